"""A hostile user's probes, each a test: a run never hangs, never loses a signal,
never leaves a process or /dev/shm entry behind, never saves or resumes a non-finite state, and
never mixes two runs; what goes wrong is one line naming the cause, or is recovered from.

Disk-full tests mount a small tmpfs (root, as on this project's machines and CI); where mount is
not allowed they are skipped, saying so.
"""

import _thread
import errno
import glob
import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluate as evaluate_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import supervise
from pipelinerl_jax.pipeline import trainer as trainer_lib

import needs
import pipeline_test  # its small_config (tests/ is on sys.path under pytest)
import procs
import xla_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = xla_env.one_device(PYTHONUNBUFFERED='1', JAX_PLATFORMS='cpu')


def small_config(**rl):
  c = pipeline_test.small_config(**rl)
  c.log.tensorboard = False
  c.train.mesh = '1,1,1'
  return c


def main_cmd(workdir, model_dir, *overrides):
  return [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
          f'--workdir={workdir}', f'--config.model.path={model_dir}',
          '--config.rl.batch_size=16', '--config.rl.group_size=4',
          '--config.generation.num_slots=16', '--config.train.mesh=1,1,1', *overrides]


def no_model_load(monkeypatch):
  """Makes loading the model's weights fail the test: checks must come before it."""
  def load_params(*args, **kwargs):
    raise AssertionError('the model was loaded before the check')
  monkeypatch.setattr(hf_checkpoint, 'load_params', load_params)


# --- disks -------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
  """mount(size_mb) -> a fresh tmpfs of that size; unmounted at the end."""
  mounted = []

  def mount(size_mb):
    d = tmp_path / f'disk{len(mounted)}'
    d.mkdir()
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size_mb}m', 'tmpfs', str(d)],
                       capture_output=True, text=True)
    if r.returncode:
      needs.missing('tmpfs', f'cannot mount a tmpfs here ({r.stderr.strip()})')
    mounted.append(d)
    return d
  yield mount
  for d in mounted:
    subprocess.run(['umount', '-l', str(d)], capture_output=True)


def fill(directory, leave_bytes=0):
  """Writes a file into `directory` until its filesystem is full, then frees `leave_bytes`."""
  path = os.path.join(directory, 'filler')
  with open(path, 'wb', buffering=0) as f:
    chunk = b'\0' * (64 << 10)
    try:
      while True:
        f.write(chunk)
    except OSError as e:
      assert e.errno == errno.ENOSPC
  size = os.path.getsize(path)
  os.truncate(path, max(0, size - leave_bytes))


def run_in_thread(fn, timeout_s):
  """fn() in a daemon thread: (finished, result or exception). A hang fails instead of
  blocking the test session."""
  out = {}

  def body():
    try:
      out['result'] = fn()
    except BaseException as e:
      out['error'] = e
  t = threading.Thread(target=body, daemon=True)
  t.start()
  t.join(timeout_s)
  return not t.is_alive(), out.get('error', out.get('result'))


@pytest.mark.parametrize('tensorboard', [True, False], ids=['tensorboard', 'jsonl_only'])
def test_disk_full_mid_run_stops_with_the_real_error(model_dir, tmp_path, small_disk,
                                                     tensorboard):
  """Item 2: an OSError from closing the writers replaced the loop's error (what this test saw
  before the fix, both ways); and when TensorBoard's writer thread was the first to meet the
  full disk, it died and its bounded queue blocked the trainer forever (the run_in_thread
  bound; this test does not force that order)."""
  workdir = small_disk(24)
  c = small_config(total_steps=10_000)
  c.log.tensorboard = tensorboard
  c.rl.max_time_s = 120.0   # the old hang ignored this too
  c.checkpoint.dir = str(tmp_path / 'ckpt')  # elsewhere: only the metrics meet the full disk

  def on_ready(live):
    def body():
      while live['trainer'].step < 1 and not live['stop'].is_set():
        time.sleep(0.05)
      fill(workdir)
    threading.Thread(target=body, daemon=True).start()

  finished, result = run_in_thread(
      lambda: launch.run_experiment(c, str(workdir), model_dir=model_dir, on_ready=on_ready), 90)
  assert finished, 'the run hung on a full disk'
  assert isinstance(result, supervise.RunError), result
  assert 'trainer loop failed: OSError' in str(result) and 'No space left' in str(result)
  assert '\n' not in str(result)


