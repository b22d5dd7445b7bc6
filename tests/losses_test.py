"""Losses and metrics vs. independent NumPy loops over tokens / sequences, on packed rows."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import losses

CAP = 5.0
LOW, HIGH = 0.2, 0.28
KL_COEF, ENT_COEF = 0.1, 0.01

# (row, first, end, first completion token): segments packed into 3 rows of 10 tokens.
_SEGMENTS = [(0, 0, 5, 2), (0, 5, 9, 6),                # row 0: two samples, one pad token
             (1, 0, 10, 3),                             # row 1: one sample, no padding
             (2, 0, 4, 1), (2, 4, 7, 5), (2, 7, 8, 8)]  # row 2: last segment has no loss tokens
B, T = 3, 10


def _make_batch(seed=0, noise=0.4):
  """Returns (logp, entropy, batch) as numpy; off-mask logp holds values that would overflow."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  adv = np.zeros((B, T), np.float32)
  next_id = np.ones(B, np.int32)
  for row, start, end, comp in _SEGMENTS:
    seg[row, start:end] = next_id[row]
    next_id[row] += 1
    mask[row, comp:end] = 1
    adv[row, start:end] = rng.normal()
  on = mask > 0
  logp = np.where(on, rng.uniform(-3, -0.05, (B, T)), 100.0).astype(np.float32)
  logp[2, 9] = -np.inf  # padding may even be -inf
  behaviour = np.where(on, logp + noise * rng.normal(size=(B, T)), 0).astype(np.float32)
  ref = np.where(on, logp + 0.3 * rng.normal(size=(B, T)), 0).astype(np.float32)
  entropy = np.where(on, rng.uniform(0, 3, (B, T)), np.nan).astype(np.float32)
  batch = dict(targets=np.zeros((B, T), np.int32), segment_ids=seg, loss_mask=mask,
               behaviour_logprobs=behaviour, advantages=adv, ref_logprobs=ref)
  return logp, entropy, batch


def _sequences(batch):
  """{(row, segment): [token index, ...]} over loss tokens."""
  seqs = {}
  for b in range(batch['loss_mask'].shape[0]):
    for t in range(batch['loss_mask'].shape[1]):
      if batch['loss_mask'][b, t] > 0:
        seqs.setdefault((b, int(batch['segment_ids'][b, t])), []).append(t)
  return seqs


def _totals(batch):
  return len(_sequences(batch)), int(batch['loss_mask'].sum())


def _np_loss_and_grads(logp, entropy, batch, config, num_samples, num_tokens):
  """Reference: (loss, dloss/dlogp, dloss/dentropy, number clipped or truncated), by loops."""
  logp = logp.astype(np.float64)
  denom = num_samples if config.normalization == 'sample' else num_tokens
  loss, g_logp, g_ent, n_clip = 0.0, np.zeros(logp.shape), np.zeros(logp.shape), 0
  lo, hi = 1 - config.clip_eps_low, 1 + config.clip_eps_high
  for (b, _), ts in _sequences(batch).items():
    a = float(batch['advantages'][b, ts[0]])
    if config.kind == 'gspo':
      s = math.exp(np.mean([logp[b, t] - batch['behaviour_logprobs'][b, t] for t in ts]))
      weight = len(ts) if config.normalization == 'token' else 1
      clipped = (a > 0 and s > hi) or (a < 0 and s < lo)
      n_clip += clipped
      loss -= weight * min(s * a, min(max(s, lo), hi) * a) / denom
      for t in ts:
        g_logp[b, t] = 0.0 if clipped else -weight * a * s / len(ts) / denom
    for t in ts:
      w = math.exp(logp[b, t] - batch['behaviour_logprobs'][b, t])
      if config.kind == 'pipelinerl':
        loss -= min(w, config.is_cap) * a * logp[b, t] / denom
        g_logp[b, t] = -min(w, config.is_cap) * a / denom
        n_clip += w > config.is_cap
      elif config.kind == 'ppo':
        clipped = (a > 0 and w > hi) or (a < 0 and w < lo)
        n_clip += clipped
        loss -= min(w * a, min(max(w, lo), hi) * a) / denom
        g_logp[b, t] = 0.0 if clipped else -a * w / denom
      d = batch['ref_logprobs'][b, t] - logp[b, t]
      loss += config.kl_coef * (math.exp(d) - d - 1) / denom
      g_logp[b, t] += config.kl_coef * (1 - math.exp(d)) / denom
      loss -= config.entropy_coef * entropy[b, t] / denom
      g_ent[b, t] = -config.entropy_coef / denom
  return loss, g_logp, g_ent, n_clip


