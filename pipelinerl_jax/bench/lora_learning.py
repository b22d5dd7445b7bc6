"""LoRA against full fine-tuning for the same number of optimizer steps: PipelineRL runs of a
preset and of its LoRA twin, from the same warm-started model, seed by seed.

  python -m pipelinerl_jax.bench.lora_learning [--full tiny] [--lora tiny_lora]
      [--seeds 0,1,2] [--steps 300] [--budget_s 0] [--target 0.8] [--out PATH.json] [--smoke]

Each seed runs the full fine-tuning preset, then the LoRA one (seeds are the outer loop, so a
drift in the host's load hits both alike), each for --steps optimizer steps of the same batch
size (so the same samples), or until a --budget_s wall-clock cap (0: none). A step budget
compares what each arm learns from the same samples whatever the host's load; a wall-clock cap
compares what each learns in the same time, which on a shared host depends on the load.

Reported per run: the reward of the first step and the last 10 steps' mean, the trend of the
per-step reward with its noise (bench/reward_trend.py: the fitted line, the first and the last
quarter's means, the rise in standard errors), time and samples to --target, samples/s, the
mean train step, the bytes published per update, the share of samples decoded across several
policy versions, the load average; then the trend over seeds. A table, a JSON file (with every
run's raw per-step rewards, so every figure can be recomputed) and a PNG (reward vs time and vs
samples, median over seeds with a min-max band). Nothing here asserts a figure; `--smoke` (an
untrained model, a few short steps) only runs the code paths.
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
from pipelinerl_jax.bench import learning_speed
from pipelinerl_jax.bench import reward_trend

LEARNING_COLUMNS = ((('run', 'name', 's'), ('seed', 'seed', 'd'), ('steps', 'steps', 'd'),
                     ('samples', 'samples', ',d'), ('reward_first', 'reward_first', '.3f'),
                     ('last10', 'reward_final', '.3f')) + reward_trend.COLUMNS)
COST_COLUMNS = (('run', 'name', 's'), ('seed', 'seed', 'd'), ('run_s', 'time_s', '.0f'),
                ('t->target', 't_target', '.0f'), ('samples/s', 'samples_per_s', '.0f'),
                ('train_step_s', 'train_step_s', '.2f'), ('publish_MB', 'publish_mb', '.3f'),
                ('lag_mean', 'lag_mean', '.2f'), ('multi_version', 'frac_multi_version', '.2f'),
                ('load', 'load', '.1f'))
# Over seeds, per preset: median [min-max] of each.
SEED_COLUMNS = (('last10', 'reward_final', '.3f'), ('rise', 'rise', '.3f'),
                ('rise/noise', 'rise_over_noise', '.1f'), ('slope/100', 'slope', '.3f'),
                ('samples/s', 'samples_per_s', '.0f'), ('train_step_s', 'train_step_s', '.2f'))


def run_row(seed: int, result: dict, target: float) -> dict:
  """One run's table row: `ablations.summarize`, the reward trend, the publish size, the load."""
  summary = ablations.summarize(result, [target])
  reached = summary['to_target'][f'{target:g}']
  sent = [r['publish_bytes'] for r in result['records'] if 'publish_bytes' in r]
  return dict(summary, **reward_trend.of_records(result['records']), seed=seed,
              t_target=reached and reached['time_s'],
              publish_mb=sent[-1] / 1e6 if sent else None,
              load=(summary['load_before'] + summary['load_after']) / 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--full', default='tiny', help='the full fine-tuning preset')
  parser.add_argument('--lora', default='tiny_lora', help='its LoRA twin')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/lora_learning.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  ablations.add_budget_flags(parser, default_steps=300)
  args = parser.parse_args(argv)
  try:
    seeds = learning_speed.parse_seeds(args.seeds)
  except ValueError as e:
    parser.error(str(e))
  import matplotlib
  matplotlib.use('Agg')
  configs = {}
  for name in (args.full, args.lora):
    c = ablations.preset(name)
    c.log.tensorboard = c.log.progress = False
    configs[name] = ablations.budgeted(parser, args, c)
  model_dir = ablations.model_dir_for(configs[args.full])
  if ablations.model_dir_for(configs[args.lora]) != model_dir:
    parser.error(f'{args.full} and {args.lora} warm-start different models')
  workdir = args.workdir or tempfile.mkdtemp(prefix='lora_learning_')
  budget = ablations.budget_text(args)
  print(f'device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; model {model_dir}; '
        f'{budget} per run; seeds {seeds}; runs in {workdir}; '
        f'load {os.getloadavg()[0]:.1f}', flush=True)
  results, rows = [], []
  for seed in seeds:
    for name, config in configs.items():
      print(f'--- {name} seed {seed}', flush=True)
      result = ablations.run_once(ablations.override(config, seed=seed),
                                  os.path.join(workdir, name, f'seed{seed}'), model_dir,
                                  name=name)
      results.append(result)
      rows.append(run_row(seed, result, args.target))
  over_seeds = reward_trend.print_tables(rows, LEARNING_COLUMNS, 'cost', COST_COLUMNS,
                                         SEED_COLUMNS, seeds)
  rise = [over_seeds[name]['rise']['median'] for name in configs]
  ratio = rise[0] / rise[1] if None not in rise and rise[1] else None
  if ratio is not None:
    print(f'median rise, {args.full} / {args.lora}: {ratio:.1f}')
  out = pathlib.Path(args.out)
  png = out.with_suffix('.png')
  ablations.plot_comparison(
      results, target=args.target, path=str(png),
      title=f'{args.full} (full fine-tuning) vs {args.lora} (LoRA), PipelineRL, '
            f'{budget} each, seeds {args.seeds}, {os.cpu_count()} CPUs')
  report = dict(host=platform.node(), cpus=os.cpu_count(), jax=jax.__version__,
                args=vars(args), model_dir=model_dir, seeds=seeds, runs=rows,
                over_seeds=over_seeds, rise_ratio=ratio, png=str(png),
                raw={f"{row['name']}/seed{row['seed']}": reward_trend.raw(r['records'])
                     for r, row in zip(results, rows)})
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float) + '\n')
  print(f'wrote {out} and {png}')


if __name__ == '__main__':
  main()
