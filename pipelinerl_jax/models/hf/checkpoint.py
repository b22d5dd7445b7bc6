"""HF model dirs (config.json + safetensors) <-> params, through the name map (names.py).

`load_params` memory-maps the files and builds each leaf with `jax.make_array_from_callback`,
whose callback copies only one device's slice out of the mapped file, so the whole model never
sits on one device (or in host memory) at once. `save_params` writes one tensor at a time.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.transformer import ModelConfig

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_SHARD_RE = re.compile(r'model-\d{5}-of-\d{5}\.safetensors$')
SAVE_DTYPES = {'bfloat16': 'BF16', 'float32': 'F32', 'float16': 'F16'}


class _Located(NamedTuple):
  """Where an HF tensor's bytes are: a file's header entry, and `part`, the index of this tensor
  in that entry when the file holds it inside a larger one (transformers 5's fused experts)."""
  file: Path
  entry: dict
  data_start: int
  part: tuple | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    shape = tuple(self.entry['shape'])
    return shape if self.part is None else np.empty(shape, np.bool_)[self.part].shape


# transformers 5's in-memory layout of a Qwen3-MoE or Qwen3.5-MoE layer's experts, which
# `save_pretrained(save_original_format=False)` writes: gate and up of every expert in one
# [X, 2I, D] tensor, down in one [X, D, I] (under `model.language_model.` in a composite dir).
# The Hub's files (and save_pretrained's default) hold one tensor per expert and projection, the
# names `hf_names.name_map` uses.
_FUSED_EXPERTS = re.compile(
    r'^(model\.(?:language_model\.)?layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$')


def _locate_tensors(model_dir: Path) -> tuple[dict[str, _Located], Path]:
  """{hf_name: where its bytes are} and the file that lists the tensors; fused expert tensors
  are listed as the per-expert tensors they hold (the fused names too)."""
  single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
  if single.is_file():
    header, start = hf_files.read_safetensors_header(single)
    located = {name: _Located(single, entry, start) for name, entry in header.items()}
    return _unfused(located), single
  if not index.is_file():
    raise FileNotFoundError(f'{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} exists')
  try:
    weight_map = json.loads(index.read_text())['weight_map']
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f'{index}: no readable weight_map ({e!r})') from None
  located = {}
  for shard_name in sorted(set(weight_map.values())):
    shard = model_dir / shard_name
    if not shard.is_file():
      raise FileNotFoundError(f'{index}: shard {shard_name!r} is listed in weight_map but '
                              f'{shard} does not exist')
    header, start = hf_files.read_safetensors_header(shard)
    for name, entry in header.items():
      if weight_map.get(name) == shard_name:
        located[name] = _Located(shard, entry, start)
  for name, shard_name in weight_map.items():
    if name not in located:
      raise ValueError(f'{model_dir / shard_name}: tensor {name!r} is listed in {index.name} but '
                       'missing from this shard')
  return _unfused(located), index


