"""CPU tests of the JAX peers in the benchmarks (jax_moe.bench.jax_peers): the GPU-only peers are skipped
with a reason, the Pallas peer's hand-written backward is right (its kernels replaced by ragged_dot's
math), the check catches a wrong gradient, and the layer-level peer is the baseline's layer."""

import importlib.util
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jax_moe import baseline
from jax_moe.bench import common, gemm_suite, jax_peers, train_suite
from jax_moe.bench.models import MODELS, ROW_DTYPE

TINY = MODELS["tiny"]
PASSED = {"forward": None, "forward+backward": None}  # check's verdicts where every output agrees
on_gpu = jax.default_backend() == "gpu"


def _operands(tokens=24, model=TINY):
    key = jax.random.key(0)
    x = jax.random.normal(key, (tokens, model.hidden_size), ROW_DTYPE)
    ids = jax_peers.uneven_ids(key, tokens, model.num_experts, model.top_k)
    gate_up = (jax.random.normal(jax.random.key(1), (model.num_experts, model.hidden_size, 2 * model.ffn_size))
               / 8).astype(ROW_DTYPE)
    down = (jax.random.normal(jax.random.key(2), (model.num_experts, model.ffn_size, model.hidden_size)) / 6
            ).astype(ROW_DTYPE)
    return x, ids, gate_up, down


def _recording_dot(what):
    """``(seen, dot)``: ragged_dot, appending ``what(rows, weights)`` of each call to ``seen``."""
    seen = []

    def dot(rows, weights, sizes):
        seen.append(what(rows, weights))
        return jax_peers.ragged_dot(rows, weights, sizes)
    return seen, dot


def _ragged_dot_math(monkeypatch, transposed=None):
    """Pallas Mosaic GPU's two kernels replaced by the same products on ragged_dot (float32 accumulation)."""
    def forward(lhs, rhs, *, group_sizes, transpose_rhs=False, **config):
        assert set(config) == set(jax_peers.MGPU_CONFIGS[0])
        return jax_peers.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)

    def weight_product(lhs, rhs, *, group_sizes, **config):  # [G, M, N]: lhs_g^T @ rhs_g
        numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return lax.ragged_dot_general(lhs, rhs, group_sizes, numbers,
                                      preferred_element_type=jnp.float32).astype(lhs.dtype)

    monkeypatch.setattr(jax_peers, "_mgpu_kernels", lambda: (forward, transposed or weight_product))


@pytest.mark.skipif(on_gpu, reason="the reasons a GPU-only peer gives elsewhere")
def test_gpu_only_peers_are_skipped_with_a_reason():
    peers = jax_peers.peers(TINY.num_experts)
    assert peers["ragged_dot"] is jax_peers.ragged_dot
    for name in ("tokamax/mosaic_gpu", "tokamax/triton", "pallas_mgpu", "transformer_engine"):
        assert isinstance(peers[name], str) and peers[name].startswith("not run: "), (name, peers[name])
    assert "triton >= 3.8" in peers["tokamax/triton"] or "does not import" in peers["tokamax/triton"]
    assert set(jax_peers.layer_peers(TINY)) == {f"baseline/{name}" for name in jax_peers.LAYER_PEERS}


def test_the_pallas_backward_is_the_gradient(monkeypatch):
    _ragged_dot_math(monkeypatch)
    assert jax_peers.check(jax_peers.mgpu_dot, *_operands()) == PASSED


def test_the_check_reports_a_wrong_gradient(monkeypatch):
    _ragged_dot_math(monkeypatch, transposed=lambda lhs, rhs, *, group_sizes, **config: jnp.zeros(
        (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), lhs.dtype))
    verdicts = jax_peers.check(jax_peers.mgpu_dot, *_operands())
    assert verdicts["forward"] is None  # a wrong weight gradient does not void the forward's row
    failure = verdicts["forward+backward"]
    assert failure.startswith("check failed on 24 tokens") and "d gate_up" in failure and "d down" in failure
    assert "d rows" not in failure and "out " not in failure


def test_the_check_fits_large_models_onto_a_subset_of_experts():
    # DeepSeek-V3's float32 gate/up gradient is 30 GB: the check ran out of memory on the H100.
    x, ids, gate_up, down = _operands()
    per_expert = 4 * gate_up.shape[1] * gate_up.shape[2]
    caps = (jax_peers.CHECK_BYTES, 3 * per_expert)
    seen, dot = _recording_dot(lambda rows, weights: weights.shape[0])
    assert jax_peers.check(dot, x, ids, gate_up, down, caps) == PASSED
    assert set(seen) == {3}
    wrong = lambda rows, weights, sizes: jax_peers.ragged_dot(rows, weights[::-1], sizes)  # noqa: E731
    assert "out" in jax_peers.check(wrong, x, ids, gate_up, down, caps)["forward"]


def test_a_check_cut_by_its_byte_cap_runs_the_first_tokens_that_fit():
    x, ids, gate_up, down = _operands(tokens=150)
    row_bytes = 4 * ids.shape[1] * gate_up.shape[0] * max(gate_up.shape[1], gate_up.shape[2])
    seen, dot = _recording_dot(lambda rows, weights: rows.shape[0])
    assert jax_peers.check(dot, x, ids, gate_up, down, (130 * row_bytes, jax_peers.CHECK_WEIGHT_BYTES)) == PASSED
    assert set(seen) == {130 * ids.shape[1]}


def test_a_check_that_raises_is_a_failed_check_of_both_passes():
    def broken(rows, weights, sizes):
        raise RuntimeError("no kernel for these shapes")
    verdicts = jax_peers.check(broken, *_operands())
    assert set(verdicts) == set(jax_peers.PASSES)
    assert all(v.startswith("check failed: RuntimeError: no kernel") for v in verdicts.values()), verdicts


