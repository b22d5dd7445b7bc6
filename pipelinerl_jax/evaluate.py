"""Evaluates a checkpoint on math benchmarks the way papers report them (evaluation.py): per test
set avg@n, pass@1, pass@k, maj@k, mean response length and the share cut at max_tokens.

  pipelinerl-eval --checkpoint=DIR [--test_files=math500.jsonl,aime24.parquet,...]
      [--n=32 --k=8 --temperature=0.6 --top_p=0.95 --max_tokens=8192] [--backend=jax|vllm]
      [--config=configs/math.py:PRESET] [--out=OUT]

DIR is a run's checkpoints dir (its latest step) or one step of it, an HF model dir (an export,
a model from the Hub), or a PEFT adapter dir (`export --format=peft`; its base is the one its
adapter_config.json names, or --base_model). Without --config: a run's checkpoint uses the run's
config, an HF or PEFT dir the `eval` preset of configs/math.py. The flags override the config's
eval settings; prompts are sized to the longest test prompt unless --max_prompt_len is given.
Prints a table and writes OUT/results.json and OUT/samples.jsonl (one line per sample: dataset,
problem id, prompt, completion, its answer, status, reward, finish reason, tokens). The numbers
come from `evaluation.evaluate_params`, the function a run's periodic evaluation calls, so the
two agree for the same params, config and seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Mapping

import ml_collections
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluation
from pipelinerl_jax import platforms
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.pipeline import build
from pipelinerl_jax.tasks import registry

BACKENDS = ('jax', 'vllm')
# Flags that override config.eval (None: keep the config's).
EVAL_FLAGS = ('k', 'n', 'temperature', 'top_p', 'top_k', 'max_tokens', 'seed', 'num_problems')


def checkpoint_kind(path: str) -> str:
  """'peft' (an adapter dir), 'hf' (a model dir) or 'orbax' (a run's checkpoints)."""
  if checkpoint_lib.is_peft_dir(path):
    return 'peft'
  return 'hf' if checkpoint_lib.is_hf_dir(path) else 'orbax'


def default_config(checkpoint: str) -> ml_collections.ConfigDict:
  """The run's config for a run's checkpoint, else the `eval` preset."""
  if checkpoint_kind(checkpoint) == 'orbax':
    return ml_collections.ConfigDict(checkpoint_lib.read_meta(checkpoint)['config'])
  return config_lib.load_preset('eval')


def evaluate_checkpoint(config: ml_collections.ConfigDict | config_lib.Config | None,
                        checkpoint: str, *, test_files: tuple[str, ...] = (),
                        backend: str = 'jax', base_model: str = '',
                        max_prompt_len: int | None = None, out_dir: str | None = None,
                        **eval_overrides) -> dict[str, Any]:
  """What the CLI runs (see the module doc). `eval_overrides`: config.eval fields (EVAL_FLAGS),
  None keeps the config's; `test_files` replace task.test_files."""
  if backend not in BACKENDS:
    raise ValueError(f'--backend={backend!r}: expected one of {", ".join(BACKENDS)}')
  if config is not None:  # a run that needs a GPU says so before any checkpoint is read
    if isinstance(config, config_lib.Config):
      config = config_lib.to_config_dict(config)
    platforms.check(config)
  kind = checkpoint_kind(checkpoint)
  run_model_dir = ''
  if kind == 'orbax':  # a missing or empty dir: one line, before anything
    run_model_dir = checkpoint_lib.read_meta(checkpoint)['model_dir']
  if config is None:
    config = default_config(checkpoint)
  if isinstance(config, config_lib.Config):
    config = config_lib.to_config_dict(config)
  config = ml_collections.ConfigDict(config.to_dict())  # a copy the flags may change
  for key, value in eval_overrides.items():
    if key not in EVAL_FLAGS:
      raise TypeError(f'evaluate_checkpoint: unknown eval setting {key!r}')
    if value is not None:
      config.eval[key] = value
  if test_files:  # math problem files, whatever task the run trained on
    config.task.name = 'math'
    config.task.test_files = tuple(test_files)
  lora, base = None, ''
  if kind == 'peft':
    lora, base = checkpoint_lib.read_peft_config(checkpoint)
    base = base_model or base
    if not checkpoint_lib.is_hf_dir(base):
      raise FileNotFoundError(f'{checkpoint}: its base model {base!r} is not an HF model dir '
                              'here; pass --base_model=DIR')
  if not config.model.path:  # the run's model dir (the base of a LoRA run's), or the dir itself
    config.model.path = run_model_dir or base or checkpoint
  config.generation.backend = backend
  config = config_lib.validate(config, runnable=False)
  platforms.check(config)  # before the model or the data is looked at
  build.check_backend_installed(config)
  t = config.task
  if t.name == 'math' and not (t.test_files or t.test_fraction):
    raise ValueError('no test sets: give --test_files (or config.task.test_files)')
  model_dir = warmstart.model_dir_for(config)
  tokenizer = hf_tokenizer.load_tokenizer(model_dir)  # before the params: a missing one is one line
  arch_dir = checkpoint if kind == 'hf' else model_dir
  m = config.model
  model_config = hf_schema.load_config(arch_dir, param_dtype=m.param_dtype, dtype=m.dtype,
                                   lm_head_fp32=m.lm_head_fp32, remat=False)
  task = registry.make_task(config.task, tokenizer)
  try:
    datasets = task.held_out(config.eval.num_problems, config.eval.seed)
    longest = max(len(tokenizer.encode(p.prompt, add_special_tokens=False))
                  for problems in datasets.values() for p in problems)
    max_prompt_len = _prompt_room(max_prompt_len, config, longest,
                                  model_config.max_position_embeddings)
    params, serve_dir, config = _params(config, kind, checkpoint, model_config, model_dir,
                                        backend, lora, base)
    result = evaluation.evaluate_params(
        config, model_config, params, tokenizer, task, datasets, backend=backend,
        model_dir=serve_dir, max_prompt_len=max_prompt_len,
        stop_ids=hf_tokenizer.stop_token_ids(model_dir, tokenizer))
  finally:
    task.close()
  result['settings'] = dict(backend=backend, checkpoint=os.path.abspath(checkpoint),
                            test_files=list(config.task.test_files),
                            max_prompt_len=max_prompt_len,
                            max_tokens=config.eval.max_tokens or config.generation.max_new_tokens,
                            **{key: getattr(config.eval, key) for key in
                               ('k', 'temperature', 'top_p', 'top_k', 'seed')},
                            n=config.eval.samples)
  if out_dir:
    evaluation.write_samples(os.path.join(out_dir, 'samples.jsonl'), result['samples'])
    summary = {key: v for key, v in result.items() if key != 'samples'}
    with open(os.path.join(out_dir, 'results.json'), 'w') as f:
      json.dump({'checkpoint': checkpoint, **summary}, f, indent=2)
  return result


def _prompt_room(given: int | None, config: config_lib.Config, longest: int, context: int) -> int:
  """The engine's prompt length: `given`, else room for every test prompt (the config's when they
  fit: then the engine is the one a run's periodic evaluation builds, and the numbers agree),
  within the model's context; what cannot fit is one line."""
  max_tokens = config.eval.max_tokens or config.generation.max_new_tokens
  room = given or max(config.generation.max_prompt_len, longest)
  if not given and room + max_tokens > context:
    room = max(longest, context - max_tokens)
  if room + max_tokens > context:
    raise ValueError(f'{"--max_prompt_len" if given else "the longest test prompt"} ({room} '
                     f'tokens) and max_tokens={max_tokens} exceed the model\'s context of '
                     f'{context} positions: lower --max_tokens or --max_prompt_len (longer '
                     'prompts are then skipped)')
  return room


def _params(config: config_lib.Config, kind: str, checkpoint: str, model_config, model_dir: str,
            backend: str, lora: config_lib.LoraSettings | None, base: str):
  """(params for the engine or None, the dir vLLM starts from, the config): the JAX engine
  gets params (a LoRA's on its base); vLLM reads an HF dir itself and is given a run's params,
  or a LoRA's adapters on its base."""
  if kind == 'hf':
    if backend == 'vllm':
      return None, checkpoint, config
    return checkpoint_lib.load_params(checkpoint, model_config), checkpoint, config
  if kind == 'peft':
    adapters = checkpoint_lib.load_peft_adapters(checkpoint, model_config, lora)
    settings = config_lib.LoraSettings(rank=lora.rank, alpha=lora.alpha, targets=lora.targets)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=settings))
    if backend == 'vllm':
      return adapters, base, config
    base_params = hf_checkpoint.load_params(base, checkpoint_lib.frozen_base_config(model_config))
    return lora_lib.Adapted(base_params, adapters, lora.scale), base, config
  params = checkpoint_lib.load_params(checkpoint, model_config, model_dir=model_dir)
  if backend == 'vllm' and isinstance(params, lora_lib.Adapted):
    return params.adapters, model_dir, config
  return params, model_dir, config


