"""Trace-time validation (issue 2, item 4): each misuse is a ValueError naming the argument, the
expected and the actual value, raised while tracing (under jax.jit, on abstract values), never an
assert, a kernel crash or a silently wrong answer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import reference

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

# capacity = 8 * 2 + 6 * (4 - 1) = 34, rounded up to 36.
CONFIG = jax_moe.MoEConfig(num_experts=6, top_k=2, hidden_size=16, max_tokens=8, dtype=BF16, align=4)
CAPACITY = 36


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_scratch(config=CONFIG, **buffers):
    """A MoEScratch of ShapeDtypeStructs for ``config``, with some buffers replaced."""
    scratch = jax.tree.map(lambda b: sds(b.shape, b.dtype), jax.eval_shape(lambda: jax_moe.init_scratch(config)))
    return scratch.replace(**buffers)


SCRATCH = abstract_scratch()
X, IDS = sds((5, 16), BF16), sds((5, 2), I32)
Y, WEIGHTS = sds((CAPACITY, 16), BF16), sds((5, 2), F32)


def concrete(tree):
    """Zeros in place of every ShapeDtypeStruct (for the eager calls)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a,
                        tree)


def run(fn, args, mode):
    if mode == "eager":
        return fn(*concrete(args))
    # Lowering abstract arguments: no data exists, so any error must come from tracing.
    return jax.jit(fn).lower(*args)


def message(op, arg, expected, actual):
    """A regex for '<op>: <arg>: expected ...<expected>..., got <actual>...'.

    Literal parts are escaped; an ``actual`` given as a compiled pattern is used as a regex.
    """
    actual = actual.pattern if isinstance(actual, re.Pattern) else re.escape(actual)
    return rf"^{re.escape(op)}: {re.escape(arg)}: expected .*{re.escape(expected)}.*, got {actual}"


MODES = ["eager", "jit"]
PERMUTES = {"native": jax_moe.permute, "reference": reference.permute}
UNPERMUTES = {"native": jax_moe.unpermute, "reference": reference.unpermute}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", PERMUTES)
def test_valid_arguments_pass(impl, mode):
    """Control: the arguments the error cases below start from are accepted."""
    run(PERMUTES[impl], (X, IDS, SCRATCH), mode)
    run(UNPERMUTES[impl], (Y, WEIGHTS, SCRATCH), mode)
    run(UNPERMUTES[impl], (sds((CAPACITY, 16), F32), sds((8, 2), BF16), SCRATCH), mode)


OTHER = jax_moe.MoEConfig(num_experts=6, top_k=2, hidden_size=8, max_tokens=4, dtype=BF16, align=4)
# Same capacity (4 * 4 + 6 * 3 = 34 -> 36) and hidden size as CONFIG, but dest_index is [4, 4].
SAME_CAPACITY = jax_moe.MoEConfig(num_experts=6, top_k=4, hidden_size=16, max_tokens=4, dtype=BF16, align=4)
F32_CONFIG = jax_moe.MoEConfig(num_experts=6, top_k=2, hidden_size=16, max_tokens=8, dtype=F32, align=4)


def foreign_scratch(config):
    """Buffers built for ``config`` wrapped with CONFIG: a scratch from another config."""
    return jax_moe.MoEScratch(*abstract_scratch(config).buffers(), config=CONFIG)


