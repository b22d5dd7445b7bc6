"""Qwen3.5 (hybrid: Gated DeltaNet layers among gated full-attention ones): logits against
transformers' `Qwen3_5ForCausalLM` and `Qwen3_5ForConditionalGeneration` (fp32, within 1e-4) on
random tiny models of several shapes; a composite dir exported back as one, its vision tower
byte for byte; packed rows against their sequences alone; the chunked delta rule against the
recurrent one, and a layer decoded token by token from its state against its chunked form;
gradients and a train step on a tiny hybrid; what is refused."""

import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.models import transformer as tfm
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import gated_delta

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, rms_norm_eps=1e-6)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)
# name -> (Qwen3_5TextConfig fields, composite). Heads and kernels vary; value heads > key heads.
CASES = {
    # transformers' default plan (every 4th layer full), untied, 2 value heads per key head.
    'text_untied_conv4': (dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=12,
                               linear_conv_kernel_dim=4, tie_word_embeddings=False), False),
    # A full-attention layer first and runs of 1 and 2: five scans. Tied, kernel 2.
    'text_tied_conv2': (dict(num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                             linear_key_head_dim=16, linear_value_head_dim=8,
                             linear_conv_kernel_dim=2, tie_word_embeddings=True,
                             layer_types=['full_attention', 'linear_attention',
                                          'linear_attention', 'full_attention',
                                          'linear_attention']), False),
    # The Hub's layout: vision tower, text_config nested, tied at the top; 3 value heads a key.
    'composite_conv3': (dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=3, tie_word_embeddings=True), True),
}
TOKENS_BxT = np.random.RandomState(0).randint(0, TEXT['vocab_size'], (2, 40))
_logits = jax.jit(tfm.forward_logits, static_argnums=1)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """checkpoint(name) -> (dir, transformers model), weights randomized (norms off their init,
  so the (1 + w) convention matters)."""
  made = {}

  def make(name):
    if name not in made:
      text, composite = CASES[name]
      torch.manual_seed(len(made))
      if composite:
        config = transformers.Qwen3_5Config(text_config={**TEXT, **text}, vision_config=VISION,
                                            tie_word_embeddings=text['tie_word_embeddings'])
        model = transformers.Qwen3_5ForConditionalGeneration(config)
      else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT, **text))
      path = tmp_path_factory.mktemp(name)
      randomize(model).save_pretrained(path)
      made[name] = (path, model)
    return made[name]
  return make


def randomize(model, scale=0.2):
  """`model` in eval mode, its weights drawn afresh (norms off their init, so the (1 + w)
  convention matters), the decay's A_log and dt_bias as initialized."""
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if not pname.endswith(('A_log', 'dt_bias')):  # keep the decay's own init
        p.copy_((0.1 if 'norm' in pname else scale) * torch.randn_like(p))
  return model.eval()


def hf_logits(model, tokens_BxT):
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens_BxT)).logits.numpy()


@pytest.mark.parametrize('name', list(CASES))
def test_logits_match_transformers(checkpoint, name):
  path, model = checkpoint(name)
  config = hf_schema.load_config(path)
  text = model.config.get_text_config()
  assert config.architecture == model.config.architectures[0] == type(model).__name__
  assert config.linear_layers == tuple(i for i, kind in enumerate(text.layer_types)
                                       if kind == 'linear_attention')
  assert config.tie_embeddings == model.config.tie_word_embeddings
  assert (config.rotary_dim, config.linear_conv_kernel) == (text.head_dim // 4,
                                                            text.linear_conv_kernel_dim)
  params = hf_checkpoint.load_params(path, config)
  ours = np.asarray(_logits(params, config, jnp.asarray(TOKENS_BxT)))
  assert np.max(np.abs(ours - hf_logits(model, TOKENS_BxT))) <= 1e-4


