"""CPU tests of the benchmark harness (jax_moe.bench) on tiny shapes.

They check that each suite runs end to end, that every derived number (per layer, GB/s, % of a
ceiling, ratios, rooflines) is computed from the measured times, that each timed program does its
work in every layer (nothing folded or dead), and where the CLI writes. The numbers mean nothing on CPU.
"""

import dataclasses
import json
import math
import pathlib
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import pytest

import jax_moe
from jax_moe.bench import cli, common, decode_suite, gemm_suite, permute_suite, stack_suite, train_suite
from jax_moe.bench.models import MIN_LAYERS, MODELS, PARAMS_SHARE, stack_counts

TINY = MODELS["tiny"]
TINY128 = dataclasses.replace(TINY, name="tiny128", label="tiny 128", num_experts=4, hidden_size=128, ffn_size=128)
LAYERS = (1, 3)
# HLO structure differs per backend (XLA:GPU turns sorts into library calls): counted on CPU only.
cpu_hlo_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU HLO ops")


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@pytest.fixture(scope="module")
def permute_rows():
    rows, _ = permute_suite.run([TINY], (2,), common.Clock(), compile_threads=2, layer_counts=LAYERS)
    return rows


def test_permute_suite_runs_every_case_from_measured_times(permute_rows):
    assert {(r["case"], r["scan"]) for r in permute_rows} == {
        (c, s) for c in permute_suite.CASES for s in ("rolled", "unrolled") if s == "rolled" or c != "copy/copy"}
    assert not [r for r in permute_rows if "error" in r], [r["error"] for r in permute_rows if "error" in r]
    small, large = (str(n) for n in LAYERS)
    ratios = ceilings = 0
    for row in permute_rows:
        assert row["repeats"] >= common.MIN_REPEATS and all(v > 0 for v in row["program_us"].values())
        per_layer = (row["program_us"][large] - row["program_us"][small]) / (LAYERS[1] - LAYERS[0])
        assert _close(row["us_per_layer"], per_layer)
        if "gb_per_s" in row:
            assert _close(row["gb_per_s"], row["bytes"] / (row["us_per_layer"] * 1e-6) / 1e9)
        if "ratio_to_baseline" in row:
            base = next(r for r in permute_rows if (r["case"], r["scan"]) == (f"argsort/{row['op']}", row["scan"]))
            assert _close(row["ratio_to_baseline"], row["us_per_layer"] / base["us_per_layer"])
            ratios += 1
        if "pct_of_copy_ceiling" in row:
            copy = next(r for r in permute_rows if r["case"] == "copy/copy")
            assert _close(row["pct_of_copy_ceiling"], 100 * row["gb_per_s"] / copy["gb_per_s"])
            ceilings += 1
    assert ratios  # CPU noise may leave some out, never all
    copy = next(r for r in permute_rows if r["case"] == "copy/copy")  # a copy of nanoseconds may come out <= 0
    assert ceilings or copy["us_per_layer"] <= 0, copy
    text = permute_suite.table(permute_rows)
    assert "| tiny | rolled | 2 |" in text and common.fmt_us(permute_rows[0]["us_per_layer"]) in text


def test_traffic_formula():
    deepseek, tokens, routes = MODELS["deepseek_v3"], 16, 128  # E256, k8, H7168, bf16
    rows = (tokens + routes) * 7168 * 2
    assert permute_suite.traffic_bytes("permute", deepseek, tokens) == rows + 12 * routes + 4 * (2 * 256 + 1)
    assert permute_suite.traffic_bytes("unpermute", deepseek, tokens) == rows + 8 * routes
    assert permute_suite.traffic_bytes("copy", deepseek, tokens) == rows  # it reads and writes half of that


