"""Which preset for which hardware, each GPU preset's memory plan and its PREDICTED speed: the
README's preset table.

  python -m pipelinerl_jax.sim.presets                      # the table, as the README has it
  python -m pipelinerl_jax.sim.presets --json=/tmp/presets.json

The speeds are predictions from one H100 run of the GPU kit (`--measured`, its JSON), labelled
so until a GPU measures the presets themselves. Per GPU preset (configs/math.py HARDWARE: the
model config, devices and card it is laid out for):
  memory    memory_plan.plan on those devices: GiB per trainer device and per generator device
            (one number when the trainer and the engine share the device).
  L̄         mean tokens per sample, assumed to be MEAN_LENGTH_SHARE of max_prompt_len +
            max_new_tokens (the paper's Qwen2.5-7B samples averaged ~3k of a 9k limit).
  training  tokens/s per trainer GPU = MFU x the card's bf16 peak / FLOPs per token. The MFU is
            the kit's at Qwen2.5-1.5B shapes (cuDNN attention, bf16 head) with the preset's remat
            policy; FLOPs per token are bench/train_step.py's count, 6 x the matmul parameters a
            token uses + 12 L (N Dh) L̄ for attention, with 4 x for LoRA (the frozen base has no
            weight gradients); a hybrid's attention layers only, and per Gated DeltaNet layer
            6 Hv (3 Dk Dv + Tb (3 Dk + 2 Dv)) for its chunked delta rule. FSDP and expert splits
            are assumed to cost nothing.
  decoding  tokens/s per generator GPU = H / step, a step = (the bf16 weights + H x L̄/2 tokens
            of KV + a hybrid's H Gated DeltaNet states) / the measured copy bandwidth / the share of that bound the JAX engine reached
            at that H (interpolated between the kit's H = 64 ... 1,024). vLLM generators are
            assumed to reach the same share: vLLM on CUDA has not been measured.
  together  the Appendix A model (sim/throughput.py): generators on GPUs of their own run beside
            the trainers, r = min(r_gen, r_train) (`pipeline`); sharing the trainer's GPU they take
            turns, r = 1 / (1/r_gen + 1/r_train) (`conventional` on one accelerator).
  step      B x L̄ / r seconds; tokens/s = r, trained tokens (prompts included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
from typing import Any, Sequence

import numpy as np

from pipelinerl_jax import accelerators
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import memory_plan
from pipelinerl_jax.generation import budget
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import gated_delta
from pipelinerl_jax.sim import throughput as tp

MEAN_LENGTH_SHARE = 1 / 3
CALIBRATION_MODEL = 'qwen2.5-1.5b'   # the train step's MFU is taken at these shapes
_RUN = pathlib.Path(__file__).resolve().parents[2] / 'docs' / 'gpu_h100_2026-11-26_second'
DEFAULT_MEASURED = (_RUN / 'kit-env-train-engine-e2e.json', _RUN / 'kit-train-grid.json')
COMMAND = 'python -m pipelinerl_jax.sim.presets'


@dataclasses.dataclass(frozen=True)
class Measured:
  """What the predictions are calibrated on: one card's kit run."""
  card: str                                  # accelerators.py's name of the card measured on
  mfu: dict[str, float]                      # remat policy -> MFU (median over repeats)
  roofline: tuple[tuple[int, float], ...]    # (H, the JAX engine's share of the bandwidth bound)
  copy_gb_per_s: float
  sources: tuple[str, ...]


