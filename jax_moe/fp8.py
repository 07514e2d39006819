"""Block-scaled FP8 expert weights: DeepSeek-V3's checkpoint format, kept as FP8 in memory.

A Linear weight [out, in] is stored as ``float8_e4m3fn`` values q and a float32 ``scale_inv``
[ceil(out/128), ceil(in/128)], one per 128 x 128 block, with ``w = q * scale_inv`` (DeepSeek-V3's
``weight`` and ``weight_scale_inv``). FP8 experts keep that [out, in] layout in the params, because
Hopper's FP8 tensor cores read both operands along K: ``gate_up`` [El, 2F, H] (gate rows first)
and ``down`` [El, H, F], with ``gate_up_scale_inv`` [El, 2F/128, H/128] and ``down_scale_inv``
[El, H/128, F/128] next to them (bf16 experts are [El, H, 2F] and [El, F, H]). H and F must be
multiples of 128. A shared expert may be FP8 too, the same way without the expert axis:
``shared_gate_up`` [2Fs, H] and ``shared_down`` [H, Fs] with their ``*_scale_inv`` (DeepSeek-V3's
checkpoint stores it so).

The math of an FP8 expert layer (DeepSeek-V3's inference recipe): the rows entering each
projection are quantised per 1 x 128 group of a row (``quantize_rows``), both operands are
dequantised exactly, and the product is accumulated in float32 and rounded to the rows' dtype;
SwiGLU's activation between the projections is float32, rounded to the rows' dtype.
``gemm.fp8_swiglu_forward`` runs both projections on the GPU in one call (CUTLASS's
blockwise-scaled FP8 grouped GEMM, or for small decode reads the FP8 decode kernel of
``cuda/fp8_decode_gemm_kernels.h``; ``gemm.fp8_forward`` is one projection on CUTLASS) and elsewhere as
``gemm.fp8_swiglu_dequantized``. Gradients reach the rows only, as if
the quantisation of the rows were the identity (FP8 experts are for inference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _native

BLOCK = _native.constants.FP8_BLOCK  # the weights' scale blocks are BLOCK x BLOCK, the rows' 1 x BLOCK
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INV_FP8_MAX = np.float32(1.0) / np.float32(FP8_MAX)  # rounded once, as the CUDA kernels' 1.0f / 448.0f
SCALE_SUFFIX = "_scale_inv"
QUANTIZED_NAMES = ("gate_up", "down")
SHARED_QUANTIZED_NAMES = ("shared_gate_up", "shared_down")


def num_blocks(size: int) -> int:
    """Scale blocks along an axis of this size: ceil(size / 128)."""
    return -(-size // BLOCK)


def _expand(scale_inv: jax.Array, k: int, n: int) -> jax.Array:
    """[..., Kb, Nb] -> [..., K, N]: each block's scale over its 128 x 128 elements."""
    full = jnp.repeat(jnp.repeat(scale_inv, BLOCK, axis=-2), BLOCK, axis=-1)
    return full[..., :k, :n]


