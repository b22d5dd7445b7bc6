"""Trainer processes as Ray actors (train.num_processes=2, generation.placement='ray'): the driver
is process 0, process 1 a Ray actor beside it; generator actors on CPU.

A short run of the tiny preset with 2 generator actors, one killed mid-run, goes on: the actor
is restarted once, every sample is trained exactly once; the last weights the generators were
sent through the object store, assembled from both processes' pieces, equal the params of the
final checkpoint exactly. (That such a run learns follows from multihost_test's two-process
step equalling the single-process one; the learning runs are reward_test's.) A run
through the main command, stopped by Ctrl-C after its first step, saves from both processes and
leaves nothing behind; resumed over gloo (the nccl protocol), where both processes gather a
whole copy onto their own devices and process 0 broadcasts its copy, it ends with the generator
holding the final checkpoint's params. kill -9 of the trainer actor mid-run stops the run with
one line naming it. The pieces' assembly refuses a gap, an overlap or a wrong layout whole. Bad
settings are one-line errors naming the key; trainer processes go to nodes of their own, else
beside the driver.

Run as a script, this file is process 0 of those runs, but for the main command's (`driver`).
"""

import os
import pathlib
import pickle
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.generation.transport import layout
from pipelinerl_jax.generation.transport import shards
from pipelinerl_jax.pipeline import metrics as metrics_lib

import procs as procs_lib  # tests/ is on sys.path (pytest, and this file run as a script)

pytestmark = pytest.mark.serial  # several processes, Ray, kills and signals with deadlines

ROOT = pathlib.Path(__file__).resolve().parent.parent
# As multihost_test: XLA's CPU backend at -O0 compiles ~3x faster on 2 shared cores; the trainer
# actor gets these from the driver (XLA_* variables travel with it).
ENV = {'TOKENIZERS_PARALLELISM': 'false', 'PYTHONPATH': str(ROOT), 'PYTHONUNBUFFERED': '1',
       'XLA_FLAGS': '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'}
FLAGS = ['--config.generation.placement=ray', '--config.generation.num_generators=1',
         '--config.train.num_processes=2', '--config.cluster.num_cpus=2',
         '--config.rl.batch_size=16', '--config.rl.group_size=4',
         '--config.generation.num_slots=16', '--config.rl.max_time_s=0',
         '--config.log.tensorboard=False', '--config.log.progress=False']
# The kill run: the tiny preset, 2 generator actors, the second killed once KILL_AT_STEP's record
# is written, a fixed number of steps after it (enough for the restarted actor to serve again).
KILL_STEPS, KILL_AT_STEP, SEED = 24, 8, 1


def run_config(kind: str, workdir: str, model_dir: str, steps: int) -> config_lib.Config:
  """The driver's runs, at FLAGS's small batch (as the main command runs it). 'kill': 2
  generator actors, one killed. 'gloo': the weights over gloo."""
  c = config_lib.load_preset('tiny')
  c.model.path = model_dir
  c.generation.placement, c.generation.num_generators = 'ray', 1
  c.train.num_processes, c.cluster.num_cpus = 2, 2
  c.rl.total_steps, c.rl.max_time_s = steps, 0.0
  c.log.tensorboard, c.log.progress = False, False
  c.checkpoint.dir = os.path.join(workdir, 'checkpoints')
  c.rl.batch_size, c.rl.group_size, c.generation.num_slots = 16, 4, 16
  if kind == 'kill':
    c.seed = SEED
    # A CPU each for the trainer actor and the 2 generators: Ray's count, not cores (the
    # second generator shares a core with the trainer actor).
    c.generation.num_generators, c.cluster.num_cpus = 2, 3
  else:
    c.generation.remote.weight_transport = 'gloo'
  return config_lib.validate(c)


