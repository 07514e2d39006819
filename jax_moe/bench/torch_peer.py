"""The PyTorch + Hugging Face peer of the train suite, run in its own process (DESIGN.md §7b).

L transformers ``Qwen3MoeSparseMoeBlock``s with the model's E, k, H, F and torch's grouped GEMM
(``config._experts_implementation = "grouped_mm"``), in the same pre-norm residual stack as
``jax_moe.moe_stack`` (``x = x + block(rms_norm(x))``), bf16; one training step is
``loss = mean(y.float() ** 2); loss.backward()`` eager, gradients set to None between steps.
Prints one JSON object: µs per step and per layer (CUDA events over back-to-back steps after
warm-up) and ``torch.cuda.max_memory_allocated``, or ``{"error": ...}``. With ``--decode``: the
forward alone at each T, captured in one CUDA graph and replayed (``{"results": [...]}``). Run as a script, not as a
module of the package: importing jax_moe would start JAX in the peer's process (two allocators on
one card give false out-of-memory errors).

    python jax_moe/bench/torch_peer.py --experts 128 --top-k 8 --hidden 2048 --ffn 768 --tokens 4096 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys


def run_in_process(shape, layers: int, tokens, steps: int, warmup: int, timeout_s: float,
                   decode: bool = False) -> dict:
    """This script in a child process (JAX kept off the card there), for the suites' processes.

    shape: anything with num_experts, top_k, hidden_size, ffn_size (a bench ModelShape).
    Returns the script's JSON object, or ``{"error": ...}`` when it timed out or printed none.
    """
    command = [sys.executable, str(pathlib.Path(__file__)), "--experts", str(shape.num_experts), "--top-k",
               str(shape.top_k), "--hidden", str(shape.hidden_size), "--ffn", str(shape.ffn_size),
               "--layers", str(layers), "--steps", str(steps), "--warmup", str(warmup),
               "--tokens", *map(str, tokens)] + (["--decode"] if decode else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout_s} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"peer exited {done.returncode}: {tail}"[:400]}
    return json.loads(lines[-1])


def _stack(shape, num_layers: int):
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    # transformers 5 names the expert count num_experts in some versions and num_local_experts in
    # others: give both.
    config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.ffn,
                            num_experts=shape.experts, num_local_experts=shape.experts,
                            num_experts_per_tok=shape.top_k, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    blocks = torch.nn.ModuleList([Qwen3MoeSparseMoeBlock(config) for _ in range(num_layers)])
    for p in blocks.parameters():  # the same scale as jax_moe.init_moe_params: N(0, 1/fan_in)
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return blocks


def _forward(blocks, x):
    import torch
    for block in blocks:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        out = block(h[None])  # the block takes [batch, sequence, H]
        x = x + (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    return x


def measure(shape, tokens: int, layers: int, steps: int, warmup: int) -> dict:
    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        blocks = _stack(shape, layers)
        x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def step():
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        loss = _forward(blocks, x).float().pow(2).mean()
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 1e3 / steps
    return {"impl": "torch+hf grouped_mm", "T": tokens, "layers": layers,
            "step_us": step_us, "us_per_layer": step_us / layers,
            "peak_bytes": int(torch.cuda.max_memory_allocated()), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def measure_decode(shape, token_counts, layers: int, steps: int, warmup: int) -> list[dict]:
    """The forward alone at each T, captured once per T in a CUDA graph and replayed (a serving loop)."""
    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        blocks = _stack(shape, layers)
    results = []
    for tokens in token_counts:
        try:
            with torch.no_grad():
                x = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
                side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch asks
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        _forward(blocks, x)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _forward(blocks, x)
                for _ in range(warmup):
                    graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(steps):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
            step_us = start.elapsed_time(end) * 1e3 / steps
            results.append({"impl": "torch+hf grouped_mm, CUDA graph", "T": tokens, "layers": layers,
                            "step_us": step_us, "us_per_layer": step_us / layers})
        except Exception as e:  # one T failing (capture, memory) must not lose the others
            results.append({"T": tokens, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python jax_moe/bench/torch_peer.py")
    for name in ("--experts", "--top-k", "--hidden", "--ffn"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True,
                        help="one T for a training step; several with --decode")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode", action="store_true",
                        help="time the forward alone in a CUDA graph at each T (a list of results)")
    args = parser.parse_args(argv)
    try:
        if args.decode:
            result = {"results": measure_decode(args, args.tokens, args.layers, args.steps, args.warmup)}
        else:
            result = measure(args, args.tokens[0], args.layers, args.steps, args.warmup)
    except Exception as e:  # reported to the parent: torch or transformers missing, out of memory
        result = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
