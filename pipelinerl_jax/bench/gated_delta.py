"""One Gated DeltaNet layer (models/layers/gated_delta.py), forward and backward, on whatever
device JAX has: the chunked delta rule as training runs it, at a Qwen3.5 model's linear-layer
shapes.

  python -m pipelinerl_jax.bench.gated_delta [--shape 2b|9b] [--tokens 8192] [--rows 1]
      [--chunk 64] [--dtype bfloat16] [--repeats 5] [--out PATH.json]
  python -m pipelinerl_jax.bench.gated_delta --quick      # toy sizes, seconds on a CPU

The shapes are configs/models/Qwen3.5-2B's and -9B's (width, key and value heads and their
dims, convolution taps). Reported: seconds per forward + backward of the whole layer
(projections, convolution, the chunked rule, gated norm, out_proj) on `--rows` rows of
`--tokens` tokens, in `--dtype` with fp32 master weights, and of the chunked rule alone (fp32),
every timed call's seconds kept and their median computed here (compilation excluded); XLA's
compiled size of the layer's program (arguments, outputs and temporaries); the chunked rule
against the recurrent one in fp32 on the same inputs (`--check_tokens` tokens, three sequences
packed in each row, a state handed in): the largest difference of the output, the final state
and every input's gradient, relative to the largest reference value; and whether the layer's
output and gradients are finite. Nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import transformer
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import gated_delta

SHAPES = {'2b': 'configs/models/Qwen3.5-2B', '9b': 'configs/models/Qwen3.5-9B'}
QUICK = transformer.ModelConfig(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16, linear_layers=(0,), linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel=4, architecture='Qwen3_5ForCausalLM')
QUICK_SIZES = dict(tokens=256, rows=1, chunk=16, check_tokens=48)


def layer_config(shape: str, chunk: int, dtype: str) -> transformer.ModelConfig:
  """The linear layers of Qwen3.5 at `shape` ('2b', '9b', or 'quick': toy dims)."""
  numerics = dict(param_dtype='float32', dtype=dtype, linear_chunk_size=chunk)
  if shape == 'quick':
    return dataclasses.replace(QUICK, **numerics)
  root = pathlib.Path(__file__).resolve().parents[2]
  return hf_schema.load_config(root / SHAPES[shape], **numerics)


def timed(fn, repeats: int) -> dict:
  """Every call's seconds after one warm-up call (which compiles), and their median."""
  jax.block_until_ready(fn())
  calls = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    calls.append(time.perf_counter() - start)
  return dict(seconds=statistics.median(calls), calls=calls)


