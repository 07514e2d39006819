"""The model shapes the suites run, and how deep a stack of them fits the card."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_moe.config import MoEConfig

ROW_DTYPE = jnp.bfloat16
PARAMS_SHARE = 0.8  # of the allocator's limit a stack's params may take; the rest is the step's temporaries
MIN_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One model's MoE layer: E experts, top k, hidden H, expert width F, its routing options (``MoEConfig``
    keywords), shared expert and correction bias (``init_moe_params`` keywords), and the depths of the
    stacks the suites run: enough layers that one layer's experts are not in L2 from the step before, no
    more than fit an H200 (training: beside their gradients; ``layers_that_fit`` takes fewer on a smaller card)."""

    name: str
    label: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    stack_layers: int
    train_layers: int
    routing: dict = dataclasses.field(default_factory=dict)
    shared_ffn: int | None = None
    shared_gate: bool = False
    router_bias: bool = False

    def config(self, max_tokens: int, real_routing: bool = True) -> MoEConfig:
        """The model's MoEConfig; ``real_routing=False`` routes by softmax top-k, as the PyTorch peer does."""
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                         max_tokens=max_tokens, dtype=ROW_DTYPE, **(self.routing if real_routing else {}))

    def param_options(self) -> dict:
        return {"shared_ffn_size": self.shared_ffn, "shared_gate": self.shared_gate, "router_bias": self.router_bias}

    def layer_param_bytes(self) -> int:
        """Bytes of one layer of the bf16 stack: the experts, the shared expert and the router."""
        experts = (self.num_experts * self.ffn_size + (self.shared_ffn or 0)) * 3 * self.hidden_size
        return 2 * (experts + self.hidden_size * self.num_experts)

    def layers_that_fit(self, limit_bytes: float | None, training: bool = False) -> int:
        """The stack's depth, or fewer where its params (training: and their gradients) would take more than
        PARAMS_SHARE of ``limit_bytes`` (None: no limit); never below MIN_LAYERS (training: one)."""
        wanted, copies, least = (self.train_layers, 2, 1) if training else (self.stack_layers, 1, MIN_LAYERS)
        if limit_bytes is None:
            return wanted
        return max(least, min(wanted, int(PARAMS_SHARE * limit_bytes // (copies * self.layer_param_bytes()))))


def stack_counts(models, limit_bytes: float | None, training: bool = False) -> tuple[dict[str, int], list[str]]:
    """Each model's depth (one for jax_moe and its peers) and a note for each one capped by the card."""
    layers = {model.name: model.layers_that_fit(limit_bytes, training) for model in models}
    notes = [f"{model.name}: {layers[model.name]} layers, not {model.layers_that_fit(None, training)}: "
             f"{model.layer_param_bytes() / 1e9:.1f} GB a layer{' and as much of gradients' if training else ''}, "
             f"{limit_bytes / 1e9:.0f} GB allocator limit"
             for model in models if layers[model.name] != model.layers_that_fit(None, training)]
    return layers, notes


MODELS = {m.name: m for m in (
    ModelShape("mixtral", "Mixtral-8x7B", 8, 2, 4096, 14336, 8, 4),
    ModelShape("qwen3_30b", "Qwen3-30B-A3B", 128, 8, 2048, 768, 16, 8),
    # 22.5 GB of bf16 experts a layer: 4 layers fit an H200 beside a step's temporaries.
    ModelShape("deepseek_v3", "DeepSeek-V3", 256, 8, 7168, 2048, 4, 2,
               routing=dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                            renormalize_epsilon=1e-20), shared_ffn=2048, router_bias=True),
    ModelShape("qwen35_397b", "Qwen3.5-397B-A17B", 512, 10, 4096, 1024, 8, 2, shared_ffn=1024, shared_gate=True),
    ModelShape("tiny", "tiny (CPU test)", 8, 2, 64, 32, 2, 2),  # the harness in seconds, on CPU
)}
