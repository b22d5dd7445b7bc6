"""The stream between actor and trainer: finished groups one way, admission credits the other.

Credits are how `max_lag` becomes backpressure on the actor. Every sample the actor admits
holds a credit until the trainer has trained on it (or dropped it) AND published the weights
that step made; `capacity` says how many credits there are. The trainer still checks every
sample's lag and drops (and counts) any that exceed max_lag, so the bound holds even for a
straggler that decoded far longer than its peers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Iterable

import numpy as np

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import episodes as episodes_lib
from pipelinerl_jax import packing


def capacity(rl: config_lib.RLConfig, num_slots: int) -> int:
  """Admission credits, in samples.

  Conventional: exactly the generated batch of B * G samples that G optimizer steps will use.
  Pipeline: (max_lag + 1) * B makes max_lag a bound: at most that many samples are in flight or
  queued, so a sample is normally trained within max_lag steps of the version that started it.
  H + B keeps no more queued than the trainer's next batch: when generation outpaces training,
  extra queued samples would only wait and grow stale.
  """
  if rl.mode == 'conventional':
    return rl.batch_size * rl.conventional_steps
  return min((rl.max_lag + 1) * rl.batch_size, num_slots + rl.batch_size)


@dataclasses.dataclass
class Group:
  """The G samples of one prompt, scored, with advantages already computed."""
  group_id: int
  problem_id: str
  samples: list[packing.Sample]
  rewards: np.ndarray              # [G]
  statuses: list[str]              # the task's score status per sample
  finished_at: float = 0.0         # time.monotonic() when the last sample finished
  num_masked: int = 0              # samples the task masked (dropped; statuses still listed)
  hit_length_limit: list[bool] = dataclasses.field(default_factory=list)  # per sample, all G
  # A multi-turn task's episodes, all G (masked ones included); empty for a one-turn task.
  episodes: list[episodes_lib.EpisodeStats] = dataclasses.field(default_factory=list)

  @property
  def start_version(self) -> int:
    """The oldest policy version among the group's tokens (what its lag is measured from)."""
    return int(min(s.versions.min() for s in self.samples))

  @property
  def num_tokens(self) -> int:
    return int(sum(len(s.completion_tokens) for s in self.samples))


class GroupLedger:
  """Which group ids are finished with (trained, or dropped unused): a checkpoint's data position.

  Group i is problem i of the task's stream, so the lowest id not yet finished (`next_group`)
  plus the finished ids above it say exactly which problems a resumed run must still generate.
  Groups in flight at save time are not finished: a resumed run regenerates them.
  """

  def __init__(self, next_group: int = 0, done_above: Iterable[int] = ()):
    self._lock = threading.Lock()
    self._next = next_group
    self._done = {i for i in done_above if i >= next_group}
    self._advance()

  def _advance(self):
    while self._next in self._done:
      self._done.remove(self._next)
      self._next += 1

  def mark(self, group_ids: Iterable[int]) -> None:
    with self._lock:
      self._done.update(i for i in group_ids if i >= self._next)
      self._advance()

  def position(self) -> dict[str, Any]:
    """{'next_group': lowest unfinished id, 'done_above': finished ids above it, sorted}."""
    with self._lock:
      return dict(next_group=self._next, done_above=sorted(self._done))


class Stopped(Exception):
  """Raised in a loop waiting on the stream once the run is stopping."""


class SampleStream:

  def __init__(self, capacity: int, stop: threading.Event, ledger: GroupLedger | None = None):
    self.capacity = capacity          # credits, in samples
    self.ledger = ledger or GroupLedger()  # marked by the trainer (trained) and actor (dropped)
    self._stop = stop
    self._cond = threading.Condition()
    self._groups: list[Group] = []
    self._owned = 0                   # samples admitted and not yet released

  # --- actor side -------------------------------------------------------------------------
  def try_acquire(self, n: int) -> bool:
    with self._cond:
      if self._owned + n > self.capacity:
        return False
      self._owned += n
      return True

  def put(self, group: Group) -> None:
    with self._cond:
      self._groups.append(group)
      self._cond.notify_all()

  def wait_for_credit(self, n: int, timeout: float) -> bool:
    with self._cond:
      return self._cond.wait_for(lambda: self._owned + n <= self.capacity or self._stop.is_set(),
                                 timeout)

  # --- trainer side -----------------------------------------------------------------------
  def take(self, num_samples: int, poll_s: float = 0.05) -> list[Group]:
    """Blocks until groups holding >= num_samples samples are queued; takes the oldest
    (by start version, then finish time) first. Raises Stopped when the run stops."""
    with self._cond:
      while sum(len(g.samples) for g in self._groups) < num_samples:
        if self._stop.is_set():
          raise Stopped()
        self._cond.wait(poll_s)
      self._groups.sort(key=lambda g: (g.start_version, g.finished_at))
      taken, count = [], 0
      while count < num_samples:
        g = self._groups.pop(0)
        taken.append(g)
        count += len(g.samples)
      return taken

  def release(self, n: int) -> None:
    with self._cond:
      self._owned = max(0, self._owned - n)
      self._cond.notify_all()

  def stats(self) -> dict[str, Any]:
    with self._cond:
      return dict(queued_samples=sum(len(g.samples) for g in self._groups), owned=self._owned)


def wait_or_stop(stop: threading.Event, seconds: float) -> None:
  if stop.wait(seconds):
    raise Stopped()


def now() -> float:
  return time.monotonic()
