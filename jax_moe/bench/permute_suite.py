"""Suite `permute`: permute/unpermute per layer against the pure-JAX baselines, floors and ceiling.

Every case is one MoE "layer" body inside a jitted ``lax.scan`` over L layers whose per-layer
inputs (scan ``xs``) are the routing: random top-k expert ids in [0, E) (k distinct per token) and
softmax weights, never constants (XLA would fold an argsort of constants at compile time). x is
in the carry and the layer's output is the next layer's x; an optimisation barrier after each
measured op keeps XLA from fusing it into its consumer, and a probe of every op's outputs feeds
the next layer, so no layer's work is dead code (see "layer bodies" below). See
``jax_moe.bench`` for how per-layer time is measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe.bench import timing
from jax_moe.bench.models import ROW_DTYPE, ModelShape

LAYER_COUNTS = (4, 12)  # the two scan lengths of the per-layer difference
UNROLLED_MAX_TOKENS = 16  # unrolled scans only at decode sizes, where per-call overhead matters
ROLLED, UNROLLED = "rolled", "unrolled"
BASELINE_IMPL = "argsort"  # the "ratio to the baseline" divides by this implementation
INDEX_BYTES = 4  # int32 ids and indices, float32 weights

BYTES_FORMULA = (
    "R = T*k routes, s = 2 (bf16), E experts. permute bytes = (T + R)*H*s (read T rows, write R rows) "
    "+ 3*4*R (read ids, write src_index and dest_index) + 4*(2E + 1) (write group_sizes, expert_offsets); "
    "unpermute bytes = (R + T)*H*s (read R rows, write T rows) + 2*4*R (read weights, dest_index); "
    "pair = permute + unpermute. GB/s = bytes / time per layer. Copy ceiling: jax_moe_bench_copy "
    "(cudaMemcpyAsync device to device on CUDA) of N = (T + R)*H*s/2 bytes per layer, which reads N and "
    "writes N, so ceiling GB/s = 2N / its time per layer; % of ceiling = GB/s / ceiling GB/s. "
    "Ratio = time per layer / time per layer of the argsort baseline, same op and scan (< 1 is faster).")

SKIP_NOTES = (
    f"Unrolled scans run only for T <= {UNROLLED_MAX_TOKENS}: at larger T the per-layer work dwarfs the "
    "per-call overhead that unrolling changes, and unrolled compiles cost the most time.",
    "The copy ceiling runs in a rolled scan only (a copy's bandwidth does not depend on unrolling).",
    "The jnp.repeat (MaxText) variant is measured as a pair only: its unpermute is the argsort one.",
    "Donation is compared on the jax_moe pair only; the floors are measured once per model, at its "
    "smallest T (they do not depend on T).",
    "Every case, the loop floor included, pays the harness's per-layer cost: slicing the layer's routing "
    "from the scan inputs and one scalar probe that keeps the previous layer's outputs live.",
    "XLA:GPU keeps optimisation barriers through fusion; XLA:CPU drops them before fusing, so on CPU a "
    "baseline op may fuse with its neighbour: CPU runs check the harness, not the ops.",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured program: an implementation and what each layer does with it."""

    impl: str  # jax_moe, argsort, repeat, floor, copy
    op: str  # pair, permute, unpermute; loop, two_noops (floors); copy (ceiling)
    donated: bool = True  # the state (x, scratch, buffers) is donated to the jitted program

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.op}" + ("" if self.donated else "/not-donated")


SHAPE_CASES = (
    Case("jax_moe", "pair"), Case("jax_moe", "pair", donated=False),
    Case("jax_moe", "permute"), Case("jax_moe", "unpermute"),
    Case("argsort", "pair"), Case("argsort", "permute"), Case("argsort", "unpermute"),
    Case("repeat", "pair"),
    Case("copy", "copy"),
)
FLOOR_CASES = (Case("floor", "loop"), Case("floor", "two_noops"))


def scans_for(case: Case, tokens: int) -> tuple[str, ...]:
    if case.impl == "copy" or tokens > UNROLLED_MAX_TOKENS:
        return (ROLLED,)
    return (ROLLED, UNROLLED)


# --- traffic --------------------------------------------------------------------------------------

def routes(model: ModelShape, tokens: int) -> int:
    return tokens * model.top_k


def traffic_bytes(op: str, model: ModelShape, tokens: int) -> int:
    """Bytes one layer of ``op`` must move (BYTES_FORMULA)."""
    num_routes, row_bytes = routes(model, tokens), model.hidden_size * jnp.dtype(ROW_DTYPE).itemsize
    rows = (tokens + num_routes) * row_bytes
    permute = rows + 3 * INDEX_BYTES * num_routes + INDEX_BYTES * (2 * model.num_experts + 1)
    unpermute = rows + 2 * INDEX_BYTES * num_routes
    return {"permute": permute, "unpermute": unpermute, "pair": permute + unpermute}[op]


