"""The math task: prompts, math-verify judgements behind the worker pool, hostile completions,
rewards for truncated / overlong samples, dataset loading, splits and mixing."""

import dataclasses
import json
import pathlib
import sys
import threading
import time

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.tasks import data
from pipelinerl_jax.tasks import math as math_task
from pipelinerl_jax.tasks import verify
from pipelinerl_jax.tasks.base import STATUSES, Problem, Score

# Per-sample deadlines and worker kills: on a loaded core a verdict can turn into a timeout.
pytestmark = pytest.mark.serial

DATA = pathlib.Path(__file__).resolve().parent / 'data'
TIMEOUT_S = 2.0
MARGIN_S = 1.5  # kill + respawn + scheduling noise on a loaded 2-core machine
START_S = 3.0  # a replacement worker's start (importing math_verify), on that machine


@pytest.fixture(scope='module')
def task():
  t = math_task.MathTask([(records('math_problems.jsonl'), 1.0)], timeout_s=TIMEOUT_S,
                         num_workers=2)
  assert t.wait_ready(60.0)
  yield t
  t.close()


def records(name: str, **fields) -> list[data.Record]:
  return list(data.load(str(DATA / name), **fields).records)


def judge(task, gold, answer, **kw):
  return task.score(Problem('p', 'q', gold), f'So the answer is $\\boxed{{{answer}}}$.', **kw)


# --- judging ---------------------------------------------------------------------------------

@pytest.mark.parametrize('gold,answer', [
    ('1/2', '0.5'), ('0.5', '1/2'), ('\\frac{1}{2}', '1/2'), ('\\frac{1}{2}', '\\dfrac{1}{2}'),
    ('0.5', '\\dfrac12'), ('\\sqrt{2}', '2^{1/2}'), ('\\sqrt{2}', '\\sqrt2'),
    ('\\frac{\\sqrt{3}}{2}', '\\frac{1}{2}\\sqrt{3}'), ('(1,2]', '(1,2]'),
    ('\\{1,2\\}', '\\{2,1\\}'), ('-3', '-3'), ('-\\frac{1}{2}', '-0.5'),
    ('-\\frac{1}{2}', '\\frac{-1}{2}'), ('1000', '1,000'), ('10', '10.0'), ('90^\\circ', '90'),
    # Units after the number are dropped, as text or bare words:
    ('5', '5 \\text{ cm}'), ('5 \\text{ cm}', '5'), ('5', '5\\,\\text{cm}'), ('5', '5 cm'),
    ('12', '12 \\text{ inches}'),
    # Percentages: X\% equals X/100 (by value); an *integer* X\% also equals X.
    ('50\\%', '0.5'), ('0.5', '50\\%'), ('50\\%', '50'), ('50', '50\\%'), ('50\\%', '50%'),
    ('20\\%', '\\frac{1}{5}'), ('12.5\\%', '0.125'),
])
def test_equivalent_forms_are_correct(task, gold, answer):
  assert judge(task, gold, answer) == Score(1.0, 'correct')


@pytest.mark.parametrize('gold,answer', [
    ('1/2', '0.6'), ('(1,2]', '(1,2)'), ('(1,2]', '[1,2]'), ('\\{1,2\\}', '\\{1,3\\}'),
    ('-3', '3'), ('\\sqrt{2}', '2'), ('1/3', '0.333'),  # floats compare at 6 decimals
    ('50\\%', '0.6'), ('50\\%', '5'),
    ('12.5\\%', '12.5'), ('0.5', '0.5\\%'),  # a non-integer X\% is only X/100
    ('5', '\\text{5 cm}'),  # the number inside \text{} reads as the symbol "5cm"
])
def test_wrong_answers_are_wrong(task, gold, answer):
  assert judge(task, gold, answer) == Score(0.0, 'wrong')


def test_only_the_last_box_counts(task):
  p = Problem('p', 'q', '7')
  assert task.score(p, '\\boxed{3} no wait, \\boxed{7}').status == 'correct'
  assert task.score(p, '\\boxed{7} no wait, \\boxed{3}').status == 'wrong'
  assert task.score(p, '\\boxed{\\frac{14}{2}} and an unclosed \\boxed{8').status == 'correct'


