"""Two hosts inside this machine, for tests: tools/two_hosts.sh's hosts `a` and `b` (network,
UTS, mount and PID namespaces joined by a veth pair; see the script's header).

  reason = two_hosts.unavailable()           # why namespaces cannot be made here, or None
  with two_hosts.TwoHosts(state_dir) as hosts:
    proc = hosts.popen('b', argv, log)       # a process on host b (its stdout and stderr: log)
    hosts.link('down'); hosts.link('up')     # b's end of the cable
    hosts.kill('b')                          # every process on b, with -9 (b can run more)
    hosts.processes('a')                     # what runs on a (not the harness's init)

Leaving the block removes both hosts, their namespaces and the veth pair. The script holds them
for as long as its stdin is open, and its holders die with it (a parent-death signal), so a test
process that is killed with -9 leaves nothing either.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time

import procs  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tools' / 'two_hosts.sh'
ADDRESS = {'a': '198.18.0.1', 'b': '198.18.0.2'}
INTERFACE = 'wire0'
TOOLS = ('ip', 'unshare', 'nsenter', 'setpriv')


def unavailable() -> str | None:
  """Why network namespaces cannot be made here (one line), or None when they can."""
  if os.geteuid() != 0:
    return 'two hosts need root (network namespaces and a veth pair)'
  missing = [t for t in TOOLS if shutil.which(t) is None]
  if missing:
    return f'{", ".join(missing)} not installed (apt-get install iproute2 util-linux)'
  probe = subprocess.run(['unshare', '--net', '--uts', '--mount', '--pid', '--fork', 'true'],
                         capture_output=True, text=True)
  if probe.returncode:
    return f'cannot make namespaces here: {probe.stderr.strip().splitlines()[-1:]}'
  return None


def _pid_namespace(pid: int, kind: str = 'pid') -> str | None:
  try:
    return os.readlink(f'/proc/{pid}/ns/{kind}')
  except OSError:
    return None


def in_namespaces(namespaces: set[str]) -> list[str]:
  """'PID command' of every live process in any of `namespaces` (`TwoHosts.namespaces()`): an
  anonymous namespace, and the veth pair in a network one, lasts as long as such a process."""
  out = []
  for name in os.listdir('/proc'):
    if name.isdigit() and _state(int(name)) not in ('Z', 'X'):
      if {_pid_namespace(int(name), kind) for kind in ('net', 'pid')} & namespaces:
        out.append(f'{name} {procs.cmdline(int(name))}')
  return out


def _state(pid: int) -> str:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0]
  except (OSError, IndexError):
    return 'X'


class TwoHosts:
  """Hosts a and b for the length of a `with` block; `state_dir` must not exist or be empty."""

  def __init__(self, state_dir: str | os.PathLike):
    self.dir = pathlib.Path(state_dir)
    self._keeper: subprocess.Popen | None = None
    self.procs: list[subprocess.Popen] = []

  @property
  def keeper_pid(self) -> int:
    """`tools/two_hosts.sh up`'s pid: the hosts live as long as it does."""
    return self._keeper.pid

  def __enter__(self) -> 'TwoHosts':
    self._keeper = subprocess.Popen(
        ['setpriv', '--pdeathsig', 'KILL', str(SCRIPT), 'up', str(self.dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = self._keeper.stdout.readline().strip()
    if not line.startswith('two hosts up'):
      self.close()
      raise RuntimeError(f'tools/two_hosts.sh up: {line or "no output"}')
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def init(self, host: str) -> int:
    return int((self.dir / f'{host}.init').read_text())

  def namespaces(self) -> set[str]:
    """The hosts' network and PID namespaces, as /proc/PID/ns names them ('net:[4026532…]')."""
    out = set()
    for host in ('a', 'b'):
      for kind, pid in (('net', self.init(host)), ('pid', self.init(host))):
        out.add(os.readlink(f'/proc/{pid}/ns/{kind}'))
    return out

  def command(self, host: str, argv) -> list[str]:
    """`argv` as run on `host` (its namespaces; this cwd), which gets SIGTERM if nsenter, its
    parent outside the host, dies (nsenter passes no signal on)."""
    return ['nsenter', '-t', str(self.init(host)), '-n', '-u', '-m', '-p', f'--wd={os.getcwd()}',
            '--', 'setpriv', '--pdeathsig', 'TERM', '--', *map(str, argv)]

  def popen(self, host: str, argv, log: str | os.PathLike, env: dict | None = None,
            **kwargs) -> subprocess.Popen:
    with open(log, 'a') as out:
      proc = subprocess.Popen(self.command(host, argv), stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, **kwargs)
    self.procs.append(proc)
    return proc

  def run(self, host: str, argv, timeout_s: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(self.command(host, argv), capture_output=True, text=True,
                          timeout=timeout_s, **kwargs)

  def link(self, state: str) -> None:
    """'down' pulls b's end of the cable (a sees the carrier go), 'up' plugs it back."""
    subprocess.run([str(SCRIPT), 'link', str(self.dir), state], check=True, timeout=30)

  def kill(self, host: str) -> None:
    """SIGKILL to every process on `host` but the harness's init; its network stays."""
    subprocess.run([str(SCRIPT), 'kill', str(self.dir), host], check=True, timeout=30)

  def processes(self, host: str) -> list[str]:
    """'PID command' of every live process on `host` (by its PID namespace; zombies are gone)
    but the harness's init."""
    init = self.init(host)
    ns = _pid_namespace(init)
    out = []
    for name in os.listdir('/proc'):
      if name.isdigit() and int(name) != init and _pid_namespace(int(name)) == ns:
        if _state(int(name)) not in ('Z', 'X'):
          out.append(f'{name} {procs.cmdline(int(name))}')
    return out

  def wait_empty(self, host: str, timeout_s: float) -> list[str]:
    """Waits up to timeout_s for `host` to run nothing; returns what still runs."""
    deadline = time.monotonic() + timeout_s
    while (left := self.processes(host)) and time.monotonic() < deadline:
      time.sleep(0.2)
    return left

  def close(self) -> None:
    for p in self.procs:  # nsenter's side of the hosts' processes (they die with the hosts)
      if p.poll() is None:
        p.kill()
    if self._keeper is not None and self._keeper.poll() is None:
      self._keeper.stdin.close()  # EOF: the script removes the hosts
      try:
        self._keeper.wait(30)
      except subprocess.TimeoutExpired:
        self._keeper.kill()  # the holders die with it (parent-death signal)
        self._keeper.wait()
    for p in self.procs:
      p.wait()
