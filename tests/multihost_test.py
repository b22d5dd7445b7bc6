"""The trainer in 2 processes on localhost (CPU, gloo collectives), as on 2 hosts.

One launch trains: a step of the 2-process mesh equals the single-process step, and each
process gathers a whole copy of its params onto its own devices (what a collective weight
transport sends from process 0); then a
PipelineRL run (process 0 runs the pipeline, process 1 follows), stopped by a SIGTERM to process
1 after two steps, saves checkpoints from both processes, and each dumps the shards it holds. A
second launch restores them in 2 processes of another layout, and the test process restores
them in 1: both equal to the shards saved. A third launch, through the CLI, kills process 1
mid-run: process 0 stops with one line naming it.

Run as a script, this file is the trainer processes' program (`worker`).
"""

import os
import pathlib
import pickle
import signal
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import distributed
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import build as build_lib
from pipelinerl_jax.pipeline import launch as launch_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import signals

pytestmark = pytest.mark.serial  # several JAX processes (jax.distributed), a kill with a deadline

ROOT = pathlib.Path(__file__).resolve().parent.parent
SGD_LR = 0.05
# The trainer processes' environment. XLA's CPU backend at -O0 compiles the train step ~3x
# faster (2 shared cores); numerics are IEEE either way, and both sides of each comparison are
# compiled alike.
ENV = {'TOKENIZERS_PARALLELISM': 'false', 'PYTHONPATH': str(ROOT),
       'XLA_FLAGS': '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'}


def packed_batch(vocab_size: int) -> dict[str, np.ndarray]:
  """B=16 samples of the demo's lengths (prompt <= 8, completion <= 12), off-policy log mu and
  nonzero advantages, packed into rows for 2 micro-batches x 4 shards."""
  rng = np.random.default_rng(7)
  samples = []
  for _ in range(16):
    p, c = int(rng.integers(3, 9)), int(rng.integers(2, 13))
    samples.append(packing.Sample(
        prompt_tokens=rng.integers(1, vocab_size, p),
        completion_tokens=rng.integers(1, vocab_size, c),
        behaviour_logprobs=-3.0 + 0.5 * rng.normal(size=c), versions=np.zeros(c, np.int32),
        advantage=float(rng.normal())))
  batch, _ = packing.pack_samples(samples, seq_len=24, row_multiple=8)
  return batch


def sgd_step(model_dir: str, mesh) -> tuple[train.TrainState, dict]:
  """One train step with SGD (the param change is -lr * gradient, so params compare gradients;
  see train_test.run_steps), the batch placed by the pipeline's batch placer."""
  model_config = hf_schema.load_config(model_dir)
  shapes = jax.eval_shape(lambda k: transformer.init_params(model_config, k),
                          jax.random.PRNGKey(0))
  params = hf_checkpoint.load_params(model_dir, model_config,
                             shardings=sharding_lib.param_shardings(shapes, mesh))
  optimizer = optax.sgd(SGD_LR)
  state, state_sh = train.create_sharded_state(params, optimizer, mesh)
  step = train.jit_train_step(
      train.make_train_step(model_config, config_lib.LossConfig(), optimizer, lambda _: SGD_LR),
      state_sh, mesh)
  put_batch = build_lib.batch_placer(config_lib.TrainConfig(micro_batches=2), mesh)
  state, metrics = step(state, put_batch(packed_batch(model_config.vocab_size)))
  return state, jax.device_get(metrics)


