// The prefill tile configuration of the grouped GEMM (its own file: CUTLASS kernels compile slowly).
#include "grouped_gemm_impl.cuh"

namespace jax_moe::gemm {

cudaError_t RunLargeM(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream) {
  return RunGemm<LargeM>(args, sm_count, stream);
}
size_t LargeMWorkspaceBytes(int64_t num_groups) { return CutlassWorkspaceBytes<LargeM>(num_groups); }

}  // namespace jax_moe::gemm
