"""Task interface: boxed-answer extraction (incl. hostile inputs), scoring, problem streams."""

import itertools
import time

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import ArithmeticTask, Problem, Score, extract_boxed
from pipelinerl_jax.tasks import registry

_OPS = {'+': lambda a, b: a + b, '-': lambda a, b: a - b, '*': lambda a, b: a * b}


def _solve(prompt):
  """Independent reference: parse 'a<op>b=' and compute."""
  body = prompt[:-1]
  for op, fn in _OPS.items():
    a, sep, b = body.partition(op)
    if sep and a and b:
      return fn(int(a), int(b))
  raise AssertionError(prompt)


@pytest.mark.parametrize('text, want', [
    ('\\boxed{82}', '82'),
    ('so the answer is \\boxed{ 82 } .', ' 82 '),
    ('\\boxed{}', ''),
    ('\\boxed{\\frac{1}{2}}', '\\frac{1}{2}'),
    ('\\boxed{{a}{b}}c}', '{a}{b}'),
    ('\\boxed{1} then \\boxed{2}', '2'),
    ('\\boxed{1} then \\boxed{2', '1'),           # an unclosed last box is ignored
    ('}}} \\boxed{7} }}', '7'),                      # stray closers close nothing
    ('{ \\boxed{7}', '7'),                           # an unclosed plain brace around it
    ('\\boxed{\\boxed{3}}', '\\boxed{3}'),           # the box that closes last wins
    ('no box here {82}', None),
    ('\\boxed 82', None),
    ('\\boxed{82', None),
    ('', None),
])
def test_extract_boxed(text, want):
  assert extract_boxed(text) == want


def test_extract_boxed_deep_nesting_is_exact():
  depth = 5000
  text = '\\boxed{' * depth + '7' + '}' * depth
  assert extract_boxed(text) == '\\boxed{' * (depth - 1) + '7' + '}' * (depth - 1)


@pytest.mark.parametrize('text', [
    '{' * 100_000,
    '}' * 100_000,
    '\\boxed{' * 20_000,                                   # 140k chars, nothing closes
    '\\boxed{' * 5_000 + '}' * 5_000 + '\\boxed{' * 5_000,
    ('\\boxed{' * 5_000 + 'x') * 3,
    '\\boxed{1}' * 12_000,
    'a' * 100_000 + '\\boxed{1}',
])
def test_extract_boxed_hostile_inputs_are_fast(text):
  start = time.perf_counter()
  extract_boxed(text)
  assert time.perf_counter() - start < 0.5


def test_score_statuses():
  task = ArithmeticTask()
  p = Problem(id='x', prompt='37+45=', answer='82')
  assert task.score(p, '\\boxed{82}') == Score(1.0, 'correct')
  assert task.score(p, ' \\boxed{ 82 }') == Score(1.0, 'correct')
  assert task.score(p, '\\boxed{81}\\boxed{82}') == Score(1.0, 'correct')
  assert task.score(p, '\\boxed{82}\\boxed{81}') == Score(0.0, 'wrong')
  assert task.score(p, '\\boxed{-82}') == Score(0.0, 'wrong')
  assert task.score(p, '82') == Score(0.0, 'no_answer')
  assert task.score(p, '\\boxed{82') == Score(0.0, 'no_answer')
  assert task.score(p, '\\boxed{8 2}') == Score(0.0, 'unparsable')
  assert task.score(p, '\\boxed{8_2}') == Score(0.0, 'unparsable')  # int() would accept it
  assert task.score(p, '\\boxed{}') == Score(0.0, 'unparsable')
  assert task.score(p, '\\boxed{' + '9' * 5000 + '}') == Score(0.0, 'unparsable')
  neg = Problem(id='y', prompt='12-45=', answer='-33')
  assert task.score(neg, '\\boxed{-33}') == Score(1.0, 'correct')


def test_score_never_raises():
  task = ArithmeticTask()
  p = Problem(id='x', prompt='37+45=', answer='82')
  for text in ['\\boxed{' * 5000, '\x00\\boxed{\udcff}', None, 123]:
    assert task.score(p, text).reward == 0.0


def test_target_and_answers_are_correct():
  task = ArithmeticTask(ops=('+', '-', '*'))
  for p in itertools.islice(task.problems(3), 300):
    assert p.prompt.endswith('=') and int(p.answer) == _solve(p.prompt)
    assert task.score(p, task.target(p)) == Score(1.0, 'correct')
  problems = itertools.islice(task.problems(3), 300)
  assert {next(op for op in '+-*' if op in p.prompt) for p in problems} == {'+', '-', '*'}
  for p in itertools.islice(ArithmeticTask().problems(0), 100):
    a, b = p.prompt[:-1].split('+')
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99


