"""Device mesh and partitioning: the one place that decides where every array lives.

Mesh axes: 'data' (pure data parallel: params replicated), 'fsdp' (data parallel with params,
gradients and optimizer state sharded), 'tensor' (Megatron-style split of heads / MLP width),
'expert' (a mixture of experts' experts split across devices; for everything else it is one
more data-parallel axis: rows are split over it, and an MoE layer exchanges them so that each
device runs its own experts on every token routed there, models/layers/moe.py).
Params are placed by regex rules over their '/'-joined pytree path; a rule names a mesh axis for
each dimension. A dimension that the axis size does not divide is left unsplit rather than
failing, so tiny test models run on any mesh. FSDP only stores a slice of each parameter and
gathers it for use, so any dimension serves: when the rule's dimension does not divide, the
largest other free dimension that does takes the 'fsdp' axis (Qwen2.5-7B's vocabulary 152064
divides by 6 where its width 3584 does not). `replicated_on_fsdp` names what still stays whole.

Qwen2.5 shapes against these rules (V, D, F; q = H*Dh, kv = K*Dh; L = 28): 1.5B 151936, 1536,
8960, q 1536, kv 256; 7B 152064, 3584, 18944, q 3584, kv 512. Every matrix shards through D on
an fsdp axis of 2, 4 or 8 (the 1.5B's also on 3 and 6: 1536 = 2^9 * 3); 5 divides neither D.
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')
BATCH_AXES = ('data', 'fsdp', 'expert')  # rows of a packed batch are split over these

# Dimension layouts follow pipelinerl_jax/models/transformer.py (stacked layers lead with L).
PARAM_RULES: Sequence[tuple[str, tuple]] = (
    (r'embed/embedding$', ('tensor', 'fsdp')),                    # [V, D]
    (r'attn/(q|k|v)_proj/kernel$', (None, 'fsdp', 'tensor')),     # [L, D, H*Dh]
    (r'attn/(q|k|v)_proj/bias$', (None, 'tensor')),               # [L, H*Dh]
    (r'attn/o_proj/kernel$', (None, 'tensor', 'fsdp')),           # [L, H*Dh, D]
    # Qwen3's per-head q/k norms: 'tensor' splits heads, and every head needs all of Dh.
    (r'attn/(q|k)_norm/scale$', ()),                              # [L, Dh]
    (r'mlp/(gate|up)_proj/kernel$', (None, 'fsdp', 'tensor')),    # [L, D, F]
    (r'mlp/down_proj/kernel$', (None, 'tensor', 'fsdp')),         # [L, F, D]
    (r'moe/router/kernel$', (None, 'fsdp', None)),                # [L, D, X]
    (r'moe/(gate|up)_proj/kernel$', (None, 'expert', 'fsdp', 'tensor')),  # [L, X, D, I]
    (r'moe/down_proj/kernel$', (None, 'expert', 'tensor', 'fsdp')),       # [L, X, I, D]
    # Qwen3.5-MoE's shared expert (a dense SwiGLU beside the routed experts) and its gate.
    (r'shared_expert/(gate|up)_proj/kernel$', (None, 'fsdp', 'tensor')),  # [L, D, Is]
    (r'shared_expert/down_proj/kernel$', (None, 'tensor', 'fsdp')),       # [L, Is, D]
    (r'shared_expert_gate/kernel$', (None, 'fsdp', None)),                # [L, D, 1]
    # Gated DeltaNet (Qwen3.5): q, k and v share one projection and one convolution over their
    # channels, so 'tensor' leaves these layers whole (the full-attention ones still split).
    (r'linear_attn/in_proj_\w+/kernel$', (None, 'fsdp', None)),          # [L, D, Cc | Hv*Dv | Hv]
    (r'linear_attn/out_proj/kernel$', (None, None, 'fsdp')),             # [L, Hv*Dv, D]
    (r'lm_head/kernel$', ('fsdp', 'tensor')),                     # [D, V]
    (r'.*', ()),                                                  # norms: replicated
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1,
              devices=None) -> Mesh:
  """A (data, fsdp, tensor, expert) mesh over the first data*fsdp*tensor*expert devices; one
  size may be -1 to take all remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor, expert]
  if sizes.count(-1) > 1:
    raise ValueError(f'mesh: at most one of data/fsdp/tensor/expert may be -1, got {sizes}')
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f'mesh: {len(devices)} devices are not divisible by {known}')
    sizes[sizes.index(-1)] = len(devices) // known
  needed = int(np.prod(sizes))
  if needed > len(devices):
    raise ValueError(f'mesh: data*fsdp*tensor*expert = {sizes} needs {needed} devices, '
                     f'{len(devices)} available')
  # A smaller mesh takes the first devices; the rest stay free (e.g. for generation).
  return Mesh(np.asarray(devices[:needed]).reshape(sizes), MESH_AXES)


