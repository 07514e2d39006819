"""What the suites share: the clock, the timing harnesses, the ceilings, the stack's params, processes
of their own (peers, one model at a time), and the records and tables they write."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib
from jax import lax

import jax_moe
from jax_moe import _native
from jax_moe.bench.models import ROW_DTYPE
from jax_moe.config import MoEConfig

WARMUP_CALLS = 2  # the first calls load kernels and record command buffers (CUDA graphs)
TARGET_SECONDS = 0.15  # wall time one measurement aims at; sets the repeat count within:
MIN_REPEATS, MAX_REPEATS = 5, 40
LOOP_COUNTS = (1, 4)  # calls in the two in-graph loops whose difference times one call, the second
LOOP_GROWTH, LOOP_MAX_CALLS = 8, 256  # growing while the difference is within its noise
HAS_BENCH = getattr(_native, "HAS_BENCH", False)  # the optional bench module (CMake JAX_MOE_BENCH=ON)
COPY_KIND = ("jax_moe_bench_copy (cudaMemcpyAsync device to device)" if HAS_BENCH
             else "an XLA elementwise copy (the bench module, JAX_MOE_BENCH=ON, is not built)")
MISSING = "–"
PER_LAYER_METHOD = (
    "per layer = (t(L2) - t(L1)) / (L2 - L1), t(L) the median wall time, dispatch to block_until_ready, of a "
    "jitted program scanning L layers, its state threaded: host dispatch and per-program costs cancel. The two "
    f"alternate after {WARMUP_CALLS} warm-up calls, {MIN_REPEATS}-{MAX_REPEATS} times (about {TARGET_SECONDS} s).")
STEP_METHOD = (
    f"per step: {WARMUP_CALLS} warm-up calls of the compiled step, then {MIN_REPEATS}-{MAX_REPEATS} (about "
    f"{TARGET_SECONDS} s a case): latency = median of single steps, dispatch to block_until_ready; back to back "
    "= mean of steps dispatched without waiting, the state (the scratch) threaded from step to step.")
LOOP_METHOD = (
    "per call = (t(N2) - t(N1)) / (N2 - N1), t(N) the median wall time of a jitted fori_loop of N calls whose "
    "operands pass an optimisation barrier each iteration (nothing hoisted) and whose every output feeds the "
    f"result (nothing dead); N1, N2 = {LOOP_COUNTS}, N2 growing up to {LOOP_MAX_CALLS} while within its noise.")


@dataclasses.dataclass
class Clock:
    """Seconds since the run started, and progress lines prefixed with them."""

    start: float = dataclasses.field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def out_of_time(self, time_limit_s: float | None, notes: list, what: str) -> bool:  # and notes what did not run
        if time_limit_s is None or self.elapsed() <= time_limit_s:
            return False
        notes.append(f"{what}: not run, the time limit ({time_limit_s:.0f} s) was reached")
        return True


def outcome(row: dict, field: str = "us_per_layer") -> str:  # a row's time for the log, or its error
    return f"{row[field]:.2f} µs" if field in row else row.get("error", "not run")


def describe_error(e: Exception) -> str:
    """One line for the record and the log: a failing case is recorded, and the run goes on."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def measure_isolated(rows: list, notes: list, clock: Clock, failure: str, measure: Callable[[], list],
                     on_rows: Callable[[list, list], Any] | None = None) -> None:
    """``rows.extend(measure())``, or the note ``failure: <error>`` (out of memory...) so that the other
    shapes still run, keeping the rows a stopped child process had measured; then ``on_rows(rows, notes)``
    saves what there is."""
    try:
        rows.extend(measure())
    except Exception as e:
        kept = getattr(e, "partial", None) or []
        rows.extend(kept)
        notes.append(f"{failure}: {describe_error(e)}" + (f" (rows it had measured, kept: {len(kept)})"
                                                          if kept else ""))
        clock.log(notes[-1])
    if on_rows:
        on_rows(rows, notes)


# --- timing ---------------------------------------------------------------------------------------

def buffer_copies(compiled) -> int:
    """Copies of non-scalar buffers in a compiled program: a copied scratch is a cost a row should show."""
    return len(re.findall(r"= \S+\[\d[^\]]*\]\S* copy\(| copy-start\(", compiled.as_text()))


