"""Math problems with a reference answer: chat prompts, the completion's final answer judged by
math-verify (or by a scoring function of the user's).

The problems come from tasks/data.py (files as they ship, rendered through the chat template).
Scoring a sample:
  1. truncated (no EOS) and `truncated` is 'mask' or 'penalize' -> not judged, status no_answer
  2. the completion's answer (`answer_format`): the last complete `\\boxed{...}`, or the text
     after the last 'Answer:' ('answer_line', DAPO-Math-17k's prompts); none -> no_answer
  3. pre-checks on the answer, each counted: empty, longer than max_answer_chars, or
     holding control characters / lone surrogates (broken UTF-8) -> unparsable
  4. math-verify in the worker pool (verify.py), hard timeout per sample -> correct | wrong |
     unparsable. A timeout is reported as 'unparsable', not 'wrong': the grader could not read
     the answer in time, which says nothing about whether it was right, and 'wrong' should stay a
     clean accuracy signal. The default rewards are the same (0), and `counters['timeout']`
     tells the two apart.
With `score_fn` (config.task.score_fn) steps 2-4 are the user's function, run in the same worker
pool under the same timeout and memory limit: it gets the whole completion and the reference.
Rewards come from `config.RewardConfig`; it also holds the options for truncated completions and
DAPO's soft overlong penalty.

How a trainer uses `Score.mask` (truncated='mask', DAPO's overlong filtering): a masked
sample carries no learning signal, neither reward nor penalty. Drop it before computing group
advantages (it is not in its group's mean or std) and give its tokens zero loss weight; a group
whose samples are all masked is dropped. Its `status` is still counted in the metrics.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from typing import Iterator, Sequence

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import data as data_lib
from pipelinerl_jax.tasks.base import STATUSES, Problem, Score, Task, extract_boxed
from pipelinerl_jax.tasks.verify import VerifyPool

ANSWER_FORMATS = ('boxed', 'answer_line')
# Pre-check and pool outcomes, counted next to the statuses (a sample can add to several).
EVENTS = ('truncated', 'masked', 'empty_answer', 'too_long', 'bad_chars', 'timeout',
          'gold_unparsable', 'worker_error')
_BAD_CHARS = re.compile('[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]')
_ANSWER_LINE = re.compile(r'answer\s{0,8}:', re.I)


def extract_answer_line(text: str) -> str | None:
  """The text after the last 'Answer:' up to the end of its line, without surrounding '$' or a
  final period (a \\boxed{} inside it: its content); None when there is none. Linear in
  len(text)."""
  last = None
  for last in _ANSWER_LINE.finditer(text):
    pass
  if last is None:
    return None
  answer = text[last.end():].split('\n', 1)[0].strip()
  boxed = extract_boxed(answer)
  if boxed is not None:
    return boxed.strip()
  return answer.rstrip('.').strip().strip('$').strip()


def extract_answer(text: str, answer_format: str = 'boxed') -> str | None:
  """A completion's final answer by `answer_format` (ANSWER_FORMATS), None when it gives none."""
  if not isinstance(text, str):
    return None
  found = extract_boxed(text) if answer_format == 'boxed' else extract_answer_line(text)
  return None if found is None else found.strip()


# --- rewards ---------------------------------------------------------------------------------

def soft_overlong_penalty(length: int, max_len: int, buffer: int) -> float:
  """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linear down to -1 at max_len,
  -1 beyond."""
  threshold = max_len - buffer
  if length <= threshold:
    return 0.0
  if length <= max_len:
    return (threshold - length) / buffer  # buffer > 0 here, since threshold < length <= max_len
  return -1.0


def make_score(status: str, config: config_lib.RewardConfig, truncated: bool = False,
               num_tokens: int | None = None, reward: float | None = None) -> Score:
  """The reward for a judged status (pure): table value (or `reward`, a scoring function's
  own), truncation rule, overlong penalty."""
  if truncated and config.truncated == 'mask':
    return Score(0.0, status, mask=True)
  if truncated and config.truncated == 'penalize':
    reward = config.truncated_reward
  elif reward is None:
    reward = getattr(config, status)
  if config.overlong_max_len and num_tokens is not None:
    reward += soft_overlong_penalty(num_tokens, config.overlong_max_len, config.overlong_buffer)
  return Score(float(reward), status)


