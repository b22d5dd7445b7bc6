"""Decoder-only LM in Flax (linen) covering Qwen2 / Qwen2.5, Qwen3 (dense and MoE), Qwen3.5 (the
hybrid of Gated DeltaNet and gated full attention, dense and MoE) and Llama-3.

Parameter pytree (layers stacked on a leading axis L by `nn.scan`; kernels are [in, out]):

  embed/embedding                      [V, D]
  layers/input_norm/scale              [L, D]
  layers/attn/{q,k,v}_proj/kernel      [L, D, N*Dh | K*Dh]    (+ /bias [L, ...] when qkv_bias)
  layers/attn/o_proj/kernel            [L, N*Dh, D]
  layers/attn/{q,k}_norm/scale         [L, Dh]                (only when qk_norm: Qwen3)
  layers/linear_attn/...                                      (a Gated DeltaNet layer's mixer
                                                               in place of attn: Qwen3.5)
  layers/linear_attn/in_proj_qkv/kernel [L, D, Cc]
  layers/linear_attn/in_proj_z/kernel  [L, D, Hv*Dv]
  layers/linear_attn/in_proj_{b,a}/kernel [L, D, Hv]
  layers/linear_attn/conv1d/kernel     [L, Kc, 1, Cc]
  layers/linear_attn/{A_log,dt_bias}   [L, Hv]
  layers/linear_attn/norm/scale        [L, Dv]
  layers/linear_attn/out_proj/kernel   [L, Hv*Dv, D]
  layers/post_attn_norm/scale          [L, D]
  layers/mlp/{gate,up}_proj/kernel     [L, D, F]
  layers/mlp/down_proj/kernel          [L, F, D]
  layers/moe/router/kernel             [L, D, X]              (an MoE layer's MLP: layers/moe.py)
  layers/moe/{gate,up}_proj/kernel     [L, X, D, I]
  layers/moe/down_proj/kernel          [L, X, I, D]
  layers/moe/shared_expert/{gate,up}_proj/kernel [L, D, Is]   (Qwen3.5-MoE's shared expert,
  layers/moe/shared_expert/down_proj/kernel [L, Is, D]         beside the routed ones, and its
  layers/moe/shared_expert_gate/kernel [L, D, 1]               sigmoid gate)
  final_norm/scale                     [D]
  lm_head/kernel                       [D, V]                 (absent when embeddings are tied)

Shape letters (the README's table): R rows, T query tokens, S key/cache positions, D model
width, N query heads, K key/value heads, Q = N // K, Dh head dim, E rotary frequencies (Dh / 2),
F MLP width, V vocab, L layers; J chunks of Tb positions (logits are made a chunk at a time);
for mixtures of experts X experts, Xk experts per token, I expert width, Is the shared expert's
width, Ls MoE layers; for Gated DeltaNet layers (layers/gated_delta.py) Hk / Hv key / value
heads of Dk / Dv, Cc convolution channels, Kc convolution taps.

Layers are stacked and scanned in runs of one kind (`ModelConfig.layer_groups`): a model whose
layers are all alike (Qwen3-30B-A3B: every layer MoE) is one scan over `layers`; a change of kind
(Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`; Qwen3.5's `layer_types`, three Gated
DeltaNet layers to one full-attention layer) splits the stack into runs `layers_0`, `layers_1`,
..., each its own scan over its own stacked params (and LoRA adapters). Runs keep one scan's
compile time and memory layout for the common case and cost one more scan per change of kind.

Qwen3.5's full attention (`attention_output_gate`) has q_proj emit each head's query and a gate,
and multiplies attention's output by sigmoid(gate) before o_proj; RoPE turns the first
`partial_rotary_factor` of each head's dims; its RMSNorms scale by (1 + w) in fp32
(`norm_zero_centered`).

Every function that takes `params` also takes `lora.Adapted(base, adapters, scale)`: the same
model with a low-rank delta on its projections (models/layers/lora.py), computed unmerged.

Two entry points share one module:
  * training rows: `token_logprobs` -- packed rows with segment ids; attention never crosses a
    segment (models/layers/attention.py: dense, or blockwise with memory linear in the row length);
    returns log pi(target) and the entropy of each position's distribution.
  * generation: `decode_paged` -- writes the new tokens' keys/values into a paged KV cache
    (models/layers/paged_attention.py) at their positions and attends to every position at or
    before each query's; the engine's path. `decode` does the same over a dense [La, R, S, K, Dh]
    cache: the reference the tests compare against. A hybrid's cache has keys and values for
    its La attention layers only, and beside them each row's `gated_delta.LinearState` in its
    Ll linear layers, stacked [Ll, R, ...]: a call continues each row's state from where it
    stands and returns the state after the row's last real token. A token is real when its KV
    lands somewhere: a position inside the dense cache, or on a page of the row's block table
    other than the trash page; padding, free slots and parked rows keep their state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipelinerl_jax.models.layers import attention as attention_lib
from pipelinerl_jax.models.layers import full_attention
from pipelinerl_jax.models.layers import gated_delta
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models.layers import paged_attention
from pipelinerl_jax.models.layers.common import MLP, dense, rms_norm


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling; `kind` is HF's rope_type ('linear' or 'llama3')."""
  kind: str
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


