"""Hugging Face checkpoints <-> the parameter pytree of `models.transformer`.

One name map (`name_map`) ties every HF tensor name to a pytree leaf; loading, saving and weight
streaming (`hf_tensors`) all read it, so the three cannot drift apart.

Checkpoints are safetensors files: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} (offsets relative to the end of the header), then raw bytes.
The reader and writer here are ours so that bf16 maps to `ml_dtypes.bfloat16` and loading can
memory-map: `load_params` builds each leaf with `jax.make_array_from_callback`, whose callback
copies only one device's slice out of the mapped file, so the whole model never sits on one device
(or in host memory) at once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.models import lora as lora_lib
from pipelinerl_jax.models import transformer
from pipelinerl_jax.models.transformer import ModelConfig, RopeScaling

CONFIG_FILE = 'config.json'
GENERATION_CONFIG_FILE = 'generation_config.json'
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_SHARD_RE = re.compile(r'model-\d{5}-of-\d{5}\.safetensors$')


@dataclasses.dataclass(frozen=True)
class _Family:
  """What an architecture is in `ModelConfig` terms, and transformers' per-class defaults for
  fields a config.json may leave out."""
  model_type: str
  qkv_bias: bool
  qk_norm: bool
  max_positions: int
  head_dim: int | None = None  # None: hidden_size / num_attention_heads
  moe: bool = False            # Qwen3-MoE's experts (`_moe_from_hf`)


_FAMILIES = {
    'Qwen2ForCausalLM': _Family('qwen2', qkv_bias=True, qk_norm=False, max_positions=32768),
    'Qwen3ForCausalLM': _Family('qwen3', qkv_bias=False, qk_norm=True, max_positions=32768,
                                head_dim=128),
    'LlamaForCausalLM': _Family('llama', qkv_bias=False, qk_norm=False, max_positions=2048),
    'Qwen3MoeForCausalLM': _Family('qwen3_moe', qkv_bias=False, qk_norm=True,
                                   max_positions=32768, moe=True),
}
_ARCHITECTURES = tuple(_FAMILIES)
_MODEL_TYPES = {family.model_type: arch for arch, family in _FAMILIES.items()}
_OVERRIDABLE = ('param_dtype', 'dtype', 'lm_head_fp32', 'remat', 'remat_policy', 'attention',
                'attention_block_q', 'attention_block_kv', 'moe_dispatch')
# transformers' Qwen3MoeConfig defaults, for fields a config.json leaves out.
_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=False, decoder_sparse_step=1)

_ST_DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32),
    'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8),
    'BOOL': np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_SAVE_DTYPES = {'bfloat16': 'BF16', 'float32': 'F32', 'float16': 'F16'}


# ---------------------------------------------------------------------------------------------
# config.json


def check_model_dir(model_dir: str, key: str) -> str:
  """`model_dir`, when it holds an HF config; else a FileNotFoundError naming `key` (the flag or
  config key that set it)."""
  if not os.path.isfile(os.path.join(model_dir, CONFIG_FILE)):
    raise FileNotFoundError(f'{key}: no {CONFIG_FILE} in {model_dir}')
  return model_dir


def load_config(model_dir: str | os.PathLike, **overrides) -> ModelConfig:
  """ModelConfig from `model_dir/config.json`.

  Overrides set the numerics only: param_dtype, dtype, lm_head_fp32, remat, remat_policy, the
  attention implementation (attention, attention_block_q, attention_block_kv) and how an MoE
  model's experts are computed (moe_dispatch).
  """
  path = Path(model_dir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f'{path}: no such file (expected an HF model directory)')
  try:
    hf = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None
  return config_from_hf(hf, source=str(path), **overrides)


TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'tokenizer.model')


def load_tokenizer(model_dir: str | os.PathLike):
  """The model dir's tokenizer (transformers' AutoTokenizer), checked: without tokenizer files
  AutoTokenizer builds an empty one from config.json that encodes every prompt to no tokens,
  which would read as "every prompt too long" or "0 tokens" much later."""
  from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed
  present = [name for name in TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
  if not present:
    raise ValueError(f'{model_dir}: no tokenizer files ({", ".join(TOKENIZER_FILES)}); copy '
                     "them from the model's original directory")
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  if not tokenizer.encode('1 + 1 = 2', add_special_tokens=False):
    raise ValueError(f'{model_dir}: its tokenizer ({", ".join(present)}) encodes text to no '
                     'tokens')
  if tokenizer.eos_token_id is None:
    raise ValueError(f'{model_dir}: the tokenizer has no eos_token; generation could not stop')
  return tokenizer


def stop_token_ids(model_dir: str | os.PathLike, tokenizer) -> tuple[int, ...]:
  """The ids that end a completion: the tokenizer's EOS and every `eos_token_id` of the model
  dir's generation_config.json (an id or a list: Llama-3 instruct models end a turn on
  <|eot_id|> and the text on <|end_of_text|>, Qwen3's chat models on <|im_end|> and
  <|endoftext|>), sorted."""
  ids = {int(tokenizer.eos_token_id)}
  path = Path(model_dir) / GENERATION_CONFIG_FILE
  if not path.is_file():
    return tuple(sorted(ids))
  try:
    generation = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None
  eos = generation.get('eos_token_id') if isinstance(generation, dict) else None
  listed = eos if isinstance(eos, list) else [] if eos is None else [eos]
  if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in listed):
    raise ValueError(f'{path}: eos_token_id must be a token id or a list of them, got {eos!r}')
  return tuple(sorted(ids | set(listed)))


def config_from_hf(hf: dict, source: str = CONFIG_FILE, **overrides) -> ModelConfig:
  """ModelConfig from a parsed HF config dict; `source` names the file in error messages."""
  def fail(msg):
    raise ValueError(f'{source}: {msg}')

  def field(name, default=None, kind=int):
    if name not in hf or hf[name] is None:
      if default is None:
        fail(f'missing field {name!r}')
      return default
    value = hf[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
      fail(f'field {name!r} must be an integer, got {value!r}')
    return kind(value)

  arch = _architecture(hf, fail)
  family = _FAMILIES[arch]
  # Fields transformers would honour and this model cannot: refused, never ignored.
  if hf.get('hidden_act', 'silu') != 'silu':
    fail(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
  if hf.get('use_sliding_window'):
    fail('use_sliding_window=true is not supported (sliding-window attention is not '
         'implemented; every layer attends to the full context)')
  if hf.get('mlp_bias'):
    fail('mlp_bias=true is not supported (the MLP has no biases)')
  if not family.qkv_bias and hf.get('attention_bias'):
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which the model lacks.
    fail('attention_bias=true is not supported (it adds q/k/v and o_proj biases; the model '
         'has no o_proj bias)')
  if hf.get('attention_dropout'):
    fail(f"attention_dropout={hf['attention_dropout']} is not supported (training runs "
         'without dropout)')
  layer_types = set(hf.get('layer_types') or ()) - {'full_attention'}
  if layer_types:
    fail(f'layer_types {sorted(layer_types)} are not supported (only full_attention)')

  hidden, heads = field('hidden_size'), field('num_attention_heads')
  if 'head_dim' in hf and hf['head_dim'] is not None:
    head_dim = field('head_dim')
  elif family.head_dim is not None:
    head_dim = family.head_dim
  elif hidden % heads:
    fail(f'missing field head_dim, and hidden_size={hidden} is not a multiple of '
         f'num_attention_heads={heads}')
  else:
    head_dim = hidden // heads
  max_positions = field('max_position_embeddings', family.max_positions)
  theta, scaling = _rope_from_hf(hf, max_positions, fail)
  num_layers = field('num_hidden_layers')
  moe = _moe_from_hf(hf, num_layers, field, fail) if family.moe else {}

  unknown = set(overrides) - set(_OVERRIDABLE)
  if unknown:
    raise TypeError(f'load_config: cannot override {sorted(unknown)}; only {list(_OVERRIDABLE)}')
  for name in ('param_dtype', 'dtype'):
    if name in overrides and not jnp.issubdtype(jnp.dtype(overrides[name]), jnp.floating):
      raise ValueError(f'load_config: {name}={overrides[name]!r} is not a floating dtype')
  return ModelConfig(
      vocab_size=field('vocab_size'),
      hidden_size=hidden,
      intermediate_size=field('intermediate_size'),
      num_layers=num_layers,
      num_heads=heads,
      num_kv_heads=field('num_key_value_heads', heads),
      head_dim=head_dim,
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=field('rms_norm_eps', 1e-6, float),
      qkv_bias=family.qkv_bias,
      qk_norm=family.qk_norm,
      tie_embeddings=field('tie_word_embeddings', False, bool),
      max_position_embeddings=max_positions,
      architecture=arch,
      **moe,
      **overrides)


def _moe_from_hf(hf, num_layers, field, fail) -> dict:
  """The ModelConfig fields of Qwen3-MoE's experts. A layer i is MoE when it is not in
  mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (and num_experts > 0), as in
  transformers; transformers 5 writes num_experts as num_local_experts."""
  named = {k: hf[k] for k in ('num_experts', 'num_local_experts') if hf.get(k) is not None}
  if len(set(named.values())) > 1:
    fail(f'num_experts={named["num_experts"]} and num_local_experts='
         f'{named["num_local_experts"]} disagree')
  key = next(iter(named), 'num_experts')
  get = lambda name, kind=int: field(name, _MOE_DEFAULTS[name], kind)
  num_experts = field(key, _MOE_DEFAULTS['num_experts'])
  top_k, width, step = (get('num_experts_per_tok'), get('moe_intermediate_size'),
                        get('decoder_sparse_step'))
  if num_experts < 0:
    fail(f'{key}={num_experts} must be >= 0')
  if step < 1:
    fail(f'decoder_sparse_step={step} must be >= 1')
  dense_only = hf.get('mlp_only_layers') or []
  if not isinstance(dense_only, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense_only):
    fail(f'mlp_only_layers={dense_only!r} must be a list of layer indices below '
         f'num_hidden_layers={num_layers}')
  layers = tuple(i for i in range(num_layers)
                 if num_experts > 0 and i not in dense_only and (i + 1) % step == 0)
  if layers and not 1 <= top_k <= num_experts:
    fail(f'num_experts_per_tok={top_k} must be in 1..{key}={num_experts}')
  if layers and width < 1:
    fail(f'moe_intermediate_size={width} must be >= 1')
  return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
              norm_topk_prob=bool(field('norm_topk_prob', False, bool)), moe_layers=layers)


def _moe_to_hf(c: ModelConfig) -> dict:
  """Qwen3-MoE's config.json fields for `c`: the MoE layers as decoder_sparse_step (the largest
  step that gives them) or, failing that, step 1 with the dense layers in mlp_only_layers."""
  layers = set(c.moe_layers)
  steps = [s for s in range(c.num_layers, 0, -1)
           if layers == {i for i in range(c.num_layers) if (i + 1) % s == 0}]
  step, dense_only = (steps[0], []) if steps else (1, sorted(set(range(c.num_layers)) - layers))
  return dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
              moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
              decoder_sparse_step=step, mlp_only_layers=dense_only, output_router_logits=False)


def _architecture(hf, fail) -> str:
  """The architecture of `architectures`, else of `model_type`; when both are given they must
  name the same one."""
  archs, model_type = hf.get('architectures'), hf.get('model_type')
  if archs:
    if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
      fail(f'architectures={archs} is not supported (expected one of {list(_ARCHITECTURES)})')
    if model_type is not None and _MODEL_TYPES.get(model_type) != archs[0]:
      fail(f'model_type={model_type!r} does not match architectures={archs} (expected '
           f'{_FAMILIES[archs[0]].model_type!r})')
    return archs[0]
  if model_type not in _MODEL_TYPES:
    fail(f'no architectures field, and model_type={model_type!r} is not supported '
         f'(expected one of {list(_MODEL_TYPES)})')
  return _MODEL_TYPES[model_type]


def _rope_from_hf(hf, max_positions, fail) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from `rope_parameters` (transformers 5) or rope_theta/rope_scaling."""
  # Same precedence as transformers: a legacy rope_scaling dict wins over rope_parameters.
  key = 'rope_scaling' if hf.get('rope_scaling') else 'rope_parameters'
  rope = dict(hf.get(key) or {})
  if any(isinstance(v, dict) for v in rope.values()):
    fail(f'{key}: per-layer-type rope parameters are not supported')
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if rope.get('partial_rotary_factor', 1.0) != 1.0:
    fail(f"{key}.partial_rotary_factor={rope['partial_rotary_factor']} is not supported")

  def need(name):
    if rope.get(name) is None:
      fail(f'{key}: rope_type={kind!r} needs field {name!r}')
    return rope[name]

  if kind == 'default':
    return theta, None
  if kind == 'linear':
    return theta, RopeScaling('linear', factor=float(need('factor')))
  if kind == 'llama3':
    # transformers' fallback chain for the pre-scaling context length.
    original = rope.get('original_max_position_embeddings',
                        hf.get('original_max_position_embeddings', max_positions))
    return theta, RopeScaling('llama3', factor=float(need('factor')),
                              low_freq_factor=float(need('low_freq_factor')),
                              high_freq_factor=float(need('high_freq_factor')),
                              original_max_position_embeddings=int(original))
  fail(f"{key}.rope_type={kind!r} is not supported (expected 'default', 'linear' or 'llama3')")


