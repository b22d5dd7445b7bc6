"""The layout digest every weight update to a generator actor carries: the paths, shapes and
dtypes of the params pytree as a short hash. An actor checks an update's digest against its own
model's before it applies it, and refuses it whole when they differ (an update for another model).

Standard library at the top: a generator actor imports this before it pins its threads.
"""

from __future__ import annotations

import hashlib
import json


def tree_digest(tree) -> str:
  """The layout of a params pytree (nested dicts of arrays) as a 16-hex-digit hash."""
  leaves = []

  def walk(node, path):
    if isinstance(node, dict):
      for k in sorted(node):
        walk(node[k], path + (k,))
    else:
      leaves.append(['/'.join(path), list(node.shape), str(node.dtype)])
  walk(tree, ())
  return hashlib.sha256(json.dumps(leaves).encode()).hexdigest()[:16]


def expected_digest(model_config, lora=None) -> str:
  """`tree_digest` of the params this model's engine takes, from its config alone; with `lora`
  (a `config.LoraSettings`) of the adapters, which are then its updates."""
  import numpy as np
  from pipelinerl_jax.models import hf_io
  from pipelinerl_jax.models import lora as lora_lib
  tree: dict = {}
  dtype = np.dtype(model_config.param_dtype)
  shapes = ({spec.path: spec.shape for spec in hf_io.name_map(model_config)} if lora is None
            else lora_lib.shapes(model_config, lora))
  for path, shape in shapes.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.lib.stride_tricks.as_strided(np.zeros((), dtype), shape,
                                                    (0,) * len(shape))
  return tree_digest(tree)
