"""The pure-JAX way JAX MoE code permutes tokens today: argsort, gather, inverse argsort.

This is the pure-JAX peer of the benchmarks and the reference model for the layer tests: the same
model as ``jax_moe.moe_layer``/``moe_stack`` (same params, routing, experts, residual) but with
argsort-based permute/unpermute and no scratch, so XLA allocates fresh buffers for every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe.config import MoEConfig
from jax_moe.experts import ExpertFn, shared_experts, swiglu_experts
from jax_moe.ops import rms_norm
from jax_moe.params import check_layer_params
from jax_moe.routing import route


def argsort_permute(x: jax.Array, topk_ids: jax.Array, num_experts: int):
    """Groups routes by expert with a stable argsort of the flat ids and a row gather.

    Args:
      x: [T, H] rows, any dtype.
      topk_ids: [T, k] expert ids, assumed in [0, num_experts).
      num_experts: E, the number of groups.

    Returns:
      ``(permuted [T*k, H] x.dtype, group_sizes [E] int32, order [T*k] int32)``: ``order[r]`` is the
      flat route ``t*k + j`` of permuted row r (routes of each expert in ascending flat order).
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    permuted = x[order // top_k]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return permuted, group_sizes, order


def repeat_permute(x: jax.Array, topk_ids: jax.Array, num_experts: int):
    """The MaxText variant of ``argsort_permute``: ``jnp.repeat(x, k, axis=0)[order]``.

    Same arguments and outputs as ``argsort_permute``.
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    permuted = jnp.repeat(x, top_k, axis=0)[order]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return permuted, group_sizes, order


def argsort_unpermute(y: jax.Array, topk_weights: jax.Array, order: jax.Array) -> jax.Array:
    """Inverse of ``argsort_permute`` followed by the router-weighted sum over k.

    Args:
      y: [T*k, H] expert outputs in permuted row order.
      topk_weights: [T, k] router weights (any float dtype).
      order: [T*k] int32 from ``argsort_permute``.

    Returns:
      [T, H] of y's dtype: ``sum_j w[t, j] * y[inv[t*k + j]]`` computed in float32.
    """
    num_tokens, top_k = topk_weights.shape
    inverse = jnp.argsort(order).astype(jnp.int32)
    rows = y[inverse].reshape(num_tokens, top_k, y.shape[1]).astype(jnp.float32)
    out = jnp.sum(rows * topk_weights.astype(jnp.float32)[:, :, None], axis=1)
    return out.astype(y.dtype)


def _local_routes(ids: jax.Array, weights: jax.Array, config: MoEConfig):
    """Global ids -> local ids in [0, El], El being the bucket of dropped routes (zero weight)."""
    if config.expert_map is None:
        return ids, weights, config.num_experts
    local = jnp.asarray(config.expert_map_array())[ids]
    dropped = local < 0
    num_local = config.num_local_experts
    return jnp.where(dropped, num_local, local), jnp.where(dropped, 0.0, weights), num_local + 1


def baseline_moe_layer(layer_params: dict, x: jax.Array, config: MoEConfig,
                       expert_fn: ExpertFn | None = None) -> jax.Array:
    """``jax_moe.moe_layer`` without a scratch: argsort permute, experts, argsort unpermute.

    Args:
      layer_params: one layer's params: ``router`` [H, E], ``gate_up`` [El, H, 2F], ``down`` [El, F, H],
        and the optional ``router_bias`` and shared expert leaves, as ``moe_layer`` takes them.
      x: [T, H] rows (``config.dtype`` for a like-for-like comparison).
      config: the ``MoEConfig`` (its routing and expert_map are honoured; align is not needed: it
        only pads).
      expert_fn: as in ``moe_layer``; None means ``swiglu_experts``.

    Returns:
      [T, H] of x's dtype. Routes to experts outside ``config.expert_map`` contribute 0.
    """
    check_layer_params("baseline_moe_layer", layer_params, config, stacked=False)
    expert_fn = swiglu_experts if expert_fn is None else expert_fn
    weights, ids = route(layer_params["router"], x, config, layer_params.get("router_bias"))
    ids, weights, num_groups = _local_routes(ids, weights, config)
    permuted, group_sizes, order = argsort_permute(x, ids, num_groups)
    # With an expert map the dropped bucket is last; ragged_dot leaves its rows zero.
    rows_out = expert_fn(layer_params, permuted, group_sizes[:config.num_local_experts])
    y = argsort_unpermute(rows_out, weights, order)
    shared = shared_experts(layer_params, x)
    return y if shared is None else y + shared


def baseline_moe_stack(params: dict, x: jax.Array, config: MoEConfig, *, unroll: int | bool = 1,
                       expert_fn: ExpertFn | None = None) -> jax.Array:
    """``jax_moe.moe_stack`` without a scratch: a scan of ``x = x + baseline_moe_layer(rms_norm(x))``.

    Args:
      params: ``init_moe_params`` output stacked on a leading layer axis L.
      x: [T, H] rows.
      config: the ``MoEConfig``.
      unroll: passed to ``lax.scan``.
      expert_fn: as in ``moe_layer``.

    Returns:
      [T, H] of x's dtype.
    """
    check_layer_params("baseline_moe_stack", params, config, stacked=True)

    def body(h, layer_params):
        return h + baseline_moe_layer(layer_params, rms_norm(h), config, expert_fn), None

    x, _ = lax.scan(body, x, params, unroll=unroll)
    return x
