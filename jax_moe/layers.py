"""A functional MoE layer and a scanned stack of them that threads ONE scratch through every layer.

No classes with hidden state: parameters are a pytree of arrays stacked on a leading layer axis,
the scratch is a ``MoEScratch`` passed in and returned. ``moe_stack`` is a ``lax.scan`` over the
layer axis with the scratch in the carry, so the compiled program holds a single scratch however
deep the stack is, and a jitted step that donates the scratch gets it back in the same buffers.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe import _validate, gemm
from jax_moe.config import MoEConfig
from jax_moe.ops import permute, unpermute
from jax_moe.scratch import MoEScratch

# expert_fn(layer_params, rows [R, H], group_sizes [El] int32) -> rows_out [R, H] (rows' dtype).
ExpertFn = Callable[[dict, jax.Array, jax.Array], jax.Array]

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
    # Full float32 precision: on GPUs XLA's default f32 dot is TF32, whose rounding can flip the
    # top-k choice between close experts. The [T, H] x [H, E] router GEMM is cheap either way.
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
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


def _gated_silu(hidden: jax.Array, dtype) -> jax.Array:
    """SwiGLU's activation of the fused [R, 2F] gate/up product, in float32, cast to dtype."""
    gate, up = jnp.split(hidden.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def swiglu_experts(layer_params: dict, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The default experts: SwiGLU as two ``jax.lax.ragged_dot`` grouped GEMMs.

    Args:
      layer_params: one layer's params; ``gate_up`` [El, H, 2F] and ``down`` [El, F, H] are used.
      rows: [R, H] rows grouped by local expert (expert e owns ``group_sizes[e]`` consecutive rows).
      group_sizes: [El] int32. Rows past ``sum(group_sizes)`` come out zero (ragged_dot's rule).

    Returns:
      [R, H] of rows' dtype: ``down_e(silu(gate_e(row)) * up_e(row))`` for each row's expert e.
      Accumulation and the activation are in float32.
    """
    hidden = jax.lax.ragged_dot(rows, layer_params["gate_up"].astype(rows.dtype), group_sizes,
                                preferred_element_type=jnp.float32)
    activated = _gated_silu(hidden, rows.dtype)
    out = jax.lax.ragged_dot(activated, layer_params["down"].astype(rows.dtype), group_sizes,
                             preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


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


def live_row_bound(config, num_tokens: int) -> int:
    """Static bound on the rows permute fills for num_tokens tokens: T*k + El*(align-1), aligned."""
    bound = num_tokens * config.top_k + config.num_local_experts * (config.align - 1)
    return min(config.capacity, -(-bound // config.align) * config.align)


def swiglu_experts_grouped(layer_params: dict, scratch: MoEScratch, num_tokens: int):
    """``swiglu_experts`` on the CUDA grouped GEMM: gate/up as one GEMM of width 2F, then down.

    Reads the rows and groups from the scratch and threads its workspace through both GEMMs.
    Returns ``([R_cap, H] rows for unpermute, scratch)``. The gate/up product is rounded to the
    rows' dtype before the activation (the ragged_dot path keeps it in float32).
    """
    config = scratch.config
    dtype = config.dtype
    live_bound = live_row_bound(config, num_tokens)
    hidden, scratch = gemm.grouped_matmul(scratch.permuted, layer_params["gate_up"].astype(dtype), scratch,
                                          num_rows=live_bound)
    activated = _gated_silu(hidden, dtype)
    out, scratch = gemm.grouped_matmul(activated, layer_params["down"].astype(dtype), scratch)
    if live_bound < config.capacity:
        out = jnp.pad(out, ((0, config.capacity - live_bound), (0, 0)))
    return out, scratch


def uses_grouped_matmul(layer_params: dict, config) -> bool:
    """Whether ``moe_layer``'s default experts run on the CUDA grouped GEMM (GPU, bf16, aligned sizes)."""
    ffn_size = layer_params["down"].shape[-2]
    return jax.default_backend() == "gpu" and gemm.supports_grouped_matmul(config, config.hidden_size, ffn_size)


def experts_on_scratch(expert_fn: ExpertFn, layer_params, scratch: MoEScratch, num_tokens: int) -> jax.Array:
    """Runs the experts on the rows that can be live, returns [R_cap, H] for ``unpermute``.

    At most ``T*k + El*(align-1)`` rows are live for T tokens (static), so when the scratch was
    sized for more tokens only that prefix goes through the GEMMs; the rest is zero (never read).
    """
    config = scratch.config
    live_bound = live_row_bound(config, num_tokens)
    rows = scratch.permuted if live_bound == config.capacity else scratch.permuted[:live_bound]
    out = expert_fn(layer_params, rows, scratch.group_sizes)
    if out.shape != rows.shape or out.dtype != rows.dtype:
        raise ValueError(f"moe_layer: expert_fn: expected it to return {rows.dtype}{list(rows.shape)} "
                         f"(rows' shape and dtype), got {out.dtype}{list(out.shape)}")
    if live_bound < config.capacity:
        out = jnp.pad(out, ((0, config.capacity - live_bound), (0, 0)))
    return out


def run_experts(expert_fn: ExpertFn | None, layer_params: dict, scratch: MoEScratch,
                num_tokens: int) -> tuple[jax.Array, MoEScratch]:
    """The experts on a permuted scratch: ``(rows_out [R_cap, H] for unpermute, scratch)``.

    ``expert_fn`` None is SwiGLU: on the CUDA grouped GEMM where ``uses_grouped_matmul`` says so
    (GPU, bf16, aligned sizes), else on ``jax.lax.ragged_dot``. Both the single-device layer and
    the expert-parallel one (on its received rows) come through here.
    """
    if expert_fn is None and uses_grouped_matmul(layer_params, scratch.config):
        return swiglu_experts_grouped(layer_params, scratch, num_tokens)
    expert_fn = swiglu_experts if expert_fn is None else expert_fn
    return experts_on_scratch(expert_fn, layer_params, scratch, num_tokens), scratch


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
