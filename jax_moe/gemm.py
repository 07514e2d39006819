"""Grouped GEMMs over the scratch's expert groups: CUTLASS Hopper custom calls on GPU.

``grouped_matmul(rows, weights, scratch)`` multiplies each expert's rows (the groups ``permute``
wrote: ``expert_offsets``) by that expert's weights, reading the groups on the device: no host
sync, work bounded by the live rows, its per-expert arguments in the scratch's workspace. Its
backward runs the two other grouped GEMMs of an expert layer, also native on GPU:
``input_grad`` (``d rows = d out @ w[g]^T``) and ``weight_grad`` (``d w[g] = rows_g^T @ d out_g``,
a reduction over each expert's own rows). Elsewhere all three are ``grouped_dot``: ragged_dot's
product, on CPU a C++ kernel that multiplies each row by its own group's weights only
(cuda/cpu_grouped_dot.cc; XLA:CPU's ragged_dot multiplies every row by every group's weights).

Few rows per expert (decode) take ``DECODE_TILE``: a CUDA-core kernel of ours
(cuda/decode_gemm.h) that streams each active expert's weights once over all SMs, with no setup
kernel, and can fold SwiGLU's activation into the gate/up product (``gated_forward``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _native, fp8
from jax_moe._validate import check_grouped_matmul_args
from jax_moe.ops import fence_results, read_from, uninitialized, write_into
from jax_moe.scratch import GROUPED_MATMUL_ALIGN, GROUPED_MATMUL_DTYPES, MoEScratch

# Tile configurations of cuda/grouped_gemm.h (GemmTile), by the rows each expert expects: 64 x 128
# tiles for a few (decode), 64 x 256 ping-pong tiles from MEDIUM_M_MIN_ROWS_PER_EXPERT (training and
# prefill of fine-grained experts: half the padded rows of a 128-row tile on ragged groups), 128 x
# 256 cooperative tiles from LARGE_M_MIN_ROWS_PER_EXPERT. Measured per call at the four models'
# shapes (notebooks/results/gemm_tiles_h200.txt): the 64 x 256 tile beat the 64 x 128 one at 20 to
# 1024 rows per expert; at 128 and 256 it was up to 21 % faster than the 128 x 256 one on 11 of 12
# products and 2 % slower on one; at 1024, up to 14 % slower.
# DECODE_TILE is the decode kernel (cuda/decode_gemm.h), taken while the experts that own rows
# expect at most DECODE_MAX_ROWS_PER_EXPERT each (measured crossover:
# notebooks/results/bench_decode.md); the backward's GEMMs of a decode-tile forward run on the 64 x
# 128 tile. When the most rows one expert can own is known (group_rows: T with distinct experts per
# token), the decode kernel also needs it to be at most DECODE_MAX_GROUP_ROWS: with more rows per
# expert CUTLASS's 64-row tile streams the weights faster (measured: Mixtral at T = 4, 586 vs 535 µs
# per layer). Fine-grained experts (at least DECODE_MANY_EXPERTS) are an exception: there an expert
# rarely owns more than the rows per pass that the expected count asks for, and the decode kernel
# wins while that count is at most DECODE_FINE_MAX_ROWS_PER_EXPERT (Qwen3-30B, whole stack per
# layer: T = 4 107 vs 118 µs, T = 8 160 vs 175; at T = 16, 1.54 rows expected, 254 vs 249;
# notebooks/results/decode_tile_rule_h200.txt. With the rule: DeepSeek-V3 T = 16, 1.27 expected,
# 2162 vs 2194; Qwen3.5 T = 16, 1.16, 898 vs 925; bench_decode_fine_rule*_h200.md).
SMALL_M_TILE, LARGE_M_TILE, DECODE_TILE, MEDIUM_M_TILE = 0, 1, 2, 3
TILES = (SMALL_M_TILE, MEDIUM_M_TILE, LARGE_M_TILE, DECODE_TILE)
TILE_NAMES = {SMALL_M_TILE: "small", MEDIUM_M_TILE: "medium", LARGE_M_TILE: "large", DECODE_TILE: "decode"}
MEDIUM_M_MIN_ROWS_PER_EXPERT = 20
LARGE_M_MIN_ROWS_PER_EXPERT = 512
DECODE_MAX_ROWS_PER_EXPERT = 2.0
DECODE_MAX_GROUP_ROWS = 2
DECODE_MANY_EXPERTS = 64
DECODE_FINE_MAX_ROWS_PER_EXPERT = 1.3
DECODE_MAX_ROWS_PER_PASS = 8
# The products of cuda/grouped_gemm.h (GemmOp).
FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2


def supports_grouped_matmul(config, hidden_size: int, ffn_size: int) -> bool:
    """Whether the CUDA grouped GEMM can run a SwiGLU layer of these sizes for ``config``."""
    return supports_swiglu(config.dtype, hidden_size, ffn_size)


def supports_swiglu(dtype, hidden_size: int, ffn_size: int) -> bool:
    """Whether the CUDA kernels can run a SwiGLU expert of these sizes on rows of this dtype."""
    return (_native.HAS_CUDA and dtype in GROUPED_MATMUL_DTYPES
            and hidden_size % GROUPED_MATMUL_ALIGN == 0 and ffn_size % GROUPED_MATMUL_ALIGN == 0)


def expected_owning_experts(num_rows: int, num_groups: int) -> float:
    """Experts expected to own rows when num_rows rows fall uniformly on num_groups experts (at least
    one, when there are rows)."""
    if num_rows <= 0:
        return 0.0
    owning = num_groups * -math.expm1(num_rows * math.log1p(-1.0 / num_groups)) if num_groups > 1 else 1.0
    return max(owning, 1.0)


def expected_rows_per_expert(num_rows: int, num_groups: int) -> float:
    """Rows each expert that owns any expects when num_rows rows fall uniformly on num_groups experts."""
    return num_rows / max(expected_owning_experts(num_rows, num_groups), 1.0)


def pick_tile(num_rows: int, num_groups: int, group_rows: int | None = None) -> int:
    """The kernel configuration for at most num_rows live rows over num_groups experts.

    group_rows: the most rows one expert can own (T with distinct experts per token), when known:
    the decode kernel is taken only up to DECODE_MAX_GROUP_ROWS of them, or, over at least
    DECODE_MANY_EXPERTS experts, while each owning one expects at most DECODE_FINE_MAX_ROWS_PER_EXPERT.
    """
    expected = expected_rows_per_expert(num_rows, num_groups)
    if expected <= DECODE_MAX_ROWS_PER_EXPERT and (
            group_rows is None or group_rows <= DECODE_MAX_GROUP_ROWS
            or (num_groups >= DECODE_MANY_EXPERTS and expected <= DECODE_FINE_MAX_ROWS_PER_EXPERT)):
        return DECODE_TILE
    rows_per_expert = num_rows / max(1, min(num_groups, num_rows))
    if rows_per_expert >= LARGE_M_MIN_ROWS_PER_EXPERT:
        return LARGE_M_TILE
    return MEDIUM_M_TILE if rows_per_expert >= MEDIUM_M_MIN_ROWS_PER_EXPERT else SMALL_M_TILE


def decode_rows_per_pass(num_rows: int, num_groups: int, group_rows: int | None = None) -> int:
    """The decode kernel's rows per pass over an expert's weights: 1, 2, 4 or 8.

    Enough for group_rows when given and at most DECODE_MAX_GROUP_ROWS (an expert with more rows
    reads its weights again: from HBM when they are larger than L2), else for the rows an owning
    expert expects (fine-grained experts past DECODE_MAX_GROUP_ROWS: the few that own more make
    another pass).
    """
    wanted = (group_rows if group_rows is not None and group_rows <= DECODE_MAX_GROUP_ROWS
              else expected_rows_per_expert(num_rows, num_groups) - 0.1)
    return next(rows for rows in (1, 2, 4, 8) if rows >= wanted or rows == DECODE_MAX_ROWS_PER_PASS)


def backward_workspace(num_groups: int) -> jax.Array:
    """A workspace for the backward's grouped GEMMs (their per-expert arguments).

    The scratch cannot reach a backward pass (it is state, never a residual: a scan would stack it
    per layer), so the backward threads this one through its four GEMMs instead. Inside a scanned
    training step XLA assigns it once, like any temporary of the loop body: a few kilobytes per
    hundred experts, constant in depth.
    """
    words = -(-_native.grouped_matmul_workspace_bytes(num_groups) // 4)
    return jnp.zeros((max(words, 1),), jnp.int32)


def _call(op, a, b, offsets, workspace, out_shape, tile, group_rows=None):
    if tile == DECODE_TILE:  # the decode kernel computes forward products only
        if op == FORWARD:
            return _decode_call(a, b, offsets, out_shape, gated=False, group_rows=group_rows), workspace
        tile = SMALL_M_TILE
    call = jax.ffi.ffi_call(
        _native.GROUPED_MATMUL_TARGET,
        (jax.ShapeDtypeStruct(out_shape, a.dtype), jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={3: 1},
        vmap_method="sequential")
    out, workspace = call(a, b, offsets, workspace, tile=np.int64(tile), op=np.int64(op))
    if op != WEIGHT_GRAD:
        return fence_results((out, workspace))
    # A weight gradient's one user is the scan's stacking of per-layer gradients: left unfenced,
    # XLA:GPU may write it straight into its slice of the stacked gradient (no per-layer copy of a
    # weight-sized buffer). The other results keep the fence (ops.fence_results: results with
    # several users made that rewrite run a call twice).
    return out, fence_results(workspace)


def _decode_call(rows, weights, offsets, out_shape, gated: bool, group_rows=None):
    """The decode kernel: out_shape's rows of ``rows @ weights[g]``, or of SwiGLU's activation."""
    call = jax.ffi.ffi_call(_native.DECODE_MATMUL_TARGET, jax.ShapeDtypeStruct(out_shape, rows.dtype),
                            vmap_method="sequential")
    rows_per_pass = decode_rows_per_pass(out_shape[0], weights.shape[0], group_rows)
    return fence_results(call(rows, weights, offsets, gated=gated, rows_per_pass=np.int64(rows_per_pass)))


def gated_silu(hidden: jax.Array, dtype) -> jax.Array:
    """SwiGLU's activation of the fused [R, 2F] gate/up product, in float32, cast to dtype."""
    gate, up = jnp.split(hidden.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def _swiglu_backward_xla(h, d, w):
    """``swiglu_backward`` as XLA's fusions (the CPU path, and the GPU's for other dtypes)."""
    activated = gated_silu(h, h.dtype)  # rounded as the forward rounded it
    d_act = d.astype(jnp.float32)
    d_w = None
    if w is not None:
        d_w = jnp.sum(activated.astype(jnp.float32) * d_act, axis=-1)
        activated = (activated.astype(jnp.float32) * w[:, None]).astype(h.dtype)
        d_act = d_act * w[:, None]
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_hidden = jnp.concatenate([d_gate, d_act * (gate * sig)], axis=-1).astype(h.dtype)
    return activated, d_hidden, d_w


def swiglu_backward(hidden: jax.Array, d_activated: jax.Array, row_weights: jax.Array | None = None, *,
                    layer=None, offset: int = 0):
    """The SwiGLU activation's backward, with the activation the down weight gradient needs.

    Args:
      hidden: [R, 2F] the forward's gate/up product [gate | up]; d_activated: [R, F] the
        activation's cotangent (hidden's dtype).
      row_weights: optional [R] float32 w_r when the rows' outputs were weighted (w_r * out_r) and
        ``d_activated`` is the cotangent of the unweighted output's activation.
      layer, offset: with layer (an int32 scalar) hidden is a stack [L, ...] whose slice ``layer``
        holds the product at element ``offset`` (``forward_into``'s); the kernel reads it there.

    Returns:
      ``(activated [R, F], d_hidden [R, 2F], d_row_weights [R] float32 or None)``: the activation
      (rounded to hidden's dtype as the forward rounded it), times w_r when weighted; the cotangent of
      hidden for d_activated * w_r; and sum_f activation * d_activated per row when weighted.
      float32 math. On a GPU with bf16 and F a multiple of 8, one CUDA kernel
      (cuda/swiglu_kernels.h); XLA's fusions of the same math otherwise.
    """
    rows, ffn = d_activated.shape
    stacked = layer is not None
    if stacked:
        layer = jnp.asarray(layer, jnp.int32)
        _check_fits_in_slice("swiglu_backward", hidden, offset, (rows, 2 * ffn))

    def fallback(h, d, w, i):
        h = read_from(h, i, (rows, 2 * ffn), offset) if stacked else h
        return _swiglu_backward_xla(h, d, w)

    weighted = row_weights is not None
    weights = row_weights.astype(jnp.float32) if weighted else None
    if hidden.dtype != jnp.bfloat16 or d_activated.dtype != jnp.bfloat16 or ffn % 8:
        return fallback(hidden, d_activated, weights, layer)

    def native(h, d, w, i):
        call = jax.ffi.ffi_call(
            _native.SWIGLU_BACKWARD_TARGET,
            (jax.ShapeDtypeStruct(d.shape, d.dtype), jax.ShapeDtypeStruct((rows, 2 * ffn), h.dtype),
             jax.ShapeDtypeStruct((rows if weighted else 1,), jnp.float32)),
            # In place: each thread reads its vectors of d_activated and hidden before writing
            # activated and d_hidden over them, so the backward allocates neither (d_hidden gets a
            # buffer of its own when hidden is read from a stack).
            input_output_aliases={1: 0} if stacked else {1: 0, 0: 1},
            vmap_method="sequential")
        activated, d_hidden, d_w = call(h, d, w if weighted else jnp.zeros((1,), jnp.float32),
                                        i if stacked else jnp.zeros((), jnp.int32), weighted=weighted,
                                        stacked=stacked, offset=np.int64(offset))
        return activated, d_hidden, d_w if weighted else None

    return _on_cuda(native, fallback, hidden, d_activated, weights, layer)


def _check_fits_in_slice(caller: str, stack, offset: int, shape) -> None:
    """ValueError unless an array of ``shape`` fits at element ``offset`` (a multiple of 8: 16-byte
    aligned for the kernels) of one slice of ``stack`` [L, ...]."""
    slice_size = math.prod(stack.shape[1:])
    if offset % 8 or offset < 0 or offset + math.prod(shape) > slice_size:
        raise ValueError(f"{caller}: offset: expected a multiple of 8 with offset + {shape[0]} x {shape[1]} <= "
                         f"{slice_size} (one slice of the stack), got {offset}")


def _on_cuda(native, fallback, *args):
    """The CUDA custom call when the program is lowered for a GPU, else the fallback (XLA's ops)."""
    if not _native.HAS_CUDA:
        return fallback(*args)
    return lax.platform_dependent(*args, cuda=native, default=fallback)


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


def forward(rows, weights, offsets, workspace, num_rows: int, tile: int, group_rows: int | None = None):
    """``out [num_rows, N]`` = each group's rows [R, K] @ weights[g] [K, N]; zero rows in no group.

    group_rows: the most rows one group can hold, when known (``pick_tile``'s). Returns
    ``(out, workspace)``. No autodiff rule (``grouped_matmul`` has one).
    """
    def fallback(r, w, o, ws):
        return _ragged_dot(r[:num_rows], w, o).astype(r.dtype), ws

    return _on_cuda(lambda r, w, o, ws: _call(FORWARD, r, w, o, ws, (num_rows, w.shape[2]), tile, group_rows),
                    fallback, rows, weights, offsets, workspace)


def gated_forward(rows, gate_up, offsets, workspace, num_rows: int, tile: int, group_rows: int | None = None):
    """``activated [num_rows, F]`` = ``gated_silu`` of each group's rows @ gate_up[g] [K, 2F].

    The gate/up product is rounded to rows' dtype before the activation (float32), as when it is
    stored. With ``DECODE_TILE`` on a GPU the activation is the decode kernel's epilogue (the
    [num_rows, 2F] product is never written); otherwise ``forward`` then ``gated_silu``. Returns
    ``(activated, workspace)``. No autodiff rule.
    """
    if tile != DECODE_TILE or gate_up.shape[2] % 16:
        hidden, workspace = forward(rows, gate_up, offsets, workspace, num_rows, tile, group_rows)
        return gated_silu(hidden, rows.dtype), workspace

    def fallback(r, w, o):
        return gated_silu(_ragged_dot(r[:num_rows], w, o).astype(r.dtype), r.dtype)

    out_shape = (num_rows, gate_up.shape[2] // 2)
    activated = _on_cuda(lambda r, w, o: _decode_call(r, w, o, out_shape, gated=True, group_rows=group_rows),
                         fallback, rows, gate_up, offsets)
    return activated, workspace


def decode_forward_with_shared(rows, weights, offsets, num_rows: int, x, shared_weights, gated: bool,
                               group_rows: int | None = None):
    """The decode kernel's grouped product and a dense one in the same launch: ``(out, shared_out)``.

    out: ``forward`` (``gated_forward`` when gated) with ``DECODE_TILE``: [num_rows, N] (gated:
    [num_rows, N / 2]) from rows [R, K] and weights [El, K, N]. shared_out: the same for x [T, Ks]
    and shared_weights [Ks, Ns], as one more expert owning every row of x: [T, Ns] (gated: [T,
    Ns / 2]). For a shared expert at decode (T of a few tokens), whose own launches are too small to
    keep every SM streaming weights: here its weights stream beside the routed experts'. bf16;
    XLA's products (the same roundings) off CUDA. No autodiff rule.
    """
    op = "decode_forward_with_shared"
    width = 16 if gated else 8  # (N / 2 a multiple of 8 when gated)
    for name, value, ndim in (("rows", rows, 2), ("weights", weights, 3), ("x", x, 2), ("shared_weights", shared_weights, 2)):
        if jnp.ndim(value) != ndim or jnp.dtype(value.dtype) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"{op}: {name}: expected a bf16 array of {ndim} dimensions, got "
                             f"{jnp.dtype(value.dtype).name}{list(jnp.shape(value))}")
    if weights.shape[1] != rows.shape[1] or weights.shape[2] % width or rows.shape[1] % 8:
        raise ValueError(f"{op}: weights: expected [El, K={rows.shape[1]}, N] with K a multiple of 8 and N of "
                         f"{width}, got {list(weights.shape)}")
    if shared_weights.shape[0] != x.shape[1] or shared_weights.shape[1] % width or x.shape[1] % 8 or x.shape[0] < 1:
        raise ValueError(f"{op}: shared_weights: expected [Ks={x.shape[1]}, Ns] for x [T >= 1, Ks] with Ks a multiple "
                         f"of 8 and Ns of {width}, got {list(shared_weights.shape)} (x {list(x.shape)})")
    num_tokens = x.shape[0]
    out_shape = (num_rows, weights.shape[2] // 2 if gated else weights.shape[2])
    shared_shape = (num_tokens, shared_weights.shape[1] // 2 if gated else shared_weights.shape[1])

    def finish(product, dtype):
        return gated_silu(product.astype(dtype), dtype) if gated else product.astype(dtype)

    def fallback(r, w, o, t, sw):
        return (finish(_ragged_dot(r[:num_rows], w, o), r.dtype),
                finish(jnp.dot(t, sw, preferred_element_type=jnp.float32), t.dtype))

    def native(r, w, o, t, sw):
        call = jax.ffi.ffi_call(_native.DECODE_MATMUL_SHARED_TARGET,
                                (jax.ShapeDtypeStruct(out_shape, r.dtype), jax.ShapeDtypeStruct(shared_shape, t.dtype)),
                                vmap_method="sequential")
        # Passes enough for the shared product's T rows as well as the routed experts' groups.
        rows_per_pass = max(decode_rows_per_pass(num_rows, w.shape[0], group_rows),
                            decode_rows_per_pass(num_tokens, 1, num_tokens))
        return fence_results(call(r, w, o, t, sw, gated=gated, rows_per_pass=np.int64(rows_per_pass)))

    return _on_cuda(native, fallback, rows, weights, offsets, x, shared_weights)


def input_grad(d_out, weights, offsets, workspace, num_rows: int, tile: int):
    """``d_rows [num_rows, K]`` = each group's d_out [R, N] @ weights[g]^T; zero rows in no group.

    Returns ``(d_rows, workspace)``, d_rows in d_out's dtype (float32 accumulation).
    """
    def fallback(g, w, o, ws):
        return _ragged_dot(g[:num_rows], w, o, transpose_weights=True).astype(g.dtype), ws

    return _on_cuda(lambda g, w, o, ws: _call(INPUT_GRAD, g, w, o, ws, (num_rows, w.shape[1]), tile),
                    fallback, d_out, weights, offsets, workspace)


def weight_grad(rows, d_out, offsets, workspace, num_groups: int):
    """``d_weights [El, K, N]`` = each group's rows_g^T [K, M_g] @ d_out_g [M_g, N]; zero for empty groups.

    rows [R, K] and d_out [R, N] share their row order (the groups of offsets). Returns
    ``(d_weights, workspace)``, d_weights in rows' dtype (float32 accumulation).
    """
    def fallback(r, g, o, ws):  # the weight gradient alone, not a vjp that also forms d rows
        return _grouped_weight_grad(r, g, _group_sizes(o), num_groups, r.dtype), ws

    return _on_cuda(lambda r, g, o, ws: _call(WEIGHT_GRAD, r, g, o, ws, (num_groups, r.shape[1], g.shape[1]),
                                              LARGE_M_TILE),
                    fallback, rows, d_out, offsets, workspace)


def _into_call(op, a, b, offsets, workspace, stack, layer, tile, out_rows, offset):
    call = jax.ffi.ffi_call(
        _native.GROUPED_MATMUL_INTO_TARGET,
        (jax.ShapeDtypeStruct(stack.shape, stack.dtype), jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={4: 0, 3: 1},
        vmap_method="sequential")
    return fence_results(call(a, b, offsets, workspace, stack, layer, tile=np.int64(tile), op=np.int64(op),
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
    return _on_cuda(native, fallback, rows, d_out, offsets, workspace, stack, layer)


def forward_into(rows, weights, offsets, workspace, num_rows: int, tile: int, stack, layer, offset: int):
    """``forward``'s out [num_rows, N] written flattened at element ``offset`` of slice ``layer`` of
    ``stack`` [L, ...] (``ops.read_from`` gives it back). Returns ``(stack, workspace)``.

    On a GPU with a bf16 stack the GEMM stores into the slice itself (stack aliased in and out; the
    decode tile runs as the 64-row one): a training loop keeps each layer's gate/up product where
    the backward reads it, with no copy. offset: a multiple of 8; the result must fit in a slice.
    """
    layer = jnp.asarray(layer, jnp.int32)
    _check_fits_in_slice("forward_into", stack, offset, (num_rows, weights.shape[2]))

    def fallback(r, w, o, ws, s, i):
        out, ws = forward(r, w, o, ws, num_rows, SMALL_M_TILE if tile == DECODE_TILE else tile)
        return write_into(s, i, out, offset), ws

    def native(r, w, o, ws, s, i):
        return _into_call(FORWARD, r, w, o, ws, s, i, SMALL_M_TILE if tile == DECODE_TILE else tile, num_rows,
                          offset)

    if stack.dtype != rows.dtype:
        return fallback(rows, weights, offsets, workspace, stack, layer)
    return _on_cuda(native, fallback, rows, weights, offsets, workspace, stack, layer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_matmul(rows, weights, offsets, workspace, num_rows, tile):
    return forward(rows, weights, offsets, workspace, num_rows, tile)


def _grouped_matmul_fwd(rows, weights, offsets, workspace, num_rows, tile):
    out = forward(rows, weights, offsets, workspace, num_rows, tile)
    # Copies of this call's live rows and groups (never the scratch's buffers themselves), and a
    # zero-width array that carries rows' row count for free.
    return out, (rows[:num_rows], weights, offsets, jnp.zeros((rows.shape[0], 0), rows.dtype))


def _grouped_matmul_bwd(num_rows, tile, residuals, cotangents):
    rows, weights, offsets, rows_like = residuals
    d_out = cotangents[0].astype(rows.dtype)
    workspace = backward_workspace(weights.shape[0])
    d_rows, workspace = input_grad(d_out, weights, offsets, workspace, num_rows, tile)
    d_weights, _ = weight_grad(rows, d_out, offsets, workspace, weights.shape[0])
    d_rows = jnp.pad(d_rows, ((0, rows_like.shape[0] - num_rows), (0, 0)))
    return d_rows, d_weights.astype(weights.dtype), None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(rows: jax.Array, weights: jax.Array, scratch: MoEScratch, *,
                   num_rows: int | None = None, tile: int | None = None) -> tuple[jax.Array, MoEScratch]:
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
        (None: by ``pick_tile`` from the rows each expert expects). Results agree within rounding.

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
    if tile is None:
        tile = pick_tile(num_rows, scratch.config.num_local_experts)
    elif tile not in TILES:
        raise ValueError(f"grouped_matmul: tile: expected one of {TILES} (gemm.SMALL_M_TILE, MEDIUM_M_TILE, "
                         f"LARGE_M_TILE, DECODE_TILE) or None, got {tile!r}")
    out, workspace = _grouped_matmul(rows, weights, scratch.expert_offsets, scratch.workspace, num_rows, tile)
    return out, scratch.replace(workspace=lax.stop_gradient(workspace))


def fp8_workspace(num_groups: int) -> jax.Array:
    """A workspace for ``fp8_forward`` alone: the FP8 GEMM's per-group arguments (int32 words, left
    unfilled: each call writes them before its GEMM reads them). A scratch's workspace
    (``init_scratch``) has room for them too."""
    return uninitialized((max(1, -(-_native.fp8_grouped_matmul_workspace_bytes(num_groups) // 4)),), jnp.int32)


FP8_TILE_ROWS = (64, 128)  # the FP8 GEMM's CUTLASS row tiles: ping-pong 64, cooperative 128
FP8_SMALL_TILE_MAX_ROWS_PER_GROUP = 32  # measured: notebooks/results/bench_gemm_fp8_tiles_h200.json


def fp8_tile_rows(num_rows: int, num_groups: int) -> int:
    """The FP8 prefill GEMM's row tile for num_rows rows over num_groups experts: 64 while the
    average group holds at most FP8_SMALL_TILE_MAX_ROWS_PER_GROUP rows, else 128. Measured on the
    H200 (gate/up, random routing): 64 rows won at 32 rows per group (DeepSeek-V3 T=1024: 1958 vs
    2221 us) and lost from 64 up (Qwen3-30B T=1024: 166 vs 158; DeepSeek-V3 T=4096: 3733 vs 3351)."""
    return 64 if num_rows <= FP8_SMALL_TILE_MAX_ROWS_PER_GROUP * num_groups else 128


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


def supports_fp8(hidden_size: int, ffn_size: int) -> bool:
    """Whether FP8 experts of these sizes run on the FP8 grouped GEMM (both multiples of 128)."""
    return _native.HAS_CUDA and hidden_size % fp8.BLOCK == 0 and ffn_size % fp8.BLOCK == 0


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


# The FP8 decode kernel (cuda/decode_gemm.h, LaunchFp8DecodeSwiglu): both projections in two
# launches (the rows quantised in each block, SwiGLU in the gate/up epilogue), no quantisation,
# setup or activation kernels between, no workspace. It starts faster than CUTLASS's FP8 path and,
# staging only the rows an expert can own (group_rows), streams as fast up to about 350 MB, so it
# was taken while the owning experts expect at most FP8_DECODE_MAX_ROWS_PER_EXPERT rows and together
# read at most FP8_DECODE_MAX_BYTES of weights (Qwen3-30B at T = 16, then a tie, stayed on CUTLASS).
# Measured on the H200, kernel times per call, decode kernel vs CUTLASS: DeepSeek-V3's experts at T = 1, 352 MB, 111 vs 119 us, and at T =
# 2, 680 MB, 205 vs 195; Mixtral's two at T = 1, 352 MB, 111 vs 130; Qwen3.5-397B's at T = 1, 126
# MB, 50 vs 65; Qwen3-30B's at T = 1, 22 vs 33, and at T = 16, 382 MB, 124 vs 123; DeepSeek-V3's
# shared expert at T = 1, 44 MB, 24 vs 44, at T = 4, 32 vs 44, at T = 16, 75 vs 44
# (notebooks/results/fp8_decode_staged_rows_h200.md, python -m jax_moe.bench.fp8_decode_probe).
# A shared expert then streams in the same launches (fp8_decode_swiglu_with_shared).
# Since the decode kernels read their weights evict-first (notebooks/results/decode_evict_first_h100.md),
# it also wins past 360 MB where the owning experts expect at most
# FP8_DECODE_LARGE_MAX_ROWS_PER_EXPERT rows, up to FP8_DECODE_LARGE_MAX_BYTES. Measured on an H100,
# µs per layer of the FP8 stack, CUTLASS vs decode kernel: DeepSeek-V3 at T = 2 (684 MB, 1.03 rows an
# expert) 338 vs 311, at T = 4 (1.33 GB) 576 vs 539; Mixtral at T = 2 (583 MB, 1.21) 301 vs 284, at T = 4
# (925 MB, 1.52) 400 vs 378; Qwen3.5-397B at T = 4 (485 MB) 257 vs 231, at T = 8 (933 MB) 433 vs 401;
# Qwen3-30B at T = 16 (383 MB, 1.58) 198 vs 194. Not taken: Mixtral at T = 8 (1.24 GB, 2.27 rows an
# expert) 449 vs 461, slower; Qwen3-30B at T = 32 (523 MB, 2.31) 244 vs 237, which the rows bound
# leaves on CUTLASS.
FP8_DECODE_MAX_ROWS_PER_EXPERT = 4.0
FP8_DECODE_MAX_BYTES = 360e6
FP8_DECODE_LARGE_MAX_ROWS_PER_EXPERT = 2.0
FP8_DECODE_LARGE_MAX_BYTES = 1.4e9
FP8_DECODE_MAX_K = 16384
FP8_DECODE_ROWS_PER_PASS = (8, 16)


def fp8_decode_rows(num_rows: int, num_groups: int, hidden_size: int, ffn_size: int) -> int:
    """``fp8_swiglu_forward``'s kernel for num_rows live rows over num_groups experts of sizes H, F:
    the FP8 decode kernel's rows per pass over an expert's weights (8; 16 only when asked), or 0
    for the CUTLASS FP8 grouped GEMM (more rows per expert or more bytes than the limits above, or
    H or F past FP8_DECODE_MAX_K)."""
    weight_bytes = expected_owning_experts(num_rows, num_groups) * 3 * hidden_size * ffn_size
    rows_per_expert = expected_rows_per_expert(num_rows, num_groups)
    if rows_per_expert > FP8_DECODE_MAX_ROWS_PER_EXPERT or max(hidden_size, ffn_size) > FP8_DECODE_MAX_K:
        return 0
    if weight_bytes > FP8_DECODE_MAX_BYTES and (weight_bytes > FP8_DECODE_LARGE_MAX_BYTES
                                                or rows_per_expert > FP8_DECODE_LARGE_MAX_ROWS_PER_EXPERT):
        return 0
    return 8


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
    tile_rows = fp8_tile_rows(num_rows, num_groups) if tile_rows is None else tile_rows
    if tile_rows not in FP8_TILE_ROWS:
        raise ValueError(f"{op}: tile_rows: expected one of {FP8_TILE_ROWS} or None, got {tile_rows!r}")
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
        decode_rows = fp8_decode_rows(num_rows, num_groups, hidden_size, two_f // 2)
    elif decode_rows not in (0,) + FP8_DECODE_ROWS_PER_PASS:
        raise ValueError(f"{op}: decode_rows: expected 0 (the CUTLASS GEMMs), one of {FP8_DECODE_ROWS_PER_PASS} "
                         f"(the decode kernel's rows per pass) or None, got {decode_rows!r}")
    elif decode_rows and max(hidden_size, two_f // 2) > FP8_DECODE_MAX_K:
        raise ValueError(f"{op}: decode_rows: the decode kernel takes H and F up to {FP8_DECODE_MAX_K}, "
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
    return _on_cuda(native, fallback, *operands)


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

    return _on_cuda(native, fallback, q_rows, row_scale, gate_up, gate_up_scale, down, down_scale, offsets, workspace)


FP8_DECODE_MAX_SHARED_ROWS = 16  # tokens a shared expert takes in the decode kernel's launches


def fp8_decode_swiglu_with_shared(rows, gate_up, gate_up_scale, down, down_scale, offsets, num_rows: int, x,
                                  shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                                  group_rows: int | None = None):
    """``fp8_swiglu_forward`` on the FP8 decode kernel (8 rows a pass) with a shared expert's FP8
    SwiGLU on the tokens x [T, H] streaming in the same two launches, as one more group owning
    every row of x: ``(routed [num_rows, H], shared [T, H])``, both bf16, each the same bits as a
    call of its own. The shared weights are [2Fs, H] and [H, Fs] float8_e4m3fn with their
    [out/128, in/128] float32 scales (``fp8.SHARED_QUANTIZED_NAMES``); T from 1 to
    FP8_DECODE_MAX_SHARED_ROWS. Off CUDA, both on ``fp8_swiglu_dequantized``. No autodiff rule."""
    op = "fp8_decode_swiglu_with_shared"
    _check_fp8_forward(rows, gate_up, gate_up_scale, offsets, num_rows, op, ("rows", "gate_up", "gate_up_scale"))
    hidden_size, ffn_size = rows.shape[1], jnp.shape(down)[-1]
    num_tokens = x.shape[0] if x.ndim == 2 else 0
    if x.ndim != 2 or x.shape[1] != hidden_size or x.dtype != rows.dtype or not 1 <= num_tokens <= FP8_DECODE_MAX_SHARED_ROWS:
        raise ValueError(f"{op}: x: expected [T, H={hidden_size}] of the rows' dtype {rows.dtype} with T from 1 to "
                         f"{FP8_DECODE_MAX_SHARED_ROWS}, got {x.dtype}{list(x.shape)}")
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
    if max(hidden_size, ffn_size, shared_ffn) > FP8_DECODE_MAX_K or shared_ffn % fp8.BLOCK:
        raise ValueError(f"{op}: expected H, F and Fs multiples of {fp8.BLOCK} up to {FP8_DECODE_MAX_K}, got "
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
    return _on_cuda(native, fallback, *operands)


def fp8_forward(rows, weights_nk, scale_nk, offsets, workspace, num_rows: int, tile_rows: int | None = None):
    """``[num_rows, N]`` bf16: each expert's rows, quantised per 1 x 128 group of a row
    (``fp8.quantize_rows``), times its FP8 weights, on Hopper's FP8 tensor cores (CUTLASS's
    blockwise-scaled grouped GEMM, float32 accumulation); rows in no group are zero. At every row
    count: at decode it streams the FP8 weights near the copy rate (one H200, DeepSeek-V3's gate/up
    at T=1: 66 us for 235 MB).

    Args:
      rows: [R >= num_rows, K] bf16 grouped by expert (``permute``'s layout).
      weights_nk: [El, N, K] float8_e4m3fn, the checkpoint's [out, in] layout (FP8 wgmma reads both
        operands K-major); scale_nk: [El, N/128, K/128] float32 (DeepSeek-V3's weight_scale_inv).
      offsets: [El + 1] int32 expert offsets; workspace: ``fp8_workspace(El)``, threaded through.
      num_rows: static row count of the result (the live-row bound).
      tile_rows: 64 or 128, the CUTLASS row tile (default ``fp8_tile_rows``; the math is the same).

    Returns ``(out, workspace)``. Off CUDA (or for shapes it does not take: K or N not a multiple of
    128, rows not bf16) ``fp8_dequantized_matmul``. No autodiff rule (``experts`` gives the layer's).
    """
    _check_fp8_forward(rows, weights_nk, scale_nk, offsets, num_rows)
    num_groups, n, k = weights_nk.shape
    if tile_rows is None:
        tile_rows = fp8_tile_rows(num_rows, num_groups)
    elif tile_rows not in FP8_TILE_ROWS:
        raise ValueError(f"fp8_forward: tile_rows: expected one of {FP8_TILE_ROWS} or None, got {tile_rows!r}")

    def fallback(r, w, s, o, ws):
        return fp8_dequantized_matmul(r, w, s, o, num_rows), ws

    def native(r, w, s, o, ws):
        return _fp8_grouped_matmul_call(r, w, s, o, ws, num_rows, tile_rows)[:2]

    if not (rows.dtype == jnp.bfloat16 and k % fp8.BLOCK == 0 and n % fp8.BLOCK == 0):
        return fallback(rows, weights_nk, scale_nk, offsets, workspace)
    return _on_cuda(native, fallback, rows, weights_nk, scale_nk, offsets, workspace)
