"""LoRA against full fine-tuning at the same wall-clock budget: PipelineRL runs of a preset and of
its LoRA twin, from the same warm-started model, seed by seed.

  python -m pipelinerl_jax.bench.lora_learning [--full tiny] [--lora tiny_lora]
      [--seeds 0,1,2] [--budget_s 300] [--target 0.8] [--out PATH.json] [--smoke]

Each seed runs the full fine-tuning preset, then the LoRA one (seeds are the outer loop, so a
drift in the host's load hits both alike), each stopped by the same wall-clock cap (compilation
included). Reported per run and over seeds: the reward at the start and at the end (10-step
trailing mean), the best, time and samples to --target, samples/s, the mean train step, the
bytes published per update and the share of samples decoded across several policy versions;
as a table, a JSON file and a PNG (reward vs time and vs samples, median over seeds with a
min-max band). Nothing here asserts timing; the JSON records the load average of every run.
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

COLUMNS = (('run', 'name', 's'), ('seed', 'seed', 'd'), ('steps', 'steps', 'd'),
           ('samples', 'samples', ',d'), ('reward_first', 'reward_first', '.3f'),
           ('reward_final', 'reward_final', '.3f'), ('reward_best', 'reward_best', '.3f'),
           ('t->target', 't_target', '.0f'), ('samples/s', 'samples_per_s', '.0f'),
           ('train_step_s', 'train_step_s', '.2f'), ('publish_MB', 'publish_mb', '.3f'),
           ('multi_version', 'frac_multi_version', '.2f'), ('load', 'load', '.1f'))


def row(summary: dict, result: dict, target: float) -> dict:
  reached = summary['to_target'][f'{target:g}']
  sent = [r['publish_bytes'] for r in result['records'] if 'publish_bytes' in r]
  return dict(summary, t_target=reached and reached['time_s'],
              publish_mb=sent[-1] / 1e6 if sent else None,
              load=(summary['load_before'] + summary['load_after']) / 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--full', default='tiny', help='the full fine-tuning preset')
  parser.add_argument('--lora', default='tiny_lora', help='its LoRA twin')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--budget_s', type=float, default=300.0, help='wall-clock cap per run')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/lora_learning.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  parser.add_argument('--smoke', action='store_true', help='untrained model, 3 short steps')
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use('Agg')
  seeds = [int(s) for s in args.seeds.split(',') if s.strip()]
  configs = {}
  for name in (args.full, args.lora):
    c = ablations.preset(name)
    c.log.tensorboard = c.log.progress = False
    if args.smoke:
      c = ablations.smoke(c)
    else:
      c.rl.max_time_s, c.rl.total_steps = args.budget_s, 10**7
    configs[name] = c
  model_dir = ablations.model_dir_for(configs[args.full])
  if ablations.model_dir_for(configs[args.lora]) != model_dir:
    parser.error(f'{args.full} and {args.lora} warm-start different models')
  workdir = args.workdir or tempfile.mkdtemp(prefix='lora_learning_')
  print(f'device: {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; model {model_dir}; '
        f'{args.budget_s:.0f} s per run; seeds {seeds}; runs in {workdir}', flush=True)
  results, rows = [], []
  for seed in seeds:
    for name, config in configs.items():
      print(f'--- {name} seed {seed}', flush=True)
      result = ablations.run_once(ablations.override(config, seed=seed),
                                  os.path.join(workdir, name, f'seed{seed}'), model_dir,
                                  name=name)
      results.append(dict(result, seed=seed))
      summary = dict(seed=seed, **ablations.summarize(result, [args.target]))
      rows.append(row(summary, result, args.target))
  print(ablations.table(rows, COLUMNS))
  over_seeds = {}
  for name in configs:
    mine = [r for r in rows if r['name'] == name]
    over_seeds[name] = {key: ablations.seed_stats([r[key] for r in mine])
                        for key in ('reward_first', 'reward_final', 'reward_best', 't_target',
                                    'samples_per_s', 'train_step_s')}
    stats = over_seeds[name]
    print(f"{name}: reward {stats['reward_first']['median']:.3f} -> "
          f"{stats['reward_final']['median']:.3f} (median over {len(mine)} seeds; final "
          f"{stats['reward_final']['min']:.3f}-{stats['reward_final']['max']:.3f}), reached "
          f"{args.target:g} in {stats['t_target']['n']}/{len(mine)}")
  out = pathlib.Path(args.out)
  png = out.with_suffix('.png')
  ablations.plot_comparison(
      results, target=args.target, path=str(png),
      title=f'{args.full} (full fine-tuning) vs {args.lora} (LoRA), PipelineRL, '
            f'{args.budget_s:.0f} s each, seeds {args.seeds}, {os.cpu_count()} CPUs')
  report = dict(host=platform.node(), cpus=os.cpu_count(), jax=jax.__version__,
                args=vars(args), model_dir=model_dir, seeds=seeds, runs=rows,
                over_seeds=over_seeds, png=str(png),
                curves={f"{r['name']}/seed{r['seed']}": ablations_curve(r) for r in results})
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=float))
  print(f'wrote {out} and {png}')


def ablations_curve(result: dict) -> dict:
  """Time, samples and smoothed reward per step (every step: runs here are short)."""
  records = result['records']
  return dict(time_s=[round(r['time_s'], 2) for r in records],
              samples=[r['samples'] for r in records],
              reward_smoothed=[round(x, 4) for x in ablations.smoothed_rewards(records)])


if __name__ == '__main__':
  main()
