"""math-verify in a pool of worker processes, under a hard time limit per sample.

math-verify's own timeouts use SIGALRM, which only interrupts Python bytecode: sympy stuck in C
(expanding `9^{9^{9^9}}`, an integer with a billion digits) never sees the signal. So every
comparison runs in a worker process, and the parent kills a worker that overruns its deadline
and starts a fresh one. A pathological answer costs its timeout; it never stalls the caller for
longer, and it cannot leave a half-dead worker behind to poison later samples.

Workers are plain `python -P verify.py` subprocesses talking over a socketpair, not
multiprocessing children: those would re-import the parent's `__main__` (the actor, with JAX)
in every worker, or fork a process that has JAX's threads running. A replacement starts in the
background (about 0.5 s to import math_verify) while the other workers carry on.

A worker dies with the process that started it, however that ends (kill -9 included): it asks
the kernel for SIGKILL when its parent goes (Linux's PR_SET_PDEATHSIG), and checks at start
that the parent is still the one that spawned it. The kernel sends that signal when the
*thread* that forked the worker exits, so the pool forks every worker from one thread of its
own that lives as long as the pool. Elsewhere a worker notices the parent's end at its next
read (EOF), and the CPU backstop below ends one stuck in C.

Verdicts, one per (gold, answer) pair:
  'correct' | 'wrong'  math-verify's judgement
  'unparsable'         the answer did not parse to any math object
  'gold_unparsable'    the reference answer did not parse (a dataset problem, not the model's)
  'timeout'            the sample ran past `timeout_s`; its worker was killed and replaced
  'error'              the worker raised (RecursionError, MemoryError, ...) or never started, or
                       two workers in turn died on the sample before answering it

A worker that dies before answering (killed while idle or mid-sample, by the OOM killer, say)
does not cost its sample the verdict: the sample goes back to the queue and is sent to a worker
started after that death. A kill can land between any check of a worker and the send to it, so
no check before sending can promise this; re-sending can. A sample whose second, fresh worker
dies too is taken to be what kills them: 'error', and no third worker is spent on it.

A pool may judge with a scoring function of the user's instead of math-verify (`score_fn`,
'module:function' or 'path/to/file.py:function', loaded in each worker): it gets (completion,
reference) and returns True / False (correct / wrong), None (no answer), a number (the reward;
status correct when > 0) or (reward, status). Its verdict travels as ('scored', reward, status);
an exception in it, or a value of another kind, is 'error' with a one-line message the pool
logs (the first few) and keeps (`last_error`). The same limits apply as to math-verify.

This file imports nothing from the project: it runs as a script in the workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import importlib
import importlib.util
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import connection as mp_connection

VERDICTS = ('correct', 'wrong', 'unparsable', 'gold_unparsable', 'timeout', 'error', 'no_answer')
USER_STATUSES = ('correct', 'wrong', 'no_answer', 'unparsable')  # a score_fn's (reward, status)
_READY = 'ready'


# --- the worker side -------------------------------------------------------------------------

def _parse_boxed(latex: str) -> list:
  import math_verify
  # Re-boxed so both sides take math-verify's \boxed path; timeouts are the pool's (see above).
  return math_verify.parse('\\boxed{' + latex + '}', parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
  return tuple(_parse_boxed(gold))  # a group's G samples share one reference answer


def _has_math(parsed: list) -> bool:
  import sympy
  # parse() falls back to the raw string when nothing parses: only strings means no math.
  return any(isinstance(x, (sympy.Basic, sympy.MatrixBase)) for x in parsed)


def judge(gold: str, answer: str) -> str:
  """The verdict for one pair, in this process and with no time limit (what a worker runs)."""
  import math_verify
  gold_parsed = list(_parse_gold(gold))
  parsed = _parse_boxed(answer)
  if gold_parsed and math_verify.verify(gold_parsed, parsed, timeout_seconds=None):
    return 'correct'  # (with a string-only gold, by exact string match)
  if not _has_math(gold_parsed):
    return 'gold_unparsable'
  return 'wrong' if _has_math(parsed) else 'unparsable'


def load_score_fn(spec: str):
  """The function a 'module:function' or 'path/to/file.py:function' spec names; ValueError in
  one line when it cannot be imported or is not callable."""
  module, _, name = spec.strip().rpartition(':')
  if not module or not name:
    raise ValueError(f"{spec!r}: expected 'module:function' or 'path/to/file.py:function'")
  try:
    if module.endswith('.py') or os.sep in module:
      path = os.path.abspath(module)
      if not os.path.isfile(path):
        raise FileNotFoundError(f'no such file {path}')
      loader_spec = importlib.util.spec_from_file_location(
          os.path.splitext(os.path.basename(path))[0], path)
      mod = importlib.util.module_from_spec(loader_spec)
      loader_spec.loader.exec_module(mod)
    else:
      mod = importlib.import_module(module)
  except Exception as e:
    raise ValueError(f'{spec!r}: cannot import {module!r}: {type(e).__name__}: {_one_line(e)}'
                     ) from None
  fn = getattr(mod, name, None)
  if not callable(fn):
    raise ValueError(f'{spec!r}: {module!r} has no function {name!r}')
  return fn


def user_verdict(fn, completion: str, reference: str):
  """A score_fn's value as a verdict (see the module doc); never raises."""
  try:
    value = fn(completion, reference)
  except Exception as e:  # the user's code: its error is the sample's verdict, in one line
    return ('error', f'score_fn raised {type(e).__name__}: {_one_line(e)}')
  if value is None:
    return 'no_answer'
  if isinstance(value, bool):
    return 'correct' if value else 'wrong'
  if isinstance(value, (int, float)) and math.isfinite(value):
    return ('scored', float(value), 'correct' if value > 0 else 'wrong')
  if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (int, float))
      and not isinstance(value[0], bool) and math.isfinite(value[0])
      and value[1] in USER_STATUSES):
    return ('scored', float(value[0]), value[1])
  return ('error', f'score_fn returned {str(value)[:80]!r}: expected True / False, None, a '
                   f'finite number or (reward, status) with status in {USER_STATUSES}')


