"""Bucketed NCCL weight transport from the trainer to generator actors on CUDA hosts, and the
same protocol over gloo on CPU (`GlooCommunicator`, generation.remote.weight_transport='gloo').
Ray has no such transport for tensors that live in a JAX process, hence this module.

UNRUN on CUDA: written for one trainer rank broadcasting to each generator actor over a vLLM
`PyNcclCommunicator` on a `StatelessProcessGroup` (no global torch.distributed state); no GPU
has run it. What does not need CUDA is tested on CPU (tests/collective_test.py): the plan,
packing, the wire protocol, deadlines, the long-lived threads and reused buffers, teardown on
failure; the rendezvous of both backends across processes (nccl: the real StatelessProcessGroup
with a stand-in communicator, and vLLM's real PyNcclCommunicator, which disables itself on a
host without NCCL and is refused here); and gloo between the pool and its actors
(tests/ray_generators_test.py).

Wire protocol, per update (every tensor is broadcast from rank `src`):
  1. header: int64 [MAGIC, version, plan_digest, num_buckets]
  2. num_buckets flat uint8 buffers, in plan order; bucket i holds whole fusion units
     (`hf_tensors.buckets`: q/k/v together, gate/up together), each tensor 256-byte aligned.
Both sides derive the same `Plan` from the model config, dtype (`budget.wire_dtype`: bf16 to
vLLM on GPUs) and bucket size, so no names or shapes travel: the digest in the header proves the
two plans agree (a receiver built for another model, dtype or bucket size rejects the update
instead of misreading bytes).

Threads, streams, buffers. Every send of a trainer runs in one long-lived thread (`Sender`),
every receive of a generator in one long-lived thread (`Receiver`), each on one CUDA stream made
once: torch caches freed device memory per stream, and vLLM's `current_stream()` makes a new
stream per thread, so a thread per transfer would never reuse a buffer. The sender packs every
bucket into one buffer (the largest bucket), reused across buckets, updates and generators:
stream order keeps a bucket's copy after the previous bucket's broadcast. The receiver owns one
staging buffer for a whole update (`budget.STAGING_BUFFERS`), allocated when it joins, before
the engine starts (so vLLM's memory budget sees it).

Whole or nothing: the receiver fills the staging buffer with every bucket before anything reaches
the engine, then hands views of it to the engine with a `release` callback; the next update
waits (within its deadline) until the engine has loaded or dropped the previous one.

Failure: a transfer that raises or misses its deadline (`timeout_s`) leaves the group unusable
(NCCL calls cannot be cancelled). The side that sees it destroys its communicator (`destroy`:
NCCL's abort, which also ends a kernel stuck on a dead peer) and closes the group's store
before raising, and the generator is restarted into a new group (the actor exits, or the pool
kills it, and Ray restarts it). A communicator that could not load NCCL (vLLM's disables itself
and then returns from every broadcast at once) is refused when the group is made, naming why.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import json
import queue
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation.transport import hf_tensors

MAGIC = 0x4E43434C574A4158  # 'NCCLWJAX'


class Communicator(Protocol):
  """What the transport needs: vLLM's PyNcclCommunicator has both methods (its broadcast also
  takes the CUDA stream to run on)."""

  def broadcast(self, tensor: torch.Tensor, src: int) -> None:
    ...

  def destroy(self) -> None:
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
    """A whole update: what the receiver stages (`budget.staged_bytes` of its shapes)."""
    return sum(self.bucket_nbytes)

  @property
  def max_bucket_nbytes(self) -> int:
    """The sender's one packing buffer."""
    return max(self.bucket_nbytes)


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
      offset = budget.align(offset + t.numel() * itemsize)
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


