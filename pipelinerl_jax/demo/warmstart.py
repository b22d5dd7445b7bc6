"""The CPU demo's starting policy: a tiny Qwen2 model, SFT-warmed on its task, saved as an HF dir.

`build_demo_model(out_dir, demo, task)` random-initializes a small Qwen2 (or, with
`demo.architecture='qwen3'`, Qwen3; 'qwen3_moe', Qwen3-MoE; 'qwen3_5', a Qwen3.5 hybrid;
'qwen3_5_moe', Qwen3.5-MoE) `ModelConfig` over the character tokenizer, imitates a small fixed
set of the task's SFT-pool problems until its sampled accuracy on unseen RL-pool problems
reaches `demo.target_sampled_accuracy` (or the step budget ends), and saves config.json +
model.safetensors + tokenizer files + warmstart.json. The build is cached: warmstart.json carries
a hash of the settings, and a dir whose hash matches is returned at once. RL then starts from a
policy that knows the answer format but gets only a minority of unseen problems right, and has
to earn the rest.

`model_dir_for(config)` is where a run finds its model: config.model.path, or this build.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluation
from pipelinerl_jax import packing
from pipelinerl_jax import train
from pipelinerl_jax.demo import char_tokenizer
from pipelinerl_jax.generation import api as gen_api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer
from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base as tasks_base
from pipelinerl_jax.tasks import registry

STAMP_FILE = 'warmstart.json'
BUILD_VERSION = 2  # bump when the build's code changes what given settings produce
DEFAULT_CACHE = '~/.cache/pipelinerl_jax'


def model_dir_for(config: config_lib.Config) -> str:
  """config.model.path, or the demo model of config.model.demo and config.task, built once into
  the cache (keyed by its settings)."""
  if config.model.path:
    return hf_schema.check_model_dir(config.model.path, 'config.model.path')
  task = registry.make_task(config.task)
  try:
    cache = os.path.expanduser(config.model.cache_dir or DEFAULT_CACHE)
    out = os.path.join(cache, f'demo-{settings_hash(config.model.demo, task)}')
    return str(build_demo_model(out, config.model.demo, task))
  finally:
    task.close()


_ARCHITECTURES = {'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
                  'qwen3_moe': 'Qwen3MoeForCausalLM', 'qwen3_5': 'Qwen3_5ForCausalLM',
                  'qwen3_5_moe': 'Qwen3_5MoeForCausalLM'}


def make_model_config(demo: config_lib.DemoModelConfig, vocab_size: int
                      ) -> transformer.ModelConfig:
  qwen2 = demo.architecture == 'qwen2'
  extra = {}
  if demo.architecture in ('qwen3_moe', 'qwen3_5_moe'):
    extra = dict(num_experts=demo.num_experts, num_experts_per_tok=demo.num_experts_per_tok,
                 moe_intermediate_size=demo.moe_intermediate_size,
                 norm_topk_prob=demo.norm_topk_prob,
                 moe_layers=tuple(i for i in range(demo.num_layers)
                                  if i not in demo.mlp_only_layers))
  if demo.architecture == 'qwen3_5_moe':  # as hf.schema reads a Qwen3_5MoeForCausalLM dir
    extra.update(shared_expert_intermediate_size=demo.shared_expert_intermediate_size,
                 intermediate_size=0)
  if demo.architecture in ('qwen3_5', 'qwen3_5_moe'):  # Qwen3.5's attention, norms, layers
    extra.update(
        attention_output_gate=True, norm_zero_centered=True,
        partial_rotary_factor=0.25,
        linear_layers=tuple(i for i in range(demo.num_layers)
                            if (i + 1) % demo.full_attention_interval),
        linear_num_key_heads=demo.linear_num_key_heads,
        linear_num_value_heads=demo.linear_num_value_heads,
        linear_key_head_dim=demo.linear_key_head_dim,
        linear_value_head_dim=demo.linear_value_head_dim,
        linear_conv_kernel=demo.linear_conv_kernel_dim)
  return transformer.ModelConfig(**{
      **dict(vocab_size=vocab_size, hidden_size=demo.hidden_size,
             intermediate_size=demo.intermediate_size, num_layers=demo.num_layers,
             num_heads=demo.num_heads, num_kv_heads=demo.num_kv_heads, head_dim=demo.head_dim,
             qkv_bias=qwen2, qk_norm=not qwen2, tie_embeddings=demo.tie_embeddings,
             max_position_embeddings=demo.max_position_embeddings,
             architecture=_ARCHITECTURES[demo.architecture]),
      **extra})


_LATER_SETTINGS = {'architecture': 'qwen2', 'tie_embeddings': False}


def settings_hash(demo: config_lib.DemoModelConfig, task: tasks_base.Task) -> str:
  """What a build depends on: the demo settings and the task (a dataclass: its fields). The
  expert fields count only for an MoE model, the linear-attention ones only for a Qwen3.5 or
  Qwen3.5-MoE, the shared expert's only for a Qwen3.5-MoE (another model's hash is what it
  always was)."""
  task_settings = {'task': type(task).__name__, **dataclasses.asdict(task)}
  # Settings added after builds were cached count only away from their defaults, so a Qwen2
  # build made before them is still found.
  demo_settings = {k: v for k, v in dataclasses.asdict(demo).items()
                   if k not in _LATER_SETTINGS or v != _LATER_SETTINGS[k]}
  if demo.architecture not in ('qwen3_moe', 'qwen3_5_moe'):
    demo_settings = {k: v for k, v in demo_settings.items() if k not in demo.MOE_FIELDS}
  if demo.architecture not in ('qwen3_5', 'qwen3_5_moe'):
    demo_settings = {k: v for k, v in demo_settings.items() if k not in demo.HYBRID_FIELDS}
  if demo.architecture != 'qwen3_5_moe':
    demo_settings.pop('shared_expert_intermediate_size', None)
  blob = json.dumps({'build_version': BUILD_VERSION, 'demo': demo_settings,
                     **task_settings}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Tokenizer access that works on a `tokenizers.Tokenizer` and on an HF tokenizer alike.


def encode(tokenizer, text: str) -> list[int]:
  ids = tokenizer.encode(text, add_special_tokens=False)
  return list(getattr(ids, 'ids', ids))  # tokenizers returns an Encoding, HF a list


def eos_id(tokenizer) -> int:
  eos = getattr(tokenizer, 'eos_token_id', None)
  return eos if eos is not None else tokenizer.token_to_id(char_tokenizer.EOS)


# ---------------------------------------------------------------------------------------------
# SFT: pure loss and step over packed rows.


def sft_loss(params, model_config: transformer.ModelConfig, batch) -> tuple[jax.Array, dict]:
  """Mean negative log-likelihood of the completion tokens (loss_mask) of a packed [R, T] batch."""
  logp_RxT, _ = transformer.token_logprobs(params, model_config, batch['tokens'],
                                           batch['targets'], batch['positions'],
                                           batch['segment_ids'])
  mask_RxT = batch['loss_mask']
  num_tokens = jnp.maximum(jnp.sum(mask_RxT), 1.0)
  nll = -jnp.sum(jnp.where(mask_RxT > 0, logp_RxT, 0.0)) / num_tokens
  return nll, {'nll': nll, 'num_tokens': num_tokens}


def make_sft_step(model_config: transformer.ModelConfig,
                  optimizer: optax.GradientTransformation) -> Callable:
  """`sft_step(state, batch) -> (state, metrics)`, pure; jit it with the state donated."""
  grad_fn = jax.value_and_grad(lambda p, b: sft_loss(p, model_config, b), has_aux=True)

  def sft_step(state: train.TrainState, batch):
    (loss, stats), grads = grad_fn(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = train.TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {'loss': loss, 'grad_norm': optax.tree.norm(grads), **stats}

  return sft_step


# An SFT example: (prompt ids, completion ids), or for a multi-turn task (prompt ids, completion
# ids, completion loss mask): 1 on the model's turns and their EOS, 0 on observations.
Example = tuple[list[int], ...]


def encode_examples(tokenizer, task, problems: Sequence[tasks_base.Problem]) -> list[Example]:
  """(prompt ids, target ids + EOS) for each problem; an episode of several turns
  (`task.target_turns`) gives its turns and observations in order, EOS after each model turn,
  and its loss mask."""
  eos = eos_id(tokenizer)
  examples = []
  for p in problems:
    turns = task.target_turns(p)
    if len(turns) == 1:
      examples.append((encode(tokenizer, p.prompt), encode(tokenizer, turns[0]) + [eos]))
      continue
    completion, mask = [], []
    for i, text in enumerate(turns):
      ids = encode(tokenizer, text) + ([eos] if i % 2 == 0 else [])
      completion += ids
      mask += [1 - i % 2] * len(ids)
    examples.append((encode(tokenizer, p.prompt), completion, mask))
  return examples


def pack_examples(examples: Sequence[Example], seq_len: int, num_rows: int
                  ) -> dict[str, np.ndarray]:
  """Packs examples into a fixed [num_rows, seq_len] batch (a fixed shape, so the jitted step
  compiles once); an example's observation tokens are fed but carry no loss."""
  samples = [packing.Sample(prompt_tokens=p, completion_tokens=c,
                            behaviour_logprobs=np.zeros(len(c), np.float32),
                            versions=np.zeros(len(c), np.int32), advantage=0.0,
                            loss_mask=mask[0] if mask else None)
             for p, c, *mask in examples]
  batch, _ = packing.pack_samples(samples, seq_len, num_rows=num_rows)
  return {k: batch[k] for k in ('tokens', 'targets', 'positions', 'segment_ids', 'loss_mask')}


