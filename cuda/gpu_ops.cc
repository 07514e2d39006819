// CUDA FFI handlers: unpack buffers, launch on XLA's stream. They never allocate, never
// synchronise and never copy to the host, so they are safe inside command buffers (CUDA graphs).
#include "gpu_ops.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "decode_gemm.h"
#include "ffi_shapes.h"
#include "gpu_kernels.h"
#include "grouped_gemm.h"
#include "grouped_gemm_fp8.h"
#include "route_kernels.h"
#include "swiglu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

ffi::Error CudaStatus(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, what + ": " + cudaGetErrorString(status));
}

bool ToFloatType(ffi::DataType type, FloatType* out) {
  switch (type) {
    case ffi::F32:
      *out = FloatType::kF32;
      return true;
    case ffi::BF16:
      *out = FloatType::kBF16;
      return true;
    case ffi::F16:
      *out = FloatType::kF16;
      return true;
    default:
      return false;
  }
}

// The launch arguments of permute's operands and results (checked by CheckPermuteShapes).
PermuteArgs PermuteArgsOf(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& topk_ids,
                          const ffi::Buffer<ffi::S32>& expert_map, void* permuted, ffi::Buffer<ffi::S32>& src_index,
                          ffi::Buffer<ffi::S32>& dest_index, ffi::Buffer<ffi::S32>& group_sizes,
                          ffi::Buffer<ffi::S32>& expert_offsets, ffi::Buffer<ffi::S32>& workspace,
                          const PermuteShapes& shapes, int64_t align, bool identity_map) {
  PermuteArgs args;
  args.x = x.untyped_data();
  args.topk_ids = topk_ids.typed_data();
  args.expert_map = identity_map ? nullptr : expert_map.typed_data();
  args.permuted = permuted;
  args.src_index = src_index.typed_data();
  args.dest_index = dest_index.typed_data();
  args.group_sizes = group_sizes.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.workspace = workspace.typed_data();
  args.num_tokens = shapes.num_tokens;
  args.top_k = shapes.top_k;
  args.num_experts = shapes.num_experts;
  args.num_local = shapes.num_local;
  args.capacity = shapes.capacity;
  args.row_bytes = shapes.row_bytes;
  args.align = align;
  args.workspace_size = shapes.workspace_size;
  return args;
}

ffi::Error PermuteImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                       ffi::Buffer<ffi::S32> expert_map, ffi::AnyBuffer, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                       ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                       ffi::Result<ffi::AnyBuffer> permuted, ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                       ffi::Result<ffi::Buffer<ffi::S32>> dest_index,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
                       ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t align, bool identity_map) {
  PermuteShapes shapes;
  if (ffi::Error error = CheckPermuteShapes(x, topk_ids, expert_map, *permuted, *src_index, *dest_index,
                                            *group_sizes, *expert_offsets, *workspace, align, identity_map, &shapes);
      error.failure())
    return error;
  const PermuteArgs args = PermuteArgsOf(x, topk_ids, expert_map, permuted->untyped_data(), *src_index, *dest_index,
                                         *group_sizes, *expert_offsets, *workspace, shapes, align, identity_map);
  return CudaStatus(LaunchPermute(args, stream), "jax_moe permute");
}

// permute, and its extra blocks start the routed experts' first weight bytes towards L2 (PermuteArgs'
// prefetch): prefetch [El, ...] any dtype, prefetch_bytes per expert, a multiple of 128 at most a
// slab's bytes. The results are permute's.
ffi::Error PermutePrefetchImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                               ffi::Buffer<ffi::S32> expert_map, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                               ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                               ffi::Buffer<ffi::S32>, ffi::AnyBuffer prefetch, ffi::Result<ffi::AnyBuffer> permuted,
                               ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                               ffi::Result<ffi::Buffer<ffi::S32>> dest_index,
                               ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                               ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
                               ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t align, bool identity_map,
                               int64_t prefetch_bytes) {
  PermuteShapes shapes;
  if (ffi::Error error = CheckPermuteShapes(x, topk_ids, expert_map, *permuted, *src_index, *dest_index,
                                            *group_sizes, *expert_offsets, *workspace, align, identity_map, &shapes);
      error.failure())
    return error;
  const auto pd = prefetch.dimensions();
  const int64_t slab = pd.size() >= 1 && pd[0] == shapes.num_local
                           ? static_cast<int64_t>(prefetch.size_bytes()) / shapes.num_local : -1;
  if (slab < 0 || prefetch_bytes < 0 || prefetch_bytes % kPrefetchLineBytes != 0 || prefetch_bytes > slab)
    return InvalidArgument("permute_prefetch: expected prefetch [El, ...] and prefetch_bytes a multiple of 128 "
                           "from 0 to an expert's bytes");
  PermuteArgs args = PermuteArgsOf(x, topk_ids, expert_map, permuted->untyped_data(), *src_index, *dest_index,
                                   *group_sizes, *expert_offsets, *workspace, shapes, align, identity_map);
  args.prefetch = prefetch.untyped_data();
  args.prefetch_expert_bytes = slab;
  args.prefetch_bytes = prefetch_bytes;
  return CudaStatus(LaunchPermute(args, stream), "jax_moe permute_prefetch");
}

// permute for FP8 experts (LaunchPermuteQuantized): permute's operands and results, permuted
// aliased but not written, and the kept rows quantised into q_rows [R, H] float8_e4m3fn and
// row_scale [R, H / 128] float32, R at least the live rows' bound T * k + El * (align - 1).
ffi::Error PermuteQuantizedImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                                ffi::Buffer<ffi::S32> expert_map, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                                ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                                ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> permuted,
                                ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                                ffi::Result<ffi::Buffer<ffi::S32>> dest_index,
                                ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                                ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
                                ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> q_rows,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_scale, int64_t align, bool identity_map) {
  PermuteShapes shapes;
  if (ffi::Error error = CheckPermuteShapes(x, topk_ids, expert_map, *permuted, *src_index, *dest_index,
                                            *group_sizes, *expert_offsets, *workspace, align, identity_map, &shapes);
      error.failure())
    return error;
  const int64_t h = x.dimensions()[1];
  const int64_t live_bound = shapes.num_tokens * shapes.top_k + shapes.num_local * (align - 1);
  const auto q_dims = q_rows->dimensions();
  if (x.element_type() != ffi::BF16 || h % 128 != 0 || q_rows->element_type() != ffi::F8E4M3FN ||
      q_dims.size() != 2 || q_dims[1] != h || q_dims[0] < live_bound ||
      static_cast<int64_t>(row_scale->element_count()) != q_dims[0] * (h / 128))
    return InvalidArgument("permute_fp8: expected x [T, H] bf16 (H a multiple of 128), q_rows [R, H] float8_e4m3fn "
                           "and row_scale [R, H / 128] float32 with R >= T * k + El * (align - 1)");
  const PermuteArgs args = PermuteArgsOf(x, topk_ids, expert_map, nullptr, *src_index, *dest_index, *group_sizes,
                                         *expert_offsets, *workspace, shapes, align, identity_map);
  return CudaStatus(LaunchPermuteQuantized(args, q_rows->untyped_data(), row_scale->typed_data(), stream),
                    "jax_moe permute_fp8");
}

