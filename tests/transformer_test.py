"""The trainer's numerics knobs: what each remat policy keeps, and the bf16 lm_head."""

import dataclasses

import jax
import jax.extend
from jax._src import ad_checkpoint  # saved_residuals: public only as print_saved_residuals
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.bench import lm_head as lm_head_bench
from pipelinerl_jax.models import transformer

MODEL = transformer.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                                attention_block_q=8, attention_block_kv=8)


def saved_bytes(config, params, tokens, positions, segment_ids):
  """Bytes of the activations (not the params) the backward pass of `config`'s model keeps."""
  f = lambda p: jnp.sum(transformer.hidden_states(p, config, tokens, positions, segment_ids))
  residuals = ad_checkpoint.saved_residuals(f, params)
  return sum(a.size * a.dtype.itemsize for a, where in residuals
             if 'from the argument' not in where), residuals


def test_remat_policies_keep_what_they_say():
  t = 16
  tokens = jnp.zeros((1, t), jnp.int32)
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  segment_ids = jnp.asarray([[1] * 10 + [2] * 6], jnp.int32)
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  kept = {}
  for name in ('none', *transformer.REMAT_POLICIES):
    config = dataclasses.replace(MODEL, remat=name != 'none',
                                 remat_policy=name if name != 'none' else 'full')
    kept[name], residuals = saved_bytes(config, params, tokens, positions, segment_ids)
    shapes = [a.shape for a, _ in residuals]
    out_shape = (MODEL.num_layers, 1, t, 2, 2, 8)  # attention's output, stacked over layers
    assert (out_shape in shapes) == (name in ('none', 'attention', 'dots')), name
  assert kept['full'] < kept['attention'] < kept['dots'] < kept['none'], kept
  with pytest.raises(ValueError, match='remat_policy='):
    dataclasses.replace(MODEL, remat_policy='some')


def test_bf16_lm_head_multiplies_in_bf16_forward_and_backward_and_stays_close_to_fp32():
  config = dataclasses.replace(MODEL, dtype='bfloat16', lm_head_fp32=False, tie_embeddings=True)
  params = transformer.init_params(config, jax.random.PRNGKey(1))
  h = jax.random.normal(jax.random.PRNGKey(2), (1, 8, MODEL.hidden_size), jnp.bfloat16)
  loss = lambda p, h, c: jnp.sum(jax.nn.log_softmax(transformer.logits(p, c, h))[..., 3])
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, h, config)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'dot_general']
  dots += [e for eq in jaxpr.jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(eq.params)
           for e in sub.eqns if e.primitive.name == 'dot_general']
  assert len(dots) == 3  # the logits, and the two backward products
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16] * 2, e
    assert e.outvars[0].aval.dtype == jnp.float32, e
  fp32 = dataclasses.replace(config, lm_head_fp32=True)
  g16 = jax.grad(loss, argnums=(0, 1))(params, h, config)
  g32 = jax.grad(loss, argnums=(0, 1))(params, h, fp32)
  assert jax.tree.map(lambda x: x.dtype, g16) == jax.tree.map(lambda x: x.dtype, g32)
  for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), np.abs(a - b).max()


def test_lm_head_bench_quick_measures_a_small_difference(tmp_path):
  report = lm_head_bench.main(['--quick', f'--out={tmp_path / "lm_head.json"}'])
  (r,) = report['results']
  assert 0 < r['mean_abs_logprob_diff'] < 1e-2 and r['max_abs_logprob_diff'] < 0.1
