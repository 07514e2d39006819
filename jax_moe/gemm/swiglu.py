"""SwiGLU's activation between the gate/up and down GEMMs, and its backward (a CUDA kernel on GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _ffi, _native
from jax_moe._ffi import read_from


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
        _ffi.check_fits_in_slice("swiglu_backward", hidden, offset, (rows, 2 * ffn))

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

    return _ffi.on_cuda(native, fallback, hidden, d_activated, weights, layer)
