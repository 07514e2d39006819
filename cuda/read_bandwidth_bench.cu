// How fast an H100/H200 reads the FP8 decode kernel's weights, by load scheme, without XLA: the
// routed gate/up weights of DeepSeek-V3 at T = 1 (8 experts x [4096, 7168] e4m3 = 235 MB, as one
// [32768, 7168] byte matrix, rotated over 4 copies so no read comes from L2), each scheme's kernel
// only reading (and folding the bytes into a value it never stores, so nothing is dead code).
// Schemes: contiguous 16-byte loads (the copy rate's pattern); the decode kernel's tile pattern
// into registers, as MmaBlock's fragments (Fp8StreamSegment's loads until session 35) and as
// whole lines swapped between lanes (its loads since), with 1, 2 and 4 blocks an SM; cp.async into
// per-warp rings (Fp8RingSegment's); one-dimensional bulk copies (cp.async.bulk, one producer
// warp) into a shared ring: row pieces, whole rows, and contiguous chunks; whole rows a warp and
// 16-row tiles swept in address order, each also with a GEMV's arithmetic on the bytes (e4m3
// decoded to float32, dot products with 1 or 2 tokens) in place of the tensor cores'.
// On the GPU machine, repository root:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a cuda/read_bandwidth_bench.cu -o /tmp/rbw && /tmp/rbw
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_timing.h"
#include "bf16_vector.cuh"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned SmemAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// The folded bytes are stored only if they equal a value they never do: the loads stay live.
__device__ __forceinline__ void Keep(unsigned folded, unsigned* sink) {
  if (folded == 0x9e3779b9u) *sink = folded;
}

// Each block's share of `bytes` for the contiguous schemes: whole 4 KB pages, the last blocks' shorter
// (or empty), every byte read. (Until session 38 the shares were rounded down to 64 KB, so with 4
// blocks an SM they read 207.6 of the 234.9 MB the rate was computed over: the "3.35-3.41 TB/s" of
// that scheme in fp8_decode_whole_lines_h100.md was about 3.0 read.)
__device__ __forceinline__ int64_t ShareBytes(int64_t bytes) { return (bytes / gridDim.x + 4095) / 4096 * 4096; }

// Contiguous: block b reads its contiguous share, kDepth 16-byte loads a thread in flight.
template <int kDepth>
__global__ void __launch_bounds__(kThreads) Contiguous(const uint8_t* src, int64_t bytes, unsigned* sink) {
  const int64_t per_block = ShareBytes(bytes), begin = blockIdx.x * per_block;
  const int64_t share = begin >= bytes ? 0 : (bytes - begin < per_block ? bytes - begin : per_block);
  const uint8_t* base = src + begin;
  unsigned folded = 0;
  for (int64_t offset = threadIdx.x * 16; offset < share; offset += kThreads * 16 * kDepth) {
    uint4 v[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int64_t at = offset + d * kThreads * 16;
      v[d] = at < share ? jax_moe::LoadStreamingBytes(base + at) : uint4{};
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) folded ^= v[d].x ^ v[d].w;
  }
  Keep(folded, sink);
}

// The decode kernel's tiles into registers: a block takes consecutive 16-row tiles, its 8 warps
// split K (128-byte blocks); per K block lane (g, t) loads rows g and g + 8 at t * 16 and
// 64 + t * 16 (MmaBlock's A operand: half a line of 8 rows an instruction), kDepth K blocks in flight.
template <int kDepth>
__global__ void __launch_bounds__(kThreads, 1) TileRegisters(const uint8_t* src, int64_t n, int64_t k,
                                                             int tiles_per_block, unsigned* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t blocks_k = k / 128, kb0 = warp * blocks_k / 8, kb1 = (warp + 1) * blocks_k / 8;
  unsigned folded = 0;
  for (int j = 0; j < tiles_per_block; ++j) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + j;
    if (tile >= n / 16) break;
    const uint8_t* row = src + (tile * 16 + g) * k + t * 16;
    for (int64_t kb = kb0; kb < kb1; kb += kDepth) {
      uint4 v[kDepth][4];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const uint8_t* p = row + (kb + d) * 128;
        const bool in = kb + d < kb1;
        v[d][0] = in ? jax_moe::LoadStreamingBytes(p) : uint4{};
        v[d][1] = in ? jax_moe::LoadStreamingBytes(p + 64) : uint4{};
        v[d][2] = in ? jax_moe::LoadStreamingBytes(p + 8 * k) : uint4{};
        v[d][3] = in ? jax_moe::LoadStreamingBytes(p + 8 * k + 64) : uint4{};
      }
#pragma unroll
      for (int d = 0; d < kDepth; ++d)
#pragma unroll
        for (int i = 0; i < 4; ++i) folded ^= v[d][i].x ^ v[d][i].w;
    }
  }
  Keep(folded, sink);
}