def _unfused(located: dict[str, _Located]) -> dict[str, _Located]:
  """`located` plus, for every fused expert tensor (`_FUSED_EXPERTS`), the per-expert tensors
  it holds, as parts of it (a tensor listed under its own name wins)."""
  out = dict(located)
  for name, where in located.items():
    match = _FUSED_EXPERTS.match(name)
    if not match or len(where.entry['shape']) != 3:
      continue
    prefix, kind = match.groups()
    num_experts, rows, _ = where.entry['shape']
    halves = ({'gate_proj': slice(0, rows // 2), 'up_proj': slice(rows // 2, rows)}
              if kind == 'gate_up_proj' else {'down_proj': slice(None)})
    for e in range(num_experts):
      for proj, rows_of in halves.items():
        out.setdefault(f'{prefix}.{e}.{proj}.weight', where._replace(part=(e, rows_of)))
  return out


def load_params(model_dir: str | os.PathLike, config: ModelConfig, shardings=None) -> dict:
  """Params pytree from an HF safetensors checkpoint, cast to config.param_dtype.

  `shardings`: a pytree of `jax.sharding.Sharding` shaped like the params (None: all on the
  first local device). Each device's slice is copied straight from the memory-mapped file.
  """
  model_dir = Path(model_dir)
  located, listing = _locate_tensors(model_dir)
  specs = hf_names.name_map(config)
  source = {}  # hf_name -> (file, header entry, data start), shapes checked
  for name, spec, _ in hf_names.checkpoint_order(config):
    if name not in located:
      raise ValueError(f'{listing}: tensor {name!r} is missing (implied by '
                       f'{hf_schema.CONFIG_FILE})')
    where = located[name]
    if where.shape != spec.hf_shape:
      shown = name if where.part is None else f'{name} (in {where.file.name}: {where.entry})'
      raise ValueError(f'{where.file}: tensor {shown!r} has shape {where.shape} but '
                       f'{hf_schema.CONFIG_FILE} implies {spec.hf_shape}')
    source[name] = where
  tied_head = {'lm_head.weight'} if config.tie_embeddings else set()  # some tied files keep it
  read = {id(where.entry) for where in source.values()}  # a fused tensor is read in parts
  unused = sorted(n for n, w in located.items()
                  if w.part is None and id(w.entry) not in read and n not in tied_head)
  carried = hf_schema.family_of(config).carried
  not_loaded = {p: sum(n.startswith(p) for n in unused) for p in carried}
  if any(not_loaded.values()):
    logging.warning('%s: not loaded (the language model alone is trained): %s; a save copies '
                    'them over unchanged', listing, ', '.join(
                        f'{n} tensors under {p}*' for p, n in not_loaded.items() if n))
  unused = [n for n in unused if not n.startswith(carried)]
  if unused:
    logging.warning('%s: ignoring %d tensors not in the model, e.g. %s', listing, len(unused),
                    unused[:3])

  sharding_of = _shardings_by_path(specs, shardings)
  dtype = jnp.dtype(config.param_dtype)
  mmaps = {}  # one read-only mapping per file, dropped when loading is done

  def view(name, transposed):
    where = source[name]
    if where.file not in mmaps:
      mmaps[where.file] = np.memmap(where.file, dtype=np.uint8, mode='r')
    x = hf_files.tensor_view(mmaps[where.file], where.entry, where.data_start)
    x = x if where.part is None else x[where.part]
    return x.T if transposed else x  # still a view: nothing is read yet

  params = {}
  for spec in specs:
    callback = _slice_reader(spec, view, dtype)
    leaf = jax.make_array_from_callback(spec.shape, sharding_of[spec.path], callback)
    node = params
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = leaf
  return params


def _slice_reader(spec: hf_names.TensorSpec, view, dtype):
  """The make_array_from_callback callback: copies one index (tuple of slices) of the leaf."""
  def read(index):
    index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, spec.shape))
    out = np.empty(shape, dtype)
    if spec.stacked and spec.experts:  # only this slice's layers and experts are touched
      layers, experts = (range(*index[a].indices(spec.shape[a])) for a in (0, 1))
      for j, i in enumerate(layers):
        for f, e in enumerate(experts):
          out[j, f] = view(spec.name((i, e)), spec.transposed)[index[2:]]
    elif spec.stacked:
      layers = range(*index[0].indices(spec.shape[0]))
      for j, i in enumerate(layers):  # only this slice's layers are touched
        out[j] = view(spec.name(i), spec.transposed)[index[1:]]
    else:
      out[...] = view(spec.name(), spec.transposed)[index]
    return out
  return read


def _shardings_by_path(specs, shardings) -> dict[tuple[str, ...], jax.sharding.Sharding]:
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return {spec.path: device for spec in specs}
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  by_path = {tuple(str(getattr(k, 'key', k)) for k in path): s for path, s in flat}
  want = {spec.path for spec in specs}
  if set(by_path) != want:
    missing, extra = sorted(want - set(by_path)), sorted(set(by_path) - want)
    raise ValueError(f'shardings do not match the params: missing {missing}, unexpected {extra}')
  return by_path


