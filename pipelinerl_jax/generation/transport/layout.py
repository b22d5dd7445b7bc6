"""The layout digest every weight update to a generator actor carries: the paths, shapes and
dtypes of the params pytree as a short hash. An actor checks an update's digest against its own
model's before it applies it, and refuses it whole when they differ (an update for another model).
With generation.remote.verify_updates, the values too: `params_checksum` of what the trainer
published, against that of what the actor handed its engine.

Standard library at the top: a generator actor imports this before it pins its threads.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable


def _leaves(tree, path=()):
  """(path, leaf) of a params pytree (nested dicts of arrays), in sorted key order."""
  if isinstance(tree, dict):
    for k in sorted(tree):
      yield from _leaves(tree[k], path + (k,))
  else:
    yield '/'.join(path), tree


def tree_digest(tree) -> str:
  """The layout of a params pytree (nested dicts of arrays) as a 16-hex-digit hash."""
  leaves = [[path, list(x.shape), str(x.dtype)] for path, x in _leaves(tree)]
  return hashlib.sha256(json.dumps(leaves).encode()).hexdigest()[:16]


def params_checksum(tree, to_host: Callable[[Any], Any] | None = None) -> str:
  """The values of a params pytree as a 16-hex-digit hash of every leaf's path, dtype, shape and
  bytes: two trees have the same one only when they hold the same bits. `to_host(leaf)` gives a
  leaf's host (numpy) copy; numpy.asarray by default."""
  import numpy as np
  to_host = to_host or np.asarray
  h = hashlib.sha256()
  for path, x in _leaves(tree):
    host = np.ascontiguousarray(to_host(x))
    h.update(json.dumps([path, str(host.dtype), list(host.shape)]).encode())
    h.update(host.reshape(-1).view(np.uint8))  # the bytes, without a copy
  return h.hexdigest()[:16]


def expected_digest(model_config, lora=None) -> str:
  """`tree_digest` of the params this model's engine takes, from its config alone; with `lora`
  (a `config.LoraSettings`) of the adapters, which are then its updates."""
  import numpy as np
  from pipelinerl_jax.models.hf import names as hf_names
  from pipelinerl_jax.models.layers import lora as lora_lib
  tree: dict = {}
  dtype = np.dtype(model_config.param_dtype)
  shapes = ({spec.path: spec.shape for spec in hf_names.name_map(model_config)} if lora is None
            else lora_lib.shapes(model_config, lora))
  for path, shape in shapes.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.lib.stride_tricks.as_strided(np.zeros((), dtype), shape,
                                                    (0,) * len(shape))
  return tree_digest(tree)
