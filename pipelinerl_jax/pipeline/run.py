"""The paper's Algorithm 2 on process 0: the actor and the trainer run concurrently, joined by
the sample stream; supervised until one ends, a stop request or the budget; the trained state
saved at exit.

The actor generates with the newest weights it has, H sequences in flight, and puts each scored
group of G samples on the stream; the trainer takes B samples, packs them, makes one step and
publishes the new weights to the engine, in flight. The stream's credits bound how far the
actor runs ahead (rl.max_lag; pipeline/stream.py). `rl.mode='conventional'` is the same loop
with k steps per generated batch.

What comes before, once per process (pipeline/launch.py): the config validated, the processes
joined, the outputs claimed, the parts built (pipeline/build.py). How the loops are supervised,
and how their outcome becomes the run's error: pipeline/supervise.py.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import cluster as cluster_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import supervise


def run(config: config_lib.Config, parts: build_lib.Parts, workdir: str, *,
        on_ready: Callable[[dict], None] | None = None,
        interrupt: threading.Event | None = None,
        watch: Callable[[threading.Event], None] | None = None) -> dict[str, Any]:
  """RL to config.rl.total_steps (or max_time_s) from `parts`, which it closes; returns a
  summary dict.

  `on_ready` (tests) gets the live objects once both loops run. `interrupt` (main's signal
  handlers set it): the loops stop as after Ctrl-C. `watch` (several trainer processes:
  multiprocess.Followers.watch): a loop that raises once one of them is lost, which ends the
  run at once.
  """
  learner = parts.learner
  start_step = int(learner.resumed['step']) if learner.resumed else 0
  try:
    # What crossed between the hosts: this host's bytes on the interface they share.
    net = (cluster_lib.NetworkCounter(config.cluster.interface) if config.cluster.interface
           else None)
    writer = metrics_lib.MetricsWriter(
        workdir, tensorboard=config.log.tensorboard, progress=config.log.progress,
        start_step=start_step, wandb=wandb_settings(config))
  except BaseException:
    supervise.close_all([('engine', parts.engine.close), ('task', parts.task.close),
                         ('checkpoints', learner.checkpoints.close)])
    raise
  if writer.dropped:
    print(f'[run] metrics.jsonl: {writer.dropped} records past step {start_step} (logged by a '
          f'run that ended before saving them) moved to {metrics_lib.DROPPED_FILE}', flush=True)

  stop = threading.Event()
  stream = stream_lib.SampleStream(
      stream_lib.capacity(config.rl, config.generation.num_slots), stop,
      ledger=stream_lib.GroupLedger(**learner.resumed['data']) if learner.resumed else None)
  actor = build_lib.make_actor(config, parts, stream, stop)
  records: list[dict] = []

  def log(record: dict) -> None:
    if 'step' in record:  # (not a skipped update's record: see trainer.py)
      record.update(actor.counters())
      record.update({f'task/{name}': n for name, n in parts.task.counters.items()})
      if net is not None:
        record.update(net.totals())
      records.append(record)
    writer.write(record)

  def save(final: bool) -> None:
    if final or learner.checkpoints.due(trainer.step):
      learner.checkpoints.save(trainer.state, checkpoint_lib.run_meta(
          config, parts.model_dir, trainer.checkpoint_meta()))

  trainer = build_lib.make_trainer(config, parts, stream, stop, log,
                                   after_publish=lambda: save(False))
  trainer.time_offset = writer.time_offset
  loops = {'actor': actor.run, 'trainer': trainer.run}
  if watch is not None:  # a trainer process lost (maybe inside a collective) ends the run
    loops['trainer processes'] = lambda: watch(stop)
  live = dict(actor=actor, trainer=trainer, engine=parts.engine, stream=stream, stop=stop,
              task=parts.task)
  try:
    with cluster_lib.pinned(parts.trainer_cores):  # train.cores='free'; restored after
      outcome = supervise.run_loops(
          loops, stop, [('closing the engine', parts.engine.close),
                        ('closing the task', parts.task.close),
                        ('closing the metrics', writer.close)],
          on_ready=on_ready and (lambda: on_ready(live)), interrupt=interrupt)
  except BaseException:  # supervising itself failed: the parts are closed, that error goes on
    supervise.close_all([('checkpoints', learner.checkpoints.close)])
    raise

  if outcome.may_save:
    try:
      save(final=True)
    except OSError as e:
      outcome.errors.append(('exit save', e))
  if 'trainer' not in outcome.alive:  # (an abandoned trainer may be inside a save, which a
    # close would wait for: with a trainer process lost, for good; the process exits without)
    outcome.closing += supervise.close_all([('closing the checkpoints',
                                             learner.checkpoints.close)])
  if outcome.interrupted:
    print(f'\n[run] loops stopped {outcome.stop_s:.1f} s after the interrupt', flush=True)
  if records:
    g, rl = config.generation, config.rl
    outcome.closing += supervise.close_all([('curves', lambda: metrics_lib.plot_curves(
        records, os.path.join(workdir, 'curves.png'),
        title=f'{rl.mode}, B={rl.batch_size}, G={rl.group_size}, H={g.num_slots}'))])
  supervise.raise_for(outcome)
  return dict(
      steps=trainer.step, samples=trainer.samples_trained, interrupted=outcome.interrupted,
      wall_s=outcome.wall_s, records=records, stale_dropped=trainer.stale_dropped,
      max_lag_seen=trainer.max_lag_seen,
      gen_train_overlap_s=metrics_lib.overlap_seconds(actor.busy_intervals,
                                                      trainer.busy_intervals),
      gen_busy_s=sum(e - s for s, e in actor.busy_intervals),
      train_busy_s=sum(e - s for s, e in trainer.busy_intervals), final_state=trainer.state,
      checkpoint=learner.checkpoints.path if learner.checkpoints.last_saved else None,
      skipped_updates=trainer.skipped_updates)


def wandb_settings(config: config_lib.Config) -> dict[str, Any] | None:
  """wandb.init's arguments for MetricsWriter, or None when config.log.wandb is off."""
  log = config.log
  if not log.wandb:
    return None
  return dict(project=log.wandb_project, entity=log.wandb_entity,
              config=dataclasses.asdict(config))
