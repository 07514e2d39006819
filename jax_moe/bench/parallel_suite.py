"""Suite parallel: the expert-parallel stack (``jax_moe.moe_stack_ep``) per layer, on every device JAX sees.

One mesh axis carries the experts (E / n a device) and the tokens (n * T; T is a device's). Per model, T and
capacity rule: ``ep`` (the sharded stack, state donated and threaded), ``ep/no-collective`` (each all_to_all
an identity of the same shapes) and ``single-device`` (``moe_stack`` of the same global problem on device 0);
collectives = ep - ep/no-collective (one device: the sharding's overhead). Capacity rules: ``no-drop`` (C = T *
min(k, El)), ``cf=2`` (C = ceil(2*T*k/n), overflow dropped and counted; not run where C is no-drop's) and,
where ``lax.ragged_all_to_all`` runs, ``dropless`` (no-drop's buffers, only live rows sent). rows sent = a
device's per layer and direction (n*C slots; dropless: the live rows); bytes = rows x H x 2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_moe
from jax_moe import parallel
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE, ModelShape

AXIS = "expert"
# DeepSeek-V3 at a prefill size and a large batch; its 22.5 GB a layer is held twice (sharded, and
# whole on device 0), so the per-layer difference is taken between 1 and 2 layers.
MODELS = ("deepseek_v3",)
TOKENS = (1024, 8192)
LAYER_COUNTS = (1, 2)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (16,)
CAPACITY_FACTORS = {"no-drop": None, "cf=2": 2.0}  # .get(DROPLESS) is no-drop's
DROPLESS = "dropless"  # no-drop's capacity, the rows sent by ragged_all_to_all
TITLE = "jax_moe expert-parallel stack per layer"
METHOD = common.PER_LAYER_METHOD


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # ep, ep/no-collective, single-device
    capacity: str | None  # a CAPACITY_FACTORS key or DROPLESS; None for single-device


def cases(capacities=tuple(CAPACITY_FACTORS), dropless: bool = False) -> tuple[Case, ...]:
    out = [Case(name, rule) for rule in capacities for name in ("ep", "ep/no-collective")]
    return (*out, *([Case("ep", DROPLESS)] if dropless else []), Case("single-device", None))


def distinct_capacities(config, num_devices: int, tokens: int) -> tuple[str, ...]:
    """The capacity rules that give different per-peer capacities C (the first of each)."""
    by_capacity = {}
    for name, factor in CAPACITY_FACTORS.items():
        by_capacity.setdefault(parallel.peer_capacity(config, num_devices, tokens, factor), name)
    return tuple(by_capacity.values())


def ragged_all_to_all_support(mesh: Mesh) -> str:
    """'supported', or why a one-row ``lax.ragged_all_to_all`` on ``mesh`` did not compile or run."""
    n = mesh.shape[AXIS]

    def per_device(x):
        ones, offsets = jnp.ones((n,), jnp.int32), jnp.arange(n, dtype=jnp.int32)
        out_offsets = jnp.full((n,), lax.axis_index(AXIS), jnp.int32)
        return lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, ones, out_offsets, ones, axis_name=AXIS)

    try:
        x = jax.device_put(jnp.ones((n * n, 4), jnp.float32), NamedSharding(mesh, P(AXIS)))
        jax.block_until_ready(jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(x))
        return "supported"
    except Exception as e:  # the backend's answer is the measurement
        return common.describe_error(e)


def _fresh(x: jax.Array, where) -> jax.Array:  # never an alias of x, which a donating program would delete
    return jax.device_put(jnp.copy(x), where)


def build_program(case: Case, model: ModelShape, tokens: int, mesh: Mesh, params: dict, local_params: dict,
                  x: jax.Array) -> common.ScanProgram:
    """The case's program; ``params`` and ``local_params`` map L to the sharded and whole L-layer stacks."""
    config = model.config(mesh.shape[AXIS] * tokens)
    if case.name == "single-device":
        device = jax.devices()[0]
        return common.ScanProgram(lambda state, p: jax_moe.moe_stack(p, *state),
                                  lambda: (_fresh(x, device), jax_moe.init_scratch(config, device)), local_params)
    factor, sharding = CAPACITY_FACTORS.get(case.capacity), NamedSharding(mesh, P(AXIS))
    exchange = parallel.all_to_all if case.name == "ep" else (lambda blocks, axis_name: blocks)
    return common.ScanProgram(
        lambda state, p: parallel.moe_stack_ep(p, *state, mesh=mesh, axis_name=AXIS, _exchange=exchange)[:2],
        lambda: (_fresh(x, sharding), parallel.init_scratch_ep(config, mesh, AXIS, capacity_factor=factor,
                                                                 ragged=case.capacity == DROPLESS)), params)


def dropped_routes(model: ModelShape, tokens: int, mesh: Mesh, params: dict, x: jax.Array, factor) -> int:
    """Routes a capacity rule drops in one call of the stack (all layers, all devices)."""
    scratch = parallel.init_scratch_ep(model.config(mesh.shape[AXIS] * tokens), mesh, AXIS, capacity_factor=factor)
    step = jax.jit(functools.partial(parallel.moe_stack_ep, mesh=mesh, axis_name=AXIS), donate_argnums=2)
    return int(np.sum(np.asarray(step(params, _fresh(x, NamedSharding(mesh, P(AXIS))), scratch)[2])))


