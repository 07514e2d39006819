"""jax_moe.hf.load_moe against transformers' own MoE blocks (issue 15).

tests/fixtures/hf/ holds tiny random checkpoints of the five families and, for fixed inputs, the
outputs of every MoE layer's transformers block (``model.model.layers[j].mlp``), written by
tests/fixtures/make_hf_fixtures.py with torch and transformers. Here only jax_moe runs: each
checkpoint loads, and every MoE layer of ``moe_layer`` on the loaded params equals transformers'
output (float32: <= 1e-5 relative to the output's largest magnitude).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import hf, init_scratch, routing
from jax_moe import moe_layer, moe_stack

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
OUTPUTS = dict(np.load(FIXTURES / "outputs.npz"))
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe", "deepseek_v3"]
# The MoE layers of each fixture, in checkpoint order (Qwen2-MoE's layer 1 is mlp_only; DeepSeek-V3's
# first layer is dense).
MOE_LAYERS = {"mixtral": [0, 1], "qwen2_moe": [0, 2], "qwen3_moe": [0, 1], "qwen3_5_moe_text": [0, 1],
              "qwen3_5_moe": [0, 1], "deepseek_v3": [1, 2]}


def _layer_outputs(name):
    return [OUTPUTS[f"{name}/layer{j}"] for j in MOE_LAYERS[name]]


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_layers_equal_transformers(name):
    assert sorted(k.split("/")[1] for k in OUTPUTS if k.startswith(name + "/layer")) == \
        [f"layer{j}" for j in MOE_LAYERS[name]]
    config, params = hf.load_moe(FIXTURES / name, max_tokens=16, dtype=jnp.float32)
    x = jnp.asarray(OUTPUTS[f"{name}/x"])
    assert params["router"].shape[0] == len(MOE_LAYERS[name])
    worst = 0.0
    for i, want in enumerate(_layer_outputs(name)):
        layer = jax.tree.map(lambda a: a[i], params)
        y, _ = jax.jit(moe_layer)(layer, x, init_scratch(config))
        error = float(np.abs(np.asarray(y) - want).max() / np.abs(want).max())
        worst = max(worst, error)
        assert error <= 1e-5, (name, i, error)
    print(f"{name}: max relative error {worst:.2e}")


def test_family_specifics_are_loaded():
    config, params = hf.load_moe(FIXTURES / "deepseek_v3", max_tokens=4)
    assert (config.scoring, config.n_group, config.topk_group, config.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert params["router_bias"].shape == (2, 8) and np.abs(np.asarray(params["router_bias"])).max() > 0
    assert params["shared_gate_up"].shape == (2, 32, 32) and "shared_gate" not in params
    config, params = hf.load_moe(FIXTURES / "qwen2_moe", max_tokens=4)  # sharded, norm_topk_prob False
    assert not config.renormalize and config.top_k == 3
    assert params["shared_gate"].shape == (2, 32, 1) and params["shared_gate_up"].shape == (2, 32, 48)
    assert set(hf.load_moe(FIXTURES / "qwen3_moe", max_tokens=4)[1]) == {"router", "gate_up", "down"}


def test_bf16_checkpoint_stays_bf16_and_runs_in_a_stack():
    config, params = hf.load_moe(FIXTURES / "mixtral", max_tokens=8)
    assert config.dtype == jnp.bfloat16 and all(a.dtype == jnp.bfloat16 for a in params.values())
    x = jnp.asarray(OUTPUTS["mixtral/x"]).astype(jnp.bfloat16)[None]  # [1, T, H]: a batch axis
    y, _ = jax.jit(moe_stack)(params, x, init_scratch(config))
    assert y.shape == x.shape and np.isfinite(np.asarray(y, np.float32)).all()
    # One layer in bf16 against transformers' float32 output of the same (bf16-valued) weights.
    layer0 = jax.tree.map(lambda a: a[0], params)
    y0, _ = jax.jit(moe_layer)(layer0, x[0], init_scratch(config))
    want = OUTPUTS["mixtral/layer0"]
    assert np.abs(np.asarray(y0, np.float32) - want).max() <= 2e-2 * np.abs(want).max()


def test_transformers_load_balancing_loss():
    logits, mask = OUTPUTS["lb/logits"], OUTPUTS["lb/mask"]
    np.testing.assert_allclose(float(routing.load_balancing_loss(logits, 2)), OUTPUTS["lb/loss"], rtol=1e-6)
    np.testing.assert_allclose(float(routing.load_balancing_loss(logits, 2, mask)), OUTPUTS["lb/loss_masked"],
                               rtol=1e-6)


def _copy(tmp_path, name) -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def test_published_config_names_load(tmp_path):
    # Published Qwen3-MoE configs say num_experts where transformers 5 writes num_local_experts.
    folder = _copy(tmp_path, "qwen3_moe")
    config = json.loads((folder / "config.json").read_text())
    _edit_config(folder, num_local_experts=None, num_experts=config["num_local_experts"])
    loaded, params = hf.load_moe(folder, max_tokens=8, dtype=jnp.float32)
    y, _ = moe_layer(jax.tree.map(lambda a: a[0], params), jnp.asarray(OUTPUTS["qwen3_moe/x"]), init_scratch(loaded))
    np.testing.assert_allclose(np.asarray(y), OUTPUTS["qwen3_moe/layer0"], rtol=1e-4, atol=1e-5)


def test_bad_checkpoints_raise_clear_errors(tmp_path):
    from safetensors.numpy import load_file, save_file
    with pytest.raises(ValueError, match=r"model_type: expected one of .*got 'llama'"):
        folder = _copy(tmp_path, "qwen3_moe")
        _edit_config(folder, model_type="llama")
        hf.load_moe(folder, max_tokens=4)
    with pytest.raises(ValueError, match="quantization_config: expected DeepSeek-V3's FP8"):
        folder = _copy(tmp_path / "q", "deepseek_v3")
        _edit_config(folder, quantization_config={"quant_method": "gptq", "bits": 4})
        hf.load_moe(folder, max_tokens=4)
    with pytest.raises(ValueError, match="experts_fp8: keeping the FP8 experts needs H, F and the shared expert's width multiples of 128"):
        _edit_config(folder, quantization_config={"quant_method": "fp8"})  # the fixture's H = 32
        hf.load_moe(folder, max_tokens=4)
    with pytest.raises(ValueError, match="experts_fp8: quantising the FP8 experts needs H, F .* leave experts_fp8 None"):
        hf.load_moe(_copy(tmp_path / "b", "qwen3_moe"), max_tokens=4, experts_fp8=True)  # a bf16 checkpoint, H = 32
    with pytest.raises(ValueError, match=r"scoring_func: expected one of \('sigmoid',\).*'softmax'"):
        folder = _copy(tmp_path / "s", "deepseek_v3")
        _edit_config(folder, scoring_func="softmax")
        hf.load_moe(folder, max_tokens=4)
    folder = _copy(tmp_path / "m", "qwen3_moe")
    tensors = load_file(folder / "model.safetensors")
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != missing}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{missing}': expected in the checkpoint, missing"):
        hf.load_moe(folder, max_tokens=4)
    tensors[missing] = tensors[missing][:, :-1]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{missing}': expected shape \(16, 32\), got \(16, 31\)"):
        hf.load_moe(folder, max_tokens=4)
    with pytest.raises(ValueError, match="expected a checkpoint folder with config.json"):
        hf.load_moe(tmp_path / "nowhere", max_tokens=4)


# ---- FP8 checkpoints (DeepSeek-V3's format) -----------------------------------------------------

_SAFETENSORS_CODES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}


def _write_safetensors(path, tensors):
    """A safetensors file written by hand: safetensors' NumPy API cannot write float8."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _SAFETENSORS_CODES[str(array.dtype)], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def _fp8_deepseek_checkpoint(folder, num_experts=4, hidden=256, ffn=128):
    """A one-layer DeepSeek-V3 FP8 checkpoint (every Linear e4m3 with 128 x 128 block scales)."""
    from jax_moe import fp8
    import ml_dtypes
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "first_k_dense_replace": 0,
              "n_routed_experts": num_experts, "num_experts_per_tok": 2, "hidden_size": hidden,
              "moe_intermediate_size": ffn, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "hidden_act": "silu", "torch_dtype": "bfloat16",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(config))
    block = "model.layers.0.mlp."
    tensors = {block + "gate.weight": rng.standard_normal((num_experts, hidden)).astype(ml_dtypes.bfloat16),
               block + "gate.e_score_correction_bias": rng.standard_normal(num_experts).astype(np.float32)}

    def linear(name, out_f, in_f):
        q, scale_inv = fp8.quantize(jnp.asarray(rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)))
        tensors[name + ".weight"] = np.asarray(q)
        tensors[name + ".weight_scale_inv"] = np.asarray(scale_inv)

    for e in range(num_experts):
        for name, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
            linear(f"{block}experts.{e}.{name}", *shape)
    for name, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
        linear(f"{block}shared_experts.{name}", *shape)
    _write_safetensors(folder / "model.safetensors", tensors)
    return tensors


