"""A run's output directories: checked before the model loads, and locked while the run owns
them.

Checks (`check_dir`, `check_free_space`) turn what would fail late -- a workdir that is a file,
an unwritable checkpoint dir found at the first save, a disk too small for the checkpoints --
into one line before anything heavy starts.

The lock (`DirLock`) keeps a second run out of a directory in use: two runs would interleave
metrics.jsonl and mix their checkpoints. It is a POSIX record lock (`fcntl.lockf`) on
DIR/.lock, which holds the holder's pid, host, start time and command: the kernel drops the
lock when its process dies, even by kill -9, so a lock left by a killed run is taken over (and
said so), never waited on. Record locks are not inherited by forked children, so a child that
outlives the run cannot keep the directory locked. They do not exclude a second lock from the
same process: a registry of the paths this process holds covers that. (On NFS, lockf needs the
lock daemon; without it the lock is advisory only.)

This module imports the standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time

LOCK_FILE = '.lock'
# The workdir's own outputs (metrics, TensorBoard, curves, eval samples): a floor, not an estimate.
MIN_WORKDIR_FREE_BYTES = 16 << 20

_held: set[str] = set()         # real paths this process has locked
_held_lock = threading.Lock()


class DirInUse(ValueError):
  """Another live run holds the directory."""


def _mb(n: int) -> str:
  return f'{n / 2**20:.1f} MB'


def _existing_ancestor(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def check_dir(path: str, key: str) -> None:
  """`path` is a directory, or can be made one, and a file can be written in it; else a
  ValueError naming `key` (the flag or config key that set it)."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f'{key}: {path} is a file, not a directory')
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f'.write-check-{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ValueError(f'{key}: cannot write in {path} ({e.strerror or type(e).__name__})'
                     ) from None


def check_free_space(needs: list[tuple[str, int, str]]) -> None:
  """needs: (path, bytes, what for) of each output. Outputs on one filesystem add up; a
  filesystem with less free space than its outputs need is a one-line ValueError."""
  by_device: dict[int, list[tuple[str, int, str]]] = {}
  for path, nbytes, what in needs:
    by_device.setdefault(os.stat(_existing_ancestor(path)).st_dev, []).append(
        (path, nbytes, what))
  for entries in by_device.values():
    free = shutil.disk_usage(_existing_ancestor(entries[0][0])).free
    total = sum(n for _, n, _ in entries)
    if free < total:
      parts = ' + '.join(f'{what} {_mb(n)}' for _, n, what in entries)
      raise ValueError(f'{entries[0][2]}: {entries[0][0]} has {_mb(free)} free, the run needs '
                       f'{_mb(total)} ({parts}); free some space or write elsewhere')


class DirLock:
  """`with DirLock(path, key):` holds DIR/.lock for the run; a second holder gets DirInUse."""

  def __init__(self, path: str, key: str):
    self.path, self.key = os.path.realpath(path), key
    self.file = os.path.join(self.path, LOCK_FILE)
    self._fd: int | None = None
    self.took_over: dict | None = None   # the previous holder's record, when it had died

  def acquire(self) -> 'DirLock':
    with _held_lock:
      if self.path in _held:
        raise DirInUse(f'{self.key}: {self.path} is in use by another run in this process')
      fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _read_holder(fd)
        os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):
          raise ValueError(f'{self.key}: cannot lock {self.file} ({e.strerror})') from None
        raise DirInUse(f'{self.key}: {self.path} is in use by another run ({_describe(holder)}); '
                       'stop it or use another directory') from None
      self.took_over = _read_holder(fd) or None  # a record left behind: its run never released
      record = dict(pid=os.getpid(), host=socket.gethostname(),
                    started=time.strftime('%Y-%m-%d %H:%M:%S'), command=' '.join(sys.argv))
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(record).encode(), 0)
      self._fd = fd
      _held.add(self.path)
    return self

  def release(self) -> None:
    """Empties the record (a clean exit) and drops the lock. The file stays: unlinking it would
    let a run that opened it just before lock a file no one else can see."""
    if self._fd is None:
      return
    with _held_lock:
      try:
        os.ftruncate(self._fd, 0)
      except OSError:  # a full or read-only disk must not hide the run's own outcome
        pass
      os.close(self._fd)  # closing drops the record lock
      self._fd = None
      _held.discard(self.path)

  def __enter__(self) -> 'DirLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> dict:
  try:
    return json.loads(os.pread(fd, 4096, 0).decode() or '{}')
  except (OSError, ValueError):
    return {}


def _describe(holder: dict) -> str:
  if not holder:
    return 'holder unknown'
  return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
          f"{holder.get('command', '')[:120]}")
