"""Two hosts inside this machine (tests/two_hosts.py: namespaces `a` and `b` joined by a veth
pair, 198.18.0.1 and 198.18.0.2, each with its own hostname, its own /etc/hosts mapping that
name to 127.0.1.1 as Debian's does, its own /dev/shm and Ray temp dir), and PipelineRL across
them as on a cluster: a Ray head on a and a Ray worker node on b (`ray start`, each node's
address given), the driver on a as trainer process 0, trainer process 1 and the generator
actor on b, jax.distributed and its gloo collectives over the veth, weights over gloo from a to b.

The cluster stays up across three runs of the same command, as a real one does:
  1. `across`: the generator on b serves every version the trainer publishes bit for bit (the
     run checks each update's checksum on b: generation.remote.verify_updates) and the metrics
     count the bytes that crossed; the link cut for 3 s at step 3 goes unnoticed; the link cut
     for good after step 10 stops it within the heartbeat timeout the config sets (plus the
     stop itself), in one line naming host b, its checkpoints intact, nothing of the run left
     on either host. That the tiny preset learns is reward_test's: across the hosts the same
     updates reach the same engine, which is what this run proves.
  2. `killed`: b is replaced (the link plugged back, a new Ray node on it) and the same command
     resumes from the first run's last checkpoint across the hosts; every process on b is then
     killed with -9: the same stop.
  3. `moved`: the same command with the generators moved to a resumes from the last checkpoint,
     on host a alone (the cluster has dropped b).
At the end, stopping each host's `ray start` as `ray stop` does leaves both hosts empty.

Needs network namespaces (root, iproute2: tests/needs.py's `netns`).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.pipeline import metrics as metrics_lib

import two_hosts  # tests/ is on sys.path

pytestmark = [pytest.mark.serial,  # a cluster, kills and deadlines
              pytest.mark.needs('netns')]

ROOT = two_hosts.ROOT
PYTHON = sys.executable
RAY = str(pathlib.Path(sys.executable).with_name('ray'))
A, B = two_hosts.ADDRESS['a'], two_hosts.ADDRESS['b']
PORT = 6379
# The run's bound: a trainer process or a generator silent this long is lost
# (train.distributed.heartbeat_timeout_s, generation.remote.heartbeat_timeout_s).
HEARTBEAT_S = 10
# What the stop takes once the loss is seen (supervise.LOST_PROCESS_STOP_S, closing the
# generators, leaving Ray), with room for a loaded host.
STOP_SLACK_S = 15
BLIP_S = 3
# The cluster's own settings (the head's --system-config): a node is dead after 10 missed
# health checks 1 s apart (each given 2 s: a loaded node answers late), so a node cut off for
# good is out before the next run places actors, while a 3-s cut is not.
RAY_SYSTEM_CONFIG = dict(health_check_period_ms=1000, health_check_timeout_ms=2000,
                         health_check_failure_threshold=10)
# Every process on the hosts: one CPU device each, XLA at -O0 (as multihost_test), quiet Ray.
# RAY_AUTH_MODE: `ray start --head` otherwise turns on token authentication and writes
# ~/.ray/auth_token (two namespaces with no route out need none). RAY_worker_niceness: Ray
# starts its workers at niceness 15; the hosts share this machine's cores, and b's trainer
# process and generator would starve behind a's driver.
ENV = {'TOKENIZERS_PARALLELISM': 'false', 'PYTHONPATH': str(ROOT), 'PYTHONUNBUFFERED': '1',
       'JAX_PLATFORMS': 'cpu', 'RAY_AUTH_MODE': 'disabled', 'RAY_USAGE_STATS_ENABLED': '0',
       'RAY_worker_niceness': '0',
       'XLA_FLAGS': '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'}
# The first run: the tiny preset (B = 128, G = 8) on the warm-started demo model, a checkpoint
# every EVERY steps.
STEPS, BLIP_AT, EVERY = 10, 3, 5
RAY_DAEMONS = ('ray start', 'gcs_server', 'raylet', 'log_monitor', 'monitor.py', 'dashboard',
               'ray.util.client.server', 'DashboardAgent', 'RuntimeEnvAgent', 'ray::IDLE')


def env() -> dict[str, str]:
  return {**{k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}, **ENV}


class Cluster:
  """The two hosts and the Ray cluster on them; `command(...)` is the run's command line."""

  def __init__(self, hosts: two_hosts.TwoHosts, logs: pathlib.Path, model_dir: str):
    self.hosts, self.logs, self.model_dir = hosts, logs, model_dir
    self.nodes: dict[str, subprocess.Popen] = {}

  def start_node(self, host: str, name: str) -> None:
    """`ray start --block` on `host`, its address given: the head on a (its 3 CPUs are for
    the run moved there), a worker node on b."""
    flags = (['--head', f'--port={PORT}', '--include-dashboard=false', '--disable-usage-stats',
              f'--system-config={json.dumps(RAY_SYSTEM_CONFIG)}'] if host == 'a' else
             [f'--address={A}:{PORT}'])  # retries until the head answers
    self.nodes[name] = self.hosts.popen(host, [
        RAY, 'start', '--block', f'--node-ip-address={two_hosts.ADDRESS[host]}', '--num-cpus=3',
        '--object-store-memory=200000000', *flags], self.logs / f'{name}.log', env=env())

  def wait_started(self, name: str, timeout_s: float = 180) -> None:
    log, deadline = self.logs / f'{name}.log', time.monotonic() + timeout_s
    while 'Ray runtime started' not in log.read_text():
      assert self.nodes[name].poll() is None, log.read_text()[-3000:]
      assert time.monotonic() < deadline, f'Ray node {name} did not start'
      time.sleep(0.2)

  def live_nodes(self) -> list[str]:
    """The addresses of the cluster's live nodes, as a driver on a sees them."""
    code = (f'import ray; ray.init(address="{A}:{PORT}", _node_ip_address="{A}", '
            'log_to_driver=False); print(" ".join(sorted(n["NodeManagerAddress"] for n in '
            'ray.nodes() if n["Alive"])))')
    out = self.hosts.run('a', [PYTHON, '-c', code], timeout_s=120, env=env())
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()

  def wait_dropped(self, address: str, timeout_s: float = 90) -> None:
    """Until the cluster has marked the node at `address` dead (its health checks), as a user
    waits (`ray status`) before running again without it."""
    deadline = time.monotonic() + timeout_s
    while address in self.live_nodes():
      assert time.monotonic() < deadline, f'the cluster kept node {address} alive'

  def command(self, workdir: pathlib.Path, generators_on: str, steps: int) -> list[str]:
    """The run's command on host a, the same for every run but where its generators go."""
    return [
        PYTHON, '-m', 'pipelinerl_jax.main', '--config=configs/math.py:tiny',
        f'--workdir={workdir}', f'--config.model.path={self.model_dir}', '--config.seed=1',
        '--config.generation.placement=ray', '--config.train.num_processes=2',
        '--config.train.mesh=2,1,1',  # data parallel: one all-reduce of the gradients a step
        f'--config.cluster.address={A}:{PORT}', f'--config.cluster.node_ip={A}',
        f'--config.cluster.interface={two_hosts.INTERFACE}',
        f'--config.generation.remote.node_ip={two_hosts.ADDRESS[generators_on]}',
        '--config.generation.remote.weight_transport=gloo',
        f'--config.generation.remote.heartbeat_timeout_s={HEARTBEAT_S}',
        f'--config.train.distributed.heartbeat_timeout_s={HEARTBEAT_S}',
        '--config.generation.remote.verify_updates=True',
        f'--config.checkpoint.every_steps={EVERY}', f'--config.rl.total_steps={steps}',
        '--config.rl.max_time_s=0', '--config.log.tensorboard=False',
        '--config.log.progress=False']

  def start_run(self, name: str, workdir, generators_on: str, steps: int) -> subprocess.Popen:
    return self.hosts.popen('a', self.command(workdir, generators_on, steps),
                            self.logs / f'{name}.log', env=env(), cwd=str(ROOT))

  def output(self, name: str) -> str:
    return (self.logs / f'{name}.log').read_text()

  def run_processes(self, host: str) -> list[str]:
    """What of a run runs on `host`: its processes but the Ray node's own."""
    return [p for p in self.hosts.processes(host) if not any(d in p for d in RAY_DAEMONS)]

  def wait_run_gone(self, start: float, timeout_s: float) -> tuple[list[str], list[str], float]:
    """Waits for both hosts to run nothing of a run; (what is left on a, on b, seconds since
    `start` (time.monotonic) when it was so)."""
    while (left := (self.run_processes('a'), self.run_processes('b'))) != ([], []):
      if time.monotonic() - start > timeout_s:
        break
      time.sleep(0.2)
    return (*left, time.monotonic() - start)

  def stop_nodes(self) -> None:
    for proc in self.nodes.values():  # as `ray stop`: SIGTERM, and `ray start` ends its own
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    for proc in self.nodes.values():
      proc.wait(60)