def hf_config(config: ModelConfig, dtype: str = 'bfloat16', extra: dict | None = None) -> dict:
  """The config.json dict for `config`; keys of `extra` (an original config.json) are kept."""
  c = config
  if c.architecture not in _ARCHITECTURES:
    raise ValueError(f'architecture={c.architecture!r} cannot be saved '
                     f'(expected one of {list(_ARCHITECTURES)})')
  family = _FAMILIES[c.architecture]
  if (c.qkv_bias, c.qk_norm) != (family.qkv_bias, family.qk_norm):
    raise ValueError(f'{c.architecture} has qkv_bias={family.qkv_bias}, '
                     f'qk_norm={family.qk_norm}; config has qkv_bias={c.qkv_bias}, '
                     f'qk_norm={c.qk_norm}')
  if c.is_moe and not family.moe:
    raise ValueError(f'{c.architecture} has no experts; config has moe_layers={c.moe_layers}')
  scaling = {}
  if c.rope_scaling is not None:
    s = c.rope_scaling
    scaling = dict(rope_type=s.kind, factor=s.factor)
    if s.kind == 'llama3':
      scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                     original_max_position_embeddings=s.original_max_position_embeddings)
  rope = {'rope_theta': c.rope_theta, 'rope_type': 'default', **scaling}
  ours = {
      'architectures': [c.architecture],
      'model_type': family.model_type,
      'vocab_size': c.vocab_size,
      'hidden_size': c.hidden_size,
      'intermediate_size': c.intermediate_size,
      'num_hidden_layers': c.num_layers,
      'num_attention_heads': c.num_heads,
      'num_key_value_heads': c.num_kv_heads,
      'head_dim': c.head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': c.max_position_embeddings,
      'rms_norm_eps': c.rms_norm_eps,
      'rope_parameters': rope,
      # The older schema's fields too (transformers < 5 and other readers ignore
      # rope_parameters and would take the default theta, 1e4), alike in meaning.
      'rope_theta': c.rope_theta,
      **({'rope_scaling': scaling} if scaling else {}),
      'tie_word_embeddings': c.tie_embeddings,
      'dtype': dtype,
      'torch_dtype': dtype,  # the key transformers < 4.56 reads
  }
  if family.model_type in ('qwen2', 'qwen3', 'qwen3_moe'):
    ours.update(use_sliding_window=False, sliding_window=None)
  if family.moe:
    ours.update(_moe_to_hf(c))
  if not family.qkv_bias:
    ours.update(attention_bias=False)
  if family.model_type == 'llama':
    ours.update(mlp_bias=False)
  # Keys that would contradict ours (legacy rope fields, a quantization we did not apply).
  stale = {'rope_scaling', 'rope_theta', 'quantization_config', 'layer_types', 'max_window_layers',
           'num_local_experts'}
  kept = {k: v for k, v in (extra or {}).items() if k not in stale}
  return {**kept, **ours}


