// The decode MoE layer's experts in one launch: for a few tokens (T <= kDecodeLayerMaxTokens), from
// the router's ids and weights to the layer's output, with no permuted rows and no launches between
//   out[t] = residual[t] + (sum over kept j of w[t, j] * y[t * k + j]  (+ shared[t]))
//   y[r]   = down[e] . silu(x[t] . gate[e]) * (x[t] . up[e])   for route r = t * k + j, e = ids[t, j]
// where shared[t] is the shared expert's SwiGLU on x[t] (times sigmoid(x[t] . shared_gate) when
// gated). Each block builds the routes' expert groups from the ids itself (a few dozen routes), takes
// an equal span of the gate/up product's 16-column chunks over all groups (every active expert's
// weights streamed once, the SMs' shares equal to a chunk), waits at one grid barrier, takes an equal
// span of the down product's chunks, and the last block to finish a column chunk of the output sums
// its routes in j order and adds the shared expert and the residual.
//
// Rounding is the unfused decode path's: the gate/up sums rounded to bf16 before the activation,
// silu(gate) * up in float32 to bf16, each route's down output to bf16, the router-weighted sum as
// unpermute's (acc = acc + f32(w * y), j ascending, to bf16), then each add as XLA's bf16 adds. Only
// the order of each dot product's float32 sums differs. Deterministic (fixed orders throughout),
// no allocation, no host sync: command buffer safe. A cooperative launch: every block resident.
#ifndef JAX_MOE_DECODE_LAYER_H_
#define JAX_MOE_DECODE_LAYER_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_moe {

struct DecodeLayerArgs {
  const void* x;              // [T, H] bf16: the normalised tokens the experts read
  const void* residual;       // [T, H] bf16: the layer's input, added to its output
  const int32_t* topk_ids;    // [T, k]: ids outside [0, E) are dropped routes
  const float* topk_weights;  // [T, k]
  const void* gate_up;        // [E, H, 2F] bf16, gate columns first
  const void* down;           // [E, F, H] bf16
  // Optional (shared_gate_up non-null): the shared expert, one more group owning every token.
  const void* shared_gate_up = nullptr;  // [H, 2Fs] bf16
  const void* shared_down = nullptr;     // [Fs, H] bf16
  const void* shared_gate = nullptr;     // [H] bf16, or null: an ungated shared expert
  void* hidden;               // [T * k + T, max(F, Fs)] bf16 temporary: silu(gate) * up per row
  void* rows_out;             // [T * k + T, H] bf16 temporary: each row's down product
  float* gate_logits;         // [T] float32 temporary (gated shared expert)
  void* out;                  // [T, H] bf16; may be residual's buffer
  int32_t* counters;          // kDecodeLayerCounterWords words, zero between calls (left zero)
  int64_t num_tokens, top_k, num_experts, hidden_size, ffn, shared_ffn = 0;
  bool prefetch_down = true;  // the down weights' first steps to L2 before the grid barrier
};

// Words of counters the kernel keeps between launches (all zero when it returns): a grid barrier's
// two, then one arrival count per 16-column chunk of H.
constexpr int64_t kDecodeLayerCounterWords = 1032;
constexpr int64_t kDecodeLayerMaxTokens = 8;
constexpr int64_t kDecodeLayerMaxRoutes = 256;

// Whether the kernel takes these sizes: bf16, T <= kDecodeLayerMaxTokens, T * k <= 256, H, F and Fs
// multiples of 16, H / 16 counters within kDecodeLayerCounterWords.
bool DecodeLayerFits(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t ffn,
                     int64_t shared_ffn);

cudaError_t LaunchDecodeLayer(const DecodeLayerArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_DECODE_LAYER_H_
