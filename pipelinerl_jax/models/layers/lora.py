"""LoRA: a low-rank delta on the projections of every layer, kept apart from the frozen base.

For a targeted projection with kernel W [Di, Do] (models/transformer.py's [in, out] layout):

  y = x W + s (x A) B,    s = alpha / r,   A [Di, Ra] random, B [Ra, Do] zeros

computed unmerged, so that B = 0 gives exactly the base model's outputs, and so that the base can
be shared, read-only, by the trainer and an inline generation engine. Shape letters: Ra is the
adapter rank r, Di and Do a projection's input and output widths (the README's table).

Adapters are their own pytree, with the base's paths and an `a` and `b` leaf under each targeted
projection, stacked over layers like the base's kernels, run by run of layers of one kind
(`ModelConfig.layer_groups`: `layers` for a model whose layers are all alike):

  layers/attn/{q,k,v,o}_proj/{a [L, Di, Ra], b [L, Ra, Do]}
  layers/mlp/{gate,up,down}_proj/{a, b}
  layers_0/linear_attn/{in_proj_qkv,in_proj_z,out_proj}/{a, b}    (a hybrid: Qwen3.5's Gated
  layers_1/attn/...                                                 DeltaNet runs beside
                                                                    full-attention ones)

A model adapts the targets it has (`targets_in`): a Gated DeltaNet layer's projections where it
has them, full attention's elsewhere, the MLP's in every layer (not a mixture of experts').

`Adapted(base, adapters, scale)` is what every model function takes as `params` to run with
adapters; `variables` turns it into the Flax variables (the `lora` collection holds each
projection's A and s * B), which `Dense` reads. `merge` makes merged weights where a path needs
them (an export, a generator without a LoRA kernel): always from the pristine base, in fp32,
so nothing drifts however many updates were merged before.

PEFT's names and adapter dirs: models/hf/peft.py (`AdapterSpec.hf_module` is the module each
adapter wraps, under the language model's prefix).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from pipelinerl_jax import config as config_lib

# Every linear map of a layer, by the name HF and the params pytree give it, and its sub-block.
TARGETS = config_lib.LORA_TARGETS
_BLOCK = {'q_proj': 'attn', 'k_proj': 'attn', 'v_proj': 'attn', 'o_proj': 'attn',
          'in_proj_qkv': 'linear_attn', 'in_proj_z': 'linear_attn', 'in_proj_b': 'linear_attn',
          'in_proj_a': 'linear_attn', 'out_proj': 'linear_attn',
          'gate_proj': 'mlp', 'up_proj': 'mlp', 'down_proj': 'mlp'}
_HF_BLOCK = {'attn': 'self_attn', 'linear_attn': 'linear_attn', 'mlp': 'mlp'}
COLLECTION = 'lora'


def active(settings: config_lib.LoraSettings) -> config_lib.LoraSettings | None:
  """`settings` (config.model.lora, checked when it was made) when LoRA is on (rank > 0), else
  None: the `lora` the functions here take."""
  return settings if settings.rank > 0 else None


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
  """One targeted projection of one run of layers: where its kernel and adapters sit, their
  widths, and the model layers the run's rows are."""
  target: str                  # 'q_proj', ...
  path: tuple[str, ...]        # ('layers', 'attn', 'q_proj'): the kernel is path + ('kernel',)
  in_features: int             # Di
  out_features: int            # Do
  first_layer: int             # the model layer of row 0
  count: int                   # rows (layers) in the run

  @property
  def layers(self) -> range:
    return range(self.first_layer, self.first_layer + self.count)

  def hf_module(self, layer: int) -> str:
    """The HF module the adapter of model layer `layer` wraps, under the language model's
    prefix (`model.` or `model.language_model.`: hf/peft.py adds it)."""
    return f'layers.{layer}.{_HF_BLOCK[self.path[1]]}.{self.target}'


