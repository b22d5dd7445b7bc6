"""Policy-gradient losses over packed micro-batches, their statistics, and group advantages.

A micro-batch is R packed rows of T tokens (all [R, T]):
  targets, segment_ids (1..k per row, 0 = padding), loss_mask (1 on completion tokens to train),
  behaviour_logprobs (log mu of the target under the sampler), advantages (per sample,
  broadcast over its tokens), optional ref_logprobs (reference model, for the KL term).
A sequence is a (row, segment id) pair. The trainer supplies logp_RxT = log pi(target) (with
gradient) and entropy_RxT.

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

from typing import Mapping

import jax
import jax.numpy as jnp

from pipelinerl_jax import config as config_lib

_BASELINES = ('mean', 'loo', 'none')


def _masked_sum(x_RxT: jax.Array, on_RxT: jax.Array) -> jax.Array:
  # `where`, not a multiply: off-mask positions may hold inf (padding) and 0 * inf = NaN.
  return jnp.sum(jnp.where(on_RxT, x_RxT, 0.0))


def policy_loss(logp_RxT: jax.Array, entropy_RxT: jax.Array, batch: Mapping[str, jax.Array],
                config: config_lib.LossConfig, *, num_samples, num_tokens
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Returns (loss scalar, stats) for one micro-batch.

  num_samples / num_tokens are totals over the whole optimizer batch (all micro-batches), so
  summing the per-micro-batch losses gives the full-batch loss exactly. They may be traced.
  stats is a flat dict of sums (keys ending in '_max': maxima) over this micro-batch.
  """
  on_RxT = batch['loss_mask'] > 0
  mask_RxT = on_RxT.astype(jnp.float32)
  adv_RxT = batch['advantages'].astype(jnp.float32)
  logp_RxT = logp_RxT.astype(jnp.float32)
  num_rows, seq_len = on_RxT.shape

  denom = num_samples if config.normalization == 'sample' else num_tokens
  denom = jnp.maximum(jnp.asarray(denom, jnp.float32), 1.0)  # an all-empty batch gives loss 0

  # Zero the log-ratio off the mask before exp, so neither value nor gradient can overflow there.
  log_ratio_RxT = jnp.where(on_RxT, logp_RxT - batch['behaviour_logprobs'], 0.0)
  ratio_RxT = jnp.exp(log_ratio_RxT)

  # Flat sequence id row * T + (segment - 1): at most T segments per row, so B*T ids suffice.
  seq_RxT = (jnp.arange(num_rows)[:, None] * seq_len
             + jnp.maximum(batch['segment_ids'] - 1, 0))
  num_seq = num_rows * seq_len
  seq_sum = lambda x_RxT: jax.ops.segment_sum(
      jnp.where(on_RxT, x_RxT, 0.0).ravel(), seq_RxT.ravel(), num_segments=num_seq)
  seq_tokens_S = seq_sum(mask_RxT)
  has_tokens_S = seq_tokens_S > 0

  low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  stats = {}
  if config.kind == 'pipelinerl':
    weight_RxT = jax.lax.stop_gradient(jnp.minimum(ratio_RxT, config.is_cap))
    pg_sum = -_masked_sum(weight_RxT * adv_RxT * logp_RxT, on_RxT)
    stats['truncated'] = _masked_sum((ratio_RxT > config.is_cap).astype(jnp.float32), on_RxT)
  elif config.kind == 'ppo':
    unclipped_RxT = ratio_RxT * adv_RxT
    clipped_RxT = jnp.clip(ratio_RxT, low, high) * adv_RxT
    pg_sum = -_masked_sum(jnp.minimum(unclipped_RxT, clipped_RxT), on_RxT)
    # The clipped branch is active (zero gradient) where it is strictly the smaller one.
    stats['clipped'] = _masked_sum((clipped_RxT < unclipped_RxT).astype(jnp.float32), on_RxT)
    stats['clip_units'] = jnp.sum(mask_RxT)
  else:  # gspo
    safe_len_S = jnp.maximum(seq_tokens_S, 1.0)
    seq_ratio_S = jnp.exp(seq_sum(log_ratio_RxT) / safe_len_S)
    seq_adv_S = seq_sum(adv_RxT) / safe_len_S  # A is constant over a sequence; this recovers it
    unclipped_S = seq_ratio_S * seq_adv_S
    clipped_S = jnp.clip(seq_ratio_S, low, high) * seq_adv_S
    term_S = -jnp.minimum(unclipped_S, clipped_S)
    # 'token' weights each sequence by its length (GSPO-token), matching the / num_tokens.
    weight_S = seq_tokens_S if config.normalization == 'token' else has_tokens_S
    pg_sum = jnp.sum(jnp.where(has_tokens_S, weight_S * term_S, 0.0))
    stats['clipped'] = jnp.sum(has_tokens_S & (clipped_S < unclipped_S)).astype(jnp.float32)
    stats['clip_units'] = jnp.sum(has_tokens_S).astype(jnp.float32)

  pg_loss = pg_sum / denom
  entropy_sum = _masked_sum(entropy_RxT.astype(jnp.float32), on_RxT)
  entropy_loss = -config.entropy_coef * entropy_sum / denom
  kl_loss = jnp.zeros((), jnp.float32)
  ref_logprobs = batch.get('ref_logprobs')
  if ref_logprobs is None and config.kl_coef > 0:
    raise ValueError(f'kl_coef={config.kl_coef} needs batch["ref_logprobs"]')
  if ref_logprobs is not None:
    # k3 = exp(d) - d - 1 with d = log ref - log pi: non-negative, unbiased for KL(pi || ref).
    # d is clamped before exp: a reference that drifted far would overflow it (and its gradient).
    clamp = config.kl_log_ratio_clamp
    ref_diff_RxT = jnp.where(on_RxT, jnp.clip(ref_logprobs - logp_RxT, -clamp, clamp), 0.0)
    kl_sum = _masked_sum(jnp.exp(ref_diff_RxT) - ref_diff_RxT - 1.0, on_RxT)
    kl_loss = config.kl_coef * kl_sum / denom
    stats['kl_sum'] = kl_sum
  loss = pg_loss + kl_loss + entropy_loss

  truncated_RxT = jnp.minimum(ratio_RxT, config.is_cap)
  stats.update(
      tokens=jnp.sum(mask_RxT),
      samples=jnp.sum(has_tokens_S).astype(jnp.float32),
      ratio_sum=_masked_sum(ratio_RxT, on_RxT),
      ratio_sq_sum=_masked_sum(ratio_RxT**2, on_RxT),
      ratio_max=jnp.max(jnp.where(on_RxT, ratio_RxT, 0.0)),  # ratios are > 0, so 0 = none
      ratio_truncated_sum=_masked_sum(truncated_RxT, on_RxT),
      ratio_truncated_sq_sum=_masked_sum(truncated_RxT**2, on_RxT),
      entropy_sum=entropy_sum,
      abs_logp_diff_sum=_masked_sum(jnp.abs(log_ratio_RxT), on_RxT),
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
      'ess_is_capped': _div(stats['ratio_truncated_sum']**2,
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
    metrics['frac_is_capped'] = _div(stats['truncated'], tokens)
  if 'clipped' in stats:
    metrics['frac_clipped'] = _div(stats['clipped'], stats['clip_units'])
  if 'kl_sum' in stats:
    metrics['kl'] = _div(stats['kl_sum'], tokens)
  return metrics


# ---------------------------------------------------------------------------------------------
# Advantages over groups of G samples of the same prompt.


def group_advantages(rewards_PxG, *, baseline: str = 'mean', normalize_std: bool = False,
                     eps: float = 1e-6) -> jax.Array:
  """Advantages [P, G] for P groups of G samples of the same prompt.

  baseline: 'mean' (R - group mean; the paper), 'loo' (R - mean of the other G-1 samples),
  'none' (R). normalize_std divides by the group's (population) std, as in GRPO.

  A group-relative baseline needs two samples: a group of one ('mean', 'loo'; masking can leave
  one sample of a group) gets advantage 0, as it carries no comparison. A group whose rewards
  are all equal has std 0: its advantages are left undivided (0 for 'mean' and 'loo'), never
  divided by ~0.
  """
  if baseline not in _BASELINES:
    raise ValueError(f'baseline={baseline!r} must be one of {_BASELINES}')
  rewards_PxG = jnp.asarray(rewards_PxG, jnp.float32)
  if rewards_PxG.ndim != 2:
    raise ValueError(f'rewards must be [P, G], got shape {rewards_PxG.shape}')
  group_size = rewards_PxG.shape[1]
  if baseline == 'mean':
    adv_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
  elif baseline == 'loo':
    others_PxG = jnp.sum(rewards_PxG, axis=1, keepdims=True) - rewards_PxG
    adv_PxG = rewards_PxG - others_PxG / max(group_size - 1, 1)
  else:
    adv_PxG = rewards_PxG
  if baseline != 'none' and group_size < 2:
    adv_PxG = jnp.zeros_like(adv_PxG)
  if normalize_std:
    std_Px1 = jnp.std(rewards_PxG, axis=1, keepdims=True)
    adv_PxG = adv_PxG / jnp.where(std_Px1 > eps, std_Px1, 1.0)
  return adv_PxG


def nonzero_groups(advantages_PxG, atol: float = 1e-8) -> jax.Array:
  """bool[N]: groups with some |advantage| > atol (all-equal rewards carry no signal)."""
  return jnp.any(jnp.abs(jnp.asarray(advantages_PxG)) > atol, axis=1)
