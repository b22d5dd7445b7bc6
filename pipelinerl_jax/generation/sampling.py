"""Sampling rules: temperature, then top-k, then top-p, then a categorical draw.

`sample` returns each chosen token with log mu, its log-prob under the exact distribution it was
drawn from (after temperature and after top-k / top-p renormalization). That is the behaviour
policy of PipelineRL's importance weight pi / mu, so it must describe the real draw, not the
model's unfiltered distribution.

Each rule takes a Python scalar (static: an "off" value costs nothing) or a [B] array (one value
per row, what the engine passes since every slot holds a different request):
  temperature  0 = greedy
  top_k        0 = off
  top_p        1.0 = off
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

Scalar = Union[int, float, jax.Array]


def is_off(top_k: Scalar, top_p: Scalar) -> bool:
  """True when both filters are statically off, so `sample` can skip the sort entirely."""
  return (isinstance(top_k, int) and top_k == 0 and
          isinstance(top_p, (int, float)) and top_p >= 1.0)


def row_keys(rng: jax.Array, batch_size: int) -> jax.Array:
  """Accepts one key (split into one per row) or a batch of keys [B] (raw or typed)."""
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  batched = rng.ndim == (1 if typed else 2)
  return rng if batched else jax.random.split(rng, batch_size)


def filter_logits(logits_BxV: jax.Array, top_k: Scalar = 0, top_p: Scalar = 1.0) -> jax.Array:
  """Sets every token outside the top-k / top-p set to -inf (top-p is taken over the top-k
  renormalized distribution, as in HF and vLLM). The most likely token is always kept; ties
  are broken by lower token id, so the kept set is exactly k tokens.

  A static top_k > 0 ranks only k candidates (`lax.top_k`); otherwise the whole vocab is sorted.
  """
  b, v = logits_BxV.shape
  if isinstance(top_k, int) and top_k > 0:
    vals_BxC, idx_BxC = jax.lax.top_k(logits_BxV, min(top_k, v))
    rank_keep_BxC = jnp.ones(vals_BxC.shape, bool)
  else:
    idx_BxC = jnp.argsort(-logits_BxV, axis=-1, stable=True)
    vals_BxC = jnp.take_along_axis(logits_BxV, idx_BxC, axis=-1)
    k_B = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
    rank_C = jnp.arange(v)
    rank_keep_BxC = (k_B[:, None] <= 0) | (rank_C[None, :] < k_B[:, None])

  p_B = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
  probs_BxC = jax.nn.softmax(jnp.where(rank_keep_BxC, vals_BxC, -jnp.inf), axis=-1)
  mass_before_BxC = jnp.cumsum(probs_BxC, axis=-1) - probs_BxC
  # p >= 1 is an explicit "off": the rounded cumsum can reach 1.0 before the tail ends.
  nucleus_BxC = (p_B[:, None] >= 1.0) | (mass_before_BxC < p_B[:, None])
  keep_BxC = rank_keep_BxC & nucleus_BxC
  keep_BxC = keep_BxC.at[:, 0].set(True)

  rows = jnp.arange(b)[:, None]
  kept_BxC = jnp.where(keep_BxC, vals_BxC, -jnp.inf)
  return jnp.full_like(logits_BxV, -jnp.inf).at[rows, idx_BxC].set(kept_BxC)


def sample(rng: jax.Array, logits_BxV: jax.Array, temperature: Scalar = 1.0, top_k: Scalar = 0,
           top_p: Scalar = 1.0) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row: returns (tokens [B] int32, log mu [B] fp32).

  rng is one key or a key per row; per-row keys make a row's draw independent of the batch it
  sits in. Rows with temperature <= 0 are greedy: the token is the argmax, and its log-prob is
  reported under the plain temperature-1 softmax with no filtering (a greedy "policy" is a point
  mass; the temperature-1 value is the useful number for evaluation and logging).
  """
  b, _ = logits_BxV.shape
  logits_BxV = logits_BxV.astype(jnp.float32)
  temperature_B = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
  greedy_B = temperature_B <= 0.0
  scaled_BxV = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
  if not is_off(top_k, top_p):
    scaled_BxV = filter_logits(scaled_BxV, top_k, top_p)

  drawn_B = jax.vmap(jax.random.categorical)(row_keys(rng, b), scaled_BxV)
  tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1), drawn_B).astype(jnp.int32)
  logp_BxV = jnp.where(greedy_B[:, None], jax.nn.log_softmax(logits_BxV, axis=-1),
                       jax.nn.log_softmax(scaled_BxV, axis=-1))
  logprobs_B = jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, logprobs_B