def flat(tree) -> dict[str, jax.Array]:
  return {sharding_lib.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def run_config(workdir: str, model_dir: str, process_id: int | None = None,
               address: str = '') -> config_lib.Config:
  """Trains until stopped (the test sends process 1 a SIGTERM), checkpointing every step."""
  c = config_lib.load_preset()
  c.model.path = model_dir
  c.checkpoint.dir = os.path.join(workdir, 'checkpoints')
  c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  c.rl.total_steps, c.rl.max_time_s = 1000, 0.0
  c.checkpoint.every_steps = 1
  c.log.tensorboard, c.log.progress = False, False
  if process_id is not None:
    c.train.num_processes = 2
    c.train.distributed.coordinator_address = address
    c.train.distributed.process_id = process_id
  return config_lib.validate(c)


# --- the trainer processes ---------------------------------------------------------------------


def worker(mode: str, process_id: int, address: str, out: str, model_dir: str) -> None:
  workdir = os.path.join(out, 'run')
  config = run_config(workdir, model_dir, process_id, address)
  distributed.initialize(config.train)
  if mode == 'train':
    two = sgd_step(model_dir, sharding_lib.make_mesh(1, 4, 1))  # rows and params over both
    two_params = distributed.whole(two[0].params)
    copy = distributed.whole_per_process(two[0].params, 'bfloat16')  # what gloo/nccl send
    with open(os.path.join(out, f'copy-{process_id}.pkl'), 'wb') as f:
      pickle.dump({k: dict(value=np.asarray(x), addressable=x.is_fully_addressable,
                           processes=sorted({d.process_index for d in x.sharding.device_set}),
                           devices=len(x.sharding.device_set))
                   for k, x in flat(copy).items()}, f)
    with signals.StopSignals() as stop:  # as main installs them
      summary = launch_lib.run_experiment(config, workdir, interrupt=stop.request)
    assert summary['interrupted'], summary  # by the stop request from process 1
    shards = {k: (x.shape, [(s.index, np.asarray(s.data)) for s in x.addressable_shards])
              for k, x in flat(summary['final_state']).items()}
    with open(os.path.join(out, f'shards-{process_id}.pkl'), 'wb') as f:
      pickle.dump(dict(steps=summary['steps'], shards=shards), f)
    if distributed.is_primary():  # the single-process step: on this process's first device
      one = sgd_step(model_dir, sharding_lib.make_mesh(1, 1, 1, devices=jax.local_devices()[:1]))
      with open(os.path.join(out, 'sgd.pkl'), 'wb') as f:
        pickle.dump({name: dict(params={k: np.asarray(v) for k, v in flat(params).items()},
                                metrics=metrics)
                     for name, (params, metrics) in (('two', (two_params, two[1])),
                                                     ('one', (one[0].params, one[1])))}, f)
  elif mode == 'restore':
    learner = build_lib.build_learner(config, workdir, model_dir)
    saved = saved_state(out)
    for k, x in flat(learner.state).items():
      for s in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), saved[k][s.index], err_msg=k)
    print(f'restored step {learner.resumed["step"]} equal on process {process_id}', flush=True)


def saved_state(out: str) -> dict[str, np.ndarray]:
  """The final train state of the 2-process run, assembled from the shards both processes held."""
  whole = {}
  for i in range(2):
    with open(os.path.join(out, f'shards-{i}.pkl'), 'rb') as f:
      for k, (shape, shards) in pickle.load(f)['shards'].items():
        x = whole.setdefault(k, np.full(shape, np.nan) if shape else np.zeros(shape))
        for index, data in shards:
          x[index] = data
  return whole


def launch(mode: str, out: str, model_dir: str, devices_per_process: int,
           while_running=lambda procs: None, timeout_s: float = 480) -> list[str]:
  """Runs `worker(mode, ...)` in 2 processes; both must exit 0. Returns their output."""
  argv = lambda i, address: [sys.executable, __file__, mode, str(i), address, out, model_dir]
  with distributed.LocalProcesses(argv, 2, devices_per_process, os.path.join(out, f'{mode}-logs'),
                                  env=ENV, cwd=str(ROOT)) as procs:
    while_running(procs)
    codes = procs.wait(timeout_s)
    outputs = [procs.output(i) for i in range(2)]
  assert codes == [0, 0], '\n'.join(f'--- process {i} ({c}):\n{text[-4000:]}'
                                    for i, (c, text) in enumerate(zip(codes, outputs)))
  return outputs


