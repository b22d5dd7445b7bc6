"""A measurement in a child process of its own (one in-process vLLM per process; memory given
back between sizes): the child prints its JSON result on one line, the parent reads it back."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Mapping, Sequence

PREFIX = 'RESULT '


def emit(result: Any) -> None:
  """The child's side: `result` as the line the parent reads."""
  print(PREFIX + json.dumps(result), flush=True)


def parse(stdout: str) -> Any | None:
  """The last result line's JSON in a child's stdout; None when it printed none."""
  lines = [line for line in stdout.splitlines() if line.startswith(PREFIX)]
  return json.loads(lines[-1][len(PREFIX):]) if lines else None


def run(cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> Any:
  """Runs `cmd` and returns its result. A child that failed or printed none: its stderr's tail,
  then SystemExit naming `what`."""
  proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
  result = parse(proc.stdout)
  if proc.returncode or result is None:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f'{what} failed (exit {proc.returncode})')
  return result
