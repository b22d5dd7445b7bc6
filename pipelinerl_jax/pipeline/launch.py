"""What every trainer process runs, from a config to the end of the run: the one place that
validates the config, joins the trainer's processes (jax.distributed), checks the platform, the
backend and the workdir, finds the model, and decides which process this is. Process 0 claims
the outputs, builds the parts and runs the pipeline (`run.run`); every other process follows it
(`multiprocess.follow`).

Every check is made once per process, before anything heavy: the GPU first (a run meant for
GPUs on a CPU says so before anything else is looked at), then what the run needs (the model
and the data named, what the installed versions and the accelerator can run (stack.py), the
backend installed, the workdir writable); on process 0, the outputs
(workdir and checkpoint dir writable, room for the checkpoints) are checked and locked before
the model loads (pipeline/workdir.py). A stop request (a signal, see pipeline/signals.py) is
honoured between these phases.

With trainer processes as Ray actors (train.num_processes > 1 and generation.placement 'ray'),
this process starts them (pipeline/trainer_actors.py) and is process 0; each actor runs
`follow_as_actor`, the same preparation and then `multiprocess.follow`.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import ml_collections

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import cluster
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax import platforms
from pipelinerl_jax import stack as stack_lib
from pipelinerl_jax import train
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import multiprocess
from pipelinerl_jax.pipeline import run as run_lib
from pipelinerl_jax.pipeline import signals
from pipelinerl_jax.pipeline import workdir as workdir_lib


def run_experiment(config: ml_collections.ConfigDict | config_lib.Config, workdir: str, *,
                   model_dir: str | None = None, on_ready: Callable[[dict], None] | None = None,
                   interrupt: threading.Event | None = None) -> dict[str, Any]:
  """The whole run from a config; returns `run.run`'s summary on process 0, and
  `multiprocess.follow`'s on the others.

  `model_dir` (tests, benchmarks) replaces config.model.path. `on_ready` (tests) gets the live
  objects once both loops run. `interrupt` (main's signal handlers set it): start-up stops with
  signals.Interrupted at its next phase; running loops stop as after Ctrl-C.
  """
  config = config_lib.validate(config, runnable=False)  # check_runnable: after the GPU check
  if launches_trainers(config):
    return _launch_trainers(config, workdir, model_dir, on_ready, interrupt)
  # before any JAX computation; nothing for one process
  distributed.initialize(config.train, interface=config.cluster.interface)
  model_dir = prepare_saying_last_words(config, workdir, model_dir, interrupt)
  if not distributed.is_primary():
    return multiprocess.follow(config, workdir, model_dir, interrupt)
  return run_primary(config, workdir, model_dir, on_ready=on_ready, interrupt=interrupt)


def launches_trainers(config: config_lib.Config) -> bool:
  """Whether this run starts its other trainer processes itself, as Ray actors."""
  return config.train.num_processes > 1 and config.generation.placement == 'ray'


def _launch_trainers(config: config_lib.Config, workdir: str, model_dir: str | None,
                     on_ready, interrupt) -> dict[str, Any]:
  # Before Ray and the actors start; JAX's backends stay unstarted until the processes join.
  check(config, workdir, stack_lib.installed(device=False))
  from pipelinerl_jax.pipeline import trainer_actors  # imports Ray: only when it is used
  with trainer_actors.launch(config, workdir, follow_as_actor) as launched:  # joins: process 0
    model_dir = prepare(config, workdir, model_dir, interrupt, checked=True)
    return run_primary(config, workdir, model_dir, on_ready=on_ready, interrupt=interrupt,
                       trainers=launched)


def follow_as_actor(config: config_lib.Config, workdir: str, stash) -> dict[str, Any]:
  """A trainer process started as a Ray actor, joined already (trainer_actors.TrainerProcess):
  the same preparation as every process, then it follows process 0, publishing its own pieces
  of the params into `stash` (a trainer_actors.Stash)."""
  model_dir = prepare_saying_last_words(config, workdir)
  return multiprocess.follow(config, workdir, model_dir, stash=stash)


def prepare_saying_last_words(config: config_lib.Config, workdir: str, *args) -> str:
  """`prepare`; a failure is also told to the other processes, which may wait for this one at a
  barrier (distributed.barrier names it then)."""
  try:
    return prepare(config, workdir, *args)
  except BaseException as e:
    distributed.say_last_words(e)
    raise


def check(config: config_lib.Config, workdir: str,
          installed: stack_lib.Stack | None = None) -> None:
  """What a run needs beyond a consistent config: the model and the data named, what the
  installed stack can run (`installed`, default: read now, JAX's device included), a model dir
  LoRA can adapt, the backend installed (vLLM, Ray), the workdir writable,
  config.cluster.interface on this host."""
  config.check_runnable()
  stack_lib.check(config, installed)  # reads the model's config.json, never its weights
  if config.model.lora.enabled and config.model.path:  # its config.json, before any weights
    lora_lib.check_base(hf_schema.load_config(
        hf_schema.check_model_dir(config.model.path, 'config.model.path')))
  build_lib.check_backend_installed(config)  # before the demo model is built
  workdir_lib.check_dir(workdir, '--workdir')
  if config.cluster.interface:  # this host's side of the network the hosts share
    cluster.interface_address(config.cluster.interface)


def prepare(config: config_lib.Config, workdir: str, model_dir: str | None = None,
            interrupt: threading.Event | None = None, checked: bool = False) -> str:
  """Every trainer process, joined: the GPU check, `check` (unless `checked` already), then the
  model directory: `model_dir`, config.model.path, or else the demo model, built once (process 0
  first: the cache may be a shared disk)."""
  platforms.check(config)  # a run meant for GPUs on a CPU: before anything else is looked at
  if checked:
    stack_lib.check(config)  # the device, now that the processes have joined
  else:
    check(config, workdir)
  if not model_dir and config.model.path:
    model_dir = hf_schema.check_model_dir(config.model.path, 'config.model.path')
  if not model_dir:
    model_dir = distributed.primary_first(lambda: warmstart.model_dir_for(config), 'demo model')
  signals.check(interrupt)
  stamp = warmstart.read_stamp(model_dir)
  if stamp:
    print(f"model: {model_dir} (warm start: greedy accuracy {stamp['greedy_accuracy']:.2f}, "
          f"sampled {stamp['sampled_accuracy']:.2f})")
  return model_dir


def run_primary(config: config_lib.Config, workdir: str, model_dir: str, *, on_ready=None,
                interrupt: threading.Event | None = None, trainers=None) -> dict[str, Any]:
  """Process 0: claims the outputs, builds the parts (each call that involves the other
  processes announced to them first: multiprocess.Followers) and runs the pipeline. `trainers`:
  the trainer actors' trainer_actors.Launch."""
  locks = claim_outputs(config, workdir, model_dir)
  try:
    with multiprocess.Followers(config, interrupt,  # none with one process
                                sharded=trainers is not None) as followers:
      signals.check(interrupt)
      parts = followers.announce(build_lib.build(config, workdir, model_dir, interrupt=interrupt,
                                                 trainers=trainers))
      watch = None
      if distributed.several_processes():
        def watch(stop):  # a trainer process lost, or a trainer actor ended, ends the run
          followers.watch(stop, trainers.check if trainers is not None else lambda: None)
      return run_lib.run(config, parts, workdir, on_ready=on_ready, interrupt=interrupt,
                         watch=watch)
  finally:
    for lock in reversed(locks):
      lock.release()


def claim_outputs(config: config_lib.Config, workdir: str, model_dir: str
                  ) -> list[workdir_lib.DirLock]:
  """Locks the workdir (checked already: `check`), checks the checkpoint dir (a directory,
  writable) and locks it, and checks there is room for the checkpoints this run keeps; all
  before the model loads."""
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
    model_config = hf_schema.load_config(model_dir, param_dtype=m.param_dtype, dtype=m.dtype)
    one = checkpoint_lib.state_bytes(model_config, train.make_optimizer(config.optimizer),
                                     lora_lib.active(m.lora))
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
