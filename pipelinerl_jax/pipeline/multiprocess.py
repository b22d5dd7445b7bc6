"""One trainer in several processes (train.num_processes > 1, one per host; distributed.py).

Process 0 runs the pipeline as a single process does (actor, sample stream, trainer loop,
metrics, the checkpoints' JSON). Every other process *follows*: it holds its shards of the train
state and makes the same collective calls in the same order, told which by process 0. Before
each such call process 0 announces it with a small JSON command in jax.distributed's key-value
store and, for a train step, broadcasts the packed batch. The calls:

  train     the packed batch -> every process places the rows its devices hold; one step
  publish   the new weights gathered whole on every process; process 0's go to the engine. With
            trainer processes as Ray actors (pipeline/trainer_actors.py): each process puts the
            pieces it holds into Ray's object store instead, for the generator actors; or, over
            a collective transport, every process gathers a whole copy onto its own devices and
            process 0 broadcasts its copy
  evaluate  the gather; process 0 evaluates
  save      orbax writes every process's shards, and the meta JSON once
  stop      the run is over

Process 0 packs the whole batch as one process does and broadcasts it. So the step sees the very
batch a single process would; packing costs little next to a step (docs/scaling.md: "Several
trainer processes"), and packing per process would still need the samples sent and a row count
agreed.

Stopping. The run ends when process 0 says so (`stop`). When it fails, it raises a stop flag
every follower watches (in a thread, so one stuck in a collective is reached too): each answers
and exits at once. A follower that does not answer is gone (killed, or its host lost); the
run's error names it and its host. A follower whose heartbeat stands still for
train.distributed.heartbeat_timeout_s (distributed.Heartbeats: killed, hung, or its host cut off,
when nothing fails on process 0 but a collective that never completes) is lost: `watch`, a loop
of the run, stops it with that line. A stop request on a follower (Ctrl-C, SIGTERM) goes to
process 0, which stops the run as after its own Ctrl-C (saving first). A follower that cannot
reach process 0 for the heartbeat timeout stops itself.
"""

from __future__ import annotations

import _thread
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax import train
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import placements
from pipelinerl_jax.pipeline import supervise

COMMAND_KEY = 'pipelinerl/command/'
READ_KEY = 'pipelinerl/command_read/'    # the last command a follower read
STOP_FLAG = 'pipelinerl/stop'
ANSWER_KEY = 'pipelinerl/answer/'          # a follower's answer to the stop flag
STOP_REQUEST_KEY = 'pipelinerl/stop_request/'
WAIT_SLICE_MS = 2_000  # blocking reads come back this often (a signal is handled in between)


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f'{type(e).__name__}: {lines[0] if lines else ""}'[:300]


def _timed_out(e: BaseException) -> bool:
  return isinstance(e, jax.errors.JaxRuntimeError) and 'DEADLINE_EXCEEDED' in str(e)


