"""FP8 experts (jax_moe.fp8): block quantisation, the layer on FP8 params, the decode kernel on GPU.

The FP8 layer's math is "dequantise the weights to the rows' dtype, multiply with the rows": on CPU
(and on GPU above decode sizes) it is that literally, so an FP8 stack equals the stack of the
dequantised params exactly; the GPU decode kernel, which dequantises in registers and accumulates
in float32, is held to it within bf16 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import MoEConfig, fp8, gemm, init_scratch, permute
from jax_moe.bench.models import MODELS
from cases import GROUPED_GEMM_EDGE_CASES, grouped_gemm_edge_case, routed_scratch
from oracle import assert_zero_past_groups

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
@pytest.mark.parametrize("num_tokens", [8, 512])
def test_gpu_fp8_stack_matches_the_dequantized_stack(num_tokens):
    """At 2 rows per expert the decode kernel reads the FP8 experts (float32 dequantised weights:
    within bf16 rounding of the dequantised stack); at 64 per expert each layer dequantises its
    experts for the bf16 grouped GEMMs: the same numbers exactly."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=num_tokens, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 2, 128, shared_ffn_size=128))
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(BF16)
    run = jax.jit(jax_moe.moe_stack)
    decode = num_tokens == 8
    assert decode == gemm.fp8_decode_plan(config.live_row_bound(num_tokens), 16, None)[0]
    assert decode == ("jax_moe_decode_matmul_fp8" in run.lower(params, x, init_scratch(config)).compile().as_text())
    got, _ = run(params, x, init_scratch(config))
    want, _ = run(_dequantized(params), x, init_scratch(config))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if decode:
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    else:
        np.testing.assert_array_equal(got, want)


def test_fp8_decode_plan_reads_fp8_bytes_until_experts_expect_8_rows():
    # DeepSeek-V3 (256 experts, top-8): the decode kernel through T = 128 (about 4 rows per owning
    # expert), dequantise-and-GEMM from T = 256 (8.0 rows); rows per pass from T only while T <= 2.
    assert gemm.fp8_decode_plan(8, 256, 1) == (True, 1)
    assert gemm.fp8_decode_plan(16 * 8, 256, 16) == (True, None)
    assert gemm.fp8_decode_plan(128 * 8, 256, 128)[0]
    assert not gemm.fp8_decode_plan(256 * 8, 256, 256)[0]


def test_fp8_forward_fallback_is_the_dequantized_product():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=6, dtype=BF16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 128)), BF16)
    scratch = permute(x, jnp.asarray(rng.integers(0, 4, (6, 2)), jnp.int32), init_scratch(config))
    q, scale_inv = fp8.quantize(jax.random.normal(jax.random.key(3), (4, 128, 256)) / 11)
    offsets, rows = scratch.expert_offsets, scratch.permuted
    sizes = scratch.group_sizes
    dense = fp8.dequantize(q, scale_inv, BF16)
    want = jax.lax.ragged_dot(rows, dense, sizes, preferred_element_type=jnp.float32).astype(BF16)
    got = gemm.fp8_forward(rows, q, scale_inv, offsets, 12)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    gated = gemm.fp8_forward(rows, q, scale_inv, offsets, 12, gated=True)
    np.testing.assert_array_equal(np.asarray(gated, np.float32), np.asarray(gemm.gated_silu(want, BF16), np.float32))


# ---- the decode kernel on FP8 weights (GPU) -----------------------------------------------------

def _check_fp8_kernel(scratch, num_local, k, n, num_rows=None, seed=4):
    """The kernel on the scratch's groups, rows of width k (the permuted rows when k = H, else
    random ones: the down projection's), against ragged_dot on the dequantised weights."""
    num_rows = num_rows or scratch.permuted.shape[0]
    rows = scratch.permuted if k == scratch.permuted.shape[1] else jax.random.normal(
        jax.random.key(seed + 100), (scratch.permuted.shape[0], k)).astype(BF16)
    q, scale_inv = jax.jit(fp8.quantize)(jax.random.normal(jax.random.key(seed), (num_local, k, n)) / np.sqrt(k))
    dense = jax.jit(fp8.dequantize, static_argnums=2)(q, scale_inv, BF16)
    sizes = jnp.diff(scratch.expert_offsets)
    want = np.asarray(jax.jit(lambda r, w: jax.lax.ragged_dot(r[:num_rows], w, sizes,
                                                              preferred_element_type=jnp.float32))(rows, dense))
    for gated in (False, True):
        got = jax.jit(lambda r, q, s, o: gemm.fp8_forward(r, q, s, o, num_rows, gated=gated))(
            rows, q, scale_inv, scratch.expert_offsets)
        expected = np.asarray(gemm.gated_silu(jnp.asarray(want, BF16), jnp.float32)) if gated else want
        got = np.asarray(got, np.float32)
        np.testing.assert_allclose(got, expected, atol=3e-2, rtol=3e-2)
        assert_zero_past_groups(got, scratch.expert_offsets)


