"""Suite permute: permute and unpermute per layer against the pure-JAX baselines, a floor and a ceiling.

Each case is a layer body in a jitted ``lax.scan`` over the routing (k distinct random ids a token, softmax
weights), each layer's output the next one's x, a barrier after each measured op and a scalar read from
every output feeding the next layer's routing (nothing fused away or dead). Cases: jax_moe, ``argsort`` (pure
JAX), ``repeat`` (MaxText's ``jnp.repeat``), pair and each op alone; the jax_moe pair not donated; the copy.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import baseline
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE, ModelShape

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b", "deepseek_v3")
QUICK_TOKENS = (1, 16, 4096)
LAYER_COUNTS = (4, 12)
UNROLLED_MAX_TOKENS = 16  # above, the work dwarfs the per-call overhead unrolling changes
ROLLED, UNROLLED = "rolled", "unrolled"
BASELINE = "argsort"  # ratios divide by this implementation's time
INDEX_BYTES = 4  # int32 ids and indices, float32 weights
TITLE = "jax_moe permute/unpermute per layer"
METHOD = common.PER_LAYER_METHOD + (
    " Bytes, with R = T*k routes and bf16 rows: permute (T + R)*H*2 + 3*4*R (ids, both indices) + 4*(2E + 1) "
    "(group sizes, offsets); unpermute (R + T)*H*2 + 2*4*R (weights, indices); GB/s = bytes / time. Copy "
    "ceiling: a copy of (T + R)*H bytes, which reads and writes them; % copy = GB/s / the copy's GB/s. "
    "Ratio = time / the argsort baseline's, same op and scan (< 1: faster). Unrolled scans only for "
    f"T <= {UNROLLED_MAX_TOKENS}; the repeat variant as a pair only (its unpermute is argsort's). XLA:CPU "
    "drops optimisation barriers before fusing: CPU runs check the harness, not the ops.")


# implementation/op[/not-donated: the state (x, scratch) not donated to the program]
CASES = ("jax_moe/pair", "jax_moe/pair/not-donated", "jax_moe/permute", "jax_moe/unpermute", "argsort/pair",
         "argsort/permute", "argsort/unpermute", "repeat/pair", "copy/copy")


def traffic_bytes(op: str, model: ModelShape, tokens: int) -> int:
    routes, row_bytes = tokens * model.top_k, model.hidden_size * jnp.dtype(ROW_DTYPE).itemsize
    permute = (tokens + routes) * row_bytes + 3 * INDEX_BYTES * routes + INDEX_BYTES * (2 * model.num_experts + 1)
    unpermute = (tokens + routes) * row_bytes + 2 * INDEX_BYTES * routes
    return {"permute": permute, "unpermute": unpermute, "pair": permute + unpermute,
            "copy": (tokens + routes) * row_bytes}[op]


class Impl(NamedTuple):
    """One implementation as the layer bodies use it. ``routed`` is what permute hands unpermute (the
    scratch, or the baseline's (rows, group sizes, order)); the carry holds ``hold(routed)`` between
    layers: the scratch, rewritten in place, or nothing (the baselines allocate anew)."""

    permute: Callable  # (x, ids, held) -> routed
    unpermute: Callable  # (routed, weights) -> [T, H]
    hold: Callable  # routed -> held
    make_held: Callable
    probed: Callable  # routed -> what a probe reads for all of it to be computed


def make_impl(name: str, model: ModelShape, tokens: int) -> Impl:
    if name == "jax_moe":
        config = model.config(tokens)
        # One custom call writes every scratch buffer: reading its rows keeps the call whole.
        return Impl(jax_moe.permute, lambda s, w: jax_moe.unpermute(s.permuted, w, s), lambda s: s,
                    lambda: jax_moe.init_scratch(config), lambda s: s.permuted)
    permute = {"argsort": baseline.argsort_permute, "repeat": baseline.repeat_permute}[name]
    return Impl(lambda x, ids, _: permute(x, ids, model.num_experts),
                lambda routed, w: baseline.argsort_unpermute(routed[0], w, routed[2]),
                lambda routed: (), tuple, lambda routed: routed)  # argsort, gather and bincount: all probed


def _after(probe, routing):
    """The layer's routing, made to depend on the previous layer's outputs (adds 0)."""
    ids, weights = routing
    return ids + probe, weights + probe.astype(weights.dtype)


def build_program(case: str, model: ModelShape, tokens: int, scan: str, routing: dict) -> common.ScanProgram:
    """The case's scan over the layers of ``routing`` (L -> (ids, weights)) and its fresh state."""
    impl_name, op, *not_donated = case.split("/")
    before_loop, after_loop = (lambda state, _: state), (lambda carry: carry)  # noqa: E731
    if op == "copy":
        size = traffic_bytes("copy", model, tokens) // (2 * jnp.dtype(ROW_DTYPE).itemsize)  # read + write

        def body(buffers, layer):  # a fixed source into the carried destination (carrying the copy's own
            source, _ = buffers  # result made XLA copy the loop-carried buffer again: twice the bytes)
            return (source, common.device_copy(source, common.runtime_zero(layer))), None
        make_state = lambda: (jnp.ones((size,), ROW_DTYPE), jnp.zeros((size,), ROW_DTYPE))  # noqa: E731
    else:
        impl = make_impl(impl_name, model, tokens)
        x = jax.random.normal(jax.random.key(1), (tokens, model.hidden_size), ROW_DTYPE)
        make_state = lambda: (jnp.copy(x), impl.make_held(), jnp.zeros((), jnp.int32))  # noqa: E731  (x, held, probe)
        if op in ("pair", "permute"):
            def body(carry, layer):
                x, held, probe = carry
                ids, weights = _after(probe, layer)
                routed = lax.optimization_barrier(impl.permute(x, ids, held))  # where the experts would run
                y = impl.unpermute(routed, weights) if op == "pair" else x
                return (y, impl.hold(routed), common.runtime_zero(impl.probed(routed))), None
        else:
            def body(carry, layer):
                _, routed, probe = carry  # the rows of the one permute before the loop
                # Through the barrier, routed hides that every layer unpermutes the same rows: nothing hoisted.
                routed, out = lax.optimization_barrier((routed, impl.unpermute(routed, _after(probe, layer)[1])))
                return (out, routed, common.runtime_zero(out)), None
            # One permute before the loop gives every layer the same rows; the carry holds them, not the scratch.
            before_loop = lambda state, routing: (  # noqa: E731
                state[0], impl.permute(state[0], routing[0][0], state[1]), state[2])
            after_loop = lambda carry: (carry[0], impl.hold(carry[1]), carry[2])  # noqa: E731

    def fn(state, routing):
        carry, _ = lax.scan(body, before_loop(state, routing), routing, unroll=True if scan == UNROLLED else 1)
        return after_loop(carry)

    return common.ScanProgram(fn, make_state, routing, donate=not not_donated)


def random_routing(key, layers: int, tokens: int, num_experts: int, top_k: int):
    """Per-layer routing [L, T, k]: k distinct uniform expert ids per token, softmax weights."""
    id_key, weight_key = jax.random.split(key)
    _, ids = lax.top_k(jax.random.uniform(id_key, (layers, tokens, num_experts)), top_k)
    weights = jax.nn.softmax(jax.random.normal(weight_key, (layers, tokens, top_k)), axis=-1)
    return ids.astype(jnp.int32), weights.astype(jnp.float32)


def measure_shape(model: ModelShape, tokens: int, cases, layer_counts, clock, compile_threads: int) -> list[dict]:
    ids, weights = random_routing(jax.random.key(0), max(layer_counts), tokens, model.num_experts, model.top_k)
    routing = {layers: (ids[:layers], weights[:layers]) for layers in layer_counts}
    programs, rows = {}, {}
    for case in cases:
        impl, op, *not_donated = case.split("/")
        for scan in (ROLLED,) if impl == "copy" or tokens > UNROLLED_MAX_TOKENS else (ROLLED, UNROLLED):
            name = f"{case} {scan}"
            rows[name] = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
                          "H": model.hidden_size, "T": tokens, "R": tokens * model.top_k, "case": case, "impl": impl,
                          "op": op, "donated": not not_donated, "scan": scan, "bytes": traffic_bytes(op, model, tokens)}
            programs[name] = build_program(case, model, tokens, scan, routing)
    for name, fields in common.time_scans(programs, compile_threads, clock, f"permute {model.name} T={tokens}").items():
        rows[name].update(fields)
    return derive(list(rows.values()))


