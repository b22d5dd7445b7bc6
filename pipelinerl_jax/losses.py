"""Policy-gradient losses over packed micro-batches, their statistics, and group advantages.

A micro-batch is B packed rows of T tokens (all [B, T]):
  targets, segment_ids (1..k per row, 0 = padding), loss_mask (1 on completion tokens to train),
  behaviour_logprobs (log mu of the target under the sampler), advantages (per sample,
  broadcast over its tokens), optional ref_logprobs (reference model, for the KL term).
A sequence is a (row, segment id) pair. The trainer supplies logp_BxT = log pi(target) (with
gradient) and entropy_BxT.

Losses are sums over this micro-batch divided by a denominator taken over the WHOLE optimizer
batch (num_samples or num_tokens), so the per-micro-batch losses add up to the full-batch loss.
Statistics are likewise sums (or maxima), combined with `combine_stats` and turned into
metrics once by `finalize_metrics`.

Loss kinds, with w = pi / mu per token (mu = behaviour policy, stale weights included):
  pipelinerl  -stopgrad(min(w, c)) * A * log pi             truncated-IS REINFORCE (paper eq. 5)
  ppo         -min(w A, clip(w, 1-low, 1+high) A)           per token
  gspo        -min(s A, clip(s, 1-low, 1+high) A)           per sequence, s = exp(mean log w)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp

_KINDS = ('pipelinerl', 'ppo', 'gspo')
_NORMALIZATIONS = ('sample', 'token')
_BASELINES = ('mean', 'loo', 'none')


@dataclasses.dataclass(frozen=True)
class LossConfig:
  kind: str = 'pipelinerl'        # 'pipelinerl' | 'ppo' | 'gspo'
  is_cap: float = 5.0             # c in min(pi/mu, c); math.inf = no truncation
  clip_eps_low: float = 0.2       # PPO/GSPO ratio clip [1-low, 1+high] (asymmetric, DAPO-style)
  clip_eps_high: float = 0.28
  normalization: str = 'sample'   # 'sample': token sum / number of sequences (paper); 'token': / tokens
  kl_coef: float = 0.0            # k3 estimator to ref_logprobs
  entropy_coef: float = 0.0       # bonus: loss -= coef * sum(entropy) / denominator

  def __post_init__(self):
    # `not (x >= 0)` style comparisons also reject NaN.
    if self.kind not in _KINDS:
      raise ValueError(f'kind={self.kind!r} must be one of {_KINDS}')
    if not self.is_cap > 0:
      raise ValueError(f'is_cap={self.is_cap} must be > 0 (math.inf disables truncation)')
    if not 0 <= self.clip_eps_low < 1:
      raise ValueError(f'clip_eps_low={self.clip_eps_low} must be in [0, 1)')
    if not 0 <= self.clip_eps_high < math.inf:
      raise ValueError(f'clip_eps_high={self.clip_eps_high} must be finite and >= 0')
    if self.normalization not in _NORMALIZATIONS:
      raise ValueError(f'normalization={self.normalization!r} must be one of {_NORMALIZATIONS}')
    if not 0 <= self.kl_coef < math.inf:
      raise ValueError(f'kl_coef={self.kl_coef} must be finite and >= 0')
    if not 0 <= self.entropy_coef < math.inf:
      raise ValueError(f'entropy_coef={self.entropy_coef} must be finite and >= 0')


def _masked_sum(x_BxT: jax.Array, on_BxT: jax.Array) -> jax.Array:
  # `where`, not a multiply: off-mask positions may hold inf (padding) and 0 * inf = NaN.
  return jnp.sum(jnp.where(on_BxT, x_BxT, 0.0))


def policy_loss(logp_BxT: jax.Array, entropy_BxT: jax.Array, batch: Mapping[str, jax.Array],
                config: LossConfig, *, num_samples, num_tokens
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Returns (loss scalar, stats) for one micro-batch.

  num_samples / num_tokens are totals over the whole optimizer batch (all micro-batches), so
  summing the per-micro-batch losses gives the full-batch loss exactly. They may be traced.
  stats is a flat dict of sums (keys ending in '_max': maxima) over this micro-batch.
  """
  on_BxT = batch['loss_mask'] > 0
  mask_BxT = on_BxT.astype(jnp.float32)
  adv_BxT = batch['advantages'].astype(jnp.float32)
  logp_BxT = logp_BxT.astype(jnp.float32)
  batch_size, seq_len = on_BxT.shape

  denom = num_samples if config.normalization == 'sample' else num_tokens
  denom = jnp.maximum(jnp.asarray(denom, jnp.float32), 1.0)  # an all-empty batch gives loss 0

  # Zero the log-ratio off the mask before exp, so neither value nor gradient can overflow there.
  log_ratio_BxT = jnp.where(on_BxT, logp_BxT - batch['behaviour_logprobs'], 0.0)
  ratio_BxT = jnp.exp(log_ratio_BxT)

  # Flat sequence id row * T + (segment - 1): at most T segments per row, so B*T ids suffice.
  seq_BxT = (jnp.arange(batch_size)[:, None] * seq_len
             + jnp.maximum(batch['segment_ids'] - 1, 0))
  num_seq = batch_size * seq_len
  seq_sum = lambda x_BxT: jax.ops.segment_sum(
      jnp.where(on_BxT, x_BxT, 0.0).ravel(), seq_BxT.ravel(), num_segments=num_seq)
  seq_tokens_S = seq_sum(mask_BxT)
  has_tokens_S = seq_tokens_S > 0

  low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  stats = {}
  if config.kind == 'pipelinerl':
    weight_BxT = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, config.is_cap))
    pg_sum = -_masked_sum(weight_BxT * adv_BxT * logp_BxT, on_BxT)
    stats['truncated'] = _masked_sum((ratio_BxT > config.is_cap).astype(jnp.float32), on_BxT)
  elif config.kind == 'ppo':
    unclipped_BxT = ratio_BxT * adv_BxT
    clipped_BxT = jnp.clip(ratio_BxT, low, high) * adv_BxT
    pg_sum = -_masked_sum(jnp.minimum(unclipped_BxT, clipped_BxT), on_BxT)
    # The clipped branch is active (zero gradient) where it is strictly the smaller one.
    stats['clipped'] = _masked_sum((clipped_BxT < unclipped_BxT).astype(jnp.float32), on_BxT)
    stats['clip_units'] = jnp.sum(mask_BxT)
  else:  # gspo
    safe_len_S = jnp.maximum(seq_tokens_S, 1.0)
    seq_ratio_S = jnp.exp(seq_sum(log_ratio_BxT) / safe_len_S)
    seq_adv_S = seq_sum(adv_BxT) / safe_len_S  # A is constant over a sequence; this recovers it
    unclipped_S = seq_ratio_S * seq_adv_S
    clipped_S = jnp.clip(seq_ratio_S, low, high) * seq_adv_S
    term_S = -jnp.minimum(unclipped_S, clipped_S)
    # 'token' weights each sequence by its length (GSPO-token), matching the / num_tokens.
    weight_S = seq_tokens_S if config.normalization == 'token' else has_tokens_S
    pg_sum = jnp.sum(jnp.where(has_tokens_S, weight_S * term_S, 0.0))
    stats['clipped'] = jnp.sum(has_tokens_S & (clipped_S < unclipped_S)).astype(jnp.float32)
    stats['clip_units'] = jnp.sum(has_tokens_S).astype(jnp.float32)

  pg_loss = pg_sum / denom
  entropy_sum = _masked_sum(entropy_BxT.astype(jnp.float32), on_BxT)
  entropy_loss = -config.entropy_coef * entropy_sum / denom
  kl_loss = jnp.zeros((), jnp.float32)
  ref_logprobs = batch.get('ref_logprobs')
  if ref_logprobs is None and config.kl_coef > 0:
    raise ValueError(f'kl_coef={config.kl_coef} needs batch["ref_logprobs"]')
  if ref_logprobs is not None:
    # k3 = exp(d) - d - 1 with d = log ref - log pi: non-negative, unbiased for KL(pi || ref).
    ref_diff_BxT = jnp.where(on_BxT, ref_logprobs - logp_BxT, 0.0)
    kl_sum = _masked_sum(jnp.exp(ref_diff_BxT) - ref_diff_BxT - 1.0, on_BxT)
    kl_loss = config.kl_coef * kl_sum / denom
    stats['kl_sum'] = kl_sum
  loss = pg_loss + kl_loss + entropy_loss

  truncated_BxT = jnp.minimum(ratio_BxT, config.is_cap)
  stats.update(
      tokens=jnp.sum(mask_BxT),
      samples=jnp.sum(has_tokens_S).astype(jnp.float32),
      ratio_sum=_masked_sum(ratio_BxT, on_BxT),
      ratio_sq_sum=_masked_sum(ratio_BxT**2, on_BxT),
      ratio_max=jnp.max(jnp.where(on_BxT, ratio_BxT, 0.0)),  # ratios are > 0, so 0 = none
      ratio_truncated_sum=_masked_sum(truncated_BxT, on_BxT),
      ratio_truncated_sq_sum=_masked_sum(truncated_BxT**2, on_BxT),
      entropy_sum=entropy_sum,
      abs_logp_diff_sum=_masked_sum(jnp.abs(log_ratio_BxT), on_BxT),
      pg_loss=pg_loss,
      kl_loss=kl_loss,
      entropy_loss=entropy_loss,
      loss=loss,
  )
  return loss, jax.lax.stop_gradient(stats)


