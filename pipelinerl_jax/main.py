"""Entry point: `python -m pipelinerl_jax.main --config=configs/math.py:tiny --workdir=DIR`
(installed: `pipelinerl-train ...`).

Override any field on the command line, e.g. `--config.rl.mode=conventional`.
JAX's GPU preallocation is already off here: `pipelinerl_jax/__init__.py` runs first.
"""

import signal
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from pipelinerl_jax import distributed
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import multiprocess
from pipelinerl_jax.pipeline import run as run_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. '
                                          'configs/math.py:tiny.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory (metrics, curves, TensorBoard).')
flags.mark_flags_as_required(['config', 'workdir'])


def _terminate(signum, frame):
  raise KeyboardInterrupt  # SIGTERM (schedulers, `kill`) stops the run as cleanly as Ctrl-C


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  signal.signal(signal.SIGTERM, _terminate)
  try:
    summary = run_lib.run_experiment(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError, run_lib.RunError, multiprocess.TrainerProcessError) as e:
    distributed.exit_with_error(f'error: {e}')  # several processes: at once
  if summary.get('follower'):
    print(f"{distributed.describe()}: followed process 0 to step {summary['steps']}")
    return
  if summary['interrupted']:
    print(f"\nInterrupted: actor and trainer stopped after {summary['steps']} steps; "
          f'metrics so far are in {_WORKDIR.value}.')
    if summary['checkpoint']:
      print(f"Checkpoint saved in {summary['checkpoint']}: run the same command to resume.")
    sys.exit(130)
  print(metrics_lib.summary_text(summary, _WORKDIR.value))
  if summary['checkpoint']:
    print(f"Checkpoints: {summary['checkpoint']} (HF export: python -m pipelinerl_jax.export "
          f"--checkpoint={summary['checkpoint']} --out=DIR)")


def cli():
  """The `pipelinerl-train` console script: same flags as `python -m pipelinerl_jax.main`."""
  app.run(main)


if __name__ == '__main__':
  cli()
