"""What runs inside one generator actor: an engine (JAX or vLLM) on the actor's own devices,
decoding continuously in a thread, fed and drained by the pool (pool.py) through Ray calls.

  pin(cores)           the process's threads to its cores (CPU nodes), before any engine starts
  update(tree, v, d)   weights through Ray's object store: `tree` arrives as read-only numpy views
                       of the one shared copy; checked against its digest `d`, then handed whole
                       to the engine, which applies it between two token steps
  update_shards(...)   the same from several trainer processes, each with its pieces
  join / receive(v)    the same over a collective (gloo on CPU, NCCL on GPUs; transport/collective):
                       one receiver thread and one staging buffer for the actor's life
  submit(requests)     into the engine's queue
  release(ids)         finished turns whose episodes ended: the engine frees what it kept
  poll(ack, wait_s)    completions finished since the last acknowledged one, and the stats

The engine is built by the first update (so a restarted actor starts from the latest weights the
pool sends it, never from stale ones); requests submitted before wait in the actor. Completions
carry a sequence number and stay in the outbox until the pool acknowledges them (`ack`): a poll
reply lost in transit is sent again, so none is lost; the pool's routing drops duplicates.

The engine comes from the project's one factory (generation/engines.py), which imports JAX or
vLLM, and their thread pools, only when it builds the engine: after `pin`. Methods run in Ray's
threads, one per concurrency group, so a weight transfer never blocks polling or submitting.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import traceback
import uuid
from typing import Any, Sequence

import ray

from pipelinerl_jax import cluster
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.generation.transport import layout

CONCURRENCY_GROUPS = {'io': 1, 'control': 1, 'weights': 1}


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
  """Everything an actor needs (picklable, no JAX objects): its engine, and how weights reach it."""
  engine: engines.EngineSpec
  model_dir: str                   # config.json (and, for vLLM, the checkpoint) on every node
  model_overrides: dict            # hf_io.load_config kwargs: the trainer's dtypes
  transport: str = 'object_store'  # 'object_store' | 'gloo' | 'nccl'
  transport_timeout_s: float = 120.0
  bucket_mb: int = 256             # collective transports
  wire_dtype: str = 'float32'      # collective transports: budget.wire_dtype


class Generator:
  """The actor's state. Plain Python: `ray.remote(Generator)` makes the actor (see members.py)."""

  def __init__(self, spec: GeneratorSpec, name: str):
    self.spec, self.name = spec, name
    self.incarnation = uuid.uuid4().hex[:12]  # a restarted actor is a new incarnation
    self._engine: api.Engine | None = None
    self._model_config = None
    self._waiting: list[api.Request] = []     # submitted before the engine exists
    self._outbox: list[tuple[int, api.Completion]] = []
    self._ids: set[str] = set()               # submitted here, completion not yet acknowledged
    self._seq = 0
    self._cond = threading.Condition()
    self._error: str | None = None            # the decode loop's death
    self._closed = False
    self._thread: threading.Thread | None = None
    self._comm = None
    self._receiver = None
    self._cores: tuple[int, ...] = ()
    self._updates = 0
    self._update_s = 0.0

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
    if self._engine is not None:
      raise RuntimeError(f'{self.name}: pin() after the engine started has no effect on its pools')
    cores = tuple(sorted(int(c) for c in cores))
    cluster.pin_threads(cores)
    self._cores = cores
    return cluster.thread_affinity()

  @ray.method(concurrency_group='control')
  def affinity(self) -> dict[int, str]:
    return cluster.thread_affinity()

  # --- weights ---------------------------------------------------------------------------------

  def _model(self):
    if self._model_config is None:
      from pipelinerl_jax.models import hf_io
      self._model_config = hf_io.load_config(self.spec.model_dir, **self.spec.model_overrides)
    return self._model_config

  @ray.method(concurrency_group='weights')
  def update(self, tree, version: int, digest: str, incarnation: str) -> int | None:
    """Applies a params pytree of host arrays (Ray resolves the object-store reference to
    zero-copy numpy views) as `version`; refused whole when its layout is not this model's.
    An update meant for another incarnation (queued while this one restarted, before the pool
    pinned it) is ignored: None tells the pool."""
    if incarnation != self.incarnation:
      return None
    got, want = layout.tree_digest(tree), layout.expected_digest(self._model())
    if digest != got or got != want:
      raise ValueError(f'{self.name}: weight update {version} refused: layout digest {got} '
                       f'(sent as {digest}) is not this model\'s {want}')
    self._apply(tree, version, hf_views=None)
    return version

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
    comm = collective.join(endpoint, 1, self.spec.transport_timeout_s, device)
    try:
      model = self._model()
      plan = collective.make_plan(hf_tensors.expected_shapes(model), self.spec.wire_dtype,
                                  self.spec.bucket_mb << 20)
      self._receiver = collective.Receiver(comm, plan, device)
    except BaseException:
      collective.destroy(comm)
      raise
    self._comm = comm

  @ray.method(concurrency_group='weights')
  def receive(self, version: int, incarnation: str) -> int | None:
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
    self._apply(None, version, hf_views=views, release=release)
    return version

  def _apply(self, tree, version: int, hf_views, release=None) -> None:
    """`release()` (collective transports) is called once `hf_views` are no longer read."""
    start = time.perf_counter()
    if self._engine is None:
      # The decode thread builds the engine: every call into it (vLLM's start-up, steps and
      # weight reloads; OpenMP sizes its pool per thread) then runs in that one thread.
      built = threading.Event()
      self._thread = threading.Thread(target=self._decode,
                                      args=(tree, version, hf_views, release, built),
                                      name=f'{self.name}-decode', daemon=True)
      self._thread.start()
      built.wait()
      if self._error is not None:
        raise RuntimeError(self._error)
    elif hf_views is not None and self.spec.engine.backend == 'vllm':
      self._engine.update_hf_tensors(hf_views, version, release)  # released once loaded
    else:
      import jax
      if hf_views is not None:
        from pipelinerl_jax.generation.transport import hf_tensors
        tree = hf_tensors.params_from_hf(hf_views, self._model())  # a copy: the views are free
        release()
      # On the device before this returns, so "version v applied" means it is there. (On CPU
      # the device array may alias the object store's copy, which it then keeps alive.)
      tree = jax.block_until_ready(jax.device_put(tree, jax.local_devices()[0]))
      self._engine.update_params(tree, version)
    self._updates += 1
    self._update_s += time.perf_counter() - start
    with self._cond:
      self._cond.notify_all()

  def _build(self, tree, version: int, hf_views, release) -> api.Engine:
    """The engine, on this actor's device, serving `version` (imports JAX or vLLM now)."""
    spec, model = self.spec, self._model()
    # Object store: each tensor of an update comes to the GPU on its own, after vLLM started
    # (a collective's staging buffer was allocated before, at `join`).
    build = dict(model_dir=spec.model_dir, staged_updates=spec.transport != 'object_store')
    if spec.engine.backend == 'vllm' and hf_views is not None:
      engine = engines.make_engine(spec.engine, model, version=-1, **build)
      engine.update_hf_tensors(hf_views, version, release)
      engine.apply_update()  # serves `version`, not the checkpoint, from its first token
      return engine
    if hf_views is not None:
      from pipelinerl_jax.generation.transport import hf_tensors
      tree = hf_tensors.params_from_hf(hf_views, model)
    if spec.engine.backend == 'jax':
      import jax
      build['device'] = jax.local_devices()[0]
    return engines.make_engine(spec.engine, model, params=tree, version=version, **build)

  # --- requests --------------------------------------------------------------------------------

  @ray.method(concurrency_group='control')
  def submit(self, requests: list[api.Request], incarnation: str) -> None:
    """Queues `requests`, which were meant for `incarnation`: a batch sent to an incarnation
    that died is dropped (the pool routes those requests again). Ids this incarnation already
    holds are skipped, so the pool may re-send what it is unsure arrived."""
    if incarnation != self.incarnation:
      return
    with self._cond:
      requests = [r for r in requests if r.request_id not in self._ids]
      self._ids.update(r.request_id for r in requests)
      if self._engine is None:
        self._waiting += requests
        return
    for r in requests:
      self._engine.submit(r)
    with self._cond:
      self._cond.notify_all()

  @ray.method(concurrency_group='control')
  def release(self, request_ids: list[str], incarnation: str) -> None:
    """`api.Engine.release` for each id (an engine keeps a continuable turn's KV until then);
    meant for another incarnation, or before the engine exists: nothing is held, nothing to do."""
    if incarnation != self.incarnation or self._engine is None:
      return
    for rid in request_ids:
      self._engine.release(rid)

  @ray.method(concurrency_group='io')
  def poll(self, incarnation: str, ack: int, wait_s: float
           ) -> tuple[str, list[tuple[int, api.Completion]], dict]:
    """(incarnation, completions numbered after `ack`, stats); waits up to `wait_s` for a first
    one. Raises the decode loop's error, if it died. A poll meant for another incarnation
    returns at once with this one's name, which tells the pool of the restart."""
    if incarnation != self.incarnation:
      return self.incarnation, [], self._stats()
    deadline = time.monotonic() + wait_s
    with self._cond:
      self._ids.difference_update(c.request_id for s, c in self._outbox if s <= ack)
      self._outbox = [(s, c) for s, c in self._outbox if s > ack]
      while not self._outbox and self._error is None and time.monotonic() < deadline:
        self._cond.wait(max(0.0, deadline - time.monotonic()))
      if self._error is not None:
        raise RuntimeError(self._error)
      items = list(self._outbox)
    return self.incarnation, items, self._stats()

  def _stats(self) -> dict[str, Any]:
    stats = dict(self._engine.stats()) if self._engine is not None else {}
    stats.update(name=self.name, pid=os.getpid(), cores=list(self._cores),
                 weight_updates=self._updates, weight_update_s=self._update_s,
                 waiting=len(self._waiting))
    stats.setdefault('version', -1)
    return stats

  def _decode(self, tree, version: int, hf_views, release, built: threading.Event) -> None:
    """Builds the engine from the first weights, then steps it while there is work; an idle
    vLLM engine still loads a pending update (which frees the staging buffer for the next)."""
    refused = ()
    try:
      try:
        engine = self._build(tree, version, hf_views, release)
      finally:
        del tree, hf_views
        if release is not None:
          release()  # loaded (or failed): no-op when the engine released it already
      if self.spec.engine.backend == 'vllm':
        from pipelinerl_jax.generation.vllm import engine as vllm_engine
        refused = vllm_engine.WeightUpdateError  # not loaded; still serving the previous one
      with self._cond:
        self._engine = engine
        waiting, self._waiting = self._waiting, []
      for r in waiting:
        engine.submit(r)
      built.set()
      while not self._closed:
        if engine.num_unfinished == 0:
          if self.spec.engine.backend == 'vllm':
            try:
              engine.apply_update()
            except refused:
              pass
          with self._cond:
            self._cond.wait(0.01)
          continue
        try:
          done = engine.step()
        except refused:
          continue
        if done:
          with self._cond:
            for c in done:
              self._seq += 1
              self._outbox.append((self._seq, c))
            self._cond.notify_all()
    except BaseException as e:
      last = traceback.format_exc().strip().splitlines()[-1]
      with self._cond:
        self._error = f'{self.name}: the decode loop failed: {last}'
        self._cond.notify_all()
      del e
    finally:
      built.set()

  @ray.method(concurrency_group='control')
  def close(self) -> None:
    self._closed = True
    if self._thread is not None:
      self._thread.join(10)
    if self._engine is not None:
      self._engine.close()
