"""Your own reward (config.task.score_fn): the documented example, run by the math task in its
worker pool, with the built-in task's contract (statuses, reward table, truncation, overlong
penalty) and its protections (a hanging or raising function costs one sample, in time, with a
one-line error; a spec that does not import is refused before anything starts)."""

import importlib.util
import pathlib
import time

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import data
from pipelinerl_jax.tasks import math as math_task
from pipelinerl_jax.tasks import registry
from pipelinerl_jax.tasks.base import Problem, Score

# Per-sample deadlines and worker kills: on a loaded core a verdict can turn into a timeout.
pytestmark = pytest.mark.serial

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / 'examples' / 'my_reward.py'
DATA = ROOT / 'tests' / 'data'
TIMEOUT_S = 1.5
START_S = 3.0


def test_the_documented_example_is_short_and_scores_as_it_says():
  assert len(EXAMPLE.read_text().splitlines()) <= 40
  spec = importlib.util.spec_from_file_location('my_reward', EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.score('so 36+36.\nAnswer: 72', '72') == (1.0, 'correct')
  assert module.score('Answer: 1,000', '1000') == (1.0, 'correct')
  assert module.score('Answer: 71', '72') == (0.1, 'wrong')
  assert module.score('Answer: 5\nno, Answer: 72', '72') == (1.0, 'correct')  # the last one
  assert module.score('it is 72', '72') is None
  assert module.score('Answer: 72', 'x') == (0.0, 'unparsable')


@pytest.fixture(scope='module')
def task():
  records = list(data.load(str(DATA / 'math_problems.jsonl')).records)
  rewards = config_lib.RewardConfig(overlong_max_len=100, overlong_buffer=20)
  t = math_task.MathTask([(records, 1.0)], rewards=rewards, score_fn=f'{EXAMPLE}:score',
                         timeout_s=TIMEOUT_S, num_workers=1)
  assert t.wait_ready(60.0)
  yield t
  t.close()


def test_the_task_scores_with_the_users_function_under_the_same_contract(task):
  p = Problem('p', 'q', '72')
  scores = task.score_many([p] * 4, ['Answer: 72', 'Answer: 70', 'no idea', 'Answer: 72'],
                           truncated=[False, False, False, True], num_tokens=[10, 10, 10, 10])
  # Its own rewards and statuses; a truncated one gets task.reward.truncated ('penalize': 0)
  # without the function being asked, as in the built-in task.
  assert scores == [Score(1.0, 'correct'), Score(0.1, 'wrong'), Score(0.0, 'no_answer'),
                    Score(0.0, 'no_answer')]
  assert task.score(p, 'Answer: 72', num_tokens=90).reward == pytest.approx(0.5)  # overlong
  assert task.answer_of('Answer: 72') is None  # its reading of answers is the user's
  assert task.counters['truncated'] >= 1


def test_a_hanging_raising_or_odd_function_costs_one_sample_in_time(tmp_path):
  module = tmp_path / 'hostile.py'
  module.write_text(
      'def score(completion, reference):\n'
      '  if completion == "hang":\n'
      '    while True:\n'
      '      pass\n'
      '  if completion == "raise":\n'
      '    raise ZeroDivisionError("no\\nway")\n'
      '  if completion == "odd":\n'
      '    return "yes"\n'
      '  return completion == reference\n')
  t = math_task.MathTask([([data.Record('a', 'd', (('user', 'q'),), '1')], 1.0)],
                         score_fn=f'{module}:score', timeout_s=TIMEOUT_S, num_workers=1)
  try:
    assert t.wait_ready(60.0)
    p = Problem('p', 'q', '1')
    t0 = time.monotonic()
    scores = t.score_many([p] * 5, ['1', 'hang', 'raise', 'odd', '2'])
    assert time.monotonic() - t0 < TIMEOUT_S + START_S + 2.0
    assert [s.status for s in scores] == ['correct', 'unparsable', 'unparsable', 'unparsable',
                                          'wrong']
    counters = t.counters
    assert counters['timeout'] == 1 and counters['worker_error'] == 2
    assert counters['worker_restarts'] == 1  # the hanging worker was killed and replaced
    error = t._pool.last_error
    assert error.startswith('score_fn returned') and '\n' not in error
    assert t.score(p, '1').status == 'correct'  # and the pool carries on
  finally:
    t.close()


def test_a_spec_that_does_not_import_is_one_line_before_anything_starts(tmp_path):
  base = dict(name='math', train_files=(str(DATA / 'math_problems.jsonl'),))
  for spec, message in (
      ('no_such_module_xyz:score', r"config.task.score_fn: 'no_such_module_xyz:score': cannot "
                                   r"import 'no_such_module_xyz': ModuleNotFoundError"),
      (f'{EXAMPLE}:nope', r"config.task.score_fn: .*my_reward.py' has no function 'nope'"),
      (f'{tmp_path}/missing.py:score', r'cannot import .*FileNotFoundError: no such file')):
    with pytest.raises(ValueError, match=message) as e:
      registry.make_task(config_lib.TaskConfig(**base, score_fn=spec))
    assert '\n' not in str(e.value)
  c = config_lib.base_config()
  c.task.name, c.task.score_fn = 'math', 'justaname'
  with pytest.raises(ValueError, match=r"config.task.score_fn: must be 'module:function'"):
    config_lib.validate(c, runnable=False)
