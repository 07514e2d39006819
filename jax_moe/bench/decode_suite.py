"""Suite decode: the whole scanned MoE stack per layer against its roofline, at decode and prefill sizes.

Per model and T (1 to 64 by default; ``--tokens 4096`` for prefill): one jitted step of ``moe_stack``
over L layers (rolled scan, scratch donated and threaded, each layer routing by its own router), µs
per layer, for each of VARIANTS: jax_moe's plan (``jax_moe.plan_layer``), and that plan with one
choice switched off (the decode kernels, the permute's L2 prefetch of the routed experts' weights, the
shared expert riding the routed experts' decode launches), so each choice is measured in the same
run; a variant whose plan is jax_moe's runs the same program and is left out. FP8_VARIANTS: the same
on FP8 experts (the same draws quantised, e4m3 with a float32 scale per 128 x 128 block) where H and F
are multiples of 128. The PyTorch + Hugging Face peer: L transformers ``Qwen3MoeSparseMoeBlock``s
(torch grouped_mm) in the same residual stack, its forward in one CUDA graph, in its own process. A
JAX peer is one more entry of VARIANTS with its own step.

Roofline per layer: the longer of the bytes a layer must read (the experts owning rows, counted on the
device from the step's own routing and averaged over layers, plus the shared expert and the router) /
the copy rate, and the forward's FLOPs (router, T*k routed and T shared rows through three projections)
/ the dense rate (FP8: twice it), both rates measured in the same run.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe import fp8
from jax_moe.bench import common
from jax_moe.bench.models import MIN_LAYERS, MODELS as MODEL_SHAPES, ROW_DTYPE, ModelShape, stack_counts

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (1, 16)
# Enough layers that one layer's experts are not in L2 from the step before, and what fits an H200.
LAYERS = {"mixtral": 8, "qwen3_30b": 16, "deepseek_v3": 4, "qwen35_397b": 8, "tiny": 2}
PEER, PEER_STEPS, PEER_WARMUP, PEER_TIMEOUT_S = "peer", 50, 5, 300
# name -> the plan_layer choices it switches off; the first of each is the plan as shipped.
VARIANTS = {"jax_moe": {}, "jax_moe/cutlass": {"decode_kernels": False}, "jax_moe/no-prefetch": {"prefetch": False},
            "jax_moe/shared-apart": {"shared_in_decode_launch": False}}
FP8_VARIANTS = {"jax_moe/fp8": {}, "jax_moe/fp8-cutlass": {"fp8_decode_kernel": False},
                "jax_moe/fp8-shared-apart": {"shared_in_decode_launch": False}}
EXPERT_LEAVES = ("gate_up", "down", *(name + fp8.SCALE_SUFFIX for name in fp8.QUANTIZED_NAMES))
TITLE = "Decode: the whole stack against its roofline (suite decode)"
METHOD = ("per layer = back-to-back step time / L (" + common.STEP_METHOD + ") Peer: transformers "
          f"Qwen3MoeSparseMoeBlocks with torch grouped_mm, the forward in one CUDA graph, {PEER_STEPS} replays "
          f"after {PEER_WARMUP}, its own process; it has no shared expert and routes by softmax top-k for every "
          "model. Roofline: the longer of the bytes bound and the FLOP bound (see jax_moe.bench.decode_suite).")


def variant_plans(variants: dict, config, tokens: int, params, **options) -> dict:
    """Each variant's ``LayerPlan``, those equal to the first's (the same program) left out."""
    plans = {name: jax_moe.plan_layer(config, tokens, params, **switches, **options) for name, switches in variants.items()}
    shipped = next(iter(plans.values()))
    return {name: plan for name, plan in plans.items() if plan != shipped or plan is shipped}


def layer_bytes(params: dict, active_experts: float) -> float:
    """Bytes a layer must read: the experts owning rows (with their scales), the shared expert, the router."""
    per_expert = sum(leaf[0, 0].nbytes for name, leaf in params.items() if name in EXPERT_LEAVES)
    return active_experts * per_expert + sum(leaf[0].nbytes for name, leaf in params.items() if name not in EXPERT_LEAVES)


def layer_flops(model: ModelShape, tokens: int) -> float:
    """The forward's FLOPs: the router, T*k routed and T shared rows through three projections (H -> 2F -> H)."""
    routed = 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size
    return routed + 2 * tokens * model.hidden_size * (3 * (model.shared_ffn or 0) + model.num_experts)