# Per layer of an unrolled program: (HLO op, count per layer, count outside the layers).
PER_LAYER_OPS = {
    "jax_moe/pair": ("custom-call", 2, 0),
    "jax_moe/permute": ("custom-call", 1, 0),
    "jax_moe/unpermute": ("custom-call", 1, 1),  # and the one permute before the loop
    "argsort/pair": ("sort", 2, 0),  # argsort and inverse argsort
    "argsort/permute": ("sort", 1, 0),
    "argsort/unpermute": ("sort", 1, 1),
    "repeat/pair": ("sort", 2, 0),
}


@cpu_hlo_only
@pytest.mark.parametrize("case_name", sorted(PER_LAYER_OPS))
def test_every_layer_does_its_work(case_name):
    """Unrolled, each layer's ops must all survive XLA's DCE and CSE (the routing is a per-layer input)."""
    layers, impl = 3, case_name.split("/")[0]
    routing = permute_suite.random_routing(jax.random.key(0), layers, 4, TINY.num_experts, TINY.top_k)
    program = permute_suite.build_program(case_name, TINY, 4, permute_suite.UNROLLED, {layers: routing})
    compiled = jax.jit(program.fn, donate_argnums=0).lower(program.make_state(), routing).compile()
    opcode, per_layer, extra = PER_LAYER_OPS[case_name]
    assert len(re.findall(rf" {opcode}\(", compiled.as_text())) == per_layer * layers + extra
    if case_name in ("argsort/permute", "argsort/pair"):  # group sizes (bincount) stay live too
        assert len(re.findall(r" scatter\(", compiled.as_text())) == layers
    if impl == "jax_moe":  # the harness adds no copy
        assert common.buffer_copies(compiled) == 0


@cpu_hlo_only
def test_rows_record_buffer_copies(permute_rows):
    copies = {r["case"]: r["hlo_buffer_copies"] for r in permute_rows if r["case"].startswith("jax_moe/pair")}
    assert all(v == 0 for v in copies["jax_moe/pair"].values())
    assert all(v > 0 for v in copies["jax_moe/pair/not-donated"].values())  # the scratch copied once


def test_device_copy_is_neither_hoisted_nor_dropped():
    """Without the bench module the copy ceiling is an XLA elementwise pass that a loop must redo."""
    def loop(buffer, salts):
        return jax.lax.scan(lambda b, s: (common.device_copy(buffer, s), None), buffer, salts)[0]
    text = jax.jit(loop).lower(jnp.ones(64, jnp.bfloat16), jnp.zeros(3, jnp.int32)).compile().as_text()
    body = text[text.index("while_body") if "while_body" in text else 0:]
    assert common.HAS_BENCH or re.search(r" add\(", body), text
    notes = []
    copy_gbs, dense_tflops = common.ceilings(common.Clock(), notes)
    assert copy_gbs > 0 and dense_tflops > 0 and common.COPY_KIND in notes[0]


def test_copy_ceiling_counts_bytes_read_and_written(monkeypatch):
    # A copy of N bytes moves 2N over the memory bus; counting N halved the rate and doubled byte rooflines.
    copied = []

    def one_second(fn, operands, **_):
        copied.append(operands[0].nbytes)
        return {"s": 1.0}
    monkeypatch.setattr(common, "loop_seconds", one_second)
    copy_gbs, _ = common.ceilings(common.Clock(), [], trials=1)
    assert copy_gbs == 2 * copied[0] / 1e9


