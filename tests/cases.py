"""Deterministic routing-contract cases (DESIGN.md §3), shared by the CPU and the GPU tests.

``cases()`` returns small cases that together cover the contract's corners; ``large_cases()``
returns model-sized ones for the GPU tests only. Importing this module is cheap (numpy and
ml_dtypes only, no jax); a case builds its arrays on first access, from a fixed seed, so
parametrizing over ``large_cases()`` costs nothing until a test touches the arrays.

Every case holds ``MoEConfig`` keyword arguments and NumPy ``x`` [T, H], ``topk_ids`` [T, k] and
``topk_weights`` [T, k]. The weights of dropped routes are NaN on purpose: the contract says a
dropped route is never read, so a NaN that leaks into an output is a contract violation.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Callable

import ml_dtypes
import numpy as np

NUMPY_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float32": np.dtype(np.float32)}

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


@dataclasses.dataclass(eq=False)
class Case:
    """One routing problem. ``config`` holds MoEConfig keyword arguments (dtype as a name).

    ``x64`` is True when ``topk_ids`` is a 64-bit integer array: run such a case under
    ``jax.enable_x64(True)``, since without it JAX itself truncates the ids to int32 before
    jax_moe sees them.
    """

    name: str
    config: dict[str, Any]
    make: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(repr=False)
    x64: bool = False

    @functools.cached_property
    def _arrays(self):
        x, ids, w = self.make()
        T, k = ids.shape
        assert x.shape == (T, self.config["hidden_size"]) and k == self.config["top_k"], self.name
        assert x.dtype == NUMPY_DTYPES[self.config["dtype"]] and w.shape == ids.shape, self.name
        assert T <= self.config["max_tokens"], self.name
        return x, ids, w

    @property
    def x(self) -> np.ndarray:
        return self._arrays[0]

    @property
    def topk_ids(self) -> np.ndarray:
        return self._arrays[1]

    @property
    def topk_weights(self) -> np.ndarray:
        return self._arrays[2]

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    def moe_config(self):
        """The jax_moe.MoEConfig of this case (imports jax_moe on first use)."""
        from jax_moe import MoEConfig
        return MoEConfig(**self.config)

    def seed(self, salt: str = "") -> int:
        """A stable per-case seed, e.g. for expert outputs derived from this case."""
        return zlib.crc32(f"{self.name}/{salt}".encode())

    def __repr__(self) -> str:
        return f"Case({self.name})"


def local_expert_of(ids: np.ndarray, num_experts: int, expert_map) -> np.ndarray:
    """[T, k] local expert of each route, -1 when dropped; works on any integer dtype (no wrap)."""
    table = np.arange(num_experts) if expert_map is None else np.asarray(expert_map, np.int64)
    flat = [int(v) for v in ids.reshape(-1)]
    local = [int(table[v]) if 0 <= v < num_experts else -1 for v in flat]
    return np.asarray(local, np.int64).reshape(ids.shape)


def _rows(rng: np.random.Generator, num_tokens: int, hidden: int, dtype: str) -> np.ndarray:
    """Random rows with a few exact zeros and negative zeros (their bits must survive a copy)."""
    rows = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    count = max(1, rows.size // 50)
    rows.flat[rng.integers(0, rows.size, count)] = 0.0
    rows.flat[rng.integers(0, rows.size, count)] = -0.0
    rows.flat[0] = -0.0
    return rows.astype(NUMPY_DTYPES[dtype])


def _weights(rng, ids, num_experts, expert_map, dtype, signed=False) -> np.ndarray:
    low = -1.0 if signed else 0.0
    weights = rng.uniform(low, 1.0, ids.shape).astype(np.float32)
    weights[local_expert_of(ids, num_experts, expert_map) < 0] = np.nan
    return weights.astype(NUMPY_DTYPES[dtype])


def _distinct_ids(rng, num_tokens, top_k, num_experts) -> np.ndarray:
    """Each token picks top_k distinct experts, like a router's top-k."""
    return np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)


