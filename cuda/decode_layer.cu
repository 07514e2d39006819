// The decode MoE layer's experts in one launch (decode_layer.h).
//
// Work is split by 16-column chunks of each product's output: the gate/up product's chunk is 16
// activation columns (4 vectors of 8 weight columns: two of gate, the matching two of up), the down
// product's 16 output columns (2 vectors). The chunks of all groups (routed experts in id order,
// then the shared expert) form one list; block b takes chunks [b C / G, (b + 1) C / G), so each SM
// streams an equal share of the weights, a chunk at most apart. Within a block each thread owns one
// vector of the span's columns and a share of K (threads of the same vector split K; a fixed-order
// sum over them); up to 256 vectors at once, more in rounds.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "bf16_vector.cuh"
#include "decode_layer.h"
#include "grouped_gemm.h"

namespace jax_moe {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kStepRows = 8;     // K rows a thread takes per step (one 16-byte load of each row's x)
constexpr int kInFlight = 2;  // steps whose weight loads a thread issues before their arithmetic
constexpr int kChunkCols = 16;   // output columns per chunk
constexpr int kMaxRoutes = static_cast<int>(kDecodeLayerMaxRoutes);
// counters[0]: the barrier's arrivals, [1]: its generation, [2] and [3]: the two products' chunk
// queues; then one arrival count per column chunk of H.
constexpr int kFixedWords = 4;
constexpr int kStaticPercent = 80;  // of a product's chunks, shared out equally before the queue

// The routes' expert groups, built by every block from the ids (routes of an expert in route order).
struct Groups {
  int expert_of[kMaxRoutes];     // route -> its expert, -1 when dropped
  int first[kMaxRoutes];         // route -> 1 when no earlier route has its expert
  int route[kMaxRoutes];         // kept routes sorted by (expert, route)
  int group_expert[kMaxRoutes];  // group -> expert
  int start[kMaxRoutes + 1];     // group -> its first position in `route`; start[num_routed] = kept
  int num_routed;
  int combine[kDecodeLayerCounterWords];  // column chunks of H this block sums last (then their count)
  int num_combine;
  int taken;
};

__device__ __forceinline__ int LoadAcquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// A grid barrier in two halves, so that a block can put work in flight between its arrival and
// its wait. counters[0] counts arrivals and is left zero; counters[1], the generation, only grows.
// Arrive returns the generation to wait past (thread 0's; the others' is unused).
__device__ int GridArrive(int* counters) {
  __syncthreads();
  int generation = 0;
  if (threadIdx.x == 0) {
    generation = LoadAcquire(counters + 1);  // stable until every block, this one too, arrives
    __threadfence();
    if (atomicAdd(counters, 1) == static_cast<int>(gridDim.x) - 1) {
      counters[0] = 0;
      __threadfence();
      atomicAdd(counters + 1, 1);
    }
  }
  return generation;
}

__device__ void GridWait(int* counters, int generation) {
  if (threadIdx.x == 0) {
    while (LoadAcquire(counters + 1) == generation) {
    }
    __threadfence();
  }
  __syncthreads();
}

// The next chunk of a product's dynamic part for this block (all threads get it), or >= `end` when
// the part is done. Every block takes exactly one chunk past the end, so the block whose take is
// the last of them (end - first + gridDim.x takes in all) leaves the queue zero for the next call.
__device__ int TakeChunk(int* queue, int first, int end, int* shared_slot) {
  __syncthreads();  // the previous chunk's value is read by every thread
  if (threadIdx.x == 0) {
    const int taken = atomicAdd(queue, 1);
    if (taken == end - first + static_cast<int>(gridDim.x) - 1) *queue = 0;
    *shared_slot = first + taken;
  }
  __syncthreads();
  return *shared_slot;
}

__device__ void BuildGroups(const DecodeLayerArgs& a, Groups& s) {
  const int routes = static_cast<int>(a.num_tokens * a.top_k), experts = static_cast<int>(a.num_experts);
  const int r = threadIdx.x;
  int e = -1;
  if (r < routes) {
    e = a.topk_ids[r];
    if (e < 0 || e >= experts) e = -1;
    s.expert_of[r] = e;
  }
  __syncthreads();
  bool first = e >= 0;
  for (int q = 0; q < r && first && q < routes; ++q) first = s.expert_of[q] != e;
  if (r < routes) s.first[r] = first;
  const int num_routed = __syncthreads_count(first);
  const int kept = __syncthreads_count(e >= 0);
  if (e >= 0) {
    int smaller = 0, distinct_smaller = 0, rank = 0;
    for (int q = 0; q < routes; ++q) {
      const int other = s.expert_of[q];
      if (other < 0) continue;
      if (other < e) {
        ++smaller;
        distinct_smaller += s.first[q];
      } else if (other == e && q < r) {
        ++rank;
      }
    }
    s.route[smaller + rank] = r;
    if (first) {
      s.group_expert[distinct_smaller] = e;
      s.start[distinct_smaller] = smaller;
    }
  }
  if (r == 0) {
    s.num_routed = num_routed;
    s.start[num_routed] = kept;
  }
  __syncthreads();
}

// One product's view of the groups: group g's weights, K, row pitch and rows.
struct Product {
  bool gated;                 // gate/up: out = silu(x . gate) * (x . up), else out = x . w
  const Bf16* in;             // gate/up: x [T, H]; down: hidden [rows, in_pitch]
  int64_t in_pitch;
  const Bf16* weights;        // routed experts' [E, K, N]
  const Bf16* shared_weights; // [Ks, Ns] or null
  int64_t k, n, shared_k, shared_n;
  Bf16* out;                  // [rows, out_pitch]
  int64_t out_pitch;
  int chunks_routed, chunks_shared;  // chunks per routed group, of the shared group
};

// Row m of group g: the row of `in` it reads and the row of `out` it writes.
__device__ __forceinline__ void RowOf(const Product& p, const Groups& s, const DecodeLayerArgs& a, int g, int m,
                                      int64_t* in_row, int64_t* out_row) {
  const int routes = static_cast<int>(a.num_tokens * a.top_k);
  if (g < s.num_routed) {
    const int r = s.route[s.start[g] + m];
    *in_row = p.gated ? r / a.top_k : r;
    *out_row = r;
  } else {
    *in_row = p.gated ? m : routes + m;
    *out_row = routes + m;
  }
}

__device__ __forceinline__ int RowsOf(const Groups& s, const DecodeLayerArgs& a, int g) {
  return g < s.num_routed ? s.start[g + 1] - s.start[g] : static_cast<int>(a.num_tokens);
}

// A thread's vector within a round of `vectors` vectors from chunk `round`: its group, its weights'
// first element (column), their K and row pitch N.
struct Vector {
  int group;
  const Bf16* w;
  int64_t k, n;
};

__device__ __forceinline__ Vector VectorOf(const Product& p, const Groups& s, int round, int v) {
  const int vectors_per_chunk = p.gated ? 4 : 2;
  const int routed_chunks = s.num_routed * p.chunks_routed;
  const int chunk = round + v / vectors_per_chunk, j = v % vectors_per_chunk;
  const bool shared = chunk >= routed_chunks;
  const int g = shared ? s.num_routed : chunk / p.chunks_routed;
  const int within = shared ? chunk - routed_chunks : chunk % p.chunks_routed;
  const int64_t k = shared ? p.shared_k : p.k, n = shared ? p.shared_n : p.n;
  // Gated: vectors 0, 1 are the chunk's gate columns, 2, 3 the matching up columns.
  const int64_t col = p.gated ? within * kChunkCols + (j & 1) * 8 + (j < 2 ? 0 : n / 2) : within * kChunkCols + j * 8;
  return Vector{g, (shared ? p.shared_weights : p.weights + s.group_expert[g] * k * n) + col, k, n};
}

// Puts the first steps of this block's first round of product p in flight to L2 (before the grid
// barrier: the wait then overlaps them).
__device__ void PrefetchSpan(const Product& p, const Groups& s, int chunk_begin, int chunk_end) {
  const int threads = static_cast<int>(blockDim.x);
  const int chunks = min(threads / (p.gated ? 4 : 2), chunk_end - chunk_begin);
  if (chunks <= 0) return;
  const int vectors = chunks * (p.gated ? 4 : 2), lanes_k = threads / vectors;
  const int v = threadIdx.x % vectors, lane_k = threadIdx.x / vectors;
  if (lane_k >= lanes_k) return;
  const Vector vec = VectorOf(p, s, chunk_begin, v);
  const int64_t step = static_cast<int64_t>(lanes_k) * kStepRows;
  for (int st = 0; st < kInFlight; ++st)
    for (int i = 0; i < kStepRows; ++i) {
      const int64_t row = lane_k * kStepRows + st * step + i;
      if (row < vec.k) asm volatile("prefetch.global.L2 [%0];" :: "l"(vec.w + row * vec.n));
    }
}

// The chunks [chunk_begin, chunk_end) of product p, in rounds of at most blockDim.x vectors.
template <int kRows>
__device__ void Span(const Product& p, const Groups& s, const DecodeLayerArgs& a, int chunk_begin, int chunk_end,
                     float* reduce) {
  const int threads = static_cast<int>(blockDim.x);
  const int vectors_per_chunk = p.gated ? 4 : 2;
  const int chunks_per_round = threads / vectors_per_chunk;
  const int routed_chunks = s.num_routed * p.chunks_routed;
  for (int round = chunk_begin; round < chunk_end; round += chunks_per_round) {
    const int chunks = min(chunks_per_round, chunk_end - round);
    const int vectors = chunks * vectors_per_chunk;
    const int lanes_k = threads / vectors;  // threads per vector, splitting K
    const int v = threadIdx.x % vectors, lane_k = threadIdx.x / vectors;
    const bool active = lane_k < lanes_k;
    const Vector vec = VectorOf(p, s, round, v);
    const int g = vec.group;
    const int64_t k = vec.k, n = vec.n;
    const Bf16* w = vec.w;
    const int rows = RowsOf(s, a, g);
    const int64_t step = static_cast<int64_t>(lanes_k) * kStepRows;
    for (int pass = 0; __syncthreads_or(pass * kRows < rows); ++pass) {
      const int rows_now = max(0, min(kRows, rows - pass * kRows));
      const Bf16* in[kRows];
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        int64_t in_row = 0, out_row;
        if (m < rows_now) RowOf(p, s, a, g, pass * kRows + m, &in_row, &out_row);
        in[m] = p.in + in_row * p.in_pitch;
      }
      float acc[kRows][8];
#pragma unroll
      for (int m = 0; m < kRows; ++m)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[m][c] = 0.0f;
      if (active && rows_now > 0) {
        for (int64_t k0 = static_cast<int64_t>(lane_k) * kStepRows; k0 < k; k0 += kInFlight * step) {
          uint4 wv[kInFlight][kStepRows];
#pragma unroll
          for (int st = 0; st < kInFlight; ++st) {
            const bool load = k0 + st * step < k;
#pragma unroll
            for (int i = 0; i < kStepRows; ++i) wv[st][i] = load ? LoadStreaming(w + (k0 + st * step + i) * n) : uint4{};
          }
#pragma unroll
          for (int st = 0; st < kInFlight; ++st) {
            const int64_t kk = k0 + st * step;
            if (kk >= k) continue;
            float wf[kStepRows][8];
#pragma unroll
            for (int i = 0; i < kStepRows; ++i) Unpack(wv[st][i], wf[i]);
#pragma unroll
            for (int m = 0; m < kRows; ++m) {
              if (m < rows_now) {
                float xf[8];
                // x is an input of the launch (the read-only path); hidden was written by this
                // launch, by other SMs before the barrier, and no L1 holds its lines from before:
                // an L1-cached load (the threads of a row share each line).
                Unpack(p.gated ? __ldg(reinterpret_cast<const uint4*>(in[m] + kk))
                               : __ldca(reinterpret_cast<const uint4*>(in[m] + kk)), xf);
#pragma unroll
                for (int i = 0; i < kStepRows; ++i)
#pragma unroll
                  for (int c = 0; c < 8; ++c) acc[m][c] = __fmaf_rn(xf[i], wf[i][c], acc[m][c]);
              }
            }
          }
        }
      }
      // reduce[thread][m][c] = reduce[lane_k][v][m][c]: the threads of vector v are v, v + vectors, ...
#pragma unroll
      for (int m = 0; m < kRows; ++m)
#pragma unroll
        for (int c = 0; c < 8; ++c) reduce[(threadIdx.x * kRows + m) * 8 + c] = acc[m][c];
      __syncthreads();
      // Each vector's lanes_k parts summed by a fixed pairwise tree into lane 0's (lane l takes lane
      // l + stride), in float4s: log2(lanes_k) steps over all threads (a lane-by-lane sum in a few
      // threads per output was microseconds of tail with 32-42 lanes a vector).
      const int per_lane = vectors * kRows * 2;  // float4s
      float4* parts = reinterpret_cast<float4*>(reduce);
      for (int stride = 1; stride < lanes_k; stride *= 2) {
        const int pairs = (lanes_k - stride + 2 * stride - 1) / (2 * stride);
        for (int i = threadIdx.x; i < pairs * per_lane; i += threads) {
          const int l = i / per_lane * 2 * stride, e = i % per_lane;
          float4 x = parts[l * per_lane + e];
          const float4 y = parts[(l + stride) * per_lane + e];
          x.x = __fadd_rn(x.x, y.x), x.y = __fadd_rn(x.y, y.y), x.z = __fadd_rn(x.z, y.z), x.w = __fadd_rn(x.w, y.w);
          parts[l * per_lane + e] = x;
        }
        __syncthreads();
      }
      // One output vector (8 columns of one row) per item: gated chunks give 2 per row, plain ones 2.
      for (int item = threadIdx.x; item < chunks * 2 * kRows; item += threads) {
        const int m = item % kRows, half = item / kRows % 2, chunk_local = item / (2 * kRows);
        const int ch = round + chunk_local;
        const bool sh = ch >= routed_chunks;
        const int gg = sh ? s.num_routed : ch / p.chunks_routed;
        const int wi = sh ? ch - routed_chunks : ch % p.chunks_routed;
        if (pass * kRows + m >= RowsOf(s, a, gg)) continue;
        int64_t in_row, out_row;
        RowOf(p, s, a, gg, pass * kRows + m, &in_row, &out_row);
        float result[8];
        if (p.gated) {
          const float* gate = reduce + ((chunk_local * 4 + half) * kRows + m) * 8;
          const float* up = gate + 2 * kRows * 8;  // the vector two on: the matching up columns
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            // As the unfused path: the products rounded to bf16, the activation in float32.
            const float gb = __bfloat162float(__float2bfloat16_rn(gate[c]));
            const float ub = __bfloat162float(__float2bfloat16_rn(up[c]));
            result[c] = __fmul_rn(__fdiv_rn(gb, __fadd_rn(1.0f, expf(-gb))), ub);
          }
        } else {
          const float* sum = reduce + ((chunk_local * 2 + half) * kRows + m) * 8;
#pragma unroll
          for (int c = 0; c < 8; ++c) result[c] = sum[c];
        }
        *reinterpret_cast<uint4*>(p.out + out_row * p.out_pitch + wi * kChunkCols + half * 8) = Pack(result);
      }
      __syncthreads();  // before the next pass overwrites `reduce`
    }
  }
}

