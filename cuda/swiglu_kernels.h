// The SwiGLU experts' elementwise backward, between the grouped GEMMs of the training step's
// backward (jax_moe.gemm.swiglu_backward). Per row r of the gate/up product hidden [R, 2F] =
// [gate | up] and the activation's cotangent d_act [R, F] (the down projection's input gradient):
//   act[r]          = bf16(silu(gate) * up)                         (the forward's rounding)
//   activated[r]    = bf16(act * w[r])                              (w[r] = 1 without row weights)
//   d_hidden[r]     = bf16([d * up * sig * (1 + gate * (1 - sig)) | d * silu(gate)]), d = d_act * w[r]
//   d_row_weight[r] = sum over f of act[f] * d_act[f]               (with row weights only)
// in float32 from the bf16 inputs. One pass over the inputs, where XLA's fusions of the same math
// read them three times. Deterministic: each row's sum runs in a fixed order. In place allowed:
// activated may be d_activated and d_hidden may be hidden (each thread reads its vectors first).
// hidden may also be read from a slice of a stack chosen on the device (the training loop's saved
// activations, kept inside the gate/up gradient's buffer): no copy of it out first.
#ifndef JAX_MOE_SWIGLU_KERNELS_H_
#define JAX_MOE_SWIGLU_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_moe {

struct SwigluBackwardArgs {
  const void* hidden;           // [R, 2F] bf16, or a stack holding it (hidden_layer below)
  const void* d_activated;      // [R, F] bf16
  const float* row_weights;     // [R], or nullptr
  void* activated;              // [R, F] bf16
  void* d_hidden;               // [R, 2F] bf16
  float* d_row_weights;         // [R] when row_weights is given, else unused
  int64_t rows, ffn;            // R and F (a multiple of 8)
  // Null, or hidden is a stack [hidden_layers, hidden_layer_elements] and the [R, 2F] product sits
  // flattened at element hidden_offset (a multiple of 8) of slice *hidden_layer (read on the
  // device, clamped). The caller checks that it fits in a slice.
  const int32_t* hidden_layer = nullptr;
  int64_t hidden_layers = 1, hidden_layer_elements = 0, hidden_offset = 0;
};

// Whether hidden read from a stack (hidden_layer set) fits in one slice at hidden_offset, 16-byte
// aligned (the FFI handler and the launcher check it).
inline bool HiddenSliceFits(const SwigluBackwardArgs& a) {
  return a.hidden_layers >= 1 && a.hidden_offset >= 0 && a.hidden_offset % 8 == 0 &&
         a.hidden_layer_elements % 8 == 0 && a.hidden_offset + a.rows * 2 * a.ffn <= a.hidden_layer_elements;
}

cudaError_t LaunchSwigluBackward(const SwigluBackwardArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_SWIGLU_KERNELS_H_
