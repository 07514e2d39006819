"""Checks of jax_moe.parallel on 8 host CPU devices, or on every GPU (``--gpu``), in a subprocess.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only works if it is set before JAX starts,
which a pytest process that already ran other tests cannot do; so this script sets it, runs the
checks named on its command line (all by default) in one process, and prints one JSON line per
check: ``{"name": ..., "ok": bool, "detail": str, "seconds": float}``. It always exits 0 after
running every check (a failing check is reported, not raised), 2 on a usage error.

With ``--gpu`` it runs ``gpu_checks(n)`` instead on a mesh of all the GPUs JAX sees (at least 2),
the single-device oracle on the first: the same checks at n = the GPU count, plus the bf16 stack
on the CUDA grouped GEMM. tests/test_parallel.py starts it when a process sees 2+ GPUs.

    python tests/parallel_checks.py [--gpu] [--list] [NAME ...]
"""

from __future__ import annotations

import os
import sys

ON_GPU = "--gpu" in sys.argv[1:]
if not ON_GPU:
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_moe import MoEConfig, init_scratch, permute, unpermute  # noqa: E402
from jax_moe import parallel as ep  # noqa: E402
from jax_moe import init_moe_params, moe_layer, moe_stack  # noqa: E402
from jax_moe.experts import swiglu_experts  # noqa: E402
from jax_moe.ops import rms_norm  # noqa: E402
from jax_moe.routing import route  # noqa: E402
from jax_moe.scratch import BUFFER_NAMES  # noqa: E402

E, K, H, F, L = 16, 2, 64, 32, 3
TOKENS_PER_DEVICE = 4
AXIS = "ep"


def config_for(num_devices: int, dtype=jnp.float32, **overrides) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=TOKENS_PER_DEVICE * num_devices,
                     dtype=dtype, **overrides)


def mesh_for(num_devices: int, explicit: bool = False) -> Mesh:
    if explicit:  # jax.make_mesh's default in jax 0.10: Explicit axes
        return jax.make_mesh((num_devices,), (AXIS,), devices=jax.devices()[:num_devices])
    return Mesh(np.array(jax.devices()[:num_devices]), (AXIS,))


def random_placement(seed: int) -> tuple[int, ...]:
    return tuple(int(v) for v in np.random.default_rng(seed).permutation(E))


# DeepSeek-V3's routing (sigmoid, groups, bias, scaling) with a shared expert: the bias and the
# shared expert are replicated like the router.
DEEPSEEK_ROUTING = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, renormalize_epsilon=1e-20)


def inputs(config: MoEConfig, num_tokens: int, seed: int = 0, shared: bool = False):
    params = init_moe_params(jax.random.key(seed), config, L, F, shared_ffn_size=24 if shared else None,
                             router_bias=shared)
    if shared:
        params["router_bias"] = 0.1 * jax.random.normal(jax.random.key(seed + 2), params["router_bias"].shape)
    x = jax.random.normal(jax.random.key(seed + 1), (num_tokens, H), jnp.float32).astype(config.dtype)
    return params, x


def single_device_stack(params, x, config):
    return jax.jit(lambda p, h: moe_stack(p, h, init_scratch(config))[0])(params, x)


def ep_stack(params, x, config, mesh, placement=None, capacity_factor=None, unroll=1, ragged=False):
    """The sharded stack on ``mesh`` from global params; returns (y, dropped) as NumPy."""
    sharded = ep.shard_params(params, mesh, AXIS, placement=placement)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=placement, capacity_factor=capacity_factor,
                                 ragged=ragged)
    x = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    step = jax.jit(lambda p, h, s: ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name=AXIS, unroll=unroll),
                   donate_argnums=2)
    y, scratch, dropped = step(sharded, x, scratch)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(AXIS)), 2), y.sharding
    return np.asarray(y), np.asarray(dropped)


def assert_close(actual, expected, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(expected).max()),
                               err_msg=what)


# --- a single-device oracle for overflow: the same stack with the overflowed routes masked --------

