// What the permute family's CPU and CUDA handlers share (permute_cpu.cc, permute_ffi.cc): the
// operand/result lists of the permute and unpermute calls (one definition for both platforms) and
// shape checks. Python validates every argument at trace time; the checks only keep a hand-written
// ffi_call from reading or writing out of bounds.
#ifndef JAX_MOE_PERMUTE_FFI_H_
#define JAX_MOE_PERMUTE_FFI_H_

#include <cstdint>
#include <string>
#include <utility>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {

struct PermuteShapes {
  int64_t num_tokens, top_k, num_experts, num_local, capacity, row_bytes, workspace_size;
};

inline int64_t RowBytes(const xla::ffi::AnyBuffer& rows) {
  const auto dims = rows.dimensions();
  return dims.size() == 2 ? dims[1] * static_cast<int64_t>(xla::ffi::ByteWidth(rows.element_type())) : -1;
}

inline xla::ffi::Error CheckPermuteShapes(const xla::ffi::AnyBuffer& x, const xla::ffi::Buffer<xla::ffi::S32>& topk_ids,
                                          const xla::ffi::Buffer<xla::ffi::S32>& expert_map,
                                          const xla::ffi::AnyBuffer& permuted, const xla::ffi::Buffer<xla::ffi::S32>& src_index,
                                          const xla::ffi::Buffer<xla::ffi::S32>& dest_index,
                                          const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                          const xla::ffi::Buffer<xla::ffi::S32>& expert_offsets,
                                          const xla::ffi::Buffer<xla::ffi::S32>& workspace, int64_t align,
                                          bool identity_map, PermuteShapes* shapes) {
  const auto ids_dims = topk_ids.dimensions();
  if (ids_dims.size() != 2 || x.dimensions().size() != 2 || ids_dims[0] != x.dimensions()[0] ||
      permuted.dimensions().size() != 2)
    return InvalidArgument("permute: x must be [T, H], topk_ids [T, k] and permuted [R_cap, H]");
  shapes->num_tokens = ids_dims[0];
  shapes->top_k = ids_dims[1];
  // The identity map (an attribute: the map operand is then a 1-element placeholder, never read): E = El.
  shapes->num_experts = identity_map ? group_sizes.element_count() : expert_map.element_count();
  shapes->num_local = group_sizes.element_count();
  shapes->capacity = permuted.dimensions()[0];
  shapes->row_bytes = RowBytes(x);
  shapes->workspace_size = workspace.element_count();
  const int64_t routes = shapes->num_tokens * shapes->top_k;
  if (shapes->row_bytes != RowBytes(permuted) || align < 1 || shapes->num_local < 1 ||
      static_cast<int64_t>(expert_offsets.element_count()) != shapes->num_local + 1 ||
      static_cast<int64_t>(src_index.element_count()) != shapes->capacity ||
      static_cast<int64_t>(dest_index.element_count()) < routes ||
      routes + shapes->num_local * (align - 1) > shapes->capacity || shapes->num_experts < 1)
    return InvalidArgument("permute: scratch buffers do not fit the inputs");
  return xla::ffi::Error::Success();
}

// Permute's operands (x, the routes, the map, then the scratch buffers it aliases), bound after
// whatever context the platform needs. (The helpers take the builder by reference: it cannot be
// moved into a parameter, and its methods take rvalues.) BindPermute below is the whole binding; its siblings
// (permute_prefetch, permute_fp8) add an operand or results between the pieces.
template <typename Binding>
auto BindPermuteOperands(Binding&& binding) {
  using xla::ffi::AnyBuffer;
  using Indices = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(binding).template Arg<AnyBuffer>()  // x [T, H]
      .template Arg<Indices>()              // topk_ids [T, k]
      .template Arg<Indices>()              // expert_map [E] (a [1] placeholder with identity_map)
      .template Arg<AnyBuffer>()            // permuted (aliased)
      .template Arg<Indices>()              // src_index (aliased)
      .template Arg<Indices>()              // dest_index (aliased)
      .template Arg<Indices>()              // group_sizes (aliased)
      .template Arg<Indices>()              // expert_offsets (aliased)
      .template Arg<Indices>();             // workspace (aliased)
}