def exchange_volume(model: ModelShape, tokens: int, num_devices: int, rule: str) -> dict:
    """What one device sends per layer and direction under a capacity rule (before drops are counted)."""
    config = model.config(num_devices * tokens)
    capacity = parallel.peer_capacity(config, num_devices, tokens, CAPACITY_FACTORS.get(rule))
    rows_sent = tokens * model.top_k if rule == DROPLESS else num_devices * capacity
    return {"C": capacity, "rows_sent": rows_sent, "live_rows": tokens * model.top_k,
            "bytes_sent": rows_sent * model.hidden_size * jnp.dtype(ROW_DTYPE).itemsize}


def measure_model(model: ModelShape, token_counts, layer_counts, mesh: Mesh, clock, compile_threads: int,
                  time_limit_s=None, notes=None, ragged_supported: bool = False) -> list[dict]:
    n, key = mesh.shape[AXIS], jax.random.key(0)
    local = common.init_stack_params(key, model.config(n * max(token_counts)), max(layer_counts), model.ffn_size)
    sharded = parallel.shard_params(local, mesh, AXIS)

    def first(stack, layers):  # the longest scan takes the stack itself: no second copy of it
        return stack if layers == max(layer_counts) else jax.tree.map(lambda a: a[:layers], stack)
    params = {layers: first(sharded, layers) for layers in layer_counts}
    local_params = {layers: first(local, layers) for layers in layer_counts}
    rows = []
    for tokens in token_counts:
        if clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
            break
        x = jax.random.normal(jax.random.fold_in(key, tokens), (n * tokens, model.hidden_size), ROW_DTYPE)
        programs, found = {}, {}
        for case in cases(distinct_capacities(model.config(n * tokens), n, tokens), ragged_supported):
            name = f"{case.name} {case.capacity or '-'}"
            found[name] = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
                           "H": model.hidden_size, "F": model.ffn_size, "devices": n, "T": tokens,
                           "T_global": n * tokens, "case": case.name, "capacity": case.capacity or "-",
                           **(exchange_volume(model, tokens, n, case.capacity) if case.capacity else {})}
            programs[name] = build_program(case, model, tokens, mesh, params, local_params, x)
        timed = common.time_scans(programs, compile_threads, clock, f"parallel {model.name} T={tokens}")
        for name, fields in timed.items():
            row = {**found[name], **fields}
            if row["case"] == "ep" and row["capacity"] != DROPLESS and "error" not in row:
                layers = max(layer_counts)
                row["dropped_routes"] = dropped_routes(model, tokens, mesh, params[layers], x,
                                                       CAPACITY_FACTORS.get(row["capacity"]))
                row["dropped_pct"] = 100 * row["dropped_routes"] / (layers * n * tokens * model.top_k)
                row["live_rows"] -= row["dropped_routes"] / (layers * n)  # a device's, a layer's
            rows.append(row)
    return derive(rows)


def derive(rows: list[dict]) -> list[dict]:
    """On each ep row: its program without collectives (dropless: no-drop's) and the single-device stack,
    µs; collectives = ep - no-collective, their share, ep / single device."""
    def us(row, case, capacity):
        return next((r.get("us_per_layer") for r in rows if (r["model"], r["T"], r["case"], r["capacity"]) ==
                     (row["model"], row["T"], case, capacity)), None)

    for row in (r for r in rows if r["case"] == "ep" and r.get("us_per_layer") is not None):
        rule = "no-drop" if row["capacity"] == DROPLESS else row["capacity"]
        local, single = us(row, "ep/no-collective", rule), us(row, "single-device", "-")
        row.update(no_collective_us=local, single_device_us=single)
        if local is not None:
            row["collectives_us"] = row["us_per_layer"] - local
            if row["us_per_layer"] > 0:
                row["collective_share_pct"] = 100 * row["collectives_us"] / row["us_per_layer"]
        if single:
            row["ratio_to_single_device"] = row["us_per_layer"] / single
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, layer_counts=LAYER_COUNTS,
        on_rows=None, time_limit_s=None):
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    support = ragged_all_to_all_support(mesh)
    notes = [f"mesh: {mesh.size} device(s); lax.ragged_all_to_all: {support}"]
    clock.log(notes[-1])
    rows = []
    for model in models:
        if model.num_experts % mesh.size:
            notes.append(f"{model.name}: not run (E={model.num_experts} is not a multiple of {mesh.size} devices)")
            continue
        common.measure_isolated(rows, notes, clock, f"parallel {model.name}: failed",
                                lambda: measure_model(model, token_counts, layer_counts, mesh, clock, compile_threads,
                                                      time_limit_s, notes, support == "supported"), on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    ep = lambda field, fmt=common.fmt_us: common.cell("ep", field, fmt)  # noqa: E731  (derive put all on the ep row)
    columns = [("ep µs", ep("us_per_layer")), ("ep/no-collective", ep("no_collective_us")),
               ("collectives µs", ep("collectives_us")), ("share", ep("collective_share_pct", common.fmt_pct)),
               ("single device", ep("single_device_us")),
               ("ep / single", ep("ratio_to_single_device", common.fmt_ratio)),
               ("dropped", ep("dropped_pct", common.fmt_pct)), ("rows sent", ep("rows_sent", "{:,}".format)),
               ("live rows", ep("live_rows", "{:,.0f}".format)),
               ("MiB sent", ep("bytes_sent", lambda v: f"{v / 2**20:,.1f}"))]
    keys = ("label", "devices", "T", "capacity", "C")
    return "µs per layer:\n\n" + common.pivot([r for r in rows if r["case"] == "ep"], keys, columns, name="case")
