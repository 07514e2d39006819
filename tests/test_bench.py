"""CPU smoke tests of the benchmark harness (jax_moe.bench) on tiny shapes.

They check that the harness runs end to end, that its JSON and markdown have the promised
structure, that every derived number (per layer, GB/s, % of ceiling, ratio) is computed from the
measured times, and that each program really does one op per layer (nothing folded or dead).
The numbers themselves mean nothing on CPU.
"""

import dataclasses
import json
import math
import re
from unittest import mock

import jax
import pytest

import jax.numpy as jnp

from jax_moe import MoEConfig, fp8, init_moe_params
from jax_moe.bench import cli, decode_suite, gemm_suite, permute_suite, report, stack_suite, timing, train_suite
from jax_moe.bench.models import MODELS

TINY = MODELS["tiny"]
LAYERS = (1, 3)
# HLO structure differs per backend (XLA:GPU turns sorts into library calls): counted on CPU only.
cpu_hlo_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU HLO ops")


@pytest.fixture(scope="module")
def permute_rows():
    rows, notes = permute_suite.run([TINY], (2,), timing.Clock(), compile_threads=2, layer_counts=LAYERS)
    assert notes
    return rows


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_permute_suite_runs_every_case(permute_rows):
    seen = {(r["T"], r["case"], r["scan"]) for r in permute_rows}
    for tokens in (2,):
        for case in permute_suite.SHAPE_CASES:
            for scan in permute_suite.scans_for(case, tokens):
                assert (tokens, case.name, scan) in seen
    floors = {(r["T"], r["case"], r["scan"]) for r in permute_rows if r["impl"] == "floor"}
    assert floors == {(2, c.name, s) for c in permute_suite.FLOOR_CASES for s in ("rolled", "unrolled")}
    assert not [r for r in permute_rows if "error" in r], [r["error"] for r in permute_rows if "error" in r]


def test_permute_numbers_come_from_measured_times(permute_rows):
    small, large = (str(n) for n in LAYERS)
    checked_ratio = checked_ceiling = 0
    for row in permute_rows:
        program = row["program_us"]
        assert set(program) == {small, large} and row["repeats"] >= timing.MIN_REPEATS
        assert all(v > 0 for v in program.values())
        assert _close(row["us_per_layer"], (program[large] - program[small]) / (LAYERS[1] - LAYERS[0]))
        if "gb_per_s" in row:
            assert _close(row["gb_per_s"], row["bytes"] / (row["us_per_layer"] * 1e-6) / 1e9)
        if "ratio_to_baseline" in row:
            baseline = next(r for r in permute_rows if (r["T"], r["case"], r["scan"]) ==
                            (row["T"], f"argsort/{row['op']}", row["scan"]))
            assert _close(row["ratio_to_baseline"], row["us_per_layer"] / baseline["us_per_layer"])
            checked_ratio += 1
        if "pct_of_copy_ceiling" in row:
            copy = next(r for r in permute_rows if r["T"] == row["T"] and r["case"] == "copy/copy")
            assert _close(row["ceiling_gb_per_s"], copy["gb_per_s"])
            assert _close(row["pct_of_copy_ceiling"], 100 * row["gb_per_s"] / copy["gb_per_s"])
            checked_ceiling += 1
    assert checked_ratio  # CPU noise may leave a few out, never all
    # A copy of the tiny model's rows takes nanoseconds on CPU, so its per-layer difference can
    # come out <= 0 in every row; then no percentage may be reported at all.
    copies = [r for r in permute_rows if r["case"] == "copy/copy"]
    assert checked_ceiling or all(r["us_per_layer"] <= 0 for r in copies), copies


def test_traffic_formula():
    model = MODELS["deepseek_v3"]  # E256, k8, H7168, bf16
    tokens, routes = 16, 128
    rows = (tokens + routes) * 7168 * 2
    assert permute_suite.traffic_bytes("permute", model, tokens) == rows + 12 * routes + 4 * (2 * 256 + 1)
    assert permute_suite.traffic_bytes("unpermute", model, tokens) == rows + 8 * routes
    assert permute_suite.copy_elements(model, tokens) * 2 * 2 == rows  # the copy reads and writes


