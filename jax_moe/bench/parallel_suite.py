"""Suite `parallel`: the expert-parallel stack (``jax_moe.parallel.moe_stack_ep``) per layer.

Runs on every device JAX sees (n of them; n = 1 works too): one mesh axis ``expert`` carries both
the experts (E / n per device) and the tokens (T = n * T_per_device, T_per_device the table's T).
For each model, T and per-peer capacity rule, these programs are timed per layer (a jitted
``lax.scan`` of L layers, the per-layer time from two scan lengths, see ``jax_moe.bench``):

- ``ep``: the sharded stack as users run it (route, dispatch, all_to_all, permute, experts,
  unpermute, all_to_all back, combine), the (x, scratch) state donated and threaded;
- ``ep/no-collective``: the same program with each ``all_to_all`` replaced by an identity of the
  same shapes (every device keeps its own send buffer): all compute, no communication. Its result
  is meaningless; its time is the layer without collectives;
- ``all_to_all``: a scan doing only the layer's three exchanges (rows and ids out, rows back) on
  buffers of the same shapes;
- ``single-device``: ``moe_stack`` of the same global problem (T tokens, all E experts) on device 0.

collectives = ep - ep/no-collective (µs per layer), share = collectives / ep. Capacity rules:
``no-drop`` (C = T_per_device * min(k, El): nothing can overflow; n times the mean load) and
``cf=2`` (C = ceil(2 * T_per_device * k / n)); the routes dropped at cf=2 are counted and reported.
Where ``lax.ragged_all_to_all`` runs (GPUs), ``dropless``: no-drop's buffers with the ragged
exchange, which sends only the live rows (``init_scratch_ep(..., ragged=True)``); only its ``ep``
program is timed (its no-collective program is no-drop's). Every row reports the rows (and bytes)
each device sends per layer and direction, against the live rows (the routes kept).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_moe
from jax_moe import parallel
from jax_moe.bench import report, timing
from jax_moe.bench.models import ROW_DTYPE, ModelShape
from jax_moe.bench.stack_suite import init_stack_params
from jax_moe.layers import moe_stack

AXIS = "expert"
# Models (need an ffn size) and tokens per device: DeepSeek-V3's shapes at a prefill size and a
# large batch (issue 7). Its experts take 22.5 GB per layer, and the suite holds the stack twice
# (sharded, and whole on device 0 for the single-device comparison), so the per-layer difference
# is taken between 1 and 2 layers: about 100 GB on device 0 with two devices.
MODELS = ("deepseek_v3",)
TOKENS = (1024, 8192)
LAYER_COUNTS = (1, 2)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (16,)
CAPACITY_FACTORS = {"no-drop": None, "cf=2": 2.0}
DROPLESS = "dropless"  # no-drop's capacity, rows sent with ragged_all_to_all (only where it runs)

NOTES = (
    "T is tokens per device; the stack runs n*T tokens over the n devices of the mesh axis.",
    "collectives = ep - ep/no-collective per layer (the same program with each all_to_all replaced by an "
    "identity of the same shapes); share = collectives / ep. 'all_to_all' times the three exchanges alone.",
    "With one device the all_to_all has one participant: share ~0 is expected, the table then shows the "
    "sharded program's overhead against the single-device stack.",
    "no-drop sends n*C = n*T*min(k, E/n) rows per device and layer (empty slots included) so nothing "
    "can overflow; cf=2 sends n*ceil(2*T*k/n) and drops (and counts) what overflows.",
    "Experts are SwiGLU as moe_layer runs them: on a GPU (bf16) the CUDA grouped GEMM "
    "(jax_moe.grouped_matmul), elsewhere jax.lax.ragged_dot; rows are bf16.",
    "A capacity rule whose C equals no-drop's (e.g. cf=2 on 2 devices) is the same program: not run again.",
    "rows sent = rows each device sends per layer and direction (fixed layouts: all n*C slots, empty ones "
    "included; dropless: the live rows only); live rows = the routes kept (T*k less the dropped); bytes = "
    "rows x H x 2 (bf16).",
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # ep, ep/no-collective, all_to_all, single-device
    capacity: str | None  # a CAPACITY_FACTORS key; None for single-device


def cases(capacities=tuple(CAPACITY_FACTORS), dropless: bool = False) -> tuple[Case, ...]:
    out = []
    for capacity in capacities:
        out += [Case("ep", capacity), Case("ep/no-collective", capacity), Case("all_to_all", capacity)]
    if dropless:
        out.append(Case("ep", DROPLESS))
    return (*out, Case("single-device", None))


def capacity_factor(rule: str):
    """The ``capacity_factor`` of a capacity rule (dropless: no-drop's)."""
    return None if rule == DROPLESS else CAPACITY_FACTORS[rule]


def distinct_capacities(config, num_devices: int, tokens: int) -> tuple[str, ...]:
    """The capacity rules in CAPACITY_FACTORS that give different per-peer capacities C."""
    seen, out = set(), []
    for name, factor in CAPACITY_FACTORS.items():
        capacity = parallel.peer_capacity(config, num_devices, tokens, factor)
        if capacity not in seen:
            seen.add(capacity)
            out.append(name)
    return tuple(out)


def _identity(blocks, axis_name):
    del axis_name
    return blocks


def ragged_all_to_all_support(mesh: Mesh) -> str:
    """'supported', or why a one-row ``lax.ragged_all_to_all`` on ``mesh`` did not compile/run."""
    n = mesh.shape[AXIS]

    def per_device(x):
        ones = jnp.ones((n,), jnp.int32)
        offsets = jnp.arange(n, dtype=jnp.int32)
        out_offsets = jnp.full((n,), lax.axis_index(AXIS), jnp.int32)
        return lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, ones, out_offsets, ones, axis_name=AXIS)

    try:
        x = jax.device_put(jnp.ones((n * n, 4), jnp.float32), NamedSharding(mesh, P(AXIS)))
        fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        jax.block_until_ready(fn(x))
        return "supported"
    except Exception as e:  # recorded: the backend's answer is the measurement
        return timing.describe_error(e)


