"""Arithmetic with a calculator tool: the multi-turn task the demo model learns to use.

A problem is `37*48=` (operands of `digits` digits each, the op drawn from `ops`), a product the
demo model cannot work out in its head. An episode alternates model turns (each ends with the
tokenizer's EOS) and the environment's observations:

  37*48=  <calc>37*48</calc>  <res>1776</res>  \\boxed{1776}
  prompt  model turn 1        observation      model turn 2

Per model turn, in this order (`CalculatorEnv.step`):
  1. cut at its token limit: the episode ends, judged by `truncated` as a one-turn completion is
     (base.truncated_score; under 'none' the turn is read as if it had finished);
  2. a complete `\\boxed{...}` anywhere in the turn: the episode ends and the last box is judged
     by arithmetic.score_integer's rules (a call beside the box is not run: its answer would come
     too late to be used);
  3. a `<calc>` or `</calc>` tag: a tool call. The environment answers `<res>value</res>`, or
     `<res>error: what</res>` for a call it will not run (malformed, nested or unterminated
     tags, more than one call in the turn, bad expressions, operands or results over the caps,
     division by zero or with a remainder). When no further turn is allowed (`last`: the turn
     limit or the episode's token budget) the episode ends instead, without an answer;
  4. anything else: the episode ends without an answer (reward 0, status no_answer).

Reward rule: every tool step pays 0; the last step pays the judged answer's reward (1 correct,
else 0), so the episode return is 1 exactly when the final box is right. Why no step reward: a
bonus per call is farmed by calling until the turn limit, and a cost per call teaches the policy
to avoid the tool the task is about; the tool's worth shows up in the final reward alone.

The calculator is not eval(): a parser of integers and + - * / (the usual precedence, a unary
minus on an operand, no parentheses), with caps on the expression's length, each operand's
digits and every intermediate result's digits. `/` divides exactly or answers an error. A call
therefore costs a bounded amount of work, and reading a turn costs time linear in its length
(a few `str.find` scans and base.extract_boxed).

SFT and RL pools are split by a hash of the prompt (arithmetic.in_sft_pool). The warm start
imitates `target_turns`: a call and a copy of its result for a `sft_tool_share` of the SFT
problems (chosen by another hash of the prompt), a direct boxed answer for the rest, so the
warm-started policy calls the tool on only part of the problems and RL has the share to raise.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Iterator

from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base
from pipelinerl_jax.tasks.base import EnvStep, Problem, Score

CALL_OPEN, CALL_CLOSE = '<calc>', '</calc>'
RESULT_OPEN, RESULT_CLOSE = '<res>', '</res>'
MAX_EXPRESSION_CHARS = 40   # between the tags, spaces included
MAX_OPERAND_DIGITS = 12
MAX_RESULT_DIGITS = 24      # every intermediate result too
_EXPR_TOKEN = re.compile(r'[ \t]*(?:([0-9]+)|([-+*/]))')  # ASCII digits only


class ToolError(ValueError):
  """A call the calculator will not run; the message (short, ASCII) goes into the observation."""


def calculate(expression: str) -> int:
  """The integer value of `expression` (integers, + - * /, a unary minus on an operand); raises
  ToolError. Bounded work: the length is checked before anything else is read."""
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ToolError(f'over {MAX_EXPRESSION_CHARS} characters')
  tokens, pos = [], 0
  while pos < len(expression):
    m = _EXPR_TOKEN.match(expression, pos)
    if m is None:
      if not expression[pos:].strip(' \t'):
        break
      raise ToolError('bad character')
    tokens.append(m.group(1) or m.group(2))
    pos = m.end()
  if not tokens:
    raise ToolError('empty expression')

  def capped(x: int) -> int:
    if abs(x) >= 10 ** MAX_RESULT_DIGITS:
      raise ToolError(f'result over {MAX_RESULT_DIGITS} digits')
    return x

  def operand(i: int) -> tuple[int, int]:  # (value, index after it)
    sign = 1
    if i < len(tokens) and tokens[i] == '-':
      sign, i = -1, i + 1
    if i >= len(tokens) or not tokens[i].isdigit():
      raise ToolError('expected a number')
    if len(tokens[i]) > MAX_OPERAND_DIGITS:
      raise ToolError(f'operand over {MAX_OPERAND_DIGITS} digits')
    return sign * int(tokens[i]), i + 1

  # Sums of terms, each term a product or exact quotient of operands, left to right.
  total, sign = 0, 1
  term, i = operand(0)
  while i < len(tokens):
    op = tokens[i]
    if op.isdigit():
      raise ToolError('expected an operator')
    rhs, i = operand(i + 1)
    if op == '*':
      term = capped(term * rhs)
    elif op == '/':
      if rhs == 0:
        raise ToolError('division by zero')
      if term % rhs:
        raise ToolError('inexact division')
      term = term // rhs
    else:
      total = capped(total + sign * term)
      sign, term = (1 if op == '+' else -1), rhs
  return capped(total + sign * term)


def run_call(turn_text: str) -> tuple[bool, str]:
  """(whether the turn calls the tool, the observation to answer it with) for a turn holding a
  `<calc>` or `</calc>` tag; (False, '') for one holding neither. Never raises."""
  start = turn_text.find(CALL_OPEN)
  if start < 0:
    if turn_text.find(CALL_CLOSE) < 0:
      return False, ''
    return True, _result(f'error: {CALL_CLOSE} without {CALL_OPEN}')
  start += len(CALL_OPEN)
  end = turn_text.find(CALL_CLOSE, start)
  if end < 0:
    return True, _result(f'error: unterminated {CALL_OPEN}')
  inner = turn_text[start:end]
  if CALL_OPEN in inner:
    return True, _result(f'error: nested {CALL_OPEN}')
  if turn_text.find(CALL_OPEN, end) >= 0:
    return True, _result('error: one call per turn')
  try:
    return True, _result(str(calculate(inner)))
  except ToolError as e:
    return True, _result(f'error: {e}')
  except Exception:  # pylint: disable=broad-except  # a tool failure must never take the actor down
    return True, _result('error: bad expression')


def _result(text: str) -> str:
  return f'{RESULT_OPEN}{text}{RESULT_CLOSE}'


def is_error(observation: str) -> bool:
  return observation.startswith(f'{RESULT_OPEN}error:')


class CalculatorEnv(base.Environment):
  """One episode (the module docstring has the rules)."""

  def __init__(self, task: CalculatorTask):
    self._task = task
    self._problem: Problem | None = None

  def reset(self, problem: Problem) -> str:
    self._problem = problem
    return problem.prompt

  def step(self, turn_text: str, *, truncated: bool, last: bool) -> EnvStep:
    if self._problem is None:
      raise RuntimeError('CalculatorEnv.step before reset')  # the caller's bug, not the policy's
    task = self._task
    if truncated:
      cut = base.truncated_score(task.truncated, task.truncated_reward)
      if cut is not None:
        return _final(cut)
    if base.extract_boxed(turn_text) is not None:
      return _final(arithmetic.score_integer(self._problem, turn_text))
    called, observation = run_call(turn_text)
    if not called:
      return _final(Score(0.0, 'no_answer'))
    error = is_error(observation)
    if last:
      return _final(Score(0.0, 'no_answer'), tool_call=True, tool_error=error)
    return EnvStep(observation=observation, reward=0.0, done=False, tool_call=True,
                   tool_error=error)


def _final(score: Score, **flags) -> EnvStep:
  return EnvStep(observation=None, reward=score.reward, done=True, score=score, **flags)


@dataclasses.dataclass(frozen=True)
class CalculatorTask(base.Task):
  """`a op b` with both operands of `digits` digits (a leading digit is never 0), the op drawn
  uniformly from `ops`. The values are checked where the knobs live (config.TaskConfig)."""
  ops: tuple[str, ...] = ('*',)
  digits: int = 2
  sft_pool_mod: int = 8        # 1 / sft_pool_mod of the problem space is reserved for SFT
  sft_tool_share: float = 0.5  # SFT examples that call the tool (the rest answer directly)
  max_turns: int = 3           # model turns per episode (overrides Task.max_turns)
  max_episode_tokens: int = 64  # tokens after the prompt per episode (Task.max_episode_tokens)
  truncated: str = 'penalize'  # turns cut at their token limit: penalize | mask | none
  truncated_reward: float = 0.0  # their reward under 'penalize'

  def __post_init__(self):
    object.__setattr__(self, 'ops', tuple(self.ops))

  # --- the Task protocol ---------------------------------------------------------------------

  def problems(self, seed: int) -> Iterator[Problem]:
    """Fresh RL-pool problems, i.i.d."""
    return self._stream(sft=False, prefix=f'rl{seed}')

  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """A one-turn reading of a completion (no tool): the last boxed integer. Never raises."""
    return arithmetic.score_answer(problem, completion_text, truncated, self.truncated,
                                   self.truncated_reward)

  def environment(self) -> CalculatorEnv:
    return CalculatorEnv(self)

  # --- supervised warm start -----------------------------------------------------------------

  def sft_problems(self, seed: int, num: int) -> list[Problem]:
    """`num` distinct SFT-pool problems, a function of (seed, num)."""
    return arithmetic.distinct_problems(self._stream(sft=True, prefix=f'sft{seed}'), num,
                                        self.space_size() // self.sft_pool_mod)

  def target(self, problem: Problem) -> str:
    """The direct answer (no tool)."""
    return f'\\boxed{{{problem.answer}}}'

  def target_turns(self, problem: Problem) -> tuple[str, ...]:
    """The call, the environment's own answer to it, and the result copied into the box; or the
    direct answer, for problems outside the `sft_tool_share` (a hash of the prompt picks them)."""
    if not self.calls_in_sft(problem):
      return (self.target(problem),)
    call = f'{CALL_OPEN}{problem.prompt.removesuffix("=")}{CALL_CLOSE}'
    env = self.environment()
    env.reset(problem)
    observation = env.step(call, truncated=False, last=False).observation
    return (call, observation, self.target(problem))

  def calls_in_sft(self, problem: Problem) -> bool:
    """Whether the SFT example of `problem` calls the tool: a property of the prompt alone."""
    # crc32 of a salted prompt: unrelated to the pool split (arithmetic.in_sft_pool).
    return zlib.crc32(f'tool/{problem.prompt}'.encode()) < self.sft_tool_share * 2 ** 32

  # --- internals -----------------------------------------------------------------------------

  def space_size(self) -> int:
    return len(self.ops) * len(self._operands()) ** 2

  def _operands(self) -> range:
    return range(10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits)

  def _stream(self, sft: bool, prefix: str) -> Iterator[Problem]:
    operands = self._operands()
    return arithmetic.problem_stream('calculator', self.ops, lambda op: (operands, operands),
                                     self.sft_pool_mod, sft, prefix)
