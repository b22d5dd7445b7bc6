"""Memory and time of the trainer's gradient over one packed row: dense vs blockwise attention.

  python -m pipelinerl_jax.bench.attention --seq_lens=1024,2048,4096,8192,16384
  python -m pipelinerl_jax.bench.attention --quick                       # seconds

For each row length T and attention implementation, the gradient of the summed token log-probs
of a tiny model over one row of T tokens (packed with samples of T/12 to T/3 tokens, so segments
do real work) is compiled ahead of time. Memory is XLA's own buffer assignment for that program
(`compiled.memory_analysis()`): `temp` is the scratch the step needs beyond its inputs and
outputs, `peak` = arguments + outputs + temp - aliased. It is known without running, so a
program whose peak exceeds `--max_run_gb` is compiled and reported but not timed (dense at 16k
would need more memory than a laptop has). Timed programs run `--warmup` times, then `--steps`
times, each ended by `jax.block_until_ready`. Prints a table and writes JSON to `--out`.

The GPU kit (bench/gpu/train.py) also uses the two functions at the end, on attention
alone at its own shapes: `check_against_dense` (an implementation's outputs and gradients
against the dense reference in fp32, rows of one, two and many samples and padding) and
`time_step_attention` (forward + backward of one layer's attention over a packed batch, one
row per call as the train step's micro-batches run it, with the FLOPs the kernel executes and
the causal pairs' FLOP floor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax import packing
from pipelinerl_jax.models.layers import attention as attention_lib
from pipelinerl_jax.models import transformer

# Qwen2-shaped, small enough that attention, not the MLP or the vocabulary, dominates at long T.
MODEL = transformer.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                rope_theta=1e6, qkv_bias=True)
QUICK_DEFAULTS = dict(seq_lens='256,512', steps=1, warmup=0)
RESULT_KEYS = ('attention', 'seq_len', 'segments', 'block', 'compile_s', 'temp_bytes',
               'peak_bytes', 'timed', 'step_s_median', 'step_s_min', 'tokens_per_s')


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.attention',
                              description=__doc__.split('\n')[0])
  p.add_argument('--seq_lens', default='1024,2048,4096,8192,16384',
                 help='comma-separated row lengths T')
  p.add_argument('--attention', default='dense,blockwise', help='implementations to compare')
  p.add_argument('--block', type=int, default=MODEL.attention_block_q,
                 help='blockwise: query and key block size')
  p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  p.add_argument('--remat', action='store_true', help='rematerialize each layer in backward')
  p.add_argument('--steps', type=int, default=3, help='timed steps')
  p.add_argument('--warmup', type=int, default=1, help='untimed steps after compiling')
  p.add_argument('--max_run_gb', type=float, default=4.0,
                 help='compile but do not run programs whose peak memory exceeds this')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--out', default='/tmp/bench_attention.json', help='JSON output path')
  p.add_argument('--quick', action='store_true',
                 help=f'small defaults for a smoke run: {QUICK_DEFAULTS} (explicit flags win)')
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = build_parser()
  if parser.parse_args(argv).quick:
    parser.set_defaults(**QUICK_DEFAULTS)
  args = parser.parse_args(argv)
  try:
    args.seq_lens = [int(s) for s in args.seq_lens.split(',') if s.strip()]
  except ValueError:
    parser.error(f'--seq_lens: expected integers like 1024,2048, got {args.seq_lens!r}')
  if not args.seq_lens or min(args.seq_lens) < 2:
    parser.error('--seq_lens: every length must be >= 2')
  args.attention = [a.strip() for a in args.attention.split(',') if a.strip()]
  bad = [a for a in args.attention if a not in ('dense', 'blockwise')]
  if not args.attention or bad:
    parser.error(f'--attention: unknown {bad}; choose from dense, blockwise')
  if args.block < 1 or args.steps < 1 or args.warmup < 0:
    parser.error('--block and --steps must be >= 1, --warmup >= 0')
  return args


def packed_row(t: int, seed: int) -> dict[str, np.ndarray]:
  """One row of samples of T/12 to T/3 tokens (the last one cut at T), positions restarting."""
  rng = np.random.default_rng(seed)
  seg, pos = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
  start, s = 0, 1
  while start < t:
    n = min(int(rng.integers(max(1, t // 12), t // 3 + 1)), t - start)
    seg[0, start:start + n], pos[0, start:start + n] = s, np.arange(n)
    start, s = start + n, s + 1
  tokens = rng.integers(0, MODEL.vocab_size, (1, t)).astype(np.int32)
  return dict(tokens=tokens, targets=np.roll(tokens, -1, axis=1), positions=pos, segment_ids=seg)


def bench_one(impl: str, t: int, args, params) -> dict:
  config = dataclasses.replace(MODEL, attention=impl, attention_block_q=args.block,
                               attention_block_kv=args.block, dtype=args.dtype, remat=args.remat)
  row = packed_row(t, args.seed)

  def loss(p, batch):
    logp, _ = transformer.token_logprobs(p, config, batch['tokens'], batch['targets'],
                                         batch['positions'], batch['segment_ids'])
    return jnp.sum(jnp.where(batch['segment_ids'] > 0, logp, 0.0))

  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, row).compile()
  compile_s = time.perf_counter() - start
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)
  result = dict(attention=impl, seq_len=t, segments=int(row['segment_ids'].max()),
                block=args.block if impl == 'blockwise' else None, compile_s=compile_s,
                temp_bytes=int(mem.temp_size_in_bytes), peak_bytes=int(peak),
                timed=peak <= args.max_run_gb * 2**30, step_s_median=None, step_s_min=None,
                tokens_per_s=None)
  if result['timed']:
    for _ in range(args.warmup):
      jax.block_until_ready(compiled(params, row))
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      jax.block_until_ready(compiled(params, row))
      times.append(time.perf_counter() - start)
    result.update(step_s_median=statistics.median(times), step_s_min=min(times),
                  tokens_per_s=t / statistics.median(times))
  return result


def _mib(x) -> str:
  return f'{x / 2**20:,.0f}'


TABLE_COLUMNS = (  # header, row -> cell
    ('attention', lambda r: r['attention'] + (f" ({r['block']})" if r['block'] else '')),
    ('T', lambda r: str(r['seq_len'])),
    ('segments', lambda r: str(r['segments'])),
    ('temp MiB', lambda r: _mib(r['temp_bytes'])),
    ('peak MiB', lambda r: _mib(r['peak_bytes'])),
    ('compile s', lambda r: f"{r['compile_s']:.1f}"),
    ('step s med', lambda r: f"{r['step_s_median']:.3f}" if r['timed'] else 'not run'),
    ('tokens/s', lambda r: f"{r['tokens_per_s']:.0f}" if r['timed'] else '-'),
)


def format_table(results: list[dict]) -> str:
  cells = [[h for h, _ in TABLE_COLUMNS]] + [[f(r) for _, f in TABLE_COLUMNS] for r in results]
  widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
  lines = ['  '.join(c.ljust(w) if h == 'attention' else c.rjust(w)
                     for (h, _), c, w in zip(TABLE_COLUMNS, row, widths)).rstrip()
           for row in cells]
  lines.insert(1, '  '.join('-' * w for w in widths))
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  params = transformer.init_params(MODEL, jax.random.PRNGKey(args.seed))
  results = []
  for t in args.seq_lens:
    for impl in args.attention:
      results.append(bench_one(impl, t, args, params))
      print(f'  {impl} T={t}: peak {_mib(results[-1]["peak_bytes"])} MiB', file=sys.stderr,
            flush=True)
  report = dict(config={k: v for k, v in vars(args).items() if k != 'out'},
                model=dataclasses.asdict(MODEL), jax_version=jax.__version__,
                device=f'{jax.devices()[0].platform}: {jax.devices()[0].device_kind}',
                results=results)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=1)
  print(format_table(results))
  print(f'JSON: {args.out}')
  return report


if __name__ == '__main__':
  main()


# ---------------------------------------------------------------------------------------------
# Attention alone: the GPU kit's numerics check and kernel timing.


def check_rows(t: int) -> np.ndarray:
  """Segment ids of 4 rows of length t: one sample; two; 16 equal; 5 unequal then padding."""
  seg = np.zeros((4, t), np.int32)
  seg[0] = 1
  seg[1, :t // 3], seg[1, t // 3:] = 1, 2
  seg[2] = np.repeat(np.arange(1, 17), -(-t // 16))[:t]
  cuts = [0, t // 10, t // 4, t // 4 + 2, t // 2, t - t // 8]
  for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
    seg[3, a:b] = i + 1
  return seg


def _attention_fn(impl: str, block: int):
  def fn(q, k, v, seg, starts, lengths):
    return attention_lib.packed(q, k, v, seg, implementation=impl, block_q=block, block_kv=block,
                                segment_starts_RxG=starts, segment_lengths_RxG=lengths)
  return fn


def _qkv(shape, seed, dtype):
  b, t, kh, g, dh = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(keys[0], shape, jnp.float32).astype(dtype),
          jax.random.normal(keys[1], (b, t, kh, dh), jnp.float32).astype(dtype),
          jax.random.normal(keys[2], (b, t, kh, dh), jnp.float32).astype(dtype))


def check_inputs(t: int, kv_heads: int, group: int, head_dim: int) -> tuple[jax.Array, ...]:
  """The check's arrays: q, k, v (fp32), the weights w of its loss (zero off real tokens), and
  the rows' segment ids, starts and lengths (check_rows)."""
  seg = check_rows(t)
  starts, lengths = packing.segment_spans(seg, 16)
  q, k, v = _qkv((len(seg), t, kv_heads, group, head_dim), 0, jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape) * (seg != 0)[:, :, None, None, None]
  return (q, k, v, w, *(jnp.asarray(x) for x in (seg, starts, lengths)))


