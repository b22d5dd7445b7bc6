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


def expected_digest(model_config) -> str:
  """`tree_digest` of the params this model's engine takes, from its config alone."""
  import numpy as np
  from pipelinerl_jax.models import hf_io
  tree: dict = {}
  dtype = np.dtype(model_config.param_dtype)
  for spec in hf_io.name_map(model_config):
    node = tree
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = np.lib.stride_tricks.as_strided(np.zeros((), dtype), spec.shape,
                                                         (0,) * len(spec.shape))
  return tree_digest(tree)
