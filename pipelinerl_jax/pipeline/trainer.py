"""The trainer loop (paper Algorithm 2, "Trainer"): take B samples, pack, one optimizer step,
publish the new weights to the generators -- after every step in pipeline mode; after the G
steps that use one generated batch in conventional mode.

An update the train step skips (non-finite loss, gradient or updated state; see train.py)
leaves the params and the step as they were: it is logged as a `skipped_update` record of its
own, not as a step, its samples are not trained again, and MAX_SKIPPED_IN_A_ROW of them in a
row stop the run (a state or a data stream that only gives non-finite updates)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from pipelinerl_jax import episodes as episodes_lib
from pipelinerl_jax import packing
from pipelinerl_jax.pipeline import stream as stream_lib

MAX_SKIPPED_IN_A_ROW = 10


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  batch_size: int                   # B samples per optimizer step
  seq_len: int                      # packed row length
  micro_batches: int
  row_multiple: int                 # micro_batches x data-parallel shards
  mode: str = 'pipeline'            # 'pipeline' | 'conventional'
  max_lag: int | None = None        # pipeline mode: samples older than this are dropped
  conventional_steps: int = 1       # conventional mode: optimizer steps per generated batch
  total_steps: int = 100
  max_time_s: float = 0.0           # 0 = no limit
  overlong: str = 'error'
  max_segments: int = 0             # samples per packed row at most (0 = no cap)
  eval_every_steps: int = 0         # with an `evaluate` function; 0 = never


def gen_rate(previous: tuple[float, float] | None, tokens: float, t: float) -> float:
  """Generated tokens/s since `previous` (tokens, time). A counter that went down was reset (an
  engine restarted): the tokens since the reset are the new count."""
  if previous is None:
    return 0.0
  last_tokens, last_t = previous
  new = tokens - last_tokens if tokens >= last_tokens else tokens
  return new / max(t - last_t, 1e-9)


def bucket_rows(num_rows: int, multiple: int) -> int:
  """Round rows up to multiple * 2^k: a handful of batch shapes, so few recompilations."""
  units = max(1, -(-num_rows // multiple))
  return multiple * (1 << (units - 1).bit_length())


def token_lags(batch: dict[str, np.ndarray], step: int) -> np.ndarray:
  """Lag (optimizer steps) of every trained token: current step minus its policy version."""
  mask = batch['loss_mask'] > 0
  return step - batch['versions'][mask]


def lag_stats(lags: np.ndarray) -> dict[str, float]:
  if lags.size == 0:
    return dict(lag_min=0.0, lag_mean=0.0, lag_max=0.0)
  return dict(lag_min=float(lags.min()), lag_mean=float(lags.mean()), lag_max=float(lags.max()))


def version_stats(versions: Sequence[np.ndarray], step: int) -> dict[str, float]:
  """How many policy versions wrote each sample, and the lag of its first and last token at
  `step`: what shows in-flight weight updates at work (a sample decoded across updates has
  tokens of several versions, its first token older than its last). Pure. `versions`: one array
  per trained sample, the version of each completion token in order; empty ones are skipped."""
  versions = [np.asarray(v) for v in versions if len(v)]
  if not versions:
    return dict(versions_per_sample_mean=0.0, versions_per_sample_max=0.0,
                frac_multi_version=0.0, lag_first_token_mean=0.0, lag_last_token_mean=0.0)
  distinct = np.array([len(np.unique(v)) for v in versions])
  return dict(versions_per_sample_mean=float(distinct.mean()),
              versions_per_sample_max=float(distinct.max()),
              frac_multi_version=float(np.mean(distinct >= 2)),
              lag_first_token_mean=float(np.mean([step - v[0] for v in versions])),
              lag_last_token_mean=float(np.mean([step - v[-1] for v in versions])))


def length_limit_stats(hit_length_limit: Sequence[bool]) -> dict[str, float]:
  """Share of completions cut at the length limit (finish_reason 'length', no EOS): a policy
  that stops ending its answers shows here first. Not IS truncation (`frac_is_capped`)."""
  n = len(hit_length_limit)
  return dict(frac_hit_length_limit=float(sum(map(bool, hit_length_limit))) / n if n else 0.0)


def prepare_batch(groups: list[stream_lib.Group], config: TrainerConfig):
  samples = [s for g in groups for s in g.samples]
  batch, pstats = packing.pack_samples(samples, config.seq_len, row_multiple=config.row_multiple,
                                       overlong=config.overlong,
                                       max_segments=config.max_segments)
  rows = bucket_rows(pstats.num_rows, config.row_multiple)
  if rows != pstats.num_rows:
    batch, pstats = packing.pack_samples(samples, config.seq_len, num_rows=rows,
                                         row_multiple=config.row_multiple,
                                         overlong=config.overlong,
                                         max_segments=config.max_segments)
  return batch, pstats


class Trainer:
  """Mutable state of the training side lives here: the TrainState and the counters."""

  def __init__(self, state, train_step: Callable, put_batch: Callable, publish: Callable,
               stream: stream_lib.SampleStream, config: TrainerConfig, stop: threading.Event,
               log: Callable[[dict], None], gen_stats: Callable[[], dict],
               after_publish: Callable[[], None] = lambda: None,
               evaluate: Callable[[Any, int], dict] | None = None):
    """`after_publish` runs after every weight publication, when the trained state, the
    engine's weights and the data position agree: where periodic checkpoints are taken.
    `evaluate(params, step)` -> metrics joins every eval_every_steps-th record."""
    self.state, self.train_step, self.put_batch = state, train_step, put_batch
    self._step = int(state.step)
    self.publish, self.stream, self.config, self.stop = publish, stream, config, stop
    self.log, self.gen_stats, self.after_publish = log, gen_stats, after_publish
    self.evaluate = evaluate
    self.busy_intervals: list[tuple[float, float]] = []   # train steps
    self.samples_trained = 0
    self.stale_dropped = 0
    self.max_lag_seen = 0
    self.skipped_updates = 0
    self._skipped_in_a_row = 0
    self.start_time = time.monotonic()
    self.time_offset = 0.0   # a resumed run's time_s continues from its last record
    self._last_gen = None

  @property
  def step(self) -> int:
    """The optimizer step as a host int, safe to read from any thread (`state.step` is a device
    array that the train step donates, so another thread may find it deleted)."""
    return self._step

  def checkpoint_meta(self) -> dict[str, Any]:
    """What a resumed run needs from the trainer besides its TrainState: the policy version,
    the data position (which groups are finished with) and the counters."""
    return dict(step=self.step, policy_version=self.step, data=self.stream.ledger.position(),
                counters=dict(samples_trained=self.samples_trained,
                              stale_dropped=self.stale_dropped, max_lag_seen=self.max_lag_seen,
                              skipped_updates=self.skipped_updates))

  def restore(self, meta: dict[str, Any]) -> None:
    """The counters of `checkpoint_meta` (the state and the data position are restored by the
    caller, into the train step's shardings and the stream's ledger)."""
    counters = meta['counters']
    self.samples_trained = counters['samples_trained']
    self.stale_dropped = counters['stale_dropped']
    self.max_lag_seen = counters['max_lag_seen']
    self.skipped_updates = counters.get('skipped_updates', 0)  # (older checkpoints lack it)

  def _take_fresh(self, n: int) -> list[stream_lib.Group]:
    """n samples whose lag at the current step is within max_lag; stale ones are dropped."""
    fresh: list[stream_lib.Group] = []
    while sum(len(g.samples) for g in fresh) < n:
      need = n - sum(len(g.samples) for g in fresh)
      for g in self.stream.take(need):
        if self.config.max_lag is not None and self.step - g.start_version > self.config.max_lag:
          self.stale_dropped += len(g.samples)
          self.stream.ledger.mark([g.group_id])
          self.stream.release(len(g.samples))
        else:
          fresh.append(g)
    return fresh

  def _one_step(self, groups: list[stream_lib.Group]) -> dict[str, Any]:
    step = self.step
    batch, pstats = prepare_batch(groups, self.config)
    lags = token_lags(batch, step)
    t0 = time.monotonic()
    self.state, metrics = self.train_step(self.state, self.put_batch(batch))
    self._step = int(self.state.step)  # not step + 1: a skipped (non-finite) update keeps it
    metrics = jax.device_get(metrics)
    # A skipped update's samples are finished with too: training on them again would give the
    # same non-finite update.
    self.stream.ledger.mark(g.group_id for g in groups)
    t1 = time.monotonic()
    self.busy_intervals.append((t0, t1))
    time_s = t1 - self.start_time + self.time_offset
    if self._step == step:
      return self._skipped(step, metrics, time_s)
    self._skipped_in_a_row = 0
    self.samples_trained += pstats.num_samples
    self.max_lag_seen = max(self.max_lag_seen, int(lags.max()) if lags.size else 0)
    rewards = np.concatenate([g.rewards for g in groups])
    statuses = [s for g in groups for s in g.statuses]  # masked samples' included
    masked = sum(g.num_masked for g in groups)
    record = {k: float(v) for k, v in metrics.items()}
    record.update(
        step=step + 1, time_s=time_s, samples=self.samples_trained,
        skipped_updates=self.skipped_updates,
        reward_mean=float(rewards.mean()), train_step_s=t1 - t0,
        train_tokens_per_s=pstats.num_tokens / max(t1 - t0, 1e-9),
        pack_fill=pstats.fill, stale_dropped=self.stale_dropped, masked=masked,
        masked_frac=masked / max(len(statuses), 1), **lag_stats(lags),
        **version_stats([smp.versions for g in groups for smp in g.samples], step),
        **length_limit_stats([h for g in groups for h in g.hit_length_limit]),
        **episodes_lib.step_metrics([e for g in groups for e in g.episodes]))
    for status in sorted(set(statuses)):
      record[f'frac_{status}'] = statuses.count(status) / len(statuses)
    return record

  def _skipped(self, step: int, metrics: dict[str, Any], time_s: float) -> dict[str, Any]:
    """The record of an update that was not applied (see the module docstring)."""
    self.skipped_updates += 1
    self._skipped_in_a_row += 1
    loss, grad_norm = float(metrics['loss']), float(metrics['grad_norm'])
    if self._skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
      raise RuntimeError(
          f'{self._skipped_in_a_row} updates in a row were skipped as non-finite (last: loss '
          f'{loss:.4g}, grad_norm {grad_norm:.4g}); the params stay those of step {step}: lower '
          'config.optimizer.lr or check the data')
    return dict(event='skipped_update', update=step + 1, policy_version=step, time_s=time_s,
                loss=loss, grad_norm=grad_norm, skipped_updates=self.skipped_updates)

  def _gen_rate(self) -> dict[str, float]:
    """Generated tokens/s since the previous log line."""
    stats, t = self.gen_stats(), time.monotonic()
    tokens = float(stats.get('tokens_generated', 0))
    rate = gen_rate(self._last_gen, tokens, t)
    self._last_gen = (tokens, t)
    # Counters an engine reports under 'generation/' (e.g. generator restarts) join the record.
    extra = {k: float(v) for k, v in stats.items() if k.startswith('generation/')}
    return dict(gen_tokens_per_s=rate, busy_slots=float(stats.get('busy_slots', 0)), **extra)

  def _complete(self, record: dict[str, Any]) -> dict[str, Any]:
    """A step record gets the generation rate and, every eval_every_steps steps, the
    evaluation's metrics; a skipped update's record stays as it is."""
    if 'step' not in record:
      return record
    record = {**record, **self._gen_rate()}
    every = self.config.eval_every_steps
    if self.evaluate is not None and every and self.step % every == 0:
      record = {**record, **self.evaluate(self.state.params, self.step)}
    return record

  def _done(self) -> bool:
    c = self.config
    return (self.step >= c.total_steps or self.stop.is_set()
            or (c.max_time_s > 0 and time.monotonic() - self.start_time > c.max_time_s))

  def run(self) -> None:
    self.start_time = time.monotonic()
    self._gen_rate()
    b = self.config.batch_size
    while not self._done():
      if self.config.mode == 'pipeline':
        groups = self._take_fresh(b)
        record = self._one_step(groups)
        if 'step' in record:  # (a skipped update left the engine's weights current)
          start = time.perf_counter()
          sent = self.publish(self.state.params, self.step)
          record['publish_s'] = time.perf_counter() - start  # the trainer waits this long
          if sent is not None:  # bytes handed over: the params, or with LoRA the adapters
            record['publish_bytes'] = float(sent)
        # Every sample taken, not b: groups whose masked samples were dropped make the count vary.
        self.stream.release(sum(len(g.samples) for g in groups))
        self.log(self._complete(record))
        self.after_publish()
      else:
        # Conventional: the whole B*G batch was generated by one policy; G steps on it, then sync.
        k = self.config.conventional_steps
        # By group id, not arrival order, so a resumed run trains exactly the same steps.
        groups = sorted(self.stream.take(b * k), key=lambda g: g.group_id)
        bounds = np.linspace(0, len(groups), k + 1).round().astype(int)  # all groups, k parts
        for i in range(k):
          record = self._one_step(groups[bounds[i]:bounds[i + 1]])
          self.log(self._complete(record))
          if self._done() and i < k - 1:
            break
        self.publish(self.state.params, self.step)
        self.stream.release(sum(len(g.samples) for g in groups))
        self.after_publish()
