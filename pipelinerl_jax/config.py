"""Every knob of a run, with its default, in one place; and the checks that reject bad values.

Experiment files in configs/ start from `base_config()` and change what they need, so a typo
in a key is an error (the key is not in the base) instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib

import ml_collections

from pipelinerl_jax import losses
from pipelinerl_jax import train
from pipelinerl_jax import warmstart
from pipelinerl_jax.tasks import math as math_task

MATH_CONFIG = pathlib.Path(__file__).resolve().parent.parent / 'configs' / 'math.py'
TASK_KEYS = ('ops', 'digits', 'sft_pool_mod')  # shared by the arithmetic task and the demo build
TASKS = ('arithmetic', 'math')
# Fields whose value is a tuple: the type of their items (a tuple default says nothing when empty).
SEQUENCE_ITEM_TYPES = {'task.ops': str, 'task.train_files': str, 'task.train_weights': float,
                       'task.test_files': str}


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.path = ''               # HF dir (config.json + safetensors); '' = build the demo model
  c.model.cache_dir = ''          # where the demo model is built once ('' = ~/.cache/pipelinerl_jax)
  c.model.param_dtype = 'float32'
  c.model.dtype = 'float32'       # compute dtype ('bfloat16' on GPUs)
  c.model.lm_head_fp32 = True
  c.model.remat = False
  # Attention over packed training rows: 'blockwise' (flash-style, memory linear in
  # train.seq_len) or 'dense' (the [T, T] score tensor per head). Generation is unaffected.
  c.model.attention = 'blockwise'
  c.model.attention_block_q = 1024
  c.model.attention_block_kv = 1024

  # Settings of the demo model built when model.path is '' (see warmstart.WarmStartConfig);
  # its task settings come from `task` below, so SFT and RL see the same problem family.
  demo = dataclasses.asdict(warmstart.WarmStartConfig())
  c.model.demo = ml_collections.ConfigDict(
      {k: v for k, v in demo.items() if k not in TASK_KEYS})

  c.task = ml_collections.ConfigDict()
  c.task.name = 'arithmetic'
  c.task.ops = ('+',)
  c.task.digits = 2
  c.task.sft_pool_mod = 8
  # task.name = 'math' (tasks/math.py): problems from local .jsonl / .json / .parquet files.
  c.task.train_files = ()         # paths; each is a dataset of the training mix
  c.task.train_weights = ()       # one weight per train file (draw probability); () = equal
  c.task.test_files = ()          # held-out sets for evaluation, one dataset each
  c.task.test_fraction = 0.0      # without test_files: this fraction of each train file is held
                                  # out (split by problem text, seed 0) as its test set
  c.task.problem_field = ''       # '' = first present of problem / question / prompt
  c.task.answer_field = ''        # '' = first present of answer / final_answer / solution
  c.task.reward = ml_collections.ConfigDict(vars(math_task.RewardConfig()))
  c.task.verify_timeout_s = 5.0   # hard limit per sample in the math-verify worker pool
  c.task.verify_workers = 2       # math-verify processes

  c.generation = ml_collections.ConfigDict()
  c.generation.backend = 'jax'    # 'jax' (in-process JAX engine) | 'vllm' (in-process vLLM)
                                  # | 'vllm_process' (vLLM in a child process, shared-memory weights)
  c.generation.vllm_kv_cache_mb = 256  # vLLM on CPU needs its KV cache size given
  c.generation.num_generators = 1 # vllm_process: generator processes (one per GPU / TP group);
                                  # each holds ceil(num_slots / num_generators) sequences
  c.generation.max_restarts = 3   # vllm_process: dead generators replaced before the run fails
  c.generation.generator_devices = ''  # vllm_process: GPU ids (as CUDA_VISIBLE_DEVICES names
                                  # them) split evenly among the generators, e.g. '4,5,6,7';
                                  # '' = the GPUs the train mesh leaves free (none on CPU)
  c.generation.weight_transport = 'shm'  # vllm_process: 'shm' (shared memory) | 'nccl' (CUDA:
                                  # broadcast from the trainer's GPU) | 'gloo' (CPU, same protocol)
  c.generation.transport_timeout_s = 120.0  # nccl/gloo: joining the group, one weight update
  c.generation.num_slots = 64     # H: sequences in flight
  c.generation.max_prompt_len = 32
  c.generation.max_new_tokens = 16
  c.generation.temperature = 1.0
  c.generation.top_p = 1.0
  c.generation.top_k = 0
  c.generation.recompute_kv = False   # paper default keeps the stale KV cache (section 5.1)

  c.rl = ml_collections.ConfigDict()
  c.rl.mode = 'pipeline'          # 'pipeline' | 'conventional'
  c.rl.batch_size = 64            # B samples per optimizer step (B / group_size prompts)
  c.rl.group_size = 8             # samples per prompt; advantages are relative to the group
  c.rl.max_lag = 4                # pipeline mode: backpressure + hard bound, in optimizer steps
  c.rl.conventional_steps = 1     # conventional mode: optimizer steps per generated batch
  c.rl.total_steps = 200
  c.rl.max_time_s = 0.0           # stop RL after this many seconds (0 = only total_steps)

  c.advantage = ml_collections.ConfigDict()
  c.advantage.baseline = 'mean'   # 'mean' (paper) | 'loo' | 'none'
  c.advantage.normalize_std = False
  c.advantage.drop_zero_groups = False

  c.loss = ml_collections.ConfigDict(vars(losses.LossConfig()))
  c.optimizer = ml_collections.ConfigDict(vars(train.OptimizerConfig()))

  c.train = ml_collections.ConfigDict()
  c.train.seq_len = 256           # packed row length
  c.train.micro_batches = 1       # gradient-accumulation steps per optimizer step
  c.train.micro_batch_rows = 0    # > 0: packed rows per micro-batch on each data-parallel shard
                                  # instead (what bounds activation memory); the number of
                                  # micro-batches then follows the batch (a power of two)
  c.train.mesh = '1,-1,1'         # data,fsdp,tensor sizes; -1 = the remaining devices
  c.train.overlong = 'error'      # 'error' | 'truncate' (counted) for samples longer than seq_len

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.dir = ''           # orbax checkpoints ('' = <workdir>/checkpoints)
  c.checkpoint.every_steps = 100  # also saved at exit (end, Ctrl-C, time budget); 0 = only then
  c.checkpoint.keep = 3           # the last k checkpoints are kept
  c.checkpoint.resume = True      # continue from the latest checkpoint in dir, if there is one

  # Periodic evaluation on held-out problems (evaluate.py), logged into the metrics as
  # eval/pass@1 and eval/pass@<k>; the same function backs `python -m pipelinerl_jax.evaluate`.
  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 0          # 0 = off
  c.eval.num_problems = 64        # per dataset (0 = all of it)
  c.eval.k = 4                    # samples per problem, for pass@k (pass@1 is their mean)
  c.eval.temperature = 1.0
  c.eval.seed = 10_000

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True
  c.log.progress = True
  return c


def load_preset(name: str = 'tiny', path: str | pathlib.Path = MATH_CONFIG
                ) -> ml_collections.ConfigDict:
  """`get_config(name)` of an experiment file (what `--config=path:name` gives `main`), loaded
  by path: configs/ is not a package. For notebooks, benchmarks and tests."""
  spec = importlib.util.spec_from_file_location('experiment_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(name)


def _paths(cfg, prefix=''):
  for k, v in cfg.items():
    path = f'{prefix}{k}'
    if isinstance(v, ml_collections.ConfigDict):
      yield from _paths(v, path + '.')
    else:
      yield path, v


def _check(ok: bool, key: str, message: str):
  if not ok:
    raise ValueError(f'config.{key}: {message}')


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first unknown key or invalid value."""
  known = dict(_paths(base_config()))
  for path, value in _paths(config):
    _check(path in known, path, 'unknown key')
    default = known[path]
    if isinstance(default, bool):
      _check(isinstance(value, bool), path, f'must be true/false, got {value!r}')
    elif isinstance(default, int):
      _check(isinstance(value, int) and not isinstance(value, bool), path,
             f'must be an integer, got {value!r}')
    elif isinstance(default, float):
      _check(isinstance(value, (int, float)) and not isinstance(value, bool)
             and not math.isnan(value), path, f'must be a number, got {value!r}')
    elif isinstance(default, str):
      _check(isinstance(value, str), path, f'must be a string, got {value!r}')
    elif isinstance(default, tuple):
      item = SEQUENCE_ITEM_TYPES[path]
      ok = isinstance(value, (tuple, list)) and all(
          isinstance(v, str) if item is str else
          isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
      _check(ok, path, f'must be a tuple of {item.__name__}s, got {value!r}')

  g, rl, tr = config.generation, config.rl, config.train
  _check(config.task.name in TASKS, 'task.name',
         f'unknown task {config.task.name!r} (known: {", ".join(TASKS)})')
  if config.task.name == 'math':
    _validate_math(config)
  ev = config.eval
  _check(ev.every_steps >= 0, 'eval.every_steps', f'must be >= 0 (0 = off), got {ev.every_steps}')
  _check(ev.num_problems >= 0, 'eval.num_problems', f'must be >= 0, got {ev.num_problems}')
  _check(ev.k >= 1, 'eval.k', f'must be >= 1, got {ev.k}')
  _check(ev.temperature >= 0, 'eval.temperature', f'must be >= 0, got {ev.temperature}')
  _check(ev.num_problems >= 1 or config.task.name == 'math', 'eval.num_problems',
         'must be >= 1 for an endless problem stream (0 = whole test sets is for math)')
  _check(g.backend in ('jax', 'vllm', 'vllm_process'), 'generation.backend',
         f"must be 'jax', 'vllm' or 'vllm_process', got {g.backend!r}")
  _check(g.backend == 'jax' or not g.recompute_kv, 'generation.recompute_kv',
         'is only implemented by the JAX engine')
  _check(g.num_slots >= 1, 'generation.num_slots', f'H must be >= 1, got {g.num_slots}')
  _check(g.num_generators >= 1, 'generation.num_generators',
         f'must be >= 1, got {g.num_generators}')
  _check(g.num_generators == 1 or g.backend == 'vllm_process', 'generation.num_generators',
         f"{g.num_generators} generators need backend 'vllm_process', not {g.backend!r}")
  _check(-(-g.num_slots // g.num_generators) >= rl.group_size, 'generation.num_generators',
         f'{g.num_generators} generators leave each fewer than rl.group_size={rl.group_size} '
         f'of num_slots={g.num_slots}: a group must fit in one generator')
  _check(g.max_restarts >= 0, 'generation.max_restarts', f'must be >= 0, got {g.max_restarts}')
  _check(g.weight_transport in ('shm', 'nccl', 'gloo'), 'generation.weight_transport',
         f"must be 'shm', 'nccl' or 'gloo', got {g.weight_transport!r}")
  _check(g.weight_transport == 'shm' or g.backend == 'vllm_process', 'generation.weight_transport',
         f"{g.weight_transport!r} needs backend 'vllm_process', not {g.backend!r}")
  _check(g.transport_timeout_s > 0, 'generation.transport_timeout_s',
         f'must be > 0, got {g.transport_timeout_s}')
  ids = [s.strip() for s in g.generator_devices.split(',')] if g.generator_devices.strip() else []
  _check(all(s.isdigit() for s in ids) and len(set(ids)) == len(ids),
         'generation.generator_devices',
         f"must be distinct GPU ids like '4,5,6,7' ('' = automatic), got {g.generator_devices!r}")
  _check(not ids or g.backend == 'vllm_process', 'generation.generator_devices',
         f"needs backend 'vllm_process', not {g.backend!r}")
  _check(len(ids) % g.num_generators == 0, 'generation.generator_devices',
         f'{len(ids)} GPUs do not split evenly among generation.num_generators={g.num_generators}')
  _check(g.num_slots >= rl.group_size, 'generation.num_slots',
         f'H={g.num_slots} must hold at least one group (rl.group_size={rl.group_size})')
  _check(g.max_prompt_len >= 1, 'generation.max_prompt_len', 'must be >= 1')
  _check(g.max_new_tokens >= 1, 'generation.max_new_tokens', 'must be >= 1')
  _check(g.temperature >= 0, 'generation.temperature', f'must be >= 0, got {g.temperature}')
  _check(0 < g.top_p <= 1, 'generation.top_p', f'must be in (0, 1], got {g.top_p}')
  _check(g.top_k >= 0, 'generation.top_k', f'must be >= 0, got {g.top_k}')
  _check(rl.mode in ('pipeline', 'conventional'), 'rl.mode',
         f"must be 'pipeline' or 'conventional', got {rl.mode!r}")
  _check(rl.group_size >= 1, 'rl.group_size', f'must be >= 1, got {rl.group_size}')
  _check(rl.batch_size >= 1 and rl.batch_size % rl.group_size == 0, 'rl.batch_size',
         f'B={rl.batch_size} must be a positive multiple of rl.group_size={rl.group_size}')
  _check(rl.max_lag >= 0, 'rl.max_lag', f'must be >= 0, got {rl.max_lag}')
  _check(rl.conventional_steps >= 1, 'rl.conventional_steps', 'must be >= 1')
  _check(rl.total_steps >= 1, 'rl.total_steps', f'must be >= 1, got {rl.total_steps}')
  _check(rl.max_time_s >= 0, 'rl.max_time_s', 'must be >= 0')
  _check(config.advantage.baseline in ('mean', 'loo', 'none'), 'advantage.baseline',
         f"must be 'mean', 'loo' or 'none', got {config.advantage.baseline!r}")
  m = config.model
  _check(m.attention in ('dense', 'blockwise'), 'model.attention',
         f"must be 'dense' or 'blockwise', got {m.attention!r}")
  for key in ('attention_block_q', 'attention_block_kv'):
    _check(m[key] >= 1, f'model.{key}', f'must be >= 1, got {m[key]}')
  _check(tr.micro_batches >= 1, 'train.micro_batches', 'must be >= 1')
  _check(tr.micro_batch_rows >= 0, 'train.micro_batch_rows', 'must be >= 0 (0 = off)')
  _check(tr.micro_batch_rows == 0 or tr.micro_batches == 1, 'train.micro_batch_rows',
         f'set it or train.micro_batches (={tr.micro_batches}), not both')
  _check(tr.overlong in ('error', 'truncate'), 'train.overlong', "must be 'error' or 'truncate'")
  _check(config.checkpoint.every_steps >= 0, 'checkpoint.every_steps',
         f'must be >= 0, got {config.checkpoint.every_steps}')
  _check(config.checkpoint.keep >= 1, 'checkpoint.keep',
         f'must be >= 1, got {config.checkpoint.keep}')
  longest = g.max_prompt_len + g.max_new_tokens - 1
  _check(tr.seq_len >= longest, 'train.seq_len',
         f'{tr.seq_len} < max_prompt_len + max_new_tokens - 1 = {longest}: samples would not fit')
  try:
    sizes = [int(s) for s in tr.mesh.split(',')]
  except ValueError:
    sizes = []
  _check(len(sizes) == 3 and all(s >= 1 or s == -1 for s in sizes), 'train.mesh',
         f"must be 'data,fsdp,tensor' sizes like '1,-1,1', got {tr.mesh!r}")
  for section, make in (('loss', lambda: losses.LossConfig(**config.loss.to_dict())),
                        ('optimizer', lambda: train.OptimizerConfig(**config.optimizer.to_dict())),
                        ('model.demo', lambda: demo_config(config))):
    try:
      make()
    except ValueError as e:
      raise ValueError(f'config.{section}: {e}') from None


def _validate_math(config: ml_collections.ConfigDict) -> None:
  t = config.task
  _check(bool(config.model.path), 'model.path',
         "is empty: task 'math' needs a model directory (the demo model only knows arithmetic)")
  _check(len(t.train_files) > 0 and all(t.train_files), 'task.train_files',
         "task 'math' needs at least one training file (.jsonl, .json or .parquet)")
  _check(all(t.test_files), 'task.test_files', 'holds an empty path')
  _check(not t.train_weights or len(t.train_weights) == len(t.train_files), 'task.train_weights',
         f'has {len(t.train_weights)} weights for {len(t.train_files)} train files')
  _check(all(w > 0 for w in t.train_weights), 'task.train_weights',
         f'must all be > 0, got {tuple(t.train_weights)}')
  _check(0 <= t.test_fraction < 1, 'task.test_fraction',
         f'must be in [0, 1), got {t.test_fraction}')
  _check(t.verify_timeout_s > 0, 'task.verify_timeout_s', f'must be > 0, got {t.verify_timeout_s}')
  _check(t.verify_workers >= 1, 'task.verify_workers', f'must be >= 1, got {t.verify_workers}')
  _check(config.eval.every_steps == 0 or t.test_files or t.test_fraction > 0, 'eval.every_steps',
         "needs held-out problems: set task.test_files or task.test_fraction for task 'math'")
  try:
    math_task.RewardConfig(**t.reward.to_dict())
  except ValueError as e:
    raise ValueError(f'config.task.reward: {e}') from None


def demo_config(config: ml_collections.ConfigDict) -> warmstart.WarmStartConfig:
  return warmstart.WarmStartConfig(**config.model.demo.to_dict(),
                                   **{k: config.task[k] for k in TASK_KEYS})
