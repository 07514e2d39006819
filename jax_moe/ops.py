"""Public permute/unpermute: validation, the FFI custom calls, autodiff and vmap rules."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _native, _validate, fp8, reference, routing
from jax_moe.scratch import BUFFER_NAMES, MoEScratch

# Operand i of the permute call is written in place as result o: the scratch buffers follow the
# three inputs (x, topk_ids, expert_map), in BUFFER_NAMES order.
_PERMUTE_ALIASES = {3 + i: i for i in range(len(BUFFER_NAMES))}

# vmap runs one call per batch element: each element has its own expert groups and offsets, and
# the kernels are written for one routing problem, so a loop is the exact, allocation-free rule.
_VMAP_METHOD = "sequential"


def _on_platform(native, fallback, *args):
    """The native handler where its module is built, else the reference.

    With both modules built (the usual case, also on machines without a GPU) this is the plain
    custom call. Otherwise ``lax.platform_dependent`` picks at lowering time; it is avoided when
    not needed because autodiff keeps residuals of every branch, and a scanned training step then
    carries reference-branch arrays of scratch shapes through its loop.
    """
    _native.warn_if_gpu_uses_reference()
    if _native.HAS_CPU and _native.HAS_CUDA and jax.default_backend() in ("cpu", "gpu"):
        return native(*args)
    return lax.platform_dependent(
        *args,
        cpu=native if _native.HAS_CPU else fallback,
        cuda=native if _native.HAS_CUDA else fallback,
        default=fallback)


def uninitialized(shape, dtype) -> jax.Array:
    """An array of unspecified contents (no fill): the caller writes every element before reading any.

    A native no-op custom call (``jax_moe_uninitialized``) where the modules are built, zeros
    otherwise. Each call carries a distinct ``tag`` attribute, so XLA never merges two of them.
    """
    aval = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)

    def native():
        return jax.ffi.ffi_call(_native.UNINITIALIZED_TARGET, aval)(tag=np.int64(next(_uninitialized_tags)))

    return _on_platform(native, lambda: jnp.zeros(aval.shape, aval.dtype))


_uninitialized_tags = itertools.count()


def write_into(stack: jax.Array, layer, value: jax.Array, offset: int) -> jax.Array:
    """``value`` flattened into slice ``layer`` (int32 scalar) of ``stack`` [L, ...] at element
    ``offset``, converted to stack's dtype (``dynamic_update_slice``: in place inside a loop)."""
    flat = stack.reshape(stack.shape[0], -1)
    flat = lax.dynamic_update_slice(flat, value.reshape(1, -1).astype(stack.dtype), (layer, offset))
    return flat.reshape(stack.shape)


def read_from(stack: jax.Array, layer, shape, offset: int, dtype=None) -> jax.Array:
    """``write_into``'s inverse: the array of ``shape`` at element ``offset`` of slice ``layer``,
    as ``dtype`` (default stack's)."""
    flat = stack.reshape(stack.shape[0], -1)
    value = lax.dynamic_slice(flat, (layer, offset), (1, math.prod(shape))).reshape(shape)
    return value if dtype is None else value.astype(dtype)


def fence_results(outputs):
    """Keeps XLA:GPU from fusing a result's consumer into the custom call.

    Its dynamic-slice fusion rewrites "custom call, then dynamic-update-slice of a result into a
    stacked array" (a training scan saving ``permuted`` for the expert GEMMs' backward) into a
    second instance of the call that writes the slice directly, while the first instance stays
    for the result's other users: the permute ran twice per layer, and its in-place scratch
    operands were copied to keep the two apart. An optimization barrier costs nothing at run
    time and is not looked through by that rewrite.
    """
    return lax.optimization_barrier(outputs)


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
        vmap_method=_VMAP_METHOD)
    # The identity map is an attribute (no per-route lookup), its operand a 1-element placeholder:
    # an empty operand crashed jaxlib 0.11.2's compiler inside a shard_map over 2+ GPUs.
    identity = config.expert_map is None
    expert_map = np.zeros((1,), np.int32) if identity else config.expert_map_array()
    outputs = fence_results(call(x, ids, jnp.asarray(expert_map), *buffers, *extra_operands,
                                 align=np.int64(config.align), identity_map=np.bool_(identity), **attributes))
    return (scratch.replace(**dict(zip(BUFFER_NAMES, outputs))), *outputs[len(buffers):])