def test_no_answer_and_unparsable(task):
  p = Problem('p', 'q', '2')
  before = task.counters
  assert task.score(p, 'The answer is 2.') == Score(0.0, 'no_answer')
  assert task.score(p, 'unclosed \\boxed{2') == Score(0.0, 'no_answer')
  assert task.score(p, '\\boxed{ }').status == 'unparsable'  # pre-check: empty
  assert task.score(p, '\\boxed{?}').status == 'unparsable'  # math-verify reads no math
  assert task.score(Problem('p', 'q', '\\frac{'), '\\boxed{2}').status == 'unparsable'
  after = task.counters
  assert after['no_answer'] - before['no_answer'] == 2
  assert after['unparsable'] - before['unparsable'] == 3
  assert after['empty_answer'] - before['empty_answer'] == 1
  assert after['gold_unparsable'] - before['gold_unparsable'] == 1


def test_score_many_matches_score_and_keeps_order(task):
  probs = [Problem(str(i), 'q', str(i)) for i in range(6)]
  texts = ['\\boxed{0}', '\\boxed{5}', 'none', '\\boxed{3}', '\\boxed{?}', '\\boxed{2+3}']
  scores = task.score_many(probs, texts)
  assert [s.status for s in scores] == ['correct', 'wrong', 'no_answer', 'correct',
                                        'unparsable', 'correct']
  assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
  assert task.score_many([], []) == []


def test_bad_calls_never_raise(task):
  p = Problem('p', 'q', '1')
  assert task.score(p, None).status == 'no_answer'
  # Mismatched lengths are a caller bug: logged and scored unparsable, not raised on the actor.
  assert [s.status for s in task.score_many([p], ['\\boxed{1}', 'x'])] == ['unparsable'] * 2


# --- hostile completions ---------------------------------------------------------------------

HOSTILE = {
    'nul': 'text \x00 with NUL \\boxed{1\x00/2}',
    'surrogates': 'broken utf-8 \udc80\udcff \\boxed{1/2\udc80}',
    'answer_100k': '\\boxed{' + '1' * 100_000 + '}',
    'braces_5k': '\\boxed{' + '{' * 5000 + '1' + '}' * 5000 + '}',
    'frac_10k': '\\boxed{' + '\\frac{1}{2}' * 10_000 + '}',
    'tower': '\\boxed{9^{9^{9^{9}}}}',  # sympy computes this in C: no signal stops it
    'factorial': '\\boxed{(10^{8})!}',
    'unclosed_boxes': '\\boxed{' * 20_000,
    'text_1m': 'x' * 1_000_000 + '\\boxed{1/2}',
}


@pytest.mark.parametrize('name', sorted(HOSTILE))
@pytest.mark.parametrize('cap', [1000, 10**6], ids=['capped', 'uncapped'])
def test_hostile_completion_returns_in_time(task, name, cap):
  # uncapped: the length pre-check is lifted so that every case reaches math-verify.
  task.max_answer_chars = cap
  try:
    t0 = time.monotonic()
    score = task.score(Problem('p', 'q', '1/2'), HOSTILE[name])
    elapsed = time.monotonic() - t0
  finally:
    task.max_answer_chars = 1000
  assert score.status in STATUSES and score.reward in (0.0, 1.0)
  assert elapsed < TIMEOUT_S + MARGIN_S, f'{name}: {elapsed:.2f} s'
  if name in ('nul', 'surrogates'):
    assert score.status == 'unparsable'  # pre-check: control characters / lone surrogates
  if name == 'text_1m':
    assert score.status == 'correct'


def test_length_cap_is_a_counted_precheck(task):
  before = task.counters
  for name in ('answer_100k', 'braces_5k', 'frac_10k'):
    assert task.score(Problem('p', 'q', '1/2'), HOSTILE[name]).status == 'unparsable'
  after = task.counters
  assert after['too_long'] - before['too_long'] == 3
  assert after['timeout'] == before['timeout']  # never reached the pool


