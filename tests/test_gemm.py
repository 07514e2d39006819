"""grouped_matmul: the CUDA grouped GEMM against jax.lax.ragged_dot (issue 8).

On CPU the op is gemm.grouped_dot (ragged_dot's product on a CPU kernel: tests/test_grouped_dot.py),
so the CPU tests pin the contract (shapes, zero rows, checks, gradients, the layer path) against
ragged_dot; the GPU tests compare the CUTLASS kernel with a float32 ragged_dot on the groups a real
permute wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import MoEConfig, gemm, init_scratch, plan
from jax_moe.tuning import DEFAULT_TUNING
from jax_moe.bench.models import MODELS
from cases import GROUPED_GEMM_EDGE_CASES as GPU_EDGE_CASES, grouped_gemm_edge_case, routed_scratch, scaled_normal
from oracle import assert_zero_past_groups

BF16 = jnp.bfloat16


def _weights(num_experts, k, n, seed=1):
    return scaled_normal(jax.random.key(seed), (num_experts, k, n), k, BF16)


# XLA's GPU ragged_dot materialises a [rows, experts, K] bf16 operand: DeepSeek-V3 at T = 1024
# (8192 rows, 256 experts, K 7168) asked for 28 GiB and ran out of memory on an 80 GB H100.
# _reference bounds that operand by running a few experts at a time.
REFERENCE_EXPANDED_BYTES = 2**30


def _reference(rows, weights, scratch, num_rows):
    """ragged_dot over the scratch's groups: exact bf16 products, float32 sums, [num_rows, N] float32
    (rows in no group zero). (A float32 copy of DeepSeek-V3's weights made XLA's GEMM autotuner run
    out of memory on the H200.) The experts go in chunks of `per_chunk`, each chunk's rows padded to
    the longest chunk's, so one compiled program serves every full chunk."""
    num_groups, k, n = weights.shape
    offsets = np.clip(np.asarray(scratch.expert_offsets, np.int64), 0, num_rows)
    rows = np.asarray(rows[:num_rows])

    def padded_rows(per_chunk):
        return max(int(offsets[min(e + per_chunk, num_groups)] - offsets[e]) for e in range(0, num_groups, per_chunk))

    per_chunk = num_groups
    while per_chunk > 1 and max(padded_rows(per_chunk), 1) * per_chunk * k * 2 > REFERENCE_EXPANDED_BYTES:
        per_chunk = (per_chunk + 1) // 2
    chunk_rows = max(padded_rows(per_chunk), 1)
    dot = jax.jit(lambda r, w, g: jax.lax.ragged_dot(r, w, g, preferred_element_type=jnp.float32))
    out = np.zeros((num_rows, n), np.float32)
    for first in range(0, num_groups, per_chunk):
        last = min(first + per_chunk, num_groups)
        lo, hi = int(offsets[first]), int(offsets[last])
        chunk = np.zeros((chunk_rows, k), rows.dtype)
        chunk[:hi - lo] = rows[lo:hi]
        sizes = jnp.asarray(np.diff(offsets[first:last + 1]), jnp.int32)
        out[lo:hi] = np.asarray(dot(chunk, weights[first:last], sizes))[:hi - lo]
    return out


def _check(rows, weights, scratch, num_rows=None, tile=None):
    run = jax.jit(lambda r, w, s: jax_moe.grouped_matmul(r, w, s, num_rows=num_rows, tile=tile))
    out, scratch = run(rows, weights, scratch)
    out = np.asarray(out.astype(jnp.float32))
    want = _reference(rows, weights, scratch, out.shape[0])
    np.testing.assert_allclose(out, want, atol=3e-2, rtol=2e-2)
    assert_zero_past_groups(out, scratch.expert_offsets, live_nonzero=False)
    return out, scratch


# ---- contract and checks (any device) ----------------------------------------------------------

def test_matches_ragged_dot_with_padding_and_zero_tail():
    config = MoEConfig(num_experts=6, top_k=2, hidden_size=32, max_tokens=20, dtype=BF16, align=4)
    scratch = routed_scratch(config, 13)
    w = _weights(6, 32, 24)
    _check(scratch.permuted, w, scratch)
    _check(scratch.permuted, w, scratch, num_rows=30)


