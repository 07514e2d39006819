// The FP8 decode grouped GEMM (fp8_decode_gemm_kernels.h): SwiGLU experts at decode on FP8 tensor
// cores, each active expert's weights streamed once over all SMs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "bf16_vector.cuh"
#include "decode_gemm_common.cuh"
#include "fp8_decode_gemm_kernels.h"
#include "fp8_quantize.cuh"
#include "grouped_gemm_kernels.h"

namespace jax_moe {
namespace {

// A one-dimensional grid over a schedule of runs (Fp8DecodeGemmArgs): a run is units_per_block
// 16-row weight tiles of one expert (gate/up: a tile of gate rows and the matching tile of up
// rows). The block stages its pass's rows quantised in shared memory; its 8 warps split into
// units_per_block units of 8 / units_per_block warps, which split the unit's K blocks, run after
// run (the block sums its warps' parts at the end of each). Each warp streams its tiles' K blocks
// through its own ring of `stages` shared-memory slots (Fp8RingSegment, cp.async: the next blocks'
// bytes stay in flight while it multiplies one), or through registers (Fp8StreamSegment), and
// keeps float32 sums as mma.sync C fragments: per 128-deep K block, four m16n8k32 products into
// zeros, then sum += part * w_scale * row_scale.
// Operands: lane (g = lane / 4, t = lane % 4) takes 16 weight bytes of tile rows Fp8TileRow(g) and
// that + 8 at t * 16 and at 64 + t * 16 in the K block, and the staged row's bytes at the same
// offsets: with the same permutation of K in both operands, the fragments need no shuffle (product
// j takes bytes 8j..8j+7 of the lane's 32). A shared expert's product can ride as one more slot.
constexpr int kFp8TileRows = 16;
constexpr int kFp8Block = static_cast<int>(kFp8ScaleBlock);
constexpr int kFp8TileBytes = kFp8TileRows * kFp8Block;  // one tile's K block: 2 KB
constexpr int kFp8RowPad = 64;  // bytes after each staged row: a quarter warp's 16-byte reads (rows g, g + 1) miss each other's banks
constexpr int kStageLoads = 2;  // row loads per thread in flight while staging
// Slots a warp's ring holds: deeper rings measured slower on the H200, at one block an SM and at two.
constexpr int kFp8RingStages = 2;
constexpr int64_t kSmemBytes = 227 * 1024;  // an H100/H200 block's shared memory

__device__ __forceinline__ void CpAsync16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "l"(global));
}
// CpAsync16 under an L2 policy (EvictFirstPolicy).
__device__ __forceinline__ void CpAsync16(void* smem, const void* global, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "l"(global), "l"(policy));
}
__device__ __forceinline__ void CpAsync4(void* smem, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))), "l"(global));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;" :: "n"(kPending)); }

// The tile row whose weights fragment row g (< 8) of MmaBlock's A operand holds (g + 8: that + 8):
// rows g / 2 and 4 + g / 2 for the pair g, g ^ 1. The 8 lanes of fragment rows 2a and 2a + 1 then
// load tile row a's whole 128-byte line of a K block in one instruction, and row 4 + a's in the
// next (Fp8StreamSegment); with fragment row g = tile row g an instruction took half a line of 8
// rows, and twice the memory requests. Each row's product is the same either way.
__device__ __forceinline__ int Fp8TileRow(int g) { return ((g & 1) << 2) | (g >> 1); }

// A slot's 16-byte chunk c of tile row r sits at chunk c ^ 4 in rows 4-7 and 12-15: a quarter
// warp's reads (tile rows a and 4 + a, chunks t or 4 + t) then fall in distinct banks.
__device__ __forceinline__ int SlotOffset(int row, int chunk) { return row * kFp8Block + ((chunk ^ (row & 4)) << 4); }

__device__ __forceinline__ void MmaE4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One K block of one 16-row tile against one 8-row slice of the staged rows: a = rows g, g + 8
// (32 bytes each: a[0..1] row g, a[2..3] row g + 8), b = row g of the slice (the same 32 bytes of K).
__device__ __forceinline__ void MmaBlock(float (&c)[4], const uint4 (&a)[4], const uint4 (&b)[2]) {
  c[0] = c[1] = c[2] = c[3] = 0.0f;
  MmaE4m3(c, a[0].x, a[2].x, a[0].y, a[2].y, b[0].x, b[0].y);
  MmaE4m3(c, a[0].z, a[2].z, a[0].w, a[2].w, b[0].z, b[0].w);
  MmaE4m3(c, a[1].x, a[3].x, a[1].y, a[3].y, b[1].x, b[1].y);
  MmaE4m3(c, a[1].z, a[3].z, a[1].w, a[3].w, b[1].z, b[1].w);
}

struct Fp8DecodeGemmArgs {
  const Bf16* rows;         // [>= out_rows, K]
  const uint8_t* weights;   // [El, N, K] e4m3
  const float* scale;       // [El, N / 128, K / 128]
  const int32_t* expert_offsets;
  Bf16* out;                // [out_rows, gated ? N / 2 : N]
  int64_t out_rows, num_groups, k, n;
  int units_per_block, stages;
  int runs_per_block;       // consecutive runs of units_per_block tiles a block takes (Fp8RunsPerBlock)
  int pass_rows;            // rows staged per pass, 1 to 8 * kSlices: no more than one expert can own
  // The schedule over the routed slots' runs (slot-major, runs_per_slot each), then the shared
  // product's: contiguous ranges of units_per_cta runs a block, or with units_per_cta 0
  // blocks_per_slot blocks a slot of runs_per_block runs each (no block meets two slots).
  int64_t num_slots, runs_per_slot, units_per_cta, blocks_per_slot;
  int64_t ring_offset;      // bytes of dynamic shared memory before the warps' rings: the staged rows'

