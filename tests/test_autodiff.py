"""Gradients through permute, unpermute, moe_layer and moe_stack (issue 4, item 5).

permute/unpermute are ``custom_vjp`` FFI calls (no forward mode), so numerical checks run in
reverse mode. The layer and stack gradients are compared with the pure-JAX baseline model, whose
gradients come from JAX's own autodiff of argsort/gather/sum.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_moe import MoEConfig, init_scratch, ops, permute, reference, routing, unpermute
from jax_moe.baseline import baseline_moe_layer, baseline_moe_stack
from jax_moe import init_moe_params, moe_layer, moe_stack
from jax_moe.scratch import BUFFER_NAMES

OPS_CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=8, max_tokens=6, dtype=jnp.float32, align=2)
# Route 1 and 4 each drop one route (-1, and an id >= E).
OPS_IDS = jnp.array([[0, 1], [1, -1], [3, 2], [2, 0], [5, 3]], jnp.int32)
H, F, T_MAX = 16, 8, 8


def _ops_inputs():
    x = jax.random.normal(jax.random.key(0), (5, 8), jnp.float32)
    w = jax.random.uniform(jax.random.key(1), (5, 2), jnp.float32, 0.1, 1.0)
    scratch = permute(x, OPS_IDS, init_scratch(OPS_CONFIG))
    y = jax.random.normal(jax.random.key(2), scratch.permuted.shape, jnp.float32)
    return x, w, y, scratch


def test_permute_gradient():
    x, _, _, _ = _ops_inputs()
    scratch = init_scratch(OPS_CONFIG)
    check_grads(lambda x: permute(x, OPS_IDS, scratch).permuted, (x,), order=1, modes=["rev"], eps=1e-2)
    # Against JAX's autodiff of the pure-jnp reference permute (a scatter of gathered rows).
    cot = jax.random.normal(jax.random.key(3), scratch.permuted.shape)
    grad = jax.grad(lambda x: jnp.sum(permute(x, OPS_IDS, scratch).permuted * cot))(x)
    want = jax.grad(lambda x: jnp.sum(reference.permute(x, OPS_IDS, scratch).permuted * cot))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(grad)).min() > 0  # every token has a kept route


def test_permute_with_prefetch_is_permute_and_has_its_gradient():
    """The prefetch hint changes no value and no gradient (the weights it names get none)."""
    x, _, _, _ = _ops_inputs()
    weights = jnp.ones((OPS_CONFIG.num_local_experts, 3, 8), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(3), init_scratch(OPS_CONFIG).permuted.shape)

    def loss(x, w):
        return jnp.sum(permute(x, OPS_IDS, init_scratch(OPS_CONFIG), prefetch=w).permuted * cot)

    value, (d_x, d_w) = jax.value_and_grad(loss, argnums=(0, 1))(x, weights)
    want, want_d_x = jax.value_and_grad(lambda x: jnp.sum(permute(x, OPS_IDS, init_scratch(OPS_CONFIG)).permuted * cot))(x)
    assert float(value) == float(want)
    np.testing.assert_array_equal(d_x, want_d_x)
    assert d_w.shape == weights.shape and not np.asarray(d_w, np.float32).any()
    with pytest.raises(ValueError, match=r"permute: prefetch: expected \[El=4, \.\.\.\] weights, got shape \(3, 8\)"):
        permute(x, OPS_IDS, init_scratch(OPS_CONFIG), prefetch=jnp.ones((3, 8)))


def test_unpermute_gradient():
    _, w, y, scratch = _ops_inputs()
    check_grads(lambda y, w: unpermute(y, w, scratch), (y, w), order=1, modes=["rev"], eps=1e-2)
    cot = jax.random.normal(jax.random.key(4), (5, 8))
    grads = jax.grad(lambda y, w: jnp.sum(unpermute(y, w, scratch) * cot), argnums=(0, 1))(y, w)
    want = jax.grad(lambda y, w: jnp.sum(reference.unpermute(y, w, scratch) * cot), argnums=(0, 1))(y, w)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    dw = np.asarray(grads[1])
    assert dw[1, 1] == 0 and dw[4, 0] == 0  # dropped routes get no weight gradient


def test_permute_unpermute_gradient_in_bfloat16():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, max_tokens=6, dtype=jnp.bfloat16, align=2)
    x, w, _, _ = _ops_inputs()
    scratch = init_scratch(config)

    def roundtrip(fn_permute, fn_unpermute, x, w):
        s = fn_permute(x, OPS_IDS, scratch)
        return jnp.sum(jnp.square(fn_unpermute(s.permuted * 2, w, s).astype(jnp.float32)))

    x16 = x.astype(jnp.bfloat16)
    grads = jax.grad(lambda x, w: roundtrip(permute, unpermute, x, w), argnums=(0, 1))(x16, w)
    want = jax.grad(lambda x, w: roundtrip(reference.permute, reference.unpermute, x, w), argnums=(0, 1))(x16, w)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(np.float32(got), np.float32(expected), rtol=2e-2, atol=2e-2)


def _model(dtype, num_layers=3, num_tokens=T_MAX, seed=0, **overrides):
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=H, max_tokens=T_MAX, dtype=dtype, **overrides)
    params = init_moe_params(jax.random.key(seed), config, num_layers, F)
    x = jax.random.normal(jax.random.key(seed + 1), (num_tokens, H), jnp.float32).astype(dtype)
    return config, params, x


def _loss(y):
    return jnp.sum(jnp.square(y.astype(jnp.float32)))


def _stack_routes(params, x, config):
    """Each layer's top-k ids of ``moe_stack(params, x)``, recomputed layer by layer."""
    h, scratch, routes = x, init_scratch(config), []
    for layer in range(params["router"].shape[0]):
        layer_params = jax.tree.map(lambda a: a[layer], params)
        routes.append(routing.route(layer_params["router"], ops.rms_norm(h), config)[1])
        y, scratch = moe_layer(layer_params, ops.rms_norm(h), scratch)
        h = h + y
    return jnp.stack(routes)


