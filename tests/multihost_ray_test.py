"""Trainer processes as Ray actors (train.num_processes=2, generation.placement='ray'): the driver
is process 0, process 1 a Ray actor beside it; generator actors on CPU.

Two runs of the main command, the second resuming the first, each take two faults in turn
(what a run costs is mostly its start: Ray, JAX in two processes):
  1. 2 generator actors, the weights through the object store. The second actor is killed with
     -9 mid-run: it is restarted once and every sample is trained exactly once. Then Ctrl-C:
     every loop stops within 10 s, both processes save, nothing is left behind, and the last
     weights the generators were sent, assembled from both processes' pieces, equal the params
     of the exit checkpoint exactly.
  2. The same command resumes from that checkpoint over gloo (the nccl protocol): both processes
     gather a whole copy onto their own devices and process 0 broadcasts its copy, which the
     generator loads without a transport error; the latest checkpoint equals what the generator
     was sent at its version. Then kill -9 of the trainer actor stops the run with one line
     naming it.
(That such a run learns follows from multihost_test's two-process step equalling the
single-process one; the learning runs are reward_test's.) The pieces' assembly refuses a gap, an
overlap or a wrong layout whole. Bad settings are one-line errors naming the key; trainer
processes go to nodes of their own, else beside the driver.

Run as a script, this file is the main command with recording hooks (`main_recording`).
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
# The first run: its second generator actor is killed once KILL_AT_STEP's record is written; it
# is stopped by Ctrl-C once STOP_AT_STEP's is (enough for the restarted actor to serve again).
KILL_AT_STEP, STOP_AT_STEP, SEED = 8, 14, 1
KEEP_VERSIONS = 4  # the recorded params of the last published versions


def flags(kind: str, workdir, model_dir: str) -> list[str]:
  """The main command's flags for run `kind`: 'kill' (2 generator actors, the object store) or
  'gloo' (1 generator, the weights over gloo, a checkpoint every step)."""
  common = ['--config=configs/math.py:tiny', f'--workdir={workdir}',
            f'--config.model.path={model_dir}', f'--config.seed={SEED}',
            '--config.generation.placement=ray', '--config.train.num_processes=2',
            '--config.rl.batch_size=16', '--config.rl.group_size=4',
            '--config.generation.num_slots=16', '--config.rl.max_time_s=0',
            '--config.rl.total_steps=100000', '--config.log.tensorboard=False',
            '--config.log.progress=False']
  if kind == 'kill':
    # A CPU each for the trainer actor and the 2 generators: Ray's count, not cores (the
    # second generator shares a core with the trainer actor).
    return common + ['--config.generation.num_generators=2', '--config.cluster.num_cpus=3']
  return common + ['--config.generation.num_generators=1', '--config.cluster.num_cpus=2',
                   '--config.generation.remote.weight_transport=gloo',
                   '--config.checkpoint.every_steps=1']


def learner_config(workdir, model_dir: str) -> config_lib.Config:
  """What reading the run's checkpoints needs: its model and optimizer, on one process."""
  c = config_lib.load_preset('tiny')
  c.model.path, c.seed = model_dir, SEED
  c.checkpoint.dir = os.path.join(workdir, 'checkpoints')
  return config_lib.validate(c)


