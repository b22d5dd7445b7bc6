"""GPU proof kit: one command that measures the JAX side of the system on one accelerator.

  python -m pipelinerl_jax.bench.gpu [--out PATH] [--budget_s 510] [--sections env,train,...]
  python -m pipelinerl_jax.bench.gpu --preset=short   # ~3 minutes: checks a fix on the GPU
  python -m pipelinerl_jax.bench.gpu --quick      # the same code at toy sizes (`make gpu-check`)
  python -m pipelinerl_jax.bench.gpu --prepare_models=DIR   # here, on CPU: the e2e warm starts

Every section first checks that JAX's backend is the one asked for (`--platform`, default gpu
where the OS shows an NVIDIA device): a run meant for the GPU that JAX put on the CPU stops at
once, in one line carrying JAX's own reason, and exits 1. JAX's warnings and the end of each
section's output go into its JSON, with the card (device kind, datasheet figures) and the
software (Python, JAX, jaxlib, CUDA, torch, ...) its figures were measured with; the report
carries them at its top and the table in its last line.

This module is the kit's runner. Each section (registry.py) runs in its own process with a
share of the time budget (unused time passes on to the next) and is killed at the end of its
share, keeping the items it had finished; a crash, an out-of-memory or a hang costs that section
only, and is recorded in the JSON. Sections skip sizes whose estimated memory exceeds what the
device offers. Prints a table, writes JSON; exits 1 if a section failed. Nothing here asserts
timing.

JAX and the project are imported inside the sections' processes: the parent only starts them,
so it never holds the device, and an import that fails costs one section, not the kit.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from pipelinerl_jax import platforms  # imports no JAX
from pipelinerl_jax.bench.gpu import e2e
from pipelinerl_jax.bench.gpu import env
from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import registry
from pipelinerl_jax.bench.gpu import section as section_lib
from pipelinerl_jax.bench.gpu import time_budget
from pipelinerl_jax.bench.gpu import train

OUTPUT_TAIL_LINES = 40       # of each section's output, kept in its JSON


# The allocator's memory fraction. jaxlib 0.10 and 0.11 read XLA_CLIENT_MEM_FRACTION, and the
# deprecated XLA_PYTHON_CLIENT_MEM_FRACTION only alone: given both, the CUDA backend refuses to
# start and JAX falls back to the CPU (the first GPU run, 2026-11-26). The kit sets one.
MEM_FRACTION_VAR = 'XLA_CLIENT_MEM_FRACTION'
DEPRECATED_MEM_FRACTION_VAR = 'XLA_PYTHON_CLIENT_MEM_FRACTION'


def child_env(section: str, base: dict[str, str]) -> dict[str, str]:
  """The environment of a section's process."""
  env = dict(base)
  # Torch and JAX share the GPU in the publish section; each section is alone on the device.
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  if MEM_FRACTION_VAR not in env and DEPRECATED_MEM_FRACTION_VAR not in env:
    env[MEM_FRACTION_VAR] = registry.SECTIONS[section].mem_fraction
  env.setdefault('TOKENIZERS_PARALLELISM', 'false')
  env['PYTHONUNBUFFERED'] = '1'
  flags = re.sub(r'--xla_force_host_platform_device_count=\S+', '', env.get('XLA_FLAGS', ''))
  env['XLA_FLAGS'] = (f'{flags} --xla_force_host_platform_device_count='
                      f'{registry.SECTIONS[section].cpu_devices}').strip()
  root = str(pathlib.Path(__file__).resolve().parents[3])  # so `-m` finds the package anywhere
  env['PYTHONPATH'] = os.pathsep.join(p for p in (root, env.get('PYTHONPATH', '')) if p)
  return env


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
    return f'--platform={platform}: JAX cannot start: {section_lib.one_line(e)}'

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
  s = section_lib.Section(args.section, args.section_out, args.deadline,
                          presets.PRESETS[args.preset], args)
  t0 = time.perf_counter()
  problem = backend_problem(args.platform)
  if problem:  # nothing measured on the wrong device is worth its time
    s.record.update(status='error', error=problem, platform_error=True)
  else:
    section_lib.compile_count()  # start counting before anything compiles
    # What its figures were measured on and with, saved before the first item.
    s.record.update(device=env.device_facts(), stack=env.stack())
    s.save()
    try:
      registry.SECTIONS[args.section].run(s)
      failed = [i['name'] for i in s.record['items'] if i['status'] == 'error']
      s.record['status'] = 'partial' if failed else 'ok'
    except Exception as e:
      s.record.update(status='error', error=section_lib.one_line(e),
                      traceback=traceback.format_exc()[-4000:])
  s.record['seconds'] = time.perf_counter() - t0
  s.record['jax_warnings'] = warnings_kept.messages
  loaded = {m.split('.')[0] for m in sys.modules}
  s.record['imported_absent_on_image'] = sorted(
      set(section_lib.IMAGE_ABSENT) - set(section_lib.CARRIED) & loaded)
  s.record['imported_carried'] = sorted(set(section_lib.CARRIED) & loaded)
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
    proc.wait(timeout=time_budget.kill_after(share_s))
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
    record.update(status='timeout', error=f'killed {time_budget.kill_after(share_s):.0f} s into '
                                          f'its {share_s:.0f} s share (grace included)')
  elif proc.returncode != 0 or record.get('status') in (None, 'running'):
    record.update(status='error', error=record.get('error') or
                  f'section process exited with {proc.returncode} before finishing')
  record.update(share_s=share_s, wall_s=time.perf_counter() - t0, exit_code=proc.returncode,
                output_tail=list(tail))
  return record