// The same tiles as whole lines: lane (g, t) loads chunk 4 * (g & 1) + t of rows g / 2 + 4i, i < 4
// (each 8 lanes one row's 128 bytes an instruction, Fp8StreamSegment's loads), then swaps one of
// each two loads with lane g ^ 1 (LinesToFragments' shuffles) before folding them.
template <int kDepth, int kBlocksPerSm = 1>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) TileLines(const uint8_t* src, int64_t n, int64_t k,
                                                                    int tiles_per_block, unsigned* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const bool odd = g & 1;
  const int64_t blocks_k = k / 128, kb0 = warp * blocks_k / 8, kb1 = (warp + 1) * blocks_k / 8;
  unsigned folded = 0;
  for (int j = 0; j < tiles_per_block; ++j) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + j;
    if (tile >= n / 16) break;
    const uint8_t* row = src + (tile * 16 + (g >> 1)) * k + ((g & 1) * 4 + t) * 16;
    for (int64_t kb = kb0; kb < kb1; kb += kDepth) {
      uint4 v[kDepth][4];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const bool in = kb + d < kb1;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[d][i] = in ? jax_moe::LoadStreamingBytes(row + (kb + d) * 128 + 4 * i * k) : uint4{};
      }
#pragma unroll
      for (int d = 0; d < kDepth; ++d)
#pragma unroll
        for (int h = 0; h < 4; h += 2) {
          const uint4 send = odd ? v[d][h] : v[d][h + 1];
          const unsigned got_x = __shfl_xor_sync(0xffffffffu, send.x, 4), got_w = __shfl_xor_sync(0xffffffffu, send.w, 4);
          folded ^= (odd ? got_x : v[d][h].x) ^ (odd ? v[d][h + 1].w : got_w);
        }
    }
  }
  Keep(folded, sink);
}

// The ring kernel's copies: each warp its K range of a tile pair (32 rows), kStages slots of
// 4 KB, kStages - 1 items ahead (cp.async 16 bytes a lane, 4 rows x 128 bytes an instruction).
// kSlotBytes 4096 puts every slot on a 128-byte boundary; 4112 with the rings 16 bytes on is the
// FP8 decode kernel's layout before its slots were aligned (4 KB of tiles, 16 bytes of scales, a
// dynamic block 16-byte aligned): every other slot 16 bytes off a 32-byte boundary.
__device__ __forceinline__ void CpAsync16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SmemAddress(smem)), "l"(global));
}
template <int kStages, int kSlotBytes>
__global__ void __launch_bounds__(kThreads, 2) WarpRings(const uint8_t* src, int64_t n, int64_t k,
                                                         int pairs_per_block, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t rings[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* ring = rings + (kSlotBytes % 128) + warp * kStages * kSlotBytes;
  const int64_t blocks_k = k / 128, kb0 = warp * blocks_k / 8, count = (warp + 1) * blocks_k / 8 - kb0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * pairs_per_block;
  const int64_t pairs = first + pairs_per_block < n / 32 ? pairs_per_block : n / 32 - first;
  const int64_t total = pairs * count;
  const int copy_row = lane >> 3, copy_chunk = lane & 7;
  auto issue = [&](int64_t item) {
    const uint8_t* from = src + ((first + item / count) * 32 + copy_row) * k + copy_chunk * 16 + (kb0 + item % count) * 128;
    uint8_t* to = ring + (item % kStages) * kSlotBytes;
#pragma unroll
    for (int j = 0; j < 8; ++j) CpAsync16(to + (copy_row + 4 * j) * 128 + copy_chunk * 16, from + 4 * j * k);
  };
  unsigned folded = 0;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total) issue(s);
    asm volatile("cp.async.commit_group;");
  }
  for (int64_t item = 0; item < total; ++item) {
    if (item + kStages - 1 < total) issue(item + kStages - 1);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
    __syncwarp();
    folded ^= reinterpret_cast<const unsigned*>(ring + (item % kStages) * kSlotBytes)[lane * 4];
    __syncwarp();
  }
  Keep(folded, sink);
}

