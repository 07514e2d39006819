"""Suite train: one training step (forward and backward) of the MoE stack, per layer.

Per model and T, each of LOSSES: ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` of the stack's L
pre-norm residual layers (the model's training depth, fewer where the params and their gradients would
not fit), ``loss = mean(y ** 2)`` in float32, every gradient an output: ``moe_stack`` with its scratch
donated and threaded, and the pure-JAX stack on ``ragged_dot`` where its weight gradient stays small, and
on each JAX peer's grouped GEMM (``jax_peers.LAYER_PEERS``: ``baseline/<peer>``, checked before it is timed).
The PyTorch + Hugging Face peer (``torch_peer.py``: transformers blocks on torch's grouped_mm, eager
backward, CUDA events) runs in its own process before JAX takes any of the card. Every model routes like
that peer (softmax top-k, renormalised, no shared expert), so all sides do the same work. TFLOP/s = 3 x
the forward's expert GEMM FLOPs / time; roofline = the longer of those FLOPs / the dense rate and (the
routed experts' weights read twice + every expert's gradient written, zero where it has no rows) / the copy
rate, both measured in the run; peak bytes from XLA's memory
analysis (arguments + outputs + temporaries - aliased) and torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jax_moe
from jax_moe import baseline
from jax_moe.bench import common, jax_peers
from jax_moe.bench.models import ROW_DTYPE, ModelShape, stack_counts

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (4096,)
# The pure-JAX weight gradient is a dense [rows, E, H] tensor (32 GiB to autotune for Qwen3-30B at T = 4096).
BASELINE_MAX_ROWS_X_EXPERTS = 1024 * 8 * 128
PEER, PEER_TIMEOUT_S = "torch+hf grouped_mm", 240
TITLE = "Training step (suite train)"
METHOD = common.STEP_METHOD


def _loss(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def jax_moe_loss(config):
    def loss(p, x, s):
        y, s = jax_moe.moe_stack(p, x, s)
        return _loss(y), s
    return loss, jax_moe.init_scratch(config)


def baseline_loss(config, expert_fn=None):
    return (lambda p, x, s: (_loss(baseline.baseline_moe_stack(p, x, config, expert_fn=expert_fn)), s)), jnp.zeros(())


# name -> (loss(params, x, state) -> (loss, state), first state): the state is threaded from step to step
# (jax_moe's scratch, donated; a scalar where there is none). A JAX peer is one more entry.
LOSSES = {"jax_moe": jax_moe_loss, "baseline": baseline_loss}


def measure(model: ModelShape, tokens: int, layers: int, params, copy_gbs, dense_tflops, peer, notes) -> list[dict]:
    flops = 3 * 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size
    active = model.num_experts * (1 - (1 - model.top_k / model.num_experts) ** tokens)
    weight_bytes = common.training_weight_bytes(active, model.num_experts, 3 * model.hidden_size * model.ffn_size * 2)
    base = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
            "H": model.hidden_size, "F": model.ffn_size, "layers": layers, "T": tokens, "flops_per_layer": flops,
            "weight_bytes_per_layer": weight_bytes, **common.roofline(weight_bytes, flops, copy_gbs, dense_tflops)}
    config = model.config(tokens, real_routing=False)
    x = jax.random.normal(jax.random.key(tokens), (tokens, model.hidden_size), ROW_DTYPE)
    rows, losses, failed = [], dict(LOSSES), []
    for name, expert_fn in jax_peers.layer_peers(model, params, x, config).items():
        if not isinstance(expert_fn, str):
            losses[name] = functools.partial(baseline_loss, expert_fn=expert_fn)
        elif expert_fn.startswith("not run"):
            notes.append(f"{model.name} T={tokens}: {name} {expert_fn}")
        else:  # its failed check: reported, not timed
            failed.append({**base, "impl": name, "error": expert_fn})
    for name, make_loss in losses.items():
        if name == "baseline" and tokens * model.top_k * model.num_experts > BASELINE_MAX_ROWS_X_EXPERTS:
            notes.append(f"{model.name} T={tokens}: baseline not run (rows x E > {BASELINE_MAX_ROWS_X_EXPERTS})")
            continue
        row = {**base, "impl": name}
        try:  # a step that fails to compile or runs out of memory is recorded; the run goes on
            loss, state = make_loss(config)
            grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
            compiled = jax.jit(lambda s, p, x: grad(p, x, s), donate_argnums=0).lower(state, params, x).compile()
            m = compiled.memory_analysis()
            row["peak_bytes"] = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                 - m.alias_size_in_bytes)
            # The state is an output of the step's one executable: ready when every gradient is.
            row.update(common.time_step(lambda s, p, x: compiled(s, p, x)[0][1], state, params, x, layers=layers))
            row["step_us"] = row["step_us_back_to_back"]
        except Exception as e:
            row["error"] = common.describe_error(e)
        rows.append(row)
    rows += failed + ([{**base, **peer, "impl": PEER}] if peer else [])
    for row in (r for r in rows if r.get("us_per_layer")):
        row["tflops"] = flops / row["us_per_layer"] / 1e6
        row["roofline_pct"] = row.get("roofline_us") and 100 * row["roofline_us"] / row["us_per_layer"]
    return rows


def run(models: list[ModelShape], token_counts, clock, compile_threads: int = 1, *, on_rows=None, time_limit_s=None,
        with_peer: bool = True):
    layers_of, notes = stack_counts(models, common.card_bytes(), training=True)
    # The peer first, while this process holds none of the card.
    peers = {(model.name, tokens): common.run_torch_peer(clock, model, layers_of[model.name], (tokens,),
                                                         common.MIN_REPEATS, common.WARMUP_CALLS, PEER_TIMEOUT_S)[0]
             for model in models if with_peer for tokens in token_counts}
    notes += [] if with_peer else ["peer: not run (--no-peer)"]
    copy_gbs, dense_tflops = common.ceilings(clock, notes)
    rows = []
    for model in models:
        params = common.init_stack_params(jax.random.key(0), model.config(max(token_counts), real_routing=False),
                                          layers_of[model.name], model.ffn_size)
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"train {model.name} T={tokens}"):
                break
            common.measure_isolated(rows, notes, clock, f"train {model.name} T={tokens}: failed", lambda: measure(
                model, tokens, layers_of[model.name], params, copy_gbs, dense_tflops, peers.get((model.name, tokens)),
                notes), on_rows)
            clock.log(f"train {model.name} T={tokens}: " + ", ".join(
                f"{r['impl']} {common.outcome(r)}" for r in rows if (r["model"], r["T"]) == (model.name, tokens)))
        params = None  # freed before the next model's stack is built
    return rows, notes


def table(rows: list[dict]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    gib = lambda v: common.MISSING if v is None else f"{v / 2**30:.1f}"  # noqa: E731
    columns = [(f"{impl} µs/layer", common.cell(impl, "us_per_layer")) for impl in impls]
    columns += [(f"{impl} / jax_moe", common.speedup(impl, "jax_moe", "us_per_layer")) for impl in impls[1:]]
    columns += [("jax_moe TFLOP/s", common.cell("jax_moe", "tflops")),
                ("roofline µs", common.cell("jax_moe", "roofline_us")),
                ("jax_moe % roofline", common.cell("jax_moe", "roofline_pct", common.fmt_pct))]
    columns += [(f"{impl} peak GiB", common.cell(impl, "peak_bytes", gib)) for impl in impls]
    return common.pivot(rows, ("model", "T", "layers"), columns)
