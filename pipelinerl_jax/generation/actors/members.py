"""The pool's record of each generator actor (`Member`), and the calls that start, find and pin
one, and name its failures in one line.

An actor is created by `create` and found by `locate` (Ray answers `where` once the actor is
placed); on a node without GPUs for it, `pin` gives its process cores of its own (placement.
CoreAllocator) before anything heavy starts in it. A member's `info` is the answer of its
incarnation's `where`: a restarted actor answers as a new incarnation (restarts.py).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import ray
from ray import exceptions as ray_errors
from ray.util import scheduling_strategies

from pipelinerl_jax import cluster
from pipelinerl_jax.generation.actors import generator as generator_lib
from pipelinerl_jax.generation.actors import placement


class GeneratorDied(RuntimeError):
  """A generator actor is gone for good; the message names it, its node and the cause."""


@dataclasses.dataclass
class Member:
  """The pool's view of one actor."""
  index: int
  name: str
  handle: Any
  info: dict
  serving: bool = False          # has weights and takes new requests
  version: int = -1              # the newest version it has applied
  ack: int = 0                   # the last completion number received from this incarnation
  poll: Any = None               # ObjectRef of the poll in flight
  update: Any = None             # ObjectRef of the update in flight
  recover: Any = None            # ObjectRef of a `where` call after a failure
  outbox: list = dataclasses.field(default_factory=list)  # routed, not yet sent
  stats: dict = dataclasses.field(default_factory=dict)
  restarts: int = 0
  comm: Any = None               # collective transports: the trainer's end of its group
  send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  @property
  def incarnation(self) -> str:
    return self.info['incarnation']

  def where(self, timeout: float = 60) -> dict:
    """Where the actor runs now (its incarnation's `where`)."""
    return ray.get(self.handle.where.remote(), timeout=timeout)


def node_with_address(ip: str, key: str = 'config.generation.remote.node_ip') -> dict:
  """The live Ray node whose address is `ip` (`ray.nodes()`'s record); a one-line ValueError
  naming `key` and the nodes there are when none is."""
  alive = [n for n in ray.nodes() if n.get('Alive')]
  for n in alive:
    if n.get('NodeManagerAddress') == ip:
      return n
  raise ValueError(f'{key}={ip!r}: no live node of the Ray cluster has that address (nodes: '
                   f'{", ".join(sorted(n.get("NodeManagerAddress", "?") for n in alive))})')


def create(spec: generator_lib.GeneratorSpec, num_generators: int, *, cpus: int, gpus: int,
           max_restarts: int, node_ip: str = '') -> list[Member]:
  """Creates the actors (Ray places them later: `locate`), all on the node with address
  `node_ip` if given; raises a one-line ValueError when the cluster (or that node) has too few
  CPUs or GPUs for them."""
  strategy, have, where = None, ray.cluster_resources(), 'the Ray cluster'
  if node_ip:
    node = node_with_address(node_ip)
    strategy = scheduling_strategies.NodeAffinitySchedulingStrategy(node['NodeID'], soft=False)
    have, where = node.get('Resources', {}), f'node {node_ip} (generation.remote.node_ip)'
  for kind, each, key in (('CPU', cpus, 'cpus_per_generator'),
                          ('GPU', gpus, 'gpus_per_generator')):
    if each * num_generators > have.get(kind, 0):
      raise ValueError(f'config.generation.num_generators: {num_generators} generators x '
                       f'generation.remote.{key}={each} need {each * num_generators} {kind}s; '
                       f'{where} has {have.get(kind, 0):g}')
  actor_cls = ray.remote(concurrency_groups=generator_lib.CONCURRENCY_GROUPS)(
      generator_lib.Generator)
  members = []
  try:
    for i in range(num_generators):
      name = f'generator-{i}'
      handle = actor_cls.options(name=name, num_cpus=cpus, num_gpus=gpus,
                                 max_restarts=max_restarts, max_task_retries=0,
                                 scheduling_strategy=strategy).remote(spec, name)
      members.append(Member(i, name, handle, info={}))
  except BaseException:
    for m in members:
      ray.kill(m.handle, no_restart=True)
    raise
  return members


def locate(m: Member, timeout: float) -> None:
  """Waits until Ray has placed the actor, and records where."""
  try:
    m.info = m.where(timeout)
  except ray_errors.GetTimeoutError:
    raise TimeoutError(f'generator actor {m.name} was not placed within {timeout:.0f}s '
                       '(see `ray status`)') from None


def pin(m: Member, cores: placement.CoreAllocator, n: int) -> None:
  """Gives the actor's process `n` cores of its own on its node, and checks that every thread
  of it runs there."""
  taken = cores.take(m.info['node_id'], m.info['cores'], n)
  seen = ray.get(m.handle.pin.remote(taken), timeout=60)
  wrong = {tid: cpus for tid, cpus in seen.items() if cluster.cpu_list(cpus) != list(taken)}
  if wrong:
    raise RuntimeError(f'{m.name}: threads {sorted(wrong)[:5]} are not pinned to cores '
                       f'{",".join(map(str, taken))}')
  m.info['cores'] = list(taken)


def incarnation_changed(m: Member) -> bool:
  """Whether the actor answers as another incarnation within a few seconds (False when it does
  not answer: stopped, or still restarting)."""
  try:
    info = m.where(timeout=5)
  except (ray_errors.GetTimeoutError, ray_errors.RayActorError):
    return False
  return info['incarnation'] != m.incarnation


def death_cause(error: BaseException) -> str:
  """The line of a Ray actor error that says why the actor died."""
  text = getattr(error, 'error_msg', None) or str(error)
  for line in text.splitlines():
    if 'The actor is dead because' in line or 'is unavailable' in line:
      line = line.split(' Some common causes', 1)[0]
      return line.split('The actor is dead because ', 1)[-1].strip()
  return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def failed(m: Member, error: ray_errors.RayTaskError) -> RuntimeError:
  """The error, in one line, of a call the actor raised in (a bug or a refused update)."""
  cause = error.cause if getattr(error, 'cause', None) is not None else error
  return RuntimeError(f'generator actor {m.name} (node {m.info.get("node_ip")}): '
                      f'{type(cause).__name__}: {str(cause).splitlines()[0]}')
