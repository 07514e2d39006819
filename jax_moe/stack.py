"""The pre-norm residual stack's math, and its training path on the grouped GEMMs.

``rms_norm`` is the stack's normalisation. ``grouped_stack`` is ``moe_stack`` when the experts run
on the CUDA grouped GEMMs (the default SwiGLU on a GPU): the same forward as a ``lax.scan`` of
``moe_layer``, differentiated as a whole by one ``jax.custom_vjp`` instead of by JAX's transpose
of the scan.

On a GPU the activations the forward keeps for the backward ride in the gate/up weight
gradient's own buffer when they fit (``saved_in_gradient``): layer l's slice of that stack is
written only by layer l's backward, after it has read them. The gate/up GEMM of the forward stores
its product there itself, and the backward's activation kernel reads it there: neither copies it.
The step then holds no activation stack next to the gradients, as PyTorch's eager backward frees
each layer's activations as it allocates its gradients.

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
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import gemm, ops, routing
from jax_moe.config import MoEConfig
from jax_moe.experts import (gate_up_to_prefetch, shared_experts, shared_rides_decode, swiglu_decode_with_shared,
                             swiglu_grouped_forward, swiglu_grouped_grad_but_gate_up)
from jax_moe.ops import rms_norm  # noqa: F401 (the stack's norm, public here as before)
from jax_moe.scratch import MoEScratch

EXPERT_WEIGHTS = ("gate_up", "down")
# Inference at decode: the router's launch normalises the tokens (ops.route_decode_normalizing), where
# XLA ran the norm in two kernels of its own. False: XLA's norm, then ops.route_decode (for measuring).
DECODE_ROUTER_NORMALIZES = True


def _dense(small: dict, h: jax.Array, config: MoEConfig, with_shared: bool = True):
    """A layer's dense part from its input h [T, H]: ``((n, weights, logits, shared), ids)``.

    n = rms_norm(h) [T, H]; the router's logits [T, E] float32, weights [T, k] float32 and ids
    [T, k] int32; the shared expert's output [T, H] (None without one, or without with_shared).
    ``small``: the layer's params other than the expert weights.
    """
    n = rms_norm(h)
    logits = routing.router_logits(small["router"], n)
    weights, ids = routing.route_logits(logits, config, small.get("router_bias"))
    return (n, weights, logits, shared_experts(small, n) if with_shared else None), ids


def _split(layer_params: dict) -> tuple[dict, jax.Array, jax.Array]:
    small = {name: a for name, a in layer_params.items() if name not in EXPERT_WEIGHTS}
    return small, layer_params["gate_up"], layer_params["down"]


def _saved_shapes(config: MoEConfig, num_tokens: int, ffn_size: int):
    """Per layer, what the forward keeps for the backward: (h, hidden, dest, offsets).

    Not the permuted rows: the backward gathers them again from the recomputed norm of h
    (``ops.rows_by_route``). Not the expert outputs: the router weights' gradient comes from the
    down projection's input gradient (``swiglu_grouped_grad_but_gate_up``'s row_weights). Each is
    [R, H] less per layer at the step's peak (Qwen3-30B at T = 4096: 134 MB)."""
    num_rows, hidden, dtype = config.live_row_bound(num_tokens), config.hidden_size, config.dtype
    return (((num_tokens, hidden), dtype), ((num_rows, 2 * ffn_size), dtype),
            ((num_tokens, config.top_k), jnp.int32), ((config.num_local_experts + 1,), jnp.int32))


_ACTIVATIONS = 2  # the first two saved arrays (h, hidden), of config.dtype

# Backends where the activations ride in the gate/up gradient (tests add "cpu"). XLA:GPU compiles
# both loops without a copy of the stack (a GPU test checks the optimized HLO); XLA:CPU copies the
# whole stack in each loop's body (jaxlib 0.10.2), so there they keep stacks of their own.
PACK_BACKENDS = ("gpu",)


