"""Grouped GEMM over the scratch's expert groups: a CUTLASS Hopper custom call on GPU.

``grouped_matmul(rows, weights, scratch)`` multiplies each expert's rows (the groups ``permute``
wrote: ``expert_offsets``) by that expert's weights, reading the groups on the device: no host
sync, work bounded by the live rows, its per-expert arguments in the scratch's workspace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _native
from jax_moe._validate import check_grouped_matmul_args
from jax_moe.ops import fence_results
from jax_moe.scratch import GROUPED_MATMUL_ALIGN, GROUPED_MATMUL_DTYPES, MoEScratch

# Tile configurations of cuda/grouped_gemm.h (GemmTile): 64-row tiles for few rows per expert
# (decode), 128 x 256 cooperative tiles once experts average this many rows (prefill).
SMALL_M_TILE, LARGE_M_TILE = 0, 1
LARGE_M_MIN_ROWS_PER_EXPERT = 128

def supports_grouped_matmul(config, hidden_size: int, ffn_size: int) -> bool:
    """Whether the CUDA grouped GEMM can run a SwiGLU layer of these sizes for ``config``."""
    return (_native.HAS_CUDA and config.dtype in GROUPED_MATMUL_DTYPES
            and hidden_size % GROUPED_MATMUL_ALIGN == 0 and ffn_size % GROUPED_MATMUL_ALIGN == 0)


def pick_tile(num_rows: int, num_groups: int) -> int:
    """The tile configuration for at most num_rows live rows over num_groups experts."""
    rows_per_expert = num_rows / max(1, min(num_groups, num_rows))
    return LARGE_M_TILE if rows_per_expert >= LARGE_M_MIN_ROWS_PER_EXPERT else SMALL_M_TILE


def _grouped_matmul_cuda(rows, weights, offsets, workspace, num_rows, tile):
    call = jax.ffi.ffi_call(
        _native.GROUPED_MATMUL_TARGET,
        (jax.ShapeDtypeStruct((num_rows, weights.shape[2]), rows.dtype),
         jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={3: 1},
        vmap_method="sequential")
    return fence_results(call(rows, weights, offsets, workspace, tile=np.int64(tile)))


def _group_sizes(offsets):
    return (offsets[1:] - offsets[:-1]).astype(jnp.int32)


def _ragged_dot(rows, weights, offsets, num_rows):
    """The same product with ``jax.lax.ragged_dot``: f32 accumulation, rows of no group zero."""
    out = lax.ragged_dot(rows[:num_rows], weights, _group_sizes(offsets), preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


def _grouped_matmul_any(rows, weights, offsets, workspace, num_rows, tile):
    if not _native.HAS_CUDA:
        return _ragged_dot(rows, weights, offsets, num_rows), workspace
    return lax.platform_dependent(
        rows, weights, offsets, workspace,
        cuda=lambda r, w, o, ws: _grouped_matmul_cuda(r, w, o, ws, num_rows, tile),
        default=lambda r, w, o, ws: (_ragged_dot(r, w, o, num_rows), ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_matmul(rows, weights, offsets, workspace, num_rows, tile):
    return _grouped_matmul_any(rows, weights, offsets, workspace, num_rows, tile)


def _grouped_matmul_fwd(rows, weights, offsets, workspace, num_rows, tile):
    out = _grouped_matmul_any(rows, weights, offsets, workspace, num_rows, tile)
    return out, (rows, weights, offsets)


def _grouped_matmul_bwd(num_rows, tile, residuals, cotangents):
    # Backward GEMMs on jax.lax.ragged_dot (d rows = d out @ w[g]^T, d w[g] = rows_g^T @ d out_g).
    rows, weights, offsets = residuals
    d_out = cotangents[0]
    live = jnp.arange(num_rows)[:, None] < offsets[-1]
    d_out = jnp.where(live, d_out, jnp.zeros((), d_out.dtype)).astype(jnp.float32)
    product = lambda r, w: lax.ragged_dot(r, w, _group_sizes(offsets), preferred_element_type=jnp.float32)
    _, vjp = jax.vjp(product, rows[:num_rows].astype(jnp.float32), weights.astype(jnp.float32))
    d_rows, d_weights = vjp(d_out)
    d_rows = jnp.pad(d_rows, ((0, rows.shape[0] - num_rows), (0, 0)))
    return d_rows.astype(rows.dtype), d_weights.astype(weights.dtype), None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(rows: jax.Array, weights: jax.Array, scratch: MoEScratch, *,
                   num_rows: int | None = None) -> tuple[jax.Array, MoEScratch]:
    """Each expert's rows times its weights, groups from the scratch's last ``permute``.

    Args:
      rows: [R, K] bf16 grouped like the scratch's ``permuted`` (its rows themselves, or an
        activation of them), R <= R_cap. K a multiple of 8.
      weights: [El, K, N] bf16, one [K, N] matrix per local expert. N a multiple of 8.
      scratch: the ``MoEScratch`` ``permute`` filled: ``expert_offsets`` gives the groups; its
        ``workspace`` holds the GEMM's per-expert arguments (written in place when donated).
      num_rows: output rows (default R): the live rows' static bound, so work and memory follow
        the batch rather than R_cap. Rows of groups past it are not computed.

    Returns:
      ``(out, scratch)``: out [num_rows, N] bf16 with ``out[i] = rows[i] @ weights[g]`` (f32
      accumulation) for row i of expert g, zero for rows in no group, as
      ``jax.lax.ragged_dot(rows, weights, group_sizes)``; and the scratch to pass on.

    On a GPU this is the CUDA custom call (CUTLASS sm90 ptr-array grouped GEMM, TMA and
    warp-specialised); elsewhere, or without the CUDA module, ``jax.lax.ragged_dot``. Its gradient
    uses ``jax.lax.ragged_dot`` for the two backward GEMMs.
    """
    num_rows = check_grouped_matmul_args(rows, weights, scratch, num_rows)
    tile = pick_tile(num_rows, scratch.config.num_local_experts)
    out, workspace = _grouped_matmul(rows, weights, scratch.expert_offsets, scratch.workspace, num_rows, tile)
    return out, scratch.replace(workspace=lax.stop_gradient(workspace))
