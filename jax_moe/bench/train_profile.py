"""Where one training step of the MoE stack spends its device time, kernel by kernel.

Compiles and warms up the jitted value_and_grad step, then traces ``--steps`` steps with the JAX
profiler (CUPTI) and prints the device time of each kernel name, largest first, with its share:

    python -m jax_moe.bench.train_profile --model qwen3_30b --tokens 4096 --layers 1
    python -m jax_moe.bench.train_profile --forward --model qwen3_30b --tokens 1 --layers 4   (decode)
    python -m jax_moe.bench.train_profile --forward --fp8 --model deepseek_v3 --tokens 1   (FP8 experts)
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile


def kernel_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int]]:
    """µs and launches per kernel name from a perfetto trace the profiler wrote under trace_dir."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    # Device lanes are the processes whose name mentions the GPU ("/device:GPU:0 ...").
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    totals, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            totals[e["name"]] += float(e["dur"])
            counts[e["name"]] += 1
    return dict(totals), dict(counts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench.train_profile")
    parser.add_argument("--model", default="qwen3_30b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--forward", action="store_true",
                        help="a decode step instead: the stack's forward alone, the model's own routing")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 experts (as the stack suite draws them; inference: use with --forward)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jax_moe
    from jax_moe.bench.models import MODELS, ROW_DTYPE
    from jax_moe.bench.stack_suite import init_stack_params

    model = MODELS[args.model]
    # Training routes as the train suite runs it (like its peer); a decode step by the model's own.
    config = model.config(args.tokens, real_routing=args.forward)
    options = model.param_options() if args.forward else {}
    params = init_stack_params(jax.random.key(0), config, args.layers, model.ffn_size, fp8=args.fp8, **options)
    x = jax.random.normal(jax.random.key(1), (args.tokens, model.hidden_size), ROW_DTYPE)

    if args.forward:
        step = jax.jit(lambda p, x, s: jax_moe.moe_stack(p, x, s), donate_argnums=2)
    else:
        def loss(p, x, s):
            y, s = jax_moe.moe_stack(p, x, s)
            return jnp.mean(jnp.square(y.astype(jnp.float32))), s

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
    def run_step(scratch):
        """``(outputs, scratch)``: y, or every gradient."""
        if args.forward:
            return step(params, x, scratch)
        (_, scratch), grads = step(params, x, scratch)
        return grads, scratch

    scratch = jax_moe.init_scratch(config)
    for _ in range(2):
        out, scratch = run_step(scratch)
    jax.block_until_ready((scratch, out))
    trace_dir = tempfile.mkdtemp(prefix="jax_moe_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            out, scratch = run_step(scratch)
        jax.block_until_ready((scratch, out))
    totals, counts = kernel_times(trace_dir)
    total = sum(totals.values())
    per = args.steps * args.layers
    print(f"{model.label} T={args.tokens} L={args.layers}: {total / per:.1f} us of kernels and "
          f"{sum(counts.values()) / per:.1f} kernel launches per layer and step ({args.steps} steps)")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / per:9.1f} us {100 * us / total:5.1f}% x{counts[name] / per:4.1f}  {name[:150]}")


if __name__ == "__main__":
    main()
