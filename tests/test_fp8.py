"""FP8 experts (jax_moe.fp8): block quantisation, the FP8 grouped GEMM, the layer on FP8 params.

The FP8 layer's math: each projection's rows are quantised per 1 x 128 group of a row, both
operands dequantised exactly, float32 accumulation, the result rounded to the rows' dtype
(``gemm.fp8_dequantized_matmul`` on CPU; CUTLASS's blockwise-scaled FP8 grouped GEMM on a GPU,
whose quantised rows are the CPU's bytes and whose products are held to a float64 reference).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import MoEConfig, experts, fp8, gemm, init_scratch, plan
from jax_moe.tuning import DEFAULT_TUNING
from jax_moe.experts import swiglu_experts
from jax_moe.bench.models import MODELS
from cases import GROUPED_GEMM_EDGE_CASES, fp8_swiglu_weights, grouped_gemm_edge_case, routed_scratch, scaled_normal
from oracle import assert_zero_past_groups

BF16 = jnp.bfloat16


def _dequantized(params):
    out = {n: a for n, a in params.items() if not n.endswith(fp8.SCALE_SUFFIX)}
    out["gate_up"], out["down"] = fp8.expert_weights(params, BF16)  # the bf16 experts' [in, out] layout
    if fp8.shared_is_quantized(params):
        out["shared_gate_up"], out["shared_down"] = fp8.expert_weights(params, BF16, fp8.SHARED_QUANTIZED_NAMES)
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


def test_model_sized_test_weights_are_drawn_an_expert_at_a_time():
    """cases.scaled_normal past layers' whole-draw bound (lowered here): one draw per expert, in the
    layout of quantising those values whole (FP8 blocks never span experts); its compiled temporaries
    for DeepSeek-V3's gate/up ([256, 7168, 4096], 15 GB of bf16) stay under 1 GB, where a whole
    float32 draw takes 28 GiB arrays an 80 GB card does not hold beside a test."""
    import cases
    key = jax.random.key(5)
    w = cases.scaled_normal(key, (3, 256, 384), 384, jnp.float32, max_whole_bytes=1000)
    q, scale = cases.scaled_normal(key, (3, 256, 384), 384, quantize=True, max_whole_bytes=1000)
    want_q, want_scale = jax.jit(fp8.quantize)(w)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    assert not np.array_equal(np.asarray(w[0]), np.asarray(w[1]))  # each expert its own key
    assert abs(float(np.std(np.asarray(w))) * np.sqrt(384) - 1) < 0.02
    draw = jax.jit(lambda k: cases.scaled_normal(k, (256, 7168, 4096), 7168, BF16))
    memory = draw.lower(key).compile().memory_analysis()
    assert memory.output_size_in_bytes == 256 * 7168 * 4096 * 2 and memory.temp_size_in_bytes < 1e9


def test_all_zero_block_gets_scale_one():
    w = jnp.zeros((256, 128)).at[200, 5].set(2.0)
    q, scale_inv = fp8.quantize(w)
    np.testing.assert_array_equal(np.asarray(scale_inv), np.asarray([[1.0], [2.0 / fp8.FP8_MAX]], np.float32))
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(q, scale_inv)), np.asarray(w))


def _fp8_swiglu_float64(layer, rows, sizes):
    """The FP8 SwiGLU experts in NumPy float64 from the quantised bytes: [R, H] float64 (before the
    final rounding to bf16; the activation rounded to bf16 as the layer rounds it)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])

    def project(a, name):
        q, scale = fp8.quantize_rows(jnp.asarray(a, BF16))
        a = np.asarray(fp8.dequantize_rows(q, scale), np.float64)
        w = np.asarray(fp8.dequantize(layer[name], layer[name + fp8.SCALE_SUFFIX]), np.float64)  # [El, out, in]
        out = np.zeros((a.shape[0], w.shape[1]))
        for g in range(w.shape[0]):
            out[offsets[g]:offsets[g + 1]] = a[offsets[g]:offsets[g + 1]] @ w[g].T
        return out

    hidden = np.asarray(jnp.asarray(project(rows, "gate_up"), BF16), np.float64)
    gate, up = np.split(hidden, 2, axis=-1)
    activated = np.asarray(jnp.asarray(gate / (1 + np.exp(-gate)) * up, BF16), np.float64)
    return project(activated, "down")


def test_fp8_swiglu_experts_are_the_fp8_recipe():
    """Rows quantised per 1 x 128 group before each projection, exact operands, float32 sums."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=256, max_tokens=8, dtype=BF16)
    layer = jax.tree.map(lambda a: a[0], fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(1), config, 1, 128)))
    assert layer["gate_up"].shape == (4, 256, 256) and layer["down"].shape == (4, 256, 128)  # [El, out, in]
    rows = (jax.random.normal(jax.random.key(2), (12, 256)) * jnp.linspace(0.1, 3.0, 256)).astype(BF16)
    sizes = jnp.asarray([5, 0, 4, 1], jnp.int32)  # two rows past the groups: zero
    got = np.asarray(jax.jit(swiglu_experts)(layer, rows, sizes), np.float64)
    want = _fp8_swiglu_float64(layer, np.asarray(rows[:10], np.float32), np.asarray(sizes))
    np.testing.assert_allclose(got[:10], want, rtol=2.0 ** -7, atol=1e-3 * np.abs(want).max())
    assert not got[10:].any()


def test_fp8_shared_expert_is_the_fp8_recipe_on_one_group():
    """An FP8 shared expert is the FP8 experts' math with every token in one group; its sigmoid gate
    (Qwen) scales the rounded output. Off the GPU (the GPU's is test_gpu_fp8_stack_matches_...)."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=256, max_tokens=8, dtype=BF16)
    params = jax_moe.init_moe_params(jax.random.key(1), config, 1, 128, shared_ffn_size=256, shared_gate=True)
    layer = jax.tree.map(lambda a: a[0], fp8.quantize_params(params))
    assert layer["shared_gate_up"].shape == (512, 256) and layer["shared_down_scale_inv"].shape == (2, 2)
    x = (jax.random.normal(jax.random.key(2), (6, 256)) * jnp.linspace(0.1, 3.0, 256)).astype(BF16)
    got = np.asarray(jax.jit(experts.shared_experts)(layer, x), np.float32)
    one_group = {name[len("shared_"):]: layer[name] for name in layer if name.startswith("shared_") and name != "shared_gate"}
    one_group = {name: leaf[None] for name, leaf in one_group.items()}  # El = 1
    want = np.asarray(jnp.asarray(_fp8_swiglu_float64(one_group, np.asarray(x, np.float32), [6]), BF16), np.float64)
    gate = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(layer["shared_gate"], np.float64))))
    np.testing.assert_allclose(got, want * gate, rtol=2.0 ** -7, atol=1e-3 * np.abs(want).max())
    # Unquantised on request: the shared expert stays bf16.
    assert not fp8.shared_is_quantized(fp8.quantize_params(params, shared=False))