FP8_SHAPES = [(name, t) for name in ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b") for t in (1, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_tokens", FP8_SHAPES, ids=[f"{n}-T{t}" for n, t in FP8_SHAPES])
def test_gpu_fp8_decode_kernel_model_shapes(name, num_tokens):
    m = MODELS[name]
    config = MoEConfig(num_experts=m.num_experts, top_k=m.top_k, hidden_size=m.hidden_size, max_tokens=num_tokens,
                       dtype=BF16)
    assert gemm.supports_fp8_decode(m.hidden_size, m.ffn_size)
    scratch = routed_scratch(config, num_tokens)
    _check_fp8_kernel(scratch, m.num_experts, m.hidden_size, 2 * m.ffn_size)
    _check_fp8_kernel(scratch, m.num_experts, m.ffn_size, m.hidden_size, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GROUPED_GEMM_EDGE_CASES))
def test_gpu_fp8_decode_kernel_edge_cases(case):
    kwargs, num_tokens, ids = grouped_gemm_edge_case(case)
    config = MoEConfig(dtype=BF16, **kwargs)
    scratch = routed_scratch(config, num_tokens, ids)
    _check_fp8_kernel(scratch, config.num_local_experts, 256, 512)
    _check_fp8_kernel(scratch, config.num_local_experts, 256, 512, num_rows=config.live_row_bound(num_tokens))