def stack_layers(model: ModelShape, limit_bytes: float | None) -> int:
    return model.layers_that_fit(LAYERS.get(model.name, model.stack_layers or MIN_LAYERS), limit_bytes)


def _active_experts(params, x, config) -> float:
    """Experts owning rows per layer, averaged over the stack's layers, from its own routing."""
    counts = jax.jit(lambda p, x, s: jax_moe.moe_stack(p, x, s, with_aux=True)[2]["expert_counts"])(
        params, x, jax_moe.init_scratch(config))
    return float((np.asarray(counts) > 0).sum(axis=-1).mean())


def _time_variants(variants, params, inputs, layers, base_of, dense_tflops, copy_gbs, clock) -> list[dict]:
    rows = []
    for tokens, (config, x) in inputs.items():
        base = base_of(tokens)
        base.update(bytes_per_layer=layer_bytes(params, base["active_experts"]),
                    **common.roofline(layer_bytes(params, base["active_experts"]), base["flops_per_layer"], copy_gbs,
                                      dense_tflops))
        for name, plan in variant_plans(variants, config, tokens, params).items():
            row = {**base, "impl": name, "plan": str(plan), "tile": plan.tile}
            try:
                step = lambda state, p, x, plan=plan: jax_moe.moe_stack(p, x, state[1], plan=plan)  # noqa: E731
                row.update(common.time_stack_step(step, (jnp.zeros_like(x), jax_moe.init_scratch(config)), params, x,
                                                  layers))
            except Exception as e:  # recorded; the other variants still run
                row["error"] = common.describe_error(e)
            if row.get("roofline_us") and row.get("us_per_layer"):
                row["pct_roofline"] = 100 * row["roofline_us"] / row["us_per_layer"]
            rows.append(row)
        clock.log(f"decode {rows[-1]['model']} T={tokens}: " + ", ".join(
            f"{r['impl']} {r.get('us_per_layer', r.get('error'))}" for r in rows if r["T"] == tokens))
    return rows


def measure_model(model: ModelShape, token_counts, clock, copy_gbs=None, dense_tflops=None, peer: dict | None = None,
                  scratch_tokens: int | None = None, layers: int | None = None) -> list[dict]:
    """Every variant's rows and the peer's (``peer``: T -> its result). scratch_tokens: each step's scratch
    holds max(T, scratch_tokens) tokens (a server decoding on its prefill scratch); layers: L (None: what fits)."""
    layers = layers or stack_layers(model, common.card_bytes())
    key = jax.random.key(0)
    stack_args = (key, model.config(max(token_counts)), layers, model.ffn_size)
    params = common.init_stack_params(*stack_args, **model.param_options())
    inputs = {tokens: (model.config(max(tokens, scratch_tokens or 0)),
                       jax.random.normal(jax.random.fold_in(key, tokens), (tokens, model.hidden_size), ROW_DTYPE))
              for tokens in token_counts}
    bases = {tokens: {"model": model.name, "label": model.label, "T": tokens, "scratch_tokens": config.max_tokens,
                      "layers": layers, "active_experts": _active_experts(params, x, config),
                      "flops_per_layer": layer_flops(model, tokens)} for tokens, (config, x) in inputs.items()}
    rows = _time_variants(VARIANTS, params, inputs, layers, lambda t: dict(bases[t]), dense_tflops, copy_gbs, clock)
    rows += [{**bases[t], "impl": PEER, **{k: v for k, v in r.items() if k in ("us_per_layer", "error")}}
             for t, r in (peer or {}).items() if t in bases]
    del params
    if model.hidden_size % fp8.BLOCK == 0 and model.ffn_size % fp8.BLOCK == 0:
        # The same draws quantised (so the same routing), built once the bf16 stack is freed.
        params = common.init_stack_params(*stack_args, fp8=True, **model.param_options())
        rows += _time_variants(FP8_VARIANTS, params, inputs, layers, lambda t: dict(bases[t]),
                               dense_tflops and 2 * dense_tflops, copy_gbs, clock)  # FP8 tensor cores: twice bf16's rate
    return rows


