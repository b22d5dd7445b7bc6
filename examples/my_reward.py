"""A reward of your own for pipelinerl_jax's math task (docs/data.md: your own reward).

  pipelinerl-train --config=configs/math.py:qwen3_1p7b_1xgpu \
      --config.task.score_fn=examples/my_reward.py:score ...

`score(completion, reference)` gets the decoded completion and the record's reference answer and
returns True / False (correct / wrong: the rewards of task.reward.*), None (no answer found), a
number (the reward; status 'correct' when > 0) or (reward, status). It runs in the verify worker
processes under task.verify_timeout_s and a memory limit: a completion that makes it hang or
raise costs that sample (status 'unparsable', the error logged in one line), never the run.
"""

import re

_FINAL = re.compile(r'answer\s*:\s*(-?[\d,]*\.?\d+)', re.IGNORECASE)


def score(completion: str, reference: str):
  """Integer answers, DAPO style: the number after the last 'Answer:'; 1 if it equals the
  reference, 0.1 for a well-formed wrong answer (a format reward), None when there is none."""
  found = _FINAL.findall(completion[-2000:])  # the end of the text: bounded work per sample
  if not found:
    return None
  try:
    value = float(found[-1].replace(',', ''))
    target = float(reference.replace(',', ''))
  except ValueError:
    return (0.0, 'unparsable')
  if abs(value - target) < 1e-9:
    return (1.0, 'correct')
  return (0.1, 'wrong')
