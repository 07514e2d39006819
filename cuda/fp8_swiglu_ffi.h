// What the two FP8 SwiGLU experts families' CUDA handlers share (fp8_gemm_ffi.cc: CUTLASS, any rows;
// fp8_decode_gemm_ffi.cc: the decode kernel): their leading operands, bound and checked once.
#ifndef JAX_MOE_FP8_SWIGLU_FFI_H_
#define JAX_MOE_FP8_SWIGLU_FFI_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {

// The operands of an FP8 SwiGLU experts call: rows [R, H] bf16, gate_up [El, 2F, H] and down
// [El, H, F] float8_e4m3fn with float32 scales [El, 2F / 128, H / 128] and [El, H / 128, F / 128],
// expert_offsets [El + 1], out [out_rows <= R, H] bf16, H and F multiples of 128. Their sizes, or
// an error naming `op`.
struct Fp8SwigluSizes {
  int64_t groups, h, f, out_rows;
};

inline xla::ffi::ErrorOr<Fp8SwigluSizes> CheckFp8Swiglu(
    const char* op, const xla::ffi::AnyBuffer& rows, const xla::ffi::AnyBuffer& gate_up,
    const xla::ffi::Buffer<xla::ffi::F32>& gate_up_scale, const xla::ffi::AnyBuffer& down,
    const xla::ffi::Buffer<xla::ffi::F32>& down_scale, const xla::ffi::Buffer<xla::ffi::S32>& expert_offsets,
    const xla::ffi::AnyBuffer& out, xla::ffi::DataType rows_type = xla::ffi::BF16) {
  namespace ffi = xla::ffi;
  const auto rd = rows.dimensions();
  const auto gd = gate_up.dimensions();
  const auto dd = down.dimensions();
  const auto od = out.dimensions();
  if (rd.size() != 2 || gd.size() != 3 || dd.size() != 3 || od.size() != 2 || rows.element_type() != rows_type ||
      gate_up.element_type() != ffi::F8E4M3FN || down.element_type() != ffi::F8E4M3FN ||
      out.element_type() != ffi::BF16)
    return ffi::Unexpected(InvalidArgument(std::string(op) + ": expected " +
                                           (rows_type == ffi::BF16 ? "bf16" : "float8_e4m3fn") +
                                           " rows, float8_e4m3fn experts, bf16 out"));
  const int64_t groups = gd[0], h = rd[1], f2 = gd[1], f = f2 / 2, out_rows = od[0];
  if (f2 != 2 * f || gd[2] != h || dd[0] != groups || dd[1] != h || dd[2] != f || od[1] != h || out_rows > rd[0] ||
      h % 128 != 0 || f % 128 != 0 ||
      static_cast<int64_t>(gate_up_scale.element_count()) != groups * (f2 / 128) * (h / 128) ||
      static_cast<int64_t>(down_scale.element_count()) != groups * (h / 128) * (f / 128) ||
      static_cast<int64_t>(expert_offsets.element_count()) != groups + 1)
    return ffi::Unexpected(InvalidArgument(std::string(op) + ": expected rows [R, H], gate_up [El, 2F, H] and down "
                                           "[El, H, F] with their [.., out / 128, in / 128] scales, H and F "
                                           "multiples of 128, out [<= R, H]"));
  return Fp8SwigluSizes{groups, h, f, out_rows};
}

// The operands both FP8 SwiGLU experts calls begin with (CheckFp8Swiglu).
inline auto BindFp8SwigluOperands() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // rows [R, H], bf16
      .Arg<ffi::AnyBuffer>()          // gate_up [El, 2F, H], float8_e4m3fn
      .Arg<ffi::Buffer<ffi::F32>>()   // gate_up_scale [El, 2F / 128, H / 128]
      .Arg<ffi::AnyBuffer>()          // down [El, H, F], float8_e4m3fn
      .Arg<ffi::Buffer<ffi::F32>>()   // down_scale [El, H / 128, F / 128]
      .Arg<ffi::Buffer<ffi::S32>>();  // expert_offsets [El + 1]
}

}  // namespace jax_moe

#endif  // JAX_MOE_FP8_SWIGLU_FFI_H_