@pytest.fixture
def full_f32_matmuls():
    # XLA's default on GPUs is TF32, whose rounding swamps a finite difference (seen on the
    # H200: directional derivatives 0.4-5% off, check_grads 1% off), while the CPU is exact f32.
    with jax.default_matmul_precision("highest"):
        yield


def _check_directional_derivative(loss, args, routes, eps=1e-3, tries=5):
    """``<grad loss, v>`` against a central difference along random directions v.

    Routing is piecewise constant, so a difference across a top-k switch is meaningless: a
    direction is used only when the routing of every layer is the same at all of
    ``args + t * eps * v``, t in {-2, -1, 0, 1, 2}. Returns how many directions were checked.
    """
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    loss = jax.jit(loss)
    checked = 0
    for seed in range(tries):
        keys = iter(jax.random.split(jax.random.key(100 + seed), 64))
        v = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), args)
        at = lambda t: jax.tree.map(lambda a, d: a + t * eps * d, args, v)
        if any(not np.array_equal(routes(*at(t)), routes(*args)) for t in (-2, -1, 1, 2)):
            continue
        numerical = (float(loss(*at(1.0))) - float(loss(*at(-1.0)))) / (2 * eps)
        analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(v)))
        np.testing.assert_allclose(analytic, numerical, rtol=1e-3, atol=1e-3)
        checked += 1
    return checked


@pytest.mark.parametrize("overrides", [{}, {"align": 4, "expert_map": (1, -1, 0, 2)}], ids=["plain", "ep-align"])
def test_moe_layer_numerical_gradient(overrides, full_f32_matmuls):
    config, params, x = _model(jnp.float32, num_tokens=6, **overrides)
    layer_params = jax.tree.map(lambda a: a[0], params)
    scratch = init_scratch(config)
    cot = jax.random.normal(jax.random.key(7), x.shape)
    loss = lambda p, x: jnp.sum(moe_layer(p, x, scratch)[0] * cot)
    route = jax.jit(lambda p, x: routing.route(p["router"], x, config)[1])
    routes = lambda p, x: np.asarray(route(p, x))
    assert _check_directional_derivative(loss, (layer_params, x), routes) >= 3
    # The expert weights do not move the routing: check_grads applies as is.
    experts = jax.jit(lambda gate_up, down: moe_layer({**layer_params, "gate_up": gate_up, "down": down}, x,
                                                      scratch)[0])
    check_grads(experts, (layer_params["gate_up"], layer_params["down"]), order=1, modes=["rev"], eps=1e-2)


def test_moe_stack_numerical_gradient(full_f32_matmuls):
    # seed 1: no near-tie between the k-th and (k+1)-th router logit in any layer (gap > 0.03),
    # so small steps along most directions keep every layer's routing.
    config, params, x = _model(jnp.float32, seed=1)
    scratch = init_scratch(config)
    cot = jax.random.normal(jax.random.key(7), x.shape)
    loss = lambda p, x: jnp.sum(moe_stack(p, x, scratch)[0] * cot)
    stack_routes = jax.jit(lambda p, x: _stack_routes(p, x, config))
    routes = lambda p, x: np.asarray(stack_routes(p, x))
    assert _check_directional_derivative(loss, (params, x), routes) >= 3
    # With the routing of every layer fixed by x and the router, the expert weights are smooth.
    stack = jax.jit(lambda gate_up, down: moe_stack({**params, "gate_up": gate_up, "down": down}, x, scratch)[0])
    check_grads(stack, (params["gate_up"], params["down"]), order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)


GRAD_CASES = [(jnp.float32, T_MAX, {}), (jnp.float32, 5, {"align": 4, "expert_map": (1, -1, 0, 2)}),
              (jnp.bfloat16, T_MAX, {"align": 2, "scoring": "sigmoid"})]


