"""Checkpoints: exact resume, pruning, save at exit, bad dirs, HF export round trip."""

import _thread
import json
import threading
import types
import zlib

import jax
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import export as export_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import stream as stream_lib
from pipelinerl_jax.pipeline import trainer as trainer_lib
from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base as tasks_base

import pipeline_test  # its small_config (tests/ is on sys.path under pytest)


@pytest.fixture
def varied_rewards(monkeypatch):
  """The untrained model never answers right: all-zero rewards, zero advantages, zero gradients,
  and params that never move would make any resume look exact. A reward that is a fixed
  function of the completion text varies within groups and stays deterministic."""
  def score(self, problem, text, truncated=False, num_tokens=None):
    return tasks_base.Score(float(zlib.crc32(text.encode()) % 2), 'wrong')
  monkeypatch.setattr(arithmetic.ArithmeticTask, 'score', score)


def small_state(model_dir, mesh_devices=8):
  config = pipeline_test.small_config()
  model_config = hf_schema.load_config(model_dir)
  mesh = sharding_lib.make_mesh(1, mesh_devices, 1)
  optimizer = train.make_optimizer(config_lib.OptimizerConfig())
  target, _ = checkpoint_lib.abstract_state(model_config, optimizer, mesh)
  params = hf_checkpoint.load_params(model_dir, model_config,
                             shardings=jax.tree.map(lambda x: x.sharding, target.params))
  state, shardings = train.create_sharded_state(params, optimizer, mesh)
  return config, model_config, optimizer, mesh, state, shardings


def fake_meta(config, model_dir, step):
  stream = stream_lib.SampleStream(16, threading.Event(),
                                   ledger=stream_lib.GroupLedger(4 * step, [4 * step + 2]))
  trainer = trainer_lib.Trainer(
      types.SimpleNamespace(step=step), None, None, None, stream, None, None, None, None)
  trainer.samples_trained, trainer.max_lag_seen = 16 * step, 1
  return checkpoint_lib.run_meta(config_lib.validate(config), model_dir,
                                 trainer.checkpoint_meta())


def leaves_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_exact_resume_conventional(model_dir, tmp_path, varied_rewards):
  """The issue's acceptance test: 4 steps straight == 2 steps, exit, resume, 2 more steps."""
  def config(total_steps):
    c = pipeline_test.small_config(mode='conventional', conventional_steps=2,
                                   total_steps=total_steps)
    c.log.tensorboard = False
    c.checkpoint.every_steps = 0  # only at exit
    return c

  a = launch.run_experiment(config(4), str(tmp_path / 'a'), model_dir=model_dir)
  b1 = launch.run_experiment(config(2), str(tmp_path / 'b'), model_dir=model_dir)
  assert b1['steps'] == 2 and b1['checkpoint'] == str(tmp_path / 'b' / 'checkpoints')
  meta = checkpoint_lib.read_meta(tmp_path / 'b' / 'checkpoints')
  # At a sync boundary every admitted group was trained: 2 steps x 16 samples / 4 per group.
  assert meta['data'] == dict(next_group=8, done_above=[]) and meta['policy_version'] == 2
  b2 = launch.run_experiment(config(4), str(tmp_path / 'b'), model_dir=model_dir)
  assert b2['steps'] == 4 and b2['samples'] == a['samples']

  initial = hf_checkpoint.load_params(model_dir, hf_schema.load_config(model_dir))
  assert not np.array_equal(a['final_state'].params['embed']['embedding'],
                            initial['embed']['embedding'])  # training did move the params
  leaves_equal(a['final_state'], b2['final_state'])  # params, optimizer state and step
  ra = metrics_lib.read_metrics(str(tmp_path / 'a' / 'metrics.jsonl'))
  rb = metrics_lib.read_metrics(str(tmp_path / 'b' / 'metrics.jsonl'))
  assert [r['step'] for r in rb] == [1, 2, 3, 4]
  for key in ('loss', 'reward_mean', 'grad_norm', 'lag_max', 'num_tokens'):
    assert [r[key] for r in ra] == [r[key] for r in rb], key


