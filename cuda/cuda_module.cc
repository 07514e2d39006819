// The CUDA module _jax_moe_cuda: every CUDA handler family, the constants, the workspace's size, and
// the host-side sizes Python needs from the kernels (GEMM workspaces, the router's slices).
#include <pybind11/pybind11.h>

#include "ffi_common.h"
#include "fp8_gemm_kernels.h"
#include "grouped_gemm_kernels.h"
#include "module_common.h"
#include "route_kernels.h"

namespace jax_moe {
// Each family's handlers and their target names, defined in its <op>_ffi.cc.
FfiTargets PermuteCudaTargets();
FfiTargets RouteCudaTargets();
FfiTargets GroupedGemmCudaTargets();
FfiTargets DecodeGemmCudaTargets();
FfiTargets Fp8GemmCudaTargets();
FfiTargets Fp8DecodeGemmCudaTargets();
FfiTargets SwigluCudaTargets();
FfiTargets UninitializedTargets();  // uninitialized_ffi.cc
}  // namespace jax_moe

PYBIND11_MODULE(_jax_moe_cuda, m) {
  using namespace jax_moe;
  m.doc() = "jax_moe CUDA FFI handlers";
  DefineModuleCommon(m, {PermuteCudaTargets, RouteCudaTargets, GroupedGemmCudaTargets, DecodeGemmCudaTargets,
                         Fp8GemmCudaTargets, Fp8DecodeGemmCudaTargets, SwigluCudaTargets, UninitializedTargets});
  m.def("grouped_matmul_workspace_bytes", &GroupedGemmWorkspaceBytes, pybind11::arg("num_groups"),
        "Workspace bytes the grouped GEMM needs for num_groups experts (sized for any Hopper GPU).");
  m.def("fp8_grouped_matmul_workspace_bytes", &Fp8GroupedGemmWorkspaceBytes, pybind11::arg("num_groups"),
        "Workspace bytes the FP8 grouped GEMM needs for num_groups experts.");
  m.def("decode_route_slices", &DecodeRouteSlices, pybind11::arg("hidden"),
        "Slices of H the decode router's reduction is split into (the leading axis of its partial sums).");
}
