"""Mixture of experts in Qwen3-MoE's and Qwen3.5-MoE's form: a router, top-k experts per token,
expert MLPs, and for Qwen3.5-MoE a shared expert.

One routing rule, Qwen3-MoE's (transformers' `Qwen3MoeSparseMoeBlock`): router logits x W_r, a
softmax over all X experts in fp32, the Xk most probable experts, their probabilities as gates
(renormalized to sum to 1 when `norm_topk_prob`). An expert is a SwiGLU MLP of width I; a
token's output is the gated sum of its experts' outputs. Qwen3.5-MoE (transformers'
`Qwen3_5MoeSparseMoeBlock`) routes the same way, always renormalized, and adds a shared expert:
a SwiGLU MLP of width Is that every token goes through, its output scaled by
sigmoid(x w_s) (`shared_expert_gate`, one weight per model dim), beside the routed experts'
sum. Routing replay and the expert axis concern the routed experts only; the shared expert is a
dense MLP, sharded as one.

Two ways to compute the experts, one result:
  * `experts_ragged` (the default): the U·Xk token-expert assignments sorted by expert, so each
    expert's tokens are one contiguous block, multiplied with `jax.lax.ragged_dot` (a grouped
    matmul: each block by its own expert's weights), then scattered back and added per token.
    Work grows with Xk, not X.
  * `experts_dense`: every expert on every token, weighted by a [U, X] gate matrix that is zero
    off the top-k: the reference the tests compare against (X / Xk times the work).

Routing replay (RL): the trainer may be handed the experts the sampler used for a token
(`replay_ids`), and then sends the token there instead of to its own top-k; its gates still come
from the current router's probabilities at those experts, so the router keeps learning. The
layer always reports its own top-k too (`LayerRoutes`), so a run sees how often the two differ.

Experts on a mesh axis (`expert_parallel`): each device of the 'expert' axis holds X / ep
experts (Xl). Tokens are exchanged as all-gather + reduce-scatter over that axis: a device
gathers the rows of its expert group, computes its own experts' share for all of them (the rest
sorted to the end and skipped), and the reduce-scatter sums the shares and hands each device its
rows back. Exact (a sum of the same terms), portable (no ragged all-to-all), and the sort stays
local to a device.

Shape letters (the README's table): U tokens of one call flattened (R·T), X experts, Xk experts
per token, Xl experts one device holds, I expert MLP width, Is the shared expert's, Y
token-expert assignments (U·Xk).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pipelinerl_jax.models.layers.common import MLP, dense

DISPATCHES = ('ragged', 'dense')
EXPERT_AXIS = 'expert'


class LayerRoutes(NamedTuple):
  """What one MoE layer reports for a training call: the experts each token was sent to and the
  router's own top-k ([R, T, Xk], `route_dtype`), and for the load-balancing loss the count of
  own top-k assignments and the sum of router probabilities per expert over real tokens ([X]
  fp32; the probabilities carry the gradient)."""
  used: jax.Array
  own: jax.Array
  counts: jax.Array
  probs: jax.Array


def route_dtype(num_experts: int):
  """The narrowest unsigned integer dtype that holds every expert id (routes travel with each
  token from the engine to the loss: one byte per id up to 256 experts)."""
  return jnp.uint8 if num_experts <= 256 else jnp.uint16 if num_experts <= 65536 else jnp.int32


def route(logits_UxX: jax.Array, k: int, norm_topk_prob: bool, replay_ids_UxXk=None,
          replay_U=None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(ids used [U, Xk] int32, their gates [U, Xk] fp32, own top-k ids [U, Xk] int32, router
  probabilities [U, X] fp32). Tokens with `replay_U` set go to `replay_ids_UxXk`."""
  probs_UxX = jax.nn.softmax(logits_UxX.astype(jnp.float32), axis=-1)
  _, own_UxXk = jax.lax.top_k(probs_UxX, k)
  ids_UxXk = own_UxXk
  if replay_ids_UxXk is not None:
    ids_UxXk = jnp.where(replay_U[:, None], replay_ids_UxXk.astype(jnp.int32), own_UxXk)
  gates_UxXk = jnp.take_along_axis(probs_UxX, ids_UxXk, axis=-1)
  if norm_topk_prob:
    gates_UxXk = gates_UxXk / jnp.sum(gates_UxXk, axis=-1, keepdims=True)
  return ids_UxXk, gates_UxXk, own_UxXk, probs_UxX


