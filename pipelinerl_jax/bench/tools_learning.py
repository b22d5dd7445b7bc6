"""Does the tools preset learn? RL on the calculator task (configs/math.py:tools) over N seeds.

  python -m pipelinerl_jax.bench.tools_learning [--seeds 0,1,2] [--budget_s 180]
      [--eval_problems 128] [--out PATH.json] [--workdir DIR] [--cache_dir DIR] [--smoke]

One warm-started model (built once into the cache; the seed varies the RL run, not the warm
start), then per seed one PipelineRL run of `--budget_s` seconds. Reported per seed, as a table
and a JSON file:
  reward        the batch's mean episode return, mean of the first and of the last 10 steps
  tool share    the share of the batch's episodes that called the tool (first / last 10 steps)
  rise, noise   reward end - start, and twice the standard error of that difference (the
                10-step means' spread over their steps): "well above noise" is rise > noise
  pass@1        greedy pass@1 with tools on `--eval_problems` held-out problems, episodes run by
                `evaluate` (the CLI's path) on the warm-started model and on the run's final
                checkpoint, with the share of those episodes that went past one turn (a call)
Nothing here asserts a figure; `--smoke` (an untrained model, 3 steps) only runs the code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile

import jax
import numpy as np

from pipelinerl_jax import evaluate as evaluate_lib
from pipelinerl_jax.bench import ablations
from pipelinerl_jax.demo import warmstart

WINDOW = 10  # steps averaged at the start and at the end of a run
TOOL_KEY = 'episode/frac_tool_call'


def window_stats(values: list[float]) -> tuple[float, float, float, float]:
  """(start mean, end mean, start standard error, end standard error) over the first and last
  WINDOW values (fewer when the run is shorter)."""
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return (float('nan'),) * 4
  first, last = v[:WINDOW], v[-WINDOW:]
  se = lambda x: float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float('nan')
  return float(first.mean()), float(last.mean()), se(first), se(last)


def run_summary(records: list[dict]) -> dict:
  """The per-seed numbers of a run's step records."""
  r0, r1, se0, se1 = window_stats([r['reward_mean'] for r in records])
  t0, t1, _, _ = window_stats([r.get(TOOL_KEY, float('nan')) for r in records])
  return dict(steps=len(records), samples=records[-1]['samples'] if records else 0,
              time_s=records[-1]['time_s'] if records else 0.0,
              reward_start=r0, reward_end=r1, rise=r1 - r0,
              noise=2 * float(np.hypot(se0, se1)), tool_share_start=t0, tool_share_end=t1)


def greedy_pass1(config, checkpoint: str, out_dir: str) -> dict:
  """Greedy pass@1 with tools through `evaluate` (episodes), and the share of its episodes that
  went past one turn."""
  result = evaluate_lib.evaluate_checkpoint(config, checkpoint, k=1, n=1, out_dir=out_dir)
  turns = [s.get('turns', 1) for s in result['samples']]
  return dict(pass1=result['pass@1'], multi_turn=float(np.mean([t > 1 for t in turns])),
              num_problems=result['num_problems'])


