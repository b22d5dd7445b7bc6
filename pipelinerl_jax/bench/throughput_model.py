"""Model vs measurement: the throughput simulator (sim/throughput.py, the paper's Appendix A)
calibrated from a learning-speed run's own rates, its predicted pipeline speedup beside the
measured one.

In every learning-speed mode the generator and trainer loops are threads of one process that
time-share all of the machine's cores. From one conventional run (phases alternate, each on all
cores), in trained tokens per second:
  r_gen   = tokens / gen_busy_s        r_train = tokens / train_busy_s
Predicted throughputs (`predict`):
  conventional    sim `conventional` with N = 1 accelerator = the whole machine, U flat at r_gen,
                  tau = 1 / r_train: r_conv = 1 / (1/r_gen + 1/r_train).
  shared cores    the pipeline's loops time-share the same cores, as this benchmark runs them.
                  Time sharing is at best work-conserving: each token still costs 1/r_gen +
                  1/r_train seconds of the whole machine, so the pipeline cannot beat r_conv:
                  predicted throughput ratio 1.0 (less when sharing costs something). That
                  assumes each phase keeps every core busy; a phase that does not (decode with
                  gen_core_scaling 1.0 leaves a core idle) lets shared cores overlap as well,
                  up to the disjoint prediction.
  disjoint cores  one core generates while the other trains: sim `pipeline` with N = 2, I = 1,
                  on one-core rates r_gen / gen_core_scaling and r_train / train_core_scaling
                  (a scaling = the rate on all cores / the rate on one core).
  bound           the better placement: max of the two predicted ratios.
Measured beside them (`compare_seed`): the throughput ratio (pipeline tokens / time_s) /
(conventional tokens / time_s), in the predictions' units, and the time-to-target speedup of the
learning-speed JSON, which also counts what each trained token teaches (lag, stale samples).

The core scalings are not measured by the learning-speed run: its CLI defaults
(GEN_CORE_SCALING, TRAIN_CORE_SCALING) come from earlier measurements on the 2-core machine.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Sequence

import numpy as np

from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.sim import throughput as tp

# Measured earlier on the 2-core benchmark machine, not in the run being modelled: the JAX
# engine's decode does not speed up from 1 to 2 cores; the train step is 1.5-1.8x faster.
GEN_CORE_SCALING = 1.0
TRAIN_CORE_SCALING = 1.6
# The learning-speed mode (ablations.mode_config) whose generator and trainer run on disjoint
# cores: its measured throughput goes beside the disjoint prediction.
DISJOINT_MODE = 'pipeline-disjoint'
# Time sharing one set of cores is at best work-conserving: no gain over alternating phases.
SHARED_CORES_SPEEDUP = 1.0
# The predictions only use throughputs; the lag bound `tp.pipeline` also returns is not reported,
# so its lengths and batch size are placeholders.
_PLACEHOLDER_LENGTHS = tp.Lengths(mean=1.0, max=1.0)
# Keys of `compare_seed` that `compare_over_seeds` takes the median of.
MEDIAN_KEYS = ('r_gen', 'r_train', 'r_gen_one_core', 'r_train_one_core', 'r_conv', 'r_shared',
               'r_disjoint', 'speedup_shared', 'speedup_disjoint', 'speedup_bound',
               'r_pipeline_measured', 'r_conventional_measured', 'throughput_ratio_measured')


def is_conventional(mode: str) -> bool:
  """'conv<k>' learning-speed modes (the others are PipelineRL in one placement or another)."""
  return mode.startswith('conv')


def flat_curve(tokens_per_s: float) -> list[tuple[float, float]]:
  """A U(h) that is tokens_per_s for every h >= 1: the run measured one rate, not a curve."""
  return [(1.0, tokens_per_s)]


def _positive(summary: dict[str, Any], key: str) -> float:
  value = summary.get(key)
  if value is None or not value > 0:
    raise ValueError(f"{summary.get('name', '?')} seed {summary.get('seed', '?')}: need {key} "
                     f'> 0, got {value}')
  return float(value)


def measured_rates(conventional: dict[str, Any]) -> dict[str, float]:
  """r_gen and r_train (trained tokens/s, all cores on each phase) of one conventional run's
  `ablations.summarize` dict."""
  tokens = _positive(conventional, 'tokens')
  return dict(r_gen=tokens / _positive(conventional, 'gen_busy_s'),
              r_train=tokens / _positive(conventional, 'train_busy_s'))


def measured_throughput(summary: dict[str, Any]) -> float:
  """Trained tokens per second of run time (compilation included, as in time to target)."""
  return _positive(summary, 'tokens') / _positive(summary, 'time_s')


def predict(conventional: dict[str, Any], gen_core_scaling: float = GEN_CORE_SCALING,
            train_core_scaling: float = TRAIN_CORE_SCALING) -> dict[str, Any]:
  """The model calibrated on one conventional run (see the module docstring): its rates, the
  predicted throughput r_* (tokens/s) of conventional RL and of the pipeline on shared and on
  disjoint cores, and each pipeline placement's predicted throughput ratio over conventional."""
  if not (gen_core_scaling > 0 and train_core_scaling > 0):
    raise ValueError(f'core scalings must be > 0, got {gen_core_scaling}, {train_core_scaling}')
  rates = measured_rates(conventional)
  conv = tp.conventional(N=1, B=1, G=1, points=flat_curve(rates['r_gen']),
                         tau=1 / rates['r_train'])
  r_gen_one_core = rates['r_gen'] / gen_core_scaling
  r_train_one_core = rates['r_train'] / train_core_scaling
  disjoint = tp.pipeline(N=2, I=1, H=1, points=flat_curve(r_gen_one_core),
                         tau=1 / r_train_one_core, B=1, lengths=_PLACEHOLDER_LENGTHS)
  speedup_disjoint = disjoint.r_pipe / conv.r_conv
  return dict(**rates, gen_core_scaling=gen_core_scaling, train_core_scaling=train_core_scaling,
              r_gen_one_core=r_gen_one_core, r_train_one_core=r_train_one_core,
              r_conv=conv.r_conv, r_shared=conv.r_conv * SHARED_CORES_SPEEDUP,
              r_disjoint=disjoint.r_pipe, speedup_shared=SHARED_CORES_SPEEDUP,
              speedup_disjoint=speedup_disjoint,
              speedup_bound=max(SHARED_CORES_SPEEDUP, speedup_disjoint),
              best_placement=('disjoint' if speedup_disjoint > SHARED_CORES_SPEEDUP
                              else 'shared'))


