"""Test session setup: 8 simulated CPU devices, so sharded code runs as on a multi-GPU host, and
XLA's CPU backend at -O0.

XLA reads the flags once, when jax first initializes its backend, so they are set before any
test module imports jax. Single-device code simply runs on device 0. The tests' shapes are
tiny, so compiling, not running, is most of their time: LLVM at -O0 compiles about twice as
fast and changes no result a test checks (the XLA graph passes, fusion included, still run).
Processes the tests start on one device get the same (xla_env.one_device); a long run that
wants the default (a learning run of hundreds of steps) starts one without it (reward_test).
"""
import os

import pytest

from xla_env import FAST_COMPILE  # tests/ is on sys.path (pyproject's rootdir insertion)

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + f' {FAST_COMPILE}'
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
