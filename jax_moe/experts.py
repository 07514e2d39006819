"""The experts step of a layer: the routed experts on permuted rows, and the shared expert.

Between ``permute`` and ``unpermute`` each local expert e applies ``down_e(silu(gate_e(r)) *
up_e(r))`` to its rows r. Which kernels run is the layer's ``LayerPlan`` (``jax_moe.plan``);
``run_experts`` reads it:
- ``ragged_dot``: ``swiglu_experts``, two ``gemm.grouped_dot`` calls differentiated by JAX (any
  device and dtype; the reference of the layer tests; FP8 experts dequantised);
- ``grouped_gemm``: the CUDA bf16 grouped GEMMs (``swiglu_experts_grouped``; at decode the decode
  kernel) with a hand-written backward of four grouped GEMMs;
- ``fp8_grouped_gemm``: the CUDA FP8 GEMMs or FP8 decode kernel (``swiglu_experts_fp8``;
  ``fp8_experts_on_tokens`` when the permute quantises), differentiable in the rows;
- ``custom``: the caller's ``expert_fn``.
``shared_experts`` is the dense SwiGLU expert every token goes through (DeepSeek-V3, Qwen2/3.5-MoE),
optionally scaled by a sigmoid gate; where the plan says so it streams its weights inside the
routed experts' decode launches instead (``run_experts`` returns it then).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import fp8, gemm, ops
from jax_moe.gemm import gated_silu
from jax_moe._ffi import read_from
from jax_moe.plan import LayerPlan
from jax_moe.routing import dot_f32
from jax_moe.scratch import MoEScratch

# expert_fn(layer_params, rows [R, H], group_sizes [El] int32) -> rows_out [R, H] (rows' dtype).
ExpertFn = Callable[[dict, jax.Array, jax.Array], jax.Array]
# The optional shared expert's param leaves: SwiGLU [H, 2Fs] and [Fs, H], and a [H, 1] gate.
SHARED_NAMES = ("shared_gate_up", "shared_down", "shared_gate")


def swiglu_experts(layer_params: dict, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The default experts: SwiGLU as two grouped GEMMs, ``gemm.grouped_dot`` (``jax.lax.ragged_dot``;
    on CPU a kernel that multiplies each row by its own expert's weights only).

    Args:
      layer_params: one layer's params; ``gate_up`` [El, H, 2F] and ``down`` [El, F, H] are used
        (FP8 experts, ``jax_moe.fp8``: the FP8 layer's math, rows quantised per 1 x 128 group).
      rows: [R, H] rows grouped by local expert (expert e owns ``group_sizes[e]`` consecutive rows).
      group_sizes: [El] int32. Rows past ``sum(group_sizes)`` come out zero (ragged_dot's rule).

    Returns:
      [R, H] of rows' dtype: ``down_e(silu(gate_e(row)) * up_e(row))`` for each row's expert e.
      Accumulation and the activation are in float32.
    """
    if fp8.is_quantized(layer_params):
        return _fp8_swiglu_dequantized(layer_params, rows, group_sizes)
    gate_up, down = fp8.expert_weights(layer_params, rows.dtype)
    hidden = gemm.grouped_dot(rows, gate_up, group_sizes, preferred_element_type=jnp.float32)
    activated = gated_silu(hidden, rows.dtype)
    out = gemm.grouped_dot(activated, down, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


def _fp8_swiglu_dequantized(layer_params: dict, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``swiglu_experts`` on FP8 experts: both projections as ``gemm.fp8_dequantized_matmul`` (the
    FP8 GEMM's math), SwiGLU's activation between them. [R, H] of rows' dtype."""
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)])
    return gemm.fp8_swiglu_dequantized(rows, *_fp8_leaves(layer_params, fp8.QUANTIZED_NAMES), offsets, rows.shape[0])


def _fp8_leaves(layer_params: dict, names: tuple[str, str]) -> tuple[jax.Array, ...]:
    """``(gate_up, gate_up_scale, down, down_scale)`` of FP8 experts as constants to autodiff."""
    return tuple(lax.stop_gradient(layer_params[name + suffix]) for name in names for suffix in ("", fp8.SCALE_SUFFIX))


