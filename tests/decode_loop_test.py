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
