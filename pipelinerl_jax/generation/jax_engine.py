"""Embedded JAX generation engine: continuous batching over H slots on a paged KV cache, with
in-flight weight updates.

Numerics are two pure jitted functions over an explicit `DecodeState` (the page pool and each
slot's decode inputs; models/layers/paged_attention.py has the pool's layout):
  * `prefill` writes R context chunks into the pool through their rows' block tables; a row whose
    chunk ends its sequence's context makes its slot ready: the slot's next input is the
    sequence's last token.
  * `decode_step` runs that input for all H slots at once (a slot that is not decoding has a
    block table of trash pages, so its writes land nowhere), samples, and makes the sampled token
    the next input.
So a step yields exactly one token per decoding slot, the first generated token included. For
a mixture-of-experts model the step also reports, per slot, the experts its input was routed to
in every MoE layer: the routes of the forward pass that drew the token, recorded beside its log
mu (`api.Completion.routes`) for the trainer to replay.

`JaxEngine` is the mutable shell: current params and version, the pending queue, which sequence
sits in which slot, the page allocator (`paging.PagePool`) and each sequence's pages. One
`step()`:
  1. applies a pending weight update (new params only; with `recompute_kv`, every sequence in a
     slot is loaded again under them);
  2. every `sync_every` token steps (4 on a GPU, 1 on a CPU), collects the tokens of the steps
     dispatched before the newest one, in one transfer while the newest still runs on the
     device: appends them with their log mu and policy version, finishes the sequences that
     stopped (their pages return), and reserves pages for the next steps (preempting the
     youngest sequence when the pool is short: it waits and is loaded again later);
  3. admits waiting requests into free slots while the pool has their pages (a slot is free once
     its sequence has stopped, or as soon as its last token is in flight), and prefills them
     (whole contexts, or `prefill_chunk` positions of each per step, so a long prompt never
     stalls the sequences in flight);
  4. dispatches one decode step for the decoding slots and returns without waiting for it.
So the host never waits for a token step it does not need, a stop is seen at most `sync_every`
steps late (the tokens a stopped sequence decodes meanwhile are dropped), and weights still
change between two token steps: each step records the version it ran with.

Invariant of a decoding slot: the pool holds positions 0..p-1 of its sequence, and its next input
is the token at position p. A weight update between two steps leaves every slot consistent: by
default the pool keeps the keys/values computed under older weights (the stale KV cache of
PipelineRL); with `recompute_kv` every sequence is prefilled again under the new weights.

A multi-turn episode continues its sequence (`api.Request.continues`): a `continuable` request
that finishes keeps its pages, not its slot (`_held`), and the request that continues it takes
them over when its prompt (the whole history) starts with the tokens whose KV they hold; only the
new positions (the observation) are prefilled, as a chunked prefill does. Otherwise (evicted,
`recompute_kv` update, history mismatch, restarted engine) the whole history is prefilled. Held
pages keep the KV of the versions that wrote them, like a sequence in flight; they are the first
pages given up when the pool is short (oldest first, before any decoding sequence is
preempted), and `release`, `abort`, a `recompute_kv` update and `close` free them.

The G samples of a prompt share its pages (`share_prompts`): the full pages of the prompt are
written once, under one params version, and every sample admitted under that version reads them
(reference counts return them when the last reader is done); each sample writes the prompt's
last, partial page into a page of its own, where the samples diverge.

Hybrids (Qwen3.5: Gated DeltaNet layers among attention layers) keep KV pages for their
attention layers only, and per slot a fixed-size state for each linear layer
(`slot_state.StateStore`, whose doc says how prefill, decode, shared prompts, continued turns,
preemption and updates treat it): a sequence's cache is its pages and its slot's state. The
writer of a shared prompt prefills it in two chunks, the full pages first, so that the state
after them can be saved for the other samples; a turn that may be continued saves its slot's
state when it finishes. So that this state is the one after the turn's last input even when
the host sees a stop late (`sync_every` > 0), a hybrid's slot parks itself on the device when
it draws one of its stop ids: the steps dispatched after it leave its state as it is.

Shapes are bucketed, so steady state never recompiles: the decode step has one variant per (model
config, H, read width W, filtering on/off) and prefill one per (row bucket, length bucket,
width), powers of two. W, the block-table entries a step reads, is a power-of-two bucket of the
longest sequence's pages for the 'xla' read and the whole table for the kernels (which read each
row's own length). `TRACES` counts traces, for tests and the benchmark.

LoRA: params given as `lora.Adapted(base, adapters, scale)` are served unmerged (every step
computes x W + s (x A) B, as the trainer does), so the base can be the trainer's own buffers.
Such an engine's updates are adapters alone: `update_params(adapters, version)` swaps them in
between two token steps and keeps the base. It holds them as a step uses them, A and s B in the
compute dtype, made once per update (`serve_adapters`): the bits the trainer's layer makes
from the same adapters at every step, without their casts in every token step.
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
from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation import paging
from pipelinerl_jax.generation import sampling
from pipelinerl_jax.generation import slot_state
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models.layers import paged_attention
from pipelinerl_jax.models import transformer

TRACES: collections.Counter = collections.Counter()  # function name -> times traced
NEVER = 1 << 40  # a slot's `_grow` while it needs no page
PARKED = 1 << 30  # the position of a slot that is not decoding: past every table, so its writes
                  # go to the trash page
# The fewest positions a call reads per row: shorter reads are cheap, and every read width is a
# compile (of the decode step, or of prefill).
MIN_READ_POSITIONS = 512
# Token steps between two collections on an accelerator: the host's work for them overlaps the
# device's; a stop is seen at most this many steps late.
SYNC_EVERY = 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8               # H: sequences decoded together
  max_seq_len: int = 1024          # S: every prompt + max_tokens must fit
  eos_token_ids: tuple[int, ...] = ()  # stop every request, on top of its own stop_token_ids
  recompute_kv: bool = False       # re-prefill in-flight sequences under new weights
  page_size: int = 16              # Z: token positions per KV page
  pool_mb: int = 0                 # the KV pool's memory; 0 = `budget.kv_pool_pages`' rule
  num_pages: int = 0               # A, exactly (the trash page included); overrides pool_mb
  decode_attention: str = 'xla'    # how a decode step reads the pool: 'xla' | 'pallas' | 'cudnn'
  sync_every: int = -1             # token steps between two collections of their results (0:
                                   # each step's at once, no overlap); -1: 1 on a CPU (the
                                   # host loop runs while the next step computes on the other
                                   # core), else SYNC_EVERY
  prefill_chunk: int = 0           # positions of one context prefilled per step (0 = all at once)
  share_prompts: bool = True       # the samples of one prompt share its full pages
  min_prefill_len: int = 16        # smallest prefill length bucket
  prefill_token_budget: int = 16384  # rows x bucket length per prefill call (bounds memory)

  def __post_init__(self):
    for name in ('num_slots', 'max_seq_len', 'page_size', 'min_prefill_len',
                 'prefill_token_budget'):
      if getattr(self, name) < 1:
        raise ValueError(f'EngineConfig.{name}={getattr(self, name)} must be >= 1')
    for name in ('pool_mb', 'num_pages', 'prefill_chunk'):
      if getattr(self, name) < 0:
        raise ValueError(f'EngineConfig.{name}={getattr(self, name)} must be >= 0')
    if self.sync_every < -1:
      raise ValueError(f'EngineConfig.sync_every={self.sync_every} must be >= 0, or -1 (auto)')
    if self.decode_attention not in paged_attention.IMPLEMENTATIONS:
      raise ValueError(f'EngineConfig.decode_attention={self.decode_attention!r} is not one of '
                       f'{paged_attention.IMPLEMENTATIONS}')

  @property
  def table_width(self) -> int:
    """Block-table entries of a slot: pages of one sequence at max_seq_len."""
    return -(-self.max_seq_len // self.page_size)


class Slots(NamedTuple):
  """Per-slot decode inputs, [H] each (rng: [H, 2] raw keys)."""
  tokens: jax.Array       # int32 next input: last prompt token or last sample
  positions: jax.Array    # int32 position of that input; the pool holds 0..position-1
  rng: jax.Array          # uint32 key of the request in the slot, from its seed
  steps: jax.Array        # int32 tokens sampled so far; folded into rng for the next draw
  temperature: jax.Array  # fp32
  top_k: jax.Array        # int32, 0 = off
  top_p: jax.Array        # fp32, 1.0 = off
  stops: jax.Array        # [H, Ks] int32: a hybrid's stop ids (-1: none), a slot that draws one
                          # parks itself; Ks = 0 for other models


class DecodeState(NamedTuple):
  pool: paged_attention.PagedKVCache  # [La, A, K, Z, Dh]: the attention layers'
  slots: Slots
  linear: slot_state.StateStore | None  # a hybrid's linear layers' states


class Chunk(NamedTuple):
  """R context chunks to write into the pool, padded to T positions: four host arrays (each is
  one transfer in the call). Row r writes positions start..start+n-1; a row whose chunk ends its
  context also readies its slot (H for none: the write is dropped). Padding rows and columns sit
  at PARKED, past every table: they write to the trash page."""
  tokens: jax.Array        # [R, T] int32
  table: jax.Array         # [R, W] int32 the row's block table
  ints: jax.Array          # [R, CHUNK_INTS] int32, the columns below
  floats: jax.Array        # [R, 2] fp32: temperature, top-p


# Chunk.ints' columns: the chunk's first position and length; the slot it readies; the
# sequence's last token (its first decode input) and that token's position (the context
# length); the request seed's high and low words (uint32 bits); tokens already generated; top-k;
# where a hybrid's state starts and the slot it goes to (`slot_state.starting`, `write`); from
# STOPS on, the Ks stop ids of the slot it readies.
(START, LENGTH, SLOT, LAST_TOKEN, NEXT_POSITION, SEED_HI, SEED_LO, STEPS, TOP_K, STATE_FROM,
 STATE_TO, STOPS) = range(12)


def chunk_positions(chunk: Chunk) -> jax.Array:
  """[R, T] int32: each row's positions, PARKED past its length."""
  col_T = jnp.arange(chunk.tokens.shape[1], dtype=jnp.int32)
  start_Rx1, length_Rx1 = chunk.ints[:, START, None], chunk.ints[:, LENGTH, None]
  return jnp.where(col_T[None] < length_Rx1, start_Rx1 + col_T[None], PARKED)


