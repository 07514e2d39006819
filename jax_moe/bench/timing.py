"""Compiling many programs at once, and timing compiled programs without host dispatch."""

from __future__ import annotations

import concurrent.futures
import re
import statistics
import time
import warnings
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
from jax import lax

WARMUP_CALLS = 2  # the first calls load kernels and record command buffers (CUDA graphs)
TARGET_SECONDS = 0.15  # wall time one measurement aims at; sets the repeat count ...
MIN_REPEATS = 5  # ... within these bounds
MAX_REPEATS = 40

PER_LAYER_METHOD = (
    "per layer = (t(L2) - t(L1)) / (L2 - L1), where t(L) is the median wall time of one call of a "
    "jitted program scanning L layers, timed from dispatch to block_until_ready, the state (x, "
    "scratch) threaded from call to call; host dispatch and per-program costs cancel in the "
    "difference. The two programs are compiled ahead of timing and called alternately, after "
    f"{WARMUP_CALLS} warm-up calls each, {MIN_REPEATS}-{MAX_REPEATS} times (about {TARGET_SECONDS} s per case).")
STEP_METHOD = (
    "per step: a jitted step of the whole stack, compiled ahead of timing, "
    f"{WARMUP_CALLS} warm-up calls, then {MIN_REPEATS}-{MAX_REPEATS} timed steps (about {TARGET_SECONDS} s "
    "per case): latency = median of single steps from dispatch to block_until_ready; back to back = mean "
    "of steps dispatched without waiting, the scratch threaded from step to step.")


class Clock:
    """Seconds since the run started, and progress lines prefixed with them."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def out_of_time(self, time_limit_s: float | None, notes: list | None, what: str) -> bool:
        """True once ``time_limit_s`` has passed; then ``what`` is noted as not run."""
        if time_limit_s is None or self.elapsed() <= time_limit_s:
            return False
        if notes is not None:
            notes.append(f"{what}: not run, the time limit ({time_limit_s:.0f} s) was reached")
        return True


def lower(fn: Callable, args: tuple, donate_argnums: tuple[int, ...] = ()):
    """Lowers ``jax.jit(fn)`` for ``args`` (arrays or ShapeDtypeStructs), keeping its warnings.

    Returns ``(lowered, warning messages)``: XLA's "donated buffers were not usable" is one of them.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*args)
    return lowered, sorted({str(w.message) for w in caught})


def compile_all(lowered: dict[Hashable, Any], threads: int) -> dict[Hashable, tuple[Any, float]]:
    """Compiles every lowered program, ``threads`` at a time (XLA compiles without the GIL).

    Compile time dominates the benchmark, and most programs are small, so compiling them
    concurrently cuts the wall time several fold. Returns key -> (compiled or the exception,
    seconds that compile took).
    """
    def compile_one(item):
        start = time.perf_counter()
        try:
            result = item.compile()
        except Exception as e:  # recorded per case; one failure must not end the run
            result = e
        return result, time.perf_counter() - start

    if threads <= 1 or len(lowered) <= 1:
        return {key: compile_one(item) for key, item in lowered.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {key: pool.submit(compile_one, item) for key, item in lowered.items()}
        return {key: future.result() for key, future in futures.items()}


_BUFFER_COPY = re.compile(r"= \S+\[\d[^\]]*\]\S* copy\(| copy-start\(")  # not scalar copies


def buffer_copies(compiled) -> int | None:
    """Copies of non-scalar buffers in a compiled program's HLO: a copy of the scratch (or of a
    loop-carried buffer) is a cost the benchmark should show, so each row records the count."""
    try:
        return len(_BUFFER_COPY.findall(compiled.as_text()))
    except Exception:  # some backends may not give the text; the count is a diagnostic only
        return None


def card_bytes() -> int | None:
    """The JAX allocator's limit on the default device (None where it reports none: CPU)."""
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


def describe_error(e: Exception) -> str:
    """One line for the JSON and the log: a failing case is recorded and the run goes on."""
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first_line}"[:500]


