"""The CPU demo's starting policy: a tiny Qwen2 model, SFT-warmed on arithmetic, saved as an HF dir.

`build_demo_model(out_dir, cfg)` random-initializes a small Qwen2 `ModelConfig` over the
character tokenizer, imitates a small fixed set of SFT-pool problems (`tasks.arithmetic`) until
its sampled accuracy on unseen RL-pool problems reaches `cfg.target_sampled_accuracy` (or the
step budget ends), and saves config.json + model.safetensors + tokenizer files + warmstart.json.
The build is cached: warmstart.json carries a hash of the settings, and a dir whose hash matches
is returned at once. RL then starts from a policy that knows the answer format but gets only a
minority of unseen problems right, and has to earn the rest.

`evaluate_accuracy` (greedy with temperature 0, sampled otherwise) runs the generation engine;
the demo and the tests reuse it.
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
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipelinerl_jax import packing
from pipelinerl_jax import train
from pipelinerl_jax.generation import api as gen_api
from pipelinerl_jax.generation import jax_engine as gen_engine
from pipelinerl_jax.demo import char_tokenizer
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models import transformer
from pipelinerl_jax.tasks import arithmetic
from pipelinerl_jax.tasks import base as tasks_base

STAMP_FILE = 'warmstart.json'
BUILD_VERSION = 1  # bump when the build's code changes what a given config produces


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  # Model. head_dim must be 32 or 64 for vLLM's CPU attention.
  hidden_size: int = 64
  intermediate_size: int = 256
  num_layers: int = 2
  num_heads: int = 2
  num_kv_heads: int = 2
  head_dim: int = 32
  max_position_embeddings: int = 128
  init_seed: int = 0
  # Task (the RL phase must build the same task: `make_task(cfg)`).
  ops: tuple[str, ...] = ('+',)
  digits: int = 2
  sft_pool_mod: int = 8
  # SFT.
  sft_examples: int = 1000       # the fixed supervised set, from the SFT pool
  sft_seed: int = 0
  batch_size: int = 128
  lr: float = 1e-3
  max_steps: int = 2000
  eval_every: int = 25
  eval_problems: int = 128       # unseen RL-pool problems, sampled at temperature 1
  eval_seed: int = 10_000
  target_sampled_accuracy: float = 0.3

  def __post_init__(self):
    object.__setattr__(self, 'ops', tuple(self.ops))
    if self.head_dim not in (32, 64):
      raise ValueError(f'head_dim={self.head_dim}: vLLM on CPU supports 32 or 64 for a tiny model')
    if self.max_steps < 0 or self.eval_every < 1 or self.batch_size < 1:
      raise ValueError('need max_steps >= 0, eval_every >= 1, batch_size >= 1')

  @classmethod
  def from_mapping(cls, cfg: Mapping[str, Any] | 'WarmStartConfig') -> 'WarmStartConfig':
    """Accepts the dataclass, a dict or an ml_collections.ConfigDict (unknown keys raise)."""
    if isinstance(cfg, cls):
      return cfg
    d = cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)
    return cls(**d)


def make_task(cfg: WarmStartConfig) -> arithmetic.ArithmeticTask:
  return arithmetic.ArithmeticTask(ops=cfg.ops, digits=cfg.digits, sft_pool_mod=cfg.sft_pool_mod)


def make_model_config(cfg: WarmStartConfig, vocab_size: int) -> transformer.ModelConfig:
  return transformer.ModelConfig(
      vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
      num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, qkv_bias=True, max_position_embeddings=cfg.max_position_embeddings,
      architecture='Qwen2ForCausalLM')


def settings_hash(cfg: WarmStartConfig) -> str:
  blob = json.dumps({'build_version': BUILD_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
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


def encode_examples(tokenizer, task, problems: Sequence[tasks_base.Problem]
                    ) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, target ids + EOS) for each problem."""
  eos = eos_id(tokenizer)
  return [(encode(tokenizer, p.prompt), encode(tokenizer, task.target(p)) + [eos])
          for p in problems]


def pack_examples(examples: Sequence[tuple[list[int], list[int]]], seq_len: int, num_rows: int
                  ) -> dict[str, np.ndarray]:
  """Packs (prompt, completion) pairs into a fixed [num_rows, seq_len] batch (a fixed shape, so
  the jitted step compiles once)."""
  samples = [packing.Sample(prompt_tokens=p, completion_tokens=c,
                            behaviour_logprobs=np.zeros(len(c), np.float32),
                            versions=np.zeros(len(c), np.int32), advantage=0.0)
             for p, c in examples]
  batch, _ = packing.pack_samples(samples, seq_len, num_rows=num_rows)
  return {k: batch[k] for k in ('tokens', 'targets', 'positions', 'segment_ids', 'loss_mask')}


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
  """Generates one completion per problem (temperature 0 = greedy) and scores it.

  Returns {'accuracy': mean reward, 'statuses': {status: count}, 'num': N} (+ 'texts').
  Request i uses seed `seed + i`, so a sampled evaluation is reproducible.
  """
  prompts = [encode(tokenizer, p.prompt) for p in problems]
  if max_tokens is None:  # room for the answer plus a little slack before 'length'
    max_tokens = max(len(encode(tokenizer, task.target(p))) for p in problems) + 4
  max_prompt = max(len(p) for p in prompts)
  # Powers of two so repeated evaluations (different sets, same sizes) reuse the compiled step.
  max_seq_len = 1 << (max_prompt + max_tokens - 1).bit_length()
  slots = min(num_slots, 1 << (len(problems) - 1).bit_length())
  engine = gen_engine.JaxEngine(
      model_config, params,
      gen_engine.EngineConfig(num_slots=slots, max_seq_len=max_seq_len,
                              eos_token_ids=(eos_id(tokenizer),)))
  sampling = gen_api.SamplingParams(temperature=temperature, max_tokens=max_tokens)
  requests = [gen_api.Request(request_id=str(i), prompt_tokens=ids, sampling=sampling,
                              seed=seed + i) for i, ids in enumerate(prompts)]
  try:
    completions = gen_api.generate(engine, requests)
  finally:
    engine.close()
  texts = [tokenizer.decode(c.tokens.tolist(), skip_special_tokens=True) for c in completions]
  scores = [task.score(p, t) for p, t in zip(problems, texts)]
  statuses = collections.Counter(s.status for s in scores)
  out = {'accuracy': float(np.mean([s.reward for s in scores])),
         'statuses': {k: statuses.get(k, 0) for k in tasks_base.STATUSES}, 'num': len(problems)}
  if return_texts:
    out['texts'] = texts
  return out


