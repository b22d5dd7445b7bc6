"""Weights published by several trainer processes: each process hands over the pieces of the
params that it holds, and a generator assembles whole leaves from them, checking that the pieces
cover every element exactly once. No process ever holds the whole model for this.

With train.num_processes = N the params are sharded over every process's devices. A piece is
one shard of one leaf (an index box) with one owner among the processes that hold it: for a
leaf sharded across processes, the process that holds that shard; for a shard replicated over
several processes (a data-parallel mesh axis spanning hosts), one of them, chosen by the leaf's
position, so that every process publishes its share. Every process computes the same owners
from the global sharding, without a word to the others.

  local_pieces(params)   -> this process's pieces, as host arrays
  assemble([pieces...])  -> the params pytree of whole numpy leaves (one copy), or ValueError
                            naming a gap, an overlap or a piece that does not fit its leaf
  Published              what the trainer hands the generator pool: one reference per process
                         (opaque here: Ray ObjectRefs) and the digest of the whole layout

Pure numpy and JAX; how the pieces travel (Ray's object store, a collective) is the caller's.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import jax
import numpy as np

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Piece:
  """One shard of the leaf at `path`, whose whole shape is `shape`: data = leaf[box]."""
  path: tuple[str, ...]
  shape: tuple[int, ...]
  box: Box
  data: np.ndarray


@dataclasses.dataclass(frozen=True)
class Published:
  """One weight update from several processes: `refs[i]` holds a list of Pieces (the pool
  passes them to generators as they are); `digest` is the layout digest of the whole params
  (layout.tree_digest), which the assembled tree must have."""
  refs: tuple[Any, ...]
  digest: str


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def owned_boxes(x: jax.Array, position: int, process: int) -> list[Box]:
  """The boxes of `x` that `process` publishes: those it holds and owns (see the module doc).
  `position`: the leaf's index in the params, which spreads replicated leaves over processes."""
  holders: dict[Box, set[int]] = {}
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    holders.setdefault(_box(index, x.shape), set()).add(device.process_index)
  mine = []
  for i, (box, processes) in enumerate(sorted(holders.items())):
    ranked = sorted(processes)
    if ranked[(position + i) % len(ranked)] == process:
      mine.append(box)
  return mine


def local_pieces(params) -> list[Piece]:
  """This process's pieces of `params` (jax Arrays, possibly spanning processes), as host
  arrays: one device-to-host transfer for them all. On CPU they may alias the device buffers:
  copy them (ray.put does) before the params are donated to the next step."""
  me = jax.process_index()
  found: list[tuple[tuple[str, ...], tuple[int, ...], Box, jax.Array]] = []
  for position, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
    shape = tuple(x.shape)
    wanted = set(owned_boxes(x, position, me))
    for shard in x.addressable_shards:
      box = _box(shard.index, shape)
      if box in wanted:
        wanted.discard(box)  # one copy of a box replicated over this process's devices
        found.append((_keys(path), shape, box, shard.data))
  host = jax.device_get([data for *_, data in found])
  return [Piece(path, shape, box, np.asarray(data))
          for (path, shape, box, _), data in zip(found, host)]


def _overlap(a: Box, b: Box) -> bool:
  return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b))


def _volume(box: Box) -> int:
  return int(np.prod([hi - lo for lo, hi in box], dtype=np.int64))


def assemble(pieces_by_process: Sequence[Sequence[Piece]]) -> dict:
  """Whole leaves from every process's pieces, as a nested dict of numpy arrays; raises
  ValueError (one line, naming the leaf) unless the pieces of each leaf fit it and cover it
  exactly once. The caller checks that the leaves are the model's (their digest)."""
  leaves: dict[tuple[str, ...], np.ndarray] = {}
  boxes: dict[tuple[str, ...], list[Box]] = {}
  for piece in itertools.chain.from_iterable(pieces_by_process):
    name = '/'.join(piece.path)
    data = np.asarray(piece.data)
    leaf = leaves.get(piece.path)
    if leaf is None:
      leaf = leaves[piece.path] = np.empty(piece.shape, data.dtype)
      boxes[piece.path] = []
    if leaf.shape != tuple(piece.shape) or leaf.dtype != data.dtype:
      raise ValueError(f'weight update rejected: leaf {name} arrives as {tuple(piece.shape)} '
                       f'{data.dtype} and as {leaf.shape} {leaf.dtype}')
    box = tuple(tuple(b) for b in piece.box)
    if len(box) != leaf.ndim or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, leaf.shape)):
      raise ValueError(f'weight update rejected: leaf {name}: piece {box} lies outside its '
                       f'shape {leaf.shape}')
    if data.shape != tuple(hi - lo for lo, hi in box):
      raise ValueError(f'weight update rejected: leaf {name}: piece {box} holds {data.shape}')
    clash = next((b for b in boxes[piece.path] if _overlap(b, box)), None)
    if clash is not None:
      raise ValueError(f'weight update rejected: leaf {name}: pieces {clash} and {box} overlap')
    leaf[tuple(slice(lo, hi) for lo, hi in box)] = data
    boxes[piece.path].append(box)
  tree: dict = {}
  for path, leaf in leaves.items():
    covered = sum(_volume(b) for b in boxes[path])
    if covered != leaf.size:  # disjoint boxes inside the leaf: a shortfall is a gap
      raise ValueError(f'weight update rejected: leaf {"/".join(path)}: the pieces cover '
                       f'{covered} of its {leaf.size} elements')
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree
