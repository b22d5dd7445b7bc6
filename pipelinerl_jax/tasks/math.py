"""Math problems with a reference answer: chat prompts, a `\\boxed{}` answer, judged by math-verify.

Scoring a sample:
  1. truncated (no EOS) and `truncated` is 'mask' or 'penalize' -> not judged, status no_answer
  2. no complete `\\boxed{...}` in the completion               -> no_answer
  3. pre-checks on the boxed answer, each counted: empty, longer than max_answer_chars, or
     holding control characters / lone surrogates (broken UTF-8) -> unparsable
  4. math-verify in the worker pool (verify.py), hard timeout per sample -> correct | wrong |
     unparsable. A timeout is reported as 'unparsable', not 'wrong': the grader could not read
     the answer in time, which says nothing about whether it was right, and 'wrong' should stay a
     clean accuracy signal. The default rewards are the same (0), and `counters['timeout']`
     tells the two apart.
Rewards come from `config.RewardConfig`; it also holds the options for truncated completions and
DAPO's soft overlong penalty.

How a trainer uses `Score.mask` (truncated='mask', DAPO's overlong filtering): a masked
sample carries no learning signal, neither reward nor penalty. Drop it before computing group
advantages (it is not in its group's mean or std) and give its tokens zero loss weight; a group
whose samples are all masked is dropped. Its `status` is still counted in the metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import threading
from typing import Any, Iterator, Mapping, Sequence

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks.base import STATUSES, Problem, Score, Task, extract_boxed
from pipelinerl_jax.tasks.verify import VerifyPool

SYSTEM_PROMPT = 'Please reason step by step, and put your final answer within \\boxed{}.'
PROBLEM_FIELDS = ('problem', 'question', 'prompt')
ANSWER_FIELDS = ('answer', 'final_answer', 'solution')  # tried in this order
# Pre-check and pool outcomes, counted next to the statuses (a sample can add to several).
EVENTS = ('truncated', 'masked', 'empty_answer', 'too_long', 'bad_chars', 'timeout',
          'gold_unparsable', 'worker_error')
_BAD_CHARS = re.compile('[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]')


def format_prompt(problem_text: str, tokenizer=None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
  """The text the model continues: the tokenizer's chat template when it has one, given
  `chat_template_kwargs` (e.g. Qwen3's enable_thinking)."""
  if tokenizer is not None and getattr(tokenizer, 'chat_template', None):
    messages = [{'role': 'system', 'content': SYSTEM_PROMPT},
                {'role': 'user', 'content': problem_text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))
  return f'{SYSTEM_PROMPT}\n\nProblem: {problem_text}\n\nSolution:'


def check_chat_template_kwargs(tokenizer, chat_template_kwargs: Mapping[str, Any]) -> None:
  """A kwarg the template cannot read would be dropped without a word by Jinja: refused here,
  naming the config key."""
  if not chat_template_kwargs:
    return
  template = getattr(tokenizer, 'chat_template', None) if tokenizer is not None else None
  if not isinstance(template, str) or not template:
    raise ValueError(f'config.task.chat_template_kwargs: {dict(chat_template_kwargs)} given, but '
                     'the tokenizer has no chat template (prompts are plain text)')
  unread = sorted(name for name in chat_template_kwargs if name not in template)
  if unread:
    raise ValueError(f'config.task.chat_template_kwargs: the chat template never mentions '
                     f'{unread}')


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
               num_tokens: int | None = None) -> Score:
  """The reward for a judged status (pure): table value, truncation rule, overlong penalty."""
  if truncated and config.truncated == 'mask':
    return Score(0.0, status, mask=True)
  if truncated and config.truncated == 'penalize':
    reward = config.truncated_reward
  else:
    reward = getattr(config, status)
  if config.overlong_max_len and num_tokens is not None:
    reward += soft_overlong_penalty(num_tokens, config.overlong_max_len, config.overlong_buffer)
  return Score(float(reward), status)


# --- datasets --------------------------------------------------------------------------------

