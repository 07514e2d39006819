// Exposes the CPU handlers to Python as PyCapsules for jax.ffi.register_ffi_target.
#include <pybind11/pybind11.h>

#include "cpu_ops.h"

namespace {
pybind11::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return pybind11::capsule(reinterpret_cast<void*>(handler));
}
}  // namespace

PYBIND11_MODULE(_jax_moe_cpu, m) {
  m.doc() = "jax_moe CPU FFI handlers";
  m.def("registrations", [] {
    pybind11::dict handlers;
    handlers["jax_moe_permute"] = Capsule(JaxMoePermuteCpu);
    handlers["jax_moe_unpermute"] = Capsule(JaxMoeUnpermuteCpu);
    handlers["jax_moe_unpermute_grad"] = Capsule(JaxMoeUnpermuteGradCpu);
    handlers["jax_moe_bench_noop"] = Capsule(JaxMoeNoopCpu);
    handlers["jax_moe_bench_copy"] = Capsule(JaxMoeCopyCpu);
    handlers["jax_moe_uninitialized"] = Capsule(JaxMoeUninitializedCpu);
    handlers["jax_moe_grouped_dot"] = Capsule(JaxMoeGroupedDotCpu);
    handlers["jax_moe_grouped_dot_weight_grad"] = Capsule(JaxMoeGroupedDotWeightGradCpu);
    handlers["jax_moe_fp8_grouped_dot"] = Capsule(JaxMoeFp8GroupedDotCpu);
    return handlers;
  });
}
