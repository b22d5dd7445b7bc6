"""The paged KV cache: reads, the page allocator, and the engine on pools of every shape.

One model config, S = 64 and a single prefill length bucket (min_prefill_len = S) as in
generation_test.py, so the two modules share compiled steps. Page size 4 splits a sequence over
up to 16 pages; page size S is the dense layout (one page per slot).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import episodes
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation import jax_engine as engine_lib
from pipelinerl_jax.generation import paging
from pipelinerl_jax.models.layers import attention as attention_lib
from pipelinerl_jax.models.layers import paged_attention as paged
from pipelinerl_jax.models import transformer
from pipelinerl_jax.tasks import base as tasks_base

CFG = transformer.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8)
S = 64
DENSE = engine_lib.EngineConfig(num_slots=4, max_seq_len=S, min_prefill_len=S, page_size=S)
PAGED = dataclasses.replace(DENSE, page_size=4)


def make_params(seed):
  # As in generation_test: x15 separates the logits so argmax is robust to rounding.
  params = transformer.init_params(CFG, jax.random.PRNGKey(seed))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * 15.0 if path[-1].key in ('kernel', 'embedding') else x, params)


@pytest.fixture(scope='module')
def params_a():
  return make_params(0)


@pytest.fixture(scope='module')
def params_b():
  return make_params(1)


_rng = np.random.default_rng(7)
PROMPT = list(_rng.integers(0, CFG.vocab_size, 10))  # two full pages of 4 and a partial one
OTHER = list(_rng.integers(0, CFG.vocab_size, 5))


def requests():
  """A group of three samples of one prompt (one greedy), and a greedy request of its own."""
  sp = lambda t, n: api.SamplingParams(temperature=t, max_tokens=n)
  return [api.Request('g0', PROMPT, sp(1.0, 9), seed=1), api.Request('g1', PROMPT, sp(1.0, 7),
                                                                      seed=2),
          api.Request('g2', PROMPT, sp(0.0, 8), seed=3), api.Request('solo', OTHER, sp(0.0, 9),
                                                                      seed=4)]


def run(params, config, new_params=None, k=3, reqs=None, model=CFG):
  """Every request to completion; `new_params` (version 1) is applied after k token steps."""
  with engine_lib.JaxEngine(model, params, config) as eng:
    for r in reqs or requests():
      eng.submit(r)
    done = {}
    for step in range(1000):
      if new_params is not None and step == k:
        eng.update_params(new_params, 1)
      done.update((c.request_id, c) for c in eng.step())
      if not eng.num_unfinished:
        break
    return done, eng.stats()


def assert_same(a, b, atol=1e-5):
  assert set(a) == set(b)
  for rid in a:
    np.testing.assert_array_equal(a[rid].tokens, b[rid].tokens, err_msg=rid)
    np.testing.assert_allclose(a[rid].logprobs, b[rid].logprobs, atol=atol, err_msg=rid)
    np.testing.assert_array_equal(a[rid].versions, b[rid].versions, err_msg=rid)


# --- reads ----------------------------------------------------------------------------------


def random_pool(rng, layers=2, pages=24, heads=2, page_size=4, dh=8):
  shape = (layers, pages, heads, page_size, dh)
  return paged.PagedKVCache(jnp.asarray(rng.normal(size=shape), jnp.float32),
                            jnp.asarray(rng.normal(size=shape), jnp.float32))


def test_xla_read_is_dense_attention_over_the_rows_pages():
  rng = np.random.default_rng(0)
  pool = random_pool(rng)
  r, t, w, z = 3, 3, 5, 4
  table = jnp.asarray(rng.permutation(np.arange(1, 24))[:r * w].reshape(r, w), jnp.int32)
  positions = jnp.asarray([[3, 4, 5], [9, 10, 11], [17, 18, 19]], jnp.int32)
  q = jnp.asarray(rng.normal(size=(r, t, 2, 2, 8)) * 3, jnp.float32)
  out = paged.attend(q, pool, jnp.int32(1), table, positions)
  # The same keys laid out densely: position p of row r is page table[r, p // Z], offset p % Z.
  dense = lambda x: x[1][table].transpose(0, 1, 3, 2, 4).reshape(r, w * z, 2, 8)
  visible = jnp.arange(w * z)[None, None] <= positions[:, :, None]
  ref = attention_lib.dense(q, dense(pool.k), dense(pool.v), visible, jnp.float32)
  np.testing.assert_allclose(out, ref, atol=1e-6)


def test_pallas_kernel_matches_the_xla_read():
  """The GPU kernel's plumbing (kv heads folded into pages, layer offsets, pre-scaled q), run
  in Pallas' interpreter on CPU."""
  rng = np.random.default_rng(1)
  pool = random_pool(rng)
  table = jnp.asarray(rng.permutation(np.arange(1, 24))[:12].reshape(3, 4), jnp.int32)
  positions = jnp.asarray([[0], [6], [15]], jnp.int32)  # lengths 1, 7, 16 (a whole table)
  q = jnp.asarray(rng.normal(size=(3, 1, 2, 2, 8)), jnp.float32)
  ref = paged.attend(q, pool, jnp.int32(1), table, positions)
  out = paged.attend(q, pool, jnp.int32(1), table, positions, implementation='pallas',
                     interpret=True)
  np.testing.assert_allclose(out, ref, atol=1e-5)


