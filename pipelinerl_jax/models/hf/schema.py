"""config.json <-> `transformer.ModelConfig`: each architecture's schema, what is refused.

Fields transformers would honour and the Flax model cannot are refused in one line naming the
file and the field, never ignored.

Qwen3.5 comes in two layouts. `Qwen3_5ForCausalLM` (model_type qwen3_5_text) is the language
model alone. The Hub ships `Qwen3_5ForConditionalGeneration` (model_type qwen3_5): the language
model's fields nested under `text_config`, its weights under `model.language_model.*`, a vision
tower (`vision_config`, `model.visual.*`) and a multi-token-prediction head (`mtp.*`). Of the
composite, the language model is loaded and trained; the vision tower and the MTP head are not
loaded, and a save copies them from the original dir unchanged (`Family.carried`), so an export
is a dir of the kind the user started from. Its multimodal RoPE fields (`mrope_section`,
`mrope_interleaved`) are accepted: for text the three position streams are equal, which makes
it plain RoPE.

Qwen3.5-MoE comes in the same two layouts (`Qwen3_5MoeForCausalLM`, model_type
qwen3_5_moe_text; `Qwen3_5MoeForConditionalGeneration`, qwen3_5_moe): the hybrid layers with
every MLP a mixture of experts beside a shared expert. Its router always renormalizes the top-k
gates and every layer has experts, as transformers computes it; a config.json saying otherwise
(`norm_topk_prob` false, `mlp_only_layers`, `decoder_sparse_step` > 1, which other readers such
as vLLM's Qwen3-Next honour) is refused.
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
class Family:
  """What an architecture is in `ModelConfig` terms, and transformers' per-class defaults for
  fields a config.json may leave out."""
  model_type: str
  qkv_bias: bool
  qk_norm: bool
  max_positions: int
  head_dim: int | None = None  # None: hidden_size / num_attention_heads
  # Experts: 'qwen3' (Qwen3-MoE's, `_moe_from_hf`) or 'qwen3_5' (every layer, and a shared
  # expert: `_qwen3_5_moe_from_hf`); None: a dense model.
  moe: str | None = None
  hybrid: bool = False         # Qwen3.5: Gated DeltaNet layers, gated attention (`_hybrid_from_hf`)
  # A composite (vision-language) dir: the language model's fields under text_config (of
  # `text_model_type`), its weights under `lm_prefix`; tensors under `carried` are not the
  # language model's and are copied unchanged on save.
  text_model_type: str | None = None
  lm_prefix: str = 'model.'
  carried: tuple[str, ...] = ()


_FAMILIES = {
    'Qwen2ForCausalLM': Family('qwen2', qkv_bias=True, qk_norm=False, max_positions=32768),
    'Qwen3ForCausalLM': Family('qwen3', qkv_bias=False, qk_norm=True, max_positions=32768,
                               head_dim=128),
    'LlamaForCausalLM': Family('llama', qkv_bias=False, qk_norm=False, max_positions=2048),
    'Qwen3MoeForCausalLM': Family('qwen3_moe', qkv_bias=False, qk_norm=True,
                                  max_positions=32768, moe='qwen3'),
    'Qwen3_5ForCausalLM': Family('qwen3_5_text', qkv_bias=False, qk_norm=True,
                                 max_positions=32768, head_dim=256, hybrid=True),
    'Qwen3_5ForConditionalGeneration': Family(
        'qwen3_5', qkv_bias=False, qk_norm=True, max_positions=32768, head_dim=256, hybrid=True,
        text_model_type='qwen3_5_text', lm_prefix='model.language_model.',
        carried=('model.visual.', 'mtp.')),
    'Qwen3_5MoeForCausalLM': Family('qwen3_5_moe_text', qkv_bias=False, qk_norm=True,
                                    max_positions=32768, head_dim=256, hybrid=True,
                                    moe='qwen3_5'),
    'Qwen3_5MoeForConditionalGeneration': Family(
        'qwen3_5_moe', qkv_bias=False, qk_norm=True, max_positions=32768, head_dim=256,
        hybrid=True, moe='qwen3_5', text_model_type='qwen3_5_moe_text',
        lm_prefix='model.language_model.', carried=('model.visual.', 'mtp.')),
}
_ARCHITECTURES = tuple(_FAMILIES)
_MODEL_TYPES = {family.model_type: arch for arch, family in _FAMILIES.items()}
_OVERRIDABLE = ('param_dtype', 'dtype', 'lm_head_fp32', 'remat', 'remat_policy', 'attention',
                'attention_block_q', 'attention_block_kv', 'moe_dispatch', 'linear_chunk_size')
# transformers' Qwen3MoeConfig defaults, for fields a config.json leaves out.
_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=False, decoder_sparse_step=1)
# transformers' Qwen3_5MoeTextConfig defaults (its docstring: "Qwen3.5-35B-A3B style").
_QWEN3_5_MOE_DEFAULTS = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512)
# transformers' Qwen3_5TextConfig defaults (its docstring: "Qwen3.5-9B style").
_HYBRID_DEFAULTS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16,
                        linear_num_value_heads=32, full_attention_interval=4,
                        partial_rotary_factor=0.25)
LAYER_TYPES = ('linear_attention', 'full_attention')


def family_of(config: ModelConfig) -> Family:
  """The family of `config.architecture` (ValueError naming the known ones if none)."""
  if config.architecture not in _FAMILIES:
    raise ValueError(f'architecture={config.architecture!r} is not one of {list(_ARCHITECTURES)}')
  return _FAMILIES[config.architecture]


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
  attention implementation (attention, attention_block_q, attention_block_kv), how an MoE
  model's experts are computed (moe_dispatch) and a hybrid's chunk length (linear_chunk_size).
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
  if family.text_model_type:
    hf = _text_config(hf, family, source)
    source = f'{source} text_config'
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
  if layer_types and not family.hybrid:
    fail(f'layer_types {sorted(layer_types)} are not supported (only full_attention)')
  if family.hybrid and not family.moe and hf.get('mlp_only_layers'):
    fail(f"mlp_only_layers={hf['mlp_only_layers']} is not supported (a dense Qwen3.5 has no "
         'experts)')

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
  theta, scaling, partial = _rope_from_hf(hf, max_positions, fail, family.hybrid)
  num_layers = field('num_hidden_layers')
  moe = {'qwen3': _moe_from_hf, 'qwen3_5': _qwen3_5_moe_from_hf}.get(
      family.moe, lambda *_: {})(hf, num_layers, field, fail)
  hybrid = _hybrid_from_hf(hf, num_layers, field, fail) if family.hybrid else {}

  unknown = set(overrides) - set(_OVERRIDABLE)
  if unknown:
    raise TypeError(f'load_config: cannot override {sorted(unknown)}; only {list(_OVERRIDABLE)}')
  for name in ('param_dtype', 'dtype'):
    if name in overrides and not jnp.issubdtype(jnp.dtype(overrides[name]), jnp.floating):
      raise ValueError(f'load_config: {name}={overrides[name]!r} is not a floating dtype')
  return ModelConfig(
      vocab_size=field('vocab_size'),
      hidden_size=hidden,
      # Qwen3.5-MoE has no dense MLP (transformers' config has no such field).
      intermediate_size=0 if family.moe == 'qwen3_5' else field('intermediate_size'),
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
      partial_rotary_factor=partial,
      **moe,
      **hybrid,
      **overrides)


def _text_config(hf, family: Family, source: str) -> dict:
  """A composite config's language model: its text_config, with the top-level
  tie_word_embeddings (what transformers' composite model ties by; the two must agree)."""
  text = hf.get('text_config')
  if not isinstance(text, dict):
    raise ValueError(f'{source}: text_config must be an object (a composite config nests the '
                     f'language model there), got {text!r}')
  if text.get('model_type', family.text_model_type) != family.text_model_type:
    raise ValueError(f"{source}: text_config.model_type={text['model_type']!r} is not "
                     f'{family.text_model_type!r}')
  tie = hf.get('tie_word_embeddings', False)
  if 'tie_word_embeddings' in text and bool(text['tie_word_embeddings']) != bool(tie):
    raise ValueError(f"{source}: tie_word_embeddings={tie} and text_config.tie_word_embeddings="
                     f"{text['tie_word_embeddings']} disagree")
  return {**text, 'tie_word_embeddings': tie}


def _hybrid_from_hf(hf, num_layers, field, fail) -> dict:
  """The ModelConfig fields of Qwen3.5's hybrid layers: the Gated DeltaNet layers from
  `layer_types` (absent: every `full_attention_interval`-th layer full, the rest linear, as
  transformers fills it in), the linear layers' heads and convolution, gated attention and
  zero-centered norms."""
  get = lambda name: field(name, _HYBRID_DEFAULTS[name])
  types = hf.get('layer_types')
  if types is None:
    interval = get('full_attention_interval')
    if interval < 1:
      fail(f'full_attention_interval={interval} must be >= 1')
    types = ['linear_attention' if (i + 1) % interval else 'full_attention'
             for i in range(num_layers)]
  if not isinstance(types, list) or len(types) != num_layers or set(types) - set(LAYER_TYPES):
    fail(f'layer_types must list {num_layers} entries (num_hidden_layers), each one of '
         f'{list(LAYER_TYPES)}; got {types!r}')
  if hf.get('attn_output_gate') is False:
    fail('attn_output_gate=false is not supported (Qwen3.5 attention always gates its output, '
         'as transformers computes it)')
  hk, hv = get('linear_num_key_heads'), get('linear_num_value_heads')
  if hk < 1 or hv % hk:
    fail(f'linear_num_value_heads={hv} must be a multiple of linear_num_key_heads={hk}')
  return dict(attention_output_gate=True, norm_zero_centered=True,
              linear_layers=tuple(i for i, kind in enumerate(types) if kind == 'linear_attention'),
              linear_num_key_heads=hk, linear_num_value_heads=hv,
              linear_key_head_dim=get('linear_key_head_dim'),
              linear_value_head_dim=get('linear_value_head_dim'),
              linear_conv_kernel=get('linear_conv_kernel_dim'))


def _hybrid_to_hf(c: ModelConfig) -> dict:
  """Qwen3.5's config.json fields for the hybrid layers of `c`."""
  linear = set(c.linear_layers)
  return dict(layer_types=[LAYER_TYPES[0] if i in linear else LAYER_TYPES[1]
                           for i in range(c.num_layers)],
              linear_num_key_heads=c.linear_num_key_heads,
              linear_num_value_heads=c.linear_num_value_heads,
              linear_key_head_dim=c.linear_key_head_dim,
              linear_value_head_dim=c.linear_value_head_dim,
              linear_conv_kernel_dim=c.linear_conv_kernel,
              partial_rotary_factor=c.partial_rotary_factor)


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


def _qwen3_5_moe_from_hf(hf, num_layers, field, fail) -> dict:
  """The ModelConfig fields of Qwen3.5-MoE's experts: every layer's MLP is num_experts routed
  experts (top num_experts_per_tok, renormalized gates) and a shared expert of
  shared_expert_intermediate_size, as transformers computes it (fields that say otherwise are
  refused: other readers honour them)."""
  get = lambda name: field(name, _QWEN3_5_MOE_DEFAULTS[name])
  num_experts, top_k = get('num_experts'), get('num_experts_per_tok')
  width, shared = get('moe_intermediate_size'), get('shared_expert_intermediate_size')
  if hf.get('norm_topk_prob') is False:
    fail('norm_topk_prob=false is not supported (Qwen3.5-MoE always renormalizes its top-k '
         'gates, as transformers computes it)')
  if hf.get('mlp_only_layers'):
    fail(f"mlp_only_layers={hf['mlp_only_layers']} is not supported (every Qwen3.5-MoE layer "
         'has experts, as transformers computes it)')
  if hf.get('decoder_sparse_step', 1) != 1:
    fail(f"decoder_sparse_step={hf['decoder_sparse_step']} is not supported (every Qwen3.5-MoE "
         'layer has experts, as transformers computes it)')
  if not 1 <= top_k <= num_experts:
    fail(f'num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}')
  for name, value in (('moe_intermediate_size', width),
                      ('shared_expert_intermediate_size', shared)):
    if value < 1:
      fail(f'{name}={value} must be >= 1')
  return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
              norm_topk_prob=True, shared_expert_intermediate_size=shared,
              moe_layers=tuple(range(num_layers)))


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


