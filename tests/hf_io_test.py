"""HF checkpoint I/O, checked against transformers' own Qwen2 / Qwen3 / Llama on tiny random
models."""

import copy
import dataclasses
import json
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import transformers
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.hf import tokenizer as hf_tokenizer
from pipelinerl_jax.models import transformer as tfm

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4)
# name -> (architecture, extra HF config, save_pretrained kwargs); one is saved in bf16.
CASES = {
    'qwen2_tied': ('qwen2', dict(num_key_value_heads=2, tie_word_embeddings=True), {}),
    'qwen2_sharded': ('qwen2', dict(num_key_value_heads=2, tie_word_embeddings=False),
                      dict(max_shard_size='20KB')),
    'llama3_rope': ('llama', dict(num_key_value_heads=1, tie_word_embeddings=False,
                                  max_position_embeddings=256,
                                  rope_parameters=dict(rope_type='llama3', rope_theta=10000.0,
                                                       factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=16)),
                    {}),
    'llama_tied_linear': ('llama', dict(num_key_value_heads=4, tie_word_embeddings=True,
                                        rope_parameters=dict(rope_type='linear', factor=2.0,
                                                             rope_theta=500000.0)),
                          dict(bf16=True)),
    # Qwen3: q/k norms, no biases, head_dim != hidden / heads; GQA 2 untied, GQA 4 tied.
    'qwen3_untied': ('qwen3', dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
                     {}),
    'qwen3_tied': ('qwen3', dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=True,
                                 rope_parameters=dict(rope_type='default', rope_theta=1e6)), {}),
    # Llama-3.2-style: tied, explicit head_dim, llama3 RoPE with factor 32.
    'llama32_style': ('llama', dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
                                    max_position_embeddings=512,
                                    rope_parameters=dict(rope_type='llama3', rope_theta=500000.0,
                                                         factor=32.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0,
                                                         original_max_position_embeddings=16)),
                      {}),
}
TOKENS_BxT = np.random.RandomState(0).randint(0, SMALL['vocab_size'], (2, 40))

_logits = jax.jit(tfm.forward_logits, static_argnums=1)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """checkpoint(name) -> (dir, transformers model): saved once per module, weights randomized."""
  made = {}

  def make(name):
    if name not in made:
      arch, extra, save_kw = CASES[name]
      cls, cfg_cls = {'qwen2': (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                      'qwen3': (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                      'llama': (transformers.LlamaForCausalLM, transformers.LlamaConfig)}[arch]
      torch.manual_seed(len(made))
      model = cls(cfg_cls(**{**SMALL, **extra})).eval()
      with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomize so both matter
        for pname, p in model.named_parameters():
          p.copy_(1 + 0.1 * torch.randn_like(p) if 'norm' in pname else 0.1 * torch.randn_like(p))
      path = tmp_path_factory.mktemp(name)
      if save_kw.get('bf16'):
        # Round the weights to bf16 in place (not model.to(), which also rounds RoPE buffers).
        with torch.no_grad():
          for p in model.parameters():
            p.copy_(p.bfloat16().float())
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
      else:
        model.save_pretrained(path, **save_kw)
      made[name] = (path, model)
    return made[name]
  return make


def abstract_params(config):
  return jax.eval_shape(lambda rng: tfm.init_params(config, rng), jax.random.key(0))


def hf_logits(model, tokens_BxT) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BxT)).logits.float().numpy()


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize('name', list(CASES))
def test_logits_match_transformers(checkpoint, name):
  path, model = checkpoint(name)
  if CASES[name][2].get('bf16'):  # transformers' own bf16 file goes through our reader
    header, _ = hf_files.read_safetensors_header(path / 'model.safetensors')
    assert {e['dtype'] for e in header.values()} == {'BF16'}
  config = hf_schema.load_config(path)
  params = hf_checkpoint.load_params(path, config)
  assert jax.tree.structure(params) == jax.tree.structure(abstract_params(config))
  ours = _logits(params, config, jnp.asarray(TOKENS_BxT))
  assert max_diff(ours, hf_logits(model, TOKENS_BxT)) <= 1e-4