def main_recording(kind: str, out: str, *argv: str) -> None:
  """The main command (`python -m pipelinerl_jax.main *argv`), recording into `out` the
  weights the generator pool is handed (the last KEEP_VERSIONS versions, whole), over gloo the
  version each loaded and the transport errors, and in `out`.completed the request ids the pool
  completed. 'kill' kills the second generator actor when version KILL_AT_STEP + 1 is published.
  The record is rewritten after every update: the command may end with os._exit."""
  import ray
  from pipelinerl_jax import main as main_lib
  from pipelinerl_jax.generation.actors import pool as pool_lib
  real_update, real_step = pool_lib.RayGenerators.update_params, pool_lib.RayGenerators.step
  record = dict(params={}, digests={}, loaded={}, transport_errors=[], killed=[])
  completed = open(f'{out}.completed', 'a')

  def keep(version, params, digest):
    record['params'][version], record['digests'][version] = params, digest
    for old in sorted(record['params'])[:-KEEP_VERSIONS]:
      del record['params'][old]
    with open(f'{out}.tmp', 'wb') as f:
      pickle.dump(record, f)
    os.replace(f'{out}.tmp', out)

  def recording_update(self, params, version):
    # After step KILL_AT_STEP's record is written (it follows that step's update).
    if kind == 'kill' and version == KILL_AT_STEP + 1 and not record['killed']:
      record['killed'].append(self.members()[1]['pid'])
      os.kill(record['killed'][0], signal.SIGKILL)  # an actor this run started
    if not isinstance(params, shards.Published):  # over gloo: process 0's gathered copy
      assert all(x.is_fully_addressable for x in jax.tree.leaves(params))
      host = jax.device_get(params)
      real_update(self, params, version)
      self.wait_version(version)
      record['loaded'][version] = self.stats()['version']
      record['transport_errors'] = list(self.transport_errors)
      keep(version, host, layout.tree_digest(host))
      return
    keep(version, shards.assemble(ray.get(list(params.refs))), params.digest)
    real_update(self, params, version)

  def recording_step(self):
    done = real_step(self)
    completed.writelines(f'{d.request_id}\n' for d in done)
    completed.flush()
    return done

  pool_lib.RayGenerators.update_params = recording_update
  pool_lib.RayGenerators.step = recording_step
  sys.argv = ['pipelinerl_jax.main', *argv]
  main_lib.cli()


def assert_sent_the_checkpoint(record: dict, workdir, model_dir: str) -> int:
  """The weights the generators were sent at the version of the run's latest checkpoint (written
  by both processes, read here in one process) equal that checkpoint's params; that version."""
  from pipelinerl_jax.pipeline import build as build_lib
  learner = build_lib.build_learner(learner_config(workdir, model_dir), str(workdir), model_dir)
  step = int(learner.state.step)
  assert step in record['params'], (step, sorted(record['params']))
  want, got = flat(learner.state.params), flat(record['params'][step])
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert record['digests'][step] == layout.tree_digest(record['params'][step])
  return step


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def actors_seen(tree, name: str) -> list[int]:
  """Pids of the run's actors of class `name` (a Ray worker renames itself once it holds an
  actor: seen before, or now)."""
  return [pid for pid, (_, line) in tree.seen.items()
          if f'ray::{name}' in line or f'ray::{name}' in procs_lib.cmdline(pid)]


def step_records(workdir) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(str(workdir / 'metrics.jsonl')) if 'step' in r]


def record_of_kill(tmp_path) -> list[int]:
  """The pid of the generator actor the 'kill' run killed, once it has."""
  with open(tmp_path / 'kill.pkl', 'rb') as f:
    return pickle.load(f)['killed']


def run_main_until(tmp_path, kind: str, workdir, model_dir: str, ready, act, timeout_s=300
                   ) -> tuple[int, str, procs_lib.RunTree, dict]:
  """`main_recording(kind)` until `ready(records)` holds for the run's step records; then
  `act(proc, tree)`, and the run's exit code once it ends (bounded: never a hang), its output,
  its process tree and what it recorded."""
  out, log_path = tmp_path / f'{kind}.pkl', tmp_path / f'{kind}.log'
  cmd = [sys.executable, __file__, kind, str(out), *flags(kind, workdir, model_dir)]
  with open(log_path, 'w') as log:
    # A session of its own: Ctrl-C in a terminal signals the whole foreground process group.
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    tree = procs_lib.RunTree(proc.pid).watch()
    try:
      deadline = time.monotonic() + timeout_s
      metrics = workdir / 'metrics.jsonl'
      while not (metrics.exists() and ready(step_records(workdir))):
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f'the run never got there: {log_path.read_text()[-4000:]}'
        time.sleep(0.5)
      act(proc, tree)
      code = proc.wait(120)
    finally:
      if proc.poll() is None:
        proc.kill()
      tree.stop()
  with open(out, 'rb') as f:
    record = pickle.load(f)
  record['completed'] = (tmp_path / f'{kind}.pkl.completed').read_text().split()
  return code, log_path.read_text(), tree, record


