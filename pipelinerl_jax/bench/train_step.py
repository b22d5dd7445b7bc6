"""Benchmark of the jitted train step (train.py): compile time, step time, tokens/s, FLOP/s.

  python -m pipelinerl_jax.bench.train_step --model=tiny,50m --rows=8 --seq_len=512 --micro=2
  python -m pipelinerl_jax.bench.train_step --model=tiny --mesh=1,4,2 --devices=8   # CPU
  python -m pipelinerl_jax.bench.train_step --quick                                 # seconds
  python -m pipelinerl_jax.bench.train_step --model=qwen2.5-1.5b --rows=8 --seq_len=8192 \
      --micro=8 --dtype=bfloat16 --attention=cudnn --remat --remat_policy=attention \
      --lm_head=dtype --profile                                                      # a GPU

Each model is randomly initialized from a preset (no download) and trained on one fixed packed
batch: random samples of varying lengths put through `packing.pack_samples`, so rows hold
several segments and the segment mask does real work. The step is compiled ahead of time
(`compile_s`; XLA's own memory figure for it, `compiled_peak_bytes`), run `--warmup` times, then
timed `--steps` times (fewer past `--max_timed_s`), each ended by `jax.block_until_ready`.

Where the time goes: `flops_per_step` are model FLOPs (`train_flops`); `executed_flops` what the
program runs: the jaxpr's matmuls (remat's recomputation included; `bench.step_profile`) plus
the attention kernel's work, which the jaxpr does not show as matmuls (cuDNN's causal pairs,
blockwise's visited tiles; `attention_kernel_flops`). `xla_cost_flops` is XLA's cost analysis
as is (it counts a loop's body once). `--profile` compiles the step a second time with XLA's
command buffers (CUDA graphs) off (`step_profile.NO_COMMAND_BUFFERS`; inside one, a trace cannot
tell the kernels' ops apart), times one step of it and traces one more, split into attention,
matmul, lm_head, optimizer and other (`profile`); the timed steps keep XLA's defaults. Prints
one table row per model and writes one JSON object to `--out`.
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
from pipelinerl_jax.bench import step_profile  # noqa: E402
from pipelinerl_jax.models.layers import attention as attention_lib  # noqa: E402
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
               'remat', 'remat_policy', 'attention', 'lm_head', 'rows', 'seq_len', 'micro',
               'samples', 'tokens', 'fill', 'compile_s', 'compiled_peak_bytes', 'step_s_median',
               'step_s_min', 'tokens_per_s', 'flops_per_step', 'flop_per_s', 'executed_flops',
               'matmul_flops', 'attention_kernel_flops', 'xla_cost_flops', 'loss')


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
  p.add_argument('--remat_policy', default='full', choices=tuple(transformer.REMAT_POLICIES),
                 help='with --remat, what each layer keeps (transformer.REMAT_POLICIES)')
  p.add_argument('--attention', default='blockwise', choices=attention_lib.IMPLEMENTATIONS)
  p.add_argument('--lm_head', default='fp32', choices=('fp32', 'dtype'),
                 help='fp32: an fp32 lm_head matmul; dtype: in --dtype, fp32 accumulation')
  p.add_argument('--max_segments', type=int, default=64, help='samples per packed row at most')
  p.add_argument('--max_timed_s', type=float, default=0.0,
                 help='stop timing after this many seconds (at least one step; 0 = off)')
  p.add_argument('--profile', action='store_true',
                 help='compile again with command buffers off, trace a step and split its '
                      'kernel time (bench.step_profile)')
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
               vocab_size: int, max_segments: int = 64
               ) -> tuple[dict[str, np.ndarray], packing.PackStats]:
  """A packed [rows, seq_len] batch about `fill` full; samples that do not fit are dropped."""
  samples = random_samples(rng, int(fill * rows * seq_len), seq_len, vocab_size)
  pack = lambda **kw: packing.pack_samples(samples, seq_len, max_segments=max_segments, **kw)
  while samples and pack()[1].num_rows > rows:
    samples.pop()  # first-fit decreasing left too little room: shed the last sample drawn
  return pack(num_rows=rows)


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


def attention_kernel_flops(config: transformer.ModelConfig, segment_ids_MxRxT: np.ndarray
                           ) -> float:
  """FLOPs of one step's attention kernels that `step_profile.matmul_flops` cannot see: cuDNN's
  (a custom call: 4 Dh per causal (query, key) pair and head forward, 10 backward) and
  blockwise's (loops of data-dependent length: every visited tile whole, the same per pair).
  A remat policy that keeps no attention residuals ('full') runs the forward again. Dense
  attention is plain matmuls, counted by the jaxpr: 0 here."""
  if config.attention == 'dense':
    return 0.0
  per_pair = config.head_dim * (14 + (4 if config.remat and config.remat_policy == 'full' else 0))
  heads = config.num_layers * config.num_heads
  if config.attention == 'cudnn':
    seg = np.asarray(segment_ids_MxRxT).reshape(-1, segment_ids_MxRxT.shape[-1])
    t = seg.shape[1]
    real = seg > 0
    lengths = np.bincount((np.arange(len(seg))[:, None] * (t + 1) + seg)[real]).astype(float)
    return heads * per_pair * float(np.sum(lengths * (lengths + 1) / 2))
  t = segment_ids_MxRxT.shape[-1]
  bq, bk = min(config.attention_block_q, t), min(config.attention_block_kv, t)
  # One trip count for a micro-batch's rows (the reduction over rows), run on every row.
  tiles = 0
  for micro_RxT in np.asarray(segment_ids_MxRxT):
    fwd, bwd = attention_lib.tiles_visited(micro_RxT, bq, bk)
    tiles += len(micro_RxT) * (fwd * (per_pair - 10 * config.head_dim) + bwd * 10 * config.head_dim)
  return heads * float(tiles) * bq * bk


def _xla_flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 -- not every backend offers it
    return None
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops']) if cost and 'flops' in cost else None


# ---------------------------------------------------------------------------------------------
# One model: build, compile, time.


def model_config(name: str, args: argparse.Namespace) -> transformer.ModelConfig:
  return dataclasses.replace(MODEL_PRESETS[name], dtype=args.dtype, remat=args.remat,
                             remat_policy=args.remat_policy, attention=args.attention,
                             lm_head_fp32=args.lm_head == 'fp32')


def bench_model(name: str, args: argparse.Namespace, mesh, memory_limit: int = 0) -> dict:
  """One model's row. With `memory_limit` > 0, a program whose compiled peak exceeds it is
  reported (`skipped`) and not run."""
  config = model_config(name, args)
  rng = np.random.default_rng(args.seed)
  batch_RxT, stats = make_batch(rng, args.rows, args.seq_len, args.fill, config.vocab_size,
                                args.max_segments)
  flops = train_flops(config, batch_RxT['segment_ids'])
  batch_MxRxT = packing.split_microbatches({k: batch_RxT[k] for k in train.BATCH_KEYS},
                                           args.micro)
  attention_flops = attention_kernel_flops(config, batch_MxRxT['segment_ids'])
  batch_MxRxT = jax.device_put(batch_MxRxT, sharding_lib.batch_sharding(mesh, leading_dims=1))

  opt_config = config_lib.OptimizerConfig(lr=1e-6)
  optimizer = train.make_optimizer(opt_config)
  params = jax.jit(functools.partial(transformer.init_params, config))(
      jax.random.PRNGKey(args.seed))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  state, shardings = train.create_sharded_state(params, optimizer, mesh)
  del params  # the state holds the placed copy; this one would double the memory
  step = train.make_train_step(config, config_lib.LossConfig(), optimizer,
                               train.lr_schedule(opt_config))
  step_fn = train.jit_train_step(step, shardings, mesh)

  t0 = time.perf_counter()
  lowered = step_fn.lower(state, batch_MxRxT)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes) if mem is not None else None
  try:  # the accounting must not cost the timing
    matmuls, while_loops = step_profile.matmul_flops(jax.make_jaxpr(step)(state, batch_MxRxT))
  except Exception:  # noqa: BLE001
    matmuls, while_loops = float('nan'), None
  devices = mesh.devices.ravel()
  result = dict(
      model=name, params=int(num_params), flop_params=flop_params(config),
      mesh=sharding_lib.mesh_text(mesh.shape[a] for a in sharding_lib.MESH_AXES),
      devices=len(devices), device_kind=devices[0].device_kind, dtype=args.dtype,
      remat=args.remat, remat_policy=args.remat_policy if args.remat else 'none',
      attention=args.attention, lm_head=args.lm_head, rows=args.rows, seq_len=args.seq_len,
      micro=args.micro, samples=stats.num_samples, tokens=stats.num_tokens, fill=stats.fill,
      compile_s=compile_s, compiled_peak_bytes=peak, flops_per_step=flops,
      executed_flops=matmuls + attention_flops, matmul_flops=matmuls,
      attention_kernel_flops=attention_flops, while_loops=while_loops,
      xla_cost_flops=_xla_flops(compiled), model_config=dataclasses.asdict(config))
  if memory_limit and peak and peak > memory_limit:
    return dict(result, skipped=f'compiled peak {peak / 2**30:.1f} GiB > {memory_limit / 2**30:.1f}')

  for _ in range(args.warmup):
    state, metrics = jax.block_until_ready(compiled(state, batch_MxRxT))
  step_s = []
  while len(step_s) < args.steps and not (
      args.max_timed_s and step_s and sum(step_s) + np.median(step_s) > args.max_timed_s):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch_MxRxT))
    step_s.append(time.perf_counter() - t0)
  if args.profile:
    box = dict(state=state)
    try:  # a profiler that cannot start (no CUPTI) costs the breakdown, not the timing
      result['command_buffers'] = step_profile.command_buffers(compiled.as_text())
      result['profile'] = profile_step(lowered, box, batch_MxRxT)
    except Exception as e:
      result['profile'] = dict(error=f'{type(e).__name__}: {e}'.splitlines()[0][:300])
    state = box['state']

  median = float(np.median(step_s))
  return dict(result, step_s_median=median, step_s_min=float(np.min(step_s)), step_s_runs=step_s,
              tokens_per_s=stats.num_tokens / median, flop_per_s=flops / median,
              executed_flop_per_s=result['executed_flops'] / median,
              loss=float(metrics['loss']))


def profile_step(lowered, box: dict, batch_MxRxT) -> dict:
  """The step compiled again with command buffers off: one warm-up step, one timed (`step_s`:
  what the command buffers are worth beside the timed run's), one traced and split by
  step_profile. `box['state']` is the train state, donated and replaced at every step."""
  t0 = time.perf_counter()
  compiled = lowered.compile(compiler_options=step_profile.NO_COMMAND_BUFFERS)
  compile_s = time.perf_counter() - t0

  def one_step():
    box['state'], _ = compiled(box['state'], batch_MxRxT)
    return box['state']

  jax.block_until_ready(one_step())
  t0 = time.perf_counter()
  jax.block_until_ready(one_step())
  step_s = time.perf_counter() - t0
  text = compiled.as_text()
  return dict(step_profile.profile_breakdown(one_step, text),
              compiler_options=step_profile.NO_COMMAND_BUFFERS, compile_s=compile_s,
              step_s=step_s, command_buffers=step_profile.command_buffers(text))


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
    ('numerics', lambda r: (f"{r['dtype']} {r['attention']} remat={r['remat_policy']} "
                            f"head={r['lm_head']}")),
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
  left = {'model', 'mesh', 'device', 'numerics'}
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
