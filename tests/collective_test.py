"""The NCCL weight transport's CUDA-free parts: plan, packing, protocol, whole-or-nothing
receive, the long-lived sender and receiver threads and their reused buffers, deadlines and
teardown on failure (over in-process stand-ins for PyNcclCommunicator), and the rendezvous of
both backends across processes: gloo for real; nccl with vLLM's real StatelessProcessGroup and a
stand-in communicator, and with vLLM's real PyNcclCommunicator, which disables itself here (no
CUDA) and is refused in one line."""

import dataclasses
import queue
import threading
import time

import jax
import pytest
import torch

from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation.transport import collective
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models import transformer

pytestmark = pytest.mark.serial  # several processes meeting over gloo, receive and send deadlines

CONFIG = transformer.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                 num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32,
                                 qkv_bias=True)
# Qwen3's layout: per-head q/k norms, no biases, tied embeddings.
QWEN3 = dataclasses.replace(CONFIG, qkv_bias=False, qk_norm=True, tie_embeddings=True,
                            architecture='Qwen3ForCausalLM')


class LoopbackComm:
  """broadcast() semantics of one rank of an in-process group: src's tensor is copied into
  every other rank's tensor of the same shape and dtype. Records the threads it ran in and its
  destroy() calls."""

  def __init__(self, inboxes: list[queue.Queue], rank: int):
    self.inboxes, self.rank = inboxes, rank
    self.threads, self.destroyed = set(), 0

  def destroy(self):
    self.destroyed += 1

  def broadcast(self, tensor, src):
    self.threads.add(threading.get_ident())
    if self.rank == src:
      for r, q in enumerate(self.inboxes):
        if r != src:
          q.put(tensor.clone())
    else:
      got = self.inboxes[self.rank].get(timeout=30)
      assert got.shape == tensor.shape and got.dtype == tensor.dtype, (got.shape, tensor.shape)
      tensor.copy_(got)


def comms(n):
  inboxes = [queue.Queue() for _ in range(n)]
  return [LoopbackComm(inboxes, r) for r in range(n)]


@pytest.mark.parametrize('config', [CONFIG, QWEN3], ids=['qwen2', 'qwen3'])
def test_plan_keeps_checkpoint_order_and_whole_fusion_units(config):
  shapes = hf_tensors.expected_shapes(config)
  plan = collective.make_plan(shapes, 'bfloat16', bucket_bytes=20_000)
  names = [s.name for b in plan.buckets for s in b]
  assert names == list(shapes)
  assert sum(n.endswith(('.q_norm.weight', '.k_norm.weight')) for n in names) == (
      2 * config.num_layers if config.qk_norm else 0)
  assert len(plan.buckets) > 3
  for bucket in plan.buckets:
    modules = [hf_tensors.module_of(s.name) for s in bucket]
    for m in set(modules):  # every part of a fused module sits in one bucket
      assert modules.count(m) == sum(hf_tensors.module_of(n) == m for n in names)
    assert all(s.offset % budget.ALIGN == 0 for s in bucket)
  assert plan.digest == collective.make_plan(shapes, 'bfloat16', 20_000).digest
  assert plan.digest != collective.make_plan(shapes, 'bfloat16', 40_000).digest
  assert plan.digest != collective.make_plan(shapes, 'float32', 20_000).digest
  # The memory plan's staging figure (budget, no torch) is the receiver's buffer, exactly.
  for dtype in ('bfloat16', 'float32'):
    for bucket_bytes in (20_000, 1 << 30):
      assert collective.make_plan(shapes, dtype, bucket_bytes).nbytes == \
          budget.staged_bytes(shapes.values(), dtype)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_broadcast_round_trip_to_two_generators(dtype):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), dtype, bucket_bytes=30_000)
  trainer, *generators = comms(3)
  results = [None, None]

  def receive(k):
    results[k] = collective.Receiver(generators[k], plan).receive(timeout_s=30)[:2]

  threads = [threading.Thread(target=receive, args=(k,)) for k in range(2)]
  for t in threads:
    t.start()
  collective.send(trainer, plan, hf_tensors.hf_torch_tensors(params, CONFIG), version=7)
  for t in threads:
    t.join(30)
  ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  for version, views in results:
    assert version == 7
    assert [n for n, _ in views] == [n for n, _ in ref]
    base = views[0][1].untyped_storage().data_ptr()
    for (name, v), (_, r) in zip(views, ref):
      assert v.dtype == hf_tensors.TORCH_DTYPES[dtype]
      torch.testing.assert_close(v, r.to(v.dtype), rtol=0, atol=0, msg=name)
      assert v.untyped_storage().data_ptr() == base  # one staging buffer: whole or nothing