  // Optional (shared_weights non-null): a shared expert's product as one more slot whose group is
  // every row of shared_rows, with its own sizes (N, K) and tiling.
  const Bf16* shared_rows = nullptr;        // [shared_count, shared_k]
  const uint8_t* shared_weights = nullptr;  // [shared_n, shared_k] e4m3
  const float* shared_scale = nullptr;      // [shared_n / 128, shared_k / 128]
  Bf16* shared_out = nullptr;               // [shared_count, gated ? shared_n / 2 : shared_n]
  int64_t shared_count = 0, shared_k = 0, shared_n = 0, shared_runs = 0;
  int shared_units_per_block = 1, shared_pass_rows = 1;
};

// Shared memory, dynamic: the pass's rows quantised [pass_rows][K + pad] bytes and their scales
// [pass_rows][K / 128] (Fp8StagingBytes), then each warp's ring of `stages` slots: kTiles K blocks of
// its tiles and their kTiles weight scales (Fp8SlotBytes), the rings and every slot starting on a
// 128-byte boundary: a slot off a 32-byte boundary sends its cp.async copies out unmerged.
constexpr int64_t kFp8SlotAlign = 128;
__host__ __device__ constexpr int64_t Fp8SlotBytes(int tiles) { return tiles * kFp8TileBytes + kFp8SlotAlign; }
// The first 128-byte boundary at or after p in shared memory (the dynamic block's start is only
// 16-byte aligned): Fp8DecodeSmem leaves kFp8SlotAlign bytes for the step.
__device__ __forceinline__ uint8_t* AlignSlots(uint8_t* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return p + ((kFp8SlotAlign - (address & (kFp8SlotAlign - 1))) & (kFp8SlotAlign - 1));
}
__host__ __device__ inline int64_t Fp8StagingBytes(int64_t rows, int64_t k) { return (rows * (k + kFp8RowPad) + rows * (k / kFp8Block) * 4 + 15) / 16 * 16; }

// Each warp's float32 sums of its tiles' C fragments, for the block's in-order reduction.
template <bool kGated, int kSlices>
using Fp8Partial = float[kWarps][kGated ? 2 : 1][kSlices][4][32];

// Stages rows_now rows of x [., k] bf16 quantised into shared memory (jax_moe.fp8.quantize_rows'
// bytes): staged [rows][k + kFp8RowPad] e4m3 and row_scale [rows][k / 128], kStageLoads pieces of 8
// values per thread in flight. Staged rows past rows_now keep stale bytes: each output column of the
// products depends on its own row alone, and those columns are never stored. Whole block.
__device__ void StageFp8Rows(const Bf16* x, int rows_now, int64_t k, uint8_t* staged, float* row_scale) {
  const int warp = threadIdx.x >> 5;
  const int64_t stride = k + kFp8RowPad, blocks_k = k / kFp8Block;
  const int64_t pieces_per_row = k / 8, pieces = rows_now * pieces_per_row;
  const int64_t padded = (pieces + 31) / 32 * 32;  // whole warps reach QuantizeGroupPiece's shuffles
  for (int64_t base = 0; base < padded; base += kStageLoads * kThreads) {
    uint4 raw[kStageLoads];
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int64_t piece = base + u * kThreads + threadIdx.x;
      const int r = static_cast<int>(piece / pieces_per_row);
      raw[u] = piece < pieces ? __ldg(reinterpret_cast<const uint4*>(x + r * k) + (piece - r * pieces_per_row)) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int64_t piece = base + u * kThreads + threadIdx.x;
      if (base + u * kThreads + warp * 32 >= padded) break;  // warp-uniform
      float v[8];
      Unpack(raw[u], v);
      uint2 packed;
      const float s = QuantizeGroupPiece(v, &packed);
      if (piece >= pieces) continue;
      const int r = static_cast<int>(piece / pieces_per_row);
      const int64_t col = (piece - r * pieces_per_row) * 8;
      *reinterpret_cast<uint2*>(staged + r * stride + col) = packed;
      if (col % kFp8Block == 0) row_scale[r * blocks_k + col / kFp8Block] = s;
    }
  }
}

// Rows past the live count are in no group: zero out columns [col0, col0 + cols) of them (the down
// product's blocks of slot 0, each its own columns). Whole block.
__device__ void ZeroFp8RowsPastLive(const Fp8DecodeGemmArgs& p, int64_t col0, int64_t cols) {
  const int out_rows = static_cast<int>(p.out_rows);
  const int live = Clamp(p.expert_offsets[p.num_groups], 0, out_rows);
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(out_rows - live) * cols; i += kThreads)
    p.out[(live + i / cols) * p.n + col0 + i % cols] = __float2bfloat16_rn(0.0f);
}

