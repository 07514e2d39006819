// The decode router (route_kernels.h). Grid: x = a tile of 64 experts, y = a slice of H, z = a
// group of up to 8 tokens. In a block each lane owns 8 consecutive experts (one 16-byte load of a
// router row) and 8 consecutive rows of H per step (one 16-byte load of each token's x); lanes and
// warps split the slice and a fixed-order reduction sums their parts. The last block to arrive
// sums the slices in slice order and routes: one warp per token for the softmax, then the top k by
// rank (every thread ranks its pairs in their token's row) or, for longer rows, in k rounds of warp
// reductions.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "bf16_vector.cuh"
#include "route_kernels.h"

namespace jax_moe {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileExperts = 64;                  // 8 lanes x 8 experts
constexpr int kLanesPerRow = kTileExperts / 8;    // lanes sharing a step's rows
constexpr int kStepRows = 8;                      // rows of H a lane takes per step
constexpr int kBlockRows = kWarps * (32 / kLanesPerRow) * kStepRows;  // rows of H per block step: 256
constexpr int kGroupTokens = 8;                   // tokens per block (grid z)
constexpr int kInFlight = 2;                      // steps whose router loads a lane issues at once
constexpr int kMaxTokens = static_cast<int>(kDecodeRouteMaxTokens);
constexpr int kMaxPairs = static_cast<int>(kDecodeRouteMaxPairs);  // T * E held in shared memory
constexpr int kMaxTopK = static_cast<int>(kDecodeRouteMaxTopK);
constexpr int kMaxExperts = static_cast<int>(kDecodeRouteMaxExperts);
constexpr int kMaxPerLane = kMaxExperts / 32;
constexpr int kMaxGroups = static_cast<int>(kDecodeRouteMaxGroups);
constexpr int kMaxSlices = 8;                     // slices of H: the last block reads 8 x T x E sums
constexpr int kPairsAtOnce = 4;                   // pairs whose sums a thread loads at once
// The top k by rank (each thread ranks its pairs against their token's row) while a thread has at
// most this many compares, else a warp per token in k rounds of warp reductions (WarpTopK).
// (Rounds won only for the longer rows: DeepSeek-V3's 256 compares at T = 1, not Qwen3-30B's 128.)
constexpr int kRankMaxCompares = 128;

__device__ __forceinline__ float WarpMax(float v) {
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, d));
  return v;
}

// A float's place in lax.top_k's total order as an unsigned key: greater floats, greater keys, -0
// below +0, NaN above +inf (-NaN below -inf). Keys and indices together make every rank distinct.
__device__ __forceinline__ uint32_t OrderKey(float v) {
  const uint32_t bits = __float_as_uint(v);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// How many of a row's 4 keys, at experts base..base + 3, come before key k of expert e: greater,
// or equal at a lower index (lax.top_k's order).
__device__ __forceinline__ int CountBefore(uint4 keys, int base, uint32_t k, int e) {
  return (keys.x > k || (keys.x == k && base < e)) + (keys.y > k || (keys.y == k && base + 1 < e)) +
         (keys.z > k || (keys.z == k && base + 2 < e)) + (keys.w > k || (keys.w == k && base + 3 < e));
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int d = 16; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(~0u, v, d));
  return v;
}

// One step of a group's scan for its two best choices: a duplicate best counts twice, as
// DeepSeek-V3's sort of the group does.
__device__ __forceinline__ void KeepTwoBest(float v, float& first, float& second) {
  if (v > first) {
    second = first;
    first = v;
  } else if (v > second) {
    second = v;
  }
}

// Merges a warp's or a slot's two best values (first >= second) into (first, second): the two best
// of the four, a duplicate best counting twice (the values a sequential KeepTwoBest scan keeps).
__device__ __forceinline__ void MergeTwoBest(float other_first, float other_second, float& first, float& second) {
  const float low = fminf(first, other_first);
  first = fmaxf(first, other_first);
  second = fmaxf(low, fmaxf(second, other_second));
}

