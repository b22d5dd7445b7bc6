"""Generation engine throughput: tokens/s of the JAX engine and vLLM at several concurrencies H,
with and without in-flight weight updates.

  python -m pipelinerl_jax.bench.generation [--quick] [--out PATH] [--slots 1,8,32]
                                            [--backends jax,vllm] [--model demo]
                                            [--engine page_size=16,sync_every=4,...]

For each backend, H and mode, a warm-up compiles every shape it needs, then --repeats timed
runs of the same workload shapes (other seeds) keep at most H requests in flight; the median is
reported. Modes:
  none              no update
  update            new weights every --update-every token steps, stale KV cache kept
  update+recompute  same, every in-flight sequence re-prefilled under the new weights (JAX only)
The model is random (throughput does not depend on the weights' values): --model 'full' (the
default), 'quick' (--quick) or 'demo' (the CPU demo's shapes: `make demo`'s model, H = 128,
8-token prompts, 12 new tokens). vLLM serves it from a Qwen2 checkpoint written under --workdir in
fp32, one in-process engine for every H (its max_num_seqs is the largest H) and receives updates
as DLPack views of the same JAX params. --engine sets JAX EngineConfig fields (name=value, comma
separated). Prints a table and writes the rows as JSON. Nothing here asserts timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine as engine_lib
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models import transformer

MODES = ('none', 'update', 'update+recompute')
BACKENDS = ('jax', 'vllm')


MODELS = ('full', 'quick', 'demo')


def model_config(model: str) -> transformer.ModelConfig:
  """Qwen2-shaped (q/k/v biases) so vLLM can serve it; head_dim 32 (vLLM on CPU needs >= 32)."""
  if model == 'quick':
    return transformer.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                   qkv_bias=True)
  if model == 'demo':  # config.DemoModelConfig's shapes over the character tokenizer
    return transformer.ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=256,
                                   num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                                   qkv_bias=True)
  return transformer.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384,
                                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                                 qkv_bias=True)


def workload(num_requests: int, vocab: int, max_prompt: int, max_new: int, seed: int):
  """Prompts of 8..max_prompt tokens and budgets of max_new/2..max_new: sequences end at
  different steps, so slots are refilled while others decode. Shapes depend on `num_requests`
  only, never on `seed`."""
  shape_rng = np.random.default_rng(0)
  lengths = shape_rng.integers(8, max_prompt + 1, num_requests)
  budgets = shape_rng.integers(max(1, max_new // 2), max_new + 1, num_requests)
  rng = np.random.default_rng(seed)
  return [api.Request(f'{seed}-{i}', list(rng.integers(0, vocab, n)),
                      api.SamplingParams(temperature=1.0, max_tokens=int(m)),
                      seed=seed * 100003 + i)
          for i, (n, m) in enumerate(zip(lengths, budgets))]


def run_once(eng: api.Engine, requests, params_for: Callable[[int], Any], update_every: int,
             max_in_flight: int, version: int) -> dict:
  """Steps until the workload is done, keeping at most `max_in_flight` requests submitted and
  publishing `params_for(version)` every `update_every` steps (tokens/s counts prefill, updates
  and host bookkeeping: it is end-to-end). Versions continue from `version`."""
  queued = list(requests)
  steps = tokens = updates = busy_total = 0
  start = time.perf_counter()
  while queued or eng.num_unfinished:
    while queued and eng.num_unfinished < max_in_flight:
      eng.submit(queued.pop(0))
    if update_every and steps and steps % update_every == 0:
      version += 1
      eng.update_params(params_for(version), version)
      updates += 1
    busy_total += min(eng.num_unfinished, max_in_flight)
    for c in eng.step():
      tokens += len(c.tokens)
    steps += 1
  wall = time.perf_counter() - start
  return dict(wall_s=wall, tokens=tokens, steps=steps, tokens_per_s=tokens / wall,
              ms_per_step=1e3 * wall / steps, mean_busy=busy_total / steps, updates=updates,
              version=version)


def measure(eng: api.Engine, args, config, h: int, every: int, param_sets) -> dict:
  """A warm-up, then the median of --repeats timed runs."""
  num_requests = max(2, args.requests_per_slot * h)
  load = lambda seed: workload(num_requests, config.vocab_size, args.max_prompt,
                               args.max_new_tokens, seed=seed)
  t0 = time.perf_counter()
  params_for = lambda version: param_sets[version % 2]
  version = run_once(eng, load(1), params_for, every, h, getattr(eng, 'version', 0))['version']
  warmup_s = time.perf_counter() - t0
  traces = sum(engine_lib.TRACES.values())
  results = []
  for rep in range(args.repeats):  # a shared host's noise is larger than small effects
    results.append(run_once(eng, load(2 + rep), params_for, every, h, version))
    version = results[-1]['version']
  result = sorted(results, key=lambda r: r['tokens_per_s'])[len(results) // 2]
  return dict(slots=h, update_every=every, requests=num_requests, warmup_s=warmup_s,
              retraces=sum(engine_lib.TRACES.values()) - traces,
              tokens_per_s_runs=[r['tokens_per_s'] for r in results], **result)


def bench(args) -> list[dict]:
  config = model_config(args.model)
  params_a = transformer.init_params(config, jax.random.PRNGKey(0))
  params_b = transformer.init_params(config, jax.random.PRNGKey(1))
  max_seq_len = args.max_prompt + args.max_new_tokens
  # Fresh copies: the engine may keep what it is given (see api.Engine.update_params).
  param_sets = [jax.tree.map(jnp.copy, p) for p in (params_a, params_b)]
  rows = []
  for backend in args.backends:
    vllm_eng = None
    if backend == 'vllm':
      from pipelinerl_jax.generation.vllm import engine as vllm_engine  # imports torch
      model_dir = pathlib.Path(args.workdir) / f'qwen2_gen_{args.model}'
      hf_checkpoint.save_params(params_a, config, model_dir, dtype='float32')
      vllm_eng = vllm_engine.VllmEngine(model_dir, vllm_engine.VllmEngineConfig(
          max_num_seqs=max(args.slots), max_model_len=max_seq_len, kv_cache_bytes=64 << 20))
    try:
      for h in args.slots:
        for mode in args.modes:
          if backend == 'vllm' and mode == 'update+recompute':
            continue  # vLLM keeps the stale KV cache
          every = 0 if mode == 'none' else args.update_every
          if vllm_eng is not None:
            row = measure(vllm_eng, args, config, h, every, param_sets)
            stats = {}
          else:
            engine_config = engine_lib.EngineConfig(num_slots=h, max_seq_len=max_seq_len,
                                                    min_prefill_len=args.min_prefill_len,
                                                    recompute_kv=mode == 'update+recompute',
                                                    **args.engine)
            with engine_lib.JaxEngine(config, param_sets[0], engine_config) as eng:
              row = measure(eng, args, config, h, every, param_sets)
              stats = eng.stats()
              stats['kv_bytes'] = sum(x.nbytes for x in jax.tree.leaves(eng._state[0]))
          row = dict(backend=backend, mode=mode, prefill_calls=stats.get('prefill_calls', 0),
                     kv_recomputes=stats.get('kv_recomputes', 0),
                     preemptions=stats.get('preemptions', 0), kv_bytes=stats.get('kv_bytes'),
                     **row)
          rows.append(row)
          print_row(row)
    finally:
      if vllm_eng is not None:
        vllm_eng.close()
  return rows


HEADER = (f'{"backend":<7} {"H":>3} {"mode":<17} {"tok/s":>9} {"ms/step":>8} {"busy":>5} {"steps":>6} '
          f'{"tokens":>7} {"updates":>7} {"warmup_s":>8} {"retrace":>7}')


def print_row(r):
  print(f'{r["backend"]:<7} {r["slots"]:>3} {r["mode"]:<17} {r["tokens_per_s"]:>9.0f} {r["ms_per_step"]:>8.2f} '
        f'{r["mean_busy"]:>5.1f} {r["steps"]:>6} {r["tokens"]:>7} {r["updates"]:>7} '
        f'{r["warmup_s"]:>8.1f} {r["retraces"]:>7}', flush=True)


def parse_engine_fields(parser, text: str) -> dict[str, Any]:
  """'name=value,...' -> EngineConfig fields, each value parsed as its field's type."""
  fields = {f.name: f for f in dataclasses.fields(engine_lib.EngineConfig)}
  out = {}
  for item in filter(None, text.split(',')):
    name, _, value = item.partition('=')
    if name not in fields or not value:
      parser.error(f'--engine: {item!r} is not name=value of an EngineConfig field '
                   f'({", ".join(fields)})')
    default = fields[name].default
    out[name] = (value.lower() in ('1', 'true') if isinstance(default, bool)
                 else type(default)(value))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='tiny model and workload (seconds)')
  parser.add_argument('--model', choices=MODELS, default=None,
                      help="model shapes (default 'full'; 'quick' with --quick)")
  parser.add_argument('--engine', default='',
                      help='JAX EngineConfig fields, e.g. page_size=16,sync_every=1')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/generation.json')
  parser.add_argument('--slots', default=None, help='comma-separated H values')
  parser.add_argument('--modes', default=','.join(MODES))
  parser.add_argument('--backends', default=','.join(BACKENDS))
  parser.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/generation',
                      help="where the vLLM backend's checkpoint is written")
  parser.add_argument('--update-every', type=int, default=8, help='token steps between updates')
  parser.add_argument('--requests-per-slot', type=int, default=None)
  parser.add_argument('--max-prompt', type=int, default=None)
  parser.add_argument('--max-new-tokens', type=int, default=None)
  parser.add_argument('--min-prefill-len', type=int, default=None)
  parser.add_argument('--repeats', type=int, default=None, help='timed runs; the median is shown')
  args = parser.parse_args(argv)
  args.model = args.model or ('quick' if args.quick else 'full')
  defaults = (dict(slots='1,4', requests_per_slot=2, max_prompt=16, max_new_tokens=16,
                   min_prefill_len=16, repeats=1) if args.quick else
              dict(slots='128', requests_per_slot=3, max_prompt=8, max_new_tokens=12,
                   min_prefill_len=8, repeats=3) if args.model == 'demo' else
              dict(slots='1,8,32', requests_per_slot=3, max_prompt=64, max_new_tokens=128,
                   min_prefill_len=64, repeats=3))
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.slots = [int(s) for s in str(args.slots).split(',')]
  args.engine = parse_engine_fields(parser, args.engine)
  args.modes = [m for m in args.modes.split(',') if m]
  unknown = set(args.modes) - set(MODES)
  if unknown:
    parser.error(f'unknown modes {sorted(unknown)}; choose from {MODES}')
  args.backends = [b for b in args.backends.split(',') if b]
  if set(args.backends) - set(BACKENDS):
    parser.error(f'unknown backends {sorted(set(args.backends) - set(BACKENDS))}; choose from '
                 f'{BACKENDS}')

  device, config = jax.devices()[0], model_config(args.model)
  print(f'device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}; '
        f'model: D={config.hidden_size} L={config.num_layers} V={config.vocab_size}; '
        f'S={args.max_prompt + args.max_new_tokens}')
  print(HEADER)
  rows = bench(args)
  out = dict(device=str(device), backend=jax.default_backend(), host=platform.node(),
             model=dataclasses.asdict(config), args=vars(args), rows=rows)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1))
  print(f'wrote {path}')


if __name__ == '__main__':  # vLLM may spawn processes: keep the guard
  main()
