"""`api.Engine` over N generator actors (Ray): what the actor loop sees with placement 'ray'.

  submit(request)   -> routed (routing.Routing: a prompt's G samples on one actor, a new prompt
                       to the least-loaded actor that serves), sent in batches by the next step
  step()            <- the completions the actors finished; each actor keeps one `poll` call in
                       flight, which returns as soon as it has something (or after `poll_s`)
  update_params     -> every actor, same version: one `ray.put` of the params as host arrays,
                       which every actor on a node reads zero-copy from Ray's object store; or a
                       bucketed gloo / NCCL broadcast per actor (transport/collective.py), all
                       from one sender thread, in the wire dtype (budget.wire_dtype); or, from
                       several trainer processes, their pieces (`shards.Published`)
  num_unfinished    =  requests submitted and not yet returned, wherever they are

Newest update wins: an actor has at most one update in flight; when it finishes, the actor is
sent the latest version published since, never the ones in between. Every update carries its
version and the digest of its layout, and the actor applies it whole or refuses it.

Faults. Actors are created with Ray's `max_restarts`. A call to an actor that died fails with
ActorUnavailableError; the pool then asks the actor where it is, which Ray answers once the
restarted actor is up. A new incarnation means the requests it held are lost: they are routed
again (to the actors serving meanwhile), the restart is counted (`generation/restarts` in the
metrics), and the actor is pinned again and sent the latest weights before it serves. Calls
carry the incarnation they are meant for, so a submit or poll queued for the dead incarnation
is ignored by the new one; completions stay in an actor's outbox until acknowledged, so a lost
reply is re-sent, and the routing accepts each request id exactly once. When Ray gives up (the
restarts are used), the run stops with one line naming the actor, its node and the cause.
A collective transfer that fails or misses its deadline is reported in one line, its
communicator destroyed, and the actor killed, so that Ray restarts it into a new group.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import ray
from ray import exceptions as ray_errors

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import routing as routing_lib
from pipelinerl_jax.generation.actors import generator as generator_lib
from pipelinerl_jax.generation.actors import placement
from pipelinerl_jax.generation.transport import shards


class GeneratorDied(RuntimeError):
  """A generator actor is gone for good; the message names it, its node and the cause."""


def death_cause(error: BaseException) -> str:
  """The line of a Ray actor error that says why the actor died."""
  text = getattr(error, 'error_msg', None) or str(error)
  for line in text.splitlines():
    if 'The actor is dead because' in line or 'is unavailable' in line:
      line = line.split(' Some common causes', 1)[0]
      return line.split('The actor is dead because ', 1)[-1].strip()
  return text.strip().splitlines()[0] if text.strip() else type(error).__name__


@dataclasses.dataclass
class _Member:
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


class RayGenerators(api.Engine):
  """`submit` and `update_params` may be called from any thread, `step` from one."""

  def __init__(self, spec: generator_lib.GeneratorSpec, model_config, *, num_generators: int,
               params, version: int, cpus_per_generator: int = 1, gpus_per_generator: int = 0,
               max_restarts: int = 3, session=None, poll_s: float = 0.05,
               start_timeout_s: float = 600.0, cores: placement.CoreAllocator | None = None):
    """Starts the actors and sends them `params` as `version`; returns once all serve.
    `session` (a `cluster.Session`) is closed by `close()`. `cores`: the allocator other actors
    of the run (trainer processes) took their cores from."""
    self.spec, self.model_config = spec, model_config
    self.max_restarts, self.poll_s, self._session = max_restarts, poll_s, session
    self._cpus, self._gpus = cpus_per_generator, gpus_per_generator
    self._lock = threading.RLock()
    self._routing = routing_lib.Routing(num_generators)
    self._unplaced: dict[str, api.Request] = {}  # no actor served when these came
    self._cores = cores or placement.CoreAllocator()
    self._latest: tuple[Any, int, str] | None = None  # (object ref or params, version, digest)
    self._closed = False
    self.restarts = self.requeued = 0
    self.transport_errors: list[str] = []
    self._sender = self._plan = None
    if spec.transport != 'object_store':
      from pipelinerl_jax.generation.transport import collective
      from pipelinerl_jax.generation.transport import hf_tensors
      self._plan = collective.make_plan(hf_tensors.expected_shapes(model_config), spec.wire_dtype,
                                        spec.bucket_mb << 20)
      # torch's cuda:0 and JAX's first device are the first visible GPU.
      self._sender = collective.Sender('cuda:0' if spec.transport == 'nccl' else 'cpu')
      self._gather_device = jax.local_devices()[0]
    have = ray.cluster_resources()
    for kind, each, key in (('CPU', cpus_per_generator, 'cpus_per_generator'),
                            ('GPU', gpus_per_generator, 'gpus_per_generator')):
      if each * num_generators > have.get(kind, 0):
        raise ValueError(f'config.generation.num_generators: {num_generators} generators x '
                         f'generation.remote.{key}={each} need {each * num_generators} {kind}s; '
                         f'the Ray cluster has {have.get(kind, 0):g}')
    actor_cls = ray.remote(concurrency_groups=generator_lib.CONCURRENCY_GROUPS)(
        generator_lib.Generator)
    self._members: list[_Member] = []
    try:
      for i in range(num_generators):
        name = f'generator-{i}'
        handle = actor_cls.options(
            name=name, num_cpus=cpus_per_generator, num_gpus=gpus_per_generator,
            max_restarts=max_restarts, max_task_retries=0).remote(spec, name)
        self._members.append(_Member(i, name, handle, info={}))
      for m in self._members:  # placement first: nothing heavy starts before the pinning
        try:
          m.info = ray.get(m.handle.where.remote(), timeout=start_timeout_s)
        except ray_errors.GetTimeoutError:
          raise TimeoutError(f'generator actor {m.name} was not placed within '
                             f'{start_timeout_s:.0f}s (see `ray status`)') from None
        self._pin(m)
        if spec.transport != 'object_store':
          self._join(m)
      self.update_params(params, version)
      self.wait_version(version, start_timeout_s)
    except BaseException:
      self.close()
      raise

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._check_open()
    if request.request_id in self._unplaced:
      raise ValueError(f'request id {request.request_id!r} is already unfinished')
    with self._lock:
      i = self._routing.choose(request)
      if i is None:
        self._unplaced[request.request_id] = request
        return
      self._routing.assign(i, request)
      self._members[i].outbox.append(request)

  def step(self) -> list[api.Completion]:
    """Sends what was routed, collects what the actors finished (waiting up to `poll_s` for a
    first completion when there is work out)."""
    self._check_open()
    with self._lock:
      self._place_unplaced()
      for m in self._members:
        self._flush(m)
        if m.poll is None and m.recover is None:
          m.poll = m.handle.poll.remote(m.info['incarnation'], m.ack, self.poll_s)
      self._dispatch_updates()
    return self._progress(self.poll_s * 2)

  def update_params(self, params: Any, version: int) -> None:
    """Object store: copies `params` to host and into the object store before returning (the
    caller may then donate them); the actors load them as soon as they are free. Collective:
    broadcasts to each serving actor in turn, each within transport_timeout_s."""
    self._check_open()
    if isinstance(params, shards.Published):  # several trainer processes: their pieces
      with self._lock:
        self._latest = (params, version, params.digest)
        self._dispatch_updates()
      return
    if self.spec.transport == 'object_store':
      host = jax.tree.map(np.asarray, jax.device_get(params))
      latest = (ray.put(host), version, generator_lib.tree_digest(host))
      with self._lock:
        self._latest = latest
        self._dispatch_updates()
      return
    with self._lock:
      self._latest = (params, version, '')
      members = [m for m in self._members if m.comm is not None and m.recover is None]
    for m in members:
      self._send(m, params, version)

  def stats(self) -> dict[str, Any]:
    with self._lock:
      per = [dict(m.stats, name=m.name, node=m.info.get('node_ip'), pid=m.info.get('pid'),
                  restarts=m.restarts, serving=m.serving) for m in self._members]
    total = lambda k: sum(s.get(k) or 0 for s in per)
    return dict(
        tokens_generated=total('tokens_generated'), tokens_per_s=total('tokens_per_s'),
        busy_slots=total('busy_slots'), num_slots=total('num_slots'),
        pending=total('pending') + len(self._unplaced),
        version=min(m.version for m in self._members), restarts=self.restarts,
        requeued=self.requeued, generators=per, **{'generation/restarts': self.restarts})

  @property
  def num_unfinished(self) -> int:
    with self._lock:
      return self._routing.num_unfinished + len(self._unplaced)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    try:
      for m in self._members:
        try:
          ray.kill(m.handle, no_restart=True)
        except Exception:  # already gone
          pass
        self._drop_comm(m)
      if self._sender is not None:
        self._sender.close()
    finally:
      if self._session is not None:
        self._session.close()

  # --- for tests and benchmarks ----------------------------------------------------------------

  def wait_version(self, version: int, timeout: float = 120.0) -> float:
    """Blocks until every actor has applied `version` (or a newer one); returns the seconds it
    took. Completions that arrive meanwhile are kept for the next `step()`."""
    start = time.monotonic()
    while min(m.version for m in self._members) < version:
      if time.monotonic() - start > timeout:
        raise TimeoutError(f'generators did not all load version {version} within {timeout:.0f}s '
                           f'(at {[m.version for m in self._members]})')
      with self._lock:
        self._dispatch_updates()
      self._progress(0.05, polls=False)
    return time.monotonic() - start

  def members(self) -> list[dict]:
    """Where each actor runs: name, node, pid, cores, GPUs, incarnation."""
    with self._lock:
      return [dict(m.info) for m in self._members]

  def affinity(self) -> list[dict[int, str]]:
    """Each actor's {thread id: Cpus_allowed_list}, read by the actor from /proc."""
    return ray.get([m.handle.affinity.remote() for m in self._members])

  def take_free_cores(self) -> tuple[int, ...]:
    """The cores of this process's node that no actor of the run holds, now held by this
    process (so that a restarted actor is not pinned onto them): where the driver's trainer
    goes when generation and training must not share a core. Raises a one-line ValueError
    when the actors hold them all."""
    allowed = sorted(os.sched_getaffinity(0))
    node = ray.get_runtime_context().get_node_id()
    with self._lock:
      cores = self._cores.take_free(node, allowed)
    if not cores:
      raise ValueError(f"config.train.cores='free': the generators hold every core this "
                       f"process may use ({','.join(map(str, allowed))}); lower "
                       'generation.num_generators or generation.remote.cpus_per_generator')
    return cores

  # --- internals -------------------------------------------------------------------------------

  def _check_open(self):
    if self._closed:
      raise RuntimeError('generators are closed')

  def _pin(self, m: _Member) -> None:
    """On a node without GPUs for it, the actor's process gets cores of its own."""
    if self._gpus:
      return
    cores = self._cores.take(m.info['node_id'], m.info['cores'], self._cpus)
    seen = ray.get(m.handle.pin.remote(cores), timeout=60)
    want = ','.join(map(str, cores))
    wrong = {tid: cpus for tid, cpus in seen.items() if _cpu_list(cpus) != list(cores)}
    if wrong:
      raise RuntimeError(f'{m.name}: threads {sorted(wrong)[:5]} are not pinned to cores {want}')
    m.info['cores'] = list(cores)

  def _join(self, m: _Member) -> None:
    """A new two-rank group with the actor (trainer rank 0), for a collective transport; a
    group that fails to form is torn down before this raises."""
    from pipelinerl_jax.generation.transport import collective
    self._drop_comm(m)
    rendezvous = collective.Rendezvous(self.spec.transport, self.spec.transport_timeout_s,
                                       host=ray.util.get_node_ip_address())
    try:
      joined = m.handle.join.remote(rendezvous.endpoint)
      m.comm = rendezvous.connect(device='cuda:0' if self.spec.transport == 'nccl' else None)
      ray.get(joined, timeout=self.spec.transport_timeout_s)
    except BaseException:
      self._drop_comm(m)
      raise
    finally:
      rendezvous.close()

  def _drop_comm(self, m: _Member) -> None:
    """Destroys the trainer's end of the actor's group, if any (bounded: an abort may block)."""
    comm, m.comm = m.comm, None
    if comm is not None:
      from pipelinerl_jax.generation.transport import collective
      collective.destroy(comm)

  def _send(self, m: _Member, params, version: int) -> None:
    """Broadcasts one update to one actor within the deadline, from the sender thread; a
    transfer that fails or misses it is reported in one line (the sender has destroyed the
    communicator) and the actor killed, so Ray restarts it into a new group."""
    from pipelinerl_jax.generation.transport import hf_tensors
    with m.send_lock:
      comm = m.comm
      if comm is None:
        return
      received = m.handle.receive.remote(version, m.info['incarnation'])
      try:
        self._sender.send(comm, self._plan, lambda: hf_tensors.gathered_torch_tensors(
            params, self.model_config, self._gather_device, self.spec.wire_dtype), version,
            timeout_s=self.spec.transport_timeout_s)
      except Exception as error:  # the sender has destroyed the communicator
        m.comm = None
        if self._incarnation_changed(m):  # it died and came back: the restart re-joins it
          return
        what = (f'did not complete within {self.spec.transport_timeout_s:.0f}s '
                '(generation.remote.transport_timeout_s)' if isinstance(error, TimeoutError)
                else f'failed ({type(error).__name__}: {error})')
        line = (f'{m.name} (node {m.info.get("node_ip")}): weight update {version} over '
                f'generation.remote.weight_transport={self.spec.transport!r} {what}; the group is '
                'unusable, the actor is restarted')
        print(f'[generators] {line}', flush=True)
        self.transport_errors.append(line)
        ray.kill(m.handle, no_restart=False)  # Ray restarts it; `_restarted` re-joins
        return
    with self._lock:
      m.update = received

  def _dispatch_updates(self) -> None:
    """(under the lock) Object store: the latest version to every actor without an update in
    flight that has an older one."""
    if self._latest is None or self.spec.transport != 'object_store':
      return
    ref, version, digest = self._latest
    for m in self._members:
      if m.update is None and m.recover is None and m.version < version:
        if isinstance(ref, shards.Published):
          m.update = m.handle.update_shards.remote(ref.refs, version, digest, m.info['incarnation'])
        else:
          m.update = m.handle.update.remote(ref, version, digest, m.info['incarnation'])

  def _place_unplaced(self) -> None:
    for rid in list(self._unplaced):
      i = self._routing.choose(self._unplaced[rid])
      if i is None:
        return
      request = self._unplaced.pop(rid)
      self._routing.assign(i, request)
      self._members[i].outbox.append(request)

  def _flush(self, m: _Member) -> None:
    """(under the lock) Sends what was routed to `m` once it has loaded the latest published
    version, as an engine in this process applies a pending update before it admits requests:
    what is submitted after an update is decoded by it from its first token (conventional RL's
    batch by one policy; otherwise an actor still loading would start it on the old one)."""
    if m.outbox and m.recover is None and (self._latest is None
                                           or m.version >= self._latest[1]):
      m.handle.submit.remote(m.outbox, m.info['incarnation'])
      m.outbox = []

  def _progress(self, timeout: float, polls: bool = True) -> list[api.Completion]:
    """Handles the calls in flight that finish within `timeout`; returns new completions."""
    with self._lock:
      pending = {}
      for m in self._members:
        for kind in (('poll', 'update', 'recover') if polls else ('update', 'recover')):
          ref = getattr(m, kind)
          if ref is not None:
            pending[ref] = (m, kind)
    if not pending:
      time.sleep(timeout)
      return []
    ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
    if ready:
      ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
    done: list[api.Completion] = []
    for ref in ready:
      m, kind = pending[ref]
      with self._lock:
        setattr(m, kind, None)
        try:
          value = ray.get(ref)
        except ray_errors.ActorDiedError as e:
          raise GeneratorDied(
              f'generator actor {m.name} (node {m.info.get("node_ip")}, pid '
              f'{m.info.get("pid")}) died: {death_cause(e)}; restarts used {m.restarts} of '
              f'generation.remote.max_restarts={self.max_restarts}') from None
        except ray_errors.RayActorError:  # unavailable: restarting, or a lost connection
          self._lost(m)
          continue
        except ray_errors.RayTaskError as e:  # the actor raised: a bug or a refused update
          cause = e.cause if getattr(e, 'cause', None) is not None else e
          raise RuntimeError(f'generator actor {m.name} (node {m.info.get("node_ip")}): '
                             f'{type(cause).__name__}: {str(cause).splitlines()[0]}') from None
        if kind == 'poll':
          done += self._received(m, *value)
        elif kind == 'update':
          if value is None:  # a new incarnation ignored it
            self._restarted(m, ray.get(m.handle.where.remote(), timeout=60))
            continue
          m.version = max(m.version, value)
          if not m.serving:
            m.serving = self._routing.serving[m.index] = True
        else:
          if value['incarnation'] != m.info['incarnation']:
            self._restarted(m, value)
          else:  # the same incarnation: a lost reply or submit; re-send what it should hold
            m.outbox = self._routing.requests(m.index)
            if m.version >= 0:
              m.serving = self._routing.serving[m.index] = True
    return done

  def _received(self, m: _Member, incarnation: str, items, stats) -> list[api.Completion]:
    """(under the lock) A poll's answer: accepted completions, or a restart detected."""
    if incarnation != m.info['incarnation']:
      self._restarted(m, ray.get(m.handle.where.remote(), timeout=60))
      return []
    m.stats = stats
    done = []
    for seq, completion in items:
      m.ack = max(m.ack, seq)
      if self._routing.accept(m.index, completion):
        done.append(completion)
    return done

  def _incarnation_changed(self, m: _Member) -> bool:
    """Whether the actor answers as another incarnation within a few seconds (False when it
    does not answer: stopped, or still restarting)."""
    try:
      info = ray.get(m.handle.where.remote(), timeout=5)
    except (ray_errors.GetTimeoutError, ray_errors.RayActorError):
      return False
    return info['incarnation'] != m.info['incarnation']

  def _lost(self, m: _Member) -> None:
    """(under the lock) A call failed: stop routing to it; ask where it is (Ray answers once a
    restarted actor is up, or fails for good)."""
    m.serving = self._routing.serving[m.index] = False
    m.poll = m.update = None
    m.recover = m.handle.where.remote()

  def _restarted(self, m: _Member, info: dict) -> None:
    """(under the lock) A new incarnation: its requests are routed again, it is pinned again
    and gets the latest weights before it serves."""
    self.restarts += 1
    m.restarts += 1
    evicted = self._routing.evict(m.index)
    self.requeued += len(evicted)
    for r in evicted:
      self._unplaced[r.request_id] = r
    if not self._gpus and m.info.get('cores'):
      self._cores.release(m.info['node_id'], m.info['cores'])
    m.info, m.ack, m.version, m.outbox, m.stats = info, 0, -1, [], {}
    m.serving = self._routing.serving[m.index] = False
    m.poll = m.update = m.recover = None
    print(f'[generators] {m.name} restarted on node {info["node_ip"]} (pid {info["pid"]}, '
          f'restart {m.restarts} of {self.max_restarts}); {len(evicted)} requests re-routed',
          flush=True)
    self._pin(m)
    if self.spec.transport == 'object_store':
      self._dispatch_updates()
      return
    self._join(m)
    params, version, _ = self._latest
    threading.Thread(target=self._send, args=(m, params, version), daemon=True).start()


def _cpu_list(text: str) -> list[int]:
  """'0-2,5' -> [0, 1, 2, 5] (the kernel's Cpus_allowed_list format)."""
  out = []
  for part in text.split(','):
    lo, _, hi = part.partition('-')
    out += range(int(lo), int(hi or lo) + 1)
  return out