def test_rejects_bad_arguments():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=8, dtype=BF16)
    scratch = init_scratch(config)
    rows, w = scratch.permuted, _weights(4, 16, 8)
    cases = [
        ((rows.astype(jnp.float32), w), {}, "rows: expected dtype"),
        ((rows, w[:3]), {}, "weights: expected shape (4, 16, N)"),
        ((rows, w.astype(jnp.float16)), {}, "weights: expected rows' dtype"),
        ((rows[:, :12], _weights(4, 12, 8)), {}, "K (rows.shape[1]): expected a positive multiple of 8"),
        ((rows, _weights(4, 16, 12)), {}, "N (weights.shape[2]): expected a positive multiple of 8"),
        ((rows, w), {"num_rows": 0}, "num_rows: expected an int in [1, 16]"),
        ((rows, w), {"tile": 4}, "tile: expected one of ('small', 'medium', 'large', 'decode')"),
        ((jnp.zeros((17, 16), BF16), w), {}, "rows: expected a rank-2 array [R, K] with R <= 16"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            jax.jit(lambda r, w: jax_moe.grouped_matmul(r, w, scratch, **kwargs)[0])(*args)
    f32_scratch = init_scratch(MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=8, dtype=jnp.float32))
    with pytest.raises(ValueError, match="grouped_matmul: scratch: expected a scratch of dtype"):
        jax_moe.grouped_matmul(rows, w, f32_scratch)


def test_gradients_match_ragged_dot():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=10, dtype=BF16, align=2)
    scratch = routed_scratch(config, 7)
    rows, w = scratch.permuted, _weights(4, 16, 8)
    sizes = scratch.group_sizes
    cot = jax.random.normal(jax.random.key(3), (config.capacity, 8))

    def ours(r, w):
        return jnp.sum(jax_moe.grouped_matmul(r, w, scratch)[0].astype(jnp.float32) * cot)

    def theirs(r, w):
        return jnp.sum(jax.lax.ragged_dot(r, w, sizes, preferred_element_type=jnp.float32) * cot)

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(rows, w)
    want = jax.jit(jax.grad(theirs, argnums=(0, 1)))(rows, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32), atol=2e-2, rtol=2e-2)
    assert np.abs(np.asarray(got[1], np.float32)).sum() > 0


def test_workspace_is_reserved_only_for_gemm_dtypes():
    bf16 = MoEConfig(num_experts=256, top_k=8, hidden_size=64, max_tokens=4, dtype=BF16)
    f32 = MoEConfig(num_experts=256, top_k=8, hidden_size=64, max_tokens=4, dtype=jnp.float32)
    need = max(jax_moe._native.grouped_matmul_workspace_bytes(256), jax_moe._native.fp8_grouped_matmul_workspace_bytes(256))
    assert init_scratch(bf16).workspace.nbytes >= need  # room for the bf16 and the FP8 GEMM's arguments
    # Routing counters, then the words kept for the decode router's arrival counter.
    assert init_scratch(f32).workspace.nbytes == (256 * 2 + jax_moe.scratch.COUNTER_WORDS) * 4
    if jax_moe._native.HAS_CUDA:
        assert need > 256 * 64  # per-expert arguments and CUTLASS's per-SM descriptors


