"""Suite gemm: the expert GEMM and the whole MoE layer against the GEMMs a JAX user would pick instead.

Per model and token count T, rows = T*k routed uniformly at random as permute groups them:
- GEMM: the fused gate/up projection [rows, H] x [El, H, 2F] (bf16 in and out, float32 accumulation)
  by ``GEMM_IMPLS``: ``jax_moe.grouped_matmul``, ``lax.ragged_dot``, Pallas Mosaic-GPU
  ``ragged_dot_mgpu`` (the best of MGPU_CONFIGS), a dense ``jnp.dot`` of the same FLOPs (the compute
  ceiling) and, from FP8_MIN_TOKENS, jax_moe's FP8 GEMM on e4m3 experts with 128 x 128 block scales
  (its rows quantised per 1 x 128 group inside the call; its ceiling is twice the dense bf16 rate).
  TFLOP/s = 2*rows*H*2F / time; weight GB/s = bytes of the experts owning rows / time, against the
  copy ceiling (decode is bound by the weights' reads).
- Layer (LAYER_TOKENS): route, permute, experts, unpermute by ``LAYER_IMPLS``: ``moe_layer`` (bf16 and
  FP8 experts) and the pure-JAX layer on ``ragged_dot``; forward, and at GRAD_TOKENS forward+backward
  (value_and_grad of sum(y) in params and x, every gradient consumed).
A peer is one more entry of GEMM_IMPLS or LAYER_IMPLS; an implementation that fails is an error row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import baseline, fp8, gemm, plan
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE, ModelShape

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 16, 128, 1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (16, 4096)
LAYER_TOKENS = (1, 1024, 4096)
GRAD_TOKENS = (1024,)
GRAD_MAX_EXPERTS = 128  # both backwards run ragged_dot somewhere, seconds a call from E = 256
RAGGED_DOT_MAX_ROWS_X_EXPERTS = 16384 * 256  # past this ragged_dot takes seconds a call (157 ms: DeepSeek-V3, 8192 rows)
FP8_MIN_TOKENS = 1024
MGPU_MAX_EXPERTS = 128  # its grid has a step per group and row block: compile time grows with E
MGPU_CONFIGS = ({"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
                {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2})
TITLE = "Grouped GEMM and the MoE layer (suite gemm)"
METHOD = common.LOOP_METHOD + " The scratch is threaded from call to call."


def _ragged_dot(rows, weights, sizes):
    return lax.ragged_dot(rows, weights, sizes, preferred_element_type=jnp.float32).astype(rows.dtype)


def _mgpu(config):
    def fn(rows, weights, sizes):
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
        return ragged_dot_mgpu.ragged_dot(rows, weights, group_sizes=sizes, **config), (rows, weights, sizes)
    return fn


def gemm_impls(model: ModelShape, tokens: int, config, scratch, weights, key) -> dict:
    """name -> (``fn(*operands) -> (out, operands)``, operands), or a string: why it does not run here."""
    live = config.live_row_bound(tokens)
    rows, sizes = scratch.permuted[:live], scratch.group_sizes
    impls = {
        "jax_moe": (lambda w, s: (jax_moe.grouped_matmul(s.permuted, w, s, num_rows=live)[0], (w, s)), (weights, scratch)),
        "ragged_dot": ((lambda r, w, g: (_ragged_dot(r, w, g), (r, w, g)), (rows, weights, sizes))
                       if tokens * config.top_k * config.num_experts <= RAGGED_DOT_MAX_ROWS_X_EXPERTS
                       else f"not run: rows x experts > {RAGGED_DOT_MAX_ROWS_X_EXPERTS}"),
        "dense": (lambda r, w: (jnp.dot(r, w, preferred_element_type=jnp.float32).astype(r.dtype), (r, w)),
                  (rows[:tokens * config.top_k], weights[0])),
    }
    for i, mgpu_config in enumerate(MGPU_CONFIGS if config.num_experts <= MGPU_MAX_EXPERTS else ()):
        impls[f"ragged_dot_mgpu/{i}"] = (_mgpu(mgpu_config), (rows, weights, sizes))
    hidden, n = weights.shape[1:]
    if tokens >= FP8_MIN_TOKENS and hidden % fp8.BLOCK == 0 and n % fp8.BLOCK == 0:
        # Experts in the checkpoint's [El, N, K] layout; any finite e4m3 values time alike.
        q = (jax.random.normal(key, (config.num_local_experts, n, hidden), ROW_DTYPE) * 64).astype(fp8.FP8)
        scale = jnp.full((config.num_local_experts, n // fp8.BLOCK, hidden // fp8.BLOCK), 1 / (64 * hidden ** 0.5))

        def ours_fp8(q, scale, s, workspace):
            out, workspace = gemm.fp8_forward(s.permuted, q, scale, s.expert_offsets, workspace, live)
            return out, (q, scale, s, workspace)
        impls["jax_moe/fp8"] = (ours_fp8, (q, scale, scratch, gemm.fp8_workspace(config.num_local_experts)))
    return impls


def measure_gemm(model: ModelShape, tokens: int, clock, notes, copy_gbs: float | None = None) -> list[dict]:
    config, key = model.config(tokens), jax.random.key(tokens)
    ids = lax.top_k(jax.random.uniform(key, (tokens, config.num_experts)), config.top_k)[1]
    x = jax.random.normal(key, (tokens, config.hidden_size), ROW_DTYPE)
    scratch = jax.jit(jax_moe.permute)(x, ids, jax_moe.init_scratch(config))
    hidden, n = model.hidden_size, 2 * model.ffn_size
    weights = (jax.random.normal(key, (config.num_local_experts, hidden, n), jnp.float32) / hidden ** 0.5).astype(ROW_DTYPE)
    active = int((scratch.group_sizes > 0).sum())
    base = {"model": model.name, "T": tokens, "rows": tokens * config.top_k, "K": hidden, "N": n, "copy_gbs": copy_gbs,
            "active_experts": active, "weight_bytes": active * hidden * n * 2, "flops": 2 * tokens * config.top_k * hidden * n,
            "tile": plan.pick_tile(config.live_row_bound(tokens), config.num_local_experts)}
    rows = []
    for name, impl in gemm_impls(model, tokens, config, scratch, weights, key).items():
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
        clock.log(f"gemm {model.name} T={tokens} {name}: " + (f"{row['us']:.1f} us" if "us" in row else row["error"]))
        rows.append(row)
    mgpu = [r for r in rows if r["impl"].startswith("ragged_dot_mgpu/")]
    if mgpu:  # one row: the best config, or the first failure
        best = min(mgpu, key=lambda r: r.get("us", float("inf")))
        rows.append({**best, "impl": "ragged_dot_mgpu", "config": MGPU_CONFIGS[int(best["impl"].split("/")[1])]})
    rows = [r for r in rows if not r["impl"].startswith("ragged_dot_mgpu/")]
    dense = next((r["tflops"] for r in rows if r["impl"] == "dense" and "tflops" in r), None)
    for row in (r for r in rows if "tflops" in r):  # FP8 tensor cores run at twice the bf16 rate
        row["pct_of_dense"] = dense and 100 * row["tflops"] / (dense * (2 if row["impl"].endswith("fp8") else 1))
        row["pct_of_copy"] = copy_gbs and 100 * row["weight_gbs"] / copy_gbs
    return rows


def layer_impls(model: ModelShape, tokens: int, config, params, x, grad: bool) -> dict:
    """name -> (``fn(params, x, *rest) -> (y, (params, x, *rest))``, operands)."""
    ours = lambda p, x, s: (lambda y, s: (y, (p, x, s)))(*jax_moe.moe_layer(p, x, s))  # noqa: E731
    pure_jax = lambda p, x: (baseline.baseline_moe_layer(p, x, config), (p, x))  # noqa: E731
    scratch = jax_moe.init_scratch(config)
    impls = {"jax_moe": (ours, (params, x, scratch)), "baseline": (pure_jax, (params, x))}
    if tokens >= FP8_MIN_TOKENS and model.hidden_size % fp8.BLOCK == 0 and model.ffn_size % fp8.BLOCK == 0:
        impls["jax_moe/fp8"] = (ours, (fp8.quantize_params(params), x, scratch))  # the same draws, quantised
    if grad:
        for name in ("jax_moe", "baseline"):
            impls[f"{name}/fwd+bwd"] = (with_grad(impls[name][0]), impls[name][1])
    return impls


def with_grad(layer):
    """``layer``'s forward+backward: d sum(y) / d (params, x) in place of y."""
    def fn(p, x, *rest):
        def loss(p, x):
            y, operands = layer(p, x, *rest)
            return jnp.sum(y.astype(jnp.float32)), operands
        (_, operands), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)
        return grads, operands
    return fn


