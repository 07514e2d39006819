// The FP8 decode GEMM's CUDA handlers (fp8_decode_gemm_kernels.h): the SwiGLU experts at decode,
// with or without a shared expert riding in the same two launches.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_ffi_common.h"
#include "fp8_decode_gemm_kernels.h"
#include "fp8_swiglu_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

// The routed operands' checks and arguments of both FP8 decode handlers.
static ffi::ErrorOr<Fp8DecodeSwigluArgs> Fp8DecodeSwigluRouted(const char* op, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                                               ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                                               ffi::Buffer<ffi::F32> down_scale,
                                                               ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer& out,
                                                               ffi::AnyBuffer& activation, int64_t rows_per_pass,
                                                               int64_t group_rows) {
  const auto sizes = CheckFp8Swiglu(op, rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, out);
  if (sizes.has_error()) return ffi::Unexpected(sizes.error());
  const int64_t groups = sizes->groups, h = sizes->h, f = sizes->f, out_rows = sizes->out_rows;
  const std::string name(op);
  if (h > kFp8DecodeMaxK || f > kFp8DecodeMaxK)
    return ffi::Unexpected(InvalidArgument(name + ": expected H and F up to 16384 (the rows are staged in shared memory)"));
  if (activation.element_type() != ffi::BF16 || static_cast<int64_t>(activation.element_count()) != out_rows * f)
    return ffi::Unexpected(InvalidArgument(name + ": expected activation [out_rows, F] bf16"));
  if (rows_per_pass != 8 && rows_per_pass != 16) return ffi::Unexpected(InvalidArgument(name + ": rows_per_pass must be 8 or 16"));
  if (group_rows < 0) return ffi::Unexpected(InvalidArgument(name + ": group_rows must be at least 0 (0: unknown)"));
  Fp8DecodeSwigluArgs args;
  args.rows = rows.untyped_data();
  args.gate_up = gate_up.untyped_data();
  args.gate_up_scale = gate_up_scale.typed_data();
  args.down = down.untyped_data();
  args.down_scale = down_scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.activation = activation.untyped_data();
  args.out = out.untyped_data();
  args.out_rows = out_rows, args.num_groups = groups, args.hidden = h, args.ffn = f;
  args.rows_per_pass = static_cast<int>(rows_per_pass);
  args.group_rows = group_rows;
  return args;
}

// FP8 SwiGLU experts at decode (fp8_decode_gemm_kernels.h): the same operands and math as
// Fp8SwigluExpertsImpl (fp8_gemm_ffi.cc) in two launches with no workspace; activation [out_rows, F]
// bf16 is the call's temporary (silu(gate) * up, read by the down product).
ffi::Error Fp8DecodeSwigluImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                               ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                               ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> activation,
                               int64_t rows_per_pass, int64_t group_rows) {
  const auto args = Fp8DecodeSwigluRouted("fp8_decode_swiglu", rows, gate_up, gate_up_scale, down, down_scale,
                                          expert_offsets, *out, *activation, rows_per_pass, group_rows);
  if (args.has_error()) return args.error();
  return CudaStatus(LaunchFp8DecodeSwiglu(*args, stream), "fp8_decode_swiglu");
}