// DeepSeek-V3's group limit on a warp's row of choices (lane l holds experts l, l + 32, ... in
// value; slots past num_experts are ignored): groups are scored by the sum of their two best
// choices, and the choices outside the topk_group best groups (greater first, ties to the lower
// group) become -inf. Whole warp; no shared memory.
template <int kPerLane>
__device__ __forceinline__ void LimitToGroups(float (&value)[kPerLane], int num_experts, int n_group, int topk_group) {
  const int lane = threadIdx.x & 31, group_size = num_experts / n_group;
  float my_group_score = -INFINITY;  // lane g < n_group: group g's score
  if (group_size % 32 == 0) {
    // A slot's 32 experts lie in one group: the warp's two best of every slot at once (independent
    // butterflies), then each group merges its slots in order.
    float first[kPerLane], second[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) first[i] = i * 32 < num_experts ? value[i] : -INFINITY, second[i] = -INFINITY;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1)
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        MergeTwoBest(__shfl_xor_sync(~0u, first[i], d), __shfl_xor_sync(~0u, second[i], d), first[i], second[i]);
    float f = -INFINITY, s = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i * 32 >= num_experts) break;
      MergeTwoBest(first[i], second[i], f, s);
      if ((i + 1) * 32 % group_size == 0) {
        if (lane == i * 32 / group_size) my_group_score = __fadd_rn(f, s);
        f = s = -INFINITY;
      }
    }
  } else {
    for (int g = 0; g < n_group; ++g) {
      float first = -INFINITY, second = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = i * 32 + lane;
        if (e >= g * group_size && e < (g + 1) * group_size && e < num_experts) KeepTwoBest(value[i], first, second);
      }
      for (int d = 16; d > 0; d >>= 1)
        MergeTwoBest(__shfl_xor_sync(~0u, first, d), __shfl_xor_sync(~0u, second, d), first, second);
      if (lane == g) my_group_score = __fadd_rn(first, second);
    }
  }
  // Group g is eligible when fewer than topk_group groups beat it (greater, or equal and lower).
  int rank = 0;
  for (int h = 0; h < n_group; ++h) {
    const float u = __shfl_sync(~0u, my_group_score, h);
    rank += (u > my_group_score) || (u == my_group_score && h < lane);
  }
  const unsigned eligible = __ballot_sync(~0u, lane < n_group && rank < topk_group);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    if (e < num_experts && !(eligible >> (e / group_size) & 1)) value[i] = -INFINITY;
  }
}

// A warp's k best choices in k rounds of two warp reductions: each lane offers its best slot not
// yet taken, the warp takes the greatest key (lax.top_k's order, OrderKey) and, among equal keys,
// the lowest expert. Lane l holds experts l, l + 32, ... in value (slots past num_experts are never
// offered). Lane j < k gets the j-th choice. (redux.sync replaces the five shuffle steps of a
// (value, index) arg-max: at T = 4096 the choice kernel went 15.1 -> 10.6 us for DeepSeek-V3, H100.)
template <int kPerLane>
__device__ __forceinline__ int WarpTopK(const float (&value)[kPerLane], int num_experts, int top_k) {
  const int lane = threadIdx.x & 31;
  uint32_t key[kPerLane];
  unsigned taken = 0;  // bit i: slot i holds no expert, or one already chosen
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    key[i] = OrderKey(value[i]);
    if (i * 32 + lane >= num_experts) taken |= 1u << i;
  }
  int chosen = 0;
  for (int j = 0; j < top_k; ++j) {
    uint32_t best_key = 0;
    int best = -1;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (!(taken >> i & 1) && (best < 0 || key[i] > best_key)) best_key = key[i], best = i;
    const uint32_t top = __reduce_max_sync(~0u, best >= 0 ? best_key : 0u);
    const uint32_t expert = __reduce_min_sync(~0u, best >= 0 && best_key == top ? best * 32 + lane : UINT_MAX);
    if ((expert & 31) == lane) taken |= 1u << (expert >> 5);
    if (lane == j) chosen = static_cast<int>(expert);
  }
  return chosen;
}