@pytest.mark.serial
def test_interrupt_saves_then_pipeline_resume_continues(model_dir, tmp_path, varied_rewards,
                                                        python_sigint):
  """A KeyboardInterrupt in the main thread (Ctrl-C) still writes the trained state; the resumed
  run continues the step count and the engine's policy version, and keeps the last k."""
  c = pipeline_test.small_config(max_lag=1, total_steps=1000)
  c.log.tensorboard = False
  c.checkpoint.every_steps = 0  # only at exit

  def on_ready(live):
    def interrupt_after_two_steps():
      # (samples_trained, a plain int: the state's step may be a donated buffer mid-step)
      while live['trainer'].samples_trained < 2 * 16 and not live['stop'].is_set():
        live['stop'].wait(0.05)
      if not live['stop'].is_set():
        _thread.interrupt_main()
    threading.Thread(target=interrupt_after_two_steps, daemon=True).start()

  first = launch.run_experiment(c, str(tmp_path), model_dir=model_dir, on_ready=on_ready)
  steps = first['steps']
  assert first['interrupted'] and steps >= 2, (first['interrupted'], steps)
  root = tmp_path / 'checkpoints'
  assert [int(p.name) for p in root.iterdir()] == [steps]
  model_config = hf_schema.load_config(model_dir)
  leaves_equal(checkpoint_lib.load_params(root, model_config), first['final_state'].params)
  before = checkpoint_lib.read_meta(root)

  c.rl.total_steps = steps + 3
  c.checkpoint.every_steps, c.checkpoint.keep = 1, 2
  second = launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == list(range(1, steps + 4))
  # The engine resumed at version `steps`: had it restarted at 0, every sample it generated
  # would be `steps` > max_lag steps stale, dropped, and the run would never train again.
  assert all(r['lag_max'] <= 1 for r in records[steps:])
  assert second['samples'] == first['samples'] + 3 * 16  # counters continue too
  after = checkpoint_lib.read_meta(root)
  assert after['policy_version'] == steps + 3
  assert sorted(int(p.name) for p in root.iterdir()) == [steps + 2, steps + 3]  # the last 2
  finished = lambda m: set(range(m['data']['next_group'])) | set(m['data']['done_above'])
  assert finished(before) < finished(after)
  assert len(finished(after) - finished(before)) >= 3 * 16 // 4  # 3 steps of 4 groups


def test_keep_last_k_and_due(model_dir, tmp_path):
  config, _, _, _, state, _ = small_state(model_dir, mesh_devices=1)
  saver = checkpoint_lib.Checkpointer(str(tmp_path / 'ck'), keep=2, every_steps=3)
  assert not saver.save(state, fake_meta(config, model_dir, 0))  # step 0 is the model dir
  for step in range(1, 6):
    assert saver.save(state.replace(step=jax.numpy.int32(step)), fake_meta(config, model_dir, step))
  assert sorted(int(p.name) for p in (tmp_path / 'ck').iterdir()) == [4, 5]
  assert not saver.save(state.replace(step=jax.numpy.int32(5)), fake_meta(config, model_dir, 5))
  saver.last_saved = 2
  assert [saver.due(s) for s in (2, 3, 4, 6)] == [False, True, True, True]
  saver.last_saved = 4
  assert [saver.due(s) for s in (5, 6, 7)] == [False, True, True]  # 6 is a boundary, 7 passed it
  assert not checkpoint_lib.Checkpointer(str(tmp_path / 'x'), 1, every_steps=0).due(100)


def test_restore_places_arrays_in_the_trainers_shardings(model_dir, tmp_path):
  config, model_config, optimizer, mesh, state, shardings = small_state(model_dir)
  saver = checkpoint_lib.Checkpointer(str(tmp_path / 'ck'), keep=1, every_steps=0)
  saver.save(state.replace(step=jax.numpy.int32(7)), fake_meta(config, model_dir, 7))
  target, _ = checkpoint_lib.abstract_state(model_config, optimizer, mesh)
  restored, meta = saver.restore(target)
  assert int(restored.step) == 7 and meta['data'] == dict(next_group=28, done_above=[30])
  leaves_equal(restored.params, state.params)
  leaves_equal(restored.opt_state, state.opt_state)
  for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
    assert x.sharding == s
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(restored.params))  # really sharded