def driver(kind: str, workdir: str, model_dir: str, out: str, steps: str) -> None:
  """Process 0 of a `run_config(kind)` run to `steps`. Records the last update the generator
  pool was handed, whole, the request ids it completed, and over gloo its transport errors once
  every actor has loaded the update. 'kill' kills the second generator actor when version
  KILL_AT_STEP + 1 is published."""
  import ray
  from pipelinerl_jax.generation.actors import pool as pool_lib
  from pipelinerl_jax.pipeline import launch
  real_update, real_step = pool_lib.RayGenerators.update_params, pool_lib.RayGenerators.step
  last, completed, killed = {}, [], []

  def recording_update(self, params, version):
    # After step KILL_AT_STEP's record is written (it follows that step's update).
    if kind == 'kill' and version == KILL_AT_STEP + 1 and not killed:
      killed.append(self.members()[1]['pid'])
      os.kill(killed[0], signal.SIGKILL)  # an actor this run started
    if not isinstance(params, shards.Published):  # over gloo: process 0's gathered copy
      assert all(x.is_fully_addressable for x in jax.tree.leaves(params))
      host = jax.device_get(params)
      last.update(version=version, params=host, digest=layout.tree_digest(host))
      real_update(self, params, version)
      self.wait_version(version)
      last.update(transport_errors=list(self.transport_errors), loaded=self.stats()['version'])
      return
    last.update(version=version, params=shards.assemble(ray.get(list(params.refs))),
                digest=params.digest)
    real_update(self, params, version)

  def recording_step(self):
    done = real_step(self)
    completed.extend(d.request_id for d in done)
    return done

  pool_lib.RayGenerators.update_params = recording_update
  pool_lib.RayGenerators.step = recording_step
  summary = launch.run_experiment(run_config(kind, workdir, model_dir, int(steps)), workdir)
  with open(out, 'wb') as f:
    pickle.dump(dict(last, steps=summary['steps'], samples=summary['samples'],
                     checkpoint=summary['checkpoint'], completed=completed, killed=killed), f)


def run_driver(tmp_path, kind: str, workdir, model_dir: str, steps: int,
               timeout_s: float = 300, **env) -> tuple[dict, str]:
  """`driver(kind, ...)` in a process of its own: what it recorded and its output. It must end
  cleanly, leaving nothing behind."""
  out, log_path = tmp_path / f'{kind}.pkl', tmp_path / f'{kind}.log'
  with open(log_path, 'w') as log:
    proc = _start([sys.executable, __file__, kind, str(workdir), model_dir, str(out), str(steps)],
                  log, **env)
    tree = procs_lib.RunTree(proc.pid).watch()
    try:
      code = proc.wait(timeout_s)
    finally:
      if proc.poll() is None:
        proc.kill()
      tree.stop()
  output = log_path.read_text()
  assert code == 0, output[-4000:]
  tree.assert_clean(timeout_s=20)
  with open(out, 'rb') as f:
    return pickle.load(f), output


def assert_sent_the_final_checkpoint(last: dict, config: config_lib.Config, workdir) -> None:
  """The last update the generators were sent equals the params of the run's final checkpoint
  (written by both processes, read in this one process)."""
  from pipelinerl_jax.pipeline import build as build_lib
  learner = build_lib.build_learner(config, str(workdir), config.model.path)
  assert int(learner.state.step) == last['version'] == config.rl.total_steps
  want, got = flat(learner.state.params), flat(last['params'])
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert last['digest'] == layout.tree_digest(last['params'])


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def trainer_actors_seen(tree) -> list[int]:
  """Pids of the run's trainer actors (a Ray worker renames itself once it holds an actor)."""
  found = []
  for pid, (_, line) in tree.seen.items():
    if 'TrainerProcess' in line or 'TrainerProcess' in procs_lib.cmdline(pid):
      found.append(pid)
  return found


def _start(cmd, log, **env):
  return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV, **env}, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)


def _run_main_until_a_step(tmp_path, act):
  """The main command until its first step is written; then `act(proc, tree)`, and the run's
  exit code once it ends (bounded: never a hang) and its output."""
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
         f'--workdir={workdir}', f'--config.model.path={os.environ["MH_MODEL_DIR"]}',
         '--config.rl.total_steps=100000', *FLAGS]
  with open(tmp_path / 'log', 'w') as log:
    proc = _start(cmd, log)
    tree = procs_lib.RunTree(proc.pid).watch()
    try:
      deadline = time.monotonic() + 300
      metrics = workdir / 'metrics.jsonl'
      while not (metrics.exists() and metrics.read_text().count('\n') >= 1):
        assert proc.poll() is None, (tmp_path / 'log').read_text()[-4000:]
        assert time.monotonic() < deadline, 'training never started'
        time.sleep(0.5)
      act(proc, tree)
      code = proc.wait(120)
    finally:
      if proc.poll() is None:
        proc.kill()
      tree.stop()
  return code, (tmp_path / 'log').read_text(), tree


