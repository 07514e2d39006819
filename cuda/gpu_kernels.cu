// CUDA permute/unpermute: a deterministic counting sort by local expert, then row copies in
// 16-byte vectors. Small problems (decode) run in one launch; large ones in four:
//   tile counts -> per-expert prefix over tiles -> stable ranks and indices -> row copies.
// Stable ranks come from warp match/ballot and per-warp counters in a fixed order, never from
// global atomics, so the layout is the contract's argsort(local_id, stable=True) exactly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "gpu_kernels.h"
#include "permute_block.cuh"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == kPermuteWarps && kThreads >= kFewRoutes, "permute_block.cuh's block sizes");
constexpr int kMaxFusedBlocks = 264;  // two waves of blocks on an H100/H200

__host__ __device__ __forceinline__ int64_t CopyBlocks(int64_t num_tokens, int64_t vecs_per_row) {
  return (num_tokens * vecs_per_row + kThreads - 1) / kThreads;
}

// ---- Fused path: every block routes all R <= kFusedMaxRoutes routes in shared memory, block 0
// ---- writes the indices, and all blocks share the row copies. One launch.
template <typename V>
__global__ void __launch_bounds__(kThreads) PermuteFusedKernel(PermuteArgs a, int rank_warps) {
  extern __shared__ int32_t shared[];
  // This block's first row vector does not depend on the routing: its load overlaps it.
  const int64_t vecs_per_row = a.row_bytes / sizeof(V);
  const int64_t first_vector = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  V first_value;
  const bool loaded = LoadTokenVector<V>(a, first_vector, vecs_per_row, &first_value);

  const int64_t routes = a.num_tokens * a.top_k;
  const BlockRoutes routed =
      routes <= kFewRoutes ? RankFewRoutesInBlock(a, shared) : RankRoutesInBlock(a, rank_warps, shared);
  const int32_t* rows = routed.rows;
  const int32_t* counts = routed.counts;
  const int32_t* offsets = routed.offsets;
  if (blockIdx.x == 0) StoreRouteIndices(a, routed);
  MarkUnusedRows(a, offsets, counts);

  const int64_t chunks = (vecs_per_row + blockDim.x - 1) / blockDim.x;
  auto token_rows = [&](int64_t t) { return rows + t * a.top_k; };
  if (loaded) StoreTokenVector<V>(a, first_vector, vecs_per_row, first_value, token_rows);
  for (int64_t i = first_vector + static_cast<int64_t>(gridDim.x) * kThreads; i < a.num_tokens * vecs_per_row;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    V value;
    LoadTokenVector<V>(a, i, vecs_per_row, &value);
    StoreTokenVector<V>(a, i, vecs_per_row, value, token_rows);
  }
  if (a.align > 1) {
    for (int64_t item = blockIdx.x; item < a.num_local * chunks; item += gridDim.x) {
      const int64_t e = item / chunks, v = (item % chunks) * blockDim.x + threadIdx.x;
      if (v < vecs_per_row) ZeroRowsVector<V>(a, offsets[e] + counts[e], offsets[e + 1], v, vecs_per_row);
    }
  }
}

// ---- Large path, launch 1: per-tile expert counts, stored expert-major: workspace[e * tiles + b].
__global__ void __launch_bounds__(kThreads) TileCountKernel(PermuteArgs a, int tiles) {
  extern __shared__ int32_t counts[];
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t routes = a.num_tokens * a.top_k;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kTileRoutes;
  const int64_t end = min(routes, begin + kTileRoutes);
  for (int64_t r = begin + threadIdx.x; r < end; r += blockDim.x) {
    const int e = LocalExpert(a.topk_ids[r], a);
    if (e >= 0) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) a.workspace[e * tiles + blockIdx.x] = counts[e];
}