// One K block of a warp's tiles: sum[q][sl] += (tile q's 16 x 128 weights a[q] against staged rows
// sl * 8 .. sl * 8 + 7) * w_scale[q] * row_scale, in C-fragment layout (MmaBlock).
template <int kTiles, int kSlices>
__device__ __forceinline__ void Fp8BlockProduct(float (&sum)[kTiles][kSlices][4], const uint4 (&a)[kTiles][4],
                                                const float (&w_scale)[kTiles], const uint8_t* staged,
                                                const float* row_scale, int64_t stride, int64_t blocks_k,
                                                int64_t kb, int pass_rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl) {
    const uint8_t* x = staged + min(sl * 8 + g, pass_rows - 1) * stride + kb * kFp8Block + t * 16;
    const uint4 b[2] = {*reinterpret_cast<const uint4*>(x), *reinterpret_cast<const uint4*>(x + 64)};
    const float xs0 = row_scale[min(sl * 8 + 2 * t, pass_rows - 1) * blocks_k + kb];
    const float xs1 = row_scale[min(sl * 8 + 2 * t + 1, pass_rows - 1) * blocks_k + kb];
#pragma unroll
    for (int q = 0; q < kTiles; ++q) {
      float c[4];
      MmaBlock(c, a[q], b);
      sum[q][sl][0] = __fmaf_rn(c[0], __fmul_rn(w_scale[q], xs0), sum[q][sl][0]);
      sum[q][sl][1] = __fmaf_rn(c[1], __fmul_rn(w_scale[q], xs1), sum[q][sl][1]);
      sum[q][sl][2] = __fmaf_rn(c[2], __fmul_rn(w_scale[q], xs0), sum[q][sl][2]);
      sum[q][sl][3] = __fmaf_rn(c[3], __fmul_rn(w_scale[q], xs1), sum[q][sl][3]);
    }
  }
}

// The end of a run: every warp leaves its sums in `partial`, then each unit's first warp (first)
// sums its warps' parts in warp order and writes the unit's tile (gated: SwiGLU's activation, as
// LaunchSwigluQuantize: gate and up rounded to bf16, silu(gate) * up in float32). Whole block; the
// last barrier lets the next run rewrite `partial` (or the next pass restage the rows).
template <bool kGated, int kSlices>
__device__ __forceinline__ void Fp8RunEpilogue(Bf16* out, Fp8Partial<kGated, kSlices>& partial,
                                               const float (&sum)[kGated ? 2 : 1][kSlices][4], int64_t tile,
                                               bool tile_ok, bool first, int warps_per_unit, int first_row,
                                               int rows_now, int64_t out_width) {
  constexpr int kTiles = kGated ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < kTiles; ++q)
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
      for (int c = 0; c < 4; ++c) partial[warp][q][sl][c][lane] = sum[q][sl][c];
  __syncthreads();
  if (first && tile_ok) {
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        // C fragment: c0, c1 at fragment row g (tile row Fp8TileRow(g)), c2, c3 at g + 8.
        const int row = sl * 8 + 2 * t + (c & 1);
        const int64_t col = tile * kFp8TileRows + Fp8TileRow(g) + (c >> 1) * 8;
        float tile_sum[kTiles];
#pragma unroll
        for (int q = 0; q < kTiles; ++q) {
          tile_sum[q] = 0.0f;
          for (int w = 0; w < warps_per_unit; ++w) tile_sum[q] = __fadd_rn(tile_sum[q], partial[warp + w][q][sl][c][lane]);
        }
        float result = tile_sum[0];
        if constexpr (kGated) {
          const float gate = __bfloat162float(__float2bfloat16_rn(tile_sum[0]));
          const float up = __bfloat162float(__float2bfloat16_rn(tile_sum[kTiles - 1]));
          result = gate / (1.0f + expf(-gate)) * up;
        }
        if (row < rows_now) out[static_cast<int64_t>(first_row + row) * out_width + col] = __float2bfloat16_rn(result);
      }
  }
  __syncthreads();
}

// A stretch of one product that a block takes: `runs` consecutive runs from first_run of one
// expert's weights (or the shared expert's) against its group's rows.
struct Fp8Segment {
  const Bf16* rows;        // the group's first row [., k]
  const uint8_t* weights;  // the expert's [n, k] e4m3
  const float* scale;      // its [n / 128, k / 128]
  Bf16* out;               // the group's first output row
  int64_t k, n;
  int units_per_block, pass_rows, group_rows;
  int first_run, runs;
};