def test_tile_choice_follows_rows_per_expert():
    assert plan.pick_tile(8, 256) == gemm.DECODE_TILE        # decode: 8 rows over 256 experts
    assert plan.pick_tile(128, 128) == gemm.DECODE_TILE      # Qwen3-30B at T=16: ~1.6 rows per owner
    assert plan.pick_tile(512, 128) == gemm.SMALL_M_TILE     # Qwen3-30B at T=64: ~4
    assert plan.pick_tile(8, 8) == gemm.DECODE_TILE          # Mixtral at T=4: 1.5 rows per expert
    assert plan.pick_tile(32, 8) == gemm.SMALL_M_TILE        # Mixtral at T=16: 4
    assert plan.pick_tile(2048, 128) == gemm.SMALL_M_TILE    # 16 rows per expert
    assert plan.pick_tile(8192, 128) == gemm.MEDIUM_M_TILE   # 64 rows per expert
    assert plan.pick_tile(32768, 256) == gemm.MEDIUM_M_TILE  # 128 rows per expert
    assert plan.pick_tile(32768, 128) == gemm.MEDIUM_M_TILE  # 256 rows per expert
    assert plan.pick_tile(4096, 8) == gemm.LARGE_M_TILE      # 512
    assert plan.pick_tile(131072, 128) == gemm.LARGE_M_TILE  # 1024
    # Knowing the most rows one expert can own (T): the decode kernel up to DECODE_MAX_GROUP_ROWS.
    assert plan.pick_tile(8, 128, group_rows=1) == gemm.DECODE_TILE
    assert plan.pick_tile(16, 128, group_rows=2) == gemm.DECODE_TILE
    assert plan.pick_tile(128, 128, group_rows=16) == gemm.SMALL_M_TILE  # Qwen3-30B at T=16: 1.58 expected
    assert plan.pick_tile(8, 8, group_rows=4) == gemm.SMALL_M_TILE        # Mixtral at T=4
    # Past DECODE_MAX_GROUP_ROWS, fine-grained experts keep the decode kernel at few expected rows.
    assert plan.pick_tile(64, 256, group_rows=8) == gemm.DECODE_TILE      # DeepSeek-V3 at T=8: 1.13
    assert plan.pick_tile(16, 64, group_rows=4) == gemm.DECODE_TILE       # 64 experts, 1.12 expected
    assert plan.pick_tile(8, 32, group_rows=4) == gemm.SMALL_M_TILE       # 1.11 expected, but 32 experts
    assert plan.pick_tile(64, 128, group_rows=8) == gemm.SMALL_M_TILE     # Qwen3-30B at T=8: 1.27 ...
    light = 3 * 2048 * 768 * 2  # ... unless its owning experts are light (Qwen3-30B's: 0.5 GB)
    assert plan.pick_tile(64, 128, group_rows=8, expert_bytes=light) == gemm.DECODE_TILE
    assert plan.decode_rows_per_pass(8, 128, group_rows=2) == 2
    # ... and their rows per pass follow the expected rows, not the bound.
    assert plan.decode_rows_per_pass(8, 128, group_rows=5) == 1
    assert plan.decode_rows_per_pass(64, 128, group_rows=8) == 2
    # Rows per pass of the decode kernel: what an owning expert expects, as a power of two.
    assert [plan.decode_rows_per_pass(r, e) for r, e in [(2, 8), (8, 128), (128, 128), (32, 8), (1, 1)]] \
        == [1, 1, 2, 4, 1]
    assert plan.expected_rows_per_expert(1, 1) == 1.0


def test_gated_forward_is_the_activation_of_the_product():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=10, dtype=BF16)
    scratch = routed_scratch(config, 9)
    w = _weights(4, 16, 32)
    rows, offsets, ws = scratch.permuted, scratch.expert_offsets, scratch.workspace
    for tile in gemm.TILES:
        rows_per_pass = 2 if tile == gemm.DECODE_TILE else 0  # the decode kernel's passes: any count is exact
        got, _ = jax.jit(lambda r, w: gemm.gated_forward(r, w, offsets, ws, 18, tile, rows_per_pass))(rows, w)
        hidden, _ = gemm.forward(rows, w, offsets, ws, 18, gemm.SMALL_M_TILE)
        want = gemm.gated_silu(hidden, BF16)
        assert got.shape == (18, 16)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)