# Per layer of an unrolled program: (HLO op, count per layer, count outside the layers).
PER_LAYER_OPS = {
    "jax_moe/pair": ("custom-call", 2, 0),
    "jax_moe/permute": ("custom-call", 1, 0),
    "jax_moe/unpermute": ("custom-call", 1, 1),  # plus the one permute before the loop
    "argsort/pair": ("sort", 2, 0),  # argsort and inverse argsort
    "argsort/permute": ("sort", 1, 0),
    "argsort/unpermute": ("sort", 1, 1),
    "repeat/pair": ("sort", 2, 0),
    "floor/two_noops": ("custom-call", 2, 0),
}


@cpu_hlo_only
@pytest.mark.parametrize("case_name", sorted(PER_LAYER_OPS))
def test_every_layer_does_its_work(case_name):
    """Unrolled, each layer's ops must all survive XLA's DCE and CSE (routing is per-layer input)."""
    impl, op = case_name.split("/")
    program = permute_suite.build_program(permute_suite.Case(impl, op), TINY, 4, permute_suite.UNROLLED)
    key = jax.random.PRNGKey(0)
    layers = 3
    routing = permute_suite.random_routing(key, layers, 4, TINY.num_experts, TINY.top_k)
    hlo = jax.jit(program.fn, donate_argnums=0).lower(jax.eval_shape(program.make_state, key), routing)
    compiled = hlo.compile()
    text = compiled.as_text()
    opcode, per_layer, extra = PER_LAYER_OPS[case_name]
    assert len(re.findall(rf" {opcode}\(", text)) == per_layer * layers + extra
    if case_name in ("argsort/permute", "argsort/pair"):  # group sizes (bincount) stay live too
        assert len(re.findall(r" scatter\(", text)) == layers
    if impl in ("jax_moe", "floor"):  # the harness adds no copy (bincount's zeros get one on CPU)
        assert timing.buffer_copies(compiled) == 0


@cpu_hlo_only
def test_rows_record_buffer_copies(permute_rows):
    not_donated = [r for r in permute_rows if r["case"] == "jax_moe/pair/not-donated"]
    donated = [r for r in permute_rows if r["case"] == "jax_moe/pair"]
    assert all(set(r["hlo_buffer_copies"]) == {str(n) for n in LAYERS} for r in donated + not_donated)
    assert all(v == 0 for r in donated for v in r["hlo_buffer_copies"].values())
    assert all(v > 0 for r in not_donated for v in r["hlo_buffer_copies"].values())  # copied once


def test_gemm_timing_grows_n2_until_the_op_is_above_the_noise(monkeypatch):
    # A CI run once timed the tiny dense GEMM at -2.4 µs (N2 - N1 = 3 calls under a loaded CPU's
    # noise). The harness must grow N2 until the difference is resolved, and never report <= 0.
    seen = []

    def fake(programs, state, routing, results):
        seen.append(tuple(sorted(programs)))
        return results.pop(0), state

    def timed_with(results):
        seen.clear()
        with mock.patch.object(timing, "per_layer_seconds", lambda p, s, r: fake(p, s, r, results)):
            return gemm_suite._timed(lambda a: (a + 1, (a,)), (jnp.ones(4),))

    noisy = {"per_layer_s": -2e-6, "spread_s": 3e-6, "repeats": 5}
    quiet = {"per_layer_s": 4e-6, "spread_s": 1e-6, "repeats": 5}
    got = timed_with([noisy, dict(noisy, per_layer_s=2e-6), quiet])  # 2 µs is within its 3 µs spread
    g = gemm_suite.RESOLVE_GROWTH
    n1, n2 = gemm_suite.REPEATS
    assert seen == [(n1, n2), (n1, n2 * g), (n1, n2 * g * g)] and n2 * g * g == gemm_suite.MAX_REPEATS_N2
    assert got == {"s": 4e-6, "spread_s": 1e-6, "repeats": 5, "n2": n2 * g * g}
    # At the largest N2 a positive time within its spread is reported with that spread...
    got = timed_with([noisy, noisy, dict(noisy, per_layer_s=2e-6)])
    assert got["s"] == 2e-6 and got["spread_s"] == 3e-6 and len(seen) == 3
    # ...and one still <= 0 is an error, never a row.
    with pytest.raises(RuntimeError, match="not resolved above the timing noise"):
        timed_with([noisy] * 3)
    assert seen[-1] == (n1, gemm_suite.MAX_REPEATS_N2)