def init_state(config: transformer.ModelConfig, num_slots: int, num_pages: int, page_size: int,
               *, stop_width: int = 0, saved_states: int = 0) -> DecodeState:
  """An all-zero pool and linear states; every slot parked. `stop_width`: Ks; `saved_states`:
  a hybrid's saved rows (M)."""
  h = num_slots
  key_shape = jax.random.PRNGKey(0).shape
  slots = Slots(tokens=jnp.zeros((h,), jnp.int32), positions=jnp.full((h,), PARKED, jnp.int32),
                rng=jnp.zeros((h, *key_shape), jnp.uint32), steps=jnp.zeros((h,), jnp.int32),
                temperature=jnp.ones((h,), jnp.float32), top_k=jnp.zeros((h,), jnp.int32),
                top_p=jnp.ones((h,), jnp.float32),
                stops=jnp.full((h, stop_width), -1, jnp.int32))
  pool = paged_attention.init_pool(len(config.attention_layers), num_pages, config.num_kv_heads,
                                   page_size, config.head_dim, config.dtype)
  return DecodeState(pool, slots, slot_state.init(config, h, saved_states))


def request_key(seed_2: jax.Array) -> jax.Array:
  """A request's key depends on its seed only, not on its slot or arrival order."""
  base = jax.random.PRNGKey(0)
  return jax.random.fold_in(jax.random.fold_in(base, seed_2[0]), seed_2[1])


@functools.partial(jax.jit, static_argnames=('config', 'fresh'), donate_argnames=('state',))
def prefill(params, state: DecodeState, chunk: Chunk, *, config: transformer.ModelConfig,
            fresh: bool = False) -> DecodeState:
  """Writes each row's chunk into the pool; readies the slots of rows that end a context.

  `fresh`: every chunk starts at position 0, so it attends only to itself: it runs over a dense
  cache of its own T positions (T x T scores, not T x W * Z) and then goes to its pages (and a
  hybrid's linear layers start from zeros).
  """
  TRACES['prefill'] += 1
  # The hidden states are not used, so no logits are made.
  positions_RxT = chunk_positions(chunk)
  ints = chunk.ints
  if fresh:
    n, t = chunk.tokens.shape
    _, own = transformer.decode(params, config, chunk.tokens, positions_RxT,
                                transformer.init_cache(config, n, t))  # padding: dropped
    linear_R = own.linear
    page_RxT, offset_RxT = paged_attention.locate(chunk.table, positions_RxT,
                                                  state.pool.k.shape[3])
    to_pages = lambda pool_LxAxKxZxDh, own_LxRxTxKxDh: pool_LxAxKxZxDh.at[
        :, page_RxT, :, offset_RxT].set(own_LxRxTxKxDh.transpose(1, 2, 0, 3, 4))
    pool = paged_attention.PagedKVCache(to_pages(state.pool.k, own.k),
                                        to_pages(state.pool.v, own.v))
  else:  # chunks of several positions read through the XLA gather (the kernels serve T = 1)
    xla = dataclasses.replace(config, decode_attention='xla')
    start_R = (None if state.linear is None
               else slot_state.starting(state.linear, ints[:, STATE_FROM]))
    _, pool, linear_R, _ = transformer.decode_paged(params, xla, chunk.tokens, positions_RxT,
                                                    state.pool, chunk.table, start_R)
  linear = (state.linear if linear_R is None
            else slot_state.write(state.linear, ints[:, STATE_TO], linear_R))
  seeds_Rx2 = jax.lax.bitcast_convert_type(ints[:, SEED_HI:SEED_LO + 1], jnp.uint32)
  rows = Slots(tokens=ints[:, LAST_TOKEN], positions=ints[:, NEXT_POSITION],
               rng=jax.vmap(request_key)(seeds_Rx2), steps=ints[:, STEPS],
               temperature=chunk.floats[:, 0], top_k=ints[:, TOP_K], top_p=chunk.floats[:, 1],
               stops=ints[:, STOPS:])
  slots = jax.tree.map(lambda all_H, new_R: all_H.at[ints[:, SLOT]].set(new_R, mode='drop'),
                       state.slots, rows)
  return DecodeState(pool, slots, linear)