def compare_seed(pipeline: dict[str, Any], conventional: dict[str, Any],
                 gen_core_scaling: float = GEN_CORE_SCALING,
                 train_core_scaling: float = TRAIN_CORE_SCALING) -> dict[str, Any]:
  """`predict` from the conventional run of one seed, beside the measured throughputs of both
  runs of that seed and their ratio (pipeline / conventional)."""
  r_pipe, r_conv = measured_throughput(pipeline), measured_throughput(conventional)
  return dict(predict(conventional, gen_core_scaling, train_core_scaling),
              r_pipeline_measured=r_pipe, r_conventional_measured=r_conv,
              throughput_ratio_measured=r_pipe / r_conv)


def compare_over_seeds(pipeline: Sequence[dict[str, Any]],
                       conventional: Sequence[dict[str, Any]],
                       gen_core_scaling: float = GEN_CORE_SCALING,
                       train_core_scaling: float = TRAIN_CORE_SCALING) -> dict[str, Any]:
  """`compare_seed` for each seed both modes ran (summaries paired by their `seed`), and the
  median over seeds of each of MEDIAN_KEYS."""
  conv_by_seed = {s.get('seed', 0): s for s in conventional}
  per_seed = [dict(seed=p.get('seed', 0),
                   **compare_seed(p, conv_by_seed[p.get('seed', 0)], gen_core_scaling,
                                  train_core_scaling))
              for p in pipeline if p.get('seed', 0) in conv_by_seed]
  if not per_seed:
    raise ValueError('the pipeline and the conventional mode share no seed')
  return dict(per_seed=per_seed,
              median={k: float(np.median([s[k] for s in per_seed])) for k in MEDIAN_KEYS})


