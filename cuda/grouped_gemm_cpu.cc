// The expert GEMMs' CPU handlers, bf16 and FP8 alike (jax_moe.gemm.grouped_dot): jax.lax.ragged_dot's
// products, each row multiplied by its own group's weights only. XLA:CPU (jax 0.10) runs ragged_dot
// as the product of every row with every group's weights, masked: G times the arithmetic. The FP8
// product shares this file's engine, its weights dequantised as they are packed.
//   GroupedDot:           out[i] = rows[i] @ w[g(i)]  (w [G, K, N], or [G, N, K] read transposed);
//                         rows past the last group come out zero.
//   GroupedDotWeightGrad: dw[g] = rows_g^T @ d_out_g  ([G, K, N]); zero for an empty group.
//   Fp8GroupedDot:        GroupedDot with float8_e4m3fn weights scaled per 128 x 128 block (DeepSeek-V3's
//                         `weight` and `weight_scale_inv`), each weight dequantised as it is packed: the
//                         float32 product q * scale, XLA's rounding of jax_moe.fp8.dequantize.
// Every output element is one float32 sum over the reduction index in ascending order, each product
// and each sum rounded to float32 (built with -ffp-contract=off), subnormals kept: the same bits
// whatever the blocking, thread count or vector width. The work is split over XLA's intra-op
// thread pool in blocks of output rows, each block computed whole by one thread.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "constants.h"
#include "ffi_common.h"
#include "float_bits.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

constexpr int64_t kTileRows = 4;      // output rows of the register tile
constexpr int64_t kTileCols = 16;     // output columns of the register tile
constexpr int64_t kBlockRows = 64;    // output rows one task computes
constexpr int64_t kPanelCols = 256;   // output columns of a packed panel of B ...
constexpr int64_t kPanelDepth = 128;  // ... and its rows (of the reduction): 128 KB of float32

// A strided matrix view: element (i, j) at data[i * stride_i + j * stride_j], of type `type`.
// F8E4M3FN views carry block scales: element (i, j) is multiplied by
// scale[(i / 128) * scale_i + (j / 128) * scale_j].
struct View {
  const void* data;
  ffi::DataType type;
  int64_t stride_i, stride_j;
  const float* scale = nullptr;
  int64_t scale_i = 0, scale_j = 0;
};

constexpr int64_t kScaleBlock = kFp8ScaleBlock;  // the FP8 weights' block edge

// float8_e4m3fn's 256 values as float32 (all exact): no infinities, S.1111.111 is NaN.
const float* E4m3Values() {
  static const std::vector<float> values = [] {
    std::vector<float> v(256);
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 15 && mantissa == 7) magnitude = std::numeric_limits<float>::quiet_NaN();
      v[b] = b & 128 ? -magnitude : magnitude;
    }
    return v;
  }();
  return values.data();
}

// convert(value, i, j): element (i0 + i, j0 + j)'s float32 value.
template <typename T, typename Convert>
void PackWith(const View& v, const T* p, int64_t i0, int64_t rows, int64_t j0, int64_t cols, int64_t width,
              float* dst, Convert convert) {
  const T* src = p + j0 * v.stride_j + i0 * v.stride_i;
  if (v.stride_i != 1 && v.stride_j == 1) {
    // A transposition: 16 x 16 blocks, so the lines read and written stay in L1 within a block.
    constexpr int64_t kBlock = 16;
    for (int64_t ib = 0; ib < rows; ib += kBlock)
      for (int64_t jb = 0; jb < cols; jb += kBlock)
        for (int64_t i = ib; i < std::min(rows, ib + kBlock); ++i)
          for (int64_t j = jb; j < std::min(cols, jb + kBlock); ++j)
            dst[j * width + i] = convert(src[i * v.stride_i + j], i, j);
  } else {
    for (int64_t j = 0; j < cols; ++j) {
      float* out = dst + j * width;
      const T* column = src + j * v.stride_j;
      if (v.stride_i == 1) {  // contiguous: a loop the compiler vectorises
        for (int64_t i = 0; i < rows; ++i) out[i] = convert(column[i], i, j);
      } else {
        for (int64_t i = 0; i < rows; ++i) out[i] = convert(column[i * v.stride_i], i, j);
      }
    }
  }
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = rows; i < width; ++i) dst[j * width + i] = 0.0f;
}