def test_a_text_dir_saves_as_one_that_transformers_loads(checkpoint, tmp_path):
  path, model = checkpoint('text_tied_conv2')
  config = hf_schema.load_config(path)
  original = json.loads((path / 'config.json').read_text())
  hf_checkpoint.save_params(hf_checkpoint.load_params(path, config), config, tmp_path,
                            dtype='float32', extra_config=original)
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert (saved['model_type'], saved['layer_types']) == ('qwen3_5_text', original['layer_types'])
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(again).__name__ == 'Qwen3_5ForCausalLM'
  np.testing.assert_array_equal(hf_logits(again, TOKENS_BxT), hf_logits(model, TOKENS_BxT))
  assert hf_schema.load_config(tmp_path) == config


def test_the_composite_exports_as_a_composite_with_its_vision_tower_unchanged(
    checkpoint, tmp_path, caplog):
  """Loading takes the language model and says once that the vision tower is not loaded; a save
  writes the composite layout back, the vision tower copied byte for byte, and transformers
  loads it as the model it was (trained weights aside: here none changed)."""
  path, model = checkpoint('composite_conv3')
  config = hf_schema.load_config(path)
  with caplog.at_level(logging.WARNING):
    params = hf_checkpoint.load_params(path, config)
  notes = [r.getMessage() for r in caplog.records if 'not loaded' in r.getMessage()]
  assert len(notes) == 1 and 'tensors under model.visual.*' in notes[0], notes
  original = json.loads((path / 'config.json').read_text())
  with pytest.raises(ValueError, match=r'^save_params: .* carry_from=None has none'):
    hf_checkpoint.save_params(params, config, tmp_path / 'bare', extra_config=original)
  out = tmp_path / 'out'
  hf_checkpoint.save_params(params, config, out, dtype='float32', extra_config=original,
                            carry_from=path)
  saved = json.loads((out / 'config.json').read_text())
  assert saved['architectures'] == ['Qwen3_5ForConditionalGeneration']
  assert saved['vision_config'] == original['vision_config']
  assert saved['text_config']['layer_types'] == original['text_config']['layer_types']

  def tensors(model_dir):  # name -> (dtype, shape, raw bytes)
    header, start = hf_files.read_safetensors_header(model_dir / 'model.safetensors')
    raw = (model_dir / 'model.safetensors').read_bytes()
    return {n: (e['dtype'], e['shape'], raw[start + e['data_offsets'][0]:
                                            start + e['data_offsets'][1]])
            for n, e in header.items()}
  before, after = tensors(path), tensors(out)
  assert sorted(before) == sorted(after)  # the same tensors, the language model's renamed none
  visual = [n for n in before if n.startswith('model.visual.')]
  assert visual and all(after[n] == before[n] for n in visual)
  again = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
  assert type(again).__name__ == 'Qwen3_5ForConditionalGeneration'
  np.testing.assert_array_equal(hf_logits(again, TOKENS_BxT), hf_logits(model, TOKENS_BxT))
  assert hf_schema.load_config(out) == config


# ---------------------------------------------------------------------------------------------
# Packed rows, the two forms of the delta rule, gradients.

HYBRID = tfm.ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, qk_norm=True, attention_output_gate=True,
    partial_rotary_factor=0.5, norm_zero_centered=True, linear_layers=(0, 1, 3),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel=4, linear_chunk_size=4,
    architecture='Qwen3_5ForCausalLM', attention='dense')


def hybrid_params(key=0):
  """Random params, norms off their init, matrices x3 (so that every layer matters); the
  decays' A_log and dt_bias as initialized."""
  params = tfm.init_params(HYBRID, jax.random.PRNGKey(key))
  leaves, tree = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.PRNGKey(key + 1), len(leaves))
  out = [x + 0.1 * jax.random.normal(k, x.shape) if 'norm' in jax.tree_util.keystr(p)
         else 3 * x if x.ndim > 2 else x for (p, x), k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, out)


