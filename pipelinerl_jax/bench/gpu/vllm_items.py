"""The items of the vllm section's serve part (vllm.py), each given a served VllmEngine: its start
against the memory plan, weight updates over DLPack, the engine stepped one token at a time with
an update between two token steps (log mu against the JAX trainer), and decode tokens/s."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pipelinerl_jax.bench.gpu import presets
from pipelinerl_jax.bench.gpu import section as section_lib

LOGPROB_BUDGET = 1e-2    # mean |log mu - log pi| in nats docs/results.md sets for bf16


def logprob_deltas(ours, ref) -> dict[str, Any]:
  """mean / max |ours - ref| over the tokens of a group (lists of 1-D arrays)."""
  import numpy as np
  d = np.abs(np.concatenate([np.asarray(a, np.float64) for a in ours])
             - np.concatenate([np.asarray(b, np.float64) for b in ref]))
  return dict(tokens=int(d.size), mean=float(d.mean()) if d.size else None,
              max=float(d.max()) if d.size else None)


def start_item(s, engine, config, run_config, name, before, start_s, save_s, on_cuda):
  """The served engine as started: vLLM's KV cache against the memory plan's, the memory share
  it was given, the attention backend it chose."""
  import jax
  import torch
  from pipelinerl_jax import memory_plan
  import vllm
  kv = engine.kv_cache_info()
  fields = dict(model=name, params=config.num_params, serving_dtype='bfloat16',
                start_s=start_s, save_s=save_s, kv_cache_bytes=kv['bytes'],
                kv_blocks=kv['num_blocks'], kv_block_size=kv['block_size'],
                kv_tokens=kv['num_blocks'] * kv['block_size'],
                cuda_graphs=not engine.llm_kwargs.get('enforce_eager', True),
                vllm_version=vllm.__version__, torch=torch.__version__,
                jax_backend=jax.default_backend(), attention=_attention_impl(engine.model),
                jax_memory=section_lib.device_memory(jax.devices()[0]))
  if on_cuda:
    free, total = before
    # The memory plan with what was in use when vLLM started (JAX's params, the CUDA contexts).
    plan, facts = memory_plan.generator_memory(
        config, run_config, 'bfloat16', total, 'free', config.param_dtype,
        used_by_trainer=max(0, total - free - memory_plan.CUDA_CONTEXT_BYTES))
    after_free, _ = torch.cuda.mem_get_info()
    fields.update(device_bytes=total, used_before_bytes=total - free,
                  used_after_bytes=total - after_free,
                  gpu_memory_utilization=engine.llm_kwargs['gpu_memory_utilization'],
                  planned_gpu_memory_utilization=facts['vllm_gpu_memory_utilization'],
                  planned_kv_cache_bytes=plan['kv'],
                  kv_over_planned=kv['bytes'] / plan['kv'] if plan['kv'] else None,
                  planned_terms=plan)
  else:
    fields.update(planned_kv_cache_bytes=engine.config.kv_cache_bytes,
                  kv_over_planned=kv['bytes'] / engine.config.kv_cache_bytes)
  s.add(f'start {name}', **fields)


def _attention_impl(model) -> str | None:
  """The class of the first attention implementation in the served model (the backend vLLM
  chose), with its FlashAttention version where it has one."""
  for module in model.modules():
    impl = getattr(module, 'impl', None)
    if impl is not None and hasattr(impl, 'forward'):
      version = getattr(impl, 'vllm_flash_attn_version', None)
      return type(impl).__name__ + (f' (FA{version})' if version else '')
  return None


def update_item(s, engine, config, param_sets, label: str, repeats: int) -> None:
  """Updates JAX -> DLPack -> vLLM: which HF tensors alias the params' buffers, whether vLLM
  loads in place (its parameters keep their pointers, which CUDA graphs captured) and the
  values it then holds, and the time of an update (views, load, device work) against one
  device copy of the same bytes."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  from pipelinerl_jax.generation.transport import hf_tensors
  if s.remaining() < 5:
    s.skip(label, 'time budget')
    return
  p0, p1 = param_sets
  zero_copy = hf_tensors.zero_copy_report(p1, config)
  params = dict(engine.model.named_parameters())
  pointers = {n: p.data_ptr() for n, p in params.items()}
  version = engine.version
  runs = []
  for i in range(repeats + 1):  # the first is a warm-up
    version += 1
    t0 = time.perf_counter()
    engine.update_params(param_sets[version % 2], version)
    engine.apply_update()
    runs.append(time.perf_counter() - t0)
  last = param_sets[version % 2]
  params = dict(engine.model.named_parameters())
  embed = params['model.embed_tokens.weight']
  rows = np.array([0, config.vocab_size // 2, config.vocab_size - 1])
  served = embed[torch.as_tensor(rows, device=embed.device)].float().cpu().numpy()
  want = np.asarray(jnp.asarray(last['embed']['embedding'][rows], jnp.bfloat16).astype(
      jnp.float32))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(p0))
  flat = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)
  copy_runs = section_lib.wall_times(lambda: copy(flat), repeats)
  del flat
  u, c = statistics.median(runs[1:]), statistics.median(copy_runs)
  s.add(label, bytes=nbytes, tensors=len(zero_copy),
        zero_copy_tensors=sum(zero_copy.values()),
        not_zero_copy=[n for n, ok in zero_copy.items() if not ok][:5],
        in_place=all(params[n].data_ptr() == ptr for n, ptr in pointers.items()),
        values_equal=bool(np.array_equal(served, want)), update_s=u, update_s_runs=runs,
        copy_s=c, update_over_copy=u / c, cuda_graphs=not engine.llm_kwargs.get('enforce_eager',
                                                                              True))