def test_decode_forward_with_shared_is_the_two_products():
    """Off CUDA: the routed product of gemm.forward / gated_forward and XLA's dense product of x,
    in one call; and swiglu_decode_with_shared differentiates as the two experts apart."""
    from jax_moe import experts
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=2, dtype=BF16)
    scratch = routed_scratch(config, 2)
    rows, offsets, ws = scratch.permuted, scratch.expert_offsets, scratch.workspace
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16)), BF16)
    up, shared_up = _weights(4, 16, 32), _weights(1, 16, 48, seed=2)[0]
    for gated in (False, True):
        out, shared = jax.jit(lambda r, t, g=gated: gemm.decode_forward_with_shared(
            r, up, offsets, 4, t, shared_up, gated=g, rows_per_pass=2))(rows, x)
        product = jnp.dot(x, shared_up, preferred_element_type=jnp.float32).astype(BF16)
        want_out = (gemm.gated_forward if gated else gemm.forward)(rows, up, offsets, ws, 4, gemm.DECODE_TILE, 2)[0]
        want_shared = gemm.gated_silu(product, BF16) if gated else product
        assert out.shape == want_out.shape and shared.shape == want_shared.shape
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
        np.testing.assert_array_equal(np.asarray(shared, np.float32), np.asarray(want_shared, np.float32))

    down, shared_down = _weights(4, 16, 16, seed=3), _weights(1, 24, 16, seed=4)[0]
    layer = {"shared_gate_up": shared_up, "shared_down": shared_down, "shared_gate": _weights(1, 16, 1, seed=5)[0]}

    def fused(r, w1, w2, t, sw1, sw2):
        params = dict(layer, shared_gate_up=sw1, shared_down=sw2)
        out, shared, _ = experts.swiglu_decode_with_shared(r, w1, w2, offsets, ws, 4, 2, params, t)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(shared.astype(jnp.float32) ** 2)

    def apart(r, w1, w2, t, sw1, sw2):
        params = dict(layer, shared_gate_up=sw1, shared_down=sw2)
        out, _ = experts._swiglu_grouped(r, w1, w2, offsets, ws, 4, gemm.DECODE_TILE, 2)
        shared = experts._gate_shared(params, t, experts._shared_swiglu_decode(t, sw1, sw2, 2))
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(shared.astype(jnp.float32) ** 2)

    operands = (rows, up, down, x, shared_up, shared_down)
    for bad, message in (((rows, up, offsets, 4, x.astype(jnp.float32), shared_up), "x: expected a bf16 array"),
                         ((rows, up[:, :8], offsets, 4, x, shared_up), "weights: expected [El, K=16, N]"),
                         ((rows, up, offsets, 4, x, shared_up[:, :40]), "shared_weights: expected [Ks=16, Ns]")):
        with pytest.raises(ValueError, match=re.escape(f"decode_forward_with_shared: {message}")):
            gemm.decode_forward_with_shared(*bad, gated=True, rows_per_pass=2)
    got = jax.jit(jax.value_and_grad(fused, argnums=range(6)))(*operands)
    want = jax.jit(jax.value_and_grad(apart, argnums=range(6)))(*operands)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(w.astype(jnp.float32)))) > 0
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=1e-3)


# ---- the CUDA kernel ----------------------------------------------------------------------------

def _model_config(name, max_tokens, **overrides):
    m = MODELS[name]
    return MoEConfig(num_experts=m.num_experts, top_k=m.top_k, hidden_size=m.hidden_size, max_tokens=max_tokens,
                     dtype=BF16, **overrides), m.ffn_size