def mesh_text(sizes) -> str:
  """Mesh sizes as `train.mesh` writes them: 'data,fsdp,tensor', with ',expert' only when the
  expert axis splits (a dense model's mesh reads as it always has)."""
  sizes = [int(s) for s in sizes]
  return ','.join(map(str, sizes if len(sizes) > 3 and sizes[3] > 1 else sizes[:3]))


def path_str(path) -> str:
  """'layers/attn/q_proj/kernel' for a pytree key path (dict keys, attributes, indices)."""
  def part(k):
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return '/'.join(part(k) for k in path)


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules=PARAM_RULES) -> P:
  for pattern, axes in rules:
    if re.search(pattern, path):
      break
  axes = tuple(axes) + (None,) * (len(shape) - len(axes))
  if len(axes) != len(shape):
    raise ValueError(f'partition rule {pattern!r} has {len(axes)} axes for {path} of shape {shape}')
  # An axis the mesh lacks (a mesh made without 'expert') is as good as one of size 1.
  axes = tuple(a if a in mesh.shape else None for a in axes)
  kept = [a if a is not None and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)]
  fsdp = mesh.shape['fsdp']
  if 'fsdp' in axes and 'fsdp' not in kept and fsdp > 1:
    # A dimension held by an axis of size 1 is as good as free.
    free = sorted((i for i, a in enumerate(kept) if a is None or mesh.shape[a] == 1),
                  key=lambda i: -shape[i])
    fits = [i for i in free if shape[i] % fsdp == 0]
    if fits:
      kept[fits[0]] = 'fsdp'
  return P(*kept)


def param_shardings(params, mesh: Mesh, rules=PARAM_RULES):
  """NamedSharding for every leaf of a params pytree (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, spec_for(path_str(path), x.shape, mesh, rules)), params)


def replicated_on_fsdp(params, mesh: Mesh, min_fraction: float = 0.01,
                       rules=PARAM_RULES) -> list[tuple[str, tuple[int, ...]]]:
  """(path, shape) of every parameter holding >= `min_fraction` of all parameters that the
  'fsdp' axis does not split (each fsdp device holds it whole); [] when fsdp is 1."""
  if mesh.shape['fsdp'] == 1:
    return []
  leaves = jax.tree_util.tree_leaves_with_path(params)
  total = sum(int(np.prod(x.shape)) for _, x in leaves)
  found = []
  for path, x in leaves:
    name = path_str(path)
    if (np.prod(x.shape) >= min_fraction * total
        and 'fsdp' not in spec_for(name, x.shape, mesh, rules)):
      found.append((name, tuple(x.shape)))
  return found


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The axes of BATCH_AXES that `mesh` has (all of them on a mesh from `make_mesh`)."""
  return tuple(a for a in BATCH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh, leading_dims: int = 0) -> NamedSharding:
  """Packed rows split over (data, fsdp, expert); `leading_dims` unsplit axes (e.g.
  micro-batches) first."""
  return NamedSharding(mesh, P(*([None] * leading_dims), batch_axes(mesh)))


def local_block(sharding: NamedSharding, shape: tuple[int, ...], axis: int) -> slice:
  """The indices along `axis` of an array of `shape` that this process's devices hold under
  `sharding`: one block, as when the mesh lists devices process by process (make_mesh does)."""
  spans = {index[axis].indices(shape[axis])[:2]
           for index in sharding.addressable_devices_indices_map(shape).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  if sum(b - a for a, b in spans) != stop - start:
    raise ValueError(f'this process holds the blocks {sorted(spans)} of axis {axis}, not one '
                     'block: list the mesh devices process by process')
  return slice(start, stop)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
  """Devices the rows of a batch are split over (data x fsdp x expert)."""
  return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))