def measure_layer(model: ModelShape, tokens: int, clock, with_grad: bool | None = None) -> list[dict]:
    """The layer's rows; forward+backward too with ``with_grad`` (None: at GRAD_TOKENS, up to GRAD_MAX_EXPERTS)."""
    config = model.config(tokens)
    grad = tokens in GRAD_TOKENS and config.num_experts <= GRAD_MAX_EXPERTS if with_grad is None else with_grad
    params = jax.tree.map(lambda a: a[0], jax_moe.init_moe_params(jax.random.key(0), config, 1, model.ffn_size,
                                                                  **model.param_options()))
    x = jax.random.normal(jax.random.key(1), (tokens, model.hidden_size), ROW_DTYPE)
    rows = []
    for name, (fn, operands) in layer_impls(model, tokens, config, params, x, grad).items():
        row = {"model": model.name, "T": tokens, "impl": name}
        try:
            row["us"] = common.loop_seconds(fn, operands)["s"] * 1e6
        except Exception as e:
            row["error"] = common.describe_error(e)
        clock.log(f"layer {model.name} T={tokens} {name}: {row.get('us', row.get('error'))}")
        rows.append(row)
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None):
    notes = []
    copy_gbs, _ = common.ceilings(clock, notes)
    rows = []
    for model in models:
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"gemm {model.name} T={tokens}"):
                break
            common.measure_isolated(rows, notes, clock, f"gemm {model.name} T={tokens}: failed",
                                    lambda: measure_gemm(model, tokens, clock, notes, copy_gbs), on_rows)
            if tokens in LAYER_TOKENS:
                common.measure_isolated(rows, notes, clock, f"layer {model.name} T={tokens}: failed",
                                        lambda: measure_layer(model, tokens, clock), on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    gemm_rows, layer_rows = [r for r in rows if "flops" in r], [r for r in rows if "flops" not in r]
    columns = [(f"{impl} µs", common.cell(impl, "us")) for impl in dict.fromkeys(r["impl"] for r in gemm_rows)]
    columns += [("jax_moe TFLOP/s", common.cell("jax_moe", "tflops")),
                ("jax_moe % of dense", common.cell("jax_moe", "pct_of_dense", common.fmt_pct)),
                ("jax_moe weight read % of copy", common.cell("jax_moe", "pct_of_copy", common.fmt_pct)),
                ("FP8 % of 2x dense", common.cell("jax_moe/fp8", "pct_of_dense", common.fmt_pct)),
                ("FP8 vs bf16", common.speedup("jax_moe", "jax_moe/fp8", "us"))]
    text = "Gate/up GEMM:\n\n" + common.pivot(gemm_rows, ("model", "T"), columns)
    if layer_rows:
        columns = [(f"{impl} µs", common.cell(impl, "us")) for impl in dict.fromkeys(r["impl"] for r in layer_rows)]
        columns += [("baseline / jax_moe", common.speedup("baseline", "jax_moe", "us")),
                    ("fwd+bwd: baseline / jax_moe", common.speedup("baseline/fwd+bwd", "jax_moe/fwd+bwd", "us")),
                    ("FP8 vs bf16", common.speedup("jax_moe", "jax_moe/fp8", "us"))]
        text += "\n\nWhole MoE layer:\n\n" + common.pivot(layer_rows, ("model", "T"), columns)
    return text