// Shared memory of the block: the reduction's per-warp parts while reducing, then the routing's
// arrays in the last block.
struct RouteShared {
  union {
    float warp_parts[kWarps][kGroupTokens][kTileExperts];
    struct {
      float scores[kMaxPairs];
      union {  // a pair's choice, then its key for the top k by rank
        __align__(16) float choice[kMaxPairs];
        __align__(16) uint32_t keys[kMaxPairs];
      };
      float group_score[kMaxTokens][kMaxGroups];
      int eligible[kMaxTokens][kMaxGroups];
      float chosen_score[kMaxTokens][kMaxTopK];
      int chosen_id[kMaxTokens][kMaxTopK];
    } route;
  };
  int is_last;
};

// The last block: sum the slices, score, choose and weigh every token's experts.
__device__ void Route(const DecodeRouteArgs& a, int slices, RouteShared& s) {
  const int num_tokens = static_cast<int>(a.num_tokens), num_experts = static_cast<int>(a.num_experts);
  const int top_k = static_cast<int>(a.top_k), pairs = num_tokens * num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* scores = s.route.scores;
  float* choice = s.route.choice;
  // Pair i's slices are at partials[slice * pairs + i]. Four pairs' loads go out together (the
  // sums are a chain of L2 round trips otherwise: 20 us at T = 16), then each sums in slice order.
  for (int base = threadIdx.x; base < pairs; base += kPairsAtOnce * kThreads) {
    float part[kPairsAtOnce][kMaxSlices];
#pragma unroll
    for (int m = 0; m < kPairsAtOnce; ++m)
#pragma unroll
      for (int slice = 0; slice < kMaxSlices; ++slice) {
        const int i = base + m * kThreads;
        part[m][slice] = i < pairs && slice < slices ? __ldcg(a.partials + slice * pairs + i) : 0.0f;
      }
#pragma unroll
    for (int m = 0; m < kPairsAtOnce; ++m) {
      const int i = base + m * kThreads;
      float sum = 0.0f;
#pragma unroll
      for (int slice = 0; slice < kMaxSlices; ++slice)
        if (slice < slices) sum = __fadd_rn(sum, part[m][slice]);
      if (i < pairs) {
        a.logits[i] = sum;
        scores[i] = sum;
      }
    }
  }
  if (threadIdx.x == 0) *a.counter = 0;  // for the next call (stream order publishes it)
  __syncthreads();

  if (a.sigmoid) {
    for (int i = threadIdx.x; i < pairs; i += kThreads) scores[i] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-scores[i])));
  } else {
    for (int t = warp; t < num_tokens; t += kWarps) {
      float* row = scores + t * num_experts;
      float most = -INFINITY;
      for (int e = lane; e < num_experts; e += 32) most = fmaxf(most, row[e]);
      most = WarpMax(most);
      float sum = 0.0f;
      for (int e = lane; e < num_experts; e += 32) {
        row[e] = expf(__fsub_rn(row[e], most));
        sum = __fadd_rn(sum, row[e]);
      }
      sum = WarpSum(sum);
      for (int e = lane; e < num_experts; e += 32) row[e] = __fdiv_rn(row[e], sum);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += kThreads)
    choice[i] = a.bias != nullptr ? __fadd_rn(scores[i], a.bias[i % num_experts]) : scores[i];
  __syncthreads();

  if (a.n_group > 1) {
    const int n_group = static_cast<int>(a.n_group), group_size = num_experts / n_group;
    for (int i = threadIdx.x; i < num_tokens * n_group; i += kThreads) {
      const int t = i / n_group, g = i % n_group;
      const float* members = choice + t * num_experts + g * group_size;
      float first = -INFINITY, second = -INFINITY;
      for (int m = 0; m < group_size; ++m) KeepTwoBest(members[m], first, second);
      s.route.group_score[t][g] = __fadd_rn(first, second);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * n_group; i += kThreads) {
      const int t = i / n_group, g = i % n_group;
      const float v = s.route.group_score[t][g];
      int rank = 0;
      for (int h = 0; h < n_group; ++h) {
        const float u = s.route.group_score[t][h];
        rank += (u > v) || (u == v && h < g);
      }
      s.route.eligible[t][g] = rank < a.topk_group;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += kThreads)
      if (!s.route.eligible[i / num_experts][i % num_experts / group_size]) choice[i] = -INFINITY;
    __syncthreads();
  }

  const int pairs_per_thread = (pairs + kThreads - 1) / kThreads;
  if (pairs_per_thread * num_experts <= kRankMaxCompares) {
    // The top k by rank: a pair's rank in its token's row is how many choices come before it;
    // ranks below k name the chosen experts in order. Every thread reads the whole row (E compares
    // a pair, 16-byte broadcast loads): no rounds, no shuffles, one barrier.
    for (int i = threadIdx.x; i < pairs; i += kThreads) s.route.keys[i] = OrderKey(choice[i]);
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += kThreads) {
      const int t = i / num_experts, e = i % num_experts;
      const uint32_t k = s.route.keys[i];
      const uint4* row = reinterpret_cast<const uint4*>(s.route.keys + t * num_experts);
      int rank = 0;
#pragma unroll 4
      for (int q = 0; q < num_experts / 4; ++q) rank += CountBefore(row[q], q * 4, k, e);
      if (rank < top_k) {
        s.route.chosen_score[t][rank] = scores[i];
        s.route.chosen_id[t][rank] = e;
      }
    }
  } else {
    // One warp per token takes its k best choices in k rounds of warp reductions (lax.top_k's order).
    // Lane l holds experts l, l + 32, ...; lane j keeps the j-th.
    for (int t = warp; t < num_tokens; t += kWarps) {
      const float* row = choice + t * num_experts;
      float value[kMaxPerLane];
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = i * 32 + lane;
        value[i] = e < num_experts ? row[e] : -INFINITY;
      }
      const int chosen = WarpTopK(value, num_experts, top_k);
      if (lane < top_k) {
        float weight = scores[t * num_experts + chosen];
        s.route.chosen_score[t][lane] = weight;
        s.route.chosen_id[t][lane] = chosen;
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_tokens * top_k; i += kThreads) {
    const int t = i / top_k, j = i % top_k;
    float weight = s.route.chosen_score[t][j];
    if (a.renormalize) {
      float sum = 0.0f;
      for (int m = 0; m < top_k; ++m) sum = __fadd_rn(sum, s.route.chosen_score[t][m]);
      weight = __fdiv_rn(weight, __fadd_rn(sum, a.renormalize_epsilon));
    }
    if (a.scaling != 1.0f) weight = __fmul_rn(weight, a.scaling);
    a.topk_weights[i] = weight;
    a.topk_ids[i] = s.route.chosen_id[t][j];
  }
}