def next_packed_batch(examples: Sequence[Example], stream: Iterator[int],
                      carried: list[int], seq_len: int, num_rows: int, max_examples: int
                      ) -> tuple[dict[str, np.ndarray], list[int]]:
  """The next SFT batch: examples in stream order (`carried` ones first) while they fit the
  [num_rows, seq_len] batch and number at most max_examples. Returns (batch, indices drawn but
  left for the next batch)."""
  picks, budget = [], num_rows * seq_len
  while len(picks) < max_examples:
    i = carried.pop(0) if carried else next(stream)
    positions = len(examples[i][0]) + len(examples[i][1]) - 1
    if positions > budget:
      carried.insert(0, i)
      break
    picks.append(i)
    budget -= positions
  while True:  # the token budget is necessary, not sufficient: first-fit may need one row more
    try:
      return pack_examples([examples[i] for i in picks], seq_len, num_rows), carried
    except ValueError:
      if len(picks) == 1:
        raise
      carried.insert(0, picks.pop())


def _epochs(n: int, rng: np.random.Generator) -> Iterator[int]:
  """Indices 0..n-1 in a fresh shuffled order each epoch, forever."""
  while True:
    yield from (int(i) for i in rng.permutation(n))


def packed_shape(max_example_len: int, batch_size: int) -> tuple[int, int]:
  """(num_rows, seq_len) that always holds `batch_size` examples of up to max_example_len
  tokens (each takes max_example_len - 1 positions)."""
  positions = max_example_len - 1
  seq_len = max(64, positions)
  per_row = seq_len // positions
  return math.ceil(batch_size / per_row), seq_len


