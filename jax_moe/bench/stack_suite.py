"""Suite stack: one jitted decode step of the scanned MoE stack, jax_moe against the pure-JAX stack.

A step is ``moe_stack`` (its scratch donated, or not) or ``baseline_moe_stack`` (argsort permute, experts
on ``lax.ragged_dot``) over the model's stack depth, in a rolled and a fully unrolled ``lax.scan``, on the
same params and routing: end to end, experts included. The scratch is threaded from step to step as a
decode loop threads it. µs a layer = back-to-back step / L; baseline / jax_moe = the two steps' ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_moe
from jax_moe import baseline
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE, ModelShape

MODELS = ("deepseek_v3", "qwen3_30b")
TOKENS = (1, 16, 128, 1024)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (1, 16)
BASELINE = "baseline"
VARIANTS = {"jax_moe": True, "jax_moe/not-donated": False, BASELINE: False}  # name -> the scratch donated
TITLE = "jax_moe scanned MoE stack, one jitted decode step"
METHOD = common.STEP_METHOD


def make_step(variant: str, config, unroll):
    """``step((y, scratch or ()), params, x) -> (y, scratch or ())``."""
    if variant == BASELINE:
        return lambda state, p, x: (baseline.baseline_moe_stack(p, x, config, unroll=unroll), ())
    return lambda state, p, x: jax_moe.moe_stack(p, x, state[1], unroll=unroll)


def measure_model(model: ModelShape, token_counts, clock, time_limit_s, notes) -> list[dict]:
    layers, key = model.layers_that_fit(common.card_bytes()), jax.random.key(0)
    params = common.init_stack_params(key, model.config(max(token_counts)), layers, model.ffn_size,
                                      **model.param_options())
    rows = []
    for tokens in token_counts:
        if clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
            break
        config = model.config(tokens)
        x = jax.random.normal(jax.random.fold_in(key, tokens), (tokens, model.hidden_size), ROW_DTYPE)
        for scan, unroll in (("rolled", 1), ("unrolled", True)):
            for variant, donated in VARIANTS.items():
                row = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
                       "H": model.hidden_size, "F": model.ffn_size, "layers": layers, "T": tokens,
                       "variant": variant, "donated": donated, "scan": scan}
                try:
                    state = (jnp.zeros_like(x), () if variant == BASELINE else jax_moe.init_scratch(config))
                    step = jax.jit(make_step(variant, config, unroll), donate_argnums=(0,) if donated else ())
                    compiled = step.lower(state, params, x).compile()
                    row.update(common.time_step(compiled, state, params, x, layers=layers))
                except Exception as e:  # recorded; the other cases still run
                    row["error"] = common.describe_error(e)
                clock.log(f"stack {model.name} T={tokens} {variant} {scan}: {common.outcome(row)} a layer")
                rows.append(row)
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None):
    rows, notes = [], []
    for model in models:
        common.measure_isolated(rows, notes, clock, f"stack {model.name}: failed",
                                lambda: measure_model(model, token_counts, clock, time_limit_s, notes), on_rows)
    return rows, notes


def table(rows: list[dict]) -> str:
    columns = [(f"{variant} µs/step", common.cell(variant, "step_us_back_to_back")) for variant in VARIANTS]
    columns += [("jax_moe µs/step, latency", common.cell("jax_moe", "step_us_latency")),
                ("jax_moe µs/layer", common.cell("jax_moe", "us_per_layer")),
                ("baseline / jax_moe", common.speedup(BASELINE, "jax_moe", "step_us_back_to_back"))]
    return "Back to back, one step:\n\n" + common.pivot(rows, ("label", "layers", "T", "scan"), columns, name="variant")
