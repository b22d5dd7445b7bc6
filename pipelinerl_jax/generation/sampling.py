"""Sampling rules: temperature, then top-k, then top-p, then a categorical draw.

`sample` returns each chosen token with log mu, its log-prob under the exact distribution it was
drawn from (after temperature and after top-k / top-p renormalization). That is the behaviour
policy of PipelineRL's importance weight pi / mu, so it must describe the real draw, not the
model's unfiltered distribution.

Each rule takes a Python scalar (static: an "off" value costs nothing) or a [R] array (one value
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
  """Accepts one key (split into one per row) or a batch of keys [R] (raw or typed)."""
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  batched = rng.ndim == (1 if typed else 2)
  return rng if batched else jax.random.split(rng, batch_size)


def filter_logits(logits_RxV: jax.Array, top_k: Scalar = 0, top_p: Scalar = 1.0) -> jax.Array:
  """Sets every token outside the top-k / top-p set to -inf (top-p is taken over the top-k
  renormalized distribution, as in HF and vLLM). The most likely token is always kept; ties
  are broken by lower token id, so the kept set is exactly k tokens.

  A static top_k > 0 ranks only k candidates (`lax.top_k`); otherwise the whole vocab is sorted.
  """
  b, v = logits_RxV.shape
  if isinstance(top_k, int) and top_k > 0:
    vals_RxC, idx_RxC = jax.lax.top_k(logits_RxV, min(top_k, v))
    rank_keep_RxC = jnp.ones(vals_RxC.shape, bool)
  else:
    idx_RxC = jnp.argsort(-logits_RxV, axis=-1, stable=True)
    vals_RxC = jnp.take_along_axis(logits_RxV, idx_RxC, axis=-1)
    k_R = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
    rank_C = jnp.arange(v)
    rank_keep_RxC = (k_R[:, None] <= 0) | (rank_C[None, :] < k_R[:, None])

  p_R = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
  probs_RxC = jax.nn.softmax(jnp.where(rank_keep_RxC, vals_RxC, -jnp.inf), axis=-1)
  mass_before_RxC = jnp.cumsum(probs_RxC, axis=-1) - probs_RxC
  # p >= 1 is an explicit "off": the rounded cumsum can reach 1.0 before the tail ends.
  nucleus_RxC = (p_R[:, None] >= 1.0) | (mass_before_RxC < p_R[:, None])
  keep_RxC = rank_keep_RxC & nucleus_RxC
  keep_RxC = keep_RxC.at[:, 0].set(True)

  rows = jnp.arange(b)[:, None]
  kept_RxC = jnp.where(keep_RxC, vals_RxC, -jnp.inf)
  return jnp.full_like(logits_RxV, -jnp.inf).at[rows, idx_RxC].set(kept_RxC)


def sample(rng: jax.Array, logits_RxV: jax.Array, temperature: Scalar = 1.0, top_k: Scalar = 0,
           top_p: Scalar = 1.0) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row: returns (tokens [R] int32, log mu [R] fp32).

  rng is one key or a key per row; per-row keys make a row's draw independent of the batch it
  sits in. Rows with temperature <= 0 are greedy: the token is the argmax, and its log-prob is
  reported under the plain temperature-1 softmax with no filtering (a greedy "policy" is a point
  mass; the temperature-1 value is the useful number for evaluation and logging).
  """
  b, _ = logits_RxV.shape
  logits_RxV = logits_RxV.astype(jnp.float32)
  temperature_R = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
  greedy_R = temperature_R <= 0.0
  scaled_RxV = logits_RxV / jnp.where(greedy_R, 1.0, temperature_R)[:, None]
  if not is_off(top_k, top_p):
    scaled_RxV = filter_logits(scaled_RxV, top_k, top_p)

  drawn_R = jax.vmap(jax.random.categorical)(row_keys(rng, b), scaled_RxV)
  tokens_R = jnp.where(greedy_R, jnp.argmax(logits_RxV, axis=-1), drawn_R).astype(jnp.int32)
  logp_RxV = jnp.where(greedy_R[:, None], jax.nn.log_softmax(logits_RxV, axis=-1),
                       jax.nn.log_softmax(scaled_RxV, axis=-1))
  logprobs_R = jnp.take_along_axis(logp_RxV, tokens_R[:, None], axis=-1)[:, 0]
  return tokens_R, logprobs_R