// sigmoid(x[t] . shared_gate) for every token, by one block (fixed-order sums: each thread's, a
// warp butterfly, the warps in order).
__device__ void SharedGateLogits(const DecodeLayerArgs& a, float* reduce) {
  const Bf16* x = static_cast<const Bf16*>(a.x);
  const Bf16* gate = static_cast<const Bf16*>(a.shared_gate);
  const int64_t hidden = a.hidden_size;
  const int warps = static_cast<int>(blockDim.x) / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int t = 0; t < a.num_tokens; ++t) {
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
      sum = __fmaf_rn(__bfloat162float(x[t * hidden + i]), __bfloat162float(gate[i]), sum);
    for (int d = 16; d > 0; d >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, d));
    if (lane == 0) reduce[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < warps; ++w) total = __fadd_rn(total, reduce[w]);
      a.gate_logits[t] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-total)));
    }
    __syncthreads();
  }
}

// Output columns [16 hc, 16 hc + 16) of every token: the routes' weighted sum as unpermute's, then
// the shared expert's output and the residual, each add rounded to bf16 as XLA's.
__device__ void Combine(const DecodeLayerArgs& a, const Groups& s, int hc, int t, int half) {
  const int64_t hidden = a.hidden_size, col = hc * kChunkCols + half * 8;
  const int top_k = static_cast<int>(a.top_k), routes = static_cast<int>(a.num_tokens * a.top_k);
  const Bf16* y = static_cast<const Bf16*>(a.rows_out);
  float acc[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
  // Eight routes' loads at once, then their sums in route order (one L2 round trip per eight
  // routes, not per route).
  constexpr int kBatch = 8;
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    uint4 yv[kBatch];
    float w[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = t * top_k + j0 + i;
      const bool kept = j0 + i < top_k && s.expert_of[r] >= 0;
      yv[i] = kept ? __ldcg(reinterpret_cast<const uint4*>(y + r * hidden + col)) : uint4{};
      w[i] = kept ? a.topk_weights[r] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (j0 + i >= top_k || s.expert_of[t * top_k + j0 + i] < 0) continue;
      float yf[8];
      Unpack(yv[i], yf);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(w[i], yf[c]));
    }
  }
  float sum[8], res[8];
  Unpack(Pack(acc), sum);  // the routes' sum in bf16
  if (a.shared_gate_up != nullptr) {
    float shared[8];
    Unpack(__ldcg(reinterpret_cast<const uint4*>(y + (routes + t) * hidden + col)), shared);
    if (a.shared_gate != nullptr) {
      const float gate = __ldcg(a.gate_logits + t);
#pragma unroll
      for (int c = 0; c < 8; ++c) shared[c] = __fmul_rn(shared[c], gate);
      Unpack(Pack(shared), shared);
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) sum[c] = __fadd_rn(sum[c], shared[c]);
    Unpack(Pack(sum), sum);
  }
  Unpack(*reinterpret_cast<const uint4*>(static_cast<const Bf16*>(a.residual) + t * hidden + col), res);