class LayerGroup(NamedTuple):
  """A run of consecutive layers of one kind, scanned together over params stacked under
  `name`: layers first..first+count-1, MoE or dense MLP, Gated DeltaNet or full attention."""
  name: str
  first: int
  count: int
  moe: bool
  linear: bool = False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics. Built from an HF config.json by `hf.schema.load_config`."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False          # Qwen2 has q/k/v biases, Llama and Qwen3 do not.
  qk_norm: bool = False           # Qwen3: an RMSNorm over Dh on every query and key head
  # Qwen3.5: q_proj also emits a gate per head, attention's output is multiplied by its sigmoid.
  attention_output_gate: bool = False
  partial_rotary_factor: float = 1.0  # RoPE turns the first factor * Dh dims of each head
  norm_zero_centered: bool = False    # Qwen3.5's RMSNorm: x * (1 + w) in fp32, w starting at 0
  tie_embeddings: bool = False
  max_position_embeddings: int = 32768
  architecture: str = 'Qwen2ForCausalLM'
  param_dtype: str = 'float32'    # master weights
  dtype: str = 'float32'          # activations / matmuls
  # Logits in fp32 (keeps trainer and sampler log-probs close); False: the lm_head matmul in
  # `dtype` with fp32 accumulation, forward and backward (logsumexp and entropy stay fp32).
  lm_head_fp32: bool = True
  remat: bool = False             # rematerialize each layer in the backward pass
  remat_policy: str = 'full'      # with remat, what a layer keeps: REMAT_POLICIES
  # Training rows only (decode always attends densely to its cache). 'blockwise' keeps one
  # block_q x block_kv tile of scores at a time, where 'dense' builds [T, T] per head: 30 GB for
  # one 16k row of a 7B model. Blocks of 1024 keep the loop short on GPUs (each iteration costs
  # a few kernel launches) while a tile stays ~100 MB; a row shorter than a block is one tile.
  # 'cudnn': cuDNN's fused kernel over the packer's segment spans (Hopper GPUs).
  attention: str = 'blockwise'    # 'dense' | 'blockwise' | 'cudnn'
  attention_block_q: int = 1024
  attention_block_kv: int = 1024
  # Generation: how a decode step reads the paged KV cache (layers/paged_attention.py); set by the
  # engine from generation.decode_attention.
  decode_attention: str = 'xla'   # 'xla' | 'pallas' | 'cudnn'
  # Mixture of experts (Qwen3-MoE, Qwen3.5-MoE: layers/moe.py): the layers in `moe_layers`
  # replace their MLP by num_experts experts of width moe_intermediate_size, num_experts_per_tok
  # per token; () = a dense model. Qwen3.5-MoE adds a shared expert every token goes through, of
  # width shared_expert_intermediate_size (0 = none), its output scaled by a sigmoid gate.
  # `moe_dispatch`: 'ragged' (tokens sorted by expert, grouped matmul) or 'dense' (every expert
  # on every token: the reference).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  shared_expert_intermediate_size: int = 0
  moe_layers: tuple[int, ...] = ()
  moe_dispatch: str = 'ragged'
  # Hybrid models (Qwen3.5, layers/gated_delta.py): the layers in `linear_layers` replace
  # attention by a Gated DeltaNet of Hk key heads of Dk, Hv value heads of Dv and a causal
  # convolution of Kc taps; () = every layer full attention. `linear_chunk_size`: the chunked
  # delta rule's chunk length (training and prefill).
  linear_layers: tuple[int, ...] = ()
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 0
  linear_chunk_size: int = gated_delta.DEFAULT_CHUNK

  def __post_init__(self):
    if self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f'attention={self.attention!r} is not one of '
                       f'{attention_lib.IMPLEMENTATIONS}')
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f'remat_policy={self.remat_policy!r} is not one of {tuple(REMAT_POLICIES)}')
    if self.decode_attention not in paged_attention.IMPLEMENTATIONS:
      raise ValueError(f'decode_attention={self.decode_attention!r} is not one of '
                       f'{paged_attention.IMPLEMENTATIONS}')
    if self.attention_block_q < 1 or self.attention_block_kv < 1:
      raise ValueError(f'attention blocks must be >= 1, got attention_block_q='
                       f'{self.attention_block_q}, attention_block_kv={self.attention_block_kv}')
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even (RoPE rotates pairs)')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of '
                       f'num_kv_heads={self.num_kv_heads}')
    layers = self._layer_indices('moe_layers')
    if layers and not (self.num_experts >= 1 and 1 <= self.num_experts_per_tok <= self.num_experts
                       and self.moe_intermediate_size >= 1):
      raise ValueError(f'MoE layers need num_experts >= num_experts_per_tok >= 1 and '
                       f'moe_intermediate_size >= 1, got {self.num_experts}, '
                       f'{self.num_experts_per_tok}, {self.moe_intermediate_size}')
    if self.shared_expert_intermediate_size < 0 or (self.shared_expert_intermediate_size
                                                    and not layers):
      raise ValueError(f'shared_expert_intermediate_size={self.shared_expert_intermediate_size} '
                       'needs MoE layers and must be >= 0')
    if self.moe_dispatch not in moe_lib.DISPATCHES:
      raise ValueError(f'moe_dispatch={self.moe_dispatch!r} is not one of {moe_lib.DISPATCHES}')
    if not (0 < self.partial_rotary_factor <= 1 and self.rotary_dim >= 2
            and self.rotary_dim % 2 == 0):
      raise ValueError(f'partial_rotary_factor={self.partial_rotary_factor} of head_dim='
                       f'{self.head_dim} must turn an even number of dims >= 2')
    if self._layer_indices('linear_layers'):
      hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
      if min(hk, hv, self.linear_key_head_dim, self.linear_value_head_dim) < 1 or hv % hk:
        raise ValueError(f'Gated DeltaNet layers need key and value heads and head dims >= 1, '
                         f'value heads a multiple of key heads, got {hk}, {hv}, '
                         f'{self.linear_key_head_dim}, {self.linear_value_head_dim}')
      if self.linear_conv_kernel < 1 or self.linear_chunk_size < 1:
        raise ValueError(f'linear_conv_kernel={self.linear_conv_kernel} and linear_chunk_size='
                         f'{self.linear_chunk_size} must be >= 1')

  def _layer_indices(self, name: str) -> tuple[int, ...]:
    """Field `name` as a tuple (set so), checked: distinct layer indices in order."""
    layers = tuple(getattr(self, name))
    object.__setattr__(self, name, layers)
    if layers != tuple(sorted(set(layers))) or any(not 0 <= i < self.num_layers for i in layers):
      raise ValueError(f'{name}={layers} must be distinct layer indices below '
                       f'num_layers={self.num_layers}, in order')
    return layers

  @property
  def is_moe(self) -> bool:
    return bool(self.moe_layers)

  @property
  def is_hybrid(self) -> bool:
    """Gated DeltaNet layers among full-attention ones (Qwen3.5)."""
    return bool(self.linear_layers)

  @property
  def attention_layers(self) -> tuple[int, ...]:
    """The full-attention layers: the ones with a KV cache."""
    linear = set(self.linear_layers)
    return tuple(i for i in range(self.num_layers) if i not in linear)

  @property
  def layer_groups(self) -> tuple[LayerGroup, ...]:
    """The model's runs of layers (see the module docstring): one group `layers` when every
    layer is of one kind, else `layers_0`, `layers_1`, ... in order. A property, so that the
    layers' code, which reads the config by attribute, finds the runs without importing this
    module (layers/lora.py stacks adapters as the runs stack kernels)."""
    moe, linear = set(self.moe_layers), set(self.linear_layers)
    runs = []
    for i in range(self.num_layers):
      kind = (i in moe, i in linear)
      if runs and runs[-1][2] == kind:
        runs[-1][1] += 1
      else:
        runs.append([i, 1, kind])
    names = ['layers'] if len(runs) == 1 else [f'layers_{j}' for j in range(len(runs))]
    return tuple(LayerGroup(n, first, count, *kind)
                 for n, (first, count, kind) in zip(names, runs))

  @property
  def rotary_dim(self) -> int:
    """The dims of each head RoPE turns (transformers: int(head_dim * partial_rotary_factor))."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def num_params(self) -> int:
    d, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    attention = d * (q * (2 if self.attention_output_gate else 1) + 2 * kv) + q * d
    if self.qkv_bias:
      attention += q + 2 * kv
    if self.qk_norm:
      attention += 2 * self.head_dim
    moe, linear = len(self.moe_layers), len(self.linear_layers)
    experts = (self.num_experts * 3 * d * self.moe_intermediate_size + d * self.num_experts
               + self.shared_expert_params)
    mixers = (l - linear) * attention + linear * self.linear_attention_params
    return (v * d * (1 if self.tie_embeddings else 2) + mixers + l * 2 * d
            + (l - moe) * 3 * d * f + moe * experts + d)

  @property
  def shared_expert_params(self) -> int:
    """Params of one MoE layer's shared expert and its gate (0 without one)."""
    width = self.shared_expert_intermediate_size
    return (3 * width + 1) * self.hidden_size if width else 0

  @property
  def linear_attention_params(self) -> int:
    """Params of one Gated DeltaNet mixer (0 without linear layers)."""
    if not self.linear_layers:
      return 0
    hk, hv, dk, dv, cc, kc = gated_delta.dims(self)
    return (self.hidden_size * (cc + hv * dv + 2 * hv) + kc * cc + 2 * hv + dv
            + hv * dv * self.hidden_size)

  @property
  def num_active_params(self) -> int:
    """Params a token uses: num_params less the experts it is not routed to."""
    idle = self.num_experts - self.num_experts_per_tok
    return self.num_params - len(self.moe_layers) * idle * 3 * self.hidden_size * (
        self.moe_intermediate_size)