@functools.partial(jax.jit, static_argnames=('config', 'filtered'), donate_argnames=('state',))
def decode_step(params, state: DecodeState, table_HxW: jax.Array, *,
                config: transformer.ModelConfig, filtered: bool
                ) -> tuple[DecodeState, jax.Array]:
  """One token for every slot: returns (state, drawn [2 + Ls·Xk, H] int32): the tokens, their
  log mu as the bits of an fp32, and for an MoE model each slot's experts in its Ls MoE layers
  (`unpack_drawn`), so the host fetches one array per step.

  A slot reads the first W entries of its table row (W = table_HxW's width). The head multiplies
  in the model's dtype with fp32 accumulation (bf16 on GPUs: the weights are read once, in half
  the bytes); sampling is in fp32. `filtered` compiles top-k / top-p in.
  """
  TRACES['decode_step'] += 1
  s = state.slots
  h_Hx1xD, pool, linear_H, experts_LsxHx1xXk = transformer.decode_paged(
      params, config, s.tokens[:, None], s.positions[:, None], state.pool, table_HxW,
      None if state.linear is None else state.linear.slots)
  logits_HxV = transformer.logits(params, config, h_Hx1xD, fp32_head=False)[:, 0]
  keys_H = jax.vmap(jax.random.fold_in)(s.rng, s.steps)
  if filtered:
    tokens_H, logprobs_H = sampling.sample(keys_H, logits_HxV, s.temperature, s.top_k, s.top_p)
  else:
    tokens_H, logprobs_H = sampling.sample(keys_H, logits_HxV, s.temperature)
  positions_H = jnp.minimum(s.positions + 1, PARKED)
  if s.stops.shape[1]:  # a hybrid: a slot that drew a stop id runs no further token
    positions_H = jnp.where(jnp.any(tokens_H[:, None] == s.stops, axis=1), PARKED, positions_H)
  slots = s._replace(tokens=tokens_H, positions=positions_H, steps=s.steps + 1)
  drawn = jnp.stack([tokens_H, jax.lax.bitcast_convert_type(logprobs_H, jnp.int32)])
  if experts_LsxHx1xXk is not None:
    h = tokens_H.shape[0]
    experts = experts_LsxHx1xXk[:, :, 0].transpose(0, 2, 1).reshape(-1, h).astype(jnp.int32)
    drawn = jnp.concatenate([drawn, experts])
  linear = state.linear if linear_H is None else state.linear._replace(slots=linear_H)
  return DecodeState(pool, slots, linear), drawn