def _case(name, *, num_experts, top_k, hidden_size, max_tokens, num_tokens=None, dtype="float32",
          weight_dtype="float32", expert_map=None, align=1, ids=None, ids_dtype="int32",
          signed_weights=False, x64=False) -> Case:
    """A case whose arrays come from a generator seeded by its name.

    ``ids``: None for distinct random experts per token, else a callable (rng, T, k, E) -> ids.
    """
    config = dict(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, max_tokens=max_tokens,
                  dtype=dtype, expert_map=None if expert_map is None else tuple(expert_map), align=align)
    num_tokens = max_tokens if num_tokens is None else num_tokens

    def make():
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        x = _rows(rng, num_tokens, hidden_size, dtype)
        if ids is None:
            topk_ids = _distinct_ids(rng, num_tokens, top_k, num_experts)
        else:
            topk_ids = np.asarray(ids(rng, num_tokens, top_k, num_experts))
        topk_ids = topk_ids.astype(ids_dtype)
        weights = _weights(rng, topk_ids, num_experts, config["expert_map"], weight_dtype, signed_weights)
        return x, topk_ids, weights

    return Case(name, config, make, x64=x64)


def _uniform(low_offset=0, high_offset=0):
    """ids uniform in [low_offset, E + high_offset): duplicates within a token allowed."""
    return lambda rng, T, k, E: rng.integers(low_offset, E + high_offset, (T, k))


def _out_of_range(rng, T, k, E):
    ids = rng.integers(0, E, (T, k)).astype(np.int64)
    bad = np.array([-1, -2, -E, E, E + 1, 1000, INT32_MIN, INT32_MAX], np.int64)
    mask = rng.random((T, k)) < 0.5
    ids[mask] = rng.choice(bad, mask.sum())
    ids[0] = bad[:k] if k <= bad.size else ids[0]
    return ids


def _wide_out_of_range(rng, T, k, E):
    """int64 ids: values >= 2**31 that would wrap onto valid experts if cast before checking."""
    ids = rng.integers(0, E, (T, k)).astype(np.int64)
    wide = np.array([2**31, 2**32, 2**32 + 1, 2**32 + E - 1, 2**40 + 3, -2**32, -2**32 + 2, 2**63 - 1,
                     -2**63], np.int64)
    mask = rng.random((T, k)) < 0.4
    ids[mask] = rng.choice(wide, mask.sum())
    ids[0, 0] = 2**32 + 1  # int32 truncation gives 1, a valid expert
    return ids


def _constant(value):
    return lambda rng, T, k, E: np.full((T, k), value, np.int64)


def _noncontiguous_map(num_experts, num_local, seed):
    """A map with -1 gaps whose local indices are a shuffled 0..num_local-1."""
    rng = np.random.default_rng(seed)
    expert_map = np.full(num_experts, -1, np.int64)
    on_device = rng.choice(num_experts, num_local, replace=False)
    expert_map[on_device] = rng.permutation(num_local)
    return tuple(int(v) for v in expert_map)


