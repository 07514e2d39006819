"""Donation really aliases (DESIGN.md §4): a donated scratch is written in place, never copied."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
import oracle

CONFIG = jax_moe.MoEConfig(num_experts=8, top_k=2, hidden_size=32, max_tokens=16, dtype=jnp.bfloat16, align=4)
NOT_USABLE = "donated buffers were not usable"


def routing(step: int):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((12, 32)).astype(CONFIG.dtype)
    ids = rng.integers(-1, 9, (12, 2)).astype(np.int32)
    weights = rng.uniform(0, 1, (12, 2)).astype(np.float32)
    return x, ids, weights


def pointers(scratch: jax_moe.MoEScratch) -> list[int]:
    return [buffer.unsafe_buffer_pointer() for buffer in scratch.buffers()]


def not_usable_warnings(records) -> list[str]:
    return [str(r.message) for r in records if NOT_USABLE in str(r.message)]


def test_warning_capture_sees_unusable_donation():
    """Control: the capture below does record the warning when a donation cannot be used."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        jax.jit(lambda a: a.sum(), donate_argnums=0)(jnp.ones((8, 8)))
    assert not_usable_warnings(records)


def test_donated_permute_writes_in_place():
    scratch = jax_moe.init_scratch(CONFIG)
    before = pointers(scratch)
    x, ids, _ = routing(0)
    step = jax.jit(jax_moe.permute, donate_argnums=2)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = step(x, ids, scratch)
        jax.block_until_ready(out)
    assert not_usable_warnings(records) == []
    assert out.permuted.unsafe_buffer_pointer() == before[0]
    assert pointers(out) == before
    assert all(buffer.is_deleted() for buffer in scratch.buffers())
    oracle.assert_scratch_matches(out, oracle.permute(x, ids, CONFIG), 12)


def test_without_donation_the_input_survives():
    """Control: the checks above can fail. Not donated, the input lives on and is not aliased."""
    scratch = jax_moe.init_scratch(CONFIG)
    x, ids, _ = routing(0)
    out = jax.jit(jax_moe.permute)(x, ids, scratch)
    assert not any(buffer.is_deleted() for buffer in scratch.buffers())
    assert out.permuted.unsafe_buffer_pointer() != scratch.permuted.unsafe_buffer_pointer()


def test_ten_donated_steps_keep_every_address():
    """A decode-like loop: permute -> toy expert -> unpermute, the scratch donated every step."""

    def step(x, ids, weights, scratch):
        scratch = jax_moe.permute(x, ids, scratch)
        y = scratch.permuted * jnp.asarray(2, CONFIG.dtype)
        return jax_moe.unpermute(y, weights, scratch), scratch

    step = jax.jit(step, donate_argnums=3)
    scratch = jax_moe.init_scratch(CONFIG)
    addresses = pointers(scratch)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for i in range(10):
            x, ids, weights = routing(i)
            previous = scratch
            out, scratch = step(x, ids, weights, scratch)
            jax.block_until_ready((out, scratch))
            assert pointers(scratch) == addresses, f"step {i}: a scratch buffer moved"
            assert all(buffer.is_deleted() for buffer in previous.buffers()), f"step {i}"
            expected = oracle.permute(x, ids, CONFIG)
            oracle.assert_scratch_matches(scratch, expected, 12)
            y = (expected.permuted.astype(np.float32) * 2).astype(CONFIG.dtype)
            oracle.assert_bitwise_equal(out, oracle.unpermute(y, weights, expected.dest_index), f"step {i}")
    assert not_usable_warnings(records) == []


def test_scanned_layers_keep_the_donated_scratch_address():
    """One scratch threaded through a lax.scan over layers, donated across two calls."""

    def stack(x, ids, weights, scratch):
        def layer(carry, per_layer):
            hidden, scratch = carry
            layer_ids, layer_weights = per_layer
            scratch = jax_moe.permute(hidden, layer_ids, scratch)
            return (jax_moe.unpermute(scratch.permuted, layer_weights, scratch), scratch), None
        return jax.lax.scan(layer, (x, scratch), (ids, weights))[0]

    stack = jax.jit(stack, donate_argnums=3)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 8, (4, 12, 2)).astype(np.int32)
    weights = rng.uniform(0, 1, (4, 12, 2)).astype(np.float32)
    scratch = jax_moe.init_scratch(CONFIG)
    address = scratch.permuted.unsafe_buffer_pointer()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for _ in range(2):
            hidden, scratch = stack(routing(0)[0], ids, weights, scratch)
            jax.block_until_ready(scratch)
            assert scratch.permuted.unsafe_buffer_pointer() == address
    assert not_usable_warnings(records) == []