// The same with a shared expert's FP8 SwiGLU on x [T, H] in the same two launches: shared_gate_up
// [2Fs, H], shared_down [H, Fs] and their scales; results shared_out [T, H] and the temporary
// shared_activation [T, Fs], both bf16.
ffi::Error Fp8DecodeSwigluSharedImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                     ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                     ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                                     ffi::AnyBuffer x, ffi::AnyBuffer shared_gate_up,
                                     ffi::Buffer<ffi::F32> shared_gate_up_scale, ffi::AnyBuffer shared_down,
                                     ffi::Buffer<ffi::F32> shared_down_scale, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> activation, ffi::Result<ffi::AnyBuffer> shared_out,
                                     ffi::Result<ffi::AnyBuffer> shared_activation, int64_t rows_per_pass,
                                     int64_t group_rows) {
  const char* op = "fp8_decode_swiglu_shared";
  auto args = Fp8DecodeSwigluRouted(op, rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, *out,
                                    *activation, rows_per_pass, group_rows);
  if (args.has_error()) return args.error();
  const int64_t h = args->hidden;
  const auto xd = x.dimensions(), gd = shared_gate_up.dimensions(), dd = shared_down.dimensions();
  const auto od = shared_out->dimensions(), ad = shared_activation->dimensions();
  if (xd.size() != 2 || gd.size() != 2 || dd.size() != 2 || od.size() != 2 || ad.size() != 2 ||
      x.element_type() != ffi::BF16 || shared_gate_up.element_type() != ffi::F8E4M3FN ||
      shared_down.element_type() != ffi::F8E4M3FN || shared_out->element_type() != ffi::BF16 ||
      shared_activation->element_type() != ffi::BF16)
    return InvalidArgument(std::string(op) + ": expected bf16 x, float8_e4m3fn shared weights, bf16 results");
  const int64_t t = xd[0], fs = gd[0] / 2;
  if (xd[1] != h || gd[0] != 2 * fs || gd[1] != h || dd[0] != h || dd[1] != fs || fs % 128 != 0 || fs < 128 ||
      fs > kFp8DecodeMaxK || t < 1 || t > kFp8DecodeMaxSharedRows || od[0] != t || od[1] != h || ad[0] != t || ad[1] != fs ||
      static_cast<int64_t>(shared_gate_up_scale.element_count()) != (2 * fs / 128) * (h / 128) ||
      static_cast<int64_t>(shared_down_scale.element_count()) != (h / 128) * (fs / 128))
    return InvalidArgument(std::string(op) + ": expected x [T, H] (T from 1 to 16), shared_gate_up [2Fs, H] and "
                           "shared_down [H, Fs] with their [out / 128, in / 128] scales (Fs a multiple of 128 up "
                           "to 16384), shared_out [T, H], shared_activation [T, Fs]");
  args->shared_x = x.untyped_data();
  args->shared_gate_up = shared_gate_up.untyped_data();
  args->shared_gate_up_scale = shared_gate_up_scale.typed_data();
  args->shared_down = shared_down.untyped_data();
  args->shared_down_scale = shared_down_scale.typed_data();
  args->shared_out = shared_out->untyped_data();
  args->shared_activation = shared_activation->untyped_data();
  args->shared_count = t, args->shared_ffn = fs;
  return CudaStatus(LaunchFp8DecodeSwiglu(*args, stream), op);
}

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8DecodeSwigluCuda, jax_moe::Fp8DecodeSwigluImpl,
                              jax_moe::BindFp8SwigluOperands()
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // activation [out_rows, F] bf16 (temporary)
                                  .Attr<int64_t>("rows_per_pass")      // 8 or 16
                                  .Attr<int64_t>("group_rows"),        // most rows an expert owns; 0: unknown
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8DecodeSwigluSharedCuda, jax_moe::Fp8DecodeSwigluSharedImpl,
                              jax_moe::BindFp8SwigluOperands()
                                  .Arg<ffi::AnyBuffer>()               // x [T, H], bf16
                                  .Arg<ffi::AnyBuffer>()               // shared_gate_up [2Fs, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // shared_gate_up_scale [2Fs / 128, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // shared_down [H, Fs], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // shared_down_scale [H / 128, Fs / 128]
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // activation [out_rows, F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // shared_out [T, H], bf16
                                  .Ret<ffi::AnyBuffer>()               // shared_activation [T, Fs] bf16 (temporary)
                                  .Attr<int64_t>("rows_per_pass")
                                  .Attr<int64_t>("group_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

FfiTargets Fp8DecodeGemmCudaTargets() {
  return {
      {"jax_moe_fp8_decode_swiglu", JaxMoeFp8DecodeSwigluCuda},
      {"jax_moe_fp8_decode_swiglu_shared", JaxMoeFp8DecodeSwigluSharedCuda},
  };
}

}  // namespace jax_moe
