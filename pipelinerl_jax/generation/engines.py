"""The one place engines are built: a spec, and `make_engine` from it.

  EngineSpec                 what builds one engine, JAX or vLLM (picklable, no JAX objects: it
                             travels to generator actors)
  spec_from_config(config)   the run's engine, from config.generation (an evaluation or the warm
                             start overrides its slots, lengths or options)
  make_engine(spec, ...)     the engine, serving `params` as `version` from its first token
  slots_for(n, most)         slots for an evaluation of n requests

Every engine of the project comes from here: the run's in the trainer's process (pipeline/
placements.py), each generator actor's (actors/decode_loop.py), the evaluation's (evaluation.py)
and the demo's warm start (demo/warmstart.py).

Imports only the standard library at the top: a generator actor imports this before it pins its
threads, and the engine (JAX or vLLM, and their thread pools) only in `make_engine`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from pipelinerl_jax import config as config_lib


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  backend: str                     # 'jax' | 'vllm'
  num_slots: int                   # H: sequences decoded together
  max_seq_len: int                 # S: every prompt + max_tokens must fit
  eos_token_ids: tuple[int, ...]   # stop every request
  jax_options: dict = dataclasses.field(default_factory=dict)  # JAX: other EngineConfig fields
  kv_cache_mb: int = 256           # vLLM on CPU (or on CUDA with gpu_memory_utilization 0)
  gpu_memory_utilization: float = 0.9  # vLLM on CUDA: generation/budget.py
  cuda_graphs: bool = True         # vLLM on CUDA
  lm_head_fp32: bool = False       # vLLM: logits in fp32, as the trainer's
  # LoRA (config.model.lora, None = none): the engine serves the model dir's weights as the
  # frozen base, and takes adapters as its params and updates.
  lora: config_lib.LoraSettings | None = None
  lora_update: str = 'merge'       # vLLM: how adapter updates land (vllm/lora_updates.py)

  def __post_init__(self):
    if self.backend not in ('jax', 'vllm'):
      raise ValueError(f"EngineSpec.backend={self.backend!r} is not 'jax' or 'vllm'")
    object.__setattr__(self, 'eos_token_ids', tuple(int(t) for t in self.eos_token_ids))


def jax_options(g) -> dict[str, Any]:
  """The JAX EngineConfig fields a generation config (`config.GenerationConfig`) sets, besides
  the slots, lengths and stop tokens."""
  return dict(recompute_kv=g.recompute_kv, page_size=g.kv_page_size, pool_mb=g.kv_pool_mb,
              decode_attention=g.decode_attention, sync_every=g.sync_every,
              prefill_chunk=g.prefill_chunk, share_prompts=g.share_prompts)


def spec_from_config(config, eos_token_ids, **overrides) -> EngineSpec:
  """The engine of one generator of the run (`config`: a validated `config.Config`);
  `overrides`: EngineSpec fields that differ (an evaluation's backend and slots)."""
  g = config.generation
  spec = EngineSpec(
      backend=g.backend, num_slots=g.generator_slots, max_seq_len=g.max_seq_len,
      eos_token_ids=tuple(eos_token_ids), jax_options=jax_options(g),
      kv_cache_mb=g.vllm.kv_cache_mb, gpu_memory_utilization=g.vllm.gpu_memory_utilization,
      cuda_graphs=g.vllm.cuda_graphs, lm_head_fp32=config.model.lm_head_fp32,
      lora=config.model.lora if config.model.lora.enabled else None,
      lora_update=g.vllm.lora_update)
  return dataclasses.replace(spec, **overrides)


def slots_for(num_requests: int, most: int) -> int:
  """Slots for a batch of `num_requests` known up front (an evaluation): a power of two, so that
  evaluations of different sets, same sizes, reuse the compiled step; at most `most`."""
  return max(1, min(most, 1 << max(0, num_requests - 1).bit_length()))


def reserve_bytes(model_config, staged_updates: bool) -> int:
  """What vLLM on a GPU must leave free for weight updates once it started: each tensor of an
  update that comes from the host goes to the GPU on its own, so the largest; none when updates
  arrive in a staging buffer allocated before the engine (collective transports)."""
  if staged_updates:
    return 0
  from pipelinerl_jax.generation import budget
  from pipelinerl_jax.generation.transport import hf_tensors
  return budget.largest_tensor_bytes(hf_tensors.expected_shapes(model_config).values(),
                                     model_config.param_dtype)


def jax_config(spec: EngineSpec):
  """The JAX engine's `EngineConfig` (imports JAX)."""
  from pipelinerl_jax.generation import jax_engine
  return jax_engine.EngineConfig(num_slots=spec.num_slots, max_seq_len=spec.max_seq_len,
                                 eos_token_ids=spec.eos_token_ids, **spec.jax_options)


def vllm_config(spec: EngineSpec, model_config, staged_updates: bool = False):
  """The in-process vLLM engine's `VllmEngineConfig` (imports vLLM); `model_config`: the
  trainer's, for the reserve."""
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  return vllm_engine.VllmEngineConfig(
      max_num_seqs=spec.num_slots, max_model_len=spec.max_seq_len,
      eos_token_ids=spec.eos_token_ids, kv_cache_bytes=spec.kv_cache_mb << 20,
      gpu_memory_utilization=spec.gpu_memory_utilization,
      reserve_bytes=reserve_bytes(model_config, staged_updates), cuda_graphs=spec.cuda_graphs,
      lm_head_fp32=spec.lm_head_fp32, lora_update=spec.lora_update)


def make_engine(spec: EngineSpec, model_config, *, params=None, version: int = 0,
                model_dir: str | None = None, device=None, staged_updates: bool = False):
  """The engine `spec` describes, serving `params` as `version` from its first token.

  JAX: on `device` (None: JAX's default), `params` required. vLLM: starts from the checkpoint in
  `model_dir`; with `params` it loads them before its first token, else it serves the
  checkpoint as `version`. `staged_updates`: later updates arrive in a staging buffer
  (`reserve_bytes`). With `spec.lora`, `params` may be the adapters alone: the JAX engine then
  loads its base from `model_dir` (in the compute dtype), vLLM serves that checkpoint as it."""
  lora = spec.lora
  if spec.backend == 'jax':
    if params is None:
      raise ValueError('make_engine: the JAX engine needs params')
    from pipelinerl_jax.generation import jax_engine
    from pipelinerl_jax.models.layers import lora as lora_lib
    if lora is not None and not isinstance(params, lora_lib.Adapted):
      if model_dir is None:
        raise ValueError('make_engine: a JAX engine given adapters alone needs model_dir (the '
                         'base)')
      import dataclasses
      from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
      base_config = dataclasses.replace(model_config, param_dtype=model_config.dtype)
      base = hf_checkpoint.load_params(model_dir, base_config)  # (the engine places it on `device`)
      params = lora_lib.Adapted(base, params, lora.scale)
    return jax_engine.JaxEngine(model_config, params, jax_config(spec), version=version,
                                device=device)
  if model_dir is None:
    raise ValueError('make_engine: the vLLM engine needs model_dir (its checkpoint)')
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  config = vllm_config(spec, model_config, staged_updates)
  adapters = {} if lora is None else dict(lora=lora)
  if params is None:
    return vllm_engine.VllmEngine(model_dir, config, version=version, **adapters)
  engine = vllm_engine.VllmEngine(model_dir, config, version=-1, **adapters)
  try:
    engine.update_params(params, version)
    engine.apply_update()  # serves `version`, not the checkpoint, from its first token
  except BaseException:
    engine.close()
    raise
  return engine

