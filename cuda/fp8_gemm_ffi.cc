// The FP8 grouped GEMM's CUDA handlers (fp8_gemm_kernels.h): fp8_grouped_matmul, and the SwiGLU
// experts in one call on rows in bf16 or already quantised. The CPU twin of the product is
// grouped_gemm_cpu.cc (fp8_grouped_dot).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_ffi_common.h"
#include "fp8_gemm_kernels.h"
#include "fp8_swiglu_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

// The FP8 grouped GEMM (fp8_gemm_kernels.h). rows [R, K] bf16 are
// quantised per 1 x 128 group into the q_rows / row_scale results (temporaries of the call), then
// multiplied with weights [El, N, K] float8_e4m3fn and their scales [El, N / 128, K / 128].
ffi::Error Fp8GroupedMatmulImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer weights,
                                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> expert_offsets,
                                ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> q_rows,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_scale, int64_t tile_rows) {
  const auto rd = rows.dimensions();
  const auto wd = weights.dimensions();
  const auto od = out->dimensions();
  if (rd.size() != 2 || wd.size() != 3 || od.size() != 2 || rows.element_type() != ffi::BF16 ||
      weights.element_type() != ffi::F8E4M3FN || out->element_type() != ffi::BF16 || wd[2] != rd[1] ||
      od[1] != wd[1] || od[0] > rd[0] || wd[1] % 128 != 0 || wd[2] % 128 != 0 ||
      static_cast<int64_t>(scale.element_count()) != wd[0] * (wd[1] / 128) * (wd[2] / 128) ||
      static_cast<int64_t>(expert_offsets.element_count()) != wd[0] + 1 ||
      static_cast<int64_t>(q_rows->element_count()) != od[0] * rd[1] ||
      static_cast<int64_t>(row_scale->element_count()) != od[0] * (rd[1] / 128))
    return InvalidArgument("fp8_grouped_matmul: expected bf16 rows [R, K], float8_e4m3fn weights [El, N, K] with "
                           "float32 scales [El, N / 128, K / 128], K and N multiples of 128, out [<= R, N]");
  const int64_t out_rows = od[0], k = rd[1];
  cudaError_t status = LaunchQuantizeRows(rows.untyped_data(), q_rows->untyped_data(), row_scale->typed_data(),
                                          out_rows, k, stream);
  if (status != cudaSuccess) return CudaStatus(status, "fp8_grouped_matmul: quantize rows");
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  const uintptr_t aligned = (base + 127) / 128 * 128;
  Fp8GroupedGemmArgs args;
  args.a = q_rows->untyped_data();
  args.a_scale = row_scale->typed_data();
  args.b = weights.untyped_data();
  args.b_scale = scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.out = out->untyped_data();
  args.workspace = reinterpret_cast<void*>(aligned);
  args.workspace_bytes = workspace->size_bytes() > aligned - base ? workspace->size_bytes() - (aligned - base) : 0;
  args.out_rows = out_rows, args.num_groups = wd[0], args.k = k, args.n = wd[1];
  if (tile_rows != 64 && tile_rows != 128) return InvalidArgument("fp8_grouped_matmul: tile_rows must be 64 or 128");
  args.tile_rows = static_cast<int>(tile_rows);
  return CudaStatus(LaunchFp8GroupedGemm(args, stream), "fp8_grouped_matmul");
}

