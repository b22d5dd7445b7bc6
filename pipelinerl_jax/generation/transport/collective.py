"""Bucketed NCCL weight transport from the trainer to generator actors on CUDA hosts, and the
same protocol over gloo on CPU (`GlooCommunicator`, generation.remote.weight_transport='gloo').
Ray has no such transport for tensors that live in a JAX process, hence this module.

UNRUN: written for one trainer rank broadcasting to the generator actors over a vLLM
`PyNcclCommunicator` on a `StatelessProcessGroup` (no global torch.distributed state); no GPU was
available where it was written. Everything that does not touch CUDA -- the plan, packing,
unpacking, the wire protocol and the timeout -- is tested on CPU with an in-process
communicator (tests/collective_test.py), and across processes over gloo
(tests/ray_generators_test.py).

Wire protocol, per update (every tensor is broadcast from rank `src`):
  1. header: int64 [MAGIC, version, plan_digest, num_buckets]
  2. num_buckets flat uint8 buffers, in plan order; bucket i holds whole fusion units
     (`hf_tensors.buckets`: q/k/v together, gate/up together), each tensor 256-byte aligned.
Both sides derive the same `Plan` from the model config, dtype and bucket size, so no names or
shapes travel: the digest in the header proves the two plans agree (a receiver built for
another model or bucket size rejects the update instead of misreading bytes).

Whole or nothing: the receiver fills one staging buffer with every bucket before anything
reaches the engine (cost: one model-sized buffer on the generator's GPU), then hands views of
it to `VllmEngine.update_hf_tensors`. A receive that does not finish within `timeout_s` raises
TimeoutError; NCCL calls cannot be cancelled, so the communicator is unusable afterwards and the
generator must be restarted (the actor exits, or the pool kills it, and Ray restarts it).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import socket
import threading
from typing import Any, Iterable, Protocol

import torch

from pipelinerl_jax.generation.transport import hf_tensors

MAGIC = 0x4E43434C574A4158  # 'NCCLWJAX'
ALIGN = 256


class Communicator(Protocol):
  """What the transport needs: vLLM's PyNcclCommunicator has this method."""

  def broadcast(self, tensor: torch.Tensor, src: int) -> None:
    ...


@dataclasses.dataclass(frozen=True)
class Slot:
  name: str
  shape: tuple[int, ...]
  offset: int  # bytes from the start of its bucket


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where every HF tensor lies: buckets of slots, in checkpoint order."""
  dtype: str
  buckets: tuple[tuple[Slot, ...], ...]
  bucket_nbytes: tuple[int, ...]

  @property
  def digest(self) -> int:
    blob = json.dumps([self.dtype, [[dataclasses.astuple(s) for s in b] for b in self.buckets]])
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:7], 'little')

  @property
  def nbytes(self) -> int:
    return sum(self.bucket_nbytes)


def make_plan(shapes: dict[str, tuple[int, ...]], dtype: str = 'bfloat16',
              bucket_bytes: int = 256 << 20) -> Plan:
  """The layout of `shapes` (checkpoint order, e.g. `hf_tensors.expected_shapes(config)`) in
  buckets of about `bucket_bytes`; fusion units are never split."""
  itemsize = hf_tensors.TORCH_DTYPES[dtype].itemsize
  meta = [(name, torch.empty(shape, dtype=hf_tensors.TORCH_DTYPES[dtype], device='meta'))
          for name, shape in shapes.items()]
  buckets, sizes = [], []
  for bucket in hf_tensors.buckets(meta, bucket_bytes):
    slots, offset = [], 0
    for name, t in bucket.tensors:
      slots.append(Slot(name, tuple(t.shape), offset))
      offset = hf_tensors.align(offset + t.numel() * itemsize, ALIGN)
    buckets.append(tuple(slots))
    sizes.append(offset)
  return Plan(dtype, tuple(buckets), tuple(sizes))


def bucket_views(plan: Plan, i: int, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
  """(name, view) of bucket i's tensors inside its flat uint8 buffer (no copy)."""
  dtype = hf_tensors.TORCH_DTYPES[plan.dtype]
  out = []
  for slot in plan.buckets[i]:
    nbytes = hf_tensors.numel(slot.shape) * dtype.itemsize
    out.append((slot.name, flat[slot.offset:slot.offset + nbytes].view(dtype).view(slot.shape)))
  return out


