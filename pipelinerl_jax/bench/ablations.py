"""Shared code of the learning-speed benchmark and the colabs/ notebooks: configs for each
mode, one RL run -> a compact result, time-to-target, comparison plots, and the stale-KV
experiment of the paper's section 5.1.

Everything a notebook computes goes through here, so the notebooks stay a page of parameters,
calls and plots, and the benchmark and the notebooks measure the same thing the same way.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import time
from typing import Any, Iterable, Sequence

import jax
import ml_collections
import numpy as np

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.bench import throughput_model
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.tasks import registry

SMOOTH_WINDOW = 10   # rewards swing +-0.1 step to step: targets are on a 10-step trailing mean
# ESS and lag of conv<k> repeat every k steps (lag 0..k-1): a window that is a multiple of
# every k plotted (1, 2, 4, 8) shows their level instead of an aliased sawtooth.
PERIODIC_WINDOW = 40


# ---------------------------------------------------------------------------------------------
# Configs.


def preset(name: str = 'tiny') -> ml_collections.ConfigDict:
  """configs/math.py:<name>."""
  return config_lib.load_preset(name)


def override(config: ml_collections.ConfigDict, **dotted: Any) -> ml_collections.ConfigDict:
  """A copy with `rl__mode='conventional'`-style overrides ('__' separates sections)."""
  c = ml_collections.ConfigDict(config.to_dict())
  for key, value in dotted.items():
    *sections, field = key.split('__')
    node = c
    for s in sections:
      node = node[s]
    if field not in node:
      raise KeyError(f'config has no {".".join(sections + [field])}')
    node[field] = value
  return c


SMOKE_STEPS = 3


def smoke(config: ml_collections.ConfigDict, cache_dir: str = '') -> ml_collections.ConfigDict:
  """Seconds instead of minutes, for tests: an untrained demo model (no SFT, built in seconds),
  16 samples per step, 16 slots. The numbers mean nothing; the code paths are the real ones."""
  c = override(config, rl__batch_size=16, generation__num_slots=16, rl__max_time_s=0.0,
               rl__total_steps=SMOKE_STEPS, log__tensorboard=False, log__progress=False)
  c.model.demo.max_steps = 0
  c.model.demo.eval_problems = 8
  if cache_dir:
    c.model.cache_dir = cache_dir
  return c


def add_budget_flags(parser, default_steps: int) -> None:
  """A learning bench's run budget: --steps (the same optimizer steps for every arm), --budget_s
  (a wall-clock cap), --smoke (seconds: an untrained model, small batches, few steps) and
  --cache_dir (the demo model's). `budgeted` applies them."""
  parser.add_argument('--steps', type=int, default=None,
                      help=f'optimizer steps per run (default {default_steps}, --smoke '
                      f'{SMOKE_STEPS}; 0 = only the wall-clock cap)')
  parser.add_argument('--budget_s', type=float, default=0.0,
                      help='wall-clock cap per run, compilation included (0 = none)')
  parser.add_argument('--cache_dir', default='', help="demo model cache ('' = the default)")
  parser.add_argument('--smoke', action='store_true',
                      help='seconds: an untrained model, small batches, --steps steps')
  parser.set_defaults(default_steps=default_steps)


def budgeted(parser, args, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with `add_budget_flags`' flags applied (a bad budget: parser.error)."""
  if args.steps is None:
    args.steps = SMOKE_STEPS if args.smoke else args.default_steps
  if args.steps < 0 or args.budget_s < 0 or not (args.steps or args.budget_s):
    parser.error('--steps and --budget_s must be >= 0, and one of them > 0')
  c = override(config)
  if args.cache_dir:
    c.model.cache_dir = args.cache_dir
  if args.smoke:
    c = smoke(c, args.cache_dir)
  c.rl.total_steps, c.rl.max_time_s = args.steps or 10**7, args.budget_s
  return c


def budget_text(args) -> str:
  """'300 steps', '600 s' or both: what stops each run."""
  return ' and '.join(([f'{args.steps} steps'] if args.steps else [])
                      + ([f'{args.budget_s:.0f} s'] if args.budget_s else []))


PER_CORE = '-percore'   # conv<k>-percore: one generator actor pinned to each core


def _cores_for(mode: str) -> int:
  cores = len(os.sched_getaffinity(0))
  if cores < 2:
    raise ValueError(f'mode {mode!r} needs 2 or more cores, this process has {cores}')
  return cores


def mode_config(config: ml_collections.ConfigDict, mode: str, conventional_slots: str = 'batch'
                ) -> ml_collections.ConfigDict:
  """'pipeline', 'pipeline-disjoint', 'conv<k>' or 'conv<k>-percore' (conventional RL, k
  optimizer steps per generated batch).

  'pipeline' runs its generator in the trainer's process, both using every core (shared);
  'pipeline-disjoint' runs it as a Ray actor pinned to half of this process's cores and pins
  the trainer to the other half (train.cores='free'), so that the two never share a core.
  'conv<k>' generates and trains in turn in one process, each phase on every core;
  'conv<k>-percore' generates with one Ray actor pinned to each core (the JAX engine's decode
  does not use a second core, N engines use N) and trains on every core in between.
  conventional_slots='batch' gives the conventional engines H = k*B slots in all: they generate
  the whole batch of k*B samples at once, which is why conventional RL raises k at all (a larger
  generation batch keeps the accelerators busy); 'same' keeps the pipeline's H.
  """
  if mode == 'pipeline':
    return override(config, rl__mode='pipeline')
  if mode == throughput_model.DISJOINT_MODE:
    cores = _cores_for(mode)
    return override(config, rl__mode='pipeline', generation__placement='ray',
                    generation__num_generators=1,
                    generation__remote__cpus_per_generator=cores // 2, train__cores='free',
                    cluster__num_cpus=cores)
  k_text = mode[4:].removesuffix(PER_CORE)
  if not throughput_model.is_conventional(mode) or not k_text.isdigit() or int(k_text) < 1:
    raise ValueError(f"mode {mode!r}: expected 'pipeline', 'pipeline-disjoint', 'conv<k>' or "
                     "'conv<k>-percore' like 'conv4'")
  k = int(k_text)
  c = override(config, rl__mode='conventional', rl__conventional_steps=k)
  if mode.endswith(PER_CORE):
    cores = _cores_for(mode)
    c = override(c, generation__placement='ray', generation__num_generators=cores,
                 cluster__num_cpus=cores)
  if conventional_slots == 'batch':
    c.generation.num_slots = k * c.rl.batch_size
  elif conventional_slots != 'same':
    raise ValueError(f"conventional_slots must be 'batch' or 'same', got {conventional_slots!r}")
  return c


def task_of(config: ml_collections.ConfigDict):
  """The task a run of this config trains on (arithmetic: no tokenizer needed)."""
  return registry.make_task(config_lib.validate(config).task)


def model_dir_for(config: ml_collections.ConfigDict) -> str:
  """The warm-started demo model of this config (built once into the cache)."""
  return warmstart.model_dir_for(config_lib.validate(config))


# ---------------------------------------------------------------------------------------------
# One run and what is kept of it.


def run_once(config: ml_collections.ConfigDict, workdir: str, model_dir: str,
             name: str = '') -> dict[str, Any]:
  """One RL run; returns its records and counters (not its final weights), and the host load
  before and after, because a shared machine's load changes how fast a run goes."""
  load_before = os.getloadavg()[0]
  t0 = time.monotonic()
  summary = launch.run_experiment(config, workdir, model_dir=model_dir)
  summary.pop('final_state', None)
  summary.update(name=name or config.rl.mode, wall_s=time.monotonic() - t0,
                 load_before=load_before, load_after=os.getloadavg()[0],
                 mode=config.rl.mode, conventional_steps=config.rl.conventional_steps,
                 num_slots=config.generation.num_slots, max_lag=config.rl.max_lag,
                 batch_size=config.rl.batch_size, is_cap=config.loss.is_cap)
  return summary


def smoothed_rewards(records: Sequence[dict]) -> list[float]:
  return metrics_lib.smooth([r['reward_mean'] for r in records], SMOOTH_WINDOW)


def time_to_target(records: Sequence[dict], target: float) -> dict[str, Any] | None:
  """First step where the 10-step trailing mean reward is >= target (needs 10 steps, so one
  lucky batch does not count): {time_s, samples, step}; None if never reached."""
  for i, (r, reward) in enumerate(zip(records, smoothed_rewards(records))):
    if i + 1 >= SMOOTH_WINDOW and reward >= target:
      return dict(time_s=r['time_s'], samples=r['samples'], step=r['step'])
  return None


def _stats(values: Sequence[float]) -> dict[str, float]:
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return dict(mean=math.nan, min=math.nan, max=math.nan)
  return dict(mean=float(v.mean()), min=float(v.min()), max=float(v.max()))


def summarize(result: dict[str, Any], targets: Iterable[float]) -> dict[str, Any]:
  """The numbers a comparison table needs, from one `run_once` result."""
  records = result['records']
  smooth = smoothed_rewards(records)
  last = records[-1] if records else {}
  return dict(
      name=result['name'], mode=result['mode'], conventional_steps=result['conventional_steps'],
      num_slots=result['num_slots'], max_lag=result['max_lag'], is_cap=result['is_cap'],
      steps=result['steps'], samples=result['samples'], time_s=last.get('time_s', 0.0),
      tokens=throughput_model.trained_tokens(records),
      first_step_s=records[0]['time_s'] if records else None,
      reward_first=records[0]['reward_mean'] if records else None,
      reward_final=smooth[-1] if smooth else None,
      reward_best=max(smooth[SMOOTH_WINDOW - 1:], default=None),
      to_target={f'{t:g}': time_to_target(records, t) for t in targets},
      ess=_stats([r['ess'] for r in records]),
      lag_min=min((r['lag_min'] for r in records), default=None),
      lag_mean=_stats([r['lag_mean'] for r in records])['mean'],
      lag_max=max((r['lag_max'] for r in records), default=None),
      frac_is_capped=_stats([r.get('frac_is_capped', 0.0) for r in records])['mean'],
      frac_hit_length_limit=_stats([r.get('frac_hit_length_limit', 0.0) for r in records])['mean'],
      frac_multi_version=_stats([r.get('frac_multi_version', 0.0) for r in records])['mean'],
      stale_dropped=result['stale_dropped'],
      samples_per_s=result['samples'] / last['time_s'] if records else None,
      # Every mode runs the same train step (B samples, same shapes): its duration is a gauge
      # of how much CPU the run got on a shared machine, for comparing runs made at different times.
      train_step_s=result['train_busy_s'] / result['steps'] if result['steps'] else None,
      gen_busy_s=result['gen_busy_s'], train_busy_s=result['train_busy_s'],
      overlap_s=result['gen_train_overlap_s'],
      load_before=result['load_before'], load_after=result['load_after'])


def speedup(pipeline: dict[str, Any], conventional: Sequence[dict[str, Any]], target: float
            ) -> dict[str, Any]:
  """Best conventional time-to-target / pipeline time-to-target, as `summarize` dicts of one
  seed each: `speedup_over_seeds` with one seed.

  A mode that never reaches the target has no time: if the pipeline does and no conventional
  mode does, the ratio is unknown but at least (shortest conventional run time) / (pipeline
  time): `value` is None and `lower_bound` holds that. If the pipeline never reaches it,
  `value` is None too and there is no bound.
  """
  return speedup_over_seeds([pipeline], {c['name']: [c] for c in conventional}, target)


# ---------------------------------------------------------------------------------------------
# Several seeds of each mode: the spread of time to target, and of the speedup.


def seed_stats(values: Sequence[float | None]) -> dict[str, Any]:
  """Median, min and max over the seeds that have a value (None: the target was never reached
  in that seed), `n` such seeds out of `seeds`. median/min/max are None when n is 0."""
  reached = [float(v) for v in values if v is not None]
  if not reached:
    return dict(median=None, min=None, max=None, n=0, seeds=len(values))
  return dict(median=float(np.median(reached)), min=min(reached), max=max(reached),
              n=len(reached), seeds=len(values))


def to_target_over_seeds(summaries: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
  """One mode's `summarize` dicts, one per seed: time and samples to target per seed (None where
  never reached), and their `seed_stats`."""
  hits = [s['to_target'][f'{target:g}'] for s in summaries]
  time_s = [None if h is None else h['time_s'] for h in hits]
  samples = [None if h is None else h['samples'] for h in hits]
  return dict(time_s=time_s, samples=samples, time_s_stats=seed_stats(time_s),
              samples_stats=seed_stats(samples))


def speedup_over_seeds(pipeline: Sequence[dict[str, Any]],
                       conventional: dict[str, Sequence[dict[str, Any]]], target: float,
                       name: str = 'pipeline') -> dict[str, Any]:
  """Speedup of the pipeline over the best conventional mode, with its spread over seeds.
  `name`: the pipeline's mode, as the notes call it (e.g. 'pipeline-disjoint').

  `pipeline` holds `summarize` dicts, one per seed; `conventional` maps each mode's name to
  its dicts for the same seeds in the same order. The best conventional mode has the lowest
  median time to target among those that reached it in every seed; `value` = its median /
  the pipeline's median. The spread is the per-seed ratio (conventional / pipeline time of
  the same seed): `per_seed_ratios` (None where either side missed), `ratio_min`,
  `ratio_max`, and `spread_crosses_1` (the spread includes 1.0: some seed shows no speedup).

  The fallbacks lean against the pipeline, never for it:
  - no conventional mode reached the target in every seed: the best is the lowest median
    among those that reached it in the most seeds; a median over only its lucky seeds
    understates its time, hence the speedup.
  - the pipeline missed a seed: `value` is None, since a median over the seeds it reached
    would overstate it (the per-seed ratios are still given).
  - no conventional mode ever reached it, the pipeline in every seed: `value` is None and
    `lower_bound` = (lowest median conventional run time) / (pipeline median time).
  `note` says which case applies.
  """
  key = f'{target:g}'
  pipe_times = to_target_over_seeds(pipeline, target)['time_s']
  pipe_stats = seed_stats(pipe_times)
  num_seeds = len(pipe_times)
  out = dict(target=target, seeds=num_seeds, value=None, lower_bound=None,
             best_conventional=None, pipeline_time_s=pipe_stats, best_conventional_time_s=None,
             per_seed_ratios=[], ratio_min=None, ratio_max=None, spread_crosses_1=None, note='')
  if not conventional:
    out['note'] = 'no conventional mode to compare with'
    return out
  if pipe_stats['n'] == 0:
    out['note'] = f'{name} never reached {key}: no speedup can be given'
    return out
  conv_times = {name: to_target_over_seeds(runs, target)['time_s']
                for name, runs in conventional.items()}
  conv_stats = {name: seed_stats(times) for name, times in conv_times.items()}
  most_seeds = max(s['n'] for s in conv_stats.values())
  pipe_missed = (f'{name} reached {key} in {pipe_stats["n"]} of {num_seeds} seeds: no '
                 'value, a median over those would flatter it')
  if most_seeds == 0:
    if pipe_stats['n'] < num_seeds:
      out['note'] = pipe_missed + '; no conventional mode reached it at all'
      return out
    shortest = min(float(np.median([c['time_s'] for c in runs]))
                   for runs in conventional.values())
    out['lower_bound'] = shortest / pipe_stats['median']
    out['note'] = (f'no conventional mode reached {key} within its budget: the speedup is at '
                   f'least {out["lower_bound"]:.2f} (shortest median conventional run / '
                   f'{name} median time to target)')
    return out

  best = min((s['median'], name) for name, s in conv_stats.items() if s['n'] == most_seeds)[1]
  ratios = [None if c is None or p is None else c / p
            for c, p in zip(conv_times[best], pipe_times)]
  ratio_stats = seed_stats(ratios)
  out.update(best_conventional=best, best_conventional_time_s=conv_stats[best],
             per_seed_ratios=ratios, ratio_min=ratio_stats['min'], ratio_max=ratio_stats['max'],
             spread_crosses_1=(None if ratio_stats['n'] == 0
                               else ratio_stats['min'] <= 1.0 <= ratio_stats['max']))
  notes = []
  if most_seeds < num_seeds:
    notes.append(f'no conventional mode reached {key} in every seed: {best} has the lowest '
                 f'median of those that reached it in the most ({most_seeds} of {num_seeds}), '
                 'over those seeds only, which understates the speedup')
  if pipe_stats['n'] < num_seeds:
    notes.append(pipe_missed)
  else:
    out['value'] = conv_stats[best]['median'] / pipe_stats['median']
    notes.append(f'{best} took {conv_stats[best]["median"]:.0f} s, {name} '
                 f'{pipe_stats["median"]:.0f} s' + (' (medians)' if num_seeds > 1 else ''))
  out['note'] = '; '.join(notes)
  return out


# ---------------------------------------------------------------------------------------------
# Plots.


def median_band(xs: Sequence[Sequence[float]], ys: Sequence[Sequence[float]],
                num_points: int = 200) -> tuple[np.ndarray, ...]:
  """Several seeds' curves y(x) as (grid, median, low, high) on a common grid: the x range that
  every seed covers (no seed is extrapolated), each curve linearly interpolated onto it. A lone
  curve comes back on its own x; empty arrays when the seeds share no range. x increasing."""
  curves = [(np.asarray(x, np.float64), np.asarray(y, np.float64))
            for x, y in zip(xs, ys) if len(x)]
  if not curves:
    return tuple(np.zeros(0) for _ in range(4))
  if len(curves) == 1:
    x, y = curves[0]
    return x, y, y, y
  start, stop = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
  if stop < start:
    return tuple(np.zeros(0) for _ in range(4))
  grid = np.linspace(start, stop, num_points)
  y_SxN = np.stack([np.interp(grid, x, y) for x, y in curves])
  return grid, np.median(y_SxN, axis=0), y_SxN.min(axis=0), y_SxN.max(axis=0)


def _plot_band(ax, xs, ys, label: str, color=None):
  """One setting's curve on `ax`: the median over seeds and, for several, a min-max band."""
  grid, median, low, high = median_band(xs, ys)
  line, = ax.plot(grid, median, color=color, label=label)
  if len(xs) > 1:
    ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2, lw=0)
  return line.get_color()


def plot_comparison(results: Sequence[dict[str, Any]], target: float | None = None,
                    title: str = '', path: str | None = None):
  """Paper Fig. 1/4 style: smoothed reward vs wall-clock time and vs samples, one curve per
  run; then ESS and mean lag vs samples. `results` are `run_once` results. Runs that share a
  name are seeds of one setting: drawn as their median with a shaded min-max band
  (`median_band`). Returns the figure."""
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
  runs_by_name: dict[str, list[dict[str, Any]]] = {}
  for res in results:
    if res['records']:
      runs_by_name.setdefault(res['name'], []).append(res)
  for name, runs in runs_by_name.items():
    records = [r['records'] for r in runs]
    t = [[x['time_s'] for x in rec] for rec in records]
    s = [[x['samples'] for x in rec] for rec in records]
    reward = [smoothed_rewards(rec) for rec in records]
    ess = [metrics_lib.smooth([x['ess'] for x in rec], PERIODIC_WINDOW) for rec in records]
    lag = [metrics_lib.smooth([x['lag_mean'] for x in rec], PERIODIC_WINDOW) for rec in records]
    label = name if len(runs) == 1 else f'{name} ({len(runs)} seeds)'
    color = _plot_band(axes[0], t, reward, label)
    _plot_band(axes[1], s, reward, label, color)
    _plot_band(axes[2], s, ess, label, color)
    max_lag = max(r['max_lag_seen'] for r in runs)
    _plot_band(axes[3], s, lag, f'{label} (max {max_lag})', color)
  seeds_note = ('; median, min-max over seeds'
                if any(len(runs) > 1 for runs in runs_by_name.values()) else '')
  axes[0].set(title=f'reward (mean of {SMOOTH_WINDOW} steps) vs time{seeds_note}',
              xlabel='seconds of RL', ylabel='reward')
  axes[1].set(title='reward vs samples', xlabel='samples trained on')
  axes[2].set(title=f'ESS (eq. 6), mean of {PERIODIC_WINDOW} steps', xlabel='samples trained on',
              ylim=(None, 1.005))
  axes[3].set(title=f'mean token lag, mean of {PERIODIC_WINDOW} steps', xlabel='samples trained on',
              ylabel='optimizer steps')
  if target is not None:
    for ax in axes[:2]:
      ax.axhline(target, color='gray', ls=':', lw=1)
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  if path:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
  return fig


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
  """Fixed-width text table: columns are (header, key, format); None prints as '-'."""
  def cell(value, fmt):
    if value is None or (isinstance(value, float) and math.isnan(value)):
      return '-'
    return format(value, fmt)
  cells = [[cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
  widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(columns)]
  lines = ['  '.join(h.rjust(w) for (h, _, _), w in zip(columns, widths)),
           '  '.join('-' * w for w in widths)]
  lines += ['  '.join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# Stale vs recomputed KV cache after an in-flight update (paper section 5.1).


def policy_snapshots(config: ml_collections.ConfigDict, workdir: str, model_dir: str,
                     versions: Sequence[int]) -> tuple[dict[int, Any], dict[str, Any]]:
  """Params after each of `versions` optimizer steps of a real pipeline RL run from the warm
  start, plus that run's result: the consecutive policies an in-flight update switches between.

  They are taken where the trainer hands them to the engine (`update_params`), which always
  gets a fresh copy the trainer never donates, so keeping a reference is safe.
  """
  wanted = set(versions)
  snapshots: dict[int, Any] = {}

  def on_ready(live):
    engine = live['engine']
    publish = engine.update_params

    def recording_publish(params, version):
      if version in wanted:
        snapshots[version] = jax.device_get(params)
      publish(params, version)
    engine.update_params = recording_publish

  c = override(config, rl__mode='pipeline', rl__total_steps=max(versions), rl__max_time_s=0.0)
  result = launch.run_experiment(c, workdir, model_dir=model_dir, on_ready=on_ready)
  result.pop('final_state', None)
  missing = wanted - snapshots.keys()
  if missing:
    raise RuntimeError(f'versions {sorted(missing)} were never published')
  return snapshots, result


def _generate_with_update(model_config, params_old, params_new, engine_config, requests,
                          update_after: int | None):
  """Runs `requests` (all in slots at once) under params_old; after `update_after` token steps
  the engine switches to params_new (None: never). Completions in request order."""
  with jax_engine.JaxEngine(model_config, params_old, engine_config) as engine:
    for r in requests:
      engine.submit(r)
    done, steps = {}, 0
    while engine.num_unfinished:
      if update_after is not None and steps == update_after:
        engine.update_params(params_new, 1)
      for c in engine.step():
        done[c.request_id] = c
      steps += 1
  return [done[r.request_id] for r in requests]


@functools.partial(jax.jit, static_argnames=('config',))
def _token_logprobs_jit(params, inputs, targets, positions, segment_ids, *, config):
  return transformer.token_logprobs(params, config, inputs, targets, positions, segment_ids)


def _token_logprobs(params, config, *arrays):
  return _token_logprobs_jit(params, *arrays, config=config)


def _logprobs_under(params, model_config, completions) -> list[np.ndarray]:
  """log pi(token) of each completion token under `params`, by one full forward (no cache)."""
  rows = [list(c.prompt_tokens) + [int(t) for t in c.tokens] for c in completions]
  width = max(len(r) for r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  seg = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
    seg[i, :len(r)] = 1
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = np.broadcast_to(np.arange(width - 1), inputs.shape)
  logp, _ = _token_logprobs(params, model_config, inputs, targets, positions, seg[:, :-1])
  logp = np.asarray(logp)
  out = []
  for i, c in enumerate(completions):
    start = len(c.prompt_tokens) - 1   # position predicting the first completion token
    out.append(logp[i, start:start + len(c.tokens)])
  return out


def divergence(behaviour: Sequence[np.ndarray], target: Sequence[np.ndarray],
               from_token: int = 0) -> dict[str, float]:
  """How far sequences sampled from mu are from pi, per token, over tokens >= from_token:
  kl = mean(log mu - log pi) (KL(mu||pi), unbiased), k3 = mean(w - 1 - log w) with w = pi/mu
  (same expectation, never negative), and the normalized ESS of w (paper eq. 6)."""
  mu = np.concatenate([b[from_token:] for b in behaviour]).astype(np.float64)
  pi = np.concatenate([t[from_token:] for t in target]).astype(np.float64)
  if mu.size == 0:
    return dict(kl=math.nan, k3=math.nan, ess=math.nan, tokens=0)
  log_w = pi - mu
  w = np.exp(log_w)
  return dict(kl=float(np.mean(-log_w)), k3=float(np.mean(w - 1 - log_w)),
              ess=float(w.sum() ** 2 / (w.size * (w ** 2).sum())), tokens=int(mu.size))


def task_requests(model_dir: str, task, num_prompts: int, samples_per_prompt: int,
                  max_new_tokens: int, seed: int) -> tuple[Any, list[api.Request]]:
  """(the model's tokenizer, requests): `num_prompts` of the task's problems, each
  `samples_per_prompt` times with its own seed, sampled at temperature 1."""
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  problems = task.problems(seed)
  prompts = [tokenizer.encode(next(problems).prompt, add_special_tokens=False)
             for _ in range(num_prompts)]
  sampling = api.SamplingParams(temperature=1.0, max_tokens=max_new_tokens)
  return tokenizer, [api.Request(f'{i}/{j}', p, sampling, seed=seed * 1_000_003 + i * 1000 + j)
                     for i, p in enumerate(prompts) for j in range(samples_per_prompt)]


def stale_kv_experiment(model_dir: str, snapshots: dict[int, Any], task, *,
                        num_prompts: int = 64, samples_per_prompt: int = 8,
                        update_after: Sequence[int] = (1, 4, 8), max_new_tokens: int = 12,
                        max_prompt_len: int = 8, seed: int = 1) -> list[dict[str, Any]]:
  """For each lag d (key of `snapshots`; 0 = the warm start) and update point m: sample the
  same prompts and seeds three ways, all starting under policy 0, and measure each batch's
  divergence from the on-policy distribution of policy d (log pi_d by a full forward):

    no update     policy 0 throughout (conventional RL, d steps later)
    stale KV      switch to policy d after m tokens, keep the KV cache of policy 0 (PipelineRL)
    recompute KV  switch after m tokens and re-prefill the cache under policy d

  Tokens before the switch are identical in the three; `*_after` columns measure only tokens
  sampled after it, where stale and recomputed KV differ.
  """
  tokenizer, requests = task_requests(model_dir, task, num_prompts, samples_per_prompt,
                                      max_new_tokens, seed)
  model_config = hf_schema.load_config(model_dir)
  rows = []
  old = jax.device_put(snapshots[0])
  for lag in sorted(d for d in snapshots if d > 0):
    new = jax.device_put(snapshots[lag])
    for m in update_after:
      row = dict(lag=lag, update_after=m)
      for variant, recompute, switch in (('no_update', False, None), ('stale_kv', False, m),
                                         ('recompute_kv', True, m)):
        engine_config = jax_engine.EngineConfig(
            num_slots=len(requests), max_seq_len=max_prompt_len + max_new_tokens,
            eos_token_ids=(warmstart.eos_id(tokenizer),), recompute_kv=recompute)
        completions = _generate_with_update(model_config, old, new, engine_config, requests,
                                            switch)
        behaviour = [c.logprobs for c in completions]
        on_policy = _logprobs_under(new, model_config, completions)
        whole, after = divergence(behaviour, on_policy), divergence(behaviour, on_policy, m)
        row.update({f'{variant}_kl': whole['kl'], f'{variant}_k3': whole['k3'],
                    f'{variant}_ess': whole['ess'], f'{variant}_kl_after': after['kl'],
                    f'{variant}_k3_after': after['k3'], 'tokens_after': after['tokens']})
      rows.append(row)
  return rows


def warm_start_params(model_dir: str):
  """The model's params on the host (policy 0 of `stale_kv_experiment`)."""
  return jax.device_get(hf_checkpoint.load_params(model_dir, hf_schema.load_config(model_dir)))