def shared_experts(layer_params: dict, x: jax.Array, plan: LayerPlan | None = None) -> jax.Array | None:
    """The shared expert's output for tokens x [T, H], x's dtype, or None when the params have none.

    ``down(silu(gate(x)) * up(x))`` with ``shared_gate_up`` [H, 2Fs] (gate first) and ``shared_down``
    [Fs, H], float32 accumulation and activation; scaled by ``sigmoid(x @ shared_gate)`` when the
    params hold a ``shared_gate`` [H, 1] (Qwen2-MoE, Qwen3.5-MoE), plain otherwise (DeepSeek-V3,
    whose ``n_shared_experts`` experts are one of width ``n_shared_experts * F``). An FP8 shared
    expert (``jax_moe.fp8``: ``shared_gate_up`` [2Fs, H], ``shared_down`` [H, Fs] and their scales)
    takes the FP8 experts' math as one group of T rows, its output rounded to x's dtype before the
    gate. ``plan``: its kernels (``plan.shared``, in launches of its own); None: XLA's.
    """
    if "shared_gate_up" not in layer_params:
        return None
    path = "xla" if plan is None else plan.shared
    weight = lambda name: layer_params[name].astype(x.dtype)  # noqa: E731
    if fp8.shared_is_quantized(layer_params):
        out = _shared_swiglu_fp8(x, layer_params, plan if path == "fp8_grouped_gemm" else None)
    elif path == "decode_kernel":
        out = _shared_swiglu_decode(x, weight("shared_gate_up"), weight("shared_down"), plan.shared_decode_rows_per_pass)
    else:
        out = _shared_swiglu(x, weight("shared_gate_up"), weight("shared_down"))
    return _gate_shared(layer_params, x, out)


def _gate_shared(layer_params: dict, x, out):
    """The shared expert's output [T, H] scaled by its sigmoid gate when the params hold one, in x's dtype."""
    if "shared_gate" in layer_params:
        out = out * jax.nn.sigmoid(dot_f32(x, layer_params["shared_gate"].astype(x.dtype)))
    return out.astype(x.dtype)


def _shared_swiglu_fp8(x, layer_params, plan: LayerPlan | None):
    """The FP8 shared expert on tokens x [T, H]: one group of T rows through ``_fp8_experts`` (the FP8
    kernels the plan names, their own small workspace), or with no plan the same math dequantised.
    [T, H] of x's dtype; differentiable in x only."""
    num_tokens = x.shape[0]
    weights = tuple(leaf[None] for leaf in _fp8_leaves(layer_params, fp8.SHARED_QUANTIZED_NAMES))
    offsets = jnp.array([0, num_tokens], jnp.int32)
    if plan is not None:
        kernels = (plan.shared_fp8_tile_rows, plan.shared_fp8_decode_rows_per_pass, num_tokens)
        return _fp8_experts(x, *weights, offsets, num_tokens, kernels, gemm.fp8_workspace(1))[0]
    return gemm.fp8_swiglu_dequantized(x, *weights, offsets, num_tokens)


