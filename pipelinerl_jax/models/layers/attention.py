"""Attention over packed training rows: dense (the reference), blockwise (memory linear in T) and
cudnn (cuDNN's fused flash attention, Hopper GPUs).

Shape letters as in transformer.py (the README's table): R rows, T query tokens, S key
positions, K key/value heads, Q = N // K query heads per key head, Dh head dim; J blocks of Tb
queries in the blockwise loop; G sample slots of a row (packing.py's `segment_starts` /
`segment_lengths`). Queries come grouped, q_RxTxKxQxDh, so grouped-query attention never
repeats keys.

Who may attend to whom in a packed row (`segment_ids_RxT`: 1..k per sample, 0 = padding):
query i sees key j when j <= i (by index) and both are in the same sample; a padding token sees
only itself, so no row is ever fully masked.

`dense` builds the [R, K, Q, T, S] score tensor in fp32: 30 GB for one 16k-token row of a 7B
model. `blockwise` is flash attention (Dao et al., FlashAttention-2) written with lax loops:
queries in blocks of `block_q`, keys in blocks of `block_kv`, a running max and sum per query
(online softmax), so only one [R, K, Q, block_q, block_kv] tile of scores exists at a time. Its
backward pass is hand-written (`jax.custom_vjp`): it keeps the output and the per-query
log-sum-exp from the forward pass and recomputes the tiles, as autodiff through the loops would
otherwise store every tile. Tiles that no (query, key) pair of any row needs are never visited:
key blocks wholly after a query block (causal), and key blocks wholly before the start of the
earliest sample any query of the block belongs to (`block_ranges`). The ranges are reduced over
the rows (rows split over devices agree on one trip count), so a packed row of short samples
costs a band along the diagonal instead of the whole triangle.

`cudnn` hands the rows to cuDNN's packed ("ragged") layout through JAX's private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (the public
`jax.nn.dot_product_attention` takes one length per row, not packed samples): each sample is a
segment given by its start and length, `PADDING_CAUSAL` masks causally within it, and key heads
are shared by their Q query heads inside the kernel. Padding tokens lie in no segment, so the
kernel writes nothing for them: their outputs are set to 0 here and the gradients that reach q,
k and v at their positions are set to 0 too, so no unwritten memory reaches the loss or the
parameters. Hopper (sm90) or newer, bf16/fp16, head dim a multiple of 8 up to 256.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so masked tiles stay NaN-free
IMPLEMENTATIONS = ('dense', 'blockwise', 'cudnn')
# Names of what attention's backward pass needs (its inputs, output and per-query log-sum-exp),
# for rematerialization policies that keep attention out of the recomputation
# (transformer.remat_policy). cuDNN's output and statistics come from its forward primitive.
SAVED_NAMES = ('attention_q', 'attention_k', 'attention_v', 'attention_out', 'attention_lse')
CUDNN_FORWARD_PRIMITIVE = 'dot_product_attention_fwd_wrapper'


def segment_mask(segment_ids_RxT: jax.Array) -> jax.Array:
  """[R, T, T] bool: causal within each packed segment; segment 0 (padding) sees only itself."""
  t = segment_ids_RxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  same = segment_ids_RxT[:, :, None] == segment_ids_RxT[:, None, :]
  real = (segment_ids_RxT != 0)[:, :, None]
  return (causal_TxT & same & real) | jnp.eye(t, dtype=bool)


def dense(q_RxTxKxQxDh, k_RxSxKxDh, v_RxSxKxDh, mask_RxTxS, dtype) -> jax.Array:
  """Softmax attention with an explicit mask; scores and softmax in fp32, the rest in `dtype`."""
  dh = q_RxTxKxQxDh.shape[-1]
  scores = jnp.einsum('btkgd,bskd->bkgts', q_RxTxKxQxDh, k_RxSxKxDh.astype(dtype),
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  scores = jnp.where(mask_RxTxS[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum('bkgts,bskd->btkgd', probs, v_RxSxKxDh.astype(dtype))


def packed(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, *, implementation: str,
           block_q: int, block_kv: int, segment_starts_RxG=None,
           segment_lengths_RxG=None) -> jax.Array:
  """Self-attention of packed rows by `implementation` ('dense' | 'blockwise' | 'cudnn'); cudnn
  also needs the packer's spans of each row's samples."""
  if implementation == 'dense':
    return dense(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_mask(segment_ids_RxT),
                 q_RxTxKxQxDh.dtype)
  if implementation == 'blockwise':
    return blockwise(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, block_q=block_q,
                     block_kv=block_kv)
  if implementation == 'cudnn':
    if segment_starts_RxG is None or segment_lengths_RxG is None:
      raise ValueError("model.attention='cudnn' needs the batch's segment_starts and "
                       'segment_lengths (packing.pack_samples makes them)')
    return cudnn(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, segment_starts_RxG,
                 segment_lengths_RxG)
  raise ValueError(f'attention={implementation!r} is not one of {IMPLEMENTATIONS}')


# ---------------------------------------------------------------------------------------------
# cuDNN's fused attention over packed segments.


def cudnn_segments(segment_starts_RxG: jax.Array, segment_lengths_RxG: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """cuDNN's packed-layout arguments from the packer's spans: (seqlen [R, G], offsets [R, G+1]),
  int32, -1 in every unused slot. JAX's wrapper moves the used slots of all rows to the front
  and turns row-relative offsets into offsets in the flattened batch (`_fix_seqlen_offsets`);
  the extra last offsets column is always unused (it becomes the end of the batch)."""
  used = segment_lengths_RxG > 0
  seqlen_RxG = jnp.where(used, segment_lengths_RxG, -1).astype(jnp.int32)
  offsets_RxG = jnp.where(used, segment_starts_RxG, -1).astype(jnp.int32)
  return seqlen_RxG, jnp.pad(offsets_RxG, ((0, 0), (0, 1)), constant_values=-1)


def segments_mask(seqlen_RxG: jax.Array, offsets_RxG1: jax.Array, t: int) -> jax.Array:
  """[R, T, T] bool: what cuDNN's PADDING_CAUSAL attends to given `cudnn_segments`' arguments
  (causal within each segment; a token outside every segment sees nothing). The reference that
  checks the arguments against `segment_mask` on CPU."""
  pos_T = jnp.arange(t)
  start, length = offsets_RxG1[:, None, :-1], seqlen_RxG[:, None, :]
  inside_RxTxG = (length > 0) & (pos_T[None, :, None] >= start) & (
      pos_T[None, :, None] < start + length)
  slot_RxT = jnp.where(inside_RxTxG.any(-1), jnp.argmax(inside_RxTxG, -1), -1)
  same = (slot_RxT[:, :, None] == slot_RxT[:, None, :]) & (slot_RxT >= 0)[:, :, None]
  return same & jnp.tril(jnp.ones((t, t), bool))


@jax.custom_vjp
def _zero_cotangent_outside(x_RxTx___, keep_RxT):
  """The identity whose gradient is 0 where `keep` is False: cuDNN leaves dq, dk, dv unwritten
  at tokens in no segment (padding)."""
  del keep_RxT
  return x_RxTx___


def _zero_cotangent_fwd(x, keep):
  return x, keep


def _zero_cotangent_bwd(keep, g):
  keep = keep.reshape(keep.shape + (1,) * (g.ndim - keep.ndim))
  return jnp.where(keep, g, jnp.zeros_like(g)), None


_zero_cotangent_outside.defvjp(_zero_cotangent_fwd, _zero_cotangent_bwd)


def _jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split('.')[:2] if p.isdigit())


def _cudnn_module(grouped: bool):
  """JAX's private cuDNN attention module, or a one-line error saying why it cannot run here."""
  backend = jax.default_backend()
  if backend != 'gpu':
    raise ValueError(f"model.attention='cudnn' needs a CUDA GPU with cuDNN; JAX's backend is "
                     f'{backend}')
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fused  # private: checked below
    fused.dot_product_attention, fused.MaskType.PADDING_CAUSAL  # noqa: B018
  except (ImportError, AttributeError) as e:
    raise ValueError(f"model.attention='cudnn': JAX {jax.__version__} has no packed cuDNN "
                     f'attention ({type(e).__name__}: {e})') from None
  if grouped and _jax_version() < (0, 11):
    # 0.10's wrapper strides packed key offsets by the query heads' width.
    raise ValueError(f"model.attention='cudnn' with grouped-query attention needs JAX >= 0.11, "
                     f'this is {jax.__version__}')
  return fused


