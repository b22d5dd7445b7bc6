"""The pipeline end to end on a tiny model: lag bound, overlap, failures, Ctrl-C.

Conventional mode's k-step sync (lags 0 then 1, no overlap) is tested without a run in
loops_test; a real conventional run is checkpoint_test's exact resume."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import ml_collections
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import packing
from pipelinerl_jax.generation import jax_engine as engine_lib
from pipelinerl_jax.pipeline import placements
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import supervise

import xla_env  # tests/ is on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent


def small_config(**rl):
  c = config_lib.load_preset()
  c.log.tensorboard = True
  c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  c.rl.total_steps = 6
  c.rl.max_time_s = 0.0
  c.log.progress = False
  for k, v in rl.items():
    c.rl[k] = v
  return c


def test_pipeline_mode_overlaps_and_bounds_lag(model_dir, tmp_path):
  summary = launch.run_experiment(small_config(max_lag=1), str(tmp_path), model_dir=model_dir)
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == list(range(1, 7))
  for r in records:
    assert set(metrics_lib.REQUIRED_KEYS) <= set(r)
    assert 0 <= r['lag_min'] <= r['lag_mean'] <= r['lag_max'] <= 1
    assert 0 < r['ess'] <= 1 + 1e-6
    assert 1 <= r['versions_per_sample_mean'] <= r['versions_per_sample_max'] <= 2
    assert 0 <= r['frac_multi_version'] <= 1 and 0 <= r['frac_hit_length_limit'] <= 1
    assert 0 <= r['lag_last_token_mean'] <= r['lag_first_token_mean'] <= 1
    assert r['publish_s'] > 0
  assert summary['max_lag_seen'] <= 1
  assert summary['gen_train_overlap_s'] > 0  # generation kept running during train steps
  assert summary['gen_busy_s'] > 0 and summary['train_busy_s'] > 0
  assert (tmp_path / 'curves.png').stat().st_size > 10_000
  assert any(p.name.startswith('events.out.tfevents') for p in (tmp_path / 'tb').iterdir())


def test_micro_batch_rows_fix_rows_per_shard_in_a_run(model_dir, tmp_path, monkeypatch):
  shapes = []
  real_split = packing.split_microbatches

  def recording_split(batch, num_micro):
    out = real_split(batch, num_micro)
    shapes.append(out['tokens'].shape)
    return out

  monkeypatch.setattr(packing, 'split_microbatches', recording_split)
  c = small_config(mode='conventional', total_steps=2)
  c.train.mesh, c.train.micro_batch_rows = '1,2,1', 1
  launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  assert len(shapes) == 2
  for m, r, _ in shapes:
    assert r == 2 and m & (m - 1) == 0  # 1 row on each of the 2 shards; 2^k micro-batches


def test_loop_failure_stops_everything_with_a_named_error(model_dir, tmp_path, monkeypatch):
  calls = []
  real_step = engine_lib.JaxEngine.step

  def failing_step(self):
    calls.append(1)
    if len(calls) == 5:
      raise RuntimeError('generator died')
    return real_step(self)

  monkeypatch.setattr(engine_lib.JaxEngine, 'step', failing_step)
  t0 = time.monotonic()
  with pytest.raises(supervise.RunError, match='actor loop failed: RuntimeError: generator died'):
    launch.run_experiment(small_config(total_steps=1000), str(tmp_path), model_dir=model_dir)
  assert time.monotonic() - t0 < 60
  # Both loops joined. (Named, not counted: tensorboardX's queue feeder thread ends on its own
  # shortly after the writer closes, which made a thread count racy.)
  assert not {'actor', 'trainer'} & {t.name for t in threading.enumerate()}


@pytest.mark.serial
def test_ctrl_c_stops_within_ten_seconds(model_dir, tmp_path):
  """The main command with its generator in the process (the default placement). SIGTERM, which
  the same handler takes: ray_pipeline_test (generator actors); a signal of either kind at any
  point of start-up: faults_test."""
  cmd = [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
         f'--workdir={tmp_path}', f'--config.model.path={model_dir}',
         '--config.rl.total_steps=100000', '--config.rl.batch_size=16',
         '--config.rl.group_size=4', '--config.generation.num_slots=16']
  env = xla_env.one_device(PYTHONUNBUFFERED='1')
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  metrics = tmp_path / 'metrics.jsonl'
  try:
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count('\n') >= 2):
      assert proc.poll() is None, proc.stdout.read()
      assert time.monotonic() < deadline, 'training never started'
      time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, out  # 128 + SIGINT
  # Both loops stop within 10 s of the signal; the exit checkpoint and the curves come after
  # (the whole exit is bounded by communicate's 30 s above).
  stopped_s = float(re.search(r'loops stopped ([0-9.]+) s after the interrupt', out).group(1))
  assert stopped_s < 10, f'loops took {stopped_s:.1f} s to stop (process exited after {elapsed:.1f} s)'
  assert 'Interrupted: actor and trainer stopped after' in out
  steps = [json.loads(line)['step'] for line in metrics.read_text().splitlines()]
  assert steps == list(range(1, len(steps) + 1))  # every completed step was logged, in order
  # The checkpoint at exit was written before exit code 130, at the last trained step.
  assert [int(p.name) for p in (tmp_path / 'checkpoints').iterdir()] == [steps[-1]]
  assert 'Checkpoint saved in' in out


def test_published_params_never_alias_the_trainers_buffers():
  device = jax.devices()[0]
  params = {'w': jax.numpy.arange(8.0), 'b': jax.numpy.ones((2, 3))}
  # Also params replicated over 8 devices, one of whose shards already sits on `device`.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  for source in (params, replicated):
    copied = placements.copy_params_fn(device)(source)
    for a, b in zip(jax.tree.leaves(source), jax.tree.leaves(copied)):
      assert b.devices() == {device}
      pointers = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
      assert b.unsafe_buffer_pointer() not in pointers
      np.testing.assert_array_equal(a, b)


def test_collective_publisher_copies_in_the_wire_dtype_where_the_params_are():
  """Over nccl the pool keeps what is published to send it (and re-send it after a restart): a
  copy in vLLM's serving dtype, sharded as the params are, never the trainer's buffers."""
  c = config_lib.load_preset('qwen1p5b_8xh100')
  config = config_lib.validate(c, runnable=False)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('fsdp',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp'))
  params = {'w': jax.device_put(jax.numpy.arange(16.0) / 3, sharding)}
  published = []

  class Pool:
    def update_params(self, p, version):
      published.append((p, version))

  placements.publisher(config, mesh, Pool(), 'bfloat16')(params, 3)
  (copy, version), = published
  w = copy['w']
  assert version == 3 and w.dtype == jax.numpy.bfloat16 and w.sharding.is_equivalent_to(
      sharding, 1)
  assert not {s.data.unsafe_buffer_pointer() for s in w.addressable_shards} & {
      s.data.unsafe_buffer_pointer() for s in params['w'].addressable_shards}
  np.testing.assert_array_equal(w, params['w'].astype(jax.numpy.bfloat16))


def test_stream_capacity_rules():
  # Pipeline: the tighter of the lag bound and "H in flight plus one batch queued".
  rl = lambda mode, max_lag, steps: config_lib.RLConfig(mode=mode, batch_size=64, max_lag=max_lag,
                                                        conventional_steps=steps)
  assert stream_lib.capacity(rl('pipeline', 4, 1), num_slots=64) == 128
  assert stream_lib.capacity(rl('pipeline', 1, 1), num_slots=256) == 128
  assert stream_lib.capacity(rl('pipeline', 0, 1), num_slots=256) == 64
  assert stream_lib.capacity(rl('conventional', 4, 3), num_slots=64) == 192


def _group(gid, version, n=2):
  samples = [packing.Sample(prompt_tokens=np.array([1, 2]), completion_tokens=np.array([3]),
                            behaviour_logprobs=np.array([-1.0]), versions=np.array([version]),
                            advantage=0.0) for _ in range(n)]
  return stream_lib.Group(group_id=gid, problem_id=str(gid), samples=samples,
                          rewards=np.zeros(n), statuses=['wrong'] * n, finished_at=float(gid))


def test_stream_credits_order_and_stop():
  stop = threading.Event()
  s = stream_lib.SampleStream(capacity=4, stop=stop)
  assert s.try_acquire(2) and s.try_acquire(2) and not s.try_acquire(2)
  s.put(_group(0, version=3))
  s.put(_group(1, version=1))
  taken = s.take(2)
  assert [g.group_id for g in taken] == [1]  # oldest policy version first
  s.release(2)
  assert s.try_acquire(2)
  stop.set()
  with pytest.raises(stream_lib.Stopped):
    s.take(4)  # only 2 samples queued and the run is stopping


@pytest.mark.parametrize('key,value,message', [
    ('generation.num_slots', 0, 'H must be >= 1'),
    ('rl.batch_size', 10, 'multiple of rl.group_size'),
    ('rl.max_lag', -1, 'must be >= 0'),
    ('rl.mode', 'async', "must be one of 'pipeline', 'conventional'"),
    ('train.seq_len', 4, 'samples would not fit'),
    ('train.mesh', '2,2', 'data,fsdp,tensor'),
    ('optimizer.lr', -1.0, 'must be finite and > 0'),
    ('loss.kind', 'dpo', "must be one of 'pipelinerl', 'ppo', 'gspo'"),
    ('generation.num_slots', 2.5, 'must be an integer'),
    ('rl.max_lag', True, 'must be an integer'),
    ('generation.num_generators', 2, "need placement 'ray'"),
    ('generation.placement', 'process', "'process' was replaced by 'ray'"),
    ('generation.remote.max_restarts', -1, 'must be >= 0'),
    ('generation.remote.weight_transport', 'mpi',
     "must be one of 'object_store', 'nccl', 'gloo'"),
    ('generation.remote.weight_transport', 'shm', "'shm' was replaced by 'object_store'"),
    ('generation.remote.weight_transport', 'gloo', "set placement='ray'"),
    ('generation.remote.transport_timeout_s', 0.0, 'must be > 0'),
    ('generation.remote.devices', '4,x', "must be distinct GPU ids like '4,5,6,7'"),
    ('generation.remote.devices', '4,4', 'must be distinct GPU ids'),
    ('generation.remote.devices', '4', "set placement='ray'"),
    ('generation.remote.cpus_per_generator', 0, 'must be >= 1'),
    ('generation.remote.gpus_per_generator', 2, 'without tensor parallelism'),
    ('cluster.address', 'localhost', "must be '' (start Ray locally), 'auto' or 'HOST:PORT'"),
    ('cluster.num_cpus', 2, "applies to generation.placement='ray' only"),
    ('train.cores', 'free', "the cores that generators as Ray actors left"),
    ('train.cores', 'some', "must be one of 'all', 'free'"),
    ('generation.vllm.kv_cache_mb', 0, 'must be >= 1'),
    ('generation.vllm.gpu_memory_utilization', 1.5, 'must be in [0, 1] (0 = use kv_cache_mb)'),
    ('generation.vllm.cuda_graphs', 1, 'must be true/false'),
    ('train.micro_batch_rows', -1, 'must be >= 0'),
    ('model.attention', 'flash', "must be one of 'blockwise', 'dense'"),
    ('model.attention_block_kv', 0, 'must be >= 1'),
    ('generation.kv_page_size', 0, 'must be >= 1'),
    ('generation.kv_pool_mb', -1, 'must be >= 0'),
    ('generation.decode_attention', 'flash', "must be one of 'xla', 'pallas', 'cudnn'"),
    ('generation.sync_every', -2, 'must be >= 0 or -1 (auto)'),
    ('generation.prefill_chunk', -8, 'must be >= 0'),
    ('task.chat_template_kwargs', {'tools': [1]}, "must be a dict of names to numbers, strings"),
    ('task.chat_template_kwargs', {'enable_thinking': False}, "apply to task 'math' only"),
    ('model.demo.architecture', 'gemma', "must be one of 'qwen2', 'qwen3'"),
])
def test_invalid_config_values_name_the_key(key, value, message):
  # Through a plain dict: ConfigDict's own type check only guards single-field writes.
  d = config_lib.load_preset().to_dict()
  *sections, field = key.split('.')
  node = d
  for section in sections:
    node = node[section]
  node[field] = value
  with pytest.raises(ValueError, match=f'config.{sections[0]}') as e:
    config_lib.validate(ml_collections.ConfigDict(d))
  assert message in str(e.value) and '\n' not in str(e.value)


def test_renamed_config_keys_name_their_new_place():
  c = config_lib.load_preset()
  c.generation.vllm_kv_cache_mb = 64
  with pytest.raises(ValueError, match=r'^config.generation.vllm_kv_cache_mb: unknown key '
                                       r'\(renamed: use config.generation.vllm.kv_cache_mb\)$'):
    config_lib.validate(c)
  c = config_lib.load_preset()
  c.generation.backend = 'vllm_process'
  with pytest.raises(ValueError, match="backend='vllm' with placement='ray'"):
    config_lib.validate(c)


def test_base_config_round_trips_to_the_typed_config():
  typed = config_lib.validate(config_lib.base_config())
  assert typed == config_lib.Config()
  assert config_lib.validate(config_lib.to_config_dict(typed)) == typed


def test_micro_batch_rows_and_micro_batches_are_not_both_set():
  c = config_lib.load_preset()
  c.train.micro_batches, c.train.micro_batch_rows = 4, 2
  with pytest.raises(ValueError, match=r'config.train.micro_batch_rows: set it or '
                                       r'train.micro_batches \(=4\), not both'):
    config_lib.validate(c)


def test_unknown_config_key_is_an_error():
  c = config_lib.load_preset()
  c.rl.max_lagg = 3
  with pytest.raises(ValueError, match=r'config.rl.max_lagg: unknown key'):
    config_lib.validate(c)


def test_verified_updates_are_refused_where_nothing_could_check_them():
  c = small_config()
  c.generation.placement, c.generation.remote.verify_updates = 'ray', True
  config_lib.validate(c)
  c.generation.backend = 'vllm'
  with pytest.raises(ValueError, match=r"config.generation.remote.verify_updates: checks the "
                                       r"params the actors hand the JAX engine \(backend 'jax'\), "
                                       r"not 'vllm'"):
    config_lib.validate(c)
  c.generation.backend, c.train.num_processes = 'jax', 2
  with pytest.raises(ValueError, match=r"needs the whole params on one trainer process: with "
                                       r"several, use weight_transport 'gloo' or 'nccl'"):
    config_lib.validate(c)
  c.generation.remote.weight_transport = 'gloo'
  config_lib.validate(c)


def test_unknown_preset_is_an_error():
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    config_lib.load_preset('huge')


@pytest.mark.needs('vllm')
@pytest.mark.parametrize('placement', ['inline', pytest.param('ray', marks=pytest.mark.serial)])
def test_pipeline_runs_with_vllm_backends(model_dir, qwen3_model_dir, tmp_path, placement):
  """placement 'inline' runs vLLM in this process on the Qwen3-format test model (tied); 'ray'
  runs 2 vLLM generator actors on the Qwen2 one, one of which is killed after the first
  optimizer step: Ray restarts it, its requests are re-routed and the run completes."""
  c = small_config(max_lag=1, total_steps=4)
  c.generation.backend = 'vllm'
  c.generation.placement = placement
  c.generation.vllm.kv_cache_mb = 64
  if placement == 'ray':
    c.generation.num_generators = 2
    c.cluster.num_cpus = 2
  killed = []

  def kill_a_generator_after_step_1(live):
    def body():
      while live['trainer'].step < 1 and not live['stop'].is_set():
        time.sleep(0.05)
      victim = live['engine'].members()[0]['pid']
      os.kill(victim, signal.SIGKILL)  # an actor this run started
      killed.append(victim)
    threading.Thread(target=body, daemon=True).start()

  summary = launch.run_experiment(
      c, str(tmp_path), model_dir=qwen3_model_dir if placement == 'inline' else model_dir,
      on_ready=kill_a_generator_after_step_1 if placement == 'ray' else None)
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2, 3, 4]
  # Step 1 trains on tokens of version 0 with version 0's params: vLLM's log mu and the
  # trainer's log pi differ only by numerics (both fp32).
  assert records[0]['lag_max'] == 0 and records[0]['abs_logp_diff'] <= 1e-4, records[0]
  # Tokens carry the versions vLLM generated them with: after step 1 some come from version >= 1.
  assert max(r['lag_max'] for r in records) <= 1
  assert any(r['lag_min'] < r['step'] - 1 for r in records[1:])
  assert summary['gen_train_overlap_s'] > 0
  if placement == 'ray':
    assert killed and summary['samples'] == 4 * 16