def check_program(impl: str, dtype, block: int):
  """Jitted: check_inputs -> [output, dq, dk, dv] of `impl` in `dtype`, as fp32. The arrays are
  arguments: a program closing over them makes them constants, which XLA folds on the host
  (the dense reference's matmuls, one by one: ~50 s on the H100 host)."""
  fn = _attention_fn(impl, block)

  @jax.jit
  def run(q, k, v, w, seg, starts, lengths):
    args = [x.astype(dtype) for x in (q, k, v)]
    loss = lambda q, k, v: jnp.sum(w * fn(q, k, v, seg, starts, lengths).astype(jnp.float32))
    out = fn(*args, seg, starts, lengths)
    return [x.astype(jnp.float32) for x in (out, *jax.grad(loss, argnums=(0, 1, 2))(*args))]

  return run


def check_against_dense(impl: str, *, t: int = 512, kv_heads: int = 2, group: int = 2,
                        head_dim: int = 64, block: int = 128, dtype=jnp.bfloat16) -> dict:
  """Max errors on real tokens of `impl` and of dense, both in `dtype`, against dense in fp32:
  outputs and the gradients of q, k and v (of a weighted sum over real tokens). `ok` when
  impl's errors are within twice dense's plus 1e-2 (the rounding of `dtype` itself)."""
  inputs = check_inputs(t, kv_heads, group, head_dim)
  real = np.asarray(inputs[4] != 0)
  run = lambda name, dt: [np.asarray(x) for x in check_program(name, dt, block)(*inputs)]
  exact = run('dense', jnp.float32)
  errors = {}
  for name in dict.fromkeys((impl, 'dense')):
    errors[name] = [float(np.abs(a - b)[real].max()) for a, b in zip(run(name, dtype), exact)]
  names = ('out', 'dq', 'dk', 'dv')
  return dict(impl=impl, t=t, head_dim=head_dim, kv_heads=kv_heads, group=group,
              errors={n: e for n, e in zip(names, errors[impl])},
              dense_errors={n: e for n, e in zip(names, errors['dense'])},
              ok=all(a <= 2 * b + 1e-2 for a, b in zip(errors[impl], errors['dense'])))