def test_cudnn_table_width_splits_the_pool_into_whole_tables():
  assert paged.cudnn_table_width(24 * 20608, 256, 80) == 1932  # B = 256: no padding rows
  for blocks, rows, width in ((96, 4, 5), (24 * 20608, 1024, 80), (64, 3, 8)):
    w = paged.cudnn_table_width(blocks, rows, width)
    assert w >= width and blocks % w == 0 and blocks // w >= rows
  assert paged.cudnn_table_width(7, 2, 4) is None  # 7 blocks: no width >= 4 gives 2 rows


def test_writes_past_a_table_land_on_the_trash_page():
  table = jnp.asarray([[3, 5]], jnp.int32)
  page, offset = paged.locate(table, jnp.asarray([[0, 5, 7, 8, 1 << 30]], jnp.int32), 4)
  np.testing.assert_array_equal(page, [[3, 5, 5, 0, 0]])
  np.testing.assert_array_equal(offset, [[0, 1, 3, 0, 0]])


# --- allocator and budget ------------------------------------------------------------------------


def test_page_pool_counts_references():
  pool = paging.PagePool(6)
  a = pool.take(3)
  assert 0 not in a and pool.num_free == 2  # page 0 is the trash page
  pool.share(a[:2])                          # a second reader of two pages
  pool.release(a)
  assert pool.num_free == 3                  # the shared two are still held
  pool.release(a[:2])
  assert pool.num_free == 5 and pool.peak_in_use == 3
  with pytest.raises(RuntimeError, match='6 pages asked, 5 free'):
    pool.take(6)


def test_pool_size_rule():
  page = budget.kv_page_bytes(2, 2, 8, 4, 'float32')
  assert page == 2 * 2 * 2 * 8 * 4 * 4
  rule = dict(num_slots=8, max_seq_len=64, page_size=4, page_bytes=page)
  assert budget.kv_pool_pages(**rule) == 1 + 8 * 16                        # every slot full
  assert budget.kv_pool_pages(**rule, free_bytes=40 * page) == 20         # half of what's free
  assert budget.kv_pool_pages(**rule, pool_mb=1) == (1 << 20) // page
  with pytest.raises(ValueError, match='generation.kv_pool_mb=0: a pool of 10 pages'):
    budget.kv_pool_pages(**rule, free_bytes=20 * page)


# --- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def dense_with_update(params_a, params_b):
  return run(params_a, DENSE, params_b)[0]