ffi::ErrorOr<UnpermuteArgs> UnpermuteArgsOf(const char* op, const ffi::AnyBuffer& y, const ffi::AnyBuffer& topk_weights,
                                            const ffi::Buffer<ffi::S32>& dest_index, ffi::AnyBuffer& out) {
  const auto w_dims = topk_weights.dimensions();
  const auto y_dims = y.dimensions();
  const auto out_dims = out.dimensions();
  UnpermuteArgs args;
  if (w_dims.size() != 2 || y_dims.size() != 2 || out_dims.size() != 2 || out_dims[0] != w_dims[0] ||
      out_dims[1] != y_dims[1] || static_cast<int64_t>(dest_index.element_count()) < w_dims[0] * w_dims[1] ||
      out.element_type() != y.element_type() || !ToFloatType(y.element_type(), &args.row_type) ||
      !ToFloatType(topk_weights.element_type(), &args.weight_type) || args.weight_type == FloatType::kF16)
    return ffi::Unexpected(InvalidArgument(std::string(op) +
                                           ": shapes or dtypes of y, topk_weights, dest_index and out disagree"));
  args.y = y.untyped_data();
  args.topk_weights = topk_weights.untyped_data();
  args.dest_index = dest_index.typed_data();
  args.out = out.untyped_data();
  args.num_tokens = w_dims[0];
  args.top_k = w_dims[1];
  args.hidden = y_dims[1];
  args.capacity = y_dims[0];
  return args;
}

ffi::Error UnpermuteImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                         ffi::Buffer<ffi::S32> dest_index, ffi::Result<ffi::AnyBuffer> out) {
  auto args = UnpermuteArgsOf("unpermute", y, topk_weights, dest_index, *out);
  if (args.has_error()) return args.error();
  return CudaStatus(LaunchUnpermute(*args, stream), "jax_moe unpermute");
}

// Unpermute with a layer's adds folded in: out = residual + (unpermute(y) + addend), both [T, H] of
// y's dtype (addend a [1] placeholder without has_addend), rounded as XLA's elementwise adds round.
ffi::Error UnpermuteAddImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                            ffi::Buffer<ffi::S32> dest_index, ffi::AnyBuffer residual, ffi::AnyBuffer addend,
                            ffi::Result<ffi::AnyBuffer> out, bool has_addend) {
  auto args = UnpermuteArgsOf("unpermute_add", y, topk_weights, dest_index, *out);
  if (args.has_error()) return args.error();
  const int64_t elements = args->num_tokens * args->hidden;
  if (residual.element_type() != y.element_type() || static_cast<int64_t>(residual.element_count()) != elements ||
      (has_addend && (addend.element_type() != y.element_type() ||
                      static_cast<int64_t>(addend.element_count()) != elements)))
    return InvalidArgument("unpermute_add: residual and addend must be [T, H] of y's dtype");
  args->residual = residual.untyped_data();
  args->addend = has_addend ? addend.untyped_data() : nullptr;
  return CudaStatus(LaunchUnpermute(*args, stream), "jax_moe unpermute_add");
}

ffi::Error UnpermuteGradImpl(cudaStream_t stream, ffi::AnyBuffer d_out, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                             ffi::Buffer<ffi::S32> dest_index, ffi::Buffer<ffi::S32> src_index,
                             ffi::Result<ffi::AnyBuffer> d_y, ffi::Result<ffi::Buffer<ffi::F32>> d_weights) {
  UnpermuteGradShapes shapes;
  if (ffi::Error error =
          CheckUnpermuteGradShapes(d_out, y, topk_weights, dest_index, src_index, *d_y, *d_weights, &shapes);
      error.failure())
    return error;
  UnpermuteGradArgs args;
  if (!ToFloatType(y.element_type(), &args.row_type) || !ToFloatType(topk_weights.element_type(), &args.weight_type) ||
      args.weight_type == FloatType::kF16)
    return InvalidArgument("unpermute_grad: y must be a float type, topk_weights float32 or bfloat16");
  args.d_out = d_out.untyped_data();
  args.y = y.untyped_data();
  args.topk_weights = topk_weights.untyped_data();
  args.dest_index = dest_index.typed_data();
  args.src_index = src_index.typed_data();
  args.d_y = d_y->untyped_data();
  args.d_weights = d_weights->typed_data();
  args.num_tokens = shapes.num_tokens;
  args.top_k = shapes.top_k;
  args.hidden = shapes.hidden;
  args.num_rows = shapes.num_rows;
  return CudaStatus(LaunchUnpermuteGrad(args, stream), "jax_moe unpermute_grad");
}

// permute's rows made again from their routes (gpu_kernels.h): dest_index [T, k] and its inverse
// src_index [R] int32, then n arrays x_i [T, H] and n results out_i [R, H] of one dtype, rows a
// multiple of 16 bytes.
ffi::Error GatherRowsImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> dest_index, ffi::Buffer<ffi::S32> src_index,
                          ffi::RemainingArgs xs, ffi::RemainingRets outs) {
  const int64_t count = static_cast<int64_t>(xs.size());
  const auto dd = dest_index.dimensions();
  if (count < 1 || count > kMaxGatherArrays || static_cast<int64_t>(outs.size()) != count || dd.size() != 2 ||
      dd[1] < 1)
    return InvalidArgument("gather_rows: expected dest_index [T, k], 1 to 4 arrays and as many results");
  GatherRowsArgs args{};
  args.num_arrays = static_cast<int>(count);
  args.dest_index = dest_index.typed_data();
  args.src_index = src_index.typed_data();
  args.top_k = dd[1];
  args.num_rows = static_cast<int64_t>(src_index.element_count());
  for (int64_t n = 0; n < count; ++n) {
    ffi::ErrorOr<ffi::AnyBuffer> x = xs.get<ffi::AnyBuffer>(n);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = outs.get<ffi::AnyBuffer>(n);
    if (!x.has_value() || !out.has_value()) return InvalidArgument("gather_rows: expected buffers");
    const auto xd = x->dimensions();
    const auto od = (*out)->dimensions();
    const int64_t row_bytes = xd.size() == 2 ? xd[1] * static_cast<int64_t>(ffi::ByteWidth(x->element_type())) : -1;
    if (xd.size() != 2 || od.size() != 2 || xd[0] != dd[0] || od[0] != args.num_rows || od[1] != xd[1] ||
        (*out)->element_type() != x->element_type() || (n > 0 && row_bytes != args.row_bytes) || row_bytes % 16 != 0)
      return InvalidArgument("gather_rows: expected arrays [T, H] of one shape, results [R, H] of their dtype, "
                             "rows a multiple of 16 bytes");
    args.num_tokens = xd[0], args.row_bytes = row_bytes;
    args.x[n] = x->untyped_data();
    args.out[n] = (*out)->untyped_data();
  }
  return CudaStatus(LaunchGatherRows(args, stream), "jax_moe gather_rows");
}

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

