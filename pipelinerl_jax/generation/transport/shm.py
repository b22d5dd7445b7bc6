"""Cross-process weight transport: one shared-memory segment holding a full HF-layout update.

Layout: a 64-byte header, a JSON manifest [[hf_name, shape, dtype, offset], ...] (fixed per
model, written by the writer once), then the tensor data, each tensor 64-byte aligned.

  header: magic u64 | version i64 | state u64 | payload_bytes u64 | manifest_bytes u64 |
          checksum u64 (crc32 of the payload, 0 = not computed) | acked_version i64 | pad

The writer (trainer process) copies each HF tensor straight into a torch view of the segment:
`hf_torch_tensors` gives DLPack views of the params, so the only copy is the one into shared
memory (it also does HF's transpose), written bucket by bucket (`hf_tensors.buckets`). The
reader (generator process) hands torch views of the segment to the engine, which copies them
into its own parameters: no other copy on either side.

Atomicity: a cross-process lock is held by the writer while it writes and by the reader while
it loads, so a load never sees a segment being rewritten. `state` is WRITING while bytes change
and VALID only after the payload, size and checksum are complete: a writer that dies part-way
leaves a segment no reader accepts. The reader checks the payload size against the manifest
and, when the writer computed one, the checksum, before anything reaches the engine. Taking the
lock times out with an error naming the holder's role, so a stuck peer is reported, not waited
on forever.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from multiprocessing import shared_memory
from typing import Any, Callable

import torch

from pipelinerl_jax.generation.transport import hf_tensors

MAGIC = 0x504C524C4A415831  # 'PLRLJAX1'
HEADER = struct.Struct('<QqQQQQq')  # see the module docstring
HEADER_BYTES = 64
ALIGN = 64
EMPTY, WRITING, VALID = 0, 1, 2


class TransportError(RuntimeError):
  """The segment holds no complete, intact update."""


class HolderDied(RuntimeError):
  """The peer process holding the segment lock is dead; the lock will never be released."""


def manifest_for(config, dtype: str = 'float32', max_manifest_bytes: int = 1 << 20):
  """[(hf_name, shape, dtype, offset)] and the segment size for a model config."""
  entries, offset = [], 0
  for name, shape in hf_tensors.expected_shapes(config).items():
    entries.append((name, tuple(shape), dtype, offset))
    offset = hf_tensors.align(
        offset + hf_tensors.numel(shape) * hf_tensors.TORCH_DTYPES[dtype].itemsize, ALIGN)
  blob = json.dumps(entries).encode()
  if len(blob) > max_manifest_bytes:
    raise ValueError(f'manifest of {len(blob)} bytes exceeds {max_manifest_bytes}')
  return entries, HEADER_BYTES + max_manifest_bytes + offset, max_manifest_bytes


class Segment:
  """A mapped segment with its header; `create` for the owner, `attach` for the peer."""

  def __init__(self, shm: shared_memory.SharedMemory, lock, manifest_capacity: int):
    self.shm, self.lock, self.manifest_capacity = shm, lock, manifest_capacity
    self.data_start = HEADER_BYTES + manifest_capacity

  @classmethod
  def create(cls, size: int, lock, manifest_capacity: int) -> 'Segment':
    seg = cls(shared_memory.SharedMemory(create=True, size=size), lock, manifest_capacity)
    HEADER.pack_into(seg.shm.buf, 0, MAGIC, -1, EMPTY, 0, 0, 0, -1)
    return seg

  @classmethod
  def attach(cls, name: str, lock, manifest_capacity: int) -> 'Segment':
    return cls(shared_memory.SharedMemory(name=name), lock, manifest_capacity)

  @property
  def name(self) -> str:
    return self.shm.name

  def header(self) -> dict:
    magic, version, state, payload, manifest, checksum, acked = HEADER.unpack_from(self.shm.buf)
    return dict(magic=magic, version=version, state=state, payload=payload, manifest=manifest,
                checksum=checksum, acked=acked)

  def write_header(self, **fields):
    h = {**self.header(), **fields}
    HEADER.pack_into(self.shm.buf, 0, MAGIC, h['version'], h['state'], h['payload'],
                     h['manifest'], h['checksum'], h['acked'])

  def view(self, shape, dtype: str, offset: int) -> torch.Tensor:
    """A tensor over the segment's bytes (no copy)."""
    t = torch.frombuffer(self.shm.buf, dtype=hf_tensors.TORCH_DTYPES[dtype],
                         count=hf_tensors.numel(shape),
                         offset=self.data_start + offset)
    return t.view(shape)

  def acquire(self, timeout: float, holder: str, holder_alive: Callable[[], bool] | None = None):
    """Takes the lock, polling `holder_alive` (when given) so that a peer that died holding it
    is reported at once (HolderDied) instead of after `timeout`."""
    deadline = time.monotonic() + timeout
    while not self.lock.acquire(timeout=min(0.1, timeout) if holder_alive else timeout):
      if holder_alive is not None and not holder_alive():
        raise HolderDied(f'weight segment {self.name}: the {holder} died holding the lock')
      if time.monotonic() >= deadline:
        raise TimeoutError(f'weight segment {self.name}: the {holder} has held the lock for more '
                           f'than {timeout:.0f}s (stuck or dead?)')

  def close(self, unlink: bool = False):
    self.shm.close()
    if unlink:
      self.shm.unlink()