def overflow_mask(ids, slots, num_devices, capacity):
    """Routes of token block d to device p beyond the first ``capacity`` (flat order): True.

    Written independently of jax_moe.parallel (a pairwise count instead of a cumulative sum).
    """
    num_tokens, top_k = ids.shape
    dest = (slots[ids] // (E // num_devices)).reshape(num_devices, num_tokens // num_devices * top_k)
    routes = dest.shape[1]
    earlier = jnp.arange(routes)[None, :] < jnp.arange(routes)[:, None]  # [r, r'] r' < r
    rank = jnp.sum((dest[:, :, None] == dest[:, None, :]) & earlier[None], axis=2)
    return (rank >= capacity).reshape(num_tokens, top_k)


def masked_single_device_stack(params, x, config, num_devices, placement, capacity):
    """moe_stack on one device where each layer's overflowed routes get id -1; also the counts."""
    slots = jnp.asarray(ep.placement_array(placement, E))

    def run(params, x):
        def body(carry, layer_params):
            h, scratch = carry
            normed = rms_norm(h)
            weights, ids = route(layer_params["router"], normed, config)
            dropped = overflow_mask(ids, slots, num_devices, capacity)
            scratch = permute(normed, jnp.where(dropped, -1, ids), scratch)
            rows = swiglu_experts(layer_params, scratch.permuted, scratch.group_sizes)
            return (h + unpermute(rows, weights, scratch), scratch), jnp.sum(dropped, dtype=jnp.int32)

        (y, _), counts = lax.scan(body, (x, init_scratch(config)), params)
        return y, counts

    return jax.jit(run)(params, x)


# --- checks ---------------------------------------------------------------------------------------

def check_equal(num_devices, placement_seed=None, explicit=False, num_tokens=None, unroll=1,
                dtype=jnp.float32, align=1, deepseek=False, ragged=False):
    """The sharded stack equals the single-device stack (no overflow: default capacity; or ragged)."""
    config = config_for(num_devices, dtype, align=align, **(DEEPSEEK_ROUTING if deepseek else {}))
    num_tokens = num_tokens or config.max_tokens
    params, x = inputs(config, num_tokens, seed=num_devices, shared=deepseek)
    placement = None if placement_seed is None else random_placement(placement_seed)
    expected = single_device_stack(params, x, config)
    actual, dropped = ep_stack(params, x, config, mesh_for(num_devices, explicit), placement, unroll=unroll,
                               ragged=ragged)
    assert dropped.shape == (L,) and not dropped.any(), dropped
    if dtype == jnp.float32:
        assert_close(actual, expected, f"{num_devices}-way stack vs single device")
    else:  # a bf16 ulp at the output's magnitude
        np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                                   atol=2e-2 * np.abs(np.asarray(expected, np.float32)).max())
    diff = np.abs(np.asarray(actual, np.float32) - np.asarray(expected, np.float32)).max()
    return f"max |diff| {diff:.3g}"


def check_layer_equal(num_devices):
    """moe_layer_ep equals moe_layer, non-contiguous placement."""
    config = config_for(num_devices)
    params, x = inputs(config, config.max_tokens, seed=3)
    layer = jax.tree.map(lambda a: a[0], params)
    expected, _ = jax.jit(lambda p, h: moe_layer(p, h, init_scratch(config)))(layer, x)
    mesh, placement = mesh_for(num_devices), random_placement(5)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=placement)
    sharded = ep.shard_params(layer, mesh, AXIS, placement=placement)
    y, scratch, dropped = jax.jit(
        lambda p, h, s: ep.moe_layer_ep(p, h, s, mesh=mesh, axis_name=AXIS), donate_argnums=2)(sharded, x, scratch)
    assert int(dropped) == 0 and dropped.shape == ()
    assert_close(y, expected, "layer")
    return "ok"