def test_failed_save_removes_its_partial_checkpoint(model_dir, tmp_path, small_disk):
  """Item 2: a full checkpoint dir left the partial save behind, keeping the disk full."""
  ckpt = small_disk(8)
  c = small_config(total_steps=10_000)
  c.rl.max_time_s = 120.0
  c.checkpoint.dir, c.checkpoint.every_steps, c.checkpoint.keep = str(ckpt), 2, 1

  def on_ready(live):
    fill(ckpt, leave_bytes=100 << 10)  # less than one checkpoint
  with pytest.raises(supervise.RunError) as e:
    launch.run_experiment(c, str(tmp_path / 'w'), model_dir=model_dir, on_ready=on_ready)
  message = str(e.value)
  assert 'could not write the checkpoint of step 2 (no space left on device' in message
  assert '\n' not in message
  assert not glob.glob(str(ckpt / '*orbax-checkpoint-tmp*')), os.listdir(ckpt)
  os.remove(ckpt / 'filler')
  assert shutil.disk_usage(ckpt).used < 64 << 10  # the disk is free again for the rerun


@pytest.mark.parametrize('case', ['workdir_is_a_file', 'checkpoint_dir_is_a_file',
                                  'checkpoint_dir_under_a_file', 'no_room_for_checkpoints'])
def test_output_problems_are_found_before_the_model_loads(model_dir, tmp_path, monkeypatch,
                                                          small_disk, case):
  """Items 2, 5 and 10: found at the first save (step 100), or a traceback."""
  no_model_load(monkeypatch)
  c = small_config()
  workdir = tmp_path / 'w'
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  key = 'config.checkpoint.dir'
  if case == 'workdir_is_a_file':
    workdir, key = a_file, '--workdir'
  elif case == 'checkpoint_dir_is_a_file':
    c.checkpoint.dir = str(a_file)
  elif case == 'checkpoint_dir_under_a_file':
    c.checkpoint.dir = str(a_file / 'ckpt')
  else:
    c.checkpoint.dir = str(small_disk(2))   # the tiny model's checkpoints need ~7 MB
  with pytest.raises(ValueError) as e:
    launch.run_experiment(c, str(workdir), model_dir=model_dir)
  assert str(e.value).startswith(key) and '\n' not in str(e.value), e.value
  if case == 'no_room_for_checkpoints':
    assert 'MB free' in str(e.value)


# --- signals -----------------------------------------------------------------------------------