# ---------------------------------------------------------------------------------------------
# Evaluation.


def evaluate_accuracy(params, model_config: transformer.ModelConfig, tokenizer, task,
                      problems: Sequence[tasks_base.Problem], temperature: float, *,
                      max_tokens: int | None = None, num_slots: int = 128, seed: int = 0,
                      return_texts: bool = False) -> dict[str, Any]:
  """One completion per problem (temperature 0 = greedy), scored: `evaluation.evaluate` on a
  JAX engine sized for these problems.

  Returns {'accuracy': fraction correct, 'statuses': {status: count}, 'num': N} (+ 'texts').
  """
  prompts = {p.prompt: encode(tokenizer, p.prompt) for p in problems}
  if max_tokens is None:  # room for the longest model turn plus a little slack before 'length'
    max_tokens = max(len(encode(tokenizer, turn)) for p in problems
                     for turn in task.target_turns(p)[::2]) + 4
  max_prompt = max(len(ids) for ids in prompts.values())
  # An episode of several turns holds up to max_episode_tokens after its prompt.
  after_prompt = max(max_tokens, task.max_episode_tokens)
  # A power of two so repeated evaluations (different sets, same sizes) reuse the compiled step.
  max_seq_len = 1 << (max_prompt + after_prompt - 1).bit_length()
  spec = engines.EngineSpec(backend='jax', num_slots=engines.slots_for(len(problems), num_slots),
                            max_seq_len=max_seq_len, eos_token_ids=(eos_id(tokenizer),))
  engine = engines.make_engine(spec, model_config, params=params)
  try:
    result = evaluation.evaluate(
        engine, {'warmstart': list(problems)}, task, encode=lambda p: prompts[p.prompt],
        decode=lambda t: tokenizer.decode(t.tolist(), skip_special_tokens=True),
        sampling=gen_api.SamplingParams(temperature=temperature, max_tokens=max_tokens),
        k=1, seed=seed, encode_text=lambda text: encode(tokenizer, text),
        max_seq_len=max_prompt + after_prompt)
  finally:
    engine.close()
  statuses = collections.Counter(s['status'] for s in result['samples'])
  out = {'accuracy': result['pass@1'], 'num': len(problems),
         'statuses': {k: statuses.get(k, 0) for k in tasks_base.STATUSES}}
  if task.environment() is not None:  # episodes: the share that went past one turn
    out['multi_turn'] = float(np.mean([s['turns'] > 1 for s in result['samples']]))
  if return_texts:
    out['texts'] = [s['completion'] for s in result['samples']]
  return out


