"""permute / unpermute: the routing contract, the FFI custom calls, their autodiff and vmap rules.

The contract (CUDA, the C++ CPU twin and ``jax_moe.reference`` agree on it bit for bit):

- A route (t, j) of ``topk_ids`` [T, k] is *dropped* when its id is < 0, >= E, or mapped to -1 by
  ``config.expert_map``: never copied, never read, contributing exactly 0. Not an error.
- ``permute`` writes, per local expert e, its kept routes' rows ``x[t]`` consecutively from
  ``expert_offsets[e]``, in ascending flat route order ``t*k + j`` (a stable grouping, as
  ``argsort(local_id, stable=True)``); segments are padded with zero rows to ``config.align``.
  ``group_sizes`` [El] and ``expert_offsets`` [El + 1] (its exclusive prefix sum; the last entry is
  the live row count, known only on the device), ``src_index`` [R_cap] (each row's flat route, -1
  for padding and past the live rows) and ``dest_index`` [T_max, k] (each route's row, -1 when
  dropped) go with the rows into the scratch. Rows past the live count are unspecified.
- ``unpermute`` gives ``out[t] = sum over kept j of w[t, j] * y[dest_index[t, j]]``, accumulated in
  float32 in ascending j as ``acc = acc + f32(w * y)`` (product and sum each rounded, no fused
  multiply-add), rounded once to y's dtype; a token with every route dropped gets zeros.
- Every misuse is a ``ValueError`` at trace time naming the argument, the expected and the actual
  value (``jax_moe._validate``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _ffi, _native, _validate, fp8, reference
from jax_moe.scratch import BUFFER_NAMES, MoEScratch
from jax_moe.tuning import DEFAULT_TUNING

# Operand i of the permute call is written in place as result o: the scratch buffers follow the
# three inputs (x, topk_ids, expert_map), in BUFFER_NAMES order.
_PERMUTE_ALIASES = {3 + i: i for i in range(len(BUFFER_NAMES))}

def _permute_call(target: str, x, ids, scratch: MoEScratch, extra_results=(), extra_operands=(), **attributes):
    """A permute-shaped custom call (``jax_moe_permute``, ``jax_moe_permute_fp8``,
    ``jax_moe_permute_prefetch``): ``(scratch, *extra)``, the scratch buffers written in place, then
    the results of ``extra_results`` shapes. ``extra_operands`` follow the scratch buffers."""
    config = scratch.config
    buffers = scratch.buffers()
    call = jax.ffi.ffi_call(
        target,
        tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers) + tuple(extra_results),
        input_output_aliases=_PERMUTE_ALIASES,
        vmap_method=_ffi.VMAP_METHOD)
    # The identity map is an attribute (no per-route lookup), its operand a 1-element placeholder:
    # an empty operand crashed jaxlib 0.11.2's compiler inside a shard_map over 2+ GPUs.
    identity = config.expert_map is None
    expert_map = np.zeros((1,), np.int32) if identity else config.expert_map_array()
    outputs = _ffi.fence_results(call(x, ids, jnp.asarray(expert_map), *buffers, *extra_operands,
                                 align=np.int64(config.align), identity_map=np.bool_(identity), **attributes))
    return (scratch.replace(**dict(zip(BUFFER_NAMES, outputs))), *outputs[len(buffers):])


def _permute_native(x, ids, scratch: MoEScratch) -> MoEScratch:
    return _permute_call(_native.PERMUTE_TARGET, x, ids, scratch)[0]


def _unpermute_native(y, topk_weights, dest_index):
    call = jax.ffi.ffi_call(
        _native.UNPERMUTE_TARGET,
        jax.ShapeDtypeStruct((topk_weights.shape[0], y.shape[1]), y.dtype),
        vmap_method=_ffi.VMAP_METHOD)
    return _ffi.fence_results(call(y, topk_weights, dest_index))


def _unpermute_any(y, topk_weights, dest_index):
    return _ffi.on_platform(_unpermute_native, reference.unpermute_unchecked, y, topk_weights, dest_index)


@jax.custom_vjp
def _permute(x, ids, scratch):
    return _ffi.on_platform(_permute_native, reference.permute_unchecked, x, ids, scratch)


def _permute_fwd(x, ids, scratch):
    out = _permute(x, ids, scratch)
    # Residual: only this call's [T, k] slice of dest_index, never a scratch buffer itself
    # (scan would stack it per layer, and the next layer overwrites it in place).
    return out, out.dest_index[:x.shape[0]]


def permute_grad(d_permuted: jax.Array, dest: jax.Array) -> jax.Array:
    """permute's backward: d x [T, H] from d permuted [R, H] and the call's dest [T, k] (no checks).

    d x[t] = sum over kept j of d permuted[dest[t, j]]: an unpermute with unit weights.
    """
    return _unpermute_any(d_permuted, jnp.ones(dest.shape, jnp.float32), dest)


def _permute_bwd(dest, cotangent: MoEScratch):
    return permute_grad(cotangent.permuted, dest), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _permute_prefetching(x, ids, scratch, weights, nbytes: int):
    def native(x, ids, scratch, weights):
        return _permute_call(_native.PERMUTE_PREFETCH_TARGET, x, ids, scratch, extra_operands=(weights,),
                             prefetch_bytes=np.int64(nbytes))[0]

    def plain(x, ids, scratch, weights):
        return _permute(x, ids, scratch)

    if not _native.HAS_CUDA or nbytes == 0:
        return plain(x, ids, scratch, weights)
    return lax.platform_dependent(x, ids, scratch, weights, cuda=native, default=plain)


def _permute_prefetching_fwd(x, ids, scratch, weights, nbytes):
    out = _permute_prefetching(x, ids, scratch, weights, nbytes)
    return out, out.dest_index[:x.shape[0]]


def _permute_prefetching_bwd(nbytes, dest, cotangent: MoEScratch):
    return permute_grad(cotangent.permuted, dest), None, None, None


_permute_prefetching.defvjp(_permute_prefetching_fwd, _permute_prefetching_bwd)


def _unpermute_grad_native(d_out, y, topk_weights, dest, src):
    call = jax.ffi.ffi_call(
        _native.UNPERMUTE_GRAD_TARGET,
        (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(topk_weights.shape, jnp.float32)),
        vmap_method=_ffi.VMAP_METHOD)
    return _ffi.fence_results(call(d_out, y, topk_weights, dest, src))


def invert_dest(dest: jax.Array, num_rows: int) -> jax.Array:
    """[num_rows] int32 flat route of each row that a route of ``dest`` [T, k] points at, else -1.

    The rows' ``src_index`` for unpermute's backward, which keeps no scratch buffer, by one scatter.
    """
    flat = jnp.arange(dest.size, dtype=jnp.int32)
    rows = jnp.where(dest.reshape(-1) >= 0, dest.reshape(-1), num_rows)  # dropped: out of range
    return jnp.full((num_rows,), -1, jnp.int32).at[rows].set(flat, mode="drop")


def rows_by_route(xs: tuple[jax.Array, ...], dest: jax.Array, src: jax.Array) -> tuple[jax.Array, ...]:
    """permute's rows again, for each array: [num_rows, H] from x [T, H], the call's dest [T, k]
    and its inverse src = ``invert_dest(dest, num_rows)`` (no checks).

    Row dest[t, j] is x[t], i.e. row r is x[src[r] // k]; every row no route points at (src -1:
    align padding, rows past the live ones) is zero. Lets a backward recompute the rows instead of
    keeping them. On a GPU, up to four arrays of one shape and dtype with 16-byte rows take one
    kernel (``jax_moe_gather_rows``) that reads each token's row once and stores it to its k rows;
    XLA's gather otherwise.
    """
    top_k = dest.shape[1]

    def fallback(dest, src, *xs):
        token = jnp.maximum(src, 0) // top_k
        return tuple(jnp.where((src >= 0)[:, None], x[token], jnp.zeros((), x.dtype)) for x in xs)

    def native(dest, src, *xs):
        call = jax.ffi.ffi_call(_native.GATHER_ROWS_TARGET,
                                tuple(jax.ShapeDtypeStruct((src.shape[0], x.shape[1]), x.dtype) for x in xs),
                                vmap_method=_ffi.VMAP_METHOD)
        return tuple(_ffi.fence_results(call(dest, src, *xs)))

    first = xs[0]
    one_kind = all(x.shape == first.shape and x.dtype == first.dtype for x in xs)
    if not (_native.HAS_CUDA and one_kind and 1 <= len(xs) <= _native.constants.GATHER_ROWS_MAX_ARRAYS
            and first.ndim == 2 and first.shape[1] * first.dtype.itemsize % 16 == 0):
        return fallback(dest, src, *xs)
    return tuple(lax.platform_dependent(dest, src, *xs, cuda=native, default=fallback))


RMS_NORM_EPSILON = 1e-6  # rms_norm's default, the stacks' norm


def rms_norm(x: jax.Array, eps: float = RMS_NORM_EPSILON) -> jax.Array:
    """Parameter-free RMS normalisation over the last axis, in float32, cast back to x's dtype (the
    stacks' norm: ``jax_moe.stack.rms_norm`` is this)."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def routes_by_src(values: jax.Array, src: jax.Array) -> jax.Array:
    """Each row's route value: [num_rows] from values [T, k] and src [num_rows] as ``rows_by_route``'s.

    Row r gets values.flat[src[r]]; rows no route points at get 0 (the router weights of the rows,
    for a backward that keeps no scratch).
    """
    return jnp.where(src >= 0, values.reshape(-1)[jnp.maximum(src, 0)], jnp.zeros((), values.dtype))