@pytest.mark.gpu
def test_gpu_fp8_layer_at_decode_matches_dequantized_layer_and_differentiates_in_x():
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=2, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (2, 256)).astype(BF16)
    run = jax.jit(jax_moe.moe_layer)
    assert "jax_moe_decode_matmul_fp8" in run.lower(layer, x, init_scratch(config)).compile().as_text()
    got, _ = run(layer, x, init_scratch(config))
    want, _ = run(_dequantized(layer), x, init_scratch(config))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    loss = lambda p, x: jnp.sum(jax_moe.moe_layer(p, x, init_scratch(config))[0].astype(jnp.float32) ** 2)
    d_x = jax.jit(jax.grad(loss, argnums=1))(layer, x)
    d_x_want = jax.jit(jax.grad(loss, argnums=1))(_dequantized(layer), x)
    np.testing.assert_allclose(np.asarray(d_x, np.float32), np.asarray(d_x_want, np.float32), atol=0.1, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_fp8_decode_kernel_reads_every_e4m3_value_exactly():
    """One-hot rows pick k rows of weights that hold every finite e4m3 bit pattern (subnormals and
    both zeros included) under power-of-two scales: the kernel's output is the dequantised row,
    exactly (each sum has one nonzero term, and e4m3 times a power of two is a bf16)."""
    k, n, num_rows = 128, 256, 8
    bits = (np.arange(k)[:, None] * 7 + np.arange(n)[None, :]) % 256
    bits[(bits & 0x7f) == 0x7f] = 0  # e4m3fn's two NaNs
    q = jax.lax.bitcast_convert_type(jnp.asarray(bits[None], jnp.uint8), jnp.float8_e4m3fn)
    scale_inv = jnp.asarray([[[0.5, 2.0 ** -7]]], jnp.float32)
    picked = np.array([0, 3, 17, 40, 64, 90, 101, 127])
    rows = jnp.asarray(np.eye(k)[picked], BF16)
    offsets = jnp.asarray([0, num_rows], jnp.int32)
    got = jax.jit(lambda r, q, s, o: gemm.fp8_forward(r, q, s, o, num_rows))(rows, q, scale_inv, offsets)
    want = np.asarray(fp8.dequantize(q, scale_inv))[0][picked]
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert np.unique(bits[picked], axis=None).size == 254  # every finite pattern was read


def test_quantize_rows_round_trip_within_e4m3_rounding():
    """The FP8 prefill GEMM's activation quantisation: per 1 x 128 group of each row."""
    rows = jax.random.normal(jax.random.key(3), (9, 384)) * jnp.linspace(0.01, 5.0, 384)
    rows = rows.at[4, 128:256].set(0.0).astype(BF16)  # an all-zero group: scale 1
    q, scale = fp8.quantize_rows(rows)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == rows.shape and scale.shape == (9, 3)
    assert float(scale[4, 1]) == 1.0 and not np.asarray(q[4, 128:256], np.float32).any()
    x = np.asarray(rows, np.float32)
    error = np.abs(np.asarray(fp8.dequantize_rows(q, scale)) - x)
    bound = 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * np.repeat(np.asarray(scale), 128, axis=1)
    assert (error <= bound).all()


def test_quantize_rows_is_ieee_float32_step_by_step():
    """quantize_rows' bytes are those of IEEE float32 steps (the CUDA kernel's math): max|x| times
    the rounded 1/448, its exact reciprocal, a product, one round-to-nearest-even into e4m3."""
    import ml_dtypes
    rows = (jax.random.normal(jax.random.key(4), (64, 512)) * jnp.linspace(0.01, 50.0, 512)).astype(BF16)
    q, scale = jax.jit(fp8.quantize_rows)(rows)
    x = np.asarray(rows, np.float32).reshape(64, 4, 128)
    amax = np.abs(x).max(-1)
    want_scale = np.where(amax > 0, amax * (np.float32(1) / np.float32(448)), np.float32(1)).astype(np.float32)
    inverse = (np.float32(1) / want_scale).astype(np.float32)
    want_q = np.clip(x * inverse[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(64, 512)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))


def _prefill_case(seed, groups, k, n, sizes):
    key = jax.random.key(seed)
    w = jax.random.normal(key, (groups, n, k)) / np.sqrt(k)
    q, scale = fp8.quantize(w)  # [El, N, K] with [El, N/128, K/128] scales: the checkpoint's layout
    rows = jax.random.normal(jax.random.fold_in(key, 1), (sum(sizes) + 5, k))
    rows = (rows * jnp.linspace(0.1, 4.0, k)).astype(BF16)  # groups of a row at different scales
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    return rows, q, scale, offsets


def _prefill_reference(q_rows, row_scale, q, scale, offsets):
    """float64 (value, magnitude) of the grouped product of dequantised operands: [R, N] each, the
    magnitude sum_k |a_k w_k| bounding accumulation error."""
    a = np.asarray(fp8.dequantize_rows(q_rows, row_scale), np.float64)
    w = np.asarray(fp8.dequantize(q, scale), np.float64)  # [El, N, K]
    o = np.asarray(offsets)
    value, magnitude = np.zeros((a.shape[0], w.shape[1])), np.zeros((a.shape[0], w.shape[1]))
    for g in range(w.shape[0]):
        value[o[g]:o[g + 1]] = a[o[g]:o[g + 1]] @ w[g].T
        magnitude[o[g]:o[g + 1]] = np.abs(a[o[g]:o[g + 1]]) @ np.abs(w[g]).T
    return value, magnitude


def test_fp8_prefill_forward_fallback_is_the_dequantized_product():
    rows, q, scale, offsets = _prefill_case(0, 3, 256, 384, [5, 0, 7])
    num_rows = 14  # two rows past the groups: zero
    out, _ = gemm.fp8_prefill_forward(rows, q, scale, offsets, jnp.zeros((1,), jnp.int32), num_rows)
    want, magnitude = _prefill_reference(*fp8.quantize_rows(rows[:num_rows]), q, scale, offsets)
    got = np.asarray(out, np.float64)
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -20 * magnitude).all()
    assert not got[12:].any()


