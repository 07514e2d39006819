"""Suite train: one training step (forward and backward) of the MoE stack (issue 13).

Per model and token count T: ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
donate_argnums=2)`` over ``moe_stack`` of L pre-norm residual layers, ``loss = mean(y ** 2)`` in
float32, the scratch threaded from step to step; the same step of the pure-JAX baseline stack
(``ragged_dot``) where it can run; and the PyTorch + Hugging Face grouped_mm peer
(``torch_peer.py``) in its own process, run before JAX takes any of the card's memory.
Reported per layer (step time / L), with TFLOP/s (fwd+bwd = 3x the forward GEMM FLOPs), % of the
training roofline and peak step memory (XLA's ``memory_analysis``: arguments + outputs +
temporaries - aliased; ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import baseline
from jax_moe.bench import timing, torch_peer
from jax_moe.bench.models import ROW_DTYPE, ModelShape, stack_counts
from jax_moe.demo import memory_stats

MODELS = ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b")
TOKENS = (1024, 4096, 16384)
QUICK_MODELS = ("qwen3_30b",)
QUICK_TOKENS = (4096,)
# Layers per model: the stack, its gradients and the step's temporaries fit one H200 (DeepSeek-V3:
# 22.5 GB of bf16 experts per layer, and as much again of weight gradients).
LAYERS = {"mixtral": 4, "qwen3_30b": 8, "deepseek_v3": 2, "qwen35_397b": 2, "tiny": 2}
# Copies of the params a training step keeps (the weights and their gradients, both bf16).
TRAIN_COPIES = 2
# The pure-JAX baseline's weight gradient is ragged_dot's transpose, a dense [rows, E, H] tensor:
# it is run only where that stays small (issue 13: Qwen3-30B at T=4096 asked 32 GiB to autotune).
BASELINE_MAX_ROWS_X_EXPERTS = 1024 * 8 * 128
# The peer's steps: the same counts as timing.step_seconds's warm-up and fewest repeats.
WARMUP_STEPS = timing.WARMUP_CALLS
STEPS = timing.MIN_REPEATS
PEER_TIMEOUT_S = 240
METHOD = ("Per layer = step time / L, the step time being timing.step_seconds's back-to-back time ("
          + timing.STEP_METHOD + "). A step is one call of the jitted value_and_grad (all gradients are "
          "outputs of the program, so none is dead code); the scratch is donated and threaded from step "
          "to step. Peer: the same stack of transformers Qwen3MoeSparseMoeBlocks with torch's grouped_mm, "
          f"eager loss.backward(), CUDA events over {STEPS} steps after {WARMUP_STEPS} warm-up steps, in "
          "its own process. Every model routes like the peer (softmax top-k, renormalised, no shared "
          "expert), so both sides do the same work. Roofline per layer = max(3 x forward GEMM FLOPs / "
          "dense jnp.dot rate, (weights read twice + weight gradients written) / copy rate), both rates "
          "measured in the same run.")


def flops_per_layer(model: ModelShape, tokens: int) -> float:
    """Forward + backward GEMM FLOPs of one layer: 3 x 2 * T * k * H * 3F."""
    return 3 * 2 * tokens * model.top_k * model.hidden_size * 3 * model.ffn_size


def weight_bytes_per_layer(model: ModelShape, tokens: int) -> float:
    """Bytes of expert weights a training step must move per layer: read twice, gradient written once."""
    active = model.num_experts * (1 - (1 - model.top_k / model.num_experts) ** tokens)
    return 3 * active * 3 * model.hidden_size * model.ffn_size * 2


def train_layers(model: ModelShape, limit_bytes: float | None) -> int:
    """L of the model's training stack: LAYERS' count, fewer where the params and their gradients
    would not fit the card (``layers_that_fit``), down to one: an 80 GB H100 holds one DeepSeek-V3
    layer and its gradients (45 GB), not two."""
    return model.layers_that_fit(LAYERS.get(model.name, 2), limit_bytes, copies=TRAIN_COPIES, least=1)


def run_peer(model: ModelShape, tokens: int, layers: int) -> dict:
    """The PyTorch peer in a subprocess: its JSON result, or {"error": ...}."""
    return torch_peer.run_in_process(model, layers, (tokens,), STEPS, WARMUP_STEPS, PEER_TIMEOUT_S)


def _peak_bytes(compiled) -> int | None:
    try:
        return memory_stats(compiled)["total_bytes"]
    except Exception:  # not every backend reports it; a diagnostic only
        return None


def _loss(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def measure_jax(model: ModelShape, tokens: int, layers: int, params, x, impl: str) -> dict:
    config = model.config(tokens, real_routing=False)
    row = {"impl": impl}
    if impl == "jax_moe":
        def loss(p, x, s):
            y, s = jax_moe.moe_stack(p, x, s)
            return _loss(y), s
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
        scratch = jax_moe.init_scratch(config)
        compiled = step.lower(params, x, scratch).compile()

        def call(s, p, x):  # the gradients are outputs of the same executable: done when the scratch is
            return compiled(p, x, s)[0][1]
        state = scratch
    else:
        step = jax.jit(jax.value_and_grad(lambda p, x: _loss(baseline.baseline_moe_stack(p, x, config)),
                                          argnums=(0, 1)))
        compiled = step.lower(params, x).compile()

        def call(_, p, x):  # the outputs themselves are the state the timer waits for
            return compiled(p, x)
        state = None
    row["peak_bytes"] = _peak_bytes(compiled)
    row["hlo_buffer_copies"] = timing.buffer_copies(compiled)
    measured, _ = timing.step_seconds(call, state, params, x)
    row["step_us"] = measured["back_to_back_s"] * 1e6
    row["step_us_latency"] = measured["latency_s"] * 1e6
    row["us_per_layer"] = row["step_us"] / layers
    return row


def dense_rate_tflops(clock) -> float | None:
    """bf16 TFLOP/s of a dense 8192^3 jnp.dot in a jitted loop: the compute ceiling of the roofline."""
    n = 8192 if jax.default_backend() == "gpu" else 256  # CPU: a smoke test of the harness only
    try:
        a = jax.random.normal(jax.random.key(0), (n, n), ROW_DTYPE)

        @jax.jit
        def loop(a):
            def body(_, acc):
                return jnp.dot(lax.optimization_barrier(acc), a, preferred_element_type=jnp.float32).astype(a.dtype)
            return lax.fori_loop(0, 10, body, a)
        jax.block_until_ready(loop(a))
        start = time.perf_counter()
        jax.block_until_ready(loop(a))
        return 10 * 2 * n ** 3 / (time.perf_counter() - start) / 1e12
    except Exception as e:
        clock.log(f"dense rate: {timing.describe_error(e)}")
        return None


def run(models: list[ModelShape], token_counts, clock, compile_threads, *, time_limit_s=None, on_rows=None,
        with_peer: bool = True):
    del compile_threads  # one large program per case
    from jax_moe.bench import gemm_suite
    from jax_moe.bench.stack_suite import init_stack_params
    notes, rows = [METHOD], []
    cases = [(m, t) for m in models for t in token_counts]
    # One L per model for both sides, from this process's allocator limit (the peer's card is the same).
    layers_of, capped = stack_counts(models, train_layers, timing.card_bytes(), held=" and as much of gradients")
    notes += capped
    peers = {}
    if with_peer:  # first, while this process holds none of the card's memory
        for model, tokens in cases:
            if clock.out_of_time(time_limit_s, notes, f"peer {model.name} T={tokens}"):
                break
            peers[(model.name, tokens)] = run_peer(model, tokens, layers_of[model.name])
            clock.log(f"peer {model.name} T={tokens}: {peers[(model.name, tokens)]}")
    else:
        notes.append("peer: not run (--no-peer)")
    dense, copy = dense_rate_tflops(clock), gemm_suite.copy_ceiling_gbs(clock)
    notes.append(f"dense jnp.dot: {dense:.0f} TFLOP/s" if dense else "dense rate: not measured")
    notes.append(f"copy: {copy:.0f} GB/s" if copy else "copy rate: not measured")
    for model in models:
        layers = layers_of[model.name]
        params = None
        for tokens in token_counts:
            if clock.out_of_time(time_limit_s, notes, f"train {model.name} T={tokens}"):
                break
            base = {"model": model.name, "label": model.label, "E": model.num_experts, "k": model.top_k,
                    "H": model.hidden_size, "F": model.ffn_size, "layers": layers, "T": tokens,
                    "flops_per_layer": flops_per_layer(model, tokens),
                    "weight_bytes_per_layer": weight_bytes_per_layer(model, tokens)}
            if dense and copy:
                base["roofline_us"] = max(base["flops_per_layer"] / (dense * 1e6),
                                          base["weight_bytes_per_layer"] / (copy * 1e3))
            if params is None:
                params = init_stack_params(jax.random.key(0), model.config(max(token_counts), real_routing=False),
                                           layers, model.ffn_size)
            x = jax.random.normal(jax.random.key(tokens), (tokens, model.hidden_size), ROW_DTYPE)
            impls = ["jax_moe"]
            if tokens * model.top_k * model.num_experts <= BASELINE_MAX_ROWS_X_EXPERTS:
                impls.append("baseline")
            else:
                notes.append(f"{model.name} T={tokens}: pure-JAX baseline not run (ragged_dot's weight gradient "
                             f"is a dense [rows, E, H] tensor; rows x E > {BASELINE_MAX_ROWS_X_EXPERTS})")
            for impl in impls:
                try:  # a case that does not compile or runs out of memory is recorded, the run goes on
                    row = _derive({**base, **measure_jax(model, tokens, layers, params, x, impl)})
                except Exception as e:
                    row = {**base, "impl": impl, "error": timing.describe_error(e)}
                rows.append(row)
                clock.log(f"train {model.name} T={tokens} {impl}: "
                          + (f"{row['us_per_layer']:.0f} us/layer" if "us_per_layer" in row else row["error"]))
            peer = peers.get((model.name, tokens))
            if peer is not None:
                rows.append(_derive({**base, **peer, "impl": "torch+hf grouped_mm"}))
            if on_rows:
                on_rows(rows, notes)
        del params
    return rows, notes


def _derive(row: dict) -> dict:
    if row.get("us_per_layer"):
        row["tflops"] = row["flops_per_layer"] / row["us_per_layer"] / 1e6
        if row.get("roofline_us"):
            row["roofline_pct"] = 100 * row["roofline_us"] / row["us_per_layer"]
    return row


def table(rows: list[dict]) -> str:
    from jax_moe.bench.report import table as md_table
    lines = []
    keys = sorted({(r["model"], r["T"]) for r in rows},
                  key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9, k[1]))
    for model, tokens in keys:
        by = {r["impl"]: r for r in rows if (r["model"], r["T"]) == (model, tokens)}
        ours, base, peer = by.get("jax_moe", {}), by.get("baseline", {}), by.get("torch+hf grouped_mm", {})
        us = lambda r: f"{r['us_per_layer']:,.0f}" if r.get("us_per_layer") else ("failed" if r else "–")
        gib = lambda r: f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "–"
        speedup = (f"{peer['us_per_layer'] / ours['us_per_layer']:.2f}x"
                   if ours.get("us_per_layer") and peer.get("us_per_layer") else "–")
        lines.append([model, str(tokens), str(ours.get("layers", "")), us(ours), us(base), us(peer), speedup,
                      f"{ours['tflops']:.0f}" if ours.get("tflops") else "–",
                      f"{ours['roofline_us']:,.0f}" if ours.get("roofline_us") else "–",
                      f"{ours['roofline_pct']:.0f}%" if ours.get("roofline_pct") else "–",
                      gib(ours), gib(peer)])
    return md_table(["model", "T", "L", "jax_moe µs/layer", "pure JAX µs/layer", "PyTorch+HF µs/layer",
                     "speed-up vs PyTorch", "jax_moe TFLOP/s", "roofline µs", "jax_moe % roofline",
                     "jax_moe peak GiB", "PyTorch peak GiB"], lines)


def markdown(record: dict) -> str:
    from jax_moe.bench.report import header_block
    lines = header_block("Training step (suite train)", record["meta"], record.get("elapsed_s", 0.0),
                         record["method"], record["notes"])
    errors = [f"- {r['model']} T={r['T']} {r['impl']}: {r['error']}" for r in record["rows"] if r.get("error")]
    return "\n".join(lines) + "\n\n" + table(record["rows"]) + "\n" + ("\n" + "\n".join(errors) + "\n" if errors else "")
