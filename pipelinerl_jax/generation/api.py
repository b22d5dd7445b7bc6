"""The one interface every generation backend implements (the embedded JAX engine, vLLM, ...).

The actor thread owns an engine: it submits requests, calls `step()` in a loop and ships the
finished completions to the trainer; the trainer (or its weight publisher) calls
`update_params` from another thread whenever it has new weights. Every generated token carries
log mu (its log-prob under the distribution it was actually drawn from) and the version of the
params that drew it, which is what the importance weights and the lag metrics need.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
from typing import Any, Iterable, Literal, Sequence

import numpy as np

FinishReason = Literal['stop', 'length']


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off. A generated stop token is kept as
  the last token of the completion (its log-prob is part of the sequence being trained)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_tokens < 1:
      raise ValueError(f'max_tokens={self.max_tokens} must be >= 1')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p={self.top_p} must be in (0, 1]')
    if self.top_k < 0 or self.temperature < 0:
      raise ValueError(f'top_k={self.top_k} and temperature={self.temperature} must be >= 0')
    object.__setattr__(self, 'stop_token_ids', tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Request:
  """`seed` is required on purpose: the samples of a request are a function of (seed, params)
  only, so the G samples of one prompt need G different seeds.

  A multi-turn episode (episodes.py) is a chain of requests, one per model turn. `continues`
  names the previous turn's request; `prompt_tokens` is still always the whole history (prompt,
  earlier turns, observations), so the result never depends on what an engine kept of the
  previous turn: an engine that still holds its KV may prefill only the new positions, any other
  prefills the whole history. `continuable`: this turn may be continued, so an engine may keep
  its KV after it finishes, until a request `continues` it or `Engine.release` drops it."""
  request_id: str
  prompt_tokens: Sequence[int]
  sampling: SamplingParams
  seed: int
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  continues: str | None = None
  continuable: bool = False


@dataclasses.dataclass
class Completion:
  """tokens / logprobs / versions: one entry per generated token (int32, float32 log mu,
  int64 policy version). `routes` (a mixture-of-experts model, engines that record them): the
  experts each token's forward pass was sent to in each MoE layer, [C, Ls, Xk] unsigned ints;
  None otherwise."""
  request_id: str
  prompt_tokens: list[int]
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  finish_reason: FinishReason
  metadata: dict[str, Any]
  routes: np.ndarray | None = None


class Engine(abc.ABC):
  """Continuous-batching generator whose weights can change between two token steps."""

  @abc.abstractmethod
  def submit(self, request: Request) -> None:
    """Queues a request; it is admitted into a free slot by a later `step()`."""

  @abc.abstractmethod
  def step(self) -> list[Completion]:
    """Applies a pending weight update, admits pending requests into free slots, then
    generates one token for every busy slot. Returns the requests finished since the last call
    (an engine that does not wait for its token steps reports a request a few steps after its
    last token was drawn)."""

  @abc.abstractmethod
  def update_params(self, params: Any, version: int) -> None:
    """Publishes new weights; safe to call from another thread. They take effect at the next
    token step (a newer update before then replaces this one); sequences in flight continue.

    An engine built on a frozen base with LoRA adapters (models/layers/lora.py) takes the adapters
    alone and keeps its base.

    Ownership contract: the engine keeps `params` (or, on another device, a copy of them) until
    the next update. The caller must therefore hand over buffers nobody will donate or delete
    -- the trainer publishes a copy, never the arrays its donated train step consumes.
    """

  @abc.abstractmethod
  def stats(self) -> dict[str, Any]:
    """At least: tokens_generated, tokens_per_s, busy_slots, pending, version."""

  @property
  @abc.abstractmethod
  def num_unfinished(self) -> int:
    """Requests submitted but not yet returned by `step()` (pending + in flight)."""

  @abc.abstractmethod
  def close(self) -> None:
    """Releases the backend's resources; the engine is unusable afterwards."""

  def release(self, request_id: str) -> None:
    """Drops what the engine keeps of a finished `continuable` request (its KV): the episode
    ended. A request it does not hold is ignored. The default keeps nothing."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def check_request(request: Request, *, max_len: int, max_len_field: str,
                  vocab_size: int) -> None:
  """The checks every backend makes at `submit`; raises ValueError naming the request."""
  prompt = list(request.prompt_tokens)
  n = request.sampling.max_tokens
  if not prompt:
    raise ValueError(f'request {request.request_id!r} has an empty prompt')
  if len(prompt) + n > max_len:
    raise ValueError(f'request {request.request_id!r}: prompt {len(prompt)} + max_tokens {n} '
                     f'exceeds {max_len_field}={max_len}')
  if min(prompt) < 0 or max(prompt) >= vocab_size:
    raise ValueError(f'request {request.request_id!r} has token ids outside the vocab')


class RequestQueue:
  """What every engine keeps of the requests it was given: the pending ones, in order, and the
  ids of all unfinished ones (pending or decoding), so an id is never unfinished twice. Any
  thread may `submit`; the stepping thread `take`s and `finish`es."""

  def __init__(self):
    self._lock = threading.Lock()
    self._pending: collections.deque[Request] = collections.deque()
    self._ids: set[str] = set()

  def submit(self, request: Request) -> None:
    with self._lock:
      if request.request_id in self._ids:
        raise ValueError(f'request id {request.request_id!r} is already unfinished')
      self._ids.add(request.request_id)
      self._pending.append(request)

  def take(self, n: int | None = None) -> list[Request]:
    """Up to n pending requests (all of them for None), oldest first; they stay unfinished."""
    with self._lock:
      n = len(self._pending) if n is None else min(n, len(self._pending))
      return [self._pending.popleft() for _ in range(n)]

  def finish(self, request_ids: Iterable[str]) -> None:
    with self._lock:
      self._ids.difference_update(request_ids)

  def discard(self, request_ids: Iterable[str]) -> None:
    """Drops these requests wherever they are: pending ones leave the queue, and every id is no
    longer unfinished."""
    ids = set(request_ids)
    with self._lock:
      self._pending = collections.deque(r for r in self._pending if r.request_id not in ids)
      self._ids.difference_update(ids)

  def clear(self) -> None:
    with self._lock:
      self._pending.clear()
      self._ids.clear()

  @property
  def num_pending(self) -> int:
    with self._lock:
      return len(self._pending)

  @property
  def num_unfinished(self) -> int:
    with self._lock:
      return len(self._ids)


class QueuedEngine(Engine):
  """An engine whose requests wait in this process: the bookkeeping each such engine keeps, its
  `RequestQueue` (`_requests`) and the version of the weights it serves (`_version`)."""

  def __init__(self, version: int = 0):
    self._requests = RequestQueue()
    self._version = version

  @property
  def num_unfinished(self) -> int:
    return self._requests.num_unfinished

  @property
  def version(self) -> int:
    """The version of the weights the next token step uses."""
    return self._version


@dataclasses.dataclass
class SequenceRecord:
  """The host record of one request being decoded: its tokens so far, each with log mu and the
  policy version that drew it (and, where recorded, its routes [Ls, Xk])."""
  request: Request
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routes: list[np.ndarray] = dataclasses.field(default_factory=list)

  def append(self, token: int, logprob: float, version: int) -> None:
    self.tokens.append(token)
    self.logprobs.append(logprob)
    self.versions.append(version)

  def completion(self, reason: FinishReason) -> Completion:
    r = self.request
    return Completion(request_id=r.request_id, prompt_tokens=[int(t) for t in r.prompt_tokens],
                      tokens=np.asarray(self.tokens, np.int32),
                      logprobs=np.asarray(self.logprobs, np.float32),
                      versions=np.asarray(self.versions, np.int64),
                      finish_reason=reason, metadata=r.metadata,
                      routes=np.stack(self.routes) if self.routes else None)


def generate(engine: Engine, requests: Sequence[Request]) -> list[Completion]:
  """Runs `step()` until every request is done; completions come back in request order.

  For tests and evaluation, on an idle engine: other work's completions would come back from
  these steps, so an engine with unfinished work is refused rather than silently drained.
  """
  if engine.num_unfinished:
    raise ValueError(f'engine has {engine.num_unfinished} unfinished requests of its own')
  ids = [r.request_id for r in requests]
  if len(set(ids)) != len(ids):
    raise ValueError('request ids must be unique')
  for r in requests:
    engine.submit(r)
  done: dict[str, Completion] = {}
  while len(done) < len(requests):
    if engine.num_unfinished == 0:
      raise RuntimeError(f'engine has no work left but {len(requests) - len(done)} requests '
                         'are missing')
    for c in engine.step():
      done[c.request_id] = c
  return [done[i] for i in ids]
