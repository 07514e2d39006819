// The SwiGLU experts' elementwise backward, its CUDA handler (swiglu_kernels.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_ffi_common.h"
#include "swiglu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

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

}  // namespace
}  // namespace jax_moe

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

namespace jax_moe {

FfiTargets SwigluCudaTargets() {
  return {
      {"jax_moe_swiglu_backward", JaxMoeSwigluBackwardCuda},
  };
}

}  // namespace jax_moe
