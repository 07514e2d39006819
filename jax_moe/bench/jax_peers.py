"""The JAX peers: the grouped GEMMs a JAX user would pick instead of jax_moe's, and the pure-JAX layer on them.

``peers``, each a ``dot(rows [R, K], weights [E, K, N], group_sizes [E]) -> [R, N]`` (float32 accumulation,
differentiable), or why it cannot run here: ``tokamax.ragged_dot`` (``mosaic_gpu`` and ``triton``, default
config, rows padded to its row block; its custom_vjp runs both gradients on the same kernels), Pallas
``ragged_dot_mgpu`` with a backward written here (``transpose_rhs=True`` for d rows,
``transposed_ragged_dot_mgpu`` for d weights) and ``lax.ragged_dot``. GEMM level (``measure_block``, gemm suite):
the SwiGLU expert block of one layer on T*k rows of uneven routing, forward and forward+backward (every output
consumed), jax_moe's on its scratch and plan. Layer level (train and decode suites):
``baseline.baseline_moe_stack`` (MaxText's shape) with ``expert_fn=swiglu_on(dot)``. Each peer is checked against
float32 ``lax.ragged_dot`` (``check``) first; one that fails is reported, not timed.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
from jax import lax

import jax_moe
from jax_moe import baseline, experts, routing
from jax_moe.bench import common
from jax_moe.bench.models import ROW_DTYPE
from jax_moe.gemm import gated_silu

MGPU_MAX_EXPERTS = 128  # its grid has a step per group and row block: compile time grows with E
MGPU_CONFIGS = ({"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
                {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2})
LAYER_PEERS = ("tokamax/mosaic_gpu", "pallas_mgpu")  # the layer-level rows: baseline/<peer>
PASSES = {"forward": 1, "forward+backward": 3}  # pass -> its FLOPs over the forward's (a backward: twice them)
ROUTING_SKEW = 1.0  # std of each expert's popularity added to the tokens' N(0, 1) router scores: uneven loads
CHECK_TOLERANCE = 2e-2  # max |peer - reference| / max |reference|, each of out, d rows, d gate/up, d down
CHECK_BYTES = 1 << 30  # ragged_dot's weight gradient is a dense [rows, E, N] float32: the check's token cap
CHECK_WEIGHT_BYTES = 4 << 30  # the float32 gate/up gradient the check compares: its expert cap (DeepSeek-V3: 36)
TOKAMAX_ROW_BLOCK = 64  # tokamax's sm90 kernels take whole row blocks; MaxText pads its gmm rows to its tile too
# rows x E past which the ragged_dot block is not timed: forward (seconds a call), forward+backward (its dense
# weight gradient, as train_suite.BASELINE_MAX_ROWS_X_EXPERTS).
RAGGED_DOT_MAX_ROWS_X_EXPERTS = {"forward": 16384 * 256, "forward+backward": 1024 * 8 * 128}


def _stand_in_for_xprof():
    """tokamax imports xprof (32 MB) only to benchmark itself: empty modules, with specs, where it is missing."""
    if "xprof" in sys.modules or importlib.util.find_spec("xprof") is not None:
        return
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        module = types.ModuleType(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None, is_package=True), []
        sys.modules[name] = module
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None


@functools.cache
def _import_tokamax():
    _stand_in_for_xprof()
    import tokamax
    from tokamax._src.ops.ragged_dot import api
    return tokamax, api.IMPLEMENTATIONS


def tokamax_dot(implementation: str):
    """``tokamax.ragged_dot`` on the rows padded with zeros to whole TOKAMAX_ROW_BLOCKs (in no group), as a
    tokamax user pads them: its kernels reject other row counts at trace time."""
    def dot(rows, weights, sizes):
        tokamax, _ = _import_tokamax()
        padded = jnp.pad(rows, ((0, -rows.shape[0] % TOKAMAX_ROW_BLOCK), (0, 0)))
        return tokamax.ragged_dot(padded, weights, sizes, implementation=implementation)[:rows.shape[0]]
    return dot


def ragged_dot(rows, weights, sizes, out_dtype=None):
    out = lax.ragged_dot(rows, weights, sizes, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or rows.dtype)


def _mgpu_kernels():
    """``(ragged_dot, transposed_ragged_dot)`` of Pallas Mosaic GPU (the import fails where Pallas does not run)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mgpu_dot(rows, weights, sizes, config: int):
    return _mgpu_kernels()[0](rows, weights, group_sizes=sizes, **MGPU_CONFIGS[config])


