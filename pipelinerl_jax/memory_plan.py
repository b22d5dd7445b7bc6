"""Memory plan of a run, on CPU, before any GPU is touched: what each device holds, and why a
layout cannot fit.

  python -m pipelinerl_jax.memory_plan --config=configs/math.py:paper_7b \\
      --model_config=configs/models/Qwen2.5-7B --devices=8 --device=h100

`--device` names the card (h100, h200: what a process has on one, accelerators.py);
`--device_gib` gives any other size.

The parameter layout is the project's own: `train.state_shardings` (params by
`sharding.param_shardings`, Adam's moments like their params) on `jax.eval_shape` of the train
state, over an abstract mesh of the config's sizes, so no device and no weight is needed. The
other terms are estimates from the shapes, each named in `Plan.trainer` / `Plan.generator`:

trainer device (one of the train mesh; tensor-parallel devices hold the same rows)
  params, adam        master weights and both moments, as sharded (param_dtype, fp32 here)
  grads               the accumulated gradient and the current micro-batch's (param_dtype);
                      the optimizer's update is made after the backward pass, in the space the
                      micro-batch's activations leave, so it is not counted beside them
  gathered            fsdp > 1 gathers a layer's weights to use them: two layers in flight plus
                      one layer's gradient, whole, and the embedding and lm_head whole
  saved               activations kept for the backward pass: each layer's input with remat
                      (and what model.remat_policy keeps), every intermediate without (a
                      hybrid's Gated DeltaNet layers: their own, `_layer_bytes_per_token`)
  layer               one layer's recomputed intermediates (live during its backward pass)
  attention           dense: the fp32 [T, T] scores, their gradient and the probabilities, per
                      head and row; blockwise: four fp32 tiles of block_q x block_kv per head
                      and the O(T) log-sum-exp and dq accumulator; cudnn: fp32 statistics per
                      sample slot (train.max_segments_per_row) and a dq accumulator
  logits              `token_logprobs` makes fp32 logits 1024 positions at a time: the logits
                      and their softmax (or gradient), [rows, 1024, V] each
  batch               the step's packed batch, every micro-batch (7 arrays of 4 bytes a token)
  base, adapters      LoRA (model.lora): the frozen base in the compute dtype (model.dtype),
                      sharded like params, and the adapters (param_dtype, replicated); `adam`
                      and `grads` are then the adapters' alone, and `gathered` is the base's
  published           placement 'ray' over nccl/gloo: the copy of the params the pool keeps to
                      send (and re-send after a restart), in the wire dtype, sharded like the
                      params (several trainer processes: whole on each process's devices);
                      two while a new version replaces the previous one
  sending             device 0, nccl/gloo: the sender's packing buffer (the largest bucket, at
                      least the largest tensor), the one tensor gathered to pack, and torch's
                      CUDA context with the NCCL communicators
rows per micro-batch are the worst case: every sample at max_prompt_len + max_new_tokens.

generator device (vLLM: one GPU per actor with placement 'ray'; 'inline' shares device 0
with the trainer; the JAX engine's params and KV cache go on the first free device, or device 0;
with LoRA an inline JAX engine on device 0 reads the trainer's base, so it adds only the
adapters and its KV cache, and vLLM adds its LoRA slot, the adapters at its padded rank)
  context             the process's CUDA context, outside vLLM's budget
  staging             nccl/gloo: the receiver's one staging buffer, a whole update in the wire
                      dtype (`budget.STAGING_BUFFERS`, allocated before vLLM starts);
                      object_store: the largest tensor on its way in, in the param dtype (the
                      rest waits in the host's object store), kept out of vLLM's budget
  weights             the serving copy (the checkpoint's dtype)
  activations         vLLM's profile run, the fp32 sampler logits, and an allowance for CUDA
                      graphs (vLLM measures its own at start and takes it from the KV cache)
  kv                  the KV cache: `kv='free'` what vLLM has left of its budget, which
                      `budget.vllm_memory_fraction` derives from generation.vllm.
                      gpu_memory_utilization exactly as the generators do at start (the device
                      then holds that share); `kv='config'` generation.vllm.kv_cache_mb (the
                      CPU setting); `kv='auto'` (default) follows the config: 'free' unless the
                      share is 0. A hybrid's KV: its full-attention layers' only
  state               a hybrid (Qwen3.5): each slot's Gated DeltaNet state in every linear
                      layer (the convolution window in the serving dtype, the fp32 recurrent
                      state), out of vLLM's budget before the KV cache

generator device (the JAX engine, backend 'jax': the first device the mesh leaves free, or
device 0 beside the trainer, whose terms it then adds to; placement 'ray': one device per
generator beside the mesh, each with its share of the slots)
  weights             its params, in the compute dtype
  update              the next published copy, held beside them until the engine swaps it in
                      between two token steps
  kv                  the paged KV pool: generation.kv_pool_mb, or every slot at full length
                      (the largest pool the engine makes without it); a hybrid's pages hold
                      its full-attention layers only
  state               a hybrid: each slot's Gated DeltaNet state in every linear layer
                      (window in the compute dtype, recurrent state in fp32), and a quarter as
                      many saved ones (`budget.saved_states`: shared prompts', held turns')

in-run evaluation (eval.every_steps > 0: a JAX engine of its own, built for each evaluation,
between two train steps, on the first device the mesh leaves free, or device 0)
  weights             its copy of the params in the compute dtype (with LoRA the adapters, and
                      the base unless it reads the trainer's)
  kv                  its paged KV pool: eval.kv_pool_mb, or generation.kv_pool_mb's rule, for
                      generation.num_slots sequences of max_prompt_len + the eval's max tokens
On device 0 it lives beside the trainer's resident state (params, Adam state, base and adapters,
published copies; the step's gradients and activations are freed between steps) and the run's
engine when that is there too.

A plan refuses (`Plan.problems`, one line each, `Plan.refusal` joins them) when a device holds
more than it has, when a large parameter stays whole on every fsdp device, when the KV cache
cannot hold one full-length request, or when the mesh and the generators need more devices than
there are. Everything here is an estimate from shapes (XLA's buffer assignment on the device
decides the truth); `tests/memory_plan_test.py` checks the trainer terms against XLA's own
numbers for small models compiled on CPU. Not modelled: the copies an in-process vLLM engine
keeps of published params (no GPU preset runs vLLM in the trainer's process).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh

from pipelinerl_jax import accelerators
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.generation import budget
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import gated_delta
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import trainer as trainer_lib

GIB = 2**30
BATCH_BYTES_PER_TOKEN = 4 * len(train.TOKEN_KEYS)  # and 8 bytes a sample slot (the spans)
LOGITS_CHUNK = 1024                    # transformer.token_logprobs' default chunk_size
CUDA_CONTEXT_BYTES = GIB * 3 // 4      # per process: CUDA context, cuBLAS / NCCL workspaces
VLLM_BATCHED_TOKENS = 8192             # vLLM's default max_num_batched_tokens (its profile run)
VLLM_BLOCK_TOKENS = 16                 # vLLM's default KV block size
CUDA_GRAPHS_BYTES = GIB                # an allowance, not a measurement (see `activations`)
LARGE_PARAM_FRACTION = 0.01            # a parameter with >= 1% of the model must be fsdp-sharded
# Trainer terms that live inside the train step only: an in-run evaluation, between two steps,
# finds their memory free.
STEP_TERMS = ('grads', 'gathered', 'saved', 'layer', 'attention', 'logits', 'batch')



@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes by term, derived figures, and the reasons it cannot fit (none = fits)."""
  trainer: dict[str, int]
  generator: dict[str, int]
  facts: dict[str, Any]
  problems: tuple[str, ...]
  evaluation: dict[str, int] = dataclasses.field(default_factory=dict)  # eval.every_steps > 0

  @property
  def fits(self) -> bool:
    return not self.problems

  @property
  def refusal(self) -> str:
    return '; '.join(self.problems)

  @property
  def trainer_total(self) -> int:
    return sum(self.trainer.values())

  @property
  def generator_total(self) -> int:
    return sum(self.generator.values())


