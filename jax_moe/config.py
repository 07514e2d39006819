"""MoEConfig: the static description of one MoE routing problem."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

# The CUDA routing keeps per-expert counters in shared memory.
MAX_LOCAL_EXPERTS = 4096
ROW_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SCORINGS = ("softmax", "sigmoid")


def positive_int(label: str, value: Any) -> int:
    """value as an int; a ValueError "{label}: expected a positive integer, got ..." unless it is one."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{label}: expected a positive integer, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of an MoE layer's routing and its scratch.

    Attributes:
      num_experts: E, the number of global experts (ids in [0, E) are routable).
      top_k: k, routes per token.
      hidden_size: H, the row width of ``x``.
      max_tokens: T_max, the most tokens one call may route (sizes the scratch).
      dtype: row dtype of ``x`` and of the scratch's ``permuted`` buffer (f16, bf16, f32).
      expert_map: optional [E] ints, global expert -> local index in [0, El) or -1 for "not on
        this device". The non-negative entries must be exactly 0..El-1, each once. None means
        identity (El = E).
      align: each expert's segment is padded to a multiple of ``align`` rows.
      scoring: router scoring used by ``moe_layer``: "softmax" over all E (Mixtral, Qwen) or
        "sigmoid" per expert (DeepSeek-V3).
      renormalize: whether ``moe_layer`` renormalises the top-k weights to sum to 1 (Mixtral,
        Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3: yes; Qwen2-MoE: ``norm_topk_prob=False`` by default).
      renormalize_epsilon: added to the top-k sum before dividing (DeepSeek-V3: 1e-20).
      n_group, topk_group: group-limited routing (DeepSeek-V3): the E experts form ``n_group``
        equal groups, a group scores the sum of its two best (bias-corrected) scores, and only the
        ``topk_group`` best groups are eligible. ``n_group=1`` means no groups.
      routed_scaling_factor: the routed experts' weights are multiplied by it after
        renormalisation (DeepSeek-V3: 2.5).
      A per-expert correction bias (DeepSeek-V3's ``e_score_correction_bias``) is a param leaf,
      ``router_bias`` [E]: added to the scores for choosing only, never to the weights.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    max_tokens: int
    dtype: Any = jnp.bfloat16
    expert_map: tuple[int, ...] | None = None
    align: int = 1
    scoring: str = "softmax"
    renormalize: bool = True
    renormalize_epsilon: float = 0.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "hidden_size", "max_tokens", "align", "n_group", "topk_group"):
            object.__setattr__(self, name, positive_int(f"MoEConfig.{name}", getattr(self, name)))
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise ValueError(f"MoEConfig.dtype: expected one of float16, bfloat16, float32, got {self.dtype!r}") from e
        if dtype not in ROW_DTYPES:
            raise ValueError(f"MoEConfig.dtype: expected one of float16, bfloat16, float32, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoEConfig.scoring: expected one of {SCORINGS}, got {self.scoring!r}")
        renormalize = self.renormalize
        if not (isinstance(renormalize, (bool, np.bool_)) or (isinstance(renormalize, (int, np.integer))
                                                               and renormalize in (0, 1))):
            raise ValueError(f"MoEConfig.renormalize: expected a bool, got {renormalize!r}")
        object.__setattr__(self, "renormalize", bool(renormalize))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k: expected at most num_experts={self.num_experts} (each token picks "
                             f"distinct experts), got {self.top_k}")
        self._check_routing()
        if self.expert_map is not None:
            object.__setattr__(self, "expert_map", self._checked_expert_map(self.expert_map))
        if self.num_local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"MoEConfig: expected at most {MAX_LOCAL_EXPERTS} local experts, got "
                             f"{self.num_local_experts}")

    def _check_routing(self) -> None:
        for name in ("renormalize_epsilon", "routed_scaling_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
                    or not np.isfinite(value) or value < 0 or (name == "routed_scaling_factor" and value == 0):
                raise ValueError(f"MoEConfig.{name}: expected a finite float "
                                 f"{'> 0' if name == 'routed_scaling_factor' else '>= 0'}, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.n_group == 1:
            if self.topk_group != 1:
                raise ValueError(f"MoEConfig.topk_group: expected 1 when n_group is 1, got {self.topk_group}")
            return
        per_group = self.num_experts // self.n_group
        if self.num_experts % self.n_group or per_group < 2:
            raise ValueError(f"MoEConfig.n_group: expected a divisor of num_experts={self.num_experts} leaving at "
                             f"least 2 experts per group (a group scores its two best), got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group or self.topk_group * per_group < self.top_k:
            raise ValueError(f"MoEConfig.topk_group: expected 1 <= topk_group <= n_group={self.n_group} with "
                             f"topk_group * {per_group} experts per group >= top_k={self.top_k}, "
                             f"got {self.topk_group}")

    def _checked_expert_map(self, expert_map) -> tuple[int, ...]:
        values = np.asarray(expert_map)
        if values.ndim != 1 or values.shape[0] != self.num_experts:
            raise ValueError(
                f"MoEConfig.expert_map: expected shape ({self.num_experts},) (one entry per global "
                f"expert), got {values.shape}")
        if values.size and not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"MoEConfig.expert_map: expected integers, got dtype {values.dtype}")
        values = values.astype(np.int64)
        local = np.sort(values[values >= 0])
        if np.any(values < -1):
            raise ValueError(
                f"MoEConfig.expert_map: expected entries >= -1, got {values[values < -1].tolist()}")
        if local.size == 0:
            raise ValueError("MoEConfig.expert_map: expected at least one local expert (entry >= 0), got none")
        if not np.array_equal(local, np.arange(local.size)):
            duplicates = sorted(set(local[1:][local[1:] == local[:-1]].tolist()))
            raise ValueError(
                f"MoEConfig.expert_map: expected the non-negative entries to be exactly 0..{local.size - 1} "
                f"each once, got {local.tolist()}" + (f" (duplicates {duplicates})" if duplicates else ""))
        return tuple(int(v) for v in values)

    @property
    def num_local_experts(self) -> int:
        """El: experts whose rows live on this device."""
        if self.expert_map is None:
            return self.num_experts
        return sum(1 for v in self.expert_map if v >= 0)

    @property
    def capacity(self) -> int:
        """R_cap: rows of ``permuted``, enough for every route plus each expert's padding."""
        rows = self.max_tokens * self.top_k + self.num_local_experts * (self.align - 1)
        return -(-rows // self.align) * self.align

    def live_row_bound(self, num_tokens: int) -> int:
        """Static bound on the rows ``permute`` fills for num_tokens tokens: T*k + El*(align-1), aligned.

        Work after ``permute`` (the expert GEMMs, ``unpermute``'s rows) needs only this prefix of
        the scratch's ``capacity`` rows when a batch has fewer than ``max_tokens`` tokens.
        """
        bound = num_tokens * self.top_k + self.num_local_experts * (self.align - 1)
        return min(self.capacity, -(-bound // self.align) * self.align)

    def group_row_bound(self, num_tokens: int) -> int:
        """Rows one local expert owns for num_tokens tokens when each token picks distinct experts
        (as top-k routers do): T, padded to ``align``. A performance hint (repeated ids are legal)."""
        return -(-num_tokens // self.align) * self.align

    def expert_map_array(self) -> np.ndarray:
        """The [E] int32 global -> local map (identity when ``expert_map`` is None)."""
        if self.expert_map is None:
            return np.arange(self.num_experts, dtype=np.int32)
        return np.asarray(self.expert_map, dtype=np.int32)
