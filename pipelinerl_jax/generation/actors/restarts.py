"""Restarts of generator actors.

Actors are created with Ray's `max_restarts`. A call to an actor that died fails with
ActorUnavailableError; the pool then stops routing to it and asks it where it is (`lost`), which
Ray answers once the restarted actor is up. A new incarnation means the requests it held are
lost: they are routed again (to the actors serving meanwhile), the restart is counted
(`generation/restarts` in the metrics), and the actor is pinned again and sent the latest weights
before it serves (`restarted`). Calls carry the incarnation they are meant for, so a submit or
poll queued for the dead incarnation is ignored by the new one; completions stay in an actor's
outbox until acknowledged, so a lost reply is re-sent, and the routing accepts each request id
exactly once. When Ray gives up (the restarts are used), the run stops with one line naming the
actor, its node and the cause (`died`).
"""

from __future__ import annotations

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import routing as routing_lib
from pipelinerl_jax.generation.actors import members as members_lib
from pipelinerl_jax.generation.actors import placement
from pipelinerl_jax.generation.actors import updates as updates_lib


class Restarts:
  """Every method runs under the pool's lock. `cores`: the allocator actors are pinned from (None:
  they are on GPUs and keep the cores Ray gave them), `cpus` each."""

  def __init__(self, routing: routing_lib.Routing, updates: updates_lib.Updates,
               cores: placement.CoreAllocator | None, cpus: int, max_restarts: int):
    self._routing, self._updates = routing, updates
    self._cores, self._cpus, self.max_restarts = cores, cpus, max_restarts
    self.count = self.requeued = 0

  def place(self, m: members_lib.Member) -> None:
    """On a node without GPUs for it, the actor's process gets cores of its own."""
    if self._cores is not None:
      members_lib.pin(m, self._cores, self._cpus)

  def lost(self, m: members_lib.Member) -> None:
    """A call failed: stop routing to it; ask where it is (Ray answers once a restarted actor is
    up, or fails for good)."""
    self._serve(m, False)
    m.poll = m.update = None
    m.recover = m.handle.where.remote()

  def recovered(self, m: members_lib.Member, info: dict) -> list[api.Request]:
    """The answer to `lost`'s question: a new incarnation restarted (see `restarted`); the same
    one lost a reply or a submit: it is sent again what it should hold."""
    if info['incarnation'] != m.incarnation:
      return self.restarted(m, info)
    m.outbox = self._routing.requests(m.index)
    if m.version >= 0:
      self._serve(m, True)
    return []

  def restarted(self, m: members_lib.Member, info: dict) -> list[api.Request]:
    """A new incarnation: it is pinned again and gets the latest weights before it serves.
    Returns the requests the dead one held, to route again."""
    self.count += 1
    m.restarts += 1
    evicted = self._routing.evict(m.index)
    self.requeued += len(evicted)
    if self._cores is not None and m.info.get('cores'):
      self._cores.release(m.info['node_id'], m.info['cores'])
    m.info, m.ack, m.version, m.outbox, m.stats = info, 0, -1, [], {}
    self._serve(m, False)
    m.poll = m.update = m.recover = None
    print(f'[generators] {m.name} restarted on node {info["node_ip"]} (pid {info["pid"]}, '
          f'restart {m.restarts} of {self.max_restarts}); {len(evicted)} requests re-routed',
          flush=True)
    self.place(m)
    self._updates.resend(m)
    return evicted

  def died(self, m: members_lib.Member, error: BaseException) -> members_lib.GeneratorDied:
    """The error that ends the run when Ray gave up on the actor."""
    return members_lib.GeneratorDied(
        f'generator actor {m.name} (node {m.info.get("node_ip")}, pid {m.info.get("pid")}) '
        f'died: {members_lib.death_cause(error)}; restarts used {m.restarts} of '
        f'generation.remote.max_restarts={self.max_restarts}')

  def _serve(self, m: members_lib.Member, serving: bool) -> None:
    m.serving = self._routing.serving[m.index] = serving