def test_fp8_shared_params_are_checked():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    params = jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128)
    layer = jax.tree.map(lambda a: a[0], fp8.quantize_params(params))
    narrow = jax.tree.map(lambda a: a[0], fp8.quantize_params(
        jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=64)))
    x = jnp.zeros((2, 128), BF16)
    cases = [
        ({k: v for k, v in layer.items() if k != "shared_down_scale_inv"}, "expected ('shared_gate_up_scale_inv', "),
        ({**layer, "shared_down": layer["shared_down"].astype(BF16)}, "params['shared_down']: expected float8_e4m3fn"),
        ({**layer, "shared_gate_up_scale_inv": layer["shared_gate_up_scale_inv"][:1]},
         "params['shared_gate_up_scale_inv']: expected float32 (2, 1) ([out/128, in/128])"),
        ({**layer, "shared_down": layer["shared_down"][:, :64]},
         "params['shared_gate_up'] and params['shared_down']: expected shared_down's Fs to be half "
         "shared_gate_up's 2Fs, got 2Fs = 256 in shared_gate_up (256, 128) and Fs = 64 in shared_down (128, 64)"),
        (narrow, "an FP8 shared expert needs H and Fs multiples of 128 (whole scale blocks along K for the "
                 "rows' quantisation), got H=128, Fs=64"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            jax_moe.moe_layer(bad, x, init_scratch(config))


def test_fp8_swiglu_forward_names_bad_operands():
    gu = fp8.quantize(jnp.ones((2, 256, 128)))
    dn = fp8.quantize(jnp.ones((2, 128, 128)))
    rows, offsets, ws = jnp.zeros((4, 128), BF16), jnp.asarray([0, 2, 4], jnp.int32), gemm.fp8_workspace(2)
    cases = [
        ((rows, gu[0].astype(BF16), gu[1], *dn), "fp8_swiglu_forward: gate_up: expected float8_e4m3fn [El, N, K]"),
        ((rows, gu[0], gu[1][:, :1], *dn), "fp8_swiglu_forward: gate_up_scale: expected float32 (2, 2, 1)"),
        ((rows, *gu, dn[0][:, :, :64], dn[1]), "fp8_swiglu_forward: down: expected [El, H, F] = (2, 128, 128)"),
        ((rows, *gu, dn[0], dn[1][:1]), "fp8_swiglu_forward: down_scale: expected float32 (2, 1, 1)"),
        ((rows[:, :64], *gu, *dn), "fp8_swiglu_forward: rows: expected [R, K=128]"),
        ((rows, gu[0][:, :255], gu[1], *dn), "fp8_swiglu_forward: gate_up: expected [El, 2F, H] (gate rows, then "
                                             "up rows), got an odd 255 rows"),
    ]
    for operands, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            gemm.fp8_swiglu_forward(*operands, offsets, ws, 4)
    with pytest.raises(ValueError, match=re.escape("fp8_swiglu_forward: tile_rows: expected one of (64, 128)")):
        gemm.fp8_swiglu_forward(rows, *gu, *dn, offsets, ws, 4, tile_rows=32)


def test_fp8_stack_is_near_the_dequantized_stack():
    """Within the rows' quantisation error of the dequantised params' stack; the pure-JAX baseline
    takes FP8 params too (its experts are swiglu_experts: the same FP8 math)."""
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, max_tokens=8, dtype=BF16, align=2)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(1), config, 2, 128, shared_ffn_size=128))
    assert fp8.is_quantized(params)
    x = jax.random.normal(jax.random.key(2), (5, 256)).astype(BF16)
    run = jax.jit(jax_moe.moe_stack)
    got, _ = run(params, x, init_scratch(config))
    want, _ = run(_dequantized(params), x, init_scratch(config))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert 0 < np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    from jax_moe.baseline import baseline_moe_stack
    base = jax.jit(lambda p, x: baseline_moe_stack(p, x, config))(params, x)
    np.testing.assert_allclose(np.asarray(base, np.float32), got, atol=2e-2, rtol=2e-2)


