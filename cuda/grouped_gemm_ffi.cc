// The bf16 grouped GEMM's CUDA handlers (grouped_gemm_kernels.h): grouped_matmul and
// grouped_matmul_into. The CPU twin of the products is grouped_gemm_cpu.cc.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_ffi_common.h"
#include "grouped_gemm_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

// Launches a grouped GEMM whose op, tile and sizes `args` already holds, on these operands. The
// per-group arguments go in `workspace` from its first 128-byte boundary (a temporary buffer of
// XLA's may sit at a smaller alignment); GroupedGemmWorkspaceBytes counts that slack.
ffi::Error LaunchOnWorkspace(GroupedGemmArgs& args, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                             const ffi::Buffer<ffi::S32>& expert_offsets, void* out, void* workspace, size_t bytes,
                             cudaStream_t stream) {
  if (args.k % kGemmAlignElements != 0 || args.n % kGemmAlignElements != 0)
    return InvalidArgument("grouped_matmul: K and N must be multiples of 8");
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.out = out;
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace);
  const uintptr_t aligned = (base + 127) / 128 * 128;
  args.workspace = reinterpret_cast<void*>(aligned);
  args.workspace_bytes = bytes > aligned - base ? bytes - (aligned - base) : 0;
  if (bytes < GroupedGemmWorkspaceBytes(args.num_groups))
    return InvalidArgument("grouped_matmul: the workspace is too small for the grouped GEMM "
                           "(scratch built without the CUDA module, or for another dtype?)");
  return CudaStatus(LaunchGroupedGemm(args, stream), "jax_moe grouped_matmul");
}

// The grouped GEMMs of grouped_gemm_kernels.h over the groups of expert_offsets, read on the device. The
// workspace (the scratch's, or the backward pass's, aliased) holds CUTLASS's per-group arguments.
//   op forward:     a = rows [R, K],  b = weights [El, K, N], out [<= R, N]
//   op input grad:  a = d_out [R, N], b = weights [El, K, N], out [<= R, K]
//   op weight grad: a = rows [R, K],  b = d_out [R, N],       out [El, K, N]
ffi::Error GroupedMatmulImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::Buffer<ffi::S32> expert_offsets, ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t tile, int64_t op) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  const auto od = out->dimensions();
  if (a.element_type() != ffi::BF16 || b.element_type() != ffi::BF16 || out->element_type() != ffi::BF16 ||
      !IsGemmTile(tile))
    return InvalidArgument("grouped_matmul: expected bf16 operands and a known tile");
  GroupedGemmArgs args;
  args.op = static_cast<GemmOp>(op);
  bool shapes_ok = ad.size() == 2;
  switch (args.op) {
    case GemmOp::kForward:  // rows [R, K], weights [El, K, N], out [<= R, N]
      shapes_ok = shapes_ok && bd.size() == 3 && od.size() == 2 && bd[1] == ad[1] && od[1] == bd[2] && od[0] <= ad[0];
      if (shapes_ok) args.num_groups = bd[0], args.k = bd[1], args.n = bd[2], args.out_rows = od[0];
      break;
    case GemmOp::kInputGrad:  // d_out [R, N], weights [El, K, N], out [<= R, K]
      shapes_ok = shapes_ok && bd.size() == 3 && od.size() == 2 && bd[2] == ad[1] && od[1] == bd[1] && od[0] <= ad[0];
      if (shapes_ok) args.num_groups = bd[0], args.k = bd[1], args.n = bd[2], args.out_rows = od[0];
      break;
    case GemmOp::kWeightGrad:  // rows [R, K], d_out [R, N], out [El, K, N]
      shapes_ok = shapes_ok && bd.size() == 2 && od.size() == 3 && bd[0] == ad[0] && od[1] == ad[1] && od[2] == bd[1];
      if (shapes_ok) args.num_groups = od[0], args.k = od[1], args.n = od[2], args.out_rows = ad[0];
      break;
    default:
      return InvalidArgument("grouped_matmul: unknown op");
  }
  if (!shapes_ok || static_cast<int64_t>(expert_offsets.element_count()) != args.num_groups + 1)
    return InvalidArgument("grouped_matmul: operand shapes do not fit the op, or expert_offsets is not [El + 1]");
  args.tile = static_cast<GemmTile>(tile);
  return LaunchOnWorkspace(args, a, b, expert_offsets, out->untyped_data(), workspace->untyped_data(),
                           workspace->size_bytes(), stream);
}

