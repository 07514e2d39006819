"""One scratch through every layer and every step: donation, no copies, memory flat in depth.

Issue 4, items 2-5. The compiled-memory numbers of notebooks/results/stack_memory_cpu.json come
from ``python -m jax_moe.demo --write-memory-series notebooks/results`` (jax_moe.demo.memory_series).
"""

import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import MoEConfig, _native, init_scratch
from jax_moe.demo import compiled_memory
from jax_moe import init_moe_params, moe_layer, moe_stack
from jax_moe.scratch import BUFFER_NAMES

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "results" / "stack_memory_cpu.json"

# Chosen so that no scratch buffer shares its dtype and shape with another array of the program
# (checked below), so a copy of that shape can only be a copy of the scratch.
CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=48, max_tokens=12, dtype=jnp.float32)
FFN = 16


def _hlo_type(shape_dtype) -> str:
    names = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16",
             jnp.dtype(jnp.int32): "s32"}
    return f"{names[jnp.dtype(shape_dtype.dtype)]}[{','.join(map(str, shape_dtype.shape))}]"


def _scratch_types(scratch) -> dict[str, str]:
    from jax_moe.scratch import BUFFER_NAMES
    return {name: _hlo_type(buf) for name, buf in zip(BUFFER_NAMES, scratch.buffers())}


_COPY = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+(copy|copy-start)\(")


def scratch_copies(hlo_text: str, scratch) -> list[str]:
    """HLO instructions that copy an array of a scratch buffer's dtype and shape (any computation)."""
    types = set(_scratch_types(scratch).values())
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _COPY.search(line)) and m.group(1) in types]


def _setup(num_layers=3):
    params = init_moe_params(jax.random.key(0), CONFIG, num_layers, FFN)
    return params, init_scratch(CONFIG)


def test_scratch_buffer_shapes_are_unambiguous():
    types = list(_scratch_types(init_scratch(CONFIG)).values())
    assert len(set(types)) == len(types), types
    # Tokens [T, H] (T = 12 or 5) and the parameters differ from every buffer. (At T = T_max the
    # [T, k] routing ids share dest_index's type; XLA has no reason to copy them.)
    others = {f"f32[{t},{CONFIG.hidden_size}]" for t in (CONFIG.max_tokens, 5)} | {"s32[5,2]"}
    others |= {_hlo_type(p) for p in jax.tree.leaves(_setup()[0])}
    assert not others & set(types), others & set(types)


def test_copy_detector_catches_the_defensive_copies_of_a_non_donated_scratch():
    # Control: without donation XLA must copy the scratch before permute writes it in place
    # (DESIGN.md §4), so the detector below sees real copies when there are some.
    params, scratch = _setup()
    x = jnp.ones((CONFIG.max_tokens, CONFIG.hidden_size), CONFIG.dtype)
    text = jax.jit(lambda p, h, s: moe_stack(p, h, s)).lower(params, x, scratch).compile().as_text()
    found = scratch_copies(text, scratch)
    assert len(found) >= 3, found  # the int buffers at least (permuted may be elided as dead)
    # ...and a scratch still used after permute (two layers reading the same input scratch) too.
    def reuse(p, h, s):
        y1, _ = moe_layer(jax.tree.map(lambda a: a[0], p), h, s)
        y2, s = moe_layer(jax.tree.map(lambda a: a[1], p), h, s)
        return y1 + y2, s
    text = jax.jit(reuse, donate_argnums=2).lower(params, x, scratch).compile().as_text()
    assert scratch_copies(text, scratch)


@pytest.mark.parametrize("num_tokens,unroll", [(12, 1), (5, 1), (12, True), (12, 2)],
                         ids=["T=Tmax", "T<Tmax", "unrolled", "unroll2"])
def test_no_scratch_copies_in_the_donated_stack(num_tokens, unroll):
    params, scratch = _setup()
    x = jnp.ones((num_tokens, CONFIG.hidden_size), CONFIG.dtype)
    step = jax.jit(lambda p, h, s: moe_stack(p, h, s, unroll=unroll), donate_argnums=2)
    compiled = step.lower(params, x, scratch).compile()
    text = compiled.as_text()
    assert "while" in text or unroll is True
    if _native.HAS_CPU if jax.default_backend() == "cpu" else _native.HAS_CUDA:
        assert "jax_moe_permute" in text  # the in-place FFI call, not the reference fallback
    assert scratch_copies(text, scratch) == []
    # Every scratch buffer is aliased input -> output: XLA writes it in place.
    assert compiled.memory_analysis().alias_size_in_bytes == scratch.nbytes


@pytest.mark.skipif(not (_native.HAS_CPU and _native.HAS_CUDA),
                    reason="with a native module missing, lax.platform_dependent keeps the reference branch")
def test_training_scan_carries_no_extra_scratch_shaped_arrays():
    """The forward scan of a training step takes the scratch and nothing else of its shapes.

    Once, ops picked native or reference with lax.platform_dependent even with both modules
    built; autodiff then kept residuals of the reference branch too, and the forward scan took
    nine more int32[R_cap]-like arrays (XLA:GPU copied such arrays ten times in this step).
    """
    params, scratch = _setup()
    x = jnp.ones((CONFIG.max_tokens, CONFIG.hidden_size), CONFIG.dtype)

    def loss(p, h, s):
        y, s = moe_stack(p, h, s)
        return jnp.sum(jnp.square(y)), s
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x, scratch)
    forward = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"][0]
    operand_types = [(jnp.dtype(v.aval.dtype).name, tuple(v.aval.shape)) for v in forward.invars]
    for name, buffer in zip(BUFFER_NAMES, scratch.buffers()):
        buffer_type = (jnp.dtype(buffer.dtype).name, tuple(buffer.shape))
        assert operand_types.count(buffer_type) == 1, (name, buffer_type, operand_types)


