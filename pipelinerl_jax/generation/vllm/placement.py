"""Which GPUs each generator process gets: the GPUs the train mesh leaves free, or those named in
generation.remote.devices, split evenly, as CUDA_VISIBLE_DEVICES entries."""

from __future__ import annotations

import os
from typing import Sequence

import jax


def visible_gpus() -> list[str]:
  """The GPUs this process sees, in JAX's order, as CUDA_VISIBLE_DEVICES entries (what a child's
  CUDA_VISIBLE_DEVICES must name); [] on a host without GPUs."""
  gpus = [d for d in jax.devices() if d.platform == 'gpu']
  env = [s.strip() for s in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if s.strip()]
  return env[:len(gpus)] if env else [str(i) for i in range(len(gpus))]


DEVICES_KEY = 'config.generation.remote.devices'


def assign_devices(visible: Sequence[str], mesh_used: int, num_generators: int,
                   requested: str = '', per_child_max: int | None = None
                   ) -> list[tuple[str, ...]]:
  """Each generator child's CUDA_VISIBLE_DEVICES entries, so that N children do not all land on
  GPU 0. `visible`: the trainer's GPUs in JAX's order (its CUDA_VISIBLE_DEVICES entries, else
  '0'..'n-1'); the train mesh holds the first `mesh_used` (sharding.make_mesh). `requested`
  '' = the GPUs the mesh leaves free, split evenly (a remainder stays unused); '5,6,7' = those.
  No GPUs: () for every child. `per_child_max`: most GPUs one child can use (1 while the
  in-process vLLM engine has no tensor parallelism). Raises a one-line ValueError naming
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
