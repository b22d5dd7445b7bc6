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


# Sort-free filtering (see `filter_logits`): rows keep at most CANDIDATES tokens by threshold,
# tried at these distances (nats) below the row's largest logit; the last one takes every token.
CANDIDATES = 256
THRESHOLD_GAPS = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0,
                  float('inf'))


def filter_logits(logits_RxV: jax.Array, top_k: Scalar = 0, top_p: Scalar = 1.0) -> jax.Array:
  """Sets every token outside the top-k / top-p set to -inf (top-p is taken over the top-k
  renormalized distribution, as in HF and vLLM). The most likely token is always kept; ties
  are broken by lower token id, so the kept set is exactly k tokens.

  A static top_k > 0 ranks only k candidates (`lax.top_k`). Otherwise nothing sorts the whole
  vocab unless it must: each row takes the tokens within a gap of its largest logit, the smallest
  gap (THRESHOLD_GAPS) whose set holds the kept set for sure (>= k tokens, or >= top_p of the
  mass) and has at most CANDIDATES tokens; only those are sorted. The kept set is the same as a
  full sort's. A batch with a row no gap serves (a flat distribution under top-p, or top_k >
  CANDIDATES) sorts the whole vocab.
  """
  b, v = logits_RxV.shape
  if isinstance(top_k, int) and top_k > 0:
    vals_RxC, idx_RxC = jax.lax.top_k(logits_RxV, min(top_k, v))
    return _keep_ranked(logits_RxV, vals_RxC, idx_RxC, jnp.full((b,), top_k), top_p,
                        jnp.ones(vals_RxC.shape, bool))
  k_R = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
  p_R = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
  c = min(CANDIDATES, v)
  max_R = jnp.max(logits_RxV, axis=-1)
  gaps_G = jnp.asarray(THRESHOLD_GAPS, jnp.float32)
  gap_R, served, total_R = candidate_gaps(logits_RxV, k_R, p_R)
  unfiltered_R = (k_R <= 0) & (p_R >= 1.0)

  def from_candidates(_):
    # The tokens within the row's gap, in token order, packed into C columns (id V: none).
    inside_RxV = logits_RxV >= (max_R - gaps_G[gap_R])[:, None]
    column_RxV = jnp.where(inside_RxV, jnp.cumsum(inside_RxV, axis=-1) - 1, c)
    rows = jnp.arange(b)[:, None]
    idx_RxC = jnp.full((b, c), v, jnp.int32).at[rows, column_RxV].set(
        jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, v)), mode='drop')
    vals_RxC = jnp.where(idx_RxC < v, jnp.take_along_axis(logits_RxV, jnp.minimum(idx_RxC, v - 1),
                                                           axis=-1), -jnp.inf)
    order_RxC = jnp.argsort(-vals_RxC, axis=-1, stable=True)  # ties: lower id first
    vals_RxC = jnp.take_along_axis(vals_RxC, order_RxC, axis=-1)
    idx_RxC = jnp.take_along_axis(idx_RxC, order_RxC, axis=-1)
    # Without top-k, top-p is over the whole distribution: the candidates' mass is not 1.
    full_probs_RxC = jnp.exp(vals_RxC - max_R[:, None]) / total_R[:, None]
    kept = _keep_ranked(logits_RxV, vals_RxC, idx_RxC, k_R, p_R, idx_RxC < v, full_probs_RxC)
    return jnp.where(unfiltered_R[:, None], logits_RxV, kept)

  def from_full_sort(_):
    idx_RxV = jnp.argsort(-logits_RxV, axis=-1, stable=True)
    vals_RxV = jnp.take_along_axis(logits_RxV, idx_RxV, axis=-1)
    return _keep_ranked(logits_RxV, vals_RxV, idx_RxV, k_R, p_R, jnp.ones((b, v), bool))

  return jax.lax.cond(served, from_candidates, from_full_sort, None)