def test_fp8_checkpoint_loads_without_dequantising(tmp_path):
    from jax_moe import fp8
    tensors = _fp8_deepseek_checkpoint(tmp_path / "fp8")
    config, params = hf.load_moe(tmp_path / "fp8", max_tokens=4)
    assert config.dtype == jnp.bfloat16 and config.scoring == "sigmoid"
    assert params["gate_up"].dtype == jnp.float8_e4m3fn and params["down"].dtype == jnp.float8_e4m3fn
    assert params["gate_up"].shape == (1, 4, 256, 256) and params["down"].shape == (1, 4, 256, 128)
    assert params["gate_up_scale_inv"].shape == (1, 4, 2, 2) and params["down_scale_inv"].shape == (1, 4, 2, 1)
    expert = "model.layers.0.mlp.experts.2."
    # As stored, [out, in]: gate rows then up rows, each with its own scale grid.
    np.testing.assert_array_equal(np.asarray(params["gate_up"][0, 2, 128:], np.float32),
                                  tensors[expert + "up_proj.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(params["gate_up_scale_inv"][0, 2, 1]),
                                  tensors[expert + "up_proj.weight_scale_inv"][0])
    np.testing.assert_array_equal(np.asarray(params["down_scale_inv"][0, 2]),
                                  tensors[expert + "down_proj.weight_scale_inv"])
    # The shared expert stays FP8 the same way (no expert axis).
    shared = "model.layers.0.mlp.shared_experts."
    assert params["shared_gate_up"].dtype == jnp.float8_e4m3fn and params["shared_gate_up"].shape == (1, 256, 256)
    assert params["shared_down"].shape == (1, 256, 128) and params["shared_down_scale_inv"].shape == (1, 2, 1)
    np.testing.assert_array_equal(np.asarray(params["shared_gate_up"][0, :128], np.float32),
                                  tensors[shared + "gate_proj.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(params["shared_gate_up_scale_inv"][0, 1]),
                                  tensors[shared + "up_proj.weight_scale_inv"][0])
    # The same checkpoint dequantised on load holds the same weights (bf16 rounding of the same
    # products, in the bf16 experts' [in, out] layout).
    _, dense = hf.load_moe(tmp_path / "fp8", max_tokens=4, experts_fp8=False)
    assert dense["gate_up"].dtype == jnp.bfloat16 and not any(n.endswith("_scale_inv") for n in dense)
    for names in (fp8.QUANTIZED_NAMES, fp8.SHARED_QUANTIZED_NAMES):
        for got, want in zip((dense[n] for n in names), fp8.expert_weights(params, jnp.bfloat16, names)):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # The FP8 layer also quantises the rows per 1 x 128 group (DeepSeek-V3's FP8 inference): within
    # that error of the dequantised layer (the exact FP8 math is test_fp8's): the rows entering the
    # routed and the shared experts' four projections, each rounded to e4m3 (a step of 2^-4
    # relative), measured at 3-4 % in norm on this layer; bound: one e4m3 step in norm.
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.bfloat16)
    got, _ = moe_stack(params, x, init_scratch(config))
    want, _ = moe_stack(dense, x, init_scratch(config))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert 0 < np.linalg.norm(got - want) <= 2.0 ** -4 * np.linalg.norm(want)
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()


def _fp8_qwen_checkpoint(folder, model_type, num_experts=4, hidden=256, ffn=128, shared=256, fp8_router=False,
                         fp8_experts=True):
    """A one-layer Qwen2-MoE (shared expert and its gate) or Qwen3-MoE FP8 checkpoint as Qwen's -FP8
    releases store them: the experts e4m3 with 128 x 128 block scales; the router and the shared
    expert's gate bf16, or the router FP8 too with ``fp8_router``. ``fp8_experts=False``: every
    weight bf16 and no quantization_config (a bf16 checkpoint of the same shapes)."""
    from jax_moe import fp8
    import ml_dtypes
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    config = {"model_type": model_type, "num_hidden_layers": 1, "num_experts": num_experts, "num_experts_per_tok": 2,
              "hidden_size": hidden, "moe_intermediate_size": ffn, "norm_topk_prob": model_type == "qwen3_moe",
              "hidden_act": "silu", "torch_dtype": "bfloat16"}
    if fp8_experts:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]}
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = shared
    (folder / "config.json").write_text(json.dumps(config))
    block = "model.layers.0.mlp."
    tensors = {}

    def linear(name, out_f, in_f, quantised=True):
        w = rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)
        if not quantised:
            tensors[name + ".weight"] = w.astype(ml_dtypes.bfloat16)
            return
        q, scale_inv = fp8.quantize(jnp.asarray(w))
        tensors[name + ".weight"] = np.asarray(q)
        tensors[name + ".weight_scale_inv"] = np.asarray(scale_inv)

    linear(block + "gate", num_experts, hidden, quantised=fp8_router)
    for e in range(num_experts):
        for name, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
            linear(f"{block}experts.{e}.{name}", *shape, quantised=fp8_experts)
    if model_type == "qwen2_moe":
        for name, shape in (("gate_proj", (shared, hidden)), ("up_proj", (shared, hidden)),
                            ("down_proj", (hidden, shared))):
            linear(f"{block}shared_expert.{name}", *shape, quantised=fp8_experts)
        linear(block + "shared_expert_gate", 1, hidden, quantised=False)
    _write_safetensors(folder / "model.safetensors", tensors)
    return tensors


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_qwen_fp8_checkpoint_loads_without_dequantising(tmp_path, model_type):
    """Qwen's -FP8 releases (Qwen3-30B-A3B-FP8 and the like): the experts (and Qwen2-MoE's shared
    expert) stay FP8 as stored; the FP8 stack is within the rows' quantisation error of the same
    checkpoint dequantised on load."""
    from jax_moe import fp8
    tensors = _fp8_qwen_checkpoint(tmp_path / "fp8", model_type)
    config, params = hf.load_moe(tmp_path / "fp8", max_tokens=4)
    assert fp8.is_quantized(params) and params["gate_up"].shape == (1, 4, 256, 256)
    np.testing.assert_array_equal(np.asarray(params["down"][0, 3], np.float32),
                                  tensors["model.layers.0.mlp.experts.3.down_proj.weight"].astype(np.float32))
    assert fp8.shared_is_quantized(params) == (model_type == "qwen2_moe")
    if model_type == "qwen2_moe":
        assert params["shared_gate_up"].shape == (1, 512, 256) and params["shared_gate"].dtype == jnp.bfloat16
    _, dense = hf.load_moe(tmp_path / "fp8", max_tokens=4, experts_fp8=False)
    assert not any(name.endswith(fp8.SCALE_SUFFIX) for name in dense)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.bfloat16)
    got, _ = moe_stack(params, x, init_scratch(config))
    want, _ = moe_stack(dense, x, init_scratch(config))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert 0 < np.linalg.norm(got - want) <= 2.0 ** -4 * np.linalg.norm(want)