def test_gemm_suite_measures_each_implementation_and_the_layer(monkeypatch):
    # 64 tokens, not fewer: the per-op time is a difference of two programs' wall times, and an
    # op of a few µs can drown in a loaded CPU's noise (seen once at 4 tokens).
    monkeypatch.setattr(gemm_suite, "LAYER_TOKENS", (64,))
    monkeypatch.setattr(gemm_suite, "GRAD_TOKENS", (64,))
    rows, notes = gemm_suite.run([TINY], (64,), timing.Clock(), compile_threads=1)
    gemm_rows = {r["impl"]: r for r in rows if "flops" in r}
    # Pallas Mosaic GPU does not run on CPU: its failure is a note, not a row.
    assert {"jax_moe", "ragged_dot", "dense"} <= set(gemm_rows), gemm_rows
    for row in gemm_rows.values():
        assert row["us"] > 0 and _close(row["tflops"], row["flops"] / row["us"] / 1e6)
        assert row["flops"] == 2 * 64 * TINY.top_k * TINY.hidden_size * 2 * TINY.ffn_size
    layer = {r["impl"]: r for r in rows if "flops" not in r}
    assert set(layer) == {"jax_moe", "baseline", "jax_moe/fwd+bwd", "baseline/fwd+bwd"}
    assert all(r["us"] > 0 for r in layer.values()), layer
    assert any(n.startswith("copy ceiling") for n in notes)
    text = gemm_suite.table(rows)
    assert "| tiny | 64 |" in text and "Whole MoE layer" in text and "fwd+bwd" in text
    assert f"| {layer['jax_moe/fwd+bwd']['us']:.0f} |" in text


def test_gemm_suite_times_the_fp8_prefill_gemm_against_bf16(monkeypatch):
    """From FP8_MIN_TOKENS up (H and F multiples of 128) jax_moe/fp8 rows for the GEMM and the whole
    layer (the same draws quantised), in the tables against bf16."""
    from jax_moe.bench.models import ModelShape
    monkeypatch.setattr(gemm_suite, "FP8_MIN_TOKENS", 32)
    model = ModelShape("tiny128", "tiny128", 4, 2, 128, ffn_size=128)
    notes = []
    rows = gemm_suite.measure_gemm(model, 32, timing.Clock(), notes)
    by = {r["impl"]: r for r in rows}
    assert by["jax_moe/fp8"]["us"] > 0 and by["jax_moe/fp8"]["flops"] == by["jax_moe"]["flops"]
    assert "jax_moe/fp8" not in {r["impl"] for r in gemm_suite.measure_gemm(model, 16, timing.Clock(), notes)}
    layer = {r["impl"]: r for r in gemm_suite.measure_layer(model, 32, timing.Clock())}
    assert layer["jax_moe/fp8"]["us"] > 0 and layer["jax_moe"]["us"] > 0
    text = gemm_suite.table(rows + list(layer.values()))
    assert "FP8 vs bf16" in text and f"{by['jax_moe']['us'] / by['jax_moe/fp8']['us']:.2f}x" in text
    assert f"{layer['jax_moe']['us'] / layer['jax_moe/fp8']['us']:.2f}x |" in text


