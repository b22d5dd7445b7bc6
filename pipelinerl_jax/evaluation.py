"""Evaluation as papers report it, per benchmark: avg@n, pass@1, pass@k (unbiased), maj@k, mean
response length and the share cut at the length limit. One code path for `pipelinerl-eval`
(evaluate.py), for in-training evals and for the demo model's warm start.

  avg@n      mean accuracy over the n samples of each problem, averaged over problems (what papers
             call avg@32 with n = 32; the same number as pass@1 estimated from n samples)
  pass@k     the unbiased estimator from n >= k samples (`pass_at_k`)
  maj@k      majority voting over k samples: their final answers (Task.answer_of) are grouped
             into classes of equivalent answers (Task.same_answers: math-verify for math), and
             the problem counts as solved when the largest class is correct. A class is the first
             answer in sample order that starts it (its representative) and every later answer
             equivalent to that representative; it is correct when its representative is.
             Samples without an answer do not vote (none at all: 0). Ties: when several classes
             share the largest size, the problem scores the share of them that are correct (the
             expected value of breaking the tie at random), so the number never depends on sample
             order among tied classes. With n > k, the mean over the n // k disjoint blocks of k
             consecutive samples.
  mean_tokens, truncated   the mean completion length in tokens, and the share of completions that
             ended at the token limit (finish_reason 'length') rather than with a stop token

A run with `eval.every_steps > 0` calls `evaluate_params` on its current params and logs
`eval/pass@1`, `eval/pass@<k>`, `eval/maj@<k>`, `eval/mean_tokens`, `eval/truncated` (and
`eval/<dataset>/...` when there are several datasets) into the step's metrics record;
`pipelinerl-eval` calls the same function on a checkpoint.

Every sample's seed is a function of (eval seed, dataset, problem id, sample index) only, and
the engine is sized from the config and the problem set alone, so the same params, problems and
seed give the same numbers through either entry point.

Correct means status 'correct' (not reward > 0: rewards may be shaped). Completions are judged
as written, truncated or not: the reward options for truncation are a training matter.

A multi-turn task's samples are episodes, run through the same episode functions as training
(episodes.py: the same turn limit, budget and request ids per turn), and judged by the status of
their environment's last step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import episodes as episodes_lib
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.tasks import base as tasks_base


# --- the numbers (pure) ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Outcome:
  """What the numbers need of one sample."""
  correct: bool
  answer: str | None = None       # its final answer (None: it gives none)
  num_tokens: int = 0
  truncated: bool = False         # ended at the token limit


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):
  1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold
  at least one correct one. Exact integer binomials, so no overflow or cancellation."""
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f'pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}')
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool],
                     same: Callable[[str, str], bool] = operator.eq) -> float:
  """The vote of one set of samples (the module doc's maj): 1.0, 0.0, or under a tie the share
  of the largest classes that are correct. `same(representative, answer)`: equivalent answers."""
  classes: list[list[int]] = []  # sample indices, the representative first
  for i, answer in enumerate(answers):
    if answer is None:
      continue
    home = next((c for c in classes if same(answers[c[0]], answer)), None)
    if home is None:
      classes.append([i])
    else:
      home.append(i)
  if not classes:
    return 0.0
  top = max(len(c) for c in classes)
  tied = [c for c in classes if len(c) == top]
  return sum(bool(correct[c[0]]) for c in tied) / len(tied)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int,
             same: Callable[[str, str], bool] = operator.eq) -> float:
  """maj@k of one problem's n >= k samples: the mean vote over its n // k disjoint blocks of k."""
  blocks = len(answers) // k
  if blocks < 1:
    raise ValueError(f'maj_at_k needs n >= k samples, got n={len(answers)} k={k}')
  return float(np.mean([majority_correct(answers[b * k:(b + 1) * k],
                                         correct[b * k:(b + 1) * k], same)
                        for b in range(blocks)]))


def sample_seed(seed: int, dataset: str, problem_id: str, index: int) -> int:
  return zlib.crc32(f'eval/{seed}/{dataset}/{problem_id}/{index}'.encode()) & 0x7FFFFFFF


def summarize(outcomes: Mapping[str, Sequence[Sequence[Outcome]]], k: int,
              same: Callable[[str, str], bool] = operator.eq) -> dict[str, Any]:
  """{dataset: [per problem: [per sample: Outcome]]} -> the module doc's numbers, per dataset
  and over all problems (each problem counts once, whatever its dataset)."""
  out: dict[str, Any] = {'k': k, 'datasets': {}}
  everything: list[dict[str, float]] = []
  for name, problems in outcomes.items():
    per = [_problem_numbers(samples, k, same) for samples in problems]
    out['datasets'][name] = _averaged(per, k)
    everything += per
  out.update(_averaged(everything, k))
  return out


