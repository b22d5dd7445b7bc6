"""Trainer processes 1..N-1 as Ray actors (train.num_processes = N with generation.placement
'ray'); the driver, the `main` command, is trainer process 0.

  launch(config, w, follow) places the N-1 actors, starts each as trainer process k (it joins
                            with jax.distributed and runs `follow`, which follows process 0:
                            launch.follow_as_actor), and joins them as process 0. Leaving its
                            `with` block ends them.
  Launch.publication(p, v, d)
                            version v of the params from every process, for the generator pool.
                            Object store: each process puts the pieces it holds into Ray's
                            object store (transport/shards.py), and the generators assemble
                            them. A collective (gloo, nccl): every process gathers a whole copy
                            in dtype d onto its own devices (distributed.whole_per_process), and
                            process 0 broadcasts its copy to the generators
  Launch.check()            each round of the run's watch (multiprocess.Followers.watch): a
                            trainer actor that died (killed, its node lost) ends the run at once,
                            with one line naming the process and its host
  TrainerProcess            the actor; its `Stash` keeps its pieces of the latest version until
                            process 0 takes them

Why the driver is process 0 and not only a launcher: process 0 runs the pipeline (actor loop,
sample stream, metrics, the checkpoints' meta, the generator pool), and as the driver it keeps
all that a single-process run has in the terminal: the output, Ctrl-C and SIGTERM (main's
handlers), the exit status, the workdir lock. A launcher would relay each of them to an actor
and back. Ray ends every actor of a driver that dies, trainer processes and generators alike, so
losing process 0 leaves nothing behind either. The cost: the driver's host is a trainer host (on
GPUs, `ray start --head --num-gpus=0` there, so that no generator lands on its GPUs;
docs/scaling.md).

Why the trainer processes are Ray actors, not started by a scheduler, when the generators are:
ObjectRefs that Ray workers pass to each other are reference-counted, and a piece is freed once
every generator has it; a process outside Ray can only hand a reference over out of band, which
pins the object for that process's lifetime, one model's share per update. Under SLURM, start a
Ray cluster in the allocation (tools/slurm_multihost.sh).

Placement: one actor per node other than the driver's while the cluster has such nodes, each
reserving train.distributed.cpus_per_process CPUs and gpus_per_process GPUs; on a cluster of one
node (a CPU machine), beside the driver, each pinned to cores of its own. Every actor gets the
driver's XLA_* and JAX_* variables (e.g. the CPU device count), so that each process sees
devices alike.

This module imports Ray and the standard library only at the top: an actor pins its cores
before JAX starts its thread pools.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import threading
import time
from typing import Any, Callable, Sequence

import ray
from ray import exceptions as ray_errors
from ray.util import scheduling_strategies

from pipelinerl_jax import cluster as cluster_lib
from pipelinerl_jax import config as config_lib

CONCURRENCY_GROUPS = {'run': 1, 'control': 1}
START_TIMEOUT_S = 600.0    # for an actor to be placed and to answer
FINISH_TIMEOUT_S = 60.0    # for the actors to return once the run is over
ENV_PREFIXES = ('XLA_', 'JAX_')


def gpus_here() -> int:
  """The GPUs this host shows the driver, without starting JAX (it must join the others
  first): CUDA_VISIBLE_DEVICES's entries if it is set, else the /dev/nvidiaN devices."""
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  if visible is not None:
    return len([s for s in visible.split(',') if s.strip()])
  return len(glob.glob('/dev/nvidia[0-9]*'))


