// The bf16 decode grouped GEMM (decode_gemm_kernels.h). Grid: x = a tile of output columns, y = a
// slot: block (x, y) finds the y-th pass (up to rows_per_pass rows of one expert; an expert's passes
// are consecutive slots) and streams that expert's [K, tile] weight columns over the pass's rows.
// With a shared product the last slot streams the shared weights over every row of shared_x; where
// passes could overflow the grid, a routed slot passes over all of its expert's rows (SlotPerPass).
// Within a block each lane owns 8 consecutive columns (one 16-byte load per k row) and 8 consecutive
// k rows per step (one 16-byte load of each row's x); lanes and warps split K, and a fixed-order
// reduction sums their parts.
#include <cuda_bf16.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "bf16_vector.cuh"
#include "decode_gemm_common.cuh"
#include "decode_gemm_kernels.h"
#include "grouped_gemm_kernels.h"

namespace jax_moe {
namespace {

constexpr int kStepRows = 8;  // k rows a lane takes per step
// Steps whose loads a lane issues before their arithmetic: 2 steps of 8 x 16 bytes, 256 bytes per lane.
constexpr int kInFlight = 2;

// acc[m][c] += sum over the step's 8 k rows i of x[m][i] * w[i][c], for the pass's live rows.
template <int kRowsPerPass>
__device__ __forceinline__ void Accumulate(float (&acc)[kRowsPerPass][8], const uint4 (&w)[kStepRows],
                                           const Bf16* x, int64_t k, int rows_now) {
  float wf[kStepRows][8];
#pragma unroll
  for (int i = 0; i < kStepRows; ++i) Unpack(w[i], wf[i]);
#pragma unroll
  for (int m = 0; m < kRowsPerPass; ++m) {
    if (m < rows_now) {
      float xf[8];
      Unpack(__ldg(reinterpret_cast<const uint4*>(x + m * k)), xf);
#pragma unroll
      for (int i = 0; i < kStepRows; ++i)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[m][c] = __fmaf_rn(xf[i], wf[i][c], acc[m][c]);
    }
  }
}

// kSplit > 1: the blocks of a thread-block cluster of kSplit (grid z) take consecutive K ranges of
// the same columns; each sums its warps' parts, then cluster rank 0 sums the ranks' parts in rank
// order through distributed shared memory and writes the result (one launch, deterministic). For
// grids too small to keep every SM streaming (a shared expert at T = 1: one group, 32-64 blocks).
template <int kVectors, int kRowsPerPass, bool kGated, int kSplit>
__global__ void __launch_bounds__(kThreads) DecodeGemmKernel(DecodeGemmArgs p) {
  constexpr int kLanesK = 32 / kVectors;            // k-row groups a warp covers at once
  constexpr int kTileCols = kVectors * 8;           // weight columns a block reads
  constexpr int kOutCols = kGated ? kTileCols / 2 : kTileCols;  // out columns it writes
  constexpr int64_t kStep = kWarps * kLanesK * kStepRows;       // k rows the block covers per step
  __shared__ float partial[kWarps][kRowsPerPass][kTileCols];
  __shared__ float block_sum[kSplit > 1 ? kRowsPerPass : 1][kSplit > 1 ? kTileCols : 1];
  const int split = kSplit > 1 ? static_cast<int>(blockIdx.z) : 0;

  // The last slot takes the shared product, when there is one (decode_gemm_kernels.h).
  const bool shared = p.shared_weights != nullptr && blockIdx.y == gridDim.y - 1;
  const Bf16* rows = static_cast<const Bf16*>(shared ? p.shared_x : p.rows);
  Bf16* out = static_cast<Bf16*>(shared ? p.shared_out : p.out);
  const int64_t k = shared ? p.shared_k : p.k, n = shared ? p.shared_n : p.n;
  const int64_t out_width = kGated ? n / 2 : n;
  const int64_t out_col0 = static_cast<int64_t>(blockIdx.x) * kOutCols;
  if (out_col0 >= out_width) return;  // the grid spans the wider of the two products
  const int out_rows = static_cast<int>(p.out_rows);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lane_k = lane / kVectors, vec = lane % kVectors;

  // This lane's 8 weight columns. A gated tile reads its out columns' gate half (the first
  // kVectors / 2 lanes) and the matching up half (the rest).
  int64_t col;
  bool col_ok;
  if constexpr (kGated) {
    constexpr int kHalf = kVectors / 2;
    const int64_t out_col = out_col0 + (vec % kHalf) * 8;
    col = out_col + (vec < kHalf ? 0 : out_width);
    col_ok = out_col < out_width;
  } else {
    col = out_col0 + vec * 8;
    col_ok = col < n;
  }

  // Rows past the live count are in no group: zero them (slot 0's blocks, one column tile each).
  if (blockIdx.y == 0 && !shared && split == 0) {
    const int live = Clamp(p.expert_offsets[p.num_groups], 0, out_rows);
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(out_rows - live) * kOutCols; i += kThreads) {
      const int64_t c = out_col0 + i % kOutCols;
      if (c < out_width) out[(live + i / kOutCols) * out_width + c] = __float2bfloat16_rn(0.0f);
    }
  }
  const int num_groups = static_cast<int>(p.num_groups), slot = static_cast<int>(blockIdx.y);
  const Group group = shared ? Group{0, 0, static_cast<int>(p.shared_rows)}
                      : SlotPerPass(p.out_rows, p.num_groups, kRowsPerPass)
                          ? FindGroup<kRowsPerPass>(p.expert_offsets, num_groups, out_rows, slot)
                          : FindGroup<kWholeGroups>(p.expert_offsets, num_groups, out_rows, slot);
  if (group.index < 0) return;
  const Bf16* weights = static_cast<const Bf16*>(shared ? p.shared_weights : p.weights) + group.index * k * n + col;