def test_a_packed_row_equals_its_sequences_run_alone():
  """Three sequences in one row (boundaries inside and between chunks of 4) and padding: each
  sequence's log-probs are those of the sequence alone, so the state and the convolution window
  are reset at every boundary."""
  params = hybrid_params()
  rng = np.random.RandomState(1)
  lengths = (7, 9, 5)
  seqs = [rng.randint(1, HYBRID.vocab_size, n) for n in lengths]
  t = sum(lengths) + 3
  tokens = np.zeros((1, t), np.int32)
  positions, segments = np.zeros_like(tokens), np.zeros_like(tokens)
  start = 0
  for i, s in enumerate(seqs):
    tokens[0, start:start + len(s)] = s
    positions[0, start:start + len(s)] = np.arange(len(s))
    segments[0, start:start + len(s)] = i + 1
    start += len(s)
  targets = np.roll(tokens, -1, axis=1)
  logprobs = jax.jit(tfm.token_logprobs, static_argnums=1)
  packed, _ = logprobs(params, HYBRID, tokens, targets, positions, segments)
  start = 0
  for s in seqs:
    n = len(s)
    alone, _ = logprobs(params, HYBRID, tokens[:, start:start + n], targets[:, start:start + n],
                        positions[:, start:start + n], np.ones((1, n), np.int32))
    np.testing.assert_allclose(np.asarray(packed)[0, start:start + n - 1],
                               np.asarray(alone)[0, :n - 1], atol=2e-5)
    start += n


def test_chunked_delta_rule_equals_the_recurrent_one_with_gradients():
  """The chunked form (chunks of 8, segments starting inside and at chunk edges, a state handed
  in) against the token-by-token recurrence: outputs, final state and every input's gradient."""
  keys = jax.random.split(jax.random.PRNGKey(3), 6)
  r, t, hv, dk, dv = 2, 29, 3, 8, 5
  q = gated_delta.l2_normalize(jax.random.normal(keys[0], (r, t, hv, dk))) * dk ** -0.5
  k = gated_delta.l2_normalize(jax.random.normal(keys[1], (r, t, hv, dk)))
  v = jax.random.normal(keys[2], (r, t, hv, dv))
  g = -2.0 * jax.random.uniform(keys[3], (r, t, hv))
  beta = jax.random.uniform(keys[4], (r, t, hv))
  state = 0.3 * jax.random.normal(keys[5], (r, hv, dk, dv))
  ids = np.ones((r, t), np.int32)
  ids[0, 8:], ids[0, 19:] = 2, 3  # row 0: a sequence starts at a chunk edge and inside one
  ids[1, 12:] = 2
  index = gated_delta.segment_index(jnp.asarray(ids))
  args = (q, k, v, g, beta)

  def run(form):
    def loss(*a):
      o, s = form(*a)
      return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(s)), (o, s)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))(
        *args, state)

  (_, (o_c, s_c)), grads_c = run(
      lambda *a: gated_delta.delta_rule_chunked(*a[:5], index, a[5], chunk=8))
  (_, (o_r, s_r)), grads_r = run(lambda *a: gated_delta.delta_rule_recurrent(*a[:5], index, a[5]))
  np.testing.assert_allclose(o_c, o_r, atol=1e-5)
  np.testing.assert_allclose(s_c, s_r, atol=1e-5)
  for a, b in zip(grads_c, grads_r):
    np.testing.assert_allclose(a, b, atol=1e-4)
  assert float(jnp.max(jnp.abs(o_c[0, 8] - o_r[0, 8]))) < 1e-5 and (
      float(jnp.max(jnp.abs(o_c[0, 7] - o_c[0, 8]))) > 1e-3)  # (a reset is not a no-op)


def test_the_chunked_rule_inverts_its_triangle_with_matmuls_that_programs_can_run_at_once():
  """(I + A)^-1 by block inversion equals the triangular solve, also where a power series of A
  would cancel catastrophically (identical keys, beta 1, no decay: A all ones below the
  diagonal), and the chunked rule's program calls no LAPACK kernel: on CPU that kernel blocks a
  thread of XLA's intra-op pool until its batch's parts are done, so the engine's prefill and
  the trainer's step solving at once wait forever on a 2-core host."""
  ones = jnp.tril(jnp.ones((64, 64)), -1)
  random = 0.5 * jnp.tril(jax.random.normal(jax.random.PRNGKey(4), (2, 3, 13, 13)), -1)
  for a in (ones, random):
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1]), a.shape)
    solved = jax.scipy.linalg.solve_triangular(a + eye, eye, lower=True, unit_diagonal=True)
    np.testing.assert_allclose(gated_delta.unit_lower_inverse(a), solved, rtol=1e-5, atol=1e-5)
  x = jnp.ones((1, 8, 2, 4))
  lowered = jax.jit(lambda q, k, v: gated_delta.delta_rule_chunked(
      q, k, v, -x[..., 0], 0.5 * x[..., 0], jnp.zeros((1, 8), jnp.int32), chunk=4)).lower(x, x, x)
  assert 'lapack' not in lowered.as_text()