COLUMNS = (('seed', 'seed', 'd'), ('steps', 'steps', 'd'), ('samples', 'samples', ',d'),
           ('run_s', 'time_s', '.0f'), ('reward_start', 'reward_start', '.3f'),
           ('reward_end', 'reward_end', '.3f'), ('rise', 'rise', '+.3f'),
           ('noise', 'noise', '.3f'), ('tool_start', 'tool_share_start', '.2f'),
           ('tool_end', 'tool_share_end', '.2f'), ('pass@1_start', 'pass1_start', '.3f'),
           ('pass@1_end', 'pass1_end', '.3f'), ('calls_start', 'eval_calls_start', '.2f'),
           ('calls_end', 'eval_calls_end', '.2f'))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated RL seeds')
  parser.add_argument('--budget_s', type=float, default=180.0, help='wall-clock cap per run')
  parser.add_argument('--eval_problems', type=int, default=128,
                      help='held-out problems for greedy pass@1')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/tools_learning.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  parser.add_argument('--cache_dir', default='', help="demo model cache ('' = the default)")
  parser.add_argument('--smoke', action='store_true',
                      help='untrained model, 3 steps of 16 episodes per seed (tests)')
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(',') if s.strip()]
  if not seeds or len(set(seeds)) != len(seeds):
    parser.error(f'--seeds {args.seeds!r}: expected distinct integers like 0,1,2')
  if args.eval_problems < 1:
    parser.error(f'--eval_problems must be >= 1, got {args.eval_problems}')

  base = ablations.preset('tools')
  base.log.tensorboard = False
  base.log.progress = False
  base.checkpoint.every_steps = 0   # saved at exit only: the end of the run is what we evaluate
  base.eval.num_problems = args.eval_problems
  base.eval.temperature = 0.0
  if args.cache_dir:
    base.model.cache_dir = args.cache_dir
  if args.smoke:
    base = ablations.smoke(base, args.cache_dir)
  else:
    base.rl.max_time_s = args.budget_s
    base.rl.total_steps = 10**7
  model_dir = ablations.model_dir_for(base)
  stamp = warmstart.read_stamp(model_dir)
  workdir = args.workdir or tempfile.mkdtemp(prefix='tools_learning_')
  print(f'device: {jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} '
        f'CPUs, jax {jax.__version__}; model {model_dir}; runs in {workdir}')
  print(f'tools preset: B={base.rl.batch_size} (G={base.rl.group_size}), '
        f'H={base.generation.num_slots}, max_lag={base.rl.max_lag}; per run '
        f'{base.rl.max_time_s:.0f} s or {base.rl.total_steps} steps; seeds {seeds}', flush=True)

  start = greedy_pass1(ablations.override(base), model_dir, os.path.join(workdir, 'eval-start'))
  rows, curves = [], {}
  for seed in seeds:
    print(f'--- seed {seed}', flush=True)
    config = ablations.override(base, seed=seed)
    run_dir = os.path.join(workdir, f'seed{seed}')
    result = ablations.run_once(config, run_dir, model_dir, name=f'seed{seed}')
    records = result['records']
    end = greedy_pass1(config, os.path.join(run_dir, 'checkpoints'),
                       os.path.join(run_dir, 'eval-end'))
    rows.append(dict(seed=seed, **run_summary(records), pass1_start=start['pass1'],
                     pass1_end=end['pass1'], eval_calls_start=start['multi_turn'],
                     eval_calls_end=end['multi_turn']))
    curves[f'seed{seed}'] = dict(
        step=[r['step'] for r in records], time_s=[round(r['time_s'], 2) for r in records],
        reward_mean=[round(r['reward_mean'], 4) for r in records],
        tool_share=[round(r.get(TOOL_KEY, float('nan')), 4) for r in records])

  print()
  print(ablations.table(rows, COLUMNS))
  above = sum(r['rise'] > r['noise'] for r in rows)
  print(f'\nreward rise above noise on {above}/{len(rows)} seeds; tool share rose on '
        f"{sum(r['tool_share_end'] > r['tool_share_start'] for r in rows)}/{len(rows)}")
  report = dict(
      device=str(jax.devices()[0]), backend=jax.default_backend(), cpus=os.cpu_count(),
      host=platform.node(), jax=jax.__version__, args=vars(args), seeds=seeds,
      model_dir=model_dir, warmstart={k: stamp.get(k) for k in (
          'settings_hash', 'sft_steps', 'greedy_accuracy', 'sampled_accuracy', 'build_seconds')},
      batch_size=base.rl.batch_size, group_size=base.rl.group_size, runs=rows, curves=curves,
      definitions=dict(
          reward_start_end=f'mean batch reward (episode return) of the first / last {WINDOW} '
                           'steps',
          noise='2 x the standard error of reward_end - reward_start (each window: the std of '
                'its step means / sqrt(steps))',
          tool_share=f'{TOOL_KEY}: the share of the step\'s episodes with at least one tool '
                     'call',
          pass1='greedy pass@1 with tools (evaluate_checkpoint, k = n = 1, temperature 0), on '
                'the warm-started model (start) and the final checkpoint (end)',
          eval_calls='share of those greedy episodes that went past one turn'))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
