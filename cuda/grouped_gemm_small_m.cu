// The decode tile configuration of the grouped GEMM (its own file: CUTLASS kernels compile slowly).
#include "grouped_gemm_impl.cuh"

namespace jax_moe::gemm {

cudaError_t RunSmallM(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream) {
  return RunGemm<SmallM>(args, sm_count, stream);
}
size_t SmallMWorkspaceBytes(int64_t num_groups) { return CutlassWorkspaceBytes<SmallM>(num_groups); }

}  // namespace jax_moe::gemm
