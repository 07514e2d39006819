"""Suite `decode`: the whole scanned MoE stack against its roofline, at decode sizes and at prefill.

Per model and T (by default 1 to 64 tokens; ``--tokens 4096`` for prefill): one jitted step of
``moe_stack`` over L layers (rolled scan, scratch donated and threaded step to step, routing by each
layer's own router; L from LAYERS, fewer where the card cannot hold them: ``stack_layers``, said in
the notes), µs per layer, for
- ``jax_moe``: the kernels ``gemm.pick_tile`` chooses (the decode kernel at few rows per expert);
- ``jax_moe/cutlass``: the same step with the decode kernel switched off (CUTLASS grouped GEMMs:
  the path before it), so the crossover is measured in the same run;
- ``jax_moe/no-prefetch``: the same step without the decode permute's L2 prefetch of the routed
  experts' gate/up weights (``ops.permute``'s ``prefetch`` hint, ``ops.DECODE_PREFETCH_BYTES``);
- ``jax_moe/shared-apart`` (models with a shared expert, where it rides the routed experts'
  decode launches): the same step with the shared expert in launches of its own;
- ``jax_moe/fp8``: the same step on FP8 experts (``jax_moe.fp8``: e4m3 weights, a float32 scale
  per 128 x 128 block; the same draws, quantised; the rows quantised per 1 x 128 group; the kernels
  ``gemm.fp8_decode_rows`` picks: the FP8 decode kernel at few rows per expert), where H and F are
  multiples of 128, against its own roofline (the experts' FP8 bytes and scales);
- ``jax_moe/fp8-cutlass``: that step with the FP8 decode kernel switched off (both projections on
  CUTLASS's FP8 grouped GEMM), the FP8 crossover measured in the same run;
- ``jax_moe/fp8-shared-apart`` (where an FP8 shared expert rides the FP8 decode launches,
  ``experts.fp8_shared_rides_decode``): the FP8 step with the shared expert in a call of its own;
- the PyTorch + Hugging Face peer: L transformers ``Qwen3MoeSparseMoeBlock``s (torch grouped_mm)
  in the same residual stack, the forward captured in one CUDA graph, its own process.

Roofline per layer = whichever bound is longer (the row's ``bound``):
- bytes: what the layer must read / the copy rate measured in the same run, the bytes being those
  of the experts that own rows (counted on the device from the step's own routing, averaged over
  layers) plus the shared expert and the router;
- FLOPs: the forward's (router, T*k routed rows and T shared rows through three projections) / the
  dense tensor-core rate (bf16: DENSE_TFLOPS; FP8: FP8_DENSE_TFLOPS).
At T <= 64 bytes bound every model; prefill sizes (``--tokens 4096``) are bound by FLOPs or, at
few rows per expert (DeepSeek-V3, Qwen3.5-397B), still by bytes. Where the decode kernels are not
picked (prefill), the variants that switch them off are the same program and are not run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe import experts, fp8, gemm, ops
from jax_moe.bench import timing, torch_peer
from jax_moe.bench.models import MODELS as MODEL_SHAPES
from jax_moe.bench.models import MIN_LAYERS, ROW_DTYPE, ModelShape, stack_counts
from jax_moe.bench.stack_suite import init_stack_params

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (1, 16)
# Layers per stack: enough that one layer's experts are not in L2 from the step before, and what
# fits the card (DeepSeek-V3: 22.5 GB of experts per layer).
LAYERS = {"mixtral": 8, "qwen3_30b": 16, "deepseek_v3": 4, "qwen35_397b": 8, "tiny": 2}
PEER_STEPS, PEER_WARMUP, PEER_TIMEOUT_S = 50, 5, 300
DENSE_TFLOPS = 790.0  # bf16 dense rate of the H200 (DESIGN.md §7b), for the FLOP roofline only
# FP8 (e4m3) dense rate for the FP8 rows' FLOP roofline: the H200's FP8 tensor cores peak at twice
# their bf16 rate (1979 vs 989 TFLOP/s dense in NVIDIA's specification), so twice the measured bf16 rate.
FP8_DENSE_TFLOPS = 2 * DENSE_TFLOPS
# Rows of each T on the decode kernel: as shipped, on the CUTLASS path, and without the permute's
# L2 prefetch of the gate/up weights (ops.DECODE_PREFETCH_BYTES = 0).
NO_PREFETCH = "jax_moe/no-prefetch"
VARIANTS = ("jax_moe", "jax_moe/cutlass", NO_PREFETCH)
SHARED_APART = "jax_moe/shared-apart"
FP8_VARIANT = "jax_moe/fp8"
FP8_VARIANTS = (FP8_VARIANT, "jax_moe/fp8-cutlass")
FP8_SHARED_APART = "jax_moe/fp8-shared-apart"
METHOD = ("Per layer = back-to-back step time / L (" + timing.STEP_METHOD + "). Roofline = the longer of "
          "bytes (the experts owning rows, counted from the step's routing and averaged over layers, + shared "
          "expert + router) / copy rate of the same run and FLOPs (router, T*k routed and T shared rows, three "
          f"projections) / dense rate ({DENSE_TFLOPS:.0f} TFLOP/s bf16, {FP8_DENSE_TFLOPS:.0f} FP8). Peer: "
          "transformers Qwen3MoeSparseMoeBlock stack with torch grouped_mm, forward in one CUDA graph, "
          f"{PEER_STEPS} replays after {PEER_WARMUP}, its own process; it has no shared expert and routes by "
          "softmax top-k for every model.")


@contextlib.contextmanager
def _setting(module, name: str, value):
    """Traces inside see ``module.<name>`` = value; the shipped value again afterwards."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def decode_kernel(enabled: bool):
    """Traces inside see ``gemm.pick_tile`` with the decode kernel on (as shipped) or off."""
    return _setting(gemm, "DECODE_MAX_ROWS_PER_EXPERT", gemm.DECODE_MAX_ROWS_PER_EXPERT if enabled else -1.0)