def pack(plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]],
         buffer: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
  """Yields (bucket index, flat uint8 view of `buffer`) with `tensors` copied in (cast to the
  plan's dtype); `tensors` must come in plan order (checkpoint order), each exactly once. Every
  bucket is packed into the same `buffer` (at least `plan.max_bucket_nbytes`; a new CPU one when
  None): consume a bucket before asking for the next."""
  if buffer is None:
    buffer = torch.zeros(plan.max_bucket_nbytes, dtype=torch.uint8)
  if buffer.numel() < plan.max_bucket_nbytes:
    raise ValueError(f'packing buffer of {buffer.numel()} bytes < the largest bucket '
                     f'({plan.max_bucket_nbytes})')
  it = iter(tensors)
  for i, size in enumerate(plan.bucket_nbytes):
    flat = buffer[:size]
    for name, view in bucket_views(plan, i, flat):
      got, src = next(it, (None, None))
      if got != name:
        raise ValueError(f'bucket {i}: expected tensor {name}, got {got} (not in checkpoint '
                         'order, or from another model)')
      if tuple(src.shape) != tuple(view.shape):
        raise ValueError(f'{name} has shape {tuple(src.shape)}, the plan says {tuple(view.shape)}')
      view.copy_(src)
      del src  # a gathered tensor is freed as soon as it is packed
    yield i, flat
  extra = next(it, None)
  if extra is not None:
    raise ValueError(f'tensor {extra[0]} is not in the plan')


def _broadcast(comm: Communicator, tensor: torch.Tensor, src: int, stream) -> None:
  if stream is None:
    comm.broadcast(tensor, src=src)
  else:  # NCCL: on the worker's own stream, not vLLM's per-thread one
    comm.broadcast(tensor, src=src, stream=stream)


def send(comm: Communicator, plan: Plan, tensors: Iterable[tuple[str, torch.Tensor]],
         version: int, *, src: int = 0, buffer: torch.Tensor | None = None,
         stream: Any = None) -> None:
  """Trainer side, in the caller's thread: the header, then every bucket packed into `buffer`
  (see `pack`); returns once the device work is done (`stream` synchronized), so that a
  caller's deadline covers the transfer itself. `Sender` runs this in its thread."""
  device = buffer.device if buffer is not None else torch.device('cpu')
  header = torch.tensor([MAGIC, version, plan.digest, len(plan.buckets)], dtype=torch.int64,
                        device=device)
  _broadcast(comm, header, src, stream)
  for _, flat in pack(plan, tensors, buffer):
    _broadcast(comm, flat, src, stream)
  if stream is not None:
    stream.synchronize()  # NCCL only enqueues; UNRUN (no GPU here)