def test_config_fields(checkpoint):
  qwen = hf_schema.load_config(checkpoint('qwen2_tied')[0])
  assert (qwen.architecture, qwen.qkv_bias, qwen.tie_embeddings) == ('Qwen2ForCausalLM', True, True)
  assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (4, 2, 16)  # head_dim = 64 / 4
  llama = hf_schema.load_config(checkpoint('llama3_rope')[0])
  assert (llama.architecture, llama.qkv_bias, llama.tie_embeddings) == ('LlamaForCausalLM', False,
                                                                        False)
  assert llama.rope_scaling == tfm.RopeScaling('llama3', 8.0, 1.0, 4.0, 16)
  linear = hf_schema.load_config(checkpoint('llama_tied_linear')[0])
  assert (linear.rope_theta, linear.rope_scaling) == (500000.0, tfm.RopeScaling('linear', 2.0))
  qwen3 = hf_schema.load_config(checkpoint('qwen3_tied')[0])
  assert (qwen3.architecture, qwen3.qkv_bias, qwen3.qk_norm, qwen3.tie_embeddings) == (
      'Qwen3ForCausalLM', False, True, True)
  assert (qwen3.num_heads, qwen3.num_kv_heads, qwen3.head_dim, qwen3.rope_theta) == (
      8, 2, 16, 1e6)  # head_dim 16, not 64 / 8
  llama32 = hf_schema.load_config(checkpoint('llama32_style')[0])
  assert (llama32.head_dim, llama32.qk_norm, llama32.rope_scaling) == (
      24, False, tfm.RopeScaling('llama3', 32.0, 1.0, 4.0, 16))


@pytest.mark.parametrize('name', ['llama3_rope', 'llama32_style'])
def test_llama3_rope_scaling_matters(checkpoint, name):
  # Guards the parity test above: unscaled RoPE must give visibly different logits at T=40.
  path, _ = checkpoint(name)
  config = hf_schema.load_config(path)
  params = hf_checkpoint.load_params(path, config)
  plain = dataclasses.replace(config, rope_scaling=None)
  tokens = jnp.asarray(TOKENS_BxT)
  assert max_diff(_logits(params, config, tokens), _logits(params, plain, tokens)) > 1e-2


def test_legacy_rope_fields_and_model_type_fallback(checkpoint, tmp_path):
  """The Hub's config.json files carry rope_theta / rope_scaling at the top level (Qwen3's with
  rope_scaling null), where transformers 5 writes rope_parameters."""
  for name in ('llama3_rope', 'llama_tied_linear', 'qwen2_tied', 'qwen3_tied', 'llama32_style'):
    src, _ = checkpoint(name)
    hf = json.loads((src / 'config.json').read_text())
    rope = hf.pop('rope_parameters')
    legacy = dict(hf, rope_theta=rope.pop('rope_theta'), rope_scaling=None)
    if rope['rope_type'] != 'default':  # the pre-5.x spelling: rope_scaling with 'type'
      legacy['rope_scaling'] = dict(rope, type=rope.pop('rope_type'))
    del legacy['architectures']
    (tmp_path / 'config.json').write_text(json.dumps(legacy))
    assert hf_schema.load_config(tmp_path) == hf_schema.load_config(src), name


@pytest.mark.parametrize('name', ['qwen3_tied', 'llama_tied_linear', 'llama32_style'])
def test_export_carries_the_older_rope_fields_too(checkpoint, name):
  """An exported config.json holds rope_theta (and rope_scaling when set) at the top level as
  well: a reader of the older schema, which ignores rope_parameters, gets the model's theta (not
  the default 1e4) and scaling, and so do our loader and transformers from those fields alone."""
  config = hf_schema.load_config(checkpoint(name)[0])
  written = hf_schema.hf_config(config)
  assert written['rope_theta'] == config.rope_theta != 10000.0
  old = {k: v for k, v in written.items() if k != 'rope_parameters'}
  if config.rope_scaling is None:
    assert 'rope_scaling' not in written
  else:
    assert old['rope_scaling']['rope_type'] == config.rope_scaling.kind
    assert old['rope_scaling']['factor'] == config.rope_scaling.factor
  assert hf_schema.config_from_hf(old) == hf_schema.config_from_hf(written) == config
  hf_class = type(transformers.AutoConfig.for_model(written['model_type']))
  from_old, from_both = hf_class(**old), hf_class(**written)
  assert from_old.rope_parameters == from_both.rope_parameters
  assert from_old.rope_parameters['rope_theta'] == config.rope_theta