// The two FP8 GEMMs of Fp8SwigluExpertsImpl on rows already quantised (q_rows [R, H] float8_e4m3fn,
// row_scale [R, H / 128]): gate/up into hidden [R', 2F], SwiGLU's activation quantised
// (LaunchSwigluQuantize), down into out [R', H]; the GEMMs share the workspace.
ffi::Error RunFp8SwigluGemms(const char* op, cudaStream_t stream, const Fp8SwigluSizes& sizes, const void* q_rows,
                             const float* row_scale, ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> gate_up_scale,
                             ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                             ffi::Buffer<ffi::S32> expert_offsets, ffi::AnyBuffer& out, ffi::Buffer<ffi::S32>& workspace,
                             ffi::AnyBuffer& hidden, ffi::AnyBuffer& q_act, ffi::Buffer<ffi::F32>& act_scale,
                             int64_t tile_rows) {
  const int64_t h = sizes.h, f = sizes.f, out_rows = sizes.out_rows;
  if (hidden.element_type() != ffi::BF16 || static_cast<int64_t>(hidden.element_count()) != out_rows * 2 * f ||
      static_cast<int64_t>(q_act.element_count()) != out_rows * f ||
      static_cast<int64_t>(act_scale.element_count()) != out_rows * (f / 128))
    return InvalidArgument(std::string(op) + ": expected temporaries hidden [out_rows, 2F] bf16, q_act [out_rows, F], "
                           "act_scale [out_rows, F / 128]");
  if (tile_rows != 64 && tile_rows != 128) return InvalidArgument(std::string(op) + ": tile_rows must be 64 or 128");
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const uintptr_t aligned = (base + 127) / 128 * 128;
  Fp8GroupedGemmArgs args;
  args.a = q_rows;
  args.a_scale = row_scale;
  args.b = gate_up.untyped_data();
  args.b_scale = gate_up_scale.typed_data();
  args.expert_offsets = expert_offsets.typed_data();
  args.out = hidden.untyped_data();
  args.workspace = reinterpret_cast<void*>(aligned);
  args.workspace_bytes = workspace.size_bytes() > aligned - base ? workspace.size_bytes() - (aligned - base) : 0;
  args.out_rows = out_rows, args.num_groups = sizes.groups, args.k = h, args.n = 2 * f;
  args.tile_rows = static_cast<int>(tile_rows);
  cudaError_t status = LaunchFp8GroupedGemm(args, stream);
  if (status != cudaSuccess) return CudaStatus(status, std::string(op) + ": gate_up");
  status = LaunchSwigluQuantize(hidden.untyped_data(), q_act.untyped_data(), act_scale.typed_data(), out_rows, f, stream);
  if (status != cudaSuccess) return CudaStatus(status, std::string(op) + ": activation");
  args.a = q_act.untyped_data();
  args.a_scale = act_scale.typed_data();
  args.b = down.untyped_data();
  args.b_scale = down_scale.typed_data();
  args.out = out.untyped_data();
  args.k = f, args.n = h;
  return CudaStatus(LaunchFp8GroupedGemm(args, stream), std::string(op) + ": down");
}

// FP8 SwiGLU experts in one call (fp8_gemm_kernels.h): rows [R, H] bf16 quantised per 1 x 128
// group, then RunFp8SwigluGemms. The quantised rows, hidden and the quantised activation are
// results of the call (temporaries).
ffi::Error Fp8SwigluExpertsImpl(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate_up,
                                ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down,
                                ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> expert_offsets,
                                ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> workspace, ffi::Result<ffi::AnyBuffer> q_rows,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_scale, ffi::Result<ffi::AnyBuffer> hidden,
                                ffi::Result<ffi::AnyBuffer> q_act, ffi::Result<ffi::Buffer<ffi::F32>> act_scale,
                                int64_t tile_rows) {
  const auto sizes = CheckFp8Swiglu("fp8_swiglu_experts", rows, gate_up, gate_up_scale, down, down_scale,
                                    expert_offsets, *out);
  if (sizes.has_error()) return sizes.error();
  const int64_t h = sizes->h, out_rows = sizes->out_rows;
  if (static_cast<int64_t>(q_rows->element_count()) != out_rows * h ||
      static_cast<int64_t>(row_scale->element_count()) != out_rows * (h / 128))
    return InvalidArgument("fp8_swiglu_experts: expected temporaries q_rows [out_rows, H], row_scale "
                           "[out_rows, H / 128]");
  const cudaError_t status = LaunchQuantizeRows(rows.untyped_data(), q_rows->untyped_data(), row_scale->typed_data(),
                                                out_rows, h, stream);
  if (status != cudaSuccess) return CudaStatus(status, "fp8_swiglu_experts: quantize rows");
  return RunFp8SwigluGemms("fp8_swiglu_experts", stream, *sizes, q_rows->untyped_data(), row_scale->typed_data(),
                           gate_up, gate_up_scale, down, down_scale, expert_offsets, *out, *workspace, *hidden, *q_act,
                           *act_scale, tile_rows);
}

