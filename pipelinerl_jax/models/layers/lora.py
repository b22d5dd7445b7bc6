"""LoRA: a low-rank delta on the projections of every layer, kept apart from the frozen base.

For a targeted projection with kernel W [Di, Do] (models/transformer.py's [in, out] layout):

  y = x W + s (x A) B,    s = alpha / r,   A [Di, Ra] random, B [Ra, Do] zeros

computed unmerged, so that B = 0 gives exactly the base model's outputs, and so that the base can
be shared, read-only, by the trainer and an inline generation engine. Shape letters: Ra is the
adapter rank r, Di and Do a projection's input and output widths (the README's table).

Adapters are their own pytree, with the base's paths and an `a` and `b` leaf under each targeted
projection, stacked over layers like the base's kernels:

  layers/attn/{q,k,v,o}_proj/{a [L, Di, Ra], b [L, Ra, Do]}
  layers/mlp/{gate,up,down}_proj/{a, b}

`Adapted(base, adapters, scale)` is what every model function takes as `params` to run with
adapters; `variables` turns it into the Flax variables (the `lora` collection holds each
projection's A and s * B), which `Dense` reads. `merge` makes merged weights where a path needs
them (an export, a generator without a LoRA kernel): always from the pristine base, in fp32,
so nothing drifts however many updates were merged before.

The PEFT names (`peft_name`) are the ones `peft.PeftModel.save_pretrained` writes for a Qwen2 /
Llama model: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [Ra, Di] and
`...lora_B.weight` [Do, Ra], B without the scale (PEFT applies alpha / r itself).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterator

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax import config as config_lib

# Every linear map of a layer, by the name HF and the params pytree give it, and its sub-block.
TARGETS = config_lib.LORA_TARGETS
_BLOCK = {'q_proj': 'attn', 'k_proj': 'attn', 'v_proj': 'attn', 'o_proj': 'attn',
          'gate_proj': 'mlp', 'up_proj': 'mlp', 'down_proj': 'mlp'}
_HF_BLOCK = {'attn': 'self_attn', 'mlp': 'mlp'}
COLLECTION = 'lora'


def active(settings: config_lib.LoraSettings) -> config_lib.LoraSettings | None:
  """`settings` (config.model.lora, checked when it was made) when LoRA is on (rank > 0), else
  None: the `lora` the functions here take."""
  return settings if settings.rank > 0 else None


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
  """One targeted projection: where its kernel and adapters sit, and their widths."""
  target: str                  # 'q_proj', ...
  path: tuple[str, ...]        # ('layers', 'attn', 'q_proj'): the kernel is path + ('kernel',)
  in_features: int             # Di
  out_features: int            # Do

  def peft_name(self, layer: int, which: str) -> str:
    """PEFT's tensor name of layer `layer`'s A ('a') or B ('b')."""
    block = _HF_BLOCK[self.path[1]]
    part = 'lora_A' if which == 'a' else 'lora_B'
    return f'base_model.model.model.layers.{layer}.{block}.{self.target}.{part}.weight'

  def module_name(self, layer: int) -> str:
    """The HF module the adapter wraps (PEFT's target module)."""
    return f'model.layers.{layer}.{_HF_BLOCK[self.path[1]]}.{self.target}'


# Projections a serving engine fuses into one module (vLLM: qkv_proj, gate_up_proj).
FUSED_GROUPS = (('q_proj', 'k_proj', 'v_proj'), ('gate_proj', 'up_proj'))


def merged_targets(lora: config_lib.LoraSettings) -> tuple[str, ...]:
  """The projections a merged reload must send: the targets, and the fused siblings of each
  (sent as the base has them), since a fused module is reloaded whole."""
  sent = set(lora.targets)
  for group in FUSED_GROUPS:
    if sent & set(group):
      sent |= set(group)
  return tuple(t for t in TARGETS if t in sent)


def check_base(model_config) -> None:
  """Raises a one-line ValueError where adapters cannot cover `model_config`'s layers: a mixture
  of experts (its layers are scanned in runs of one kind, transformer.layer_groups, and its
  experts are stacked weights, not projections), or a hybrid (the adapters' paths are one stack
  of full-attention layers, `layers/attn/...`)."""
  c = model_config
  if getattr(c, 'moe_layers', ()):
    raise ValueError(f'config.model.lora: LoRA on a mixture-of-experts model ({c.num_experts} '
                     f'experts in {len(c.moe_layers)} layers) is not supported; set '
                     'model.lora.rank=0')
  if getattr(c, 'linear_layers', ()):
    raise ValueError(f'config.model.lora: LoRA on a hybrid model ({len(c.linear_layers)} Gated '
                     'DeltaNet layers) is not supported; set model.lora.rank=0')


def specs(model_config, lora: config_lib.LoraSettings) -> list[AdapterSpec]:
  """The targeted projections of `model_config` (a transformer.ModelConfig), in TARGETS order."""
  check_base(model_config)
  c = model_config
  d, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  widths = {'q_proj': (d, q), 'k_proj': (d, kv), 'v_proj': (d, kv), 'o_proj': (q, d),
            'gate_proj': (d, f), 'up_proj': (d, f), 'down_proj': (f, d)}
  return [AdapterSpec(t, ('layers', _BLOCK[t], t), *widths[t]) for t in lora.targets]


def shapes(model_config, lora: config_lib.LoraSettings) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{leaf path: shape} of every adapter leaf (a [L, Di, Ra], b [L, Ra, Do])."""
  l, r = model_config.num_layers, lora.rank
  out = {}
  for s in specs(model_config, lora):
    out[s.path + ('a',)] = (l, s.in_features, r)
    out[s.path + ('b',)] = (l, r, s.out_features)
  return out


def num_params(model_config, lora: config_lib.LoraSettings) -> int:
  return sum(math.prod(s) for s in shapes(model_config, lora).values())


def nest(flat: dict[tuple[str, ...], Any]) -> dict:
  """The nested-dict pytree of {leaf path: leaf}."""
  tree: dict = {}
  for path, leaf in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree


def leaves(adapters) -> list[tuple[tuple[str, ...], Any]]:
  """(path, leaf) of every leaf of an adapters pytree (nested dicts), sorted by path."""
  return sorted(_flat_paths(adapters), key=lambda path_leaf: path_leaf[0])


def _flat_paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat_paths(v, prefix + (k,))
  else:
    yield prefix, tree


def init_adapters(model_config, lora: config_lib.LoraSettings, rng: jax.Array, dtype: Any = jnp.float32
                  ) -> dict:
  """A uniform within +-1/sqrt(Di) (x A then has x's scale), B zeros: the delta starts at 0."""
  flat = {}
  keys = jax.random.split(rng, len(lora.targets))
  for key, s in zip(keys, specs(model_config, lora)):
    l, r = model_config.num_layers, lora.rank
    bound = 1.0 / s.in_features ** 0.5
    flat[s.path + ('a',)] = jax.random.uniform(key, (l, s.in_features, r), dtype, -bound, bound)
    flat[s.path + ('b',)] = jnp.zeros((l, r, s.out_features), dtype)
  return nest(flat)


def check_adapters(adapters, model_config, lora: config_lib.LoraSettings, what: str = 'adapters') -> None:
  """Raises a one-line ValueError naming the first leaf that is missing, extra or misshapen."""
  want = shapes(model_config, lora)
  got = {p: tuple(x.shape) for p, x in _flat_paths(adapters)}
  problems = [f'{"/".join(p)} is missing' for p in want if p not in got]
  problems += [f'{"/".join(p)} is not an adapter of rank {lora.rank} over {lora.targets}'
               for p in got if p not in want]
  problems += [f'{"/".join(p)} has shape {got[p]}, expected {want[p]}'
               for p in want if p in got and got[p] != want[p]]
  if problems:
    raise ValueError(f'{what} rejected: ' + '; '.join(problems[:3]))


@flax.struct.dataclass
class Adapted:
  """Params of a model with adapters: the frozen base (transformer.py's params pytree), the
  adapters, and the scale alpha / r (static: a change of scale is a new program)."""
  base: Any
  adapters: Any
  scale: float = flax.struct.field(pytree_node=False)


def base_of(params):
  """The base params of `params` (itself, without adapters)."""
  return params.base if isinstance(params, Adapted) else params


def variables(params) -> dict:
  """Flax variables for `Transformer.apply`: the base, and with adapters the `lora` collection,
  each projection's A and s * B (B scaled once here rather than s applied to every row)."""
  if not isinstance(params, Adapted):
    return {'params': params}
  scaled = jax.tree_util.tree_map_with_path(
      lambda p, x: x * params.scale if p[-1].key == 'b' else x, params.adapters)
  return {'params': params.base, COLLECTION: scaled}


class Dense(nn.Dense):
  """`nn.Dense` (the same params and numerics) plus s (x A) B when the `lora` collection holds
  adapters for this projection; the delta is computed in the layer's dtype."""

  @nn.compact
  def __call__(self, x):
    y = super().__call__(x)
    if not self.has_variable(COLLECTION, 'a'):
      return y
    a_DixRa = self.get_variable(COLLECTION, 'a')
    b_RaxDo = self.get_variable(COLLECTION, 'b')  # already scaled by s (`variables`)
    x, a_DixRa, b_RaxDo = nn.dtypes.promote_dtype(x, a_DixRa, b_RaxDo, dtype=self.dtype)
    return y + (x @ a_DixRa) @ b_RaxDo


@functools.partial(jax.jit, static_argnames=('scale', 'dtype'))
def merge(base, adapters, *, scale: float, dtype: Any = None):
  """Base params with W + s A B in place of every targeted kernel, computed in fp32 from `base`
  as given (never from an earlier merge) and cast to `dtype` (None: each kernel's own)."""
  def leaf(path, w):
    node = adapters
    for key in path[:-1]:
      node = node.get(key) if isinstance(node, dict) else None
      if node is None:
        break
    out_dtype = w.dtype if dtype is None else dtype
    if node is None or path[-1] != 'kernel' or 'a' not in node:
      return w.astype(out_dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w
    delta_LxDixDo = jnp.einsum('liu,luo->lio', node['a'].astype(jnp.float32),
                             node['b'].astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * delta_LxDixDo).astype(out_dtype)
  keys = lambda p: tuple(k.key for k in p)
  return jax.tree_util.tree_map_with_path(lambda p, w: leaf(keys(p), w), base)


# ---------------------------------------------------------------------------------------------
# PEFT's adapter format: adapter_config.json + adapter_model.safetensors.

PEFT_CONFIG_FILE = 'adapter_config.json'
PEFT_WEIGHTS_FILE = 'adapter_model.safetensors'


def peft_tensors(adapters, model_config, lora: config_lib.LoraSettings, dtype: Any = None
                 ) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, host array) of every adapter tensor, layer by layer: A as [Ra, Di] and B as
  [Do, Ra] (torch Linear layout), B unscaled; in `dtype` (None: the adapters' own)."""
  host = {path: np.asarray(jax.device_get(x)) for path, x in leaves(adapters)}
  for i in range(model_config.num_layers):
    for s in specs(model_config, lora):
      for which in ('a', 'b'):
        x = host[s.path + (which,)][i].T
        x = x if dtype is None else x.astype(jnp.dtype(dtype))
        yield s.peft_name(i, which), np.ascontiguousarray(x)


def peft_shapes(model_config, lora: config_lib.LoraSettings) -> dict[str, tuple[int, ...]]:
  """{PEFT name: shape} of every adapter tensor, in `peft_tensors`' order (what a collective
  transport carries for a LoRA update)."""
  out = {}
  for i in range(model_config.num_layers):
    for s in specs(model_config, lora):
      out[s.peft_name(i, 'a')] = (lora.rank, s.in_features)
      out[s.peft_name(i, 'b')] = (s.out_features, lora.rank)
  return out


def peft_config(lora: config_lib.LoraSettings, base_model: str) -> dict:
  """adapter_config.json: the fields PEFT reads for a plain LoRA; it fills in the rest."""
  return dict(peft_type='LORA', task_type='CAUSAL_LM', base_model_name_or_path=base_model,
              r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
              lora_dropout=0.0, bias='none', fan_in_fan_out=False, use_rslora=False,
              use_dora=False, init_lora_weights=True, inference_mode=True, modules_to_save=None)
