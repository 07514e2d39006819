"""README.md and notebooks/results/README.md: every snippet runs as written, every number is a committed one.

- Each ```python block of README runs in a fresh namespace from the repository root, with warnings as
  errors (a training step that drops its donated scratch would warn "Some donated buffers were not
  usable"), and prints what its last comment says.
- README's two commands are the ones CI runs, its size stays in budget, and the files it links exist.
- Its headline performance table equals the one computed here from the committed JSON results.
- The results index lists every file of notebooks/results, and every file it lists exists.
"""

import contextlib
import io
import json
import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "notebooks" / "results"
INDEX = RESULTS / "README.md"

MAIN_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m jax_moe.demo"
TEST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" '
                "&& python -m pytest -q tests")
MAX_BYTES = 12_000  # README with the architecture section
MAX_BYTES_WITHOUT_ARCHITECTURE = 9_500


def _loss_went_down(printed: str) -> None:
    first, last = map(float, re.fullmatch(r"loss (\d+\.\d+) -> (\d+\.\d+)", printed).groups())
    assert last < first, printed


# What each python block of README prints, in order: an exact string, or a check of the printed text
# (the training step's losses depend on the float rounding of the machine, their fall does not).
EXPECTED_OUTPUTS = ["(16, 64) 32", _loss_went_down, "(2, 8, 32)"]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_expected_python_blocks():
    assert len(_blocks()) == len(EXPECTED_OUTPUTS), f"expected {len(EXPECTED_OUTPUTS)} python blocks in README.md"


@pytest.mark.parametrize("index", range(len(EXPECTED_OUTPUTS)), ids=["inference", "training", "hf"])
def test_readme_python_block_runs_as_written(index, monkeypatch):
    block, expected = _blocks()[index], EXPECTED_OUTPUTS[index]
    monkeypatch.chdir(ROOT)  # the blocks' paths are relative to the repository root
    printed = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    text = printed.getvalue().strip()
    if callable(expected):
        expected(text)
    else:
        assert text == expected
    # The block's last comment shows what it prints (the training losses are an example).
    last_comment = block.rstrip().splitlines()[-1].rsplit("# ", 1)[-1]
    if not callable(expected):
        assert last_comment == expected
    else:
        expected(last_comment)


def test_readme_commands_size_and_links():
    text = README.read_text()
    assert MAIN_COMMAND in text and TEST_COMMAND in text
    assert len(text.encode()) <= MAX_BYTES, len(text.encode())
    before, _, after = text.partition("\n## Architecture\n")
    assert after, "README.md has no '## Architecture' section"
    rest = re.search(r"\n## ", after)
    without = before + (after[rest.start():] if rest else "")
    assert len(without.encode()) <= MAX_BYTES_WITHOUT_ARCHITECTURE, len(without.encode())
    hf_note = text.index('pip install "jax_moe[hf]"')
    assert hf_note < text.index("hf.load_moe(\"tests/fixtures"), "the [hf] install note must come before the snippet"
    for link in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / link).exists(), link


# ---- the headline table, from the committed results (one H200)

MODELS = ["qwen3_30b", "mixtral", "deepseek_v3", "qwen35_397b"]
# Where each pure-JAX ratio comes from: "stack" = the stack suite's rolled scan, "layer" = the gemm suite's
# one-layer forward. Pairs not listed were never measured.
PURE_JAX_FORWARD = {
    ("qwen3_30b", 1): ("bench_stack_h200.json", "stack"), ("qwen3_30b", 16): ("bench_stack_h200.json", "stack"),
    ("qwen3_30b", 4096): ("bench_gemm_h200.json", "layer"),
    ("mixtral", 1): ("bench_gemm_mixtral_qwen35_h200.json", "layer"),
    ("mixtral", 4096): ("bench_gemm_mixtral_qwen35_h200.json", "layer"),
    ("deepseek_v3", 1): ("bench_stack_real_routing_h200.json", "stack"),
    ("deepseek_v3", 16): ("bench_stack_deepseek_h200.json", "stack"),
    ("deepseek_v3", 4096): ("bench_stack_real_routing_h200.json", "stack"),
    ("qwen35_397b", 1): ("bench_stack_real_routing_h200.json", "stack"),
    ("qwen35_397b", 4096): ("bench_stack_real_routing_h200.json", "stack"),
}