def records(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  if not path.exists():
    return []
  return [r for r in metrics_lib.read_metrics(str(path)) if 'step' in r]


def wait_for_step(workdir, step: int, proc: subprocess.Popen, output, timeout_s: float = 900,
                  resumed_since: float | None = None):
  """Until the run has written `step`'s record. `resumed_since` (time.time() when a resumed run
  started): only its own records, once it has moved the previous run's later ones aside."""
  deadline = time.monotonic() + timeout_s
  dropped = pathlib.Path(workdir) / metrics_lib.DROPPED_FILE
  while (resumed_since is not None and not (
      dropped.exists() and dropped.stat().st_mtime >= resumed_since)) or (
          not (rs := records(workdir)) or rs[-1]['step'] < step):
    assert proc.poll() is None, output()[-4000:]
    assert time.monotonic() < deadline, f'step {step} not reached'
    time.sleep(0.2)


def saved_steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (pathlib.Path(workdir) / 'checkpoints').iterdir()
                if p.name.isdigit())


def fault(cluster: Cluster, name: str, workdir, proc, do) -> dict:
  """`do()` to a running run; what followed: exit code, output, seconds from the fault to the
  driver's exit and to both hosts running nothing of the run, what was left, checkpoints."""
  start = time.monotonic()
  do()
  proc.wait(HEARTBEAT_S + 120)
  out = dict(stop_s=time.monotonic() - start, code=proc.returncode,
             output=cluster.output(name))
  out['left_a'], out['left_b'], out['gone_s'] = cluster.wait_run_gone(
      start, HEARTBEAT_S + STOP_SLACK_S + 30)
  out['saved'], out['records'] = saved_steps(workdir), records(workdir)
  return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The three runs of the module's doc, on one cluster; what each showed."""
  from pipelinerl_jax.demo import warmstart
  model_dir = warmstart.model_dir_for(  # the warm-started demo model, built once, cached
      config_lib.validate(config_lib.load_preset('tiny')))
  base = tmp_path_factory.mktemp('two_hosts')
  workdir = base / 'run'
  out = dict(workdir=workdir, model_dir=model_dir)
  with two_hosts.TwoHosts(base / 'hosts') as hosts:
    c = Cluster(hosts, base, model_dir)
    c.start_node('a', 'ray-a')
    c.start_node('b', 'ray-b')
    c.wait_started('ray-a')
    c.wait_started('ray-b')

    # 1. across: every version served bit for bit; a blip; then cut for good
    proc = c.start_run('across', workdir, 'b', STEPS + 1000)
    output = lambda: c.output('across')  # noqa: E731
    wait_for_step(workdir, BLIP_AT, proc, output)
    hosts.link('down')
    time.sleep(BLIP_S)
    hosts.link('up')
    out['blip_step'] = records(workdir)[-1]['step']
    wait_for_step(workdir, STEPS, proc, output)
    out['across'] = fault(c, 'across', workdir, proc, lambda: hosts.link('down'))
    c.wait_dropped(B)

    # 2. killed: b replaced, the same command resumes across the hosts; b killed
    hosts.kill('b')  # what is left of b's Ray node: it cannot rejoin as the same node
    hosts.link('up')
    c.start_node('b', 'ray-b2')
    c.wait_started('ray-b2')
    resumed_at, since = out['across']['saved'][-1], time.time()
    proc = c.start_run('killed', workdir, 'b', resumed_at + 1000)
    wait_for_step(workdir, resumed_at + 2, proc, lambda: c.output('killed'), resumed_since=since)
    out['killed'] = fault(c, 'killed', workdir, proc, lambda: hosts.kill('b'))
    c.wait_dropped(B)

    # 3. moved: the same command, the generators on a
    proc = c.start_run('moved', workdir, 'a', out['killed']['saved'][-1] + 2)
    out['moved'] = dict(code=proc.wait(600), output=c.output('moved'), records=records(workdir))

    c.stop_nodes()
    out['left_at_end'] = hosts.wait_empty('a', 30) + hosts.wait_empty('b', 30)
    yield out


