"""Attention over packed training rows: dense (the reference) and blockwise (memory linear in T).

Shape letters as in transformer.py (the README's table): R rows, T query tokens, S key
positions, K key/value heads, Q = N // K query heads per key head, Dh head dim; J blocks of Tb
queries in the blockwise loop. Queries come grouped, q_RxTxKxQxDh, so grouped-query attention
never repeats keys.

Who may attend to whom in a packed row (`segment_ids_RxT`: 1..k per sample, 0 = padding):
query i sees key j when j <= i (by index) and both are in the same sample; a padding token sees
only itself, so no row is ever fully masked.

`dense` builds the [R, K, Q, T, S] score tensor in fp32: 30 GB for one 16k-token row of a 7B
model. `blockwise` is flash attention (Dao et al., FlashAttention-2) written with lax loops:
queries in blocks of `block_q`, keys in blocks of `block_kv`, a running max and sum per query
(online softmax), so only one [R, K, Q, block_q, block_kv] tile of scores exists at a time. Its
backward pass is hand-written (`jax.custom_vjp`): it keeps the output and the per-query
log-sum-exp from the forward pass and recomputes the tiles, as autodiff through the loops would
otherwise store every tile. Key blocks wholly after a query block (causally masked) are never
visited; blocks masked only by segments are computed and masked, since skipping them would need
a per-device branch on data (the rows are split over devices).

Not offered: cuDNN's fused attention. `jax.nn.dot_product_attention(implementation='cudnn')`
takes one length per row (JAX 0.10.2 and 0.11), not packed segments; a packed layout exists only
in JAX's private `jax._src.cudnn.fused_attention_stablehlo` (segment offsets with a static
maximum count per row, Hopper only), and a dense `mask` becomes a dense bias there.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so masked tiles stay NaN-free
IMPLEMENTATIONS = ('dense', 'blockwise')


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
           block_q: int, block_kv: int) -> jax.Array:
  """Self-attention of packed rows by `implementation` ('dense' | 'blockwise')."""
  if implementation == 'dense':
    return dense(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_mask(segment_ids_RxT),
                 q_RxTxKxQxDh.dtype)
  if implementation == 'blockwise':
    return blockwise(q_RxTxKxQxDh, k_RxTxKxDh, v_RxTxKxDh, segment_ids_RxT, block_q=block_q,
                     block_kv=block_kv)
  raise ValueError(f'attention={implementation!r} is not one of {IMPLEMENTATIONS}')


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
  kv_blocks = jnp.asarray(blocks.kv_blocks_for())

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
    acc, m, l = jax.lax.fori_loop(0, kv_blocks[i], kv_step, init)
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
  out, lse = _forward(q, k, v, seg_q, seg_k, blocks)
  return out, (q, k, v, seg_q, seg_k, out, lse)


def _flash_bwd(blocks: _Blocks, residuals, dout):
  """FlashAttention-2's backward: per tile, p from the saved log-sum-exp, then
  ds = p * (dout.v - rowsum(dout * out)); dq += ds.k, dk += ds^T.q, dv += p^T.dout."""
  q, k, v, seg_q, seg_k, out, lse = residuals
  dtype = q.dtype
  scale = 1.0 / math.sqrt(q.shape[-1])
  delta = jnp.einsum('bqkgd,bqkgd->bkgq', dout.astype(jnp.float32), out.astype(jnp.float32))
  first_q_block = jnp.asarray(blocks.first_q_block_for())
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
    dq, dk_j, dv_j = jax.lax.fori_loop(first_q_block[j], blocks.nq, q_step, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(blocks.nk))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)
  return (dq.astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype),
          None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
