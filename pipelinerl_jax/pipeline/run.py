"""A run's lifecycle, the paper's Algorithm 2: build the parts, run the actor and the trainer
concurrently, joined by the sample stream, supervise them, save at exit.

Actor and trainer are two threads of this process (JAX releases the GIL while it computes), so
generation and training overlap. The main thread only supervises: the first exception in either
loop, or Ctrl-C, stops both within seconds, and the error names the loop that failed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable

import ml_collections

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import multiprocess
from pipelinerl_jax.pipeline import stream as stream_lib

STOP_TIMEOUT_S = 10.0


class RunError(RuntimeError):
  """A loop of the run failed; the message names it and the original error."""


def run_experiment(config: ml_collections.ConfigDict | config_lib.Config, workdir: str
                   ) -> dict[str, Any]:
  """What `main` runs: validate, find or build the model, then RL."""
  config = config_lib.validate(config)
  distributed.initialize(config.train)  # before any JAX computation; nothing for one process
  build_lib.check_backend_installed(config)  # before the demo model is built
  model_dir = distributed.primary_first(lambda: warmstart.model_dir_for(config), 'model')
  stamp = warmstart.read_stamp(model_dir)
  if stamp:
    print(f"model: {model_dir} (warm start: greedy accuracy {stamp['greedy_accuracy']:.2f}, "
          f"sampled {stamp['sampled_accuracy']:.2f})")
  return run(config, workdir, model_dir=model_dir)


def run(config: ml_collections.ConfigDict | config_lib.Config, workdir: str, *,
        model_dir: str | None = None, on_ready: Callable[[dict], None] | None = None
        ) -> dict[str, Any]:
  """RL to config.rl.total_steps (or max_time_s); returns a summary dict.

  `model_dir` overrides config.model.path (the demo passes the model it built). `on_ready`
  (tests) gets the live objects once both loops run.
  """
  config = config_lib.validate(config)
  model_dir = model_dir or config.model.path
  if not model_dir:
    raise ValueError('config.model.path: no model directory given')
  os.makedirs(workdir, exist_ok=True)
  distributed.initialize(config.train)  # (run_experiment joined already, to build the model)
  if distributed.process_count() > 1:  # one trainer in several processes: multiprocess.py
    return multiprocess.run(config, workdir, model_dir, functools.partial(
        run_pipeline, config, workdir, model_dir, on_ready=on_ready))
  return run_pipeline(config, workdir, model_dir, build_lib.build(config, workdir, model_dir),
                      on_ready=on_ready)


def run_pipeline(config: config_lib.Config, workdir: str, model_dir: str,
                 parts: build_lib.Parts, on_ready: Callable[[dict], None] | None = None
                 ) -> dict[str, Any]:
  """Actor and trainer over the built parts, supervised until done; saved at exit."""
  stop = threading.Event()
  stream = stream_lib.SampleStream(
      stream_lib.capacity(config.rl, config.generation.num_slots), stop,
      ledger=stream_lib.GroupLedger(**parts.resumed['data']) if parts.resumed else None)
  actor = build_lib.make_actor(parts, stream, stop)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                                     progress=config.log.progress)
  records: list[dict] = []

  def log(record: dict) -> None:
    record.update(actor.counters())
    record.update({f'task/{name}': n for name, n in parts.task.counters.items()})
    records.append(record)
    writer.write(record)

  def save(final: bool) -> None:
    if final or parts.checkpoints.due(trainer.step):
      parts.checkpoints.save(trainer.state, checkpoint_lib.run_meta(
          config, model_dir, trainer.checkpoint_meta()))

  trainer = build_lib.make_trainer(parts, stream, stop, log, after_publish=lambda: save(False))
  live = dict(actor=actor, trainer=trainer, engine=parts.engine, stream=stream, stop=stop,
              task=parts.task)
  try:
    outcome = supervise({'actor': actor.run, 'trainer': trainer.run}, stop,
                        on_ready=on_ready and (lambda: on_ready(live)))
  finally:
    parts.engine.close()
    parts.task.close()
    writer.close()
  if 'trainer' not in outcome.alive + [name for name, _ in outcome.errors]:
    save(final=True)  # also after Ctrl-C or the time budget: nothing trained is lost
  parts.checkpoints.close()
  if outcome.interrupted:
    print(f'\n[run] loops stopped {outcome.stop_s:.1f} s after the interrupt', flush=True)
  if records:
    g, rl = config.generation, config.rl
    metrics_lib.plot_curves(records, os.path.join(workdir, 'curves.png'),
                            title=f'{rl.mode}, B={rl.batch_size}, G={rl.group_size}, '
                                  f'H={g.num_slots}')
  if outcome.errors:
    name, e = outcome.errors[0]
    raise RunError(f'{name} loop failed: {type(e).__name__}: {e}') from e
  if outcome.alive:
    raise RunError(f'{", ".join(outcome.alive)} did not stop within {STOP_TIMEOUT_S:.0f} s')
  return dict(
      steps=trainer.step, samples=trainer.samples_trained, interrupted=outcome.interrupted,
      wall_s=outcome.wall_s, records=records, stale_dropped=trainer.stale_dropped,
      max_lag_seen=trainer.max_lag_seen,
      gen_train_overlap_s=metrics_lib.overlap_seconds(actor.busy_intervals,
                                                      trainer.busy_intervals),
      gen_busy_s=sum(e - s for s, e in actor.busy_intervals),
      train_busy_s=sum(e - s for s, e in trainer.busy_intervals), final_state=trainer.state,
      checkpoint=parts.checkpoints.path if parts.checkpoints.last_saved else None)


@dataclasses.dataclass
class Outcome:
  interrupted: bool                             # Ctrl-C (or SIGTERM, see main.py)
  errors: list[tuple[str, BaseException]]       # loops that raised, in order
  alive: list[str]                              # loops that did not stop in time
  stop_s: float                                 # interrupt -> loops stopped
  wall_s: float


def supervise(loops: dict[str, Callable[[], None]], stop: threading.Event,
              on_ready: Callable[[], None] | None = None) -> Outcome:
  """Runs each loop in a thread until one ends (any loop ending ends the run), `stop` is set or
  Ctrl-C; then stops them all, waiting at most STOP_TIMEOUT_S."""
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
      stop.wait(0.2)
  except KeyboardInterrupt:
    interrupted, t_interrupt = True, time.monotonic()
  finally:
    stop.set()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
  t_end = time.monotonic()
  # A copy: a loop that outlived the deadline may still fail later (e.g. on the engine closed
  # under it); what it did after being abandoned is not the cause.
  return Outcome(interrupted=interrupted, errors=list(errors),
                 alive=[t.name for t in threads if t.is_alive()],
                 stop_s=t_end - t_interrupt, wall_s=t_end - t_start)