def test_fp8_params_are_checked():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 256))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jnp.zeros((2, 128), BF16)
    small = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    narrow = jax.tree.map(lambda a: a[0], fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), small, 1, 64)))
    cases = [
        ({k: v for k, v in layer.items() if k != "down_scale_inv"}, "expected ('gate_up_scale_inv', "),
        ({**layer, "gate_up": layer["gate_up"].astype(BF16)}, "params['gate_up']: expected float8_e4m3fn"),
        ({**layer, "down_scale_inv": layer["down_scale_inv"][:, :, :0]}, "params['down_scale_inv']: expected float32"),
        ({**layer, "down": jnp.swapaxes(layer["down"], 1, 2)}, "params['down']: expected shape (4, 128, 256)"),
        (narrow, "FP8 experts need H and F multiples of 128 (whole scale blocks along K for the rows' "
                 "quantisation), got H=128, F=64"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
            jax_moe.moe_layer(bad, x, init_scratch(config))


def test_fp8_layer_differentiates_in_x_only():
    """The rows' quantisation passes the gradient through: d x near the dequantised layer's."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, max_tokens=4, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (3, 128)).astype(BF16)
    loss = lambda p, x: jnp.sum(jax_moe.moe_layer(p, x, init_scratch(config))[0].astype(jnp.float32) ** 2)
    d_params, d_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, x)
    _, d_x_want = jax.jit(jax.grad(loss, argnums=(0, 1)))(_dequantized(layer), x)
    d_x, d_x_want = np.asarray(d_x, np.float32), np.asarray(d_x_want, np.float32)
    assert np.abs(d_x).sum() > 0 and np.abs(d_x - d_x_want).max() <= 0.1 * np.abs(d_x_want).max()
    for name in fp8.QUANTIZED_NAMES + fp8.SHARED_QUANTIZED_NAMES:
        for leaf in (name, name + fp8.SCALE_SUFFIX):
            assert not np.asarray(d_params[leaf], np.float32).any(), leaf
    assert np.abs(np.asarray(d_params["router"], np.float32)).sum() > 0


def _on(device_kind, fn, *args):
    device = jax.devices(device_kind)[0]
    return jax.jit(fn)(*jax.device_put(args, device))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_gpu_fp8_stack_matches_the_cpu_fp8_stack(num_tokens):
    """The FP8 grouped GEMM at every size (1 and 8 tokens: decode; 512: prefill) against the CPU's
    math. The first projection's quantised rows are the same; its bf16 result may differ by
    rounding, and a changed activation (the GPU's silu is another float32 formula) can move its
    1 x 128 group's FP8 scale; with the shared expert FP8 too, four projections a layer quantise
    their rows. So the bound is on the whole output (3 % in norm; measured up to 2.04 % at T = 1)
    with a looser one per element."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=num_tokens, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 2, 128, shared_ffn_size=128))
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(BF16)
    run = lambda p, x, s: jax_moe.moe_stack(p, x, s)[0]
    gpu = jax.devices("gpu")[0]
    hlo = jax.jit(run).lower(*jax.device_put((params, x, init_scratch(config)), gpu)).compile().as_text()
    # The routed and the shared experts, each one call for both projections (in the scan body): the
    # FP8 decode kernel's for small reads (plan.fp8_decode_rows), else the CUTLASS GEMMs'.
    decode = [bool(plan.fp8_decode_rows(rows, groups, 256, 128))
              for rows, groups in ((config.live_row_bound(num_tokens), 16), (num_tokens, 1))]
    assert decode == [num_tokens <= 8, num_tokens == 1]  # T = 8: 8 rows of the shared expert take CUTLASS
    # With the routed experts on the decode kernel, the shared expert rides in their launches.
    rides = decode[0] and num_tokens <= plan.FP8_DECODE_MAX_SHARED_ROWS
    assert hlo.count('custom_call_target="jax_moe_fp8_decode_swiglu_shared"') == rides
    assert hlo.count('custom_call_target="jax_moe_fp8_decode_swiglu"') == (0 if rides else sum(decode))
    # The routed experts on CUTLASS past one routing tile of routes take rows quantised in permute
    # (the plan's permute="fp8_quantize").
    quantized = not decode[0] and num_tokens * 4 > jax_moe.scratch.ROUTING_TILE
    assert hlo.count('custom_call_target="jax_moe_permute_fp8"') == quantized
    assert hlo.count('custom_call_target="jax_moe_fp8_swiglu_quantized_experts"') == quantized
    assert hlo.count('custom_call_target="jax_moe_fp8_swiglu_experts"') == (0 if rides else 2 - sum(decode) - quantized)
    got = np.asarray(_on("gpu", run, params, x, init_scratch(config)), np.float32)
    want = np.asarray(_on("cpu", run, params, x, init_scratch(config)), np.float32)
    assert np.linalg.norm(got - want) <= 0.03 * np.linalg.norm(want)
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()


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


def _fp8_case(seed, groups, k, n, sizes):
    key = jax.random.key(seed)
    w = jax.random.normal(key, (groups, n, k)) / np.sqrt(k)
    q, scale = fp8.quantize(w)  # [El, N, K] with [El, N/128, K/128] scales: the checkpoint's layout
    rows = jax.random.normal(jax.random.fold_in(key, 1), (sum(sizes) + 5, k))
    rows = (rows * jnp.linspace(0.1, 4.0, k)).astype(BF16)  # groups of a row at different scales
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    return rows, q, scale, offsets


def _fp8_reference(q_rows, row_scale, q, scale, offsets):
    """float64 (value, magnitude) of the grouped product of dequantised operands: [R, N] each, the
    magnitude sum_k |a_k w_k| bounding accumulation error."""
    a = np.asarray(fp8.dequantize_rows(q_rows, row_scale), np.float64)
    o = np.clip(np.asarray(offsets), 0, a.shape[0])
    value, magnitude = np.zeros((a.shape[0], q.shape[1])), np.zeros((a.shape[0], q.shape[1]))
    for g in np.flatnonzero(o[1:] > o[:-1]):  # one expert at a time: DeepSeek-V3's are 7.5 G weights
        w = np.asarray(fp8.dequantize(q[g], scale[g]), np.float64)  # [N, K]
        value[o[g]:o[g + 1]] = a[o[g]:o[g + 1]] @ w.T
        magnitude[o[g]:o[g + 1]] = np.abs(a[o[g]:o[g + 1]]) @ np.abs(w).T
    return value, magnitude


def test_fp8_forward_fallback_is_the_dequantized_product():
    rows, q, scale, offsets = _fp8_case(0, 3, 256, 384, [5, 0, 7])
    num_rows = 14  # two rows past the groups: zero
    out, _ = gemm.fp8_forward(rows, q, scale, offsets, jnp.zeros((1,), jnp.int32), num_rows)
    want, magnitude = _fp8_reference(*fp8.quantize_rows(rows[:num_rows]), q, scale, offsets)
    got = np.asarray(out, np.float64)
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -20 * magnitude).all()
    assert not got[12:].any()


def test_fp8_forward_takes_the_fallback_for_shapes_the_kernel_does_not():
    """N not a multiple of 128: the dequantising fallback, on any device."""
    rows, q, scale, offsets = _fp8_case(2, 2, 256, 200, [3, 4])
    out, _ = gemm.fp8_forward(rows, q, scale, offsets, gemm.fp8_workspace(2), 7)
    want, _ = _fp8_reference(*fp8.quantize_rows(rows[:7]), q, scale, offsets)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes, k, n", [
    ([5, 0, 7], 512, 384),          # empty expert between two
    ([300, 1, 0, 129], 512, 384),   # groups over several 128-row tiles, one row, empty
    ([0, 0, 0, 64], 512, 384),      # one expert takes every row
    ([1], 256, 256),                # T = 1, one route
    ([130, 0, 126, 8], 1024, 640),  # K over 8 scale blocks, N not a multiple of the 128 x 128 tile pair
])
@pytest.mark.parametrize("tile_rows", plan.FP8_TILE_ROWS)
def test_gpu_fp8_forward_matches_the_dequantized_product(sizes, k, n, tile_rows):
    """The CUTLASS FP8 blockwise grouped GEMM: its quantised rows are fp8.quantize_rows' bytes, and
    its result is the float64 product of the dequantised operands within bf16 rounding of the
    result (2^-8 relative) plus the FP8 tensor cores' accumulation (2^-10 of sum |a w|: their
    per-128 partial sums keep fewer bits than float32); rows past the groups are zero."""
    groups = len(sizes)
    rows, q, scale, offsets = _fp8_case(1, groups, k, n, sizes)
    num_rows = sum(sizes) + 3
    workspace = gemm.fp8_workspace(groups)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put((rows, q, scale, offsets, workspace), gpu)
    out, _, q_rows, row_scale = jax.jit(lambda *a: gemm.fp8_gemm._fp8_grouped_matmul_call(*a, num_rows, tile_rows))(*args)
    want_q, want_scale = jax.jit(fp8.quantize_rows)(jax.device_put(rows[:num_rows], jax.devices("cpu")[0]))
    np.testing.assert_array_equal(np.asarray(row_scale), np.asarray(want_scale))
    np.testing.assert_array_equal(np.asarray(q_rows).view(np.uint8), np.asarray(want_q).view(np.uint8))
    want, magnitude = _fp8_reference(want_q, want_scale, q, scale, offsets)
    got = np.asarray(out, np.float64)
    error = np.abs(got - want)
    assert (error <= 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * magnitude).all(), error.max()
    assert not got[sum(sizes):].any()
    public, _ = jax.jit(lambda *a: gemm.fp8_forward(*a, num_rows, tile_rows))(*args)
    np.testing.assert_array_equal(np.asarray(public, np.float32), np.asarray(out, np.float32))
    other = 192 - tile_rows  # the other tile: the same math, each output one float32 sum of the same products
    np.testing.assert_allclose(np.asarray(jax.jit(lambda *a: gemm.fp8_forward(*a, num_rows, other))(*args)[0],
                                          np.float64), got, rtol=2.0 ** -7, atol=2.0 ** -10 * magnitude.max())


