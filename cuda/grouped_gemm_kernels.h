// Grouped GEMMs of the expert layers on Hopper (CUTLASS sm90 ptr-array kernels), forward and
// backward, with the groups read on the device from permute's expert_offsets. For each local
// expert g owning rows [offsets[g], offsets[g + 1]):
//   forward      out[rows of g]    = rows[rows of g] @ w[g]          (rows [R, K], w [El, K, N])
//   input grad   d_rows[rows of g] = d_out[rows of g] @ w[g]^T       (d_out [R, N])
//   weight grad  d_w[g]            = rows[rows of g]^T @ d_out[rows of g]
// No host sync, no allocation: the per-group argument arrays and CUTLASS's workspace live in the
// caller's workspace buffer (the scratch's `workspace`: workspace_layout.h; or one the backward pass
// threads through).
#ifndef JAX_MOE_GROUPED_GEMM_KERNELS_H_
#define JAX_MOE_GROUPED_GEMM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "constants.h"

namespace jax_moe {

// The workspace is sized for this many SMs (Hopper has at most 132); a device with more runs
// the persistent kernels on this many.
constexpr int kGemmMaxSms = 144;
// GemmTile, GemmOp and kGemmAlignElements are in constants.h (Python reads them too).

// Whether `tile` names one of GemmTile's configurations (the FFI handler and the launcher check it).
inline bool IsGemmTile(int64_t tile) {
  return tile == static_cast<int64_t>(GemmTile::kSmallM) || tile == static_cast<int64_t>(GemmTile::kMediumM) ||
         tile == static_cast<int64_t>(GemmTile::kLargeM);
}

struct GroupedGemmArgs {
  // forward: a = rows [>= out_rows, K], b = w [El, K, N], out [out_rows, N]
  // input grad: a = d_out [>= out_rows, N], b = w [El, K, N], out [out_rows, K]
  // weight grad: a = rows [>= R, K], b = d_out [>= R, N], out [El, K, N]; R = out_rows
  const void* a;
  const void* b;
  const int32_t* expert_offsets;  // [El + 1]: group g is rows [offsets[g], offsets[g + 1])
  void* out;                      // bf16; rows (forward, input grad) or experts (weight grad)
                                  // that no group covers are zero
  void* workspace;                // workspace_bytes, 128-byte aligned (the handler aligns it up)
  size_t workspace_bytes;
  // Null, or out is a stack [out_layers, out_layer_elements] and the result (flattened) goes to
  // element out_offset of its slice *out_layer (read on the device, clamped to the stack): a
  // training loop writes each layer's weight gradient straight into the stacked gradient, and the
  // forward's gate/up product into the buffer that keeps it for the backward. The caller checks
  // that the result fits in a slice and that out_offset is a multiple of 8 (16-byte TMA stores).
  const int32_t* out_layer = nullptr;
  int64_t out_layers = 1;
  int64_t out_layer_elements = 0;
  int64_t out_offset = 0;
  int64_t out_rows;               // row bound of the groups (offsets are clamped to it)
  int64_t num_groups, k, n;       // El and the forward product's K and N
  GemmOp op;
  GemmTile tile;
};

// Whether a result written into a stack (out_layer set) fits in one slice at out_offset, 16-byte
// aligned (the FFI handler and the launcher check it).
inline bool OutSliceFits(const GroupedGemmArgs& a) {
  const int64_t result = a.op == GemmOp::kWeightGrad ? a.num_groups * a.k * a.n
                                                     : a.out_rows * (a.op == GemmOp::kForward ? a.n : a.k);
  return a.out_layers >= 1 && a.out_offset >= 0 && a.out_offset % kGemmAlignElements == 0 &&
         a.out_layer_elements % kGemmAlignElements == 0 && a.out_offset + result <= a.out_layer_elements;
}

// Workspace bytes any grouped GEMM op needs for num_groups experts, 128 bytes of alignment slack
// included (host arithmetic, no device).
size_t GroupedGemmWorkspaceBytes(int64_t num_groups);
// The current device's SMs, at most kGemmMaxSms (queried once per device, then cached: safe under
// graph capture). 0 when it cannot be queried. The FP8 grouped GEMM sizes its grid by it too.
int GemmSmCount();

cudaError_t LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_GROUPED_GEMM_KERNELS_H_
