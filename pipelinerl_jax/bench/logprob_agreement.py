"""How far vLLM's log mu is from the trainer's log pi, per serving dtype and lm_head precision.

  python -m pipelinerl_jax.bench.logprob_agreement [--quick] [--size 50m | --model-dir DIR]

A random Qwen2 model (`bench.weight_sync` sizes; params x --scale so that the distributions are
peaked like a trained model's) is saved in fp32 and served by `VllmEngine` in each variant:
  fp32               the reference path: should agree to ~1e-6
  bf16               weights and compute in bf16, logits from a bf16 matmul
  bf16+lm_head_fp32  same, with vLLM's `head_dtype=float32` (the last matmul in fp32)
Each variant samples --requests x --tokens tokens at temperature 1 and compares their log mu
with `transformer.token_logprobs` of the fp32 params as two trainers compute it: all in fp32,
and in bf16 with an fp32 lm_head (`model.dtype='bfloat16'`, `model.lm_head_fp32=True`).
Each variant runs in its own process (one in-process vLLM per process). Prints a table, writes
JSON; nothing asserts accuracy here (tests/vllm_engine_test.py does for fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

from pipelinerl_jax.bench import one_process

VARIANTS = {'fp32': ('float32', False), 'bf16': ('bfloat16', False),
            'bf16+lm_head_fp32': ('bfloat16', True)}
HEADER = (f'{"variant":<18} {"tokens":>6}   vs fp32 trainer: {"mean|d|":>8} {"max|d|":>8}'
          f'   vs bf16 trainer: {"mean|d|":>8} {"max|d|":>8}')


def run_variant(variant: str, args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pipelinerl_jax.bench import weight_sync as ws_bench
  from pipelinerl_jax.generation import api
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  from pipelinerl_jax.models import transformer

  if args.model_dir:  # a real checkpoint, as stored
    model_dir = pathlib.Path(args.model_dir)
    config = hf_schema.load_config(model_dir)
    params = hf_checkpoint.load_params(model_dir, config)
  else:
    config = ws_bench.model_config(args.size)
    params = jax.tree.map(lambda x: x * args.scale,
                          transformer.init_params(config, jax.random.PRNGKey(0)))
    model_dir = pathlib.Path(args.workdir) / f'qwen2_{args.size}_x{args.scale}'
    if not (model_dir / hf_schema.CONFIG_FILE).exists():
      hf_checkpoint.save_params(params, config, model_dir, dtype='float32')
  dtype, head_fp32 = VARIANTS[variant]
  max_len = 16 + args.tokens
  engine = vllm_engine.VllmEngine(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=args.requests, max_model_len=max_len, kv_cache_bytes=64 << 20, dtype=dtype,
      lm_head_fp32=head_fp32))
  rng = np.random.default_rng(0)
  requests = [api.Request(f'r{i}', [int(t) for t in rng.integers(0, config.vocab_size, 16)],
                          api.SamplingParams(temperature=1.0, max_tokens=args.tokens), seed=i)
              for i in range(args.requests)]
  try:
    engine.update_params(params, 1)  # served as the trainer publishes them (and reloaded)
    completions = api.generate(engine, requests)
    assert all((c.versions == 1).all() for c in completions)
  finally:
    engine.close()
  # The trainer's two settings: all fp32, and bf16 compute (fp32 params) with an fp32 lm_head.
  trainer_bf16 = dataclasses.replace(config, dtype='bfloat16', lm_head_fp32=True)
  # One program per trainer setting and sequence length, not an op-by-op trace per completion.
  token_logprobs = jax.jit(transformer.token_logprobs, static_argnums=1)
  deltas = {'fp32': [], 'bf16': []}
  for c in completions:
    seq = jnp.array([c.prompt_tokens + c.tokens.tolist()])
    t = seq.shape[1] - 1
    for ref, cfg in (('fp32', config), ('bf16', trainer_bf16)):
      lp, _ = token_logprobs(params, cfg, seq[:, :-1], seq[:, 1:], jnp.arange(t)[None],
                             jnp.ones((1, t), jnp.int32))
      deltas[ref].append(np.abs(c.logprobs - np.asarray(lp[0, len(c.prompt_tokens) - 1:])))
  out = dict(variant=variant, size=args.size, scale=args.scale, model_dir=str(model_dir))
  for ref, ds in deltas.items():
    d = np.concatenate(ds)
    out.update({f'tokens': int(d.size), f'mean_abs_vs_{ref}_trainer': float(d.mean()),
                f'max_abs_vs_{ref}_trainer': float(d.max()),
                f'p99_abs_vs_{ref}_trainer': float(np.quantile(d, 0.99))})
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='tiny model, few tokens')
  parser.add_argument('--size', default='50m', help='a bench.weight_sync size')
  parser.add_argument('--scale', type=float, default=4.0, help='params multiplier')
  parser.add_argument('--model-dir', default='', help='an HF checkpoint instead of a random model')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--tokens', type=int, default=64)
  parser.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/logprob_agreement')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/logprob_agreement.json')
  parser.add_argument('--one', help=argparse.SUPPRESS)  # internal: one variant, print JSON
  args = parser.parse_args(argv)
  if args.quick:
    args.size, args.requests, args.tokens = 'quick', 4, 16
  if args.one:
    one_process.emit(run_variant(args.one, args))
    return
  variants = [v for v in args.variants.split(',') if v]
  if set(variants) - set(VARIANTS):
    parser.error(f'unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from '
                 f'{list(VARIANTS)}')
  print(HEADER, flush=True)
  rows = []
  for variant in variants:
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.logprob_agreement', f'--one={variant}',
           f'--size={args.size}', f'--scale={args.scale}', f'--requests={args.requests}',
           f'--tokens={args.tokens}', f'--workdir={args.workdir}', f'--model-dir={args.model_dir}']
    r = one_process.run(cmd, f'variant {variant}',
                        env={**os.environ, 'VLLM_ENABLE_V1_MULTIPROCESSING': '0'})
    rows.append(r)
    print(f'{variant:<18} {r["tokens"]:>6} {"":>17} {r["mean_abs_vs_fp32_trainer"]:>8.2e} '
          f'{r["max_abs_vs_fp32_trainer"]:>8.2e} {"":>17} {r["mean_abs_vs_bf16_trainer"]:>8.2e} '
          f'{r["max_abs_vs_bf16_trainer"]:>8.2e}', flush=True)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(rows=rows), indent=1))
  print(f'wrote {path}')


if __name__ == '__main__':  # vLLM may spawn processes: keep the guard
  main()