def attention_pairs(segment_ids_RxT: np.ndarray) -> float:
  """Causal (query, key) pairs within samples: sum of n (n + 1) / 2 over the samples."""
  seg = np.asarray(segment_ids_RxT)
  t = seg.shape[1]
  real = seg > 0
  lengths = np.bincount((np.arange(len(seg))[:, None] * (t + 1) + seg)[real]).astype(float)
  return float(np.sum(lengths * (lengths + 1) / 2))


def time_step_attention(impl: str, batch: dict[str, np.ndarray], *, kv_heads: int, group: int,
                        head_dim: int, block: int = 1024, repeats: int = 1,
                        dtype=jnp.bfloat16) -> dict:
  """Forward + backward of one layer's attention over each packed row of `batch` (one row a
  call, as micro-batches of one row run it): the seconds summed over the rows, the FLOPs the
  kernel executes, and `pair_flops`, the floor: 12 Dh per causal pair and query head (forward
  4, backward 8; a flash kernel recomputes the scores, 14)."""
  seg_RxT = np.asarray(batch['segment_ids'])
  rows, t = seg_RxT.shape
  q, k, v = _qkv((1, t, kv_heads, group, head_dim), 0, dtype)
  fn = _attention_fn(impl, block)

  @jax.jit
  def step(q, k, v, seg, starts, lengths):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg, starts, lengths).astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  row = lambda r: tuple(jnp.asarray(batch[key][r:r + 1]) for key in
                        ('segment_ids', 'segment_starts', 'segment_lengths'))
  start = time.perf_counter()
  compiled = step.lower(q, k, v, *row(0)).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(q, k, v, *row(0)))
  seconds = []
  for r in range(rows):
    args = row(r)
    jax.block_until_ready(args)
    runs = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(q, k, v, *args))
      runs.append(time.perf_counter() - start)
    seconds.append(min(runs))
  heads = kv_heads * group
  pairs = attention_pairs(seg_RxT)
  if impl == 'dense':
    executed = 12.0 * head_dim * heads * rows * t * t
  elif impl == 'cudnn':
    executed = 14.0 * head_dim * heads * pairs
  else:
    bq = bk = min(block, t)
    tiles = [attention_lib.tiles_visited(seg_RxT[r:r + 1], bq, bk) for r in range(rows)]
    executed = head_dim * heads * bq * bk * sum(4.0 * f + 10.0 * b for f, b in tiles)
  total = float(sum(seconds))
  return dict(impl=impl, rows=rows, t=t, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              block=block if impl == 'blockwise' else None, compile_s=compile_s,
              seconds=total, seconds_per_row=seconds, pair_flops=12.0 * head_dim * heads * pairs,
              executed_flops=executed, executed_tflops=executed / total / 1e12,
              pair_tflops=12.0 * head_dim * heads * pairs / total / 1e12)