GPU_SHAPES = [("mixtral", 64), ("mixtral", 1024), ("qwen3_30b", 64), ("qwen3_30b", 4096), ("deepseek_v3", 64),
              ("deepseek_v3", 1024), ("qwen35_397b", 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_tokens", GPU_SHAPES, ids=[f"{n}-T{t}" for n, t in GPU_SHAPES])
def test_gpu_model_shapes_match_ragged_dot(name, num_tokens):
    config, ffn = _model_config(name, num_tokens)
    scratch = routed_scratch(config, num_tokens)
    up = _weights(config.num_experts, config.hidden_size, 2 * ffn)
    hidden, scratch = _check(scratch.permuted, up, scratch)
    if plan.pick_tile(config.capacity, config.num_experts) == gemm.DECODE_TILE:
        _check(scratch.permuted, up, scratch, tile=gemm.SMALL_M_TILE)  # the other kernel agrees too
        _check_gated(scratch.permuted, up, scratch)
    del up
    down = _weights(config.num_experts, ffn, config.hidden_size, seed=2)
    _check(jnp.asarray(hidden[:, :ffn], BF16), down, scratch)


def _check_gated(rows, gate_up, scratch, num_rows=None):
    """The decode kernel's SwiGLU epilogue against gated_silu of a float32 ragged_dot rounded to bf16."""
    num_rows = num_rows or rows.shape[0]
    rows_per_pass = plan.decode_rows_per_pass(num_rows, gate_up.shape[0])
    run = jax.jit(lambda r, w, s: gemm.gated_forward(r, w, s.expert_offsets, s.workspace, num_rows,
                                                     gemm.DECODE_TILE, rows_per_pass)[0])
    got = np.asarray(run(rows, gate_up, scratch), np.float32)
    hidden = _reference(rows, gate_up, scratch, num_rows)
    want = np.asarray(gemm.gated_silu(jnp.asarray(hidden, BF16), jnp.float32))
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    assert_zero_past_groups(got, scratch.expert_offsets)


DECODE_SHAPES = [(name, t) for name in ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b") for t in (1, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_tokens", DECODE_SHAPES, ids=[f"{n}-T{t}" for n, t in DECODE_SHAPES])
def test_gpu_decode_kernel_model_shapes(name, num_tokens):
    """Decode sizes of the four models: plain and gated products of the decode kernel, both projections
    (at T=16 pick_tile may prefer CUTLASS: the decode kernel is asked for explicitly)."""
    config, ffn = _model_config(name, num_tokens)
    scratch = routed_scratch(config, num_tokens)
    if num_tokens == 1:
        assert plan.pick_tile(config.capacity, config.num_experts, config.group_row_bound(1)) == gemm.DECODE_TILE
    up = _weights(config.num_experts, config.hidden_size, 2 * ffn)
    hidden, scratch = _check(scratch.permuted, up, scratch, tile=gemm.DECODE_TILE)
    _check_gated(scratch.permuted, up, scratch)
    del up
    down = _weights(config.num_experts, ffn, config.hidden_size, seed=2)
    _check(jnp.asarray(hidden[:, :ffn], BF16), down, scratch, tile=gemm.DECODE_TILE)


@pytest.mark.gpu
def test_gpu_decode_kernel_passes_over_uneven_groups():
    """Experts owning 0 to 11 rows (a popular expert takes several passes, each a block of its own):
    plain and gated products at every rows_per_pass match ragged_dot, rows in no group zero."""
    config = MoEConfig(num_experts=16, top_k=1, hidden_size=256, max_tokens=64, dtype=BF16)
    counts = [11, 1, 0, 7, 3, 0, 2, 9, 1, 0, 5, 4, 0, 8, 1, 2]
    scratch = routed_scratch(config, sum(counts), np.repeat(np.arange(16), counts)[:, None])
    up = _weights(16, 256, 512)
    want = _reference(scratch.permuted, up, scratch, 64)
    want_gated = np.asarray(gemm.gated_silu(jnp.asarray(want, BF16), jnp.float32))
    for rows_per_pass in (1, 2, 4, 8):
        for op, expected in ((gemm.forward, want), (gemm.gated_forward, want_gated)):
            got = jax.jit(lambda r, w, s, op=op: op(r, w, s.expert_offsets, s.workspace, 64, gemm.DECODE_TILE,
                                                    rows_per_pass)[0])(scratch.permuted, up, scratch)
            got = np.asarray(got, np.float32)
            np.testing.assert_allclose(got, expected, atol=3e-2, rtol=3e-2,
                                       err_msg=f"{op.__name__}, rows_per_pass {rows_per_pass}")
            assert_zero_past_groups(got, scratch.expert_offsets)


@pytest.mark.gpu
def test_gpu_decode_kernel_more_passes_than_a_grid_holds():
    """70,000 rows over 4 experts at one row a pass would need more blocks than a grid's y extent:
    the kernel then gives each expert a slot and passes over its rows in turn."""
    config = MoEConfig(num_experts=4, top_k=1, hidden_size=64, max_tokens=70_000, dtype=BF16)
    scratch = routed_scratch(config, 70_000, np.arange(70_000)[:, None] % 3)
    up = _weights(4, 64, 64)
    out = jax.jit(lambda r, w, s: gemm.forward(r, w, s.expert_offsets, s.workspace, 70_000, gemm.DECODE_TILE, 1)[0])(
        scratch.permuted, up, scratch)
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, _reference(scratch.permuted, up, scratch, 70_000), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_EDGE_CASES))
def test_gpu_edge_cases_match_ragged_dot(case):
    kwargs, num_tokens, ids = grouped_gemm_edge_case(case)
    config = MoEConfig(dtype=BF16, **kwargs)
    scratch = routed_scratch(config, num_tokens, ids)
    w = _weights(config.num_local_experts, 256, 512)
    _check(scratch.permuted, w, scratch)
    _check(scratch.permuted, w, scratch, num_rows=config.live_row_bound(num_tokens))
    # The decode kernel on the same groups (up to hundreds of rows per expert: several passes).
    _check(scratch.permuted, w, scratch, tile=gemm.DECODE_TILE)
    _check(scratch.permuted, w, scratch, num_rows=config.live_row_bound(num_tokens), tile=gemm.DECODE_TILE)
    _check_gated(scratch.permuted, w, scratch)


