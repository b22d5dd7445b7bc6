"""The task interface: a stream of problems and a pure scorer for completions.

A task hands out `Problem`s (an id, the prompt text the model continues, the reference answer)
and scores the decoded completion text. Scoring runs on the actor's hot path, once per sample,
on text written by a policy that may be degenerate, so it must be fast, must never raise, and
its cost must stay linear in the text length whatever the text holds.

Every task is told, per sample, whether the completion was cut at the length limit (the
engine's finish_reason 'length': no EOS) and how many tokens it has. A cut-off completion never
gave a final answer, whatever its text holds, so it must not be paid as a finished one: a reward
that pays it teaches the policy to never stop. `config.RewardConfig.truncated` says how a task
treats it (`truncated_score`):
  'penalize'  reward = truncated_reward (0 by default, as for a missing answer), status no_answer
  'mask'      no learning signal either way (DAPO's overlong filtering): `Score.mask`, reward 0,
              status no_answer; the actor drops it before the group's advantages
  'none'      judged like a finished completion (ablations only: the failure described above)
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Iterator, Literal, Sequence

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
  mask: bool = False  # True: leave the sample out of training (no signal; see the actor)


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """An environment's answer to one model turn.

  The episode's reward is the sum of its steps' rewards (the episode return); the last step's
  reward carries the final judgement. `score` (last step only) gives the episode's status for
  the metrics and may mask it like a one-turn `Score`; its reward is not added again."""
  observation: str | None      # fed to the model, never sampled, before its next turn; None = done
  reward: float
  done: bool
  score: Score | None = None
  tool_call: bool = False      # this turn called a tool
  tool_error: bool = False     # ... and the tool answered with an error


class Environment(abc.ABC):
  """One episode of a multi-turn task, made fresh per episode by `Task.environment()`.

  A model turn ends with a stop token (the tokenizer's EOS) or at its token limit. Like `score`,
  `step` reads text a policy wrote: it must never raise, never hang, and its cost must stay
  linear in the text whatever the text holds (a hostile tool call gets an error observation)."""

  @abc.abstractmethod
  def reset(self, problem: Problem) -> str:
    """The first observation: the prompt text the model's first turn continues."""

  @abc.abstractmethod
  def step(self, turn_text: str, *, truncated: bool, last: bool) -> EnvStep:
    """The model's decoded turn. `truncated`: cut at its token limit (no stop token); `last`:
    no further turn is allowed (the task's turn limit or token budget is spent), so the answer
    must be done=True."""


class Task(abc.ABC):
  """What the actor, the evaluation and the demo build use of a task. Subclasses implement
  `problems` and `score`; the rest has defaults."""

  @abc.abstractmethod
  def problems(self, seed: int) -> Iterator[Problem]:
    """An infinite stream, the same for the same seed."""

  @abc.abstractmethod
  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """Pure and fast; never raises. `truncated`: the completion was cut at the length limit
    (no EOS); `num_tokens`: its length (for length-based penalties)."""

  def score_many(self, problems: Sequence[Problem], texts: Sequence[str],
                 truncated: Sequence[bool] | None = None,
                 num_tokens: Sequence[int | None] | None = None) -> list[Score]:
    """`score` for a batch (the actor calls it once per finished group)."""
    n = len(texts)
    truncated = [False] * n if truncated is None else truncated
    num_tokens = [None] * n if num_tokens is None else num_tokens
    if not len(problems) == len(truncated) == len(num_tokens) == n:
      raise ValueError(f'score_many: {len(problems)} problems, {n} texts, {len(truncated)} '
                       f'truncated flags, {len(num_tokens)} lengths (must all be equal)')
    return [self.score(p, t, tr, nt) for p, t, tr, nt in zip(problems, texts, truncated,
                                                             num_tokens)]

  def held_out(self, num_problems: int, seed: int) -> dict[str, list[Problem]]:
    """{dataset name: problems} to evaluate on, prompts formatted like training prompts; the
    first `num_problems` of each set (0 = all of it, for finite sets)."""
    if num_problems < 1:
      raise ValueError(f'{type(self).__name__}: an endless problem stream needs a number of '
                       'held-out problems >= 1')
    stream, seen, out = self.problems(seed), set(), []
    while len(out) < num_problems:
      p = next(stream)
      if p.prompt not in seen:
        seen.add(p.prompt)
        out.append(p)
    return {self.name: out}

  @property
  def name(self) -> str:
    """The task's name in metrics and evaluation output."""
    return type(self).__name__.removesuffix('Task').lower()

  @property
  def counters(self) -> dict[str, int]:
    """Totals since construction, logged every step as task/<name> (e.g. verifier timeouts)."""
    return {}

  def close(self) -> None:
    """Releases what the task holds (worker processes); scoring again may restart them."""

  # Majority voting (evaluation.py's maj@k) groups samples by their final answers.

  def answer_of(self, completion_text: str) -> str | None:
    """A completion's final answer, None when it gives none (or the task cannot tell): the
    content of its last `\\boxed{}`, as every built-in task reads it."""
    boxed = extract_boxed(completion_text) if isinstance(completion_text, str) else None
    return None if boxed is None else boxed.strip()

  def same_answers(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
    """Whether each pair of answers is equivalent (here: equal text)."""
    return [a == b for a, b in pairs]

  # Multi-turn tasks. A task without an environment is one turn: the actor scores each group's
  # completions with `score_many`.

  def environment(self) -> Environment | None:
    """A fresh environment for one episode, or None for a one-turn task."""
    return None

  @property
  def max_turns(self) -> int:
    """The most model turns of an episode."""
    return 1

  @property
  def max_episode_tokens(self) -> int:
    """The most tokens after the prompt in one episode (model turns and observations); 0 = only
    each turn's own limit (`sampling.max_tokens`)."""
    return 0

  # The supervised warm start of the demo model (demo/warmstart.py) needs these two.

  def sft_problems(self, seed: int, num: int) -> list[Problem]:
    """`num` distinct problems reserved for SFT, disjoint from `problems()`."""
    raise NotImplementedError(f'{type(self).__name__} has no SFT pool for a warm start')

  def target(self, problem: Problem) -> str:
    """The completion SFT imitates (the tokenizer's EOS goes after it)."""
    raise NotImplementedError(f'{type(self).__name__} has no SFT targets for a warm start')

  def target_turns(self, problem: Problem) -> tuple[str, ...]:
    """The episode SFT imitates: model turns at even indices, the environment's observations
    between them (fed, not imitated); the tokenizer's EOS goes after each model turn. One turn,
    `target(problem)`, unless a multi-turn task says otherwise."""
    return (self.target(problem),)


def truncated_score(mode: str, truncated_reward: float) -> Score | None:
  """The score of a completion cut at the length limit, or None under 'none' (judge it as usual).
  Pure; the rule a task applies before looking at the text."""
  if mode == 'mask':
    return Score(0.0, 'no_answer', mask=True)
  if mode == 'penalize':
    return Score(float(truncated_reward), 'no_answer')
  return None


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