def _problem_numbers(samples: Sequence[Outcome], k: int, same) -> dict[str, float]:
  n = len(samples)
  correct = [s.correct for s in samples]
  numbers = {'n': n, 'avg': float(np.mean(correct)) if n else 0.0,
             'pass@1': pass_at_k(n, sum(correct), 1) if n else 0.0,
             'mean_tokens': float(np.mean([s.num_tokens for s in samples])) if n else 0.0,
             'truncated': float(np.mean([s.truncated for s in samples])) if n else 0.0}
  numbers[f'pass@{k}'] = pass_at_k(n, sum(correct), k) if n >= k else 0.0
  numbers[f'maj@{k}'] = maj_at_k([s.answer for s in samples], correct, k, same) if n >= k else 0.0
  return numbers


def _averaged(per: Sequence[Mapping[str, float]], k: int) -> dict[str, Any]:
  n = int(min((p['n'] for p in per), default=0))
  keys = ('avg', 'pass@1', f'pass@{k}', f'maj@{k}', 'mean_tokens', 'truncated')
  out: dict[str, Any] = {'num_problems': len(per), 'n': n}
  for key in keys:
    out[f'avg@{n}' if key == 'avg' else key] = _mean([p[key] for p in per])
  return out


def _mean(xs):
  return float(np.mean(xs)) if xs else 0.0


METRICS = ('pass@1', 'pass@{k}', 'maj@{k}', 'mean_tokens', 'truncated')


def metrics_record(result: Mapping[str, Any], prefix: str = 'eval/') -> dict[str, float]:
  """The flat keys a run logs: eval/pass@1, eval/pass@<k>, eval/maj@<k>, eval/mean_tokens,
  eval/truncated, and each per dataset when there are several."""
  keys = [m.format(k=result['k']) for m in METRICS]
  record = {f'{prefix}{key}': result[key] for key in keys}
  if len(result['datasets']) > 1:
    for name, d in result['datasets'].items():
      record.update({f'{prefix}{name}/{key}': d[key] for key in keys})
  return record


def equivalence(task, answers_per_problem: Sequence[Sequence[str | None]]
                ) -> Callable[[str, str], bool]:
  """`same(a, b)` for the answers of each problem: every pair of distinct answers of one problem
  judged once by `task.same_answers` (in one batch: the math task's worker pool), symmetric."""
  unordered: dict[frozenset, tuple[str, str]] = {}
  for answers in answers_per_problem:
    distinct = list(dict.fromkeys(a for a in answers if a is not None))
    for i, a in enumerate(distinct):
      for b in distinct[i + 1:]:
        unordered.setdefault(frozenset((a, b)), (a, b))
  pairs = list(unordered.values())
  equal = {frozenset(p) for p, same in zip(pairs, task.same_answers(pairs) if pairs else [])
           if same}
  return lambda a, b: a == b or frozenset((a, b)) in equal


# --- the evaluation --------------------------------------------------------------------------

def evaluate(engine: api.Engine, datasets: Mapping[str, Sequence[tasks_base.Problem]], task, *,
             encode: Callable[[tasks_base.Problem], list[int]],
             decode: Callable[[np.ndarray], str], sampling: api.SamplingParams, k: int,
             seed: int, n: int | None = None,
             encode_text: Callable[[str], list[int]] | None = None,
             max_seq_len: int = 0) -> dict[str, Any]:
  """n samples (default k) of every problem on an idle engine, scored by the task.

  A multi-turn task needs `encode_text` (an observation's token ids) and bounds its episodes
  by `max_seq_len` (the engine's). Returns `summarize(...)` plus 'n', 'seconds' and 'samples'
  (one dict per sample; an episode's also has its turns, tool calls, tool errors and outcome).
  """
  n = n or k
  if n < k:
    raise ValueError(f'need n >= k samples per problem, got n={n} k={k}')
  multi_turn = task.environment() is not None
  items, requests = [], []
  for name, problems in datasets.items():
    for p in problems:
      prompt = () if multi_turn else encode(p)  # an episode's prompt comes from its reset
      for j in range(n):
        requests.append(api.Request(request_id=f'{name}/{p.id}/{j}', prompt_tokens=prompt,
                                    sampling=sampling, seed=sample_seed(seed, name, p.id, j)))
        items.append((name, p, j))
  problems = [p for _, p, _ in items]
  t0 = time.monotonic()
  extra: list[dict[str, Any]] = [{} for _ in items]
  if not multi_turn:
    completions = api.generate(engine, requests)
    texts = [decode(c.tokens) for c in completions]
    scores = task.score_many(problems, texts)  # math: judged in parallel by the verify pool
  else:
    if encode_text is None:
      raise ValueError(f'task {task.name} is multi-turn: evaluate needs encode_text')
    limits = episodes_lib.limits_of(task, sampling, max_seq_len)
    episodes = episodes_lib.run(
        engine, [episodes_lib.start(p, task.environment(), encode, limits,
                                    request_id=r.request_id, seed=r.seed)
                 for p, r in zip(problems, requests)],
        decode=decode, encode_text=encode_text, limits=limits)
    completions = [episodes_lib.completion(e) for e in episodes]
    texts = [decode(c.tokens) for c in completions]
    scores = [e.score for e in episodes]
    extra = [dict(turns=e.turns, tool_calls=e.tool_calls, tool_errors=e.tool_errors,
                  outcome=e.outcome) for e in episodes]
  answers = [task.answer_of(text) for text in texts]
  outcomes: dict[str, dict[str, list[Outcome]]] = {name: {} for name in datasets}
  samples = []
  for (name, p, j), c, text, s, answer, more in zip(items, completions, texts, scores, answers,
                                                    extra):
    outcomes[name].setdefault(p.id, []).append(Outcome(
        correct=s.status == 'correct', answer=answer, num_tokens=len(c.tokens),
        truncated=c.finish_reason == 'length'))
    samples.append(dict(dataset=name, problem_id=p.id, sample=j, prompt=p.prompt,
                        completion=text, answer=answer, status=s.status, reward=s.reward,
                        finish_reason=c.finish_reason, num_tokens=len(c.tokens), **more))
  per_problem = [d.values() for d in outcomes.values()]
  same = equivalence(task, [[o.answer for o in problem] for d in per_problem for problem in d])
  out = summarize({name: list(d.values()) for name, d in outcomes.items()}, k, same)
  out.update(n=n, seconds=time.monotonic() - t0, samples=samples)
  return out