# --- datasets --------------------------------------------------------------------------------

def split_problems(records: Sequence[data_lib.Record], test_fraction: float,
                   seed: int = 0) -> tuple[list[data_lib.Record], list[data_lib.Record]]:
  """(train, test), a function of (records, test_fraction, seed); each keeps the input order.

  The split is over distinct prompts, so a problem listed twice never lands on both sides.
  """
  if not 0.0 <= test_fraction <= 1.0:
    raise ValueError(f'test_fraction={test_fraction} must be in [0, 1]')
  prompts = list(dict.fromkeys(r.messages for r in records))
  random.Random(f'math-split/{seed}').shuffle(prompts)
  test_prompts = set(prompts[:round(len(prompts) * test_fraction)])
  train = [r for r in records if r.messages not in test_prompts]
  test = [r for r in records if r.messages in test_prompts]
  return train, test


def mixed_stream(datasets: Sequence[tuple[Sequence[data_lib.Record], float]], seed: int,
                 render=None) -> Iterator[Problem]:
  """An infinite stream over [(records, weight), ...], a function of (datasets, seed).

  Each draw picks a dataset with probability proportional to its weight, then takes that
  dataset's next problem in a shuffled order that is redrawn every epoch (so no problem repeats
  before all of its dataset has been seen). Prompts are rendered by `render` (a
  data.PromptRenderer; default: plain text with the default system prompt).
  """
  datasets = _check_datasets(datasets)
  render = render or data_lib.PromptRenderer()
  rng = random.Random(f'math/{seed}')
  weights = [weight for _, weight in datasets]
  remaining = [[] for _ in datasets]  # per dataset: indices left in its epoch
  while True:
    d = rng.choices(range(len(datasets)), weights)[0]
    if not remaining[d]:
      remaining[d] = list(range(len(datasets[d][0])))
      rng.shuffle(remaining[d])
    r = datasets[d][0][remaining[d].pop()]
    yield Problem(id=r.id, prompt=render(r), answer=r.answer)


def by_dataset(parts: Sequence[tuple[str, Sequence[data_lib.Record]]]
               ) -> dict[str, list[data_lib.Record]]:
  """{dataset name: records} of [(path, records), ...]; one name from two paths is refused
  (name them 'NAME=PATH')."""
  out: dict[str, list[data_lib.Record]] = {}
  origin: dict[str, str] = {}
  for path, records in parts:
    for r in records:
      if origin.setdefault(r.dataset, path) != path:
        raise ValueError(f'config.task.test_files: {origin[r.dataset]} and {path} both give '
                         f"dataset {r.dataset!r}; name them apart, as 'NAME=PATH'")
      out.setdefault(r.dataset, []).append(r)
  return out


def load_splits(train_files: Sequence[str], test_files: Sequence[str] = (),
                test_fraction: float = 0.0, problem_field: str = '', answer_field: str = '',
                answer_rule: str = 'auto'
                ) -> tuple[list[list[data_lib.Record]], dict[str, list[data_lib.Record]]]:
  """(train records per train file, {dataset: test records}): what a run trains and evaluates on.

  With test_files, each is a test set (or one per `data_source` value of its rows) and the train
  files are used whole. Without, each train file gives `test_fraction` of its problems
  (split_problems, seed 0: the same split for every run seed) to a test set of its dataset's
  name. Test sets never share a prompt with training unless the files themselves overlap.
  """
  load = lambda path: list(data_lib.load(path, problem_field, answer_field, answer_rule).records)
  train = [load(path) for path in train_files]
  if test_files:
    return train, by_dataset([(path, load(path)) for path in test_files])
  held = []
  if test_fraction > 0:
    for i, (path, records) in enumerate(zip(train_files, train)):
      train[i], test = split_problems(records, test_fraction, seed=0)
      held.append((path, test))
  return train, by_dataset(held)


def _check_datasets(datasets):
  datasets = [(list(records), float(weight)) for records, weight in datasets]
  if not datasets:
    raise ValueError('need at least one dataset')
  for i, (records, weight) in enumerate(datasets):
    if not records or not weight > 0:
      raise ValueError(f'dataset {i}: needs problems and a weight > 0 (has {len(records)} '
                       f'problems, weight {weight})')
  return datasets