@dataclasses.dataclass
class Program:
    fn: Callable  # fn(state, params_L) -> state; the state is donated
    make_state: Callable[[], Any]  # fresh buffers each call (a donated state is consumed)
    params: dict  # layer count -> that case's params (the scan's xs)


def _fresh(x: jax.Array, where) -> jax.Array:
    """A copy of x placed on ``where``: never an alias of x, which a donating program would delete."""
    return jax.device_put(jnp.copy(x), where)


def build_program(case: Case, model: ModelShape, tokens: int, mesh: Mesh, params: dict,
                  local_params: dict, x: jax.Array) -> Program:
    """The case's program and its initial state; ``params`` maps L -> sharded params of L layers."""
    n = mesh.shape[AXIS]
    config = model.config(n * tokens)
    if case.name == "single-device":
        def fn(state, layer_params):
            return moe_stack(layer_params, *state)
        device = jax.devices()[0]
        return Program(fn, lambda: (_fresh(x, device), jax_moe.init_scratch(config, device)), local_params)

    factor = capacity_factor(case.capacity)
    sharding = NamedSharding(mesh, P(AXIS))
    if case.name == "all_to_all":
        capacity = parallel.peer_capacity(config, n, tokens, factor)

        def make_state():
            return (jax.device_put(jnp.ones((n * n, capacity, model.hidden_size), ROW_DTYPE), sharding),
                    jax.device_put(jnp.zeros((n * n, capacity), jnp.int32), sharding))

        def exchanges(rows, ids, layer_params):
            def body(carry, _):
                rows, ids = carry
                rows, ids = parallel.all_to_all(rows, AXIS), parallel.all_to_all(ids, AXIS)
                return (parallel.all_to_all(rows, AXIS), ids), None
            (rows, ids), _ = lax.scan(body, (rows, ids), layer_params["router"])
            return rows, ids

        def fn(state, layer_params):
            return jax.shard_map(exchanges, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()),
                                 out_specs=(P(AXIS), P(AXIS)))(*state, {"router": layer_params["router"]})
        return Program(fn, make_state, params)

    exchange = parallel.all_to_all if case.name == "ep" else _identity

    def fn(state, layer_params):
        y, scratch, _ = parallel.moe_stack_ep(layer_params, *state, mesh=mesh, axis_name=AXIS, _exchange=exchange)
        return y, scratch
    return Program(fn, lambda: (_fresh(x, sharding), parallel.init_scratch_ep(
        config, mesh, AXIS, capacity_factor=factor, ragged=case.capacity == DROPLESS)), params)