# What a rematerialized layer keeps for its backward pass besides its input (the rest is
# recomputed): 'full' nothing; 'attention' attention's inputs, output and statistics, so only
# the projections, the MLP and the elementwise work are recomputed; 'dots' also every weight
# matmul's output, so only elementwise work is. More kept: less recomputed, more memory.
REMAT_POLICIES = {'full': 'nothing but the layer input', 'attention': 'attention residuals',
                  'dots': 'attention residuals and every weight matmul output'}


def remat_policy(name: str):
  """The `jax.checkpoint` policy of a REMAT_POLICIES name (None: save nothing)."""
  if name == 'full':
    return None
  names = jax.checkpoint_policies.save_only_these_names(*attention_lib.SAVED_NAMES)

  def attention(prim, *args, **params):
    # cuDNN's output and softmax statistics leave its forward primitive unnamed.
    return prim.name == attention_lib.CUDNN_FORWARD_PRIMITIVE or names(prim, *args, **params)

  if name == 'attention':
    return attention
  if name == 'dots':
    return jax.checkpoint_policies.save_from_both_policies(
        attention, jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  raise ValueError(f'remat_policy={name!r} is not one of {tuple(REMAT_POLICIES)}')


class KVCache(NamedTuple):
  """A generation cache: keys and values of the La attention layers ([La, R, S, K, Dh] each,
  or a paged pool [La, A, K, Z, Dh] read through block tables), and for a hybrid each row's
  Gated DeltaNet state in its Ll linear layers (`gated_delta.LinearState` of [Ll, R, ...]
  arrays; None for a model without linear layers)."""
  k: jax.Array
  v: jax.Array
  linear: gated_delta.LinearState | None = None


class _CacheCarry(NamedTuple):
  """What the layer scan carries in generation: the KVCache of every layer, the index of the
  attention layer and of the linear layer to run next (each kind counts its own), and for a
  paged cache each row's block table [R, W] (None: dense)."""
  k: jax.Array
  v: jax.Array
  layer: jax.Array
  table: jax.Array | None
  linear: gated_delta.LinearState | None
  linear_layer: jax.Array


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
  """Zeros: R fresh rows of `max_len` positions (a hybrid's linear states at their start)."""
  shape = (len(config.attention_layers), batch_size, max_len, config.num_kv_heads,
           config.head_dim)
  dtype = dtype or config.dtype
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                 init_linear_states(config, batch_size, dtype))