def pack(plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]], device='cpu'
         ) -> Iterable[tuple[int, torch.Tensor]]:
  """Yields (bucket index, flat uint8 buffer) with `tensors` copied in (cast to the plan's
  dtype); `tensors` must come in plan order (checkpoint order), each exactly once."""
  it = iter(tensors)
  for i, size in enumerate(plan.bucket_nbytes):
    flat = torch.zeros(size, dtype=torch.uint8, device=device)
    for name, view in bucket_views(plan, i, flat):
      got, src = next(it, (None, None))
      if got != name:
        raise ValueError(f'bucket {i}: expected tensor {name}, got {got} (not in checkpoint '
                         'order, or from another model)')
      if tuple(src.shape) != tuple(view.shape):
        raise ValueError(f'{name} has shape {tuple(src.shape)}, the plan says {tuple(view.shape)}')
      view.copy_(src)
    yield i, flat
  extra = next(it, None)
  if extra is not None:
    raise ValueError(f'tensor {extra[0]} is not in the plan')


def send(comm: Communicator, plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]],
         version: int, *, src: int = 0, device='cpu') -> None:
  """Trainer side: header, then every bucket (one bucket buffer alive at a time)."""
  header = torch.tensor([MAGIC, version, plan.digest, len(plan.buckets)], dtype=torch.int64,
                        device=device)
  comm.broadcast(header, src=src)
  for _, flat in pack(plan, tensors, device):
    comm.broadcast(flat, src=src)
  _wait(device)


def _wait(device) -> None:
  """NCCL broadcasts are asynchronous on the current CUDA stream: wait for them, so that a
  caller's deadline covers the transfer itself. UNRUN (no GPU here)."""
  if torch.device(device).type == 'cuda':
    torch.cuda.current_stream(torch.device(device)).synchronize()


