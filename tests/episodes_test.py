"""Multi-turn episodes with a scripted engine and a toy environment (no model): the exact tokens,
masks, log mu and versions of an episode, its rows in a packed batch, the loss's gradient at its
observation tokens, a turn decoded across weight updates, hostile environments, the actor's
credits and metrics, and pass@1 through `evaluate`. Each test takes well under a second."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import episodes
from pipelinerl_jax import evaluation
from pipelinerl_jax import losses
from pipelinerl_jax import packing
from pipelinerl_jax.generation import api
from pipelinerl_jax.pipeline import actor as actor_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import base as tasks_base

import scripted  # tests/ is on sys.path under pytest

OBS = 9  # the toy tool's answer token


def sample_index(request: api.Request) -> int:
  """j of a request id '<group or dataset/problem>/<j>[/turn<k>]'."""
  return int(request.request_id.split('/turn')[0].rsplit('/', 1)[1])


def turn_script(request: api.Request) -> list[int]:
  """Turn k of sample j: [j, 5 + k, 1] (1 is the stop token)."""
  return [sample_index(request), 5 + request.metadata.get('turn', 1), 1]


class EchoEnv(tasks_base.Environment):
  """Turn k < turns is a tool call answered with the observation 'OBS k' (step reward 0.25; an
  error when the turn starts with 3); the last turn is judged by its first token's parity."""

  def __init__(self, turns: int = 3, fault: str = ''):
    self.turns, self.fault, self.k = turns, fault, 0

  def reset(self, problem):
    if self.fault == 'reset':
      raise RuntimeError('reset failed')
    return problem.prompt

  def step(self, turn_text, *, truncated, last):
    self.k += 1
    first = int(turn_text.split()[0])
    if self.fault == 'raise' and self.k == 2:
      raise ZeroDivisionError('tool crashed')
    if self.fault == 'garbage':
      return 'not an EnvStep'
    if self.fault == 'huge' and self.k == 1:
      return tasks_base.EnvStep(observation=' '.join(['7'] * 10_000), reward=0.25, done=False)
    if self.fault == 'never_done' or (self.k < self.turns and not last):
      return tasks_base.EnvStep(observation=f'{OBS} {self.k}', reward=0.25, done=False,
                                tool_call=True, tool_error=first == 3)
    correct = first % 2 == 1
    return tasks_base.EnvStep(observation=None, reward=float(correct), done=True,
                              score=tasks_base.Score(float(correct),
                                                     'correct' if correct else 'wrong'))


@dataclasses.dataclass
class EchoTask(scripted.ScriptedTask):
  turns: int = 3
  fault: str = ''
  turn_limit: int = 4
  budget: int = 0

  def environment(self):
    return EchoEnv(self.turns, self.fault)

  @property
  def max_turns(self):
    return self.turn_limit

  @property
  def max_episode_tokens(self):
    return self.budget


