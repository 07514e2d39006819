"""A decode layer's experts in one launch: the Python face of cuda/decode_layer.h.

After the router, the unfused inference path at decode runs permute, the gate/up and down
projections (two launches of the decode GEMM) and ``unpermute_add``: four launches, each with its
own start and tail, for a layer whose floor is one read of the active experts' weights.
``experts_and_add`` does all of it in one cooperative launch. Every block builds the routes' expert
groups from the ids itself (a few dozen routes: no permuted rows, no index buffers), streams an
equal share of the gate/up product's columns over all active experts (and the shared expert), waits
at one grid barrier, streams an equal share of the down product's, and the last block to finish a
16-column chunk of the output sums that chunk's routes, the shared expert and the residual.

Its math is the unfused path's roundings (gate/up sums to bf16, the activation in float32, each
route's output to bf16, unpermute's float32 weighted sum in route order, XLA's bf16 adds); only the
float32 summation order inside each dot product differs. Inference only (no autodiff rule): the
training forward keeps the unfused path, whose backward needs its buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _native, fp8
from jax_moe.ops import fence_results
from jax_moe.config import MoEConfig
from jax_moe.scratch import MoEScratch

# Tokens up to which moe_stack's inference forward takes the one-launch layer. The kernel takes up
# to 8 (cuda/decode_layer.h kDecodeLayerMaxTokens), but from 4 tokens, with 4 or 8 rows a pass, it
# ran 256 threads of 190-240 registers an SM and was up to 2.8x slower than the four launches
# (notebooks/results/decode_one_launch_layer_h200.md). The bench's decode suite switches ENABLED off
# to measure the unfused path in the same run.
MAX_TOKENS = 2
ENABLED = True


def fits(config: MoEConfig, num_tokens: int, layer_params: dict) -> bool:
    """Whether ``experts_and_add`` runs this layer: a GPU with the CUDA module, bf16 tokens and
    experts (bf16 or wider weights, cast), no expert map, no FP8 experts, at most MAX_TOKENS tokens,
    and sizes the kernel takes (H, F and the shared expert's F multiples of 16)."""
    if not (ENABLED and num_tokens <= MAX_TOKENS and _native.HAS_CUDA and jax.default_backend() == "gpu"):
        return False
    if config.expert_map is not None or jnp.dtype(config.dtype) != jnp.bfloat16:
        return False
    if fp8.is_quantized(layer_params) or fp8.shared_is_quantized(layer_params):
        return False
    num_experts, hidden, _ = layer_params["gate_up"].shape[-3:]
    ffn = layer_params["down"].shape[-2]
    shared_ffn = layer_params["shared_down"].shape[-2] if "shared_gate_up" in layer_params else 0
    return _native.decode_layer_fits(num_tokens, config.top_k, num_experts, hidden, ffn, shared_ffn)


def experts_and_add(x: jax.Array, residual: jax.Array, weights: jax.Array, ids: jax.Array, layer_params: dict,
                    scratch: MoEScratch) -> tuple[jax.Array, MoEScratch]:
    """``residual + (sum_j weights[:, j] * expert_{ids[:, j]}(x) + shared(x))`` in one launch.

    Args:
      x: [T, H] bf16, the layer's normalised tokens; residual: [T, H] bf16, its input.
      weights: [T, k] float32 and ids: [T, k] int32, the router's (ids outside [0, E) are dropped).
      layer_params: one layer's params: ``gate_up`` [E, H, 2F], ``down`` [E, F, H], and optionally
        ``shared_gate_up`` [H, 2Fs], ``shared_down`` [Fs, H], ``shared_gate`` [H, 1] (cast to bf16).
      scratch: the shared scratch; the kernel keeps its counters in the workspace's last words.

    Returns:
      ``(out [T, H] bf16, scratch)``: ``out`` in the residual's buffer, equal to ``unpermute_add`` of
      the decode GEMMs' SwiGLU but for float32 summation order. Call only where ``fits`` holds.
    """
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    dtype = x.dtype
    gate_up, down = layer_params["gate_up"].astype(dtype), layer_params["down"].astype(dtype)
    has_shared = "shared_gate_up" in layer_params
    gated = has_shared and "shared_gate" in layer_params
    placeholder = jnp.zeros((1,), dtype)
    shared_gate_up = layer_params["shared_gate_up"].astype(dtype) if has_shared else placeholder
    shared_down = layer_params["shared_down"].astype(dtype) if has_shared else placeholder
    shared_gate = layer_params["shared_gate"].astype(dtype).reshape(-1) if gated else placeholder
    ffn, shared_ffn = down.shape[-2], (shared_down.shape[0] if has_shared else 0)
    rows = num_tokens * (top_k + 1)
    workspace = scratch.workspace
    call = jax.ffi.ffi_call(
        _native.DECODE_LAYER_TARGET,
        (jax.ShapeDtypeStruct(residual.shape, dtype), jax.ShapeDtypeStruct((rows, max(ffn, shared_ffn)), dtype),
         jax.ShapeDtypeStruct((rows, hidden), dtype), jax.ShapeDtypeStruct((num_tokens,), jnp.float32),
         jax.ShapeDtypeStruct(workspace.shape, workspace.dtype)),
        input_output_aliases={1: 0, 9: 4}, vmap_method="sequential")
    out, _, _, _, workspace = fence_results(call(x, residual, ids.astype(jnp.int32), weights.astype(jnp.float32), gate_up, down,
                                   shared_gate_up, shared_down, shared_gate, workspace,
                                   has_shared=np.bool_(has_shared), gated_shared=np.bool_(gated)))
    return out, scratch.replace(workspace=workspace)