# --- the hosts themselves, and JAX's gloo between them -------------------------------------------

PROBE = '''
import json, os, socket
from pipelinerl_jax import cluster
name = socket.gethostname()
try:
  socket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(('8.8.8.8', 53))
  out = 'a route out'
except OSError as e:
  out = e.strerror
print(json.dumps(dict(name=name, resolves=socket.gethostbyname(name), peer=socket.gethostbyname(
    {'a': 'b', 'b': 'a'}[name]), interfaces=cluster.interfaces(), out=out,
    shm=os.listdir('/dev/shm'))))
'''


def test_two_hosts_are_two_hosts_and_leave_nothing_behind(tmp_path):
  with two_hosts.TwoHosts(tmp_path / 'hosts') as hosts:
    namespaces = hosts.namespaces()
    hosts.run('a', ['touch', '/dev/shm/only-on-a'], check=True)
    seen = {h: json.loads(hosts.run(h, [PYTHON, '-c', PROBE], env=env(), check=True).stdout)
            for h in ('a', 'b')}
    # b reaches a's address over the veth (a's own name resolves to loopback, Debian-style)
    server = hosts.popen('a', [PYTHON, '-c', 'import socket; s = socket.create_server(("'
                               f'{A}", 7777)); c, _ = s.accept(); c.sendall(b"from a")'],
                         tmp_path / 'server.log')
    time.sleep(1)
    got = hosts.run('b', [PYTHON, '-c', f'import socket; print(socket.create_connection(("{A}"'
                          ', 7777), timeout=10).recv(10).decode())'], check=True)
    server.wait(10)
    assert not os.path.exists('/dev/shm/only-on-a')
  for h, other in (('a', 'b'), ('b', 'a')):
    assert seen[h]['name'] == h and seen[h]['resolves'] == '127.0.1.1'
    assert seen[h]['peer'] == two_hosts.ADDRESS[other]
    assert seen[h]['interfaces'] == {'lo': '127.0.0.1', 'wire0': two_hosts.ADDRESS[h]}
    assert seen[h]['out'] == 'Network is unreachable'
  assert seen['a']['shm'] == ['only-on-a'] and seen['b']['shm'] == []
  assert got.stdout.strip() == 'from a'
  assert two_hosts.in_namespaces(namespaces) == []  # gone: the namespaces and the veth pair

  # `up` killed with -9 (the test process killed, say): its holders die with it
  hosts = two_hosts.TwoHosts(tmp_path / 'killed').__enter__()
  namespaces = hosts.namespaces()
  hosts.popen('b', ['sleep', '600'], tmp_path / 'sleep.log')
  os.kill(hosts.keeper_pid, signal.SIGKILL)
  deadline = time.monotonic() + 10
  while two_hosts.in_namespaces(namespaces) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert two_hosts.in_namespaces(namespaces) == []
  hosts.close()


