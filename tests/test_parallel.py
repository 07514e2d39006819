"""Expert parallelism (issues 6, 7): jax_moe.parallel on 8 CPU devices, on 2+ GPUs, and on one device.

The 8-device checks live in tests/parallel_checks.py and run in ONE subprocess (started once per
session by the ``eight_devices`` fixture): ``--xla_force_host_platform_device_count`` only takes
effect before JAX starts, which this pytest process has long done. Each check is reported here as
its own test. With 2+ GPUs the GPU checks run the same way (``--gpu``, the ``all_gpus`` fixture),
on a mesh of every GPU. The rest runs in-process on a one-device mesh.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_moe import MoEConfig, init_scratch
from jax_moe import parallel as ep
from jax_moe.bench import common, parallel_suite
from jax_moe.bench.models import MODELS
from jax_moe import init_moe_params, moe_stack

CHECKS_SCRIPT = pathlib.Path(__file__).with_name("parallel_checks.py")
EIGHT_DEVICE_CHECKS = (
    "equal_2way",
    "equal_4way_noncontiguous",
    "equal_8way_noncontiguous_explicit_mesh",
    "equal_8way_fewer_tokens_unrolled",
    "equal_8way_bf16_align8",
    "equal_4way_deepseek_routing_shared_expert",
    "layer_equal_4way",
    "placement_is_an_expert_map",
    "overflow_4way",
    "overflow_8way_capacity_1",
    "grad_4way_noncontiguous",
    "grad_8way_overflow",
    "equal_4way_ragged",
    "grad_4way_ragged",
    "no_scratch_copies_8way",
    "errors",
    "bench_suite_8way",
)
SUBPROCESS_TIMEOUT_S = 900


# The same checks at n = the GPU count (tests/parallel_checks.py gpu_checks), with --gpu.
GPU_CHECKS = (
    "equal_f32_noncontiguous",
    "equal_f32_fewer_tokens_unrolled",
    "equal_bf16_grouped_gemm_align8",
    "grouped_gemm_in_use",
    "layer_equal",
    "overflow",
    "grad_noncontiguous",
    "grad_overflow",
    "equal_ragged",
    "equal_ragged_bf16_align8",
    "grad_ragged",
    "no_scratch_copies_f32",
    "no_scratch_copies_bf16_grouped_gemm",
    "bench_suite",
)


def run_checks(*flags: str, env: dict) -> dict[str, dict]:
    """Runs tests/parallel_checks.py in a fresh process; check name -> its JSON result."""
    proc = subprocess.run([sys.executable, str(CHECKS_SCRIPT), *flags], env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=CHECKS_SCRIPT.parent.parent)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["name"]] = result
    return results


@pytest.fixture(scope="session")
def eight_devices() -> dict[str, dict]:
    """Runs every check of tests/parallel_checks.py on 8 host CPU devices; name -> its JSON result."""
    return run_checks(env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="session")
def all_gpus() -> dict[str, dict]:
    """Runs the GPU checks on a mesh of every GPU; skips with fewer than 2."""
    count = len(jax.devices("gpu"))  # only reached on a GPU (the marker skips the rest)
    if count < 2:
        pytest.skip(f"needs 2 or more CUDA devices, JAX sees {count}")
    # The child holds its own GPU memory next to this process: no preallocated pool there.
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    return run_checks("--gpu", env={**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})


def test_every_eight_device_check_ran(eight_devices):
    assert set(eight_devices) == set(EIGHT_DEVICE_CHECKS)


@pytest.mark.parametrize("name", EIGHT_DEVICE_CHECKS)
def test_eight_devices(eight_devices, name):
    result = eight_devices.get(name)
    assert result is not None, f"check {name} did not report"
    assert result["ok"], result["detail"]


@pytest.mark.gpu
def test_every_gpu_check_ran(all_gpus):
    assert set(all_gpus) == set(GPU_CHECKS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CHECKS)
def test_all_gpus(all_gpus, name):
    result = all_gpus.get(name)
    assert result is not None, f"check {name} did not report"
    assert result["ok"], result["detail"]


# --- in-process, one device ----------------------------------------------------------------------

E, K, H, F, L, T = 8, 2, 32, 16, 2, 8


def _one_device_mesh(explicit=False):
    if explicit:
        return jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    return Mesh(np.array(jax.devices()[:1]), ("ep",))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto_mesh", "explicit_mesh"])
def test_one_device_mesh_equals_moe_stack(explicit):
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    params = init_moe_params(jax.random.key(0), config, L, F)
    x = jax.random.normal(jax.random.key(1), (T, H), jnp.float32)
    expected, _ = jax.jit(moe_stack)(params, x, init_scratch(config))
    mesh = _one_device_mesh(explicit)
    placement = (3, 1, 0, 2, 7, 6, 5, 4)
    scratch = ep.init_scratch_ep(config, mesh, "ep", placement=placement)
    assert jax.tree.structure(scratch).num_leaves == 6
    step = jax.jit(lambda p, h, s: ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name="ep"), donate_argnums=2)
    y, scratch, dropped = step(ep.shard_params(params, mesh, "ep", placement=placement), x, scratch)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert dropped.shape == (L,) and not np.asarray(dropped).any()
    assert isinstance(scratch, ep.ExpertParallelScratch) and scratch.local.permuted.shape[0] == 1


def test_fp8_params_shard_with_their_scales():
    """FP8 experts' scales travel with their experts (placement and sharding), so EP equals moe_stack."""
    from jax_moe import fp8
    hidden, ffn = 128, 128  # FP8 experts: whole 128-wide scale blocks along K
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=hidden, max_tokens=T, dtype=jnp.float32)
    params = fp8.quantize_params(init_moe_params(jax.random.key(0), config, L, ffn))
    x = jax.random.normal(jax.random.key(1), (T, hidden), jnp.float32)
    expected, _ = jax.jit(moe_stack)(params, x, init_scratch(config))
    mesh = _one_device_mesh(False)
    placement = (3, 1, 0, 2, 7, 6, 5, 4)
    sharded = ep.shard_params(params, mesh, "ep", placement=placement)
    np.testing.assert_array_equal(np.asarray(sharded["gate_up_scale_inv"][:, 0]),
                                  np.asarray(params["gate_up_scale_inv"][:, 2]))  # slot 0 holds expert 2
    y, _, _ = jax.jit(lambda p, h, s: ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name="ep"))(
        sharded, x, ep.init_scratch_ep(config, mesh, "ep", placement=placement))
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_one_device_ragged_exchange_equals_moe_stack_with_gradients():
    """The dropless ragged exchange (lax.ragged_all_to_all on a GPU, where this runs the op itself;
    the whole-block all_to_all on CPU) gives moe_stack's output and gradients."""
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    params = init_moe_params(jax.random.key(4), config, L, F)
    x = jax.random.normal(jax.random.key(5), (T, H), jnp.float32)
    mesh = _one_device_mesh()
    placement = (2, 5, 0, 7, 1, 3, 6, 4)

    def single(p, h):
        return jnp.sum(jnp.sin(moe_stack(p, h, init_scratch(config))[0]))

    def sharded(p, h, s):
        y, s, dropped = ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name="ep")
        return jnp.sum(jnp.sin(y)), (s, dropped)

    with jax.default_matmul_precision("highest"):
        value, grads = jax.jit(jax.value_and_grad(single, argnums=(0, 1)))(params, x)
        scratch = ep.init_scratch_ep(config, mesh, "ep", placement=placement, ragged=True)
        assert scratch.ragged
        step = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True), donate_argnums=2)
        (ep_value, (scratch, dropped)), (d_params, d_x) = step(
            ep.shard_params(params, mesh, "ep", placement=placement), x, scratch)
    assert not np.asarray(dropped).any() and scratch.ragged
    np.testing.assert_allclose(float(ep_value), float(value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(d_x), np.asarray(grads[1]), rtol=1e-5, atol=1e-5)
    order = np.asarray(placement)
    for name in ("router", "gate_up", "down"):
        got = np.asarray(d_params[name])
        got = got if name == "router" else got[:, order]  # slot order -> global expert order
        np.testing.assert_allclose(got, np.asarray(grads[0][name]), rtol=1e-5, atol=1e-5, err_msg=name)


def test_ragged_exchange_lowers_to_ragged_all_to_all_for_gpus():
    """Lowered for CUDA (possible on any machine) the dropless stack sends its rows with
    ragged_all_to_all, out and back, and its gradient transposes both."""
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    params = init_moe_params(jax.random.key(0), config, L, F)
    x = jnp.zeros((T, H), jnp.float32)
    mesh = _one_device_mesh()
    sharded = ep.shard_params(params, mesh, "ep")

    def loss(p, h, s):
        return jnp.sum(ep.moe_stack_ep(p, h, s, mesh=mesh, axis_name="ep")[0])

    for ragged, want in ((True, 2), (False, 0)):
        scratch = ep.init_scratch_ep(config, mesh, "ep", ragged=ragged)
        forward = jax.jit(loss).trace(sharded, x, scratch).lower(lowering_platforms=("cuda",)).as_text()
        backward = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(sharded, x, scratch).lower(
            lowering_platforms=("cuda",)).as_text()
        assert forward.count("ragged_all_to_all") == want, (ragged, forward.count("ragged_all_to_all"))
        assert backward.count("ragged_all_to_all") == 2 * want


def test_one_device_overflow_is_counted():
    # One device: each token's k routes all go to device 0, so C = ceil(0.5 * T * k) keeps the first
    # half of the routes in flat order and drops the rest, in every layer.
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    params = init_moe_params(jax.random.key(0), config, L, F)
    mesh = _one_device_mesh()
    scratch = ep.init_scratch_ep(config, mesh, "ep", capacity_factor=0.5)
    assert scratch.capacity == T * K // 2
    x = jax.random.normal(jax.random.key(1), (T, H), jnp.float32)
    _, _, dropped = ep.moe_stack_ep(ep.shard_params(params, mesh, "ep"), x, scratch, mesh=mesh, axis_name="ep")
    assert np.asarray(dropped).tolist() == [T * K // 2] * L


def test_peer_capacity_and_expert_maps():
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=8, max_tokens=64)
    assert ep.peer_capacity(config, 4, 16, None) == 16 * 4  # min(k, El) = 4
    assert ep.peer_capacity(MoEConfig(num_experts=16, top_k=4, hidden_size=8, max_tokens=64), 8, 16, None) == 32
    assert ep.peer_capacity(config, 4, 16, 1.0) == 16  # the mean load of a peer
    assert ep.peer_capacity(config, 4, 16, 1.3) == 21  # ceil(1.3 * 16)
    assert ep.peer_capacity(config, 4, 16, 100.0) == 64  # never above the no-overflow bound
    assert ep.peer_capacity(config, 4, 1, 0.01) == 1  # at least one row
    placement = (5, 0, 3, 1, 2, 4)  # 6 experts on 3 devices, 2 each
    maps = [ep.device_expert_map(placement, 3, d) for d in range(3)]
    assert maps == [(-1, 0, -1, 1, -1, -1), (-1, -1, 1, -1, 0, -1), (1, -1, -1, -1, -1, 0)]
    for m in maps:  # each a valid MoEConfig.expert_map with E / n local experts
        assert MoEConfig(num_experts=6, top_k=1, hidden_size=8, max_tokens=1, expert_map=m).num_local_experts == 2
    local = ep.local_config(config, 4, 16)
    assert local.expert_map is None and (local.num_experts, local.top_k, local.max_tokens) == (4, 1, 64)


def test_identity_map_is_an_attribute_never_an_empty_operand():
    """An empty expert-map operand crashed jaxlib 0.11.2's compiler inside a shard_map over 2+ GPUs
    (Shardy's ManualComputationUnusedInputsPattern): the identity travels as an attribute with a
    one-element placeholder operand, so no permute call has an empty operand."""
    import jax_moe
    for expert_map, identity, map_type in ((None, "true", "tensor<1xi32>"), ((1, 0, -1, 2), "false", "tensor<4xi32>")):
        config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, max_tokens=4, dtype=jnp.float32,
                           expert_map=expert_map)
        text = jax.jit(jax_moe.permute).lower(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32),
                                              init_scratch(config)).as_text()
        call = next(line for line in text.splitlines() if "jax_moe_permute" in line)
        assert f"identity_map = {identity}" in call, call
        assert map_type in call and "tensor<0x" not in call, call


