"""The GPU proof kit (bench/gpu.py): --quick end to end on CPU with the packages the GPU image
lacks hidden, so the kit is shown to run without them; its time budget and a failing section;
its pure helpers. Timing is never asserted."""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import jax
import pytest

from pipelinerl_jax.bench import gpu
from pipelinerl_jax.bench import train_step as train_bench
from pipelinerl_jax.models import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
# On the image: none of these (ml_collections travels as a wheel, so it stays visible here).
HIDDEN = tuple(m for m in gpu.IMAGE_ABSENT if m not in gpu.CARRIED)

# Loaded by every Python process started with this directory on PYTHONPATH, the kit's section
# processes included: the path finder stops seeing the hidden packages, so they are as absent
# as on the image (`import` fails, `importlib.util.find_spec` returns None).
SITECUSTOMIZE = f'''
import importlib.machinery
import sys

HIDDEN = {HIDDEN!r}


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


def image_like_env(hider_dir: pathlib.Path) -> dict:
  hider_dir.mkdir(parents=True, exist_ok=True)
  (hider_dir / 'sitecustomize.py').write_text(SITECUSTOMIZE)
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
def quick(tmp_path_factory):
  """One --quick run, as `make gpu-check` does it, with the image's absent packages hidden."""
  tmp = tmp_path_factory.mktemp('gpu_kit')
  out = tmp / 'gpu.json'
  proc = run_kit(['--quick', f'--out={out}', f'--workdir={tmp / "work"}'],
                 image_like_env(tmp / 'hider'))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return json.loads(out.read_text()), proc.stdout


def items(report, section):
  return {i['name']: i for i in report['sections'][section]['items']}


def positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_runs_every_section_without_image_absent_packages(quick):
  report, _ = quick
  assert report['quick'] and list(report['sections']) == list(gpu.SECTIONS)
  for name, section in report['sections'].items():
    assert section['status'] == 'ok', (name, section.get('error'), section['items'])
    assert section['imported_absent_on_image'] == [], name
    assert all(i['status'] == 'ok' for i in section['items']), name
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
  assert positive(env['bf16_matmul']['tflops']) and env['bf16_matmul']['n'] == gpu.QUICK.matmul_n
  assert positive(env['device_copy']['gb_per_s'])


def test_quick_train_step_counts_flops_and_leaves_mfu_to_known_peaks(quick):
  report, _ = quick
  (name, r), = items(report, 'train').items()
  assert name == 'tiny' and r['dtype'] == 'bfloat16' and r['remat'] is True
  for key in ('tokens_per_s', 'flop_per_s', 'flops_per_step', 'step_s_median', 'compile_s',
              'dense_attention_flops', 'memory_estimate_bytes'):
    assert positive(r[key]), key
  assert math.isfinite(r['loss']) and r['samples'] > r['rows']
  assert r['mfu'] is None  # CPU: no datasheet peak
  matmul = items(report, 'env')['bf16_matmul']['tflops']
  assert r['of_measured_matmul'] == pytest.approx(r['flop_per_s'] / (matmul * 1e12))
  assert 0 < r['lm_head_flop_share'] < 1
  config = train_bench.MODEL_PRESETS['tiny']
  assert r['flops_per_step'] >= 6 * train_bench.flop_params(config) * r['tokens']


def test_quick_engine_checks_the_reads_and_decodes_every_token_with_and_without_updates(quick):
  report, _ = quick
  z = gpu.QUICK
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
    assert r['dense_kv_bytes'] == gpu.kv_cache_bytes(config, h, z.prompt_len + z.new_tokens)
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
  devices = gpu.CPU_DEVICES['publish']
  assert sharded['devices'] == replicated['devices'] == devices
  assert sharded['arrays'] == replicated['arrays'] == devices * leaves  # one per shard
  assert sharded['leaves_split'] > 0 and replicated['leaves_split'] == 0
  assert replicated['bytes'] == devices * p['bytes'] and sharded['bytes'] < replicated['bytes']
  for r in (single, sharded, replicated):
    assert r['pointers_equal'] is True and r['pointers_differ'] == 0
    assert r['values_equal'] is True and r['torch_devices'] == ['cpu']
    assert r['seconds'] >= 0 and len(r['seconds_runs']) == gpu.QUICK.repeats


def test_quick_e2e_reports_rewards(quick):
  report, _ = quick
  (name, r), = items(report, 'e2e').items()
  assert name == 'tiny preset' and r['steps'] == gpu.QUICK.e2e_steps
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
  rows = [l.split()[:2] for l in lines[2:] if not l.startswith('wrote ')]
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
  assert e2e['share_s'] == pytest.approx(6 * gpu.SECTION_WEIGHTS['e2e'] / (
      gpu.SECTION_WEIGHTS['e2e'] + gpu.SECTION_WEIGHTS['env']), abs=0.5)
  assert e2e['status'] == 'timeout' and 'killed' in e2e['error']
  assert e2e['wall_s'] < gpu.kill_after(e2e['share_s']) + 5
  assert env['status'] == 'skipped' and 'time budget' in env['reason']
  assert proc.returncode == 1 and 'timeout' in proc.stdout
  assert wall < 60


# ---------------------------------------------------------------------------------------------
# Pure helpers.


def test_budget_shares_follow_the_weights_and_pass_on_unused_time():
  sections = list(gpu.SECTIONS)
  total = sum(gpu.SECTION_WEIGHTS.values())
  assert gpu.share_of_budget(460, sections) == pytest.approx(
      460 * gpu.SECTION_WEIGHTS['env'] / total)
  # The last section gets everything left; a section that ended early leaves more to the rest.
  assert gpu.share_of_budget(100, ['e2e']) == 100
  assert gpu.share_of_budget(300, sections[1:]) > gpu.share_of_budget(200, sections[1:])
  assert gpu.share_of_budget(-5, sections) == 0
  assert gpu.kill_after(100) == 100 + gpu.KILL_GRACE_S and gpu.kill_after(2) == 3.5


def test_bf16_peak_by_device_kind():
  assert gpu.bf16_peak('NVIDIA H100 80GB HBM3')['tflops'] == 989.4  # SXM
  assert gpu.bf16_peak('NVIDIA H100 PCIe')['tflops'] == 756.5
  assert gpu.bf16_peak('NVIDIA H100 NVL')['tflops'] == 835.5
  assert gpu.bf16_peak('NVIDIA H200')['tflops'] == 989.4
  assert 'H100 SXM' in gpu.bf16_peak('NVIDIA H100 80GB HBM3')['source']
  assert gpu.bf16_peak('cpu')['tflops'] is None
  assert gpu.bf16_peak('cpu', 100.0) == dict(tflops=100.0, source='--peak_tflops')


def test_kv_cache_bytes_match_the_engine_cache():
  for name in ('tiny', 'qwen2.5-0.5b'):
    for dtype in ('float32', 'bfloat16'):
      config = dataclasses.replace(train_bench.MODEL_PRESETS[name], dtype=dtype)
      cache = jax.eval_shape(lambda: transformer.init_cache(config, 64, 1280))
      assert gpu.kv_cache_bytes(config, 64, 1280) == sum(x.size * x.dtype.itemsize
                                                         for x in cache)


def test_reward_summary_compares_first_and_last_steps():
  records = [dict(step=i + 1, time_s=float(i), reward_mean=i / 100) for i in range(60)]
  r = gpu.reward_summary(records)
  assert r['reward_window'] == 10 and r['steps'] == 60 and r['rising'] is True
  assert r['reward_first'] == pytest.approx(0.045) and r['reward_last'] == pytest.approx(0.545)
  assert len(r['curve']) == 60 and r['curve'][-1] == (60, 59.0, 0.59)
  assert len(gpu.reward_summary(records * 10)['curve']) <= 200
  assert gpu.reward_summary(records[:2])['reward_window'] == 1
  assert gpu.reward_summary([])['reward_first'] is None


def test_section_env_sets_device_count_and_keeps_user_settings():
  env = gpu.child_env('publish', {'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --foo',
                                  'XLA_PYTHON_CLIENT_PREALLOCATE': 'true'})
  assert env['XLA_FLAGS'].split() == ['--foo', '--xla_force_host_platform_device_count=4']
  assert env['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'true'  # the user's choice wins
  assert gpu.child_env('env', {})['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'
  assert str(ROOT) in gpu.child_env('env', {})['PYTHONPATH'].split(os.pathsep)


def test_bad_sections_are_refused_with_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    gpu.main(['--sections=env,bogus'])
  assert e.value.code == 2 and "--sections" in capsys.readouterr().err