GLOO = '''
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pipelinerl_jax import config as config_lib, distributed
index, interface = int(sys.argv[1]), sys.argv[2]
train = config_lib.TrainConfig(num_processes=2, distributed=config_lib.DistributedConfig(
    coordinator_address=sys.argv[3], process_id=index, heartbeat_timeout_s=10))
try:
  distributed.initialize(train, interface=interface)
except ValueError as e:
  print('refused:', e)
  sys.exit(0)
mesh = Mesh(np.array(jax.devices()), ('x',))
x = jax.make_array_from_callback((2,), NamedSharding(mesh, P('x')),
                                 lambda i: np.full(1, index + 1.0))
print('sum:', float(jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(x)))
'''


def test_jax_gloo_between_the_hosts_listens_on_the_interface_never_on_loopback(tmp_path):
  """Without cluster.interface, JAX's gloo would listen where the host name resolves (127.0.1.1
  here): refused in one line. With it, a collective between the hosts runs over the veth."""
  with two_hosts.TwoHosts(tmp_path / 'hosts') as hosts:
    for interface, port in (('', 7001), (two_hosts.INTERFACE, 7002)):
      procs = [hosts.popen(h, [PYTHON, '-c', GLOO, str(i), interface, f'{A}:{port}'],
                           tmp_path / f'{h}{port}.log', env=env())
               for i, h in enumerate('ab')]
      assert [p.wait(120) for p in procs] == [0, 0]
    outputs = {f'{h}{port}': (tmp_path / f'{h}{port}.log').read_text().strip().splitlines()[-1]
               for h in 'ab' for port in (7001, 7002)}
  for h in 'ab':
    assert outputs[f'{h}7001'] == (
        f"refused: config.cluster.interface is unset, so JAX's gloo collectives would listen on "
        f"127.0.1.1, what host name '{h}' resolves to, which the other hosts cannot reach (the "
        f'coordinator is {A}:7001): set it to the network interface the hosts share')
    assert outputs[f'{h}7002'] == 'sum: 3.0'