def read_measured(paths: Sequence[str | pathlib.Path]) -> Measured:
  """The GPU kit's JSON files (bench/gpu) -> `Measured`; a one-line ValueError when they lack
  the train or engine figures the predictions need."""
  cards, mfu, roofline, copy = set(), {}, {}, []
  for path in paths:
    run = json.loads(pathlib.Path(path).read_text())
    sections = run.get('sections', {})
    for item in sections.get('env', {}).get('items', []):
      if item.get('device_kind'):
        card = accelerators.card_of(item['device_kind'])
        cards.add(card.name if card else item['device_kind'])
    for item in sections.get('train', {}).get('items', []):
      if (item.get('mfu') and item.get('model') == CALIBRATION_MODEL
          and item.get('attention') == 'cudnn' and 'head=dtype' in item.get('name', '')):
        mfu.setdefault(item['remat_policy'] if item.get('remat') else 'none', []).append(
            item['mfu'])
    for item in sections.get('engine', {}).get('items', []):
      if item.get('roofline') and item.get('attention') == 'cudnn' and item.get('mode') == 'none':
        roofline.setdefault(int(item['slots']), []).append(item['roofline'])
        copy.append(item['copy_gb_per_s'])
  names = ', '.join(map(str, paths))
  if len(cards) != 1:
    raise ValueError(f'{names}: need runs on one card, found {sorted(cards) or "none"}')
  if not mfu or not roofline:
    raise ValueError(f'{names}: need the kit\'s train step at {CALIBRATION_MODEL} shapes with '
                     'cuDNN attention and its JAX engine with the cuDNN read')
  return Measured(card=cards.pop(), mfu={k: statistics.median(v) for k, v in mfu.items()},
                  roofline=tuple((h, statistics.median(v)) for h, v in sorted(roofline.items())),
                  copy_gb_per_s=statistics.median(copy), sources=tuple(map(str, paths)))


def flops_per_token(m, mean_len: float, lora: bool) -> float:
  """Model FLOPs of one trained token (bench/train_step.py's count: the embedding is a lookup,
  an MoE layer's matmuls are its active experts'); LoRA's base computes no weight gradient."""
  lookup = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
  matmul = (4.0 if lora else 6.0) * (m.num_active_params - lookup)
  attention = 12.0 * len(m.attention_layers) * m.num_heads * m.head_dim * mean_len
  linear = 0.0
  if m.is_hybrid:
    _, hv, dk, dv, _, _ = gated_delta.dims(m)
    linear = (6.0 * len(m.linear_layers) * hv
              * (3 * dk * dv + m.linear_chunk_size * (3 * dk + 2 * dv)))
  return matmul + attention + linear


def predict(name: str, hardware: dict[str, Any], preset, measured: Measured) -> dict[str, Any]:
  """The plan and predicted speed of one GPU preset (`preset`: its ConfigDict) on `hardware`."""
  card = accelerators.card_named(hardware['card'])
  if card.name != measured.card:
    raise ValueError(f'{name}: planned for {card.name}, but the measurements are from '
                     f'{measured.card}')
  hf_config, source = memory_plan.read_hf_config(config_lib.CONFIGS_DIR / 'models' /
                                                 hardware['model'])
  plan = memory_plan.plan(preset, hf_config, num_devices=hardware['devices'],
                          device_gib=card.usable_gib, source=source)
  c = config_lib.validate(preset, runnable=False)
  m = hf_schema.config_from_hf(hf_config, source=source, param_dtype=c.model.param_dtype,
                               dtype=c.model.dtype)
  g = c.generation
  mean_len = MEAN_LENGTH_SHARE * (g.max_prompt_len + g.max_new_tokens)
  policy = c.model.remat_policy if c.model.remat else 'none'
  mfu = measured.mfu.get(policy, measured.mfu.get('full'))
  train_per_gpu = (mfu * card.bf16_tflops * 1e12
                   / flops_per_token(m, mean_len, c.model.lora.rank > 0))
  h = g.generator_slots
  kv_per_token = budget.kv_page_bytes(len(m.attention_layers), m.num_kv_heads, m.head_dim, 1,
                                     'bfloat16')
  state = len(m.linear_layers) * gated_delta.state_bytes(m, 'bfloat16') if m.is_hybrid else 0
  step_bytes = m.num_params * 2 + h * (mean_len / 2 * kv_per_token + state)
  hs, shares = zip(*measured.roofline)
  share = float(np.interp(h, hs, shares))
  decode_per_gpu = h / (step_bytes / (measured.copy_gb_per_s * 1e9) / share)
  trainers, generators = plan.facts['train_devices'], plan.facts['generator_devices']
  # U(h) flat at the predicted rate: the preset runs at one H.
  points, tau = ((1.0, decode_per_gpu),), 1 / train_per_gpu
  if generators:
    rate = tp.pipeline(trainers + generators, generators, h, points, tau, c.rl.batch_size,
                       tp.Lengths(mean_len, g.max_prompt_len + g.max_new_tokens)).r_pipe
  else:
    rate = tp.conventional(1, c.rl.batch_size, 1, points, tau).r_conv
  gib = lambda n: n / memory_plan.GIB
  return dict(
      preset=name, runs_on=hardware['runs_on'], model=hardware['model'], card=card.name,
      devices=hardware['devices'], fits=plan.fits, refusal=plan.refusal,
      trainer_gib=gib(plan.trainer_total), generator_gib=gib(plan.generator_total),
      shares_device=not generators, trainer_devices=trainers, generator_devices=generators,
      slots_per_generator=h, mean_tokens=mean_len, remat_policy=policy, mfu=mfu,
      train_tokens_per_s_per_gpu=train_per_gpu, decode_roofline_share=share,
      decode_tokens_per_s_per_gpu=decode_per_gpu, tokens_per_s=rate,
      step_s=c.rl.batch_size * mean_len / rate)