// Bulk copies: one block an SM, a shared ring of `stages` stages of 16 row pieces of `piece`
// bytes (rows k apart) of a 16-row tile, pieces walking K. Warp 0's lanes 0-15 copy a stage's
// pieces (cp.async.bulk, completing on the stage's `full` barrier); warps 1-7 wait on it, read
// it and release it (`empty`).
__device__ __forceinline__ void BarrierInit(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddress(bar)), "r"(count));
}
__device__ __forceinline__ void BarrierExpectBytes(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddress(bar)), "r"(bytes));
}
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddress(bar)));
}
__device__ __forceinline__ void BarrierWait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(SmemAddress(bar)),
      "r"(parity));
}
__device__ __forceinline__ void BulkCopy(void* smem, const void* global, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   SmemAddress(smem)),
               "l"(global), "r"(bytes), "r"(SmemAddress(bar))
               : "memory");
}
constexpr int kMaxBulkStages = 16;
// A ring's barriers: `full` completes on its stage's copies (one arrival and the bytes), `empty` on
// the 7 consumer warps' releases. Whole block.
__device__ void InitRing(uint64_t* full, uint64_t* empty, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], kThreads / 32 - 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
}
// Warps 1-7: wait for each of `items` stages of stage_bytes in turn, read a word of it and release it.
__device__ void ConsumeRing(const uint8_t* ring, int stage_bytes, int64_t items, int stages, uint64_t* full,
                            uint64_t* empty, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  unsigned folded = 0;
  for (int64_t item = 0; item < items; ++item) {
    const int s = static_cast<int>(item % stages);
    BarrierWait(&full[s], static_cast<unsigned>((item / stages) & 1));
    folded ^= reinterpret_cast<const uint4*>(ring + s * stage_bytes)[(threadIdx.x - 32) % (stage_bytes / 16)].x;
    __syncwarp();
    if (lane == 0) BarrierArrive(&empty[s]);
  }
  Keep(folded, sink);
}
__global__ void __launch_bounds__(kThreads, 1) BulkRing(const uint8_t* src, int64_t n, int64_t k, int piece,
                                                        int stages, int tiles_per_block, unsigned* sink, int rows = 16) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kMaxBulkStages], empty[kMaxBulkStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int stage_bytes = rows * piece;
  InitRing(full, empty, stages);
  // A tile of `rows` rows: the block's tiles_per_block 16-row tiles as 16 / rows as many.
  const int64_t pieces_per_row = k / piece, per_tile16 = 16 / rows;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block * per_tile16;
  const int64_t last_tile = min(first_tile + tiles_per_block * per_tile16, n / rows);
  const int64_t items = (last_tile - first_tile) * pieces_per_row;
  if (warp == 0) {
    for (int64_t item = 0; item < items; ++item) {
      const int s = static_cast<int>(item % stages);
      const int64_t round = item / stages;
      if (round > 0) BarrierWait(&empty[s], static_cast<unsigned>((round - 1) & 1));
      if (lane == 0) BarrierExpectBytes(&full[s], stage_bytes);
      __syncwarp();
      if (lane < rows) {
        const int64_t tile = first_tile + item / pieces_per_row, p = item % pieces_per_row;
        BulkCopy(ring + s * stage_bytes + lane * piece, src + (tile * rows + lane) * k + p * piece, piece, &full[s]);
      }
    }
  } else {
    ConsumeRing(ring, stage_bytes, items, stages, full, empty, sink);
  }
}

