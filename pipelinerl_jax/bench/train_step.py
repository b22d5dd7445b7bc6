"""Benchmark of the jitted train step (train.py): compile time, step time, tokens/s, FLOP/s.

  python -m pipelinerl_jax.bench.train_step --model=tiny,50m --rows=8 --seq_len=512 --micro=2
  python -m pipelinerl_jax.bench.train_step --model=tiny --mesh=1,4,2 --devices=8   # CPU
  python -m pipelinerl_jax.bench.train_step --quick                                 # seconds

Each model is randomly initialized from a preset (no download) and trained on one fixed packed
batch: random samples of varying lengths put through `packing.pack_samples`, so rows hold
several segments and the segment mask does real work. The step is compiled ahead of time
(`compile_s`), run `--warmup` times, then timed `--steps` times, each ended by
`jax.block_until_ready`. Prints one table row per model and writes one JSON object to `--out`.
"""

from __future__ import annotations

import math
import os
import sys


def _flag_value(argv: list[str], name: str) -> str | None:
  """The value of `--name=v` or `--name v` in argv (the last one wins), else None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
    elif arg == f'--{name}' and i + 1 < len(argv):
      value = argv[i + 1]
  return value


if __name__ == '__main__':
  # XLA reads this once, when jax starts its backend, so it is set before jax is imported.
  # It only adds simulated CPU devices; a GPU run is unaffected. Default: the mesh's size.
  _devices = _flag_value(sys.argv[1:], 'devices')
  if _devices in (None, '0'):
    _mesh = (_flag_value(sys.argv[1:], 'mesh') or '1,1,1').split(',')
    # A malformed --mesh is reported by the parser below; 1 device until then.
    _devices = math.prod(int(s) for s in _mesh) if all(s.strip().isdigit() for s in _mesh) else 1
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={_devices}').strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pipelinerl_jax import config as config_lib  # noqa: E402
from pipelinerl_jax import packing  # noqa: E402
from pipelinerl_jax import sharding as sharding_lib  # noqa: E402
from pipelinerl_jax import train  # noqa: E402
from pipelinerl_jax.models import transformer  # noqa: E402


def _qwen2_like(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads=2, head_dim=64):
  # Qwen2 ratios: MLP width ~5.5 D (rounded to 128), GQA, q/k/v biases, rope theta 1e6. The
  # vocab is smaller than Qwen's 152k so the embedding does not dwarf the layers at these sizes.
  return transformer.ModelConfig(
      vocab_size=vocab_size, hidden_size=hidden_size,
      intermediate_size=max(128, round(5.5 * hidden_size / 128) * 128),
      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      rope_theta=1e6, qkv_bias=True, tie_embeddings=False)


def _qwen25(hidden_size, intermediate_size, num_layers, num_heads, head_dim):
  # The published Qwen2.5 shapes (their config.json): 151,936-token vocab, 2 KV heads, q/k/v
  # biases, rope theta 1e6, embeddings tied to the lm_head.
  return transformer.ModelConfig(
      vocab_size=151936, hidden_size=hidden_size, intermediate_size=intermediate_size,
      num_layers=num_layers, num_heads=num_heads, num_kv_heads=2, head_dim=head_dim,
      rope_theta=1e6, qkv_bias=True, tie_embeddings=True)


# name -> ModelConfig; the name is the total parameter count, embedding and lm_head included,
# or the Qwen2.5 model whose shapes it has (random weights all the same).
MODEL_PRESETS = {
    'tiny': _qwen2_like(512, 64, num_layers=2, num_heads=4, head_dim=16),     # 0.24M
    '50m': _qwen2_like(16384, 512, num_layers=7, num_heads=8),                # 51.7M
    '250m': _qwen2_like(32768, 1024, num_layers=9, num_heads=16),             # 244M
    'qwen2.5-0.5b': _qwen25(896, 4864, num_layers=24, num_heads=14, head_dim=64),      # 494M
    'qwen2.5-1.5b': _qwen25(1536, 8960, num_layers=28, num_heads=12, head_dim=128),    # 1.54B
}

# --quick: every size small enough that one run takes seconds on a laptop CPU.
QUICK_DEFAULTS = dict(model='tiny', rows=4, seq_len=64, micro=2, steps=2, warmup=1)

RESULT_KEYS = ('model', 'params', 'flop_params', 'mesh', 'devices', 'device_kind', 'dtype',
               'remat', 'rows', 'seq_len', 'micro', 'samples', 'tokens', 'fill', 'compile_s',
               'step_s_median', 'step_s_min', 'tokens_per_s', 'flops_per_step', 'flop_per_s',
               'loss')


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.train_step',
                              description=__doc__.split('\n')[0])
  p.add_argument('--model', default='tiny',
                 help=f'comma-separated presets, one table row each: {", ".join(MODEL_PRESETS)}')
  p.add_argument('--mesh', default='1,1,1', help='data,fsdp,tensor sizes')
  p.add_argument('--devices', type=int, default=0,
                 help='simulated CPU devices, read before jax starts, so only as '
                      '`python -m`; default: the mesh size')
  p.add_argument('--rows', type=int, default=8, help='packed rows per optimizer step')
  p.add_argument('--seq_len', type=int, default=512, help='positions per packed row')
  p.add_argument('--micro', type=int, default=2, help='micro-batches per step (accumulated)')
  p.add_argument('--steps', type=int, default=5, help='timed steps')
  p.add_argument('--warmup', type=int, default=1, help='untimed steps after compiling')
  p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'),
                 help='activation / matmul dtype (master weights stay float32)')
  p.add_argument('--remat', action='store_true', help='rematerialize each layer in backward')
  p.add_argument('--fill', type=float, default=0.9, help='target fraction of real positions')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--out', default='/tmp/bench_train_step.json', help='JSON output path')
  p.add_argument('--quick', action='store_true',
                 help=f'small defaults for a smoke run: {QUICK_DEFAULTS} (explicit flags win)')
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = build_parser()
  if parser.parse_args(argv).quick:
    parser.set_defaults(**QUICK_DEFAULTS)
  args = parser.parse_args(argv)
  args.model = [m.strip() for m in args.model.split(',') if m.strip()]
  unknown = [m for m in args.model if m not in MODEL_PRESETS]
  if not args.model or unknown:
    parser.error(f'--model: unknown {unknown}; choose from {list(MODEL_PRESETS)}')
  try:
    args.mesh = tuple(int(s) for s in args.mesh.split(','))
  except ValueError:
    args.mesh = ()
  if len(args.mesh) != 3 or min(args.mesh) < 1:
    parser.error('--mesh must be three positive sizes data,fsdp,tensor, e.g. 1,4,2')
  dp = args.mesh[0] * args.mesh[1]
  if min(args.rows, args.seq_len, args.micro, args.steps) < 1 or args.warmup < 0:
    parser.error('--rows, --seq_len, --micro, --steps must be >= 1 and --warmup >= 0')
  if args.rows % (args.micro * dp):
    parser.error(f'--rows={args.rows} must be a multiple of --micro x data x fsdp = '
                 f'{args.micro * dp} (each micro-batch splits its rows over data and fsdp)')
  if not 0 < args.fill <= 1:
    parser.error(f'--fill={args.fill} must be in (0, 1]')
  return args


# ---------------------------------------------------------------------------------------------
# Batch and FLOP count.


def random_samples(rng: np.random.Generator, count_positions: int, seq_len: int,
                   vocab_size: int) -> list[packing.Sample]:
  """Samples of n = prompt + completion - 1 positions, n uniform in [T/16, T/2], until their
  positions would exceed `count_positions`; the prompt is 1/8 to 1/2 of the sample."""
  samples, total = [], 0
  lo, hi = max(2, seq_len // 16), max(2, seq_len // 2)
  while True:
    n = int(rng.integers(lo, hi + 1))
    if total + n > count_positions:
      return samples
    p = int(rng.integers(max(1, n // 8), max(1, n // 2) + 1))
    c = n + 1 - p
    samples.append(packing.Sample(
        prompt_tokens=rng.integers(0, vocab_size, p),
        completion_tokens=rng.integers(0, vocab_size, c),
        # Near log(1/V), as a fresh model gives: importance weights around 1, some truncated.
        behaviour_logprobs=-math.log(vocab_size) + 0.1 * rng.standard_normal(c),
        versions=np.zeros(c, np.int64),
        advantage=float(rng.standard_normal())))
    total += n


def make_batch(rng: np.random.Generator, rows: int, seq_len: int, fill: float,
               vocab_size: int) -> tuple[dict[str, np.ndarray], packing.PackStats]:
  """A packed [rows, seq_len] batch about `fill` full; samples that do not fit are dropped."""
  samples = random_samples(rng, int(fill * rows * seq_len), seq_len, vocab_size)
  while samples and packing.pack_samples(samples, seq_len)[1].num_rows > rows:
    samples.pop()  # first-fit decreasing left too little room: shed the last sample drawn
  return packing.pack_samples(samples, seq_len, num_rows=rows)


def flop_params(config: transformer.ModelConfig) -> int:
  """Parameters that cost 2 FLOPs per token in the forward pass: all of them except the
  embedding table, which is a lookup; the lm_head matmul counts (it is the table when tied).
  Norm scales and biases are counted too (they are a few thousand, far below 1%)."""
  lookup = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
  return config.num_params - lookup


def train_flops(config: transformer.ModelConfig, segment_ids_RxT: np.ndarray) -> float:
  """Model FLOPs of one forward + backward over the real tokens of a packed batch.

  Standard estimate (Kaplan et al. 2020; PaLM appendix B): 6 N per token for the matmuls
  (2 forward, 4 backward) plus 12 L T_ctx (H Dh) per token for scores and attention-weighted
  values, with T_ctx the length of the token's own sample, no causal halving (what a run of
  that sample alone would count). Padding, the dense T x T masked attention the kernel
  actually computes across packed segments, and remat's recomputation are not counted.
  """
  seg = np.asarray(segment_ids_RxT)
  rows, t = seg.shape
  real = seg > 0
  # Flat id row * T + segment id: one per packed sample; bincount gives each sample's length.
  lengths = np.bincount((np.arange(rows)[:, None] * (t + 1) + seg)[real])
  num_tokens = int(real.sum())
  attn_width = config.num_heads * config.head_dim
  attention = 12 * config.num_layers * attn_width * float(np.sum(lengths.astype(np.float64)**2))
  return 6.0 * flop_params(config) * num_tokens + attention


# ---------------------------------------------------------------------------------------------
# One model: build, compile, time.


def bench_model(name: str, args: argparse.Namespace, mesh) -> dict:
  config = dataclasses.replace(MODEL_PRESETS[name], dtype=args.dtype, remat=args.remat)
  rng = np.random.default_rng(args.seed)
  batch_RxT, stats = make_batch(rng, args.rows, args.seq_len, args.fill, config.vocab_size)
  flops = train_flops(config, batch_RxT['segment_ids'])
  batch_MxRxT = packing.split_microbatches({k: batch_RxT[k] for k in train.BATCH_KEYS},
                                           args.micro)
  batch_MxRxT = jax.device_put(batch_MxRxT, sharding_lib.batch_sharding(mesh, leading_dims=1))

  opt_config = config_lib.OptimizerConfig(lr=1e-6)
  optimizer = train.make_optimizer(opt_config)
  params = jax.jit(functools.partial(transformer.init_params, config))(
      jax.random.PRNGKey(args.seed))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  state, shardings = train.create_sharded_state(params, optimizer, mesh)
  del params  # the state holds the placed copy; this one would double the memory
  step_fn = train.jit_train_step(
      train.make_train_step(config, config_lib.LossConfig(), optimizer,
                            train.lr_schedule(opt_config)),
      shardings, mesh)

  t0 = time.perf_counter()
  compiled = step_fn.lower(state, batch_MxRxT).compile()
  compile_s = time.perf_counter() - t0

  for _ in range(args.warmup):
    state, metrics = jax.block_until_ready(compiled(state, batch_MxRxT))
  step_s = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch_MxRxT))
    step_s.append(time.perf_counter() - t0)

  median = float(np.median(step_s))
  devices = mesh.devices.ravel()
  return dict(
      model=name, params=int(num_params), flop_params=flop_params(config),
      mesh=','.join(str(mesh.shape[a]) for a in sharding_lib.MESH_AXES),
      devices=len(devices), device_kind=devices[0].device_kind, dtype=args.dtype,
      remat=args.remat, rows=args.rows, seq_len=args.seq_len, micro=args.micro,
      samples=stats.num_samples, tokens=stats.num_tokens, fill=stats.fill,
      compile_s=compile_s, step_s_median=median, step_s_min=float(np.min(step_s)),
      tokens_per_s=stats.num_tokens / median, flops_per_step=flops, flop_per_s=flops / median,
      loss=float(metrics['loss']), model_config=dataclasses.asdict(config))


# ---------------------------------------------------------------------------------------------
# Output.


def _si(x: float) -> str:
  """1234567 -> '1.23M': three significant digits and a metric prefix."""
  for scale, prefix in ((1e15, 'P'), (1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
    if abs(x) >= scale:
      return f'{x / scale:.3g}{prefix}'
  return f'{x:.3g}'


TABLE_COLUMNS = (  # header, row -> cell
    ('model', lambda r: r['model']),
    ('params', lambda r: _si(r['params'])),
    ('mesh', lambda r: r['mesh']),
    ('device', lambda r: f"{r['devices']}x {r['device_kind']}"),
    ('dtype', lambda r: r['dtype'] + (' remat' if r['remat'] else '')),
    ('tokens/step', lambda r: f"{r['tokens']} ({r['fill']:.0%})"),
    ('compile s', lambda r: f"{r['compile_s']:.2f}"),
    ('step s med', lambda r: f"{r['step_s_median']:.4f}"),
    ('step s min', lambda r: f"{r['step_s_min']:.4f}"),
    ('tokens/s', lambda r: f"{r['tokens_per_s']:.0f}"),
    ('FLOP/s', lambda r: _si(r['flop_per_s'])),
)


def format_table(results: list[dict]) -> str:
  cells = [[h for h, _ in TABLE_COLUMNS]] + [[f(r) for _, f in TABLE_COLUMNS] for r in results]
  widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
  # Text left-aligned, numbers right-aligned, as a reader scans them.
  left = {'model', 'mesh', 'device', 'dtype'}
  lines = []
  for row in cells:
    lines.append('  '.join(c.ljust(w) if h in left else c.rjust(w)
                           for (h, _), c, w in zip(TABLE_COLUMNS, row, widths)).rstrip())
  lines.insert(1, '  '.join('-' * w for w in widths))
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  need = int(np.prod(args.mesh))
  devices = jax.devices()
  if len(devices) < need:
    raise SystemExit(f'--mesh={",".join(map(str, args.mesh))} needs {need} devices, '
                     f'{len(devices)} available (on CPU pass --devices={need})')
  mesh = sharding_lib.make_mesh(*args.mesh, devices=devices[:need])
  results = [bench_model(name, args, mesh) for name in args.model]
  report = dict(
      config={k: v for k, v in vars(args).items() if k != 'out'} | {'mesh': list(args.mesh)},
      jax_version=jax.__version__, platform=devices[0].platform, results=results)
  print(format_table(results), flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=2)
  print(f'wrote {args.out}')
  return report


if __name__ == '__main__':
  main()