def combine_stats(a: dict, b: dict) -> dict:
  """Merges two micro-batches' stats: sums add, keys ending with '_max' take the max."""
  if a.keys() != b.keys():
    raise ValueError(f'stats keys differ: {sorted(a.keys() ^ b.keys())}')
  return {k: jnp.maximum(a[k], b[k]) if k.endswith('_max') else a[k] + b[k] for k in a}


def _div(num, den):
  # 0 when there is nothing to average (an empty micro-batch), never NaN.
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def finalize_metrics(stats: dict) -> dict[str, jax.Array]:
  """Turns summed stats into metrics. Means over no tokens (and their ESS) read 0."""
  tokens = stats['tokens']
  metrics = {
      # Normalized effective sample size (paper eq. 6): (sum w)^2 / (N sum w^2), 1 on-policy.
      'ess': _div(stats['ratio_sum']**2, tokens * stats['ratio_sq_sum']),
      'ess_truncated': _div(stats['ratio_truncated_sum']**2,
                            tokens * stats['ratio_truncated_sq_sum']),
      'ratio_mean': _div(stats['ratio_sum'], tokens),
      'ratio_max': stats['ratio_max'],
      'entropy': _div(stats['entropy_sum'], tokens),
      'abs_logp_diff': _div(stats['abs_logp_diff_sum'], tokens),
      'tokens': tokens,
      'samples': stats['samples'],
      'pg_loss': stats['pg_loss'],
      'kl_loss': stats['kl_loss'],
      'entropy_loss': stats['entropy_loss'],
      'loss': stats['loss'],
  }
  if 'truncated' in stats:
    metrics['frac_truncated'] = _div(stats['truncated'], tokens)
  if 'clipped' in stats:
    metrics['frac_clipped'] = _div(stats['clipped'], stats['clip_units'])
  if 'kl_sum' in stats:
    metrics['kl'] = _div(stats['kl_sum'], tokens)
  return metrics


