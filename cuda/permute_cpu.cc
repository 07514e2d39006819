// The permute family's CPU handlers: the routing contract's permute, unpermute and unpermute's
// backward (CUDA: permute_ffi.cc). The CUDA kernels must match them bit for bit, so they are
// written for clarity: one pass to count, one to place, one to pad.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "ffi_common.h"
#include "float_bits.h"
#include "permute_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

ffi::Error PermuteImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_ids,
                       ffi::Buffer<ffi::S32> expert_map, ffi::AnyBuffer /*permuted_in*/,
                       ffi::Buffer<ffi::S32> /*src_index_in*/, ffi::Buffer<ffi::S32> /*dest_index_in*/,
                       ffi::Buffer<ffi::S32> /*group_sizes_in*/,
                       ffi::Buffer<ffi::S32> /*expert_offsets_in*/, ffi::Buffer<ffi::S32> /*workspace_in*/,
                       ffi::Result<ffi::AnyBuffer> permuted, ffi::Result<ffi::Buffer<ffi::S32>> src_index,
                       ffi::Result<ffi::Buffer<ffi::S32>> dest_index,
                       ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                       ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
                       ffi::Result<ffi::Buffer<ffi::S32>> workspace,  // used by the CUDA kernels only
                       int64_t align, bool identity_map) {
  PermuteShapes shapes;
  if (ffi::Error error = CheckPermuteShapes(x, topk_ids, expert_map, *permuted, *src_index, *dest_index,
                                            *group_sizes, *expert_offsets, *workspace, align, identity_map, &shapes);
      error.failure())
    return error;
  const int64_t top_k = shapes.top_k;
  const int64_t num_routes = shapes.num_tokens * top_k;
  const int64_t num_experts = shapes.num_experts;
  const int64_t num_local = shapes.num_local;
  const int64_t capacity = shapes.capacity;
  const int64_t row_bytes = shapes.row_bytes;

  const int32_t* ids = topk_ids.typed_data();
  const int32_t* local_of_global = identity_map ? nullptr : expert_map.typed_data();
  std::vector<int32_t> local(num_routes);
  std::vector<int64_t> count(num_local, 0);
  for (int64_t r = 0; r < num_routes; ++r) {
    const int32_t id = ids[r];
    int32_t e = (id >= 0 && id < num_experts) ? (local_of_global ? local_of_global[id] : id) : -1;
    if (e >= num_local) e = -1;  // a corrupt map entry is treated as "not on this device"
    local[r] = e;
    if (e >= 0) ++count[e];
  }

  int32_t* sizes = group_sizes->typed_data();
  int32_t* offsets = expert_offsets->typed_data();
  offsets[0] = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    sizes[e] = static_cast<int32_t>((count[e] + align - 1) / align * align);
    offsets[e + 1] = offsets[e] + sizes[e];
  }

  // Stable placement: routes visited in ascending flat index fill each expert's segment in order.
  const char* x_rows = static_cast<const char*>(x.untyped_data());
  char* out_rows = static_cast<char*>(permuted->untyped_data());
  int32_t* src = src_index->typed_data();
  int32_t* dest = dest_index->typed_data();
  std::vector<int64_t> next_row(offsets, offsets + num_local);
  for (int64_t r = 0; r < num_routes; ++r) {
    const int32_t e = local[r];
    if (e < 0) {
      dest[r] = -1;
      continue;
    }
    const int64_t row = next_row[e]++;
    dest[r] = static_cast<int32_t>(row);
    src[row] = static_cast<int32_t>(r);
    std::memcpy(out_rows + row * row_bytes, x_rows + (r / top_k) * row_bytes, row_bytes);
  }
  // Padding rows are zero with src_index -1; rows past the live count get src_index -1 only.
  for (int64_t e = 0; e < num_local; ++e) {
    for (int64_t row = offsets[e] + count[e]; row < offsets[e + 1]; ++row) {
      src[row] = -1;
      std::memset(out_rows + row * row_bytes, 0, row_bytes);
    }
  }
  for (int64_t row = offsets[num_local]; row < capacity; ++row) src[row] = -1;
  return ffi::Error::Success();
}

// Reads element h of a row of y (or w) of the given dtype as float32.
template <ffi::DataType kType>
float LoadAsFloat(const void* data, int64_t index);
template <>
float LoadAsFloat<ffi::F32>(const void* data, int64_t index) {
  return static_cast<const float*>(data)[index];
}
template <>
float LoadAsFloat<ffi::BF16>(const void* data, int64_t index) {
  return Bf16ToFloat(static_cast<const uint16_t*>(data)[index]);
}
template <>
float LoadAsFloat<ffi::F16>(const void* data, int64_t index) {
  return F16ToFloat(static_cast<const uint16_t*>(data)[index]);
}

