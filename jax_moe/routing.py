"""Routing: router scores, the top-k choice of every supported model, and the routers' training terms.

Variants, chosen by the static ``MoEConfig``:
- softmax over all E experts, top-k, renormalised (Mixtral, Qwen3-MoE, Qwen3.5-MoE) or not
  (Qwen2-MoE's default ``norm_topk_prob=False``): ``scoring="softmax"``, ``renormalize``;
- DeepSeek-V3: sigmoid scores; a per-expert correction bias (param leaf ``router_bias`` [E]) added
  for choosing only; ``n_group`` groups scored by the sum of their two best biased scores, only the
  ``topk_group`` best groups eligible; the chosen experts' unbiased scores renormalised with
  ``renormalize_epsilon`` and multiplied by ``routed_scaling_factor``.
Router math is float32. Ties go to the lower expert (or group) index, deterministically
(``jax.lax.top_k``'s order).

The CUDA router (``route_decode``, ``route_decode_normalizing``): the whole router (logits, scores,
choice, weights) in one launch for a few tokens, the same ids as XLA's routing of its logits;
``jax_moe.plan`` takes it at decode sizes.

Training helpers: ``load_balancing_loss`` (transformers' ``load_balancing_loss_func``, the
Mixtral/Qwen form), ``router_z_loss``, and DeepSeek-V3's auxiliary-loss-free bias update
``update_router_bias``, all pure functions of what ``moe_stack(..., with_aux=True)`` returns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe import _ffi, _native
from jax_moe.config import MoEConfig
from jax_moe.ops import RMS_NORM_EPSILON, rms_norm
from jax_moe.scratch import MoEScratch


def dot_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` accumulated in float32, at full float32 precision when an operand is float32.

    On GPUs XLA's default f32 dot is TF32, whose rounding can flip the top-k choice between close
    experts. bf16 products are exact in float32 already, and asking HIGHEST of bf16 operands could
    make XLA upcast the weights. (The router's logits and the shared expert use it.)
    """
    exact = jnp.float32 in (jnp.dtype(x.dtype), jnp.dtype(w.dtype))
    return jnp.dot(x, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST if exact else None)


def router_logits(router: jax.Array, x: jax.Array) -> jax.Array:
    """[T, E] float32 logits ``x @ router`` (x [T, H], router [H, E]), float32 accumulation."""
    return dot_f32(x, router)


def scores_from_logits(logits: jax.Array, config: MoEConfig) -> jax.Array:
    """[T, E] float32 scores: softmax over all E, or sigmoid, as ``config.scoring`` says."""
    logits = logits.astype(jnp.float32)
    return jax.nn.softmax(logits, axis=-1) if config.scoring == "softmax" else jax.nn.sigmoid(logits)


def router_scores(router: jax.Array, x: jax.Array, config: MoEConfig) -> jax.Array:
    """[T, E] float32 router scores of x [T, H]: softmax over all E, or sigmoid (``config.scoring``)."""
    return scores_from_logits(router_logits(router, x), config)


def _check_route_args(logits, config: MoEConfig, bias) -> None:
    if logits.ndim != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(f"route: router logits: expected shape (T, {config.num_experts}) [T, num_experts], "
                         f"got {tuple(logits.shape)}")
    if config.top_k > config.num_experts:
        raise ValueError(f"route: config.top_k: expected at most num_experts={config.num_experts}, got {config.top_k}")
    if bias is not None and tuple(jnp.shape(bias)) != (config.num_experts,):
        raise ValueError(f"route: router_bias: expected shape ({config.num_experts},) [num_experts], "
                         f"got {tuple(jnp.shape(bias))}")


