"""The Ray cluster a run's actors live on: join one, or start a local one that dies with the run.

`connect(config.cluster)` returns a `Session`; `Session.close()` ends it. Two cases:

  * `address` 'auto' or 'HOST:PORT': join a cluster started with `ray start` (docs/scaling.md).
    Ray ties the actors this driver creates to it: when the driver exits or dies, Ray kills
    them; the cluster itself keeps running.
  * `address` '': start Ray on this host for this run, quietly (no dashboard, no usage stats,
    no worker logs forwarded). Ray's head processes (gcs_server, raylet, ...) are the driver's
    children, started deaf to Ctrl-C (the driver stops them after saving; Ray's own SIGTERM
    handler in the driver is replaced by the run's again), and most end when the driver does;
    but, measured with Ray 2.60, a driver killed with -9 leaves the raylet's agents
    (DashboardAgent, RuntimeEnvAgent) running for good. So a local
    start also launches a watchdog (`python -m pipelinerl_jax.cluster`, stdlib only): it keeps
    a list of every process under Ray's head processes and, once the driver has gone (its pipe
    to the watchdog closes, whether by `close()`, an exception or SIGKILL), stops whatever of
    that list still runs: SIGTERM, then SIGKILL. The object store's shared memory is a /dev/shm
    file Ray unlinks as soon as it maps it, so it goes with the last process that maps it.

Nothing here is specific to generators: trainer actors can live on the same session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from typing import Iterable, Sequence

GRACE_S = 3.0        # the watchdog lets Ray's processes end by themselves this long
TERM_WAIT_S = 2.0    # then SIGTERM, and SIGKILL after this long
SCAN_S = 0.5         # how often the watchdog refreshes its list of Ray's processes


# --- processes, from /proc ---------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
  """(state, ppid, start time in clock ticks) of a process, None if it is gone."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[0], int(fields[1]), int(fields[19])


def process_table() -> dict[int, tuple[str, int, int]]:
  """{pid: (state, ppid, start time)} of every process on this host."""
  table = {}
  for name in os.listdir('/proc'):
    if name.isdigit():
      stat = _stat(int(name))
      if stat is not None:
        table[int(name)] = stat
  return table


def descendants(roots: Iterable[int], table: dict[int, tuple[str, int, int]] | None = None
                ) -> set[int]:
  """Every process below `roots` (not the roots themselves)."""
  table = process_table() if table is None else table
  children: dict[int, list[int]] = {}
  for pid, (_, ppid, _) in table.items():
    children.setdefault(ppid, []).append(pid)
  out, todo = set(), list(roots)
  while todo:
    for child in children.get(todo.pop(), ()):
      if child not in out:
        out.add(child)
        todo.append(child)
  return out


def alive(tracked: dict[int, int]) -> dict[int, int]:
  """The processes of {pid: start time} that still run (the same process: a reused pid has
  another start time; a zombie has ended)."""
  out = {}
  for pid, start in tracked.items():
    stat = _stat(pid)
    if stat is not None and stat[2] == start and stat[0] != 'Z':
      out[pid] = start
  return out


def _set_affinity(cores: Sequence[int]) -> None:
  """Every thread of this process on `cores`; threads started later inherit it."""
  for tid in os.listdir('/proc/self/task'):
    try:
      os.sched_setaffinity(int(tid), cores)
    except ProcessLookupError:  # the thread ended meanwhile
      pass


def pin_threads(cores: Sequence[int]) -> None:
  """Pins every thread of this process to `cores` (threads started later inherit it) and sizes
  the thread pools that read their size from the environment: for an actor's process, before
  JAX (XLA) or torch size their pools from the cores they may use."""
  cores = tuple(sorted(int(c) for c in cores))
  _set_affinity(cores)
  n = str(len(cores))
  os.environ.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)


def thread_affinity() -> dict[int, str]:
  """{thread id: Cpus_allowed_list} for every thread of this process, as the kernel has it."""
  out = {}
  for tid in os.listdir('/proc/self/task'):
    try:
      with open(f'/proc/self/task/{tid}/status') as f:
        for line in f:
          if line.startswith('Cpus_allowed_list:'):
            out[int(tid)] = line.split(':', 1)[1].strip()
    except OSError:  # the thread ended meanwhile
      pass
  return out


def cpu_list(text: str) -> list[int]:
  """'0-2,5' -> [0, 1, 2, 5] (the kernel's Cpus_allowed_list format)."""
  out = []
  for part in text.split(','):
    lo, _, hi = part.partition('-')
    out += range(int(lo), int(hi or lo) + 1)
  return out


@contextlib.contextmanager
def pinned(cores: Sequence[int] | None):
  """Every thread of this process on `cores` inside the block, on the cores it had before
  after it (None: left alone). For a process whose pools already run (the driver's JAX): they
  keep their size and share these cores."""
  if cores is None:
    yield
    return
  before = os.sched_getaffinity(0)
  _set_affinity(tuple(sorted(int(c) for c in cores)))
  try:
    yield
  finally:
    _set_affinity(before)


