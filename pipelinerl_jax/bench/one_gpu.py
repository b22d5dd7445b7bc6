"""The one-GPU preset run on its own shapes, for a GPU with no model or data on it.

  python -m pipelinerl_jax.bench.one_gpu --out=DIR [--steps=2] [--max_time_s=180]
  python -m pipelinerl_jax.bench.one_gpu --quick --out=DIR    # CPU: a tiny Qwen3, same path

`qwen3_1p7b_1xgpu` (configs/math.py) with random weights of Qwen3-1.7B's shapes
(configs/models/Qwen3-1.7B, saved in bf16 as an HF dir) and the character tokenizer, for a few
optimizer steps. The task is the demo's arithmetic, not math: the GPU image has neither
`datasets` nor math-verify, and what is measured here does not depend on the prompts (the
trainer's rows are full either way). Random weights almost never emit a token the tokenizer
knows, let alone EOS: every sample runs to max_new_tokens, so the trainer packs the worst case
the memory plan assumes. Rewards are all 0: the loss is 0 and the step still runs whole.
TensorBoard is off (tensorboardX is not on the image); the checkpoint at exit is written, as a
run writes it.

DIR/one_gpu.json holds the memory plan's terms beside the device's peak (`memory_stats`), the
median train step and decode tokens/s of the steps done, and the run's error if it stopped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL_CONFIG = ROOT / 'configs/models/Qwen3-1.7B'
PRESET = 'qwen3_1p7b_1xgpu'
# --quick: Qwen3 in miniature (head_dim != hidden / heads, GQA 2, tied), runnable on a CPU.
QUICK_HF = dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3', vocab_size=512,
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                tie_word_embeddings=True, rope_theta=1e6, rope_scaling=None,
                max_position_embeddings=4096, torch_dtype='bfloat16')


def make_model_dir(out: pathlib.Path, hf_config: dict[str, Any], seed: int = 0) -> pathlib.Path:
  """An HF dir of random weights with `hf_config`'s shapes (bf16), the character tokenizer and a
  generation_config.json; built once (kept when `out` already has its config.json)."""
  import jax
  from pipelinerl_jax.demo import char_tokenizer
  from pipelinerl_jax.models import hf_io
  from pipelinerl_jax.models import transformer
  if (out / hf_io.CONFIG_FILE).is_file():
    return out
  tmp = out.with_name(out.name + '.tmp')
  config = hf_io.config_from_hf(hf_config)
  params = transformer.init_params(config, jax.random.PRNGKey(seed))
  tok = char_tokenizer.build_char_tokenizer()
  ids = char_tokenizer.special_token_ids(tok)
  published = {k: v for k, v in hf_config.items() if not k.startswith('_')}
  hf_io.save_params(params, config, tmp, dtype='bfloat16', extra_config={**published, **ids})
  del params
  char_tokenizer.save_tokenizer(tok, tmp, model_max_length=config.max_position_embeddings)
  (tmp / hf_io.GENERATION_CONFIG_FILE).write_text(json.dumps(ids) + '\n')
  tmp.rename(out)
  return out


def run_config(model_dir: pathlib.Path, steps: int, max_time_s: float, max_new_tokens: int,
               quick: bool):
  """The preset with the model filled in and the arithmetic task (see the module doc); --quick
  shrinks what a CPU cannot run."""
  from pipelinerl_jax import config as config_lib
  c = config_lib.load_preset(PRESET)
  c.model.path = str(model_dir)
  c.task.name, c.task.chat_template_kwargs = 'arithmetic', {}
  c.eval.num_problems = 8           # (eval.every_steps is 0: no evaluation runs)
  c.log.tensorboard = False
  c.rl.total_steps = steps
  c.rl.max_time_s = max_time_s
  if max_new_tokens:
    c.generation.max_new_tokens = max_new_tokens
  if quick:
    c.allow_cpu = True
    c.model.dtype, c.model.attention = 'float32', 'blockwise'
    c.generation.decode_attention = 'xla'
    c.generation.max_prompt_len, c.generation.max_new_tokens = 16, 16
    c.generation.num_slots, c.generation.kv_pool_mb = 16, 8
    c.rl.batch_size, c.rl.group_size, c.rl.max_lag = 8, 4, 1
    c.train.seq_len = 64
  c.task.reward.overlong_max_len = c.generation.max_new_tokens
  c.task.reward.overlong_buffer = c.generation.max_new_tokens // 6
  return c


def device_memory() -> dict[str, Any]:
  """The first device's allocator figures (peak, limit), where the platform reports them."""
  import jax
  stats = jax.local_devices()[0].memory_stats() or {}
  return {k: stats.get(k) for k in ('peak_bytes_in_use', 'bytes_in_use', 'bytes_limit')}


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Where one_gpu.json, the model and the run go.')
  parser.add_argument('--steps', type=int, default=2, help='Optimizer steps (rl.total_steps).')
  parser.add_argument('--max_time_s', type=float, default=180.0,
                      help='RL stops after this many seconds (rl.max_time_s; 0 = steps only).')
  parser.add_argument('--max_new_tokens', type=int, default=0,
                      help="generation.max_new_tokens (0 = the preset's).")
  parser.add_argument('--quick', action='store_true', help='A tiny Qwen3 on the CPU.')
  args = parser.parse_args(argv)
  import jax
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax import memory_plan
  from pipelinerl_jax.pipeline import launch

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  hf_config = QUICK_HF if args.quick else memory_plan.read_hf_config(MODEL_CONFIG)[0]
  report: dict[str, Any] = dict(preset=PRESET, quick=args.quick,
                                device=str(jax.local_devices()[0].device_kind))
  t0 = time.perf_counter()
  model_dir = make_model_dir(out / 'model', hf_config)
  report['model_s'] = time.perf_counter() - t0
  c = run_config(model_dir, args.steps, args.max_time_s, args.max_new_tokens, args.quick)
  limit = device_memory()['bytes_limit']
  plan = memory_plan.plan(c, hf_config, num_devices=1,
                          device_gib=(limit or 80 * memory_plan.GIB) / memory_plan.GIB)
  report['plan'] = dict(trainer=plan.trainer, generator=plan.generator,
                        total=plan.trainer_total + plan.generator_total, refusal=plan.refusal)
  t0 = time.perf_counter()
  try:
    summary = launch.run_experiment(config_lib.validate(c, runnable=False), str(out / 'run'))
    records, report['error'] = summary['records'], None
  except Exception as e:  # keep what the run logged
    metrics = out / 'run' / 'metrics.jsonl'
    records = ([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
               if metrics.exists() else [])
    report['error'] = f'{type(e).__name__}: {e}'.splitlines()[0]
  report['rl_s'] = time.perf_counter() - t0
  median = lambda key: statistics.median(r[key] for r in records) if records else None
  report.update(steps=len(records), memory=device_memory(),
                train_step_s_median=median('train_step_s'),
                gen_tokens_per_s_median=median('gen_tokens_per_s'),
                frac_hit_length_limit=median('frac_hit_length_limit'))
  (out / 'one_gpu.json').write_text(json.dumps(report, indent=1, default=str) + '\n')
  gib = lambda b: f'{b / memory_plan.GIB:.2f} GiB' if b is not None else 'n/a'
  number = lambda x, unit: f'{x:.2f} {unit}' if x is not None else 'n/a'
  print(f"{PRESET} on {report['device']}: {report['steps']} steps in {report['rl_s']:.0f} s, "
        f"train step {number(report['train_step_s_median'], 's')}, decode "
        f"{number(report['gen_tokens_per_s_median'], 'tok/s')}; peak "
        f"{gib(report['memory']['peak_bytes_in_use'])} against the plan's "
        f"{gib(report['plan']['total'])}" + (f"; error: {report['error']}"
                                             if report['error'] else ''))
  return report


if __name__ == '__main__':
  main()
