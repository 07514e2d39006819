"""The one-launch decode layer (jax_moe.decode_layer, cuda/decode_layer.h).

On the GPU: against a NumPy-order reference of the same roundings (dropped routes, a token's routes
repeating one expert, every route dropped, plain and gated shared experts, model-sized shapes),
against the unfused decode path inside moe_stack, bitwise run to run, and under forced command
buffers with changing inputs. Off the GPU: that it is never taken.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import MoEConfig, _native, decode_layer, init_scratch, scratch
from jax_moe.baseline import baseline_moe_stack
from jax_moe.layers import init_moe_params, moe_stack

BF16, F32 = jnp.bfloat16, jnp.float32


def _bf16(a):
    return np.asarray(jnp.asarray(a, F32).astype(BF16).astype(F32))


def _reference(x, residual, weights, ids, params):
    """The kernel's math with its roundings, sums in float32 (XLA's dots on the device)."""
    x32 = jnp.asarray(x, F32)
    gate_up, down = jnp.asarray(params["gate_up"], F32), jnp.asarray(params["down"], F32)
    num_tokens, top_k = ids.shape
    num_experts, ffn = gate_up.shape[0], down.shape[1]
    hi = jax.lax.Precision.HIGHEST

    def swiglu(row, gu, dn, width):
        product = _bf16(jnp.dot(row, gu, precision=hi))
        gate, up = product[:width], product[width:]
        hidden = _bf16(gate / (1.0 + np.exp(-gate)) * up)
        return _bf16(jnp.dot(jnp.asarray(hidden), dn, precision=hi))

    out = np.zeros((num_tokens, x.shape[1]), np.float32)
    for t in range(num_tokens):
        acc = np.zeros(x.shape[1], np.float32)
        for j in range(top_k):
            e = int(ids[t, j])
            if 0 <= e < num_experts:
                acc = acc + np.float32(weights[t, j]) * swiglu(x32[t], gate_up[e], down[e], ffn)
        total = _bf16(acc)
        if "shared_gate_up" in params:
            shared = swiglu(x32[t], jnp.asarray(params["shared_gate_up"], F32), jnp.asarray(params["shared_down"], F32),
                            params["shared_down"].shape[0])
            if "shared_gate" in params:
                logit = float(jnp.dot(x32[t], jnp.asarray(params["shared_gate"], F32).reshape(-1), precision=hi))
                shared = _bf16(shared * np.float32(1.0 / (1.0 + np.exp(-logit))))
            total = _bf16(total + shared)
        out[t] = _bf16(np.asarray(residual, np.float32)[t] + total)
    return out


def _params(num_experts, hidden, ffn, shared_ffn=0, gated=False, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    params = {"gate_up": (jax.random.normal(keys[0], (num_experts, hidden, 2 * ffn)) / np.sqrt(hidden)).astype(BF16),
              "down": (jax.random.normal(keys[1], (num_experts, ffn, hidden)) / np.sqrt(ffn)).astype(BF16)}
    if shared_ffn:
        params["shared_gate_up"] = (jax.random.normal(keys[2], (hidden, 2 * shared_ffn)) / np.sqrt(hidden)).astype(BF16)
        params["shared_down"] = (jax.random.normal(keys[3], (shared_ffn, hidden)) / np.sqrt(shared_ffn)).astype(BF16)
        if gated:
            params["shared_gate"] = (jax.random.normal(keys[4], (hidden, 1)) / np.sqrt(hidden)).astype(BF16)
    return params


def _call(params, ids, weights, residual_scale=1.0, seed=1):
    num_tokens, top_k = ids.shape
    num_experts, hidden = params["gate_up"].shape[:2]
    config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, max_tokens=num_tokens, dtype=BF16)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), BF16)
    residual = jnp.asarray(rng.standard_normal((num_tokens, hidden)) * residual_scale, BF16)
    # The kernel's own bound (moe_stack takes it only up to decode_layer.MAX_TOKENS).
    assert _native.decode_layer_fits(num_tokens, top_k, num_experts, hidden, params["down"].shape[1],
                                     params["shared_down"].shape[0] if "shared_down" in params else 0)
    run = jax.jit(lambda x, r, w, i, p, s: decode_layer.experts_and_add(x, r, w, i, p, s)[0])
    out = run(x, residual, jnp.asarray(weights, F32), jnp.asarray(ids, jnp.int32), params, init_scratch(config))
    return np.asarray(out, np.float32), (x, residual)


# (name, E, k, H, F, Fs, gated, T): small shapes, odd token counts, and the four models' sizes with
# fewer experts (the weights of 256 DeepSeek-V3 experts alone would be 22 GB).
DIRECT_CASES = [
    ("small-T1", 16, 4, 256, 128, 0, False, 1),
    ("small-T3-shared", 16, 4, 256, 128, 96, False, 3),
    ("small-T8-gated", 16, 4, 256, 64, 160, True, 8),
    ("qwen3-T1", 128, 8, 2048, 768, 0, False, 1),
    ("qwen3-T8", 128, 8, 2048, 768, 0, False, 8),
    ("mixtral-T2", 8, 2, 4096, 14336, 0, False, 2),
    ("deepseek-T1", 16, 8, 7168, 2048, 2048, False, 1),
    ("qwen35-T5", 32, 10, 4096, 1024, 1024, True, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_experts,top_k,hidden,ffn,shared_ffn,gated,num_tokens", DIRECT_CASES,
                         ids=[c[0] for c in DIRECT_CASES])
def test_gpu_decode_layer_matches_reference(name, num_experts, top_k, hidden, ffn, shared_ffn, gated, num_tokens):
    rng = np.random.default_rng(7)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    params = _params(num_experts, hidden, ffn, shared_ffn, gated)
    got, (x, residual) = _call(params, ids, weights)
    want = _reference(x, residual, weights, ids, params)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    # The experts contribute: the result is not the residual.
    assert np.abs(got - np.asarray(residual, np.float32)).max() > 1e-2


@pytest.mark.gpu
def test_gpu_decode_layer_dropped_and_repeated_routes():
    params = _params(16, 256, 128, 64, gated=True)
    # Token 0: ids out of range both ways (dropped); token 1: all four routes to expert 5 (one group
    # of 4 rows at T = 2: two passes of the kernel's 2 rows); token 2 absent (T = 2).
    ids = np.array([[-1, 3, 16, 7], [5, 5, 5, 5]], np.int32)
    weights = np.array([[0.5, 0.25, 0.75, 0.125], [0.1, 0.2, 0.3, 0.4]], np.float32)
    got, (x, residual) = _call(params, ids, weights)
    np.testing.assert_allclose(got, _reference(x, residual, weights, ids, params), rtol=2e-2, atol=2e-2)

    # Every route dropped, no shared expert: residual + 0, rounded as XLA's add (-0 becomes +0).
    plain = _params(16, 256, 128)
    ids = np.full((3, 4), -1, np.int32)
    got, (x, residual) = _call(plain, ids, np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(got, np.asarray(residual, np.float32) + np.float32(0.0))


@pytest.mark.gpu
def test_gpu_decode_layer_is_bitwise_repeatable_and_resets_its_counters():
    """Three inputs, each run twice: the same bits each time (fixed orders), and each run right (a
    counter left non-zero would stop the last block's combine or start it early)."""
    params = _params(64, 512, 256, 128)
    rng = np.random.default_rng(3)
    for trial in range(3):
        ids = np.stack([rng.choice(64, 6, replace=False) for _ in range(4)]).astype(np.int32)
        weights = rng.random((4, 6)).astype(np.float32)
        first, (x, residual) = _call(params, ids, weights, seed=trial)
        second, _ = _call(params, ids, weights, seed=trial)
        np.testing.assert_array_equal(first, second)
        np.testing.assert_allclose(first, _reference(x, residual, weights, ids, params), rtol=2e-2, atol=2e-2)


def _stack_case(num_tokens, shared_ffn, gated, routing, layers=3):
    extra = dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5) if routing == "deepseek" else {}
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=256, max_tokens=num_tokens, dtype=BF16, **extra)
    params = init_moe_params(jax.random.key(0), config, layers, 128, shared_ffn_size=shared_ffn or None,
                             shared_gate=gated, router_bias=routing == "deepseek")
    x = jax.random.normal(jax.random.key(num_tokens), (num_tokens, 256)).astype(BF16)
    return config, params, x


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("shared_ffn,gated,routing", [(0, False, "softmax"), (96, False, "deepseek"),
                                                      (128, True, "softmax")], ids=["routed", "deepseek-shared",
                                                                                    "gated-shared"])
