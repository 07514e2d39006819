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
from jax_moe import init_moe_params, moe_layer, moe_stack

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
    no_gate_up = {k: v for k, v in params.items() if k not in ("shared_gate_up", "shared_gate")}
    with pytest.raises(ValueError, match="shared_gate_up and shared_down together"):  # not a shape of shared_down
        moe_layer(no_gate_up, x, init_scratch(config))
    # An odd gate/up width is named on the gate/up leaf, not on the router or the down projection.
    for name, width, axis in (("gate_up", 15, "2F"), ("shared_gate_up", 23, "2Fs")):
        odd = {**params, name: params[name][..., :width]}
        with pytest.raises(ValueError, match=rf"params\['{name}'\]: expected an even {axis} >= 2 .* got {axis} = {width}"):
            moe_layer(odd, x, init_scratch(config))


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
    _, ids = routing.route(params["router"][0], jax_moe.ops.rms_norm(x), config, params["router_bias"][0])
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


DECODE_ROUTE_CASES = {  # (config kwargs, tokens): the models' router shapes at decode, and edges
    "qwen3-like-T1": (dict(num_experts=128, top_k=8, hidden_size=2048), 1),  # top k by rank: its longest row
    "qwen3-like-T16": (dict(num_experts=128, top_k=8, hidden_size=2048), 16),
    "mixtral-like-T3": (dict(num_experts=8, top_k=2, hidden_size=4096), 3),
    "deepseek-like-T2": (dict(num_experts=256, top_k=8, hidden_size=7168), 2),
    "deepseek-like-T1": (dict(num_experts=256, top_k=8, hidden_size=7168), 1),  # the shortest row of the rounds
    "qwen35-like-T1": (dict(num_experts=512, top_k=10, hidden_size=4096), 1),  # top k in rounds of warp reductions
    "qwen35-like-T8": (dict(num_experts=512, top_k=10, hidden_size=4096), 8),
    "small-H-k-equals-E": (dict(num_experts=16, top_k=16, hidden_size=136), 5),
    # Experts 2i and 2i + 1 share a router column: their logits are equal bitwise, every choice
    # is a tie, broken to the lower expert as lax.top_k does.
    "tied-pairs-T4": (dict(num_experts=64, top_k=7, hidden_size=512), 4),
}


