"""`generation.placement` -> the run's generation engine, and the publisher that hands each new
policy to it; both follow from where the engine runs and how weights travel there.

  ENGINE_PLACEMENTS[placement](...)  the engine: 'inline' (in the trainer's process, the JAX
                                     engine on a device the mesh leaves free, or vLLM) or 'ray'
                                     (generator actors, generation/actors/); a new placement of
                                     generators plugs in here
  publisher(config, mesh, engine, d) (params, version) -> the engine, as a fresh copy where the
                                     engine would otherwise share the donated train state's buffers
  transport_dtype(...)               the dtype updates travel in over a collective
  generation_device(mesh), copy_params_fn(device, dtype)
                                     the in-process engine's device, and the copy onto it (the
                                     in-run evaluation uses both too)
  base_on(base, device)              LoRA: the frozen base for an engine on `device`, the
                                     trainer's own buffers when they are there (one copy)

With LoRA (config.model.lora) the trained params are the adapters: the publisher sends only
them, and the engines keep the frozen base they were built with.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib


def generation_device(mesh) -> jax.Device:
  """The in-process engine's device: the first one the train mesh leaves free, else the first."""
  free = [d for d in jax.local_devices() if d not in set(mesh.devices.flat)]
  return free[0] if free else jax.local_devices()[0]


def copy_params_fn(device=None, dtype: str | None = None) -> Callable:
  """Params -> a fresh copy (on `device`), its floats in `dtype` when given (the dtype the JAX
  engine computes in: the copy is then also the cast it would make, and moves fewer bytes). The
  engine must never hold a buffer that the donated train step will reuse (see
  api.Engine.update_params): `device_put` alone may hand back the very shard that already sits
  on `device`, so copy first (in the train sharding), then move."""
  def leaf(x):
    x = jnp.copy(x)
    return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x
  copy = jax.jit(lambda p: jax.tree.map(leaf, p))
  return copy if device is None else lambda params: jax.device_put(copy(params), device)


def base_on(base, device: jax.Device):
  """The frozen base of a LoRA run for an engine on `device`: the trainer's own arrays when each
  lives on that device alone (the train step never donates or changes them, so both read one
  copy), else a copy there, made once."""
  if all(x.sharding.device_set == {device} for x in jax.tree.leaves(base)):
    return base
  return copy_params_fn(device)(base)


def tree_nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def publisher(config: config_lib.Config, mesh, engine: api.Engine, wire_dtype: str,
              trainers=None) -> Callable[[Any, int], int]:
  """What the trainer calls after a step: a fresh copy of the params to the engine (for the
  in-process JAX engine, on its device; vLLM copies into its own tensors). Generator actors
  over the object store copy to host before `update_params` returns: no copy needed here. Over a
  collective the pool keeps the params to re-send after a restart: a copy in the wire dtype
  (`wire_dtype`, bf16 to vLLM on GPUs), sharded as the params are, from which the sender gathers
  one tensor at a time. With trainer actors (`trainers`), every process puts its own pieces into
  the object store. With LoRA the params are the adapters, published in their own dtype.

  Returns the publisher, which returns the bytes of the update it handed over (the record's
  `publish_bytes`: the params, or with LoRA only the adapters, as they leave the trainer)."""
  g = config.generation
  lora = config.model.lora.enabled
  if trainers is not None:
    def publish(params, version):
      engine.update_params(trainers.publication(params, version, wire_dtype), version)
      return tree_nbytes(params) * jnp.dtype(wire_dtype).itemsize // jnp.dtype(
          config.model.param_dtype).itemsize
    return publish
  if g.placement == 'ray' and g.remote.weight_transport == 'object_store':
    copy = lambda params: params  # the pool copies to host before update_params returns
  elif g.placement == 'ray':
    dtype = jnp.dtype(wire_dtype)  # (with LoRA the param dtype: transport_dtype)
    copy = jax.jit(lambda p: jax.tree.map(lambda x: jnp.copy(x).astype(dtype), p))
  elif g.backend == 'jax':  # in the engine's compute dtype: the copy is its cast too
    copy = copy_params_fn(generation_device(mesh), None if lora else config.model.dtype)
  else:
    copy = copy_params_fn()

  def publish(params, version):
    update = copy(params)
    engine.update_params(update, version)
    return tree_nbytes(update)
  return publish


