"""How a run's loops are supervised, and how their outcome becomes the run's error.

The actor and the trainer are two threads of one process (JAX releases the GIL while it
computes), so generation and training overlap. The main thread only supervises (`run_loops`):
the first exception in either loop, or Ctrl-C, or a stop request (pipeline/signals.py) stops
both within seconds. After an interrupt, a loop busy with one step (an XLA compile: minutes on a
GPU host) is waited for longer, so that what it trains is saved; a second signal exits at once.

Whatever fails, every part that was started is closed (`close_all`), and a failure while closing
never hides the error that ended the run (`raise_for`): the loop's error is the one reported,
and it names the loop.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Callable

from pipelinerl_jax import distributed
from pipelinerl_jax.pipeline import stream as stream_lib

STOP_TIMEOUT_S = 10.0
# With a trainer process lost, the trainer loop may wait inside a collective that never
# completes (nothing it holds can be saved then): the loops get this long, and the process exits
# without those still busy (command_line.exit_now).
LOST_PROCESS_STOP_S = 2.0
# After an interrupt, a busy loop is waited for this much longer (see the module's docstring).
INTERRUPTED_STEP_TIMEOUT_S = 600.0


class RunError(RuntimeError):
  """A loop of the run failed; the message names it and the original error."""


TrainerProcessError = distributed.TrainerProcessError  # a trainer process failed or is gone


Closers = list[tuple[str, Callable[[], None]]]


@dataclasses.dataclass
class Outcome:
  interrupted: bool                             # Ctrl-C (or SIGTERM, see main.py)
  errors: list[tuple[str, BaseException]]       # loops that raised, in order
  alive: list[str]                              # loops that did not stop in time
  stop_s: float                                 # interrupt -> loops stopped
  wall_s: float
  closing: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # closes that failed

  @property
  def may_save(self) -> bool:
    """Whether the trainer's state is whole, so saved at exit (also after Ctrl-C or the time
    budget: nothing trained is lost): the trainer loop neither failed nor is still busy, and no
    trainer process was lost (its shards are gone)."""
    lost = any(isinstance(e, TrainerProcessError) for _, e in self.errors)
    return 'trainer' not in self.alive + [name for name, _ in self.errors] and not lost


def close_all(closers: Closers) -> list[tuple[str, str]]:
  """Calls every closer, whatever the others do; returns (what, one-line error) of those that
  raised (a full disk fails the flushes: that must neither hide the run's own error nor skip
  the other closes)."""
  errors = []
  for name, close in closers:
    try:
      close()
    except Exception as e:
      lines = str(e).strip().splitlines()
      errors.append((name, f'{type(e).__name__}: {lines[0] if lines else ""}'))
  return errors


def run_loops(loops: dict[str, Callable[[], None]], stop: threading.Event, closers: Closers,
              on_ready: Callable[[], None] | None = None,
              interrupt: threading.Event | None = None) -> Outcome:
  """Runs each loop in a thread until one ends (any loop ending ends the run), `stop` is set,
  `interrupt` is set (a signal) or Ctrl-C; then stops them all, waiting at most STOP_TIMEOUT_S
  (after an interrupt, up to INTERRUPTED_STEP_TIMEOUT_S more for a loop busy with a step), and
  calls `closers` (Outcome.closing: those that failed). When supervising itself raises, the
  closers are called and that error goes on."""
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
      if interrupt is not None and interrupt.is_set():
        interrupted, t_interrupt = True, time.monotonic()
        break
      stop.wait(0.1)
  except KeyboardInterrupt:
    interrupted, t_interrupt = True, time.monotonic()
  finally:
    stop.set()
    _join(threads, STOP_TIMEOUT_S, lost=lambda: any(
        isinstance(e, TrainerProcessError) for _, e in errors) or distributed.lost_processes())
    busy = [t.name for t in threads if t.is_alive()]
    if interrupted and busy:
      print(f'[run] waiting for the {" and ".join(busy)} loop to finish its step (a compile, a '
            'long step) so that it is saved; a second signal (Ctrl-C) exits now, without a save',
            flush=True)
      _join(threads, INTERRUPTED_STEP_TIMEOUT_S)
    t_end = time.monotonic()
    # Copies, before the closes: a loop that outlived the deadline may still fail later (e.g. on
    # the engine closed under it); what it did after being abandoned is not the cause.
    seen, alive = list(errors), [t.name for t in threads if t.is_alive()]
    closing = close_all(closers)
  return Outcome(interrupted=interrupted, errors=seen, alive=alive, stop_s=t_end - t_interrupt,
                 wall_s=t_end - t_start, closing=closing)


def raise_for(outcome: Outcome) -> None:
  """The run's error, if any: a loop's (the closes that also failed printed beside it), a loop
  that did not stop in time, or else the first close that failed. A loop still busy after an
  interrupt is what was asked for: said, not raised."""
  if outcome.errors:
    name, e = outcome.errors[0]
    for what, problem in outcome.closing:  # secondary: the loop's error is the one to report
      print(f'[run] also: {what} failed: {problem}', file=sys.stderr, flush=True)
    where = name if name in ('exit save', 'trainer processes') else f'{name} loop'
    raise RunError(f'{where} failed: {type(e).__name__}: {e}') from e
  if outcome.alive and not outcome.interrupted:
    raise RunError(f'{", ".join(outcome.alive)} did not stop within {STOP_TIMEOUT_S:.0f} s')
  if outcome.alive:
    print(f'[run] the {" and ".join(outcome.alive)} loop was still busy '
          f'{INTERRUPTED_STEP_TIMEOUT_S:.0f} s after the interrupt: not saving its state',
          flush=True)
  if outcome.closing:
    what, problem = outcome.closing[0]
    raise RunError(f'{what} failed: {problem}')


def _join(threads: list[threading.Thread], timeout_s: float,
          lost: Callable[[], bool] = lambda: False) -> None:
  """Waits up to `timeout_s` for the threads to end; once `lost()` (a trainer process is lost,
  see LOST_PROCESS_STOP_S), up to LOST_PROCESS_STOP_S more at most."""
  deadline = time.monotonic() + timeout_s
  shortened = False
  while (alive := [t for t in threads if t.is_alive()]) and time.monotonic() < deadline:
    if not shortened and lost():
      shortened, deadline = True, min(deadline, time.monotonic() + LOST_PROCESS_STOP_S)
    alive[0].join(min(0.5, max(0.0, deadline - time.monotonic())))
