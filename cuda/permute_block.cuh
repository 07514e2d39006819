// Permute's device pieces, shared by its own kernels (gpu_kernels.cu) and the decode router, whose
// last block permutes the tokens it has just routed (route_kernels.cu): the stable counting sort of
// one problem's routes by local expert in one block's shared memory, the index stores, and the row
// copies in 16-byte vectors. Included by those two .cu files only.
#ifndef JAX_MOE_PERMUTE_BLOCK_CUH_
#define JAX_MOE_PERMUTE_BLOCK_CUH_

#include <algorithm>
#include <cstdint>

#include "gpu_kernels.h"

namespace jax_moe {
namespace {

constexpr int kPermuteWarps = 8;                   // warps of a block that ranks (256 threads)
constexpr int64_t kMinRoutesPerWarp = 128;
constexpr int64_t kPermuteSharedInts = 48 * 1024 / 4;  // the default dynamic shared memory limit

__device__ __forceinline__ int LocalExpert(int32_t id, const PermuteArgs& a) {
  if (id < 0 || id >= a.num_experts) return -1;
  if (a.expert_map == nullptr) return id;  // identity map: saves a dependent load at decode
  const int e = __ldg(a.expert_map + id);
  return (e >= 0 && e < a.num_local) ? e : -1;
}

__device__ __forceinline__ int32_t RoundUp(int32_t n, int32_t align) { return (n + align - 1) / align * align; }

__device__ __forceinline__ int32_t WarpInclusiveScan(int32_t value) {
  const int lane = threadIdx.x & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t other = __shfl_up_sync(~0u, value, d);
    if (lane >= d) value += other;
  }
  return value;
}

// offsets[0..n] = exclusive prefix sum of counts rounded up to align (offsets[n] = total).
// Whole block; counts may be in shared or global memory. Ends with a barrier.
__device__ void BlockScanPadded(const int32_t* counts, int32_t* offsets, int n, int32_t align) {
  __shared__ int32_t warp_totals[32];
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(n, begin + per_thread);
  int32_t own = 0;
  for (int i = begin; i < end; ++i) own += RoundUp(counts[i], align);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t inclusive = WarpInclusiveScan(own);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int32_t total = lane < static_cast<int>(blockDim.x >> 5) ? warp_totals[lane] : 0;
    const int32_t scanned = WarpInclusiveScan(total);
    __syncwarp();
    if (lane < static_cast<int>(blockDim.x >> 5)) warp_totals[lane] = scanned - total;
  }
  __syncthreads();
  int32_t running = warp_totals[warp] + inclusive - own;
  for (int i = begin; i < end; ++i) {
    offsets[i] = running;
    running += RoundUp(counts[i], align);
  }
  if (threadIdx.x == blockDim.x - 1) offsets[n] = running;
  __syncthreads();
}

