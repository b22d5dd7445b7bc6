"""Learning speed: PipelineRL vs conventional RL with k optimizer steps per generated batch
(the paper's Fig. 1/4 comparison), on the same task, warm-started model, seed and budgets.

  python -m pipelinerl_jax.bench.learning_speed [--budget_s 300] [--target 0.8]
      [--modes pipeline,conv1,conv2,conv4,conv8] [--out PATH.json] [--seed 0] [--smoke]

Each mode is one RL run of the `tiny` preset from the same warm-started model, stopped by the
same wall-clock cap (--budget_s, compilation included) or sample budget (--budget_samples),
whichever comes first. Every optimizer step trains on B samples in every mode; conventional
`conv<k>` generates k*B samples with one policy (on H = k*B slots, the whole batch at once),
then takes k steps on them, so its lag runs 0..k-1. Reported per mode: time and samples to the
target reward (10-step trailing mean), ESS and token lag (min / mean / max), and the
learning curves, as a table, a JSON file and a PNG (reward vs time and vs samples).

`speedup_vs_best_conventional` = (fastest conventional time to target) / (pipeline time to
target). It is null when it cannot be measured: `speedup.note` says why, and when only the
pipeline reached the target, `speedup.lower_bound` is the ratio the budget still proves.
Nothing here asserts timing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile

import jax

from pipelinerl_jax.bench import ablations

DEFAULT_MODES = 'pipeline,conv1,conv2,conv4,conv8'
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
CURVE_POINTS = 300   # per mode in the JSON; the full records are in each run's metrics.jsonl


def curve(records: list[dict]) -> dict[str, list[float]]:
  """Learning curve, thinned to at most CURVE_POINTS steps (always keeping the last)."""
  smooth = ablations.smoothed_rewards(records)
  stride = max(1, -(-len(records) // CURVE_POINTS))
  keep = sorted(set(range(0, len(records), stride)) | {len(records) - 1}) if records else []
  return dict(step=[records[i]['step'] for i in keep],
              time_s=[round(records[i]['time_s'], 2) for i in keep],
              samples=[records[i]['samples'] for i in keep],
              reward_smoothed=[round(smooth[i], 4) for i in keep],
              ess=[round(records[i]['ess'], 4) for i in keep],
              lag_mean=[round(records[i]['lag_mean'], 3) for i in keep])


COLUMNS = (('mode', 'name', 's'), ('H', 'num_slots', 'd'), ('steps', 'steps', 'd'),
           ('samples', 'samples', ',d'), ('run_s', 'time_s', '.0f'),
           ('t->target', 't_target', '.0f'), ('samples->target', 's_target', ',d'),
           ('reward_final', 'reward_final', '.3f'), ('ess_mean', 'ess_mean', '.3f'),
           ('ess_min', 'ess_min', '.3f'), ('lag_min', 'lag_min', '.0f'),
           ('lag_mean', 'lag_mean', '.2f'), ('lag_max', 'lag_max', '.0f'),
           ('samples/s', 'samples_per_s', '.0f'), ('train_step_s', 'train_step_s', '.2f'),
           ('overlap_s', 'overlap_s', '.0f'), ('load', 'load', '.1f'))


def table_row(s: dict, target: float) -> dict:
  reached = s['to_target'][f'{target:g}']
  return dict(s, t_target=reached and reached['time_s'], s_target=reached and reached['samples'],
              ess_mean=s['ess']['mean'], ess_min=s['ess']['min'],
              load=(s['load_before'] + s['load_after']) / 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--budget_s', type=float, default=300.0, help='wall-clock cap per run')
  parser.add_argument('--budget_samples', type=int, default=0,
                      help='sample cap per run (0 = none: the time cap ends the run)')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--modes', default=DEFAULT_MODES,
                      help="comma-separated: 'pipeline' and/or 'conv<k>' (k steps per batch)")
  parser.add_argument('--conventional_slots', default='batch', choices=('batch', 'same'),
                      help="conventional H: 'batch' = k*B (whole batch at once), 'same' = preset")
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/learning_speed.json')
  parser.add_argument('--png', default='', help="figure path ('' = the JSON path with .png)")
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  parser.add_argument('--cache_dir', default='', help="demo model cache ('' = the default)")
  parser.add_argument('--smoke', action='store_true',
                      help='untrained model, 3 steps of 16 samples per mode (tests)')
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use('Agg')  # a file, never a window
  modes = [m for m in args.modes.split(',') if m]
  if 'pipeline' not in modes:
    parser.error("--modes must include 'pipeline' (the speedup is relative to it)")

  base = ablations.preset('tiny')
  base.seed = args.seed
  base.log.tensorboard = False
  if args.cache_dir:
    base.model.cache_dir = args.cache_dir
  if args.smoke:
    base = ablations.smoke(base, args.cache_dir)
  else:
    base.rl.max_time_s = args.budget_s
    base.rl.total_steps = (max(1, args.budget_samples // base.rl.batch_size)
                           if args.budget_samples else 10**7)
  configs = {m: ablations.mode_config(base, m, args.conventional_slots) for m in modes}
  model_dir = ablations.model_dir_for(base)
  workdir = args.workdir or tempfile.mkdtemp(prefix='learning_speed_')
  print(f'device: {jax.devices()[0].device_kind} ({jax.default_backend()}), '
        f'{os.cpu_count()} CPUs, jax {jax.__version__}; model {model_dir}; runs in {workdir}')
  print(f'B={base.rl.batch_size} (G={base.rl.group_size} samples per prompt), pipeline '
        f'H={base.generation.num_slots} max_lag={base.rl.max_lag}; per run: '
        f'{base.rl.max_time_s:.0f} s or {base.rl.total_steps} steps; target {args.target}',
        flush=True)

  results = []
  for m in modes:
    print(f'--- {m}', flush=True)
    results.append(ablations.run_once(configs[m], os.path.join(workdir, m), model_dir, name=m))
  summaries = [ablations.summarize(r, sorted({*THRESHOLDS, args.target})) for r in results]
  pipe = next(s for s in summaries if s['name'] == 'pipeline')
  conv = [s for s in summaries if s['name'] != 'pipeline']
  speedup = ablations.speedup(pipe, conv, args.target)
  by_threshold = {f'{t:g}': ablations.speedup(pipe, conv, t)['value'] for t in THRESHOLDS}

  print()
  print(ablations.table([table_row(s, args.target) for s in summaries], COLUMNS))
  value = speedup['value']
  print(f"\nspeedup_vs_best_conventional (target {args.target:g}): "
        f"{'null' if value is None else f'{value:.2f}'}  ({speedup['note']})")
  print('at other targets: ' + ', '.join(
      f"{k}: {'-' if v is None else f'{v:.2f}'}" for k, v in by_threshold.items()))

  out = pathlib.Path(args.out)
  png = pathlib.Path(args.png or out.with_suffix('.png'))
  ablations.plot_comparison(
      results, target=args.target, path=str(png),
      title=f'PipelineRL vs conventional (conv<k> = k optimizer steps per generated batch); '
            f'tiny preset, B={base.rl.batch_size}, seed {args.seed}, '
            f'{os.cpu_count()} CPUs, {jax.default_backend()}')
  report = dict(
      device=str(jax.devices()[0]), backend=jax.default_backend(), cpus=os.cpu_count(),
      host=platform.node(), jax=jax.__version__, args=vars(args), model_dir=model_dir,
      batch_size=base.rl.batch_size, group_size=base.rl.group_size, target=args.target,
      speedup_vs_best_conventional=value, speedup=speedup,
      speedup_at_thresholds=by_threshold, modes=summaries,
      curves={r['name']: curve(r['records']) for r in results}, png=str(png),
      definitions=dict(
          time_to_target='seconds of RL (trainer clock; first compilation included) until the '
                         '10-step trailing mean of the batch reward first reaches the target; '
                         'null if never within the budget',
          speedup_vs_best_conventional='fastest conventional time to target / pipeline time '
                                       'to target; null if either side never reached it (see '
                                       'speedup.note and speedup.lower_bound)',
          conv_k='conventional RL: k*B samples generated by one policy, then k optimizer steps '
                 'of B samples each, then a weight sync'))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float))
  print(f'wrote {out} and {png}')


if __name__ == '__main__':
  main()
