"""The watchdog that ends what a local Ray leaves behind, on a process tree of its own (no Ray):
processes below its roots are tracked as they appear, orphans included, and ended once the
driver's pipe closes, also those that ignore SIGTERM."""

import os
import re
import signal
import socket
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


# --- this host's network -----------------------------------------------------------------------


def test_an_interface_or_address_this_host_lacks_is_one_line_naming_the_host():
  host = socket.gethostname()
  with pytest.raises(ValueError) as e:
    cluster.interface_address('nosuch0')
  assert str(e.value).startswith(f"config.cluster.interface='nosuch0': that interface does not "
                                 f'exist on host {host} (its interfaces: lo 127.0.0.1')
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError) as e:
    cluster.check_local_address('198.18.0.9')
  assert str(e.value).startswith(f"config.cluster.node_ip='198.18.0.9' is not an address of host "
                                 f'{host}')
  assert cluster.interface_address('lo') == cluster.check_local_address('127.0.0.1') == '127.0.0.1'
  with pytest.raises(ValueError, match=r"^config\.cluster\.interface='nosuch0': that interface"):
    cluster.NetworkCounter('nosuch0')


def test_the_network_counter_counts_the_bytes_an_interface_carries():
  counter = cluster.NetworkCounter('lo')
  with socket.create_server(('127.0.0.1', 0)) as server:
    with socket.create_connection(server.getsockname()) as client:
      peer, _ = server.accept()
      with peer:
        client.sendall(b'x' * 1_000_000)
        got = 0
        while got < 1_000_000:
          got += len(peer.recv(1 << 20))
  totals = counter.totals()
  assert set(totals) == {'net/rx_bytes', 'net/tx_bytes'}
  assert totals['net/tx_bytes'] >= 1_000_000 and totals['net/rx_bytes'] >= 1_000_000


def test_joining_ray_as_an_address_this_host_lacks_is_one_line():
  with pytest.raises(ValueError, match=r"^config\.cluster\.node_ip='198\.18\.0\.9' is not an "):
    cluster.connect(config_lib.ClusterConfig(address='198.18.0.1:6379', node_ip='198.18.0.9'))


@pytest.mark.parametrize('section, fields, message', [
    ('cluster', dict(node_ip='10.0.0'), "must be an IPv4 address like '10.0.0.5'"),
    ('cluster', dict(interface='eth 1'), 'must be a network interface name'),
    ('cluster', dict(interface='a' * 16), 'must be a network interface name'),
    ('remote', dict(node_ip='b'), "must be an IPv4 address like '10.0.0.5'"),
    ('remote', dict(heartbeat_timeout_s=0.5), 'must be >= 1'),
    ('distributed', dict(coordinator_port=70000), 'must be a port number'),
])
def test_network_settings_are_checked(section, fields, message):
  cls = dict(cluster=config_lib.ClusterConfig, remote=config_lib.RemoteConfig,
             distributed=config_lib.DistributedConfig)[section]
  with pytest.raises(ValueError, match=re.escape(message)):
    cls(**fields)


def test_network_settings_apply_where_they_are_used():
  c = config_lib.load_preset('tiny')
  c.cluster.interface = 'eth1'  # any run of several processes, Ray or not: valid alone
  config_lib.validate(c)
  c.cluster.node_ip = '10.0.0.5'  # the driver's Ray node
  with pytest.raises(ValueError, match=r"^config\.cluster: is where Ray actors run"):
    config_lib.validate(c)
  c = config_lib.load_preset('tiny')
  c.train.num_processes, c.train.distributed.coordinator_port = 2, 1234
  c.train.distributed.coordinator_address, c.train.distributed.process_id = '10.0.0.5:1234', 0
  with pytest.raises(ValueError, match=r'^config\.train\.distributed\.coordinator_port: is the '):
    config_lib.validate(c)