def shared_in_decode_launch(enabled: bool):
    """Traces inside run a shared expert at decode in the routed experts' launches (as shipped) or apart."""
    return _setting(experts, "SHARED_IN_DECODE_LAUNCH", enabled)


def decode_prefetch(enabled: bool):
    """Traces inside have the decode permute's L2 prefetch on (as shipped) or off."""
    return _setting(ops, "DECODE_PREFETCH_BYTES", ops.DECODE_PREFETCH_BYTES if enabled else 0)


def fp8_decode_kernel(enabled: bool):
    """Traces inside see ``gemm.fp8_decode_rows`` with the FP8 decode kernel on (as shipped) or off."""
    return _setting(gemm, "FP8_DECODE_MAX_ROWS_PER_EXPERT", gemm.FP8_DECODE_MAX_ROWS_PER_EXPERT if enabled else -1.0)


def run_peer(model: ModelShape, token_counts, layers: int) -> dict[int, dict]:
    """The PyTorch peer's decode results per T (subprocess), or {T: {"error": ...}}."""
    result = torch_peer.run_in_process(model, layers, token_counts, PEER_STEPS, PEER_WARMUP, PEER_TIMEOUT_S,
                                       decode=True)
    if "results" in result:
        return {r["T"]: r for r in result["results"]}
    return {t: {"error": result.get("error", "no result")[:400]} for t in token_counts}


def layer_bytes(model: ModelShape, params: dict, active_experts: float) -> float:
    """Bytes one layer must read: the experts owning rows (FP8 ones with their scales), the shared
    expert and the router."""
    per_expert = sum(leaf[0, 0].nbytes for name, leaf in params.items() if name in EXPERT_LEAVES)
    small = sum(leaf[0].nbytes for name, leaf in params.items() if name not in EXPERT_LEAVES)
    return active_experts * per_expert + small


EXPERT_LEAVES = ("gate_up", "down", *(name + fp8.SCALE_SUFFIX for name in fp8.QUANTIZED_NAMES))


def layer_flops(model: ModelShape, tokens: int) -> float:
    """FLOPs of one layer's forward: the router product, the T*k routed rows and the T shared rows
    through their three projections (H -> 2F -> F -> H)."""
    routed = 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size
    shared = 2 * tokens * model.hidden_size * 3 * (model.shared_ffn or 0)
    return routed + shared + 2 * tokens * model.hidden_size * model.num_experts


def roofline_fields(bytes_read: float, flops: float, copy_gbs: float | None, dense_tflops: float) -> dict:
    """A row's roofline: the longer of the byte bound (bytes / copy rate, only where the copy rate was
    measured) and the FLOP bound (flops / dense rate), µs, and which one it is."""
    byte_us = bytes_read / (copy_gbs * 1e3) if copy_gbs else None
    flop_us = flops / (dense_tflops * 1e6)
    if byte_us is None:
        return {"roofline_us": None, "flop_roofline_us": flop_us, "bound": None}
    return {"roofline_us": max(byte_us, flop_us), "byte_roofline_us": byte_us, "flop_roofline_us": flop_us,
            "bound": "bytes" if byte_us >= flop_us else "FLOPs"}