def packed_index(rows: int, tokens: int) -> jax.Array:
  """`segment_index` of rows holding three sequences each (boundaries at 1/3 and 2/3)."""
  ids = jnp.ones((rows, tokens), jnp.int32)
  ids = ids.at[:, tokens // 3:].set(2).at[:, 2 * tokens // 3:].set(3)
  return gated_delta.segment_index(ids)


def rule_inputs(key, rows, tokens, hv, dk, dv):
  """Normalized q (scaled) and k, v, decays g <= 0 and betas, fp32, and a state handed in."""
  keys = jax.random.split(key, 6)
  q = gated_delta.l2_normalize(jax.random.normal(keys[0], (rows, tokens, hv, dk))) * dk ** -0.5
  k = gated_delta.l2_normalize(jax.random.normal(keys[1], (rows, tokens, hv, dk)))
  v = jax.random.normal(keys[2], (rows, tokens, hv, dv))
  g = -jax.random.uniform(keys[3], (rows, tokens, hv))
  beta = jax.random.uniform(keys[4], (rows, tokens, hv))
  state = 0.1 * jax.random.normal(keys[5], (rows, hv, dk, dv))
  return q, k, v, g, beta, state


def rule_value_and_grads(form, index):
  """jitted (q, k, v, g, beta, state) -> ((loss, (output, final state)), gradients)."""
  def loss(q, k, v, g, beta, state):
    o, s = form(q, k, v, g, beta, index, state)
    return jnp.sum(o * o) + jnp.sum(s * s), (o, s)
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def relative(a, b) -> float:
  return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def agreement(config, rows, tokens, chunk) -> dict:
  """The chunked rule against the recurrent one in fp32 (see the module doc)."""
  _, hv, dk, dv, _, _ = gated_delta.dims(config)
  inputs = rule_inputs(jax.random.PRNGKey(1), rows, tokens, hv, dk, dv)
  index = packed_index(rows, tokens)
  chunked = lambda *a: gated_delta.delta_rule_chunked(*a, chunk=chunk)
  (_, (o_c, s_c)), g_c = rule_value_and_grads(chunked, index)(*inputs)
  (_, (o_r, s_r)), g_r = rule_value_and_grads(gated_delta.delta_rule_recurrent, index)(*inputs)
  diffs = dict(output=relative(o_c, o_r), state=relative(s_c, s_r))
  for name, a, b in zip(('q', 'k', 'v', 'g', 'beta', 'state_in'), g_c, g_r):
    diffs[f'grad_{name}'] = relative(a, b)
  return diffs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--shape', default='2b', choices=sorted(SHAPES))
  parser.add_argument('--tokens', type=int, default=8192)
  parser.add_argument('--rows', type=int, default=1)
  parser.add_argument('--chunk', type=int, default=gated_delta.DEFAULT_CHUNK)
  parser.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float32'))
  parser.add_argument('--check_tokens', type=int, default=1024)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--quick', action='store_true', help='toy sizes')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/gated_delta.json')
  args = parser.parse_args(argv)
  shape = 'quick' if args.quick else args.shape
  sizes = QUICK_SIZES if args.quick else dict(tokens=args.tokens, rows=args.rows,
                                              chunk=args.chunk, check_tokens=args.check_tokens)
  config = layer_config(shape, sizes['chunk'], args.dtype)
  hk, hv, dk, dv, cc, kc = gated_delta.dims(config)
  rows, tokens = sizes['rows'], sizes['tokens']

  layer = gated_delta.GatedDeltaNet(config)
  x = jax.random.normal(jax.random.PRNGKey(0), (rows, tokens, config.hidden_size),
                        jnp.dtype(args.dtype))
  ids = jnp.ones((rows, tokens), jnp.int32)
  params = jax.jit(lambda key: layer.init(key, x[:, :8], ids[:, :8]))(jax.random.PRNGKey(2))

  def layer_loss(params, x):
    return jnp.sum(layer.apply(params, x, ids)[0].astype(jnp.float32) ** 2)
  layer_step = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1)))
  memory = layer_step.lower(params, x).compile().memory_analysis()
  compiled_bytes = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                    + memory.temp_size_in_bytes) if memory is not None else None
  timings = dict(layer=timed(lambda: layer_step(params, x), args.repeats))
  loss, grads = layer_step(params, x)
  finite = bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(g)))
                                            for g in jax.tree.leaves(grads))
  inputs = rule_inputs(jax.random.PRNGKey(3), rows, tokens, hv, dk, dv)
  rule_step = rule_value_and_grads(
      lambda *a: gated_delta.delta_rule_chunked(*a, chunk=sizes['chunk']),
      packed_index(rows, tokens))
  timings['rule'] = timed(lambda: rule_step(*inputs), args.repeats)
  diffs = agreement(config, rows, sizes['check_tokens'], sizes['chunk'])

  device = jax.devices()[0]
  dims = dict(hidden=config.hidden_size, key_heads=hk, value_heads=hv, key_dim=dk,
              value_dim=dv, conv_channels=cc, conv_taps=kc)
  print(f'{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; {shape} '
        f'{dims}; {rows} x {tokens} tokens, chunk {sizes["chunk"]}, {args.dtype}')
  print(f"{'what':>6}  {'fwd+bwd s':>10}")
  for name, t in timings.items():
    print(f"{name:>6}  {t['seconds']:10.4f}")
  if compiled_bytes is not None:
    print(f'the layer program: {compiled_bytes / 2**20:.1f} MiB (arguments, outputs, temporaries)')
  print('chunked vs recurrent in fp32 (max |difference| / max |reference|, '
        f'{sizes["check_tokens"]} tokens): ' + ', '.join(f'{k} {v:.1e}' for k, v in diffs.items())
        + f'; finite: {finite}')
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(dict(device=str(device), backend=jax.default_backend(),
                                 host=platform.node(), jax=jax.__version__, args=vars(args),
                                 shape=shape, dims=dims, sizes=sizes, timings=timings,
                                 compiled_bytes=compiled_bytes, relative_difference=diffs,
                                 finite=finite), indent=1) + '\n')
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