def test_loop_timing_grows_n2_until_the_call_is_above_the_noise():
    # A CI run once timed a tiny dense GEMM at -2.4 µs (N2 - N1 = 3 calls under a loaded CPU's noise).
    seen = []

    def timed_with(results):
        seen.clear()

        def measure(programs, state, xs):
            seen.append(tuple(sorted(programs)))
            return results.pop(0), state
        return common.loop_seconds(lambda a: (a + 1, (a,)), (jnp.ones(4),), measure=measure)

    noisy = {"per_layer_s": -2e-6, "spread_s": 3e-6, "repeats": 5}
    quiet = {"per_layer_s": 4e-6, "spread_s": 1e-6, "repeats": 5}
    got = timed_with([noisy, dict(noisy, per_layer_s=2e-6), quiet])  # 2 µs is within its 3 µs spread
    (n1, n2), g = common.LOOP_COUNTS, common.LOOP_GROWTH
    assert seen == [(n1, n2), (n1, n2 * g), (n1, n2 * g * g)] and n2 * g * g == common.LOOP_MAX_CALLS
    assert got == {"s": 4e-6, "spread_s": 1e-6, "repeats": 5, "n2": n2 * g * g}
    got = timed_with([noisy, noisy, dict(noisy, per_layer_s=2e-6)])  # at the largest N2: reported with its spread
    assert got["s"] == 2e-6 and got["spread_s"] == 3e-6
    with pytest.raises(RuntimeError, match="not resolved above the timing noise"):
        timed_with([noisy] * 3)


def test_timing_loop_keeps_every_output():
    """A timed program must run every output's work: a harness that read one leaf lost the rest."""
    def fn(a, b):  # the second output is the only matrix product
        return (a + 1.0, jnp.dot(a, b)), (a, b)

    ops = (jnp.ones((64, 64)), jnp.ones((64, 64)))
    has_dot = lambda program: bool(re.search(r"\bdot\(", jax.jit(program).lower(ops).compile().as_text()))  # noqa: E731
    assert has_dot(common.loop_program(fn, 2))
    assert not has_dot(common.loop_program(fn, 2, consume=lambda out: jax.tree.leaves(out)[0].reshape(-1)[0]))


def test_gemm_suite_measures_each_implementation():
    # 64 tokens, not fewer: an op of a few µs can drown in a loaded CPU's noise.
    notes = []
    rows = {r["impl"]: r for r in gemm_suite.measure(TINY, 64, common.Clock(), notes, copy_gbs=1.0)}
    assert {"jax_moe", "ragged_dot", "dense"} <= set(rows), rows
    if jax.default_backend() != "gpu":  # the GPU-only peers say why they did not run
        assert any(n.startswith("tiny T=64: pallas_mgpu not run") for n in notes), notes
    for row in (r for r in rows.values() if "error" not in r):
        assert row["us"] > 0 and _close(row["tflops"], row["flops"] / row["us"] / 1e6)
        assert row["flops"] == 2 * 64 * TINY.top_k * TINY.hidden_size * 2 * TINY.ffn_size
        assert _close(row["pct_of_copy"], 100 * row["weight_gbs"] / 1.0)
        assert _close(row["pct_of_dense"], 100 * row["tflops"] / rows["dense"]["tflops"])
    assert f"| tiny | 64 | {common.fmt_us(rows['jax_moe']['us'])} |" in gemm_suite.table(list(rows.values()))


def test_train_suite_runs_jax_moe_and_baseline_steps():
    rows, notes = train_suite.run([TINY], (8,), common.Clock(), with_peer=False)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"jax_moe", "baseline"}, rows
    for row in by.values():
        assert row["step_us"] > 0 and _close(row["us_per_layer"], row["step_us"] / TINY.train_layers)
        assert _close(row["tflops"], row["flops_per_layer"] / row["us_per_layer"] / 1e6)
        assert row["flops_per_layer"] == 3 * 2 * 8 * TINY.top_k * TINY.hidden_size * 3 * TINY.ffn_size
        # The routed experts' weights read twice, every expert's gradient written (zero without rows).
        active = TINY.num_experts * (1 - (1 - TINY.top_k / TINY.num_experts) ** 8)
        expert_bytes = 3 * TINY.hidden_size * TINY.ffn_size * 2
        assert _close(row["weight_bytes_per_layer"], (2 * active + TINY.num_experts) * expert_bytes)
        assert row["peak_bytes"] > 0 and _close(row["roofline_pct"], 100 * row["roofline_us"] / row["us_per_layer"])
    assert any("peer: not run" in n for n in notes) and any(n.startswith("copy ceiling") for n in notes)
    line = f"| tiny | 8 | {TINY.train_layers} | {common.fmt_us(by['jax_moe']['us_per_layer'])} |"
    assert line in train_suite.table(rows)


