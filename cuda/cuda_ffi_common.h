// What the CUDA handler files share: a launcher's status as an FFI error.
#ifndef JAX_MOE_CUDA_FFI_COMMON_H_
#define JAX_MOE_CUDA_FFI_COMMON_H_

#include <cuda_runtime.h>

#include <string>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {

inline xla::ffi::Error CudaStatus(cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, what + ": " + cudaGetErrorString(status));
}

}  // namespace jax_moe

#endif  // JAX_MOE_CUDA_FFI_COMMON_H_