def quantize(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q [..., R, C] float8_e4m3fn, scale_inv [..., ceil(R/128), ceil(C/128)] float32)``, blocks of
    the last two axes (a Linear weight's [out, in]).

    Each 128 x 128 block is scaled so its largest magnitude maps to 448 (e4m3's largest finite
    value) and rounded to nearest; an all-zero block gets scale 1. ``dequantize`` inverts it to
    within e4m3's rounding: |w - q * scale_inv| <= 2**-4 * |w| + 2**-10 * scale_inv per element
    (3 mantissa bits; the second term covers subnormals). Jitted, so a layer's experts are read
    twice and written once as FP8, with no float32 copy of them (DeepSeek-V3's layer: 22 GB of bf16).
    """
    if jnp.ndim(weights) < 2 or not jnp.issubdtype(jnp.result_type(weights), jnp.floating):
        raise ValueError(f"quantize: weights: expected a floating array [..., R, C], got "
                         f"{jnp.result_type(weights)}{list(jnp.shape(weights))}")
    return _quantize(weights)


@jax.jit
def _quantize(weights):
    rows, cols = weights.shape[-2:]
    lead = weights.shape[:-2]
    pad = [(0, 0)] * len(lead) + [(0, num_blocks(rows) * BLOCK - rows), (0, num_blocks(cols) * BLOCK - cols)]
    blocks = jnp.pad(weights, pad).reshape(*lead, num_blocks(rows), BLOCK, num_blocks(cols), BLOCK)
    amax = jnp.max(jnp.abs(blocks.astype(jnp.float32)), axis=(-3, -1))
    scale_inv = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(blocks.astype(jnp.float32) / scale_inv[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8)
    q = q.reshape(*lead, num_blocks(rows) * BLOCK, num_blocks(cols) * BLOCK)[..., :rows, :cols]
    return q, scale_inv


def dequantize(q: jax.Array, scale_inv: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``q * scale_inv`` block by block, in float32, then cast to dtype: [..., R, C] as q."""
    if jnp.ndim(q) < 2:
        raise ValueError(f"dequantize: q: expected [..., R, C], got shape {jnp.shape(q)}")
    k, n = q.shape[-2:]
    want = (*q.shape[:-2], num_blocks(k), num_blocks(n))
    if jnp.shape(scale_inv) != want:
        raise ValueError(f"dequantize: scale_inv: expected shape {want} [..., ceil(R/128), ceil(C/128)] for q of "
                         f"shape {jnp.shape(q)}, got {jnp.shape(scale_inv)}")
    return (q.astype(jnp.float32) * _expand(scale_inv, k, n)).astype(dtype)


def _check_rows(op: str, name: str, rows) -> None:
    if jnp.ndim(rows) != 2 or jnp.shape(rows)[1] % BLOCK:
        raise ValueError(f"{op}: {name}: expected [R, K] with K a multiple of {BLOCK}, got shape {jnp.shape(rows)}")


def quantize_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations for the FP8 prefill GEMM: rows [R, K] (K a multiple of 128) ->
    ``(q [R, K] float8_e4m3fn, scale [R, K/128] float32)``, per 1 x 128 group of each row.

    scale = max |x| * (1 / 448) (1 for an all-zero group) and q = x * (1 / scale) rounded to
    nearest, saturating at 448: each step one IEEE float32 operation, so the CUDA kernel
    (``cuda/fp8_gemm_kernels.cu``, QuantizeRows) writes the same bytes. (Written with a reciprocal
    because XLA's CPU backend turns ``x / y`` into a multiply by an approximate reciprocal.)
    """
    _check_rows("quantize_rows", "rows", rows)
    r, k = rows.shape
    groups = rows.astype(jnp.float32).reshape(r, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(groups * (1.0 / scale)[..., None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(r, k)
    return q, scale


def dequantize_rows(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``quantize_rows``' inverse to within e4m3 rounding: [R, K] of dtype."""
    _check_rows("dequantize_rows", "q", q)
    r, k = q.shape
    if jnp.shape(scale) != (r, k // BLOCK):
        raise ValueError(f"dequantize_rows: scale: expected shape {(r, k // BLOCK)} [R, K/128], got {jnp.shape(scale)}")
    return (q.astype(jnp.float32).reshape(r, k // BLOCK, BLOCK) * scale[..., None]).reshape(r, k).astype(dtype)


def is_quantized(params: dict) -> bool:
    """Whether the (layer or stacked) params carry FP8 experts (``gate_up_scale_inv``)."""
    return isinstance(params, dict) and "gate_up" + SCALE_SUFFIX in params


def shared_is_quantized(params: dict) -> bool:
    """Whether the (layer or stacked) params carry an FP8 shared expert (``shared_gate_up_scale_inv``)."""
    return isinstance(params, dict) and "shared_gate_up" + SCALE_SUFFIX in params


def quantize_params(params: dict, shared: bool = True) -> dict:
    """The params with ``gate_up`` and ``down`` quantised to FP8 in the [out, in] layout (transposed
    from the bf16 experts' [in, out]) and their ``*_scale_inv`` added, and so the shared expert's
    ``shared_gate_up`` and ``shared_down`` when the params have one and ``shared`` (DeepSeek-V3's
    recipe quantises every Linear but the router); every other leaf as it is. Stacked or one layer's
    (or a part of them: the leaves it has)."""
    out = dict(params)
    names = QUANTIZED_NAMES + (SHARED_QUANTIZED_NAMES if shared else ())
    for name in (name for name in names if name in params):
        out[name], out[name + SCALE_SUFFIX] = quantize(jnp.swapaxes(params[name], -1, -2))
    return out


def expert_weights(layer_params: dict, dtype, names: tuple[str, str] = QUANTIZED_NAMES) -> tuple[jax.Array, jax.Array]:
    """``(gate_up [..., H, 2F], down [..., F, H])`` in dtype: the bf16 experts' layout, dequantised and
    transposed when the params carry them as FP8 (then constants to autodiff). ``names``: the routed
    experts' leaves, or ``SHARED_QUANTIZED_NAMES`` for the shared expert's."""
    if names[0] + SCALE_SUFFIX not in layer_params:
        return tuple(layer_params[name].astype(dtype) for name in names)
    # FP8 weights are for inference: no gradient reaches them or their scales.
    return tuple(jnp.swapaxes(dequantize(jax.lax.stop_gradient(layer_params[name]),
                                         jax.lax.stop_gradient(layer_params[name + SCALE_SUFFIX]), dtype), -1, -2)
                 for name in names)


def ffn_size(layer_params: dict) -> int:
    """F of the (layer or stacked) params: ``down`` is [..., F, H], or [..., H, F] when FP8."""
    return layer_params["down"].shape[-1 if is_quantized(layer_params) else -2]


def straight_through_rows(rows: jax.Array) -> jax.Array:
    """``dequantize_rows(*quantize_rows(rows))`` in float32, with the identity's gradient (the
    quantisation is a constant offset to autodiff): the FP8 GEMM's view of its rows [R, K]."""
    exact = rows.astype(jnp.float32)
    return exact + jax.lax.stop_gradient(dequantize_rows(*quantize_rows(rows)) - exact)
