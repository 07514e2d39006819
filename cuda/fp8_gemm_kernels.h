// The FP8 grouped GEMM, past decode's few rows per expert: DeepSeek-V3's block-scaled e4m3 experts
// on Hopper's FP8 tensor cores (CUTLASS's ptr-array blockwise-scaled mainloop).
// For each local expert g owning rows [offsets[g], offsets[g + 1]):
//   out[rows of g] = (q_rows * row_scale) @ (w_q[g] * w_scale[g])^T     accumulated in float32
// with the rows quantised per 1 x 128 group of each row (QuantizeRows below) and the weights in
// the checkpoint's own layout: w_q [El, N, K] float8_e4m3fn (K contiguous: FP8 wgmma reads both
// operands K-major), w_scale [El, N / 128, K / 128] float32 (DeepSeek-V3's weight_scale_inv).
// Groups read on the device, per-group arguments in the caller's workspace, no allocation.
#ifndef JAX_MOE_FP8_GEMM_KERNELS_H_
#define JAX_MOE_FP8_GEMM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_moe {

struct Fp8GroupedGemmArgs {
  const void* a;                  // [>= out_rows, K] float8_e4m3fn rows, grouped by expert
  const float* a_scale;           // [>= out_rows, K / 128]: each 1 x 128 group's dequantisation factor
  const void* b;                  // [El, N, K] float8_e4m3fn
  const float* b_scale;           // [El, N / 128, K / 128]
  const int32_t* expert_offsets;  // [El + 1]
  void* out;                      // [out_rows, N] bf16; rows in no group zero
  void* workspace;                // 128-byte aligned
  size_t workspace_bytes;
  int64_t out_rows, num_groups, k, n;  // K and N multiples of 128
  int tile_rows;                       // CUTLASS's row tile: 128 (cooperative) or 64 (ping-pong)
};

size_t Fp8GroupedGemmWorkspaceBytes(int64_t num_groups);
cudaError_t LaunchFp8GroupedGemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream);

// Rows [R, K] bf16 -> q [R, K] float8_e4m3fn and scale [R, K / 128] float32, per 1 x 128 group:
// scale = max |x| * (1 / 448) (1 for an all-zero group), q = x * (1 / scale) rounded to nearest
// (saturating), each step an IEEE float32 operation: jax_moe.fp8.quantize_rows bit for bit.
cudaError_t LaunchQuantizeRows(const void* rows, void* q, float* scale, int64_t num_rows, int64_t k,
                               cudaStream_t stream);

// SwiGLU's activation of hidden [R, 2F] bf16 (gate columns, then up), quantised for the down
// projection: q [R, F] float8_e4m3fn and scale [R, F / 128] = LaunchQuantizeRows of the activation
// silu(gate) * up, computed in float32 and rounded to bf16 (jax_moe.gemm.gated_silu). F % 128 == 0.
cudaError_t LaunchSwigluQuantize(const void* hidden, void* q, float* scale, int64_t num_rows, int64_t ffn,
                                 cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_FP8_GEMM_KERNELS_H_