// Launch 2: one warp per expert turns its tile counts into exclusive prefixes (the first row of
// each tile inside the expert's segment), stores the expert's total and its padded group size.
__global__ void __launch_bounds__(kThreads) TilePrefixKernel(PermuteArgs a, int tiles) {
  const int lane = threadIdx.x & 31;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (e >= a.num_local) return;
  int32_t* tile_counts = a.workspace + e * tiles;
  int32_t running = 0;
  for (int base = 0; base < tiles; base += 32) {
    const int b = base + lane;
    const int32_t count = b < tiles ? tile_counts[b] : 0;
    const int32_t inclusive = WarpInclusiveScan(count);
    if (b < tiles) tile_counts[b] = running + inclusive - count;
    running += __shfl_sync(~0u, inclusive, 31);
  }
  if (lane == 0) {
    a.workspace[a.num_local * tiles + e] = running;
    a.group_sizes[e] = RoundUp(running, static_cast<int32_t>(a.align));
  }
}

// Launch 3: stable ranks inside each tile (RankSlice per warp, warps in order, tiles in order).
// Writes dest_index, src_index, expert_offsets and the unused-row markers.
__global__ void __launch_bounds__(kThreads) RankKernel(PermuteArgs a, int tiles, int rank_warps) {
  extern __shared__ int32_t shared[];
  const int num_local = static_cast<int>(a.num_local);
  int32_t* offsets = shared;                     // [El + 1]
  int32_t* warp_rows = offsets + num_local + 1;  // [rank_warps][El]
  BlockScanPadded(a.group_sizes, offsets, num_local, 1);
  for (int i = threadIdx.x; i < rank_warps * num_local; i += blockDim.x) warp_rows[i] = 0;
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e <= num_local; e += blockDim.x) a.expert_offsets[e] = offsets[e];
  __syncthreads();

  const int warp = threadIdx.x >> 5;
  const int64_t routes = a.num_tokens * a.top_k;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kTileRoutes + warp * RankSliceLength(rank_warps);
  const int64_t end = min(routes, begin + RankSliceLength(rank_warps));
  int experts[kMaxRoutesPerLane];
  if (warp < rank_warps) {
    LoadSliceExperts(a, begin, end, experts);
    CountSlice(begin, end, experts, warp_rows + warp * num_local);
  }
  __syncthreads();
  const int32_t* tile_first = a.workspace + blockIdx.x;  // workspace[e * tiles + tile]
  WarpCountsToRows(warp_rows, num_local, rank_warps,
                   [&](int e) { return offsets[e] + tile_first[static_cast<int64_t>(e) * tiles]; });
  __syncthreads();
  if (warp < rank_warps) {
    RankSlice(begin, end, experts, warp_rows + warp * num_local, [&](int64_t r, int32_t row) {
      a.dest_index[r] = row;
      if (row >= 0) a.src_index[row] = static_cast<int32_t>(r);
    });
  }
  MarkUnusedRows(a, offsets, a.workspace + a.num_local * tiles);
}

// Launch 4: row copies (CopyBlocks blocks), then one block per (expert, chunk) zeroes padding rows.
template <typename V>
__global__ void __launch_bounds__(kThreads) CopyRowsKernel(PermuteArgs a, int64_t chunks, int tiles) {
  const int64_t vecs_per_row = a.row_bytes / sizeof(V);
  const int64_t copy_blocks = CopyBlocks(a.num_tokens, vecs_per_row);
  if (blockIdx.x < copy_blocks) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    V value;
    if (LoadTokenVector<V>(a, i, vecs_per_row, &value))
      StoreTokenVector<V>(a, i, vecs_per_row, value, [&](int64_t t) { return a.dest_index + t * a.top_k; });
  } else {
    const int64_t item = blockIdx.x - copy_blocks;
    const int64_t e = item / chunks, v = (item % chunks) * blockDim.x + threadIdx.x;
    const int32_t kept = a.workspace[a.num_local * tiles + e];
    if (v < vecs_per_row)
      ZeroRowsVector<V>(a, a.expert_offsets[e] + kept, a.expert_offsets[e + 1], v, vecs_per_row);
  }
}