def _rope_from_hf(hf, max_positions, fail, partial_ok: bool
                  ) -> tuple[float, RopeScaling | None, float]:
  """(rope_theta, scaling, partial_rotary_factor) from `rope_parameters` (transformers 5) or
  rope_theta/rope_scaling. A partial rotary factor only where the family has one (Qwen3.5's,
  0.25 unless given, in rope_parameters or at the top level)."""
  # Same precedence as transformers: a legacy rope_scaling dict wins over rope_parameters.
  key = 'rope_scaling' if hf.get('rope_scaling') else 'rope_parameters'
  rope = dict(hf.get(key) or {})
  if any(isinstance(v, dict) for v in rope.values()):
    fail(f'{key}: per-layer-type rope parameters are not supported')
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10000.0)))
  kind = rope.get('rope_type', rope.get('type', 'default'))
  partial = 1.0
  if partial_ok:
    partial = float(rope.get('partial_rotary_factor', hf.get(
        'partial_rotary_factor', _HYBRID_DEFAULTS['partial_rotary_factor'])))
  elif rope.get('partial_rotary_factor', 1.0) != 1.0:
    fail(f"{key}.partial_rotary_factor={rope['partial_rotary_factor']} is not supported")

  def need(name):
    if rope.get(name) is None:
      fail(f'{key}: rope_type={kind!r} needs field {name!r}')
    return rope[name]

  if kind == 'default':
    return theta, None, partial
  if kind == 'linear':
    return theta, RopeScaling('linear', factor=float(need('factor'))), partial
  if kind == 'llama3':
    # transformers' fallback chain for the pre-scaling context length.
    original = rope.get('original_max_position_embeddings',
                        hf.get('original_max_position_embeddings', max_positions))
    return theta, RopeScaling('llama3', factor=float(need('factor')),
                              low_freq_factor=float(need('low_freq_factor')),
                              high_freq_factor=float(need('high_freq_factor')),
                              original_max_position_embeddings=int(original)), partial
  fail(f"{key}.rope_type={kind!r} is not supported (expected 'default', 'linear' or 'llama3')")


