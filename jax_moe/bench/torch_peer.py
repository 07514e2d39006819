"""The PyTorch + Hugging Face peer of the train and decode suites, a script run in its own process.

L transformers ``Qwen3MoeSparseMoeBlock``s with the model's E, k, H, F and torch's grouped GEMM
(``_experts_implementation = "grouped_mm"``) in ``moe_stack``'s pre-norm residual stack
(``x = x + block(rms_norm(x))``), bf16. A training step: ``mean(y.float() ** 2).backward()`` eager,
CUDA events over back-to-back steps after warm-up. ``--decode``: the forward alone at each T, captured
in one CUDA graph and replayed. Writes one JSON object to OUT, ``{"error": ...}`` on failure. A
script, not a module of the package: importing jax_moe would start JAX beside torch on the card.

    python jax_moe/bench/torch_peer.py --experts 128 --top-k 8 --hidden 2048 --ffn 768 --layers 8 --tokens 4096 --out OUT
"""

from __future__ import annotations

import argparse
import json


def build_stack(args):
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    # transformers 5 names the expert count num_experts in some versions, num_local_experts in others.
    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
                            num_local_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        blocks = torch.nn.ModuleList([Qwen3MoeSparseMoeBlock(config) for _ in range(args.layers)])
    for p in blocks.parameters():  # jax_moe.init_moe_params's scale: N(0, 1/fan_in)
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return blocks


def forward(blocks, x):
    import torch
    for block in blocks:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        out = block(h[None])  # the block takes [batch, sequence, H]
        x = x + (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    return x


def time_us(run, steps: int) -> float:
    """µs per call of ``run`` over ``steps`` back-to-back calls, by CUDA events."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def train_step(args, blocks, tokens: int) -> dict:
    import torch
    x = torch.randn(tokens, args.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def step():
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        forward(blocks, x).float().pow(2).mean().backward()

    for _ in range(args.warmup):
        step()
    torch.cuda.reset_peak_memory_stats()
    step_us = time_us(step, args.steps)
    return {"step_us": step_us, "peak_bytes": int(torch.cuda.max_memory_allocated())}


def decode_step(args, blocks, tokens: int) -> dict:
    import torch
    with torch.no_grad():
        x = torch.randn(tokens, args.hidden, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(args.warmup):
                forward(blocks, x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(blocks, x)
        for _ in range(args.warmup):
            graph.replay()
        return {"step_us": time_us(graph.replay, args.steps)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python jax_moe/bench/torch_peer.py")
    for name in ("--experts", "--top-k", "--hidden", "--ffn", "--layers"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="the forward alone, in a CUDA graph")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results = []
    try:
        import torch
        import transformers
        blocks = build_stack(args)
        for tokens in args.tokens:
            try:  # one T failing (capture, memory) must not lose the others
                row = (decode_step if args.decode else train_step)(args, blocks, tokens)
                row["us_per_layer"] = row["step_us"] / args.layers
            except Exception as e:
                row = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
            results.append({"T": tokens, "layers": args.layers, **row})
        result = {"results": results, "torch": torch.__version__, "transformers": transformers.__version__}
    except Exception as e:  # torch or transformers missing: reported to the suite
        result = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