def wait_for_steps(procs, metrics: pathlib.Path, steps: int, timeout_s: float = 300) -> None:
  """Until `metrics` holds `steps` records (both processes still running)."""
  deadline = time.monotonic() + timeout_s
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
    running = procs.wait(0) == [None, None]
    assert running and time.monotonic() < deadline, procs.output(0)[-4000:]
    time.sleep(0.5)


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize('overrides,message', [
    (dict(num_processes=-1), "must be >= 1 (0 = the scheduler's count)"),
    (dict(distributed=dict(process_id=1)), 'applies to several trainer processes'),
    (dict(num_processes=2, distributed=dict(process_id=2)), 'is not below num_processes=2'),
    (dict(num_processes=2, distributed=dict(coordinator_address='node0')), "'HOST:PORT'"),
    (dict(num_processes=2, distributed=dict(heartbeat_timeout_s=0)), 'must be >= 1'),
])
def test_distributed_config_errors_name_the_key(overrides, message):
  c = config_lib.load_preset()
  for key, value in overrides.items():
    if isinstance(value, dict):
      for k, v in value.items():
        c.train[key][k] = v
    else:
      c.train[key] = value
  with pytest.raises(ValueError, match=r'^config\.train\.') as e:
    config_lib.validate(c)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_several_trainer_processes_generate_with_the_inline_jax_engine():
  c = config_lib.load_preset()
  c.train.num_processes = 2
  c.generation.backend = 'vllm'
  with pytest.raises(ValueError, match=r"^config\.train\.num_processes: 2 trainer processes "
                                       r"generate with the JAX engine on process 0"):
    config_lib.validate(c)


def test_joining_after_jax_started_is_a_one_line_error():
  jax.devices()  # this test process's backend is up: too late to join others
  train_config = config_lib.TrainConfig(num_processes=2, distributed=config_lib.DistributedConfig(
      coordinator_address='127.0.0.1:1', process_id=1))
  with pytest.raises(ValueError, match=r'^config\.train\.distributed: cannot join the other '
                                       r'trainer processes \(RuntimeError: ') as e:
    distributed.initialize(train_config)
  assert '\n' not in str(e.value)


@pytest.fixture(scope='module')
def trained(model_dir, tmp_path_factory):
  """Output of the 'train' launch: 2 processes with 2 devices each (a mesh of 4)."""
  out = str(tmp_path_factory.mktemp('multihost'))

  def stop_after_two_steps(procs):
    wait_for_steps(procs, pathlib.Path(out) / 'run' / 'metrics.jsonl', 2)
    procs.procs[1].send_signal(signal.SIGTERM)  # to the follower: process 0 stops the run

  outputs = launch('train', out, model_dir, devices_per_process=2,
                   while_running=stop_after_two_steps)
  assert 'stop requested by trainer process 1 of 2' in outputs[0], outputs[0][-3000:]
  return out


def test_two_process_step_equals_single_process(trained, model_dir):
  with open(os.path.join(trained, 'sgd.pkl'), 'rb') as f:
    steps = pickle.load(f)
  one, two = steps['one']['params'], steps['two']['params']
  assert one.keys() == two.keys()
  for k in one:
    np.testing.assert_allclose(two[k], one[k], atol=1e-5, err_msg=k)
  for k in ('loss', 'grad_norm', 'ess', 'num_samples'):
    np.testing.assert_allclose(steps['two']['metrics'][k], steps['one']['metrics'][k],
                               rtol=1e-5, err_msg=k)
  # The step moved the params: the comparison is not of two untouched copies.
  init = hf_checkpoint.load_params(model_dir, hf_schema.load_config(model_dir))
  moved = max(float(np.max(np.abs(one[k] - np.asarray(v)))) for k, v in flat(init).items())
  assert moved > 1e-4


