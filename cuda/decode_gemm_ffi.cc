// The bf16 decode GEMM's CUDA handlers (decode_gemm_kernels.h): decode_matmul, with or without a
// shared expert's product in the same launch.
#include <cuda_runtime.h>

#include "cuda_ffi_common.h"
#include "decode_gemm_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

// The decode grouped GEMM of decode_gemm_kernels.h: rows [R, K], weights [El, K, N] bf16, expert_offsets
// [El + 1]; out [<= R, N], or [<= R, N / 2] = silu(gate) * up when gated (N = 2F, gate first).
ffi::Error DecodeMatmulArgs(ffi::AnyBuffer rows, ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> expert_offsets,
                            ffi::AnyBuffer out, bool gated, int64_t rows_per_pass, DecodeGemmArgs* args) {
  const auto rd = rows.dimensions();
  const auto wd = weights.dimensions();
  const auto od = out.dimensions();
  if (rows.element_type() != ffi::BF16 || weights.element_type() != ffi::BF16 || out.element_type() != ffi::BF16)
    return InvalidArgument("decode_matmul: expected bf16 rows, weights and out");
  if (rd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[1] != rd[1] || od[0] > rd[0] ||
      od[1] != (gated ? wd[2] / 2 : wd[2]) || static_cast<int64_t>(expert_offsets.element_count()) != wd[0] + 1)
    return InvalidArgument("decode_matmul: expected rows [R, K], weights [El, K, N], expert_offsets [El + 1] "
                           "and out [<= R, N] ([<= R, N / 2] when gated)");
  if (rd[1] % 8 != 0 || wd[2] % (gated ? 16 : 8) != 0)
    return InvalidArgument("decode_matmul: K and N (N / 2 when gated) must be multiples of 8");
  if (rows_per_pass != 1 && rows_per_pass != 2 && rows_per_pass != 4 && rows_per_pass != 8)
    return InvalidArgument("decode_matmul: rows_per_pass must be 1, 2, 4 or 8");
  args->rows = rows.untyped_data();
  args->weights = weights.untyped_data();
  args->expert_offsets = expert_offsets.typed_data();
  args->out = out.untyped_data();
  args->out_rows = od[0];
  args->num_groups = wd[0], args->k = wd[1], args->n = wd[2];
  args->gated = gated;
  args->rows_per_pass = static_cast<int>(rows_per_pass);
  return ffi::Error::Success();
}

ffi::Error DecodeMatmulImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                            ffi::Buffer<ffi::S32> expert_offsets, ffi::Result<ffi::AnyBuffer> out, bool gated,
                            int64_t rows_per_pass) {
  DecodeGemmArgs args;
  ffi::Error error = DecodeMatmulArgs(rows, weights, expert_offsets, *out, gated, rows_per_pass, &args);
  if (error.failure()) return error;
  return CudaStatus(LaunchDecodeGemm(args, stream), "jax_moe decode_matmul");
}

// The decode grouped GEMM with a dense product in the same launch (decode_gemm_kernels.h's shared_*):
// as DecodeMatmulImpl, and shared_out [T, Ns] (or [T, Ns / 2] gated) = shared_x [T, Ks] @
// shared_weights [Ks, Ns], bf16.
ffi::Error DecodeMatmulSharedImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                                  ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer shared_x,
                                  ffi::AnyBuffer shared_weights, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> shared_out, bool gated, int64_t rows_per_pass) {
  DecodeGemmArgs args;
  ffi::Error error = DecodeMatmulArgs(rows, weights, expert_offsets, *out, gated, rows_per_pass, &args);
  if (error.failure()) return error;
  const auto xd = shared_x.dimensions();
  const auto wd = shared_weights.dimensions();
  const auto od = shared_out->dimensions();
  if (shared_x.element_type() != ffi::BF16 || shared_weights.element_type() != ffi::BF16 ||
      shared_out->element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 2 || od.size() != 2 ||
      xd[0] < 1 || wd[0] != xd[1] || od[0] != xd[0] || od[1] != (gated ? wd[1] / 2 : wd[1]) || xd[1] % 8 != 0 ||
      wd[1] % (gated ? 16 : 8) != 0)
    return InvalidArgument("decode_matmul_shared: expected bf16 shared_x [T >= 1, Ks], shared_weights [Ks, Ns] and "
                           "shared_out [T, Ns] ([T, Ns / 2] when gated), Ks and Ns (Ns / 2 gated) multiples of 8");
  args.shared_x = shared_x.untyped_data();
  args.shared_weights = shared_weights.untyped_data();
  args.shared_out = shared_out->untyped_data();
  args.shared_rows = xd[0], args.shared_k = wd[0], args.shared_n = wd[1];
  return CudaStatus(LaunchDecodeGemm(args, stream), "jax_moe decode_matmul_shared");
}

}  // namespace
}  // namespace jax_moe

// The decode GEMM's routed operands, shared by its two handlers.
static auto BindDecodeMatmulOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()          // rows [R, K], bf16
      .Arg<ffi::AnyBuffer>()          // weights [El, K, N], bf16
      .Arg<ffi::Buffer<ffi::S32>>();  // expert_offsets [El + 1]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeMatmulCuda, jax_moe::DecodeMatmulImpl,
                              BindDecodeMatmulOperands()
                                  .Ret<ffi::AnyBuffer>()               // out, bf16
                                  .Attr<bool>("gated")                 // silu(gate) * up epilogue
                                  .Attr<int64_t>("rows_per_pass"),     // 1, 2, 4 or 8
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeDecodeMatmulSharedCuda, jax_moe::DecodeMatmulSharedImpl,
                              BindDecodeMatmulOperands()
                                  .Arg<ffi::AnyBuffer>()               // shared_x [T, Ks], bf16
                                  .Arg<ffi::AnyBuffer>()               // shared_weights [Ks, Ns], bf16
                                  .Ret<ffi::AnyBuffer>()               // out, bf16
                                  .Ret<ffi::AnyBuffer>()               // shared_out, bf16
                                  .Attr<bool>("gated")                 // silu(gate) * up epilogue
                                  .Attr<int64_t>("rows_per_pass"),     // 1, 2, 4 or 8
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

FfiTargets DecodeGemmCudaTargets() {
  return {
      {"jax_moe_decode_matmul", JaxMoeDecodeMatmulCuda},
      {"jax_moe_decode_matmul_shared", JaxMoeDecodeMatmulSharedCuda},
  };
}

}  // namespace jax_moe
