"""Where a MoE stack step's GPU time goes, kernel by kernel (run by hand on the GPU machine).

    python3 tests/profile_gpu.py OUT_DIR [--model qwen3_30b] [--layers 4] [infer1 infer16 infer4096 train4096]

Each case is ``infer<T>`` (``moe_stack``'s inference step at T tokens, the scratch donated) or ``train<T>``
(its ``value_and_grad`` step): an L-layer stack of the model's shapes (``jax_moe.bench.models``), compiled
and warmed up, then three steps traced by ``jax.profiler`` (perfetto JSON). Printed and written to
OUT_DIR/profile.json per case: the plan, each kernel's launches and µs per layer (sorted by time), their
sum per layer, and the span of the device's events per layer (span minus sum: the gaps between launches,
and between the three steps, which the host dispatches one after another). Without a GPU the trace has
no device events: the cases still run and report none (tests/test_sanitize_script.py runs it on CPU).
"""

import argparse
import collections
import glob
import gzip
import json
import os

import jax

import jax_moe
from jax_moe.bench import train_suite
from jax_moe.bench.models import MODELS

STEPS = 3  # traced steps per case


def step_fn(params, x, config, training: bool):
    """``(run, scratch)``: ``run(scratch) -> (result, scratch)``, one donated step of the stack (result is all
    it returns; training: the train suite's loss and step), and the first scratch."""
    if training:
        loss, scratch = train_suite.jax_moe_loss(config)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
        scratch_of = lambda result: result[0][1]  # noqa: E731  ((loss, scratch), grads)
    else:
        step, scratch = jax.jit(jax_moe.moe_stack, donate_argnums=2), jax_moe.init_scratch(config)
        scratch_of = lambda result: result[1]  # noqa: E731  (y, scratch)

    def run(scratch):
        result = step(params, x, scratch)
        return result, scratch_of(result)
    return run, scratch


def device_kernels(trace_dir: str):
    """The device's events of the trace under ``trace_dir``: [(name, start µs, duration µs)]."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [(e["name"], e["ts"], e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("dur") and "GPU" in processes.get(e.get("pid"), "")]


def profile(model, case: str, layers: int, out_dir: str) -> dict:
    training, tokens = case.startswith("train"), int(case.removeprefix("train").removeprefix("infer"))
    config = model.config(tokens)
    params = jax_moe.init_moe_params(jax.random.key(0), config, layers, model.ffn_size, **model.param_options())
    x = jax.random.normal(jax.random.key(1), (tokens, model.hidden_size), config.dtype)
    run, scratch = step_fn(params, x, config, training)
    plan = jax_moe.plan_layer(config, tokens, jax.tree.map(lambda a: a[0], params), training=training)
    for _ in range(2):
        result, scratch = run(scratch)
    jax.block_until_ready(result)
    trace_dir = os.path.join(out_dir, f"trace_{case}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(STEPS):
            result, scratch = run(scratch)
        jax.block_until_ready(result)
    kernels = device_kernels(trace_dir)
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for name, _, duration in kernels:
        per_name[name][0] += 1
        per_name[name][1] += duration
    per_layer = STEPS * layers
    span = max((t + d for _, t, d in kernels), default=0) - min((t for _, t, _ in kernels), default=0)
    return {"plan": str(plan), "layers": layers, "launches_per_layer": len(kernels) / per_layer,
            "kernel_us_per_layer": sum(d for _, _, d in kernels) / per_layer, "span_us_per_layer": span / per_layer,
            "kernels": sorted(([n, c / per_layer, d / per_layer] for n, (c, d) in per_name.items()),
                              key=lambda row: -row[2])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("cases", nargs="*", default=["infer1", "infer16", "infer4096", "train4096"])
    parser.add_argument("--model", default="qwen3_30b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_intermixed_args(argv)
    report = {"device": jax.devices()[0].device_kind, "model": args.model, "cases": {}}
    for case in args.cases:
        report["cases"][case] = result = profile(MODELS[args.model], case, args.layers, args.out_dir)
        print(f"== {case}: {result['plan']}\n   {result['kernel_us_per_layer']:.1f} us of kernels a layer in a span "
              f"of {result['span_us_per_layer']:.1f}, {result['launches_per_layer']:.1f} launches a layer", flush=True)
        for name, count, us in result["kernels"][:16]:
            print(f"   {us:8.1f} us  x{count:4.1f}  {name[:100]}")
    with open(os.path.join(args.out_dir, "profile.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
