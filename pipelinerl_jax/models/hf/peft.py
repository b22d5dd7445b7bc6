"""PEFT adapter dirs (adapter_config.json + adapter_model.safetensors) from LoRA adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.transformer import ModelConfig


def save_peft(adapters, model_config: ModelConfig, lora: config_lib.LoraSettings, out_dir,
              base_model: str, dtype: Any = None) -> list[Path]:
  """Writes a PEFT adapter dir that `peft.PeftModel.from_pretrained(<base model>, out_dir)` and
  vLLM's LoRARequest load; returns the files written."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  weights, config = out / lora_lib.PEFT_WEIGHTS_FILE, out / lora_lib.PEFT_CONFIG_FILE
  hf_files.write_safetensors(weights,
                             list(lora_lib.peft_tensors(adapters, model_config, lora, dtype)))
  hf_files.write_json(config, lora_lib.peft_config(lora, base_model))
  return [config, weights]