def init_linear_states(config: ModelConfig, rows: int, dtype: Any = None
                       ) -> gated_delta.LinearState | None:
  """The zero state of `rows` fresh sequences in every linear layer, [Ll, R, ...] (None for a
  model without linear layers)."""
  if not config.is_hybrid:
    return None
  one = gated_delta.init_state(config, rows, dtype)
  return jax.tree.map(lambda x: jnp.zeros((len(config.linear_layers), *x.shape), x.dtype), one)


def _real_tokens(cache: _CacheCarry, positions_RxT: jax.Array) -> jax.Array:
  """[R, T] int32, 1 where a generation call's token is real (its KV lands somewhere: inside
  the dense cache, or on a page other than the trash page), else 0: the segment ids a linear
  layer runs with, so that padding and rows with nothing to decode keep their state."""
  if cache.table is None:
    real_RxT = positions_RxT < cache.k.shape[2]
  else:
    page_RxT, _ = paged_attention.locate(cache.table, positions_RxT, cache.k.shape[3])
    real_RxT = page_RxT != paged_attention.TRASH_PAGE
  return real_RxT.astype(jnp.int32)


class DecoderLayer(nn.Module):
  """One pre-norm block. `nn.scan` calls it with carry (x, cache) where cache is None (training:
  segment ids say who attends to whom) or a `_CacheCarry` over all layers (generation: the
  cache mask, or a paged cache's positions, do).

  `moe`: the MLP is the experts (models/layers/moe.py), which also take this layer's slice of the
  replayed routes [R, T, Xk] (scanned) and the mask of tokens that replay them (broadcast), and
  whose `LayerRoutes` the scan stacks; `mesh` / `batch_axes` place the experts.

  `linear`: the mixer is a Gated DeltaNet (layers/gated_delta.py) in place of attention; in
  training rows the segment ids reset its state."""
  config: ModelConfig
  moe: bool = False
  mesh: Any = None
  batch_axes: tuple[str, ...] = ()
  linear: bool = False

  @nn.compact
  def __call__(self, carry, positions_RxT, segment_ids_RxT, mask_RxTxS, spans, replay_RxT,
               routes_RxTxXk):
    x_RxTxD, cache = carry
    c = self.config
    norm = lambda name: rms_norm(c, name)
    if self.linear:
      mixer = gated_delta.GatedDeltaNet(c, name='linear_attn')
      if cache is None:
        h, _ = mixer(norm('input_norm')(x_RxTxD), segment_ids_RxT)
      else:  # this layer's slice of the rows' states in, its next state back in place
        i = cache.linear_layer
        state = jax.tree.map(lambda all_: jax.lax.dynamic_index_in_dim(all_, i, keepdims=False),
                             cache.linear)
        h, state = mixer(norm('input_norm')(x_RxTxD), _real_tokens(cache, positions_RxT),
                         state)
        cache = cache._replace(linear=jax.tree.map(
            lambda all_, new: jax.lax.dynamic_update_index_in_dim(all_, new, i, 0),
            cache.linear, state), linear_layer=i + 1)
    else:
      h, cache = full_attention.Attention(c, name='attn')(
          norm('input_norm')(x_RxTxD), positions_RxT, segment_ids_RxT, mask_RxTxS, cache, spans)
      if cache is not None:
        cache = cache._replace(layer=cache.layer + 1)  # the next attention layer's index
    x_RxTxD = x_RxTxD + h
    routes = None
    if self.moe:
      tokens_RxT = None if segment_ids_RxT is None else segment_ids_RxT != 0
      h, routes = moe_lib.MoE(c, self.mesh, self.batch_axes, name='moe')(
          norm('post_attn_norm')(x_RxTxD), tokens_RxT, routes_RxTxXk, replay_RxT)
    else:
      h = MLP(c, name='mlp')(norm('post_attn_norm')(x_RxTxD))
    x_RxTxD = x_RxTxD + h
    return (x_RxTxD, cache), routes