def test_paged_equals_dense_with_an_update_mid_sequence(params_a, params_b, dense_with_update):
  out = dense_with_update
  for c in out.values():
    assert list(c.versions[:3]) == [0, 0, 0] and c.versions[-1] == 1  # decoded across it
  assert not np.array_equal(out['g0'].tokens[:7], out['g1'].tokens)  # the samples diverge
  for config in (PAGED, dataclasses.replace(PAGED, share_prompts=False, sync_every=1),
                 dataclasses.replace(PAGED, sync_every=4)):
    paged_out, stats = run(params_a, config, params_b)
    assert_same(paged_out, out)
    assert stats['kv_pages_free'] == stats['kv_pages']  # every page back


def test_samples_of_a_prompt_share_its_full_pages(params_a):
  shared, st = run(params_a, PAGED)
  alone, st_alone = run(params_a, dataclasses.replace(PAGED, share_prompts=False))
  assert_same(shared, alone)
  # The prompt's context is 9 positions: 2 full pages written once and read by 3 samples; each
  # sample writes its partial page (1 position) itself.
  assert st['prompt_pages_shared'] == 2 * 2 and 'prompt_pages_shared' not in st_alone
  assert st_alone['prefill_tokens'] - st['prefill_tokens'] == 2 * 8
  assert st['kv_pages_peak'] == st_alone['kv_pages_peak'] - 2 * 2


def test_a_short_pool_makes_requests_wait_and_changes_nothing(params_a):
  base, _ = run(params_a, PAGED)
  # 12 pages (and the trash page): two sequences of up to 5 pages at a time, never four.
  out, stats = run(params_a, dataclasses.replace(PAGED, num_pages=13, sync_every=1))
  assert_same(out, base)
  assert stats['kv_pages'] == stats['kv_pages_free'] == 12
  # A pool this short preempts: sequences that cannot grow wait and are loaded again.
  out, stats = run(params_a, dataclasses.replace(PAGED, num_pages=8, sync_every=1))
  assert_same(out, base)
  assert stats['preemptions'] > 0 and stats['kv_pages_free'] == stats['kv_pages']
  with engine_lib.JaxEngine(CFG, params_a, dataclasses.replace(PAGED, num_pages=4)) as eng:
    with pytest.raises(ValueError, match=r'needs 5 KV pages of 4; the pool has 3 '
                                         r'\(generation.kv_pool_mb\)'):
      eng.submit(requests()[0])


def test_pages_return_on_abort_and_recompute(params_a, params_b):
  config = dataclasses.replace(PAGED, num_slots=2, recompute_kv=True)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    for r in requests():
      eng.submit(r)
    eng.step()
    eng.step()
    held = eng.stats()['kv_pages'] - eng.stats()['kv_pages_free']
    assert held > 0 and eng.stats()['busy_slots'] == 2
    eng.abort(['g0', 'solo'])  # one in a slot, one pending
    assert eng.stats()['kv_pages_free'] > eng.stats()['kv_pages'] - held
    eng.update_params(params_b, 1)  # reloads the sequence left in flight under params_b
    done = {}
    while eng.num_unfinished:
      done.update((c.request_id, c) for c in eng.step())
    assert set(done) == {'g1', 'g2'}
    stats = eng.stats()
    assert stats['kv_recomputes'] >= 1 and stats['kv_pages_free'] == stats['kv_pages']
  assert eng.num_unfinished == 0


def test_a_reader_takes_over_a_prompt_whose_writer_is_aborted_while_loading(params_a):
  base, _ = run(params_a, PAGED)
  config = dataclasses.replace(PAGED, prefill_chunk=4, sync_every=1)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    for r in requests():
      eng.submit(r)
    eng.step()  # g0 writes the prompt's first chunk; g1, g2 wait for its pages
    eng.abort(['g0'])
    done = {}
    for _ in range(100):  # without a new writer, g1 and g2 would wait forever
      done.update((c.request_id, c) for c in eng.step())
  assert_same(done, {k: v for k, v in base.items() if k != 'g0'})


