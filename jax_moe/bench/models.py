"""The model shapes and token counts the benchmark runs, in one place."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_moe.config import MoEConfig

ROW_DTYPE = jnp.bfloat16
# A stack's params may take this share of the allocator's limit (ModelShape.layers_that_fit); the
# rest is the step's temporaries (at prefill, the permuted rows and the products). Every count it
# leaves still streams far more than L2 a step.
PARAMS_SHARE = 0.8
MIN_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The MoE shape of one model.

    Attributes:
      name: the name used on the command line.
      label: the name printed in tables.
      num_experts, top_k, hidden_size: E, k, H.
      ffn_size: F, each expert's intermediate size (stack and gemm suites).
      stack_layers: L of the stack suite's model, chosen to fit the card's memory and the run's
        time budget (None: not in the stack suite).
      routing: the model's ``MoEConfig`` routing fields (default: softmax top-k, renormalised).
      shared_ffn, shared_gate, router_bias: the model's shared expert (width, sigmoid gate) and
        correction bias, as ``init_moe_params`` takes them.
    """

    name: str
    label: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int | None = None
    stack_layers: int | None = None
    routing: dict = dataclasses.field(default_factory=dict)
    shared_ffn: int | None = None
    shared_gate: bool = False
    router_bias: bool = False

    def config(self, max_tokens: int, real_routing: bool = True) -> MoEConfig:
        """The model's MoEConfig; ``real_routing=False`` routes like Mixtral/Qwen3 (the train suite's
        PyTorch peer is transformers' Qwen3-MoE block for every shape)."""
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                         max_tokens=max_tokens, dtype=ROW_DTYPE, **(self.routing if real_routing else {}))

    def param_options(self) -> dict:
        """``init_moe_params`` keywords for the model's shared expert and correction bias."""
        return {"shared_ffn_size": self.shared_ffn, "shared_gate": self.shared_gate, "router_bias": self.router_bias}

    def describe(self) -> str:
        return f"{self.label} (E{self.num_experts}, k{self.top_k}, H{self.hidden_size})"

    def layer_param_bytes(self) -> int:
        """Bytes of one layer of the bf16 stack: the experts, the shared expert and the router."""
        hidden = self.hidden_size
        weights = self.num_experts * 3 * hidden * self.ffn_size + 3 * hidden * (self.shared_ffn or 0)
        return 2 * (weights + hidden * self.num_experts)

    def layers_that_fit(self, wanted: int, limit_bytes: float | None, copies: int = 1, least: int = MIN_LAYERS) -> int:
        """``wanted`` stack layers, or fewer where ``copies`` of their bf16 params (2 for a training
        step: the weights and their gradients) would take more than PARAMS_SHARE of ``limit_bytes``
        (the allocator's limit, ``timing.card_bytes()``; None: no limit), never below ``least``. An
        80 GB H100 holds two DeepSeek-V3 layers (22.6 GB each) beside a decode step, not four, and
        one beside its gradients; the H200 keeps the counts chosen for it."""
        if limit_bytes is None:
            return wanted
        return max(least, min(wanted, int(PARAMS_SHARE * limit_bytes // (copies * self.layer_param_bytes()))))


def stack_counts(models, count, limit_bytes: float | None, held: str = "") -> tuple[dict[str, int], list[str]]:
    """Each model's stack L, ``count(model, limit_bytes)`` (one L for jax_moe and its peer), and a note
    for each model capped below ``count(model, None)``; ``held`` says what else a layer's params
    bring (a training step's gradients)."""
    layers = {model.name: count(model, limit_bytes) for model in models}
    notes = [f"{model.name}: {layers[model.name]} layers, not {count(model, None)}: "
             f"{model.layer_param_bytes() / 1e9:.1f} GB a layer{held}, {limit_bytes / 1e9:.0f} GB allocator limit"
             for model in models if layers[model.name] != count(model, None)]
    return layers, notes


MODELS = {m.name: m for m in (
    ModelShape("mixtral", "Mixtral-8x7B", 8, 2, 4096, ffn_size=14336),
    # Stack: the real model has 48 MoE layers (58 GB of bf16 experts); 16 keep the unrolled
    # compile inside the run's time budget. Per-layer time is step time / L.
    ModelShape("qwen3_30b", "Qwen3-30B-A3B", 128, 8, 2048, ffn_size=768, stack_layers=16),
    # Stack: one layer's experts are 256 x 3 x 7168 x 2048 bf16 = 22.5 GB, so 4 layers (90 GB)
    # is what fits the 139 GiB card next to the per-layer temporaries (the real model has 58).
    # Its routing: sigmoid scores, 8 groups of which 4 are eligible, a correction bias, weights
    # renormalised and scaled by 2.5; one shared expert of width F.
    ModelShape("deepseek_v3", "DeepSeek-V3", 256, 8, 7168, ffn_size=2048, stack_layers=4,
               routing=dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                            renormalize_epsilon=1e-20), shared_ffn=2048, router_bias=True),
    # One sigmoid-gated shared expert; its width is taken as F here. Stack: 12.9 GB of experts per
    # layer; 8 layers (the real model has 60).
    ModelShape("qwen35_397b", "Qwen3.5-397B-A17B", 512, 10, 4096, ffn_size=1024, stack_layers=8, shared_ffn=1024,
               shared_gate=True),
    # CPU development and tests: the whole harness in seconds.
    ModelShape("tiny", "tiny (CPU test)", 8, 2, 64, ffn_size=32, stack_layers=2),
)}

PERMUTE_MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
PERMUTE_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
STACK_MODELS = ("deepseek_v3", "qwen3_30b")
STACK_TOKENS = (1, 16, 128, 1024)

# --quick: decode and one prefill size of the two models both suites share, about a minute.
QUICK_PERMUTE_MODELS = ("qwen3_30b", "deepseek_v3")
QUICK_PERMUTE_TOKENS = (1, 16, 4096)
QUICK_STACK_MODELS = ("qwen3_30b",)
QUICK_STACK_TOKENS = (1, 16)