// v's rows [i0, i0 + rows) and columns [j0, j0 + cols) as float32, transposed into dst [cols][width]:
// dst[j * width + i] = v(i0 + i, j0 + j), each column padded with zeros from rows to width.
void Pack(const View& v, int64_t i0, int64_t rows, int64_t j0, int64_t cols, int64_t width, float* dst) {
  switch (v.type) {
    case ffi::F32:
      PackWith(v, static_cast<const float*>(v.data), i0, rows, j0, cols, width, dst,
               [](float x, int64_t, int64_t) { return x; });
      return;
    case ffi::BF16:
      PackWith(v, static_cast<const uint16_t*>(v.data), i0, rows, j0, cols, width, dst,
               [](uint16_t x, int64_t, int64_t) { return Bf16ToFloat(x); });
      return;
    case ffi::F8E4M3FN: {
      const float* values = E4m3Values();
      PackWith(v, static_cast<const uint8_t*>(v.data), i0, rows, j0, cols, width, dst,
               [&](uint8_t x, int64_t i, int64_t j) {
                 return values[x] * v.scale[(i0 + i) / kScaleBlock * v.scale_i + (j0 + j) / kScaleBlock * v.scale_j];
               });
      return;
    }
    default:  // F16 (the handlers admit no other type)
      PackWith(v, static_cast<const uint16_t*>(v.data), i0, rows, j0, cols, width, dst,
               [](uint16_t x, int64_t, int64_t) { return F16ToFloat(x); });
      return;
  }
}

// acc[i][j] += sum over r < depth of a[r][i] * b[r][j], r ascending, each product and sum rounded;
// a packed [depth][kTileRows], b's row r the kTileCols floats at b + r * b_stride. Eight-float
// vectors (GCC/Clang vector extensions) keep the tile in registers. Cloned for AVX2 where the
// compiler can: the same arithmetic on wider registers, the same bits.
typedef float Vec8 __attribute__((vector_size(32)));
static_assert(kTileCols == 16, "a tile row is two Vec8");
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void TileProduct(const float* a, const float* b, int64_t b_stride, int64_t depth, float* acc) {
  Vec8 sum[kTileRows][2];
  std::memcpy(sum, acc, sizeof(sum));
  for (int64_t r = 0; r < depth; ++r) {
    Vec8 lo, hi;
    std::memcpy(&lo, b + r * b_stride, sizeof(lo));
    std::memcpy(&hi, b + r * b_stride + 8, sizeof(hi));
    for (int64_t i = 0; i < kTileRows; ++i) {
      const float x = a[r * kTileRows + i];
      sum[i][0] = sum[i][0] + x * lo;
      sum[i][1] = sum[i][1] + x * hi;
    }
  }
  std::memcpy(acc, sum, sizeof(sum));
}

// Rows [0, rows) and columns [0, cols) of a tile acc [kTileRows][kTileCols] into out (row-major,
// leading dimension ld) at (row0, col0), rounded to out's type.
void StoreTile(const float* acc, int64_t rows, int64_t cols, void* out, ffi::DataType type, int64_t ld,
               int64_t row0, int64_t col0) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* values = acc + i * kTileCols;
    const int64_t at = (row0 + i) * ld + col0;
    switch (type) {
      case ffi::F32:
        std::memcpy(static_cast<float*>(out) + at, values, cols * sizeof(float));
        break;
      case ffi::BF16:
        for (int64_t j = 0; j < cols; ++j) static_cast<uint16_t*>(out)[at + j] = FloatToBf16(values[j]);
        break;
      default:
        for (int64_t j = 0; j < cols; ++j) static_cast<uint16_t*>(out)[at + j] = FloatToF16(values[j]);
        break;
    }
  }
}

// A thread's buffers, reused from block to block: A's packed rows, a panel of B, the sums.
struct Packs {
  std::vector<float> a, b, sums;
};

