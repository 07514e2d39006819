"""The expert GEMMs, one module per kernel family (the layers choose among them with ``jax_moe.plan``):

- ``grouped_dot``: ``jax.lax.ragged_dot``'s product (a C++ kernel on CPU): the reference and the
  off-GPU path of every other family;
- ``grouped_matmul``: the CUDA bf16 grouped GEMMs (CUTLASS, Hopper): forward, input and weight
  gradients, and the public ``grouped_matmul`` op;
- ``decode``: the CUDA-core decode kernel for a few rows per expert;
- ``fp8_gemm``: FP8 experts (CUTLASS blockwise-scaled grouped GEMM and the FP8 decode kernel);
- ``swiglu``: the activation between the projections and its backward kernel.
"""

from jax_moe.gemm.decode import decode_forward_with_shared
from jax_moe.gemm.fp8_gemm import (FP8_DECODE_ROWS_PER_PASS, fp8_decode_swiglu_with_shared, fp8_dequantized_matmul,
                                   fp8_forward, fp8_swiglu_dequantized, fp8_swiglu_forward,
                                   fp8_swiglu_quantized_forward, fp8_workspace)
from jax_moe.gemm.grouped_dot import grouped_dot
from jax_moe.gemm.grouped_matmul import (DECODE_TILE, FORWARD, INPUT_GRAD, LARGE_M_TILE, MEDIUM_M_TILE, SMALL_M_TILE,
                                         TILES, WEIGHT_GRAD, backward_workspace, forward, forward_into,
                                         gated_forward, grouped_matmul, input_grad, weight_grad, weight_grad_into)
from jax_moe.gemm.swiglu import gated_silu, swiglu_backward

__all__ = ["grouped_dot", "grouped_matmul", "forward", "gated_forward", "input_grad", "weight_grad",
           "forward_into", "weight_grad_into", "backward_workspace", "decode_forward_with_shared",
           "fp8_forward", "fp8_swiglu_forward", "fp8_swiglu_quantized_forward", "fp8_swiglu_dequantized",
           "fp8_dequantized_matmul", "fp8_decode_swiglu_with_shared", "fp8_workspace", "gated_silu",
           "swiglu_backward", "TILES", "SMALL_M_TILE", "MEDIUM_M_TILE", "LARGE_M_TILE", "DECODE_TILE", "FORWARD",
           "INPUT_GRAD", "WEIGHT_GRAD", "FP8_DECODE_ROWS_PER_PASS"]