def test_problem_streams_are_deterministic_and_infinite():
  task = ArithmeticTask()
  first = list(itertools.islice(task.problems(7), 200))
  again = list(itertools.islice(ArithmeticTask().problems(7), 200))
  assert first == again
  other = list(itertools.islice(task.problems(8), 200))
  assert [p.prompt for p in first] != [p.prompt for p in other]
  assert len({p.id for p in first + other}) == 400  # ids unique across seeds
  assert sum(1 for _ in itertools.islice(task.problems(0), 20_000)) == 20_000  # > the pool


def test_sft_set_is_fixed_distinct_and_disjoint_from_rl():
  task = ArithmeticTask()
  sft = task.sft_problems(0, 1000)
  assert sft == task.sft_problems(0, 1000)
  assert task.sft_problems(0, 100) == sft[:100]
  assert len({p.prompt for p in sft}) == 1000
  assert task.sft_problems(1, 100) != sft[:100]
  sft_prompts = {p.prompt for p in sft} | {p.prompt for p in task.sft_problems(5, 1000)}
  rl_prompts = {p.prompt for s in (0, 1, 10_000)
                for p in itertools.islice(task.problems(s), 5000)}
  assert len(rl_prompts) > 4000
  assert not sft_prompts & rl_prompts
  with pytest.raises(ValueError, match='distinct SFT-pool problems'):
    task.sft_problems(0, 2000)  # the pool holds ~1/8 of 8100


def test_config_makes_and_checks_the_task():
  """The checks live in config.py (TaskConfig, RewardConfig); the registry passes them on."""
  config = config_lib.validate(dict(task=dict(ops=('+', '*'), digits=3,
                                              reward=dict(truncated='mask'))))
  assert registry.make_task(config.task) == ArithmeticTask(ops=('+', '*'), digits=3,
                                                           truncated='mask')
  assert registry.make_task(config_lib.validate({}).task).truncated == 'penalize'
  for bad, key in [(dict(ops=('/',)), 'ops'), (dict(sft_pool_mod=1), 'sft_pool_mod'),
                   (dict(digits=10), 'digits'), (dict(reward=dict(truncated='zero')), 'truncated')]:
    with pytest.raises(ValueError, match=key):
      config_lib.validate(dict(task=bad))


P82 = Problem(id='x', prompt='37+45=', answer='82')


def test_a_cut_off_completion_is_never_paid_by_default():
  task = ArithmeticTask()
  for text in ['\\boxed{82}', '\\boxed{82}1}1}', 'junk \\boxed{82}']:
    assert task.score(P82, text, truncated=True) == Score(0.0, 'no_answer')
    assert task.score(P82, text, truncated=False).reward == 1.0


def test_truncated_modes():
  text = '\\boxed{82}'
  pen = ArithmeticTask(truncated='penalize', truncated_reward=-0.5)
  assert pen.score(P82, text, truncated=True) == Score(-0.5, 'no_answer')
  assert pen.score(P82, '\\boxed{1}', truncated=False) == Score(0.0, 'wrong')  # finished: judged
  mask = ArithmeticTask(truncated='mask')
  assert mask.score(P82, text, truncated=True) == Score(0.0, 'no_answer', mask=True)
  assert mask.score(P82, text) == Score(1.0, 'correct')
  assert not mask.score(P82, text).mask
  none = ArithmeticTask(truncated='none')  # the old behaviour, for ablations
  assert none.score(P82, text, truncated=True) == Score(1.0, 'correct')
  assert none.score(P82, 'x', truncated=True) == Score(0.0, 'no_answer')


def test_text_after_the_boxed_answer_is_ignored_when_finished():
  """The demo model's `86+50=` -> `\\boxed{136}1`: the last complete box is the answer."""
  task = ArithmeticTask()
  p = Problem(id='y', prompt='86+50=', answer='136')
  assert task.score(p, '\\boxed{136}1') == Score(1.0, 'correct')
  assert task.score(p, '\\boxed{136}1', truncated=True) == Score(0.0, 'no_answer')
  assert task.score(p, '\\boxed{136}1}1}') == Score(1.0, 'correct')
  assert task.score(p, '\\boxed{136}\\boxed{1}') == Score(0.0, 'wrong')  # a later box wins


def test_score_many_is_score_per_sample():
  task = ArithmeticTask()
  texts = ['\\boxed{82}', '\\boxed{82}', '\\boxed{81}', '82']
  flags = [False, True, False, True]
  got = task.score_many([P82] * 4, texts, flags, [5, 12, 5, 12])
  assert got == [task.score(P82, t, f) for t, f in zip(texts, flags)]
  assert [s.reward for s in got] == [1.0, 0.0, 0.0, 0.0]
  assert task.score_many([P82] * 4, texts) == [task.score(P82, t) for t in texts]
  with pytest.raises(ValueError, match='score_many: 4 problems, 4 texts, 3 truncated flags'):
    task.score_many([P82] * 4, texts, flags[:3])