template <ffi::DataType kType>
void StoreFromFloat(void* data, int64_t index, float value);
template <>
void StoreFromFloat<ffi::F32>(void* data, int64_t index, float value) {
  static_cast<float*>(data)[index] = value;
}
template <>
void StoreFromFloat<ffi::BF16>(void* data, int64_t index, float value) {
  static_cast<uint16_t*>(data)[index] = FloatToBf16(value);
}
template <>
void StoreFromFloat<ffi::F16>(void* data, int64_t index, float value) {
  static_cast<uint16_t*>(data)[index] = FloatToF16(value);
}

template <ffi::DataType kRowType, ffi::DataType kWeightType>
void UnpermuteRows(const void* y, const void* weights, const int32_t* dest, void* out,
                   int64_t num_tokens, int64_t top_k, int64_t hidden, int64_t capacity) {
  const IeeeSubnormals ieee;
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = dest[t * top_k + j];
      if (row < 0 || row >= capacity) continue;  // dropped route: never read
      const float w = LoadAsFloat<kWeightType>(weights, t * top_k + j);
      const int64_t base = static_cast<int64_t>(row) * hidden;
      // Built with -ffp-contract=off: the product and the sum are each rounded to float32.
      for (int64_t h = 0; h < hidden; ++h) acc[h] = acc[h] + w * LoadAsFloat<kRowType>(y, base + h);
    }
    for (int64_t h = 0; h < hidden; ++h) StoreFromFloat<kRowType>(out, t * hidden + h, acc[h]);
  }
}

template <ffi::DataType kRowType>
ffi::Error DispatchWeights(ffi::DataType weight_type, const void* y, const void* weights,
                           const int32_t* dest, void* out, int64_t num_tokens, int64_t top_k,
                           int64_t hidden, int64_t capacity) {
  switch (weight_type) {
    case ffi::F32:
      UnpermuteRows<kRowType, ffi::F32>(y, weights, dest, out, num_tokens, top_k, hidden, capacity);
      return ffi::Error::Success();
    case ffi::BF16:
      UnpermuteRows<kRowType, ffi::BF16>(y, weights, dest, out, num_tokens, top_k, hidden, capacity);
      return ffi::Error::Success();
    default:
      return InvalidArgument("unpermute: topk_weights must be float32 or bfloat16");
  }
}

ffi::Error UnpermuteImpl(ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                         ffi::Buffer<ffi::S32> dest_index, ffi::Result<ffi::AnyBuffer> out) {
  const auto w_dims = topk_weights.dimensions();
  const auto y_dims = y.dimensions();
  const auto out_dims = out->dimensions();
  if (w_dims.size() != 2 || y_dims.size() != 2 || out_dims.size() != 2 || out_dims[0] != w_dims[0] ||
      out_dims[1] != y_dims[1] || static_cast<int64_t>(dest_index.element_count()) < w_dims[0] * w_dims[1] ||
      out->element_type() != y.element_type())
    return InvalidArgument("unpermute: shapes of y, topk_weights, dest_index and out disagree");
  const int64_t num_tokens = w_dims[0], top_k = w_dims[1], hidden = y_dims[1], capacity = y_dims[0];
  const void* rows = y.untyped_data();
  const void* weights = topk_weights.untyped_data();
  const int32_t* dest = dest_index.typed_data();
  void* result = out->untyped_data();
  switch (y.element_type()) {
    case ffi::F32:
      return DispatchWeights<ffi::F32>(topk_weights.element_type(), rows, weights, dest, result,
                                       num_tokens, top_k, hidden, capacity);
    case ffi::BF16:
      return DispatchWeights<ffi::BF16>(topk_weights.element_type(), rows, weights, dest, result,
                                        num_tokens, top_k, hidden, capacity);
    case ffi::F16:
      return DispatchWeights<ffi::F16>(topk_weights.element_type(), rows, weights, dest, result,
                                       num_tokens, top_k, hidden, capacity);
    default:
      return InvalidArgument("unpermute: y must be float16, bfloat16 or float32");
  }
}