class RecordingEngine(scripted.ScriptedEngine):
  """Keeps every request submitted; `updates` {step: version} publishes weights mid-run."""

  def __init__(self, *args, updates: dict[int, int] | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.requests: list[api.Request] = []
    self.updates = updates or {}

  def submit(self, request):
    self.requests.append(request)
    super().submit(request)

  def step(self):
    if self.steps in self.updates:
      self.update_params({}, self.updates[self.steps])
    return super().step()


SAMPLING = api.SamplingParams(max_tokens=8)


def run_episodes(task: EchoTask, n: int = 2, engine=None, max_seq_len: int = 0):
  engine = engine or RecordingEngine(num_slots=8, script=turn_script)
  limits = episodes.limits_of(task, SAMPLING, max_seq_len)
  problem = tasks_base.Problem(id='p0', prompt='p0', answer='')
  started = [episodes.start(problem, task.environment(), scripted.encode, limits,
                            request_id=f'0/{j}', seed=100 + j, metadata=dict(group=0, index=j))
             for j in range(n)]
  return engine, episodes.run(engine, started, decode=scripted.decode,
                              encode_text=scripted.encode_text, limits=limits)


def test_an_episode_is_its_turns_and_observations_with_exact_masks_and_requests():
  engine, (e0, e1) = run_episodes(EchoTask(turns=3))
  assert e1.tokens == [1, 6, 1, OBS, 1, 1, 7, 1, OBS, 2, 1, 8, 1]
  assert e1.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
  assert e1.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3 + [0.0] * 2 + [-0.5] * 3
  assert e1.turns == 3 and e1.tool_calls == 2 and e1.outcome == 'done'
  assert e1.reward == 0.25 + 0.25 + 1.0 and e1.score.status == 'correct'
  assert e0.reward == 0.5 and e0.score.status == 'wrong' and e0.tokens[0] == 0
  # Turn k's request: the whole history as its prompt, chained to turn k - 1.
  turns = [r for r in engine.requests if r.metadata['index'] == 1]
  assert [r.request_id for r in turns] == ['0/1', '0/1/turn2', '0/1/turn3']
  assert [r.continues for r in turns] == [None, '0/1', '0/1/turn2']
  assert [r.continuable for r in turns] == [True, True, True]  # turn limit 4: any may go on
  assert list(turns[2].prompt_tokens) == [2, 3] + e1.tokens[:10]
  assert turns[0].seed == 101 and len({r.seed for r in turns}) == 3
  # The engine keeps nothing of a finished episode.
  assert engine.held == set() and sorted(engine.released) == ['0/0/turn3', '0/1/turn3']


def test_packed_episode_rows_train_model_tokens_only_and_one_turn_rows_are_unchanged():
  _, eps = run_episodes(EchoTask(turns=3))
  group = actor_lib.make_group(0, tasks_base.Problem('p0', 'p0', ''),
                               [episodes.completion(e) for e in eps], [e.score for e in eps],
                               scripted.actor_config(group_size=2),
                               loss_masks=[episodes.loss_mask(e) for e in eps],
                               episodes=[episodes.stats(e) for e in eps])
  batch, stats = packing.pack_samples(group.samples, seq_len=32)
  mask = np.asarray(eps[1].loss_mask, bool)
  for s, e in zip(group.samples, eps):
    r = np.flatnonzero((batch['sample_index'] == group.samples.index(s)).any(1))[0]
    at = np.flatnonzero(batch['sample_index'][r] == group.samples.index(s))[1:]  # targets 1..
    np.testing.assert_array_equal(batch['loss_mask'][r, at], mask)
    np.testing.assert_array_equal(batch['versions'][r, at][~mask], -1)
    np.testing.assert_array_equal(batch['behaviour_logprobs'][r, at][~mask], 0.0)
    np.testing.assert_array_equal(batch['advantages'][r, at][~mask], 0.0)
    np.testing.assert_array_equal(batch['advantages'][r, at][mask], s.advantage)
    np.testing.assert_array_equal(batch['targets'][r, at], e.tokens)
  assert stats.num_loss_tokens == 2 * 9 == int(batch['loss_mask'].sum())
  assert trainer_lib.token_lags(batch, 0).size == 18
  # A one-turn sample: no mask and an all-ones mask pack to the same rows, byte for byte.
  one = dict(prompt_tokens=[2, 3], completion_tokens=[4, 5, 1], behaviour_logprobs=[-1, -2, -3],
             versions=[0, 1, 1], advantage=0.5, ref_logprobs=[-1.5, -2.5, -3.5])
  a, _ = packing.pack_samples([packing.Sample(**one)], seq_len=8)
  b, _ = packing.pack_samples([packing.Sample(**one, loss_mask=[1, 1, 1])], seq_len=8)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_a_bad_loss_mask_is_refused_with_a_clear_error():
  base = dict(prompt_tokens=[2], completion_tokens=[4, 5], behaviour_logprobs=[-1, -2],
              versions=[0, 0], advantage=0.0)
  with pytest.raises(ValueError, match='loss_mask has length 1'):
    packing.Sample(**base, loss_mask=[1])
  with pytest.raises(ValueError, match='only 0 .* and 1'):
    packing.Sample(**base, loss_mask=[1, 2])


@pytest.mark.parametrize('kind', ['pipelinerl', 'ppo', 'gspo'])
def test_the_loss_ignores_observation_tokens(kind):
  """d loss / d logits is exactly zero at observation positions (and not at model tokens),
  with the entropy bonus and the KL term on."""
  rng = np.random.default_rng(0)
  t, v = 10, 7
  mask = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0], np.float32)  # prompt, turn, obs, turn, pad
  batch = dict(targets=jnp.asarray(rng.integers(0, v, (1, t)), jnp.int32),
               segment_ids=jnp.asarray([[1] * 9 + [0]], jnp.int32),
               loss_mask=jnp.asarray(mask[None]),
               behaviour_logprobs=jnp.asarray(np.where(mask, -1.7, 0.0)[None], jnp.float32),
               advantages=jnp.asarray(np.where(mask, 0.8, 0.0)[None], jnp.float32),
               ref_logprobs=jnp.asarray(np.where(mask, -2.0, 0.0)[None], jnp.float32))
  cfg = config_lib.LossConfig(kind=kind, entropy_coef=0.01, kl_coef=0.1)

  def loss(logits_RxTxV):
    logp_RxTxV = jax.nn.log_softmax(logits_RxTxV)
    logp_RxT = jnp.take_along_axis(logp_RxTxV, batch['targets'][..., None], -1)[..., 0]
    entropy_RxT = -jnp.sum(jnp.exp(logp_RxTxV) * logp_RxTxV, -1)
    return losses.policy_loss(logp_RxT, entropy_RxT, batch, cfg, num_samples=1,
                              num_tokens=mask.sum())[0]

  grads_TxV = np.asarray(jax.grad(loss)(jnp.asarray(rng.normal(size=(1, t, v)),
                                                    jnp.float32)))[0]
  assert np.all(grads_TxV[mask == 0] == 0.0)
  assert np.all(np.abs(grads_TxV[mask == 1]).sum(-1) > 0)