def test_overrides_set_numerics(checkpoint):
  path, _ = checkpoint('qwen2_tied')
  config = hf_schema.load_config(path, param_dtype='bfloat16', dtype='bfloat16', lm_head_fp32=False,
                             remat=True)
  assert (config.param_dtype, config.dtype, config.lm_head_fp32, config.remat) == (
      'bfloat16', 'bfloat16', False, True)
  params = hf_checkpoint.load_params(path, config)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  with pytest.raises(TypeError, match='vocab_size'):
    hf_schema.load_config(path, vocab_size=10)


@pytest.mark.parametrize('name,dtype,max_shard_bytes', [('qwen2_tied', 'float32', None),
                                                        ('llama3_rope', 'bfloat16', 12_000)])
def test_save_roundtrip(checkpoint, tmp_path, name, dtype, max_shard_bytes):
  src, _ = checkpoint(name)
  config = hf_schema.load_config(src)
  # Fresh random weights (unlike the checkpoint's), in the model's own pytree layout.
  rng = np.random.RandomState(1)
  params = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype),
                        abstract_params(config))
  out = tmp_path / 'out'
  hf_checkpoint.save_params(params, config, out, dtype=dtype, max_shard_bytes=max_shard_bytes,
                    extra_config={'bos_token_id': 3, 'eos_token_id': 5, 'rope_theta': 1.0})

  written = json.loads((out / 'config.json').read_text())
  assert (written['bos_token_id'], written['eos_token_id']) == (3, 5)
  assert hf_schema.load_config(out) == config  # the stale legacy rope_theta did not leak back in
  files = sorted(out.glob('*.safetensors'))
  assert len(files) > 1 if max_shard_bytes else [f.name for f in files] == ['model.safetensors']

  # Our load gives back exactly the params, rounded to the saved dtype.
  expected = jax.tree.map(lambda x: x.astype(dtype).astype(config.param_dtype), params)
  loaded = hf_checkpoint.load_params(out, config)
  jax.tree.map(np.testing.assert_array_equal, loaded, expected)

  # The safetensors library reads every file; names, shapes and values agree with hf_tensors.
  on_disk = {}
  for f in files:
    with safetensors.safe_open(f, framework='pt') as st:
      on_disk.update({k: st.get_tensor(k) for k in st.keys()})
  ours = dict(hf_names.hf_tensors(params, config, dtype=dtype))
  assert set(on_disk) == set(ours)
  assert config.tie_embeddings == ('lm_head.weight' not in on_disk)
  for k, t in on_disk.items():
    assert str(t.dtype) == f'torch.{dtype}'
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(ours[k], np.float32), err_msg=k)

  # transformers loads the directory and computes the same logits as our model.
  cls = getattr(transformers, config.architecture)
  model = cls.from_pretrained(out, dtype=torch.float32).eval()
  tokens = jnp.asarray(TOKENS_BxT)
  assert max_diff(_logits(loaded, config, tokens), hf_logits(model, TOKENS_BxT)) <= 1e-4

  # Saving again with other sharding replaces the old files instead of mixing with them.
  hf_checkpoint.save_params(params, config, out, dtype='float32',
                    max_shard_bytes=None if max_shard_bytes else 30_000)
  again = hf_checkpoint.load_params(out, config)
  jax.tree.map(np.testing.assert_array_equal, again, params)
  assert (len(list(out.glob('*.safetensors'))) == 1) == bool(max_shard_bytes)
  assert (out / hf_checkpoint.INDEX_FILE).exists() == (not max_shard_bytes)