def load_problems(path: str, problem_field: str | None = None,
                  answer_field: str | None = None) -> list[Problem]:
  """Problems from a local .jsonl / .json / .parquet file, read offline with `datasets`.

  Fields default to the first present of PROBLEM_FIELDS and ANSWER_FIELDS. An answer holding a
  `\\boxed{}` (a full solution) gives its last boxed content; a 'solution' field without one is
  an error. `Problem.prompt` is the raw problem text: MathTask formats it for the model. Ids are
  `<file stem>-<row>`.
  """
  path = os.fspath(path)
  kind = {'.jsonl': 'json', '.json': 'json', '.parquet': 'parquet'}.get(
      os.path.splitext(path)[1].lower())
  if kind is None:
    raise ValueError(f'{path}: unknown format (expected .jsonl, .json or .parquet)')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file')
  if path.lower().endswith('.jsonl'):
    _check_jsonl(path)  # `datasets` names neither the bad line nor an empty file
  import datasets  # imported here: slow, and only the loader needs it
  try:
    ds = datasets.load_dataset(kind, data_files=path, split='train')
  except Exception as e:
    first_line = (str(e).strip().splitlines() or [''])[0]
    raise ValueError(f'{path}: cannot read as {kind}: {type(e).__name__}: {first_line}') from e
  columns = ds.column_names
  pf = _pick_field(path, columns, problem_field, PROBLEM_FIELDS, 'problem')
  af = _pick_field(path, columns, answer_field, ANSWER_FIELDS, 'answer')
  stem = os.path.splitext(os.path.basename(path))[0]
  problems = []
  for row, (text, answer) in enumerate(zip(ds[pf], ds[af])):
    where = f'{path}: row {row}'
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f'{where}: field {pf!r} is empty or not text: {text!r:.80}')
    answer = '' if answer is None else str(answer).strip()
    boxed = extract_boxed(answer)
    if boxed is not None:
      answer = boxed.strip()
    elif af == 'solution':
      raise ValueError(f'{where}: field {af!r} holds no \\boxed{{}} answer')
    if not answer:
      raise ValueError(f'{where}: field {af!r} is empty')
    problems.append(Problem(id=f'{stem}-{row}', prompt=text, answer=answer))
  if not problems:
    raise ValueError(f'{path}: holds no problems')
  return problems


def _check_jsonl(path: str) -> None:
  """Every non-blank line is a JSON object, and there is one at least; errors name the line."""
  count = 0
  with open(path, encoding='utf-8', errors='replace') as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line.rstrip('\n'))
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}: line {lineno}: not valid JSON ({e.msg} at column {e.colno})'
                         ) from None
      if not isinstance(record, dict):
        raise ValueError(f'{path}: line {lineno}: not a JSON object: {line.strip()[:80]}')
      count += 1
  if not count:
    raise ValueError(f'{path}: holds no problems (the file is empty)')


def _pick_field(path, columns, given, candidates, what):
  if given is not None:
    if given not in columns:
      raise ValueError(f'{path}: no {what} field {given!r} (columns: {", ".join(columns)})')
    return given
  for name in candidates:
    if name in columns:
      return name
  raise ValueError(f'{path}: no {what} field (looked for {", ".join(candidates)}; '
                   f'columns: {", ".join(columns)})')


def split_problems(problems: Sequence[Problem], test_fraction: float,
                   seed: int = 0) -> tuple[list[Problem], list[Problem]]:
  """(train, test), a function of (problems, test_fraction, seed); each keeps the input order.

  The split is over distinct problem texts, so a problem listed twice never lands on both sides.
  """
  if not 0.0 <= test_fraction <= 1.0:
    raise ValueError(f'test_fraction={test_fraction} must be in [0, 1]')
  texts = list(dict.fromkeys(p.prompt for p in problems))
  random.Random(f'math-split/{seed}').shuffle(texts)
  test_texts = set(texts[:round(len(texts) * test_fraction)])
  train = [p for p in problems if p.prompt not in test_texts]
  test = [p for p in problems if p.prompt in test_texts]
  return train, test


def mixed_stream(datasets: Sequence[tuple[Sequence[Problem], float]], seed: int,
                 tokenizer=None, chat_template_kwargs: Mapping[str, Any] | None = None
                 ) -> Iterator[Problem]:
  """An infinite stream over [(problems, weight), ...], a function of (datasets, seed).

  Each draw picks a dataset with probability proportional to its weight, then takes that
  dataset's next problem in a shuffled order that is redrawn every epoch (so no problem repeats
  before all of its dataset has been seen). Prompts are formatted with `format_prompt`.
  """
  datasets = _check_datasets(datasets)
  rng = random.Random(f'math/{seed}')
  weights = [weight for _, weight in datasets]
  remaining = [[] for _ in datasets]  # per dataset: indices left in its epoch
  while True:
    d = rng.choices(range(len(datasets)), weights)[0]
    if not remaining[d]:
      remaining[d] = list(range(len(datasets[d][0])))
      rng.shuffle(remaining[d])
    p = datasets[d][0][remaining[d].pop()]
    yield dataclasses.replace(p, prompt=format_prompt(p.prompt, tokenizer, chat_template_kwargs))


def dataset_name(path: str) -> str:
  """A dataset's name in metrics and evaluation output: its file stem."""
  return os.path.splitext(os.path.basename(os.fspath(path)))[0]