def routes_from_rows(row_values: jax.Array, dest: jax.Array) -> jax.Array:
    """``routes_by_src``'s transpose: [T, k] route (t, j) gets row_values[dest[t, j]], 0 if dropped."""
    return jnp.where(dest >= 0, row_values[jnp.maximum(dest, 0)], jnp.zeros((), row_values.dtype))


@jax.custom_vjp
def unpermute_by_dest(y, topk_weights, dest_index):
    """``unpermute`` from a ``dest_index`` [>= T, k] int32 array instead of a scratch (no checks).

    The differentiable core of ``unpermute``, also used by the expert-parallel combine, whose
    destination rows are not a scratch's. Its backward is native too (``jax_moe_unpermute_grad``):
    d y[dest[t, j]] = w[t, j] * d out[t] (zero rows where no route points), d w[t, j] =
    <y[dest[t, j]], d out[t]>.
    """
    return _unpermute_any(y, topk_weights, dest_index)


def _unpermute_fwd(y, topk_weights, dest_index):
    # Residuals: y itself (the expert outputs, never a scratch buffer), w and a copy of this call's
    # [T, k] dest_index (the scratch's is overwritten by the next layer). Each row's route is
    # recomputed in the backward by one scatter rather than kept: no scratch buffer is a residual.
    return _unpermute_any(y, topk_weights, dest_index), (y, topk_weights, dest_index[:topk_weights.shape[0]])