def test_fp8_prefill_forward_takes_the_fallback_for_shapes_the_kernel_does_not():
    """N not a multiple of 128: the dequantising fallback, on any device."""
    rows, q, scale, offsets = _prefill_case(2, 2, 256, 200, [3, 4])
    out, _ = gemm.fp8_prefill_forward(rows, q, scale, offsets, gemm.fp8_workspace(2), 7)
    want, _ = _prefill_reference(*fp8.quantize_rows(rows[:7]), q, scale, offsets)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes, k, n", [
    ([5, 0, 7], 512, 384),          # empty expert between two
    ([300, 1, 0, 129], 512, 384),   # groups over several 128-row tiles, one row, empty
    ([0, 0, 0, 64], 512, 384),      # one expert takes every row
    ([1], 256, 256),                # T = 1, one route
    ([130, 0, 126, 8], 1024, 640),  # K over 8 scale blocks, N not a multiple of the 128 x 128 tile pair
])
@pytest.mark.parametrize("tile_rows", gemm.FP8_TILE_ROWS)
def test_gpu_fp8_prefill_forward_matches_the_dequantized_product(sizes, k, n, tile_rows):
    """The CUTLASS FP8 blockwise grouped GEMM: its quantised rows are fp8.quantize_rows' bytes, and
    its result is the float64 product of the dequantised operands within bf16 rounding of the
    result (2^-8 relative) plus the FP8 tensor cores' accumulation (2^-10 of sum |a w|: their
    per-128 partial sums keep fewer bits than float32); rows past the groups are zero."""
    groups = len(sizes)
    rows, q, scale, offsets = _prefill_case(1, groups, k, n, sizes)
    num_rows = sum(sizes) + 3
    workspace = gemm.fp8_workspace(groups)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put((rows, q, scale, offsets, workspace), gpu)
    out, _, q_rows, row_scale = jax.jit(lambda *a: gemm._fp8_grouped_matmul_call(*a, num_rows, tile_rows))(*args)
    want_q, want_scale = jax.jit(fp8.quantize_rows, device=jax.devices("cpu")[0])(rows[:num_rows])
    np.testing.assert_array_equal(np.asarray(row_scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q_rows).view(np.uint8), np.asarray(want_q).view(np.uint8))
    want, magnitude = _prefill_reference(want_q, want_scale, q, scale, offsets)
    got = np.asarray(out, np.float64)
    error = np.abs(got - want)
    assert (error <= 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * magnitude).all(), error.max()
    assert not got[sum(sizes):].any()
    public, _ = jax.jit(lambda *a: gemm.fp8_prefill_forward(*a, num_rows, tile_rows))(*args)
    np.testing.assert_array_equal(np.asarray(public, np.float32), np.asarray(out, np.float32))
    other = 192 - tile_rows  # the other tile: the same math, each output one float32 sum of the same products
    np.testing.assert_allclose(np.asarray(jax.jit(lambda *a: gemm.fp8_prefill_forward(*a, num_rows, other))(*args)[0],
                                          np.float64), got, rtol=2.0 ** -7, atol=2.0 ** -10 * magnitude.max())


@pytest.mark.parametrize("change, match", [
    (lambda a: a | {"weights_nk": a["weights_nk"].astype(BF16)}, "weights_nk: expected float8_e4m3fn"),
    (lambda a: a | {"rows": a["rows"][:, :128]}, r"rows: expected \[R, K=256\]"),
    (lambda a: a | {"scale_nk": a["scale_nk"][:, :1]}, r"scale_nk: expected float32 \(2, 2, 2\)"),
    (lambda a: a | {"offsets": a["offsets"][:2]}, r"offsets: expected int32 \[3\]"),
    (lambda a: a | {"num_rows": 99}, "num_rows: expected 0..12"),
    (lambda a: a | {"tile_rows": 96}, r"tile_rows: expected one of \(64, 128\)"),
])
def test_fp8_prefill_forward_rejects_bad_operands(change, match):
    rows, q, scale, offsets = _prefill_case(0, 2, 256, 256, [3, 4])
    args = change(dict(rows=rows, weights_nk=q, scale_nk=scale, offsets=offsets, workspace=gemm.fp8_workspace(2),
                       num_rows=7))
    with pytest.raises(ValueError, match=match):
        gemm.fp8_prefill_forward(**args)


def test_fp8_tile_rows_is_the_small_tile_up_to_the_crossover():
    per_group = gemm.FP8_SMALL_TILE_MAX_ROWS_PER_GROUP
    assert gemm.fp8_tile_rows(per_group * 256, 256) == 64
    assert gemm.fp8_tile_rows(per_group * 256 + 1, 256) == 128
    assert gemm.fp8_tile_rows(1, 1) == 64
