"""Trainer side of a weight sync: the params pytree as HF-named torch tensors, without copies.

`hf_torch_tensors(params, config)` yields (hf_name, torch tensor) in checkpoint order. Each
pytree leaf crosses to torch once, with `torch.from_dlpack` (the tensor aliases the JAX buffer);
one layer of a stacked leaf is `leaf[i]` and HF's [out, in] layout of a Dense kernel is `.T`,
both views. So on a leaf held in one buffer, on the CPU or on one GPU, no byte is copied here:
the only copy is the one the receiver makes into its own parameters (vLLM's loader does
`param.copy_(tensor)`, casting to the serving dtype on the way; a GPU leaf crosses as a CUDA
tensor on its device, so an in-process vLLM on that GPU copies device to device).
`is_zero_copy` says which tensors alias their leaf.

Leaves that live on several devices (sharded), or on a GPU that this torch cannot address, are
gathered to host (one copy) and reported as not zero-copy. Collective transports use
`gathered_torch_tensors` instead: one HF tensor at a time, made on the device the sender packs
from.

The tensors alias buffers JAX treats as immutable: receivers must only read them, and the params
must not be donated or deleted until the receiver is done (the `api.Engine.update_params`
ownership contract).

LoRA (models/layers/lora.py): an update is the adapters alone, named and laid out as PEFT saves them
(A [Ra, Di] and B [Do, Ra] per layer, torch's Linear layout: `hf.peft.shapes`); the
`update_*` functions take the run's `config.LoraSettings` (None: a full update) and pick the
one layout or the other.

Atomic units: vLLM fuses q/k/v into one `qkv_proj` module (weights and biases), gate/up into
`gate_up_proj`, and a Gated DeltaNet layer's in_proj_qkv/in_proj_z into `in_proj_qkvz` and
in_proj_b/in_proj_a into `in_proj_ba`; it re-packs a module only once all of its parts have
arrived, so a unit sent without its siblings is loaded half-old, half-garbage. `fusion_units`
groups consecutive tensors by the module they land in, and `buckets` packs whole units into
byte-bounded buckets for transports that move a bounded amount at a time; a unit is never split
across buckets.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from typing import Any, Iterable, Iterator, Sequence

import jax
import ml_dtypes
import numpy as np
import torch

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models import transformer

# HF names of the parts that vLLM loads into one fused module, -> that module's name.
_FUSED = (
    (re.compile(r'^(.*\.self_attn\.)[qkv]_proj\.(weight|bias)$'), r'\1qkv_proj'),
    # An MLP, or a mixture of experts' shared expert (Qwen3.5-MoE: mlp.shared_expert.*).
    (re.compile(r'^(.*\.mlp\.(?:shared_expert\.)?)(gate|up)_proj\.weight$'), r'\1gate_up_proj'),
    # A Gated DeltaNet layer (Qwen3.5): qkv with z, b with a.
    (re.compile(r'^(.*\.linear_attn\.)in_proj_(qkv|z)\.weight$'), r'\1in_proj_qkvz'),
    (re.compile(r'^(.*\.linear_attn\.)in_proj_(b|a)\.weight$'), r'\1in_proj_ba'),
)


def module_of(hf_name: str) -> str:
  """The serving-side module an HF tensor is loaded into (fused modules share one name)."""
  for pattern, module in _FUSED:
    if pattern.match(hf_name):
      return pattern.sub(module, hf_name)
  return hf_name.rsplit('.', 1)[0]


def expected_shapes(config: transformer.ModelConfig) -> dict[str, tuple[int, ...]]:
  """{hf_name: HF shape} of every tensor a full update carries."""
  return {name: spec.hf_shape for name, spec, _ in hf_names.checkpoint_order(config)}


def leaf_to_torch(x: Any) -> torch.Tensor:
  """One leaf as a torch tensor: an alias of the buffer when the leaf is one buffer on the CPU
  or on one GPU (a CUDA tensor there), else a host copy (sharded leaves)."""
  if isinstance(x, torch.Tensor):
    return x
  if isinstance(x, jax.Array):
    devices = x.sharding.device_set
    platform = next(iter(devices)).platform if len(devices) == 1 else None
    if platform == 'cpu' or (platform == 'gpu' and torch.cuda.is_available()):
      return torch.from_dlpack(x)  # ordered after x's producer; aliases its buffer
  host = np.ascontiguousarray(np.asarray(x))
  with warnings.catch_warnings():  # the gathered copy is read-only; receivers only read it
    warnings.simplefilter('ignore', UserWarning)
    if host.dtype.name == 'bfloat16':  # numpy has no bf16: reinterpret the bits
      return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def hf_torch_tensors(params, config: transformer.ModelConfig
                     ) -> Iterator[tuple[str, torch.Tensor]]:
  """Yields (hf_name, tensor in HF layout) in checkpoint order; see the module docstring.

  Each leaf is converted once, when its first tensor is yielded, so a consumer that stops
  early has touched only what it read.
  """
  converted: dict[tuple[str, ...], torch.Tensor] = {}
  for name, spec, index in hf_names.checkpoint_order(config):
    if spec.path not in converted:
      converted[spec.path] = leaf_to_torch(hf_names.leaf_at(params, spec.path))
    t = converted[spec.path]
    if tuple(t.shape) != spec.shape:
      raise ValueError(f'leaf {"/".join(spec.path)} has shape {tuple(t.shape)}, the config '
                       f'implies {spec.shape}')
    t = t if index is None else t[index]
    yield name, (_reversed_axes(t) if spec.transposed else t)


def _reversed_axes(t: torch.Tensor) -> torch.Tensor:
  """`t` with its axes reversed, a view (torch's `.T` is for matrices only: a conv1d weight has
  three axes)."""
  return t.permute(*range(t.ndim - 1, -1, -1))


def gathered_torch_tensors(params, config: transformer.ModelConfig, device: jax.Device,
                           dtype: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
  """(hf_name, tensor in HF layout) in checkpoint order for a collective transport, each made
  alone: sliced, transposed and cast to `dtype` where the (sharded) params live, then gathered
  onto `device` and handed over as a DLPack alias of that one-device array (a CUDA tensor on a
  GPU). A sender that copies each tensor into its bucket and drops it holds one HF tensor
  beyond the params at a time, never a gathered model."""
  for name, x in hf_names.hf_tensors(params, config, dtype):
    yield name, torch.from_dlpack(jax.device_put(x, device))


def params_from_hf(tensors: Iterable[tuple[str, torch.Tensor]], config: transformer.ModelConfig,
                   dtype=None) -> dict:
  """The params pytree (host numpy) of a full update in HF layout: the inverse of
  `hf_torch_tensors`, for a JAX engine fed by a collective transport. One copy (the stack of the
  per-layer tensors, transposed back); `dtype` (e.g. the model's param dtype) casts."""
  got = {name: t for name, t in tensors}
  check_complete([(n, tuple(t.shape)) for n, t in got.items()], expected_shapes(config))
  to_np = lambda t: (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                     if t.dtype == torch.bfloat16 else t.numpy())
  params: dict = {}
  for spec in hf_names.name_map(config):
    leaf = hf_names.assemble(spec, lambda name: to_np(got[name]))
    node = params
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = leaf if dtype is None else leaf.astype(dtype)
  return params


def update_shapes(config: transformer.ModelConfig, lora: config_lib.LoraSettings | None = None
                  ) -> dict[str, tuple[int, ...]]:
  """{name: shape} of every tensor of an update, in wire order: a full one's HF tensors, or the
  adapters' PEFT tensors."""
  return expected_shapes(config) if lora is None else hf_peft.shapes(config, lora)


def gathered_update_tensors(params, config: transformer.ModelConfig, device: jax.Device,
                            dtype: str | None = None, lora: config_lib.LoraSettings | None = None
                            ) -> Iterator[tuple[str, torch.Tensor]]:
  """`gathered_torch_tensors`, or with `lora` the adapters' PEFT tensors (`params` are the
  adapters), each on `device` in `dtype`, in `update_shapes` order."""
  if lora is None:
    yield from gathered_torch_tensors(params, config, device, dtype)
    return
  for name, x in hf_peft.tensors(params, config, lora, dtype):
    yield name, torch.from_numpy(x) if device.platform == 'cpu' else torch.from_dlpack(
        jax.device_put(x, device))


def update_from_hf(tensors: Iterable[tuple[str, torch.Tensor]], config: transformer.ModelConfig,
                   lora: config_lib.LoraSettings | None = None, dtype=None) -> dict:
  """The pytree (host numpy) of an update received in wire layout: `params_from_hf`, or with
  `lora` the adapters from their PEFT tensors (one copy)."""
  if lora is None:
    return params_from_hf(tensors, config, dtype)
  got = dict(tensors)
  check_complete([(n, tuple(t.shape)) for n, t in got.items()], hf_peft.shapes(config, lora))
  rows = hf_peft.stacked(lambda name, _: got[name].numpy(), config, lora)
  return lora_lib.nest({path: np.stack(r) if dtype is None else np.stack(r).astype(dtype)
                        for path, r in rows.items()})


def is_zero_copy(tensor: torch.Tensor, leaf: Any) -> bool:
  """True when `tensor`'s bytes lie inside `leaf`'s single buffer (an alias, not a copy)."""
  if not isinstance(leaf, jax.Array) or len(leaf.sharding.device_set) != 1:
    return False
  start = leaf.unsafe_buffer_pointer()
  end = start + leaf.nbytes
  return start <= tensor.data_ptr() < end


def zero_copy_report(params, config: transformer.ModelConfig) -> dict[str, bool]:
  """{hf_name: aliases the params' buffer}, for every tensor `hf_torch_tensors` yields."""
  leaves = {spec.path: hf_names.leaf_at(params, spec.path) for spec in hf_names.name_map(config)}
  specs = {name: spec for name, spec, _ in hf_names.checkpoint_order(config)}
  return {name: is_zero_copy(t, leaves[specs[name].path])
          for name, t in hf_torch_tensors(params, config)}


# ---------------------------------------------------------------------------------------------
# Layout and grouping for transports.

TORCH_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def numel(shape: Sequence[int]) -> int:
  n = 1
  for d in shape:
    n *= d
  return n


def tensor_nbytes(t: torch.Tensor) -> int:
  return t.numel() * t.element_size()


def fusion_units(tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
  """Consecutive tensors grouped by the serving module they load into (q/k/v weights and
  biases together, gate/up together, everything else alone or with its bias)."""
  for _, unit in itertools.groupby(tensors, key=lambda nt: module_of(nt[0])):
    yield list(unit)


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Whole fusion units, at most `max_bytes` in all unless one unit alone is larger."""
  tensors: list[tuple[str, torch.Tensor]]

  @property
  def nbytes(self) -> int:
    return sum(tensor_nbytes(t) for _, t in self.tensors)

  @property
  def names(self) -> list[str]:
    return [n for n, _ in self.tensors]


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[Bucket]:
  """Packs consecutive fusion units into buckets of at most `max_bytes`; a unit is never split
  (one larger than `max_bytes` forms a bucket of its own)."""
  if max_bytes <= 0:
    raise ValueError(f'max_bytes={max_bytes} must be positive')
  current, size = [], 0
  for unit in fusion_units(tensors):
    unit_bytes = sum(tensor_nbytes(t) for _, t in unit)
    if current and size + unit_bytes > max_bytes:
      yield Bucket(current)
      current, size = [], 0
    current += unit
    size += unit_bytes
  if current:
    yield Bucket(current)


def check_complete(names_shapes: Sequence[tuple[str, tuple[int, ...]]],
                   expected: dict[str, tuple[int, ...]]) -> None:
  """Raises ValueError unless `names_shapes` is exactly `expected`: every name once, with its
  shape, nothing extra. A partial update would leave the receiver half-updated."""
  seen, problems = set(), []
  for name, shape in names_shapes:
    if name in seen:
      problems.append(f'{name} sent twice')
    seen.add(name)
    if name not in expected:
      problems.append(f'{name} is not a tensor of the model')
    elif tuple(shape) != tuple(expected[name]):
      problems.append(f'{name} has shape {tuple(shape)}, expected {tuple(expected[name])}')
  missing = sorted(set(expected) - seen)
  if missing:
    problems.append(f'{len(missing)} tensors missing, e.g. {missing[:3]}')
  if problems:
    raise ValueError('weight update rejected: ' + '; '.join(problems[:5]) +
                     (f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''))
