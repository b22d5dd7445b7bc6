"""PipelineRL with generators as Ray actors (generation.placement='ray', JAX engines): SIGTERM
stops every actor within 10 s and saves; a driver killed with -9 leaves no Ray process behind.
(The vLLM backend in actors runs in pipeline_test.)

Ctrl-C of the main command with generator actors (every loop stopped within 10 s, the exit
checkpoint, nothing left, the same command resuming from it), and a run going on while one of
2 generator actors is killed mid-run (replaced, every sample exactly once), are tested with the
trainer in 2 processes, in multihost_ray_test.py: one run takes both.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from pipelinerl_jax import cluster

import xla_env  # tests/ is on sys.path

# Ray, signals and kills with deadlines, and /dev/shm listed before and after a run.
pytestmark = pytest.mark.serial

ROOT = pathlib.Path(__file__).resolve().parent.parent

def _main(workdir, model_dir, *extra):
  return [sys.executable, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
          f'--workdir={workdir}', f'--config.model.path={model_dir}',
          '--config.generation.placement=ray', '--config.generation.num_generators=2',
          '--config.cluster.num_cpus=2', '--config.rl.batch_size=16', '--config.rl.group_size=4',
          '--config.generation.num_slots=16', '--config.rl.max_time_s=0', *extra]


def _start(cmd):
  env = xla_env.one_device(PYTHONUNBUFFERED='1')
  # A session of its own: Ctrl-C in a terminal signals the whole foreground process group.
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_steps(proc, metrics, n, timeout=300):
  deadline = time.monotonic() + timeout
  while not (metrics.exists() and metrics.read_text().count('\n') >= n):
    assert proc.poll() is None, proc.stdout.read()
    assert time.monotonic() < deadline, 'training never started'
    time.sleep(0.5)


def _ray_processes(pid):
  """Every process below the driver, with its start time: Ray's head processes, its agents and
  workers (the generator actors among them), and the watchdog."""
  table = cluster.process_table()
  below = cluster.descendants([pid], table)
  names = {p: pathlib.Path(f'/proc/{p}/cmdline').read_bytes().replace(b'\0', b' ').decode()
           for p in below if os.path.exists(f'/proc/{p}/cmdline')}
  assert any('raylet' in n for n in names.values()), names
  assert any('gcs_server' in n for n in names.values()), names
  assert sum(n.startswith('ray::Generator') for n in names.values()) == 2, names
  return {p: table[p][2] for p in below}


def _assert_all_gone(tracked, shm_before, timeout=20):
  deadline = time.monotonic() + timeout
  while cluster.alive(tracked) and time.monotonic() < deadline:
    time.sleep(0.2)
  left = cluster.alive(tracked)
  assert not left, {p: pathlib.Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in left}
  new = set(os.listdir('/dev/shm')) - shm_before
  assert not [n for n in new if 'plasma' in n or 'ray' in n], new


def test_sigterm_stops_every_actor_within_ten_seconds_and_saves(model_dir, tmp_path):
  """What a scheduler does: SIGTERM to the driver. (Ctrl-C, to the whole foreground group, and
  the resume: multihost_ray_test, with a trainer actor as well.)"""
  shm_before = set(os.listdir('/dev/shm'))
  metrics = tmp_path / 'metrics.jsonl'
  proc = _start(_main(tmp_path, model_dir, '--config.rl.total_steps=100000'))
  try:
    _wait_for_steps(proc, metrics, 2)
    tracked = _ray_processes(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, out  # 128 + SIGTERM
  stopped_s = float(re.search(r'loops stopped ([0-9.]+) s after the interrupt', out).group(1))
  assert stopped_s < 10
  steps = [json.loads(line)['step'] for line in metrics.read_text().splitlines()]
  assert [int(p.name) for p in (tmp_path / 'checkpoints').iterdir()] == [steps[-1]]
  _assert_all_gone(tracked, shm_before)


def test_driver_killed_with_sigkill_leaves_no_ray_process(model_dir, tmp_path):
  shm_before = set(os.listdir('/dev/shm'))
  proc = _start(_main(tmp_path, model_dir, '--config.rl.total_steps=100000'))
  try:
    _wait_for_steps(proc, tmp_path / 'metrics.jsonl', 1)
    tracked = _ray_processes(proc.pid)
    proc.kill()  # SIGKILL: no handler, no atexit, no ray.shutdown
    proc.wait(30)
  finally:
    if proc.poll() is None:
      proc.kill()
  _assert_all_gone(tracked, shm_before)
