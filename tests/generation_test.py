"""Generation engine and sampling rules, against plain full-forward references.

Compiles dominate the runtime on CPU, so every engine here shares one model config, S = 64 and
a single prefill length bucket (min_prefill_len = S); the references are jitted at fixed shapes.
"""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine as engine_lib
from pipelinerl_jax.generation import sampling
from pipelinerl_jax.models import transformer

import needs  # tests/ is on sys.path

CFG = transformer.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8)
S = 64
ENGINE = engine_lib.EngineConfig(num_slots=4, max_seq_len=S, min_prefill_len=S)
REF_ROWS = 8  # reference batches are padded to this many rows: one compile each

_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(0, CFG.vocab_size, n)) for n in (1, 3, 7, 12, 20, 5)]


def make_params(seed):
  # The init's std 0.02 makes near-uniform logits; x15 separates them so argmax is robust.
  params = transformer.init_params(CFG, jax.random.PRNGKey(seed))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * 15.0 if path[-1].key in ('kernel', 'embedding') else x, params)


@pytest.fixture(scope='module')
def params_a():
  return make_params(0)


@pytest.fixture(scope='module')
def params_b():
  return make_params(1)


def request(i, prompt, max_tokens=8, temperature=0.0, seed=None, **kw):
  sp = api.SamplingParams(temperature=temperature, max_tokens=max_tokens, **kw)
  return api.Request(f'r{i}', prompt, sp, seed=i if seed is None else seed)


def run(params, requests, config=ENGINE, **kw):
  with engine_lib.JaxEngine(CFG, params, config, **kw) as eng:
    return {c.request_id: c for c in api.generate(eng, requests)}


# --- references ---------------------------------------------------------------------------------


@jax.jit
def _full_logprobs(params, tokens_BxS):
  return jax.nn.log_softmax(transformer.forward_logits(params, CFG, tokens_BxS), axis=-1)


def full_logprobs(params, seqs):
  """log pi(. | seq[:p+1]) at every position p of each sequence, by a plain full forward."""
  tokens = np.zeros((REF_ROWS, S), np.int32)
  for r, seq in enumerate(seqs):
    tokens[r, :len(seq)] = seq
  return np.asarray(_full_logprobs(params, tokens))


def token_logprobs(params, prompt, tokens):
  lp = full_logprobs(params, [list(prompt) + list(tokens)])[0]
  p = len(prompt)
  return np.array([lp[p + j - 1, t] for j, t in enumerate(tokens)])


@jax.jit
def _ref_prefill(params, tokens_BxS, lengths_B):
  positions = jnp.where(jnp.arange(S)[None] < lengths_B[:, None], jnp.arange(S)[None], S)
  return transformer.decode(params, CFG, tokens_BxS, positions,
                            transformer.init_cache(CFG, REF_ROWS, S))[1]


@jax.jit
def _ref_decode(params, tokens_B, positions_B, cache):
  logits, cache = transformer.decode(params, CFG, tokens_B[:, None], positions_B[:, None], cache)
  return jax.nn.log_softmax(logits[:, 0], axis=-1), cache


def stale_kv_logprobs(old, new, prompt, tokens, k):
  """Log-probs of tokens[k:] when the cache of positions < len(prompt) + k - 1 was built
  under `old` and every later step runs under `new` (PipelineRL's kept KV cache)."""
  seq = list(prompt) + list(tokens)
  start = len(prompt) + k - 1  # position of the first input decoded with new params
  ctx = np.zeros((REF_ROWS, S), np.int32)
  ctx[0, :start] = seq[:start]
  cache = _ref_prefill(old, ctx, np.full((REF_ROWS,), start, np.int32))
  out = []
  for pos in range(start, len(seq) - 1):
    lp, cache = _ref_decode(new, np.full((REF_ROWS,), seq[pos], np.int32),
                            np.full((REF_ROWS,), pos, np.int32), cache)
    out.append(float(lp[0, seq[pos + 1]]))
  return np.array(out)


