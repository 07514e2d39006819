"""``moe_layer``: one functional MoE layer that threads the scratch through (no hidden state).

Parameters are a pytree of arrays (``jax_moe.params``), the scratch a ``MoEScratch`` passed in and
returned. The layer's sequence (route -> permute -> experts -> unpermute) is
``jax_moe.pipeline.run_layer``; its kernels are the call's ``LayerPlan`` (``jax_moe.plan``). A
scanned stack of layers is ``jax_moe.stack.moe_stack``; expert parallel is ``jax_moe.parallel``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import _validate, pipeline, plan as plan_lib, routing
from jax_moe.experts import ExpertFn
from jax_moe.params import check_layer_params, check_options, flat_tokens, moved_to_parallel
from jax_moe.plan import LayerPlan
from jax_moe.scratch import MoEScratch


def moe_layer(layer_params: dict, x: jax.Array, scratch: MoEScratch,
              expert_fn: ExpertFn | None = None, *, with_aux: bool = False, residual: jax.Array | None = None,
              plan: LayerPlan | None = None, mesh=None, axis_name: str | None = None):
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
        dtype, where rows past ``sum(group_sizes)`` must not affect the others. None means SwiGLU
        on the plan's kernels (the CUDA grouped GEMMs on a GPU, else ``jax.lax.ragged_dot``).
      with_aux: also return the router's training signals.
      residual: optional, of x's shape and dtype: y is then ``residual + y`` (a pre-norm block's
        ``h + moe_layer(params, norm(h), ...)``), both adds in unpermute's launch on a GPU
        (``ops.unpermute_add``: no pass over [T, H] of its own; the same bits as the adds apart).
      plan: the kernels to run (``jax_moe.plan_layer(config, T, layer_params)``, the default), made
        for this call's T tokens.

    Returns:
      ``(y, scratch)``: y of x's shape and dtype, the router-weighted sum of each token's k expert
      outputs (dropped routes of ``config.expert_map`` contribute 0) plus the shared expert's output
      (plus ``residual``), and the scratch to pass on (state, not a differentiable output: its
      gradient is stopped). With
      ``with_aux``: ``(y, scratch, aux)``, aux = ``{"router_logits": [T, E] float32,
      "expert_counts": [E] int32}`` (routes per global expert) for ``jax_moe.routing``'s losses.

    Expert parallel: ``jax_moe.moe_layer_ep`` (this module sits below ``jax_moe.parallel``).
    """
    op = "moe_layer"
    moved_to_parallel(op, mesh, axis_name)
    check_options(op, expert_fn)
    _validate.check_scratch(op, scratch)
    config = scratch.config
    check_layer_params(op, layer_params, config, stacked=False)
    tokens = flat_tokens(op, x, config)
    if residual is not None and (tuple(jnp.shape(residual)) != tuple(jnp.shape(x))
                                 or jnp.dtype(residual.dtype) != jnp.dtype(x.dtype)):
        raise ValueError(f"{op}: residual: expected x's shape and dtype, {jnp.dtype(x.dtype)}"
                         f"{list(jnp.shape(x))}, got {jnp.dtype(residual.dtype)}{list(jnp.shape(residual))}")
    plan = (plan_lib.plan_layer(config, tokens.shape[0], layer_params, expert_fn=expert_fn) if plan is None
            else plan_lib.check_plan(op, plan, tokens.shape[0]))
    out = pipeline.run_layer(plan, layer_params, tokens, scratch, expert_fn=expert_fn,
                             residual=None if residual is None else jnp.reshape(residual, tokens.shape))
    y = jnp.reshape(out.y, jnp.shape(x))
    if not with_aux:
        return y, out.scratch
    return y, out.scratch, {"router_logits": out.logits,
                            "expert_counts": routing.expert_counts(out.ids, config.num_experts)}