# K and N off the tiles' multiples: the 128 x 256 tile's 1x2 cluster has an odd count of N tiles
# (768 = 3 tiles, 264 = 2 with a partial one), the K tail is partial (264), and N = 8 is one column
# group. Each on the small tile (T=16), the medium one (T=300: 75 rows per expert) and the large one
# (T=2048: 512 rows per expert).
ODD_TILE_SHAPES = [(512, 768), (264, 264), (256, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 8])
def test_gpu_shared_expert_on_the_decode_kernel(num_tokens):
    """DeepSeek-V3's shared expert (H 7168, width 2048) at decode sizes: the decode kernel (one group
    of T rows, one pass) against XLA's float32 dots; shared_experts runs it where the plan says
    "decode_kernel" and XLA's dots where it says "xla"."""
    from jax_moe import experts
    rng = np.random.default_rng(num_tokens)
    x = jnp.asarray(rng.standard_normal((num_tokens, 7168)), BF16)
    gate_up = _weights(1, 7168, 4096, seed=3)[0]
    down = _weights(1, 2048, 7168, seed=4)[0]
    rows_per_pass = plan.decode_rows_per_pass(num_tokens, 1, num_tokens)
    got = np.asarray(jax.jit(experts._shared_swiglu_decode, static_argnums=3)(x, gate_up, down, rows_per_pass),
                     np.float32)
    want = np.asarray(jax.jit(experts._shared_swiglu)(x, gate_up, down), np.float32)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    params = {"shared_gate_up": gate_up, "shared_down": down}
    on_kernel = plan.LayerPlan(num_tokens, shared="decode_kernel", shared_decode_rows_per_pass=rows_per_pass)
    for shared_plan, launches in ((on_kernel, 2), (on_kernel.replace(shared="xla"), 0)):
        hlo = jax.jit(lambda p, x: experts.shared_experts(p, x, shared_plan)).lower(params, x).compile().as_text()
        assert hlo.count('custom_call_target="jax_moe_decode_matmul"') == launches


@pytest.mark.gpu
def test_gpu_stack_runs_the_shared_expert_on_decode_launches_of_its_own():
    """Past the tuning's decode_max_group_rows tokens (so not riding the routed launches) and up to
    its shared_decode_max_tokens, the inference stack's gated shared expert takes two decode
    launches of its own; against the same stack with it on XLA's dots (a plan that says so) the
    output is within bf16 rounding, and that program has two decode launches fewer."""
    from jax_moe import init_moe_params, moe_stack
    num_tokens = 5
    assert DEFAULT_TUNING.decode_max_group_rows < num_tokens <= DEFAULT_TUNING.shared_decode_max_tokens
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=256, max_tokens=num_tokens, dtype=BF16)
    params = init_moe_params(jax.random.key(0), config, 2, 128, shared_ffn_size=256, shared_gate=True)
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(BF16)

    stack_plan = jax_moe.plan_layer(config, num_tokens, params)
    assert stack_plan.shared == "decode_kernel"

    def run(layer_plan):
        # One compile: the program's text and its output from the same executable.
        step = jax.jit(lambda p, x, s: moe_stack(p, x, s, plan=layer_plan)[0]).lower(
            params, x, init_scratch(config)).compile()
        return np.asarray(step(params, x, init_scratch(config)), np.float32), step.as_text().count(
            'custom_call_target="jax_moe_decode_matmul"')

    got, launches = run(stack_plan)
    want, launches_on_xla = run(stack_plan.replace(shared="xla"))
    assert launches == launches_on_xla + 2, (launches, launches_on_xla)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert np.abs(want - np.asarray(x, np.float32)).max() > 1e-2  # the layers add something


