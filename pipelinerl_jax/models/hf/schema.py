"""config.json <-> `transformer.ModelConfig`: each architecture's schema, what is refused.

Fields transformers would honour and the Flax model cannot are refused in one line naming the
file and the field, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp

from pipelinerl_jax.models.transformer import ModelConfig, RopeScaling

CONFIG_FILE = 'config.json'


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
  rope = {'rope_theta': c.rope_theta, 'rope_type': 'default'}
  if c.rope_scaling is not None:
    s = c.rope_scaling
    rope.update(rope_type=s.kind, factor=s.factor)
    if s.kind == 'llama3':
      rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                  original_max_position_embeddings=s.original_max_position_embeddings)
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
