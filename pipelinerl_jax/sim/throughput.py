"""Throughput model of the paper's Appendix A: conventional RL vs PipelineRL on N accelerators.

Units: every rate r_* is tokens/s for the whole cluster; tau is seconds per token on one
accelerator; lengths are tokens per sample. One sample costs the same L tokens to generate and
to train on (the model does not split prompt from completion).

Definitions:
  U(h)   generation throughput of ONE accelerator (tokens/s) with h sequences in flight on it:
         measured points (h, tokens/s), piecewise-linear in h, U(0) = 0, flat past the last point.
  tau    training time per token on one accelerator, so n trainers process n / tau tokens/s.

  Conventional, G optimizer steps per generated batch: all N accelerators generate B·G samples,
  h = B·G / N per accelerator (capped at `max_h`, the memory limit), then all N train on them:
      r_gen = N·U(h),  r_train = N / tau,  r_conv = 1 / (1/r_gen + 1/r_train),  lag = G − 1.

  Pipeline: I generation accelerators with H sequences in flight on EACH of them (H·I in flight
  in total) and N − I trainers, running concurrently:
      r_pipe = min(U(H)·I, (N − I) / tau),
      g_max  = ceil(H·I·L / (L̄·B))          (L max length, L̄ mean length, B samples per step).

Like the paper, the model ignores the tail of a conventional batch, where fewer than h
sequences are left in flight; so r_conv is an upper bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import NamedTuple, Sequence, Union

import numpy as np

# (h, tokens/s per accelerator) pairs, h = in-flight sequences on that accelerator.
Points = Sequence[tuple[float, float]]

# An example curve with a plausible shape (near-linear at small h, saturating as decoding turns
# compute-bound): U(h) = 6000·h / (h + 64), rounded. ILLUSTRATIVE ONLY: it is not a measurement
# and not the paper's curve (which the paper does not publish). Pair it with ILLUSTRATIVE_TAU.
ILLUSTRATIVE_POINTS: tuple[tuple[int, int], ...] = tuple(
    (h, round(6000 * h / (h + 64))) for h in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512))
ILLUSTRATIVE_TAU = 1 / 8000  # s/token: training 8000 tokens/s per accelerator, also made up


@dataclasses.dataclass(frozen=True)
class Lengths:
  mean: float  # L̄, tokens
  max: float   # L, tokens

  def __post_init__(self):
    if not 0 < self.mean <= self.max:
      raise ValueError(f'need 0 < mean length <= max length, got {self.mean}, {self.max}')


def lengths_from_samples(samples: Sequence[float]) -> Lengths:
  samples = np.asarray(samples, dtype=np.float64)
  if samples.size == 0:
    raise ValueError('no length samples')
  return Lengths(mean=float(samples.mean()), max=float(samples.max()))


def as_lengths(lengths: Union[Lengths, Sequence[float]]) -> Lengths:
  """A `Lengths`, or sample lengths to summarize."""
  return lengths if isinstance(lengths, Lengths) else lengths_from_samples(lengths)


class ConvConfig(NamedTuple):
  G: int            # optimizer steps per generated batch
  h: float          # in-flight sequences per accelerator while generating
  r_gen: float
  r_train: float
  r_conv: float
  lag: int          # G − 1: the last step of a batch uses samples G − 1 versions old


class PipeConfig(NamedTuple):
  I: int            # generation accelerators (N − I train)
  H: float          # in-flight sequences per generation accelerator
  r_gen: float      # U(H)·I
  r_train: float    # (N − I) / tau
  r_pipe: float
  g_max: int


# ---------------------------------------------------------------------------------------------
# Utilization curve.


def curve_arrays(points: Points) -> tuple[np.ndarray, np.ndarray]:
  """Sorted (h_P, u_P) with the (0, 0) point prepended; rejects repeated or non-positive h."""
  pts = sorted((float(h), float(u)) for h, u in points)
  if not pts:
    raise ValueError('utilization curve has no points')
  h_P = np.array([0.0] + [h for h, _ in pts])
  u_P = np.array([0.0] + [u for _, u in pts])
  if np.any(np.diff(h_P) <= 0):
    raise ValueError(f'utilization curve needs distinct h > 0, got {[h for h, _ in pts]}')
  if np.any(u_P < 0) or not np.all(np.isfinite(u_P)):
    raise ValueError('utilization curve needs finite tokens/s >= 0')
  return h_P, u_P


def utilization(points: Points, h):
  """U(h), tokens/s per accelerator: linear between points, U(0) = 0, flat past the last."""
  h_P, u_P = curve_arrays(points)
  u = np.interp(h, h_P, u_P)  # np.interp holds the end values outside [0, h_max]
  return float(u) if np.ndim(u) == 0 else u


# ---------------------------------------------------------------------------------------------
# The two throughput formulas and the lag bound.


def _check_cluster(N: int, B: int, tau: float):
  if N < 1 or B < 1:
    raise ValueError(f'need N >= 1 and B >= 1, got N={N}, B={B}')
  if not tau > 0:
    raise ValueError(f'tau must be > 0 s/token, got {tau}')


def conventional(N: int, B: int, G: int, points: Points, tau: float,
                 max_h: float | None = None) -> ConvConfig:
  """Generate B·G samples on all N accelerators, then train on all N (G steps)."""
  _check_cluster(N, B, tau)
  h = B * G / N
  if max_h is not None:
    h = min(h, max_h)  # more samples than fit: generated in waves of max_h per accelerator
  r_gen = N * utilization(points, h)
  r_train = N / tau
  # Phases run one after the other, so their times per token add.
  r_conv = 1 / (1 / r_gen + 1 / r_train) if r_gen > 0 else 0.0
  return ConvConfig(G=G, h=h, r_gen=r_gen, r_train=r_train, r_conv=r_conv, lag=G - 1)


def lag_bound(H: float, I: int, B: int, lengths: Union[Lengths, Sequence[float]]) -> int:
  """g_max = ceil(H·I·L / (L̄·B)), H per generation accelerator.

  Why: in steady state the H·I in-flight sequences share the pipeline's rate r_pipe (when the
  trainer is the bottleneck the generators are held back to its pace), so a max-length sequence
  takes t_gen = L·H·I / r_pipe, while an optimizer step consumes B·L̄ tokens in
  t_train = B·L̄ / r_pipe. g_max = ceil(t_gen / t_train), whichever side is the bottleneck.
  """
  lengths = as_lengths(lengths)
  steps = H * I * lengths.max / (lengths.mean * B)
  return max(1, math.ceil(steps - 1e-9))  # the epsilon keeps float noise (3.0000000001) at 3


def pipeline(N: int, I: int, H: float, points: Points, tau: float, B: int,
             lengths: Union[Lengths, Sequence[float]]) -> PipeConfig:
  """I generators at H in flight each, N − I trainers, concurrently: the slower side sets r."""
  _check_cluster(N, B, tau)
  if not 1 <= I <= N - 1:
    raise ValueError(f'need 1 <= I <= N - 1, got I={I}, N={N}')
  r_gen = utilization(points, H) * I
  r_train = (N - I) / tau
  return PipeConfig(I=I, H=H, r_gen=r_gen, r_train=r_train, r_pipe=min(r_gen, r_train),
                    g_max=lag_bound(H, I, B, lengths))


# ---------------------------------------------------------------------------------------------
# Search.


def h_grid(points: Points, max_h: float | None = None) -> list[float]:
  """Candidate H: the curve's measured h and the powers of two, up to max_h (default: the last
  measured h, past which U is flat and a larger H only adds lag)."""
  h_P, _ = curve_arrays(points)
  cap = float(h_P[-1]) if max_h is None else float(max_h)
  grid = {float(h) for h in h_P[1:] if h <= cap}
  p = 1
  while p <= cap:
    grid.add(float(p))
    p *= 2
  return [int(h) if h.is_integer() else h for h in sorted(grid)]


def rank_key(c: PipeConfig):
  """Best first: highest r_pipe; ties go to the lower lag, then the smaller H, then smaller I."""
  return (-c.r_pipe, c.g_max, c.H, c.I)


def best_config(N: int, B: int, points: Points, tau: float,
                lengths: Union[Lengths, Sequence[float]], max_lag: int | None = None,
                h_values: Sequence[float] | None = None,
                max_h: float | None = None) -> tuple[PipeConfig, list[PipeConfig]]:
  """Exhaustive search over I in 1..N−1 and H in `h_values` (default `h_grid(points, max_h)`).

  Returns (best, table): `table` holds every (I, H), ranked by `rank_key`, the lag limit not
  applied; `best` is the first with g_max <= max_lag (any, when max_lag is None). Raises
  ValueError when no configuration meets max_lag.
  """
  if N < 2:
    raise ValueError(f'a pipeline needs N >= 2 accelerators, got {N}')
  lengths = as_lengths(lengths)
  grid = list(h_values) if h_values is not None else h_grid(points, max_h)
  table = sorted((pipeline(N, I, H, points, tau, B, lengths)
                  for I in range(1, N) for H in grid), key=rank_key)
  feasible = [c for c in table if max_lag is None or c.g_max <= max_lag]
  if not feasible:
    raise ValueError(f'no (I, H) has g_max <= max_lag={max_lag}; the smallest g_max is '
                     f'{min(c.g_max for c in table)}')
  return feasible[0], table


# ---------------------------------------------------------------------------------------------
# Calibration from this repo's benchmarks.


def utilization_from_bench_json(path, mode: str = 'none', backend: str = 'jax'
                                ) -> list[tuple[int, float]]:
  """U(h) points from `python -m pipelinerl_jax.bench.generation` output: (slots, tokens_per_s)
  of the rows with `mode` ('none': no weight updates) and `backend` (rows written before the
  bench had several backends are the JAX engine's). That bench runs one engine on one
  device, so its tokens/s are per accelerator. Its H is the slot count: slots stay full in a
  pipeline, while the bench's tail drains them, so these points slightly understate U(H)."""
  rows = json.loads(pathlib.Path(path).read_text())['rows']
  points = [(int(r['slots']), float(r['tokens_per_s'])) for r in rows
            if r['mode'] == mode and r.get('backend', 'jax') == backend]
  if not points:
    raise ValueError(f'{path}: no rows with mode {mode!r} (modes: '
                     f'{sorted({r["mode"] for r in rows})})')
  hs = [h for h, _ in points]
  if len(set(hs)) != len(hs):
    raise ValueError(f'{path}: several rows for the same slots in mode {mode!r}: {sorted(hs)}')
  return sorted(points)


def tau_from_train_bench_json(path, model: str | None = None) -> float:
  """tau (s/token per accelerator) from `python -m pipelinerl_jax.bench.train_step` output:
  its tokens_per_s is for the whole mesh of `devices`, so tau = devices / tokens_per_s. With
  several models in the file, `model` picks one."""
  results = json.loads(pathlib.Path(path).read_text())['results']
  names = [r['model'] for r in results]
  if model is not None:
    results = [r for r in results if r['model'] == model]
  if len(results) != 1:
    which = f'model {model!r}' if model is not None else 'model=None'
    raise ValueError(f'{path}: {which} matches {len(results)} results; models: {names}')
  (r,) = results
  return r['devices'] / r['tokens_per_s']
