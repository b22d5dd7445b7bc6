"""The calculator task: the tool's parser, every hostile call, the episode rules, the config."""

import itertools
import time

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import char_tokenizer
from pipelinerl_jax.tasks import calculator
from pipelinerl_jax.tasks import registry
from pipelinerl_jax.tasks.base import EnvStep, Problem, Score
from pipelinerl_jax.tasks.calculator import CalculatorTask, ToolError, calculate, run_call

P = Problem(id='x', prompt='37*48=', answer='1776')


@pytest.mark.parametrize('expr, want', [
    ('37*48', 1776), (' 37 * 48 ', 1776), ('1+2*3', 7), ('2*3+1', 7), ('10-2-3', 5),
    ('8/2/2', 2), ('2*6/3', 4), ('-5+2', -3), ('3--4', 7), ('3*-4', -12), ('-12/4', -3),
    ('0', 0), ('007', 7), ('1+2*3-8/4*5', -3), ('999999999999*999999999999', 999999999998000000000001),
])
def test_calculate(expr, want):
  assert calculate(expr) == want


@pytest.mark.parametrize('expr, message', [
    ('', 'empty expression'), ('   ', 'empty expression'),
    ('1/0', 'division by zero'), ('5*3/0', 'division by zero'), ('7/2', 'inexact division'),
    ('1234567890123*2', 'operand over 12 digits'),
    ('999999999999*999999999999*99', 'result over 24 digits'),
    ('1' * 41, 'over 40 characters'),
    ('2**3', 'expected a number'), ('1+', 'expected a number'), ('*2', 'expected a number'),
    ('--1', 'expected a number'), ('1 2', 'expected an operator'),
    ('(1+2)', 'bad character'), ('1+x', 'bad character'), ('__import__', 'bad character'),
    ('1.5*2', 'bad character'), ('\u0663*2', 'bad character'),  # an Arabic-Indic digit
])
def test_calculate_refuses(expr, message):
  with pytest.raises(ToolError, match=message.replace('*', r'\*')):
    calculate(expr)


@pytest.mark.parametrize('turn, observation', [
    ('<calc>37*48</calc>', '<res>1776</res>'),
    ('let me see <calc>37*48</calc> ok', '<res>1776</res>'),
    ('<calc>1/0</calc>', '<res>error: division by zero</res>'),
    ('<calc>37*48', '<res>error: unterminated <calc></res>'),
    ('37*48</calc>', '<res>error: </calc> without <calc></res>'),
    ('<calc><calc>1</calc></calc>', '<res>error: nested <calc></res>'),
    ('<calc>1</calc><calc>2</calc>', '<res>error: one call per turn</res>'),
    ('<calc></calc>', '<res>error: empty expression</res>'),
    ('<calc>' + '9' * 30 + '</calc>', '<res>error: operand over 12 digits</res>'),
])
def test_run_call(turn, observation):
  assert run_call(turn) == (True, observation)


def test_a_turn_without_tags_is_no_call():
  assert run_call('\\boxed{1776}') == (False, '')
  assert run_call('<res>1776</res>') == (False, '')


def _episode(task, turns, problem=P):
  """Runs model turns through one environment; returns its steps."""
  env = task.environment()
  assert env.reset(problem) == problem.prompt
  steps = []
  for i, turn in enumerate(turns):
    steps.append(env.step(turn, truncated=False, last=i == task.max_turns - 1))
    if steps[-1].done:
      break
  return steps


def test_call_then_answer_pays_only_at_the_end():
  steps = _episode(CalculatorTask(), ['<calc>37*48</calc>', '\\boxed{1776}'])
  assert steps == [
      EnvStep(observation='<res>1776</res>', reward=0.0, done=False, tool_call=True),
      EnvStep(observation=None, reward=1.0, done=True, score=Score(1.0, 'correct'))]
  assert sum(s.reward for s in steps) == 1.0  # the episode return


@pytest.mark.parametrize('turns, status, tool_calls, tool_errors', [
    (['\\boxed{1776}'], 'correct', 0, 0),                            # answered directly
    (['\\boxed{1700}'], 'wrong', 0, 0),
    (['\\boxed{17x}'], 'unparsable', 0, 0),
    (['1776'], 'no_answer', 0, 0),                                  # neither box nor call
    (['<calc>37*48</calc>\\boxed{1}'], 'wrong', 0, 0),              # the box ends it, not run
    (['<calc>1/0</calc>', '\\boxed{1776}'], 'correct', 1, 1),
    (['<calc>37*48</calc>'] * 5, 'no_answer', 3, 0),                # endless calls: turn limit
    (['<calc>1/0'] * 5, 'no_answer', 3, 3),
])
def test_episode_rules(turns, status, tool_calls, tool_errors):
  task = CalculatorTask(max_turns=3)
  steps = _episode(task, turns)
  assert steps[-1].done and steps[-1].observation is None
  assert all(not s.done and s.observation for s in steps[:-1])
  assert steps[-1].score.status == status
  assert steps[-1].reward == (1.0 if status == 'correct' else 0.0)
  assert sum(s.reward for s in steps[:-1]) == 0.0
  assert sum(s.tool_call for s in steps) == tool_calls
  assert sum(s.tool_error for s in steps) == tool_errors
  assert len(steps) <= task.max_turns