// rms_norm's scale of each of the block's token rows, 1 / sqrt(mean(x * x) + eps), into inv_rms:
// each thread sums the squares of its 8-value pieces (kNormLoads loads in flight: one round trip
// up to H = 8192, not one a piece), then the warps' lanes (a fixed butterfly) and the warps in
// order. Whole block.
constexpr int kNormLoads = 4;
template <int kTokens>
__device__ void RowInvRms(const Bf16* x, int tokens, int64_t hidden, float eps, float (&inv_rms)[kTokens]) {
  __shared__ float warp_sums[kWarps][kTokens];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t pieces = hidden / 8;
  float sum[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    sum[t] = 0.0f;
    if (t < tokens)
      for (int64_t base = threadIdx.x; base < pieces; base += kNormLoads * kThreads) {
        uint4 raw[kNormLoads];
#pragma unroll
        for (int u = 0; u < kNormLoads; ++u) {
          const int64_t p = base + u * kThreads;
          raw[u] = p < pieces ? __ldg(reinterpret_cast<const uint4*>(x + t * hidden) + p) : uint4{};
        }
#pragma unroll
        for (int u = 0; u < kNormLoads; ++u) {
          float v[8];
          Unpack(raw[u], v);  // (pieces past H are zeros: adding their squares changes no bit)
#pragma unroll
          for (int i = 0; i < 8; ++i) sum[t] = __fadd_rn(sum[t], __fmul_rn(v[i], v[i]));
        }
      }
  }
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum[t] = __fadd_rn(sum[t], __shfl_xor_sync(~0u, sum[t], d));
    if (lane == 0) warp_sums[warp][t] = sum[t];
  }
  __syncthreads();
  if (threadIdx.x < kTokens) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total = __fadd_rn(total, warp_sums[w][threadIdx.x]);
    inv_rms[threadIdx.x] = __frsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(hidden)), eps));
  }
  __syncthreads();
}

