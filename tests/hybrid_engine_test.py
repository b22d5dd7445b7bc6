"""The JAX engine on a hybrid (Qwen3.5: Gated DeltaNet layers among gated attention layers): its
log mu against the trainer's log pi for whole sequences (fp32, within 1e-4) with no update and
across an update with recompute; a prompt's samples starting from one saved state, chunked
prefill, preemption, sync_every and slots loaded again after others changing no token; a
continued turn starting from its held state even when its stop is seen late; after an update, no
request starting from a state written under the older version. A Qwen3.5-MoE's recorded routes,
replayed by the trainer, give its log mu; a hybrid's adapters are served unmerged.

One engine shape (H = 4 slots, S = 48, pages of 4, one prefill length bucket), so the tests share
their compiled steps; more requests than slots, so every run loads sequences into slots that
others have used.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine as engine_lib
from pipelinerl_jax.models import transformer as tfm
import paged_engine_test  # tests/ is on sys.path
from qwen35_test import HYBRID, hybrid_params  # tests/ is on sys.path

S = 48
CONFIG = engine_lib.EngineConfig(num_slots=4, max_seq_len=S, page_size=4, min_prefill_len=S)
_rng = np.random.default_rng(3)
PROMPT = [int(t) for t in _rng.integers(1, HYBRID.vocab_size, 10)]  # 2 full pages + 1 position
OTHER = [int(t) for t in _rng.integers(1, HYBRID.vocab_size, 7)]


@pytest.fixture(scope='module')
def params_a():
  return hybrid_params(0)


@pytest.fixture(scope='module')
def params_b():
  return hybrid_params(5)


def requests(n_group=3):
  """A group of samples of one prompt (the last greedy) and three requests of their own: six
  sequences for four slots."""
  sp = lambda t, n: api.SamplingParams(temperature=t, max_tokens=n)
  group = [api.Request(f'g{i}', PROMPT, sp(1.0 if i < n_group - 1 else 0.0, 9 + i), seed=i)
           for i in range(n_group)]
  return group + [api.Request('solo', OTHER, sp(0.0, 11), seed=7),
                  api.Request('long', OTHER + PROMPT, sp(1.0, 14), seed=8),
                  api.Request('short', PROMPT[:5], sp(1.0, 6), seed=9)]


def run(params, config=CONFIG, new_params=None, k=3, reqs=None, model=HYBRID):
  """paged_engine_test's run on a hybrid, which must also give back every saved state."""
  done, stats = paged_engine_test.run(params, config, new_params, k, reqs or requests(), model)
  assert stats['kv_pages_free'] == stats['kv_pages']  # every page back
  assert stats['saved_states_free'] == stats['saved_states']  # every saved state back
  return done, stats


def assert_same(a, b, atol=1e-5):
  assert set(a) == set(b)
  for rid in a:
    np.testing.assert_array_equal(a[rid].tokens, b[rid].tokens, err_msg=rid)
    np.testing.assert_allclose(a[rid].logprobs, b[rid].logprobs, atol=atol, err_msg=rid)
    np.testing.assert_array_equal(a[rid].versions, b[rid].versions, err_msg=rid)


_ROWS = 8  # the trainer's batch: one compile for every set of completions


@functools.partial(jax.jit, static_argnums=1)
def _trainer_logprobs(params, model, tokens, segments, routes=None, replay=None):
  t = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
  return tfm.token_logprobs_routed(params, model, tokens, jnp.roll(tokens, -1, 1), positions,
                                   segments, routes_RxTxLsxXk=routes, replay_RxT=replay)[0]


def trainer_logprobs(params, completions, model=HYBRID):
  """log pi of each completion's tokens under `params`, as the trainer computes it (whole
  sequences, the chunked delta rule), one padded batch; for an MoE model each completion token
  replays the experts the engine recorded for it."""
  tokens, segments = np.zeros((_ROWS, S), np.int32), np.zeros((_ROWS, S), np.int32)
  routes = replay = None
  if model.moe_layers:
    routes = np.zeros((_ROWS, S, len(model.moe_layers), model.num_experts_per_tok), np.int32)
    replay = np.zeros((_ROWS, S), bool)
  for i, c in enumerate(completions):
    seq = list(c.prompt_tokens) + c.tokens.tolist()
    tokens[i, :len(seq)], segments[i, :len(seq)] = seq, 1
    if routes is not None:  # at the position whose target is the token
      at = slice(len(c.prompt_tokens) - 1, len(seq) - 1)
      routes[i, at], replay[i, at] = c.routes, True
  logp = np.asarray(_trainer_logprobs(params, model, tokens, segments, routes, replay))
  return [logp[i, len(c.prompt_tokens) - 1:len(c.prompt_tokens) - 1 + len(c.tokens)]
          for i, c in enumerate(completions)]