def choose_nodes(nodes: Sequence[dict], driver_node: str, count: int, cpus: int,
                 gpus: int) -> list[str]:
  """Node ids for trainer processes 1..count (`nodes`: `ray.nodes()`): one on each of the first
  `count` nodes other than the driver's with `cpus` CPUs and `gpus` GPUs; on a cluster of one
  node, all beside the driver. Raises a one-line ValueError when neither fits."""
  alive = [n for n in nodes if n.get('Alive')]

  def fits(node, k):
    have = node.get('Resources', {})
    return have.get('CPU', 0) >= k * cpus and have.get('GPU', 0) >= k * gpus

  others = sorted((n for n in alive if n['NodeID'] != driver_node and fits(n, 1)),
                  key=lambda n: (n.get('NodeManagerAddress', ''), n['NodeID']))
  if len(others) >= count:
    return [n['NodeID'] for n in others[:count]]
  if len(alive) == 1 and alive[0]['NodeID'] == driver_node and fits(alive[0], count):
    return [driver_node] * count
  want = f'{cpus} CPUs' + (f' and {gpus} GPUs' if gpus else '')
  raise ValueError(f'config.train.num_processes: {count} trainer processes besides this one need '
                   f'{count} other nodes with {want} each (train.distributed.cpus_per_process, '
                   f'gpus_per_process); the Ray cluster has {len(others)} ({len(alive)} nodes '
                   'in all; see `ray status`)')


class Stash:
  """A trainer actor's pieces of the latest published version, in Ray's object store, until
  process 0 takes them (`TrainerProcess.pieces`)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._latest: tuple[int, Any] | None = None

  def publish(self, params, version: int) -> None:
    """Called by the follower's loop (multiprocess.follow) when process 0 publishes: a copy of
    this process's pieces goes into the object store now, before the next step donates them."""
    from pipelinerl_jax.generation.transport import shards
    ref = ray.put(shards.local_pieces(params))
    with self._cond:
      self._latest = (version, ref)
      self._cond.notify_all()

  def take(self, version: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while self._latest is None or self._latest[0] < version:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f'no pieces of version {version} published within {timeout_s:.0f}s')
        self._cond.wait(left)
      got, ref = self._latest
    if got != version:
      raise ValueError(f'pieces of version {version} asked for, version {got} published')
    return [ref]  # inside a list: Ray passes the reference on (counted), not its value


class TrainerProcess:
  """Trainer process `index` of a run, as a Ray actor (`ray.remote(TrainerProcess)`)."""

  def __init__(self, index: int):
    self.index = index
    self.stash = Stash()

  @ray.method(concurrency_group='control')
  def where(self, interface: str = '') -> dict[str, Any]:
    """Where this actor runs; `network_error`: why config.cluster.interface (`interface`) is
    not usable on its host (one line), before it joins the others."""
    ctx = ray.get_runtime_context()
    network_error = None
    if interface:
      try:
        cluster_lib.interface_address(interface)
      except ValueError as e:
        network_error = str(e)
    return dict(index=self.index, pid=os.getpid(), host=socket.gethostname(),
                node_id=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                cores=sorted(os.sched_getaffinity(0)), gpus=[str(g) for g in ray.get_gpu_ids()],
                network_error=network_error)

  @ray.method(concurrency_group='control')
  def pin(self, cores: Sequence[int]) -> list[int]:
    cluster_lib.pin_threads(cores)
    return sorted(os.sched_getaffinity(0))

  @ray.method(concurrency_group='run')
  def run(self, config: config_lib.Config, workdir: str, address: str,
          follow: Callable[[config_lib.Config, str, Stash], dict[str, Any]]) -> dict[str, Any]:
    """Joins the others as process `index`, then `follow` (launch.follow_as_actor, handed in
    by the driver: it follows process 0 until it ends the run)."""
    import jax
    from pipelinerl_jax import distributed
    distributed.initialize(config.train, coordinator_address=address, process_id=self.index,
                           interface=config.cluster.interface,
                           host_address=ray.util.get_node_ip_address())
    summary = follow(config, workdir, self.stash)
    jax.distributed.shutdown()  # meets process 0's (Launch.close)
    return dict(steps=summary['steps'], interrupted=summary['interrupted'])

  @ray.method(concurrency_group='control')
  def pieces(self, version: int, timeout_s: float) -> list[Any]:
    return self.stash.take(version, timeout_s)


