"""The watchdog that ends what a local Ray leaves behind, on a process tree of its own (no Ray):
processes below its roots are tracked as they appear, orphans included, and ended once the
driver's pipe closes, also those that ignore SIGTERM."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pipelinerl_jax import cluster
from pipelinerl_jax import config as config_lib

# A root that starts a child which ignores SIGTERM, then exits itself: the child is orphaned
# (reparented away from the tree), as Ray's agents are when the raylet dies.
TREE = '''
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c',
    'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])
print(child.pid, flush=True)
time.sleep(float(sys.argv[1]))
'''


@pytest.mark.serial
def test_watchdog_ends_tracked_processes_and_orphans_when_its_pipe_closes():
  root = subprocess.Popen([sys.executable, '-c', TREE, '2'], stdout=subprocess.PIPE, text=True)
  child = int(root.stdout.readline())
  tracked = {child: cluster._stat(child)[2]}
  watchdog = subprocess.Popen([sys.executable, '-m', 'pipelinerl_jax.cluster', str(root.pid)],
                              stdin=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(
                                  os.path.abspath(cluster.__file__))))
  try:
    time.sleep(1.5)                   # the watchdog has seen the child
    root.wait(10)                     # the root exits: its child is an orphan now
    assert cluster.alive(tracked)
    watchdog.send_signal(signal.SIGINT)  # Ctrl-C to the group: the watchdog keeps watching
    time.sleep(0.5)
    assert watchdog.poll() is None
    start = time.monotonic()
    watchdog.stdin.close()            # the driver is gone
    watchdog.wait(20)
    assert not cluster.alive(tracked)  # SIGTERM ignored: SIGKILL after the grace periods
    assert time.monotonic() - start < cluster.GRACE_S + cluster.TERM_WAIT_S + 5
  finally:
    for p in (root, watchdog):
      if p.poll() is None:
        p.kill()
    if cluster.alive(tracked):  # ours, if the test failed before the watchdog ended it
      os.kill(child, signal.SIGKILL)


def test_descendants_and_alive_read_the_process_table():
  me = os.getpid()
  proc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])
  try:
    assert proc.pid in cluster.descendants([me])
    start = cluster._stat(proc.pid)[2]
    assert cluster.alive({proc.pid: start}) == {proc.pid: start}
    assert cluster.alive({proc.pid: start + 1}) == {}  # a reused pid is another process
  finally:
    proc.kill()
    proc.wait()
  assert cluster.alive({proc.pid: start}) == {}


@pytest.mark.parametrize('fields, message', [
    (dict(address='localhost'), "must be '' (start Ray locally), 'auto' or 'HOST:PORT'"),
    (dict(address='auto', num_cpus=2), 'size a local start only'),
    (dict(num_gpus=-2), 'must be >= -1'),
])
def test_cluster_settings_are_checked(fields, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    config_lib.ClusterConfig(**fields)
  assert config_lib.ClusterConfig(address='10.0.0.5:6379').address == '10.0.0.5:6379'