// The grouped GEMMs of grouped_gemm.h over the groups of expert_offsets, read on the device. The
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

// A grouped GEMM of grouped_gemm.h written into one slice of a stack (aliased in and out), its
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

// The decode grouped GEMM of decode_gemm.h: rows [R, K], weights [El, K, N] bf16, expert_offsets
// [El + 1]; out [<= R, N], or [<= R, N / 2] = silu(gate) * up when gated (N = 2F, gate first).
ffi::Error DecodeMatmulArgs(ffi::AnyBuffer rows, ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> expert_offsets,
                            ffi::AnyBuffer out, bool gated, int64_t rows_per_pass, DecodeGemmArgs* args) {
  const auto rd = rows.dimensions();
  const auto wd = weights.dimensions();
  const auto od = out.dimensions();
  if (rows.element_type() != ffi::BF16 || weights.element_type() != ffi::BF16 || out.element_type() != ffi::BF16)
    return InvalidArgument("decode_matmul: expected bf16 rows, weights and out");
  if (rd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[1] != rd[1] || od[0] > rd[0] ||
      od[1] != (gated ? wd[2] / 2 : wd[2]) || static_cast<int64_t>(expert_offsets.element_count()) != wd[0] + 1)
    return InvalidArgument("decode_matmul: expected rows [R, K], weights [El, K, N], expert_offsets [El + 1] "
                           "and out [<= R, N] ([<= R, N / 2] when gated)");
  if (rd[1] % 8 != 0 || wd[2] % (gated ? 16 : 8) != 0)
    return InvalidArgument("decode_matmul: K and N (N / 2 when gated) must be multiples of 8");
  if (rows_per_pass != 1 && rows_per_pass != 2 && rows_per_pass != 4 && rows_per_pass != 8)
    return InvalidArgument("decode_matmul: rows_per_pass must be 1, 2, 4 or 8");
  args->rows = rows.untyped_data();
  args->weights = weights.untyped_data();
  args->expert_offsets = expert_offsets.typed_data();
  args->out = out.untyped_data();
  args->out_rows = od[0];
  args->num_groups = wd[0], args->k = wd[1], args->n = wd[2];
  args->gated = gated;
  args->rows_per_pass = static_cast<int>(rows_per_pass);
  return ffi::Error::Success();
}

ffi::Error DecodeMatmulImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                            ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> out, bool gated,
                            int64_t rows_per_pass) {
  DecodeGemmArgs args;
  ffi::Error error = DecodeMatmulArgs(rows, weights, expert_offsets, *out, gated, rows_per_pass, &args);
  if (error.failure()) return error;
  return CudaStatus(LaunchDecodeGemm(args, stream), "jax_moe decode_matmul");
}

// The decode grouped GEMM with a dense product in the same launch (decode_gemm.h's shared_*):
// as DecodeMatmulImpl, and shared_out [T, Ns] (or [T, Ns / 2] gated) = shared_x [T, Ks] @
// shared_weights [Ks, Ns], bf16.
ffi::Error DecodeMatmulSharedImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                                  ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer shared_x,
                                  ffi::AnyBuffer shared_weights, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> shared_out, bool gated, int64_t rows_per_pass) {
  DecodeGemmArgs args;
  ffi::Error error = DecodeMatmulArgs(rows, weights, expert_offsets, *out, gated, rows_per_pass, &args);
  if (error.failure()) return error;
  const auto xd = shared_x.dimensions();
  const auto wd = shared_weights.dimensions();
  const auto od = shared_out->dimensions();
  if (shared_x.element_type() != ffi::BF16 || shared_weights.element_type() != ffi::BF16 ||
      shared_out->element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 2 || od.size() != 2 ||
      xd[0] < 1 || wd[0] != xd[1] || od[0] != xd[0] || od[1] != (gated ? wd[1] / 2 : wd[1]) || xd[1] % 8 != 0 ||
      wd[1] % (gated ? 16 : 8) != 0)
    return InvalidArgument("decode_matmul_shared: expected bf16 shared_x [T >= 1, Ks], shared_weights [Ks, Ns] and "
                           "shared_out [T, Ns] ([T, Ns / 2] when gated), Ks and Ns (Ns / 2 gated) multiples of 8");
  args.shared_x = shared_x.untyped_data();
  args.shared_weights = shared_weights.untyped_data();
  args.shared_out = shared_out->untyped_data();
  args.shared_rows = xd[0], args.shared_k = wd[0], args.shared_n = wd[1];
  return CudaStatus(LaunchDecodeGemm(args, stream), "jax_moe decode_matmul_shared");
}

// The experts' choice (route_kernels.h): choice [T, E] float32 -> topk_ids [T, k] int32.
ffi::Error ChooseExpertsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> choice, ffi::Result<ffi::Buffer<ffi::S32>> topk_ids,
                             int64_t n_group, int64_t topk_group) {
  const auto cd = choice.dimensions();
  const auto id = topk_ids->dimensions();
  if (cd.size() != 2 || id.size() != 2 || cd[0] != id[0] ||
      !ChooseExpertsFits(cd[1], id[1], n_group, topk_group))
    return InvalidArgument("choose_experts: expected choice [T, E] and ids [T, k] within ChooseExpertsFits "
                           "(route_kernels.h)");
  ChooseExpertsArgs args;
  args.choice = choice.typed_data();
  args.topk_ids = topk_ids->typed_data();
  args.num_tokens = cd[0], args.num_experts = cd[1], args.top_k = id[1];
  args.n_group = n_group, args.topk_group = topk_group;
  return CudaStatus(LaunchChooseExperts(args, stream), "choose_experts");
}