@dataclasses.dataclass
class Launch:
  """Process 0's side of the trainer actors (processes 1..N-1, in order)."""
  session: cluster_lib.Session
  actors: list[Any]
  infos: list[dict]
  address: str                         # jax.distributed's coordinator: process 0
  cores: Any                           # placement.CoreAllocator, shared with the generators
  timeout_s: float                     # for an actor's pieces of one version
  transport: str                       # generation.remote.weight_transport
  runs: list[Any] = dataclasses.field(default_factory=list)
  _digest: str | None = None

  def publication(self, params, version: int, wire_dtype: str):
    """Version `version` of `params` for the generator pool. Object store: a shards.Published,
    this process's pieces put into the object store, and each actor's, which it put when its
    loop was told to publish; raises TrainerProcessError naming an actor that is gone. A
    collective: the whole params in `wire_dtype` on this process's devices, gathered with the
    followers (their loop makes the same call), which the pool broadcasts."""
    from pipelinerl_jax import distributed
    from pipelinerl_jax.generation.transport import layout
    from pipelinerl_jax.generation.transport import shards
    if self.transport != 'object_store':
      return distributed.whole_per_process(params, wire_dtype)
    own = ray.put(shards.local_pieces(params))
    theirs = [actor.pieces.remote(version, self.timeout_s) for actor in self.actors]
    refs = [own]
    for i, ref in enumerate(theirs):
      try:
        refs += ray.get(ref, timeout=self.timeout_s + 10)
      except (ray_errors.RayActorError, ray_errors.RayTaskError, ray_errors.GetTimeoutError) as e:
        raise _error(f'{_describe(i + 1)}: its pieces of version {version}: {_cause(e)}') from None
    if self._digest is None:
      self._digest = layout.tree_digest(params)
    return shards.Published(tuple(refs), self._digest)

  def check(self) -> None:
    """Raises TrainerProcessError when an actor's run has ended (killed, its node lost) while
    the run goes on (multiprocess.Followers.watch calls it)."""
    index = {ref: i + 1 for i, ref in enumerate(self.runs)}
    ready, _ = ray.wait(list(index), num_returns=1, timeout=0)
    if ready:
      try:
        ray.get(ready[0])
        cause = 'returned while the run went on'
      except (ray_errors.RayActorError, ray_errors.RayTaskError) as e:
        cause = _cause(e)
      raise _error(f'{_describe(index[ready[0]])} ended: {cause}')

  def close(self, clean: bool) -> None:
    """Ends the actors and a local Ray. `clean` (the run ended, its followers told to stop):
    leaves jax.distributed with them first, which they wait for before returning."""
    try:
      if clean and self.runs:
        import jax
        jax.distributed.shutdown()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=FINISH_TIMEOUT_S)
    finally:
      for actor in self.actors:
        try:
          ray.kill(actor, no_restart=True)
        except Exception:  # already gone
          pass
      self.session.close()

  def __enter__(self) -> 'Launch':
    return self

  def __exit__(self, kind, error, traceback) -> None:
    self.close(clean=error is None)


