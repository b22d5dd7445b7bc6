"""The trainer's numeric core: `train_step(state, batch) -> (state, metrics)`, pure and jitted.

The batch is packed rows split into micro-batches, every array [M, R, T] (see packing.py), and
the rows' sample spans [M, R, G]; for a mixture-of-experts model also the experts the sampler
routed each model token to, `routes` [M, R, T, Ls, Xk] (when every sample has them): the
trainer replays them (`moe_routing='replay'`: models/layers/moe.py) or only compares its own routes
with them.
Gradients are accumulated over the M micro-batches with `lax.scan`; the loss of each is
normalized by totals over the whole batch, so the accumulated gradient is exactly the
full-batch gradient. A non-finite loss, gradient, updated param or optimizer moment skips the
update (params, optimizer state and step unchanged) and is reported in `metrics['skipped']`: so
a non-finite state is never published, saved or resumed. (Finite loss and gradients can still
give non-finite params: an lr of 1e30, an Adam moment that overflows.)

LoRA (models/layers/lora.py): the state's params are the adapters, and the frozen base is a third,
non-donated argument, `train_step(state, batch, base)`: gradients and Adam moments exist for the
adapters only, and the base's buffers stay valid for whoever else reads them (an inline engine).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from pipelinerl_jax import config as config_lib
from pipelinerl_jax import losses
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models.layers import lora as lora_lib
from pipelinerl_jax.models.layers import moe as moe_lib
from pipelinerl_jax.models import transformer

# Per-token arrays [M, R, T], then the packer's spans of each row's samples [M, R, G] (which
# cuDNN attention reads instead of recomputing them from the segment ids).
TOKEN_KEYS = ('tokens', 'targets', 'positions', 'segment_ids', 'loss_mask', 'behaviour_logprobs',
              'advantages')
SPAN_KEYS = ('segment_starts', 'segment_lengths')
BATCH_KEYS = TOKEN_KEYS + SPAN_KEYS
OPTIONAL_KEYS = ('routes',)  # a batch holds them when its samples do
MOE_ROUTING = ('recompute', 'replay')


@flax.struct.dataclass
class TrainState:
  step: jax.Array             # optimizer updates applied so far = the policy version
  params: Any                 # what is trained: every weight, or the adapters with LoRA
  opt_state: Any


def lr_schedule(config: config_lib.OptimizerConfig) -> optax.Schedule:
  if config.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup_steps, max(config.total_steps, config.warmup_steps + 1),
        end_value=config.lr * config.min_lr_ratio)
  warmup = max(config.warmup_steps, 1)
  return lambda step: config.lr * jnp.minimum(1.0, (step + 1) / warmup)


def make_optimizer(config: config_lib.OptimizerConfig) -> optax.GradientTransformation:
  # Decay only matrices (LoRA's A and B too): norm scales and biases are stacked over layers,
  # so ndim can't tell.
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: sharding_lib.path_str(path).endswith(('kernel', 'embedding', '/a', '/b')),
      params)
  adamw = optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if config.max_grad_norm:
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
  return adamw


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def all_finite(tree) -> jax.Array:
  """True when every floating-point leaf of `tree` is finite (integer leaves always are)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def batch_totals(batch) -> tuple[jax.Array, jax.Array]:
  """(sequences, loss tokens) over the whole batch: the loss normalizers (paper: / B sequences)."""
  starts = (batch['positions'] == 0) & (batch['segment_ids'] != 0)
  num_samples = jnp.maximum(jnp.sum(starts), 1).astype(jnp.float32)
  num_tokens = jnp.maximum(jnp.sum(batch['loss_mask']), 1.0).astype(jnp.float32)
  return num_samples, num_tokens