// Output rows [i0, i0 + rows) of out = A @ B (A [*, depth] and B [depth, cols] as views; out
// row-major with leading dimension ld, of out_type). The block's A rows are packed once; B is
// packed a panel (kPanelDepth x kPanelCols) at a time, its rows read whole (a group of a few rows
// would otherwise stream B at the pace of strided loads); each panel's products continue the
// float32 sums kept in `sums`, so every element is still one sum in ascending order of depth.
void ProductBlock(const View& a, const View& b, int64_t i0, int64_t rows, int64_t cols, int64_t depth,
                  void* out, ffi::DataType out_type, int64_t ld, Packs& packs) {
  constexpr int64_t kTileSize = kTileRows * kTileCols;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  packs.a.resize(row_tiles * depth * kTileRows);
  packs.b.resize(kPanelDepth * kPanelCols);
  packs.sums.resize(row_tiles * (kPanelCols / kTileCols) * kTileSize);
  for (int64_t t = 0; t < row_tiles; ++t) {  // tile t's A values as [depth][kTileRows]
    const int64_t first = t * kTileRows;
    Pack(a, i0 + first, std::min(kTileRows, rows - first), 0, depth, kTileRows, packs.a.data() + t * depth * kTileRows);
  }
  // B^T: Pack(bt, ...) lays B's rows out whole.
  const View bt{b.data, b.type, b.stride_j, b.stride_i, b.scale, b.scale_j, b.scale_i};
  for (int64_t n0 = 0; n0 < cols; n0 += kPanelCols) {
    const int64_t panel_cols = std::min(kPanelCols, cols - n0);
    const int64_t col_tiles = (panel_cols + kTileCols - 1) / kTileCols, width = col_tiles * kTileCols;
    std::fill(packs.sums.begin(), packs.sums.end(), 0.0f);
    for (int64_t k0 = 0; k0 < depth; k0 += kPanelDepth) {
      const int64_t panel_depth = std::min(kPanelDepth, depth - k0);
      Pack(bt, n0, panel_cols, k0, panel_depth, width, packs.b.data());  // [panel_depth][width]
      for (int64_t c = 0; c < col_tiles; ++c)
        for (int64_t t = 0; t < row_tiles; ++t)
          TileProduct(packs.a.data() + (t * depth + k0) * kTileRows, packs.b.data() + c * kTileCols, width,
                      panel_depth, packs.sums.data() + (t * col_tiles + c) * kTileSize);
    }
    for (int64_t t = 0; t < row_tiles; ++t)
      for (int64_t c = 0; c < col_tiles; ++c)
        StoreTile(packs.sums.data() + (t * col_tiles + c) * kTileSize, std::min(kTileRows, rows - t * kTileRows),
                  std::min(kTileCols, panel_cols - c * kTileCols), out, out_type, ld, i0 + t * kTileRows,
                  n0 + c * kTileCols);
  }
}

// Runs tasks 0..count-1 on the caller and the pool's threads; returns when all have run. Tasks
// are taken from a shared counter, so the call finishes even if no pool thread ever starts one.
template <typename Task>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, const Task& task) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  // Each runner owns its pack buffers; `task` lives on the caller's stack, which outlives every
  // task run (the caller waits for `done`), and a runner started after that finds no task left.
  auto run = [state, count, &task] {
    const IeeeSubnormals ieee;  // whichever thread runs a task: the same arithmetic
    Packs packs;
    for (int64_t i; (i = state->next.fetch_add(1)) < count;) {
      task(i, packs);
      if (state->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->all_done.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([run] { run(); });
  run();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done.load() == count; });
}

bool IsFloat(ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16 || t == ffi::F16; }

int64_t Bytes(ffi::DataType t) { return static_cast<int64_t>(ffi::ByteWidth(t)); }

// A task: output rows [first, first + rows) of one group's product.
struct Block {
  int64_t group, first, rows;
};
void AddBlocks(std::vector<Block>& blocks, int64_t group, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kBlockRows) blocks.push_back({group, i, std::min(kBlockRows, end - i)});
}

// Group g's rows [start[g], start[g + 1]): consecutive from row 0, sizes clamped to [0, rows left].
std::vector<int64_t> GroupStarts(const int32_t* sizes, int64_t groups, int64_t rows) {
  std::vector<int64_t> start(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) start[g + 1] = std::min<int64_t>(rows, start[g] + std::max(0, sizes[g]));
  return start;
}

