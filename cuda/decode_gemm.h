// The decode grouped GEMM: few rows per expert (T <= 64 or so), every expert's weights streamed
// from HBM once by all SMs. For each local expert g owning rows [offsets[g], offsets[g + 1]):
//   out[rows of g] = rows[rows of g] @ w[g]                      (w [El, K, N], out [R, N])
//   gated:  out[rows of g] = silu(rows @ w[g][:, :F]) * (rows @ w[g][:, F:])   (out [R, F], N = 2F)
// A CUDA-core kernel of our own rather than CUTLASS: at a few rows per expert a tensor-core tile
// is mostly padding, the setup kernel and its launch cost more than the rows' arithmetic, and the
// SwiGLU activation folds into the gate/up product's epilogue. No workspace, no host sync, no
// allocation; the groups are read on the device; the result is deterministic (fixed summation
// order) and rows in no group come out zero.
// (FP8 experts run on the FP8 grouped GEMM at every size: grouped_gemm_fp8.h.)
#ifndef JAX_MOE_DECODE_GEMM_H_
#define JAX_MOE_DECODE_GEMM_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_moe {

struct DecodeGemmArgs {
  const void* rows;               // [>= out_rows, K] bf16, grouped by expert
  const void* weights;            // [El, K, N] bf16
  const int32_t* expert_offsets;  // [El + 1], clamped to out_rows
  void* out;                      // [out_rows, gated ? N / 2 : N] bf16
  int64_t out_rows, num_groups, k, n;
  bool gated;
  // Rows of one expert computed per pass over its weights (1, 2, 4 or 8): an expert with more
  // rows takes several passes (the later ones mostly from L2). The caller picks it from the rows
  // it expects per expert.
  int rows_per_pass;
};

cudaError_t LaunchDecodeGemm(const DecodeGemmArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_DECODE_GEMM_H_