def _records(name):
    data = json.loads((RESULTS / name).read_text())
    if "rows" in data:
        return [data]
    runs = data["runs"]
    return list(runs.values()) if isinstance(runs, dict) else runs


def _rows(name):
    return [row for record in _records(name) for row in record["rows"]]


def _find(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _us(v):
    return f"{v:#.3g}" if abs(v) < 100 else f"{v:.0f}"


def _times(ratio):
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _pure_jax_forward(model, tokens):
    if (model, tokens) not in PURE_JAX_FORWARD:
        return "—"
    name, kind = PURE_JAX_FORWARD[(model, tokens)]
    if kind == "stack":
        rows = [r for r in _rows(name) if r["model"] == model and r["T"] == tokens and r.get("scan") == "rolled"]
        ours, base = _find(rows, variant="jax_moe"), _find(rows, variant="baseline")
        if base.get("error"):
            return "OOM" if "RESOURCE_EXHAUSTED" in base["error"] else "fails"
        return _times(base["step_us_back_to_back"] / ours["step_us_back_to_back"])
    rows = [r for r in _rows(name) if r["model"] == model and r["T"] == tokens and "flops" not in r]
    return _times(_find(rows, impl="baseline")["us"] / _find(rows, impl="jax_moe")["us"])


def _forward(model, tokens):
    if tokens <= 16:
        rows = _rows("bench_decode_h200.json")
    else:  # each model's latest prefill run
        runs = sorted((r for r in _records("bench_prefill_h200.json") if any(x["model"] == model for x in r["rows"])),
                      key=lambda r: r["meta"]["date"])
        rows = runs[-1]["rows"]
    ours = _find(rows, model=model, T=tokens, impl="jax_moe")
    peer = _find(rows, model=model, T=tokens, impl="peer")
    return ours["label"], [f"{_us(ours['us_per_layer'])} ({ours['pct_roofline']:.0f}%)",
                           f"{peer['us_per_layer'] / ours['us_per_layer']:.2f}x", _pure_jax_forward(model, tokens)]


def _training(model, tokens):
    rows = [r for r in _rows("bench_train_h200.json") if r["model"] == model and r["T"] == tokens]
    ours = _find(rows, impl="jax_moe")
    if ours is None:
        return ["—"] * 3
    peer, base = _find(rows, impl="torch+hf grouped_mm"), _find(rows, impl="baseline")
    return [f"{_us(ours['us_per_layer'])} ({ours['roofline_pct']:.0f}%)",
            f"{peer['us_per_layer'] / ours['us_per_layer']:.2f}x" if peer else "—",
            _times(base["us_per_layer"] / ours["us_per_layer"]) if base else "—"]


def headline_table() -> list[str]:
    lines = ["| model | T | forward µs (% roofline) | vs PyTorch + HF | vs pure JAX | training µs (% roofline) "
             "| vs PyTorch + HF | vs pure JAX |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model in MODELS:
        for i, tokens in enumerate((1, 16, 4096)):
            label, forward = _forward(model, tokens)
            lines.append("| " + " | ".join([label if i == 0 else "", str(tokens)] + forward + _training(model, tokens))
                         + " |")
    return lines


@pytest.mark.parametrize("path", [README, INDEX], ids=["README", "results_index"])
def test_headline_table_is_the_committed_results(path):
    text = path.read_text()
    expected = headline_table()
    start = text.index(expected[0])
    assert text[start:].splitlines()[:len(expected)] == expected


def test_results_index_lists_every_file():
    text = INDEX.read_text()
    listed = set()
    for cell in re.findall(r"^\| `([^`]+)` \|", text, re.M):
        stem, *extensions = [part.strip() for part in cell.split(",")]
        listed.add(stem)
        listed.update(stem.rsplit(".", 1)[0] + ext for ext in extensions)
    present = {p.name for p in RESULTS.iterdir() if p.is_file()}
    assert listed == present, (sorted(present - listed), sorted(listed - present))
    assert len(present) <= 46, len(present)  # a pair per suite and card (six suites and the profile, two cards) and a few records
    for name in re.findall(r"`([\w.]+\.(?:md|json))`", text):  # every file it cites by name exists
        assert (RESULTS / name).exists() or (ROOT / name).exists(), name