@pytest.mark.serial
def test_a_signal_inside_a_gc_callback_is_not_lost(model_dir, tmp_path):
  """Item 3: the handler raised KeyboardInterrupt, which Python drops inside a garbage
  collector callback ("Exception ignored in _xla_gc_callback"): the run trained its whole
  budget. Here SIGTERM is delivered inside a gc callback of the main thread once the run's
  handler is in and JAX is imported (start-up: the main thread is busy building the run)."""
  metrics = tmp_path / 'metrics.jsonl'
  launcher = textwrap.dedent(f'''
      import gc, os, runpy, signal, sys, threading
      sent = []
      def callback(phase, info):
        if (sent or phase != 'start' or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
            or 'jax' not in sys.modules):
          return
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):  # Python code: the handler runs here, inside the callback
          pass
      gc.callbacks.append(callback)
      sys.argv = {main_cmd(tmp_path, model_dir, '--config.rl.total_steps=30')[2:]!r}
      runpy.run_module('pipelinerl_jax.main', run_name='__main__')
  ''')
  proc = subprocess.run([sys.executable, '-c', launcher], cwd=ROOT, env=ENV, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
  steps = ([r['step'] for r in metrics_lib.read_metrics(str(metrics))] if metrics.exists()
           else [])
  assert proc.returncode == 143, proc.stdout[-2000:]
  assert 'Traceback' not in proc.stdout and 'Exception ignored' not in proc.stdout
  assert not steps or steps[-1] < 30, 'the signal was lost: the run trained its whole budget'


@pytest.mark.serial
@pytest.mark.parametrize('sig,delay_s', [
    (signal.SIGTERM, 0.6), (signal.SIGINT, 1.5), (signal.SIGTERM, 2.5), (signal.SIGINT, 3.5),
    (signal.SIGTERM, 4.5), (signal.SIGINT, 6.0), (signal.SIGTERM, 8.0)])
def test_a_signal_at_any_point_of_start_up_stops_the_run(model_dir, tmp_path, sig, delay_s):
  """Item 3: a signal during imports, the model load, the first compile or the first steps:
  the run always stops promptly, exits 130 (SIGINT) or 143 (SIGTERM), never a traceback.
  (Start-up takes about 8 s here: the delays cover imports, build, compile, first steps.)"""
  proc = subprocess.Popen(main_cmd(tmp_path, model_dir, '--config.rl.total_steps=100000'),
                          cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True)
  tree = procs.RunTree(proc.pid).watch()
  try:
    time.sleep(delay_s)
    proc.send_signal(sig)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
  finally:
    if proc.poll() is None:
      proc.kill()
  tree.stop()
  assert proc.returncode == 128 + sig, out[-2000:]
  assert 'Traceback' not in out and 'Exception ignored' not in out, out[-2000:]
  assert stop_s < 30, f'took {stop_s:.0f} s to stop'
  tree.assert_clean()


@pytest.mark.serial
def test_a_second_signal_exits_at_once(model_dir, tmp_path):
  """The way out of a phase that cannot be interrupted (here a model load made to last 60 s):
  the first signal asks for a stop, the second exits at once with its own status."""
  started = tmp_path / 'started'
  launcher = textwrap.dedent(f'''
      import runpy, sys, time
      from pipelinerl_jax.models.hf import schema as hf_schema
      def slow_load_config(*args, **kwargs):
        open({str(started)!r}, 'w').close()
        time.sleep(60)
      hf_schema.load_config = slow_load_config
      sys.argv = {main_cmd(tmp_path / 'w', model_dir)[2:]!r}
      runpy.run_module('pipelinerl_jax.main', run_name='__main__')
  ''')
  proc = subprocess.Popen([sys.executable, '-c', launcher], cwd=ROOT, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 60
    while not started.exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # still loading: the stop waits for the phase to end
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert time.monotonic() - t0 < 5
  assert proc.returncode == 130 and 'SIGINT again: exiting now, without a save' in out, out


# --- two runs, one workdir -------------------------------------------------------------------

@pytest.mark.serial
def test_a_second_run_on_a_workdir_is_refused_naming_the_holder(model_dir, tmp_path, python_sigint):
  """Item 4: two runs interleaved metrics.jsonl and mixed their checkpoints."""
  c = small_config(total_steps=10_000)
  c.rl.max_time_s = 120.0
  second = {}

  def on_ready(live):
    def body():
      second['proc'] = subprocess.run(
          main_cmd(tmp_path, model_dir, '--config.rl.total_steps=2'), cwd=ROOT, env=ENV,
          text=True, capture_output=True, timeout=180)
      _thread.interrupt_main()  # Ctrl-C: the run waits for a step in progress and saves it
    threading.Thread(target=body, daemon=True).start()

  first = launch.run_experiment(c, str(tmp_path), model_dir=model_dir, on_ready=on_ready)
  assert first['interrupted'], first['steps']  # by the Ctrl-C, not by rl.max_time_s
  proc = second['proc']
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert proc.stderr.strip().count('\n') == 0, proc.stderr
  assert f'is in use by another run (pid {os.getpid()} on' in proc.stderr
  steps = [r['step'] for r in metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))]
  assert steps == list(range(1, first['steps'] + 1))  # the first run's records alone


# --- kill -9 -----------------------------------------------------------------------------------

@pytest.mark.serial
def test_verify_workers_die_with_their_parent_even_mid_job(tmp_path):
  """Item 1: a math-verify worker busy on a pathological answer (sympy stuck in C, for
  minutes) outlived a kill -9 of the process that started it."""
  ready = tmp_path / 'ready'
  script = textwrap.dedent(f'''
      import sys, threading, time
      sys.path.insert(0, {str(ROOT)!r})
      from pipelinerl_jax.tasks import verify
      pool = verify.VerifyPool(num_workers=1, timeout_s=600)
      assert pool.wait_ready()
      threading.Thread(target=pool.verify_many, args=([('1', '9^{{9^{{9^9}}}}')],),
                       daemon=True).start()
      time.sleep(0.5)
      open({str(ready)!r}, 'w').write('1')
      time.sleep(600)
  ''')
  proc = subprocess.Popen([sys.executable, '-c', script], env=ENV, start_new_session=True)
  try:
    deadline = time.monotonic() + 60
    while not ready.exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.1)
    tree = procs.RunTree(proc.pid).sample()
    assert len(tree.seen) == 1, tree.seen  # the worker, busy
    proc.kill()
    proc.wait()
    tree.assert_clean(timeout_s=3)
  finally:
    if proc.poll() is None:
      proc.kill()


