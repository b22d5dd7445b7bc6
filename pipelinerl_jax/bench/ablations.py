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
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import run as run_lib
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


def smoke(config: ml_collections.ConfigDict, cache_dir: str = '') -> ml_collections.ConfigDict:
  """Seconds instead of minutes, for tests: an untrained demo model (no SFT, built in seconds),
  16 samples per step, 16 slots. The numbers mean nothing; the code paths are the real ones."""
  c = override(config, rl__batch_size=16, generation__num_slots=16, rl__max_time_s=0.0,
               rl__total_steps=3, log__tensorboard=False, log__progress=False)
  c.model.demo.max_steps = 0
  c.model.demo.eval_problems = 8
  if cache_dir:
    c.model.cache_dir = cache_dir
  return c


def mode_config(config: ml_collections.ConfigDict, mode: str, conventional_slots: str = 'batch'
                ) -> ml_collections.ConfigDict:
  """'pipeline' or 'conv<k>' (conventional RL, k optimizer steps per generated batch).

  conventional_slots='batch' gives the conventional engine H = k*B slots: it generates its
  whole batch of k*B samples at once, which is why conventional RL raises k at all (a larger
  generation batch keeps the accelerators busy); 'same' keeps the pipeline's H.
  """
  if mode == 'pipeline':
    return override(config, rl__mode='pipeline')
  if not mode.startswith('conv') or not mode[4:].isdigit() or int(mode[4:]) < 1:
    raise ValueError(f"mode {mode!r}: expected 'pipeline' or 'conv<k>' like 'conv4'")
  k = int(mode[4:])
  c = override(config, rl__mode='conventional', rl__conventional_steps=k)
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
  summary = run_lib.run(config, workdir, model_dir=model_dir)
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
  """Best conventional time-to-target / pipeline time-to-target, as `summarize` dicts.

  A mode that never reaches the target has no time: if the pipeline does and no conventional
  mode does, the ratio is unknown but at least (shortest conventional run time) / (pipeline
  time): `value` is None and `lower_bound` holds that. If the pipeline never reaches it,
  `value` is None too and there is no bound.
  """
  key = f'{target:g}'
  pipe = pipeline['to_target'][key]
  reached = [(c['to_target'][key]['time_s'], c['name']) for c in conventional
             if c['to_target'][key] is not None]
  out = dict(target=target, value=None, lower_bound=None, best_conventional=None, note='')
  if pipe is None:
    out['note'] = f'pipeline never reached {target:g}: no speedup can be given'
  elif reached:
    best_time, best_name = min(reached)
    out.update(value=best_time / pipe['time_s'], best_conventional=best_name)
    out['note'] = f'{best_name} took {best_time:.0f} s, pipeline {pipe["time_s"]:.0f} s'
  elif conventional:
    shortest = min(conventional, key=lambda c: c['time_s'])
    out.update(lower_bound=shortest['time_s'] / pipe['time_s'])
    out['note'] = (f'no conventional mode reached {target:g} within its budget: the speedup is '
                   f'at least {out["lower_bound"]:.2f} (shortest conventional run / pipeline '
                   'time to target)')
  return out


# ---------------------------------------------------------------------------------------------
# Plots.


def plot_comparison(results: Sequence[dict[str, Any]], target: float | None = None,
                    title: str = '', path: str | None = None):
  """Paper Fig. 1/4 style: smoothed reward vs wall-clock time and vs samples, one curve per
  run; then ESS and mean lag vs samples. `results` are `run_once` results. Returns the figure."""
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
  for res in results:
    records = res['records']
    if not records:
      continue
    t = [r['time_s'] for r in records]
    s = [r['samples'] for r in records]
    smooth = smoothed_rewards(records)
    line, = axes[0].plot(t, smooth, label=res['name'])
    axes[1].plot(s, smooth, color=line.get_color(), label=res['name'])
    axes[2].plot(s, metrics_lib.smooth([r['ess'] for r in records], PERIODIC_WINDOW),
                 color=line.get_color(), label=res['name'])
    axes[3].plot(s, metrics_lib.smooth([r['lag_mean'] for r in records], PERIODIC_WINDOW),
                 color=line.get_color(), label=f"{res['name']} (max {res['max_lag_seen']})")
  axes[0].set(title=f'reward (mean of {SMOOTH_WINDOW} steps) vs time', xlabel='seconds of RL',
              ylabel='reward')
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
  result = run_lib.run(c, workdir, model_dir=model_dir, on_ready=on_ready)
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
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  model_config = hf_io.load_config(model_dir)
  problems = task.problems(seed)
  prompts = [tokenizer.encode(next(problems).prompt, add_special_tokens=False)
             for _ in range(num_prompts)]
  sampling = api.SamplingParams(temperature=1.0, max_tokens=max_new_tokens)
  requests = [api.Request(f'{i}/{j}', p, sampling, seed=seed * 1_000_003 + i * 1000 + j)
              for i, p in enumerate(prompts) for j in range(samples_per_prompt)]
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
  return jax.device_get(hf_io.load_params(model_dir, hf_io.load_config(model_dir)))
