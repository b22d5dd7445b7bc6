"""The reasoning task: worked solutions (checked line by line), determinism, length spread,
disjoint SFT / RL pools, scoring with truncation, and the char tokenizer's coverage."""

import itertools
import random
import re

import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import char_tokenizer
from pipelinerl_jax.tasks import Problem, Score, extract_boxed
from pipelinerl_jax.tasks import reasoning
from pipelinerl_jax.tasks import registry
from pipelinerl_jax.tasks.reasoning import ReasoningTask, worked_solution

_LINE = re.compile(r'(\d)([+*])(\d)\+(\d)=(\d+);(\d*)([+*])(\d*);(\d);(\d+)')


def check_solution(a, op, b, text):
  """Replays a worked solution against the long-hand procedure, independently of the generator:
  each line must take the last digits of the previous state, add the carry, and pass on the rest."""
  *lines, box = text.split('\n')
  top, bottom, carry, result = str(a), str(b), 0, ''
  for line in lines:
    x, line_op, y, c, s, new_top, state_op, new_bottom, new_carry, new_result = (
        _LINE.fullmatch(line).groups())
    assert line_op == state_op == op and int(c) == carry
    assert int(x) == (int(top[-1]) if top else 0) and new_top == top[:-1]
    if op == '+':
      assert int(y) == (int(bottom[-1]) if bottom else 0) and new_bottom == bottom[:-1]
      assert int(s) == int(x) + int(y) + carry
    else:
      assert int(y) == b and new_bottom == bottom
      assert int(s) == int(x) * b + carry
    top, bottom, carry = new_top, new_bottom, int(s) // 10
    assert int(new_carry) == carry and new_result == s[-1] + result
    result = new_result
  assert not top and (op == '*' or not bottom)
  assert box == f'\\boxed{{{a + b if op == "+" else a * b}}}'


def test_worked_solution_examples():
  assert worked_solution(4728, '+', 395) == (
      '8+5+0=13;472+39;1;3\n2+9+1=12;47+3;1;23\n7+3+1=11;4+;1;123\n4+0+1=5;+;0;5123\n'
      '\\boxed{5123}')
  assert worked_solution(4728, '*', 7) == (
      '8*7+0=56;472*7;5;6\n2*7+5=19;47*7;1;96\n7*7+1=50;4*7;5;096\n4*7+5=33;*7;3;3096\n'
      '\\boxed{33096}')
  assert worked_solution(99, '+', 1).endswith('9+0+1=10;+;1;00\n\\boxed{100}')


def test_worked_solutions_follow_the_procedure():
  rng = random.Random(0)
  cases = [(0, '+', 0), (5, '+', 0), (9, '*', 9), (10 ** 8 - 1, '+', 10 ** 8 - 1), (1, '+', 999)]
  cases += [(rng.randrange(10 ** rng.randint(1, 9)), '+', rng.randrange(10 ** rng.randint(1, 9)))
            for _ in range(300)]
  cases += [(rng.randrange(10 ** rng.randint(1, 9)), '*', rng.randint(2, 9)) for _ in range(300)]
  for a, op, b in cases:
    check_solution(a, op, b, worked_solution(a, op, b))


def test_worked_solution_rejects_what_it_cannot_write():
  for args in [(3, '-', 2), (-3, '+', 2), (12, '*', 1), (12, '*', 10)]:
    with pytest.raises(ValueError, match='worked_solution'):
      worked_solution(*args)


def test_problems_are_deterministic_in_range_and_solved():
  task = ReasoningTask(ops=('+', '*'), min_digits=2, max_digits=5)
  first = list(itertools.islice(task.problems(7), 500))
  assert first == list(itertools.islice(ReasoningTask(ops=('+', '*'), min_digits=2,
                                                      max_digits=5).problems(7), 500))
  assert [p.prompt for p in first] != [p.prompt for p in itertools.islice(task.problems(8), 500)]
  assert len({p.id for p in first}) == 500
  seen_ops, seen_digits = set(), set()
  for p in first:
    a, op, b = re.fullmatch(r'(\d+)([+*])(\d+)=\n', p.prompt).groups()
    seen_ops.add(op)
    seen_digits.add(len(a))
    assert a[0] != '0' and 2 <= len(a) <= 5
    assert (2 <= len(b) <= 5 and b[0] != '0') if op == '+' else 2 <= int(b) <= 9
    check_solution(int(a), op, int(b), task.target(p))
    assert extract_boxed(task.target(p)) == p.answer
  assert seen_ops == {'+', '*'} and seen_digits == {2, 3, 4, 5}


def test_solution_lengths_spread_within_one_batch():
  task = ReasoningTask()  # operands of 1..8 digits
  for seed in (0, 1):
    lengths = np.array([len(task.target(p)) for p in itertools.islice(task.problems(seed), 128)])
    assert lengths.min() <= 40 and lengths.max() >= 180  # ~20 to a few hundred tokens
    assert lengths.std() >= 40
    assert lengths.max() <= task.max_target_chars()
  nines = 10 ** 8 - 1
  assert task.max_target_chars() == len(worked_solution(nines, '+', nines))
  assert ReasoningTask(max_digits=3).max_target_chars() < 80 < task.max_target_chars()
  # More digits, longer solutions: the mean length grows with max_digits.
  means = [np.mean([len(t.target(p)) for p in itertools.islice(t.problems(0), 200)])
           for t in (ReasoningTask(max_digits=d) for d in (2, 4, 8))]
  assert means[0] < means[1] < means[2]