def test_a_cut_off_turn_ends_the_episode_by_the_truncated_rule():
  for mode, want in [('penalize', Score(-0.5, 'no_answer')),
                     ('mask', Score(0.0, 'no_answer', mask=True)),
                     ('none', Score(1.0, 'correct'))]:
    env = CalculatorTask(truncated=mode, truncated_reward=-0.5).environment()
    env.reset(P)
    step = env.step('\\boxed{1776}', truncated=True, last=False)
    assert step.done and step.score == want and step.reward == want.reward
  env = CalculatorTask(truncated='penalize').environment()
  env.reset(P)
  assert env.step('<calc>37*48</calc>', truncated=True, last=False).done


@pytest.mark.parametrize('turn', [
    '<calc>' * 50_000,
    '</calc>' * 50_000,
    '<calc>' + '9' * 300_000 + '</calc>',
    '<calc>' + '1+' * 100_000 + '1</calc>',
    '<calc>1</calc>' * 30_000,
    '<calc>' + '(' * 300_000 + '</calc>',
    '\\boxed{' * 40_000 + '<calc>1</calc>',
    'x' * 300_000 + '<calc>1</calc>',
])
def test_hostile_turns_are_fast_and_answered(turn):
  env = CalculatorTask().environment()
  env.reset(P)
  start = time.perf_counter()
  step = env.step(turn, truncated=False, last=False)
  assert time.perf_counter() - start < 0.5  # linear scans of ~300k characters
  assert step.tool_call
  if step.tool_error:
    assert step.observation.startswith('<res>error: ') and len(step.observation) < 60
  else:
    assert step.observation == '<res>1</res>'


def test_problems_and_sft_pool():
  task = CalculatorTask(ops=('*', '+'), digits=2)
  problems = list(itertools.islice(task.problems(0), 2000))
  for p in problems[:200]:
    a, op, b = p.prompt[:2], p.prompt[2], p.prompt[3:5]
    assert p.prompt.endswith('=') and len(p.prompt) == 6
    assert int(p.answer) == (int(a) * int(b) if op == '*' else int(a) + int(b))
  assert {p.prompt[2] for p in problems} == {'*', '+'}
  assert list(itertools.islice(task.problems(0), 50)) == problems[:50]
  sft = task.sft_problems(0, 300)
  assert len({p.prompt for p in sft}) == 300
  rl = {p.prompt for s in (0, 1) for p in itertools.islice(task.problems(s), 3000)}
  assert not rl & {p.prompt for p in sft}


def test_sft_targets_call_for_a_share_and_copy_the_tools_answer():
  task = CalculatorTask(sft_tool_share=0.3)
  sft = task.sft_problems(0, 400)
  turns = [task.target_turns(p) for p in sft]
  calling = [t for t in turns if len(t) == 3]
  assert 0.2 < len(calling) / len(sft) < 0.4
  for p, t in zip(sft, turns):
    if len(t) == 1:
      assert t == (f'\\boxed{{{p.answer}}}',)
    else:
      assert t == (f'<calc>{p.prompt[:-1]}</calc>', f'<res>{p.answer}</res>',
                   f'\\boxed{{{p.answer}}}')
      # Replayed through the environment, the example is a correct episode.
      steps = _episode(task, [t[0], t[2]], p)
      assert steps[0].observation == t[1] and steps[-1].score.status == 'correct'
  assert all(len(CalculatorTask(sft_tool_share=1.0).target_turns(p)) == 3 for p in sft[:20])
  assert all(len(CalculatorTask(sft_tool_share=0.0).target_turns(p)) == 1 for p in sft[:20])


def test_the_char_tokenizer_covers_every_character_the_task_writes():
  task = CalculatorTask(ops=('*', '+', '-'), digits=3)
  texts = [p.prompt for p in itertools.islice(task.problems(0), 200)]
  texts += [t for p in task.sft_problems(0, 200) for t in task.target_turns(p)]
  errors = ['1/0', '7/2', '', '1' * 41, '9' * 13, '1 2', '+', 'x',
            '999999999999*999999999999*99']
  texts += [run_call(f'<calc>{e}</calc>')[1] for e in errors]
  texts += [run_call(t)[1] for t in ['<calc>', '</calc>', '<calc><calc></calc>', '<calc>1</calc>' * 2]]
  alphabet = set(char_tokenizer.DEFAULT_ALPHABET)
  assert not set(''.join(texts)) - alphabet


def test_config_makes_and_checks_the_task():
  config = config_lib.validate(dict(task=dict(name='calculator', ops=('*',), digits=2,
                                              max_turns=4, max_episode_tokens=48,
                                              sft_tool_share=0.25),
                                    generation=dict(max_new_tokens=48)))
  task = registry.make_task(config.task)
  assert task == CalculatorTask(ops=('*',), digits=2, max_turns=4, max_episode_tokens=48,
                                sft_tool_share=0.25)
  assert task.max_turns == 4 and task.max_episode_tokens == 48
  assert isinstance(task.environment(), calculator.CalculatorEnv)
  for bad, key in [(dict(max_turns=0), 'max_turns'), (dict(max_turns=33), 'max_turns'),
                   (dict(max_episode_tokens=0), 'max_episode_tokens'),
                   (dict(sft_tool_share=1.5), 'sft_tool_share'), (dict(ops=('/',)), 'ops')]:
    with pytest.raises(ValueError, match=f'config.task.{key}: '):
      config_lib.validate(dict(task=dict(name='calculator', **bad),
                               generation=dict(max_new_tokens=300), train=dict(seq_len=512)))
  with pytest.raises(ValueError, match='generation.max_new_tokens: 16 < task.max_episode_tok'):
    config_lib.validate(dict(task=dict(name='calculator', max_episode_tokens=96)))
