"""Blockwise (flash) attention against the dense reference: values, gradients, the model, memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models.layers import attention
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


# ---------------------------------------------------------------------------------------------
# Segment-aware tile skipping (blockwise) and cuDNN's packed layout (its arguments, on CPU).


def layout_rows(t):
  """Rows of one sample, two samples, 16 equal samples, and 5 samples then padding."""
  seg = np.zeros((4, t), np.int32)
  seg[0] = 1
  seg[1, :t // 3], seg[1, t // 3:] = 1, 2
  seg[2] = np.repeat(np.arange(1, 17), t // 16)
  for s, (a, b) in enumerate([(0, 5), (5, 20), (20, 22), (22, 40), (40, t - 9)]):
    seg[3, a:b] = s + 1
  return seg


def test_blockwise_skips_cross_segment_tiles_and_still_equals_dense():
  t = 64
  seg = jnp.asarray(layout_rows(t))
  q, k, v = qkv(4, t, 2, 2, 8, seed=4)
  w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
  fn = functools.partial(attention.blockwise, block_q=16, block_kv=8)

  @jax.jit
  def both(q, k, v):
    value_and_grad = lambda f: jax.value_and_grad(
        lambda q, k, v: jnp.sum(w * jnp.tanh(f(q, k, v, seg))), argnums=(0, 1, 2))(q, k, v)
    return fn(q, k, v, seg), dense_ref(q, k, v, seg), value_and_grad(fn), value_and_grad(dense_ref)

  out, want_out, (_, got), (_, want) = both(q, k, v)
  np.testing.assert_allclose(out, want_out, atol=2e-6)
  for name, a, b in zip('qkv', got, want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f'd{name}')

  # Tiles per row and head: a row of 16 equal samples needs about the diagonal band only.
  t_long = 512
  rows = jnp.asarray(layout_rows(t_long))
  one = attention.tiles_visited(rows[:1], 64, 64)
  sixteen = attention.tiles_visited(rows[2:3], 64, 64)
  assert one == (36, 36)                     # 8 query blocks: the causal triangle
  assert sixteen[0] <= one[0] / 3 and sixteen[1] <= one[1] / 3, (sixteen, one)
  # Rows split over devices share one trip count: the reduction over rows is the union.
  both = attention.tiles_visited(rows[1:3], 64, 64)
  assert both[0] >= attention.tiles_visited(rows[1:2], 64, 64)[0] >= sixteen[0]


def spans(seg):
  starts, lengths = packing.segment_spans(np.asarray(seg), 8)
  return jnp.asarray(starts), jnp.asarray(lengths)


def test_cudnn_arguments_describe_the_segment_mask():
  """What PADDING_CAUSAL attends to with our (seqlen, offsets) is segment_mask on every real
  token, both as read directly and after JAX's own packing of them (`_fix_seqlen_offsets`)."""
  from jax._src.cudnn import fused_attention_stablehlo as fused
  t = 48
  seg = jnp.asarray(np.concatenate([layout_rows(t)[[0, 1, 3]], np.zeros((1, t), np.int32)]))
  seqlen, offsets = attention.cudnn_segments(*spans(seg))
  real = np.asarray(seg != 0)
  want = np.asarray(attention.segment_mask(seg))
  got = np.asarray(attention.segments_mask(seqlen, offsets, t))
  np.testing.assert_array_equal(got[real], want[real])
  assert not got[~real].any()                # padding lies in no segment

  shape = jax.ShapeDtypeStruct((4, t, 2, 8), jnp.bfloat16)
  flat_len, flat_off = fused._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, shape,
                                                 shape)[:3:2]
  # Used slots of all rows moved to the front, offsets into the flattened batch, scaled by the
  # stride of a token; the filler slots have length 0.
  flat_off = np.asarray(flat_off).ravel() // (2 * 8)
  slot = np.full(4 * t, -1)
  for s, (o, n) in enumerate(zip(flat_off, np.asarray(flat_len).ravel())):
    slot[o:o + max(n, 0)] = s
  slot = slot.reshape(4, t)
  flat_mask = ((slot[:, :, None] == slot[:, None, :]) & (slot >= 0)[:, :, None]
               & np.tril(np.ones((t, t), bool)))
  np.testing.assert_array_equal(flat_mask[real], want[real])


