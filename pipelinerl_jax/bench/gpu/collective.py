"""The collective section: the weight transport over NCCL (generation/transport/collective.py)
between two processes on one GPU, a trainer's sender and a generator's receiver, as the design
runs them on two GPUs.

NCCL refuses two ranks of a group on one device unless they look like two hosts: each process
gets its own NCCL_HOSTID, and NCCL then moves the bytes over its socket transport. So the time
says what the protocol costs over sockets, not what NVLink or PCIe between two GPUs would give;
what the section proves is that the real communicator carries whole updates, bit for bit. It
needs vLLM (its PyNcclCommunicator and StatelessProcessGroup), which tools/gpu_stage.py brings to
the GPU image; it runs only when named. On a CPU (--quick) the same two processes use gloo.

Per model: the receiver's process joins the group (`{model} join`: both ranks, from the spawn),
then every update of `repeats` is sent whole in the wire dtype (bf16, as to vLLM on a GPU):
seconds per update, GB/s over the bytes sent, and every tensor's received bits against the sent
ones (an exact integer sum of each tensor's bit patterns).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib

WIRE_DTYPE = 'bfloat16'
TIMEOUT_S = 60.0             # a join or one update; a dead peer ends the item by then
NCCL_HOSTIDS = ('pipelinerl-trainer', 'pipelinerl-generator')  # ranks 0 and 1


def _as_another_host(rank: int) -> None:
  """NCCL settings of this process, before NCCL starts in it: its own host id, and the loopback
  interface for NCCL's sockets (both ranks are on this machine)."""
  os.environ['NCCL_HOSTID'] = NCCL_HOSTIDS[rank]
  os.environ.setdefault('NCCL_SOCKET_IFNAME', 'lo')


def bits_sum(tensor) -> int:
  """The sum of a tensor's elements read as integers of their width: equal for equal bits,
  exact, and the same in whatever order a device adds them."""
  import torch
  ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
  return int(tensor.contiguous().view(ints).sum(dtype=torch.int64))


def _receive(endpoint, config, updates: int, device: str, results) -> None:
  """(the receiver's process) Joins as rank 1, receives `updates` updates of the model `config`
  and puts, for each, (version, {hf_name: bits_sum}) on `results`; an error as its one line."""
  if endpoint.backend == 'nccl':
    _as_another_host(1)
  from pipelinerl_jax.generation.transport import collective
  from pipelinerl_jax.generation.transport import hf_tensors
  try:
    plan = collective.make_plan(hf_tensors.expected_shapes(config), WIRE_DTYPE)
    comm = collective.join(endpoint, 1, timeout_s=TIMEOUT_S, device=device)
    receiver = collective.Receiver(comm, plan, device)
    for _ in range(updates):
      version, views, release = receiver.receive(timeout_s=TIMEOUT_S)
      results.put((version, {name: bits_sum(v) for name, v in views}))
      release()
    collective.destroy(comm)
  except Exception as e:
    results.put(section_lib.one_line(e))


def run(s: section_lib.Section) -> None:
  """Each model of the preset in turn, a receiver's process and a group of its own each."""
  for name in s.sizes.collective_models:
    if s.remaining() < 10:
      s.skip(f'{name} join', 'time budget')
      continue
    _model(s, name)


def _model(s: section_lib.Section, name: str) -> None:
  """One model: its group, joined by a receiver's process, then `repeats` whole updates."""
  import multiprocessing
  import jax
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.generation.transport import collective
  from pipelinerl_jax.generation.transport import hf_tensors
  from pipelinerl_jax.models import transformer

  on_gpu = jax.default_backend() == 'gpu'
  backend, device = ('nccl', 'cuda:0') if on_gpu else ('gloo', 'cpu')
  if on_gpu:
    _as_another_host(0)
  config = train_bench.MODEL_PRESETS[name]
  plan = collective.make_plan(hf_tensors.expected_shapes(config), WIRE_DTYPE)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  tensors = lambda: hf_tensors.gathered_torch_tensors(params, config, jax.devices()[0],
                                                      WIRE_DTYPE)
  sent = {n: bits_sum(t) for n, t in tensors()}
  updates = s.sizes.repeats
  spawn = multiprocessing.get_context('spawn')
  results = spawn.Queue()
  t0 = time.perf_counter()
  rendezvous = collective.Rendezvous(backend, timeout_s=TIMEOUT_S)
  proc = spawn.Process(
      target=_receive, args=(rendezvous.endpoint, config, updates, device, results),
      daemon=True)
  proc.start()
  sender, comm = collective.Sender(device), None
  try:
    try:
      comm = rendezvous.connect(device)
    except Exception as e:
      s.fail(f'{name} join', e)
      return
    s.add(f'{name} join', model=name, backend=backend, device=device,
          seconds=time.perf_counter() - t0, nccl_hostids=list(NCCL_HOSTIDS) if on_gpu else None)
    runs, received = [], []
    try:
      for version in range(1, updates + 1):
        t0 = time.perf_counter()
        sender.send(comm, plan, tensors, version,
                    timeout_s=max(5.0, min(TIMEOUT_S, s.remaining())))
        runs.append(time.perf_counter() - t0)
        received.append(results.get(timeout=TIMEOUT_S))
        if isinstance(received[-1], str):
          raise RuntimeError(f'the receiver: {received[-1]}')
    except Exception as e:
      s.fail(f'{name} update', e)
      return
    t = statistics.median(runs)
    s.add(f'{name} update', model=name, backend=backend, wire_dtype=WIRE_DTYPE,
          bytes=plan.nbytes, tensors=len(sent), buckets=len(plan.buckets), updates=len(runs),
          seconds=t, seconds_runs=runs, gb_per_s=plan.nbytes / t / 1e9,
          versions_ok=[v for v, _ in received] == list(range(1, updates + 1)),
          values_equal=all(got == sent for _, got in received))
  finally:
    if comm is not None:
      collective.destroy(comm)
    rendezvous.close()
    sender.close()
    proc.join(timeout=30)
    if proc.is_alive():
      proc.kill()


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  if item['name'].endswith('join'):
    return f"{g('backend')} on {g('device')}: joined in {g('seconds'):.1f} s"
  return (f"{section_lib.fmt_si(g('bytes'), 'B')} in {g('buckets')} buckets, {g('updates')} "
          f"updates: {g('seconds') * 1e3:.1f} ms each, {g('gb_per_s'):.2f} GB/s; versions "
          f"{g('versions_ok')}, values equal {g('values_equal')}")
