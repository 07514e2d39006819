// The SwiGLU backward's elementwise kernel (swiglu_kernels.h): one warp per row, each lane taking
// 8 consecutive columns (16-byte loads and stores) at a time.
#include <cuda_bf16.h>

#include <cstdint>

#include "bf16_vector.cuh"
#include "swiglu_kernels.h"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

__device__ __forceinline__ float RoundToBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <bool kWeighted>
__global__ void __launch_bounds__(kThreads) SwigluBackwardKernel(SwigluBackwardArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t vectors = a.ffn / 8;
  const __nv_bfloat16* hidden_base = static_cast<const __nv_bfloat16*>(a.hidden);
  if (a.hidden_layer != nullptr) {
    const int64_t layer = min(max(static_cast<int64_t>(*a.hidden_layer), int64_t{0}), a.hidden_layers - 1);
    hidden_base += layer * a.hidden_layer_elements + a.hidden_offset;
  }
  const uint4* hidden = reinterpret_cast<const uint4*>(hidden_base) + row * 2 * vectors;
  const uint4* d_activated = static_cast<const uint4*>(a.d_activated) + row * vectors;
  uint4* activated = static_cast<uint4*>(a.activated) + row * vectors;
  uint4* d_hidden = static_cast<uint4*>(a.d_hidden) + row * 2 * vectors;
  const float w = kWeighted ? a.row_weights[row] : 1.0f;
  float sum = 0.0f;
  for (int64_t v = lane; v < vectors; v += 32) {
    float gate[8], up[8], d_act[8], act[8], d_gate[8], d_up[8];
    Unpack(hidden[v], gate);
    Unpack(hidden[vectors + v], up);
    Unpack(d_activated[v], d_act);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      // Products and sums rounded one by one (no FMA), in the order the float32 JAX code writes.
      const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate[i])));
      const float silu = __fmul_rn(gate[i], sig);
      act[i] = RoundToBf16(__fmul_rn(silu, up[i]));
      const float d = kWeighted ? __fmul_rn(d_act[i], w) : d_act[i];
      if (kWeighted) {
        sum = __fadd_rn(sum, __fmul_rn(act[i], d_act[i]));
        act[i] = __fmul_rn(act[i], w);
      }
      d_gate[i] = __fmul_rn(__fmul_rn(__fmul_rn(d, up[i]), sig),
                            __fadd_rn(1.0f, __fmul_rn(gate[i], __fsub_rn(1.0f, sig))));
      d_up[i] = __fmul_rn(d, silu);
    }
    activated[v] = Pack(act);
    d_hidden[v] = Pack(d_gate);
    d_hidden[vectors + v] = Pack(d_up);
  }
  if (kWeighted) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, d));
    if (lane == 0) a.d_row_weights[row] = sum;
  }
}

}  // namespace

cudaError_t LaunchSwigluBackward(const SwigluBackwardArgs& args, cudaStream_t stream) {
  if (args.ffn < 8 || args.ffn % 8 != 0 || args.rows < 0) return cudaErrorInvalidValue;
  if (args.hidden_layer != nullptr && !HiddenSliceFits(args)) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  const int64_t blocks = (args.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (args.row_weights != nullptr)
    SwigluBackwardKernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  else
    SwigluBackwardKernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_moe
