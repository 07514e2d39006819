"""Block-scaled FP8 expert weights: DeepSeek-V3's checkpoint format, kept as FP8 in memory.

A weight [..., K, N] is stored as ``float8_e4m3fn`` values q and a float32 ``scale_inv``
[..., ceil(K/128), ceil(N/128)], one per 128 x 128 block, with ``w = q * scale_inv`` (DeepSeek-V3's
``weight`` and ``weight_scale_inv``, transposed to our [in, out] layout). In the params the
experts' scales sit next to their weights as ``gate_up_scale_inv`` and ``down_scale_inv``.

The math of an FP8 expert layer: the weights are dequantised (q * scale_inv, in float32, then
rounded to the rows' dtype) and multiplied with the rows as they are (bf16, float32 accumulation);
activations are not quantised. On a GPU at decode sizes (``gemm.fp8_decode_plan``) the decode
kernel reads the FP8 bytes and multiplies each exact q with the row value times scale_inv in
float32 (never rounding the weight to bf16, so it differs from the dequantised weights' product by
bf16 rounding), so a step reads half the bytes of bf16 experts. Elsewhere (CPU; GPU prefill) each
layer dequantises its experts, then runs the bf16 experts: FP8 params halve the experts' memory (a
DeepSeek-V3 checkpoint loads as stored), but such a step is slower than bf16, since the
dequantised copy of every expert of the layer is written and read once per step.

``gemm.fp8_prefill_forward`` is the FP8 tensor-core grouped GEMM for prefill (the rows quantised by
``quantize_rows``); it reads the checkpoint's [El, N, K] layout, which FP8 wgmma needs, so the
layers (whose FP8 params are [K, N] for the decode kernel) do not use it yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INV_FP8_MAX = np.float32(1.0) / np.float32(FP8_MAX)  # rounded once, as the CUDA kernels' 1.0f / 448.0f
SCALE_SUFFIX = "_scale_inv"
QUANTIZED_NAMES = ("gate_up", "down")


def num_blocks(size: int) -> int:
    """Scale blocks along an axis of this size: ceil(size / 128)."""
    return -(-size // BLOCK)


def _expand(scale_inv: jax.Array, k: int, n: int) -> jax.Array:
    """[..., Kb, Nb] -> [..., K, N]: each block's scale over its 128 x 128 elements."""
    full = jnp.repeat(jnp.repeat(scale_inv, BLOCK, axis=-2), BLOCK, axis=-1)
    return full[..., :k, :n]


def quantize(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q [..., K, N] float8_e4m3fn, scale_inv [..., ceil(K/128), ceil(N/128)] float32)``.

    Each 128 x 128 block is scaled so its largest magnitude maps to 448 (e4m3's largest finite
    value) and rounded to nearest; an all-zero block gets scale 1. ``dequantize`` inverts it to
    within e4m3's rounding: |w - q * scale_inv| <= 2**-4 * |w| + 2**-10 * scale_inv per element
    (3 mantissa bits; the second term covers subnormals).
    """
    k, n = weights.shape[-2:]
    w = weights.astype(jnp.float32)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, num_blocks(k) * BLOCK - k), (0, num_blocks(n) * BLOCK - n)]
    padded = jnp.pad(w, pad)
    blocks = padded.reshape(*w.shape[:-2], num_blocks(k), BLOCK, num_blocks(n), BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale_inv = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(w / _expand(scale_inv, k, n), -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale_inv


def dequantize(q: jax.Array, scale_inv: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q * scale_inv`` block by block, in float32, then cast to dtype: [..., K, N]."""
    k, n = q.shape[-2:]
    return (q.astype(jnp.float32) * _expand(scale_inv, k, n)).astype(dtype)


def quantize_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations for the FP8 prefill GEMM: rows [R, K] (K a multiple of 128) ->
    ``(q [R, K] float8_e4m3fn, scale [R, K/128] float32)``, per 1 x 128 group of each row.

    scale = max |x| * (1 / 448) (1 for an all-zero group) and q = x * (1 / scale) rounded to
    nearest, saturating at 448: each step one IEEE float32 operation, so the CUDA kernel
    (``cuda/grouped_gemm_fp8.cu``, QuantizeRows) writes the same bytes. (Written with a reciprocal
    because XLA's CPU backend turns ``x / y`` into a multiply by an approximate reciprocal.)
    """
    r, k = rows.shape
    groups = rows.astype(jnp.float32).reshape(r, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(groups * (1.0 / scale)[..., None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(r, k)
    return q, scale


def dequantize_rows(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``quantize_rows``' inverse to within e4m3 rounding: [R, K] of dtype."""
    r, k = q.shape
    return (q.astype(jnp.float32).reshape(r, k // BLOCK, BLOCK) * scale[..., None]).reshape(r, k).astype(dtype)


def is_quantized(params: dict) -> bool:
    """Whether the (layer or stacked) params carry FP8 experts (``gate_up_scale_inv``)."""
    return isinstance(params, dict) and "gate_up" + SCALE_SUFFIX in params


def quantize_params(params: dict) -> dict:
    """The params with ``gate_up`` and ``down`` quantised to FP8 and their ``*_scale_inv`` added;
    every other leaf as it is. Stacked or one layer's."""
    out = dict(params)
    for name in QUANTIZED_NAMES:
        out[name], out[name + SCALE_SUFFIX] = quantize(params[name])
    return out


def expert_weights(layer_params: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """``(gate_up, down)`` in dtype: dequantised when the params carry FP8 experts (then constants
    to autodiff)."""
    if not is_quantized(layer_params):
        return layer_params["gate_up"].astype(dtype), layer_params["down"].astype(dtype)
    # FP8 weights are for inference: no gradient reaches them or their scales.
    return tuple(dequantize(jax.lax.stop_gradient(layer_params[name]),
                            jax.lax.stop_gradient(layer_params[name + SCALE_SUFFIX]), dtype)
                 for name in QUANTIZED_NAMES)