def test_a_layer_decoded_token_by_token_from_its_state_equals_its_chunked_form():
  """The interface decode builds on: a Gated DeltaNet layer over a sequence at once, against a
  prefill of its first part (chunked, from a zero state) then one recurrent step per token from
  the state handed on; a step of a row with segment id 0 keeps its state; and a prefill of
  right-padded rows hands on the state after each row's last real token."""
  layer = gated_delta.GatedDeltaNet(HYBRID)
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 13, HYBRID.hidden_size))
  params = jax.tree.map(lambda p: 3 * p, layer.init(jax.random.PRNGKey(6), x, None)['params'])
  apply = jax.jit(lambda x, ids, state: layer.apply({'params': params}, x, ids, state))
  ones = lambda r, t: jnp.ones((r, t), jnp.int32)
  whole, _ = apply(x, ones(2, 13), None)
  out, state = apply(x[:, :6], ones(2, 6), gated_delta.init_state(HYBRID, 2))
  assert state.conv.shape == (2, HYBRID.linear_conv_kernel - 1, 2 * 2 * 8 + 4 * 8)
  assert state.recurrent.shape == (2, 4, 8, 8) and state.recurrent.dtype == jnp.float32
  steps = [out]
  for i in range(6, 13):
    y, state = apply(x[:, i:i + 1], None, state)
    steps.append(y)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, atol=1e-5)
  # A step with segment id 0 (a slot with nothing to decode) leaves that row's state as it was.
  _, after = apply(x[:, :1], jnp.asarray([[1], [0]], jnp.int32), state)
  for kept, old in zip(after, state):
    np.testing.assert_array_equal(kept[1], old[1])
    assert not np.array_equal(kept[0], old[0])
  # Row 1 has 9 real tokens then padding: its state is the state after those 9.
  ids = ones(2, 13).at[1, 9:].set(0)
  _, padded = apply(x, ids, gated_delta.init_state(HYBRID, 2))
  _, nine = apply(x[1:, :9], ones(1, 9), gated_delta.init_state(HYBRID, 1))
  np.testing.assert_allclose(padded.recurrent[1], nine.recurrent[0], atol=1e-5)
  np.testing.assert_allclose(padded.conv[1], nine.conv[0], atol=1e-6)


def test_gradients_reach_every_param_and_remat_changes_none():
  params = hybrid_params()
  tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 11), 0, HYBRID.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
  segments = jnp.ones((2, 11), jnp.int32).at[0, 6:].set(2)

  def grads(config):
    f = lambda p: jnp.sum(tfm.token_logprobs(p, config, tokens, jnp.roll(tokens, -1, 1),
                                             positions, segments)[0])
    return jax.jit(jax.grad(f))(params)

  plain = grads(HYBRID)
  remat = grads(dataclasses.replace(HYBRID, remat=True, remat_policy='dots'))
  for path, g in jax.tree_util.tree_leaves_with_path(plain):
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.max(jnp.abs(g))) > 0, path
  # (XLA's CPU backend at -O0, as the tests compile, rounds the two programs apart by ~2e-5.)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(a)))), plain, remat)