# --- the task --------------------------------------------------------------------------------

class MathTask(Task):
  """The Task protocol over weighted datasets, scored by math-verify (or `score_fn`) in a worker
  pool.

  datasets: [(records, weight), ...] (data.Record), streamed by `mixed_stream`.
  render: a data.PromptRenderer (the tokenizer's chat template, the system prompt); None: plain
    text with the default system prompt.
  test_sets: {name: records} held out for evaluation (`held_out`).
  answer_format: how a completion states its answer (ANSWER_FORMATS).
  score_fn: the user's scoring function ('module:function'), judged in the pool instead of
    math-verify (verify.py).
  timeout_s: hard per-sample verification limit. The pool (num_workers processes) starts with
    the task; `close()` ends it (a later score starts a new one).
  """

  def __init__(self, datasets: Sequence[tuple[Sequence[data_lib.Record], float]],
               render: data_lib.PromptRenderer | None = None,
               rewards: config_lib.RewardConfig = config_lib.RewardConfig(), *,
               test_sets: dict[str, Sequence[data_lib.Record]] | None = None,
               answer_format: str = 'boxed', score_fn: str = '', timeout_s: float = 5.0,
               num_workers: int = 2, max_answer_chars: int = 1000, memory_limit_mb: int = 4096):
    if answer_format not in ANSWER_FORMATS:
      raise ValueError(f'answer_format={answer_format!r}: expected one of '
                       f'{", ".join(ANSWER_FORMATS)}')
    self.test_sets = {name: list(records) for name, records in (test_sets or {}).items()}
    # No training problems: a task to evaluate on its test sets only (pipelinerl-eval).
    self.datasets = _check_datasets(datasets) if datasets or not self.test_sets else []
    self.render = render or data_lib.PromptRenderer()
    self.rewards, self.answer_format, self.score_fn = rewards, answer_format, score_fn
    self.max_answer_chars = max_answer_chars
    self._pool_args = dict(num_workers=num_workers, timeout_s=timeout_s,
                           memory_limit_mb=memory_limit_mb, score_fn=score_fn)
    self._counts = dict.fromkeys(STATUSES + EVENTS, 0)
    self._lock = threading.Lock()
    try:
      self._pool = VerifyPool(**self._pool_args)
    except ValueError as e:  # a score_fn that does not import
      raise ValueError(f'config.task.score_fn: {e}') from None

  @property
  def counters(self) -> dict[str, int]:
    """Totals since construction: each status, each pre-check / pool event, worker restarts."""
    with self._lock:
      counts = dict(self._counts)
      pool = self._pool
    counts['worker_restarts'] = pool.counters['restarts'] if pool else 0
    return counts

  def wait_ready(self, timeout_s: float | None = None) -> bool:
    """Blocks until the verify workers have started (else the first score pays for it)."""
    return self._get_pool().wait_ready(timeout_s)

  def close(self) -> None:
    with self._lock:
      pool, self._pool = self._pool, None
    if pool is not None:
      pool.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # --- the Task protocol ---------------------------------------------------------------------

  def problems(self, seed: int) -> Iterator[Problem]:
    if not self.datasets:
      raise ValueError('config.task.train_files: no training problems (this task evaluates only)')
    return mixed_stream(self.datasets, seed, self.render)

  def held_out(self, num_problems: int, seed: int) -> dict[str, list[Problem]]:
    """The test sets, the first `num_problems` of each (0 = all), prompts rendered as in
    training. `seed` is unused: the sets are fixed."""
    del seed
    if not any(self.test_sets.values()):
      raise ValueError('config.task: no held-out problems to evaluate on (set task.test_files '
                       'or task.test_fraction)')
    return {name: [Problem(id=r.id, prompt=self.render(r), answer=r.answer)
                   for r in (records[:num_problems] if num_problems else records)]
            for name, records in self.test_sets.items()}

  def score(self, problem: Problem, completion_text: str, truncated: bool = False,
            num_tokens: int | None = None) -> Score:
    """Never raises; returns within about timeout_s (plus worker start-up on the first call).

    truncated: the completion ended without EOS (finish_reason 'length').
    num_tokens: its length, for the soft overlong penalty (no penalty when None).
    """
    return self.score_many([problem], [completion_text], [truncated], [num_tokens])[0]

  def score_many(self, problems: Sequence[Problem], texts: Sequence[str],
                 truncated: Sequence[bool] | None = None,
                 num_tokens: Sequence[int | None] | None = None) -> list[Score]:
    """`score` for a batch (a group's G samples), judged in parallel by the pool."""
    n = len(texts)
    truncated = [False] * n if truncated is None else list(truncated)
    num_tokens = [None] * n if num_tokens is None else list(num_tokens)
    try:
      if not len(problems) == len(truncated) == len(num_tokens) == n:
        raise ValueError(f'score_many: {len(problems)} problems, {n} texts, {len(truncated)} '
                         f'truncated flags, {len(num_tokens)} lengths')
      events = []
      judged = [self._precheck(p, t, tr, events) for p, t, tr in
                zip(problems, texts, truncated)]
      jobs = [i for i, s in enumerate(judged) if isinstance(s, tuple)]
      if jobs:
        verdicts = self._verify([judged[i] for i in jobs])
        for i, verdict in zip(jobs, verdicts):
          judged[i] = _status_of_verdict(verdict, events)
      scores = [make_score(status, self.rewards, tr, nt, reward)
                for (status, reward), tr, nt in zip(map(_with_reward, judged), truncated,
                                                    num_tokens)]
    except Exception:  # a scorer bug must never take the actor down
      logging.exception('MathTask.score_many failed; %d samples scored unparsable', n)
      events, scores = ['worker_error'] * n, [Score(0.0, 'unparsable')] * n
    events += ['masked' for s in scores if s.mask]
    with self._lock:
      for s in scores:
        self._counts[s.status] += 1
      for e in events:
        self._counts[e] += 1
    return scores

  # --- answers, for majority voting (evaluation.py) -------------------------------------------

  def answer_of(self, completion_text: str) -> str | None:
    """The completion's final answer as `score` reads it (None with a score_fn: its reading is
    the user's)."""
    return None if self.score_fn else extract_answer(completion_text, self.answer_format)

  def same_answers(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
    """Whether each pair of answers is equivalent, by math-verify in the pool (the second read
    against the first as the reference); identical strings without asking."""
    out = [a == b for a, b in pairs]
    ask = [i for i, same in enumerate(out) if not same]
    if ask and not self.score_fn:
      for i, verdict in zip(ask, self._verify([pairs[i] for i in ask])):
        out[i] = verdict == 'correct'
    return out

  # --- internals -----------------------------------------------------------------------------

  def _precheck(self, problem, text, truncated, events):
    """A status decided without the pool, or the pair to send it: (gold, answer) for
    math-verify, (reference, completion) for a score_fn."""
    if truncated:
      events.append('truncated')
      if self.rewards.truncated != 'none':
        return 'no_answer'  # its reward does not depend on the answer: skip judging it
    if self.score_fn:
      return (problem.answer, text) if isinstance(text, str) else 'unparsable'
    answer = extract_answer(text, self.answer_format)
    if answer is None:
      return 'no_answer'
    for event, bad in (('empty_answer', not answer),
                       ('too_long', len(answer) > self.max_answer_chars),
                       ('bad_chars', _BAD_CHARS.search(answer) is not None)):
      if bad:
        events.append(event)
        return 'unparsable'
    return (problem.answer, answer)

  def _get_pool(self) -> VerifyPool:
    with self._lock:
      if self._pool is None:  # closed earlier; scoring again restarts the workers
        self._pool = VerifyPool(**self._pool_args)
      return self._pool

  def _verify(self, pairs):
    return self._get_pool().verify_many(pairs)


def _status_of_verdict(verdict, events: list):
  """A pool verdict as a status, or (status, reward) for a score_fn's ('scored', reward,
  status)."""
  if isinstance(verdict, tuple):
    return verdict[2], verdict[1]
  if verdict in ('correct', 'wrong', 'unparsable', 'no_answer'):
    return verdict
  events.append({'timeout': 'timeout', 'gold_unparsable': 'gold_unparsable'}.get(
      verdict, 'worker_error'))
  return 'unparsable'


def _with_reward(judged) -> tuple[str, float | None]:
  return judged if isinstance(judged, tuple) else (judged, None)
