"""MoE layer parameters: their layout, random initialisation, and the trace-time checks of them.

Parameters are a plain dict of arrays, one layer's or stacked on a leading layer axis L
(``init_moe_params``; ``jax_moe.hf.load_moe`` gives the same layout from a checkpoint):
``router`` [L, H, E], ``gate_up`` [L, El, H, 2F] (gate first), ``down`` [L, El, F, H], and
optionally DeepSeek-V3's ``router_bias`` [L, E], a shared expert (``shared_gate_up`` [L, H, 2Fs],
``shared_down`` [L, Fs, H], Qwen's ``shared_gate`` [L, H, 1]), and FP8 experts' ``*_scale_inv``
(``jax_moe.fp8``: e4m3 weights in the checkpoints' [out, in] layout).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import fp8
from jax_moe.config import MoEConfig, positive_int
from jax_moe.experts import SHARED_NAMES

PARAM_NAMES = ("router", "gate_up", "down")
FP8_SCALE_NAMES = tuple(name + fp8.SCALE_SUFFIX for name in fp8.QUANTIZED_NAMES)
SHARED_FP8_SCALE_NAMES = tuple(name + fp8.SCALE_SUFFIX for name in fp8.SHARED_QUANTIZED_NAMES)
# The leaves with a (local) expert axis: sharded over devices by expert parallelism.
EXPERT_PARAM_NAMES = ("gate_up", "down") + FP8_SCALE_NAMES
# Optional leaves: the correction bias of DeepSeek-V3's routing, shared experts, FP8 experts' scales.
OPTIONAL_PARAM_NAMES = ("router_bias",) + SHARED_NAMES + FP8_SCALE_NAMES + SHARED_FP8_SCALE_NAMES


# draw_by_matrix draws a leaf larger than this in float32 one [.., .] matrix at a time (each from
# its own key): drawn whole, DeepSeek-V3's experts take float32 temporaries several times their
# bf16 size (28 GiB arrays a layer, eager or jitted), more than a card holds beside the result.
# Smaller leaves are drawn whole, with the values they always had.
WHOLE_DRAW_MAX_BYTES = 1 << 30


def draw_by_matrix(key: jax.Array, shape: tuple[int, ...], draw, max_whole_bytes: int = WHOLE_DRAW_MAX_BYTES):
    """``draw(key, shape)`` (float32 draws made into a leaf, or a pytree of leaves) as it is, or,
    past ``max_whole_bytes`` of float32, one ``draw(k, shape[-2:])`` per matrix from split keys
    (``lax.map``), each output leaf's leading axis reshaped to ``shape[:-2]``. Only the result is
    ever whole. (init_moe_params' draws, and the GPU tests' model-sized weights.)"""
    if 4 * math.prod(shape) <= max_whole_bytes:
        return draw(key, shape)
    lead = tuple(shape[:-2])

    def by_matrix(keys):
        stacked = lax.map(lambda k: draw(k, tuple(shape[-2:])), keys)
        return jax.tree.map(lambda leaf: leaf.reshape(lead + leaf.shape[1:]), stacked)
    return jax.jit(by_matrix)(jax.random.split(key, math.prod(lead)))


def init_moe_params(key: jax.Array, config: MoEConfig, num_layers: int, ffn_size: int, dtype=None, *,
                    shared_ffn_size: int | None = None, shared_gate: bool = False,
                    router_bias: bool = False, max_whole_draw_bytes: int = WHOLE_DRAW_MAX_BYTES) -> dict:
    """Random parameters of ``num_layers`` MoE layers, stacked on a leading layer axis.

    Args:
      key: a ``jax.random`` key.
      config: the ``MoEConfig`` of every layer (E, El, H come from it).
      num_layers: L, the number of layers.
      ffn_size: F, each expert's intermediate size.
      dtype: parameter dtype; None means ``config.dtype``.
      shared_ffn_size: Fs, the width of a shared SwiGLU expert every token goes through (DeepSeek-V3:
        ``n_shared_experts * F``; Qwen2/3.5-MoE: ``shared_expert_intermediate_size``); None: none.
      shared_gate: the shared expert's output is scaled by ``sigmoid(x @ shared_gate)`` (Qwen).
      router_bias: a float32 [E] correction bias for choosing experts (DeepSeek-V3), zeros.
      max_whole_draw_bytes: a leaf of more float32 bytes than this is drawn a matrix at a time.

    Returns:
      ``{"router": [L, H, E], "gate_up": [L, El, H, 2F], "down": [L, El, F, H]}`` of ``dtype``, plus
      ``shared_gate_up`` [L, H, 2Fs], ``shared_down`` [L, Fs, H], ``shared_gate`` [L, H, 1] and
      ``router_bias`` [L, E] when asked for. ``gate_up[..., :F]`` is the SwiGLU gate,
      ``gate_up[..., F:]`` the up projection. Only the El local experts of ``config.expert_map``
      have weights (local index order). Weights are normal / sqrt(fan-in); a leaf over
      ``max_whole_draw_bytes`` of float32 is drawn a matrix at a time, so that model-sized params
      need little more memory than themselves.
    """
    if not isinstance(config, MoEConfig):
        raise ValueError(f"init_moe_params: config: expected a MoEConfig, got {type(config).__name__}")
    num_layers = positive_int("init_moe_params: num_layers", num_layers)
    ffn_size = positive_int("init_moe_params: ffn_size", ffn_size)
    if shared_ffn_size is not None:
        shared_ffn_size = positive_int("init_moe_params: shared_ffn_size", shared_ffn_size)
    if shared_gate and shared_ffn_size is None:
        raise ValueError("init_moe_params: shared_gate: expected shared_ffn_size too (a gate needs a shared expert)")
    dtype = config.dtype if dtype is None else jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"init_moe_params: dtype: expected a floating dtype (or None: config.dtype), got {dtype}")
    hidden, experts, local = config.hidden_size, config.num_experts, config.num_local_experts
    keys = jax.random.split(key, 6)

    def normal(k, shape, fan_in):
        return draw_by_matrix(k, shape, lambda k, shape: (
            jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))).astype(dtype), max_whole_draw_bytes)

    params = {
        "router": normal(keys[0], (num_layers, hidden, experts), hidden),
        "gate_up": normal(keys[1], (num_layers, local, hidden, 2 * ffn_size), hidden),
        "down": normal(keys[2], (num_layers, local, ffn_size, hidden), ffn_size),
    }
    if shared_ffn_size is not None:
        params["shared_gate_up"] = normal(keys[3], (num_layers, hidden, 2 * shared_ffn_size), hidden)
        params["shared_down"] = normal(keys[4], (num_layers, shared_ffn_size, hidden), shared_ffn_size)
    if shared_gate:
        params["shared_gate"] = normal(keys[5], (num_layers, hidden, 1), hidden)
    if router_bias:
        params["router_bias"] = jnp.zeros((num_layers, experts), jnp.float32)
    return params


def check_param_keys(op: str, params) -> None:
    """params must be a dict holding at least ``PARAM_NAMES``; ValueError otherwise."""
    if not isinstance(params, dict) or not all(n in params for n in PARAM_NAMES):
        raise ValueError(f"{op}: params: expected a dict with keys {PARAM_NAMES} (from init_moe_params), "
                         f"got {type(params).__name__}" + (f" with keys {sorted(params)}" if isinstance(params, dict)
                                                           else ""))


def check_layer_params(op: str, layer_params, config: MoEConfig, stacked: bool) -> None:
    """Trace-time shape check of (stacked) layer params against ``config`` (the scratch's); a
    ValueError naming ``op`` (the function the user called) and the argument otherwise."""
    check_param_keys(op, layer_params)
    unknown = sorted(set(layer_params) - set(PARAM_NAMES) - set(OPTIONAL_PARAM_NAMES))
    if unknown:
        raise ValueError(f"{op}: params: expected keys among {PARAM_NAMES + OPTIONAL_PARAM_NAMES}, got unknown "
                         f"{unknown}")
    not_float = sorted(n for n, leaf in layer_params.items()
                       if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
    if not_float:
        raise ValueError(f"{op}: params[{not_float[0]!r}]: expected a floating dtype (float32, bfloat16, float16, or "
                         f"float8_e4m3fn for FP8 experts), got {jnp.result_type(layer_params[not_float[0]])}")
    if ("shared_gate_up" in layer_params) != ("shared_down" in layer_params) or (
            "shared_gate" in layer_params and "shared_gate_up" not in layer_params):
        present = sorted(n for n in SHARED_NAMES if n in layer_params)
        raise ValueError(f"{op}: params: expected shared_gate_up and shared_down together (shared_gate only with "
                         f"them), got {present}")
    router_shape = tuple(jnp.shape(layer_params["router"]))
    if stacked and len(router_shape) == 2:
        raise ValueError(f"{op}: params: expected params stacked on a leading layer axis L (init_moe_params' "
                         f"layout: router [L, H, E]), got one layer's (router {router_shape}): pass them to "
                         f"moe_layer, or add the axis with jax.tree.map(lambda a: a[None], params)")
    if not stacked and len(router_shape) == 3:
        raise ValueError(f"{op}: params: expected one layer's params (router [H, E]), got params stacked on a "
                         f"layer axis (router {router_shape}): pass them to moe_stack, or take layer l with "
                         f"jax.tree.map(lambda a: a[l], params)")
    lead = router_shape[:1] if stacked and router_shape else ()
    hidden, experts, local = config.hidden_size, config.num_experts, config.num_local_experts
    if len(router_shape) == len(lead) + 2 and router_shape[len(lead):] != (hidden, experts):
        raise ValueError(f"{op}: scratch: built for another config than the params: its config has "
                         f"hidden_size={hidden} and num_experts={experts}, params['router'] is {router_shape} "
                         f"([{'L, ' if stacked else ''}H, E]); build the scratch with init_scratch(config) for "
                         f"these params")
    quantized = fp8.is_quantized(layer_params)  # FP8 experts keep the checkpoint's [out, in] layout
    ffn2 = jnp.shape(layer_params["gate_up"])[-2 if quantized else -1] if jnp.ndim(layer_params["gate_up"]) > 1 else -1
    shared_quantized = fp8.shared_is_quantized(layer_params)
    shared2 = (jnp.shape(layer_params["shared_gate_up"])[-2 if shared_quantized else -1]
               if jnp.ndim(layer_params.get("shared_gate_up", 0)) > 1 else -1)
    want = {
        "router": lead + (hidden, experts),
        "gate_up": lead + ((local, ffn2, hidden) if quantized else (local, hidden, ffn2)),
        "down": lead + ((local, hidden, ffn2 // 2) if quantized else (local, ffn2 // 2, hidden)),
        "router_bias": lead + (experts,),
        "shared_gate_up": lead + ((shared2, hidden) if shared_quantized else (hidden, shared2)),
        "shared_down": lead + ((hidden, shared2 // 2) if shared_quantized else (shared2 // 2, hidden)),
        "shared_gate": lead + (hidden, 1),
    }
    layout = "[L, " if stacked else "["
    # The gate/up width first: an odd one would otherwise surface as the down projection's shape.
    for name, width, axis in (("gate_up", ffn2, "2F"), ("shared_gate_up", shared2, "2Fs")):
        if name in layer_params and jnp.ndim(layer_params[name]) == len(want[name]) and (width < 2 or width % 2):
            raise ValueError(f"{op}: params[{name!r}]: expected an even {axis} >= 2 (the gate and up halves side "
                             f"by side), got {axis} = {width} in shape {tuple(jnp.shape(layer_params[name]))}")
    # Then the two projections against each other: which of them is off cannot be told, so name both.
    for up, down, axis, down_axis in (("gate_up", "down", "2F", "F"), ("shared_gate_up", "shared_down", "2Fs", "Fs")):
        if up not in layer_params or down not in layer_params or jnp.ndim(layer_params[down]) != len(want[down]):
            continue
        width = ffn2 if up == "gate_up" else shared2
        down_shape = tuple(jnp.shape(layer_params[down]))
        quantized_down = quantized if down == "down" else shared_quantized
        down_width = down_shape[-1] if quantized_down else down_shape[-2]
        # Only where down is right but for its F (a transposed or foreign down gets the shape message).
        with_own_width = tuple(want[down][:-1]) + (down_width,) if quantized_down else (
            tuple(want[down][:-2]) + (down_width, want[down][-1]))
        if tuple(jnp.shape(layer_params[up])) == want[up] and down_width != width // 2 and down_shape == with_own_width:
            raise ValueError(f"{op}: params[{up!r}] and params[{down!r}]: expected {down}'s {down_axis} to be half "
                             f"{up}'s {axis}, got {axis} = {width} in {up} {tuple(jnp.shape(layer_params[up]))} and "
                             f"{down_axis} = {down_width} in {down} {down_shape}")
    for name, shape in want.items():
        if name not in layer_params:
            continue
        have = tuple(jnp.shape(layer_params[name]))
        if have != shape:
            raise ValueError(
                f"{op}: params[{name!r}]: expected shape {shape} ({layout}... with H={hidden}, E={experts}, "
                f"El={local}, 2F and 2Fs even{'; FP8 experts [out, in]' if quantized or shared_quantized else ''}), "
                f"got {have}")
    _check_fp8_params(op, layer_params, layout, hidden, ffn2 // 2)
    if "shared_gate_up" in layer_params and "shared_down" in layer_params:
        _check_fp8_params(op, layer_params, layout, hidden, shared2 // 2, shared=True)


def _check_fp8_params(op: str, layer_params, layout: str, hidden: int, ffn: int,
                      shared: bool = False) -> None:
    """FP8 experts (``jax_moe.fp8``): both scales or none; e4m3 weights [.., El, out, in] with H and F
    multiples of 128, and [.., El, out/128, in/128] scales. ``shared``: the shared expert's, without El."""
    names, scale_names = ((fp8.SHARED_QUANTIZED_NAMES, SHARED_FP8_SCALE_NAMES) if shared
                          else (fp8.QUANTIZED_NAMES, FP8_SCALE_NAMES))
    what, width, expert_axis = ("an FP8 shared expert", "Fs", "") if shared else ("FP8 experts", "F", "El, ")
    present = [name for name in scale_names if name in layer_params]
    if not present:
        return
    if len(present) != len(scale_names):
        raise ValueError(f"{op}: params: expected {scale_names} together ({what}), got {present}")
    if hidden % fp8.BLOCK or ffn % fp8.BLOCK:
        raise ValueError(f"{op}: params: {what} need{'s' if shared else ''} H and {width} multiples of {fp8.BLOCK} "
                         f"(whole scale blocks along K for the rows' quantisation), got H={hidden}, {width}={ffn}")
    for name in names:
        weights, scales = layer_params[name], layer_params[name + fp8.SCALE_SUFFIX]
        if jnp.dtype(weights.dtype) != jnp.dtype(fp8.FP8):
            raise ValueError(f"{op}: params[{name!r}]: expected float8_e4m3fn next to {name + fp8.SCALE_SUFFIX!r}, "
                             f"got {weights.dtype}")
        out_f, in_f = jnp.shape(weights)[-2:]
        want = jnp.shape(weights)[:-2] + (fp8.num_blocks(out_f), fp8.num_blocks(in_f))
        if tuple(jnp.shape(scales)) != want or jnp.dtype(scales.dtype) != jnp.float32:
            raise ValueError(f"{op}: params[{name + fp8.SCALE_SUFFIX!r}]: expected float32 {want} ({layout}"
                             f"{expert_axis}out/128, in/128]), got {scales.dtype}{list(jnp.shape(scales))}")


def flat_tokens(op: str, x, config: MoEConfig) -> jax.Array:
    """x [..., H] -> [T, H] (T = all leading elements); a wrong H, dtype or token count is a
    ValueError naming ``op`` here."""
    shape = tuple(jnp.shape(x))
    if len(shape) < 1 or shape[-1] != config.hidden_size:
        raise ValueError(f"{op}: x: expected shape [..., {config.hidden_size}] (hidden_size last), got {shape}")
    if jnp.dtype(x.dtype) != config.dtype:
        raise ValueError(f"{op}: x: expected dtype {config.dtype} (the scratch's config.dtype), got {jnp.dtype(x.dtype)}")
    num_tokens = math.prod(shape[:-1])
    if not 1 <= num_tokens <= config.max_tokens:
        raise ValueError(f"{op}: x: expected 1 to {config.max_tokens} tokens in all (the scratch's "
                         f"config.max_tokens), got {num_tokens} in shape {shape}")
    return jnp.reshape(x, (-1, config.hidden_size))


def check_options(op: str, expert_fn, unroll=1) -> None:
    if expert_fn is not None and not callable(expert_fn):
        raise ValueError(f"{op}: expert_fn: expected None or a callable (layer_params, rows, group_sizes) -> rows, "
                         f"got {type(expert_fn).__name__}")
    if not isinstance(unroll, (bool, int, np.integer)) or (not isinstance(unroll, bool) and unroll < 0):
        raise ValueError(f"{op}: unroll: expected a bool or a non-negative int (lax.scan's), got {unroll!r}")


def moved_to_parallel(op: str, mesh, axis_name) -> None:
    if mesh is not None or axis_name is not None:
        raise ValueError(f"{op}: mesh/axis_name: expert parallelism is jax_moe.{op}_ep(..., mesh=, axis_name=) "
                         f"(with init_scratch_ep and shard_params); got mesh={mesh!r}, axis_name={axis_name!r}")


