"""Suite decode: the scanned MoE stack per layer against its roofline, at decode and prefill sizes.

Per model and T (1 to 64; ``--tokens 4096`` for prefill): one jitted step of ``moe_stack`` over the
model's stack depth (rolled scan, scratch donated and threaded, each layer routing by its own router),
µs a layer = back-to-back step / L, for each of VARIANTS (FP8_VARIANTS on FP8 experts, the same draws
quantised, where H and F are multiples of 128): the plan of ``jax_moe.plan_layer``, and that plan with one
choice switched off, passed as ``plan=`` (one equal to the shipped plan is not run). Peers: the JAX peers'
pure-JAX layer (``jax_peers``) and, in its own process, L transformers ``Qwen3MoeSparseMoeBlock``s (torch
grouped_mm, softmax top-k, no shared expert) in one CUDA graph. Roofline: the longer of the bytes a layer
must read (the experts owning rows in the step's own routing, averaged over layers, the shared expert, the
router) / the copy rate and its FLOPs / the dense rate (FP8: twice it), both measured in the run.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe import baseline, fp8
from jax_moe.bench import common, jax_peers
from jax_moe.bench.models import MODELS as MODEL_SHAPES, ROW_DTYPE, ModelShape, stack_counts

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (1, 16)
PEER, PEER_STEPS, PEER_WARMUP, PEER_TIMEOUT_S = "peer", 50, 5, 300
# name -> the plan_layer choices it switches off; the first of each is the plan as shipped.
VARIANTS = {"jax_moe": {}, "jax_moe/cutlass": {"decode_kernels": False}, "jax_moe/no-prefetch": {"prefetch": False},
            "jax_moe/shared-apart": {"shared_in_decode_launch": False}}
FP8_VARIANTS = {"jax_moe/fp8": {}, "jax_moe/fp8-cutlass": {"fp8_decode_kernel": False},
                "jax_moe/fp8-shared-apart": {"shared_in_decode_launch": False}}
EXPERT_LEAVES = ("gate_up", "down", *(name + fp8.SCALE_SUFFIX for name in fp8.QUANTIZED_NAMES))
TITLE = "Decode: the whole stack against its roofline (suite decode)"
METHOD = common.STEP_METHOD


def variant_plans(variants: dict, config, tokens: int, params, **options) -> dict:
    """Each variant's ``LayerPlan``, those equal to the first's (the same program) left out."""
    plans = {name: jax_moe.plan_layer(config, tokens, params, **switches, **options)
             for name, switches in variants.items()}
    shipped = next(iter(plans.values()))
    return {name: plan for name, plan in plans.items() if plan != shipped or plan is shipped}


def layer_bytes(params: dict, active_experts: float) -> float:
    """Bytes a layer must read: the experts owning rows (with their scales), the shared expert, the router."""
    per_expert = sum(leaf[0, 0].nbytes for name, leaf in params.items() if name in EXPERT_LEAVES)
    small = sum(leaf[0].nbytes for name, leaf in params.items() if name not in EXPERT_LEAVES)
    return active_experts * per_expert + small


def layer_flops(model: ModelShape, tokens: int) -> float:
    routed = 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size
    return routed + 2 * tokens * model.hidden_size * (3 * (model.shared_ffn or 0) + model.num_experts)


def _time_variants(variants, params, inputs, layers, bases, dense_tflops, copy_gbs, clock, peers_of=None,
                   on_rows=None) -> list[dict]:
    """Each variant's row per T, and with ``peers_of`` (the model) each JAX peer's layer (``jax_peers``);
    ``on_rows(rows)`` after each T."""
    rows = []
    for tokens, (config, x) in inputs.items():
        base = {**bases[tokens], "bytes_per_layer": layer_bytes(params, bases[tokens]["active_experts"])}
        base.update(common.roofline(base["bytes_per_layer"], base["flops_per_layer"], copy_gbs, dense_tflops))
        steps = {name: ((lambda state, p, x, plan=plan: jax_moe.moe_stack(p, x, state[1], plan=plan)),
                        {"plan": str(plan), "tile": plan.tile})
                 for name, plan in variant_plans(variants, config, tokens, params).items()}
        for name, fn in (jax_peers.layer_peers(peers_of, params, x, config, "forward") if peers_of else {}).items():
            if not isinstance(fn, str):  # the scratch passes through the pure-JAX stack untouched
                fn = lambda state, p, x, fn=fn, config=config: (baseline.baseline_moe_stack(p, x, config, expert_fn=fn),
                                                                state[1])
            if not str(fn).startswith("not run"):  # not run here: the parent's notes say why
                steps[name] = (fn, {})
        for name, (step, fields) in steps.items():
            row = {**base, "impl": name, **fields}
            try:
                if isinstance(step, str):  # a peer's failed check: reported, not timed
                    raise RuntimeError(step)
                state = (jnp.zeros_like(x), jax_moe.init_scratch(config))
                step = jax.jit(step, donate_argnums=0)
                row.update(common.time_step(step.lower(state, params, x).compile(), state, params, x, layers=layers))
                row["pct_roofline"] = row.get("roofline_us") and 100 * row["roofline_us"] / row["us_per_layer"]
            except Exception as e:  # recorded; the other variants still run
                row["error"] = step if isinstance(step, str) else common.describe_error(e)
            rows.append(row)
        clock.log(f"decode {base['model']} T={tokens}: " + ", ".join(
            f"{r['impl']} {common.outcome(r)}" for r in rows if r["T"] == tokens))
        if on_rows:
            on_rows(rows)
    return rows


def measure_model(model: ModelShape | str, token_counts, copy_gbs=None, dense_tflops=None, peer: list | None = None,
                  layers: int | None = None, on_rows=None) -> list[dict]:
    """Every variant's rows and the peer's (its rows, with T); layers: L (None: what fits the card);
    ``on_rows(rows)`` with the rows so far after each T (in a child process: they survive its timeout)."""
    model, clock = MODEL_SHAPES[model] if isinstance(model, str) else model, common.Clock()
    layers, key = layers or model.layers_that_fit(common.card_bytes()), jax.random.key(0)
    stack_args = (key, model.config(max(token_counts)), layers, model.ffn_size)
    params = common.init_stack_params(*stack_args, **model.param_options())
    inputs = {tokens: (model.config(tokens),
                       jax.random.normal(jax.random.fold_in(key, tokens), (tokens, model.hidden_size), ROW_DTYPE))
              for tokens in token_counts}
    count = jax.jit(lambda p, x, s: jax_moe.moe_stack(p, x, s, with_aux=True)[2]["expert_counts"])  # [L, E]
    bases = {tokens: {"model": model.name, "label": model.label, "T": tokens,
                      "layers": layers, "flops_per_layer": layer_flops(model, tokens), "active_experts": float(
                          (np.asarray(count(params, x, jax_moe.init_scratch(config))) > 0).sum(-1).mean())}
             for tokens, (config, x) in inputs.items()}
    peer_rows = [{**bases[r["T"]], "impl": PEER, **{k: r[k] for k in ("us_per_layer", "error") if k in r}}
                 for r in peer or () if r.get("T") in bases]
    rows = []
    save = on_rows and (lambda measured: on_rows(rows + measured + peer_rows))
    rows += _time_variants(VARIANTS, params, inputs, layers, bases, dense_tflops, copy_gbs, clock, peers_of=model,
                           on_rows=save)
    del params
    if model.hidden_size % fp8.BLOCK == 0 and model.ffn_size % fp8.BLOCK == 0:
        # The same draws quantised (so the same routing), built once the bf16 stack is freed.
        params = common.init_stack_params(*stack_args, fp8=True, **model.param_options())
        rows += _time_variants(FP8_VARIANTS, params, inputs, layers, bases, dense_tflops and 2 * dense_tflops,
                               copy_gbs, clock, on_rows=save)  # FP8 tensor cores run at twice the bf16 rate
    return rows + peer_rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None,
        with_peer: bool = True, isolate: bool | None = None):
    """isolate: each model in a process of its own (``common.in_child``); by default for several models on a
    GPU when this process does not preallocate the card (as the CLI sets it)."""
    if isolate is None:
        isolate = (len(models) > 1 and jax.default_backend() == "gpu"
                   and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false")
    layers, notes = stack_counts(models, common.card_bytes())
    # The peer first, while this process holds none of the card.
    peers = {model.name: common.run_torch_peer(clock, model, layers[model.name], token_counts, PEER_STEPS, PEER_WARMUP,
                                               PEER_TIMEOUT_S, decode=True) for model in models if with_peer}
    notes += [f"{model.name}: {name} {why}" for model in models for name, why in jax_peers.layer_peers(model).items()
              if isinstance(why, str)]
    copy_gbs, dense_tflops = common.ceilings(clock, notes)
    rows = []
    for model in models:
        if clock.out_of_time(time_limit_s, notes, f"decode {model.name}"):
            break
        options = dict(token_counts=list(token_counts), copy_gbs=copy_gbs, dense_tflops=dense_tflops,
                       peer=peers.get(model.name), layers=layers[model.name])
        if isolate and MODEL_SHAPES.get(model.name) == model:
            remaining = None if time_limit_s is None else max(60.0, time_limit_s - clock.elapsed())
            measure = functools.partial(common.in_child, f"{__name__}:measure_model", remaining, model=model.name,
                                        **options)
        else:
            measure = functools.partial(measure_model, model, **options)
        common.measure_isolated(rows, notes, clock, f"decode {model.name}: failed", measure, on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    columns = [("experts read", lambda by: f"{next(iter(by.values()))['active_experts']:.1f}"),
               ("roofline µs", common.cell("jax_moe", "roofline_us")),
               ("bound", common.cell("jax_moe", "bound", common.fmt_text)),
               ("kernel", common.cell("jax_moe", "tile", common.fmt_text))]
    columns += [(f"{impl} µs (% roofline)", common.cell(impl, "us_per_layer", pct="pct_roofline"))
                for impl in dict.fromkeys(r["impl"] for r in rows)]
    columns += [(f"{impl} / jax_moe", common.speedup(impl, "jax_moe", "us_per_layer"))
                for impl in dict.fromkeys(r["impl"] for r in rows) if impl.startswith("baseline/")]
    columns += [("peer / jax_moe", common.speedup(PEER, "jax_moe", "us_per_layer")),
                ("FP8 vs bf16", common.speedup("jax_moe", "jax_moe/fp8", "us_per_layer"))]
    return common.pivot(rows, ("label", "T"), columns)