def measure_isolated(rows: list, notes: list, clock: Clock, failure: str, measure: Callable[[], list],
                     on_rows: Callable[[list, list], Any] | None = None) -> None:
    """``rows.extend(measure())``; if it raises (e.g. out of memory), note ``failure: <error>`` instead,
    so the other models and shapes still run. Then ``on_rows(rows, notes)`` saves what there is."""
    try:
        rows.extend(measure())
    except Exception as e:
        notes.append(f"{failure}: {describe_error(e)}")
        clock.log(notes[-1])
    if on_rows:
        on_rows(rows, notes)


def consume_all(tree) -> jax.Array:
    """A float32 scalar that depends on EVERY leaf of ``tree``, for in-graph timing loops.

    XLA deletes what no output reads: a timing loop that kept one leaf of a gradient (d down) once
    timed a quarter of the backward. All leaves pass through one optimisation barrier, which
    materialises each in full (XLA neither fuses nor slices through it), and one element of each
    leaf after it feeds the scalar, so no leaf's computation is dead.
    """
    leaves = jax.tree.leaves(lax.optimization_barrier(tree))
    return sum((leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves if leaf.size),
               start=jnp.float32(0))


def _call_blocking(program, state, *args) -> tuple[float, Any]:
    start = time.perf_counter()
    state = jax.block_until_ready(program(state, *args))
    return time.perf_counter() - start, state


def _repeats_for(seconds_per_round: float) -> int:
    wanted = int(TARGET_SECONDS / max(seconds_per_round, 1e-9))
    return max(MIN_REPEATS, min(MAX_REPEATS, wanted))


def per_layer_seconds(programs: dict[int, Any], state, routing: dict[int, Any]) -> tuple[dict, Any]:
    """Per-layer time of a scanned program, with host dispatch and per-program costs removed.

    ``programs`` maps a layer count L to a compiled ``program(state, routing[L]) -> state``. Each
    call is timed from dispatch to ``block_until_ready``: t(L) = fixed + L * per_layer, where
    fixed is the host dispatch, argument handling and anything done once per program. Two layer
    counts L1 < L2 give per_layer = (t(L2) - t(L1)) / (L2 - L1). The two programs are called
    alternately (drift hits both alike) and the median of each is used (robust to stray
    slow calls). ``state`` is threaded from call to call, as a donated decode loop threads it.

    Returns ``({"per_layer_s", "spread_s", "program_s": {L: median}, "repeats"}, state)``, where
    spread_s (the two programs' interquartile ranges over L2 - L1) says how far to trust per_layer_s.
    """
    small, large = sorted(programs)
    round_seconds = 0.0
    for _ in range(WARMUP_CALLS):
        round_seconds = 0.0
        for layers in (small, large):
            seconds, state = _call_blocking(programs[layers], state, routing[layers])
            round_seconds += seconds
    repeats = _repeats_for(round_seconds)
    samples = {small: [], large: []}
    for _ in range(repeats):
        for layers in (small, large):
            seconds, state = _call_blocking(programs[layers], state, routing[layers])
            samples[layers].append(seconds)
    medians = {layers: statistics.median(values) for layers, values in samples.items()}
    per_layer = (medians[large] - medians[small]) / (large - small)
    # A rough uncertainty: the interquartile ranges of both programs, spread over the layers.
    spread = sum(_interquartile(values) for values in samples.values()) / (large - small)
    return {"per_layer_s": per_layer, "spread_s": spread, "program_s": medians, "repeats": repeats}, state


def _interquartile(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def step_seconds(program, state, *args) -> tuple[dict, Any]:
    """Time of one jitted step ``program(state, *args) -> state`` two ways.

    latency: the median of single steps, each timed from dispatch to ``block_until_ready`` (what
    one decode step costs a caller that waits for it, host dispatch included).
    back_to_back: the mean over consecutive steps dispatched without waiting, the state threaded
    from each step to the next (what a decode loop sees: host dispatch overlaps device work).
    """
    seconds = 0.0
    for _ in range(WARMUP_CALLS):
        seconds, state = _call_blocking(program, state, *args)
    repeats = _repeats_for(2 * seconds)
    latencies = []
    for _ in range(repeats):
        seconds, state = _call_blocking(program, state, *args)
        latencies.append(seconds)
    start = time.perf_counter()
    for _ in range(repeats):
        state = program(state, *args)
    state = jax.block_until_ready(state)
    back_to_back = (time.perf_counter() - start) / repeats
    return {"latency_s": statistics.median(latencies), "back_to_back_s": back_to_back,
            "repeats": repeats}, state
