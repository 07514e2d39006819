"""The expert-parallel problem of the multi-process test, built the same way in every process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import MoEConfig
from jax_moe import init_moe_params

AXIS = "ep"
E, K, H, F, L, TOKENS_PER_PROCESS = 8, 2, 32, 16, 2, 4


def case(num_processes: int):
    """(global config, params, x, placement) as host NumPy arrays, identical in every process.

    DeepSeek-V3-like routing (sigmoid, groups, a correction bias, scaling) and a shared expert, so
    the replicated leaves travel too; a non-contiguous placement of the experts.
    """
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=TOKENS_PER_PROCESS * num_processes,
                       dtype=jnp.float32, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    params = init_moe_params(jax.random.key(7), config, L, F, shared_ffn_size=12, router_bias=True)
    params["router_bias"] = 0.1 * jax.random.normal(jax.random.key(8), params["router_bias"].shape)
    params = {name: np.asarray(leaf) for name, leaf in params.items()}
    x = np.asarray(jax.random.normal(jax.random.key(9), (config.max_tokens, H), jnp.float32))
    placement = tuple(int(v) for v in np.random.default_rng(3).permutation(E))
    return config, params, x, placement
