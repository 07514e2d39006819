// The FP8 grouped GEMM's 128-row cooperative configuration, in its own file: CUTLASS kernels compile
// slowly, and separate files compile in parallel.
#include "fp8_gemm_cutlass.cuh"

namespace jax_moe::fp8gemm {

JAX_MOE_DEFINE_FP8_GEMM_CONFIG(Rows128, Rows128)

}  // namespace jax_moe::fp8gemm