def _swiglu(gate, up):
  return nn.silu(gate) * up


def experts_ragged(x_UxD, ids_UxXk, gates_UxXk, w_gate_XlxDxI, w_up_XlxDxI, w_down_XlxIxD,
                   first_expert=0) -> jax.Array:
  """Gated sum of each token's experts [U, D], for the Xl experts first_expert.. held here
  (assignments to other experts contribute nothing): assignments sorted by expert, one grouped
  matmul per projection."""
  u, k = ids_UxXk.shape
  num_local = w_gate_XlxDxI.shape[0]
  local_Y = ids_UxXk.reshape(-1) - first_expert
  held_Y = (local_Y >= 0) & (local_Y < num_local)
  key_Y = jnp.where(held_Y, local_Y, num_local)  # other experts' assignments sort last
  order_Y = jnp.argsort(key_Y, stable=True)
  token_Y = order_Y // k
  sizes_Xl = jnp.zeros(num_local + 1, jnp.int32).at[key_Y].add(1)[:num_local]
  # The rows past the held experts' blocks (other devices' experts) belong to no group, and
  # ragged_dot leaves them unspecified, forward and backward (its input-side gradient too): a
  # GPU may leave NaN there, and 0 * NaN is NaN. So every grouped product's rows outside the
  # groups are zeroed where they come out (its cotangent there is then exactly 0) and where
  # they go in (what the transposed product leaves in them never reaches dx), and before the
  # gates multiply (the gates' gradient is the product's value).
  held_Yx1 = held_Y[order_Y, None]
  grouped = lambda lhs, rhs: jnp.where(held_Yx1, jax.lax.ragged_dot(lhs, rhs, sizes_Xl), 0)
  xs_YxD = jnp.where(held_Yx1, x_UxD[token_Y], 0)
  h_YxI = jnp.where(held_Yx1, _swiglu(grouped(xs_YxD, w_gate_XlxDxI),
                                      grouped(xs_YxD, w_up_XlxDxI)), 0)
  out_YxD = grouped(h_YxI, w_down_XlxIxD)
  out_YxD = out_YxD * gates_UxXk.reshape(-1)[order_Y, None].astype(out_YxD.dtype)
  return jnp.zeros_like(x_UxD).at[token_Y].add(out_YxD)


def experts_dense(x_UxD, ids_UxXk, gates_UxXk, w_gate_XxDxI, w_up_XxDxI, w_down_XxIxD
                  ) -> jax.Array:
  """The reference: every expert on every token, combined by gates that are zero off the
  top-k."""
  num_experts = w_gate_XxDxI.shape[0]
  combine_UxX = jnp.sum(jax.nn.one_hot(ids_UxXk, num_experts, dtype=jnp.float32)
                        * gates_UxXk[..., None], axis=1)
  h_UxXxI = _swiglu(jnp.einsum('ud,xdi->uxi', x_UxD, w_gate_XxDxI),
                    jnp.einsum('ud,xdi->uxi', x_UxD, w_up_XxDxI))
  out_UxXxD = jnp.einsum('uxi,xid->uxd', h_UxXxI, w_down_XxIxD)
  return jnp.einsum('uxd,ux->ud', out_UxXxD, combine_UxX.astype(out_UxXxD.dtype))


