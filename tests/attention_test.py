"""Blockwise (flash) attention against the dense reference: values, gradients, the model, memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models import attention
from pipelinerl_jax.models import transformer


def packed_segments(rows, t, seed):
  """Rows of 1-4 samples of random lengths, then padding (segment 0); one row with no padding."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, t), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, t), size=rng.integers(1, 4), replace=False))
    end = t if r == 0 else rng.integers(cuts[-1], t + 1)
    bounds = [0, *cuts, end]
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[r, a:b] = s + 1
  return jnp.asarray(seg)


def qkv(b, t, k, g, dh, seed, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, k, g, dh), jnp.float32)
  kk = jax.random.normal(keys[1], (b, t, k, dh), jnp.float32)
  v = jax.random.normal(keys[2], (b, t, k, dh), jnp.float32)
  return q.astype(dtype), kk.astype(dtype), v.astype(dtype)


def dense_ref(q, k, v, seg):
  return attention.dense(q, k, v, attention.segment_mask(seg), q.dtype)


# T = 37 is no multiple of any block below, so padded query and key blocks are exercised; with
# block_q > block_kv some padded queries see no key at all.
@pytest.mark.parametrize('block_q,block_kv', [(8, 8), (5, 16), (16, 5), (64, 64)])
def test_blockwise_equals_dense_values_and_gradients(block_q, block_kv):
  q, k, v = qkv(3, 37, 2, 3, 8, seed=block_q)   # GQA: 2 key heads, 3 query heads each
  seg = packed_segments(3, 37, seed=block_kv)
  fn = functools.partial(attention.blockwise, block_q=block_q, block_kv=block_kv)
  np.testing.assert_allclose(fn(q, k, v, seg), dense_ref(q, k, v, seg), atol=2e-6)

  # A loss that weighs every output differently, so no gradient term cancels by symmetry.
  w = jax.random.normal(jax.random.PRNGKey(7), q.shape)
  loss = lambda f: lambda q, k, v: jnp.sum(w * jnp.tanh(f(q, k, v, seg)))
  got = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(dense_ref), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip('qkv', got, want):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f'd{name}')


def test_blockwise_respects_segments():
  """Changing one sample's keys changes only that sample's outputs."""
  q, k, v = qkv(1, 24, 1, 2, 8, seed=0)
  seg = jnp.asarray([[1] * 10 + [2] * 10 + [0] * 4])
  fn = functools.partial(attention.blockwise, block_q=4, block_kv=4)
  base = fn(q, k, v, seg)
  moved = fn(q, k.at[:, 12].add(3.0), v.at[:, 12].add(3.0), seg)
  changed = np.abs(np.asarray(moved - base)).max(axis=(0, 2, 3, 4)) > 1e-6
  assert not changed[:12].any() and changed[12:20].all() and not changed[20:].any()


def test_blockwise_bf16_is_as_close_to_fp32_as_dense_bf16():
  q, k, v = qkv(2, 64, 2, 2, 16, seed=3)
  seg = packed_segments(2, 64, seed=3)
  exact = dense_ref(q, k, v, seg)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  dense_err = float(jnp.abs(dense_ref(*bf, seg).astype(jnp.float32) - exact).max())
  out = attention.blockwise(*bf, seg, block_q=16, block_kv=16)
  assert out.dtype == jnp.bfloat16
  block_err = float(jnp.abs(out.astype(jnp.float32) - exact).max())
  assert block_err <= 2 * dense_err + 1e-3, (block_err, dense_err)

  w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
  grad = lambda f, xs: jax.grad(lambda *a: jnp.sum(w * f(*a, seg).astype(jnp.float32)),
                                argnums=(0, 1, 2))(*xs)
  exact_g = grad(dense_ref, (q, k, v))
  dense_g = grad(dense_ref, bf)
  block_g = grad(functools.partial(attention.blockwise, block_q=16, block_kv=16), bf)
  for name, e, d, b in zip('qkv', exact_g, dense_g, block_g):
    assert b.dtype == jnp.bfloat16
    d_err = float(jnp.abs(d.astype(jnp.float32) - e).max())
    b_err = float(jnp.abs(b.astype(jnp.float32) - e).max())
    assert b_err <= 2 * d_err + 1e-2, (name, b_err, d_err)


