"""Shared-memory weight transport, and the vLLM generator in its own process."""

import multiprocessing as mp
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import shm_weights
from pipelinerl_jax.generation import weight_sync
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
  _, size, capacity = shm_weights.manifest_for(CONFIG)
  seg = shm_weights.Segment.create(size, mp.get_context('spawn').Lock(), capacity)
  yield seg
  seg.close(unlink=True)


def test_round_trip_gives_the_hf_tensors(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  shm_weights.write_update(segment, params, CONFIG, version=3)
  with segment.lock:
    version, views = shm_weights.read_update(segment)
    assert version == 3
    ref = list(weight_sync.hf_torch_tensors(params, CONFIG))
    assert [n for n, _ in views] == [n for n, _ in ref]
    raw = np.frombuffer(segment.shm.buf, np.uint8)
    base, end = raw.ctypes.data, raw.ctypes.data + raw.size
    for (name, v), (_, r) in zip(views, ref):
      np.testing.assert_array_equal(v.numpy(), r.numpy(), err_msg=name)
      assert base + segment.data_start <= v.data_ptr() < end, name  # a view, not a copy
    del views, raw


def test_corrupt_or_half_written_segments_are_rejected(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  shm_weights.write_update(segment, params, CONFIG, version=1)
  segment.shm.buf[segment.data_start + 100] ^= 0xFF  # one flipped byte
  with segment.lock, pytest.raises(shm_weights.TransportError, match='checksum'):
    shm_weights.read_update(segment)
  segment.write_header(state=shm_weights.WRITING)  # a writer that died part-way
  with segment.lock, pytest.raises(shm_weights.TransportError, match='no complete update'):
    shm_weights.read_update(segment)
  segment.write_header(state=shm_weights.VALID, payload=12)
  with segment.lock, pytest.raises(shm_weights.TransportError, match='payload'):
    shm_weights.read_update(segment)


def test_writer_times_out_with_a_clear_error_while_the_reader_holds_the_lock(segment):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  with segment.lock:
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match='generator .reader. has held the lock'):
      shm_weights.write_update(segment, params, CONFIG, version=1, timeout=0.2)
    assert time.perf_counter() - start < 5


@needs_vllm
def test_generator_process_loads_updates_and_reports_its_death(tmp_path):
  from pipelinerl_jax.generation import generator_process
  from pipelinerl_jax.generation import vllm_engine
  model_dir = warmstart.build_demo_model(
      tmp_path / 'demo', warmstart.WarmStartConfig(max_steps=0, eval_problems=8),
      log=lambda _: None)
  config = hf_io.load_config(model_dir)
  p1 = jax.tree.map(lambda x: x * 2.0, transformer.init_params(config, jax.random.PRNGKey(5)))
  reqs = lambda tag: [api.Request(f'{tag}{i}', [5 + i, 6, 7, 8], api.SamplingParams(
      temperature=1.0, max_tokens=12), seed=i) for i in range(4)]

  gen = generator_process.GeneratorProcess(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=8, max_model_len=64, kv_cache_bytes=16 << 20))
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
      seq = jnp.array([c.prompt_tokens + c.tokens.tolist()])
      t = seq.shape[1] - 1
      lp, _ = transformer.token_logprobs(p1, config, seq[:, :-1], seq[:, 1:],
                                         jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))
      np.testing.assert_allclose(c.logprobs, np.asarray(lp[0, 3:]), atol=1e-4)
    assert gen.stats()['version'] == 1

    os.kill(gen._proc.pid, signal.SIGKILL)  # the child we started
    gen._proc.join(timeout=10)
    with pytest.raises(generator_process.GeneratorDied, match='exited with code -9'):
      gen.step()
    with pytest.raises(generator_process.GeneratorDied):
      gen.update_params(p1, 2)
  finally:
    gen.close()