template <typename V>
cudaError_t LaunchPermuteTyped(const PermuteArgs& a, cudaStream_t stream) {
  const int64_t routes = a.num_tokens * a.top_k;
  const int64_t vecs_per_row = a.row_bytes / sizeof(V);
  const int64_t chunks = (vecs_per_row + kThreads - 1) / kThreads;
  const int64_t padding_items = a.align > 1 ? a.num_local * chunks : 0;
  // Shared ints per block: rank_warps per-warp counter rows of El beside the other arrays.
  const int64_t fused_ints = RouteRowsInts(routes, a.num_local);
  // (at least one counter row, or the few routes' two arrays)
  const int64_t least_ints = fused_ints + (routes <= kFewRoutes ? 2 * routes : a.num_local);
  if (routes <= kFusedMaxRoutes && least_ints <= kPermuteSharedInts) {
    const int rank_warps = PermuteRankWarps(routes, fused_ints, a.num_local);
    // Every block routes all R routes again: enough blocks to stream the copies, no more.
    const int64_t blocks = std::clamp<int64_t>(CopyBlocks(a.num_tokens, vecs_per_row) + padding_items, 1, kMaxFusedBlocks);
    const int64_t ints = routes <= kFewRoutes ? RankFewRoutesInts(routes, a.num_local)
                                              : RankRoutesInts(routes, a.num_local, rank_warps);
    PermuteFusedKernel<V><<<blocks, kThreads, ints * 4, stream>>>(a, rank_warps);
    return cudaGetLastError();
  }
  const int tiles = static_cast<int>((routes + kTileRoutes - 1) / kTileRoutes);
  if (a.workspace_size < a.num_local * (tiles + 1)) return cudaErrorInvalidValue;
  TileCountKernel<<<tiles, kThreads, a.num_local * 4, stream>>>(a, tiles);
  TilePrefixKernel<<<(a.num_local + kWarps - 1) / kWarps, kThreads, 0, stream>>>(a, tiles);
  const int rank_warps = PermuteRankWarps(kTileRoutes, a.num_local + 1, a.num_local);
  RankKernel<<<tiles, kThreads, (a.num_local + 1 + rank_warps * a.num_local) * 4, stream>>>(a, tiles, rank_warps);
  CopyRowsKernel<V><<<CopyBlocks(a.num_tokens, vecs_per_row) + padding_items, kThreads, 0, stream>>>(a, chunks, tiles);
  return cudaGetLastError();
}