def _packing(config: MoEConfig, num_tokens: int, gate_up_shape, gate_up_dtype):
    """Where each saved activation starts in a layer's flattened gate/up gradient slice, or None.

    None when they do not fit in it or the gradient's dtype is not the activations' (float32
    master weights with bf16 activations): they then get stacks of their own.
    """
    shapes = _saved_shapes(config, num_tokens, gate_up_shape[-1] // 2)[:_ACTIVATIONS]
    if jax.default_backend() not in PACK_BACKENDS or jnp.dtype(gate_up_dtype) != jnp.dtype(config.dtype):
        return None
    sizes = [math.prod(shape) for shape, _ in shapes]
    if sum(sizes) > math.prod(gate_up_shape[1:]):
        return None
    return tuple(itertools.accumulate([0] + sizes[:-1]))


def saved_in_gradient(config: MoEConfig, num_tokens: int, gate_up_shape, gate_up_dtype) -> bool:
    """Whether ``grouped_stack``'s backward finds the saved activations in the gate/up gradient.

    True when a layer's input [T, H] and gate/up product [R, 2F] (R = ``live_row_bound(T)``) fit
    in one layer's gate/up gradient [El, H, 2F] of the activations' dtype: about T <= El * H / k
    (Qwen3-30B-A3B: T <= 28,000; DeepSeek-V3: 200,000).
    """
    return _packing(config, num_tokens, gate_up_shape, gate_up_dtype) is not None


def _layer_forward(layer_params: dict, h: jax.Array, scratch: MoEScratch, keep: bool, hidden_into=None):
    """One layer: ``(h + y, scratch, logits [T, E], ids [T, k], saved)`` (``saved`` as _saved_shapes,
    None unless ``keep``). hidden_into: ``swiglu_grouped_forward``'s; saved then holds the stack
    it returns in hidden's place."""
    config = scratch.config
    num_tokens = h.shape[0]
    small, gate_up, down = _split(layer_params)
    num_rows, group_rows = config.live_row_bound(num_tokens), config.group_row_bound(num_tokens)
    tile = gemm.pick_tile(num_rows, config.num_local_experts, group_rows)
    # Inference at decode: the shared expert streams in the routed experts' launches.
    fuse_shared = not keep and shared_rides_decode(small, h, tile)
    route_kernel = (num_tokens <= ops.DECODE_ROUTE_TOKENS
                    and ops.decode_route_fits(config, num_tokens, small["router"].dtype))
    if keep or not route_kernel:
        (n, weights, logits, shared), ids = _dense(small, h, config, with_shared=not fuse_shared)
    else:
        # Inference at T <= ops.DECODE_ROUTE_TOKENS: the norm and the router in one kernel. (A training
        # forward routes in XLA: its backward recomputes that routing, and must find the same ids.)
        if DECODE_ROUTER_NORMALIZES:
            n, weights, ids, logits, scratch = ops.route_decode_normalizing(small["router"], h, scratch,
                                                                            small.get("router_bias"))
        else:
            n = rms_norm(h)
            weights, ids, logits, scratch = ops.route_decode(small["router"], n, scratch, small.get("router_bias"))
        shared = None if fuse_shared else shared_experts(small, n)
    # Inference on the decode kernel: the permute's launch starts the gate/up weights towards L2.
    prefetch = None if keep else gate_up_to_prefetch(None, layer_params, config, num_tokens)
    scratch = ops.permute(n, ids, scratch, prefetch=prefetch)
    offsets = scratch.expert_offsets
    gate_up, down = gate_up.astype(config.dtype), down.astype(config.dtype)
    if fuse_shared:
        out_rows, shared, workspace = swiglu_decode_with_shared(scratch.permuted, gate_up, down, offsets,
                                                                scratch.workspace, num_rows, group_rows, small, n)
        hidden = None
    else:
        out_rows, workspace, hidden = swiglu_grouped_forward(
            scratch.permuted, gate_up, down, offsets, scratch.workspace,
            num_rows, tile, keep_hidden=keep, group_rows=group_rows, hidden_into=hidden_into)
    saved = None
    if keep:
        y = ops.unpermute(out_rows, weights, scratch)
        h_out = h + (y if shared is None else y + shared)
        saved = (h, hidden, scratch.dest_index[:num_tokens], offsets)
    else:  # inference: the adds in unpermute's launch
        h_out = ops.unpermute_add(out_rows, weights, scratch, h, shared)
    return h_out, scratch.replace(workspace=workspace), logits, ids, saved


def _set_layer(stacks, layer, values):
    """Writes ``values`` into slice ``layer`` of each stacked array (in place inside a loop)."""
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), layer, 0), stacks, values)