def report(result: Mapping[str, Any]) -> str:
  """A table: one row per test set and one over all problems."""
  k, n = result['k'], result['n']
  cols = [f'avg@{n}', 'pass@1', f'pass@{k}', f'maj@{k}', 'mean_tokens', 'truncated']
  cols = list(dict.fromkeys(cols))
  rows = [(name, d) for name, d in result['datasets'].items()] + [('all', result)]
  width = max(len(name) for name, _ in rows)
  lines = [f"{'dataset'.ljust(width)}  problems  " + '  '.join(c.rjust(11) for c in cols)]
  for name, d in rows:
    lines.append(f'{name.ljust(width)}  {d["num_problems"]:8d}  ' + '  '.join(
        f'{d[c]:11.1f}' if c == 'mean_tokens' else f'{d[c]:11.4f}' for c in cols))
  lines.append(f"{n} samples per problem, {result['seconds']:.1f} s, {result['skipped']} "
               'skipped (prompt too long)')
  return '\n'.join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    result = evaluate_checkpoint(
        f.config, f.checkpoint, test_files=tuple(f.test_files or ()), backend=f.backend,
        base_model=f.base_model, max_prompt_len=f.max_prompt_len, out_dir=f.out,
        **{key: getattr(f, key) for key in EVAL_FLAGS})
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'error: {e}')
  print(report(result))


