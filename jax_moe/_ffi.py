"""FFI plumbing below ``ops``, ``routing`` and ``gemm``: choosing the native call or its fallback,
uninitialised buffers, fences, and slices of stacked buffers."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _native

# vmap runs one call per batch element: each element has its own expert groups and offsets, and
# the kernels are written for one routing problem, so a loop is the exact, allocation-free rule.
VMAP_METHOD = "sequential"


def on_platform(native, fallback, *args):
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


def on_cuda(native, fallback, *args):
    """The CUDA custom call when the program is lowered for a GPU, else the fallback (XLA's ops)."""
    if not _native.HAS_CUDA:
        return fallback(*args)
    return lax.platform_dependent(*args, cuda=native, default=fallback)


def uninitialized(shape, dtype) -> jax.Array:
    """An array of unspecified contents (no fill): the caller writes every element before reading any.

    A native no-op custom call (``jax_moe_uninitialized``) where the modules are built, zeros
    otherwise. Each call carries a distinct ``tag`` attribute, so XLA never merges two of them.
    """
    aval = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), dtype)

    def native():
        return jax.ffi.ffi_call(_native.UNINITIALIZED_TARGET, aval)(tag=np.int64(next(_uninitialized_tags)))

    return on_platform(native, lambda: jnp.zeros(aval.shape, aval.dtype))


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


def check_fits_in_slice(caller: str, stack, offset: int, shape) -> None:
    """ValueError unless an array of ``shape`` fits at element ``offset`` (a multiple of 8: 16-byte
    aligned for the kernels) of one slice of ``stack`` [L, ...]."""
    slice_size = math.prod(stack.shape[1:])
    if offset % 8 or offset < 0 or offset + math.prod(shape) > slice_size:
        raise ValueError(f"{caller}: offset: expected a multiple of 8 with offset + {shape[0]} x {shape[1]} <= "
                         f"{slice_size} (one slice of the stack), got {offset}")