def _loss_and_grads(logp, entropy, batch, config, num_samples, num_tokens):
  def f(lp, ent):
    return losses.policy_loss(lp, ent, batch, config, num_samples=num_samples,
                              num_tokens=num_tokens)
  (loss, stats), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      jnp.asarray(logp), jnp.asarray(entropy))
  return loss, stats, grads


@pytest.mark.parametrize('normalization', ['sample', 'token'])
@pytest.mark.parametrize('kind', ['pipelinerl', 'ppo', 'gspo'])
def test_loss_and_gradients_match_numpy(kind, normalization):
  logp, entropy, batch = _make_batch()
  config = config_lib.LossConfig(kind=kind, normalization=normalization, is_cap=CAP,
                             kl_coef=KL_COEF, entropy_coef=ENT_COEF)
  num_samples, num_tokens = _totals(batch)
  assert num_samples == 5  # the prompt-only segment is not a sample
  loss, stats, (g_logp, g_ent) = _loss_and_grads(logp, entropy, batch, config,
                                                 num_samples, num_tokens)
  want_loss, want_g_logp, want_g_ent, n_clip = _np_loss_and_grads(
      logp, entropy, batch, config, num_samples, num_tokens)
  if kind != 'pipelinerl':  # the fixture exercises both branches of the clip
    n_units = num_samples if kind == 'gspo' else num_tokens
    assert 0 < n_clip < n_units
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_logp, want_g_logp, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g_ent, want_g_ent, rtol=1e-5, atol=1e-7)
  metrics = losses.finalize_metrics(stats)
  np.testing.assert_allclose(metrics['loss'], want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      metrics['pg_loss'] + metrics['kl_loss'] + metrics['entropy_loss'], loss, rtol=1e-5)
  frac_key = 'frac_is_capped' if kind == 'pipelinerl' else 'frac_clipped'
  n_units = num_samples if kind == 'gspo' else num_tokens
  np.testing.assert_allclose(metrics[frac_key], n_clip / n_units, rtol=1e-6)


def test_gspo_gives_every_token_of_a_sequence_the_same_gradient():
  logp, entropy, batch = _make_batch(seed=1)
  config = config_lib.LossConfig(kind='gspo')
  _, _, (g_logp, _) = _loss_and_grads(logp, entropy, batch, config, *_totals(batch))
  g_logp = np.asarray(g_logp)
  assert np.any(g_logp != 0)
  for (b, _), ts in _sequences(batch).items():
    np.testing.assert_allclose(g_logp[b, ts], g_logp[b, ts[0]], rtol=1e-6)


def test_gspo_row_packed_with_one_token_samples():
  # The last row holds T one-token samples (segment ids 1..T): every sequence id must fit.
  rng = np.random.default_rng(2)
  logp = rng.uniform(-3, -0.1, (2, 4)).astype(np.float32)
  batch = dict(segment_ids=np.array([[1, 1, 1, 0], [1, 2, 3, 4]], np.int32),
               loss_mask=np.array([[0, 1, 1, 0], [1, 1, 1, 1]], np.float32),
               behaviour_logprobs=(logp + 0.1 * rng.normal(size=(2, 4))).astype(np.float32),
               advantages=np.array([[0.5] * 4, [1.0, -2.0, 0.7, -0.3]], np.float32),
               ref_logprobs=logp)
  batch['behaviour_logprobs'][0, 3] = 0
  config = config_lib.LossConfig(kind='gspo', normalization='token')
  _, stats, (g_logp, _) = _loss_and_grads(logp, np.zeros_like(logp), batch, config, 5, 6)
  _, want_g_logp, _, _ = _np_loss_and_grads(logp, np.zeros_like(logp), batch, config, 5, 6)
  np.testing.assert_allclose(g_logp, want_g_logp, rtol=1e-5, atol=1e-7)
  assert losses.finalize_metrics(stats)['samples'] == 5


