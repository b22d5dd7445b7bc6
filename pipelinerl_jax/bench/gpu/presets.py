"""The kit's sizes: `--preset=full` (the default), `short` and `quick` (toy sizes, CPU), the
train section's grid of variants, and the vllm section's sizes (full, or quick with --quick)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class TrainVariant(NamedTuple):
  """One train-step measurement of the grid: a model preset and its numerics."""
  model: str
  attention: str           # models/layers/attention.py: 'cudnn' | 'blockwise' | 'dense'
  remat: str               # 'none' or a transformer.REMAT_POLICIES name
  lm_head: str             # 'fp32' (an fp32 matmul) | 'dtype' (bf16, fp32 accumulation)
  micro: int               # micro-batches of the step: rows per micro-batch = rows / micro
  profile: bool = False    # trace one more step: the kernel time by part

  @property
  def name(self) -> str:
    return (f'{self.model} {self.attention} remat={self.remat} head={self.lm_head} '
            f'micro={self.micro}')


# What the H100 runs of 2026-11-26 left unknown, most telling first, so that a section cut short
# keeps them (each one's prediction, and what was measured: docs/dev/attention-2026-11-26.md).
TRAIN_GRID = (
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'none', 'dtype', 8),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'none', 'dtype', 8),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'dots', 'dtype', 8),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'dots', 'dtype', 4),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'full', 'dtype', 2),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'dots', 'dtype', 4),
    TrainVariant('qwen2.5-1.5b', 'cudnn', 'full', 'dtype', 8, profile=True),
    TrainVariant('qwen2.5-0.5b', 'cudnn', 'full', 'dtype', 8, profile=True),
)
QUICK_TRAIN_GRID = (  # every code path once (cuDNN's is skipped off a GPU)
    TrainVariant('tiny', 'blockwise', 'attention', 'dtype', 2, profile=True),
    TrainVariant('tiny', 'cudnn', 'full', 'dtype', 2),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
  train_grid: tuple[TrainVariant, ...]  # the train step's variants, in this order
  train_rows: int                 # packed rows per optimizer step
  train_seq_len: int
  train_steps: int
  engine_model: str
  engine_slots: tuple[int, ...]   # H values
  prompt_len: int
  new_tokens: int
  publish_models: tuple[str, ...]
  repeats: int                    # timed repetitions of the short measurements
  matmul_n: int                   # the bf16 matmul probe is n x n x n
  copy_mib: int                   # the device-copy probe moves this many MiB
  e2e_rl_s: float                 # RL wall-clock cap of the end-to-end run (0 = steps only)
  e2e_steps: int                  # and its step cap
  budget_s: float
  # Run when --sections is not given, in this order; () = the registry's default sections.
  sections: tuple[str, ...] = ()
  e2e_presets: tuple[str, ...] = ('tiny', 'reasoning')
  collective_models: tuple[str, ...] = ('qwen2.5-0.5b', 'qwen2.5-1.5b')  # updates sent whole
  one_gpu_steps: int = 3          # the one-GPU preset sections' step cap,
  one_gpu_new_tokens: int = 1024  # and their generation.max_new_tokens (0: the preset's)
  # The lora section: sizes (bench/lora.py's), rank, and its decode workload and repeats.
  lora_sizes: tuple[str, ...] = ('1.5b', '8b')
  lora_rank: int = 32             # qwen3_8b_lora_1xgpu's
  lora_requests: int = 256
  lora_new_tokens: int = 128
  lora_repeats: int = 3
  # The moe_layer section: the expert axis's sizes it runs one device's share of (1: whole).
  moe_expert_splits: tuple[int, ...] = (1, 4)
  # The gated_delta section: the Qwen3.5 shapes of bench/gated_delta.py ('quick': its toy one).
  gated_delta_shapes: tuple[str, ...] = ('2b', '9b')


FULL = Sizes(train_grid=TRAIN_GRID, train_rows=8, train_seq_len=8192, train_steps=3,
             engine_model='qwen2.5-0.5b', engine_slots=(64, 256, 512), prompt_len=256,
             new_tokens=1024, publish_models=('qwen2.5-0.5b', 'qwen2.5-1.5b'), repeats=10,
             matmul_n=8192, copy_mib=1024, e2e_rl_s=45.0, e2e_steps=100_000, budget_s=510.0)
# About 3 minutes: a fix checked on the sizes that matter most.
SHORT = dataclasses.replace(FULL, train_grid=(TRAIN_GRID[0], TRAIN_GRID[6]), engine_slots=(256,),
                            publish_models=('qwen2.5-0.5b',), budget_s=180.0,
                            sections=('env', 'train', 'engine', 'publish'))
QUICK = Sizes(train_grid=QUICK_TRAIN_GRID, train_rows=4, train_seq_len=64,
              train_steps=2, engine_model='tiny', engine_slots=(2, 4), prompt_len=8,
              new_tokens=8, publish_models=('tiny',), repeats=3, matmul_n=256, copy_mib=4,
              e2e_rl_s=0.0, e2e_steps=3, budget_s=300.0, e2e_presets=('tiny',),
              collective_models=('tiny',), one_gpu_steps=2, one_gpu_new_tokens=16,
              lora_sizes=('quick',), lora_rank=8, lora_requests=4, lora_new_tokens=8,
              lora_repeats=2, moe_expert_splits=(1, 2), gated_delta_shapes=('quick',))
PRESETS = dict(full=FULL, short=SHORT, quick=QUICK)


@dataclasses.dataclass(frozen=True)
class VllmSizes:
  """The vllm section's sizes (its parts: vllm.py)."""
  model: str                      # the served model: bench.train_step preset, or 'quick'
  update_models: tuple[str, ...]  # the update part's models
  slots: tuple[int, ...]          # H values of the decode items
  prompt_len: int                 # decode items (the engine section's shapes)
  new_tokens: int
  check_requests: int             # the stepped check: requests of each kind,
  check_prompt_len: int
  check_tokens: int               # tokens each,
  check_update_at: int            # the update applied before this token step
  repeats: int                    # timed weight updates
  e2e_rl_s: float
  e2e_steps: int                  # 0: no e2e part


VLLM_FULL = VllmSizes(model='qwen2.5-0.5b', update_models=('qwen2.5-1.5b',), slots=(64, 256),
                      prompt_len=256, new_tokens=1024, check_requests=8, check_prompt_len=32,
                      check_tokens=48, check_update_at=16, repeats=5, e2e_rl_s=60.0,
                      e2e_steps=100_000)
# --quick leaves out the e2e part (40 s here; vLLM in a run is tests/reward_test.py's).
VLLM_QUICK = VllmSizes(model='quick', update_models=('quick',), slots=(2, 4), prompt_len=8,
                       new_tokens=8, check_requests=2, check_prompt_len=8, check_tokens=8,
                       check_update_at=3, repeats=2, e2e_rl_s=0.0, e2e_steps=0)

