"""LoRA: B = 0 is the base, only adapters train, the JAX engine serves adapters on the trainer's
base (log mu = the trainer's, updates mid-sequence, no drift), orbax resume, PEFT export, a run."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelinerl_jax import checkpoint as checkpoint_lib
from pipelinerl_jax import config as config_lib
from pipelinerl_jax import export as export_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import peft as hf_peft
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models import transformer
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.pipeline import placements

from checkpoint_test import varied_rewards  # noqa: F401 (a fixture)
import pipeline_test  # its small_config (tests/ is on sys.path under pytest)
import train_test  # its tiny CONFIG and packed random batches

CONFIG = train_test.CONFIG
LORA = config_lib.LoraSettings(rank=4, alpha=8.0)
MAX_LEN = 64


def random_adapters(config, lora, seed, b_scale=0.1):
  """Adapters with a random B too (init gives B = 0): the delta is not zero."""
  adapters = lora_lib.init_adapters(config, lora, jax.random.PRNGKey(seed))
  key = jax.random.PRNGKey(seed + 1000)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: b_scale * jax.random.normal(key, x.shape) if p[-1].key == 'b' else x,
      adapters)


def logprobs(params, config, tokens_RxT):
  r, t = tokens_RxT.shape
  lp, _ = transformer.token_logprobs(params, config, tokens_RxT[:, :-1], tokens_RxT[:, 1:],
                                     jnp.broadcast_to(jnp.arange(t - 1), (r, t - 1)),
                                     jnp.ones((r, t - 1), jnp.int32))
  return np.asarray(lp)


def test_zero_b_is_exactly_the_base_and_any_b_is_the_merged_model():
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, CONFIG.vocab_size)
  base = logprobs(params, CONFIG, tokens)
  fresh = lora_lib.init_adapters(CONFIG, LORA, jax.random.PRNGKey(2))
  assert np.abs(np.asarray(fresh['layers']['mlp']['up_proj']['a'])).max() > 0  # A is random
  np.testing.assert_array_equal(logprobs(lora_lib.Adapted(params, fresh, LORA.scale), CONFIG,
                                         tokens), base)
  adapters = random_adapters(CONFIG, LORA, 3)
  unmerged = logprobs(lora_lib.Adapted(params, adapters, LORA.scale), CONFIG, tokens)
  merged = logprobs(lora_lib.merge(params, adapters, scale=LORA.scale), CONFIG, tokens)
  assert np.abs(unmerged - base).max() > 1e-2  # the delta matters
  np.testing.assert_allclose(unmerged, merged, atol=1e-5)
  only_o = config_lib.LoraSettings(rank=2, alpha=2.0, targets=('o_proj',))
  assert lora_lib.shapes(CONFIG, only_o) == {('layers', 'attn', 'o_proj', 'a'): (2, 64, 2),
                                             ('layers', 'attn', 'o_proj', 'b'): (2, 2, 64)}
  # A merged reload sends fused modules whole: q with k and v, up with gate.
  assert lora_lib.merged_targets(config_lib.LoraSettings(2, 2.0, ('up_proj', 'q_proj'))) == (
      'q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj')


def test_train_step_optimizes_only_the_adapters():
  """State params, gradients and Adam moments are the adapters' alone; the base passed to the
  step is never donated nor changed; after two steps both A and B moved."""
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  opt_config = config_lib.OptimizerConfig(lr=1e-2)
  optimizer = train.make_optimizer(opt_config)
  base = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  base = jax.device_put(base, sharding_lib.param_shardings(base, mesh))
  base_before = jax.tree.map(np.asarray, base)
  adapters = lora_lib.init_adapters(CONFIG, LORA, jax.random.PRNGKey(1))
  state, shardings = train.create_sharded_state(adapters, optimizer, mesh)
  step = train.jit_train_step(
      train.make_train_step(CONFIG, config_lib.LossConfig(), optimizer,
                            train.lr_schedule(opt_config), lora_scale=LORA.scale),
      shardings, mesh, base=base)
  adapter_shapes = {tuple(x.shape) for x in jax.tree.leaves(adapters)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and {tuple(x.shape) for x in moments} <= adapter_shapes
  assert sum(x.size for x in moments) == 2 * lora_lib.num_params(CONFIG, LORA)  # mu and nu
  for seed in (1, 2):
    state, metrics = step(state, train_test.micro(train_test.random_batch(seed), 2))
    assert metrics['skipped'] == 0 and metrics['grad_norm'] > 0
  assert int(state.step) == 2
  for name in ('a', 'b'):
    moved = np.abs(np.asarray(state.params['layers']['attn']['v_proj'][name])
                   - np.asarray(adapters['layers']['attn']['v_proj'][name])).max()
    assert moved > 1e-4, name  # B from its first step, A once B is not zero
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), base, base_before)
  assert not any(x.is_deleted() for x in jax.tree.leaves(base))


def _requests(tag, n=3, max_tokens=10, seed=50):
  """Sampled (temperature 1) requests: the same tag gives the same prompts and seeds."""
  return [api.Request(f'{tag}{i}', [3 + i, 7, 11, 2 + i], api.SamplingParams(
      temperature=1.0, max_tokens=max_tokens), seed=seed + i) for i in range(n)]


def _run(engine, requests, update_at=None, update=None):
  for r in requests:
    engine.submit(r)
  done, steps = {}, 0
  while engine.num_unfinished:
    if steps == update_at:
      engine.update_params(*update)
    done.update((c.request_id, c) for c in engine.step())
    steps += 1
  return [done[r.request_id] for r in requests]


def _stale_kv_logprobs(p_old, p_new, config, comp, k):
  """log-probs of a sequence whose params changed before generated token k, the KV of the
  prompt and tokens 0..k-2 kept from the old params."""
  prompt, toks = list(comp.prompt_tokens), comp.tokens.tolist()
  old = logprobs(p_old, config, jnp.array([prompt + toks]))[0, len(prompt) - 1:][:k]
  ctx = prompt + toks[:k - 1]
  _, cache = transformer.decode(p_old, config, jnp.array([ctx]), jnp.arange(len(ctx))[None],
                                transformer.init_cache(config, 1, MAX_LEN))
  rest = toks[k - 1:-1]
  logits, _ = transformer.decode(p_new, config, jnp.array([rest]),
                                 (len(ctx) + jnp.arange(len(rest)))[None], cache)
  lp = jax.nn.log_softmax(logits[0], axis=-1)
  new = np.asarray(jnp.take_along_axis(lp, jnp.array(toks[k:])[:, None], axis=-1)[:, 0])
  return np.concatenate([old, new])


def test_jax_engine_serves_adapters_on_the_trainers_own_base():
  """One copy of the base: the engine reads the trainer's buffers; log mu equals the trainer's
  log pi with adapters; an adapter update lands mid-sequence with per-token versions; 1,000
  updates later the same adapters give bit-identical tokens and log mu (nothing merged)."""
  device = jax.devices()[0]
  mesh = sharding_lib.make_mesh(devices=[device])
  base = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  base = jax.device_put(base, sharding_lib.param_shardings(base, mesh))  # the trainer's layout
  a1, a2 = random_adapters(CONFIG, LORA, 1), random_adapters(CONFIG, LORA, 2)
  copy = placements.copy_params_fn(device)
  served = lora_lib.Adapted(placements.base_on(base, device), copy(a1), LORA.scale)
  engine = jax_engine.JaxEngine(CONFIG, served, jax_engine.EngineConfig(
      num_slots=4, max_seq_len=MAX_LEN), version=1, device=device)
  with engine:
    for mine, theirs in zip(jax.tree.leaves(engine._params.base), jax.tree.leaves(base)):
      assert mine.unsafe_buffer_pointer() == theirs.unsafe_buffer_pointer()

    first = _run(engine, _requests('a'))
    p1 = lora_lib.Adapted(base, a1, LORA.scale)
    for c in first:
      assert (c.versions == 1).all()
      ref = logprobs(p1, CONFIG, jnp.array([list(c.prompt_tokens) + c.tokens.tolist()]))
      np.testing.assert_allclose(c.logprobs, ref[0, len(c.prompt_tokens) - 1:], atol=1e-5)

    k = 4  # the update lands before the 5th step: tokens 0..3 old, 4.. new
    mid = _run(engine, _requests('m'), update_at=k, update=(copy(a2), 2))
    p2 = lora_lib.Adapted(base, a2, LORA.scale)
    changed = 0
    for c, before in zip(mid, first):
      np.testing.assert_array_equal(c.tokens[:k], before.tokens[:k])
      np.testing.assert_array_equal(c.versions, [1] * k + [2] * (len(c.tokens) - k))
      np.testing.assert_allclose(c.logprobs, _stale_kv_logprobs(p1, p2, CONFIG, c, k),
                                 atol=1e-5)
      changed += not np.array_equal(c.tokens, before.tokens)
    assert changed  # the new adapters took over

    with pytest.raises(ValueError, match='adapter update to version 3 rejected'):
      engine.update_params(random_adapters(CONFIG, config_lib.LoraSettings(2, 2.0), 0), 3)

    # An update swaps the served adapters (nothing is merged into the base, so nothing can
    # accumulate): after others, a1 again gives a1's tokens and log mu bit for bit.
    for v, other in enumerate([copy(a2), copy(random_adapters(CONFIG, LORA, 100))]):
      engine.update_params(other, 3 + v)
      engine.step()  # a step applies a pending update first
    engine.update_params(copy(a1), 10)
    again = _run(engine, _requests('a'))
    for c, before in zip(again, first):
      np.testing.assert_array_equal(c.tokens, before.tokens)
      np.testing.assert_array_equal(c.logprobs, before.logprobs)
    assert engine.stats()['updates'] >= 4
    for mine, theirs in zip(jax.tree.leaves(engine._params.base), jax.tree.leaves(base)):
      assert mine.unsafe_buffer_pointer() == theirs.unsafe_buffer_pointer()


def _lora_config(**rl):
  c = pipeline_test.small_config(**rl)
  c.log.tensorboard = False
  c.model.lora.rank = 4
  c.model.lora.alpha = 8.0
  c.optimizer.lr = 3e-3
  return c


def test_lora_run_publishes_adapters_only_and_its_checkpoint_restores_exactly(
    model_dir, tmp_path, varied_rewards):
  """A LoRA run trains, publishes and saves the adapters (and their Adam state), never the base:
  every step publishes the adapters' bytes, each token carries its policy version, and the
  checkpoint restores bit for bit (the base is referenced by its model dir)."""
  c = _lora_config(max_lag=1, total_steps=3)
  c.checkpoint.every_steps = 0  # only at exit
  c.eval.every_steps, c.eval.num_problems, c.eval.k = 3, 4, 2  # evaluated in the run, LoRA too
  summary = launch.run_experiment(c, str(tmp_path), model_dir=model_dir)
  assert summary['steps'] == 3
  model_config = hf_schema.load_config(model_dir)
  lora = config_lib.LoraSettings(rank=4, alpha=8.0)
  state = summary['final_state']
  lora_lib.check_adapters(state.params, model_config, lora)  # the state: adapters
  assert np.abs(np.asarray(state.params['layers']['mlp']['down_proj']['b'])).max() > 0
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2, 3]
  assert 0 <= records[-1]['eval/pass@1'] <= 1 and records[-1]['eval/mean_tokens'] > 0
  assert 'eval/pass@1' not in records[0]
  for r in records:
    assert r['publish_bytes'] == 4 * lora_lib.num_params(model_config, lora)
    assert 1 <= r['versions_per_sample_mean'] <= r['versions_per_sample_max'] <= 2
    assert 0 <= r['lag_last_token_mean'] <= r['lag_first_token_mean'] <= 1

  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  target, _ = checkpoint_lib.abstract_state(
      model_config, train.make_optimizer(config_lib.validate(c).optimizer), mesh, lora)
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path / 'checkpoints'), 3, 0)
  restored, meta = checkpoints.restore(target)
  checkpoints.close()
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # adapters, Adam state, step
  assert meta['model_dir'] == os.path.abspath(model_dir)  # the base: referenced, not copied

  c.model.lora.rank, c.rl.total_steps = 0, 5
  with pytest.raises(ValueError, match=r'config.model.lora: this run is full fine-tuning, the '
                                       r'checkpoints .* are LoRA rank 4'):
    launch.run_experiment(c, str(tmp_path), model_dir=model_dir)


def test_peft_export_loads_in_peft_with_the_merged_exports_logits(model_dir, tmp_path):
  """A LoRA checkpoint exported both ways: PEFT's PeftModel on the base and transformers on the
  merged export (merged in fp32) give the same logits, and equal the trainer's."""
  import peft  # (the test extra's: pyproject.toml)
  import torch
  import transformers
  model_config = hf_schema.load_config(model_dir)
  lora = config_lib.LoraSettings(rank=4, alpha=8.0, targets=config_lib.LORA_TARGETS)
  adapters = random_adapters(model_config, lora, 7, b_scale=0.2)
  mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
  state, _ = train.create_sharded_state(adapters, optax.adam(1e-3), mesh)
  state = state.replace(step=jnp.asarray(5, jnp.int32))
  config = _lora_config()
  config.model.lora.targets = config_lib.LORA_TARGETS
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), keep=1, every_steps=0)
  checkpoints.save(state, checkpoint_lib.run_meta(config_lib.validate(config), model_dir,
                                                  dict(step=5)))
  checkpoints.close()

  export_lib.export_hf(tmp_path / 'ckpt', None, tmp_path / 'peft', format='peft')
  export_lib.export_hf(tmp_path / 'ckpt', None, tmp_path / 'merged')
  saved = json.loads((tmp_path / 'peft' / hf_peft.CONFIG_FILE).read_text())
  assert saved['r'] == 4 and saved['lora_alpha'] == 8.0
  with pytest.raises(ValueError, match='format=.* expected one of'):
    export_lib.export_hf(tmp_path / 'ckpt', None, tmp_path / 'x', format='gguf')

  tokens = torch.tensor([[3, 9, 4, 12, 5, 7, 8]])
  base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  with torch.no_grad():
    peft_logits = peft.PeftModel.from_pretrained(base, str(tmp_path / 'peft'))(tokens).logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'merged',
                                                               dtype=torch.float32)
    merged_logits = merged(tokens).logits
  np.testing.assert_allclose(peft_logits.numpy(), merged_logits.numpy(), atol=1e-4)
  ours = transformer.forward_logits(
      lora_lib.Adapted(hf_checkpoint.load_params(model_dir, model_config), adapters, lora.scale),
      model_config, jnp.asarray(tokens.numpy()))
  np.testing.assert_allclose(np.asarray(ours), merged_logits.numpy(), atol=1e-4)


