// The permute family's CUDA handlers (permute_kernels.h): permute and its prefetching and FP8
// variants, unpermute (and with the layer's adds), unpermute's backward, gather_rows. Their CPU
// twins are in permute_cpu.cc; the bindings both share in permute_ffi.h.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_ffi_common.h"
#include "permute_ffi.h"
#include "permute_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

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

// permute's rows made again from their routes (permute_kernels.h): dest_index [T, k] and its inverse
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

namespace jax_moe {

FfiTargets PermuteCudaTargets() {
  return {
      {"jax_moe_permute", JaxMoePermuteCuda},
      {"jax_moe_permute_prefetch", JaxMoePermutePrefetchCuda},
      {"jax_moe_permute_fp8", JaxMoePermuteFp8Cuda},
      {"jax_moe_unpermute", JaxMoeUnpermuteCuda},
      {"jax_moe_unpermute_add", JaxMoeUnpermuteAddCuda},
      {"jax_moe_unpermute_grad", JaxMoeUnpermuteGradCuda},
      {"jax_moe_gather_rows", JaxMoeGatherRowsCuda},
  };
}

}  // namespace jax_moe