def _shared_swiglu(x, gate_up, down):
    """The shared SwiGLU expert on XLA's dots: [T, H] float32."""
    return dot_f32(gated_silu(dot_f32(x, gate_up), x.dtype), down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _shared_swiglu_decode(x, gate_up, down, rows_per_pass: int):
    """``_shared_swiglu`` on the decode kernel (one group of T rows), rounded to x's dtype; its
    gradient is the XLA path's. XLA's dot would copy a scanned stack's slice of the weights first;
    the custom call reads it in place."""
    num_tokens = x.shape[0]
    offsets = jnp.array([0, num_tokens], jnp.int32)
    workspace = jnp.zeros((1,), jnp.int32)  # the decode kernel keeps no per-group arguments
    activated, workspace = gemm.gated_forward(x, gate_up[None], offsets, workspace, num_tokens, gemm.DECODE_TILE,
                                              rows_per_pass)
    out, _ = gemm.forward(activated, down[None], offsets, workspace, num_tokens, gemm.DECODE_TILE, rows_per_pass)
    return out


def _shared_swiglu_decode_fwd(x, gate_up, down, rows_per_pass):
    return _shared_swiglu_decode(x, gate_up, down, rows_per_pass), (x, gate_up, down)


def _shared_swiglu_decode_bwd(rows_per_pass, residuals, d_out):
    _, vjp = jax.vjp(lambda *a: _shared_swiglu(*a).astype(d_out.dtype), *residuals)
    return vjp(d_out)


_shared_swiglu_decode.defvjp(_shared_swiglu_decode_fwd, _shared_swiglu_decode_bwd)


def swiglu_decode_with_shared(rows, gate_up, down, offsets, workspace, num_rows: int, rows_per_pass: int,
                              layer_params: dict, x):
    """The routed experts' SwiGLU on the decode kernel with the shared expert's in the same two
    launches (``gemm.decode_forward_with_shared``, rows_per_pass enough for both): ``(rows_out
    [num_rows, H], shared [T, H], workspace)``, shared gated as ``shared_experts``'s. The routed experts' math is
    ``_swiglu_grouped``'s at ``gemm.DECODE_TILE``, the shared expert's ``_shared_swiglu_decode``'s
    (its sums split over other blocks: float32 roundings may differ). Differentiable as those two."""
    shared_gate_up, shared_down = (layer_params[name].astype(x.dtype) for name in ("shared_gate_up", "shared_down"))
    out, shared, workspace = _swiglu_with_shared(rows, gate_up, down, offsets, workspace, num_rows, rows_per_pass,
                                                 x, shared_gate_up, shared_down)
    return out, _gate_shared(layer_params, x, shared), workspace


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _swiglu_with_shared(rows, gate_up, down, offsets, workspace, num_rows, rows_per_pass, x, shared_gate_up,
                        shared_down):
    activated, shared_activated = gemm.decode_forward_with_shared(rows, gate_up, offsets, num_rows, x, shared_gate_up,
                                                                  gated=True, rows_per_pass=rows_per_pass)
    out, shared = gemm.decode_forward_with_shared(activated, down, offsets, num_rows, shared_activated, shared_down,
                                                  gated=False, rows_per_pass=rows_per_pass)
    return out, shared, workspace


def _swiglu_with_shared_fwd(rows, gate_up, down, offsets, workspace, num_rows, rows_per_pass, x, shared_gate_up,
                            shared_down):
    (out, workspace), routed = _swiglu_grouped_fwd(rows, gate_up, down, offsets, workspace, num_rows,
                                                   gemm.DECODE_TILE, rows_per_pass)
    shared, dense = _shared_swiglu_decode_fwd(x, shared_gate_up, shared_down, rows_per_pass)
    return (out, shared, workspace), (routed, dense)


def _swiglu_with_shared_bwd(num_rows, rows_per_pass, residuals, cotangents):
    routed, dense = residuals
    d_out, d_shared, d_workspace = cotangents
    d_routed = _swiglu_grouped_bwd(num_rows, gemm.DECODE_TILE, rows_per_pass, routed, (d_out, d_workspace))
    return (*d_routed, *_shared_swiglu_decode_bwd(rows_per_pass, dense, d_shared))


_swiglu_with_shared.defvjp(_swiglu_with_shared_fwd, _swiglu_with_shared_bwd)


def swiglu_grouped_forward(rows, gate_up, down, offsets, workspace, num_rows: int, tile: str,
                           keep_hidden: bool = True, rows_per_pass: int = 0, hidden_into=None):
    """``(out [num_rows, H], workspace, hidden [num_rows, 2F] or None)``: the grouped SwiGLU, no autodiff rule.

    ``keep_hidden=False`` (no backward to come) lets the decode tile fold the activation into the
    gate/up GEMM, and hidden comes back None. rows_per_pass: ``gemm.forward``'s. hidden_into: optional
    ``(stack, layer, offset)``: the gate/up GEMM writes hidden there (``gemm.forward_into``) and
    the stack comes back in hidden's place.
    """
    if hidden_into is not None:
        stack, layer, offset = hidden_into
        hidden, workspace = gemm.forward_into(rows, gate_up, offsets, workspace, num_rows, tile, stack, layer, offset)
        activated = gated_silu(read_from(hidden, layer, (num_rows, gate_up.shape[2]), offset), rows.dtype)
    elif keep_hidden:
        hidden, workspace = gemm.forward(rows, gate_up, offsets, workspace, num_rows, tile, rows_per_pass)
        activated = gated_silu(hidden, rows.dtype)
    else:
        hidden = None
        activated, workspace = gemm.gated_forward(rows, gate_up, offsets, workspace, num_rows, tile, rows_per_pass)
    out, workspace = gemm.forward(activated, down, offsets, workspace, num_rows, tile, rows_per_pass)
    return out, workspace, hidden


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _swiglu_grouped(rows, gate_up, down, offsets, workspace, num_rows, tile, rows_per_pass):
    out, workspace, _ = swiglu_grouped_forward(rows, gate_up, down, offsets, workspace, num_rows, tile,
                                               keep_hidden=False, rows_per_pass=rows_per_pass)
    return out, workspace


def _swiglu_grouped_fwd(rows, gate_up, down, offsets, workspace, num_rows, tile, rows_per_pass):
    out, workspace, hidden = swiglu_grouped_forward(rows, gate_up, down, offsets, workspace, num_rows, tile,
                                                    rows_per_pass=rows_per_pass)
    # Residuals: this layer's live rows and groups (a scan stacks them per layer, so the next
    # layer's in-place permute cannot clobber them), the [num_rows, 2F] gate/up product (the
    # activation is recomputed from it: [num_rows, F] less to keep), the weights by reference, and
    # a zero-width array carrying the scratch's row count.
    residuals = (rows[:num_rows], hidden, offsets, gate_up, down, jnp.zeros((rows.shape[0], 0), rows.dtype))
    return (out, workspace), residuals


def swiglu_grouped_grad(rows, hidden, offsets, gate_up, down, d_out, num_rows: int, tile: int,
                        stacks=None, layer=None):
    """The grouped SwiGLU's backward: four grouped GEMMs, the activation recomputed from ``hidden``.

    Args:
      rows: [num_rows, H] the forward's live input rows; hidden: [num_rows, 2F] its gate/up
        product; offsets: [El + 1] int32 groups; gate_up [El, H, 2F], down [El, F, H]: the weights
        (rows' dtype); d_out: [num_rows, H] the output rows' cotangent.
      stacks, layer: optional stacked gradients ``(d_gate_up [L, El, H, 2F], d_down [L, El, F, H])``
        and an int32 layer index: the weight gradients are written into slice ``layer`` of each
        (``gemm.weight_grad_into``: in place on a GPU).

    Returns:
      ``(d_rows [num_rows, H], d_gate_up, d_down)``: the weight gradients [El, ...], or the stacks
      when given. Rows' dtype, float32 accumulation.
    """
    d_rows, d_hidden, d_down, _, workspace = swiglu_grouped_grad_but_gate_up(
        hidden, offsets, gate_up, down, d_out.astype(rows.dtype), num_rows, tile,
        None if stacks is None else stacks[1], layer)
    if stacks is None:
        d_gate_up, _ = gemm.weight_grad(rows, d_hidden, offsets, workspace, gate_up.shape[0])
    else:
        d_gate_up, _ = gemm.weight_grad_into(rows, d_hidden, offsets, workspace, stacks[0], layer)
    return d_rows, d_gate_up, d_down


def swiglu_grouped_grad_but_gate_up(hidden, offsets, gate_up, down, d_out, num_rows: int, tile: int,
                                    down_stack=None, layer=None, row_weights=None, hidden_at=None):
    """``swiglu_grouped_grad`` without its last GEMM, the gate/up weight gradient rows^T @ d_hidden.

    For a caller that must order that GEMM after other work (``jax_moe.stack`` keeps activations
    in the buffer it writes). ``d_out`` in hidden's dtype; ``down_stack``/``layer`` as ``stacks[1]``
    there. hidden_at: optional ``(stack, layer, offset)`` holding hidden instead (``hidden`` None),
    read there by the activation's backward (``gemm.swiglu_backward``).

    row_weights: optional [num_rows] float32 w_r, when the cotangent is that of the weighted rows
    w_r * out_r and ``d_out`` is given unweighted (unpermute's combine: d_out[r] = d y[token of r]).
    Then d out_r = w_r * d_out_r, and also d w_r = <out_r, d_out_r> = <act_r, d_out_r @ down^T>:
    the expert outputs need not be kept for the router's gradient, the input-gradient GEMM of the
    down projection gives it.

    Returns ``(d_rows [num_rows, H], d_hidden [num_rows, 2F], d_down, d_row_weights [num_rows]
    float32 or None, workspace)``.
    """
    num_groups = gate_up.shape[0]
    workspace = gemm.backward_workspace(num_groups)
    d_activated, workspace = gemm.input_grad(d_out, down, offsets, workspace, num_rows, tile)
    # The weights scale the [R, F] side of the down weight gradient: sum_r (w_r act_r)^T d_out_r.
    if hidden_at is None:
        activated, d_hidden, d_row_weights = gemm.swiglu_backward(hidden, d_activated, row_weights)
    else:
        stack, at_layer, offset = hidden_at
        activated, d_hidden, d_row_weights = gemm.swiglu_backward(stack, d_activated, row_weights, layer=at_layer,
                                                                  offset=offset)
    if down_stack is None:
        d_down, workspace = gemm.weight_grad(activated, d_out, offsets, workspace, num_groups)
    else:
        d_down, workspace = gemm.weight_grad_into(activated, d_out, offsets, workspace, down_stack, layer)
    d_rows, workspace = gemm.input_grad(d_hidden, gate_up, offsets, workspace, num_rows, tile)
    return d_rows, d_hidden, d_down, d_row_weights, workspace


def _swiglu_grouped_bwd(num_rows, tile, rows_per_pass, residuals, cotangents):
    rows, hidden, offsets, gate_up, down, rows_like = residuals
    d_rows, d_gate_up, d_down = swiglu_grouped_grad(rows, hidden, offsets, gate_up, down, cotangents[0],
                                                    num_rows, tile)
    d_rows = jnp.pad(d_rows, ((0, rows_like.shape[0] - num_rows), (0, 0)))
    return d_rows, d_gate_up.astype(gate_up.dtype), d_down.astype(down.dtype), None, None


_swiglu_grouped.defvjp(_swiglu_grouped_fwd, _swiglu_grouped_bwd)


def swiglu_experts_grouped(layer_params: dict, scratch: MoEScratch, plan: LayerPlan):
    """``swiglu_experts`` on the CUDA grouped GEMMs: gate/up as one GEMM of width 2F, then down.

    Reads the rows and groups from the scratch and threads its workspace through both GEMMs.
    Returns ``([live_row_bound(T), H] rows for unpermute, scratch)``: only the rows T tokens can
    fill are computed. The gate/up product is rounded to the rows' dtype before the activation
    (the ragged_dot path keeps it in float32). Differentiable: its backward runs the input- and
    weight-gradient grouped GEMMs of both projections, recomputing the activation from the saved
    gate/up product; the weight gradients come out in the weights' dtype. FP8 experts
    (``jax_moe.fp8``) are dequantised to the rows' dtype first (no gradient reaches FP8 weights).
    """
    config = scratch.config
    num_rows = config.live_row_bound(plan.num_tokens)
    gate_up, down = fp8.expert_weights(layer_params, config.dtype)
    out, workspace = _swiglu_grouped(scratch.permuted, gate_up, down, scratch.expert_offsets, scratch.workspace,
                                     num_rows, plan.tile, plan.decode_rows_per_pass)
    return out, scratch.replace(workspace=lax.stop_gradient(workspace))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fp8_experts(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows, kernels, workspace):
    """Both projections on the FP8 kernels, one call (``gemm.fp8_swiglu_forward``; kernels: its
    ``(tile_rows, decode_rows, group_rows)``): ``([num_rows, H], workspace)``. Differentiable in rows."""
    tile_rows, decode_rows, group_rows = kernels
    return gemm.fp8_swiglu_forward(rows, gate_up, gate_up_scale, down, down_scale, offsets, workspace, num_rows,
                                   tile_rows=tile_rows, decode_rows=decode_rows, group_rows=group_rows)


def _fp8_experts_fwd(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows, kernels, workspace):
    out = _fp8_experts(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows, kernels, workspace)
    # The live rows only, and a zero-width array carrying the scratch's row count (as _swiglu_grouped).
    return out, (rows[:num_rows], gate_up, gate_up_scale, down, down_scale, offsets,
                 jnp.zeros((rows.shape[0], 0), rows.dtype))


def _fp8_experts_bwd(num_rows, kernels, residuals, cotangents):
    # The rows' gradient with the rows' quantisation as the identity (as fp8_dequantized_matmul's):
    # through the dequantised weights on the bf16 grouped GEMMs (the weight gradients it also forms
    # are dead code). FP8 weights and scales are inference-only; the workspace has no gradient.
    rows, gate_up, gate_up_scale, down, down_scale, offsets, shape_of_rows = residuals
    d_out = cotangents[0]
    gate_up, down = (jnp.swapaxes(fp8.dequantize(w, s, rows.dtype), -1, -2)
                     for w, s in ((gate_up, gate_up_scale), (down, down_scale)))
    workspace = gemm.backward_workspace(gate_up.shape[0])
    hidden, _ = gemm.forward(rows, gate_up, offsets, workspace, num_rows, gemm.SMALL_M_TILE)
    d_rows, _, _ = swiglu_grouped_grad(rows, hidden, offsets, gate_up, down, d_out, num_rows, gemm.SMALL_M_TILE)
    d_rows = jnp.pad(d_rows, ((0, shape_of_rows.shape[0] - num_rows), (0, 0)))
    return d_rows, None, None, None, None, None, None


_fp8_experts.defvjp(_fp8_experts_fwd, _fp8_experts_bwd)


def swiglu_experts_fp8(layer_params: dict, scratch: MoEScratch, plan: LayerPlan):
    """``swiglu_experts_grouped`` for FP8 experts (``jax_moe.fp8``): both projections on the FP8
    kernels the plan names in one call (``gemm.fp8_swiglu_forward``; rows quantised per 1 x 128
    group, the scratch's workspace threaded through), SwiGLU's activation between them.
    Differentiable in the rows (not in the FP8 weights). Returns ``([live_row_bound(T), H], scratch)``."""
    config = scratch.config
    num_rows = config.live_row_bound(plan.num_tokens)
    weights = _fp8_leaves(layer_params, fp8.QUANTIZED_NAMES)
    kernels = (plan.fp8_tile_rows, plan.fp8_decode_rows_per_pass, config.group_row_bound(plan.num_tokens))
    out, workspace = _fp8_experts(scratch.permuted, *weights, scratch.expert_offsets, num_rows, kernels,
                                  scratch.workspace)
    return out, scratch.replace(workspace=lax.stop_gradient(workspace))


def fp8_experts_on_tokens(layer_params: dict, tokens, ids, scratch: MoEScratch, plan: LayerPlan):
    """``permute`` then ``swiglu_experts_fp8`` for FP8 experts on the CUTLASS path (the plan's
    ``permute="fp8_quantize"``), with the tokens quantised in permute (``ops.permute_fp8``, then
    ``gemm.fp8_swiglu_quantized_forward``): the same bits, and no bf16 rows written and read back.
    Differentiable in tokens (the rows' quantisation as the identity, as ``swiglu_experts_fp8``).
    Returns ``([live_row_bound(T), H], scratch)``."""
    config = scratch.config
    num_rows = config.live_row_bound(tokens.shape[0])
    out, scratch = _fp8_permuted_experts(tokens, ids, scratch, *_fp8_leaves(layer_params, fp8.QUANTIZED_NAMES),
                                         num_rows, plan.fp8_tile_rows)
    return out, lax.stop_gradient(scratch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fp8_permuted_experts(tokens, ids, scratch, gate_up, gate_up_scale, down, down_scale, num_rows, tile_rows):
    scratch, q_rows, row_scale = ops.permute_fp8(tokens, ids, scratch, num_rows)
    out, workspace = gemm.fp8_swiglu_quantized_forward(q_rows, row_scale, gate_up, gate_up_scale, down, down_scale,
                                                       scratch.expert_offsets, scratch.workspace, num_rows, tile_rows)
    return out, scratch.replace(workspace=workspace)


def _fp8_permuted_experts_fwd(tokens, ids, scratch, gate_up, gate_up_scale, down, down_scale, num_rows, tile_rows):
    out, scratch = _fp8_permuted_experts(tokens, ids, scratch, gate_up, gate_up_scale, down, down_scale, num_rows,
                                         tile_rows)
    # This call's routes and offsets, never a scratch buffer itself (the next layer overwrites it).
    dest = scratch.dest_index[:tokens.shape[0]]
    return (out, scratch), (tokens, dest, scratch.expert_offsets, gate_up, gate_up_scale, down, down_scale)


def _fp8_permuted_experts_bwd(num_rows, tile_rows, residuals, cotangents):
    # The rows are recomputed from the tokens (permute's bf16 rows were never written), then
    # _fp8_experts' backward and permute's.
    tokens, dest, offsets, gate_up, gate_up_scale, down, down_scale = residuals
    rows = ops.rows_by_route((tokens,), dest, ops.invert_dest(dest, num_rows))[0]
    d_rows = _fp8_experts_bwd(num_rows, None, (rows, gate_up, gate_up_scale, down, down_scale, offsets,
                                                jnp.zeros((num_rows, 0), rows.dtype)), cotangents)[0]
    return ops.permute_grad(d_rows, dest), None, None, None, None, None, None


_fp8_permuted_experts.defvjp(_fp8_permuted_experts_fwd, _fp8_permuted_experts_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12))
def _fp8_experts_with_shared(rows, gate_up, gate_up_scale, down, down_scale, offsets, x, shared_gate_up,
                             shared_gate_up_scale, shared_down, shared_down_scale, num_rows, group_rows):
    """``(routed [num_rows, H], shared [T, H])``: ``gemm.fp8_decode_swiglu_with_shared``,
    differentiable in rows and x as ``_fp8_experts``."""
    return gemm.fp8_decode_swiglu_with_shared(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows, x,
                                              shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                                              group_rows)


def _fp8_experts_with_shared_fwd(rows, gate_up, gate_up_scale, down, down_scale, offsets, x, shared_gate_up,
                                 shared_gate_up_scale, shared_down, shared_down_scale, num_rows, group_rows):
    out = _fp8_experts_with_shared(rows, gate_up, gate_up_scale, down, down_scale, offsets, x, shared_gate_up,
                                   shared_gate_up_scale, shared_down, shared_down_scale, num_rows, group_rows)
    routed = (rows[:num_rows], gate_up, gate_up_scale, down, down_scale, offsets,
              jnp.zeros((rows.shape[0], 0), rows.dtype))
    shared = (x, *(leaf[None] for leaf in (shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)),
              jnp.array([0, x.shape[0]], jnp.int32), jnp.zeros((x.shape[0], 0), x.dtype))
    return out, (routed, shared)


def _fp8_experts_with_shared_bwd(num_rows, group_rows, residuals, cotangents):
    routed, shared = residuals
    d_out, d_shared = cotangents
    d_rows = _fp8_experts_bwd(num_rows, group_rows, routed, (d_out, None))[0]
    d_x = _fp8_experts_bwd(shared[0].shape[0], shared[0].shape[0], shared, (d_shared, None))[0]
    return (d_rows, None, None, None, None, None, d_x, None, None, None, None)


_fp8_experts_with_shared.defvjp(_fp8_experts_with_shared_fwd, _fp8_experts_with_shared_bwd)


def experts_on_scratch(expert_fn: ExpertFn, layer_params, scratch: MoEScratch, num_tokens: int) -> jax.Array:
    """Runs ``expert_fn`` on the rows that can be live; returns them ([live_row_bound(T), H]).

    At most ``T*k + El*(align-1)`` rows are live for T tokens (static), so when the scratch was
    sized for more tokens only that prefix goes through the GEMMs (``unpermute`` reads no more).
    """
    config = scratch.config
    live_bound = config.live_row_bound(num_tokens)
    rows = scratch.permuted if live_bound == config.capacity else scratch.permuted[:live_bound]
    out = expert_fn(layer_params, rows, scratch.group_sizes)
    if out.shape != rows.shape or out.dtype != rows.dtype:
        raise ValueError(f"moe_layer: expert_fn: expected it to return {rows.dtype}{list(rows.shape)} "
                         f"(rows' shape and dtype), got {out.dtype}{list(out.shape)}")
    return out


def run_experts(plan: LayerPlan, layer_params: dict, scratch: MoEScratch, tokens: jax.Array,
                expert_fn: ExpertFn | None = None):
    """The experts on a permuted scratch, as ``plan`` says: ``(rows_out [live_row_bound(T), H] for
    unpermute, shared [T, H] or None, scratch)``.

    ``shared`` is the shared expert's output when the plan streams it in the routed experts'
    launches (``plan.shared`` ``"routed_launch"`` / ``"fp8_routed_launch"``; ``tokens`` [T, H] are
    its input), else None (the layer runs ``shared_experts`` apart). The single-device layer and the
    expert-parallel one (on its received rows) both come through here.
    """
    config, num_tokens = scratch.config, plan.num_tokens
    num_rows = config.live_row_bound(num_tokens)
    if plan.experts == "grouped_gemm":
        if plan.shared == "routed_launch":
            gate_up, down = fp8.expert_weights(layer_params, config.dtype)
            rows_per_pass = max(plan.decode_rows_per_pass, plan.shared_decode_rows_per_pass)
            out, shared, workspace = swiglu_decode_with_shared(scratch.permuted, gate_up, down, scratch.expert_offsets,
                                                               scratch.workspace, num_rows, rows_per_pass,
                                                               layer_params, tokens)
            return out, shared, scratch.replace(workspace=lax.stop_gradient(workspace))
        out, scratch = swiglu_experts_grouped(layer_params, scratch, plan)
        return out, None, scratch
    if plan.experts == "fp8_grouped_gemm":
        if plan.shared == "fp8_routed_launch":
            out, shared = _fp8_experts_with_shared(
                scratch.permuted, *_fp8_leaves(layer_params, fp8.QUANTIZED_NAMES), scratch.expert_offsets, tokens,
                *_fp8_leaves(layer_params, fp8.SHARED_QUANTIZED_NAMES), num_rows,
                config.group_row_bound(num_tokens))
            return out, _gate_shared(layer_params, tokens, shared), scratch
        out, scratch = swiglu_experts_fp8(layer_params, scratch, plan)
        return out, None, scratch
    if plan.experts == "custom" and expert_fn is None:
        raise ValueError("moe_layer: plan: experts='custom' needs an expert_fn")
    expert_fn = swiglu_experts if expert_fn is None else expert_fn
    return experts_on_scratch(expert_fn, layer_params, scratch, num_tokens), None, scratch


def run_experts_keeping_hidden(plan: LayerPlan, layer_params: dict, scratch: MoEScratch, hidden_into=None):
    """A stack's training forward on the bf16 grouped GEMMs: ``(rows_out, scratch, hidden)``, hidden
    the gate/up product [live_row_bound(T), 2F] its backward reads (or, with ``hidden_into``, the
    stack it was written into: ``swiglu_grouped_forward``'s). No autodiff rule: the stack's backward
    (``jax_moe.stack``) is written by hand."""
    config = scratch.config
    num_rows = config.live_row_bound(plan.num_tokens)
    gate_up, down = (layer_params[name].astype(config.dtype) for name in ("gate_up", "down"))
    out, workspace, hidden = swiglu_grouped_forward(scratch.permuted, gate_up, down, scratch.expert_offsets,
                                                    scratch.workspace, num_rows, plan.tile, keep_hidden=True,
                                                    rows_per_pass=plan.decode_rows_per_pass, hidden_into=hidden_into)
    return out, scratch.replace(workspace=workspace), hidden