def test_lora_settings_errors_name_the_key():
  for key, value, match in (('rank', -1, 'config.model.lora.rank: must be >= 0'),
                            ('alpha', 0.0, 'config.model.lora.alpha: must be finite and > 0'),
                            ('targets', ('qkv',), 'config.model.lora.targets: must be distinct')):
    c = config_lib.base_config()
    c.model.lora.rank = 8
    c.model.lora[key] = value
    with pytest.raises(ValueError, match=match):
      config_lib.validate(c, runnable=False)
  c = config_lib.base_config()
  c.model.lora.rank, c.train.num_processes = 8, 2
  with pytest.raises(ValueError, match='config.model.lora: LoRA trains in one trainer process'):
    config_lib.validate(c, runnable=False)
  # A mixture of experts: refused by the config for the demo's, by the adapters' shapes for a
  # model dir's (its experts are stacked weights, its layers scanned in runs of one kind).
  c = config_lib.base_config()
  c.model.lora.rank, c.model.demo.architecture = 8, 'qwen3_moe'
  with pytest.raises(ValueError, match='config.model.lora: LoRA on a mixture-of-experts model'):
    config_lib.validate(c, runnable=False)
  moe_config = dataclasses.replace(CONFIG, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=16, moe_layers=(0,))
  with pytest.raises(ValueError, match='model.lora: LoRA on a mixture-of-experts model'):
    lora_lib.shapes(moe_config, LORA)


