"""HF-named torch views of the params (zero copy), fusion units, buckets, checks."""

import jax
import numpy as np
import pytest
import torch

from pipelinerl_jax.generation.transport import hf_tensors
from pipelinerl_jax.models.hf import names as hf_names
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer

CONFIG = transformer.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                 num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32,
                                 qkv_bias=True)


@pytest.fixture(scope='module')
def params():
  return transformer.init_params(CONFIG, jax.random.PRNGKey(0))


def test_tensors_alias_the_jax_buffers_and_match_hf_layout(params):
  ours = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  reference = list(hf_names.hf_tensors(params, CONFIG))  # jitted slices + transposes (copies)
  assert [n for n, _ in ours] == [n for n, _ in reference]
  for (name, t), (_, ref) in zip(ours, reference):
    np.testing.assert_array_equal(t.numpy(), np.asarray(ref), err_msg=name)

  specs = {name: (spec, i) for name, spec, i in hf_names.checkpoint_order(CONFIG)}
  for name, t in ours:
    spec, i = specs[name]
    leaf = hf_names.leaf_at(params, spec.path)
    # Same bytes: layer i of a stacked leaf starts i layers into the JAX buffer.
    offset = 0 if i is None else i * (leaf.nbytes // leaf.shape[0])
    assert t.data_ptr() == leaf.unsafe_buffer_pointer() + offset, name
    if spec.transposed:
      assert not t.is_contiguous() and t.stride() == (1, t.shape[0]), name  # a .T view
  assert all(hf_tensors.zero_copy_report(params, CONFIG).values())


def test_a_sharded_leaf_is_copied_and_reported_as_such(params):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('x',))
  sharded = jax.device_put(params['lm_head']['kernel'],
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'x')))
  mixed = {**params, 'lm_head': {'kernel': sharded}}
  report = hf_tensors.zero_copy_report(mixed, CONFIG)
  assert report['lm_head.weight'] is False
  assert sum(not v for v in report.values()) == 1
  tensors = dict(hf_tensors.hf_torch_tensors(mixed, CONFIG))
  np.testing.assert_array_equal(tensors['lm_head.weight'].numpy(), np.asarray(sharded).T)


def test_fusion_units_keep_fused_parts_together(params):
  units = [[n for n, _ in u] for u in hf_tensors.fusion_units(
      hf_tensors.hf_torch_tensors(params, CONFIG))]
  qkv = [u for u in units if any('q_proj' in n for n in u)]
  assert len(qkv) == CONFIG.num_layers
  for u in qkv:
    assert sorted(n.split('.')[-2] + '.' + n.split('.')[-1] for n in u) == [
        'k_proj.bias', 'k_proj.weight', 'q_proj.bias', 'q_proj.weight', 'v_proj.bias',
        'v_proj.weight']
  gate_up = [u for u in units if any('gate_proj' in n for n in u)]
  assert all(len(u) == 2 and 'up_proj' in u[1] for u in gate_up)
  assert hf_tensors.module_of('model.layers.3.mlp.up_proj.weight') == \
      'model.layers.3.mlp.gate_up_proj'
  assert hf_tensors.module_of('model.layers.3.mlp.shared_expert.gate_proj.weight') == \
      'model.layers.3.mlp.shared_expert.gate_up_proj'  # vLLM's Qwen3.5-MoE shared expert
  assert hf_tensors.module_of('model.norm.weight') == 'model.norm'


@pytest.mark.parametrize('max_bytes', [1, 40_000, 100_000, 10**9])
def test_buckets_are_bounded_whole_units_in_order(params, max_bytes):
  tensors = list(hf_tensors.hf_torch_tensors(params, CONFIG))
  buckets = list(hf_tensors.buckets(tensors, max_bytes))
  assert [n for b in buckets for n in b.names] == [n for n, _ in tensors]
  for b in buckets:
    modules = [hf_tensors.module_of(n) for n in b.names]
    if b.nbytes > max_bytes:  # only a single oversized unit may exceed the budget
      assert len(set(modules)) == 1
  # No fused module is split across two buckets.
  owners = {}
  for k, b in enumerate(buckets):
    for n in b.names:
      owners.setdefault(hf_tensors.module_of(n), set()).add(k)
  assert all(len(ks) == 1 for ks in owners.values())
  if max_bytes == 10**9:
    assert len(buckets) == 1
  if max_bytes == 1:
    assert len(buckets) == len(owners)


def test_check_complete_rejects_partial_wrong_or_extra_updates(params):
  expected = hf_tensors.expected_shapes(CONFIG)
  full = [(n, tuple(t.shape)) for n, t in hf_tensors.hf_torch_tensors(params, CONFIG)]
  hf_tensors.check_complete(full, expected)  # no error
  with pytest.raises(ValueError, match='missing'):
    hf_tensors.check_complete(full[:-1], expected)
  with pytest.raises(ValueError, match='expected'):
    hf_tensors.check_complete(full[:-1] + [(full[-1][0], (1, 2))], expected)
  with pytest.raises(ValueError, match='not a tensor of the model'):
    hf_tensors.check_complete(full + [('model.extra.weight', (3,))], expected)
  with pytest.raises(ValueError, match='twice'):
    hf_tensors.check_complete(full + full[:1], expected)


def test_a_leaf_of_the_wrong_shape_is_named(params):
  bad = {**params, 'final_norm': {'scale': torch.zeros(3)}}
  with pytest.raises(ValueError, match='final_norm/scale'):
    list(hf_tensors.hf_torch_tensors(bad, CONFIG))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_params_from_hf_inverts_the_hf_views(params, dtype):
  """What a JAX generator fed by a collective rebuilds from the received HF tensors."""
  tensors = [(n, t.to(hf_tensors.TORCH_DTYPES[dtype]))
             for n, t in hf_tensors.hf_torch_tensors(params, CONFIG)]
  rebuilt = hf_tensors.params_from_hf(tensors, CONFIG)
  assert jax.tree.structure(rebuilt) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(rebuilt)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-2 if dtype == 'bfloat16' else 0, atol=0)
  with pytest.raises(ValueError, match='tensors missing'):
    hf_tensors.params_from_hf(tensors[1:], CONFIG)


def test_a_hybrids_tensors_alias_their_leaves_and_fused_projections_travel_together():
  """Qwen3.5's Gated DeltaNet layers: vLLM loads in_proj_qkv with in_proj_z and in_proj_b with
  in_proj_a into one module each; the conv1d weight (three axes) crosses as HF's [Cc, 1, Kc]."""
  config = hf_schema.config_from_hf(dict(
      architectures=['Qwen3_5ForCausalLM'], model_type='qwen3_5_text', vocab_size=96,
      hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
      num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4))
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  ours = list(hf_tensors.hf_torch_tensors(params, config))
  for (name, t), (_, ref) in zip(ours, hf_names.hf_tensors(params, config)):
    np.testing.assert_array_equal(t.numpy(), np.asarray(ref), err_msg=name)
  assert dict(ours)['model.layers.0.linear_attn.conv1d.weight'].shape == (32, 1, 4)
  assert all(hf_tensors.zero_copy_report(params, config).values())
  units = [[n.split('.')[-2] for n, _ in u] for u in hf_tensors.fusion_units(ours)
           if 'linear_attn' in u[0][0] and 'in_proj' in u[0][0]]
  assert units == [['in_proj_qkv', 'in_proj_z'], ['in_proj_b', 'in_proj_a']] * 3
  assert hf_tensors.module_of('model.layers.2.linear_attn.in_proj_a.weight') == \
      'model.layers.2.linear_attn.in_proj_ba'
