"""Test session setup: 8 simulated CPU devices, so sharded code runs as on a multi-GPU host, and
XLA's CPU backend at -O0.

XLA reads the flags once, when jax first initializes its backend, so they are set before any
test module imports jax. Single-device code simply runs on device 0. The tests' shapes are
tiny, so compiling, not running, is most of their time: LLVM at -O0 compiles about twice as
fast and changes no result a test checks (the XLA graph passes, fusion included, still run).
Processes the tests start on one device get the same (xla_env.one_device); a long run that
wants the default (a learning run of hundreds of steps) starts one without it (reward_test).

`make test` runs most tests on pytest-xdist workers, each a session of its own: a costly build
that tests only read goes through the `built_once` fixture, which makes it once for all of them.

JAX's persistent compilation cache (every program however quick to compile) is shared by both
phases, every worker and every process a test starts, and by later runs on the same machine: it
lives outside the checkout, in ~/.cache/pipelinerl_jax/jax-tests ($XDG_CACHE_HOME if set), so
CI's next run and a fresh clone start warm. The tests build the same few small models again and
again, and XLA's key (the program, the flags, the JAX version) makes a hit the very executable a
fresh compile would give. Past COMPILATION_CACHE_LIMIT_BYTES the next run starts it afresh.
JAX_COMPILATION_CACHE_DIR names another directory; set to '' it turns the cache off (a cold run).
"""
import fcntl
import os
import pathlib
import shutil
import signal
from typing import Callable

import pytest

from xla_env import FAST_COMPILE  # tests/ is on sys.path (pyproject's rootdir insertion)

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + f' {FAST_COMPILE}'
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
_CACHE_HOME = pathlib.Path(os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache')
COMPILATION_CACHE = _CACHE_HOME / 'pipelinerl_jax' / 'jax-tests'
COMPILATION_CACHE_LIMIT_BYTES = 1 << 30


def _empty_if_over(path: pathlib.Path, limit_bytes: int) -> None:
  """Runs of changed code add entries; past the limit the next run starts the cache afresh. (JAX's
  own jax_compilation_cache_max_size re-reads the whole directory on every write, under a lock
  all processes share: with the suite's thousands of entries that cost more than it saved.) The
  directory is moved aside before it is removed: a run of another checkout reading it meanwhile
  finds no entries there (misses), not files vanishing as it reads them."""
  try:
    size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else 0
  except FileNotFoundError:  # another run moved it aside meanwhile
    return
  if size > limit_bytes:
    aside = path.with_name(f'{path.name}.old-{os.getpid()}')
    try:
      path.rename(aside)
    except OSError:
      return
    shutil.rmtree(aside, ignore_errors=True)


if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  if not os.environ.get('PYTEST_XDIST_WORKER'):  # the session's first process, before any worker
    _empty_if_over(COMPILATION_CACHE, COMPILATION_CACHE_LIMIT_BYTES)
  COMPILATION_CACHE.mkdir(parents=True, exist_ok=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = str(COMPILATION_CACHE)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')


# What a test needs of the machine: skipped without it, failed where CI requires it.
from needs import (pytest_configure, pytest_make_collect_report,  # noqa: E402,F401
                   pytest_runtest_makereport, pytest_runtest_setup)


@pytest.fixture(scope='session')
def built_once(tmp_path_factory) -> Callable[[str, Callable[[pathlib.Path], None]], pathlib.Path]:
  """built_once(name, build) -> a dir that build(dir) filled once for this test run: under
  pytest-xdist the first worker to ask builds it while the others wait on a lock, then all read
  it. A failed build leaves no mark, so the next worker to ask tries again (and fails alike)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    base = base.parent  # this run's root, which holds each worker's own basetemp

  def get(name, build):
    out, done = base / f'built-{name}', base / f'built-{name}.done'
    with open(base / f'built-{name}.lock', 'w') as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not done.exists():
        out.mkdir(exist_ok=True)
        build(out)
        done.touch()
    return out
  return get


@pytest.fixture(scope='session')
def model_dir(built_once):
  """An untrained demo-format model (random init, real HF dir with the char tokenizer), built once
  per test run; tests only read it. A module may define its own `model_dir` to override it."""
  from pipelinerl_jax.demo import warmstart  # imports jax: only after XLA_FLAGS is set above
  from pipelinerl_jax import config as config_lib
  demo = config_lib.DemoModelConfig(max_steps=0, eval_problems=8)
  build = lambda d: warmstart.build_demo_model(d / 'demo', demo, log=lambda *_: None)
  return str(built_once('model', build) / 'demo')


@pytest.fixture(scope='session')
def qwen3_model_dir(built_once):
  """The same untrained demo-format model saved as Qwen3ForCausalLM (per-head q/k norms, no
  biases), with tied embeddings as Qwen3's small models have; built once per test run."""
  from pipelinerl_jax.demo import warmstart
  from pipelinerl_jax import config as config_lib
  demo = config_lib.DemoModelConfig(architecture='qwen3', tie_embeddings=True, max_steps=0,
                                    eval_problems=8)
  build = lambda d: warmstart.build_demo_model(d / 'qwen3', demo, log=lambda *_: None)
  return str(built_once('qwen3-model', build) / 'qwen3')


@pytest.fixture
def python_sigint():
  """Python's own SIGINT handler (KeyboardInterrupt) for the test, the previous one after it.
  `_thread.interrupt_main()` (a test's Ctrl-C) does nothing under SIG_IGN or SIG_DFL, which a test
  before this one in the same process may have left: the run would then go on to its time limit
  and the test would check nothing about the interrupt."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)
