"""One trainer in several processes (one per host): joining them with `jax.distributed`, who is
who, and starting N of them on one machine (tests, trying a multi-host config locally).

A multi-host JAX trainer is one SPMD program: every process runs the same jitted steps on one
mesh over all hosts' devices, each feeding and holding the shards on its own devices.
`initialize` joins this process to the others; it must run before any JAX computation (JAX
cannot join once its backend has started). With train.num_processes == 1 it does nothing, and
everything here answers for a single process.

Cross-process collectives on CPU use gloo (XLA's CPU client has none by default); on GPUs XLA
uses NCCL whatever that setting says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from pipelinerl_jax import config as config_lib

_HOST_KEY = 'pipelinerl/process/'
_hosts: dict[int, str] = {}   # process index -> 'host NAME, pid N', filled by `initialize`
# How long a process waits at a barrier for the others: process 0 may be building the demo model
# or loading a large dataset meanwhile.
BARRIER_TIMEOUT_S = 3600
_gathered = False             # whole() ran once in this process


def initialize(config: config_lib.TrainConfig, coordinator_address: str | None = None,
               process_id: int | None = None) -> None:
  """Joins the trainer's other processes (train.num_processes != 1), once per process.
  `coordinator_address` and `process_id` replace train.distributed's: what the driver hands out
  to the trainer processes it starts as Ray actors (pipeline/trainer_actors.py)."""
  if config.num_processes == 1 or jax.distributed.is_initialized():
    return
  if coordinator_address is not None:
    config = dataclasses.replace(config, distributed=dataclasses.replace(
        config.distributed, coordinator_address=coordinator_address, process_id=process_id))
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # JAX's preemption service would take SIGTERM for itself (a notice that every process must
  # poll at the same training steps); here a stop request goes to process 0, which decides.
  jax.config.update('jax_enable_preemption_service', False)
  d = config.distributed
  try:
    jax.distributed.initialize(
        coordinator_address=d.coordinator_address or None,
        num_processes=config.num_processes or None,
        process_id=d.process_id if d.process_id >= 0 else None,
        initialization_timeout=d.initialization_timeout_s,
        heartbeat_timeout_seconds=d.heartbeat_timeout_s)
  except (ValueError, TypeError, RuntimeError) as e:
    # e.g. no address given and no scheduler to read it from, or a peer that never came
    raise ValueError(f'config.train.distributed: cannot join the other trainer processes '
                     f'({_first_line(e)})') from None
  _register_host()


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


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Returns once every process called barrier(name). In jax.distributed's key-value store, not
  on the devices: the first collective over a set of devices opens its connections, and gloo
  waits only 30 s for a peer there."""
  if several_processes():
    coordination_client().wait_at_barrier(f'pipelinerl/{name}', int(timeout_s * 1000))


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


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
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

