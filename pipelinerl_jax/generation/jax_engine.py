"""Embedded JAX generation engine: continuous batching over H slots with in-flight weight updates.

Numerics are two pure jitted functions over an explicit `DecodeState`:
  * `prefill` loads R sequences into R slots: their context (every token but the last) goes
    into the KV cache, the last token becomes the slot's next input.
  * `decode_step` runs that input for all H slots at once (free slots are computed and
    ignored), samples, and makes the sampled token the next input.
So a step yields exactly one token per busy slot, the first generated token included, and the
only thing the host does between steps is bookkeeping. `JaxEngine` is the thin mutable shell:
current params and version, the pending queue, and which request sits in which slot.

Invariant of a busy slot: the cache holds positions 0..p-1 of its sequence, and its next input
is the token at position p. A weight update between two steps therefore leaves every slot
consistent: by default the cache keeps the keys/values computed under older weights (the stale
KV cache of PipelineRL); with `recompute_kv` every slot is re-prefilled under the new weights.

Shapes are fixed, so steady state never recompiles: the decode step has one variant per
(model config, H, S, filtering on/off), and prefill one per (row bucket, length bucket), both
powers of two. `TRACES` counts traces, for tests and the benchmark.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import sampling
from pipelinerl_jax.models import transformer

TRACES: collections.Counter = collections.Counter()  # function name -> times traced


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8               # H: sequences decoded together
  max_seq_len: int = 1024          # S: cache length; every prompt + max_tokens must fit
  eos_token_ids: tuple[int, ...] = ()  # stop every request, on top of its own stop_token_ids
  recompute_kv: bool = False       # re-prefill in-flight sequences under new weights
  min_prefill_len: int = 16        # smallest prompt-length bucket
  prefill_token_budget: int = 16384  # rows x bucket length per prefill call (bounds memory)


class Slots(NamedTuple):
  """Per-slot decode inputs, [H] each (rng: [H, 2] raw keys)."""
  tokens: jax.Array       # int32 next input: last prompt token or last sample
  positions: jax.Array    # int32 position of that input; the cache holds 0..position-1
  rng: jax.Array          # uint32 key of the request in the slot, from its seed
  steps: jax.Array        # int32 tokens sampled so far; folded into rng for the next draw
  temperature: jax.Array  # fp32
  top_k: jax.Array        # int32, 0 = off
  top_p: jax.Array        # fp32, 1.0 = off


class DecodeState(NamedTuple):
  cache: transformer.KVCache  # [L, H, S, K, Dh]
  slots: Slots


class Load(NamedTuple):
  """R sequences to put into slots, context padded to a bucket length T. Padding rows carry
  slot id H, so every write they make is dropped."""
  slot_ids: jax.Array     # [R] int32
  context: jax.Array      # [R, T] int32, sequence minus its last token
  lengths: jax.Array      # [R] int32 context length = position of the last token
  last_tokens: jax.Array  # [R] int32
  seeds: jax.Array        # [R, 2] uint32 request seed (high, low word)
  steps: jax.Array        # [R] int32 tokens already generated
  temperature: jax.Array  # [R] fp32
  top_k: jax.Array        # [R] int32
  top_p: jax.Array        # [R] fp32


def init_state(config: transformer.ModelConfig, num_slots: int, max_len: int) -> DecodeState:
  """All slots free: position S, so a free slot's cache writes are dropped."""
  h = num_slots
  key_shape = jax.random.PRNGKey(0).shape
  slots = Slots(tokens=jnp.zeros((h,), jnp.int32), positions=jnp.full((h,), max_len, jnp.int32),
                rng=jnp.zeros((h, *key_shape), jnp.uint32), steps=jnp.zeros((h,), jnp.int32),
                temperature=jnp.ones((h,), jnp.float32), top_k=jnp.zeros((h,), jnp.int32),
                top_p=jnp.ones((h,), jnp.float32))
  return DecodeState(transformer.init_cache(config, h, max_len), slots)


def request_key(seed_2: jax.Array) -> jax.Array:
  """A request's key depends on its seed only, not on its slot or arrival order."""
  base = jax.random.PRNGKey(0)
  return jax.random.fold_in(jax.random.fold_in(base, seed_2[0]), seed_2[1])