def write_update(seg: Segment, params, config, version: int, *, dtype: str = 'float32',
                 bucket_bytes: int = 64 << 20, checksum: bool = True,
                 timeout: float = 60.0, reader_alive: Callable[[], bool] | None = None) -> dict:
  """Writes a full update of `params` as `version`; returns timings. Raises TimeoutError when
  the reader holds the segment longer than `timeout` seconds, HolderDied when it died holding
  it (with `reader_alive` given)."""
  entries, _, _ = manifest_for(config, dtype, seg.manifest_capacity)
  where = {name: (shape, offset) for name, shape, _, offset in entries}
  t0 = time.perf_counter()
  seg.acquire(timeout, 'generator (reader)', reader_alive)
  try:
    t1 = time.perf_counter()
    seg.write_header(state=WRITING)
    blob = json.dumps(entries).encode()
    seg.shm.buf[HEADER_BYTES:HEADER_BYTES + len(blob)] = blob
    crc, payload = 0, 0
    for bucket in hf_tensors.buckets(hf_tensors.hf_torch_tensors(params, config),
                                      bucket_bytes):
      for name, src in bucket.tensors:
        shape, offset = where[name]
        dst = seg.view(shape, dtype, offset)
        dst.copy_(src)  # the one copy (with HF's transpose, and a cast if dtype differs)
        payload = max(payload, offset + dst.numel() * dst.element_size())
        if checksum:
          crc = zlib.crc32(memoryview(dst.numpy() if dtype != 'bfloat16' else
                                      dst.view(torch.int16).numpy()), crc)
        del dst
    seg.write_header(version=version, state=VALID, payload=payload, manifest=len(blob),
                     checksum=crc if checksum else 0)
  finally:
    seg.lock.release()
  return dict(wait_s=t1 - t0, write_s=time.perf_counter() - t1)


def read_update(seg: Segment, *, verify: bool = True) -> tuple[int, list[tuple[str, Any]]]:
  """(version, [(hf_name, view)]) of the segment's update; call with the lock held, and drop
  the views before releasing it. Raises TransportError for an incomplete or corrupt segment."""
  h = seg.header()
  if h['magic'] != MAGIC:
    raise TransportError(f'segment {seg.name}: bad magic {h["magic"]:#x}')
  if h['state'] != VALID:
    raise TransportError(f'segment {seg.name}: no complete update (state {h["state"]}; a writer '
                         'died part-way?)')
  entries = json.loads(bytes(seg.shm.buf[HEADER_BYTES:HEADER_BYTES + h['manifest']]))
  expected = max((off + hf_tensors.numel(shape) * hf_tensors.TORCH_DTYPES[dt].itemsize
                  for _, shape, dt, off in entries),
                 default=0)
  if h['payload'] != expected or seg.data_start + expected > seg.shm.size:
    raise TransportError(f'segment {seg.name}: payload of {h["payload"]} bytes, the manifest '
                         f'needs {expected}')
  views = [(name, seg.view(shape, dt, off)) for name, shape, dt, off in entries]
  if verify and h['checksum']:
    crc = 0
    for _, v in views:
      crc = zlib.crc32(memoryview((v.view(torch.int16) if v.dtype == torch.bfloat16 else v)
                                  .numpy()), crc)
    if crc != h['checksum']:
      raise TransportError(f'segment {seg.name}: checksum {crc:#x} != header '
                           f'{h["checksum"]:#x} for version {h["version"]}')
  return h['version'], views