#pragma unroll
  for (int c = 0; c < 8; ++c) res[c] = __fadd_rn(res[c], sum[c]);
  *reinterpret_cast<uint4*>(static_cast<Bf16*>(a.out) + t * hidden + col) = Pack(res);
}

__device__ void CombineChunks(const DecodeLayerArgs& a, const Groups& s, const int* chunks, int count) {
  const int tokens = static_cast<int>(a.num_tokens);
  for (int item = threadIdx.x; item < count * tokens * 2; item += blockDim.x)
    Combine(a, s, chunks[item / (tokens * 2)], item / 2 % tokens, item % 2);
}

template <int kRows, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) DecodeLayerKernel(DecodeLayerArgs a) {
  __shared__ Groups s;
  extern __shared__ float reduce[];  // [kThreads][kRows][8]
  BuildGroups(a, s);
  const bool has_shared = a.shared_gate_up != nullptr;
  const int groups = s.num_routed + (has_shared ? 1 : 0);
  const int64_t hidden = a.hidden_size, hidden_pitch = max(a.ffn, has_shared ? a.shared_ffn : 0);
  const int blocks = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  int* counters = a.counters;

  // The gate/up product with the activation: hidden [routes + T, Fmax].
  Product gate_up{true, static_cast<const Bf16*>(a.x), hidden, static_cast<const Bf16*>(a.gate_up),
                  static_cast<const Bf16*>(a.shared_gate_up), hidden, 2 * a.ffn, hidden, 2 * a.shared_ffn,
                  static_cast<Bf16*>(a.hidden), hidden_pitch,
                  static_cast<int>(a.ffn / kChunkCols), static_cast<int>(a.shared_ffn / kChunkCols)};
  // Each product: every block first takes an equal static share of kStaticPercent % of the chunks
  // (one round: all its vectors' loads in flight at once), then the rest one chunk at a time from a
  // queue, so that SMs which stream faster take more. (Equal shares of all chunks left the last
  // block 10-35 % behind the median one, the others waiting at the barrier or the end:
  // notebooks/results/decode_one_launch_layer_h200.md.)
  int total = s.num_routed * gate_up.chunks_routed + (has_shared ? gate_up.chunks_shared : 0);
  if (a.shared_gate != nullptr && b == blocks - 1) SharedGateLogits(a, reduce);
  int share = static_cast<int>(static_cast<int64_t>(total) * kStaticPercent / (100 * blocks));
  for (int first = b * share, last = (b + 1) * share;;) {
    Span<kRows>(gate_up, s, a, first, last, reduce);
    first = TakeChunk(counters + 2, blocks * share, total, &s.taken), last = first + 1;
    if (first >= total) break;
  }

  // The down product: rows_out [routes + T, H]. Between arriving at the barrier and waiting there,
  // the block puts its static share's first weights in flight to L2.
  Product down{false, static_cast<const Bf16*>(a.hidden), hidden_pitch, static_cast<const Bf16*>(a.down),
               static_cast<const Bf16*>(a.shared_down), a.ffn, hidden, a.shared_ffn, hidden,
               static_cast<Bf16*>(a.rows_out), hidden,
               static_cast<int>(hidden / kChunkCols), static_cast<int>(hidden / kChunkCols)};
  total = groups * down.chunks_routed;
  share = static_cast<int>(static_cast<int64_t>(total) * kStaticPercent / (100 * blocks));
  const int generation = GridArrive(counters);
  if (a.prefetch_down) PrefetchSpan(down, s, b * share, (b + 1) * share);
  GridWait(counters, generation);

  int* arrivals = counters + kFixedWords;
  const int hidden_chunks = static_cast<int>(hidden / kChunkCols);
  if (groups == 0) {  // every route dropped, no shared expert: the output is the residual's sum with 0
    for (int hc0 = b; hc0 < hidden_chunks; hc0 += blocks * kThreads) {
      if (threadIdx.x == 0) s.num_combine = 0;
      __syncthreads();
      const int hc = hc0 + static_cast<int>(threadIdx.x) * blocks;
      if (hc < hidden_chunks) s.combine[atomicAdd(&s.num_combine, 1)] = hc;
      __syncthreads();
      CombineChunks(a, s, s.combine, s.num_combine);
      __syncthreads();
    }
    return;
  }
  if (threadIdx.x == 0) s.num_combine = 0;
  __syncthreads();
  // Down chunks [first, last), then counted in per column chunk of H: the last block to finish a
  // column chunk combines it.
  auto down_chunks = [&](int first, int last) {
    Span<kRows>(down, s, a, first, last, reduce);
    __threadfence();
    __syncthreads();
    for (int c = first + static_cast<int>(threadIdx.x); c < last; c += kThreads) {
      const int hc = c % hidden_chunks;
      if (atomicAdd(arrivals + hc, 1) == groups - 1) {
        arrivals[hc] = 0;  // for the next call (stream order publishes it)
        s.combine[atomicAdd(&s.num_combine, 1)] = hc;
      }
    }
  };
  for (int first = b * share, last = (b + 1) * share;;) {
    down_chunks(first, last);
    first = TakeChunk(counters + 3, blocks * share, total, &s.taken), last = first + 1;
    if (first >= total) break;
  }
  __syncthreads();
  if (s.num_combine == 0) return;
  __threadfence();
  CombineChunks(a, s, s.combine, s.num_combine);
}