# ---------------------------------------------------------------------------------------------
# The build.


def train_sft(params, model_config: transformer.ModelConfig, cfg: WarmStartConfig, tokenizer,
              task, log: Callable[[str], None] = print) -> tuple[Any, list[dict]]:
  """SFT on the fixed SFT set until sampled accuracy on unseen problems reaches the target or
  max_steps; returns (params, history of evaluations)."""
  sft_set = task.sft_problems(cfg.sft_seed, cfg.sft_examples)
  examples = encode_examples(tokenizer, task, sft_set)
  eval_set = list(_take(task.problems(cfg.eval_seed), cfg.eval_problems))
  num_rows, seq_len = packed_shape(max(len(p) + len(c) for p, c in examples), cfg.batch_size)

  optimizer = train.make_optimizer(train.OptimizerConfig(lr=cfg.lr, max_grad_norm=1.0))
  state = train.init_train_state(params, optimizer)
  step_fn = jax.jit(make_sft_step(model_config, optimizer), donate_argnums=(0,))
  rng = np.random.default_rng(cfg.sft_seed)
  order, cursor = rng.permutation(len(examples)), 0
  history, start, losses = [], time.perf_counter(), []

  def evaluate(step):
    acc = evaluate_accuracy(state.params, model_config, tokenizer, task, eval_set, 1.0,
                            seed=step * cfg.eval_problems)
    loss = float(np.mean(losses)) if losses else float('nan')
    history.append({'step': step, 'loss': loss, 'sampled_accuracy': acc['accuracy'],
                    'statuses': acc['statuses'], 'seconds': time.perf_counter() - start})
    log(f'[warmstart] step {step:5d}  loss {loss:.3f}  sampled acc {acc["accuracy"]:.3f}  '
        f'{acc["statuses"]}  {time.perf_counter() - start:.0f}s')
    losses.clear()
    return acc['accuracy']

  step = 0
  while step < cfg.max_steps:
    picks = []
    for _ in range(min(cfg.batch_size, len(examples))):  # epochs of a shuffled fixed set
      if cursor == len(order):
        order, cursor = rng.permutation(len(examples)), 0
      picks.append(examples[order[cursor]])
      cursor += 1
    state, metrics = step_fn(state, pack_examples(picks, seq_len, num_rows))
    losses.append(float(metrics['loss']))
    step += 1
    if step % cfg.eval_every == 0 and evaluate(step) >= cfg.target_sampled_accuracy:
      break
  else:
    if not history or history[-1]['step'] != step:
      evaluate(step)
  return state.params, history


def build_demo_model(out_dir: str | os.PathLike, cfg: WarmStartConfig | Mapping[str, Any] = None,
                     log: Callable[[str], None] = print) -> Path:
  """Builds (or finds cached) the warm-started demo model in out_dir; returns out_dir."""
  cfg = WarmStartConfig.from_mapping(cfg if cfg is not None else WarmStartConfig())
  out_dir = Path(out_dir)
  digest = settings_hash(cfg)
  if (read_stamp(out_dir).get('settings_hash') == digest and
      (out_dir / hf_io.SINGLE_FILE).exists()):
    return out_dir

  start = time.perf_counter()
  log(f'[warmstart] building the demo model in {out_dir} (settings {digest})')
  tok = char_tokenizer.build_char_tokenizer()
  task = make_task(cfg)
  model_config = make_model_config(cfg, tok.get_vocab_size())
  params = transformer.init_params(model_config, jax.random.PRNGKey(cfg.init_seed))
  log(f'[warmstart] {model_config.num_params:,} params; SFT on {cfg.sft_examples} examples')
  params, history = train_sft(params, model_config, cfg, tok, task, log)
  eval_set = list(_take(task.problems(cfg.eval_seed), cfg.eval_problems))
  greedy = evaluate_accuracy(params, model_config, tok, task, eval_set, 0.0)
  log(f'[warmstart] done in {time.perf_counter() - start:.0f}s: greedy acc '
      f'{greedy["accuracy"]:.3f}, sampled acc {history[-1]["sampled_accuracy"]:.3f}')

  # Everything goes into a temp dir first; the rename makes a finished build appear at once, so
  # a crash never leaves a dir that looks complete.
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.parent / f'.{out_dir.name}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  ids = char_tokenizer.special_token_ids(tok)
  hf_io.save_params(params, model_config, tmp, dtype='float32',
                    extra_config={**ids, 'bos_token_id': None})
  char_tokenizer.save_tokenizer(tok, tmp, model_max_length=cfg.max_position_embeddings)
  (tmp / 'generation_config.json').write_text(json.dumps(ids, indent=2) + '\n')
  stamp = {'settings_hash': digest, 'settings': dataclasses.asdict(cfg),
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
