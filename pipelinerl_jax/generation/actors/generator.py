"""One generator actor as Ray sees it: the calls the pool (pool.py) makes, where the actor runs,
and weights in over three transports; the engine itself, its thread and its outbox are in
decode_loop.py, free of Ray.

  pin(cores)           the process's threads to its cores (CPU nodes), before any engine starts
  heartbeat()          the pool is there: from the first one on, an actor that hears none for
                       spec.heartbeat_timeout_s stops itself (its host cut off from the driver's:
                       Ray leaves such an actor running)
  update(tree, v, d)   weights through Ray's object store: `tree` arrives as read-only numpy views
                       of the one shared copy; checked against its digest `d`, then handed whole
                       to the engine, which applies it between two token steps; with
                       spec.verify_updates, what the engine was handed is checked against the
                       trainer's checksum of what it published (every transport)
  update_shards(...)   the same from several trainer processes, each with its pieces
  join / receive(v)    the same over a collective (gloo on CPU, NCCL on GPUs; transport/collective):
                       one receiver thread and one staging buffer for the actor's life
  submit(requests)     into the engine's queue
  release(ids)         finished turns whose episodes ended: the engine frees what it kept
  poll(ack, wait_s)    completions finished since the last acknowledged one, and the stats

The engine is built by the first update (so a restarted actor starts from the latest weights the
pool sends it, never from stale ones); requests submitted before wait in the loop. Completions
carry a sequence number and stay in the outbox until the pool acknowledges them (`ack`): a poll
reply lost in transit is sent again, so none is lost; the pool's routing drops duplicates.

JAX or vLLM, and their thread pools, are imported only when the engine is built: after `pin`.
Methods run in Ray's threads, one per concurrency group.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import uuid
from typing import Any, Sequence

import ray

from pipelinerl_jax import cluster
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.generation.actors import decode_loop
from pipelinerl_jax.generation.transport import layout

# A thread per group: a weight transfer never blocks polling or submitting, and nothing (a
# submit waiting for the engine to be built) holds up a heartbeat.
CONCURRENCY_GROUPS = {'io': 1, 'control': 1, 'weights': 1, 'heartbeat': 1}


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
  """Everything an actor needs (picklable, no JAX objects): its engine, and how weights reach it."""
  engine: engines.EngineSpec
  model_dir: str                   # config.json (and, for vLLM, the checkpoint) on every node
  model_overrides: dict            # hf_schema.load_config kwargs: the trainer's dtypes
  transport: str = 'object_store'  # 'object_store' | 'gloo' | 'nccl'
  transport_timeout_s: float = 120.0
  bucket_mb: int = 256             # collective transports
  wire_dtype: str = 'float32'      # collective transports: budget.wire_dtype
  interface: str = ''              # gloo listens on its address (config.cluster.interface);
                                   # '' = on the Ray node's address
  heartbeat_timeout_s: float = 60.0  # no heartbeat from the pool this long: the actor stops
  verify_updates: bool = False     # config.generation.remote.verify_updates


class Generator:
  """The actor's state. Plain Python: `ray.remote(Generator)` makes the actor (see members.py)."""

  def __init__(self, spec: GeneratorSpec, name: str):
    self.spec, self.name = spec, name
    self.incarnation = uuid.uuid4().hex[:12]  # a restarted actor is a new incarnation
    self._model_config = None
    self._loop = decode_loop.DecodeLoop(name, spec.engine, spec.model_dir, model=self._model,
                                        staged_updates=spec.transport != 'object_store',
                                        checksums=spec.verify_updates)
    self._verified = 0  # updates whose params matched the trainer's checksum
    self._comm = None
    self._receiver = None
    self._cores: tuple[int, ...] = ()
    self._heard: float | None = None  # the pool's last heartbeat (time.monotonic)

  # --- placement -------------------------------------------------------------------------------

  @ray.method(concurrency_group='control')
  def where(self) -> dict[str, Any]:
    """Where this actor runs (for the pool, its errors and the metrics)."""
    ctx = ray.get_runtime_context()
    return dict(name=self.name, incarnation=self.incarnation, pid=os.getpid(),
                node_id=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                host=socket.gethostname(), cores=sorted(os.sched_getaffinity(0)),
                gpus=[str(g) for g in ray.get_gpu_ids()],
                reconstructed=ctx.was_current_actor_reconstructed)

  @ray.method(concurrency_group='control')
  def pin(self, cores: Sequence[int]) -> dict[int, str]:
    """Pins every thread of this process to `cores` (threads started later inherit it) and
    sizes the thread pools that read their size from the environment. Called before the engine
    exists, so JAX (XLA) and torch size their pools from these cores. Returns
    `cluster.thread_affinity()`, which the kernel reports."""
    if self._loop.started:
      raise RuntimeError(f'{self.name}: pin() after the engine started has no effect on its pools')
    cores = tuple(sorted(int(c) for c in cores))
    cluster.pin_threads(cores)
    self._cores = cores
    return cluster.thread_affinity()

  @ray.method(concurrency_group='control')
  def affinity(self) -> dict[int, str]:
    return cluster.thread_affinity()

  @ray.method(concurrency_group='heartbeat')
  def heartbeat(self) -> None:
    if self._heard is None:
      threading.Thread(target=self._watch_pool, name='heartbeat-watch', daemon=True).start()
    self._heard = time.monotonic()

  def _watch_pool(self) -> None:
    timeout_s = self.spec.heartbeat_timeout_s
    while True:
      time.sleep(min(1.0, timeout_s / 10))
      silent = time.monotonic() - self._heard
      if silent > timeout_s:
        print(f'[{self.name}] stopping: no heartbeat from the run for {silent:.1f} s '
              f'(generation.remote.heartbeat_timeout_s={timeout_s:g}): its driver is gone or '
              'unreachable', flush=True)
        os._exit(1)

  # --- weights ---------------------------------------------------------------------------------

  def _model(self):
    if self._model_config is None:
      from pipelinerl_jax.models.hf import schema as hf_schema
      self._model_config = hf_schema.load_config(self.spec.model_dir, **self.spec.model_overrides)
    return self._model_config

  @ray.method(concurrency_group='weights')
  def update(self, tree, version: int, digest: str, incarnation: str,
             checksum: str = '') -> int | None:
    """Applies a params pytree of host arrays (Ray resolves the object-store reference to
    zero-copy numpy views) as `version`; refused whole when its layout is not this model's.
    An update meant for another incarnation (queued while this one restarted, before the pool
    pinned it) is ignored: None tells the pool. `checksum`: the trainer's, of what it published
    (spec.verify_updates)."""
    if incarnation != self.incarnation:
      return None
    got = layout.tree_digest(tree)
    want = layout.expected_digest(self._model(), self.spec.engine.lora)
    if digest != got or got != want:
      raise ValueError(f'{self.name}: weight update {version} refused: layout digest {got} '
                       f'(sent as {digest}) is not this model\'s {want}')
    self._verify(version, self._loop.apply(tree, version), checksum)
    return version

  def _verify(self, version: int, handed: str | None, published: str) -> None:
    """With spec.verify_updates: the params the engine was handed are the trainer's, bit for
    bit, or the actor raises (and the run stops, naming it)."""
    if not self.spec.verify_updates:
      return
    if handed != published:
      raise ValueError(f'{self.name}: weight update {version} arrived changed: the params its '
                       f'engine was handed have checksum {handed}, the trainer published '
                       f'{published or "none"} (generation.remote.verify_updates)')
    self._verified += 1

  @ray.method(concurrency_group='weights')
  def update_shards(self, refs: Sequence[Any], version: int, digest: str,
                    incarnation: str) -> int | None:
    """`update`, from several trainer processes: `refs[i]` holds process i's pieces of the params
    (transport/shards.py), which are assembled into whole leaves first; pieces that leave a gap
    or overlap refuse the update whole, as a wrong layout does."""
    if incarnation != self.incarnation:
      return None
    from pipelinerl_jax.generation.transport import shards
    return self.update(shards.assemble(ray.get(list(refs))), version, digest, incarnation)

  @ray.method(concurrency_group='weights')
  def join(self, endpoint) -> None:
    """Joins the trainer's two-rank group (rank 1) for a collective weight transport, and
    allocates the staging buffer for the actor's life (before the engine starts, whose memory
    budget then sees it)."""
    from pipelinerl_jax.generation.transport import collective
    from pipelinerl_jax.generation.transport import hf_tensors
    device = 'cuda:0' if endpoint.backend == 'nccl' else 'cpu'
    address = (cluster.interface_address(self.spec.interface) if self.spec.interface
               else ray.util.get_node_ip_address())
    comm = collective.join(endpoint, 1, self.spec.transport_timeout_s, device, address=address)
    try:
      model = self._model()
      plan = collective.make_plan(
          hf_tensors.update_shapes(model, self.spec.engine.lora),
          self.spec.wire_dtype, self.spec.bucket_mb << 20)
      self._receiver = collective.Receiver(comm, plan, device)
    except BaseException:
      collective.destroy(comm)
      raise
    self._comm = comm

  @ray.method(concurrency_group='weights')
  def receive(self, version: int, incarnation: str, checksum: str = '') -> int | None:
    """Receives the update the trainer is broadcasting into the staging buffer, then applies it
    whole. A receive that fails or passes its deadline leaves the group unusable: its
    communicator is destroyed, the process exits, and Ray restarts the actor (which joins a new
    group). None: meant for another incarnation, which had that group."""
    if incarnation != self.incarnation or self._comm is None:
      return None
    from pipelinerl_jax.generation.transport import collective
    try:
      got, views, release = self._receiver.receive(self.spec.transport_timeout_s)
      if got != version:
        raise ValueError(f'announced version {version}, received {got}')
    except BaseException as e:
      print(f'[{self.name}] weight transport failed, exiting for a restart: '
            f'{type(e).__name__}: {e}', flush=True)
      collective.destroy(self._comm)  # (the receiver has, for a failed transfer)
      os._exit(1)
    self._verify(version, self._loop.apply(None, version, hf_views=views, release=release),
                 checksum)
    return version

  # --- requests --------------------------------------------------------------------------------

  @ray.method(concurrency_group='control')
  def submit(self, requests: list[api.Request], incarnation: str) -> None:
    """Queues `requests`, which were meant for `incarnation`: a batch sent to an incarnation
    that died is dropped (the pool routes those requests again). Ids this incarnation already
    holds are skipped, so the pool may re-send what it is unsure arrived."""
    if incarnation == self.incarnation:
      self._loop.submit(requests)

  @ray.method(concurrency_group='control')
  def release(self, request_ids: list[str], incarnation: str) -> None:
    """`api.Engine.release` for each id (an engine keeps a continuable turn's KV until then);
    meant for another incarnation, or before the engine exists: nothing is held, nothing to do."""
    if incarnation == self.incarnation:
      self._loop.release(request_ids)

  @ray.method(concurrency_group='io')
  def poll(self, incarnation: str, ack: int, wait_s: float
           ) -> tuple[str, list[tuple[int, api.Completion]], dict]:
    """(incarnation, completions numbered after `ack`, stats); waits up to `wait_s` for a first
    one. Raises the decode loop's error, if it died. A poll meant for another incarnation
    returns at once with this one's name, which tells the pool of the restart."""
    if incarnation != self.incarnation:
      return self.incarnation, [], self._stats()
    items = self._loop.poll(ack, wait_s)
    return self.incarnation, items, self._stats()

  def _stats(self) -> dict[str, Any]:
    stats = self._loop.stats()
    stats.update(name=self.name, pid=os.getpid(), cores=list(self._cores))
    if self.spec.verify_updates:
      stats['updates_verified'] = self._verified
    return stats

  @ray.method(concurrency_group='control')
  def close(self) -> None:
    self._loop.close()