template <int kTokens>
__global__ void __launch_bounds__(kThreads) DecodeRouteKernel(DecodeRouteArgs a, int64_t slice_rows) {
  __shared__ RouteShared s;
  const int64_t hidden = a.hidden, num_experts = a.num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int vec = lane % kLanesPerRow, lane_k = lane / kLanesPerRow;
  const int first_token = blockIdx.z * kGroupTokens;
  const int tokens = min(kTokens, static_cast<int>(a.num_tokens) - first_token);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileExperts + vec * 8;
  const bool col_ok = col < num_experts;  // E is a multiple of 8: a lane's 8 experts are all in or out
  const int64_t row_begin = blockIdx.y * slice_rows;
  const int64_t row_end = min(hidden, row_begin + slice_rows);
  const Bf16* router = static_cast<const Bf16*>(a.router) + col;
  const Bf16* x = static_cast<const Bf16*>(a.x) + first_token * hidden;

  // With a.normed, x is the tokens before the norm: each x load is scaled and rounded to bf16 as
  // rms_norm's result (the same bits whichever block computes it), and the blocks of expert tile 0
  // write those values (every slice's rows once).
  __shared__ float inv_rms[kTokens];
  Bf16* normed = a.normed != nullptr ? static_cast<Bf16*>(a.normed) + first_token * hidden : nullptr;
  if (normed != nullptr) {
    // The first steps' router rows start towards L2 while the norm's sums wait on x.
    const int64_t r_first = row_begin + (warp * (32 / kLanesPerRow) + lane_k) * kStepRows;
#pragma unroll
    for (int s = 0; s < kInFlight; ++s)
#pragma unroll
      for (int i = 0; i < kStepRows; ++i) {
        const int64_t r = r_first + s * kBlockRows + i;
        if (col_ok && r < row_end) asm volatile("prefetch.global.L2 [%0];" :: "l"(router + r * num_experts));
      }
    RowInvRms<kTokens>(x, tokens, hidden, a.norm_epsilon, inv_rms);
  }
  const bool writes_normed = normed != nullptr && blockIdx.x == 0 && vec == 0;

  float acc[kTokens][8];
#pragma unroll
  for (int t = 0; t < kTokens; ++t)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[t][c] = 0.0f;
  // Two steps' router loads in flight before their arithmetic: a slice is a few steps of one
  // round trip each (DeepSeek-V3: four), so the reduction is latency-bound.
  for (int64_t r0 = row_begin + (warp * (32 / kLanesPerRow) + lane_k) * kStepRows; r0 < row_end;
       r0 += kInFlight * kBlockRows) {
    uint4 w[kInFlight][kStepRows];
#pragma unroll
    for (int s = 0; s < kInFlight; ++s)
#pragma unroll
      for (int i = 0; i < kStepRows; ++i) {
        const int64_t r = r0 + s * kBlockRows;
        w[s][i] = col_ok && r < row_end ? LoadStreaming(router + (r + i) * num_experts) : uint4{};
      }
#pragma unroll
    for (int s = 0; s < kInFlight; ++s) {
      const int64_t r = r0 + s * kBlockRows;
      if (r >= row_end) continue;
      float wf[kStepRows][8];
#pragma unroll
      for (int i = 0; i < kStepRows; ++i) Unpack(w[s][i], wf[i]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < tokens) {
          float xf[8];
          Unpack(__ldg(reinterpret_cast<const uint4*>(x + t * hidden + r)), xf);
          if (normed != nullptr) {
#pragma unroll
            for (int i = 0; i < 8; ++i) xf[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(xf[i], inv_rms[t])));
            if (writes_normed) *reinterpret_cast<uint4*>(normed + t * hidden + r) = Pack(xf);
          }
#pragma unroll
          for (int i = 0; i < kStepRows; ++i)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[t][c] = __fmaf_rn(xf[i], wf[i][c], acc[t][c]);
        }
      }
    }
  }
  // Lanes of the same experts (a fixed butterfly), then the warps in order.
