// Launchers of the CUDA permute/unpermute kernels: the routing contract's layout (jax_moe.reference
// is its definition; permute_cpu.cc the CPU twin they match bit for bit).
#ifndef JAX_MOE_PERMUTE_KERNELS_H_
#define JAX_MOE_PERMUTE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "constants.h"
#include "workspace_layout.h"

namespace jax_moe {

// Up to one tile of routes, one launch does routing and row copies (every block routes redundantly).
constexpr int64_t kFusedMaxRoutes = kTileRoutes;

enum class FloatType { kF32, kBF16, kF16 };

struct PermuteArgs {
  const void* x;               // [T, H]
  const int32_t* topk_ids;     // [T, k]
  const int32_t* expert_map;   // [E], or nullptr for the identity map
  void* permuted;              // [capacity, H]
  int32_t* src_index;          // [capacity]
  int32_t* dest_index;         // [T_max, k]
  int32_t* group_sizes;        // [El]
  int32_t* expert_offsets;     // [El + 1]
  int32_t* workspace;          // the scratch's: RoutingWorkspaceWords (workspace_layout.h)
  int64_t num_tokens, top_k, num_experts, num_local, capacity, row_bytes, align, workspace_size;
  // Optional (permute_prefetch, the one-launch path only): more blocks (as many as the launcher
  // sizes) ask L2 for the first prefetch_bytes (a multiple of 128) of each routed local expert's
  // slab of prefetch_expert_bytes in prefetch [El, ...], the weights the next GEMM reads first.
  const void* prefetch = nullptr;
  int64_t prefetch_expert_bytes = 0, prefetch_bytes = 0;
};

struct UnpermuteArgs {
  const void* y;               // [capacity, H]
  const void* topk_weights;    // [T, k]
  const int32_t* dest_index;   // [>= T, k]
  void* out;                   // [T, H]
  int64_t num_tokens, top_k, hidden, capacity;
  FloatType row_type, weight_type;
  // Optional, [T, H] of y's dtype: out = residual + (sum + addend), each sum rounded to y's dtype
  // as separate elementwise adds would round it (a layer's shared expert and its residual add).
  const void* addend = nullptr;
  const void* residual = nullptr;
};

// Unpermute's backward: d_y[r] = w[s] * d_out[s / k] for the route s = src_index[r] of row r
// (zero for rows of no route), d_weights[t, j] = <y[dest_index[t, j]], d_out[t]> (zero when dropped).
struct UnpermuteGradArgs {
  const void* d_out;           // [T, H]
  const void* y;               // [R, H]
  const void* topk_weights;    // [T, k]
  const int32_t* dest_index;   // [T, k]
  const int32_t* src_index;    // [R]
  void* d_y;                   // [R, H], y's dtype
  float* d_weights;            // [T, k]
  int64_t num_tokens, top_k, hidden, num_rows;
  FloatType row_type, weight_type;
};

// permute's rows made again from their routes, for a backward that recomputes them rather than
// keep them: out_i[dest_index[t, j]] = x_i[t] for each array i, and zero rows where no route
// points (src_index[r] = -1: padding, rows past the live ones). src_index must be dest_index's
// inverse (ops.invert_dest). Each token's row is read once and written to its k rows, one launch
// for up to kMaxGatherArrays (constants.h) arrays of one row size, 16-byte vectors.
struct GatherRowsArgs {
  const void* x[kMaxGatherArrays];  // [T, row_bytes] each
  void* out[kMaxGatherArrays];      // [R, row_bytes] each
  int num_arrays;
  const int32_t* dest_index;        // [T, top_k]: each route's row, or -1 (dropped)
  const int32_t* src_index;         // [R]: the flat route t * top_k + j of each row, or -1
  int64_t num_tokens, top_k, num_rows, row_bytes;  // row_bytes a multiple of 16
};

cudaError_t LaunchPermute(const PermuteArgs& args, cudaStream_t stream);
// permute for FP8 experts: the same indices, and instead of the rows (args.permuted is not written)
// each kept row quantised per 1 x 128 group as QuantizeRows quantises (fp8_gemm_kernels.h):
// q_rows [>= live rows, H] float8_e4m3fn, row_scale [>= live rows, H / 128] float32 (padding rows
// as zero rows quantise: zero bytes, scale 1; rows past the live ones unwritten). x bf16 with H a
// multiple of 128. Always the four-launch path (prefill-sized routes).
cudaError_t LaunchPermuteQuantized(const PermuteArgs& args, void* q_rows, float* row_scale, cudaStream_t stream);
cudaError_t LaunchUnpermute(const UnpermuteArgs& args, cudaStream_t stream);
cudaError_t LaunchUnpermuteGrad(const UnpermuteGradArgs& args, cudaStream_t stream);
cudaError_t LaunchGatherRows(const GatherRowsArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_PERMUTE_KERNELS_H_