def test_mismatched_plans_are_rejected_not_misread():
  shapes = hf_tensors.expected_shapes(CONFIG)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  trainer, gen = comms(2)
  sender = threading.Thread(target=collective.send, args=(
      trainer, collective.make_plan(shapes, 'bfloat16', 30_000),
      hf_tensors.hf_torch_tensors(params, CONFIG), 1))
  sender.start()
  with pytest.raises(ValueError, match='disagree on model, dtype or bucket size'):
    collective.Receiver(gen, collective.make_plan(shapes, 'bfloat16', 60_000)).receive(30)
  assert gen.destroyed == 1  # the group is torn down, not left half-read
  sender.join(1)  # it stays blocked on buckets nobody reads (a real group would be torn down)


def test_pack_refuses_tensors_out_of_plan_order():
  shapes = hf_tensors.expected_shapes(CONFIG)
  plan = collective.make_plan(shapes, 'float32', 30_000)
  tensors = list(hf_tensors.hf_torch_tensors(
      transformer.init_params(CONFIG, jax.random.PRNGKey(0)), CONFIG))
  tensors[0], tensors[1] = tensors[1], tensors[0]
  with pytest.raises(ValueError, match='checkpoint order'):
    list(collective.pack(plan, tensors))


def test_receive_times_out_with_a_clear_error():
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)

  class Silent:  # a trainer that never sends
    destroyed = 0

    def broadcast(self, tensor, src):
      time.sleep(5)

    def destroy(self):
      self.destroyed += 1

  comm = Silent()
  start = time.monotonic()
  with pytest.raises(TimeoutError, match='not received within 0s .trainer dead or stuck'):
    collective.Receiver(comm, plan).receive(timeout_s=0.2)
  assert time.monotonic() - start < 3
  assert comm.destroyed == 1


def _gloo_receiver(endpoint, results):
  """(spawned process) rank 1: receives one update and sends back its tensors."""
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  comm = collective.join(endpoint, 1, timeout_s=30)
  version, views, _ = collective.Receiver(comm, plan).receive(timeout_s=30)
  # numpy, not torch: a torch tensor crosses a Queue as a shared-memory fd that the reader
  # fetches from this process, which may have exited by then.
  results.put((version, [(n, v.numpy().copy()) for n, v in views]))


def test_gloo_broadcast_across_processes_without_a_default_group():
  import multiprocessing as mp
  import torch.distributed as dist
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(1))
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  rendezvous = collective.Rendezvous('gloo', timeout_s=30)
  ctx = mp.get_context('spawn')
  results = ctx.Queue()
  proc = ctx.Process(target=_gloo_receiver, args=(rendezvous.endpoint, results), daemon=True)
  proc.start()
  try:
    comm = rendezvous.connect()
    collective.Sender().send(comm, plan, lambda: hf_tensors.hf_torch_tensors(params, CONFIG),
                             version=4, timeout_s=30)
    version, got = results.get(timeout=60)
  finally:
    proc.join(timeout=30)
  assert version == 4 and not dist.is_initialized()  # no global torch.distributed state
  ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  assert [n for n, _ in got] == [n for n, _ in ref]
  for (name, v), (_, r) in zip(got, ref):
    torch.testing.assert_close(torch.from_numpy(v), r, rtol=0, atol=0, msg=name)


def test_one_sender_and_one_receiver_thread_and_buffer_serve_every_update():
  """No thread per transfer: the same sender thread, packing buffer, receiver thread and staging
  buffer for every update (on CUDA, also one stream each: torch caches freed memory per stream)."""
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  trainer, gen = comms(2)
  sender, receiver = collective.Sender(), collective.Receiver(gen, plan)
  assert receiver.staging.numel() == plan.nbytes  # allocated when joining, before any update
  staging = receiver.staging.data_ptr()
  seen = []
  for version in (1, 2, 3):
    params = transformer.init_params(CONFIG, jax.random.PRNGKey(version))
    out = {}
    t = threading.Thread(target=lambda: out.update(got=receiver.receive(timeout_s=30)))
    t.start()
    sender.send(trainer, plan, lambda: hf_tensors.hf_torch_tensors(params, CONFIG), version,
                timeout_s=30)
    t.join(30)
    got, views, release = out['got']
    assert got == version
    for (name, v), (_, r) in zip(views, hf_tensors.hf_torch_tensors(params, CONFIG)):
      torch.testing.assert_close(v, r, rtol=0, atol=0, msg=name)
    assert views[0][1].untyped_storage().data_ptr() == staging
    seen.append((sender.thread.ident, sender.buffer.data_ptr(), receiver.thread.ident))
    release()
  assert len(set(seen)) == 1, seen
  assert trainer.threads == {sender.thread.ident} and gen.threads == {receiver.thread.ident}
  assert sender.buffer.numel() == plan.max_bucket_nbytes < plan.nbytes