@pytest.fixture(scope='module')
def plain(params_a):
  return run(params_a)


def test_log_mu_equals_the_trainers_log_pi_without_and_across_a_recompute_update(
    params_a, params_b, plain):
  """Prefill (chunked form) hands each sequence's state to decode's recurrent steps; a
  recompute update loads every sequence again under the new params. Each token's log mu equals
  log pi of the params of its version, whole sequences, fp32."""
  out, stats = plain
  assert stats['states_saved'] >= 1 and stats['prompt_pages_shared'] == 2 * 2
  for c, ref in zip(out.values(), trainer_logprobs(params_a, list(out.values()))):
    np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, err_msg=c.request_id)
  config = dataclasses.replace(CONFIG, recompute_kv=True)
  out, stats = run(params_a, config, params_b, k=4)
  assert stats['kv_recomputes'] >= 4
  completions = list(out.values())
  under_a, under_b = (trainer_logprobs(p, completions) for p in (params_a, params_b))
  mixed = 0
  for c, a, b in zip(completions, under_a, under_b):
    old = c.versions == 0
    mixed += bool(old.any() and not old.all())
    np.testing.assert_allclose(c.logprobs, np.where(old, a, b), atol=1e-4, err_msg=c.request_id)
  assert mixed >= 3  # decoded across the update
  assert float(np.max(np.abs(under_a[0] - under_b[0]))) > 0.1  # (the two params differ)


def test_shared_states_chunked_prefill_preemption_and_sync_change_no_token(params_a, plain):
  """The samples of a prompt start from one saved copy of the state after its shared pages;
  loading each prompt whole, in chunks of 3 between decode steps, waiting for pages and being
  preempted and loaded again, or collecting tokens 4 steps late, gives the same tokens."""
  base, stats = plain
  alone, alone_stats = run(params_a, dataclasses.replace(CONFIG, share_prompts=False))
  assert_same(alone, base)
  assert 'states_saved' not in alone_stats
  assert alone_stats['prefill_tokens'] - stats['prefill_tokens'] == 2 * 8  # 2 readers, 2 pages
  for config in (dataclasses.replace(CONFIG, prefill_chunk=3, sync_every=1),
                 dataclasses.replace(CONFIG, sync_every=4)):
    assert_same(run(params_a, config)[0], base)
  short, stats = run(params_a, dataclasses.replace(CONFIG, num_pages=12, sync_every=1))
  assert stats['preemptions'] > 0
  assert_same(short, base)


def turn(rid, prompt, n=8, continues=None, continuable=True):
  return api.Request(rid, prompt, api.SamplingParams(temperature=0.0, max_tokens=n), seed=11,
                     continues=continues, continuable=continuable)


def drain(eng):
  done = {}
  while eng.num_unfinished:
    done.update((c.request_id, c) for c in eng.step())
  return done


@pytest.mark.parametrize('sync_every', [0, 4])
def test_a_continued_turn_starts_from_the_state_its_turn_ended_with(params_a, sync_every):
  """Turn 1 ends on a stop id drawn mid-turn (with sync_every 4 the host sees it steps later:
  the slot parked itself on the device, so its state is the one after the turn's last input);
  turn 2 prefills only the observation, from that saved state and the held pages, and equals a
  fresh engine given the whole history."""
  free, _ = run(params_a, reqs=[turn('probe', PROMPT, continuable=False)])
  drawn = free['probe'].tokens.tolist()
  stop = next(t for i, t in enumerate(drawn) if i >= 2 and t not in drawn[:i])
  config = dataclasses.replace(CONFIG, sync_every=sync_every, eos_token_ids=(stop,))
  observation = [5, 6, 7]
  with engine_lib.JaxEngine(HYBRID, params_a, config) as eng:
    eng.submit(turn('e', PROMPT))
    first = drain(eng)['e']
    assert first.tokens[-1] == stop and len(first.tokens) < 8
    history = PROMPT + first.tokens.tolist() + observation
    before = eng.stats()['prefill_tokens']
    eng.submit(turn('e/2', history, continues='e', continuable=False))
    second = drain(eng)['e/2']
    stats = eng.stats()
    assert stats['kv_held_reused'] == 1 and stats['states_saved'] >= 1
    assert stats['prefill_tokens'] - before == len(observation)  # the stop id and the rest
    assert stats['saved_states_free'] == stats['saved_states']
  fresh, _ = run(params_a, config, reqs=[turn('h', history, continuable=False)])
  np.testing.assert_array_equal(second.tokens, fresh['h'].tokens)
  np.testing.assert_allclose(second.logprobs, fresh['h'].logprobs, atol=1e-5)


