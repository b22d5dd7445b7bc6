"""One trainer in several processes (one per host): joining them with `jax.distributed`, who is
who, and starting N of them on one machine (tests, trying a multi-host config locally).

A multi-host JAX trainer is one SPMD program: every process runs the same jitted steps on one
mesh over all hosts' devices, each feeding and holding the shards on its own devices.
`initialize` joins this process to the others; it must run before any JAX computation (JAX
cannot join once its backend has started). With train.num_processes == 1 it does nothing, and
everything here answers for a single process.

Cross-process collectives on CPU use gloo (XLA's CPU client has none by default); on GPUs XLA
uses NCCL whatever that setting says. JAX builds its gloo transport without an interface
(GLOO_SOCKET_IFNAME is not read): gloo listens on the address the host name resolves to, which
on a host whose /etc/hosts maps its name to 127.0.1.1 (Debian's default) no other host can
reach; the collectives then fail only after gloo's connect retries, minutes later. So
`initialize` gives gloo an address: config.cluster.interface's on this host, else a Ray actor's
node address, and refuses JAX's default in one line when it is a loopback address while the
coordinator is on another host.

Heartbeats. Every process counts up a key in jax.distributed's key-value store every second or
so (`Heartbeats`); process 0 reads them, and a process whose count stands still for
train.distributed.heartbeat_timeout_s is lost (pipeline/multiprocess.py stops the run with one
line naming it and its host). A process that cannot reach process 0 that long stops itself,
also in one line. JAX's own heartbeat, which aborts every process with a fatal log when it
fires, is kept as the backstop, at twice the timeout plus 10 s, so that the run's own line
comes first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipelinerl_jax import cluster
from pipelinerl_jax import config as config_lib

_HOST_KEY = 'pipelinerl/process/'
_ALIVE_KEY = 'pipelinerl/alive/'
_LAST_WORDS_KEY = 'pipelinerl/last_words/'  # a process's own failure, written before it ends
_barriers: dict[str, int] = {}  # barrier name -> how many of that name this process passed
_hosts: dict[int, str] = {}   # process index -> 'host NAME, pid N', filled by `initialize`
_heartbeats: 'Heartbeats | None' = None
# How long a process waits at a barrier for the others: process 0 may be building the demo model
# or loading a large dataset meanwhile.
BARRIER_TIMEOUT_S = 3600
_gathered = False             # whole() ran once in this process


def initialize(config: config_lib.TrainConfig, coordinator_address: str | None = None,
               process_id: int | None = None, *, interface: str = '',
               host_address: str | None = None) -> None:
  """Joins the trainer's other processes (train.num_processes != 1), once per process.
  `coordinator_address` and `process_id` replace train.distributed's: what the driver hands out
  to the trainer processes it starts as Ray actors (pipeline/trainer_actors.py). Gloo listens on
  `interface`'s address on this host (config.cluster.interface), else on `host_address` (a Ray
  node's), else where JAX's default puts it (see the module's doc)."""
  if config.num_processes == 1 or jax.distributed.is_initialized():
    return
  if coordinator_address is not None:
    config = dataclasses.replace(config, distributed=dataclasses.replace(
        config.distributed, coordinator_address=coordinator_address, process_id=process_id))
  listen = cluster.interface_address(interface) if interface else host_address
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # JAX's preemption service would take SIGTERM for itself (a notice that every process must
  # poll at the same training steps); here a stop request goes to process 0, which decides.
  jax.config.update('jax_enable_preemption_service', False)
  d = config.distributed
  address = d.coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS') or None
  host = address.rsplit(':', 1)[0].strip('[]') if address else ''
  try:
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=config.num_processes or None,
        process_id=d.process_id if d.process_id >= 0 else None,
        initialization_timeout=d.initialization_timeout_s,
        # JAX's default listens on every address of the host ([::]:port)
        coordinator_bind_address=address if _is_local(host) else None,
        heartbeat_timeout_seconds=jax_heartbeat_s(d.heartbeat_timeout_s))
  except (ValueError, TypeError, RuntimeError) as e:
    # e.g. no address given and no scheduler to read it from, or a peer that never came
    raise ValueError(f'config.train.distributed: cannot join the other trainer processes '
                     f'({_first_line(e)})') from None
  if listen is None:
    _check_default_gloo_address()
  else:
    _gloo_listens_on(listen)
  _register_host()
  global _heartbeats
  _heartbeats = Heartbeats(coordination_client(), jax.process_index(), jax.process_count(),
                           d.heartbeat_timeout_s)


