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
  poll(ack, wait_s)    completions finished since the last acknowledged one, and the stats

The engine is built by the first update (so a restarted actor starts from the latest weights the
pool sends it, never from stale ones); requests submitted before wait in the actor. Completions
carry a sequence number and stay in the outbox until the pool acknowledges them (`ack`): a poll
reply lost in transit is sent again, so none is lost; the pool's routing drops duplicates.

This module imports Ray and the standard library only at the top: the engine (JAX or vLLM, and
their thread pools) is imported after `pin`. Methods run in Ray's threads, one per concurrency
group, so a weight transfer never blocks polling or submitting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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

CONCURRENCY_GROUPS = {'io': 1, 'control': 1, 'weights': 1}


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
  """Everything an actor needs to build its engine (picklable, no JAX objects)."""
  backend: str                     # 'jax' | 'vllm'
  model_dir: str                   # config.json (and, for vLLM, the checkpoint) on every node
  model_overrides: dict            # hf_io.load_config kwargs: the trainer's dtypes
  num_slots: int                   # H of this generator
  max_seq_len: int
  eos_token_ids: tuple[int, ...]  # stop every request
  recompute_kv: bool = False       # JAX engine
  jax_options: dict = dataclasses.field(default_factory=dict)  # JAX engine: EngineConfig fields
  kv_cache_mb: int = 256           # vLLM on CPU (or on CUDA with gpu_memory_utilization 0)
  gpu_memory_utilization: float = 0.9  # vLLM on CUDA: generation/budget.py
  cuda_graphs: bool = True         # vLLM on CUDA
  lm_head_fp32: bool = False       # vLLM
  transport: str = 'object_store'  # 'object_store' | 'gloo' | 'nccl'
  transport_timeout_s: float = 120.0
  bucket_mb: int = 256             # collective transports
  wire_dtype: str = 'float32'      # collective transports: budget.wire_dtype


def tree_digest(tree) -> str:
  """The layout of a params pytree (paths, shapes, dtypes) as a short hash: an update whose
  digest differs from the receiver's is for another model and is refused whole."""
  leaves = []

  def walk(node, path):
    if isinstance(node, dict):
      for k in sorted(node):
        walk(node[k], path + (k,))
    else:
      leaves.append(['/'.join(path), list(node.shape), str(node.dtype)])
  walk(tree, ())
  return hashlib.sha256(json.dumps(leaves).encode()).hexdigest()[:16]


def expected_digest(model_config) -> str:
  """`tree_digest` of the params this model's engine takes, from its config alone."""
  import numpy as np
  from pipelinerl_jax.models import hf_io
  tree: dict = {}
  dtype = np.dtype(model_config.param_dtype)
  for spec in hf_io.name_map(model_config):
    node = tree
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = np.lib.stride_tricks.as_strided(np.zeros((), dtype), spec.shape,
                                                         (0,) * len(spec.shape))
  return tree_digest(tree)


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


class Generator:
  """The actor's state. Plain Python: `ray.remote(Generator)` makes the actor (see pool.py)."""

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
    `thread_affinity()`, which the kernel reports."""
    if self._engine is not None:
      raise RuntimeError(f'{self.name}: pin() after the engine started has no effect on its pools')
    cores = tuple(sorted(int(c) for c in cores))
    cluster.pin_threads(cores)
    self._cores = cores
    return thread_affinity()

  @ray.method(concurrency_group='control')
  def affinity(self) -> dict[int, str]:
    return thread_affinity()

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
    got, want = tree_digest(tree), expected_digest(self._model())
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
    elif hf_views is not None and self.spec.backend == 'vllm':
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
    if spec.backend == 'jax':
      import jax
      from pipelinerl_jax.generation import jax_engine
      if hf_views is not None:
        from pipelinerl_jax.generation.transport import hf_tensors
        tree = hf_tensors.params_from_hf(hf_views, model)
      options = dict(spec.jax_options, recompute_kv=spec.recompute_kv)
      return jax_engine.JaxEngine(
          model, tree, jax_engine.EngineConfig(
              num_slots=spec.num_slots, max_seq_len=spec.max_seq_len,
              eos_token_ids=spec.eos_token_ids, **options),
          version=version, device=jax.local_devices()[0])
    from pipelinerl_jax.generation import budget
    from pipelinerl_jax.generation.transport import hf_tensors
    from pipelinerl_jax.generation.vllm import engine as vllm_engine
    # Object store: each tensor of an update comes to the GPU on its own, after vLLM started
    # (a collective's staging buffer was allocated before, at `join`).
    reserve = budget.largest_tensor_bytes(hf_tensors.expected_shapes(model).values(),
                                          model.param_dtype) \
        if spec.transport == 'object_store' else 0
    engine = vllm_engine.VllmEngine(spec.model_dir, vllm_engine.VllmEngineConfig(
        max_num_seqs=spec.num_slots, max_model_len=spec.max_seq_len,
        eos_token_ids=spec.eos_token_ids, kv_cache_bytes=spec.kv_cache_mb << 20,
        gpu_memory_utilization=spec.gpu_memory_utilization, reserve_bytes=reserve,
        cuda_graphs=spec.cuda_graphs, lm_head_fp32=spec.lm_head_fp32), version=-1)
    if hf_views is not None:
      engine.update_hf_tensors(hf_views, version, release)
    else:
      engine.update_params(tree, version)
    engine.apply_update()  # serves `version`, not the checkpoint, from its first token
    return engine

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
      if self.spec.backend == 'vllm':
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
          if self.spec.backend == 'vllm':
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
