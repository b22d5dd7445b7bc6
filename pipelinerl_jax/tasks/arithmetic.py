"""Procedural integer arithmetic: prompt `37+45=`, target completion `\\boxed{82}` (+ EOS).

The problem space is split once, by a hash of the prompt, into an SFT pool (1 / sft_pool_mod of
it) and an RL pool (the rest). The warm start imitates a small fixed set drawn from the SFT pool;
RL then only ever sees problems from the RL pool, so whatever it gains is on unseen problems and
cannot come from memorizing the supervised examples. The split depends on the problem alone,
not on any seed, so the two sets are disjoint for every pair of seeds.

Scoring: the answer is the last complete `\\boxed{...}` (base.extract_boxed); text around it is
ignored, so `\\boxed{136}1<eos>` is a correct finished answer. A completion cut at the length
limit is never judged: `truncated` (config.RewardConfig.truncated, default 'penalize' with reward
0; base.truncated_score) says what it gets. Why trailing text is not an error: the boxed answer is the answer by the same
convention the math task and its verifier use ("the last boxed"), and the harm that trailing
text did -- a policy that never stops -- comes from paying cut-off completions, which the
truncation rule ends; junk followed by EOS costs its author only a few tokens.
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from typing import Callable, Iterator

from pipelinerl_jax.tasks import base
from pipelinerl_jax.tasks.base import Problem, Score, extract_boxed

OPS = {'+': lambda a, b: a + b, '-': lambda a, b: a - b, '*': lambda a, b: a * b}
_INTEGER = re.compile(r'-?\d{1,32}')  # an answer longer than 32 digits is not a number we asked for
ALPHABET = '0123456789+-*=\\boxed{}'  # every character a prompt or target can hold


def score_integer(problem: Problem, completion_text: str) -> Score:
  """The last boxed answer read as an integer, against problem.answer. Never raises."""
  try:
    boxed = extract_boxed(completion_text)
    if boxed is None:
      return Score(0.0, 'no_answer')
    value = boxed.strip()
    if not _INTEGER.fullmatch(value):
      return Score(0.0, 'unparsable')
    return Score(1.0, 'correct') if int(value) == int(problem.answer) else Score(0.0, 'wrong')
  except Exception:  # a scorer failure must never take the actor down
    return Score(0.0, 'unparsable')


def score_answer(problem: Problem, completion_text: str, truncated: bool, truncated_mode: str,
                 truncated_reward: float) -> Score:
  """A completion of a boxed-integer task: the truncation rule (base.truncated_score) for one
  cut at the length limit, else `score_integer`. Never raises."""
  if truncated:
    cut = base.truncated_score(truncated_mode, truncated_reward)
    if cut is not None:
      return cut
  return score_integer(problem, completion_text)


def problem_stream(name: str, ops: tuple[str, ...],
                   operand_ranges: Callable[[str], tuple[range, range]], sft_pool_mod: int,
                   sft: bool, prefix: str) -> Iterator[Problem]:
  """Endless i.i.d. `a op b=` problems of one pool (the SFT pool when `sft`, else the RL pool):
  op uniform over `ops`, a and b uniform over `operand_ranges(op)`; ids `prefix-<index>`."""
  # A string seed keeps the SFT and RL streams of the same integer seed, and the tasks' streams,
  # unrelated.
  rng = random.Random(f'{name}/{prefix}')
  index = 0
  while True:
    op = rng.choice(ops)
    ra, rb = operand_ranges(op)
    a, b = rng.choice(ra), rng.choice(rb)
    prompt = f'{a}{op}{b}='
    if in_sft_pool(prompt, sft_pool_mod) != sft:
      continue
    yield Problem(id=f'{prefix}-{index}', prompt=prompt, answer=str(OPS[op](a, b)))
    index += 1


def in_sft_pool(prompt: str, sft_pool_mod: int) -> bool:
  """Whether a prompt belongs to the SFT pool (else the RL pool): a property of the prompt alone."""
  # crc32, not hash(): Python salts str hashes per process.
  return zlib.crc32(prompt.encode()) % sft_pool_mod == 0


def distinct_problems(stream: Iterator[Problem], num: int, pool_size: int) -> list[Problem]:
  """The first `num` problems of `stream` with distinct prompts; an error naming the pool's size
  (about `pool_size`) when it does not hold that many."""
  out, seen = [], set()
  for _ in range(100 * num + 10_000):  # bounded: the pool may hold fewer than `num`
    if len(out) == num:
      return out
    p = next(stream)
    if p.prompt not in seen:
      seen.add(p.prompt)
      out.append(p)
  if len(out) < num:
    raise ValueError(f'found only {len(out)} distinct SFT-pool problems of the {num} asked '
                     f'for; the pool holds about {pool_size}')
  return out


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(base.Task):
  """`a op b`: a has `digits` digits; b too, except for '*' where it has one digit (so products
  stay short). Each problem picks its op uniformly from `ops`. The values are checked where the
  knobs live (config.TaskConfig, config.RewardConfig)."""
  ops: tuple[str, ...] = ('+',)
  digits: int = 2
  sft_pool_mod: int = 8      # 1 / sft_pool_mod of the problem space is reserved for SFT
  truncated: str = 'penalize'  # completions cut at the length limit: penalize | mask | none
  truncated_reward: float = 0.0  # their reward under 'penalize'

  def __post_init__(self):
    object.__setattr__(self, 'ops', tuple(self.ops))

  # --- the Task protocol ---------------------------------------------------------------------

  def problems(self, seed: int) -> Iterator[Problem]:
    """Fresh RL-pool problems, i.i.d. (repeats happen once the stream outgrows the pool)."""
    return self._stream(seed, sft=False, prefix=f'rl{seed}')

  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """Never raises. num_tokens is not used (the reward does not depend on length)."""
    return score_answer(problem, completion_text, truncated, self.truncated,
                        self.truncated_reward)

  # --- supervised warm start -----------------------------------------------------------------

  def sft_problems(self, seed: int, num: int) -> list[Problem]:
    """`num` distinct SFT-pool problems, a function of (seed, num)."""
    return distinct_problems(self._stream(seed, sft=True, prefix=f'sft{seed}'), num,
                             self.space_size() // self.sft_pool_mod)

  def target(self, problem: Problem) -> str:
    """The completion SFT imitates (the tokenizer's EOS goes after it)."""
    return f'\\boxed{{{problem.answer}}}'

  # --- internals -----------------------------------------------------------------------------

  def space_size(self) -> int:
    return sum(len(ra) * len(rb) for ra, rb in map(self._operand_ranges, self.ops))

  def _operand_ranges(self, op: str) -> tuple[range, range]:
    full = range(10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits)
    return full, (range(1, 10) if op == '*' else full)

  def _stream(self, seed: int, sft: bool, prefix: str) -> Iterator[Problem]:
    return problem_stream('arithmetic', self.ops, self._operand_ranges, self.sft_pool_mod, sft,
                          prefix)
