"""``grouped_dot``: ``jax.lax.ragged_dot``'s product, on CPU a C++ kernel that multiplies each row by
its own group's weights only (XLA:CPU's ragged_dot multiplies every row by every group's weights
and masks). The reference and the off-GPU path of every other GEMM here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import _native


_GROUPED_DOT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def grouped_dot(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, *,
                preferred_element_type=None, transpose_weights: bool = False) -> jax.Array:
    """``jax.lax.ragged_dot(rows, weights, group_sizes, preferred_element_type=...)``, without
    XLA:CPU's waste on CPU.

    rows [M, K], weights [G, K, N], group_sizes [G] (integer): rows [o_g, o_g + group_sizes[g]) of
    group g (o_g the sum of the sizes before it) times weights[g]; rows past the last group are
    zero. Returns [M, N] of ``preferred_element_type`` (default: rows' and weights' result type).
    ``transpose_weights``: weights are [G, N, K] and multiply as weights[g]^T (read in place on CPU;
    an input gradient's or a checkpoint's [out, in] layout, with no transposed copy).

    On CPU with the native module (float32/bf16/f16 operands) a C++ kernel multiplies each row by
    its own group's weights only; XLA:CPU's ``ragged_dot`` multiplies every row by every group's
    weights and masks (jax 0.10), G times the arithmetic. Each output element is one float32 sum in
    ascending K, each product and sum rounded to float32 (the same bits on any CPU and thread count);
    XLA's sum order differs, so results agree with ``ragged_dot`` to float32 rounding. Elsewhere
    (GPU) it is ``ragged_dot``. Differentiable in reverse mode, its backward on the same kernels
    (``d rows = d out @ weights[g]^T``, ``d weights[g] = rows_g^T @ d out_g``); not in forward mode.
    Under ``jax.vmap`` as ``ragged_dot`` (not batched in jax 0.10), whose branch is traced too.
    """
    if rows.ndim != 2 or weights.ndim != 3 or rows.shape[1] != weights.shape[2 if transpose_weights else 1]:
        layout = "[G, N, K] (transpose_weights)" if transpose_weights else "[G, K, N]"
        raise ValueError(f"grouped_dot: rows, weights: expected rows [M, K] and weights {layout}, got "
                         f"{rows.shape} and {weights.shape}")
    if group_sizes.shape != (weights.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_dot: group_sizes: expected an integer array of shape {(weights.shape[0],)}, got "
                         f"{group_sizes.dtype} {group_sizes.shape}")
    out_dtype = jnp.dtype(jnp.result_type(rows.dtype, weights.dtype) if preferred_element_type is None
                          else preferred_element_type)
    sizes = group_sizes.astype(jnp.int32)
    if not (_native.HAS_CPU and all(jnp.dtype(a.dtype) in _GROUPED_DOT_DTYPES for a in (rows, weights))
            and out_dtype in _GROUPED_DOT_DTYPES):
        return _xla_grouped_dot(rows, weights, sizes, out_dtype, transpose_weights)
    return _grouped_dot(rows, weights, sizes, out_dtype, transpose_weights)


def _xla_grouped_dot(rows, weights, sizes, out_dtype, transpose_weights: bool):
    w = jnp.swapaxes(weights, 1, 2) if transpose_weights else weights
    return lax.ragged_dot(rows, w, sizes, preferred_element_type=out_dtype)


def _cpu_grouped_dot(rows, weights, sizes, out_dtype, transpose_weights: bool):
    """The CPU kernel: ``rows @ weights[g]`` per group, weights [G, K, N] (or [G, N, K] read transposed)."""
    n = weights.shape[1] if transpose_weights else weights.shape[2]
    call = jax.ffi.ffi_call(_native.GROUPED_DOT_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), out_dtype),
                            vmap_method="sequential")
    return call(rows, weights, sizes, transpose_weights=transpose_weights)


def _cpu_weight_grad(rows, d_out, sizes, num_groups: int, out_dtype):
    """The CPU kernel: ``[G, K, N]``, each group's ``rows_g^T @ d_out_g``, zero for an empty group."""
    call = jax.ffi.ffi_call(_native.GROUPED_DOT_WEIGHT_GRAD_TARGET,
                            jax.ShapeDtypeStruct((num_groups, rows.shape[1], d_out.shape[1]), out_dtype),
                            vmap_method="sequential")
    return call(rows, d_out, sizes)


def _grouped_dot_call(rows, weights, sizes, out_dtype, transpose_weights: bool):
    return lax.platform_dependent(
        rows, weights, sizes,
        cpu=lambda r, w, s: _cpu_grouped_dot(r, w, s, out_dtype, transpose_weights),
        default=lambda r, w, s: _xla_grouped_dot(r, w, s, out_dtype, transpose_weights))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_dot(rows, weights, sizes, out_dtype, transpose_weights: bool):
    return _grouped_dot_call(rows, weights, sizes, out_dtype, transpose_weights)


def _grouped_dot_fwd(rows, weights, sizes, out_dtype, transpose_weights):
    return _grouped_dot_call(rows, weights, sizes, out_dtype, transpose_weights), (rows, weights, sizes)


def _grouped_dot_bwd(out_dtype, transpose_weights, residuals, d_out):
    def cpu(r, w, s, d):
        d_rows = _cpu_grouped_dot(d, w, s, r.dtype, not transpose_weights)
        # weights[g] [K, N]: rows_g^T @ d_out_g; read transposed ([N, K]): d_out_g^T @ rows_g.
        d_weights = (_cpu_weight_grad(d, r, s, w.shape[0], w.dtype) if transpose_weights
                     else _cpu_weight_grad(r, d, s, w.shape[0], w.dtype))
        return d_rows, d_weights

    def xla(r, w, s, d):  # JAX's transpose of ragged_dot, as without this rule
        _, vjp = jax.vjp(lambda r, w: _xla_grouped_dot(r, w, s, out_dtype, transpose_weights), r, w)
        return vjp(d)

    return (*lax.platform_dependent(*residuals, d_out, cpu=cpu, default=xla), None)


_grouped_dot.defvjp(_grouped_dot_fwd, _grouped_dot_bwd)


def _grouped_weight_grad(rows, d_out, sizes, num_groups: int, out_dtype):
    """``[G, K, N]`` of out_dtype: each group's ``rows_g^T @ d_out_g`` (float32 sums), zero for an
    empty group: the CPU kernel, or JAX's transpose of ``ragged_dot`` (on other devices, or dtypes
    the kernel does not take)."""
    def xla(r, d, s):
        zeros = jnp.zeros((num_groups, r.shape[1], d.shape[1]), r.dtype)
        _, vjp = jax.vjp(lambda w: lax.ragged_dot(r, w, s, preferred_element_type=jnp.float32), zeros)
        return vjp(d.astype(jnp.float32))[0].astype(out_dtype)

    if not (_native.HAS_CPU and all(jnp.dtype(a.dtype) in _GROUPED_DOT_DTYPES for a in (rows, d_out))
            and jnp.dtype(out_dtype) in _GROUPED_DOT_DTYPES):
        return xla(rows, d_out, sizes)
    return lax.platform_dependent(rows, d_out, sizes, default=xla,
                                  cpu=lambda r, d, s: _cpu_weight_grad(r, d, s, num_groups, out_dtype))


def _group_sizes(offsets):
    return (offsets[1:] - offsets[:-1]).astype(jnp.int32)


def _ragged_dot(rows, weights, offsets, transpose_weights: bool = False):
    return grouped_dot(rows, weights, _group_sizes(offsets), preferred_element_type=jnp.float32,
                       transpose_weights=transpose_weights)