def receive_into(comm: Communicator, plan: Plan, staging: torch.Tensor, *, src: int = 0,
                 stream: Any = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
  """Generator side, in the caller's thread: (version, [(hf_name, view into `staging`)]) once
  every bucket has arrived; ValueError for a header that does not match the plan. `Receiver`
  runs this in its thread."""
  if staging.numel() < plan.nbytes:
    raise ValueError(f'staging buffer of {staging.numel()} bytes < one update ({plan.nbytes})')
  header = torch.zeros(4, dtype=torch.int64, device=staging.device)
  _broadcast(comm, header, src, stream)
  magic, version, digest, n = (int(x) for x in header.tolist())
  if magic != MAGIC or digest != plan.digest or n != len(plan.buckets):
    raise ValueError(f'weight update header {hex(magic)}/{digest:#x}/{n} buckets does not '
                     f'match this generator\'s plan ({plan.digest:#x}/{len(plan.buckets)} '
                     'buckets): trainer and generator disagree on model, dtype or bucket size')
  views, start = [], 0
  for i, size in enumerate(plan.bucket_nbytes):
    flat = staging[start:start + size]
    _broadcast(comm, flat, src, stream)
    views += bucket_views(plan, i, flat)
    start += size
  if stream is not None:
    stream.synchronize()  # done means the bytes are here, inside the deadline; UNRUN
  return version, views


class _Worker:
  """One long-lived daemon thread that runs jobs in order, on one CUDA stream made once (None
  on CPU); the caller waits for each job with a deadline."""

  def __init__(self, name: str, device: torch.device):
    self.stream = torch.cuda.Stream(device) if device.type == 'cuda' else None
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._idle = threading.Event()
    self._idle.set()
    self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self.thread.start()

  def run(self, job: Callable[[], Any], timeout_s: float) -> Any:
    """job() in the worker thread; concurrent.futures.TimeoutError past `timeout_s` (the job
    keeps running: the caller must make it end, e.g. by destroying its communicator)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._jobs.put((job, future))
    return future.result(timeout_s)

  def wait_idle(self, timeout_s: float) -> bool:
    return self._idle.wait(timeout_s)

  def close(self) -> None:
    self._jobs.put(None)

  def _loop(self) -> None:
    with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
      while (item := self._jobs.get()) is not None:
        job, future = item
        if not future.set_running_or_notify_cancel():
          continue
        self._idle.clear()
        try:
          future.set_result(job())
        except BaseException as e:  # raised in the caller's thread
          future.set_exception(e)
        finally:
          del job, future, item
          self._idle.set()


ABANDON_AFTER_S = 10.0  # an overdue transfer still running this long into the next send is left


class Sender:
  """Trainer side: every update to every generator is sent from one long-lived thread, on one
  CUDA stream, packed into one buffer allocated once (grown if a plan needs more)."""

  def __init__(self, device: str | torch.device = 'cpu'):
    self.device = torch.device(device)
    self._worker = _Worker('weights-sender', self.device)
    self._buffer: torch.Tensor | None = None
    self._lock = threading.Lock()  # one send at a time (generators restarted meanwhile queue)
    self._overdue = False           # the last send timed out; its job may still run

  @property
  def thread(self) -> threading.Thread:
    return self._worker.thread

  @property
  def buffer(self) -> torch.Tensor | None:
    return self._buffer

  def send(self, comm: Communicator, plan: Plan,
           tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], version: int, *,
           timeout_s: float, src: int = 0) -> None:
    """Broadcasts `tensors()` (made in the sender thread, in plan order) as `version` within
    `timeout_s`. On any failure or timeout the communicator is destroyed before this raises
    (TimeoutError for the deadline): the group is unusable, the generator must be restarted."""
    with self._lock:
      if self._overdue:
        self._replace_if_stuck()

      def job():
        if self._buffer is None or self._buffer.numel() < plan.max_bucket_nbytes:
          self._buffer = None
          self._buffer = torch.zeros(plan.max_bucket_nbytes, dtype=torch.uint8,
                                     device=self.device)
        send(comm, plan, tensors(), version, src=src, buffer=self._buffer,
             stream=self._worker.stream)
      try:
        self._worker.run(job, timeout_s)
      except BaseException as e:
        destroy(comm)
        if isinstance(e, concurrent.futures.TimeoutError):
          self._overdue = True
          raise TimeoutError(f'weight update {version} not sent within {timeout_s:.0f}s '
                             '(generator dead or stuck?)') from None
        raise

  def _replace_if_stuck(self) -> None:
    """Before the send after a timeout: the destroyed communicator (or the generator's restart,
    which closes its end) normally has ended the overdue transfer by now; one that has not (a
    gloo peer alive but silent ends only at gloo's own timeout) is left behind with its
    thread, stream and buffer, and a new worker serves this send and the next ones."""
    self._overdue = False
    if self._worker.wait_idle(ABANDON_AFTER_S):
      return
    print(f'[weights] an overdue transfer has not ended {ABANDON_AFTER_S:.0f}s into the next '
          'send: leaving its thread, sending from a new one', flush=True)
    self._worker.close()
    self._worker, self._buffer = _Worker('weights-sender', self.device), None

  def close(self) -> None:
    self._worker.close()


class Receiver:
  """Generator side: every update is received in one long-lived thread, on one CUDA stream, into
  one staging buffer for a whole update, allocated here (before the engine starts, so that its
  memory budget sees it) and reused: `budget.STAGING_BUFFERS` is 1. An update is handed over
  with a `release` callback; the next one waits until it was called."""

  def __init__(self, comm: Communicator, plan: Plan, device: str | torch.device = 'cpu', *,
               src: int = 0):
    self.comm, self.plan, self.src = comm, plan, src
    self.device = torch.device(device)
    self._worker = _Worker('weights-receiver', self.device)
    self.staging = self._worker.run(  # on the stream that fills it
        lambda: torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device), 60.0)
    self._free = threading.Event()
    self._free.set()

  @property
  def thread(self) -> threading.Thread:
    return self._worker.thread

  def receive(self, timeout_s: float
              ) -> tuple[int, list[tuple[str, torch.Tensor]], Callable[[], None]]:
    """(version, [(hf_name, view into the staging buffer)], release) once the update being
    broadcast has arrived whole; call `release()` once the views are no longer read. Within
    `timeout_s`, the wait for the previous update's release included. ValueError for a
    mismatched header, TimeoutError past the deadline; on any failure the communicator is
    destroyed first (the group is unusable; restart the generator)."""
    deadline = time.monotonic() + timeout_s
    try:
      if not self._free.wait(timeout_s):
        raise TimeoutError(f'the previous weight update was not released by the engine within '
                           f'{timeout_s:.0f}s; the staging buffer is still in use')
      self._free.clear()
      try:
        version, views = self._worker.run(
            lambda: receive_into(self.comm, self.plan, self.staging, src=self.src,
                                 stream=self._worker.stream),
            max(0.0, deadline - time.monotonic()))
      except concurrent.futures.TimeoutError:
        raise TimeoutError(f'weight update not received within {timeout_s:.0f}s (trainer dead '
                           'or stuck?); the communicator is destroyed, restart the generator'
                           ) from None
    except BaseException:
      destroy(self.comm)
      raise
    released = threading.Lock()

    def release():
      if released.acquire(blocking=False):
        self._free.set()
    return version, views, release


def destroy(comm: Communicator, timeout_s: float = 10.0) -> bool:
  """Tears a communicator down: `destroy()` (NCCL: ncclCommAbort, which also ends a kernel
  waiting on a dead peer; gloo: aborts its process group) and then its group's store, in a
  daemon thread bounded by `timeout_s` (an abort may block; vLLM bounds its own the same way).
  Idempotent. True when it ended in time."""
  def body():
    close = getattr(comm, 'destroy', None)
    if close is not None:
      close()
    group = getattr(comm, 'group', None)
    if group is not None and hasattr(group, 'store'):
      comm.group = None  # the StatelessProcessGroup's TCPStore closes with its last reference
  thread = threading.Thread(target=body, name='weights-destroy', daemon=True)
  thread.start()
  thread.join(timeout_s)
  return not thread.is_alive()


# --- rendezvous: trainer (rank 0) and one generator (rank 1) ------------------------------------

BACKENDS = ('gloo', 'nccl')


def _backstop(timeout_s: float) -> datetime.timedelta:
  """The library's own timeout: later than the callers' deadlines (`Receiver.receive`,
  `Sender.send`), so theirs report first, with the clearer message."""
  return datetime.timedelta(seconds=2 * timeout_s + 10)


class GlooCommunicator:
  """`broadcast` over a torch ProcessGroupGloo built on its own TCPStore. No default process
  group is created (`torch.distributed.is_initialized()` stays False), so the trainer process
  keeps no global torch.distributed state and can hold one group per generator. Gloo runs the
  same wire protocol as NCCL on CPU, so CI exercises the real cross-process path.

  `address`: where this rank's gloo listens. Given, because torch's default is the address the
  host name resolves to (GLOO_SOCKET_IFNAME aside), which on a host whose /etc/hosts maps its
  name to 127.0.1.1 the other host cannot reach. None: torch's default."""

  def __init__(self, store, rank: int, world_size: int, timeout_s: float,
               address: str | None = None):
    import torch.distributed as dist
    self._dist = dist
    self.store = store
    prefixed = dist.PrefixStore('pipelinerl_jax/weights', store)
    if address is None:
      self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, _backstop(timeout_s))
    else:
      options = dist.ProcessGroupGloo._Options()
      options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
      options._timeout = _backstop(timeout_s)
      self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)

  def broadcast(self, tensor: torch.Tensor, src: int) -> None:
    if self.pg is None:
      raise RuntimeError('the gloo group was destroyed')
    opts = self._dist.BroadcastOptions()
    opts.rootRank = src
    self.pg.broadcast([tensor], opts).wait()

  def destroy(self) -> None:
    """Aborts the group and drops the store. (An operation already waiting on a silent peer
    still ends only at gloo's own timeout, or when the peer's process exits.)"""
    pg, self.pg, self.store = self.pg, None, None
    if pg is not None:
      pg.abort()