# Projections a serving engine fuses into one module (vLLM: qkv_proj, gate_up_proj, and for
# Qwen3.5's Gated DeltaNet in_proj_qkvz and in_proj_ba).
FUSED_GROUPS = (('q_proj', 'k_proj', 'v_proj'), ('gate_proj', 'up_proj'),
                ('in_proj_qkv', 'in_proj_z'), ('in_proj_b', 'in_proj_a'))


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
  of experts (its experts are stacked weights, not projections)."""
  c = model_config
  if getattr(c, 'moe_layers', ()):
    raise ValueError(f'config.model.lora: LoRA on a mixture-of-experts model ({c.num_experts} '
                     f'experts in {len(c.moe_layers)} layers) is not supported; set '
                     'model.lora.rank=0')


def _widths(c) -> dict[str, tuple[int, int]]:
  """(Di, Do) of every projection a layer of `c` may have. Qwen3.5's gated attention's q_proj
  makes each head's query and its gate; a Gated DeltaNet's in_proj_qkv its q, k and v channels
  (Cc, layers/gated_delta.py's `dims`)."""
  d, f = c.hidden_size, c.intermediate_size
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
  dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
  return {'q_proj': (d, q * (2 if c.attention_output_gate else 1)), 'k_proj': (d, kv),
          'v_proj': (d, kv), 'o_proj': (q, d),
          'in_proj_qkv': (d, 2 * hk * dk + hv * dv), 'in_proj_z': (d, hv * dv),
          'in_proj_b': (d, hv), 'in_proj_a': (d, hv), 'out_proj': (hv * dv, d),
          'gate_proj': (d, f), 'up_proj': (d, f), 'down_proj': (f, d)}


def specs(model_config, lora: config_lib.LoraSettings) -> list[AdapterSpec]:
  """The targeted projections of `model_config` (a transformer.ModelConfig), run by run of
  layers and in TARGETS order within a run; the targets a run does not have are skipped (a
  one-line ValueError when no layer has any)."""
  check_base(model_config)
  c = model_config
  widths = _widths(c)
  out = []
  for group in c.layer_groups:
    out += [AdapterSpec(t, (group.name, _BLOCK[t], t), *widths[t], group.first, group.count)
            for t in lora.targets if _BLOCK[t] in _blocks(group)]
  if not out:
    has = {b for group in c.layer_groups for b in _blocks(group)}
    raise ValueError(f'config.model.lora.targets: {", ".join(lora.targets)} name no projection '
                     f'of {c.architecture} (it has '
                     f'{", ".join(t for t in TARGETS if _BLOCK[t] in has)})')
  return out


def _blocks(group) -> tuple[str, str]:
  """The sub-blocks of a run of layers (a transformer.LayerGroup): its mixer and its MLP."""
  return ('linear_attn' if group.linear else 'attn', 'moe' if group.moe else 'mlp')


def targets_in(model_config, lora: config_lib.LoraSettings) -> tuple[str, ...]:
  """The targets `model_config` has, in TARGETS order: what its adapters are on."""
  have = {s.target for s in specs(model_config, lora)}
  return tuple(t for t in lora.targets if t in have)


def by_layer(adapter_specs: list[AdapterSpec]) -> list[tuple[int, AdapterSpec]]:
  """(model layer, spec) of every adapted projection, layer by layer and in `adapter_specs`'
  order within a layer: the order PEFT tensors are saved and sent in."""
  return sorted(((i, s) for s in adapter_specs for i in s.layers), key=lambda pair: pair[0])


def shapes(model_config, lora: config_lib.LoraSettings) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{leaf path: shape} of every adapter leaf (a [L, Di, Ra], b [L, Ra, Do]; L the run's)."""
  r, out = lora.rank, {}
  for s in specs(model_config, lora):
    out[s.path + ('a',)] = (s.count, s.in_features, r)
    out[s.path + ('b',)] = (s.count, r, s.out_features)
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
  adapter_specs = specs(model_config, lora)
  for key, s in zip(jax.random.split(rng, len(adapter_specs)), adapter_specs):
    bound = 1.0 / s.in_features ** 0.5
    flat[s.path + ('a',)] = jax.random.uniform(key, (s.count, s.in_features, lora.rank), dtype,
                                               -bound, bound)
    flat[s.path + ('b',)] = jnp.zeros((s.count, lora.rank, s.out_features), dtype)
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
