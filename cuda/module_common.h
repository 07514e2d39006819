// What both pybind11 modules (cpu_module.cc, cuda_module.cc) define alike: their handlers as
// PyCapsules for jax.ffi.register_ffi_target, the constants Python reads (constants.h) and the
// scratch workspace's size (workspace_layout.h).
#ifndef JAX_MOE_MODULE_COMMON_H_
#define JAX_MOE_MODULE_COMMON_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>

#include "constants.h"
#include "ffi_common.h"
#include "workspace_layout.h"

namespace jax_moe {

// Defines registrations() (target name -> capsule, over the families' targets), constants() and
// workspace_words() on module m.
inline void DefineModuleCommon(pybind11::module_& m, std::initializer_list<FfiTargets (*)()> families) {
  FfiTargets targets;
  for (auto family : families)
    for (const FfiTarget& target : family()) targets.push_back(target);
  m.def("registrations", [targets] {
    pybind11::dict handlers;
    for (const FfiTarget& target : targets) handlers[target.name] = pybind11::capsule(reinterpret_cast<void*>(target.handler));
    return handlers;
  }, "The FFI handlers by target name, as PyCapsules for jax.ffi.register_ffi_target.");
  m.def("constants", [] {
    pybind11::dict values;
    ForEachConstant([&](const char* name, int64_t value) { values[name] = value; });
    return values;
  }, "The constants and enum values the kernels and Python share (cuda/constants.h), by name.");
  m.def("workspace_words", &ScratchWorkspaceWords, pybind11::arg("routes"), pybind11::arg("num_local"),
        pybind11::arg("gemm_bytes"),
        "int32 words of the scratch's workspace for T_max * k routes over num_local experts and the "
        "grouped GEMMs' workspace bytes (cuda/workspace_layout.h).");
}

}  // namespace jax_moe

#endif  // JAX_MOE_MODULE_COMMON_H_