def jax_heartbeat_s(timeout_s: int) -> int:
  """JAX's own heartbeat timeout: the backstop behind the run's (`Heartbeats`), late enough that
  the run's one line comes first (its stop takes seconds after the loss is seen)."""
  return 2 * timeout_s + 10


def _is_local(host: str) -> bool:
  try:
    ipaddress.ip_address(host)
  except ValueError:
    return False  # a name: JAX binds every address, as by default
  return host in cluster.interfaces().values()


def _gloo_listens_on(address: str) -> None:
  """JAX's CPU client, when it starts, with gloo collectives listening on `address` (JAX's own
  factory passes gloo no address). Before JAX's backend starts: it reads the factory then."""
  from jax._src import distributed as jax_distributed  # the client of `initialize`
  from jax._src import xla_bridge
  from jax._src.lib import _jax
  from jax.extend import backend
  collectives = _jax.make_gloo_tcp_collectives(
      distributed_client=jax_distributed.global_state.client, hostname=address)
  backend.register_backend_factory(
      'cpu', functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
      priority=0, fail_quietly=False)


def _check_default_gloo_address() -> None:
  """JAX's default: gloo listens on what the host name resolves to. A loopback address there,
  with the coordinator on another host, fails only minutes later, after gloo's connect
  retries: refused now, in one line."""
  from jax._src import distributed as jax_distributed
  address = jax_distributed.global_state.coordinator_address or ''
  coordinator = address.rsplit(':', 1)[0].strip('[]')
  name = socket.gethostname()
  try:
    resolved = socket.gethostbyname(name)
  except OSError:
    resolved = None
  try:
    remote = not ipaddress.ip_address(socket.gethostbyname(coordinator)).is_loopback
  except (OSError, ValueError):
    remote = True
  if remote and (resolved is None or ipaddress.ip_address(resolved).is_loopback):
    where = f'on {resolved}, what' if resolved else 'on what'
    raise ValueError(f'config.cluster.interface is unset, so JAX\'s gloo collectives would '
                     f'listen {where} host name {name!r} resolves to, which the other hosts '
                     f'cannot reach (the coordinator is {address}): set it to the network '
                     'interface the hosts share')