// Knobs read once from the environment, for measuring: JAX_MOE_DECODE_LAYER_BLOCKS_PER_SM (default
// 1: the chunks are shared out per block, so with two an SM the SMs' shares would differ by up to
// two chunks), JAX_MOE_DECODE_LAYER_THREADS (256 or 512; default 512 up to two rows a pass, whose
// registers allow it: twice the weight loads in flight an SM), JAX_MOE_DECODE_LAYER_PREFETCH (0: no
// L2 prefetch of the down weights before the barrier).
int EnvInt(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : fallback;
}

int BlocksPerSm() {
  static const int blocks = std::clamp(EnvInt("JAX_MOE_DECODE_LAYER_BLOCKS_PER_SM", 1), 1, 4);
  return blocks;
}

int ThreadsWanted() {
  static const int threads = EnvInt("JAX_MOE_DECODE_LAYER_THREADS", 0);
  return threads;
}

template <int kRows, int kThreads>
cudaError_t LaunchRows(const DecodeLayerArgs& args, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(kThreads) * kRows * 8 * sizeof(float);
  static cudaError_t configured = cudaFuncSetAttribute(DecodeLayerKernel<kRows, kThreads>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(smem));
  if (configured != cudaSuccess) return configured;
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, DecodeLayerKernel<kRows, kThreads>,
                                                                    kThreads, smem);
      e != cudaSuccess)
    return e;
  const int sms = GemmSmCount();
  if (per_sm < 1 || sms < 1) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(sms * std::min(per_sm, BlocksPerSm())));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, DecodeLayerKernel<kRows, kThreads>, args);
}