def test_lora_on_a_moe_model_dir_is_refused_from_its_config_json(tmp_path):
  """A Qwen3-MoE model dir is refused by the run's own entry point from its config.json: the dir
  holds nothing else, so any weight load would have failed otherwise, and the workdir is not
  even claimed."""
  c = config_lib.base_config()
  c.model.lora.rank = 8
  c.model.path = str(config_lib.CONFIGS_DIR / 'models' / 'Qwen3-30B-A3B')
  assert os.listdir(c.model.path) == ['config.json']
  with pytest.raises(ValueError, match=r'^config.model.lora: LoRA on a mixture-of-experts model '
                                       r'\(128 experts in 48 layers\) is not supported'):
    launch.run_experiment(c, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_adapters_over_a_collective_reach_a_generators_engine_whole(model_dir):
  """A generator actor's side, without Ray: its decode loop builds a JAX engine on the base in
  its model dir from the first adapters (object store: a pytree), then takes an update over a
  collective (PEFT-named tensors, a fraction of a full update's bytes) and serves it."""
  import threading
  from collective_test import comms  # an in-process loopback group
  from pipelinerl_jax.generation import engines
  from pipelinerl_jax.generation.actors import decode_loop
  from pipelinerl_jax.generation.transport import collective
  from pipelinerl_jax.generation.transport import hf_tensors
  model_config = hf_schema.load_config(model_dir)
  a1, a2 = (random_adapters(model_config, LORA, seed) for seed in (1, 2))
  plan = collective.make_plan(hf_tensors.update_shapes(model_config, LORA), 'float32', 1 << 20)
  full = collective.make_plan(hf_tensors.update_shapes(model_config), 'float32', 1 << 20)
  assert plan.nbytes == 4 * lora_lib.num_params(model_config, LORA) < full.nbytes / 4

  spec = engines.EngineSpec(backend='jax', num_slots=4, max_seq_len=MAX_LEN, eos_token_ids=(),
                            lora=LORA)
  loop = decode_loop.DecodeLoop('g0', spec, model_dir, staged_updates=True,
                                model=lambda: model_config)
  try:
    loop.apply(jax.tree.map(np.asarray, a1), 1)  # builds the engine
    trainer, generator = comms(2)
    received = {}
    thread = threading.Thread(target=lambda: received.update(
        r=collective.Receiver(generator, plan).receive(timeout_s=30)))
    thread.start()
    collective.send(trainer, plan, hf_tensors.gathered_update_tensors(
        a2, model_config, jax.devices()[0], 'float32', LORA), version=2)
    thread.join(30)
    version, views, release = received['r']
    assert version == 2
    loop.apply(None, 2, hf_views=views, release=release)
    loop.submit(_requests('c'))
    done, ack = [], 0
    while len(done) < 3:
      items = loop.poll(ack, wait_s=30)
      assert items, 'no completion within 30 s'
      done += [c for _, c in items]
      ack = items[-1][0]
  finally:
    loop.close()
  base = hf_checkpoint.load_params(model_dir, model_config)
  for c in done:
    assert (c.versions == 2).all()
    ref = logprobs(lora_lib.Adapted(base, a2, LORA.scale), model_config,
                   jnp.array([list(c.prompt_tokens) + c.tokens.tolist()]))
    np.testing.assert_allclose(c.logprobs, ref[0, len(c.prompt_tokens) - 1:], atol=1e-5)
