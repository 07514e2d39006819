"""A functional MoE layer and a scanned stack of them that threads ONE scratch through every layer.

No classes with hidden state: parameters are a pytree of arrays stacked on a leading layer axis,
the scratch is a ``MoEScratch`` passed in and returned. ``moe_stack`` is a ``lax.scan`` over the
layer axis with the scratch in the carry, so the compiled program holds a single scratch however
deep the stack is, and a jitted step that donates the scratch gets it back in the same buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import _validate
from jax_moe.config import MoEConfig
from jax_moe.experts import ExpertFn, run_experts, swiglu_experts  # noqa: F401 (swiglu_experts: public here too)
from jax_moe.ops import permute, unpermute
from jax_moe.scratch import MoEScratch

PARAM_NAMES = ("router", "gate_up", "down")


def init_moe_params(key: jax.Array, config: MoEConfig, num_layers: int, ffn_size: int, dtype=None) -> dict:
    """Random parameters of ``num_layers`` MoE layers, stacked on a leading layer axis.

    Args:
      key: a ``jax.random`` key.
      config: the ``MoEConfig`` of every layer (E, El, H come from it).
      num_layers: L, the number of layers.
      ffn_size: F, each expert's intermediate size.
      dtype: parameter dtype; None means ``config.dtype``.

    Returns:
      ``{"router": [L, H, E], "gate_up": [L, El, H, 2F], "down": [L, El, F, H]}`` of ``dtype``.
      ``gate_up[..., :F]`` is the SwiGLU gate, ``gate_up[..., F:]`` the up projection. Only the El
      local experts of ``config.expert_map`` have weights (local index order).
    """
    if not isinstance(config, MoEConfig):
        raise ValueError(f"init_moe_params: config: expected a MoEConfig, got {type(config).__name__}")
    for name, value in (("num_layers", num_layers), ("ffn_size", ffn_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_moe_params: {name}: expected a positive integer, got {value!r}")
    dtype = config.dtype if dtype is None else jnp.dtype(dtype)
    hidden, experts, local = config.hidden_size, config.num_experts, config.num_local_experts
    router_key, gate_up_key, down_key = jax.random.split(key, 3)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(jnp.float32(fan_in))).astype(dtype)

    return {
        "router": normal(router_key, (num_layers, hidden, experts), hidden),
        "gate_up": normal(gate_up_key, (num_layers, local, hidden, 2 * ffn_size), hidden),
        "down": normal(down_key, (num_layers, local, ffn_size, hidden), ffn_size),
    }


def router_scores(router: jax.Array, x: jax.Array, config: MoEConfig) -> jax.Array:
    """[T, E] float32 router scores: softmax over all E, or sigmoid, as ``config.scoring`` says."""
    # Full float32 precision for float32 operands: on GPUs XLA's default f32 dot is TF32, whose
    # rounding can flip the top-k choice between close experts. bf16 products are exact in float32
    # already, and asking HIGHEST of bf16 operands could make XLA upcast the router weights.
    exact = jnp.float32 in (jnp.dtype(x.dtype), jnp.dtype(router.dtype))
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32,
                     precision=lax.Precision.HIGHEST if exact else None)
    return jax.nn.softmax(logits, axis=-1) if config.scoring == "softmax" else jax.nn.sigmoid(logits)


def route(router: jax.Array, x: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Router scores -> top-k weights and ids, as ``config.scoring`` and ``config.renormalize`` say.

    Args:
      router: [H, E] router weights.
      x: [T, H] rows.
      config: the layer's ``MoEConfig``.

    Returns:
      ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``: global expert ids, weights from
      softmax (over all E) or sigmoid scores, renormalised over the k chosen when configured.
    """
    weights, ids = lax.top_k(router_scores(router, x, config), config.top_k)
    if config.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Parameter-free RMS normalisation over the last axis, in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def check_layer_params(op: str, layer_params, config: MoEConfig, stacked: bool) -> None:
    """Trace-time shape check of (stacked) layer params against ``config``; ValueError otherwise."""
    if not isinstance(layer_params, dict) or not all(n in layer_params for n in PARAM_NAMES):
        raise ValueError(f"{op}: params: expected a dict with keys {PARAM_NAMES} (from init_moe_params), "
                         f"got {type(layer_params).__name__}"
                         + (f" with keys {sorted(layer_params)}" if isinstance(layer_params, dict) else ""))
    lead = (jnp.shape(layer_params["router"])[0],) if stacked and jnp.ndim(layer_params["router"]) else ()
    hidden, experts, local = config.hidden_size, config.num_experts, config.num_local_experts
    ffn2 = jnp.shape(layer_params["gate_up"])[-1] if jnp.ndim(layer_params["gate_up"]) else -1
    want = {
        "router": lead + (hidden, experts),
        "gate_up": lead + (local, hidden, ffn2),
        "down": lead + (local, ffn2 // 2, hidden),
    }
    for name, shape in want.items():
        have = tuple(jnp.shape(layer_params[name]))
        if have != shape or ffn2 < 2 or ffn2 % 2:
            layout = "[L, " if stacked else "["
            raise ValueError(
                f"{op}: params[{name!r}]: expected shape {shape} ({layout}... with H={hidden}, E={experts}, "
                f"El={local}, gate_up last axis 2F even), got {have}")


def moe_layer(layer_params: dict, x: jax.Array, scratch: MoEScratch,
              expert_fn: ExpertFn | None = None, *, mesh=None, axis_name: str | None = None):
    """One MoE layer: route, ``permute`` into the scratch, grouped experts, ``unpermute``.

    Args:
      layer_params: one layer's params (``init_moe_params`` sliced at a layer): ``router`` [H, E],
        ``gate_up`` [El, H, 2F], ``down`` [El, F, H].
      x: [T, H] of ``scratch.config.dtype``, T <= ``config.max_tokens``.
      scratch: the shared ``MoEScratch``; written in place when donated. Do not reuse the argument.
      expert_fn: ``expert_fn(layer_params, rows [R, H], group_sizes [El] int32) -> [R, H]`` rows'
        dtype, where rows past ``sum(group_sizes)`` must not affect the others. None means SwiGLU:
        on a GPU with a bf16 config, ``swiglu_experts_grouped`` (the CUDA grouped GEMM,
        ``jax_moe.grouped_matmul``); otherwise ``swiglu_experts`` (``jax.lax.ragged_dot``).

    Returns:
      ``(y, scratch)``: y [T, H] of x's dtype, the router-weighted sum of each token's k expert
      outputs (dropped routes of ``config.expert_map`` contribute 0), and the scratch to pass on.
      The returned scratch is state, not a differentiable output (its gradient is stopped).

    Expert parallel: with ``mesh`` and ``axis_name`` this is ``jax_moe.parallel.moe_layer_ep``
    (scratch from ``init_scratch_ep``, params from ``shard_params``) and returns ``(y, scratch,
    dropped)``, dropped being the routes the per-peer capacity dropped.
    """
    if mesh is not None or axis_name is not None:
        from jax_moe import parallel  # imported here: parallel builds on this module
        return parallel.moe_layer_ep(layer_params, x, scratch, mesh=mesh, axis_name=axis_name,
                                     expert_fn=expert_fn)
    if not isinstance(scratch, MoEScratch):
        raise ValueError(f"moe_layer: scratch: expected a MoEScratch (from jax_moe.init_scratch), "
                         f"got {type(scratch).__name__}")
    config = scratch.config
    check_layer_params("moe_layer", layer_params, config, stacked=False)
    weights, ids = route(layer_params["router"], x, config)
    # The scratch is state, not a differentiable value: stopping its gradient on the way in and
    # out keeps it out of autodiff entirely (otherwise custom_vjp instantiates a zero [R_cap, H]
    # tangent for it and a scanned stack carries that tangent through every layer). It lowers to
    # nothing, so the buffers still flow straight from one aliased call to the next.
    scratch = permute(x, ids, lax.stop_gradient(scratch))
    rows_out, scratch = run_experts(expert_fn, layer_params, scratch, x.shape[0])
    y = unpermute(rows_out, weights, scratch)
    return y, lax.stop_gradient(scratch)


def moe_stack(params: dict, x: jax.Array, scratch: MoEScratch, *, unroll: int | bool = 1,
              expert_fn: ExpertFn | None = None, mesh=None, axis_name: str | None = None):
    """L pre-norm residual MoE layers as one ``lax.scan`` with the scratch in the carry.

    Each layer computes ``x = x + moe_layer(params[l], rms_norm(x), scratch)``.

    Args:
      params: ``init_moe_params`` output, leaves stacked on a leading layer axis L.
      x: [T, H] of ``scratch.config.dtype``.
      scratch: the ONE ``MoEScratch`` shared by all layers. Donate it to the enclosing ``jax.jit``
        (``donate_argnums``) to have it written in place and returned in the same buffers.
      unroll: passed to ``lax.scan`` (an int, or True for a fully unrolled loop).
      expert_fn: as in ``moe_layer``.

    Returns:
      ``(x_out, scratch)``: x_out [T, H] of x's dtype, and the scratch to pass to the next step.

    Expert parallel: with ``mesh`` and ``axis_name`` this is ``jax_moe.parallel.moe_stack_ep`` and
    returns ``(x_out, scratch, dropped [L])``.
    """
    if mesh is not None or axis_name is not None:
        from jax_moe import parallel  # imported here: parallel builds on this module
        return parallel.moe_stack_ep(params, x, scratch, mesh=mesh, axis_name=axis_name, unroll=unroll,
                                     expert_fn=expert_fn)
    if not isinstance(scratch, MoEScratch):
        raise ValueError(f"moe_stack: scratch: expected a MoEScratch (from jax_moe.init_scratch), "
                         f"got {type(scratch).__name__}")
    check_layer_params("moe_stack", params, scratch.config, stacked=True)
    _validate.check_scratch("moe_stack", scratch)

    def body(carry, layer_params):
        h, s = carry
        y, s = moe_layer(layer_params, rms_norm(h), s, expert_fn)
        return (h + y, s), None

    (x, scratch), _ = lax.scan(body, (x, scratch), params, unroll=unroll)
    return x, scratch