def route_logits(logits: jax.Array, config: MoEConfig, bias: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """Router logits -> ``(topk_weights [T, k] float32, topk_ids [T, k] int32)`` as ``config`` says.

    Args:
      logits: [T, E] router logits (float32 math whatever their dtype).
      config: scoring, renormalize(_epsilon), n_group/topk_group, routed_scaling_factor, top_k.
      bias: optional [E] correction added to the scores for choosing experts (and groups) only.

    Returns:
      Weights from the unbiased scores of the chosen experts (renormalised and scaled when
      configured) and the chosen global expert ids, best first.
    """
    _check_route_args(logits, config, bias)
    scores = scores_from_logits(logits, config)
    choice = scores if bias is None else scores + lax.stop_gradient(bias).astype(jnp.float32)
    ids = choose_experts(lax.stop_gradient(choice), config)
    return chosen_weights(scores, ids, config), ids


# The CUDA choice kernel's limits (cuda/constants.h).
CHOOSE_MAX_EXPERTS = _native.constants.CHOOSE_EXPERTS_MAX_EXPERTS
CHOOSE_MAX_TOP_K = _native.constants.CHOOSE_EXPERTS_MAX_TOP_K
CHOOSE_MAX_GROUPS = _native.constants.CHOOSE_EXPERTS_MAX_GROUPS


def choose_experts(choice: jax.Array, config: MoEConfig) -> jax.Array:
    """[T, k] int32 ids of each token's ``config.top_k`` best choices [T, E] float32, best first, ties
    to the lower index; with ``n_group > 1`` only within the ``topk_group`` groups whose two best
    choices sum highest. ``lax.top_k``'s ids; on a GPU one kernel (``jax_moe_choose_experts``, one
    warp per token) instead of XLA's sorts, where the sizes fit it."""
    num_tokens, num_experts = choice.shape

    def native(choice):
        call = jax.ffi.ffi_call(_native.CHOOSE_EXPERTS_TARGET,
                                jax.ShapeDtypeStruct((num_tokens, config.top_k), jnp.int32), vmap_method="sequential")
        return call(choice, n_group=np.int64(config.n_group), topk_group=np.int64(config.topk_group))

    fits = (num_experts <= CHOOSE_MAX_EXPERTS and config.top_k <= min(num_experts, CHOOSE_MAX_TOP_K)
            and config.n_group <= CHOOSE_MAX_GROUPS and num_tokens >= 1)
    choice = choice.astype(jnp.float32)
    xla = functools.partial(choose_experts_xla, config=config)
    if not (_native.HAS_CUDA and fits):
        return xla(choice)
    return lax.platform_dependent(choice, cuda=native, default=xla)


def choose_experts_xla(choice: jax.Array, config: MoEConfig) -> jax.Array:
    """``choose_experts`` by ``lax.top_k`` (XLA's sorts on a GPU): the CPU path and the GPU kernel's oracle."""
    if config.n_group > 1:
        num_tokens = choice.shape[0]
        grouped = choice.reshape(num_tokens, config.n_group, -1)
        group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        _, best_groups = lax.top_k(group_scores, config.topk_group)
        eligible = jnp.any(best_groups[:, :, None] == jnp.arange(config.n_group), axis=1)  # [T, n_group]
        choice = jnp.where(eligible[:, :, None], grouped, -jnp.inf).reshape(num_tokens, -1)
    return lax.top_k(choice, config.top_k)[1].astype(jnp.int32)


def chosen_weights(scores: jax.Array, ids: jax.Array, config: MoEConfig) -> jax.Array:
    """[T, k] float32 weights of the chosen experts: scores [T, E] at ids [T, k], renormalised and
    scaled as ``config`` says (``route_logits``' weights as a function of the scores alone)."""
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if config.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + config.renormalize_epsilon)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights


