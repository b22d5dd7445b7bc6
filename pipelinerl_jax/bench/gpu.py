"""GPU proof kit: one command that measures the JAX side of the system on one accelerator.

  python -m pipelinerl_jax.bench.gpu [--out PATH] [--budget_s 510] [--sections env,train,...]
  python -m pipelinerl_jax.bench.gpu --quick      # the same code at toy sizes (`make gpu-check`)

Sections, in this order:
  env      devices and versions (JAX, jaxlib, CUDA, torch), the bf16 peak used for MFU (from the
           device kind, or --peak_tflops), and two measured ceilings: a bf16 matmul and a device
           copy.
  train    the jitted train step at Qwen2.5-0.5B and 1.5B shapes (random weights, bf16 compute,
           fp32 master weights, remat, packed rows): tokens/s, model FLOP/s and MFU. FLOPs are
           bench.train_step's count: 6 N per token plus attention over each sample's own context.
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
  e2e      a short PipelineRL run of the `tiny` preset (TensorBoard off): reward, first steps
           against last steps.

Each section runs in its own process with a share of the time budget (unused time passes on to
the next) and is killed at the end of its share, keeping the items it had finished; a crash, an
out-of-memory or a hang costs that section only, and is recorded in the JSON. Sections skip
sizes whose estimated memory exceeds what the device offers. Prints a table, writes JSON; exits
1 if a section failed. Nothing here asserts timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
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
import traceback
from typing import Any, Callable

# jax and the project are imported inside the sections: the parent only starts processes, so it
# never holds the device, and an import that fails costs one section, not the kit.

SECTIONS = ('env', 'train', 'engine', 'publish', 'e2e')
# Shares of the time budget; a section's share is taken from what is left when it starts.
SECTION_WEIGHTS = dict(env=2.0, train=9.0, engine=6.0, publish=2.0, e2e=5.0)
MIN_SECTION_S = 3.0          # a share shorter than this is not started
KILL_GRACE_S = 10.0          # past its share a section is killed after at most this
# Simulated CPU devices per section (ignored on GPU): the publish section's mesh case needs
# several to put more than one shard in play on CPU.
CPU_DEVICES = dict(env=1, train=1, engine=1, publish=4, e2e=1)
MEMORY_HEADROOM = 0.85       # a size is run only if its estimate fits in this share of memory

# Packages the lent GPU image does not have (see the README's "GPU proof kit"): the kit must not
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


@dataclasses.dataclass(frozen=True)
class Sizes:
  train_models: tuple[str, ...]   # bench.train_step presets
  train_rows: int                 # packed rows per optimizer step
  train_seq_len: int
  train_micro: int                # micro-batches per step
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


FULL = Sizes(train_models=('qwen2.5-0.5b', 'qwen2.5-1.5b'), train_rows=8, train_seq_len=8192,
             train_micro=8, train_steps=3, engine_model='qwen2.5-0.5b',
             engine_slots=(64, 256, 512), prompt_len=256, new_tokens=1024,
             publish_models=('qwen2.5-0.5b', 'qwen2.5-1.5b'), repeats=10, matmul_n=8192,
             copy_mib=1024, e2e_rl_s=90.0, e2e_steps=100_000, budget_s=510.0)
QUICK = Sizes(train_models=('tiny',), train_rows=4, train_seq_len=64, train_micro=2,
              train_steps=2, engine_model='tiny', engine_slots=(2, 4), prompt_len=8,
              new_tokens=8, publish_models=('tiny',), repeats=3, matmul_n=256, copy_mib=4,
              e2e_rl_s=0.0, e2e_steps=3, budget_s=300.0)


# ---------------------------------------------------------------------------------------------
# JAX version differences, here and nowhere else: the kit runs on the pinned JAX (0.10) and on
# the GPU image's (0.11); everything else it uses is the same in both.

# The allocator's memory fraction: XLA_CLIENT_MEM_FRACTION is the newer name; set both.
MEM_FRACTION_VARS = ('XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_CLIENT_MEM_FRACTION')
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


def train_memory_bytes(config, rows_per_micro: int, seq_len: int) -> int:
  """A rough upper estimate of the train step's peak memory: fp32 params, two Adam moments, the
  accumulated and the micro-batch gradients; each layer's saved input (remat); one layer's
  T x T scores and probabilities with their gradients; a few chunks of fp32 logits."""
  state = 5 * 4 * config.num_params
  act = 2 * rows_per_micro * seq_len * config.hidden_size * (config.num_layers + 8)
  attention = rows_per_micro * config.num_heads * seq_len * seq_len * (4 + 4 + 2 + 2)
  logits = 4 * rows_per_micro * min(1024, seq_len) * config.vocab_size * 4
  return state + act + attention + logits


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
  for name in MEM_FRACTION_VARS:  # each section is alone on the device
    env.setdefault(name, '0.90')
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


def run_train(s: Section) -> None:
  import jax
  from pipelinerl_jax import sharding as sharding_lib
  from pipelinerl_jax.bench import train_step as train_bench

  z = s.sizes
  device = jax.devices()[0]
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=[device])
  peak = bf16_peak(device.device_kind, s.args.peak_tflops)
  limit = memory_limit_bytes(device)
  for name in z.train_models:
    config = train_bench.MODEL_PRESETS[name]
    need = train_memory_bytes(config, z.train_rows // z.train_micro, z.train_seq_len)
    if need > MEMORY_HEADROOM * limit:
      s.skip(name, f'needs ~{need / 2**30:.1f} GiB, the device offers {limit / 2**30:.1f}')
      continue
    if s.remaining() < 10:
      s.skip(name, 'time budget')
      continue
    args = train_bench.parse_args([
        f'--model={name}', f'--rows={z.train_rows}', f'--seq_len={z.train_seq_len}',
        f'--micro={z.train_micro}', f'--steps={z.train_steps}', '--warmup=1',
        '--dtype=bfloat16', '--remat'])
    try:
      r = train_bench.bench_model(name, args, mesh)
    except Exception as e:  # e.g. out of memory: the next model may still fit
      s.fail(name, e)
      gc.collect()
      continue
    lm_head = 6.0 * config.vocab_size * config.hidden_size * r['tokens']
    s.add(name, **{k: v for k, v in r.items() if k != 'model_config'},
          mfu=r['flop_per_s'] / (peak['tflops'] * 1e12) if peak['tflops'] else None,
          bf16_peak_tflops=peak['tflops'], bf16_peak_source=peak['source'],
          lm_head_fp32=config.lm_head_fp32, lm_head_flop_share=lm_head / r['flops_per_step'],
          dense_attention_flops=dense_attention_flops(config, z.train_rows, z.train_seq_len),
          memory_estimate_bytes=need, memory=_device_memory(device))
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
  from pipelinerl_jax.pipeline import build as build_lib

  z = s.sizes
  device = jax.devices()[0]
  on_gpu = jax.default_backend() == 'gpu'
  config = dataclasses.replace(train_bench.MODEL_PRESETS[z.engine_model], dtype='bfloat16')
  master = [transformer.init_params(config, jax.random.PRNGKey(i)) for i in (0, 1)]
  publish = build_lib.copy_params_fn(device, config.dtype)  # the trainer's copy to the engine
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

  sync = engine_lib.EngineConfig.sync_every  # the default: on a GPU 4, on a CPU 0
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
  from pipelinerl_jax.pipeline import build as build_lib

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
      publish = build_lib.copy_params_fn(device)
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
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax.pipeline import run as run_lib

  z = s.sizes
  workdir = pathlib.Path(s.args.workdir) / 'e2e'
  c = config_lib.load_preset('tiny')
  c.log.tensorboard = False       # tensorboardX is not on the GPU image
  c.log.progress = not s.args.quick
  c.model.cache_dir = str(pathlib.Path(s.args.workdir) / 'model_cache')
  c.checkpoint.every_steps = 0    # one save, at the end
  if s.args.quick:                # an untrained model, a few small steps
    c.model.demo.max_steps = 0
    c.model.demo.eval_problems = 8
    c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  t0 = time.perf_counter()
  model_dir = warmstart.model_dir_for(config_lib.validate(c))  # builds the warm-started demo model once
  warmstart_s = time.perf_counter() - t0
  c.rl.total_steps = z.e2e_steps
  # What is left after teardown, the final checkpoint and the plot (~20 s on a slow host).
  c.rl.max_time_s = (min(z.e2e_rl_s, max(10.0, s.remaining() - 30.0)) if z.e2e_rl_s else 0.0)
  rl_dir = workdir / f'run-{int(time.time())}'
  error = None
  t0 = time.perf_counter()
  try:
    summary = run_lib.run(c, str(rl_dir), model_dir=model_dir)
    records = summary['records']
  except Exception as e:  # keep the steps that were logged
    error = _one_line(e)
    metrics = rl_dir / 'metrics.jsonl'
    records = ([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
               if metrics.exists() else [])
  rl_s = time.perf_counter() - t0
  median = lambda key: (statistics.median(r[key] for r in records)
                        if records and key in records[0] else None)
  fields = dict(preset='tiny', warmstart_s=warmstart_s, rl_s=rl_s, max_time_s=c.rl.max_time_s,
                batch_size=c.rl.batch_size, group_size=c.rl.group_size,
                num_slots=c.generation.num_slots, **reward_summary(records),
                gen_tokens_per_s_median=median('gen_tokens_per_s'),
                train_step_s_median=median('train_step_s'),
                lag_max=max((r['lag_max'] for r in records), default=None), workdir=str(rl_dir))
  if error:
    s.record['items'].append(dict(name='tiny preset', status='error', error=error, **fields))
    s.save()
  else:
    s.add('tiny preset', **fields)


SECTION_FNS: dict[str, Callable[[Section], None]] = dict(
    env=run_env, train=run_train, engine=run_engine, publish=run_publish, e2e=run_e2e)


def section_main(args: argparse.Namespace) -> None:
  """Runs one section in this process and writes its record to args.section_out."""
  s = Section(args.section, args.section_out, args.deadline, QUICK if args.quick else FULL, args)
  compile_count()  # start counting before anything compiles
  t0 = time.perf_counter()
  try:
    SECTION_FNS[args.section](s)
    failed = [i['name'] for i in s.record['items'] if i['status'] == 'error']
    s.record['status'] = 'partial' if failed else 'ok'
  except Exception as e:
    s.record.update(status='error', error=_one_line(e), traceback=traceback.format_exc()[-4000:])
  s.record['seconds'] = time.perf_counter() - t0
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
         f'--peak_tflops={args.peak_tflops}'] + (['--quick'] if args.quick else [])
  t0 = time.perf_counter()
  # Its own process group, so a kill takes anything it started; its output goes to our
  # stderr, leaving stdout to the table.
  proc = subprocess.Popen(cmd, env=child_env(name, dict(os.environ)), stdout=sys.stderr,
                          stderr=sys.stderr, start_new_session=True)
  killed = False
  try:
    proc.wait(timeout=kill_after(share_s))
  except subprocess.TimeoutExpired:
    killed = True
  finally:
    if proc.poll() is None:  # timed out, or we are being interrupted
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
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
  record.update(share_s=share_s, wall_s=time.perf_counter() - t0, exit_code=proc.returncode)
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
  if section == 'train':
    mfu = f"MFU {g('mfu'):.1%}" if g('mfu') is not None else 'MFU -'
    if g('of_measured_matmul') is not None:
      mfu += f" ({g('of_measured_matmul'):.1%} of the measured matmul)"
    return (f"{g('rows')}x{g('seq_len')} bf16 remat: {g('tokens')} tok/step, "
            f"{g('step_s_median'):.3f} s/step, {g('tokens_per_s'):.0f} tok/s, "
            f"{_fmt_si(g('flop_per_s'), 'FLOP/s')}, {mfu}, compile {g('compile_s'):.0f} s")
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
  if section == 'e2e':
    if g('reward_first') is None:
      return f"no step logged; {g('error', '')}"
    text = (f"{g('steps')} steps in {g('rl_s'):.0f} s (+{g('warmstart_s'):.0f} s warm start): "
            f"reward {g('reward_first'):.3f} -> {g('reward_last'):.3f} "
            f"(means of first/last {g('reward_window')})")
    return text + (f"; {g('error')}" if g('error') else '')
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
  p.add_argument('--quick', action='store_true',
                 help='toy sizes, the same code (CPU, about a minute; `make gpu-check`)')
  p.add_argument('--out', default='/tmp/pipelinerl_jax_bench/gpu.json', help='JSON output path')
  p.add_argument('--sections', default=','.join(SECTIONS),
                 help=f'comma-separated, run in this order: {",".join(SECTIONS)}')
  p.add_argument('--budget_s', type=float, default=0.0,
                 help=f'total seconds for all sections (default {FULL.budget_s:.0f}, '
                      f'--quick {QUICK.budget_s:.0f})')
  p.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/gpu',
                 help="the end-to-end run's directory and its demo-model cache")
  p.add_argument('--peak_tflops', type=float, default=0.0,
                 help='bf16 peak for MFU, TFLOP/s (default: from the device kind)')
  # Internal: run one section in this process.
  p.add_argument('--section', choices=SECTIONS, help=argparse.SUPPRESS)
  p.add_argument('--section_out', help=argparse.SUPPRESS)
  p.add_argument('--deadline', type=float, default=0.0, help=argparse.SUPPRESS)
  return p


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.section:
    section_main(args)
    return 0
  sections = [s.strip() for s in args.sections.split(',') if s.strip()]
  unknown = [s for s in sections if s not in SECTIONS]
  if not sections or unknown or len(set(sections)) != len(sections):
    parser.error(f'--sections: give distinct names from {",".join(SECTIONS)} (got '
                 f'{args.sections!r})')
  if args.budget_s < 0 or args.peak_tflops < 0:
    parser.error('--budget_s and --peak_tflops must be >= 0')
  sizes = QUICK if args.quick else FULL
  budget = args.budget_s or sizes.budget_s
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmpdir = out.parent / f'.{out.stem}-sections-{os.getpid()}'
  tmpdir.mkdir(parents=True, exist_ok=True)

  start = time.monotonic()
  report: dict[str, Any] = dict(
      kit='pipelinerl_jax.bench.gpu', quick=args.quick, budget_s=budget, sections_run=sections,
      sizes=dataclasses.asdict(sizes),
      started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      sections={})
  try:
    for i, name in enumerate(sections):
      share = share_of_budget(budget - (time.monotonic() - start), sections[i:])
      if share < MIN_SECTION_S:
        report['sections'][name] = dict(section=name, status='skipped', items=[],
                                        reason=f'time budget ({share:.1f} s left for it)')
        continue
      print(f'[gpu] {name}: up to {share:.0f} s', file=sys.stderr, flush=True)
      report['sections'][name] = run_section(name, args, share, tmpdir)
  finally:
    add_measured_ceiling(report)
    report['wall_s'] = time.monotonic() - start
    out.write_text(json.dumps(report, indent=1, default=_json_default))
    for f in tmpdir.glob('*'):
      f.unlink()
    tmpdir.rmdir()
  print(format_table(report), flush=True)
  print(f'wrote {out}', flush=True)
  failed = [n for n, s in report['sections'].items() if s['status'] not in ('ok', 'skipped')]
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