def launch(config: config_lib.Config, workdir: str,
           follow: Callable[[config_lib.Config, str, Stash], dict[str, Any]]) -> Launch:
  """Connects to Ray (config.cluster), places and starts trainer processes 1..N-1, each running
  `follow` once joined, then joins them as process 0 (jax.distributed: before this process
  starts JAX's backend)."""
  from pipelinerl_jax import distributed
  from pipelinerl_jax.generation.actors import placement
  d, count = config.train.distributed, config.train.num_processes - 1
  gpus = gpus_here() if d.gpus_per_process < 0 else d.gpus_per_process
  session = cluster_lib.connect(config.cluster)
  launched = None
  try:
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = ray.nodes()
    _check_gpus(config, session, nodes, driver_node, gpus)
    chosen = choose_nodes(nodes, driver_node, count, d.cpus_per_process, gpus)
    _check_room_for_generators(config, count, d.cpus_per_process, gpus)
    actor_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(TrainerProcess)
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    actors = [actor_cls.options(
        name=f'trainer-process-{k}', num_cpus=d.cpus_per_process, num_gpus=gpus, max_restarts=0,
        runtime_env={'env_vars': env} if env else None,
        scheduling_strategy=scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(k) for k, node in enumerate(chosen, start=1)]
    launched = Launch(session=session, actors=actors, infos=[], address='',
                      cores=placement.CoreAllocator(),
                      timeout_s=config.generation.remote.transport_timeout_s,
                      transport=config.generation.remote.weight_transport)
    for k, actor in enumerate(actors, start=1):
      try:
        info = ray.get(actor.where.remote(config.cluster.interface), timeout=START_TIMEOUT_S)
      except ray_errors.GetTimeoutError:
        raise TimeoutError(f'trainer process {k} was not placed within {START_TIMEOUT_S:.0f}s '
                           '(see `ray status`)') from None
      except ray_errors.RayActorError as e:  # e.g. its node died meanwhile
        raise _error(f'trainer process {k} of {count + 1} did not start: {_cause(e)}') from None
      if info['network_error']:  # before the processes join: they would wait for this one
        raise ValueError(info['network_error'])
      if not gpus:  # cores of its own, before its JAX starts
        cores = launched.cores.take(info['node_id'], info['cores'], d.cpus_per_process)
        info['cores'] = ray.get(actor.pin.remote(cores), timeout=60)
      launched.infos.append(info)
    # The coordinator listens on the address the other hosts reach this one by.
    interface = config.cluster.interface
    host = cluster_lib.interface_address(interface) if interface else session.node_ip
    launched.address = f'{host}:{d.coordinator_port or distributed.free_port(host)}'
    launched.runs = [a.run.remote(config, workdir, launched.address, follow) for a in actors]
    distributed.initialize(config.train, coordinator_address=launched.address, process_id=0,
                           interface=interface, host_address=session.node_ip)
    return launched
  except BaseException:
    if launched is not None:
      launched.close(clean=False)
    else:
      session.close()
    raise


def _check_gpus(config: config_lib.Config, session, nodes, driver_node: str, gpus: int) -> None:
  """Trainer processes on GPUs: one host each, and none of process 0's GPUs given to Ray."""
  if not gpus:
    return
  if session.local:
    raise ValueError('config.train.num_processes: several trainer processes on one GPU host '
                     '(a local Ray start) are not supported: run one trainer process per host on '
                     'a Ray cluster (cluster.address; docs/scaling.md: several hosts)')
  offered = next((n.get('Resources', {}).get('GPU', 0) for n in nodes
                  if n['NodeID'] == driver_node), 0)
  if offered:
    raise ValueError(f'config.cluster.address: this host trains (process 0) and also offers '
                     f'{offered:g} GPUs to Ray actors; start Ray here with `ray start ... '
                     '--num-gpus=0`, so that no generator lands on the trainer\'s GPUs')


def _check_room_for_generators(config: config_lib.Config, count: int, cpus: int,
                               gpus: int) -> None:
  g, remote = config.generation, config.generation.remote
  have = ray.cluster_resources()
  need_gpus = remote.gpus_per_generator if remote.gpus_per_generator >= 0 else (
      1 if have.get('GPU', 0) > 0 else 0)
  for kind, each, trainer_each, key in (
      ('CPU', remote.cpus_per_generator, cpus, 'cpus_per_generator'),
      ('GPU', need_gpus, gpus, 'gpus_per_generator')):
    left = have.get(kind, 0) - count * trainer_each
    if each * g.num_generators > left:
      raise ValueError(f'config.generation.num_generators: {g.num_generators} generators x '
                       f'generation.remote.{key}={each} need {each * g.num_generators} {kind}s; '
                       f'the Ray cluster has {left:g} left after {count} trainer processes '
                       f'(train.distributed.{kind.lower()}s_per_process={trainer_each})')


def _describe(index: int) -> str:
  from pipelinerl_jax import distributed
  return distributed.describe(index)


def _cause(e: BaseException) -> str:
  if isinstance(e, ray_errors.RayTaskError) and getattr(e, 'cause', None) is not None:
    e = e.cause
  text = getattr(e, 'error_msg', None) or str(e)
  for line in text.splitlines():
    if 'The actor is dead because' in line:
      return line.split('The actor is dead because ', 1)[1].split(' Some common causes')[0].strip()
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return f'{type(e).__name__}: {lines[-1] if lines else ""}'[:300]


def _error(message: str) -> Exception:
  from pipelinerl_jax.pipeline import supervise
  return supervise.TrainerProcessError(message)