# ---------------------------------------------------------------------------------------------
# The build.


def train_sft(params, model_config: transformer.ModelConfig, demo: config_lib.DemoModelConfig,
              tokenizer, task: tasks_base.Task, log: Callable[[str], None] = print
              ) -> tuple[Any, list[dict]]:
  """SFT on the fixed SFT set until sampled accuracy on unseen problems reaches the target or
  max_steps; returns (params, history of evaluations)."""
  sft_set = task.sft_problems(demo.sft_seed, demo.sft_examples)
  examples = encode_examples(tokenizer, task, sft_set)
  eval_set = list(_take(task.problems(demo.eval_seed), demo.eval_problems))
  max_example_len = max(len(p) + len(c) for p, c, *_ in examples)
  num_rows, seq_len = packed_shape(max_example_len, demo.batch_size)
  if demo.rows_per_step:  # first-fit into fewer rows: short examples share a row
    num_rows = demo.rows_per_step

  optimizer = train.make_optimizer(config_lib.OptimizerConfig(
      lr=demo.lr, max_grad_norm=1.0, warmup_steps=demo.warmup_steps))
  state = train.init_train_state(params, optimizer)
  step_fn = jax.jit(make_sft_step(model_config, optimizer), donate_argnums=(0,))
  stream = _epochs(len(examples), np.random.default_rng(demo.sft_seed))
  carried: list[int] = []  # drawn but left out of a full step: first in the next one
  history, start, losses = [], time.perf_counter(), []

  def evaluate(step):
    acc = evaluate_accuracy(state.params, model_config, tokenizer, task, eval_set, 1.0,
                            seed=step)
    loss = float(np.mean(losses)) if losses else float('nan')
    history.append({'step': step, 'loss': loss, 'sampled_accuracy': acc['accuracy'],
                    'statuses': acc['statuses'], 'seconds': time.perf_counter() - start,
                    **({'multi_turn': acc['multi_turn']} if 'multi_turn' in acc else {})})
    turns = f'  multi-turn {acc["multi_turn"]:.2f}' if 'multi_turn' in acc else ''
    log(f'[warmstart] step {step:5d}  loss {loss:.3f}  sampled acc {acc["accuracy"]:.3f}  '
        f'{acc["statuses"]}{turns}  {time.perf_counter() - start:.0f}s')
    losses.clear()
    return acc['accuracy']

  step = 0
  while step < demo.max_steps:
    batch, carried = next_packed_batch(examples, stream, carried, seq_len, num_rows,
                                       demo.batch_size)
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics['loss']))
    step += 1
    if step % demo.eval_every == 0 and evaluate(step) >= demo.target_sampled_accuracy:
      break
  else:
    if not history or history[-1]['step'] != step:
      evaluate(step)
  return state.params, history