def test_pool_survives_timeouts(task):
  p = Problem('p', 'q', '1/2')
  before = task.counters
  assert task.score(p, HOSTILE['tower']).status == 'unparsable'
  after = task.counters
  assert after['timeout'] - before['timeout'] == 1
  assert after['worker_restarts'] - before['worker_restarts'] == 1
  # The next samples score correctly, and a batch with two stuck samples among good ones only
  # loses the stuck ones, both workers being killed and replaced in the same batch.
  assert task.score(p, '\\boxed{0.5}').status == 'correct'
  t0 = time.monotonic()
  scores = task.score_many([p] * 5, ['\\boxed{\\frac12}', HOSTILE['tower'], '\\boxed{1}',
                                     HOSTILE['factorial'], '\\boxed{2/4}'])
  assert time.monotonic() - t0 < 2 * TIMEOUT_S + MARGIN_S
  assert [s.status for s in scores] == ['correct', 'unparsable', 'wrong', 'unparsable',
                                        'correct']
  assert task.counters['timeout'] - after['timeout'] == 2
  assert task.score(p, '\\boxed{50\\%}').status == 'correct'


# --- rewards ---------------------------------------------------------------------------------

def test_soft_overlong_penalty_boundaries():
  f = math_task.soft_overlong_penalty
  assert f(0, 100, 20) == 0.0
  assert f(80, 100, 20) == 0.0           # l = L - Lc
  assert f(81, 100, 20) == pytest.approx(-1 / 20)
  assert f(90, 100, 20) == pytest.approx(-0.5)
  assert f(100, 100, 20) == pytest.approx(-1.0)  # l = L
  assert f(101, 100, 20) == -1.0
  assert f(100, 100, 0) == 0.0 and f(101, 100, 0) == -1.0  # no buffer: a hard step


def test_reward_table_truncation_and_overlong():
  make = math_task.make_score
  table = config_lib.RewardConfig(correct=2.0, wrong=-1.0, no_answer=-0.5, unparsable=-0.25)
  assert [make(s, table).reward for s in STATUSES] == [2.0, -1.0, -0.5, -0.25]
  assert make('correct', table, truncated=True) == Score(0.0, 'correct')  # 'penalize' (default)
  none = config_lib.RewardConfig(correct=2.0, truncated='none')
  assert make('correct', none, truncated=True) == Score(2.0, 'correct')
  mask = config_lib.RewardConfig(truncated='mask')
  assert make('correct', mask, truncated=True) == Score(0.0, 'correct', mask=True)
  assert not make('correct', mask, truncated=False).mask
  pen = config_lib.RewardConfig(truncated='penalize', truncated_reward=-1.0)
  assert make('correct', pen, truncated=True).reward == -1.0
  soft = config_lib.RewardConfig(overlong_max_len=100, overlong_buffer=20)
  assert make('correct', soft, num_tokens=80).reward == 1.0
  assert make('correct', soft, num_tokens=90).reward == pytest.approx(0.5)
  assert make('wrong', soft, num_tokens=200).reward == -1.0
  assert make('correct', soft).reward == 1.0  # no length given: no penalty
  with pytest.raises(ValueError, match='truncated'):
    config_lib.RewardConfig(truncated='drop')
  with pytest.raises(ValueError, match='overlong_buffer'):
    config_lib.RewardConfig(overlong_max_len=10, overlong_buffer=20)


def test_truncated_samples_in_the_task(task):
  p = Problem('p', 'q', '4')
  text = '\\boxed{4} and then it went on and on'
  try:
    task.rewards = config_lib.RewardConfig(truncated='mask')
    before = task.counters
    masked = task.score(p, text, truncated=True)
    assert masked.mask and masked.reward == 0.0 and masked.status == 'no_answer'
    assert task.counters['masked'] - before['masked'] == 1
    assert task.counters['truncated'] - before['truncated'] == 1
    task.rewards = config_lib.RewardConfig(truncated='penalize', truncated_reward=-0.5)
    assert task.score(p, text, truncated=True) == Score(-0.5, 'no_answer')
    task.rewards = config_lib.RewardConfig(truncated='none', overlong_max_len=100,
                                          overlong_buffer=10)
    assert task.score(p, text, truncated=True, num_tokens=95).reward == pytest.approx(0.5)
  finally:
    task.rewards = config_lib.RewardConfig()


# --- prompts and answers ---------------------------------------------------------------------