// A grouped GEMM of grouped_gemm_kernels.h written into one slice of a stack (aliased in and out), its
// result flattened at element `offset` of slice `layer`: a training loop's per-layer result with
// no per-layer buffer to copy (the weight gradients into the stacked gradient, the forward's
// gate/up product into the buffer that keeps it for the backward).
//   op forward:     a = rows [R, K], b = weights [El, K, N], result [out_rows, N] (out_rows <= R)
//   op weight grad: a = rows [R, K], b = d_out [R, N],       result [El, K, N]
//   stack [L, ...] of bf16, layer s32[] (read on the device, clamped to [0, L))
ffi::Error GroupedMatmulIntoImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                 ffi::Buffer<ffi::S32> expert_offsets, ffi::Buffer<ffi::S32>, ffi::AnyBuffer,
                                 ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> stack,
                                 ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t tile, int64_t op,
                                 int64_t out_rows, int64_t offset) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  const auto sd = stack->dimensions();
  if (a.element_type() != ffi::BF16 || b.element_type() != ffi::BF16 || stack->element_type() != ffi::BF16 ||
      !IsGemmTile(tile))
    return InvalidArgument("grouped_matmul_into: expected bf16 operands and stack, and a known tile");
  GroupedGemmArgs args;
  args.op = static_cast<GemmOp>(op);
  args.num_groups = static_cast<int64_t>(expert_offsets.element_count()) - 1;
  bool shapes_ok = ad.size() == 2 && sd.size() >= 1 && sd[0] >= 1 && layer.element_count() == 1 && args.num_groups >= 1;
  if (args.op == GemmOp::kForward) {  // rows [R, K], weights [El, K, N]
    shapes_ok = shapes_ok && bd.size() == 3 && bd[0] == args.num_groups && bd[1] == ad[1] && out_rows >= 0 &&
                out_rows <= ad[0];
    if (shapes_ok) args.k = bd[1], args.n = bd[2], args.out_rows = out_rows;
    args.tile = static_cast<GemmTile>(tile);
  } else if (args.op == GemmOp::kWeightGrad) {  // rows [R, K], d_out [R, N]
    shapes_ok = shapes_ok && bd.size() == 2 && bd[0] == ad[0];
    if (shapes_ok) args.k = ad[1], args.n = bd[1], args.out_rows = ad[0];
    args.tile = GemmTile::kLargeM;
  } else {
    return InvalidArgument("grouped_matmul_into: op must be forward or weight grad");
  }
  if (!shapes_ok)
    return InvalidArgument("grouped_matmul_into: expected rows [R, K], weights [El, K, N] (forward) or d_out "
                           "[R, N] (weight grad), expert_offsets [El + 1], a stack [L, ...] and a scalar layer");
  args.out_layer = layer.typed_data();
  args.out_layers = sd[0];
  args.out_layer_elements = static_cast<int64_t>(stack->element_count()) / sd[0];
  args.out_offset = offset;
  if (!OutSliceFits(args))
    return InvalidArgument("grouped_matmul_into: the result must fit in one slice of the stack at offset, "
                           "a multiple of 8 elements");
  return LaunchOnWorkspace(args, a, b, expert_offsets, stack->untyped_data(), workspace->untyped_data(),
                           workspace->size_bytes(), stream);
}

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeGroupedMatmulCuda, jax_moe::GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // a: rows or d_out, bf16
                                  .Arg<ffi::AnyBuffer>()               // b: weights or d_out, bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out, bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Attr<int64_t>("tile")               // GemmTile
                                  .Attr<int64_t>("op"),                // GemmOp
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeGroupedMatmulIntoCuda, jax_moe::GroupedMatmulIntoImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // a: rows [R, K], bf16
                                  .Arg<ffi::AnyBuffer>()               // b: weights or d_out, bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Arg<ffi::AnyBuffer>()               // stack [L, ...] (aliased)
                                  .Arg<ffi::Buffer<ffi::S32>>()        // layer, a scalar
                                  .Ret<ffi::AnyBuffer>()               // stack, slice layer written
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Attr<int64_t>("tile")               // GemmTile (forward)
                                  .Attr<int64_t>("op")                 // GemmOp: forward or weight grad
                                  .Attr<int64_t>("out_rows")           // forward: the result's rows
                                  .Attr<int64_t>("offset"),            // element of the slice
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

FfiTargets GroupedGemmCudaTargets() {
  return {
      {"jax_moe_grouped_matmul", JaxMoeGroupedMatmulCuda},
      {"jax_moe_grouped_matmul_into", JaxMoeGroupedMatmulIntoCuda},
  };
}

}  // namespace jax_moe