def _decode_route_inputs(case, with_bias):
    """(router [H, E] bf16, x [T, H] bf16, bias [E] float32 or None) of a DECODE_ROUTE_CASES case."""
    kwargs, num_tokens = DECODE_ROUTE_CASES[case]
    rng = np.random.default_rng(num_tokens * 7 + kwargs["num_experts"])
    hidden, experts = kwargs["hidden_size"], kwargs["num_experts"]
    tied = case.startswith("tied")
    router = rng.standard_normal((hidden, experts)) / np.sqrt(hidden)
    if tied:
        router = np.repeat(router[:, ::2], 2, axis=1)
    router = jnp.asarray(router, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    bias = rng.standard_normal(experts) / 8
    if tied:
        bias = np.repeat(bias[::2], 2)
    bias = jnp.asarray(bias, F32) if with_bias else None
    return router, x, bias


def _skip_unless_groups_hold_k(kwargs, routing_kwargs):
    """Skips a DECODE_ROUTE_CASES case whose experts the routing's groups cannot split or hold k of."""
    experts, groups = kwargs["num_experts"], routing_kwargs.get("n_group", 1)
    if experts % groups or kwargs["top_k"] > experts // max(1, groups) * routing_kwargs.get("topk_group", 1):
        pytest.skip("groups must divide the experts and hold k of them")


def _decode_route(case, routing_kwargs, with_bias, device):
    kwargs, num_tokens = DECODE_ROUTE_CASES[case]
    _skip_unless_groups_hold_k(kwargs, routing_kwargs)
    config = MoEConfig(max_tokens=num_tokens, dtype=jnp.bfloat16, **kwargs, **routing_kwargs)
    router, x, bias = _decode_route_inputs(case, with_bias)
    with jax.default_device(device):
        step = jax.jit(lambda r, x, s: jax_moe.routing.route_decode(r, x, s, bias), donate_argnums=2)
        scratch = init_scratch(config)
        results = []
        for _ in range(3):  # the kernel's arrival counter must be back at zero after each call
            weights, ids, logits, scratch = step(router, x, scratch)
            results.append((np.asarray(weights), np.asarray(ids), np.asarray(logits)))
        want_logits = routing.router_logits(router, x)
    return config, bias, results, np.asarray(want_logits), scratch


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(DECODE_ROUTE_CASES))
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gpu_decode_route_matches_route_logits(case, name, with_bias):
    """The CUDA decode router: logits within float32 rounding of XLA's product, the ids that
    route_logits (and the NumPy oracle) choose from the kernel's logits, the same weights within
    float32 rounding; three calls on one scratch give the same results bitwise (deterministic,
    counter reset), and the workspace's counter word is zero afterwards."""
    config, bias, results, want_logits, scratch = _decode_route(case, ROUTINGS[name], with_bias,
                                                                jax.devices("gpu")[0])
    assert jax_moe.routing.decode_route_fits(config, want_logits.shape[0], jnp.bfloat16)
    weights, ids, logits = results[0]
    for later in results[1:]:
        for a, b in zip(results[0], later):
            np.testing.assert_array_equal(a, b)
    assert int(scratch.workspace[-1]) == 0
    # Both sums of H products in float32, in different orders: each within a few float32 ulps of
    # the sum of the products' magnitudes (float64 here) of the exact value.
    router64, x64 = (np.asarray(a, np.float64) for a in _decode_route_inputs(case, with_bias)[:2])
    exact, magnitude = x64 @ router64, np.abs(x64) @ np.abs(router64)
    np.testing.assert_array_less(np.abs(logits - exact), 3e-6 * magnitude + 1e-30)
    np.testing.assert_array_less(np.abs(want_logits - exact), 3e-6 * magnitude + 1e-30)
    if case.startswith("tied"):  # the ties this case is for do happen
        np.testing.assert_array_equal(logits[:, ::2], logits[:, 1::2])
    want_weights, want_ids = routing.route_logits(jnp.asarray(logits), config, bias)
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    np.testing.assert_allclose(weights, np.asarray(want_weights), rtol=4e-6, atol=1e-7)
    oracle_weights, oracle_ids = _oracle_route(logits, config, bias)
    np.testing.assert_array_equal(ids, oracle_ids)
    np.testing.assert_allclose(weights, oracle_weights, rtol=1e-5, atol=1e-7)


def test_route_decode_elsewhere_is_route_logits():
    """On a CPU the XLA branch is taken, with the CUDA module built (CI builds it: the platform
    branch is chosen when lowering) or without it: the results are route_logits(router_logits(...))
    exactly, the scratch passes through."""
    for _ in range(1):
        config = MoEConfig(num_experts=16, top_k=4, hidden_size=64, max_tokens=3, dtype=jnp.bfloat16, **DEEPSEEK_LIKE)
        rng = np.random.default_rng(3)
        router = jnp.asarray(rng.standard_normal((64, 16)) / 8, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
        bias = jnp.asarray(rng.standard_normal(16) / 8, F32)
        with jax.default_device(jax.devices("cpu")[0]):
            weights, ids, logits, scratch = jax.jit(jax_moe.routing.route_decode)(router, x, init_scratch(config), bias)
            want_logits = routing.router_logits(router, x)
            want_weights, want_ids = routing.route_logits(want_logits, config, bias)
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_weights))
        assert scratch.workspace.shape == init_scratch(config).workspace.shape


