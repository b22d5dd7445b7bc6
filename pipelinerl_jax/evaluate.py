"""pass@1 and pass@k on held-out problems: one code path for the CLI and for in-training evals.

  python -m pipelinerl_jax.evaluate --config=configs/math.py:tiny --checkpoint=DIR [--k=4]
      [--out=DIR]   (installed: pipelinerl-eval ...)

prints pass@1 / pass@k per dataset and writes OUT/results.json and OUT/samples.jsonl (one line
per sample: dataset, problem id, prompt, completion, status, reward). A run with
`eval.every_steps > 0` calls the same `evaluate_params` on its current params and logs
`eval/pass@1`, `eval/pass@<k>` (and `eval/<dataset>/...` when there are several datasets) into
the step's metrics record.

Every sample's seed is a function of (eval seed, dataset, problem id, sample index) only, and
the engine is sized from the config and the problem set alone, so the same params, problems and
seed give the same numbers through either entry point.

Correct means status 'correct' (not reward > 0: rewards may be shaped). Completions are judged
as written, truncated or not: the reward options for truncation are a training matter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax.generation import api
from pipelinerl_jax.tasks import base as tasks_base


# --- the numbers (pure) ----------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):
  1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold
  at least one correct one. Exact integer binomials, so no overflow or cancellation."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f'pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}')
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_seed(seed: int, dataset: str, problem_id: str, index: int) -> int:
  return zlib.crc32(f'eval/{seed}/{dataset}/{problem_id}/{index}'.encode()) & 0x7FFFFFFF


def summarize(correct: Mapping[str, Sequence[Sequence[bool]]], k: int) -> dict[str, Any]:
  """{dataset: [per problem: [per sample: correct?]]} -> pass@1 and pass@k, per dataset and over
  all problems (each problem counts once, whatever its dataset)."""
  out: dict[str, Any] = {'k': k, 'datasets': {}}
  ks = sorted({1, k})
  everything = {kk: [] for kk in ks}
  for name, problems in correct.items():
    per = {kk: [pass_at_k(len(s), sum(s), kk) for s in problems] for kk in ks}
    out['datasets'][name] = {'num_problems': len(problems), 'pass@1': _mean(per[1]),
                             f'pass@{k}': _mean(per[k])}
    for kk in ks:
      everything[kk] += per[kk]
  out.update({'num_problems': len(everything[1]), 'pass@1': _mean(everything[1]),
              f'pass@{k}': _mean(everything[k])})
  return out


def _mean(xs):
  return float(np.mean(xs)) if xs else 0.0


def metrics_record(result: Mapping[str, Any], prefix: str = 'eval/') -> dict[str, float]:
  """The flat keys a run logs: eval/pass@1, eval/pass@<k>, per dataset when there are several."""
  k = result['k']
  record = {f'{prefix}pass@1': result['pass@1'], f'{prefix}pass@{k}': result[f'pass@{k}']}
  if len(result['datasets']) > 1:
    for name, d in result['datasets'].items():
      record[f'{prefix}{name}/pass@1'] = d['pass@1']
      record[f'{prefix}{name}/pass@{k}'] = d[f'pass@{k}']
  return record


# --- the evaluation --------------------------------------------------------------------------

def evaluate(engine: api.Engine, datasets: Mapping[str, Sequence[tasks_base.Problem]], task, *,
             encode: Callable[[tasks_base.Problem], list[int]],
             decode: Callable[[np.ndarray], str], sampling: api.SamplingParams, k: int,
             seed: int, n: int | None = None) -> dict[str, Any]:
  """n samples (default k) of every problem on an idle engine, scored by the task.

  Returns `summarize(...)` plus 'n', 'seconds' and 'samples' (one dict per sample).
  """
  n = n or k
  if n < k:
    raise ValueError(f'need n >= k samples per problem, got n={n} k={k}')
  items, requests = [], []
  for name, problems in datasets.items():
    for p in problems:
      prompt = encode(p)
      for j in range(n):
        requests.append(api.Request(request_id=f'{name}/{p.id}/{j}', prompt_tokens=prompt,
                                    sampling=sampling, seed=sample_seed(seed, name, p.id, j)))
        items.append((name, p, j))
  t0 = time.monotonic()
  completions = api.generate(engine, requests)
  texts = [decode(c.tokens) for c in completions]
  problems = [p for _, p, _ in items]
  if hasattr(task, 'score_many'):  # math: one call, judged in parallel by the verify pool
    scores = task.score_many(problems, texts)
  else:
    scores = [task.score(p, t) for p, t in zip(problems, texts)]
  correct: dict[str, dict[str, list[bool]]] = {name: {} for name in datasets}
  samples = []
  for (name, p, j), c, text, s in zip(items, completions, texts, scores):
    correct[name].setdefault(p.id, []).append(s.status == 'correct')
    samples.append(dict(dataset=name, problem_id=p.id, sample=j, prompt=p.prompt,
                        completion=text, status=s.status, reward=s.reward,
                        finish_reason=c.finish_reason, num_tokens=len(c.tokens)))
  out = summarize({name: list(d.values()) for name, d in correct.items()}, k)
  out.update(n=n, seconds=time.monotonic() - t0, samples=samples)
  return out


def eval_sets(config, task) -> dict[str, list[tasks_base.Problem]]:
  """The held-out problems of a config, prompts formatted as the actor formats them.

  arithmetic: the first eval.num_problems distinct problems of task.problems(eval.seed). They
    come from the RL pool, like the training stream, and are not removed from it: the pool of
    2-digit sums (~7k problems) is small enough that training samples nearly all of it, so
    these are problems never seen with a target (the SFT pool is disjoint), not problems never
    seen at all.
  math: the test sets (task.test_files, or the test_fraction split of each train file), the
    first eval.num_problems of each (0 = all). Disjoint from training by construction.
  """
  num = config.eval.num_problems
  if config.task.name == 'arithmetic':
    if num < 1:
      raise ValueError('config.eval.num_problems: arithmetic needs a number of problems >= 1')
    stream, seen, out = task.problems(config.eval.seed), set(), []
    while len(out) < num:
      p = next(stream)
      if p.prompt not in seen:
        seen.add(p.prompt)
        out.append(p)
    return {'arithmetic': out}
  from pipelinerl_jax.tasks import math as math_task
  t = config.task
  _, test = math_task.load_splits(t.train_files, t.test_files, t.test_fraction,
                                  t.problem_field, t.answer_field)
  if not any(test.values()):
    raise ValueError('config.task: no held-out problems to evaluate on (set task.test_files or '
                     'task.test_fraction)')
  tokenizer = getattr(task, 'tokenizer', None)
  return {name: [dataclasses.replace(p, prompt=math_task.format_prompt(p.prompt, tokenizer))
                 for p in (problems[:num] if num else problems)]
          for name, problems in test.items()}


def evaluate_params(config, model_config, params, tokenizer, task,
                    datasets: Mapping[str, Sequence[tasks_base.Problem]], *,
                    k: int | None = None, n: int | None = None, device=None) -> dict[str, Any]:
  """`evaluate` with a JaxEngine built on `params`, sized from the config and problem count.

  What both the CLI and the in-training eval call. Problems whose prompt is longer than
  generation.max_prompt_len are skipped and counted ('skipped'), not fatal: a long test problem
  must not end a run at its first evaluation.
  """
  from pipelinerl_jax.generation import engine as engine_lib
  g, ev = config.generation, config.eval
  k = k or ev.k
  encoded: dict[str, list[int]] = {}
  kept, skipped = {}, 0
  for name, problems in datasets.items():
    kept[name] = []
    for p in problems:
      ids = tokenizer.encode(p.prompt, add_special_tokens=False)
      if 0 < len(ids) <= g.max_prompt_len:
        encoded[p.prompt] = list(ids)
        kept[name].append(p)
      else:
        skipped += 1
  num_requests = sum(map(len, kept.values())) * (n or k)
  slots = max(1, min(g.num_slots, 1 << max(0, num_requests - 1).bit_length()))
  engine = engine_lib.JaxEngine(
      model_config, params,
      engine_lib.EngineConfig(num_slots=slots, max_seq_len=g.max_prompt_len + g.max_new_tokens,
                              eos_token_ids=(tokenizer.eos_token_id,)),
      device=device)
  sampling = api.SamplingParams(temperature=ev.temperature, top_p=g.top_p, top_k=g.top_k,
                                max_tokens=g.max_new_tokens)
  try:
    result = evaluate(engine, kept, task, encode=lambda p: encoded[p.prompt],
                      decode=lambda t: tokenizer.decode(t, skip_special_tokens=True),
                      sampling=sampling, k=k, n=n, seed=ev.seed)
  finally:
    engine.close()
  result['skipped'] = skipped
  return result


def write_samples(path: str, samples: Sequence[Mapping[str, Any]]) -> None:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    for s in samples:
      f.write(json.dumps(s, ensure_ascii=False) + '\n')


def evaluate_checkpoint(config, checkpoint: str, *, k: int | None = None, n: int | None = None,
                        out_dir: str | None = None) -> dict[str, Any]:
  """What the CLI runs: params from `checkpoint`, architecture and tokenizer from the config's
  model (config.model.path, or the demo model) unless the checkpoint is an HF dir with its own
  config.json; the problems of `eval_sets`."""
  from pipelinerl_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from pipelinerl_jax.models import hf_io  # pylint: disable=g-import-not-at-top
  from pipelinerl_jax.pipeline import run as run_lib  # pylint: disable=g-import-not-at-top
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  config_lib.validate(config)
  model_dir = run_lib.resolve_model_dir(config)
  has_config = os.path.isfile(os.path.join(checkpoint, hf_io.CONFIG_FILE))
  arch_dir = checkpoint if has_config else model_dir
  m = config.model
  model_config = hf_io.load_config(arch_dir, param_dtype=m.param_dtype, dtype=m.dtype,
                                   lm_head_fp32=m.lm_head_fp32, remat=False)
  params = checkpoint_lib.load_params(checkpoint, model_config)  # orbax run dir or HF dir
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  task = run_lib.make_task(config, tokenizer)
  try:
    result = evaluate_params(config, model_config, params, tokenizer, task,
                             eval_sets(config, task), k=k, n=n)
  finally:
    getattr(task, 'close', lambda: None)()
  if out_dir:
    write_samples(os.path.join(out_dir, 'samples.jsonl'), result['samples'])
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
  from absl import flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  f = flags.FLAGS
  try:
    result = evaluate_checkpoint(f.config, f.checkpoint, k=f.k, n=f.n, out_dir=f.out)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'error: {e}')
  print(report(result))


def cli():
  """The `pipelinerl-eval` console script (and `python -m pipelinerl_jax.evaluate`). The flags are
  defined here, not at import: run.py imports this module, and `main` defines its own --config."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top,g-multiple-import
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
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