class Transformer(nn.Module):
  """Returns final-norm hidden states [R, T, D], the updated cache (None without one) and, for
  an MoE model, the `moe.LayerRoutes` of its Ls MoE layers stacked on a leading axis (else
  None).

  Training rows pass `segment_ids_RxT` (and no cache), and for cuDNN attention `spans`, the
  packer's (segment_starts_RxG, segment_lengths_RxG); generation passes a `KVCache` (a hybrid's
  with its rows' linear states) and the mask of cache slots each token sees, or a paged pool in
  a KVCache and each row's block table. An MoE model
  may be handed the experts to replay, `routes_RxTxLsxXk`, for the tokens in `replay_RxT`.
  `mesh` / `batch_axes`: where the experts run (models/layers/moe.py, `expert_parallel`).
  """
  config: ModelConfig
  mesh: Any = None
  batch_axes: tuple[str, ...] = ()

  @nn.compact
  def __call__(self, tokens_RxT, positions_RxT, segment_ids_RxT=None, mask_RxTxS=None,
               cache: KVCache | None = None, table_RxW=None,
               spans=None, routes_RxTxLsxXk=None, replay_RxT=None):
    c = self.config
    if cache is not None and c.is_hybrid and cache.linear is None:
      raise ValueError(f'{c.architecture}: a generation cache without the states of its Gated '
                       f'DeltaNet layers {c.linear_layers} (KVCache.linear)')
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
                     embedding_init=nn.initializers.normal(0.02), name='embed')
    x_RxTxD = embed(tokens_RxT)
    layer_cls = (nn.remat(DecoderLayer, prevent_cse=False, policy=remat_policy(c.remat_policy))
                 if c.remat else DecoderLayer)
    zero = jnp.zeros((), jnp.int32)
    carry = None if cache is None else _CacheCarry(cache.k, cache.v, zero, table_RxW,
                                                   cache.linear, zero)
    routes, moe_seen = [], 0
    for group in c.layer_groups:
      replayed = None  # this run's slice of the replayed routes, layers first: [n, R, T, Xk]
      if group.moe and routes_RxTxLsxXk is not None:
        replayed = jnp.moveaxis(routes_RxTxLsxXk[:, :, moe_seen:moe_seen + group.count], 2, 0)
      layers = nn.scan(layer_cls, variable_axes={'params': 0, lora_lib.COLLECTION: 0},
                       split_rngs={'params': True},
                       in_axes=(nn.broadcast,) * 5 + (0,), length=group.count)(
                           c, group.moe, self.mesh, self.batch_axes, group.linear,
                           name=group.name)
      (x_RxTxD, carry), group_routes = layers(
          (x_RxTxD, carry), positions_RxT, segment_ids_RxT, mask_RxTxS, spans,
          replay_RxT if replayed is not None else None, replayed)
      if group.moe:
        routes.append(group_routes)
        moe_seen += group.count
    x_RxTxD = rms_norm(c, 'final_norm')(x_RxTxD)
    if not c.tie_embeddings and self.is_initializing():
      # Created here so init makes it; applied by `logits`, which may run in fp32 / chunks.
      dense(c.vocab_size, False, c, 'lm_head')(x_RxTxD)
    new_cache = None if cache is None else KVCache(carry.k, carry.v, carry.linear)
    stacked = (jax.tree.map(lambda *a: jnp.concatenate(a), *routes) if routes else None)
    return x_RxTxD, new_cache, stacked