def model_section(summaries: dict[str, Sequence[dict[str, Any]]], speedup: dict[str, Any],
                  gen_core_scaling: float = GEN_CORE_SCALING,
                  train_core_scaling: float = TRAIN_CORE_SCALING) -> dict[str, Any]:
  """The learning-speed JSON's `model` section. `summaries` maps each mode to its per-seed
  `summarize` dicts; `speedup` is `ablations.speedup_over_seeds`'s result, whose best
  conventional mode calibrates the model (when none reached the target: the conventional mode
  with the highest median measured throughput, which the `note` says)."""
  conventional = {m: s for m, s in summaries.items() if is_conventional(m)}
  if 'pipeline' not in summaries or not conventional:
    raise ValueError('the model needs the pipeline and at least one conventional mode')
  best = speedup.get('best_conventional')
  if best is not None:
    note = f'calibrated on {best}, the best conventional mode by time to target'
  else:
    best = max(conventional, key=lambda m: np.median([measured_throughput(s)
                                                      for s in conventional[m]]))
    note = (f'calibrated on {best}, the conventional mode with the highest measured throughput '
            '(no best mode by time to target)')
  over = compare_over_seeds(summaries['pipeline'], conventional[best], gen_core_scaling,
                            train_core_scaling)
  if DISJOINT_MODE in summaries:  # the placement the disjoint prediction is about, measured
    disjoint = compare_over_seeds(summaries[DISJOINT_MODE], conventional[best],
                                  gen_core_scaling, train_core_scaling)
    over['disjoint_measured'] = dict(
        per_seed=[dict(seed=s['seed'], throughput_ratio_measured=s['throughput_ratio_measured'])
                  for s in disjoint['per_seed']],
        median=disjoint['median']['throughput_ratio_measured'])
  return dict(conventional_mode=best, note=note, gen_core_scaling=gen_core_scaling,
              train_core_scaling=train_core_scaling, **over,
              time_to_target_speedup_measured=speedup.get('value'),
              definitions=dict(
                  rates='r_gen = trained tokens / generator busy s, r_train = trained tokens / '
                        'trainer busy s, of the conventional run (all cores on each phase); '
                        'every r_* in tokens/s',
                  predictions='sim.throughput: r_conv = conventional(N=1, U flat at r_gen, '
                              'tau=1/r_train); r_shared = r_conv (time sharing the same cores '
                              'is at best work-conserving); r_disjoint = pipeline(N=2, I=1) on '
                              'one-core rates r_gen/gen_core_scaling, '
                              'r_train/train_core_scaling; speedup_* = r_* / r_conv; '
                              'speedup_bound = the larger of the two placements',
                  measured='throughput_ratio_measured = (pipeline tokens / time_s) / '
                           '(conventional tokens / time_s) of the same seed (pipeline: shared '
                           f'cores; disjoint_measured: the same for {DISJOINT_MODE}); '
                           'time_to_target_speedup_measured = the JSON\'s speedup.value',
                  core_scalings='rate on all cores / rate on one core, measured earlier on '
                                'this machine, not in this run'))


def model_line(section: dict[str, Any]) -> str:
  """The model section's medians, predicted beside measured, as one line."""
  m = section['median']
  seeds = len(section['per_seed'])
  ttt = section['time_to_target_speedup_measured']
  return (f"model ({section['conventional_mode']}, median of {seeds} seed"
          f"{'s' if seeds > 1 else ''}): r_gen {m['r_gen']:.0f}, r_train {m['r_train']:.0f} "
          f"-> r_conv {m['r_conv']:.0f} tok/s; predicted pipeline/conventional throughput "
          f"{m['speedup_shared']:.2f} shared cores, {m['speedup_disjoint']:.2f} disjoint "
          f"(2-core/1-core rate: gen {section['gen_core_scaling']:g}, train "
          f"{section['train_core_scaling']:g}), bound {m['speedup_bound']:.2f}; measured "
          f"throughput ratio {m['throughput_ratio_measured']:.2f} shared"
          + (f", {section['disjoint_measured']['median']:.2f} disjoint"
             if 'disjoint_measured' in section else '')
          + ", time-to-target speedup "
          f"{'null' if ttt is None else f'{ttt:.2f}'}")


# ---------------------------------------------------------------------------------------------
# An existing learning-speed JSON.


def trained_tokens(records: Sequence[dict[str, Any]]) -> int:
  """Trained (completion) tokens of one run: the sum of its step records' `tokens`."""
  return int(sum(r.get('tokens', 0) for r in records))


def summaries_of_report(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
  """Each mode's per-seed summaries from a learning-speed JSON. Summaries written before they
  counted trained tokens get `tokens` from their run's metrics.jsonl, in
  <args.workdir>/<mode>/seed<k>/."""
  out = {}
  for mode in report['modes']:
    if 'per_seed' not in mode:
      raise ValueError(f"mode {mode.get('name')!r} has no per_seed summaries: a learning-speed "
                       'JSON from before --seeds')
    out[mode['name']] = [dict(s) for s in mode['per_seed']]
    for s in out[mode['name']]:
      if s.get('tokens') is None:
        path = os.path.join(report['args']['workdir'], mode['name'], f"seed{s['seed']}",
                            metrics_lib.METRICS_FILE)
        if not os.path.exists(path):
          raise ValueError(f"{mode['name']} seed {s['seed']}: the summary has no tokens and "
                           f'{path} is gone')
        s['tokens'] = trained_tokens(metrics_lib.read_metrics(path))
  return out


def add_model_to_report(path: str, gen_core_scaling: float = GEN_CORE_SCALING,
                        train_core_scaling: float = TRAIN_CORE_SCALING) -> dict[str, Any]:
  """Computes the `model` section of the learning-speed JSON at `path`, writes it into that
  file (replacing any earlier one) and returns it."""
  file = pathlib.Path(path)
  report = json.loads(file.read_text())
  section = model_section(summaries_of_report(report), report['speedup'], gen_core_scaling,
                          train_core_scaling)
  report['model'] = section
  file.write_text(json.dumps(report, indent=1, default=float))
  return section