def test_bad_arguments_raise_value_errors_at_trace_time():
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, max_tokens=T, dtype=jnp.float32)
    mesh = _one_device_mesh()
    with pytest.raises(ValueError, match="placement.*permutation"):
        ep.init_scratch_ep(config, mesh, "ep", placement=(0, 0, 1, 2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="placement.*8 integers"):
        ep.shard_params(init_moe_params(jax.random.key(0), config, L, F), mesh, "ep", placement=(0, 1))
    with pytest.raises(ValueError, match="axis_name"):
        ep.init_scratch_ep(config, mesh, "experts")
    with pytest.raises(ValueError, match=r"shard_params: params: expected a dict with keys .* got dict with keys "
                                         r"\['down', 'router'\]"):
        ep.shard_params({k: v for k, v in init_moe_params(jax.random.key(0), config, L, F).items() if k != "gate_up"},
                        mesh, "ep")
    scratch = ep.init_scratch_ep(config, mesh, "ep")
    params = ep.shard_params(init_moe_params(jax.random.key(0), config, L, F), mesh, "ep")
    with pytest.raises(ValueError, match="x: expected at most 8 tokens"):
        ep.moe_stack_ep(params, jnp.zeros((16, H), jnp.float32), scratch, mesh=mesh, axis_name="ep")
    with pytest.raises(ValueError, match="scratch: expected an ExpertParallelScratch"):
        ep.moe_stack_ep(params, jnp.zeros((T, H), jnp.float32), init_scratch(config), mesh=mesh, axis_name="ep")


def test_parallel_bench_suite_on_one_device(tmp_path):
    rows, notes = parallel_suite.run([MODELS["tiny"]], (2,), common.Clock(), compile_threads=2, layer_counts=(1, 2))
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    # One device, T=2, k=2: cf=2's C (ceil(2*2*2/1) capped at 2*min(k, E)) is no-drop's, so it is not rerun.
    capacities = parallel_suite.distinct_capacities(MODELS["tiny"].config(2), 1, 2)
    assert capacities == ("no-drop",)
    dropless = "lax.ragged_all_to_all: supported" in notes[0]  # a GPU: the ragged exchange runs
    assert {(r["case"], r["capacity"]) for r in rows} == {(c.name, c.capacity or "-")
                                                          for c in parallel_suite.cases(capacities, dropless)}
    for row in rows:
        if row["case"] == "ep":  # T=2, k=2: 4 live routes; no-drop sends its n*C slots, dropless the routes
            want = 4 if row["capacity"] == parallel_suite.DROPLESS else row["C"]
            assert (row["rows_sent"], row["live_rows"]) == (want, 4), row
    assert any("ragged_all_to_all" in n for n in notes)
    for row in rows:
        if row["case"] == "ep":  # dropless has no program of its own without collectives: no-drop's
            rule = "no-drop" if row["capacity"] == parallel_suite.DROPLESS else row["capacity"]
            local = next(r for r in rows if (r["case"], r["capacity"]) == ("ep/no-collective", rule))
            assert row["collectives_us"] == pytest.approx(row["us_per_layer"] - local["us_per_layer"])
            if row["us_per_layer"] > 0:  # CPU noise can make a tiny per-layer difference negative
                assert row["collective_share_pct"] == pytest.approx(100 * row["collectives_us"] / row["us_per_layer"])
    assert "collectives µs" in parallel_suite.table(rows)
    assert any(n.startswith("mesh: 1 device(s); lax.ragged_all_to_all: ") for n in notes), notes


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process(tmp_path):
    """The EP stack across 2 processes (jax.distributed, CPU collectives over gloo, one device each)
    equals the single-device stack: outputs and every gradient (params and x)."""
    from multiprocess_case import case
    worker = pathlib.Path(__file__).with_name("multiprocess_ep.py")
    out = tmp_path / "results.npz"
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device per process
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", port, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0])
        finally:
            proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    got = dict(np.load(out))

    config, params, x, _ = case(2)

    def loss(p, h):
        y, _ = moe_stack(p, h, init_scratch(config))
        return jnp.sum(jnp.sin(y)), y

    (_, y), (d_params, d_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    assert not got["dropped"].any()
    want = {"y": y, "d_x": d_x, **{f"d_{name}": leaf for name, leaf in d_params.items()}}
    assert set(want) <= set(got), sorted(got)
    for name, value in want.items():
        value = np.asarray(value)
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(value).max()),
                                   err_msg=name)
