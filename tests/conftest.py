"""Test session setup: 8 simulated CPU devices, so sharded code runs as on a multi-GPU host.

XLA reads the flag once, when jax first initializes its backend, so it is set before any test
module imports jax. Single-device code simply runs on device 0.
"""
import os

import pytest

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


@pytest.fixture(scope='session')
def model_dir(tmp_path_factory):
  """An untrained demo-format model (random init, real HF dir with the char tokenizer), built once
  per session; tests only read it. A module may define its own `model_dir` to override it."""
  from pipelinerl_jax.demo import warmstart  # imports jax: only after XLA_FLAGS is set above
  from pipelinerl_jax import config as config_lib
  demo = config_lib.DemoModelConfig(max_steps=0, eval_problems=8)
  out = tmp_path_factory.mktemp('model') / 'demo'
  return str(warmstart.build_demo_model(out, demo, log=lambda *_: None))