def dropped_routes(model: ModelShape, tokens: int, mesh: Mesh, params: dict, x: jax.Array, factor) -> int:
    """Routes the capacity rule drops in one call of the L-layer stack (all layers, all devices)."""
    n = mesh.shape[AXIS]
    scratch = parallel.init_scratch_ep(model.config(n * tokens), mesh, AXIS, capacity_factor=factor)
    step = jax.jit(functools.partial(parallel.moe_stack_ep, mesh=mesh, axis_name=AXIS), donate_argnums=2)
    _, _, dropped = step(params, _fresh(x, NamedSharding(mesh, P(AXIS))), scratch)
    return int(np.sum(np.asarray(dropped)))


def _row(model: ModelShape, tokens: int, n: int, case: Case) -> dict:
    row = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
           "H": model.hidden_size, "F": model.ffn_size, "devices": n, "T": tokens, "T_global": n * tokens,
           "case": case.name, "capacity": case.capacity or "-"}
    if case.capacity is not None:
        row.update(exchange_volume(model, tokens, n, case.capacity))
    return row


def exchange_volume(model: ModelShape, tokens: int, num_devices: int, rule: str) -> dict:
    """What one device sends per layer and direction under a capacity rule (tokens per device).

    ``C``; ``rows_sent``: every slot of the fixed layout (n*C, empty ones included), or for
    dropless the live rows alone (every route kept, one row each); ``bytes_sent`` (bf16 rows);
    ``live_rows``: the routes, T*k (less the dropped ones, which the run counts).
    """
    config = model.config(num_devices * tokens)
    capacity = parallel.peer_capacity(config, num_devices, tokens, capacity_factor(rule))
    rows_sent = tokens * model.top_k if rule == DROPLESS else num_devices * capacity
    return {"C": capacity, "rows_sent": rows_sent, "live_rows": tokens * model.top_k,
            "bytes_sent": rows_sent * model.hidden_size * jnp.dtype(ROW_DTYPE).itemsize}


