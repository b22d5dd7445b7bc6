"""Weight-sync cost of `VllmEngine`: publishing a JAX params pytree into in-process vLLM, relative
to one memcpy of the params.

  python -m pipelinerl_jax.bench.weight_sync [--quick] [--sizes 50m,250m,500m] [--out PATH]

Per size a random Qwen2 model is saved with `hf_checkpoint.save_params` under --workdir and vLLM is
started on it. `sync_s` is the median of --repeats timings of `update_params(params, v)` plus the
`step()` that applies it (no requests in flight): the DLPack views, the completeness check and
vLLM's `reload_weights` (copy into its params and re-pack for the CPU GEMM kernels).
`memcpy_s` is the median time to copy the same bytes once (numpy's single-threaded copy
between two preallocated fp32 buffers of the params' size, measured before vLLM starts).
`sync_over_memcpy` = sync_s / memcpy_s: the zero-copy path should cost about one copy plus the
re-pack. Also reported: tokens/s of a small sampled workload (8 requests x 32 tokens), with and
without an update every --update-every steps.

Each size runs in its own process (vLLM's in-process engine is one per process, and memory is
returned between sizes). Nothing here asserts timing; a shared host is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

from pipelinerl_jax.bench import one_process

SIZES = {
    # name: (vocab, hidden, layers, heads, kv_heads, intermediate); head_dim 64 (vLLM CPU)
    'quick': (256, 128, 2, 2, 1, 256),
    '50m': (16384, 512, 8, 8, 4, 2048),
    '250m': (32768, 1024, 16, 16, 8, 2816),
    '500m': (32768, 1536, 16, 24, 4, 4096),  # 491M params, ~2 GB in fp32: minutes on 2 cores
}
HEADER = (f'{"size":>6} {"params":>8} {"MB":>7} {"dtype":>8} {"sync_ms":>8} {"memcpy_ms":>9} '
          f'{"sync/memcpy":>11} {"tok/s":>7} {"tok/s+upd":>9}')


def model_config(size: str):
  from pipelinerl_jax.models import transformer
  v, d, l, h, k, f = SIZES[size]
  return transformer.ModelConfig(vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=l,
                                 num_heads=h, num_kv_heads=k, head_dim=64, qkv_bias=True,
                                 rope_theta=1e6, max_position_embeddings=4096,
                                 architecture='Qwen2ForCausalLM')


def memcpy_seconds(nbytes: int, repeats: int) -> float:
  """Median time of one single-threaded copy of `nbytes` between two preallocated, touched
  host buffers (numpy: a plain memcpy, no thread pool to wait on)."""
  import numpy as np
  src = np.ones(nbytes // 4, np.float32)
  dst = np.zeros_like(src)
  times = []
  for _ in range(repeats + 1):
    t = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t)
  return statistics.median(times[1:])  # the first touches pages


def throughput(engine, vocab: int, params_pair, update_every: int, seed: int) -> float:
  """tokens/s of 8 sampled requests x 32 tokens; new params every `update_every` steps."""
  import numpy as np
  from pipelinerl_jax.generation import api
  rng = np.random.default_rng(seed)
  for i in range(8):
    engine.submit(api.Request(f'{seed}-{i}', [int(t) for t in rng.integers(0, vocab, 16)],
                              api.SamplingParams(temperature=1.0, max_tokens=32), seed=seed + i))
  steps = tokens = 0
  start = time.perf_counter()
  while engine.num_unfinished:
    if update_every and steps and steps % update_every == 0:
      engine.update_params(params_pair[steps // update_every % 2], engine.version + 1)
    tokens += sum(len(c.tokens) for c in engine.step())
    steps += 1
  return tokens / (time.perf_counter() - start)


def run_size(size: str, args) -> dict:
  """One size, in this process."""
  import jax
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  from pipelinerl_jax.generation.transport import hf_tensors
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models import transformer

  config = model_config(size)
  model_dir = pathlib.Path(args.workdir) / f'qwen2_{size}_{args.dtype}'
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  hf_checkpoint.save_params(params, config, model_dir, dtype=args.dtype)
  other = transformer.init_params(config, jax.random.PRNGKey(1))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  zero_copy = hf_tensors.zero_copy_report(params, config)
  # Before vLLM starts: its CPU worker pins OpenMP threads, which would slow this plain copy.
  memcpy_s = memcpy_seconds(nbytes, max(args.repeats, 10))

  engine = vllm_engine.VllmEngine(
      model_dir, vllm_engine.VllmEngineConfig(max_num_seqs=8, max_model_len=256,
                                              kv_cache_bytes=64 << 20))
  try:
    syncs = []
    for rep in range(args.repeats + 1):  # the first pays one-time costs
      t = time.perf_counter()
      engine.update_params(other if rep % 2 == 0 else params, engine.version + 1)
      engine.step()
      syncs.append(time.perf_counter() - t)
    sync_s = statistics.median(syncs[1:])
    tps = throughput(engine, config.vocab_size, (params, other), 0, seed=1000)
    tps_upd = throughput(engine, config.vocab_size, (params, other), args.update_every, seed=2000)
  finally:
    engine.close()
  return dict(size=size, params=config.num_params, param_bytes=nbytes, dtype=args.dtype,
              sync_s=sync_s, sync_s_runs=syncs, memcpy_s=memcpy_s,
              sync_over_memcpy=sync_s / memcpy_s, tokens_per_s=tps,
              tokens_per_s_with_updates=tps_upd, update_every=args.update_every,
              zero_copy_tensors=int(sum(zero_copy.values())), tensors=len(zero_copy))


def print_row(r):
  print(f'{r["size"]:>6} {r["params"] / 1e6:>7.1f}M {r["param_bytes"] / 1e6:>7.0f} '
        f'{r["dtype"]:>8} {1e3 * r["sync_s"]:>8.1f} {1e3 * r["memcpy_s"]:>9.1f} '
        f'{r["sync_over_memcpy"]:>11.2f} {r["tokens_per_s"]:>7.0f} '
        f'{r["tokens_per_s_with_updates"]:>9.0f}', flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='one tiny model (smoke test)')
  parser.add_argument('--sizes', default='50m', help=f'comma-separated, of {list(SIZES)}')
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'),
                      help='checkpoint and serving dtype (params stay fp32)')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--update-every', type=int, default=8, help='token steps between updates')
  parser.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/weight_sync')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/hf_tensors.json')
  parser.add_argument('--one', help=argparse.SUPPRESS)  # internal: run one size, print JSON
  args = parser.parse_args(argv)

  if args.one:
    one_process.emit(run_size(args.one, args))
    return
  sizes = ['quick'] if args.quick else [s for s in args.sizes.split(',') if s]
  unknown = set(sizes) - set(SIZES)
  if unknown:
    parser.error(f'unknown sizes {sorted(unknown)}; choose from {list(SIZES)}')
  if args.quick:
    args.repeats = min(args.repeats, 2)

  rows = []
  print(HEADER, flush=True)
  for size in sizes:
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.weight_sync', f'--one={size}',
           f'--dtype={args.dtype}', f'--repeats={args.repeats}', f'--workdir={args.workdir}',
           f'--update-every={args.update_every}']
    rows.append(one_process.run(cmd, f'size {size}',
                                env={**os.environ, 'VLLM_ENABLE_V1_MULTIPROCESSING': '0'}))
    print_row(rows[-1])
  out = dict(host=platform.node(), cpus=os.cpu_count(), rows=rows,
             sync_over_memcpy={r['size']: r['sync_over_memcpy'] for r in rows})
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