def _bf16_ulps(got, want):
    """|got - want| in units of want's bf16 spacing, elementwise (bf16 arrays)."""
    want32 = np.asarray(want, F32)
    spacing = np.spacing(np.abs(want32).astype(np.float32)) * 2.0 ** 16  # float32 spacing times 2^16: bf16's
    return np.abs(np.asarray(got, F32) - want32) / np.maximum(spacing, np.finfo(np.float32).tiny)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3-like-T1", "qwen3-like-T16", "mixtral-like-T3", "deepseek-like-T2",
                                  "qwen35-like-T1", "small-H-k-equals-E"])
@pytest.mark.parametrize("name", ["softmax-renormalized", "deepseek-v3"])
def test_gpu_route_decode_normalizing_is_route_decode_of_its_norm(case, name):
    """The decode router that normalises its tokens (the inference stack's decode layers): n within
    one bf16 rounding of rms_norm (its sum of squares in another order), almost always equal; the
    weights, ids and logits bitwise route_decode's of that n (each block rounds its loads as n is
    rounded); deterministic over three calls on one scratch, the counter back at zero."""
    kwargs, num_tokens = DECODE_ROUTE_CASES[case]
    routing_kwargs = ROUTINGS[name]
    _skip_unless_groups_hold_k(kwargs, routing_kwargs)
    config = MoEConfig(max_tokens=num_tokens, dtype=jnp.bfloat16, **kwargs, **routing_kwargs)
    router, x, bias = _decode_route_inputs(case, True)
    h = (x.astype(F32) * 3.0 + 0.5).astype(jnp.bfloat16)  # not already normalised
    step = jax.jit(lambda r, h, s: jax_moe.routing.route_decode_normalizing(r, h, s, bias), donate_argnums=2)
    assert "jax_moe_decode_route_norm" in step.lower(router, h, init_scratch(config)).compile().as_text()
    scratch = init_scratch(config)
    results = []
    for _ in range(3):
        *outs, scratch = step(router, h, scratch)
        results.append([np.asarray(o) for o in outs])
    for later in results[1:]:
        for a, b in zip(results[0], later):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert int(scratch.workspace[-1]) == 0
    n, weights, ids, logits = results[0]
    want_n = np.asarray(jax.jit(jax_moe.ops.rms_norm)(h))
    ulps = _bf16_ulps(n, want_n)
    assert ulps.max() <= 1.0, ulps.max()
    assert (ulps == 0).mean() >= 0.99, (ulps == 0).mean()
    want_weights, want_ids, want_logits, _ = jax.jit(lambda r, n, s: jax_moe.routing.route_decode(r, n, s, bias))(
        router, jnp.asarray(n), init_scratch(config))
    np.testing.assert_array_equal(logits, np.asarray(want_logits))
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    np.testing.assert_array_equal(weights, np.asarray(want_weights))


