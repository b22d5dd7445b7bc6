"""Variable-length RL samples -> fixed [R, T] numpy rows for the jitted train step.

A sample is the token sequence prompt + completion (n = P + C tokens). It becomes n - 1
positions in next-token layout: position i holds token i and, as its target, token i + 1, so the
model's log pi(target) at position i conditions only on tokens <= i of the same sample.
Targets that are completion tokens carry the loss (loss_mask = 1) and the per-token sampler
data (behaviour log-probs, policy versions, advantage, optional reference log-probs).

A multi-turn episode is one sample whose completion interleaves model turns and the
environment's observations (episodes.py); its `Sample.loss_mask` says which completion tokens
the model drew (1) and which were fed (0). An observation target is packed like a prompt token:
loss_mask 0, no log mu, advantage or reference log-prob, version -1; so every per-token sum of
the loss and its metrics (ESS, lag, entropy, clip fractions, token counts) covers model tokens
only.

Samples are placed first-fit decreasing into rows of T = seq_len positions; `segment_ids`
(1..k per row, 0 = padding) keep attention inside a sample and `positions` restart at 0 for each.
The packer also hands over each row's samples as spans, `segment_starts` / `segment_lengths`
[R, G] (sample g of a row starts at position start and covers length positions; unused slots are
-1 / 0), so a fused attention kernel gets its segment offsets without recomputing them from the
per-token ids. G = `max_segments` when set (rows then hold at most that many samples), else T.

A mixture-of-experts sample may carry its routes: for each completion token, the experts the
sampler sent the forward pass that drew it through, in each MoE layer ([C, Ls, Xk]). They are
packed at the position whose target is that token (where its log mu goes), as `routes`
[R, T, Ls, Xk] (0 elsewhere), for the trainer to replay (models/layers/moe.py).

Shape letters: R rows, T positions per row, M micro-batches, P prompt, C completion tokens, G
sample slots per row, Ls MoE layers, Xk experts per token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

_OVERLONG_MODES = ('error', 'truncate')


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: `==` on array fields is ambiguous
class Sample:
  """One finished rollout; arrays are converted with np.asarray (lists are fine)."""
  prompt_tokens: np.ndarray        # int [P]
  completion_tokens: np.ndarray    # int [C]
  behaviour_logprobs: np.ndarray   # float [C]: log mu of each completion token under the sampler
  versions: np.ndarray             # int [C]: policy version that produced each token
  advantage: float
  reward: float = 0.0
  ref_logprobs: np.ndarray | None = None  # float [C]
  group_id: int = -1
  # [C] 1 = a model token (trained), 0 = an observation token (fed, never trained); None = all
  # model tokens (a one-turn sample). Observation tokens carry log mu 0 and the version of the
  # token before them in the arrays above; packing ignores both.
  loss_mask: np.ndarray | None = None
  # [C, Ls, Xk] unsigned ints: the experts each completion token's forward pass was routed to
  # in each MoE layer (an MoE model's JAX engine records them; observation tokens hold 0).
  routes: np.ndarray | None = None

  def __post_init__(self):
    def as_1d(name, kind):
      x = np.asarray(getattr(self, name))
      if x.ndim != 1:
        raise ValueError(f'Sample.{name} must be 1-D, got shape {x.shape}')
      if x.size and x.dtype.kind not in kind:
        raise ValueError(f'Sample.{name} must have dtype kind in {kind!r}, got {x.dtype}')
      object.__setattr__(self, name, x)
      return x

    prompt = as_1d('prompt_tokens', 'iu')
    completion = as_1d('completion_tokens', 'iu')
    if prompt.size < 1:
      raise ValueError('Sample.prompt_tokens is empty; a sample needs at least one prompt token')
    if completion.size < 1:
      raise ValueError('Sample.completion_tokens is empty; a sample needs at least one '
                       'completion token')
    for name, tokens in (('prompt_tokens', prompt), ('completion_tokens', completion)):
      if tokens.min() < 0:
        raise ValueError(f'Sample.{name} has a negative token id {tokens.min()}')
    c = completion.size
    per_token = [('behaviour_logprobs', 'fiu'), ('versions', 'iu')]
    if self.ref_logprobs is not None:
      per_token.append(('ref_logprobs', 'fiu'))
    if self.loss_mask is not None:
      per_token.append(('loss_mask', 'biuf'))
    for name, kind in per_token:
      x = as_1d(name, kind)
      if x.size != c:
        raise ValueError(f'Sample.{name} has length {x.size}, completion_tokens has {c}')
      # A NaN or inf here would poison every importance ratio of the batch.
      if x.dtype.kind == 'f' and not np.all(np.isfinite(x)):
        raise ValueError(f'Sample.{name} has non-finite values')
    if self.loss_mask is not None and not np.all((self.loss_mask == 0) | (self.loss_mask == 1)):
      raise ValueError('Sample.loss_mask must hold only 0 (observation) and 1 (model token)')
    if self.routes is not None:
      routes = np.asarray(self.routes)
      if routes.ndim != 3 or routes.shape[0] != c or routes.dtype.kind != 'u':
        raise ValueError(f'Sample.routes must be unsigned ints [C={c}, Ls, Xk], got '
                         f'{routes.dtype} {routes.shape}')
      object.__setattr__(self, 'routes', routes)
    if not math.isfinite(self.advantage):
      raise ValueError(f'Sample.advantage must be finite, got {self.advantage}')


@dataclasses.dataclass(frozen=True)
class PackStats:
  num_samples: int
  num_rows: int
  num_tokens: int          # real (non-padding) positions
  num_loss_tokens: int
  truncated_samples: int
  truncated_tokens: int    # completion tokens dropped by overlong='truncate'
  fill: float              # num_tokens / (num_rows * seq_len)


def _kept_positions(samples: Sequence[Sample], seq_len: int, overlong: str) -> np.ndarray:
  """Positions each sample occupies after the overlong policy; raises on what cannot fit."""
  kept = np.empty(len(samples), np.int64)
  for i, s in enumerate(samples):
    p, c = s.prompt_tokens.size, s.completion_tokens.size
    n_pos = p + c - 1
    if n_pos > seq_len:
      if overlong == 'error':
        raise ValueError(f'sample {i} has {p + c} tokens (prompt {p} + completion {c}) but a '
                         f'row of seq_len={seq_len} holds at most {seq_len + 1}; raise seq_len '
                         f"or pass overlong='truncate'")
      if p > seq_len:  # not even one completion token would be a target
        raise ValueError(f'sample {i}: prompt of {p} tokens leaves no completion token within '
                         f'seq_len={seq_len} (needs prompt <= seq_len to truncate)')
      n_pos = seq_len
    kept[i] = n_pos
  return kept


def _first_fit_decreasing(lengths: np.ndarray, seq_len: int, max_per_row: int = 0):
  """Row, offset and segment id (1..k, left to right) of each item, and the rows used.

  Longest first, ties in input order; each item goes into the first row with room for it (and,
  with `max_per_row` > 0, fewer than that many items).
  """
  order = np.argsort(-lengths, kind='stable')
  free = np.full(len(lengths), seq_len, np.int64)  # at most one row per item
  count = np.zeros(len(lengths), np.int64)
  row, offset, segment = (np.empty(len(lengths), np.int64) for _ in range(3))
  used = 0
  for i in order:
    fits = free[:used] >= lengths[i]
    if max_per_row:
      fits &= count[:used] < max_per_row
    r = int(fits.argmax()) if fits.any() else used
    used = max(used, r + 1)
    count[r] += 1
    row[i], offset[i], segment[i] = r, seq_len - free[r], count[r]
    free[r] -= lengths[i]
  return row, offset, segment, used


def _num_rows(used: int, num_rows: int | None, row_multiple: int, seq_len: int) -> int:
  if num_rows is None:
    return -(-used // row_multiple) * row_multiple
  if num_rows % row_multiple:
    raise ValueError(f'num_rows={num_rows} is not a multiple of row_multiple={row_multiple}')
  if used > num_rows:
    raise ValueError(f'the samples need {used} rows of seq_len={seq_len} (first-fit '
                     f'decreasing) but num_rows={num_rows}')
  return num_rows


def pack_samples(samples: Sequence[Sample], seq_len: int, *, num_rows: int | None = None,
                 row_multiple: int = 1, overlong: str = 'error',
                 max_segments: int = 0) -> tuple[dict[str, np.ndarray], PackStats]:
  """Packs samples into [R, seq_len] arrays; see the module docstring for the layout.

  Returns (batch, stats). batch keys: tokens, targets, positions, segment_ids, loss_mask,
  behaviour_logprobs, advantages, versions, sample_index, segment_starts and segment_lengths
  ([R, G]), and ref_logprobs and routes ([R, T, Ls, Xk]) when every sample has them. Off the
  loss positions the per-token fields are 0 (versions -1, sample_index -1 on padding).
  `max_segments` > 0 caps the samples of a row (G = max_segments); 0 leaves rows uncapped
  (G = seq_len).
  """
  if (seq_len < 1 or row_multiple < 1 or (num_rows is not None and num_rows < 0)
      or max_segments < 0):
    raise ValueError(f'need seq_len >= 1, row_multiple >= 1, num_rows >= 0, max_segments >= 0; '
                     f'got {seq_len}, {row_multiple}, {num_rows}, {max_segments}')
  if overlong not in _OVERLONG_MODES:
    raise ValueError(f'overlong={overlong!r}; expected one of {_OVERLONG_MODES}')
  for field in ('ref_logprobs', 'routes'):
    has = [getattr(s, field) is not None for s in samples]
    if any(has) and not all(has):
      # Dropping them for the whole batch would silently turn off the KL term, or replay.
      missing = [i for i, h in enumerate(has) if not h]
      raise ValueError(f'{field} given for some samples but missing for samples {missing[:8]}')
  if samples and samples[0].routes is not None:
    shapes = {(s.routes.shape[1:], s.routes.dtype) for s in samples}
    if len(shapes) > 1:
      raise ValueError(f'Sample.routes differ in shape or dtype across samples: {sorted(shapes)}')

  kept_B = _kept_positions(samples, seq_len, overlong)
  row_B, offset_B, segment_B, used = _first_fit_decreasing(kept_B, seq_len, max_segments)
  rows = _num_rows(used, num_rows, row_multiple, seq_len)

  shape = (rows, seq_len)
  batch = {
      'tokens': np.zeros(shape, np.int32),
      'targets': np.zeros(shape, np.int32),
      'positions': np.zeros(shape, np.int32),
      'segment_ids': np.zeros(shape, np.int32),
      'loss_mask': np.zeros(shape, np.float32),
      'behaviour_logprobs': np.zeros(shape, np.float32),
      'advantages': np.zeros(shape, np.float32),
      'versions': np.full(shape, -1, np.int32),
      'sample_index': np.full(shape, -1, np.int32),
      'segment_starts': np.full((rows, max_segments or seq_len), -1, np.int32),
      'segment_lengths': np.zeros((rows, max_segments or seq_len), np.int32),
  }
  if samples and samples[0].ref_logprobs is not None:
    batch['ref_logprobs'] = np.zeros(shape, np.float32)
  if samples and samples[0].routes is not None:
    batch['routes'] = np.zeros(shape + samples[0].routes.shape[1:], samples[0].routes.dtype)

  num_loss = 0
  for i, s in enumerate(samples):
    n, r, o, p = int(kept_B[i]), int(row_B[i]), int(offset_B[i]), s.prompt_tokens.size
    seq = np.concatenate([s.prompt_tokens, s.completion_tokens])[:n + 1]
    span = slice(o, o + n)
    batch['tokens'][r, span] = seq[:-1]
    batch['targets'][r, span] = seq[1:]
    batch['positions'][r, span] = np.arange(n)
    batch['segment_ids'][r, span] = segment_B[i]
    batch['segment_starts'][r, segment_B[i] - 1] = o
    batch['segment_lengths'][r, segment_B[i] - 1] = n
    batch['sample_index'][r, span] = i
    # Position j predicts token j + 1, a completion token from j = p - 1 on.
    c = n - (p - 1)
    loss = slice(o + p - 1, o + n)
    # Observation targets (loss_mask 0) stay as padding leaves them (see the module docstring).
    model_C = np.ones(c, bool) if s.loss_mask is None else s.loss_mask[:c] > 0
    batch['loss_mask'][r, loss] = model_C
    batch['behaviour_logprobs'][r, loss] = np.where(model_C, s.behaviour_logprobs[:c], 0.0)
    batch['advantages'][r, loss] = np.where(model_C, s.advantage, 0.0)
    batch['versions'][r, loss] = np.where(model_C, s.versions[:c], -1)
    if 'ref_logprobs' in batch:
      batch['ref_logprobs'][r, loss] = np.where(model_C, s.ref_logprobs[:c], 0.0)
    if 'routes' in batch:
      batch['routes'][r, loss] = np.where(model_C[:, None, None], s.routes[:c], 0)
    num_loss += int(model_C.sum())

  full_B = np.array([s.prompt_tokens.size + s.completion_tokens.size - 1 for s in samples],
                    np.int64)
  num_tokens = int(kept_B.sum())
  stats = PackStats(
      num_samples=len(samples),
      num_rows=rows,
      num_tokens=num_tokens,
      num_loss_tokens=num_loss,
      truncated_samples=int(np.sum(full_B > kept_B)),
      truncated_tokens=int(np.sum(full_B - kept_B)),
      fill=num_tokens / (rows * seq_len) if rows else 0.0,
  )
  return batch, stats


def segment_spans(segment_ids_RxT, max_segments: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment_starts, segment_lengths) [R, max_segments] of rows laid out as the packer lays them
  (segments 1..k left to right, each contiguous; 0 = padding): for batches made by hand."""
  seg = np.asarray(segment_ids_RxT)
  starts = np.full((seg.shape[0], max_segments), -1, np.int32)
  lengths = np.zeros((seg.shape[0], max_segments), np.int32)
  for r, row in enumerate(seg):
    ids = np.unique(row[row != 0])
    if ids.size > max_segments:
      raise ValueError(f'row {r} holds {ids.size} samples, more than max_segments='
                       f'{max_segments} (train.max_segments_per_row)')
    for g, s in enumerate(ids):
      at = np.flatnonzero(row == s)
      if s != g + 1 or at[-1] - at[0] + 1 != at.size:
        raise ValueError(f'row {r}: segment {s} is not the contiguous segment {g + 1} that '
                         f'packing makes (ids 1..k, left to right)')
      starts[r, g], lengths[r, g] = at[0], at.size
  return starts, lengths


