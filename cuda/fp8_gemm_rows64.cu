// The FP8 grouped GEMM's 64-row ping-pong configuration, in its own file: CUTLASS kernels compile
// slowly, and separate files compile in parallel.
#include "fp8_gemm_cutlass.cuh"

namespace jax_moe::fp8gemm {

JAX_MOE_DEFINE_FP8_GEMM_CONFIG(Rows64, Rows64)

}  // namespace jax_moe::fp8gemm