def test_no_state_of_an_older_version_starts_a_request_submitted_after_an_update(
    params_a, params_b):
  """Kept policy: a group's samples go on from the state and pages written under version 0;
  a request for the same prompt submitted after the update to version 1 does not start from
  the group's saved prompt state (it carries version 0): it decodes what a fresh engine under
  version 1 decodes."""
  late = api.Request('late', PROMPT, api.SamplingParams(temperature=0.0, max_tokens=6), seed=3)
  with engine_lib.JaxEngine(HYBRID, params_a, CONFIG) as eng:
    for r in requests()[:3]:
      eng.submit(r)
    for _ in range(3):
      eng.step()
    assert eng.stats()['prompt_pages_shared'] > 0 and eng.stats()['busy_slots'] == 3
    eng.update_params(params_b, 1)
    eng.step()
    eng.submit(late)
    done = drain(eng)
    shared = eng.stats()['prompt_pages_shared']
  assert shared == 2 * 2  # the group's two readers only: 'late' shared nothing
  assert all(c.versions[0] == 0 and c.versions[-1] == 1 for k, c in done.items() if k != 'late')
  fresh, _ = run(params_b, reqs=[late])
  np.testing.assert_array_equal(done['late'].tokens, fresh['late'].tokens)
  np.testing.assert_allclose(done['late'].logprobs, fresh['late'].logprobs, atol=1e-5)
  assert (done['late'].versions == 1).all()


# Qwen3.5-MoE: the same hybrid, every MLP 8 experts (2 a token) beside a shared expert.
HYBRID_MOE = dataclasses.replace(
    HYBRID, intermediate_size=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    norm_topk_prob=True, shared_expert_intermediate_size=16,
    moe_layers=tuple(range(HYBRID.num_layers)), architecture='Qwen3_5MoeForCausalLM')


def test_a_hybrid_moe_records_routes_the_trainer_replays_to_its_log_mu():
  """Qwen3.5-MoE: each token's experts in every MoE layer are recorded as it is drawn (from the
  prefill for the first, the recurrent step after): the experts the trainer's router picks at
  lag 0 in fp32, and the trainer's log pi, replaying them over whole sequences, equals log mu."""
  params = jax.tree.map(lambda x: 4 * x, tfm.init_params(HYBRID_MOE, jax.random.PRNGKey(0)))
  out, _ = run(params, model=HYBRID_MOE)
  completions = list(out.values())
  for c in completions:
    assert c.routes.shape == (len(c.tokens), 4, 2), c.request_id
  for c, ref in zip(completions, trainer_logprobs(params, completions, HYBRID_MOE)):
    np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, err_msg=c.request_id)
  # At lag 0 in fp32 they are the experts the trainer's own router picks.
  c = completions[0]
  seq = jnp.asarray([list(c.prompt_tokens) + c.tokens.tolist()])
  _, _, own = tfm.token_logprobs_routed(params, HYBRID_MOE, seq, jnp.roll(seq, -1, 1),
                                        jnp.arange(seq.shape[1])[None], jnp.ones_like(seq))
  drawn_at = np.asarray(own.own)[:, 0, len(c.prompt_tokens) - 1:-1]  # [Ls, C, Xk]
  np.testing.assert_array_equal(np.sort(drawn_at, -1), np.sort(np.moveaxis(c.routes, 0, 1), -1))


def test_a_hybrid_with_adapters_is_served_unmerged_as_the_trainer_scores_it(params_a):
  """LoRA on a hybrid: the base and random adapters on every projection LoRA covers (the Gated
  DeltaNet layers' too), served unmerged; log mu equals log pi of the same `lora.Adapted`."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.models.layers import lora as lora_lib
  from lora_test import random_adapters  # tests/ is on sys.path
  every = config_lib.LoraSettings(rank=2, alpha=4.0, targets=config_lib.LORA_TARGETS)
  adapted = lora_lib.Adapted(params_a, random_adapters(HYBRID, every, 2, b_scale=0.3),
                             every.scale)
  out, _ = run(adapted)
  completions = list(out.values())
  under_base = trainer_logprobs(params_a, completions)
  for c, ref, base in zip(completions, trainer_logprobs(adapted, completions), under_base):
    np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, err_msg=c.request_id)
  assert max(float(np.max(np.abs(r - b))) for r, b in zip(
      trainer_logprobs(adapted, completions), under_base)) > 0.1  # (the adapters matter)
