"""A functional MoE layer and a scanned stack of them that threads ONE scratch through every layer.

No classes with hidden state: parameters are a pytree of arrays stacked on a leading layer axis,
the scratch is a ``MoEScratch`` passed in and returned. ``moe_stack`` is a ``lax.scan`` over the
layer axis with the scratch in the carry, so the compiled program holds a single scratch however
deep the stack is, and a jitted step that donates the scratch gets it back in the same buffers.
Expert parallelism builds on this module (``jax_moe.parallel``: ``moe_layer_ep``, ``moe_stack_ep``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _validate, experts, fp8, ops, routing, stack
from jax_moe.config import MoEConfig, positive_int
from jax_moe.experts import (SHARED_NAMES, ExpertFn, run_experts_and_shared, shared_experts,  # noqa: F401
                             swiglu_experts, uses_grouped_matmul)
from jax_moe.ops import permute, unpermute
from jax_moe.routing import route, router_logits, router_scores  # noqa: F401 (public here too, as before)
from jax_moe.scratch import MoEScratch
from jax_moe.stack import rms_norm  # public here too, as before the stack module held it

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


def draw_by_matrix(key: jax.Array, shape: tuple[int, ...], draw):
    """``draw(key, shape)`` (float32 draws made into a leaf, or a pytree of leaves) as it is, or,
    past WHOLE_DRAW_MAX_BYTES of float32, one ``draw(k, shape[-2:])`` per matrix from split keys
    (``lax.map``), each output leaf's leading axis reshaped to ``shape[:-2]``. Only the result is
    ever whole. (init_moe_params' draws, and the GPU tests' model-sized weights.)"""
    if 4 * math.prod(shape) <= WHOLE_DRAW_MAX_BYTES:
        return draw(key, shape)
    lead = tuple(shape[:-2])

    def by_matrix(keys):
        stacked = lax.map(lambda k: draw(k, tuple(shape[-2:])), keys)
        return jax.tree.map(lambda leaf: leaf.reshape(lead + leaf.shape[1:]), stacked)
    return jax.jit(by_matrix)(jax.random.split(key, math.prod(lead)))


def init_moe_params(key: jax.Array, config: MoEConfig, num_layers: int, ffn_size: int, dtype=None, *,
                    shared_ffn_size: int | None = None, shared_gate: bool = False,
                    router_bias: bool = False) -> dict:
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

    Returns:
      ``{"router": [L, H, E], "gate_up": [L, El, H, 2F], "down": [L, El, F, H]}`` of ``dtype``, plus
      ``shared_gate_up`` [L, H, 2Fs], ``shared_down`` [L, Fs, H], ``shared_gate`` [L, H, 1] and
      ``router_bias`` [L, E] when asked for. ``gate_up[..., :F]`` is the SwiGLU gate,
      ``gate_up[..., F:]`` the up projection. Only the El local experts of ``config.expert_map``
      have weights (local index order). Weights are normal / sqrt(fan-in); a leaf over
      ``WHOLE_DRAW_MAX_BYTES`` of float32 is drawn a matrix at a time, so that model-sized params
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
            jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))).astype(dtype))

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
    """Trace-time shape check of (stacked) layer params against ``config``; ValueError otherwise."""
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
    lead = (jnp.shape(layer_params["router"])[0],) if stacked and jnp.ndim(layer_params["router"]) else ()
    hidden, experts, local = config.hidden_size, config.num_experts, config.num_local_experts
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


def _flat_tokens(op: str, x, config: MoEConfig) -> jax.Array:
    """x [..., H] -> [T, H] (T = all leading elements); a wrong H is a ValueError here."""
    shape = tuple(jnp.shape(x))
    if len(shape) < 1 or shape[-1] != config.hidden_size:
        raise ValueError(f"{op}: x: expected shape [..., {config.hidden_size}] (hidden_size last), got {shape}")
    return jnp.reshape(x, (-1, config.hidden_size))


def _check_options(op: str, expert_fn, unroll=1) -> None:
    if expert_fn is not None and not callable(expert_fn):
        raise ValueError(f"{op}: expert_fn: expected None or a callable (layer_params, rows, group_sizes) -> rows, "
                         f"got {type(expert_fn).__name__}")
    if not isinstance(unroll, (bool, int, np.integer)) or (not isinstance(unroll, bool) and unroll < 0):
        raise ValueError(f"{op}: unroll: expected a bool or a non-negative int (lax.scan's), got {unroll!r}")


def _moved_to_parallel(op: str, mesh, axis_name) -> None:
    if mesh is not None or axis_name is not None:
        raise ValueError(f"{op}: mesh/axis_name: expert parallelism is jax_moe.{op}_ep(..., mesh=, axis_name=) "
                         f"(with init_scratch_ep and shard_params); got mesh={mesh!r}, axis_name={axis_name!r}")


def moe_layer(layer_params: dict, x: jax.Array, scratch: MoEScratch,
              expert_fn: ExpertFn | None = None, *, with_aux: bool = False, residual: jax.Array | None = None,
              mesh=None, axis_name: str | None = None):
    """One MoE layer: route, ``permute`` into the scratch, grouped experts, ``unpermute``.

    Args:
      layer_params: one layer's params (``init_moe_params`` sliced at a layer): ``router`` [H, E],
        ``gate_up`` [El, H, 2F], ``down`` [El, F, H]; optional ``router_bias`` [E] (added to the
        scores for choosing only) and a shared expert ``shared_gate_up`` [H, 2Fs], ``shared_down``
        [Fs, H], ``shared_gate`` [H, 1] (see ``init_moe_params``). Routing as ``scratch.config``
        says (``jax_moe.routing``).
      x: [..., H] of ``scratch.config.dtype``: any leading batch axes, at most ``config.max_tokens``
        tokens in all (they are flattened inside, and the shape restored on return).
      scratch: the shared ``MoEScratch``; written in place when donated. Do not reuse the argument.
      expert_fn: ``expert_fn(layer_params, rows [R, H], group_sizes [El] int32) -> [R, H]`` rows'
        dtype, where rows past ``sum(group_sizes)`` must not affect the others. None means SwiGLU:
        on a GPU with a bf16 config, ``swiglu_experts_grouped`` (the CUDA grouped GEMM,
        ``jax_moe.grouped_matmul``); otherwise ``swiglu_experts`` (``jax.lax.ragged_dot``).
      with_aux: also return the router's training signals.
      residual: optional, of x's shape and dtype: y is then ``residual + y`` (a pre-norm block's
        ``h + moe_layer(params, norm(h), ...)``), both adds in unpermute's launch on a GPU
        (``ops.unpermute_add``: no pass over [T, H] of its own; the same bits as the adds apart).

    Returns:
      ``(y, scratch)``: y of x's shape and dtype, the router-weighted sum of each token's k expert
      outputs (dropped routes of ``config.expert_map`` contribute 0) plus the shared expert's output
      (plus ``residual``), and the scratch to pass on (state, not a differentiable output: its
      gradient is stopped). With
      ``with_aux``: ``(y, scratch, aux)``, aux = ``{"router_logits": [T, E] float32,
      "expert_counts": [E] int32}`` (routes per global expert) for ``jax_moe.routing``'s losses.

    Expert parallel: ``jax_moe.moe_layer_ep`` (this module sits below ``jax_moe.parallel``).
    """
    _moved_to_parallel("moe_layer", mesh, axis_name)
    _check_options("moe_layer", expert_fn)
    if not isinstance(scratch, MoEScratch):
        raise ValueError(f"moe_layer: scratch: expected a MoEScratch (from jax_moe.init_scratch), "
                         f"got {type(scratch).__name__}")
    config = scratch.config
    check_layer_params("moe_layer", layer_params, config, stacked=False)
    tokens = _flat_tokens("moe_layer", x, config)
    if residual is not None and (tuple(jnp.shape(residual)) != tuple(jnp.shape(x))
                                 or jnp.dtype(residual.dtype) != jnp.dtype(x.dtype)):
        raise ValueError(f"moe_layer: residual: expected x's shape and dtype, {jnp.dtype(x.dtype)}"
                         f"{list(jnp.shape(x))}, got {jnp.dtype(residual.dtype)}{list(jnp.shape(residual))}")
    # The scratch is state, not a differentiable value: stopping its gradient on the way in and
    # out keeps it out of autodiff entirely (otherwise custom_vjp instantiates a zero [R_cap, H]
    # tangent for it and a scanned stack carries that tangent through every layer). It lowers to
    # nothing, so the buffers still flow straight from one aliased call to the next.
    scratch = lax.stop_gradient(scratch)
    router, bias = layer_params["router"], layer_params.get("router_bias")
    if tokens.shape[0] <= ops.DECODE_ROUTE_TOKENS and ops.decode_route_fits(config, tokens.shape[0], router.dtype):
        # A few tokens: the router in one kernel (differentiable: its backward keeps the ids).
        weights, ids, logits, scratch = ops.route_decode(router, tokens, scratch, bias)
    else:
        logits = routing.router_logits(router, tokens)
        weights, ids = routing.route_logits(logits, config, bias)
    if expert_fn is None and experts.fp8_quantizes_in_permute(layer_params, tokens, config):
        rows_out, scratch = experts.fp8_experts_on_tokens(layer_params, tokens, ids, scratch)
        shared = shared_experts(layer_params, tokens)
    else:
        prefetch = experts.gate_up_to_prefetch(expert_fn, layer_params, config, tokens.shape[0])
        scratch = permute(tokens, ids, scratch, prefetch=prefetch)
        rows_out, shared, scratch = run_experts_and_shared(expert_fn, layer_params, scratch, tokens)
    if residual is not None:
        y = ops.unpermute_add(rows_out, weights, scratch, jnp.reshape(residual, tokens.shape), shared)
    else:
        y = unpermute(rows_out, weights, scratch)
        if shared is not None:
            y = y + shared
    y = jnp.reshape(y, jnp.shape(x))
    scratch = lax.stop_gradient(scratch)
    if not with_aux:
        return y, scratch
    return y, scratch, {"router_logits": logits, "expert_counts": routing.expert_counts(ids, config.num_experts)}


def moe_stack(params: dict, x: jax.Array, scratch: MoEScratch, *, unroll: int | bool = 1,
              expert_fn: ExpertFn | None = None, with_aux: bool = False, mesh=None, axis_name: str | None = None):
    """L pre-norm residual MoE layers as one ``lax.scan`` with the scratch in the carry.

    Each layer computes ``x = x + moe_layer(params[l], rms_norm(x), scratch)``.

    Args:
      params: ``init_moe_params`` output (or ``jax_moe.hf.load_moe``'s), leaves stacked on a
        leading layer axis L.
      x: [..., H] of ``scratch.config.dtype`` (leading batch axes flattened inside, restored).
      scratch: the ONE ``MoEScratch`` shared by all layers. Donate it to the enclosing ``jax.jit``
        (``donate_argnums``) to have it written in place and returned in the same buffers.
      unroll: passed to ``lax.scan`` (an int, or True for a fully unrolled loop).
      expert_fn: as in ``moe_layer``.
      with_aux: also return every layer's router signals, stacked.

    With the default experts on the CUDA grouped GEMMs (GPU, bf16) the stack is differentiated as a
    whole by a hand-written backward (``jax_moe.stack.grouped_stack``) that writes every weight
    gradient straight into its layer's slice of the stacked gradient: no zero fill, no per-layer
    copy. Otherwise JAX differentiates the scan of ``moe_layer``.

    Returns:
      ``(x_out, scratch)``: x_out of x's shape and dtype, and the scratch to pass to the next step.
      With ``with_aux``: ``(x_out, scratch, aux)``, aux = ``{"router_logits": [L, T, E] float32,
      "expert_counts": [L, E] int32}`` (feed ``jax_moe.routing.load_balancing_loss``,
      ``router_z_loss``, ``update_router_bias``).

    Expert parallel: ``jax_moe.moe_stack_ep``.
    """
    _moved_to_parallel("moe_stack", mesh, axis_name)
    _check_options("moe_stack", expert_fn, unroll)
    if not isinstance(scratch, MoEScratch):
        raise ValueError(f"moe_stack: scratch: expected a MoEScratch (from jax_moe.init_scratch), "
                         f"got {type(scratch).__name__}")
    check_layer_params("moe_stack", params, scratch.config, stacked=True)
    _validate.check_scratch("moe_stack", scratch)
    tokens = _flat_tokens("moe_stack", x, scratch.config)
    if expert_fn is None and uses_grouped_matmul(params, scratch.config) and not fp8.is_quantized(params):
        tokens, scratch, aux = stack.grouped_stack(params, tokens, scratch, unroll=unroll, with_aux=with_aux)
    else:
        (tokens, scratch), aux = _scan_layers(params, tokens, scratch, unroll, expert_fn, with_aux)
    out = jnp.reshape(tokens, jnp.shape(x))
    return (out, scratch, aux) if with_aux else (out, scratch)


# The scanned stack passes each layer's input as moe_layer's residual: the add is in unpermute's
# launch (ops.unpermute_add), the same bits. False: the add apart, as before (an A/B switch for the
# benchmarks; read at trace time).
RESIDUAL_IN_UNPERMUTE = True


def _scan_layers(params, tokens, scratch, unroll, expert_fn, with_aux):
    """The stack as a ``lax.scan`` of ``moe_layer``, differentiated by JAX."""
    def body(carry, layer_params):
        h, s = carry
        if RESIDUAL_IN_UNPERMUTE:  # the residual add rides the layer's unpermute launch
            h, s, aux = moe_layer(layer_params, rms_norm(h), s, expert_fn, with_aux=True, residual=h)
        else:
            y, s, aux = moe_layer(layer_params, rms_norm(h), s, expert_fn, with_aux=True)
            h = h + y
        return (h, s), (aux if with_aux else None)

    return lax.scan(body, (tokens, scratch), params, unroll=unroll)
