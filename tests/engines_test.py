"""The engine factory: the run's config to a spec, the spec to an engine, the reserve rule."""

import dataclasses

import pytest

from pipelinerl_jax import config as config_lib
from pipelinerl_jax.generation import engines
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models import transformer

CFG = transformer.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8)


def run_config(**generation):
  c = config_lib.load_preset('tiny')
  for key, value in generation.items():
    setattr(c.generation, key, value)
  return config_lib.validate(c, runnable=False)


def test_spec_from_config_takes_every_engine_field_of_the_run():
  config = run_config(num_slots=24, kv_page_size=8, prefill_chunk=32, share_prompts=False)
  spec = engines.spec_from_config(config, [7])
  g = config.generation
  assert (spec.backend, spec.num_slots, spec.max_seq_len, spec.eos_token_ids) == (
      g.backend, 24, g.max_seq_len, (7,))
  assert (spec.kv_cache_mb, spec.gpu_memory_utilization, spec.cuda_graphs) == (
      g.vllm.kv_cache_mb, g.vllm.gpu_memory_utilization, g.vllm.cuda_graphs)
  assert spec.lm_head_fp32 == config.model.lm_head_fp32
  # The JAX options name EngineConfig fields, with the config's values.
  built = engines.jax_config(spec)
  assert (built.num_slots, built.page_size, built.prefill_chunk, built.share_prompts) == (
      24, 8, 32, False)
  assert set(spec.jax_options) <= {f.name for f in dataclasses.fields(jax_engine.EngineConfig)}
  # An evaluation's overrides replace those fields and keep the rest.
  evaluation = engines.spec_from_config(config, [7], num_slots=4, backend='jax')
  assert evaluation == dataclasses.replace(spec, num_slots=4, backend='jax')


def test_slots_for_an_evaluation_are_a_bounded_power_of_two():
  assert [engines.slots_for(n, 16) for n in (0, 1, 2, 3, 5, 16, 17, 1000)] == [
      1, 1, 2, 4, 8, 16, 16, 16]


def test_vllm_reserves_its_largest_tensor_unless_updates_are_staged():
  # CFG's largest tensor is an MLP matrix, 32 x 64 float32 (the embedding is 40 x 32).
  assert engines.reserve_bytes(CFG, staged_updates=False) == 32 * 64 * 4
  assert engines.reserve_bytes(CFG, staged_updates=True) == 0


class Recorder:
  """Stands in for an engine class: records how it was built and what was called on it."""

  def __init__(self, *args, **kwargs):
    self.args, self.kwargs, self.calls = args, kwargs, []

  def update_params(self, params, version):
    self.calls.append(('update_params', params, version))

  def apply_update(self):
    self.calls.append(('apply_update',))


def test_make_engine_builds_the_jax_engine_the_spec_describes(monkeypatch):
  monkeypatch.setattr(jax_engine, 'JaxEngine', Recorder)
  spec = engines.EngineSpec(backend='jax', num_slots=2, max_seq_len=32, eos_token_ids=(3,),
                            jax_options=dict(page_size=8))
  engine = engines.make_engine(spec, CFG, params='params', version=5, device='device')
  assert engine.args == (CFG, 'params', engines.jax_config(spec))
  assert engine.kwargs == dict(version=5, device='device')
  assert (engine.args[2].num_slots, engine.args[2].eos_token_ids) == (2, (3,))


def test_make_engine_starts_vllm_on_the_checkpoint_or_on_the_params_given(monkeypatch):
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  monkeypatch.setattr(vllm_engine, 'VllmEngine', Recorder)
  spec = engines.EngineSpec(backend='vllm', num_slots=2, max_seq_len=32, eos_token_ids=(3,),
                            kv_cache_mb=16, cuda_graphs=False)
  on_disk = engines.make_engine(spec, CFG, model_dir='ckpt', version=4)
  config = on_disk.args[1]
  assert on_disk.args[0] == 'ckpt' and on_disk.kwargs == dict(version=4) and not on_disk.calls
  assert (config.max_num_seqs, config.max_model_len, config.eos_token_ids,
          config.kv_cache_bytes, config.cuda_graphs) == (2, 32, (3,), 16 << 20, False)
  assert config.reserve_bytes == engines.reserve_bytes(CFG, staged_updates=False) > 0
  # With params: loaded as `version` before the first token; the checkpoint is never served.
  given = engines.make_engine(spec, CFG, params='params', version=7, model_dir='ckpt',
                              staged_updates=True)
  assert given.kwargs == dict(version=-1) and given.args[1].reserve_bytes == 0
  assert given.calls == [('update_params', 'params', 7), ('apply_update',)]


def test_bad_specs_fail_in_one_line_naming_what_is_missing():
  with pytest.raises(ValueError, match="EngineSpec.backend='sglang' is not 'jax' or 'vllm'"):
    engines.EngineSpec(backend='sglang', num_slots=1, max_seq_len=8, eos_token_ids=())
  jax_spec = engines.EngineSpec(backend='jax', num_slots=1, max_seq_len=8, eos_token_ids=())
  with pytest.raises(ValueError, match='the JAX engine needs params'):
    engines.make_engine(jax_spec, CFG)
  vllm_spec = dataclasses.replace(jax_spec, backend='vllm')
  with pytest.raises(ValueError, match='the vLLM engine needs model_dir'):
    engines.make_engine(vllm_spec, CFG, params={})