  // This block's K range: whole steps of 8 rows.
  const int64_t k_chunk = kSplit > 1 ? (k / kStepRows + kSplit - 1) / kSplit * kStepRows : k;
  const int64_t k_begin = split * k_chunk;
  const int64_t k_end = k_begin + k_chunk < k ? k_begin + k_chunk : k;
  const uint64_t policy = EvictFirstPolicy();

  // One pass for a routed slot of a pass; several for the shared slot (every row of shared_x) or a
  // slot of a whole expert's rows.
  for (int first_row = group.start; first_row < group.end; first_row += kRowsPerPass) {
    const int rows_now = min(kRowsPerPass, group.end - first_row);
    const Bf16* x = rows + static_cast<int64_t>(first_row) * k;
    float acc[kRowsPerPass][8];
#pragma unroll
    for (int m = 0; m < kRowsPerPass; ++m)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[m][c] = 0.0f;
    // kInFlight steps' loads in flight per lane before their arithmetic (bf16: 4 steps measured no
    // faster than 2; neither did refilling each step's registers as soon as it is consumed).
    for (int64_t k0 = k_begin + static_cast<int64_t>(warp * kLanesK + lane_k) * kStepRows; k0 < k_end;
         k0 += kInFlight * kStep) {
      uint4 w[kInFlight][kStepRows];
#pragma unroll
      for (int s = 0; s < kInFlight; ++s) {
        const bool load = col_ok && k0 + s * kStep < k_end;
#pragma unroll
        for (int i = 0; i < kStepRows; ++i) w[s][i] = load ? LoadStreaming(weights + (k0 + s * kStep + i) * n, policy) : uint4{};
      }
#pragma unroll
      for (int s = 0; s < kInFlight; ++s)
        if (k0 + s * kStep < k_end) Accumulate<kRowsPerPass>(acc, w[s], x + k0 + s * kStep, k, rows_now);
    }
    // Sum the lanes that share columns (a fixed butterfly), then the warps in order.
#pragma unroll
    for (int m = 0; m < kRowsPerPass; ++m)
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int d = kVectors; d < 32; d <<= 1) acc[m][c] = __fadd_rn(acc[m][c], __shfl_xor_sync(0xffffffffu, acc[m][c], d));
    if (lane_k == 0) {
#pragma unroll
      for (int m = 0; m < kRowsPerPass; ++m)
#pragma unroll
        for (int c = 0; c < 8; ++c) partial[warp][m][vec * 8 + c] = acc[m][c];
    }
    __syncthreads();
    if constexpr (kSplit > 1) {
      // Each rank sums its warps; rank 0 then sums the ranks in order (rank 0's part first).
      for (int i = threadIdx.x; i < rows_now * kTileCols; i += kThreads) {
        const int m = i / kTileCols, j = i % kTileCols;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum = __fadd_rn(sum, partial[w][m][j]);
        block_sum[m][j] = sum;
      }
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      cluster.sync();  // every rank's block_sum is written
      if (split == 0) {
        for (int i = threadIdx.x; i < rows_now * kTileCols; i += kThreads) {
          const int m = i / kTileCols, j = i % kTileCols;
          float sum = block_sum[m][j];
#pragma unroll
          for (int r = 1; r < kSplit; ++r) sum = __fadd_rn(sum, cluster.map_shared_rank(&block_sum[0][0], r)[m * kTileCols + j]);
          partial[0][m][j] = sum;  // rank 0's warps are done with partial: the epilogue reads row 0
        }
      }
      cluster.sync();  // rank 0 has read the others' parts: they may start their next pass
      __syncthreads();
    }
    for (int i = threadIdx.x; i < rows_now * kOutCols; i += kThreads) {
      const int m = i / kOutCols, j = i % kOutCols;
      if (kSplit > 1 && split != 0) break;
      if (out_col0 + j >= out_width) continue;
      constexpr int kParts = kSplit > 1 ? 1 : kWarps;  // split: rank 0's partial[0] holds the sums
      float result = 0.0f;
      if constexpr (kGated) {
        // As the CUTLASS path: the gate/up product rounded to bf16, the activation in float32.
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int w = 0; w < kParts; ++w) {
          gate = __fadd_rn(gate, partial[w][m][j]);
          up = __fadd_rn(up, partial[w][m][kOutCols + j]);
        }
        gate = __bfloat162float(__float2bfloat16_rn(gate));
        up = __bfloat162float(__float2bfloat16_rn(up));
        result = __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);
      } else {
#pragma unroll
        for (int w = 0; w < kParts; ++w) result = __fadd_rn(result, partial[w][m][j]);
      }
      out[static_cast<int64_t>(first_row + m) * out_width + out_col0 + j] = __float2bfloat16_rn(result);
    }
    __syncthreads();  // before the next pass overwrites `partial`
  }
}


