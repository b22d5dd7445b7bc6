"""SIGINT / SIGTERM stop a run by setting an event; nothing is raised inside arbitrary code.

A handler that raises KeyboardInterrupt runs wherever the main thread happens to be: inside a
garbage-collector callback (jax registers one) the exception is printed as "Exception ignored"
and dropped, so the signal is lost and the run trains its whole budget; elsewhere it lands
mid-import or mid-save as a traceback. These handlers only record the signal. The run polls the
event between start-up phases (`check`) and in its supervisor, and stops as after Ctrl-C:
both loops end, the trained state is saved, and the process exits 128 + signal number (130
for SIGINT, 143 for SIGTERM, what shells and schedulers expect).

A second signal exits at once (status 128 + signal number, no save): the way out when a phase
that cannot be interrupted (an XLA compile, a model load) takes longer than one can wait.
Child processes end with the process (see tasks/verify.py).

This module imports the standard library only.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
  """The run was asked to stop (a signal) before its loops started."""

  def __init__(self, signum: int):
    super().__init__(f'interrupted by {signal.Signals(signum).name} during start-up')
    self.signum = signum


class StopRequest(threading.Event):
  """An event that also records which signal set it (None: set by other means)."""
  signum: int | None = None


class StopSignals:
  """Installs the handlers (main thread only); `request` is set by the first signal."""

  def __init__(self):
    self.request = StopRequest()
    self._previous = {}

  def install(self) -> 'StopSignals':
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def uninstall(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def __enter__(self) -> 'StopSignals':
    return self.install()

  def __exit__(self, *exc) -> None:
    self.uninstall()

  def _handle(self, signum, frame) -> None:
    del frame
    if self.request.is_set():
      # os.write, not print: the handler may run while print() holds stdout's lock.
      os.write(2, f'\n{signal.Signals(signum).name} again: exiting now, without a save\n'.encode())
      os._exit(exit_code(signum))
    self.request.signum = signum
    self.request.set()


def exit_code(signum: int | None) -> int:
  """The status of a run stopped by `signum`: 128 + its number, as a shell reports a process
  killed by it (130 for SIGINT, also for a KeyboardInterrupt without a signal; 143 for SIGTERM)."""
  return 128 + int(signum or signal.SIGINT)


def check(request: threading.Event | None) -> None:
  """Raises Interrupted when `request` is set: called between start-up phases, each of which may
  run for minutes on a GPU host."""
  if request is not None and request.is_set():
    raise Interrupted(getattr(request, 'signum', None) or signal.SIGINT)
