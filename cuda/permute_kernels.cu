// CUDA permute/unpermute: a deterministic counting sort by local expert, then row copies in
// 16-byte vectors. Small problems (decode) run in one launch; large ones in four:
//   tile counts -> per-expert prefix over tiles -> stable ranks and indices -> row copies.
// Stable ranks come from warp match/ballot and per-warp counters in a fixed order, never from
// global atomics, so the layout is the contract's argsort(local_id, stable=True) exactly.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "bf16_vector.cuh"
#include "fp8_quantize.cuh"
#include "permute_kernels.h"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxFusedBlocks = 264;  // two waves of blocks on an H100/H200
constexpr int64_t kMinRoutesPerWarp = 128;
constexpr int64_t kSharedInts = 48 * 1024 / 4;  // default dynamic shared memory limit

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

// src_index = -1 on every padding row and every row past the live count. Grid-strided.
__device__ void MarkUnusedRows(const PermuteArgs& a, const int32_t* offsets, const int32_t* counts, int64_t blocks) {
  const int64_t stride = blocks * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
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
  const int64_t by_memory = (kSharedInts - other_ints) / num_local;
  return static_cast<int>(std::clamp<int64_t>(std::min(by_routes, by_memory), 1, kWarps));
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
// a few instructions over the routes in shared memory. At decode the launch is latency, not work:
// on the H200 at T = 1 these loops take it from 5.0 to 4.0 us (Qwen3-30B) and 5.2 to 4.7
// (DeepSeek-V3) against the unrolled warp ranks, match and scans of RankRoutesInBlock.
constexpr int kFewRoutes = 64;
static_assert(kFewRoutes <= kThreads, "RankFewRoutesInBlock gives each route a thread");

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

__host__ __device__ __forceinline__ int64_t CopyBlocks(int64_t num_tokens, int64_t vecs_per_row) {
  return (num_tokens * vecs_per_row + kThreads - 1) / kThreads;
}

// Streams the first prefetch_bytes of each routed local expert's matrix of a.prefetch into L2, one
// 128-byte line per prefetch, over `blocks` blocks (block `block` of them). A hint with no result:
// lines of experts that two routes share are asked for twice, which L2 merges.
__device__ void PrefetchRoutedExperts(const PermuteArgs& a, int64_t block, int64_t blocks) {
  const int64_t routes = a.num_tokens * a.top_k, lines = a.prefetch_bytes / kPrefetchLineBytes;
  const char* base = static_cast<const char*>(a.prefetch);
  for (int64_t i = block * kThreads + threadIdx.x; i < routes * lines; i += blocks * kThreads) {
    const int e = LocalExpert(__ldg(a.topk_ids + i / lines), a);
    if (e < 0) continue;
    const char* line = base + e * a.prefetch_expert_bytes + (i % lines) * kPrefetchLineBytes;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
}

// Blocks that prefetch for a.prefetch: about eight lines a thread, at most one block an SM of a
// 132-SM card (the prefetch is a hint; more blocks would only delay the permute's own).
int PrefetchBlocks(const PermuteArgs& a) {
  if (a.prefetch == nullptr) return 0;
  const int64_t lines = a.num_tokens * a.top_k * (a.prefetch_bytes / kPrefetchLineBytes);
  constexpr int64_t kLinesPerBlock = 8 * kThreads;
  return lines > 0 ? static_cast<int>(std::clamp<int64_t>((lines + kLinesPerBlock - 1) / kLinesPerBlock, 1, 132)) : 0;
}

// ---- Fused path: every block routes all R <= kFusedMaxRoutes routes in shared memory, block 0
// ---- writes the indices, and all blocks share the row copies. One launch.
// ---- Optional extra blocks at the end of the grid prefetch (PermuteArgs' prefetch).
template <typename V>
__global__ void __launch_bounds__(kThreads) PermuteFusedKernel(PermuteArgs a, int rank_warps, int prefetch_blocks) {
  extern __shared__ int32_t shared[];
  // The last prefetch_blocks blocks only start the experts' weights towards L2 (the HBM is
  // otherwise idle until the first expert GEMM streams them, a launch later).
  const int64_t work_blocks = gridDim.x - prefetch_blocks;
  if (blockIdx.x >= work_blocks) {
    PrefetchRoutedExperts(a, blockIdx.x - work_blocks, prefetch_blocks);
    return;
  }
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
  MarkUnusedRows(a, offsets, counts, work_blocks);

  const int64_t chunks = (vecs_per_row + blockDim.x - 1) / blockDim.x;
  auto token_rows = [&](int64_t t) { return rows + t * a.top_k; };
  if (loaded) StoreTokenVector<V>(a, first_vector, vecs_per_row, first_value, token_rows);
  for (int64_t i = first_vector + work_blocks * kThreads; i < a.num_tokens * vecs_per_row;
       i += work_blocks * kThreads) {
    V value;
    LoadTokenVector<V>(a, i, vecs_per_row, &value);
    StoreTokenVector<V>(a, i, vecs_per_row, value, token_rows);
  }
  if (a.align > 1) {
    for (int64_t item = blockIdx.x; item < a.num_local * chunks; item += work_blocks) {
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
  MarkUnusedRows(a, offsets, a.workspace + a.num_local * tiles, gridDim.x);
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

// Launch 4 of the large path for FP8 experts (LaunchPermuteQuantized): each thread quantises one
// 8-value piece of a token's bf16 row (a 1 x 128 group is 16 lanes of one half warp,
// QuantizeGroupPiece: the bytes of QuantizeRows on the permuted rows) and stores it, and the group's
// scale, to each of the token's kept rows. Blocks past the copies write the padding rows as
// QuantizeRows writes zero rows: zero bytes, scale 1. H is a multiple of 128, so a row's groups
// start on half-warp boundaries.
__global__ void __launch_bounds__(kThreads) CopyRowsQuantizedKernel(PermuteArgs a, uint2* q_rows, float* row_scale,
                                                                     int64_t chunks, int tiles) {
  const int64_t pieces_per_row = a.row_bytes / 16, groups_per_row = pieces_per_row / 16;
  const int64_t copy_blocks = CopyBlocks(a.num_tokens, pieces_per_row);
  if (blockIdx.x < copy_blocks) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    const bool live = i < a.num_tokens * pieces_per_row;
    float v[8];
    Unpack(live ? reinterpret_cast<const uint4*>(a.x)[i] : make_uint4(0, 0, 0, 0), v);
    uint2 packed;
    const float s = QuantizeGroupPiece(v, &packed);  // every lane of the warp reaches the shuffles
    if (!live) return;
    const int64_t t = i / pieces_per_row, piece = i % pieces_per_row;
    for (int j = 0; j < a.top_k; ++j) {
      const int32_t row = a.dest_index[t * a.top_k + j];
      if (row < 0) continue;
      q_rows[row * pieces_per_row + piece] = packed;
      if (piece % 16 == 0) row_scale[row * groups_per_row + piece / 16] = s;
    }
  } else {
    const int64_t item = blockIdx.x - copy_blocks;
    const int64_t e = item / chunks, piece = (item % chunks) * blockDim.x + threadIdx.x;
    const int32_t kept = a.workspace[a.num_local * tiles + e];
    if (piece >= pieces_per_row) return;
    for (int64_t row = a.expert_offsets[e] + kept; row < a.expert_offsets[e + 1]; ++row) {
      q_rows[row * pieces_per_row + piece] = make_uint2(0, 0);
      if (piece % 16 == 0) row_scale[row * groups_per_row + piece / 16] = 1.0f;  // an all-zero group's scale
    }
  }
}

// The large path's first three launches (tile counts, per-expert prefixes, stable ranks and
// indices), shared by the row copies of LaunchPermuteTyped and LaunchPermuteQuantized. Returns the
// number of route tiles, or -1 when the workspace cannot hold their counts (nothing launched).
int LaunchRankTiles(const PermuteArgs& a, cudaStream_t stream) {
  const int tiles = static_cast<int>((a.num_tokens * a.top_k + kTileRoutes - 1) / kTileRoutes);
  if (a.workspace_size < RoutingWorkspaceWords(a.num_tokens * a.top_k, a.num_local)) return -1;
  TileCountKernel<<<tiles, kThreads, a.num_local * 4, stream>>>(a, tiles);
  TilePrefixKernel<<<(a.num_local + kWarps - 1) / kWarps, kThreads, 0, stream>>>(a, tiles);
  const int rank_warps = PermuteRankWarps(kTileRoutes, a.num_local + 1, a.num_local);
  RankKernel<<<tiles, kThreads, (a.num_local + 1 + rank_warps * a.num_local) * 4, stream>>>(a, tiles, rank_warps);
  return tiles;
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
  if (routes <= kFusedMaxRoutes && least_ints <= kSharedInts) {
    const int rank_warps = PermuteRankWarps(routes, fused_ints, a.num_local);
    // Every block routes all R routes again: enough blocks to stream the copies, no more.
    const int64_t blocks = std::clamp<int64_t>(CopyBlocks(a.num_tokens, vecs_per_row) + padding_items, 1, kMaxFusedBlocks);
    const int64_t ints = routes <= kFewRoutes ? RankFewRoutesInts(routes, a.num_local)
                                              : RankRoutesInts(routes, a.num_local, rank_warps);
    const int prefetch_blocks = PrefetchBlocks(a);
    PermuteFusedKernel<V><<<blocks + prefetch_blocks, kThreads, ints * 4, stream>>>(a, rank_warps, prefetch_blocks);
    return cudaGetLastError();
  }
  // (No prefetch here: a prefill-sized permute's weights are many times L2.)
  const int tiles = LaunchRankTiles(a, stream);
  if (tiles < 0) return cudaErrorInvalidValue;
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
// issuing 2, 4 or 8 routes' loads before the sums gave 86%, 69% and 40%; at decode (T = 1, one block)
// issuing all k before the sums was no faster either (4.1 vs 3.9 us, Qwen3-30B on an H100).
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

cudaError_t LaunchPermuteQuantized(const PermuteArgs& a, void* q_rows, float* row_scale, cudaStream_t stream) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(q_rows);
  if (a.row_bytes % 256 != 0 || addresses % 16 != 0 || a.num_tokens < 1) return cudaErrorInvalidValue;
  // Always the large path: its copy launch is the one that quantises (prefill-sized routes).
  const int tiles = LaunchRankTiles(a, stream);
  if (tiles < 0) return cudaErrorInvalidValue;
  const int64_t pieces_per_row = a.row_bytes / 16;
  const int64_t chunks = (pieces_per_row + kThreads - 1) / kThreads;
  const int64_t padding_items = a.align > 1 ? a.num_local * chunks : 0;
  CopyRowsQuantizedKernel<<<CopyBlocks(a.num_tokens, pieces_per_row) + padding_items, kThreads, 0, stream>>>(
      a, static_cast<uint2*>(q_rows), row_scale, chunks, tiles);
  return cudaGetLastError();
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
