"""Which regime a preset runs in on this machine: how many policy versions write one sample,
how far behind its tokens are, and whether it learns, on an idle host and on a busy one.

  python -m pipelinerl_jax.bench.regime [--preset reasoning] [--busy 0] [--seeds 0]
      [--budget_s 900] [--steps 0] [--set SECTION.FIELD=VALUE ...] [--out PATH.json] [--smoke]

PipelineRL's in-flight updates matter when a sample is decoded across several optimizer steps.
Whether it is depends on how long one sample takes to decode against how often the trainer
publishes, and both depend on the machine's speed and on what else runs on it. `--busy N` starts
N processes that spin on a core each for the length of every run (and are killed with it, even
if this process is killed), so that "a loaded host" is a condition anyone can repeat; with
`--busy 0` the host should be otherwise idle, and the load average before and after each run is
reported either way.

Reported per run: steps and samples, the mean over steps of the policy versions per sample and of
the share of samples written by two or more versions (`frac_multi_version`), the token lag of a
sample's first and last token, ESS (mean and lowest step), samples dropped as too stale, the
mean train step, and the reward's trend (bench/reward_trend.py). A table, and a JSON file with
every run's raw per-step values, so that every figure can be recomputed from it. Nothing here
asserts a figure; `--smoke` (an untrained model, a few short steps) only runs the code paths.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import learning_speed
from pipelinerl_jax.bench import reward_trend

# Per step, what the JSON keeps of each run (the trend's own raw values and the regime's).
RAW_KEYS = (*reward_trend.RAW_KEYS, 'versions_per_sample_mean', 'frac_multi_version', 'ess',
            'lag_first_token_mean', 'lag_last_token_mean', 'train_step_s')
REGIME_COLUMNS = (('run', 'name', 's'), ('seed', 'seed', 'd'), ('busy', 'busy', 'd'),
                  ('steps', 'steps', 'd'), ('samples', 'samples', ',d'),
                  ('versions', 'versions_mean', '.2f'), ('multi_version', 'frac_multi_version', '.2f'),
                  ('lag_first', 'lag_first_token', '.2f'), ('lag_last', 'lag_last_token', '.2f'),
                  ('ess', 'ess_mean', '.3f'), ('ess_min', 'ess_min', '.3f'),
                  ('stale', 'stale_dropped', 'd'), ('train_step_s', 'train_step_s', '.3f'),
                  ('load', 'load', '.1f'))
LEARNING_COLUMNS = ((('run', 'name', 's'), ('seed', 'seed', 'd'),
                     ('reward_first', 'reward_first', '.3f'), ('last10', 'reward_final', '.3f'))
                    + reward_trend.COLUMNS)
# A spinner asks the kernel to kill it when its parent dies (prctl PR_SET_PDEATHSIG), then
# checks that the parent it was started by is still there: no spinner outlives the bench, even
# one killed with -9. (Set in the child itself: a preexec_fn would fork the threaded JAX process.)
SPINNER = ('import ctypes, os, signal, sys\n'
           'ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n'
           'if os.getppid() != int(sys.argv[1]): sys.exit()\n'
           'while True: pass\n')


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
  """n processes spinning on a core each while the block runs; yields their pids."""
  procs = [subprocess.Popen([sys.executable, '-c', SPINNER, str(os.getpid())])
           for _ in range(n)]
  try:
    yield [p.pid for p in procs]
  finally:
    for p in procs:
      p.kill()
    for p in procs:
      p.wait()


def _mean(records: Sequence[dict], key: str) -> float:
  values = [r[key] for r in records if key in r]
  return float(np.mean(values)) if values else float('nan')


def run_row(name: str, seed: int, busy: int, result: dict[str, Any]) -> dict[str, Any]:
  """One run's row: the regime's means over its steps, `ablations.summarize`, the trend."""
  records = result['records']
  summary = ablations.summarize(result, [])
  return dict(summary, **reward_trend.of_records(records), name=name, seed=seed, busy=busy,
              versions_mean=_mean(records, 'versions_per_sample_mean'),
              frac_multi_version=_mean(records, 'frac_multi_version'),
              lag_first_token=_mean(records, 'lag_first_token_mean'),
              lag_last_token=_mean(records, 'lag_last_token_mean'),
              ess_mean=summary['ess']['mean'], ess_min=summary['ess']['min'],
              load=(summary['load_before'] + summary['load_after']) / 2)


def raw(records: Sequence[dict[str, Any]]) -> dict[str, list]:
  return {key: [r.get(key) for r in records] for key in RAW_KEYS}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--preset', default='reasoning', help='configs/math.py preset to run')
  parser.add_argument('--busy', type=int, default=0,
                      help='processes spinning on a core each during every run (a loaded host)')
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--name', default='', help="the runs' name in the table ('' = idle/busyN)")
  parser.add_argument('--set', action='append', default=[], metavar='SECTION.FIELD=VALUE',
                      help='a config override (repeatable), e.g. rl.batch_size=32')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/regime.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  ablations.add_budget_flags(parser, default_steps=0)
  parser.set_defaults(budget_s=900.0)
  args = parser.parse_args(argv)
  if args.busy < 0:
    parser.error(f'--busy {args.busy}: expected >= 0')
  try:
    seeds = learning_speed.parse_seeds(args.seeds)
    sets = learning_speed.parse_sets(args.set)
  except ValueError as e:
    parser.error(str(e))
  config = ablations.preset(args.preset)
  config.log.tensorboard = False
  config = ablations.budgeted(parser, args, config)
  try:
    config = ablations.override(config, **sets)
  except (KeyError, TypeError) as e:
    parser.error(f'--set: {e.args[0] if e.args else e}')
  name = args.name or (f'busy{args.busy}' if args.busy else 'idle')
  model_dir = ablations.model_dir_for(config)
  workdir = args.workdir or tempfile.mkdtemp(prefix='regime_')
  print(f'device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; preset {args.preset} '
        f'(B={config.rl.batch_size}, H={config.generation.num_slots}, '
        f'max_lag={config.rl.max_lag}, lr={config.optimizer.lr:g}); '
        f'{ablations.budget_text(args)} per run; {args.busy} busy process(es); seeds {seeds}; '
        f'runs in {workdir}; load {os.getloadavg()[0]:.1f}', flush=True)
  rows, raws, spinners = [], {}, []
  for seed in seeds:
    print(f'--- {name} seed {seed}', flush=True)
    with busy_cores(args.busy) as pids:
      spinners += pids
      result = ablations.run_once(ablations.override(config, seed=seed),
                                  os.path.join(workdir, name, f'seed{seed}'), model_dir, name=name)
    rows.append(run_row(name, seed, args.busy, result))
    raws[f'{name}/seed{seed}'] = raw(result['records'])
  print(ablations.table(rows, REGIME_COLUMNS))
  print(ablations.table(rows, LEARNING_COLUMNS))
  report = dict(host=platform.node(), cpus=os.cpu_count(), jax=jax.__version__, args=vars(args),
                preset=args.preset, model_dir=model_dir, seeds=seeds,
                settings=dict(batch_size=config.rl.batch_size, group_size=config.rl.group_size,
                              num_slots=config.generation.num_slots, max_lag=config.rl.max_lag,
                              lr=config.optimizer.lr),
                busy_pids=spinners, runs=rows, raw=raws)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float) + '\n')
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
