"""Which kernels a layer call runs, decided once: ``LayerPlan`` and ``plan_layer``.

A ``LayerPlan`` is computed once per ``moe_layer`` / ``moe_stack`` call from the config, the token
count, the platform and the params' kind (bf16 or FP8 experts, a shared expert or not), with the
thresholds of ``jax_moe.tuning``. The layer's steps (``jax_moe.pipeline``) read it and ask nothing
again. Print one to see what a shape runs; pass one (``plan=``, edited with ``.replace``) to pin a
path::

    plan = jax_moe.plan_layer(config, num_tokens=16, params=params)
    print(plan)
    y, scratch = jax_moe.moe_layer(layer_params, x, scratch, plan=plan.replace(tile="small"))

The choice rules (``pick_tile``, ``decode_rows_per_pass``, ``fp8_decode_rows``, ``fp8_tile_rows``)
live here too, so a tuning change touches this module and ``jax_moe.tuning`` only.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_moe import _native, fp8, ops, routing
from jax_moe.config import MoEConfig
from jax_moe.scratch import GROUPED_MATMUL_ALIGN, GROUPED_MATMUL_DTYPES, ROUTING_TILE
from jax_moe.tuning import DEFAULT_TUNING, Tuning

# Kernel limits (what the kernels can run, not tuning; cuda/constants.h).
DECODE_MAX_ROWS_PER_PASS = _native.constants.DECODE_GEMM_MAX_ROWS_PER_PASS  # rows staged per pass over weights
FP8_DECODE_MAX_K = _native.constants.FP8_DECODE_MAX_K  # the FP8 decode kernel stages K in shared memory
FP8_DECODE_MAX_SHARED_ROWS = _native.constants.FP8_DECODE_MAX_SHARED_ROWS  # a riding shared expert's tokens
FP8_TILE_ROWS = (64, 128)  # the FP8 CUTLASS row tiles: ping-pong 64, cooperative 128

TILES = ("small", "medium", "large", "decode")
ROUTERS = ("xla", "kernel")
PERMUTES = ("plain", "prefetch", "fp8_quantize")
EXPERTS = ("ragged_dot", "grouped_gemm", "fp8_grouped_gemm", "custom")
SHARED = ("none", "xla", "decode_kernel", "routed_launch", "fp8_grouped_gemm", "fp8_dequantized", "fp8_routed_launch")
# The shared expert's choices that run inside the routed experts' launches.
SHARED_IN_ROUTED_LAUNCH = ("routed_launch", "fp8_routed_launch")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """The kernels of one layer call (static: hashable, printable, comparable).

    Attributes:
      num_tokens: T, the tokens of the call the plan was made for.
      router: ``"xla"`` (``routing.route_logits`` of XLA's logits) or ``"kernel"`` (the one-launch
        CUDA router, ``routing.route_decode``).
      norm_in_router: with the kernel router, a stack's pre-norm runs in the router's launch.
      permute: ``"plain"``; ``"prefetch"`` (the permute's launch also starts each routed expert's
        first ``prefetch_bytes`` of gate/up weights towards L2); ``"fp8_quantize"`` (the permute
        writes the FP8 rows the FP8 GEMMs read, not bf16 rows).
      experts: ``"ragged_dot"`` (``gemm.grouped_dot``), ``"grouped_gemm"`` (the CUDA bf16 grouped
        GEMMs and decode kernel), ``"fp8_grouped_gemm"`` (the CUDA FP8 ones), ``"custom"`` (the
        caller's ``expert_fn``).
      tile: the bf16 grouped GEMM's configuration (``TILES``), ``"decode"`` being the decode kernel;
        None off the bf16 grouped GEMMs.
      decode_rows_per_pass: the decode kernel's rows per pass over an expert's weights (0 off it).
      fp8_tile_rows: the FP8 CUTLASS row tile (0 off the FP8 GEMMs).
      fp8_decode_rows_per_pass: the FP8 decode kernel's rows per pass; 0: the FP8 CUTLASS GEMMs.
      shared: the shared expert's path (``SHARED``): ``"none"`` without one; ``"xla"`` (XLA's dots);
        ``"decode_kernel"`` (launches of its own on the decode kernel); ``"routed_launch"`` /
        ``"fp8_routed_launch"`` (its weights stream in the routed experts' decode launches);
        ``"fp8_grouped_gemm"`` / ``"fp8_dequantized"`` (an FP8 shared expert as one group of T rows).
      shared_decode_rows_per_pass, shared_fp8_tile_rows, shared_fp8_decode_rows_per_pass: the
        shared expert's kernel parameters, as the routed experts' above (in launches of its own;
        riding the routed launches, the decode kernel passes enough rows for both).
      residual_in_unpermute: a residual add (and the shared expert's) ride unpermute's launch.
      activations_in_gradient: a training stack keeps each layer's saved activations inside its
        gate/up weight gradient's buffer (``jax_moe.stack``), when they fit.
    """

    num_tokens: int
    router: str = "xla"
    norm_in_router: bool = False
    permute: str = "plain"
    prefetch_bytes: int = 0
    experts: str = "ragged_dot"
    tile: str | None = None
    decode_rows_per_pass: int = 0
    fp8_tile_rows: int = 0
    fp8_decode_rows_per_pass: int = 0
    shared: str = "none"
    shared_decode_rows_per_pass: int = 0
    shared_fp8_tile_rows: int = 0
    shared_fp8_decode_rows_per_pass: int = 0
    residual_in_unpermute: bool = True
    activations_in_gradient: bool = False

    def __post_init__(self):
        for name, allowed in (("router", ROUTERS), ("permute", PERMUTES), ("experts", EXPERTS), ("shared", SHARED),
                              ("tile", TILES + (None,))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LayerPlan: {name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.experts == "grouped_gemm" and self.tile is None:
            raise ValueError("LayerPlan: tile: expected one of the tiles for experts='grouped_gemm', got None")
        if self.tile == "decode" and not 1 <= self.decode_rows_per_pass <= DECODE_MAX_ROWS_PER_PASS:
            raise ValueError(f"LayerPlan: decode_rows_per_pass: expected 1..{DECODE_MAX_ROWS_PER_PASS} with the "
                             f"decode tile, got {self.decode_rows_per_pass}")
        if self.experts == "fp8_grouped_gemm" and self.fp8_tile_rows not in FP8_TILE_ROWS:
            raise ValueError(f"LayerPlan: fp8_tile_rows: expected one of {FP8_TILE_ROWS} with FP8 experts, "
                             f"got {self.fp8_tile_rows}")
        if self.permute == "fp8_quantize" and (self.experts != "fp8_grouped_gemm" or self.fp8_decode_rows_per_pass):
            raise ValueError("LayerPlan: permute: 'fp8_quantize' feeds the FP8 CUTLASS GEMMs only "
                             "(experts='fp8_grouped_gemm', fp8_decode_rows_per_pass=0)")
        if self.shared == "routed_launch" and self.tile != "decode":
            raise ValueError("LayerPlan: shared: 'routed_launch' rides the decode kernel (tile='decode')")
        if self.shared == "fp8_routed_launch" and not self.fp8_decode_rows_per_pass:
            raise ValueError("LayerPlan: shared: 'fp8_routed_launch' rides the FP8 decode kernel "
                             "(fp8_decode_rows_per_pass > 0)")

    def replace(self, **fields) -> "LayerPlan":
        """A copy with ``fields`` changed (checked as a new plan)."""
        return dataclasses.replace(self, **fields)

    def for_training(self) -> "LayerPlan":
        """The plan of a stack's training forward: the router in XLA (its backward recomputes the
        routing and must find the same ids), no prefetch, the shared expert in launches of its own,
        the adds apart (the backward needs the layer output's parts)."""
        shared = {"routed_launch": "decode_kernel", "fp8_routed_launch": "fp8_grouped_gemm"}.get(self.shared,
                                                                                                   self.shared)
        return self.replace(router="xla", norm_in_router=False, permute="plain", prefetch_bytes=0, shared=shared,
                            residual_in_unpermute=False)


# --- the choice rules -----------------------------------------------------------------------------

def expected_owning_experts(num_rows: int, num_groups: int) -> float:
    """Experts expected to own rows when num_rows rows fall uniformly on num_groups experts (at least
    one, when there are rows)."""
    if num_rows <= 0:
        return 0.0
    owning = num_groups * -math.expm1(num_rows * math.log1p(-1.0 / num_groups)) if num_groups > 1 else 1.0
    return max(owning, 1.0)


def expected_rows_per_expert(num_rows: int, num_groups: int) -> float:
    """Rows each expert that owns any expects when num_rows rows fall uniformly on num_groups experts."""
    return num_rows / max(expected_owning_experts(num_rows, num_groups), 1.0)


def pick_tile(num_rows: int, num_groups: int, group_rows: int | None = None, *, tuning: Tuning = DEFAULT_TUNING,
              decode_kernel: bool = True, expert_bytes: float | None = None) -> str:
    """The bf16 grouped GEMM's tile (``TILES``) for at most num_rows live rows over num_groups experts.

    group_rows: the most rows one expert can own (T with distinct experts per token), when known:
    the decode kernel is taken only up to ``decode_max_group_rows`` of them, or, over at least
    ``decode_many_experts`` experts, while each owning one expects at most
    ``decode_fine_max_rows_per_expert`` (``decode_light_max_rows_per_expert`` where the owning
    experts of ``expert_bytes`` each, when given, weigh at most ``decode_light_max_bytes``).
    decode_kernel=False: never the decode kernel.
    """
    expected = expected_rows_per_expert(num_rows, num_groups)
    light = expert_bytes is not None and (
        expected_owning_experts(num_rows, num_groups) * expert_bytes <= tuning.decode_light_max_bytes)
    fine_limit = tuning.decode_light_max_rows_per_expert if light else tuning.decode_fine_max_rows_per_expert
    if decode_kernel and expected <= tuning.decode_max_rows_per_expert and (
            group_rows is None or group_rows <= tuning.decode_max_group_rows
            or (num_groups >= tuning.decode_many_experts and expected <= fine_limit)):
        return "decode"
    rows_per_expert = num_rows / max(1, min(num_groups, num_rows))
    if rows_per_expert >= tuning.large_tile_min_rows_per_expert:
        return "large"
    return "medium" if rows_per_expert >= tuning.medium_tile_min_rows_per_expert else "small"


def decode_rows_per_pass(num_rows: int, num_groups: int, group_rows: int | None = None, *,
                         tuning: Tuning = DEFAULT_TUNING) -> int:
    """The decode kernel's rows per pass over an expert's weights: 1, 2, 4 or 8.

    Enough for group_rows when given and at most ``decode_max_group_rows``, else for the rows an
    owning expert expects: an expert with more rows takes more passes, blocks that run beside each
    other, so that the later ones can read its weights from L2.
    """
    wanted = (group_rows if group_rows is not None and group_rows <= tuning.decode_max_group_rows
              else expected_rows_per_expert(num_rows, num_groups) - 0.1)
    return next(rows for rows in (1, 2, 4, 8) if rows >= wanted or rows == DECODE_MAX_ROWS_PER_PASS)


def fp8_decode_rows(num_rows: int, num_groups: int, hidden_size: int, ffn_size: int, *,
                    tuning: Tuning = DEFAULT_TUNING) -> int:
    """The FP8 SwiGLU's kernel for num_rows live rows over num_groups experts of sizes H, F: the FP8
    decode kernel's rows per pass (8), or 0 for the CUTLASS FP8 grouped GEMMs (more rows per expert
    or more weight bytes than the tuning allows, or H or F past ``FP8_DECODE_MAX_K``)."""
    weight_bytes = expected_owning_experts(num_rows, num_groups) * 3 * hidden_size * ffn_size
    rows_per_expert = expected_rows_per_expert(num_rows, num_groups)
    if rows_per_expert > tuning.fp8_decode_max_rows_per_expert or max(hidden_size, ffn_size) > FP8_DECODE_MAX_K:
        return 0
    if weight_bytes > tuning.fp8_decode_max_bytes and (
            weight_bytes > tuning.fp8_decode_large_max_bytes
            or rows_per_expert > tuning.fp8_decode_large_max_rows_per_expert):
        return 0
    return 8


def fp8_tile_rows(num_rows: int, num_groups: int, *, tuning: Tuning = DEFAULT_TUNING) -> int:
    """The FP8 CUTLASS GEMM's row tile: 64 while the average group holds at most
    ``fp8_small_tile_max_rows_per_group`` rows, else 128."""
    return 64 if num_rows <= tuning.fp8_small_tile_max_rows_per_group * num_groups else 128


def supports_swiglu(dtype, hidden_size: int, ffn_size: int) -> bool:
    """Whether the CUDA kernels take a bf16 SwiGLU expert of these sizes on rows of this dtype."""
    return (jnp.dtype(dtype) in GROUPED_MATMUL_DTYPES
            and hidden_size % GROUPED_MATMUL_ALIGN == 0 and ffn_size % GROUPED_MATMUL_ALIGN == 0)


def supports_fp8(hidden_size: int, ffn_size: int) -> bool:
    """Whether the CUDA FP8 kernels take FP8 experts of these sizes (both multiples of 128)."""
    return hidden_size % fp8.BLOCK == 0 and ffn_size % fp8.BLOCK == 0


def default_platform() -> str:
    """``"cuda"`` where the default backend is a GPU and the CUDA module is built, else the backend's
    name (``"cpu"``, or ``"gpu"`` without the CUDA module: the layers then run XLA's kernels)."""
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" and _native.HAS_CUDA else backend


# --- the plan -------------------------------------------------------------------------------------

def _shared_ffn_size(params: dict) -> int:
    return params["shared_down"].shape[-1 if fp8.shared_is_quantized(params) else -2]


def _shared_apart(config: MoEConfig, num_tokens: int, params: dict, gpu: bool, tuning: Tuning,
                  fp8_decode_kernel: bool) -> dict:
    """The shared expert's path when it runs in launches of its own, with its kernel parameters."""
    if "shared_gate_up" not in params:
        return {"shared": "none"}
    hidden, shared_ffn = config.hidden_size, _shared_ffn_size(params)
    if fp8.shared_is_quantized(params):
        if gpu and config.dtype == jnp.bfloat16 and supports_fp8(hidden, shared_ffn):
            decode = fp8_decode_rows(num_tokens, 1, hidden, shared_ffn, tuning=tuning) if fp8_decode_kernel else 0
            return {"shared": "fp8_grouped_gemm", "shared_fp8_decode_rows_per_pass": decode,
                    "shared_fp8_tile_rows": fp8_tile_rows(num_tokens, 1, tuning=tuning)}
        return {"shared": "fp8_dequantized"}
    if gpu and num_tokens <= tuning.shared_decode_max_tokens and supports_swiglu(config.dtype, hidden, shared_ffn):
        return {"shared": "decode_kernel",
                "shared_decode_rows_per_pass": decode_rows_per_pass(num_tokens, 1, num_tokens, tuning=tuning)}
    return {"shared": "xla"}


def plan_layer(config: MoEConfig, num_tokens: int, params: dict, *, expert_fn=None, training: bool = False,
               platform: str | None = None, tuning: Tuning = DEFAULT_TUNING, decode_kernels: bool = True,
               fp8_decode_kernel: bool = True, shared_in_decode_launch: bool = True, prefetch: bool = True,
               quantize_in_permute: bool = True, router_kernel: bool = True, router_normalizes: bool = True,
               residual_in_unpermute: bool = True) -> LayerPlan:
    """The kernels a layer call of ``num_tokens`` tokens runs.

    Args:
      config: the scratch's ``MoEConfig``.
      num_tokens: T, the call's token count (all leading axes of x).
      params: the layer's params, or a stack's (leading layer axis): only their names, dtypes and
        trailing shapes are read (bf16 or FP8 experts, F, a shared expert and its width).
      expert_fn: the caller's experts, if any (the plan's experts are then ``"custom"``).
      training: the plan of a stack's training forward (``LayerPlan.for_training``).
      platform: ``"cuda"`` plans the CUDA kernels (a GPU with the CUDA module), anything else XLA's;
        None: ``default_platform()``. (Plans for "cuda" can be printed on any machine.)
      tuning: the thresholds (``jax_moe.tuning``).
      decode_kernels, fp8_decode_kernel, shared_in_decode_launch, prefetch, quantize_in_permute,
      router_kernel, router_normalizes, residual_in_unpermute: False switches that choice off (for
        comparisons; each is on where it applies by default).

    Returns:
      A ``LayerPlan``. On a GPU with the CUDA module and bf16 (or FP8) experts of aligned sizes the
      experts run on the CUDA grouped GEMMs, elsewhere on ``ragged_dot``.
    """
    if not isinstance(config, MoEConfig):
        raise ValueError(f"plan_layer: config: expected a MoEConfig, got {type(config).__name__}")
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"plan_layer: num_tokens: expected a positive int, got {num_tokens!r}")
    if not isinstance(params, dict) or not {"router", "gate_up", "down"} <= set(params):
        raise ValueError("plan_layer: params: expected a dict with 'router', 'gate_up' and 'down' "
                         "(init_moe_params' layout)")
    gpu = (default_platform() if platform is None else platform) == "cuda"
    hidden, num_local, top_k = config.hidden_size, config.num_local_experts, config.top_k
    quantized = fp8.is_quantized(params)
    ffn = fp8.ffn_size(params)
    num_rows, group_rows = config.live_row_bound(num_tokens), config.group_row_bound(num_tokens)

    fields: dict = {"num_tokens": num_tokens, "residual_in_unpermute": residual_in_unpermute}
    if expert_fn is not None:
        fields["experts"] = "custom"
    elif gpu and supports_swiglu(config.dtype, hidden, ffn) and (not quantized or supports_fp8(hidden, ffn)):
        fields["experts"] = "fp8_grouped_gemm" if quantized else "grouped_gemm"
    experts = fields.get("experts", "ragged_dot")

    if experts == "grouped_gemm":
        tile = pick_tile(num_rows, num_local, group_rows, tuning=tuning, decode_kernel=decode_kernels,
                         expert_bytes=3 * hidden * ffn * jnp.dtype(config.dtype).itemsize)
        fields["tile"] = tile
        if tile == "decode":
            fields["decode_rows_per_pass"] = decode_rows_per_pass(num_rows, num_local, group_rows, tuning=tuning)
    if experts == "fp8_grouped_gemm":
        fields["fp8_tile_rows"] = fp8_tile_rows(num_rows, num_local, tuning=tuning)
        if fp8_decode_kernel:
            fields["fp8_decode_rows_per_pass"] = fp8_decode_rows(num_rows, num_local, hidden, ffn, tuning=tuning)

    if (router_kernel and gpu and num_tokens <= tuning.router_kernel_max_tokens
            and routing.decode_route_sizes_fit(config, num_tokens, params["router"].dtype)):
        fields["router"] = "kernel"
        fields["norm_in_router"] = router_normalizes

    if (prefetch and fields.get("tile") == "decode" and jnp.dtype(params["gate_up"].dtype) == config.dtype):
        layer_gate_up = jax.ShapeDtypeStruct(params["gate_up"].shape[-3:], params["gate_up"].dtype)
        nbytes = ops.prefetch_bytes_per_route(num_tokens * top_k, layer_gate_up, tuning.prefetch_bytes)
        if nbytes:
            fields.update(permute="prefetch", prefetch_bytes=nbytes)
    elif (quantize_in_permute and experts == "fp8_grouped_gemm" and config.dtype == jnp.bfloat16
          and num_tokens * top_k > ROUTING_TILE and not fields.get("fp8_decode_rows_per_pass")):
        fields["permute"] = "fp8_quantize"  # more routes than permute's one-launch path takes

    fields.update(_shared_apart(config, num_tokens, params, gpu, tuning, fp8_decode_kernel))
    if shared_in_decode_launch and fields["shared"] != "none":
        shared_ffn = _shared_ffn_size(params)
        if (fields.get("tile") == "decode" and fields["shared"] == "decode_kernel"
                and num_tokens <= tuning.decode_max_group_rows):
            fields["shared"] = "routed_launch"
        elif (fields.get("fp8_decode_rows_per_pass") and fields["shared"] == "fp8_grouped_gemm"
              and num_tokens <= FP8_DECODE_MAX_SHARED_ROWS and shared_ffn <= FP8_DECODE_MAX_K):
            fields["shared"] = "fp8_routed_launch"

    if experts == "grouped_gemm" and gpu:
        fields["activations_in_gradient"] = jnp.dtype(params["gate_up"].dtype) == config.dtype
    plan = LayerPlan(**fields)
    return plan.for_training() if training else plan


def check_plan(op: str, plan, num_tokens: int) -> LayerPlan:
    """``plan`` if it is a LayerPlan made for ``num_tokens`` tokens; ValueError naming ``op`` otherwise."""
    if not isinstance(plan, LayerPlan):
        raise ValueError(f"{op}: plan: expected a LayerPlan (from jax_moe.plan_layer) or None, "
                         f"got {type(plan).__name__}")
    if plan.num_tokens != num_tokens:
        raise ValueError(f"{op}: plan: expected a plan for this call's {num_tokens} tokens, got one made for "
                         f"{plan.num_tokens} (plan_layer(config, num_tokens, params))")
    return plan