@pytest.mark.serial
def test_kill_9_then_resume_leaves_nothing_behind_and_repeats_no_step(model_dir, tmp_path,
                                                                      capsys):
  """Items 1, 4 and 7: after kill -9 of a math run no process or /dev/shm entry of it
  survives; the rerun takes over its stale lock; metrics.jsonl and TensorBoard repeated the
  steps logged after the last checkpoint, and time_s restarted at 0."""
  data = tmp_path / 'problems.jsonl'
  data.write_text(''.join(json.dumps({'problem': f'{i}+{i}', 'answer': str(2 * i)}) + '\n'
                          for i in range(50)))
  workdir = tmp_path / 'w'
  math_flags = ['--config.task.name=math', f"--config.task.train_files=('{data}',)",
                '--config.task.verify_workers=2', '--config.generation.max_prompt_len=112',
                '--config.log.tensorboard=True', '--config.checkpoint.every_steps=4']
  proc = subprocess.Popen(main_cmd(workdir, model_dir, '--config.rl.total_steps=100000',
                                   *math_flags),
                          cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
  tree = procs.RunTree(proc.pid).watch()
  metrics = workdir / 'metrics.jsonl'
  try:
    deadline = time.monotonic() + 240
    # Killed one or two steps past a checkpoint: the next save is then at least two steps away,
    # so the kill lands before it however the poll and the steps interleave.
    while not (metrics.exists() and (logged := metrics_lib.read_metrics(str(metrics)))
               and logged[-1]['step'] > 4 and logged[-1]['step'] % 4 in (1, 2)):
      assert proc.poll() is None and time.monotonic() < deadline, 'the run did not train'
      time.sleep(0.1)
    proc.kill()
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
  tree.stop()
  assert any('verify.py' in cmd for _, cmd in tree.seen.values()), tree.seen
  tree.assert_clean()

  killed = metrics_lib.read_metrics(str(metrics))
  saved = checkpoint_lib.locate(workdir / 'checkpoints')[1]
  assert killed[-1]['step'] > saved  # steps logged but never saved: they will be trained again
  c = small_config(total_steps=killed[-1]['step'] + 2)
  c.model.path = model_dir
  c.task.name, c.task.train_files, c.task.verify_workers = 'math', (str(data),), 2
  c.generation.max_prompt_len, c.checkpoint.every_steps, c.log.tensorboard = 112, 4, True
  capsys.readouterr()
  launch.run_experiment(c, str(workdir), model_dir=model_dir)
  out = capsys.readouterr().out
  assert 'which ended without releasing it' in out  # the killed run's lock, taken over

  records = metrics_lib.read_metrics(str(metrics))
  assert [r['step'] for r in records] == list(range(1, c.rl.total_steps + 1))
  times = [r['time_s'] for r in records]
  assert times == sorted(times), times  # continues across the resume
  dropped = metrics_lib.read_metrics(str(workdir / metrics_lib.DROPPED_FILE))
  assert [r['step'] for r in dropped] == [r['step'] for r in killed if r['step'] > saved]
  tb_steps = tensorboard_steps(workdir / 'tb', 'loss')
  assert tb_steps == list(range(1, c.rl.total_steps + 1)), tb_steps


def tensorboard_steps(logdir, tag):
  """The steps of `tag` TensorBoard shows: events in file order, each SessionLog.START at step
  s discarding the events at or after s read before it (TensorBoard's purge rule)."""
  from tensorboardX.proto import event_pb2
  steps = []
  for path in sorted(glob.glob(str(logdir / 'events.out.tfevents.*'))):
    data, i = pathlib.Path(path).read_bytes(), 0
    while i + 12 <= len(data):
      n, = struct.unpack('<Q', data[i:i + 8])
      if i + 16 + n > len(data):
        break  # a record cut short by the kill
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if event.HasField('session_log') and event.session_log.status == event.session_log.START:
        steps = [s for s in steps if s < event.step]
      if any(v.tag == tag for v in event.summary.value):
        steps.append(event.step)
  return steps


# --- non-finite updates --------------------------------------------------------------------------

def test_an_absurd_lr_is_refused():
  """Item 6: lr=1e30 passed validation and wrecked the params at the first update."""
  for lr in (1e30, 2.0):
    c = config_lib.load_preset()
    c.optimizer.lr = lr
    with pytest.raises(ValueError, match='config.optimizer.lr: must be finite and > 0'):
      config_lib.validate(c)


def test_train_step_never_applies_an_update_that_makes_params_non_finite(model_dir):
  """Item 6: the guard looked at the loss and the gradients only; an optimizer whose update is
  not finite (here infinite lr, with finite loss and gradients) got its params published."""
  model_config = hf_schema.load_config(model_dir)
  params = hf_checkpoint.load_params(model_dir, model_config)
  step = jax.jit(train.make_train_step(model_config, config_lib.LossConfig(), optax.sgd(np.inf),
                                       lambda s: np.inf))
  state = train.init_train_state(params, optax.sgd(np.inf))
  T = 16
  batch = dict(tokens=np.ones((1, 1, T), np.int32), targets=np.ones((1, 1, T), np.int32),
               positions=np.arange(T, dtype=np.int32)[None, None],
               segment_ids=np.ones((1, 1, T), np.int32),
               loss_mask=np.ones((1, 1, T), np.float32),
               behaviour_logprobs=np.full((1, 1, T), -1.0, np.float32),
               advantages=np.ones((1, 1, T), np.float32))
  new_state, metrics = step(state, batch)
  assert np.isfinite(float(metrics['loss'])) and np.isfinite(float(metrics['grad_norm']))
  assert int(metrics['skipped']) == 1 and int(new_state.step) == 0
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_state.params)):
    np.testing.assert_array_equal(a, b)