@functools.partial(jax.jit, static_argnames=('config',), donate_argnames=('state',))
def prefill(params, state: DecodeState, load: Load, *, config: transformer.ModelConfig
            ) -> DecodeState:
  """Writes each row's context into the cache of its slot and makes it ready to decode."""
  TRACES['prefill'] += 1
  n, t = load.context.shape
  # A fresh T-long cache: the context attends only to itself, so the cost is T^2, not T*S.
  col_T = jnp.arange(t, dtype=jnp.int32)
  positions_RxT = jnp.where(col_T[None] < load.lengths[:, None], col_T[None], t)
  _, fresh = transformer.decode(params, config, load.context, positions_RxT,
                                transformer.init_cache(config, n, t))  # logits are DCE'd
  # Columns past a row's length are zeros here; each is rewritten before any query sees it.
  cache = transformer.KVCache(
      k=state.cache.k.at[:, load.slot_ids, :t].set(fresh.k, mode='drop'),
      v=state.cache.v.at[:, load.slot_ids, :t].set(fresh.v, mode='drop'))
  rows = Slots(tokens=load.last_tokens, positions=load.lengths,
               rng=jax.vmap(request_key)(load.seeds), steps=load.steps,
               temperature=load.temperature, top_k=load.top_k, top_p=load.top_p)
  slots = jax.tree.map(lambda all_H, new_R: all_H.at[load.slot_ids].set(new_R, mode='drop'),
                       state.slots, rows)
  return DecodeState(cache, slots)


@functools.partial(jax.jit, static_argnames=('config', 'filtered'), donate_argnames=('state',))
def decode_step(params, state: DecodeState, *, config: transformer.ModelConfig, filtered: bool
                ) -> tuple[DecodeState, jax.Array, jax.Array]:
  """One token for every slot: returns (state, tokens [H], log mu [H]).

  `filtered` compiles top-k / top-p in; without it no row pays for the vocab sort.
  """
  TRACES['decode_step'] += 1
  s = state.slots
  logits_Hx1xV, cache = transformer.decode(params, config, s.tokens[:, None],
                                           s.positions[:, None], state.cache)
  keys_H = jax.vmap(jax.random.fold_in)(s.rng, s.steps)
  if filtered:
    tokens_H, logprobs_H = sampling.sample(keys_H, logits_Hx1xV[:, 0], s.temperature, s.top_k,
                                           s.top_p)
  else:
    tokens_H, logprobs_H = sampling.sample(keys_H, logits_Hx1xV[:, 0], s.temperature)
  # A finished slot keeps decoding garbage until reused; capped at S its writes are dropped,
  # and below S they land where the next occupant writes before it reads.
  max_len = cache.k.shape[2]
  slots = s._replace(tokens=tokens_H, positions=jnp.minimum(s.positions + 1, max_len),
                     steps=s.steps + 1)
  return DecodeState(cache, slots), tokens_H, logprobs_H


# ---------------------------------------------------------------------------------------------
# The mutable shell.


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _seed_words(seed: int) -> tuple[int, int]:
  seed %= 1 << 64  # negative or wide seeds (e.g. hash()) are fine
  return seed >> 32, seed & 0xFFFFFFFF


@dataclasses.dataclass
class _Sequence(api.SequenceRecord):
  """A request in a slot, with the token ids that end it."""
  stop_ids: frozenset[int] = frozenset()


