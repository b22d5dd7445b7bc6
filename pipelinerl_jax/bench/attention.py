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