def nccl_unavailable(comm) -> str | None:
  """Why `comm` (a vLLM PyNcclCommunicator) moves no data, or None when it is usable. vLLM's
  communicator sets `available=False, disabled=True` when its group has one rank,
  VLLM_DISABLE_PYNCCL is set, or the NCCL library does not load, and its `broadcast` then
  returns at once (vllm/distributed/device_communicators/pynccl.py, `__init__`, `broadcast`)."""
  if getattr(comm, 'available', True) and not getattr(comm, 'disabled', False):
    return None
  if getattr(comm, 'world_size', 2) == 1:
    return 'the group has one rank'
  try:
    import vllm.envs as envs
    if envs.VLLM_DISABLE_PYNCCL:
      return 'VLLM_DISABLE_PYNCCL is set'
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    NCCLLibrary()
  except Exception as e:  # the reason vLLM swallowed
    return (f'vLLM could not load the NCCL library ({type(e).__name__}: '
            f'{" ".join(str(e).split())}; set VLLM_NCCL_SO_PATH to libnccl.so.2)')
  return 'vLLM disabled it (the NCCL library loads here now)'


def _nccl_communicator(group, device, communicator: Callable | None):
  """A communicator over `group` (vLLM's PyNcclCommunicator unless given: tests pass a stand-in
  to run the rendezvous without CUDA); refused in one line when it is disabled."""
  if communicator is None:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    communicator = PyNcclCommunicator
  comm = communicator(group, device=device)
  why = nccl_unavailable(comm)
  if why is not None:
    destroy(comm)
    raise RuntimeError(f"generation.remote.weight_transport='nccl': the NCCL communicator on "
                       f'{device} is disabled: {why}')
  return comm


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """What a generator needs to join its trainer's group (picklable)."""
  backend: str
  host: str
  port: int
  world_size: int = 2


