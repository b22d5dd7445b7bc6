"""Train step: sharded = single device, accumulation = full batch, non-finite guard, learning."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models import transformer

CONFIG = transformer.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                 qkv_bias=True)


def random_batch(seed, rows=8, seq_len=16):
  """Rows holding two packed segments each, with a few padding positions at the end."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, seq_len), np.int32)
  pos = np.zeros((rows, seq_len), np.int32)
  for r in range(rows):
    a = rng.integers(4, seq_len - 6)
    b = rng.integers(a + 2, seq_len)
    seg[r, :a], seg[r, a:b] = 1, 2
    pos[r, :a], pos[r, a:b] = np.arange(a), np.arange(b - a)
  loss_mask = ((seg != 0) & (pos >= 2)).astype(np.float32)
  adv = rng.normal(size=(rows, seq_len)).astype(np.float32) * loss_mask
  return {
      'tokens': rng.integers(0, CONFIG.vocab_size, (rows, seq_len)).astype(np.int32),
      'targets': rng.integers(0, CONFIG.vocab_size, (rows, seq_len)).astype(np.int32),
      'positions': pos,
      'segment_ids': seg,
      'loss_mask': loss_mask,
      # Off-policy on purpose, so importance weights are not all 1.
      'behaviour_logprobs': (-4.2 + 0.3 * rng.normal(size=(rows, seq_len))).astype(np.float32)
                            * loss_mask,
      'advantages': adv,
  }


def micro(batch, m):
  return {k: v.reshape(m, v.shape[0] // m, *v.shape[1:]) for k, v in batch.items()}


def run_steps(mesh, batches, loss_config=config_lib.LossConfig(), num_micro=2, lr=1e-2, sgd=False):
  """Steps from the same init. sgd=True makes the param change exactly -lr * gradient, so
  comparing params compares gradients (Adam's first step is ~lr * sign(g), which magnifies
  rounding differences in near-zero gradient entries)."""
  opt_config = config_lib.OptimizerConfig(lr=lr, warmup_steps=0)
  optimizer = optax.sgd(lr) if sgd else train.make_optimizer(opt_config)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  state, shardings = train.create_sharded_state(params, optimizer, mesh)
  step = train.jit_train_step(
      train.make_train_step(CONFIG, loss_config, optimizer, train.lr_schedule(opt_config)),
      shardings, mesh)
  metrics = []
  for b in batches:
    state, m = step(state, micro(b, num_micro))
    metrics.append(jax.device_get(m))
  return state, metrics


def test_sharded_step_equals_single_device():
  batches = [random_batch(1), random_batch(2)]
  single, m1 = run_steps(sharding_lib.make_mesh(devices=jax.devices()[:1]), batches, sgd=True)
  mesh = sharding_lib.make_mesh(fsdp=4, tensor=2)
  sharded, m8 = run_steps(mesh, batches, sgd=True)
  # Really sharded: q_proj kernel [L, D, H*Dh] split 4 ways on D and 2 ways on H*Dh.
  q = sharded.params['layers']['attn']['q_proj']['kernel']
  assert q.addressable_shards[0].data.shape == (2, 64 // 4, 64 // 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),
               single.params, sharded.params)
  for a, b in zip(m1, m8):
    for k in ('loss', 'grad_norm', 'ess'):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
  assert int(sharded.step) == 2


def test_microbatches_accumulate_to_full_batch():
  batches = [random_batch(3)]
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  s1, m1 = run_steps(mesh, batches, num_micro=1, sgd=True)
  s4, m4 = run_steps(mesh, batches, num_micro=4, sgd=True)
  np.testing.assert_allclose(m1[0]['loss'], m4[0]['loss'], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m1[0]['grad_norm'], m4[0]['grad_norm'], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s1.params, s4.params)


def test_optimizer_state_is_sharded_like_params():
  mesh = sharding_lib.make_mesh(fsdp=4, tensor=2)
  optimizer = train.make_optimizer(config_lib.OptimizerConfig(lr=1e-3))
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  state, _ = train.create_sharded_state(params, optimizer, mesh)
  q = state.params['layers']['attn']['q_proj']['kernel']
  adam = state.opt_state[1][0]
  for moment in (adam.mu, adam.nu):
    assert moment['layers']['attn']['q_proj']['kernel'].sharding.spec == q.sharding.spec


def test_nonfinite_update_is_skipped_and_reported():
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  bad = random_batch(4)
  bad['advantages'] = np.where(bad['loss_mask'] > 0, np.nan, 0).astype(np.float32)
  params0 = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  state, metrics = run_steps(mesh, [bad, random_batch(5)])
  assert metrics[0]['skipped'] == 1 and metrics[1]['skipped'] == 0
  assert int(state.step) == 1  # only the finite batch counted as a policy version
  # The skipped step left params untouched, so the result equals one step on the good batch.
  ref, _ = run_steps(mesh, [random_batch(5)])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), state.params, ref.params)


@pytest.mark.parametrize('kind', ['pipelinerl', 'ppo', 'gspo'])
def test_positive_advantage_raises_logprob(kind):
  """A few updates with A = +1 on a fixed completion make that completion more likely."""
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  batch = random_batch(6)
  batch['advantages'] = batch['loss_mask'].copy()
  params0 = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  logp = functools.partial(transformer.token_logprobs, config=CONFIG, tokens_RxT=batch['tokens'],
                           targets_RxT=batch['targets'], positions_RxT=batch['positions'],
                           segment_ids_RxT=batch['segment_ids'])
  mask = batch['loss_mask']
  before = float(jnp.sum(logp(params0)[0] * mask))
  # On-policy behaviour log-probs, as the sampler would have reported them.
  batch['behaviour_logprobs'] = np.asarray(logp(params0)[0]) * mask
  state, metrics = run_steps(mesh, [batch] * 3, config_lib.LossConfig(kind=kind))
  after = float(jnp.sum(logp(state.params)[0] * mask))
  assert after > before + 1.0
  np.testing.assert_allclose(metrics[0]['ess'], 1.0, atol=1e-5)
