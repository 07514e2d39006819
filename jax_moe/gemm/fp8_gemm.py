"""FP8 experts' GEMMs: CUTLASS's blockwise-scaled grouped GEMM (rows quantised per 1 x 128 group,
DeepSeek-V3's 128 x 128 weight blocks) and the FP8 decode kernel, both projections and SwiGLU in
one call; off CUDA the same math on dequantised operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _ffi, _native, fp8, plan
from jax_moe._ffi import fence_results, uninitialized
from jax_moe.gemm.grouped_dot import _GROUPED_DOT_DTYPES, _group_sizes, _ragged_dot
from jax_moe.gemm.swiglu import gated_silu


def fp8_workspace(num_groups: int) -> jax.Array:
    """A workspace for ``fp8_forward`` alone: the FP8 GEMM's per-group arguments (int32 words, left
    unfilled: each call writes them before its GEMM reads them). A scratch's workspace
    (``init_scratch``) has room for them too."""
    return uninitialized((max(1, -(-_native.fp8_grouped_matmul_workspace_bytes(num_groups) // 4)),), jnp.int32)


def _fp8_grouped_matmul_call(rows, weights_nk, scale_nk, offsets, workspace, num_rows: int, tile_rows: int):
    """The CUDA call of ``fp8_forward``: ``(out, workspace, q_rows, row_scale)``, the last two
    the call's quantised rows (``fp8.quantize_rows(rows[:num_rows])``, temporaries; tests read them)."""
    n, k = weights_nk.shape[1:]
    call = jax.ffi.ffi_call(
        _native.FP8_GROUPED_MATMUL_TARGET,
        (jax.ShapeDtypeStruct((num_rows, n), rows.dtype), jax.ShapeDtypeStruct(workspace.shape, workspace.dtype),
         jax.ShapeDtypeStruct((num_rows, k), fp8.FP8), jax.ShapeDtypeStruct((num_rows, k // fp8.BLOCK), jnp.float32)),
        input_output_aliases={4: 1}, vmap_method="sequential")
    return fence_results(call(rows, weights_nk, scale_nk, offsets, workspace, tile_rows=np.int64(tile_rows)))


def _check_fp8_forward(rows, weights_nk, scale_nk, offsets, num_rows, op: str = "fp8_forward",
                       names: tuple[str, str, str] = ("rows", "weights_nk", "scale_nk")):
    """Trace-time ValueErrors for ``fp8_forward``'s operands (``op``'s, named ``names``)."""
    rows_name, weights_name, scale_name = names
    if jnp.ndim(weights_nk) != 3 or jnp.dtype(weights_nk.dtype) != jnp.dtype(fp8.FP8):
        raise ValueError(f"{op}: {weights_name}: expected float8_e4m3fn [El, N, K], got {weights_nk.dtype} "
                         f"{tuple(jnp.shape(weights_nk))}")
    num_groups, n, k = weights_nk.shape
    if k % fp8.BLOCK:
        raise ValueError(f"{op}: {weights_name}: expected K a multiple of {fp8.BLOCK} (the rows are quantised per "
                         f"1 x {fp8.BLOCK} group), got K={k}")
    if jnp.ndim(rows) != 2 or rows.shape[1] != k:
        raise ValueError(f"{op}: {rows_name}: expected [R, K={k}], got {tuple(jnp.shape(rows))}")
    want = (num_groups, fp8.num_blocks(n), fp8.num_blocks(k))
    if tuple(jnp.shape(scale_nk)) != want or jnp.dtype(scale_nk.dtype) != jnp.float32:
        raise ValueError(f"{op}: {scale_name}: expected float32 {want}, got {scale_nk.dtype} "
                         f"{tuple(jnp.shape(scale_nk))}")
    if tuple(jnp.shape(offsets)) != (num_groups + 1,) or jnp.dtype(offsets.dtype) != jnp.int32:
        raise ValueError(f"{op}: offsets: expected int32 [{num_groups + 1}], got {offsets.dtype} "
                         f"{tuple(jnp.shape(offsets))}")
    if not 0 <= num_rows <= rows.shape[0]:
        raise ValueError(f"{op}: num_rows: expected 0..{rows.shape[0]} (the rows), got {num_rows}")


def fp8_dequantized_matmul(rows, weights_nk, scale_nk, offsets, num_rows: int):
    """``fp8_forward``'s math on dequantised operands: ``[num_rows, N]`` in rows' dtype = each group's
    ``fp8.straight_through_rows(rows)`` @ dequantised weights^T, float32 accumulation (``ragged_dot``).
    Differentiable in rows (the rows' quantisation passes the gradient through)."""
    a = fp8.straight_through_rows(rows[:num_rows])
    return _dequantized_grouped_dot(a, weights_nk, scale_nk, offsets).astype(rows.dtype)


def _dequantized_grouped_dot(rows, weights_nk, scale_nk, offsets):
    """``[M, N]`` float32: each group's float32 rows [M, K] @ ``fp8.dequantize(weights_nk[g],
    scale_nk[g])^T`` (weights [El, N, K] float8_e4m3fn, scale [El, N/128, K/128]), as ``grouped_dot``
    of the dequantised weights, transposed. Differentiable in rows only (FP8 weights are constants).

    On CPU with the native module, one kernel reads the FP8 weights in place, dequantising each as
    it is packed (the same float32 product as ``fp8.dequantize``, so the same bits unless a
    dequantised weight is subnormal, which XLA's CPU code flushes to zero and the kernel keeps): no
    float32 copy of the experts, 4x their FP8 bytes. Its gradient reads them in place too."""
    weights_nk, scale_nk = lax.stop_gradient(weights_nk), lax.stop_gradient(scale_nk)
    if (_native.HAS_CPU and jnp.dtype(rows.dtype) in _GROUPED_DOT_DTYPES and jnp.dtype(weights_nk.dtype) == fp8.FP8
            and jnp.dtype(scale_nk.dtype) == jnp.float32):
        return _fp8_grouped_dot(rows, weights_nk, scale_nk, offsets)
    return _xla_dequantized_grouped_dot(rows, weights_nk, scale_nk, offsets)


def _xla_dequantized_grouped_dot(rows, weights_nk, scale_nk, offsets):
    """``_dequantized_grouped_dot`` through a float32 copy of the dequantised weights (off CPU, and
    the path the CPU kernel replaced: benchmarks and tests compare the two)."""
    return _ragged_dot(rows, fp8.dequantize(weights_nk, scale_nk, jnp.float32), offsets, transpose_weights=True)


def _cpu_fp8_grouped_dot(rows, weights, scale, offsets, transpose_weights: bool):
    """The CPU kernel: ``rows @ dequantize(weights[g], scale[g])`` per group, float32 out (weights
    [El, K, N], or [El, N, K] read transposed; scale over the weights' own 128 x 128 blocks)."""
    n = weights.shape[1] if transpose_weights else weights.shape[2]
    call = jax.ffi.ffi_call(_native.FP8_GROUPED_DOT_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(rows, weights, scale, _group_sizes(offsets), transpose_weights=transpose_weights)


@jax.custom_vjp
def _fp8_grouped_dot(rows, weights_nk, scale_nk, offsets):
    return lax.platform_dependent(rows, weights_nk, scale_nk, offsets, default=_xla_dequantized_grouped_dot,
                                  cpu=lambda r, w, s, o: _cpu_fp8_grouped_dot(r, w, s, o, True))


def _fp8_grouped_dot_fwd(rows, weights_nk, scale_nk, offsets):
    return _fp8_grouped_dot(rows, weights_nk, scale_nk, offsets), (rows, weights_nk, scale_nk, offsets)


def _fp8_grouped_dot_bwd(residuals, d_out):
    rows, weights_nk, scale_nk, offsets = residuals

    def cpu(r, w, s, o, d):  # d rows = d out @ dequantised weights[g] ([N, K]), read in place
        return _cpu_fp8_grouped_dot(d, w, s, o, False).astype(r.dtype)

    def xla(r, w, s, o, d):
        return jax.vjp(lambda r: _xla_dequantized_grouped_dot(r, w, s, o), r)[1](d)[0]

    d_rows = lax.platform_dependent(rows, weights_nk, scale_nk, offsets, d_out, cpu=cpu, default=xla)
    return d_rows, None, None, None  # FP8 weights and their scales are constants (inference only)


_fp8_grouped_dot.defvjp(_fp8_grouped_dot_fwd, _fp8_grouped_dot_bwd)


# The FP8 decode kernel's rows per pass over an expert's weights (cuda/fp8_decode_gemm_kernels.h,
# LaunchFp8DecodeSwiglu): both projections in two launches, the rows quantised in each block.
FP8_DECODE_ROWS_PER_PASS = (8, 16)


def _fp8_decode_swiglu_call(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows: int,
                            rows_per_pass: int, group_rows: int | None = None):
    """The FP8 decode kernel's call: ``(out [num_rows, H], activation [num_rows, F])``, the second a
    temporary (SwiGLU's activation in bf16, before the down product quantises it; tests read it).
    group_rows: ``fp8_swiglu_forward``'s."""
    hidden_size, f = rows.shape[1], down.shape[2]
    call = jax.ffi.ffi_call(_native.FP8_DECODE_SWIGLU_TARGET,
                            (jax.ShapeDtypeStruct((num_rows, hidden_size), rows.dtype),
                             jax.ShapeDtypeStruct((num_rows, f), rows.dtype)),
                            vmap_method="sequential")
    return fence_results(call(rows, gate_up, gate_up_scale, down, down_scale, offsets,
                              rows_per_pass=np.int64(rows_per_pass), group_rows=np.int64(group_rows or 0)))


def _fp8_swiglu_experts_call(rows, gate_up, gate_up_scale, down, down_scale, offsets, workspace, num_rows: int,
                             tile_rows: int):
    """The CUDA call of ``fp8_swiglu_forward``: ``(out, workspace, q_rows, row_scale, hidden, q_act,
    act_scale)``, the last five the call's temporaries (the quantised rows, the gate/up product
    [num_rows, 2F], the quantised activation; tests read them)."""
    hidden_size, f = rows.shape[1], down.shape[2]
    shapes = (((num_rows, hidden_size), rows.dtype), (workspace.shape, workspace.dtype),
              ((num_rows, hidden_size), fp8.FP8), ((num_rows, hidden_size // fp8.BLOCK), jnp.float32),
              ((num_rows, 2 * f), rows.dtype), ((num_rows, f), fp8.FP8), ((num_rows, f // fp8.BLOCK), jnp.float32))
    call = jax.ffi.ffi_call(_native.FP8_SWIGLU_EXPERTS_TARGET,
                            tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
                            input_output_aliases={6: 1}, vmap_method="sequential")
    return fence_results(call(rows, gate_up, gate_up_scale, down, down_scale, offsets, workspace,
                              tile_rows=np.int64(tile_rows)))


def fp8_swiglu_dequantized(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows: int):
    """``fp8_swiglu_forward``'s math on dequantised operands, any device: ``fp8_dequantized_matmul``
    twice with SwiGLU's activation (``gated_silu``) between. [num_rows, H] of rows' dtype,
    differentiable in rows."""
    hidden = fp8_dequantized_matmul(rows, gate_up, gate_up_scale, offsets, num_rows)
    return fp8_dequantized_matmul(gated_silu(hidden, rows.dtype), down, down_scale, offsets, num_rows)


def _check_fp8_swiglu(op, rows, rows_name, gate_up, gate_up_scale, down, down_scale, offsets, num_rows, tile_rows):
    """Trace-time ValueErrors for an FP8 SwiGLU call's operands; returns its row tile (tile_rows or
    ``fp8_tile_rows``' pick)."""
    _check_fp8_forward(rows, gate_up, gate_up_scale, offsets, num_rows, op, (rows_name, "gate_up", "gate_up_scale"))
    num_groups, two_f, hidden_size = gate_up.shape
    if two_f % 2:
        raise ValueError(f"{op}: gate_up: expected [El, 2F, H] (gate rows, then up rows), got an odd "
                         f"{two_f} rows: {tuple(gate_up.shape)}")
    if jnp.shape(down) != (num_groups, hidden_size, two_f // 2):
        raise ValueError(f"{op}: down: expected [El, H, F] = {(num_groups, hidden_size, two_f // 2)} "
                         f"(gate_up is [El, 2F, H] = {tuple(gate_up.shape)}), got {tuple(jnp.shape(down))}")
    _check_fp8_forward(jax.ShapeDtypeStruct((0, two_f // 2), rows.dtype), down, down_scale, offsets, 0, op,
                       ("the activation", "down", "down_scale"))
    tile_rows = plan.fp8_tile_rows(num_rows, num_groups) if tile_rows is None else tile_rows
    if tile_rows not in plan.FP8_TILE_ROWS:
        raise ValueError(f"{op}: tile_rows: expected one of {plan.FP8_TILE_ROWS} or None, got {tile_rows!r}")
    return tile_rows


def fp8_swiglu_forward(rows, gate_up, gate_up_scale, down, down_scale, offsets, workspace, num_rows: int,
                       tile_rows: int | None = None, decode_rows: int | None = None, group_rows: int | None = None):
    """FP8 SwiGLU experts in one CUDA call: ``fp8_forward`` with ``gate_up`` [El, 2F, H], SwiGLU's
    activation (float32, rounded to the rows' dtype) quantised per 1 x 128 group, then
    ``fp8_forward`` with ``down`` [El, H, F]. The same math as those three steps
    (``fp8_swiglu_dequantized`` off CUDA). With few rows per expert the call runs the FP8 decode
    kernel (``fp8_decode_rows``): the same quantisations and block scales, float32 sums in another
    order, two launches in all.

    Args as ``fp8_forward``'s (rows [R, H] bf16, both projections' FP8 weights [El, out, in] and
    float32 scales [El, out/128, in/128], H and F multiples of 128), and decode_rows: 0 for the
    CUTLASS GEMMs (tile_rows their row tile), 8 or 16 for the decode kernel with that many rows of
    an expert per pass over its weights (16 runs as 8 where 16 staged rows do not fit in shared
    memory: gate/up past H of about 9,000, down past F of about 11,000), None for
    ``fp8_decode_rows``' pick. group_rows: the most rows one expert can own, when known
    (``MoEConfig.group_row_bound``): the decode kernel stages no more rows than that per pass (T = 1:
    one row, and blocks small enough for two an SM); any value is correct, a smaller one slower.
    Returns ``([num_rows, H], workspace)``.
    """
    op = "fp8_swiglu_forward"
    tile_rows = _check_fp8_swiglu(op, rows, "rows", gate_up, gate_up_scale, down, down_scale, offsets, num_rows,
                                  tile_rows)
    num_groups, two_f, hidden_size = gate_up.shape
    if decode_rows is None:
        decode_rows = plan.fp8_decode_rows(num_rows, num_groups, hidden_size, two_f // 2)
    elif decode_rows not in (0,) + FP8_DECODE_ROWS_PER_PASS:
        raise ValueError(f"{op}: decode_rows: expected 0 (the CUTLASS GEMMs), one of {FP8_DECODE_ROWS_PER_PASS} "
                         f"(the decode kernel's rows per pass) or None, got {decode_rows!r}")
    elif decode_rows and max(hidden_size, two_f // 2) > plan.FP8_DECODE_MAX_K:
        raise ValueError(f"{op}: decode_rows: the decode kernel takes H and F up to {plan.FP8_DECODE_MAX_K}, "
                         f"got H={hidden_size}, F={two_f // 2}")
    if group_rows is not None and (not isinstance(group_rows, int) or group_rows < 1):
        raise ValueError(f"{op}: group_rows: expected a positive int or None, got {group_rows!r}")

    def fallback(r, gu, gus, d, ds, o, ws):
        return fp8_swiglu_dequantized(r, gu, gus, d, ds, o, num_rows), ws

    def native(*operands):
        if decode_rows:
            return _fp8_decode_swiglu_call(*operands[:6], num_rows, decode_rows, group_rows)[0], operands[6]
        return _fp8_swiglu_experts_call(*operands, num_rows, tile_rows)[:2]

    operands = (rows, gate_up, gate_up_scale, down, down_scale, offsets, workspace)
    if rows.dtype != jnp.bfloat16:  # (H and F are multiples of 128: checked above)
        return fallback(*operands)
    return _ffi.on_cuda(native, fallback, *operands)


def fp8_swiglu_quantized_forward(q_rows, row_scale, gate_up, gate_up_scale, down, down_scale, offsets, workspace,
                                 num_rows: int, tile_rows: int | None = None):
    """``fp8_swiglu_forward`` on the CUTLASS FP8 GEMMs for rows quantised beforehand
    (``ops.permute_fp8``): q_rows [R, H] float8_e4m3fn and row_scale [R, H/128] float32 (the bytes
    ``fp8.quantize_rows`` gives), the other arguments as there. The same math and bits as
    ``fp8_swiglu_forward(rows, ..., decode_rows=0)`` on the rows they quantise, without its
    quantisation launch. Off CUDA the same math on the dequantised rows. No autodiff rule.
    Returns ``([num_rows, H] bf16, workspace)``.
    """
    op = "fp8_swiglu_quantized_forward"
    if q_rows.ndim != 2 or jnp.dtype(q_rows.dtype) != jnp.dtype(fp8.FP8):
        raise ValueError(f"{op}: q_rows: expected float8_e4m3fn [R, H], got {q_rows.dtype}{list(q_rows.shape)}")
    want = (q_rows.shape[0], q_rows.shape[1] // fp8.BLOCK)
    if tuple(row_scale.shape) != want or jnp.dtype(row_scale.dtype) != jnp.float32:
        raise ValueError(f"{op}: row_scale: expected float32 {list(want)} ([R, H/128] beside q_rows), "
                         f"got {row_scale.dtype}{list(row_scale.shape)}")
    rows_like = jax.ShapeDtypeStruct(q_rows.shape, jnp.bfloat16)
    tile_rows = _check_fp8_swiglu(op, rows_like, "q_rows", gate_up, gate_up_scale, down, down_scale, offsets,
                                  num_rows, tile_rows)
    hidden_size = gate_up.shape[2]

    def fallback(q, s, gu, gus, d, ds, o, ws):  # fp8_swiglu_dequantized's math from the quantised rows
        a = fp8.dequantize_rows(q[:num_rows], s[:num_rows], jnp.float32)
        hidden = _dequantized_grouped_dot(a, gu, gus, o).astype(jnp.bfloat16)
        return fp8_dequantized_matmul(gated_silu(hidden, jnp.bfloat16), d, ds, o, num_rows), ws

    def native(q, s, gu, gus, d, ds, o, ws):
        f = d.shape[2]
        shapes = (((num_rows, hidden_size), jnp.bfloat16), (ws.shape, ws.dtype), ((num_rows, 2 * f), jnp.bfloat16),
                  ((num_rows, f), fp8.FP8), ((num_rows, f // fp8.BLOCK), jnp.float32))
        call = jax.ffi.ffi_call(_native.FP8_SWIGLU_QUANTIZED_EXPERTS_TARGET,
                                tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
                                input_output_aliases={7: 1}, vmap_method="sequential")
        return tuple(fence_results(call(q, s, gu, gus, d, ds, o, ws, tile_rows=np.int64(tile_rows))))[:2]

    return _ffi.on_cuda(native, fallback, q_rows, row_scale, gate_up, gate_up_scale, down, down_scale, offsets, workspace)


def fp8_decode_swiglu_with_shared(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows: int, x,
                                  shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                                  group_rows: int | None = None):
    """``fp8_swiglu_forward`` on the FP8 decode kernel (8 rows a pass) with a shared expert's FP8
    SwiGLU on the tokens x [T, H] streaming in the same two launches, as one more group owning
    every row of x: ``(routed [num_rows, H], shared [T, H])``, both bf16, each the same bits as a
    call of its own. The shared weights are [2Fs, H] and [H, Fs] float8_e4m3fn with their
    [out/128, in/128] float32 scales (``fp8.SHARED_QUANTIZED_NAMES``); T from 1 to
    plan.FP8_DECODE_MAX_SHARED_ROWS. Off CUDA, both on ``fp8_swiglu_dequantized``. No autodiff rule."""
    op = "fp8_decode_swiglu_with_shared"
    _check_fp8_forward(rows, gate_up, gate_up_scale, offsets, num_rows, op, ("rows", "gate_up", "gate_up_scale"))
    hidden_size, ffn_size = rows.shape[1], jnp.shape(down)[-1]
    num_tokens = x.shape[0] if x.ndim == 2 else 0
    if x.ndim != 2 or x.shape[1] != hidden_size or x.dtype != rows.dtype or not 1 <= num_tokens <= plan.FP8_DECODE_MAX_SHARED_ROWS:
        raise ValueError(f"{op}: x: expected [T, H={hidden_size}] of the rows' dtype {rows.dtype} with T from 1 to "
                         f"{plan.FP8_DECODE_MAX_SHARED_ROWS}, got {x.dtype}{list(x.shape)}")
    shared_ffn = jnp.shape(shared_down)[-1]
    want = {"shared_gate_up": (2 * shared_ffn, hidden_size), "shared_down": (hidden_size, shared_ffn)}
    for name, leaf, scale in (("shared_gate_up", shared_gate_up, shared_gate_up_scale),
                              ("shared_down", shared_down, shared_down_scale)):
        if jnp.shape(leaf) != want[name] or leaf.dtype != fp8.FP8:
            raise ValueError(f"{op}: {name}: expected float8_e4m3fn{list(want[name])}, got "
                             f"{leaf.dtype}{list(jnp.shape(leaf))}")
        blocks = tuple(fp8.num_blocks(d) for d in want[name])
        if jnp.shape(scale) != blocks or scale.dtype != jnp.float32:
            raise ValueError(f"{op}: {name}_scale: expected float32{list(blocks)}, got {scale.dtype}{list(jnp.shape(scale))}")
    if max(hidden_size, ffn_size, shared_ffn) > plan.FP8_DECODE_MAX_K or shared_ffn % fp8.BLOCK:
        raise ValueError(f"{op}: expected H, F and Fs multiples of {fp8.BLOCK} up to {plan.FP8_DECODE_MAX_K}, got "
                         f"H={hidden_size}, F={ffn_size}, Fs={shared_ffn}")
    def fallback(*operands):  # the shared expert as one group (El = 1) of every token
        return (fp8_swiglu_dequantized(*operands[:6], num_rows),
                fp8_swiglu_dequantized(operands[6], *(leaf[None] for leaf in operands[7:]),
                                       jnp.array([0, num_tokens], jnp.int32), num_tokens))

    def native(*operands):
        call = jax.ffi.ffi_call(_native.FP8_DECODE_SWIGLU_SHARED_TARGET,
                                (jax.ShapeDtypeStruct((num_rows, hidden_size), rows.dtype),
                                 jax.ShapeDtypeStruct((num_rows, ffn_size), rows.dtype),
                                 jax.ShapeDtypeStruct((num_tokens, hidden_size), rows.dtype),
                                 jax.ShapeDtypeStruct((num_tokens, shared_ffn), rows.dtype)),
                                vmap_method="sequential")
        out, _, shared_out, _ = fence_results(call(*operands, rows_per_pass=np.int64(8),
                                                   group_rows=np.int64(group_rows or 0)))
        return out, shared_out

    operands = (rows, gate_up, gate_up_scale, down, down_scale, offsets, x, shared_gate_up, shared_gate_up_scale,
                shared_down, shared_down_scale)
    if rows.dtype != jnp.bfloat16:
        return fallback(*operands)
    return _ffi.on_cuda(native, fallback, *operands)


def fp8_forward(rows, weights_nk, scale_nk, offsets, workspace, num_rows: int, tile_rows: int | None = None):
    """``[num_rows, N]`` bf16: each expert's rows, quantised per 1 x 128 group of a row
    (``fp8.quantize_rows``), times its FP8 weights, on Hopper's FP8 tensor cores (CUTLASS's
    blockwise-scaled grouped GEMM, float32 accumulation); rows in no group are zero. At every row
    count: at decode it streams the FP8 weights near the copy rate.

    Args:
      rows: [R >= num_rows, K] bf16 grouped by expert (``permute``'s layout).
      weights_nk: [El, N, K] float8_e4m3fn, the checkpoint's [out, in] layout (FP8 wgmma reads both
        operands K-major); scale_nk: [El, N/128, K/128] float32 (DeepSeek-V3's weight_scale_inv).
      offsets: [El + 1] int32 expert offsets; workspace: ``fp8_workspace(El)``, threaded through.
      num_rows: static row count of the result (the live-row bound).
      tile_rows: 64 or 128, the CUTLASS row tile (default ``plan.fp8_tile_rows``; the same math).

    Returns ``(out, workspace)``. Off CUDA (or for shapes it does not take: K or N not a multiple of
    128, rows not bf16) ``fp8_dequantized_matmul``. No autodiff rule (``experts`` gives the layer's).
    """
    _check_fp8_forward(rows, weights_nk, scale_nk, offsets, num_rows)
    num_groups, n, k = weights_nk.shape
    if tile_rows is None:
        tile_rows = plan.fp8_tile_rows(num_rows, num_groups)
    elif tile_rows not in plan.FP8_TILE_ROWS:
        raise ValueError(f"fp8_forward: tile_rows: expected one of {plan.FP8_TILE_ROWS} or None, got {tile_rows!r}")

    def fallback(r, w, s, o, ws):
        return fp8_dequantized_matmul(r, w, s, o, num_rows), ws

    def native(r, w, s, o, ws):
        return _fp8_grouped_matmul_call(r, w, s, o, ws, num_rows, tile_rows)[:2]

    if not (rows.dtype == jnp.bfloat16 and k % fp8.BLOCK == 0 and n % fp8.BLOCK == 0):
        return fallback(rows, weights_nk, scale_nk, offsets, workspace)
    return _ffi.on_cuda(native, fallback, rows, weights_nk, scale_nk, offsets, workspace)