def test_chat_template_kwargs_reach_the_template_or_are_refused():
  """Qwen3's template opens an empty think block when enable_thinking is false; the task's
  stream, its held-out set and the registry all pass task.chat_template_kwargs on, and a name the
  template never reads (Jinja would drop it silently) is refused naming the key."""
  from pipelinerl_jax.tasks import registry
  import transformers
  from pipelinerl_jax.demo import char_tokenizer
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=char_tokenizer.build_char_tokenizer(), eos_token='<eos>')
  kwargs = {'enable_thinking': False}
  with pytest.raises(ValueError, match='chat_template_kwargs.*no chat template'):
    data.check_chat_template_kwargs(tok, kwargs)
  tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                       "<|assistant|>{% if enable_thinking is defined and enable_thinking is false"
                       " %}<think>\n\n</think>\n\n{% endif %}")
  problems = records('math_problems.jsonl')
  thinking, plain = (data.PromptRenderer(tok, chat_template_kwargs=k)(problems[0])
                     for k in ({}, kwargs))
  assert plain == thinking + '<think>\n\n</think>\n\n'
  render = data.PromptRenderer(tok, chat_template_kwargs=kwargs)
  task = math_task.MathTask([(problems, 1.0)], render, test_sets={'t': problems[:2]},
                            num_workers=1)
  try:
    assert next(task.problems(seed=0)).prompt.endswith('</think>\n\n')
    assert all(p.prompt.endswith('</think>\n\n') for p in task.held_out(0, 0)['t'])
  finally:
    task.close()
  config = config_lib.TaskConfig(name='math', train_files=(str(DATA / 'math_problems.jsonl'),),
                                 chat_template_kwargs={'reasoning_effort': 'low'})
  with pytest.raises(ValueError, match=r"config.task.chat_template_kwargs: the chat template "
                                       r"never mentions \['reasoning_effort'\]"):
    registry.make_task(config, tok)


def test_answer_line_format_reads_dapos_final_line(task):
  """DAPO-Math-17k's prompts ask for 'Answer: $Answer' on the last line, not a box."""
  line = math_task.extract_answer_line
  assert line('so x = 3.\nAnswer: 72') == '72'
  assert line('Answer: 1\nwait.\nanswer:  $\\frac{1}{2}$.\nDone') == '\\frac{1}{2}'
  assert line('Answer: \\boxed{5} (checked)') == '5'
  assert line('no final line') is None
  assert line('Answer:' * 100_000) == ''  # linear in the text, whatever it holds
  p = Problem('p', 'q', '72')
  task.answer_format = 'answer_line'
  try:
    assert task.score(p, 'Twice 36.\nAnswer: 72').status == 'correct'
    assert task.score(p, 'Twice 36 is \\boxed{72}').status == 'no_answer'
    assert task.answer_of('Answer: 72') == '72'
  finally:
    task.answer_format = 'boxed'
  assert task.score(p, 'Twice 36.\nAnswer: 72').status == 'no_answer'
  assert task.answer_of('Twice 36 is \\boxed{72}') == '72'


def test_same_answers_is_math_verify_equivalence(task):
  assert task.same_answers([('1/2', '0.5'), ('3', '3'), ('1/2', '0.6'), ('\\{1,2\\}', '\\{2,1\\}')]
                           ) == [True, True, False, True]


# --- datasets --------------------------------------------------------------------------------

def test_both_field_conventions_of_the_test_files():
  plain = records('math_problems.jsonl')
  assert len(plain) == 10 and plain[1].answer == '\\frac{1}{2}' and plain[6].answer == '50\\%'
  assert plain[0].id == 'math_problems-0' and plain[0].text.startswith('What is $3')
  sols = records('math_solutions.parquet')
  assert len(sols) == 10 and sols[0].text.startswith('Natalia')
  assert [p.answer for p in sols[:3]] == ['72', '\\frac{3}{2}', '5\\sqrt{2}']
  assert sols[6].answer == '\\{-2, 4\\}' and sols[9].answer == '1024'  # the last box, nested
  assert len({p.id for p in plain + sols}) == 20


