"""The one name map between HF tensor names and the parameter pytree of `models.transformer`.

`name_map` ties every HF tensor name to a pytree leaf; loading, saving and weight streaming
(`hf_tensors`) all read it, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import gated_delta
from pipelinerl_jax.models.transformer import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One pytree leaf and the HF tensor(s) it comes from."""
  hf_name: str                # per-layer names hold '{i}', the layer index (and '{e}', the expert)
  path: tuple[str, ...]       # keys into the params pytree
  shape: tuple[int, ...]      # the leaf's shape (leading L when stacked, then X with experts)
  stacked: bool = False       # one HF tensor per layer, stacked on axis 0 of the leaf
  transposed: bool = False    # HF's axes reversed: a Linear weight [out, in] for a Dense kernel
                              # [in, out], a conv1d weight [Cc, 1, Kc] for [Kc, 1, Cc]
  first_layer: int = 0        # the model layer of the leaf's row 0 (runs of layers, see
                              # ModelConfig.layer_groups)
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
  """Every leaf of the params pytree in checkpoint order; q/k/v and gate/up stay adjacent. The
  language model's tensors are under `model.` (`model.language_model.` in a composite dir)."""
  c = config
  d, f = c.hidden_size, c.intermediate_size
  prefix = hf_schema.family_of(c).lm_prefix
  heads = c.num_heads * c.head_dim
  widths = {'q': heads * (2 if c.attention_output_gate else 1),  # Qwen3.5: queries and gates
            'k': c.num_kv_heads * c.head_dim, 'v': c.num_kv_heads * c.head_dim}
  specs = [TensorSpec(f'{prefix}embed_tokens.weight', ('embed', 'embedding'), (c.vocab_size, d))]
  for group in c.layer_groups:
    layer = lambda hf, path, shape, **kw: TensorSpec(
        f'{prefix}layers.{{i}}.{hf}', (group.name, *path), (group.count, *shape), stacked=True,
        first_layer=group.first, **kw)
    if group.linear:
      specs += _gated_delta_specs(c, layer)
    else:
      specs += [layer(f'self_attn.{p}_proj.weight', ('attn', f'{p}_proj', 'kernel'), (d, n),
                      transposed=True) for p, n in widths.items()]
      if c.qkv_bias:
        specs += [layer(f'self_attn.{p}_proj.bias', ('attn', f'{p}_proj', 'bias'), (n,))
                  for p, n in widths.items()]
      specs.append(layer('self_attn.o_proj.weight', ('attn', 'o_proj', 'kernel'),
                         (heads, d), transposed=True))
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
      if c.shared_expert_intermediate_size:  # Qwen3.5-MoE: the shared expert and its gate
        s = c.shared_expert_intermediate_size
        shared = lambda p, shape: layer(f'mlp.shared_expert.{p}.weight',
                                        ('moe', 'shared_expert', p, 'kernel'), shape,
                                        transposed=True)
        specs += [shared('gate_proj', (d, s)), shared('up_proj', (d, s)),
                  shared('down_proj', (s, d)),
                  layer('mlp.shared_expert_gate.weight', ('moe', 'shared_expert_gate', 'kernel'),
                        (d, 1), transposed=True)]
    else:
      specs += [
          layer('mlp.gate_proj.weight', ('mlp', 'gate_proj', 'kernel'), (d, f), transposed=True),
          layer('mlp.up_proj.weight', ('mlp', 'up_proj', 'kernel'), (d, f), transposed=True),
          layer('mlp.down_proj.weight', ('mlp', 'down_proj', 'kernel'), (f, d), transposed=True)]
    specs += [layer('input_layernorm.weight', ('input_norm', 'scale'), (d,)),
              layer('post_attention_layernorm.weight', ('post_attn_norm', 'scale'), (d,))]
  specs.append(TensorSpec(f'{prefix}norm.weight', ('final_norm', 'scale'), (d,)))
  if not c.tie_embeddings:
    specs.append(TensorSpec('lm_head.weight', ('lm_head', 'kernel'), (d, c.vocab_size),
                            transposed=True))
  return specs


def _gated_delta_specs(c: ModelConfig, layer) -> list[TensorSpec]:
  """A Gated DeltaNet mixer's tensors (layers/gated_delta.py): the four input projections
  (q, k, v fused in one; z; b and a), the convolution ([Cc, 1, Kc] in HF, flax's [Kc, 1, Cc]
  here), the decay's A_log and dt_bias, the gated norm and out_proj."""
  hk, hv, dk, dv, cc, kc = gated_delta.dims(c)
  d = c.hidden_size
  proj = lambda name, shape: layer(f'linear_attn.{name}.weight', ('linear_attn', name, 'kernel'),
                                   shape, transposed=True)
  return [proj('in_proj_qkv', (d, cc)), proj('in_proj_z', (d, hv * dv)),
          proj('in_proj_b', (d, hv)), proj('in_proj_a', (d, hv)),
          layer('linear_attn.conv1d.weight', ('linear_attn', 'conv1d', 'kernel'), (kc, 1, cc),
                transposed=True),
          layer('linear_attn.dt_bias', ('linear_attn', 'dt_bias'), (hv,)),
          layer('linear_attn.A_log', ('linear_attn', 'A_log'), (hv,)),
          layer('linear_attn.norm.weight', ('linear_attn', 'norm', 'scale'), (dv,)),
          proj('out_proj', (hv * dv, d))]


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
