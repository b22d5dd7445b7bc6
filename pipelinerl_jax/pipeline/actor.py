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

A multi-turn task (one whose `environment()` is not None) makes each of a group's G samples an
episode (episodes.py): when a turn finishes, the environment answers it and the next turn is
submitted at once, its prompt the whole history; when all G episodes have ended the group is
made as above, rewards the episode returns. An episode holds its one sample credit from
admission to emission, and at most one of its turns is in the engine at a time, so the engine
never holds more than H requests. A one-turn task takes the path it always took.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import zlib
from typing import Any, Callable, Iterator

import numpy as np

from pipelinerl_jax import episodes as episodes_lib
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
  max_seq_len: int = 0                 # the engine's prompt + completion limit (bounds episodes)


def request_seed(seed: int, group_id: int, index: int) -> int:
  """Distinct, reproducible per-sample seeds (the G samples of a prompt must differ)."""
  return zlib.crc32(f'{seed}/{group_id}/{index}'.encode()) & 0x7FFFFFFF


def make_group(group_id: int, problem: tasks_base.Problem, completions: list[api.Completion],
               scores: list[tasks_base.Score], config: ActorConfig,
               loss_masks: list[np.ndarray] | None = None,
               episodes: list[episodes_lib.EpisodeStats] = ()) -> stream_lib.Group | None:
  """The group of the unmasked samples, advantages computed over them alone; None when every
  sample is masked. `statuses` keeps all G samples' statuses (the metrics count them all).
  `loss_masks` / `episodes`: a multi-turn task's, one per sample (all G)."""
  statuses = [s.status for s in scores]
  hit_length_limit = [c.finish_reason == 'length' for c in completions]
  masks = loss_masks if loss_masks is not None else [None] * len(completions)
  kept = [(c, s, m) for c, s, m in zip(completions, scores, masks) if not s.mask]
  if not kept:
    return None
  rewards_G = np.array([s.reward for _, s, _ in kept], np.float32)
  adv_G = np.asarray(losses.group_advantages(
      rewards_G[None], baseline=config.advantage_baseline,
      normalize_std=config.advantage_normalize_std))[0]
  samples = [
      packing.Sample(prompt_tokens=np.asarray(c.prompt_tokens), completion_tokens=c.tokens,
                     behaviour_logprobs=c.logprobs, versions=c.versions,
                     advantage=float(a), reward=float(r), group_id=group_id, loss_mask=m,
                     routes=c.routes)
      for (c, _, m), a, r in zip(kept, adv_G, rewards_G)]
  return stream_lib.Group(group_id=group_id, problem_id=problem.id, samples=samples,
                          rewards=rewards_G, statuses=statuses,
                          num_masked=len(statuses) - len(samples), finished_at=time.monotonic(),
                          hit_length_limit=hit_length_limit, episodes=list(episodes))


class Actor:
  """Mutable state of the generation side lives here and nowhere else."""

  def __init__(self, engine: api.Engine, problems: Iterator[tasks_base.Problem],
               task: tasks_base.Task,
               encode: Callable[[tasks_base.Problem], list[int]],
               decode: Callable[[np.ndarray], str], stream: stream_lib.SampleStream,
               config: ActorConfig, stop: threading.Event,
               group_ids: Iterator[int] | None = None,
               encode_text: Callable[[str], list[int]] | None = None):
    """`group_ids` numbers the `problems` (default 0, 1, ...; a resumed run starts later);
    `task` scores them. `encode_text`: an observation's token ids (a multi-turn task's)."""
    self.engine, self.problems, self.task = engine, problems, task
    self.encode, self.decode, self.encode_text = encode, decode, encode_text
    self.limits = episodes_lib.limits_of(task, config.sampling, config.max_seq_len)
    self.stream, self.config, self.stop = stream, config, stop
    self.busy_intervals: list[tuple[float, float]] = []   # engine steps that did work
    self.groups_emitted = 0
    self.groups_dropped = 0        # all-equal rewards, when drop_zero_advantage_groups
    self.samples_masked = 0        # dropped because the task masked them
    self.groups_masked = 0         # dropped because every sample was masked
    self.episode_outcomes: collections.Counter = collections.Counter()  # multi-turn tasks
    self._group_ids = itertools.count() if group_ids is None else group_ids
    self._open: dict[int, dict[str, Any]] = {}

  def _admit(self) -> None:
    g = self.config.group_size
    while (self.engine.num_unfinished + g <= self.config.num_slots
           and self.stream.try_acquire(g)):
      gid = next(self._group_ids)
      problem = next(self.problems)
      env = self.task.environment()
      if env is not None:
        self._start_episodes(gid, problem, [env] + [self.task.environment() for _ in range(g - 1)])
        continue
      prompt = self.encode(problem)
      self._open[gid] = dict(problem=problem, completions=[None] * g)
      for j in range(g):
        self.engine.submit(api.Request(
            request_id=f'{gid}/{j}', prompt_tokens=prompt, sampling=self.config.sampling,
            seed=request_seed(self.config.seed, gid, j), metadata=dict(group=gid, index=j)))

  def _start_episodes(self, gid: int, problem: tasks_base.Problem,
                      envs: list[tasks_base.Environment]) -> None:
    if self.encode_text is None:
      raise ValueError(f'task {self.task.name} is multi-turn: the actor needs encode_text')
    self._open[gid] = entry = dict(problem=problem, episodes=[])
    for j, env in enumerate(envs):
      episode, request = episodes_lib.start(
          problem, env, self.encode, self.limits, request_id=f'{gid}/{j}',
          seed=request_seed(self.config.seed, gid, j), metadata=dict(group=gid, index=j))
      entry['episodes'].append(episode)
      if request is not None:
        self.engine.submit(request)
    if all(e.done for e in entry['episodes']):  # every reset failed
      self._end_episodes(gid)

  def _collect(self, completion: api.Completion) -> None:
    gid, j = completion.metadata['group'], completion.metadata['index']
    entry = self._open[gid]
    if 'episodes' in entry:
      episode = entry['episodes'][j]
      request = episodes_lib.on_turn(episode, completion, decode=self.decode,
                                     encode_text=self.encode_text, limits=self.limits)
      if request is not None:
        self.engine.submit(request)
        return
      self.engine.release(completion.request_id)
      if all(e.done for e in entry['episodes']):
        self._end_episodes(gid)
      return
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
    self._emit(gid, make_group(gid, problem, completions, scores, self.config),
               len(completions))

  def _end_episodes(self, gid: int) -> None:
    entry = self._open.pop(gid)
    episodes = entry['episodes']
    self.episode_outcomes.update(e.outcome for e in episodes)
    group = make_group(gid, entry['problem'], [episodes_lib.completion(e) for e in episodes],
                       [e.score for e in episodes], self.config,
                       loss_masks=[episodes_lib.loss_mask(e) for e in episodes],
                       episodes=[episodes_lib.stats(e) for e in episodes])
    self._emit(gid, group, len(episodes))

  def _emit(self, gid: int, group: stream_lib.Group | None, num_samples: int) -> None:
    """Sends a finished group to the trainer, or drops it (masked, all-equal rewards)."""
    num_masked = num_samples - (len(group.samples) if group else 0)
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
                samples_masked=self.samples_masked, groups_masked=self.groups_masked,
                **{f'episodes_{outcome}': n for outcome, n in self.episode_outcomes.items()})

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