// Contiguous bulk copies: each block streams its contiguous share of the bytes as single
// cp.async.bulk copies of `chunk` bytes (not row pieces), through a ring of `stages` chunks; warp
// 0's lane 0 copies, warps 1-7 wait, read a word and release.
__global__ void __launch_bounds__(kThreads, 1) BulkContiguous(const uint8_t* src, int64_t bytes, int chunk,
                                                              int stages, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kMaxBulkStages], empty[kMaxBulkStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  InitRing(full, empty, stages);
  // Every byte read (ShareBytes), the block's last copy short.
  const int64_t per_block = ShareBytes(bytes), begin = blockIdx.x * per_block;
  const int64_t share = begin >= bytes ? 0 : (bytes - begin < per_block ? bytes - begin : per_block);
  const int64_t items = (share + chunk - 1) / chunk;
  const uint8_t* base = src + begin;
  if (warp == 0) {
    if (lane == 0)
      for (int64_t item = 0; item < items; ++item) {
        const int s = static_cast<int>(item % stages);
        const int64_t round = item / stages;
        if (round > 0) BarrierWait(&empty[s], static_cast<unsigned>((round - 1) & 1));
        const unsigned size = static_cast<unsigned>(share - item * chunk < chunk ? share - item * chunk : chunk);
        BarrierExpectBytes(&full[s], size);
        BulkCopy(ring + s * chunk, base + item * chunk, size, &full[s]);
      }
  } else {
    ConsumeRing(ring, chunk, items, stages, full, empty, sink);
  }
}

// The GEMV schemes' arithmetic: 16 e4m3 bytes as float32, and their dot product with 16 float32
// values of x held as x[0], x[32], x[64], x[96] (float4 each: conflict-free across a warp's lanes).
__device__ __forceinline__ void DecodeE4m3x16(const uint4& v, float (&w)[16]) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[q] & 0xffff), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[q] >> 16), __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    w[4 * q] = a.x, w[4 * q + 1] = a.y, w[4 * q + 2] = b.x, w[4 * q + 3] = b.y;
  }
}
__device__ __forceinline__ float Dot16(const float (&w)[16], const float4* x) {
  float part = 0.0f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 xv = x[q * 32];
    part = fmaf(w[4 * q], xv.x, part);
    part = fmaf(w[4 * q + 1], xv.y, part);
    part = fmaf(w[4 * q + 2], xv.z, part);
    part = fmaf(w[4 * q + 3], xv.w, part);
  }
  return part;
}

