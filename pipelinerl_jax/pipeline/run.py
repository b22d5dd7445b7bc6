"""A run's lifecycle, the paper's Algorithm 2: build the parts, run the actor and the trainer
concurrently, joined by the sample stream, supervise them, save at exit.

Actor and trainer are two threads of this process (JAX releases the GIL while it computes), so
generation and training overlap. The main thread only supervises: the first exception in either
loop, or Ctrl-C, stops both within seconds, and the error names the loop that failed.

Before anything heavy starts, the run checks its outputs (workdir and checkpoint dir writable,
room for the checkpoints) and locks them (pipeline/workdir.py); a stop request (a signal, see
pipeline/signals.py) is honoured between start-up phases. Whatever fails, every part that was
started is closed, and a failure while closing never hides the error that ended the run.

With several trainer processes (train.num_processes), process 0 runs this lifecycle and the
others follow its calls (pipeline/multiprocess.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable

import ml_collections

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import cluster as cluster_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax import platforms
from pipelinerl_jax import train
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import multiprocess
from pipelinerl_jax.pipeline import signals
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import workdir as workdir_lib

STOP_TIMEOUT_S = 10.0
# After an interrupt, a loop busy with one step (an XLA compile: minutes on a GPU host) is waited
# for this much longer, so that what it trains is saved; a second signal exits at once.
INTERRUPTED_STEP_TIMEOUT_S = 600.0


class RunError(RuntimeError):
  """A loop of the run failed; the message names it and the original error."""


def run_with_model(config: config_lib.Config, workdir: str,
                   interrupt: threading.Event | None = None, trainers=None) -> dict[str, Any]:
  """Joins the trainer's processes, finds or builds the model (config.model.path or the demo
  model), then `run`. What every trainer process runs; `launch.run_experiment` (the main
  command) starts the others first when they are Ray actors."""
  config = config_lib.validate(config, runnable=False)
  distributed.initialize(config.train)  # before any JAX computation; nothing for one process
  platforms.check(config)  # a run meant for GPUs on a CPU: before anything else is looked at
  config.check_runnable()
  build_lib.check_backend_installed(config)  # before the demo model is built
  workdir_lib.check_dir(workdir, '--workdir')
  model_dir = distributed.primary_first(lambda: warmstart.model_dir_for(config), 'demo model')
  signals.check(interrupt)
  stamp = warmstart.read_stamp(model_dir)
  if stamp:
    print(f"model: {model_dir} (warm start: greedy accuracy {stamp['greedy_accuracy']:.2f}, "
          f"sampled {stamp['sampled_accuracy']:.2f})")
  return run(config, workdir, model_dir=model_dir, interrupt=interrupt, trainers=trainers)


def launches_trainers(config: config_lib.Config) -> bool:
  """Whether this run starts its other trainer processes itself, as Ray actors."""
  return config.train.num_processes > 1 and config.generation.placement == 'ray'


def run(config: ml_collections.ConfigDict | config_lib.Config, workdir: str, *,
        model_dir: str | None = None, on_ready: Callable[[dict], None] | None = None,
        interrupt: threading.Event | None = None, trainers=None) -> dict[str, Any]:
  """RL to config.rl.total_steps (or max_time_s); returns a summary dict.

  `model_dir` overrides config.model.path (the demo passes the model it built). `on_ready`
  (tests) gets the live objects once both loops run. `interrupt` (main's signal handlers set
  it): start-up stops with signals.Interrupted at its next phase; running loops stop as after
  Ctrl-C. `trainers`, with trainer processes as Ray actors (pipeline/trainer_actors.py): on
  process 0, the `Launch` of the others (which `launch.run_experiment` makes); on the others, their
  actor's `Stash`.
  """
  config = config_lib.validate(config)
  model_dir = model_dir or config.model.path
  if not model_dir:
    raise ValueError('config.model.path: no model directory given')
  if trainers is None and launches_trainers(config):
    raise ValueError('config.train.num_processes: trainer processes as Ray actors are started by '
                     'launch.run_experiment (the main command), not by run()')
  distributed.initialize(config.train)  # (run_with_model joined already, to build the model)
  if not distributed.is_primary():  # another trainer process: it follows process 0's calls
    return multiprocess.follow(config, workdir, model_dir, interrupt, stash=trainers)
  locks = claim_outputs(config, workdir, model_dir)
  try:
    with multiprocess.Followers(config, interrupt,  # none with one process
                                sharded=trainers is not None) as followers:
      return _run(config, workdir, model_dir, on_ready, interrupt, followers.announce, trainers)
  finally:
    for lock in reversed(locks):
      lock.release()


def claim_outputs(config: config_lib.Config, workdir: str, model_dir: str
                  ) -> list[workdir_lib.DirLock]:
  """Checks the workdir and the checkpoint dir (directories, writable, room for the
  checkpoints this run keeps) and locks them; all before the model loads."""
  workdir_lib.check_dir(workdir, '--workdir')
  locks = [workdir_lib.DirLock(workdir, '--workdir').acquire()]
  try:
    ckpt_dir = checkpoint_lib.directory(config, workdir)
    workdir_lib.check_dir(ckpt_dir, 'config.checkpoint.dir')
    if os.path.commonpath([os.path.realpath(ckpt_dir), locks[0].path]) != locks[0].path:
      locks.append(workdir_lib.DirLock(ckpt_dir, 'config.checkpoint.dir').acquire())
    for lock in locks:
      if lock.took_over:
        print(f"[run] {lock.path}: taking over from pid {lock.took_over.get('pid')} "
              f"(started {lock.took_over.get('started')}), which ended without releasing it",
              flush=True)
    m = config.model
    model_config = hf_io.load_config(model_dir, param_dtype=m.param_dtype, dtype=m.dtype)
    one = checkpoint_lib.state_bytes(model_config, train.make_optimizer(config.optimizer))
    keep = config.checkpoint.keep
    have = min(keep, sum(name.isdigit() for name in os.listdir(ckpt_dir)))
    workdir_lib.check_free_space([  # orbax writes a new checkpoint before pruning the oldest
        (ckpt_dir, (keep + 1 - have) * one, 'config.checkpoint.dir'),
        (workdir, workdir_lib.MIN_WORKDIR_FREE_BYTES, '--workdir')])
  except BaseException:
    for lock in reversed(locks):
      lock.release()
    raise
  return locks


def _run(config: config_lib.Config, workdir: str, model_dir: str,
         on_ready: Callable[[dict], None] | None, interrupt: threading.Event | None,
         announce: Callable[[build_lib.Parts], build_lib.Parts], trainers) -> dict[str, Any]:
  signals.check(interrupt)
  parts = announce(build_lib.build(config, workdir, model_dir, interrupt=interrupt,
                                   trainers=trainers))
  start_step = int(parts.resumed['step']) if parts.resumed else 0
  try:
    writer = metrics_lib.MetricsWriter(
        workdir, tensorboard=config.log.tensorboard, progress=config.log.progress,
        start_step=start_step, wandb=wandb_settings(config))
  except BaseException:
    close_all([('engine', parts.engine.close), ('task', parts.task.close),
               ('checkpoints', parts.checkpoints.close)])
    raise
  if writer.dropped:
    print(f'[run] metrics.jsonl: {writer.dropped} records past step {start_step} (logged by a '
          f'run that ended before saving them) moved to {metrics_lib.DROPPED_FILE}', flush=True)

  stop = threading.Event()
  stream = stream_lib.SampleStream(
      stream_lib.capacity(config.rl, config.generation.num_slots), stop,
      ledger=stream_lib.GroupLedger(**parts.resumed['data']) if parts.resumed else None)
  actor = build_lib.make_actor(parts, stream, stop)
  records: list[dict] = []

  def log(record: dict) -> None:
    if 'step' in record:  # (not a skipped update's record: see trainer.py)
      record.update(actor.counters())
      record.update({f'task/{name}': n for name, n in parts.task.counters.items()})
      records.append(record)
    writer.write(record)

  def save(final: bool) -> None:
    if final or parts.checkpoints.due(trainer.step):
      parts.checkpoints.save(trainer.state, checkpoint_lib.run_meta(
          config, model_dir, trainer.checkpoint_meta()))

  trainer = build_lib.make_trainer(parts, stream, stop, log, after_publish=lambda: save(False))
  trainer.time_offset = writer.time_offset
  live = dict(actor=actor, trainer=trainer, engine=parts.engine, stream=stream, stop=stop,
              task=parts.task)
  loops = {'actor': actor.run, 'trainer': trainer.run}
  if trainers is not None:  # a trainer actor lost between collectives ends the run at once
    loops['trainer processes'] = lambda: trainers.watch(stop)
  outcome = None
  try:
    with cluster_lib.pinned(parts.trainer_cores):  # train.cores='free'; restored after
      outcome = supervise(loops, stop, on_ready=on_ready and (lambda: on_ready(live)),
                          interrupt=interrupt)
  finally:
    closing = close_all([('closing the engine', parts.engine.close),
                         ('closing the task', parts.task.close),
                         ('closing the metrics', writer.close)])
    if outcome is None:  # supervise itself raised: that error goes on, after the parts closed
      close_all([('checkpoints', parts.checkpoints.close)])
  lost = any(isinstance(e, multiprocess.TrainerProcessError) for _, e in outcome.errors)
  if 'trainer' not in outcome.alive + [name for name, _ in outcome.errors] and not lost:
    try:
      save(final=True)  # also after Ctrl-C or the time budget: nothing trained is lost
    except OSError as e:
      outcome.errors.append(('exit save', e))
  closing += close_all([('closing the checkpoints', parts.checkpoints.close)])
  if outcome.interrupted:
    print(f'\n[run] loops stopped {outcome.stop_s:.1f} s after the interrupt', flush=True)
  if records:
    g, rl = config.generation, config.rl
    closing += close_all([('curves', lambda: metrics_lib.plot_curves(
        records, os.path.join(workdir, 'curves.png'),
        title=f'{rl.mode}, B={rl.batch_size}, G={rl.group_size}, H={g.num_slots}'))])
  if outcome.errors:
    name, e = outcome.errors[0]
    for what, problem in closing:  # secondary: the loop's error is the one to report
      print(f'[run] also: {what} failed: {problem}', file=sys.stderr, flush=True)
    where = name if name in ('exit save', 'trainer processes') else f'{name} loop'
    raise RunError(f'{where} failed: {type(e).__name__}: {e}') from e
  if outcome.alive and not outcome.interrupted:
    raise RunError(f'{", ".join(outcome.alive)} did not stop within {STOP_TIMEOUT_S:.0f} s')
  if outcome.alive:  # asked to stop: that is what happens, busy loop or not
    print(f'[run] the {" and ".join(outcome.alive)} loop was still busy '
          f'{INTERRUPTED_STEP_TIMEOUT_S:.0f} s after the interrupt: not saving its state',
          flush=True)
  if closing:
    what, problem = closing[0]
    raise RunError(f'{what} failed: {problem}')
  return dict(
      steps=trainer.step, samples=trainer.samples_trained, interrupted=outcome.interrupted,
      wall_s=outcome.wall_s, records=records, stale_dropped=trainer.stale_dropped,
      max_lag_seen=trainer.max_lag_seen,
      gen_train_overlap_s=metrics_lib.overlap_seconds(actor.busy_intervals,
                                                      trainer.busy_intervals),
      gen_busy_s=sum(e - s for s, e in actor.busy_intervals),
      train_busy_s=sum(e - s for s, e in trainer.busy_intervals), final_state=trainer.state,
      checkpoint=parts.checkpoints.path if parts.checkpoints.last_saved else None,
      skipped_updates=trainer.skipped_updates)


def wandb_settings(config: config_lib.Config) -> dict[str, Any] | None:
  """wandb.init's arguments for MetricsWriter, or None when config.log.wandb is off."""
  log = config.log
  if not log.wandb:
    return None
  return dict(project=log.wandb_project, entity=log.wandb_entity,
              config=dataclasses.asdict(config))