def test_on_policy_metrics_are_exact():
  logp, entropy, batch = _make_batch()
  batch['behaviour_logprobs'] = np.where(batch['loss_mask'] > 0, logp, 0).astype(np.float32)
  _, stats, _ = _loss_and_grads(logp, entropy, batch, config_lib.LossConfig(), *_totals(batch))
  m = losses.finalize_metrics(stats)
  for key in ('ess', 'ess_is_capped', 'ratio_mean', 'ratio_max'):
    np.testing.assert_allclose(m[key], 1.0, rtol=1e-6)
  assert m['abs_logp_diff'] == 0 and m['frac_is_capped'] == 0


def test_off_policy_metrics_match_numpy():
  logp, entropy, batch = _make_batch(noise=1.0)
  on = batch['loss_mask'] > 0
  batch['behaviour_logprobs'][0, 3] = logp[0, 3] - 4.0  # w = e^4 > CAP
  _, stats, _ = _loss_and_grads(logp, entropy, batch, config_lib.LossConfig(is_cap=CAP),
                                *_totals(batch))
  m = losses.finalize_metrics(stats)
  w = np.exp(logp[on].astype(np.float64) - batch['behaviour_logprobs'][on])
  wc = np.minimum(w, CAP)
  n = w.size
  d = batch['ref_logprobs'][on] - logp[on].astype(np.float64)
  want = {
      'ess': w.sum()**2 / (n * (w**2).sum()),
      'ess_is_capped': wc.sum()**2 / (n * (wc**2).sum()),
      'ratio_mean': w.mean(), 'ratio_max': w.max(), 'frac_is_capped': np.mean(w > CAP),
      'entropy': entropy[on].mean(), 'kl': np.mean(np.exp(d) - d - 1),
      'abs_logp_diff': np.mean(np.abs(np.log(w))), 'tokens': n, 'samples': 5,
  }
  assert want['ess'] < want['ess_is_capped'] < 1 and want['frac_is_capped'] > 0
  for key, value in want.items():
    np.testing.assert_allclose(m[key], value, rtol=1e-5, err_msg=key)


@pytest.mark.parametrize('cap', [CAP, math.inf])
def test_truncation_caps_the_gradient_weight(cap):
  logp, entropy, batch = _make_batch()
  batch['behaviour_logprobs'][1, 5] = logp[1, 5] - 6.0  # w = e^6 ~ 403
  num_samples, num_tokens = _totals(batch)
  config = config_lib.LossConfig(is_cap=cap)
  _, _, (g_logp, _) = _loss_and_grads(logp, entropy, batch, config, num_samples, num_tokens)
  a = batch['advantages'][1, 5]
  weight = min(math.exp(6.0), cap)
  np.testing.assert_allclose(g_logp[1, 5], -weight * a / num_samples, rtol=1e-5)


