"""FP8 prefill GEMM: the 64- vs 128-row CUTLASS tile against bf16 jax_moe, on the gemm suite's randomly
routed gate/up rows: ``python -m jax_moe.bench.fp8_tile_probe`` (a GPU; prints one JSON line per shape).
The measurement behind ``gemm.fp8_tile_rows``: notebooks/results/bench_gemm_fp8_tiles_h200.md."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import jax_moe
from jax_moe import fp8, gemm
from jax_moe.bench import gemm_suite
from jax_moe.bench.models import MODELS

SHAPES = (("qwen3_30b", 1024), ("qwen3_30b", 4096), ("qwen3_30b", 16384),
          ("deepseek_v3", 1024), ("deepseek_v3", 4096), ("deepseek_v3", 16384))


def measure(name: str, tokens: int) -> dict:
    """µs of the FP8 GEMM per row tile and of the bf16 grouped_matmul, for one (model, T)."""
    m = MODELS[name]
    config = m.config(tokens)
    key = jax.random.key(tokens)
    scratch, _ = gemm_suite._routed_scratch(config, tokens, key)
    H, N, El = m.hidden_size, 2 * m.ffn_size, config.num_local_experts
    live = config.live_row_bound(tokens)
    q = (jax.random.normal(key, (El, N, H), jnp.bfloat16) * 64).astype(fp8.FP8)
    q_scale = jnp.full((El, N // fp8.BLOCK, H // fp8.BLOCK), 1 / (64 * H ** 0.5), jnp.float32)
    res = {"rows_per_group": round(tokens * config.top_k / El, 1), "picked": gemm.fp8_tile_rows(live, El)}
    for tile in gemm.FP8_TILE_ROWS:
        def eight(q, q_scale, s, ws, tile=tile):
            out, ws = gemm.fp8_forward(s.permuted, q, q_scale, s.expert_offsets, ws, live, tile)
            return out, (q, q_scale, s, ws)
        operands = (q, q_scale, scratch, gemm.fp8_workspace(El))
        res[f"fp8_{tile}"] = round(gemm_suite._timed(eight, operands)["s"] * 1e6, 1)
    del q
    w = jax.random.normal(key, (El, H, N), jnp.bfloat16)

    def bf16(w, s):
        out, s = jax_moe.grouped_matmul(s.permuted, w, s, num_rows=live)
        return out, (w, s)
    res["bf16"] = round(gemm_suite._timed(bf16, (w, scratch))["s"] * 1e6, 1)
    res["speedup_best"] = round(res["bf16"] / min(res[f"fp8_{t}"] for t in gemm.FP8_TILE_ROWS), 2)
    return res


def main():
    out = {}
    for name, tokens in SHAPES:
        out[f"{name} T={tokens}"] = measure(name, tokens)
        print(name, tokens, json.dumps(out[f"{name} T={tokens}"]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