// A launch's shape: the tile width (wide: 128 weight columns, each warp reading 256 contiguous
// bytes per k row; narrow: 64), a K split over clusters of `split` blocks, and the grid: (tiles of
// the wider product, slots: the routed passes there can be, then the shared product's), of which
// `working` blocks have columns to compute.
struct DecodeShape {
  bool wide;
  int split;
  int64_t tiles, slots, working;
};

// Bytes of weights the busiest SM streams: each SM streams at about its share of the copy rate, so
// a launch lasts about as long as its busiest SM, which holds ceil(blocks / SMs) of them (Qwen3-30B's
// gate/up at T = 1: 192 narrow blocks, two on some SMs, 16.9 us where its 50 MB alone take 11.8).
int64_t BusiestSmBytes(const DecodeShape& shape, int64_t k) {
  const int sms = GemmSmCount();
  const int64_t wave = sms > 0 ? sms : kWaveBlocks;
  return (shape.working * shape.split + wave - 1) / wave * (k / shape.split) * (shape.wide ? 128 : 64) * 2;
}

// The shape: wide tiles while they fill more than a wave of blocks, narrow ones otherwise; then a K
// split while the grid is at most half a wave (kWaveBlocks). (Choosing the width by BusiestSmBytes
// was slower where it picked narrow tiles for large grids: that cost decides only whether a shared
// product joins. Tiles of 32 columns were slower too where they would even out the SMs' bytes,
// Qwen3-30B's gate/up at T = 1 23.5 us vs 20.7 on an H100: past two resident blocks an SM, 120
// registers a thread, the third runs as a second round; and 25.7 us held to 80 registers (some spilled)
// so that three blocks an SM fit.)
DecodeShape ShapeOf(const DecodeGemmArgs& args) {
  const bool gated = args.gated, shared = args.shared_weights != nullptr;
  const int64_t routed_slots = SlotPerPass(args.out_rows, args.num_groups, args.rows_per_pass)
                                   ? MaxPasses(args.out_rows, args.num_groups, args.rows_per_pass)
                                   : std::min(args.num_groups, args.out_rows);
  const int64_t routed_width = gated ? args.n / 2 : args.n, shared_width = gated ? args.shared_n / 2 : args.shared_n;
  const int64_t k = std::min(routed_slots > 0 ? args.k : INT64_MAX, shared ? args.shared_k : INT64_MAX);
  auto shape_of = [&](bool wide) {
    const int64_t out_cols = (gated ? 32 : 64) * (wide ? 2 : 1);
    const int64_t routed_tiles = routed_slots > 0 ? (routed_width + out_cols - 1) / out_cols : 0;
    const int64_t shared_tiles = shared ? (shared_width + out_cols - 1) / out_cols : 0;
    return DecodeShape{wide, 1, std::max(routed_tiles, shared_tiles), routed_slots + (shared ? 1 : 0),
                       routed_tiles * routed_slots + shared_tiles};
  };
  const DecodeShape wide = shape_of(true);
  DecodeShape shape = wide.working > kWaveBlocks ? wide : shape_of(false);
  const int64_t k_steps = k / kStepRows;
  for (int split : {4, 2})
    if (split * shape.working <= kWaveBlocks && k_steps >= split * kWarps * (32 / (shape.wide ? 16 : 8))) {
      shape.split = split;
      break;
    }
  return shape;
}