@pytest.mark.parametrize('normalization', ['sample', 'token'])
@pytest.mark.parametrize('kind', ['pipelinerl', 'ppo', 'gspo'])
def test_micro_batches_sum_to_the_full_batch(kind, normalization):
  logp, entropy, batch = _make_batch()
  config = config_lib.LossConfig(kind=kind, normalization=normalization, kl_coef=KL_COEF,
                             entropy_coef=ENT_COEF)
  totals = _totals(batch)
  full_loss, full_stats, _ = _loss_and_grads(logp, entropy, batch, config, *totals)
  halves = [slice(0, 1), slice(1, 3)]
  parts = [_loss_and_grads(logp[s], entropy[s], {k: v[s] for k, v in batch.items()}, config,
                           *totals) for s in halves]
  np.testing.assert_allclose(parts[0][0] + parts[1][0], full_loss, rtol=1e-5)
  combined = losses.finalize_metrics(losses.combine_stats(parts[0][1], parts[1][1]))
  full = losses.finalize_metrics(full_stats)
  assert combined.keys() == full.keys()
  for key in full:
    np.testing.assert_allclose(combined[key], full[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_ppo_clip_is_asymmetric():
  # One row, six one-token samples: (ratio, advantage) around the clip range [0.8, 1.28].
  ratios = np.array([1.3, 1.25, 0.75, 0.85, 0.5, 1.5])
  adv = np.array([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], np.float32)
  logp = np.full((1, 6), -1.0, np.float32)
  batch = dict(segment_ids=np.arange(1, 7, dtype=np.int32)[None], loss_mask=np.ones((1, 6)),
               behaviour_logprobs=(logp - np.log(ratios)).astype(np.float32), advantages=adv[None])
  config = config_lib.LossConfig(kind='ppo', clip_eps_low=0.2, clip_eps_high=0.28)
  _, stats, (g_logp, _) = _loss_and_grads(logp, np.zeros_like(logp), batch, config, 6, 6)
  # Beyond 1+high with A > 0 and below 1-low with A < 0: clipped, no gradient.
  # The pessimistic min keeps the gradient on the other side (0.5 with A > 0, 1.5 with A < 0).
  np.testing.assert_array_equal(np.asarray(g_logp[0]) == 0, [1, 0, 1, 0, 0, 0])
  np.testing.assert_allclose(g_logp[0, [1, 3, 4, 5]], -adv[[1, 3, 4, 5]] * ratios[[1, 3, 4, 5]] / 6,
                             rtol=1e-5)
  np.testing.assert_allclose(losses.finalize_metrics(stats)['frac_clipped'], 2 / 6)


@pytest.mark.parametrize('kind', ['pipelinerl', 'ppo', 'gspo'])
def test_micro_batch_without_loss_tokens_is_finite(kind):
  logp, entropy, batch = _make_batch()
  batch['loss_mask'] = np.zeros_like(batch['loss_mask'])
  config = config_lib.LossConfig(kind=kind, kl_coef=KL_COEF, entropy_coef=ENT_COEF)
  loss, stats, (g_logp, g_ent) = _loss_and_grads(logp, entropy, batch, config, 0, 0)
  assert loss == 0
  assert not np.any(g_logp) and not np.any(g_ent)
  metrics = losses.finalize_metrics(stats)
  for key, value in metrics.items():
    assert np.isfinite(value), key
  assert metrics['tokens'] == 0 and metrics['samples'] == 0


def test_jit_with_traced_totals_matches_eager():
  logp, entropy, batch = _make_batch()
  config = config_lib.LossConfig(kind='gspo', normalization='token')
  num_samples, num_tokens = _totals(batch)
  jitted = jax.jit(losses.policy_loss, static_argnames='config')
  loss, stats = jitted(logp, entropy, batch, config, num_samples=jnp.int32(num_samples),
                       num_tokens=jnp.int32(num_tokens))
  want, want_stats = losses.policy_loss(logp, entropy, batch, config, num_samples=num_samples,
                                        num_tokens=num_tokens)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  for key in want_stats:
    np.testing.assert_allclose(stats[key], want_stats[key], rtol=1e-6, err_msg=key)


def test_kl_coef_needs_ref_logprobs():
  logp, entropy, batch = _make_batch()
  del batch['ref_logprobs']
  with pytest.raises(ValueError, match='ref_logprobs'):
    losses.policy_loss(logp, entropy, batch, config_lib.LossConfig(kl_coef=0.1), num_samples=5,
                       num_tokens=20)
  _, stats = losses.policy_loss(logp, entropy, batch, config_lib.LossConfig(), num_samples=5,
                                num_tokens=20)
  assert 'kl' not in losses.finalize_metrics(stats)


def test_combine_stats_sums_and_maxes():
  a = {'tokens': jnp.float32(3), 'ratio_max': jnp.float32(2)}
  b = {'tokens': jnp.float32(4), 'ratio_max': jnp.float32(1.5)}
  out = losses.combine_stats(a, b)
  assert out['tokens'] == 7 and out['ratio_max'] == 2
  with pytest.raises(ValueError, match='keys'):
    losses.combine_stats(a, {'tokens': jnp.float32(1)})


@pytest.mark.parametrize('field,value', [
    ('kind', 'grpo'), ('is_cap', 0.0), ('is_cap', math.nan), ('clip_eps_low', 1.0),
    ('clip_eps_low', -0.1), ('clip_eps_high', -0.1), ('clip_eps_high', math.inf),
    ('normalization', 'seq'), ('kl_coef', -1.0), ('entropy_coef', math.nan)])
def test_loss_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    config_lib.LossConfig(**{field: value})


def test_loss_config_accepts_no_truncation():
  assert config_lib.LossConfig(is_cap=math.inf).is_cap == math.inf


# ---------------------------------------------------------------------------------------------
# Advantages.

_REWARDS = np.array([[1, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0.5, 2, -1, 3, 0]], np.float32)


def _np_advantages(rewards, baseline, normalize_std, eps=1e-6):
  out = np.zeros(rewards.shape)
  for i, group in enumerate(rewards.astype(np.float64)):
    g = len(group)
    mean = sum(group) / g
    std = math.sqrt(sum((x - mean)**2 for x in group) / g)
    for j, r in enumerate(group):
      if baseline == 'mean':
        out[i, j] = r - mean
      elif baseline == 'loo':
        out[i, j] = r - (sum(group) - r) / (g - 1) if g > 1 else 0.0
      else:
        out[i, j] = r
      if normalize_std and std > eps:
        out[i, j] /= std
  return out


@pytest.mark.parametrize('normalize_std', [False, True])
@pytest.mark.parametrize('baseline', ['mean', 'loo', 'none'])
def test_group_advantages_match_numpy(baseline, normalize_std):
  got = losses.group_advantages(_REWARDS, baseline=baseline, normalize_std=normalize_std)
  want = _np_advantages(_REWARDS, baseline, normalize_std)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('normalize_std', [False, True])
def test_a_group_of_one_has_no_advantage(normalize_std):
  """Masking can leave one sample of a group: a group-relative baseline has nothing to compare
  it with, so its advantage is 0 (leave-one-out used to give A = R, and R / 1e-6 with std)."""
  rewards = np.array([[1.0], [0.0], [2.5]], np.float32)
  for baseline in ('mean', 'loo'):
    adv = losses.group_advantages(rewards, baseline=baseline, normalize_std=normalize_std)
    np.testing.assert_array_equal(adv, np.zeros_like(rewards))
  np.testing.assert_array_equal(
      losses.group_advantages(rewards, baseline='none', normalize_std=normalize_std), rewards)


def test_a_zero_std_group_is_not_blown_up():
  rewards = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]], np.float32)
  for baseline in ('mean', 'loo', 'none'):
    adv = np.asarray(losses.group_advantages(rewards, baseline=baseline, normalize_std=True))
    assert np.all(np.isfinite(adv)) and np.abs(adv).max() < 10, (baseline, adv)
  adv = losses.group_advantages(rewards, baseline='mean', normalize_std=True)
  np.testing.assert_array_equal(adv[:2], 0.0)