def cases() -> list[Case]:
    """Small cases covering the routing contract; the whole list runs in seconds on a CPU."""
    MAP8 = (-1, 2, -1, 0, 3, -1, 1, -1)
    return [
        # Random routing over the three row dtypes and both weight dtypes.
        _case("random_f32", num_experts=8, top_k=2, hidden_size=64, max_tokens=32),
        _case("random_bf16_w_bf16", num_experts=16, top_k=4, hidden_size=128, max_tokens=64, num_tokens=20,
              dtype="bfloat16", weight_dtype="bfloat16"),
        _case("random_f16", num_experts=8, top_k=3, hidden_size=32, max_tokens=17, dtype="float16"),
        _case("random_f16_w_bf16", num_experts=6, top_k=2, hidden_size=24, max_tokens=12, num_tokens=9,
              dtype="float16", weight_dtype="bfloat16", signed_weights=True),
        _case("random_uniform_dups_f32", num_experts=5, top_k=3, hidden_size=16, max_tokens=40,
              ids=_uniform(), signed_weights=True),
        # Every route dropped: no rows, every dest -1, every output zero.
        _case("all_dropped", num_experts=4, top_k=2, hidden_size=16, max_tokens=8,
              ids=lambda rng, T, k, E: rng.choice([-1, -5, E, E + 3, INT32_MIN, INT32_MAX], (T, k))),
        _case("all_dropped_align4_bf16", num_experts=4, top_k=3, hidden_size=8, max_tokens=8, num_tokens=5,
              dtype="bfloat16", align=4, ids=_constant(-1)),
        _case("all_dropped_by_map", num_experts=6, top_k=2, hidden_size=8, max_tokens=6,
              expert_map=(-1, 0, -1, 1, -1, 2), ids=lambda rng, T, k, E: rng.choice([0, 2, 4], (T, k))),
        # Every route to one expert (with k > 1 every token repeats it).
        _case("all_to_one_expert_bf16", num_experts=8, top_k=2, hidden_size=16, max_tokens=16,
              dtype="bfloat16", ids=_constant(5)),
        _case("all_to_one_expert_align16", num_experts=4, top_k=3, hidden_size=8, max_tokens=10,
              align=16, ids=_constant(0)),
        _case("all_to_last_expert_f16", num_experts=7, top_k=1, hidden_size=5, max_tokens=9,
              dtype="float16", ids=_constant(6)),
        # Ids out of range: negative, >= E, int32 extremes.
        _case("ids_out_of_range", num_experts=8, top_k=4, hidden_size=16, max_tokens=24, ids=_out_of_range),
        _case("ids_out_of_range_align4_bf16", num_experts=8, top_k=4, hidden_size=16, max_tokens=32,
              num_tokens=19, dtype="bfloat16", align=4, ids=_out_of_range),
        # Non-contiguous expert maps with -1 entries.
        _case("expert_map_noncontiguous_bf16", num_experts=8, top_k=3, hidden_size=16, max_tokens=20,
              dtype="bfloat16", expert_map=MAP8, ids=_uniform(-2, 2)),
        _case("expert_map_single_local_f16", num_experts=6, top_k=2, hidden_size=8, max_tokens=12,
              dtype="float16", expert_map=(-1, -1, -1, 0, -1, -1), ids=_uniform()),
        _case("expert_map_align4", num_experts=12, top_k=4, hidden_size=16, max_tokens=16, num_tokens=15,
              expert_map=_noncontiguous_map(12, 5, 1), align=4, ids=_uniform(-1, 1)),
        _case("expert_map_all_local_shuffled", num_experts=6, top_k=2, hidden_size=8, max_tokens=10,
              expert_map=(5, 3, 1, 0, 2, 4)),
        # Duplicate ids within a token's top-k.
        _case("duplicate_ids", num_experts=4, top_k=4, hidden_size=16, max_tokens=12,
              ids=lambda rng, T, k, E: np.concatenate(
                  [np.full((1, k), 1), np.array([[2, 0, 2, 2]]), rng.integers(0, 2, (T - 2, k))])),
        _case("duplicate_ids_align3_bf16", num_experts=3, top_k=3, hidden_size=8, max_tokens=9,
              dtype="bfloat16", align=3, ids=_uniform(0, -1)),
        # T = 1, T < max_tokens, T = max_tokens.
        _case("T1", num_experts=8, top_k=2, hidden_size=16, max_tokens=8, num_tokens=1),
        _case("T1_Tmax1_k1_E1", num_experts=1, top_k=1, hidden_size=4, max_tokens=1),
        _case("T_less_than_max", num_experts=8, top_k=2, hidden_size=16, max_tokens=64, num_tokens=7,
              dtype="bfloat16"),
        _case("T_equals_max", num_experts=8, top_k=2, hidden_size=16, max_tokens=24, dtype="float16"),
        # align > 1.
        _case("align4_bf16", num_experts=8, top_k=2, hidden_size=16, max_tokens=16, num_tokens=13,
              dtype="bfloat16", align=4),
        _case("align16_f16", num_experts=16, top_k=4, hidden_size=8, max_tokens=9, dtype="float16",
              align=16),
        _case("align16_sparse", num_experts=32, top_k=1, hidden_size=8, max_tokens=4, align=16),
        # Hidden sizes: scalar paths (odd row bytes) and model sizes.
        _case("H1_f32", num_experts=4, top_k=2, hidden_size=1, max_tokens=11),
        _case("H1_bf16", num_experts=4, top_k=3, hidden_size=1, max_tokens=7, dtype="bfloat16", align=2),
        _case("H3_bf16", num_experts=5, top_k=2, hidden_size=3, max_tokens=9, dtype="bfloat16"),
        _case("H3_f16", num_experts=5, top_k=2, hidden_size=3, max_tokens=9, dtype="float16",
              ids=_out_of_range),
        _case("H2880_bf16", num_experts=8, top_k=2, hidden_size=2880, max_tokens=8, num_tokens=6,
              dtype="bfloat16"),
        _case("H2880_f32_align4", num_experts=8, top_k=4, hidden_size=2880, max_tokens=4, align=4,
              ids=_uniform(-1, 1)),
        _case("H7168_bf16_w_bf16", num_experts=16, top_k=4, hidden_size=7168, max_tokens=6, num_tokens=5,
              dtype="bfloat16", weight_dtype="bfloat16"),
        _case("H7168_f16_map", num_experts=8, top_k=2, hidden_size=7168, max_tokens=3, dtype="float16",
              expert_map=MAP8),
        # Integer id dtypes other than int32.
        _case("ids_int64", num_experts=8, top_k=2, hidden_size=16, max_tokens=10, ids_dtype="int64",
              x64=True),
        _case("ids_int64_wide_out_of_range", num_experts=8, top_k=3, hidden_size=8, max_tokens=16,
              ids=_wide_out_of_range, ids_dtype="int64", x64=True),
        _case("ids_int64_wide_map_bf16", num_experts=8, top_k=2, hidden_size=8, max_tokens=12,
              dtype="bfloat16", expert_map=MAP8, ids=_wide_out_of_range, ids_dtype="int64", x64=True),
        _case("ids_uint32_wide", num_experts=8, top_k=2, hidden_size=8, max_tokens=8, ids_dtype="uint32",
              ids=lambda rng, T, k, E: np.where(rng.random((T, k)) < 0.4,
                                               rng.choice([2**31, 2**32 - 1, 2**31 + 1], (T, k)),
                                               rng.integers(0, E, (T, k)))),
        _case("ids_uint64_wide", num_experts=8, top_k=2, hidden_size=8, max_tokens=8, ids_dtype="uint64",
              ids=lambda rng, T, k, E: np.where(rng.random((T, k)) < 0.4,
                                               rng.choice(np.array([2**32 + 1, 2**63, 2**64 - 1], np.uint64), (T, k)),
                                               rng.integers(0, E, (T, k)).astype(np.uint64)),
              x64=True),
        _case("ids_int16", num_experts=8, top_k=2, hidden_size=8, max_tokens=8, ids_dtype="int16",
              ids=_uniform(-3, 3)),
        _case("ids_int8_negative", num_experts=100, top_k=3, hidden_size=8, max_tokens=8, ids_dtype="int8",
              ids=lambda rng, T, k, E: rng.integers(-128, 128, (T, k))),
        _case("ids_int8_E200", num_experts=200, top_k=2, hidden_size=4, max_tokens=8, ids_dtype="int8",
              ids=lambda rng, T, k, E: rng.integers(-128, 128, (T, k))),
        _case("ids_uint8_E300", num_experts=300, top_k=2, hidden_size=8, max_tokens=8, ids_dtype="uint8",
              ids=lambda rng, T, k, E: rng.integers(0, 256, (T, k))),
    ]