def route(router: jax.Array, x: jax.Array, config: MoEConfig, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """``route_logits(router_logits(router, x), config, bias)``: x [T, H], router [H, E]."""
    if jnp.ndim(x) != 2 or jnp.shape(x)[1] != config.hidden_size:
        raise ValueError(f"route: x: expected shape (T, {config.hidden_size}) [T, hidden_size], got {jnp.shape(x)}")
    if jnp.shape(router) != (config.hidden_size, config.num_experts):
        raise ValueError(f"route: router: expected shape ({config.hidden_size}, {config.num_experts}) "
                         f"[hidden_size, num_experts], got {jnp.shape(router)}")
    return route_logits(router_logits(router, x), config, bias)


def expert_counts(topk_ids: jax.Array, num_experts: int) -> jax.Array:
    """[E] int32 routes per global expert (ids outside [0, E) are not counted)."""
    if not jnp.issubdtype(jnp.result_type(topk_ids), jnp.integer):
        raise ValueError(f"expert_counts: topk_ids: expected an integer dtype, got {jnp.result_type(topk_ids)}")
    flat = jnp.asarray(topk_ids).reshape(-1)
    return jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")


def load_balancing_loss(router_logits: jax.Array, top_k: int, attention_mask: jax.Array | None = None) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer form, as Mixtral and Qwen use it).

    Args:
      router_logits: [..., T, E] logits of every layer (e.g. ``aux["router_logits"]`` [L, T, E]
        of ``moe_stack(..., with_aux=True)``); all leading axes are layers, as transformers
        concatenates its per-layer tuple.
      top_k: the k the loss counts choices with.
      attention_mask: optional [T] (or the tokens' leading shape) 1 for real tokens, 0 for padding.

    Returns:
      float32 scalar ``E * sum_e f_e * P_e``: f_e the fraction of (token, slot) choices of expert e,
      P_e the mean router probability of e, both over the real tokens of every layer.
    """
    num_experts = router_logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= num_experts:
        raise ValueError(f"load_balancing_loss: top_k: expected an integer in [1, {num_experts}] (the logits' "
                         f"last axis), got {top_k!r}")
    probs = jax.nn.softmax(router_logits.astype(jnp.float32).reshape(-1, num_experts), axis=-1)  # [N, E]
    _, chosen = lax.top_k(probs, top_k)
    one_hot = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32)  # [N, k, E]
    if attention_mask is None:
        tokens_per_expert = jnp.mean(one_hot, axis=0)  # [k, E]
        prob_per_expert = jnp.mean(probs, axis=0)
    else:
        tokens = attention_mask.size
        layers = probs.shape[0] // tokens
        if layers * tokens != probs.shape[0]:
            raise ValueError(f"load_balancing_loss: attention_mask: expected {probs.shape[0]} tokens per layer "
                             f"to divide, got shape {tuple(attention_mask.shape)}")
        mask = jnp.tile(attention_mask.reshape(-1).astype(jnp.float32), layers)  # [N]
        tokens_per_expert = jnp.sum(one_hot * mask[:, None, None], axis=0) / jnp.sum(mask)
        prob_per_expert = jnp.sum(probs * mask[:, None], axis=0) / jnp.sum(mask)
    return jnp.sum(tokens_per_expert * prob_per_expert[None, :]) * num_experts


def router_z_loss(router_logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens (and layers) of ``logsumexp(logits)**2``, float32."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)))


def update_router_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: ``bias + rate * sign(mean load - load)``.

    Args:
      bias: [..., E] correction biases (``router_bias``, per layer when stacked).
      counts: [..., E] routes per expert in the last step (``aux["expert_counts"]``).
      rate: the update speed (DeepSeek-V3 used 0.001).

    Returns:
      The new biases, bias's dtype: overloaded experts go down by ``rate``, underloaded up.
    """
    if jnp.shape(counts) != jnp.shape(bias):
        raise ValueError(f"update_router_bias: counts: expected bias's shape {jnp.shape(bias)} [..., E], got "
                         f"{jnp.shape(counts)}")
    if isinstance(rate, (int, float, np.number)) and not (np.isfinite(rate) and rate >= 0):
        raise ValueError(f"update_router_bias: rate: expected a finite number >= 0, got {rate!r}")
    load = counts.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias.astype(jnp.float32) + rate * step).astype(bias.dtype)


# --- the CUDA router ------------------------------------------------------------------------------

# The CUDA decode router's limits (cuda/constants.h).
DECODE_ROUTE_MAX_TOKENS = _native.constants.DECODE_ROUTE_MAX_TOKENS
DECODE_ROUTE_MAX_EXPERTS = _native.constants.DECODE_ROUTE_MAX_EXPERTS
DECODE_ROUTE_MAX_PAIRS = _native.constants.DECODE_ROUTE_MAX_PAIRS  # T * E
DECODE_ROUTE_MAX_TOP_K = _native.constants.DECODE_ROUTE_MAX_TOP_K
DECODE_ROUTE_MAX_GROUPS = _native.constants.DECODE_ROUTE_MAX_GROUPS




def decode_route_fits(config, num_tokens: int, router_dtype) -> bool:
    """Whether ``route_decode`` runs the CUDA decode router on a GPU for these sizes: the CUDA module
    built and ``decode_route_sizes_fit``."""
    return _native.HAS_CUDA and decode_route_sizes_fit(config, num_tokens, router_dtype)


