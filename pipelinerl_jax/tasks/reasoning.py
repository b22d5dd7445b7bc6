"""Long-hand arithmetic with every step written out: long, variable-length worked solutions.

A problem is `4728+395=` followed by a newline (or `4728*7=`: a multi-digit number times one
digit, 2..9). The solution works from the last digit to the first, one line per digit; each line
shows the column's computation with its carry, then the state the next line starts from:

  4728+395=                         4728*7=
  8+5+0=13;472+39;1;3               8*7+0=56;472*7;5;6
  2+9+1=12;47+3;1;23                2*7+5=19;47*7;1;96
  7+3+1=11;4+;1;123                 7*7+1=50;4*7;5;096
  4+0+1=5;+;0;5123                  4*7+5=33;*7;3;3096
  \\boxed{5123}                      \\boxed{33096}

A line is `x op y + carry = s ; remaining operands ; new carry ; digits of the result so far`
(an operand that has run out gives 0). Each line depends on the line before it alone: the next
digits are the last ones before the operator and before the ';', so a small model can learn the
procedure by looking back one line. The box holds the final carry (when not 0) and the result
digits. Line count grows with the operands' digits and line width with both, so the length of a
solution grows about quadratically: with operands of 1 to 8 digits a batch holds solutions from
about 20 to about 230 tokens (one token per character with the demo's char tokenizer).

Scoring is the arithmetic task's: the last boxed integer against the answer, truncation by
`truncated` (base.truncated_score); the worked steps themselves are not graded. SFT and RL pools
are split by a hash of the prompt, as in arithmetic.py, so they are disjoint for every seed. SFT
examples may reach more digits than RL problems (`sft_max_digits`): the warm start then has seen
every line shape RL asks for, with room to spare.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Iterator

from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base
from pipelinerl_jax.tasks.base import Problem, Score

OPS = ('+', '*')
ALPHABET = '0123456789+*=;\n\\boxed{}'  # every character a prompt or target can hold


def worked_solution(a: int, op: str, b: int) -> str:
  """The worked solution of `a op b` (without EOS), ending in `\\boxed{a op b}`. Pure."""
  if op not in OPS or a < 0 or b < 0 or (op == '*' and not 2 <= b <= 9):
    raise ValueError(f'worked_solution: {a}{op}{b} (need a, b >= 0; * takes b in 2..9)')
  top, bottom = str(a), str(b)
  carry, result, lines = 0, '', []
  while True:
    x = int(top[-1]) if top else 0
    top = top[:-1]
    if op == '+':
      y = int(bottom[-1]) if bottom else 0
      bottom = bottom[:-1]
      s = x + y + carry
      step = f'{x}+{y}+{carry}={s}'
    else:
      s = x * b + carry
      step = f'{x}*{b}+{carry}={s}'
    carry, result = s // 10, str(s % 10) + result
    lines.append(f'{step};{top}{op}{bottom};{carry};{result}')
    if not top and (op == '*' or not bottom):  # '*' keeps its one-digit multiplier
      break
  answer = (str(carry) if carry else '') + result
  return '\n'.join(lines) + f'\n\\boxed{{{answer}}}'


@dataclasses.dataclass(frozen=True)
class ReasoningTask(base.Task):
  """Operands of min_digits..max_digits digits (each drawn uniformly, a and b independently;
  a leading digit is never 0); '*' multiplies by one digit, 2..9. Each problem picks its op
  uniformly from `ops`. The values are checked where the knobs live (config.TaskConfig)."""
  ops: tuple[str, ...] = ('+',)
  min_digits: int = 1
  max_digits: int = 8
  sft_max_digits: int = 0      # the most digits of an SFT example's operands (0 = max_digits)
  sft_pool_mod: int = 8        # 1 / sft_pool_mod of the problem space is reserved for SFT
  truncated: str = 'penalize'  # completions cut at the length limit: penalize | mask | none
  truncated_reward: float = 0.0  # their reward under 'penalize'

  def __post_init__(self):
    object.__setattr__(self, 'ops', tuple(self.ops))

  # --- the Task protocol ---------------------------------------------------------------------

  def problems(self, seed: int) -> Iterator[Problem]:
    """Fresh RL-pool problems, i.i.d."""
    return self._stream(seed, sft=False, prefix=f'rl{seed}', max_digits=self.max_digits)

  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """Never raises. num_tokens is not used (the reward does not depend on length)."""
    return arithmetic.score_answer(problem, completion_text, truncated, self.truncated,
                                   self.truncated_reward)

  # --- supervised warm start -----------------------------------------------------------------

  def sft_problems(self, seed: int, num: int) -> list[Problem]:
    """`num` distinct SFT-pool problems, a function of (seed, num)."""
    max_digits = self.sft_max_digits or self.max_digits
    return arithmetic.distinct_problems(
        self._stream(seed, sft=True, prefix=f'sft{seed}', max_digits=max_digits), num,
        self.space_size(max_digits) // self.sft_pool_mod)

  def target(self, problem: Problem) -> str:
    """The completion SFT imitates: the worked solution (the tokenizer's EOS goes after it)."""
    return worked_solution(*_parse(problem.prompt))

  def max_target_chars(self, max_digits: int | None = None) -> int:
    """The longest target of any RL problem of this task (or of operands up to `max_digits`
    digits; size max_new_tokens from it: one more for EOS). All-nines operands carry at every
    digit, which makes every line its longest."""
    nines = 10 ** (max_digits or self.max_digits) - 1
    return max(len(worked_solution(nines, op, nines if op == '+' else 9)) for op in self.ops)

  # --- internals -----------------------------------------------------------------------------

  def space_size(self, max_digits: int | None = None) -> int:
    count = lambda lo, hi: 10 ** hi - (10 ** (lo - 1) if lo > 1 else 0)
    full = count(self.min_digits, max_digits or self.max_digits)
    return sum(full * (full if op == '+' else 8) for op in self.ops)

  def _operand(self, rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(self.min_digits, max_digits)
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)

  def _stream(self, seed: int, sft: bool, prefix: str, max_digits: int) -> Iterator[Problem]:
    # A string seed keeps the SFT and RL streams of the same integer seed unrelated.
    rng = random.Random(f'reasoning/{prefix}')
    index = 0
    while True:
      op = rng.choice(self.ops)
      a = self._operand(rng, max_digits)
      b = self._operand(rng, max_digits) if op == '+' else rng.randint(2, 9)
      prompt = f'{a}{op}{b}=\n'
      if arithmetic.in_sft_pool(prompt, self.sft_pool_mod) != sft:
        continue
      yield Problem(id=f'{prefix}-{index}', prompt=prompt, answer=str(a + b if op == '+' else a * b))
      index += 1


def _parse(prompt: str) -> tuple[int, str, int]:
  body = prompt.rstrip('\n').removesuffix('=')
  for op in OPS:
    a, sep, b = body.partition(op)
    if sep:
      return int(a), op, int(b)
  raise ValueError(f'not a reasoning-task prompt: {prompt!r}')
