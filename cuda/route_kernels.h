// The decode router: a layer's router logits, scores and top-k for a few tokens in one launch.
// XLA runs the same math (jax_moe.routing.route_logits of router_logits) as six to ten small
// kernels at decode (a multiply and a reduce for the [1, H] x [H, E] product, the softmax, a sort
// for the top-k, the gathers, the renormalisation): 9-20 us per layer on the H200 where the
// arithmetic takes one. Here every block reduces a slice of H for a tile of experts, and the last
// block to finish sums the slices in a fixed order and routes every token:
//   scores: softmax over all E, or sigmoid; choice = scores + bias (optional, for choosing only);
//   n_group > 1 (DeepSeek-V3): groups scored by the sum of their two best choices, only the
//   topk_group best groups eligible; the top k choices by value, ties to the lower expert index;
//   weights = the chosen experts' scores, optionally / (their sum + renormalize_epsilon), * scaling.
// The same ids as route_logits of the same logits; logits and weights equal within float32
// rounding (the summation orders are not XLA's). Deterministic. No allocation: the per-slice sums
// are a result of the call, and the arrival counter is one int32 that the caller keeps at zero
// between calls (the last block resets it): the last word of the scratch's workspace
// (workspace_layout.h).
#ifndef JAX_MOE_ROUTE_KERNELS_H_
#define JAX_MOE_ROUTE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "constants.h"

namespace jax_moe {

struct DecodeRouteArgs {
  const void* x;               // [T, H] bf16: the normalised tokens, or with normed, the tokens before the norm
  const void* router;          // [H, E] bf16
  const float* bias;           // [E], or null
  float* partials;             // [DecodeRouteSlices(H), T, E] per-slice sums (scratch of the call)
  float* logits;               // [T, E] out
  float* topk_weights;         // [T, k] out
  int32_t* topk_ids;           // [T, k] out, global expert ids, best first
  int32_t* counter;            // one int32, zero on entry and on exit
  int64_t num_tokens, hidden, num_experts, top_k;
  bool sigmoid = false, renormalize = false;
  float renormalize_epsilon = 0.0f, scaling = 1.0f;
  int64_t n_group = 1, topk_group = 1;
  // Optional (non-null): the router normalises x first, as jax_moe.stack.rms_norm does (float32
  // mean of squares over H, + norm_epsilon, reciprocal square root, x times it rounded to bf16),
  // routes those tokens and writes them here [T, H] bf16: the stack's norm without launches of its own.
  void* normed = nullptr;
  float norm_epsilon = 1e-6f;
};

// Slices of H that the router's reduction is split into (rows of `partials`).
int64_t DecodeRouteSlices(int64_t hidden);
// Whether the sizes fit the kernel: 1 <= T <= 16, 8 <= E <= 512, T * E <= 4096, H and E multiples of 8,
// 1 <= k <= min(E, 32), groups dividing E (two experts or more each), 1 <= topk_group <= n_group <= 32.
bool DecodeRouteFits(int64_t num_tokens, int64_t hidden, int64_t num_experts, int64_t top_k, int64_t n_group,
                     int64_t topk_group);
cudaError_t LaunchDecodeRoute(const DecodeRouteArgs& args, cudaStream_t stream);

// The experts' choice at any T (route_logits' top k, for the tokens that do not take the decode
// router): from choice [T, E] float32 (the scores plus the bias), the k best experts of each token,
// ties to the lower index, within the topk_group best of n_group groups (scored by the sum of their
// two best choices) when n_group > 1; the ids lax.top_k gives for route_logits. One warp per token,
// its choices in registers: XLA's sort-based top-k took 15 us (Qwen3-30B) to 80 us (DeepSeek-V3's
// two group sorts and the final one) per layer at T = 4096 on the H200.
struct ChooseExpertsArgs {
  const float* choice;  // [T, E]
  int32_t* topk_ids;    // [T, k] out, best first
  int64_t num_tokens, num_experts, top_k, n_group = 1, topk_group = 1;
};
// 1 <= k <= min(E, 32), 1 <= E <= 1024, groups dividing E, 1 <= topk_group <= n_group <= 32.
bool ChooseExpertsFits(int64_t num_experts, int64_t top_k, int64_t n_group, int64_t topk_group);
cudaError_t LaunchChooseExperts(const ChooseExpertsArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_ROUTE_KERNELS_H_