def _active_experts(params, x, config) -> float:
    """Experts owning rows per layer, averaged over the stack's layers, from its own routing."""
    run = jax.jit(lambda p, x, s: jax_moe.moe_stack(p, x, s, with_aux=True)[2]["expert_counts"])
    counts = np.asarray(run(params, x, jax_moe.init_scratch(config)))
    return float((counts > 0).sum(axis=-1).mean())


def stack_layers(model: ModelShape, limit_bytes: float | None) -> int:
    """L of the model's stack: LAYERS' count, fewer where the card cannot hold it (``layers_that_fit``)."""
    return model.layers_that_fit(LAYERS.get(model.name, model.stack_layers or MIN_LAYERS), limit_bytes)


def _time_step(params, x, config, layers: int, row: dict) -> None:
    """One jitted stack step, scratch donated and threaded: µs per layer into ``row``."""
    try:
        step = jax.jit(lambda carry, p, x: jax_moe.moe_stack(p, x, carry[1]), donate_argnums=0)
        carry_spec = (x, jax.eval_shape(lambda: jax_moe.init_scratch(config)))
        compiled = step.lower(carry_spec, params, x).compile()
        measured, carry = timing.step_seconds(compiled, (jnp.zeros_like(x), jax_moe.init_scratch(config)), params, x)
        del carry
        row["us_per_layer"] = measured["back_to_back_s"] * 1e6 / layers
        row["step_us_latency"] = measured["latency_s"] * 1e6
    except Exception as e:
        row["error"] = timing.describe_error(e)


def _log(clock, rows, model: ModelShape, tokens: int) -> None:
    mine = [r for r in rows if r["T"] == tokens and r["model"] == model.name]
    clock.log(f"decode {model.name} T={tokens} (roofline {mine[0]['roofline_us'] or 0:.0f} us): " + ", ".join(
        f"{r['impl']} {r['us_per_layer']:.0f} us" if "us_per_layer" in r else f"{r['impl']} {r.get('error')}"
        for r in mine))


def measure_model(model: ModelShape, token_counts, clock, copy_gbs, peer: dict | None,
                  scratch_tokens: int | None = None, layers: int | None = None) -> list[dict]:
    """jax_moe's rows (all variants) and, with ``peer`` (run_peer's results), the peer's.

    scratch_tokens: each step's scratch holds max(T, scratch_tokens) tokens (a server decoding on
    the scratch it prefilled with); None: T, the smallest. layers: L of the stack (None:
    ``stack_layers`` for this device)."""
    layers = layers or stack_layers(model, timing.card_bytes())
    key = jax.random.PRNGKey(0)
    stack_args = (key, model.config(max(token_counts)), layers, model.ffn_size)
    params = init_stack_params(*stack_args, **model.param_options())

    # Each T's config and tokens, the same for the bf16 and the FP8 stack.
    inputs = {tokens: (model.config(max(tokens, scratch_tokens or 0)),
                       jax.random.normal(jax.random.fold_in(key, tokens), (tokens, model.hidden_size), ROW_DTYPE))
              for tokens in token_counts}
    rows, bases = [], {}
    for tokens, (config, x) in inputs.items():
        active = _active_experts(params, x, config)
        bytes_read = layer_bytes(model, params, active)
        tile = gemm.pick_tile(config.live_row_bound(tokens), config.num_local_experts,
                              config.group_row_bound(tokens))
        flops = layer_flops(model, tokens)
        base = bases[tokens] = {
            "model": model.name, "label": model.label, "T": tokens, "scratch_tokens": config.max_tokens,
            "layers": layers, "active_experts": active, "bytes_per_layer": bytes_read, "flops_per_layer": flops,
            **roofline_fields(bytes_read, flops, copy_gbs, DENSE_TFLOPS),
            "tile": gemm.TILE_NAMES[tile]}
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)  # (no copy of a layer)
        fused = experts.shared_rides_decode(layer, x, tile)
        # Without the decode kernel picked, switching it off gives the same program: not run again.
        variants = VARIANTS if tile == gemm.DECODE_TILE else VARIANTS[:1]
        for variant in variants + ((SHARED_APART,) if fused else ()):
            rows.append(row := {**base, "impl": variant})
            with (decode_kernel(variant != "jax_moe/cutlass"), shared_in_decode_launch(variant != SHARED_APART),
                  decode_prefetch(variant != NO_PREFETCH)):
                _time_step(params, x, config, layers, row)
        if peer is not None:
            rows.append({**base, "impl": "peer", **{k: v for k, v in peer.get(tokens, {}).items()
                                                   if k in ("us_per_layer", "error")}})
        _log(clock, rows, model, tokens)
    del params
    if model.hidden_size % fp8.BLOCK == 0 and model.ffn_size % fp8.BLOCK == 0:
        # The same draws quantised (so the same routing), built after the bf16 stack is freed.
        params = init_stack_params(*stack_args, fp8=True, **model.param_options())
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
        for tokens, (config, x) in inputs.items():
            bytes_read = layer_bytes(model, params, bases[tokens]["active_experts"])
            rides = experts.fp8_shared_rides_decode(layer, x, config.live_row_bound(tokens), config.num_local_experts)
            on_decode_kernel = gemm.fp8_decode_rows(config.live_row_bound(tokens), config.num_local_experts,
                                                    model.hidden_size, model.ffn_size) > 0
            variants = (FP8_VARIANTS if on_decode_kernel else FP8_VARIANTS[:1]) + ((FP8_SHARED_APART,) if rides else ())
            for variant in variants:
                rows.append(row := {**bases[tokens], "impl": variant, "bytes_per_layer": bytes_read,
                                    **roofline_fields(bytes_read, bases[tokens]["flops_per_layer"], copy_gbs,
                                                      FP8_DENSE_TFLOPS)})
                with fp8_decode_kernel(variant != FP8_VARIANTS[1]), shared_in_decode_launch(variant != FP8_SHARED_APART):
                    _time_step(params, x, config, layers, row)
            _log(clock, rows, model, tokens)
        del params
    for row in rows:
        if row.get("us_per_layer") and row.get("roofline_us"):
            row["pct_roofline"] = 100 * row["roofline_us"] / row["us_per_layer"]
    return rows