def test_route_decode_normalizing_elsewhere_is_rms_norm_then_route_decode():
    """Off the GPU (the XLA branch, with the CUDA module built or not): n = rms_norm(h) and
    route_decode of it, bitwise; bad operands raise ValueError naming them; differentiating raises
    (inference only)."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=64, max_tokens=3, dtype=jnp.bfloat16, **DEEPSEEK_LIKE)
    rng = np.random.default_rng(5)
    router = jnp.asarray(rng.standard_normal((64, 16)) / 8, jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((3, 64)) * 4, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(16) / 8, F32)
    with jax.default_device(jax.devices("cpu")[0]):
        n, weights, ids, logits, scratch = jax.jit(jax_moe.routing.route_decode_normalizing)(
            router, h, init_scratch(config), bias)
        def unfused(router, h, scratch, bias):
            n = jax_moe.ops.rms_norm(h)
            return (n, *jax_moe.routing.route_decode(router, n, scratch, bias)[:3])

        want_n, want_weights, want_ids, want_logits = jax.jit(unfused)(router, h, init_scratch(config), bias)
        for got, want in ((n, want_n), (weights, want_weights), (ids, want_ids), (logits, want_logits)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert scratch.workspace.shape == init_scratch(config).workspace.shape
        with pytest.raises(ValueError, match=r"route_decode_normalizing: x: expected shape \(3, 64\)"):
            jax_moe.routing.route_decode_normalizing(router, h[:, :32], init_scratch(config), bias)
        with pytest.raises(ValueError, match="not differentiable"):
            jax.grad(lambda h: jax_moe.routing.route_decode_normalizing(router, h, init_scratch(config))[1].sum())(
                h.astype(F32).astype(jnp.bfloat16))


@pytest.mark.gpu
def test_gpu_decode_stack_normalizes_in_the_router_like_xla():
    """The inference stack at decode runs the norm in the router's launch; against the same stack with
    XLA's norm (a plan with ``norm_in_router`` off) the output is within bf16 rounding (n differs by
    at most one bf16 rounding, rarely), and that program has the plain router."""
    num_tokens = 2
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=256, max_tokens=num_tokens, dtype=jnp.bfloat16,
                       **ROUTINGS["deepseek-v3"])
    params = init_moe_params(jax.random.key(0), config, 3, 128, router_bias=True, shared_ffn_size=128)
    x = (jax.random.normal(jax.random.key(1), (num_tokens, 256)) * 2).astype(jnp.bfloat16)

    def run(**policy):
        # One compile: the output and the program's text from the same executable.
        layer_plan = jax_moe.plan_layer(config, num_tokens, params, **policy)
        step = jax.jit(lambda p, x, s: moe_stack(p, x, s, plan=layer_plan)[0]).lower(
            params, x, init_scratch(config)).compile()
        return np.asarray(step(params, x, init_scratch(config)), F32), step.as_text()

    got, program = run()
    assert "jax_moe_decode_route_norm" in program
    want, plain = run(router_normalizes=False)
    assert "jax_moe_decode_route_norm" not in plain and "jax_moe_decode_route" in plain
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_decode_gradient_is_route_logits_gradient(name):
    """route_decode's backward (XLA's, of the weights at the kept ids and of the logits) gives the
    gradient that differentiating router_logits + route_logits gives, in router and x; the bias
    gets none. On the CPU (the XLA branch, with the CUDA module built or not)."""
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=64, max_tokens=3, dtype=jnp.bfloat16, **ROUTINGS[name])
    rng = np.random.default_rng(5)
    router = jnp.asarray(rng.standard_normal((64, 16)) / 8, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(16) / 8, F32)
    d_weights = jnp.asarray(rng.standard_normal((3, 4)), F32)
    d_logits = jnp.asarray(rng.standard_normal((3, 16)), F32)

    def via_decode(router, x, bias):
        weights, _, logits, _ = jax_moe.routing.route_decode(router, x, init_scratch(config), bias)
        return jnp.sum(weights * d_weights) + jnp.sum(logits * d_logits)

    def via_xla(router, x, bias):
        logits = routing.router_logits(router, x)
        weights, _ = routing.route_logits(logits, config, bias)
        return jnp.sum(weights * d_weights) + jnp.sum(logits * d_logits)

    want = jax.jit(jax.grad(via_xla, argnums=(0, 1, 2)))(router, x, bias)
    for has_cuda in (jax_moe._native.HAS_CUDA,):
        with jax.default_device(jax.devices("cpu")[0]):
            got = jax.jit(jax.grad(via_decode, argnums=(0, 1, 2)))(router, x, bias)
        assert jax_moe.routing.decode_route_fits(config, 3, router.dtype) == has_cuda  # the platform branch
        for g, w in zip(got, want):  # the same float32 math, each gradient rounded to its input's dtype
            np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
        assert np.abs(np.asarray(got[0], F32)).sum() > 0 and not np.asarray(got[2]).any()


def test_decode_route_fits_its_limits():
    fits = jax_moe.routing.decode_route_sizes_fit
    qwen3 = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, max_tokens=64, dtype=jnp.bfloat16)
    assert fits(qwen3, 1, jnp.bfloat16) and fits(qwen3, 16, jnp.bfloat16)
    assert not fits(qwen3, 17, jnp.bfloat16)  # more tokens than the kernel routes
    assert not fits(qwen3, 1, jnp.float32)  # a float32 router goes to XLA
    qwen35 = MoEConfig(num_experts=512, top_k=10, hidden_size=4096, max_tokens=64, dtype=jnp.bfloat16)
    assert fits(qwen35, 8, jnp.bfloat16) and not fits(qwen35, 9, jnp.bfloat16)  # T * E <= 4096
    odd = MoEConfig(num_experts=60, top_k=4, hidden_size=2048, max_tokens=4, dtype=jnp.bfloat16)
    assert not fits(odd, 1, jnp.bfloat16)  # E not a multiple of 8 (Qwen1.5-MoE's 60)
    many = MoEConfig(num_experts=1024, top_k=8, hidden_size=2048, max_tokens=4, dtype=jnp.bfloat16)
    assert not fits(many, 1, jnp.bfloat16)  # more experts than the kernel's 512
    # The kernel runs only where the CUDA module is built.
    assert jax_moe.routing.decode_route_fits(qwen3, 1, jnp.bfloat16) == jax_moe._native.HAS_CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("routing_name", ["softmax-renormalized", "deepseek-v3"])
def test_gpu_decode_stack_uses_the_decode_router_and_training_does_not(routing_name):
    num_tokens = jax_moe.tuning.DEFAULT_TUNING.router_kernel_max_tokens
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=256, max_tokens=num_tokens, dtype=jnp.bfloat16,
                       **ROUTINGS[routing_name])
    params = init_moe_params(jax.random.key(0), config, 2, 128, router_bias=routing_name != "softmax-renormalized",
                             shared_ffn_size=128)
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(jnp.bfloat16)
    step = jax.jit(lambda p, x, s: moe_stack(p, x, s, with_aux=True))
    assert "jax_moe_decode_route" in step.lower(params, x, init_scratch(config)).compile().as_text()
    got, _, aux = step(params, x, init_scratch(config))
    want = baseline_moe_stack(params, x, config)
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), rtol=3e-2, atol=3e-2)
    assert aux["router_logits"].shape == (2, num_tokens, 64)
    assert int(aux["expert_counts"].sum()) == 2 * num_tokens * 6
    grad = jax.jit(jax.grad(lambda p, x, s: jnp.sum(moe_stack(p, x, s)[0].astype(F32))))
    assert "jax_moe_decode_route" not in grad.lower(params, x, init_scratch(config)).compile().as_text()


@pytest.mark.gpu
def test_gpu_decode_stack_prefetches_gate_up_without_changing_a_bit():
    """An inference step on the decode kernel permutes with the gate/up prefetch (ops.permute's
    hint); with a plan without it the step runs the plain permute and gives the same bits; the
    training step never prefetches."""
    num_tokens = jax_moe.tuning.DEFAULT_TUNING.router_kernel_max_tokens
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=256, max_tokens=num_tokens, dtype=jnp.bfloat16)
    params = init_moe_params(jax.random.key(0), config, 2, 128, shared_ffn_size=128)
    x = jax.random.normal(jax.random.key(1), (num_tokens, 256)).astype(jnp.bfloat16)

    def step_and_program(**policy):
        layer_plan = jax_moe.plan_layer(config, num_tokens, params, **policy)
        step = jax.jit(lambda p, x, s: moe_stack(p, x, s, plan=layer_plan)[0])
        compiled = step.lower(params, x, init_scratch(config)).compile()
        return np.asarray(step(params, x, init_scratch(config))), compiled

    got, program = step_and_program()
    assert "jax_moe_permute_prefetch" in program.as_text()
    want, plain_program = step_and_program(prefetch=False)
    assert "jax_moe_permute_prefetch" not in plain_program.as_text()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # The layer's gate/up slice feeds the permute as it feeds the GEMM, never as a copy (a layer's
    # gate/up is 8 MB here).
    temp = [p.memory_analysis().temp_size_in_bytes for p in (program, plain_program)]
    assert temp[0] <= temp[1] + (1 << 20), temp
    grad = jax.jit(jax.grad(lambda p, x, s: jnp.sum(moe_stack(p, x, s)[0].astype(F32))))
    assert "jax_moe_permute_prefetch" not in grad.lower(params, x, init_scratch(config)).compile().as_text()
    layer = jax.tree.map(lambda a: a[0], params)  # moe_layer takes the hint too
    layer_step = jax.jit(lambda p, x, s: moe_layer(p, x, s)[0])
    assert "jax_moe_permute_prefetch" in layer_step.lower(layer, x, init_scratch(config)).compile().as_text()


# (E, k, n_group, topk_group): Mixtral, Qwen3-30B, DeepSeek-V3, Qwen3.5-397B, an E that is not a
# multiple of 32, the kernel's largest E and k, and a group limit leaving exactly k eligible experts.
CHOICE_CASES = {"mixtral": (8, 2, 1, 1), "qwen3": (128, 8, 1, 1), "deepseek": (256, 8, 8, 4),
                "qwen35": (512, 10, 1, 1), "odd": (60, 4, 3, 2), "widest": (1024, 32, 32, 7),
                "k_eligible": (64, 8, 8, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CHOICE_CASES))
@pytest.mark.parametrize("num_tokens", [1, 13, 4096])
def test_gpu_choose_experts_is_lax_top_k(case, num_tokens):
    """The choice kernel's ids equal lax.top_k's (XLA's sorts on the same GPU) bit for bit, on
    continuous choices and on choices of few distinct values (ties everywhere), and without groups
    also on -0 beside +0 and NaN (lax.top_k's total order: +0 before -0, NaN first); a routed
    program at prefill size runs the kernel, not a sort."""
    num_experts, top_k, n_group, topk_group = CHOICE_CASES[case]
    config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=16, max_tokens=num_tokens,
                       n_group=n_group, topk_group=topk_group, scoring="sigmoid" if n_group > 1 else "softmax")
    key = jax.random.key(num_experts + num_tokens)
    smooth = jax.random.uniform(key, (num_tokens, num_experts), F32)
    ties = jnp.round(smooth * 4) / 4  # five values: many equal choices and group scores
    choices = [smooth, ties]
    if n_group == 1:  # (the group limit's scores compare as floats: -0 ties +0 there)
        zeros = jnp.where(smooth < 0.5, jnp.where(smooth < 0.25, -0.0, 0.0), ties - 1.0)  # +-0 the best
        choices.append(zeros.at[:, 3::11].set(jnp.nan))
    for choice in choices:
        got = jax.jit(lambda c: routing.choose_experts(c, config))(choice)
        want = jax.jit(lambda c: routing.choose_experts_xla(c, config))(choice)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.dtype == jnp.int32 and got.shape == (num_tokens, top_k)
    hlo = jax.jit(lambda c: routing.choose_experts(c, config)).lower(smooth).compile().as_text()
    assert 'custom_call_target="jax_moe_choose_experts"' in hlo and " sort(" not in hlo


def test_choose_experts_off_the_gpu_is_lax_top_k():
    """Off a GPU (and where the kernel does not fit) the choice is choose_experts_xla: lax.top_k."""
    config = MoEConfig(num_experts=64, top_k=6, hidden_size=16, max_tokens=9, n_group=8, topk_group=2,
                       scoring="sigmoid")
    choice = jnp.round(jax.random.uniform(jax.random.key(3), (9, 64), F32) * 3) / 3
    got = routing.choose_experts(choice, config)
    want = routing.choose_experts_xla(choice, config)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # lax.top_k's order: best first, ties to the lower index, only the two best groups' experts.
    groups = np.asarray(got) // 8
    assert all(len(set(row)) <= 2 for row in groups)
