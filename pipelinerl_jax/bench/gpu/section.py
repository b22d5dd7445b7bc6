"""What every section's code uses inside its own process: its record (`Section`, saved after
each item, so a kill keeps what was done), the timing and memory helpers, the requests the
engine and vLLM sections decode, and the table's number format.

Nothing here imports JAX at module level: the kit's parent process imports this module too, and
never holds the device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time
import traceback
from typing import Any, Callable

from pipelinerl_jax import accelerators
from pipelinerl_jax.pipeline import metrics as metrics_lib

MEMORY_HEADROOM = 0.85       # a size is run only if its estimate fits in this share of memory

# Packages a bare GPU image (JAX, torch, transformers) does not have (see docs/gpu-kit.md): the kit must not
# import them; CARRIED travel as wheels (tools/gpu_wheels.sh).
IMAGE_ABSENT = ('vllm', 'math_verify', 'tensorboardX', 'datasets', 'ml_collections')
CARRIED = ('ml_collections',)

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


def bf16_peak(device_kind: str, override_tflops: float = 0.0) -> dict[str, Any]:
  """{'tflops': peak or None, 'source': where it came from} for a jax device_kind."""
  if override_tflops > 0:
    return dict(tflops=override_tflops, source='--peak_tflops')
  card = accelerators.card_of(device_kind)
  if card is None:
    return dict(tflops=None, source=f'no known bf16 peak for {device_kind!r} (MFU not computed)')
  return dict(tflops=card.bf16_tflops, source=f'{card.source}, dense bf16')


class Section:
  """A section's record, rewritten to its JSON file after every item, so a kill keeps what
  was done. `sizes` is the preset's (presets.Sizes)."""

  def __init__(self, name: str, path: str, deadline: float, sizes, args: argparse.Namespace):
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
    self.record['items'].append(dict(name=name, status='error', error=one_line(error),
                                     traceback=traceback.format_exc()[-4000:]))
    self.save()
    print(f'[gpu:{self.name}] {name}: error {one_line(error)}', flush=True)

  def save(self) -> None:
    tmp = f'{self.path}.tmp'
    with open(tmp, 'w') as f:
      json.dump(self.record, f, indent=1, default=json_default)
    os.replace(tmp, self.path)


def json_default(x):
  if hasattr(x, 'item'):  # numpy / jax scalars
    return x.item()
  return str(x)


def one_line(e: BaseException) -> str:
  text = f'{type(e).__name__}: {e}'.strip().splitlines()
  return text[0][:500] if text else type(e).__name__


def _brief(item: dict) -> str:
  return ', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                   for k, v in item.items() if k in ('tokens_per_s', 'mfu', 'step_s_median',
                                                     'publish_over_copy', 'pointers_equal',
                                                     'reward_first', 'reward_last', 'tflops',
                                                     'gb_per_s'))


def run_records(run: Callable[[], dict[str, Any]], workdir: pathlib.Path
                ) -> tuple[list[dict[str, Any]], str | None, float]:
  """Runs `run()` (a launch.run_experiment writing to `workdir`): its per-step records, its error
  in one line (None if it ended), and its seconds; a run that failed keeps the steps it logged."""
  t0 = time.perf_counter()
  try:
    records, error = run()['records'], None
  except Exception as e:  # keep the steps that were logged
    error = one_line(e)
    metrics = workdir / metrics_lib.METRICS_FILE
    records = metrics_lib.read_metrics(str(metrics)) if metrics.exists() else []
  return records, error, time.perf_counter() - t0


def bench_report(s: Section, name: str, cmd: list[str], out: pathlib.Path
                 ) -> dict[str, Any] | None:
  """The JSON report the bench process `cmd` (python -m pipelinerl_jax.bench.<module> ...)
  writes to `out`, run within the section's time; None once item `name` is recorded skipped (cut
  short by the time budget) or failed (the exit status and the last line of its stderr)."""
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=s.remaining())
  except subprocess.TimeoutExpired:
    s.skip(name, 'time budget (cut short)')
    return None
  if proc.returncode or not out.exists():
    tail = (proc.stderr.strip().splitlines() or [''])[-1]
    module = '.'.join(cmd[2].split('.')[-2:])
    s.fail(name, RuntimeError(f'{module} exited {proc.returncode}: {tail}'))
    return None
  return json.loads(out.read_text())


def median_of(records: list[dict[str, Any]], key: str) -> float | None:
  """The median of `key` over a run's records (None when they lack it)."""
  return (statistics.median(r[key] for r in records)
          if records and key in records[0] else None)


def device_memory(device) -> dict[str, Any]:
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


def make_requests(num: int, prompt_len: int, max_tokens: int, vocab: int, seed: int):
  """`num` requests of `prompt_len` random tokens, each sampled to `max_tokens` at temperature 1
  with its own seed."""
  import numpy as np
  from pipelinerl_jax.generation import api
  rng = np.random.default_rng(seed)
  return [api.Request(f'{seed}-{i}', [int(t) for t in rng.integers(0, vocab, prompt_len)],
                      api.SamplingParams(temperature=1.0, max_tokens=max_tokens),
                      seed=seed * 100003 + i) for i in range(num)]


def fmt_si(x: float | None, unit: str = '') -> str:
  if x is None:
    return '-'
  for scale, prefix in ((1e15, 'P'), (1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
    if abs(x) >= scale:
      return f'{x / scale:.3g}{prefix}{unit}'
  return f'{x:.3g}{unit}'
