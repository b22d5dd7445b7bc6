"""Character tokenizer, the demo model build (HF dir, cache) and the SFT warm start."""

import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.demo import char_tokenizer
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer
from pipelinerl_jax.tasks import ArithmeticTask
from pipelinerl_jax.tasks.calculator import CalculatorTask

# A build small enough for a test: 32 SFT examples seen 150 times (memorized), never stopped
# early by the accuracy target.
TINY = config_lib.DemoModelConfig(sft_examples=32, batch_size=32, max_steps=150, eval_every=50,
                                  eval_problems=16, target_sampled_accuracy=2.0)
TASK = ArithmeticTask()


@pytest.fixture(scope='module')
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp('demo') / 'model'
  logs = []
  start = time.perf_counter()
  path = warmstart.build_demo_model(out, TINY, TASK, log=logs.append)
  return path, logs, time.perf_counter() - start


def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path):
  tok = char_tokenizer.build_char_tokenizer()
  char_tokenizer.save_tokenizer(tok, tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert hf.eos_token == '<eos>' and hf.pad_token == '<pad>' and hf.bos_token is None
  assert (hf.pad_token_id, hf.eos_token_id) == (0, 1) and len(hf) == tok.get_vocab_size()
  task = ArithmeticTask(ops=('+', '-', '*'))
  texts = [s for p in task.sft_problems(0, 50) for s in (p.prompt, task.target(p))]
  texts += [' a  b . , ', "it's\n\t{x}", char_tokenizer.DEFAULT_ALPHABET]
  for text in texts:
    ids = hf.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, no BOS / EOS added
    assert ids == hf(text)['input_ids'] == tok.encode(text).ids
    assert hf.decode(ids) == text
  ids = hf.encode('37+45=') + [hf.eos_token_id, hf.pad_token_id]
  assert hf.decode(ids, skip_special_tokens=True) == '37+45='
  assert hf.encode('é') == [hf.unk_token_id]  # outside the alphabet


def test_build_writes_a_loadable_hf_dir_with_matching_logits(built):
  path, logs, _ = built
  names = {p.name for p in path.iterdir()}
  assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
          'generation_config.json', warmstart.STAMP_FILE} <= names
  assert not list(path.parent.glob('.model.*'))  # no temp / old dirs left behind
  assert any('building' in line for line in logs)

  config = hf_schema.load_config(path)
  assert config.head_dim in (32, 64) and config.architecture == 'Qwen2ForCausalLM'
  tok = transformers.AutoTokenizer.from_pretrained(path)
  assert config.vocab_size == len(tok)
  assert json.loads((path / 'config.json').read_text())['eos_token_id'] == tok.eos_token_id
  params = hf_checkpoint.load_params(path, config)
  tokens = np.array([tok.encode('37+45=\\boxed{82}'), tok.encode('99*9=\\boxed{891}x')[:16]])
  ours = np.asarray(transformer.forward_logits(params, config, jnp.asarray(tokens)))
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = model(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)


def test_second_build_is_a_cache_hit(built):
  path, _, first_seconds = built
  stamp_mtime = (path / warmstart.STAMP_FILE).stat().st_mtime_ns
  logs = []
  start = time.perf_counter()
  assert warmstart.build_demo_model(path, TINY, TASK, log=logs.append) == path
  assert time.perf_counter() - start < min(1.0, first_seconds / 5)
  assert logs == [] and (path / warmstart.STAMP_FILE).stat().st_mtime_ns == stamp_mtime
  # Other settings would rebuild: the stamp's hash tells them apart.
  stored = warmstart.read_stamp(path)['settings_hash']
  other = dataclasses.replace(TINY, max_steps=151)
  assert warmstart.settings_hash(other, TASK) != stored
  assert warmstart.settings_hash(TINY, ArithmeticTask(digits=3)) != stored
  for change in (dict(architecture='qwen3'), dict(tie_embeddings=True)):
    assert warmstart.settings_hash(dataclasses.replace(TINY, **change), TASK) != stored


def test_sft_lowers_loss_and_learns_the_sft_set(built):
  path, _, _ = built
  stamp = warmstart.read_stamp(path)
  assert stamp['settings_hash'] == warmstart.settings_hash(TINY, TASK)
  losses = [h['loss'] for h in stamp['history']]
  assert [h['step'] for h in stamp['history']] == [50, 100, 150]
  assert losses[-1] < 0.5 * losses[0] and losses[-1] < 0.5

  config = hf_schema.load_config(path)
  tok = char_tokenizer.load_tokenizer(path)
  task = TASK
  sft_set = task.sft_problems(TINY.sft_seed, TINY.sft_examples)
  fresh = transformer.init_params(config, jax.random.PRNGKey(TINY.init_seed))
  before = warmstart.evaluate_accuracy(fresh, config, tok, task, sft_set, 0.0)
  after = warmstart.evaluate_accuracy(hf_checkpoint.load_params(path, config), config, tok, task,
                                      sft_set, 0.0, return_texts=True)
  assert before['accuracy'] == 0.0 and before['statuses']['no_answer'] == len(sft_set)
  assert after['accuracy'] >= 0.75, after
  assert sum(after['statuses'].values()) == after['num'] == len(sft_set)
  assert all(t.startswith('\\boxed{') for t in after['texts'])


