"""An independent NumPy-loop oracle of the routing contract (DESIGN.md §3).

Written from the contract's text alone, one route and one token at a time, so that it shares no
code and no structure with ``jax_moe.reference`` or the native handlers. It reads only the plain
fields of a config (``num_experts``, ``top_k``, ``max_tokens``, ``expert_map``, ``align``), never its
derived properties, so it also checks ``capacity`` and ``num_local_experts``.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Permuted:
    """What a permute must produce. ``permuted`` rows >= ``live_rows`` are unspecified (zero here)."""

    group_sizes: np.ndarray     # [El] int32
    expert_offsets: np.ndarray  # [El + 1] int32
    permuted: np.ndarray        # [R_cap, H]
    src_index: np.ndarray       # [R_cap] int32
    dest_index: np.ndarray      # [T, k] int32 (only the rows of this call)
    live_rows: int
    capacity: int
    num_local_experts: int


def _field(config, name):
    return config[name] if isinstance(config, dict) else getattr(config, name)


def capacity(config) -> int:
    """R_cap = T_max * k + El * (align - 1), rounded up to a multiple of align."""
    expert_map = _field(config, "expert_map")
    num_local = _field(config, "num_experts") if expert_map is None else sum(1 for v in expert_map if v >= 0)
    align = _field(config, "align")
    rows = _field(config, "max_tokens") * _field(config, "top_k") + num_local * (align - 1)
    return -(-rows // align) * align


def permute(x: np.ndarray, topk_ids: np.ndarray, config) -> Permuted:
    """Groups routes by local expert, stable in flat route order, segments padded to ``align``."""
    num_experts, align = _field(config, "num_experts"), _field(config, "align")
    expert_map = _field(config, "expert_map")
    table = list(range(num_experts)) if expert_map is None else [int(v) for v in expert_map]
    num_local = sum(1 for v in table if v >= 0)
    num_tokens, top_k = topk_ids.shape
    assert top_k == _field(config, "top_k") and num_tokens <= _field(config, "max_tokens")

    # Local expert of each route in flat order t * k + j; Python ints, so no id can wrap.
    local = []
    for t in range(num_tokens):
        for j in range(top_k):
            global_id = int(topk_ids[t, j])
            local.append(table[global_id] if 0 <= global_id < num_experts else -1)

    counts = [0] * num_local
    for e in local:
        if e >= 0:
            counts[e] += 1
    group_sizes = [(c + align - 1) // align * align for c in counts]
    expert_offsets = [0]
    for size in group_sizes:
        expert_offsets.append(expert_offsets[-1] + size)

    rows = capacity(config)
    permuted = np.zeros((rows, x.shape[1]), x.dtype)
    src_index = np.full(rows, -1, np.int32)
    dest_index = np.full((num_tokens, top_k), -1, np.int32)
    next_row = list(expert_offsets[:-1])
    for route, e in enumerate(local):
        if e < 0:
            continue
        row = next_row[e]
        next_row[e] += 1
        t, j = divmod(route, top_k)
        permuted[row] = x[t]
        src_index[row] = route
        dest_index[t, j] = row
    return Permuted(np.asarray(group_sizes, np.int32), np.asarray(expert_offsets, np.int32), permuted,
                    src_index, dest_index, expert_offsets[-1], rows, num_local)


def round_to(values: np.ndarray, dtype) -> np.ndarray:
    """float32 -> dtype, round to nearest even (numpy for float16, ml_dtypes for bfloat16)."""
    dtype = np.dtype(dtype)
    assert values.dtype == np.float32
    if dtype == np.float32:
        return values.copy()
    assert dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)), dtype
    return values.astype(dtype)


def unpermute(y: np.ndarray, topk_weights: np.ndarray, dest_index: np.ndarray) -> np.ndarray:
    """out[t] = sum over kept j, ascending, of w[t, j] * y[dest[t, j]]: float32, no FMA, rounded once."""
    num_tokens, top_k = topk_weights.shape
    out = np.zeros((num_tokens, y.shape[1]), np.float32)
    for t in range(num_tokens):
        acc = np.zeros(y.shape[1], np.float32)
        for j in range(top_k):
            row = int(dest_index[t, j])
            if row < 0:
                continue  # dropped: skipped, not "+ 0 * y" (its weight and row are never read)
            product = np.float32(topk_weights[t, j]) * y[row].astype(np.float32)  # rounded to f32
            acc = acc + product                                                   # rounded to f32
        out[t] = acc
    return round_to(out, y.dtype)


def unpermute_abs_bound(y: np.ndarray, topk_weights: np.ndarray, dest_index: np.ndarray) -> np.ndarray:
    """[T, H] float64 sum of |w * y| over kept routes: the scale of a sum's rounding error."""
    dest = np.asarray(dest_index)
    kept = dest >= 0
    w = np.where(kept, np.abs(np.asarray(topk_weights, np.float64)), 0.0)
    rows = np.abs(np.asarray(y, np.float64))[np.maximum(dest, 0)]  # [T, k, H]
    return np.einsum("tk,tkh->th", w, np.where(kept[..., None], rows, 0.0))


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a float array (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(actual, expected, what: str = "") -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    differ = bits(actual) != bits(expected)
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.size} elements differ bitwise; first at {first}: "
            f"got {actual[first]!r} expected {expected[first]!r}")


def assert_zero_past_groups(out, expert_offsets, live_nonzero: bool = True) -> None:
    """A grouped product's rows past its last group are exactly zero (no group covers them), and
    (``live_nonzero``) its live rows are not all zero. out: [rows, N]; expert_offsets: [El + 1]."""
    out = np.asarray(out)
    live = min(int(expert_offsets[-1]), out.shape[0])
    assert not out[live:].any(), "rows in no group must be zero"
    if live_nonzero:
        assert np.abs(out[:live]).sum() > 0


def assert_scratch_matches(scratch, expected: Permuted, T: int) -> None:
    """Compares a permute's scratch with the oracle, bitwise, where the contract specifies it.

    ``permuted``: rows below the live count (padding rows must be exactly +0.0 bits);
    ``src_index``: every row; ``dest_index``: rows < T; ``group_sizes``/``expert_offsets``: all.
    """
    assert_bitwise_equal(scratch.group_sizes, expected.group_sizes, "group_sizes")
    assert_bitwise_equal(scratch.expert_offsets, expected.expert_offsets, "expert_offsets")
    permuted = np.asarray(scratch.permuted)
    assert permuted.shape == expected.permuted.shape, (
        f"permuted: shape {permuted.shape} != {expected.permuted.shape}")
    live = expected.live_rows
    padding = np.flatnonzero(expected.src_index[:live] < 0)
    nonzero_padding = padding[(bits(permuted[padding]) != 0).any(axis=1)]
    assert nonzero_padding.size == 0, f"permuted: padding rows {nonzero_padding.tolist()} are not zero"
    assert_bitwise_equal(permuted[:live], expected.permuted[:live], f"permuted[:{live}]")
    assert_bitwise_equal(scratch.src_index, expected.src_index, "src_index")
    assert_bitwise_equal(np.asarray(scratch.dest_index)[:T], expected.dest_index, f"dest_index[:{T}]")