def measure_model(model: ModelShape, token_counts, layer_counts, mesh: Mesh, clock: timing.Clock,
                  compile_threads: int, seed: int = 0, time_limit_s=None, notes=None,
                  ragged_supported: bool = False) -> list[dict]:
    n = mesh.shape[AXIS]
    key = jax.random.PRNGKey(seed)
    config = model.config(n * max(token_counts))
    local_params = init_stack_params(key, config, max(layer_counts), model.ffn_size)
    sharded_params = parallel.shard_params(local_params, mesh, AXIS)

    def first(stack, layers):  # the longest scan takes the stack itself: no second copy of it
        return stack if layers == max(layer_counts) else jax.tree.map(lambda a: a[:layers], stack)
    params = {layers: first(sharded_params, layers) for layers in layer_counts}
    single_params = {layers: first(local_params, layers) for layers in layer_counts}
    clock.log(f"parallel {model.name}: {n} device(s), L={layer_counts}, F={model.ffn_size}")
    rows = []
    dropless = ragged_supported
    for tokens in token_counts:
        if clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
            continue
        x = jax.random.normal(jax.random.fold_in(key, tokens), (n * tokens, model.hidden_size), ROW_DTYPE)
        entries, lowered = [], {}
        capacities = distinct_capacities(model.config(n * tokens), n, tokens)
        for name in CAPACITY_FACTORS:
            if name not in capacities:
                clock.log(f"parallel {model.name} T={tokens} {name}: same C as no-drop, not run again")
        for case in cases(capacities, dropless=dropless):
            row = _row(model, tokens, n, case)
            try:
                program = build_program(case, model, tokens, mesh, params, single_params, x)
                found = set()
                state_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                          program.make_state())
                for layers in layer_counts:
                    lowered[(case, layers)], caught = timing.lower(
                        program.fn, (state_spec, program.params[layers]), (0,))
                    found.update(caught)
                row["warnings"] = sorted(found)
            except Exception as e:
                row["error"], program = timing.describe_error(e), None
            entries.append((row, case, program))
        compiled = timing.compile_all(lowered, compile_threads)
        clock.log(f"parallel {model.name} T={tokens}: compiled {len(compiled)} programs")
        for row, case, program in entries:
            where = f"parallel {model.name} T={tokens} {case.name} {row['capacity']}"
            if "error" in row:
                clock.log(f"{where}: {row['error']}")
                continue
            try:
                executables = {}
                for layers in layer_counts:
                    executable, seconds = compiled[(case, layers)]
                    if isinstance(executable, Exception):
                        raise executable
                    executables[layers] = executable
                    row["compile_s"] = round(row.get("compile_s", 0.0) + seconds, 3)
                row["hlo_buffer_copies"] = {str(k): timing.buffer_copies(e) for k, e in executables.items()}
                measured, state = timing.per_layer_seconds(executables, program.make_state(), program.params)
                del state
                row["us_per_layer"] = measured["per_layer_s"] * 1e6
                row["spread_us"] = measured["spread_s"] * 1e6
                row["program_us"] = {str(k): s * 1e6 for k, s in measured["program_s"].items()}
                row["repeats"] = measured["repeats"]
                if case.name == "ep" and capacity_factor(case.capacity) is not None:
                    layers = max(layer_counts)
                    row["dropped_routes"] = dropped_routes(model, tokens, mesh, params[layers], x,
                                                           capacity_factor(case.capacity))
                    row["dropped_pct"] = 100.0 * row["dropped_routes"] / (layers * n * tokens * model.top_k)
                    row["live_rows"] -= row["dropped_routes"] / (layers * n)  # per device and layer
                clock.log(f"{where}: {row['us_per_layer']:.1f} us/layer")
            except Exception as e:
                row["error"] = timing.describe_error(e)
                clock.log(f"{where}: {row['error']}")
        rows += [row for row, *_ in entries]
    derive(rows)
    return rows


def _find(rows, row, case_name, capacity=None):
    capacity = row["capacity"] if capacity is None else capacity
    return next((r for r in rows if (r["model"], r["T"], r["case"], r["capacity"]) ==
                 (row["model"], row["T"], case_name, capacity)), None)


def _no_collective(rows, row):
    """The ep row's program without collectives: its own rule's (dropless has none: no-drop's)."""
    return _find(rows, row, "ep/no-collective", "no-drop" if row["capacity"] == DROPLESS else None)


def derive(rows: list[dict]) -> None:
    """collectives_us = ep - ep/no-collective, share = that / ep; ratio to the single-device stack."""
    for row in rows:
        if row["case"] != "ep" or row.get("us_per_layer") is None:
            continue
        local = _no_collective(rows, row)
        if local and local.get("us_per_layer") is not None:
            row["collectives_us"] = row["us_per_layer"] - local["us_per_layer"]
            if row["us_per_layer"] > 0:
                row["collective_share_pct"] = 100.0 * row["collectives_us"] / row["us_per_layer"]
        single = _find(rows, row, "single-device", "-")
        if single and single.get("us_per_layer"):
            row["ratio_to_single_device"] = row["us_per_layer"] / single["us_per_layer"]