def _permute_native(x, ids, scratch: MoEScratch) -> MoEScratch:
    return _permute_call(_native.PERMUTE_TARGET, x, ids, scratch)[0]


def _unpermute_native(y, topk_weights, dest_index):
    call = jax.ffi.ffi_call(
        _native.UNPERMUTE_TARGET,
        jax.ShapeDtypeStruct((topk_weights.shape[0], y.shape[1]), y.dtype),
        vmap_method=_VMAP_METHOD)
    return fence_results(call(y, topk_weights, dest_index))


def _unpermute_any(y, topk_weights, dest_index):
    return _on_platform(_unpermute_native, reference.unpermute_unchecked, y, topk_weights, dest_index)


@jax.custom_vjp
def _permute(x, ids, scratch):
    return _on_platform(_permute_native, reference.permute_unchecked, x, ids, scratch)


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


# Bytes of the routed experts' weights a decode permute asks L2 for, split over its routes (each
# expert's first bytes, which the next GEMM's blocks read first). The HBM is otherwise idle while
# the permute runs; L2 holds 50 MB on the H100 and H200. 8 MiB measured best of 8, 16
# and 32 MiB on the H100 (notebooks/results/decode_prefetch_h100.md).
DECODE_PREFETCH_BYTES = 8 << 20