def build_demo_model(out_dir: str | os.PathLike,
                     demo: config_lib.DemoModelConfig = config_lib.DemoModelConfig(),
                     task: tasks_base.Task | None = None,
                     log: Callable[[str], None] = print) -> Path:
  """Builds (or finds cached) the warm-started demo model in out_dir; returns out_dir. `task`
  defaults to the default arithmetic task."""
  task = task or arithmetic.ArithmeticTask()
  out_dir = Path(out_dir)
  digest = settings_hash(demo, task)
  if (read_stamp(out_dir).get('settings_hash') == digest and
      (out_dir / hf_checkpoint.SINGLE_FILE).exists()):
    return out_dir

  start = time.perf_counter()
  log(f'[warmstart] building the demo model in {out_dir} (settings {digest})')
  tok = char_tokenizer.build_char_tokenizer()
  model_config = make_model_config(demo, tok.get_vocab_size())
  params = transformer.init_params(model_config, jax.random.PRNGKey(demo.init_seed))
  log(f'[warmstart] {model_config.num_params:,} params; SFT on {demo.sft_examples} examples')
  params, history = train_sft(params, model_config, demo, tok, task, log)
  eval_set = list(_take(task.problems(demo.eval_seed), demo.eval_problems))
  greedy = evaluate_accuracy(params, model_config, tok, task, eval_set, 0.0)
  log(f'[warmstart] done in {time.perf_counter() - start:.0f}s: greedy acc '
      f'{greedy["accuracy"]:.3f}, sampled acc {history[-1]["sampled_accuracy"]:.3f}')

  # Everything goes into a temp dir first; the rename makes a finished build appear at once, so
  # a crash never leaves a dir that looks complete.
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.parent / f'.{out_dir.name}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  ids = char_tokenizer.special_token_ids(tok)
  hf_checkpoint.save_params(params, model_config, tmp, dtype='float32',
                    extra_config={**ids, 'bos_token_id': None})
  char_tokenizer.save_tokenizer(tok, tmp, model_max_length=demo.max_position_embeddings)
  (tmp / 'generation_config.json').write_text(json.dumps(ids, indent=2) + '\n')
  stamp = {'settings_hash': digest, 'settings': dataclasses.asdict(demo),
           'task': {'name': type(task).__name__, **dataclasses.asdict(task)},
           'sft_steps': history[-1]['step'], 'greedy_accuracy': greedy['accuracy'],
           'sampled_accuracy': history[-1]['sampled_accuracy'], 'history': history,
           'build_seconds': time.perf_counter() - start}
  (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + '\n')
  old = out_dir.parent / f'.{out_dir.name}.old-{os.getpid()}'
  if out_dir.exists():
    out_dir.rename(old)
  tmp.rename(out_dir)
  shutil.rmtree(old, ignore_errors=True)
  return out_dir


def read_stamp(model_dir: str | os.PathLike) -> dict:
  """warmstart.json of a finished build ({} when absent or unreadable)."""
  try:
    return json.loads((Path(model_dir) / STAMP_FILE).read_text())
  except (OSError, ValueError):
    return {}


def _take(it, n):
  for _, x in zip(range(n), it):
    yield x