# ---------------------------------------------------------------------------------------------
# The name map.


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One pytree leaf and the HF tensor(s) it comes from."""
  hf_name: str                # per-layer names hold '{i}', the layer index (and '{e}', the expert)
  path: tuple[str, ...]       # keys into the params pytree
  shape: tuple[int, ...]      # the leaf's shape (leading L when stacked, then X with experts)
  stacked: bool = False       # one HF tensor per layer, stacked on axis 0 of the leaf
  transposed: bool = False    # HF Linear weight is [out, in]; a Dense kernel is [in, out]
  first_layer: int = 0        # the model layer of the leaf's row 0 (runs of layers, see
                              # transformer.layer_groups)
  experts: bool = False       # also one HF tensor per expert, stacked on axis 1 (MoE)

  @property
  def hf_shape(self) -> tuple[int, ...]:
    shape = self.shape[1 + self.experts:] if self.stacked else self.shape
    return shape[::-1] if self.transposed else shape

  def indices(self) -> list:
    """Every HF tensor's index into the leaf, in checkpoint order: None (the whole leaf), a row
    j, or (j, expert) for expert weights."""
    if not self.stacked:
      return [None]
    if self.experts:
      return [(j, e) for j in range(self.shape[0]) for e in range(self.shape[1])]
    return list(range(self.shape[0]))

  def name(self, index=None) -> str:
    """The HF name of the tensor at `index` (see `indices`)."""
    if not self.stacked:
      return self.hf_name
    j, e = index if self.experts else (index, None)
    return self.hf_name.format(i=self.first_layer + j, e=e)


def name_map(config: ModelConfig) -> list[TensorSpec]:
  """Every leaf of the params pytree in checkpoint order; q/k/v and gate/up stay adjacent."""
  c = config
  d, f = c.hidden_size, c.intermediate_size
  widths = {'q': c.num_heads * c.head_dim, 'k': c.num_kv_heads * c.head_dim,
            'v': c.num_kv_heads * c.head_dim}
  specs = [TensorSpec('model.embed_tokens.weight', ('embed', 'embedding'), (c.vocab_size, d))]
  for group in transformer.layer_groups(c):
    layer = lambda hf, path, shape, **kw: TensorSpec(
        f'model.layers.{{i}}.{hf}', (group.name, *path), (group.count, *shape), stacked=True,
        first_layer=group.first, **kw)
    specs += [layer(f'self_attn.{p}_proj.weight', ('attn', f'{p}_proj', 'kernel'), (d, n),
                    transposed=True) for p, n in widths.items()]
    if c.qkv_bias:
      specs += [layer(f'self_attn.{p}_proj.bias', ('attn', f'{p}_proj', 'bias'), (n,))
                for p, n in widths.items()]
    specs.append(layer('self_attn.o_proj.weight', ('attn', 'o_proj', 'kernel'),
                       (widths['q'], d), transposed=True))
    if c.qk_norm:
      specs += [layer(f'self_attn.{p}_norm.weight', ('attn', f'{p}_norm', 'scale'),
                      (c.head_dim,)) for p in 'qk']
    if group.moe:
      x, i = c.num_experts, c.moe_intermediate_size
      expert = lambda p, shape: layer(f'mlp.experts.{{e}}.{p}.weight', ('moe', p, 'kernel'),
                                      (x, *shape), transposed=True, experts=True)
      specs += [layer('mlp.gate.weight', ('moe', 'router', 'kernel'), (d, x), transposed=True),
                expert('gate_proj', (d, i)), expert('up_proj', (d, i)),
                expert('down_proj', (i, d))]
    else:
      specs += [
          layer('mlp.gate_proj.weight', ('mlp', 'gate_proj', 'kernel'), (d, f), transposed=True),
          layer('mlp.up_proj.weight', ('mlp', 'up_proj', 'kernel'), (d, f), transposed=True),
          layer('mlp.down_proj.weight', ('mlp', 'down_proj', 'kernel'), (f, d), transposed=True)]
    specs += [layer('input_layernorm.weight', ('input_norm', 'scale'), (d,)),
              layer('post_attention_layernorm.weight', ('post_attn_norm', 'scale'), (d,))]
  specs.append(TensorSpec('model.norm.weight', ('final_norm', 'scale'), (d,)))
  if not c.tie_embeddings:
    specs.append(TensorSpec('lm_head.weight', ('lm_head', 'kernel'), (d, c.vocab_size),
                            transposed=True))
  return specs


def checkpoint_order(config: ModelConfig) -> Iterator[tuple[str, TensorSpec, Any]]:
  """(hf_name, spec, index) for every HF tensor (index into the leaf: `TensorSpec.indices`):
  leading globals, then layer by layer (each layer's tensors together, fused parts adjacent; an
  MoE layer's experts one after the other, each its gate, up and down), then trailing globals.
  Loading, saving and every weight transport walk the model in this order."""
  specs = name_map(config)
  stacked = [s for s in specs if s.stacked]
  yield from ((s.name(), s, None) for s in specs[:specs.index(stacked[0])])
  for layer in range(config.num_layers):
    here = [s for s in stacked if s.first_layer <= layer < s.first_layer + s.shape[0]]
    for is_expert, run in itertools.groupby(here, key=lambda s: s.experts):
      run = list(run)
      j = layer - run[0].first_layer
      indices = [(j, e) for e in range(config.num_experts)] if is_expert else [j]
      for index in indices:
        yield from ((s.name(index), s, index) for s in run)
  yield from ((s.name(), s, None) for s in specs[specs.index(stacked[-1]) + 1:])


def assemble(spec: TensorSpec, tensor_of) -> np.ndarray:
  """The leaf of `spec` (host numpy) from its HF tensors, `tensor_of(hf_name)` -> array in HF
  layout: the inverse of `hf_tensors` for one leaf."""
  parts = [np.asarray(tensor_of(spec.name(index))) for index in spec.indices()]
  parts = [p.T if spec.transposed else p for p in parts]
  if not spec.stacked:
    return np.array(parts[0])
  return np.stack(parts).reshape(spec.shape)


def leaf_at(params, path: tuple[str, ...]):
  """The leaf of the params pytree at a TensorSpec.path."""
  for key in path:
    params = params[key]
  return params


def hf_tensors(params, config: ModelConfig, dtype: Any = None) -> Iterator[tuple[str, Any]]:
  """Yields (hf_name, array in HF layout), one layer at a time, fused groups adjacent.

  Arrays stay where the params are (jax arrays on device: ready for `torch.from_dlpack`); each
  is one layer's (or one expert's) slice, transposed to [out, in] where HF uses Linear weights,
  cast to `dtype`.
  """
  dtype = None if dtype is None else jnp.dtype(dtype)
  for name, spec, index in checkpoint_order(config):
    yield name, _hf_layout(leaf_at(params, spec.path), index, spec.transposed, dtype)


@functools.partial(jax.jit, static_argnames=('transposed', 'dtype'))
def _hf_layout(x, index, transposed, dtype):
  # Jitted with a traced index: one compile per leaf shape rather than per layer (and expert).
  x = x if index is None else x[index]
  x = x.T if transposed else x
  return x if dtype is None else x.astype(dtype)


# ---------------------------------------------------------------------------------------------
# safetensors files.


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
  """({name: {dtype, shape, data_offsets}}, byte offset where the data starts)."""
  path = Path(path)
  size = path.stat().st_size
  with open(path, 'rb') as f:
    head = f.read(8)
    n = int.from_bytes(head, 'little') if len(head) == 8 else -1
    if n < 2 or 8 + n > size:
      raise ValueError(f'{path}: not a safetensors file (header length {n}, file size {size})')
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f'{path}: unreadable safetensors header ({e})') from None
  if not isinstance(header, dict):
    raise ValueError(f'{path}: safetensors header is not a JSON object')
  header.pop('__metadata__', None)
  data_start = 8 + n
  for name, entry in header.items():
    try:
      dtype = _ST_DTYPES.get(entry['dtype'])
      (begin, end), shape = entry['data_offsets'], entry['shape']
    except (KeyError, TypeError, ValueError):
      raise ValueError(f'{path}: malformed header entry for tensor {name!r}: {entry!r}') from None
    if dtype is None:
      raise ValueError(f'{path}: tensor {name!r} has unsupported dtype {entry["dtype"]!r}')
    if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
      raise ValueError(f'{path}: tensor {name!r} data_offsets {entry["data_offsets"]} do not fit '
                       f'shape {entry["shape"]} {entry["dtype"]} in a {size}-byte file')
  return header, data_start


def _tensor_view(mmap: np.memmap, entry: dict, data_start: int) -> np.ndarray:
  """Zero-copy view of one tensor; pages are read only when a slice of it is copied."""
  begin, end = entry['data_offsets']
  raw = mmap[data_start + begin:data_start + end]
  return raw.view(_ST_DTYPES[entry['dtype']]).reshape(entry['shape'])


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], np.dtype]],
                       arrays: Iterator[tuple[str, Any]]):
  """Writes the header from `tensors` (name, shape, dtype), then each array as it arrives."""
  header, offset = {'__metadata__': {'format': 'pt'}}, 0
  for name, shape, dtype in tensors:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {'dtype': _ST_NAMES[dtype], 'shape': list(shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)  # keeps tensor data 8-byte aligned
  tmp = path.with_name(path.name + '.tmp')
  with open(tmp, 'wb') as f:
    f.write(len(blob).to_bytes(8, 'little'))
    f.write(blob)
    for name, shape, dtype in tensors:
      got_name, x = next(arrays)
      x = np.ascontiguousarray(np.asarray(x))
      if got_name != name or x.shape != tuple(shape) or x.dtype != dtype:
        raise AssertionError(f'{path}: expected {name} {shape} {dtype}, got {got_name} '
                             f'{x.shape} {x.dtype}')
      x.tofile(f)
  os.replace(tmp, path)  # readers never see a half-written file


def write_safetensors(path: str | os.PathLike, arrays: list[tuple[str, np.ndarray]]) -> None:
  """Writes (name, host array) pairs, in that order, as one safetensors file (atomically)."""
  arrays = [(name, np.ascontiguousarray(x)) for name, x in arrays]
  _write_safetensors(Path(path), [(name, x.shape, x.dtype) for name, x in arrays], iter(arrays))


# ---------------------------------------------------------------------------------------------
# Loading and saving.


class _Located(NamedTuple):
  """Where an HF tensor's bytes are: a file's header entry, and `part`, the index of this tensor
  in that entry when the file holds it inside a larger one (transformers 5's fused experts)."""
  file: Path
  entry: dict
  data_start: int
  part: tuple | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    shape = tuple(self.entry['shape'])
    return shape if self.part is None else np.empty(shape, np.bool_)[self.part].shape


# transformers 5's in-memory layout of a Qwen3-MoE layer's experts, which
# `save_pretrained(save_original_format=False)` writes: gate and up of every expert in one
# [X, 2I, D] tensor, down in one [X, D, I]. The Hub's files (and save_pretrained's default) hold
# one tensor per expert and projection, the names `name_map` uses.
_FUSED_EXPERTS = re.compile(r'^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$')


def _locate_tensors(model_dir: Path) -> tuple[dict[str, _Located], Path]:
  """{hf_name: where its bytes are} and the file that lists the tensors; fused expert tensors
  are listed as the per-expert tensors they hold (the fused names too)."""
  single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
  if single.is_file():
    header, start = read_safetensors_header(single)
    located = {name: _Located(single, entry, start) for name, entry in header.items()}
    return _unfused(located), single
  if not index.is_file():
    raise FileNotFoundError(f'{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} exists')
  try:
    weight_map = json.loads(index.read_text())['weight_map']
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f'{index}: no readable weight_map ({e!r})') from None
  located = {}
  for shard_name in sorted(set(weight_map.values())):
    shard = model_dir / shard_name
    if not shard.is_file():
      raise FileNotFoundError(f'{index}: shard {shard_name!r} is listed in weight_map but '
                              f'{shard} does not exist')
    header, start = read_safetensors_header(shard)
    for name, entry in header.items():
      if weight_map.get(name) == shard_name:
        located[name] = _Located(shard, entry, start)
  for name, shard_name in weight_map.items():
    if name not in located:
      raise ValueError(f'{model_dir / shard_name}: tensor {name!r} is listed in {index.name} but '
                       'missing from this shard')
  return _unfused(located), index