def test_kill_of_the_trainer_actor_stops_the_run_with_one_line(model_dir, tmp_path, monkeypatch):
  monkeypatch.setenv('MH_MODEL_DIR', model_dir)

  killed = []

  def kill_the_trainer_actor(proc, tree):
    victim = trainer_actors_seen(tree.sample())
    assert len(victim) == 1, tree.seen
    os.kill(victim[0], signal.SIGKILL)
    killed.append(victim[0])

  code, output, tree = _run_main_until_a_step(tmp_path, kill_the_trainer_actor)
  assert code == 1, output[-4000:]
  last = output.strip().splitlines()[-1]
  assert last.startswith(f'error: trainer process 1 of 2 (host {socket.gethostname()}, '
                         f'pid {killed[0]}) is gone'), output[-4000:]
  tree.assert_clean(timeout_s=20)


def test_two_process_run_goes_on_while_a_generator_actor_is_killed(model_dir, tmp_path):
  """The trainer in 2 processes, 2 generator actors, the second killed at KILL_AT_STEP: it is
  restarted once and every sample is trained exactly once; the last weights the generators were
  sent, assembled from both processes' pieces, equal the final checkpoint's.

  Until 2026-11-26 this was a 400-step learning run (reward +0.10 over its first 10 steps, and
  greedy answers that stop on their own), ~240 s of the suite. The claims about the kill and
  the weights need no learning; learning in 2 processes rests on multihost_test's step equality
  and the single-process learning runs (reward_test)."""
  workdir = tmp_path / 'run'
  config = run_config('kill', str(workdir), model_dir, KILL_STEPS)
  last, _ = run_driver(tmp_path, 'kill', workdir, model_dir, KILL_STEPS)
  records = [r for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl')) if 'step' in r]
  assert [r['step'] for r in records] == list(range(1, KILL_STEPS + 1))  # one writer
  assert last['killed'] and records[-1]['generation/restarts'] == 1
  assert records[KILL_AT_STEP - 1]['generation/restarts'] == 0
  assert len(last['completed']) == len(set(last['completed']))  # no request completed twice
  assert last['samples'] == KILL_STEPS * config.rl.batch_size  # none lost or counted twice
  assert_sent_the_final_checkpoint(last, config, workdir)


def test_ctrl_c_saves_from_both_processes_and_the_run_resumes_over_gloo(model_dir, tmp_path,
                                                                        monkeypatch):
  """Ctrl-C after the first step: both processes stop, save and leave nothing. The run resumed
  from that checkpoint (2 processes again), with weight_transport='gloo' (the nccl protocol on
  CPU), continues to its end: each update is gathered, by both processes, into a whole copy on
  process 0's devices, which it broadcasts to the generator. The last one equals the final
  checkpoint's params, and the generator loaded it, without a transport error."""
  monkeypatch.setenv('MH_MODEL_DIR', model_dir)
  # What a terminal does: SIGINT to the whole foreground group (the trainer actor is in Ray's).
  code, output, tree = _run_main_until_a_step(tmp_path, lambda proc, _: os.killpg(proc.pid,
                                                                                  signal.SIGINT))
  assert code == 130, output[-4000:]  # 128 + SIGINT
  workdir = tmp_path / 'run'
  steps = [r['step'] for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl'))
           if 'step' in r]
  saved = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())
  assert saved and saved[-1] == steps[-1], (saved, steps)  # the exit save, from both processes
  assert {p.name for p in (workdir / 'checkpoints' / str(saved[-1]) / 'state').glob(
      'ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}
  tree.assert_clean(timeout_s=20)

  total = saved[-1] + 3
  last, output = run_driver(tmp_path, 'gloo', workdir, model_dir, total)
  assert f'resuming from {workdir / "checkpoints"} at step {saved[-1]}' in output, output[-4000:]
  assert last['steps'] == total and last['loaded'] == total
  assert last['transport_errors'] == []
  records = [r for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl')) if 'step' in r]
  assert [r['step'] for r in records] == list(range(1, total + 1))  # one writer, no step twice
  assert_sent_the_final_checkpoint(last, run_config('gloo', str(workdir), model_dir, total),
                                   workdir)


# --- checks before anything starts -----------------------------------------------------------


@pytest.mark.parametrize('change,message', [
    (lambda c: c.train.distributed.update(coordinator_address='127.0.0.1:1234', process_id=0),
     'train.num_processes: with generation.placement=\'ray\' the run starts its 2 trainer '
     'processes itself'),
    (lambda c: c.train.distributed.update(cpus_per_process=0),
     'train.distributed.cpus_per_process: must be >= 1'),
])
def test_config_errors_name_the_key(change, message):
  c = config_lib.load_preset('tiny')
  c.generation.placement, c.train.num_processes = 'ray', 2
  change(c)
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  assert message in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_trainer_processes_go_to_other_nodes_else_beside_the_driver():
  from pipelinerl_jax.pipeline import trainer_actors
  node = lambda i, cpus, gpus=0: dict(NodeID=f'n{i}', Alive=True, NodeManagerAddress=f'10.0.0.{i}',
                                      Resources=dict(CPU=cpus, GPU=gpus))
  nodes = [node(0, 8), node(2, 8, 8), node(1, 8, 8), node(3, 8, 4)]
  # GPU hosts: one process per other node that has the GPUs, in address order
  assert trainer_actors.choose_nodes(nodes, 'n0', 2, 1, 8) == ['n1', 'n2']
  with pytest.raises(ValueError, match=r'^config\.train\.num_processes: 3 trainer processes'):
    trainer_actors.choose_nodes(nodes, 'n0', 3, 1, 8)
  # one CPU machine: beside the driver, if its CPUs suffice
  assert trainer_actors.choose_nodes([node(0, 4)], 'n0', 3, 1, 0) == ['n0'] * 3
  with pytest.raises(ValueError, match='the Ray cluster has 0'):
    trainer_actors.choose_nodes([node(0, 2)], 'n0', 3, 1, 0)


# --- the pieces, in this process -----------------------------------------------------------------


def _two_processes_pieces():
  """Pieces of a params tree sharded over 4 devices, dealt to 2 'processes' alternately."""
  rng = np.random.default_rng(0)
  params = {'a': {'w': rng.standard_normal((8, 6)).astype(np.float32)},
            'b': rng.standard_normal((4,)).astype(np.float32)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('x', 'y'))
  specs = {'a': {'w': jax.sharding.PartitionSpec('x', 'y')}, 'b': jax.sharding.PartitionSpec()}
  placed = jax.tree.map(lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)),
                        params, specs)
  pieces = shards.local_pieces(placed)  # one process here: it owns every box once
  return params, [pieces[0::2], pieces[1::2]]


def test_pieces_assemble_to_the_whole_params():
  params, by_process = _two_processes_pieces()
  assert len(by_process[0]) and len(by_process[1])
  assert len([p for p in by_process[0] + by_process[1] if p.path == ('a', 'w')]) == 4
  got = shards.assemble(by_process)
  for k in params['a']:
    np.testing.assert_array_equal(got['a'][k], params['a'][k])
  np.testing.assert_array_equal(got['b'], params['b'])
  assert layout.tree_digest(got) == layout.tree_digest(params)


@pytest.mark.parametrize('change,message', [
    (lambda ps: ps[1:], 'the pieces cover 36 of its 48 elements'),   # a process's piece lost
    (lambda ps: ps + ps[:1], 'overlap'),                                # one sent twice
    (lambda ps: [ps[0].__class__(ps[0].path, (8, 7), ps[0].box, ps[0].data)] + ps[1:],
     'arrives as'),                                                     # another layout
])
def test_a_gap_an_overlap_or_another_layout_is_refused_whole(change, message):
  _, by_process = _two_processes_pieces()
  wa = [p for p in by_process[0] + by_process[1] if p.path == ('a', 'w')]
  rest = [p for p in by_process[0] + by_process[1] if p.path != ('a', 'w')]
  with pytest.raises(ValueError, match=re.escape(message)):
    shards.assemble([rest, change(wa)])


if __name__ == '__main__':
  driver(*sys.argv[1:])
