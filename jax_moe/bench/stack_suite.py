"""Suite `stack`: one jitted decode step of the whole scanned MoE stack, jax_moe vs the baseline.

A step is ``moe_stack(params, x, scratch)`` (jax_moe, the scratch donated or not) or
``baseline_moe_stack(params, x, config)`` (argsort permute, no scratch), in a rolled and a fully
unrolled ``lax.scan``. Both run the same params and routing; the experts are ``moe_layer``'s (on a
GPU the CUDA grouped GEMM) for jax_moe and ``jax.lax.ragged_dot`` for the baseline: end to end.
The scratch is threaded from step to step as a decode loop threads it (donated: the same buffers
come back).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe.bench import timing
from jax_moe.bench.models import ROW_DTYPE, ModelShape
from jax_moe.config import MoEConfig

ROLLED, UNROLLED = "rolled", "unrolled"
BASELINE_VARIANT = "baseline"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the stack: jax_moe with its scratch (donated to the step or not), or the baseline."""

    name: str
    uses_scratch: bool
    donated: bool


VARIANTS = (
    Variant("jax_moe", uses_scratch=True, donated=True),
    Variant("jax_moe/not-donated", uses_scratch=True, donated=False),
    Variant(BASELINE_VARIANT, uses_scratch=False, donated=False),
)

NOTES = (
    "step_us_latency: median of single steps, each from dispatch to block_until_ready (host dispatch "
    "included). step_us_back_to_back: mean over consecutive steps dispatched without waiting, the "
    "scratch threaded step to step (a decode loop). us_per_layer = back-to-back step / L. "
    "x baseline = back-to-back step / the baseline's, same model, T and scan.",
    "Experts are SwiGLU: jax_moe's on the CUDA grouped GEMM on a GPU (bf16; ragged_dot elsewhere), the "
    "baseline's on jax.lax.ragged_dot. So the ratio is the whole layer end to end, experts included.",
    "Stack depth L is smaller than the real models' (see 'layers'): DeepSeek-V3's experts take 22.5 GB "
    "per layer in bf16, and unrolled compiles grow with L.",
)


def init_stack_params(key, config: MoEConfig, layers: int, ffn_size: int, *, fp8: bool = False,
                      **options) -> dict:
    """``init_moe_params`` drawn one expert at a time (``lax.map``), stacked to [L, El, ...].

    ``init_moe_params`` itself draws model-sized leaves a matrix at a time; this stays for ``fp8``,
    which quantises each expert as it is drawn, and for its draws (one key per expert), those of
    every recorded run. The router comes from ``init_moe_params`` with the full config (and a
    throwaway ffn of 1); every other leaf from ``init_moe_params`` for a one-expert config, so the
    scaling stays in one place.
    ``fp8``: each expert quantised as it is drawn (``jax_moe.fp8``): the same draws, FP8 experts
    (the shared one too) and their scales, never a bf16 copy of the stack.
    """
    from jax_moe import fp8 as moe_fp8, layers as moe_layers  # imported late: a missing module fails this suite only

    num_local = config.num_local_experts
    one_expert = MoEConfig(num_experts=1, top_k=1, hidden_size=config.hidden_size, max_tokens=1,
                           dtype=config.dtype)

    def expert(expert_key):
        drawn = moe_layers.init_moe_params(expert_key, one_expert, 1, ffn_size)
        drawn = {name: leaf[0, 0] for name, leaf in drawn.items() if name != "router"}
        return moe_fp8.quantize_params(drawn) if fp8 else drawn

    def build(k):
        router_key, experts_key = jax.random.split(k)
        # The router and the options' small leaves (shared expert, correction bias) drawn whole.
        small = moe_layers.init_moe_params(router_key, config, layers, 1, **options)
        small = {name: leaf for name, leaf in small.items() if name not in ("gate_up", "down")}
        small = moe_fp8.quantize_params(small) if fp8 else small  # the shared expert, as DeepSeek-V3 stores it
        experts = lax.map(expert, jax.random.split(experts_key, layers * num_local))
        stacked = {name: leaf.reshape(layers, num_local, *leaf.shape[1:]) for name, leaf in experts.items()}
        return {**small, **stacked}

    return jax.jit(build)(key)


def make_step(variant: Variant, config, unroll) -> Callable:
    """``step(carry, params, x) -> carry`` with carry = (y, scratch or ()), so timing can thread it."""
    from jax_moe import baseline, layers  # imported late: a missing module fails this variant only

    if variant.uses_scratch:
        def step(carry, params, x):
            _, scratch = carry
            return layers.moe_stack(params, x, scratch, unroll=unroll)
    else:
        def step(carry, params, x):
            return baseline.baseline_moe_stack(params, x, config, unroll=unroll), ()
    return step


def _row(model: ModelShape, layers: int, tokens: int, variant: Variant, scan: str) -> dict:
    return {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
            "H": model.hidden_size, "F": model.ffn_size, "layers": layers, "T": tokens,
            "variant": variant.name, "donated": variant.donated, "scan": scan}