def expert_parallel(mesh, batch_axes: tuple[str, ...]):
  """`experts_ragged` over a mesh: rows split over `batch_axes` (the packed batch's), experts
  over the 'expert' axis; see the module docstring. Returns f(x_RxTxD, ids, gates, w_gate,
  w_up, w_down) -> [R, T, D]."""
  ep = mesh.shape[EXPERT_AXIS]
  rows = P(batch_axes)

  def local(x_RxTxD, ids_RxTxXk, gates_RxTxXk, w_gate, w_up, w_down):
    if ep > 1:  # the rows of every device of this expert group
      gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
      x_RxTxD, ids_RxTxXk, gates_RxTxXk = map(gather, (x_RxTxD, ids_RxTxXk, gates_RxTxXk))
    r, t, d = x_RxTxD.shape
    k = ids_RxTxXk.shape[-1]
    first = jax.lax.axis_index(EXPERT_AXIS) * w_gate.shape[0]
    y_UxD = experts_ragged(x_RxTxD.reshape(r * t, d), ids_RxTxXk.reshape(r * t, k),
                           gates_RxTxXk.reshape(r * t, k), w_gate, w_up, w_down, first)
    y_RxTxD = y_UxD.reshape(r, t, d)
    if ep > 1:  # every device's share summed, each device's own rows back
      y_RxTxD = jax.lax.psum_scatter(y_RxTxD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return y_RxTxD

  experts = P(EXPERT_AXIS)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, experts, experts, experts),
                       out_specs=rows)


class _Kernel(nn.Module):
  """One weight, as the Dense layers name theirs (`<name>/kernel`), in the compute dtype."""
  shape: tuple[int, ...]
  config: Any

  @nn.compact
  def __call__(self):
    c = self.config
    return self.param('kernel', nn.initializers.normal(0.02), self.shape,
                      c.param_dtype).astype(c.dtype)


class MoE(nn.Module):
  """The sparse MLP block. `__call__(x_RxTxD, token_mask_RxT, replay_ids_RxTxXk, replay_RxT)` ->
  (y_RxTxD, LayerRoutes). `token_mask_RxT` marks real tokens for the load-balancing statistics
  (None: all); replay as in the module docstring (None: none).

  Params: router/kernel [D, X], {gate,up}_proj/kernel [X, D, I], down_proj/kernel [X, I, D];
  with config.shared_expert_intermediate_size > 0 also shared_expert/{gate,up,down}_proj
  (a SwiGLU of width Is) and shared_expert_gate/kernel [D, 1]. `mesh` (with `batch_axes`): the
  routed experts run through `expert_parallel` on it (None: on one device, or wherever XLA
  places them)."""
  config: Any
  mesh: Any = None
  batch_axes: tuple[str, ...] = ()

  @nn.compact
  def __call__(self, x_RxTxD, token_mask_RxT=None, replay_ids_RxTxXk=None, replay_RxT=None):
    c = self.config
    r, t, d = x_RxTxD.shape
    x_count, k, width = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    w_router_DxX = _Kernel((d, x_count), c, name='router')()
    w_gate_XxDxI = _Kernel((x_count, d, width), c, name='gate_proj')()
    w_up_XxDxI = _Kernel((x_count, d, width), c, name='up_proj')()
    w_down_XxIxD = _Kernel((x_count, width, d), c, name='down_proj')()

    x_UxD = x_RxTxD.reshape(r * t, d)
    replay_UxXk = None if replay_ids_RxTxXk is None else replay_ids_RxTxXk.reshape(r * t, k)
    replay_U = None if replay_RxT is None else replay_RxT.reshape(r * t)
    ids_UxXk, gates_UxXk, own_UxXk, probs_UxX = route(
        jnp.dot(x_UxD, w_router_DxX), k, c.norm_topk_prob, replay_UxXk, replay_U)
    gates_UxXk = gates_UxXk.astype(c.dtype)  # as transformers: gates in the hidden dtype
    weights = (w_gate_XxDxI, w_up_XxDxI, w_down_XxIxD)
    if c.moe_dispatch == 'dense':
      y_RxTxD = experts_dense(x_UxD, ids_UxXk, gates_UxXk, *weights).reshape(r, t, d)
    elif self.mesh is not None:
      rows = lambda a: a.reshape(r, t, k)
      y_RxTxD = expert_parallel(self.mesh, self.batch_axes)(
          x_RxTxD, rows(ids_UxXk), rows(gates_UxXk), *weights)
    else:
      y_RxTxD = experts_ragged(x_UxD, ids_UxXk, gates_UxXk, *weights).reshape(r, t, d)
    if c.shared_expert_intermediate_size:
      shared_RxTxD = MLP(c, c.shared_expert_intermediate_size, name='shared_expert')(x_RxTxD)
      gate_RxTx1 = dense(1, False, c, 'shared_expert_gate')(x_RxTxD)
      y_RxTxD = y_RxTxD + nn.sigmoid(gate_RxTx1) * shared_RxTxD

    real_U = (jnp.ones((r * t,), jnp.float32) if token_mask_RxT is None
              else token_mask_RxT.reshape(r * t).astype(jnp.float32))
    counts_X = jnp.zeros(x_count, jnp.float32).at[own_UxXk.reshape(-1)].add(
        jnp.repeat(real_U, k))
    dtype = route_dtype(x_count)
    routes = LayerRoutes(used=ids_UxXk.reshape(r, t, k).astype(dtype),
                         own=own_UxXk.reshape(r, t, k).astype(dtype),
                         counts=jax.lax.stop_gradient(counts_X), probs=real_U @ probs_UxX)
    return y_RxTxD, routes


