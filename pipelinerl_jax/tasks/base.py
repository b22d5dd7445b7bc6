"""The task interface the actor uses: a stream of problems and a pure scorer for completions.

A task hands out `Problem`s (an id, the prompt text the model continues, the reference answer)
and scores the decoded completion text. Scoring runs on the actor's hot path, once per sample,
on text written by a policy that may be degenerate, so it must be fast, must never raise, and
its cost must stay linear in the text length whatever the text holds.

Every task is told, per sample, whether the completion was cut at the length limit (the
engine's finish_reason 'length': no EOS) and how many tokens it has. A cut-off completion never
gave a final answer, whatever its text holds, so it must not be paid as a finished one: a reward
that pays it teaches the policy to never stop. `TRUNCATED_MODES` are the ways a task may treat it:
  'penalize'  reward = truncated_reward (0 by default, as for a missing answer), status no_answer
  'mask'      no learning signal either way (DAPO's overlong filtering): `Score.mask`, reward 0,
              status no_answer; the actor drops it before the group's advantages
  'none'      judged like a finished completion (ablations only: the failure described above)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Literal, Protocol, Sequence

Status = Literal['correct', 'wrong', 'no_answer', 'unparsable']
STATUSES: tuple[Status, ...] = ('correct', 'wrong', 'no_answer', 'unparsable')


@dataclasses.dataclass(frozen=True)
class Problem:
  id: str
  prompt: str
  answer: str


@dataclasses.dataclass(frozen=True)
class Score:
  reward: float
  status: Status
  mask: bool = False  # True: no learning signal (dropped before advantages; status still counted)


class Task(Protocol):

  def problems(self, seed: int) -> Iterator[Problem]:
    """An infinite stream, the same for the same seed."""

  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """Fast; never raises. truncated: the completion ended at the length limit, without EOS.
    num_tokens: its length in tokens (None: unknown)."""

  def score_many(self, problems: Sequence[Problem], texts: Sequence[str],
                 truncated: Sequence[bool] | None = None,
                 num_tokens: Sequence[int | None] | None = None) -> list[Score]:
    """`score` for a batch (a group's G samples); None flags mean 'not truncated' / unknown."""


TRUNCATED_MODES = ('penalize', 'mask', 'none')


def check_truncated_mode(mode: str) -> None:
  if mode not in TRUNCATED_MODES:
    raise ValueError(f'truncated={mode!r} must be one of {TRUNCATED_MODES}')


def truncated_score(mode: str, truncated_reward: float) -> Score | None:
  """The score of a completion cut at the length limit, or None under 'none' (judge it as usual).
  Pure; the rule every task applies before looking at the text."""
  if mode == 'mask':
    return Score(0.0, 'no_answer', mask=True)
  if mode == 'penalize':
    return Score(float(truncated_reward), 'no_answer')
  return None


def batch_flags(n: int, problems: Sequence[Problem], truncated: Sequence[bool] | None,
                num_tokens: Sequence[int | None] | None) -> tuple[list[bool], list[int | None]]:
  """`score_many`'s optional per-sample lists, filled in and checked against n texts."""
  truncated = [False] * n if truncated is None else [bool(t) for t in truncated]
  num_tokens = [None] * n if num_tokens is None else list(num_tokens)
  if not len(problems) == len(truncated) == len(num_tokens) == n:
    raise ValueError(f'score_many: {len(problems)} problems, {n} texts, {len(truncated)} '
                     f'truncated flags, {len(num_tokens)} lengths (must all be equal)')
  return truncated, num_tokens


class PerSampleTask:
  """Base for a task whose samples are scored one at a time: `score_many` calls `score`."""

  def score_many(self, problems: Sequence[Problem], texts: Sequence[str],
                 truncated: Sequence[bool] | None = None,
                 num_tokens: Sequence[int | None] | None = None) -> list[Score]:
    truncated, num_tokens = batch_flags(len(texts), problems, truncated, num_tokens)
    return [self.score(p, t, tr, nt)
            for p, t, tr, nt in zip(problems, texts, truncated, num_tokens)]


_BOX_OPEN = '\\boxed{'
_BOX_TOKENS = re.compile(r'\\boxed\{|[{}]')


def extract_boxed(text: str) -> str | None:
  """Content of the last complete `\\boxed{...}` (the one whose closing brace comes last), braces
  inside it balanced; None when there is none. An unclosed `\\boxed{` is ignored.

  One left-to-right pass over the braces with an explicit stack: linear in len(text), no
  recursion, so deep nesting or a flood of unclosed boxes costs no more than their length.
  """
  if _BOX_OPEN not in text:
    return None
  stack = []  # per open brace: start of the boxed content, or -1 for a plain '{'
  last = None
  for m in _BOX_TOKENS.finditer(text):
    token = m.group()
    if token == '}':
      if not stack:
        continue  # a stray '}' closes nothing
      start = stack.pop()
      if start >= 0:
        last = (start, m.start())
    else:
      stack.append(m.end() if token == _BOX_OPEN else -1)
  return None if last is None else text[last[0]:last[1]]
