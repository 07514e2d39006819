// The decode router (route_kernels.h). Grid: x = a tile of 64 experts, y = a slice of H, z = a
// group of up to 8 tokens. In a block each lane owns 8 consecutive experts (one 16-byte load of a
// router row) and 8 consecutive rows of H per step (one 16-byte load of each token's x); lanes and
// warps split the slice and a fixed-order reduction sums their parts. The last block to arrive
// sums the slices in slice order and routes: one warp per token for the softmax and the top-k.
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
constexpr int kMaxTokens = 16;
constexpr int kMaxPairs = 4096;                   // T * E held in shared memory
constexpr int kMaxTopK = 32;
constexpr int kMaxExperts = 512;
constexpr int kMaxGroups = 32;
constexpr int kMaxSlices = 16;                    // slices of H: the last block reads up to 16 x T x E sums
constexpr int kPairsAtOnce = 4;                   // pairs whose sums a thread loads at once

// Phase marks for cuda/route_phase_bench.cu, which defines the macro before including this file to
// time each phase of the kernel; nothing in the module's build.
#ifndef JAX_MOE_ROUTE_MARK
#define JAX_MOE_ROUTE_MARK(phase)
#endif

__device__ __forceinline__ float WarpMax(float v) {
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, d));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int d = 16; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(~0u, v, d));
  return v;
}

// Shared memory of the block: the reduction's per-warp parts while reducing, then the routing's
// arrays in the last block.
struct RouteShared {
  union {
    float warp_parts[kWarps][kGroupTokens][kTileExperts];
    struct {
      float logits[kMaxPairs];  // [T, E]: the slices summed, then the scores of the routing warps
      float choice[kMaxPairs];  // [T, E]: a token's choices, for the group limit
      float bias[kMaxExperts];
      float group_score[kMaxTokens][kMaxGroups];
      int eligible[kMaxTokens][kMaxGroups];
    } route;
  };
  int is_last;
};

