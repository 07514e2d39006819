// The scratch's int32 workspace (jax_moe.scratch.MoEScratch.workspace), defined here once. It lets
// no handler allocate: calls that are never live at once share it, each leaving nothing in it for
// the next. In int32 words, for a scratch of R = T_max * k routes over El local experts:
//
//   [0, RoutingWorkspaceWords(R, El))   permute's multi-launch path: the route count of each
//                                       (local expert, tile of kTileRoutes routes), expert-major,
//                                       then one total per expert (permute_kernels.cu)
//   [0, ceil(gemm_bytes / 4))           or a grouped GEMM's per-expert arguments and CUTLASS's own
//                                       workspace, from the first 128-byte boundary: gemm_bytes is
//                                       GroupedGemmWorkspaceBytes / Fp8GroupedGemmWorkspaceBytes,
//                                       the larger (0 without the CUDA module)
//   [words - kWorkspaceReservedWords, words)   written by neither; its last word is the decode
//                                       router's arrival counter (route_kernels.h), zero between
//                                       calls: zeroed at allocation, reset by the router itself
//
// ScratchWorkspaceWords gives `words`; both modules export it to Python (workspace_words).
#ifndef JAX_MOE_WORKSPACE_LAYOUT_H_
#define JAX_MOE_WORKSPACE_LAYOUT_H_

#include <algorithm>
#include <cstdint>

namespace jax_moe {

// Routes per tile of permute's multi-launch path; up to one tile, one launch does it all.
constexpr int64_t kTileRoutes = 1024;
// Words at the workspace's end that permute and the GEMMs never touch: room enough to keep the
// router's counter clear of the GEMM's arguments whatever their 128-byte alignment shift.
constexpr int64_t kWorkspaceReservedWords = 32;

// Words of permute's route counts for `routes` routes over num_local experts.
inline int64_t RoutingWorkspaceWords(int64_t routes, int64_t num_local) {
  const int64_t tiles = (routes + kTileRoutes - 1) / kTileRoutes;
  return num_local * (tiles + 1);
}

// Words of the whole workspace: the larger of permute's counts and the GEMMs' bytes, then the
// reserved words.
inline int64_t ScratchWorkspaceWords(int64_t routes, int64_t num_local, int64_t gemm_bytes) {
  return std::max(RoutingWorkspaceWords(routes, num_local), (gemm_bytes + 3) / 4) + kWorkspaceReservedWords;
}

// The decode router's arrival counter: the workspace's last word.
inline int64_t DecodeRouteCounterWord(int64_t workspace_words) { return workspace_words - 1; }

}  // namespace jax_moe

#endif  // JAX_MOE_WORKSPACE_LAYOUT_H_