// Permuted rows are written once and not read back by this kernel: streaming (evict-first) stores.
template <typename V>
__device__ __forceinline__ void StoreOnce(V* p, const V& v) {
  if constexpr (sizeof(V) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else {
    *p = v;
  }
}

// Row copies go by flat vector index i over x [T, H/V]: thread i loads x's vector once and stores
// it to each kept destination row of its token (token_rows(t) -> its k rows). Measured on the
// H200 (T = 16384, DeepSeek-V3 rows, % of the cudaMemcpy rate): one vector per thread with
// streaming stores 86.8%, two vectors with streaming stores 86.3%, two with plain stores 84.7%.
template <typename V>
__device__ __forceinline__ bool LoadTokenVector(const PermuteArgs& a, int64_t i, int64_t vecs_per_row, V* value) {
  if (i >= a.num_tokens * vecs_per_row) return false;
  *value = reinterpret_cast<const V*>(a.x)[i];
  return true;
}

template <typename V, typename TokenRows>
__device__ __forceinline__ void StoreTokenVector(const PermuteArgs& a, int64_t i, int64_t vecs_per_row, const V& value,
                                                 TokenRows token_rows) {
  const int64_t t = i / vecs_per_row, v = i % vecs_per_row;
  const int32_t* rows = token_rows(t);
  V* out = reinterpret_cast<V*>(a.permuted);
  for (int j = 0; j < a.top_k; ++j) {
    const int32_t row = rows[j];
    if (row >= 0) StoreOnce(out + row * vecs_per_row + v, value);
  }
}

template <typename V>
__device__ __forceinline__ void ZeroRowsVector(const PermuteArgs& a, int64_t begin, int64_t end, int64_t v,
                                               int64_t vecs_per_row) {
  V* out = reinterpret_cast<V*>(a.permuted);
  V zero;
  memset(&zero, 0, sizeof(V));
  for (int64_t row = begin; row < end; ++row) out[row * vecs_per_row + v] = zero;
}

// src_index = -1 on every padding row and every row past the live count, strided over the threads
// of the grid (the default) or of one block (first = threadIdx.x, stride = blockDim.x).
__device__ void MarkUnusedRows(const PermuteArgs& a, const int32_t* offsets, const int32_t* counts,
                               int64_t first = -1, int64_t stride = 0) {
  if (first < 0) {
    first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  }
  if (a.align > 1) {
    for (int64_t e = first; e < a.num_local; e += stride)
      for (int64_t row = offsets[e] + counts[e]; row < offsets[e + 1]; ++row) a.src_index[row] = -1;
  }
  for (int64_t row = offsets[a.num_local] + first; row < a.capacity; row += stride) a.src_index[row] = -1;
}

// ---- Stable ranking of one slice of routes by one warp. Each lane preloads its routes' experts
// ---- (independent loads in flight), then chunks of 32 go in flat order: match_any groups lanes
// ---- of one expert, a lane's rank is the count of its lower peers, and the group's lowest lane
// ---- advances the warp's per-expert counter. No atomics, so the order is fixed.
constexpr int kMaxRoutesPerLane = kTileRoutes / 32;

__device__ __forceinline__ void LoadSliceExperts(const PermuteArgs& a, int64_t begin, int64_t end,
                                                 int (&experts)[kMaxRoutesPerLane]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kMaxRoutesPerLane; ++i) {
    const int64_t r = begin + i * 32 + lane;
    experts[i] = r < end ? LocalExpert(a.topk_ids[r], a) : -1;
  }
}

// warp_counts[e] += routes of expert e in the slice.
__device__ __forceinline__ void CountSlice(int64_t begin, int64_t end, const int (&experts)[kMaxRoutesPerLane],
                                           int32_t* warp_counts) {
  const unsigned lanes_below = (1u << (threadIdx.x & 31)) - 1;
#pragma unroll
  for (int i = 0; i < kMaxRoutesPerLane; ++i) {
    if (begin + i * 32 >= end) break;  // warp-uniform
    const unsigned peers = __match_any_sync(~0u, experts[i]);
    if (experts[i] >= 0 && (peers & lanes_below) == 0) warp_counts[experts[i]] += __popc(peers);
    __syncwarp();
  }
}

// warp_rows[e] holds the next row of expert e for this slice; emit(r, row) for each route (-1 if
// dropped), in flat order.
template <typename Emit>
__device__ __forceinline__ void RankSlice(int64_t begin, int64_t end, const int (&experts)[kMaxRoutesPerLane],
                                          int32_t* warp_rows, Emit emit) {
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1;
#pragma unroll
  for (int i = 0; i < kMaxRoutesPerLane; ++i) {
    if (begin + i * 32 >= end) break;  // warp-uniform
    const int e = experts[i];
    const unsigned peers = __match_any_sync(~0u, e);
    const int64_t r = begin + i * 32 + lane;
    if (r < end) emit(r, e >= 0 ? warp_rows[e] + __popc(peers & lanes_below) : -1);
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) warp_rows[e] += __popc(peers);
    __syncwarp();
  }
}

// Turns per-warp counts into per-warp first rows, in warp order, starting at first_row(e).
template <typename FirstRow>
__device__ __forceinline__ void WarpCountsToRows(int32_t* warp_rows, int num_local, int rank_warps, FirstRow first_row) {
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t row = first_row(e);
    for (int w = 0; w < rank_warps; ++w) {
      const int32_t count = warp_rows[w * num_local + e];
      warp_rows[w * num_local + e] = row;
      row += count;
    }
  }
}