def test_a_skipped_update_is_logged_as_such_and_never_saved(model_dir, tmp_path, monkeypatch):
  """Item 6: the second update is non-finite (finite loss and gradients, infinite update). It
  was applied, saved and resumed, and logged as `step: 2` with step 2 then logged again."""
  real_make, real_jit = train.make_train_step, train.jit_train_step

  def make(model_config, loss_config, optimizer, schedule, **kw):
    def poisoned_update(updates, state, params=None):
      updates, state = optimizer.update(updates, state, params)
      return jax.tree.map(lambda u: u * jnp.inf, updates), state
    poisoned = optax.GradientTransformation(optimizer.init, poisoned_update)
    return (real_make(model_config, loss_config, optimizer, schedule, **kw),
            real_make(model_config, loss_config, poisoned, schedule, **kw))

  def jit(steps, state_sharding, mesh, **kw):
    good, bad = (real_jit(s, state_sharding, mesh, **kw) for s in steps)
    calls = []

    def train_step(state, batch):
      calls.append(1)
      return (bad if len(calls) == 2 else good)(state, batch)
    return train_step

  monkeypatch.setattr(train, 'make_train_step', make)
  monkeypatch.setattr(train, 'jit_train_step', jit)
  c = small_config(total_steps=4)
  c.rl.max_time_s = 60.0
  summary = launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  assert summary['steps'] == 4
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r.get('step') for r in records] == [1, None, 2, 3, 4]
  skipped = records[1]
  assert skipped['event'] == 'skipped_update' and skipped['update'] == 2
  assert skipped['policy_version'] == 1
  assert [r['skipped_updates'] for r in records if 'step' in r] == [0, 1, 1, 1]
  model_config = hf_schema.load_config(model_dir)
  saved = checkpoint_lib.load_params(tmp_path / 'checkpoints', model_config)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(saved))


# --- checkpoints that do not restore --------------------------------------------------------

