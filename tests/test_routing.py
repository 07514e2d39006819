"""Routing variants, shared experts and the routers' training terms (issue 15), on CPU.

The choice of experts is checked against an independent NumPy oracle (stable sorts, explicit
loops), including ties, groups and the correction bias; the layer with shared experts against the
pure-JAX baseline, values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe import MoEConfig, init_scratch, routing
from jax_moe.baseline import baseline_moe_layer, baseline_moe_stack
from jax_moe.layers import init_moe_params, moe_layer, moe_stack

F32 = jnp.float32


def _oracle_route(logits, config, bias=None):
    """NumPy float64: the contract of routing.route_logits, by explicit sorting and loops."""
    logits = np.asarray(logits, np.float64)
    if config.scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
    num_tokens, num_experts = scores.shape
    ids = np.zeros((num_tokens, config.top_k), np.int64)
    for t in range(num_tokens):
        eligible = np.ones(num_experts, bool)
        if config.n_group > 1:
            size = num_experts // config.n_group
            group_score = [np.sort(choice[t, g * size:(g + 1) * size])[::-1][:2].sum() for g in range(config.n_group)]
            best = np.argsort(-np.asarray(group_score), kind="stable")[:config.topk_group]
            eligible = np.isin(np.arange(num_experts) // size, best)
        order = [e for e in np.argsort(-choice[t], kind="stable") if eligible[e]]  # ties: lower index first
        ids[t] = order[:config.top_k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if config.renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + config.renormalize_epsilon)
    return weights * config.routed_scaling_factor, ids


DEEPSEEK_LIKE = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, renormalize_epsilon=1e-20)
ROUTINGS = {
    "softmax-renormalized": dict(),
    "softmax-raw (Qwen2-MoE)": dict(renormalize=False),
    "sigmoid": dict(scoring="sigmoid"),
    "deepseek-v3": DEEPSEEK_LIKE,
    "deepseek-v3-one-group-left": dict(DEEPSEEK_LIKE, topk_group=1),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_numpy_oracle(name, with_bias):
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=8, max_tokens=64, dtype=F32, **ROUTINGS[name])
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 16)).astype(np.float32) * 2
    bias = rng.standard_normal(16).astype(np.float32) * 0.3 if with_bias else None
    weights, ids = jax.jit(lambda l, b: routing.route_logits(l, config, b))(logits, bias)
    want_w, want_ids = _oracle_route(logits, config, bias)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=1e-7)


def test_route_ties_go_to_the_lower_index():
    config = MoEConfig(num_experts=8, top_k=3, hidden_size=4, max_tokens=4, dtype=F32, scoring="sigmoid",
                       n_group=4, topk_group=2)
    logits = np.zeros((2, 8), np.float32)  # every score equal: groups 0 and 1, experts 0, 1, 2
    logits[1, 5] = logits[1, 4] = 1.0      # group 2 best; then a tie between groups 0, 1, 3: group 0
    _, ids = routing.route_logits(logits, config)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2], [4, 5, 0]])
    np.testing.assert_array_equal(np.asarray(ids), _oracle_route(logits, config)[1])


def test_bias_chooses_but_does_not_weigh():
    config = MoEConfig(num_experts=4, top_k=1, hidden_size=4, max_tokens=4, dtype=F32, scoring="sigmoid",
                       renormalize=False)
    logits = np.array([[2.0, 0.0, 0.0, 0.0]], np.float32)
    weights, ids = routing.route_logits(logits, config, jnp.array([0.0, 0.0, 1.0, 0.0]))
    assert int(ids[0, 0]) == 2  # 0.5 + 1.0 beats sigmoid(2) = 0.88
    np.testing.assert_allclose(float(weights[0, 0]), 0.5)  # the unbiased score


def test_routing_config_is_validated():
    for kwargs, message in [(dict(n_group=3), "n_group"), (dict(n_group=8), "n_group"),
                            (dict(n_group=4, topk_group=5), "topk_group"), (dict(topk_group=2), "topk_group"),
                            (dict(routed_scaling_factor=-1.0), "routed_scaling_factor"),
                            (dict(renormalize_epsilon=float("nan")), "renormalize_epsilon")]:
        with pytest.raises(ValueError, match=f"MoEConfig.{message}"):
            MoEConfig(num_experts=8, top_k=2, hidden_size=4, max_tokens=4, **kwargs)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=4, max_tokens=4)
    with pytest.raises(ValueError, match=r"route: router_bias: expected shape \(4,\)"):
        routing.route_logits(jnp.zeros((3, 4)), config, jnp.zeros(5))


def _model(config, layers=2, shared=True, gate=True, bias=True):
    params = init_moe_params(jax.random.key(0), config, layers, 8, shared_ffn_size=12 if shared else None,
                             shared_gate=gate, router_bias=bias)
    if bias:
        params["router_bias"] = jax.random.normal(jax.random.key(1), params["router_bias"].shape) * 0.1
    return params


@pytest.mark.parametrize("routing_name", ["softmax-raw (Qwen2-MoE)", "deepseek-v3"])
@pytest.mark.parametrize("gate", [False, True])
def test_layer_with_shared_experts_matches_baseline(routing_name, gate):
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=16, max_tokens=12, dtype=F32, **ROUTINGS[routing_name])
    params = jax.tree.map(lambda a: a[0], _model(config, gate=gate))
    x = jax.random.normal(jax.random.key(2), (12, 16))
    y, _ = jax.jit(moe_layer)(params, x, init_scratch(config))
    want = baseline_moe_layer(params, x, config)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    without = jax.tree.map(lambda a: a[0], {k: v for k, v in _model(config, shared=False, gate=False).items()})
    routed_only, _ = jax.jit(moe_layer)(without, x, init_scratch(config))
    assert np.abs(np.asarray(y) - np.asarray(routed_only)).max() > 1e-3  # the shared expert adds something


def test_stack_gradients_with_new_routing_and_shared_experts_match_baseline():
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=16, max_tokens=12, dtype=F32, align=2, **DEEPSEEK_LIKE)
    params = _model(config)
    x = jax.random.normal(jax.random.key(3), (12, 16))
    loss = lambda p, x, s: jnp.mean(moe_stack(p, x, s)[0] ** 2)  # noqa: E731
    base = lambda p, x: jnp.mean(baseline_moe_stack(p, x, config) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x, init_scratch(config))
    want = jax.jit(jax.grad(base, argnums=(0, 1)))(params, x)
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(got)]
    for path, g, w in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert not np.asarray(got[0]["router_bias"]).any()  # the bias only chooses: no gradient
    assert np.abs(np.asarray(got[0]["shared_gate"])).max() > 0


def test_leading_batch_axes_and_a_wrong_hidden_size():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=16, max_tokens=12, dtype=F32)
    params = _model(config, shared=True, gate=True, bias=False)
    x = jax.random.normal(jax.random.key(4), (3, 4, 16))
    y, _ = jax.jit(moe_stack)(params, x, init_scratch(config))
    flat, _ = jax.jit(moe_stack)(params, x.reshape(12, 16), init_scratch(config))
    assert y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y).reshape(12, 16), np.asarray(flat))
    with pytest.raises(ValueError, match=r"moe_stack: x: expected shape \[\.\.\., 16\].*got \(3, 4, 8\)"):
        moe_stack(params, jnp.zeros((3, 4, 8)), init_scratch(config))
    with pytest.raises(ValueError, match=r"moe_layer: x: expected shape \[\.\.\., 16\]"):
        moe_layer(jax.tree.map(lambda a: a[0], params), jnp.zeros((12, 15)), init_scratch(config))
    with pytest.raises(ValueError, match="moe_layer: mesh/axis_name: expert parallelism is jax_moe.moe_layer_ep"):
        moe_layer(jax.tree.map(lambda a: a[0], params), x, init_scratch(config), mesh=object(), axis_name="x")


def test_params_are_validated():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=16, max_tokens=12, dtype=F32)
    params = jax.tree.map(lambda a: a[0], _model(config))
    x = jnp.zeros((4, 16))
    for change, message in [({"router_bias": jnp.zeros(7)}, r"params\['router_bias'\]: expected shape \(8,\)"),
                            ({"shared_gate": jnp.zeros((16, 2))}, r"params\['shared_gate'\]: expected shape \(16, 1\)"),
                            ({"extra": jnp.zeros(1)}, "unknown \\['extra'\\]")]:
        with pytest.raises(ValueError, match=message):
            moe_layer({**params, **change}, x, init_scratch(config))
    no_down = {k: v for k, v in params.items() if k != "shared_down"}
    with pytest.raises(ValueError, match="shared_gate_up and shared_down together"):
        moe_layer(no_down, x, init_scratch(config))


def _numpy_load_balancing(logits, top_k, mask=None):
    logits = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weight = np.ones(len(probs)) if mask is None else np.tile(np.asarray(mask, np.float64).reshape(-1),
                                                               len(probs) // np.size(mask))
    counts = np.zeros(probs.shape[1])
    for row, w in zip(chosen, weight):
        counts[row] += w
    return probs.shape[1] * np.sum(counts / weight.sum() * (probs * weight[:, None]).sum(0) / weight.sum())


def test_aux_outputs_and_losses():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=16, max_tokens=12, dtype=F32, scoring="sigmoid",
                       n_group=2, topk_group=1)
    params = _model(config, layers=3)
    x = jax.random.normal(jax.random.key(5), (12, 16))
    out, _, aux = jax.jit(lambda p, x, s: moe_stack(p, x, s, with_aux=True))(params, x, init_scratch(config))
    plain, _ = jax.jit(moe_stack)(params, x, init_scratch(config))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    assert aux["router_logits"].shape == (3, 12, 8) and aux["expert_counts"].shape == (3, 8)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]).sum(-1), [24, 24, 24])
    # Layer 0's counts are those of its routing of rms_norm(x).
    _, ids = routing.route(params["router"][0], jax_moe.layers.rms_norm(x), config, params["router_bias"][0])
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"][0]), np.bincount(np.asarray(ids).ravel(), minlength=8))
    logits = np.asarray(aux["router_logits"])
    np.testing.assert_allclose(float(routing.load_balancing_loss(logits, 2)), _numpy_load_balancing(logits, 2),
                               rtol=1e-5)
    mask = (np.arange(12) % 5 != 0).astype(np.float32)
    np.testing.assert_allclose(float(routing.load_balancing_loss(logits, 2, mask)),
                               _numpy_load_balancing(logits, 2, mask), rtol=1e-5)
    z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(routing.router_z_loss(logits)), np.mean(z ** 2), rtol=1e-5)
    counts = np.array([[5, 1, 3, 3]])
    np.testing.assert_allclose(np.asarray(routing.update_router_bias(jnp.zeros((1, 4)), counts, 0.01)),
                               [[-0.01, 0.01, 0.0, 0.0]])