class Commands:
  """Process 0 -> the followers: the next collective call, in order. On process 0,
  `stop_request` is what a follower's stop request sets (the run's interrupt event; None:
  interrupt the main thread, as Ctrl-C)."""

  def __init__(self, stop_request: threading.Event | None = None):
    self._client = distributed.coordination_client()
    self._next = 0
    self._kept = 0  # commands before this one are deleted from the store
    self._stop_request = stop_request
    self._forwarded = False

  def send(self, op: str, arrays: dict[str, np.ndarray] | None = None, **fields) -> None:
    self._forward_stop_request()
    arrays = arrays or {}
    header = dict(op=op, fields=fields,
                  arrays={k: (list(v.shape), v.dtype.str) for k, v in arrays.items()})
    self._client.key_value_set(f'{COMMAND_KEY}{self._next}', json.dumps(header))
    self._next += 1
    self._delete_read()
    if arrays:
      multihost_utils.broadcast_one_to_all(arrays)

  def _delete_read(self) -> None:
    """Deletes the commands every follower has read. (Not those before the latest call alone:
    a call may need no communication, e.g. a publication of params every process holds whole,
    and process 0 then runs ahead of a follower by several commands.)"""
    read = [int(v) for _, v in self._client.key_value_dir_get(READ_KEY)]
    done = min(read) + 1 if len(read) == jax.process_count() - 1 else 0
    for i in range(self._kept, done):
      self._client.key_value_delete(f'{COMMAND_KEY}{i}')
    self._kept = max(self._kept, done)

  def receive(self, while_waiting: Callable[[], None] = lambda: None
              ) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """(op, fields, arrays) of the next command; blocks until process 0 sends it, calling
    `while_waiting` every WAIT_SLICE_MS."""
    key = f'{COMMAND_KEY}{self._next}'
    while True:
      while_waiting()
      try:
        header = json.loads(self._client.blocking_key_value_get(key, WAIT_SLICE_MS))
        break
      except jax.errors.JaxRuntimeError as e:
        if not _timed_out(e):
          raise
    self._client.key_value_set(f'{READ_KEY}{jax.process_index()}', str(self._next),
                               allow_overwrite=True)
    self._next += 1
    arrays = {}
    if header['arrays']:
      zeros = {k: np.zeros(shape, np.dtype(dtype))
               for k, (shape, dtype) in header['arrays'].items()}
      arrays = multihost_utils.broadcast_one_to_all(zeros, is_source=False)
    return header['op'], header['fields'], arrays

  def _forward_stop_request(self) -> None:
    """A follower asked to stop (see `follow`): stop the run as Ctrl-C here would. Only while
    the loops run (their calls come from the trainer's thread): the main thread's own calls are
    the final save, when the run is ending anyway."""
    if self._forwarded or threading.current_thread() is threading.main_thread():
      return
    requests = self._client.key_value_dir_get(STOP_REQUEST_KEY)
    if requests:
      self._forwarded = True
      request = json.loads(requests[0][1])
      print(f"[run] stop requested by {request['who']}", flush=True)
      if self._stop_request is None:
        _thread.interrupt_main()
      else:
        self._stop_request.signum = request['signum']  # the follower's signal: the exit status
        self._stop_request.set()

  def stop(self, error: str | None, grace_s: float) -> list[str]:
    """Ends the followers: `stop` in order, and the stop flag for those stuck in a call.
    After a failure (`error`), waits up to grace_s for every follower's answer but those known
    lost (their heartbeat stood still); returns what is known of those that did not answer
    (they are gone)."""
    self._client.key_value_set(STOP_FLAG, json.dumps(dict(error=error)))
    self._client.key_value_set(f'{COMMAND_KEY}{self._next}',
                               json.dumps(dict(op='stop', fields={}, arrays={})))
    if error is None:
      return []
    lost = distributed.lost_processes()
    missing = set(range(1, jax.process_count()))
    deadline = time.monotonic() + grace_s
    while missing - set(lost) and time.monotonic() < deadline:
      answered = {int(k.rsplit('/', 1)[1]) for k, _ in self._client.key_value_dir_get(ANSWER_KEY)}
      missing -= answered
      time.sleep(0.05)
    last_words = distributed.last_words()
    return [f'{distributed.describe(i)} ' + (
        f'failed: {last_words[i]}' if i in last_words else distributed.gone(lost.get(i)))
        for i in sorted(missing)]


def grace_seconds(config: config_lib.Config) -> float:
  """How long process 0 waits for the followers' answers: well within the heartbeat timeout,
  after which jax.distributed ends every process with a fatal log."""
  return min(5.0, config.train.distributed.heartbeat_timeout_s / 3)


# --- process 0 ---------------------------------------------------------------------------------


class _AnnouncedCheckpoints:
  """The run's Checkpointer; a save is announced first (every process writes its shards)."""

  def __init__(self, checkpoints, commands: Commands):
    self._checkpoints, self._commands = checkpoints, commands

  def save(self, state: train.TrainState, meta: dict[str, Any]) -> bool:
    self._commands.send('save', meta=meta)
    return self._checkpoints.save(state, meta)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._checkpoints, name)


def lead(parts: build_lib.Parts, commands: Commands, sharded: bool = False) -> build_lib.Parts:
  """Process 0's parts, each call that involves every process announced to the followers
  first. The evaluation gets the params whole (`distributed.whole`); so does the engine, unless
  `sharded`: generator actors get every process's pieces (pipeline/trainer_actors.py)."""
  put_batch, publish, evaluate = parts.put_batch, parts.publish, parts.evaluate

  def put_batch_everywhere(batch: dict[str, np.ndarray]):
    commands.send('train', arrays={k: batch[k] for k in train.BATCH_KEYS})
    return put_batch(batch)

  def publish_announced(params, version: int) -> None:
    commands.send('publish', version=version)
    publish(params if sharded else distributed.whole(params), version)

  def evaluate_whole(params, step: int) -> dict:
    commands.send('evaluate', step=step)
    return evaluate(distributed.whole(params), step)

  checkpoints = _AnnouncedCheckpoints(parts.learner.checkpoints, commands)
  return dataclasses.replace(
      parts, put_batch=put_batch_everywhere, publish=publish_announced,
      evaluate=evaluate_whole if evaluate else None,
      learner=dataclasses.replace(parts.learner, checkpoints=checkpoints))


