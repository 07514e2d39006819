"""The thresholds that choose a layer's kernels, as data: one table, one line of reason each.

``jax_moe.plan.plan_layer`` reads a ``Tuning`` (``DEFAULT_TUNING`` unless given one) and nothing
else reads these numbers. Each field's ``why`` says what the threshold trades; the measurements
behind the defaults (H100 and H200) are in the benchmark results (``python -m jax_moe.bench``), not
here. A tuned table for another card is ``Tuning(**values)``, e.g. from JSON.
"""

from __future__ import annotations

import dataclasses


def _rule(value, why: str):
    return dataclasses.field(default=value, metadata={"why": why})


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Thresholds of the kernel choices (all static Python numbers; hashable)."""

    router_kernel_max_tokens: int = _rule(
        2, "the one-launch router beats XLA's six to ten small kernels up to here; past it its H reduction is "
           "latency-bound and slower")
    prefetch_bytes: int = _rule(
        8 << 20, "L2 bytes a decode permute asks for (the next GEMM's first weight bytes); HBM is idle during the "
                 "permute, L2 holds 50 MB")
    medium_tile_min_rows_per_expert: float = _rule(
        20, "the 64 x 256 ping-pong tile pads ragged groups half as much as a 128-row tile once groups hold this many")
    large_tile_min_rows_per_expert: float = _rule(
        512, "the 128 x 256 cooperative tile wins once every expert's rows fill several of its tiles")
    decode_max_rows_per_expert: float = _rule(
        2.0, "the CUDA-core decode kernel streams weights faster than CUTLASS while owning experts expect this "
             "few rows")
    decode_max_group_rows: int = _rule(
        2, "past this many rows in one expert CUTLASS's 64-row tile streams the weights faster")
    decode_many_experts: int = _rule(
        64, "fine-grained layers (at least this many experts) rarely give one expert more rows than expected")
    decode_fine_max_rows_per_expert: float = _rule(
        1.2, "fine-grained layers keep the decode kernel while owning experts expect at most this many rows; past "
             "it CUTLASS's 64-row tile reads a popular expert once")
    decode_light_max_rows_per_expert: float = _rule(
        1.6, "and light ones up to this many: their launches are short, and a popular expert's extra passes "
             "read it from L2")
    decode_light_max_bytes: float = _rule(
        1e9, "a fine-grained layer is light while the experts expected to own rows weigh at most this many bytes")
    shared_decode_max_tokens: int = _rule(
        8, "a bf16 shared expert streams its weights on the decode kernel up to here (one pass of 8 rows); XLA's "
           "dot copies the stacked slice first")
    fp8_small_tile_max_rows_per_group: int = _rule(
        32, "the FP8 CUTLASS 64-row tile beats the 128-row one while groups average at most this many rows")
    fp8_decode_max_rows_per_expert: float = _rule(
        4.0, "the FP8 decode kernel (two launches, no setup) beats CUTLASS's FP8 path up to this many rows an "
             "expert")
    fp8_decode_max_bytes: float = _rule(
        360e6, "up to this many weight bytes the FP8 decode kernel streams as fast as CUTLASS at any row count")
    fp8_decode_large_max_rows_per_expert: float = _rule(
        2.0, "past fp8_decode_max_bytes it still wins (evict-first loads) while experts expect at most this many "
             "rows")
    fp8_decode_large_max_bytes: float = _rule(
        1.4e9, "and up to this many weight bytes")

    def why(self, name: str) -> str:
        """The reason behind threshold ``name``."""
        return {f.name: f.metadata["why"] for f in dataclasses.fields(self)}[name]


DEFAULT_TUNING = Tuning()