def receive(comm: Communicator, plan: Plan, *, src: int = 0, device='cpu',
            timeout_s: float = 120.0) -> tuple[int, list[tuple[str, torch.Tensor]]]:
  """Generator side: (version, [(hf_name, view into one staging buffer)]) once every bucket has
  arrived; raises ValueError for a header that does not match the plan, TimeoutError when the
  update does not complete within `timeout_s` (the communicator is then unusable)."""
  result: dict[str, Any] = {}

  def body():
    try:
      header = torch.zeros(4, dtype=torch.int64, device=device)
      comm.broadcast(header, src=src)
      magic, version, digest, n = (int(x) for x in header.tolist())
      if magic != MAGIC or digest != plan.digest or n != len(plan.buckets):
        raise ValueError(f'weight update header {hex(magic)}/{digest:#x}/{n} buckets does not '
                         f'match this generator\'s plan ({plan.digest:#x}/{len(plan.buckets)} '
                         'buckets): trainer and generator disagree on model, dtype or bucket size')
      staging = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
      views, start = [], 0
      for i, size in enumerate(plan.bucket_nbytes):
        flat = staging[start:start + size]
        comm.broadcast(flat, src=src)
        views += bucket_views(plan, i, flat)
        start += size
      _wait(device)  # NCCL only enqueues: done means the bytes are here, inside the deadline
      result['update'] = (version, views)
    except BaseException as e:  # re-raised in the caller's thread
      result['error'] = e

  thread = threading.Thread(target=body, name='nccl-weights-receive', daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise TimeoutError(f'weight update not received within {timeout_s:.0f}s (trainer dead '
                       'or stuck?); the communicator is unusable, restart the generator')
  if 'error' in result:
    raise result['error']
  return result['update']


def connect(host: str, port: int, rank: int, world_size: int, device: torch.device):
  """A PyNcclCommunicator over a StatelessProcessGroup (trainer: rank 0; generators 1..N).
  UNRUN here (needs CUDA)."""
  from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
  from vllm.distributed.utils import StatelessProcessGroup
  group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
  return PyNcclCommunicator(group, device=device)


# --- rendezvous: trainer (rank 0) and one generator (rank 1) ------------------------------------

BACKENDS = ('gloo', 'nccl')


def _backstop(timeout_s: float) -> datetime.timedelta:
  """The library's own timeout: later than the callers' deadlines (`receive`, the generator's
  send thread), so theirs report first, with the clearer message."""
  return datetime.timedelta(seconds=2 * timeout_s + 10)


class GlooCommunicator:
  """`broadcast` over a torch ProcessGroupGloo built on its own TCPStore. No default process
  group is created (`torch.distributed.is_initialized()` stays False), so the trainer process
  keeps no global torch.distributed state and can hold one group per generator. Gloo runs the
  same wire protocol as NCCL on CPU, so CI exercises the real cross-process path."""

  def __init__(self, store, rank: int, world_size: int, timeout_s: float):
    import torch.distributed as dist
    self._dist = dist
    self.pg = dist.ProcessGroupGloo(dist.PrefixStore('pipelinerl_jax/weights', store), rank,
                                    world_size, _backstop(timeout_s))

  def broadcast(self, tensor: torch.Tensor, src: int) -> None:
    opts = self._dist.BroadcastOptions()
    opts.rootRank = src
    self.pg.broadcast([tensor], opts).wait()


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """What a generator needs to join its trainer's group (picklable)."""
  backend: str
  host: str
  port: int
  world_size: int = 2


class Rendezvous:
  """Trainer side of one group; `connect` blocks until the generator joins. Every (re)started
  generator gets a new one: a new port, so a dead generator's group is never reused."""

  def __init__(self, backend: str, timeout_s: float, host: str = '127.0.0.1'):
    if backend not in BACKENDS:
      raise ValueError(f'weight transport {backend!r} is not one of {BACKENDS}')
    self.backend, self.timeout_s = backend, timeout_s
    if backend == 'gloo':
      from torch.distributed import TCPStore
      self._server = TCPStore(host, 0, 2, True, timeout=_backstop(timeout_s),
                              wait_for_workers=False)
      port = self._server.port
    else:  # StatelessProcessGroup starts its store server on this socket in `connect`
      self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      self._server.bind((host, 0))
      self._server.listen()
      port = self._server.getsockname()[1]
    self.endpoint = Endpoint(backend, host, port)

  def connect(self, device=None) -> Communicator:
    """Rank 0's communicator (NCCL: on `device`, the trainer's GPU). UNRUN for nccl."""
    if self.backend == 'gloo':
      return GlooCommunicator(self._server, 0, self.endpoint.world_size, self.timeout_s)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    e = self.endpoint
    group = StatelessProcessGroup.create(host=e.host, port=e.port, rank=0,
                                         world_size=e.world_size, listen_socket=self._server,
                                         store_timeout=int(self.timeout_s))
    return PyNcclCommunicator(group, device=device)


def join(endpoint: Endpoint, rank: int, timeout_s: float, device=None) -> Communicator:
  """Generator side: this rank's communicator in the group `endpoint` names."""
  if endpoint.backend == 'gloo':
    from torch.distributed import TCPStore
    store = TCPStore(endpoint.host, endpoint.port, endpoint.world_size, False,
                     timeout=_backstop(timeout_s))
    return GlooCommunicator(store, rank, endpoint.world_size, timeout_s)
  from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
  from vllm.distributed.utils import StatelessProcessGroup
  group = StatelessProcessGroup.create(host=endpoint.host, port=endpoint.port, rank=rank,
                                       world_size=endpoint.world_size,
                                       store_timeout=int(timeout_s))
  return PyNcclCommunicator(group, device=device)
