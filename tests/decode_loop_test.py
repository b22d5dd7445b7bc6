"""A generator actor's decode loop without Ray, on the scripted engine: requests that wait for the
first weights, resent ids skipped, completions kept and resent until acknowledged, later weights
applied between steps, the loop's death raised in one line."""

import numpy as np
import pytest

from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.generation.actors import decode_loop

import scripted  # tests/ is on sys.path under pytest


def make_loop(monkeypatch, script=scripted.two_tokens):
  built = []

  def make_engine(spec, model, *, params, version, **kwargs):
    engine = scripted.ScriptedEngine(num_slots=4, script=script)
    engine.update_params(params, version)
    built.append(engine)
    return engine
  monkeypatch.setattr(decode_loop.engines, 'make_engine', make_engine)
  spec = engines.EngineSpec(backend='jax', num_slots=4, max_seq_len=16, eos_token_ids=(1,))
  loop = decode_loop.DecodeLoop('generator-0', spec, '/nowhere', staged_updates=False,
                                model=lambda: None)
  return loop, built


def request(rid: str) -> api.Request:
  return api.Request(rid, [3, 4], api.SamplingParams(max_tokens=4), seed=0,
                     metadata=dict(index=2))


def poll_until(loop, ack: int, count: int) -> list:
  for _ in range(200):
    items = loop.poll(ack, wait_s=0.05)
    if len(items) >= count:
      return items
  raise AssertionError(f'{count} completions never came: {items}')


def test_completions_stay_until_acknowledged_and_resent_ids_are_skipped(monkeypatch):
  loop, built = make_loop(monkeypatch)
  try:
    loop.submit([request('a'), request('b')])
    assert not loop.started and loop.stats()['waiting'] == 2 and loop.stats()['version'] == -1
    loop.apply({'w': np.zeros(2, np.float32)}, version=1)
    assert loop.started and loop.stats()['waiting'] == 0
    loop.submit([request('a')])                  # resent while held: skipped
    items = poll_until(loop, ack=0, count=2)
    assert [s for s, _ in items] == [1, 2] and {c.request_id for _, c in items} == {'a', 'b'}
    assert all((c.versions == 1).all() for _, c in items)
    assert loop.poll(0, wait_s=0) == items        # a lost reply: the same again
    assert loop.poll(2, wait_s=0) == []           # acknowledged: gone, and the ids free
    loop.apply({'w': np.ones(2, np.float32)}, version=2)  # applied between two steps
    loop.submit([request('a')])
    (seq, c), = poll_until(loop, ack=2, count=1)
    assert seq == 3 and c.request_id == 'a' and (c.versions == 2).all()
    assert sorted(built[0].completed) == ['a', 'a', 'b']  # the resend while held never ran
    assert loop.stats()['weight_updates'] == 2 and len(built) == 1
  finally:
    loop.close()
  assert built[0].closed


def test_a_failed_decode_loop_is_raised_by_poll_in_one_line(monkeypatch):
  def broken(r):
    raise ValueError('scripted failure')
  loop, _ = make_loop(monkeypatch, script=broken)
  try:
    loop.apply({'w': np.zeros(2, np.float32)}, version=0)
    loop.submit([request('a')])
    with pytest.raises(RuntimeError, match=r'^generator-0: the decode loop failed: '
                                           r'ValueError: scripted failure$'):
      poll_until(loop, ack=0, count=1)
  finally:
    loop.close()


# --- verified updates (generation.remote.verify_updates) ------------------------------------------


def test_params_checksum_changes_with_any_bit_and_not_with_key_order():
  from pipelinerl_jax.generation.transport import layout
  tree = {'b': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}, 'a': np.ones(4, np.float32)}
  same = {'a': np.ones(4, np.float32), 'b': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}}
  flipped = {'a': tree['a'].copy(), 'b': {'w': tree['b']['w'].copy()}}
  flipped['b']['w'].view(np.uint32)[1, 2] ^= 1  # the lowest mantissa bit of one value
  as_f16 = {'a': tree['a'].astype(np.float16), 'b': tree['b']}
  moved = {'a': tree['a'], 'b': {'v': tree['b']['w']}}
  sums = [layout.params_checksum(t) for t in (tree, same, flipped, as_f16, moved)]
  assert sums[0] == sums[1] and len(set(sums[1:])) == 4


def test_a_verifying_generator_applies_what_was_published_and_refuses_a_changed_update(
    monkeypatch):
  """The actor's own code without Ray, on the scripted engine: an update whose params are the
  trainer's, bit for bit, is counted; one with a single bit changed on the way stops it in one
  line naming the version and both checksums."""
  from pipelinerl_jax.generation.actors import generator
  from pipelinerl_jax.generation.transport import layout
  from pipelinerl_jax.models import transformer
  monkeypatch.setattr(decode_loop.engines, 'make_engine',
                      lambda spec, model, *, params, version, **kw: scripted.ScriptedEngine(4))
  config = transformer.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
  spec = generator.GeneratorSpec(
      engine=engines.EngineSpec(backend='jax', num_slots=4, max_seq_len=16, eos_token_ids=(1,)),
      model_dir='/nowhere', model_overrides={}, verify_updates=True)
  actor = generator.Generator(spec, 'generator-0')
  actor._model_config = config
  import jax
  params = jax.tree.map(np.asarray, transformer.init_params(config, jax.random.PRNGKey(0)))
  digest = layout.tree_digest(params)
  try:
    for version in (0, 1):  # the first builds the engine, the next goes to the running one
      assert actor.update(params, version, digest, actor.incarnation,
                          layout.params_checksum(params)) == version
    assert actor._stats()['updates_verified'] == 2
    changed = jax.tree.map(np.copy, params)
    changed['embed']['embedding'].view(np.uint32)[3, 1] ^= 1
    want = layout.params_checksum(params)
    with pytest.raises(ValueError) as e:
      actor.update(changed, 2, digest, actor.incarnation, want)
    assert str(e.value) == (
        f'generator-0: weight update 2 arrived changed: the params its engine was handed have '
        f'checksum {layout.params_checksum(changed)}, the trainer published {want} '
        '(generation.remote.verify_updates)')
    assert actor._stats()['updates_verified'] == 2
  finally:
    actor.close()
