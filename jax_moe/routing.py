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

from jax_moe import _native
from jax_moe.config import MoEConfig


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


# The CUDA choice kernel's limits (cuda/route_kernels.h, ChooseExpertsFits).
CHOOSE_MAX_EXPERTS, CHOOSE_MAX_TOP_K, CHOOSE_MAX_GROUPS = 1024, 32, 32


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
