"""The one-GPU preset sections: a short PipelineRL run of a one-GPU preset (configs/math.py) on
random weights of its model's shapes, for a GPU that has neither the model nor the data.

The model is built on the device from the config.json in configs/models/ (saved in bf16 as an HF
dir, with the character tokenizer) and the task is the demo's arithmetic: the GPU image has
neither `datasets` nor math-verify, and nothing measured here depends on the prompts. Random
weights almost never emit a token the tokenizer knows, let alone EOS: every sample runs to
max_new_tokens, so the trainer packs the worst case the memory plan assumes. Rewards are all 0:
the loss is 0 and the step still runs whole. Each preset is its own section, so that the
device's peak (`memory_stats`) is that run's alone; it is recorded beside the memory plan's
terms, with the median train step and decode tokens/s. --quick runs the same path on a model
of the preset's family in miniature (Qwen3, or a Qwen3.5 hybrid) with the preset's other
settings shrunk to what a CPU runs.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Callable

from pipelinerl_jax.bench.gpu import section as section_lib

ROOT = pathlib.Path(__file__).resolve().parents[3]
# The one-GPU presets, each with the model whose shapes its run takes.
PRESET_MODELS = {'qwen3_1p7b_1xgpu': 'configs/models/Qwen3-1.7B',
                 'qwen3_8b_lora_1xgpu': 'configs/models/Qwen3-8B',
                 'qwen3_5_2b_1xgpu': 'configs/models/Qwen3.5-2B'}
# --quick: Qwen3 in miniature (head_dim != hidden / heads, GQA 2, tied), runnable on a CPU.
QUICK_HF = dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3', vocab_size=512,
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                tie_word_embeddings=True, rope_theta=1e6, rope_scaling=None,
                max_position_embeddings=4096, torch_dtype='bfloat16')
# ... and Qwen3.5's: 3 Gated DeltaNet layers and one gated attention layer, 2 value heads a key
# head, a convolution of 4 taps.
QUICK_HF_HYBRID = dict(QUICK_HF, architectures=['Qwen3_5ForCausalLM'], model_type='qwen3_5_text',
                       num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4)


def quick_hf(preset: str) -> dict[str, Any]:
  """The miniature of `preset`'s model family that --quick runs."""
  full, _ = _full_hf(preset)
  return QUICK_HF_HYBRID if full['model_type'].startswith('qwen3_5') else QUICK_HF


def _full_hf(preset: str):
  from pipelinerl_jax import memory_plan
  return memory_plan.read_hf_config(ROOT / PRESET_MODELS[preset])


# Kept for what follows the run's stop: the engine's drain, the final checkpoint, teardown.
AFTER_RUN_S = 45.0


def make_model_dir(out: pathlib.Path, hf_config: dict[str, Any], seed: int = 0) -> pathlib.Path:
  """An HF dir of random weights with `hf_config`'s shapes (bf16), the character tokenizer and a
  generation_config.json; built once (kept when `out` already has its config.json)."""
  import jax
  from pipelinerl_jax.demo import char_tokenizer
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
  from pipelinerl_jax.models import transformer
  if (out / hf_schema.CONFIG_FILE).is_file():
    return out
  tmp = out.with_name(out.name + '.tmp')
  config = hf_schema.config_from_hf(hf_config)
  params = transformer.init_params(config, jax.random.PRNGKey(seed))
  tok = char_tokenizer.build_char_tokenizer()
  ids = char_tokenizer.special_token_ids(tok)
  published = {k: v for k, v in hf_config.items() if not k.startswith('_')}
  hf_checkpoint.save_params(params, config, tmp, dtype='bfloat16',
                            extra_config={**published, **ids})
  del params
  char_tokenizer.save_tokenizer(tok, tmp, model_max_length=config.max_position_embeddings)
  (tmp / hf_tokenizer.GENERATION_CONFIG_FILE).write_text(json.dumps(ids) + '\n')
  tmp.rename(out)
  return out