// Unpermute's backward (permute_kernels.h, UnpermuteGradArgs): d_y rows from src_index, each product
// rounded once as on the GPU (bitwise equal); d_weights summed over h in ascending order.
template <ffi::DataType kRowType, ffi::DataType kWeightType>
void UnpermuteGradRows(const void* d_out, const void* y, const void* weights, const int32_t* dest,
                       const int32_t* src, void* d_y, float* d_weights, const UnpermuteGradShapes& s) {
  const IeeeSubnormals ieee;
  const int64_t num_routes = s.num_tokens * s.top_k;
  for (int64_t r = 0; r < s.num_rows; ++r) {
    const int32_t route = src[r];
    const bool routed = route >= 0 && route < num_routes;
    const float w = routed ? LoadAsFloat<kWeightType>(weights, route) : 0.0f;
    const int64_t token_base = routed ? (route / s.top_k) * s.hidden : 0;
    for (int64_t h = 0; h < s.hidden; ++h)
      StoreFromFloat<kRowType>(d_y, r * s.hidden + h, routed ? w * LoadAsFloat<kRowType>(d_out, token_base + h) : 0.0f);
  }
  for (int64_t route = 0; route < num_routes; ++route) {
    const int32_t row = dest[route];
    float acc = 0.0f;
    if (row >= 0 && row < s.num_rows) {
      const int64_t token_base = (route / s.top_k) * s.hidden, row_base = static_cast<int64_t>(row) * s.hidden;
      for (int64_t h = 0; h < s.hidden; ++h)
        acc = acc + LoadAsFloat<kRowType>(y, row_base + h) * LoadAsFloat<kRowType>(d_out, token_base + h);
    }
    d_weights[route] = acc;
  }
}

template <ffi::DataType kRowType>
ffi::Error UnpermuteGradWeights(ffi::DataType weight_type, const void* d_out, const void* y, const void* weights,
                                const int32_t* dest, const int32_t* src, void* d_y, float* d_weights,
                                const UnpermuteGradShapes& shapes) {
  switch (weight_type) {
    case ffi::F32:
      UnpermuteGradRows<kRowType, ffi::F32>(d_out, y, weights, dest, src, d_y, d_weights, shapes);
      return ffi::Error::Success();
    case ffi::BF16:
      UnpermuteGradRows<kRowType, ffi::BF16>(d_out, y, weights, dest, src, d_y, d_weights, shapes);
      return ffi::Error::Success();
    default:
      return InvalidArgument("unpermute_grad: topk_weights must be float32 or bfloat16");
  }
}

ffi::Error UnpermuteGradImpl(ffi::AnyBuffer d_out, ffi::AnyBuffer y, ffi::AnyBuffer topk_weights,
                             ffi::Buffer<ffi::S32> dest_index, ffi::Buffer<ffi::S32> src_index,
                             ffi::Result<ffi::AnyBuffer> d_y, ffi::Result<ffi::Buffer<ffi::F32>> d_weights) {
  UnpermuteGradShapes shapes;
  if (ffi::Error error =
          CheckUnpermuteGradShapes(d_out, y, topk_weights, dest_index, src_index, *d_y, *d_weights, &shapes);
      error.failure())
    return error;
  const auto args = std::make_tuple(d_out.untyped_data(), y.untyped_data(), topk_weights.untyped_data(),
                                    dest_index.typed_data(), src_index.typed_data(), d_y->untyped_data(),
                                    d_weights->typed_data(), shapes);
  const ffi::DataType weight_type = topk_weights.element_type();
  switch (y.element_type()) {
    case ffi::F32:
      return std::apply([&](auto... a) { return UnpermuteGradWeights<ffi::F32>(weight_type, a...); }, args);
    case ffi::BF16:
      return std::apply([&](auto... a) { return UnpermuteGradWeights<ffi::BF16>(weight_type, a...); }, args);
    case ffi::F16:
      return std::apply([&](auto... a) { return UnpermuteGradWeights<ffi::F16>(weight_type, a...); }, args);
    default:
      return InvalidArgument("unpermute_grad: y must be float16, bfloat16 or float32");
  }
}

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoePermuteCpu, jax_moe::PermuteImpl,
                              jax_moe::BindPermute(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUnpermuteCpu, jax_moe::UnpermuteImpl,
                              jax_moe::BindUnpermute(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUnpermuteGradCpu, jax_moe::UnpermuteGradImpl,
                              jax_moe::BindUnpermuteGrad(ffi::Ffi::Bind()));

namespace jax_moe {

FfiTargets PermuteCpuTargets() {
  return {
      {"jax_moe_permute", JaxMoePermuteCpu},
      {"jax_moe_unpermute", JaxMoeUnpermuteCpu},
      {"jax_moe_unpermute_grad", JaxMoeUnpermuteGradCpu},
  };
}

}  // namespace jax_moe