def _mgpu_dot_fwd(rows, weights, sizes, config):
    return _mgpu_dot(rows, weights, sizes, config), (rows, weights, sizes)


def _mgpu_dot_bwd(config, residuals, d_out):
    rows, weights, sizes = residuals
    forward, transposed = _mgpu_kernels()
    d_out = d_out.astype(rows.dtype)
    d_rows = forward(d_out, weights, group_sizes=sizes, transpose_rhs=True, **MGPU_CONFIGS[config])
    d_weights = transposed(rows, d_out, group_sizes=sizes, **MGPU_CONFIGS[config])  # rows_g^T @ d_out_g, [E, K, N]
    return d_rows, d_weights.astype(weights.dtype), None


_mgpu_dot.defvjp(_mgpu_dot_fwd, _mgpu_dot_bwd)


def mgpu_dot(rows, weights, sizes):
    """``ragged_dot_mgpu``, the larger row block where experts average 128 rows or more."""
    return _mgpu_dot(rows, weights, sizes, int(rows.shape[0] >= 128 * weights.shape[0]))


def peers(num_experts: int) -> dict:
    """name -> ``dot``, or why it does not run here."""
    gpu = jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind
    out = {"ragged_dot": ragged_dot}
    try:
        _, implementations = _import_tokamax()
    except Exception as e:  # not installed, or an import error
        why = f"not run: tokamax does not import: {common.describe_error(e)}"
        out["tokamax/mosaic_gpu"] = out["tokamax/triton"] = why
    else:
        out["tokamax/mosaic_gpu"] = tokamax_dot("mosaic_gpu") if gpu else "not run: needs an NVIDIA GPU"
        triton = next((d.version for d in importlib.metadata.distributions(name="triton")), "absent")
        out["tokamax/triton"] = (tokamax_dot("triton") if gpu and "triton" in implementations else
                                 f"not run: tokamax's Triton ragged_dot needs jax_triton and triton >= 3.8 (triton "
                                 f"{triton} here)" + ("" if gpu else " and an NVIDIA GPU"))
    out["pallas_mgpu"] = (mgpu_dot if gpu and num_experts <= MGPU_MAX_EXPERTS else
                          "not run: needs an NVIDIA GPU" if not gpu else f"not run: E > {MGPU_MAX_EXPERTS}")
    out["transformer_engine"] = "not run: not among the peers here (a 276 MB core wheel, a JAX extension to compile)"
    return out


def swiglu(dot, rows, gate_up, down, sizes):
    """The SwiGLU experts on ``dot``: [R, H] of rows' dtype, the activation in float32 (as jax_moe's)."""
    return dot(gated_silu(dot(rows, gate_up, sizes), rows.dtype), down, sizes)


def swiglu_on(dot):
    """An ``expert_fn`` for ``baseline.baseline_moe_stack``: the SwiGLU experts on ``dot``."""
    def expert_fn(layer_params, rows, sizes):
        return swiglu(dot, rows, layer_params["gate_up"].astype(rows.dtype), layer_params["down"].astype(rows.dtype),
                      sizes)
    return expert_fn


def uneven_ids(key, tokens: int, num_experts: int, top_k: int) -> jax.Array:
    """[T, k] expert ids of top-k routing on scores skewed per expert by ROUTING_SKEW (trained routers are uneven)."""
    token_key, expert_key = jax.random.split(key)
    scores = jax.random.normal(token_key, (tokens, num_experts)) + ROUTING_SKEW * jax.random.normal(expert_key,
                                                                                                   (num_experts,))
    return lax.top_k(scores, top_k)[1]


def check(dot, x, ids, gate_up, down, caps=(CHECK_BYTES, CHECK_WEIGHT_BYTES)) -> dict[str, str | None]:
    """Per pass of PASSES, None where the SwiGLU block on ``dot`` agrees with float32-accumulating ragged_dot's
    within CHECK_TOLERANCE, else what differs (or the error that stopped the check): the forward by its out,
    forward+backward also by the rows' and both weights' gradients for a random cotangent (a wrong weight
    gradient does not void a forward's row). On the first tokens of ``x`` (ids [T, k]) whose reference gradient
    fits ``caps[0]`` bytes, routed onto the first experts whose float32 weight gradients fit ``caps[1]`` (ids
    modulo their count)."""
    try:
        errors, tokens = _relative_errors(dot, x, ids, gate_up, down, caps)
    except Exception as e:
        return dict.fromkeys(PASSES, f"check failed: {common.describe_error(e)}")

    def verdict(names):
        bad = [f"{name} {errors[name]:.3g}" for name in names if not errors[name] <= CHECK_TOLERANCE]
        return bad and f"check failed on {tokens} tokens (relative error > {CHECK_TOLERANCE}): {', '.join(bad)}" or None
    return dict(zip(PASSES, (verdict(["out"]), verdict(errors))))