// The decode router (route_kernels.h): x [T, H] and router [H, E] bf16, bias [E] float32 (or [1]
// without one); workspace: the scratch's, whose last word is the kernel's arrival counter.
// normed (null or [T, H] bf16): the router normalises x first and writes the normalised tokens there.
ffi::Error DecodeRoute(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer router, ffi::Buffer<ffi::F32> bias,
                       ffi::Result<ffi::Buffer<ffi::F32>> logits, ffi::Result<ffi::Buffer<ffi::F32>> topk_weights,
                       ffi::Result<ffi::Buffer<ffi::S32>> topk_ids, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                       ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::AnyBuffer* normed, float norm_epsilon,
                       bool has_bias, bool sigmoid, bool renormalize, float renormalize_epsilon, float scaling,
                       int64_t n_group, int64_t topk_group) {
  const auto xd = x.dimensions();
  const auto rd = router.dimensions();
  const auto wd = topk_weights->dimensions();
  if (xd.size() != 2 || rd.size() != 2 || wd.size() != 2 || x.element_type() != ffi::BF16 ||
      router.element_type() != ffi::BF16 || rd[0] != xd[1] || wd[0] != xd[0])
    return InvalidArgument("decode_route: expected bf16 x [T, H] and router [H, E], weights [T, k]");
  DecodeRouteArgs args;
  args.num_tokens = xd[0], args.hidden = xd[1], args.num_experts = rd[1], args.top_k = wd[1];
  args.n_group = n_group, args.topk_group = topk_group;
  if (!DecodeRouteFits(args.num_tokens, args.hidden, args.num_experts, args.top_k, n_group, topk_group))
    return InvalidArgument("decode_route: sizes outside the kernel's (route_kernels.h DecodeRouteFits)");
  const int64_t pairs = args.num_tokens * args.num_experts;
  if (static_cast<int64_t>(logits->element_count()) != pairs ||
      static_cast<int64_t>(topk_ids->element_count()) != args.num_tokens * args.top_k ||
      static_cast<int64_t>(partials->element_count()) != DecodeRouteSlices(args.hidden) * pairs ||
      (has_bias && static_cast<int64_t>(bias.element_count()) != args.num_experts) || workspace->element_count() < 1)
    return InvalidArgument("decode_route: expected logits [T, E], ids [T, k], partials [slices, T, E], bias [E], "
                           "a workspace of one word or more");
  args.x = x.untyped_data();
  args.router = router.untyped_data();
  args.bias = has_bias ? bias.typed_data() : nullptr;
  args.partials = partials->typed_data();
  args.logits = logits->typed_data();
  args.topk_weights = topk_weights->typed_data();
  args.topk_ids = topk_ids->typed_data();
  args.counter = workspace->typed_data() + workspace->element_count() - 1;
  args.sigmoid = sigmoid, args.renormalize = renormalize;
  args.renormalize_epsilon = renormalize_epsilon, args.scaling = scaling;
  if (normed != nullptr) {
    if (normed->element_type() != ffi::BF16 || normed->dimensions().size() != 2 ||
        normed->dimensions()[0] != xd[0] || normed->dimensions()[1] != xd[1])
      return InvalidArgument("decode_route_norm: expected the normalised tokens bf16 [T, H], as x");
    args.normed = normed->untyped_data();
    args.norm_epsilon = norm_epsilon;
  }
  return CudaStatus(LaunchDecodeRoute(args, stream), "decode_route");
}

ffi::Error DecodeRouteImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer router, ffi::Buffer<ffi::F32> bias,
                           ffi::Buffer<ffi::S32>, ffi::Result<ffi::Buffer<ffi::F32>> logits,
                           ffi::Result<ffi::Buffer<ffi::F32>> topk_weights, ffi::Result<ffi::Buffer<ffi::S32>> topk_ids,
                           ffi::Result<ffi::Buffer<ffi::F32>> partials, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
                           bool has_bias, bool sigmoid, bool renormalize, float renormalize_epsilon, float scaling,
                           int64_t n_group, int64_t topk_group) {
  return DecodeRoute(stream, x, router, bias, logits, topk_weights, topk_ids, partials, workspace, nullptr, 0.0f,
                     has_bias, sigmoid, renormalize, renormalize_epsilon, scaling, n_group, topk_group);
}

// The decode router on tokens before the stack's norm: also writes rms_norm(x) [T, H] bf16 (normed).
ffi::Error DecodeRouteNormImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer router, ffi::Buffer<ffi::F32> bias,
                               ffi::Buffer<ffi::S32>, ffi::Result<ffi::Buffer<ffi::F32>> logits,
                               ffi::Result<ffi::Buffer<ffi::F32>> topk_weights,
                               ffi::Result<ffi::Buffer<ffi::S32>> topk_ids, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                               ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> normed,
                               bool has_bias, bool sigmoid, bool renormalize, float renormalize_epsilon, float scaling,
                               int64_t n_group, int64_t topk_group, float norm_epsilon) {
  ffi::AnyBuffer normed_buffer = *normed;
  return DecodeRoute(stream, x, router, bias, logits, topk_weights, topk_ids, partials, workspace, &normed_buffer,
                     norm_epsilon, has_bias, sigmoid, renormalize, renormalize_epsilon, scaling, n_group, topk_group);
}

// The FP8 grouped GEMM (grouped_gemm_fp8.h). rows [R, K] bf16 are
// quantised per 1 x 128 group into the q_rows / row_scale results (temporaries of the call), then
// multiplied with weights [El, N, K] float8_e4m3fn and their scales [El, N / 128, K / 128].
ffi::Error Fp8GroupedMatmulImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> expert_offsets,
                                ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> q_rows,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_scale, int64_t tile_rows) {
  const auto rd = rows.dimensions();
  const auto wd = weights.dimensions();
  const auto od = out->dimensions();
  if (rd.size() != 2 || wd.size() != 3 || od.size() != 2 || rows.element_type() != ffi::BF16 ||
      weights.element_type() != ffi::F8E4M3FN || out->element_type() != ffi::BF16 || wd[2] != rd[1] ||
      od[1] != wd[1] || od[0] > rd[0] || wd[1] % 128 != 0 || wd[2] % 128 != 0 ||
      static_cast<int64_t>(scale.element_count()) != wd[0] * (wd[1] / 128) * (wd[2] / 128) ||
      static_cast<int64_t>(expert_offsets.element_count()) != wd[0] + 1 ||
      static_cast<int64_t>(q_rows->element_count()) != od[0] * rd[1] ||
      static_cast<int64_t>(row_scale->element_count()) != od[0] * (rd[1] / 128))
    return InvalidArgument("fp8_grouped_matmul: expected bf16 rows [R, K], float8_e4m3fn weights [El, N, K] with "
                           "float32 scales [El, N / 128, K / 128], K and N multiples of 128, out [<= R, N]");
  const int64_t out_rows = od[0], k = rd[1];
  cudaError_t status = LaunchQuantizeRows(rows.untyped_data(), q_rows->untyped_data(), row_scale->typed_data(),
                                          out_rows, k, stream);
  if (status != cudaSuccess) return CudaStatus(status, "fp8_grouped_matmul: quantize rows");
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  const uintptr_t aligned = (base + 127) / 128 * 128;
  Fp8GroupedGemmArgs args;
  args.a = q_rows->untyped_data();
  args.a_scale = row_scale->typed_data();
  args.b = weights.untyped_data();
  args.b_scale = scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.out = out->untyped_data();
  args.workspace = reinterpret_cast<void*>(aligned);
  args.workspace_bytes = workspace->size_bytes() > aligned - base ? workspace->size_bytes() - (aligned - base) : 0;
  args.out_rows = out_rows, args.num_groups = wd[0], args.k = k, args.n = wd[1];
  if (tile_rows != 64 && tile_rows != 128) return InvalidArgument("fp8_grouped_matmul: tile_rows must be 64 or 128");
  args.tile_rows = static_cast<int>(tile_rows);
  return CudaStatus(LaunchFp8GroupedGemm(args, stream), "fp8_grouped_matmul");
}

// The operands of an FP8 SwiGLU experts call: rows [R, H] bf16, gate_up [El, 2F, H] and down
// [El, H, F] float8_e4m3fn with float32 scales [El, 2F / 128, H / 128] and [El, H / 128, F / 128],
// expert_offsets [El + 1], out [out_rows <= R, H] bf16, H and F multiples of 128. Their sizes, or
// an error naming `op`.
struct Fp8SwigluSizes {
  int64_t groups, h, f, out_rows;
};