# ---------------------------------------------------------------------------------------------
# Advantages over groups of G samples of the same prompt.


def group_advantages(rewards_NxG, *, baseline: str = 'mean', normalize_std: bool = False,
                     eps: float = 1e-6) -> jax.Array:
  """Advantages [N, G] for N groups of G samples of the same prompt.

  baseline: 'mean' (R - group mean; the paper), 'loo' (R - mean of the other G-1 samples,
  0 baseline when G = 1), 'none' (R). normalize_std divides by the group's (population)
  std + eps, as in GRPO.
  """
  if baseline not in _BASELINES:
    raise ValueError(f'baseline={baseline!r} must be one of {_BASELINES}')
  rewards_NxG = jnp.asarray(rewards_NxG, jnp.float32)
  if rewards_NxG.ndim != 2:
    raise ValueError(f'rewards must be [N, G], got shape {rewards_NxG.shape}')
  group_size = rewards_NxG.shape[1]
  if baseline == 'mean':
    adv_NxG = rewards_NxG - jnp.mean(rewards_NxG, axis=1, keepdims=True)
  elif baseline == 'loo':
    others_NxG = jnp.sum(rewards_NxG, axis=1, keepdims=True) - rewards_NxG
    adv_NxG = rewards_NxG - others_NxG / max(group_size - 1, 1)  # G = 1: others sum to 0
  else:
    adv_NxG = rewards_NxG
  if normalize_std:
    adv_NxG = adv_NxG / (jnp.std(rewards_NxG, axis=1, keepdims=True) + eps)
  return adv_NxG


def nonzero_groups(advantages_NxG, atol: float = 1e-8) -> jax.Array:
  """bool[N]: groups with some |advantage| > atol (all-equal rewards carry no signal)."""
  return jnp.any(jnp.abs(jnp.asarray(advantages_NxG)) > atol, axis=1)