def copy_elements(model: ModelShape, tokens: int) -> int:
    """Row-dtype elements of the ceiling's copy: half the rows' bytes, since a copy reads and writes."""
    return -(-(tokens + routes(model, tokens)) * model.hidden_size // 2)


# --- implementations ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Impl:
    """How one implementation permutes and unpermutes, in the shape the layer bodies need.

    ``routed`` is what permute hands to unpermute (the jax_moe scratch, or the baseline's
    ``(permuted, group_sizes, order)``); ``held`` is what of it the scan carry keeps between
    layers: the scratch, written in place by the next permute; nothing for the baselines, which
    allocate new arrays every layer.
    """

    permute: Callable[[jax.Array, jax.Array, Any], Any]  # (x, ids, held) -> routed
    unpermute: Callable[[Any, jax.Array], jax.Array]  # (routed, weights) -> [T, H]
    hold: Callable[[Any], Any]  # routed -> held
    make_held: Callable[[], Any]
    probed: Callable[[Any], Any]  # what of routed a probe reads so that all of it is computed


def make_impl(name: str, model: ModelShape, tokens: int) -> Impl:
    from jax_moe import baseline  # written alongside; imported late so the rest runs without it
    if name == "jax_moe":
        config = model.config(tokens)
        return Impl(permute=lambda x, ids, scratch: jax_moe.permute(x, ids, scratch),
                    unpermute=lambda scratch, w: jax_moe.unpermute(scratch.permuted, w, scratch),
                    hold=lambda scratch: scratch,
                    make_held=lambda: jax_moe.init_scratch(config),
                    # One custom call writes every scratch buffer and cannot run in part. (Reading
                    # the index buffers too made XLA:CPU copy them before the next in-place permute.)
                    probed=lambda scratch: scratch.permuted)
    permute_fn = {"argsort": baseline.argsort_permute, "repeat": baseline.repeat_permute}[name]
    return Impl(permute=lambda x, ids, _: permute_fn(x, ids, model.num_experts),
                unpermute=lambda routed, w: baseline.argsort_unpermute(routed[0], w, routed[2]),
                hold=lambda routed: (),
                make_held=lambda: (),
                probed=lambda routed: routed)  # three separate ops: argsort, gather, bincount


# --- layer bodies: (carry, (ids, weights)) -> (carry, None) ---------------------------------------
#
# What keeps every layer's work live and unfused, on any XLA backend:
# - an optimisation barrier after each measured op: XLA cannot fuse across it (XLA:GPU keeps
#   barriers through fusion), so its outputs are materialised in full;
# - a probe: an int32 scalar read from one element of every op's output, 0 at run time but not
#   provably 0, carried to the next layer and added to its routing. So every output is a real
#   input of the next layer, rolled or unrolled (a barrier output nobody reads may be pruned).
#   Cost: one scalar fusion per layer, paid alike by every case, floors included.
# (Reading the previous layer's outputs at the start of the next layer instead made XLA copy the
# loop-carried buffers every iteration.)

def _tie(value):
    """An optimisation barrier: XLA may neither fuse through it nor look inside."""
    return lax.optimization_barrier(value)


def _probe(tree) -> jax.Array:
    """int32 scalar, 0 at run time (no NaN, no INT_MIN in these buffers), read from every leaf."""
    flags = []
    for leaf in jax.tree.leaves(tree):
        first = leaf.reshape(-1)[0]
        flags.append(first != first if jnp.issubdtype(first.dtype, jnp.floating)
                     else first == jnp.iinfo(jnp.int32).min)
    return sum(flag.astype(jnp.int32) for flag in flags)


def _after(probe, routing):
    """The layer's routing, made to depend on the previous layer's probe (adds 0)."""
    ids, weights = routing
    return ids + probe, weights + probe.astype(weights.dtype)


def pair_body(impl: Impl):
    def body(carry, routing):
        x, held, probe = carry
        ids, weights = _after(probe, routing)
        routed = _tie(impl.permute(x, ids, held))  # where the expert GEMMs would be
        return (impl.unpermute(routed, weights), impl.hold(routed), _probe(impl.probed(routed))), None
    return body


def permute_body(impl: Impl):
    def body(carry, routing):
        x, held, probe = carry
        ids, _ = _after(probe, routing)
        routed = _tie(impl.permute(x, ids, held))
        return (x, impl.hold(routed), _probe(impl.probed(routed))), None
    return body


def unpermute_body(impl: Impl):
    def body(carry, routing):
        _, routed, probe = carry  # routed: from the one permute before the loop
        _, weights = _after(probe, routing)
        # Passing routed through the barrier hides that every layer unpermutes the same rows,
        # so XLA cannot hoist or share per-layer work (the baseline's inverse argsort).
        routed, out = _tie((routed, impl.unpermute(routed, weights)))
        return (out, routed, _probe(out)), None
    return body


def permute_around_loop(impl: Impl):
    """The unpermute-only program's (before_loop, after_loop): one permute before the loop (a
    per-program cost, removed by the difference) gives every layer the same routed rows to
    unpermute with its own weights; the carry holds them in place of ``held``."""
    def before_loop(state, routing):
        x, held, probe = state
        return x, impl.permute(x, routing[0][0], held), probe

    def after_loop(carry):
        x, routed, probe = carry
        return x, impl.hold(routed), probe

    return before_loop, after_loop


def _bench_noop(buffer):
    return jax.ffi.ffi_call("jax_moe_bench_noop", jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                            input_output_aliases={0: 0})(buffer)


def _bench_copy(buffer):
    # Side-effecting, so XLA neither hoists this loop-invariant copy out of the loop nor drops it.
    return jax.ffi.ffi_call("jax_moe_bench_copy", jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                            has_side_effect=True)(buffer)


def loop_floor_body(carry, routing):
    x, probe = carry
    return (x, _probe(_after(probe, routing))), None  # reads the layer's routing, nothing else


def two_noops_body(carry, routing):
    x, buffer, probe = carry
    return (x, _bench_noop(_bench_noop(buffer)), _probe(_after(probe, routing))), None


def copy_body(buffers, routing):
    # Copies a fixed source into the carried destination. (Carrying the copy's own result made XLA
    # copy the loop-carried buffer again every iteration, measured on the H200: twice the bytes.)
    source, _ = buffers
    return (source, _bench_copy(source)), None


# --- programs -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
    """A scanned program ``fn(state, routing) -> state`` and how to build its input state."""

    fn: Callable
    make_state: Callable[[jax.Array], Any]  # key -> state (device arrays)
    donate: bool


def _unchanged(value, *_):
    return value


def build_program(case: Case, model: ModelShape, tokens: int, scan: str) -> Program:
    unroll = True if scan == UNROLLED else 1
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731  (the probe before the first layer)
    rows = lambda key: jax.random.normal(key, (tokens, model.hidden_size), ROW_DTYPE)  # noqa: E731
    before_loop, after_loop = _unchanged, _unchanged

    if case.op == "loop":
        body, make_state = loop_floor_body, lambda key: (rows(key), zero())
    elif case.op == "two_noops":
        buffer_shape = (routes(model, tokens), model.hidden_size)  # like the scratch's permuted rows
        body = two_noops_body
        make_state = lambda key: (rows(key), jnp.zeros(buffer_shape, ROW_DTYPE), zero())  # noqa: E731
    elif case.op == "copy":
        body = copy_body
        make_state = lambda key: (jnp.ones((copy_elements(model, tokens),), ROW_DTYPE),  # noqa: E731
                                  jnp.zeros((copy_elements(model, tokens),), ROW_DTYPE))
    else:
        impl = make_impl(case.impl, model, tokens)
        make_state = lambda key: (rows(key), impl.make_held(), zero())  # noqa: E731
        body = {"pair": pair_body, "permute": permute_body, "unpermute": unpermute_body}[case.op](impl)
        if case.op == "unpermute":
            before_loop, after_loop = permute_around_loop(impl)

    def fn(state, routing):
        carry, _ = lax.scan(body, before_loop(state, routing), routing, unroll=unroll)
        return after_loop(carry)

    return Program(fn=fn, make_state=make_state, donate=case.donated)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_routing(key, layers: int, tokens: int, num_experts: int, top_k: int):
    """Per-layer routing [L, T, k]: k distinct uniform expert ids per token, softmax weights."""
    id_key, weight_key = jax.random.split(key)
    _, ids = lax.top_k(jax.random.uniform(id_key, (layers, tokens, num_experts)), top_k)
    weights = jax.nn.softmax(jax.random.normal(weight_key, (layers, tokens, top_k)), axis=-1)
    return ids.astype(jnp.int32), weights.astype(jnp.float32)


# --- the suite ------------------------------------------------------------------------------------

def _row(model: ModelShape, tokens: int, case: Case, scan: str) -> dict:
    row = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
           "H": model.hidden_size, "T": tokens, "R": routes(model, tokens), "case": case.name,
           "impl": case.impl, "op": case.op, "donated": case.donated, "scan": scan}
    if case.op in ("permute", "unpermute", "pair"):
        row["bytes"] = traffic_bytes(case.op, model, tokens)
    if case.op == "copy":
        row["bytes"] = 2 * copy_elements(model, tokens) * jnp.dtype(ROW_DTYPE).itemsize  # read + write
    return row