def _stale_kv_logprobs(p_old, p_new, config, prompts, tokens, k: int):
  """log pi of each row's tokens when the weights changed before generated token k and the KV
  cache of the prompt and tokens 0..k-2 was kept from the old weights (PipelineRL's stale
  cache): what an engine that keeps its cache computes. Rows of equal lengths, [R, n] out."""
  import jax
  import jax.numpy as jnp
  from pipelinerl_jax.models import transformer
  prompts, tokens = jnp.asarray(prompts), jnp.asarray(tokens)
  r, p = prompts.shape
  n = tokens.shape[1]
  seq = jnp.concatenate([prompts, tokens], axis=1)
  positions = jnp.broadcast_to(jnp.arange(p + n - 1), (r, p + n - 1))
  old, _ = transformer.token_logprobs(p_old, config, seq[:, :-1], seq[:, 1:], positions,
                                      jnp.ones_like(positions))
  ctx = seq[:, :p + k - 1]
  cache = transformer.init_cache(config, r, p + n)
  _, cache = transformer.decode(p_old, config, ctx, positions[:, :p + k - 1], cache)
  rest = seq[:, p + k - 1:-1]
  logits, _ = transformer.decode(p_new, config, rest, positions[:, p + k - 1:], cache)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  new = jnp.take_along_axis(logp, tokens[:, k:, None], axis=-1)[..., 0]
  return jnp.concatenate([old[:, p - 1:p - 1 + k], new], axis=1)


def _trainer_logprobs(params, config, prompts, tokens):
  """The trainer's log pi of each row's tokens (one forward over prompt + tokens), [R, n]."""
  import jax.numpy as jnp
  from pipelinerl_jax.models import transformer
  seq = jnp.concatenate([jnp.asarray(prompts), jnp.asarray(tokens)], axis=1)
  r, t = seq.shape
  positions = jnp.broadcast_to(jnp.arange(t - 1), (r, t - 1))
  lp, ent = transformer.token_logprobs(params, config, seq[:, :-1], seq[:, 1:], positions,
                                       jnp.ones_like(positions))
  p = jnp.asarray(prompts).shape[1]
  return lp[:, p - 1:], ent[:, p - 1:]


