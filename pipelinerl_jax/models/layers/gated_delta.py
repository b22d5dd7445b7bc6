"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), Qwen3.5's linear-attention layer.

Per value head the layer keeps a state S [Dk, Dv] instead of a KV cache. Token t decays it by
exp(g_t) and writes v_t at key k_t with the delta rule (only the part S does not already
predict, at rate beta_t), then reads it with q_t:

  S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)
  o_t = S_t^T q_t

The layer (`GatedDeltaNet`, transformers' `Qwen3_5GatedDeltaNet`): one projection makes q, k and
v for Hk key heads of Dk and Hv value heads of Dv (Hv a multiple of Hk; value head h reads key
head h // (Hv / Hk)); a depthwise causal convolution of Kc taps over those channels, then SiLU;
q and k L2-normalized (in fp32), q scaled by Dk^-1/2; beta_t = sigmoid(b_t) and
g_t = -exp(A_log) softplus(a_t + dt_bias) from two projections of width Hv; the output through
an RMSNorm over Dv gated by SiLU(z_t) (a fourth projection) and `out_proj`.

Two forms of the same recurrence, fp32 throughout (the state too, whatever the compute dtype):
  * `delta_rule_chunked` (training, prefill): positions in chunks of Tb; within a chunk every
    pairwise term at once (the UT transform of the DeltaNet papers: a unit lower-triangular
    system per chunk, solved through its inverse, `unit_lower_inverse`), a `lax.scan` carries
    S across chunks. No maintained JAX kernel exists for it (flash-linear-attention's are
    Triton kernels for PyTorch), so it is plain jnp.
  * `delta_rule_step` (decode): one token, the recurrence as written. `delta_rule_recurrent`
    scans it over a sequence: the reference the chunked form is tested against.

Packed rows: a token whose segment id differs from the previous token's (and is not 0) starts a
new sequence: the state and the convolution window are reset there, so a packed row computes
exactly what its sequences compute alone. Padding (segment id 0) only follows a row's real
tokens: it writes nothing (beta = 0, g = 0), so the state at the row's end is the state after
its last real token.

The interface decode builds on. A layer's state for R sequences is a `LinearState`:
  conv_RxWcxCc         the convolution's window: the last Wc = Kc - 1 inputs (compute dtype)
  recurrent_RxHvxDkxDv S, fp32
`GatedDeltaNet.__call__(x_RxTxD, segment_ids_RxT, state)` returns (output, new state): with
`state=None` it starts from zeros (training rows); given a state, T > 1 tokens continue it in
the chunked form (a prefill, or its next chunk) and T = 1 takes one recurrent step (decode: no
segment ids needed; a row whose id is 0 keeps its state). The state returned is the one after
each row's last real token. Decoding one token of a hybrid layer: x [R, 1, D] and its layer's
LinearState in, the output and the new LinearState out; `init_state` makes a zero state (a
fresh sequence).

Shape letters (the README's table): R rows, T tokens, D model width, Hk / Hv key / value heads,
Dk / Dv their head dims, Cc convolution channels (2 Hk Dk + Hv Dv), Kc convolution taps, Wc its
window (Kc - 1), J chunks of Tb tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipelinerl_jax.models.layers.common import dense

DEFAULT_CHUNK = 64  # transformers' and flash-linear-attention's chunk length


class LinearState(NamedTuple):
  """A Gated DeltaNet layer's state for R sequences (see the module doc)."""
  conv: jax.Array        # [R, Wc, Cc], compute dtype
  recurrent: jax.Array   # [R, Hv, Dk, Dv], fp32


def dims(config) -> tuple[int, int, int, int, int, int]:
  """(Hk, Hv, Dk, Dv, Cc, Kc) of `config`'s linear layers."""
  c = config
  hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
  dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
  return hk, hv, dk, dv, 2 * hk * dk + hv * dv, c.linear_conv_kernel


def init_state(config, rows: int, dtype: Any = None) -> LinearState:
  """Zeros: the state of R fresh sequences (window in `dtype`, default config.dtype)."""
  _, hv, dk, dv, cc, kc = dims(config)
  return LinearState(jnp.zeros((rows, kc - 1, cc), dtype or config.dtype),
                     jnp.zeros((rows, hv, dk, dv), jnp.float32))


def state_bytes(config, dtype: Any = None) -> int:
  """Bytes of one sequence's state in one linear layer (the window in `dtype`)."""
  _, hv, dk, dv, cc, kc = dims(config)
  return (kc - 1) * cc * jnp.dtype(dtype or config.dtype).itemsize + hv * dk * dv * 4


# ---------------------------------------------------------------------------------------------
# Segments of packed rows.


def segment_index(segment_ids_RxT: jax.Array) -> jax.Array:
  """[R, T] int32: how many sequences have started before or at each token, not counting the
  row's first (0 = the sequence the row, and any state handed in, begins with). Padding (id 0)
  keeps its predecessor's index: it starts nothing."""
  changed = segment_ids_RxT[:, 1:] != segment_ids_RxT[:, :-1]
  starts_RxT = jnp.pad(changed & (segment_ids_RxT[:, 1:] != 0), ((0, 0), (1, 0)))
  return jnp.cumsum(starts_RxT, axis=1, dtype=jnp.int32)


# ---------------------------------------------------------------------------------------------
# The causal convolution.


def causal_conv(x_RxTxCc, kernel_KcxCc, index_RxT, valid_RxT, window_RxWcxCc=None):
  """Depthwise causal convolution (no activation) in fp32: y_t = sum_j kernel[j] x_{t-Kc+1+j},
  the inputs of another sequence (`segment_index`) counted as zeros; `window` holds the Wc inputs
  before the row, part of its first sequence (None: zeros). Returns (y [R, T, Cc] fp32, the
  window after each row's last real token: its last Wc inputs of that token's sequence, what
  the sequence's next token reads; a row with no real token keeps the window it came with)."""
  kc = kernel_KcxCc.shape[0]
  r, t, cc = x_RxTxCc.shape
  if window_RxWcxCc is None:
    window_RxWcxCc = jnp.zeros((r, kc - 1, cc), x_RxTxCc.dtype)
  xs = jnp.concatenate([window_RxWcxCc.astype(x_RxTxCc.dtype), x_RxTxCc], axis=1)
  index = jnp.pad(index_RxT, ((0, 0), (kc - 1, 0)))  # the window: the first sequence's
  kernel = kernel_KcxCc.astype(jnp.float32)
  y = jnp.zeros((r, t, cc), jnp.float32)
  for j in range(kc):  # Kc is 2-4: a few shifted multiply-adds
    same = (index[:, j:j + t] == index_RxT)[..., None]
    y = y + jnp.where(same, xs[:, j:j + t].astype(jnp.float32), 0.0) * kernel[j]
  # The window after the last real token (at -1 when none: the incoming window).
  last_R = jnp.max(jnp.where(valid_RxT, jnp.arange(t), -1), axis=1)
  at_RxWc = last_R[:, None] + 1 + jnp.arange(kc - 1)     # positions in xs
  window = jnp.take_along_axis(xs, at_RxWc[..., None], axis=1)
  same_RxWc = (jnp.take_along_axis(index, at_RxWc, axis=1)
               == jnp.take_along_axis(index, (last_R + kc - 1)[:, None], axis=1))
  return y, jnp.where(same_RxWc[..., None], window, 0).astype(x_RxTxCc.dtype)


def conv_step(x_RxCc, kernel_KcxCc, window_RxWcxCc):
  """One token of `causal_conv`: (y [R, Cc] fp32, the next window)."""
  xs = jnp.concatenate([window_RxWcxCc, x_RxCc[:, None].astype(window_RxWcxCc.dtype)], axis=1)
  y = jnp.einsum('rkc,kc->rc', xs.astype(jnp.float32), kernel_KcxCc.astype(jnp.float32))
  return y, xs[:, 1:]


# ---------------------------------------------------------------------------------------------
# The delta rule. q, k [R, T, Hv, Dk] (normalized, q scaled), v [R, T, Hv, Dv], g and beta
# [R, T, Hv], all fp32; g <= 0.


def delta_rule_step(q_RxHvxDk, k_RxHvxDk, v_RxHvxDv, g_RxHv, beta_RxHv, state_RxHvxDkxDv):
  """One token: (o [R, Hv, Dv], the next state)."""
  s = state_RxHvxDkxDv * jnp.exp(g_RxHv)[..., None, None]
  predicted_RxHvxDv = jnp.einsum('rhkv,rhk->rhv', s, k_RxHvxDk)
  u_RxHvxDv = (v_RxHvxDv - predicted_RxHvxDv) * beta_RxHv[..., None]
  s = s + jnp.einsum('rhk,rhv->rhkv', k_RxHvxDk, u_RxHvxDv)
  return jnp.einsum('rhkv,rhk->rhv', s, q_RxHvxDk), s


def delta_rule_recurrent(q, k, v, g, beta, index_RxT, state=None):
  """`delta_rule_step` token by token, the state reset where `segment_index` moves on: the
  reference for `delta_rule_chunked`. Returns (o [R, T, Hv, Dv], the final state)."""
  r, _, hv, dk = k.shape
  dv = v.shape[-1]
  if state is None:
    state = jnp.zeros((r, hv, dk, dv), jnp.float32)
  starts_RxT = index_RxT != jnp.pad(index_RxT, ((0, 0), (1, 0)))[:, :-1]

  def step(s, token):
    q_t, k_t, v_t, g_t, beta_t, start_R = token
    s = jnp.where(start_R[:, None, None, None], 0.0, s)
    o, s = delta_rule_step(q_t, k_t, v_t, g_t, beta_t, s)
    return s, o

  time_first = lambda x: jnp.moveaxis(x, 1, 0)
  state, o_TxRxHvxDv = jax.lax.scan(step, state, tuple(map(time_first, (q, k, v, g, beta,
                                                                         starts_RxT))))
  return jnp.moveaxis(o_TxRxHvxDv, 0, 1), state


def _exp_where(mask, x):
  """exp(x) where mask, else 0, with finite gradients (x may be large and positive off mask)."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def unit_lower_inverse(a_NxN: jax.Array) -> jax.Array:
  """(I + a)^-1 for strictly lower-triangular a [..., n, n], by recursive block inversion with
  matmuls alone: diagonal blocks of size s, already inverted, pair into blocks of 2s whose
  lower-left block is -inv22 a21 inv11 (as LAPACK's recursive trtri; stable where the inverse
  is, unlike a power series of a, whose terms cancel).

  Not `jax.scipy.linalg.solve_triangular`: on CPU its LAPACK kernel splits a batch over XLA's
  intra-op thread pool and blocks a pool thread until the parts are done, so two programs
  solving at once (the engine's prefill beside the trainer's step) each hold a thread waiting
  for parts no free thread runs, and on a 2-core host both wait forever."""
  n = a_NxN.shape[-1]
  p = 1 << max(n - 1, 0).bit_length()
  lead = a_NxN.shape[:-2]
  a = jnp.pad(a_NxN, [(0, 0)] * len(lead) + [(0, p - n), (0, p - n)])
  matmul = lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)
  inv = jnp.ones(lead + (p, 1, 1), a.dtype)   # the inverted diagonal blocks [..., p / s, s, s]
  size = 1
  while size < p:
    pairs = p // (2 * size)
    blocks = jnp.diagonal(a.reshape(lead + (pairs, 2 * size, pairs, 2 * size)),
                          axis1=-4, axis2=-2)      # [..., 2s, 2s, pairs]
    a21 = jnp.moveaxis(blocks, -1, -3)[..., size:, :size]
    i11, i22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    i21 = -matmul(i22, matmul(a21, i11))
    inv = jnp.concatenate([jnp.concatenate([i11, jnp.zeros_like(i11)], axis=-1),
                           jnp.concatenate([i21, i22], axis=-1)], axis=-2)
    size *= 2
  return inv[..., 0, :n, :n]


def delta_rule_chunked(q, k, v, g, beta, index_RxT, state=None, chunk: int = DEFAULT_CHUNK):
  """The recurrence in chunks of Tb positions (see the module doc); equal to
  `delta_rule_recurrent` in exact arithmetic. Returns (o [R, T, Hv, Dv], the final state).

  Within a chunk, with c_i the cumulative log decay from the chunk's start to position i and
  only pairs of one sequence counted: u = (I + A)^-1 (beta v - beta exp(c) k S), A_ij =
  beta_i exp(c_i - c_j) k_i.k_j for j < i; o = exp(c) q S + (exp(c_i - c_j) q_i.k_j)_{j<=i} u;
  the next S = exp(c_last) S + sum_j exp(c_last - c_j) k_j u_j^T. The state a chunk starts with
  belongs to the sequence of the previous chunk's last token (of the row's first, for the
  first chunk)."""
  r, t, hv, dk = k.shape
  dv = v.shape[-1]
  tb = min(chunk, t)
  pad = -t % tb
  j = (t + pad) // tb
  if state is None:
    state = jnp.zeros((r, hv, dk, dv), jnp.float32)
  # Padded positions write nothing and keep the last sequence going.
  grow = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  index_RxT = jnp.pad(index_RxT, ((0, 0), (0, pad)), mode='edge')
  # [R, Hv, J, Tb, ...]: heads first, then chunks, then positions in a chunk.
  chunked = lambda x: jnp.moveaxis(grow(x).reshape(r, j, tb, *x.shape[2:]), 3, 1)
  q_RxHvxJxTbxDk, k_RxHvxJxTbxDk, v_RxHvxJxTbxDv = chunked(q), chunked(k), chunked(v)
  g_RxHvxJxTb = jnp.moveaxis(grow(g).reshape(r, j, tb, hv), 3, 1)
  beta_RxHvxJxTb = jnp.moveaxis(grow(beta).reshape(r, j, tb, hv), 3, 1)
  index_Rx1xJxTb = index_RxT.reshape(r, 1, j, tb)
  # The sequence each chunk's incoming state belongs to; that of its last token.
  incoming_Rx1xJ = jnp.concatenate([jnp.zeros((r, 1, 1), jnp.int32),
                                    index_Rx1xJxTb[..., :-1, -1]], axis=-1)
  last_Rx1xJ = index_Rx1xJxTb[..., -1]

  c = jnp.cumsum(g_RxHvxJxTb, axis=-1)                                   # [R, Hv, J, Tb]
  same = index_Rx1xJxTb[..., :, None] == index_Rx1xJxTb[..., None, :]    # [R, 1, J, Tb, Tb]
  causal = jnp.tril(jnp.ones((tb, tb), bool))
  decay_RxHvxJxTbxTb = _exp_where(same & causal, c[..., :, None] - c[..., None, :])
  continues = index_Rx1xJxTb == incoming_Rx1xJ[..., None]                # [R, 1, J, Tb]
  from_start = _exp_where(continues, c)                                  # exp(c), or 0

  kk = jnp.einsum('rhjid,rhjkd->rhjik', k_RxHvxJxTbxDk, k_RxHvxJxTbxDk)
  a = beta_RxHvxJxTb[..., None] * kk * decay_RxHvxJxTbxTb * jnp.tril(jnp.ones((tb, tb)), -1)
  rhs = jnp.concatenate([v_RxHvxJxTbxDv, from_start[..., None] * k_RxHvxJxTbxDk], axis=-1)
  solved = jnp.matmul(unit_lower_inverse(a), beta_RxHvxJxTb[..., None] * rhs,
                      precision=jax.lax.Precision.HIGHEST)
  u0_RxHvxJxTbxDv, w_RxHvxJxTbxDk = solved[..., :dv], solved[..., dv:]
  scores = jnp.einsum('rhjid,rhjkd->rhjik', q_RxHvxJxTbxDk, k_RxHvxJxTbxDk) * decay_RxHvxJxTbxTb
  q_read = from_start[..., None] * q_RxHvxJxTbxDk
  survives = index_Rx1xJxTb == last_Rx1xJ[..., None]                    # to the chunk's end
  k_write = _exp_where(survives, c[..., -1:] - c)[..., None] * k_RxHvxJxTbxDk
  keep_RxHvxJ = _exp_where(last_Rx1xJ == incoming_Rx1xJ, c[..., -1])

  def one_chunk(s_RxHvxDkxDv, xs):
    u0, w, qr, sc, kw, keep = xs
    u = u0 - jnp.einsum('rhik,rhkv->rhiv', w, s_RxHvxDkxDv)
    o = jnp.einsum('rhik,rhkv->rhiv', qr, s_RxHvxDkxDv) + jnp.einsum('rhij,rhjv->rhiv', sc, u)
    s_RxHvxDkxDv = keep[..., None, None] * s_RxHvxDkxDv + jnp.einsum('rhik,rhiv->rhkv', kw, u)
    return s_RxHvxDkxDv, o

  chunk_first = lambda x: jnp.moveaxis(x, 2, 0)
  state, o_JxRxHvxTbxDv = jax.lax.scan(one_chunk, state, tuple(map(chunk_first, (
      u0_RxHvxJxTbxDv, w_RxHvxJxTbxDk, q_read, scores, k_write, keep_RxHvxJ))))
  o_RxTxHvxDv = jnp.moveaxis(o_JxRxHvxTbxDv, 0, 2).reshape(r, hv, j * tb, dv)
  return jnp.moveaxis(o_RxTxHvxDv, 1, 2)[:, :t], state


# ---------------------------------------------------------------------------------------------
# The layer.


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(sum x^2 + eps) over the last axis, in fp32 (transformers' and FLA's l2norm)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class CausalConv(nn.Module):
  """The depthwise convolution's kernel, [Kc, 1, Cc] (flax's depthwise layout; HF's conv1d
  weight is its transpose), applied by `causal_conv`, or by `conv_step` to one token of a
  sequence with a window. Returns (y [R, T, Cc] fp32, the next window)."""
  taps: int
  param_dtype: Any

  @nn.compact
  def __call__(self, x_RxTxCc, index_RxT, valid_RxT, window_RxWcxCc):
    cc = x_RxTxCc.shape[-1]
    kernel_KcxCc = self.param('kernel', nn.initializers.lecun_normal(), (self.taps, 1, cc),
                              self.param_dtype)[:, 0]
    if window_RxWcxCc is not None and x_RxTxCc.shape[1] == 1:
      y_RxCc, window = conv_step(x_RxTxCc[:, 0], kernel_KcxCc, window_RxWcxCc)
      return y_RxCc[:, None], jnp.where(valid_RxT[:, :, None], window, window_RxWcxCc)
    return causal_conv(x_RxTxCc, kernel_KcxCc, index_RxT, valid_RxT, window_RxWcxCc)


class GatedRMSNorm(nn.Module):
  """RMSNorm over the last axis, then scale, then times SiLU(gate): transformers'
  `Qwen3_5RMSNormGated` (normalized in fp32, scaled in the input's dtype, gated in fp32)."""
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x, gate):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    y = scale.astype(self.dtype) * x32.astype(self.dtype)
    return (y * nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


def _a_log_init(key, shape, dtype):
  # transformers' init: A uniform in [0.01, 16] (kept away from 0, so log A is finite).
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNet(nn.Module):
  """The linear-attention layer (see the module doc). Returns (output [R, T, D], the
  LinearState after each row's last real token, or None when `state` is None: training rows
  need no state out)."""
  config: Any

  @nn.compact
  def __call__(self, x_RxTxD, segment_ids_RxT, state: LinearState | None = None):
    c = self.config
    hk, hv, dk, dv, cc, kc = dims(c)
    r, t, _ = x_RxTxD.shape
    qkv_RxTxCc = dense(cc, False, c, 'in_proj_qkv')(x_RxTxD)
    z_RxTxHvxDv = dense(hv * dv, False, c, 'in_proj_z')(x_RxTxD).reshape(r, t, hv, dv)
    b_RxTxHv = dense(hv, False, c, 'in_proj_b')(x_RxTxD)
    a_RxTxHv = dense(hv, False, c, 'in_proj_a')(x_RxTxD)
    a_log_Hv = self.param('A_log', _a_log_init, (hv,), c.param_dtype)
    dt_bias_Hv = self.param('dt_bias', nn.initializers.ones, (hv,), c.param_dtype)

    step = state is not None and t == 1
    if segment_ids_RxT is None:
      segment_ids_RxT = jnp.ones((r, t), jnp.int32)
    valid_RxT = segment_ids_RxT != 0
    index_RxT = segment_index(segment_ids_RxT)
    y_RxTxCc, window = CausalConv(kc, c.param_dtype, name='conv1d')(
        qkv_RxTxCc, index_RxT, valid_RxT, None if state is None else state.conv)
    y_RxTxCc = nn.silu(y_RxTxCc).astype(c.dtype)  # as transformers: the conv's output dtype
    q, k, v = jnp.split(y_RxTxCc, [hk * dk, 2 * hk * dk], axis=-1)
    groups = hv // hk  # value head h reads key head h // groups
    q_RxTxHvxDk = jnp.repeat(l2_normalize(q.reshape(r, t, hk, dk)), groups, axis=2) * dk ** -0.5
    k_RxTxHvxDk = jnp.repeat(l2_normalize(k.reshape(r, t, hk, dk)), groups, axis=2)
    v_RxTxHvxDv = v.reshape(r, t, hv, dv).astype(jnp.float32)
    beta_RxTxHv = jax.nn.sigmoid(b_RxTxHv).astype(jnp.float32)
    g_RxTxHv = -jnp.exp(a_log_Hv.astype(jnp.float32)) * jax.nn.softplus(
        a_RxTxHv.astype(jnp.float32) + dt_bias_Hv.astype(jnp.float32))
    # Padding writes nothing and decays nothing.
    beta_RxTxHv = jnp.where(valid_RxT[..., None], beta_RxTxHv, 0.0)
    g_RxTxHv = jnp.where(valid_RxT[..., None], g_RxTxHv, 0.0)

    recurrent = None if state is None else state.recurrent
    if step:
      o, recurrent = delta_rule_step(q_RxTxHvxDk[:, 0], k_RxTxHvxDk[:, 0], v_RxTxHvxDv[:, 0],
                                     g_RxTxHv[:, 0], beta_RxTxHv[:, 0], recurrent)
      o_RxTxHvxDv = o[:, None]
    else:
      o_RxTxHvxDv, recurrent = delta_rule_chunked(
          q_RxTxHvxDk, k_RxTxHvxDk, v_RxTxHvxDv, g_RxTxHv, beta_RxTxHv, index_RxT, recurrent,
          chunk=c.linear_chunk_size)
    o_RxTxHvxDv = GatedRMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name='norm')(
        o_RxTxHvxDv.astype(c.dtype), z_RxTxHvxDv)
    out = dense(c.hidden_size, False, c, 'out_proj')(o_RxTxHvxDv.reshape(r, t, hv * dv))
    if state is None:
      return out, None
    return out, LinearState(window.astype(state.conv.dtype), recurrent)