def _relative_errors(dot, x, ids, gate_up, down, caps) -> tuple[dict[str, float], int]:
    (max_bytes, max_weight_bytes), (_, hidden, width) = caps, gate_up.shape
    num_experts = max(1, min(gate_up.shape[0], max_weight_bytes // (4 * hidden * width)))
    gate_up, down, ids = gate_up[:num_experts], down[:num_experts], ids % num_experts
    tokens = max(1, min(x.shape[0], max_bytes // (4 * ids.shape[1] * num_experts * max(hidden, width))))
    rows, sizes, _ = baseline.argsort_permute(x[:tokens], ids[:tokens], num_experts)
    cotangent = jax.random.normal(jax.random.key(1), rows.shape, rows.dtype)

    def results(dot):
        def block(rows, gate_up, down, sizes, cotangent):
            out, vjp = jax.vjp(lambda r, a, b: swiglu(dot, r, a, b, sizes), rows, gate_up, down)
            return out, *vjp(cotangent.astype(out.dtype))
        return jax.jit(block)(rows, gate_up, down, sizes, cotangent)

    want, got = results(functools.partial(ragged_dot, out_dtype=jnp.float32)), results(dot)
    relative = jax.jit(lambda g, w: jnp.max(jnp.abs(g.astype(jnp.float32) - w))
                        / jnp.maximum(jnp.max(jnp.abs(w)), jnp.finfo(jnp.float32).tiny))  # fused: no f32 copy
    names = ("out", "d rows", "d gate_up", "d down")
    return {name: float(relative(g, w)) for name, g, w in zip(names, got, want)}, tokens


def _step(experts_fn, training: bool):
    """``fn(rows, gate_up, down, aux, cotangent) -> (out, operands)`` for ``common.loop_seconds``:
    the block's output, and with ``training`` the gradients of rows and both weights too."""
    def step(rows, gate_up, down, aux, cotangent):
        if not training:
            out, aux = experts_fn(rows, gate_up, down, aux)
            return out, (rows, gate_up, down, aux, cotangent)
        out, vjp, aux = jax.vjp(lambda r, a, b: experts_fn(r, a, b, aux), rows, gate_up, down, has_aux=True)
        return (out, vjp(cotangent.astype(out.dtype))), (rows, gate_up, down, aux, cotangent)
    return step


def measure_block(model, tokens: int, clock, notes, copy_gbs, dense_tflops) -> list[dict]:
    """The SwiGLU expert block of one layer, forward and forward+backward: jax_moe and each of ``peers``."""
    config, key = model.config(tokens), jax.random.key(tokens + 1)
    hidden, width, num_experts = model.hidden_size, model.ffn_size, model.num_experts
    ids = uneven_ids(key, tokens, num_experts, model.top_k)
    x = jax.random.normal(key, (tokens, hidden), ROW_DTYPE)
    gate_up, down = ((jax.random.normal(jax.random.fold_in(key, i), shape) / shape[1] ** 0.5).astype(ROW_DTYPE)
                     for i, shape in ((1, (num_experts, hidden, 2 * width)), (2, (num_experts, width, hidden))))
    rows, sizes, _ = jax.jit(baseline.argsort_permute, static_argnums=2)(x, ids, num_experts)
    scratch = jax.jit(jax_moe.permute)(x, ids, jax_moe.init_scratch(config))
    layer = {"router": jnp.zeros((hidden, num_experts), ROW_DTYPE), "gate_up": gate_up, "down": down}
    flops, expert_bytes = 2 * tokens * model.top_k * hidden * 3 * width, 3 * hidden * width * 2
    active = int((sizes > 0).sum())
    weight_bytes = {"forward": active * expert_bytes,
                    "forward+backward": common.training_weight_bytes(active, num_experts, expert_bytes)}
    results = []
    for name, dot in {"jax_moe": None, **peers(num_experts)}.items():
        if isinstance(dot, str):
            notes.append(f"{model.name} T={tokens}: block {name} {dot}")
            clock.log(notes[-1])
            continue
        checked = {} if dot is None else check(dot, x, ids, gate_up, down)
        for passes, scale in PASSES.items():
            if name == "ragged_dot" and tokens * model.top_k * num_experts > RAGGED_DOT_MAX_ROWS_X_EXPERTS[passes]:
                notes.append(f"{model.name} T={tokens}: block ragged_dot {passes} not run (rows x E > "
                             f"{RAGGED_DOT_MAX_ROWS_X_EXPERTS[passes]})")
                continue
            row = {"model": model.name, "T": tokens, "rows": tokens * model.top_k, "impl": name, "pass": passes,
                   "flops": scale * flops,
                   **common.roofline(weight_bytes[passes], scale * flops, copy_gbs, dense_tflops)}
            try:
                if checked.get(passes):
                    raise RuntimeError(checked[passes])
                if dot is None:
                    block = jax_moe_block(jax_moe.plan_layer(config, tokens, layer, training=scale > 1), layer, x)
                    operands = (scratch.permuted, gate_up, down, scratch)
                else:
                    block = lambda r, a, b, s, dot=dot: (swiglu(dot, r, a, b, s), s)  # noqa: E731
                    operands = (rows, gate_up, down, sizes)
                out_rows = config.live_row_bound(tokens) if dot is None else rows.shape[0]
                cotangent = jax.random.normal(jax.random.fold_in(key, 3), (out_rows, hidden), ROW_DTYPE)
                timed = common.loop_seconds(_step(block, scale > 1), (*operands, cotangent))
                row.update(us=timed["s"] * 1e6, spread_us=timed["spread_s"] * 1e6, repeats=timed["repeats"])
                row.update(tflops=row["flops"] / row["us"] / 1e6)
                row["roofline_pct"] = row.get("roofline_us") and 100 * row["roofline_us"] / row["us"]
            except Exception as e:  # recorded (a failed check, out of memory...); the other peers still run
                row["error"] = checked.get(passes) or common.describe_error(e)
            clock.log(f"gemm block {model.name} T={tokens} {name} {passes}: {common.outcome(row, 'us')}")
            results.append(row)
    return results


def jax_moe_block(plan, layer: dict, x):
    """``block(rows, gate_up, down, scratch) -> (out, scratch)``: jax_moe's experts as ``plan`` runs them."""
    def block(rows, gate_up, down, scratch):
        out, _, scratch = experts.run_experts(plan, {**layer, "gate_up": gate_up, "down": down},
                                              scratch.replace(permuted=rows), x)
        return out, scratch
    return block


def layer_peers(model, params=None, x=None, config=None, passes: str = "forward+backward") -> dict:
    """name -> ``expert_fn`` for each of LAYER_PEERS, or why it does not run here (``not run: ...``) or
    its failed ``check`` of ``passes`` on the first layer's experts and routing of ``x`` [T, H] (with params)."""
    out, available = {}, peers(model.num_experts)
    for name in LAYER_PEERS:
        dot = available[name]
        if params is not None and not isinstance(dot, str):
            bias = params.get("router_bias")
            ids = jax.jit(lambda p, b, x: routing.route(p["router"][0], x, config, b)[1])(
                params, None if bias is None else bias[0], x)
            dot = check(dot, x, ids, params["gate_up"][0].astype(x.dtype),
                           params["down"][0].astype(x.dtype))[passes] or dot
        out[f"baseline/{name}"] = dot if isinstance(dot, str) else swiglu_on(dot)
    return out


def table(rows: list[dict]) -> str:
    """The SwiGLU block: each implementation's µs, jax_moe's TFLOP/s and % of roofline, each peer / jax_moe."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    columns = [(f"{impl} µs", common.cell(impl, "us")) for impl in impls]
    columns += [("jax_moe TFLOP/s", common.cell("jax_moe", "tflops")),
                ("jax_moe % roofline", common.cell("jax_moe", "roofline_pct", common.fmt_pct))]
    columns += [(f"{impl} TFLOP/s (% roofline)", common.cell(impl, "tflops", pct="roofline_pct")) for impl in impls[1:]]
    columns += [(f"{impl} / jax_moe", common.speedup(impl, "jax_moe", "us")) for impl in impls[1:]]
    title = "SwiGLU expert block (gate/up, SwiGLU, down), uneven routing:\n\n"
    return title + common.pivot(rows, ("model", "T", "pass"), columns)