def cudnn(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, segment_starts_RxG,
          segment_lengths_RxG) -> jax.Array:
  """Equal to `dense(q, k, v, segment_mask(segment_ids))` on every real token (cuDNN's rounding);
  0 at padding tokens. The spans must describe the same rows as `segment_ids`."""
  b, t, kh, g, dh = q_RxTxKxQxDh.shape
  fused = _cudnn_module(grouped=g > 1)
  if q_RxTxKxQxDh.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"model.attention='cudnn' needs model.dtype bfloat16 or float16, got "
                     f'{q_RxTxKxQxDh.dtype}')
  real_RxT = segment_ids_RxT != 0
  q_RxTxNxDh = q_RxTxKxQxDh.reshape(b, t, kh * g, dh)  # head n uses key head n // Q, as cuDNN
  q_RxTxNxDh, k_RxTxKxDh, v_RxTxKxDh = (
      checkpoint_name(_zero_cotangent_outside(x, real_RxT), name)
      for x, name in ((q_RxTxNxDh, 'attention_q'), (k_RxTxKxDh, 'attention_k'),
                      (v_RxTxKxDh, 'attention_v')))
  seqlen_RxG, offsets_RxG1 = cudnn_segments(segment_starts_RxG, segment_lengths_RxG)
  try:
    out_RxTxNxDh = fused.dot_product_attention(
        q_RxTxNxDh, k_RxTxKxDh, v_RxTxKxDh, q_seqlen=seqlen_RxG, kv_seqlen=seqlen_RxG,
        q_offsets=offsets_RxG1, kv_offsets=offsets_RxG1, scale=1.0 / math.sqrt(dh),
        mask_type=fused.MaskType.PADDING_CAUSAL, qkv_layout='BTNH')
  except (NotImplementedError, ValueError, RuntimeError) as e:
    first = (str(e).strip().splitlines() or [''])[0]
    raise ValueError(f"model.attention='cudnn': cuDNN refused q {q_RxTxNxDh.shape} "
                     f'{q_RxTxNxDh.dtype}, k {k_RxTxKxDh.shape}: {type(e).__name__}: {first}'
                     ) from e
  out_RxTxNxDh = jnp.where(real_RxT[:, :, None, None], out_RxTxNxDh, 0)
  return out_RxTxNxDh.reshape(b, t, kh, g, dh)