def test_next_update_waits_for_the_release_of_the_staging_buffer():
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  trainer, gen = comms(2)
  receiver = collective.Receiver(gen, plan)
  threading.Thread(target=collective.send, args=(
      trainer, plan, hf_tensors.hf_torch_tensors(params, CONFIG), 1), daemon=True).start()
  _, _, release = receiver.receive(timeout_s=30)
  # Not released (the engine still reads the views): the next update is refused at its
  # deadline, without touching the buffer, and the group is torn down.
  start = time.monotonic()
  with pytest.raises(TimeoutError, match='previous weight update was not released'):
    receiver.receive(timeout_s=0.3)
  assert 0.3 <= time.monotonic() - start < 3 and gen.destroyed == 1
  release()
  release()  # idempotent: a second call does not free a later update's buffer


def test_a_failed_or_stuck_send_destroys_the_communicator(monkeypatch):
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  tensors = lambda: hf_tensors.hf_torch_tensors(params, CONFIG)
  sender = collective.Sender()

  class Failing:
    destroyed = 0

    def broadcast(self, tensor, src):
      raise RuntimeError('connection reset by peer')

    def destroy(self):
      self.destroyed += 1

  comm = Failing()
  with pytest.raises(RuntimeError, match='connection reset'):
    sender.send(comm, plan, tensors, 1, timeout_s=30)
  assert comm.destroyed == 1

  class Stuck:
    """A broadcast waiting on a dead peer; an abort (destroy) ends it, like ncclCommAbort."""
    def __init__(self, aborts):
      self.aborts, self.destroyed, self._gone = aborts, 0, threading.Event()

    def broadcast(self, tensor, src):
      self._gone.wait()
      raise RuntimeError('aborted')

    def destroy(self):
      self.destroyed += 1
      if self.aborts:
        self._gone.set()

  thread = sender.thread
  comm = Stuck(aborts=True)
  with pytest.raises(TimeoutError, match='weight update 2 not sent within 0s'):
    sender.send(comm, plan, tensors, 2, timeout_s=0.2)
  assert comm.destroyed == 1 and sender.thread is thread  # the abort freed it: kept
  # A transfer that the destroy does not end is left behind when the next send comes, which
  # runs in a new thread.
  monkeypatch.setattr(collective, 'ABANDON_AFTER_S', 0.2)
  comm = Stuck(aborts=False)
  start = time.monotonic()
  with pytest.raises(TimeoutError):
    sender.send(comm, plan, tensors, 3, timeout_s=0.2)
  assert time.monotonic() - start < 2  # the caller learns at the deadline, not later
  assert comm.destroyed == 1 and sender.thread is thread
  trainer, gen = comms(2)
  receiver = collective.Receiver(gen, plan)
  out = {}
  t = threading.Thread(target=lambda: out.update(got=receiver.receive(timeout_s=30)))
  t.start()
  sender.send(trainer, plan, tensors, 4, timeout_s=30)
  t.join(30)
  assert out['got'][0] == 4
  assert sender.thread is not thread and trainer.threads == {sender.thread.ident}


class Disabled:
  """What vLLM's PyNcclCommunicator is after NCCL failed to load: no error, no data moved."""
  available, disabled, world_size = False, True, 2

  def __init__(self, group, device):
    self.group = group

  def broadcast(self, tensor, src, stream=None):
    return None

  def destroy(self):
    pass


@pytest.mark.needs('vllm')
def test_a_disabled_nccl_communicator_is_refused_in_one_line():
  rendezvous = collective.Rendezvous('nccl', timeout_s=30, communicator=Disabled)
  joined = {}

  def generator():
    try:
      collective.join(rendezvous.endpoint, 1, timeout_s=30, device='cpu', communicator=Disabled)
    except RuntimeError as e:
      joined['error'] = str(e)
  t = threading.Thread(target=generator)
  t.start()
  with pytest.raises(RuntimeError) as e:
    rendezvous.connect('cpu')
  t.join(30)
  for message in (str(e.value), joined['error']):
    assert message.startswith("generation.remote.weight_transport='nccl': the NCCL communicator "
                              'on cpu is disabled: ') and '\n' not in message
  # Here, as on any host without NCCL, the cause is the library vLLM could not load.
  assert 'vLLM could not load the NCCL library' in joined['error']
  assert 'VLLM_NCCL_SO_PATH' in joined['error']