def _unfused(located: dict[str, _Located]) -> dict[str, _Located]:
  """`located` plus, for every fused expert tensor (`_FUSED_EXPERTS`), the per-expert tensors
  it holds, as parts of it (a tensor listed under its own name wins)."""
  out = dict(located)
  for name, where in located.items():
    match = _FUSED_EXPERTS.match(name)
    if not match or len(where.entry['shape']) != 3:
      continue
    prefix, kind = match.groups()
    num_experts, rows, _ = where.entry['shape']
    halves = ({'gate_proj': slice(0, rows // 2), 'up_proj': slice(rows // 2, rows)}
              if kind == 'gate_up_proj' else {'down_proj': slice(None)})
    for e in range(num_experts):
      for proj, rows_of in halves.items():
        out.setdefault(f'{prefix}.{e}.{proj}.weight', where._replace(part=(e, rows_of)))
  return out


def load_params(model_dir: str | os.PathLike, config: ModelConfig, shardings=None) -> dict:
  """Params pytree from an HF safetensors checkpoint, cast to config.param_dtype.

  `shardings`: a pytree of `jax.sharding.Sharding` shaped like the params (None: all on the
  first local device). Each device's slice is copied straight from the memory-mapped file.
  """
  model_dir = Path(model_dir)
  located, listing = _locate_tensors(model_dir)
  specs = name_map(config)
  source = {}  # hf_name -> (file, header entry, data start), shapes checked
  for name, spec, _ in checkpoint_order(config):
    if name not in located:
      raise ValueError(f'{listing}: tensor {name!r} is missing (implied by {CONFIG_FILE})')
    where = located[name]
    if where.shape != spec.hf_shape:
      shown = name if where.part is None else f'{name} (in {where.file.name}: {where.entry})'
      raise ValueError(f'{where.file}: tensor {shown!r} has shape {where.shape} but '
                       f'{CONFIG_FILE} implies {spec.hf_shape}')
    source[name] = where
  tied_head = {'lm_head.weight'} if config.tie_embeddings else set()  # some tied files keep it
  read = {id(where.entry) for where in source.values()}  # a fused tensor is read in parts
  unused = sorted(n for n, w in located.items()
                  if w.part is None and id(w.entry) not in read and n not in tied_head)
  if unused:
    logging.warning('%s: ignoring %d tensors not in the model, e.g. %s', listing, len(unused),
                    unused[:3])

  sharding_of = _shardings_by_path(specs, shardings)
  dtype = jnp.dtype(config.param_dtype)
  mmaps = {}  # one read-only mapping per file, dropped when loading is done

  def view(name, transposed):
    where = source[name]
    if where.file not in mmaps:
      mmaps[where.file] = np.memmap(where.file, dtype=np.uint8, mode='r')
    x = _tensor_view(mmaps[where.file], where.entry, where.data_start)
    x = x if where.part is None else x[where.part]
    return x.T if transposed else x  # still a view: nothing is read yet

  params = {}
  for spec in specs:
    callback = _slice_reader(spec, view, dtype)
    leaf = jax.make_array_from_callback(spec.shape, sharding_of[spec.path], callback)
    node = params
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = leaf
  return params


def _slice_reader(spec: TensorSpec, view, dtype):
  """The make_array_from_callback callback: copies one index (tuple of slices) of the leaf."""
  def read(index):
    index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, spec.shape))
    out = np.empty(shape, dtype)
    if spec.stacked and spec.experts:  # only this slice's layers and experts are touched
      layers, experts = (range(*index[a].indices(spec.shape[a])) for a in (0, 1))
      for j, i in enumerate(layers):
        for f, e in enumerate(experts):
          out[j, f] = view(spec.name((i, e)), spec.transposed)[index[2:]]
    elif spec.stacked:
      layers = range(*index[0].indices(spec.shape[0]))
      for j, i in enumerate(layers):  # only this slice's layers are touched
        out[j] = view(spec.name(i), spec.transposed)[index[1:]]
    else:
      out[...] = view(spec.name(), spec.transposed)[index]
    return out
  return read