def prefetch_bytes(num_routes: int, weights) -> int:
    """Bytes of each routed expert's slab ``weights[e]`` that ``permute(..., prefetch=weights)`` asks
    L2 for: ``DECODE_PREFETCH_BYTES`` over the routes, at most a slab, whole 128-byte lines."""
    slab = math.prod(weights.shape[1:]) * jnp.dtype(weights.dtype).itemsize
    return min(slab, DECODE_PREFETCH_BYTES // max(num_routes, 1)) // 128 * 128


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
        vmap_method=_VMAP_METHOD)
    return fence_results(call(d_out, y, topk_weights, dest, src))


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
    kernel (``jax_moe_gather_rows``) that reads each token's row once and stores it to its k rows
    (Qwen3-30B's backward at T = 4096: 81 µs per layer for two arrays, XLA's two gathers 126 µs);
    XLA's gather otherwise.
    """
    top_k = dest.shape[1]

    def fallback(dest, src, *xs):
        token = jnp.maximum(src, 0) // top_k
        return tuple(jnp.where((src >= 0)[:, None], x[token], jnp.zeros((), x.dtype)) for x in xs)

    def native(dest, src, *xs):
        call = jax.ffi.ffi_call(_native.GATHER_ROWS_TARGET,
                                tuple(jax.ShapeDtypeStruct((src.shape[0], x.shape[1]), x.dtype) for x in xs),
                                vmap_method=_VMAP_METHOD)
        return tuple(fence_results(call(dest, src, *xs)))

    first = xs[0]
    one_kind = all(x.shape == first.shape and x.dtype == first.dtype for x in xs)
    if not (_native.HAS_CUDA and one_kind and 1 <= len(xs) <= 4 and first.ndim == 2
            and first.shape[1] * first.dtype.itemsize % 16 == 0):
        return fallback(dest, src, *xs)
    return tuple(lax.platform_dependent(dest, src, *xs, cuda=native, default=fallback))


# The CUDA decode router's limits (cuda/route_kernels.h, DecodeRouteFits).
DECODE_ROUTE_MAX_TOKENS = 16
DECODE_ROUTE_MAX_EXPERTS = 512
DECODE_ROUTE_MAX_PAIRS = 4096  # T * E
DECODE_ROUTE_MAX_TOP_K = 32
DECODE_ROUTE_MAX_GROUPS = 32
# Layers route with route_decode's kernel up to this many tokens (moe_layer always; the bf16
# stack's hand-written backward recomputes its routing in XLA, so only its inference forward).
# Measured on the H200 (µs per layer, moe_stack steps): faster than XLA's routing at T = 1 (Qwen3-30B
# 53.4 -> 47-49.5, Qwen3.5 129 -> 119-127, Mixtral 212 -> 206-210, DeepSeek-V3 even) and about even at
# T = 2; slower at T = 16 (Qwen3-30B 240 -> 251-261: its reduction of H is latency-bound; again on
# an H100 on 2026-12-06, 306 -> 324 µs: notebooks/results/shared_decode_bound_h100.md).
DECODE_ROUTE_TOKENS = 2


RMS_NORM_EPSILON = 1e-6  # rms_norm's default, the stacks' norm


def rms_norm(x: jax.Array, eps: float = RMS_NORM_EPSILON) -> jax.Array:
    """Parameter-free RMS normalisation over the last axis, in float32, cast back to x's dtype (the
    stacks' norm: ``jax_moe.stack.rms_norm`` is this)."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def decode_route_fits(config, num_tokens: int, router_dtype) -> bool:
    """Whether ``route_decode`` runs the CUDA decode router on a GPU for these sizes.

    bf16 tokens and router, T <= 16, E <= 512 and T * E <= 4096, H and E multiples of 8, k <= min(E, 32),
    n_group <= 32 groups of two experts or more, and the CUDA module built.
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    experts, groups = config.num_experts, config.n_group
    return (_native.HAS_CUDA and jnp.dtype(config.dtype) == bf16 and jnp.dtype(router_dtype) == bf16
            and 1 <= num_tokens <= DECODE_ROUTE_MAX_TOKENS and num_tokens * experts <= DECODE_ROUTE_MAX_PAIRS
            and experts <= DECODE_ROUTE_MAX_EXPERTS and experts % 8 == 0 and config.hidden_size % 8 == 0
            and config.top_k <= DECODE_ROUTE_MAX_TOP_K
            and 1 <= groups <= DECODE_ROUTE_MAX_GROUPS and experts % groups == 0
            and (groups == 1 or experts // groups >= 2) and 1 <= config.topk_group <= groups)


def route_decode(router: jax.Array, x: jax.Array, scratch: MoEScratch, bias: jax.Array | None = None):
    """``route_logits(router_logits(router, x))`` for a few tokens: ``(weights, ids, logits, scratch)``.

    Args:
      router: [H, E] the layer's router; x: [T, H] its (normalised) tokens; bias: optional [E]
        correction added to the scores for choosing only; scratch: the shared scratch (the CUDA
        kernel keeps its arrival counter in the workspace's last word).

    Returns:
      weights [T, k] float32, ids [T, k] int32 (``jax_moe.routing.route_logits``'s), logits [T, E]
      float32, and the scratch to pass on.

    On a GPU within ``decode_route_fits`` one kernel (``jax_moe_decode_route``) computes the
    logits, scores, top-k and weights where XLA runs six to ten small kernels: the same ids as
    route_logits of the kernel's logits; logits and weights within float32 rounding of XLA's (other
    summation orders). Elsewhere, the XLA path. Differentiable in router and x: the backward is
    XLA's, of the weights as a function of the logits at the chosen ids (``routing.chosen_weights``)
    and of the logits themselves; the ids are kept, not chosen again, so the gradient is that of
    the routing the forward took (the bias gets none, as in route_logits). Measured on the H200 at
    T = 1: 8.6 µs for Qwen3-30B's router (XLA's kernels for the same math about 13 µs); 12.5 µs for
    DeepSeek-V3's in the version before its two steps of loads in flight (not timed alone since).
    Its reduction of H is a chain of dependent round trips (router loads, the partial sums, the
    arrival counter, the last block's reads), not bandwidth-bound.
    """
    config = scratch.config
    bias_operand = _check_route_decode("route_decode", config, router, x, bias)
    weights, ids, logits, workspace = _route_decode(config, bias is not None, router, x, bias_operand,
                                                    scratch.workspace)
    return weights, ids, logits, scratch.replace(workspace=workspace)


def route_decode_normalizing(router: jax.Array, h: jax.Array, scratch: MoEScratch, bias: jax.Array | None = None,
                             eps: float = RMS_NORM_EPSILON):
    """``route_decode(router, rms_norm(h, eps), scratch, bias)`` with the norm in the router's launch:
    ``(n, weights, ids, logits, scratch)``, n = rms_norm(h) [T, H].

    For the inference stack's decode layers, where XLA ran the norm as two kernels of their own
    (1.9 µs of kernels a layer at T = 1 on the H200; the layer measured 0.7 µs faster for Qwen3-30B
    on an H100: notebooks/results/decode_norm_in_router_h100.md). On a GPU within ``decode_route_fits`` every block of the decode
    router (``jax_moe_decode_route_norm``) finds its tokens' scales from the whole rows and
    normalises the values it loads, and the blocks of the first expert tile write n. n is rms_norm's
    to within one bf16 rounding (its float32 sum of squares is summed in another order; the
    reciprocal square root is correctly rounded), and weights, ids and logits are bitwise
    ``route_decode`` of that n. Elsewhere rms_norm then route_decode. Inference only: differentiating
    it raises (differentiate rms_norm and route_decode instead).
    """
    config = scratch.config
    bias_operand = _check_route_decode("route_decode_normalizing", config, router, h, bias)
    n, weights, ids, logits, workspace = _route_decode_normalizing(config, bias is not None, float(eps), router, h,
                                                                   bias_operand, scratch.workspace)
    return n, weights, ids, logits, scratch.replace(workspace=workspace)


def _check_route_decode(name: str, config, router, x, bias) -> jax.Array:
    """ValueError unless router [H, E], x [T, H] and bias [E] (or None) fit config; the bias operand."""
    want = {"router": (config.hidden_size, config.num_experts), "x": (jnp.shape(x)[0], config.hidden_size),
            "bias": (config.num_experts,)}
    for arg, value in (("router", router), ("x", x), ("bias", bias)):
        if value is not None and tuple(jnp.shape(value)) != want[arg]:
            raise ValueError(f"{name}: {arg}: expected shape {want[arg]} ([H, E], [T, H], [E]), "
                             f"got {tuple(jnp.shape(value))}")
    return jnp.zeros((1,), jnp.float32) if bias is None else bias.astype(jnp.float32)


def _route_in_xla(config, has_bias: bool, router, x, bias_operand):
    """The decode router's math in XLA: ``(weights, ids, logits)`` of route_logits(router_logits(...))."""
    logits = routing.router_logits(router, x)
    weights, ids = routing.route_logits(logits, config, bias_operand if has_bias else None)
    return weights, ids, logits


def _route_decode_forward(config, has_bias: bool, router, x, bias_operand, workspace):
    """route_decode's four results (the workspace last) on the kernel or XLA's path."""
    def xla(router, x, bias_operand, workspace):
        return (*_route_in_xla(config, has_bias, router, x, bias_operand), workspace)

    if not decode_route_fits(config, x.shape[0], router.dtype):
        return xla(router, x, bias_operand, workspace)

    def native(router, x, bias_operand, workspace):
        return _decode_route_call(config, has_bias, router, x, bias_operand, workspace)[:4]

    return lax.platform_dependent(router, x, bias_operand, workspace, cuda=native, default=xla)


def _decode_route_call(config, has_bias: bool, router, x, bias_operand, workspace, norm_eps: float | None = None):
    """The CUDA decode router: ``(weights, ids, logits, workspace, n)``. With norm_eps, x is the
    tokens before the norm and n = their rms_norm (``jax_moe_decode_route_norm``); else n is None."""
    num_tokens, (hidden, experts) = x.shape[0], router.shape
    f32 = jnp.float32
    results = (jax.ShapeDtypeStruct((num_tokens, experts), f32), jax.ShapeDtypeStruct((num_tokens, config.top_k), f32),
               jax.ShapeDtypeStruct((num_tokens, config.top_k), jnp.int32),
               jax.ShapeDtypeStruct((_native.decode_route_slices(hidden), num_tokens, experts), f32),
               jax.ShapeDtypeStruct(workspace.shape, workspace.dtype))
    attrs = dict(has_bias=np.bool_(has_bias), sigmoid=np.bool_(config.scoring == "sigmoid"),
                 renormalize=np.bool_(config.renormalize), renormalize_epsilon=np.float32(config.renormalize_epsilon),
                 scaling=np.float32(config.routed_scaling_factor), n_group=np.int64(config.n_group),
                 topk_group=np.int64(config.topk_group))
    if norm_eps is None:
        target = _native.DECODE_ROUTE_TARGET
    else:
        target = _native.DECODE_ROUTE_NORM_TARGET
        results += (jax.ShapeDtypeStruct(x.shape, x.dtype),)
        attrs["norm_epsilon"] = np.float32(norm_eps)
    call = jax.ffi.ffi_call(target, results, input_output_aliases={3: 4}, vmap_method=_VMAP_METHOD)
    out = fence_results(call(x, router, bias_operand, workspace, **attrs))
    logits, weights, ids, _, workspace = out[:5]
    return weights, ids, logits, workspace, (out[5] if norm_eps is not None else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _route_decode_normalizing(config, has_bias: bool, eps: float, router, h, bias_operand, workspace):
    def xla(router, h, bias_operand, workspace):
        n = rms_norm(h, eps)
        return (n, *_route_in_xla(config, has_bias, router, n, bias_operand), workspace)

    if not decode_route_fits(config, h.shape[0], router.dtype):
        return xla(router, h, bias_operand, workspace)

    def native(router, h, bias_operand, workspace):
        weights, ids, logits, workspace, n = _decode_route_call(config, has_bias, router, h, bias_operand, workspace,
                                                                norm_eps=eps)
        return n, weights, ids, logits, workspace

    return lax.platform_dependent(router, h, bias_operand, workspace, cuda=native, default=xla)


def _route_decode_normalizing_fwd(config, has_bias, eps, router, h, bias_operand, workspace):
    raise ValueError("route_decode_normalizing: not differentiable (inference only); differentiate "
                     "rms_norm then route_decode instead")


def _route_decode_normalizing_bwd(config, has_bias, eps, residuals, cotangents):
    raise AssertionError("unreachable: the forward raises")


_route_decode_normalizing.defvjp(_route_decode_normalizing_fwd, _route_decode_normalizing_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _route_decode(config, has_bias: bool, router, x, bias_operand, workspace):
    return _route_decode_forward(config, has_bias, router, x, bias_operand, workspace)


def _route_decode_fwd(config, has_bias, router, x, bias_operand, workspace):
    results = _route_decode_forward(config, has_bias, router, x, bias_operand, workspace)
    return results, (router, x, results[1])


def _route_decode_bwd(config, has_bias, residuals, cotangents):
    router, x, ids = residuals
    d_weights, _, d_logits, _ = cotangents

    def routed(router, x):
        logits = routing.router_logits(router, x)
        return routing.chosen_weights(routing.scores_from_logits(logits, config), ids, config), logits

    _, vjp = jax.vjp(routed, router, x)
    d_router, d_x = vjp((d_weights, d_logits))
    return d_router, d_x, None, None


_route_decode.defvjp(_route_decode_fwd, _route_decode_bwd)


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
    d_y, d_w = _on_platform(_unpermute_grad_native, reference.unpermute_grad_unchecked,
                            d_out.astype(y.dtype), y, topk_weights, dest, src)
    return d_y, d_w.astype(topk_weights.dtype)


def _unpermute_bwd(residuals, d_out):
    return (*unpermute_grad(d_out, *residuals), None)


unpermute_by_dest.defvjp(_unpermute_fwd, _unpermute_bwd)


def permute(x: jax.Array, topk_ids: jax.Array, scratch: MoEScratch, prefetch: jax.Array | None = None) -> MoEScratch:
    """Groups each token's top-k routes by local expert into the scratch (DESIGN.md §3).

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
    return _permute_prefetching(x, ids, scratch, prefetch, prefetch_bytes(ids.size, prefetch))


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
    """Gathers each token's expert outputs back and sums them weighted (DESIGN.md §3).

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
        # In place of the residual: a scan's carry then stays in its buffer (a new result was
        # copied into it, 1.2 us per layer at decode on the H200).
        call = jax.ffi.ffi_call(_native.UNPERMUTE_ADD_TARGET, jax.ShapeDtypeStruct(residual.shape, y.dtype),
                                input_output_aliases={3: 0}, vmap_method=_VMAP_METHOD)
        return fence_results(call(y, topk_weights, dest_index, residual, addend_operand,
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