def test_chunked_prefill_interleaves_with_decoding_and_equals_one_prefill(params_a):
  long_prompt = list(np.random.default_rng(3).integers(0, CFG.vocab_size, 41))
  reqs = [api.Request('short', OTHER, api.SamplingParams(temperature=1.0, max_tokens=20),
                      seed=5),
          api.Request('long', long_prompt, api.SamplingParams(temperature=1.0, max_tokens=6),
                      seed=6)]
  whole, _ = run(params_a, PAGED, reqs=reqs)
  config = dataclasses.replace(PAGED, prefill_chunk=8, sync_every=1)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    eng.submit(reqs[0])
    eng.step()
    eng.submit(reqs[1])
    loading_steps = 0
    done = {}
    while eng.num_unfinished:
      before = eng.stats()
      done.update((c.request_id, c) for c in eng.step())
      after = eng.stats()
      if after['prefill_calls'] > before['prefill_calls'] and loading_steps < 5:
        loading_steps += 1  # a chunk of the long prompt in this step ...
        assert after['decode_steps'] == before['decode_steps'] + 1  # ... and a token step
    assert loading_steps == 5  # 40 positions of context in chunks of 8
  assert_same(done, whole)


# --- multi-turn: a continuation takes over the previous turn's pages ---------------------------

OBSERVATION = [7, 8, 9]


def drain(eng, done=None):
  done = {} if done is None else done
  for _ in range(1000):
    if not eng.num_unfinished:
      break
    done.update((c.request_id, c) for c in eng.step())
  return done


def turn(rid, prompt, n=6, continues=None, continuable=True, seed=11):
  return api.Request(rid, prompt, api.SamplingParams(temperature=0.0, max_tokens=n), seed=seed,
                     continues=continues, continuable=continuable)


@pytest.mark.parametrize('sync_every', [0, 4])
def test_a_continued_turn_equals_a_fresh_prefill_of_its_history(params_a, sync_every):
  """Turn 2 of an episode prefills only the observation over turn 1's held pages: its tokens
  and log mu equal those of a fresh engine given the whole history, and after `release` every
  page is free."""
  config = dataclasses.replace(PAGED, sync_every=sync_every)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    eng.submit(turn('e', PROMPT))
    first = drain(eng)['e']
    assert eng.stats()['kv_pages_held'] > 0
    history = PROMPT + first.tokens.tolist() + OBSERVATION
    before = eng.stats()['prefill_tokens']
    eng.submit(turn('e/turn2', history, continues='e'))
    second = drain(eng)['e/turn2']
    stats = eng.stats()
    assert stats['kv_held_reused'] == 1
    assert stats['kv_held_positions_reused'] == len(PROMPT) + len(first.tokens) - 1
    # Prefilled: turn 1's last token and the observation but its last token (the first input).
    assert stats['prefill_tokens'] - before == 1 + len(OBSERVATION) - 1
    eng.release('e/turn2')
    eng.step()  # (a release takes effect at the next step)
    stats = eng.stats()
    assert stats['kv_pages_free'] == stats['kv_pages'] and stats['kv_pages_held'] == 0
  fresh, _ = run(params_a, config, reqs=[turn('h', history, continuable=False)])
  np.testing.assert_array_equal(second.tokens, fresh['h'].tokens)
  np.testing.assert_allclose(second.logprobs, fresh['h'].logprobs, atol=1e-5)