# ---------------------------------------------------------------------------------------------
# The train step's MoE terms: load balancing and how the trainer's routes compare with the
# sampler's.


def differing(a_LsxRxTxXk: jax.Array, b_LsxRxTxXk: jax.Array) -> jax.Array:
  """[Ls, R, T] bool: the two top-k sets differ (the order within a set does not count)."""
  return jnp.any(jnp.sort(a_LsxRxTxXk.astype(jnp.int32), axis=-1)
                 != jnp.sort(b_LsxRxTxXk.astype(jnp.int32), axis=-1), axis=-1)


def routing_stats(routes: LayerRoutes, real_RxT: jax.Array, num_real_total,
                  sampler_RxTxLsxXk=None, sampled_RxT=None) -> tuple[jax.Array, dict]:
  """(load-balancing loss of this call, weighted for the batch; stats, sums over this call).

  The load-balancing loss is transformers' (Switch Transformer's): X * sum_e f_e P_e, f_e the
  share of own top-k assignments and P_e the mean router probability of expert e, pooled over
  the layers and the real tokens (`real_RxT`) of this call; weighted by this call's share of the
  batch's `num_real_total` real tokens, so the micro-batches' terms add up to a token-weighted
  mean. With the sampler's routes (`sampler_RxTxLsxXk`, on the tokens of `sampled_RxT`): how many
  (token, layer) routes there are, and in how many the trainer's own top-k differs from the
  sampler's."""
  num_layers, num_experts = routes.counts.shape
  real = jnp.sum(real_RxT.astype(jnp.float32))
  assignments = jnp.maximum(real * num_layers, 1.0)
  share_X = jnp.sum(routes.counts, axis=0) / assignments
  prob_X = jnp.sum(routes.probs, axis=0) / assignments
  aux = num_experts * jnp.sum(share_X * prob_X) * real / jnp.maximum(num_real_total, 1.0)
  stats = {'moe_aux_loss': jax.lax.stop_gradient(aux),
           'moe_expert_counts': jnp.sum(routes.counts, axis=0)}
  if sampler_RxTxLsxXk is not None:
    sampler = jnp.moveaxis(sampler_RxTxLsxXk, 2, 0)
    on_LsxRxT = jnp.broadcast_to(sampled_RxT, routes.own.shape[:-1])
    count = lambda x: jnp.sum(jnp.where(on_LsxRxT, x, False)).astype(jnp.float32)
    stats.update(moe_route_units=count(jnp.ones_like(on_LsxRxT)),
                 moe_routes_differ=count(differing(routes.own, sampler)))
  return aux, stats


def routing_metrics(stats: dict) -> dict[str, jax.Array]:
  """The summed `routing_stats` of a step as metrics: moe/aux_loss; moe/expert_load_max (the
  busiest expert's share of assignments over the mean share: 1 = balanced); with the sampler's
  routes, moe/routes_differ (share of (model token, layer) routes where the trainer's own top-k
  is not the sampler's)."""
  counts_X = stats['moe_expert_counts']
  metrics = {'moe/aux_loss': stats['moe_aux_loss'],
             'moe/expert_load_max': jnp.max(counts_X) / jnp.maximum(jnp.mean(counts_X), 1e-9)}
  if 'moe_route_units' in stats:
    units = jnp.maximum(stats['moe_route_units'], 1.0)
    metrics['moe/routes_differ'] = stats['moe_routes_differ'] / units
  return metrics