// A segment through the rings: each warp streams its tiles' K blocks through its own ring of
// `stages` slots at `rings` (cp.async; the next stages - 1 items in flight while it multiplies
// one). Whole block. Not inlined: inside the schedule's loop, at 128 registers a thread, the
// gated 8-row variant spilled 52 bytes; as a function of its own it spills none.
template <bool kGated, int kSlices>
__device__ __noinline__ void Fp8RingSegment(const Fp8Segment& s, uint8_t* staged, uint8_t* rings, int stages,
                                               Fp8Partial<kGated, kSlices>& partial) {
  constexpr int kTiles = kGated ? 2 : 1;  // weight tiles per unit: gate and up, or one
  constexpr int64_t kSlot = Fp8SlotBytes(kTiles);
  // 32-bit sizes and offsets within the expert (its [N, K] bytes are under 2^31): the fewer
  // registers, the fewer spilled at 128 a thread.
  const int k = static_cast<int>(s.k), n = static_cast<int>(s.n), blocks_k = k / kFp8Block;
  const int stride = k + kFp8RowPad;
  // Only pass_rows rows are staged (T = 1: one row of 7 KB rather than eight, for DeepSeek-V3's
  // gate/up: two blocks an SM); the products' columns past them read the last staged row again
  // and are never stored.
  const int pass_rows = s.pass_rows;
  float* row_scale = reinterpret_cast<float*>(staged + pass_rows * stride);
  uint8_t* ring = rings + (threadIdx.x >> 5) * stages * kSlot;
  const int out_width = kGated ? n / 2 : n;
  const int tiles = out_width / kFp8TileRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warps_per_unit = kWarps / s.units_per_block;
  const int unit = warp / warps_per_unit, part = warp % warps_per_unit;
  const int runs = s.runs;
  // Run j of the segment: tile (first_run + j) * units_per_block + unit, so a block streams a
  // contiguous stretch of the expert's weights. Every warp takes the same `runs` (the block
  // reduces once per run), idling on tiles past the last.
  const int first_tile = s.first_run * s.units_per_block + unit, tile_step = s.units_per_block;
  const int last_tile = min(tiles, first_tile + runs * tile_step);  // past the segment's runs, or the last tile
  const int block_begin = part * blocks_k / warps_per_unit, block_end = (part + 1) * blocks_k / warps_per_unit;

  // The lane's copies: 16-byte chunk (lane % 8) of tile rows lane / 8 + 4j, j < 4, of each tile; and
  // lane i < kTiles copies tile i's weight scale (the up tile's rows start F rows on).
  const int copy_row = lane >> 3, copy_chunk = lane & 7;
  const int count = block_end - block_begin;  // this warp's K blocks of each tile
  // Its ring's sequence: run-major, then K block. The next item to copy (tile issue_tile, K block
  // block_begin + issue_i) and its slot, kept as counters: a 64-bit division and two remainders
  // per item sat between a slot landing and the next copy going out, and the ring is only as deep
  // as that gap lets it be.
  int issue_tile = first_tile, issue_i = 0, issue_slot = 0;
  const uint64_t policy = EvictFirstPolicy();
  auto issue_next = [&]() {
    const int kb = block_begin + issue_i;
    if (issue_tile < last_tile) {
      const int row0 = issue_tile * kFp8TileRows;
      const uint8_t* src = s.weights + ((row0 + copy_row) * k + copy_chunk * 16 + kb * kFp8Block);
      uint8_t* dst = ring + issue_slot * kSlot;
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          CpAsync16(dst + i * kFp8TileBytes + SlotOffset(copy_row + 4 * j, copy_chunk), src + (i * out_width + 4 * j) * k,
                    policy);
      if (lane < kTiles)
        CpAsync4(dst + kTiles * kFp8TileBytes + lane * 4,
                 s.scale + (row0 + (lane == 1 ? out_width : 0)) / kFp8Block * blocks_k + kb);
    }
    if (++issue_i == count) issue_i = 0, issue_tile += tile_step;
    if (++issue_slot == stages) issue_slot = 0;
  };
  auto wait = [&]() { CpAsyncWait<kFp8RingStages - 1>(); };  // until the oldest group in flight has landed

  for (int first = 0; first < s.group_rows; first += pass_rows) {
    const int rows_now = min(pass_rows, s.group_rows - first);
    // The ring's first stages - 1 K blocks in flight while the rows are staged.
    issue_tile = first_tile, issue_i = issue_slot = 0;
    for (int ahead = 0; ahead < stages - 1; ++ahead) {
      issue_next();
      CpAsyncCommit();
    }
    StageFp8Rows(s.rows + first * k, rows_now, k, staged, row_scale);
    __syncthreads();

    int read_slot = 0;
    for (int j = 0; j < runs; ++j) {
      const int tile = first_tile + j * tile_step;
      const bool tile_ok = tile < tiles;  // warp-uniform
      float sum[kTiles][kSlices][4] = {};
      for (int i = 0; i < count; ++i) {
        // The ring runs on across runs: the next run's first blocks load during this one's last.
        issue_next();  // item j * count + i + stages - 1
        CpAsyncCommit();
        wait();
        __syncwarp();  // every lane's copies of item j * count + i are visible to the warp
        const uint8_t* slot = ring + read_slot * kSlot;
        if (++read_slot == stages) read_slot = 0;
        if (!tile_ok) continue;
        uint4 a[kTiles][4];
        float w_scale[kTiles];
#pragma unroll
        for (int q = 0; q < kTiles; ++q) {
          const uint8_t* tile_bytes = slot + q * kFp8TileBytes;
          const int row = Fp8TileRow(g);
          a[q][0] = *reinterpret_cast<const uint4*>(tile_bytes + SlotOffset(row, t));
          a[q][1] = *reinterpret_cast<const uint4*>(tile_bytes + SlotOffset(row, 4 + t));
          a[q][2] = *reinterpret_cast<const uint4*>(tile_bytes + SlotOffset(row + 8, t));
          a[q][3] = *reinterpret_cast<const uint4*>(tile_bytes + SlotOffset(row + 8, 4 + t));
          w_scale[q] = reinterpret_cast<const float*>(slot + kTiles * kFp8TileBytes)[q];
        }
        Fp8BlockProduct<kTiles, kSlices>(sum, a, w_scale, staged, row_scale, stride, blocks_k, block_begin + i, pass_rows);
        __syncwarp();  // the slot is read before a later iteration's copies overwrite it
      }
      Fp8RunEpilogue<kGated, kSlices>(s.out, partial, sum, tile, tile_ok, part == 0, warps_per_unit, first, rows_now,
                                      out_width);
    }
  }
}

// The same products with the weights loaded straight into registers, no ring: each warp keeps
// kDepth K blocks of its tiles in flight in registers (gated: 2 blocks of 8 16-byte loads a lane;
// down: 4 of 4), reloading a buffer as soon as its product is taken, across runs too, so its loads
// never drain between runs. The K blocks, their order and every sum are the ring kernel's: the same
// bits. Shared memory holds only the staged rows; registers hold the loads in flight (one block an
// SM of up to 255 a thread: at 128, two blocks an SM, the buffers spilled to local memory).