def rows(measured: Measured, path: str | pathlib.Path = config_lib.MATH_CONFIG
         ) -> list[dict[str, Any]]:
  """Every preset of the experiment file, in its order: a GPU preset with its prediction, the
  others with what they run on."""
  experiment = config_lib.load_experiment(path)
  missing = sorted(set(experiment.PRESETS) - set(experiment.HARDWARE))
  if missing:
    raise ValueError(f'{path}: HARDWARE has no entry for {", ".join(missing)}')
  out = []
  for name in experiment.PRESETS:
    hardware = experiment.HARDWARE[name]
    if 'model' in hardware:
      out.append(predict(name, hardware, experiment.get_config(name), measured))
    else:
      out.append(dict(preset=name, runs_on=hardware['runs_on'], about=hardware['about']))
  return out


def _thousands(x: float) -> str:
  return f'{x / 1e3:,.1f}k' if x < 1e4 else f'{x / 1e3:,.0f}k'


def markdown(table: list[dict[str, Any]]) -> str:
  """The README's table: a row per GPU preset; presets without a model of their own share a row
  when they run on the same thing."""
  lines = ['| preset | runs on | model | GiB per GPU (memory plan): trainer / generator | '
           'step (predicted) | tokens/s (predicted) |', '|---|---|---|---|---|---|']
  others: dict[tuple[str, str], list[str]] = {}
  for r in table:
    if 'model' not in r:
      others.setdefault((r['runs_on'], r['about']), []).append(f"`{r['preset']}`")
      continue
    memory = (f"{r['trainer_gib'] + r['generator_gib']:.1f} (one device)" if r['shares_device']
              else f"{r['trainer_gib']:.1f} / {r['generator_gib']:.1f}")
    if not r['fits']:
      memory += ' (refused)'
    step = f"{r['step_s']:.1f} s" if r['step_s'] < 10 else f"{r['step_s']:.0f} s"
    lines.append(f"| `{r['preset']}` | {r['runs_on']} | {r['model']} | {memory} | {step} | "
                 f"{_thousands(r['tokens_per_s'])} |")
  lines[2:2] = [f"| {', '.join(names)} | {runs_on} | {about} | — | — | — |"
                for (runs_on, about), names in others.items()]
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split('\n')[0])
  p.add_argument('--measured', nargs='+', default=[str(x) for x in DEFAULT_MEASURED],
                 help="the GPU kit's JSON files the predictions are calibrated on")
  p.add_argument('--json', default='', help='also write every row, with its terms, here')
  args = p.parse_args(argv)
  try:
    measured = read_measured(args.measured)
    table = rows(measured)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(markdown(table))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        dict(measured=dataclasses.asdict(measured), mean_length_share=MEAN_LENGTH_SHARE,
             rows=table), indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
