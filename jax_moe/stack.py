"""The pre-norm residual stack's math, and its training path on the grouped GEMMs.

``rms_norm`` is the stack's normalisation. ``grouped_stack`` is ``moe_stack`` when the experts run
on the CUDA grouped GEMMs (the default SwiGLU on a GPU): the same forward as a ``lax.scan`` of
``moe_layer``, differentiated as a whole by one ``jax.custom_vjp`` instead of by JAX's transpose
of the scan.

Why: the transpose of a scan collects each layer's parameter gradients as the loop's stacked
outputs, and JAX starts those from zeros: a fill of every weight gradient (a fifth of a
Qwen3-30B training step), and each layer's gradient is a buffer of its own, copied into the stack
(XLA's slice fusion does not take a GEMM whose operand is already a slice). Here the stacked
gradients, and the activations the forward saves, start as ``ops.uninitialized`` buffers that the
loops write one layer's slice at a time: every element is written exactly once, each weight
gradient by its GEMM straight into its slice (``gemm.weight_grad_into``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import gemm, ops, routing
from jax_moe.config import MoEConfig
from jax_moe.experts import shared_experts, swiglu_grouped_forward, swiglu_grouped_grad
from jax_moe.scratch import MoEScratch

EXPERT_WEIGHTS = ("gate_up", "down")


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Parameter-free RMS normalisation over the last axis, in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _dense(small: dict, h: jax.Array, config: MoEConfig):
    """A layer's dense part from its input h [T, H]: ``((n, weights, logits, shared), ids)``.

    n = rms_norm(h) [T, H]; the router's logits [T, E] float32, weights [T, k] float32 and ids
    [T, k] int32; the shared expert's output [T, H] (None without one). ``small``: the layer's
    params other than the expert weights.
    """
    n = rms_norm(h)
    logits = routing.router_logits(small["router"], n)
    weights, ids = routing.route_logits(logits, config, small.get("router_bias"))
    return (n, weights, logits, shared_experts(small, n)), ids


def _split(layer_params: dict) -> tuple[dict, jax.Array, jax.Array]:
    small = {name: a for name, a in layer_params.items() if name not in EXPERT_WEIGHTS}
    return small, layer_params["gate_up"], layer_params["down"]


def _saved_shapes(config: MoEConfig, num_tokens: int, ffn_size: int):
    """Per layer, what the forward keeps for the backward: (h, hidden, out_rows, dest, offsets).

    Not the permuted rows: the backward gathers them again from the recomputed norm of h
    (``ops.rows_by_dest``), cheaper than copying [R, H] into the stack per layer, and [R, H] less
    per layer at the step's peak (Qwen3-30B at T = 4096: 134 MB)."""
    num_rows, hidden, dtype = config.live_row_bound(num_tokens), config.hidden_size, config.dtype
    return (((num_tokens, hidden), dtype), ((num_rows, 2 * ffn_size), dtype), ((num_rows, hidden), dtype),
            ((num_tokens, config.top_k), jnp.int32), ((config.num_local_experts + 1,), jnp.int32))


def _layer_forward(layer_params: dict, h: jax.Array, scratch: MoEScratch, keep: bool):
    """One layer: ``(h + y, scratch, logits [T, E], ids [T, k], saved)`` (``saved`` as _saved_shapes,
    None unless ``keep``)."""
    config = scratch.config
    num_tokens = h.shape[0]
    small, gate_up, down = _split(layer_params)
    (n, weights, logits, shared), ids = _dense(small, h, config)
    scratch = ops.permute(n, ids, scratch)
    num_rows, group_rows = config.live_row_bound(num_tokens), config.group_row_bound(num_tokens)
    tile = gemm.pick_tile(num_rows, config.num_local_experts, group_rows)
    offsets = scratch.expert_offsets
    out_rows, workspace, hidden = swiglu_grouped_forward(
        scratch.permuted, gate_up.astype(config.dtype), down.astype(config.dtype), offsets, scratch.workspace,
        num_rows, tile, keep_hidden=keep, group_rows=group_rows)
    y = ops.unpermute(out_rows, weights, scratch)
    if shared is not None:
        y = y + shared
    saved = None
    if keep:
        saved = (h, hidden, out_rows, scratch.dest_index[:num_tokens], offsets)
    return h + y, scratch.replace(workspace=workspace), logits, ids, saved


def _set_layer(stacks, layer, values):
    """Writes ``values`` into slice ``layer`` of each stacked array (in place inside a loop)."""
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), layer, 0), stacks, values)


