"""Suite train: one training step (forward and backward) of the MoE stack, per layer.

Per model and token count T: ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
donate_argnums=2)`` over ``moe_stack``'s L pre-norm residual layers, ``loss = mean(y ** 2)`` in float32,
the scratch threaded from step to step; the same step of the pure-JAX stack on ``ragged_dot`` where it
fits; and the PyTorch + Hugging Face peer (``torch_peer.py``), each in a process of its own, run before
JAX takes any of the card. Every model routes like that peer (softmax top-k, renormalised, no shared
expert), so all sides do the same work. In-process JAX peers are entries of ``STEPS``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_moe
from jax_moe import baseline
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE, ModelShape, stack_counts

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (4096,)
# Layers a model's stack, its gradients and a step's temporaries fit on one H200.
LAYERS = {"mixtral": 4, "qwen3_30b": 8, "deepseek_v3": 2, "qwen35_397b": 2, "tiny": 2}
TRAIN_COPIES = 2  # a step holds the weights and their gradients
# The pure-JAX weight gradient is ragged_dot's transpose, a dense [rows, E, H] tensor (Qwen3-30B at
# T = 4096 asked 32 GiB to autotune it): run only below this.
BASELINE_MAX_ROWS_X_EXPERTS = 1024 * 8 * 128
PEER, PEER_TIMEOUT_S = "torch+hf grouped_mm", 240
TITLE = "Training step (suite train)"
METHOD = ("per layer = back-to-back step time / L, a step being one call of the jitted value_and_grad (every "
          "gradient an output): " + common.STEP_METHOD + " Peer: transformers Qwen3MoeSparseMoeBlocks with "
          f"torch's grouped_mm, eager loss.backward(), CUDA events over {common.MIN_REPEATS} steps after "
          f"{common.WARMUP_CALLS}. TFLOP/s = 3 x the forward's expert GEMM FLOPs / time. Roofline = the longer of "
          "those FLOPs / the dense rate and (weights read twice + gradients written) / the copy rate. Peak "
          "bytes: XLA's memory analysis; torch.cuda.max_memory_allocated.")


def _loss(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def jax_moe_step(config):
    """``(step(state, params, x), first state, donated)``: the scratch is the state, donated."""
    def loss(p, x, s):
        y, s = jax_moe.moe_stack(p, x, s)
        return _loss(y), s
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return (lambda s, p, x: grad(p, x, s)), jax_moe.init_scratch(config), True


def baseline_step(config):
    grad = jax.value_and_grad(lambda p, x: _loss(baseline.baseline_moe_stack(p, x, config)), argnums=(0, 1))
    return (lambda _, p, x: grad(p, x)), None, False


STEPS = {"jax_moe": jax_moe_step, "baseline": baseline_step}  # name -> (step, first state, state donated)


def measure_step(name: str, config, params, x, layers: int) -> dict:
    step, state, donated = STEPS[name](config)
    compiled = jax.jit(step, donate_argnums=(0,) if donated else ()).lower(state, params, x).compile()
    # What the timer waits for (the scratch, or every output) is done when the gradients are.
    thread = (lambda s, p, x: compiled(s, p, x)[0][1]) if donated else (lambda _, p, x: compiled(state, p, x))
    measured, _ = common.step_seconds(thread, state, params, x)
    return {"step_us": measured["back_to_back_s"] * 1e6, "step_us_latency": measured["latency_s"] * 1e6,
            "us_per_layer": measured["back_to_back_s"] * 1e6 / layers, "peak_bytes": common.peak_bytes(compiled),
            "hlo_buffer_copies": common.buffer_copies(compiled)}


def train_layers(model: ModelShape, limit_bytes: float | None) -> int:
    """L: LAYERS' count, fewer where the params and their gradients would not fit, down to one."""
    return model.layers_that_fit(LAYERS.get(model.name, 2), limit_bytes, copies=TRAIN_COPIES, least=1)


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None,
        with_peer: bool = True):
    layers_of, notes = stack_counts(models, train_layers, common.card_bytes(), held=" and as much of gradients")
    peers = {}
    for model in models if with_peer else ():  # first, while this process holds none of the card
        for tokens in token_counts:
            result = common.run_torch_peer(model, layers_of[model.name], (tokens,), common.MIN_REPEATS,
                                           common.WARMUP_CALLS, PEER_TIMEOUT_S)
            peers[model.name, tokens] = result.get("results", [result])[0]
            clock.log(f"peer {model.name} T={tokens}: {peers[model.name, tokens]}")
    if not with_peer:
        notes.append("peer: not run (--no-peer)")
    copy_gbs, dense_tflops = common.ceilings(clock, notes)
    rows = []
    for model in models:
        layers, params = layers_of[model.name], None
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"train {model.name} T={tokens}"):
                break
            flops = 3 * 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size
            active = model.num_experts * (1 - (1 - model.top_k / model.num_experts) ** tokens)
            weight_bytes = 3 * active * 3 * model.hidden_size * model.ffn_size * 2  # read twice, gradient written
            base = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
                    "H": model.hidden_size, "F": model.ffn_size, "layers": layers, "T": tokens,
                    "flops_per_layer": flops, "weight_bytes_per_layer": weight_bytes,
                    **common.roofline(weight_bytes, flops, copy_gbs, dense_tflops)}
            config = model.config(tokens, real_routing=False)
            if params is None:
                params = common.init_stack_params(jax.random.key(0), model.config(max(token_counts), real_routing=False),
                                                  layers, model.ffn_size)
            x = jax.random.normal(jax.random.key(tokens), (tokens, model.hidden_size), ROW_DTYPE)
            case_rows = []
            for name in STEPS:
                if name == "baseline" and tokens * model.top_k * model.num_experts > BASELINE_MAX_ROWS_X_EXPERTS:
                    notes.append(f"{model.name} T={tokens}: baseline not run (rows x E > {BASELINE_MAX_ROWS_X_EXPERTS})")
                    continue
                try:  # a case that fails to compile or runs out of memory is recorded; the run goes on
                    row = {**base, "impl": name, **measure_step(name, config, params, x, layers)}
                except Exception as e:
                    row = {**base, "impl": name, "error": common.describe_error(e)}
                case_rows.append(row)
                clock.log(f"train {model.name} T={tokens} {name}: {row.get('us_per_layer', row.get('error'))}")
            if (model.name, tokens) in peers:
                case_rows.append({**base, **peers[model.name, tokens], "impl": PEER})
            for row in case_rows:
                if row.get("us_per_layer"):
                    row["tflops"] = flops / row["us_per_layer"] / 1e6
                    if "roofline_us" in row:
                        row["roofline_pct"] = 100 * row["roofline_us"] / row["us_per_layer"]
            rows += case_rows
            if on_rows:
                on_rows(rows, notes)
        del params
    return rows, notes


def table(rows: list[dict]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    gib = lambda v: common.MISSING if v is None else f"{v / 2**30:.1f}"  # noqa: E731
    columns = [(f"{impl} µs/layer", common.cell(impl, "us_per_layer")) for impl in impls]
    columns += [(f"{impl} / jax_moe", common.speedup(impl, "jax_moe", "us_per_layer")) for impl in impls[1:]]
    columns += [("jax_moe TFLOP/s", common.cell("jax_moe", "tflops")), ("roofline µs", common.cell("jax_moe", "roofline_us")),
                ("jax_moe % roofline", common.cell("jax_moe", "roofline_pct", common.fmt_pct))]
    columns += [(f"{impl} peak GiB", common.cell(impl, "peak_bytes", gib)) for impl in impls]
    return common.pivot(rows, ("model", "T", "layers"), columns)
