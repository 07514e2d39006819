// What every XLA FFI handler file shares, CPU and CUDA alike: the error for a bad operand and the
// (target name, handler) pairs each op family hands its module to register.
#ifndef JAX_MOE_FFI_COMMON_H_
#define JAX_MOE_FFI_COMMON_H_

#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {

inline xla::ffi::Error InvalidArgument(const char* message) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, message);
}
inline xla::ffi::Error InvalidArgument(const std::string& message) { return InvalidArgument(message.c_str()); }

// A handler and the name jax.ffi.register_ffi_target registers it under (jax_moe/_native.py).
struct FfiTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};
using FfiTargets = std::vector<FfiTarget>;

}  // namespace jax_moe

#endif  // JAX_MOE_FFI_COMMON_H_