_CHILD = "import sys; from jax_moe.bench.decode_suite import child_main; child_main(*sys.argv[1:])"


def measure_model_in_child(model: ModelShape, token_counts, copy_gbs=None, dense_tflops=None, peer=None,
                           timeout_s: float | None = None, scratch_tokens=None, layers=None) -> list[dict]:
    """``measure_model`` in a process of its own, whose device memory goes back to the card when it exits
    (Qwen3.5-397B ran out of memory as the fourth model of one process, where alone it runs)."""
    if MODEL_SHAPES.get(model.name) != model:
        raise ValueError(f"measure_model_in_child: model: expected one of jax_moe.bench.models.MODELS, got {model.name!r}")
    spec = {"model": model.name, "tokens": list(token_counts), "copy_gbs": copy_gbs, "dense_tflops": dense_tflops,
            "peer": peer, "scratch_tokens": scratch_tokens, "layers": layers}
    return common.run_child(["-c", _CHILD, json.dumps(spec)], timeout_s)


def child_main(spec: str, out: str) -> None:
    spec = json.loads(spec)
    peer = {int(t): r for t, r in (spec["peer"] or {}).items()}  # JSON keys are strings
    rows = measure_model(MODEL_SHAPES[spec["model"]], tuple(spec["tokens"]), common.Clock(), spec["copy_gbs"],
                         spec["dense_tflops"], peer, spec["scratch_tokens"], spec["layers"])
    with open(out, "w") as f:
        json.dump(rows, f)


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None,
        with_peer: bool = True, isolate: bool | None = None, scratch_tokens: int | None = None):
    """isolate: each model in a process of its own; by default for several models on a GPU when this
    process does not preallocate the card (as the CLI sets it)."""
    if isolate is None:
        isolate = (len(models) > 1 and jax.default_backend() == "gpu"
                   and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false")
    layers, notes = stack_counts(models, stack_layers, common.card_bytes())  # one L for jax_moe and the peer
    peers = {}
    for model in models if with_peer else ():  # first, before JAX holds any of the card
        result = common.run_torch_peer(model, layers[model.name], token_counts, PEER_STEPS, PEER_WARMUP,
                                       PEER_TIMEOUT_S, decode=True)
        peers[model.name] = {r["T"]: r for r in result.get("results", [])} or {t: result for t in token_counts}
        clock.log(f"decode peer {model.name}: {peers[model.name]}")
    copy_gbs, dense_tflops = common.ceilings(clock, notes)
    if scratch_tokens:
        notes.append(f"scratch sized for max(T, {scratch_tokens}) tokens (a server's prefill scratch), not T")
    rows = []
    for model in models:
        if clock.out_of_time(time_limit_s, notes, f"decode {model.name}"):
            break
        rates, peer = (copy_gbs, dense_tflops), peers.get(model.name)
        if isolate:
            remaining = None if time_limit_s is None else max(60.0, time_limit_s - clock.elapsed())
            measure = functools.partial(measure_model_in_child, model, token_counts, *rates, peer, remaining,
                                        scratch_tokens, layers[model.name])
        else:
            measure = functools.partial(measure_model, model, token_counts, clock, *rates, peer, scratch_tokens,
                                        layers[model.name])
        common.measure_isolated(rows, notes, clock, f"decode {model.name}: failed", measure, on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    def cell(impl):
        def value(by):
            row = by.get(impl)
            if row is None or "error" in row:
                return common.MISSING if row is None else "error"
            return f"{common.fmt_us(row.get('us_per_layer'))} ({common.fmt_pct(row.get('pct_roofline'))})"
        return value

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    columns = [("experts read", lambda by: f"{next(iter(by.values()))['active_experts']:.1f}"),
               ("roofline µs", common.cell("jax_moe", "roofline_us")), ("bound", common.cell("jax_moe", "bound", common.fmt_text)),
               ("kernel", common.cell("jax_moe", "tile", common.fmt_text))]
    columns += [(f"{impl} µs (% roofline)", cell(impl)) for impl in impls]
    columns += [("peer / jax_moe", common.speedup(PEER, "jax_moe", "us_per_layer")),
                ("FP8 vs bf16", common.speedup("jax_moe", "jax_moe/fp8", "us_per_layer"))]
    return common.pivot(rows, ("label", "T"), columns)