template <int kTiles>
struct Fp8Fragments {
  uint4 a[kTiles][4];
  float w_scale[kTiles];
};

// The stream kernel loads, lane (g, t), chunk 4 * (g & 1) + t of tile rows g / 2, 4 + g / 2,
// 8 + g / 2 and 12 + g / 2 into v[0..3]: each 8 lanes one row's whole line. Each pair of lanes
// g, g ^ 1 then swaps one of each two loads (16 bytes, four shuffles) to hold MmaBlock's fragments
// of tile rows Fp8TileRow(g) and that + 8: chunks t and 4 + t of each.
__device__ __forceinline__ void LinesToFragments(const uint4 (&v)[4], uint4 (&a)[4]) {
  const bool odd = (threadIdx.x >> 2) & 1;
#pragma unroll
  for (int h = 0; h < 4; h += 2) {
    // Even g keeps row g / 2's chunk t and gets its chunk 4 + t; odd g keeps row 4 + g / 2's
    // chunk 4 + t and gets its chunk t.
    const uint4 send = odd ? v[h] : v[h + 1];
    uint4 got;
    got.x = __shfl_xor_sync(0xffffffffu, send.x, 4);
    got.y = __shfl_xor_sync(0xffffffffu, send.y, 4);
    got.z = __shfl_xor_sync(0xffffffffu, send.z, 4);
    got.w = __shfl_xor_sync(0xffffffffu, send.w, 4);
    a[h] = odd ? got : v[h];
    a[h + 1] = odd ? v[h + 1] : got;
  }
}

template <bool kGated, int kSlices, int kDepth>
__device__ __forceinline__ void Fp8StreamSegment(const Fp8Segment& s, uint8_t* staged,
                                                 Fp8Partial<kGated, kSlices>& partial) {
  constexpr int kTiles = kGated ? 2 : 1;
  const int64_t k = s.k, n = s.n, blocks_k = k / kFp8Block;
  const int64_t stride = k + kFp8RowPad;
  const int pass_rows = s.pass_rows;
  float* row_scale = reinterpret_cast<float*>(staged + pass_rows * stride);
  const int64_t out_width = kGated ? n / 2 : n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warps_per_unit = kWarps / s.units_per_block;
  const int unit = warp / warps_per_unit, part = warp % warps_per_unit;
  const int runs = s.runs;
  const int begin = static_cast<int>(part * blocks_k / warps_per_unit);
  const int own32 = static_cast<int>((part + 1) * blocks_k / warps_per_unit) - begin;
  // Every warp steps through the same number of items a run, a multiple of kDepth (buffer d always
  // holds an item d mod kDepth of a run, and the block's barriers at each run's end line up); items
  // past a warp's own K blocks load and multiply nothing.
  const int count32 = static_cast<int>(((blocks_k + warps_per_unit - 1) / warps_per_unit + kDepth - 1) / kDepth * kDepth);
  const int tiles32 = static_cast<int>(out_width / kFp8TileRows);

  // Lane (g, t)'s weights: 16 bytes at (4 * (g & 1) + t) * 16 of tile rows g / 2 + 4i, i < 4
  // (LinesToFragments makes them MmaBlock's A operand). The items in order: run j (tile
  // first_tile + j * units_per_block), K block begin + i of the warp's range; a cursor walks them
  // by 32-bit offsets within the expert (its [N, K] bytes are under 2^31), the fewer registers the
  // more bytes in flight.
  const uint8_t* weights = s.weights + (g >> 1) * k + ((g & 1) * 4 + t) * 16;
  const int k32 = static_cast<int>(k), up_bytes = static_cast<int>(out_width * k);
  const int up_scales = static_cast<int>(out_width / kFp8Block * blocks_k);
  const int first_tile = s.first_run * s.units_per_block + unit;
  const int tile_step = s.units_per_block;
  struct Cursor {
    int i, tile, offset, scale_offset;  // offset: bytes of (tile's row 0, K block begin + i)
  };
  auto start = [&]() {
    const int row0 = first_tile * kFp8TileRows;
    return Cursor{0, first_tile, row0 * k32 + begin * kFp8Block, row0 / kFp8Block * static_cast<int>(blocks_k) + begin};
  };
  auto advance = [&](Cursor& c) {
    if (++c.i == count32) {
      c.i = 0;
      c.tile += tile_step;
      const int row0 = c.tile * kFp8TileRows;
      c.offset = row0 * k32 + begin * kFp8Block;
      c.scale_offset = row0 / kFp8Block * static_cast<int>(blocks_k) + begin;
    } else {
      c.offset += kFp8Block;
      c.scale_offset += 1;
    }
  };
  const int last_tile = min(tiles32, first_tile + runs * tile_step);  // past this block's runs
  const uint64_t policy = EvictFirstPolicy();
  auto load = [&](const Cursor& c, Fp8Fragments<kTiles>& f) {
    if (c.tile >= last_tile || c.i >= own32) return;
#pragma unroll
    for (int q = 0; q < kTiles; ++q) {
      const uint8_t* src = weights + c.offset + q * up_bytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) f.a[q][i] = LoadStreamingBytes(src + 4 * i * k32, policy);
      f.w_scale[q] = __ldg(s.scale + c.scale_offset + q * up_scales);
    }
  };

  for (int first = 0; first < s.group_rows; first += pass_rows) {
    const int rows_now = min(pass_rows, s.group_rows - first);
    Fp8Fragments<kTiles> buffer[kDepth];
    Cursor next = start();
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {  // in flight while the rows are staged
      load(next, buffer[d]);
      advance(next);
    }
    StageFp8Rows(s.rows + first * k, rows_now, k, staged, row_scale);
    __syncthreads();
    for (int j = 0; j < runs; ++j) {
      const int tile = first_tile + j * tile_step;
      float sum[kTiles][kSlices][4] = {};
      for (int i = 0; i < count32; i += kDepth) {
#pragma unroll
        for (int d = 0; d < kDepth; ++d) {
          if (tile < tiles32 && i + d < own32) {  // warp-uniform: LinesToFragments shuffles
            uint4 a[kTiles][4];
#pragma unroll
            for (int q = 0; q < kTiles; ++q) LinesToFragments(buffer[d].a[q], a[q]);
            Fp8BlockProduct<kTiles, kSlices>(sum, a, buffer[d].w_scale, staged, row_scale, stride, blocks_k,
                                             begin + i + d, pass_rows);
          }
          load(next, buffer[d]);  // the run's next K blocks, or the next run's first
          advance(next);
        }
      }
      Fp8RunEpilogue<kGated, kSlices>(s.out, partial, sum, tile, tile < tiles32, part == 0, warps_per_unit, first,
                                      rows_now, out_width);
    }
  }
}