// ---- Unpermute: one (token, chunk of vectors) per block; each thread sums its lanes over j in
// ---- ascending order in float32 with separately rounded product and sum (no FMA).
template <typename Row>
struct RowTraits;
template <>
struct RowTraits<float> {
  __device__ static float ToFloat(float v) { return v; }
  __device__ static float FromFloat(float v) { return v; }
};
template <>
struct RowTraits<__nv_bfloat16> {
  __device__ static float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 FromFloat(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct RowTraits<__half> {
  __device__ static float ToFloat(__half v) { return __half2float(v); }
  __device__ static __half FromFloat(float v) { return __float2half_rn(v); }
};

template <typename Row, int kVec>
struct alignas(sizeof(Row) * kVec) RowVector {
  Row lanes[kVec];
};

// One thread per 16-byte vector of one token's output, summing over j in order. Measured on the
// H200 (T = 16384, DeepSeek-V3 rows): this plain loop reached 97% of the cudaMemcpy rate, while
// issuing 2, 4 or 8 routes' loads before the sums gave 86%, 69% and 40%.
template <typename Row, typename Weight, int kVec>
__global__ void __launch_bounds__(kThreads) UnpermuteKernel(UnpermuteArgs a) {
  using Vector = RowVector<Row, kVec>;
  const int64_t vecs_per_row = a.hidden / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= a.num_tokens * vecs_per_row) return;
  const int64_t t = i / vecs_per_row, v = i % vecs_per_row;
  const Vector* y = reinterpret_cast<const Vector*>(a.y);
  const Weight* weights = reinterpret_cast<const Weight*>(a.topk_weights);
  // The addends do not depend on the routes: their loads go out first.
  Vector addend, residual;
  if (a.addend != nullptr) addend = reinterpret_cast<const Vector*>(a.addend)[i];
  if (a.residual != nullptr) residual = reinterpret_cast<const Vector*>(a.residual)[i];
  float acc[kVec];
#pragma unroll
  for (int l = 0; l < kVec; ++l) acc[l] = 0.0f;
  for (int j = 0; j < a.top_k; ++j) {
    const int32_t row = a.dest_index[t * a.top_k + j];
    if (row < 0 || row >= a.capacity) continue;  // dropped: never read
    const float w = RowTraits<Weight>::ToFloat(weights[t * a.top_k + j]);
    const Vector rows = y[row * vecs_per_row + v];
#pragma unroll
    for (int l = 0; l < kVec; ++l) acc[l] = __fadd_rn(acc[l], __fmul_rn(w, RowTraits<Row>::ToFloat(rows.lanes[l])));
  }
  Vector result;
#pragma unroll
  for (int l = 0; l < kVec; ++l) result.lanes[l] = RowTraits<Row>::FromFloat(acc[l]);
  // Each add in float32, rounded to Row: a correctly rounded add of two Row values (float32 holds
  // more than twice their bits), what an elementwise add of the rounded sum gives.
  using T = RowTraits<Row>;
  if (a.addend != nullptr) {
#pragma unroll
    for (int l = 0; l < kVec; ++l)
      result.lanes[l] = T::FromFloat(__fadd_rn(T::ToFloat(result.lanes[l]), T::ToFloat(addend.lanes[l])));
  }
  if (a.residual != nullptr) {
#pragma unroll
    for (int l = 0; l < kVec; ++l)
      result.lanes[l] = T::FromFloat(__fadd_rn(T::ToFloat(residual.lanes[l]), T::ToFloat(result.lanes[l])));
  }
  reinterpret_cast<Vector*>(a.out)[i] = result;
}

template <typename Row, typename Weight, int kVec>
cudaError_t LaunchUnpermuteTyped(const UnpermuteArgs& a, cudaStream_t stream) {
  const int64_t blocks = (a.num_tokens * (a.hidden / kVec) + kThreads - 1) / kThreads;
  UnpermuteKernel<Row, Weight, kVec><<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename Row, typename Weight>
cudaError_t LaunchUnpermuteRows(const UnpermuteArgs& a, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(Row);
  const bool aligned = ((reinterpret_cast<uintptr_t>(a.y) | reinterpret_cast<uintptr_t>(a.out) |
                         reinterpret_cast<uintptr_t>(a.addend) | reinterpret_cast<uintptr_t>(a.residual)) % 16) == 0;
  if (aligned && a.hidden % kVec16 == 0) return LaunchUnpermuteTyped<Row, Weight, kVec16>(a, stream);
  return LaunchUnpermuteTyped<Row, Weight, 1>(a, stream);
}

template <typename Row>
cudaError_t LaunchUnpermuteWeights(const UnpermuteArgs& a, cudaStream_t stream) {
  return a.weight_type == FloatType::kF32 ? LaunchUnpermuteRows<Row, float>(a, stream)
                                          : LaunchUnpermuteRows<Row, __nv_bfloat16>(a, stream);
}

// ---- Unpermute's backward, one launch in two roles. Row blocks: one thread per 16-byte vector of
// d_y, d_y[r] = w[s] * d_out[s / k] for the route s of row r (src_index), each product rounded
// once, zero for rows of no route. Route blocks: one warp per route (t, j), the float32 dot
// product <y[dest[t, j]], d_out[t]> summed lane-strided then by a fixed butterfly (deterministic).
template <typename Row, typename Weight, int kVec>
__global__ void __launch_bounds__(kThreads) UnpermuteGradKernel(UnpermuteGradArgs a, int64_t row_blocks) {
  using Vector = RowVector<Row, kVec>;
  const int64_t vecs_per_row = a.hidden / kVec;
  const int64_t num_routes = a.num_tokens * a.top_k;
  const Vector* d_out = reinterpret_cast<const Vector*>(a.d_out);
  const Weight* weights = reinterpret_cast<const Weight*>(a.topk_weights);
  if (blockIdx.x < row_blocks) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (i >= a.num_rows * vecs_per_row) return;
    const int64_t r = i / vecs_per_row, v = i % vecs_per_row;
    const int32_t route = a.src_index[r];
    Vector result;
    if (route >= 0 && route < num_routes) {
      const float w = RowTraits<Weight>::ToFloat(weights[route]);
      const Vector g = d_out[(route / a.top_k) * vecs_per_row + v];
#pragma unroll
      for (int l = 0; l < kVec; ++l) result.lanes[l] = RowTraits<Row>::FromFloat(__fmul_rn(w, RowTraits<Row>::ToFloat(g.lanes[l])));
    } else {
#pragma unroll
      for (int l = 0; l < kVec; ++l) result.lanes[l] = RowTraits<Row>::FromFloat(0.0f);
    }
    reinterpret_cast<Vector*>(a.d_y)[i] = result;
    return;
  }
  const int lane = threadIdx.x & 31;
  const int64_t route = (static_cast<int64_t>(blockIdx.x) - row_blocks) * kWarps + (threadIdx.x >> 5);
  if (route >= num_routes) return;
  const int32_t row = a.dest_index[route];
  float acc = 0.0f;
  if (row >= 0 && row < a.num_rows) {
    const Vector* y = reinterpret_cast<const Vector*>(a.y) + row * vecs_per_row;
    const Vector* g = d_out + (route / a.top_k) * vecs_per_row;
    for (int64_t v = lane; v < vecs_per_row; v += 32) {
      const Vector yv = y[v], gv = g[v];
#pragma unroll
      for (int l = 0; l < kVec; ++l)
        acc = __fadd_rn(acc, __fmul_rn(RowTraits<Row>::ToFloat(yv.lanes[l]), RowTraits<Row>::ToFloat(gv.lanes[l])));
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(~0u, acc, d));
  if (lane == 0) a.d_weights[route] = acc;
}

template <typename Row, typename Weight, int kVec>
cudaError_t LaunchUnpermuteGradTyped(const UnpermuteGradArgs& a, cudaStream_t stream) {
  const int64_t row_blocks = (a.num_rows * (a.hidden / kVec) + kThreads - 1) / kThreads;
  const int64_t route_blocks = (a.num_tokens * a.top_k + kWarps - 1) / kWarps;
  if (row_blocks + route_blocks == 0) return cudaSuccess;
  UnpermuteGradKernel<Row, Weight, kVec><<<row_blocks + route_blocks, kThreads, 0, stream>>>(a, row_blocks);
  return cudaGetLastError();
}

template <typename Row, typename Weight>
cudaError_t LaunchUnpermuteGradRows(const UnpermuteGradArgs& a, cudaStream_t stream) {
  constexpr int kVec16 = 16 / sizeof(Row);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(a.y) | reinterpret_cast<uintptr_t>(a.d_out) | reinterpret_cast<uintptr_t>(a.d_y)) %
       16) == 0;
  if (aligned && a.hidden % kVec16 == 0) return LaunchUnpermuteGradTyped<Row, Weight, kVec16>(a, stream);
  return LaunchUnpermuteGradTyped<Row, Weight, 1>(a, stream);
}

