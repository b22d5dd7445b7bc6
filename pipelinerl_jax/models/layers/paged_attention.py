"""Attention of new tokens against a paged KV cache: what generation writes and reads.

The cache is one pool of fixed-size pages for keys and one for values, [L, A, K, Z, Dh] each (A
pages of Z token positions), and a block table per sequence, [W] page ids: position p of a
sequence has its key and value in page `table[p // Z]` at offset `p % Z`, in every layer. Memory
then follows each sequence's real length, and sequences can share pages (a group's prompt).

Page 0 is the trash page: never given to a sequence, and every table entry not in use holds it.
Writes that must land nowhere (padding tokens, free slots, a finished sequence still decoding
until the host notices) land there, and reads past a sequence's length read finite values that
the mask removes. So no page id is ever out of range, which the GPU kernels need.

The K heads of a page sit between the page and its Z positions, so one (layer, page, head) is a
contiguous [Z, Dh] block. A kernel that wants pages of one head reads the pool as
[L * A * K, Z, Dh], one that wants [pages, K, Z, Dh] reads it as [L * A, K, Z, Dh]: both are
reshapes of the whole pool (free), where slicing one layer out of the layer scan's carry would
copy that layer's pages on every step.

`attend` reads by `implementation`:
  xla     the reference and the default (any backend): gathers the first W entries of each row's
          table, [R, W, K, Z, Dh] (the caller passes W, a bucket of the live page count), and runs
          masked attention over them with fp32 scores; grouped queries, keys never repeated.
  pallas  JAX's Pallas Triton paged attention (GPU; `jax.experimental.pallas.ops.gpu`, present in
          JAX 0.10 and 0.11, deprecated since 0.11.0): each row reads its own live pages only.
  cudnn   cuDNN's paged flash attention through JAX's private
          `jax._src.cudnn.fused_attention_stablehlo.paged_attention` (GPU, bf16 / fp16).
The kernels serve decode steps (T = 1); prefill chunks (T > 1) always take 'xla'.

Shape letters as in transformer.py, plus A pages in the pool, Z positions per page, W entries of
a block table.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

TRASH_PAGE = 0
IMPLEMENTATIONS = ('xla', 'pallas', 'cudnn')
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: masked scores stay NaN-free


class PagedKVCache(NamedTuple):
  """Keys and values of every layer, [L, A, K, Z, Dh] each."""
  k: jax.Array
  v: jax.Array


def init_pool(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int,
              head_dim: int, dtype: Any) -> PagedKVCache:
  shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
  return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def locate(table_RxW: jax.Array, positions_RxT: jax.Array, page_size: int
           ) -> tuple[jax.Array, jax.Array]:
  """(page id, offset) of each position; positions past the table go to the trash page."""
  w = table_RxW.shape[1]
  index_RxT = positions_RxT // page_size
  page_RxT = jnp.take_along_axis(table_RxW, jnp.clip(index_RxT, 0, w - 1), axis=1)
  page_RxT = jnp.where((index_RxT >= 0) & (index_RxT < w), page_RxT, TRASH_PAGE)
  return page_RxT, positions_RxT % page_size


def write(pool_LxAxKxZxDh: jax.Array, layer: jax.Array, page_RxT: jax.Array,
          offset_RxT: jax.Array, new_RxTxKxDh: jax.Array) -> jax.Array:
  """The pool with one layer's new keys (or values) scattered in, in place under jit."""
  return pool_LxAxKxZxDh.at[layer, page_RxT, :, offset_RxT].set(
      new_RxTxKxDh.astype(pool_LxAxKxZxDh.dtype))


