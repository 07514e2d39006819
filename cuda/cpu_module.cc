// The CPU module _jax_moe_cpu: every CPU handler family, the constants and the workspace's size.
#include <pybind11/pybind11.h>

#include "ffi_common.h"
#include "module_common.h"

namespace jax_moe {
// Each family's handlers and their target names, defined in its file.
FfiTargets PermuteCpuTargets();      // permute_cpu.cc
FfiTargets GroupedGemmCpuTargets();  // grouped_gemm_cpu.cc
FfiTargets UninitializedTargets();   // uninitialized_ffi.cc
}  // namespace jax_moe

PYBIND11_MODULE(_jax_moe_cpu, m) {
  using namespace jax_moe;
  m.doc() = "jax_moe CPU FFI handlers";
  DefineModuleCommon(m, {PermuteCpuTargets, GroupedGemmCpuTargets, UninitializedTargets});
}
