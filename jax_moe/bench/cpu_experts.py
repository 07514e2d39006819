"""The experts on CPU: ``moe_layer`` with ``gemm.grouped_dot``'s kernel against XLA:CPU's ragged_dot.

``python -m jax_moe.bench.cpu_experts [--out DIR] [--repeats N] [--quick]`` (a CPU; about five
minutes on two cores). Writes ``cpu_experts.json`` and ``.md`` with the command.

Per case, in one process: a jitted ``moe_layer`` forward, and forward + backward (the
gradients of every param and of x, all consumed: ``timing.consume_all``), with the default experts
on ``grouped_dot`` (the C++ kernel) and on ``jax.lax.ragged_dot`` (the path before it, swapped in
for ``gemm.grouped_dot``), and two floors: XLA:CPU's dense dots doing the layer's useful expert
arithmetic (the routed rows [T·k, H] by [H, 2F] and [T·k, F] by [F, H]; three times that work for
forward + backward), and XLA:CPU reading every expert's weights once (a sum over them; twice for
forward + backward, which reads them and writes their gradients). % of floor = the larger floor /
the time. Times are medians of single calls, dispatch to ``block_until_ready``.

FP8 experts (``jax_moe.fp8.quantize_params``: e4m3 weights with 128 x 128 block scales), whose CPU
math is ``gemm.fp8_swiglu_dequantized``: the same layer's forward, and forward + backward (the
gradients of x and of the router; FP8 weights are constants), with the kernel reading the FP8 weights
in place (``gemm._dequantized_grouped_dot``) and with the path before it (a float32 copy of the
dequantised experts, then ``grouped_dot``), with each compiled program's temporary bytes (XLA's
memory analysis), the copy's included.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import fp8, gemm
from jax_moe.bench import timing

# (name, E, k, H, F, T, dtype): a coarse (Mixtral-like) and two fine-grained (Qwen3-, DeepSeek-like)
# layers at widths a notebook on a laptop runs.
CASES = (
    ("coarse E8 k2", 8, 2, 512, 1024, 256, "float32"),
    ("coarse E8 k2", 8, 2, 512, 1024, 256, "bfloat16"),
    ("fine E64 k8", 64, 8, 512, 256, 128, "bfloat16"),
    ("fine E128 k8", 128, 8, 512, 256, 128, "float32"),
    ("fine E128 k8", 128, 8, 512, 256, 128, "bfloat16"),
)

# (name, E, k, H, F, T): bf16 activations, FP8 experts (H and F multiples of 128).
FP8_CASES = (
    ("coarse E8 k2", 8, 2, 512, 1024, 256),
    ("fine E128 k8", 128, 8, 512, 256, 128),
)


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _ragged_dot(rows, weights, group_sizes, *, preferred_element_type=None):
    return lax.ragged_dot(rows, weights, group_sizes, preferred_element_type=preferred_element_type)


def measure(num_experts, top_k, hidden, ffn, tokens, dtype, repeats: int) -> dict:
    dtype = jnp.dtype(dtype)
    config = jax_moe.MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, max_tokens=tokens,
                               dtype=dtype)
    params = jax.tree.map(lambda a: a[0], jax_moe.init_moe_params(jax.random.key(0), config, 1, ffn))
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), dtype)
    scratch = jax_moe.init_scratch(config)

    def forward(p, x, s):
        return jax_moe.moe_layer(p, x, s)[0]

    def forward_backward(p, x, s):
        grads = jax.grad(lambda p, x: jnp.sum(jax_moe.moe_layer(p, x, s)[0].astype(jnp.float32)),
                         argnums=(0, 1))(p, x)
        return timing.consume_all(grads)

    result = {}
    kernel = gemm.grouped_dot
    for path, dot in (("kernel", kernel), ("ragged_dot", _ragged_dot)):
        gemm.grouped_dot = dot  # swiglu_experts calls it through the module
        jax.clear_caches()  # no trace of the other path is reused
        try:
            result[f"forward_{path}_ms"] = 1e3 * _median_seconds(jax.jit(forward), params, x, scratch, repeats=repeats)
            result[f"train_{path}_ms"] = 1e3 * _median_seconds(jax.jit(forward_backward), params, x, scratch,
                                                               repeats=repeats)
        finally:
            gemm.grouped_dot = kernel
            jax.clear_caches()
    rows = tokens * top_k
    a = jax.random.normal(jax.random.key(2), (rows, hidden), dtype)
    h = jax.random.normal(jax.random.key(3), (rows, ffn), dtype)

    def dense(a, h, gate_up, down):
        return (jnp.dot(a, gate_up, preferred_element_type=jnp.float32),
                jnp.dot(h, down, preferred_element_type=jnp.float32))

    def read(gate_up, down):
        return jnp.sum(gate_up, dtype=jnp.float32), jnp.sum(down, dtype=jnp.float32)

    floor = 1e3 * _median_seconds(jax.jit(dense), a, h, params["gate_up"][0], params["down"][0], repeats=repeats)
    read_ms = 1e3 * _median_seconds(jax.jit(read), params["gate_up"], params["down"], repeats=repeats)
    result.update(dense_floor_forward_ms=floor, dense_floor_train_ms=3 * floor, weight_read_ms=read_ms,
                  floor_forward_ms=max(floor, read_ms), floor_train_ms=max(3 * floor, 2 * read_ms),
                  expert_gflop_forward=2 * rows * hidden * 3 * ffn / 1e9)
    result["forward_speedup"] = result["forward_ragged_dot_ms"] / result["forward_kernel_ms"]
    result["train_speedup"] = result["train_ragged_dot_ms"] / result["train_kernel_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def measure_fp8(num_experts, top_k, hidden, ffn, tokens, repeats: int) -> dict:
    config = jax_moe.MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, max_tokens=tokens,
                               dtype=jnp.bfloat16)
    params = jax.tree.map(lambda a: a[0], jax_moe.init_moe_params(jax.random.key(0), config, 1, ffn))
    params = fp8.quantize_params(params)
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.bfloat16)
    scratch = jax_moe.init_scratch(config)

    def forward(p, x, s):
        return jax_moe.moe_layer(p, x, s)[0]

    def forward_backward(p, x, s):
        loss = lambda router, x: jnp.sum(jax_moe.moe_layer(dict(p, router=router), x, s)[0].astype(jnp.float32))
        return timing.consume_all(jax.grad(loss, argnums=(0, 1))(p["router"], x))

    result = {"expert_fp8_mb": sum(p.nbytes for name, p in params.items() if name in fp8.QUANTIZED_NAMES) / 1e6}
    in_place = gemm._dequantized_grouped_dot
    for path, product in (("kernel", in_place), ("copy", gemm._xla_dequantized_grouped_dot)):
        gemm._dequantized_grouped_dot = product  # fp8_dequantized_matmul calls it through the module
        jax.clear_caches()
        try:
            for step, fn in (("forward", forward), ("train", forward_backward)):
                jitted = jax.jit(fn)
                result[f"{step}_{path}_ms"] = 1e3 * _median_seconds(jitted, params, x, scratch, repeats=repeats)
                memory = jitted.lower(params, x, scratch).compile().memory_analysis()
                result[f"{step}_{path}_temp_mb"] = memory.temp_size_in_bytes / 1e6
        finally:
            gemm._dequantized_grouped_dot = in_place
            jax.clear_caches()
    result["forward_speedup"] = result["forward_copy_ms"] / result["forward_kernel_ms"]
    result["train_speedup"] = result["train_copy_ms"] / result["train_kernel_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def markdown(record: dict) -> str:
    lines = [
        "# The experts on CPU: `gemm.grouped_dot`'s kernel against XLA:CPU's `ragged_dot`",
        "",
        f"- command: `{record['command']}`",
        f"- machine: {record['machine']}",
        f"- method: {__doc__.split(chr(10) + chr(10))[2].replace(chr(10), ' ')}",
        "",
        "ms per call (median). Floors: XLA:CPU's dense dots of the same useful expert FLOPs, and its read of "
        "every expert's weights; % = the larger floor / time.",
        "",
        "| layer (E, k, H, F, T) | dtype | fwd: ragged_dot | fwd: kernel | speedup | floors: dots, read "
        "| fwd % of floor | fwd+bwd: ragged_dot | fwd+bwd: kernel | speedup | fwd+bwd % of floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['name']} ({row['E']}, {row['k']}, {row['H']}, {row['F']}, {row['T']}) | {row['dtype']} "
            f"| {row['forward_ragged_dot_ms']:.1f} | {row['forward_kernel_ms']:.1f} | {row['forward_speedup']:.1f}x "
            f"| {row['dense_floor_forward_ms']:.1f}, {row['weight_read_ms']:.1f} "
            f"| {100 * row['floor_forward_ms'] / row['forward_kernel_ms']:.0f} % "
            f"| {row['train_ragged_dot_ms']:.1f} | {row['train_kernel_ms']:.1f} | {row['train_speedup']:.1f}x "
            f"| {100 * row['floor_train_ms'] / row['train_kernel_ms']:.0f} % |")
    if record.get("fp8_rows"):
        lines += [
            "",
            f"- FP8 method: {__doc__.split(chr(10) + chr(10))[3].replace(chr(10), ' ')}",
            "",
            "FP8 experts (bf16 activations): ms per call (median) and the compiled program's temporaries (MB), "
            "the FP8 weights read in place by the kernel vs a float32 copy of them dequantised first.",
            "",
            "| layer (E, k, H, F, T) | FP8 experts MB | fwd: copy | fwd: in place | speedup | fwd temp MB: copy, "
            "in place | fwd+bwd: copy | fwd+bwd: in place | speedup | fwd+bwd temp MB: copy, in place |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in record["fp8_rows"]:
            lines.append(
                f"| {row['name']} ({row['E']}, {row['k']}, {row['H']}, {row['F']}, {row['T']}) "
                f"| {row['expert_fp8_mb']:.1f} | {row['forward_copy_ms']:.1f} | {row['forward_kernel_ms']:.1f} "
                f"| {row['forward_speedup']:.1f}x "
                f"| {row['forward_copy_temp_mb']:.1f}, {row['forward_kernel_temp_mb']:.1f} "
                f"| {row['train_copy_ms']:.1f} | {row['train_kernel_ms']:.1f} | {row['train_speedup']:.1f}x "
                f"| {row['train_copy_temp_mb']:.1f}, {row['train_kernel_temp_mb']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench.cpu_experts", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="notebooks/results", help="output folder (default notebooks/results)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (default 5)")
    parser.add_argument("--quick", action="store_true", help="the first case of each table only")
    args = parser.parse_args(argv)
    if jax.default_backend() != "cpu":
        parser.error(f"expected JAX's default backend to be cpu, got {jax.default_backend()} "
                     "(JAX_PLATFORMS=cpu selects it)")
    cases, fp8_cases = (CASES[:1], FP8_CASES[:1]) if args.quick else (CASES, FP8_CASES)
    record = {"command": "python -m jax_moe.bench.cpu_experts " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}",
              "rows": [], "fp8_rows": []}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, e, k, h, f, t, dtype in cases:
        row = {"name": name, "E": e, "k": k, "H": h, "F": f, "T": t, "dtype": dtype,
               **measure(e, k, h, f, t, dtype, args.repeats)}
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        (out / "cpu_experts.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / "cpu_experts.md").write_text(markdown(record))
    for name, e, k, h, f, t in fp8_cases:
        row = {"name": name, "E": e, "k": k, "H": h, "F": f, "T": t, **measure_fp8(e, k, h, f, t, args.repeats)}
        print(json.dumps(row), flush=True)
        record["fp8_rows"].append(row)
        (out / "cpu_experts.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / "cpu_experts.md").write_text(markdown(record))
    return record


if __name__ == "__main__":
    main()