def attend(q_RxTxKxQxDh: jax.Array, cache: PagedKVCache, layer: jax.Array,
           table_RxW: jax.Array, positions_RxT: jax.Array, *, implementation: str = 'xla',
           interpret: bool = False) -> jax.Array:
  """Each query (at position p) attends to its row's keys at positions 0..p, which must be in the
  pool already (write first). Returns [R, T, K, Q, Dh] in q's dtype.

  The kernels need T = 1 and read min(p + 1, W * Z) positions of each row; `interpret` runs the
  Pallas kernel in its interpreter (for tests on CPU).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'paged attention {implementation!r} is not one of {IMPLEMENTATIONS}')
  if implementation == 'xla' or q_RxTxKxQxDh.shape[1] != 1:
    return _attend_xla(q_RxTxKxQxDh, cache, layer, table_RxW, positions_RxT)
  # A parked slot's position is past every table: the kernels read at most the table.
  lengths_R = jnp.clip(positions_RxT[:, 0] + 1, 1, table_RxW.shape[1] * cache.k.shape[3])
  if implementation == 'pallas':
    return _attend_pallas(q_RxTxKxQxDh, cache, layer, table_RxW, lengths_R, interpret)
  return _attend_cudnn(q_RxTxKxQxDh, cache, layer, table_RxW, lengths_R)


def _attend_xla(q_RxTxKxQxDh, cache, layer, table_RxW, positions_RxT):
  """Masked dense attention over the gathered pages, as `models.attention.dense` computes it:
  scores and softmax in fp32, probabilities and values in q's dtype."""
  dtype = q_RxTxKxQxDh.dtype
  r, _, k, _, dh = q_RxTxKxQxDh.shape
  w, z = table_RxW.shape[1], cache.k.shape[3]
  # One gather from the whole pool (layer and page ids together), so only these pages are read;
  # laid out [R, K, W * Z, Dh] as the gather writes them (no separate transpose).
  gather = lambda pool: jnp.moveaxis(pool[layer, table_RxW], 2, 1).reshape(r, k, w * z, dh)
  k_RxKxSxDh, v_RxKxSxDh = gather(cache.k).astype(dtype), gather(cache.v).astype(dtype)
  scores = jnp.einsum('rtkqd,rksd->rkqts', q_RxTxKxQxDh, k_RxKxSxDh,
                      preferred_element_type=jnp.float32) / math.sqrt(dh)
  visible_RxTxS = jnp.arange(w * z, dtype=jnp.int32)[None, None] <= positions_RxT[:, :, None]
  scores = jnp.where(visible_RxTxS[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum('rkqts,rksd->rtkqd', probs, v_RxKxSxDh)


def _pad_table(table_RxW: jax.Array, width: int) -> jax.Array:
  return jnp.pad(table_RxW, ((0, 0), (0, width - table_RxW.shape[1])),
                 constant_values=TRASH_PAGE)


def _attend_pallas(q_Rx1xKxQxDh, cache, layer, table_RxW, lengths_R, interpret):
  """The Pallas kernel takes q [B, heads, Dh] against pages of one kv head: each (row, kv head)
  becomes a batch row with its Q query heads, and each (layer, page, head) one page of a single
  head, so the kernel reads a row's pages once for all Q heads that share them."""
  import warnings
  with warnings.catch_warnings():  # deprecated since JAX 0.11.0; chosen here on purpose
    warnings.simplefilter('ignore', DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
  l, a, k, z, dh = cache.k.shape
  r, _, _, q, _ = q_Rx1xKxQxDh.shape
  w = 1 << max(0, table_RxW.shape[1] - 1).bit_length()  # Triton blocks are powers of two
  table_RxW = _pad_table(table_RxW, w)
  ids_RxKxW = ((layer * a + table_RxW)[:, None, :] * k
               + jnp.arange(k, dtype=jnp.int32)[None, :, None])
  # The kernel does not scale scores: scale q (exact in any dtype when Dh is a power of 4).
  q_RKxQxDh = (q_Rx1xKxQxDh[:, 0].astype(jnp.float32) / math.sqrt(dh)).astype(
      q_Rx1xKxQxDh.dtype).reshape(r * k, q, dh)
  k_splits = max(1, min(16, w // 4))
  out = pallas_paged.paged_attention(
      q_RKxQxDh, cache.k.reshape(1, l * a * k, z, dh), cache.v.reshape(1, l * a * k, z, dh),
      ids_RxKxW.reshape(r * k, w), jnp.repeat(lengths_R.astype(jnp.int32), k),
      k_splits=k_splits, pages_per_compute_block=min(8, w // k_splits), interpret=interpret)
  return out.reshape(r, 1, k, q, dh)


def cudnn_table_width(blocks: int, rows: int, width: int) -> int | None:
  """cuDNN reads a page table [B, 1, W, 1] and requires B * W == blocks (every block of the key
  array in exactly one row's table). The widest W >= width with B = blocks / W >= rows whole:
  the fewest rows of padding. None when no such W exists."""
  best = None
  for w in range(width, blocks // max(rows, 1) + 1):
    if blocks % w == 0:
      best = w
  return best


def _attend_cudnn(q_Rx1xKxQxDh, cache, layer, table_RxW, lengths_R):
  """cuDNN reads key pages [blocks, K, Z, Dh] (layout BNSH) through a page table [B, 1, W, 1]
  with B * W == blocks: the pool as (layer, page) blocks, each row's table holding its layer's
  ids and padded with trash pages, rows padded to B with rows that read one trash position."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  l, a, k, z, dh = cache.k.shape
  r, _, _, q, _ = q_Rx1xKxQxDh.shape
  blocks = l * a
  w = cudnn_table_width(blocks, r, table_RxW.shape[1])
  if w is None:
    raise ValueError(f'cudnn paged attention: no table width >= {table_RxW.shape[1]} splits the '
                     f'pool\'s {blocks} (layer, page) blocks into at least {r} rows')
  b = blocks // w
  q_BxNx1xDh = jnp.zeros((b, k * q, 1, dh), q_Rx1xKxQxDh.dtype).at[:r, :, 0].set(
      q_Rx1xKxQxDh[:, 0].reshape(r, k * q, dh))
  ids_RxW = layer * a + _pad_table(table_RxW, w)
  table_Bx1xWx1 = jnp.zeros((b, w), jnp.int32).at[:r].set(ids_RxW)[:, None, :, None]
  # Padding rows read one trash position (a length of 0 is not worth testing cuDNN on).
  q_len_B = jnp.ones((b,), jnp.int32)
  kv_len_B = jnp.ones((b,), jnp.int32).at[:r].set(lengths_R.astype(jnp.int32))
  out = cudnn_attention.paged_attention(
      q_BxNx1xDh, cache.k.reshape(blocks, k, z, dh), cache.v.reshape(blocks, k, z, dh),
      q_len_B, kv_len_B, table_Bx1xWx1, table_Bx1xWx1, scale=1.0 / math.sqrt(dh),
      mask_type=cudnn_attention.MaskType.PADDING, qkv_layout='BNTH')
  if isinstance(out, (tuple, list)):
    out = out[0]
  return out[:r, :, 0].reshape(r, 1, k, q, dh)
