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