def _shardings_by_path(specs, shardings) -> dict[tuple[str, ...], jax.sharding.Sharding]:
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return {spec.path: device for spec in specs}
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  by_path = {tuple(str(getattr(k, 'key', k)) for k in path): s for path, s in flat}
  want = {spec.path for spec in specs}
  if set(by_path) != want:
    missing, extra = sorted(want - set(by_path)), sorted(set(by_path) - want)
    raise ValueError(f'shardings do not match the params: missing {missing}, unexpected {extra}')
  return by_path


def save_params(params, config: ModelConfig, out_dir: str | os.PathLike,
                dtype: str = 'bfloat16', max_shard_bytes: int | None = None,
                extra_config: dict | None = None) -> list[Path]:
  """Writes config.json and model.safetensors (or shards + index) that transformers can load.

  Tensors go to disk one at a time (one layer's slice, gathered to host), so host memory holds
  at most one tensor beyond what the params already occupy. Returns the files written.
  """
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f'save_params: dtype={dtype!r} is not one of {list(_SAVE_DTYPES)}')
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  np_dtype = _ST_DTYPES[_SAVE_DTYPES[dtype]]
  entries = [(name, spec.hf_shape, np_dtype) for name, spec, _ in checkpoint_order(config)]
  shards = _split_shards(entries, max_shard_bytes)
  arrays = hf_tensors(params, config, dtype=np_dtype)

  written = []
  if len(shards) == 1:  # as transformers does: no index for a checkpoint that fits one file
    _write_safetensors(out_dir / SINGLE_FILE, shards[0], arrays)
    written.append(out_dir / SINGLE_FILE)
  else:
    weight_map = {}
    for k, shard in enumerate(shards):
      shard_name = f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors'
      _write_safetensors(out_dir / shard_name, shard, arrays)
      weight_map.update({name: shard_name for name, _, _ in shard})
      written.append(out_dir / shard_name)
    total = sum(math.prod(shape) * d.itemsize for _, shape, d in entries)
    index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
    _write_json(out_dir / INDEX_FILE, index)
    written.append(out_dir / INDEX_FILE)
  _write_json(out_dir / CONFIG_FILE, hf_config(config, dtype, extra_config))
  written.append(out_dir / CONFIG_FILE)
  # A previous save with other sharding would otherwise shadow or mix with this one.
  for old in out_dir.iterdir():
    if (old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name)) and old not in written:
      old.unlink()
  return written


def _split_shards(entries, max_shard_bytes):
  """Consecutive runs of tensors, each at most max_shard_bytes (a larger tensor goes alone)."""
  if max_shard_bytes is None:
    return [entries]
  shards, current, size = [], [], 0
  for entry in entries:
    nbytes = math.prod(entry[1]) * entry[2].itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  return shards + [current]


def _write_json(path: Path, obj):
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + '\n')
  os.replace(tmp, path)


def save_peft(adapters, model_config: ModelConfig, lora: config_lib.LoraSettings, out_dir,
              base_model: str, dtype: Any = None) -> list[Path]:
  """Writes a PEFT adapter dir that `peft.PeftModel.from_pretrained(<base model>, out_dir)` and
  vLLM's LoRARequest load; returns the files written."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  weights, config = out / lora_lib.PEFT_WEIGHTS_FILE, out / lora_lib.PEFT_CONFIG_FILE
  write_safetensors(weights, list(lora_lib.peft_tensors(adapters, model_config, lora, dtype)))
  _write_json(config, lora_lib.peft_config(lora, base_model))
  return [config, weights]