@pytest.mark.parametrize("change, match", [
    (lambda a: a | {"weights_nk": a["weights_nk"].astype(BF16)}, "weights_nk: expected float8_e4m3fn"),
    (lambda a: a | {"rows": a["rows"][:, :128]}, r"rows: expected \[R, K=256\]"),
    (lambda a: a | {"scale_nk": a["scale_nk"][:, :1]}, r"scale_nk: expected float32 \(2, 2, 2\)"),
    (lambda a: a | {"offsets": a["offsets"][:2]}, r"offsets: expected int32 \[3\]"),
    (lambda a: a | {"num_rows": 99}, "num_rows: expected 0..12"),
    (lambda a: a | {"tile_rows": 96}, r"tile_rows: expected one of \(64, 128\)"),
    (lambda a: a | {"weights_nk": a["weights_nk"][..., :200], "rows": a["rows"][:, :200]},
     "weights_nk: expected K a multiple of 128"),
])
def test_fp8_forward_rejects_bad_operands(change, match):
    rows, q, scale, offsets = _fp8_case(0, 2, 256, 256, [3, 4])
    args = change(dict(rows=rows, weights_nk=q, scale_nk=scale, offsets=offsets, workspace=gemm.fp8_workspace(2),
                       num_rows=7))
    with pytest.raises(ValueError, match=match):
        gemm.fp8_forward(**args)


def test_fp8_tile_rows_is_the_small_tile_up_to_the_crossover():
    per_group = DEFAULT_TUNING.fp8_small_tile_max_rows_per_group
    assert plan.fp8_tile_rows(per_group * 256, 256) == 64
    assert plan.fp8_tile_rows(per_group * 256 + 1, 256) == 128
    assert plan.fp8_tile_rows(1, 1) == 64


def _check_fp8_forward(scratch, num_local, k, n, num_rows=None, seed=4):
    """fp8_forward on the scratch's groups and rows of width k (the permuted rows when k = H, else
    random ones: the down projection's) against the float64 product of the quantised operands."""
    num_rows = num_rows or scratch.permuted.shape[0]
    rows = scratch.permuted if k == scratch.permuted.shape[1] else jax.random.normal(
        jax.random.key(seed + 100), (scratch.permuted.shape[0], k)).astype(BF16)
    q, scale = scaled_normal(jax.random.key(seed), (num_local, n, k), k, quantize=True)
    workspace = scratch.workspace  # the scratch's workspace has room for the FP8 GEMM's arguments
    got, _ = jax.jit(lambda *a: gemm.fp8_forward(*a, num_rows))(rows, q, scale, scratch.expert_offsets, workspace)
    want_q, want_scale = jax.jit(fp8.quantize_rows)(jax.device_put(rows[:num_rows], jax.devices("cpu")[0]))
    want, magnitude = _fp8_reference(want_q, want_scale, q, scale, scratch.expert_offsets)
    got = np.asarray(got, np.float64)
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * magnitude).all()
    assert_zero_past_groups(got, scratch.expert_offsets)


def _check_fp8_swiglu_forward(scratch, num_local, hidden, ffn, num_rows=None, seed=6):
    """fp8_swiglu_forward (one call) against its three steps on the GPU: fp8_forward, gated_silu in
    XLA, fp8_forward. The gate/up product is the same GEMM (bitwise); the activation is computed by
    another float32 silu (expf vs XLA's), so a few values may round to a neighbouring bf16 and move
    their group's scale: the quantised activation matches in all but a few bytes and the output in norm."""
    num_rows = num_rows or scratch.permuted.shape[0]
    keys = jax.random.split(jax.random.key(seed))
    gu = scaled_normal(keys[0], (num_local, 2 * ffn, hidden), hidden, quantize=True)
    dn = scaled_normal(keys[1], (num_local, hidden, ffn), ffn, quantize=True)
    rows, offsets, workspace = scratch.permuted, scratch.expert_offsets, scratch.workspace
    tile = plan.fp8_tile_rows(num_rows, num_local)
    fused = jax.jit(lambda *a: gemm.fp8_gemm._fp8_swiglu_experts_call(*a, num_rows, tile))(rows, *gu, *dn, offsets, workspace)
    out, _, _, _, hidden_rows, q_act, act_scale = fused

    def three_steps(rows, gu, gus, dn, dns, offsets, ws):
        h, ws = gemm.fp8_forward(rows, gu, gus, offsets, ws, num_rows, tile)
        act = gemm.gated_silu(h, rows.dtype)
        return h, fp8.quantize_rows(act), gemm.fp8_forward(act, dn, dns, offsets, ws, num_rows, tile)[0]
    h, (want_q, want_scale), want = jax.jit(three_steps)(rows, *gu, *dn, offsets, workspace)
    np.testing.assert_array_equal(np.asarray(hidden_rows, np.float32), np.asarray(h, np.float32))
    differ = np.asarray(q_act).view(np.uint8) != np.asarray(want_q).view(np.uint8)
    assert differ.mean() <= 1e-3, differ.mean()
    np.testing.assert_allclose(np.asarray(act_scale), np.asarray(want_scale), rtol=2.0 ** -7)
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(out - want) <= 2.0 ** -7 * np.linalg.norm(want)
    assert_zero_past_groups(out, offsets)


FP8_SHAPES = [(name, t) for name in ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b") for t in (1, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_tokens", FP8_SHAPES, ids=[f"{n}-T{t}" for n, t in FP8_SHAPES])
def test_gpu_fp8_forward_model_shapes_at_decode(name, num_tokens):
    m = MODELS[name]
    config = MoEConfig(num_experts=m.num_experts, top_k=m.top_k, hidden_size=m.hidden_size, max_tokens=num_tokens,
                       dtype=BF16)
    assert plan.supports_fp8(m.hidden_size, m.ffn_size)
    scratch = routed_scratch(config, num_tokens)
    _check_fp8_forward(scratch, m.num_experts, m.hidden_size, 2 * m.ffn_size)
    _check_fp8_forward(scratch, m.num_experts, m.ffn_size, m.hidden_size, seed=5)
    _check_fp8_swiglu_forward(scratch, m.num_experts, m.hidden_size, m.ffn_size)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GROUPED_GEMM_EDGE_CASES))
