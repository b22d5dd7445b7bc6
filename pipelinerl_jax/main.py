"""Entry point: `python -m pipelinerl_jax.main --config=configs/math.py:tiny --workdir=DIR`
(installed: `pipelinerl-train ...`).

Override any field on the command line, e.g. `--config.rl.mode=conventional`.
JAX's GPU preallocation is already off here: `pipelinerl_jax/__init__.py` runs first.

Exit status: 0 done; 1 an error (one line on stderr); 130 / 143 stopped by SIGINT / SIGTERM
(after saving what was trained; see pipeline/signals.py).
"""

import difflib
import os
import signal
import sys
import threading

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

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
  from pipelinerl_jax.pipeline import multiprocess
  from pipelinerl_jax.pipeline import run as run_lib
  try:
    summary = launch.run_experiment(_CONFIG.value, _WORKDIR.value, interrupt=_STOP.request)
  except signals.Interrupted as e:
    print(f'\nInterrupted by {signal.Signals(e.signum).name} during start-up; nothing was '
          'trained.', flush=True)
    sys.exit(signals.exit_code(e.signum))
  except (ValueError, OSError, run_lib.RunError, multiprocess.TrainerProcessError) as e:
    exit_now(f'error: {one_line(e)}')  # OSError: a full or read-only disk
  if summary.get('follower'):  # another process of the trainer (pipeline/multiprocess.py)
    print(f"{distributed.describe()}: followed process 0 to step {summary['steps']}")
    sys.exit(signals.exit_code(_STOP.request.signum) if summary['interrupted'] else 0)
  if summary['interrupted']:
    print(f"\nInterrupted: actor and trainer stopped after {summary['steps']} steps; "
          f'metrics so far are in {_WORKDIR.value}.')
    if summary['checkpoint']:
      print(f"Checkpoint saved in {summary['checkpoint']}: run the same command to resume.")
    exit_now(signals.exit_code(_STOP.request.signum))
  print(metrics_lib.summary_text(summary, _WORKDIR.value))
  if summary['checkpoint']:
    print(f"Checkpoints: {summary['checkpoint']} (HF export: python -m pipelinerl_jax.export "
          f"--checkpoint={summary['checkpoint']} --out=DIR)")


def exit_now(status: int | str) -> None:
  """sys.exit, unless a loop of the run was abandoned mid-step (inside XLA, see run.supervise):
  interpreter shutdown would abort under it, so the process ends at once (output flushed). So
  does an error in a trainer of several processes: a normal exit would wait at jax.distributed's
  shutdown barrier for peers that may be gone (then abort with a stack trace)."""
  from pipelinerl_jax import distributed
  abandoned = any(t.name in ('actor', 'trainer') and t.is_alive() for t in threading.enumerate())
  if not abandoned and not (isinstance(status, str) and distributed.several_processes()):
    sys.exit(status)
  if isinstance(status, str):
    print(status, file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1 if isinstance(status, str) else status)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad --config override or preset as one line. (ml_collections
  raises those from inside the parser, before `main`, as a long traceback.)"""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # a missing flag, a bad value, a preset that raised
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    sys.exit(f"error: {lines[-1] if 'Traceback' in str(e) else lines[0]}")
  except Exception as e:
    sys.exit(f'error: {explain_config_error(argv, e)}')


def explain_config_error(argv: list[str], error: Exception) -> str:
  """The override in `argv` that names no key of the config file, or else `error`'s text."""
  from pipelinerl_jax import config as config_lib
  spec = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '')
  path, _, preset = spec.partition(':')
  try:
    config = config_lib.load_preset(preset or None, path)
  except Exception as e:  # the file or the preset itself is what is wrong
    error = e
  else:
    for arg in argv:
      if not arg.startswith('--config.'):
        continue
      key = arg[len('--config.'):].split('=', 1)[0]
      node, parts = config, key.split('.')
      for i, part in enumerate(parts):
        if not hasattr(node, 'keys') or part not in node:
          known = list(node.keys()) if hasattr(node, 'keys') else []
          close = difflib.get_close_matches(part, known, n=1)
          hint = f' (did you mean {".".join(parts[:i] + close)}?)' if close else ''
          return f'--config.{key}: unknown key{hint}'
        node = node[part]
  return f'{type(error).__name__}: {one_line(error)}'


def one_line(error: BaseException) -> str:
  """An error's message on one line (some libraries' span several)."""
  return ' '.join(str(error).split()).strip('\'"')


def cli():
  """The `pipelinerl-train` console script: same flags as `python -m pipelinerl_jax.main`."""
  _STOP.install()  # first: a signal at any later point stops the run, never as a traceback
  app.run(main, flags_parser=parse_flags)


if __name__ == '__main__':
  cli()
