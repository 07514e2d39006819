// The optional module _jax_moe_bench (CMake: JAX_MOE_BENCH=ON): the benchmark suites' floor and
// ceiling, not part of the library. jax_moe_bench_noop is an empty call on a donated buffer;
// jax_moe_bench_copy a plain copy (cudaMemcpyAsync device to device on CUDA: the bandwidth
// ceiling). The CPU pair exists so the suites run, and are tested, everywhere. With
// JAX_MOE_BENCH_CUDA (a CUDA build) the CUDA pair is registered too.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

#if JAX_MOE_BENCH_CUDA
#include <cuda_runtime.h>

#include "cuda_ffi_common.h"
#endif

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

ffi::Error NoopCpu(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

ffi::Error CopyCpu(ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.size_bytes() != dst->size_bytes()) return InvalidArgument("copy: sizes differ");
  std::memcpy(dst->untyped_data(), src.untyped_data(), src.size_bytes());
  return ffi::Error::Success();
}

#if JAX_MOE_BENCH_CUDA
ffi::Error NoopCuda(cudaStream_t, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

ffi::Error CopyCuda(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst) {
  if (src.size_bytes() != dst->size_bytes()) return InvalidArgument("copy: sizes differ");
  return CudaStatus(cudaMemcpyAsync(dst->untyped_data(), src.untyped_data(), src.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream),
                    "jax_moe copy");
}
#endif

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeBenchNoopCpu, jax_moe::NoopCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()    // buffer (aliased)
                                  .Ret<ffi::AnyBuffer>());  // the same buffer, untouched

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeBenchCopyCpu, jax_moe::CopyCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()    // src
                                  .Ret<ffi::AnyBuffer>());  // dst, same shape and dtype

#if JAX_MOE_BENCH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeBenchNoopCuda, jax_moe::NoopCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // buffer (aliased)
                                  .Ret<ffi::AnyBuffer>(),  // the same buffer, untouched
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeBenchCopyCuda, jax_moe::CopyCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // src
                                  .Ret<ffi::AnyBuffer>(),  // dst, same shape and dtype
                              {ffi::Traits::kCmdBufferCompatible});
#endif

namespace {

pybind11::dict Targets(std::initializer_list<jax_moe::FfiTarget> targets) {
  pybind11::dict handlers;
  for (const jax_moe::FfiTarget& target : targets)
    handlers[target.name] = pybind11::capsule(reinterpret_cast<void*>(target.handler));
  return handlers;
}

}  // namespace

PYBIND11_MODULE(_jax_moe_bench, m) {
  m.doc() = "jax_moe benchmark FFI handlers (built with JAX_MOE_BENCH=ON)";
  m.def("registrations", [] {
    pybind11::dict platforms;
    platforms["cpu"] = Targets({{"jax_moe_bench_noop", JaxMoeBenchNoopCpu}, {"jax_moe_bench_copy", JaxMoeBenchCopyCpu}});
#if JAX_MOE_BENCH_CUDA
    platforms["CUDA"] = Targets({{"jax_moe_bench_noop", JaxMoeBenchNoopCuda}, {"jax_moe_bench_copy", JaxMoeBenchCopyCuda}});
#endif
    return platforms;
  }, "The handlers by platform, then by target name, as PyCapsules for jax.ffi.register_ffi_target.");
}