def check_placement_is_an_expert_map():
    """Device d's block of shard_params output is the single-device params of its expert_map."""
    num_devices = 4
    config, placement = config_for(num_devices), random_placement(7)
    params, _ = inputs(config, 1)
    sharded = ep.shard_params(params, mesh_for(num_devices), AXIS, placement=placement)
    local = E // num_devices
    for d, shard in enumerate(sorted(sharded["gate_up"].addressable_shards, key=lambda s: s.index[1].start)):
        expert_map = ep.device_expert_map(placement, num_devices, d)
        MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=1, expert_map=expert_map)  # valid map
        owned = [e for e in range(E) if expert_map[e] >= 0]
        assert len(owned) == local
        for e in owned:
            np.testing.assert_array_equal(np.asarray(shard.data)[:, expert_map[e]], np.asarray(params["gate_up"])[:, e])
    # ...and a wrong placement gives a different answer (the placement is really used).
    x = jax.random.normal(jax.random.key(2), (config.max_tokens, H), jnp.float32)
    mesh = mesh_for(num_devices)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=None)
    y, _, _ = ep.moe_stack_ep(sharded, x, scratch, mesh=mesh, axis_name=AXIS)
    assert not np.allclose(np.asarray(y), np.asarray(single_device_stack(params, x, config)), atol=1e-3)
    return "ok"


def check_overflow(num_devices, capacity_factor, placement_seed):
    """Tiny capacity: equals the single-device stack with exactly the overflowed routes dropped."""
    config = config_for(num_devices)
    params, x = inputs(config, config.max_tokens, seed=11)
    placement = random_placement(placement_seed)
    capacity = ep.peer_capacity(config, num_devices, TOKENS_PER_DEVICE, capacity_factor)
    assert capacity < TOKENS_PER_DEVICE * K, capacity
    expected, expected_counts = masked_single_device_stack(params, x, config, num_devices, placement, capacity)
    actual, dropped = ep_stack(params, x, config, mesh_for(num_devices), placement, capacity_factor)
    np.testing.assert_array_equal(dropped, np.asarray(expected_counts))
    assert dropped.min() > 0 and dropped.max() < config.max_tokens * K, dropped
    assert_close(actual, expected, "overflow stack vs masked single device")
    return f"C={capacity}, dropped per layer {dropped.tolist()} of {config.max_tokens * K}"


