"""Loads the native modules and registers their FFI handlers with XLA, once, at import."""

from __future__ import annotations

import importlib
import warnings

import jax

PERMUTE_TARGET = "jax_moe_permute"
UNPERMUTE_TARGET = "jax_moe_unpermute"


def _register(module_name: str, platform: str) -> bool:
    try:
        module = importlib.import_module(f"jax_moe.{module_name}")
    except ImportError as e:
        if platform == "cpu":
            warnings.warn(f"jax_moe: native CPU module not available ({e}); using the pure-JAX reference "
                          "(jax_moe.reference) on CPU, which is slower.", RuntimeWarning, stacklevel=3)
        return False
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


HAS_CPU = _register("_jax_moe_cpu", "cpu")
HAS_CUDA = _register("_jax_moe_cuda", "CUDA")

_warned_gpu_fallback = False


def warn_if_gpu_uses_reference() -> None:
    """Once per process: say so when a GPU run will use the reference for lack of the CUDA module."""
    global _warned_gpu_fallback
    if HAS_CUDA or _warned_gpu_fallback:
        return
    _warned_gpu_fallback = True
    if jax.default_backend() == "gpu":
        warnings.warn("jax_moe: built without the CUDA module; permute/unpermute on GPU use the "
                      "pure-JAX reference. Rebuild with -Ccmake.define.JAX_MOE_CUDA=ON.",
                      RuntimeWarning, stacklevel=4)