class Followers:
  """Process 0's side of the other trainer processes (with one process, nothing):
  `announce(parts)` makes every call that involves them announced (`lead`); leaving the block
  ends them, and after a failure names any that is gone (TrainerProcessError). `sharded`: they
  publish their own pieces of the params (trainer actors)."""

  def __init__(self, config: config_lib.Config, stop_request: threading.Event | None = None,
               sharded: bool = False):
    self._grace_s = grace_seconds(config)
    self._sharded = sharded
    self._commands = Commands(stop_request) if distributed.several_processes() else None

  def announce(self, parts: build_lib.Parts) -> build_lib.Parts:
    return parts if self._commands is None else lead(parts, self._commands, self._sharded)

  def watch(self, stop: threading.Event, check: Callable[[], None] = lambda: None) -> None:
    """A loop of the run (several processes), until `stop` is set: raises TrainerProcessError
    once a follower failed or is lost (distributed.check_peers), or when `check()` raises
    (trainer actors: one whose Ray call ended)."""
    while not stop.wait(distributed.heartbeat_interval_s()):
      check()
      distributed.check_peers()

  def __enter__(self) -> 'Followers':
    return self

  def __exit__(self, kind, error, traceback) -> None:
    if self._commands is None:
      return
    if error is None:
      self._commands.stop(error=None, grace_s=0)
      distributed.stop_heartbeats()  # the followers leave now
      return
    lost = self._commands.stop(error=_first_line(error), grace_s=self._grace_s)
    seen = error.__cause__ if isinstance(error.__cause__, supervise.TrainerProcessError) else None
    if seen is not None:  # the run's watch found a trainer process gone: that says it all
      raise supervise.TrainerProcessError(f'{seen}. All trainer processes stopped') from error
    if lost:
      raise supervise.TrainerProcessError(
          f'{"; ".join(lost)}. All trainer processes stopped (seen by process 0: '
          f'{_first_line(error)})') from error


# --- the other processes -----------------------------------------------------------------------


def _watch_stop_flag(client) -> None:
  """A follower's thread: when process 0 raises the stop flag after a failure, answer and exit
  at once (the main thread may be waiting in a collective that will never complete)."""
  while True:
    try:
      flag = json.loads(client.blocking_key_value_get(STOP_FLAG, 60_000))
      break
    except jax.errors.JaxRuntimeError as e:
      if not _timed_out(e):
        return  # process 0's coordinator is gone: jax.distributed ends this process
  if flag['error'] is None:
    return  # a normal end: the main thread returns by itself
  client.key_value_set(f'{ANSWER_KEY}{jax.process_index()}', 'stopping')
  print(f'{distributed.describe()}: stopped, because process 0 stopped: {flag["error"]}',
        file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)


def follow(config: config_lib.Config, workdir: str, model_dir: str,
           interrupt: threading.Event | None = None, stash=None) -> dict[str, Any]:
  """A follower's whole run: its shards of the train state, the same calls as process 0.
  `interrupt` set (a signal here: main's handlers) asks process 0 to stop the run, which it does
  as after its own Ctrl-C, saving first; this process keeps following until then. `stash` (a
  trainer actor's, trainer_actors.Stash): where it publishes its own pieces of the params, for
  the generator actors (over a collective transport, the gather of a copy per process instead);
  without it, a publication is a gather of the whole params."""
  client = distributed.coordination_client()
  threading.Thread(target=_watch_stop_flag, args=(client,), name='stop-flag', daemon=True).start()
  forwarded = []

  def forward_stop_request():
    if interrupt is not None and interrupt.is_set() and not forwarded:
      forwarded.append(True)
      client.key_value_set(f'{STOP_REQUEST_KEY}{jax.process_index()}', json.dumps(dict(
          who=distributed.describe(), signum=getattr(interrupt, 'signum', None))))
      print(f'{distributed.describe()}: stop requested; process 0 stops the run',
            file=sys.stderr, flush=True)

  try:
    learner = build_lib.build_learner(config, workdir, model_dir)
    if stash is None:
      publish = lambda params, version: distributed.whole(params)  # noqa: E731 (a collective)
    elif config.generation.remote.weight_transport != 'object_store':
      wire_dtype = placements.transport_dtype(config, learner.model_config, model_dir)

      def publish(params, version):  # the gather that gives process 0 its copy to broadcast
        del version
        distributed.whole_per_process(params, wire_dtype)  # (this process's copy is dropped)
    else:
      publish = stash.publish
    publish(learner.state.params, int(learner.state.step))  # what process 0's build hands its engine
    put_batch = build_lib.batch_placer(config.train, learner.mesh)
    commands = Commands()
    state = learner.state
    while True:
      op, fields, arrays = commands.receive(while_waiting=forward_stop_request)
      if op == 'train':
        state, _ = learner.train_step(state, put_batch(arrays))
        jax.block_until_ready(state.step)  # a failure shows in its own call
      elif op == 'publish':
        publish(state.params, fields['version'])
      elif op == 'evaluate':
        distributed.whole(state.params)
      elif op == 'save':
        learner.checkpoints.save(state, fields['meta'])
      elif op == 'stop':
        break
      else:
        raise ValueError(f'unknown command {op!r} from process 0')
    distributed.stop_heartbeats()  # process 0 may leave first now
    learner.checkpoints.close()
  except BaseException as e:
    distributed.say_last_words(e)
    raise supervise.TrainerProcessError(
        f'{distributed.describe()} failed: {_first_line(e)}') from e
  return dict(steps=int(state.step), follower=True, interrupted=bool(forwarded),
              final_state=state)
