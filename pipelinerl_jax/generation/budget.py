"""A generator's device memory, by one rule that the generators apply when they start and the
memory plan (`memory_plan.py`) computes ahead of a run:

  wire_dtype            the dtype weight updates travel in over a collective transport
  staged_bytes          what one whole update takes in a transport buffer (tensors aligned)
  STAGING_BUFFERS       how many whole updates a generator holds staged at once
  vllm_memory_fraction  the `gpu_memory_utilization` vLLM is given on a CUDA device
  kv_pool_pages         the pages of the JAX engine's paged KV cache
  saved_states          a hybrid's Gated DeltaNet states the JAX engine keeps beside its slots'
  vllm_lora_rank        the rank vLLM's LoRA slot is allocated at (LoRA runs)

vLLM's share. vLLM asks for `gpu_memory_utilization x total` bytes for its own weights,
activations, CUDA graphs and KV cache (what is left of its budget after a profile run), on top
of what the device already holds when it starts (vllm/v1/worker/utils.py:request_memory, and
gpu_worker.determine_available_memory: KV = requested - what vLLM itself consumed). So
`generation.vllm.gpu_memory_utilization` is here the share of the device in use once vLLM has
started, by everything on it: other processes, this process's CUDA context, the transport's
staging buffer (allocated before the engine starts) and vLLM. vLLM gets what remains of that
share, minus what this process will still allocate later (`reserve_bytes`: the object-store
transport's tensor on its way in).

Standard library only: the memory plan runs where torch is not installed.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

GIB = 2**30
ALIGN = 256            # bytes: each tensor's offset in a transport buffer is a multiple of it
# Whole updates staged on a generator's device at once over nccl/gloo: the receiver owns one
# buffer, allocated when it joins the trainer's group and reused for every update; the next
# update waits until the engine has loaded (or dropped) the previous one (transport/collective).
STAGING_BUFFERS = 1
MIN_VLLM_BYTES = GIB // 2  # below this vLLM cannot even hold a small model's activations
# The JAX engine's KV pool, when generation.kv_pool_mb is 0: at most this share of the memory
# its device has free when the engine starts (the rest is for activations, logits, a weight
# update in flight and, on a shared device, the trainer).
KV_FREE_SHARE = 0.5
ITEMSIZE = {'float32': 4, 'bfloat16': 2, 'float16': 2}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def vllm_lora_rank(rank: int) -> int:
  """vLLM's max_lora_rank for an adapter of `rank`: the smallest it allows (its slot is padded
  with zeros past `rank`)."""
  for r in VLLM_LORA_RANKS:
    if r >= rank:
      return r
  raise ValueError(f'lora rank {rank} is above vLLM\'s largest, {VLLM_LORA_RANKS[-1]}')


def serving_dtype(hf_config: dict) -> str | None:
  """The dtype vLLM serves a checkpoint in (its config.json's; None when it names none)."""
  return hf_config.get('dtype') or hf_config.get('torch_dtype')


def wire_dtype(transport: str, backend: str, serving: str | None, param_dtype: str) -> str:
  """The dtype updates travel in over a collective. nccl to vLLM: the serving dtype, which vLLM
  casts every weight to on load anyway (its CUDA fp32 head, `head_dtype=float32`, multiplies the
  lm_head weight in the serving dtype: vllm/model_executor/layers/logits_processor.py
  `_apply_head`, `torch.mm(..., out_dtype=float32)`), so fp32 on the wire would buy nothing and
  double the staging buffer. gloo (CPU) and the JAX engine: the trainer's param dtype (vLLM on
  CPU keeps an fp32 lm_head for `lm_head_fp32`; the JAX engine holds the params as trained)."""
  if transport == 'nccl' and backend == 'vllm' and serving in ITEMSIZE:
    return serving
  return param_dtype


def align(n: int, to: int = ALIGN) -> int:
  """n rounded up to a multiple of `to`."""
  return -(-n // to) * to


def staged_bytes(shapes: Iterable[Sequence[int]], dtype: str) -> int:
  """Bytes of one whole update in a transport buffer: each tensor starts at an ALIGN boundary
  (equal to `collective.Plan.nbytes`, whatever the bucket size)."""
  return sum(align(math.prod(s) * ITEMSIZE[dtype]) for s in shapes)


def largest_tensor_bytes(shapes: Iterable[Sequence[int]], dtype: str) -> int:
  return max(math.prod(s) for s in shapes) * ITEMSIZE[dtype]


def vllm_memory_fraction(share: float, free_bytes: int, total_bytes: int,
                         reserve_bytes: int = 0) -> float:
  """vLLM's `gpu_memory_utilization` on a device with `free_bytes` of `total_bytes` free now, so
  that the device holds `share` of its memory once vLLM has started and this process has
  allocated `reserve_bytes` more (see the module doc). Raises a one-line ValueError naming
  generation.vllm.gpu_memory_utilization when that leaves vLLM less than MIN_VLLM_BYTES."""
  if not 0 < share <= 1:
    raise ValueError(f'generation.vllm.gpu_memory_utilization={share}: must be in (0, 1]')
  used = total_bytes - free_bytes
  budget = int(share * total_bytes) - used - reserve_bytes
  if budget < MIN_VLLM_BYTES:
    raise ValueError(
        f'generation.vllm.gpu_memory_utilization={share} of {total_bytes / GIB:.1f} GiB leaves '
        f'vLLM {budget / GIB:.2f} GiB: {used / GIB:.2f} GiB are in use on its GPU already (other '
        f'processes, the CUDA context, the weight-staging buffer) and {reserve_bytes / GIB:.2f} '
        'GiB are kept for weight updates; raise the share or free the GPU')
  return budget / total_bytes


def saved_states(num_slots: int) -> int:
  """The saved Gated DeltaNet states (generation/slot_state.py) a hybrid's JAX engine keeps
  beside its `num_slots` slots' own, each one sequence's state in every linear layer: a quarter
  of the slots, one per group of 4 or more samples of a prompt in flight (a shared prompt holds
  one), or in multi-turn runs a finished turn's, held for the next. When none is free a prompt
  is not shared (each sample loads it whole) and the oldest held turn gives its up: fewer cost
  prefill, never a wrong token."""
  return max(1, num_slots // 4)


def kv_page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                  dtype: str) -> int:
  """Bytes of one page of the JAX engine's pool: keys and values of `page_size` positions in
  every layer."""
  return 2 * num_layers * num_kv_heads * head_dim * page_size * ITEMSIZE[dtype]


def kv_pool_pages(*, num_slots: int, max_seq_len: int, page_size: int, page_bytes: int,
                  pool_mb: int = 0, free_bytes: int | None = None) -> int:
  """Pages of the JAX engine's KV pool, its trash page included. `pool_mb` MiB when set;
  otherwise enough for every slot at max_seq_len (a dense cache's memory: more is never used),
  or fewer when that exceeds KV_FREE_SHARE of `free_bytes` (the device's free memory, when it
  reports it). Raises a one-line ValueError naming generation.kv_pool_mb when the pool cannot
  hold one full-length sequence."""
  per_sequence = -(-max_seq_len // page_size)
  if pool_mb:
    pages = (pool_mb << 20) // page_bytes
  else:
    pages = 1 + num_slots * per_sequence
    if free_bytes is not None:
      pages = min(pages, int(KV_FREE_SHARE * free_bytes) // page_bytes)
  if pages < 1 + per_sequence:
    raise ValueError(f'generation.kv_pool_mb={pool_mb}: a pool of {pages} pages of '
                     f'{page_bytes / 2**20:.2f} MiB cannot hold one sequence of {max_seq_len} '
                     f'positions ({per_sequence} pages and the trash page)')
  return pages