def row_multiple(data_parallel: int, micro_batches: int, micro_batch_rows: int = 0) -> int:
  """Packed rows must be a multiple of this so that every micro-batch splits evenly over the
  data-parallel shards. `micro_batch_rows` > 0 fixes the rows each shard gets per micro-batch
  (the memory a step needs) and lets the number of micro-batches follow the batch; 0 fixes the
  number of micro-batches instead."""
  return (micro_batch_rows or micro_batches) * data_parallel


def num_micro_batches(num_rows: int, data_parallel: int, micro_batches: int,
                      micro_batch_rows: int = 0) -> int:
  """How many micro-batches `num_rows` packed rows (a multiple of `row_multiple`) make."""
  if not micro_batch_rows:
    return micro_batches
  per_micro = micro_batch_rows * data_parallel
  if num_rows % per_micro:
    raise ValueError(f'{num_rows} rows are not a multiple of micro_batch_rows x data shards = '
                     f'{per_micro}')
  return num_rows // per_micro


def split_microbatches(batch: dict[str, np.ndarray], num_micro: int) -> dict[str, np.ndarray]:
  """[R, ...] -> [M, R/M, ...]: micro-batch m holds rows m*R/M .. (m+1)*R/M - 1."""
  if num_micro < 1:
    raise ValueError(f'num_micro={num_micro} must be >= 1')
  out = {}
  for key, x in batch.items():
    r = x.shape[0]
    if r % num_micro:
      raise ValueError(f'batch[{key!r}] has {r} rows, not divisible by num_micro={num_micro}; '
                       f'pack with row_multiple={num_micro}')
    out[key] = x.reshape(num_micro, r // num_micro, *x.shape[1:])
  return out


def unpack_per_token(values_RxT, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
  """Per sample (list index = sample_index), `values` at its loss positions, in token order
(an episode's model tokens only).

  Works on a packed batch or its split_microbatches view, given values of the same shape.
  """
  mask = np.asarray(batch['loss_mask'])
  values = np.asarray(values_RxT)
  if values.shape != mask.shape:
    raise ValueError(f'values have shape {values.shape}, the batch has {mask.shape}')
  at_loss = mask.reshape(-1) > 0
  # Row-major order keeps each sample's positions in order: a sample lies in one row.
  index_L = np.asarray(batch['sample_index']).reshape(-1)[at_loss]
  values_L = values.reshape(-1)[at_loss]
  order = np.argsort(index_L, kind='stable')
  if not index_L.size:
    return []
  num_samples = int(index_L.max()) + 1
  counts = np.bincount(index_L, minlength=num_samples)
  return np.split(values_L[order], np.cumsum(counts)[:-1])
