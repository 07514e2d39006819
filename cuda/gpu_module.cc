// Exposes the CUDA handlers to Python as PyCapsules for jax.ffi.register_ffi_target.
#include <pybind11/pybind11.h>

#include "gpu_ops.h"
#include "grouped_gemm.h"
#include "grouped_gemm_fp8.h"
#include "route_kernels.h"

namespace {
pybind11::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return pybind11::capsule(reinterpret_cast<void*>(handler));
}
}  // namespace

PYBIND11_MODULE(_jax_moe_cuda, m) {
  m.doc() = "jax_moe CUDA FFI handlers";
  m.def("registrations", [] {
    pybind11::dict handlers;
    handlers["jax_moe_permute"] = Capsule(JaxMoePermuteCuda);
    handlers["jax_moe_permute_prefetch"] = Capsule(JaxMoePermutePrefetchCuda);
    handlers["jax_moe_permute_fp8"] = Capsule(JaxMoePermuteFp8Cuda);
    handlers["jax_moe_unpermute"] = Capsule(JaxMoeUnpermuteCuda);
    handlers["jax_moe_unpermute_add"] = Capsule(JaxMoeUnpermuteAddCuda);
    handlers["jax_moe_unpermute_grad"] = Capsule(JaxMoeUnpermuteGradCuda);
    handlers["jax_moe_gather_rows"] = Capsule(JaxMoeGatherRowsCuda);
    handlers["jax_moe_grouped_matmul"] = Capsule(JaxMoeGroupedMatmulCuda);
    handlers["jax_moe_grouped_matmul_into"] = Capsule(JaxMoeGroupedMatmulIntoCuda);
    handlers["jax_moe_decode_matmul"] = Capsule(JaxMoeDecodeMatmulCuda);
    handlers["jax_moe_decode_matmul_shared"] = Capsule(JaxMoeDecodeMatmulSharedCuda);
    handlers["jax_moe_decode_route"] = Capsule(JaxMoeDecodeRouteCuda);
    handlers["jax_moe_decode_route_norm"] = Capsule(JaxMoeDecodeRouteNormCuda);
    handlers["jax_moe_choose_experts"] = Capsule(JaxMoeChooseExpertsCuda);
    handlers["jax_moe_fp8_grouped_matmul"] = Capsule(JaxMoeFp8GroupedMatmulCuda);
    handlers["jax_moe_fp8_swiglu_experts"] = Capsule(JaxMoeFp8SwigluExpertsCuda);
    handlers["jax_moe_fp8_swiglu_quantized_experts"] = Capsule(JaxMoeFp8SwigluQuantizedExpertsCuda);
    handlers["jax_moe_fp8_decode_swiglu"] = Capsule(JaxMoeFp8DecodeSwigluCuda);
    handlers["jax_moe_fp8_decode_swiglu_shared"] = Capsule(JaxMoeFp8DecodeSwigluSharedCuda);
    handlers["jax_moe_swiglu_backward"] = Capsule(JaxMoeSwigluBackwardCuda);
    handlers["jax_moe_bench_noop"] = Capsule(JaxMoeNoopCuda);
    handlers["jax_moe_bench_copy"] = Capsule(JaxMoeCopyCuda);
    handlers["jax_moe_uninitialized"] = Capsule(JaxMoeUninitializedCuda);
    return handlers;
  });
  m.def("grouped_matmul_workspace_bytes", &jax_moe::GroupedGemmWorkspaceBytes, pybind11::arg("num_groups"),
        "Workspace bytes the grouped GEMM needs for num_groups experts (sized for any Hopper GPU).");
  m.def("fp8_grouped_matmul_workspace_bytes", &jax_moe::Fp8GroupedGemmWorkspaceBytes, pybind11::arg("num_groups"),
        "Workspace bytes the FP8 grouped GEMM needs for num_groups experts.");
  m.def("decode_route_slices", &jax_moe::DecodeRouteSlices, pybind11::arg("hidden"),
        "Slices of H the decode router's reduction is split into (the leading axis of its partial sums).");
}