def test_a_turn_decoded_across_weight_updates_carries_per_token_versions():
  """Versions 1 and 2 are published at engine steps 2 and 5, while turns are decoding: each
  model token has the version of the step that drew it, each observation token the version of
  the token before it; the lag and the versions metric count model tokens only."""
  engine = RecordingEngine(num_slots=8, script=turn_script, updates={2: 1, 5: 2})
  _, (e0, _) = run_episodes(EchoTask(turns=3), engine=engine)
  # Turn 1 drawn at steps 1-3 (update 1 applies at step 3), turn 2 at 4-6 (update 2 at 6),
  # turn 3 at 7-9.
  assert e0.versions == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
  assert episodes.stats(e0).versions == 3
  sample = packing.Sample(prompt_tokens=e0.prompt_tokens, completion_tokens=e0.tokens,
                          behaviour_logprobs=e0.logprobs, versions=e0.versions, advantage=1.0,
                          loss_mask=e0.loss_mask)
  batch, _ = packing.pack_samples([sample], seq_len=16)
  lags = trainer_lib.token_lags(batch, step=2)
  np.testing.assert_array_equal(np.sort(lags), np.sort(
      [2 - v for v, m in zip(e0.versions, e0.loss_mask) if m]))


@pytest.mark.parametrize('fault,outcome,status,masked', [
    ('raise', 'env_error', 'unparsable', False),
    ('garbage', 'env_error', 'unparsable', False),
    ('reset', 'env_error', 'unparsable', True),
    ('huge', 'cut', 'no_answer', False),
    ('never_done', 'turn_limit', 'no_answer', False),
])
def test_a_hostile_environment_ends_its_episode_with_a_clear_outcome(fault, outcome, status,
                                                                    masked):
  engine, eps = run_episodes(EchoTask(turns=3, fault=fault, turn_limit=4), max_seq_len=40)
  for e in eps:
    assert e.outcome == outcome and e.score.status == status and e.score.mask == masked
  if outcome == 'env_error':
    assert all(e.reward == 0.0 for e in eps)
  if fault == 'never_done':
    assert all(e.turns == 4 for e in eps)
  if fault == 'huge':  # not fed: the episode ends at the model's first turn
    assert all(e.tokens == [e.tokens[0], 6, 1] and e.loss_mask == [1, 1, 1] for e in eps)
  assert engine.held == set() and engine.num_unfinished == 0