def derive(rows: list[dict]) -> list[dict]:
    """GB/s, the ratio to the baseline and % of the copy ceiling, from the measured times."""
    def find(row, case, scan=None):
        want = (row["model"], row["T"], case, scan or row["scan"])
        return next((r for r in rows if (r["model"], r["T"], r["case"], r["scan"]) == want), {})

    for row in rows:
        if row.get("us_per_layer", 0) > 0 and "bytes" in row:
            row["gb_per_s"] = row["bytes"] / row["us_per_layer"] / 1e3
    for row in (r for r in rows if r["op"] in ("permute", "unpermute", "pair") and "us_per_layer" in r):
        if find(row, f"{BASELINE}/{row['op']}").get("us_per_layer", 0) > 0:
            row["ratio_to_baseline"] = row["us_per_layer"] / find(row, f"{BASELINE}/{row['op']}")["us_per_layer"]
        ceiling = find(row, "copy/copy", ROLLED).get("gb_per_s")
        if ceiling and "gb_per_s" in row:
            row["ceiling_gb_per_s"], row["pct_of_copy_ceiling"] = ceiling, 100 * row["gb_per_s"] / ceiling
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, layer_counts=LAYER_COUNTS,
        on_rows=None, time_limit_s=None) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    for model in models:
        for tokens in token_counts:
            if not clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
                measure = functools.partial(measure_shape, model, tokens, CASES, layer_counts, clock, compile_threads)
                common.measure_isolated(rows, notes, clock, f"permute {model.name} T={tokens}: failed", measure,
                                        on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    columns = [(case, common.cell(case, "us_per_layer")) for case in dict.fromkeys(r["case"] for r in rows)]
    columns += [("pair jax_moe / argsort", common.cell("jax_moe/pair", "ratio_to_baseline", common.fmt_ratio)),
                *((f"{op} jax_moe % copy", common.cell(f"jax_moe/{op}", "pct_of_copy_ceiling", common.fmt_pct))
                  for op in ("permute", "unpermute")), ("copy GB/s", common.cell("copy/copy", "gb_per_s"))]
    return "µs per layer:\n\n" + common.pivot(rows, ("model", "scan", "T"), columns, name="case")
