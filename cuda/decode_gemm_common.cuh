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
  int index;  // -1: fewer passes than the slot
  int start, end;
};

// Passes of at most kRowsPerPass rows an expert owning `rows` rows takes.
template <int kRowsPerPass>
__device__ __forceinline__ int Passes(int rows) {
  return rows > 0 ? 1 + (rows - 1) / kRowsPerPass : 0;
}

// The most passes `rows` rows over `groups` experts can take (each owning expert's last one may be partial).
__host__ __device__ inline int64_t MaxPasses(int64_t rows, int64_t groups, int rows_per_pass) {
  const int64_t owners = groups < rows ? groups : rows;
  return (rows + owners * (rows_per_pass - 1)) / rows_per_pass;
}

constexpr int kWholeGroups = 1 << 30;  // FindGroup's kRowsPerPass for one slot per expert, whatever its rows
constexpr int64_t kMaxRoutedSlots = 65534;  // a grid's y extent (65,535) less the shared product's slot

// Whether a routed slot is one pass (its expert's passes in adjacent slots) rather than all of one
// expert's rows: a slot a pass unless the passes could overflow the grid. Host (the grid) and
// device (FindGroup) decide alike.
__host__ __device__ inline bool SlotPerPass(int64_t rows, int64_t groups, int rows_per_pass) {
  return MaxPasses(rows, groups, rows_per_pass) <= kMaxRoutedSlots;
}

// The slot-th pass of at most kRowsPerPass rows, in expert order, over the experts that own rows
// (offsets clamped to out_rows): its expert and rows, for every thread of the block. Each thread
// counts its share of experts' passes, a block scan ranks them. Consecutive slots are the passes of
// one expert, so blocks that run together stream the same weights and all but the first read them
// from L2. (A template: the divisions are shifts, and each instance has its own shared memory.)
template <int kRowsPerPass>
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
    count += Passes<kRowsPerPass>(Clamp(offsets[g + 1], start, out_rows) - start);
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
      const int end = Clamp(offsets[g + 1], start, out_rows), passes = Passes<kRowsPerPass>(end - start);
      if (slot < rank + passes) {
        const int pass_start = start + (slot - rank) * kRowsPerPass;
        found = Group{g, pass_start, end - pass_start > kRowsPerPass ? pass_start + kRowsPerPass : end};
        break;
      }
      rank += passes;
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