ffi::ErrorOr<Fp8SwigluSizes> CheckFp8Swiglu(const char* op, const ffi::AnyBuffer& rows, const ffi::AnyBuffer& gate_up,
                                            const ffi::Buffer<ffi::F32>& gate_up_scale, const ffi::AnyBuffer& down,
                                            const ffi::Buffer<ffi::F32>& down_scale,
                                            const ffi::Buffer<ffi::S32>& expert_offsets, const ffi::AnyBuffer& out,
                                            ffi::DataType rows_type = ffi::BF16) {
  const auto rd = rows.dimensions();
  const auto gd = gate_up.dimensions();
  const auto dd = down.dimensions();
  const auto od = out.dimensions();
  if (rd.size() != 2 || gd.size() != 3 || dd.size() != 3 || od.size() != 2 || rows.element_type() != rows_type ||
      gate_up.element_type() != ffi::F8E4M3FN || down.element_type() != ffi::F8E4M3FN ||
      out.element_type() != ffi::BF16)
    return ffi::Unexpected(InvalidArgument(std::string(op) + ": expected " +
                                           (rows_type == ffi::BF16 ? "bf16" : "float8_e4m3fn") +
                                           " rows, float8_e4m3fn experts, bf16 out"));
  const int64_t groups = gd[0], h = rd[1], f2 = gd[1], f = f2 / 2, out_rows = od[0];
  if (f2 != 2 * f || gd[2] != h || dd[0] != groups || dd[1] != h || dd[2] != f || od[1] != h || out_rows > rd[0] ||
      h % 128 != 0 || f % 128 != 0 ||
      static_cast<int64_t>(gate_up_scale.element_count()) != groups * (f2 / 128) * (h / 128) ||
      static_cast<int64_t>(down_scale.element_count()) != groups * (h / 128) * (f / 128) ||
      static_cast<int64_t>(expert_offsets.element_count()) != groups + 1)
    return ffi::Unexpected(InvalidArgument(std::string(op) + ": expected rows [R, H], gate_up [El, 2F, H] and down "
                                           "[El, H, F] with their [.., out / 128, in / 128] scales, H and F "
                                           "multiples of 128, out [<= R, H]"));
  return Fp8SwigluSizes{groups, h, f, out_rows};
}

// The two FP8 GEMMs of Fp8SwigluExpertsImpl on rows already quantised (q_rows [R, H] float8_e4m3fn,
// row_scale [R, H / 128]): gate/up into hidden [R', 2F], SwiGLU's activation quantised
// (LaunchSwigluQuantize), down into out [R', H]; the GEMMs share the workspace.
ffi::Error RunFp8SwigluGemms(const char* op, cudaStream_t stream, const Fp8SwigluSizes& sizes, const void* q_rows,
                             const float* row_scale, ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> gate_up_scale,
                             ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                             ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer& out, ffi::Buffer<ffi::S32>& workspace,
                             ffi::AnyBuffer& hidden, ffi::AnyBuffer& q_act, ffi::Buffer<ffi::F32>& act_scale,
                             int64_t tile_rows) {
  const int64_t h = sizes.h, f = sizes.f, out_rows = sizes.out_rows;
  if (hidden.element_type() != ffi::BF16 || static_cast<int64_t>(hidden.element_count()) != out_rows * 2 * f ||
      static_cast<int64_t>(q_act.element_count()) != out_rows * f ||
      static_cast<int64_t>(act_scale.element_count()) != out_rows * (f / 128))
    return InvalidArgument(std::string(op) + ": expected temporaries hidden [out_rows, 2F] bf16, q_act [out_rows, F], "
                           "act_scale [out_rows, F / 128]");
  if (tile_rows != 64 && tile_rows != 128) return InvalidArgument(std::string(op) + ": tile_rows must be 64 or 128");
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const uintptr_t aligned = (base + 127) / 128 * 128;
  Fp8GroupedGemmArgs args;
  args.a = q_rows;
  args.a_scale = row_scale;
  args.b = gate_up.untyped_data();
  args.b_scale = gate_up_scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.out = hidden.untyped_data();
  args.workspace = reinterpret_cast<void*>(aligned);
  args.workspace_bytes = workspace.size_bytes() > aligned - base ? workspace.size_bytes() - (aligned - base) : 0;
  args.out_rows = out_rows, args.num_groups = sizes.groups, args.k = h, args.n = 2 * f;
  args.tile_rows = static_cast<int>(tile_rows);
  cudaError_t status = LaunchFp8GroupedGemm(args, stream);
  if (status != cudaSuccess) return CudaStatus(status, std::string(op) + ": gate_up");
  status = LaunchSwigluQuantize(hidden.untyped_data(), q_act.untyped_data(), act_scale.typed_data(), out_rows, f, stream);
  if (status != cudaSuccess) return CudaStatus(status, std::string(op) + ": activation");
  args.a = q_act.untyped_data();
  args.a_scale = act_scale.typed_data();
  args.b = down.untyped_data();
  args.b_scale = down_scale.typed_data();
  args.out = out.untyped_data();
  args.k = f, args.n = h;
  return CudaStatus(LaunchFp8GroupedGemm(args, stream), std::string(op) + ": down");
}

// FP8 SwiGLU experts in one call (grouped_gemm_fp8.h): rows [R, H] bf16 quantised per 1 x 128
// group, then RunFp8SwigluGemms. The quantised rows, hidden and the quantised activation are
// results of the call (temporaries).
ffi::Error Fp8SwigluExpertsImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                                ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> q_rows,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_scale, ffi::Result<ffi::AnyBuffer> hidden,
                                ffi::Result<ffi::AnyBuffer> q_act, ffi::Result<ffi::Buffer<ffi::F32>> act_scale,
                                int64_t tile_rows) {
  const auto sizes = CheckFp8Swiglu("fp8_swiglu_experts", rows, gate_up, gate_up_scale, down, down_scale,
                                    expert_offsets, *out);
  if (sizes.has_error()) return sizes.error();
  const int64_t h = sizes->h, out_rows = sizes->out_rows;
  if (static_cast<int64_t>(q_rows->element_count()) != out_rows * h ||
      static_cast<int64_t>(row_scale->element_count()) != out_rows * (h / 128))
    return InvalidArgument("fp8_swiglu_experts: expected temporaries q_rows [out_rows, H], row_scale "
                           "[out_rows, H / 128]");
  const cudaError_t status = LaunchQuantizeRows(rows.untyped_data(), q_rows->untyped_data(), row_scale->typed_data(),
                                                out_rows, h, stream);
  if (status != cudaSuccess) return CudaStatus(status, "fp8_swiglu_experts: quantize rows");
  return RunFp8SwigluGemms("fp8_swiglu_experts", stream, *sizes, q_rows->untyped_data(), row_scale->typed_data(),
                           gate_up, gate_up_scale, down, down_scale, expert_offsets, *out, *workspace, *hidden, *q_act,
                           *act_scale, tile_rows);
}