def test_timing_loop_keeps_every_output():
    """A timed program must run every output's work: a harness that read one leaf lost the rest."""
    def fn(a, b):  # the second output is the only matrix product
        return (a + 1.0, jnp.dot(a, b)), (a, b)

    ops = (jnp.ones((64, 64)), jnp.ones((64, 64)))
    has_dot = lambda program: bool(re.search(r"\bdot\(", jax.jit(program).lower(ops).compile().as_text()))
    assert has_dot(gemm_suite.loop_program(fn, 2))
    # The flaw this guards against: consuming only the first leaf compiles the product away.
    first_leaf_only = lambda out: jax.tree.leaves(out)[0].reshape(-1)[0]
    assert not has_dot(gemm_suite.loop_program(fn, 2, consume=first_leaf_only))


def test_train_suite_runs_jax_moe_and_baseline_steps():
    rows, notes = train_suite.run([TINY], (8,), timing.Clock(), 1, with_peer=False)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"jax_moe", "baseline"}, rows
    for row in by.values():
        assert row["step_us"] > 0 and _close(row["us_per_layer"], row["step_us"] / train_suite.LAYERS["tiny"])
        assert _close(row["tflops"], row["flops_per_layer"] / row["us_per_layer"] / 1e6)
        assert row["flops_per_layer"] == 3 * 2 * 8 * TINY.top_k * TINY.hidden_size * 3 * TINY.ffn_size
        assert row["peak_bytes"] > 0
    assert any("peer: not run" in n for n in notes)
    text = train_suite.table(rows)
    assert "| tiny | 8 |" in text and f"{by['jax_moe']['us_per_layer']:,.0f}" in text


def test_decode_suite_reports_roofline_of_the_bytes_read():
    rows, notes = decode_suite.run([TINY], (1, 4, 64), timing.Clock(), 1, with_peer=False)
    # The CUTLASS-path variant only where the decode kernel is picked (elsewhere it is the same program).
    assert {(r["T"], r["impl"]) for r in rows} == {(r["T"], v) for r in rows for v in decode_suite.VARIANTS
                                                   if v == "jax_moe" or r["tile"] == "decode"}
    assert {r["tile"] for r in rows if r["T"] == 1} == {"decode"}
    assert {r["tile"] for r in rows if r["T"] == 64} != {"decode"}
    expert_bytes = 3 * TINY.hidden_size * TINY.ffn_size * 2
    for row in rows:
        assert "error" not in row, row
        # T tokens own at most T*k experts; at least one when any route is kept.
        assert 1 <= row["active_experts"] <= min(TINY.num_experts, row["T"] * TINY.top_k)
        assert row["bytes_per_layer"] > row["active_experts"] * expert_bytes  # plus the router
        assert row["flops_per_layer"] == decode_suite.layer_flops(TINY, row["T"])
        assert row["roofline_us"] == max(row["byte_roofline_us"], row["flop_roofline_us"])
        assert row["bound"] == ("bytes" if row["byte_roofline_us"] >= row["flop_roofline_us"] else "FLOPs")
        assert row["us_per_layer"] > 0 and _close(row["pct_roofline"], 100 * row["roofline_us"] / row["us_per_layer"])
    assert any("copy ceiling" in n for n in notes)
    text = decode_suite.table(rows)
    assert "roofline" in text and TINY.label in text


def test_decode_suite_roofline_is_the_longer_of_bytes_and_flops():
    """Prefill rows are bound by FLOPs where decode rows are bound by bytes; FP8 rows by their own rate."""
    deepseek = MODELS["deepseek_v3"]
    routed = 2 * 4096 * 8 * 7168 * 3 * 2048
    assert decode_suite.layer_flops(deepseek, 4096) == routed + 2 * 4096 * 7168 * 3 * 2048 + 2 * 4096 * 7168 * 256
    flops = decode_suite.layer_flops(deepseek, 4096)
    bf16 = decode_suite.roofline_fields(22.5e9, flops, 4280.0, decode_suite.DENSE_TFLOPS)
    assert bf16["bound"] == "bytes" and _close(bf16["roofline_us"], 22.5e9 / 4280e3)
    assert _close(bf16["flop_roofline_us"], flops / (decode_suite.DENSE_TFLOPS * 1e6))
    small = decode_suite.roofline_fields(1e6, flops, 4280.0, decode_suite.DENSE_TFLOPS)
    assert small["bound"] == "FLOPs" and small["roofline_us"] == small["flop_roofline_us"]
    fp8_rate = decode_suite.roofline_fields(1e6, flops, 4280.0, decode_suite.FP8_DENSE_TFLOPS)
    assert _close(fp8_rate["roofline_us"], small["roofline_us"] / 2)
    unmeasured = decode_suite.roofline_fields(1e6, flops, None, decode_suite.DENSE_TFLOPS)
    assert unmeasured["roofline_us"] is None and unmeasured["bound"] is None


