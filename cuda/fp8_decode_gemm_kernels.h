// The FP8 decode grouped GEMM: decode_gemm_kernels.h's idea (few rows per expert, every active
// expert's weights streamed from HBM once by all SMs) for FP8 SwiGLU experts, on FP8 tensor cores.
#ifndef JAX_MOE_FP8_DECODE_GEMM_KERNELS_H_
#define JAX_MOE_FP8_DECODE_GEMM_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "constants.h"

namespace jax_moe {

// FP8 SwiGLU experts at decode: the FP8 grouped GEMM's math (fp8_gemm_kernels.h: rows quantised
// per 1 x 128 group, block-scaled e4m3 weights [El, out, in], float32 partial sums scaled per
// 128-deep K block) in two launches that stream each active expert's FP8 weights once over all
// SMs: gate/up with SwiGLU's activation in its epilogue (activation [out_rows, F] bf16, the CUTLASS
// path's rounding: gate and up to bf16, silu(gate) * up in float32 to bf16), then down. Each block
// quantises its expert's rows into shared memory (the bytes of LaunchQuantizeRows) and feeds them
// with the weights to mma.sync's m16n8k32 e4m3 product: weights as the 16-row A operand, up to
// rows_per_pass rows as the B operand. No workspace, deterministic, rows in no group come out zero.
// A shared expert (shared_gate_up non-null) streams in the same two launches as one more group
// owning every row of shared_x; such launches run the register-streaming kernel
// (fp8_decode_gemm_kernels.cu), the same bits as the ring kernel that launches of routed experts
// alone run.
struct Fp8DecodeSwigluArgs {
  const void* rows;               // [>= out_rows, H] bf16, grouped by expert
  const void* gate_up;            // [El, 2F, H] float8_e4m3fn
  const float* gate_up_scale;     // [El, 2F / 128, H / 128]
  const void* down;               // [El, H, F] float8_e4m3fn
  const float* down_scale;        // [El, H / 128, F / 128]
  const int32_t* expert_offsets;  // [El + 1]
  void* activation;               // [out_rows, F] bf16 (a temporary the down product reads)
  void* out;                      // [out_rows, H] bf16
  int64_t out_rows, num_groups, hidden, ffn;  // H and F multiples of 128, at most kFp8DecodeMaxK
  int rows_per_pass;                          // 8 or 16: rows of an expert per pass over its weights
  int64_t group_rows;                         // the most rows one expert can own; 0: unknown
  // Optional (shared_gate_up non-null): a shared expert's FP8 SwiGLU on shared_x in the same two
  // launches, as one more group owning every row of shared_x (the same math as a call of its own).
  const void* shared_x = nullptr;              // [shared_count, H] bf16
  const void* shared_gate_up = nullptr;        // [2Fs, H] float8_e4m3fn
  const float* shared_gate_up_scale = nullptr; // [2Fs / 128, H / 128]
  const void* shared_down = nullptr;           // [H, Fs] float8_e4m3fn
  const float* shared_down_scale = nullptr;    // [H / 128, Fs / 128]
  void* shared_activation = nullptr;           // [shared_count, Fs] bf16 (a temporary)
  void* shared_out = nullptr;                  // [shared_count, H] bf16
  int64_t shared_count = 0, shared_ffn = 0;    // shared_count from 1 to kFp8DecodeMaxSharedRows, Fs a multiple of 128
};

cudaError_t LaunchFp8DecodeSwiglu(const Fp8DecodeSwigluArgs& args, cudaStream_t stream);

}  // namespace jax_moe

#endif  // JAX_MOE_FP8_DECODE_GEMM_KERNELS_H_