// Fp8SwigluExpertsImpl on rows quantised beforehand (permute_fp8): q_rows [R, H] float8_e4m3fn and
// row_scale [R, H / 128] are operands, not temporaries.
ffi::Error Fp8SwigluQuantizedExpertsImpl(cudaStream_t stream, ffi::AnyBuffer q_rows, ffi::Buffer<ffi::F32> row_scale,
                                         ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> gate_up_scale,
                                         ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                                         ffi::Buffer<ffi::S32> expert_offsets, ffi::Buffer<ffi::S32>,
                                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
                                         ffi::Result<ffi::AnyBuffer> hidden, ffi::Result<ffi::AnyBuffer> q_act,
                                         ffi::Result<ffi::Buffer<ffi::F32>> act_scale, int64_t tile_rows) {
  const char* op = "fp8_swiglu_quantized_experts";
  const auto sizes = CheckFp8Swiglu(op, q_rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, *out,
                                    ffi::F8E4M3FN);
  if (sizes.has_error()) return sizes.error();
  if (static_cast<int64_t>(row_scale.element_count()) != q_rows.dimensions()[0] * (sizes->h / 128))
    return InvalidArgument(std::string(op) + ": expected row_scale [R, H / 128] beside q_rows [R, H]");
  return RunFp8SwigluGemms(op, stream, *sizes, q_rows.untyped_data(), row_scale.typed_data(), gate_up, gate_up_scale,
                           down, down_scale, expert_offsets, *out, *workspace, *hidden, *q_act, *act_scale, tile_rows);
}

// FP8 SwiGLU experts at decode (decode_gemm.h): the same operands and math as
// Fp8SwigluExpertsImpl in two launches with no workspace; activation [out_rows, F] bf16 is the
// call's temporary (silu(gate) * up, read by the down product).
// The routed operands' checks and arguments of both FP8 decode handlers.
static ffi::ErrorOr<Fp8DecodeSwigluArgs> Fp8DecodeSwigluRouted(const char* op, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                                               ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                                               ffi::Buffer<ffi::F32> down_scale,
                                                               ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer& out,
                                                               ffi::AnyBuffer& activation, int64_t rows_per_pass,
                                                               int64_t group_rows) {
  const auto sizes = CheckFp8Swiglu(op, rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, out);
  if (sizes.has_error()) return ffi::Unexpected(sizes.error());
  const int64_t groups = sizes->groups, h = sizes->h, f = sizes->f, out_rows = sizes->out_rows;
  const std::string name(op);
  if (h > kFp8DecodeMaxK || f > kFp8DecodeMaxK)
    return ffi::Unexpected(InvalidArgument(name + ": expected H and F up to 16384 (the rows are staged in shared memory)"));
  if (activation.element_type() != ffi::BF16 || static_cast<int64_t>(activation.element_count()) != out_rows * f)
    return ffi::Unexpected(InvalidArgument(name + ": expected activation [out_rows, F] bf16"));
  if (rows_per_pass != 8 && rows_per_pass != 16) return ffi::Unexpected(InvalidArgument(name + ": rows_per_pass must be 8 or 16"));
  if (group_rows < 0) return ffi::Unexpected(InvalidArgument(name + ": group_rows must be at least 0 (0: unknown)"));
  Fp8DecodeSwigluArgs args;
  args.rows = rows.untyped_data();
  args.gate_up = gate_up.untyped_data();
  args.gate_up_scale = gate_up_scale.typed_data();
  args.down = down.untyped_data();
  args.down_scale = down_scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.activation = activation.untyped_data();
  args.out = out.untyped_data();
  args.out_rows = out_rows, args.num_groups = groups, args.hidden = h, args.ffn = f;
  args.rows_per_pass = static_cast<int>(rows_per_pass);
  args.group_rows = group_rows;
  return args;
}

// FP8 SwiGLU experts at decode (decode_gemm.h): the same operands and math as
// Fp8SwigluExpertsImpl in two launches with no workspace; activation [out_rows, F] bf16 is the
// call's temporary (silu(gate) * up, read by the down product).
ffi::Error Fp8DecodeSwigluImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                               ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                               ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> activation,
                               int64_t rows_per_pass, int64_t group_rows) {
  const auto args = Fp8DecodeSwigluRouted("fp8_decode_swiglu", rows, gate_up, gate_up_scale, down, down_scale,
                                          expert_offsets, *out, *activation, rows_per_pass, group_rows);
  if (args.has_error()) return args.error();
  return CudaStatus(LaunchFp8DecodeSwiglu(*args, stream), "fp8_decode_swiglu");
}

// The same with a shared expert's FP8 SwiGLU on x [T, H] in the same two launches: shared_gate_up
// [2Fs, H], shared_down [H, Fs] and their scales; results shared_out [T, H] and the temporary
// shared_activation [T, Fs], both bf16.
ffi::Error Fp8DecodeSwigluSharedImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                     ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                     ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                                     ffi::AnyBuffer x, ffi::AnyBuffer shared_gate_up,
                                     ffi::Buffer<ffi::F32> shared_gate_up_scale, ffi::AnyBuffer shared_down,
                                     ffi::Buffer<ffi::F32> shared_down_scale, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> activation, ffi::Result<ffi::AnyBuffer> shared_out,
                                     ffi::Result<ffi::AnyBuffer> shared_activation, int64_t rows_per_pass,
                                     int64_t group_rows) {
  const char* op = "fp8_decode_swiglu_shared";
  auto args = Fp8DecodeSwigluRouted(op, rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, *out,
                                    *activation, rows_per_pass, group_rows);
  if (args.has_error()) return args.error();
  const int64_t h = args->hidden;
  const auto xd = x.dimensions(), gd = shared_gate_up.dimensions(), dd = shared_down.dimensions();
  const auto od = shared_out->dimensions(), ad = shared_activation->dimensions();
  if (xd.size() != 2 || gd.size() != 2 || dd.size() != 2 || od.size() != 2 || ad.size() != 2 ||
      x.element_type() != ffi::BF16 || shared_gate_up.element_type() != ffi::F8E4M3FN ||
      shared_down.element_type() != ffi::F8E4M3FN || shared_out->element_type() != ffi::BF16 ||
      shared_activation->element_type() != ffi::BF16)
    return InvalidArgument(std::string(op) + ": expected bf16 x, float8_e4m3fn shared weights, bf16 results");
  const int64_t t = xd[0], fs = gd[0] / 2;
  if (xd[1] != h || gd[0] != 2 * fs || gd[1] != h || dd[0] != h || dd[1] != fs || fs % 128 != 0 || fs < 128 ||
      fs > kFp8DecodeMaxK || t < 1 || t > 16 || od[0] != t || od[1] != h || ad[0] != t || ad[1] != fs ||
      static_cast<int64_t>(shared_gate_up_scale.element_count()) != (2 * fs / 128) * (h / 128) ||
      static_cast<int64_t>(shared_down_scale.element_count()) != (h / 128) * (fs / 128))
    return InvalidArgument(std::string(op) + ": expected x [T, H] (T from 1 to 16), shared_gate_up [2Fs, H] and "
                           "shared_down [H, Fs] with their [out / 128, in / 128] scales (Fs a multiple of 128 up "
                           "to 16384), shared_out [T, H], shared_activation [T, Fs]");
  args->shared_x = x.untyped_data();
  args->shared_gate_up = shared_gate_up.untyped_data();
  args->shared_gate_up_scale = shared_gate_up_scale.typed_data();
  args->shared_down = shared_down.untyped_data();
  args->shared_down_scale = shared_down_scale.typed_data();
  args->shared_out = shared_out->untyped_data();
  args->shared_activation = shared_activation->untyped_data();
  args->shared_count = t, args->shared_ffn = fs;
  return CudaStatus(LaunchFp8DecodeSwiglu(*args, stream), op);
}