def load_splits(train_files: Sequence[str], test_files: Sequence[str] = (),
                test_fraction: float = 0.0, problem_field: str | None = None,
                answer_field: str | None = None
                ) -> tuple[list[list[Problem]], dict[str, list[Problem]]]:
  """(train problems per train file, {name: test problems}): what a run trains and evaluates on.

  With test_files, each is a test set and the train files are used whole. Without, each train
  file gives `test_fraction` of its problems (split_problems, seed 0: the same split for every
  run seed) to a test set of the same name. Test sets never share a problem text with training
  unless the files themselves overlap.
  """
  load = lambda path: load_problems(path, problem_field or None, answer_field or None)
  train = [load(path) for path in train_files]
  if test_files:
    return train, {dataset_name(path): load(path) for path in test_files}
  test = {}
  if test_fraction > 0:
    for i, (path, problems) in enumerate(zip(train_files, train)):
      train[i], test[dataset_name(path)] = split_problems(problems, test_fraction, seed=0)
  return train, test


def _check_datasets(datasets):
  datasets = [(list(problems), float(weight)) for problems, weight in datasets]
  if not datasets:
    raise ValueError('need at least one dataset')
  for i, (problems, weight) in enumerate(datasets):
    if not problems or not weight > 0:
      raise ValueError(f'dataset {i}: needs problems and a weight > 0 (has {len(problems)} '
                       f'problems, weight {weight})')
  return datasets


# --- the task --------------------------------------------------------------------------------

class MathTask(Task):
  """The Task protocol over weighted datasets, scored by math-verify in a worker pool.

  datasets: [(problems, weight), ...], streamed by `mixed_stream`.
  tokenizer, chat_template_kwargs: for `format_prompt` (no tokenizer: the plain-text prompt).
  test_sets: {name: problems} held out for evaluation (`held_out`).
  timeout_s: hard per-sample verification limit. The pool (num_workers processes) starts with
    the task; `close()` ends it (a later score starts a new one).
  """

  def __init__(self, datasets: Sequence[tuple[Sequence[Problem], float]], tokenizer=None,
               rewards: config_lib.RewardConfig = config_lib.RewardConfig(), *,
               test_sets: dict[str, Sequence[Problem]] | None = None, timeout_s: float = 5.0,
               num_workers: int = 2, max_answer_chars: int = 1000, memory_limit_mb: int = 4096,
               chat_template_kwargs: Mapping[str, Any] | None = None):
    self.datasets = _check_datasets(datasets)
    self.test_sets = {name: list(problems) for name, problems in (test_sets or {}).items()}
    check_chat_template_kwargs(tokenizer, chat_template_kwargs or {})
    self.tokenizer, self.rewards = tokenizer, rewards
    self.chat_template_kwargs = dict(chat_template_kwargs or {})
    self.max_answer_chars = max_answer_chars
    self._pool_args = dict(num_workers=num_workers, timeout_s=timeout_s,
                           memory_limit_mb=memory_limit_mb)
    self._counts = dict.fromkeys(STATUSES + EVENTS, 0)
    self._lock = threading.Lock()
    self._pool = VerifyPool(**self._pool_args)

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
    return mixed_stream(self.datasets, seed, self.tokenizer, self.chat_template_kwargs)

  def held_out(self, num_problems: int, seed: int) -> dict[str, list[Problem]]:
    """The test sets, the first `num_problems` of each (0 = all), prompts formatted as in
    training. `seed` is unused: the sets are fixed."""
    del seed
    if not any(self.test_sets.values()):
      raise ValueError('config.task: no held-out problems to evaluate on (set task.test_files '
                       'or task.test_fraction)')
    return {name: [dataclasses.replace(p, prompt=format_prompt(p.prompt, self.tokenizer,
                                                               self.chat_template_kwargs))
                   for p in (problems[:num_problems] if num_problems else problems)]
            for name, problems in self.test_sets.items()}

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
      statuses = [self._precheck(p, t, tr, events) for p, t, tr in
                  zip(problems, texts, truncated)]
      jobs = [i for i, s in enumerate(statuses) if isinstance(s, tuple)]
      if jobs:
        verdicts = self._verify([statuses[i] for i in jobs])
        for i, verdict in zip(jobs, verdicts):
          statuses[i] = _status_of_verdict(verdict, events)
      scores = [make_score(s, self.rewards, tr, nt)
                for s, tr, nt in zip(statuses, truncated, num_tokens)]
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

  # --- internals -----------------------------------------------------------------------------

  def _precheck(self, problem, text, truncated, events):
    """A status decided without math-verify, or the (gold, answer) pair to send to the pool."""
    if truncated:
      events.append('truncated')
      if self.rewards.truncated != 'none':
        return 'no_answer'  # its reward does not depend on the answer: skip judging it
    boxed = extract_boxed(text) if isinstance(text, str) else None
    if boxed is None:
      return 'no_answer'
    answer = boxed.strip()
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


def _status_of_verdict(verdict: str, events: list) -> str:
  if verdict in ('correct', 'wrong', 'unparsable'):
    return verdict
  events.append({'timeout': 'timeout', 'gold_unparsable': 'gold_unparsable'}.get(
      verdict, 'worker_error'))
  return 'unparsable'