def measure_model_in_child(model: ModelShape, token_counts, copy_gbs, peer: dict | None,
                           timeout_s: float | None = None, scratch_tokens: int | None = None,
                           layers: int | None = None) -> list[dict]:
    """``measure_model`` in a process of its own (``_child_main(SPEC, OUT)``).

    Its device memory goes back to the card when it exits. In one process, Qwen3.5-397B (103 GB of
    bf16 experts in its 8-layer stack) ran out of memory as the suite's fourth model, where alone it
    runs: the allocator had kept what the models before it took. The child inherits the environment
    (the CLI's ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: this process must not hold the card), and its
    log lines go to this process's stdout and stderr. Raises RuntimeError when it gives no rows.
    """
    if model.name not in MODEL_SHAPES or MODEL_SHAPES[model.name] != model:
        raise ValueError(f"measure_model_in_child: model: expected one of jax_moe.bench.models.MODELS, "
                         f"got {model.name!r}")
    with tempfile.TemporaryDirectory() as folder:
        spec, out = pathlib.Path(folder, "spec.json"), pathlib.Path(folder, "rows.json")
        spec.write_text(json.dumps({"model": model.name, "tokens": list(token_counts), "copy_gbs": copy_gbs,
                                    "peer": peer, "scratch_tokens": scratch_tokens, "layers": layers}))
        try:
            # -c, not -m: jax_moe.bench imports this module, and runpy warns when -m runs it again.
            done = subprocess.run([sys.executable, "-c", _CHILD, str(spec), str(out)], timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"its process ran past {timeout_s:.0f} s") from None
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"its process exited with status {done.returncode} (its log is above)")
        return json.loads(out.read_text())


_CHILD = "import sys; from jax_moe.bench.decode_suite import _child_main; _child_main(sys.argv[1:])"


def _child_main(argv: list[str]) -> None:
    """The child of ``measure_model_in_child``: SPEC (model, tokens, copy rate, peer rows) -> OUT (rows)."""
    spec_path, out_path = argv
    spec = json.loads(pathlib.Path(spec_path).read_text())
    peer = None if spec["peer"] is None else {int(t): r for t, r in spec["peer"].items()}  # JSON keys are str
    rows = measure_model(MODEL_SHAPES[spec["model"]], tuple(spec["tokens"]), timing.Clock(), spec["copy_gbs"], peer,
                         spec["scratch_tokens"], spec["layers"])
    pathlib.Path(out_path).write_text(json.dumps(rows))