# (model or (E, k, H, F), Fs, T): DeepSeek-V3 and Qwen3.5's shared experts; a shared expert wider
# than the routed ones (the grid spans it) with one expert owning every row (align 8, 3 passes).
SHARED_LAUNCH_CASES = [("deepseek_v3", 2048, 1), ("deepseek_v3", 2048, 2), ("qwen35_397b", 512, 1),
                       ((4, 1, 256, 128), 384, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("model,shared_ffn,num_tokens", SHARED_LAUNCH_CASES,
                         ids=["deepseek_v3-T1", "deepseek_v3-T2", "qwen35_397b-T1", "wide-shared-T2"])
def test_gpu_shared_expert_rides_the_routed_decode_launch(model, shared_ffn, num_tokens):
    """gemm.decode_forward_with_shared on the GPU: the routed rows against ragged_dot (zero past
    the groups), the shared rows against XLA's float32 dot, gated and plain; moe_layer then makes
    two decode launches with the shared expert in them and none of its own."""
    if isinstance(model, str):
        config, ffn = _model_config(model, num_tokens)
        scratch = routed_scratch(config, num_tokens)
    else:
        (num_experts, top_k, hidden, ffn) = model
        config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, max_tokens=num_tokens,
                           dtype=BF16, align=8)
        scratch = routed_scratch(config, num_tokens, np.zeros((num_tokens, 1), np.int32))
    hidden = config.hidden_size
    num_rows, group_rows = config.live_row_bound(num_tokens), config.group_row_bound(num_tokens)
    rows_per_pass = max(plan.decode_rows_per_pass(num_rows, config.num_experts, group_rows),
                        plan.decode_rows_per_pass(num_tokens, 1, num_tokens))
    x = jnp.asarray(np.random.default_rng(num_tokens).standard_normal((num_tokens, hidden)), BF16)
    shared_up, shared_down = _weights(1, hidden, 2 * shared_ffn, seed=3)[0], _weights(1, shared_ffn, hidden, seed=4)[0]
    up = _weights(config.num_experts, hidden, 2 * ffn)
    run = jax.jit(lambda r, w, t, sw, gated: gemm.decode_forward_with_shared(
        r, w, scratch.expert_offsets, num_rows, t, sw, gated=gated, rows_per_pass=rows_per_pass), static_argnums=4)
    activated, shared_activated = run(scratch.permuted, up, x, shared_up, True)
    hidden_rows = _reference(scratch.permuted, up, scratch, num_rows)
    want = np.asarray(gemm.gated_silu(jnp.asarray(hidden_rows, BF16), jnp.float32))
    np.testing.assert_allclose(np.asarray(activated, np.float32), want, atol=3e-2, rtol=3e-2)
    assert_zero_past_groups(np.asarray(activated, np.float32), scratch.expert_offsets, live_nonzero=False)
    dense = jnp.dot(x, shared_up, preferred_element_type=jnp.float32).astype(BF16)
    want_shared = np.asarray(gemm.gated_silu(dense, jnp.float32))
    np.testing.assert_allclose(np.asarray(shared_activated, np.float32), want_shared, atol=3e-2, rtol=3e-2)
    del up
    down = _weights(config.num_experts, ffn, hidden, seed=2)
    out, shared_out = run(activated, down, shared_activated, shared_down, False)
    np.testing.assert_allclose(np.asarray(out, np.float32), _reference(activated, down, scratch, num_rows),
                               atol=3e-2, rtol=3e-2)
    assert_zero_past_groups(np.asarray(out, np.float32), scratch.expert_offsets, live_nonzero=False)
    want_out = np.asarray(jnp.dot(shared_activated, shared_down, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(np.asarray(shared_out, np.float32), want_out, atol=3e-2, rtol=3e-2)

    if isinstance(model, str):  # the layer takes it: two launches, the shared expert in both
        layer = {"router": _weights(1, hidden, config.num_experts, seed=5)[0], "gate_up": _weights(
            config.num_experts, hidden, 2 * ffn), "down": down, "shared_gate_up": shared_up, "shared_down": shared_down}
        assert jax_moe.plan_layer(config, num_tokens, layer).shared == "routed_launch"
        hlo = jax.jit(jax_moe.moe_layer).lower(layer, x, init_scratch(config)).compile().as_text()
        assert hlo.count("custom_call_target=\"jax_moe_decode_matmul_shared\"") == 2, hlo.count("decode_matmul")
        assert "custom_call_target=\"jax_moe_decode_matmul\"" not in hlo


TILE_CASES = [(16, gemm.SMALL_M_TILE), (300, gemm.MEDIUM_M_TILE), (2048, gemm.LARGE_M_TILE), (16, gemm.DECODE_TILE),
              (300, gemm.DECODE_TILE)]
TILE_IDS = ["small-tile", "medium-tile", "large-tile", "decode", "decode-many-rows"]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,tile", TILE_CASES, ids=TILE_IDS)
@pytest.mark.parametrize("k,n", ODD_TILE_SHAPES, ids=[f"K{k}-N{n}" for k, n in ODD_TILE_SHAPES])
def test_gpu_partial_tiles_match_ragged_dot(k, n, num_tokens, tile):
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=k, max_tokens=num_tokens, dtype=BF16)
    scratch = routed_scratch(config, num_tokens)
    _check(scratch.permuted, _weights(8, k, n), scratch, tile=tile)
    if tile == gemm.DECODE_TILE and n % 16 == 0:
        _check_gated(scratch.permuted, _weights(8, k, n), scratch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,tile", TILE_CASES, ids=TILE_IDS)
def test_gpu_repeat_runs_are_bitwise_equal(num_tokens, tile):
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=512, max_tokens=num_tokens, dtype=BF16)
    scratch = routed_scratch(config, num_tokens)
    w = _weights(8, 512, 1024)
    run = jax.jit(lambda r, w, s: jax_moe.grouped_matmul(r, w, s, tile=tile), donate_argnums=2)
    rows = jnp.array(scratch.permuted)
    first, scratch = run(rows, w, scratch)
    second, scratch = run(rows, w, scratch)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.mark.gpu
def test_gpu_moe_layer_uses_the_grouped_gemm_and_matches_the_baseline():
    from jax_moe.baseline import baseline_moe_layer
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=64, dtype=BF16, align=8)
    params = jax_moe.init_moe_params(jax.random.key(0), config, 2, 128)
    layer_params = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (40, 256)).astype(BF16)
    scratch = init_scratch(config)
    step = jax.jit(jax_moe.moe_layer, donate_argnums=2)
    assert "jax_moe_grouped_matmul" in step.lower(layer_params, x, scratch).compile().as_text()
    y, scratch = step(layer_params, x, scratch)
    want = baseline_moe_layer(layer_params, x, config)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), atol=5e-2, rtol=5e-2)
    # Training through it: finite gradients close to the baseline's.
    loss = lambda p, s: jnp.sum(jax_moe.moe_layer(p, x, s)[0].astype(jnp.float32) ** 2)
    base = lambda p: jnp.sum(baseline_moe_layer(p, x, config).astype(jnp.float32) ** 2)
    got = jax.jit(jax.grad(loss))(layer_params, scratch)
    want = jax.jit(jax.grad(base))(layer_params)
    for name in ("gate_up", "down"):
        g, h = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        assert np.isfinite(g).all()
        assert np.linalg.norm(g - h) <= 0.05 * np.linalg.norm(h), name


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jax_moe
    config = jax_moe.MoEConfig(num_experts=8, top_k=2, hidden_size=128, max_tokens=64, dtype=jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (8, 128, 256)) / 12).astype(jnp.bfloat16)

    @jax.jit
    def step(x, ids, w, s):
        s = jax_moe.permute(x, ids, s)
        out, s = jax_moe.grouped_matmul(s.permuted, w, s)
        return out, s

    s = jax_moe.init_scratch(config)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
        ids = jnp.asarray(rng.integers(0, 8 if seed % 2 else 3, (64, 2)), jnp.int32)
        out, s = step(x, ids, w, s)
        sizes = jnp.diff(s.expert_offsets)
        want = jax.lax.ragged_dot(s.permuted, w, sizes, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2, rtol=2e-2)
    print("command buffer runs match")
""")


@pytest.mark.gpu
def test_gpu_command_buffer_with_changing_groups():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    result = subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "command buffer runs match" in result.stdout
