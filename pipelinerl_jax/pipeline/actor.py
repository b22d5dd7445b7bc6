"""The actor (paper Algorithm 2, "Actor"): keeps up to H sequences in flight, never waiting for
the trainer. Each loop: admit new prompts (G samples each) while slots and credits allow, then
one engine step -- which first applies any weights the trainer published since the last step,
so sequences in flight continue under the new policy with their KV cache kept. Finished
groups are scored, given advantages and sent to the trainer.

A task may mask samples (math with truncated='mask': no learning signal either way). A masked
sample is dropped before the group's advantages are computed, so it is neither in the
baseline's mean / std nor trained on; its credit goes back to the stream at once, and its
status still counts in the step's status fractions. A group with every sample masked is
dropped whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import zlib
from typing import Any, Callable, Iterator

import numpy as np

from pipelinerl_jax import losses
from pipelinerl_jax import packing
from pipelinerl_jax.generation import api
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.tasks import base as tasks_base


@dataclasses.dataclass(frozen=True)
class ActorConfig:
  group_size: int                      # G samples per prompt
  num_slots: int                       # H, max sequences in flight
  sampling: api.SamplingParams
  seed: int = 0
  advantage_baseline: str = 'mean'
  advantage_normalize_std: bool = False
  drop_zero_advantage_groups: bool = False


def request_seed(seed: int, group_id: int, index: int) -> int:
  """Distinct, reproducible per-sample seeds (the G samples of a prompt must differ)."""
  return zlib.crc32(f'{seed}/{group_id}/{index}'.encode()) & 0x7FFFFFFF


def make_group(group_id: int, problem: tasks_base.Problem, completions: list[api.Completion],
               scores: list[tasks_base.Score], config: ActorConfig) -> stream_lib.Group | None:
  """The group of the unmasked samples, advantages computed over them alone; None when every
  sample is masked. `statuses` keeps all G samples' statuses (the metrics count them all)."""
  statuses = [s.status for s in scores]
  hit_length_limit = [c.finish_reason == 'length' for c in completions]
  kept = [(c, s) for c, s in zip(completions, scores) if not s.mask]
  if not kept:
    return None
  completions, scores = [c for c, _ in kept], [s for _, s in kept]
  rewards_G = np.array([s.reward for s in scores], np.float32)
  adv_G = np.asarray(losses.group_advantages(
      rewards_G[None], baseline=config.advantage_baseline,
      normalize_std=config.advantage_normalize_std))[0]
  samples = [
      packing.Sample(prompt_tokens=np.asarray(c.prompt_tokens), completion_tokens=c.tokens,
                     behaviour_logprobs=c.logprobs, versions=c.versions,
                     advantage=float(a), reward=float(r), group_id=group_id)
      for c, a, r in zip(completions, adv_G, rewards_G)]
  return stream_lib.Group(group_id=group_id, problem_id=problem.id, samples=samples,
                          rewards=rewards_G, statuses=statuses,
                          num_masked=len(statuses) - len(samples), finished_at=time.monotonic(),
                          hit_length_limit=hit_length_limit)


class Actor:
  """Mutable state of the generation side lives here and nowhere else."""

  def __init__(self, engine: api.Engine, problems: Iterator[tasks_base.Problem],
               task: tasks_base.Task,
               encode: Callable[[tasks_base.Problem], list[int]],
               decode: Callable[[np.ndarray], str], stream: stream_lib.SampleStream,
               config: ActorConfig, stop: threading.Event,
               group_ids: Iterator[int] | None = None):
    """`group_ids` numbers the `problems` (default 0, 1, ...; a resumed run starts later);
    `task` scores them."""
    self.engine, self.problems, self.task = engine, problems, task
    self.encode, self.decode = encode, decode
    self.stream, self.config, self.stop = stream, config, stop
    self.busy_intervals: list[tuple[float, float]] = []   # engine steps that did work
    self.groups_emitted = 0
    self.groups_dropped = 0        # all-equal rewards, when drop_zero_advantage_groups
    self.samples_masked = 0        # dropped because the task masked them
    self.groups_masked = 0         # dropped because every sample was masked
    self._group_ids = itertools.count() if group_ids is None else group_ids
    self._open: dict[int, dict[str, Any]] = {}

  def _admit(self) -> None:
    g = self.config.group_size
    while (self.engine.num_unfinished + g <= self.config.num_slots
           and self.stream.try_acquire(g)):
      gid = next(self._group_ids)
      problem = next(self.problems)
      prompt = self.encode(problem)
      self._open[gid] = dict(problem=problem, completions=[None] * g)
      for j in range(g):
        self.engine.submit(api.Request(
            request_id=f'{gid}/{j}', prompt_tokens=prompt, sampling=self.config.sampling,
            seed=request_seed(self.config.seed, gid, j), metadata=dict(group=gid, index=j)))

  def _collect(self, completion: api.Completion) -> None:
    gid, j = completion.metadata['group'], completion.metadata['index']
    entry = self._open[gid]
    entry['completions'][j] = completion
    if any(c is None for c in entry['completions']):
      return
    del self._open[gid]
    problem, completions = entry['problem'], entry['completions']
    # One call per group (math judges its samples in parallel), told which samples hit the
    # length limit and how long they are.
    scores = self.task.score_many(
        [problem] * len(completions), [self.decode(c.tokens) for c in completions],
        [c.finish_reason == 'length' for c in completions], [len(c.tokens) for c in completions])
    group = make_group(gid, problem, completions, scores, self.config)
    num_masked = len(completions) - (len(group.samples) if group else 0)
    self.samples_masked += num_masked
    self.stream.release(num_masked)  # masked samples are never trained: free their slots now
    if group is None:
      self.groups_masked += 1
      return
    if (self.config.drop_zero_advantage_groups
        and not bool(losses.nonzero_groups(np.array([[s.advantage for s in group.samples]]))[0])):
      self.groups_dropped += 1
      self.stream.ledger.mark([gid])
      self.stream.release(len(group.samples))
      return
    self.groups_emitted += 1
    self.stream.put(group)

  def counters(self) -> dict[str, int]:
    """Totals since the start, for the metrics records."""
    return dict(groups_emitted=self.groups_emitted, groups_dropped=self.groups_dropped,
                samples_masked=self.samples_masked, groups_masked=self.groups_masked)

  def run(self) -> None:
    while not self.stop.is_set():
      self._admit()
      if self.engine.num_unfinished == 0:
        # Out of credits: the trainer is behind by max_lag steps. Wait for it.
        self.stream.wait_for_credit(self.config.group_size, timeout=0.05)
        continue
      t0 = time.monotonic()
      finished = self.engine.step()
      self.busy_intervals.append((t0, time.monotonic()))
      for c in finished:
        self._collect(c)