// out = each group's rows @ B_g, B_g = b_of(g) ([K, N] as a view); rows past the last group zero.
template <typename GroupView>
void GroupedProduct(ffi::ThreadPool& pool, ffi::AnyBuffer rows, const int32_t* sizes, int64_t groups, int64_t n,
                    ffi::Result<ffi::AnyBuffer>& out, const GroupView& b_of) {
  const int64_t m = rows.dimensions()[0], k = rows.dimensions()[1];
  const std::vector<int64_t> start = GroupStarts(sizes, groups, m);
  std::vector<Block> blocks;  // rows of one group
  for (int64_t g = 0; g < groups; ++g) AddBlocks(blocks, g, start[g], start[g + 1]);
  const View a{rows.untyped_data(), rows.element_type(), k, 1};
  char* result = static_cast<char*>(out->untyped_data());
  const ffi::DataType out_type = out->element_type();
  ParallelFor(pool, static_cast<int64_t>(blocks.size()), [&](int64_t t, Packs& packs) {
    const Block& block = blocks[t];
    ProductBlock(a, b_of(block.group), block.first, block.rows, n, k, result, out_type, n, packs);
  });
  // Rows in no group: zero (ragged_dot's rule).
  std::fill(result + start[groups] * n * Bytes(out_type), result + m * n * Bytes(out_type), 0);
}

// The shapes GroupedDot and Fp8GroupedDot share: rows [M, K], weights [G, K, N] ([G, N, K] transposed),
// group_sizes [G], out [M, N]; *n is N. `op` names the handler in the message.
ffi::Error CheckProductShapes(const std::string& op, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer out, bool transpose_weights,
                              int64_t* n) {
  const auto r = rows.dimensions(), w = weights.dimensions(), o = out.dimensions();
  if (r.size() != 2 || w.size() != 3 || o.size() != 2 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] != w[0] || o[0] != r[0])
    return InvalidArgument(op + ": expected rows [M, K], weights [G, K, N] ([G, N, K] transposed), "
                                "group_sizes [G] and out [M, N]");
  *n = transpose_weights ? w[1] : w[2];
  if ((transpose_weights ? w[2] : w[1]) != r[1] || o[1] != *n)
    return InvalidArgument(op + ": K or N of rows, weights and out disagree");
  return ffi::Error::Success();
}

ffi::Error GroupedDotImpl(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, bool transpose_weights) {
  int64_t n;
  if (ffi::Error error = CheckProductShapes("grouped_dot", rows, weights, group_sizes, *out, transpose_weights, &n);
      error.failure())
    return error;
  if (!IsFloat(rows.element_type()) || !IsFloat(weights.element_type()) || !IsFloat(out->element_type()))
    return InvalidArgument("grouped_dot: rows, weights and out must be float32, bfloat16 or float16");
  const int64_t k = rows.dimensions()[1];
  const ffi::DataType w_type = weights.element_type();
  GroupedProduct(pool, rows, group_sizes.typed_data(), weights.dimensions()[0], n, out, [&](int64_t g) {
    const char* data = static_cast<const char*>(weights.untyped_data()) + g * k * n * Bytes(w_type);
    // B(r, j): w[g][r][j] ([K, N]) or w[g][j][r] ([N, K]).
    return transpose_weights ? View{data, w_type, 1, k} : View{data, w_type, n, 1};
  });
  return ffi::Error::Success();
}

int64_t ScaleBlocks(int64_t size) { return (size + kScaleBlock - 1) / kScaleBlock; }

ffi::Error Fp8GroupedDotImpl(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                             ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::AnyBuffer> out, bool transpose_weights) {
  int64_t n;
  if (ffi::Error error = CheckProductShapes("fp8_grouped_dot", rows, weights, group_sizes, *out, transpose_weights, &n);
      error.failure())
    return error;
  const auto w = weights.dimensions(), s = scale.dimensions();
  if (s.size() != 3 || s[0] != w[0] || s[1] != ScaleBlocks(w[1]) || s[2] != ScaleBlocks(w[2]))
    return InvalidArgument("fp8_grouped_dot: expected scale [G, ceil(dim 1 / 128), ceil(dim 2 / 128)] of the weights");
  if (!IsFloat(rows.element_type()) || weights.element_type() != ffi::F8E4M3FN || !IsFloat(out->element_type()))
    return InvalidArgument("fp8_grouped_dot: rows and out must be float32, bfloat16 or float16, weights "
                           "float8_e4m3fn");
  const int64_t k = rows.dimensions()[1];
  GroupedProduct(pool, rows, group_sizes.typed_data(), w[0], n, out, [&](int64_t g) {
    const uint8_t* data = static_cast<const uint8_t*>(weights.untyped_data()) + g * k * n;
    const float* block_scale = scale.typed_data() + g * s[1] * s[2];
    // B(r, j): w[g][r][j] with scale[g][r / 128][j / 128], or w[g][j][r] with scale[g][j / 128][r / 128].
    return transpose_weights ? View{data, ffi::F8E4M3FN, 1, k, block_scale, 1, s[2]}
                             : View{data, ffi::F8E4M3FN, n, 1, block_scale, s[2], 1};
  });
  return ffi::Error::Success();
}