def test_decode_suite_measures_each_model_in_a_process_of_its_own_when_asked():
    """isolate=True (a GPU's default for several models, so that each model's device memory is freed
    before the next): the rows come from a child process and describe the same routing as the rows
    measured here; a peer's rows pass through; a child that fails is a note, not an exception."""
    here, _ = decode_suite.run([TINY], (2,), timing.Clock(), 1, with_peer=False, isolate=False)
    peer = {2: {"us_per_layer": 123.0}}
    child = decode_suite.measure_model_in_child(TINY, (2,), None, peer, timeout_s=300)
    by_impl = {r["impl"]: r for r in child}
    assert set(by_impl) == {*(r["impl"] for r in here), "peer"}
    assert by_impl["peer"]["us_per_layer"] == 123.0
    for row in here:
        got = by_impl[row["impl"]]
        # The same draws and routing in both processes: the same experts read, bytes and tile.
        for key in ("T", "layers", "active_experts", "bytes_per_layer", "tile"):
            assert got[key] == row[key], (key, got[key], row[key])
        assert got["us_per_layer"] > 0
    with pytest.raises(ValueError, match="model"):
        decode_suite.measure_model_in_child(dataclasses.replace(TINY, ffn_size=64), (2,), None, None)
    with mock.patch.object(decode_suite.subprocess, "run", return_value=mock.Mock(returncode=1)):
        rows, notes = decode_suite.run([TINY], (2,), timing.Clock(), 1, with_peer=False, isolate=True)
    assert rows == [] and any("decode tiny: failed" in n and "status 1" in n for n in notes)


def test_stacks_fit_the_card_and_both_sides_of_the_decode_suite_use_one_count(monkeypatch):
    """layers_that_fit: the wanted count where the bf16 params fit PARAMS_SHARE of the allocator's
    limit (an H200's 0.92 x 150 GB keeps DeepSeek-V3's 4 and Qwen3.5's 8), fewer on an 80 GB card,
    never below MIN_LAYERS; the decode suite gives the peer and jax_moe the same count and notes
    the cap; the stack suite's rows carry the count it ran."""
    from jax_moe.bench import models
    deepseek, qwen35 = MODELS["deepseek_v3"], MODELS["qwen35_397b"]
    assert deepseek.layer_param_bytes() == 2 * (256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256)
    h200, h100 = 0.92 * 150.2e9, 0.92 * 85.0e9
    assert [decode_suite.stack_layers(m, h200) for m in (deepseek, qwen35)] == [4, 8]
    assert [decode_suite.stack_layers(m, None) for m in (deepseek, qwen35)] == [4, 8]
    assert [decode_suite.stack_layers(m, h100) for m in (deepseek, qwen35)] == [2, 4]
    assert deepseek.layers_that_fit(4, 1e9) == models.MIN_LAYERS  # too small: the step's OOM says so
    assert TINY.layers_that_fit(2, 1e9) == 2

    small_card = 2.5 * TINY.layer_param_bytes() / models.PARAMS_SHARE
    monkeypatch.setattr(decode_suite, "LAYERS", {**decode_suite.LAYERS, "tiny": 3})
    monkeypatch.setattr(timing, "card_bytes", lambda: small_card)
    seen = {}

    def peer(model, tokens, layers):  # records the count it is given; no rows
        seen["peer"] = layers
        return {}
    monkeypatch.setattr(decode_suite, "run_peer", peer)
    rows, notes = decode_suite.run([TINY], (2,), timing.Clock(), 1, isolate=False)
    assert seen["peer"] == 2 and {r["layers"] for r in rows} == {2}, (seen, rows)
    assert any(n.startswith("tiny: 2 layers, not 3") for n in notes), notes
    rows, _ = stack_suite.run([dataclasses.replace(TINY, stack_layers=3)], (2,), timing.Clock(), 1)
    assert rows and {r["layers"] for r in rows} == {2}, rows


