"""FP8 experts (jax_moe.fp8): block quantisation and the layer on FP8 params.

The FP8 layer's math is "dequantise the weights to the rows' dtype, multiply with the rows", so an
FP8 stack equals the stack of the dequantised params exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import MoEConfig, fp8, init_scratch

BF16 = jnp.bfloat16


def _dequantized(params):
    out = {n: a for n, a in params.items() if not n.endswith(fp8.SCALE_SUFFIX)}
    for name in fp8.QUANTIZED_NAMES:
        out[name] = fp8.dequantize(params[name], params[name + fp8.SCALE_SUFFIX], BF16)
    return out


@pytest.mark.parametrize("shape", [(200, 300), (2, 128, 256), (1, 1, 7)])
def test_quantize_round_trip_within_e4m3_rounding(shape):
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1])
    q, scale_inv = fp8.quantize(w)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == shape[:-2] + (-(-shape[-2] // 128), -(-shape[-1] // 128))
    error = np.abs(np.asarray(fp8.dequantize(q, scale_inv)) - np.asarray(w))
    bound = 2.0 ** -4 * np.abs(np.asarray(w)) + 2.0 ** -10 * np.asarray(fp8._expand(scale_inv, *shape[-2:]))
    assert (error <= bound).all(), float((error / bound).max())
    # Each block's largest magnitude lands on e4m3's largest finite value.
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == fp8.FP8_MAX


def test_all_zero_block_gets_scale_one():
    w = jnp.zeros((256, 128)).at[200, 5].set(2.0)
    q, scale_inv = fp8.quantize(w)
    np.testing.assert_array_equal(np.asarray(scale_inv), np.asarray([[1.0], [2.0 / fp8.FP8_MAX]], np.float32))
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(q, scale_inv)), np.asarray(w))


def test_fp8_stack_is_the_stack_of_dequantized_weights():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, max_tokens=8, dtype=BF16, align=2)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(1), config, 2, 128, shared_ffn_size=128))
    assert fp8.is_quantized(params)
    x = jax.random.normal(jax.random.key(2), (5, 256)).astype(BF16)
    run = jax.jit(jax_moe.moe_stack)
    got, _ = run(params, x, init_scratch(config))
    want, _ = run(_dequantized(params), x, init_scratch(config))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # The pure-JAX baseline takes FP8 params too (the same dequantised math).
    from jax_moe.baseline import baseline_moe_stack
    base = jax.jit(lambda p, x: baseline_moe_stack(p, x, config))(params, x)
    np.testing.assert_allclose(np.asarray(base, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)


def test_fp8_params_are_checked():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jnp.zeros((2, 128), BF16)
    cases = [
        ({k: v for k, v in layer.items() if k != "down_scale_inv"}, "expected ('gate_up_scale_inv', "),
        ({**layer, "gate_up": layer["gate_up"].astype(BF16)}, "params['gate_up']: expected float8_e4m3fn"),
        ({**layer, "down_scale_inv": layer["down_scale_inv"][:, :, :0]}, "params['down_scale_inv']: expected float32"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            jax_moe.moe_layer(bad, x, init_scratch(config))


def test_fp8_layer_differentiates_in_x_only():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (3, 128)).astype(BF16)
    loss = lambda p, x: jnp.sum(jax_moe.moe_layer(p, x, init_scratch(config))[0].astype(jnp.float32) ** 2)
    d_params, d_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, x)
    _, d_x_want = jax.jit(jax.grad(loss, argnums=(0, 1)))(_dequantized(layer), x)
    np.testing.assert_array_equal(np.asarray(d_x, np.float32), np.asarray(d_x_want, np.float32))
    assert np.abs(np.asarray(d_x, np.float32)).sum() > 0
    for name in ("gate_up", "down", "gate_up_scale_inv", "down_scale_inv"):
        assert not np.asarray(d_params[name], np.float32).any(), name
    assert np.abs(np.asarray(d_params["router"], np.float32)).sum() > 0


@pytest.mark.gpu
def test_gpu_fp8_stack_matches_the_dequantized_stack():
    """On a GPU the FP8 layer dequantises, then runs the bf16 grouped GEMMs: the same numbers."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=8, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 2, 128, shared_ffn_size=128))
    x = jax.random.normal(jax.random.key(1), (8, 256)).astype(BF16)
    run = jax.jit(jax_moe.moe_stack)
    got, _ = run(params, x, init_scratch(config))
    want, _ = run(_dequantized(params), x, init_scratch(config))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