def evaluate_params(config: config_lib.Config, model_config, params, tokenizer, task,
                    datasets: Mapping[str, Sequence[tasks_base.Problem]], *,
                    k: int | None = None, n: int | None = None, device=None,
                    stop_ids: tuple[int, ...] | None = None, backend: str = 'jax',
                    model_dir: str | None = None, max_prompt_len: int | None = None
                    ) -> dict[str, Any]:
  """`evaluate` on an engine built for it, sized from the config and the problem count.

  What both the CLI and the in-training eval call. Sampling comes from config.eval (temperature,
  top_p, top_k, max_tokens: 0 = generation.max_new_tokens), n and k from config.eval unless
  given. Problems whose prompt is longer than `max_prompt_len` (None: generation.max_prompt_len)
  are skipped and counted ('skipped'), not fatal: a long test problem must not end a run at its
  first evaluation. `stop_ids`: what ends a completion (the model dir's
  `hf_tokenizer.stop_token_ids`; None: the tokenizer's EOS).

  backend 'jax': a JAX engine on `device` serving `params` (its KV pool: eval.kv_pool_mb, else
  generation.kv_pool_mb's rule). 'vllm': an in-process vLLM engine on `model_dir` (an HF dir;
  the base of a LoRA run, whose adapters are `params`), serving `params` when given, else the
  checkpoint there.
  """
  g, ev = config.generation, config.eval
  k = k or ev.k
  n = n or ev.samples
  max_prompt_len = max_prompt_len or g.max_prompt_len
  max_tokens = ev.max_tokens or g.max_new_tokens
  encoded: dict[str, list[int]] = {}
  kept, skipped = {}, 0
  for name, problems in datasets.items():
    kept[name] = []
    for p in problems:
      ids = tokenizer.encode(p.prompt, add_special_tokens=False)
      if 0 < len(ids) <= max_prompt_len:
        encoded[p.prompt] = list(ids)
        kept[name].append(p)
      else:
        skipped += 1
  num_requests = sum(map(len, kept.values())) * max(n, k)
  options = dict(engines.jax_options(g), recompute_kv=False,
                 pool_mb=ev.kv_pool_mb or g.kv_pool_mb)
  spec = engines.spec_from_config(
      config, stop_ids or (tokenizer.eos_token_id,), backend=backend,
      num_slots=engines.slots_for(num_requests, g.num_slots),
      max_seq_len=max_prompt_len + max_tokens, jax_options=options)
  if backend == 'jax':
    engine = engines.make_engine(spec, model_config, params=params, device=device,
                                 model_dir=model_dir)
  else:
    engine = engines.make_engine(spec, model_config, params=params, model_dir=model_dir)

  def encode(problem: tasks_base.Problem) -> list[int]:
    """A held-out prompt (encoded above), or the text a multi-turn task's environment starts
    its episode from."""
    if problem.prompt in encoded:
      return encoded[problem.prompt]
    ids = list(tokenizer.encode(problem.prompt, add_special_tokens=False))
    if not 0 < len(ids) <= max_prompt_len:
      raise ValueError(f'problem {problem.id}: the episode starts from {len(ids)} tokens, '
                       f'config.generation.max_prompt_len is {max_prompt_len}')
    return ids

  sampling = api.SamplingParams(temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k,
                                max_tokens=max_tokens)
  try:
    result = evaluate(engine, kept, task, encode=encode,
                      decode=lambda t: tokenizer.decode(t, skip_special_tokens=True),
                      sampling=sampling, k=k, n=n, seed=ev.seed,
                      encode_text=lambda text: list(tokenizer.encode(text,
                                                                     add_special_tokens=False)),
                      max_seq_len=max_prompt_len + max_tokens)
  finally:
    engine.close()
  result['skipped'] = skipped
  return result


def write_samples(path: str, samples: Sequence[Mapping[str, Any]]) -> None:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    for s in samples:
      f.write(json.dumps(s, ensure_ascii=False) + '\n')
