"""Entry point: `python -m pipelinerl_jax.main --config=configs/math.py:tiny --workdir=DIR`
(installed: `pipelinerl-train ...`).

Override any field on the command line, e.g. `--config.rl.mode=conventional`.
JAX's GPU preallocation is already off here: `pipelinerl_jax/__init__.py` runs first.

Exit status: 0 done; 1 an error (one line on stderr); 130 / 143 stopped by SIGINT / SIGTERM
(after saving what was trained; see pipeline/signals.py).
"""

import signal
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from pipelinerl_jax import command_line
from pipelinerl_jax.pipeline import signals

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. '
                                          'configs/math.py:tiny.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory (metrics, curves, TensorBoard).')
flags.mark_flags_as_required(['config', 'workdir'])

_STOP = signals.StopSignals()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  # Imported after the signal handlers are in: importing JAX takes seconds, and a signal
  # meanwhile must stop the run like any other.
  from pipelinerl_jax import distributed
  from pipelinerl_jax.pipeline import launch
  from pipelinerl_jax.pipeline import metrics as metrics_lib
  from pipelinerl_jax.pipeline import supervise
  try:
    summary = launch.run_experiment(_CONFIG.value, _WORKDIR.value, interrupt=_STOP.request)
  except signals.Interrupted as e:
    print(f'\nInterrupted by {signal.Signals(e.signum).name} during start-up; nothing was '
          'trained.', flush=True)
    sys.exit(signals.exit_code(e.signum))
  except (ValueError, OSError, supervise.RunError, supervise.TrainerProcessError) as e:
    command_line.exit_now(f'error: {command_line.one_line(e)}')  # OSError: a full or read-only disk
  if summary.get('follower'):  # another process of the trainer (pipeline/multiprocess.py)
    print(f"{distributed.describe()}: followed process 0 to step {summary['steps']}")
    sys.exit(signals.exit_code(_STOP.request.signum) if summary['interrupted'] else 0)
  if summary['interrupted']:
    print(f"\nInterrupted: actor and trainer stopped after {summary['steps']} steps; "
          f'metrics so far are in {_WORKDIR.value}.')
    if summary['checkpoint']:
      print(f"Checkpoint saved in {summary['checkpoint']}: run the same command to resume.")
    command_line.exit_now(signals.exit_code(_STOP.request.signum))
  print(metrics_lib.summary_text(summary, _WORKDIR.value))
  if summary['checkpoint']:
    print(f"Checkpoints: {summary['checkpoint']} (HF export: python -m pipelinerl_jax.export "
          f"--checkpoint={summary['checkpoint']} --out=DIR)")


def cli():
  """The `pipelinerl-train` console script: same flags as `python -m pipelinerl_jax.main`."""
  _STOP.install()  # first: a signal at any later point stops the run, never as a traceback
  app.run(main, flags_parser=command_line.parse_flags)


if __name__ == '__main__':
  cli()
