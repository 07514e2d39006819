"""The bf16 decode kernel: a CUDA-core GEMM that streams each active expert's weights once over all
SMs for a few rows an expert (no setup kernel), optionally folding SwiGLU's activation into the
gate/up product, and optionally streaming a dense (shared) expert's weights in the same launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _ffi, _native, plan
from jax_moe._ffi import fence_results
from jax_moe.gemm.grouped_dot import _ragged_dot
from jax_moe.gemm.swiglu import gated_silu


def _decode_call(rows, weights, offsets, out_shape, gated: bool, rows_per_pass: int):
    """The decode kernel: out_shape's rows of ``rows @ weights[g]``, or of SwiGLU's activation,
    ``rows_per_pass`` rows of an expert per pass over its weights (``plan.decode_rows_per_pass``)."""
    if not 1 <= rows_per_pass <= plan.DECODE_MAX_ROWS_PER_PASS:
        raise ValueError(f"decode kernel: rows_per_pass: expected 1..{plan.DECODE_MAX_ROWS_PER_PASS}, "
                         f"got {rows_per_pass!r}")
    call = jax.ffi.ffi_call(_native.DECODE_MATMUL_TARGET, jax.ShapeDtypeStruct(out_shape, rows.dtype),
                            vmap_method="sequential")
    return fence_results(call(rows, weights, offsets, gated=gated, rows_per_pass=np.int64(rows_per_pass)))


def decode_forward_with_shared(rows, weights, offsets, num_rows: int, x, shared_weights, gated: bool,
                               rows_per_pass: int):
    """The decode kernel's grouped product and a dense one in the same launch: ``(out, shared_out)``.

    out: ``forward`` (``gated_forward`` when gated) with ``DECODE_TILE``: [num_rows, N] (gated:
    [num_rows, N / 2]) from rows [R, K] and weights [El, K, N]. shared_out: the same for x [T, Ks]
    and shared_weights [Ks, Ns], as one more expert owning every row of x: [T, Ns] (gated: [T,
    Ns / 2]). For a shared expert at decode (T of a few tokens), whose own launches are too small to
    keep every SM streaming weights: here its weights stream beside the routed experts'.
    rows_per_pass: enough for the routed groups and the shared expert's T rows. bf16;
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
        return fence_results(call(r, w, o, t, sw, gated=gated, rows_per_pass=np.int64(rows_per_pass)))

    return _ffi.on_cuda(native, fallback, rows, weights, offsets, x, shared_weights)