def measure_shape(model: ModelShape, tokens: int, cases, layer_counts, clock: timing.Clock,
                  compile_threads: int, seed: int = 0) -> list[dict]:
    """Lowers, compiles (concurrently) and times every (case, scan) of one (model, T)."""
    key = jax.random.PRNGKey(seed)
    ids, weights = random_routing(key, max(layer_counts), tokens, model.num_experts, model.top_k)
    routing = {layers: (ids[:layers], weights[:layers]) for layers in layer_counts}

    # Lower everything first (Python, one thread), then compile it all concurrently.
    entries, lowered = [], {}
    for case in cases:
        for scan in scans_for(case, tokens):
            row, program = _row(model, tokens, case, scan), None
            try:
                program = build_program(case, model, tokens, scan)
                state_spec = jax.eval_shape(program.make_state, key)
                caught = set()
                for layers in layer_counts:
                    routing_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), routing[layers])
                    lowered[(case, scan, layers)], found = timing.lower(
                        program.fn, (state_spec, routing_spec), (0,) if program.donate else ())
                    caught.update(found)
                row["warnings"] = sorted(caught)
            except Exception as e:  # e.g. a module not written yet: recorded, the run goes on
                row["error"] = timing.describe_error(e)
            entries.append((row, case, scan, program))
    compiled = timing.compile_all(lowered, compile_threads)
    clock.log(f"permute {model.name} T={tokens}: compiled {len(compiled)} programs")

    for row, case, scan, program in entries:
        where = f"permute {model.name} T={tokens} {row['case']} {scan}"
        if "error" in row:
            clock.log(f"{where}: {row['error']}")
            continue
        results = {layers: compiled[(case, scan, layers)] for layers in layer_counts}
        row["compile_s"] = round(sum(seconds for _, seconds in results.values()), 3)
        try:
            executables = {}
            for layers, (executable, _) in results.items():
                if isinstance(executable, Exception):
                    raise executable
                executables[layers] = executable
            row["hlo_buffer_copies"] = {str(layers): timing.buffer_copies(e) for layers, e in executables.items()}
            state = program.make_state(jax.random.fold_in(key, 1))
            measured, state = timing.per_layer_seconds(executables, state, routing)
            del state
            row["us_per_layer"] = measured["per_layer_s"] * 1e6
            row["spread_us"] = measured["spread_s"] * 1e6
            row["program_us"] = {str(layers): s * 1e6 for layers, s in measured["program_s"].items()}
            row["repeats"] = measured["repeats"]
            clock.log(f"{where}: {row['us_per_layer']:.2f} us/layer")
        except Exception as e:
            row["error"] = timing.describe_error(e)
            clock.log(f"{where}: {row['error']}")
    rows = [row for row, *_ in entries]
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    """Adds GB/s, % of the copy ceiling and the ratio to the baseline, from the measured times."""
    def time_of(model, tokens, case_name, scan):
        for r in rows:
            if (r["model"], r["T"], r["case"], r["scan"]) == (model, tokens, case_name, scan):
                return r.get("us_per_layer")
        return None

    for row in rows:
        us = row.get("us_per_layer")
        if us is None or row["op"] not in ("permute", "unpermute", "pair", "copy") or us <= 0:
            continue
        row["gb_per_s"] = row["bytes"] / (us * 1e-6) / 1e9
    for row in rows:
        us = row.get("us_per_layer")
        if us is None or row["op"] not in ("permute", "unpermute", "pair"):
            continue
        baseline = time_of(row["model"], row["T"], f"{BASELINE_IMPL}/{row['op']}", row["scan"])
        if baseline and baseline > 0:
            row["ratio_to_baseline"] = us / baseline
        ceiling = next((r.get("gb_per_s") for r in rows if r["model"] == row["model"]
                        and r["T"] == row["T"] and r["op"] == "copy"), None)
        if ceiling and "gb_per_s" in row:
            row["ceiling_gb_per_s"] = ceiling
            row["pct_of_copy_ceiling"] = 100.0 * row["gb_per_s"] / ceiling


def run(models: list[ModelShape], token_counts, clock: timing.Clock, compile_threads: int,
        layer_counts=LAYER_COUNTS, on_rows: Callable[[list[dict], list[str]], Any] | None = None,
        time_limit_s: float | None = None) -> tuple[list[dict], list[str]]:
    """The whole suite. ``on_rows(rows, notes)`` gets everything so far after each shape (partial saves)."""
    rows, notes = [], list(SKIP_NOTES)
    for model in models:
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
                continue
            cases = SHAPE_CASES + (FLOOR_CASES if tokens == min(token_counts) else ())
            rows.extend(measure_shape(model, tokens, cases, layer_counts, clock, compile_threads))
            if on_rows:
                on_rows(rows, notes)
    return rows, notes