def test_gpu_fp8_forward_edge_cases(case):
    kwargs, num_tokens, ids = grouped_gemm_edge_case(case)
    config = MoEConfig(dtype=BF16, **kwargs)
    scratch = routed_scratch(config, num_tokens, ids)
    _check_fp8_forward(scratch, config.num_local_experts, 256, 512)
    _check_fp8_forward(scratch, config.num_local_experts, 256, 512, num_rows=config.live_row_bound(num_tokens))
    _check_fp8_swiglu_forward(scratch, config.num_local_experts, 256, 256, num_rows=config.live_row_bound(num_tokens))


@pytest.mark.gpu
def test_gpu_fp8_layer_differentiates_in_x_like_the_cpu():
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=2, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (2, 256)).astype(BF16)
    loss = lambda p, x: jnp.sum(jax_moe.moe_layer(p, x, init_scratch(config))[0].astype(jnp.float32) ** 2)
    d_x = np.asarray(_on("gpu", jax.grad(loss, argnums=1), layer, x), np.float32)
    d_x_cpu = np.asarray(_on("cpu", jax.grad(loss, argnums=1), layer, x), np.float32)
    assert np.abs(d_x).sum() > 0
    np.testing.assert_allclose(d_x, d_x_cpu, atol=0.05 * np.abs(d_x_cpu).max(), rtol=5e-2)


@pytest.mark.gpu
def test_gpu_fp8_forward_reads_every_e4m3_value():
    """One-hot rows pick columns of weights [N, K] that hold every finite e4m3 bit pattern
    (subnormals and both zeros included) under power-of-two scales: the output is the dequantised
    column, exactly."""
    k, n, num_rows = 128, 256, 8
    bits = (np.arange(n)[:, None] * 7 + np.arange(k)[None, :]) % 256
    bits[(bits & 0x7f) == 0x7f] = 0  # e4m3fn's two NaNs
    q = jax.lax.bitcast_convert_type(jnp.asarray(bits[None], jnp.uint8), jnp.float8_e4m3fn)
    scale = jnp.asarray([[[0.5], [2.0 ** -7]]], jnp.float32)  # [1, N/128, K/128]
    picked = np.array([0, 3, 17, 40, 64, 90, 101, 127])
    rows = jnp.asarray(np.eye(k)[picked], BF16)
    offsets = jnp.asarray([0, num_rows], jnp.int32)
    got, _ = jax.jit(lambda *a: gemm.fp8_forward(*a, num_rows))(rows, q, scale, offsets, gemm.fp8_workspace(1))
    # Each output is q_w * 448 * fl(1/448) * scale_w in float32 roundings: within 2^-22 of the
    # dequantised weight, which bf16 holds exactly (e4m3 times a power of two), so it rounds to it.
    want = np.asarray(fp8.dequantize(q, scale))[0][:, picked].T
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert np.unique(bits[:, picked], axis=None).size == 254  # every finite pattern was read


