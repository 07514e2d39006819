"""``moe_stack``: L pre-norm residual MoE layers in one ``lax.scan``, and its training path.

Each layer is ``x = x + moe_layer(params[l], rms_norm(x), scratch)``, run by
``jax_moe.pipeline.run_layer`` with the scratch in the scan's carry: the compiled program holds
one scratch however deep the stack, and a jitted step that donates it gets it back in the same
buffers.

On the CUDA bf16 grouped GEMMs (``plan.experts == "grouped_gemm"``) the stack is differentiated as
a whole by one ``jax.custom_vjp`` (``grouped_stack``) instead of JAX's transpose of the scan. The
transpose of a scan collects each layer's parameter gradients as the loop's stacked outputs and
starts those from zeros (a fill of every weight gradient), each layer's gradient a buffer of its
own copied into the stack. Here the stacked gradients, and the activations the forward saves, start
as ``_ffi.uninitialized`` buffers that the loops write one layer's slice at a time: every element is
written exactly once, each weight gradient by its GEMM straight into its slice
(``gemm.weight_grad_into``). On a GPU the saved activations ride in the gate/up weight gradient's
own buffer when they fit (``plan.activations_in_gradient``, ``saved_in_gradient``): layer l's slice
is written only by layer l's backward, after it has read them, so the step holds no activation
stack beside the gradients.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import _ffi, _validate, gemm, ops, params as params_lib, pipeline, plan as plan_lib, routing
from jax_moe.config import MoEConfig
from jax_moe.experts import ExpertFn, shared_experts, swiglu_grouped_grad_but_gate_up
from jax_moe.ops import rms_norm  # noqa: F401 (the stack's norm, public here as before)
from jax_moe.plan import LayerPlan
from jax_moe.scratch import MoEScratch

EXPERT_WEIGHTS = ("gate_up", "down")


def _dense(small: dict, h: jax.Array, config: MoEConfig, plan: LayerPlan):
    """A layer's dense part from its input h [T, H], recomputed by the backward for its vjp:
    ``((n, weights, logits, shared), ids)``. n = rms_norm(h); the router's logits [T, E] float32,
    weights [T, k] float32 and ids [T, k] int32 (as the training forward's XLA router chose them);
    the shared expert's output [T, H] or None. ``small``: the params other than the expert weights.
    """
    n = rms_norm(h)
    logits = routing.router_logits(small["router"], n)
    weights, ids = routing.route_logits(logits, config, small.get("router_bias"))
    return (n, weights, logits, shared_experts(small, n, plan)), ids


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


def _packing(config: MoEConfig, num_tokens: int, gate_up_shape, gate_up_dtype, allowed: bool = True):
    """Where each saved activation starts in a layer's flattened gate/up gradient slice, or None.

    None when not ``allowed`` (``plan.activations_in_gradient``: XLA:GPU compiles both loops
    without a copy of the stack, XLA:CPU copies the whole stack in each loop's body), when they do
    not fit in it, or when the gradient's dtype is not the activations' (float32 master weights
    with bf16 activations): they then get stacks of their own.
    """
    shapes = _saved_shapes(config, num_tokens, gate_up_shape[-1] // 2)[:_ACTIVATIONS]
    if not allowed or jnp.dtype(gate_up_dtype) != jnp.dtype(config.dtype):
        return None
    sizes = [math.prod(shape) for shape, _ in shapes]
    if sum(sizes) > math.prod(gate_up_shape[1:]):
        return None
    return tuple(itertools.accumulate([0] + sizes[:-1]))


def saved_in_gradient(config: MoEConfig, num_tokens: int, gate_up_shape, gate_up_dtype, allowed: bool = True) -> bool:
    """Whether ``grouped_stack``'s backward finds the saved activations in the gate/up gradient.

    True when a layer's input [T, H] and gate/up product [R, 2F] (R = ``live_row_bound(T)``) fit
    in one layer's gate/up gradient [El, H, 2F] of the activations' dtype: about T <= El * H / k
    (Qwen3-30B-A3B: T <= 28,000; DeepSeek-V3: 200,000).
    """
    return _packing(config, num_tokens, gate_up_shape, gate_up_dtype, allowed) is not None


def _set_layer(stacks, layer, values):
    """Writes ``values`` into slice ``layer`` of each stacked array (in place inside a loop)."""
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), layer, 0), stacks, values)


def _forward(params, tokens, scratch: MoEScratch, plan: LayerPlan, unroll, with_aux: bool, keep: bool):
    """The scanned forward: ``(out, scratch, aux or None, saved or None)``.

    ``keep`` (a training forward, ``plan`` its ``for_training()``): ``saved`` is ``(carrier,
    stacks)``, the gate/up-gradient-shaped buffer holding the activations (None when they do not
    fit, ``_packing``) and the stacks of what it does not hold.
    """
    config = scratch.config
    num_layers = params["router"].shape[0]
    saved = None
    if keep:
        shapes = _saved_shapes(config, tokens.shape[0], params["down"].shape[-2])
        starts = _packing(config, tokens.shape[0], params["gate_up"].shape, params["gate_up"].dtype,
                          plan.activations_in_gradient)
        carrier = None if starts is None else _ffi.uninitialized(params["gate_up"].shape, params["gate_up"].dtype)
        stacked = shapes if starts is None else shapes[_ACTIVATIONS:]
        saved = (carrier, tuple(_ffi.uninitialized((num_layers,) + shape, dtype) for shape, dtype in stacked))

    def body(carry, xs):
        h, s, saved = carry
        layer, layer_params = xs
        keep_hidden = None
        if keep:
            # The layer's input goes in first; its gate/up GEMM then stores its product straight
            # into the same slice (no copy of either afterwards).
            keep_hidden = True if saved[0] is None else (_ffi.write_into(saved[0], layer, h, starts[0]), layer,
                                                         starts[1])
        out = pipeline.run_layer(plan, layer_params, h, s, residual=h, pre_norm=True, keep_hidden=keep_hidden)
        if keep:
            carrier, stacks = saved
            layer_saved = (h, out.hidden, out.scratch.dest_index[:h.shape[0]], out.scratch.expert_offsets)
            if carrier is not None:
                carrier = out.hidden  # the stack the gate/up GEMM wrote into
                layer_saved = layer_saved[_ACTIVATIONS:]
            saved = (carrier, _set_layer(stacks, layer, layer_saved))
        h, s, logits, ids = out.y, out.scratch, out.logits, out.ids
        aux = {"router_logits": logits, "expert_counts": routing.expert_counts(ids, config.num_experts)}
        return (h, s, saved), (aux if with_aux else None)

    (out, scratch, saved), aux = lax.scan(body, (tokens, scratch, saved),
                                          (jnp.arange(num_layers, dtype=jnp.int32), params), unroll=unroll)
    return out, scratch, aux, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _stack(params, tokens, scratch, config, plan, unroll, with_aux):
    out, scratch, aux, _ = _forward(params, tokens, scratch, plan, unroll, with_aux, keep=False)
    return out, scratch, aux


def _stack_fwd(params, tokens, scratch, config, plan, unroll, with_aux):
    out, scratch, aux, saved = _forward(params, tokens, scratch, plan.for_training(), unroll, with_aux, keep=True)
    return (out, scratch, aux), (params, saved)  # the params by reference, the saved stacks


def _stack_bwd(config, plan, unroll, with_aux, residuals, cotangents):
    params, (carrier, stacks) = residuals
    d_out, _, d_aux = cotangents
    plan = plan.for_training()
    num_layers = params["router"].shape[0]
    num_tokens = d_out.shape[0]
    num_rows = config.live_row_bound(num_tokens)
    tile = plan.tile
    grads = {name: _ffi.uninitialized(a.shape, a.dtype) for name, a in params.items() if name != "gate_up"}
    # The gate/up gradient starts as the buffer holding the activations: each layer's slice is
    # read below before that layer's weight-gradient GEMM overwrites it.
    grads["gate_up"] = _ffi.uninitialized(params["gate_up"].shape, params["gate_up"].dtype) if carrier is None \
        else carrier
    shapes = _saved_shapes(config, num_tokens, params["down"].shape[-2])
    starts = _packing(config, num_tokens, params["gate_up"].shape, params["gate_up"].dtype, plan.activations_in_gradient)
    d_logits = d_aux["router_logits"] if with_aux else None

    def body(carry, xs):
        d_h, grads = carry
        layer, layer_params, layer_stacks, d_logits_layer = xs
        if carrier is None:
            h, hidden, dest, offsets = layer_stacks
            hidden_at = None
        else:  # hidden is read where it is by the activation's backward
            h_shape, h_dtype = shapes[0]
            h, hidden = _ffi.read_from(grads["gate_up"], layer, h_shape, starts[0], h_dtype), None
            hidden_at = (grads["gate_up"], layer, starts[1])
            dest, offsets = layer_stacks
        small, gate_up, down = _split(layer_params)
        (n, weights, logits, shared), dense_vjp, _ = jax.vjp(lambda h, small: _dense(small, h, config, plan), h,
                                                             small, has_aux=True)
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


def grouped_stack(params: dict, tokens: jax.Array, scratch: MoEScratch, plan: LayerPlan, *,
                  unroll: int | bool = 1, with_aux: bool = False):
    """``moe_stack`` on the bf16 grouped GEMMs with a hand-written backward (no argument checks).

    Args:
      params: stacked layer params (``init_moe_params``), SwiGLU experts ``gate_up`` [L, El, H, 2F]
        and ``down`` [L, El, F, H].
      tokens: [T, H] of ``scratch.config.dtype``.
      scratch: the one ``MoEScratch``, threaded through the layers (state: no gradient).
      plan: the layers' kernels (``plan.experts == "grouped_gemm"``); the training forward and the
        backward run its ``for_training()``.
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
    out, scratch, aux = _stack(params, tokens, lax.stop_gradient(scratch), scratch.config, plan, unroll, with_aux)
    return out, lax.stop_gradient(scratch), aux


def _scan_layers(params, tokens, scratch, plan: LayerPlan, unroll, expert_fn, with_aux):
    """The stack as a ``lax.scan`` of ``run_layer``, differentiated by JAX."""
    def body(carry, layer_params):
        h, s = carry
        out = pipeline.run_layer(plan, layer_params, h, s, expert_fn=expert_fn, residual=h, pre_norm=True)
        aux = {"router_logits": out.logits, "expert_counts": routing.expert_counts(out.ids, s.config.num_experts)}
        return (out.y, out.scratch), (aux if with_aux else None)

    return lax.scan(body, (tokens, scratch), params, unroll=unroll)


def moe_stack(params: dict, x: jax.Array, scratch: MoEScratch, *, unroll: int | bool = 1,
              expert_fn: ExpertFn | None = None, with_aux: bool = False, plan: LayerPlan | None = None,
              mesh=None, axis_name: str | None = None):
    """L pre-norm residual MoE layers as one ``lax.scan`` with the scratch in the carry.

    Each layer computes ``x = x + moe_layer(params[l], rms_norm(x), scratch)``.

    Args:
      params: ``init_moe_params`` output (or ``jax_moe.hf.load_moe``'s), leaves stacked on a
        leading layer axis L.
      x: [..., H] of ``scratch.config.dtype`` (leading batch axes flattened inside, restored); at
        most ``config.max_tokens`` tokens in all.
      scratch: the ONE ``MoEScratch`` shared by all layers. Donate it to the enclosing ``jax.jit``
        (``donate_argnums``) to have it written in place and returned in the same buffers; in a
        training step return it through ``value_and_grad``'s ``has_aux``.
      unroll: passed to ``lax.scan`` (an int, or True for a fully unrolled loop).
      expert_fn: as in ``moe_layer``.
      with_aux: also return every layer's router signals, stacked.
      plan: the kernels of every layer (``jax_moe.plan_layer(config, T, params)``, the default).

    On the CUDA bf16 grouped GEMMs the stack is differentiated as a whole by a hand-written
    backward (``grouped_stack``) that writes every weight gradient straight into its layer's slice
    of the stacked gradient: no zero fill, no per-layer copy. Otherwise JAX differentiates the scan.

    Returns:
      ``(x_out, scratch)``: x_out of x's shape and dtype, and the scratch to pass to the next step.
      With ``with_aux``: ``(x_out, scratch, aux)``, aux = ``{"router_logits": [L, T, E] float32,
      "expert_counts": [L, E] int32}`` (feed ``jax_moe.routing.load_balancing_loss``,
      ``router_z_loss``, ``update_router_bias``).

    Expert parallel: ``jax_moe.moe_stack_ep``.
    """
    op = "moe_stack"
    params_lib.moved_to_parallel(op, mesh, axis_name)
    params_lib.check_options(op, expert_fn, unroll)
    _validate.check_scratch(op, scratch)
    config = scratch.config
    params_lib.check_layer_params(op, params, config, stacked=True)
    tokens = params_lib.flat_tokens(op, x, config)
    plan = (plan_lib.plan_layer(config, tokens.shape[0], params, expert_fn=expert_fn) if plan is None
            else plan_lib.check_plan(op, plan, tokens.shape[0]))
    try:
        if expert_fn is None and plan.experts == "grouped_gemm":
            tokens, scratch, aux = grouped_stack(params, tokens, scratch, plan, unroll=unroll, with_aux=with_aux)
        else:
            (tokens, scratch), aux = _scan_layers(params, tokens, scratch, plan, unroll, expert_fn, with_aux)
    except NotImplementedError as error:  # ragged_dot's batching rule inside the scan
        if "vmap" not in str(error):
            raise
        raise ValueError(f"{op}: x: jax.vmap of moe_stack is not supported (the layers' grouped GEMMs cannot be "
                         f"batched inside its scan); moe_stack takes the batch itself: pass x with the batch as "
                         f"leading axes, [B, T, H], instead of vmapping over it") from None
    out = jnp.reshape(tokens, jnp.shape(x))
    return (out, scratch, aux) if with_aux else (out, scratch)
