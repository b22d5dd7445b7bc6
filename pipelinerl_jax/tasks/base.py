"""The task interface the actor uses: a stream of problems and a pure scorer for completions.

A task hands out `Problem`s (an id, the prompt text the model continues, the reference answer)
and scores the decoded completion text. Scoring runs on the actor's hot path, once per sample,
on text written by a policy that may be degenerate, so it must be fast, must never raise, and
its cost must stay linear in the text length whatever the text holds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Literal, Protocol

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


class Task(Protocol):

  def problems(self, seed: int) -> Iterator[Problem]:
    """An infinite stream, the same for the same seed."""

  def score(self, problem: Problem, completion_text: str) -> Score:
    """Pure and fast; never raises."""


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
