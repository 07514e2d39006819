// The weight gradient's configuration of the grouped GEMM (its M is the forward's K, never small,
// so always the large tile, with wider epilogue stores: WeightGradM), in its own file: CUTLASS
// kernels compile slowly, separate files in parallel.
#include "grouped_gemm_cutlass.cuh"

namespace jax_moe::gemm {

JAX_MOE_DEFINE_GEMM_CONFIG(WeightGrad, WeightGradM)

}  // namespace jax_moe::gemm
