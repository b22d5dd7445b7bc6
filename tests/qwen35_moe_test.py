"""Qwen3.5-MoE (hybrid layers, every MLP routed experts beside a gated shared expert): logits
against transformers' `Qwen3_5MoeForCausalLM` and `Qwen3_5MoeForConditionalGeneration` (fp32,
within 1e-4) for several expert counts, both weight layouts; saved dirs that transformers loads
as the same model; routing replay through the hybrid's runs of layers; what is refused."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pipelinerl_jax import packing
from pipelinerl_jax.models import transformer as tfm
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import moe as moe_lib

from qwen35_test import HYBRID, VISION, hf_logits, randomize  # tests/ is on sys.path under pytest

TEXT = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, moe_intermediate_size=16)
# name -> (Qwen3_5MoeTextConfig fields, composite, save_pretrained's save_original_format)
CASES = {
    # transformers' default plan (every 4th layer full), top-2 of 4, untied, the fused layout.
    'text_4_experts_fused': (dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                  shared_expert_intermediate_size=24,
                                  tie_word_embeddings=False), False, False),
    # A full-attention layer first (four runs of layers), top-3 of 8, tied, the Hub's layout.
    'text_8_experts_hub': (dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                shared_expert_intermediate_size=8, tie_word_embeddings=True,
                                layer_types=['full_attention', 'linear_attention',
                                             'linear_attention', 'full_attention']),
                           False, True),
    # The Hub's composite (vision tower, text_config nested), top-1 of 6, the Hub's layout.
    'composite_6_experts': (dict(num_hidden_layers=4, num_experts=6, num_experts_per_tok=1,
                                 shared_expert_intermediate_size=16, tie_word_embeddings=False),
                            True, True),
}
TOKENS_BxT = np.random.RandomState(0).randint(0, TEXT['vocab_size'], (2, 24))
_logits = jax.jit(tfm.forward_logits, static_argnums=1)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """checkpoint(name) -> (dir, transformers model), weights randomized (`randomize`: routers
  decisive enough that routing matters)."""
  made = {}

  def make(name):
    if name not in made:
      text, composite, hub_layout = CASES[name]
      torch.manual_seed(len(made))
      if composite:
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
            text_config={**TEXT, **text}, vision_config=VISION,
            tie_word_embeddings=text['tie_word_embeddings']))
      else:
        model = transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**TEXT, **text))
      path = tmp_path_factory.mktemp(name)
      randomize(model, scale=0.3).save_pretrained(path, save_original_format=hub_layout)
      made[name] = (path, model)
    return made[name]
  return make


@pytest.mark.parametrize('name', list(CASES))
def test_logits_match_transformers(checkpoint, name):
  path, model = checkpoint(name)
  config = hf_schema.load_config(path)
  text = model.config.get_text_config()
  assert config.architecture == type(model).__name__
  assert config.moe_layers == tuple(range(text.num_hidden_layers)) and config.norm_topk_prob
  assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
          config.shared_expert_intermediate_size) == (
              text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size,
              text.shared_expert_intermediate_size)
  assert config.linear_layers == tuple(i for i, kind in enumerate(text.layer_types)
                                       if kind == 'linear_attention')
  params = hf_checkpoint.load_params(path, config)
  assert params['layers_0']['moe']['shared_expert_gate']['kernel'].shape[1:] == (32, 1)
  ours = np.asarray(_logits(params, config, jnp.asarray(TOKENS_BxT)))
  assert np.max(np.abs(ours - hf_logits(model, TOKENS_BxT))) <= 1e-4
  # The shared expert is part of the output: with its output zeroed the logits move.
  silenced = jax.tree.map(lambda x: x, params)
  for group in (k for k in params if k.startswith('layers')):
    down = silenced[group]['moe']['shared_expert']['down_proj']
    down['kernel'] = jnp.zeros_like(down['kernel'])
  without = np.asarray(_logits(silenced, config, jnp.asarray(TOKENS_BxT)))
  assert np.max(np.abs(without - ours)) > 1e-2


def _tensors(model_dir):
  header, _ = hf_files.read_safetensors_header(model_dir / 'model.safetensors')
  return header


def _raw(model_dir, name):
  """The bytes of tensor `name` in model_dir's model.safetensors."""
  header, start = hf_files.read_safetensors_header(model_dir / 'model.safetensors')
  begin, end = header[name]['data_offsets']
  with open(model_dir / 'model.safetensors', 'rb') as f:
    f.seek(start + begin)
    return f.read(end - begin)