// The FP8 decode kernel: kDepth 0 streams the weights through each warp's ring in shared memory
// (Fp8RingSegment, two blocks an SM), kDepth > 0 through registers (Fp8StreamSegment, one block).
// Block b takes a range of the schedule's runs (Fp8DecodeGemmArgs): with a shared product, runs
// [b, b + 1) * units_per_cta of the flat schedule, one segment per slot it meets, so every SM
// streams about the same bytes and the shared expert rides in the same launch; without, a chunk
// of one slot's runs.
template <bool kGated, int kSlices, int kDepth>
__global__ void __launch_bounds__(kThreads, kDepth == 0 ? 2 : 1) Fp8DecodeKernel(Fp8DecodeGemmArgs p) {
  extern __shared__ __align__(16) uint8_t staged[];  // the staged rows, then (ring) the warps' rings
  __shared__ Fp8Partial<kGated, kSlices> partial;
  const int64_t routed = p.num_slots * p.runs_per_slot;
  const int64_t total = routed + (p.shared_weights != nullptr ? p.shared_runs : 0);
  int64_t u, end;
  if (p.units_per_cta > 0) {
    u = static_cast<int64_t>(blockIdx.x) * p.units_per_cta;
    end = min(total, u + p.units_per_cta);
  } else {
    const int64_t slot = blockIdx.x / p.blocks_per_slot;
    u = slot * p.runs_per_slot + (blockIdx.x - slot * p.blocks_per_slot) * p.runs_per_block;
    end = min(u + p.runs_per_block, (slot + 1) * p.runs_per_slot);
  }
  const int out_rows = static_cast<int>(p.out_rows);
  while (u < end) {  // block-uniform
    Fp8Segment s;
    if (u < routed) {
      const int64_t slot = u / p.runs_per_slot;
      s.first_run = static_cast<int>(u - slot * p.runs_per_slot);
      s.runs = static_cast<int>(min(end, (slot + 1) * p.runs_per_slot) - u);
      u += s.runs;
      const int64_t n = p.n, span = p.units_per_block * kFp8TileRows;
      if (!kGated && slot == 0) {
        const int64_t col0 = s.first_run * span;
        ZeroFp8RowsPastLive(p, col0, min(n, (s.first_run + s.runs) * span) - col0);
      }
      const Group group =
          FindGroup<kWholeGroups>(p.expert_offsets, static_cast<int>(p.num_groups), out_rows, static_cast<int>(slot));
      if (group.index < 0) continue;
      s.rows = p.rows + static_cast<int64_t>(group.start) * p.k;
      s.weights = p.weights + group.index * n * p.k;
      s.scale = p.scale + group.index * (n / kFp8Block) * (p.k / kFp8Block);
      s.out = p.out + static_cast<int64_t>(group.start) * (kGated ? n / 2 : n);
      s.k = p.k, s.n = n;
      s.units_per_block = p.units_per_block, s.pass_rows = p.pass_rows, s.group_rows = group.end - group.start;
    } else {
      s.first_run = static_cast<int>(u - routed);
      s.runs = static_cast<int>(end - u);
      u = end;
      s.rows = p.shared_rows, s.weights = p.shared_weights, s.scale = p.shared_scale, s.out = p.shared_out;
      s.k = p.shared_k, s.n = p.shared_n;
      s.units_per_block = p.shared_units_per_block, s.pass_rows = p.shared_pass_rows;
      s.group_rows = static_cast<int>(p.shared_count);
    }
    if constexpr (kDepth == 0)
      Fp8RingSegment<kGated, kSlices>(s, staged, AlignSlots(staged + p.ring_offset), p.stages, partial);
    else
      Fp8StreamSegment<kGated, kSlices, kDepth>(s, staged, partial);
  }
}

// Warps per unit: as many as leave each at least 4 K blocks (DeepSeek-V3's gate/up, 56 blocks: 8
// warps on one tile pair; its down projection, 16 blocks: 4 warps per tile, 2 tiles a block).
int Fp8UnitsPerBlock(int64_t blocks_k) {
  int warps = kWarps;
  while (warps > 1 && blocks_k / warps < 4) warps /= 2;
  return kWarps / warps;
}

