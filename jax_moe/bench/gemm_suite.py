"""Suite gemm: the experts' grouped GEMM against the GEMMs a JAX user would pick instead.

Per model and T: the fused gate/up projection of one layer, [T*k, H] x [El, H, 2F] (bf16, float32
accumulation), on T*k rows routed uniformly at random, by ``jax_moe.grouped_matmul`` (on the tile the
layer's plan picks), each JAX peer (``jax_peers.peers``) and a dense ``jnp.dot`` of the same FLOPs (the
compute ceiling). TFLOP/s = 2*T*k*H*2F / time; weight GB/s = bytes of the experts owning rows / time,
against the copy ceiling. Then the SwiGLU expert block, forward and forward+backward, against the JAX peers
(``jax_peers.measure_block``). Whole layers and FP8 experts: the stack, decode and train suites.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe.bench import common, jax_peers
from jax_moe.bench.models import ROW_DTYPE, ModelShape

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 16, 128, 1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (16, 4096)
TITLE = "Grouped GEMM (suite gemm)"
METHOD = common.LOOP_METHOD + " The scratch is threaded from call to call."


def impls(tokens: int, config, scratch, weights, tile) -> dict:
    """name -> (``fn(*operands) -> (out, operands)``, operands), or why it does not run here."""
    live = config.live_row_bound(tokens)
    rows, sizes = scratch.permuted[:live], scratch.group_sizes
    out = {"jax_moe": (lambda w, s: (jax_moe.grouped_matmul(s.permuted, w, s, num_rows=live, tile=tile)[0], (w, s)),
                       (weights, scratch)),
           "dense": (lambda r, w: (jnp.dot(r, w, preferred_element_type=jnp.float32).astype(r.dtype), (r, w)),
                     (rows[:tokens * config.top_k], weights[0]))}
    limit = jax_peers.RAGGED_DOT_MAX_ROWS_X_EXPERTS["forward"]  # past it ragged_dot takes seconds a call
    for name, dot in jax_peers.peers(config.num_experts).items():
        if name == "ragged_dot" and tokens * config.top_k * config.num_experts > limit:
            dot = f"not run (rows x E > {limit})"
        out[name] = dot if isinstance(dot, str) else (lambda r, w, g, dot=dot: (dot(r, w, g), (r, w, g)),
                                                      (rows, weights, sizes))
    return out


def measure(model: ModelShape, tokens: int, clock, notes, copy_gbs: float | None = None) -> list[dict]:
    config, key = model.config(tokens), jax.random.key(tokens)
    ids = lax.top_k(jax.random.uniform(key, (tokens, config.num_experts)), config.top_k)[1]
    x = jax.random.normal(key, (tokens, config.hidden_size), ROW_DTYPE)
    scratch = jax.jit(jax_moe.permute)(x, ids, jax_moe.init_scratch(config))
    hidden, n = model.hidden_size, 2 * model.ffn_size
    weights = (jax.random.normal(key, (config.num_local_experts, hidden, n)) / hidden ** 0.5).astype(ROW_DTYPE)
    active = int((scratch.group_sizes > 0).sum())
    layer = {name: jax.ShapeDtypeStruct(shape, ROW_DTYPE) for name, shape in (  # the plan reads shapes alone
        ("router", (hidden, config.num_experts)), ("down", (config.num_local_experts, model.ffn_size, hidden)))}
    tile = jax_moe.plan_layer(config, tokens, {**layer, "gate_up": weights}, platform="cuda").tile
    base = {"model": model.name, "T": tokens, "rows": tokens * config.top_k, "K": hidden, "N": n, "copy_gbs": copy_gbs,
            "active_experts": active, "weight_bytes": active * hidden * n * 2,
            "flops": 2 * tokens * config.top_k * hidden * n,
            "tile": tile}
    rows = []
    for name, impl in impls(tokens, config, scratch, weights, tile).items():
        if isinstance(impl, str):
            notes.append(f"{model.name} T={tokens}: {name} {impl}")
            continue
        row = {**base, "impl": name}
        try:
            timed = common.loop_seconds(*impl)
            row.update(us=timed["s"] * 1e6, spread_us=timed["spread_s"] * 1e6, repeats=timed["repeats"], n2=timed["n2"])
            row.update(tflops=row["flops"] / row["us"] / 1e6, weight_gbs=row["weight_bytes"] / row["us"] / 1e3)
        except Exception as e:  # recorded; the other implementations still run
            row["error"] = common.describe_error(e)
        clock.log(f"gemm {model.name} T={tokens} {name}: {common.outcome(row, 'us')}")
        rows.append(row)
    dense = next((r["tflops"] for r in rows if r["impl"] == "dense" and "tflops" in r), None)
    for row in (r for r in rows if "tflops" in r):
        row["pct_of_dense"] = dense and 100 * row["tflops"] / dense
        row["pct_of_copy"] = copy_gbs and 100 * row["weight_gbs"] / copy_gbs
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None):
    rows, notes = [], []
    copy_gbs, dense_tflops = common.ceilings(clock, notes)
    for model in models:
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"gemm {model.name} T={tokens}"):
                break
            common.measure_isolated(rows, notes, clock, f"gemm {model.name} T={tokens}: failed",
                                    lambda: measure(model, tokens, clock, notes, copy_gbs), on_rows)
            common.measure_isolated(rows, notes, clock, f"gemm block {model.name} T={tokens}: failed", lambda: (
                jax_peers.measure_block(model, tokens, clock, notes, copy_gbs, dense_tflops)), on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    blocks, rows = [r for r in rows if "pass" in r], [r for r in rows if "pass" not in r]
    columns = [(f"{impl} µs", common.cell(impl, "us")) for impl in dict.fromkeys(r["impl"] for r in rows)]
    columns += [("jax_moe TFLOP/s", common.cell("jax_moe", "tflops")),
                ("jax_moe % of dense", common.cell("jax_moe", "pct_of_dense", common.fmt_pct)),
                ("jax_moe weight read % of copy", common.cell("jax_moe", "pct_of_copy", common.fmt_pct))]
    return "Gate/up GEMM:\n\n" + common.pivot(rows, ("model", "T"), columns) + (
        "\n\n" + jax_peers.table(blocks) if blocks else "")