def check_grad(num_devices, placement_seed, capacity_factor=None, ragged=False):
    """jax.grad through the sharded stack equals the single-device gradient (params and x)."""
    config = config_for(num_devices)
    params, x = inputs(config, config.max_tokens, seed=21)
    placement = random_placement(placement_seed)
    mesh = mesh_for(num_devices)
    capacity = ep.peer_capacity(config, num_devices, TOKENS_PER_DEVICE, capacity_factor)

    def single_loss(p, h):
        if capacity_factor is None:
            y, _ = moe_stack(p, h, init_scratch(config))
        else:
            y, _ = masked_single_device_stack(p, h, config, num_devices, placement, capacity)
        return jnp.sum(jnp.sin(y))

    def sharded_loss(p, h, s):
        y, s, _ = ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name=AXIS)
        return jnp.sum(jnp.sin(y)), s

    expected = jax.jit(jax.grad(single_loss, argnums=(0, 1)))(params, x)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=placement, capacity_factor=capacity_factor,
                                 ragged=ragged)
    grad = jax.jit(jax.grad(sharded_loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
    (d_params, d_x), _ = grad(ep.shard_params(params, mesh, AXIS, placement=placement), x, scratch)
    assert_close(d_x, expected[1], "d x")
    slots = np.asarray(ep.placement_array(placement, E))
    for name in ("router", "gate_up", "down"):
        actual = np.asarray(d_params[name])
        if name != "router":
            actual = actual[:, slots]  # slot order -> global expert order
        assert_close(actual, expected[0][name], f"d params[{name!r}]")
    return "ok"


# A copy of a scratch-shaped value; a copy of a fresh broadcast (a dispatch-plan buffer that happens
# to share a scratch buffer's shape) cannot be a scratch copy.
_COPY = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+(copy|copy-start)\((?!%?\w*broadcast)")


def check_no_scratch_copies(num_devices, dtype=jnp.float32, align=4, custom_call="jax_moe_permute"):
    """Donated sharded stack (inference and training): every scratch buffer aliased, none copied."""
    # align 4 makes the receive capacity (n*C + El*3, rounded to 4) differ from the n*C received rows.
    config = config_for(num_devices, dtype, align=align)
    params, x = inputs(config, config.max_tokens)
    mesh, placement = mesh_for(num_devices), random_placement(1)
    scratch = ep.init_scratch_ep(config, mesh, AXIS, placement=placement)
    sharded = ep.shard_params(params, mesh, AXIS, placement=placement)
    names = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.int32): "s32", jnp.dtype(jnp.bfloat16): "bf16"}
    scratch_types = {}
    for name in BUFFER_NAMES:
        shape = getattr(scratch.local, name).shape
        for dims in (shape, (1, *shape[1:]), shape[1:]):  # stacked, a device's block, and its own view
            scratch_types[f"{names[jnp.dtype(getattr(scratch.local, name).dtype)]}[{','.join(map(str, dims))}]"] = name
    per_device_bytes = scratch.nbytes // num_devices

    def step(p, h, s):
        return ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name=AXIS)

    def train(p, h, s):
        def loss(p, h, s):
            y, s, _ = step(p, h, s)
            return jnp.sum(jnp.square(y)), s
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, h, s)

    def scratch_copies(fn, donate):
        compiled = jax.jit(fn, donate_argnums=donate).lower(sharded, x, scratch).compile()
        text = compiled.as_text()
        assert custom_call in text and "all-to-all" in text, custom_call
        copies = [line.strip()[:160] for line in text.splitlines()
                  if (m := _COPY.search(line)) and m.group(1) in scratch_types]
        return copies, compiled.memory_analysis().alias_size_in_bytes

    # Control: not donated, XLA must copy each device's scratch before writing it in place.
    copies, _ = scratch_copies(step, ())
    assert len(copies) >= len(BUFFER_NAMES), copies
    for label, fn in (("step", step), ("train", train)):
        copies, aliased = scratch_copies(fn, 2)
        assert copies == [], (label, copies)
        assert aliased == per_device_bytes, (label, aliased, per_device_bytes)

    # Donated steps get the same buffers back, on every device.
    run = jax.jit(step, donate_argnums=2)
    pointers = sorted((s.device.id, s.data.unsafe_buffer_pointer())
                      for b in jax.tree.leaves(scratch) for s in b.addressable_shards)
    for i in range(3):
        y, scratch, _ = run(sharded, x, scratch)
        now = sorted((s.device.id, s.data.unsafe_buffer_pointer())
                     for b in jax.tree.leaves(scratch) for s in b.addressable_shards)
        assert now == pointers, f"step {i}: scratch buffers moved"
    return f"aliased {per_device_bytes} B per device, no copies"


def check_errors():
    """Trace-time ValueErrors that name the argument."""
    mesh = mesh_for(4)
    config = config_for(4)
    params, x = inputs(config, config.max_tokens)
    sharded = ep.shard_params(params, mesh, AXIS)
    scratch = ep.init_scratch_ep(config, mesh, AXIS)

    def raises(fn, *words):
        try:
            fn()
        except ValueError as e:
            message = str(e)
            missing = [w for w in words if w not in message]
            assert not missing, (missing, message)
            return
        raise AssertionError(f"no ValueError (expected one naming {words})")

    call = lambda **kw: ep.moe_stack_ep(kw.get("p", sharded), kw.get("x", x), kw.get("s", scratch),  # noqa: E731
                                        mesh=kw.get("mesh", mesh), axis_name=kw.get("axis", AXIS))
    raises(lambda: ep.init_scratch_ep(MoEConfig(num_experts=6, top_k=2, hidden_size=H, max_tokens=16), mesh, AXIS),
           "num_experts", "multiple", "4")
    raises(lambda: ep.init_scratch_ep(MoEConfig(num_experts=E, top_k=2, hidden_size=H, max_tokens=6), mesh, AXIS),
           "max_tokens", "multiple")
    raises(lambda: ep.init_scratch_ep(config, mesh, "tp"), "axis_name", "'tp'")
    raises(lambda: ep.init_scratch_ep(config, "mesh", AXIS), "mesh", "Mesh")
    raises(lambda: ep.init_scratch_ep(config, mesh, AXIS, placement=[0] * E), "placement", "permutation")
    raises(lambda: ep.init_scratch_ep(config, mesh, AXIS, capacity_factor=0), "capacity_factor")
    raises(lambda: ep.init_scratch_ep(config, mesh, AXIS, capacity_factor=2.0, ragged=True), "ragged", "dropless")
    raises(lambda: ep.init_scratch_ep(config_for(4, expert_map=tuple(range(E))), mesh, AXIS), "expert_map")
    raises(lambda: call(x=x[:6]), "x", "multiple", "6")
    raises(lambda: call(x=jnp.zeros((2 * config.max_tokens, H), jnp.float32)), "x", "at most")
    raises(lambda: call(x=x.astype(jnp.bfloat16)), "x", "dtype")
    raises(lambda: call(mesh=mesh_for(2)), "scratch", "2 devices")
    raises(lambda: call(axis="tp"), "axis_name")
    raises(lambda: call(s=init_scratch(config)), "scratch", "ExpertParallelScratch")
    raises(lambda: call(p={**sharded, "down": sharded["down"][:, :, :5]}), "params['down']")
    raises(lambda: ep.shard_params(params, mesh_for(8), AXIS, placement=list(range(E - 1))), "placement")
    return "ok"


