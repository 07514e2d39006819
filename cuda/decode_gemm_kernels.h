// The decode grouped GEMM: few rows per expert (T <= 64 or so), every expert's weights streamed
// from HBM once by all SMs. For each local expert g owning rows [offsets[g], offsets[g + 1]):
//   out[rows of g] = rows[rows of g] @ w[g]                      (w [El, K, N], out [R, N])
//   gated:  out[rows of g] = silu(rows @ w[g][:, :F]) * (rows @ w[g][:, F:])   (out [R, F], N = 2F)
// A CUDA-core kernel of our own rather than CUTLASS: at a few rows per expert a tensor-core tile
// is mostly padding, the setup kernel and its launch cost more than the rows' arithmetic, and the
// SwiGLU activation folds into the gate/up product's epilogue. No workspace, no host sync, no
// allocation; the groups are read on the device; the result is deterministic (fixed summation
// order) and rows in no group come out zero.
// fp8_decode_gemm_kernels.h is the same idea for FP8 experts, on FP8 tensor cores.
#ifndef JAX_MOE_DECODE_GEMM_KERNELS_H_
#define JAX_MOE_DECODE_GEMM_KERNELS_H_

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
  // rows takes several passes, blocks of their own that run side by side, so the later ones can
  // read the weights from L2. The caller picks it from the rows it expects per expert.
  int rows_per_pass;
  // Optional (shared_weights non-null): a dense product in the same launch, one more slot at the
  // grid's end: shared_out = shared_x @ shared_weights (gated as above), as if one more expert
  // owned every row of shared_x. A shared expert at decode then streams its weights beside the
  // routed experts' instead of in launches of its own, too small to keep the SMs streaming.
  const void* shared_x = nullptr;        // [shared_rows, shared_k] bf16
  const void* shared_weights = nullptr;  // [shared_k, shared_n] bf16
  void* shared_out = nullptr;            // [shared_rows, gated ? shared_n / 2 : shared_n] bf16
  int64_t shared_rows = 0, shared_k = 0, shared_n = 0;
};

cudaError_t LaunchDecodeGemm(const DecodeGemmArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_DECODE_GEMM_KERNELS_H_