def test_sft_set_is_fixed_distinct_and_disjoint_from_rl():
  task = ReasoningTask(max_digits=3)  # small enough that the pools would collide if not split
  sft = task.sft_problems(0, 2000)
  assert sft == task.sft_problems(0, 2000) and task.sft_problems(0, 100) == sft[:100]
  assert len({p.prompt for p in sft}) == 2000
  assert task.sft_problems(1, 100) != sft[:100]
  sft_prompts = {p.prompt for s in (0, 3) for p in task.sft_problems(s, 2000)}
  rl_prompts = {p.prompt for s in (0, 1, 10_000) for p in itertools.islice(task.problems(s), 20_000)}
  assert len(rl_prompts) > 30_000
  assert not sft_prompts & rl_prompts
  with pytest.raises(ValueError, match='distinct SFT-pool problems'):
    ReasoningTask(max_digits=1).sft_problems(0, 200)  # 100 problems, 1/8 of them for SFT


def test_scoring_worked_solutions():
  task = ReasoningTask()
  p = next(task.problems(0))
  solution = task.target(p)
  assert task.score(p, solution) == Score(1.0, 'correct')
  assert task.score(p, solution + '1') == Score(1.0, 'correct')  # after the box: ignored
  wrong = solution.replace(f'{{{p.answer}}}', f'{{{int(p.answer) + 1}}}')
  assert task.score(p, wrong) == Score(0.0, 'wrong')
  # Only the final answer is graded: a slip in a step with the right box still scores.
  assert task.score(p, '0+0+0=7;;0;7\n' + solution) == Score(1.0, 'correct')
  assert task.score(p, solution[:solution.index('\\boxed')]) == Score(0.0, 'no_answer')
  assert task.score(p, solution.replace('}', '')) == Score(0.0, 'no_answer')
  assert task.score(p, '\\boxed{12;3}') == Score(0.0, 'unparsable')
  assert task.score(p, None) == Score(0.0, 'unparsable')


def test_truncated_worked_solutions():
  p = Problem(id='x', prompt='4728+395=\n', answer='5123')
  solution = worked_solution(4728, '+', 395)
  cut = solution[:30]
  for mode, want in [('penalize', Score(0.0, 'no_answer')),
                     ('mask', Score(0.0, 'no_answer', mask=True))]:
    task = ReasoningTask(truncated=mode)
    assert task.score(p, solution, truncated=True) == want  # a full box, but never stopped
    assert task.score(p, cut, truncated=True) == want
    assert task.score(p, solution) == Score(1.0, 'correct')
  assert ReasoningTask(truncated='penalize', truncated_reward=-1.0).score(
      p, cut, truncated=True) == Score(-1.0, 'no_answer')
  assert ReasoningTask(truncated='none').score(p, solution, truncated=True).reward == 1.0
  task = ReasoningTask()
  got = task.score_many([p] * 3, [solution, solution, cut], [False, True, True], [60, 61, 30])
  assert [s.reward for s in got] == [1.0, 0.0, 0.0]


def test_char_tokenizer_covers_the_alphabet():
  tok = char_tokenizer.build_char_tokenizer()
  unk = tok.token_to_id(char_tokenizer.UNK)
  ids = tok.encode(reasoning.ALPHABET).ids
  assert len(set(ids)) == len(ids) == len(reasoning.ALPHABET) and unk not in ids
  task = ReasoningTask(ops=('+', '*'))
  for p in itertools.islice(task.problems(0), 50):
    text = p.prompt + task.target(p)
    ids = tok.encode(text).ids
    assert unk not in ids and len(ids) == len(text) and tok.decode(ids) == text
    assert set(text) <= set(reasoning.ALPHABET)


def test_sft_examples_may_reach_more_digits_than_rl():
  task = ReasoningTask(max_digits=4, sft_max_digits=7)
  sft_digits = {max(map(len, re.findall(r'\d+', p.prompt))) for p in task.sft_problems(0, 500)}
  rl_digits = {max(map(len, re.findall(r'\d+', p.prompt)))
               for p in itertools.islice(task.problems(0), 500)}
  assert max(sft_digits) == 7 and max(rl_digits) == 4
  assert task.max_target_chars() < task.max_target_chars(7)
  rl_prompts = {p.prompt for p in itertools.islice(task.problems(0), 5000)}
  assert not rl_prompts & {p.prompt for p in task.sft_problems(0, 500)}


def test_config_makes_and_checks_the_task():
  config = config_lib.validate(dict(task=dict(name='reasoning', ops=('+', '*'), digits=6,
                                              min_digits=2, sft_max_digits=8,
                                              reward=dict(truncated='mask'))))
  task = registry.make_task(config.task)
  assert task == ReasoningTask(ops=('+', '*'), min_digits=2, max_digits=6, sft_max_digits=8,
                               truncated='mask')
  for bad, key in [(dict(ops=('-',)), 'ops'), (dict(min_digits=0), 'min_digits'),
                   (dict(min_digits=4, digits=3), 'min_digits'),
                   (dict(sft_max_digits=10), 'sft_max_digits'), (dict(sft_pool_mod=1), 'sft_pool')]:
    with pytest.raises(ValueError, match=key):
      config_lib.validate(dict(task=dict(name='reasoning', **bad)))