def make_mesh() -> Mesh:
    """Every device JAX sees on one axis ``expert`` (Auto axis type)."""
    return Mesh(np.array(jax.devices()), (AXIS,))


def facts() -> dict:
    """The mesh size and whether ``lax.ragged_all_to_all`` compiles and runs on this backend."""
    mesh = make_mesh()
    return {"devices": mesh.size, "ragged_all_to_all": ragged_all_to_all_support(mesh)}


def run(models: list[ModelShape], token_counts, clock: timing.Clock, compile_threads: int,
        layer_counts=LAYER_COUNTS, on_rows: Callable[[list[dict], list[str]], Any] | None = None,
        time_limit_s: float | None = None, found: dict | None = None) -> tuple[list[dict], list[str]]:
    """The suite on all devices. ``found``: ``facts()`` if already probed. Returns (rows, notes)."""
    mesh = make_mesh()
    found = facts() if found is None else found
    support = found["ragged_all_to_all"]
    notes = list(NOTES) + [f"lax.ragged_all_to_all on this backend ({mesh.size} device(s)): {support}"
                           + ("" if support == "supported" else "; only the fixed-capacity all_to_all is measured")]
    clock.log(notes[-1])
    rows = []
    for model in models:
        if model.ffn_size is None:
            notes.append(f"{model.name}: not in the parallel suite (no ffn size chosen)")
            continue
        if model.num_experts % mesh.size:
            notes.append(f"{model.name}: E={model.num_experts} is not a multiple of {mesh.size} devices")
            continue
        timing.measure_isolated(rows, notes, clock, f"{model.name}: failed before any program ran",
                                lambda: measure_model(model, token_counts, layer_counts, mesh, clock,
                                                      compile_threads, time_limit_s=time_limit_s, notes=notes,
                                                      ragged_supported=support == "supported"),
                                on_rows)
    return rows, notes


# --- report ---------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    fmt_us, fmt_pct, fmt_ratio = report.fmt_us, report.fmt_pct, report.fmt_ratio
    lines = []
    for row in rows:
        if row["case"] != "ep":
            continue
        local = _no_collective(rows, row)
        alone = _find(rows, row, "all_to_all")
        single = _find(rows, row, "single-device", "-")

        def us(r):
            return "error" if r is not None and "error" in r else fmt_us((r or {}).get("us_per_layer"))

        lines.append([row["label"], str(row["devices"]), str(row["T"]), row["capacity"], str(row.get("C", "")),
                      us(row), us(local), fmt_us(row.get("collectives_us")), fmt_pct(row.get("collective_share_pct")),
                      us(alone), us(single), fmt_ratio(row.get("ratio_to_single_device")),
                      report.MISSING if "dropped_pct" not in row else f"{row['dropped_pct']:.1f}%",
                      f"{row['rows_sent']:,}", f"{row['live_rows']:,.0f}", f"{row['bytes_sent'] / 2**20:,.1f}"])
    return report.table(["model", "n", "T/device", "capacity", "C", "ep µs/layer", "ep/no-collective",
                         "collectives µs", "share", "all_to_all alone", "single device", "ep / single",
                         "dropped", "rows sent", "live rows", "MiB sent"], lines)


def markdown(record: dict) -> str:
    rows = record["rows"]
    shapes = sorted({(r["label"], r["E"], r["k"], r["H"], r["F"]) for r in rows})
    out = report.header_block(
        "jax_moe expert-parallel stack per layer", record["meta"], record["elapsed_s"], record["method"],
        [f"mesh: {record['facts']['devices']} device(s) on one axis (experts and tokens)",
         "shapes: " + "; ".join(f"{s[0]} E{s[1]} k{s[2]} H{s[3]} F{s[4]}" for s in shapes)])
    out += ["## Per layer, µs", "", table(rows), "", "## Notes", "", *[f"- {n}" for n in record["notes"]], ""]
    out += report.errors_block(rows, lambda r: f"{r['model']} T={r['T']} {r['case']} {r['capacity']}")
    return "\n".join(out)