def large_cases() -> list[Case]:
    """Model-sized cases for the GPU tests (too slow for the CPU suite). Arrays build lazily."""
    return [
        _case("large_T16384_E512_k10_H7168_bf16", num_experts=512, top_k=10, hidden_size=7168,
              max_tokens=16384, dtype="bfloat16"),
        _case("large_T4096_E256_k8_H7168_bf16", num_experts=256, top_k=8, hidden_size=7168,
              max_tokens=4096, dtype="bfloat16"),
        # One expert-parallel shard of the DeepSeek-V3 shape: 32 of 256 experts local, tile-aligned.
        _case("large_ep_T1024_E256_k8_H7168_bf16_map_align16", num_experts=256, top_k=8, hidden_size=7168,
              max_tokens=1024, dtype="bfloat16", expert_map=_noncontiguous_map(256, 32, 7), align=16),
    ]


# Routing corner cases of the grouped GEMM tests (forward and backward), on a 16-expert config of
# H=256, top_k=2, max_tokens=300: keyword overrides of that MoEConfig, plus num_tokens (default 300)
# and ids(T, k) (default: random distinct experts).
GROUPED_GEMM_EDGE_CASES = {
    "T=1": dict(num_tokens=1),
    "all-rows-one-expert": dict(ids=lambda T, k: np.stack([np.full(T, 3)] + [np.full(T, -1)] * (k - 1), 1)),
    "empty-experts": dict(ids=lambda T, k: np.stack([np.arange(T) % 2 * 5 + j for j in range(k)], 1)),
    "dropped-routes": dict(ids=lambda T, k: np.where(np.arange(T * k).reshape(T, k) % 3 == 0, -1,
                                                     np.arange(T * k).reshape(T, k) % 16)),
    "align-8": dict(align=8),
    "align-8-partial-batch": dict(align=8, num_tokens=200),
    "expert-map": dict(expert_map=tuple(-1 if e % 4 == 0 else e - e // 4 - 1 for e in range(16))),
}


def grouped_gemm_edge_case(name: str) -> tuple[dict, int, np.ndarray | None]:
    """(MoEConfig keyword arguments without dtype, num_tokens, ids [T, k] or None) of a case above."""
    spec = dict(GROUPED_GEMM_EDGE_CASES[name])
    num_tokens = spec.pop("num_tokens", 300)
    ids = spec.pop("ids", None)
    config = dict(num_experts=16, top_k=2, hidden_size=256, max_tokens=300, **spec)
    return config, num_tokens, None if ids is None else ids(num_tokens, 2)


def routed_scratch(config, num_tokens: int, ids=None, seed: int = 0):
    """A scratch after a real (jitted) permute of random tokens of config.dtype: ids [T, k] as given,
    else each token's top-k of random scores (distinct experts). Imports jax on first use."""
    import jax
    import jax.numpy as jnp
    from jax_moe import init_scratch, permute

    key_x, key_ids = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key_x, (num_tokens, config.hidden_size), jnp.float32).astype(config.dtype)
    if ids is None:
        ids = jax.lax.top_k(jax.random.uniform(key_ids, (num_tokens, config.num_experts)), config.top_k)[1]
    return jax.jit(permute)(x, jnp.asarray(ids, jnp.int32), init_scratch(config))


def scaled_normal(key, shape, fan_in: int, dtype="bfloat16", quantize: bool = False, max_whole_bytes=None):
    """Standard normal draws / sqrt(fan_in) of ``shape``, in ``dtype``; with ``quantize``, the
    float32 draws as ``jax_moe.fp8.quantize`` gives them: ``(e4m3 weights, float32 block scales)``.
    Past ``max_whole_bytes`` (default ``jax_moe.params.WHOLE_DRAW_MAX_BYTES``) of float32 (DeepSeek-V3's gate/up drawn whole makes
    28 GiB arrays, which an 80 GB card does not hold beside a test), one draw per expert matrix
    from split keys (``params.draw_by_matrix``: other values, the same distribution; FP8 blocks
    never span two experts, so the layout is the whole draw's). Imports jax on first use."""
    import jax
    import jax.numpy as jnp
    from jax_moe import fp8, params

    def draw(k, shape):  # eager when whole: the division op by op, as the tests always drew (bit for bit)
        w = jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)
        return jax.jit(fp8.quantize)(w) if quantize else w.astype(dtype)

    limit = params.WHOLE_DRAW_MAX_BYTES if max_whole_bytes is None else max_whole_bytes
    return params.draw_by_matrix(key, tuple(shape), draw, limit)


def fp8_swiglu_weights(keys, num_experts: int, hidden: int, ffn: int, shared_ffn: int):
    """FP8 SwiGLU experts and a shared expert whose products have unit variance, from keys[0..3]:
    ``(gate_up, down, shared_gate_up, shared_down)``, each ``(e4m3 weights, float32 block scales)``
    in the checkpoint layout ([El, 2F, H], [El, H, F], [2Fs, H], [H, Fs]). Imports jax on first use."""
    return (scaled_normal(keys[0], (num_experts, 2 * ffn, hidden), hidden, quantize=True),
            scaled_normal(keys[1], (num_experts, hidden, ffn), ffn, quantize=True),
            scaled_normal(keys[2], (2 * shared_ffn, hidden), hidden, quantize=True),
            scaled_normal(keys[3], (hidden, shared_ffn), shared_ffn, quantize=True))