def describe(section: str, item: dict[str, Any]) -> str:
  """One table cell: why an item was skipped or failed, else its section's own description of
  its main figures (an e2e run that failed still shows the steps it logged)."""
  if item['status'] == 'skipped':
    return item.get('reason', '')
  if item['status'] == 'error' and 'reward_first' not in item:
    return item.get('error', '')
  return registry.SECTIONS[section].describe(item)


def add_measured_on(report: dict[str, Any]) -> None:
  """The card and the software every figure was measured with, at the report's top: those of
  the first section that started (each section's process records its own; all ran on one
  machine, and one whose JAX was not on the platform asked for stopped the run)."""
  first = next((sec for sec in report['sections'].values() if 'device' in sec), {})
  report.update(card=first.get('device'), stack=first.get('stack'))


def describe_measured_on(report: dict[str, Any]) -> str:
  """The table's last line: the card and the software of every figure in it."""
  card, stack = report.get('card'), report.get('stack')
  if not card:
    return 'measured on: nothing (no section started)'
  return (f"measured on {card['num_devices']}x {card['device_kind']} (card: "
          f"{card['card'] or 'not listed'}), jax {stack['jax']} / jaxlib {stack['jaxlib']} "
          f"({stack['platform_version']}), torch {stack['packages'].get('torch') or 'absent'}, "
          f"python {stack['python']}")


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
  lines.append(describe_measured_on(report))
  return '\n'.join(line.rstrip() for line in lines)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.gpu',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--preset', choices=sorted(presets.PRESETS), default='full',
                 help='sizes and default sections: full (~8.5 min), short (~3 min: one train '
                      'size, the engine at H = 256, publish), quick (toy sizes, CPU)')
  p.add_argument('--quick', action='store_true', help='--preset=quick (`make gpu-check`)')
  p.add_argument('--platform', choices=('gpu', 'cpu'), default=None,
                 help="the backend every section must run on (default: gpu where the OS shows "
                      "an NVIDIA device, else cpu)")
  p.add_argument('--out', default='/tmp/pipelinerl_jax_bench/gpu.json', help='JSON output path')
  p.add_argument('--sections', default='',
                 help=f'comma-separated, run in this order: '
                      f'{",".join(registry.DEFAULT_SECTIONS)} (default: the preset\'s); also '
                      f"{','.join(registry.OPTIONAL_SECTIONS)} (on a GPU they need vLLM: "
                      'tools/gpu_stage.py)')
  p.add_argument('--budget_s', type=float, default=0.0,
                 help='total seconds for all sections (default: the preset\'s, '
                      + ', '.join(f'{k} {v.budget_s:.0f}' for k, v in presets.PRESETS.items())
                      + ')')
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
  p.add_argument('--section', choices=tuple(registry.SECTIONS), help=argparse.SUPPRESS)
  p.add_argument('--section_out', help=argparse.SUPPRESS)
  p.add_argument('--deadline', type=float, default=0.0, help=argparse.SUPPRESS)
  return p


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
  sizes = presets.PRESETS[args.preset]
  sizes = dataclasses.replace(sizes, sections=sizes.sections or registry.DEFAULT_SECTIONS)
  if args.prepare_models:
    for path in e2e.prepare_models(args.prepare_models, presets.FULL.e2e_presets):
      print(path)
    return 0
  sections = ([s.strip() for s in args.sections.split(',') if s.strip()] if args.sections
              else list(sizes.sections))
  unknown = [s for s in sections if s not in registry.SECTIONS]
  if not sections or unknown or len(set(sections)) != len(sections):
    parser.error(f'--sections: give distinct names from '
                 f'{",".join(registry.SECTIONS)} (got {args.sections!r})')
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
      share = time_budget.share_of_budget(
          budget - (time.monotonic() - start), [registry.SECTIONS[n].weight for n in sections[i:]])
      if wrong_platform or share < time_budget.MIN_SECTION_S:
        reason = (f'not started: {wrong_platform}' if wrong_platform
                  else f'time budget ({share:.1f} s left for it)')
        report['sections'][name] = dict(section=name, status='skipped', items=[], reason=reason)
        continue
      print(f'[gpu] {name}: up to {share:.0f} s', file=sys.stderr, flush=True)
      report['sections'][name] = run_section(name, args, share, tmpdir)
      if report['sections'][name].get('platform_error'):
        wrong_platform = report['sections'][name]['error']
  finally:
    train.add_measured_ceiling(report)
    add_measured_on(report)
    report['wall_s'] = time.monotonic() - start
    out.write_text(json.dumps(report, indent=1, default=section_lib.json_default))
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