#pragma unroll
  for (int t = 0; t < kTokens; ++t)
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int d = kLanesPerRow; d < 32; d <<= 1) acc[t][c] = __fadd_rn(acc[t][c], __shfl_xor_sync(~0u, acc[t][c], d));
  if (lane_k == 0) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t)
#pragma unroll
      for (int c = 0; c < 8; ++c) s.warp_parts[warp][t][vec * 8 + c] = acc[t][c];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < tokens * kTileExperts; i += kThreads) {
    const int t = i / kTileExperts, j = i % kTileExperts;
    const int64_t e = static_cast<int64_t>(blockIdx.x) * kTileExperts + j;
    if (e >= num_experts) continue;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum = __fadd_rn(sum, s.warp_parts[w][t][j]);
    a.partials[(blockIdx.y * a.num_tokens + first_token + t) * num_experts + e] = sum;  // [slice][t][e]
  }

  // Publish this block's sums, then count it in; the last block in routes.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int blocks = static_cast<int>(gridDim.x * gridDim.y * gridDim.z);
    s.is_last = atomicAdd(a.counter, 1) == blocks - 1;
  }
  __syncthreads();
  if (!s.is_last) return;
  __threadfence();
  Route(a, static_cast<int>(gridDim.y), s);
}

}  // namespace

int64_t DecodeRouteSlices(int64_t hidden) {
  // More slices would spread the router over more SMs (DeepSeek-V3's 3.7 MB over 32 blocks of 115
  // KB here) but lengthen the last block's sums.
  return std::clamp<int64_t>((hidden + kBlockRows - 1) / kBlockRows, 1, kMaxSlices);
}

bool DecodeRouteFits(int64_t num_tokens, int64_t hidden, int64_t num_experts, int64_t top_k, int64_t n_group,
                     int64_t topk_group) {
  return num_tokens >= 1 && num_tokens <= kMaxTokens && num_experts >= 8 && num_experts <= kMaxExperts &&
         num_tokens * num_experts <= kMaxPairs &&
         hidden >= 8 && hidden % 8 == 0 && num_experts % 8 == 0 && top_k >= 1 && top_k <= num_experts &&
         top_k <= kMaxTopK && n_group >= 1 && n_group <= kMaxGroups && num_experts % n_group == 0 &&
         (n_group == 1 || num_experts / n_group >= 2) && topk_group >= 1 && topk_group <= n_group;
}

