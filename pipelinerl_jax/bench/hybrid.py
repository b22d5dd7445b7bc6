"""Qwen3.5 hybrids against dense models: the train / sampler mismatch at lag 0, and whether the
`tiny_hybrid` demo learns beside `tiny`.

  python -m pipelinerl_jax.bench.hybrid [--seeds 0,1,2] [--steps 150] [--budget_s 0]
      [--target 0.8] [--scales 2,3,4] [--set SECTION.FIELD=VALUE ...] [--out PATH.json] [--smoke]
      [--skip_learning] [--skip_mismatch]

Mismatch: a hybrid (3 Gated DeltaNet layers to 1 gated attention layer, Qwen3.5's layout) and a
dense model of the same size (the same width, MLP, layers and attention heads, every layer
attention: Qwen3), random weights x each of --scales so that the next-token distributions are
peaked like a trained model's (the same multiplier peaks the two models differently: compare
rows of like -log mu). The JAX engine samples the same requests from each at temperature 1,
recording log mu, in fp32 and in bf16 (params held in bf16, as a GPU run's engine holds them);
the trainer then scores the same tokens under the same params by a full forward (its chunked
delta rule where the engine ran the recurrent step), in fp32 and as the GPU presets train
(fp32 params, bf16 compute and lm_head). Per (model, engine dtype) and trainer: the mean and
the largest |log pi - log mu| over the sampled tokens and the normalized ESS of pi / mu (paper
eq. 6), beside the mean -log mu (how peaked the sampled distributions are). Lag 0: only the
numerics differ (no update between sampling and scoring).

Learning: per seed, one PipelineRL run of `tiny` and one of `tiny_hybrid` (configs/math.py; each
from its own warm start), seeds the outer loop, each for --steps optimizer steps (the same
samples whatever the host's load) or until a --budget_s wall-clock cap. Per run: the first and
the last 10 steps' reward, the reward's trend and its noise (bench/reward_trend.py), the means
over its steps of the policy versions per sample, |log pi - log mu| of the trained tokens, ESS
and the token lag, the train step's seconds and the load; then each over seeds. Tables, a JSON
file (with every run's raw per-step rewards) and a PNG of the learning curves (median and
min-max band over seeds). Nothing here asserts a figure; `--smoke` (untrained models, a few
steps, small batches) only runs the code paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import tempfile

import jax
import numpy as np

from pipelinerl_jax.bench import ablations
from pipelinerl_jax.bench import learning_speed
from pipelinerl_jax.bench import reward_trend
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models import transformer

PRESETS = ('tiny', 'tiny_hybrid')
# The mismatch's two models: one width, MLP, depth and attention; the hybrid's layers 0-2 and 4-6
# Gated DeltaNet (2 key heads, 4 value heads of 64, a convolution of 4 taps).
_SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4,
              num_kv_heads=2, head_dim=64, qk_norm=True, tie_embeddings=True,
              attention='dense')
MODELS = {
    'dense': transformer.ModelConfig(**_SHAPE, architecture='Qwen3ForCausalLM'),
    'hybrid': transformer.ModelConfig(
        **_SHAPE, architecture='Qwen3_5ForCausalLM', attention_output_gate=True,
        partial_rotary_factor=0.25, norm_zero_centered=True, linear_layers=(0, 1, 2, 4, 5, 6),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel=4),
}
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=4, head_dim=16,
                   linear_layers=(0, 1, 2), linear_key_head_dim=16, linear_value_head_dim=16)
MISMATCH_COLUMNS = (('model', 'model', 's'), ('params', 'params', ',d'), ('scale', 'scale', 'g'),
                    ('engine', 'engine_dtype', 's'), ('tokens', 'tokens', 'd'),
                    ('-log mu', 'nll', '.2f'),
                    ('fp32 trainer: mean|d|', 'fp32_mean', '.2e'), ('max|d|', 'fp32_max', '.2e'),
                    ('ess', 'fp32_ess', '.5f'),
                    ('bf16 trainer: mean|d|', 'bf16_mean', '.2e'), ('max|d|', 'bf16_max', '.2e'),
                    ('ess', 'bf16_ess', '.5f'))
LEARNING_COLUMNS = ((('preset', 'name', 's'), ('seed', 'seed', 'd'), ('steps', 'steps', 'd'),
                     ('samples', 'samples', ',d'), ('reward_first', 'reward_first', '.3f'),
                     ('last10', 'reward_final', '.3f')) + reward_trend.COLUMNS)
RUN_COLUMNS = (('preset', 'name', 's'), ('seed', 'seed', 'd'), ('run_s', 'time_s', '.0f'),
               ('t->target', 't_target', '.0f'), ('samples->target', 's_target', ',d'),
               ('versions/sample', 'versions_per_sample', '.2f'),
               ('|logpi-logmu|', 'abs_logp_diff', '.2e'), ('ess', 'ess_mean', '.4f'),
               ('lag_mean', 'lag_mean', '.2f'), ('train_step_s', 'train_step_s', '.2f'),
               ('load', 'load', '.1f'))
SEED_COLUMNS = (('last10', 'reward_final', '.3f'), ('rise', 'rise', '.3f'),
                ('rise/noise', 'rise_over_noise', '.1f'), ('slope/100', 'slope', '.3f'),
                ('versions/sample', 'versions_per_sample', '.2f'),
                ('|logpi-logmu|', 'abs_logp_diff', '.2e'), ('ess', 'ess_mean', '.4f'))


# ---------------------------------------------------------------------------------------------
# The mismatch at lag 0.


def sample(config: transformer.ModelConfig, params, requests: list[api.Request],
           max_tokens: int) -> list[api.Completion]:
  """The JAX engine's completions of `requests` (log mu in config.dtype's numerics)."""
  engine_config = jax_engine.EngineConfig(
      num_slots=len(requests),
      max_seq_len=max(len(r.prompt_tokens) for r in requests) + max_tokens)
  with jax_engine.JaxEngine(config, params, engine_config) as engine:
    return api.generate(engine, requests)


def mismatch_row(name: str, config: transformer.ModelConfig, params, dtype: str,
                 requests: list[api.Request], max_tokens: int) -> dict:
  """One (model, engine dtype) row: see the module doc."""
  completions = sample(dataclasses.replace(config, dtype=dtype), params, requests, max_tokens)
  behaviour = [c.logprobs for c in completions]
  # The mean -log mu (the sampled tokens' surprise): how peaked each model's distributions
  # are, which the mismatch depends on as much as the layers do.
  row = dict(model=name, params=config.num_params, engine_dtype=dtype,
             tokens=sum(len(b) for b in behaviour),
             nll=-float(np.mean(np.concatenate(behaviour))))
  # The trainer as the CPU demos run it (fp32) and as the GPU presets do (bf16 compute and
  # lm_head over fp32 params).
  trainers = {'fp32': config,
              'bf16': dataclasses.replace(config, dtype='bfloat16', lm_head_fp32=False)}
  for trainer, trainer_config in trainers.items():
    target = ablations._logprobs_under(params, trainer_config, completions)
    d = np.abs(np.concatenate(target).astype(np.float64) - np.concatenate(behaviour))
    row.update({f'{trainer}_mean': float(d.mean()), f'{trainer}_max': float(d.max()),
                f'{trainer}_ess': ablations.divergence(behaviour, target)['ess']})
  return row


def mismatch(*, scales: list[float], num_requests: int, prompt_len: int, max_tokens: int,
             smoke: bool) -> list[dict]:
  rng = np.random.default_rng(0)
  rows = []
  for name, config in MODELS.items():
    if smoke:
      config = dataclasses.replace(
          config, **{k: v for k, v in SMOKE_SHAPE.items()
                     if name == 'hybrid' or not k.startswith('linear')})
    init = transformer.init_params(config, jax.random.PRNGKey(0))
    requests = [api.Request(f'r{i}', [int(t) for t in rng.integers(0, config.vocab_size,
                                                                    prompt_len)],
                            api.SamplingParams(temperature=1.0, max_tokens=max_tokens), seed=i)
                for i in range(num_requests)]
    for scale in scales:
      params = jax.tree.map(lambda x: x * scale, init)
      for dtype in ('float32', 'bfloat16'):
        rows.append(dict(mismatch_row(name, config, params, dtype, requests, max_tokens),
                         scale=scale))
        print(ablations.table(rows[-1:], MISMATCH_COLUMNS), flush=True)
  return rows


# ---------------------------------------------------------------------------------------------
# Learning runs.


def run_row(seed: int, result: dict, target: float, targets) -> dict:
  """One run's table row (`reward_trend.run_row`) with the means of its mismatch metrics."""
  return reward_trend.run_row(seed, result, target, targets,
                              dict(versions_per_sample='versions_per_sample_mean',
                                   abs_logp_diff='abs_logp_diff'))