// Routes of a tile that each of rank_warps ranking warps owns (a contiguous slice).
__host__ __device__ __forceinline__ int64_t RankSliceLength(int rank_warps) { return kTileRoutes / rank_warps; }

// Ranking warps for a tile of routes: each ranks at least kMinRoutesPerWarp routes (small problems
// zero and scan fewer per-warp counter rows), and their counter rows [rank_warps][El] fit in
// shared memory beside other_ints.
inline int PermuteRankWarps(int64_t routes_in_tile, int64_t other_ints, int64_t num_local) {
  const int64_t by_routes = (routes_in_tile + kMinRoutesPerWarp - 1) / kMinRoutesPerWarp;
  const int64_t by_memory = (kPermuteSharedInts - other_ints) / num_local;
  return static_cast<int>(std::clamp<int64_t>(std::min(by_routes, by_memory), 1, kPermuteWarps));
}

// Shared ints of RankRoutesInBlock: rows [R], counts [El], offsets [El + 1], then per-warp counters.
__host__ __device__ __forceinline__ int64_t RouteRowsInts(int64_t routes, int64_t num_local) {
  return routes + 2 * num_local + 1;
}
__host__ __device__ __forceinline__ int64_t RankRoutesInts(int64_t routes, int64_t num_local, int rank_warps) {
  return RouteRowsInts(routes, num_local) + rank_warps * num_local;
}

struct BlockRoutes {
  int32_t* rows;     // [R] each route's permuted row, -1 when dropped
  int32_t* counts;   // [El] kept routes of each local expert (unpadded)
  int32_t* offsets;  // [El + 1] padded exclusive prefix of counts
};

// All R <= kTileRoutes routes of `a` ranked by one whole block in `shared` (RankRoutesInts ints),
// stable in flat route order: the contract's argsort(local id, stable=True). Ends with a barrier.
__device__ BlockRoutes RankRoutesInBlock(const PermuteArgs& a, int rank_warps, int32_t* shared) {
  const int64_t routes = a.num_tokens * a.top_k;
  const int num_local = static_cast<int>(a.num_local);
  BlockRoutes b{shared, shared + routes, shared + routes + num_local};
  int32_t* warp_rows = b.offsets + num_local + 1;  // [rank_warps][El]
  for (int i = threadIdx.x; i < rank_warps * num_local; i += blockDim.x) warp_rows[i] = 0;
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  const int64_t begin = warp * RankSliceLength(rank_warps);
  const int64_t end = min(routes, begin + RankSliceLength(rank_warps));
  int experts[kMaxRoutesPerLane];
  if (warp < rank_warps) {
    LoadSliceExperts(a, begin, end, experts);
    CountSlice(begin, end, experts, warp_rows + warp * num_local);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t total = 0;
    for (int w = 0; w < rank_warps; ++w) total += warp_rows[w * num_local + e];
    b.counts[e] = total;
  }
  __syncthreads();
  BlockScanPadded(b.counts, b.offsets, num_local, static_cast<int32_t>(a.align));
  WarpCountsToRows(warp_rows, num_local, rank_warps, [&](int e) { return b.offsets[e]; });
  __syncthreads();
  if (warp < rank_warps)
    RankSlice(begin, end, experts, warp_rows + warp * num_local, [&](int64_t r, int32_t row) { b.rows[r] = row; });
  __syncthreads();
  return b;
}

// Up to this many routes (decode: T * k), RankFewRoutesInBlock ranks them instead: rolled loops of
// a few instructions over the routes in shared memory. A layer's kernels at decode run with their
// code cold, fetched from L2 as it executes, and RankRoutesInBlock's unrolled warp loops, match
// and scans then cost more than the routes' arithmetic (5 us of the H200's decode layer).
constexpr int kFewRoutes = 64;

// Shared ints of RankFewRoutesInBlock: RouteRowsInts, then each route's local expert and padded count.
__host__ __device__ __forceinline__ int64_t RankFewRoutesInts(int64_t routes, int64_t num_local) {
  return RouteRowsInts(routes, num_local) + 2 * routes;
}

