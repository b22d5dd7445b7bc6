"""The train section: the jitted train step at Qwen2.5-0.5B and 1.5B shapes (random weights, bf16
compute, fp32 master weights, packed rows).

First cuDNN's attention against dense numerically (rows of one, two, many samples and padding);
then the variants of presets.TRAIN_GRID (attention x remat policy x lm_head precision x rows per
micro-batch), most telling first: tokens/s, model FLOP/s and MFU (bench.train_step's count: 6 N
per token plus attention over each sample's own context), the FLOPs the program executes, XLA's
peak memory beside the memory plan's estimate (memory_plan.py, what runs are planned with), and
for some a profile of one step's kernel time by part (attention, matmul, lm_head, optimizer,
other; compiled again with command buffers off, with its own step time); last, cuDNN's and
blockwise's attention alone (forward + backward over the step's rows, with the causal pairs'
FLOP floor). Every item says when it ended (`at_s`) and how long it took (`took_s`).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import section as section_lib

# XLA's own compiled peak of a train variant is a figure, not an estimate: it runs up to this
# share of the allocator's limit (the rest: fragmentation, cuDNN and cuBLAS workspaces).
COMPILED_PEAK_HEADROOM = 0.97


# The attention-alone items, per model shape, after the grid. Dense is left out: the H100 runs
# of 2026-11-26 measured it (183 / 315 ms a layer at 1.5B / 0.5B, fp32 [T, T] scores).
ATTENTION_IMPLS = ('cudnn', 'blockwise')
MIN_VARIANT_S = 20.0       # a train variant is not started with less time left than this
MIN_ATTENTION_S = 5.0      # nor an attention-alone item (or 1.5x the last one's time)


def train_memory_plan(config, rows: int, rows_per_micro: int, seq_len: int) -> dict[str, int]:
  """The memory plan's terms (memory_plan.py, what runs are planned with) for one device running
  the kit's train step: fp32 master weights, Adam, bf16 compute, these packed rows."""
  from jax.sharding import AbstractMesh
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax import memory_plan
  from pipelinerl_jax import sharding as sharding_lib
  mesh = AbstractMesh((1, 1, 1, 1), sharding_lib.MESH_AXES)
  terms, _ = memory_plan.train_step_memory(config, config_lib.OptimizerConfig(), mesh, rows,
                                           rows_per_micro, seq_len)
  return terms


def dense_attention_flops(config, rows: int, seq_len: int) -> float:
  """FLOPs the masked dense attention executes over packed rows (scores and values, forward and
  backward, no remat): 12 L (H Dh) R T^2. Not counted as model FLOPs, which count only each
  sample's own context; reported to show what the kernel really does."""
  return 12.0 * config.num_layers * config.num_heads * config.head_dim * rows * seq_len**2


def add_measured_ceiling(report: dict[str, Any]) -> None:
  """Gives each train item its FLOP/s as a fraction of the env section's measured bf16 matmul
  (the ceiling a dense bf16 program reaches here; MFU is against the datasheet peak)."""
  sections = report['sections']
  env = {i['name']: i for i in sections.get('env', {}).get('items', [])}
  measured = env.get('bf16_matmul', {}).get('tflops')
  for item in sections.get('train', {}).get('items', []):
    if measured and item.get('flop_per_s'):
      item['of_measured_matmul'] = item['flop_per_s'] / (measured * 1e12)


def _skip_or_fail(s: section_lib.Section, item: str, error: BaseException) -> None:
  """cuDNN attention's refusal on a host without a CUDA GPU (the --quick run on CPU) is a skip;
  anything else a failure."""
  if isinstance(error, ValueError) and 'needs a CUDA GPU' in str(error):
    s.skip(item, section_lib.one_line(error))
  else:
    s.fail(item, error)


class _Clock:
  """Stamps each item of a section, however it ended, with when it ended (`at_s`, from the
  clock's start) and how long it took (`took_s`): where a section's time went."""

  def __init__(self, s: section_lib.Section):
    self.s, self.start = s, time.perf_counter()
    self.last = self.start

  def stamp(self) -> float:
    now = time.perf_counter()
    took, self.last = now - self.last, now
    if self.s.record['items']:
      self.s.record['items'][-1].update(at_s=round(now - self.start, 1), took_s=round(took, 1))
      self.s.save()
    return took