def _forward(params, tokens, scratch: MoEScratch, unroll, with_aux: bool, keep: bool):
    """The scanned forward: ``(out, scratch, aux or None, saved stacks or None)``."""
    config = scratch.config
    num_layers = params["router"].shape[0]
    saved = None
    if keep:
        shapes = _saved_shapes(config, tokens.shape[0], params["down"].shape[-2])
        saved = tuple(ops.uninitialized((num_layers,) + shape, dtype) for shape, dtype in shapes)

    def body(carry, xs):
        h, s, saved = carry
        layer, layer_params = xs
        h, s, logits, ids, layer_saved = _layer_forward(layer_params, h, s, keep)
        if keep:
            saved = _set_layer(saved, layer, layer_saved)
        aux = {"router_logits": logits, "expert_counts": routing.expert_counts(ids, config.num_experts)}
        return (h, s, saved), (aux if with_aux else None)

    (out, scratch, saved), aux = lax.scan(body, (tokens, scratch, saved),
                                          (jnp.arange(num_layers, dtype=jnp.int32), params), unroll=unroll)
    return out, scratch, aux, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _stack(params, tokens, scratch, config, unroll, with_aux):
    out, scratch, aux, _ = _forward(params, tokens, scratch, unroll, with_aux, keep=False)
    return out, scratch, aux


def _stack_fwd(params, tokens, scratch, config, unroll, with_aux):
    out, scratch, aux, saved = _forward(params, tokens, scratch, unroll, with_aux, keep=True)
    return (out, scratch, aux), (params, saved)  # the params by reference, the saved stacks


def _stack_bwd(config, unroll, with_aux, residuals, cotangents):
    params, saved = residuals
    d_out, _, d_aux = cotangents
    num_layers = params["router"].shape[0]
    num_tokens = d_out.shape[0]
    num_rows = config.live_row_bound(num_tokens)
    tile = gemm.pick_tile(num_rows, config.num_local_experts, config.group_row_bound(num_tokens))
    grads = {name: ops.uninitialized(a.shape, a.dtype) for name, a in params.items()}
    d_logits = d_aux["router_logits"] if with_aux else None

    def body(carry, xs):
        d_h, grads = carry
        layer, layer_params, (h, hidden, out_rows, dest, offsets), d_logits_layer = xs
        small, gate_up, down = _split(layer_params)
        (n, weights, logits, shared), dense_vjp, _ = jax.vjp(lambda h, small: _dense(small, h, config), h, small,
                                                             has_aux=True)
        rows = ops.rows_by_dest(n, dest, num_rows)
        # d y = d h: the residual connection passes it on unchanged and into the layer's output.
        d_out_rows, d_weights = ops.unpermute_grad(d_h, out_rows, weights, dest)
        d_rows, d_gate_up, d_down = swiglu_grouped_grad(
            rows, hidden, offsets, gate_up.astype(config.dtype), down.astype(config.dtype), d_out_rows, num_rows,
            tile, stacks=(grads["gate_up"], grads["down"]), layer=layer)
        d_n = ops.permute_grad(d_rows, dest)
        d_logits_layer = jnp.zeros_like(logits) if d_logits_layer is None else d_logits_layer
        d_h_dense, d_small = dense_vjp((d_n, d_weights, d_logits_layer, None if shared is None else d_h))
        small_grads = _set_layer({name: grads[name] for name in d_small}, layer, d_small)
        grads = {**small_grads, "gate_up": d_gate_up, "down": d_down}
        return (d_h + d_h_dense, grads), None

    xs = (jnp.arange(num_layers, dtype=jnp.int32), params, saved, d_logits)
    (d_tokens, grads), _ = lax.scan(body, (d_out, grads), xs, reverse=True, unroll=unroll)
    return grads, d_tokens, None


_stack.defvjp(_stack_fwd, _stack_bwd)


def grouped_stack(params: dict, tokens: jax.Array, scratch: MoEScratch, *, unroll: int | bool = 1,
                  with_aux: bool = False):
    """``moe_stack`` on the grouped GEMMs with a hand-written backward (no argument checks).

    Args:
      params: stacked layer params (``init_moe_params``), SwiGLU experts ``gate_up`` [L, El, H, 2F]
        and ``down`` [L, El, F, H].
      tokens: [T, H] of ``scratch.config.dtype``.
      scratch: the one ``MoEScratch``, threaded through the layers (state: no gradient).
      unroll: as ``lax.scan``'s, for both the forward and the backward loop.
      with_aux: also return ``{"router_logits": [L, T, E] float32, "expert_counts": [L, E] int32}``.

    Returns:
      ``(out [T, H], scratch, aux or None)``, equal to a ``lax.scan`` of ``moe_layer`` with the
      grouped-GEMM experts. Its backward saves per layer the layer's input, the gate/up product,
      the expert outputs and the routes' rows, recomputes the router, the routing, the shared
      expert and the permuted rows (one gather) from the layer's input, and
      writes every parameter gradient into its slice of a stacked buffer that nothing fills first.
    """
    out, scratch, aux = _stack(params, tokens, lax.stop_gradient(scratch), scratch.config, unroll, with_aux)
    return out, lax.stop_gradient(scratch), aux