def test_a_train_step_on_a_tiny_hybrid_over_an_fsdp_mesh():
  """Packed samples through the real train step on fsdp=2 (the partition rules place the
  linear layers' projections): the loss is finite and every parameter moves."""
  rng = np.random.RandomState(2)
  samples = [packing.Sample(prompt_tokens=rng.randint(1, 64, 3),
                            completion_tokens=rng.randint(1, 64, n),
                            behaviour_logprobs=np.full(n, -4.0, np.float32),
                            versions=np.zeros(n, np.int32), advantage=a)
             for n, a in ((6, 1.0), (9, -1.0), (4, 0.5), (7, -0.5))]
  batch, _ = packing.pack_samples(samples, seq_len=32, row_multiple=2)
  mesh = sharding_lib.make_mesh(fsdp=2, devices=jax.devices()[:2])
  opt_config = config_lib.OptimizerConfig(lr=1e-2, warmup_steps=0)
  optimizer = train.make_optimizer(opt_config)
  params = hybrid_params()
  state, shardings = train.create_sharded_state(params, optimizer, mesh)
  qkv = state.params['layers_0']['linear_attn']['in_proj_qkv']['kernel']
  assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', None)
  step = train.jit_train_step(train.make_train_step(
      HYBRID, config_lib.LossConfig(), optimizer, train.lr_schedule(opt_config)), shardings, mesh)
  micro = {k: v[None] for k, v in batch.items()}
  new, metrics = step(state, micro)
  assert np.isfinite(float(metrics['loss'])) and int(new.step) == 1
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, jax.device_get(new.params))
  assert all(jax.tree.leaves(moved)), moved


# ---------------------------------------------------------------------------------------------
# What is refused, in one line.

def _text_config(**edit):
  hf = dict(architectures=['Qwen3_5ForCausalLM'], model_type='qwen3_5_text', vocab_size=96,
            hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
  hf.update(edit)
  return hf


@pytest.mark.parametrize('hf, message', [
    (_text_config(attn_output_gate=False), 'attn_output_gate=false is not supported'),
    (_text_config(layer_types=['linear_attention'] * 3 + ['sliding_attention']),
     'layer_types must list 4 entries'),
    (_text_config(layer_types=['full_attention'] * 3), 'layer_types must list 4 entries'),
    (_text_config(linear_num_key_heads=3, linear_num_value_heads=4),
     'linear_num_value_heads=4 must be a multiple of linear_num_key_heads=3'),
    (_text_config(mlp_only_layers=[1]), re.escape('mlp_only_layers=[1] is not supported')),
    (_text_config(attention_bias=True), 'attention_bias=true is not supported'),
    (dict(architectures=['Qwen3_5ForConditionalGeneration'], model_type='qwen3_5'),
     'text_config must be an object'),
    (dict(architectures=['Qwen3_5ForConditionalGeneration'], model_type='qwen3_5',
          tie_word_embeddings=False, text_config=_text_config(tie_word_embeddings=True)),
     r'tie_word_embeddings=False and text_config.tie_word_embeddings=True disagree'),
    (dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3', vocab_size=96,
          hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          rope_parameters=dict(rope_theta=1e6, partial_rotary_factor=0.5)),
     'rope_parameters.partial_rotary_factor=0.5 is not supported'),
])
def test_fields_the_model_cannot_honour_are_refused(hf, message):
  with pytest.raises(ValueError, match='^config.json.*: ' + message) as e:
    hf_schema.config_from_hf(hf)
  assert '\n' not in str(e.value)


def test_a_run_with_the_jax_engine_passes_its_check_and_decode_needs_the_linear_states(
    checkpoint, tmp_path):
  """The run's check takes a hybrid dir with backend 'jax' (the engine serves it:
  tests/hybrid_engine_test.py); decoding over a cache without the linear layers' states is
  refused naming them."""
  from pipelinerl_jax.pipeline import launch
  params = hybrid_params()
  cache = tfm.init_cache(HYBRID, 1, 8)
  assert cache.k.shape[0] == 1 and cache.linear.recurrent.shape == (3, 1, 4, 8, 8)
  with pytest.raises(ValueError, match=r'Qwen3_5ForCausalLM: a generation cache without the '
                                       r'states of its Gated DeltaNet layers \(0, 1, 3\)'):
    tfm.decode(params, HYBRID, jnp.ones((1, 2), jnp.int32), jnp.arange(2)[None],
               cache._replace(linear=None))
  path, _ = checkpoint('text_untied_conv4')
  config = config_lib.load_preset('tiny')
  config.model.path = str(path)
  launch.check(config_lib.validate(config), str(tmp_path / 'run'))