# Leaf name -> partition spec; every leaf is split (the norms' layer axis over 'tensor').
_SPLITS = {
    'embedding': P('fsdp', 'tensor'), 'lm_head': P('fsdp', 'tensor'),
    'q_proj/kernel': P(None, 'fsdp', 'tensor'), 'k_proj/kernel': P(None, 'fsdp', 'tensor'),
    'v_proj/kernel': P(None, 'fsdp', 'tensor'), 'gate_proj': P(None, 'fsdp', 'tensor'),
    'up_proj': P(None, 'fsdp', 'tensor'), 'o_proj': P(None, 'tensor', 'fsdp'),
    'down_proj': P(None, 'tensor', 'fsdp'), 'bias': P(None, 'tensor'),
    'input_norm': P('tensor', 'fsdp'), 'post_attn_norm': P('tensor', 'fsdp'),
    'final_norm': P('fsdp'),
}


def _spec_for(path: tuple[str, ...]) -> P:
  joined = '/'.join(path)
  (spec,) = [s for key, s in _SPLITS.items() if key in joined]
  return spec


def test_sharded_load_places_only_each_devices_slice(checkpoint, monkeypatch):
  path, _ = checkpoint('qwen2_sharded')
  config = hf_schema.load_config(path)
  full = hf_checkpoint.load_params(path, config)
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('fsdp', 'tensor'))
  shardings = jax.tree_util.tree_map_with_path(
      lambda p, _: NamedSharding(mesh, _spec_for(tuple(k.key for k in p))), full)

  # Record which HF tensors each callback touches.
  calls, make_reader = [], hf_checkpoint._slice_reader

  def spy(spec, view, dtype):
    def logged_view(name, transposed):
      seen.append(name)
      return view(name, transposed)
    seen, read = [], make_reader(spec, logged_view, dtype)

    def reader(index):
      seen.clear()
      out = read(index)
      calls.append((spec, index, list(seen)))
      return out
    return reader
  monkeypatch.setattr(hf_checkpoint, '_slice_reader', spy)
  sharded = hf_checkpoint.load_params(path, config, shardings)

  for leaf, ref, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(full),
                                 jax.tree.leaves(shardings)):
    assert leaf.sharding == sharding
    np.testing.assert_array_equal(leaf, ref)
    shard_shape = sharding.shard_shape(leaf.shape)
    assert np.prod(shard_shape) < np.prod(leaf.shape)
    assert len(leaf.addressable_shards) == 8
    for shard in leaf.addressable_shards:
      assert shard.data.shape == shard_shape
      np.testing.assert_array_equal(shard.data, np.asarray(ref)[shard.index])
  for spec, index, seen in calls:  # a stacked leaf's slice reads only its own layers
    layers = range(*index[0].indices(config.num_layers)) if spec.stacked else [None]
    assert seen == [spec.name(i) for i in layers]
  assert any(spec.stacked and len(seen) == 1 for spec, _, seen in calls)

  with pytest.raises(ValueError, match='shardings do not match'):
    hf_checkpoint.load_params(path, config, {'embed': shardings['embed']})


@pytest.mark.parametrize('name', ['qwen2_sharded', 'llama_tied_linear', 'qwen3_untied'])
def test_hf_tensors_cover_state_dict(checkpoint, name):
  """Our HF names are transformers' own: what the loader, saver and every transport walk."""
  path, model = checkpoint(name)
  config = hf_schema.load_config(path)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  if config.tie_embeddings:  # transformers lists the tied head; it is never sent or saved
    np.testing.assert_array_equal(state.pop('lm_head.weight'), state['model.embed_tokens.weight'])
  pairs = list(hf_names.hf_tensors(hf_checkpoint.load_params(path, config), config))
  names = [n for n, _ in pairs]
  assert len(names) == len(set(names))
  assert set(names) == set(state)
  for n, x in pairs:
    np.testing.assert_array_equal(np.asarray(x), state[n], err_msg=n)

  position = {n: k for k, n in enumerate(names)}
  for i in range(config.num_layers):
    qkv = [f'model.layers.{i}.self_attn.{p}_proj.{w}' for p in 'qkv' for w in ('weight', 'bias')
           if f'model.layers.{i}.self_attn.{p}_proj.{w}' in position]
    gate_up = [f'model.layers.{i}.mlp.{p}_proj.weight' for p in ('gate', 'up')]
    for group in (qkv, gate_up):
      at = sorted(position[n] for n in group)
      assert at == list(range(at[0], at[0] + len(group))), group
    assert len(qkv) == (6 if config.qkv_bias else 3)
  # vLLM loads each q/k norm into a module of its own: a fusion unit alone, whole.
  norms = [n for n in names if n.endswith(('q_norm.weight', 'k_norm.weight'))]
  assert len(norms) == (2 * config.num_layers if config.qk_norm else 0)
  for n in norms:
    assert hf_tensors.module_of(n) == n.rsplit('.', 1)[0]


