// Grouped GEMM of the expert layers on Hopper (CUTLASS sm90 ptr-array kernels): for each local
// expert g, out[rows of g] = rows[rows of g] @ w[g], with the groups read on the device from
// permute's expert_offsets. No host sync, no allocation: the per-group argument arrays and
// CUTLASS's workspace live in the caller's workspace buffer (the scratch's `workspace`).
#ifndef JAX_MOE_GROUPED_GEMM_H_
#define JAX_MOE_GROUPED_GEMM_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_moe {

// The workspace is sized for this many SMs (Hopper has at most 132); a device with more runs
// the persistent kernels on this many.
constexpr int kGemmMaxSms = 144;
// Operands are 16-byte aligned rows for TMA: K and N must be multiples of this (bf16 elements).
constexpr int64_t kGemmAlignElements = 8;

// Tile configurations, chosen at trace time from the expected rows per expert.
enum class GemmTile : int64_t {
  kSmallM = 0,  // 64 x 128 tiles, ping-pong warp groups: decode, few rows per expert
  kLargeM = 1,  // 128 x 256 tiles, cooperative, 1x2 cluster: prefill
};

struct GroupedGemmArgs {
  const void* rows;               // [>= out_rows, K] bf16, grouped by expert
  const void* weights;            // [El, K, N] bf16
  const int32_t* expert_offsets;  // [El + 1]: group g is rows [offsets[g], offsets[g + 1])
  void* out;                      // [out_rows, N] bf16; rows in no group are zero
  void* workspace;                // workspace_bytes, 128-byte aligned
  size_t workspace_bytes;
  int64_t out_rows, num_groups, k, n;
  GemmTile tile;
};

// Workspace bytes the grouped GEMM needs for num_groups experts (host arithmetic, no device).
size_t GroupedGemmWorkspaceBytes(int64_t num_groups);

cudaError_t LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_GROUPED_GEMM_H_