def parse_scales(text: str) -> list[float]:
  """'2,3,4' -> [2.0, 3.0, 4.0]; anything else is one ValueError naming the flag."""
  try:
    scales = [float(x) for x in text.split(',')]
  except ValueError:
    scales = []
  if not scales or not all(x > 0 for x in scales):
    raise ValueError(f'--scales must be comma-separated positive numbers, got {text!r}')
  return scales


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated RL seeds')
  parser.add_argument('--target', type=float, default=0.8, help='10-step mean reward target')
  parser.add_argument('--scales', default='2,3,4',
                      help="the mismatch models' params multipliers, comma-separated")
  parser.add_argument('--set', action='append', default=[], metavar='SECTION.FIELD=VALUE',
                      help='config override for every run (after --smoke and the budget)')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/hybrid.json')
  parser.add_argument('--workdir', default='', help="run dirs ('' = a temporary dir)")
  ablations.add_budget_flags(parser, default_steps=150)
  parser.add_argument('--skip_learning', action='store_true')
  parser.add_argument('--skip_mismatch', action='store_true')
  args = parser.parse_args(argv)
  import matplotlib
  matplotlib.use('Agg')
  try:
    seeds = learning_speed.parse_seeds(args.seeds)
    sets = learning_speed.parse_sets(args.set)
    scales = parse_scales(args.scales)
  except ValueError as e:
    parser.error(str(e))
  workdir = args.workdir or tempfile.mkdtemp(prefix='hybrid_')
  print(f'device: {jax.devices()[0].device_kind} ({jax.default_backend()}), '
        f'{os.cpu_count()} CPUs, jax {jax.__version__}; runs in {workdir}; '
        f'load {os.getloadavg()[0]:.1f}', flush=True)
  report = dict(device=str(jax.devices()[0]), backend=jax.default_backend(),
                cpus=os.cpu_count(), host=platform.node(), jax=jax.__version__, args=vars(args),
                seeds=seeds, load_start=os.getloadavg()[0])
  out = pathlib.Path(args.out)

  if not args.skip_mismatch:
    print('\nmismatch at lag 0 (the same params sample and score):', flush=True)
    sizes = (dict(num_requests=4, prompt_len=8, max_tokens=8) if args.smoke
             else dict(num_requests=32, prompt_len=16, max_tokens=64))
    rows = mismatch(scales=scales, smoke=args.smoke, **sizes)
    print(ablations.table(rows, MISMATCH_COLUMNS), flush=True)
    report['mismatch'] = dict(rows=rows, sizes=sizes, scales=scales,
                              models={k: dataclasses.asdict(v) for k, v in MODELS.items()})

  if not args.skip_learning:
    targets = sorted({*learning_speed.THRESHOLDS, args.target})
    bases = {}
    for name in PRESETS:
      base = ablations.preset(name)
      base.log.tensorboard = False
      base = ablations.budgeted(parser, args, base)
      try:
        base = ablations.override(base, **sets)
      except (KeyError, TypeError) as e:
        parser.error(f'--set: {e.args[0] if e.args else e}')
      bases[name] = (base, ablations.model_dir_for(base))
    results, rows = [], []
    for seed in seeds:   # outer: load drift hits both presets alike
      for name, (base, model_dir) in bases.items():
        print(f'--- {name} seed {seed}', flush=True)
        result = ablations.run_once(ablations.override(base, seed=seed),
                                    os.path.join(workdir, name, f'seed{seed}'), model_dir,
                                    name=name)
        results.append(result)
        rows.append(run_row(seed, result, args.target, targets))
    over_seeds = reward_trend.print_tables(
        rows, LEARNING_COLUMNS, 'versions, mismatch and cost over the steps of each run',
        RUN_COLUMNS, SEED_COLUMNS, seeds, name_header='preset')
    png = out.with_suffix('.png')
    ablations.plot_comparison(
        results, target=args.target, path=str(png),
        title=f"tiny vs tiny_hybrid, seeds {','.join(map(str, seeds))} (median, min-max band), "
              f'{os.cpu_count()} CPUs, {jax.default_backend()}')
    report.update(runs=rows, over_seeds=over_seeds, png=str(png),
                  model_dirs={name: d for name, (_, d) in bases.items()},
                  raw={f"{r['name']}/seed{row['seed']}": reward_trend.raw(r['records'])
                       for r, row in zip(results, rows)})
  report['load_end'] = os.getloadavg()[0]
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str) + '\n')
  print(f'\nwrote {out}')


if __name__ == '__main__':
  main()