def save_params(params, config: ModelConfig, out_dir: str | os.PathLike,
                dtype: str = 'bfloat16', max_shard_bytes: int | None = None,
                extra_config: dict | None = None,
                carry_from: str | os.PathLike | None = None) -> list[Path]:
  """Writes config.json and model.safetensors (or shards + index) that transformers can load.

  Tensors go to disk one at a time (one layer's slice, gathered to host), so host memory holds
  at most one tensor beyond what the params already occupy. `carry_from`: the original model
  dir, whose tensors that are not the language model's (a composite's vision tower and MTP
  head: `Family.carried`) are copied byte for byte after ours; a composite needs it. Returns
  the files written.
  """
  if dtype not in SAVE_DTYPES:
    raise ValueError(f'save_params: dtype={dtype!r} is not one of {list(SAVE_DTYPES)}')
  carried = _carried_tensors(config, carry_from)
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  np_dtype = hf_files.ST_DTYPES[SAVE_DTYPES[dtype]]
  entries = [(name, spec.hf_shape, np_dtype) for name, spec, _ in hf_names.checkpoint_order(config)]
  entries += [(name, where.shape, hf_files.ST_DTYPES[where.entry['dtype']])
              for name, where in carried]
  shards = _split_shards(entries, max_shard_bytes)
  arrays = itertools.chain(hf_names.hf_tensors(params, config, dtype=np_dtype),
                           _views(carried))

  written = []
  if len(shards) == 1:  # as transformers does: no index for a checkpoint that fits one file
    hf_files.write_safetensors_streamed(out_dir / SINGLE_FILE, shards[0], arrays)
    written.append(out_dir / SINGLE_FILE)
  else:
    weight_map = {}
    for k, shard in enumerate(shards):
      shard_name = f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors'
      hf_files.write_safetensors_streamed(out_dir / shard_name, shard, arrays)
      weight_map.update({name: shard_name for name, _, _ in shard})
      written.append(out_dir / shard_name)
    total = sum(math.prod(shape) * d.itemsize for _, shape, d in entries)
    index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
    hf_files.write_json(out_dir / INDEX_FILE, index)
    written.append(out_dir / INDEX_FILE)
  hf_files.write_json(out_dir / hf_schema.CONFIG_FILE,
                      hf_schema.hf_config(config, dtype, extra_config))
  written.append(out_dir / hf_schema.CONFIG_FILE)
  # A previous save with other sharding would otherwise shadow or mix with this one.
  for old in out_dir.iterdir():
    if (old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name)) and old not in written:
      old.unlink()
  return written


def _carried_tensors(config: ModelConfig, carry_from) -> list[tuple[str, _Located]]:
  """(name, where) of every tensor of `carry_from` a save of `config` copies over unchanged."""
  family = hf_schema.family_of(config)
  carried = []
  if carry_from is not None and family.carried:
    located, _ = _locate_tensors(Path(carry_from))
    carried = sorted(((name, where) for name, where in located.items()
                      if where.part is None and name.startswith(family.carried)),
                     key=lambda named: named[0])
  if family.text_model_type and not carried:
    raise ValueError(f'save_params: {config.architecture} is saved with the tensors it does not '
                     f'train ({", ".join(p + "*" for p in family.carried)}), and carry_from='
                     f'{carry_from} has none: give the original model dir')
  return carried


def _views(located: list[tuple[str, _Located]]):
  """(name, a zero-copy view of the tensor's bytes) for each, in order."""
  mmaps = {}
  for name, where in located:
    if where.file not in mmaps:
      mmaps[where.file] = np.memmap(where.file, dtype=np.uint8, mode='r')
    yield name, hf_files.tensor_view(mmaps[where.file], where.entry, where.data_start)


def _split_shards(entries, max_shard_bytes):
  """Consecutive runs of tensors, each at most max_shard_bytes (a larger tensor goes alone)."""
  if max_shard_bytes is None:
    return [entries]
  shards, current, size = [], [], 0
  for entry in entries:
    nbytes = math.prod(entry[1]) * entry[2].itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  return shards + [current]
