// The input gradient's large tile configuration of the grouped GEMM, in its own file:
// CUTLASS kernels compile slowly, and separate files compile in parallel.
#include "grouped_gemm_cutlass.cuh"

namespace jax_moe::gemm {

JAX_MOE_DEFINE_GEMM_CONFIG(InputGradLargeM, LargeM<GemmOp::kInputGrad>)

}  // namespace jax_moe::gemm
