"""The model shapes and token counts the benchmark runs, in one place."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_moe.config import MoEConfig

ROW_DTYPE = jnp.bfloat16


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
    """

    name: str
    label: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int | None = None
    stack_layers: int | None = None

    def config(self, max_tokens: int) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                         max_tokens=max_tokens, dtype=ROW_DTYPE)

    def describe(self) -> str:
        return f"{self.label} (E{self.num_experts}, k{self.top_k}, H{self.hidden_size})"


MODELS = {m.name: m for m in (
    ModelShape("mixtral", "Mixtral-8x7B", 8, 2, 4096, ffn_size=14336),
    # Stack: the real model has 48 MoE layers (58 GB of bf16 experts); 16 keep the unrolled
    # compile inside the run's time budget. Per-layer time is step time / L.
    ModelShape("qwen3_30b", "Qwen3-30B-A3B", 128, 8, 2048, ffn_size=768, stack_layers=16),
    # Stack: one layer's experts are 256 x 3 x 7168 x 2048 bf16 = 22.5 GB, so 4 layers (90 GB)
    # is what fits the 139 GiB card next to the per-layer temporaries (the real model has 58).
    ModelShape("deepseek_v3", "DeepSeek-V3", 256, 8, 7168, ffn_size=2048, stack_layers=4),
    ModelShape("qwen35_397b", "Qwen3.5-397B-A17B", 512, 10, 4096, ffn_size=1024),
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
