"""Where one training step of the MoE stack spends its device time, kernel by kernel.

Compiles and warms up the jitted value_and_grad step, then traces ``--steps`` steps with the JAX
profiler (CUPTI) and prints the device time of each kernel name, largest first, with its share:

    python -m jax_moe.bench.train_profile --model qwen3_30b --tokens 4096 --layers 1
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile


def kernel_times(trace_dir: str) -> dict[str, float]:
    """µs per kernel name from a perfetto trace the profiler wrote under trace_dir."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    # Device lanes are the processes whose name mentions the GPU ("/device:GPU:0 ...").
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            totals[e["name"]] += float(e["dur"])
    return dict(totals)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench.train_profile")
    parser.add_argument("--model", default="qwen3_30b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jax_moe
    from jax_moe.bench.models import MODELS, ROW_DTYPE
    from jax_moe.bench.stack_suite import init_stack_params

    model = MODELS[args.model]
    config = model.config(args.tokens, real_routing=False)  # as the train suite runs it
    params = init_stack_params(jax.random.key(0), config, args.layers, model.ffn_size)
    x = jax.random.normal(jax.random.key(1), (args.tokens, model.hidden_size), ROW_DTYPE)

    def loss(p, x, s):
        y, s = jax_moe.moe_stack(p, x, s)
        return jnp.mean(jnp.square(y.astype(jnp.float32))), s

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
    scratch = jax_moe.init_scratch(config)
    for _ in range(2):
        (_, scratch), grads = step(params, x, scratch)
    jax.block_until_ready((scratch, grads))
    trace_dir = tempfile.mkdtemp(prefix="jax_moe_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            (_, scratch), grads = step(params, x, scratch)
        jax.block_until_ready((scratch, grads))
    totals = kernel_times(trace_dir)
    total = sum(totals.values())
    print(f"{model.label} T={args.tokens} L={args.layers}: {total / args.steps / args.layers:.0f} us of kernels "
          f"per layer and step ({args.steps} steps)")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / args.steps / args.layers:9.1f} us {100 * us / total:5.1f}%  {name[:150]}")


if __name__ == "__main__":
    main()
