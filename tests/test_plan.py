"""LayerPlan and plan_layer: the kernels a layer call runs, decided once, printable and pinnable.

Plans for the CUDA platform are made on any machine (``platform="cuda"``), so the choice rules are
tested here on the four benchmark models' shapes; the GPU tests check the programs run what the
plan says.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import fp8, plan
from jax_moe.bench.models import MODELS
from jax_moe.tuning import DEFAULT_TUNING, Tuning

BF16 = jnp.bfloat16


def _model(name, num_tokens, shared=False, quantized=False):
    """(config, params as shapes) of a benchmark model at T tokens, one layer."""
    m = MODELS[name]
    config = m.config(num_tokens)
    shared_ffn = m.ffn_size if shared else None
    params = jax.eval_shape(lambda: jax_moe.init_moe_params(jax.random.key(0), config, 1, m.ffn_size,
                                                            shared_ffn_size=shared_ffn))
    if quantized:
        params = jax.eval_shape(lambda p: fp8.quantize_params(p), params)
    return config, params


def test_cpu_plan_runs_xla_kernels():
    config, params = _model("qwen3_30b", 16, shared=True)
    got = jax_moe.plan_layer(config, 16, params, platform="cpu")
    assert (got.router, got.permute, got.experts, got.tile, got.shared) == ("xla", "plain", "ragged_dot", None, "xla")
    assert jax_moe.plan_layer(config, 16, params, expert_fn=lambda *a: a[1], platform="cuda").experts == "custom"


@pytest.mark.parametrize("num_tokens,tile,router,permute", [
    (1, "decode", "kernel", "prefetch"), (2, "decode", "kernel", "prefetch"), (8, "decode", "xla", "prefetch"),
    (16, "decode", "xla", "prefetch"), (32, "small", "xla", "plain"), (4096, "medium", "xla", "plain")])
def test_cuda_plan_of_qwen3_30b(num_tokens, tile, router, permute):
    config, params = _model("qwen3_30b", num_tokens)
    got = jax_moe.plan_layer(config, num_tokens, params, platform="cuda")
    assert (got.experts, got.tile, got.router, got.permute) == ("grouped_gemm", tile, router, permute)
    assert got.decode_rows_per_pass == (plan.decode_rows_per_pass(config.live_row_bound(num_tokens), 128,
                                                                   config.group_row_bound(num_tokens))
                                        if tile == "decode" else 0)
    assert got.norm_in_router == (router == "kernel")
    assert got.activations_in_gradient
    # Printable and hashable: a static argument of jit and custom_vjp.
    assert "tile='%s'" % tile in str(got) and hash(got) == hash(dataclasses.replace(got))


def test_cuda_plan_normalises_in_the_router_for_bf16_and_fp8_experts_alike():
    # One rule for both param kinds: at decode a stack's pre-norm rides the router's launch.
    for quantized in (False, True):
        config, params = _model("qwen3_30b", 1, quantized=quantized)
        got = jax_moe.plan_layer(config, 1, params, platform="cuda")
        assert (got.experts, got.router, got.norm_in_router) == (
            "fp8_grouped_gemm" if quantized else "grouped_gemm", "kernel", True)


def test_cuda_plan_streams_the_shared_expert_in_the_routed_decode_launches():
    config, params = _model("deepseek_v3", 1, shared=True)
    got = jax_moe.plan_layer(config, 1, params, platform="cuda")
    assert (got.tile, got.shared, got.shared_decode_rows_per_pass) == ("decode", "routed_launch", 1)
    apart = jax_moe.plan_layer(config, 1, params, platform="cuda", shared_in_decode_launch=False)
    assert apart.shared == "decode_kernel"
    training = got.for_training()
    assert (training.router, training.permute, training.shared, training.residual_in_unpermute) == (
        "xla", "plain", "decode_kernel", False)
    assert jax_moe.plan_layer(config, 1, params, platform="cuda", training=True) == training
    # Past the tuning's shared_decode_max_tokens the shared expert is XLA's dots.
    config, params = _model("deepseek_v3", 16, shared=True)
    assert jax_moe.plan_layer(config, 9, params, platform="cuda").shared == "xla"


def test_cuda_plan_of_fp8_experts():
    config, params = _model("deepseek_v3", 1, shared=True, quantized=True)
    decode = jax_moe.plan_layer(config, 1, params, platform="cuda")
    assert (decode.experts, decode.fp8_decode_rows_per_pass, decode.shared) == ("fp8_grouped_gemm", 8,
                                                                                 "fp8_routed_launch")
    assert jax_moe.plan_layer(config, 1, params, platform="cuda", fp8_decode_kernel=False).shared == "fp8_grouped_gemm"
    config, params = _model("deepseek_v3", 4096, shared=True, quantized=True)
    prefill = jax_moe.plan_layer(config, 4096, params, platform="cuda")
    assert (prefill.permute, prefill.fp8_decode_rows_per_pass, prefill.fp8_tile_rows) == ("fp8_quantize", 0, 128)
    assert jax_moe.plan_layer(config, 4096, params, platform="cuda", quantize_in_permute=False).permute == "plain"


def test_policy_keywords_switch_a_choice_off():
    config, params = _model("qwen3_30b", 1)
    assert jax_moe.plan_layer(config, 1, params, platform="cuda", decode_kernels=False).tile == "small"
    assert jax_moe.plan_layer(config, 1, params, platform="cuda", prefetch=False).permute == "plain"
    assert jax_moe.plan_layer(config, 1, params, platform="cuda", router_kernel=False).router == "xla"
    assert not jax_moe.plan_layer(config, 1, params, platform="cuda", router_normalizes=False).norm_in_router
    assert not jax_moe.plan_layer(config, 1, params, platform="cuda", residual_in_unpermute=False).residual_in_unpermute


def test_tuning_is_data_that_changes_the_plan():
    config, params = _model("qwen3_30b", 64)
    assert jax_moe.plan_layer(config, 64, params, platform="cuda").tile == "small"
    # Every threshold has its reason, and a table of other values changes the choice.
    assert all(DEFAULT_TUNING.why(f.name) for f in dataclasses.fields(Tuning))
    eager = Tuning(decode_max_rows_per_expert=8.0, decode_max_group_rows=64)
    assert jax_moe.plan_layer(config, 64, params, platform="cuda", tuning=eager).tile == "decode"


def test_layer_plan_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="LayerPlan: tile: expected one of"):
        plan.LayerPlan(4, experts="grouped_gemm", tile="huge")
    with pytest.raises(ValueError, match="LayerPlan: decode_rows_per_pass"):
        plan.LayerPlan(4, experts="grouped_gemm", tile="decode")
    with pytest.raises(ValueError, match="'routed_launch' rides the decode kernel"):
        plan.LayerPlan(4, experts="grouped_gemm", tile="small", shared="routed_launch")
    with pytest.raises(ValueError, match="'fp8_quantize' feeds the FP8 CUTLASS GEMMs only"):
        plan.LayerPlan(4, permute="fp8_quantize")


def test_a_plan_pins_the_layer_and_must_be_made_for_its_tokens():
    config = jax_moe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=8, dtype=jnp.float32)
    params = jax_moe.init_moe_params(jax.random.key(0), config, 2, 8)
    layer = jax.tree.map(lambda a: a[0], params)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    default = jax_moe.plan_layer(config, 8, layer)
    y, _ = jax_moe.moe_layer(layer, x, jax_moe.init_scratch(config), plan=default)
    want, _ = jax_moe.moe_layer(layer, x, jax_moe.init_scratch(config))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    with pytest.raises(ValueError, match="moe_layer: plan: expected a plan for this call's 8 tokens, got one made "
                                         "for 4"):
        jax_moe.moe_layer(layer, x, jax_moe.init_scratch(config), plan=default.replace(num_tokens=4))
    with pytest.raises(ValueError, match="moe_stack: plan: expected a LayerPlan"):
        jax_moe.moe_stack(params, x, jax_moe.init_scratch(config), plan="decode")


def test_light_fine_grained_layers_keep_the_decode_kernel_longer():
    # 128 rows over 128 experts expect 1.58 rows an owning expert: past decode_fine_max_rows_per_expert,
    # within decode_light_max_rows_per_expert while the ~82 owning experts weigh at most decode_light_max_bytes.
    light, heavy = 3 * 2048 * 768 * 2, 3 * 7168 * 2048 * 2  # bytes of a Qwen3-30B and a DeepSeek-V3 expert
    assert plan.pick_tile(128, 128, 16) == "small"  # expert bytes unknown: the fine-grained limit
    assert plan.pick_tile(128, 128, 16, expert_bytes=light) == "decode"
    assert plan.pick_tile(128, 128, 16, expert_bytes=heavy) == "small"
    assert plan.pick_tile(256, 128, 32, expert_bytes=light) == "small"  # 2.3 rows an expert: CUTLASS
    # DeepSeek-V3: 128 rows over 256 experts expect 1.27 rows an owning expert: CUTLASS; 64 rows 1.13: decode.
    assert plan.pick_tile(128, 256, 16, expert_bytes=heavy) == "small"
    assert plan.pick_tile(64, 256, 8, expert_bytes=heavy) == "decode"
    tuning = dataclasses.replace(DEFAULT_TUNING, decode_light_max_bytes=1e6)
    assert plan.pick_tile(128, 128, 16, expert_bytes=light, tuning=tuning) == "small"