SCRATCH_ERRORS = {
    "not_a_scratch_tuple": (SCRATCH.buffers(), "scratch", "a MoEScratch", "tuple"),
    "not_a_scratch_dict": ({"permuted": SCRATCH.permuted}, "scratch", "a MoEScratch", "dict"),
    "not_a_scratch_array": (SCRATCH.permuted, "scratch", "a MoEScratch",
                            re.compile(r"(ArrayImpl|\w*Tracer)\b")),
    "other_config_hidden_and_tokens": (foreign_scratch(OTHER), "scratch.permuted", "bfloat16[36, 16]",
                                       "bfloat16[28, 8]"),
    "other_config_dtype": (foreign_scratch(F32_CONFIG), "scratch.permuted", "bfloat16[36, 16]",
                           "float32[36, 16]"),
    "other_config_top_k": (foreign_scratch(SAME_CAPACITY), "scratch.dest_index", "int32[8, 2]", "int32[4, 4]"),
    "group_sizes_wrong_length": (abstract_scratch(group_sizes=sds((5,), I32)), "scratch.group_sizes",
                                 "int32[6]", "int32[5]"),
    "expert_offsets_wrong_length": (abstract_scratch(expert_offsets=sds((6,), I32)), "scratch.expert_offsets",
                                    "int32[7]", "int32[6]"),
    "src_index_wrong_dtype": (abstract_scratch(src_index=sds((CAPACITY,), F32)), "scratch.src_index",
                              "int32[36]", "float32[36]"),
}


def test_other_config_fixture_shapes():
    assert OTHER.capacity == 28 and SAME_CAPACITY.capacity == CAPACITY == CONFIG.capacity


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", PERMUTES)
@pytest.mark.parametrize("name", SCRATCH_ERRORS)
def test_bad_scratch(name, impl, mode):
    scratch, arg, expected, actual = SCRATCH_ERRORS[name]
    with pytest.raises(ValueError, match=message("permute", arg, expected, actual)):
        run(PERMUTES[impl], (X, IDS, scratch), mode)
    with pytest.raises(ValueError, match=message("unpermute", arg, expected, actual)):
        run(UNPERMUTES[impl], (Y, WEIGHTS, scratch), mode)


def test_other_config_message_names_the_config():
    with pytest.raises(ValueError, match=r"for its config MoEConfig\(.*hidden_size=16.*\).*another config"):
        run(jax_moe.permute, (X, IDS, foreign_scratch(OTHER)), "jit")