ffi::Error GroupedDotWeightGradImpl(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::AnyBuffer d_out,
                                    ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d_weights) {
  const auto r = rows.dimensions(), d = d_out.dimensions(), o = d_weights->dimensions();
  if (r.size() != 2 || d.size() != 2 || o.size() != 3 || group_sizes.dimensions().size() != 1 || d[0] != r[0] ||
      group_sizes.dimensions()[0] != o[0] || o[1] != r[1] || o[2] != d[1])
    return InvalidArgument("grouped_dot_weight_grad: expected rows [M, K], d_out [M, N], group_sizes [G] and "
                           "d_weights [G, K, N]");
  if (!IsFloat(rows.element_type()) || !IsFloat(d_out.element_type()) || !IsFloat(d_weights->element_type()))
    return InvalidArgument("grouped_dot_weight_grad: rows, d_out and d_weights must be float32, bfloat16 or float16");
  const int64_t m = r[0], k = r[1], n = d[1], groups = o[0];
  const std::vector<int64_t> start = GroupStarts(group_sizes.typed_data(), groups, m);
  const ffi::DataType row_type = rows.element_type(), d_type = d_out.element_type();
  const ffi::DataType out_type = d_weights->element_type();
  char* result = static_cast<char*>(d_weights->untyped_data());
  const int64_t group_bytes = k * n * Bytes(out_type);
  std::vector<Block> blocks;  // rows of dw[g] (of K) of one group
  for (int64_t g = 0; g < groups; ++g) {
    if (start[g + 1] == start[g]) std::fill(result + g * group_bytes, result + (g + 1) * group_bytes, 0);
    else AddBlocks(blocks, g, 0, k);
  }
  ParallelFor(pool, static_cast<int64_t>(blocks.size()), [&](int64_t t, Packs& packs) {
    const Block& block = blocks[t];
    const int64_t first_row = start[block.group], depth = start[block.group + 1] - first_row;
    // A(i, r) = rows[first_row + r][i] (rows_g^T); B(r, j) = d_out[first_row + r][j].
    const View a{static_cast<const char*>(rows.untyped_data()) + first_row * k * Bytes(row_type), row_type, 1, k};
    const View b{static_cast<const char*>(d_out.untyped_data()) + first_row * n * Bytes(d_type), d_type, n, 1};
    ProductBlock(a, b, block.first, block.rows, n, depth, result + block.group * group_bytes, out_type, n, packs);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeGroupedDotCpu, jax_moe::GroupedDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // rows [M, K]
                                  .Arg<ffi::AnyBuffer>()           // weights [G, K, N] ([G, N, K] transposed)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()           // out [M, N]
                                  .Attr<bool>("transpose_weights"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8GroupedDotCpu, jax_moe::Fp8GroupedDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // rows [M, K]
                                  .Arg<ffi::AnyBuffer>()           // weights [G, K, N] ([G, N, K] transposed) e4m3
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scale: the weights' 128 x 128 blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>()           // out [M, N]
                                  .Attr<bool>("transpose_weights"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeGroupedDotWeightGradCpu, jax_moe::GroupedDotWeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // rows [M, K]
                                  .Arg<ffi::AnyBuffer>()           // d_out [M, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes [G]
                                  .Ret<ffi::AnyBuffer>());         // d_weights [G, K, N]

namespace jax_moe {

FfiTargets GroupedGemmCpuTargets() {
  return {
      {"jax_moe_grouped_dot", JaxMoeGroupedDotCpu},
      {"jax_moe_grouped_dot_weight_grad", JaxMoeGroupedDotWeightGradCpu},
      {"jax_moe_fp8_grouped_dot", JaxMoeFp8GroupedDotCpu},
  };
}

}  // namespace jax_moe
