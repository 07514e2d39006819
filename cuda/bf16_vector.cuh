// Eight bf16 values in one 16-byte vector (a uint4) to float32 and back, and streaming loads of
// one (or of 16 FP8 bytes), for device code that loads and stores rows 16 bytes at a time.
#ifndef JAX_MOE_BF16_VECTOR_CUH_
#define JAX_MOE_BF16_VECTOR_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace jax_moe {

// Exact: the low half of each 32-bit word is the lower-indexed element.
__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Each value rounded to bf16 (nearest even).
__device__ __forceinline__ uint4 Pack(const float (&f)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // .x is the low half
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Eight bf16 values read once per call (weights streamed from HBM): a read-only load that does
// not allocate in L1, so the data every lane rereads (the rows) stays there.
__device__ __forceinline__ uint4 LoadStreaming(const __nv_bfloat16* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Sixteen bytes read once per call (FP8 weights streamed from HBM), the same load as volatile: it
// stays where it is written, so loads issued ahead of their use (the FP8 decode kernel's
// register-streaming segment) are not sunk towards it.
__device__ __forceinline__ uint4 LoadStreamingBytes(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// An L2 policy for weights a kernel reads once: evict-first, so their lines leave L2 before what the
// small launches around a decode layer read again (tokens, permuted rows, the scratch's offsets).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// LoadStreaming and LoadStreamingBytes under an L2 policy (EvictFirstPolicy).
__device__ __forceinline__ uint4 LoadStreaming(const __nv_bfloat16* p, uint64_t policy) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(policy));
  return v;
}
__device__ __forceinline__ uint4 LoadStreamingBytes(const uint8_t* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

}  // namespace jax_moe

#endif  // JAX_MOE_BF16_VECTOR_CUH_
