"""vmap over a leading batch axis of permute/unpermute (issue 4, item 6).

The FFI calls use ``vmap_method="sequential"``: a batch becomes a loop of single calls, each on
its own slice of a batched scratch (every element is its own routing problem, with its own
groups and offsets). These tests check it equals per-element calls, batched or not in each
argument, under jit and through the layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import MoEConfig, init_scratch, permute, unpermute
from jax_moe import init_moe_params, moe_layer
from jax_moe.scratch import BUFFER_NAMES

B, T, H = 3, 6, 16
CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=H, max_tokens=8, dtype=jnp.float32, align=2,
                   expert_map=(0, 1, -1, 2))


def _batched_scratch(config, batch=B):
    """A batch of scratches: one init_scratch, its leaves stacked (tree_map)."""
    single = init_scratch(config)
    return jax.tree.map(lambda a: jnp.stack([a] * batch), single)


def _inputs(dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (B, T, H), jnp.float32).astype(dtype)
    ids = jax.random.randint(jax.random.key(seed + 1), (B, T, 2), -1, 6)  # includes dropped ids
    w = jax.random.uniform(jax.random.key(seed + 2), (B, T, 2), jnp.float32)
    return x, ids, w


def _assert_scratch_equal(batched, index, single):
    for name in BUFFER_NAMES:
        if name == "workspace":  # unspecified contents
            continue
        got, want = np.asarray(getattr(batched, name)[index]), np.asarray(getattr(single, name))
        if name == "permuted":  # rows past the live count are unspecified
            live = int(single.expert_offsets[-1])
            got, want = got[:live], want[:live]
        elif name == "dest_index":  # rows t >= T are unspecified
            got, want = got[:T], want[:T]
        np.testing.assert_array_equal(got, want, err_msg=f"element {index}: {name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_permute_equals_per_element(jit, dtype):
    config = MoEConfig(**{**CONFIG.__dict__, "dtype": dtype})
    x, ids, _ = _inputs(dtype)
    batched_permute = jax.vmap(permute)
    if jit:
        batched_permute = jax.jit(batched_permute, donate_argnums=2)
    out = batched_permute(x, ids, _batched_scratch(config))
    assert out.permuted.shape == (B, config.capacity, H) and out.config == config
    for b in range(B):
        _assert_scratch_equal(out, b, permute(x[b], ids[b], init_scratch(config)))
    # The elements really differ (different routing per element).
    assert not np.array_equal(out.group_sizes[0], out.group_sizes[1])


def test_vmap_permute_with_a_shared_x():
    # x not batched, ids batched: each element routes the same tokens differently.
    x, ids, _ = _inputs()
    out = jax.vmap(permute, in_axes=(None, 0, 0))(x[0], ids, _batched_scratch(CONFIG))
    for b in range(B):
        _assert_scratch_equal(out, b, permute(x[0], ids[b], init_scratch(CONFIG)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_unpermute_equals_per_element(jit):
    x, ids, w = _inputs()
    scratches = jax.vmap(permute)(x, ids, _batched_scratch(CONFIG))
    y = jax.random.normal(jax.random.key(9), scratches.permuted.shape)
    batched_unpermute = jax.vmap(unpermute)
    if jit:
        batched_unpermute = jax.jit(batched_unpermute)
    out = batched_unpermute(y, w, scratches)
    assert out.shape == (B, T, H)
    for b in range(B):
        single = permute(x[b], ids[b], init_scratch(CONFIG))
        np.testing.assert_array_equal(out[b], unpermute(y[b], w[b], single))
    # Unbatched weights and rows, batched scratch (dest_index): in_axes None works too.
    out = jax.vmap(unpermute, in_axes=(None, None, 0))(y[0], w[0], scratches)
    for b in range(B):
        single = permute(x[b], ids[b], init_scratch(CONFIG))
        np.testing.assert_array_equal(out[b], unpermute(y[0], w[0], single))


def _gathered_swiglu(layer_params, rows, group_sizes):
    """SwiGLU with each row's expert weights gathered: vmappable, unlike ``jax.lax.ragged_dot``
    in jax 0.10 ("ragged_dot vmap over any dim but 0 - NYI"). Rows past the groups are unread."""
    ends = jnp.cumsum(group_sizes)
    expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right"), group_sizes.shape[0] - 1)
    gate, up = jnp.split(jnp.einsum("rh,rhf->rf", rows, layer_params["gate_up"][expert]), 2, axis=-1)
    return jnp.einsum("rf,rfh->rh", jax.nn.silu(gate) * up, layer_params["down"][expert])


def test_vmap_of_the_layer_and_its_gradient():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    params = jax.tree.map(lambda a: a[0], init_moe_params(jax.random.key(0), config, 1, 8))
    x, _, _ = _inputs()
    # Same numbers as the default ragged_dot experts for one element.
    y_default, _ = moe_layer(params, x[0], init_scratch(config))
    y_gathered, _ = moe_layer(params, x[0], init_scratch(config), expert_fn=_gathered_swiglu)
    np.testing.assert_allclose(y_gathered, y_default, rtol=1e-5, atol=1e-5)

    def loss(x, scratch):
        y, _ = moe_layer(params, x, scratch, expert_fn=_gathered_swiglu)
        return jnp.sum(jnp.square(y))

    layer = jax.vmap(lambda x, s: moe_layer(params, x, s, expert_fn=_gathered_swiglu))
    ys, _ = jax.jit(layer)(x, _batched_scratch(config))
    grads = jax.jit(jax.vmap(jax.grad(loss)))(x, _batched_scratch(config))
    for b in range(B):
        y, _ = moe_layer(params, x[b], init_scratch(config), expert_fn=_gathered_swiglu)
        np.testing.assert_allclose(ys[b], y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grads[b], jax.grad(loss)(x[b], init_scratch(config)), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(grads)).max() > 0
