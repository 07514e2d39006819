// The routing CUDA handlers (route_kernels.h): the experts' choice at any T and the decode router,
// with or without the stack's norm in its launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cuda_ffi_common.h"
#include "route_kernels.h"
#include "workspace_layout.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

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
// without one); workspace: the scratch's, whose last word is the kernel's arrival counter
// (workspace_layout.h).
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
  args.counter = workspace->typed_data() + DecodeRouteCounterWord(static_cast<int64_t>(workspace->element_count()));
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

}  // namespace
}  // namespace jax_moe

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

namespace jax_moe {

FfiTargets RouteCudaTargets() {
  return {
      {"jax_moe_choose_experts", JaxMoeChooseExpertsCuda},
      {"jax_moe_decode_route", JaxMoeDecodeRouteCuda},
      {"jax_moe_decode_route_norm", JaxMoeDecodeRouteNormCuda},
  };
}

}  // namespace jax_moe
