"""The publish section: trainer params to the engine's buffers (the publish copy, then update +
apply) timed against one plain device copy of the same bytes; JAX to torch over DLPack (data
pointers must be equal; time), for single-device params and for params placed on a mesh of every
local device, sharded and replicated, shard by shard."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from pipelinerl_jax.bench.gpu import section as section_lib


def dlpack_handoff(torch, arrays, repeats: int) -> dict[str, Any]:
  """Single-device jax arrays to torch over DLPack, `repeats` times (the median is reported;
  the first pays torch's device set-up); then, on the last set of tensors, the checks: data
  pointers equal, and the first and last element read the same through both."""
  import jax.numpy as jnp
  import numpy as np
  runs = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    tensors = [torch.from_dlpack(x) for x in arrays]
    runs.append(time.perf_counter() - t0)
  same = [t.data_ptr() == x.unsafe_buffer_pointer() for t, x in zip(tensors, arrays)]
  values = all(np.array_equal(np.asarray(jnp.take(x, np.array([0, x.size - 1]))),
                              t.flatten()[[0, -1]].cpu().numpy()) for x, t in zip(arrays, tensors))
  return dict(arrays=len(arrays), bytes=sum(x.nbytes for x in arrays),
              seconds=statistics.median(runs), seconds_runs=runs, pointers_equal=all(same),
              pointers_differ=same.count(False), values_equal=values,
              torch_devices=sorted({str(t.device) for t in tensors}))


def run(s: section_lib.Section) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from pipelinerl_jax import sharding as sharding_lib
  from pipelinerl_jax.bench import train_step as train_bench
  from pipelinerl_jax.generation import jax_engine as engine_lib
  from pipelinerl_jax.models import transformer
  from pipelinerl_jax.pipeline import placements

  z = s.sizes
  device = jax.devices()[0]
  limit = section_lib.memory_limit_bytes(device)
  try:
    import torch
  except Exception as e:  # recorded on each DLPack item; the JAX-only items still run
    torch, torch_error = None, section_lib.one_line(e)
  for name in z.publish_models:
    config = train_bench.MODEL_PRESETS[name]
    nbytes = 4 * config.num_params
    # params, published copy, flat copy pair
    if 4 * nbytes > section_lib.MEMORY_HEADROOM * limit:
      s.skip(name, f'needs ~{4 * nbytes / 2**30:.1f} GiB, the device offers '
                   f'{limit / 2**30:.1f}')
      continue
    if s.remaining() < 5:
      s.skip(name, 'time budget')
      continue
    params = transformer.init_params(config, jax.random.PRNGKey(0))
    leaves = jax.tree.leaves(params)
    nbytes = sum(x.nbytes for x in leaves)
    try:
      publish = placements.copy_params_fn(device)
      publish_runs = section_lib.wall_times(lambda: publish(params), z.repeats)
      flat = jnp.ones((nbytes // 4,), jnp.float32)
      copy = jax.jit(jnp.copy)
      copy_runs = section_lib.wall_times(lambda: copy(flat), z.repeats)
      del flat
      # Update + apply on a live engine (one slot, nothing in flight): what follows the copy.
      published = [publish(params) for _ in range(2)]
      with engine_lib.JaxEngine(config, published[0],
                                engine_lib.EngineConfig(num_slots=1, max_seq_len=8)) as eng:
        apply_runs = []
        for i in range(z.repeats):
          t0 = time.perf_counter()
          eng.update_params(published[i % 2], i + 1)
          eng.step()
          apply_runs.append(time.perf_counter() - t0)
      del published
      p, c = statistics.median(publish_runs), statistics.median(copy_runs)
      s.add(f'{name} publish', model=name, bytes=nbytes, leaves=len(leaves), publish_s=p,
            copy_s=c, publish_over_copy=p / c, copy_gb_per_s=2 * nbytes / c / 1e9,
            apply_s=statistics.median(apply_runs), publish_s_runs=publish_runs,
            copy_s_runs=copy_runs)
    except Exception as e:
      s.fail(f'{name} publish', e)

    if torch is None:
      s.record['items'].append(dict(name=f'{name} dlpack', status='error', error=torch_error))
      s.save()
      continue
    try:
      s.add(f'{name} dlpack', model=name, **dlpack_handoff(torch, leaves, z.repeats))
    except Exception as e:
      s.fail(f'{name} dlpack', e)

    # Params on a mesh of every local device, as the trainer holds them: each addressable
    # shard is one buffer, handed over alone (a multi-device array has no single pointer).
    mesh = sharding_lib.make_mesh(1, -1, 1, devices=jax.local_devices())
    layouts = (('sharded', sharding_lib.param_shardings(params, mesh)),
               ('replicated', jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()),
                                           params)))
    for layout, shardings in layouts:
      try:
        placed = jax.device_put(params, shardings)
        shards = [sh.data for x in jax.tree.leaves(placed) for sh in x.addressable_shards]
        split = sum(len({str(sh.index) for sh in x.addressable_shards}) > 1
                    for x in jax.tree.leaves(placed))
        s.add(f'{name} dlpack {layout}', model=name, layout=layout, devices=mesh.devices.size,
              leaves_split=split, **dlpack_handoff(torch, shards, z.repeats))
        del placed, shards
      except Exception as e:
        s.fail(f'{name} dlpack {layout}', e)
    del params, leaves
    gc.collect()


def describe(item: dict[str, Any]) -> str:
  """One table cell: the item's main figures."""
  g = item.get
  if 'publish_s' in item:
    return (f"{section_lib.fmt_si(g('bytes'), 'B')}: publish {1e3 * g('publish_s'):.2f} ms vs "
            f"copy {1e3 * g('copy_s'):.2f} ms ({g('publish_over_copy'):.2f}x), apply "
            f"{1e3 * g('apply_s'):.2f} ms")
  where = f"{g('devices')} devices, {g('leaves_split')} leaves split, " if g('layout') else ''
  return (f"{where}{g('arrays')} arrays on {','.join(g('torch_devices'))}: pointers equal "
          f"{g('pointers_equal')}, values equal {g('values_equal')}, "
          f"{1e3 * g('seconds'):.2f} ms")
