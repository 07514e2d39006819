"""FP8 SwiGLU experts at decode sizes, per call: the FP8 decode kernel against CUTLASS's FP8 path.

``python -m jax_moe.bench.fp8_decode_probe --out FILE.json [--cases deepseek_v3:1,qwen3_30b:16]
[--experts N]`` (a GPU): one ``gemm.fp8_swiglu_forward`` per path (``decode_rows`` 0, 8 and, from 3
rows per expert, 16; ``decode8_bound``: 8 with ``group_rows``, the rows staged a pass bounded by
what one expert can own) on randomly routed top-k rows, kernel time per call from a profiler trace
(CUPTI), and what ``gemm.fp8_decode_rows`` picks. A case is MODEL:T, or ``ds_shared:T`` for
DeepSeek-V3's shared expert (one group of T rows). Weights are rotated over 4 copies where one set
is under 4 GB, so the reads come from HBM, not L2. ``--experts N`` keeps N experts (at least the
rows' top-k): the same active experts and grid, little memory (ncu's kernel replay saves it all).
The measurement behind ``gemm.fp8_decode_rows``: notebooks/results/fp8_decode_kernel_h200.md.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp

from jax_moe import MoEConfig, fp8, gemm
from jax_moe.bench import gemm_suite
from jax_moe.bench.models import MODELS
from jax_moe.bench.train_profile import kernel_times

CASES = ([("deepseek_v3", t) for t in (1, 2, 4, 16, 64)] + [("qwen3_30b", t) for t in (1, 2, 16, 64, 128)]
         + [("qwen35_397b", t) for t in (1, 16)] + [("mixtral", 1)] + [("ds_shared", t) for t in (1, 4, 8, 16, 32)])
REPS = 16
ROTATE_BELOW_BYTES = 4e9


def parse_cases(text: str | None) -> list[tuple[str, int]]:
    """``"model:T,..."`` -> [(model, T)]; None -> CASES. Unknown models are a ValueError."""
    if text is None:
        return list(CASES)
    cases = []
    for item in text.split(","):
        name, _, tokens = item.partition(":")
        if name != "ds_shared" and name not in MODELS or not tokens.isdigit() or int(tokens) < 1:
            raise ValueError(f"fp8_decode_probe: --cases: expected MODEL:T with MODEL one of "
                             f"{sorted(MODELS) + ['ds_shared']} and T >= 1, got {item!r}")
        cases.append((name, int(tokens)))
    return cases


def kernel_us(fn, operand_sets, reps: int = REPS) -> list:
    """``[µs of kernels per call, {kernel: µs}]`` of fn over the operand sets in turn (2 warm-up calls)."""
    for operands in operand_sets[:2]:
        y = fn(*operands)
    jax.block_until_ready(y)
    trace = tempfile.mkdtemp()
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    for i in range(reps):
        y = fn(*operand_sets[i % len(operand_sets)])
    jax.block_until_ready(y)
    jax.profiler.stop_trace()
    totals, _ = kernel_times(trace)
    return [round(sum(totals.values()) / reps, 1), {k[:64]: round(v / reps, 1) for k, v in totals.items()}]


def _config(name: str, tokens: int, experts: int | None) -> tuple[MoEConfig, int, int]:
    """(config, H, F) of a case; ``experts`` caps the expert count (at least top-k)."""
    if name == "ds_shared":
        m = MODELS["deepseek_v3"]
        return MoEConfig(num_experts=1, top_k=1, hidden_size=m.hidden_size, max_tokens=tokens), m.hidden_size, m.ffn_size
    m = MODELS[name]
    config = m.config(tokens, real_routing=experts is None)
    if experts is not None:
        config = MoEConfig(num_experts=max(experts, m.top_k), top_k=m.top_k, hidden_size=m.hidden_size,
                           max_tokens=tokens)
    return config, m.hidden_size, m.ffn_size


def measure(name: str, tokens: int, experts: int | None = None) -> dict:
    """One case: sizes, the rows an owning expert expects, ``fp8_decode_rows``' pick, and per path
    ``[µs per call, {kernel: µs}]`` (or the error)."""
    config, hidden, ffn = _config(name, tokens, experts)
    num_local = config.num_local_experts
    scratch, _ = gemm_suite._routed_scratch(config, tokens, jax.random.key(tokens))
    live = config.live_row_bound(tokens)
    copies = 4 if num_local * 3 * hidden * ffn < ROTATE_BELOW_BYTES else 1
    weight_sets = []
    for key in jax.random.split(jax.random.key(1), copies):
        def draw(key, shape):  # e4m3 values of a unit-variance draw, one scale per block
            q = (jax.random.normal(key, shape, jnp.bfloat16) * 64).astype(fp8.FP8)
            blocks = (shape[0], fp8.num_blocks(shape[1]), fp8.num_blocks(shape[2]))
            return q, jnp.full(blocks, 1 / (64 * shape[2] ** 0.5), jnp.float32)
        gate_up = jax.jit(draw, static_argnums=1)(key, (num_local, 2 * ffn, hidden))
        down = jax.jit(draw, static_argnums=1)(jax.random.fold_in(key, 1), (num_local, hidden, ffn))
        weight_sets.append((*gate_up, *down))
    expected = gemm.expected_rows_per_expert(live, num_local)
    result = {"experts": num_local, "H": hidden, "F": ffn, "rows": live, "rows_per_expert": round(expected, 2),
              "pick": gemm.fp8_decode_rows(live, num_local, hidden, ffn)}
    bound = config.group_row_bound(tokens)
    result["group_rows"] = bound
    for label, decode_rows, group_rows in (("cutlass", 0, None), ("decode8", 8, None), ("decode8_bound", 8, bound),
                                           ("decode16", 16, None)):
        if decode_rows == 16 and expected < 3 or label == "decode8_bound" and bound >= 8:
            continue
        fn = jax.jit(lambda w, s, d=decode_rows, g=group_rows: gemm.fp8_swiglu_forward(
            s.permuted, *w, s.expert_offsets, s.workspace, live, decode_rows=d, group_rows=g)[0])
        try:
            result[label] = kernel_us(fn, [(w, scratch) for w in weight_sets])
        except Exception as e:  # a case that fails is reported, the others still run
            result[label] = f"{type(e).__name__}: {e}"[:300]
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench.fp8_decode_probe")
    parser.add_argument("--out", required=True, help="JSON file of the results")
    parser.add_argument("--cases", help="MODEL:T,... (default: the cases of the committed results)")
    parser.add_argument("--experts", type=int, help="keep this many experts (for ncu: little memory)")
    args = parser.parse_args(argv)
    out = {}
    for name, tokens in parse_cases(args.cases):
        out[f"{name} T{tokens}"] = measure(name, tokens, args.experts)
        print(name, tokens, json.dumps(out[f"{name} T{tokens}"]), flush=True)
        with open(args.out, "w") as f:  # after each case: a run cut short keeps what it measured
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
