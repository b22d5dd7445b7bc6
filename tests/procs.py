"""What a run leaves behind: the processes it started and the /dev/shm entries they used.

For tests that end a run (kill -9, a signal, an error) and check that nothing of it survives:

  proc = subprocess.Popen(cmd, start_new_session=True)   # its own session: all of its children
  tree = procs.RunTree(proc.pid).watch()                 # samples until stopped
  ...                                                    # let it start children, then kill it
  tree.stop()
  tree.assert_clean(timeout_s=10)                        # no process, no /dev/shm entry left

A process counts as the run's when it descends from the root or shares its session (a child
re-parented to init after a kill -9 keeps its session id). Processes are identified by (pid,
start time), so a recycled pid is never taken for a survivor; zombies count as gone. /dev/shm
entries count when a process of the run had them mapped or open while it was sampled, so
entries of other programs on the machine are never blamed on the run.
"""

from __future__ import annotations

import os
import threading
import time

SHM = '/dev/shm/'


def _stat(pid: int) -> list[str] | None:
  """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None


def start_time(pid: int) -> int | None:
  fields = _stat(pid)
  return int(fields[19]) if fields else None  # field 22 of stat; the 20th after the name


def alive(pid: int, started: int) -> bool:
  fields = _stat(pid)
  return bool(fields) and fields[0] not in ('Z', 'X') and int(fields[19]) == started


def cmdline(pid: int) -> str:
  try:
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      return f.read().replace(b'\0', b' ').decode(errors='replace').strip()[:200]
  except OSError:
    return '?'


def _all_pids() -> list[int]:
  return [int(name) for name in os.listdir('/proc') if name.isdigit()]


def members(root: int, session: int | None) -> dict[int, int]:
  """{pid: start time} of `root`'s descendants and of the processes in `session`."""
  parent, sid = {}, {}
  for pid in _all_pids():
    fields = _stat(pid)
    if fields and fields[0] not in ('Z', 'X'):
      parent[pid], sid[pid] = int(fields[1]), int(fields[3])
  found = {pid for pid, s in sid.items() if session is not None and s == session}
  frontier, visited = [root], {root}
  while frontier:
    p = frontier.pop()
    kids = [c for c, pp in parent.items() if pp == p and c not in visited]
    visited.update(kids)
    frontier += kids
  found = (found | visited) - {root}
  out = {}
  for pid in found:
    started = start_time(pid)
    if started is not None:
      out[pid] = started
  return out


def shm_used(pid: int) -> set[str]:
  """/dev/shm paths that `pid` has mapped (shared memory, POSIX semaphores) or open."""
  used = set()
  try:
    with open(f'/proc/{pid}/maps') as f:
      for line in f:
        i = line.find(SHM)
        if i >= 0:
          used.add(line[i:].strip().removesuffix(' (deleted)'))
  except OSError:
    pass
  try:
    for fd in os.listdir(f'/proc/{pid}/fd'):
      try:
        target = os.readlink(f'/proc/{pid}/fd/{fd}')
      except OSError:
        continue
      if target.startswith(SHM):
        used.add(target.removesuffix(' (deleted)'))
  except OSError:
    pass
  return used


class RunTree:
  """The processes and /dev/shm entries of the run rooted at `root` (see the module doc)."""

  def __init__(self, root: int):
    self.root = root
    self.root_started = start_time(root)
    try:
      self.session = os.getsid(root)
    except OSError:
      self.session = None
    if self.session == os.getsid(0):  # the caller's own session: not the run's
      self.session = None
    self.seen: dict[int, tuple[int, str]] = {}   # pid -> (start time, command line)
    self.shm: set[str] = set()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def sample(self) -> 'RunTree':
    for pid, started in members(self.root, self.session).items():
      if pid not in self.seen:
        self.seen[pid] = (started, cmdline(pid))
      self.shm |= shm_used(pid)
    if self.root_started is not None and alive(self.root, self.root_started):
      self.shm |= shm_used(self.root)
    return self

  def watch(self, interval_s: float = 0.2) -> 'RunTree':
    """Samples in a background thread until `stop()`."""
    def loop():
      while not self._stop.wait(interval_s):
        self.sample()
    self.sample()
    self._thread = threading.Thread(target=loop, name='run-tree-watch', daemon=True)
    self._thread.start()
    return self

  def stop(self) -> 'RunTree':
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    return self.sample()

  def survivors(self) -> list[str]:
    now = members(self.root, self.session)
    out = [f'{pid} {cmd}' for pid, (started, cmd) in self.seen.items() if alive(pid, started)]
    out += [f'{pid} {cmdline(pid)}' for pid, started in now.items()
            if pid not in self.seen and alive(pid, started)]
    return out

  def leaked_shm(self) -> list[str]:
    return sorted(p for p in self.shm if os.path.exists(p))

  def assert_clean(self, timeout_s: float = 10.0) -> None:
    """Waits up to timeout_s for the run's processes to end and its /dev/shm entries to go."""
    deadline = time.monotonic() + timeout_s
    while (self.survivors() or self.leaked_shm()) and time.monotonic() < deadline:
      time.sleep(0.1)
    survivors, shm = self.survivors(), self.leaked_shm()
    assert not survivors, f'processes of the run survived it: {survivors}'
    assert not shm, f'/dev/shm entries of the run survived it: {shm}'