def test_train_suite_sizes_the_stack_for_its_params_and_gradients(monkeypatch):
    """train_layers: LAYERS' count where the params and their gradients fit PARAMS_SHARE of the
    allocator's limit (the H200 keeps every count), one DeepSeek-V3 layer on an 80 GB card, never
    below one; the peer and jax_moe get the same count, and the notes say it was capped."""
    from jax_moe.bench import models
    names = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
    h200, h100 = 0.92 * 150.2e9, 0.92 * 85.0e9
    assert [train_suite.train_layers(MODELS[n], h200) for n in names] == [train_suite.LAYERS[n] for n in names]
    assert [train_suite.train_layers(MODELS[n], None) for n in names] == [train_suite.LAYERS[n] for n in names]
    assert [train_suite.train_layers(MODELS[n], h100) for n in names] == [4, 8, 1, 2]
    assert train_suite.train_layers(MODELS["deepseek_v3"], 1e9) == 1

    small_card = 2.5 * train_suite.TRAIN_COPIES * TINY.layer_param_bytes() / models.PARAMS_SHARE
    monkeypatch.setattr(train_suite, "LAYERS", {**train_suite.LAYERS, "tiny": 3})
    monkeypatch.setattr(timing, "card_bytes", lambda: small_card)
    seen = {}

    def peer(model, tokens, layers):  # records the count it is given; no timing
        seen["peer"] = layers
        return {"error": "not run"}
    monkeypatch.setattr(train_suite, "run_peer", peer)
    rows, notes = train_suite.run([TINY], (8,), timing.Clock(), 1)
    assert seen["peer"] == 2 and {r["layers"] for r in rows} == {2}, (seen, rows)
    assert any(n.startswith("tiny: 2 layers, not 3") for n in notes), notes


def test_decode_suite_sizes_the_scratch_for_a_server_when_asked():
    """scratch_tokens (--scratch-tokens): the step decodes T tokens on a scratch sized for more, as a
    server does on its prefill scratch; the same routing and bytes as the T-sized scratch, in this
    process and in a child's; the note says so; the CLI takes it for the decode suite only."""
    small, _ = decode_suite.run([TINY], (2,), timing.Clock(), 1, with_peer=False, isolate=False)
    rows, notes = decode_suite.run([TINY], (2,), timing.Clock(), 1, with_peer=False, isolate=False,
                                   scratch_tokens=64)
    child = decode_suite.measure_model_in_child(TINY, (2,), None, None, timeout_s=300, scratch_tokens=64)
    assert {r["scratch_tokens"] for r in small} == {2} and {r["scratch_tokens"] for r in rows + child} == {64}
    for got in (rows, child):
        for row, want in zip(got, small):
            assert "error" not in row, row
            assert (row["impl"], row["active_experts"], row["bytes_per_layer"]) == (
                want["impl"], want["active_experts"], want["bytes_per_layer"])
    assert any("max(T, 64)" in n for n in notes)
    with pytest.raises(SystemExit):
        cli.main(["--suite", "train", "--scratch-tokens", "64"])


def test_decode_suite_cutlass_variant_switches_off_every_decode_pick():
    """The `jax_moe/cutlass` column must be the decode kernel's absence everywhere it is picked:
    at T <= 2 and, over many experts, past two rows a group (the fine-grained rule)."""
    from jax_moe import gemm
    qwen3 = MODELS["qwen3_30b"]
    picks = [(qwen3.config(t).live_row_bound(t), qwen3.num_experts, qwen3.config(t).group_row_bound(t))
             for t in (1, 2, 4, 8)]
    assert all(gemm.pick_tile(*pick) == gemm.DECODE_TILE for pick in picks)
    with decode_suite.decode_kernel(False):
        assert all(gemm.pick_tile(*pick) != gemm.DECODE_TILE for pick in picks)
    assert gemm.pick_tile(*picks[-1]) == gemm.DECODE_TILE  # restored


