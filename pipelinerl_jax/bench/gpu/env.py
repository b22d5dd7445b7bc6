"""The env section: devices and versions (JAX, jaxlib, CUDA, torch), the bf16 peak used for MFU
(from the device kind, or --peak_tflops), and two measured ceilings: a bf16 matmul and a device
copy. Also what every section records beside its figures: the card (`device_facts`) and the
software (`stack`)."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import statistics
from typing import Any

from pipelinerl_jax import accelerators
from pipelinerl_jax.bench.gpu import section as section_lib

STACK_PACKAGES = ('flax', 'optax', 'orbax-checkpoint', 'numpy', 'transformers', 'ml-collections',
                  'torch')


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def stack() -> dict[str, Any]:
  """The software a figure was measured with: Python, JAX and jaxlib, JAX's backend and its
  platform version (on a GPU the CUDA version, 'cuda 13000'), and the packages the kit uses, as
  installed (torch's too, without importing it)."""
  import jax
  import jax.extend
  return dict(python=platform.python_version(), jax=jax.__version__,
              jaxlib=package_version('jaxlib'), backend=jax.default_backend(),
              platform_version=jax.extend.backend.get_backend().platform_version,
              packages={p: package_version(p) for p in STACK_PACKAGES})


def device_facts() -> dict[str, Any]:
  """The card a figure was measured on: JAX's device kind, the card it is and its datasheet
  figures (accelerators.py), and how many devices JAX sees."""
  import jax
  devices = jax.devices()
  return dict(accelerators.describe(devices[0].device_kind), platform=devices[0].platform,
              num_devices=len(devices))


def run(s: section_lib.Section) -> None:
  import jax
  import jax.numpy as jnp

  devices = jax.devices()
  device = devices[0]
  peak = section_lib.bf16_peak(device.device_kind, s.args.peak_tflops)
  torch_info: dict[str, Any]
  try:
    import torch
    torch_info = dict(version=torch.__version__, cuda=torch.version.cuda,
                      cuda_available=torch.cuda.is_available(),
                      device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
  except Exception as e:  # the kit runs without torch; only DLPack needs it
    torch_info = dict(error=section_lib.one_line(e))
  s.add('versions', **stack(), device_kind=device.device_kind, num_devices=len(devices),
        devices=[dict(id=d.id, platform=d.platform, kind=d.device_kind) for d in devices],
        memory=section_lib.device_memory(device), torch=torch_info,
        bf16_peak_tflops=peak['tflops'], bf16_peak_source=peak['source'], host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
        environment_info=jax.print_environment_info(return_string=True))

  n = s.sizes.matmul_n
  keys = jax.random.split(jax.random.PRNGKey(0), 2)  # random data: zeros run faster than real
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
  matmul = jax.jit(lambda x, y: x @ y)
  times = section_lib.wall_times(lambda: matmul(a, b), s.sizes.repeats)
  t = statistics.median(times)
  s.add('bf16_matmul', n=n, seconds=t, tflops=2 * n**3 / t / 1e12, seconds_runs=times)
  del a, b

  nbytes = s.sizes.copy_mib << 20
  x = jax.random.normal(keys[0], (nbytes // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)
  times = section_lib.wall_times(lambda: copy(x), s.sizes.repeats)
  t = statistics.median(times)
  # Bytes read plus bytes written, as copy bandwidths are usually quoted.
  s.add('device_copy', bytes=nbytes, seconds=t, gb_per_s=2 * nbytes / t / 1e9,
        seconds_runs=times)


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  if item['name'] == 'versions':
    torch = g('torch') or {}
    return (f"{g('num_devices')}x {g('device_kind')}; jax {g('jax')} ({g('platform_version')}), "
            f"torch {torch.get('version', 'absent')}; bf16 peak "
            f"{g('bf16_peak_tflops') or '-'} TFLOP/s ({g('bf16_peak_source')})")
  if 'tflops' in item:
    return f"{g('n')}^3 bf16: {g('tflops'):.1f} TFLOP/s"
  return f"{section_lib.fmt_si(g('bytes'), 'B')}: {g('gb_per_s'):.1f} GB/s (read + write)"