def test_unreadable_latest_checkpoints_fall_back_to_the_previous_one(model_dir, tmp_path,
                                                                     capsys):
  """Item 9 (and 6): a truncated latest checkpoint stopped the run, advising resume=False,
  which is then refused; a non-finite one was resumed."""
  c = small_config(total_steps=4)
  c.checkpoint.every_steps, c.checkpoint.keep = 2, 5
  launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  root = tmp_path / 'checkpoints'
  assert sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) == [2, 4]
  # Step 5: the state of step 4 made non-finite; step 4: a data file cut short.
  model_config = hf_schema.load_config(model_dir)
  mesh = sharding_lib.make_mesh(1, 1, 1)
  optimizer = train.make_optimizer(config_lib.validate(c).optimizer)
  target, _ = checkpoint_lib.abstract_state(model_config, optimizer, mesh)
  checkpoints = checkpoint_lib.Checkpointer(str(root), keep=5, every_steps=0)
  state, meta = checkpoints.restore(target, 4)
  poisoned = state.replace(step=jnp.asarray(5, jnp.int32),
                           params=jax.tree.map(lambda x: x * jnp.nan, state.params))
  checkpoints.save(poisoned, {**meta, 'step': 5, 'policy_version': 5})
  checkpoints.close()
  data_files = [p for p in (root / '4' / 'state').rglob('*') if p.is_file()]
  largest = max(data_files, key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:largest.stat().st_size // 2])

  c.rl.total_steps = 6
  capsys.readouterr()
  summary = launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  out = capsys.readouterr().out
  assert 'non-finite' in out and 'resuming from step 2 instead' in out, out
  assert (root / '5.unreadable').is_dir() and (root / '4.unreadable').is_dir()
  assert summary['steps'] == 6
  assert checkpoint_lib.locate(root) == (root, 6)
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2, 3, 4, 5, 6]

  # None restores: the advice must be one that works (resume=False is refused on this dir).
  for p in root.glob('[0-9]*/state/**/*'):
    if p.is_file():
      p.write_bytes(b'')
  c.rl.total_steps = 7
  with pytest.raises(ValueError) as e:
    launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  assert 'set config.checkpoint.dir to a new directory' in str(e.value)
  assert 'resume=False' not in str(e.value) and '\n' not in str(e.value)


# --- model dirs and data files -----------------------------------------------------------------

@pytest.fixture
def model_without_tokenizer(model_dir, tmp_path):
  out = tmp_path / 'no_tokenizer'
  out.mkdir()
  for name in os.listdir(model_dir):
    if not name.startswith('tokenizer'):  # the demo model's: tokenizer.json, tokenizer_config.json
      shutil.copy(os.path.join(model_dir, name), out / name)
  return str(out)


def test_evaluate_without_tokenizer_files_is_an_error_not_a_zero(model_without_tokenizer):
  """Item 8: "pass@1 0.0000, 8 skipped: prompt too long", exit status 0."""
  c = config_lib.load_preset()
  c.model.path = model_without_tokenizer
  c.eval.num_problems, c.eval.k = 8, 1
  with pytest.raises(ValueError) as e:
    evaluate_lib.evaluate_checkpoint(c, model_without_tokenizer)
  assert str(e.value).startswith(f'{model_without_tokenizer}: no tokenizer files')


def test_training_without_tokenizer_files_fails_before_the_model_loads(model_without_tokenizer,
                                                                        tmp_path, monkeypatch):
  """Item 8: training failed later with "prompt has 0 tokens"."""
  no_model_load(monkeypatch)
  with pytest.raises(ValueError, match='no tokenizer files'):
    launch.run_experiment(small_config(), str(tmp_path), model_dir=model_without_tokenizer)


@pytest.mark.parametrize('content,message', [
    (None, 'no such file'),
    ('', 'holds no problems'),
    ('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2", "answer": "4"\n',
     'line 3: not valid JSON'),
    ('{"problem": "1+1", "answer": "2"}\n[1, 2]\n', "row 1: field 'problem'"),
], ids=['missing', 'empty', 'malformed', 'not_an_object'])
def test_bad_data_files_are_reported_before_the_model_loads(model_dir, tmp_path, monkeypatch,
                                                            content, message):
  """Item 10: reported only after the model (or vLLM) had started; an empty JSONL gave
  StopIteration; a bad line was reported without its number."""
  no_model_load(monkeypatch)
  data = tmp_path / 'train.jsonl'
  if content is not None:
    data.write_text(content)
  c = small_config()
  c.task.name, c.task.train_files, c.model.path = 'math', (str(data),), model_dir
  with pytest.raises((ValueError, FileNotFoundError)) as e:
    launch.run_experiment(c, str(tmp_path / 'w'), model_dir=model_dir)
  assert str(e.value).startswith(str(data)) and message in str(e.value), e.value
  assert '\n' not in str(e.value)