def test_a_text_dir_saves_as_one_that_transformers_loads(checkpoint, tmp_path):
  """Loaded from transformers 5's fused layout, saved in the Hub's (one tensor per expert):
  transformers loads it as the same model."""
  path, model = checkpoint('text_4_experts_fused')
  assert 'model.layers.0.mlp.experts.gate_up_proj' in _tensors(path)
  config = hf_schema.load_config(path)
  original = json.loads((path / 'config.json').read_text())
  hf_checkpoint.save_params(hf_checkpoint.load_params(path, config), config, tmp_path,
                            dtype='float32', extra_config=original)
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert (saved['model_type'], saved['shared_expert_intermediate_size']) == (
      'qwen3_5_moe_text', 24)
  assert 'intermediate_size' not in saved and 'mlp_only_layers' not in saved
  header = _tensors(tmp_path)
  assert 'model.layers.3.mlp.experts.3.down_proj.weight' in header
  assert header['model.layers.3.mlp.shared_expert_gate.weight']['shape'] == [1, 32]
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(again).__name__ == 'Qwen3_5MoeForCausalLM'
  np.testing.assert_array_equal(hf_logits(again, TOKENS_BxT), hf_logits(model, TOKENS_BxT))
  assert hf_schema.load_config(tmp_path) == config


def test_the_composite_exports_as_a_composite(checkpoint, tmp_path):
  """A composite dir saves back as one: the language model's experts under
  model.language_model.*, the vision tower byte for byte, identical logits in transformers."""
  path, model = checkpoint('composite_6_experts')
  config = hf_schema.load_config(path)
  original = json.loads((path / 'config.json').read_text())
  hf_checkpoint.save_params(hf_checkpoint.load_params(path, config), config, tmp_path,
                            dtype='float32', extra_config=original, carry_from=path)
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert saved['architectures'] == ['Qwen3_5MoeForConditionalGeneration']
  assert saved['text_config']['model_type'] == 'qwen3_5_moe_text'
  assert saved['vision_config'] == original['vision_config']
  before, after = _tensors(path), _tensors(tmp_path)
  assert sorted(before) == sorted(after)
  assert 'model.language_model.layers.2.mlp.experts.5.up_proj.weight' in after
  visual = [n for n in before if n.startswith('model.visual.')]
  assert visual and all(_raw(path, n) == _raw(tmp_path, n) for n in visual)
  again = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
  assert type(again).__name__ == 'Qwen3_5MoeForConditionalGeneration'
  np.testing.assert_array_equal(hf_logits(again, TOKENS_BxT), hf_logits(model, TOKENS_BxT))
  assert hf_schema.load_config(tmp_path) == config


# ---------------------------------------------------------------------------------------------
# Routing replay through the hybrid's runs of layers.

# qwen35_test's hybrid, every MLP 8 experts (2 a token) beside a shared expert; three runs.
HYBRID_MOE = dataclasses.replace(
    HYBRID, intermediate_size=0, linear_layers=(0, 2, 3), num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, norm_topk_prob=True, shared_expert_intermediate_size=16,
    moe_layers=(0, 1, 2, 3), architecture='Qwen3_5MoeForCausalLM')


def test_replay_sends_every_model_token_to_the_samplers_experts_in_every_layer():
  """Three runs of layers (linear, full, linear x2), each MoE: under replay every model token's
  experts in every layer are the sampler's (and the grouped dispatch gives what the dense
  reference gives for them), prompt tokens keep the router's own, and the log-probs move with
  the routes."""
  params = jax.tree.map(lambda x: 4 * x, tfm.init_params(HYBRID_MOE, jax.random.PRNGKey(0)))
  rng = np.random.RandomState(1)
  samples = [packing.Sample(prompt_tokens=rng.randint(1, 64, 3),
                            completion_tokens=rng.randint(1, 64, n),
                            behaviour_logprobs=np.zeros(n, np.float32),
                            versions=np.zeros(n, np.int32), advantage=1.0,
                            routes=np.argsort(rng.rand(n, 4, 8), -1)[..., :2].astype(np.uint8))
             for n in (6, 9, 5)]
  batch, _ = packing.pack_samples(samples, seq_len=32)
  on = batch['loss_mask'] > 0
  prompt = ~on & (batch['segment_ids'] > 0)
  args = [jnp.asarray(batch[k]) for k in ('tokens', 'targets', 'positions', 'segment_ids')]
  routed = jax.jit(tfm.token_logprobs_routed, static_argnums=1)
  replay = dict(routes_RxTxLsxXk=jnp.asarray(batch['routes']), replay_RxT=jnp.asarray(on))
  own_logp, _, own = routed(params, HYBRID_MOE, *args)
  logp, _, routes = routed(params, HYBRID_MOE, *args, **replay)
  dense_logp, _, _ = routed(params, dataclasses.replace(HYBRID_MOE, moe_dispatch='dense'), *args,
                            **replay)
  sampler = np.moveaxis(batch['routes'], 2, 0)  # [Ls, R, T, Xk]
  assert routes.used.shape == sampler.shape
  np.testing.assert_array_equal(np.sort(np.asarray(routes.used), -1)[:, on],
                                np.sort(sampler, -1)[:, on])
  np.testing.assert_array_equal(np.asarray(routes.used)[:, prompt], np.asarray(own.own)[:, prompt])
  assert np.mean(np.asarray(moe_lib.differing(own.own, sampler))[:, on]) > 0.5
  np.testing.assert_allclose(np.asarray(logp)[on], np.asarray(dense_logp)[on], atol=1e-5)
  assert np.max(np.abs(np.asarray(logp - own_logp))[on]) > 1e-2