def test_bad_checkpoint_dirs_give_one_line_errors_naming_the_path(model_dir, tmp_path):
  config, model_config, _, _, state, _ = small_state(model_dir, mesh_devices=1)
  missing = tmp_path / 'nope'
  with pytest.raises(FileNotFoundError, match=str(missing)):
    checkpoint_lib.load_params(missing, model_config)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no checkpoint here'):
    checkpoint_lib.load_params(tmp_path / 'empty', model_config)

  root = tmp_path / 'work' / 'checkpoints'
  saver = checkpoint_lib.Checkpointer(str(root), keep=1, every_steps=0)
  saver.save(state.replace(step=jax.numpy.int32(3)), fake_meta(config, model_dir, 3))
  with pytest.raises(FileNotFoundError, match='no checkpoint of step 9'):
    checkpoint_lib.load_params(root, model_config, step=9)
  for f in (root / '3' / 'state').rglob('*'):  # corrupt: every data file truncated
    if f.is_file():
      f.write_bytes(b'')
  config.checkpoint.every_steps = 0
  with pytest.raises(ValueError) as e:
    launch.run_experiment(config, str(tmp_path / 'work'), model_dir=model_dir)
  assert str(root / '3') in str(e.value) and '\n' not in str(e.value)
  with pytest.raises(ValueError, match=str(root / '3')):
    checkpoint_lib.load_params(root, model_config)

  config.checkpoint.resume = False  # a fresh run must not mix its checkpoints with these
  with pytest.raises(ValueError, match=f'config.checkpoint.resume: .*{root}') as e:
    launch.run_experiment(config, str(tmp_path / 'work'), model_dir=model_dir)
  assert '\n' not in str(e.value)


def test_seed_mismatch_refuses_to_resume(model_dir, tmp_path):
  config, _, _, _, state, _ = small_state(model_dir, mesh_devices=1)
  saver = checkpoint_lib.Checkpointer(str(tmp_path / 'checkpoints'), keep=1, every_steps=0)
  saver.save(state.replace(step=jax.numpy.int32(1)), fake_meta(config, model_dir, 1))
  config.seed = 5
  config.train.mesh = '1,1,1'
  with pytest.raises(ValueError, match="config.seed: 5 differs from the checkpoint's seed 0"):
    launch.run_experiment(config, str(tmp_path), model_dir=model_dir)


def test_data_stream_skips_what_was_finished():
  problems = iter(f'p{i}' for i in range(100))
  ids, probs = checkpoint_lib.data_stream(problems, dict(next_group=3, done_above=[4, 6]))
  assert [(next(ids), next(probs)) for _ in range(4)] == [
      (3, 'p3'), (5, 'p5'), (7, 'p7'), (8, 'p8')]
  ledger = stream_lib.GroupLedger(3, [4, 6])
  ledger.mark([3, 5])
  assert ledger.position() == dict(next_group=7, done_above=[])
  ledger.mark([9, 2])
  assert ledger.position() == dict(next_group=7, done_above=[9])


def test_export_round_trip(model_dir, tmp_path):
  config, model_config, _, _, state, _ = small_state(model_dir, mesh_devices=1)
  trained = jax.tree.map(lambda x: x * 1.5 + 0.25, state.params)  # not the model dir's values
  saver = checkpoint_lib.Checkpointer(str(tmp_path / 'checkpoints'), keep=2, every_steps=0)
  saver.save(state.replace(step=jax.numpy.int32(2)), fake_meta(config, model_dir, 2))
  saver.save(state.replace(step=jax.numpy.int32(3), params=trained),
             fake_meta(config, model_dir, 3))
  out = tmp_path / 'hf'
  export_lib.export_hf(tmp_path / 'checkpoints', None, out)  # model dir as recorded
  names = {p.name for p in out.iterdir()}
  assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'} <= names
  assert 'warmstart.json' not in names
  assert json.loads((out / 'config.json').read_text())['dtype'] == 'float32'

  leaves_equal(hf_checkpoint.load_params(out, model_config), trained)
  # load_params: a checkpoints dir (latest), one step dir, a given step, an HF dir.
  leaves_equal(checkpoint_lib.load_params(tmp_path / 'checkpoints', model_config), trained)
  leaves_equal(checkpoint_lib.load_params(tmp_path / 'checkpoints' / '2', model_config),
               state.params)
  leaves_equal(checkpoint_lib.load_params(tmp_path / 'checkpoints', model_config, step=2),
               state.params)
  leaves_equal(checkpoint_lib.load_params(out, model_config), trained)

  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  np.testing.assert_array_equal(model.get_input_embeddings().weight.detach().numpy(),
                                np.asarray(trained['embed']['embedding']))
  assert tokenizer.eos_token_id is not None
