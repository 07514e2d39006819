// CUDA XLA FFI handlers for jax_moe (same operands, results and attributes as cpu_ops.h).
#ifndef JAX_MOE_GPU_OPS_H_
#define JAX_MOE_GPU_OPS_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxMoePermuteCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoePermutePrefetchCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoePermuteFp8Cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUnpermuteCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUnpermuteAddCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUnpermuteGradCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeGatherRowsCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeGroupedMatmulCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeGroupedMatmulIntoCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeDecodeMatmulCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeDecodeMatmulSharedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeDecodeRouteCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeDecodeRouteNormCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeChooseExpertsCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8GroupedMatmulCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8SwigluExpertsCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8SwigluQuantizedExpertsCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8DecodeSwigluCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeFp8DecodeSwigluSharedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeSwigluBackwardCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeNoopCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCopyCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeUninitializedCuda(XLA_FFI_CallFrame* call_frame);
}

#endif  // JAX_MOE_GPU_OPS_H_