# ---------------------------------------------------------------------------------------------
# What is refused, in one line.

def _moe_text_config(**edit):
  hf = dict(architectures=['Qwen3_5MoeForCausalLM'], model_type='qwen3_5_moe_text',
            vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16)
  hf.update(edit)
  return hf


@pytest.mark.parametrize('edit, message', [
    (dict(norm_topk_prob=False), 'norm_topk_prob=false is not supported'),
    (dict(mlp_only_layers=[1]), re.escape('mlp_only_layers=[1] is not supported')),
    (dict(decoder_sparse_step=2), 'decoder_sparse_step=2 is not supported'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok=9 must be in 1..num_experts=8'),
    (dict(shared_expert_intermediate_size=0), 'shared_expert_intermediate_size=0 must be >= 1'),
    (dict(model_type='qwen3_5_text'), "model_type='qwen3_5_text' does not match"),
])
def test_fields_the_model_cannot_honour_are_refused(edit, message):
  with pytest.raises(ValueError, match='^config.json: ' + message) as e:
    hf_schema.config_from_hf(_moe_text_config(**edit))
  assert '\n' not in str(e.value)


def test_the_fields_the_hub_writes_that_agree_are_accepted():
  """The Hub's text_config lists mlp_only_layers [] and a dense intermediate_size the model does
  not have: accepted, the latter unused."""
  config = hf_schema.config_from_hf(_moe_text_config(mlp_only_layers=[], intermediate_size=512,
                                                     norm_topk_prob=True))
  assert config.intermediate_size == 0 and config.moe_layers == (0, 1, 2, 3)
  # The parameter count the memory plan reads is the model's, shared experts included.
  params = jax.eval_shape(lambda: tfm.init_params(config, jax.random.PRNGKey(0)))
  assert config.num_params == sum(x.size for x in jax.tree.leaves(params))


def test_the_tiny_hybrid_moe_demo_model_is_a_qwen3_5_moe_that_transformers_loads(tmp_path):
  """The demo preset's model, saved as the warm start saves it: transformers loads it as a
  Qwen3_5MoeForCausalLM with every weight found and none left over, and it reads back as the
  model it was built as (3 Gated DeltaNet layers, then full attention; 8 experts and a shared
  one in every layer)."""
  from pipelinerl_jax import config as config_lib
  from pipelinerl_jax.demo import char_tokenizer
  from pipelinerl_jax.demo import warmstart
  demo = config_lib.validate(config_lib.load_preset('tiny_hybrid_moe'), runnable=False).model.demo
  tok = char_tokenizer.build_char_tokenizer()
  config = warmstart.make_model_config(demo, tok.get_vocab_size())
  assert (config.linear_layers, config.moe_layers) == ((0, 1, 2), (0, 1, 2, 3))
  assert (config.num_experts, config.shared_expert_intermediate_size) == (8, 32)
  hf_checkpoint.save_params(tfm.init_params(config, jax.random.PRNGKey(0)), config, tmp_path,
                            dtype='float32',
                            extra_config={**char_tokenizer.special_token_ids(tok),
                                          'bos_token_id': None})
  assert hf_schema.load_config(tmp_path) == config
  model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                  output_loading_info=True)
  assert type(model).__name__ == 'Qwen3_5MoeForCausalLM'
  assert not any(info[k] for k in ('missing_keys', 'unexpected_keys', 'mismatched_keys')), info
