"""One MoE layer's data path, written once: route -> dispatch -> experts -> combine.

``run_layer`` is the only place the sequence exists. ``moe_layer``, the scanned ``moe_stack`` (its
inference forward and its training forward) and the expert-parallel layer all call it; they differ
only in the ``LayerPlan`` they pass (which kernels) and in the ``Dispatch`` (where the routed rows go
and how they come back):

- ``LocalDispatch``: ``permute`` the routes into this device's scratch; combine with ``unpermute``
  (the residual and shared-expert adds in its launch when the plan says so);
- ``jax_moe.parallel.ExpertParallelDispatch``: exchange the routes with the devices owning their
  experts, ``permute`` what arrives; combine by exchanging the outputs back and summing per token.

The scratch is state, never a differentiable value: its gradient is stopped on the way in and out
(the stop lowers to nothing, so the buffers still flow from one aliased call to the next).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
from jax import lax

from jax_moe import experts, ops, routing
from jax_moe.config import MoEConfig
from jax_moe.experts import ExpertFn
from jax_moe.plan import SHARED_IN_ROUTED_LAUNCH, LayerPlan
from jax_moe.scratch import MoEScratch


class LayerOutput(NamedTuple):
    """What ``run_layer`` returns.

    y: [T, H] the layer's output (plus the residual when one was given); scratch: to pass on;
    logits: [T, E] float32 router logits; ids: [T, k] int32 chosen experts; hidden: the gate/up
    product the experts kept for a backward (``keep_hidden``), else None; extra: what the dispatch
    reports (expert parallel: the routes its capacity dropped), else None.
    """

    y: jax.Array
    scratch: MoEScratch
    logits: jax.Array
    ids: jax.Array
    hidden: Any = None
    extra: Any = None


class Dispatch(Protocol):
    """Where a layer's routed rows go and how their outputs come back (vLLM's prepare/finalize)."""

    def dispatch(self, plan: LayerPlan, layer_params: dict, tokens: jax.Array, ids: jax.Array, scratch: MoEScratch):
        """Groups the routes' rows by local expert into the scratch: ``(scratch, state, experts_plan)``,
        experts_plan being the plan of the experts step on those rows."""

    def combine(self, plan: LayerPlan, rows_out: jax.Array, weights: jax.Array, scratch: MoEScratch, state,
                residual: jax.Array | None, shared: jax.Array | None):
        """The weighted sum per token of its routes' outputs, plus shared and residual: ``(y, extra)``."""


class LocalDispatch:
    """The single-device dispatch: ``permute`` into the scratch, ``unpermute`` back."""

    def dispatch(self, plan, layer_params, tokens, ids, scratch):
        if plan.permute == "prefetch":  # the launch also starts the next GEMM's weights towards L2
            scratch = ops.permute(tokens, ids, scratch, prefetch=layer_params["gate_up"],
                                  prefetch_bytes=plan.prefetch_bytes)
        else:
            scratch = ops.permute(tokens, ids, scratch)
        return scratch, None, plan

    def combine(self, plan, rows_out, weights, scratch, state, residual, shared):
        if residual is not None and plan.residual_in_unpermute:
            return ops.unpermute_add(rows_out, weights, scratch, residual, shared), None
        y = ops.unpermute(rows_out, weights, scratch)
        if shared is not None:
            y = y + shared
        return (y if residual is None else residual + y), None


LOCAL = LocalDispatch()


def route(plan: LayerPlan, layer_params: dict, x: jax.Array, scratch: MoEScratch, config: MoEConfig,
          pre_norm: bool):
    """The router step: ``(n, weights [T, k], ids [T, k], logits [T, E], scratch)``, n the tokens the
    experts see (``rms_norm(x)`` with ``pre_norm``, else x)."""
    router, bias = layer_params["router"], layer_params.get("router_bias")
    if plan.router == "kernel" and pre_norm and plan.norm_in_router:
        return routing.route_decode_normalizing(router, x, scratch, bias)
    n = ops.rms_norm(x) if pre_norm else x
    if plan.router == "kernel":  # differentiable: its backward keeps the ids
        weights, ids, logits, scratch = routing.route_decode(router, n, scratch, bias)
    else:
        logits = routing.router_logits(router, n)
        weights, ids = routing.route_logits(logits, config, bias)
    return n, weights, ids, logits, scratch


def run_layer(plan: LayerPlan, layer_params: dict, x: jax.Array, scratch: MoEScratch, *,
              expert_fn: ExpertFn | None = None, residual: jax.Array | None = None, pre_norm: bool = False,
              dispatch: Dispatch = LOCAL, config: MoEConfig | None = None, keep_hidden=None) -> LayerOutput:
    """One MoE layer on tokens x [T, H] (no argument checks: the public functions check).

    Args:
      plan: the kernels (``jax_moe.plan_layer``), made for T tokens.
      layer_params: one layer's params (``init_moe_params`` sliced at a layer).
      x: [T, H] the layer's input.
      scratch: the scratch the routed rows go through.
      expert_fn: the caller's experts for ``plan.experts == "custom"``.
      residual: [T, H] added to the output (in unpermute's launch when the plan says so).
      pre_norm: route and run the experts on ``rms_norm(x)`` (a pre-norm block; the kernel router
        can normalise in its own launch).
      dispatch: ``LOCAL``, or expert parallel's exchange.
      config: the routing config (default: the scratch's; expert parallel routes with the global one).
      keep_hidden: for a stack's training forward on the bf16 grouped GEMMs: True keeps the gate/up
        product for the backward, or ``(stack, layer, offset)`` writes it there
        (``experts.swiglu_grouped_forward``); the experts then run without their own autodiff rule.

    Returns:
      A ``LayerOutput``.
    """
    config = scratch.config if config is None else config
    scratch = lax.stop_gradient(scratch)
    n, weights, ids, logits, scratch = route(plan, layer_params, x, scratch, config, pre_norm)
    hidden = shared = None
    if plan.permute == "fp8_quantize":  # the permute writes the FP8 GEMMs' rows: dispatch and experts in one
        rows_out, scratch = experts.fp8_experts_on_tokens(layer_params, n, ids, scratch, plan)
        state = None
    else:
        scratch, state, experts_plan = dispatch.dispatch(plan, layer_params, n, ids, scratch)
        if keep_hidden is not None:
            rows_out, scratch, hidden = experts.run_experts_keeping_hidden(
                experts_plan, layer_params, scratch, None if keep_hidden is True else keep_hidden)
        else:
            rows_out, shared, scratch = experts.run_experts(experts_plan, layer_params, scratch, n, expert_fn)
    # The shared expert after the routed ones: the order of n's uses is the order JAX sums their
    # cotangents in, and this one keeps the gradients' bits as they were.
    if plan.shared not in SHARED_IN_ROUTED_LAUNCH:
        shared = experts.shared_experts(layer_params, n, plan)
    y, extra = dispatch.combine(plan, rows_out, weights, scratch, state, residual, shared)
    return LayerOutput(y, lax.stop_gradient(scratch), logits, ids, hidden, extra)