def test_the_peer_runs_in_a_process_of_its_own_and_reports_its_failure():
    """No GPU here: the PyTorch peer's process reports why it did not run."""
    (row,) = common.run_torch_peer(common.Clock(), TINY, 2, (4,), 1, 1, 300)
    assert row["T"] == 4 and row["error"], row


def _decode_rows(rows):
    return {(r["T"], r["impl"]): r for r in rows}


def test_decode_suite_reports_each_variant_against_its_roofline():
    rows, notes = decode_suite.run([TINY128], (1, 64), common.Clock(), with_peer=False)
    by = _decode_rows(rows)
    params = jax.eval_shape(lambda: common.init_stack_params(jax.random.key(0), TINY128.config(64), 2, 128))
    for tokens in (1, 64):  # the variants whose plan differs from jax_moe's (on CPU: none)
        plans = decode_suite.variant_plans(decode_suite.VARIANTS, TINY128.config(tokens), tokens, params)
        assert {impl for t, impl in by if t == tokens and "fp8" not in impl} == set(plans)
        assert by[tokens, "jax_moe"]["plan"] == str(plans["jax_moe"])
    for row in rows:
        assert "error" not in row, row
        assert 1 <= row["active_experts"] <= min(TINY128.num_experts, row["T"] * TINY128.top_k)
        assert row["flops_per_layer"] == decode_suite.layer_flops(TINY128, row["T"])
        assert row["roofline_us"] == max(row["byte_roofline_us"], row["flop_roofline_us"])
        assert _close(row["pct_roofline"], 100 * row["roofline_us"] / row["us_per_layer"])
    # The same draws quantised: the same experts read, at half the bytes plus a float32 scale a 128 x 128 block.
    bf16, eight = by[1, "jax_moe"], by[1, "jax_moe/fp8"]
    assert eight["active_experts"] == bf16["active_experts"]
    assert _close(bf16["bytes_per_layer"] - eight["bytes_per_layer"], bf16["active_experts"] * 3 * (128 * 128 - 4))
    assert _close(eight["flop_roofline_us"], bf16["flop_roofline_us"] / 2)  # FP8 runs at twice the dense rate
    assert any(n.startswith("copy ceiling") for n in notes)
    assert "| tiny 128 | 1 |" in decode_suite.table(rows) and "FP8 vs bf16" in decode_suite.table(rows)


def test_decode_variants_switch_off_one_choice_each_on_a_gpu_plan():
    """On a GPU's plan every variant is a program of its own where its choice applies, and none where
    it does not (prefill: no decode kernel, so no CUTLASS or prefetch variant)."""
    deepseek = MODELS["deepseek_v3"]
    params = jax.eval_shape(lambda: jax_moe.init_moe_params(jax.random.key(0), deepseek.config(1), 1, 2048,
                                                            **deepseek.param_options()))
    plans = decode_suite.variant_plans(decode_suite.VARIANTS, deepseek.config(1), 1, params, platform="cuda")
    assert set(plans) == set(decode_suite.VARIANTS) and plans["jax_moe"].tile == "decode"
    assert plans["jax_moe/cutlass"].tile != "decode" and plans["jax_moe/no-prefetch"].prefetch_bytes == 0
    assert plans["jax_moe"].shared == "routed_launch" != plans["jax_moe/shared-apart"].shared
    prefill = decode_suite.variant_plans(decode_suite.VARIANTS, deepseek.config(4096), 4096, params, platform="cuda")
    assert set(prefill) == {"jax_moe"}


