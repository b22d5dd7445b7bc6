"""`api.Engine` over N generator actors (Ray): what the actor loop sees with placement 'ray'.

  submit(request)   -> routed (routing.Routing: a prompt's G samples on one actor, a new prompt
                       to the least-loaded actor that serves), sent in batches by the next step
  step()            <- the completions the actors finished; each actor keeps one `poll` call in
                       flight, which returns as soon as it has something (or after `poll_s`)
  update_params     -> every actor, same version, newest wins (updates.py: the object store, or
                       a gloo / NCCL broadcast per actor)
  num_unfinished    =  requests submitted and not yet returned, wherever they are
  stats(), close()

The pieces: the record of each actor (members.py), the updates (updates.py), the restarts
(restarts.py); this facade routes requests and handles the Ray calls in flight as they finish.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
from ray import exceptions as ray_errors

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import routing as routing_lib
from pipelinerl_jax.generation.actors import generator as generator_lib
from pipelinerl_jax.generation.actors import members as members_lib
from pipelinerl_jax.generation.actors import placement
from pipelinerl_jax.generation.actors import restarts as restarts_lib
from pipelinerl_jax.generation.actors import updates as updates_lib


class RayGenerators(api.Engine):
  """`submit` and `update_params` may be called from any thread, `step` from one."""

  def __init__(self, spec: generator_lib.GeneratorSpec, model_config, *, num_generators: int,
               params, version: int, cpus_per_generator: int = 1, gpus_per_generator: int = 0,
               max_restarts: int = 3, session=None, poll_s: float = 0.05,
               start_timeout_s: float = 600.0, cores: placement.CoreAllocator | None = None,
               node_ip: str = ''):
    """Starts the actors (all on the Ray node with address `node_ip`, if given) and sends them
    `params` as `version`; returns once all serve. `session` (a `cluster.Session`) is closed by
    `close()`. `cores`: the allocator other actors of the run (trainer processes) took their
    cores from."""
    self.spec, self.poll_s, self._session = spec, poll_s, session
    self._lock = threading.RLock()
    self._stopped = threading.Event()  # the heartbeats end with the pool
    self._routing = routing_lib.Routing(num_generators)
    self._unplaced: dict[str, api.Request] = {}  # no actor served when these came
    self._cores = cores or placement.CoreAllocator()
    self._closed = False
    self._members: list[members_lib.Member] = []
    self._updates = updates_lib.Updates(spec, model_config, self._members, self._lock)
    self._restarts = restarts_lib.Restarts(
        self._routing, self._updates, None if gpus_per_generator else self._cores,
        cpus_per_generator, max_restarts)
    try:
      self._members += members_lib.create(spec, num_generators, cpus=cpus_per_generator,
                                          gpus=gpus_per_generator, max_restarts=max_restarts,
                                          node_ip=node_ip)
      threading.Thread(target=self._heartbeats, name='generator-heartbeats', daemon=True).start()
      for m in self._members:  # placement first: nothing heavy starts before the pinning
        members_lib.locate(m, start_timeout_s)
        self._restarts.place(m)
        if spec.transport != 'object_store':
          self._updates.join(m)
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
          m.poll = m.handle.poll.remote(m.incarnation, m.ack, self.poll_s)
      self._updates.dispatch()
    return self._progress(self.poll_s * 2)

  def release(self, request_id: str) -> None:
    """Tells the generator that decoded this finished turn that its episode ended."""
    self._check_open()
    with self._lock:
      i = self._routing.release(request_id)
      if i is not None:
        m = self._members[i]
        m.handle.release.remote([request_id], m.incarnation)

  def update_params(self, params: Any, version: int) -> None:
    """See `updates.Updates.publish`."""
    self._check_open()
    self._updates.publish(params, version)

  def stats(self) -> dict[str, Any]:
    with self._lock:
      per = [dict(m.stats, name=m.name, node=m.info.get('node_ip'), pid=m.info.get('pid'),
                  restarts=m.restarts, serving=m.serving) for m in self._members]
    total = lambda k: sum(s.get(k) or 0 for s in per)
    restarts = self._restarts.count
    logged = {'generation/restarts': restarts}
    if self.spec.verify_updates:  # by the actors' live incarnations, as of their last poll
      logged['generation/updates_verified'] = total('updates_verified')
    return dict(
        tokens_generated=total('tokens_generated'), tokens_per_s=total('tokens_per_s'),
        busy_slots=total('busy_slots'), num_slots=total('num_slots'),
        pending=total('pending') + len(self._unplaced),
        version=min(m.version for m in self._members), restarts=restarts,
        requeued=self._restarts.requeued, generators=per, **logged)

  @property
  def num_unfinished(self) -> int:
    with self._lock:
      return self._routing.num_unfinished + len(self._unplaced)

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._stopped.set()
    try:
      for m in self._members:
        try:
          ray.kill(m.handle, no_restart=True)
        except Exception:  # already gone
          pass
      self._updates.close()
    finally:
      if self._session is not None:
        self._session.close()

  # --- for tests and benchmarks ----------------------------------------------------------------

  @property
  def transport_errors(self) -> list[str]:
    """One line per collective transfer that failed (its actor was restarted)."""
    return self._updates.transport_errors

  def wait_version(self, version: int, timeout: float = 120.0) -> float:
    """Blocks until every actor has applied `version` (or a newer one); returns the seconds it
    took. Completions that arrive meanwhile are kept for the next `step()`."""
    start = time.monotonic()
    while min(m.version for m in self._members) < version:
      if time.monotonic() - start > timeout:
        raise TimeoutError(f'generators did not all load version {version} within {timeout:.0f}s '
                           f'(at {[m.version for m in self._members]})')
      with self._lock:
        self._updates.dispatch()
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

  def _heartbeats(self) -> None:
    """Tells every actor the run is there, a few times per its heartbeat timeout (its own
    thread: the actor loop may wait for the trainer for long). Fire and forget: a call to an
    actor that is restarting or gone fails without anyone waiting for it."""
    every_s = min(1.0, self.spec.heartbeat_timeout_s / 5)
    while not self._stopped.wait(every_s):
      with self._lock:
        handles = [m.handle for m in self._members]
      for handle in handles:
        handle.heartbeat.remote()

  def _check_open(self):
    if self._closed:
      raise RuntimeError('generators are closed')

  def _place_unplaced(self) -> None:
    for rid in list(self._unplaced):
      i = self._routing.choose(self._unplaced[rid])
      if i is None:
        return
      request = self._unplaced.pop(rid)
      self._routing.assign(i, request)
      self._members[i].outbox.append(request)

  def _flush(self, m: members_lib.Member) -> None:
    """(under the lock) Sends what was routed to `m` once it has loaded the latest published
    version, as an engine in this process applies a pending update before it admits requests:
    what is submitted after an update is decoded by it from its first token (conventional RL's
    batch by one policy; otherwise an actor still loading would start it on the old one)."""
    if m.outbox and m.recover is None and self._updates.is_current(m):
      m.handle.submit.remote(m.outbox, m.incarnation)
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
          raise self._restarts.died(m, e) from None
        except ray_errors.RayActorError:  # unavailable: restarting, or a lost connection
          self._restarts.lost(m)
          continue
        except ray_errors.RayTaskError as e:  # the actor raised: a bug or a refused update
          raise members_lib.failed(m, e) from None
        if kind == 'poll':
          done += self._received(m, *value)
        elif kind == 'update':
          self._loaded(m, value)
        else:
          self._requeue(self._restarts.recovered(m, value))
    return done

  def _received(self, m: members_lib.Member, incarnation: str, items, stats
                ) -> list[api.Completion]:
    """(under the lock) A poll's answer: accepted completions, or a restart detected."""
    if incarnation != m.incarnation:
      self._requeue(self._restarts.restarted(m, m.where()))
      return []
    m.stats = stats
    done = []
    for seq, completion in items:
      m.ack = max(m.ack, seq)
      if self._routing.accept(m.index, completion):
        done.append(completion)
    return done

  def _loaded(self, m: members_lib.Member, version: int | None) -> None:
    """(under the lock) An update's answer: `version` applied, so `m` serves; None: a new
    incarnation ignored it."""
    if version is None:
      self._requeue(self._restarts.restarted(m, m.where()))
      return
    m.version = max(m.version, version)
    if not m.serving:
      m.serving = self._routing.serving[m.index] = True

  def _requeue(self, requests: list[api.Request]) -> None:
    """(under the lock) Requests a dead incarnation held: routed again by the next step."""
    for r in requests:
      self._unplaced[r.request_id] = r