def stepped_item(s, engine, config, p0, p1, z: presets.VllmSizes) -> None:
  """vLLM stepped one token at a time with an update between two token steps. Requests 'old'
  start under p0, and p1 is applied before token step `check_update_at`; requests 'new' start
  right after it. Checks: every step gives each running sequence exactly one token; per-token
  versions; log mu against the JAX trainer on the same weights and tokens: 'old' tokens before
  the update and all of 'new' against full forwards (fp32 and bf16-compute trainers), 'old'
  tokens after it against the stale-KV computation; 'new' against p0 shows the update landed."""
  import dataclasses as dc
  import numpy as np
  if s.remaining() < 10:
    s.skip('stepped', 'time budget')
    return
  k, n = z.check_update_at, z.check_tokens
  base = engine.version
  old = section_lib.make_requests(z.check_requests, z.check_prompt_len, n, config.vocab_size, 11)
  new = section_lib.make_requests(z.check_requests, z.check_prompt_len, n, config.vocab_size, 12)
  engine.update_params(p0, base + 1)
  engine.apply_update()
  for r in old:
    engine.submit(r)
  done, steps, one_token = {}, 0, True
  while engine.num_unfinished:
    if steps == k:
      engine.update_params(p1, base + 2)
      engine.apply_update()
      for r in new:
        engine.submit(r)
    running = engine.num_unfinished
    before = engine.stats()['tokens_generated']
    done.update((c.request_id, c) for c in engine.step())
    one_token &= engine.stats()['tokens_generated'] - before == running
    steps += 1
  olds = [done[r.request_id] for r in old]
  news = [done[r.request_id] for r in new]
  versions_ok = (all(list(c.versions) == [base + 1] * k + [base + 2] * (n - k) for c in olds)
                 and all(list(c.versions) == [base + 2] * n for c in news))
  rows = lambda cs: (np.array([c.prompt_tokens for c in cs]), np.array([c.tokens for c in cs]))
  trainer_bf16 = dc.replace(config, dtype='bfloat16', lm_head_fp32=True)
  fields = dict(requests=2 * z.check_requests, tokens_each=n, update_before_step=k,
                steps=steps, one_token_per_step=bool(one_token), versions_ok=bool(versions_ok))
  ours_old = [c.logprobs for c in olds]
  ours_new = [c.logprobs for c in news]
  for label, cfg in (('fp32', config), ('bf16', trainer_bf16)):
    lp_old, _ = _trainer_logprobs(p0, cfg, *rows(olds))
    lp_new, ent = _trainer_logprobs(p1, cfg, *rows(news))
    stale = _stale_kv_logprobs(p0, p1, cfg, *rows(olds), k)
    fields[f'vs_{label}_before_update'] = logprob_deltas([o[:k] for o in ours_old],
                                                         np.asarray(lp_old)[:, :k])
    fields[f'vs_{label}_stale_kv'] = logprob_deltas([o[k:] for o in ours_old],
                                                    np.asarray(stale)[:, k:])
    fields[f'vs_{label}_new_requests'] = logprob_deltas(ours_new, np.asarray(lp_new))
    if label == 'fp32':
      fields['entropy_new_mean'] = float(np.asarray(ent).mean())
      wrong, _ = _trainer_logprobs(p0, cfg, *rows(news))
      fields['new_requests_vs_old_weights'] = logprob_deltas(ours_new, np.asarray(wrong))
  groups = ('before_update', 'stale_kv', 'new_requests')
  fields['within_budget'] = all(fields[f'vs_fp32_{g}']['mean'] <= LOGPROB_BUDGET for g in groups)
  fields['budget'] = LOGPROB_BUDGET
  s.add('stepped', **fields)


def decode_items(s, engine, config, param_sets, z: presets.VllmSizes) -> None:
  """Decode tokens/s at each H, the engine section's shapes and workload (bench.generation's
  run_once), without and with an update before every token step."""
  from pipelinerl_jax.bench import generation as gen_bench
  params_for = lambda version: param_sets[version % 2]
  done = [i for i in s.record['items'] if 'update_s' in i and i['status'] == 'ok']
  update_s = done[-1]['update_s'] if done else 0.0  # one update, measured before
  last = None  # (H, ms per step) of the previous timed run, to predict the next one
  for mode, every in (('none', 0), ('update', 1)):
    for h in z.slots:
      name = f'H={h} {mode}'
      if last is not None:
        step_s = last[1] / 1e3 * max(1.0, h / last[0]) + (update_s if every else 0.0)
        predicted = step_s * z.new_tokens * 1.5 + 5
        if predicted > s.remaining():
          s.skip(name, f'time budget (predicted {predicted:.0f} s)')
          continue
      try:
        t0, version = time.perf_counter(), engine.version
        version = gen_bench.run_once(
            engine, section_lib.make_requests(h, z.prompt_len, 2, config.vocab_size, 1),
            params_for, every, h, version)['version']
        warmup_s = time.perf_counter() - t0
        r = gen_bench.run_once(
            engine, section_lib.make_requests(h, z.prompt_len, z.new_tokens, config.vocab_size, 3),
            params_for, every, h, version)
      except Exception as e:
        s.fail(name, e)
        continue
      last = (h, r['ms_per_step'])
      s.add(name, slots=h, mode=mode, prompt_len=z.prompt_len, new_tokens=z.new_tokens,
            warmup_s=warmup_s, **{k: v for k, v in r.items() if k != 'version'})