def card_bytes() -> int | None:
    """The JAX allocator's limit on the default device (None where it reports none: CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def _timed_call(program, state, *args) -> tuple[float, Any]:
    start = time.perf_counter()
    state = jax.block_until_ready(program(state, *args))
    return time.perf_counter() - start, state


def _repeats(seconds_per_round: float) -> int:
    return max(MIN_REPEATS, min(MAX_REPEATS, int(TARGET_SECONDS / max(seconds_per_round, 1e-9))))


def per_layer_seconds(programs: dict[int, Any], state, xs: dict[int, Any]) -> tuple[dict, Any]:
    """PER_LAYER_METHOD for ``programs`` (L -> ``program(state, xs[L]) -> state``), called alternately so
    that drift hits both alike. Returns ``({"per_layer_s", "spread_s", "program_s": {L: median},
    "repeats"}, state)``; spread_s, both interquartile ranges over L2 - L1, says how far to trust it."""
    small, large = sorted(programs)
    for _ in range(WARMUP_CALLS):
        round_seconds = 0.0
        for layers in (small, large):
            seconds, state = _timed_call(programs[layers], state, xs[layers])
            round_seconds += seconds
    samples, repeats = {small: [], large: []}, _repeats(round_seconds)
    for _ in range(repeats):
        for layers in (small, large):
            seconds, state = _timed_call(programs[layers], state, xs[layers])
            samples[layers].append(seconds)
    medians = {layers: statistics.median(values) for layers, values in samples.items()}
    quartiles = [statistics.quantiles(values, n=4) for values in samples.values()]
    return {"per_layer_s": (medians[large] - medians[small]) / (large - small),
            "spread_s": sum(q[2] - q[0] for q in quartiles) / (large - small), "program_s": medians,
            "repeats": repeats}, state


def time_step(program, state, *args, layers: int = 1) -> dict:
    """STEP_METHOD for a compiled ``program(state, *args) -> state``: µs a step (latency, back to back)
    and a layer (back to back / ``layers``)."""
    for _ in range(WARMUP_CALLS):
        seconds, state = _timed_call(program, state, *args)
    repeats, latencies = _repeats(2 * seconds), []
    for _ in range(repeats):
        seconds, state = _timed_call(program, state, *args)
        latencies.append(seconds)
    start = time.perf_counter()
    for _ in range(repeats):
        state = program(state, *args)
    jax.block_until_ready(state)
    back_to_back = (time.perf_counter() - start) / repeats * 1e6
    return {"step_us_latency": statistics.median(latencies) * 1e6, "step_us_back_to_back": back_to_back,
            "us_per_layer": back_to_back / layers, "repeats": repeats}


@dataclasses.dataclass
class ScanProgram:
    fn: Callable  # fn(state, xs[L]) -> state, a scan over L layers
    make_state: Callable[[], Any]  # fresh buffers each call: a donated state is consumed
    xs: dict  # layer count L -> the scan's inputs
    donate: bool = True


def time_scans(programs: dict[str, ScanProgram], threads: int, clock: Clock, where: str) -> dict[str, dict]:
    """Each program lowered and compiled for every L, ``threads`` at a time (XLA compiles without the GIL;
    compiling dominates the permute suite), then timed one by one. Returns name -> its row's fields."""
    def compile_program(program):
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), program.make_state())
        jitted = jax.jit(program.fn, donate_argnums=(0,) if program.donate else ())
        return {layers: jitted.lower(spec, xs).compile() for layers, xs in program.xs.items()}

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = {name: pool.submit(compile_program, program) for name, program in programs.items()}
    clock.log(f"{where}: compiled {len(programs)} programs")
    rows = {}
    for name, program in programs.items():
        try:
            executables = futures[name].result()
            measured, _ = per_layer_seconds(executables, program.make_state(), program.xs)
            rows[name] = {"us_per_layer": measured["per_layer_s"] * 1e6, "spread_us": measured["spread_s"] * 1e6,
                          "program_us": {str(k): s * 1e6 for k, s in measured["program_s"].items()},
                          "repeats": measured["repeats"],
                          "hlo_buffer_copies": {str(k): buffer_copies(e) for k, e in executables.items()}}
        except Exception as e:  # recorded; the other cases still run
            rows[name] = {"error": describe_error(e)}
        clock.log(f"{where} {name}: {outcome(rows[name])}")
    return rows


def consume_all(tree) -> jax.Array:
    """A float32 scalar that depends on every leaf of ``tree``: all pass one optimisation barrier (each
    materialised in full) and one element of each feeds the scalar. XLA deletes what no output reads:
    a loop that kept one leaf of a gradient once timed a quarter of the backward."""
    leaves = jax.tree.leaves(lax.optimization_barrier(tree))
    return sum((leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves if leaf.size), start=jnp.float32(0))