// RankRoutesInBlock's results for R <= min(kFewRoutes, blockDim.x) routes, bitwise: route r's row
// is the padded counts of the experts below its expert plus its expert's routes before it.
__device__ BlockRoutes RankFewRoutesInBlock(const PermuteArgs& a, int32_t* shared) {
  const int routes = static_cast<int>(a.num_tokens * a.top_k);
  const int num_local = static_cast<int>(a.num_local);
  const int32_t align = static_cast<int32_t>(a.align);
  BlockRoutes b{shared, shared + routes, shared + routes + num_local};
  int32_t* expert = b.offsets + num_local + 1;  // [R] local expert, -1 dropped
  int32_t* padded = expert + routes;            // [R] the expert's padded count at its first route, else 0
  const int r = threadIdx.x;
  const int e = r < routes ? LocalExpert(a.topk_ids[r], a) : -1;
  if (r < routes) expert[r] = e;
  __syncthreads();
  int32_t before = 0, count = 0;
  if (e >= 0) {
    for (int q = 0; q < routes; ++q) {
      const bool same = expert[q] == e;
      count += same;
      before += same && q < r;
    }
  }
  if (r < routes) padded[r] = e >= 0 && before == 0 ? RoundUp(count, align) : 0;
  __syncthreads();
  for (int g = threadIdx.x; g <= num_local; g += blockDim.x) {
    int32_t offset = 0, kept = 0;
    for (int q = 0; q < routes; ++q) {
      offset += expert[q] < g ? padded[q] : 0;  // dropped routes have padded 0
      kept += expert[q] == g;
    }
    b.offsets[g] = offset;
    if (g < num_local) b.counts[g] = kept;
  }
  __syncthreads();
  if (r < routes) b.rows[r] = e >= 0 ? b.offsets[e] + before : -1;
  __syncthreads();
  return b;
}

// The routes' indices from one block: group_sizes, expert_offsets, dest_index, src_index of the kept
// routes (MarkUnusedRows writes the other rows' src_index).
__device__ void StoreRouteIndices(const PermuteArgs& a, const BlockRoutes& b) {
  const int64_t routes = a.num_tokens * a.top_k;
  for (int e = threadIdx.x; e < a.num_local; e += blockDim.x) {
    a.group_sizes[e] = b.offsets[e + 1] - b.offsets[e];
    a.expert_offsets[e] = b.offsets[e];
  }
  if (threadIdx.x == 0) a.expert_offsets[a.num_local] = b.offsets[a.num_local];
  for (int r = threadIdx.x; r < routes; r += blockDim.x) {
    a.dest_index[r] = b.rows[r];
    if (b.rows[r] >= 0) a.src_index[b.rows[r]] = r;
  }
}

// One block's copies after RankRoutesInBlock: every token's row to its kept routes' rows (kBatch of
// each thread's loads in flight at once: the copy is a few round trips to L2, not a stream), then
// the padding rows zeroed.
template <typename V, int kBatch = 4>
__device__ void CopyRowsInBlock(const PermuteArgs& a, const BlockRoutes& b) {
  const int64_t vecs_per_row = a.row_bytes / sizeof(V), vectors = a.num_tokens * vecs_per_row;
  auto token_rows = [&](int64_t t) { return b.rows + t * a.top_k; };
  for (int64_t base = threadIdx.x; base < vectors; base += kBatch * blockDim.x) {
    V value[kBatch];
    bool loaded[kBatch];
#pragma unroll
    for (int m = 0; m < kBatch; ++m) loaded[m] = LoadTokenVector<V>(a, base + m * blockDim.x, vecs_per_row, &value[m]);
#pragma unroll
    for (int m = 0; m < kBatch; ++m)
      if (loaded[m]) StoreTokenVector<V>(a, base + m * blockDim.x, vecs_per_row, value[m], token_rows);
  }
  if (a.align > 1) {
    for (int64_t e = 0; e < a.num_local; ++e)
      for (int64_t v = threadIdx.x; v < vecs_per_row; v += blockDim.x)
        ZeroRowsVector<V>(a, b.offsets[e] + b.counts[e], b.offsets[e + 1], v, vecs_per_row);
  }
}

}  // namespace
}  // namespace jax_moe

#endif  // JAX_MOE_PERMUTE_BLOCK_CUH_
