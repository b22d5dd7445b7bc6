"""PipelineRL learns end to end (the reward rises, the JAX engine generating, weights updated in
flight), and vLLM serves the trainer's weights across updates (its log mu is the trainer's log pi).

The warm-started demo model (built once into the cache, ~45 s) on unseen 2-digit additions, the
demo preset run for a fixed number of optimizer steps (not time: a loaded host is slower, not
less conclusive). A single step's mean reward has a std of ~0.06-0.09 around its trend, so a
10-step mean's is ~0.025 and the difference of two ~0.035: the 0.10 margin is ~3 of those.
Measured over 240 steps, first 10 -> last 10 steps' mean reward, JAX engine, 2026-11-26 (~50 s of
RL each): 0.289 -> 0.433 (seed 0), 0.266 -> 0.471 (seed 1), 0.243 -> 0.456 (seed 2), 0.248 ->
0.402 (seed 3).

What vLLM adds to that run is its sampler: learning with it is learning with the JAX engine
once vLLM's log mu is the trainer's log pi for every version it serves. Its test checks that
directly, over updates, in far fewer steps than a rise of the reward needs (see its doc).

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
# vLLM: 8 generated batches, by versions 0, 2, ..., 14 (7 of them loaded as updates); both
# engines fp32, so log mu and log pi of the same params differ by summation order alone
# (vllm_engine_test: within 1e-4 per token).
VLLM_STEPS = 16
AGREE = 1e-4


def run_demo(workdir: pathlib.Path, *flags: str) -> list[dict]:
  """The demo's main command with `flags`; its step records."""
  cmd = [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
         f'--workdir={workdir}', '--config.seed=1', '--config.rl.max_time_s=0',
         '--config.log.tensorboard=False', '--config.log.progress=False', *flags]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return [r for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl')) if 'step' in r]


# A fixed number of steps, not time, and the lag bounded by rl.max_lag: a run beside another
# test (make test's parallel phase) is slower, not less conclusive.
def test_reward_rises(tmp_path):
  records = run_demo(tmp_path / 'run', f'--config.rl.total_steps={STEPS}')
  rewards = np.array([r['reward_mean'] for r in records])
  assert len(rewards) == STEPS
  first, last = rewards[:10].mean(), rewards[-10:].mean()
  print(f'\nreward first 10 steps {first:.3f}, last 10 steps {last:.3f} '
        f'(+{last - first:.3f}); {records[-1]["time_s"]:.0f} s, '
        f'max lag {max(r["lag_max"] for r in records)}')
  assert last > first + MARGIN


@pytest.mark.needs('vllm')
def test_vllm_log_mu_is_the_trainers_log_pi_at_every_version_it_serves(tmp_path):
  """The demo with vLLM generating (in-process), conventional RL with 2 optimizer steps per
  generated batch: the first step of each batch trains on tokens vLLM sampled with the very
  params the trainer holds (lag 0), so |log pi - log mu| is numerics alone (both fp32); the
  second trains them one update later (lag 1), which shows how far one update moves log pi.
  vLLM gets the params after every second step: one it failed to load, or loaded wrong (a
  tensor left out, a fused projection misplaced), would put a lag-0 step at least that far off."""
  records = run_demo(tmp_path / 'run', '--config.generation.backend=vllm',
                     '--config.generation.vllm.kv_cache_mb=64', '--config.rl.mode=conventional',
                     '--config.rl.conventional_steps=2', f'--config.rl.total_steps={VLLM_STEPS}')
  assert [r['step'] for r in records] == list(range(1, VLLM_STEPS + 1))
  same, moved = records[0::2], records[1::2]  # lag 0, lag 1
  assert all(r['lag_min'] == r['lag_max'] == 0 for r in same)
  assert all(r['lag_min'] == r['lag_max'] == 1 for r in moved)
  agree = np.array([r['abs_logp_diff'] for r in same])
  one_update = np.array([r['abs_logp_diff'] for r in moved])
  print(f'\n|log pi - log mu| at lag 0 (versions 0, 2, ..., {VLLM_STEPS - 2} served by vLLM): '
        f'max {agree.max():.1e}; one update later: min {one_update.min():.1e}')
  assert agree.max() <= AGREE
  assert one_update.min() > 10 * AGREE