def test_the_budget_bounds_an_episode_and_its_last_turn():
  """Budget 9 after the prompt: turn 1 (3) + obs (2) leaves 4, turn 2 (3) + obs (2) would leave
  -1: so turn 2 is asked as the last one and gets at most 4 tokens."""
  engine, (e0, _) = run_episodes(EchoTask(turns=5, budget=9))
  assert e0.turns == 2 and e0.outcome == 'done' and len(e0.tokens) == 8
  turn2 = [r for r in engine.requests if r.request_id == '0/0/turn2'][0]
  assert turn2.sampling.max_tokens == 4


def test_the_actor_runs_multi_turn_groups_within_its_credits_and_logs_episode_metrics():
  """Episodes through the actor and trainer loops: never more than H requests in the engine,
  the trained samples carry their loss masks, the records their episode metrics, and an
  environment that raises in some episodes costs those episodes only."""

  class SomeFaulty(EchoTask):
    def environment(self):
      self.made = getattr(self, 'made', 0) + 1
      return EchoEnv(self.turns, 'raise' if self.made % 4 == 0 else '')

  engine = RecordingEngine(num_slots=6, script=turn_script)
  result = scripted.run_loops(engine, scripted.trainer_config(batch_size=4, total_steps=4),
                              scripted.actor_config(group_size=2, num_slots=6), capacity=8,
                              task=SomeFaulty(turns=3))
  assert engine.max_unfinished <= 6
  samples = [s for g in result.trainer.groups for s in g.samples]
  assert len(samples) == 16 and all(s.loss_mask is not None for s in samples)
  assert all(s.loss_mask[0] == 1 and s.loss_mask[-1] == 1 for s in samples)
  records = result.records
  assert all('episode/turns_mean' in r for r in records)
  assert any(r['episode/frac_env_error'] > 0 for r in records)
  assert all(r['episode/frac_done'] + r['episode/frac_env_error'] == 1.0 for r in records)
  assert all(r['lag_max'] >= 0 for r in records)


def test_one_turn_tasks_log_no_episode_metrics():
  engine = scripted.ScriptedEngine(num_slots=8)
  result = scripted.run_loops(engine, scripted.trainer_config(batch_size=4, total_steps=2),
                              scripted.actor_config(group_size=2, num_slots=8), capacity=8)
  assert not any(k.startswith('episode/') for r in result.records for k in r)
  assert engine.released == [] and engine.held == set()


def test_evaluate_runs_episodes_for_a_multi_turn_task():
  engine = RecordingEngine(num_slots=8, script=turn_script)
  problems = [tasks_base.Problem(id=f'q{i}', prompt=f'q{i}', answer='') for i in range(3)]
  result = evaluation.evaluate(engine, {'toy': problems}, EchoTask(turns=2),
                               encode=scripted.encode, decode=scripted.decode, sampling=SAMPLING,
                               k=2, seed=0, encode_text=scripted.encode_text)
  # Sample j's last turn starts with j: sample 1 of each problem is correct.
  assert result['pass@1'] == 0.5 and result['pass@2'] == 1.0
  assert all(s['turns'] == 2 and s['outcome'] == 'done' for s in result['samples'])
  assert {r.request_id for r in engine.requests} >= {'toy/q0/0', 'toy/q0/0/turn2'}
  with pytest.raises(ValueError, match='needs encode_text'):
    evaluation.evaluate(RecordingEngine(num_slots=8, script=turn_script), {'toy': problems},
                        EchoTask(turns=2), encode=scripted.encode, decode=scripted.decode,
                        sampling=SAMPLING, k=1, seed=0)