def candidate_gaps(logits_RxV: jax.Array, k_R: jax.Array, p_R: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(index into THRESHOLD_GAPS of each row's smallest serving gap, whether every filtered row
  has one, each row's sum of exp(logit - max)): one pass over the vocab for all gaps."""
  v = logits_RxV.shape[1]
  max_R = jnp.max(logits_RxV, axis=-1)
  w_RxV = jnp.exp(logits_RxV - max_R[:, None])  # unnormalized probabilities
  total_R = jnp.sum(w_RxV, axis=-1)
  gaps_G = jnp.asarray(THRESHOLD_GAPS, jnp.float32)
  within_RxVxG = logits_RxV[:, :, None] >= (max_R[:, None] - gaps_G[None, :])[:, None, :]
  count_RxG = jnp.sum(within_RxVxG, axis=1)
  mass_RxG = jnp.sum(jnp.where(within_RxVxG, w_RxV[:, :, None], 0.0), axis=1) / total_R[:, None]
  holds_RxG = jnp.where(k_R[:, None] > 0, count_RxG >= jnp.minimum(k_R, v)[:, None],
                        mass_RxG >= p_R[:, None])
  fits_RxG = holds_RxG & (count_RxG <= min(CANDIDATES, v))
  unfiltered_R = (k_R <= 0) & (p_R >= 1.0)
  served = jnp.all(unfiltered_R | jnp.any(fits_RxG, axis=-1))
  return jnp.argmax(fits_RxG, axis=-1), served, total_R


def _keep_ranked(logits_RxV, vals_RxC, idx_RxC, k_R, top_p, real_RxC, full_probs_RxC=None):
  """logits_RxV with only the kept tokens among C ranked candidates (descending; `real_RxC`
  False for padding): rank < k (k <= 0: all), then the nucleus of top_p. `full_probs_RxC`: the
  candidates' probabilities under the whole distribution, for rows without top-k (None: the
  candidates are the whole vocab, or every row has top-k)."""
  b, c = vals_RxC.shape
  rank_C = jnp.arange(c)
  rank_keep_RxC = real_RxC & ((k_R[:, None] <= 0) | (rank_C[None, :] < k_R[:, None]))
  p_R = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
  probs_RxC = jax.nn.softmax(jnp.where(rank_keep_RxC, vals_RxC, -jnp.inf), axis=-1)
  if full_probs_RxC is not None:
    probs_RxC = jnp.where(k_R[:, None] > 0, probs_RxC, full_probs_RxC)
  mass_before_RxC = jnp.cumsum(probs_RxC, axis=-1) - probs_RxC
  # p >= 1 is an explicit "off": the rounded cumsum can reach 1.0 before the tail ends.
  nucleus_RxC = (p_R[:, None] >= 1.0) | (mass_before_RxC < p_R[:, None])
  keep_RxC = rank_keep_RxC & nucleus_RxC
  keep_RxC = keep_RxC.at[:, 0].set(True)

  rows = jnp.arange(b)[:, None]
  kept_RxC = jnp.where(keep_RxC, vals_RxC, -jnp.inf)
  return jnp.full_like(logits_RxV, -jnp.inf).at[rows, idx_RxC].set(kept_RxC, mode='drop')


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
  # What each row's log-prob is taken under: the drawn distribution; for greedy rows the plain
  # softmax, which `scaled` already is unless filtering changed it.
  measured_RxV = scaled_RxV
  if not is_off(top_k, top_p):
    scaled_RxV = filter_logits(scaled_RxV, top_k, top_p)
    measured_RxV = jnp.where(greedy_R[:, None], logits_RxV, scaled_RxV)

  drawn_R = jax.vmap(jax.random.categorical)(row_keys(rng, b), scaled_RxV)
  tokens_R = jnp.where(greedy_R, jnp.argmax(logits_RxV, axis=-1), drawn_R).astype(jnp.int32)
  # One reduction over the vocab instead of a whole log-softmax.
  logprobs_R = (jnp.take_along_axis(measured_RxV, tokens_R[:, None], axis=-1)[:, 0]
                - jax.nn.logsumexp(measured_RxV, axis=-1))
  return tokens_R, logprobs_R