class Heartbeats:
  """This process's heartbeat in jax.distributed's key-value store, and what it knows of the
  others' (see the module's doc). Two daemon threads: one counts up this process's key every
  `interval_s`; on a follower the other stops the process, with one line on stderr, once no
  count has gone through for `timeout_s` (process 0, or this host's network, is gone)."""

  def __init__(self, client, index: int, count: int, timeout_s: float):
    self.index, self.timeout_s = index, timeout_s
    self.interval_s = max(0.2, min(1.0, timeout_s / 10))
    self._client = client
    now = time.monotonic()
    self._written = now
    self._seen = {i: ('', now) for i in range(count) if i != index}  # count, when it moved
    self._stop = threading.Event()
    threading.Thread(target=self._beat, name='heartbeat', daemon=True).start()
    if index:
      threading.Thread(target=self._watch_leader, name='heartbeat-watch', daemon=True).start()

  def _beat(self) -> None:
    while not self._stop.wait(self.interval_s):
      try:
        self._client.key_value_increment(f'{_ALIVE_KEY}{self.index}', 1)
        self._written = time.monotonic()
      except Exception:  # process 0 unreachable: `_watch_leader` decides
        pass

  def _watch_leader(self) -> None:
    while not self._stop.wait(self.interval_s):
      silent = time.monotonic() - self._written
      if silent > self.timeout_s and not self._stop.is_set():
        print(f'{describe(self.index)}: stopping: {describe(0)} unreachable for {silent:.1f} s '
              f'(train.distributed.heartbeat_timeout_s={self.timeout_s:g})',
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

  def lost(self) -> dict[int, float]:
    """Process 0: {index: seconds silent} of the processes silent for longer than the timeout."""
    now = time.monotonic()
    counts = dict(self._client.key_value_dir_get(_ALIVE_KEY))
    out = {}
    for i, (seen, since) in list(self._seen.items()):
      count = counts.get(f'{_ALIVE_KEY}{i}', '')
      if count != seen:
        self._seen[i] = (count, now)
      elif now - since > self.timeout_s:
        out[i] = now - since
    return out

  def stop(self) -> None:
    self._stop.set()


def lost_processes() -> dict[int, float]:
  """{index: seconds silent} of the trainer processes lost (process 0's view; see Heartbeats)."""
  return _heartbeats.lost() if _heartbeats is not None else {}


def heartbeat_interval_s() -> float:
  return _heartbeats.interval_s if _heartbeats is not None else 1.0


def stop_heartbeats() -> None:
  """Before this process leaves on purpose (the run is over): silence is no longer a loss."""
  if _heartbeats is not None:
    _heartbeats.stop()


def coordination_client():
  """jax.distributed's client of the coordination service on process 0: a key-value store every
  process reaches, for small messages between processes (orbax keeps its barriers there)."""
  from orbax.checkpoint import multihost  # orbax's public handle on JAX's client
  return multihost.get_jax_distributed_client()


def _register_host() -> None:
  """Every process's host and pid, kept by every process: a failure report can name a peer
  after it is gone."""
  client, me = coordination_client(), jax.process_index()
  client.key_value_set(f'{_HOST_KEY}{me}', f'host {socket.gethostname()}, pid {os.getpid()}')
  timeout_ms = 60_000
  for i in range(jax.process_count()):
    _hosts[i] = client.blocking_key_value_get(f'{_HOST_KEY}{i}', timeout_ms)


def several_processes() -> bool:
  """This process is one of several trainer processes (without starting JAX's backend)."""
  return jax.distributed.is_initialized() and jax.process_count() > 1


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_primary() -> bool:
  """Process 0 runs the pipeline (actor, stream, metrics); the others follow its steps."""
  return jax.process_index() == 0


def describe(index: int | None = None) -> str:
  """'trainer process 1 of 2 (host NAME, pid N)': what a message about a process names."""
  index = jax.process_index() if index is None else index
  where = _hosts.get(index, f'host {socket.gethostname()}, pid {os.getpid()}'
                     if index == jax.process_index() else 'host unknown')
  return f'trainer process {index} of {jax.process_count()} ({where})'


class TrainerProcessError(RuntimeError):
  """A trainer process failed or is gone; the message names it and its host."""


def say_last_words(error: BaseException) -> None:
  """This process's failure, for the others (a barrier, process 0's report), before it ends."""
  if several_processes():
    coordination_client().key_value_set(f'{_LAST_WORDS_KEY}{jax.process_index()}',
                                        _first_line(error), allow_overwrite=True)


def last_words() -> dict[int, str]:
  """{index: one line} of the processes that said their last words (`say_last_words`)."""
  return {int(k.rsplit('/', 1)[1]): v
          for k, v in coordination_client().key_value_dir_get(_LAST_WORDS_KEY)}


def check_peers() -> None:
  """Raises TrainerProcessError naming another process that failed (its last words) or, on
  process 0, that is lost (its heartbeat stood still)."""
  me = jax.process_index()
  failed = {i: words for i, words in last_words().items() if i != me}
  if failed:
    raise TrainerProcessError('; '.join(f'{describe(i)} failed: {words}'
                                        for i, words in sorted(failed.items())))
  lost = lost_processes()
  if lost:
    raise TrainerProcessError('; '.join(f'{describe(i)} {gone(s)}'
                                        for i, s in sorted(lost.items())))


def gone(silent_s: float | None = None) -> str:
  """Why a process is taken for gone: its heartbeat stood still `silent_s`, or (None) it did not
  answer process 0's stop flag."""
  if silent_s is None:
    return 'is gone (no answer: killed, or its host lost)'
  return f'is gone (silent for {silent_s:.1f} s: killed, hung, or its host cut off)'


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Returns once every process called barrier(name); raises TrainerProcessError when another
  process fails or is lost meanwhile (`check_peers`). In jax.distributed's key-value store, not
  on the devices: the first collective over a set of devices opens its connections, and gloo
  waits only 30 s for a peer there."""
  if not several_processes():
    return
  client = coordination_client()
  _barriers[name] = _barriers.get(name, 0) + 1  # the same name again: the next barrier
  arrived = f'pipelinerl/barrier/{name}/{_barriers[name]}/'
  client.key_value_set(f'{arrived}{jax.process_index()}', '')
  deadline = time.monotonic() + timeout_s
  while len(client.key_value_dir_get(arrived)) < jax.process_count():
    check_peers()
    if time.monotonic() > deadline:
      raise TimeoutError(f'trainer processes did not all reach {name!r} within {timeout_s:.0f}s')
    time.sleep(0.1)


def primary_first(fn: Callable[[], Any], name: str) -> Any:
  """fn() on process 0, then on the others (e.g. building a cache on a shared disk once)."""
  if not several_processes():
    return fn()
  if is_primary():
    out = fn()
    barrier(name)
    return out
  barrier(name)
  return fn()


def whole(tree: Any) -> Any:
  """Arrays sharded over the processes' devices -> whole arrays this process can read, on its
  first device of their mesh. A collective: every process calls it, in the same order. In one
  process, `tree` itself."""
  if jax.process_count() == 1:
    return tree
  global _gathered
  if not jax.tree.leaves(tree):
    return tree
  if not _gathered:  # the first gather, at start-up: processes may arrive minutes apart
    barrier('first gather')
    _gathered = True
  replicated = jax.tree.map(lambda x: NamedSharding(x.sharding.mesh, P()), tree)
  gathered = _gather(tree, replicated)
  return jax.tree.map(lambda x: x.addressable_data(0), gathered)


def whole_per_process(tree: Any, dtype) -> Any:
  """Arrays sharded over the processes' devices -> on every process, one whole copy in `dtype`
  spread over that process's devices of the mesh (each leaf split along its first dimension
  their count divides, else replicated on them), as arrays this process alone holds. A
  collective: every process calls it, in the same order. The gather runs in XLA, device to
  device (NCCL between GPU hosts), and a copy costs each device 1/L of the model, where
  `whole` costs the whole model."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  dtype = np.dtype(dtype)
  devices = leaves[0].sharding.mesh.devices.flat
  by_process: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  counts = {len(ds) for ds in by_process.values()}
  if len(counts) != 1:
    raise ValueError('config.train.mesh: every trainer process must hold as many of the '
                     'mesh\'s devices as the others, to hold one whole copy of the params each '
                     f'(devices per process: { {p: len(ds) for p, ds in by_process.items()} })')
  grid = np.array([by_process[p] for p in sorted(by_process)])
  mesh = Mesh(grid, ('process', 'local'))

  def spec(x):
    dims = [None] * x.ndim
    split = next((i for i, n in enumerate(x.shape) if n % grid.shape[1] == 0), None)
    if split is not None:
      dims[split] = 'local'
    return P(*dims)

  specs = [spec(x) for x in leaves]
  copied = jax.jit(_cast, static_argnums=1,
                   out_shardings=[NamedSharding(mesh, s) for s in specs])(leaves, dtype)
  mine = Mesh(grid[jax.process_index()], ('local',))
  return jax.tree.unflatten(treedef, [
      jax.make_array_from_single_device_arrays(
          x.shape, NamedSharding(mine, s), [shard.data for shard in x.addressable_shards])
      for x, s in zip(copied, specs)])


