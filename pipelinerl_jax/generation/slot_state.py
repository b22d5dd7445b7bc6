"""A hybrid's Gated DeltaNet states in the JAX engine: a fixed-size state per slot, beside the
paged KV cache.

Where an attention layer keeps keys and values per position, a Gated DeltaNet layer
(models/layers/gated_delta.py) keeps per sequence one state of fixed size: its convolution
window and its fp32 recurrent state. A sequence in the engine holds both kinds of storage: pages
of the KV pool for its attention layers (paging.py), and for its linear layers the state of the
slot it sits in. The engine treats them as one cache:

  prefill     a chunk writes its positions' keys and values into the sequence's pages, and runs
              its linear layers (the chunked form) from the state it starts from to its slot:
              zeros at position 0, else its slot's own state, or a saved one (below);
  decode      a step reads and writes every slot's state in place (the recurrent form); a slot
              whose table holds only the trash page (free, loading, finished) or that stopped
              on the device keeps its state as it is;
  prompts     the samples of a prompt share its full pages, and the state after those pages,
              saved once from the writer's slot: every sample starts from that one copy;
  turns       a finished turn that an episode may continue keeps its pages and a saved copy of
              its slot's state, which the next turn starts from;
  preemption  pages and slot go back; the sequence is loaded again later from its tokens;
  updates     a saved prompt state is a prompt prefix: it carries the version that wrote it and
              serves new requests only under that version; with `recompute_kv` every sequence
              is loaded again under the new weights.

Device layout (`StateStore`), for Ll linear layers, H slots and M saved rows (a
`gated_delta.LinearState` of stacked arrays each):
  slots  [Ll, H, Wc, Cc] and [Ll, H, Hv, Dk, Dv]: row h is slot h's state; decode runs them all
  saved  the same with M rows, written only by `save` (a slot's state copied in)
A prefill row says where its state starts (`starting`): FRESH (zeros), a slot (0..H-1) or a
saved row r (H + r); its state at the chunk's end goes to its slot (`write`; H: nowhere).

`SavedRows` is the host's free list of saved rows. Shape letters as in transformer.py, plus H
slots, M saved rows, N copies.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import transformer
from pipelinerl_jax.models.layers import gated_delta

FRESH = -1  # a prefill row that starts a sequence: its state starts at zero


class StateStore(NamedTuple):
  """Every slot's state and the saved ones (see the module doc)."""
  slots: gated_delta.LinearState   # [Ll, H, ...]
  saved: gated_delta.LinearState   # [Ll, M, ...]


def init(config: transformer.ModelConfig, num_slots: int, num_saved: int) -> StateStore | None:
  """Zeros; None for a model without linear layers."""
  if not config.is_hybrid:
    return None
  return StateStore(transformer.init_linear_states(config, num_slots),
                    transformer.init_linear_states(config, num_saved))


def starting(store: StateStore, from_R: jax.Array) -> gated_delta.LinearState:
  """The states R prefill rows start from, [Ll, R, ...]: zeros for FRESH, a slot's for
  0..H-1, saved row r's for H + r."""
  h = store.slots.recurrent.shape[1]
  m = store.saved.recurrent.shape[1]
  in_slot_R = from_R < h

  def pick(slots, saved):
    of_slot = jnp.take(slots, jnp.clip(from_R, 0, h - 1), axis=1)
    of_saved = jnp.take(saved, jnp.clip(from_R - h, 0, max(m - 1, 0)), axis=1)
    shape = (1, -1) + (1,) * (slots.ndim - 2)
    state = jnp.where(in_slot_R.reshape(shape), of_slot, of_saved)
    return jnp.where((from_R >= 0).reshape(shape), state, 0).astype(slots.dtype)

  return jax.tree.map(pick, store.slots, store.saved)


def write(store: StateStore, to_R: jax.Array, rows: gated_delta.LinearState) -> StateStore:
  """Each row's state [Ll, R, ...] into slot to_R[r]; to_R[r] = H writes nothing."""
  slots = jax.tree.map(lambda all_, new: all_.at[:, to_R].set(new.astype(all_.dtype),
                                                              mode='drop'), store.slots, rows)
  return store._replace(slots=slots)


@functools.partial(jax.jit, donate_argnames=('store',))
def save(store: StateStore, slots_N: jax.Array, rows_N: jax.Array) -> StateStore:
  """Slot slots_N[n]'s state into saved row rows_N[n] (M: nowhere, for padding)."""
  saved = jax.tree.map(lambda to, of: to.at[:, rows_N].set(jnp.take(of, slots_N, axis=1),
                                                           mode='drop'),
                       store.saved, store.slots)
  return store._replace(saved=saved)


class SavedRows:
  """The host's free list of the M saved rows."""

  def __init__(self, num_rows: int):
    self.num_rows = num_rows
    self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest first

  @property
  def num_free(self) -> int:
    return len(self._free)

  def take(self) -> int | None:
    """A free row, or None when all are in use."""
    return self._free.pop() if self._free else None

  def release(self, row: int) -> None:
    assert row not in self._free, f'saved row {row} released twice'
    self._free.append(row)