MODEL = transformer.ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2,
                                num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True)


@pytest.mark.parametrize('dtype,remat', [('float32', False), ('float32', True),
                                         ('bfloat16', False)])
def test_model_logprobs_and_param_gradients_match_dense(dtype, remat):
  t = 40
  seg = packed_segments(2, t, seed=5)
  pos = np.zeros((2, t), np.int32)
  for r in range(2):
    for s in np.unique(seg[r]):
      idx = np.flatnonzero(np.asarray(seg[r]) == s)
      pos[r, idx] = np.arange(idx.size)
  rng = np.random.default_rng(0)
  tokens, targets = (jnp.asarray(rng.integers(0, 64, (2, t)), jnp.int32) for _ in range(2))
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))

  def logp_and_grad(impl):
    cfg = dataclasses.replace(MODEL, attention=impl, attention_block_q=16, attention_block_kv=8,
                              dtype=dtype, remat=remat)
    def loss(p):
      logp, ent = transformer.token_logprobs(p, cfg, tokens, targets, pos, seg)
      return jnp.sum(jnp.where(seg > 0, logp + 0.1 * ent, 0.0)), logp
    (_, logp), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logp, g

  logp_b, grad_b = logp_and_grad('blockwise')
  logp_d, grad_d = logp_and_grad('dense')
  tol = 1e-5 if dtype == 'float32' else 5e-2
  np.testing.assert_allclose(logp_b, logp_d, atol=tol)
  flat_b = jax.tree_util.tree_leaves_with_path(grad_b)
  for (path, gb), gd in zip(flat_b, jax.tree.leaves(grad_d)):
    scale = float(jnp.abs(gd).max()) + 1e-6
    err = float(jnp.abs(gb - gd).max()) / scale
    assert err < (1e-4 if dtype == 'float32' else 5e-2), (jax.tree_util.keystr(path), err)


def test_blockwise_under_sharded_jit_equals_single_device():
  mesh = sharding_lib.make_mesh(1, 8, 1)
  q, k, v = qkv(8, 32, 2, 2, 8, seed=9)
  seg = packed_segments(8, 32, seed=9)
  fn = functools.partial(attention.blockwise, block_q=8, block_kv=8)
  w = jax.random.normal(jax.random.PRNGKey(2), q.shape)
  value_and_grads = lambda q, k, v, seg: jax.value_and_grad(
      lambda q, k, v: jnp.sum(w * fn(q, k, v, seg)), argnums=(0, 1, 2))(q, k, v)
  rows = sharding_lib.batch_sharding(mesh)
  sharded = jax.jit(value_and_grads, in_shardings=(rows,) * 4)(q, k, v, seg)
  single = jax.jit(value_and_grads)(q, k, v, seg)
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6)  # sums differ in order only


def temp_bytes(impl, t):
  """Temporary memory XLA assigns to a gradient of attention over one row of length t."""
  q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, t, 2, 2, 16), (1, t, 2, 16),
                                                             (1, t, 2, 16)))
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
  fn = (functools.partial(attention.blockwise, block_q=128, block_kv=128) if impl == 'blockwise'
        else dense_ref)
  grad = jax.grad(lambda q, k, v, seg: jnp.sum(fn(q, k, v, seg)), argnums=(0, 1, 2))
  return jax.jit(grad).lower(q, k, v, seg).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_and_dense_quadratically():
  dense_1k, dense_2k = temp_bytes('dense', 1024), temp_bytes('dense', 2048)
  block_1k, block_2k = temp_bytes('blockwise', 1024), temp_bytes('blockwise', 2048)
  assert dense_2k > 3.5 * dense_1k           # the [T, T] score tensors
  assert block_2k < 2.5 * block_1k           # O(T) buffers plus fixed-size tiles
  assert block_2k * 8 < dense_2k


def test_bad_attention_settings_are_refused():
  with pytest.raises(ValueError, match='attention='):
    dataclasses.replace(MODEL, attention='flash')
  with pytest.raises(ValueError, match='attention blocks'):
    dataclasses.replace(MODEL, attention_block_kv=0)
  cfg = config_lib.base_config()
  cfg.model.attention = 'flash'
  with pytest.raises(ValueError, match='config.model.attention'):
    config_lib.validate(cfg)
