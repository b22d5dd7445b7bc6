"""VllmEngine on a Qwen3.5-MoE hybrid (routed experts and a gated shared expert in every MLP)
across an in-flight update: each sequence's recurrent state kept, log mu against the trainer's
log pi before and after. vllm_hybrid_test does the same for the dense hybrid; this file has its
own process-wide vLLM engine (one per module), so the two never share a process at once.

vLLM routes on its own (bf16): where two experts' scores nearly tie, a token may take another
expert than the trainer's fp32 router, and that token's log mu differs by far more than bf16
noise. So the bounds are on the mean and on most tokens, not on every token; the JAX engine's
routing replay is what makes a MoE's routes the trainer's (docs/moe.md).
"""


import numpy as np
import pytest

from pipelinerl_jax.bench import vllm_hybrid as bench

MEAN_BOUND = 2e-2   # nats per token, mean: bf16 plus the odd route that flips
NEAR = 5e-2         # what a token within bf16 noise is off by at most
REQUESTS, TOKENS, UPDATE_AT = 3, 12, 5


@pytest.fixture(scope='module')
def model(built_once):
  workdir = built_once('qwen35-moe-vllm', lambda d: bench.build(d, scale=0.05, moe=True))
  return bench.exact(bench.load(bench.build(workdir, scale=0.05, moe=True)))


@pytest.fixture(scope='module')
def engine(model):
  with bench.start_engine(model.dir, REQUESTS, 64) as eng:
    yield eng


@pytest.mark.needs('vllm')
def test_an_moe_hybrid_keeps_each_sequences_state_across_an_update(engine, model):
  assert model.config.num_experts == 4 and model.config.shared_expert_intermediate_size
  base, mid, fresh = bench.decode(engine, model.old, model.new, version=10, n=REQUESTS,
                                  tokens=TOKENS, update_at=UPDATE_AT)
  changed = 0
  for b, m in zip(base, mid):
    np.testing.assert_array_equal(m.tokens[:UPDATE_AT], b.tokens[:UPDATE_AT])
    np.testing.assert_array_equal(m.versions, [10] * UPDATE_AT + [11] * (TOKENS - UPDATE_AT))
    changed += not np.array_equal(m.tokens, b.tokens)
  assert changed >= 2  # the continuation follows the new weights (experts included)
  assert all((c.versions == 11).all() for c in fresh)

  d = bench.compare(model, model.old, model.new, base, mid, fresh, UPDATE_AT)
  for name in ('before_vs_trainer_old', 'after_vs_stale', 'fresh_vs_trainer_new'):
    assert d[name].mean() <= MEAN_BOUND and np.mean(d[name] <= NEAR) >= 0.9, (name, d[name])
  assert d['after_vs_recomputed'].mean() >= 10 * d['after_vs_stale'].mean()