class JaxEngine(api.Engine):
  """In-process engine over `transformer.decode`; one actor thread calls `step()`, any thread
  may call `submit` and `update_params`.

  `device` (a `jax.Device` or a `Sharding` valid for every leaf, e.g. replicated) places params
  and the decode state, so generation can run on other devices than training; the jitted steps
  follow their inputs. Params put on another device are copied there; on the same device they
  are kept as given (see the ownership contract of `api.Engine.update_params`).
  """

  def __init__(self, model_config: transformer.ModelConfig, params: Any,
               config: EngineConfig = EngineConfig(), *, version: int = 0, device: Any = None):
    self.model_config = model_config
    self.config = config
    self._device = device
    self._params = self._place(params)
    self._version = version
    self._state = self._place(init_state(model_config, config.num_slots, config.max_seq_len))
    self._slots: list[_Sequence | None] = [None] * config.num_slots
    self._requests = api.RequestQueue()
    self._next_params: tuple[Any, int] | None = None
    self._lock = threading.Lock()  # guards _next_params
    self._closed = False
    self._counts = collections.Counter()
    self._step_seconds = 0.0

  def _place(self, tree):
    return tree if self._device is None else jax.device_put(tree, self._device)

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._check_open()
    api.check_request(request, max_len=self.config.max_seq_len,
                      max_len_field='max_seq_len',
                      vocab_size=self.model_config.vocab_size)
    self._requests.submit(request)

  def update_params(self, params: Any, version: int) -> None:
    self._check_open()
    placed = self._place(params)
    with self._lock:
      self._next_params = (placed, version)

  def step(self) -> list[api.Completion]:
    self._check_open()
    start = time.perf_counter()
    self._apply_update()
    self._admit()
    busy = [i for i, s in enumerate(self._slots) if s is not None]
    if not busy:
      return []
    filtered = any(self._slots[i].request.sampling.top_k > 0 or
                   self._slots[i].request.sampling.top_p < 1.0 for i in busy)
    self._state, tokens_H, logprobs_H = decode_step(
        self._params, self._state, config=self.model_config, filtered=filtered)
    tokens_H, logprobs_H = jax.device_get((tokens_H, logprobs_H))

    finished = []
    for i in busy:
      seq = self._slots[i]
      token = int(tokens_H[i])
      seq.append(token, float(logprobs_H[i]), self._version)
      if token in seq.stop_ids:
        reason = 'stop'
      elif len(seq.tokens) >= seq.request.sampling.max_tokens:
        reason = 'length'
      else:
        continue
      finished.append(seq.completion(reason))
      self._slots[i] = None
    self._requests.finish(c.request_id for c in finished)
    self._counts['tokens_generated'] += len(busy)
    self._counts['decode_steps'] += 1
    self._counts['completions'] += len(finished)
    self._step_seconds += time.perf_counter() - start
    return finished

  def stats(self) -> dict[str, Any]:
    busy = sum(s is not None for s in self._slots)
    pending = self._requests.num_pending
    tokens = self._counts['tokens_generated']
    return dict(self._counts, tokens_generated=tokens,
                tokens_per_s=tokens / self._step_seconds if self._step_seconds else 0.0,
                step_seconds=self._step_seconds, busy_slots=busy, num_slots=len(self._slots),
                pending=pending, version=self._version)

  @property
  def num_unfinished(self) -> int:
    return self._requests.num_unfinished

  @property
  def version(self) -> int:
    return self._version

  def close(self) -> None:
    self._closed = True
    self._params = self._state = self._next_params = None
    self._slots = [None] * self.config.num_slots
    self._requests.clear()

  # --- internals -------------------------------------------------------------------------------

  def _check_open(self):
    if self._closed:
      raise RuntimeError('engine is closed')

  def _apply_update(self):
    with self._lock:
      update, self._next_params = self._next_params, None
    if update is None:
      return
    params, version = update
    if any(x.is_deleted() for x in jax.tree.leaves(params) if isinstance(x, jax.Array)):
      raise RuntimeError(f'params of version {version} were deleted after being published '
                         '(donated?); publish a copy the trainer will not donate')
    self._params, self._version = params, version
    self._counts['updates'] += 1
    busy = [i for i, s in enumerate(self._slots) if s is not None]
    if self.config.recompute_kv and busy:
      self._load(busy, [self._slots[i] for i in busy])
      self._counts['kv_recomputes'] += len(busy)

  def _admit(self):
    free = [i for i, s in enumerate(self._slots) if s is None]
    admitted = self._requests.take(len(free))
    if not admitted:
      return
    eos = frozenset(self.config.eos_token_ids)
    seqs = [_Sequence(r, stop_ids=eos | frozenset(r.sampling.stop_token_ids)) for r in admitted]
    slot_ids = free[:len(seqs)]
    for i, seq in zip(slot_ids, seqs):
      self._slots[i] = seq
    self._load(slot_ids, seqs)

  def _bucket_len(self, n: int) -> int:
    return min(max(self.config.min_prefill_len, _pow2_at_least(n)), self.config.max_seq_len)

  def _load(self, slot_ids: list[int], seqs: list[_Sequence]):
    """Prefills (prompt + generated)[:-1] of each sequence into its slot, under the current
    params; grouped by length bucket, at most `prefill_token_budget` tokens per call."""
    groups = collections.defaultdict(list)
    for i, seq in zip(slot_ids, seqs):
      full = list(seq.request.prompt_tokens) + seq.tokens
      groups[self._bucket_len(len(full) - 1)].append((i, seq, full))
    max_rows = _pow2_at_least(self.config.num_slots)
    for t, group in sorted(groups.items()):
      fits = max(1, self.config.prefill_token_budget // t)
      per_call = min(max_rows, 1 << (fits.bit_length() - 1))  # a power of two <= fits
      for c in range(0, len(group), per_call):
        chunk = group[c:c + per_call]
        self._state = prefill(self._params, self._state, self._make_load(chunk, t),
                              config=self.model_config)
        self._counts['prefill_calls'] += 1
        self._counts['prefill_tokens'] += sum(len(full) - 1 for _, _, full in chunk)

  def _make_load(self, chunk, t: int) -> Load:
    n = _pow2_at_least(len(chunk))
    load = Load(slot_ids=np.full((n,), self.config.num_slots, np.int32),
                context=np.zeros((n, t), np.int32), lengths=np.zeros((n,), np.int32),
                last_tokens=np.zeros((n,), np.int32), seeds=np.zeros((n, 2), np.uint32),
                steps=np.zeros((n,), np.int32), temperature=np.ones((n,), np.float32),
                top_k=np.zeros((n,), np.int32), top_p=np.ones((n,), np.float32))
    for row, (slot, seq, full) in enumerate(chunk):
      sp = seq.request.sampling
      load.slot_ids[row] = slot
      load.context[row, :len(full) - 1] = full[:-1]
      load.lengths[row] = len(full) - 1
      load.last_tokens[row] = full[-1]
      load.seeds[row] = _seed_words(seq.request.seed)
      load.steps[row] = len(seq.tokens)
      load.temperature[row] = sp.temperature
      load.top_k[row] = sp.top_k
      load.top_p[row] = sp.top_p
    return load
