"""requirements-gpu.txt resolves, for Python 3.12, to the GPU stack it pins (JAX 0.11.2, torch
2.11.0 pinned by vLLM 0.26.0) on one CUDA major (13); requirements-gpu-cuda12.txt, the JAX path
for older drivers, to JAX 0.11.2 on CUDA 12 alone, without torch, vLLM or Ray.

The checker runs offline on three recorded pip reports; the live resolve needs PyPI and is skipped
with a reason when PyPI cannot be reached, or when the index gives no PEP 658 metadata files
(pip then downloads every wheel, ~4.8 GB; PIPELINERL_RESOLVE_GPU=1 runs it anyway).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import needs  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / 'tests' / 'data'

SUFFIXED = re.compile(r'^nvidia-.+-cu(?P<major>\d+)$')          # nvidia-nccl-cu13
JAX_PLUGIN = re.compile(r'^jax-cuda(?P<major>\d+)-(plugin|pjrt)$')
# Unsuffixed CUDA 13 wheels whose version is the toolkit's (cuBLAS, cuFFT... have their own).
TOOLKIT_VERSIONED = ('cuda-toolkit', 'nvidia-cuda-runtime', 'nvidia-cuda-nvrtc')
# CuTe DSL's compiler runtimes: nvidia-cutlass-dsl 4.8 needs libs-cu12 whatever CUDA is used
# (libs-cu13 too with its [cu13] extra); they live inside its own package, not nvidia/*/lib.
SIDE_BY_SIDE = re.compile(r'^nvidia-cutlass-dsl-libs-')


def cuda_majors(report: dict) -> dict[int, list[str]]:
  """{CUDA major: ['name==version', ...]} of the CUDA wheels in a `pip --report` document."""
  majors: dict[int, list[str]] = {}
  for item in report['install']:
    name = re.sub(r'[-_.]+', '-', item['metadata']['name']).lower()
    version = item['metadata']['version']
    if SIDE_BY_SIDE.match(name):
      continue
    m = SUFFIXED.match(name) or JAX_PLUGIN.match(name)
    if m:
      major = int(m['major'])
    elif name in TOOLKIT_VERSIONED:
      major = int(version.split('.')[0])
    else:
      continue
    majors.setdefault(major, []).append(f'{name}=={version}')
  return majors


def one_cuda_stack_error(report: dict) -> str | None:
  """None, or one line naming the CUDA majors that a resolve mixes and a wheel of each."""
  majors = cuda_majors(report)
  if len(majors) <= 1:
    return None
  return 'two CUDA majors in one environment: ' + '; '.join(
      f'CUDA {k}: {", ".join(v[:3])}{" ..." if len(v) > 3 else ""}'
      for k, v in sorted(majors.items()))


def test_jax_cuda12_beside_torch_2_13_is_two_cuda_majors():
  error = one_cuda_stack_error(json.loads((DATA / 'pip_report_jax_cuda12.json').read_text()))
  assert error and 'CUDA 12: ' in error and 'CUDA 13: ' in error and '\n' not in error
  majors = cuda_majors(json.loads((DATA / 'pip_report_jax_cuda12.json').read_text()))
  assert 'nvidia-nccl-cu12==2.32.3' in majors[12] and 'nvidia-nccl-cu13==2.29.7' in majors[13]


# The stack the GPU figures in docs/ were measured on (vLLM on CUDA: not yet run), as
# requirements-gpu.txt pins it and pip resolves it.
GPU_STACK = {'jax': '0.11.2', 'jaxlib': '0.11.2', 'jax-cuda13-plugin': '0.11.2',
             'torch': '2.11.0', 'vllm': '0.26.0'}
# The JAX path on CUDA 12 (requirements-gpu-cuda12.txt): the same JAX, nothing of vLLM's.
CUDA12_JAX_STACK = {'jax': '0.11.2', 'jaxlib': '0.11.2', 'jax-cuda12-plugin': '0.11.2',
                    'torch': None, 'vllm': None, 'ray': None}
# Each GPU requirements file: its CUDA major and the stack it resolves to (None: absent).
STACKS = {'requirements-gpu.txt': (13, GPU_STACK),
          'requirements-gpu-cuda12.txt': (12, CUDA12_JAX_STACK)}


def stack_error(report: dict, stack: dict[str, str | None] = GPU_STACK,
                major: int = 13) -> str | None:
  """None, or one line naming what a resolve gives other than `stack` on CUDA `major` alone."""
  got = {re.sub(r'[-_.]+', '-', i['metadata']['name']).lower(): i['metadata']['version']
         for i in report['install']}
  wrong = [f'{name} {got.get(name, "missing")} (pinned stack: {version or "absent"})'
           for name, version in stack.items() if got.get(name) != version]
  majors = set(cuda_majors(report))
  other = (f'CUDA {", ".join(map(str, sorted(majors)))} where the stack is CUDA {major}'
           if majors and majors != {major} else None)
  return one_cuda_stack_error(report) or other or (
      ('not the GPU stack: ' + ', '.join(wrong)) if wrong else None)


def test_the_gpu_stack_resolves_to_one_cuda_major():
  report = json.loads((DATA / 'pip_report_gpu_stack.json').read_text())
  assert stack_error(report) is None
  majors = cuda_majors(report)
  assert set(majors) == {13}
  assert {'jax-cuda13-plugin==0.11.2', 'nvidia-nccl-cu13==2.28.9'} <= set(majors[13])
  assert stack_error(report, CUDA12_JAX_STACK, 12) == 'CUDA 13 where the stack is CUDA 12'
  report['install'] = [i for i in report['install'] if i['metadata']['name'] != 'vllm']
  assert stack_error(report) == 'not the GPU stack: vllm missing (pinned stack: 0.26.0)'


def test_the_cuda12_jax_path_resolves_to_cuda_12_without_torch():
  report = json.loads((DATA / 'pip_report_gpu_cuda12_stack.json').read_text())
  assert stack_error(report, CUDA12_JAX_STACK, 12) is None
  majors = cuda_majors(report)
  assert set(majors) == {12}
  assert {'jax-cuda12-plugin==0.11.2', 'nvidia-nccl-cu12==2.32.3'} <= set(majors[12])
  report['install'].append({'metadata': {'name': 'torch', 'version': '2.11.0'}})
  assert stack_error(report, CUDA12_JAX_STACK, 12) == (
      'not the GPU stack: torch 2.11.0 (pinned stack: absent)')


@pytest.mark.parametrize('packages,mixed', [
    ([('jax-cuda12-plugin', '0.10.2'), ('jax_cuda13_pjrt', '0.10.2')], True),
    ([('nvidia-cudnn-cu12', '9.1'), ('nvidia-cuda-runtime', '13.0.96')], True),
    ([('nvidia-cutlass-dsl-libs-cu12', '4.8.0'), ('nvidia-nccl-cu13', '2.29.7')], False),
    ([('nvidia-cublas', '13.1.1.3'), ('nvidia-cufft', '12.0.0.61'), ('torch', '2.13.0')], False),
])
def test_checker_rules(packages, mixed):
  report = {'install': [{'metadata': {'name': n, 'version': v}} for n, v in packages]}
  assert (one_cuda_stack_error(report) is not None) == mixed


def test_requirements_pin_the_gpu_stack_with_the_cuda13_plugin():
  gpu = (ROOT / 'requirements-gpu.txt').read_text()
  assert re.search(rf"^jax\[cuda13\]=={re.escape(GPU_STACK['jax'])}$", gpu, re.M)
  assert re.search(rf"^vllm=={re.escape(GPU_STACK['vllm'])}$", gpu, re.M)
  assert not re.search(r'^jax\[cuda12\]', gpu, re.M)
  assert 'driver >= 580' in gpu and 'Python 3.12' in gpu


def test_the_cuda12_file_pins_the_same_jax_and_no_vllm():
  cuda12 = (ROOT / 'requirements-gpu-cuda12.txt').read_text()
  assert re.search(rf"^jax\[cuda12\]=={re.escape(CUDA12_JAX_STACK['jax'])}$", cuda12, re.M)
  assert CUDA12_JAX_STACK['jax'] == GPU_STACK['jax']
  assert not re.search(r'^(vllm|torch|ray|jax\[cuda13\])\b', cuda12, re.M)
  assert 'driver >= 525.60.13' in cuda12 and 'Python 3.12' in cuda12


def _pypi_metadata_state() -> str:
  """'metadata' (PEP 658 files offered), 'no-metadata', or why PyPI cannot be reached."""
  req = urllib.request.Request('https://pypi.org/simple/flax/',
                               headers={'Accept': 'application/vnd.pypi.simple.v1+json'})
  try:
    with urllib.request.urlopen(req, timeout=10) as r:
      files = json.load(r)['files']
  except (urllib.error.URLError, OSError, ValueError) as e:
    return f'PyPI unreachable ({e})'
  wheels = [f for f in files if f['filename'].endswith('.whl')]
  return 'metadata' if any(f.get('core-metadata') for f in wheels[-5:]) else 'no-metadata'


PLATFORMS = [f'manylinux_2_{v}_x86_64' for v in range(17, 36)] + [
    'manylinux2014_x86_64', 'manylinux2010_x86_64', 'manylinux1_x86_64', 'linux_x86_64']


@pytest.mark.parametrize('requirements', sorted(STACKS))
def test_requirements_gpu_resolves_to_one_cuda_stack(requirements, tmp_path):
  """The real resolve for Python 3.12 on manylinux x86-64 (glibc up to 2.35), from PyPI alone:
  this machine's pip config (local wheel folders, the CPU torch constraint) is left out."""
  state = _pypi_metadata_state()
  if state.startswith('PyPI unreachable'):
    needs.missing('pypi_metadata', f'{state}: cannot resolve {requirements}')
  if state == 'no-metadata' and os.environ.get('PIPELINERL_RESOLVE_GPU') != '1':
    needs.missing('pypi_metadata', 'the index serves no PEP 658 metadata files, so the resolve '
                  'would download every wheel (~4.8 GB); set PIPELINERL_RESOLVE_GPU=1 to run it')
  env = {k: v for k, v in os.environ.items() if not k.startswith('PIP_')}
  env['PIP_CONFIG_FILE'] = os.devnull
  report = tmp_path / 'report.json'
  cmd = [sys.executable, '-m', 'pip', 'install', '-q', '--dry-run', '--ignore-installed',
         '--report', str(report), '--python-version', '3.12', '--implementation', 'cp',
         '--only-binary=:all:', '--no-cache-dir',
         *[f'--platform={p}' for p in PLATFORMS], '-r', str(ROOT / requirements)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  major, stack = STACKS[requirements]
  assert stack_error(json.loads(report.read_text()), stack, major) is None
