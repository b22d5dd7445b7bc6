"""Generators as Ray actors: weight-sync time against the number of actors, and the per-step
overhead of Ray placement against the inline engine, in one run.

  python -m pipelinerl_jax.bench.ray_sync [--sizes quick,50m] [--actors 1,2,4] [--out PATH]

One local Ray cluster (`--cpus` logical CPUs) serves every measurement; JAX engines in the
actors, one core each (shared round-robin when there are more actors than cores).

Weight sync, per model size and N actors, after 10 untimed updates: `sync_ms` is the time of
`update_params(params, v)` (params to host, one `ray.put` into the object store) until every
actor has version v on its device (each read the one shared copy zero-copy; its engine switches
at its next token step); `put_ms` is the `update_params` call alone (the trainer's share: after
it returns the trainer may donate its params). Medians and minima over --repeats: `ray.put` is
bimodal, fast when the object store reuses memory an older version freed and several times
slower when it touches fresh pages. `memcpy_ms`: one single-threaded copy of the params' bytes.

Per-step overhead: the same workload (--groups prompts x 4 samples x --tokens tokens) through
the inline JAX engine in this process and through one actor with as many slots. `ms/step` is
wall time per decode step; for Ray also the actor's own engine time per step, and the
difference: what placement adds (submitting, polling, shipping completions back). The inline
engine uses this process's cores, the actor its one core: compare the overhead column, not
the raw ms/step.

Nothing here asserts timing; a shared host is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

SIZES = {  # name: (vocab, hidden, layers, heads, kv_heads, intermediate), head_dim 64
    'quick': (256, 128, 2, 2, 1, 256),
    '50m': (16384, 512, 8, 8, 4, 2048),
    '250m': (32768, 1024, 16, 16, 8, 2816),
}


def model_config(size: str):
  from pipelinerl_jax.models import transformer
  v, d, l, h, k, f = SIZES[size]
  return transformer.ModelConfig(vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=l,
                                 num_heads=h, num_kv_heads=k, head_dim=64, qkv_bias=True,
                                 max_position_embeddings=512, architecture='Qwen2ForCausalLM')


def memcpy_ms(nbytes: int) -> float:
  import numpy as np
  src = np.ones(nbytes // 4, np.float32)
  dst = np.zeros_like(src)
  times = []
  for _ in range(4):
    t = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times[1:])


def requests(groups: int, tokens: int, tag: str):
  from pipelinerl_jax.generation import api
  return [api.Request(f'{tag}{g}/{j}', [3 + g % 50, 4, 5, 6], api.SamplingParams(
      max_tokens=tokens), seed=10 * g + j, metadata=dict(group=f'{tag}{g}', index=j))
          for g in range(groups) for j in range(4)]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--sizes', default='quick,50m')
  parser.add_argument('--actors', default='1,2,4')
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument('--groups', type=int, default=8)
  parser.add_argument('--tokens', type=int, default=32)
  parser.add_argument('--cpus', type=int, default=0, help='local cluster CPUs (0 = max actors)')
  parser.add_argument('--out', default='ray_sync.json')
  args = parser.parse_args(argv)
  sizes = args.sizes.split(',')
  actor_counts = [int(n) for n in args.actors.split(',')]

  import jax
  from pipelinerl_jax import cluster
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.generation import api
  from pipelinerl_jax.generation import engines
  from pipelinerl_jax.generation.actors import generator
  from pipelinerl_jax.generation.actors import pool as pool_lib
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models import transformer

  session = cluster.connect(config_lib.ClusterConfig(num_cpus=args.cpus or max(actor_counts)))
  sync_rows, step_rows = [], []
  try:
    with tempfile.TemporaryDirectory() as tmp:
      for size in sizes:
        config = model_config(size)
        model_dir = pathlib.Path(tmp) / size
        params = [transformer.init_params(config, jax.random.PRNGKey(i)) for i in range(2)]
        hf_checkpoint.save_params(params[0], config, model_dir)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params[0]))
        spec = generator.GeneratorSpec(
            engine=engines.EngineSpec(backend='jax', num_slots=4 * args.groups,
                                      max_seq_len=4 + args.tokens, eos_token_ids=()),
            model_dir=str(model_dir), model_overrides={})
        copy = memcpy_ms(nbytes)
        for n in actor_counts:
          pool = pool_lib.RayGenerators(spec, config, num_generators=n, params=params[0],
                                        version=0)
          try:
            for r in range(1, 11):  # untimed: the object store's pages are touched here
              pool.update_params(params[r % 2], r)
              pool.wait_version(r)
            put, sync = [], []
            for r in range(11, args.repeats + 11):
              t0 = time.perf_counter()
              pool.update_params(params[r % 2], r)
              t1 = time.perf_counter()
              pool.wait_version(r)
              put.append(t1 - t0)
              sync.append(time.perf_counter() - t0)
            row = dict(size=size, params=sum(x.size for x in jax.tree.leaves(params[0])),
                       mb=nbytes / 2**20, actors=n, put_ms=1e3 * statistics.median(put),
                       put_ms_min=1e3 * min(put), sync_ms=1e3 * statistics.median(sync),
                       sync_ms_min=1e3 * min(sync), memcpy_ms=copy)
            sync_rows.append(row)
            print(f'sync  {size:>6} N={n}  {row["mb"]:7.1f} MB  put {row["put_ms"]:8.1f} ms  '
                  f'sync {row["sync_ms"]:8.1f} ms  (memcpy {copy:6.2f} ms)', flush=True)
            if n == 1:  # the per-step overhead, on this size
              step_rows.append(_overhead(size, config, params[0], pool, spec.engine, args,
                                         requests, engines, api))
          finally:
            pool.close()
  finally:
    session.close()

  print(f'\n{"size":>6} {"MB":>7} {"actors":>6} {"put_ms":>8} {"(min)":>7} {"sync_ms":>8} '
        f'{"(min)":>7} {"memcpy_ms":>9}')
  for r in sync_rows:
    print(f'{r["size"]:>6} {r["mb"]:7.1f} {r["actors"]:>6} {r["put_ms"]:8.1f} '
          f'{r["put_ms_min"]:7.1f} {r["sync_ms"]:8.1f} {r["sync_ms_min"]:7.1f} '
          f'{r["memcpy_ms"]:9.2f}')
  print(f'\n{"size":>6} {"steps":>6} {"inline ms/step":>14} {"ray ms/step":>11} '
        f'{"actor engine ms/step":>20} {"ray overhead ms/step":>20}')
  for r in step_rows:
    print(f'{r["size"]:>6} {r["decode_steps"]:>6} {r["inline_ms_per_step"]:14.2f} '
          f'{r["ray_ms_per_step"]:11.2f} {r["actor_engine_ms_per_step"]:20.2f} '
          f'{r["ray_overhead_ms_per_step"]:20.2f}')
  result = dict(date=time.strftime('%Y-%m-%d %H:%M'), host=platform.node(),
                cpus=os.cpu_count(), load_average=os.getloadavg(), argv=sys.argv[1:],
                sync=sync_rows, step_overhead=step_rows)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  print(f'\nwrote {args.out}')
  return result


def _overhead(size, config, params, pool, engine_spec, args, requests, engines, api) -> dict:
  """The same workload inline and through `pool` (one actor, the same engine), each once warmed
  up."""
  inline = engines.make_engine(engine_spec, config, params=params)
  api.generate(inline, requests(args.groups, args.tokens, 'warm'))
  before = inline.stats()
  t0 = time.perf_counter()
  api.generate(inline, requests(args.groups, args.tokens, 'timed'))
  inline_s = time.perf_counter() - t0
  inline_steps = inline.stats()['decode_steps'] - before['decode_steps']
  inline.close()

  api.generate(pool, requests(args.groups, args.tokens, 'warm'))
  before = pool.stats()['generators'][0]
  t0 = time.perf_counter()
  api.generate(pool, requests(args.groups, args.tokens, 'timed'))
  ray_s = time.perf_counter() - t0
  after = pool.stats()['generators'][0]
  steps = after['decode_steps'] - before['decode_steps']
  engine_s = after['step_seconds'] - before['step_seconds']
  return dict(size=size, decode_steps=steps, inline_ms_per_step=1e3 * inline_s / inline_steps,
              ray_ms_per_step=1e3 * ray_s / steps, actor_engine_ms_per_step=1e3 * engine_s / steps,
              ray_overhead_ms_per_step=1e3 * (ray_s - engine_s) / steps)


if __name__ == '__main__':
  main()