def unpermute_grad(d_out: jax.Array, y: jax.Array, topk_weights: jax.Array, dest: jax.Array):
    """unpermute's backward (no checks): ``(d y [R, H] y's dtype, d w [T, k] topk_weights' dtype)``.

    d y[dest[t, j]] = w[t, j] * d out[t] (zero rows where no route points), d w[t, j] =
    <y[dest[t, j]], d out[t]>; d_out [T, H], y [R, H], dest [T, k] the call's destination rows.
    """
    src = invert_dest(dest, y.shape[0])
    d_y, d_w = _ffi.on_platform(_unpermute_grad_native, reference.unpermute_grad_unchecked,
                            d_out.astype(y.dtype), y, topk_weights, dest, src)
    return d_y, d_w.astype(topk_weights.dtype)


def _unpermute_bwd(residuals, d_out):
    return (*unpermute_grad(d_out, *residuals), None)


unpermute_by_dest.defvjp(_unpermute_fwd, _unpermute_bwd)


def _slab_bytes(weights) -> int:
    """Bytes of one expert's slab ``weights[e]`` of a stack [El, ...] (arrays or shapes)."""
    return math.prod(weights.shape[1:]) * jnp.dtype(weights.dtype).itemsize


def prefetch_bytes_per_route(num_routes: int, weights, budget: int) -> int:
    """Bytes of each routed expert's slab ``weights[e]`` a permute asks L2 for: ``budget`` split over
    the routes, at most a slab, whole cache lines."""
    line = _native.constants.PREFETCH_LINE_BYTES
    return min(_slab_bytes(weights), budget // max(num_routes, 1)) // line * line


def permute(x: jax.Array, topk_ids: jax.Array, scratch: MoEScratch, prefetch: jax.Array | None = None, *,
            prefetch_bytes: int | None = None) -> MoEScratch:
    """Groups each token's top-k routes by local expert into the scratch (the module's contract).

    Args:
      x: [T, H] rows of ``scratch.config.dtype``, 1 <= T <= ``config.max_tokens``.
      topk_ids: [T, k] global expert ids, any integer dtype. Ids < 0, >= E, or mapped to -1 by
        ``config.expert_map`` are dropped routes: never copied, contributing 0 on unpermute.
      scratch: the ``MoEScratch`` to write. Its buffers are aliased to the outputs (written in
        place when the caller donates them); do not use the argument after the call.
      prefetch: optional [El, ...] weights the next expert GEMM reads (a layer's gate/up stack). A
        hint: on a GPU, a decode-sized permute (one launch) starts the first ``prefetch_bytes`` of
        each routed expert's slab towards L2 in extra blocks of its launch, so the HBM streams
        them while the rows are copied. Results and gradients are the same with or without it.
      prefetch_bytes: bytes of each routed expert's slab to prefetch (whole cache lines, at most
        a slab); None: ``tuning.prefetch_bytes`` split over the routes (``jax_moe.plan`` decides it
        for the layers).

    Returns:
      The new ``MoEScratch``: ``permuted`` [R_cap, H] rows grouped by local expert (stable in
      flat route order, segments padded with zero rows to ``config.align``), ``src_index`` [R_cap],
      ``dest_index`` [T_max, k] (rows < T), ``group_sizes`` [El], ``expert_offsets`` [El + 1].
    """
    ids = _validate.check_permute_args(x, topk_ids, scratch)
    if prefetch is None:
        return _permute(x, ids, scratch)
    num_local = scratch.config.num_local_experts
    if jnp.ndim(prefetch) < 2 or jnp.shape(prefetch)[0] != num_local:
        raise ValueError(f"permute: prefetch: expected [El={num_local}, ...] weights, got shape {jnp.shape(prefetch)}")
    slab, line = _slab_bytes(prefetch), _native.constants.PREFETCH_LINE_BYTES
    if prefetch_bytes is None:
        prefetch_bytes = prefetch_bytes_per_route(ids.size, prefetch, DEFAULT_TUNING.prefetch_bytes)
    if not isinstance(prefetch_bytes, int) or prefetch_bytes < 0 or prefetch_bytes % line or prefetch_bytes > slab:
        raise ValueError(f"permute: prefetch_bytes: expected a multiple of {line} from 0 to {slab} (one expert's "
                         f"slab), got {prefetch_bytes!r}")
    return _permute_prefetching(x, ids, scratch, prefetch, prefetch_bytes)


def permute_fp8(x: jax.Array, topk_ids: jax.Array, scratch: MoEScratch, num_rows: int):
    """``permute`` for FP8 experts: the same indices, and the rows quantised instead of copied.

    Returns ``(scratch, q_rows [num_rows, H] float8_e4m3fn, row_scale [num_rows, H/128] float32)``:
    the live rows (``expert_offsets[-1]`` of them, padding rows included) are those of
    ``fp8.quantize_rows(permute(x, topk_ids, scratch).permuted[:num_rows])``, bitwise (each 1 x 128
    group quantised alone, so quantising a token's row before its k copies gives the same bytes);
    rows past them are unspecified (the FP8 GEMMs write zero rows there). num_rows: at least
    ``config.live_row_bound(T)``, at most R_cap. On a GPU (bf16 x, H a multiple of 128) one call
    whose copy launch quantises: a prefill layer's permuted bf16 rows are neither written nor read
    back (``scratch.permuted`` is left as it was). Elsewhere ``permute`` then ``fp8.quantize_rows``.
    No autodiff rule: a differentiable caller wraps it (``jax_moe.experts``' FP8 prefill path
    recomputes the rows in its backward).
    """
    ids = _validate.check_permute_args(x, topk_ids, scratch)
    config = scratch.config
    bound = config.live_row_bound(x.shape[0])
    if not isinstance(num_rows, int) or not bound <= num_rows <= config.capacity:
        raise ValueError(f"permute_fp8: num_rows: expected an int from {bound} (live_row_bound(T)) to "
                         f"{config.capacity} (capacity), got {num_rows!r}")
    if config.hidden_size % fp8.BLOCK:
        raise ValueError(f"permute_fp8: x: expected a hidden size that is a multiple of {fp8.BLOCK}, "
                         f"got {config.hidden_size}")

    def fallback(x, ids, scratch):
        scratch = _permute(x, ids, scratch)
        return (scratch, *fp8.quantize_rows(scratch.permuted[:num_rows]))

    if not (_native.HAS_CUDA and jnp.dtype(x.dtype) == jnp.bfloat16):
        return fallback(x, ids, scratch)

    def native(x, ids, scratch):
        quantized = (jax.ShapeDtypeStruct((num_rows, x.shape[1]), fp8.FP8),
                     jax.ShapeDtypeStruct((num_rows, x.shape[1] // fp8.BLOCK), jnp.float32))
        return _permute_call(_native.PERMUTE_FP8_TARGET, x, ids, scratch, quantized)

    return lax.platform_dependent(x, ids, scratch, cuda=native, default=fallback)


def unpermute(y: jax.Array, topk_weights: jax.Array, scratch: MoEScratch) -> jax.Array:
    """Gathers each token's expert outputs back and sums them weighted (the module's contract).

    Args:
      y: [R, H] float16/bfloat16/float32 expert outputs in the permuted row order of the last
        ``permute`` on ``scratch``: all R_cap rows, or at least the live rows' static bound
        ``config.live_row_bound(T)`` (rows past it are never read).
      topk_weights: [T, k] float32 or bfloat16 router weights; T must be the T of that permute.
      scratch: the scratch returned by that ``permute`` (only ``dest_index`` is read).

    Returns:
      [T, H] of y's dtype: ``sum over kept j of w[t, j] * y[dest_index[t, j]]`` accumulated in
      float32 in ascending j without FMA, rounded once. Bitwise deterministic.
    """
    _validate.check_unpermute_args(y, topk_weights, scratch)
    return unpermute_by_dest(y, topk_weights, scratch.dest_index)


def unpermute_add(y: jax.Array, topk_weights: jax.Array, scratch: MoEScratch, residual: jax.Array,
                  addend: jax.Array | None = None) -> jax.Array:
    """``residual + (unpermute(y, topk_weights, scratch) + addend)``: a layer's output and residual add.

    Args as ``unpermute``'s; residual and addend (optional: a shared expert's output) [T, H] of y's
    dtype. On a GPU one launch, the adds in unpermute's epilogue, each rounded to y's dtype as the
    elementwise adds round (bitwise XLA's: float32 holds more than twice a bf16's bits, so an add
    in float32 rounded to bf16 is the correctly rounded bf16 add), its result in the residual's
    buffer; elsewhere those adds in XLA. Differentiable: the residual and the addend get the
    output's cotangent, y and the weights unpermute's (its native backward).
    """
    _validate.check_unpermute_args(y, topk_weights, scratch)
    want = (topk_weights.shape[0], y.shape[1])
    for name, value in (("residual", residual), ("addend", addend)):
        if value is not None and (tuple(value.shape) != want or value.dtype != y.dtype):
            raise ValueError(f"unpermute_add: {name}: expected {jnp.dtype(y.dtype)}{list(want)} ([T, H], y's dtype), "
                             f"got {value.dtype}{list(value.shape)}")
    return unpermute_add_by_dest(y, topk_weights, scratch.dest_index, residual, addend)


def _unpermute_add_any(y, topk_weights, dest_index, residual, addend):
    has_addend = addend is not None
    addend_operand = addend if has_addend else jnp.zeros((1,), y.dtype)

    def xla(y, topk_weights, dest_index, residual, addend_operand):
        out = _unpermute_any(y, topk_weights, dest_index)
        return residual + (out + addend_operand if has_addend else out)

    def native(y, topk_weights, dest_index, residual, addend_operand):
        # In place of the residual: a scan's carry then stays in its buffer (a new result would be
        # copied into it).
        call = jax.ffi.ffi_call(_native.UNPERMUTE_ADD_TARGET, jax.ShapeDtypeStruct(residual.shape, y.dtype),
                                input_output_aliases={3: 0}, vmap_method=_ffi.VMAP_METHOD)
        return _ffi.fence_results(call(y, topk_weights, dest_index, residual, addend_operand,
                                  has_addend=np.bool_(has_addend)))

    operands = (y, topk_weights, dest_index, residual, addend_operand)
    if not _native.HAS_CUDA:
        return xla(*operands)
    return lax.platform_dependent(*operands, cuda=native, default=xla)


@jax.custom_vjp
def unpermute_add_by_dest(y, topk_weights, dest_index, residual, addend):
    """``unpermute_add`` from a ``dest_index`` [>= T, k] int32 array (no checks); addend may be None."""
    return _unpermute_add_any(y, topk_weights, dest_index, residual, addend)


def _unpermute_add_fwd(y, topk_weights, dest_index, residual, addend):
    # The residuals of unpermute's own rule (the adds need none), and whether an addend came: ()
    # if so, None if not (a pytree structure, not a value).
    out = _unpermute_add_any(y, topk_weights, dest_index, residual, addend)
    return out, (y, topk_weights, dest_index[:topk_weights.shape[0]], None if addend is None else ())


def _unpermute_add_bwd(residuals, d_out):
    y, topk_weights, dest, added = residuals
    d_y, d_w = unpermute_grad(d_out, y, topk_weights, dest)
    return d_y, d_w, None, d_out, None if added is None else d_out


unpermute_add_by_dest.defvjp(_unpermute_add_fwd, _unpermute_add_bwd)
