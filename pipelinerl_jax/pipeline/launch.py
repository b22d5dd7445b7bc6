"""What the main command runs: validate the config, start the trainer's other processes as Ray
actors when the config asks for them (pipeline/trainer_actors.py), then `run.run_with_model` here.

It sits above both `run` and `trainer_actors`: each trainer actor calls `run.run_with_model` too,
so the launch cannot live in `run` without an import circle.
"""

from __future__ import annotations

import threading
from typing import Any

import ml_collections

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import run as run_lib
from pipelinerl_jax.pipeline import workdir as workdir_lib


def run_experiment(config: ml_collections.ConfigDict | config_lib.Config, workdir: str,
                   interrupt: threading.Event | None = None) -> dict[str, Any]:
  """The whole run from a config; returns `run.run`'s summary."""
  config = config_lib.validate(config, runnable=False)  # run_with_model checks the GPU first
  if not run_lib.launches_trainers(config):
    return run_lib.run_with_model(config, workdir, interrupt)
  config.check_runnable()
  build_lib.check_backend_installed(config)  # Ray
  workdir_lib.check_dir(workdir, '--workdir')
  from pipelinerl_jax.pipeline import trainer_actors  # imports Ray: only when it is used
  with trainer_actors.launch(config, workdir) as launched:
    return run_lib.run_with_model(config, workdir, interrupt, trainers=launched)
