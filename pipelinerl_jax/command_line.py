"""What the commands share around their one library call: absl's flag parsing with a bad command
line as one line, an error's text on one line, and the exit of a process whose run may have left
a loop mid-step.

Imports absl and the standard library only at import time (JAX loads later, inside the command).
"""

import difflib
import os
import sys
import threading

from absl import flags


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


def exit_now(status: int | str) -> None:
  """sys.exit, unless a loop of the run was abandoned mid-step (inside XLA, see
  supervise.run_loops): interpreter shutdown would abort under it, so the process ends at once
  (output flushed). So
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