@pytest.mark.needs('vllm')
def test_vllm_pynccl_communicator_without_nccl_is_refused_with_its_cause():
  """The real class over the real StatelessProcessGroup: on a host without NCCL (this one),
  vLLM's communicator disables itself silently; the rendezvous names why instead."""
  rendezvous = collective.Rendezvous('nccl', timeout_s=30)
  errors = {}

  def generator():
    try:
      collective.join(rendezvous.endpoint, 1, timeout_s=30, device='cpu')
    except RuntimeError as e:
      errors[1] = str(e)
  t = threading.Thread(target=generator)
  t.start()
  try:
    rendezvous.connect('cpu')
  except RuntimeError as e:
    errors[0] = str(e)
  t.join(60)
  assert set(errors) == {0, 1}
  for message in errors.values():
    assert 'is disabled: vLLM could not load the NCCL library (ValueError: NCCL only supports ' \
           'CUDA and ROCm backends.' in message, message


class StoreCommunicator:
  """Stands in for vLLM's PyNcclCommunicator where there is no CUDA: its constructor (group,
  device) and broadcast(tensor, src, stream), moving bytes through the StatelessProcessGroup's
  TCPStore, so that the nccl rendezvous and the protocol run across processes on CPU."""
  available, disabled = True, False

  def __init__(self, group, device):
    self.group, self.rank, self.destroyed = group, group.rank, 0

  def broadcast(self, tensor, src, stream=None):
    flat = tensor.reshape(-1).view(torch.uint8)
    if self.rank == src:
      self.group.broadcast_obj(flat.numpy().tobytes(), src)
    else:
      flat.copy_(torch.frombuffer(bytearray(self.group.broadcast_obj(None, src)),
                                  dtype=torch.uint8))

  def destroy(self):
    self.destroyed += 1


def _nccl_path_receiver(endpoint, results):
  """(spawned process) rank 1 over the nccl code path: joins, receives two updates, reports
  them with the receiver's thread and staging buffer."""
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'bfloat16', 30_000)
  comm = collective.join(endpoint, 1, timeout_s=60, device='cpu', communicator=StoreCommunicator)
  receiver = collective.Receiver(comm, plan)
  for _ in range(2):
    version, views, release = receiver.receive(timeout_s=60)
    results.put((version, [(n, v.float().numpy().copy()) for n, v in views],
                 receiver.thread.ident, receiver.staging.data_ptr()))
    release()


@pytest.mark.needs('vllm')
def test_nccl_rendezvous_and_protocol_across_processes_with_a_stand_in_communicator():
  import multiprocessing as mp
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'bfloat16', 30_000)
  rendezvous = collective.Rendezvous('nccl', timeout_s=60, communicator=StoreCommunicator)
  ctx = mp.get_context('spawn')
  results = ctx.Queue()
  proc = ctx.Process(target=_nccl_path_receiver, args=(rendezvous.endpoint, results),
                     daemon=True)
  proc.start()
  sender = collective.Sender()
  try:
    comm = rendezvous.connect('cpu')
    got = []
    for version in (5, 6):
      params = transformer.init_params(CONFIG, jax.random.PRNGKey(version))
      sender.send(comm, plan, lambda: hf_tensors.gathered_torch_tensors(
          params, CONFIG, jax.devices()[0], 'bfloat16'), version, timeout_s=60)
      got.append((params, results.get(timeout=120)))
  finally:
    proc.join(timeout=30)
  assert proc.exitcode == 0
  assert got[0][1][2:] == got[1][1][2:]  # one receiver thread, one staging buffer
  for params, (version, views, _, _) in got:
    ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
    assert [n for n, _ in views] == [n for n, _ in ref]
    for (name, v), (_, r) in zip(views, ref):  # sent in bf16, as to vLLM on a GPU
      torch.testing.assert_close(torch.from_numpy(v), r.to(torch.bfloat16).float(), rtol=0,
                                 atol=0, msg=name)
  collective.destroy(comm)
  assert comm.destroyed == 1 and comm.group is None


def test_gathered_tensors_are_made_one_at_a_time_from_sharded_params():
  """The sender's source: params sharded over the 8 simulated devices, each HF tensor sliced,
  transposed and cast where they live, then alone on one device."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.sharding.Mesh(jax.devices()[:4], ('fsdp',))
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(2))
  sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
      mesh, P(*([None] * (x.ndim - 1)), 'fsdp') if x.shape[-1] % 4 == 0 else P())), params)
  target = jax.devices()[5]
  ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  got = list(hf_tensors.gathered_torch_tensors(sharded, CONFIG, target, 'bfloat16'))
  assert [n for n, _ in got] == [n for n, _ in ref]
  for (name, t), (_, r) in zip(got, ref):
    assert t.dtype == torch.bfloat16 and t.is_contiguous()
    torch.testing.assert_close(t, r.to(torch.bfloat16), rtol=0, atol=0, msg=name)