// Permute's results: the scratch buffers, written in place.
template <typename Binding>
auto BindPermuteResults(Binding&& binding) {
  using xla::ffi::AnyBuffer;
  using Indices = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(binding).template Ret<AnyBuffer>()  // permuted [R_cap, H]
      .template Ret<Indices>()              // src_index [R_cap]
      .template Ret<Indices>()              // dest_index [T_max, k]
      .template Ret<Indices>()              // group_sizes [El]
      .template Ret<Indices>()              // expert_offsets [El + 1]
      .template Ret<Indices>();             // workspace
}

// Permute's attributes.
template <typename Binding>
auto BindPermuteAttrs(Binding&& binding) {
  return std::move(binding).template Attr<int64_t>("align")
      // The identity map as an attribute, not as an empty operand: jaxlib 0.11.2's compiler crashed
      // on an empty operand inside a shard_map over 2+ GPUs.
      .template Attr<bool>("identity_map");
}

// Permute's operands, results and attributes.
template <typename Binding>
auto BindPermute(Binding&& binding) {
  return BindPermuteAttrs(BindPermuteResults(BindPermuteOperands(std::move(binding))));
}

// Unpermute's operands and result, bound after whatever context the platform needs.
template <typename Binding>
auto BindUnpermute(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // y [R_cap, H]
      .template Arg<xla::ffi::AnyBuffer>()                   // topk_weights [T, k]
      .template Arg<xla::ffi::Buffer<xla::ffi::S32>>()       // dest_index [T_max, k]
      .template Ret<xla::ffi::AnyBuffer>();                  // out [T, H]
}

struct UnpermuteGradShapes {
  int64_t num_tokens, top_k, hidden, num_rows;
};

// d_out [T, H], y [R, H] of one float dtype, topk_weights [T, k], dest_index [T, k], src_index [R];
// d_y like y, d_weights [T, k].
inline xla::ffi::Error CheckUnpermuteGradShapes(const xla::ffi::AnyBuffer& d_out, const xla::ffi::AnyBuffer& y,
                                                const xla::ffi::AnyBuffer& topk_weights,
                                                const xla::ffi::Buffer<xla::ffi::S32>& dest_index,
                                                const xla::ffi::Buffer<xla::ffi::S32>& src_index,
                                                const xla::ffi::AnyBuffer& d_y,
                                                const xla::ffi::Buffer<xla::ffi::F32>& d_weights,
                                                UnpermuteGradShapes* shapes) {
  const auto g = d_out.dimensions(), r = y.dimensions(), w = topk_weights.dimensions(), dy = d_y.dimensions();
  if (g.size() != 2 || r.size() != 2 || w.size() != 2 || dy.size() != 2 || g[0] != w[0] || g[1] != r[1] ||
      dy[0] != r[0] || dy[1] != r[1] || d_out.element_type() != y.element_type() ||
      d_y.element_type() != y.element_type() ||
      static_cast<int64_t>(dest_index.element_count()) != w[0] * w[1] ||
      static_cast<int64_t>(src_index.element_count()) != r[0] ||
      static_cast<int64_t>(d_weights.element_count()) != w[0] * w[1])
    return InvalidArgument("unpermute_grad: shapes or dtypes of d_out, y, topk_weights, dest_index, src_index disagree");
  shapes->num_tokens = w[0];
  shapes->top_k = w[1];
  shapes->hidden = r[1];
  shapes->num_rows = r[0];
  return xla::ffi::Error::Success();
}

// Unpermute's backward: operands and results, bound after whatever context the platform needs.
template <typename Binding>
auto BindUnpermuteGrad(Binding binding) {
  using Indices = xla::ffi::Buffer<xla::ffi::S32>;
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // d_out [T, H]
      .template Arg<xla::ffi::AnyBuffer>()                   // y [R, H], the rows unpermute read
      .template Arg<xla::ffi::AnyBuffer>()                   // topk_weights [T, k]
      .template Arg<Indices>()                               // dest_index [T, k]
      .template Arg<Indices>()                               // src_index [R]
      .template Ret<xla::ffi::AnyBuffer>()                   // d_y [R, H], y's dtype
      .template Ret<xla::ffi::Buffer<xla::ffi::F32>>();      // d_weights [T, k] float32
}

}  // namespace jax_moe

#endif  // JAX_MOE_PERMUTE_FFI_H_