# --- sampling -----------------------------------------------------------------------------------


def np_filtered_logprobs(logits, temperature, top_k, top_p):
  """The distribution each row is drawn from, by its definition."""
  if temperature == 0:
    z = logits - logits.max()
    return z - np.log(np.exp(z).sum())
  z = logits / temperature
  order = np.argsort(-z, kind='stable')
  keep = np.zeros(z.shape, bool)
  keep[order[:top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  if top_p < 1.0:
    before = np.cumsum(p[order]) - p[order]
    keep[order[before >= top_p]] = False
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  with np.errstate(divide='ignore'):
    return np.log(p / p.sum())


_sample_static = jax.jit(sampling.sample, static_argnames=('top_k', 'top_p'))
_sample_per_row = jax.jit(sampling.sample)


@pytest.mark.parametrize('rule', [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.3, top_k=8, top_p=0.7),
    'per_row',
])
def test_sample_draws_only_allowed_tokens_with_renormalized_logprobs(rule):
  rows, draws = 5, 3000
  logits = np.random.default_rng(1).normal(size=(rows, CFG.vocab_size)).astype(np.float32) * 2
  if rule == 'per_row':  # (temperature, top_k, top_p); row 0 is unfiltered, row 3 greedy
    per_row = [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.2, 0, 0.5), (0.0, 4, 0.5), (1.0, 6, 0.8)]
    t, k, p = (np.repeat(np.array(col), draws) for col in zip(*per_row))
    kw = dict(temperature=t.astype(np.float32), top_k=k.astype(np.int32),
              top_p=p.astype(np.float32))
  else:
    per_row = [(rule['temperature'], rule.get('top_k', 0), rule.get('top_p', 1.0))] * rows
    kw = rule
  tiled = np.repeat(logits, draws, axis=0)
  sample = _sample_per_row if rule == 'per_row' else _sample_static
  tokens, logprobs = sample(jax.random.PRNGKey(2), tiled, **kw)
  tokens = np.asarray(tokens).reshape(rows, draws)
  logprobs = np.asarray(logprobs).reshape(rows, draws)

  for r, (t, k, p) in enumerate(per_row):
    ref = np_filtered_logprobs(logits[r], t, k, p)
    assert np.isfinite(ref[tokens[r]]).all(), 'drew a token outside the top-k / top-p set'
    np.testing.assert_allclose(logprobs[r], ref[tokens[r]], atol=1e-5)
    freq = np.bincount(tokens[r], minlength=CFG.vocab_size) / draws
    if t == 0:
      assert (tokens[r] == logits[r].argmax()).all()
    else:
      np.testing.assert_allclose(freq, np.exp(ref), atol=0.04)
    if (k, p) == (0, 1.0):
      assert np.isfinite(ref).all()  # "off" really is off: every token stays possible
  if rule == 'per_row':
    assert len(set(tokens[0])) > 10


@pytest.mark.parametrize('candidates', [8, 256])
def test_filtering_without_a_full_sort_keeps_the_same_tokens(monkeypatch, candidates):
  """8 candidates: peaked rows are served from candidates while a flat row under top-p sends
  the batch to the full sort; 256: every row from candidates (V = 40)."""
  monkeypatch.setattr(sampling, 'CANDIDATES', candidates)
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, CFG.vocab_size)).astype(np.float32)
  for r in range(5):  # peaked: four tokens well above the rest (a tie among them)
    logits[r, rng.permutation(CFG.vocab_size)[:4]] += [12.0, 11.0, 11.0, 9.5]
  logits[5] = rng.normal(size=CFG.vocab_size) * 0.01  # flat
  k = np.array([0, 2, 0, 3, 0, 0], np.int32)
  p = np.array([0.9, 1.0, 0.5, 0.8, 1.0, 0.95], np.float32)
  # Fresh functions: jit's trace cache would keep the other parameter's CANDIDATES.
  filtered = jax.jit(lambda *a: sampling.filter_logits(*a))
  gaps = jax.jit(lambda *a: sampling.candidate_gaps(*a))
  for rows in (slice(0, 5), slice(0, 6)):
    served = bool(gaps(logits[rows], k[rows], p[rows])[1])
    assert served == (candidates == 256 or rows.stop == 5)
    out = np.asarray(filtered(logits[rows], k[rows], p[rows]))
    for r in range(out.shape[0]):
      want = np.isfinite(np_filtered_logprobs(logits[r], 1.0, k[r], p[r]))
      np.testing.assert_array_equal(np.isfinite(out[r]), want, err_msg=f'row {r}')
      np.testing.assert_array_equal(out[r][want], logits[r][want])


