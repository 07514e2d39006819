"""The decode kernels' outputs, for tests/test_fp8.py's check that their knobs change no bit: the FP8
kernel's two ways of moving the weights (``JAX_MOE_FP8_DECODE_KERNEL=ring|stream``) and the L2 policy
of every decode kernel's weight loads (``JAX_MOE_DECODE_EVICT_FIRST=1|0``). Each knob is read once per
process: ``python tests/decode_kernel_case.py OUT.npz`` in one process per setting.

Cases, each saved as its bf16 bits (uint16): FP8 routed experts alone at 2 and 16 tokens with 8 and 16
rows a pass and with a 3-row group bound; FP8 at 3 tokens with a shared expert riding the same launches
(its F above the routed one); the bf16 decode kernel's gate/up product at 2 tokens, alone and with a
shared expert riding. Off CUDA the calls fall back to XLA's math, and every setting gives the same
arrays trivially.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import fp8_swiglu_weights, routed_scratch, scaled_normal  # noqa: E402
from jax_moe import MoEConfig, gemm  # noqa: E402

HIDDEN, FFN, SHARED_FFN, EXPERTS, TOP_K = 1024, 384, 640, 16, 4


def outputs() -> dict[str, np.ndarray]:
    keys = jax.random.split(jax.random.key(5), 5)
    gate_up, down, shared_gate_up, shared_down = fp8_swiglu_weights(keys, EXPERTS, HIDDEN, FFN, SHARED_FFN)
    bits = lambda a: np.asarray(jnp.asarray(a).view(jnp.uint16))
    out = {}
    for num_tokens in (2, 16):
        config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens=num_tokens,
                           dtype=jnp.bfloat16)
        scratch = routed_scratch(config, num_tokens)
        for rows_per_pass, group_rows in ((8, None), (16, None), (8, 3)):
            forward = jax.jit(lambda r, o, w, *weights: gemm.fp8_swiglu_forward(
                r, *weights, o, w, config.capacity, decode_rows=rows_per_pass, group_rows=group_rows)[0])
            out[f"routed_T{num_tokens}_pass{rows_per_pass}_bound{group_rows}"] = bits(forward(
                scratch.permuted, scratch.expert_offsets, scratch.workspace, *gate_up, *down))
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens=3, dtype=jnp.bfloat16)
    scratch = routed_scratch(config, 3)
    x = jax.random.normal(keys[4], (3, HIDDEN)).astype(jnp.bfloat16)
    riding = jax.jit(lambda *a: gemm.fp8_decode_swiglu_with_shared(*a[:6], config.capacity, *a[6:]))
    routed, shared = riding(scratch.permuted, *gate_up, *down, scratch.expert_offsets, x, *shared_gate_up,
                            *shared_down)
    out["riding_routed"], out["riding_shared"] = bits(routed), bits(shared)
    # The bf16 decode kernel (gemm.DECODE_TILE), alone and with a shared product riding.
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens=2, dtype=jnp.bfloat16)
    scratch = routed_scratch(config, 2)
    gate_up16 = scaled_normal(keys[0], (EXPERTS, HIDDEN, 2 * FFN), HIDDEN)
    shared16 = scaled_normal(keys[2], (HIDDEN, 2 * SHARED_FFN), HIDDEN)
    alone = jax.jit(lambda r, w, o, ws: gemm.forward(r, w, o, ws, config.capacity, gemm.DECODE_TILE)[0])
    out["bf16_alone"] = bits(alone(scratch.permuted, gate_up16, scratch.expert_offsets, scratch.workspace))
    with_shared = jax.jit(lambda r, w, o, x, s: gemm.decode_forward_with_shared(r, w, o, config.capacity, x, s,
                                                                                gated=True))
    routed, shared = with_shared(scratch.permuted, gate_up16, scratch.expert_offsets, x[:2], shared16)
    out["bf16_riding_routed"], out["bf16_riding_shared"] = bits(routed), bits(shared)
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **outputs())