def test_a_killed_generator_ctrl_c_resume_over_gloo_and_a_killed_trainer(model_dir, tmp_path):
  """The two runs of the module doc, on one workdir.

  Until 2026-11-29 these were four runs (a generator killed, Ctrl-C, its resume over gloo, the
  trainer killed), each starting Ray and JAX in two processes; before 2026-11-26 the generator's
  kill was a 400-step learning run. The claims about the faults and the weights need no
  learning, and one run can take two faults in turn."""
  workdir = tmp_path / 'run'

  # 1. A generator actor killed, then Ctrl-C.
  def stopped_after_the_restart(records):
    return len(records) >= STOP_AT_STEP and records[-1]['generation/restarts'] == 1

  def ctrl_c(proc, tree):
    live = [pid for pid in tree.sample().seen if 'ray::Generator' in procs_lib.cmdline(pid)]
    assert len(live) == 2 and record_of_kill(tmp_path)[0] not in live, tree.seen  # a successor
    assert len(actors_seen(tree, 'TrainerProcess')) == 1, tree.seen
    # What a terminal does: SIGINT to the whole foreground group (the trainer actor is in Ray's).
    os.killpg(proc.pid, signal.SIGINT)

  code, output, tree, record = run_main_until(tmp_path, 'kill', workdir, model_dir,
                                              stopped_after_the_restart, ctrl_c)
  assert code == 130, output[-4000:]  # 128 + SIGINT
  stopped_s = float(re.search(r'loops stopped ([0-9.]+) s after the interrupt', output).group(1))
  assert stopped_s < 10, output[-4000:]
  tree.assert_clean(timeout_s=20)  # every process of the run, and its /dev/shm entries
  records = step_records(workdir)
  steps = [r['step'] for r in records]
  assert steps == list(range(1, len(steps) + 1))  # one writer
  assert record['killed'] and records[KILL_AT_STEP - 1]['generation/restarts'] == 0
  assert records[-1]['generation/restarts'] == 1
  assert len(record['completed']) == len(set(record['completed']))  # none completed twice
  assert records[-1]['samples'] == steps[-1] * 16  # none lost or counted twice
  saved = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir())
  assert saved == [steps[-1]], (saved, steps)  # the exit save, from both processes
  assert {p.name for p in (workdir / 'checkpoints' / str(saved[-1]) / 'state').glob(
      'ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}
  assert assert_sent_the_checkpoint(record, workdir, model_dir) == saved[-1] == max(
      record['params'])  # the last update sent, assembled from both processes' pieces

  # 2. The same command resumes over gloo; then the trainer actor is killed.
  killed = []

  def three_steps_on(records):
    return len(records) >= saved[-1] + 3

  def kill_the_trainer_actor(proc, tree):
    victim = actors_seen(tree.sample(), 'TrainerProcess')
    assert len(victim) == 1, tree.seen
    os.kill(victim[0], signal.SIGKILL)
    killed.append(victim[0])

  code, output, tree, record = run_main_until(tmp_path, 'gloo', workdir, model_dir,
                                              three_steps_on, kill_the_trainer_actor)
  assert f'resuming from {workdir / "checkpoints"} at step {saved[-1]}' in output, output[-4000:]
  assert code == 1, output[-4000:]
  last = output.strip().splitlines()[-1]
  # Whichever sees it first: process 0's heartbeat ('is gone') or Ray, reporting the actor's
  # worker dead ('ended: ...'); one line naming the process either way.
  assert re.match(rf'error: trainer process 1 of 2 \(host {re.escape(socket.gethostname())}, '
                  rf'pid {killed[0]}\) (is gone|ended: its worker process has died)',
                  last), output[-4000:]
  tree.assert_clean(timeout_s=20)
  steps = [r['step'] for r in step_records(workdir)]
  assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= saved[-1] + 3  # no step twice
  # Each update was loaded before the next step, without a transport error, and the latest
  # checkpoint (a step after the resume) holds what the generator was sent at its version.
  assert record['loaded'] and all(record['loaded'][v] == v for v in record['loaded'])
  assert record['transport_errors'] == []
  assert assert_sent_the_checkpoint(record, workdir, model_dir) > saved[-1]


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
  main_recording(*sys.argv[1:])
