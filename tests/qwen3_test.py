"""The Qwen3-format test model (conftest's qwen3_model_dir: per-head q/k norms, no biases, tied
embeddings) through the pipeline: a short RL run with the JAX engine whose checkpoint is exported
and greedy-decoded by transformers. With vLLM it is pipeline_test's inline run and the model
vllm_engine_test serves (updates between two token steps, log mu against the trainer's)."""

import json
import pathlib
import shutil

import numpy as np

from pipelinerl_jax import export as export_lib
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import engines
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib

import pipeline_test  # its small_config (tests/ is on sys.path under pytest)
from checkpoint_test import varied_rewards  # noqa: F401  (a fixture: rewards that vary)

# Prompts of the char tokenizer's ids, decoded greedily for up to MAX_TOKENS.
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [20, 4, 20]]
MAX_TOKENS = 10


def test_the_qwen3_model_dir_is_what_transformers_calls_qwen3(qwen3_model_dir):
  hf = json.loads((pathlib.Path(qwen3_model_dir) / 'config.json').read_text())
  assert (hf['architectures'], hf['model_type'], hf['tie_word_embeddings']) == (
      ['Qwen3ForCausalLM'], 'qwen3', True)
  config = hf_schema.load_config(qwen3_model_dir)
  assert config.qk_norm and not config.qkv_bias and config.tie_embeddings


def test_rl_with_the_jax_engine_then_export_decodes_alike_in_transformers(
    qwen3_model_dir, tmp_path, monkeypatch, varied_rewards):
  """The run stops on every id of generation_config.json's list; its last checkpoint, exported,
  is a Qwen3 dir that transformers loads and greedy-decodes as our engine does."""
  import torch
  import transformers
  model_dir = tmp_path / 'model'
  shutil.copytree(qwen3_model_dir, model_dir)
  eos = hf_tokenizer.load_tokenizer(model_dir).eos_token_id
  (model_dir / 'generation_config.json').write_text(json.dumps({'eos_token_id': [eos, 3]}))
  specs, spec_from_config = [], engines.spec_from_config
  monkeypatch.setattr(engines, 'spec_from_config',
                      lambda *a, **kw: specs.append(spec_from_config(*a, **kw)) or specs[-1])
  launch.run_experiment(pipeline_test.small_config(max_lag=1, total_steps=3),
                        str(tmp_path / 'run'), model_dir=str(model_dir))
  records = metrics_lib.read_metrics(str(tmp_path / 'run' / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2, 3] and max(r['lag_max'] for r in records) <= 1
  # Step 1 trains on tokens of version 0 with version 0's params: the engine's log mu and the
  # trainer's log pi differ only by numerics (both fp32).
  assert records[0]['lag_max'] == 0 and records[0]['abs_logp_diff'] <= 1e-4, records[0]
  assert specs[0].eos_token_ids == tuple(sorted({eos, 3}))

  out = tmp_path / 'hf'
  export_lib.export_hf(tmp_path / 'run' / 'checkpoints', None, out)
  config = hf_schema.load_config(out)
  assert config == hf_schema.load_config(qwen3_model_dir)
  params = hf_checkpoint.load_params(out, config)
  q_norm = params['layers']['attn']['q_norm']['scale']
  assert not np.array_equal(q_norm, np.ones_like(q_norm))  # trained: RL moved the q/k norms
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(model).__name__ == 'Qwen3ForCausalLM'
  np.testing.assert_array_equal(model.model.layers[1].self_attn.q_norm.weight.detach().numpy(),
                                np.asarray(q_norm[1]))
  stop = hf_tokenizer.stop_token_ids(out, hf_tokenizer.load_tokenizer(out))
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