# ---------------------------------------------------------------------------------------------
# Pure functions over (params, config, arrays).


def cache_mask(positions_RxT: jax.Array, cache_len: int) -> jax.Array:
  """A query at position p sees cache slots 0..p (slot j holds the token at position j)."""
  return jnp.arange(cache_len)[None, None, :] <= positions_RxT[:, :, None]


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
  """Random params (normal(0.02) kernels, unit norms). Jitted: eager init is ~4x slower."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  # The params do not depend on the attention kernel; init's one-token call needs none of
  # cuDNN's (a GPU, bf16, the packer's spans).
  config = dataclasses.replace(config, attention='dense')
  init = lambda key: Transformer(config).init(key, tokens, tokens, jnp.ones((1, 1), jnp.int32))
  return jax.jit(init)(rng)['params']


def hidden_states(params, config: ModelConfig, tokens_RxT, positions_RxT, segment_ids_RxT,
                  spans=None):
  h, _, _ = Transformer(config).apply(lora_lib.variables(params), tokens_RxT, positions_RxT,
                                      segment_ids_RxT, spans=spans)
  return h


@jax.custom_vjp
def _low_precision_head(h_RxTxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
  """fp32 logits of h (compute dtype) and w (master dtype) multiplied in h's dtype with fp32
  accumulation, forward and backward: autodiff would multiply the fp32 logits' gradient by the
  weights in fp32, off the bf16 tensor cores, in the two backward matmuls."""
  return jnp.einsum('btd,dv->btv', h_RxTxD, w_DxV.astype(h_RxTxD.dtype),
                    preferred_element_type=jnp.float32)


def _low_precision_head_fwd(h_RxTxD, w_DxV):
  return _low_precision_head(h_RxTxD, w_DxV), (h_RxTxD, w_DxV)


def _low_precision_head_bwd(residuals, dz_RxTxV):
  h_RxTxD, w_DxV = residuals
  dz_RxTxV = dz_RxTxV.astype(h_RxTxD.dtype)
  dh = jnp.einsum('btv,dv->btd', dz_RxTxV, w_DxV.astype(h_RxTxD.dtype),
                  preferred_element_type=jnp.float32)
  dw = jnp.einsum('btd,btv->dv', h_RxTxD, dz_RxTxV, preferred_element_type=jnp.float32)
  return dh.astype(h_RxTxD.dtype), dw.astype(w_DxV.dtype)


_low_precision_head.defvjp(_low_precision_head_fwd, _low_precision_head_bwd)


def logits(params, config: ModelConfig, h_RxTxD: jax.Array, *, fp32_head: bool | None = None
           ) -> jax.Array:
  """Logits [R, T, V] in fp32. The head multiplies in fp32 when `fp32_head` (default:
  config.lm_head_fp32), else in config.dtype with fp32 accumulation."""
  params = lora_lib.base_of(params)  # (the head has no adapter)
  if config.tie_embeddings:
    w_DxV = params['embed']['embedding'].T
  else:
    w_DxV = params['lm_head']['kernel']
  fp32_head = config.lm_head_fp32 if fp32_head is None else fp32_head
  with jax.named_scope('lm_head'):  # the profile breakdown finds the head by this
    if fp32_head or jnp.dtype(config.dtype) == jnp.float32:
      dtype = jnp.float32 if fp32_head else config.dtype
      return jnp.einsum('btd,dv->btv', h_RxTxD.astype(dtype), w_DxV.astype(dtype),
                        preferred_element_type=jnp.float32)
    return _low_precision_head(h_RxTxD.astype(config.dtype), w_DxV)


def forward_logits(params, config: ModelConfig, tokens_RxT, positions_RxT=None,
                   segment_ids_RxT=None):
  """Full-sequence logits; defaults: positions 0..T-1, a single segment per row."""
  b, t = tokens_RxT.shape
  if positions_RxT is None:
    positions_RxT = jnp.broadcast_to(jnp.arange(t), (b, t))
  if segment_ids_RxT is None:
    segment_ids_RxT = jnp.ones((b, t), jnp.int32)
  return logits(params, config, hidden_states(params, config, tokens_RxT, positions_RxT,
                                              segment_ids_RxT))


def token_logprobs(params, config: ModelConfig, tokens_RxT, targets_RxT, positions_RxT,
                   segment_ids_RxT, temperature: float = 1.0, chunk_size: int = 1024,
                   spans=None):
  """log pi(target_t | tokens_<=t) and the entropy of that distribution, both [R, T] fp32.

  Logits are made `chunk_size` positions at a time so a [R, T, V] array never exists at once
  (V is 152k for Qwen2.5); rematerialized in the backward pass for the same reason. `spans`:
  the packer's (segment_starts_RxG, segment_lengths_RxG), which cuDNN attention needs.
  """
  h_RxTxD = hidden_states(params, config, tokens_RxT, positions_RxT, segment_ids_RxT, spans)
  return head_logprobs(params, config, h_RxTxD, targets_RxT, temperature, chunk_size)


def token_logprobs_routed(params, config: ModelConfig, tokens_RxT, targets_RxT, positions_RxT,
                          segment_ids_RxT, *, routes_RxTxLsxXk=None, replay_RxT=None,
                          mesh=None, batch_axes: tuple[str, ...] = (),
                          temperature: float = 1.0, chunk_size: int = 1024, spans=None):
  """`token_logprobs` and, for an MoE model, its layers' `moe.LayerRoutes` [Ls, ...] (None for
  a dense model): (logp [R, T], entropy [R, T], routes). Tokens in `replay_RxT` go to the experts
  of `routes_RxTxLsxXk` (routing replay); `mesh` / `batch_axes` place the experts."""
  h_RxTxD, _, routes = Transformer(config, mesh, batch_axes).apply(
      lora_lib.variables(params), tokens_RxT, positions_RxT, segment_ids_RxT, spans=spans,
      routes_RxTxLsxXk=routes_RxTxLsxXk, replay_RxT=replay_RxT)
  logp_RxT, entropy_RxT = head_logprobs(params, config, h_RxTxD, targets_RxT, temperature,
                                        chunk_size)
  return logp_RxT, entropy_RxT, routes


def head_logprobs(params, config: ModelConfig, h_RxTxD, targets_RxT, temperature: float = 1.0,
                  chunk_size: int = 1024):
  """log pi(target) and the entropy at each position of final hidden states, chunk by chunk
  (see `token_logprobs`)."""
  b, t, d = h_RxTxD.shape
  chunk = min(chunk_size, t)
  pad = (-t) % chunk
  h_RxTxD = jnp.pad(h_RxTxD, ((0, 0), (0, pad), (0, 0)))
  targets_RxT = jnp.pad(targets_RxT, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  h_JxRxTbxD = h_RxTxD.reshape(b, n, chunk, d).swapaxes(0, 1)
  tg_JxRxTb = targets_RxT.reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(h_RxTbxD, tg_RxTb):
    z_RxTbxV = logits(params, config, h_RxTbxD) / temperature
    logz_RxTb = jax.nn.logsumexp(z_RxTbxV, axis=-1)
    logp_RxTb = jnp.take_along_axis(z_RxTbxV, tg_RxTb[..., None], axis=-1)[..., 0] - logz_RxTb
    p_RxTbxV = jax.nn.softmax(z_RxTbxV, axis=-1)
    entropy_RxTb = logz_RxTb - jnp.sum(p_RxTbxV * z_RxTbxV, axis=-1)
    return logp_RxTb, entropy_RxTb

  logp_JxRxTb, ent_JxRxTb = jax.lax.map(lambda a: one_chunk(*a), (h_JxRxTbxD, tg_JxRxTb))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp_JxRxTb), unchunk(ent_JxRxTb)


def decode(params, config: ModelConfig, tokens_RxT, positions_RxT, cache: KVCache):
  """Runs T new tokens per row against the cache: returns (logits [R, T, V], new cache).

  Prefill is T = prompt length (pad with positions >= cache length); a decode step is T = 1.
  A hybrid's linear layers continue each row's state in the cache: the chunked form for T > 1,
  the recurrent step for T = 1.
  """
  mask = cache_mask(positions_RxT, cache.k.shape[2])
  h, new_cache, _ = Transformer(config).apply(lora_lib.variables(params), tokens_RxT,
                                              positions_RxT, mask_RxTxS=mask, cache=cache)
  return logits(params, config, h), new_cache


def decode_paged(params, config: ModelConfig, tokens_RxT, positions_RxT,
                 pool: paged_attention.PagedKVCache, table_RxW,
                 linear: gated_delta.LinearState | None = None):
  """Runs T new tokens per row against a paged cache: returns (hidden states [R, T, D], new
  pool, the rows' new linear states (None for a model without linear layers), experts
  [Ls, R, T, Xk] each token was routed to in the Ls MoE layers, or None for a dense model).
  Row r's tokens go to the pages of `table_RxW[r]`; a position past the table (padding) writes
  to the trash page, and a token on the trash page leaves the row's linear state as it was.
  The table's width W bounds what a query reads: W * Z positions. `linear`: each row's state
  in a hybrid's linear layers, [Ll, R, ...]. The caller makes the logits it needs (`logits`)."""
  h, new_cache, routes = Transformer(config).apply(
      lora_lib.variables(params), tokens_RxT, positions_RxT,
      cache=KVCache(pool.k, pool.v, linear), table_RxW=table_RxW)
  return (h, paged_attention.PagedKVCache(new_cache.k, new_cache.v), new_cache.linear,
          None if routes is None else routes.used)
