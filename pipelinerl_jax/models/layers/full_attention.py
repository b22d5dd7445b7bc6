"""Full (softmax) attention as a layer: projections, per-head q/k norms, RoPE, and the attention
itself over packed training rows (attention.py), a dense cache or a paged one (paged_attention.py).

Shape letters as in transformer.py: R rows, T query tokens, S cache positions, N query heads,
K key/value heads, Q = N // K, Dh head dim, E rotary frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from pipelinerl_jax.models.layers import attention as attention_lib
from pipelinerl_jax.models.layers import paged_attention
from pipelinerl_jax.models.layers.common import dense, rms_norm


def rope_inv_freq(config) -> jax.Array:
  """Inverse frequencies [E] of the `config.rotary_dim` dims RoPE turns (E = rotary_dim / 2),
  with HF's 'linear' and 'llama3' scaling rules."""
  dim = config.rotary_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  s = config.rope_scaling
  if s is None:
    return inv_freq
  if s.kind == 'linear':
    return inv_freq / s.factor
  if s.kind == 'llama3':
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)
  raise ValueError(f'rope_scaling.rope_type={s.kind!r} is not supported (default, linear, llama3)')


def apply_rope(x_RxTxNxDh: jax.Array, positions_RxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """HF's non-interleaved rotary embedding on the first 2E dims of each head (the two halves
  of those are the pairs); the rest pass unchanged (partial rotary)."""
  angles_RxTxE = positions_RxT[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(angles_RxTxE)[:, :, None, :]
  sin = jnp.sin(angles_RxTxE)[:, :, None, :]
  x = x_RxTxNxDh.astype(jnp.float32)
  x1, x2, rest = jnp.split(x, [inv_freq.shape[0], 2 * inv_freq.shape[0]], axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
  return out.astype(x_RxTxNxDh.dtype)


class Attention(nn.Module):
  """Returns (output [R, T, D], the updated cache or None)."""
  config: Any

  @nn.compact
  def __call__(self, x_RxTxD, positions_RxT, segment_ids_RxT, mask_RxTxS, layer_cache,
               spans=None):
    c = self.config
    b, t, _ = x_RxTxD.shape
    gated = c.attention_output_gate
    q = dense(c.num_heads * c.head_dim * (2 if gated else 1), c.qkv_bias, c, 'q_proj')(x_RxTxD)
    k = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, c, 'k_proj')(x_RxTxD)
    v = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, c, 'v_proj')(x_RxTxD)
    gate_RxTxNxDh = None
    if gated:  # Qwen3.5: each head's query, then its output gate
      q, gate_RxTxNxDh = jnp.split(q.reshape(b, t, c.num_heads, 2 * c.head_dim), 2, axis=-1)
    q_RxTxNxDh = q.reshape(b, t, c.num_heads, c.head_dim)
    k_RxTxKxDh = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:  # Qwen3: each head's query and key normalized over Dh, before RoPE
      q_RxTxNxDh = rms_norm(c, 'q_norm')(q_RxTxNxDh)
      k_RxTxKxDh = rms_norm(c, 'k_norm')(k_RxTxKxDh)
    inv_freq = rope_inv_freq(c)
    q_RxTxNxDh = apply_rope(q_RxTxNxDh, positions_RxT, inv_freq)
    k_RxTxKxDh = apply_rope(k_RxTxKxDh, positions_RxT, inv_freq)
    v_RxTxKxDh = v.reshape(b, t, c.num_kv_heads, c.head_dim)

    g = c.num_heads // c.num_kv_heads
    q_RxTxKxQxDh = q_RxTxNxDh.reshape(b, t, c.num_kv_heads, g, c.head_dim)
    new_cache = None
    if layer_cache is None:  # training rows: keys are the row's own tokens
      starts_RxG, lengths_RxG = spans if spans is not None else (None, None)
      with jax.named_scope('attention_core'):  # the profile breakdown finds attention by this
        out_RxTxKxQxDh = attention_lib.packed(
            q_RxTxKxQxDh, k_RxTxKxDh.astype(c.dtype), v_RxTxKxDh.astype(c.dtype),
            segment_ids_RxT, implementation=c.attention, block_q=c.attention_block_q,
            block_kv=c.attention_block_kv, segment_starts_RxG=starts_RxG,
            segment_lengths_RxG=lengths_RxG)
        out_RxTxKxQxDh = checkpoint_name(out_RxTxKxQxDh, 'attention_out')
    elif layer_cache.table is None:  # dense cache: write at each token's position, read it all
      # The whole [L, R, S, K, Dh] cache rides in the layer scan's carry and only the T new
      # tokens are scattered into it, so a decode step updates the cache in place instead of
      # rebuilding it (as scanning over per-layer slices would).
      cache_k, cache_v, layer = layer_cache.k, layer_cache.v, layer_cache.layer
      rows = jnp.arange(b)[:, None]
      # Positions >= S (padding) are dropped, so padded prompt tokens write nowhere.
      cache_k = cache_k.at[layer, rows, positions_RxT].set(k_RxTxKxDh.astype(cache_k.dtype),
                                                           mode='drop')
      cache_v = cache_v.at[layer, rows, positions_RxT].set(v_RxTxKxDh.astype(cache_v.dtype),
                                                           mode='drop')
      out_RxTxKxQxDh = attention_lib.dense(
          q_RxTxKxQxDh, jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False),
          jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False), mask_RxTxS, c.dtype)
      new_cache = layer_cache._replace(k=cache_k, v=cache_v)
    else:  # paged cache: the same, through each row's block table (in place as above)
      layer, table_RxW = layer_cache.layer, layer_cache.table
      page_RxT, offset_RxT = paged_attention.locate(table_RxW, positions_RxT,
                                                    layer_cache.k.shape[3])
      pool = paged_attention.PagedKVCache(
          paged_attention.write(layer_cache.k, layer, page_RxT, offset_RxT, k_RxTxKxDh),
          paged_attention.write(layer_cache.v, layer, page_RxT, offset_RxT, v_RxTxKxDh))
      out_RxTxKxQxDh = paged_attention.attend(q_RxTxKxQxDh.astype(c.dtype), pool, layer,
                                              table_RxW, positions_RxT,
                                              implementation=c.decode_attention)
      new_cache = layer_cache._replace(k=pool.k, v=pool.v)
    out = out_RxTxKxQxDh.reshape(b, t, c.num_heads * c.head_dim)
    if gated:
      out = out.astype(c.dtype) * jax.nn.sigmoid(gate_RxTxNxDh.reshape(out.shape))
    return dense(c.hidden_size, False, c, 'o_proj')(out), new_cache