def test_decode_suite_measures_a_model_in_a_process_of_its_own():
    """The rows of a child process describe the same routing and bytes as this process's; a peer's rows
    pass through; a failing child raises."""
    saved = []
    here = decode_suite.measure_model(TINY, (2,), layers=2, on_rows=saved.append)
    assert saved and saved[-1] == here  # what a stopped child would have left is every row
    child = common.in_child("jax_moe.bench.decode_suite:measure_model", 300, model="tiny", token_counts=[2],
                            peer=[{"T": 2, "us_per_layer": 123.0}], layers=2)
    by_impl = {r["impl"]: r for r in child}
    assert set(by_impl) == {*(r["impl"] for r in here), "peer"} and by_impl["peer"]["us_per_layer"] == 123.0
    for row in here:
        got = by_impl[row["impl"]]
        assert got["us_per_layer"] > 0
        for key in ("T", "layers", "active_experts", "bytes_per_layer", "plan"):
            assert got[key] == row[key], (key, got[key], row[key])
    with pytest.raises(RuntimeError, match="status 3"):
        common.run_child(["-c", "import sys; sys.exit(3)"], 60)


def test_rows_a_child_saved_survive_its_timeout():
    """A child stopped at its timeout leaves the rows it saved: measure_isolated keeps them and notes why."""
    script = ("import sys, time; from jax_moe.bench import common; common.save_json(sys.argv[1], [{'T': 1}]); "
              "time.sleep(120)")
    rows, notes, saved = [], [], []
    common.measure_isolated(rows, notes, common.Clock(), "decode tiny: failed",
                            lambda: common.run_child(["-c", script], 20), lambda r, n: saved.append(list(r)))
    assert rows == [{"T": 1}] and saved == [rows]
    assert notes == ["decode tiny: failed: RuntimeError: its process ran past 20 s (rows it had measured, kept: 1)"]
    with pytest.raises(RuntimeError) as failed:
        common.run_child(["-c", "import sys; sys.exit(3)"], 60)
    assert failed.value.partial is None


def test_stacks_fit_the_card_and_a_suite_and_its_peer_use_one_count():
    """layers_that_fit keeps the model's depth where its params fit PARAMS_SHARE of the allocator's limit
    (an H200's keeps DeepSeek-V3's 4 and Qwen3.5's 8), fewer on an 80 GB card, never below the least;
    training counts the gradients too; stack_counts gives each model one count and notes a cap."""
    deepseek, qwen35 = MODELS["deepseek_v3"], MODELS["qwen35_397b"]
    assert deepseek.layer_param_bytes() == 2 * (256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256)
    h200, h100 = 0.92 * 150.2e9, 0.92 * 85.0e9
    for limit, want in ((h200, [4, 8]), (None, [4, 8]), (h100, [2, 4]), (1e9, [MIN_LAYERS, MIN_LAYERS])):
        assert [m.layers_that_fit(limit) for m in (deepseek, qwen35)] == want
    names = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
    assert [MODELS[n].layers_that_fit(h200, training=True) for n in names] == [MODELS[n].train_layers for n in names]
    assert [MODELS[n].layers_that_fit(h100, training=True) for n in names] == [4, 8, 1, 2]
    small_card = 2.5 * TINY.layer_param_bytes() / PARAMS_SHARE
    layers, notes = stack_counts([dataclasses.replace(TINY, stack_layers=3)], small_card)
    assert layers == {"tiny": 2} and notes[0].startswith("tiny: 2 layers, not 3")


def test_measure_isolated_keeps_rows_and_notes_a_failure():
    rows, notes, saved = [{"T": 1}], [], []
    save = lambda r, n: saved.append((len(r), len(n)))  # noqa: E731
    common.measure_isolated(rows, notes, common.Clock(), "m: failed", lambda: [{"T": 2}], save)
    common.measure_isolated(rows, notes, common.Clock(), "m: failed", lambda: 1 / 0, save)
    assert rows == [{"T": 1}, {"T": 2}] and notes == ["m: failed: ZeroDivisionError: division by zero"]
    assert saved == [(2, 0), (2, 1)]  # saved after each, the failure included