def test_gpu_stack_at_decode_takes_the_one_launch_layer(num_tokens, shared_ffn, gated, routing, monkeypatch):
    """Three layers: the one-launch layer in the compiled step, none of permute, and the same bits
    each run. One layer (the same routing on both paths: a later layer's input differs by roundings,
    and a near tie may go either way): against the unfused path and the baseline."""
    config, params, x = _stack_case(num_tokens, shared_ffn, gated, routing)
    step = jax.jit(lambda p, x, s: moe_stack(p, x, s, with_aux=True))
    hlo = step.lower(params, x, init_scratch(config)).compile().as_text()
    assert "jax_moe_decode_layer" in hlo and "jax_moe_permute" not in hlo
    first, _, _ = step(params, x, init_scratch(config))
    again, _, _ = step(params, x, init_scratch(config))
    np.testing.assert_array_equal(np.asarray(first, F32), np.asarray(again, F32))

    more = decode_layer.MAX_TOKENS + 1  # past the bound: the four launches
    config, params, x = _stack_case(more, shared_ffn, gated, routing)
    assert "jax_moe_decode_layer" not in step.lower(params, x, init_scratch(config)).compile().as_text()

    config, params, x = _stack_case(num_tokens, shared_ffn, gated, routing, layers=1)
    got, _, aux = step(params, x, init_scratch(config))
    monkeypatch.setattr(decode_layer, "ENABLED", False)
    unfused_step = jax.jit(lambda p, x, s: moe_stack(p, x, s, with_aux=True))
    assert "jax_moe_decode_layer" not in unfused_step.lower(params, x, init_scratch(config)).compile().as_text()
    want, _, want_aux = unfused_step(params, x, init_scratch(config))
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(want_aux["expert_counts"]))
    # Within bf16 roundings: the unfused path's XLA shared expert above T = 2 keeps its SwiGLU in
    # float32 where the kernel rounds as the decode kernel does.
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(baseline_moe_stack(params, x, config), F32),
                               rtol=3e-2, atol=3e-2)


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests_dir!r})
    import jax, numpy as np
    from jax_moe import decode_layer, init_scratch
    from jax_moe.layers import moe_stack
    from test_decode_layer import _stack_case

    config, params, x = _stack_case(2, 96, True, "softmax")
    fused = jax.jit(lambda p, x, s: moe_stack(p, x, s)[0])
    # Replays with other inputs between: the same input gives the same bits (counters left zero).
    results = [np.asarray(fused(params, x * scale, init_scratch(config)), np.float32) for scale in (1, 2, 1)]
    np.testing.assert_array_equal(results[0], results[2])
    assert np.abs(results[0] - results[1]).max() > 0.1
    config, params, x = _stack_case(2, 96, True, "softmax", layers=1)
    got = [np.asarray(fused(params, x * scale, init_scratch(config)), np.float32) for scale in (1, 2)]
    decode_layer.ENABLED = False
    unfused = jax.jit(lambda p, x, s: moe_stack(p, x, s)[0])
    for scale, result in zip((1, 2), got):
        want = np.asarray(unfused(params, x * scale, init_scratch(config)), np.float32)
        np.testing.assert_allclose(result, want, rtol=2e-2, atol=2e-2 * scale)
    print("command buffer runs match")