// Runs of tiles per block: enough that the grid fits in the blocks the SMs hold at once (a block
// stages its rows and finds its expert once, then streams run after run through one ring; blocks
// of one run each spent most of their life in that prologue: DeepSeek-V3's gate/up at T = 1 was
// 1,024 blocks of 229 KB at one block an SM, ncu: 39 % of DRAM bandwidth). The slots bound the
// experts owning rows from above. Rounded down to one wave: a second wave of a few long blocks
// doubled the time (DeepSeek-V3 at T = 2, 144 blocks of 15 runs for 132 SMs: 319 us a call). With
// more slots than the SMs hold, four blocks a slot: waves enough for a short tail. per_sm: the
// blocks an SM holds (the occupancy calculator's, from the launch's shared memory).
int Fp8RunsPerBlock(int64_t runs, int64_t slots, int per_sm) {
  const int sms = GemmSmCount();
  const int64_t capacity = (sms > 0 ? sms : kWaveBlocks) * std::max(per_sm, 1);
  const int64_t blocks_x = slots <= capacity ? capacity / slots : 4;
  return static_cast<int>(std::max<int64_t>(1, (runs + blocks_x - 1) / blocks_x));
}

// Dynamic shared memory of a launch: `staging` bytes of staged rows (the most of its products'),
// then, for the ring, `stages` slots a warp from the next 128-byte boundary.
template <bool kGated>
int64_t Fp8DecodeSmem(int64_t staging, int stages) {
  return staging + kFp8SlotAlign + kWarps * stages * Fp8SlotBytes(kGated ? 2 : 1);
}
// The ring's slots (kFp8RingStages) when they fit beside the staged rows, else 0.
template <bool kGated, int kSlices>
int Fp8Stages(int64_t staging) {
  if (Fp8DecodeSmem<kGated>(staging, kFp8RingStages) + sizeof(Fp8Partial<kGated, kSlices>) + 1024 <= kSmemBytes)
    return kFp8RingStages;
  return 0;
}

// Which way a launch's weights travel: routed experts alone through the rings (Fp8RingSegment,
// faster there); with a shared product riding through the registers (Fp8StreamSegment), whose one
// block an SM keeps the flat schedule's ranges long. Both give the same bits.
bool Fp8UsesRing(const Fp8DecodeGemmArgs& args) { return args.shared_weights == nullptr; }

// Bytes of staged rows of a launch: its products' most.
int64_t Fp8LaunchStaging(const Fp8DecodeGemmArgs& args, int pass_rows, int shared_pass_rows) {
  return std::max(Fp8StagingBytes(pass_rows, args.k),
                  args.shared_weights != nullptr ? Fp8StagingBytes(shared_pass_rows, args.shared_k) : 0);
}

// Whether a launch's staged rows (and the ring) fit an SM's shared memory.
template <bool kGated, int kSlices>
bool Fp8Fits(int64_t staging, bool ring) {
  if (ring) return Fp8Stages<kGated, kSlices>(staging) > 0;
  return staging + static_cast<int64_t>(sizeof(Fp8Partial<kGated, kSlices>)) + 1024 <= kSmemBytes;
}

// pass_rows: rows staged per pass, 1 to 8 * kSlices.
template <bool kGated, int kSlices>
cudaError_t LaunchFp8Decode(Fp8DecodeGemmArgs args, int pass_rows, cudaStream_t stream) {
  const bool ring = Fp8UsesRing(args);
  args.pass_rows = pass_rows;
  if (args.shared_weights != nullptr) {
    args.shared_units_per_block = Fp8UnitsPerBlock(args.shared_k / kFp8Block);
    const int64_t shared_tiles = (kGated ? args.shared_n / 2 : args.shared_n) / kFp8TileRows;
    args.shared_runs = (shared_tiles + args.shared_units_per_block - 1) / args.shared_units_per_block;
    args.shared_pass_rows = static_cast<int>(std::min<int64_t>(args.shared_count, 8 * kSlices));
  }
  const int64_t staging = Fp8LaunchStaging(args, pass_rows, args.shared_pass_rows);
  if (!Fp8Fits<kGated, kSlices>(staging, ring)) return cudaErrorInvalidValue;
  args.ring_offset = staging;
  args.stages = ring ? Fp8Stages<kGated, kSlices>(staging) : 0;
  const size_t smem = static_cast<size_t>(ring ? Fp8DecodeSmem<kGated>(staging, args.stages) : staging);
  // Registers hold the stream kernel's loads in flight: one block an SM of up to 255 a thread.
  auto kernel = ring ? Fp8DecodeKernel<kGated, kSlices, 0> : Fp8DecodeKernel<kGated, kSlices, kGated ? 2 : 4>;
  // Past 48 KB of shared memory, static `partial` included, the dynamic part needs the opt-in.
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  int per_sm = 1;
  status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (status != cudaSuccess) return status;
  const int64_t tiles = (kGated ? args.n / 2 : args.n) / kFp8TileRows;
  const int64_t slots = std::min(args.num_groups, args.out_rows);
  const int64_t runs = (tiles + args.units_per_block - 1) / args.units_per_block;
  // The schedule. Routed experts alone: each slot's runs in equal chunks of runs_per_block
  // (Fp8RunsPerBlock), no block meeting two experts. With a shared product: every run of every
  // slot, then the shared product's, in equal contiguous ranges over the blocks the SMs hold at
  // once (a block meeting two experts finds the second and stages its rows again, a few us, where
  // chunks whole a slot would leave the shared product's blocks a second wave).
  args.num_slots = slots, args.runs_per_slot = runs;
  unsigned grid;
  if (args.shared_weights == nullptr) {
    if (slots == 0) return cudaSuccess;
    args.runs_per_block = Fp8RunsPerBlock(runs, slots, per_sm);
    args.blocks_per_slot = (runs + args.runs_per_block - 1) / args.runs_per_block;
    args.units_per_cta = 0;
    grid = static_cast<unsigned>(slots * args.blocks_per_slot);
  } else {
    const int64_t total = slots * runs + args.shared_runs;
    const int sms = GemmSmCount();
    const int64_t capacity = static_cast<int64_t>(sms > 0 ? sms : kWaveBlocks) * std::max(per_sm, 1);
    args.units_per_cta = (total + capacity - 1) / capacity;
    grid = static_cast<unsigned>((total + args.units_per_cta - 1) / args.units_per_cta);
  }
  kernel<<<grid, kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// 16 rows a pass where asked, an expert can own more than 8, and their staging and a ring fit (at
// 2 slots: K up to 8,832 for gate/up, 11,264 for down), else 8; no more rows staged than an expert
// can own (group_rows, when known).
template <bool kGated>
cudaError_t LaunchFp8DecodeRows(const Fp8DecodeGemmArgs& args, int rows_per_pass, int64_t group_rows,
                                cudaStream_t stream) {
  const int64_t bound = group_rows > 0 ? group_rows : rows_per_pass;
  const int64_t staging16 = Fp8LaunchStaging(args, 16, static_cast<int>(std::min<int64_t>(args.shared_count, 16)));
  if (rows_per_pass == 16 && bound > 8 && Fp8Fits<kGated, 2>(staging16, Fp8UsesRing(args)))
    return LaunchFp8Decode<kGated, 2>(args, 16, stream);
  return LaunchFp8Decode<kGated, 1>(args, static_cast<int>(std::min<int64_t>(bound, 8)), stream);
}

}  // namespace

