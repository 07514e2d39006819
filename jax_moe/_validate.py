"""Trace-time argument checks shared by the native ops and the reference.

Every failure is a ValueError naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.config import ROW_DTYPES
from jax_moe.scratch import GROUPED_MATMUL_ALIGN, GROUPED_MATMUL_DTYPES, MoEScratch, buffer_shapes

WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _fail(op: str, arg: str, expected: str, actual) -> ValueError:
    return ValueError(f"{op}: {arg}: expected {expected}, got {actual}")


def check_scratch(op: str, scratch) -> None:
    """The scratch must be a MoEScratch whose buffers match the config it carries."""
    if not isinstance(scratch, MoEScratch):
        raise _fail(op, "scratch", "a MoEScratch (from jax_moe.init_scratch)", type(scratch).__name__)
    for name, want in buffer_shapes(scratch.config).items():
        have = getattr(scratch, name)
        if tuple(have.shape) != want.shape or jnp.dtype(have.dtype) != want.dtype:
            raise _fail(op, f"scratch.{name}",
                        f"{want.dtype}{list(want.shape)} for its config {scratch.config}",
                        f"{jnp.dtype(have.dtype)}{list(have.shape)} (scratch built for another config?)")


def check_permute_args(x, topk_ids, scratch) -> jax.Array:
    """Validates permute's arguments and returns the ids as int32 with out-of-range ids as -1."""
    check_scratch("permute", scratch)
    config = scratch.config
    x_shape, ids_shape = np.shape(x), np.shape(topk_ids)
    if len(x_shape) != 2:
        raise _fail("permute", "x", "a rank-2 array [T, H]", f"shape {x_shape}")
    if x_shape[1] != config.hidden_size:
        raise _fail("permute", "x", f"hidden size x.shape[1] == {config.hidden_size} (config.hidden_size)",
                    x_shape[1])
    if jnp.dtype(x.dtype) != config.dtype:
        raise _fail("permute", "x", f"dtype {config.dtype} (config.dtype)", jnp.dtype(x.dtype))
    if x_shape[0] > config.max_tokens:
        raise _fail("permute", "x", f"at most {config.max_tokens} tokens (config.max_tokens)", x_shape[0])
    if x_shape[0] < 1:
        raise _fail("permute", "x", "at least 1 token", x_shape[0])
    if len(ids_shape) != 2 or ids_shape != (x_shape[0], config.top_k):
        raise _fail("permute", "topk_ids", f"shape ({x_shape[0]}, {config.top_k}) [T, top_k]", ids_shape)
    ids_dtype = jnp.dtype(topk_ids.dtype)
    if not jnp.issubdtype(ids_dtype, jnp.integer) or ids_dtype == jnp.bool_:
        raise _fail("permute", "topk_ids", "an integer dtype", ids_dtype)
    return normalize_ids(jnp.asarray(topk_ids), config.num_experts)


def normalize_ids(topk_ids: jax.Array, num_experts: int) -> jax.Array:
    """int32 ids. Narrow ids convert exactly; for wider ones any id outside [0, E) becomes -1
    *before* the cast, so they cannot wrap into range."""
    if jnp.dtype(topk_ids.dtype).itemsize < 4 or topk_ids.dtype == jnp.int32:
        return topk_ids.astype(jnp.int32)  # E itself may not fit a narrow dtype: compare in int32
    in_range = (topk_ids >= 0) & (topk_ids < num_experts)
    return jnp.where(in_range, topk_ids, -1).astype(jnp.int32)


def check_unpermute_args(y, topk_weights, scratch) -> None:
    check_scratch("unpermute", scratch)
    config = scratch.config
    y_shape, w_shape = np.shape(y), np.shape(topk_weights)
    y_dtype = jnp.dtype(y.dtype)
    if y_dtype not in ROW_DTYPES:
        raise _fail("unpermute", "y", "dtype float16, bfloat16 or float32 (expert outputs)", y_dtype)
    if len(w_shape) != 2 or w_shape[1] != config.top_k or not 1 <= w_shape[0] <= config.max_tokens:
        raise _fail("unpermute", "topk_weights",
                    f"shape (T, {config.top_k}) with 1 <= T <= {config.max_tokens} (config.max_tokens)", w_shape)
    bound = config.live_row_bound(w_shape[0])
    if len(y_shape) != 2 or y_shape[1] != config.hidden_size or not bound <= y_shape[0] <= config.capacity:
        raise _fail("unpermute", "y",
                    f"shape (R, {config.hidden_size}) with {bound} <= R <= {config.capacity} "
                    f"(config.live_row_bound(T) <= R <= config.capacity)", y_shape)
    w_dtype = jnp.dtype(topk_weights.dtype)
    if w_dtype not in WEIGHT_DTYPES:
        raise _fail("unpermute", "topk_weights", "dtype float32 or bfloat16", w_dtype)


def check_grouped_matmul_args(rows, weights, scratch, num_rows) -> int:
    """Validates grouped_matmul's arguments; returns the output row count."""
    op = "grouped_matmul"
    check_scratch(op, scratch)
    config = scratch.config
    r_shape, w_shape = np.shape(rows), np.shape(weights)
    dtypes = [str(d) for d in GROUPED_MATMUL_DTYPES]
    if jnp.dtype(rows.dtype) not in GROUPED_MATMUL_DTYPES:
        raise _fail(op, "rows", f"dtype in {dtypes}", jnp.dtype(rows.dtype))
    if config.dtype not in GROUPED_MATMUL_DTYPES:
        raise _fail(op, "scratch", f"a scratch of dtype in {dtypes} (only those reserve the GEMM's workspace)",
                    config.dtype)
    if len(r_shape) != 2 or r_shape[0] > config.capacity:
        raise _fail(op, "rows", f"a rank-2 array [R, K] with R <= {config.capacity} (the scratch's R_cap)", r_shape)
    if len(w_shape) != 3 or w_shape[0] != config.num_local_experts or w_shape[1] != r_shape[1]:
        raise _fail(op, "weights", f"shape ({config.num_local_experts}, {r_shape[1]}, N) [El, K, N]", w_shape)
    if jnp.dtype(weights.dtype) != jnp.dtype(rows.dtype):
        raise _fail(op, "weights", f"rows' dtype {jnp.dtype(rows.dtype)}", jnp.dtype(weights.dtype))
    for name, size in (("K (rows.shape[1])", r_shape[1]), ("N (weights.shape[2])", w_shape[2])):
        if size % GROUPED_MATMUL_ALIGN or size == 0:
            raise _fail(op, name, f"a positive multiple of {GROUPED_MATMUL_ALIGN}", size)
    num_rows = r_shape[0] if num_rows is None else num_rows
    if not isinstance(num_rows, (int, np.integer)) or not 1 <= num_rows <= r_shape[0]:
        raise _fail(op, "num_rows", f"an int in [1, {r_shape[0]}] (rows.shape[0])", num_rows)
    return int(num_rows)
