"""The bf16 grouped GEMMs over the scratch's expert groups: CUTLASS Hopper custom calls on GPU.

``grouped_matmul(rows, weights, scratch)`` multiplies each expert's rows (the groups ``permute``
wrote: ``expert_offsets``) by that expert's weights, reading the groups on the device: no host
sync, work bounded by the live rows, its per-expert arguments in the scratch's workspace. Its
backward runs the two other grouped GEMMs of an expert layer, also native on GPU: ``input_grad``
(``d rows = d out @ w[g]^T``) and ``weight_grad`` (``d w[g] = rows_g^T @ d out_g``, a reduction
over each expert's own rows). Off CUDA all three are ``grouped_dot``. The ``"decode"`` tile is
the decode kernel (``jax_moe.gemm.decode``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _ffi, _native, plan
from jax_moe._ffi import fence_results, write_into
from jax_moe._validate import check_grouped_matmul_args
from jax_moe.scratch import MoEScratch
from jax_moe.gemm.decode import _decode_call
from jax_moe.gemm.grouped_dot import _group_sizes, _grouped_weight_grad, _ragged_dot
from jax_moe.gemm.swiglu import gated_silu


# The tiles of the bf16 grouped GEMM by name (``jax_moe.plan.TILES``; ``plan.pick_tile`` chooses),
# and their native ids (cuda/constants.h). "decode" is the decode kernel.
SMALL_M_TILE, MEDIUM_M_TILE, LARGE_M_TILE, DECODE_TILE = "small", "medium", "large", "decode"
TILES = (SMALL_M_TILE, MEDIUM_M_TILE, LARGE_M_TILE, DECODE_TILE)
_TILE_IDS = {SMALL_M_TILE: _native.constants.GEMM_TILE_SMALL_M, LARGE_M_TILE: _native.constants.GEMM_TILE_LARGE_M,
             DECODE_TILE: _native.constants.GEMM_TILE_DECODE, MEDIUM_M_TILE: _native.constants.GEMM_TILE_MEDIUM_M}
# The products of the grouped GEMM (cuda/constants.h).
FORWARD = _native.constants.GEMM_OP_FORWARD
INPUT_GRAD = _native.constants.GEMM_OP_INPUT_GRAD
WEIGHT_GRAD = _native.constants.GEMM_OP_WEIGHT_GRAD


def backward_workspace(num_groups: int) -> jax.Array:
    """A workspace for the backward's grouped GEMMs (their per-expert arguments).

    The scratch cannot reach a backward pass (it is state, never a residual: a scan would stack it
    per layer), so the backward threads this one through its four GEMMs instead. Inside a scanned
    training step XLA assigns it once, like any temporary of the loop body: a few kilobytes per
    hundred experts, constant in depth.
    """
    words = -(-_native.grouped_matmul_workspace_bytes(num_groups) // 4)
    return jnp.zeros((max(words, 1),), jnp.int32)


def _call(op, a, b, offsets, workspace, out_shape, tile, rows_per_pass=0):
    if tile == DECODE_TILE:  # the decode kernel computes forward products only
        if op == FORWARD:
            return _decode_call(a, b, offsets, out_shape, gated=False, rows_per_pass=rows_per_pass), workspace
        tile = SMALL_M_TILE
    call = jax.ffi.ffi_call(
        _native.GROUPED_MATMUL_TARGET,
        (jax.ShapeDtypeStruct(out_shape, a.dtype), jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={3: 1},
        vmap_method="sequential")
    out, workspace = call(a, b, offsets, workspace, tile=np.int64(_TILE_IDS[tile]), op=np.int64(op))
    if op != WEIGHT_GRAD:
        return fence_results((out, workspace))
    # A weight gradient's one user is the scan's stacking of per-layer gradients: left unfenced,
    # XLA:GPU may write it straight into its slice of the stacked gradient (no per-layer copy of a
    # weight-sized buffer). The other results keep the fence (_ffi.fence_results: results with
    # several users made that rewrite run a call twice).
    return out, fence_results(workspace)


def forward(rows, weights, offsets, workspace, num_rows: int, tile: str, rows_per_pass: int = 0):
    """``out [num_rows, N]`` = each group's rows [R, K] @ weights[g] [K, N]; zero rows in no group.

    tile: one of ``TILES``; rows_per_pass: the decode tile's (``plan.decode_rows_per_pass``).
    Returns ``(out, workspace)``. No autodiff rule (``grouped_matmul`` has one).
    """
    def fallback(r, w, o, ws):
        return _ragged_dot(r[:num_rows], w, o).astype(r.dtype), ws

    return _ffi.on_cuda(lambda r, w, o, ws: _call(FORWARD, r, w, o, ws, (num_rows, w.shape[2]), tile, rows_per_pass),
                    fallback, rows, weights, offsets, workspace)


def gated_forward(rows, gate_up, offsets, workspace, num_rows: int, tile: str, rows_per_pass: int = 0):
    """``activated [num_rows, F]`` = ``gated_silu`` of each group's rows @ gate_up[g] [K, 2F].

    The gate/up product is rounded to rows' dtype before the activation (float32), as when it is
    stored. With ``DECODE_TILE`` on a GPU the activation is the decode kernel's epilogue (the
    [num_rows, 2F] product is never written); otherwise ``forward`` then ``gated_silu``. Returns
    ``(activated, workspace)``. No autodiff rule.
    """
    if tile != DECODE_TILE or gate_up.shape[2] % 16:
        hidden, workspace = forward(rows, gate_up, offsets, workspace, num_rows, tile, rows_per_pass)
        return gated_silu(hidden, rows.dtype), workspace

    def fallback(r, w, o):
        return gated_silu(_ragged_dot(r[:num_rows], w, o).astype(r.dtype), r.dtype)

    out_shape = (num_rows, gate_up.shape[2] // 2)
    activated = _ffi.on_cuda(lambda r, w, o: _decode_call(r, w, o, out_shape, gated=True, rows_per_pass=rows_per_pass),
                         fallback, rows, gate_up, offsets)
    return activated, workspace


def input_grad(d_out, weights, offsets, workspace, num_rows: int, tile: int):
    """``d_rows [num_rows, K]`` = each group's d_out [R, N] @ weights[g]^T; zero rows in no group.

    Returns ``(d_rows, workspace)``, d_rows in d_out's dtype (float32 accumulation).
    """
    def fallback(g, w, o, ws):
        return _ragged_dot(g[:num_rows], w, o, transpose_weights=True).astype(g.dtype), ws

    return _ffi.on_cuda(lambda g, w, o, ws: _call(INPUT_GRAD, g, w, o, ws, (num_rows, w.shape[1]), tile),
                    fallback, d_out, weights, offsets, workspace)


def weight_grad(rows, d_out, offsets, workspace, num_groups: int):
    """``d_weights [El, K, N]`` = each group's rows_g^T [K, M_g] @ d_out_g [M_g, N]; zero for empty groups.

    rows [R, K] and d_out [R, N] share their row order (the groups of offsets). Returns
    ``(d_weights, workspace)``, d_weights in rows' dtype (float32 accumulation).
    """
    def fallback(r, g, o, ws):  # the weight gradient alone, not a vjp that also forms d rows
        return _grouped_weight_grad(r, g, _group_sizes(o), num_groups, r.dtype), ws

    return _ffi.on_cuda(lambda r, g, o, ws: _call(WEIGHT_GRAD, r, g, o, ws, (num_groups, r.shape[1], g.shape[1]),
                                              LARGE_M_TILE),
                    fallback, rows, d_out, offsets, workspace)


def _into_call(op, a, b, offsets, workspace, stack, layer, tile, out_rows, offset):
    call = jax.ffi.ffi_call(
        _native.GROUPED_MATMUL_INTO_TARGET,
        (jax.ShapeDtypeStruct(stack.shape, stack.dtype), jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={4: 0, 3: 1},
        vmap_method="sequential")
    return fence_results(call(a, b, offsets, workspace, stack, layer, tile=np.int64(_TILE_IDS[tile]), op=np.int64(op),
                              out_rows=np.int64(out_rows), offset=np.int64(offset)))


def weight_grad_into(rows, d_out, offsets, workspace, stack, layer):
    """``weight_grad`` written into slice ``layer`` of a stacked gradient ``stack`` [L, El, K, N].

    layer: an int32 scalar (a loop index: read on the device). Returns ``(stack, workspace)``.
    On a GPU with a bf16 stack the GEMM writes the slice itself, the stack aliased in and out, so a
    loop over layers that carries the stack keeps no per-layer gradient and copies nothing;
    otherwise the gradient is computed and written with ``dynamic_update_slice``.
    """
    layer = jnp.asarray(layer, jnp.int32)

    def fallback(r, g, o, ws, s, i):
        d_weights, ws = weight_grad(r, g, o, ws, s.shape[1])
        return write_into(s, i, d_weights, 0), ws

    def native(r, g, o, ws, s, i):
        return _into_call(WEIGHT_GRAD, r, g, o, ws, s, i, LARGE_M_TILE, r.shape[0], 0)

    if stack.dtype != rows.dtype:  # the kernel writes its result's dtype: no conversion in place
        return fallback(rows, d_out, offsets, workspace, stack, layer)
    return _ffi.on_cuda(native, fallback, rows, d_out, offsets, workspace, stack, layer)


def forward_into(rows, weights, offsets, workspace, num_rows: int, tile: int, stack, layer, offset: int):
    """``forward``'s out [num_rows, N] written flattened at element ``offset`` of slice ``layer`` of
    ``stack`` [L, ...] (``_ffi.read_from`` gives it back). Returns ``(stack, workspace)``.

    On a GPU with a bf16 stack the GEMM stores into the slice itself (stack aliased in and out; the
    decode tile runs as the 64-row one): a training loop keeps each layer's gate/up product where
    the backward reads it, with no copy. offset: a multiple of 8; the result must fit in a slice.
    """
    layer = jnp.asarray(layer, jnp.int32)
    _ffi.check_fits_in_slice("forward_into", stack, offset, (num_rows, weights.shape[2]))

    def fallback(r, w, o, ws, s, i):
        out, ws = forward(r, w, o, ws, num_rows, SMALL_M_TILE if tile == DECODE_TILE else tile)
        return write_into(s, i, out, offset), ws

    def native(r, w, o, ws, s, i):
        return _into_call(FORWARD, r, w, o, ws, s, i, SMALL_M_TILE if tile == DECODE_TILE else tile, num_rows,
                          offset)

    if stack.dtype != rows.dtype:
        return fallback(rows, weights, offsets, workspace, stack, layer)
    return _ffi.on_cuda(native, fallback, rows, weights, offsets, workspace, stack, layer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_matmul(rows, weights, offsets, workspace, num_rows, tile, rows_per_pass):
    return forward(rows, weights, offsets, workspace, num_rows, tile, rows_per_pass)


def _grouped_matmul_fwd(rows, weights, offsets, workspace, num_rows, tile, rows_per_pass):
    out = forward(rows, weights, offsets, workspace, num_rows, tile, rows_per_pass)
    # Copies of this call's live rows and groups (never the scratch's buffers themselves), and a
    # zero-width array that carries rows' row count for free.
    return out, (rows[:num_rows], weights, offsets, jnp.zeros((rows.shape[0], 0), rows.dtype))


def _grouped_matmul_bwd(num_rows, tile, rows_per_pass, residuals, cotangents):
    rows, weights, offsets, rows_like = residuals
    d_out = cotangents[0].astype(rows.dtype)
    workspace = backward_workspace(weights.shape[0])
    d_rows, workspace = input_grad(d_out, weights, offsets, workspace, num_rows, tile)
    d_weights, _ = weight_grad(rows, d_out, offsets, workspace, weights.shape[0])
    d_rows = jnp.pad(d_rows, ((0, rows_like.shape[0] - num_rows), (0, 0)))
    return d_rows, d_weights.astype(weights.dtype), None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(rows: jax.Array, weights: jax.Array, scratch: MoEScratch, *,
                   num_rows: int | None = None, tile: str | None = None) -> tuple[jax.Array, MoEScratch]:
    """Each expert's rows times its weights, groups from the scratch's last ``permute``.

    Args:
      rows: [R, K] bf16 grouped like the scratch's ``permuted`` (its rows themselves, or an
        activation of them), R <= R_cap. K a multiple of 8.
      weights: [El, K, N] bf16, one [K, N] matrix per local expert. N a multiple of 8.
      scratch: the ``MoEScratch`` ``permute`` filled: ``expert_offsets`` gives the groups; its
        ``workspace`` holds the GEMM's per-expert arguments (written in place when donated).
      num_rows: output rows (default R): the live rows' static bound, so work and memory follow
        the batch rather than R_cap. Rows of groups past it are not computed.
      tile: the GPU kernel: ``SMALL_M_TILE``, ``MEDIUM_M_TILE``, ``LARGE_M_TILE`` or ``DECODE_TILE``
        (None: by ``plan.pick_tile`` from the rows each expert expects). Results agree within rounding.

    Returns:
      ``(out, scratch)``: out [num_rows, N] bf16 with ``out[i] = rows[i] @ weights[g]`` (f32
      accumulation) for row i of expert g, zero for rows in no group, as
      ``jax.lax.ragged_dot(rows, weights, group_sizes)``; and the scratch to pass on.

    On a GPU this is a CUDA custom call (CUTLASS sm90 ptr-array grouped GEMM, TMA and
    warp-specialised; at a few rows per expert the decode kernel); elsewhere, or without the CUDA
    module, ``jax.lax.ragged_dot``. Its gradient runs the input- and weight-gradient grouped GEMMs
    (``input_grad``, ``weight_grad``): native on GPU, bf16 operands with float32 accumulation, no
    float32 copy of the weights.
    """
    num_rows = check_grouped_matmul_args(rows, weights, scratch, num_rows)
    num_groups = scratch.config.num_local_experts
    if tile is None:
        tile = plan.pick_tile(num_rows, num_groups)
    elif tile not in TILES:
        raise ValueError(f"grouped_matmul: tile: expected one of {TILES} (gemm.SMALL_M_TILE, MEDIUM_M_TILE, "
                         f"LARGE_M_TILE, DECODE_TILE) or None, got {tile!r}")
    rows_per_pass = plan.decode_rows_per_pass(num_rows, num_groups) if tile == DECODE_TILE else 0
    out, workspace = _grouped_matmul(rows, weights, scratch.expert_offsets, scratch.workspace, num_rows, tile,
                                     rows_per_pass)
    return out, scratch.replace(workspace=lax.stop_gradient(workspace))