def make_train_step(model_config: transformer.ModelConfig, loss_config: config_lib.LossConfig,
                    optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    temperature: float = 1.0, lora_scale: float | None = None, *, mesh=None,
                    moe_routing: str = 'recompute') -> Callable:
  """Returns the pure `train_step(state, batch) -> (state, metrics)`; with `lora_scale` (alpha /
  rank) `train_step(state, batch, base)`, whose state's params are the adapters.

  An MoE model's experts run on `mesh` (the step's; None: wherever XLA places them), its
  routes are `moe_routing`: 'recompute' (the trainer's own) or 'replay' (a model token goes to
  the experts the sampler used, from the batch's `routes`); its load-balancing loss, weighted by
  `loss_config.router_aux_coef`, and routing metrics join the loss and metrics."""
  if moe_routing not in MOE_ROUTING:
    raise ValueError(f'moe_routing={moe_routing!r} is not one of {MOE_ROUTING}')
  batch_axes = () if mesh is None else sharding_lib.batch_axes(mesh)

  def micro_loss(trainable, micro, num_samples, num_tokens, num_real, base):
    params = trainable if base is None else lora_lib.Adapted(base, trainable, lora_scale)
    spans = tuple(micro[k] for k in SPAN_KEYS) if SPAN_KEYS[0] in micro else None
    sampler_routes = micro.get('routes')
    sampled_RxT = micro['loss_mask'] > 0
    replay = sampler_routes is not None and moe_routing == 'replay'
    logp_RxT, entropy_RxT, routes = transformer.token_logprobs_routed(
        params, model_config, micro['tokens'], micro['targets'], micro['positions'],
        micro['segment_ids'], temperature=temperature, spans=spans,
        routes_RxTxLsxXk=sampler_routes if replay else None,
        replay_RxT=sampled_RxT if replay else None, mesh=mesh, batch_axes=batch_axes)
    loss, stats = losses.policy_loss(logp_RxT, entropy_RxT, micro, loss_config,
                                     num_samples=num_samples, num_tokens=num_tokens)
    if routes is not None:
      aux, moe_stats = moe_lib.routing_stats(routes, micro['segment_ids'] != 0, num_real,
                                             sampler_routes, sampled_RxT)
      loss = loss + loss_config.router_aux_coef * aux
      stats = {**stats, **jax.lax.stop_gradient(moe_stats)}
    return loss, stats

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)  # gradients of the trainable only

  def train_step(state: TrainState, batch, base=None):
    if (base is None) != (lora_scale is None):
      raise ValueError('train_step: the base is passed with LoRA (lora_scale), and only then')
    num_samples, num_tokens = batch_totals(batch)
    num_real = jnp.sum(batch['segment_ids'] != 0).astype(jnp.float32)
    first = jax.tree.map(lambda x: x[0], batch)
    _, stats_shape = jax.eval_shape(micro_loss, state.params, first, num_samples, num_tokens,
                                    num_real, base)
    # Zeros are neutral for sums; -inf for maxima (combine_stats takes the max of '_max' keys).
    stats0 = {k: jnp.full(v.shape, -jnp.inf if k.endswith('_max') else 0, v.dtype)
              for k, v in stats_shape.items()}
    grads0 = jax.tree.map(jnp.zeros_like, state.params)

    def accumulate(carry, micro):
      grads_acc, loss_acc, stats_acc = carry
      (loss, stats), grads = grad_fn(state.params, micro, num_samples, num_tokens, num_real,
                                     base)
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss,
              losses.combine_stats(stats_acc, stats)), None

    (grads, loss, stats), _ = jax.lax.scan(accumulate, (grads0, jnp.zeros(()), stats0), batch)

    with jax.named_scope('optimizer'):  # the profile breakdown finds the update by this
      grad_norm = optax.tree.norm(grads)
      updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
      new_params = optax.apply_updates(state.params, updates)
      ok = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(new_params)
            & all_finite(new_opt_state))
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      new_state = TrainState(step=state.step + ok.astype(jnp.int32),
                             params=keep(new_params, state.params),
                             opt_state=keep(new_opt_state, state.opt_state))
    metrics = dict(losses.finalize_metrics(stats))
    if 'moe_aux_loss' in stats:
      metrics.update(moe_lib.routing_metrics(stats))
    metrics.update(loss=loss, grad_norm=grad_norm, lr=schedule(state.step),
                   skipped=1 - ok.astype(jnp.int32), num_samples=num_samples,
                   num_tokens=num_tokens)
    return new_state, metrics

  return train_step


def state_shardings(state: TrainState, mesh):
  """Shardings for a TrainState: params by the partition rules, optimizer moments likewise
  (they mirror the params), scalars replicated. Works on arrays or ShapeDtypeStructs."""
  param_sh = sharding_lib.param_shardings(state.params, mesh)
  by_shape_path = {}
  jax.tree_util.tree_map_with_path(
      lambda p, x, s: by_shape_path.setdefault(sharding_lib.path_str(p), (x.shape, s)),
      state.params, param_sh)

  def for_opt_leaf(path, x):
    # optax states nest the param tree under their own keys (e.g. '1/0/mu/layers/...'): use the
    # sharding of the param whose path ends this leaf's path and whose shape it has.
    p = sharding_lib.path_str(path)
    for param_path, (shape, sh) in by_shape_path.items():
      if (p == param_path or p.endswith('/' + param_path)) and x.shape == shape:
        return sh
    return sharding_lib.replicated(mesh)

  return TrainState(step=sharding_lib.replicated(mesh), params=param_sh,
                    opt_state=jax.tree_util.tree_map_with_path(for_opt_leaf, state.opt_state))


def jit_train_step(train_step: Callable, state_sharding: TrainState, mesh, base=None):
  """`jax.jit` with explicit shardings: state donated, batch rows split over (data, fsdp) (one
  sharding for every array of the batch dict, whichever keys it has). With LoRA, `base` (the
  frozen params, placed) is bound as the step's third argument, in its own shardings and never
  donated: the result is still `step(state, batch)`."""
  batch_sh = sharding_lib.batch_sharding(mesh, leading_dims=1)
  out_sh = (state_sharding, sharding_lib.replicated(mesh))
  if base is None:
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sh), out_shardings=out_sh,
                   donate_argnums=(0,))
  base_sh = jax.tree.map(lambda x: x.sharding, base)
  jitted = jax.jit(train_step, in_shardings=(state_sharding, batch_sh, base_sh),
                   out_shardings=out_sh, donate_argnums=(0,))
  return functools.partial(_with_base, jitted, base)


def _with_base(jitted: Callable, base, state: TrainState, batch):
  return jitted(state, batch, base)


def create_sharded_state(params, optimizer, mesh) -> tuple[TrainState, TrainState]:
  """Places params by the rules and builds the optimizer state directly in its sharding."""
  shapes = jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer), params)
  shardings = state_shardings(shapes, mesh)
  params = jax.device_put(params, shardings.params)
  state = jax.jit(functools.partial(init_train_state, optimizer=optimizer),
                  out_shardings=shardings)(params)
  return state, shardings