def decode_route_sizes_fit(config, num_tokens: int, router_dtype) -> bool:
    """Whether the CUDA decode router's kernel takes these sizes: bf16 tokens and router, T <= 16,
    E <= 512 and T * E <= 4096, H and E multiples of 8, k <= min(E, 32), n_group <= 32 groups of two
    experts or more."""
    bf16 = jnp.dtype(jnp.bfloat16)
    experts, groups = config.num_experts, config.n_group
    return (jnp.dtype(config.dtype) == bf16 and jnp.dtype(router_dtype) == bf16
            and 1 <= num_tokens <= DECODE_ROUTE_MAX_TOKENS and num_tokens * experts <= DECODE_ROUTE_MAX_PAIRS
            and experts <= DECODE_ROUTE_MAX_EXPERTS and experts % 8 == 0 and config.hidden_size % 8 == 0
            and config.top_k <= DECODE_ROUTE_MAX_TOP_K
            and 1 <= groups <= DECODE_ROUTE_MAX_GROUPS and experts % groups == 0
            and (groups == 1 or experts // groups >= 2) and 1 <= config.topk_group <= groups)


def route_decode(router: jax.Array, x: jax.Array, scratch: MoEScratch, bias: jax.Array | None = None):
    """``route_logits(router_logits(router, x))`` for a few tokens: ``(weights, ids, logits, scratch)``.

    Args:
      router: [H, E] the layer's router; x: [T, H] its (normalised) tokens; bias: optional [E]
        correction added to the scores for choosing only; scratch: the shared scratch (the CUDA
        kernel keeps its arrival counter in the workspace's last word).

    Returns:
      weights [T, k] float32, ids [T, k] int32 (``jax_moe.route_logits``'s), logits [T, E]
      float32, and the scratch to pass on.

    On a GPU within ``decode_route_fits`` one kernel (``jax_moe_decode_route``) computes the
    logits, scores, top-k and weights where XLA runs six to ten small kernels: the same ids as
    route_logits of the kernel's logits; logits and weights within float32 rounding of XLA's (other
    summation orders). Elsewhere, the XLA path. Differentiable in router and x: the backward is
    XLA's, of the weights as a function of the logits at the chosen ids (``chosen_weights``)
    and of the logits themselves; the ids are kept, not chosen again, so the gradient is that of
    the routing the forward took (the bias gets none, as in route_logits). Its reduction of H is a
    chain of dependent round trips (router loads, partial sums, the arrival counter), not
    bandwidth-bound: past a few tokens XLA's routing is faster (``jax_moe.tuning``).
    """
    config = scratch.config
    bias_operand = _check_route_decode("route_decode", config, router, x, bias)
    weights, ids, logits, workspace = _route_decode(config, bias is not None, router, x, bias_operand,
                                                    scratch.workspace)
    return weights, ids, logits, scratch.replace(workspace=workspace)


def route_decode_normalizing(router: jax.Array, h: jax.Array, scratch: MoEScratch, bias: jax.Array | None = None,
                             eps: float = RMS_NORM_EPSILON):
    """``route_decode(router, rms_norm(h, eps), scratch, bias)`` with the norm in the router's launch:
    ``(n, weights, ids, logits, scratch)``, n = rms_norm(h) [T, H].

    For the inference stack's decode layers, where XLA runs the norm as two small kernels of their
    own. On a GPU within ``decode_route_fits`` every block of the decode
    router (``jax_moe_decode_route_norm``) finds its tokens' scales from the whole rows and
    normalises the values it loads, and the blocks of the first expert tile write n. n is rms_norm's
    to within one bf16 rounding (its float32 sum of squares is summed in another order; the
    reciprocal square root is correctly rounded), and weights, ids and logits are bitwise
    ``route_decode`` of that n. Elsewhere rms_norm then route_decode. Inference only: differentiating
    it raises (differentiate rms_norm and route_decode instead).
    """
    config = scratch.config
    bias_operand = _check_route_decode("route_decode_normalizing", config, router, h, bias)
    n, weights, ids, logits, workspace = _route_decode_normalizing(config, bias is not None, float(eps), router, h,
                                                                   bias_operand, scratch.workspace)
    return n, weights, ids, logits, scratch.replace(workspace=workspace)


def _check_route_decode(name: str, config, router, x, bias) -> jax.Array:
    """ValueError unless router [H, E], x [T, H] and bias [E] (or None) fit config; the bias operand."""
    want = {"router": (config.hidden_size, config.num_experts), "x": (jnp.shape(x)[0], config.hidden_size),
            "bias": (config.num_experts,)}
    for arg, value in (("router", router), ("x", x), ("bias", bias)):
        if value is not None and tuple(jnp.shape(value)) != want[arg]:
            raise ValueError(f"{name}: {arg}: expected shape {want[arg]} ([H, E], [T, H], [E]), "
                             f"got {tuple(jnp.shape(value))}")
    return jnp.zeros((1,), jnp.float32) if bias is None else bias.astype(jnp.float32)


def _route_in_xla(config, has_bias: bool, router, x, bias_operand):
    """The decode router's math in XLA: ``(weights, ids, logits)`` of route_logits(router_logits(...))."""
    logits = router_logits(router, x)
    weights, ids = route_logits(logits, config, bias_operand if has_bias else None)
    return weights, ids, logits


def _route_decode_forward(config, has_bias: bool, router, x, bias_operand, workspace):
    """route_decode's four results (the workspace last) on the kernel or XLA's path."""
    def xla(router, x, bias_operand, workspace):
        return (*_route_in_xla(config, has_bias, router, x, bias_operand), workspace)

    if not decode_route_fits(config, x.shape[0], router.dtype):
        return xla(router, x, bias_operand, workspace)

    def native(router, x, bias_operand, workspace):
        return _decode_route_call(config, has_bias, router, x, bias_operand, workspace)[:4]

    return lax.platform_dependent(router, x, bias_operand, workspace, cuda=native, default=xla)


def _decode_route_call(config, has_bias: bool, router, x, bias_operand, workspace, norm_eps: float | None = None):
    """The CUDA decode router: ``(weights, ids, logits, workspace, n)``. With norm_eps, x is the
    tokens before the norm and n = their rms_norm (``jax_moe_decode_route_norm``); else n is None."""
    num_tokens, (hidden, experts) = x.shape[0], router.shape
    f32 = jnp.float32
    results = (jax.ShapeDtypeStruct((num_tokens, experts), f32), jax.ShapeDtypeStruct((num_tokens, config.top_k), f32),
               jax.ShapeDtypeStruct((num_tokens, config.top_k), jnp.int32),
               jax.ShapeDtypeStruct((_native.decode_route_slices(hidden), num_tokens, experts), f32),
               jax.ShapeDtypeStruct(workspace.shape, workspace.dtype))
    attrs = dict(has_bias=np.bool_(has_bias), sigmoid=np.bool_(config.scoring == "sigmoid"),
                 renormalize=np.bool_(config.renormalize), renormalize_epsilon=np.float32(config.renormalize_epsilon),
                 scaling=np.float32(config.routed_scaling_factor), n_group=np.int64(config.n_group),
                 topk_group=np.int64(config.topk_group))
    if norm_eps is None:
        target = _native.DECODE_ROUTE_TARGET
    else:
        target = _native.DECODE_ROUTE_NORM_TARGET
        results += (jax.ShapeDtypeStruct(x.shape, x.dtype),)
        attrs["norm_epsilon"] = np.float32(norm_eps)
    call = jax.ffi.ffi_call(target, results, input_output_aliases={3: 4}, vmap_method=_ffi.VMAP_METHOD)
    out = _ffi.fence_results(call(x, router, bias_operand, workspace, **attrs))
    logits, weights, ids, _, workspace = out[:5]
    return weights, ids, logits, workspace, (out[5] if norm_eps is not None else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _route_decode_normalizing(config, has_bias: bool, eps: float, router, h, bias_operand, workspace):
    def xla(router, h, bias_operand, workspace):
        n = rms_norm(h, eps)
        return (n, *_route_in_xla(config, has_bias, router, n, bias_operand), workspace)

    if not decode_route_fits(config, h.shape[0], router.dtype):
        return xla(router, h, bias_operand, workspace)

    def native(router, h, bias_operand, workspace):
        weights, ids, logits, workspace, n = _decode_route_call(config, has_bias, router, h, bias_operand, workspace,
                                                                norm_eps=eps)
        return n, weights, ids, logits, workspace

    return lax.platform_dependent(router, h, bias_operand, workspace, cuda=native, default=xla)


def _route_decode_normalizing_fwd(config, has_bias, eps, router, h, bias_operand, workspace):
    raise ValueError("route_decode_normalizing: not differentiable (inference only); differentiate "
                     "rms_norm then route_decode instead")


def _route_decode_normalizing_bwd(config, has_bias, eps, residuals, cotangents):
    raise AssertionError("unreachable: the forward raises")


_route_decode_normalizing.defvjp(_route_decode_normalizing_fwd, _route_decode_normalizing_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _route_decode(config, has_bias: bool, router, x, bias_operand, workspace):
    return _route_decode_forward(config, has_bias, router, x, bias_operand, workspace)


def _route_decode_fwd(config, has_bias, router, x, bias_operand, workspace):
    results = _route_decode_forward(config, has_bias, router, x, bias_operand, workspace)
    return results, (router, x, results[1])


def _route_decode_bwd(config, has_bias, residuals, cotangents):
    router, x, ids = residuals
    d_weights, _, d_logits, _ = cotangents

    def routed(router, x):
        logits = router_logits(router, x)
        return chosen_weights(scores_from_logits(logits, config), ids, config), logits

    _, vjp = jax.vjp(routed, router, x)
    d_router, d_x = vjp((d_weights, d_logits))
    return d_router, d_x, None, None


_route_decode.defvjp(_route_decode_fwd, _route_decode_bwd)