cudaError_t LaunchDecodeRoute(const DecodeRouteArgs& a, cudaStream_t stream) {
  if (!DecodeRouteFits(a.num_tokens, a.hidden, a.num_experts, a.top_k, a.n_group, a.topk_group) ||
      a.x == nullptr || a.router == nullptr || a.partials == nullptr || a.logits == nullptr ||
      a.topk_weights == nullptr || a.topk_ids == nullptr || a.counter == nullptr)
    return cudaErrorInvalidValue;
  const int64_t tiles = (a.num_experts + kTileExperts - 1) / kTileExperts;
  const int64_t slices = DecodeRouteSlices(a.hidden);
  // Slices of whole block steps: every lane's 8 rows lie inside H.
  const int64_t slice_rows = ((a.hidden + kBlockRows - 1) / kBlockRows + slices - 1) / slices * kBlockRows;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(slices),
                  static_cast<unsigned>((a.num_tokens + kGroupTokens - 1) / kGroupTokens));
  const int64_t tokens = std::min<int64_t>(a.num_tokens, kGroupTokens);
  if (tokens == 1) {
    DecodeRouteKernel<1><<<grid, kThreads, 0, stream>>>(a, slice_rows);
  } else if (tokens == 2) {
    DecodeRouteKernel<2><<<grid, kThreads, 0, stream>>>(a, slice_rows);
  } else if (tokens <= 4) {
    DecodeRouteKernel<4><<<grid, kThreads, 0, stream>>>(a, slice_rows);
  } else {
    DecodeRouteKernel<8><<<grid, kThreads, 0, stream>>>(a, slice_rows);
  }
  return cudaGetLastError();
}

namespace {

constexpr int kChooseWarps = 8;  // tokens a block of the choice kernel takes

// Token t's k best choices (one warp per token; lane l holds experts l, l + 32, ... of the row):
// the group limit, then the top k by warp reductions in lax.top_k's order (its ids on the same choices).
template <int kPerLane>
__global__ void __launch_bounds__(kChooseWarps * 32) ChooseExpertsKernel(ChooseExpertsArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kChooseWarps + (threadIdx.x >> 5);
  if (t >= a.num_tokens) return;
  const int num_experts = static_cast<int>(a.num_experts), top_k = static_cast<int>(a.top_k);
  const float* row = a.choice + t * num_experts;
  float value[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    value[i] = e < num_experts ? row[e] : -INFINITY;
  }
  if (a.n_group > 1) LimitToGroups(value, num_experts, static_cast<int>(a.n_group), static_cast<int>(a.topk_group));
  const int chosen = WarpTopK(value, num_experts, top_k);
  if (lane < top_k) a.topk_ids[t * top_k + lane] = chosen;
}

}  // namespace

bool ChooseExpertsFits(int64_t num_experts, int64_t top_k, int64_t n_group, int64_t topk_group) {
  return num_experts >= 1 && num_experts <= kChooseExpertsMaxExperts && top_k >= 1 &&
         top_k <= std::min(num_experts, kChooseExpertsMaxTopK) && n_group >= 1 && n_group <= kChooseExpertsMaxGroups &&
         num_experts % n_group == 0 && topk_group >= 1 && topk_group <= n_group;
}

cudaError_t LaunchChooseExperts(const ChooseExpertsArgs& a, cudaStream_t stream) {
  if (!ChooseExpertsFits(a.num_experts, a.top_k, a.n_group, a.topk_group) || a.num_tokens < 0)
    return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((a.num_tokens + kChooseWarps - 1) / kChooseWarps);
  const int per_lane = static_cast<int>((a.num_experts + 31) / 32);
  if (per_lane <= 4) {
    ChooseExpertsKernel<4><<<blocks, kChooseWarps * 32, 0, stream>>>(a);
  } else if (per_lane <= 8) {
    ChooseExpertsKernel<8><<<blocks, kChooseWarps * 32, 0, stream>>>(a);
  } else if (per_lane <= 16) {
    ChooseExpertsKernel<16><<<blocks, kChooseWarps * 32, 0, stream>>>(a);
  } else {
    ChooseExpertsKernel<32><<<blocks, kChooseWarps * 32, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace jax_moe
