// CPU XLA FFI handlers for jax_moe permute/unpermute (the routing contract of DESIGN.md §3) and
// the grouped GEMMs of the experts off the GPU (cpu_grouped_dot.cc).
#ifndef JAX_MOE_CPU_OPS_H_
#define JAX_MOE_CPU_OPS_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxMoePermuteCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUnpermuteCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUnpermuteGradCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeNoopCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCopyCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUninitializedCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeGroupedDotCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeGroupedDotWeightGradCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8GroupedDotCpu(XLA_FFI_CallFrame* call_frame);
}

#endif  // JAX_MOE_CPU_OPS_H_