// SwiGLU's backward (swiglu_kernels.h). hidden [R, 2F], or with `stacked` a stack [L, ...] whose
// slice `layer` (a scalar read on the device) holds the [R, 2F] product flattened at element
// `offset`; d_activated [R, F]; row_weights [R] when weighted.
ffi::Error SwigluBackwardImpl(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::AnyBuffer d_activated,
                              ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> layer,
                              ffi::Result<ffi::AnyBuffer> activated, ffi::Result<ffi::AnyBuffer> d_hidden,
                              ffi::Result<ffi::Buffer<ffi::F32>> d_row_weights, bool weighted, bool stacked,
                              int64_t offset) {
  const auto hd = hidden.dimensions();
  const auto dd = d_activated.dimensions();
  const int64_t rows = dd.size() == 2 ? dd[0] : -1, ffn = dd.size() == 2 ? dd[1] : -1;
  const bool hidden_ok = stacked ? hd.size() >= 1 && hd[0] >= 1 && layer.element_count() == 1
                                 : hd.size() == 2 && hd[0] == rows && hd[1] == 2 * ffn;
  if (!hidden_ok || dd.size() != 2 || ffn % 8 != 0 || hidden.element_type() != ffi::BF16 ||
      d_activated.element_type() != ffi::BF16 || activated->element_type() != ffi::BF16 ||
      d_hidden->element_type() != ffi::BF16 || activated->element_count() != d_activated.element_count() ||
      static_cast<int64_t>(d_hidden->element_count()) != 2 * rows * ffn ||
      (weighted && (static_cast<int64_t>(row_weights.element_count()) != rows ||
                    static_cast<int64_t>(d_row_weights->element_count()) != rows)))
    return InvalidArgument("swiglu_backward: expected bf16 hidden [R, 2F] (or a stack of it), d_activated [R, F] "
                           "(F a multiple of 8), and row_weights [R] when weighted");
  SwigluBackwardArgs args{hidden.untyped_data(), d_activated.untyped_data(), weighted ? row_weights.typed_data() : nullptr,
                          activated->untyped_data(), d_hidden->untyped_data(), d_row_weights->typed_data(), rows, ffn};
  if (stacked) {
    args.hidden_layer = layer.typed_data();
    args.hidden_layers = hd[0];
    args.hidden_layer_elements = static_cast<int64_t>(hidden.element_count()) / hd[0];
    args.hidden_offset = offset;
    if (!HiddenSliceFits(args))
      return InvalidArgument("swiglu_backward: the [R, 2F] product must fit in one slice of the stack at offset, "
                             "a multiple of 8 elements");
  }
  return CudaStatus(LaunchSwigluBackward(args, stream), "jax_moe swiglu_backward");
}

// Benchmark floor and ceiling: an empty call on a donated buffer, and a device-to-device copy.
ffi::Error NoopImpl(cudaStream_t, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

ffi::Error CopyImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.size_bytes() != dst->size_bytes()) return InvalidArgument("copy: sizes differ");
  return CudaStatus(cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(), src.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream),
                    "jax_moe copy");
}

// A buffer XLA allocates and no kernel writes: the start of an array that is later written in
// full, one slice per loop iteration (the training stack's stacked weight gradients and saved
// activations), without the fill a zero-initialised array costs. "tag" only keeps XLA from
// merging two such calls of the same shape into one buffer.
ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer>, int64_t /*tag*/) { return ffi::Error::Success(); }

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoePermuteCuda, jax_moe::PermuteImpl,
                              jax_moe::BindPermute(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoePermutePrefetchCuda, jax_moe::PermutePrefetchImpl,
                              jax_moe::BindPermuteAttrs(jax_moe::BindPermuteResults(
                                  jax_moe::BindPermuteOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                      .Arg<ffi::AnyBuffer>()))  // prefetch [El, ...] (read by L2 only)
                                  .Attr<int64_t>("prefetch_bytes"),
                              {ffi::Traits::kCmdBufferCompatible});

