"""A scripted `api.Engine` and a fake learner: the actor and trainer loops without a model.

The loops' rules (the credit bound, stale drops, the conventional k-step sync, masked credits,
the resume ledger) are about which sample goes where and when, not about numerics; these
stand-ins make them testable in well under a second:

  engine = scripted.ScriptedEngine(num_slots=16)            # completions from a script
  result = scripted.run_loops(engine, trainer_config, actor_config, capacity=16)
  result.trained        # [[group ids of step 1], [of step 2], ...]

`ScriptedEngine` admits pending requests into free slots and draws one token per busy slot per
`step()`, each stamped with the version of the weights in place at that step (an update waits
for the next step, as the API says). What a request generates is `script(request)`; `hold(request,
version)` keeps a finished request in its slot (a straggler) until it returns False. A finished
`continuable` request is held (`held`) until a request `continues` it or `release` drops it, as
an engine that keeps its KV would; `released` lists the ids released.
`FakeLearner` is a TrainState stand-in (`.step`, `.params`) and a train step that only counts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from typing import Any, Callable, Iterator

from pipelinerl_jax.generation import api
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import base as tasks_base


def two_tokens(request: api.Request) -> list[int]:
  """The default script: two tokens, the sample's index within its group then a stop token."""
  return [int(request.metadata.get('index', 0)), 1]


class ScriptedEngine(api.Engine):
  """Deterministic continuous batching: see the module docstring. Thread-safe as the API asks
  (`submit` and `update_params` from any thread, `step` from one)."""

  def __init__(self, num_slots: int, script: Callable[[api.Request], list[int]] = two_tokens,
               hold: Callable[[api.Request, int], bool] = lambda request, version: False,
               logprob: float = -0.5):
    self.num_slots, self.script, self.hold, self.logprob = num_slots, script, hold, logprob
    self.queue = api.RequestQueue()
    self.busy: list[api.SequenceRecord] = []
    self.version = 0
    self._update: tuple[Any, int] | None = None
    self._lock = threading.Lock()
    self.params: Any = None
    self.tokens_generated = 0
    self.steps = 0
    self.max_unfinished = 0          # the most requests unfinished at once, over all steps
    self.completed: list[str] = []   # request ids, in the order they were returned
    self.held: set[str] = set()      # finished continuable requests not continued or released
    self.released: list[str] = []
    self.closed = False

  def submit(self, request: api.Request) -> None:
    if self.closed:
      raise RuntimeError('engine is closed')
    self.queue.submit(request)
    self.held.discard(request.continues)
    self.max_unfinished = max(self.max_unfinished, self.queue.num_unfinished)

  def update_params(self, params: Any, version: int) -> None:
    with self._lock:
      self._update = (params, version)

  def step(self) -> list[api.Completion]:
    with self._lock:
      if self._update is not None:
        self.params, self.version = self._update
        self._update = None
    self.steps += 1
    self.busy += [api.SequenceRecord(r) for r in self.queue.take(self.num_slots - len(self.busy))]
    done, finished, drew = [], [], False
    for record in list(self.busy):
      want = self.script(record.request)
      if len(record.tokens) < len(want):
        record.append(want[len(record.tokens)], self.logprob, self.version)
        self.tokens_generated += 1
        drew = True
      if len(record.tokens) == len(want) and not self.hold(record.request, self.version):
        self.busy.remove(record)
        finished.append(record)
        done.append(record.completion('stop'))
    if not drew and not done:
      time.sleep(0.001)  # only stragglers held: do not spin a core the trainer needs
    self.queue.finish(c.request_id for c in done)
    self.completed += [c.request_id for c in done]
    self.held.update(r.request.request_id for r in finished if r.request.continuable)
    return done

  def release(self, request_id: str) -> None:
    self.released.append(request_id)
    self.held.discard(request_id)

  def stats(self) -> dict[str, Any]:
    return dict(tokens_generated=self.tokens_generated, tokens_per_s=0.0,
                busy_slots=len(self.busy), pending=self.queue.num_pending, version=self.version)

  @property
  def num_unfinished(self) -> int:
    return self.queue.num_unfinished

  def close(self) -> None:
    self.closed = True


@dataclasses.dataclass
class ScriptedTask(tasks_base.Task):
  """Problem i is 'p{i}'. The reward of a completion is its first token's parity (the samples of
  a group differ, so advantages are not all zero); `mask(text)` leaves a sample out."""
  mask: Callable[[str], bool] = lambda text: False

  def problems(self, seed: int) -> Iterator[tasks_base.Problem]:
    i = 0
    while True:
      yield tasks_base.Problem(id=f'p{i}', prompt=f'p{i}', answer='')
      i += 1

  def score(self, problem, completion_text, truncated=False, num_tokens=None):
    first = int(completion_text.split()[0])
    return tasks_base.Score(float(first % 2), 'correct' if first % 2 else 'wrong',
                            mask=self.mask(completion_text))


