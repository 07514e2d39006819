"""Loads the native modules and registers their FFI handlers with XLA, once, at import.

Also the constants the kernels and Python share (``constants``) and the scratch workspace's size
(``workspace_words``): defined once in cuda/constants.h and cuda/workspace_layout.h, exported by
both native modules, so the CPU module alone provides them.
"""

from __future__ import annotations

import importlib
import types
import warnings

import jax

PERMUTE_TARGET = "jax_moe_permute"
PERMUTE_FP8_TARGET = "jax_moe_permute_fp8"  # CUDA only
PERMUTE_PREFETCH_TARGET = "jax_moe_permute_prefetch"  # CUDA only
UNPERMUTE_TARGET = "jax_moe_unpermute"
UNPERMUTE_GRAD_TARGET = "jax_moe_unpermute_grad"
UNPERMUTE_ADD_TARGET = "jax_moe_unpermute_add"  # CUDA only
GROUPED_MATMUL_TARGET = "jax_moe_grouped_matmul"  # CUDA only
GROUPED_MATMUL_INTO_TARGET = "jax_moe_grouped_matmul_into"  # CUDA only
GATHER_ROWS_TARGET = "jax_moe_gather_rows"  # CUDA only
DECODE_MATMUL_TARGET = "jax_moe_decode_matmul"  # CUDA only
DECODE_MATMUL_SHARED_TARGET = "jax_moe_decode_matmul_shared"  # CUDA only
DECODE_ROUTE_TARGET = "jax_moe_decode_route"  # CUDA only
DECODE_ROUTE_NORM_TARGET = "jax_moe_decode_route_norm"  # CUDA only
CHOOSE_EXPERTS_TARGET = "jax_moe_choose_experts"  # CUDA only
FP8_GROUPED_MATMUL_TARGET = "jax_moe_fp8_grouped_matmul"  # CUDA only
FP8_SWIGLU_EXPERTS_TARGET = "jax_moe_fp8_swiglu_experts"  # CUDA only
FP8_SWIGLU_QUANTIZED_EXPERTS_TARGET = "jax_moe_fp8_swiglu_quantized_experts"  # CUDA only
FP8_DECODE_SWIGLU_TARGET = "jax_moe_fp8_decode_swiglu"  # CUDA only
FP8_DECODE_SWIGLU_SHARED_TARGET = "jax_moe_fp8_decode_swiglu_shared"  # CUDA only
SWIGLU_BACKWARD_TARGET = "jax_moe_swiglu_backward"  # CUDA only
UNINITIALIZED_TARGET = "jax_moe_uninitialized"
BENCH_NOOP_TARGET = "jax_moe_bench_noop"  # only with the benchmark module (HAS_BENCH)
BENCH_COPY_TARGET = "jax_moe_bench_copy"  # only with the benchmark module (HAS_BENCH)
GROUPED_DOT_TARGET = "jax_moe_grouped_dot"  # CPU only
GROUPED_DOT_WEIGHT_GRAD_TARGET = "jax_moe_grouped_dot_weight_grad"  # CPU only
FP8_GROUPED_DOT_TARGET = "jax_moe_fp8_grouped_dot"  # CPU only


def _register(module_name: str, platform: str):
    """The imported module once its handlers are registered, or None when it was not built."""
    try:
        module = importlib.import_module(f"jax_moe.{module_name}")
    except ImportError as e:
        if platform == "cpu":
            warnings.warn(f"jax_moe: native CPU module not available ({e}); using the pure-JAX reference "
                          "(jax_moe.reference) on CPU, which is slower.", RuntimeWarning, stacklevel=3)
        return None
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return module


_CPU_MODULE = _register("_jax_moe_cpu", "cpu")
HAS_CPU = _CPU_MODULE is not None
_CUDA_MODULE = _register("_jax_moe_cuda", "CUDA")
HAS_CUDA = _CUDA_MODULE is not None

_SHARED_MODULE = _CPU_MODULE if _CPU_MODULE is not None else _CUDA_MODULE
if _SHARED_MODULE is None:
    raise ImportError("jax_moe: neither native module (jax_moe._jax_moe_cpu, jax_moe._jax_moe_cuda) is built; "
                      "they hold the constants jax_moe shares with its kernels. Reinstall: pip install .")

# The constants and enum values of cuda/constants.h by name, e.g. constants.GEMM_TILE_SMALL_M,
# constants.FP8_BLOCK, constants.DECODE_ROUTE_MAX_TOKENS, constants.ROUTING_TILE_ROUTES.
constants = types.SimpleNamespace(**{name: int(value) for name, value in _SHARED_MODULE.constants().items()})


def workspace_words(routes: int, num_local: int, gemm_bytes: int) -> int:
    """int32 words of a scratch's workspace (cuda/workspace_layout.h) for T_max * k routes over
    num_local experts, with gemm_bytes of the grouped GEMMs' arguments (0 without the CUDA module)."""
    return int(_SHARED_MODULE.workspace_words(routes, num_local, gemm_bytes))


def _register_bench() -> bool:
    """Registers the optional benchmark module's targets on each platform it was built for."""
    try:
        module = importlib.import_module("jax_moe._jax_moe_bench")
    except ImportError:
        return False
    for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return True


# The benchmark suites' floor and ceiling targets (BENCH_NOOP_TARGET, BENCH_COPY_TARGET), from the
# optional module _jax_moe_bench: built only on request (JAX_MOE_BENCH=ON, cuda/README.md).
HAS_BENCH = _register_bench()


def grouped_matmul_workspace_bytes(num_groups: int) -> int:
    """Bytes of workspace the CUDA grouped GEMM needs for num_groups experts; 0 without the module."""
    return 0 if _CUDA_MODULE is None else int(_CUDA_MODULE.grouped_matmul_workspace_bytes(num_groups))


def fp8_grouped_matmul_workspace_bytes(num_groups: int) -> int:
    """Bytes of workspace the CUDA FP8 grouped GEMM needs for num_groups experts; 0 without the module."""
    return 0 if _CUDA_MODULE is None else int(_CUDA_MODULE.fp8_grouped_matmul_workspace_bytes(num_groups))


def decode_route_slices(hidden: int) -> int:
    """Slices of H the CUDA decode router sums separately (its partial sums' leading axis)."""
    return int(_CUDA_MODULE.decode_route_slices(hidden))


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
