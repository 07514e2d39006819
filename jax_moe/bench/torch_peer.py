"""The PyTorch + Hugging Face peer of the train and decode suites, a script run in its own process.

L transformers ``Qwen3MoeSparseMoeBlock``s with the model's E, k, H, F and torch's grouped GEMM
(``_experts_implementation = "grouped_mm"``) in ``moe_stack``'s pre-norm residual stack
(``x = x + block(rms_norm(x))``), bf16. A training step: ``mean(y.float() ** 2).backward()`` eager,
CUDA events over back-to-back steps after warm-up; with ``decode``, the forward alone, captured in one
CUDA graph and replayed. A script, not a module of the package: importing jax_moe would start JAX
beside torch on the card. ``python torch_peer.py SPEC OUT``: SPEC, the JSON ``common.run_torch_peer`` writes.
"""

import json
import sys
import types


def build_stack(spec):
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    # transformers 5 names the expert count num_experts in some versions, num_local_experts in others.
    config = Qwen3MoeConfig(hidden_size=spec.hidden, moe_intermediate_size=spec.ffn, num_experts=spec.experts,
                            num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        blocks = torch.nn.ModuleList([Qwen3MoeSparseMoeBlock(config) for _ in range(spec.layers)])
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


def time_us(run, spec) -> float:
    """µs a call of ``run`` over ``spec.steps`` back-to-back calls after ``spec.warmup``, by CUDA events."""
    import torch
    for _ in range(spec.warmup):
        run()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(spec.steps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / spec.steps


def measure(spec, blocks, tokens: int) -> dict:
    import torch
    x = torch.randn(tokens, spec.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=not spec.decode)
    if not spec.decode:
        def step():
            blocks.zero_grad(set_to_none=True)
            x.grad = None
            forward(blocks, x).float().pow(2).mean().backward()
        return {"step_us": time_us(step, spec), "peak_bytes": int(torch.cuda.max_memory_allocated())}
    with torch.no_grad():
        side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(spec.warmup):
                forward(blocks, x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(blocks, x)
        return {"step_us": time_us(graph.replay, spec)}


def main(spec: str, out: str) -> None:
    spec, results = types.SimpleNamespace(**json.loads(spec)), []
    try:
        import torch
        import transformers
        blocks = build_stack(spec)
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        for tokens in spec.tokens:
            try:  # one T failing (capture, memory) must not lose the others
                row = measure(spec, blocks, tokens)
                row["us_per_layer"] = row["step_us"] / spec.layers
            except Exception as e:
                row = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
            results.append({"T": tokens, "layers": spec.layers, **versions, **row})
    except Exception as e:  # torch or transformers missing: reported to the suite
        results = [{"T": tokens, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"} for tokens in spec.tokens]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