def _cast(leaves, dtype):  # module level: jit's cache is keyed by the function
  # A copy even where the dtype and sharding stay: jit would hand back an input passed through,
  # and the caller's train step donates its params.
  return [jnp.copy(x).astype(dtype) for x in leaves]


def _gather(tree, shardings):
  return jax.jit(_identity, out_shardings=shardings)(tree)


def _identity(x):
  return x


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f'{type(e).__name__}: {lines[0] if lines else ""}'[:300]


# --- N processes on this machine ---------------------------------------------------------------


def free_port(host: str = '127.0.0.1') -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class LocalProcesses:
  """`num_processes` trainer processes on this host, as a multi-host run has one per host:
  process i runs `argv_for(i, coordinator_address)`, sees `devices_per_process` CPU devices
  (XLA_FLAGS), and writes its output to `log_dir`/process-<i>.log. Leaving the `with` block
  kills any still running.

      with LocalProcesses(argv_for, 2, 2, log_dir) as procs:
        codes = procs.wait(timeout_s=300)
  """

  def __init__(self, argv_for: Callable[[int, str], Sequence[str]], num_processes: int,
               devices_per_process: int, log_dir: str, env: dict[str, str] | None = None,
               cwd: str | None = None):
    self.address = f'127.0.0.1:{free_port()}'
    self.log_dir = log_dir
    os.makedirs(log_dir, exist_ok=True)
    base = {**os.environ, **(env or {})}
    flags = [f for f in base.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    base['XLA_FLAGS'] = ' '.join(flags + [
        f'--xla_force_host_platform_device_count={devices_per_process}'])
    base.setdefault('JAX_PLATFORMS', 'cpu')
    self.procs: list[subprocess.Popen] = []
    try:
      for i in range(num_processes):
        with open(self.log_path(i), 'w') as log:
          self.procs.append(subprocess.Popen(list(argv_for(i, self.address)), env=base,
                                             cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    except BaseException:
      self.close()  # none of them may outlive a failed start
      raise

  def log_path(self, index: int) -> str:
    return os.path.join(self.log_dir, f'process-{index}.log')

  def output(self, index: int) -> str:
    with open(self.log_path(index)) as f:
      return f.read()

  def wait(self, timeout_s: float) -> list[int | None]:
    """Exit codes (None: still running when the time was up)."""
    deadline = time.monotonic() + timeout_s
    for p in self.procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(max(0.0, deadline - time.monotonic()))
    return [p.poll() for p in self.procs]

  def close(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      p.wait()

  def __enter__(self) -> 'LocalProcesses':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