// Whole rows per warp: warp w streams its own rows of the [N, K] matrix, 512 contiguous bytes an
// instruction (lane l: 16 bytes at l * 16 of each 512), kDepth instructions in flight. With kTokens > 0
// it also takes each row's dot products with kTokens rows of x (float32 in shared memory, laid out so
// that lane l's 16 values of a 512-byte chunk are 4 conflict-free 16-byte reads): the e4m3 bytes
// decoded to float32, 16 fused multiply-adds a token, a block scale per 128 bytes of K, a warp sum per row.
template <int kDepth, int kTokens, int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) RowGemv(const uint8_t* src, int64_t n, int64_t k,
                                                                  unsigned* sink) {
  extern __shared__ __align__(16) float xs[];  // [kTokens][k / 512][4][32 lanes][4]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = static_cast<int>(k / 512);
  for (int i = threadIdx.x; i < kTokens * k; i += kThreads) xs[i] = 1.0f + (i & 7) * 0.125f;
  __syncthreads();
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32), gw = blockIdx.x * (kThreads / 32) + warp;
  const int64_t r0 = gw * n / warps, r1 = (gw + 1) * n / warps;
  unsigned folded = 0;
  float total = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = src + r * k + lane * 16;
    float acc[kTokens > 0 ? kTokens : 1] = {};
    for (int c = 0; c < chunks; c += kDepth) {
      uint4 v[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) v[d] = c + d < chunks ? jax_moe::LoadStreamingBytes(row + (c + d) * 512) : uint4{};
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if constexpr (kTokens == 0) {
          folded ^= v[d].x ^ v[d].w;
        } else {
          if (c + d >= chunks) break;
          float w[16];
          DecodeE4m3x16(v[d], w);
          const float scale = 1.0f + ((c + d) & 3) * 0.25f;  // a block scale per 128 bytes of K
#pragma unroll
          for (int t = 0; t < kTokens; ++t) {
            const float4* x = reinterpret_cast<const float4*>(xs + (static_cast<int64_t>(t) * chunks + c + d) * 512) + lane;
            acc[t] = fmaf(Dot16(w, x), scale, acc[t]);
          }
        }
      }
    }
    if constexpr (kTokens > 0) {
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        float sum = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        total += sum;
      }
    }
  }
  Keep(folded ^ __float_as_uint(total), sink);
}