def test_decode_suite_shared_apart_variant_switches_off_the_shared_launch(monkeypatch):
    """`jax_moe/shared-apart` must run the shared expert in launches of its own where the shipped
    path puts it in the routed experts' decode launches (a GPU's pick, forced here)."""
    from jax_moe import experts, gemm
    monkeypatch.setattr(experts, "_shared_on_decode_kernel", lambda x, ffn, max_tokens: True)
    layer = {"gate_up": None, "down": None, "shared_gate_up": None, "shared_down": jnp.zeros((8, 4))}
    assert experts.shared_rides_decode(layer, jnp.zeros((1, 4)), gemm.DECODE_TILE)
    assert not experts.shared_rides_decode(layer, jnp.zeros((1, 4)), gemm.SMALL_M_TILE)
    with decode_suite.shared_in_decode_launch(False):
        assert not experts.shared_rides_decode(layer, jnp.zeros((1, 4)), gemm.DECODE_TILE)
    assert experts.shared_rides_decode(layer, jnp.zeros((1, 4)), gemm.DECODE_TILE)  # restored


def test_decode_suite_fp8_shared_apart_variant_switches_off_the_fp8_shared_ride(monkeypatch):
    """`jax_moe/fp8-shared-apart` must run an FP8 shared expert in a call of its own where the
    shipped path streams it in the routed experts' FP8 decode launches (a GPU's pick, forced here)."""
    from jax_moe import experts
    monkeypatch.setattr(experts, "_on_fp8_decode_device", lambda x: True)
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, max_tokens=1)
    params = fp8.quantize_params(init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128))
    layer = jax.tree.map(lambda a: a[0], params)
    rides = lambda: experts.fp8_shared_rides_decode(layer, jnp.zeros((1, 256), jnp.bfloat16), 2, 8)
    assert rides()
    with decode_suite.shared_in_decode_launch(False):
        assert not rides()
    assert rides()  # restored
    without_shared = {k: v for k, v in layer.items() if not k.startswith("shared_")}
    assert not experts.fp8_shared_rides_decode(without_shared, jnp.zeros((1, 256), jnp.bfloat16), 2, 8)
    assert not experts.fp8_shared_rides_decode(layer, jnp.zeros((17, 256), jnp.bfloat16), 34, 8)  # T > 16


def test_decode_suite_times_fp8_experts_against_their_own_roofline():
    model = dataclasses.replace(TINY, name="tiny128", label="tiny 128", hidden_size=128, ffn_size=128)
    rows, _ = decode_suite.run([model], (2,), timing.Clock(), 1, with_peer=False)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {*decode_suite.VARIANTS, *decode_suite.FP8_VARIANTS}
    bf16, fp8_row = by["jax_moe"], by[decode_suite.FP8_VARIANT]
    for variant in decode_suite.FP8_VARIANTS:
        assert "error" not in by[variant] and by[variant]["us_per_layer"] > 0
    # Same draws quantised: the same routing, so the same experts read, at half the bytes plus
    # one float32 scale per 128 x 128 block (3 blocks per expert here).
    assert fp8_row["active_experts"] == bf16["active_experts"]
    saved = fp8_row["active_experts"] * (3 * 128 * 128 * 2 - (3 * 128 * 128 + 3 * 4))
    assert _close(bf16["bytes_per_layer"] - fp8_row["bytes_per_layer"], saved)
    assert _close(fp8_row["pct_roofline"], 100 * fp8_row["roofline_us"] / fp8_row["us_per_layer"])
    assert "FP8 vs bf16" in decode_suite.table(rows) and "FP8 CUTLASS path" in decode_suite.table(rows)
    assert "FP8 shared apart" in decode_suite.table(rows)