@pytest.mark.parametrize("dtype,num_tokens,overrides", GRAD_CASES, ids=["f32", "f32-T<Tmax-ep-align", "bf16-sigmoid"])
def test_gradients_match_the_baseline(dtype, num_tokens, overrides):
    config, params, x = _model(dtype, num_tokens=num_tokens, **overrides)
    scratch = init_scratch(config)
    layer_params = jax.tree.map(lambda a: a[0], params)
    cases = [
        (lambda p, x: _loss(moe_layer(p, x, scratch)[0]), lambda p, x: _loss(baseline_moe_layer(p, x, config)),
         layer_params),
        (lambda p, x: _loss(moe_stack(p, x, scratch)[0]), lambda p, x: _loss(baseline_moe_stack(p, x, config)),
         params),
    ]
    for ours, base, p in cases:
        got = jax.jit(jax.grad(ours, argnums=(0, 1)))(p, x)
        want = jax.jit(jax.grad(base, argnums=(0, 1)))(p, x)
        for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
            g, w = np.float32(g), np.float32(w)
            assert g.dtype == w.dtype and g.shape == w.shape
            scale = np.abs(w).max()
            assert scale > 0, path[0]
            tol = 1e-5 if dtype == jnp.float32 else 2e-2
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=str(path[0]))


def _residual_types(vjp_fn) -> list[tuple[str, tuple]]:
    """The arrays a ``jax.vjp`` closure keeps for the backward pass (its pytree leaves)."""
    return [(jnp.dtype(leaf.dtype).name, tuple(leaf.shape)) for leaf in jax.tree.leaves(vjp_fn)]


def _scratch_types(scratch, lead=()) -> dict[str, tuple[str, tuple]]:
    return {name: (jnp.dtype(b.dtype).name, lead + tuple(b.shape)) for name, b in zip(BUFFER_NAMES, scratch.buffers())}


def test_custom_vjp_residuals_hold_no_scratch_buffer():
    x, w, y, scratch = _ops_inputs()
    fresh = init_scratch(OPS_CONFIG)
    buffers = _scratch_types(fresh)
    _, vjp_permute = jax.vjp(lambda x: permute(x, OPS_IDS, fresh).permuted, x)
    _, vjp_unpermute = jax.vjp(lambda y, w: unpermute(y, w, scratch), y, w)
    # permute keeps only this call's [T, k] destinations; unpermute y (the expert outputs it was
    # given), w and the [T, k] destinations. Neither keeps a scratch buffer (T = 5 < T_max = 6, so
    # the [T, k] slice is not dest_index itself; src_index is recomputed by the backward).
    assert _residual_types(vjp_permute) == [("int32", (5, 2))]
    assert sorted(_residual_types(vjp_unpermute)) == sorted(
        [("float32", y.shape), ("float32", w.shape), ("int32", (5, 2))])
    scratch_residuals = set(_residual_types(vjp_permute)) & set(buffers.values())
    assert not scratch_residuals


def test_stack_residuals_hold_no_scratch_buffer():
    num_layers, num_tokens = 3, 5
    config, params, x = _model(jnp.float32, num_layers=num_layers, num_tokens=num_tokens)
    scratch = init_scratch(config)
    _, vjp_fn = jax.vjp(lambda p, x: moe_stack(p, x, scratch)[0], params, x)
    residuals = _residual_types(vjp_fn)
    stacked = _scratch_types(scratch, lead=(num_layers,))
    # Never stacked per layer: the index buffers, offsets and workspace. group_sizes IS stacked,
    # by ragged_dot (it needs the groups for its own transpose), as the baseline stacks its own.
    for name in ("src_index", "dest_index", "expert_offsets", "workspace"):
        assert stacked[name] not in residuals, name
        assert _scratch_types(scratch)[name] not in residuals, name
    # No unstacked [R_cap, H] buffer either (a zero tangent of the scratch used to be kept here;
    # moe_layer stops the scratch's gradient so it has none).
    assert _scratch_types(scratch)["permuted"] not in residuals
    # The rows ragged_dot keeps are the live-bounded prefix [T*k, H], not the [R_cap, H] buffer.
    assert ("float32", (num_layers, num_tokens * 2, H)) in residuals


def test_stack_residual_bytes_no_more_than_the_baseline():
    config, params, x = _model(jnp.float32, num_layers=4)  # T = T_max, align 1: R_cap = T*k
    scratch = init_scratch(config)
    _, ours = jax.vjp(lambda p, x: moe_stack(p, x, scratch)[0], params, x)
    _, base = jax.vjp(lambda p, x: baseline_moe_stack(p, x, config), params, x)
    ours_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(ours))
    base_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(base))
    assert ours_bytes <= base_bytes, (ours_bytes, base_bytes)