def encode(problem: tasks_base.Problem) -> list[int]:
  return [2, 3]


def decode(tokens) -> str:
  return ' '.join(str(int(t)) for t in tokens)


class FakeLearner:
  """`state` has `.step` and `.params`; `train_step` advances the step and returns the metrics a
  real one does. `delay_s` makes each step take that long (a trainer slower than the actor)."""

  def __init__(self, step: int = 0, delay_s: float = 0.0):
    self.state = types.SimpleNamespace(step=step, params={'version': step})
    self.delay_s = delay_s

  def train_step(self, state, batch):
    if self.delay_s:
      time.sleep(self.delay_s)
    step = state.step + 1
    return (types.SimpleNamespace(step=step, params={'version': step}),
            {'loss': 0.0, 'grad_norm': 0.0, 'ess': 1.0})


class RecordingTrainer(trainer_lib.Trainer):
  """The real trainer, recording the group ids each optimizer step trains on (and the groups)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.trained: list[list[int]] = []
    self.groups: list[stream_lib.Group] = []

  def _one_step(self, groups):
    self.trained.append([g.group_id for g in groups])
    self.groups += groups
    return super()._one_step(groups)


@dataclasses.dataclass
class Result:
  actor: actor_lib.Actor
  trainer: RecordingTrainer
  stream: stream_lib.SampleStream
  records: list[dict]            # the trainer's step records
  published: list[int]           # versions, in publication order
  trained: list[list[int]]       # group ids per optimizer step


def trainer_config(batch_size: int = 8, total_steps: int = 6, **kwargs
                   ) -> trainer_lib.TrainerConfig:
  return trainer_lib.TrainerConfig(batch_size=batch_size, seq_len=64, micro_batches=1,
                                   row_multiple=1, total_steps=total_steps, **kwargs)


def actor_config(group_size: int = 4, num_slots: int = 16, **kwargs) -> actor_lib.ActorConfig:
  return actor_lib.ActorConfig(group_size=group_size, num_slots=num_slots,
                               sampling=api.SamplingParams(max_tokens=8), **kwargs)


def encode_text(text: str) -> list[int]:
  """An observation's tokens: `decode`'s inverse."""
  return [int(t) for t in text.split()]


def run_loops(engine: ScriptedEngine, trainer_cfg: trainer_lib.TrainerConfig,
              actor_cfg: actor_lib.ActorConfig, capacity: int,
              task: tasks_base.Task | None = None, learner: FakeLearner | None = None,
              position: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Result:
  """The actor in a thread and the trainer in this one, as a run wires them (publish goes to
  the engine), until the trainer's total_steps. `position` resumes from a checkpoint's data
  position (the ledger, and the problems still to do). A loop that does not finish within
  `timeout_s` (a credit leak deadlocks them) fails the test rather than hanging it."""
  from pipelinerl_jax import checkpoint as checkpoint_lib
  task = task or ScriptedTask()
  learner = learner or FakeLearner()
  stop = threading.Event()
  stream = stream_lib.SampleStream(
      capacity, stop, ledger=stream_lib.GroupLedger(**position) if position else None)
  group_ids, problems = checkpoint_lib.data_stream(task.problems(0), position)
  actor = actor_lib.Actor(engine, problems, task, encode, decode, stream, actor_cfg, stop,
                          group_ids=group_ids, encode_text=encode_text)
  records, published = [], []

  def publish(params, version):
    published.append(version)
    engine.update_params(params, version)

  engine.update_params(learner.state.params, learner.state.step)  # as build does on resume
  trainer = RecordingTrainer(learner.state, learner.train_step, lambda batch: batch, publish,
                             stream, trainer_cfg, stop, records.append, engine.stats)
  errors = []

  def actor_loop():
    try:
      actor.run()
    except BaseException as e:  # surfaced below, in the test's thread
      errors.append(e)
      stop.set()

  thread = threading.Thread(target=actor_loop, name='scripted-actor', daemon=True)
  watchdog = threading.Timer(timeout_s, stop.set)
  thread.start()
  watchdog.start()
  try:
    trainer.run()
  except stream_lib.Stopped:
    pass
  finally:
    timed_out = not watchdog.is_alive()
    watchdog.cancel()
    stop.set()
    thread.join(5)
  if errors:
    raise errors[0]
  assert not timed_out and not thread.is_alive(), (
      f'the loops did not finish in {timeout_s} s: step {trainer.step} of '
      f'{trainer_cfg.total_steps}, stream {stream.stats()}, engine {engine.stats()}')
  return Result(actor, trainer, stream, [r for r in records if 'step' in r], published,
                trainer.trained)
