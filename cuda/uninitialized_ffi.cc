// A buffer XLA allocates and no kernel writes: the start of an array that is later written in
// full, one slice per loop iteration (the training stack's stacked weight gradients and saved
// activations), without the fill a zero-initialised array costs. "tag" only keeps XLA from
// merging two such calls of the same shape into one buffer. It touches no device, so one handler
// serves both platforms: each module registers it.
#include <cstdint>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe {
namespace {

ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer>, int64_t /*tag*/) { return ffi::Error::Success(); }

}  // namespace
}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeUninitialized, jax_moe::UninitializedImpl,
                              ffi::Ffi::Bind()
                                  .Ret<ffi::AnyBuffer>()   // the buffer, contents unspecified
                                  .Attr<int64_t>("tag"),   // distinct per call (no merging)
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_moe {

FfiTargets UninitializedTargets() { return {{"jax_moe_uninitialized", JaxMoeUninitialized}}; }

}  // namespace jax_moe