def loop_program(fn, calls: int, consume=consume_all):
    """``program(operands) -> float32``: ``fn(*operands) -> (out, operands)`` called ``calls`` times in a
    ``fori_loop``, the operands threaded behind a barrier and every call's outputs consumed."""
    def program(operands):
        def body(_, carry):
            operands, total = carry
            out, operands = fn(*lax.optimization_barrier(operands))
            return operands, total + consume(out)
        return lax.fori_loop(0, calls, body, (operands, jnp.float32(0)))[1]
    return program


def loop_seconds(fn, operands, measure=per_layer_seconds) -> dict:
    """LOOP_METHOD for ``fn(*operands) -> (out, operands)``. A call of a few µs can sit below the noise of
    N2 - N1 = 3 calls (a loaded CPU once gave a negative time): while the time is not above its spread N2
    grows LOOP_GROWTH-fold, up to LOOP_MAX_CALLS, where a time <= 0 raises."""
    small, large = LOOP_COUNTS
    compiled = {}
    while True:
        for calls in (small, large):
            if calls not in compiled:
                compiled[calls] = jax.jit(loop_program(fn, calls)).lower(operands).compile()
        programs = {n: (lambda _state, _xs, c=compiled[n]: c(operands)) for n in (small, large)}
        result, _ = measure(programs, None, dict.fromkeys(programs))
        if result["per_layer_s"] > max(0.0, result["spread_s"]) or large >= LOOP_MAX_CALLS:
            break
        large = min(LOOP_MAX_CALLS, large * LOOP_GROWTH)
    if result["per_layer_s"] <= 0:
        raise RuntimeError(f"time per call not resolved above the timing noise at N2 = {large}: "
                           f"{result['per_layer_s'] * 1e6:.2f} µs, spread {result['spread_s'] * 1e6:.2f} µs")
    return {"s": result["per_layer_s"], "spread_s": result["spread_s"], "repeats": result["repeats"], "n2": large}


# --- ceilings -------------------------------------------------------------------------------------

def runtime_zero(tree) -> jax.Array:
    """An int32 scalar read from every leaf of ``tree``: 0 at run time (no NaN, no INT_MIN in these
    buffers) but not provably 0, so whatever it feeds depends on all of ``tree``."""
    flags = [first != first if jnp.issubdtype(first.dtype, jnp.floating) else first == jnp.iinfo(jnp.int32).min
             for first in (leaf.reshape(-1)[0] for leaf in jax.tree.leaves(tree))]
    return sum(flag.astype(jnp.int32) for flag in flags)


def device_copy(buffer: jax.Array, salt: jax.Array | None = None) -> jax.Array:
    """A copy XLA can neither hoist out of a loop nor drop: COPY_KIND. The XLA copy adds ``salt``
    (``runtime_zero`` of the buffer, or of a loop's per-layer input) to every element."""
    if HAS_BENCH:
        return jax.ffi.ffi_call(_native.BENCH_COPY_TARGET, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                                has_side_effect=True)(buffer)
    return buffer + (runtime_zero(buffer) if salt is None else salt).astype(buffer.dtype)