template <typename Row>
cudaError_t LaunchUnpermuteGradWeights(const UnpermuteGradArgs& a, cudaStream_t stream) {
  return a.weight_type == FloatType::kF32 ? LaunchUnpermuteGradRows<Row, float>(a, stream)
                                          : LaunchUnpermuteGradRows<Row, __nv_bfloat16>(a, stream);
}

// ---- Rows by their routes, one launch in two roles, one thread per 16-byte vector of a row.
// Token blocks: load the token's vector of every array once (all loads before the stores), store
// it to each of the token's routed rows. Zero blocks: rows no route points at get zeros.
__global__ void __launch_bounds__(kThreads) GatherRowsKernel(GatherRowsArgs a, int64_t token_blocks) {
  const int64_t vecs_per_row = a.row_bytes / 16;
  if (blockIdx.x < token_blocks) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (i >= a.num_tokens * vecs_per_row) return;
    const int64_t t = i / vecs_per_row, v = i % vecs_per_row;
    uint4 values[kMaxGatherArrays];
#pragma unroll
    for (int n = 0; n < kMaxGatherArrays; ++n)
      if (n < a.num_arrays) values[n] = static_cast<const uint4*>(a.x[n])[i];
    for (int64_t j = 0; j < a.top_k; ++j) {
      const int32_t row = a.dest_index[t * a.top_k + j];
      if (row < 0 || row >= a.num_rows) continue;  // dropped
#pragma unroll
      for (int n = 0; n < kMaxGatherArrays; ++n)
        if (n < a.num_arrays) static_cast<uint4*>(a.out[n])[row * vecs_per_row + v] = values[n];
    }
    return;
  }
  // One warp per row: most rows have a route and need nothing here.
  const int64_t row = (static_cast<int64_t>(blockIdx.x) - token_blocks) * kWarps + (threadIdx.x >> 5);
  if (row >= a.num_rows) return;
  const int32_t route = a.src_index[row];
  if (route >= 0 && route < a.num_tokens * a.top_k) return;  // a token block writes it
  for (int64_t v = threadIdx.x & 31; v < vecs_per_row; v += 32)
