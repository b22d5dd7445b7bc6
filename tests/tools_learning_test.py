"""bench/tools_learning.py's per-run numbers. (Its --smoke run, the tools preset end to end,
takes minutes on the 2-core machine: run by hand, not in the suite.)"""

import math

import pytest

from pipelinerl_jax.bench import tools_learning


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