cudaError_t LaunchFp8DecodeSwiglu(const Fp8DecodeSwigluArgs& args, cudaStream_t stream) {
  const bool shared = args.shared_gate_up != nullptr;
  if (args.hidden % kFp8Block != 0 || args.ffn % kFp8Block != 0 || args.hidden > kFp8DecodeMaxK ||
      args.ffn > kFp8DecodeMaxK || args.num_groups < 1 || args.num_groups > 65535 || args.out_rows < 0 ||
      args.out_rows > (int64_t{1} << 30) || (args.rows_per_pass != 8 && args.rows_per_pass != 16) ||
      2 * args.ffn * args.hidden >= (int64_t{1} << 31))  // the stream kernel's 32-bit offsets in an expert
    return cudaErrorInvalidValue;
  if (shared && (args.shared_ffn % kFp8Block != 0 || args.shared_ffn < kFp8Block || args.shared_ffn > kFp8DecodeMaxK ||
                 args.shared_count < 1 || args.shared_count > kFp8DecodeMaxSharedRows ||
                 2 * args.shared_ffn * args.hidden >= (int64_t{1} << 31)))
    return cudaErrorInvalidValue;
  if (args.out_rows == 0 && !shared) return cudaSuccess;
  Fp8DecodeGemmArgs gemm{};
  gemm.rows = static_cast<const Bf16*>(args.rows);
  gemm.weights = static_cast<const uint8_t*>(args.gate_up);
  gemm.scale = args.gate_up_scale;
  gemm.expert_offsets = args.expert_offsets;
  gemm.out = static_cast<Bf16*>(args.activation);
  gemm.out_rows = args.out_rows, gemm.num_groups = args.num_groups, gemm.k = args.hidden, gemm.n = 2 * args.ffn;
  gemm.units_per_block = Fp8UnitsPerBlock(gemm.k / kFp8Block);
  if (shared) {
    gemm.shared_rows = static_cast<const Bf16*>(args.shared_x);
    gemm.shared_weights = static_cast<const uint8_t*>(args.shared_gate_up);
    gemm.shared_scale = args.shared_gate_up_scale;
    gemm.shared_out = static_cast<Bf16*>(args.shared_activation);
    gemm.shared_count = args.shared_count, gemm.shared_k = args.hidden, gemm.shared_n = 2 * args.shared_ffn;
  }
  // (The shared product stages up to a pass's rows of the routed launch at once: more take passes.)
  cudaError_t status = LaunchFp8DecodeRows<true>(gemm, args.rows_per_pass, args.group_rows, stream);
  if (status != cudaSuccess) return status;
  gemm.rows = static_cast<const Bf16*>(args.activation);
  gemm.weights = static_cast<const uint8_t*>(args.down);
  gemm.scale = args.down_scale;
  gemm.out = static_cast<Bf16*>(args.out);
  gemm.k = args.ffn, gemm.n = args.hidden;
  gemm.units_per_block = Fp8UnitsPerBlock(gemm.k / kFp8Block);
  if (shared) {
    gemm.shared_rows = static_cast<const Bf16*>(args.shared_activation);
    gemm.shared_weights = static_cast<const uint8_t*>(args.shared_down);
    gemm.shared_scale = args.shared_down_scale;
    gemm.shared_out = static_cast<Bf16*>(args.shared_out);
    gemm.shared_k = args.shared_ffn, gemm.shared_n = args.hidden;
  }
  return LaunchFp8DecodeRows<false>(gemm, args.rows_per_pass, args.group_rows, stream);
}

}  // namespace jax_moe
