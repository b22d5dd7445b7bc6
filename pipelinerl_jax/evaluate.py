"""Evaluates a checkpoint: pass@1 and pass@k on the config's held-out problems.

  python -m pipelinerl_jax.evaluate --config=configs/math.py:tiny --checkpoint=DIR [--k=4]
      [--n=8] [--out=DIR]

prints pass@1 / pass@k per dataset and writes OUT/results.json and OUT/samples.jsonl (one line
per sample: dataset, problem id, prompt, completion, status, reward). DIR is a run's checkpoints
dir (its latest step), one step of it, or an HF model dir. The numbers come from
`evaluation.evaluate_params`, the function a run's periodic evaluation calls, so the two agree
for the same params and seed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluation
from pipelinerl_jax import platforms
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.tasks import registry


def evaluate_checkpoint(config, checkpoint: str, *, k: int | None = None, n: int | None = None,
                        out_dir: str | None = None) -> dict[str, Any]:
  """What the CLI runs: params from `checkpoint`, architecture and tokenizer from the config's
  model (config.model.path, or the demo model) unless the checkpoint is an HF dir with its own
  config.json; the task's held-out problems."""
  config = config_lib.validate(config, runnable=False)
  platforms.check(config)  # before the model or the data is looked at
  config.check_runnable()
  model_dir = warmstart.model_dir_for(config)
  tokenizer = hf_tokenizer.load_tokenizer(model_dir)  # before the params: a missing one is one line
  has_config = os.path.isfile(os.path.join(checkpoint, hf_schema.CONFIG_FILE))
  arch_dir = checkpoint if has_config else model_dir
  m = config.model
  model_config = hf_schema.load_config(arch_dir, param_dtype=m.param_dtype, dtype=m.dtype,
                                   lm_head_fp32=m.lm_head_fp32, remat=False)
  params = checkpoint_lib.load_params(checkpoint, model_config)  # orbax run dir or HF dir
  task = registry.make_task(config.task, tokenizer)
  try:
    result = evaluation.evaluate_params(
        config, model_config, params, tokenizer, task,
        task.held_out(config.eval.num_problems, config.eval.seed), k=k, n=n,
        stop_ids=hf_tokenizer.stop_token_ids(model_dir, tokenizer))
  finally:
    task.close()
  if out_dir:
    evaluation.write_samples(os.path.join(out_dir, 'samples.jsonl'), result['samples'])
    summary = {key: v for key, v in result.items() if key != 'samples'}
    with open(os.path.join(out_dir, 'results.json'), 'w') as f:
      json.dump({'checkpoint': checkpoint, **summary}, f, indent=2)
  return result


def report(result: Mapping[str, Any]) -> str:
  k = result['k']

  def numbers(d):
    return f"pass@1 {d['pass@1']:.4f}" + (f", pass@{k} {d[f'pass@{k}']:.4f}" if k > 1 else '')

  lines = [f"{name}: {d['num_problems']} problems, {numbers(d)}"
           for name, d in result['datasets'].items()]
  lines.append(f"all: {result['num_problems']} problems x {result['n']} samples, "
               f"{numbers(result)} ({result['seconds']:.1f} s, {result['skipped']} skipped: "
               'prompt too long)')
  return '\n'.join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    result = evaluate_checkpoint(f.config, f.checkpoint, k=f.k, n=f.n, out_dir=f.out)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'error: {e}')
  print(report(result))


def cli():
  """The `pipelinerl-eval` console script (and `python -m pipelinerl_jax.evaluate`). Flags are
  defined here, not at import, so that `main`'s module and this one can be imported together
  (both define --config)."""
  config_flags.DEFINE_config_file('config', None, 'Experiment config, e.g. configs/math.py:tiny.',
                                  lock_config=True)
  flags.DEFINE_string('checkpoint', None, 'HF model dir (or orbax run checkpoint) to evaluate.')
  flags.DEFINE_integer('k', None, 'pass@k (default: config.eval.k).')
  flags.DEFINE_integer('n', None, 'Samples per problem, >= k (default: k).')
  flags.DEFINE_string('out', None, 'Writes results.json and samples.jsonl here.')
  flags.mark_flags_as_required(['config', 'checkpoint'])
  app.run(main)


if __name__ == '__main__':
  cli()
