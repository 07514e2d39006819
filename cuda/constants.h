// The constants and enums that the kernels, their handlers and Python share, defined once here.
// Both native modules export them by their Python names (ForEachConstant below), read in Python as
// jax_moe._native.constants; Python never copies a value. Plain C++: the CPU module includes it.
#ifndef JAX_MOE_CONSTANTS_H_
#define JAX_MOE_CONSTANTS_H_

#include <cstdint>

#include "workspace_layout.h"

namespace jax_moe {

// The expert GEMM's kernel and tile, chosen at trace time from the rows each expert expects.
enum class GemmTile : int64_t {
  kSmallM = 0,   // 64 x 128 tiles, ping-pong warp groups: decode, few rows per expert
  kLargeM = 1,   // 128 x 256 tiles, cooperative, 1x2 cluster: many rows per expert
  kDecode = 2,   // the decode kernel (decode_gemm_kernels.h), not a CUTLASS tile: never a grouped GEMM's
  kMediumM = 3,  // 64 x 256 tiles, ping-pong warp groups: tens to hundreds of rows per expert
};

// Which product of the expert layer a grouped GEMM computes (grouped_gemm_kernels.h).
enum class GemmOp : int64_t {
  kForward = 0,
  kInputGrad = 1,
  kWeightGrad = 2,  // always the 128 x 256 tile: its M is K, never small
};

// Operands are 16-byte aligned rows for TMA: K and N must be multiples of this (bf16 elements).
constexpr int64_t kGemmAlignElements = 8;
// The bf16 decode GEMM's most rows of one expert per pass over its weights (1, 2, 4 or 8).
constexpr int64_t kDecodeGemmMaxRowsPerPass = 8;

// FP8 experts: weights scaled per 128 x 128 block, rows quantised per 1 x 128 group.
constexpr int64_t kFp8ScaleBlock = 128;
// The FP8 decode kernel stages a pass's rows whole in shared memory: H and F up to this.
constexpr int64_t kFp8DecodeMaxK = 16384;
// Tokens a shared expert may bring into the FP8 decode kernel's launches.
constexpr int64_t kFp8DecodeMaxSharedRows = 16;

// The decode router's limits (DecodeRouteFits): tokens, experts, T * E held in shared memory,
// top k, expert groups.
constexpr int64_t kDecodeRouteMaxTokens = 16;
constexpr int64_t kDecodeRouteMaxExperts = 512;
constexpr int64_t kDecodeRouteMaxPairs = 4096;
constexpr int64_t kDecodeRouteMaxTopK = 32;
constexpr int64_t kDecodeRouteMaxGroups = 32;

// The experts' choice kernel's limits (ChooseExpertsFits): one warp per token, choices in registers.
constexpr int64_t kChooseExpertsMaxExperts = 1024;
constexpr int64_t kChooseExpertsMaxTopK = 32;
constexpr int64_t kChooseExpertsMaxGroups = 32;

// gather_rows takes up to this many arrays in one launch.
constexpr int64_t kMaxGatherArrays = 4;
// What one prefetch of permute_prefetch asks L2 for: a line.
constexpr int64_t kPrefetchLineBytes = 128;

// Calls visit(python_name, value) for each constant Python reads.
template <typename Visit>
void ForEachConstant(Visit&& visit) {
  visit("GEMM_TILE_SMALL_M", static_cast<int64_t>(GemmTile::kSmallM));
  visit("GEMM_TILE_LARGE_M", static_cast<int64_t>(GemmTile::kLargeM));
  visit("GEMM_TILE_DECODE", static_cast<int64_t>(GemmTile::kDecode));
  visit("GEMM_TILE_MEDIUM_M", static_cast<int64_t>(GemmTile::kMediumM));
  visit("GEMM_OP_FORWARD", static_cast<int64_t>(GemmOp::kForward));
  visit("GEMM_OP_INPUT_GRAD", static_cast<int64_t>(GemmOp::kInputGrad));
  visit("GEMM_OP_WEIGHT_GRAD", static_cast<int64_t>(GemmOp::kWeightGrad));
  visit("GEMM_ALIGN_ELEMENTS", kGemmAlignElements);
  visit("DECODE_GEMM_MAX_ROWS_PER_PASS", kDecodeGemmMaxRowsPerPass);
  visit("FP8_BLOCK", kFp8ScaleBlock);
  visit("FP8_DECODE_MAX_K", kFp8DecodeMaxK);
  visit("FP8_DECODE_MAX_SHARED_ROWS", kFp8DecodeMaxSharedRows);
  visit("DECODE_ROUTE_MAX_TOKENS", kDecodeRouteMaxTokens);
  visit("DECODE_ROUTE_MAX_EXPERTS", kDecodeRouteMaxExperts);
  visit("DECODE_ROUTE_MAX_PAIRS", kDecodeRouteMaxPairs);
  visit("DECODE_ROUTE_MAX_TOP_K", kDecodeRouteMaxTopK);
  visit("DECODE_ROUTE_MAX_GROUPS", kDecodeRouteMaxGroups);
  visit("CHOOSE_EXPERTS_MAX_EXPERTS", kChooseExpertsMaxExperts);
  visit("CHOOSE_EXPERTS_MAX_TOP_K", kChooseExpertsMaxTopK);
  visit("CHOOSE_EXPERTS_MAX_GROUPS", kChooseExpertsMaxGroups);
  visit("GATHER_ROWS_MAX_ARRAYS", kMaxGatherArrays);
  visit("PREFETCH_LINE_BYTES", kPrefetchLineBytes);
  visit("ROUTING_TILE_ROUTES", kTileRoutes);
  visit("WORKSPACE_RESERVED_WORDS", kWorkspaceReservedWords);
}

}  // namespace jax_moe

#endif  // JAX_MOE_CONSTANTS_H_