// A key that orders choices as floats do (-0 as +0, so that equal floats tie); unsigned, for the
// warp's max instruction.
__device__ __forceinline__ unsigned ChoiceKey(float v) {
  const unsigned bits = __float_as_uint(__fadd_rn(v, 0.0f));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// One token, routed by one warp in the token's rows of shared memory: lane l takes experts l,
// l + 32, ... The scores, the choices, the group limit, the top k and the weights, with no
// block-wide barrier. The loops stay rolled: in a layer this code is cold (the experts' launches
// between two routers evict it), and unrolled register versions of it, faster here with the code
// warm, were slower in a layer. The sums run in the order the earlier block-wide version used (a
// lane's experts in order, then a butterfly): the same bits.
__device__ void RouteToken(const DecodeRouteArgs& a, int t, RouteShared& s) {
  const int num_experts = static_cast<int>(a.num_experts), top_k = static_cast<int>(a.top_k);
  const int lane = threadIdx.x & 31;
  float* row = s.route.logits + t * num_experts;     // the logits, then the scores
  float* choice = s.route.choice + t * num_experts;  // the choices, then their keys
  if (a.sigmoid) {
    for (int e = lane; e < num_experts; e += 32) row[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-row[e])));
  } else {
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
  for (int e = lane; e < num_experts; e += 32)
    choice[e] = a.bias != nullptr ? __fadd_rn(row[e], s.route.bias[e]) : row[e];
  __syncwarp();
  JAX_MOE_ROUTE_MARK(4);  // scores and choices

  if (a.n_group > 1) {
    // Groups scored by their two best choices; only the topk_group best stay eligible (ties to
    // the lower group). Lane g takes group g, from a different member each (no bank conflicts):
    // the two best do not depend on the order.
    const int n_group = static_cast<int>(a.n_group), group_size = num_experts / n_group;
    if (lane < n_group) {
      float first = -INFINITY, second = -INFINITY;
      for (int m = 0; m < group_size; ++m) {
        const float v = choice[lane * group_size + (m + lane) % group_size];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      s.route.group_score[t][lane] = __fadd_rn(first, second);
    }
    __syncwarp();
    if (lane < n_group) {
      const float v = s.route.group_score[t][lane];
      int rank = 0;
      for (int h = 0; h < n_group; ++h) {
        const float u = s.route.group_score[t][h];
        rank += (u > v) || (u == v && h < lane);
      }
      s.route.eligible[t][lane] = rank < a.topk_group;
    }
    __syncwarp();
    for (int e = lane; e < num_experts; e += 32)
      if (!s.route.eligible[t][e / group_size]) choice[e] = -INFINITY;
  }
  JAX_MOE_ROUTE_MARK(5);  // the group limit

  // The top k in k rounds: the warp's largest key (one max instruction), then the lowest expert
  // holding it (one min instruction), as lax.top_k breaks ties. Each lane keeps its best left,
  // and only the lane that lost it looks again.
  unsigned* keys = reinterpret_cast<unsigned*>(choice);
  for (int e = lane; e < num_experts; e += 32) keys[e] = ChoiceKey(choice[e]);
  unsigned taken = 0;  // bit i: expert i * 32 + lane is chosen
  unsigned best_key = 0;
  auto lane_best = [&] {  // slot of the lane's best left (the lower among equal keys), -1 if none
    int best = -1;
    for (int i = 0, e = lane; e < num_experts; ++i, e += 32)
      if (!(taken >> i & 1) && (best < 0 || keys[e] > best_key)) best = i, best_key = keys[e];
    return best;
  };
  int best = lane_best();
  int chosen = 0;
  for (int j = 0; j < top_k; ++j) {
    const unsigned most = __reduce_max_sync(~0u, best >= 0 ? best_key : 0u);
    const unsigned index = __reduce_min_sync(~0u, best >= 0 && best_key == most ? best * 32 + lane : UINT_MAX);
    if (lane == j) chosen = static_cast<int>(index);
    if ((index & 31) == static_cast<unsigned>(lane)) {
      taken |= 1u << best;
      best = lane_best();
    }
  }
  JAX_MOE_ROUTE_MARK(6);  // the top k

  __syncwarp();
  const float chosen_score = lane < top_k ? row[chosen] : 0.0f;
  float sum = 0.0f;
  if (a.renormalize)
    for (int m = 0; m < top_k; ++m) sum = __fadd_rn(sum, __shfl_sync(~0u, chosen_score, m));
  if (lane < top_k) {
    float weight = chosen_score;
    if (a.renormalize) weight = __fdiv_rn(weight, __fadd_rn(sum, a.renormalize_epsilon));
    if (a.scaling != 1.0f) weight = __fmul_rn(weight, a.scaling);
    a.topk_weights[t * top_k + lane] = weight;
    a.topk_ids[t * top_k + lane] = chosen;
  }
  JAX_MOE_ROUTE_MARK(7);  // the weights written
}

// The last block: sum the slices, then one warp routes each token.
__device__ void Route(const DecodeRouteArgs& a, int slices, RouteShared& s) {
  const int num_tokens = static_cast<int>(a.num_tokens), num_experts = static_cast<int>(a.num_experts);
  const int pairs = num_tokens * num_experts;
  const int warp = threadIdx.x >> 5;
  // The bias's loads go out with the sums' below.
  float bias[kMaxExperts / kThreads];
#pragma unroll
  for (int m = 0; m < kMaxExperts / kThreads; ++m) {
    const int e = threadIdx.x + m * kThreads;
    bias[m] = a.bias != nullptr && e < num_experts ? __ldg(a.bias + e) : 0.0f;
  }
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
        s.route.logits[i] = sum;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxExperts / kThreads; ++m)
    if (threadIdx.x + m * kThreads < num_experts) s.route.bias[threadIdx.x + m * kThreads] = bias[m];
  if (threadIdx.x == 0) *a.counter = 0;  // for the next call (stream order publishes it)
  __syncthreads();
  JAX_MOE_ROUTE_MARK(3);  // the slices summed
  for (int t = warp; t < num_tokens; t += kWarps) {
    RouteToken(a, t, s);
  }
}

template <int kTokens>
__global__ void __launch_bounds__(kThreads, 1) DecodeRouteKernel(DecodeRouteArgs a, int64_t slice_rows) {
  __shared__ RouteShared s;
  JAX_MOE_ROUTE_MARK(0);  // the block starts
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
  JAX_MOE_ROUTE_MARK(1);  // the block's products reduced to its warps' parts
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
  JAX_MOE_ROUTE_MARK(2);  // the block's sums published and counted in
  if (!s.is_last) return;
  __threadfence();
  Route(a, static_cast<int>(gridDim.y), s);
}

// Block steps of H (kBlockRows rows each) per slice: as few as spread H over kMaxSlices slices.
int64_t DecodeRouteSliceSteps(int64_t hidden) {
  const int64_t steps = (std::max<int64_t>(hidden, 1) + kBlockRows - 1) / kBlockRows;
  return (steps + kMaxSlices - 1) / kMaxSlices;
}

}  // namespace

int64_t DecodeRouteSlices(int64_t hidden) {
  // More slices spread the router's read over more SMs (DeepSeek-V3's 3.7 MB: 14 x 4 blocks of
  // 64 KB) at the price of longer sums in the last block; every slice holds whole block steps.
  const int64_t steps = (std::max<int64_t>(hidden, 1) + kBlockRows - 1) / kBlockRows;
  return (steps + DecodeRouteSliceSteps(hidden) - 1) / DecodeRouteSliceSteps(hidden);
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
  const int64_t slice_rows = DecodeRouteSliceSteps(a.hidden) * kBlockRows;
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

}  // namespace jax_moe