def test_held_pages_go_first_under_pool_pressure_and_corrupt_nobody(params_a):
  """A pool of 7 pages: episode e's turn 1 holds its pages while two other requests arrive;
  they evict them rather than wait, decode what a roomy pool gives them, and e's turn 2 then
  prefills its whole history (the same tokens as a fresh engine). A history that does not
  start with the held tokens is prefilled whole too. No page is lost."""
  config = dataclasses.replace(PAGED, num_pages=8, sync_every=1)  # (compiled above)
  others = [turn('x', OTHER, n=9, continuable=False, seed=4),
            turn('y', PROMPT[:6], n=9, continuable=False, seed=5)]
  alone, _ = run(params_a, PAGED, reqs=others)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    eng.submit(turn('e', PROMPT))
    first = drain(eng)['e']
    for r in others:
      eng.submit(r)
    out = drain(eng)
    assert eng.stats()['kv_held_evicted'] == 1 and eng.stats()['kv_pages_held'] == 0
    assert_same(out, alone)
    history = PROMPT + first.tokens.tolist() + OBSERVATION
    eng.submit(turn('e/turn2', history, continues='e'))
    second = drain(eng)['e/turn2']
    assert eng.stats().get('kv_held_reused', 0) == 0
    # A mismatched history: the held KV is dropped, the whole history prefilled.
    eng.submit(turn('f', PROMPT))
    drain(eng)
    eng.submit(turn('f/turn2', OTHER + OBSERVATION, continues='f', continuable=False))
    mismatched = drain(eng)['f/turn2']
    stats = eng.stats()
    assert stats['kv_held_mismatch'] == 1
    eng.release('e/turn2')
    eng.step()  # (a release takes effect at the next step)
    stats = eng.stats()
    assert stats['kv_pages_free'] == stats['kv_pages']
  fresh, _ = run(params_a, PAGED, reqs=[turn('h', history, continuable=False),
                                        turn('m', OTHER + OBSERVATION, continuable=False)])
  np.testing.assert_array_equal(second.tokens, fresh['h'].tokens)
  np.testing.assert_array_equal(mismatched.tokens, fresh['m'].tokens)


def test_held_pages_are_freed_by_a_recompute_update_and_by_abort(params_a, params_b):
  config = dataclasses.replace(PAGED, recompute_kv=True)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    eng.submit(turn('e', PROMPT))
    eng.submit(turn('f', OTHER))
    drain(eng)
    assert eng.stats()['kv_pages_held'] > 0
    eng.abort(['f'])
    eng.update_params(params_b, 1)
    eng.step()
    stats = eng.stats()
    assert stats['kv_pages_held'] == 0 and stats['kv_pages_free'] == stats['kv_pages']


class _ThreeTurns(tasks_base.Environment):
  """Observation '7 8 9' after turns 1 and 2; done after turn 3."""
  turns = 0

  def reset(self, problem):
    return problem.prompt

  def step(self, turn_text, *, truncated, last):
    self.turns += 1
    done = last or self.turns == 3
    return tasks_base.EnvStep(observation=None if done else '7 8 9', reward=float(done),
                              done=done)


def test_episodes_leave_every_page_free(params_a):
  """Six sampled 3-turn episodes on 4 slots: turns reuse held pages, and once the episodes have
  ended (each releasing its last turn) every page is free. (Eviction: the test above.)"""
  config = dataclasses.replace(PAGED, sync_every=1)
  limits = episodes.Limits(sampling=api.SamplingParams(temperature=1.0, max_tokens=5),
                           max_turns=3, max_seq_len=S)
  with engine_lib.JaxEngine(CFG, params_a, config) as eng:
    started = [episodes.start(tasks_base.Problem(f'p{i}', '', ''), _ThreeTurns(),
                              lambda p, i=i: PROMPT[i:], limits, request_id=f'e{i}', seed=i)
               for i in range(6)]
    done = episodes.run(eng, started, decode=lambda t: ' '.join(map(str, t)),
                        encode_text=lambda text: [int(t) for t in text.split()], limits=limits)
    eng.step()  # (releases take effect at the next step)
    stats = eng.stats()
  assert all(e.turns == 3 and e.outcome == 'done' for e in done)
  assert stats['kv_held_reused'] > 0
  assert stats['kv_pages_free'] == stats['kv_pages'] and stats['kv_pages_held'] == 0