""")


@pytest.mark.gpu
def test_gpu_decode_layer_in_command_buffers_with_changing_inputs():
    """Forced command buffers (one-op graphs, as test_gpu's): the cooperative launch is recorded and
    replayed, and each replay follows its inputs."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    script = _COMMAND_BUFFER_SCRIPT.format(tests_dir=os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "command buffer runs match" in result.stdout


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the path off the GPU")
def test_decode_layer_is_not_taken_off_the_gpu():
    config, params, x = _stack_case(2, 96, True, "softmax")
    assert not decode_layer.fits(config, 2, jax.tree.map(lambda a: a[0], params))
    hlo = jax.jit(lambda p, x, s: moe_stack(p, x, s)).lower(params, x, init_scratch(config)).as_text()
    assert "jax_moe_decode_layer" not in hlo


def test_scratch_reserves_the_decode_layer_counters():
    assert scratch.COUNTER_WORDS >= scratch.DECODE_LAYER_COUNTER_WORDS + 1
    words = _native.decode_layer_counter_words()
    if words is None:
        pytest.skip("built without the CUDA module")
    assert words == scratch.DECODE_LAYER_COUNTER_WORDS


def test_decode_layer_fits_only_where_the_kernel_does(monkeypatch):
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=16, dtype=BF16)
    layer = _params(16, 256, 128)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    if not _native.HAS_CUDA:
        assert not decode_layer.fits(config, 1, layer)
        return
    assert decode_layer.fits(config, 1, layer)
    assert not decode_layer.fits(config, decode_layer.MAX_TOKENS + 1, layer)
    assert not decode_layer.fits(config, 1, _params(16, 256, 120))  # F not a multiple of 16
    assert not decode_layer.fits(MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=16, dtype=F32), 1,
                                 layer)
    mapped = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=16, dtype=BF16,
                       expert_map=tuple(reversed(range(16))))
    assert not decode_layer.fits(mapped, 1, layer)
    monkeypatch.setattr(decode_layer, "ENABLED", False)
    assert not decode_layer.fits(config, 1, layer)