# ---------------------------------------------------------------------------------------------
# Blockwise (flash) attention.


def blockwise(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, *, block_q: int = 1024,
              block_kv: int = 1024) -> jax.Array:
  """Equal to `dense(q, k, v, segment_mask(segment_ids))` within rounding; memory O(T)."""
  if block_q < 1 or block_kv < 1:
    raise ValueError(f'attention blocks must be >= 1, got block_q={block_q}, block_kv={block_kv}')
  t = q_RxTxKxQxDh.shape[1]
  bq, bk = min(block_q, t), min(block_kv, t)
  nq, nk = -(-t // bq), -(-t // bk)
  # Queries and keys padded to whole blocks; padded keys get segment -1 (nobody's segment) and
  # lie after every real query, so the causal rule already hides them.
  pad = lambda x, n, value=0: jnp.pad(x, [(0, 0), (0, n - t)] + [(0, 0)] * (x.ndim - 2),
                                      constant_values=value)
  q = pad(q_RxTxKxQxDh, nq * bq)
  k, v = pad(k_RxTxKxDh, nk * bk), pad(v_RxTxKxDh, nk * bk)
  seg_q, seg_k = pad(segment_ids_RxT, nq * bq), pad(segment_ids_RxT, nk * bk, -1)
  out = _flash(q, k, v, seg_q, seg_k, _Blocks(t, bq, bk, nq, nk))
  return out[:, :t]


class _Blocks(NamedTuple):
  """Static block geometry (hashable: a `nondiff_argnums` of the custom VJP)."""
  t: int    # real length
  bq: int   # query block
  bk: int   # key block
  nq: int   # query blocks
  nk: int   # key blocks

  def kv_blocks_for(self) -> np.ndarray:
    """[nq]: query block i needs key blocks 0 .. n_i - 1 (the later ones are causally masked)."""
    last_query = np.minimum((np.arange(self.nq) + 1) * self.bq, self.t) - 1
    return np.minimum(last_query // self.bk + 1, self.nk).astype(np.int32)

  def first_q_block_for(self) -> np.ndarray:
    """[nk]: key block j is seen by query blocks i >= this (the inverse of kv_blocks_for)."""
    return (np.arange(self.nk) * self.bk // self.bq).astype(np.int32)


def _reach(segment_ids_RxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the first key each query sees, the last query that sees each key), [R, T] int32 each.

  A real token's sample spans its id's first to last occurrence in the row; a padding token sees
  and is seen by itself only. Ids outside 1..T (never made by packing) fall back to the whole
  row, which only costs tiles.
  """
  t = segment_ids_RxT.shape[1]
  pos_T = jnp.arange(t, dtype=jnp.int32)
  known = (segment_ids_RxT > 0) & (segment_ids_RxT <= t)
  ids_RxT = jnp.where(known, segment_ids_RxT, 0)
  first_Rx_ = jax.vmap(lambda ids: jax.ops.segment_min(pos_T, ids, num_segments=t + 1))(ids_RxT)
  last_Rx_ = jax.vmap(lambda ids: jax.ops.segment_max(pos_T, ids, num_segments=t + 1))(ids_RxT)
  first_key = jnp.take_along_axis(first_Rx_, ids_RxT, axis=1)
  last_query = jnp.take_along_axis(last_Rx_, ids_RxT, axis=1)
  padding = segment_ids_RxT == 0
  first_key = jnp.where(padding, pos_T, jnp.where(known, first_key, 0))
  last_query = jnp.where(padding, pos_T, jnp.where(known, last_query, t - 1))
  return first_key, last_query


def block_ranges(segment_ids_RxT: jax.Array, blocks: _Blocks):
  """Which tiles blockwise visits, the same for every row (reduced over rows, so rows split
  over devices agree): query block i visits key blocks kv_lo[i] .. kv_hi[i] - 1 in the forward
  pass; key block j visits query blocks q_lo[j] .. q_hi[j] - 1 in the backward pass. Tiles
  outside these hold no (query, key) pair that may attend in any row."""
  t, bq, bk, nq, nk = blocks
  first_key_RxT, last_query_RxT = _reach(segment_ids_RxT[:, :t])
  # Padded positions (>= t) take values that leave the reductions to the real ones; every
  # block holds at least one real position.
  first_key = jnp.pad(jnp.min(first_key_RxT, axis=0), (0, nq * bq - t), constant_values=t)
  last_query = jnp.pad(jnp.max(last_query_RxT, axis=0), (0, nk * bk - t), constant_values=-1)
  kv_lo_J = (first_key.reshape(nq, bq).min(axis=1) // bk).astype(jnp.int32)
  q_hi_J = (last_query.reshape(nk, bk).max(axis=1) // bq + 1).astype(jnp.int32)
  return (kv_lo_J, jnp.asarray(blocks.kv_blocks_for()), jnp.asarray(blocks.first_q_block_for()),
          q_hi_J)


def tiles_visited(segment_ids_RxT: jax.Array, block_q: int, block_kv: int) -> tuple[int, int]:
  """(forward, backward) tiles `blockwise` computes for these rows (per row and head)."""
  t = segment_ids_RxT.shape[1]
  bq, bk = min(block_q, t), min(block_kv, t)
  kv_lo, kv_hi, q_lo, q_hi = block_ranges(
      jnp.asarray(segment_ids_RxT), _Blocks(t, bq, bk, -(-t // bq), -(-t // bk)))
  return int(jnp.sum(kv_hi - kv_lo)), int(jnp.sum(q_hi - q_lo))


def _tile_mask(i, j, seg_q_RxTb, seg_k_RxS, blocks: _Blocks):
  """[R, bq, bk] bool: which (query, key) pairs of tile (i, j) may attend."""
  qi = i * blocks.bq + jnp.arange(blocks.bq)
  kj = j * blocks.bk + jnp.arange(blocks.bk)
  causal = kj[None, :] <= qi[:, None]
  same = (seg_q_RxTb[:, :, None] == seg_k_RxS[:, None, :]) & (seg_q_RxTb != 0)[:, :, None]
  return (causal & same) | (qi[:, None] == kj[None, :])


def _tile_scores(q_RxTbxKxQxDh, k_RxSxKxDh, mask_RxTbxS):
  scale = 1.0 / math.sqrt(q_RxTbxKxQxDh.shape[-1])
  s = jnp.einsum('bqkgd,bskd->bkgqs', q_RxTbxKxQxDh, k_RxSxKxDh,
                 preferred_element_type=jnp.float32) * scale
  return jnp.where(mask_RxTbxS[:, None, None], s, MASK_VALUE)


def _slice(x, index, size):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _forward(q, k, v, seg_q, seg_k, blocks: _Blocks):
  """(out [R, Tb, K, Q, Dh] in q's dtype, log-sum-exp [R, K, Q, Tb] fp32)."""
  b, _, kh, g, dh = q.shape
  kv_lo, kv_hi, _, _ = block_ranges(seg_q, blocks)

  def q_block(_, i):
    q_i, seg_i = _slice(q, i, blocks.bq), _slice(seg_q, i, blocks.bq)

    def kv_step(j, carry):
      acc, m, l = carry
      k_j, v_j = _slice(k, j, blocks.bk), _slice(v, j, blocks.bk)
      mask = _tile_mask(i, j, seg_i, _slice(seg_k, j, blocks.bk), blocks)
      s = _tile_scores(q_i, k_j, mask)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
      correction = jnp.exp(m - m_new)
      l = l * correction + p.sum(-1)
      acc = acc * correction[..., None] + jnp.einsum(
          'bkgqs,bskd->bkgqd', p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
      return acc, m_new, l

    init = (jnp.zeros((b, kh, g, blocks.bq, dh), jnp.float32),
            jnp.full((b, kh, g, blocks.bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, blocks.bq), jnp.float32))
    acc, m, l = jax.lax.fori_loop(kv_lo[i], kv_hi[i], kv_step, init)
    l = jnp.maximum(l, jnp.finfo(jnp.float32).tiny)  # a padded query may see no key at all
    out = (acc / l[..., None]).astype(q.dtype)
    return None, (jnp.einsum('bkgqd->bqkgd', out), m + jnp.log(l))

  _, (out_JxRxTbxKxQxDh, lse_JxRxKxQxTb) = jax.lax.scan(q_block, None, jnp.arange(blocks.nq))
  out = jnp.moveaxis(out_JxRxTbxKxQxDh, 0, 1).reshape(b, blocks.nq * blocks.bq, kh, g, dh)
  lse = jnp.moveaxis(lse_JxRxKxQxTb, 0, 3).reshape(b, kh, g, blocks.nq * blocks.bq)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, seg_q, seg_k, blocks: _Blocks):
  return _forward(q, k, v, seg_q, seg_k, blocks)[0]


def _flash_fwd(q, k, v, seg_q, seg_k, blocks):
  q, k, v = (checkpoint_name(x, name) for x, name in zip((q, k, v), SAVED_NAMES))
  out, lse = _forward(q, k, v, seg_q, seg_k, blocks)
  out, lse = checkpoint_name(out, 'attention_out'), checkpoint_name(lse, 'attention_lse')
  return out, (q, k, v, seg_q, seg_k, out, lse)


def _flash_bwd(blocks: _Blocks, residuals, dout):
  """FlashAttention-2's backward: per tile, p from the saved log-sum-exp, then
  ds = p * (dout.v - rowsum(dout * out)); dq += ds.k, dk += ds^T.q, dv += p^T.dout."""
  q, k, v, seg_q, seg_k, out, lse = residuals
  dtype = q.dtype
  scale = 1.0 / math.sqrt(q.shape[-1])
  delta = jnp.einsum('bqkgd,bqkgd->bkgq', dout.astype(jnp.float32), out.astype(jnp.float32))
  _, _, q_lo, q_hi = block_ranges(seg_q, blocks)
  dout = dout.astype(dtype)

  def kv_block(dq, j):
    k_j, v_j, seg_j = (_slice(x, j, blocks.bk) for x in (k, v, seg_k))

    def q_step(i, carry):
      dq, dk_j, dv_j = carry
      q_i, dout_i = _slice(q, i, blocks.bq), _slice(dout, i, blocks.bq)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * blocks.bq, blocks.bq, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * blocks.bq, blocks.bq, axis=3)
      mask = _tile_mask(i, j, _slice(seg_q, i, blocks.bq), seg_j, blocks)
      s = _tile_scores(q_i, k_j, mask)
      p = jnp.where(mask[:, None, None], jnp.exp(s - lse_i[..., None]), 0.0)
      dv_j += jnp.einsum('bkgqs,bqkgd->bskd', p.astype(dtype), dout_i,
                         preferred_element_type=jnp.float32)
      dp = jnp.einsum('bqkgd,bskd->bkgqs', dout_i, v_j, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_i[..., None])).astype(dtype)
      dq_i = jnp.einsum('bkgqs,bskd->bqkgd', ds, k_j, preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, _slice(dq, i, blocks.bq) + dq_i * scale, i * blocks.bq, axis=1)
      dk_j += jnp.einsum('bkgqs,bqkgd->bskd', ds, q_i, preferred_element_type=jnp.float32) * scale
      return dq, dk_j, dv_j

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    dq, dk_j, dv_j = jax.lax.fori_loop(q_lo[j], q_hi[j], q_step, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(blocks.nk))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)
  return (dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype),
          None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
