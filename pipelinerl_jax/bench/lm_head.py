"""How far a bf16 lm_head (fp32 accumulation) moves the trainer's log-probs from an fp32 one.

  python -m pipelinerl_jax.bench.lm_head                    # Qwen2.5-1.5B head, 512 positions
  python -m pipelinerl_jax.bench.lm_head --quick            # seconds

The head's inputs are what the bf16 model body hands it: final-norm hidden states in bf16
(random, unit RMS) and the fp32 master weights [D, V], scaled so that the logits have standard
deviation `--logit_std` (a trained model's are peaked; each scale is one table row). Targets are
sampled from the fp32 distribution, as a sampler would. Both heads run through
`transformer.logits` (the trainer's code): `lm_head_fp32=True` (fp32 matmul) and False (bf16
operands, fp32 accumulation); log pi(target) = z[target] - logsumexp(z) and the entropy are in
fp32 for both, as in `token_logprobs`. Reported: mean and max |log pi_bf16 - log pi_fp32| in nats
and the mean |entropy difference|. Prints a table and writes JSON; nothing asserts here.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.models import transformer

QUICK_DEFAULTS = dict(hidden=64, vocab=512, positions=64, logit_std='4')


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m pipelinerl_jax.bench.lm_head',
                              description=__doc__.split('\n')[0])
  p.add_argument('--hidden', type=int, default=1536, help='D (Qwen2.5-1.5B: 1536)')
  p.add_argument('--vocab', type=int, default=151936, help='V (Qwen2.5: 151936)')
  p.add_argument('--positions', type=int, default=512, help='token positions compared')
  p.add_argument('--logit_std', default='2,4,8', help='comma-separated logit scales, one row each')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--out', default='/tmp/bench_lm_head.json', help='JSON output path')
  p.add_argument('--quick', action='store_true',
                 help=f'small defaults for a smoke run: {QUICK_DEFAULTS} (explicit flags win)')
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = build_parser()
  if parser.parse_args(argv).quick:
    parser.set_defaults(**QUICK_DEFAULTS)
  args = parser.parse_args(argv)
  try:
    args.logit_std = [float(s) for s in args.logit_std.split(',') if s.strip()]
  except ValueError:
    parser.error(f'--logit_std: expected numbers like 2,4, got {args.logit_std!r}')
  if min(args.hidden, args.vocab, args.positions) < 1 or not args.logit_std:
    parser.error('--hidden, --vocab, --positions must be >= 1 and --logit_std non-empty')
  return args


def head_config(hidden: int, vocab: int, lm_head_fp32: bool) -> transformer.ModelConfig:
  return transformer.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                                 num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                                 dtype='bfloat16', lm_head_fp32=lm_head_fp32)


def logprob_and_entropy(params, config, h_RxTxD, targets_RxT):
  """log pi(target) and entropy [R, T] in fp32, by `token_logprobs`' formulas."""
  z_RxTxV = transformer.logits(params, config, h_RxTxD)
  logz = jax.nn.logsumexp(z_RxTxV, axis=-1)
  logp = jnp.take_along_axis(z_RxTxV, targets_RxT[..., None], axis=-1)[..., 0] - logz
  entropy = logz - jnp.sum(jax.nn.softmax(z_RxTxV, axis=-1) * z_RxTxV, axis=-1)
  return logp, entropy


def compare(args, logit_std: float) -> dict:
  key_h, key_w, key_t = jax.random.split(jax.random.PRNGKey(args.seed), 3)
  h = jax.random.normal(key_h, (1, args.positions, args.hidden), jnp.float32)
  h = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True))).astype(jnp.bfloat16)
  w = jax.random.normal(key_w, (args.hidden, args.vocab), jnp.float32)
  params = {'lm_head': {'kernel': w * (logit_std / np.sqrt(args.hidden))}}
  fp32, bf16 = (head_config(args.hidden, args.vocab, flag) for flag in (True, False))
  z = transformer.logits(params, fp32, h)
  targets = jax.random.categorical(key_t, z).astype(jnp.int32)
  fn = jax.jit(logprob_and_entropy, static_argnums=1)
  logp32, ent32 = fn(params, fp32, h, targets)
  logp16, ent16 = fn(params, bf16, h, targets)
  d = np.abs(np.asarray(logp16 - logp32))
  return dict(logit_std=logit_std, measured_logit_std=float(jnp.std(z)),
              mean_abs_logprob_diff=float(d.mean()), max_abs_logprob_diff=float(d.max()),
              mean_abs_entropy_diff=float(np.abs(np.asarray(ent16 - ent32)).mean()),
              mean_entropy=float(ent32.mean()), mean_logprob=float(logp32.mean()))


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  results = [compare(args, s) for s in args.logit_std]
  print(f'{"logit std":>9} {"entropy":>8} {"mean|d logp|":>13} {"max|d logp|":>12} '
        f'{"mean|d H|":>10}')
  for r in results:
    print(f'{r["measured_logit_std"]:9.2f} {r["mean_entropy"]:8.3f} '
          f'{r["mean_abs_logprob_diff"]:13.2e} {r["max_abs_logprob_diff"]:12.2e} '
          f'{r["mean_abs_entropy_diff"]:10.2e}')
  report = dict(config={k: v for k, v in vars(args).items() if k != 'out'},
                jax_version=jax.__version__, device=jax.devices()[0].device_kind,
                results=results)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=1)
  print(f'JSON: {args.out}')
  return report


if __name__ == '__main__':
  main()
