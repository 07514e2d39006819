"""CUDA custom calls vs the CPU custom call, bit for bit (DESIGN.md §3).

The CPU handler is proven against the NumPy oracle in test_contract.py; here every case runs
on both devices in one process and must agree exactly, on the whole CPU grid, on medium cases
that take the multi-launch CUDA path, and on model-sized cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from cases import Case, _case, cases, large_cases  # noqa: F401

pytestmark = pytest.mark.gpu


def _cpu():
    return jax.devices("cpu")[0]


def _gpu():
    return jax.devices("gpu")[0]


def _expert_outputs(case: Case, config) -> np.ndarray:
    """Independent [R_cap, H] expert outputs (so unpermute reads exactly the rows it must)."""
    rng = np.random.default_rng(case.seed("y"))
    return rng.standard_normal((config.capacity, config.hidden_size)).astype(case.x.dtype)


@jax.jit
def _permute_unpermute(x, topk_ids, topk_weights, y, scratch):
    scratch = jax_moe.permute(x, topk_ids, scratch)
    return scratch, jax_moe.unpermute(y, topk_weights, scratch)


def _run(case: Case, device, y: np.ndarray):
    config = case.moe_config()
    with jax.enable_x64(case.x64):
        args = [jax.device_put(a, device) for a in (case.x, case.topk_ids, case.topk_weights, y)]
        scratch, out = _permute_unpermute(*args, jax_moe.init_scratch(config, device))
        return jax.tree.map(np.asarray, scratch), np.asarray(out)


def _assert_same(case: Case, cpu, gpu):
    (cpu_scratch, cpu_out), (gpu_scratch, gpu_out) = cpu, gpu
    T = case.num_tokens
    live = int(cpu_scratch.expert_offsets[-1])
    for name in ("group_sizes", "expert_offsets", "src_index"):
        np.testing.assert_array_equal(getattr(gpu_scratch, name), getattr(cpu_scratch, name), err_msg=name)
    np.testing.assert_array_equal(gpu_scratch.dest_index[:T], cpu_scratch.dest_index[:T], err_msg="dest_index")
    np.testing.assert_array_equal(gpu_scratch.permuted[:live].view(np.uint8), cpu_scratch.permuted[:live].view(np.uint8),
                                  err_msg="permuted")
    np.testing.assert_array_equal(gpu_out.view(np.uint8), cpu_out.view(np.uint8), err_msg="unpermute")


def _medium_cases() -> list[Case]:
    """Cases past the one-launch limit (R > 1024 routes): the four-launch CUDA path and its edges."""
    return [
        _case("medium_R1025", num_experts=8, top_k=1, hidden_size=64, max_tokens=1025, dtype="bfloat16"),
        _case("medium_R2048_tile", num_experts=64, top_k=8, hidden_size=128, max_tokens=256, dtype="float16"),
        _case("medium_R4104_two_tiles", num_experts=128, top_k=8, hidden_size=40, max_tokens=513, dtype="float32",
              align=8),
        _case("medium_El2048", num_experts=2048, top_k=4, hidden_size=16, max_tokens=2000, dtype="bfloat16"),
        _case("medium_El4096_align16", num_experts=4096, top_k=2, hidden_size=8, max_tokens=3000,
              dtype="float32", align=16),
        _case("medium_odd_H", num_experts=16, top_k=4, hidden_size=3, max_tokens=700, dtype="float16",
              align=4),
        _case("medium_map", num_experts=64, top_k=6, hidden_size=256, max_tokens=600, dtype="bfloat16",
              expert_map=tuple(((e * 5) % 64) // 2 if e % 2 == 0 else -1 for e in range(64))),
        _case("medium_dropped_and_out_of_range", num_experts=40, top_k=8, hidden_size=72, max_tokens=900,
              dtype="float32", ids=lambda rng, T, k, E: rng.integers(-3, E + 3, (T, k))),
        _case("medium_all_one_expert", num_experts=256, top_k=8, hidden_size=64, max_tokens=1000, dtype="bfloat16",
              align=32, ids=lambda rng, T, k, E: np.full((T, k), 77)),
        _case("medium_T_below_max", num_experts=32, top_k=4, hidden_size=96, max_tokens=4000, num_tokens=1500,
              dtype="bfloat16", align=2),
    ]


@pytest.mark.parametrize("case", cases() + _medium_cases(), ids=repr)
def test_gpu_matches_cpu(case):
    y = _expert_outputs(case, case.moe_config())
    _assert_same(case, _run(case, _cpu(), y), _run(case, _gpu(), y))


@pytest.mark.parametrize("case", large_cases(), ids=repr)
def test_gpu_matches_cpu_large(case):
    y = _expert_outputs(case, case.moe_config())
    _assert_same(case, _run(case, _cpu(), y), _run(case, _gpu(), y))


@pytest.mark.parametrize("case", [c for c in _medium_cases() if c.name in ("medium_R4104_two_tiles", "medium_map")]
                         + [c for c in cases() if not c.x64][:3], ids=repr)
def test_gpu_runs_are_bitwise_deterministic(case):
    y = _expert_outputs(case, case.moe_config())
    first, second = _run(case, _gpu(), y), _run(case, _gpu(), y)
    _assert_same(case, first, second)


def _prefetch_cases() -> list[Case]:
    """The one-launch path's edges (maps, align, dropped ids, odd rows), one four-launch case (which
    ignores the hint), and Qwen3-30B's decode routing."""
    return ([c for c in cases() if not c.x64] + [c for c in _medium_cases() if c.name == "medium_map"]
            + [_case("qwen3_T2", num_experts=128, top_k=8, hidden_size=2048, max_tokens=2, dtype="bfloat16")])