// Fp8SwigluExpertsImpl on rows quantised beforehand (permute_fp8): q_rows [R, H] float8_e4m3fn and
// row_scale [R, H / 128] are operands, not temporaries.
ffi::Error Fp8SwigluQuantizedExpertsImpl(cudaStream_t stream, ffi::AnyBuffer q_rows, ffi::Buffer<ffi::F32> row_scale,
                                         ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> gate_up_scale,
                                         ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                                         ffi::Buffer<ffi::S32> expert_offsets, ffi::Buffer<ffi::S32>,
                                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
                                         ffi::Result<ffi::AnyBuffer> hidden, ffi::Result<ffi::AnyBuffer> q_act,
                                         ffi::Result<ffi::Buffer<ffi::F32>> act_scale, int64_t tile_rows) {
  const char* op = "fp8_swiglu_quantized_experts";
  const auto sizes = CheckFp8Swiglu(op, q_rows, gate_up, gate_up_scale, down, down_scale, expert_offsets, *out,
                                    ffi::F8E4M3FN);
  if (sizes.has_error()) return sizes.error();
  if (static_cast<int64_t>(row_scale.element_count()) != q_rows.dimensions()[0] * (sizes->h / 128))
    return InvalidArgument(std::string(op) + ": expected row_scale [R, H / 128] beside q_rows [R, H]");
  return RunFp8SwigluGemms(op, stream, *sizes, q_rows.untyped_data(), row_scale.typed_data(), gate_up, gate_up_scale,
                           down, down_scale, expert_offsets, *out, *workspace, *hidden, *q_act, *act_scale, tile_rows);
}

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8GroupedMatmulCuda, jax_moe::Fp8GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // rows [R, K], bf16
                                  .Arg<ffi::AnyBuffer>()               // weights [El, N, K], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // scale [El, N / 128, K / 128]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, N], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // q_rows [out_rows, K] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // row_scale [out_rows, K / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8SwigluExpertsCuda, jax_moe::Fp8SwigluExpertsImpl,
                              jax_moe::BindFp8SwigluOperands()
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // q_rows [out_rows, H] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // row_scale [out_rows, H / 128] (temporary)
                                  .Ret<ffi::AnyBuffer>()               // hidden [out_rows, 2F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // q_act [out_rows, F] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // act_scale [out_rows, F / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeFp8SwigluQuantizedExpertsCuda, jax_moe::Fp8SwigluQuantizedExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // q_rows [R, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // row_scale [R, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // gate_up [El, 2F, H], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // gate_up_scale [El, 2F / 128, H / 128]
                                  .Arg<ffi::AnyBuffer>()               // down [El, H, F], float8_e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()        // down_scale [El, H / 128, F / 128]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // expert_offsets [El + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // workspace (aliased)
                                  .Ret<ffi::AnyBuffer>()               // out [out_rows, H], bf16
                                  .Ret<ffi::Buffer<ffi::S32>>()        // workspace
                                  .Ret<ffi::AnyBuffer>()               // hidden [out_rows, 2F] bf16 (temporary)
                                  .Ret<ffi::AnyBuffer>()               // q_act [out_rows, F] (temporary)
                                  .Ret<ffi::Buffer<ffi::F32>>()        // act_scale [out_rows, F / 128] (temporary)
                                  .Attr<int64_t>("tile_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

FfiTargets Fp8GemmCudaTargets() {
  return {
      {"jax_moe_fp8_grouped_matmul", JaxMoeFp8GroupedMatmulCuda},
      {"jax_moe_fp8_swiglu_experts", JaxMoeFp8SwigluExpertsCuda},
      {"jax_moe_fp8_swiglu_quantized_experts", JaxMoeFp8SwigluQuantizedExpertsCuda},
  };
}

}  // namespace jax_moe
