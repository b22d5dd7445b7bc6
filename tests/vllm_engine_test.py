"""VllmEngine: in-flight weight updates, zero-copy hand-over, log mu, greedy parity, rollback.

One in-process vLLM engine serves the whole module (start-up costs ~10 s); each test first
publishes the weights it needs, so tests do not depend on each other's order. It serves the
Qwen3-format test model (per-head q/k norms, no biases, tied embeddings); Qwen2's biases go
through vLLM in the benchmarks' tests and the pipeline runs.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Not serial: nothing here has a deadline; beside another test an engine is slower, not wrong.
pytestmark = pytest.mark.needs('vllm')

from pipelinerl_jax.generation import api  # noqa: E402
from pipelinerl_jax.generation import jax_engine as jax_engine  # noqa: E402
from pipelinerl_jax.generation import sampling  # noqa: E402
from pipelinerl_jax.generation.transport import hf_tensors  # noqa: E402
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint  # noqa: E402
from pipelinerl_jax.models.hf import names as hf_names  # noqa: E402
from pipelinerl_jax.models.hf import schema as hf_schema  # noqa: E402
from pipelinerl_jax.models import transformer  # noqa: E402
from pipelinerl_jax.tasks import base as tasks_base  # noqa: E402

import xla_env  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LEN = 128
MAX_TOKENS = 16
UPDATE_AT = 5  # the update is applied before this step: tokens 0..4 old, 5.. new


@pytest.fixture(scope='module')
def model(qwen3_model_dir):
  """(model dir, config, p0 = the checkpoint's params, p1 = other, sharper random params)."""
  model_dir = qwen3_model_dir
  config = hf_schema.load_config(model_dir)
  p0 = hf_checkpoint.load_params(model_dir, config)
  # x2: peaked logits, so greedy choices and the update's effect are far from ties. The q/k
  # norm scales differ per dimension: a norm that failed to load would show.
  p1 = jax.tree.map(lambda x: x * 2.0, transformer.init_params(config, jax.random.PRNGKey(5)))
  for i, name in enumerate(('q_norm', 'k_norm')):
    scale = p1['layers']['attn'][name]
    scale['scale'] = jax.random.uniform(jax.random.PRNGKey(i), scale['scale'].shape,
                                        minval=0.5, maxval=2.0)
  return model_dir, config, p0, p1


@pytest.fixture(scope='module')
def engine(model):
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  eng = vllm_engine.VllmEngine(model[0], vllm_engine.VllmEngineConfig(
      max_num_seqs=8, max_model_len=MAX_LEN, kv_cache_bytes=32 << 20))
  yield eng
  eng.close()


def publish(eng, params, version):
  """Publishes and applies (a step with no requests only applies the update)."""
  eng.update_params(params, version)
  assert eng.step() == []
  assert eng.version == version


def requests(tag, temperature=1.0, n=4, **kw):
  return [api.Request(f'{tag}{i}', [5 + i, 6, 7 + 2 * i, 8], api.SamplingParams(
      temperature=temperature, max_tokens=MAX_TOKENS, **kw), seed=100 + i) for i in range(n)]


def trainer_logprobs(params, config, comp, temperature=1.0):
  """log pi of the completion's tokens, full forward (what the trainer computes)."""
  seq = jnp.array([comp.prompt_tokens + comp.tokens.tolist()])
  t = seq.shape[1] - 1
  lp, _ = transformer.token_logprobs(params, config, seq[:, :-1], seq[:, 1:],
                                     jnp.arange(t)[None], jnp.ones((1, t), jnp.int32),
                                     temperature=temperature)
  return np.asarray(lp[0, len(comp.prompt_tokens) - 1:])


def stale_kv_logprobs(p_old, p_new, config, comp, k):
  """log-probs of a sequence whose weights changed before generated token k, keeping the KV
  cache of the prompt and tokens 0..k-2 from the old weights (PipelineRL's stale cache)."""
  prompt, toks = comp.prompt_tokens, comp.tokens.tolist()
  old = trainer_logprobs(p_old, config, comp)[:k]
  ctx = prompt + toks[:k - 1]
  _, cache = transformer.decode(p_old, config, jnp.array([ctx]), jnp.arange(len(ctx))[None],
                                transformer.init_cache(config, 1, MAX_LEN))
  rest = toks[k - 1:-1]
  logits, _ = transformer.decode(p_new, config, jnp.array([rest]),
                                 (len(ctx) + jnp.arange(len(rest)))[None], cache)
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  new = np.asarray(jnp.take_along_axis(logp, jnp.array(toks[k:])[:, None], axis=-1)[:, 0])
  return np.concatenate([old, new])


def test_update_mid_generation_keeps_prefix_and_continues_from_new_weights(engine, model):
  _, config, p0, p1 = model
  publish(engine, p0, 10)
  base = api.generate(engine, requests('base'))
  again = api.generate(engine, requests('again'))
  for a, b in zip(base, again):  # same (seed, params): same tokens
    np.testing.assert_array_equal(a.tokens, b.tokens)

  for r in requests('mid'):
    engine.submit(r)
  done, steps = {}, 0
  while engine.num_unfinished:
    if steps == UPDATE_AT:
      engine.update_params(p1, 11)
    done.update((c.request_id, c) for c in engine.step())
    steps += 1
  mid = [done[f'mid{i}'] for i in range(4)]

  changed = 0
  for b, m in zip(base, mid):
    np.testing.assert_array_equal(m.tokens[:UPDATE_AT], b.tokens[:UPDATE_AT])
    np.testing.assert_array_equal(m.versions, [10] * UPDATE_AT + [11] * (MAX_TOKENS - UPDATE_AT))
    assert m.finish_reason == 'length' and len(m.tokens) == MAX_TOKENS
    changed += not np.array_equal(m.tokens, b.tokens)
    # Every log mu, before and after the update, is the stale-KV mixed policy's.
    ref = stale_kv_logprobs(p0, p1, config, m, UPDATE_AT)
    np.testing.assert_allclose(m.logprobs, ref, atol=1e-4)
  assert changed >= 3  # the continuation follows the new weights
  stats = engine.stats()
  assert stats['version'] == 11 and stats['updates'] >= 2 and stats['tokens_generated'] > 0
  assert stats['tokens_per_s'] > 0 and stats['busy_slots'] == 0 and stats['pending'] == 0


def test_handed_over_tensors_share_memory_with_the_jax_buffers(engine, model):
  _, config, p0, _ = model
  handed = []
  real = engine._worker.reload_weights

  def spy(weights_iterator=None, **kw):
    def record():
      for name, t in weights_iterator:
        handed.append((name, t.data_ptr()))
        yield name, t
    return real(weights_iterator=record(), **kw)

  engine._worker.reload_weights = spy
  try:
    publish(engine, p0, 20)
  finally:
    del engine._worker.reload_weights  # back to the class method
  specs = {name: (spec, i) for name, spec, i in hf_names.checkpoint_order(config)}
  assert [n for n, _ in handed] == list(specs)
  for name, ptr in handed:
    spec, i = specs[name]
    leaf = hf_names.leaf_at(p0, spec.path)
    offset = 0 if i is None else i * (leaf.nbytes // leaf.shape[0])
    assert ptr == leaf.unsafe_buffer_pointer() + offset, name


def test_log_mu_agrees_with_trainer_logprobs_after_update(engine, model):
  _, config, _, p1 = model
  publish(engine, p1, 30)
  deltas = []
  for temperature in (1.0, 0.7):
    for c in api.generate(engine, requests(f't{temperature}', temperature)):
      assert (c.versions == 30).all()
      deltas.append(np.abs(c.logprobs - trainer_logprobs(p1, config, c, temperature)))
  # top-k / top-p: log mu is under the renormalized filtered distribution.
  for c in api.generate(engine, requests('filtered', 0.8, top_k=5, top_p=0.9)):
    seq = jnp.array([c.prompt_tokens + c.tokens.tolist()])
    logits = transformer.forward_logits(p1, config, seq[:, :-1])[0, len(c.prompt_tokens) - 1:]
    filtered = sampling.filter_logits(logits / 0.8, 5, 0.9)
    ref = jnp.take_along_axis(jax.nn.log_softmax(filtered, -1), jnp.array(c.tokens)[:, None], -1)
    deltas.append(np.abs(c.logprobs - np.asarray(ref[:, 0])))
  deltas = np.concatenate(deltas)
  print(f'\nlog mu vs trainer: mean |d| {deltas.mean():.2e}, max |d| {deltas.max():.2e} '
        f'over {deltas.size} tokens')
  assert deltas.mean() <= 1e-2  # the target; fp32 serving is far tighter:
  assert deltas.max() <= 1e-4


def test_greedy_matches_the_jax_engine(engine, model):
  _, config, p0, _ = model
  publish(engine, p0, 40)
  ours = api.generate(engine, requests('greedy', 0.0))
  with jax_engine.JaxEngine(config, p0, jax_engine.EngineConfig(num_slots=4,
                                                               max_seq_len=MAX_LEN)) as je:
    theirs = api.generate(je, requests('greedy', 0.0))
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)  # temperature-1 log-probs


class _ToolEnv(tasks_base.Environment):
  """Answers turn 1 with the observation '9 10 11', ends at turn 2."""
  turns = 0

  def reset(self, problem):
    return problem.prompt

  def step(self, turn_text, *, truncated, last):
    self.turns += 1
    if last or self.turns == 2:
      return tasks_base.EnvStep(observation=None, reward=1.0, done=True)
    return tasks_base.EnvStep(observation='9 10 11', reward=0.0, done=False, tool_call=True)


def test_multi_turn_episodes_match_the_jax_engine_continuing_its_kv(engine, model):
  """vLLM runs each turn as a new request with the whole history (prefix caching stays off);
  the JAX engine continues the held KV. Greedy episodes agree token for token."""
  from pipelinerl_jax import episodes
  _, config, p0, _ = model
  publish(engine, p0, 45)
  limits = episodes.Limits(sampling=api.SamplingParams(temperature=0.0, max_tokens=6),
                           max_turns=2)

  def run_on(eng):
    started = [episodes.start(tasks_base.Problem(f'p{i}', '', ''), _ToolEnv(),
                              lambda p, i=i: [5 + i, 6, 7 + 2 * i, 8], limits,
                              request_id=f'e{i}', seed=i) for i in range(2)]
    return episodes.run(eng, started, decode=lambda tokens: ' '.join(map(str, tokens)),
                        encode_text=lambda text: [int(t) for t in text.split()], limits=limits)

  ours = run_on(engine)
  with jax_engine.JaxEngine(config, p0, jax_engine.EngineConfig(num_slots=4,
                                                               max_seq_len=MAX_LEN)) as je:
    theirs = run_on(je)
    assert je.stats()['kv_held_reused'] == 2
  for a, b in zip(ours, theirs):
    assert a.turns == b.turns == 2 and a.loss_mask == b.loss_mask
    assert a.tokens == b.tokens and a.tokens[6:9] == [9, 10, 11]
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_stop_tokens_end_the_sequence_and_are_kept(engine, model):
  _, _, _, p1 = model
  publish(engine, p1, 50)  # (the untrained tied checkpoint repeats its last prompt token)
  (base,) = api.generate(engine, requests('free', 0.0, n=1))
  toks = base.tokens.tolist()
  j = next(j for j in range(1, len(toks)) if toks[j] not in toks[:j])  # first new token
  (stopped,) = api.generate(engine, requests('stop', 0.0, n=1, stop_token_ids=(toks[j],)))
  assert stopped.finish_reason == 'stop'
  assert stopped.tokens.tolist() == toks[:j + 1]
  assert base.finish_reason == 'length'


def test_a_load_failing_part_way_rolls_back_and_generation_continues(engine, model):
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  _, _, p0, p1 = model
  publish(engine, p0, 60)
  expected = api.generate(engine, requests('ref'))
  real, calls = engine._worker.reload_weights, []

  def transport_dies_once(weights_iterator=None, **kw):
    calls.append(1)
    if len(calls) > 1:
      return real(weights_iterator=weights_iterator, **kw)

    def broken():  # half the tensors arrive, then the source fails
      for k, item in enumerate(weights_iterator):
        if k == 12:
          raise OSError('transport died')
        yield item
    return real(weights_iterator=broken(), **kw)

  engine._worker.reload_weights = transport_dies_once
  try:
    for r in requests('ref2'):
      engine.submit(r)
    for _ in range(UPDATE_AT):
      assert engine.step() == []
    engine.update_params(p1, 61)
    with pytest.raises(vllm_engine.WeightUpdateError, match='transport died'):
      engine.step()
  finally:
    del engine._worker.reload_weights
  assert len(calls) == 2  # the failed load, then the rollback to p0
  assert engine.version == 60
  stats = engine.stats()
  assert stats['rollbacks'] >= 1 and 'transport died' in stats['last_update_error']
  done = {}
  while engine.num_unfinished:
    done.update((c.request_id, c) for c in engine.step())
  # The in-flight sequences finished on the old weights, exactly as without the failed update.
  for i, e in enumerate(expected):
    np.testing.assert_array_equal(done[f'ref2{i}'].tokens, e.tokens)
    assert (done[f'ref2{i}'].versions == 60).all()


def test_bad_updates_are_rejected_without_touching_the_model(engine, model):
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  _, config, p0, p1 = model
  publish(engine, p0, 70)
  wrong = {**p1, 'final_norm': {'scale': jnp.zeros((3,))}}
  with pytest.raises(ValueError, match='final_norm/scale'):
    engine.update_params(wrong, 71)
  donated = jax.tree.map(jnp.copy, p1)
  engine.update_params(donated, 72)
  donated['layers']['mlp']['down_proj']['kernel'].delete()
  with pytest.raises(vllm_engine.WeightUpdateError, match='deleted'):
    engine.step()
  assert engine.version == 70 and engine.stats()['broken'] is None
  (c,) = api.generate(engine, requests('after', n=1))
  np.testing.assert_allclose(c.logprobs, trainer_logprobs(p0, config, c), atol=1e-4)


def test_hf_tensor_updates_are_released_once_no_longer_read(engine, model):
  """The staging-buffer contract of a collective transport: `release` is called once per
  update, when it is loaded, replaced by a newer one before loading, or fails."""
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  _, config, p0, p1 = model
  views = lambda p: [(n, t.clone()) for n, t in hf_tensors.hf_torch_tensors(p, config)]
  released = []
  engine.update_hf_tensors(views(p1), 80, release=lambda: released.append(80))
  engine.update_hf_tensors(views(p0), 81, release=lambda: released.append(81))
  assert released == [80]  # dropped unloaded: newest wins
  assert engine.apply_update() == 81 and released == [80, 81]
  assert engine.apply_update() is None and released == [80, 81]
  engine.update_hf_tensors(views(p1)[:-1], 82, release=lambda: released.append(82))
  with pytest.raises(vllm_engine.WeightUpdateError, match='1 tensors missing'):
    engine.apply_update()
  assert released == [80, 81, 82] and engine.version == 81
  (c,) = api.generate(engine, requests('staged', n=1))
  np.testing.assert_allclose(c.logprobs, trainer_logprobs(p0, config, c), atol=1e-4)


class _WithoutWeightVersions:
  """The LLMEngine of vLLM 0.26 (the GPU image's) as the engine sees it: no
  `set_weight_version`, no per-token version spans on finished outputs."""

  def __init__(self, core):
    self._inner = core

  def __getattr__(self, name):
    if name in ('set_weight_version', 'get_weight_version'):
      raise AttributeError(name)
    return getattr(self._inner, name)

  def step(self):
    outputs = self._inner.step()
    for out in outputs:
      for c in out.outputs:
        c.weight_versions = None
    return outputs


def test_versions_are_recorded_where_vllm_keeps_none(engine, model):
  _, _, p0, p1 = model
  errors_before = engine.stats().get('update_errors', 0)  # the engine is the module's
  core, engine._core = engine._core, _WithoutWeightVersions(engine._core)
  try:
    publish(engine, p0, 90)
    for r in requests('v026'):
      engine.submit(r)
    done, steps = [], 0
    while engine.num_unfinished:
      if steps == UPDATE_AT:
        engine.update_params(p1, 91)
      done += engine.step()
      steps += 1
  finally:
    engine._core = core
  # Loaded (a failed load raises from step()) and recorded per token by the engine alone.
  assert len(done) == 4 and engine.version == 91
  assert engine.stats().get('update_errors', 0) == errors_before
  for c in done:
    np.testing.assert_array_equal(c.versions, [90] * UPDATE_AT + [91] * (MAX_TOKENS - UPDATE_AT))


def test_kv_cache_info_and_served_model(engine, model):
  _, config, p0, _ = model
  publish(engine, p0, 95)
  info = engine.kv_cache_info()
  # The fixture asks for 32 MiB; vLLM rounds down to whole blocks of every layer.
  per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * info['block_size']
  assert info['bytes'] == info['num_blocks'] * per_block and 0 < info['bytes'] <= 32 << 20
  embed = dict(engine.model.named_parameters())['model.embed_tokens.weight']
  np.testing.assert_array_equal(embed[:config.vocab_size].numpy(),
                                np.asarray(p0['embed']['embedding']))


def test_a_running_engine_keeps_no_file_store_a_kill_would_leave(engine):
  # vLLM met its one-rank process group through $TMPDIR/vllm_dist_<uuid>; only a clean exit
  # would delete it, and generators get killed.
  init_method = engine._worker.distributed_init_method
  assert init_method.startswith('file://') and 'vllm_dist_' in init_method
  assert not pathlib.Path(init_method.removeprefix('file://')).exists()
  (r,) = requests('fs', n=1)  # and it still generates
  engine.submit(r)
  done = []
  while not done:
    done = engine.step()
  assert done[0].request_id == r.request_id and 1 <= len(done[0].tokens) <= MAX_TOKENS


def test_bench_quick_runs_and_reports_sync_over_memcpy(tmp_path):
  out, tmp = tmp_path / 'ws.json', tmp_path / 'tmp'
  tmp.mkdir()
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.bench.weight_sync', '--quick', f'--out={out}',
       f'--workdir={tmp_path}'], cwd=ROOT, capture_output=True, text=True, timeout=240,
      env={**xla_env.one_device(), 'TMPDIR': str(tmp)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  # A clean run leaves nothing of vLLM's file stores in its TMPDIR.
  assert not list(tmp.glob('vllm_dist_*')), sorted(p.name for p in tmp.iterdir())
  report = json.loads(out.read_text())
  (row,) = report['rows']
  assert report['sync_over_memcpy']['quick'] == row['sync_over_memcpy'] > 0
  assert row['zero_copy_tensors'] == row['tensors'] > 0
  assert row['tokens_per_s'] > 0 and row['tokens_per_s_with_updates'] > 0
  assert 'sync/memcpy' in proc.stdout
