"""PEFT's LoRA format: its tensor names, and adapter dirs (adapter_config.json +
adapter_model.safetensors) written from LoRA adapters (models/layers/lora.py).

The names are the ones `peft.PeftModel.save_pretrained` writes: the wrapped module's name in the
HF model, under `base_model.model.`, then `lora_A.weight` [Ra, Di] or `lora_B.weight` [Do, Ra],
B without the scale (PEFT applies alpha / r itself). The module is the layer's projection under
the language model's prefix: `model.layers.{i}.self_attn.q_proj` for a causal LM,
`model.language_model.layers.{i}.linear_attn.in_proj_qkv` in Qwen3.5's composite layout, so an
adapter dir loads onto the kind of model dir it was trained from. vLLM's LoRA loader reads the
same names (it maps the composite's prefix itself, and fuses the parts it serves fused:
docs/lora.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.transformer import ModelConfig

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'


def module_name(model_config: ModelConfig, spec: lora_lib.AdapterSpec, layer: int) -> str:
  """The HF module the adapter of model layer `layer` wraps (PEFT's target module)."""
  return hf_schema.family_of(model_config).lm_prefix + spec.hf_module(layer)


def tensor_name(model_config: ModelConfig, spec: lora_lib.AdapterSpec, layer: int,
                which: str) -> str:
  """PEFT's name of layer `layer`'s A ('a') or B ('b')."""
  part = 'lora_A' if which == 'a' else 'lora_B'
  return f'base_model.model.{module_name(model_config, spec, layer)}.{part}.weight'


def tensors(adapters, model_config: ModelConfig, lora: config_lib.LoraSettings,
            dtype: Any = None) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, host array) of every adapter tensor, layer by layer: A as [Ra, Di] and B as
  [Do, Ra] (torch Linear layout), B unscaled; in `dtype` (None: the adapters' own)."""
  host = {path: np.asarray(jax.device_get(x)) for path, x in lora_lib.leaves(adapters)}
  for i, s in lora_lib.by_layer(lora_lib.specs(model_config, lora)):
    for which in ('a', 'b'):
      x = host[s.path + (which,)][i - s.first_layer].T
      x = x if dtype is None else x.astype(jnp.dtype(dtype))
      yield tensor_name(model_config, s, i, which), np.ascontiguousarray(x)


def shapes(model_config: ModelConfig, lora: config_lib.LoraSettings
           ) -> dict[str, tuple[int, ...]]:
  """{PEFT name: shape} of every adapter tensor, in `tensors`' order (what a collective
  transport carries for a LoRA update)."""
  out = {}
  for i, s in lora_lib.by_layer(lora_lib.specs(model_config, lora)):
    out[tensor_name(model_config, s, i, 'a')] = (lora.rank, s.in_features)
    out[tensor_name(model_config, s, i, 'b')] = (s.out_features, lora.rank)
  return out


def stacked(tensor_of, model_config: ModelConfig, lora: config_lib.LoraSettings
            ) -> dict[tuple[str, ...], list]:
  """{adapter leaf path: its rows in layer order} from PEFT tensors, `tensor_of(name, shape)` ->
  the tensor of that name in PEFT's layout; each row transposed to the leaf's ([Di, Ra] for A,
  [Ra, Do] for B). The caller stacks the rows in its own array type."""
  out = {}
  for s in lora_lib.specs(model_config, lora):
    for which, shape in (('a', (lora.rank, s.in_features)), ('b', (s.out_features, lora.rank))):
      out[s.path + (which,)] = [tensor_of(tensor_name(model_config, s, i, which), shape).T
                                for i in s.layers]
  return out


def adapter_config(model_config: ModelConfig, lora: config_lib.LoraSettings,
                   base_model: str) -> dict:
  """adapter_config.json: the fields PEFT reads for a plain LoRA; it fills in the rest. The
  target modules are the targets the model has (`lora.targets_in`)."""
  return dict(peft_type='LORA', task_type='CAUSAL_LM', base_model_name_or_path=base_model,
              r=lora.rank, lora_alpha=lora.alpha,
              target_modules=list(lora_lib.targets_in(model_config, lora)),
              lora_dropout=0.0, bias='none', fan_in_fan_out=False, use_rslora=False,
              use_dora=False, init_lora_weights=True, inference_mode=True, modules_to_save=None)


def save_peft(adapters, model_config: ModelConfig, lora: config_lib.LoraSettings, out_dir,
              base_model: str, dtype: Any = None) -> list[Path]:
  """Writes a PEFT adapter dir that `peft.PeftModel.from_pretrained(<base model>, out_dir)` and
  vLLM's LoRARequest load; returns the files written."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  weights, config = out / WEIGHTS_FILE, out / CONFIG_FILE
  hf_files.write_safetensors(weights, list(tensors(adapters, model_config, lora, dtype)))
  hf_files.write_json(config, adapter_config(model_config, lora, base_model))
  return [config, weights]
