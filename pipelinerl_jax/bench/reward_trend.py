"""How much a learning run's reward rose, and against what noise: one computation for every
learning bench (`lora_learning`, `moe_replay`), from the raw per-step rewards each keeps in its
JSON, so that any figure quoted from a bench can be recomputed from that JSON.

A step's reward is the mean over its batch of samples drawn at temperature 1: it swings from
step to step, and a 10-step mean at the end of a short run hides a small rise in that swing.
Two views of the same rewards:
  * the least-squares line of reward against step: its slope per 100 steps, the slope's
    standard error from the residuals, and the line's values at the first and the last step;
  * the means of the first and of the last quarter of the steps, their difference (the rise),
    and the standard error of that difference from the scatter of the rewards within each
    quarter (the noise); rise / noise is how many standard errors the run rose.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import learning_speed

KEYS = ('line_first', 'line_last', 'slope', 'slope_se', 'quarter_first', 'quarter_last', 'rise',
        'noise', 'rise_over_noise')
# For ablations.table: (header, key, format).
COLUMNS = (('line_first', 'line_first', '.3f'), ('line_last', 'line_last', '.3f'),
           ('slope/100', 'slope', '+.3f'), ('se', 'slope_se', '.3f'),
           ('q1_mean', 'quarter_first', '.3f'), ('q4_mean', 'quarter_last', '.3f'),
           ('rise', 'rise', '+.3f'), ('noise', 'noise', '.3f'),
           ('rise/noise', 'rise_over_noise', '.1f'))
RAW_KEYS = ('step', 'time_s', 'samples', 'reward_mean')


def raw(records: Sequence[dict[str, Any]]) -> dict[str, list]:
  """The per-step values the trend is computed from, as lists (what a bench's JSON keeps)."""
  return {key: [r[key] for r in records] for key in RAW_KEYS}


def trend(steps: Sequence[float], rewards: Sequence[float]) -> dict[str, float]:
  """The module docstring's numbers for one run; NaN where the run is too short (the line needs
  3 steps, the quarters 2 steps each)."""
  step = np.asarray(steps, np.float64)
  reward = np.asarray(rewards, np.float64)
  if step.shape != reward.shape:
    raise ValueError(f'{step.size} steps but {reward.size} rewards')
  out = dict.fromkeys(KEYS, math.nan)
  if step.size >= 3:
    slope, intercept = np.polyfit(step, reward, 1)
    residual = reward - (slope * step + intercept)
    se = math.sqrt(residual.var(ddof=2) / ((step - step.mean()) ** 2).sum())
    out.update(slope=100 * float(slope), slope_se=100 * se,
               line_first=float(slope * step[0] + intercept),
               line_last=float(slope * step[-1] + intercept))
  quarter = step.size // 4
  if quarter >= 2:
    first, last = reward[:quarter], reward[-quarter:]
    rise = float(last.mean() - first.mean())
    noise = math.sqrt(first.var(ddof=1) / quarter + last.var(ddof=1) / quarter)
    out.update(quarter_first=float(first.mean()), quarter_last=float(last.mean()), rise=rise,
               noise=noise, rise_over_noise=rise / noise if noise > 0 else math.nan)
  return out


def of_records(records: Sequence[dict[str, Any]]) -> dict[str, float]:
  """`trend` of a run's metrics records."""
  return trend([r['step'] for r in records], [r['reward_mean'] for r in records])


def run_row(seed: int, result: dict[str, Any], target: float, targets: Sequence[float],
            means: dict[str, str]) -> dict[str, Any]:
  """One learning run's table row: `ablations.summarize`, the reward trend, the time and samples
  to `target`, the load, and for each {column: metric} of `means` the metric's mean over the
  run's steps."""
  records = result['records']
  summary = ablations.summarize(result, targets)
  reached = summary['to_target'][f'{target:g}']
  return dict(summary, **of_records(records), seed=seed,
              t_target=reached and reached['time_s'], s_target=reached and reached['samples'],
              ess_mean=summary['ess']['mean'],
              load=(summary['load_before'] + summary['load_after']) / 2,
              **{column: float(np.mean([r[key] for r in records])) if records else float('nan')
                 for column, key in means.items()})


def over_seeds(rows: Sequence[dict[str, Any]], keys: Sequence[str] = KEYS
               ) -> dict[str, dict[str, Any]]:
  """Per key, `ablations.seed_stats` (median, min, max, n) over the rows (one per seed) that
  have a value."""
  finite = lambda v: None if v is None or math.isnan(v) else v
  return {key: ablations.seed_stats([finite(r.get(key)) for r in rows]) for key in keys}


def seed_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """One line per setting (the rows' 'name', one row per seed), each of `columns` (header, key,
  format) a cell 'median [min-max]' over that setting's seeds, for `ablations.table` with
  `text_columns(columns)`; and those statistics, per setting and key, for the JSON."""
  text, stats = [], {}
  for name in dict.fromkeys(r['name'] for r in rows):
    mine = [r for r in rows if r['name'] == name]
    stats[name] = over_seeds(mine, [key for _, key, _ in columns])
    text.append({'name': name, 'seeds': len(mine),
                 **{key: learning_speed.spread_cell(stats[name][key], fmt)
                    for _, key, fmt in columns}})
  return text, stats


def text_columns(columns: Sequence[tuple[str, str, str]], name_header: str = 'run'
                 ) -> tuple[tuple[str, str, str], ...]:
  """`ablations.table` columns for `seed_table`'s text rows."""
  return ((name_header, 'name', 's'), ('seeds', 'seeds', 'd'),
          *((header, key, 's') for header, key, _ in columns))


def print_tables(rows: Sequence[dict[str, Any]], learning_columns, other_title: str,
                 other_columns, seed_columns, seeds: Sequence[int], name_header: str = 'run'
                 ) -> dict[str, Any]:
  """A learning bench's tables, one row per run: the learning columns (with the trend), the
  bench's other columns under `other_title`, then `seed_table` over `seeds`. Returns the
  over-seeds statistics for the JSON."""
  print('\nlearning (reward per step; trend: bench/reward_trend.py):')
  print(ablations.table(rows, learning_columns))
  print(f'\n{other_title}:')
  print(ablations.table(rows, other_columns))
  seed_text, stats = seed_table(rows, seed_columns)
  print(f'\nover seeds {list(seeds)} (median [min-max]):')
  print(ablations.table(seed_text, text_columns(seed_columns, name_header)))
  return stats