PERMUTE_ERRORS = {
    # name: (x, topk_ids, argument, expected, actual)
    "x_rank_1": (sds((16,), BF16), IDS, "x", "rank-2 array [T, H]", "shape (16,)"),
    "x_rank_3": (sds((1, 5, 16), BF16), IDS, "x", "rank-2 array [T, H]", "shape (1, 5, 16)"),
    "x_hidden_size": (sds((5, 8), BF16), IDS, "x", "hidden size x.shape[1] == 16", "8"),
    "x_dtype_float32": (sds((5, 16), F32), IDS, "x", "dtype bfloat16", "float32"),
    "x_dtype_float16": (sds((5, 16), jnp.float16), IDS, "x", "dtype bfloat16", "float16"),
    "x_dtype_int": (sds((5, 16), I32), IDS, "x", "dtype bfloat16", "int32"),
    "too_many_tokens": (sds((9, 16), BF16), sds((9, 2), I32), "x", "at most 8 tokens (config.max_tokens)", "9"),
    "zero_tokens": (sds((0, 16), BF16), sds((0, 2), I32), "x", "at least 1 token", "0"),
    "ids_top_k": (X, sds((5, 3), I32), "topk_ids", "shape (5, 2) [T, top_k]", "(5, 3)"),
    "ids_tokens": (X, sds((4, 2), I32), "topk_ids", "shape (5, 2) [T, top_k]", "(4, 2)"),
    "ids_rank_1": (X, sds((10,), I32), "topk_ids", "shape (5, 2) [T, top_k]", "(10,)"),
    "ids_float32": (X, sds((5, 2), F32), "topk_ids", "an integer dtype", "float32"),
    "ids_bfloat16": (X, sds((5, 2), BF16), "topk_ids", "an integer dtype", "bfloat16"),
    "ids_bool": (X, sds((5, 2), jnp.bool_), "topk_ids", "an integer dtype", "bool"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", PERMUTES)
@pytest.mark.parametrize("name", PERMUTE_ERRORS)
def test_bad_permute_arguments(name, impl, mode):
    x, ids, arg, expected, actual = PERMUTE_ERRORS[name]
    with pytest.raises(ValueError, match=message("permute", arg, expected, actual)):
        run(PERMUTES[impl], (x, ids, SCRATCH), mode)


UNPERMUTE_ERRORS = {
    # name: (y, topk_weights, argument, expected, actual)
    "y_int32": (sds((CAPACITY, 16), I32), WEIGHTS, "y", "dtype float16, bfloat16 or float32", "int32"),
    "y_int8": (sds((CAPACITY, 16), jnp.int8), WEIGHTS, "y", "dtype float16, bfloat16 or float32", "int8"),
    "y_uint8": (sds((CAPACITY, 16), jnp.uint8), WEIGHTS, "y", "dtype float16, bfloat16 or float32", "uint8"),
    "y_float8_e4m3fn": (sds((CAPACITY, 16), jnp.float8_e4m3fn), WEIGHTS, "y",
                        "dtype float16, bfloat16 or float32", "float8_e4m3fn"),
    "y_float8_e5m2": (sds((CAPACITY, 16), jnp.float8_e5m2), WEIGHTS, "y",
                      "dtype float16, bfloat16 or float32", "float8_e5m2"),
    "y_bool": (sds((CAPACITY, 16), jnp.bool_), WEIGHTS, "y", "dtype float16, bfloat16 or float32", "bool"),
    "y_hidden_size": (sds((CAPACITY, 8), BF16), WEIGHTS, "y", "shape (R, 16) with 28 <= R <= 36", "(36, 8)"),
    # T=5 tokens can fill 5*2 + 6*(4-1) = 28 rows: fewer rows of y cannot hold them, more than R_cap never exist.
    "y_rows_below_live_bound": (sds((27, 16), BF16), WEIGHTS, "y", "shape (R, 16) with 28 <= R <= 36", "(27, 16)"),
    "y_rows_above_capacity": (sds((37, 16), BF16), WEIGHTS, "y", "shape (R, 16) with 28 <= R <= 36", "(37, 16)"),
    "y_rank_3": (sds((1, CAPACITY, 16), BF16), WEIGHTS, "y", "shape (R, 16)", "(1, 36, 16)"),
    "weights_top_k": (Y, sds((5, 3), F32), "topk_weights", "shape (T, 2) with 1 <= T <= 8", "(5, 3)"),
    "weights_too_many_tokens": (Y, sds((9, 2), F32), "topk_weights", "shape (T, 2) with 1 <= T <= 8", "(9, 2)"),
    "weights_zero_tokens": (Y, sds((0, 2), F32), "topk_weights", "shape (T, 2) with 1 <= T <= 8", "(0, 2)"),
    "weights_rank_1": (Y, sds((10,), F32), "topk_weights", "shape (T, 2)", "(10,)"),
    "weights_float16": (Y, sds((5, 2), jnp.float16), "topk_weights", "dtype float32 or bfloat16", "float16"),
    "weights_int32": (Y, sds((5, 2), I32), "topk_weights", "dtype float32 or bfloat16", "int32"),
    "weights_float8": (Y, sds((5, 2), jnp.float8_e4m3fn), "topk_weights", "dtype float32 or bfloat16",
                       "float8_e4m3fn"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", UNPERMUTES)
@pytest.mark.parametrize("name", UNPERMUTE_ERRORS)
def test_bad_unpermute_arguments(name, impl, mode):
    y, weights, arg, expected, actual = UNPERMUTE_ERRORS[name]
    with pytest.raises(ValueError, match=message("unpermute", arg, expected, actual)):
        run(UNPERMUTES[impl], (y, weights, SCRATCH), mode)


def test_errors_surface_while_tracing_a_larger_program():
    """Inside a jitted scan over layers the misuse still fails at trace time, as a ValueError."""

    def stack(x, ids, scratch):
        def layer(carry, layer_ids):
            hidden, scratch = carry
            scratch = jax_moe.permute(hidden, layer_ids, scratch)
            return (hidden, scratch), None
        return jax.lax.scan(layer, (x, scratch), ids)[0]

    jax.jit(stack).trace(X, sds((3, 5, 2), I32), SCRATCH)  # control: valid
    with pytest.raises(ValueError, match=message("permute", "topk_ids", "an integer dtype", "float32")):
        jax.jit(stack).trace(X, sds((3, 5, 2), F32), SCRATCH)
    with pytest.raises(ValueError, match=message("permute", "x", "dtype bfloat16", "float32")):
        jax.jit(stack).trace(sds((5, 16), F32), sds((3, 5, 2), I32), SCRATCH)


def test_init_scratch_rejects_non_config():
    with pytest.raises(ValueError, match=message("init_scratch", "config", "a MoEConfig", "dict")):
        jax_moe.init_scratch(dict(num_experts=4, top_k=2, hidden_size=8, max_tokens=4))


# ---------------------------------------------------------------------------------------------
# MoEConfig: invalid fields are rejected at construction.

BASE = dict(num_experts=4, top_k=2, hidden_size=16, max_tokens=8)

CONFIG_ERRORS = {
    # name: (overrides, field, expected, actual)
    "num_experts_zero": (dict(num_experts=0), "num_experts", "a positive integer", "0"),
    "num_experts_negative": (dict(num_experts=-3), "num_experts", "a positive integer", "-3"),
    "num_experts_bool": (dict(num_experts=True), "num_experts", "a positive integer", "True"),
    "num_experts_float": (dict(num_experts=4.0), "num_experts", "a positive integer", "4.0"),
    "num_experts_str": (dict(num_experts="4"), "num_experts", "a positive integer", "'4'"),
    "num_experts_none": (dict(num_experts=None), "num_experts", "a positive integer", "None"),
    "top_k_zero": (dict(top_k=0), "top_k", "a positive integer", "0"),
    "hidden_size_zero": (dict(hidden_size=0), "hidden_size", "a positive integer", "0"),
    "hidden_size_negative": (dict(hidden_size=-16), "hidden_size", "a positive integer", "-16"),
    "max_tokens_zero": (dict(max_tokens=0), "max_tokens", "a positive integer", "0"),
    "align_zero": (dict(align=0), "align", "a positive integer", "0"),
    "align_float": (dict(align=1.5), "align", "a positive integer", "1.5"),
    "dtype_int32": (dict(dtype=jnp.int32), "dtype", "one of float16, bfloat16, float32", "int32"),
    "dtype_float64": (dict(dtype=np.float64), "dtype", "one of float16, bfloat16, float32", "float64"),
    "dtype_float8": (dict(dtype=jnp.float8_e4m3fn), "dtype", "one of float16, bfloat16, float32",
                     "float8_e4m3fn"),
    "dtype_nonsense": (dict(dtype="nonsense"), "dtype", "one of float16, bfloat16, float32", "'nonsense'"),
    "scoring": (dict(scoring="relu"), "scoring", "one of ('softmax', 'sigmoid')", "'relu'"),
    "renormalize_str": (dict(renormalize="no"), "renormalize", "a bool", "'no'"),  # not silently True
    "renormalize_two": (dict(renormalize=2), "renormalize", "a bool", "2"),
    "expert_map_short": (dict(expert_map=(0, 1, 2)), "expert_map", "shape (4,)", "(3,)"),
    "expert_map_long": (dict(expert_map=(0, 1, 2, 3, -1)), "expert_map", "shape (4,)", "(5,)"),
    "expert_map_2d": (dict(expert_map=((0, 1), (2, 3))), "expert_map", "shape (4,)", "(2, 2)"),
    "expert_map_below_minus_one": (dict(expert_map=(0, -2, 1, 2)), "expert_map", "entries >= -1", "[-2]"),
    "expert_map_duplicate": (dict(expert_map=(0, 1, 1, -1)), "expert_map",
                             "non-negative entries to be exactly 0..2 each once", "[0, 1, 1] (duplicates [1])"),
    "expert_map_gap": (dict(expert_map=(0, -1, 2, -1)), "expert_map",
                       "non-negative entries to be exactly 0..1 each once", "[0, 2]"),
    "expert_map_out_of_range": (dict(expert_map=(0, 1, 7, -1)), "expert_map",
                                "non-negative entries to be exactly 0..2 each once", "[0, 1, 7]"),
    "expert_map_no_local": (dict(expert_map=(-1, -1, -1, -1)), "expert_map", "at least one local expert",
                            "none"),
    "expert_map_float": (dict(expert_map=(0.0, 1.0, 2.0, 3.0)), "expert_map", "integers", "dtype float64"),
}


@pytest.mark.parametrize("name", CONFIG_ERRORS)
def test_invalid_config(name):
    overrides, field, expected, actual = CONFIG_ERRORS[name]
    pattern = rf"^MoEConfig\.{field}: expected .*{re.escape(expected)}.*got {re.escape(actual)}"
    with pytest.raises(ValueError, match=pattern):
        jax_moe.MoEConfig(**{**BASE, **overrides})


def test_valid_configs_normalise_and_hash():
    """Control for the table above: accepted spellings give equal, hashable configs."""
    as_tuple = jax_moe.MoEConfig(**BASE, dtype="bfloat16", expert_map=(1, -1, 0, 2))
    as_array = jax_moe.MoEConfig(**BASE, dtype=jnp.bfloat16, expert_map=np.array([1, -1, 0, 2]))
    assert as_tuple == as_array and hash(as_tuple) == hash(as_array)
    assert as_tuple.num_local_experts == 3
    assert jax_moe.MoEConfig(**{**BASE, "num_experts": np.int64(4)}).num_experts == 4
    assert jax_moe.MoEConfig(**BASE, renormalize=np.bool_(False)) == jax_moe.MoEConfig(**BASE, renormalize=0)


@pytest.mark.parametrize("name, residual, addend, message", [
    ("residual_shape", sds((5, 16), BF16), None, r"unpermute_add: residual: expected bfloat16\[4, 16\]"),
    ("residual_dtype", sds((4, 16), F32), None, r"unpermute_add: residual: expected bfloat16\[4, 16\].*got float32"),
    ("addend_shape", sds((4, 16), BF16), sds((4, 8), BF16), r"unpermute_add: addend: expected bfloat16\[4, 16\]"),
])
def test_bad_unpermute_add_arguments(name, residual, addend, message):
    """The decode layer's unpermute with its adds: residual and addend must be [T, H] of y's dtype."""
    y, weights = sds((CAPACITY, 16), BF16), sds((4, 2), F32)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(jax_moe.ops.unpermute_add, y, weights, abstract_scratch(), residual, addend)


def test_unpermute_add_off_the_gpu_is_the_adds():
    """On the CPU (its XLA branch) unpermute_add is residual + (unpermute + addend) exactly."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 16)), BF16)
    scratch = jax_moe.permute(x, jnp.asarray(rng.integers(0, 6, (4, 2)), I32), jax_moe.init_scratch(CONFIG))
    y = jnp.asarray(rng.standard_normal((CAPACITY, 16)), BF16)
    weights = jnp.asarray(rng.random((4, 2)), F32)
    residual, addend = (jnp.asarray(rng.standard_normal((4, 16)) * s, BF16) for s in (50, 1))
    got = jax.jit(jax_moe.ops.unpermute_add)(y, weights, scratch, residual, addend)
    want = residual + (jax_moe.unpermute(y, weights, scratch) + addend)
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))


def _empty_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    return tmp_path


# The helpers around the layer: routing, its losses and bias update, FP8 (de)quantisation, params,
# the scratch's placement and checkpoint loading. Each call is what a user could plausibly get wrong.
HELPER_MISUSES = [
    ("route_router_H", lambda: jax_moe.routing.route(sds((8, 6), F32), sds((3, 16), F32), CONFIG),
     r"route: router: expected shape \(16, 6\) \[hidden_size, num_experts\], got \(8, 6\)"),
    ("route_x_rank", lambda: jax_moe.routing.route(sds((16, 6), F32), sds((16,), F32), CONFIG),
     r"route: x: expected shape \(T, 16\)"),
    ("expert_counts_float_ids", lambda: jax_moe.routing.expert_counts(sds((3, 2), F32), 6),
     "expert_counts: topk_ids: expected an integer dtype, got float32"),
    ("load_balancing_top_k_0", lambda: jax_moe.routing.load_balancing_loss(sds((4, 6), F32), 0),
     r"load_balancing_loss: top_k: expected an integer in \[1, 6\]"),
    ("load_balancing_top_k_past_E", lambda: jax_moe.routing.load_balancing_loss(sds((4, 6), F32), 7),
     r"load_balancing_loss: top_k: expected an integer in \[1, 6\].*got 7"),
    ("bias_counts_shape", lambda: jax_moe.routing.update_router_bias(sds((2, 6), F32), sds((6,), I32), 1e-3),
     r"update_router_bias: counts: expected bias's shape \(2, 6\)"),
    ("bias_rate_negative", lambda: jax_moe.routing.update_router_bias(sds((6,), F32), sds((6,), I32), -1e-3),
     "update_router_bias: rate: expected a finite number >= 0"),
    ("quantize_vector", lambda: jax_moe.fp8.quantize(sds((128,), F32)),
     r"quantize: weights: expected a floating array \[\.\.\., R, C\], got float32\[128\]"),
    ("quantize_ints", lambda: jax_moe.fp8.quantize(sds((128, 128), I32)), "quantize: weights: expected a floating"),
    ("dequantize_scale", lambda: jax_moe.fp8.dequantize(sds((4, 256, 130), jnp.float8_e4m3fn), sds((4, 2, 1), F32)),
     r"dequantize: scale_inv: expected shape \(4, 2, 2\)"),
    ("quantize_rows_K", lambda: jax_moe.fp8.quantize_rows(sds((4, 100), BF16)),
     "quantize_rows: rows: expected .R, K. with K a multiple of 128, got shape \\(4, 100\\)"),
    ("dequantize_rows_scale", lambda: jax_moe.fp8.dequantize_rows(sds((4, 256), jnp.float8_e4m3fn), sds((4, 1), F32)),
     r"dequantize_rows: scale: expected shape \(4, 2\)"),
    ("params_int_dtype", lambda: jax_moe.init_moe_params(jax.random.key(0), CONFIG, 1, 8, dtype=I32),
     "init_moe_params: dtype: expected a floating dtype"),
    ("scratch_device_name", lambda: jax_moe.init_scratch(CONFIG, device="cpu"),
     "init_scratch: device: expected a jax.Device, a jax.sharding.Sharding or None, got str 'cpu'"),
]


@pytest.mark.parametrize("name, call, message", HELPER_MISUSES, ids=[m[0] for m in HELPER_MISUSES])
def test_helpers_reject_bad_arguments(name, call, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(call)  # at trace time: on abstract values


def test_init_moe_params_sizes_are_positive_integers():
    """num_layers, ffn_size and shared_ffn_size: Python or NumPy integers >= 1 (shapes come out as
    Python ints); a bool, a float, zero or a negative size names the argument."""
    params = jax.eval_shape(lambda: jax_moe.init_moe_params(jax.random.key(0), CONFIG, np.int64(2), np.int32(8),
                                                            shared_ffn_size=np.int64(4)))
    assert params["gate_up"].shape == (2, 6, 16, 16) and params["shared_down"].shape == (2, 4, 16)
    for name in ("num_layers", "ffn_size", "shared_ffn_size"):
        for bad in (0, -2, 2.0, True, "2"):
            kwargs = {"num_layers": 1, "ffn_size": 8, "shared_ffn_size": 4, name: bad}
            with pytest.raises(ValueError, match=rf"init_moe_params: {name}: expected a positive integer, got {bad!r}"):
                jax_moe.init_moe_params(jax.random.key(0), CONFIG, kwargs.pop("num_layers"), kwargs.pop("ffn_size"),
                                        **kwargs)


def test_load_moe_checks_max_tokens_first(tmp_path):
    """Before reading anything: a config.json that is also incomplete is not what the error names."""
    import jax_moe.hf
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"load_moe: max_tokens: expected a positive integer, got {bad!r}"):
            jax_moe.hf.load_moe(_empty_checkpoint(tmp_path), max_tokens=bad)


# ---- errors raised inside the composite functions name the function the user called ----

def _stack_case(num_layers=2):
    config = jax_moe.MoEConfig(num_experts=4, top_k=2, hidden_size=16, max_tokens=8, dtype=F32)
    params = jax_moe.init_moe_params(jax.random.key(0), config, num_layers, 8)
    return config, params, jnp.zeros((8, 16), F32)


def test_moe_stack_errors_name_moe_stack_and_the_argument():
    config, params, x = _stack_case()
    scratch = jax_moe.init_scratch(config)
    layer = jax.tree.map(lambda a: a[0], params)
    other = jax_moe.init_scratch(jax_moe.MoEConfig(num_experts=8, top_k=2, hidden_size=32, max_tokens=8, dtype=F32))
    wide_gate_up = dict(params, gate_up=jnp.zeros((2, 4, 16, 20), F32))
    cases = [
        (lambda: jax_moe.moe_stack(params, jnp.zeros((16, 16), F32), scratch),
         "moe_stack: x: expected 1 to 8 tokens in all (the scratch's config.max_tokens), got 16"),
        (lambda: jax_moe.moe_stack(params, x, other), "moe_stack: scratch: built for another config than the params"),
        (lambda: jax_moe.moe_stack(layer, x, scratch),
         "moe_stack: params: expected params stacked on a leading layer axis L"),
        (lambda: jax_moe.moe_layer(params, x, scratch), "moe_layer: params: expected one layer's params"),
        (lambda: jax_moe.moe_stack(wide_gate_up, x, scratch),
         "moe_stack: params['gate_up'] and params['down']: expected down's F to be half gate_up's 2F, got 2F = 20"),
        (lambda: jax_moe.moe_layer(layer, x.astype(BF16), scratch),
         "moe_layer: x: expected dtype float32 (the scratch's config.dtype), got bfloat16"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()


def test_moe_config_rejects_more_routes_than_experts():
    with pytest.raises(ValueError, match=re.escape("MoEConfig.top_k: expected at most num_experts=4 (each token "
                                                   "picks distinct experts), got 5")):
        jax_moe.MoEConfig(num_experts=4, top_k=5, hidden_size=16, max_tokens=8)


def test_vmap_of_moe_stack_says_what_to_do_instead():
    config, params, _ = _stack_case()
    x = jnp.ones((3, 2, 16), F32)
    with pytest.raises(ValueError, match=re.escape("moe_stack: x: jax.vmap of moe_stack is not supported")):
        jax.vmap(lambda x: jax_moe.moe_stack(params, x, jax_moe.init_scratch(config))[0])(x)
    y, _ = jax_moe.moe_stack(params, x, jax_moe.init_scratch(config))  # the batch as leading axes instead
    assert y.shape == x.shape
