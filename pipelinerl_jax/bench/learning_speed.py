"""Learning speed: PipelineRL vs conventional RL with k optimizer steps per generated batch
(the paper's Fig. 1/4 comparison), on the same task, warm-started model, seeds and budgets.

  python -m pipelinerl_jax.bench.learning_speed [--preset tiny] [--seeds 0,1,2]
      [--budget_s 300] [--target 0.8] [--modes pipeline,conv1,conv2,conv4,conv8]
      [--set generation.sync_every=1 ...] [--out PATH.json] [--smoke]
      [--gen_core_scaling 1.0] [--train_core_scaling 1.6]
  python -m pipelinerl_jax.bench.learning_speed --report PATH.json   # model section only

Modes: `pipeline` (generator and trainer in one process, sharing every core),
`pipeline-disjoint` (the generator a Ray actor pinned to half the cores, the trainer pinned to
the rest: train.cores='free'), `conv<k>` (every core for each phase in turn) and
`conv<k>-percore` (one generator actor pinned to each core, training on every core). Each mode is
one RL run per seed of a configs/math.py preset (--preset, default `tiny`) from the same
warm-started model, stopped by the same wall-clock cap (--budget_s, compilation included)
or sample budget (--budget_samples), whichever comes first. The seed varies the RL run
(problems, sampling), not the warm start. Seeds are the outer loop (seed 0 of every mode, then
seed 1, ...), so a drift in the machine's load hits every mode alike. Every optimizer step
trains on B samples in every mode; conventional `conv<k>` generates k*B samples with one policy
(on H = k*B slots, the whole batch at once), then takes k steps on them, so its lag runs
0..k-1. Reported per mode and seed: time and samples to the target reward (10-step trailing
mean), ESS and token lag (min / mean / max), and the learning curves; per mode, the median and
min-max of time and samples to target over the seeds that reached it. As tables, a JSON file
and a PNG (reward vs time and vs samples: the median over seeds with a min-max band).

`speedup_vs_best_conventional` = (median time to target of the best conventional mode) /
(pipeline median time to target), the best being the lowest median among the conventional
modes that reached the target in every seed. Its spread is the per-seed ratio (same seed,
conventional / pipeline time): `speedup.ratio_min` / `ratio_max` and `spread_crosses_1`. It is
null when it cannot be measured: `speedup.note` says why, and when only the pipeline reached
the target, `speedup.lower_bound` is the ratio the budget still proves (the fallbacks are in
`ablations.speedup_over_seeds`). `speedup_of_other_placements` is the same for
pipeline-disjoint. Nothing here asserts timing.

Model vs measurement: the JSON's `model` section calibrates the throughput simulator
(sim/throughput.py) on the best conventional mode's own rates and puts its predicted
pipeline/conventional throughput ratio, on shared and on disjoint cores, beside the measured
throughput ratio and time-to-target speedup (medians over seeds; see bench/throughput_model.py).
The core scalings it needs are flags, measured earlier, not by this run. `--report PATH.json`
adds that section to an existing JSON without running anything (summaries without `tokens`
read them from the runs' metrics.jsonl under the JSON's workdir).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import platform
import tempfile

import jax

from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import throughput_model

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


# One row per run (mode and seed).
COLUMNS = (('mode', 'name', 's'), ('seed', 'seed', 'd'), ('H', 'num_slots', 'd'),
           ('steps', 'steps', 'd'), ('samples', 'samples', ',d'), ('run_s', 'time_s', '.0f'),
           ('t->target', 't_target', '.0f'), ('samples->target', 's_target', ',d'),
           ('reward_final', 'reward_final', '.3f'), ('ess_mean', 'ess_mean', '.3f'),
           ('ess_min', 'ess_min', '.3f'), ('lag_min', 'lag_min', '.0f'),
           ('lag_mean', 'lag_mean', '.2f'), ('lag_max', 'lag_max', '.0f'),
           ('samples/s', 'samples_per_s', '.0f'), ('train_step_s', 'train_step_s', '.2f'),
           ('gen_busy', 'gen_busy', '.2f'), ('train_busy', 'train_busy', '.2f'),
           ('overlap_s', 'overlap_s', '.0f'), ('load', 'load', '.1f'))
# One row per mode, over its seeds: median [min-max] to target, medians of the rest.
SEED_COLUMNS = (('mode', 'name', 's'), ('reached', 'reached', 's'),
                ('t->target', 't_target', 's'), ('samples->target', 's_target', 's'),
                ('steps', 'steps', '.0f'), ('reward_final', 'reward_final', '.3f'),
                ('ess_mean', 'ess_mean', '.3f'), ('lag_mean', 'lag_mean', '.2f'),
                ('samples/s', 'samples_per_s', '.0f'), ('train_step_s', 'train_step_s', '.2f'),
                ('gen_busy', 'gen_busy', '.2f'), ('train_busy', 'train_busy', '.2f'),
                ('load', 'load', '.1f'))


def table_row(s: dict, target: float) -> dict:
  reached = s['to_target'][f'{target:g}']
  return dict(s, t_target=reached and reached['time_s'], s_target=reached and reached['samples'],
              ess_mean=s['ess']['mean'], ess_min=s['ess']['min'],
              load=(s['load_before'] + s['load_after']) / 2,
              # each loop's busy share of the run: the idle share is what placement could gain
              gen_busy=s['gen_busy_s'] / s['time_s'] if s['time_s'] else None,
              train_busy=s['train_busy_s'] / s['time_s'] if s['time_s'] else None)


def spread_cell(stats: dict, fmt: str) -> str:
  """'median [min-max]' of `ablations.seed_stats` (the median alone for one seed); '-' if no
  seed has a value."""
  if stats['n'] == 0:
    return '-'
  if stats['seeds'] == 1:
    return format(stats['median'], fmt)
  return (f"{format(stats['median'], fmt)} "
          f"[{format(stats['min'], fmt)}-{format(stats['max'], fmt)}]")


def mode_over_seeds(name: str, seeds: list[int], summaries: list[dict], target: float) -> dict:
  """A mode's JSON entry: per seed its time and samples to target and its summary, and their
  median, min, max and count over the seeds that reached the target."""
  over = ablations.to_target_over_seeds(summaries, target)
  return dict(name=name, seeds=seeds, target=target,
              time_to_target=over['time_s'], samples_to_target=over['samples'],
              time_to_target_stats=over['time_s_stats'],
              samples_to_target_stats=over['samples_stats'],
              per_seed=summaries)


def seed_table_row(mode: dict) -> dict:
  rows = [table_row(s, mode['target']) for s in mode['per_seed']]

  def median(key):
    return ablations.seed_stats([r[key] for r in rows])['median']
  time_stats = mode['time_to_target_stats']
  return dict(name=mode['name'], reached=f"{time_stats['n']}/{time_stats['seeds']}",
              t_target=spread_cell(time_stats, '.0f'),
              s_target=spread_cell(mode['samples_to_target_stats'], ',.0f'),
              **{key: median(key) for key in ('steps', 'reward_final', 'ess_mean', 'lag_mean',
                                              'samples_per_s', 'train_step_s', 'gen_busy',
                                              'train_busy', 'load')})


MODEL_COLUMNS = (('seed', 'seed', 'd'), ('r_gen', 'r_gen', '.0f'), ('r_train', 'r_train', '.0f'),
                 ('r_conv', 'r_conv', '.0f'), ('pred_shared', 'speedup_shared', '.2f'),
                 ('pred_disjoint', 'speedup_disjoint', '.2f'),
                 ('pred_bound', 'speedup_bound', '.2f'),
                 ('measured', 'throughput_ratio_measured', '.2f'))


def model_text(section: dict) -> str:
  """The model section as a per-seed table (tokens/s; predicted and measured throughput ratios
  pipeline / conventional) and its one-line summary of medians."""
  return (f"model vs measurement ({section['note']}):\n"
          + ablations.table(section['per_seed'], MODEL_COLUMNS) + '\n'
          + throughput_model.model_line(section))


def parse_seeds(seeds: str) -> list[int]:
  out = [int(k) for k in seeds.split(',') if k.strip()]
  if not out or len(set(out)) != len(out):
    raise ValueError(f'--seeds {seeds!r}: expected distinct integers like 0,1,2')
  return out


def parse_sets(sets: list[str]) -> dict[str, object]:
  """['generation.sync_every=1', ...] -> {'generation__sync_every': 1} (ablations.override's
  keys); a value that is not a Python literal stays a string ('model.path=/x')."""
  out = {}
  for item in sets:
    key, sep, text = item.partition('=')
    if not sep or not key.strip() or '__' in key:
      raise ValueError(f'--set {item!r}: expected SECTION.FIELD=VALUE like generation.sync_every=1')
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    out[key.strip().replace('.', '__')] = value
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--preset', default='tiny', help='configs/math.py preset to run')
  parser.add_argument('--seeds', default='', help='comma-separated RL seeds, e.g. 0,1,2')
  parser.add_argument('--seed', type=int, default=None,
                      help='one seed, the same as --seeds K (default: seed 0)')
  parser.add_argument('--budget_s', type=float, default=300.0, help='wall-clock cap per run')
  parser.add_argument('--budget_samples', type=int, default=0,
                      help='sample cap per run (0 = none: the time cap ends the run)')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--modes', default=DEFAULT_MODES,
                      help="comma-separated: 'pipeline' and/or 'conv<k>' (k steps per batch)")
  parser.add_argument('--conventional_slots', default='batch', choices=('batch', 'same'),
                      help="conventional H: 'batch' = k*B (whole batch at once), 'same' = preset")
  parser.add_argument('--set', action='append', default=[], metavar='SECTION.FIELD=VALUE',
                      help='a config override for every mode (repeatable), e.g. '
                           'generation.sync_every=1')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/learning_speed.json')
  parser.add_argument('--png', default='', help="figure path ('' = the JSON path with .png)")
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  parser.add_argument('--cache_dir', default='', help="demo model cache ('' = the default)")
  parser.add_argument('--smoke', action='store_true',
                      help='untrained model, 3 steps of 16 samples per mode and seed (tests)')
  parser.add_argument('--gen_core_scaling', type=float,
                      default=throughput_model.GEN_CORE_SCALING,
                      help='for the model: generation tokens/s on 2 cores / on 1 (measured '
                           'earlier on the 2-core machine, not by this run)')
  parser.add_argument('--train_core_scaling', type=float,
                      default=throughput_model.TRAIN_CORE_SCALING,
                      help='for the model: train tokens/s on 2 cores / on 1 (1.5-1.8 measured '
                           'earlier on the 2-core machine, not by this run)')
  parser.add_argument('--report', default='',
                      help='only add the model section to this existing learning-speed JSON')
  args = parser.parse_args(argv)
  if args.report:
    section = throughput_model.add_model_to_report(args.report, args.gen_core_scaling,
                                                   args.train_core_scaling)
    print(model_text(section))
    print(f'wrote the model section into {args.report}')
    return
  import matplotlib
  matplotlib.use('Agg')  # a file, never a window
  modes = [m for m in args.modes.split(',') if m]
  if 'pipeline' not in modes:
    parser.error("--modes must include 'pipeline' (the speedup is relative to it)")
  if args.seeds and args.seed is not None:
    parser.error('give --seeds or --seed, not both')
  try:
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed or 0]
  except ValueError as e:
    parser.error(str(e))

  try:
    sets = parse_sets(args.set)
  except ValueError as e:
    parser.error(str(e))
  base = ablations.preset(args.preset)
  base.log.tensorboard = False
  if args.cache_dir:
    base.model.cache_dir = args.cache_dir
  if args.smoke:
    base = ablations.smoke(base, args.cache_dir)
  else:
    base.rl.max_time_s = args.budget_s
    base.rl.total_steps = (max(1, args.budget_samples // base.rl.batch_size)
                           if args.budget_samples else 10**7)
  try:  # last, so that they win over the budget and --smoke
    base = ablations.override(base, **sets)
  except (KeyError, TypeError) as e:  # no such field; a value of the wrong type
    parser.error(f'--set: {e.args[0] if e.args else e}')
  model_dir = ablations.model_dir_for(base)   # the warm start does not depend on the seed
  workdir = args.workdir or tempfile.mkdtemp(prefix='learning_speed_')
  print(f'device: {jax.devices()[0].device_kind} ({jax.default_backend()}), '
        f'{os.cpu_count()} CPUs, jax {jax.__version__}; model {model_dir}; runs in {workdir}')
  print(f'{args.preset} preset: B={base.rl.batch_size} (G={base.rl.group_size} samples per '
        f'prompt), pipeline H={base.generation.num_slots} max_lag={base.rl.max_lag}; per run: '
        f'{base.rl.max_time_s:.0f} s or {base.rl.total_steps} steps; target {args.target}; '
        f'seeds {seeds}' + (f'; overrides {", ".join(args.set)}' if args.set else ''), flush=True)

  targets = sorted({*THRESHOLDS, args.target})
  results = {m: [] for m in modes}
  summaries = {m: [] for m in modes}
  for seed in seeds:   # outer: load drift during the benchmark hits every mode alike
    for m in modes:
      print(f'--- {m} seed {seed}', flush=True)
      config = ablations.mode_config(ablations.override(base, seed=seed), m,
                                     args.conventional_slots)
      result = ablations.run_once(config, os.path.join(workdir, m, f'seed{seed}'), model_dir,
                                  name=m)
      results[m].append(result)
      summaries[m].append(dict(seed=seed, **ablations.summarize(result, targets)))
  conv = {m: summaries[m] for m in modes if throughput_model.is_conventional(m)}
  speedup = ablations.speedup_over_seeds(summaries['pipeline'], conv, args.target)
  # Other placements of PipelineRL (pipeline-disjoint) against the same conventional modes.
  placements = {m: ablations.speedup_over_seeds(summaries[m], conv, args.target, name=m)
                for m in modes if m != 'pipeline' and not throughput_model.is_conventional(m)}
  by_threshold = {f'{t:g}': ablations.speedup_over_seeds(summaries['pipeline'], conv, t)['value']
                  for t in THRESHOLDS}
  mode_reports = [mode_over_seeds(m, seeds, summaries[m], args.target) for m in modes]

  print()
  print(ablations.table([table_row(s, args.target) for seed_index in range(len(seeds))
                         for s in (summaries[m][seed_index] for m in modes)], COLUMNS))
  print(f'\nover seeds {seeds} (median [min-max] over the seeds that reached {args.target:g}; '
        'other columns: medians):')
  print(ablations.table([seed_table_row(r) for r in mode_reports], SEED_COLUMNS))
  value = speedup['value']
  spread = ('' if speedup['ratio_min'] is None else
            f", per-seed ratio {speedup['ratio_min']:.2f}-{speedup['ratio_max']:.2f}, "
            f"crosses 1.0: {'yes' if speedup['spread_crosses_1'] else 'no'}")
  print(f"\nspeedup_vs_best_conventional (target {args.target:g}, {len(seeds)} seed"
        f"{'s' if len(seeds) > 1 else ''}): {'null' if value is None else f'{value:.2f}'}"
        f"{spread}  ({speedup['note']})")
  for m, other in placements.items():
    value_text = 'null' if other['value'] is None else f"{other['value']:.2f}"
    print(f"{m}: speedup vs best conventional {value_text}  ({other['note']})")
  print('at other targets: ' + ', '.join(
      f"{k}: {'-' if v is None else f'{v:.2f}'}" for k, v in by_threshold.items()))
  try:
    model = throughput_model.model_section(summaries, speedup, args.gen_core_scaling,
                                           args.train_core_scaling)
    print('\n' + model_text(model))
  except ValueError as e:   # rates it cannot measure must not cost the run its JSON
    model = dict(note=f'no model: {e}')
    print(f"\n{model['note']}")

  out = pathlib.Path(args.out)
  png = pathlib.Path(args.png or out.with_suffix('.png'))
  seeds_text = (f'seed {seeds[0]}' if len(seeds) == 1 else
                f"seeds {','.join(map(str, seeds))} (median, min-max band)")
  ablations.plot_comparison(
      [r for m in modes for r in results[m]], target=args.target, path=str(png),
      title=f'PipelineRL vs conventional (conv<k> = k optimizer steps per generated batch); '
            f'{args.preset} preset, B={base.rl.batch_size}, {seeds_text}, '
            f'{os.cpu_count()} CPUs, {jax.default_backend()}')
  report = dict(
      device=str(jax.devices()[0]), backend=jax.default_backend(), cpus=os.cpu_count(),
      host=platform.node(), jax=jax.__version__, args=vars(args), preset=args.preset,
      seeds=seeds, model_dir=model_dir, batch_size=base.rl.batch_size,
      group_size=base.rl.group_size, target=args.target,
      speedup_vs_best_conventional=value, speedup=speedup,
      speedup_at_thresholds=by_threshold, speedup_of_other_placements=placements,
      model=model, modes=mode_reports,
      curves={m: {f'seed{seed}': curve(r['records']) for seed, r in zip(seeds, results[m])}
              for m in modes},
      png=str(png),
      definitions=dict(
          time_to_target='seconds of RL (trainer clock; first compilation included) until the '
                         '10-step trailing mean of the batch reward first reaches the target; '
                         'null if never within the budget. Per mode: one per seed, and their '
                         'median, min, max and count (n) over the seeds that reached it',
          speedup_vs_best_conventional='median time to target of the best conventional mode '
                                       '(lowest median among those reaching the target in '
                                       'every seed) / pipeline median time to target; null '
                                       'if it cannot be measured (see speedup.note and '
                                       'speedup.lower_bound)',
          per_seed_ratios='conventional / pipeline time to target of the same seed (the best '
                          'conventional mode); spread_crosses_1: their min <= 1 <= max',
          conv_k='conventional RL: k*B samples generated by one policy, then k optimizer steps '
                 'of B samples each, then a weight sync'))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float))
  print(f'wrote {out} and {png}')


if __name__ == '__main__':
  main()