def test_name_map_matches_init_params():
  for qkv_bias, tied, qk_norm in ((True, False, False), (False, True, False), (False, True, True)):
    config = tfm.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3,
                             num_heads=4, num_kv_heads=2, head_dim=6, qkv_bias=qkv_bias,
                             qk_norm=qk_norm, tie_embeddings=tied)
    flat = {tuple(k.key for k in p): x.shape
            for p, x in jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]}
    assert {s.path: s.shape for s in hf_names.name_map(config)} == flat


def test_qwen3_config_is_written_as_transformers_reads_it(checkpoint):
  config = hf_schema.load_config(checkpoint('qwen3_tied')[0])
  hub = {'layer_types': ['full_attention'] * 2, 'max_window_layers': 28, 'rope_theta': 5.0,
         'rope_scaling': None, 'eos_token_id': [151645, 151643]}
  written = hf_schema.hf_config(config, extra=hub)
  assert (written['model_type'], written['attention_bias'], written['use_sliding_window'],
          written['head_dim']) == ('qwen3', False, False, 16)
  assert written['eos_token_id'] == [151645, 151643]  # the original's own keys are kept
  assert not {'layer_types', 'max_window_layers', 'rope_scaling'} & set(written)
  assert written['rope_theta'] == config.rope_theta != hub['rope_theta']  # ours, not the stale
  assert hf_schema.config_from_hf(written) == config
  assert transformers.Qwen3Config(**written).head_dim == 16
  for field in ('qk_norm', 'qkv_bias'):  # what Qwen3ForCausalLM cannot express
    bad = dataclasses.replace(config, **{field: not getattr(config, field)})
    with pytest.raises(ValueError, match=f'Qwen3ForCausalLM has qkv_bias=False, qk_norm=True; '
                                         f'config has .*{field}={getattr(bad, field)}'):
      hf_schema.hf_config(bad)


def test_stop_tokens_are_the_tokenizers_eos_and_generation_configs_list(tmp_path):
  tokenizer = types.SimpleNamespace(eos_token_id=7)
  assert hf_tokenizer.stop_token_ids(tmp_path, tokenizer) == (7,)  # no generation_config.json
  generation = tmp_path / 'generation_config.json'
  for eos, expected in (([128009, 128001, 7], (7, 128001, 128009)), (3, (3, 7)), (None, (7,))):
    generation.write_text(json.dumps({'eos_token_id': eos, 'do_sample': True}))
    assert hf_tokenizer.stop_token_ids(tmp_path, tokenizer) == expected
  generation.write_text(json.dumps({'eos_token_id': ['</s>']}))
  with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be .*'</s>'"):
    hf_tokenizer.stop_token_ids(tmp_path, tokenizer)
  generation.write_text('{')
  with pytest.raises(ValueError, match='generation_config.json: not valid JSON'):
    hf_tokenizer.stop_token_ids(tmp_path, tokenizer)


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error naming the file and the field / tensor.


def _edit_config(**changes):
  def edit(d):
    hf = json.loads((d / 'config.json').read_text())
    for k, v in changes.items():
      if v is None:
        hf.pop(k, None)
      else:
        hf[k] = v
    (d / 'config.json').write_text(json.dumps(hf))
  return edit


def _drop_tensor(name):
  def edit(d):
    state = safetensors.torch.load_file(d / 'model.safetensors')
    del state[name]
    safetensors.torch.save_file(state, d / 'model.safetensors', metadata={'format': 'pt'})
  return edit


def _drop_shard(tensor):
  def edit(d):
    shard = json.loads((d / 'model.safetensors.index.json').read_text())['weight_map'][tensor]
    (d / shard).unlink()
    return [shard]
  return edit


