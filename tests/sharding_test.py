"""Partition rules against the real Qwen2.5 and Qwen3 shapes, and the fsdp fallback to another
dimension."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models import transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
QWEN = {name: hf_schema.load_config(ROOT / 'configs/models' / name)
        for name in ('Qwen2.5-Math-1.5B', 'Qwen2.5-7B', 'Qwen3-8B')}


def shapes(config):
  return jax.eval_shape(functools.partial(transformer.init_params, config), jax.random.PRNGKey(0))


def specs(config, fsdp, tensor=1):
  mesh = AbstractMesh((1, fsdp, tensor, 1), sharding_lib.MESH_AXES)
  params = shapes(config)
  return {sharding_lib.path_str(p): (x.shape, sharding_lib.spec_for(sharding_lib.path_str(p),
                                                                   x.shape, mesh))
          for p, x in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize('name', sorted(QWEN))
@pytest.mark.parametrize('fsdp', [2, 4, 8])
def test_every_qwen_matrix_shards_over_fsdp_on_its_width(name, fsdp):
  config = QWEN[name]
  mesh = AbstractMesh((1, fsdp, 1, 1), sharding_lib.MESH_AXES)
  assert sharding_lib.replicated_on_fsdp(shapes(config), mesh, min_fraction=0.0005) == []
  matrices = {p: v for p, v in specs(config, fsdp).items() if p.endswith(('kernel', 'embedding'))}
  assert len(matrices) == 9 - config.tie_embeddings
  for path, (shape, spec) in matrices.items():
    # The rules' own dimension, the model width D, never a fallback.
    assert shape[spec.index('fsdp')] == config.hidden_size, (path, shape, spec)


def test_fsdp_falls_back_to_a_dimension_it_divides():
  got = specs(QWEN['Qwen2.5-7B'], fsdp=6)
  # D = 3584 is not a multiple of 6; V = 152064 is.
  assert got['embed/embedding'][1] == P('fsdp', None)
  assert got['lm_head/kernel'][1] == P(None, 'fsdp')
  # q_proj [28, 3584, 3584]: nothing divides by 6, so it stays whole and is reported.
  assert 'fsdp' not in got['layers/attn/q_proj/kernel'][1]
  mesh = AbstractMesh((1, 6, 1, 1), sharding_lib.MESH_AXES)
  whole = dict(sharding_lib.replicated_on_fsdp(shapes(QWEN['Qwen2.5-7B']), mesh))
  assert 'layers/attn/q_proj/kernel' in whole and 'embed/embedding' not in whole


def test_fallback_never_takes_a_dimension_the_tensor_axis_holds():
  # gate/up [L, D, F]: fsdp 5 does not divide D = 1536 but F = 8960, free while tensor is 1.
  got = specs(QWEN['Qwen2.5-Math-1.5B'], fsdp=5, tensor=1)
  assert got['layers/mlp/gate_proj/kernel'][1] == P(None, None, 'fsdp')
  # tensor=2 holds F (8960 % 2 == 0): fsdp has no free dimension left (L = 28 is not one).
  spec = sharding_lib.spec_for('layers/mlp/gate_proj/kernel', (28, 1536, 8960),
                               AbstractMesh((1, 5, 2, 1), sharding_lib.MESH_AXES))
  assert spec == P(None, None, 'tensor')


def test_fallback_placement_runs_and_matches_one_device():
  """A model whose width 3 devices do not divide but whose vocabulary they do: its embedding
  is split over the vocabulary, and the forward pass is unchanged."""
  config = transformer.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  mesh = sharding_lib.make_mesh(1, 3, 1)
  shardings = sharding_lib.param_shardings(params, mesh)
  assert shardings['embed']['embedding'].spec == P('fsdp', None)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) % 96
  fn = lambda p: transformer.forward_logits(p, config, tokens)
  sharded = jax.jit(fn)(jax.device_put(params, shardings))
  np.testing.assert_allclose(sharded, jax.jit(fn)(params), atol=1e-5)
  assert isinstance(shardings['embed']['embedding'], NamedSharding)


def test_qwen3_norms_stay_whole_on_every_device():
  """The tensor axis splits heads and each head's q/k norm scales all of its Dh: the [L, Dh]
  scales stay whole, beside projections split over fsdp and tensor."""
  got = specs(QWEN['Qwen3-8B'], fsdp=4, tensor=2)
  for name in ('q_norm', 'k_norm'):
    assert got[f'layers/attn/{name}/scale'] == ((36, 128), P(None, None))
  assert got['layers/attn/q_proj/kernel'] == ((36, 4096, 4096), P(None, 'fsdp', 'tensor'))


@pytest.mark.parametrize('name', ['Qwen3.5-2B', 'Qwen3.5-9B'])
def test_a_hybrids_linear_layers_shard_over_fsdp_on_the_width(name):
  """Qwen3.5's Gated DeltaNet projections take the fsdp axis on D (q, k and v share one
  projection and one convolution, so 'tensor' leaves them whole); nothing large stays whole."""
  config = hf_schema.load_config(ROOT / 'configs/models' / name)
  for fsdp in (2, 4, 8):
    mesh = AbstractMesh((1, fsdp, 2, 1), sharding_lib.MESH_AXES)
    assert sharding_lib.replicated_on_fsdp(shapes(config), mesh, min_fraction=0.0005) == []
  got = {p: v for p, v in specs(config, fsdp=4, tensor=2).items() if 'linear_attn' in p}
  projections = {p: v for p, v in got.items() if p.endswith('_proj/kernel') or 'in_proj' in p}
  assert len(projections) == 5 * len({p.split('/')[0] for p in got})
  for path, (shape, spec) in projections.items():
    assert shape[spec.index('fsdp')] == config.hidden_size and 'tensor' not in spec, path