class Rendezvous:
  """Trainer side of one group; `connect` blocks until the generator joins. Every (re)started
  generator gets a new one: a new port, so a dead generator's group is never reused. `close`
  releases the port and the store if `connect` never made a communicator (which then owns
  them: `destroy` it). `host`: this host's address as the generator reaches it, where the
  group's store and (gloo) the trainer's rank listen."""

  def __init__(self, backend: str, timeout_s: float, host: str = '127.0.0.1',
               communicator: Callable | None = None):
    if backend not in BACKENDS:
      raise ValueError(f'weight transport {backend!r} is not one of {BACKENDS}')
    self.backend, self.timeout_s, self._communicator = backend, timeout_s, communicator
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
    """Rank 0's communicator (NCCL: on `device`, the trainer's GPU). UNRUN for nccl on CUDA."""
    server, self._server = self._server, None
    if server is None:
      raise RuntimeError('this rendezvous was used or closed; make a new one')
    if self.backend == 'gloo':
      return GlooCommunicator(server, 0, self.endpoint.world_size, self.timeout_s,
                              address=self.endpoint.host)
    from vllm.distributed.utils import StatelessProcessGroup
    e = self.endpoint
    group = StatelessProcessGroup.create(host=e.host, port=e.port, rank=0,
                                         world_size=e.world_size, listen_socket=server,
                                         store_timeout=int(self.timeout_s))
    return _nccl_communicator(group, device, self._communicator)

  def close(self) -> None:
    server, self._server = self._server, None
    if isinstance(server, socket.socket):
      server.close()


def join(endpoint: Endpoint, rank: int, timeout_s: float, device=None,
         communicator: Callable | None = None, address: str | None = None) -> Communicator:
  """Generator side: this rank's communicator in the group `endpoint` names; over gloo, this
  rank listens on `address` (this host's, as the trainer reaches it; None: torch's default)."""
  if endpoint.backend == 'gloo':
    from torch.distributed import TCPStore
    store = TCPStore(endpoint.host, endpoint.port, endpoint.world_size, False,
                     timeout=_backstop(timeout_s))
    return GlooCommunicator(store, rank, endpoint.world_size, timeout_s, address=address)
  from vllm.distributed.utils import StatelessProcessGroup
  group = StatelessProcessGroup.create(host=endpoint.host, port=endpoint.port, rank=rank,
                                       world_size=endpoint.world_size,
                                       store_timeout=int(timeout_s))
  return _nccl_communicator(group, device, communicator)