@jax.custom_vjp
def _poison(x, covered):
  return x


def _poison_bwd(covered, g):
  covered = covered.reshape(covered.shape + (1,) * (g.ndim - covered.ndim))
  return jnp.where(covered, g, jnp.nan), None


_poison.defvjp(lambda x, covered: (x, covered), _poison_bwd)


class FakeCudnn:
  """cuDNN's packed attention emulated in XLA, unwritten memory included: the output and dq,
  dk, dv at tokens in no segment are NaN, as garbage could be."""
  from jax._src.cudnn.fused_attention_stablehlo import MaskType

  @classmethod
  def dot_product_attention(cls, q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale,
                            mask_type, qkv_layout):
    assert mask_type == cls.MaskType.PADDING_CAUSAL and qkv_layout == 'BTNH'
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets
    b, t, n, dh = q.shape
    assert scale == pytest.approx(dh ** -0.5)
    mask = attention.segments_mask(q_seqlen, q_offsets, t)
    covered = mask.any(-1)
    q, k, v = (_poison(x, covered) for x in (q, k, v))
    out = attention.dense(q.reshape(b, t, k.shape[2], n // k.shape[2], dh), k, v, mask, q.dtype)
    return jnp.where(covered[..., None, None, None], out, jnp.nan).reshape(q.shape)


def test_cudnn_wrapper_equals_dense_on_real_tokens_and_keeps_padding_finite(monkeypatch):
  monkeypatch.setattr(attention, '_cudnn_module', lambda grouped: FakeCudnn)
  cudnn = attention.cudnn
  t = 48
  seg = jnp.asarray(np.concatenate([layout_rows(t)[[0, 1, 3]], np.zeros((1, t), np.int32)]))
  starts, lengths = spans(seg)
  q, k, v = qkv(4, t, 2, 3, 8, seed=6, dtype=jnp.bfloat16)
  real = np.asarray(seg != 0)
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape) * real[:, :, None, None, None]

  @jax.jit
  def outputs_and_grads(q, k, v):
    fns = (lambda q, k, v: cudnn(q, k, v, seg, starts, lengths),
           lambda q, k, v: dense_ref(q, k, v, seg))
    grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(w * f(q, k, v).astype(jnp.float32)),
                              argnums=(0, 1, 2))(q, k, v)
    return [(f(q, k, v), grad(f)) for f in fns]

  (out, got), (want, ref) = jax.tree.map(lambda x: np.asarray(x, np.float32),
                                         outputs_and_grads(q, k, v))
  np.testing.assert_allclose(out[real], want[real], atol=1e-2)
  assert (out[~real] == 0).all()
  for name, a, b in zip('qkv', got, ref):
    assert np.isfinite(a).all(), name
    np.testing.assert_allclose(a[real], b[real], atol=3e-2, err_msg=f'd{name}')
    assert (a[~real] == 0).all(), name


def test_cudnn_says_why_it_cannot_run_here():
  q, k, v = qkv(1, 8, 1, 2, 8, seed=0, dtype=jnp.bfloat16)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="model.attention='cudnn' needs a CUDA GPU with cuDNN; "
                                       "JAX's backend is cpu"):
    attention.packed(q, k, v, seg, implementation='cudnn', block_q=8, block_kv=8,
                     segment_starts_RxG=jnp.zeros((1, 1), jnp.int32),
                     segment_lengths_RxG=jnp.full((1, 1), 8, jnp.int32))
  with pytest.raises(ValueError, match='needs the batch.s segment_starts'):
    attention.packed(q, k, v, seg, implementation='cudnn', block_q=8, block_kv=8)
  cfg = config_lib.base_config()
  cfg.model.attention = 'cudnn'
  with pytest.raises(ValueError, match="config.model.attention: 'cudnn' needs model.dtype"):
    config_lib.validate(cfg)