def test_explicit_fields_and_errors(tmp_path):
  path = tmp_path / 'odd.jsonl'
  path.write_text(json.dumps({'text': 'What is 2+2?', 'target': 4, 'answer': 'x'}) + '\n')
  [p] = data.load(str(path), prompt_field='text', answer_field='target').records
  assert (p.text, p.answer) == ('What is 2+2?', '4')
  with pytest.raises(ValueError) as e:
    data.load(str(path))
  msg = str(e.value)
  assert str(path) in msg and 'no problem field' in msg and 'problem, question, prompt' in msg
  assert '\n' not in msg
  with pytest.raises(ValueError, match=r"no answer field 'final'"):
    data.load(str(path), prompt_field='text', answer_field='final')
  nobox = tmp_path / 'nobox.jsonl'
  nobox.write_text(json.dumps({'question': 'q', 'solution': 'it is 4'}) + '\n')
  with pytest.raises(ValueError, match=r'nobox.jsonl: row 0: .*no \\boxed'):
    data.load(str(nobox))
  with pytest.raises(FileNotFoundError, match='missing.parquet'):
    data.load(str(tmp_path / 'missing.parquet'))


def test_split_is_deterministic_and_disjoint():
  problems = records('math_problems.jsonl') + records('math_solutions.parquet')
  train, test = math_task.split_problems(problems, 0.25, seed=3)
  assert (train, test) == math_task.split_problems(problems, 0.25, seed=3)
  assert len(test) == 5 and len(train) == 15
  assert not {p.messages for p in train} & {p.messages for p in test}
  assert sorted(p.id for p in train + test) == sorted(p.id for p in problems)
  assert math_task.split_problems(problems, 0.25, seed=4)[1] != test
  # A duplicated problem stays on one side.
  dup = problems + [dataclasses.replace(problems[0], id='dup')]
  for seed in range(5):
    train, test = math_task.split_problems(dup, 0.5, seed)
    assert not {p.messages for p in train} & {p.messages for p in test}


def _record(id_, text):
  return data.Record(id_, 'd', (('user', text),), '1')


def test_mixing_follows_weights_and_seed():
  a = [_record(f'a{i}', f'A{i}') for i in range(7)]
  b = [_record(f'b{i}', f'B{i}') for i in range(3)]
  stream = math_task.mixed_stream([(a, 3.0), (b, 1.0)], seed=0)
  first = [next(stream) for _ in range(4000)]
  share_a = sum(p.id.startswith('a') for p in first) / len(first)
  assert abs(share_a - 0.75) < 0.03
  again = math_task.mixed_stream([(a, 3.0), (b, 1.0)], seed=0)
  assert [p.id for p in first[:50]] == [next(again).id for _ in range(50)]
  other = math_task.mixed_stream([(a, 3.0), (b, 1.0)], seed=1)
  assert [p.id for p in first[:50]] != [next(other).id for _ in range(50)]
  # Each dataset is walked epoch by epoch: every 7 draws from `a` are a permutation of it.
  from_a = [p.id for p in first if p.id.startswith('a')]
  for epoch in range(3):
    assert sorted(from_a[7 * epoch:7 * epoch + 7]) == sorted(p.id for p in a)
  assert from_a[:7] != from_a[7:14]  # reshuffled per epoch
  by_id = {r.id: r for r in a + b}
  assert first[0].prompt == data.PromptRenderer()(by_id[first[0].id])
  with pytest.raises(ValueError, match='weight'):
    next(math_task.mixed_stream([(a, 1.0), (b, 0.0)], seed=0))


def test_task_stream_close_and_restart():
  problems = records('math_problems.jsonl')
  with pytest.raises(ValueError, match='weight'):
    math_task.MathTask([(problems, -1.0)])
  with math_task.MathTask([(problems, 1.0)], num_workers=1) as t:
    p = next(t.problems(seed=0))
    assert p.prompt.startswith(data.SYSTEM_PROMPT) and p.id.startswith('math_problems-')
    t.close()  # scoring after close starts a new pool
    assert t.score(Problem('p', 'q', '3'), '\\boxed{3}').status == 'correct'