def test_fp8_router_is_dequantised(tmp_path):
    """An FP8 Linear that is not an expert (a router stored as e4m3) is read dequantised, not as raw
    e4m3 values."""
    from jax_moe import fp8
    tensors = _fp8_qwen_checkpoint(tmp_path / "fp8", "qwen3_moe", fp8_router=True)
    _, params = hf.load_moe(tmp_path / "fp8", max_tokens=4, dtype=jnp.float32)
    gate = "model.layers.0.mlp.gate"
    want = fp8.dequantize(jnp.asarray(tensors[gate + ".weight"]), jnp.asarray(tensors[gate + ".weight_scale_inv"]))
    np.testing.assert_array_equal(np.asarray(params["router"][0]), np.asarray(want).T)


def test_bf16_checkpoint_quantised_on_request(tmp_path):
    from jax_moe import fp8
    _fp8_qwen_checkpoint(tmp_path / "bf16", "qwen2_moe", fp8_experts=False)  # H, F, Fs multiples of 128
    config, params = hf.load_moe(tmp_path / "bf16", max_tokens=4)
    assert not fp8.is_quantized(params) and params["gate_up"].dtype == jnp.bfloat16
    _, quantised = hf.load_moe(tmp_path / "bf16", max_tokens=4, experts_fp8=True)
    want = fp8.quantize_params(params)
    assert set(quantised) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(quantised[name], np.float32), np.asarray(want[name], np.float32))