@pytest.mark.parametrize("case", _prefetch_cases(), ids=repr)
def test_gpu_permute_prefetch_changes_no_bit(case):
    """permute(..., prefetch=w): its extra blocks only ask L2 for weights; the scratch and
    unpermute's output are bitwise permute's. The slabs (256 KB) make one prefetch block a route."""
    config = case.moe_config()
    y = _expert_outputs(case, config)
    with jax.default_device(_gpu()):
        weights = jnp.ones((config.num_local_experts, 256, 512), jnp.bfloat16)

    @jax.jit
    def prefetching(x, topk_ids, topk_weights, y, scratch, weights):
        scratch = jax_moe.permute(x, topk_ids, scratch, prefetch=weights)
        return scratch, jax_moe.unpermute(y, topk_weights, scratch)

    with jax.enable_x64(case.x64):
        args = [jax.device_put(a, _gpu()) for a in (case.x, case.topk_ids, case.topk_weights, y)]
        scratch, out = prefetching(*args, jax_moe.init_scratch(config, _gpu()), weights)
        got = jax.tree.map(np.asarray, scratch), np.asarray(out)
    _assert_same(case, _run(case, _gpu(), y), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", [256, 100])  # 16-byte vectors, and single elements
@pytest.mark.parametrize("with_addend", [True, False], ids=["addend", "residual-only"])
def test_gpu_unpermute_add_is_the_elementwise_adds_bitwise(dtype, hidden, with_addend):
    """unpermute with a layer's adds in its launch: bitwise residual + (unpermute + addend) as XLA
    adds them, with residuals 300x larger than the sums (so most adds round) and dropped routes."""
    config = jax_moe.MoEConfig(num_experts=16, top_k=4, hidden_size=hidden, max_tokens=5, dtype=dtype, align=2)
    rng = np.random.default_rng(hidden)
    with jax.default_device(_gpu()):
        x = jnp.asarray(rng.standard_normal((5, hidden)), dtype)
        ids = jnp.asarray(rng.integers(-1, 17, (5, 4)), jnp.int32)
        scratch = jax.jit(jax_moe.permute)(x, ids, jax_moe.init_scratch(config))
        y = jnp.asarray(rng.standard_normal((config.capacity, hidden)), dtype)
        weights = jnp.asarray(rng.random((5, 4)), jnp.float32)
        residual = jnp.asarray(300 * rng.standard_normal((5, hidden)), dtype)
        addend = jnp.asarray(rng.standard_normal((5, hidden)), dtype) if with_addend else None
        fused = jax.jit(jax_moe.ops.unpermute_add)
        assert "jax_moe_unpermute_add" in fused.lower(y, weights, scratch, residual, addend).compile().as_text()
        got = fused(y, weights, scratch, residual, addend)

        @jax.jit
        def apart(y, weights, scratch, residual, addend):
            out = jax_moe.unpermute(y, weights, scratch)
            return residual + (out if addend is None else out + addend)

        want = apart(y, weights, scratch, residual, addend)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(residual, np.float32))