template <int kRows>
cudaError_t LaunchRowsWide(const DecodeLayerArgs& args, cudaStream_t stream) {
  return ThreadsWanted() == 256 ? LaunchRows<kRows, 256>(args, stream) : LaunchRows<kRows, 512>(args, stream);
}

}  // namespace

bool DecodeLayerFits(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t ffn,
                     int64_t shared_ffn) {
  return num_tokens >= 1 && num_tokens <= kDecodeLayerMaxTokens && top_k >= 1 &&
         num_tokens * top_k <= kDecodeLayerMaxRoutes && num_experts >= 1 && hidden >= kChunkCols &&
         hidden % kChunkCols == 0 && hidden / kChunkCols + kFixedWords <= kDecodeLayerCounterWords &&
         ffn >= kChunkCols && ffn % kChunkCols == 0 && shared_ffn >= 0 && shared_ffn % kChunkCols == 0;
}

cudaError_t LaunchDecodeLayer(const DecodeLayerArgs& a, cudaStream_t stream) {
  const bool shared = a.shared_gate_up != nullptr;
  if (!DecodeLayerFits(a.num_tokens, a.top_k, a.num_experts, a.hidden_size, a.ffn, shared ? a.shared_ffn : 0) ||
      (shared && (a.shared_down == nullptr || a.shared_ffn < kChunkCols)) || a.x == nullptr ||
      a.residual == nullptr || a.topk_ids == nullptr || a.topk_weights == nullptr || a.gate_up == nullptr ||
      a.down == nullptr || a.hidden == nullptr || a.rows_out == nullptr || a.out == nullptr ||
      a.counters == nullptr || (a.shared_gate != nullptr && (!shared || a.gate_logits == nullptr)))
    return cudaErrorInvalidValue;
  const bool prefetch = EnvInt("JAX_MOE_DECODE_LAYER_PREFETCH", 1) != 0;
  DecodeLayerArgs args = a;
  args.prefetch_down = prefetch;
  if (a.num_tokens == 1) return LaunchRowsWide<1>(args, stream);
  if (a.num_tokens == 2) return LaunchRowsWide<2>(args, stream);
  if (a.num_tokens <= 4) return LaunchRows<4, 256>(args, stream);
  return LaunchRows<8, 256>(args, stream);
}

}  // namespace jax_moe