template <int kVectors, int kRowsPerPass, bool kGated, int kSplit>
cudaError_t LaunchSplit(const DecodeGemmArgs& args, const DecodeShape& shape, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(shape.tiles), static_cast<unsigned>(shape.slots), kSplit);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = kSplit;
  config.attrs = &cluster;
  config.numAttrs = kSplit > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, DecodeGemmKernel<kVectors, kRowsPerPass, kGated, kSplit>, args);
}

template <int kVectors, int kRowsPerPass, bool kGated>
cudaError_t Launch(const DecodeGemmArgs& args, const DecodeShape& shape, cudaStream_t stream) {
  switch (shape.split) {
    case 4:
      return LaunchSplit<kVectors, kRowsPerPass, kGated, 4>(args, shape, stream);
    case 2:
      return LaunchSplit<kVectors, kRowsPerPass, kGated, 2>(args, shape, stream);
  }
  return LaunchSplit<kVectors, kRowsPerPass, kGated, 1>(args, shape, stream);
}

template <int kVectors, bool kGated>
cudaError_t LaunchRows(const DecodeGemmArgs& args, const DecodeShape& shape, cudaStream_t stream) {
  switch (args.rows_per_pass) {
    case 1:
      return Launch<kVectors, 1, kGated>(args, shape, stream);
    case 2:
      return Launch<kVectors, 2, kGated>(args, shape, stream);
    case 4:
      return Launch<kVectors, 4, kGated>(args, shape, stream);
    case 8:
      return Launch<kVectors, 8, kGated>(args, shape, stream);
  }
  return cudaErrorInvalidValue;
}

template <bool kGated>
cudaError_t LaunchShaped(const DecodeGemmArgs& args, cudaStream_t stream) {
  const DecodeShape shape = ShapeOf(args);
  return shape.wide ? LaunchRows<16, kGated>(args, shape, stream) : LaunchRows<8, kGated>(args, shape, stream);
}

cudaError_t LaunchOne(const DecodeGemmArgs& args, cudaStream_t stream) {
  return args.gated ? LaunchShaped<true>(args, stream) : LaunchShaped<false>(args, stream);
}

// Whether the shared product joins the routed experts' launch: when that leaves the busiest SM no
// more bytes than the two launches apart (BusiestSmBytes; a launch of its own costs its start and
// its tail besides). So a shared expert fills a routed grid's last wave, but does not join a grid
// where its blocks would make some SMs stream one block more (DeepSeek-V3's gate/up at T = 1).
bool SharedJoinsLaunch(const DecodeGemmArgs& args) {
  if (args.out_rows == 0) return true;
  DecodeGemmArgs routed = args, shared = args;
  routed.shared_weights = nullptr;
  shared.out_rows = 0;
  return BusiestSmBytes(ShapeOf(args), std::max(args.k, args.shared_k)) <=
         BusiestSmBytes(ShapeOf(routed), args.k) + BusiestSmBytes(ShapeOf(shared), args.shared_k);
}

}  // namespace

cudaError_t LaunchDecodeGemm(const DecodeGemmArgs& args, cudaStream_t stream) {
  if (args.k % 8 != 0 || args.n % (args.gated ? 16 : 8) != 0 || args.num_groups < 1 ||
      args.num_groups > kMaxRoutedSlots || args.out_rows < 0 || args.out_rows > (int64_t{1} << 30) ||
      (args.rows_per_pass != 1 && args.rows_per_pass != 2 && args.rows_per_pass != 4 && args.rows_per_pass != 8))
    return cudaErrorInvalidValue;
  if (args.shared_weights != nullptr &&
      (args.shared_k < 8 || args.shared_k % 8 != 0 || args.shared_n < 8 || args.shared_n % (args.gated ? 16 : 8) != 0 ||
       args.shared_rows < 1 || args.shared_rows > (int64_t{1} << 30)))
    return cudaErrorInvalidValue;
  if (args.out_rows == 0 && args.shared_weights == nullptr) return cudaSuccess;
  if (args.shared_weights == nullptr || SharedJoinsLaunch(args)) return LaunchOne(args, stream);
  // Apart: the routed experts' launch, then the shared product's alone (its only slot).
  DecodeGemmArgs routed = args, shared = args;
  routed.shared_weights = nullptr;
  shared.out_rows = 0;
  const cudaError_t status = args.out_rows > 0 ? LaunchOne(routed, stream) : cudaSuccess;
  return status != cudaSuccess ? status : LaunchOne(shared, stream);
}

}  // namespace jax_moe
