"""Routing replay on a mixture of experts: how it changes the train / sampler mismatch, and
whether the tiny MoE learns with it and without it.

  python -m pipelinerl_jax.bench.moe_replay [--preset tiny_moe] [--seeds 0,1,2] [--steps 300]
      [--budget_s 0] [--target 0.8] [--lags 1,2,4,8] [--set SECTION.FIELD=VALUE ...]
      [--out PATH.json] [--smoke] [--skip_learning] [--skip_mismatch]

Both parts start from the warm-started demo MoE of the preset (configs/math.py): `tiny_moe` (a
Qwen3-MoE) or `tiny_hybrid_moe` (a Qwen3.5-MoE: Gated DeltaNet layers and a shared expert).

Mismatch: the JAX engine samples B = 256 completions under the warm start (policy 0), recording
each token's log mu and routes; the policies of a short real pipeline run (`--lags`, optimizer
steps later) then score the same tokens by a full forward as the trainer does, with the
sampler's experts replayed and with their own. Per (dtype, lag, routing): the mean
|log pi - log mu| of the model tokens (the trainer's `abs_logp_diff`), the normalized ESS of pi
/ mu (paper eq. 6), and the share of (token, MoE layer) routes whose own top-k is not the
sampler's. Lag 0 in bfloat16 is the engine-vs-trainer numerics alone (bf16 on both sides; the
engine decodes one token at a time over its paged cache, the trainer a whole row at once).

Learning: per seed, one PipelineRL run of the preset per routing ('replay', 'recompute'), the
seeds the outer loop, each for --steps optimizer steps (the same samples for both routings,
whatever the host's load) or until a --budget_s wall-clock cap (0: none). Per run: the time and
samples to the target reward (10-step trailing mean), the first and the last 10 steps' reward,
the trend of the per-step reward with its noise (bench/reward_trend.py), and the means over its
steps of abs_logp_diff, ESS, frac_is_capped and moe/routes_differ; then the trend and the
mismatch over seeds. Tables, a JSON file (with every run's raw per-step rewards) and two PNGs:
the learning curves (reward vs time and samples, ESS, lag; median and min-max band over seeds)
and the mismatch over the runs (abs_logp_diff, moe/routes_differ). Nothing here asserts a
figure; `--smoke` (an untrained model, a few steps, small batches) only runs the code paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import platform
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax import packing
from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import learning_speed
from pipelinerl_jax.bench import reward_trend
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import metrics as metrics_lib

ROUTINGS = ('replay', 'recompute')
PRESETS = ('tiny_moe', 'tiny_hybrid_moe')
# The mismatch table with the two routings side by side, one row per (dtype, lag).
PAIRED_COLUMNS = (('dtype', 'dtype', 's'), ('lag', 'lag', 'd'),
                  ('|logpi-logmu| replay', 'abs_logp_diff_replay', '.2e'),
                  ('recompute', 'abs_logp_diff_recompute', '.2e'),
                  ('ess replay', 'ess_replay', '.4f'), ('recompute', 'ess_recompute', '.4f'),
                  ('routes_differ', 'routes_differ_recompute', '.4f'),
                  ('tokens', 'tokens_recompute', 'd'))
LEARNING_COLUMNS = ((('routing', 'name', 's'), ('seed', 'seed', 'd'), ('steps', 'steps', 'd'),
                     ('samples', 'samples', ',d'), ('reward_first', 'reward_first', '.3f'),
                     ('last10', 'reward_final', '.3f')) + reward_trend.COLUMNS)
RUN_COLUMNS = (('routing', 'name', 's'), ('seed', 'seed', 'd'), ('run_s', 'time_s', '.0f'),
               ('t->target', 't_target', '.0f'), ('samples->target', 's_target', ',d'),
               ('|logpi-logmu|', 'abs_logp_diff', '.2e'),
               ('ess', 'ess_mean', '.4f'), ('capped', 'frac_is_capped', '.4f'),
               ('routes_differ', 'routes_differ', '.4f'),
               ('lag_mean', 'lag_mean', '.2f'), ('train_step_s', 'train_step_s', '.2f'),
               ('load', 'load', '.1f'))
# Over seeds, per routing: median [min-max] of each.
SEED_COLUMNS = (('last10', 'reward_final', '.3f'), ('rise', 'rise', '.3f'),
                ('rise/noise', 'rise_over_noise', '.1f'), ('slope/100', 'slope', '.3f'),
                ('|logpi-logmu|', 'abs_logp_diff', '.2e'), ('ess', 'ess_mean', '.4f'),
                ('routes_differ', 'routes_differ', '.4f'))


# ---------------------------------------------------------------------------------------------
# The mismatch of one batch of samples, scored by later policies.


def sample_batch(model_dir: str, params, config: transformer.ModelConfig, *, task,
                 prompts: int, group_size: int, max_tokens: int, seed: int
                 ) -> list[api.Completion]:
  """`prompts` x `group_size` completions of `task`'s problems under `params`, temperature 1,
  each token with its log mu and routes (the JAX engine's)."""
  tokenizer, requests = ablations.task_requests(model_dir, task, prompts, group_size,
                                                max_tokens, seed)
  engine_config = jax_engine.EngineConfig(
      num_slots=len(requests),
      max_seq_len=max(len(r.prompt_tokens) for r in requests) + max_tokens,
      eos_token_ids=(warmstart.eos_id(tokenizer),))
  with jax_engine.JaxEngine(config, params, engine_config) as engine:
    return api.generate(engine, requests)


def packed(completions: list[api.Completion]) -> dict[str, np.ndarray]:
  samples = [packing.Sample(prompt_tokens=c.prompt_tokens, completion_tokens=c.tokens,
                            behaviour_logprobs=c.logprobs, versions=c.versions, advantage=0.0,
                            routes=c.routes) for c in completions]
  longest = max(len(c.prompt_tokens) + len(c.tokens) for c in completions)
  batch, _ = packing.pack_samples(samples, seq_len=max(64, longest))
  return batch


def score(params, config: transformer.ModelConfig, batch: dict[str, np.ndarray], routing: str
          ) -> dict[str, float]:
  """The trainer's view of `batch` under `params`: mismatch to the sampler's log mu and how
  many routes of the model tokens differ from the sampler's."""
  on = batch['loss_mask'] > 0
  replay = routing == 'replay'
  logp, _, routes = _routed(params, *(jnp.asarray(batch[k]) for k in (
      'tokens', 'targets', 'positions', 'segment_ids')),
      jnp.asarray(batch['routes']) if replay else None, jnp.asarray(on) if replay else None,
      config=config)
  log_w = (np.asarray(logp) - batch['behaviour_logprobs'])[on].astype(np.float64)
  w = np.exp(log_w)
  sampler = jnp.moveaxis(jnp.asarray(batch['routes']), 2, 0)
  differ = np.asarray(moe_lib.differing(routes.own, sampler))[:, on]
  return dict(abs_logp_diff=float(np.mean(np.abs(log_w))),
              ess=float(w.sum() ** 2 / (w.size * (w ** 2).sum())),
              routes_differ=float(differ.mean()), tokens=int(on.sum()))


@jax.jit
def _cast(params, like):
  return jax.tree.map(lambda x: x.astype(like.dtype), params)


@functools.partial(jax.jit, static_argnames=('config',))
def _routed(params, tokens, targets, positions, segment_ids, routes, replay, *, config):
  return transformer.token_logprobs_routed(params, config, tokens, targets, positions,
                                           segment_ids, routes_RxTxLsxXk=routes,
                                           replay_RxT=replay)


def mismatch(model_dir: str, snapshots: dict[int, dict], *, task, prompts: int,
             group_size: int, max_tokens: int, seed: int = 1) -> list[dict]:
  """Rows of (dtype, lag, routing): see the module docstring."""
  config = hf_schema.load_config(model_dir)
  rows = []
  for dtype in ('float32', 'bfloat16'):
    c = dataclasses.replace(config, dtype=dtype)
    p0 = snapshots[0]
    batch = packed(sample_batch(model_dir, _cast(p0, jnp.zeros((), dtype)), c, task=task,
                                prompts=prompts, group_size=group_size, max_tokens=max_tokens,
                                seed=seed))
    for lag in sorted(snapshots):
      for routing in ROUTINGS:
        rows.append(dict(dtype=dtype, lag=lag, routing=routing,
                         **score(snapshots[lag], c, batch, routing)))
  return rows


# ---------------------------------------------------------------------------------------------
# Learning runs.


def run_row(seed: int, result: dict, target: float, targets) -> dict:
  """One run's table row (`reward_trend.run_row`) with the means of its mismatch metrics."""
  return reward_trend.run_row(seed, result, target, targets,
                              dict(abs_logp_diff='abs_logp_diff',
                                   routes_differ='moe/routes_differ'))


def paired(rows: list[dict]) -> list[dict]:
  """The mismatch rows of one (dtype, lag) side by side: keys suffixed by the routing."""
  out = {}
  for r in rows:
    row = out.setdefault((r['dtype'], r['lag']), dict(dtype=r['dtype'], lag=r['lag']))
    row.update({f"{k}_{r['routing']}": v for k, v in r.items()
                if k not in ('dtype', 'lag', 'routing')})
  return list(out.values())


def plot_mismatch(results: list[dict], path: str, title: str):
  """abs_logp_diff and moe/routes_differ vs samples, per routing: median and min-max band."""
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for routing in ROUTINGS:
    runs = [r['records'] for r in results if r['name'] == routing and r['records']]
    if not runs:
      continue
    xs = [[x['samples'] for x in rec] for rec in runs]
    color = None
    for ax, key in zip(axes, ('abs_logp_diff', 'moe/routes_differ')):
      ys = [metrics_lib.smooth([x[key] for x in rec], ablations.SMOOTH_WINDOW) for rec in runs]
      color = ablations._plot_band(ax, xs, ys, f'{routing} ({len(runs)} seeds)', color)
  axes[0].set(title='|log pi - log mu| of trained tokens (mean of 10 steps)',
              xlabel='samples trained on', yscale='log')
  axes[1].set(title="share of routes whose own top-k is not the sampler's",
              xlabel='samples trained on')
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--preset', default=PRESETS[0], choices=PRESETS,
                      help='the demo MoE (configs/math.py)')
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated RL seeds')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--lags', default='1,2,4,8', help='policies the mismatch part scores with')
  parser.add_argument('--set', action='append', default=[], metavar='SECTION.FIELD=VALUE',
                      help='config override for every run (after --smoke and the budget)')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/moe_replay.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  ablations.add_budget_flags(parser, default_steps=300)
  parser.add_argument('--skip_learning', action='store_true')
  parser.add_argument('--skip_mismatch', action='store_true')
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use('Agg')
  try:
    seeds = learning_speed.parse_seeds(args.seeds)
    lags = sorted({int(k) for k in args.lags.split(',') if k.strip()})
    sets = learning_speed.parse_sets(args.set)
  except ValueError as e:
    parser.error(str(e))
  base = ablations.preset(args.preset)
  base.log.tensorboard = False
  base = ablations.budgeted(parser, args, base)
  try:
    base = ablations.override(base, **sets)
  except (KeyError, TypeError) as e:
    parser.error(f'--set: {e.args[0] if e.args else e}')
  model_dir = ablations.model_dir_for(base)
  workdir = args.workdir or tempfile.mkdtemp(prefix='moe_replay_')
  print(f'device: {jax.devices()[0].device_kind} ({jax.default_backend()}), '
        f'{os.cpu_count()} CPUs, jax {jax.__version__}; model {model_dir}; runs in {workdir}; '
        f'load {os.getloadavg()[0]:.1f}', flush=True)
  report = dict(device=str(jax.devices()[0]), backend=jax.default_backend(),
                cpus=os.cpu_count(), host=platform.node(), jax=jax.__version__, args=vars(args),
                preset=args.preset, model_dir=model_dir, seeds=seeds)
  out = pathlib.Path(args.out)

  if not args.skip_mismatch:
    snapshot_steps = [1, 2] if args.smoke else lags
    snapshots, _ = ablations.policy_snapshots(
        ablations.override(base, seed=seeds[0]), os.path.join(workdir, 'snapshots'), model_dir,
        snapshot_steps)
    snapshots[0] = ablations.warm_start_params(model_dir)
    sizes = dict(prompts=4, group_size=4) if args.smoke else dict(prompts=32, group_size=8)
    rows = mismatch(model_dir, snapshots, task=ablations.task_of(base),
                    max_tokens=base.generation.max_new_tokens, **sizes)
    print('\nmismatch of one batch sampled under policy 0, scored by policy <lag>:')
    print(ablations.table(paired(rows), PAIRED_COLUMNS), flush=True)
    report['mismatch'] = rows

  if not args.skip_learning:
    targets = sorted({*learning_speed.THRESHOLDS, args.target})
    results, rows = [], []
    for seed in seeds:   # outer: load drift hits both routings alike
      for routing in ROUTINGS:
        print(f'--- {routing} seed {seed}', flush=True)
        config = ablations.override(base, seed=seed, model__moe_routing=routing)
        result = ablations.run_once(config, os.path.join(workdir, routing, f'seed{seed}'),
                                    model_dir, name=routing)
        results.append(result)
        rows.append(run_row(seed, result, args.target, targets))
    over_seeds = reward_trend.print_tables(
        rows, LEARNING_COLUMNS, 'mismatch over the steps of each run, and cost', RUN_COLUMNS,
        SEED_COLUMNS, seeds, name_header='routing')
    over = {routing: ablations.to_target_over_seeds([r for r in rows if r['name'] == routing],
                                                    args.target) for routing in ROUTINGS}
    for routing, o in over.items():
      print(f"{routing}: reached {args.target:g} in {o['time_s_stats']['n']}/{len(seeds)} "
            f"seeds, time to target {learning_speed.spread_cell(o['time_s_stats'], '.0f')} s, "
            f"samples {learning_speed.spread_cell(o['samples_stats'], ',.0f')}")
    seeds_text = f"seeds {','.join(map(str, seeds))} (median, min-max band)"
    png = out.with_suffix('.png')
    ablations.plot_comparison(
        results, target=args.target, path=str(png),
        title=f'{args.preset}: routing replay vs recompute, {seeds_text}, '
              f'{os.cpu_count()} CPUs, {jax.default_backend()}')
    mismatch_png = out.with_name(out.stem + '_mismatch.png')
    plot_mismatch(results, str(mismatch_png), f'{args.preset}: train / sampler mismatch, '
                  f'{seeds_text}')
    report.update(runs=rows, over_seeds=over_seeds, to_target=over, png=str(png),
                  mismatch_png=str(mismatch_png),
                  raw={f"{r['name']}/seed{row['seed']}": reward_trend.raw(r['records'])
                       for r, row in zip(results, rows)})
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str) + '\n')
  print(f'\nwrote {out}')


if __name__ == '__main__':
  main()
