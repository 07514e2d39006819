// One 1 x 128 group's quantisation to float8_e4m3fn, for device code that quantises rows on the
// fly (the FP8 grouped GEMM's QuantizeRows, the FP8 decode kernel's staging of its rows).
#ifndef JAX_MOE_FP8_QUANTIZE_CUH_
#define JAX_MOE_FP8_QUANTIZE_CUH_

#include <cuda_fp8.h>

#include <cstdint>

namespace jax_moe {

// Half a warp per 1 x 128 group: each of 16 consecutive lanes holds 8 of its values in v, and
// every lane of the warp must reach the shuffles (lanes with no group pass zeros). Returns the
// group's scale and this lane's 8 quantised values in `packed`. The math is
// jax_moe.fp8.quantize_rows' in IEEE float32 (no FMA, no approximate division), so the bytes equal
// the CPU's: scale = max|x| * (1 / 448) (1 for an all-zero group), q = rne_satfinite(x * (1 / scale)).
__device__ __forceinline__ float QuantizeGroupPiece(const float (&v)[8], uint2* packed) {
  constexpr float kInvFp8Max = 1.0f / 448.0f;
  float most = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) most = fmaxf(most, fabsf(v[i]));
#pragma unroll
  for (int d = 8; d > 0; d >>= 1) most = fmaxf(most, __shfl_xor_sync(~0u, most, d));
  const float s = most > 0.0f ? __fmul_rn(most, kInvFp8Max) : 1.0f;
  const float inv = __fdiv_rn(1.0f, s);
  uint32_t words[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(__fmul_rn(v[2 * i], inv), __fmul_rn(v[2 * i + 1], inv));
    words[i / 2] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3)) << (16 * (i % 2));
  }
  *packed = make_uint2(words[0], words[1]);
  return s;
}

}  // namespace jax_moe

#endif  // JAX_MOE_FP8_QUANTIZE_CUH_
