"""Which devices generators get.

GPUs: the GPUs the train mesh leaves free, or those named in generation.remote.devices, as
CUDA_VISIBLE_DEVICES entries (`assign_devices`). A local Ray start hands exactly these to Ray,
which gives each generator actor its own (`num_gpus`), so none lands on a trainer's GPU.

CPU cores: Ray counts CPUs but does not say which cores an actor may use, so on a node without
GPUs the pool gives each generator actor cores of its own (`CoreAllocator`) and the actor pins its
process to them before JAX or torch start their thread pools.
"""

from __future__ import annotations

import collections
import os
from typing import Hashable, Sequence

import jax


def visible_gpus() -> list[str]:
  """The GPUs this process sees, in JAX's order, as CUDA_VISIBLE_DEVICES entries (what a local
  Ray's CUDA_VISIBLE_DEVICES must name); [] on a host without GPUs."""
  gpus = [d for d in jax.devices() if d.platform == 'gpu']
  env = [s.strip() for s in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if s.strip()]
  return env[:len(gpus)] if env else [str(i) for i in range(len(gpus))]


DEVICES_KEY = 'config.generation.remote.devices'


def free_gpus(visible: Sequence[str], mesh_used: int, requested: str = '') -> list[str]:
  """The GPUs a local Ray cluster may give generators: `requested` (checked), else those the
  train mesh leaves free (`assign_devices`' rules, before the split among generators)."""
  shares = assign_devices(visible, mesh_used, 1, requested)
  return list(shares[0])


def assign_devices(visible: Sequence[str], mesh_used: int, num_generators: int,
                   requested: str = '', per_child_max: int | None = None
                   ) -> list[tuple[str, ...]]:
  """Each generator's CUDA_VISIBLE_DEVICES entries, so that N generators do not all land on
  GPU 0. `visible`: the trainer's GPUs in JAX's order (its CUDA_VISIBLE_DEVICES entries, else
  '0'..'n-1'); the train mesh holds the first `mesh_used` (sharding.make_mesh). `requested`
  '' = the GPUs the mesh leaves free, split evenly (a remainder stays unused); '5,6,7' = those.
  No GPUs: () for every generator. `per_child_max`: most GPUs one generator can use (1 while
  the in-process vLLM engine has no tensor parallelism). Raises a one-line ValueError naming
  generation.remote.devices when no valid assignment exists."""
  ids = [s.strip() for s in requested.split(',') if s.strip()]
  if not visible:
    if ids:
      raise ValueError(f'{DEVICES_KEY}={requested!r}: this host has no GPUs (leave it empty)')
    return [()] * num_generators
  used = list(visible[:mesh_used])
  if ids:
    unknown = [i for i in ids if i not in visible]
    if unknown:
      raise ValueError(f'{DEVICES_KEY}={requested!r}: GPU(s) {",".join(unknown)} are not '
                       f'visible (visible: {",".join(visible)})')
    if len(set(ids)) != len(ids):
      raise ValueError(f'{DEVICES_KEY}={requested!r} names a GPU twice')
    clash = [i for i in ids if i in used]
    if clash:
      raise ValueError(f'{DEVICES_KEY}={requested!r}: GPU(s) {",".join(clash)} belong to the '
                       f'train mesh (train.mesh uses {",".join(used)})')
    if len(ids) % num_generators:
      raise ValueError(f'{DEVICES_KEY}={requested!r}: {len(ids)} GPUs do not split evenly '
                       f'among generation.num_generators={num_generators}')
    free = ids
  else:
    free = list(visible[mesh_used:])
    if len(free) < num_generators:
      raise ValueError(f'{DEVICES_KEY}: the train mesh uses {min(mesh_used, len(visible))} '
                       f'of {len(visible)} GPUs, leaving {len(free)} for generation.'
                       f'num_generators={num_generators}; shrink train.mesh or lower it')
  k = len(free) // num_generators
  if per_child_max is not None and k > per_child_max:
    raise ValueError(f'{DEVICES_KEY}: {k} GPUs per generator would need tensor parallelism, '
                     'which the in-process vLLM engine does not do; set generation.'
                     f'num_generators={len(free) if ids else k * num_generators} (one GPU each)')
  return [tuple(free[i * k:(i + 1) * k]) for i in range(num_generators)]


class CoreAllocator:
  """Cores per node, handed out least-used first: disjoint while a node has enough, shared
  evenly once more are asked for than it has (e.g. a benchmark with more actors than cores)."""

  def __init__(self):
    self._use: dict[Hashable, collections.Counter] = {}

  def take(self, node: Hashable, allowed: Sequence[int], n: int) -> tuple[int, ...]:
    """n cores of `allowed` (the cores the actor's process may use on `node`)."""
    if n < 1 or not allowed:
      raise ValueError(f'cannot take {n} of cores {list(allowed)}')
    use = self._use.setdefault(node, collections.Counter())
    ranked = sorted(allowed, key=lambda c: (use[c], c))
    cores = tuple(sorted(ranked[:n]))
    use.update(cores)
    return cores

  def take_free(self, node: Hashable, allowed: Sequence[int]) -> tuple[int, ...]:
    """Every core of `allowed` that nobody holds on `node`, now held (e.g. the driver's trainer
    takes what the generators left, so that a restarted generator is not pinned onto it)."""
    use = self._use.setdefault(node, collections.Counter())
    cores = tuple(sorted(c for c in allowed if use[c] <= 0))
    use.update(cores)
    return cores

  def release(self, node: Hashable, cores: Sequence[int]) -> None:
    use = self._use.get(node)
    if use is not None:
      use.subtract(cores)
