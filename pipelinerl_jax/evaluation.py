"""pass@1 and pass@k on held-out problems: one code path for the CLI (evaluate.py), for
in-training evals and for the demo model's warm start.

A run with `eval.every_steps > 0` calls `evaluate_params` on its current params and logs
`eval/pass@1`, `eval/pass@<k>` (and `eval/<dataset>/...` when there are several datasets) into
the step's metrics record; `python -m pipelinerl_jax.evaluate` calls the same function on a
checkpoint.

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

import json
import math
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
  correct: dict[str, dict[str, list[bool]]] = {name: {} for name in datasets}
  samples = []
  for (name, p, j), c, text, s, more in zip(items, completions, texts, scores, extra):
    correct[name].setdefault(p.id, []).append(s.status == 'correct')
    samples.append(dict(dataset=name, problem_id=p.id, sample=j, prompt=p.prompt,
                        completion=text, status=s.status, reward=s.reward,
                        finish_reason=c.finish_reason, num_tokens=len(c.tokens), **more))
  out = summarize({name: list(d.values()) for name, d in correct.items()}, k)
  out.update(n=n, seconds=time.monotonic() - t0, samples=samples)
  return out


def evaluate_params(config: config_lib.Config, model_config, params, tokenizer, task,
                    datasets: Mapping[str, Sequence[tasks_base.Problem]], *,
                    k: int | None = None, n: int | None = None, device=None,
                    stop_ids: tuple[int, ...] | None = None) -> dict[str, Any]:
  """`evaluate` with a JAX engine built on `params`, sized from the config and problem count.

  What both the CLI and the in-training eval call. Problems whose prompt is longer than
  generation.max_prompt_len are skipped and counted ('skipped'), not fatal: a long test problem
  must not end a run at its first evaluation. `stop_ids`: what ends a completion (the model dir's
  `hf_tokenizer.stop_token_ids`; None: the tokenizer's EOS).
  """
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
  spec = engines.spec_from_config(
      config, stop_ids or (tokenizer.eos_token_id,), backend='jax',
      num_slots=engines.slots_for(num_requests, g.num_slots),
      jax_options=dict(engines.jax_options(g), recompute_kv=False))
  engine = engines.make_engine(spec, model_config, params=params, device=device)

  def encode(problem: tasks_base.Problem) -> list[int]:
    """A held-out prompt (encoded above), or the text a multi-turn task's environment starts
    its episode from."""
    if problem.prompt in encoded:
      return encoded[problem.prompt]
    ids = list(tokenizer.encode(problem.prompt, add_special_tokens=False))
    if not 0 < len(ids) <= g.max_prompt_len:
      raise ValueError(f'problem {problem.id}: the episode starts from {len(ids)} tokens, '
                       f'config.generation.max_prompt_len is {g.max_prompt_len}')
    return ids

  sampling = api.SamplingParams(temperature=ev.temperature, top_p=g.top_p, top_k=g.top_k,
                                max_tokens=g.max_new_tokens)
  try:
    result = evaluate(engine, kept, task, encode=encode,
                      decode=lambda t: tokenizer.decode(t, skip_special_tokens=True),
                      sampling=sampling, k=k, n=n, seed=ev.seed,
                      encode_text=lambda text: list(tokenizer.encode(text,
                                                                     add_special_tokens=False)),
                      max_seq_len=g.max_seq_len)
  finally:
    engine.close()
  result['skipped'] = skipped
  return result


def write_samples(path: str, samples: Sequence[Mapping[str, Any]]) -> None:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    for s in samples:
      f.write(json.dumps(s, ensure_ascii=False) + '\n')