def _check_fp8_decode(scratch, num_local, hidden, ffn, num_rows=None, rows_per_pass=8, seed=7, group_rows=None):
    """The FP8 decode kernel (both projections, SwiGLU in the gate/up epilogue) against float64
    products of its own quantised inputs: the activation against silu(gate) * up of the exact
    gate/up product (each rounded to bf16 as the kernel does: a bf16 ulp or two apart where the
    float32 sums round the other way), the output against the exact product of the quantised
    activation within the FP8 GEMM's bound; rows past the groups zero; and the CUTLASS path in norm.
    group_rows: the rows staged per pass (a bound an expert may exceed: it then takes more passes)."""
    num_rows = num_rows or scratch.permuted.shape[0]
    keys = jax.random.split(jax.random.key(seed))
    gu = scaled_normal(keys[0], (num_local, 2 * ffn, hidden), hidden, quantize=True)
    dn = scaled_normal(keys[1], (num_local, hidden, ffn), ffn, quantize=True)
    rows, offsets = scratch.permuted, scratch.expert_offsets
    out, act = jax.jit(lambda *a: gemm.fp8_gemm._fp8_decode_swiglu_call(*a, num_rows, rows_per_pass, group_rows))(
        rows, *gu, *dn, offsets)
    cpu = jax.devices("cpu")[0]
    q_rows, row_scale = jax.jit(fp8.quantize_rows)(jax.device_put(rows[:num_rows], cpu))
    hidden_rows, _ = _fp8_reference(q_rows, row_scale, *gu, offsets)
    gate, up = (np.asarray(jnp.asarray(h, BF16), np.float64) for h in np.split(hidden_rows, 2, axis=1))
    want_act = gate / (1.0 + np.exp(-gate)) * up
    live = int(np.clip(np.asarray(offsets)[-1], 0, num_rows))
    act = act[:live]  # (rows in no group: never written, the down product never reads them)
    got_act = np.asarray(act, np.float64)
    assert (np.abs(got_act - want_act[:live]) <= 2.0 ** -6 * np.abs(want_act[:live])
            + 2.0 ** -9 * np.abs(want_act).max(initial=0.0)).all()
    q_act, act_scale = jax.jit(fp8.quantize_rows)(jax.device_put(act, cpu))
    want, magnitude = _fp8_reference(q_act, act_scale, *dn, offsets)  # [live, H]
    got = np.asarray(out, np.float64)
    assert (np.abs(got[:live] - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * magnitude).all()
    assert_zero_past_groups(got, offsets)
    cutlass, _ = jax.jit(lambda *a: gemm.fp8_swiglu_forward(*a, num_rows, decode_rows=0))(
        rows, *gu, *dn, offsets, scratch.workspace)
    cutlass = np.asarray(cutlass, np.float64)
    assert np.linalg.norm(got - cutlass) <= 2.0 ** -7 * np.linalg.norm(cutlass)


DECODE_SHAPES = ([(name, t, 8) for name in ("mixtral", "qwen3_30b", "deepseek_v3", "qwen35_397b") for t in (1, 2)]
                 + [("qwen3_30b", 16, 8), ("qwen3_30b", 16, 16)])  # (DeepSeek-V3's float64 reference: 8 experts a second)


@pytest.mark.gpu
@pytest.mark.parametrize("name,num_tokens,rows_per_pass", DECODE_SHAPES,
                         ids=[f"{n}-T{t}-pass{r}" for n, t, r in DECODE_SHAPES])
def test_gpu_fp8_decode_kernel_model_shapes(name, num_tokens, rows_per_pass):
    m = MODELS[name]
    config = MoEConfig(num_experts=m.num_experts, top_k=m.top_k, hidden_size=m.hidden_size, max_tokens=num_tokens,
                       dtype=BF16)
    scratch = routed_scratch(config, num_tokens)
    _check_fp8_decode(scratch, m.num_experts, m.hidden_size, m.ffn_size, rows_per_pass=rows_per_pass,
                      group_rows=config.group_row_bound(num_tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_pass", gemm.FP8_DECODE_ROWS_PER_PASS)
@pytest.mark.parametrize("case", list(GROUPED_GEMM_EDGE_CASES))
def test_gpu_fp8_decode_kernel_edge_cases(case, rows_per_pass):
    """Empty experts, one expert with all 300 rows (many passes over its weights), dropped routes,
    align 8, an expert map, rows past the live count; K of 2 and 3 scale blocks (H 256, F 384); 3
    rows staged a pass where experts own more (a group_rows bound too small is slower, not wrong)."""
    kwargs, num_tokens, ids = grouped_gemm_edge_case(case)
    config = MoEConfig(dtype=BF16, **kwargs)
    scratch = routed_scratch(config, num_tokens, ids)
    _check_fp8_decode(scratch, config.num_local_experts, 256, 384, rows_per_pass=rows_per_pass)
    _check_fp8_decode(scratch, config.num_local_experts, 256, 384, rows_per_pass=rows_per_pass, group_rows=3)
    _check_fp8_decode(scratch, config.num_local_experts, 256, 384, num_rows=config.live_row_bound(num_tokens),
                      rows_per_pass=rows_per_pass)


@pytest.mark.gpu
def test_gpu_fp8_decode_kernel_shared_expert_group():
    """The FP8 shared expert's call at decode: one group of T rows."""
    for num_tokens, rows_per_pass in ((1, 8), (5, 8), (16, 16), (16, 8)):
        config = MoEConfig(num_experts=1, top_k=1, hidden_size=7168, max_tokens=num_tokens, dtype=BF16)
        scratch = routed_scratch(config, num_tokens, np.zeros((num_tokens, 1), np.int32))
        _check_fp8_decode(scratch, 1, 7168, 2048, rows_per_pass=rows_per_pass, group_rows=num_tokens)


def test_fp8_decode_rows_picks_the_decode_kernel_for_small_reads():
    """The decode kernel up to 360 MB of weights at up to 4 rows an expert, and up to 1.4 GB at up to 2."""
    assert plan.fp8_decode_rows(1, 1, 7168, 2048) == 8             # DeepSeek-V3's shared expert, T = 1: 44 MB
    assert plan.fp8_decode_rows(4, 1, 7168, 2048) == 8             # T = 4
    assert plan.fp8_decode_rows(16, 1, 7168, 2048) == 0            # T = 16: 16 rows an expert
    assert plan.fp8_decode_rows(8, 128, 2048, 768) == 8            # Qwen3-30B's experts, T = 1: 38 MB
    assert plan.fp8_decode_rows(10, 512, 4096, 1024) == 8          # Qwen3.5-397B's, T = 1: 126 MB
    assert plan.fp8_decode_rows(128, 128, 2048, 768) == 8          # Qwen3-30B's, T = 16: 383 MB, 1.6 rows an expert
    assert plan.fp8_decode_rows(256, 128, 2048, 768) == 0          # T = 32: 523 MB, 2.3 rows an expert
    assert plan.fp8_decode_rows(8, 256, 7168, 2048) == 8           # DeepSeek-V3's experts, T = 1: 348 MB
    assert plan.fp8_decode_rows(2, 8, 4096, 14336) == 8            # Mixtral's, T = 1: 330 MB
    assert plan.fp8_decode_rows(16, 8, 4096, 14336) == 0           # T = 8: 1.24 GB, 2.3 rows an expert
    assert plan.fp8_decode_rows(16, 256, 7168, 2048) == 8          # DeepSeek-V3's, T = 2: 684 MB
    assert plan.fp8_decode_rows(32, 256, 7168, 2048) == 8          # T = 4: 1.33 GB
    assert plan.fp8_decode_rows(64, 256, 7168, 2048) == 0          # T = 8: 2.5 GB
    assert plan.fp8_decode_rows(4096 * 8, 256, 7168, 2048) == 0    # prefill
    assert plan.fp8_decode_rows(1, 1, 256, plan.FP8_DECODE_MAX_K + 128) == 0  # F past the staging


def test_fp8_swiglu_forward_rejects_a_bad_decode_rows():
    rows, gu, dn = jnp.zeros((4, 128), BF16), fp8.quantize(jnp.ones((2, 256, 128))), fp8.quantize(jnp.ones((2, 128, 128)))
    offsets, ws = jnp.array([0, 2, 4], jnp.int32), gemm.fp8_workspace(2)
    with pytest.raises(ValueError, match=re.escape("fp8_swiglu_forward: decode_rows: expected 0 (the CUTLASS GEMMs), "
                                                   "one of (8, 16)")):
        gemm.fp8_swiglu_forward(rows, *gu, *dn, offsets, ws, 4, decode_rows=4)


RIDING_SHAPES = [(7168, 2048, 2048, 16, 8, 1), (7168, 2048, 2048, 16, 8, 2), (256, 384, 256, 8, 2, 16),
                 (256, 384, 640, 4, 1, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,ffn,shared_ffn,num_experts,top_k,num_tokens", RIDING_SHAPES,
                         ids=[f"H{h}-F{f}-Fs{s}-E{e}-k{k}-T{t}" for h, f, s, e, k, t in RIDING_SHAPES])
def test_gpu_fp8_shared_expert_rides_the_decode_launches_bitwise(hidden, ffn, shared_ffn, num_experts, top_k,
                                                                 num_tokens):
    """The shared expert in the routed experts' FP8 decode launches: both results the same bits as
    their calls apart (DeepSeek-V3's sizes at T = 1 and 2; Fs below and above F; 16 tokens, two
    passes of 8 shared rows)."""
    config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden, max_tokens=num_tokens, dtype=BF16)
    scratch = routed_scratch(config, num_tokens)
    keys = jax.random.split(jax.random.key(11), 5)
    gu, dn, sgu, sdn = fp8_swiglu_weights(keys, num_experts, hidden, ffn, shared_ffn)
    x = jax.random.normal(keys[4], (num_tokens, hidden)).astype(BF16)
    num_rows, group_rows = config.live_row_bound(num_tokens), config.group_row_bound(num_tokens)
    rows, offsets = scratch.permuted, scratch.expert_offsets
    both = jax.jit(lambda *a: gemm.fp8_decode_swiglu_with_shared(*a[:6], num_rows, *a[6:], group_rows=group_rows))
    routed, shared = both(rows, *gu, *dn, offsets, x, *sgu, *sdn)
    alone = jax.jit(lambda r, g, gs, d, ds, o, n, gr: gemm.fp8_gemm._fp8_decode_swiglu_call(r, g, gs, d, ds, o, n, 8, gr)[0],
                    static_argnums=(6, 7))
    want_routed = alone(rows, *gu, *dn, offsets, num_rows, group_rows)
    want_shared = alone(x, *(leaf[None] for leaf in (*sgu, *sdn)), jnp.array([0, num_tokens], jnp.int32),
                        num_tokens, num_tokens)
    np.testing.assert_array_equal(np.asarray(routed.view(jnp.uint16)), np.asarray(want_routed.view(jnp.uint16)))
    np.testing.assert_array_equal(np.asarray(shared.view(jnp.uint16)), np.asarray(want_shared.view(jnp.uint16)))
    assert np.abs(np.asarray(shared, np.float32)).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_gpu_fp8_layer_with_the_shared_expert_riding_is_the_layer_without(num_tokens):
    """moe_layer with FP8 experts and shared expert (and Qwen's shared gate) at decode: the same
    bits whether the shared expert rides the routed launches or runs a call of its own."""
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, max_tokens=num_tokens, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=256,
                                                        shared_gate=True))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(BF16)
    outs = []
    for rides in (True, False):
        layer_plan = jax_moe.plan_layer(config, num_tokens, layer, shared_in_decode_launch=rides)
        assert (layer_plan.shared == "fp8_routed_launch") == rides
        run = lambda p, x, s, layer_plan=layer_plan: jax_moe.moe_layer(p, x, s, plan=layer_plan)[0]
        hlo = jax.jit(run).lower(layer, x, init_scratch(config)).compile().as_text()
        assert hlo.count('custom_call_target="jax_moe_fp8_decode_swiglu_shared"') == rides
        outs.append(np.asarray(jax.jit(run)(layer, x, init_scratch(config)).view(jnp.uint16)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_fp8_decode_swiglu_with_shared_names_bad_operands():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=256, max_tokens=2, dtype=BF16)
    scratch = init_scratch(config)
    gu = fp8.quantize(jnp.ones((4, 256, 256)))
    dn = fp8.quantize(jnp.ones((4, 256, 128)))
    sgu, sdn = fp8.quantize(jnp.ones((256, 256))), fp8.quantize(jnp.ones((256, 128)))
    x = jnp.ones((2, 256), BF16)
    call = lambda x=x, sgu=sgu, sdn=sdn: gemm.fp8_decode_swiglu_with_shared(
        scratch.permuted, *gu, *dn, scratch.expert_offsets, 4, x, *sgu, *sdn)
    with pytest.raises(ValueError, match=re.escape("fp8_decode_swiglu_with_shared: x: expected [T, H=256] of the rows' "
                                                   "dtype bfloat16 with T from 1 to 16, got bfloat16[17, 256]")):
        call(x=jnp.ones((17, 256), BF16))
    with pytest.raises(ValueError, match=re.escape("shared_down: expected float8_e4m3fn[256, 128], got "
                                                   "float8_e4m3fn[128, 128]")):
        call(sdn=(sdn[0][:128], sdn[1][:1]))
    with pytest.raises(ValueError, match=re.escape("shared_gate_up_scale: expected float32[2, 2], got float32[1, 2]")):
        call(sgu=(sgu[0], sgu[1][:1]))
    routed, shared = call()  # off the GPU: the dequantised math, both shapes right
    assert routed.shape == (4, 256) and shared.shape == (2, 256)


def test_fp8_experts_with_shared_differentiate_as_the_two_calls():
    """The riding call's gradients in the rows and in x are the two calls' apart (off the GPU the
    forward is the dequantised math; the backward is the same code on every device)."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=256, max_tokens=3, dtype=BF16)
    scratch = routed_scratch(config, 3)
    keys = jax.random.split(jax.random.key(5), 5)
    gu = fp8.quantize(jax.random.normal(keys[0], (4, 256, 256)) / 16)
    dn = fp8.quantize(jax.random.normal(keys[1], (4, 256, 128)) / 16)
    sgu, sdn = fp8.quantize(jax.random.normal(keys[2], (512, 256)) / 16), fp8.quantize(jax.random.normal(keys[3], (256, 256)) / 16)
    x = jax.random.normal(keys[4], (3, 256)).astype(BF16)
    num_rows, group_rows = config.live_row_bound(3), config.group_row_bound(3)
    offsets, workspace = scratch.expert_offsets, scratch.workspace
    kernels = (plan.fp8_tile_rows(num_rows, 4), plan.fp8_decode_rows(num_rows, 4, 256, 128), group_rows)
    shared_kernels = (plan.fp8_tile_rows(3, 1), plan.fp8_decode_rows(3, 1, 256, 256), 3)

    def riding(rows, x):
        out, shared = experts._fp8_experts_with_shared(rows, *gu, *dn, offsets, x, *sgu, *sdn, num_rows, group_rows)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(shared.astype(jnp.float32) ** 3)

    def apart(rows, x):
        out = experts._fp8_experts(rows, *gu, *dn, offsets, num_rows, kernels, workspace)[0]
        shared = experts._fp8_experts(x, *(leaf[None] for leaf in (*sgu, *sdn)), jnp.array([0, 3], jnp.int32), 3,
                                      shared_kernels, gemm.fp8_workspace(1))[0]
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(shared.astype(jnp.float32) ** 3)

    got = jax.jit(jax.grad(riding, argnums=(0, 1)))(scratch.permuted, x)
    want = jax.jit(jax.grad(apart, argnums=(0, 1)))(scratch.permuted, x)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(w, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ---- FP8 rows quantised in permute (ops.permute_fp8, gemm.fp8_swiglu_quantized_forward) ----

def _permute_fp8_case(num_tokens=40, align=1, expert_map=None, seed=0):
    config = MoEConfig(num_experts=8, top_k=3, hidden_size=256, max_tokens=num_tokens, dtype=BF16, align=align,
                       expert_map=expert_map)
    keys = jax.random.split(jax.random.key(seed), 2)
    x = (jax.random.normal(keys[0], (num_tokens, 256)) * 3).astype(BF16)
    ids = jax.random.randint(keys[1], (num_tokens, 3), -1, 9)  # some dropped (-1 and 8 = E)
    return config, x, ids


def test_permute_fp8_names_bad_num_rows():
    config, x, ids = _permute_fp8_case()
    bound = config.live_row_bound(40)
    with pytest.raises(ValueError, match=re.escape(f"permute_fp8: num_rows: expected an int from {bound} "
                                                   f"(live_row_bound(T)) to {config.capacity} (capacity), got 7")):
        jax_moe.ops.permute_fp8(x, ids, init_scratch(config), 7)


def test_permute_fp8_is_permute_then_quantize_rows_off_the_gpu():
    config, x, ids = _permute_fp8_case(align=4)
    num_rows = config.live_row_bound(40)
    scratch, q, scale = jax.jit(jax_moe.ops.permute_fp8, static_argnums=3)(x, ids, init_scratch(config), num_rows)
    want = jax.jit(jax_moe.permute)(x, ids, init_scratch(config))
    q_want, scale_want = fp8.quantize_rows(want.permuted[:num_rows])
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q_want).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(scale_want))
    for name in ("dest_index", "expert_offsets", "group_sizes"):
        np.testing.assert_array_equal(np.asarray(getattr(scratch, name)), np.asarray(getattr(want, name)))


def _fp8_experts_two_ways(config, x, ids):
    """experts._fp8_permuted_experts and permute + experts._fp8_experts: outputs and d x of each."""
    keys = jax.random.split(jax.random.key(3), 2)
    gu = fp8.quantize(jax.random.normal(keys[0], (8, 256, 256)) / 16)
    dn = fp8.quantize(jax.random.normal(keys[1], (8, 256, 128)) / 16)
    num_rows = config.live_row_bound(x.shape[0])

    def fused(x):
        out, _ = experts._fp8_permuted_experts(x, ids, init_scratch(config), *gu, *dn, num_rows,
                                               plan.fp8_tile_rows(num_rows, 8))
        return out

    def apart(x):
        scratch = jax_moe.permute(x, ids, init_scratch(config))
        return experts._fp8_experts(scratch.permuted, *gu, *dn, scratch.expert_offsets, num_rows,
                                    (plan.fp8_tile_rows(num_rows, 8), 0, None), scratch.workspace)[0]

    results = []
    for fn in (fused, apart):
        loss = lambda x: jnp.sum(fn(x).astype(jnp.float32) ** 2)
        results.append((np.asarray(jax.jit(fn)(x), np.float32), np.asarray(jax.jit(jax.grad(loss))(x), np.float32)))
    return results


def test_fp8_permuted_experts_differentiate_as_permute_then_the_fp8_call():
    """Off the GPU: the forward is the dequantised math from the quantised rows (the same as the
    call's up to float32 rounding); the backward recomputes the rows and is the same code."""
    config, x, ids = _permute_fp8_case(align=2)
    (out, d_x), (out_want, d_x_want) = _fp8_experts_two_ways(config, x, ids)
    assert np.abs(out_want).max() > 0 and np.abs(d_x_want).max() > 0
    np.testing.assert_allclose(out, out_want, atol=0.02 * np.abs(out_want).max(), rtol=0.02)
    np.testing.assert_array_equal(d_x, d_x_want)


@pytest.mark.gpu
@pytest.mark.parametrize("align, expert_map", [(1, None), (4, None), (1, (0, -1, 1, 2, -1, 3, 4, 5))],
                         ids=["plain", "align4", "expert_map"])
def test_gpu_permute_fp8_is_permute_then_quantize_rows_bitwise(align, expert_map):
    config, x, ids = _permute_fp8_case(num_tokens=700, align=align, expert_map=expert_map)
    num_rows = config.live_row_bound(700)
    gpu = jax.devices("gpu")[0]
    x, ids = jax.device_put((x, ids), gpu)
    fn = jax.jit(jax_moe.ops.permute_fp8, static_argnums=3)
    hlo = fn.lower(x, ids, init_scratch(config), num_rows).compile().as_text()
    assert 'custom_call_target="jax_moe_permute_fp8"' in hlo
    dirty = init_scratch(config)  # a scratch holding another permute's rows and indices first
    dirty = jax.jit(jax_moe.permute)(x[::-1], ids, dirty)
    scratch, q, scale = fn(x, ids, dirty, num_rows)
    want = jax.jit(jax_moe.permute)(x, ids, init_scratch(config))
    q_want, scale_want = jax.jit(fp8.quantize_rows)(want.permuted[:num_rows])
    # The live rows (padding included); rows past them are unspecified, as the permuted rows the
    # FP8 call quantised there were (the GEMMs write zeros there, unpermute never reads them).
    live = int(want.expert_offsets[-1])
    assert 0 < live < num_rows
    np.testing.assert_array_equal(np.asarray(q[:live]).view(np.uint8), np.asarray(q_want[:live]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale[:live]), np.asarray(scale_want[:live]))
    for name in ("dest_index", "src_index", "expert_offsets", "group_sizes"):
        np.testing.assert_array_equal(np.asarray(getattr(scratch, name)), np.asarray(getattr(want, name)))


@pytest.mark.gpu
def test_gpu_fp8_permuted_experts_are_the_fp8_call_on_permuted_rows_bitwise():
    config, x, ids = _permute_fp8_case(num_tokens=600, align=2)
    x, ids = jax.device_put((x, ids), jax.devices("gpu")[0])
    (out, d_x), (out_want, d_x_want) = _fp8_experts_two_ways(config, x, ids)
    assert np.abs(out_want).max() > 0 and np.abs(d_x_want).max() > 0
    np.testing.assert_array_equal(out, out_want)
    np.testing.assert_array_equal(d_x, d_x_want)


@pytest.mark.gpu
def test_gpu_fp8_layer_quantizing_in_permute_is_the_layer_without():
    """moe_layer with FP8 experts at prefill: the same bits, and the same d x, whether permute
    quantises the tokens or the FP8 call quantises permute's bf16 rows."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=256, max_tokens=512, dtype=BF16)
    params = fp8.quantize_params(jax_moe.init_moe_params(jax.random.key(0), config, 1, 128, shared_ffn_size=128))
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (512, 256)).astype(BF16)
    outs = []
    for fused in (True, False):
        layer_plan = jax_moe.plan_layer(config, 512, layer, quantize_in_permute=fused)
        assert (layer_plan.permute == "fp8_quantize") == fused
        run = lambda p, x, s, layer_plan=layer_plan: jax_moe.moe_layer(p, x, s, plan=layer_plan)[0]
        hlo = jax.jit(run).lower(layer, x, init_scratch(config)).compile().as_text()
        assert hlo.count('custom_call_target="jax_moe_permute_fp8"') == fused
        loss = lambda x, layer_plan=layer_plan: jnp.sum(
            jax_moe.moe_layer(layer, x, init_scratch(config), plan=layer_plan)[0].astype(jnp.float32) ** 2)
        outs.append((np.asarray(jax.jit(run)(layer, x, init_scratch(config)).view(jnp.uint16)),
                     np.asarray(jax.jit(jax.grad(loss))(x).view(jnp.uint16))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
