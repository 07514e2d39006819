// Bit-exact float16/bfloat16 <-> float32 conversions for host code (round to nearest even),
// so the CPU handlers round exactly as the contract and the CUDA intrinsics do; and the IEEE
// subnormal mode their float32 arithmetic runs in.
#ifndef JAX_MOE_FLOAT_BITS_H_
#define JAX_MOE_FLOAT_BITS_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace jax_moe {

inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(sign | FloatToBits(magnitude));
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t FloatToF16(float f) {
  uint32_t u = FloatToBits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (143u << 23)) {  // |f| >= 65536, inf or NaN
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // below the smallest normal half: let the FPU round
    const uint32_t magic = 126u << 23;  // 0.5f: aligns the half subnormal ulp at float's ulp
    out = FloatToBits(BitsToFloat(u) + BitsToFloat(magic)) - magic;
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = u >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

// XLA:CPU runs custom calls with flush-to-zero / denormals-are-zero set; the contract's float32
// arithmetic (and the CUDA kernels) keep subnormals, so clear those modes for the sum.
class IeeeSubnormals {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  IeeeSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero)); }
  ~IeeeSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeSubnormals() {
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~(uint64_t{1} << 24);  // FZ
    __asm__ volatile("msr fpcr, %0" : : "r"(ieee));
  }
  ~IeeeSubnormals() { __asm__ volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

}  // namespace jax_moe

#endif  // JAX_MOE_FLOAT_BITS_H_