# --- engine -------------------------------------------------------------------------------------


def test_greedy_matches_full_forward_decoding(params_a):
  # 6 prompts on 4 slots: later ones are prefilled while others decode.
  max_tokens = [8, 3, 6, 8, 5, 7]
  reqs = [request(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
  out = run(params_a, reqs)

  seqs = [list(p) for p in PROMPTS]
  ref_tokens, ref_lps = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
  for _ in range(max(max_tokens)):
    lp = full_logprobs(params_a, seqs)
    for r, seq in enumerate(seqs):
      t = int(lp[r, len(seq) - 1].argmax())
      seq.append(t)
      ref_tokens[r].append(t)
      ref_lps[r].append(lp[r, len(seq) - 2, t])
  for i, n in enumerate(max_tokens):
    c = out[f'r{i}']
    assert c.finish_reason == 'length' and c.prompt_tokens == PROMPTS[i]
    np.testing.assert_array_equal(c.tokens, ref_tokens[i][:n])
    np.testing.assert_allclose(c.logprobs, ref_lps[i][:n], atol=1e-5)
    np.testing.assert_array_equal(c.versions, np.zeros(n))


def _mixed_requests():
  rules = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
           dict(temperature=1.0, top_k=5)]
  reqs = [request(i, p, 4 + i, seed=100 + i, **rules[i % len(rules)])
          for i, p in enumerate(PROMPTS)]
  # Same prompt and rule: same seed gives the same sample, another seed another one.
  reqs += [api.Request(name, PROMPTS[2], api.SamplingParams(max_tokens=12), seed=seed)
           for name, seed in (('same_a', 7), ('same_b', 7), ('other', 8))]
  return reqs


def test_results_independent_of_arrival_order_and_slot(params_a):
  reqs = _mixed_requests()
  base = run(params_a, reqs)
  shuffled = [reqs[i] for i in np.random.default_rng(3).permutation(len(reqs))]
  runs = [run(params_a, reqs[::-1], dataclasses.replace(ENGINE, num_slots=8)),
          run(params_a, shuffled)]
  for other in runs:
    for rid, c in base.items():
      np.testing.assert_array_equal(other[rid].tokens, c.tokens)
      np.testing.assert_allclose(other[rid].logprobs, c.logprobs, atol=1e-5)
  np.testing.assert_array_equal(base['same_a'].tokens, base['same_b'].tokens)
  assert not np.array_equal(base['same_a'].tokens, base['other'].tokens)


def run_with_update(params, new_params, requests, k, recompute_kv):
  """Decodes k tokens under `params` (version 0), then switches to `new_params` (version 1)."""
  config = dataclasses.replace(ENGINE, recompute_kv=recompute_kv)
  with engine_lib.JaxEngine(CFG, params, config) as eng:
    for r in requests:
      eng.submit(r)
    done = {}
    for _ in range(k):
      done.update((c.request_id, c) for c in eng.step())
    eng.update_params(new_params, 1)
    assert eng.version == 0  # takes effect at the next token step, not before
    while eng.num_unfinished:
      done.update((c.request_id, c) for c in eng.step())
    assert eng.stats()['version'] == 1
    return done


UPDATE_PROMPTS = PROMPTS[:3]
K = 3


@pytest.fixture(scope='module')
def update_requests():
  return [request(i, p, 9, temperature=1.0) for i, p in enumerate(UPDATE_PROMPTS)]


@pytest.fixture(scope='module')
def no_update(params_a, update_requests):
  return run(params_a, update_requests)


def _check_prefix_and_versions(out, no_update, params_a, params_b):
  changed = False
  for rid, c in out.items():
    np.testing.assert_array_equal(c.tokens[:K], no_update[rid].tokens[:K])
    np.testing.assert_allclose(c.logprobs[:K], no_update[rid].logprobs[:K], atol=1e-6)
    np.testing.assert_array_equal(c.versions, [0] * K + [1] * (len(c.tokens) - K))
    np.testing.assert_allclose(c.logprobs[:K], token_logprobs(params_a, c.prompt_tokens,
                                                              c.tokens)[:K], atol=1e-5)
    changed |= not np.array_equal(c.tokens, no_update[rid].tokens)
  assert changed, 'the update had no visible effect'


def test_update_with_recomputed_kv_matches_new_model(params_a, params_b, update_requests,
                                                     no_update):
  out = run_with_update(params_a, params_b, update_requests, K, recompute_kv=True)
  _check_prefix_and_versions(out, no_update, params_a, params_b)
  for c in out.values():
    new_lp = token_logprobs(params_b, c.prompt_tokens, c.tokens)
    np.testing.assert_allclose(c.logprobs[K:], new_lp[K:], atol=1e-5)


def test_update_keeps_stale_kv_by_default(params_a, params_b, update_requests, no_update):
  out = run_with_update(params_a, params_b, update_requests, K, recompute_kv=False)
  _check_prefix_and_versions(out, no_update, params_a, params_b)
  for c in out.values():
    stale_lp = stale_kv_logprobs(params_a, params_b, c.prompt_tokens, c.tokens, K)
    np.testing.assert_allclose(c.logprobs[K:], stale_lp, atol=1e-5)
    # ... and the stale cache matters: the new model alone gives another log-prob.
    fresh_lp = token_logprobs(params_b, c.prompt_tokens, c.tokens)
    assert abs(c.logprobs[K] - fresh_lp[K]) > 1e-3


def test_engine_applies_top_k_and_top_p(params_a):
  # A one-token support is greedy decoding whose renormalized log mu is exactly 0.
  greedy = run(params_a, [request(0, PROMPTS[3], 6)])['r0']
  out = run(params_a, [request(0, PROMPTS[3], 6, temperature=1.0, top_k=1),
                       request(1, PROMPTS[3], 6, temperature=1.0, top_p=1e-3),
                       request(2, PROMPTS[3], 6, temperature=1.0)])
  for rid in ('r0', 'r1'):
    np.testing.assert_array_equal(out[rid].tokens, greedy.tokens)
    np.testing.assert_allclose(out[rid].logprobs, 0.0, atol=1e-6)
  assert (out['r2'].logprobs < -1e-3).all()  # unfiltered rows in the same batch stay unfiltered


def test_stop_tokens_and_length(params_a):
  base = run(params_a, [request(0, PROMPTS[3], 10)])['r0']
  assert base.finish_reason == 'length' and len(base.tokens) == 10
  eos = int(base.tokens[4])
  first = list(base.tokens).index(eos)
  for out in (run(params_a, [request(0, PROMPTS[3], 10, stop_token_ids=(eos, 39))])['r0'],
              run(params_a, [request(0, PROMPTS[3], 10)],
                  dataclasses.replace(ENGINE, eos_token_ids=(eos,)))['r0']):
    assert out.finish_reason == 'stop'
    np.testing.assert_array_equal(out.tokens, base.tokens[:first + 1])  # stop token kept

  with engine_lib.JaxEngine(CFG, params_a, ENGINE) as eng:
    with pytest.raises(ValueError, match='max_seq_len'):
      eng.submit(request(0, PROMPTS[4], S - len(PROMPTS[4]) + 1))
    with pytest.raises(ValueError, match='vocab'):
      eng.submit(request(0, [CFG.vocab_size], 2))


def test_continuous_batching_does_not_recompile(params_a):
  def requests(offset, extra_len):
    lengths, max_tokens = [4, 9, 2, 15, 6, 11, 3, 8, 5, 13], [5, 2, 7, 3, 6, 4, 8, 2, 5, 3]
    rng = np.random.default_rng(offset)
    return [request(offset + i, list(rng.integers(0, CFG.vocab_size, n + extra_len)), m,
                    temperature=1.0) for i, (n, m) in enumerate(zip(lengths, max_tokens))]

  eng = engine_lib.JaxEngine(CFG, params_a, ENGINE)
  warm = api.generate(eng, requests(0, 0))  # 10 requests through 4 slots
  traces = dict(engine_lib.TRACES)
  sizes = engine_lib.decode_step._cache_size(), engine_lib.prefill._cache_size()
  # Other prompts and lengths, same buckets and admission pattern: nothing new to compile.
  out = api.generate(eng, requests(100, 3))
  assert dict(engine_lib.TRACES) == traces
  assert (engine_lib.decode_step._cache_size(), engine_lib.prefill._cache_size()) == sizes
  for c in warm + out:
    assert c.finish_reason in ('stop', 'length') and len(c.tokens) >= 1
  stats = eng.stats()
  assert stats['tokens_generated'] == sum(len(c.tokens) for c in warm + out)
  assert stats['busy_slots'] == 0 and stats['pending'] == 0 and eng.num_unfinished == 0
  eng.close()
  with pytest.raises(RuntimeError, match='closed'):
    eng.step()


def test_concurrent_updates_from_another_thread(params_a, params_b):
  eng = engine_lib.JaxEngine(CFG, params_a, ENGINE)
  stop = threading.Event()

  def trainer():
    version = 0
    while not stop.is_set():
      version += 1
      eng.update_params(params_b if version % 2 else params_a, version)
      stop.wait(0.002)

  thread = threading.Thread(target=trainer)
  thread.start()
  try:
    out = api.generate(eng, [request(i, p, 8, temperature=1.0) for i, p in enumerate(PROMPTS)])
  finally:
    stop.set()
    thread.join()
  for c in out:
    assert len(c.tokens) == 8 and (np.diff(c.versions) >= 0).all()
  assert max(c.versions.max() for c in out) > 0


def test_deleted_params_are_refused(params_a):
  eng = engine_lib.JaxEngine(CFG, params_a, ENGINE)
  published = jax.tree.map(jnp.copy, params_a)
  eng.update_params(published, 1)
  jax.tree.leaves(published)[0].delete()  # what a donating train step would do to an alias
  with pytest.raises(RuntimeError, match='deleted'):
    eng.step()


def test_generation_on_another_device(params_a):
  needs.check('two_devices')
  devices = jax.devices()
  reqs = [request(0, PROMPTS[4], 5)]
  source = jax.device_put(jax.tree.map(jnp.copy, params_a), devices[0])
  eng = engine_lib.JaxEngine(CFG, source, ENGINE, device=devices[1])
  eng.update_params(jax.tree.map(jnp.copy, source), 1)
  jax.tree.map(lambda x: x.delete(), source)  # the engine holds copies on devices[1]
  out = api.generate(eng, reqs)[0]
  assert eng._state.pool.k.devices() == {devices[1]}
  np.testing.assert_array_equal(out.tokens, run(params_a, reqs)['r0'].tokens)
  np.testing.assert_array_equal(out.versions, np.ones(5))