def _one_line(e: BaseException) -> str:
  return ' '.join(str(e).split())[:200]


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
  """SIGKILL this process when its parent exits (Linux); exits now if the parent already has
  (this process was re-parented before it could ask)."""
  if sys.platform.startswith('linux'):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  if os.getppid() != parent_pid:
    os._exit(0)


def _worker_main(fd: int, memory_limit_mb: int, cpu_backstop_s: int, parent_pid: int,
                 score_fn: str = '') -> None:
  import resource
  die_with_parent(parent_pid)
  # Ctrl-C reaches the whole process group; the parent, not the signal, ends workers.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if memory_limit_mb > 0:  # a runaway bignum raises MemoryError instead of OOM-ing the host
    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  # Its "timeout is disabled" warnings are moot here: the parent enforces the timeout.
  logging.getLogger('math_verify').setLevel(logging.CRITICAL)
  # Imported before READY: start-up is not charged to a sample.
  if score_fn:
    fn = load_score_fn(score_fn)
    run = lambda reference, completion: user_verdict(fn, completion, reference)
  else:
    import math_verify  # noqa: F401
    run = judge
  conn = mp_connection.Connection(fd)
  conn.send(_READY)
  while True:
    try:
      job = conn.recv()
    except (EOFError, OSError):
      return  # the parent is gone
    if job is None:
      return
    # Backstop for an orphan (the parent died without killing us) stuck in C: the kernel ends
    # this process once the job has used cpu_backstop_s more seconds of CPU.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = int(usage.ru_utime + usage.ru_stime) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = used + cpu_backstop_s
    resource.setrlimit(resource.RLIMIT_CPU,
                       (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    try:
      verdict = run(*job)
    except Exception:  # RecursionError on deep nesting, MemoryError, sympy internals
      verdict = 'error'
    conn.send(verdict)


# --- the parent side -------------------------------------------------------------------------

@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  conn: mp_connection.Connection
  serial: int  # spawn order: a sample re-sent after a death goes to a worker spawned after it
  ready: bool = False  # True once it sent _READY; only ready workers get jobs


@dataclasses.dataclass
class _Batch:
  """One `verify_many` call's state while its samples are out with the workers."""
  results: list
  pending: collections.deque  # indices into the batch, not yet sent (or sent again after a death)
  busy: dict = dataclasses.field(default_factory=dict)  # worker slot -> (index, deadline)
  # index -> the lowest worker serial it may go to: set when its first worker died on it.
  resend_from: dict = dataclasses.field(default_factory=dict)

  def lost(self, index: int, next_serial: int) -> bool:
    """Its worker died before answering: queue it again for a fresh worker (True), unless
    this is its second worker to die (False: its verdict is 'error')."""
    if index in self.resend_from:
      return False
    self.resend_from[index] = next_serial
    self.pending.appendleft(index)
    return True

  def next_for(self, w: _Worker) -> int | None:
    """The first pending sample this worker may take."""
    return next((i for i in self.pending if self.resend_from.get(i, 0) <= w.serial), None)


class VerifyPool:
  """`num_workers` processes judging (gold, answer) pairs; see `verify_many`.

  A sample's clock starts when it is handed to a worker, so a batch of n samples takes at most
  about ceil(n / num_workers) * timeout_s (plus start-up, for the first batch: `wait_ready`);
  a sample whose worker died is sent once more, which can add a start-up and a timeout_s.
  Thread-safe (one batch at a time).
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, memory_limit_mb: int = 4096,
               start_timeout_s: float = 60.0, score_fn: str = ''):
    """`score_fn`: judge with the user's function instead (module doc); it is imported here
    first, so a bad spec is a one-line ValueError before any worker starts."""
    if num_workers < 1:
      raise ValueError(f'num_workers={num_workers} must be >= 1')
    if not timeout_s > 0:
      raise ValueError(f'timeout_s={timeout_s} must be > 0')
    self.timeout_s, self.memory_limit_mb = timeout_s, memory_limit_mb
    self.start_timeout_s = start_timeout_s
    if score_fn:
      load_score_fn(score_fn)
      module, _, name = score_fn.strip().rpartition(':')
      if module.endswith('.py') or os.sep in module:  # workers start elsewhere in the tree
        score_fn = f'{os.path.abspath(module)}:{name}'
    self.score_fn = score_fn
    self.last_error: str | None = None  # a score_fn's latest error message
    self._errors_logged = 0
    self.counters = {'timeout': 0, 'error': 0, 'restarts': 0, 'start_failures': 0,
                     'resent': 0}
    self._spawned = 0  # workers spawned so far: the next one's serial
    self._lock = threading.Lock()
    # Workers are forked from this one thread (see the module docstring: the parent-death
    # signal follows the forking thread).
    self._forker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='verify-fork')
    # A slot is None after a failed start; it is retried at the next batch, not in a tight loop.
    self._workers: list[_Worker | None] = [None] * num_workers
    self._finalizer = weakref.finalize(self, _shut_down, self._workers, self._forker)  # at exit too
    self._fill_slots()

  def verify_many(self, pairs: list[tuple[str, str]]) -> list[str]:
    """One verdict per (gold, answer) pair, in order; no input makes this raise or hang."""
    with self._lock:
      if not self._finalizer.alive:
        raise RuntimeError('VerifyPool is closed')
      try:
        self._fill_slots()
        return self._run(pairs)
      except Exception:  # a bug here must not take the caller down; the batch is lost
        logging.exception('VerifyPool: batch failed')
        self.counters['error'] += len(pairs)
        _kill_all(self._workers)  # their state is unknown; the next batch starts fresh ones
        return ['error'] * len(pairs)

  def wait_ready(self, timeout_s: float | None = None) -> bool:
    """Blocks until every worker has started (else the first batch waits for them)."""
    deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
    with self._lock:
      self._fill_slots()
      while True:
        starting = {w.conn: slot for slot, w in enumerate(self._workers) if w and not w.ready}
        if not starting:
          return all(self._workers)
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        for conn in mp_connection.wait(list(starting), timeout=left):
          self._on_message(starting[conn], _Batch([], collections.deque()))

  def close(self) -> None:
    with self._lock:
      self._finalizer()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # --- internals -----------------------------------------------------------------------------

  def _run(self, pairs):
    batch = _Batch([None] * len(pairs), collections.deque(range(len(pairs))))
    results, pending, busy = batch.results, batch.pending, batch.busy
    # Waiting on workers that are still starting is bounded too, by start_timeout_s.
    stall_deadline = time.monotonic() + self.start_timeout_s
    while pending or busy:
      now = time.monotonic()
      for slot, w in enumerate(self._workers):
        if not pending:
          break
        if w and w.ready and slot not in busy and (index := batch.next_for(w)) is not None:
          try:
            w.conn.send(pairs[index])
          except (OSError, ValueError):  # died while idle; the job waits for another worker
            self._replace(slot)
            continue
          pending.remove(index)
          busy[slot] = (index, now + self.timeout_s)
          stall_deadline = now + self.start_timeout_s
      watched = {w.conn: slot for slot, w in enumerate(self._workers)
                 if w and (slot in busy or not w.ready)}
      if pending and not busy and (not watched or now >= stall_deadline):
        # No worker can take these: every start failed, or none finished starting in time.
        logging.error('VerifyPool: no worker available; %d samples get verdict error',
                      len(pending))
        while pending:
          results[pending.popleft()] = 'error'
          self.counters['error'] += 1
        break
      wait_s = min(d for _, d in busy.values()) - now if busy else stall_deadline - now
      for conn in mp_connection.wait(list(watched), timeout=max(0.0, wait_s)):
        self._on_message(watched[conn], batch)
      now = time.monotonic()
      for slot, (index, deadline) in list(busy.items()):
        if now >= deadline:
          del busy[slot]
          results[index] = 'timeout'
          self.counters['timeout'] += 1
          self._replace(slot)
    return results

  def _on_message(self, slot, batch):
    w, busy, results = self._workers[slot], batch.busy, batch.results
    try:
      msg = w.conn.recv()
    except (EOFError, OSError):  # the worker died: a segfault, the OOM killer, a broken start
      if slot in busy:
        index = busy.pop(slot)[0]
        if batch.lost(index, next_serial=self._spawned):  # the replacement below qualifies
          self.counters['resent'] += 1
        else:
          results[index] = 'error'
          self.counters['error'] += 1
      if w.ready:
        self._replace(slot)
      else:
        self.counters['start_failures'] += 1
        _kill(w)
        self._workers[slot] = None
      return
    if msg == _READY:
      w.ready = True
    elif slot in busy:
      index, _ = busy.pop(slot)
      results[index] = self._accept(msg)
      if results[index] == 'error':
        self.counters['error'] += 1

  def _accept(self, msg):
    """A worker's message as a verdict: one of VERDICTS, or a score_fn's ('scored', reward,
    status); its ('error', message) is 'error', the message logged (the first few) and kept."""
    if isinstance(msg, str):
      return msg if msg in VERDICTS else 'error'
    if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == 'scored':
      return msg
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == 'error':
      self.last_error = str(msg[1])
      if self._errors_logged < 5:
        self._errors_logged += 1
        logging.warning('VerifyPool: %s', self.last_error)
    return 'error'

  def _spawn(self) -> _Worker:
    parent_sock, child_sock = socket.socketpair()
    try:
      cpu_backstop_s = int(2 * self.timeout_s) + 10
      # -P: the script's directory (pipelinerl_jax/tasks, which holds math.py) must not shadow
      # the standard library.
      proc = self._forker.submit(
          subprocess.Popen,
          [sys.executable, '-P', os.path.abspath(__file__), str(child_sock.fileno()),
           str(self.memory_limit_mb), str(cpu_backstop_s), str(os.getpid()), self.score_fn],
          pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL,
          env=_worker_env(self.score_fn)).result()
    finally:
      child_sock.close()  # the child holds its copy; ours must go so its death reads as EOF
    self._spawned += 1
    return _Worker(proc, mp_connection.Connection(parent_sock.detach()), self._spawned - 1)

  def _fill_slots(self):
    for slot, w in enumerate(self._workers):
      if w is None:
        self._workers[slot] = self._spawn()

  def _replace(self, slot):
    _kill(self._workers[slot])
    self._workers[slot] = self._spawn()
    self.counters['restarts'] += 1


def _worker_env(score_fn: str) -> dict[str, str] | None:
  """A score_fn's module is found in a worker where it is found here: this process's import
  path (the working directory for '') goes to the worker as PYTHONPATH; this file's directory
  stays out (its math.py would shadow the standard library's). None: inherit."""
  if not score_fn:
    return None
  here = os.path.dirname(os.path.abspath(__file__))
  paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(dict.fromkeys(p for p in paths if p != here))
  return env


def _kill(w: _Worker | None) -> None:
  if w is None:
    return
  try:
    w.proc.kill()
    w.proc.wait(timeout=1.0)
  except Exception:
    pass
  w.conn.close()


def _kill_all(workers: list) -> None:
  for slot, w in enumerate(workers):
    _kill(w)
    workers[slot] = None


def _shut_down(workers: list, forker: concurrent.futures.ThreadPoolExecutor) -> None:
  _kill_all(workers)
  forker.shutdown(wait=False)


if __name__ == '__main__':
  _worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
               sys.argv[5] if len(sys.argv) > 5 else '')