def check_bench_suite(num_devices):
    """The parallel benchmark suite runs on all devices: every case timed, shares derived."""
    from jax_moe.bench import common, parallel_suite
    from jax_moe.bench.models import MODELS
    rows, notes = parallel_suite.run([MODELS["tiny"]], (2,), common.Clock(), compile_threads=2, layer_counts=(1, 2))
    errors = [r["error"] for r in rows if "error" in r]
    assert not errors, errors
    assert {r["devices"] for r in rows} == {num_devices}
    ep_rows = [r for r in rows if r["case"] == "ep"]
    capacities = parallel_suite.distinct_capacities(MODELS["tiny"].config(2 * num_devices), num_devices, 2)
    dropless = [parallel_suite.DROPLESS] if "lax.ragged_all_to_all: supported" in notes[0] else []
    assert [r["capacity"] for r in ep_rows] == list(capacities) + dropless
    assert all("collectives_us" in r for r in ep_rows)
    for r in ep_rows:  # bytes: the fixed layout sends all n*C slots, dropless only the T*k routes
        want = 2 * MODELS["tiny"].top_k if r["capacity"] == parallel_suite.DROPLESS else num_devices * r["C"]
        assert r["rows_sent"] == want and r["bytes_sent"] == want * MODELS["tiny"].hidden_size * 2, r
    return "; ".join(f"{r['capacity']}: {r['us_per_layer']:.0f} us/layer, collectives {r['collectives_us']:.0f}"
                     for r in ep_rows)


CHECKS = {
    "equal_2way": lambda: check_equal(2),
    "equal_4way_noncontiguous": lambda: check_equal(4, placement_seed=0),
    "equal_8way_noncontiguous_explicit_mesh": lambda: check_equal(8, placement_seed=1, explicit=True),
    "equal_8way_fewer_tokens_unrolled": lambda: check_equal(8, placement_seed=2, num_tokens=16, unroll=True),
    "equal_8way_bf16_align8": lambda: check_equal(8, placement_seed=9, dtype=jnp.bfloat16, align=8),
    "equal_4way_deepseek_routing_shared_expert": lambda: check_equal(4, placement_seed=10, deepseek=True),
    "layer_equal_4way": lambda: check_layer_equal(4),
    "placement_is_an_expert_map": check_placement_is_an_expert_map,
    "overflow_4way": lambda: check_overflow(4, 1.0, placement_seed=3),
    "overflow_8way_capacity_1": lambda: check_overflow(8, 0.5, placement_seed=4),
    "grad_4way_noncontiguous": lambda: check_grad(4, placement_seed=6),
    "grad_8way_overflow": lambda: check_grad(8, placement_seed=8, capacity_factor=0.5),
    "equal_4way_ragged": lambda: check_equal(4, placement_seed=11, ragged=True),
    "grad_4way_ragged": lambda: check_grad(4, placement_seed=12, ragged=True),
    "no_scratch_copies_8way": lambda: check_no_scratch_copies(8),
    "errors": check_errors,
    "bench_suite_8way": lambda: check_bench_suite(8),
}