def transport_dtype(config: config_lib.Config, model_config, model_dir: str) -> str:
  """The dtype weight updates travel in to generator actors over a collective
  (`budget.wire_dtype`: the serving dtype of vLLM over nccl, else the param dtype)."""
  from pipelinerl_jax.generation import budget
  with open(os.path.join(model_dir, hf_schema.CONFIG_FILE)) as f:
    serving = budget.serving_dtype(json.load(f))
  g = config.generation
  if config.model.lora.enabled:  # adapters: small, sent as trained (no rounding on the way)
    return model_config.param_dtype
  return budget.wire_dtype(g.remote.weight_transport, g.backend, serving,
                           model_config.param_dtype)


def _inline_engine(config: config_lib.Config, model_config, model_dir: str, *, mesh,
                   eos_token_ids: tuple[int, ...], params, version: int, cores=None
                   ) -> api.Engine:
  """The engine in the trainer's process: the JAX engine on a device the mesh leaves free, or
  vLLM (which starts from the checkpoint on disk, what `params` were loaded from)."""
  del cores
  spec = engines.spec_from_config(config, eos_token_ids)
  if spec.backend == 'jax':
    device = generation_device(mesh)
    if isinstance(params, lora_lib.Adapted):  # one base for trainer and engine where it can be
      served = lora_lib.Adapted(base_on(params.base, device),
                                copy_params_fn(device)(params.adapters), params.scale)
    else:
      served = copy_params_fn(device, model_config.dtype)(params)
    return engines.make_engine(spec, model_config, params=served, version=version, device=device)
  return engines.make_engine(spec, model_config, model_dir=model_dir)


def _ray_engine(config: config_lib.Config, model_config, model_dir: str, *, mesh,
                eos_token_ids: tuple[int, ...], params, version: int, cores=None
                ) -> api.Engine:
  """Generator actors on a Ray cluster (joined, or started here), each on its own devices.
  `cores`: the placement.CoreAllocator that trainer actors took their cores from."""
  from pipelinerl_jax import cluster as cluster_lib  # imports Ray
  from pipelinerl_jax.generation.actors import generator
  from pipelinerl_jax.generation.actors import placement
  from pipelinerl_jax.generation.actors import pool
  import ray
  g, remote = config.generation, config.generation.remote
  if isinstance(params, lora_lib.Adapted):  # generators load the base from model_dir
    params = params.adapters
  gpus = None
  visible = placement.visible_gpus()
  if not config.cluster.address and visible:  # a local Ray gets the GPUs the mesh leaves free
    placement.assign_devices(visible, mesh.devices.size, g.num_generators, remote.devices,
                             per_child_max=1)  # the same checks, one line each
    gpus = placement.free_gpus(visible, mesh.devices.size, remote.devices)
  session = cluster_lib.connect(config.cluster, gpus=gpus)
  try:
    gpus_each = remote.gpus_per_generator
    if gpus_each < 0:
      gpus_each = 1 if ray.cluster_resources().get('GPU', 0) > 0 else 0
    if remote.weight_transport == 'nccl' and not gpus_each:
      raise ValueError("config.generation.remote.weight_transport: 'nccl' needs generators on "
                       "GPUs (the cluster has none, or gpus_per_generator=0); use 'gloo' or "
                       "'object_store'")
    spec = generator.GeneratorSpec(
        engine=engines.spec_from_config(config, eos_token_ids),
        model_dir=os.path.abspath(model_dir),
        model_overrides=dict(param_dtype=model_config.param_dtype, dtype=model_config.dtype,
                             lm_head_fp32=model_config.lm_head_fp32),
        transport=remote.weight_transport, transport_timeout_s=remote.transport_timeout_s,
        wire_dtype=transport_dtype(config, model_config, model_dir),
        interface=config.cluster.interface, heartbeat_timeout_s=remote.heartbeat_timeout_s,
        verify_updates=remote.verify_updates)
    return pool.RayGenerators(
        spec, model_config, num_generators=g.num_generators, params=params, version=version,
        cpus_per_generator=remote.cpus_per_generator, gpus_per_generator=gpus_each,
        max_restarts=remote.max_restarts, session=session, cores=cores, node_ip=remote.node_ip)
  except BaseException:
    session.close()
    raise


ENGINE_PLACEMENTS = {'inline': _inline_engine, 'ray': _ray_engine}
