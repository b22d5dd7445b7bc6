"""The NCCL weight transport's CUDA-free parts: plan, packing, protocol, whole-or-nothing
receive and timeout, over an in-process stand-in for PyNcclCommunicator."""

import queue
import threading
import time

import jax
import pytest
import torch

from pipelinerl_jax.generation.transport import collective
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models import transformer

CONFIG = transformer.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                 num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32,
                                 qkv_bias=True)


class LoopbackComm:
  """broadcast() semantics of one rank of an in-process group: src's tensor is copied into
  every other rank's tensor of the same shape and dtype."""

  def __init__(self, inboxes: list[queue.Queue], rank: int):
    self.inboxes, self.rank = inboxes, rank

  def broadcast(self, tensor, src):
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


def test_plan_keeps_checkpoint_order_and_whole_fusion_units():
  shapes = hf_tensors.expected_shapes(CONFIG)
  plan = collective.make_plan(shapes, 'bfloat16', bucket_bytes=20_000)
  names = [s.name for b in plan.buckets for s in b]
  assert names == list(shapes)
  assert len(plan.buckets) > 3
  for bucket in plan.buckets:
    modules = [hf_tensors.module_of(s.name) for s in bucket]
    for m in set(modules):  # every part of a fused module sits in one bucket
      assert modules.count(m) == sum(hf_tensors.module_of(n) == m for n in names)
    assert all(s.offset % collective.ALIGN == 0 for s in bucket)
  assert plan.digest == collective.make_plan(shapes, 'bfloat16', 20_000).digest
  assert plan.digest != collective.make_plan(shapes, 'bfloat16', 40_000).digest
  assert plan.digest != collective.make_plan(shapes, 'float32', 20_000).digest


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_broadcast_round_trip_to_two_generators(dtype):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), dtype, bucket_bytes=30_000)
  trainer, *generators = comms(3)
  results = [None, None]

  def receive(k):
    results[k] = collective.receive(generators[k], plan, timeout_s=30)

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
    collective.receive(gen, collective.make_plan(shapes, 'bfloat16', 60_000), timeout_s=30)
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
    def broadcast(self, tensor, src):
      time.sleep(5)

  start = time.monotonic()
  with pytest.raises(TimeoutError, match='not received within 0s .trainer dead or stuck'):
    collective.receive(Silent(), plan, timeout_s=0.2)
  assert time.monotonic() - start < 3


def _gloo_receiver(endpoint, results):
  """(spawned process) rank 1: receives one update and sends back its tensors."""
  plan = collective.make_plan(hf_tensors.expected_shapes(CONFIG), 'float32', 30_000)
  comm = collective.join(endpoint, 1, timeout_s=30)
  version, views = collective.receive(comm, plan, timeout_s=30)
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
    collective.send(comm, plan, hf_tensors.hf_torch_tensors(params, CONFIG), version=4)
    version, got = results.get(timeout=60)
  finally:
    proc.join(timeout=30)
  assert version == 4 and not dist.is_initialized()  # no global torch.distributed state
  ref = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  assert [n for n, _ in got] == [n for n, _ in ref]
  for (name, v), (_, r) in zip(got, ref):
    torch.testing.assert_close(torch.from_numpy(v), r, rtol=0, atol=0, msg=name)