// A tile's rows swept in address order: a block takes 16-row tiles (16 x K contiguous bytes), and
// step j of its threads reads bytes j * 4096 + thread * 16 of the tile (kDepth steps in flight), so
// the SM's loads in flight are one narrow window, as in the contiguous scheme. Each warp's 512 bytes
// lie in one row (K a multiple of 512): with kTokens > 0 the lanes take their 16 bytes' dot products
// with x (float32 in shared memory, piece p's float4 q at (p / 32 * 4 + q) * 32 + p % 32: conflict-free),
// a block scale per 128 bytes, a warp sum, and lane 0 stores the row's chunk sum for a fixed-order
// reduction at the tile's end.
template <int kDepth, int kTokens, int kBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) TileSweep(const uint8_t* src, int64_t n, int64_t k,
                                                                    int tiles_per_block, unsigned* sink) {
  extern __shared__ __align__(16) float xs[];  // [kTokens][k], then [kTokens][16][k / 512] chunk sums
  const int lane = threadIdx.x & 31;
  const int chunks = static_cast<int>(k / 512);
  float* sums = xs + kTokens * k;
  for (int i = threadIdx.x; i < kTokens * k; i += kThreads) xs[i] = 1.0f + (i & 7) * 0.125f;
  __syncthreads();
  const int steps = static_cast<int>(16 * k / 4096);
  unsigned folded = 0;
  float total = 0.0f;
  for (int j = 0; j < tiles_per_block; ++j) {
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * tiles_per_block + j;
    if (tile >= n / 16) break;
    const uint8_t* base = src + tile * 16 * k + threadIdx.x * 16;
    for (int step = 0; step < steps; step += kDepth) {
      uint4 v[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth; ++d) v[d] = step + d < steps ? jax_moe::LoadStreamingBytes(base + (step + d) * 4096) : uint4{};
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if constexpr (kTokens == 0) {
          folded ^= v[d].x ^ v[d].w;
        } else {
          if (step + d >= steps) break;
          const int offset = (step + d) * 4096 + threadIdx.x * 16;
          const int row = offset / static_cast<int>(k), col = offset - row * static_cast<int>(k);
          float w[16];
          DecodeE4m3x16(v[d], w);
          const float scale = 1.0f + ((col >> 7) & 3) * 0.25f;
          const int piece = col / 16;
#pragma unroll
          for (int t = 0; t < kTokens; ++t) {
            const float4* x = reinterpret_cast<const float4*>(xs + t * k) + (piece / 32 * 4) * 32 + piece % 32;
            float part = Dot16(w, x) * scale;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (lane == 0) sums[(t * 16 + row) * chunks + col / 512] = part;
          }
        }
      }
    }
    if constexpr (kTokens > 0) {
      __syncthreads();
      if (threadIdx.x < 16 * kTokens) {
        float sum = 0.0f;
        for (int c = 0; c < chunks; ++c) sum += sums[threadIdx.x * chunks + c];
        total += sum;
      }
      __syncthreads();
    }
  }
  Keep(folded ^ __float_as_uint(total), sink);
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t k = 7168, n = 8 * 4096, bytes = n * k;
  const int copies = 4;
  std::vector<uint8_t*> weights(copies);
  for (auto& w : weights) {
    CK(cudaMalloc(&w, bytes));
    CK(cudaMemset(w, 1, bytes));
  }
  unsigned* sink;
  CK(cudaMalloc(&sink, sizeof(unsigned)));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  // Mean time of 20 back-to-back calls over the rotated copies (3 warm-up calls), and its read rate.
  auto report = [&](const char* name, auto launch) {
    for (int i = 0; i < 3; ++i) launch(weights[i % copies]);
    CK(cudaDeviceSynchronize());
    const int reps = 20;
    CK(cudaEventRecord(start));
    for (int i = 0; i < reps; ++i) launch(weights[i % copies]);
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    const double us = ms * 1e3 / reps;
    printf("%-48s %8.1f us  %6.2f TB/s\n", name, us, bytes / us / 1e6);
  };
  char name[96];
  {
    uint8_t* to;
    CK(cudaMalloc(&to, bytes));
    report("cudaMemcpy D2D of half (read + write)", [&](uint8_t* w) {
      CK(cudaMemcpyAsync(to, w, bytes / 2, cudaMemcpyDeviceToDevice));
    });
    CK(cudaFree(to));
  }
  for (int per_sm : {1, 2, 4}) {
    snprintf(name, sizeof(name), "contiguous, 8 loads a thread, %d block(s) an SM", per_sm);
    report(name, [&](uint8_t* w) { Contiguous<8><<<sms * per_sm, kThreads>>>(w, bytes, sink); });
    snprintf(name, sizeof(name), "contiguous, 4 loads a thread, %d block(s) an SM", per_sm);
    report(name, [&](uint8_t* w) { Contiguous<4><<<sms * per_sm, kThreads>>>(w, bytes, sink); });
  }
  const int64_t tiles = n / 16;
  const int tiles_per_block = static_cast<int>((tiles + sms - 1) / sms);
  const unsigned tile_grid = static_cast<unsigned>((tiles + tiles_per_block - 1) / tiles_per_block);
  report("tiles into registers, 2 K blocks in flight", [&](uint8_t* w) {
    TileRegisters<2><<<tile_grid, kThreads>>>(w, n, k, tiles_per_block, sink);
  });
  report("tiles into registers, 4 K blocks in flight", [&](uint8_t* w) {
    TileRegisters<4><<<tile_grid, kThreads>>>(w, n, k, tiles_per_block, sink);
  });
  report("tiles as whole lines into registers, 2 in flight", [&](uint8_t* w) {
    TileLines<2><<<tile_grid, kThreads>>>(w, n, k, tiles_per_block, sink);
  });
  report("tiles as whole lines into registers, 4 in flight", [&](uint8_t* w) {
    TileLines<4><<<tile_grid, kThreads>>>(w, n, k, tiles_per_block, sink);
  });
  // The same with 2 and 4 blocks an SM (16 and 32 warps issuing loads).
  using TileKernel = void (*)(const uint8_t*, int64_t, int64_t, int, unsigned*);
  const struct {
    int depth, per_sm;
    TileKernel kernel;
  } tile_lines[] = {{1, 2, TileLines<1, 2>}, {2, 2, TileLines<2, 2>}, {4, 2, TileLines<4, 2>},
                    {1, 4, TileLines<1, 4>}, {2, 4, TileLines<2, 4>}, {4, 4, TileLines<4, 4>}};
  for (const auto& v : tile_lines) {
    const int per_block = static_cast<int>((tiles + v.per_sm * sms - 1) / (v.per_sm * sms));
    const unsigned grid = static_cast<unsigned>((tiles + per_block - 1) / per_block);
    snprintf(name, sizeof(name), "tiles as whole lines, %d in flight, %d blocks an SM", v.depth, v.per_sm);
    report(name, [&](uint8_t* w) { v.kernel<<<grid, kThreads>>>(w, n, k, per_block, sink); });
  }
  {
    const int64_t pairs = n / 32;
    const int per_block = static_cast<int>((pairs + 2 * sms - 1) / (2 * sms));
    const unsigned grid = static_cast<unsigned>((pairs + per_block - 1) / per_block);
    constexpr int kAligned = 4096, kOff = 4112;  // see WarpRings
    const int smem2 = 8 * 2 * kAligned, smem3 = 8 * 3 * kAligned, smem_off = 128 + 8 * 2 * kOff;
    CK(cudaFuncSetAttribute(WarpRings<2, kAligned>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem2));
    CK(cudaFuncSetAttribute(WarpRings<3, kAligned>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem3));
    CK(cudaFuncSetAttribute(WarpRings<2, kOff>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_off));
    report("cp.async warp rings, 2 slots, 2 blocks an SM", [&](uint8_t* w) {
      WarpRings<2, kAligned><<<grid, kThreads, smem2>>>(w, n, k, per_block, sink);
    });
    report("cp.async warp rings, 3 slots, 2 blocks an SM", [&](uint8_t* w) {
      WarpRings<3, kAligned><<<grid, kThreads, smem3>>>(w, n, k, per_block, sink);
    });
    report("cp.async warp rings, 2 slots, every other one 16 B off", [&](uint8_t* w) {
      WarpRings<2, kOff><<<grid, kThreads, smem_off>>>(w, n, k, per_block, sink);
    });
  }
  const int max_smem = 200 * 1024;
  // Whole rows a warp, 1 to 4 blocks an SM; without and with the dot products of 1 and 2 tokens.
  {
    auto row_gemv = [&](const char* what, auto kernel, int per_sm, int tokens) {
      const int smem = tokens * static_cast<int>(k) * 4;
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem > 0 ? smem : 1024));
      snprintf(name, sizeof(name), "whole rows a warp, %s, %d blocks an SM", what, per_sm);
      report(name, [&](uint8_t* w) { kernel<<<sms * per_sm, kThreads, smem>>>(w, n, k, sink); });
    };
    row_gemv("4 in flight, loads only", RowGemv<4, 0, 1>, 1, 0);
    row_gemv("4 in flight, loads only", RowGemv<4, 0, 2>, 2, 0);
    row_gemv("2 in flight, loads only", RowGemv<2, 0, 4>, 4, 0);
    row_gemv("4 in flight, loads only", RowGemv<4, 0, 4>, 4, 0);
    row_gemv("2 in flight, T = 1", RowGemv<2, 1, 2>, 2, 1);
    row_gemv("4 in flight, T = 1", RowGemv<4, 1, 2>, 2, 1);
    row_gemv("2 in flight, T = 1", RowGemv<2, 1, 4>, 4, 1);
    row_gemv("4 in flight, T = 1", RowGemv<4, 1, 4>, 4, 1);
    row_gemv("2 in flight, T = 2", RowGemv<2, 2, 2>, 2, 2);
    row_gemv("2 in flight, T = 2", RowGemv<2, 2, 3>, 3, 2);
    row_gemv("4 in flight, T = 2", RowGemv<4, 2, 3>, 3, 2);
  }
  // Tiles swept in address order, 1 to 4 blocks an SM; without and with the dot products.
  {
    auto sweep = [&](const char* what, auto kernel, int per_sm, int tokens) {
      const int smem = tokens * static_cast<int>(k) * 4 + tokens * 16 * static_cast<int>(k / 512) * 4;
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem > 0 ? smem : 1024));
      const int per_block = static_cast<int>((tiles + per_sm * sms - 1) / (per_sm * sms));
      const unsigned grid = static_cast<unsigned>((tiles + per_block - 1) / per_block);
      snprintf(name, sizeof(name), "tiles swept in order, %s, %d blocks an SM", what, per_sm);
      report(name, [&](uint8_t* w) { kernel<<<grid, kThreads, smem>>>(w, n, k, per_block, sink); });
    };
    sweep("4 in flight, loads only", TileSweep<4, 0, 1>, 1, 0);
    sweep("4 in flight, loads only", TileSweep<4, 0, 2>, 2, 0);
    sweep("4 in flight, loads only", TileSweep<4, 0, 4>, 4, 0);
    sweep("2 in flight, loads only", TileSweep<2, 0, 4>, 4, 0);
    sweep("4 in flight, T = 1", TileSweep<4, 1, 2>, 2, 1);
    sweep("2 in flight, T = 1", TileSweep<2, 1, 4>, 4, 1);
    sweep("4 in flight, T = 1", TileSweep<4, 1, 4>, 4, 1);
    sweep("4 in flight, T = 2", TileSweep<4, 2, 2>, 2, 2);
    sweep("2 in flight, T = 2", TileSweep<2, 2, 3>, 3, 2);
    sweep("4 in flight, T = 2", TileSweep<4, 2, 3>, 3, 2);
  }
  CK(cudaFuncSetAttribute(BulkRing, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  for (int piece : {1024, 1792, 3584, 7168}) {
    for (int rows : {16, 8}) {
      for (int stages : {2, 3, 4, 6, 8}) {
        const int smem = stages * rows * piece;
        if (smem > max_smem || (piece < 3584 && (rows != 16 || stages < 4))) continue;
        snprintf(name, sizeof(name), "bulk copies of %d bytes, %d rows, %d stages (%d KB)", piece, rows, stages,
                 smem / 1024);
        report(name, [&](uint8_t* w) {
          BulkRing<<<tile_grid, kThreads, smem>>>(w, n, k, piece, stages, tiles_per_block, sink, rows);
        });
      }
    }
  }
  // Whole rows of the [N, K] matrix (7168 bytes each) with 2 and 4 blocks an SM: more copies in flight.
  for (int per_sm : {2, 4}) {
    for (int rows : {8, 4, 2}) {
      for (int stages : {2, 3, 4, 6}) {
        const int smem = stages * rows * 7168;
        if (smem * per_sm > 220 * 1024 || rows * per_sm > 16) continue;
        const int per_block = static_cast<int>((tiles + per_sm * sms - 1) / (per_sm * sms));
        const unsigned grid = static_cast<unsigned>((tiles + per_block - 1) / per_block);
        snprintf(name, sizeof(name), "bulk copies of whole rows, %d rows, %d stages, %d blocks an SM", rows, stages, per_sm);
        report(name, [&](uint8_t* w) { BulkRing<<<grid, kThreads, smem>>>(w, n, k, 7168, stages, per_block, sink, rows); });
      }
    }
  }
  CK(cudaFuncSetAttribute(BulkContiguous, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  for (int per_sm : {2, 4})
    for (int chunk : {16384, 32768})
      for (int stages : {2, 3}) {
        const int smem = stages * chunk;
        if (smem * per_sm > 220 * 1024) continue;
        snprintf(name, sizeof(name), "contiguous bulk copies of %d KB, %d stages, %d blocks an SM", chunk / 1024, stages, per_sm);
        report(name, [&](uint8_t* w) { BulkContiguous<<<sms * per_sm, kThreads, smem>>>(w, bytes, chunk, stages, sink); });
      }
  for (int chunk : {8192, 16384, 32768, 57344}) {
    for (int stages : {2, 3, 4, 6, 8, 12}) {
      const int smem = stages * chunk;
      if (smem > max_smem || stages > kMaxBulkStages) continue;
      snprintf(name, sizeof(name), "contiguous bulk copies of %d KB, %d stages", chunk / 1024, stages);
      report(name, [&](uint8_t* w) { BulkContiguous<<<sms, kThreads, smem>>>(w, bytes, chunk, stages, sink); });
    }
  }
  return 0;
}