def test_no_scratch_copies_in_a_donated_layer_or_training_step():
    params, scratch = _setup()
    x = jnp.ones((CONFIG.max_tokens, CONFIG.hidden_size), CONFIG.dtype)
    layer = jax.jit(moe_layer, donate_argnums=2)
    text = layer.lower(jax.tree.map(lambda a: a[0], params), x, scratch).compile().as_text()
    assert scratch_copies(text, scratch) == []

    def loss(p, h, s):
        y, s = moe_stack(p, h, s)
        return jnp.sum(jnp.square(y)), s
    train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), donate_argnums=2)
    text = train.lower(params, x, scratch).compile().as_text()
    assert scratch_copies(text, scratch) == []
    # One permute per layer, in the rolled forward scan. XLA:GPU's dynamic-slice fusion once
    # cloned it into a second call that wrote the stacked residual (see _ffi.fence_results).
    if _native.HAS_CPU if jax.default_backend() == "cpu" else _native.HAS_CUDA:
        assert text.count('custom_call_target="jax_moe_permute"') == 1, "permute cloned or missing"


def test_donated_steps_reuse_the_same_buffers():
    params, scratch = _setup(num_layers=4)
    step = jax.jit(lambda p, h, s: moe_stack(p, h, s), donate_argnums=2)
    pointers = [b.unsafe_buffer_pointer() for b in scratch.buffers()]
    xs = jax.random.normal(jax.random.key(1), (100, CONFIG.max_tokens, CONFIG.hidden_size), CONFIG.dtype)
    live = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(100):
            y, scratch = step(params, xs[i], scratch)
            assert [b.unsafe_buffer_pointer() for b in scratch.buffers()] == pointers, f"step {i}"
            del y
            if i in (1, 50, 99):
                jax.block_until_ready(scratch)
                arrays = jax.live_arrays()
                live.append((len(arrays), sum(a.nbytes for a in arrays)))
    assert not [w for w in caught if "donated" in str(w.message)], [str(w.message) for w in caught]
    assert live[0] == live[1] == live[2], live  # nothing accumulates across steps
    stats = jax.devices()[0].memory_stats()  # None on CPU; the allocator's bytes in use on GPU
    if stats and "bytes_in_use" in stats:
        in_use = []
        for i in range(20):
            y, scratch = step(params, xs[i], scratch)
            del y
            jax.block_until_ready(scratch)
            in_use.append(jax.devices()[0].memory_stats()["bytes_in_use"])
        assert max(in_use[5:]) <= in_use[4], in_use


def test_temp_memory_is_flat_in_depth_and_per_layer_scratch_grows():
    scratch_bytes = init_scratch(CONFIG).nbytes
    series = {layers: compiled_memory(CONFIG, layers, FFN, variants=("shared", "shared_unrolled", "per_layer"))
              for layers in (2, 8, 32)}
    shared = [series[n]["shared"]["temp_bytes"] for n in (2, 8, 32)]
    # Flat: 30 more layers may not add even one scratch's worth of temporaries.
    assert max(shared) - min(shared) < scratch_bytes / 4, shared
    # The per-layer port holds about a scratch per layer more than the same unrolled program with
    # one scratch (unrolling alone also grows on CPU: XLA relayouts each layer's weights up front).
    extra = [series[n]["per_layer"]["temp_bytes"] - series[n]["shared_unrolled"]["temp_bytes"] for n in (2, 8, 32)]
    assert extra[2] - extra[0] > 0.5 * 30 * scratch_bytes, (extra, scratch_bytes)
    per_layer = [series[n]["per_layer"]["temp_bytes"] for n in (2, 8, 32)]
    assert per_layer[0] < per_layer[1] < per_layer[2]


def test_training_memory_no_worse_than_the_baseline():
    for layers in (2, 6):
        memory = compiled_memory(CONFIG, layers, FFN, variants=("train_shared", "train_baseline"))
        ours, base = memory["train_shared"], memory["train_baseline"]
        assert ours["temp_bytes"] <= 1.02 * base["temp_bytes"], (layers, memory)
        # In total ours also holds the (donated, aliased) scratch itself.
        assert ours["total_bytes"] <= 1.02 * base["total_bytes"] + init_scratch(CONFIG).nbytes, (layers, memory)


def test_committed_memory_series():
    if not RESULTS.exists():
        pytest.skip(f"{RESULTS} not written yet (python -m jax_moe.demo --write-memory-series notebooks/results)")
    result = json.loads(RESULTS.read_text())
    assert result["layers"] == [2, 8, 32]
    series, scratch_bytes = result["series"], result["scratch_bytes"]
    shared = series["shared"]["temp_bytes"]
    assert max(shared) - min(shared) < scratch_bytes / 4
    extra = np.subtract(series["per_layer"]["temp_bytes"], series["shared_unrolled"]["temp_bytes"])
    assert extra[2] - extra[0] > 0.5 * 30 * scratch_bytes
    for i in range(3):
        assert series["train_shared"]["temp_bytes"][i] <= 1.02 * series["train_baseline"]["temp_bytes"][i]
    assert RESULTS.with_suffix(".md").exists()
