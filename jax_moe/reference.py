"""Pure-jnp permute/unpermute: the test oracle, and the fallback when no native module loads.

Same signatures and contract as ``jax_moe.permute``/``jax_moe.unpermute`` (the contract in ``jax_moe.ops``), except
that rows of ``permuted`` past the live count come back zero (the contract leaves them unspecified),
and that XLA may round the unpermute sum differently by an ulp (only the NumPy loop in the tests is
a bit-exact oracle for unpermute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import _validate
from jax_moe.scratch import MoEScratch


def permute(x: jax.Array, topk_ids: jax.Array, scratch: MoEScratch) -> MoEScratch:
    """Groups routes by local expert with a stable argsort (``jax_moe.permute``'s contract).

    Args:
      x: [T, H] rows of ``scratch.config.dtype``; topk_ids: [T, k] any integer dtype;
      scratch: the ``MoEScratch`` whose buffers are replaced (functionally, not in place).

    Returns:
      The new ``MoEScratch``: ``permuted`` [R_cap, H] (rows past the live count zero),
      ``src_index`` [R_cap], ``dest_index`` [T_max, k] (rows >= T kept), ``group_sizes`` [El],
      ``expert_offsets`` [El + 1], all int32 but ``permuted``.
    """
    ids = _validate.check_permute_args(x, topk_ids, scratch)
    return permute_unchecked(x, ids, scratch)


def local_expert_ids(ids: jax.Array, config) -> jax.Array:
    """Flat [R] local expert of each route, -1 when the route is dropped. ``ids`` is int32."""
    flat = ids.reshape(-1)
    expert_map = jnp.asarray(config.expert_map_array())
    in_range = (flat >= 0) & (flat < config.num_experts)
    return jnp.where(in_range, expert_map[jnp.clip(flat, 0, config.num_experts - 1)], -1)


def permute_unchecked(x: jax.Array, ids: jax.Array, scratch: MoEScratch) -> MoEScratch:
    """``permute`` without validation; ``ids`` [T, k] is already int32 (the ops' fallback path)."""
    config = scratch.config
    num_tokens, top_k = ids.shape
    num_local, align, capacity = config.num_local_experts, config.align, config.capacity

    local = local_expert_ids(ids, config)
    sort_key = jnp.where(local >= 0, local, num_local)  # dropped routes sort last
    order = jnp.argsort(sort_key, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_local, jnp.int32).at[sort_key].add(1, mode="drop")
    group_sizes = (counts + align - 1) // align * align
    expert_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])
    first_sorted = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])

    sorted_key = sort_key[order]
    expert = jnp.clip(sorted_key, 0, num_local - 1)
    rank = jnp.arange(order.shape[0], dtype=jnp.int32) - first_sorted[expert]
    row = jnp.where(sorted_key < num_local, expert_offsets[expert] + rank, -1)
    dest = jnp.zeros_like(row).at[order].set(row).reshape(num_tokens, top_k)

    target = jnp.where(row >= 0, row, capacity)  # out of bounds: dropped by mode="drop"
    permuted = jnp.zeros((capacity, config.hidden_size), x.dtype).at[target].set(x[order // top_k], mode="drop")
    src_index = jnp.full((capacity,), -1, jnp.int32).at[target].set(order, mode="drop")
    dest_index = lax.dynamic_update_slice(scratch.dest_index, dest, (0, 0))
    return scratch.replace(permuted=permuted, src_index=src_index, dest_index=dest_index,
                           group_sizes=group_sizes, expert_offsets=expert_offsets)


def unpermute(y: jax.Array, topk_weights: jax.Array, scratch: MoEScratch) -> jax.Array:
    """Weighted sum of each token's expert rows in ascending j (``jax_moe.unpermute``'s contract).

    Args:
      y: [R_cap, H] f16/bf16/f32 rows in permuted order; topk_weights: [T, k] f32/bf16;
      scratch: the scratch of the matching ``permute`` (``dest_index`` is read).

    Returns:
      [T, H] of y's dtype, accumulated in float32 (may differ from the native op by an ulp).
    """
    _validate.check_unpermute_args(y, topk_weights, scratch)
    return unpermute_unchecked(y, topk_weights, scratch.dest_index)


def unpermute_unchecked(y: jax.Array, topk_weights: jax.Array, dest_index: jax.Array) -> jax.Array:
    """``unpermute`` without validation, from ``dest_index`` [>= T, k] int32 directly."""
    num_tokens, top_k = topk_weights.shape
    dest = dest_index[:num_tokens]
    acc = jnp.zeros((num_tokens, y.shape[1]), jnp.float32)
    for j in range(top_k):
        kept = dest[:, j:j + 1] >= 0
        rows = y[jnp.maximum(dest[:, j], 0)].astype(jnp.float32)
        acc = jnp.where(kept, acc + topk_weights[:, j:j + 1].astype(jnp.float32) * rows, acc)
    return acc.astype(y.dtype)


def unpermute_grad_unchecked(d_out: jax.Array, y: jax.Array, topk_weights: jax.Array, dest_index: jax.Array,
                             src_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``unpermute``'s backward without validation (the native ``jax_moe_unpermute_grad``'s contract).

    Args:
      d_out: [T, H] cotangent of unpermute's output, y's dtype.
      y: [R, H] the rows unpermute read.
      topk_weights: [T, k] float32 or bfloat16.
      dest_index: [T, k] int32 permuted row of each route, -1 when dropped.
      src_index: [R] int32 flat route ``t*k + j`` of each row, -1 for rows of no route.

    Returns:
      ``(d_y [R, H] y.dtype, d_weights [T, k] float32)``: ``d_y[r] = w[s] * d_out[s // k]`` for the
      route s of row r (zero for rows of no route), each product rounded once from float32;
      ``d_weights[t, j] = <y[dest[t, j]], d_out[t]>`` in float32, zero for dropped routes.
    """
    num_tokens, top_k = topk_weights.shape
    num_routes = num_tokens * top_k
    routed = (src_index >= 0) & (src_index < num_routes)
    route = jnp.where(routed, src_index, 0)
    w = topk_weights.reshape(-1)[route].astype(jnp.float32)
    g = d_out[route // top_k].astype(jnp.float32)
    d_y = jnp.where(routed[:, None], w[:, None] * g, 0.0).astype(y.dtype)
    kept = (dest_index >= 0) & (dest_index < y.shape[0])
    rows = y[jnp.where(kept, dest_index, 0)].astype(jnp.float32)  # [T, k, H]
    d_w = jnp.einsum("tkh,th->tk", rows, d_out.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return d_y, jnp.where(kept, d_w, 0.0)