def run(s: section_lib.Section) -> None:
  """cuDNN's attention against dense numerically, then the train step over the preset's grid,
  then attention alone (cuDNN, blockwise) at the kit's shapes."""
  import jax
  from pipelinerl_jax import sharding as sharding_lib

  z = s.sizes
  clock = _Clock(s)
  device = jax.devices()[0]
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=[device])
  peak = section_lib.bf16_peak(device.device_kind, s.args.peak_tflops)
  models = list(dict.fromkeys(v.model for v in z.train_grid))
  _attention_checks(s, clock, models)
  for v in z.train_grid:
    _variant(s, v, mesh, peak, section_lib.memory_limit_bytes(device))
    clock.stamp()
    gc.collect()
  _attention_alone(s, clock, models, peak)


def _attention_checks(s: section_lib.Section, clock: _Clock, models: list[str]) -> None:
  """cuDNN's attention (and, in --quick, blockwise) against dense at each model's head shapes:
  numerics first, as a wrong kernel's speed is worth nothing."""
  from pipelinerl_jax.bench import attention as attention_bench
  from pipelinerl_jax.bench import train_step as train_bench
  for name in models:
    c = train_bench.MODEL_PRESETS[name]
    for impl in (('blockwise', 'cudnn') if s.args.quick else ('cudnn',)):
      item = f'{name} attention check {impl}'
      try:
        r = attention_bench.check_against_dense(
            impl, t=min(512, s.sizes.train_seq_len), kv_heads=c.num_kv_heads,
            group=c.num_heads // c.num_kv_heads, head_dim=c.head_dim, block=128)
      except Exception as e:
        _skip_or_fail(s, item, e)
        clock.stamp()
        continue
      if r['ok']:
        s.add(item, **r)
      else:
        s.record['items'].append(dict(name=item, status='error', error='errors beyond 2x dense '
                                      f"bf16's + 1e-2: {r['errors']}", **r))
      clock.stamp()


def _variant(s: section_lib.Section, v: presets.TrainVariant, mesh, peak: dict,
             limit: int) -> None:
  """One variant of the grid, timed (bench.train_step), beside the memory plan's estimate."""
  from pipelinerl_jax.bench import train_step as train_bench
  z = s.sizes
  if s.remaining() < MIN_VARIANT_S:
    s.skip(v.name, 'time budget')
    return
  device = mesh.devices.ravel()[0]
  args = train_bench.parse_args([
      f'--model={v.model}', f'--rows={z.train_rows}', f'--seq_len={z.train_seq_len}',
      f'--micro={v.micro}', f'--steps={z.train_steps}', '--warmup=1', '--dtype=bfloat16',
      f'--attention={v.attention}', f'--lm_head={v.lm_head}',
      f'--max_timed_s={max(1.0, min(10.0, s.remaining() / 8))}',
      *(['--remat', f'--remat_policy={v.remat}'] if v.remat != 'none' else []),
      *(['--profile'] if v.profile else [])])
  config = train_bench.MODEL_PRESETS[v.model]
  try:
    r = train_bench.bench_model(v.model, args, mesh,
                                memory_limit=int(COMPILED_PEAK_HEADROOM * limit))
  except Exception as e:  # e.g. out of memory: the next variant may still fit
    _skip_or_fail(s, v.name, e)
    return
  fields = {k: val for k, val in r.items() if k != 'model_config'}
  if 'skipped' in r:
    s.record['items'].append(dict(name=v.name, status='skipped', reason=r['skipped'],
                                  memory_limit_bytes=limit, **fields))
    s.save()
    return
  lm_head = 6.0 * config.vocab_size * config.hidden_size * r['tokens']
  memory = section_lib.device_memory(device)
  peak_bytes = memory.get('peak_bytes_in_use')  # none on CPU; the process's, over variants
  plan = train_memory_plan(train_bench.model_config(v.model, args), z.train_rows,
                           z.train_rows // v.micro, z.train_seq_len)
  compiled = r.get('compiled_peak_bytes')
  tflops = peak['tflops']
  s.add(v.name, variant=v._asdict(), **fields,
        mfu=r['flop_per_s'] / (tflops * 1e12) if tflops else None,
        executed_mfu=r['executed_flop_per_s'] / (tflops * 1e12) if tflops else None,
        bf16_peak_tflops=tflops, bf16_peak_source=peak['source'],
        lm_head_flop_share=lm_head / r['flops_per_step'],
        dense_attention_flops=dense_attention_flops(config, z.train_rows, z.train_seq_len),
        memory=memory, memory_plan_bytes=sum(plan.values()), memory_plan_terms=plan,
        plan_over_compiled_peak=sum(plan.values()) / compiled if compiled else None,
        plan_over_device_peak=sum(plan.values()) / peak_bytes if peak_bytes else None)


def _attention_alone(s: section_lib.Section, clock: _Clock, models: list[str],
                     peak: dict) -> None:
  """Each ATTENTION_IMPLS's forward + backward over the rows of the batch the train step of
  each model gets (bench_model's seed 0), against the causal pairs' FLOP floor."""
  import numpy as np
  from pipelinerl_jax.bench import attention as attention_bench
  from pipelinerl_jax.bench import train_step as train_bench
  z = s.sizes
  last_s = 0.0
  for name in models:
    c = train_bench.MODEL_PRESETS[name]
    batch, _ = train_bench.make_batch(np.random.default_rng(0), z.train_rows, z.train_seq_len,
                                      0.9, c.vocab_size)
    for impl in ATTENTION_IMPLS:
      item = f'{name} attention {impl}'
      if s.remaining() < max(MIN_ATTENTION_S, 1.5 * last_s):
        s.skip(item, 'time budget')
        clock.stamp()
        continue
      try:
        r = attention_bench.time_step_attention(
            impl, batch, kv_heads=c.num_kv_heads, group=c.num_heads // c.num_kv_heads,
            head_dim=c.head_dim, block=c.attention_block_q)
        floor = r['pair_flops'] / (peak['tflops'] * 1e12) if peak['tflops'] else None
        s.add(item, model=name, layers=c.num_layers, step_attention_s=r['seconds'] * c.num_layers,
              pair_floor_s=floor, **r)
      except Exception as e:
        _skip_or_fail(s, item, e)
      last_s = clock.stamp()
      gc.collect()


def describe_profile(profile: dict[str, Any] | None) -> str:
  """A train item's profile, in its table cell: the kernel time by part, or why not."""
  if not profile:
    return ''
  if profile.get('error'):
    return f"profile: {profile['error']}"
  step = (f"without command buffers {profile['step_s']:.3f} s/step, "
          if profile.get('step_s') else '')
  if not profile.get('reliable', True):
    return f"profile: {step}UNRELIABLE: {profile['unreliable']}"
  split = ', '.join(f'{k} {v:.0%}' for k, v in (profile.get('shares') or {}).items() if v)
  return f'profile: {step}kernels: {split}'


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  fmt_si = section_lib.fmt_si
  if 'errors' in item:
    return f"max errors {item['errors']} (dense bf16: {item['dense_errors']})"
  if 'pair_flops' in item:
    floor = f", floor {g('pair_floor_s') * 1e3:.2f} ms" if g('pair_floor_s') else ''
    return (f"fwd+bwd {g('rows')}x{g('t')}: {g('seconds') * 1e3:.2f} ms a layer{floor}, "
            f"{g('pair_tflops'):.1f} TFLOP/s on causal pairs, x{g('layers')} layers = "
            f"{g('step_attention_s'):.3f} s a step")
  mfu = f"MFU {g('mfu'):.1%}" if g('mfu') is not None else 'MFU -'
  if g('of_measured_matmul') is not None:
    mfu += f" ({g('of_measured_matmul'):.1%} of the measured matmul)"
  split = describe_profile(g('profile'))
  return (f"{g('rows')}x{g('seq_len')}: {g('tokens')} tok/step, "
          f"{g('step_s_median'):.3f} s/step, {g('tokens_per_s'):.0f} tok/s, "
          f"{fmt_si(g('flop_per_s'), 'FLOP/s')}, {mfu}, executed "
          f"{fmt_si(g('executed_flops'))} ({fmt_si(g('executed_flop_per_s'), 'FLOP/s')}), "
          f"peak {fmt_si(g('compiled_peak_bytes'), 'B')}, compile {g('compile_s'):.0f} s"
          + (f'; {split}' if split else ''))
