"""The pieces every kind of layer uses: RMSNorm, a projection (LoRA-aware) and the SwiGLU MLP.

Layers take the model's `transformer.ModelConfig` as `config` (read by attribute, not imported:
the assembly in transformer.py imports the layers).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipelinerl_jax.models.layers import lora as lora_lib


class RMSNorm(nn.Module):
  """RMSNorm over the last axis. `zero_centered` (Qwen3.5): the scale is 1 + w, w starting at 0,
  applied in fp32 before the cast (transformers' `Qwen3_5RMSNorm`)."""
  eps: float
  dtype: Any
  param_dtype: Any
  zero_centered: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
    scale = self.param('scale', init, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.zero_centered:
      return (x32 * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
    # Cast before scaling, as HF and vLLM do, so bf16 results agree with the sampler's.
    return x32.astype(self.dtype) * scale.astype(self.dtype)


def rms_norm(config, name: str) -> RMSNorm:
  """The model's RMSNorm (its eps, dtypes and convention), named `name`."""
  return RMSNorm(config.rms_norm_eps, config.dtype, config.param_dtype,
                 config.norm_zero_centered, name=name)


def dense(features, use_bias, config, name):
  # nn.Dense, plus a LoRA delta when the variables carry adapters for it (models/layers/lora.py).
  return lora_lib.Dense(features, use_bias=use_bias, dtype=config.dtype,
                        param_dtype=config.param_dtype,
                        kernel_init=nn.initializers.normal(0.02), name=name)


class MLP(nn.Module):
  """SwiGLU of width `width` (None: the model's intermediate_size)."""
  config: Any
  width: int | None = None

  @nn.compact
  def __call__(self, x):
    c = self.config
    width = self.width or c.intermediate_size
    gate = dense(width, False, c, 'gate_proj')(x)
    up = dense(width, False, c, 'up_proj')(x)
    return dense(c.hidden_size, False, c, 'down_proj')(nn.silu(gate) * up)