def hf_config(config: ModelConfig, dtype: str = 'bfloat16', extra: dict | None = None) -> dict:
  """The config.json dict for `config`; keys of `extra` (an original config.json) are kept. A
  composite's (Qwen3_5ForConditionalGeneration) needs `extra` for its vision_config."""
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
  qwen3_5_moe = (tuple(range(c.num_layers)), True)
  if family.moe == 'qwen3_5' and ((c.moe_layers, c.norm_topk_prob) != qwen3_5_moe
                                  or c.shared_expert_intermediate_size < 1):
    raise ValueError(f'{c.architecture} has experts in every layer, renormalized gates and a '
                     f'shared expert; config has moe_layers={c.moe_layers}, norm_topk_prob='
                     f'{c.norm_topk_prob}, shared_expert_intermediate_size='
                     f'{c.shared_expert_intermediate_size}')
  if c.shared_expert_intermediate_size and family.moe != 'qwen3_5':
    raise ValueError(f'{c.architecture} has no shared expert; config has '
                     f'shared_expert_intermediate_size={c.shared_expert_intermediate_size}')
  hybrid = (c.attention_output_gate, c.norm_zero_centered)
  if (c.is_hybrid and not family.hybrid) or (family.hybrid and hybrid != (True, True)) or (
      not family.hybrid and any(hybrid)):
    raise ValueError(f'{c.architecture}: config has linear_layers={c.linear_layers}, '
                     f'attention_output_gate={hybrid[0]}, norm_zero_centered={hybrid[1]}, '
                     f'which that architecture does not')
  extra = dict(extra or {})
  if family.text_model_type and not isinstance(extra.get('vision_config'), dict):
    raise ValueError(f'{c.architecture} is saved with its vision tower: it needs the original '
                     "config.json's vision_config (extra)")
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
  if family.moe == 'qwen3':
    ours.update(_moe_to_hf(c))
  if family.moe == 'qwen3_5':
    del ours['intermediate_size']
    ours.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                output_router_logits=False)
  if not family.qkv_bias:
    ours.update(attention_bias=False)
  if family.model_type == 'llama':
    ours.update(mlp_bias=False)
  # Keys that would contradict ours (legacy rope fields, a quantization we did not apply).
  stale = {'rope_scaling', 'rope_theta', 'quantization_config', 'layer_types', 'max_window_layers',
           'num_local_experts'}
  keep = lambda original: {k: v for k, v in original.items() if k not in stale}
  if not family.hybrid:
    return {**keep(extra), **ours}
  ours.update(_hybrid_to_hf(c))
  text_extra = extra.get('text_config') if family.text_model_type else extra
  text_extra = text_extra if isinstance(text_extra, dict) else {}
  # The multimodal RoPE fields the model does not use (plain RoPE for text) stay as they were.
  original_rope = text_extra.get('rope_parameters') or {}
  rope.update({k: original_rope[k] for k in ('mrope_section', 'mrope_interleaved')
               if k in original_rope}, partial_rotary_factor=c.partial_rotary_factor)
  if not family.text_model_type:
    return {**keep(extra), **ours}
  del ours['architectures'], ours['torch_dtype']
  text = {**keep(text_extra), **ours, 'model_type': family.text_model_type}
  return {**keep(extra), 'architectures': [c.architecture], 'model_type': family.model_type,
          'text_config': text, 'tie_word_embeddings': c.tie_embeddings, 'dtype': dtype,
          'torch_dtype': dtype}