def run(models: list[ModelShape], token_counts, clock, compile_threads, *, time_limit_s=None, on_rows=None,
        with_peer: bool = True, isolate: bool | None = None, scratch_tokens: int | None = None):
    """Every model's rows and the notes. isolate: each model in a process of its own
    (``measure_model_in_child``); by default for more than one model on a GPU, when this process
    does not preallocate the card's memory (as the CLI sets it). scratch_tokens: as ``measure_model``'s."""
    del compile_threads  # one program at a time: each holds the model's weights
    if isolate is None:
        isolate = (len(models) > 1 and jax.default_backend() == "gpu"
                   and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false")
    from jax_moe.bench.gemm_suite import copy_ceiling_gbs
    # One L per model for both sides, from this process's allocator limit (the child's is the same card's).
    layers, notes = stack_counts(models, stack_layers, timing.card_bytes())
    # Every peer first, before JAX holds any of the card (two allocators on one card fail falsely).
    peers = {}
    for model in models if with_peer else ():
        peers[model.name] = run_peer(model, token_counts, layers[model.name])
        errors = [r["error"] for r in peers[model.name].values() if "error" in r]
        clock.log(f"decode peer {model.name}: " + (errors[0] if errors else ", ".join(
            f"T={t} {r['us_per_layer']:.0f} us" for t, r in peers[model.name].items())))
        if errors:
            notes.append(f"{model.name}: peer: {errors[0]}")
    copy = copy_ceiling_gbs(clock)
    notes.append(f"copy ceiling: {copy:.0f} GB/s" if copy else "copy ceiling: not measured (no roofline)")
    if scratch_tokens:
        notes.append(f"scratch sized for max(T, {scratch_tokens}) tokens (a server's prefill scratch), not T")
    rows = []
    for model in models:
        if clock.out_of_time(time_limit_s, notes, f"decode {model.name}"):
            break
        if isolate:
            remaining = None if time_limit_s is None else max(60.0, time_limit_s - clock.elapsed())
            measure = functools.partial(measure_model_in_child, model, token_counts, copy, peers.get(model.name),
                                        remaining, scratch_tokens, layers[model.name])
        else:
            measure = functools.partial(measure_model, model, token_counts, clock, copy, peers.get(model.name),
                                        scratch_tokens, layers[model.name])
        timing.measure_isolated(rows, notes, clock, f"decode {model.name}: failed", measure, on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    from jax_moe.bench.report import fmt_pct, fmt_us, table as md_table
    lines = []
    for model, tokens in dict.fromkeys((r["model"], r["T"]) for r in rows):
        by = {r["impl"]: r for r in rows if (r["model"], r["T"]) == (model, tokens)}
        first = next(iter(by.values()))
        line = [first["label"], str(tokens), f"{first['active_experts']:.1f}", fmt_us(first.get("roofline_us")),
                first.get("bound") or "–", first["tile"]]
        for impl in (*VARIANTS, SHARED_APART, "peer"):
            r = by.get(impl, {})
            line += [fmt_us(r.get("us_per_layer")), fmt_pct(r.get("pct_roofline"))]
        ours, peer, fp8_row = by.get("jax_moe", {}), by.get("peer", {}), by.get(FP8_VARIANT, {})
        fp8_cutlass, fp8_apart = by.get(FP8_VARIANTS[1], {}), by.get(FP8_SHARED_APART, {})
        line.append(f"{peer['us_per_layer'] / ours['us_per_layer']:.2f}x"
                    if ours.get("us_per_layer") and peer.get("us_per_layer") else "–")
        line += [fmt_us(fp8_row.get("roofline_us")), fp8_row.get("bound") or "–", fmt_us(fp8_row.get("us_per_layer")),
                 fmt_pct(fp8_row.get("pct_roofline")), fmt_us(fp8_cutlass.get("us_per_layer")),
                 fmt_pct(fp8_cutlass.get("pct_roofline")), fmt_us(fp8_apart.get("us_per_layer")),
                 fmt_pct(fp8_apart.get("pct_roofline")),
                 f"{ours['us_per_layer'] / fp8_row['us_per_layer']:.2f}x"
                 if ours.get("us_per_layer") and fp8_row.get("us_per_layer") else "–"]
        lines.append(line)
    return md_table(["model", "T", "experts read", "roofline µs", "bound", "kernel", "jax_moe µs", "% roofline",
                     "CUTLASS path µs", "% roofline", "no prefetch µs", "% roofline", "shared expert apart µs", "% roofline",
                     "PyTorch+HF graph µs", "% roofline", "jax_moe vs peer",
                     "FP8 roofline µs", "FP8 bound", "FP8 µs", "% FP8 roofline", "FP8 CUTLASS path µs",
                     "% FP8 roofline",
                     "FP8 shared apart µs", "% FP8 roofline", "FP8 vs bf16"], lines)


def markdown(record: dict) -> str:
    from jax_moe.bench.report import header_block
    lines = header_block("Decode: whole stack vs the weight-read roofline (suite decode)", record["meta"],
                         record.get("elapsed_s", 0.0), record["method"], record["notes"])
    return "\n".join(lines) + "\n\n" + table(record["rows"]) + "\n"
