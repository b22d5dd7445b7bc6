"""The tools preset end to end (bench/tools_learning.py --smoke: an untrained model, 3 steps of
episodes, greedy pass@1 with tools through evaluate), and the bench's per-run numbers."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from pipelinerl_jax.bench import tools_learning

import xla_env  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_smoke_runs_the_tools_preset_and_writes_json(tmp_path):
  out = tmp_path / 'tools.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.tools_learning', '--smoke', '--seeds=0',
       '--eval_problems=4', f'--out={out}', f'--cache_dir={tmp_path / "cache"}',
       f'--workdir={tmp_path / "runs"}'],
      cwd=ROOT, env=xla_env.one_device(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'reward_start' in proc.stdout and 'tool_start' in proc.stdout
  report = json.loads(out.read_text())
  (run,) = report['runs']
  assert run['seed'] == 0 and run['steps'] == 3 and run['samples'] == 48
  # Every step record carried the episode metrics (the share is a fraction, not missing).
  shares = report['curves']['seed0']['tool_share']
  assert len(shares) == 3 and all(0.0 <= s <= 1.0 for s in shares)
  for key in ('pass1_start', 'pass1_end', 'eval_calls_start', 'eval_calls_end'):
    assert 0.0 <= run[key] <= 1.0
  samples = (tmp_path / 'runs' / 'seed0' / 'eval-end' / 'samples.jsonl').read_text().splitlines()
  assert len(samples) == 4 and all('turns' in json.loads(s) for s in samples)


def test_run_summary_windows_and_noise():
  records = [dict(step=i + 1, samples=16 * (i + 1), time_s=float(i), reward_mean=r,
                  **{tools_learning.TOOL_KEY: t})
             for i, (r, t) in enumerate(zip([0.1, 0.3] * 10 + [0.7, 0.9] * 10,
                                            [0.2] * 20 + [0.8] * 20))]
  s = tools_learning.run_summary(records)
  assert (s['steps'], s['samples'], s['time_s']) == (40, 640, 39.0)
  assert s['reward_start'] == pytest.approx(0.2) and s['reward_end'] == pytest.approx(0.8)
  assert s['rise'] == pytest.approx(0.6)
  se = 0.1 * math.sqrt(10 / 9) / math.sqrt(10)  # std (ddof 1) of ten alternating +-0.1
  assert s['noise'] == pytest.approx(2 * math.hypot(se, se))
  assert (s['tool_share_start'], s['tool_share_end']) == (pytest.approx(0.2), pytest.approx(0.8))
