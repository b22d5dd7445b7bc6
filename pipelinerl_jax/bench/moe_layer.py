"""One MoE layer's experts, forward and backward: the grouped matmul (`moe.experts_ragged`)
against the dense reference (`moe.experts_dense`), on whatever device JAX has.

  python -m pipelinerl_jax.bench.moe_layer [--tokens 8192] [--experts 128] [--top_k 8]
      [--hidden 2048] [--width 768] [--dtype bfloat16] [--expert_split 1] [--out PATH.json]
  python -m pipelinerl_jax.bench.moe_layer --quick      # toy sizes, seconds on a CPU

The defaults are one Qwen3-30B-A3B layer and one 8k row. `--expert_split k` runs the grouped
path on 1/k of the experts, as one device of an expert axis of k does (the other assignments
sort past its groups and are dropped). Reported per path: seconds per forward + backward
(median of the timed repeats, compilation excluded), the max difference of the output and of
every gradient from the dense reference (in fp32 on the same inputs: how far the grouped path's
arithmetic is from the reference's), and whether the output is finite where the reference is.
Nothing here asserts a figure. The dense reference needs tokens x experts x width activations:
`--no_dense` skips it where that does not fit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.models.layers import moe as moe_lib

QUICK = dict(tokens=256, experts=8, top_k=2, hidden=64, width=32)


def inputs(tokens, experts, top_k, hidden, width, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  x_UxD = jax.random.normal(keys[0], (tokens, hidden), dtype)
  ids_UxXk = jnp.argsort(jax.random.uniform(keys[1], (tokens, experts)), axis=-1)[:, :top_k]
  gates_UxXk = jax.nn.softmax(jax.random.normal(keys[2], (tokens, top_k)), axis=-1)
  scale = lambda n: 1 / np.sqrt(n)
  weights = (scale(hidden) * jax.random.normal(keys[3], (experts, hidden, width), dtype),
             scale(hidden) * jax.random.normal(keys[4], (experts, hidden, width), dtype),
             scale(width) * jax.random.normal(keys[5], (experts, width, hidden), dtype))
  return x_UxD, ids_UxXk, gates_UxXk.astype(dtype), weights


def value_and_grads(experts_fn):
  """jitted (x, ids, gates, weights) -> (sum of squares of the output, its gradients with
  respect to x, gates and weights)."""
  loss = lambda x, ids, gates, ws: jnp.sum(experts_fn(x, ids, gates, *ws).astype(jnp.float32)
                                           ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))


def timed(fn, repeats):
  jax.block_until_ready(fn())  # compiles
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--tokens', type=int, default=8192)
  parser.add_argument('--experts', type=int, default=128)
  parser.add_argument('--top_k', type=int, default=8)
  parser.add_argument('--hidden', type=int, default=2048)
  parser.add_argument('--width', type=int, default=768)
  parser.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float32'))
  parser.add_argument('--expert_split', type=int, default=1)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--no_dense', action='store_true')
  parser.add_argument('--quick', action='store_true', help='toy sizes')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/moe_layer.json')
  args = parser.parse_args(argv)
  sizes = QUICK if args.quick else {k: getattr(args, k) for k in QUICK}
  if sizes['experts'] % args.expert_split:
    parser.error(f"--expert_split {args.expert_split} does not divide {sizes['experts']} experts")
  dtype = jnp.dtype(args.dtype)
  x, ids, gates, weights = inputs(**sizes, dtype=dtype)
  local = sizes['experts'] // args.expert_split
  held = lambda x, ids, gates, *ws: moe_lib.experts_ragged(
      x, ids, gates, *(w[:local] for w in ws), first_expert=0)
  rows = []
  paths = [('ragged', held)] + ([] if args.no_dense else [('dense', moe_lib.experts_dense)])
  for name, fn in paths:
    step = value_and_grads(fn)
    rows.append(dict(path=name, seconds=timed(lambda: step(x, ids, gates, weights),
                                              args.repeats)))
  # Agreement in fp32 on the same inputs: the grouped path's arithmetic against the reference.
  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  mask = lambda ids: jnp.where(ids < local, ids, -1)  # the reference on the held experts only
  reference = lambda x, ids, gates, *ws: moe_lib.experts_dense(
      x, jnp.maximum(mask(ids), 0), jnp.where(mask(ids) >= 0, gates, 0), *ws)
  got = value_and_grads(held)(f32(x), ids, f32(gates), f32(weights))
  want = value_and_grads(reference)(f32(x), ids, f32(gates), f32(weights))
  diffs = dict(loss=float(jnp.abs(got[0] - want[0]) / jnp.maximum(jnp.abs(want[0]), 1e-30)))
  for label, a, b in zip(('x', 'gates', 'w_gate', 'w_up', 'w_down'),
                         jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    diffs[f'grad_{label}'] = float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)),
                                                                        1e-30))
  finite = bool(jnp.isfinite(got[0]) and all(jnp.all(jnp.isfinite(g))
                                               for g in jax.tree.leaves(got[1])))
  device = jax.devices()[0]
  print(f'{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; {sizes}, '
        f'{args.dtype}, experts held {local} of {sizes["experts"]}')
  print(f"{'path':>8}  {'fwd+bwd s':>10}")
  for r in rows:
    print(f"{r['path']:>8}  {r['seconds']:10.4f}")
  print('grouped vs reference in fp32 (max |difference| / max |reference|): '
        + ', '.join(f'{k} {v:.1e}' for k, v in diffs.items()) + f'; finite: {finite}')
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(device=str(device), backend=jax.default_backend(),
                                 host=platform.node(), jax=jax.__version__, args=vars(args),
                                 sizes=sizes, experts_held=local, timings=rows,
                                 relative_difference=diffs, finite=finite), indent=1) + '\n')
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
