"""Suite gemm: the expert GEMMs and the whole MoE layer on the grouped GEMM (issue 8).

Per model and token count T (rows = T*k routed uniformly at random, as permute groups them):
- the gate/up GEMM [rows, H] x [El, H, 2F] by jax_moe.grouped_matmul, jax.lax.ragged_dot, Pallas
  Mosaic-GPU ragged_dot_mgpu (best of a few configs, models with E <= 128), and a dense jnp.dot
  [rows, H] x [H, 2F] of the same FLOPs as the ceiling; TFLOP/s = 2*rows*H*2F / time;
- the active experts' weight bytes per second against the copy ceiling (decode is weight bound);
- the whole layer (route, permute, experts, unpermute): jax_moe.moe_layer against the pure-JAX
  baseline layer on ragged_dot.
Timing: METHOD below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import baseline, experts, fp8, gemm
from jax_moe.bench import timing
from jax_moe.bench.models import ModelShape

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 16, 128, 1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (16, 4096)
LAYER_TOKENS = (1, 1024, 4096)  # the whole-layer comparison
# Forward + backward of the layer: both sides' backward GEMMs are ragged_dot, which takes seconds
# per call at E=256 and up, so only the models with at most this many experts.
GRAD_TOKENS = (1024,)
GRAD_MAX_EXPERTS = 128
REPEATS = (1, 4)  # N1, N2; N2 grows where an op is below the timing noise (_timed)
RESOLVE_GROWTH = 8
MAX_REPEATS_N2 = 256
DECODE_CONTENDER_MAX_ROWS_PER_EXPERT = 64  # the decode kernel is also timed up to this many
# ragged_dot is skipped where it takes seconds per call (issue 8 measured 157 ms for DeepSeek-V3 at
# 8192 rows): the suite would spend its device time there.
RAGGED_DOT_MAX_ROWS_X_EXPERTS = 16384 * 256
FP8_MIN_TOKENS = 1024  # the FP8 prefill GEMM (gemm.fp8_forward) is timed from here up
MGPU_MAX_EXPERTS = 128  # its grid has one step per group and row block: compile time grows with E
MGPU_CONFIGS = ({"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
                {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2})
# (A third, 128 x 256 with 3 stages, was 3-5x slower than these on the H200 for Qwen3-30B shapes.)
COPY_BYTES = 1 << 30
METHOD = ("Each op runs N times inside one jitted fori_loop, its operands in the carry behind an "
          "optimisation barrier (nothing is hoisted), a scratch threaded through; time per op = "
          "(t(N2) - t(N1)) / (N2 - N1) of median wall times, N1, N2 = %d, %d: host dispatch cancels "
          "(timing.per_layer_seconds: the two programs alternate after %d warm-up calls, %d-%d times). "
          "Where the time is not above its spread (the interquartile ranges over N2 - N1), N2 grows %dx "
          "up to %d (the row's n2, spread_us beside it); a time still <= 0 there is an error row."
          % (*REPEATS, timing.WARMUP_CALLS, timing.MIN_REPEATS, timing.MAX_REPEATS,
             RESOLVE_GROWTH, MAX_REPEATS_N2))
NOTES = [
    "GEMM: the fused gate/up projection of one layer, [T*k, H] x [El, H, 2F], bf16 in and out, f32 "
    "accumulation; rows routed uniformly at random.",
    "jax_moe FP8 (T >= %d): gemm.fp8_forward, the same GEMM on float8_e4m3fn experts [El, 2F, H] "
    "with 128 x 128 block scales, the rows quantised per 1 x 128 group inside the call (included in the time); "
    "its ceiling is twice the dense bf16 jnp.dot's rate (Hopper's FP8 tensor cores run at twice bf16's)." % FP8_MIN_TOKENS,
    "weight GB/s: bytes of the experts that own at least one row / time; copy: jax_moe_bench_copy "
    "of 1 GiB, (read + write bytes) / time.",
    "jax_moe: the backward pass runs the native input- and weight-gradient grouped GEMMs; the baseline "
    "differentiates ragged_dot. 'fwd+bwd' times value_and_grad of sum(y) with respect to the params and "
    "x, every gradient leaf consumed.",
]


def loop_program(fn, n: int, consume=timing.consume_all):
    """``program(operands) -> float32``: ``fn`` called n times in a ``fori_loop``, every output consumed.

    ``fn(*operands) -> (out, operands)``; the operands are threaded from call to call behind an
    optimisation barrier (nothing is hoisted), and ``consume`` turns each call's outputs into the
    scalar the loop accumulates (a test swaps it to show what a harness that drops outputs loses).
    """
    def program(ops):
        def body(_, carry):
            ops, acc = carry
            ops = lax.optimization_barrier(ops)
            out, ops = fn(*ops)
            return ops, acc + consume(out)
        return lax.fori_loop(0, n, body, (ops, jnp.float32(0)))[1]
    return program


def _timed(fn, operands) -> dict:
    """Seconds per call of ``fn(*operands) -> (out, operands)``, by the N1/N2 in-graph difference.

    The operands returned are the next call's (a scratch threads through, written in place). An op
    of a few µs can sit below the wall-clock noise of N2 - N1 = 3 calls (a loaded CPU once gave a
    negative time): while the time is not above its spread (timing.per_layer_seconds), N2 grows
    RESOLVE_GROWTH-fold, up to MAX_REPEATS_N2. There a positive time is reported with its spread
    (noise that scales with the program's length does not shrink with N2); a time <= 0 raises.
    """
    small, large = REPEATS
    compiled = {}
    while True:
        for n in (small, large):
            if n not in compiled:
                compiled[n] = jax.jit(loop_program(fn, n)).lower(operands).compile()
        # timing.per_layer_seconds (the permute suite's harness) alternates and differences the
        # two; the "state" it threads is just the probe scalar here: every call starts from the operands.
        programs = {n: (lambda _state, _routing, c=compiled[n]: c(operands)) for n in (small, large)}
        result, _ = timing.per_layer_seconds(programs, None, dict.fromkeys(programs))
        if result["per_layer_s"] > max(0.0, result["spread_s"]) or large >= MAX_REPEATS_N2:
            break
        large = min(MAX_REPEATS_N2, large * RESOLVE_GROWTH)
    if result["per_layer_s"] <= 0:
        raise RuntimeError(f"time per call not resolved above the timing noise at N2 = {large}: "
                           f"{result['per_layer_s'] * 1e6:.2f} µs, spread {result['spread_s'] * 1e6:.2f} µs")
    return {"s": result["per_layer_s"], "spread_s": result["spread_s"], "repeats": result["repeats"], "n2": large}


def _routed_scratch(config, tokens, key):
    ids = lax.top_k(jax.random.uniform(key, (tokens, config.num_experts)), config.top_k)[1]
    x = jax.random.normal(key, (tokens, config.hidden_size), jnp.bfloat16)
    return jax.jit(jax_moe.permute)(x, ids, jax_moe.init_scratch(config)), x


def _mgpu(rows, weights, sizes, config):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(rows, weights, group_sizes=sizes, **config)


def measure_gemm(model: ModelShape, tokens: int, clock, notes) -> list[dict]:
    config = model.config(tokens)
    key = jax.random.key(tokens)
    scratch, _ = _routed_scratch(config, tokens, key)
    H, N = model.hidden_size, 2 * model.ffn_size
    weights = (jax.random.normal(key, (config.num_local_experts, H, N), jnp.float32) / H ** 0.5).astype(jnp.bfloat16)
    live = config.live_row_bound(tokens)
    rows = scratch.permuted[:live]
    sizes = scratch.group_sizes
    active = int((sizes > 0).sum())
    flops = 2 * tokens * config.top_k * H * N
    base = {"model": model.name, "T": tokens, "rows": tokens * config.top_k, "K": H, "N": N,
            "active_experts": active, "weight_bytes": active * H * N * 2, "flops": flops,
            "tile": gemm.TILE_NAMES[gemm.pick_tile(config.live_row_bound(tokens), config.num_local_experts)]}
    def ours(w, s, tile=None):
        out, s = jax_moe.grouped_matmul(s.permuted, w, s, num_rows=live, tile=tile)
        return out, (w, s)

    # The kernel pick_tile passes over, timed too where it is a contender (the decode crossover).
    picked = gemm.pick_tile(live, config.num_local_experts)
    rows_per_expert = live / max(1, min(config.num_local_experts, live))
    other = (gemm.SMALL_M_TILE if picked == gemm.DECODE_TILE
             else gemm.DECODE_TILE if rows_per_expert <= DECODE_CONTENDER_MAX_ROWS_PER_EXPERT else None)
    impls = {
        "jax_moe": (ours, (weights, scratch)),
        **({f"jax_moe/{gemm.TILE_NAMES[other]}": (lambda w, s: ours(w, s, other), (weights, scratch))}
           if other is not None else {}),
        "ragged_dot": (lambda r, w, g: (lax.ragged_dot(r, w, g, preferred_element_type=jnp.float32).astype(r.dtype),
                                        (r, w, g)), (rows, weights, sizes)),
        "dense": (lambda r, w: (jnp.dot(r, w, preferred_element_type=jnp.float32).astype(r.dtype), (r, w)),
                  (rows[:tokens * config.top_k], weights[0])),
    }
    if tokens >= FP8_MIN_TOKENS and H % fp8.BLOCK == 0 and N % fp8.BLOCK == 0:
        # FP8 experts in the checkpoint's [El, N, K] layout. The values only need to be finite
        # e4m3 numbers (the time does not depend on them): drawn in bf16 and cast, scales constant.
        q = (jax.random.normal(key, (config.num_local_experts, N, H), jnp.bfloat16) * 64).astype(fp8.FP8)
        q_scale = jnp.full((config.num_local_experts, N // fp8.BLOCK, H // fp8.BLOCK), 1 / (64 * H ** 0.5), jnp.float32)

        def ours_fp8(q, q_scale, s, ws):
            out, ws = gemm.fp8_forward(s.permuted, q, q_scale, s.expert_offsets, ws, live)
            return out, (q, q_scale, s, ws)
        impls["jax_moe/fp8"] = (ours_fp8, (q, q_scale, scratch, gemm.fp8_workspace(config.num_local_experts)))
    if tokens * config.top_k * config.num_experts > RAGGED_DOT_MAX_ROWS_X_EXPERTS:
        del impls["ragged_dot"]
        notes.append(f"{model.name} T={tokens}: ragged_dot not run (rows x experts > {RAGGED_DOT_MAX_ROWS_X_EXPERTS})")
    if config.num_experts <= MGPU_MAX_EXPERTS:
        for i, cfg in enumerate(MGPU_CONFIGS):
            impls[f"mgpu{i}"] = (lambda r, w, g, cfg=cfg: (_mgpu(r, w, g, cfg), (r, w, g)), (rows, weights, sizes))
    out = []
    for name, (fn, operands) in impls.items():
        try:
            result = _timed(fn, operands)
            row = {**base, "impl": name, "us": result["s"] * 1e6, "repeats": result["repeats"], "n2": result["n2"],
                   "spread_us": result["spread_s"] * 1e6}
        except Exception as e:  # one failing implementation must not end the run
            row = {**base, "impl": name, "error": timing.describe_error(e)}
        if "us" in row:
            row["tflops"] = flops / row["us"] / 1e6
            row["weight_gbs"] = base["weight_bytes"] / row["us"] / 1e3
        clock.log(f"gemm {model.name} T={tokens} {name}: " +
                  (f"{row['us']:.1f} us, {row['tflops']:.1f} TFLOP/s" if "us" in row else row["error"]))
        out.append(row)
    mgpu = [r for r in out if r["impl"].startswith("mgpu") and "us" in r]
    failed = [r["error"] for r in out if r["impl"].startswith("mgpu") and "error" in r]
    if failed and not mgpu:
        notes.append(f"{model.name} T={tokens}: ragged_dot_mgpu failed: {failed[0]}")
    if mgpu:
        best = min(mgpu, key=lambda r: r["us"])
        out.append({**best, "impl": "ragged_dot_mgpu", "config": MGPU_CONFIGS[int(best["impl"][4:])]})
    return [r for r in out if not r["impl"].startswith("mgpu")]


def measure_layer(model: ModelShape, tokens: int, clock) -> list[dict]:
    config = model.config(tokens)
    params = jax_moe.init_moe_params(jax.random.key(0), config, 1, model.ffn_size, **model.param_options())
    layer_params = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (tokens, model.hidden_size), jnp.bfloat16)
    scratch = jax_moe.init_scratch(config)
    def ours(p, x, s):
        y, s = jax_moe.moe_layer(p, x, s)
        return y, (p, x, s)

    def base(p, x):
        return baseline.baseline_moe_layer(p, x, config), (p, x)

    def with_grad(layer):  # layer(p, x, *rest) -> (y, (p, x, *rest)); d sum(y) / d (p, x) instead of y
        def fn(p, x, *rest):
            def loss(p, x):
                y, operands = layer(p, x, *rest)
                return jnp.sum(y.astype(jnp.float32)), operands
            (_, operands), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x)
            return grads, operands
        return fn

    impls = {"jax_moe": (ours, (layer_params, x, scratch)), "baseline": (base, (layer_params, x))}
    if tokens >= FP8_MIN_TOKENS and model.hidden_size % fp8.BLOCK == 0 and model.ffn_size % fp8.BLOCK == 0:
        impls["jax_moe/fp8"] = (ours, (fp8.quantize_params(layer_params), x, scratch))  # the same draws, quantised
    if tokens in GRAD_TOKENS and config.num_experts <= GRAD_MAX_EXPERTS:
        impls["jax_moe/fwd+bwd"] = (with_grad(ours), (layer_params, x, scratch))
        impls["baseline/fwd+bwd"] = (with_grad(base), (layer_params, x))
    rows = []
    for name, (fn, operands) in impls.items():
        row = {"model": model.name, "T": tokens, "impl": name, "grouped_gemm": experts.uses_grouped_matmul(
            layer_params, config) if name.startswith("jax_moe") else False}
        try:
            row["us"] = _timed(fn, operands)["s"] * 1e6
        except Exception as e:
            row["error"] = timing.describe_error(e)
        clock.log(f"layer {model.name} T={tokens} {name}: {row.get('us', row.get('error'))}")
        rows.append(row)
    return rows


def copy_ceiling_gbs(clock, trials: int = 3) -> float | None:
    """The card's device-to-device copy rate (read + write bytes per second), the best of
    ``trials`` measurements: a ceiling, so one slow trial (measured on the H200: 3.86 vs
    4.19 TB/s in another run) must not lower every roofline of the run."""
    from jax_moe.bench.permute_suite import _bench_copy
    try:
        buffer = jnp.ones((COPY_BYTES // 2,), jnp.bfloat16)
        seconds = min(_timed(lambda b: (_bench_copy(b), (b,)), (buffer,))["s"] for _ in range(trials))
        return 2 * COPY_BYTES / seconds / 1e9
    except Exception as e:
        clock.log(f"copy ceiling: {timing.describe_error(e)}")
        return None


def run(models: list[ModelShape], token_counts, clock, compile_threads, *, time_limit_s=None, on_rows=None):
    del compile_threads  # programs here are few and large; compiled one at a time
    notes = list(NOTES)
    copy = copy_ceiling_gbs(clock)
    notes.append(f"copy ceiling: {copy:.0f} GB/s" if copy else "copy ceiling: not measured")
    rows = []
    for model in models:
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"gemm {model.name} T={tokens}"):
                break
            timing.measure_isolated(
                rows, notes, clock, f"gemm {model.name} T={tokens}: failed",
                lambda: [r | {"copy_gbs": copy} for r in measure_gemm(model, tokens, clock, notes)], on_rows)
        for tokens in LAYER_TOKENS:
            if tokens not in token_counts or clock.out_of_time(time_limit_s, notes, f"layer {model.name} T={tokens}"):
                continue
            timing.measure_isolated(rows, notes, clock, f"layer {model.name} T={tokens}: failed",
                                    lambda: measure_layer(model, tokens, clock), on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    from jax_moe.bench.report import table as md_table
    lines = []
    gemm_rows = [r for r in rows if "flops" in r]
    keys = sorted({(r["model"], r["T"]) for r in gemm_rows}, key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9, k[1]))
    for model, tokens in keys:
        by = {r["impl"]: r for r in gemm_rows if (r["model"], r["T"]) == (model, tokens)}
        cell = lambda n: f"{by[n]['us']:.0f} µs / {by[n]['tflops']:.0f}" if n in by and "us" in by[n] else "–"
        ours, dense = by.get("jax_moe", {}), by.get("dense", {})
        frac = f"{ours['tflops'] / dense['tflops']:.0%}" if "us" in ours and "us" in dense else "–"
        wbw = f"{ours['weight_gbs'] / ours['copy_gbs']:.0%}" if "us" in ours and ours.get("copy_gbs") else "–"
        eight = by.get("jax_moe/fp8", {})
        fp8_frac = f"{eight['tflops'] / (2 * dense['tflops']):.0%}" if "us" in eight and "us" in dense else "–"
        fp8_speedup = f"{ours['us'] / eight['us']:.2f}x" if "us" in ours and "us" in eight else "–"
        lines.append([model, str(tokens), cell("jax_moe"), cell("ragged_dot"), cell("ragged_dot_mgpu"),
                      cell("dense"), frac, wbw, cell("jax_moe/fp8"), fp8_frac, fp8_speedup])
    text = md_table(["model", "T", "jax_moe (µs / TFLOP/s)", "ragged_dot", "ragged_dot_mgpu", "dense jnp.dot",
                     "jax_moe % of dense", "weight read % of copy", "jax_moe FP8", "FP8 % of 2x dense",
                     "FP8 vs bf16"], lines)
    layer_rows = [r for r in rows if "flops" not in r]
    lines = []
    for model, tokens in sorted({(r["model"], r["T"]) for r in layer_rows}):
        by = {r["impl"]: r for r in layer_rows if (r["model"], r["T"]) == (model, tokens)}
        line = [model, str(tokens)]
        for suffix in ("", "/fwd+bwd"):
            ours, base = by.get("jax_moe" + suffix, {}), by.get("baseline" + suffix, {})
            us = lambda r: f"{r['us']:.0f}" if "us" in r else "–"
            speedup = f"{base['us'] / ours['us']:.1f}x" if "us" in ours and "us" in base else "–"
            line += [us(ours), us(base), speedup]
        eight = by.get("jax_moe/fp8", {})
        line += [us(eight), f"{by['jax_moe']['us'] / eight['us']:.2f}x" if "us" in eight and "us" in by.get("jax_moe", {})
                 else "–"]
        lines.append(line)
    if lines:
        text += "\n\nWhole MoE layer, µs:\n\n" + md_table(
            ["model", "T", "jax_moe", "pure JAX + ragged_dot", "speed-up",
             "jax_moe fwd+bwd", "pure JAX fwd+bwd", "speed-up fwd+bwd", "jax_moe FP8", "FP8 vs bf16"], lines)
    return text


def markdown(record: dict) -> str:
    from jax_moe.bench.report import header_block
    lines = header_block("Grouped GEMM (suite gemm)", record["meta"], record.get("elapsed_s", 0.0),
                         record["method"], record["notes"])
    return "\n".join(lines) + "\n\n" + table(record["rows"]) + "\n"
