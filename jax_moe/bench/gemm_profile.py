"""One model's gate/up grouped GEMM, run a few times for a profiler: ``ncu`` reads its counters.

    ncu --kernel-name regex:device_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 -m jax_moe.bench.gemm_profile --model qwen3_30b --tokens 1024

The shapes and routing are the gemm suite's (``gemm_suite.measure_gemm``). XLA's command buffers are
turned off so that each call is a plain kernel launch a profiler can replay.
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jax_moe.bench.gemm_profile")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

    import jax
    import jax.numpy as jnp

    import jax_moe
    from jax_moe.bench import gemm_suite
    from jax_moe.bench.models import MODELS

    model = MODELS[args.model]
    config = model.config(args.tokens)
    key = jax.random.key(args.tokens)
    scratch, _ = gemm_suite._routed_scratch(config, args.tokens, key)
    hidden, n = model.hidden_size, 2 * model.ffn_size
    weights = (jax.random.normal(key, (config.num_local_experts, hidden, n), jnp.float32)
               / hidden ** 0.5).astype(jnp.bfloat16)
    live = config.live_row_bound(args.tokens)
    step = jax.jit(lambda w, s: jax_moe.grouped_matmul(s.permuted, w, s, num_rows=live))
    for _ in range(args.calls):
        out, scratch = step(weights, scratch)
    jax.block_until_ready(out)
    active = int((scratch.group_sizes > 0).sum())
    print(f"{model.label} T={args.tokens}: [{args.tokens * config.top_k}, {hidden}] x [{config.num_local_experts}, "
          f"{hidden}, {n}], {active} active experts, weights read {active * hidden * n * 2 / 1e6:.0f} MB, "
          f"tile {jax_moe.gemm.TILE_NAMES[jax_moe.gemm.pick_tile(live, config.num_local_experts)]}")


if __name__ == "__main__":
    main()