def test_the_layer_peer_is_the_baseline_layer_forward_and_backward(monkeypatch):
    _ragged_dot_math(monkeypatch)
    config = TINY.config(16)
    params = common.init_stack_params(jax.random.key(3), config, 2, TINY.ffn_size)
    x = jax.random.normal(jax.random.key(4), (16, TINY.hidden_size), ROW_DTYPE)

    def loss(p, expert_fn):
        return jnp.sum(baseline.baseline_moe_stack(p, x, config, expert_fn=expert_fn).astype(jnp.float32) ** 2)

    want = jax.grad(loss)(params, None)
    got = jax.grad(loss)(params, jax_peers.swiglu_on(jax_peers.mgpu_dot))
    for name in ("gate_up", "down", "router"):
        scale = float(jnp.max(jnp.abs(want[name].astype(jnp.float32))))
        assert float(jnp.max(jnp.abs(got[name].astype(jnp.float32) - want[name]))) <= 2e-2 * scale, name


def test_tokamax_gets_whole_row_blocks_and_its_padding_leaves_the_block_unchanged(monkeypatch):
    # DeepSeek-V3's check on 1,040 rows and decode's 2-160 rows: tokamax's sm90 kernels refused them.
    seen, dot = _recording_dot(lambda rows, weights: rows.shape[0])
    fake = type(sys)("tokamax")
    fake.ragged_dot = lambda rows, weights, sizes, implementation: dot(rows, weights, sizes)
    monkeypatch.setattr(jax_peers, "_import_tokamax", lambda: (fake, ("mosaic_gpu",)))
    assert jax_peers.check(jax_peers.tokamax_dot("mosaic_gpu"), *_operands(tokens=5)) == PASSED
    assert seen and all(r % jax_peers.TOKAMAX_ROW_BLOCK == 0 for r in seen), seen


def test_tokamax_xla_path_passes_the_check():
    pytest.importorskip("tokamax")
    assert jax_peers.check(jax_peers.tokamax_dot("xla"), *_operands()) == PASSED


def test_gemm_suite_times_the_block_of_jax_moe_and_each_peer_that_runs():
    notes = []
    rows = jax_peers.measure_block(TINY, 32, common.Clock(), notes, 1.0, 1.0)
    by = {(r["impl"], r["pass"]): r for r in rows}
    expected = {(impl, p) for impl in ("jax_moe", "ragged_dot") for p in ("forward", "forward+backward")}
    assert expected <= set(by), by
    for row in rows:
        assert "error" not in row, row
        assert row["flops"] == (3 if row["pass"] == "forward+backward" else 1) * 2 * 32 * 2 * 64 * 3 * 32
        assert row["tflops"] == pytest.approx(row["flops"] / row["us"] / 1e6)
        assert row["roofline_pct"] == pytest.approx(100 * row["roofline_us"] / row["us"])
    # The backward reads the routed experts' weights again and writes every expert's gradient (1 GB/s here).
    expert_us = 3 * TINY.hidden_size * TINY.ffn_size * 2 / 1e3
    forward, training = by[("jax_moe", "forward")], by[("jax_moe", "forward+backward")]
    assert training["byte_roofline_us"] == pytest.approx(2 * forward["byte_roofline_us"] + TINY.num_experts * expert_us)
    if not on_gpu:
        skipped = {name for name in jax_peers.peers(TINY.num_experts)
                   if any(f"block {name} not run" in n for n in notes)}
        assert skipped == {"tokamax/mosaic_gpu", "tokamax/triton", "pallas_mgpu", "transformer_engine"}, notes
    table = gemm_suite.table(rows)
    assert "SwiGLU expert block" in table and "| tiny | 32 | forward+backward |" in table
    assert "ragged_dot / jax_moe" in table


def test_a_peer_with_a_wrong_weight_gradient_is_timed_forward_only(monkeypatch):
    # tokamax's weight gradients failed the check at Qwen3-30B T = 4096 on the H100; its forward passed.
    _ragged_dot_math(monkeypatch, transposed=lambda lhs, rhs, *, group_sizes, **config: jnp.zeros(
        (group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), lhs.dtype))
    monkeypatch.setattr(jax_peers, "peers", lambda num_experts: {"pallas_mgpu": jax_peers.mgpu_dot})
    rows = jax_peers.measure_block(TINY, 32, common.Clock(), [], 1.0, 1.0)
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert by[("pallas_mgpu", "forward")]["us"] > 0 and "error" not in by[("pallas_mgpu", "forward")]
    failed = by[("pallas_mgpu", "forward+backward")]
    assert "us" not in failed and failed["error"].startswith("check failed on 32 tokens"), failed


@pytest.mark.skipif(on_gpu, reason="the reasons a GPU-only peer gives elsewhere")
def test_train_suite_notes_why_each_layer_peer_did_not_run():
    rows, notes = train_suite.run([TINY], (8,), common.Clock(), with_peer=False)
    assert {r["impl"] for r in rows} == {"jax_moe", "baseline"}
    for name in jax_peers.LAYER_PEERS:
        assert any(f"tiny T=8: baseline/{name} not run: " in n for n in notes), notes


def test_xprof_stand_in_can_be_looked_up_again(monkeypatch):
    # On the H100 the stand-in's second lookup raised "xprof.__spec__ is None" and no tokamax row ran.
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    if importlib.util.find_spec("xprof") is not None:
        pytest.skip("xprof is installed: no stand-in")
    try:
        jax_peers._stand_in_for_xprof()
        jax_peers._stand_in_for_xprof()
        assert importlib.util.find_spec("xprof") is not None
        from xprof.cli.tools import get_kernel_stats_tool
        assert get_kernel_stats_tool is None
    finally:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.pop(name, None)