// (permuted is aliased but not written.)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoePermuteFp8Cuda, jax_moe::PermuteQuantizedImpl,
                              jax_moe::BindPermuteAttrs(
                                  jax_moe::BindPermuteResults(jax_moe::BindPermuteOperands(
                                                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()))
                                      .Ret<ffi::AnyBuffer>()            // q_rows [R, H] float8_e4m3fn
                                      .Ret<ffi::Buffer<ffi::F32>>()),   // row_scale [R, H / 128]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUnpermuteCuda, jax_moe::UnpermuteImpl,
                              jax_moe::BindUnpermute(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUnpermuteAddCuda, jax_moe::UnpermuteAddImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // y [R, H]
                                  .Arg<ffi::AnyBuffer>()               // topk_weights [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // dest_index [>= T, k]
                                  .Arg<ffi::AnyBuffer>()               // residual [T, H]
                                  .Arg<ffi::AnyBuffer>()               // addend [T, H] ([1] without)
                                  .Ret<ffi::AnyBuffer>()               // out [T, H]
                                  .Attr<bool>("has_addend"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUnpermuteGradCuda, jax_moe::UnpermuteGradImpl,
                              jax_moe::BindUnpermuteGrad(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeGatherRowsCuda, jax_moe::GatherRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()        // dest_index [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // src_index [R], its inverse
                                  .RemainingArgs()                     // x_i [T, H]
                                  .RemainingRets(),                    // out_i [R, H]
                              {ffi::Traits::kCmdBufferCompatible});

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

// The decode GEMM's routed operands, shared by its two handlers.
static auto BindDecodeMatmulOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // rows [R, K], bf16
      .Arg<ffi::AnyBuffer>()          // weights [El, K, N], bf16
      .Arg<ffi::Buffer<ffi::S32>>();  // expert_offsets [El + 1]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeMatmulCuda, jax_moe::DecodeMatmulImpl,
                              BindDecodeMatmulOperands()
                                  .Ret<ffi::AnyBuffer>()               // out, bf16
                                  .Attr<bool>("gated")                 // silu(gate) * up epilogue
                                  .Attr<int64_t>("rows_per_pass"),     // 1, 2, 4 or 8
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeMatmulSharedCuda, jax_moe::DecodeMatmulSharedImpl,
                              BindDecodeMatmulOperands()
                                  .Arg<ffi::AnyBuffer>()               // shared_x [T, Ks], bf16
                                  .Arg<ffi::AnyBuffer>()               // shared_weights [Ks, Ns], bf16
                                  .Ret<ffi::AnyBuffer>()               // out, bf16
                                  .Ret<ffi::AnyBuffer>()               // shared_out, bf16
                                  .Attr<bool>("gated")                 // silu(gate) * up epilogue
                                  .Attr<int64_t>("rows_per_pass"),     // 1, 2, 4 or 8
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeChooseExpertsCuda, jax_moe::ChooseExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()        // choice [T, E]
                                  .Ret<ffi::Buffer<ffi::S32>>()        // topk_ids [T, k]
                                  .Attr<int64_t>("n_group")
                                  .Attr<int64_t>("topk_group"),
                              {ffi::Traits::kCmdBufferCompatible});

namespace {

// The decode router's operands and results, the same for its two targets.
auto DecodeRouteOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()         // x [T, H], bf16 (with the norm: before it)
      .Arg<ffi::AnyBuffer>()         // router [H, E], bf16
      .Arg<ffi::Buffer<ffi::F32>>()  // bias [E] ([1] without)
      .Arg<ffi::Buffer<ffi::S32>>()  // workspace (aliased)
      .Ret<ffi::Buffer<ffi::F32>>()  // logits [T, E]
      .Ret<ffi::Buffer<ffi::F32>>()  // topk_weights [T, k]
      .Ret<ffi::Buffer<ffi::S32>>()  // topk_ids [T, k]
      .Ret<ffi::Buffer<ffi::F32>>()  // partials [slices, T, E]
      .Ret<ffi::Buffer<ffi::S32>>(); // workspace
}

// The routing attributes, after a binding's results.
template <typename Binding>
auto WithDecodeRouteAttrs(Binding binding) {
  return std::move(binding).template Attr<bool>("has_bias")  // (the builder's methods take rvalues)
      .template Attr<bool>("sigmoid")  // scores: sigmoid, else softmax
      .template Attr<bool>("renormalize")
      .template Attr<float>("renormalize_epsilon")
      .template Attr<float>("scaling")
      .template Attr<int64_t>("n_group")
      .template Attr<int64_t>("topk_group");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeRouteCuda, jax_moe::DecodeRouteImpl,
                              WithDecodeRouteAttrs(DecodeRouteOperands()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeRouteNormCuda, jax_moe::DecodeRouteNormImpl,
                              WithDecodeRouteAttrs(DecodeRouteOperands()
                                                       .Ret<ffi::AnyBuffer>())  // normed [T, H] bf16: rms_norm(x)
                                  .Attr<float>("norm_epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8GroupedMatmulCuda, jax_moe::Fp8GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // rows [R, K], bf16
                                  .Arg<ffi::AnyBuffer>()               // weights [El, N, K], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // scale [El, N / 128, K / 128]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, N], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // q_rows [out_rows, K] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // row_scale [out_rows, K / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

// The operands both FP8 SwiGLU experts calls begin with (CheckFp8Swiglu).
static auto BindFp8SwigluOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // rows [R, H], bf16
      .Arg<ffi::AnyBuffer>()          // gate_up [El, 2F, H], float8_e4m3fn
      .Arg<ffi::Buffer<ffi::F32>>()   // gate_up_scale [El, 2F / 128, H / 128]
      .Arg<ffi::AnyBuffer>()          // down [El, H, F], float8_e4m3fn
      .Arg<ffi::Buffer<ffi::F32>>()   // down_scale [El, H / 128, F / 128]
      .Arg<ffi::Buffer<ffi::S32>>();  // expert_offsets [El + 1]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8DecodeSwigluCuda, jax_moe::Fp8DecodeSwigluImpl,
                              BindFp8SwigluOperands()
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // activation [out_rows, F] bf16 (temporary)
                                  .Attr<int64_t>("rows_per_pass")      // 8 or 16
                                  .Attr<int64_t>("group_rows"),        // most rows an expert owns; 0: unknown
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8DecodeSwigluSharedCuda, jax_moe::Fp8DecodeSwigluSharedImpl,
                              BindFp8SwigluOperands()
                                  .Arg<ffi::AnyBuffer>()               // x [T, H], bf16
                                  .Arg<ffi::AnyBuffer>()               // shared_gate_up [2Fs, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // shared_gate_up_scale [2Fs / 128, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // shared_down [H, Fs], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // shared_down_scale [H / 128, Fs / 128]
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // activation [out_rows, F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // shared_out [T, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // shared_activation [T, Fs] bf16 (temporary)
                                  .Attr<int64_t>("rows_per_pass")
                                  .Attr<int64_t>("group_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8SwigluExpertsCuda, jax_moe::Fp8SwigluExpertsImpl,
                              BindFp8SwigluOperands()
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // q_rows [out_rows, H] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // row_scale [out_rows, H / 128] (temporary)
                                  .Ret<ffi::AnyBuffer>()               // hidden [out_rows, 2F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // q_act [out_rows, F] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // act_scale [out_rows, F / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8SwigluQuantizedExpertsCuda, jax_moe::Fp8SwigluQuantizedExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // q_rows [R, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // row_scale [R, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // gate_up [El, 2F, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // gate_up_scale [El, 2F / 128, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // down [El, H, F], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // down_scale [El, H / 128, F / 128]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // hidden [out_rows, 2F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // q_act [out_rows, F] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // act_scale [out_rows, F / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeSwigluBackwardCuda, jax_moe::SwigluBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // hidden [R, 2F] (or its stack), bf16
                                  .Arg<ffi::AnyBuffer>()               // d_activated [R, F], bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()        // row_weights [R] ([1] unweighted)
                                  .Arg<ffi::Buffer<ffi::S32>>()        // layer, a scalar (stacked)
                                  .Ret<ffi::AnyBuffer>()               // activated [R, F], bf16
                                  .Ret<ffi::AnyBuffer>()               // d_hidden [R, 2F], bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()        // d_row_weights [R] ([1] unweighted)
                                  .Attr<bool>("weighted")
                                  .Attr<bool>("stacked")               // hidden is a stack's slice
                                  .Attr<int64_t>("offset"),            // hidden's element in it
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeNoopCuda, jax_moe::NoopImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // buffer (aliased)
                                  .Ret<ffi::AnyBuffer>(),  // the same buffer, untouched
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCopyCuda, jax_moe::CopyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // src
                                  .Ret<ffi::AnyBuffer>(),  // dst, same shape and dtype
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUninitializedCuda, jax_moe::UninitializedImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::AnyBuffer>()   // the buffer, contents unspecified
                                  .Attr<int64_t>("tag"),   // distinct per call (no merging)
                              {ffi::Traits::kCmdBufferCompatible});