def _bytes(dtype) -> int:
  return np.dtype(jax.numpy.dtype(dtype)).itemsize


def _sharded_bytes(shapes, shardings) -> int:
  """Bytes one device holds of a pytree of ShapeDtypeStructs placed by `shardings`."""
  leaves = jax.tree.leaves(shapes)
  shards = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sh in zip(leaves, shards))


def mesh_sizes(mesh: str, num_devices: int) -> tuple[int, int, int, int]:
  """train.mesh 'data,fsdp,tensor[,expert]' with -1 resolved as `sharding.make_mesh` would on a
  host of `num_devices` (-1 takes every device, leaving none to generators)."""
  sizes = [int(s) for s in mesh.split(',')] + [1] * (mesh.count(',') == 2)
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    sizes[sizes.index(-1)] = num_devices // known
  return tuple(sizes)


def worst_case_rows(config: config_lib.Config, data_parallel: int) -> tuple[int, int]:
  """(packed rows of a step, rows per micro-batch on one data shard) when every sample has the
  maximum length, as the trainer packs and buckets them (packing, trainer.bucket_rows)."""
  g, tr = config.generation, config.train
  longest = g.max_prompt_len + g.max_new_tokens - 1      # positions a sample occupies
  per_row = max(1, tr.seq_len // longest)
  needed = -(-config.rl.batch_size // per_row)
  multiple = packing.row_multiple(data_parallel, tr.micro_batches, tr.micro_batch_rows)
  rows = trainer_lib.bucket_rows(needed, multiple)
  num_micro = packing.num_micro_batches(rows, data_parallel, tr.micro_batches,
                                        tr.micro_batch_rows)
  return rows, rows // (num_micro * data_parallel)


def _layer_bytes_per_token(m: transformer.ModelConfig, moe: bool = False, ep: int = 1,
                           linear: bool = False) -> int:
  """Intermediates of one decoder layer per token (no attention scores), as transformer.py makes
  them: fp32 norm inputs and RoPE, the rest in the compute dtype. An MoE layer (layers/moe.py):
  router logits and fp32 probabilities, and for each of the Xk assignments the token gathered,
  the expert's gate, up and activation and its output; split over an expert axis of `ep`, the
  gathered rows and the shares before the reduce-scatter (ep rows of D for each of its own); a
  shared expert's (Qwen3.5-MoE) gate, up, activation and output, and its gate's logit.
  A Gated DeltaNet layer (`linear`, layers/gated_delta.py) in place of attention: its four
  projections and the gated norm; in fp32 the convolution's output and its SiLU, q and k per
  value head, v, the decay and beta; per value head and position about 11 rows of Tb (the
  chunked form's pairwise matrices: the decay and its masks, k.k, A, the triangular solve's,
  q.k, and the chunk-major copy the scan reads) and 3 Dk + 3 Dv (the solved right-hand sides,
  the scan's other inputs, u and the output); one [Hv, Dk, Dv] state per chunk of Tb; the
  masks a byte each (what autodiff keeps for its backward pass, counted from
  `saved_residuals`)."""
  dt = _bytes(m.dtype)
  d, f, dh = m.hidden_size, m.intermediate_size, m.head_dim
  h, k = m.num_heads, m.num_kv_heads
  mlp = 4 * f
  if moe:
    xk, width = m.num_experts_per_tok, m.moe_intermediate_size
    mlp = m.num_experts + xk * (2 * d + 3 * width) + 2 * ep * d
    if m.shared_expert_intermediate_size:
      mlp += 3 * m.shared_expert_intermediate_size + d + 1
  masks = 0
  if linear:
    _, hv, dk, dv, cc, _ = gated_delta.dims(m)
    tb = m.linear_chunk_size
    in_dtype = 2 * d + 2 * cc + 3 * hv * dv + 2 * hv + 3 * d + mlp
    in_fp32 = (2 * d + 2 * cc + hv * (2 * dk + dv + 2) + hv * 11 * tb + hv * 3 * (dk + dv)
               + -(-hv * dk * dv // tb))
    masks = 2 * hv * tb
  else:
    in_fp32 = 2 * d + (h + k) * dh                              # norm x32, rotated q and k
    in_dtype = 2 * d + (h + 2 * k) * dh + h * dh + 3 * d + mlp  # norms, qkv, attn, o, resid., mlp
    if m.qk_norm:  # Qwen3: q and k normalized per head (fp32 inside the norm)
      in_dtype += (h + k) * dh
      in_fp32 += (h + k) * dh
    if m.attention_output_gate:  # Qwen3.5: the gate and the gated output
      in_dtype += 2 * h * dh
  if moe:
    in_fp32 += 2 * m.num_experts
  return dt * in_dtype + 4 * in_fp32 + masks


def _attention_bytes(m: transformer.ModelConfig, rows: int, t: int,
                     segments: int) -> tuple[int, int]:
  """(saved for backward per layer, working set of one layer's backward) of attention."""
  dt, h = _bytes(m.dtype), m.num_heads
  if m.attention == 'dense':
    scores = rows * h * t * t
    return scores * (4 + dt) + rows * t * t, scores * (4 + 4 + dt) + rows * t * t
  if m.attention == 'cudnn':  # fp32 softmax statistics for each of a row's `segments` slots
    stats = rows * segments * h * t * 4
    return stats, stats + rows * t * h * m.head_dim * 4
  bq, bk = min(m.attention_block_q, t), min(m.attention_block_kv, t)
  lse = rows * h * t * 4
  tiles = 4 * rows * h * bq * bk * 4                     # s, p, dp, ds
  dq = rows * t * h * m.head_dim * 4
  return lse, tiles + 2 * lse + dq


def trainer_memory(m: transformer.ModelConfig, config: config_lib.Config,
                   mesh: AbstractMesh) -> tuple[dict[str, int], dict[str, Any]]:
  """The trainer device's terms for the config's worst-case batch (`worst_case_rows`)."""
  data_parallel = sharding_lib.data_parallel_size(mesh)
  rows, rows_per_micro = worst_case_rows(config, data_parallel)
  memory, facts = train_step_memory(m, config.optimizer, mesh, rows // data_parallel,
                                    rows_per_micro, config.train.seq_len,
                                    config.train.max_segments_per_row,
                                    lora=lora_lib.active(config.model.lora))
  facts.update(rows_per_step=rows,
               micro_batches=rows // (rows_per_micro * data_parallel))
  return memory, facts


def train_step_memory(m: transformer.ModelConfig, optimizer_config: config_lib.OptimizerConfig,
                      mesh: AbstractMesh, rows_per_shard: int, rows_per_micro: int, t: int,
                      max_segments_per_row: int = config_lib.TrainConfig.max_segments_per_row,
                      lora: config_lib.LoraSettings | None = None
                      ) -> tuple[dict[str, int], dict[str, Any]]:
  """One trainer device's terms for a step over `rows_per_shard` packed rows of `t` tokens, run
  `rows_per_micro` rows at a time (what the GPU kit compares with measured peaks).

  Calibrated against the peaks of the first H100 run (2026-11-26, Qwen2.5-0.5B and 1.5B shapes,
  bf16, remat, 8k rows): the optimizer's update is made after the backward pass has freed the
  micro-batch's activations, so it is not counted beside them (the micro-batch gradient is);
  `token_logprobs` holds two fp32 [rows, 1024, V] chunks at once, and one layer's
  intermediates are live during its backward pass."""
  optimizer = train.make_optimizer(optimizer_config)
  params = jax.eval_shape(functools.partial(transformer.init_params, m), jax.random.PRNGKey(0))
  trainable = params if lora is None else jax.eval_shape(
      functools.partial(lora_lib.init_adapters, m, lora, dtype=m.param_dtype),
      jax.random.PRNGKey(0))
  state = jax.eval_shape(functools.partial(train.init_train_state, optimizer=optimizer),
                         trainable)
  shardings = train.state_shardings(state, mesh)
  param_bytes = _sharded_bytes(state.params, shardings.params)
  opt_bytes = _sharded_bytes(state.opt_state, shardings.opt_state)
  tokens = rows_per_micro * t
  pb, dt = _bytes(m.param_dtype), _bytes(m.dtype)
  base_bytes = 0
  if lora is not None:  # the frozen base, in the compute dtype, sharded as params are
    base = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.dtype(m.dtype)),
                        params)
    base_bytes = _sharded_bytes(base, sharding_lib.param_shardings(base, mesh))
    pb = dt  # what fsdp gathers is the base
  d, v, l = m.hidden_size, m.vocab_size, m.num_layers

  ep = mesh.shape['expert'] if 'expert' in mesh.shape else 1
  moe_layers = len(m.moe_layers)
  experts = 3 * d * m.moe_intermediate_size * m.num_experts  # one MoE layer's expert weights
  # A gathered layer holds the experts of its device's expert group only (models/layers/moe.py).
  linear_layers = len(m.linear_layers)
  layer_params = (m.num_params - v * d * (1 if m.tie_embeddings else 2) - d
                  - moe_layers * experts) // l
  if linear_layers:  # the larger of the two kinds; Qwen3.5's MLPs are all dense or all MoE
    mlp_params = (d * m.num_experts + m.shared_expert_params if moe_layers
                  else 3 * d * m.intermediate_size)  # an MoE layer's experts are added below
    linear_layer = m.linear_attention_params + mlp_params + 2 * d
    layer_params = max(linear_layer, (l * layer_params - linear_layers * linear_layer)
                       // max(1, l - linear_layers))
  if moe_layers:
    layer_params += experts // ep
  gathered = 0
  if mesh.shape['fsdp'] > 1:
    gathered = 3 * layer_params * pb + v * d * pb * (1 if m.tie_embeddings else 2)
  attn_saved, attn_work = _attention_bytes(m, rows_per_micro, t, max_segments_per_row)
  attention_layers = l - linear_layers
  linear, moe = set(m.linear_layers), set(m.moe_layers)
  counts = collections.Counter((i in moe, i in linear) for i in range(l))
  kinds = [(n, is_moe, is_linear) for (is_moe, is_linear), n in sorted(counts.items())]
  per_token = {(is_moe, is_linear): _layer_bytes_per_token(m, is_moe, ep, is_linear)
               for _, is_moe, is_linear in kinds}
  layer = max(per_token.values()) * tokens
  if m.remat:
    # Each layer's input, and what the policy keeps (transformer.REMAT_POLICIES): attention's
    # q, k, v, output and statistics; 'dots' also the o-projection and MLP (dense: the three
    # projections'; MoE: the router's and a shared expert's, the grouped matmuls are
    # recomputed) outputs, and a Gated DeltaNet's four projections and out_proj.
    kept = 0
    if m.remat_policy in ('attention', 'dots'):
      kept = tokens * 2 * (m.num_heads + m.num_kv_heads) * m.head_dim * dt + attn_saved
    saved = l * tokens * d * dt + attention_layers * kept
    if m.remat_policy == 'dots':
      shared = m.shared_expert_intermediate_size
      mlp = {False: 2 * m.intermediate_size,
             True: m.num_experts + (2 * shared + 1 + d if shared else 0)}
      mixer = {False: 0, True: 0}
      if linear_layers:
        _, hv, _, dv, cc, _ = gated_delta.dims(m)
        mixer[True] = cc + hv * dv + 2 * hv
      saved += sum(n * tokens * (2 * d + mlp[is_moe] + mixer[is_linear]) * dt
                   for n, is_moe, is_linear in kinds)
  else:
    saved = (sum(n * tokens * per_token[is_moe, is_linear] for n, is_moe, is_linear in kinds)
             + attention_layers * attn_saved)
  chunk = min(LOGITS_CHUNK, t)
  logits = 2 * rows_per_micro * chunk * v * 4 + tokens * d * 4
  # An MoE model's batch also carries the sampler's routes, one byte an id up to 256 experts.
  routes = (moe_layers * m.num_experts_per_tok
            * np.dtype(moe_lib.route_dtype(m.num_experts)).itemsize)
  memory = dict(params=param_bytes, adam=opt_bytes, grads=2 * param_bytes, gathered=gathered,
                saved=saved, layer=layer, attention=attn_work, logits=logits,
                batch=rows_per_shard * (t * (BATCH_BYTES_PER_TOKEN + routes)
                                        + 8 * max_segments_per_row))
  if lora is not None:
    # The adapters' x A of every adapted projection of every layer, saved for the backward
    # pass: [U, Ra] each.
    adapted = sum(s.count for s in lora_lib.specs(m, lora))
    memory['saved'] += adapted * tokens * lora.rank * dt
    memory = dict(base=base_bytes, adapters=memory.pop('params'), **memory)
  facts = dict(rows_per_micro_batch=rows_per_micro, tokens_per_micro_batch=tokens,
               replicated_on_fsdp=sharding_lib.replicated_on_fsdp(
                   params, mesh, LARGE_PARAM_FRACTION))
  return memory, facts


def _hf_shapes(m: transformer.ModelConfig) -> list[tuple[int, ...]]:
  return [spec.hf_shape for _, spec, _ in hf_names.checkpoint_order(m)]


def publishing_memory(m: transformer.ModelConfig, config: config_lib.Config, param_bytes: int,
                      wire: str, train_devices: int) -> dict[str, int]:
  """Trainer-device terms of sending updates to generator actors over nccl/gloo (device 0, the
  one that sends, is the worst); none for the object store (params go to host). With several
  trainer processes the copy is whole on each process's devices (whole_per_process)."""
  g = config.generation
  if g.placement != 'ray' or g.remote.weight_transport == 'object_store':
    return {}
  lora = lora_lib.active(config.model.lora)
  if lora is not None:  # the adapters, replicated, in their dtype (transport_dtype)
    largest = budget.largest_tensor_bytes(hf_peft.shapes(m, lora).values(), wire)
    return dict(published=2 * param_bytes, sending=max(largest, param_bytes) + largest
                + CUDA_CONTEXT_BYTES)
  largest = budget.largest_tensor_bytes(_hf_shapes(m), wire)
  bucket = max(256 << 20, largest)  # GeneratorSpec.bucket_mb's default
  if config.train.num_processes > 1:
    local_devices = max(1, train_devices // config.train.num_processes)
    copy = -(-m.num_params * _bytes(wire) // local_devices)
  else:
    copy = param_bytes * _bytes(wire) // _bytes(m.param_dtype)
  return dict(published=2 * copy, sending=bucket + largest + CUDA_CONTEXT_BYTES)


def generator_memory(m: transformer.ModelConfig, config: config_lib.Config,
                     serving_dtype: str, device_bytes: int, kv: str, wire: str,
                     used_by_trainer: int = 0, lora: config_lib.LoraSettings | None = None
                     ) -> tuple[dict[str, int], dict[str, Any]]:
  """The terms of one vLLM generator device; `used_by_trainer`: what the trainer holds on the
  same device (in-process vLLM shares device 0 with it). Raises ValueError (one line) when the
  configured share leaves vLLM nothing."""
  g = config.generation
  sb = _bytes(serving_dtype)
  slots = -(-g.num_slots // g.num_generators)
  max_len = g.max_prompt_len + g.max_new_tokens
  shapes = _hf_shapes(m) if lora is None else list(hf_peft.shapes(m, lora).values())
  collective = g.remote.weight_transport != 'object_store' and g.placement == 'ray'
  if collective:
    staging = budget.STAGING_BUFFERS * budget.staged_bytes(shapes, wire)
  else:  # each tensor reaches the GPU on its own, from the host
    staging = budget.largest_tensor_bytes(shapes, m.param_dtype)
  d, f = m.hidden_size, m.intermediate_size
  if m.is_moe:  # the MLP width a token uses: its experts' (and a shared one's), or a dense's
    f = max(m.num_experts_per_tok * m.moe_intermediate_size + m.shared_expert_intermediate_size,
            f if len(m.moe_layers) < m.num_layers else 0)
  q_kv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
  profile = VLLM_BATCHED_TOKENS * (4 * f + 4 * d + q_kv) * sb
  activations = (profile + slots * m.vocab_size * 4
                 + (CUDA_GRAPHS_BYTES if g.vllm.cuda_graphs else 0))
  kv_per_token = 2 * len(m.attention_layers) * m.num_kv_heads * m.head_dim * sb
  request = -(-max_len // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS * kv_per_token
  weights = m.num_params * sb
  host_base = 0
  if lora is not None and g.vllm.lora_update == 'merge':
    # The base's kernels of every module an adapter touches, kept on the host to merge from.
    kept = config_lib.LoraSettings(1, 1.0, lora_lib.merged_targets(lora))
    host_base = sum(s.count * s.in_features * s.out_features
                    for s in lora_lib.specs(m, kept)) * sb
  if lora is not None and g.vllm.lora_update == 'slot':
    # vLLM's one LoRA slot: every targeted projection's A and B at its padded rank.
    padded = config_lib.LoraSettings(budget.vllm_lora_rank(lora.rank), lora.alpha, lora.targets)
    weights += lora_lib.num_params(m, padded) * sb
  memory = dict(context=CUDA_CONTEXT_BYTES, staging=staging, weights=weights,
                activations=activations)
  if m.is_hybrid:  # each sequence's Gated DeltaNet state (fp32), out of vLLM's cache budget
    memory['state'] = slots * len(m.linear_layers) * gated_delta.state_bytes(m, serving_dtype)
  share = g.vllm.gpu_memory_utilization
  fraction = None
  if kv == 'free':
    # What the generator sees when vLLM starts: its context and staging buffer (and, inline,
    # the trainer) in use; the object store's tensor kept for later.
    used = CUDA_CONTEXT_BYTES + (staging if collective else 0) + used_by_trainer
    fraction = budget.vllm_memory_fraction(share, device_bytes - used, device_bytes,
                                           reserve_bytes=0 if collective else staging)
    kv_bytes = (int(fraction * device_bytes) - memory['weights'] - activations
                - memory.get('state', 0))
  else:
    kv_bytes = g.vllm.kv_cache_mb << 20
  memory['kv'] = max(kv_bytes, 0)
  update_bytes = (m.num_params if lora is None else lora_lib.num_params(m, lora)) * _bytes(
      m.param_dtype)
  facts = dict(slots_per_generator=slots, kv_bytes_per_token=kv_per_token,
               full_request_bytes=request, kv_full_requests=kv_bytes / request,
               wire_dtype=wire if collective else m.param_dtype,
               staging_buffers=budget.STAGING_BUFFERS if collective else 0,
               vllm_gpu_memory_utilization=fraction, host_lora_base_bytes=host_base,
               # Ray's object store: one host copy per node of each update in flight (two while
               # a new version replaces the one the actors still read).
               host_object_store_bytes=update_bytes
               if g.remote.weight_transport == 'object_store' and g.placement == 'ray' else 0)
  return memory, facts


def evaluation_memory(m: transformer.ModelConfig, config: config_lib.Config,
                      shares_base: bool) -> dict[str, int]:
  """The in-run evaluation's JAX engine (the module doc's terms); `shares_base`: with LoRA, it
  reads the trainer's base (placements.base_on: the whole mesh is its one device)."""
  g, ev = config.generation, config.eval
  page_bytes = budget.kv_page_bytes(len(m.attention_layers), m.num_kv_heads, m.head_dim,
                                    g.kv_page_size, m.dtype)
  pages = budget.kv_pool_pages(num_slots=g.num_slots,
                               max_seq_len=g.max_prompt_len + (ev.max_tokens or g.max_new_tokens),
                               page_size=g.kv_page_size, page_bytes=page_bytes,
                               pool_mb=ev.kv_pool_mb or g.kv_pool_mb)
  lora = lora_lib.active(config.model.lora)
  weights = m.num_params * _bytes(m.dtype)
  if lora is not None:
    weights = (0 if shares_base else weights) + lora_lib.num_params(m, lora) * _bytes(m.dtype)
  memory = dict(weights=weights, kv=pages * page_bytes)
  if m.is_hybrid:  # its slots' Gated DeltaNet states and the saved ones, as the run's engine's
    memory['state'] = engine_state_bytes(m, g.num_slots)
  return memory


def engine_state_bytes(m: transformer.ModelConfig, num_slots: int) -> int:
  """A hybrid JAX engine's Gated DeltaNet states: every slot's and the saved ones, each in
  every linear layer (generation/slot_state.py)."""
  rows = num_slots + budget.saved_states(num_slots)
  return rows * len(m.linear_layers) * gated_delta.state_bytes(m)


def _evaluation_problems(p_trainer: dict[str, int], generator: dict[str, int],
                         evaluation: dict[str, int], config: config_lib.Config, mesh_size: int,
                         device: '_Device', facts: dict[str, Any]) -> list[str]:
  """Where the in-run evaluation's engine goes, and whether that device holds it then."""
  g = config.generation
  num_devices, device_bytes, device_gib = device.count, device.bytes, device.gib
  total = sum(evaluation.values())
  if mesh_size < num_devices:  # the first free device
    facts['evaluation_device'] = mesh_size
    if g.placement == 'ray':
      return [f'eval.every_steps: the in-run evaluation builds a JAX engine on device '
              f'{mesh_size}, which a generator holds (placement ray): set eval.every_steps=0 and '
              'evaluate checkpoints with pipelinerl-eval']
    beside = sum(generator.values()) if g.backend == 'jax' else 0
    facts['evaluation_device_bytes'] = beside + total
    if beside + total > device_bytes:
      return [f'device {mesh_size} during an evaluation holds the JAX engine and the '
              f'evaluation\'s: {(beside + total) / GIB:.1f} GiB > {device_gib:g} GiB']
    return []
  facts['evaluation_device'] = 0
  resident = sum(v for k, v in p_trainer.items() if k not in STEP_TERMS)
  beside = sum(generator.values()) if g.placement == 'inline' else 0
  facts['evaluation_device_bytes'] = resident + beside + total
  if resident + beside + total > device_bytes:
    return [f'device 0 during an evaluation holds the trainer\'s state, the engine and the '
            f'evaluation\'s: {(resident + beside + total) / GIB:.1f} GiB > {device_gib:g} GiB '
            '(eval.kv_pool_mb sizes its KV pool)']
  return []


KV_MODES = ('auto', 'free', 'config')


def plan(config: ml_collections.ConfigDict | config_lib.Config, hf_config: dict, *,
         num_devices: int, device_gib: float, kv: str = 'auto',
         source: str = 'config.json') -> Plan:
  """The memory plan of `config` with the architecture `hf_config` (a parsed config.json) on
  `num_devices` devices of `device_gib` GiB. `kv`: how vLLM's KV cache is sized (see the module
  doc): 'auto' as the generators on GPUs do, 'free' from generation.vllm.gpu_memory_utilization,
  'config' generation.vllm.kv_cache_mb."""
  if kv not in KV_MODES:
    raise ValueError(f'kv={kv!r}: expected one of {", ".join(map(repr, KV_MODES))}')
  config = config_lib.validate(config, runnable=False)  # the model comes from hf_config
  if kv == 'auto':
    kv = 'free' if config.generation.vllm.gpu_memory_utilization > 0 else 'config'
  elif kv == 'free' and not config.generation.vllm.gpu_memory_utilization:
    raise ValueError("kv='free' needs generation.vllm.gpu_memory_utilization > 0")
  mc = config.model
  m = hf_schema.config_from_hf(hf_config, source=source, param_dtype=mc.param_dtype,
                               dtype=mc.dtype, lm_head_fp32=mc.lm_head_fp32, remat=mc.remat,
                               remat_policy=mc.remat_policy, attention=mc.attention,
                               attention_block_q=mc.attention_block_q,
                               attention_block_kv=mc.attention_block_kv)
  device = _Device(num_devices, device_gib)
  sizes = mesh_sizes(config.train.mesh, num_devices)
  mesh = AbstractMesh(sizes, sharding_lib.MESH_AXES)
  lora = lora_lib.active(config.model.lora)
  trainer, facts = trainer_memory(m, config, mesh)
  serving = budget.serving_dtype(hf_config) or 'bfloat16'
  g = config.generation
  wire = budget.wire_dtype(g.remote.weight_transport, g.backend, serving, m.param_dtype)
  if lora is not None:  # adapters travel in their own dtype (placements.transport_dtype)
    wire = m.param_dtype
  trainer.update(publishing_memory(m, config, trainer['adapters' if lora else 'params'], wire,
                                   mesh.size))
  facts.update(mesh=sharding_lib.mesh_text(sizes), train_devices=mesh.size,
               device_bytes=device.bytes, params=m.num_params,
               active_params=m.num_active_params)
  problems = _trainer_problems(config, sizes, trainer, facts, device)
  if g.backend == 'jax':
    generator, more = _jax_engine_plan(m, config, mesh.size, trainer, facts, lora, device)
  else:
    generator, more = _vllm_plan(m, config, mesh.size, trainer, facts, lora, device, serving,
                                 kv, wire)
  problems += more
  evaluation = {}
  if config.eval.every_steps:
    shares = (lora is not None and mesh.size == 1 and num_devices == 1)
    evaluation = evaluation_memory(m, config, shares)
    problems += _evaluation_problems(trainer, generator, evaluation, config, mesh.size, device,
                                     facts)
  return Plan(trainer=trainer, generator=generator, facts=facts, problems=tuple(problems),
              evaluation=evaluation)


@dataclasses.dataclass(frozen=True)
class _Device:
  """The devices a plan places onto: how many, and each one's memory."""
  count: int
  gib: float

  @property
  def bytes(self) -> int:
    return int(self.gib * GIB)


def _trainer_problems(config: config_lib.Config, sizes, trainer: dict[str, int],
                      facts: dict[str, Any], device: _Device) -> list[str]:
  """A mesh that shards no large parameter, a trainer device over its memory."""
  problems = []
  if facts['replicated_on_fsdp']:
    name, shape = facts['replicated_on_fsdp'][0]
    n = len(facts['replicated_on_fsdp'])
    problems.append(
        f"train.mesh={config.train.mesh}: fsdp={sizes[1]} divides no dimension of {n} large "
        f"parameter(s) (e.g. {name} {list(shape)}), so each of the {sizes[1]} devices holds "
        f'them whole')
  if sum(trainer.values()) > device.bytes:
    top = sorted(trainer.items(), key=lambda kv_: -kv_[1])[:3]
    problems.append(
        f'a trainer device needs {sum(trainer.values()) / GIB:.1f} GiB > {device.gib:g} GiB ('
        + ', '.join(f'{k} {b / GIB:.1f}' for k, b in top) + ')')
  return problems


def _jax_engine_plan(m: transformer.ModelConfig, config: config_lib.Config, mesh_size: int,
                     trainer: dict[str, int], facts: dict[str, Any],
                     lora: config_lib.LoraSettings | None, device: _Device
                     ) -> tuple[dict[str, int], list[str]]:
  """The JAX engine's terms (the module doc's) and where they do not fit. Placement 'inline': on
  the first device the mesh leaves free (or on device 0, beside the trainer); 'ray': one device
  per generator, beside the mesh, each with its share of the slots."""
  g = config.generation
  page_bytes = budget.kv_page_bytes(len(m.attention_layers), m.num_kv_heads, m.head_dim,
                                    g.kv_page_size, m.dtype)
  pages = budget.kv_pool_pages(num_slots=g.generator_slots, max_seq_len=g.max_seq_len,
                               page_size=g.kv_page_size, page_bytes=page_bytes,
                               pool_mb=g.kv_pool_mb)
  facts['generator_devices'] = 1 if mesh_size < device.count else 0
  # Served weights, the next published copy (it lands while they serve) and the KV pool.
  weights = update = m.num_params * _bytes(m.dtype)
  if lora is not None:
    # Adapters alone, served in the compute dtype and published in the param dtype; the base
    # too unless the engine reads the trainer's (inline on device 0, the whole mesh one
    # device: placements.base_on).
    shares = (not facts['generator_devices'] and g.placement == 'inline' and mesh_size == 1)
    n = lora_lib.num_params(m, lora)
    weights = (0 if shares else weights) + n * _bytes(m.dtype)
    update = n * _bytes(m.param_dtype)
    facts['engine_shares_base'] = shares
  generator = dict(weights=weights, update=update, kv=pages * page_bytes)
  if m.is_hybrid:  # Gated DeltaNet states per slot and saved ones, beside the KV pool
    generator['state'] = engine_state_bytes(m, g.generator_slots)
    facts.update(state_bytes_per_slot=len(m.linear_layers) * gated_delta.state_bytes(m),
                 saved_states=budget.saved_states(g.generator_slots),
                 linear_layers=len(m.linear_layers), attention_layers=len(m.attention_layers))
  engine = sum(generator.values())
  # The trash page holds no sequence; a full-length sequence takes whole pages.
  facts.update(kv_pool_tokens=(pages - 1) * g.kv_page_size,
               kv_pool_full_sequences=(pages - 1) // -(-g.max_seq_len // g.kv_page_size),
               slots_per_generator=g.generator_slots)
  problems = []
  mesh_text, gib = config.train.mesh, f'{device.gib:g} GiB'
  if g.placement == 'ray':
    facts['generator_devices'] = g.num_generators
    if mesh_size + g.num_generators > device.count:
      problems.append(f'train.mesh={mesh_text} takes {mesh_size} of {device.count} devices, '
                      f'{g.num_generators} generator(s) need one each')
    if engine > device.bytes:
      problems.append(f'a generator device holds the JAX engine: {engine / GIB:.1f} GiB > {gib}')
  elif mesh_size > device.count:
    problems.append(f'train.mesh={mesh_text} needs {mesh_size} devices, the host has '
                    f'{device.count}')
  elif not facts['generator_devices'] and sum(trainer.values()) + engine > device.bytes:
    problems.append(f'device 0 holds the trainer and the JAX engine: '
                    f'{(sum(trainer.values()) + engine) / GIB:.1f} GiB > {gib}')
  elif engine > device.bytes:
    problems.append(f'the device of the JAX engine needs {engine / GIB:.1f} GiB > {gib}')
  return generator, problems


def _vllm_plan(m: transformer.ModelConfig, config: config_lib.Config, mesh_size: int,
               trainer: dict[str, int], facts: dict[str, Any],
               lora: config_lib.LoraSettings | None, device: _Device, serving: str, kv: str,
               wire: str) -> tuple[dict[str, int], list[str]]:
  """vLLM's terms (`generator_memory`) and where they do not fit. Placement 'ray': one GPU per
  generator actor, beside the mesh; 'inline': in the trainer's process, on its device 0."""
  g = config.generation
  in_process = g.placement == 'inline'
  generators = 0 if in_process else g.num_generators
  facts['generator_devices'] = generators
  problems = []
  if mesh_size + generators > device.count:
    problems.append(f'train.mesh={config.train.mesh} takes {mesh_size} of {device.count} '
                    f'devices, {generators} generator(s) need one each')
  shared = sum(trainer.values()) if in_process else 0
  try:
    generator, gen_facts = generator_memory(m, config, serving, device.bytes, kv, wire,
                                            used_by_trainer=shared, lora=lora)
  except ValueError as e:  # the share leaves vLLM nothing
    return {}, problems + [str(e)]
  facts.update(gen_facts)
  if gen_facts['kv_full_requests'] < 1:
    problems.append(
        f"the KV cache ({generator['kv'] / 2**20:.0f} MiB per generator, kv={kv}) holds "
        f"{gen_facts['kv_full_requests']:.2f} of one full-length request "
        f"({g.max_prompt_len + g.max_new_tokens} tokens = "
        f"{gen_facts['full_request_bytes'] / 2**20:.0f} MiB)")
  if sum(generator.values()) + shared > device.bytes:
    where = 'device 0 (trainer and in-process vLLM)' if in_process else 'a generator device'
    problems.append(f'{where} needs {(sum(generator.values()) + shared) / GIB:.1f} GiB > '
                    f'{device.gib:g} GiB')
  return generator, problems


def read_hf_config(path: str | os.PathLike) -> tuple[dict, str]:
  """(parsed config.json, its path) from a model directory or a config.json path."""
  path = os.fspath(path)
  if not path:
    raise ValueError('no model config: give --model_config (a model directory or config.json, '
                     'e.g. configs/models/Qwen2.5-7B) or config.model.path')
  if os.path.isdir(path) or not path.endswith('.json'):
    path = os.path.join(path, hf_schema.CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file (give a model directory or its config.json)')
  with open(path) as f:
    try:
      return json.load(f), path
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}: not valid JSON ({e})') from None


def format_plan(p: Plan) -> str:
  """A table of GiB per device by term, the derived figures, then FITS or the one-line refusal."""
  f = p.facts
  active = (f" ({f['active_params'] / 1e9:.2f}B active)"
            if f.get('active_params', f['params']) != f['params'] else '')
  lines = [f"trainer: {f['train_devices']} device(s), mesh {f['mesh']} "
           f"(data,fsdp,tensor,expert); {f['params'] / 1e9:.2f}B params{active}; worst case "
           f"{f['rows_per_step']} rows per step, "
           f"{f['micro_batches']} micro-batch(es) of {f['rows_per_micro_batch']} row(s) per "
           f'device']
  width = max(len(k) for k in [*p.trainer, *p.generator, 'total'])
  for name, terms, total in (('trainer device', p.trainer, p.trainer_total),
                             ('generator device', p.generator, p.generator_total),
                             ('in-run evaluation', p.evaluation, sum(p.evaluation.values()))):
    if not terms:
      continue
    lines.append(f'  {name}:')
    lines += [f'    {k.ljust(width)} {v / GIB:8.2f} GiB' for k, v in terms.items()]
    lines.append(f"    {'total'.ljust(width)} {total / GIB:8.2f} GiB of "
                 f"{f['device_bytes'] / GIB:g}")
  if 'kv_pool_tokens' in f:
    shared = ' beside the trainer on device 0' if not f['generator_devices'] else ''
    lines.append(f"JAX engine{shared}: {f['slots_per_generator']} slots; its KV pool holds "
                 f"{f['kv_pool_tokens']:,} positions, {f['kv_pool_full_sequences']} full-length "
                 'sequences (a sequence that finds no free page waits, or is preempted)')
    if 'state_bytes_per_slot' in f:
      lines.append(f"  and per slot the Gated DeltaNet state of {f['linear_layers']} linear "
                   f"layers, {f['state_bytes_per_slot'] / 2**20:.1f} MiB, and {f['saved_states']} "
                   f"saved ones (KV pages only for the {f['attention_layers']} full-attention "
                   'layers)')
    if not f['generator_devices']:
      lines.append(f'device 0 in all: {(p.trainer_total + p.generator_total) / GIB:.2f} GiB of '
                   f"{f['device_bytes'] / GIB:g}")
  if f.get('engine_shares_base'):
    lines.append('the JAX engine reads the trainer\'s base (one copy): it adds the adapters, the '
                 'next update of them and its KV pool')
  if 'kv_full_requests' in f:
    lines.append(f"generators: {f['generator_devices']}, {f['slots_per_generator']} slots each; "
                 f"KV {f['kv_bytes_per_token'] / 1024:.0f} KiB/token, a full request "
                 f"{f['full_request_bytes'] / 2**20:.0f} MiB: the cache holds "
                 f"{f['kv_full_requests']:.1f} full-length requests")
    if f['staging_buffers']:
      lines.append(f"weights sent in {f['wire_dtype']}, {f['staging_buffers']} whole update "
                   'staged per generator')
    if f['vllm_gpu_memory_utilization'] is not None:
      lines.append(f"vLLM is given gpu_memory_utilization "
                   f"{f['vllm_gpu_memory_utilization']:.3f}")
    if f.get('host_lora_base_bytes'):
      lines.append(f"host memory, the base kernels LoRA merges from: "
                   f"{f['host_lora_base_bytes'] / GIB:.1f} GiB per generator")
    if f['host_object_store_bytes']:
      lines.append(f"host memory, Ray's object store: {f['host_object_store_bytes'] / GIB:.1f} "
                   'GiB per node per update in flight (two while a new one replaces it)')
  if 'evaluation_device_bytes' in f:
    lines.append(f"device {f['evaluation_device']} during an in-run evaluation: "
                 f"{f['evaluation_device_bytes'] / GIB:.2f} GiB of {f['device_bytes'] / GIB:g} "
                 "(the train step's gradients and activations are free then)")
  lines.append('FITS' if p.fits else f'REFUSED: {p.refusal}')
  return '\n'.join(lines)


def main(argv):
  del argv
  from absl import flags  # the CLI only
  f = flags.FLAGS
  try:
    hf_config, source = read_hf_config(f.model_config or f.config.model.path)
    device_gib = f.device_gib or accelerators.card_named(f.device).usable_gib
    p = plan(f.config, hf_config, num_devices=f.devices, device_gib=device_gib, kv=f.kv,
             source=source)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  print(format_plan(p))
  if f.json:
    with open(f.json, 'w') as out:
      json.dump(dict(trainer=p.trainer, generator=p.generator, facts=p.facts,
                     problems=list(p.problems), fits=p.fits), out, indent=1, default=str)
  raise SystemExit(0 if p.fits else 1)


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. '
                                  'configs/math.py:paper_7b.', lock_config=True)
  flags.DEFINE_string('model_config', '', 'Model directory or config.json (default: '
                      'config.model.path), e.g. configs/models/Qwen2.5-7B.')
  flags.DEFINE_integer('devices', 8, 'Accelerators on the host.')
  flags.DEFINE_enum('device', 'h100', list(accelerators.PLANNED),
                    'The card, for the memory a process has on each device: ' + ', '.join(
                        f'{c.name} {c.usable_gib:g} GiB' for c in accelerators.CARDS
                        if c.usable_gib) + '.')
  flags.DEFINE_float('device_gib', 0.0, 'Memory per accelerator, GiB (default: --device\'s).')
  flags.DEFINE_enum('kv', 'auto', list(KV_MODES), "vLLM KV cache: 'auto' = as the generators "
                    "size it on GPUs (the config's generation.vllm.gpu_memory_utilization, or "
                    "kv_cache_mb when it is 0); 'free' = from the share; 'config' = "
                    'generation.vllm.kv_cache_mb.')
  flags.DEFINE_string('json', '', 'Also write the plan as JSON here.')
  flags.mark_flags_as_required(['config'])


if __name__ == '__main__':
  from absl import app
  _define_flags()
  app.run(main)