def _scanned_stack(x, ids, weights, scratch):
    """A layer stack in lax.scan: routing per layer from xs, the scratch in the carry."""
    def layer(carry, routing):
        h, scratch = carry
        layer_ids, layer_weights = routing
        scratch = jax_moe.permute(h, layer_ids, scratch)
        y = scratch.permuted * jnp.asarray(1.5, h.dtype)
        h = h + jax_moe.unpermute(y, layer_weights, scratch)
        return (h, scratch), scratch.group_sizes
    (h, scratch), sizes = jax.lax.scan(layer, (x, scratch), (ids, weights))
    return h, scratch, sizes


def _stack_inputs(seed, layers=4, T=96, k=4, E=16, H=256):
    rng = np.random.default_rng(seed)
    config = jax_moe.MoEConfig(num_experts=E, top_k=k, hidden_size=H, max_tokens=T, dtype=jnp.float32, align=4)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(-1, E + 1, (layers, T, k)).astype(np.int32)
    weights = rng.random((layers, T, k)).astype(np.float32)
    return config, x, ids, weights


def test_gpu_scan_matches_cpu():
    config, *inputs = _stack_inputs(0)
    results = []
    for device in (_cpu(), _gpu()):
        args = [jax.device_put(a, device) for a in inputs]
        step = jax.jit(_scanned_stack, donate_argnums=3)
        h, _, sizes = step(*args, jax_moe.init_scratch(config, device))
        results.append((np.asarray(h), np.asarray(sizes)))
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    sys.path.insert(0, {tests_dir!r})
    import jax_moe
    from test_gpu import _scanned_stack, _stack_inputs
    step = jax.jit(_scanned_stack, donate_argnums=3)
    config, *inputs = _stack_inputs(0)
    gpu = jax.devices("gpu")[0]
    scratch = jax_moe.init_scratch(config, gpu)
    for seed in range(4):  # new routing every run: a stale recorded graph would repeat old results
        config, *inputs = _stack_inputs(seed)
        h, scratch, sizes = step(*[jax.device_put(a, gpu) for a in inputs], scratch)
        cpu = jax.devices("cpu")[0]
        h_cpu, _, sizes_cpu = jax.jit(_scanned_stack)(*[jax.device_put(a, cpu) for a in inputs],
                                                      jax_moe.init_scratch(config, cpu))
        np.testing.assert_array_equal(np.asarray(h), np.asarray(h_cpu))
        np.testing.assert_array_equal(np.asarray(sizes), np.asarray(sizes_cpu))
    print("command buffer runs match")
""")


def test_gpu_command_buffer_with_changing_inputs():
    """XLA records custom calls into CUDA graphs: results must follow the inputs of every run.

    The flags force command buffers for fusions and custom calls down to one-op graphs. (jaxlib
    0.11 forms them on the thunk sequence, after HLO, so the compiled HLO text cannot show them.)
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    script = _COMMAND_BUFFER_SCRIPT.format(tests_dir=os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "command buffer runs match" in result.stdout
