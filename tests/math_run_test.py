"""The math task in runs: a short pipeline run, masked samples in the actor, config and presets."""

import pathlib
import threading

import ml_collections
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.tasks.base import STATUSES, Problem, Score, Task

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / 'tests' / 'data'


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
  """An untrained demo-format model whose positions cover ~200-character math prompts."""
  demo = config_lib.DemoModelConfig(max_steps=0, eval_problems=8, max_position_embeddings=256)
  out = tmp_path_factory.mktemp('model') / 'demo'
  return str(warmstart.build_demo_model(out, demo, log=lambda *_: None))


def small_math_config(model_dir):
  c = config_lib.load_preset()
  c.task.name = 'math'
  c.model.path = model_dir
  c.task.train_files = (str(DATA / 'math_problems.jsonl'), str(DATA / 'math_solutions.parquet'))
  c.task.train_weights = (1.0, 2.0)
  c.task.test_fraction = 0.25
  c.task.verify_workers = 1
  # Most untrained completions hit the length limit: masking them exercises the credit release.
  c.task.reward.truncated = 'mask'
  c.generation.max_prompt_len = 192
  c.generation.max_new_tokens = 16
  c.train.seq_len = 256
  c.train.mesh = '1,1,1'
  c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 8, 4, 16
  c.rl.total_steps = 2
  c.eval.every_steps, c.eval.num_problems, c.eval.k = 2, 0, 2  # at the last step, test splits
  c.rl.max_time_s = 300.0  # a safety stop only: a leaked credit would otherwise hang the test
  c.log.progress = False
  c.log.tensorboard = False
  return c


def test_math_run_counts_statuses_masks_evaluates_and_closes_the_pool(model_dir, tmp_path):
  seen = {}

  def on_ready(live):
    seen['task'] = live['task']
    seen['procs'] = [w.proc for w in live['task']._pool._workers if w is not None]

  summary = launch.run_experiment(small_math_config(model_dir), str(tmp_path), on_ready=on_ready)
  assert summary['steps'] == 2
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2]
  for r in records:
    fracs = {k: v for k, v in r.items() if k.removeprefix('frac_') in STATUSES}
    assert abs(sum(fracs.values()) - 1) < 1e-6  # statuses of every sample, masked ones too
    assert 0 <= r['masked_frac'] < 1  # a group reaching the trainer has an unmasked sample
    assert r['task/worker_restarts'] == 0 and 'task/timeout' in r
  assert records[-1]['samples_masked'] > 0
  # Evaluated on the two held-out splits (2 problems each), per dataset and over both.
  assert 'eval/pass@1' not in records[0]
  assert {'eval/pass@1', 'eval/pass@2', 'eval/math_problems/pass@1',
          'eval/math_solutions/pass@2'} <= set(records[-1])
  assert (tmp_path / 'eval' / 'samples-2.jsonl').read_text().count('\n') == 4 * 2
  assert records[-1]['task/masked'] == records[-1]['samples_masked']
  # The verify pool is closed and its workers are gone.
  assert seen['task']._pool is None
  assert seen['procs'] and all(p.poll() is not None for p in seen['procs'])


def test_load_splits_test_files_or_a_held_out_fraction():
  from pipelinerl_jax.tasks import math as math_task
  files = [str(DATA / 'math_problems.jsonl'), str(DATA / 'math_solutions.parquet')]
  train, test = math_task.load_splits(files[:1], test_files=files[1:])
  assert [len(t) for t in train] == [10] and list(test) == ['math_solutions']
  train, test = math_task.load_splits(files, test_fraction=0.3)
  assert list(test) == ['math_problems', 'math_solutions']
  for part, held in zip(train, test.values()):
    assert len(held) == 3 and not {p.messages for p in part} & {p.messages for p in held}
  assert math_task.load_splits(files, test_fraction=0.3) == (train, test)  # seed-independent


# --- the actor's masking, on hand-made completions ---------------------------------------------