def test_evaluate_accuracy_greedy_is_deterministic_sampling_is_seeded(built):
  path, _, _ = built
  config = hf_schema.load_config(path)
  params = hf_checkpoint.load_params(path, config)
  tok = char_tokenizer.build_char_tokenizer()  # the in-process tokenizer works as well
  task = TASK
  problems = task.sft_problems(TINY.sft_seed, 16)
  run = lambda temp, seed: warmstart.evaluate_accuracy(params, config, tok, task, problems, temp,
                                                       seed=seed, return_texts=True)['texts']
  assert run(0.0, 0) == run(0.0, 1)
  assert run(1.0, 3) == run(1.0, 3)
  samples = [run(5.0, s) for s in (0, 1)]  # hot enough that two seeds must differ somewhere
  assert samples[0] != samples[1]


def _ids_in(batch) -> list[int]:
  """Example ids in a packed batch (example i's completion tokens are all i + 1)."""
  return sorted(t - 1 for t in set(batch['targets'][batch['loss_mask'] > 0].tolist()))


def test_packed_batches_share_rows_in_stream_order_and_lose_nothing():
  # 50 examples of 5..40 positions into 2 rows of 64: several share a row, and those that no
  # longer fit a step open the next one, in stream order, none dropped or repeated.
  lengths = np.random.default_rng(0).integers(3, 39, size=50)
  examples = [([1] * 3, [i + 1] * int(n)) for i, n in enumerate(lengths)]
  stream = itertools.chain(range(50), itertools.repeat(49))
  carried, steps = [], []
  while not steps or 49 not in steps[-1]:
    batch, carried = warmstart.next_packed_batch(examples, stream, carried, 64, 2, 100)
    assert batch['tokens'].shape == (2, 64)
    steps.append(_ids_in(batch))
  assert sum(steps, [])[:49] == list(range(49))  # each once, in order
  assert len(steps) < 25  # more than one example per row on average
  batch, carried = warmstart.next_packed_batch(examples, iter(range(50)), [], 64, 2, 3)
  assert _ids_in(batch) == [0, 1, 2] and carried == []  # the example cap holds


def test_demo_settings_are_checked():
  with pytest.raises(ValueError, match='head_dim'):
    config_lib.DemoModelConfig(hidden_size=48, head_dim=24)
  c = config_lib.base_config()
  c.model.demo.no_such_field = 1
  with pytest.raises(ValueError, match=r'^config.model.demo.no_such_field: unknown key'):
    config_lib.validate(c)


def test_model_dir_for_a_config_builds_the_demo_model_of_its_task(tmp_path):
  c = config_lib.base_config()
  c.model.cache_dir = str(tmp_path)
  c.model.demo.max_steps = 0
  c.model.demo.eval_problems = 8
  c.task.ops = ('+', '-')
  config = config_lib.validate(c)
  path = warmstart.model_dir_for(config)
  stamp = warmstart.read_stamp(path)
  assert path.startswith(str(tmp_path)) and stamp['task']['ops'] == ['+', '-']
  assert stamp['settings_hash'] == warmstart.settings_hash(config.model.demo,
                                                           ArithmeticTask(ops=('+', '-')))
  c.model.path = str(tmp_path / 'nowhere')
  with pytest.raises(FileNotFoundError, match='config.model.path: no config.json'):
    warmstart.model_dir_for(config_lib.validate(c))


def test_multi_turn_sft_examples_carry_loss_on_model_turns_only():
  """A calculator episode's observation tokens are fed (inputs) but never targets of the loss;
  its model turns and each turn's EOS are; one-turn examples keep their whole completion."""
  tok = char_tokenizer.build_char_tokenizer()
  eos = warmstart.eos_id(tok)
  task = CalculatorTask(sft_tool_share=0.5)
  problems = task.sft_problems(0, 40)
  examples = warmstart.encode_examples(tok, task, problems)
  assert {len(e) for e in examples} == {2, 3}  # both kinds
  for p, e in zip(problems, examples):
    turns = task.target_turns(p)
    batch = warmstart.pack_examples([e], 64, 1)
    at = batch['segment_ids'] > 0
    got = ''.join('|' if t == eos else tok.decode([t])
                  for t in batch['targets'][at & (batch['loss_mask'] > 0)])
    assert got == ''.join(turns[j] + '|' for j in range(0, len(turns), 2)), got
    fed = tok.decode(batch['tokens'][at].tolist(), skip_special_tokens=True)
    assert fed == p.prompt + ''.join(turns)  # observations are in the inputs
  # Packed together, each example keeps its own mask: loss tokens add up.
  batch = warmstart.pack_examples(examples, 128, 16)
  assert batch['loss_mask'].sum() == sum(
      sum(e[2]) if len(e) == 3 else len(e[1]) for e in examples)
  s_id = tok.token_to_id('s')  # in every observation ('<res>', '</res>'), in no model turn
  calls = sum(len(e) == 3 for e in examples)
  assert np.sum(batch['targets'] == s_id) == 2 * calls > 0
  assert not np.any((batch['targets'] == s_id) & (batch['loss_mask'] > 0))