def test_measure_isolated_keeps_rows_and_notes_a_failure():
    rows, notes, saved = [{"T": 1}], [], []
    save = lambda r, n: saved.append((len(r), len(n)))  # noqa: E731
    timing.measure_isolated(rows, notes, timing.Clock(), "m: failed", lambda: [{"T": 2}], save)
    timing.measure_isolated(rows, notes, timing.Clock(), "m: failed", lambda: 1 / 0, save)
    assert rows == [{"T": 1}, {"T": 2}] and notes == ["m: failed: ZeroDivisionError: division by zero"]
    assert saved == [(2, 0), (2, 1)]  # saved after each, the failure included


def test_gemm_suite_notes_a_failing_shape_and_goes_on(monkeypatch):
    def measure_gemm(model, tokens, clock, notes):
        if tokens == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return [{"model": model.name, "T": tokens, "impl": "jax_moe", "flops": 1, "us": 1.0}]
    monkeypatch.setattr(gemm_suite, "measure_gemm", measure_gemm)
    monkeypatch.setattr(gemm_suite, "copy_ceiling_gbs", lambda clock: None)
    rows, notes = gemm_suite.run([TINY], (2, 3), timing.Clock(), compile_threads=1)
    assert [r["T"] for r in rows] == [3]
    assert any("gemm tiny T=2: failed" in n and "out of memory" in n for n in notes), notes


def test_stack_suite_runs_and_compares_to_baseline():
    rows, notes = stack_suite.run([TINY], (1,), timing.Clock(), compile_threads=2)
    assert len(rows) == len(stack_suite.VARIANTS) * 2 and notes
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    for row in rows:
        assert row["step_us_latency"] > 0 and row["step_us_back_to_back"] > 0
        assert _close(row["us_per_layer"], row["step_us_back_to_back"] / TINY.stack_layers)
        baseline = next(r for r in rows if r["variant"] == "baseline" and r["scan"] == row["scan"])
        assert _close(row["ratio_to_baseline"], row["step_us_back_to_back"] / baseline["step_us_back_to_back"])
        if row["variant"] != "baseline":
            assert row["scratch_bytes"] > 0


def test_cli_writes_json_and_markdown(tmp_path):
    records = cli.main(["--suite", "permute", "--models", "tiny", "--tokens", "1", "--layers", "1", "2",
                        "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_permute.json").read_text())
    assert record["rows"] == json.loads(json.dumps(records["permute"]["rows"]))
    meta = record["meta"]
    for key in ("device_kind", "jax", "jaxlib", "date", "command", "platform"):
        assert meta[key]
    assert meta["device_kind"] == jax.devices()[0].device_kind and meta["jax"] == jax.__version__
    assert record["bytes_formula"] == permute_suite.BYTES_FORMULA
    assert record["layer_counts"] == [1, 2]
    markdown = (tmp_path / "bench_permute.md").read_text()
    assert meta["device_kind"] in markdown and permute_suite.BYTES_FORMULA in markdown
    headers = [line for line in markdown.splitlines() if line.startswith("| T |")]
    assert len(headers) == 2  # rolled and unrolled tables of the one model
    assert "| model | T | scan | loop, trivial body |" in markdown
    pair = next(r for r in record["rows"] if r["case"] == "jax_moe/pair" and r["scan"] == "rolled")
    assert report.fmt_us(pair["us_per_layer"]) in markdown


def test_cli_selection():
    args = cli.parse_args(["--models", "tiny,mixtral", "--tokens", "1,16", "4"])
    assert args.models == ["tiny", "mixtral"] and args.tokens == [1, 16, 4]
    quick = cli.parse_args(["--quick"])
    models, tokens = cli._selection(quick, (), (), ("qwen3_30b",), (1, 16))
    assert [m.name for m in models] == ["qwen3_30b"] and tokens == (1, 16)
    assert quick.layers is None  # each suite then takes its own default (permute_suite.LAYER_COUNTS, ...)
    for bad in (["--models", "gpt5"], ["--layers", "3", "3"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
