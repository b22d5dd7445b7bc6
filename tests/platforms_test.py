"""A run meant for GPUs on a host where JAX has none stops in one line, before anything is
loaded, naming the setting and JAX's reason (platforms.py)."""

import pathlib
import subprocess
import sys

import jax
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluate
from pipelinerl_jax import platforms

ROOT = pathlib.Path(__file__).resolve().parent.parent


def validated(preset='tiny', **overrides):
  c = config_lib.load_preset(preset)
  for key, value in overrides.items():
    section, _, name = key.rpartition('.')
    node = c
    for part in filter(None, section.split('.')):
      node = node[part]
    node[name] = value
  return config_lib.validate(c, runnable=False)


def test_settings_that_need_a_gpu_are_named():
  assert platforms.settings_needing_gpu(validated(), device_count=1) == []
  gpu_preset = platforms.settings_needing_gpu(validated('qwen1p5b_8xh100'), device_count=1)
  assert gpu_preset == ["config.platform='gpu'",
                        "config.train.mesh='1,4,1' (needs 4 devices, JAX sees 1)",
                        "config.generation.remote.weight_transport='nccl'"]
  assert platforms.settings_needing_gpu(validated(**{'train.mesh': '2,-1,2'}), 8) == []
  assert platforms.settings_needing_gpu(validated(**{'train.mesh': '2,-1,2'}), 2) == [
      "config.train.mesh='2,-1,2' (needs 4 devices, JAX sees 2)"]
  ray = validated(**{'generation.placement': 'ray', 'generation.remote.devices': '4,5'})
  assert platforms.settings_needing_gpu(ray, 8) == [
      "config.generation.remote.devices='4,5' (GPU ids)"]


def test_check_refuses_a_gpu_config_on_cpu_unless_allowed():
  assert jax.default_backend() == 'cpu'
  platforms.check(validated())  # the CPU demo: nothing needs a GPU
  with pytest.raises(ValueError) as e:
    platforms.check(validated('paper_7b'))
  message = str(e.value)
  assert '\n' not in message and message.startswith(
      "config.platform='gpu' needs a GPU, but JAX's backend is cpu: ")
  assert "JAX_PLATFORMS='cpu' leaves the GPU out" in message
  assert message.endswith('--config.allow_cpu=True runs it on the CPU anyway (debugging)')
  platforms.check(validated('paper_7b', allow_cpu=True))


def test_reason_is_jaxs_own_when_its_cuda_backend_failed(monkeypatch, tmp_path):
  from jax._src import xla_bridge
  jax.devices()  # the table is filled when the backends start
  monkeypatch.setitem(xla_bridge._backend_errors, 'cuda',
                      'XLA_CLIENT_MEM_FRACTION is specified together with\n'
                      'XLA_PYTHON_CLIENT_MEM_FRACTION. Remove the latter one, it is deprecated.')
  device = tmp_path / 'nvidia0'
  device.write_text('')
  monkeypatch.setattr(platforms, 'NVIDIA_DEVICE_FILES', (str(device), '/dev/not-there'))
  assert platforms.describe_no_gpu() == (
      'its CUDA backend failed to start: XLA_CLIENT_MEM_FRACTION is specified together with '
      'XLA_PYTHON_CLIENT_MEM_FRACTION. Remove the latter one, it is deprecated. '
      f'(the OS shows an NVIDIA device: {device})')


def test_reason_without_a_plugin_or_a_device(monkeypatch):
  monkeypatch.setattr(platforms, 'chosen_platforms', lambda: '')  # JAX's own choice
  monkeypatch.setattr(platforms, 'CUDA_PLUGIN_MODULES', ('no_such_plugin_module',))
  assert platforms.no_gpu_reason().startswith('no CUDA plugin for JAX is installed')
  monkeypatch.setattr(platforms, 'CUDA_PLUGIN_MODULES', ('json',))  # "installed"
  monkeypatch.setattr(platforms, 'NVIDIA_DEVICE_FILES', ('/dev/not-there',))
  assert platforms.no_gpu_reason() == 'the OS shows no NVIDIA device'


def test_main_stops_in_one_line_before_the_model_path_is_looked_at(tmp_path):
  """The GPU preset's model path is a placeholder: the missing GPU is named first."""
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:qwen1p5b_8xh100',
       f'--workdir={tmp_path / "run"}'], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("error: config.platform='gpu' needs a GPU, but JAX's backend is cpu")
  assert not (tmp_path / 'run').exists()  # nothing claimed, nothing written
  allowed = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:qwen1p5b_8xh100',
       f'--workdir={tmp_path / "run"}', '--config.allow_cpu=True'], cwd=ROOT,
      capture_output=True, text=True, timeout=120)
  assert allowed.returncode == 1 and 'config.model.path: is empty' in allowed.stderr


def test_evaluate_stops_before_the_checkpoint_is_read(tmp_path):
  with pytest.raises(ValueError, match="config.platform='gpu' needs a GPU"):
    evaluate.evaluate_checkpoint(config_lib.load_preset('qwen1p5b_8xh100'),
                                 str(tmp_path / 'no-checkpoint'))