def _forward(params, tokens, scratch: MoEScratch, unroll, with_aux: bool, keep: bool):
    """The scanned forward: ``(out, scratch, aux or None, saved or None)``.

    ``saved`` (``keep``): ``(carrier, stacks)``, the gate/up-gradient-shaped buffer holding the
    activations (None when they do not fit, ``_packing``) and the stacks of what it does not hold.
    """
    config = scratch.config
    num_layers = params["router"].shape[0]
    saved = None
    if keep:
        shapes = _saved_shapes(config, tokens.shape[0], params["down"].shape[-2])
        starts = _packing(config, tokens.shape[0], params["gate_up"].shape, params["gate_up"].dtype)
        carrier = None if starts is None else ops.uninitialized(params["gate_up"].shape, params["gate_up"].dtype)
        stacked = shapes if starts is None else shapes[_ACTIVATIONS:]
        saved = (carrier, tuple(ops.uninitialized((num_layers,) + shape, dtype) for shape, dtype in stacked))

    def body(carry, xs):
        h, s, saved = carry
        layer, layer_params = xs
        hidden_into = None
        if keep and saved[0] is not None:
            # The layer's input goes in first; its gate/up GEMM then stores its product straight
            # into the same slice (no copy of either afterwards).
            hidden_into = (ops.write_into(saved[0], layer, h, starts[0]), layer, starts[1])
        h, s, logits, ids, layer_saved = _layer_forward(layer_params, h, s, keep, hidden_into)
        if keep:
            carrier, stacks = saved
            if carrier is not None:
                carrier = layer_saved[1]
                layer_saved = layer_saved[_ACTIVATIONS:]
            saved = (carrier, _set_layer(stacks, layer, layer_saved))
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
    params, (carrier, stacks) = residuals
    d_out, _, d_aux = cotangents
    num_layers = params["router"].shape[0]
    num_tokens = d_out.shape[0]
    num_rows = config.live_row_bound(num_tokens)
    tile = gemm.pick_tile(num_rows, config.num_local_experts, config.group_row_bound(num_tokens))
    grads = {name: ops.uninitialized(a.shape, a.dtype) for name, a in params.items() if name != "gate_up"}
    # The gate/up gradient starts as the buffer holding the activations: each layer's slice is
    # read below before that layer's weight-gradient GEMM overwrites it.
    grads["gate_up"] = ops.uninitialized(params["gate_up"].shape, params["gate_up"].dtype) if carrier is None \
        else carrier
    shapes = _saved_shapes(config, num_tokens, params["down"].shape[-2])
    starts = _packing(config, num_tokens, params["gate_up"].shape, params["gate_up"].dtype)
    d_logits = d_aux["router_logits"] if with_aux else None

    def body(carry, xs):
        d_h, grads = carry
        layer, layer_params, layer_stacks, d_logits_layer = xs
        if carrier is None:
            h, hidden, dest, offsets = layer_stacks
            hidden_at = None
        else:  # hidden is read where it is by the activation's backward
            h_shape, h_dtype = shapes[0]
            h, hidden = ops.read_from(grads["gate_up"], layer, h_shape, starts[0], h_dtype), None
            hidden_at = (grads["gate_up"], layer, starts[1])
            dest, offsets = layer_stacks
        small, gate_up, down = _split(layer_params)
        (n, weights, logits, shared), dense_vjp, _ = jax.vjp(lambda h, small: _dense(small, h, config), h, small,
                                                             has_aux=True)
        src = ops.invert_dest(dest, num_rows)  # each row's route, for the gathers below
        # y = h + sum_j w[t, j] out[dest[t, j]] (+ shared): d y = d h reaches each route's output
        # rows unweighted here; the experts' backward applies the weights and gives their gradient.
        rows, d_h_rows = ops.rows_by_route((n, d_h.astype(config.dtype)), dest, src)
        d_rows, d_hidden, d_down, d_row_weights, workspace = swiglu_grouped_grad_but_gate_up(
            hidden, offsets, gate_up.astype(config.dtype), down.astype(config.dtype), d_h_rows, num_rows, tile,
            grads["down"], layer, row_weights=ops.routes_by_src(weights.astype(jnp.float32), src), hidden_at=hidden_at)
        d_weights = ops.routes_from_rows(d_row_weights, dest).astype(weights.dtype)
        d_n = ops.permute_grad(d_rows, dest)
        d_logits_layer = jnp.zeros_like(logits) if d_logits_layer is None else d_logits_layer
        d_h_dense, d_small = dense_vjp((d_n, d_weights, d_logits_layer, None if shared is None else d_h))
        gate_up_stack = grads["gate_up"]
        if carrier is not None:
            # Everything that reads this layer's activations feeds one of these values: the barrier
            # orders all those reads before the GEMM below overwrites the slice holding them (else
            # XLA would copy the whole stack to keep the late readers, the norm's backward, valid).
            d_h_dense, d_small, d_down, rows, d_hidden, gate_up_stack = lax.optimization_barrier(
                (d_h_dense, d_small, d_down, rows, d_hidden, gate_up_stack))
        d_gate_up, _ = gemm.weight_grad_into(rows, d_hidden, offsets, workspace, gate_up_stack, layer)
        small_grads = _set_layer({name: grads[name] for name in d_small}, layer, d_small)
        grads = {**small_grads, "gate_up": d_gate_up, "down": d_down}
        return (d_h + d_h_dense, grads), None

    xs = (jnp.arange(num_layers, dtype=jnp.int32), params, stacks, d_logits)
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
      grouped-GEMM experts. Its backward saves per layer the layer's input and the gate/up
      product (inside the gate/up gradient's buffer on a GPU when they fit: ``saved_in_gradient``)
      and the routes' rows and groups; recomputes the router, the routing, the shared expert and
      the permuted rows (one gather) from the layer's input; takes the router weights' gradient
      from the down projection's input gradient (no expert outputs kept); and writes every
      parameter gradient into its slice of a stacked buffer that nothing fills first.
    """
    out, scratch, aux = _stack(params, tokens, lax.stop_gradient(scratch), scratch.config, unroll, with_aux)
    return out, lax.stop_gradient(scratch), aux