def test_pool_replaces_workers_that_die(task):
  p = Problem('p', 'q', '1/2')
  assert task.score(p, '\\boxed{0.5}').status == 'correct'  # both workers idle and ready
  workers = task._pool._workers
  # Killed while idle (the OOM killer, say): the next batch still scores every sample.
  before = task.counters
  workers[0].proc.kill()
  workers[0].proc.wait()
  assert [s.status for s in task.score_many([p] * 3, ['\\boxed{1/2}'] * 3)] == ['correct'] * 3
  assert task.counters['worker_restarts'] - before['worker_restarts'] == 1
  # Every worker killed mid-sample: the sample is sent again to a fresh worker (where the tower
  # runs out its time: a timeout, not a worker error), and the next sample, which may meet the
  # other dead worker still marked ready, is verified too.
  before = task.counters
  result = []
  scorer = threading.Thread(target=lambda: result.extend(task.score_many([p], [HOSTILE['tower']])))
  t0 = time.monotonic()
  scorer.start()
  time.sleep(0.5)
  for w in list(workers):
    w.proc.kill()
  scorer.join(0.5 + START_S + TIMEOUT_S + MARGIN_S)
  assert time.monotonic() - t0 < 0.5 + START_S + TIMEOUT_S + MARGIN_S
  assert [s.status for s in result] == ['unparsable']
  assert task.counters['timeout'] - before['timeout'] == 1
  assert task.score(p, '\\boxed{2/4}').status == 'correct'
  assert task.counters['worker_error'] == before['worker_error']


class _DiesAfterSend:
  """A worker's connection that kills the worker right after handing it a job, when
  `kills(worker, job)`: the job sits unread in its socket, the moment that no check made before
  sending can see (the flake this reproduces: an idle worker killed just before its next job)."""

  def __init__(self, worker, kills):
    self._worker, self._conn, self._kills = worker, worker.conn, kills

  def send(self, job):
    self._conn.send(job)
    if self._kills(self._worker, job):
      self._worker.proc.kill()
      self._worker.proc.wait()

  def __getattr__(self, name):  # recv, fileno, close: the real connection's
    return getattr(self._conn, name)


class _KillingPool(verify.VerifyPool):
  def __init__(self, kills, **kw):
    self._kills = kills
    super().__init__(**kw)

  def _spawn(self):
    w = super()._spawn()
    w.conn = _DiesAfterSend(w, self._kills)
    return w


def test_a_sample_whose_worker_dies_is_verified_by_a_fresh_one():
  doomed = set()
  with _KillingPool(lambda w, job: w.proc.pid in doomed, num_workers=2,
                    timeout_s=TIMEOUT_S) as pool:
    assert pool.wait_ready(60.0)
    doomed.update(w.proc.pid for w in pool._workers)  # each dies on its first job, unanswered
    # Worker 1 is idle and ready, but started before worker 0 died: the sample waits for
    # worker 0's replacement.
    assert pool.verify_many([('1/2', '0.5')]) == ['correct']
    assert pool.verify_many([('1/2', '2/4'), ('3', '3')]) == ['correct'] * 2
    assert pool.counters == {'timeout': 0, 'error': 0, 'restarts': 2, 'start_failures': 0,
                             'resent': 2}


def test_a_sample_that_kills_two_workers_is_an_error_and_the_rest_are_verified():
  with _KillingPool(lambda w, job: job[1] == 'die', num_workers=2, timeout_s=TIMEOUT_S) as pool:
    assert pool.wait_ready(60.0)
    verdicts = pool.verify_many([('1/2', '0.5'), ('1', 'die'), ('3', '3'), ('2', '1')])
    assert verdicts == ['correct', 'error', 'correct', 'wrong']
    assert pool.counters == {'timeout': 0, 'error': 1, 'restarts': 2, 'start_failures': 0,
                             'resent': 1}


def test_workers_that_cannot_start_fail_fast(monkeypatch):
  problems = [Problem('p', 'q', '3')]
  monkeypatch.setattr(sys, 'executable', '/bin/false')  # every worker exits at once
  t = math_task.MathTask([(problems, 1.0)], num_workers=2)
  try:
    t0 = time.monotonic()
    scores = t.score_many(problems * 3, ['\\boxed{3}'] * 3)
    assert time.monotonic() - t0 < 5.0  # no waiting out start_timeout_s, no respawn loop
    assert [s.status for s in scores] == ['unparsable'] * 3
    assert t.counters['worker_error'] == 3 and t._pool.counters['start_failures'] == 2
    monkeypatch.undo()  # the next batch retries the empty slots
    assert t.score(problems[0], '\\boxed{3}').status == 'correct'
  finally:
    t.close()
