"""The benchmark's outputs: the environment record, JSON, and markdown tables."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

import jax
import jaxlib

import jax_moe
from jax_moe import _native

MISSING = "–"


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_moe": jax_moe.__version__,
        "native_cpu": _native.HAS_CPU,
        "native_cuda": _native.HAS_CUDA,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m jax_moe.bench " + " ".join(sys.argv[1:]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""),
    }


def write(out_dir: pathlib.Path, suite: str, record: dict, markdown: str) -> tuple[pathlib.Path, pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"bench_{suite}.json", out_dir / f"bench_{suite}.md"
    json_path.write_text(json.dumps(record, indent=1, default=float) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


# --- cells ----------------------------------------------------------------------------------------

def fmt_us(value) -> str:
    if value is None:
        return MISSING
    if abs(value) < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def fmt_ratio(value) -> str:
    return MISSING if value is None else f"{value:.2f}x"


def fmt_pct(value) -> str:
    return MISSING if value is None else f"{value:.0f}%"


FIELDS = {"us": ("us_per_layer", fmt_us), "ratio": ("ratio_to_baseline", fmt_ratio),
          "pct": ("pct_of_copy_ceiling", fmt_pct), "gbps": ("gb_per_s", lambda v: MISSING if v is None else f"{v:.0f}")}


def cell(row: dict | None, kind: str) -> str:
    if row is None:
        return MISSING
    if "error" in row:
        return "error"
    field, fmt = FIELDS[kind]
    return fmt(row.get(field))


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def header_block(title: str, env: dict, elapsed_s: float, method: str, extra: list[str]) -> list[str]:
    return [
        f"# {title}", "",
        f"- device: **{env['device_kind']}** ({env['platform']}), jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"jax_moe {env['jax_moe']} (native CPU {env['native_cpu']}, CUDA {env['native_cuda']}), "
        f"python {env['python']}",
        f"- date: {env['date']}, run time {elapsed_s:.0f} s",
        f"- command: `{env['command']}`" + (f" with XLA_FLAGS=`{env['xla_flags']}`" if env["xla_flags"] else ""),
        f"- method: {method}",
        *[f"- {line}" for line in extra], "",
    ]


def errors_block(rows: list[dict], describe) -> list[str]:
    errors = [f"- {describe(r)}: {r['error']}" for r in rows if "error" in r]
    return (["## Errors", "", *errors, ""]) if errors else []


# --- permute suite --------------------------------------------------------------------------------

# (column header, case name, field kind); "pct" is % of the copy ceiling, "ratio" / argsort.
PERMUTE_COLUMNS = (
    ("pair jax_moe", "jax_moe/pair", "us"),
    ("pair jax_moe, not donated", "jax_moe/pair/not-donated", "us"),
    ("pair argsort", "argsort/pair", "us"),
    ("pair repeat", "repeat/pair", "us"),
    ("pair jax_moe / argsort", "jax_moe/pair", "ratio"),
    ("permute jax_moe", "jax_moe/permute", "us"),
    ("permute argsort", "argsort/permute", "us"),
    ("permute jax_moe % copy", "jax_moe/permute", "pct"),
    ("unpermute jax_moe", "jax_moe/unpermute", "us"),
    ("unpermute argsort", "argsort/unpermute", "us"),
    ("unpermute jax_moe % copy", "jax_moe/unpermute", "pct"),
    ("copy ceiling", "copy/copy", "us"),
    ("copy GB/s", "copy/copy", "gbps"),
)
COMPACT_COLUMNS = (
    ("pair jax_moe", "jax_moe/pair", "us"),
    ("pair argsort", "argsort/pair", "us"),
    ("ratio", "jax_moe/pair", "ratio"),
    ("permute % copy", "jax_moe/permute", "pct"),
    ("unpermute % copy", "jax_moe/unpermute", "pct"),
)


def _find(rows, model, tokens, case, scan):
    return next((r for r in rows if (r["model"], r["T"], r["case"], r["scan"]) == (model, tokens, case, scan)), None)


def permute_tables(rows: list[dict], columns=PERMUTE_COLUMNS, with_model: bool = False) -> str:
    """One markdown table per (model, scan) with a row per T; or one table if ``with_model``."""
    blocks, lines_all = [], []
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        model_rows = [r for r in rows if r["model"] == model and r["impl"] != "floor"]
        for scan in ("rolled", "unrolled"):
            token_counts = sorted({r["T"] for r in model_rows if r["scan"] == scan})
            lines = [[str(t)] + [cell(_find(rows, model, t, case, scan), kind) for _, case, kind in columns]
                     for t in token_counts]
            if not lines:
                continue
            if with_model:
                lines_all += [[model, scan] + line for line in lines]
            else:
                label = model_rows[0]
                blocks.append(f"### {label['label']} (E{label['E']}, k{label['k']}, H{label['H']}), {scan} scan, "
                              f"µs per layer\n\n" + table(["T"] + [c[0] for c in columns], lines))
    if with_model:
        return table(["model", "scan", "T"] + [c[0] for c in columns], lines_all)
    return "\n\n".join(blocks)


def floors_table(rows: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows if r["impl"] == "floor"):
        for scan in ("rolled", "unrolled"):
            loop = next((r for r in rows if (r["model"], r["case"], r["scan"]) == (model, "floor/loop", scan)), None)
            noops = next((r for r in rows if (r["model"], r["case"], r["scan"]) == (model, "floor/two_noops", scan)), None)
            if loop is None and noops is None:
                continue
            added = (noops["us_per_layer"] - loop["us_per_layer"]
                     if loop and noops and "us_per_layer" in loop and "us_per_layer" in noops else None)
            tokens = (loop or noops)["T"]
            lines.append([model, str(tokens), scan, cell(loop, "us"), cell(noops, "us"), fmt_us(added)])
    return table(["model", "T", "scan", "loop, trivial body", "two no-op custom calls (donated buffer)",
                  "added by the two calls"], lines)


def permute_markdown(record: dict) -> str:
    rows = record["rows"]
    out = header_block("jax_moe permute/unpermute per layer", record["meta"], record["elapsed_s"],
                       record["method"], [f"bytes and ratios: {record['bytes_formula']}"])
    out += ["## Per layer, µs", "", permute_tables(rows), "",
            "## Floors, µs per layer", "", floors_table(rows), "",
            "## Notes", "", *[f"- {n}" for n in record["notes"]], ""]
    out += errors_block(rows, lambda r: f"{r['model']} T={r['T']} {r['case']} {r['scan']}")
    return "\n".join(out)


# --- stack suite ----------------------------------------------------------------------------------

def stack_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        ok = "error" not in r
        lines.append([r["label"], str(r["layers"]), str(r["T"]), r["scan"], r["variant"],
                      fmt_us(r.get("step_us_latency")) if ok else "error",
                      fmt_us(r.get("step_us_back_to_back")) if ok else "error",
                      fmt_us(r.get("us_per_layer")) if ok else "error",
                      fmt_ratio(r.get("ratio_to_baseline")),
                      f"{r['compile_s']:.1f}" if "compile_s" in r else MISSING])
    return table(["model", "L", "T", "scan", "variant", "µs/step, latency", "µs/step, back to back",
                  "µs/layer", "× baseline", "compile s"], lines)


def stack_markdown(record: dict) -> str:
    rows = record["rows"]
    shapes = sorted({(r["label"], r["E"], r["k"], r["H"], r["F"], r["layers"]) for r in rows})
    out = header_block("jax_moe scanned MoE stack, one jitted decode step", record["meta"], record["elapsed_s"],
                       record["method"],
                       ["shapes: " + "; ".join(f"{s[0]} E{s[1]} k{s[2]} H{s[3]} F{s[4]} L{s[5]}" for s in shapes)])
    out += ["## Step time", "", stack_table(rows), "", "## Notes", "", *[f"- {n}" for n in record["notes"]], ""]
    out += errors_block(rows, lambda r: f"{r['model']} T={r['T']} {r['variant']} {r['scan']}")
    return "\n".join(out)