def close_all(closers: list[tuple[str, Callable[[], None]]]) -> list[tuple[str, str]]:
  """Calls every closer, whatever the others do; returns (what, one-line error) of those that
  raised (a full disk fails the flushes: that must neither hide the run's own error nor skip
  the other closes)."""
  errors = []
  for name, close in closers:
    try:
      close()
    except Exception as e:
      lines = str(e).strip().splitlines()
      errors.append((name, f'{type(e).__name__}: {lines[0] if lines else ""}'))
  return errors


@dataclasses.dataclass
class Outcome:
  interrupted: bool                             # Ctrl-C (or SIGTERM, see main.py)
  errors: list[tuple[str, BaseException]]       # loops that raised, in order
  alive: list[str]                              # loops that did not stop in time
  stop_s: float                                 # interrupt -> loops stopped
  wall_s: float


def supervise(loops: dict[str, Callable[[], None]], stop: threading.Event,
              on_ready: Callable[[], None] | None = None,
              interrupt: threading.Event | None = None) -> Outcome:
  """Runs each loop in a thread until one ends (any loop ending ends the run), `stop` is set,
  `interrupt` is set (a signal) or Ctrl-C; then stops them all, waiting at most STOP_TIMEOUT_S
  (after an interrupt, up to INTERRUPTED_STEP_TIMEOUT_S more for a loop busy with a step)."""
  errors: list[tuple[str, BaseException]] = []

  def guarded(name, fn):
    def body():
      try:
        fn()
      except stream_lib.Stopped:
        pass
      except BaseException as e:  # reported by the main thread
        errors.append((name, e))
      finally:
        stop.set()
    return threading.Thread(target=body, name=name, daemon=True)

  threads = [guarded(name, fn) for name, fn in loops.items()]
  interrupted, t_start = False, time.monotonic()
  t_interrupt = t_start
  try:
    for t in threads:
      t.start()
    if on_ready is not None:
      on_ready()
    while not stop.is_set():
      if interrupt is not None and interrupt.is_set():
        interrupted, t_interrupt = True, time.monotonic()
        break
      stop.wait(0.1)
  except KeyboardInterrupt:
    interrupted, t_interrupt = True, time.monotonic()
  finally:
    stop.set()
    _join(threads, STOP_TIMEOUT_S)
    busy = [t.name for t in threads if t.is_alive()]
    if interrupted and busy:
      print(f'[run] waiting for the {" and ".join(busy)} loop to finish its step (a compile, a '
            'long step) so that it is saved; a second signal (Ctrl-C) exits now, without a save',
            flush=True)
      _join(threads, INTERRUPTED_STEP_TIMEOUT_S)
  t_end = time.monotonic()
  # A copy: a loop that outlived the deadline may still fail later (e.g. on the engine closed
  # under it); what it did after being abandoned is not the cause.
  return Outcome(interrupted=interrupted, errors=list(errors),
                 alive=[t.name for t in threads if t.is_alive()],
                 stop_s=t_end - t_interrupt, wall_s=t_end - t_start)


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