#pragma unroll
    for (int n = 0; n < kMaxGatherArrays; ++n)
      if (n < a.num_arrays) static_cast<uint4*>(a.out[n])[row * vecs_per_row + v] = make_uint4(0, 0, 0, 0);
}

}  // namespace

cudaError_t LaunchGatherRows(const GatherRowsArgs& a, cudaStream_t stream) {
  uintptr_t addresses = 0;
  for (int n = 0; n < a.num_arrays; ++n)
    addresses |= reinterpret_cast<uintptr_t>(a.x[n]) | reinterpret_cast<uintptr_t>(a.out[n]);
  if (a.num_arrays < 1 || a.num_arrays > kMaxGatherArrays || a.top_k < 1 || a.row_bytes % 16 != 0 ||
      addresses % 16 != 0 || a.num_rows < 0 || a.num_tokens < 0)
    return cudaErrorInvalidValue;
  const int64_t token_blocks = (a.num_tokens * (a.row_bytes / 16) + kThreads - 1) / kThreads;
  const int64_t blocks = token_blocks + (a.num_rows + kWarps - 1) / kWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  GatherRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, token_blocks);
  return cudaGetLastError();
}

cudaError_t LaunchPermute(const PermuteArgs& a, cudaStream_t stream) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.permuted);
  if (a.row_bytes % 16 == 0 && addresses % 16 == 0) return LaunchPermuteTyped<uint4>(a, stream);
  if (a.row_bytes % 4 == 0 && addresses % 4 == 0) return LaunchPermuteTyped<uint32_t>(a, stream);
  return LaunchPermuteTyped<uint16_t>(a, stream);
}

cudaError_t LaunchUnpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  switch (a.row_type) {
    case FloatType::kF32:
      return LaunchUnpermuteWeights<float>(a, stream);
    case FloatType::kBF16:
      return LaunchUnpermuteWeights<__nv_bfloat16>(a, stream);
    case FloatType::kF16:
      return LaunchUnpermuteWeights<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchUnpermuteGrad(const UnpermuteGradArgs& a, cudaStream_t stream) {
  switch (a.row_type) {
    case FloatType::kF32:
      return LaunchUnpermuteGradWeights<float>(a, stream);
    case FloatType::kBF16:
      return LaunchUnpermuteGradWeights<__nv_bfloat16>(a, stream);
    case FloatType::kF16:
      return LaunchUnpermuteGradWeights<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_moe