def _truncate(d):
  f = d / 'model.safetensors'
  f.write_bytes(f.read_bytes()[:-100])


BAD = {
    # id: (checkpoint, edit, error, fragments of the message)
    'architecture': ('qwen2_tied', _edit_config(architectures=['MistralForCausalLM']),
                     ValueError, ['config.json', 'architectures', 'MistralForCausalLM']),
    'model_type': ('qwen2_tied', _edit_config(architectures=None, model_type='mistral'),
                   ValueError, ['config.json', 'model_type', 'mistral']),
    'missing_field': ('qwen2_tied', _edit_config(hidden_size=None),
                      ValueError, ['config.json', "'hidden_size'"]),
    'mlp_bias': ('llama3_rope', _edit_config(mlp_bias=True), ValueError,
                 ['config.json', 'mlp_bias']),
    'attention_bias': ('llama3_rope', _edit_config(attention_bias=True), ValueError,
                       ['config.json', 'attention_bias', 'o_proj']),
    'sliding_window': ('qwen2_tied', _edit_config(use_sliding_window=True), ValueError,
                       ['config.json', 'use_sliding_window']),
    'rope_type': ('qwen2_tied', _edit_config(rope_parameters={'rope_type': 'yarn', 'factor': 4.0}),
                  ValueError, ['config.json', 'rope_type', 'yarn']),
    # Qwen3 fields the model would otherwise ignore, in the Hub's spelling where it has one.
    'qwen3_sliding_window': ('qwen3_untied', _edit_config(use_sliding_window=True,
                                                          sliding_window=4096),
                             ValueError, ['config.json', 'use_sliding_window']),
    'qwen3_sliding_layers': ('qwen3_untied', _edit_config(
        layer_types=['full_attention', 'sliding_attention']), ValueError,
                             ['config.json', 'layer_types', 'sliding_attention']),
    'qwen3_attention_bias': ('qwen3_untied', _edit_config(attention_bias=True), ValueError,
                             ['config.json', 'attention_bias', 'o_proj']),
    'qwen3_yarn': ('qwen3_untied', _edit_config(rope_parameters=None, rope_theta=1e6,
                                                rope_scaling={'rope_type': 'yarn', 'factor': 4.0,
                                                              'original_max_position_embeddings':
                                                              32768}),
                   ValueError, ['config.json', 'rope_scaling.rope_type', 'yarn']),
    'qwen3_moe_model_type': ('qwen3_untied', _edit_config(model_type='qwen3_moe'), ValueError,
                             ['config.json', "model_type='qwen3_moe'", 'Qwen3ForCausalLM']),
    'qwen3_attention_dropout': ('qwen3_untied', _edit_config(attention_dropout=0.1), ValueError,
                                ['config.json', 'attention_dropout']),
    'missing_shard': ('qwen2_sharded', _drop_shard('model.layers.1.mlp.up_proj.weight'),
                      FileNotFoundError, ['model.safetensors.index.json']),
    'missing_tensor': ('qwen2_tied', _drop_tensor('model.layers.1.mlp.up_proj.weight'),
                       ValueError, ['model.safetensors', "'model.layers.1.mlp.up_proj.weight'"]),
    'shape_mismatch': ('qwen2_sharded', _edit_config(intermediate_size=96), ValueError,
                       ["'model.layers.0.mlp.gate_proj.weight'", '(128, 64)', '(96, 64)',
                        '-of-', 'config.json']),
    'truncated_file': ('qwen2_tied', _truncate, ValueError, ['model.safetensors']),
    'no_weights': ('qwen2_tied', lambda d: (d / 'model.safetensors').unlink(), FileNotFoundError,
                   ['model.safetensors', 'model.safetensors.index.json']),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_input_names_file_and_field(checkpoint, tmp_path, case):
  name, edit, error, fragments = BAD[case]
  d = tmp_path / 'ckpt'
  shutil.copytree(checkpoint(name)[0], d)
  fragments = fragments + (edit(d) or [])  # an edit may add names it chose
  with pytest.raises(error) as info:
    hf_checkpoint.load_params(d, hf_schema.load_config(d))
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))