def ceilings(clock: Clock, notes: list, trials: int = 3) -> tuple[float | None, float | None]:
    """The card's copy rate (GB/s, read + write bytes) and dense bf16 jnp.dot rate (TFLOP/s), each the best
    of ``trials`` (a ceiling: one slow trial must not lower every roofline of the run), and a note each."""
    copy_bytes, n = (1 << 30, 8192) if jax.default_backend() == "gpu" else (1 << 24, 256)  # CPU: the harness only
    # An XLA copy or product is carried to the next call: XLA:CPU drops barriers and would compute only the
    # element a loop reads. (A carried custom-call copy would be copied again into the carry.)
    copy = (lambda b: (device_copy(b), (b,))) if HAS_BENCH else (lambda b: (c := device_copy(b), (c,)))  # noqa: E731
    dot = lambda a, b: (c := jnp.dot(a, b, preferred_element_type=jnp.float32).astype(ROW_DTYPE), (a, c))  # noqa: E731
    a = (jax.random.normal(jax.random.key(0), (n, n)) / n ** 0.5).astype(ROW_DTYPE)  # products stay near 1
    buffer, rates = jnp.ones((copy_bytes // 2,), ROW_DTYPE), []
    # A copy of copy_bytes reads and writes them: 2 * copy_bytes moved.
    for what, fn, operands, work, unit in (("copy", copy, (buffer,), 2 * copy_bytes / 1e9, f"GB/s, {COPY_KIND}"),
                                           ("dense", dot, (a, a), 2 * n ** 3 / 1e12, f"TFLOP/s, jnp.dot of {n}^3")):
        try:
            rates.append(work / min(loop_seconds(fn, operands)["s"] for _ in range(trials)))
            notes.append(f"{what} ceiling: {fmt_us(rates[-1])} {unit}")
        except Exception as e:
            rates.append(None)
            notes.append(f"{what} ceiling: not measured: {describe_error(e)}")
    clock.log("; ".join(notes[-2:]))
    return rates[0], rates[1]


def roofline(bytes_moved: float, flops: float, copy_gbs: float | None, dense_tflops: float | None) -> dict:
    """The longer of the byte bound (bytes / copy rate) and the FLOP bound (flops / dense rate), µs, and
    which one it is; nothing where a rate was not measured."""
    if not copy_gbs or not dense_tflops:
        return {}
    byte_us, flop_us = bytes_moved / (copy_gbs * 1e3), flops / (dense_tflops * 1e6)
    return {"roofline_us": max(byte_us, flop_us), "byte_roofline_us": byte_us, "flop_roofline_us": flop_us,
            "bound": "bytes" if byte_us >= flop_us else "FLOPs"}


def training_weight_bytes(read_experts: float, num_experts: int, expert_bytes: float) -> float:
    """Weight bytes a training step's experts move: the routed experts' weights read by the forward and again
    by the backward, and every expert's gradient written (a dense gradient: zero where an expert has no rows)."""
    return (2 * read_experts + num_experts) * expert_bytes


# --- params and processes -------------------------------------------------------------------------

def init_stack_params(key, config: MoEConfig, layers: int, ffn_size: int, *, fp8: bool = False, **options) -> dict:
    """``init_moe_params`` drawn one expert at a time (``lax.map``), stacked to [L, El, ...]. With ``fp8``
    each expert is quantised as it is drawn: the same draws, never a bf16 copy of the stack (DeepSeek-V3's
    would not fit beside its FP8 one). The router and the options' leaves come from the full config."""
    from jax_moe import fp8 as moe_fp8

    local = config.num_local_experts
    one_expert = MoEConfig(num_experts=1, top_k=1, hidden_size=config.hidden_size, max_tokens=1, dtype=config.dtype)
    maybe_quantized = moe_fp8.quantize_params if fp8 else (lambda p: p)

    def expert(expert_key):
        drawn = jax_moe.init_moe_params(expert_key, one_expert, 1, ffn_size)
        return maybe_quantized({name: leaf[0, 0] for name, leaf in drawn.items() if name != "router"})

    def build(k):
        router_key, experts_key = jax.random.split(k)
        small = jax_moe.init_moe_params(router_key, config, layers, 1, **options)
        small = maybe_quantized({name: leaf for name, leaf in small.items() if name not in ("gate_up", "down")})
        experts = lax.map(expert, jax.random.split(experts_key, layers * local))
        return {**small, **{name: leaf.reshape(layers, local, *leaf.shape[1:]) for name, leaf in experts.items()}}

    return jax.jit(build)(key)


def run_child(args: list[str], timeout_s: float | None, env: dict | None = None):
    """``python ARGS OUT`` in a process of its own, which writes one JSON value to the file OUT (rewritten
    whole as it goes, by ``save_json``); its log goes to this process's output. Raises RuntimeError, its
    ``partial`` what OUT last held, when it times out or exits without success."""
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder, "out.json")
        try:
            done = subprocess.run([sys.executable, *args, str(out)], timeout=timeout_s, env=env)
            failure = None if done.returncode == 0 and out.is_file() else (
                f"its process exited with status {done.returncode} (its log is above)")
        except subprocess.TimeoutExpired:
            failure = f"its process ran past {timeout_s:.0f} s"
        value = json.loads(out.read_text()) if out.is_file() else None
        if failure:
            error = RuntimeError(failure)
            error.partial = value
            raise error
        return value


def save_json(path, value) -> None:
    """``value`` to ``path`` whole or not at all: a process stopped mid-write leaves the previous one."""
    pathlib.Path(f"{path}.part").write_text(json.dumps(value, default=float))
    os.replace(f"{path}.part", path)


def in_child(function: str, timeout_s: float | None, **kwargs):
    """``module:function(**kwargs, on_rows=save)`` (JSON in and out) in a process of its own, whose device
    memory goes back to the card when it exits (Qwen3.5-397B ran out of memory as the fourth model of one
    process); ``save`` writes the rows so far, which survive a timeout."""
    code = ("import importlib, json, sys; from jax_moe.bench.common import save_json; (module, name), out = "
            "sys.argv[1].split(':'), sys.argv[3]; save_json(out, getattr(importlib.import_module(module), name)("
            "**json.loads(sys.argv[2]), on_rows=lambda rows: save_json(out, rows)))")
    return run_child(["-c", code, function, json.dumps(kwargs)], timeout_s)


def run_torch_peer(clock: Clock, model, layers: int, tokens, steps: int, warmup: int, timeout_s: float,
                   decode: bool = False) -> list[dict]:
    """``torch_peer.py``'s row for each T (its time, or its error); JAX is kept off the card there."""
    spec = {"experts": model.num_experts, "top_k": model.top_k, "hidden": model.hidden_size, "ffn": model.ffn_size,
            "layers": layers, "tokens": list(tokens), "steps": steps, "warmup": warmup, "decode": decode}
    try:
        rows = run_child([str(pathlib.Path(__file__).with_name("torch_peer.py")), json.dumps(spec)], timeout_s,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except RuntimeError as e:
        rows = [{"T": t, "error": f"peer: {e}"} for t in tokens]
    clock.log(f"peer {model.name}: " + ", ".join(f"T={r['T']} {outcome(r)}" for r in rows))
    return rows


# --- records and tables ---------------------------------------------------------------------------

def environment() -> dict:
    device = jax.devices()[0]
    return {"device_kind": device.device_kind, "platform": device.platform, "device_count": jax.device_count(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jax_moe": jax_moe.__version__,
            "native_cpu": _native.HAS_CPU, "native_cuda": _native.HAS_CUDA, "native_bench": HAS_BENCH,
            "python": platform.python_version(), "command": "python -m jax_moe.bench " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")}


def fmt_us(value) -> str:
    if value is None:
        return MISSING
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:,.0f}"


# Cells of the tables: MISSING where there is no value.
fmt_ratio = lambda value: MISSING if value is None else f"{value:.2f}x"  # noqa: E731
fmt_pct = lambda value: MISSING if value is None else f"{value:.0f}%"  # noqa: E731
fmt_text = lambda value: MISSING if value is None else str(value)  # noqa: E731


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def cell(impl: str, field: str, fmt=fmt_us, pct: str | None = None):
    """A ``pivot`` column: ``fmt`` of ``field`` in the row of ``impl`` (and its ``pct`` field as a
    percentage); "error" where it failed."""
    def value(by: dict) -> str:
        row = by.get(impl)
        if row is None or "error" in row:
            return MISSING if row is None else "error"
        return fmt(row.get(field)) + (f" ({fmt_pct(row.get(pct))})" if pct else "")
    return value


def speedup(impl: str, ours: str, field: str):
    """A ``pivot`` column: ``impl``'s ``field`` over ``ours``'s (> 1: ours is faster)."""
    def value(by: dict) -> str:
        theirs, mine = by.get(impl, {}).get(field), by.get(ours, {}).get(field)
        return fmt_ratio(theirs / mine) if theirs and mine else MISSING
    return value


def pivot(rows: list[dict], keys: tuple[str, ...], columns, name: str = "impl") -> str:
    """A markdown table of ``rows``: one line per distinct value of ``keys`` (in order of appearance),
    one column per ``(header, cell(rows of the line by their name field))``."""
    lines = []
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        by = {r[name]: r for r in rows if tuple(r[k] for k in keys) == key}
        lines.append([str(v) for v in key] + [value(by) for _, value in columns])
    return table([*keys, *(header for header, _ in columns)], lines)


def document(title: str, record: dict, body: str) -> str:
    """A suite's markdown: what ran where and how, ``body`` (its tables), the notes and the errors."""
    env = record["meta"]
    keys = ("model", "T", "impl", "case", "variant", "scan", "capacity")
    errors = [f"- {' '.join(str(r[k]) for k in keys if k in r)}: {r['error']}" for r in record["rows"] if "error" in r]
    return "\n".join([
        f"# {title}", "",
        f"- device: **{env['device_kind']}** ({env['platform']}), jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"jax_moe {env['jax_moe']} (native CPU {env['native_cpu']}, CUDA {env['native_cuda']}, "
        f"bench {env['native_bench']}), python {env['python']}",
        f"- date: {env['date']}, run time {record['elapsed_s']:.0f} s",
        f"- command: `{env['command']}`" + (f" with XLA_FLAGS=`{env['xla_flags']}`" if env["xla_flags"] else ""),
        f"- what: {record['about']}", f"- method: {record['method']}", "", body, "",
        "## Notes", "", *[f"- {n}" for n in record["notes"]], "",
        *(["## Errors", "", *errors, ""] if errors else [])])
