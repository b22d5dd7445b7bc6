"""Which accelerator JAX runs on, and a refusal when a run meant for GPUs would run on a CPU.

JAX falls back to its CPU backend with a logged warning when its CUDA backend cannot start (a
bad environment variable, a driver older than the plugin, no plugin installed). A run meant for
GPUs then crawls, or dies of memory much later, and a benchmark reports CPU figures as GPU
ones. `check` turns that into one line before anything is loaded: which setting needs a GPU,
JAX's own reason for having none, and whether the OS shows an NVIDIA device.

A config needs a GPU when it says so (`config.platform='gpu'`, the GPU presets), when its
trainer mesh is larger than the devices JAX sees, or when it sends weights over NCCL or picks
GPU ids for generators. `config.allow_cpu=True` lets such a config run on the CPU backend
anyway, for debugging.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

# The device files JAX itself looks for before it tries its CUDA backend (its hardware_utils).
NVIDIA_DEVICE_FILES = ('/dev/nvidia0', '/dev/nvidiactl', '/dev/dxg')
CUDA_PLUGIN_MODULES = ('jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12', 'jax_cuda13_plugin',
                       'jax_cuda12_plugin')
ACCELERATOR_BACKENDS = ('gpu', 'tpu')


def nvidia_device_files() -> list[str]:
  """The NVIDIA device files the OS shows, whatever JAX makes of them."""
  return [path for path in NVIDIA_DEVICE_FILES if os.path.exists(path)]


def cuda_plugin_installed() -> bool:
  for name in CUDA_PLUGIN_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except (ImportError, ValueError):  # a parent package that is absent or broken
      continue
  return False


def _one_line(text: Any) -> str:
  return ' '.join(str(text).split())


def jax_backend_errors() -> dict[str, str]:
  """The backends JAX tried and could not start, with its error (JAX keeps these in a private
  table; empty where this JAX has none). Call after JAX has started its backends."""
  try:
    from jax._src import xla_bridge
  except ImportError:
    return {}
  return {k: _one_line(v) for k, v in dict(getattr(xla_bridge, '_backend_errors', {})).items()}


def chosen_platforms() -> str:
  """The backends JAX was told to use (JAX_PLATFORMS or jax_platforms), '' for its own choice."""
  import jax
  return os.environ.get('JAX_PLATFORMS', '') or (jax.config.jax_platforms or '')


def no_gpu_reason() -> str:
  """Why JAX has no GPU backend, in JAX's words where it gave any. Starts JAX's backends."""
  import jax
  jax.devices()
  errors = jax_backend_errors()
  for name in ('cuda', 'rocm', 'gpu'):
    if name in errors:
      return f'its {name.upper()} backend failed to start: {errors[name]}'
  chosen = chosen_platforms()
  if chosen and not any(p in chosen for p in ('cuda', 'gpu', 'rocm')):
    return f'JAX_PLATFORMS={chosen!r} leaves the GPU out'
  if not cuda_plugin_installed():
    return 'no CUDA plugin for JAX is installed (pip install -r requirements-gpu.txt)'
  if not nvidia_device_files():
    return 'the OS shows no NVIDIA device'
  return 'JAX found no GPU'


def describe_no_gpu() -> str:
  """`no_gpu_reason`, and the NVIDIA device files the OS shows when there are any (then the
  fault is JAX's set-up, not the machine)."""
  files = nvidia_device_files()
  seen = f' (the OS shows an NVIDIA device: {", ".join(files)})' if files else ''
  return no_gpu_reason() + seen


def mesh_devices(mesh: str) -> int:
  """Devices a 'data,fsdp,tensor' mesh needs at least (-1 takes one or more)."""
  return math.prod(max(1, int(s)) for s in mesh.split(','))


def settings_needing_gpu(config, device_count: int) -> list[str]:
  """The settings of a validated Config that need a GPU, each as `key=value` (and why)."""
  needs = []
  if config.platform == 'gpu':
    needs.append("config.platform='gpu'")
  mesh = config.train.mesh
  if mesh_devices(mesh) > device_count:
    needs.append(f'config.train.mesh={mesh!r} (needs {mesh_devices(mesh)} devices, JAX sees '
                 f'{device_count})')
  remote = config.generation.remote
  if config.generation.placement == 'ray' and remote.weight_transport == 'nccl':
    needs.append("config.generation.remote.weight_transport='nccl'")
  if remote.devices:
    needs.append(f'config.generation.remote.devices={remote.devices!r} (GPU ids)')
  return needs


def check(config) -> None:
  """Raises a one-line ValueError when `config` needs a GPU and JAX's backend has none, unless
  config.allow_cpu. Starts JAX's backends: with several trainer processes, call it after
  jax.distributed is initialized."""
  import jax
  backend = jax.default_backend()
  if backend in ACCELERATOR_BACKENDS or config.allow_cpu:
    return
  needs = settings_needing_gpu(config, jax.device_count())
  if needs:
    raise ValueError(f"{needs[0]} needs a GPU, but JAX's backend is {backend}: "
                     f'{describe_no_gpu()}; --config.allow_cpu=True runs it on the CPU anyway '
                     '(debugging)')