def test_stack_suite_runs_and_compares_to_baseline():
    rows, _ = stack_suite.run([TINY], (1,), common.Clock())
    assert len(rows) == len(stack_suite.VARIANTS) * 2 and not [r for r in rows if "error" in r], rows
    for row in rows:
        assert row["step_us_latency"] > 0
        assert _close(row["us_per_layer"], row["step_us_back_to_back"] / TINY.stack_layers)
    ours, base = (next(r for r in rows if (r["variant"], r["scan"]) == (v, "rolled")) for v in ("jax_moe", "baseline"))
    ratio = common.fmt_ratio(base["step_us_back_to_back"] / ours["step_us_back_to_back"])
    text = stack_suite.table(rows)
    assert "| tiny (CPU test) | 2 | 1 | rolled |" in text and f"| {ratio} |" in text


def test_cli_writes_json_and_markdown_where_asked(tmp_path):
    records = cli.main(["--suite", "permute", "--models", "tiny", "--tokens", "1", "--layers", "1", "2",
                        "--out", str(tmp_path)])
    record = json.loads((tmp_path / "bench_permute.json").read_text())
    assert record["rows"] == json.loads(json.dumps(records["permute"]["rows"]))
    assert record["options"] == {"layer_counts": [1, 2]} and record["method"] == permute_suite.METHOD
    for key in ("device_kind", "jax", "jaxlib", "date", "command", "platform"):
        assert record["meta"][key]
    markdown = (tmp_path / "bench_permute.md").read_text()
    assert record["meta"]["device_kind"] in markdown and permute_suite.METHOD in markdown
    pair = next(r for r in record["rows"] if r["case"] == "jax_moe/pair" and r["scan"] == "rolled")
    assert common.fmt_us(pair["us_per_layer"]) in markdown


def test_cli_writes_to_a_scratch_folder_and_never_over_committed_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the standard library's, not jax_moe's
    assert cli.parse_args([]).out == tmp_path / "tmp" / "jax_moe_bench"
    quick = ["--suite", "permute", "--models", "tiny", "--tokens", "1", "--layers", "1", "2"]
    cli.main(quick)
    assert (tmp_path / "tmp" / "jax_moe_bench" / "bench_permute.json").is_file()
    assert str(tmp_path / "tmp" / "jax_moe_bench") in capsys.readouterr().out
    results = tmp_path / "results"  # a folder with a committed result, as notebooks/results
    results.mkdir()
    (results / "bench_permute.json").write_text("committed\n")
    for args in (["init", "-q"], ["add", "bench_permute.json"]):
        subprocess.run(["git", "-C", str(results), *args], check=True, capture_output=True)
    with pytest.raises(SystemExit):
        cli.parse_args([*quick, "--out", str(results)])
    assert "--overwrite" in capsys.readouterr().err
    assert (results / "bench_permute.json").read_text() == "committed\n"
    cli.main([*quick, "--out", str(results), "--overwrite"])
    assert json.loads((results / "bench_permute.json").read_text())["suite"] == "permute"


def test_cli_selection():
    args = cli.parse_args(["--models", "tiny,mixtral", "--tokens", "1,16", "4"])
    assert args.models == ["tiny", "mixtral"] and args.tokens == [1, 16, 4] and args.suites == cli.ALL
    models, tokens = cli.selection(cli.parse_args(["--quick"]), stack_suite)
    assert [m.name for m in models] == list(stack_suite.QUICK_MODELS) and tokens == stack_suite.QUICK_TOKENS
    for bad in (["--models", "gpt5"], ["--layers", "3", "3"], ["--suite", "gpu"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_the_benchmarks_stay_at_most_a_quarter_of_the_package():
    # The library is what users run: the suites may not outgrow it again (they were 39 % of it once).
    package = pathlib.Path(jax_moe.__file__).parent
    lines = {path: len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    bench = sum(n for path, n in lines.items() if "bench" in path.relative_to(package).parts)
    assert 4 * bench <= sum(lines.values()), f"bench/ is {bench} of {sum(lines.values())} lines"