def unpack_drawn(drawn: np.ndarray, config: transformer.ModelConfig
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """A decode step's output on the host: (tokens [H] int32, log mu [H] fp32, routes
  [H, Ls, Xk] in `moe.route_dtype`, or None for a dense model)."""
  routes = None
  if config.is_moe:
    h = drawn.shape[1]
    routes = drawn[2:].reshape(len(config.moe_layers), config.num_experts_per_tok, h)
    routes = routes.transpose(2, 0, 1).astype(moe_lib.route_dtype(config.num_experts))
  return drawn[0], drawn[1].view(np.float32), routes


@functools.partial(jax.jit, static_argnames=('scale', 'dtype'))
def serve_adapters(adapters, *, scale: float, dtype):
  """A and s B in `dtype`: what `lora.variables` and `lora.Dense` make of the adapters at every
  step (s B in the adapters' dtype, then both cast), made once; served with scale 1."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: (x * scale if p[-1].key == 'b' else x).astype(dtype), adapters)


@jax.jit
def _cast_floats(params, dtype_like):
  return jax.tree.map(lambda x: x.astype(dtype_like.dtype)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def _layout_mismatch(new, old) -> str | None:
  """Why pytree `new` cannot replace `old` (other leaves, shapes or dtypes), or None."""
  new_paths = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(new)}
  old_paths = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(old)}
  if new_paths.keys() != old_paths.keys():
    missing, extra = sorted(old_paths.keys() - new_paths), sorted(new_paths.keys() - old_paths)
    return f'leaves missing {missing[:3]}, unexpected {extra[:3]}'
  for path, x in new_paths.items():
    want = old_paths[path]
    if x.shape != want.shape or x.dtype != want.dtype:
      return f'{path} is {x.dtype}{list(x.shape)}, expected {want.dtype}{list(want.shape)}'
  return None


# ---------------------------------------------------------------------------------------------
# The mutable shell.


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _seed_words(seed: int) -> tuple[int, int]:
  seed %= 1 << 64  # negative or wide seeds (e.g. hash()) are fine
  return seed >> 32, seed & 0xFFFFFFFF


@dataclasses.dataclass(eq=False)
class _Prefix:
  """The full pages of a prompt's context, written once under `version` by `writer`; valid for
  new readers while anyone still holds them."""
  key: tuple[int, ...]
  pages: list[int]
  version: int
  writer: '_Sequence'
  ready: bool = False   # the writer's prefill of these pages is dispatched
  holders: int = 0
  state_row: int | None = None  # a hybrid's: the saved row of the state after these pages


class _Held(NamedTuple):
  """A finished turn that an episode may continue: the pool holds the KV of all its tokens but
  the last in `pages`; a hybrid's saved row `state_row` holds its state after them."""
  seq: '_Sequence'
  pages: list[int]
  state_row: int | None


@dataclasses.dataclass(eq=False)
class _Sequence(api.SequenceRecord):
  """A request in the engine: its tokens so far and where it stands. While it sits in a slot,
  the engine's per-slot arrays hold its position and the steps it still needs."""
  stop_ids: frozenset[int] = frozenset()
  max_tokens: int = 0
  filtered: bool = False          # top-k / top-p
  # Constants of the request, computed once (admission reads them for every waiting sequence):
  prompt_len: int = 0
  prompt_pages: int = 0           # full pages of the prompt's context: what samples can share
  last_needed: int = 0            # the input position of the step that draws its last token
  order: int = 0                  # admission order (the youngest is preempted first)
  slot: int | None = None
  pages: list[int] = dataclasses.field(default_factory=list)  # its block table
  prefix: _Prefix | None = None
  context: list[int] = dataclasses.field(default_factory=list)  # (prompt + tokens)[:-1]
  loaded: int = 0                 # context positions whose prefill is dispatched
  # A hybrid's: where the state its next chunk starts from is (`slot_state.starting`), and the
  # saved row it owns until that chunk has read it (a continued turn's).
  state_from: int = slot_state.FRESH
  owned_row: int | None = None
  decoding: bool = False
  first_step: int = 0             # tokens of earlier decode steps are not its own (any more)
  done: bool = False

  __eq__ = object.__eq__  # identity, as the host's bookkeeping means it
  __hash__ = object.__hash__


class _Dispatched(NamedTuple):
  drawn: jax.Array          # tokens, log mu (and routes): `unpack_drawn`
  slots: list[int]          # the slots that decoded in it
  seqs: list                # the sequence in each of them
  index: int                # decode steps dispatched before it
  version: int


class JaxEngine(api.QueuedEngine):
  """In-process engine over `transformer.decode_paged`; one actor thread calls `step()`, any
  thread may call `submit` and `update_params`.

  `device` (a `jax.Device` or a `Sharding` valid for every leaf, e.g. replicated) places params
  and the decode state, so generation can run on other devices than training; the jitted steps
  follow their inputs. Params put on another device are copied there; on the same device they
  are kept as given when they are in the model's dtype (see the ownership contract of
  `api.Engine.update_params`), else cast to it once per update (the engine computes in it).
  """

  def __init__(self, model_config: transformer.ModelConfig, params: Any,
               config: EngineConfig = EngineConfig(), *, version: int = 0, device: Any = None):
    super().__init__(version)
    self.model_config = dataclasses.replace(model_config,
                                            decode_attention=config.decode_attention)
    self.config = config
    self._device = device
    self._sync_every = config.sync_every if config.sync_every >= 0 else (
        1 if self._platform() == 'cpu' else SYNC_EVERY)
    # Decode steps that may be dispatched before the next collection, the current one
    # included: pages for them are reserved at each collection.
    self._lookahead = max(1, self._sync_every) + 1
    # LoRA: the scale, and the adapters' layout as updates bring them (served, they are cast).
    self._lora_scale = params.scale if isinstance(params, lora_lib.Adapted) else None
    self._adapter_layout = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         params.adapters) if self._lora_scale else None)
    self._params = self._serving(self._place(params))
    self._pages = paging.PagePool(self._pool_size())
    h = config.num_slots
    # A hybrid's saved states (shared prompts, held turns), the copies into them not yet
    # dispatched ((slot, row): before the next prefill, which may load another sequence into
    # the slot), and the stop ids its slots park on.
    self._hybrid = self.model_config.is_hybrid
    self._saved = slot_state.SavedRows(budget.saved_states(h) if self._hybrid else 0)
    self._saves: list[tuple[int, int]] = []
    self._stop_width = (_pow2_at_least(max(1, len(config.eos_token_ids))) if self._hybrid
                        else 0)
    self._state = self._place(init_state(
        self.model_config, h, self._pages.num_pages, config.page_size,
        stop_width=self._stop_width, saved_states=self._saved.num_rows))
    self._slots: list[_Sequence | None] = [None] * h
    self._loading: list[_Sequence] = []   # in a slot, their context not all prefilled yet
    # Per slot, for the sequence decoding there (the host's mirror of the device): the
    # position of its next input, decode steps still to dispatch (0: none), the input position
    # of its last step, pages held.
    self._pos = np.zeros(h, np.int64)
    self._left = np.zeros(h, np.int64)
    self._last = np.zeros(h, np.int64)
    self._npages = np.zeros(h, np.int64)
    # ... and the position from which its next `lookahead` steps need a page it does not hold
    # (NEVER when no step does, or the slot is not decoding): `_reserve` compares only this.
    self._grow = np.full(h, NEVER, np.int64)
    self._filtered = 0                    # decoding sequences with top-k / top-p
    # Not in a slot yet: preempted ones (oldest first), then requests taken from the queue.
    self._waiting: collections.deque[_Sequence] = collections.deque()
    self._prefixes: dict[tuple[int, ...], _Prefix] = {}
    # Finished continuable requests by request id, oldest first.
    self._held: dict[str, _Held] = {}
    self._pending: list[_Dispatched] = []
    self._dispatched = 0
    self._table = np.zeros((h, config.table_width), np.int32)
    # Read width -> the decode table as last passed: a host copy in the step after it changed
    # (the call transfers it), then on the device.
    self._table_dev: dict[int, np.ndarray | jax.Array] = {}
    self._admitted = 0
    self._collected = True  # a collection happened since pages were last reserved
    self._next_params: tuple[Any, int] | None = None
    self._to_release: list[str] = []  # request ids `release`d since the last step
    self._lock = threading.Lock()  # guards _next_params and _to_release
    self._closed = False
    self._counts = collections.Counter()
    self._step_seconds = 0.0

  def _place(self, tree):
    return tree if self._device is None else jax.device_put(tree, self._device)

  def _first_device(self):
    if self._device is None:
      return jax.devices()[0]
    return self._device if isinstance(self._device, jax.Device) else next(
        iter(self._device.device_set))

  def _platform(self) -> str:
    return self._first_device().platform

  def _serving(self, params):
    dtype = jnp.dtype(self.model_config.dtype)
    if isinstance(params, lora_lib.Adapted):
      return lora_lib.Adapted(self._serving(params.base),
                              serve_adapters(params.adapters, scale=params.scale, dtype=dtype),
                              1.0)
    if all(x.dtype == dtype for x in jax.tree.leaves(params)
           if jnp.issubdtype(x.dtype, jnp.floating)):
      return params
    return _cast_floats(params, jnp.zeros((), dtype))

  def _pool_size(self) -> int:
    """`num_pages`, or the budget's rule on this engine's device; for the cuDNN read, rounded up
    to a multiple of the table width's power of two (it needs the pool to split into whole
    tables: `paged_attention.cudnn_table_width`)."""
    c, m = self.config, self.model_config
    pages = c.num_pages
    if not pages:
      stats = self._first_device().memory_stats() or {}
      free = (stats['bytes_limit'] - stats.get('bytes_in_use', 0)
              if stats.get('bytes_limit') else None)
      pages = budget.kv_pool_pages(
          num_slots=c.num_slots, max_seq_len=c.max_seq_len, page_size=c.page_size,
          page_bytes=budget.kv_page_bytes(len(m.attention_layers), m.num_kv_heads, m.head_dim,
                                          c.page_size, m.dtype),
          pool_mb=c.pool_mb, free_bytes=free)
    if c.decode_attention != 'cudnn':
      return pages
    w = _pow2_at_least(c.table_width)
    return -(-pages // w) * w

  # --- api.Engine ------------------------------------------------------------------------------

  def submit(self, request: api.Request) -> None:
    self._check_open()
    api.check_request(request, max_len=self.config.max_seq_len,
                      max_len_field='max_seq_len',
                      vocab_size=self.model_config.vocab_size)
    needed = ((len(request.prompt_tokens) + request.sampling.max_tokens - 2)
              // self.config.page_size + 1)  # pages through its last input position
    if needed > self._pages.num_pages - 1:
      raise ValueError(f'request {request.request_id!r}: prompt {len(request.prompt_tokens)} + '
                       f'max_tokens {request.sampling.max_tokens} needs {needed} KV pages of '
                       f'{self.config.page_size}; the pool has {self._pages.num_pages - 1} '
                       '(generation.kv_pool_mb)')
    self._requests.submit(request)

  def update_params(self, params: Any, version: int) -> None:
    """New params; an engine serving adapters (`lora.Adapted`) takes new adapters alone, checked
    against the ones it serves, and keeps its base."""
    self._check_open()
    served = self._params
    if self._lora_scale is not None and not isinstance(params, lora_lib.Adapted):
      problem = _layout_mismatch(params, self._adapter_layout)
      if problem:
        raise ValueError(f'adapter update to version {version} rejected: {problem}')
      placed = lora_lib.Adapted(served.base, self._place(params), self._lora_scale)
    else:
      placed = self._place(params)
    with self._lock:
      self._next_params = (placed, version)

  def step(self) -> list[api.Completion]:
    self._check_open()
    start = time.perf_counter()
    if self._to_release:
      self._release_held()
    finished = self._apply_update()
    if len(self._pending) > self._sync_every:
      finished += self._collect(keep_newest=True)
    if self._collected:
      self._reserve()
    if self._waiting or self._requests.num_pending:
      self._admit()
    if self._loading:
      self._load()
    if (not self._dispatch() or not self._sync_every) and self._pending:
      finished += self._collect(keep_newest=False)  # nothing left to overlap with
    self._step_seconds += time.perf_counter() - start
    return finished

  def abort(self, request_ids) -> None:
    """Drops requests, pending or in flight, without a completion; their pages return. Call it
    from the thread that calls `step()`."""
    self._check_open()
    ids = set(request_ids)
    self._waiting = collections.deque(s for s in self._waiting if s.request.request_id not in ids)
    for seq in list(self._slots):
      if seq is not None and seq.request.request_id in ids:
        seq.done = True
        self._release_pages(seq)
    for d in self._pending:  # sequences whose last token is in flight hold no slot any more
      for seq in d.seqs:
        if seq.request.request_id in ids:
          seq.done = True
    for request_id in ids & self._held.keys():
      self._drop_held(request_id)
    self._requests.discard(ids)
    self._counts['aborted'] += len(ids)

  def stats(self) -> dict[str, Any]:
    busy = sum(s is not None for s in self._slots)
    pending = self._requests.num_pending + len(self._waiting)
    tokens = self._counts['tokens_generated']
    return dict(self._counts, tokens_generated=tokens,
                tokens_per_s=tokens / self._step_seconds if self._step_seconds else 0.0,
                step_seconds=self._step_seconds, busy_slots=busy, num_slots=len(self._slots),
                pending=pending, version=self._version, kv_pages=self._pages.num_pages - 1,
                kv_pages_free=self._pages.num_free, kv_pages_peak=self._pages.peak_in_use,
                kv_pages_held=sum(len(h.pages) for h in self._held.values()),
                kv_page_size=self.config.page_size, sync_every=self._sync_every,
                saved_states=self._saved.num_rows, saved_states_free=self._saved.num_free)

  def precompile(self) -> int:
    """Compiles the decode step (unfiltered) for every read width it may use, so no token step
    compiles later; needs an idle engine (its free slots write only to the trash page). Returns
    how many widths."""
    self._check_open()
    if any(s is not None for s in self._slots) or self._pending or self._waiting:
      raise RuntimeError('precompile needs an idle engine')
    c = self.config
    if c.decode_attention == 'xla':
      widths = sorted({self._width(p) for p in range(1, c.table_width + 1)})
    else:
      widths = [c.table_width]
    for w in widths:
      table = self._place(jnp.zeros((c.num_slots, w), jnp.int32))
      self._state, _ = decode_step(self._params, self._state, table,
                                   config=self.model_config, filtered=False)
    jax.block_until_ready(self._state)
    return len(widths)

  def release(self, request_id: str) -> None:
    """Frees the pages a finished continuable request holds (its episode ended), at the next
    `step()`; safe to call from any thread (a generator actor's pool calls it from another)."""
    self._check_open()
    with self._lock:
      self._to_release.append(request_id)

  def close(self) -> None:
    self._closed = True
    self._params = self._state = self._next_params = None
    self._slots = [None] * self.config.num_slots
    self._pending, self._table_dev, self._prefixes, self._loading = [], {}, {}, []
    self._held, self._saves = {}, []
    self._waiting.clear()
    self._requests.clear()

  # --- internals -------------------------------------------------------------------------------

  def _check_open(self):
    if self._closed:
      raise RuntimeError('engine is closed')

  def _pages_through(self, position: int) -> int:
    """Pages a sequence needs to hold positions 0..position."""
    return position // self.config.page_size + 1

  def _apply_update(self) -> list[api.Completion]:
    with self._lock:
      update, self._next_params = self._next_params, None
    if update is None:
      return []
    params, version = update
    if any(x.is_deleted() for x in jax.tree.leaves(params) if isinstance(x, jax.Array)):
      raise RuntimeError(f'params of version {version} were deleted after being published '
                         '(donated?); publish a copy the trainer will not donate')
    self._params, self._version = self._serving(params), version
    self._counts['updates'] += 1
    self._prefixes = {}  # pages written under the old params are no prefix for new requests
    if not self.config.recompute_kv:
      return []
    for request_id in list(self._held):  # their KV is the old params'
      self._drop_held(request_id)
    finished = self._collect(keep_newest=False)
    placed = sorted(((s.slot, s) for s in self._slots if s is not None),
                    key=lambda slot_seq: slot_seq[1].order)
    for _, seq in placed:
      self._release_pages(seq)
    for slot, seq in placed:  # loaded again in the same slots, under the new params
      self._place_sequence(seq, slot, self._usable_prefix(seq))
    self._counts['kv_recomputes'] += len(placed)
    return finished

  # Slots and pages.

  def _place_sequence(self, seq: _Sequence, slot: int, prefix: _Prefix | None,
                      held: tuple[_Held, int] | None = None) -> None:
    """Gives `seq` the slot and pages to load its context and decode `lookahead` steps (the
    caller has checked there are enough free pages), sharing its prompt's pages (and a hybrid's
    state after them) when `prefix` (`_usable_prefix`) is given, or taking over the previous
    turn's (held turn, positions its pages hold) when `held` (`_held_for`) is."""
    context = list(seq.request.prompt_tokens)
    context += seq.tokens
    context.pop()
    seq.context, position = context, len(context)
    seq.slot, seq.decoding, seq.first_step = slot, False, self._dispatched
    last_needed = seq.last_needed
    last = min(position + self._lookahead - 1, last_needed)
    seq.state_from = slot_state.FRESH
    if held is not None:
      entry, loaded = held
      del self._held[seq.request.continues]
      total = self._pages_through(last)
      self._pages.release(entry.pages[total:])  # (pages it reserved for steps it never took)
      seq.pages = entry.pages[:total] + self._pages.take(max(0, total - len(entry.pages)))
      seq.loaded = loaded
      if entry.state_row is not None:
        seq.state_from, seq.owned_row = self._saved_address(entry.state_row), entry.state_row
      self._counts['kv_held_reused'] += 1
      self._counts['kv_held_positions_reused'] += loaded
    elif prefix is None:
      seq.pages, seq.loaded = self._pages.take(last // self.config.page_size + 1), 0
    else:
      shared = prefix.pages
      self._pages.share(shared)
      prefix.holders += 1
      self._counts['prompt_pages_shared'] += len(shared)
      seq.pages = shared + self._pages.take(self._pages_through(last) - len(shared))
      seq.loaded = len(shared) * self.config.page_size
      if prefix.state_row is not None:
        seq.state_from = self._saved_address(prefix.state_row)
    if prefix is None and seq.prompt_pages and seq.request.continues is None:
      # A hybrid's samples also need the state after the shared pages: a saved row, if one is
      # free (else no sharing: each sample loads its whole prompt).
      row = self._saved.take() if self._hybrid else None
      if row is not None or not self._hybrid:
        prefix = _Prefix(key=tuple(seq.request.prompt_tokens),
                         pages=seq.pages[:seq.prompt_pages], version=self._version, writer=seq,
                         holders=1, state_row=row)
        self._prefixes[prefix.key] = prefix
    seq.prefix = prefix
    self._slots[slot] = seq
    self._loading.append(seq)
    self._pos[slot], self._last[slot] = position, last_needed
    self._left[slot], self._npages[slot], self._grow[slot] = 0, len(seq.pages), NEVER

  def _new_sequence(self, request: api.Request, eos: frozenset[int]) -> _Sequence:
    sp, n = request.sampling, len(request.prompt_tokens)
    stop_ids = eos.union(sp.stop_token_ids) if sp.stop_token_ids else eos
    if len(stop_ids) > self._stop_width and self._hybrid:
      self._widen_stops(len(stop_ids))
    return _Sequence(
        request, stop_ids=stop_ids,
        max_tokens=sp.max_tokens, filtered=sp.top_k > 0 or sp.top_p < 1.0, prompt_len=n,
        prompt_pages=(n - 1) // self.config.page_size if self.config.share_prompts else 0,
        last_needed=n + sp.max_tokens - 2)

  def _usable_prefix(self, seq: _Sequence) -> _Prefix | None:
    # (`prompt_pages` is 0 without `share_prompts`; a history is no other sequence's prompt)
    if not seq.prompt_pages or seq.request.continues is not None:
      return None
    prefix = self._prefixes.get(tuple(seq.request.prompt_tokens))
    if prefix is None or prefix.version != self._version or prefix.holders == 0:
      return None
    return prefix

  def _widen_stops(self, n: int) -> None:
    """Room for `n` stop ids per slot on the device (the next prefill and decode compile once)."""
    width = _pow2_at_least(n)
    stops = self._state.slots.stops
    stops = jnp.pad(stops, ((0, 0), (0, width - stops.shape[1])), constant_values=-1)
    self._state = self._state._replace(slots=self._state.slots._replace(stops=stops))
    self._stop_width = width

  def _saved_address(self, row: int) -> int:
    """Where `slot_state.starting` finds saved row `row`."""
    return self.config.num_slots + row

  def _held_for(self, seq: _Sequence) -> tuple[_Held, int] | None:
    """(the held turn `seq` continues, positions whose KV its pages hold), when the engine holds
    it and its tokens are a prefix of `seq`'s history; a mismatch frees it (whole prefill)."""
    entry = self._held.get(seq.request.continues) if seq.request.continues else None
    if entry is None or seq.tokens:  # (a preempted continuation loads again from scratch)
      return None
    previous = entry.seq
    history = list(previous.request.prompt_tokens) + previous.tokens
    valid = len(history) - 1  # the last token was never an input
    prompt = seq.request.prompt_tokens
    if len(prompt) <= valid or list(prompt[:valid]) != history[:valid]:
      self._drop_held(seq.request.continues)
      self._counts['kv_held_mismatch'] += 1
      return None
    return entry, valid

  def _release_held(self) -> None:
    with self._lock:
      ids, self._to_release = self._to_release, []
    for request_id in ids:
      if request_id in self._held:
        self._drop_held(request_id)
        self._counts['kv_held_released'] += 1

  def _drop_held(self, request_id: str) -> None:
    entry = self._held.pop(request_id)
    self._pages.release(entry.pages)
    if entry.state_row is not None:
      self._saved.release(entry.state_row)

  def _hold(self, seq: _Sequence) -> bool:
    """Keeps a finished continuable turn's pages (and a hybrid's state, copied into a saved row
    before the slot is loaded again; the oldest held turn gives up its row when none is free).
    False when a hybrid's state finds no row: the turn keeps nothing."""
    row = None
    if self._hybrid:
      row = self._saved.take()
      if row is None and self._held:  # (a hybrid's held turns all hold a row)
        self._drop_held(next(iter(self._held)))
        self._counts['kv_held_evicted'] += 1
        row = self._saved.take()
      if row is None:
        return False
      self._saves.append((seq.slot, row))
    self._held[seq.request.request_id] = _Held(seq, seq.pages, row)
    return True

  def _evict_held(self, num_free: int, keep: str | None = None) -> None:
    """Frees held pages, oldest first (but `keep`'s), until `num_free` pages are free."""
    for request_id in list(self._held):
      if self._pages.num_free >= num_free:
        return
      if request_id != keep:
        self._drop_held(request_id)
        self._counts['kv_held_evicted'] += 1

  def _start_decoding(self, seq: _Sequence) -> None:
    """Its context is in (prefill dispatched): it decodes from the next step on."""
    slot = seq.slot
    seq.decoding = True
    self._loading.remove(seq)
    self._left[slot] = seq.max_tokens - len(seq.tokens)
    held = len(seq.pages) * self.config.page_size  # positions its pages hold
    self._grow[slot] = held - (self._lookahead - 1) if seq.last_needed >= held else NEVER
    self._filtered += seq.filtered
    self._table[slot] = paged_attention.TRASH_PAGE
    self._table[slot, :len(seq.pages)] = seq.pages
    self._table_dev = {}

  def _release_pages(self, seq: _Sequence, drop_in_flight: bool = True,
                     finished: bool = False) -> None:
    """Returns the sequence's pages and slot. Tokens of its steps still in flight are dropped
    (it will decode them again), unless `drop_in_flight` is False (they are its last ones).
    A `finished` continuable sequence keeps its pages in `_held` instead (after its prompt's
    saved state, if it was the last to hold it, is given back: room for its own)."""
    if seq.owned_row is not None:  # (preempted or aborted before its first chunk read it)
      self._saved.release(seq.owned_row)
      seq.owned_row = None
    prefix, seq.prefix = seq.prefix, None
    if prefix is not None:
      prefix.holders -= 1
      if prefix.holders == 0:
        if self._prefixes.get(prefix.key) is prefix:
          del self._prefixes[prefix.key]
        if prefix.state_row is not None:
          self._saved.release(prefix.state_row)
      if prefix.writer is seq and not prefix.ready:  # aborted while loading: a reader writes
        heirs = [s for s in self._loading if s.prefix is prefix and s is not seq]
        if heirs:
          prefix.writer, heirs[0].loaded = heirs[0], 0
          heirs[0].state_from = slot_state.FRESH
    if not (finished and seq.request.continuable and self._hold(seq)):
      self._pages.release(seq.pages)
    seq.pages = []
    slot = seq.slot
    if slot is not None:
      if self._slots[slot] is seq:
        self._slots[slot] = None
      if seq.decoding:
        self._filtered -= seq.filtered
        self._table[slot] = paged_attention.TRASH_PAGE
        self._table_dev = {}
      else:
        self._loading.remove(seq)
      self._left[slot] = self._npages[slot] = 0
      self._grow[slot] = NEVER
    seq.slot, seq.decoding = None, False
    if drop_in_flight:
      seq.first_step = self._dispatched

  def _reserve(self) -> None:
    """Pages for the next `lookahead` steps of every decoding sequence; when the pool is short,
    the youngest decoding sequences wait (their pages return; they are loaded again later)."""
    self._collected = False
    short = self._pos >= self._grow
    if not short.any():
      return
    need = np.minimum(self._pos + (self._lookahead - 1), self._last) // self.config.page_size
    slots = np.flatnonzero(short)
    missing = need[slots] + 1 - self._npages[slots]
    if missing.sum() > self._pages.num_free:
      self._evict_held(int(missing.sum()))
    if missing.sum() > self._pages.num_free:
      by_age = sorted(range(len(slots)), key=lambda j: self._slots[slots[j]].order)
      while by_age and missing.sum() > self._pages.num_free:
        j = by_age.pop()
        victim = self._slots[slots[j]]
        self._release_pages(victim)
        self._waiting.appendleft(victim)
        self._counts['preemptions'] += 1
        missing[j] = 0
    z, lookahead = self.config.page_size, self._lookahead
    for slot, n in zip(slots[missing > 0].tolist(), missing[missing > 0].tolist()):
      seq = self._slots[slot]
      seq.pages += self._pages.take(n)
      self._table[slot, :len(seq.pages)] = seq.pages
      self._npages[slot] = len(seq.pages)
      held = len(seq.pages) * z
      self._grow[slot] = held - (lookahead - 1) if seq.last_needed >= held else NEVER
      self._table_dev = {}

  def _admit(self) -> None:
    """Waiting sequences (preempted first, then new requests, in order) into free slots while
    the pool has their pages, keeping a page of growth for every `page_size` decode steps of the
    sequences in flight. A request that does not fit waits; nothing behind it overtakes it."""
    free = [i for i, s in enumerate(self._slots) if s is None]
    decoding = int(np.count_nonzero(self._left))
    reserve = -(-decoding * self._lookahead // self.config.page_size)
    eos = frozenset(self.config.eos_token_ids)
    waiting, page_size, lookahead = self._waiting, self.config.page_size, self._lookahead
    free.reverse()  # popped from the end: lowest slots first
    while free:
      if not waiting:
        new = self._requests.take(len(free))
        if not new:
          return
        waiting.extend(self._new_sequence(r, eos) for r in new)
      seq = waiting[0]
      last = min(seq.prompt_len + len(seq.tokens) - 2 + lookahead, seq.last_needed)
      need = last // page_size + 1  # pages through `last`
      prefix = self._usable_prefix(seq) if seq.prompt_pages else None
      if prefix is not None:
        need -= len(prefix.pages)
      held = self._held_for(seq) if seq.request.continues is not None else None
      if held is not None:
        need = max(0, need - len(held[0].pages))
      if need > self._pages.num_free - reserve:
        self._evict_held(need + reserve, keep=seq.request.continues)
        held = self._held_for(seq)  # (still there: kept)
        if need > self._pages.num_free - reserve:
          return
      waiting.popleft()
      self._admitted += 1
      seq.order = self._admitted
      self._place_sequence(seq, free.pop(), prefix, held)

  # Prefill.

  def _bucket_len(self, n: int) -> int:
    return min(max(self.config.min_prefill_len, _pow2_at_least(n)), self.config.max_seq_len)

  def _width(self, pages: int) -> int:
    """Table entries a call reads: a power-of-two bucket of `pages` (at least
    MIN_READ_POSITIONS), at most the whole table."""
    least = -(-MIN_READ_POSITIONS // self.config.page_size)
    return min(_pow2_at_least(max(pages, least)), self.config.table_width)

  def _load(self) -> None:
    """Dispatches prefill chunks for the sequences being loaded, oldest first, within
    `prefill_token_budget` positions (one chunk per sequence per step when chunked); a reader of
    a shared prompt waits until the prompt's writer has dispatched those pages. A hybrid's
    writer loads the shared pages as a chunk of their own (the state after them is saved)."""
    c = self.config
    budget_left = c.prefill_token_budget
    served = set()  # sequences given a chunk in this step
    while self._loading:
      rows = []
      for seq in sorted(self._loading, key=lambda s: s.order):
        if seq.prefix is not None and seq.prefix.writer is not seq and not seq.prefix.ready:
          continue  # its prompt's pages are not written yet
        if c.prefill_chunk and seq in served:
          continue
        n = len(seq.context) - seq.loaded  # 0: only its slot is to be readied
        if c.prefill_chunk:
          n = min(n, c.prefill_chunk)
        if self._hybrid and seq.prefix is not None and not seq.prefix.ready:  # (the writer)
          n = min(n, len(seq.prefix.pages) * c.page_size - seq.loaded)
        t = self._bucket_len(max(n, 1))
        if t > budget_left and (rows or served):  # the first row of a step always goes
          break
        rows.append((seq, n, t))
        budget_left -= t
        served.add(seq)
      if not rows:
        return
      self._prefill_rows(rows)

  def _prefill_rows(self, rows) -> None:
    """One prefill call per length bucket, fresh contexts apart (rows padded to a power of
    two); updates each sequence's progress, marks prompt pages ready and starts sequences whose
    context is in."""
    groups = collections.defaultdict(list)
    for seq, n, t in rows:
      groups[t, seq.loaded == 0].append((seq, n))
    max_rows = _pow2_at_least(self.config.num_slots)
    for (t, fresh), group in sorted(groups.items()):
      fits = max(1, self.config.prefill_token_budget // t)
      per_call = min(max_rows, 1 << (fits.bit_length() - 1))  # a power of two <= fits
      for i in range(0, len(group), per_call):
        part = group[i:i + per_call]
        if self._saves:  # before any slot is loaded again
          self._flush_saves()
        self._state = prefill(self._params, self._state, self._make_chunk(part, t),
                              config=self.model_config, fresh=fresh)
        self._counts['prefill_calls'] += 1
        self._counts['prefill_tokens'] += sum(n for _, n in part)
        for seq, n in part:
          seq.loaded += n
          seq.state_from = seq.slot  # (a hybrid's next chunk continues its slot's state)
          if seq.owned_row is not None:  # read by this chunk
            self._saved.release(seq.owned_row)
            seq.owned_row = None
          prefix = seq.prefix
          if prefix is not None and prefix.writer is seq and not prefix.ready and (
              seq.loaded >= len(prefix.pages) * self.config.page_size):
            prefix.ready = True
            if prefix.state_row is not None:
              self._saves.append((seq.slot, prefix.state_row))
          if seq.loaded >= len(seq.context):
            self._start_decoding(seq)

  def _flush_saves(self) -> None:
    """Dispatches the pending copies of slots' states into saved rows."""
    n = _pow2_at_least(len(self._saves))
    pad = n - len(self._saves)
    slots = [s for s, _ in self._saves] + [0] * pad
    rows = [r for _, r in self._saves] + [self._saved.num_rows] * pad  # (padding: nowhere)
    self._state = self._state._replace(linear=slot_state.save(
        self._state.linear, np.array(slots, np.int32), np.array(rows, np.int32)))
    self._counts['states_saved'] += len(self._saves)
    self._saves = []

  def _make_chunk(self, part, t: int) -> Chunk:
    c = self.config
    n_rows = _pow2_at_least(len(part))
    width = self._width(self._pages_through(max(seq.loaded for seq, _ in part) + t - 1))
    # Built as lists and converted once: cheaper than writing numpy arrays element by element.
    # The seed's words are written as int64 and wrap to their int32 bits in the cast.
    tokens, tables, ints, floats = [], [], [], []
    no_stops = (-1,) * self._stop_width
    for seq, n in part:
      start = seq.loaded
      tokens.append(seq.context[start:start + n] + [0] * (t - n))
      pages = seq.pages[:width]
      tables.append(pages + [paged_attention.TRASH_PAGE] * (width - len(pages)))
      state = (seq.state_from, seq.slot)
      if start + n >= len(seq.context):
        r = seq.request
        sp = r.sampling
        stops = (*sorted(seq.stop_ids), *no_stops)[:self._stop_width]
        ints.append((start, n, seq.slot, seq.tokens[-1] if seq.tokens else r.prompt_tokens[-1],
                     len(seq.context), *_seed_words(r.seed), len(seq.tokens), sp.top_k, *state,
                     *stops))
        floats.append((sp.temperature, sp.top_p))
      else:
        ints.append((start, n, c.num_slots, 0, 0, 0, 0, 0, 0, *state, *no_stops))
        floats.append((1.0, 1.0))
    pad = n_rows - len(part)
    tokens += [[0] * t] * pad
    tables += [[paged_attention.TRASH_PAGE] * width] * pad
    ints += [(0, 0, c.num_slots, 0, 0, 0, 0, 0, 0, slot_state.FRESH, c.num_slots,
              *no_stops)] * pad
    floats += [(1.0, 1.0)] * pad
    return Chunk(tokens=np.array(tokens, np.int32), table=np.array(tables, np.int32),
                 ints=np.array(ints, np.int64).astype(np.int32),
                 floats=np.array(floats, np.float32))

  # Decode steps and their results.

  def _dispatch(self) -> bool:
    """One decode step for every decoding sequence that needs a token (not waited for)."""
    decoding = self._left > 0
    if not decoding.any():
      return False
    c = self.config
    if c.decode_attention == 'xla' and self._width(1) < c.table_width:
      longest = int(np.minimum(self._pos, self._last)[decoding].max())
      width = self._width(self._pages_through(longest))
    else:  # one width: the kernels read each row's own length, and a short table is read whole
      width = c.table_width
    table = self._table_dev.get(width)
    if table is None:
      # Changed (admissions, page boundaries): the call's own transfer of a host array costs a
      # few µs where `jax.device_put` costs tens (`jnp.asarray` adds an XLA op the step waits
      # for). A copy: on CPU the device may alias the buffer, which the host edits later.
      table = self._table_dev[width] = self._table[:, :width].copy()
    elif isinstance(table, np.ndarray):  # unchanged since the last step: keep it there
      table = self._table_dev[width] = jax.device_put(table, self._device)
    self._state, drawn = decode_step(
        self._params, self._state, table, config=self.model_config, filtered=self._filtered > 0)
    decoded = np.flatnonzero(decoding).tolist()
    slots = self._slots
    self._pending.append(_Dispatched(drawn, decoded, list(map(slots.__getitem__, decoded)),
                                     self._dispatched, self._version))
    self._dispatched += 1
    self._counts['decode_steps'] += 1
    self._pos += decoding
    self._left -= decoding
    for slot in np.flatnonzero(decoding & (self._left == 0)).tolist():
      # Its last token is in flight: its slot and pages can go now (before the next prefill
      # overwrites them on the device, this step has written them).
      self._release_pages(slots[slot], drop_in_flight=False, finished=True)
    return True

  def _collect(self, keep_newest: bool) -> list[api.Completion]:
    """Fetches the tokens of the dispatched steps (all but the newest when `keep_newest`) in
    one transfer, appends them, and finishes the sequences that stopped or are complete."""
    n = len(self._pending) - (1 if keep_newest else 0)
    if n <= 0:
      return []
    batch, self._pending = self._pending[:n], self._pending[n:]
    self._collected = True
    if len(batch) > 1:  # all transfers under way before the first wait
      for d in batch:
        d.drawn.copy_to_host_async()
    finished, appended = [], 0
    for d in batch:
      tokens_H, logprobs_H, routes_H = unpack_drawn(np.asarray(d.drawn),  # no pytree device_get
                                                    self.model_config)
      tokens, logprobs = tokens_H.tolist(), logprobs_H.tolist()
      index, version = d.index, d.version
      for slot, seq in zip(d.slots, d.seqs):
        if seq.done or index < seq.first_step:
          continue
        token, drawn = tokens[slot], seq.tokens
        drawn.append(token)
        seq.logprobs.append(logprobs[slot])
        seq.versions.append(version)
        if routes_H is not None:
          seq.routes.append(routes_H[slot])
        appended += 1
        if token in seq.stop_ids:
          reason = 'stop'
        elif len(drawn) >= seq.max_tokens:
          reason = 'length'
        else:
          continue
        seq.done = True
        if seq.slot is not None:
          self._release_pages(seq, finished=True)
        finished.append(seq.completion(reason))
    self._requests.finish(c.request_id for c in finished)
    self._counts['tokens_generated'] += appended
    self._counts['completions'] += len(finished)
    return finished