def check_grouped_gemm_in_use(num_devices):
    """On GPUs the sharded bf16 stack runs its experts on the CUDA grouped GEMM, as moe_stack does."""
    from jax_moe import _native
    config = config_for(num_devices, jnp.bfloat16, align=8)
    params, x = inputs(config, config.max_tokens)
    mesh = mesh_for(num_devices)
    scratch = ep.init_scratch_ep(config, mesh, AXIS)
    text = jax.jit(lambda p, h, s: ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name=AXIS)).lower(
        ep.shard_params(params, mesh, AXIS), x, scratch).compile().as_text()
    calls = text.count(f"custom_call_target=\"{_native.GROUPED_MATMUL_TARGET}\"")
    assert calls == 2, f"{calls} grouped GEMM calls in the compiled stack (expected 2: gate/up, down)"
    return f"{calls} grouped GEMM custom calls per layer body"


def gpu_checks(n: int) -> dict:
    """The checks for n GPUs. f32 ones run at full f32 precision (XLA:GPU's default f32 dot is TF32)."""
    def full_f32(check):
        def run():
            with jax.default_matmul_precision("highest"):
                return check()
        return run

    return {
        "equal_f32_noncontiguous": full_f32(lambda: check_equal(n, placement_seed=0)),
        "equal_f32_fewer_tokens_unrolled": full_f32(lambda: check_equal(n, placement_seed=2, num_tokens=n,
                                                                        unroll=True)),
        "equal_bf16_grouped_gemm_align8": lambda: check_equal(n, placement_seed=9, dtype=jnp.bfloat16, align=8),
        "grouped_gemm_in_use": lambda: check_grouped_gemm_in_use(n),
        "layer_equal": full_f32(lambda: check_layer_equal(n)),
        "overflow": full_f32(lambda: check_overflow(n, 0.5, placement_seed=4)),
        "grad_noncontiguous": full_f32(lambda: check_grad(n, placement_seed=6)),
        "grad_overflow": full_f32(lambda: check_grad(n, placement_seed=8, capacity_factor=0.5)),
        "equal_ragged": full_f32(lambda: check_equal(n, placement_seed=11, ragged=True)),
        "equal_ragged_bf16_align8": lambda: check_equal(n, placement_seed=13, dtype=jnp.bfloat16, align=8,
                                                        ragged=True),
        "grad_ragged": full_f32(lambda: check_grad(n, placement_seed=12, ragged=True)),
        "no_scratch_copies_f32": lambda: check_no_scratch_copies(n),
        "no_scratch_copies_bf16_grouped_gemm": lambda: check_no_scratch_copies(
            n, jnp.bfloat16, align=8, custom_call="jax_moe_grouped_matmul"),
        "bench_suite": lambda: check_bench_suite(n),
    }


def main(argv: list[str]) -> int:
    argv = [a for a in argv if a != "--gpu"]
    checks = gpu_checks(jax.device_count()) if ON_GPU else CHECKS
    if "--list" in argv:
        print("\n".join(checks))
        return 0
    names = argv or list(checks)
    unknown = [n for n in names if n not in checks]
    if unknown:
        print(f"unknown checks {unknown}; known: {list(checks)}", file=sys.stderr)
        return 2
    if ON_GPU:
        assert jax.default_backend() == "gpu" and jax.device_count() >= 2, jax.devices()
    else:
        assert jax.device_count() == 8, jax.devices()
    for name in names:
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON lines only
                detail, ok = checks[name](), True
        except Exception:  # reported per check, so one failure does not hide the others
            detail, ok = traceback.format_exc(limit=6), False
        print(json.dumps({"name": name, "ok": ok, "detail": str(detail),
                          "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
