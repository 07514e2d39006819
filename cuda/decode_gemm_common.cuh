// What the two decode GEMM kernels share (decode_gemm_kernels.cu: bf16 on CUDA cores;
// fp8_decode_gemm_kernels.cu: FP8 on mma.sync): the block size, finding a slot's expert, and the
// grid they aim for. Device code internal to each file that includes it (an anonymous namespace).
#ifndef JAX_MOE_DECODE_GEMM_COMMON_CUH_
#define JAX_MOE_DECODE_GEMM_COMMON_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

using Bf16 = __nv_bfloat16;

__device__ __forceinline__ int Clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

struct Group {
  int index;  // -1: fewer experts than the slot own rows
  int start, end;
};

// The slot-th expert, in expert order, that owns rows (offsets clamped to out_rows), for every
// thread of the block: each thread counts its share of experts, a block scan ranks them.
__device__ Group FindGroup(const int32_t* offsets, int num_groups, int out_rows, int slot) {
  __shared__ int warp_totals[kWarps];
  __shared__ Group found;
  if (threadIdx.x == 0) found = Group{-1, 0, 0};
  const int per_thread = (num_groups + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per_thread;
  const int last = min(first + per_thread, num_groups);
  int count = 0;
  for (int g = first; g < last; ++g) {
    const int start = Clamp(offsets[g], 0, out_rows);
    count += Clamp(offsets[g + 1], start, out_rows) > start;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = count;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int rank = inclusive - count;
  for (int w = 0; w < warp; ++w) rank += warp_totals[w];
  if (slot >= rank && slot < rank + count) {
    for (int g = first; g < last; ++g) {
      const int start = Clamp(offsets[g], 0, out_rows);
      const int end = Clamp(offsets[g + 1], start, out_rows);
      if (end == start) continue;
      if (rank == slot) {
        found = Group{g, start, end};
        break;
      }
      ++rank;
    }
  }
  __syncthreads();
  return found;
}

// One block per SM of a 132-SM H100/H200: the grid the bf16 kernel aims for. Measured on the H200
// at the four models' T = 1 shapes (kernel times, splits 1-8 x both tile widths): a grid of up to
// about one wave streams best as narrow tiles without a split (Qwen3-30B gate/up 16.4 us vs 18.7
// wide, Mixtral's down projection 57.8 vs 86.3 wide); a split only pays while the narrow grid
// is at most half a wave (DeepSeek-V3's shared gate/up, 64 blocks: 18.2 us split 2 vs 24.2), and
// clusters of 4 over a grid past one wave cost up to 30 % (Mixtral down 79.5 us at 256 blocks).
constexpr int64_t kWaveBlocks = 132;

}  // namespace
}  // namespace jax_moe

#endif  // JAX_MOE_DECODE_GEMM_COMMON_CUH_
