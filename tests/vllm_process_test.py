"""Shared-memory weight transport, and the vLLM generator in its own process."""

import multiprocessing as mp
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation.transport import shm
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models import transformer

CONFIG = transformer.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                 qkv_bias=True)

try:
  import vllm  # noqa: F401
  _VLLM_ERROR = None
except Exception as e:
  _VLLM_ERROR = f'{type(e).__name__}: {e}'
needs_vllm = pytest.mark.skipif(_VLLM_ERROR is not None,
                                reason=f'vLLM is not importable here: {_VLLM_ERROR}')


@pytest.fixture
def segment():
  _, size, capacity = shm.manifest_for(CONFIG)
  seg = shm.Segment.create(size, mp.get_context('spawn').Lock(), capacity)
  yield seg
  seg.close(unlink=True)


def test_round_trip_gives_the_hf_tensors(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  shm.write_update(segment, params, CONFIG, version=3)
  with segment.lock:
    version, views = shm.read_update(segment)
    assert version == 3
    ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
    assert [n for n, _ in views] == [n for n, _ in ref]
    raw = np.frombuffer(segment.shm.buf, np.uint8)
    base, end = raw.ctypes.data, raw.ctypes.data + raw.size
    for (name, v), (_, r) in zip(views, ref):
      np.testing.assert_array_equal(v.numpy(), r.numpy(), err_msg=name)
      assert base + segment.data_start <= v.data_ptr() < end, name  # a view, not a copy
    del views, raw


def test_corrupt_or_half_written_segments_are_rejected(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  shm.write_update(segment, params, CONFIG, version=1)
  segment.shm.buf[segment.data_start + 100] ^= 0xFF  # one flipped byte
  with segment.lock, pytest.raises(shm.TransportError, match='checksum'):
    shm.read_update(segment)
  segment.write_header(state=shm.WRITING)  # a writer that died part-way
  with segment.lock, pytest.raises(shm.TransportError, match='no complete update'):
    shm.read_update(segment)
  segment.write_header(state=shm.VALID, payload=12)
  with segment.lock, pytest.raises(shm.TransportError, match='payload'):
    shm.read_update(segment)


def test_writer_times_out_with_a_clear_error_while_the_reader_holds_the_lock(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  with segment.lock:
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match='generator .reader. has held the lock'):
      shm.write_update(segment, params, CONFIG, version=1, timeout=0.2)
    assert time.perf_counter() - start < 5


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
  model_dir = warmstart.build_demo_model(
      tmp_path_factory.mktemp('gp') / 'demo',
      config_lib.DemoModelConfig(max_steps=0, eval_problems=8), log=lambda _: None)
  return model_dir, hf_io.load_config(model_dir)


def sharp_params(config, seed):
  """Random params x2: peaked logits, so different params give clearly different tokens."""
  return jax.tree.map(lambda x: x * 2.0, transformer.init_params(config, jax.random.PRNGKey(seed)))


def assert_logprobs_under(params, config, c):
  seq = jnp.array([c.prompt_tokens + c.tokens.tolist()])
  t = seq.shape[1] - 1
  lp, _ = transformer.token_logprobs(params, config, seq[:, :-1], seq[:, 1:],
                                     jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
  np.testing.assert_allclose(c.logprobs, np.asarray(lp[0, len(c.prompt_tokens) - 1:]),
                             atol=1e-4, err_msg=c.request_id)


def kill(gen):
  os.kill(gen._proc.pid, signal.SIGKILL)  # the child we started
  gen._proc.join(timeout=10)


@needs_vllm
def test_generator_process_loads_updates_restarts_once_then_reports_death(demo):
  from pipelinerl_jax.generation.vllm import child
  from pipelinerl_jax.generation.vllm import process as generator_process
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  model_dir, config = demo
  p1, p2 = sharp_params(config, 5), sharp_params(config, 6)
  reqs = lambda tag, n=4, max_tokens=12: [api.Request(f'{tag}{i}', [5 + i, 6, 7, 8], api.SamplingParams(
      temperature=1.0, max_tokens=max_tokens), seed=i) for i in range(n)]

  gen = generator_process.GeneratorProcess(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=8, max_model_len=64, kv_cache_bytes=16 << 20),
      config=child.ProcessConfig(max_restarts=1))
  try:
    with pytest.raises(ValueError, match='max_model_len'):  # refused here, child unharmed
      gen.submit(api.Request('long', [1] * 60, api.SamplingParams(max_tokens=8), seed=0))
    before = api.generate(gen, reqs('a'))
    assert all((c.versions == 0).all() for c in before)
    # While requests are in flight: each sequence's versions are 0... then 1...
    for r in reqs('mid'):
      gen.submit(r)
    gen.update_params(p1, 1)
    gen.wait_loaded(1)
    done = []
    while gen.num_unfinished:
      done += gen.step()
    for c in done:
      assert (np.diff(c.versions) >= 0).all() and set(c.versions.tolist()) <= {0, 1}
    after = api.generate(gen, reqs('b'))
    for c in after:  # loaded through shared memory: log mu is the trainer's log pi under p1
      assert (c.versions == 1).all()
      assert_logprobs_under(p1, config, c)
    assert gen.stats()['version'] == 1

    # Killed mid-generation, right after version 2 was published: a fresh child loads version 2
    # from the segment, the requests in flight restart from their prompts, none returns twice.
    short, long = reqs('short', 4, max_tokens=2), reqs('long', 4, max_tokens=48)
    for r in short + long:
      gen.submit(r)
    returned = []
    while len(returned) < len(short):
      returned += gen.step()
    assert {c.request_id for c in returned} == {r.request_id for r in short}
    gen.update_params(p2, 2)
    kill(gen)
    after_kill = []
    while gen.num_unfinished:
      after_kill += gen.step()
    ids = [c.request_id for c in returned + after_kill]
    assert sorted(ids) == sorted(r.request_id for r in short + long)  # each exactly once
    stats = gen.stats()
    assert stats['restarts'] == 1 and stats['requeued'] == 4 and stats['restart_version'] == 2
    assert stats['last_death'] == 'killed by signal SIGKILL'
    for c in after_kill:
      assert (c.versions >= 2).all() and len(c.tokens) == 48
      assert_logprobs_under(p2, config, c)  # from the prompt, wholly under version 2

    kill(gen)  # the second death exceeds max_restarts=1
    with pytest.raises(generator_process.GeneratorDied,
                       match=r'^vllm_process generator \(pid \d+\) died: killed by signal '
                             r'SIGKILL; restarts used 1 of generation.remote.max_restarts=1'):
      gen.step()
    with pytest.raises(generator_process.GeneratorDied):
      gen.update_params(p1, 3)
  finally:
    gen.close()


@needs_vllm
def test_pool_keeps_groups_together_and_updates_every_generator(demo):
  from pipelinerl_jax.generation.vllm import pool as generator_pool
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  model_dir, config = demo
  p1 = sharp_params(config, 7)
  pool = generator_pool.GeneratorPool(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=8, max_model_len=64, kv_cache_bytes=16 << 20), num_generators=2)
  try:
    pool.update_params(p1, 1)
    pool.wait_loaded(1)
    groups = [[api.Request(f'g{g}/{j}', [5 + g, 6, 7, 8], api.SamplingParams(max_tokens=10),
                           seed=10 * g + j, metadata=dict(group=g, index=j))
               for j in range(4)] for g in range(3)]
    for group in groups:
      for r in group:
        pool.submit(r)
    where = {rid: i for i, child in enumerate(pool.children) for rid in child._inflight}
    for group in groups:  # a group on one child; the second group on the less-loaded one
      assert len({where[r.request_id] for r in group}) == 1
    assert where['g0/0'] != where['g1/0']
    done = []
    while pool.num_unfinished:
      done += pool.step()
    assert sorted(c.request_id for c in done) == sorted(r.request_id for g in groups for r in g)
    for c in done:
      assert (c.versions == 1).all()
      assert_logprobs_under(p1, config, c)
    stats = pool.stats()
    assert stats['version'] == 1 and len(stats['generators']) == 2
    assert stats['tokens_generated'] == 120 and pool._route == {}
  finally:
    pool.close()


def test_assign_devices_splits_the_gpus_the_mesh_leaves_free():
  from pipelinerl_jax.generation.vllm.placement import assign_devices
  gpus = [str(i) for i in range(8)]
  assert assign_devices(gpus, 4, 4) == [('4',), ('5',), ('6',), ('7',)]
  assert assign_devices(gpus, 4, 2) == [('4', '5'), ('6', '7')]
  assert assign_devices(gpus, 5, 2, per_child_max=1) == [('5',), ('6',)]  # a remainder: unused
  assert assign_devices(gpus, 2, 2, '5,7') == [('5',), ('7',)]
  assert assign_devices(['3', '1', '6'], 1, 2) == [('1',), ('6',)]  # the trainer's own ids
  assert assign_devices([], 1, 3) == [(), (), ()]  # CPU host: the children inherit


@pytest.mark.parametrize('visible, used, n, requested, per_child_max, match', [
    ('', 1, 1, '0', None, 'this host has no GPUs'),
    ('01234567', 8, 1, '', None, 'the train mesh uses 8 of 8 GPUs, leaving 0'),
    ('01234567', 6, 3, '', None, 'leaving 2 for generation.num_generators=3'),
    ('01234567', 4, 2, '3,4', None, r'GPU\(s\) 3 belong to the train mesh'),
    ('01234567', 4, 2, '5,9', None, r'GPU\(s\) 9 are not visible'),
    ('01234567', 4, 2, '5,5', None, 'names a GPU twice'),
    ('01234567', 4, 2, '5,6,7', None, 'do not split evenly'),
    ('01234567', 4, 2, '', 1, r'tensor parallelism.*num_generators=4'),
])
def test_assign_devices_refuses_impossible_assignments(visible, used, n, requested,
                                                       per_child_max, match):
  from pipelinerl_jax.generation.vllm.placement import assign_devices
  with pytest.raises(ValueError, match=match) as e:
    assign_devices(list(visible), used, n, requested, per_child_max)
  assert str(e.value).startswith('config.generation.remote.devices')
  assert '\n' not in str(e.value)


@needs_vllm
def test_gloo_transport_loads_updates_times_out_clearly_and_rejoins_after_restart(demo):
  from pipelinerl_jax.generation.vllm import child
  from pipelinerl_jax.generation.vllm import process as generator_process
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  import torch.distributed as dist
  model_dir, config = demo
  p1, p2 = sharp_params(config, 5), sharp_params(config, 6)
  reqs = lambda tag: [api.Request(f'{tag}{i}', [5 + i, 6, 7, 8], api.SamplingParams(
      temperature=1.0, max_tokens=8), seed=i) for i in range(3)]
  gen = generator_process.GeneratorProcess(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=8, max_model_len=64, kv_cache_bytes=16 << 20),
      config=child.ProcessConfig(max_restarts=1, weight_transport='gloo',
                                             transport_timeout_s=5, bucket_mb=1))
  try:
    gen.update_params(p1, 1)  # broadcast over the gloo group, applied between two steps
    gen.wait_loaded(1)
    for c in api.generate(gen, reqs('a')):
      assert (c.versions == 1).all()
      assert_logprobs_under(p1, config, c)
    assert not dist.is_initialized()

    # A child that never takes its part of the broadcast: a one-line TimeoutError, not a hang;
    # the child is killed and its replacement joins a new group and gets version 2 first.
    os.kill(gen._proc.pid, signal.SIGSTOP)
    with pytest.raises(TimeoutError, match=r"^vllm_process: weight update 2 did not complete "
                       r"over generation.remote.weight_transport='gloo' within 5s") as e:
      gen.update_params(p2, 2)
    assert '\n' not in str(e.value)
    after = api.generate(gen, reqs('b'))
    assert gen.stats()['restarts'] == 1
    for c in after:
      assert (c.versions == 2).all()
      assert_logprobs_under(p2, config, c)

    # The child's side: an announced update that never arrives ends the child with a one-line
    # error (here past max_restarts=1, so it is the GeneratorDied message's last error).
    gen._requests.put(('weights', 3))  # announced, never sent
    deadline = time.monotonic() + 60
    with pytest.raises(generator_process.GeneratorDied,
                       match=r"its last error: RuntimeError: "
                             r"generation.remote.weight_transport='gloo': "
                             r'TimeoutError: weight update not received within 5s'):
      while time.monotonic() < deadline:
        gen.step()
  finally:
    gen.close()