def _completion(j, n=3, reason='stop'):
  return api.Completion(request_id=f'0/{j}', prompt_tokens=[1, 2], tokens=np.arange(3, 3 + n),
                        logprobs=np.full(n, -1.0, np.float32), versions=np.zeros(n, np.int64),
                        finish_reason=reason, metadata=dict(group=0, index=j))


CONFIG = actor_lib.ActorConfig(group_size=4, num_slots=4,
                               sampling=api.SamplingParams(max_tokens=4))
PROBLEM = Problem('p0', 'q', '1')


def test_masked_samples_are_out_of_the_baseline():
  scores = [Score(1.0, 'correct'), Score(0.0, 'no_answer', mask=True),
            Score(0.0, 'wrong'), Score(0.0, 'no_answer', mask=True)]
  group = actor_lib.make_group(0, PROBLEM, [_completion(j) for j in range(4)], scores, CONFIG)
  # Baseline = mean of the two unmasked rewards (0.5), not of all four (0.25).
  assert [s.advantage for s in group.samples] == [0.5, -0.5]
  assert group.rewards.tolist() == [1.0, 0.0]
  assert group.statuses == ['correct', 'no_answer', 'wrong', 'no_answer']
  assert group.num_masked == 2
  all_masked = [Score(0.0, 'no_answer', mask=True)] * 4
  assert actor_lib.make_group(0, PROBLEM, [_completion(j) for j in range(4)], all_masked,
                              CONFIG) is None


class _FakeTask(Task):
  """score_many masks the truncated samples; records what it was told."""

  def __init__(self):
    self.calls = []

  def problems(self, seed):
    raise NotImplementedError

  def score(self, problem, completion_text, truncated=False, num_tokens=None):
    raise NotImplementedError

  def score_many(self, problems, texts, truncated, num_tokens):
    self.calls.append((list(truncated), list(num_tokens)))
    return [Score(0.0, 'no_answer', mask=True) if t else Score(1.0, 'correct')
            for t in truncated]


def _actor(task, capacity=4):
  stream = stream_lib.SampleStream(capacity, threading.Event())
  actor = actor_lib.Actor(engine=None, problems=iter(()), task=task,
                          encode=None, decode=lambda t: 'x', stream=stream, config=CONFIG,
                          stop=threading.Event())
  assert stream.try_acquire(4)  # what _admit does for the group
  actor._open[0] = dict(problem=PROBLEM, completions=[None] * 4)
  return actor, stream


def _finish(actor, reasons):
  for j, reason in enumerate(reasons):
    actor._collect(_completion(j, n=2 + j, reason=reason))


def test_masked_samples_release_their_credits():
  task = _FakeTask()
  actor, stream = _actor(task)
  _finish(actor, ['stop', 'length', 'stop', 'length'])
  assert task.calls == [([False, True, False, True], [2, 3, 4, 5])]  # one call per group
  assert stream.stats() == dict(queued_samples=2, owned=2)  # 2 masked credits back at once
  (group,) = stream.take(2)
  assert len(group.samples) == 2 and group.num_masked == 2 and len(group.statuses) == 4
  assert actor.counters()['samples_masked'] == 2 and actor.counters()['groups_masked'] == 0


def test_all_masked_group_is_dropped_and_releases_everything():
  actor, stream = _actor(_FakeTask())
  _finish(actor, ['length'] * 4)
  assert stream.stats() == dict(queued_samples=0, owned=0)
  assert actor.counters() == dict(groups_emitted=0, groups_dropped=0, samples_masked=4,
                                  groups_masked=1)


def test_tasks_without_score_many_are_scored_per_sample():
  class PerSample(Task):
    def problems(self, seed):
      raise NotImplementedError

    def score(self, problem, completion_text, truncated=False, num_tokens=None):
      good = completion_text == 'a' and not truncated
      return Score(float(good), 'correct' if good else 'wrong')

  scores = PerSample().score_many([PROBLEM] * 3, ['a', 'b', 'a'], [False, False, True])
  assert [s.status for s in scores] == ['correct', 'wrong', 'wrong']