def test_nonzero_groups_flags_groups_with_signal():
  adv = losses.group_advantages(_REWARDS)
  np.testing.assert_array_equal(losses.nonzero_groups(adv), [True, False, True])
  np.testing.assert_array_equal(losses.nonzero_groups(np.array([[1e-9, -1e-9]]), atol=1e-8),
                                [False])


def test_group_advantages_rejects_bad_input():
  with pytest.raises(ValueError, match='baseline'):
    losses.group_advantages(_REWARDS, baseline='median')
  with pytest.raises(ValueError, match='P, G'):
    losses.group_advantages(_REWARDS[0])


def test_k3_kl_log_ratio_is_clamped():
  """A reference that drifted far (log ref - log pi = 60) would overflow exp in k3; the clamp
  keeps the loss and its gradient finite and equal to the clamped value's."""
  logp, entropy, batch = _make_batch()
  on = batch['loss_mask'] > 0
  batch = dict(batch, ref_logprobs=np.where(on, logp + 60.0, 0.0).astype(np.float32))
  config = config_lib.LossConfig(kl_coef=0.1, kl_log_ratio_clamp=5.0)
  loss, stats, grads = _loss_and_grads(logp, entropy, batch, config, *_totals(batch))
  assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in grads)
  d = 5.0
  want = on.sum() * (math.exp(d) - d - 1)
  np.testing.assert_allclose(float(stats['kl_sum']), want, rtol=1e-5)
  # Inside the clamp nothing changes: a tiny drift gives the unclamped k3.
  small = dict(batch, ref_logprobs=np.where(on, logp + 0.3, 0.0).astype(np.float32))
  _, stats, _ = _loss_and_grads(logp, entropy, small, config, *_totals(small))
  np.testing.assert_allclose(float(stats['kl_sum']), on.sum() * (math.exp(0.3) - 1.3), rtol=1e-4)