def measure_model(model: ModelShape, token_counts, clock: timing.Clock, compile_threads: int,
                  seed: int = 0, time_limit_s: float | None = None, notes: list | None = None) -> list[dict]:
    """Builds the model's params once, then compiles and times every (T, scan, variant)."""
    key = jax.random.PRNGKey(seed)
    layers = model.layers_that_fit(model.stack_layers, timing.card_bytes())  # fewer on a smaller card
    params = init_stack_params(key, model.config(max(token_counts)), layers, model.ffn_size, **model.param_options())
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    clock.log(f"stack {model.name}: L={layers}, F={model.ffn_size}, params {param_bytes / 1e9:.2f} GB")
    rows = []
    for tokens in token_counts:
        if clock.out_of_time(time_limit_s, notes, f"{model.name} T={tokens}"):
            continue
        config = model.config(tokens)
        x = jax.random.normal(jax.random.fold_in(key, tokens), (tokens, model.hidden_size), ROW_DTYPE)
        scratch_spec = jax.eval_shape(lambda: jax_moe.init_scratch(config))
        y_spec = jax.ShapeDtypeStruct(x.shape, x.dtype)

        entries, lowered = [], {}
        for scan, unroll in ((ROLLED, 1), (UNROLLED, True)):
            for variant in VARIANTS:
                row = _row(model, layers, tokens, variant, scan)
                row["param_bytes"] = param_bytes
                try:
                    carry_spec = (y_spec, scratch_spec if variant.uses_scratch else ())
                    step = make_step(variant, config, unroll)
                    lowered[(variant, scan)], row["warnings"] = timing.lower(
                        step, (carry_spec, params, x), (0,) if variant.donated else ())
                except Exception as e:
                    row["error"] = timing.describe_error(e)
                entries.append((row, variant, scan))
        # The first program autotunes the expert GEMMs alone (autotuning times kernels on the
        # device); the rest then find its results in XLA's in-process cache and compile together.
        keys = list(lowered)
        compiled = timing.compile_all({k: lowered[k] for k in keys[:1]}, 1)
        compiled.update(timing.compile_all({k: lowered[k] for k in keys[1:]}, compile_threads))
        clock.log(f"stack {model.name} T={tokens}: compiled {len(compiled)} programs")

        for row, variant, scan in entries:
            where = f"stack {model.name} T={tokens} {variant.name} {scan}"
            if "error" in row:
                clock.log(f"{where}: {row['error']}")
                rows.append(row)
                continue
            executable, row["compile_s"] = compiled[(variant, scan)]
            row["compile_s"] = round(row["compile_s"], 3)
            try:
                if isinstance(executable, Exception):
                    raise executable
                row["hlo_buffer_copies"] = timing.buffer_copies(executable)
                scratch = jax_moe.init_scratch(config) if variant.uses_scratch else ()
                if variant.uses_scratch:
                    row["scratch_bytes"] = scratch.nbytes
                measured, carry = timing.step_seconds(executable, (jnp.zeros_like(x), scratch), params, x)
                del carry, scratch
                row["step_us_latency"] = measured["latency_s"] * 1e6
                row["step_us_back_to_back"] = measured["back_to_back_s"] * 1e6
                row["us_per_layer"] = row["step_us_back_to_back"] / layers
                row["repeats"] = measured["repeats"]
                clock.log(f"{where}: {row['step_us_latency']:.0f} us/step latency, "
                          f"{row['step_us_back_to_back']:.0f} us/step back to back")
            except Exception as e:
                row["error"] = timing.describe_error(e)
                clock.log(f"{where}: {row['error']}")
            rows.append(row)
    del params
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    """Ratio of each variant's back-to-back step to the baseline's, same model, T and scan."""
    for row in rows:
        baseline = next((r.get("step_us_back_to_back") for r in rows if r["variant"] == BASELINE_VARIANT
                         and (r["model"], r["T"], r["scan"]) == (row["model"], row["T"], row["scan"])), None)
        if baseline and row.get("step_us_back_to_back") is not None:
            row["ratio_to_baseline"] = row["step_us_back_to_back"] / baseline


def run(models: list[ModelShape], token_counts, clock: timing.Clock, compile_threads: int,
        on_rows: Callable[[list[dict], list[str]], Any] | None = None,
        time_limit_s: float | None = None) -> tuple[list[dict], list[str]]:
    rows, notes = [], list(NOTES)
    for model in models:
        if model.stack_layers is None:
            notes.append(f"{model.name}: not in the stack suite (no ffn size / depth chosen)")
            continue
        timing.measure_isolated(rows, notes, clock, f"{model.name}: failed before any step ran",
                                lambda: measure_model(model, token_counts, clock, compile_threads,
                                                      time_limit_s=time_limit_s, notes=notes), on_rows)
    return rows, notes
