"""The kit's sections, in the order they run: the one place a section is registered.

A section is a module with `run(s)`, which records its items on `s` (a section.Section: `s.add`,
`s.skip`, `s.fail`, each saved as it ends) within `s.remaining()` seconds, and `describe(item)`,
an ok item's table cell. Registering it here gives it its `--sections` name, its own process with
a share of the time budget, its rows in the table and its record in the JSON:

  SectionSpec('name', module.run, module.describe, weight=4.0, default=False)

The section's sizes for each preset go in presets.py (or, as vllm's, chosen by `s.args.quick`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from pipelinerl_jax.bench.gpu import collective
from pipelinerl_jax.bench.gpu import e2e
from pipelinerl_jax.bench.gpu import engine
from pipelinerl_jax.bench.gpu import env
from pipelinerl_jax.bench.gpu import gated_delta
from pipelinerl_jax.bench.gpu import lora
from pipelinerl_jax.bench.gpu import moe_layer
from pipelinerl_jax.bench.gpu import one_gpu
from pipelinerl_jax.bench.gpu import publish
from pipelinerl_jax.bench.gpu import section as section_lib
from pipelinerl_jax.bench.gpu import train
from pipelinerl_jax.bench.gpu import vllm

MEM_FRACTION = '0.90'        # of the device, for a section's process: each is alone on it


class SectionSpec(NamedTuple):
  name: str
  run: Callable[[section_lib.Section], None]
  describe: Callable[[dict[str, Any]], str]
  # Its share of the time budget, against the sections run after it (unused time passes on).
  weight: float
  default: bool = True          # run when --sections is not given; False: only when named
  cpu_devices: int = 1          # simulated CPU devices of its process (ignored on a GPU)
  mem_fraction: str = MEM_FRACTION


SECTIONS: dict[str, SectionSpec] = {spec.name: spec for spec in (
    SectionSpec('env', env.run, env.describe, weight=2.0),
    # The largest variants ask for more of the device (1.5B without remat: XLA's compiled peak
    # 69 GiB on an 80 GB H100).
    SectionSpec('train', train.run, train.describe, weight=9.0, mem_fraction='0.95'),
    SectionSpec('engine', engine.run, engine.describe, weight=6.0),
    # Its mesh case needs several devices to put more than one shard in play on CPU.
    SectionSpec('publish', publish.run, publish.describe, weight=2.0, cpu_devices=4),
    SectionSpec('e2e', e2e.run, e2e.describe, weight=6.0),
    # vLLM is not on the GPU image until tools/gpu_stage.py has brought it there.
    SectionSpec('vllm', vllm.run, vllm.describe, weight=8.0, default=False),
    # NCCL needs vLLM's communicator: after tools/gpu_stage.py, as vllm.
    SectionSpec('collective', collective.run, collective.describe, weight=3.0, default=False),
    # A one-GPU preset's short run on random weights of its shapes (one_gpu.PRESET_MODELS), each
    # in its own process, so that the device's peak is that preset's.
    SectionSpec('qwen3_1xgpu', one_gpu.runner_for('qwen3_1p7b_1xgpu'), one_gpu.describe,
                weight=6.0, default=False),
    SectionSpec('lora_1xgpu', one_gpu.runner_for('qwen3_8b_lora_1xgpu'), one_gpu.describe,
                weight=6.0, default=False),
    SectionSpec('qwen3_5_1xgpu', one_gpu.runner_for('qwen3_5_2b_1xgpu'), one_gpu.describe,
                weight=6.0, default=False),
    # Adapter updates against full ones, and decode with adapters (bench/lora.py's processes).
    SectionSpec('lora', lora.run, lora.describe, weight=4.0, default=False),
    # One MoE layer's grouped matmul against the dense reference (bench/moe_layer.py's).
    SectionSpec('moe_layer', moe_layer.run, moe_layer.describe, weight=2.0, default=False),
    # One Qwen3.5 Gated DeltaNet layer, chunked, forward and backward (bench/gated_delta.py's).
    SectionSpec('gated_delta', gated_delta.run, gated_delta.describe, weight=2.0,
                default=False),
)}
DEFAULT_SECTIONS = tuple(name for name, spec in SECTIONS.items() if spec.default)
OPTIONAL_SECTIONS = tuple(name for name, spec in SECTIONS.items() if not spec.default)