def cli():
  """The `pipelinerl-eval` console script (and `python -m pipelinerl_jax.evaluate`). Flags are
  defined here, not at import, so that `main`'s module and this one can be imported together
  (both define --config)."""
  config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. configs/math.py:eval '
                                  "(default: the run's, or the eval preset).", lock_config=True)
  flags.DEFINE_string('checkpoint', None, "A run's checkpoints (or one step), an HF model dir or "
                      'a PEFT adapter dir.')
  flags.DEFINE_list('test_files', [], 'Test sets (NAME=PATH names one); default: the config\'s.')
  flags.DEFINE_enum('backend', 'jax', list(BACKENDS), 'The engine: JAX or vLLM.')
  flags.DEFINE_string('base_model', '', "A PEFT adapter dir's base ('' = as its config names).")
  flags.DEFINE_integer('n', None, 'Samples per problem, >= k (default: config.eval.n, else k).')
  flags.DEFINE_integer('k', None, 'pass@k and maj@k (default: config.eval.k).')
  flags.DEFINE_float('temperature', None, 'Sampling temperature (0 = greedy).')
  flags.DEFINE_float('top_p', None, 'Nucleus sampling (1 = off).')
  flags.DEFINE_integer('top_k', None, 'Top-k sampling (0 = off).')
  flags.DEFINE_integer('max_tokens', None, 'New tokens per completion.')
  flags.DEFINE_integer('max_prompt_len', None, 'Longest prompt (default: the longest test one).')
  flags.DEFINE_integer('seed', None, 'Sampling seed.')
  flags.DEFINE_integer('num_problems', None, 'Problems per test set (0 = all).')
  flags.DEFINE_string('out', None, 'Writes results.json and samples.jsonl here.')
  flags.mark_flags_as_required(['checkpoint'])
  app.run(main)


if __name__ == '__main__':
  cli()
