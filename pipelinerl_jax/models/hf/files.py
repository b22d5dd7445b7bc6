"""safetensors files and a model dir's JSON files: read and written by our own code, so that bf16
maps to `ml_dtypes.bfloat16`, loading can memory-map, and every file appears whole or not at all.

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} (offsets relative to the end of the header), then raw bytes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np

ST_DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32),
    'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8),
    'BOOL': np.dtype(np.bool_),
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
  """({name: {dtype, shape, data_offsets}}, byte offset where the data starts)."""
  path = Path(path)
  size = path.stat().st_size
  with open(path, 'rb') as f:
    head = f.read(8)
    n = int.from_bytes(head, 'little') if len(head) == 8 else -1
    if n < 2 or 8 + n > size:
      raise ValueError(f'{path}: not a safetensors file (header length {n}, file size {size})')
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f'{path}: unreadable safetensors header ({e})') from None
  if not isinstance(header, dict):
    raise ValueError(f'{path}: safetensors header is not a JSON object')
  header.pop('__metadata__', None)
  data_start = 8 + n
  for name, entry in header.items():
    try:
      dtype = ST_DTYPES.get(entry['dtype'])
      (begin, end), shape = entry['data_offsets'], entry['shape']
    except (KeyError, TypeError, ValueError):
      raise ValueError(f'{path}: malformed header entry for tensor {name!r}: {entry!r}') from None
    if dtype is None:
      raise ValueError(f'{path}: tensor {name!r} has unsupported dtype {entry["dtype"]!r}')
    if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
      raise ValueError(f'{path}: tensor {name!r} data_offsets {entry["data_offsets"]} do not fit '
                       f'shape {entry["shape"]} {entry["dtype"]} in a {size}-byte file')
  return header, data_start


def tensor_view(mmap: np.memmap, entry: dict, data_start: int) -> np.ndarray:
  """Zero-copy view of one tensor; pages are read only when a slice of it is copied."""
  begin, end = entry['data_offsets']
  raw = mmap[data_start + begin:data_start + end]
  return raw.view(ST_DTYPES[entry['dtype']]).reshape(entry['shape'])


def write_safetensors_streamed(path: Path, tensors: list[tuple[str, tuple[int, ...], np.dtype]],
                       arrays: Iterator[tuple[str, Any]]):
  """Writes the header from `tensors` (name, shape, dtype), then each array as it arrives."""
  header, offset = {'__metadata__': {'format': 'pt'}}, 0
  for name, shape, dtype in tensors:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {'dtype': ST_NAMES[dtype], 'shape': list(shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)  # keeps tensor data 8-byte aligned
  tmp = path.with_name(path.name + '.tmp')
  with open(tmp, 'wb') as f:
    f.write(len(blob).to_bytes(8, 'little'))
    f.write(blob)
    for name, shape, dtype in tensors:
      got_name, x = next(arrays)
      x = np.ascontiguousarray(np.asarray(x))
      if got_name != name or x.shape != tuple(shape) or x.dtype != dtype:
        raise AssertionError(f'{path}: expected {name} {shape} {dtype}, got {got_name} '
                             f'{x.shape} {x.dtype}')
      x.tofile(f)
  os.replace(tmp, path)  # readers never see a half-written file


def write_safetensors(path: str | os.PathLike, arrays: list[tuple[str, np.ndarray]]) -> None:
  """Writes (name, host array) pairs, in that order, as one safetensors file (atomically)."""
  arrays = [(name, np.ascontiguousarray(x)) for name, x in arrays]
  write_safetensors_streamed(Path(path), [(name, x.shape, x.dtype) for name, x in arrays],
                             iter(arrays))



def write_json(path: Path, obj):
  """Writes `obj` as JSON to `path` atomically (sorted keys, indented)."""
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + '\n')
  os.replace(tmp, path)
