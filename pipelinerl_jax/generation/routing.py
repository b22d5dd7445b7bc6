"""Which generator holds which request: the bookkeeping of a pool of generators, kept apart from
whatever runs them (Ray actors today), so it is tested on its own.

  choose(request)       -> the generator for a new request: for a turn that `continues` an
                           episode, the generator that decoded its previous turn (it may hold
                           its KV); else the one already holding its group (the G samples of a
                           prompt share a prefix and a scheduler), else the least-loaded
                           generator that serves; None when none serves
  assign(i, request)    -> generator i holds it now
  accept(i, completion) -> True exactly once per request id, and only from the generator the
                           request is assigned to; anything else (a duplicate, a completion from
                           a generator the request was taken from) is dropped
  evict(i)              -> the requests generator i held, oldest first, now held by none: it
                           restarted and lost them; the pool routes them again
  release(request_id)   -> the generator that decoded this finished continuable turn (to tell it
                           the episode ended), or None

A request id is unfinished from `assign` until its completion is accepted, so it can be neither
lost (an evicted request is handed back) nor counted twice.
"""

from __future__ import annotations

import collections
from typing import Any

from pipelinerl_jax.generation import api


def group_key(request: api.Request) -> Any:
  """What keeps requests together: the actor's group id, else the request itself."""
  return request.metadata.get('group', request.request_id)


class Routing:
  """Not thread-safe: the pool calls it under its own lock."""

  def __init__(self, num_generators: int):
    if num_generators < 1:
      raise ValueError(f'num_generators={num_generators} must be >= 1')
    self.serving = [True] * num_generators
    self._held: list[dict[str, api.Request]] = [{} for _ in range(num_generators)]  # in order
    self._where: dict[str, int] = {}                # request id -> generator holding it
    self._group_at: dict[Any, int] = {}             # group key -> generator, while it has some
    self._open: collections.Counter = collections.Counter()  # group key -> requests held
    self._turns: dict[str, int] = {}  # finished continuable request id -> generator that did it

  def choose(self, request: api.Request) -> int | None:
    if request.request_id in self._where:
      raise ValueError(f'request id {request.request_id!r} is already unfinished')
    at = self._turns.get(request.continues) if request.continues is not None else None
    if at is not None and self.serving[at]:
      return at
    at = self._group_at.get(group_key(request))
    if at is not None and self.serving[at]:
      return at
    serving = [i for i, s in enumerate(self.serving) if s]
    return min(serving, key=lambda i: (len(self._held[i]), i)) if serving else None

  def assign(self, i: int, request: api.Request) -> None:
    rid, key = request.request_id, group_key(request)
    if rid in self._where:
      raise ValueError(f'request id {rid!r} is already unfinished')
    self._where[rid] = i
    self._held[i][rid] = request
    self._turns.pop(request.continues, None)
    self._group_at[key] = i  # a group split by an eviction follows its newest requests
    self._open[key] += 1

  def accept(self, i: int, completion: api.Completion) -> bool:
    rid = completion.request_id
    if self._where.get(rid) != i:
      return False
    if self._held[i][rid].continuable:
      self._turns[rid] = i
    self._release(i, rid)
    return True

  def evict(self, i: int) -> list[api.Request]:
    requests = list(self._held[i].values())
    for r in requests:
      self._release(i, r.request_id)
    self._turns = {rid: at for rid, at in self._turns.items() if at != i}  # (their KV is gone)
    return requests

  def release(self, request_id: str) -> int | None:
    return self._turns.pop(request_id, None)

  def _release(self, i: int, rid: str) -> None:
    del self._where[rid]
    key = group_key(self._held[i].pop(rid))
    self._open[key] -= 1
    if not self._open[key]:
      del self._open[key]
      self._group_at.pop(key, None)

  def load(self, i: int) -> int:
    return len(self._held[i])

  def held(self, i: int) -> list[str]:
    """The ids generator i holds, oldest first."""
    return list(self._held[i])

  def requests(self, i: int) -> list[api.Request]:
    return list(self._held[i].values())

  @property
  def num_unfinished(self) -> int:
    return len(self._where)