# --- the runs ------------------------------------------------------------------------------------


def test_host_b_serves_every_published_version_bit_for_bit_and_the_bytes_are_counted(runs):
  from pipelinerl_jax.generation.transport import collective
  from pipelinerl_jax.generation.transport import hf_tensors
  from pipelinerl_jax.models.hf import schema as hf_schema
  rs = [r for r in runs['across']['records'] if r['step'] <= STEPS]
  assert [r['step'] for r in rs] == list(range(1, STEPS + 1))
  # Version 0 and one update a step, each checked on b against the checksum of what a published
  # (a mismatch stops the run): by step n's record, versions 0 .. n-2 at least (the count is as
  # of the generator's last poll).
  verified = [r['generation/updates_verified'] for r in rs]
  sent, received = rs[-1]['net/tx_bytes'], rs[-1]['net/rx_bytes']
  print(f'\nupdates verified on b by step: {verified}; {rs[-1]["time_s"]:.0f} s; '
        f'{sent / 1e6:.1f} MB sent from a to b, {received / 1e6:.1f} MB received')
  assert all(v >= r['step'] - 1 for v, r in zip(verified, rs))
  assert all(np.diff(verified) >= 0)
  # Each step's weights went from a to b's generator over gloo: at least that many bytes left
  # a's interface; and the counts only grow.
  model = hf_schema.load_config(runs['model_dir'])
  update_bytes = collective.make_plan(hf_tensors.expected_shapes(model), 'float32').nbytes
  assert sent >= STEPS * update_bytes
  assert received > 0
  assert all(np.diff([r['net/tx_bytes'] for r in rs]) > 0)


def test_a_cut_of_a_few_seconds_goes_unnoticed(runs):
  # The run went on through the blip at step BLIP_AT, every step once, to its cut for good.
  steps = [r['step'] for r in runs['across']['records']]
  assert runs['blip_step'] < STEPS <= steps[-1]
  assert steps == list(range(1, len(steps) + 1))


def assert_stopped_in_one_line(out: dict, what: str) -> None:
  last = out['output'].strip().splitlines()[-1]
  print(f'\n{what}: the driver stopped {out["stop_s"]:.1f} s after it, both hosts free of '
        f'the run {out["gone_s"]:.1f} s after it; {last}')
  assert out['code'] == 1, out['output'][-4000:]
  assert last.startswith('error: trainer process 1 of 2 (host b, pid '), last
  assert out['stop_s'] < HEARTBEAT_S + STOP_SLACK_S
  assert (out['left_a'], out['left_b']) == ([], []), out
  assert out['gone_s'] < HEARTBEAT_S + STOP_SLACK_S


def test_a_cut_for_good_stops_the_run_in_one_line_naming_the_host(runs):
  out = runs['across']
  assert_stopped_in_one_line(out, 'the link cut for good')
  assert 'silent for' in out['output'].strip().splitlines()[-1]  # the heartbeat's bound
  # its last checkpoint is whole (a save the cut cut short is not one): the next run resumes
  # from it, across the hosts
  assert out['saved'][-1] >= STEPS - EVERY
  assert (f'resuming from {runs["workdir"] / "checkpoints"} at step {out["saved"][-1]}'
          in runs['killed']['output'])


def test_every_process_on_b_killed_stops_the_run_in_one_line(runs):
  out = runs['killed']
  assert_stopped_in_one_line(out, 'every process on b killed with -9')
  steps = [r['step'] for r in out['records']]
  assert steps[-1] >= runs['across']['saved'][-1] + 2


def test_the_same_command_with_the_generators_on_a_resumes(runs):
  out, saved = runs['moved'], runs['killed']['saved'][-1]
  assert out['code'] == 0, out['output'][-4000:]
  assert f'resuming from {runs["workdir"] / "checkpoints"} at step {saved}' in out['output']
  assert out['records'][-1]['step'] == saved + 2
  assert runs['left_at_end'] == []