def test_each_process_gathers_a_whole_copy_onto_its_own_devices(trained):
  """distributed.whole_per_process, what a collective weight transport sends from process 0:
  on each process, the whole params in the wire dtype, held by its 2 devices alone."""
  with open(os.path.join(trained, 'sgd.pkl'), 'rb') as f:
    want = pickle.load(f)['two']['params']
  for i in range(2):
    with open(os.path.join(trained, f'copy-{i}.pkl'), 'rb') as f:
      copy = pickle.load(f)
    assert copy.keys() == want.keys()
    for k, got in copy.items():
      assert got['addressable'] and got['processes'] == [i] and got['devices'] == 2, (k, got)
      assert got['value'].dtype == jnp.bfloat16
      np.testing.assert_array_equal(got['value'], want[k].astype(jnp.bfloat16), err_msg=k)


def test_two_process_run_writes_one_log_and_checkpoints_from_both(trained):
  run_dir = pathlib.Path(trained) / 'run'
  records = [r for r in metrics_lib.read_metrics(str(run_dir / 'metrics.jsonl')) if 'step' in r]
  last = records[-1]['step']
  assert [r['step'] for r in records] == list(range(1, last + 1))  # one writer: process 0
  assert last >= 2
  # Every step saved, the last 3 kept; the last one when the stop request ended the run.
  assert sorted(int(p.name) for p in (run_dir / 'checkpoints').iterdir()) == list(
      range(max(1, last - 2), last + 1))
  # orbax: each process wrote the shards it holds; the JSON meta once
  assert {p.name for p in (run_dir / 'checkpoints' / str(last) / 'state').glob(
      'ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}
  for i in range(2):
    with open(pathlib.Path(trained) / f'shards-{i}.pkl', 'rb') as f:
      assert pickle.load(f)['steps'] == last


def test_checkpoint_restores_in_two_processes_and_in_one(trained, model_dir):
  launch('restore', trained, model_dir, devices_per_process=1)  # a mesh of 2, saved from 4
  config = run_config(os.path.join(trained, 'run'), model_dir)
  learner = build_lib.build_learner(config, os.path.join(trained, 'run'), model_dir)
  assert learner.mesh.devices.size == len(jax.devices())  # 8 devices here
  saved = saved_state(trained)
  restored = flat(learner.state)
  assert restored.keys() == saved.keys()
  assert any('mu' in k for k in saved)  # Adam's moments are part of the comparison
  for k, x in restored.items():
    np.testing.assert_array_equal(np.asarray(x), saved[k], err_msg=k)
  last = [r['step'] for r in metrics_lib.read_metrics(
      os.path.join(trained, 'run', 'metrics.jsonl')) if 'step' in r][-1]
  assert learner.resumed['step'] == last and int(learner.state.step) == last


def test_kill_of_process_1_stops_process_0_with_one_line(model_dir, tmp_path):
  workdir = str(tmp_path / 'run')

  def argv(i, address):
    return [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py',
            f'--workdir={workdir}', f'--config.model.path={model_dir}',
            '--config.rl.batch_size=16', '--config.rl.group_size=4',
            '--config.generation.num_slots=16', '--config.rl.max_time_s=0',
            '--config.log.tensorboard=False', '--config.log.progress=False',
            '--config.train.num_processes=2',
            f'--config.train.distributed.coordinator_address={address}',
            f'--config.train.distributed.process_id={i}']

  with distributed.LocalProcesses(argv, 2, 1, str(tmp_path / 'logs'), env=ENV,
                                  cwd=str(ROOT)) as procs:
    wait_for_steps(procs, pathlib.Path(workdir) / 'metrics.jsonl', 1)
    killed = procs.procs[1].pid
    os.kill(killed, signal.SIGKILL)
    codes = procs.wait(120)  # bounded: never a hang
    output = procs.output(0)
  assert codes == [1, -signal.SIGKILL], output[-3000:]
  last = output.strip().splitlines()[-1]
  assert last.startswith(f'error: trainer process 1 of 2 (host {socket.gethostname()}, '
                         f'pid {killed}) is gone'), output[-3000:]
  assert 'Check failure stack trace' not in output  # not jax.distributed's fatal abort


if __name__ == '__main__':
  worker(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