def run_config(preset: str, model_dir: pathlib.Path, sizes, max_time_s: float, quick: bool):
  """The preset with the model filled in and the arithmetic task (see the module doc); --quick
  shrinks what a CPU cannot run."""
  from pipelinerl_jax import config as config_lib
  c = config_lib.load_preset(preset)
  c.model.path = str(model_dir)
  c.task.name, c.task.chat_template_kwargs = 'arithmetic', {}
  c.eval.every_steps = 0            # the measured steps train and generate only
  c.eval.num_problems = 64          # the preset's 0 (whole test sets) is for math files
  c.log.tensorboard = False         # tensorboardX is not on the GPU image
  c.log.progress = not quick
  c.rl.total_steps = sizes.one_gpu_steps
  c.rl.max_time_s = max_time_s
  if sizes.one_gpu_new_tokens:
    c.generation.max_new_tokens = sizes.one_gpu_new_tokens
  if quick:
    c.allow_cpu = True
    c.model.dtype, c.model.attention = 'float32', 'blockwise'
    c.generation.decode_attention = 'xla'
    c.generation.max_prompt_len = 16
    c.generation.num_slots, c.generation.kv_pool_mb = 16, 8
    c.rl.batch_size, c.rl.group_size, c.rl.max_lag = 8, 4, 1
    c.train.seq_len = 64
  c.task.reward.overlong_max_len = c.generation.max_new_tokens
  c.task.reward.overlong_buffer = c.generation.max_new_tokens // 6
  return c


def runner_for(preset: str) -> Callable[[section_lib.Section], None]:
  """The section's `run` for `preset`."""
  if preset not in PRESET_MODELS:
    raise KeyError(f'no model shapes for one-GPU preset {preset!r} '
                   f'(known: {sorted(PRESET_MODELS)})')
  return lambda s: run_preset(s, preset)


def run_preset(s: section_lib.Section, preset: str) -> None:
  import jax
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax import memory_plan
  from pipelinerl_jax.pipeline import launch

  name = f'{preset} preset'
  quick = s.args.quick
  hf_config = quick_hf(preset) if quick else _full_hf(preset)[0]
  work = pathlib.Path(s.args.workdir) / 'one_gpu'
  t0 = time.perf_counter()
  model_dir = make_model_dir(work / f'{preset}-{"quick" if quick else "model"}', hf_config)
  model_s = time.perf_counter() - t0
  device = jax.local_devices()[0]
  # The device's peak is the process's high-water mark: the build's own (its fp32 init) is
  # kept apart, so that the run's peak reads as the run's only where it is the larger.
  model_memory = section_lib.device_memory(device)
  max_time_s = s.remaining() - AFTER_RUN_S
  if max_time_s < 10:
    s.skip(name, f'time budget ({s.remaining():.0f} s left after building the model)')
    return
  c = run_config(preset, model_dir, s.sizes, max_time_s, quick)
  limit = section_lib.device_memory(device).get('bytes_limit')
  plan = memory_plan.plan(c, hf_config, num_devices=1,
                          device_gib=(limit or 80 * memory_plan.GIB) / memory_plan.GIB)
  run_dir = work / f'{preset}-{int(time.time())}'
  records, error, rl_s = section_lib.run_records(
      lambda: launch.run_experiment(config_lib.validate(c, runnable=False), str(run_dir)), run_dir)
  median = lambda key: section_lib.median_of(records, key)
  fields = dict(preset=preset, model_s=model_s, rl_s=rl_s, max_time_s=max_time_s,
                steps=len(records), max_new_tokens=c.generation.max_new_tokens,
                plan_trainer_bytes=plan.trainer, plan_generator_bytes=plan.generator,
                plan_total_bytes=plan.trainer_total + plan.generator_total,
                plan_refusal=plan.refusal, model_memory=model_memory,
                memory=section_lib.device_memory(device),
                train_step_s_median=median('train_step_s'),
                gen_tokens_per_s_median=median('gen_tokens_per_s'),
                frac_hit_length_limit=median('frac_hit_length_limit'),
                publish_bytes_median=median('publish_bytes'), workdir=str(run_dir))
  if error or not records:
    s.record['items'].append(dict(name=name, status='error',
                                  error=error or 'the run logged no step', **fields))
    s.save()
  else:
    s.add(name, **fields)


def describe(item: dict[str, Any]) -> str:
  """One table cell: steps, the step and decode figures, the device's peak against the plan."""
  g = item.get
  gib = lambda b: f'{b / 2**30:.2f} GiB' if b is not None else 'n/a'
  number = lambda x, unit: f'{x:.3g} {unit}' if x is not None else 'n/a'
  text = (f"{g('steps')} steps in {g('rl_s'):.0f} s (+{g('model_s'):.0f} s model): train step "
          f"{number(g('train_step_s_median'), 's')}, decode "
          f"{number(g('gen_tokens_per_s_median'), 'tok/s')}; peak "
          f"{gib((g('memory') or {}).get('peak_bytes_in_use'))} against the plan's "
          f"{gib(g('plan_total_bytes'))}")
  return text + (f"; {g('error')}" if g('error') else '')