def test_an_unknown_command_line_key_is_one_line():
  """Item 10: a 55-line traceback (ml_collections raises while absl parses the flags)."""
  proc = subprocess.run(
      [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
       '--workdir=/nonexistent/never-made', '--config.rl.max_lagg=3'],
      cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip() == ('error: --config.rl.max_lagg: unknown key '
                                 '(did you mean rl.max_lag?)'), proc.stderr


def test_generation_rate_is_never_negative_after_an_engine_restart():
  """Item 10: gen_tokens_per_s was logged as -1942 after a generator restart reset its
  token counter."""
  counts = iter([5000, 9000, 300])
  trainer = trainer_lib.Trainer(types.SimpleNamespace(step=0), None, None, None, None, None,
                                None, None, lambda: {'tokens_generated': next(counts)})
  trainer._gen_rate()
  assert trainer._gen_rate()['gen_tokens_per_s'] > 0
  assert trainer._gen_rate()['gen_tokens_per_s'] > 0  # 300 tokens since the restart


# --- Weights & Biases ----------------------------------------------------------------------------

def test_wandb_logs_the_records_and_a_resumed_run_continues_the_same_run(model_dir, tmp_path,
                                                                         monkeypatch):
  needs.check('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  c = small_config(total_steps=2)
  c.log.wandb, c.checkpoint.every_steps = True, 0
  launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  c.rl.total_steps = 3
  launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  run_id = (tmp_path / metrics_lib.WANDB_ID_FILE).read_text().strip()
  runs = sorted(glob.glob(str(tmp_path / 'wandb' / 'offline-run-*')))
  assert len(runs) == 2 and all(r.endswith(f'-{run_id}') for r in runs), runs
  logged = [wandb_history(glob.glob(os.path.join(r, '*.wandb'))[0]) for r in runs]
  jsonl = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [h['_step'] for h in logged[0]] == [1, 2] and [h['_step'] for h in logged[1]] == [3]
  assert len(jsonl) == 3
  for history, record in zip(logged[0] + logged[1], jsonl):
    for key in ('loss', 'time_s', 'samples', 'num_tokens', 'train_tokens_per_s'):
      assert history[key] == pytest.approx(record[key]), key


def wandb_history(path):
  """The history rows of an offline W&B run file: W&B's 7-byte header, then LevelDB-log
  records (32 KiB blocks; 7-byte record headers: crc, length, type) of `Record` protobufs."""
  from wandb.proto import wandb_internal_pb2
  data = pathlib.Path(path).read_bytes()
  assert data[:4] == b':W&B', data[:8]
  rows, pending, i, block = [], b'', 7, 32768
  while i + 7 <= len(data):
    if block - i % block < 7:  # a block's tail too short for a header is padding
      i += block - i % block
      continue
    length, kind = int.from_bytes(data[i + 4:i + 6], 'little'), data[i + 6]
    pending += data[i + 7:i + 7 + length]
    i += 7 + length
    if kind in (1, 4):  # FULL, LAST
      record = wandb_internal_pb2.Record.FromString(pending)
      pending = b''
      if record.WhichOneof('record_type') == 'history':
        rows.append({(item.key or '/'.join(item.nested_key)): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


@pytest.mark.serial
def test_wandb_service_processes_die_with_a_killed_run(tmp_path):
  """W&B starts helper processes (wandb-core, its system monitor): a kill -9 of the run must
  not leave them behind."""
  needs.check('wandb')
  ready = tmp_path / 'ready'
  script = textwrap.dedent(f'''
      import time, wandb
      run = wandb.init(project='p', dir={str(tmp_path)!r})
      run.log({{'loss': 1.0}}, step=1)
      open({str(ready)!r}, 'w').close()
      time.sleep(600)
  ''')
  proc = subprocess.Popen([sys.executable, '-c', script], start_new_session=True,
                          env={**ENV, 'WANDB_MODE': 'offline', 'WANDB_SILENT': 'true'})
  try:
    deadline = time.monotonic() + 60
    while not ready.exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.1)
    tree = procs.RunTree(proc.pid).sample()
    assert any('wandb' in cmd for _, cmd in tree.seen.values()), tree.seen
    proc.kill()
    proc.wait()
    tree.assert_clean(timeout_s=20)
  finally:
    if proc.poll() is None:
      proc.kill()
