"""JAX's GPU preallocation is off before jax is first imported, in the entry point and in the
generator actor's module (what a Ray worker imports), unless the user chose a memory setting."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Records the variable at the moment `import jax` first starts, imports the module, then jax
# (if the module did not): whoever imports jax first after the package finds it set.
PROBE = '''
import json, os, sys
seen = {}
class Probe:
  def find_spec(self, name, path=None, target=None):
    if name == 'jax' and 'at_jax_import' not in seen:
      seen['at_jax_import'] = os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')
    return None
sys.meta_path.insert(0, Probe())
import importlib
importlib.import_module(sys.argv[1])
seen['after'] = os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')
seen['module_imported_jax'] = 'jax' in sys.modules
import jax
print(json.dumps(seen))
'''


def probe(module, **env_overrides):
  from pipelinerl_jax import JAX_GPU_MEMORY_VARS
  env = {k: v for k, v in os.environ.items() if k not in JAX_GPU_MEMORY_VARS}
  env.update(env_overrides)
  proc = subprocess.run([sys.executable, '-c', PROBE, module], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('module', ['pipelinerl_jax.main',
                                    'pipelinerl_jax.generation.actors.generator'])
def test_preallocation_is_off_before_jax_is_imported(module):
  seen = probe(module)
  assert seen['at_jax_import'] == 'false' and seen['after'] == 'false'


@pytest.mark.parametrize('user_env', [{'XLA_PYTHON_CLIENT_PREALLOCATE': 'true'},
                                      {'XLA_PYTHON_CLIENT_MEM_FRACTION': '.5'}])
def test_a_users_own_setting_is_kept(user_env):
  seen = probe('pipelinerl_jax.main', **user_env)
  assert seen['after'] == user_env.get('XLA_PYTHON_CLIENT_PREALLOCATE')