# --- this host's network -----------------------------------------------------------------------


def _ipv4_of(name: str) -> str | None:
  """The IPv4 address of interface `name` (the kernel's SIOCGIFADDR), None without one."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack('256s', name[:15].encode()))
    except OSError:
      return None
  return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str | None]:
  """{interface name: its IPv4 address or None} of this host (its network namespace)."""
  return {name: _ipv4_of(name) for _, name in socket.if_nameindex()}


def _described(found: dict[str, str | None]) -> str:
  return ', '.join(f'{name} {ip}' if ip else name for name, ip in found.items())


def interface_address(name: str, key: str = 'config.cluster.interface') -> str:
  """The IPv4 address of interface `name` on this host; a one-line ValueError naming `key`, the
  host and its interfaces when it has no such interface, or one without an IPv4 address."""
  found = interfaces()
  if found.get(name):
    return found[name]
  why = 'has no IPv4 address' if name in found else 'does not exist'
  raise ValueError(f'{key}={name!r}: that interface {why} on host {socket.gethostname()} '
                   f'(its interfaces: {_described(found)})')


def check_local_address(ip: str, key: str = 'config.cluster.node_ip') -> str:
  """`ip`, if it is an IPv4 address of this host's interfaces; else a one-line ValueError naming
  `key`, the host and its addresses."""
  found = interfaces()
  if ip not in found.values():
    raise ValueError(f'{key}={ip!r} is not an address of host {socket.gethostname()} '
                     f'(its interfaces: {_described(found)})')
  return ip


def interface_bytes(name: str, key: str = 'config.cluster.interface') -> tuple[int, int]:
  """(received, sent) bytes of interface `name` since it was made, as the kernel counts them
  (/proc/net/dev: this process's network namespace); a one-line ValueError as
  `interface_address`'s when there is no such interface."""
  with open('/proc/net/dev') as f:
    for line in f:
      iface, sep, counters = line.partition(':')
      if sep and iface.strip() == name:
        fields = counters.split()
        return int(fields[0]), int(fields[8])
  raise ValueError(f'{key}={name!r}: that interface does not exist on host '
                   f'{socket.gethostname()} (its interfaces: {_described(interfaces())})')


class NetworkCounter:
  """The bytes this host received and sent on interface `name` since the counter was made: what
  crossed between the hosts when they talk over it (a step's record: `totals()`)."""

  def __init__(self, name: str):
    self.name = name
    self._start = interface_bytes(name)

  def totals(self) -> dict[str, int]:
    rx, tx = interface_bytes(self.name)
    return {'net/rx_bytes': rx - self._start[0], 'net/tx_bytes': tx - self._start[1]}


# --- the watchdog ------------------------------------------------------------------------------


def watch(roots: Sequence[int], control=sys.stdin) -> None:
  """Tracks `roots` and everything below them until `control` reaches EOF (the driver closed
  it or died), then ends what still runs. Ignores Ctrl-C and SIGTERM: it shares the driver's
  process group, and must outlive the driver to clean up after it."""
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  tracked: dict[int, int] = {}

  def scan():
    table = process_table()
    for pid in set(roots) | descendants(set(roots) | set(tracked), table):
      if pid in table and pid not in tracked:
        tracked[pid] = table[pid][2]

  fd = control.fileno()
  while True:
    scan()
    ready, _, _ = select.select([fd], [], [], SCAN_S)
    if ready and not os.read(fd, 4096):
      break
  scan()
  stop(tracked)


def stop(tracked: dict[int, int], grace_s: float = GRACE_S) -> None:
  """Waits up to `grace_s` for the processes to end, then SIGTERM, then SIGKILL."""
  for sig, wait_s in ((None, grace_s), (signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, 1.0)):
    running = alive(tracked)
    if sig is not None:
      for pid in running:
        try:
          os.kill(pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + wait_s
    while running and time.monotonic() < deadline:
      time.sleep(0.05)
      running = alive(running)
    if not running:
      return


# --- the driver's side -------------------------------------------------------------------------


@dataclasses.dataclass
class Session:
  """A connection to a Ray cluster; `close()` disconnects (and ends a local cluster)."""
  address: str                          # the GCS address
  local: bool                           # started here for this run
  node_ip: str                          # this driver's node
  owned: bool = True                    # False: Ray was already up in this process; leave it
  head_pids: tuple[int, ...] = ()       # local start: Ray's head processes
  watchdog: subprocess.Popen | None = None

  def close(self, timeout_s: float = 15.0) -> None:
    """Disconnects; a local cluster is shut down and the watchdog ends what is left of it."""
    if not self.owned:
      return
    self.owned = False
    import ray
    try:
      ray.shutdown()
    finally:
      if self.watchdog is not None:
        self.watchdog.stdin.close()  # EOF: the watchdog stops what is left, then exits
        try:
          self.watchdog.wait(timeout_s)
        except subprocess.TimeoutExpired:
          self.watchdog.kill()  # our own child, by its handle
          self.watchdog.wait()


@contextlib.contextmanager
def _signals_kept(local: bool):
  """Two things around `ray.init`, in the main thread:
  * Ray's C++ core installs its own SIGTERM handler in the driver (it logs and aborts), which
    would replace the run's (main.py: SIGTERM stops the run like Ctrl-C); the driver's handler
    is put back afterwards.
  * A local start's head processes share the driver's process group, so a Ctrl-C in a terminal
    reaches them too and they die at once, under a driver still saving and stopping its actors.
    Started with SIGINT ignored (a disposition that survives exec), they stay up until the
    driver's `close()` ends them."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  term = signal.getsignal(signal.SIGTERM)
  interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if local else None
  try:
    yield
  finally:
    if local:
      signal.signal(signal.SIGINT, interrupt)
    if term is not None:  # None: set outside Python; leave Ray's
      signal.signal(signal.SIGTERM, term)


@contextlib.contextmanager
def _quiet_fork():
  """JAX warns at every fork of a process it runs in; these forks exec at once (Ray's
  processes, the watchdog), which is safe."""
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message=r'os\.fork\(\) was called', category=RuntimeWarning)
    yield


def _ray_init(**kwargs):
  import ray
  with _quiet_fork():
    return ray.init(include_dashboard=False, log_to_driver=False, configure_logging=True,
                    logging_level=logging.ERROR, **kwargs)


def connect(config, *, gpus: Sequence[str] | None = None) -> Session:
  """Joins `config.address` (a `config_lib.ClusterConfig`) or starts a local cluster.

  `gpus`: for a local start, the CUDA_VISIBLE_DEVICES entries Ray may hand to actors (so that
  they never land on the trainer's GPUs); None = what Ray detects. When Ray is already up in this
  process (a test's fixture, a notebook), the session uses it and leaves it running."""
  import ray
  if ray.is_initialized():
    ctx = ray.get_runtime_context()
    return Session(address=ctx.gcs_address, local=False,
                   node_ip=ray.util.get_node_ip_address(), owned=False)
  os.environ.setdefault('RAY_USAGE_STATS_ENABLED', '0')  # read by the processes Ray starts
  node = {}
  if config.node_ip:  # Ray's own guess follows a route to a public address, or the host name
    node['_node_ip_address'] = check_local_address(config.node_ip)
  if config.address:
    try:
      with _signals_kept(local=False):
        ctx = _ray_init(address=config.address, **node)
    except (ConnectionError, RuntimeError, ValueError) as e:
      hint = '' if config.node_ip else '; set config.cluster.node_ip to this host\'s address'
      raise ConnectionError(f'config.cluster.address={config.address!r}: cannot join that Ray '
                            f'cluster ({type(e).__name__}: {str(e).splitlines()[0]}{hint})'
                            ) from None
    return Session(address=ctx.address_info['gcs_address'], local=False,
                   node_ip=ray.util.get_node_ip_address())

  before = descendants([os.getpid()])
  kwargs = dict(num_cpus=config.num_cpus or os.cpu_count(), **node)
  if config.object_store_mb:
    kwargs['object_store_memory'] = config.object_store_mb << 20
  saved = os.environ.get('CUDA_VISIBLE_DEVICES')
  if config.num_gpus >= 0:
    kwargs['num_gpus'] = config.num_gpus
  if gpus is not None:
    # The raylet (and every worker it starts) sees these GPUs only; set while Ray starts. This
    # process's own GPUs were fixed when JAX started, before.
    os.environ['CUDA_VISIBLE_DEVICES'] = ','.join(gpus)
    kwargs.setdefault('num_gpus', len(gpus))
  try:
    # 'local': never an existing cluster that `ray start` left recorded in /tmp/ray.
    with _signals_kept(local=True):
      ctx = _ray_init(address='local', **kwargs)
  finally:
    if gpus is not None:
      if saved is None:
        os.environ.pop('CUDA_VISIBLE_DEVICES', None)
      else:
        os.environ['CUDA_VISIBLE_DEVICES'] = saved
  table = process_table()
  head = tuple(sorted(pid for pid in descendants([os.getpid()], table) - before
                      if table[pid][1] == os.getpid()))
  with _quiet_fork():
    watchdog = subprocess.Popen(
        [sys.executable, '-m', 'pipelinerl_jax.cluster', *map(str, head)],
        stdin=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return Session(address=ctx.address_info['gcs_address'], local=True,
                 node_ip=ray.util.get_node_ip_address(), head_pids=head, watchdog=watchdog)


if __name__ == '__main__':
  watch([int(a) for a in sys.argv[1:]])