# --- config ----------------------------------------------------------------------------------

def _filled(preset='tiny', **task):
  c = config_lib.load_preset(preset)
  c.task.name = 'math'
  c.model.path = '/models/m'
  c.task.train_files = ('/data/train.jsonl',)
  for k, v in task.items():
    c.task[k] = v
  return c


@pytest.mark.parametrize('key,value,message', [
    ('train_files', (), 'needs at least one training file'),
    ('train_files', ('a.jsonl', 3), 'must be a tuple of strs'),
    ('train_weights', (1.0, 2.0), 'has 2 weights for 1 train files'),
    ('train_weights', (0.0,), 'must all be > 0'),
    ('train_weights', ('x',), 'must be a tuple of floats'),
    ('test_fraction', 1.0, 'must be in [0, 1)'),
    ('verify_timeout_s', 0.0, 'must be > 0'),
    ('verify_workers', 0, 'must be >= 1'),
    ('name', 'chess', "must be one of 'arithmetic', 'reasoning', 'math', 'calculator', got 'chess'"),
])
def test_bad_math_fields_name_the_key(key, value, message):
  c = _filled()
  c.task = ml_collections.ConfigDict({**c.task.to_dict(), key: value})
  with pytest.raises(ValueError, match=f'config.task.{key}') as e:
    config_lib.validate(c)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_bad_reward_and_missing_model_and_eval_set():
  c = _filled()
  c.task.reward.truncated = 'drop'
  with pytest.raises(ValueError, match=r"^config.task.reward.truncated: must be one of") as e:
    config_lib.validate(c)
  assert '\n' not in str(e.value)
  c = _filled()
  c.model.path = ''
  with pytest.raises(ValueError, match="config.model.path: is empty: task 'math' needs"):
    config_lib.validate(c)
  c = _filled()
  c.eval.every_steps = 10
  with pytest.raises(ValueError, match='config.eval.every_steps: needs held-out problems'):
    config_lib.validate(c)
  c.task.test_fraction = 0.1
  config_lib.validate(c)


def test_every_preset_validates_once_its_placeholders_are_set():
  for preset in ('tiny', 'tools', 'qwen1p5b_8xh100', 'paper_7b'):
    c = config_lib.load_preset(preset)
    if c.task.name == 'math':
      with pytest.raises(ValueError, match='config.model.path'):
        config_lib.validate(c)  # placeholders left empty: a clear error, not a demo build
      c.model.path = '/models/m'
      c.task.train_files = ('/data/train.jsonl',)
    config_lib.validate(c)
  paper = config_lib.load_preset('paper_7b')
  assert (paper.rl.batch_size, paper.rl.group_size, paper.optimizer.lr,
          paper.generation.max_new_tokens, paper.loss.is_cap) == (1024, 8, 1e-6, 8192, 5.0)


def test_tiny_preset_is_unchanged():
  tiny, base = config_lib.load_preset('tiny').to_dict(), config_lib.base_config().to_dict()
  expected = {
      ('task', 'name'): 'arithmetic', ('task', 'ops'): ('+',), ('task', 'digits'): 2,
      ('generation', 'num_slots'): 128, ('generation', 'max_prompt_len'): 8,
      ('generation', 'max_new_tokens'): 12, ('rl', 'batch_size'): 128, ('rl', 'group_size'): 8,
      ('rl', 'max_lag'): 4, ('rl', 'total_steps'): 100_000, ('rl', 'max_time_s'): 600.0,
      ('optimizer', 'lr'): 3e-4, ('optimizer', 'max_grad_norm'): 1.0, ('train', 'seq_len'): 128}
  for section, fields in base.items():
    if not isinstance(fields, dict):
      assert tiny[section] == fields
      continue
    for field, default in fields.items():
      assert tiny[section][field] == expected.get((section, field), default), (section, field)
