"""Expert parallelism: the MoE layer and stack on a device mesh, with ``jax.shard_map`` and XLA collectives.

Layout (one mesh axis ``axis_name`` of size n; E global experts, El = E / n per device):

- experts are sharded over the axis: the params' expert axis (``gate_up`` [L, E, H, 2F], ``down``
  [L, E, F, H]) is split in n blocks of El rows, device d holding rows ``d*El .. (d+1)*El - 1``.
  Which global expert sits in which row is the **placement**: ``placement[e]`` is the row ("slot") of
  global expert e, a permutation of 0..E-1 (None: identity, i.e. contiguous blocks). Device d's
  ``expert_map`` in the sense of ``MoEConfig`` is ``device_expert_map(placement, n, d)``;
- tokens are data-parallel over the same axis: x [T, H] is split in n blocks of T_l = T / n rows;
- the router ([L, H, E]) is replicated.

One layer, on each device, inside ``jax.shard_map`` (T_l local tokens, k routes each, C = the
per-peer capacity):

1. route the local tokens (global expert ids, as ``jax_moe.routing.route``);
2. dispatch: group the routes by destination device into n fixed buckets of C rows ([n, C, H]),
   each bucket in ascending flat route order ``t*k + j``; a route whose rank in its bucket is >= C
   **overflows**: it is dropped (contributes 0, like an id of -1), and counted;
3. ``lax.all_to_all`` the rows and their local expert ids (-1 for empty slots): each device now
   holds the n*C rows sent to it, C from each peer;
4. ``jax_moe.permute`` the received rows by local expert into the device's scratch (one route per
   row, top_k = 1; empty slots carry id -1 and are dropped), run the experts (as ``moe_layer``
   does: the CUDA grouped GEMM on a GPU with bf16, else ``ragged_dot`` over ``group_sizes``), and
   ``jax_moe.unpermute`` them back to the received-slot order (weights 1: exact);
5. ``lax.all_to_all`` back, so each route's expert output returns to the slot it left from;
6. combine per token: ``out[t] = sum over kept j of w[t, j] * back[slot(t, j)]``, the same native
   unpermute (float32, ascending j) the single-device layer uses, with overflowed routes dropped.

So with enough capacity (the default: C = T_l * min(k, El), the most routes one device can send to
one peer) the sharded stack computes exactly what the single-device ``moe_stack`` does; with a
smaller capacity it computes the single-device stack with the overflowed routes dropped, and says
how many there were.

The scratch: each device owns one ``MoEScratch`` for the receive side (El local experts, top_k 1,
max_tokens n*C). ``init_scratch_ep`` stacks the n of them on a leading device axis sharded over
``axis_name`` (``ExpertParallelScratch``); inside ``shard_map`` each device sees its own, threaded
through the layer ``scan`` in the carry and written in place by the aliased FFI calls, so a jitted
step that donates it gets it back in the same buffers, with no copies.

Dropless exchange (``init_scratch_ep(..., ragged=True)``, no capacity factor): the buckets keep the
same layout, but the rows go out and back with ``lax.ragged_all_to_all``, which sends only each
bucket's live rows (the routes, T_l * k per device) instead of all n * C slots: the bytes of the
fixed layout's empty slots are never sent. The routes' local expert ids (4 bytes a slot) still go
with a plain ``all_to_all``: they say which received slots are live, and give the receive sizes
with no extra collective. Slots nothing was sent to keep unspecified contents; id -1 marks them,
so permute never reads them, and the combine reads only live slots. XLA:CPU cannot compile
``ragged_all_to_all`` (jaxlib 0.10.2 to 0.11.2: "HLO opcode ragged-all-to-all is not supported"),
so on CPU the same layout goes through ``all_to_all`` whole: the results are identical, only the
bytes differ.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_moe import pipeline, plan as plan_lib
from jax_moe._validate import _fail
from jax_moe.config import MoEConfig
from jax_moe.experts import ExpertFn
from jax_moe.ops import permute, unpermute, unpermute_by_dest
from jax_moe.params import EXPERT_PARAM_NAMES, check_layer_params, check_options, check_param_keys
from jax_moe.plan import LayerPlan
from jax_moe.scratch import BUFFER_NAMES, MoEScratch, buffer_shapes, init_scratch

# exchange(rows [n, C, ...], axis_name) -> rows [n, C, ...]: block p goes to device p, block q of
# the result came from device q. The default is lax.all_to_all; the benchmark swaps in an identity.
Exchange = Callable[[jax.Array, str], jax.Array]


def all_to_all(blocks: jax.Array, axis_name: str) -> jax.Array:
    """Sends ``blocks[p]`` to device p of ``axis_name``; returns the blocks received, by source."""
    return lax.all_to_all(blocks, axis_name, split_axis=0, concat_axis=0, tiled=True)


def ragged_all_to_all(rows: jax.Array, send_sizes: jax.Array, recv_sizes: jax.Array, axis_name: str) -> jax.Array:
    """``all_to_all`` of the block layout [n * C, H] sending only the first ``send_sizes[p]`` rows of block p.

    Block p's live rows land in block ``me`` of device p's result; ``recv_sizes[q]`` is how many
    arrive from device q. Rows past each block's live count are unspecified in the result. On a GPU
    ``lax.ragged_all_to_all``; elsewhere (XLA:CPU cannot compile it) the whole blocks go through
    ``lax.all_to_all``, which gives the same live rows.
    """
    num_devices = send_sizes.shape[0]
    capacity = rows.shape[0] // num_devices

    def ragged(rows, send_sizes, recv_sizes):
        me = lax.axis_index(axis_name).astype(jnp.int32)
        block_starts = jnp.arange(num_devices, dtype=jnp.int32) * capacity
        output_offsets = jnp.full((num_devices,), me * capacity, jnp.int32)  # my block on every peer
        return lax.ragged_all_to_all(rows, jnp.zeros_like(rows), block_starts, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis_name)

    def whole(rows, send_sizes, recv_sizes):
        del send_sizes, recv_sizes
        return all_to_all(rows.reshape(num_devices, capacity, *rows.shape[1:]), axis_name).reshape(rows.shape)

    return lax.platform_dependent(rows, send_sizes, recv_sizes, cuda=ragged, default=whole)


# --- placement and capacity -----------------------------------------------------------------------

def checked_placement(op: str, placement, num_experts: int) -> tuple[int, ...] | None:
    """``placement`` as a tuple (a permutation of 0..E-1), or None for the identity; ValueError otherwise."""
    if placement is None:
        return None
    values = np.asarray(placement)
    if values.shape != (num_experts,) or (values.size and not np.issubdtype(values.dtype, np.integer)):
        raise _fail(op, "placement", f"{num_experts} integers (the slot of each global expert)",
                    f"{values.dtype} of shape {values.shape}")
    if not np.array_equal(np.sort(values), np.arange(num_experts)):
        raise _fail(op, "placement", f"a permutation of 0..{num_experts - 1}", values.tolist())
    return tuple(int(v) for v in values)


def placement_array(placement: Sequence[int] | None, num_experts: int) -> np.ndarray:
    """[E] int32: the slot (row of the params' expert axis) of each global expert."""
    if placement is None:
        return np.arange(num_experts, dtype=np.int32)
    return np.asarray(placement, dtype=np.int32)


def device_expert_map(placement: Sequence[int], num_devices: int, device: int) -> tuple[int, ...]:
    """Device ``device``'s ``MoEConfig.expert_map``: global expert -> its local index there, or -1.

    Args:
      placement: [E] ints, the slot of each global expert (``tuple(range(E))`` for contiguous blocks).
      num_devices: n, the expert axis size (a divisor of E).
      device: d in [0, n).

    Device d holds slots ``d*El .. (d+1)*El - 1`` (El = E / n); its local index of a slot is slot - d*El.
    """
    slots = np.asarray(checked_placement("device_expert_map", placement, len(placement)), dtype=np.int64)
    if len(slots) % num_devices or not 0 <= device < num_devices:
        raise _fail("device_expert_map", "num_devices, device",
                    f"a divisor of E = {len(slots)} and a device in [0, n)", (num_devices, device))
    local = len(slots) // num_devices
    return tuple(int(s - device * local) if s // local == device else -1 for s in slots)


def peer_capacity(config: MoEConfig, num_devices: int, tokens_per_device: int,
                  capacity_factor: float | None) -> int:
    """C: rows one device may send to one peer per layer.

    None: ``T_l * min(k, El)``, the most a device can ever send to one peer (top-k experts are
    distinct), so nothing overflows. A factor f: ``ceil(f * T_l * k / n)`` (f = 1 is the mean load
    of a peer under uniform routing), at least 1 and at most the no-overflow bound.
    """
    bound = tokens_per_device * min(config.top_k, config.num_experts // num_devices)
    if capacity_factor is None:
        return bound
    return min(bound, max(1, math.ceil(capacity_factor * tokens_per_device * config.top_k / num_devices)))


def local_config(config: MoEConfig, num_devices: int, capacity: int) -> MoEConfig:
    """The per-device receive-side config: El local experts, one route per received row, n*C rows.

    Its expert map is None (identity: the received ids are already local). That used to crash
    jaxlib 0.11.2's compiler inside a shard_map over 2+ GPUs while permute passed the identity as
    an empty operand; it is an attribute now.
    """
    local = config.num_experts // num_devices
    # Routing happens before the exchange with the global config: the receive side only permutes.
    return dataclasses.replace(config, num_experts=local, top_k=1, max_tokens=num_devices * capacity,
                               expert_map=None, n_group=1, topk_group=1)


# --- the sharded scratch --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExpertParallelScratch:
    """One ``MoEScratch`` per device of the expert axis, stacked on a leading device axis.

    A pytree whose leaves are the stacked buffers (``local``'s), everything else static aux data.

    Attributes:
      local: a ``MoEScratch`` for ``local_config(config, num_devices, capacity)`` whose every buffer
        has a leading [n] device axis, sharded over the expert axis (device d holds row d).
      config: the global ``MoEConfig`` (E experts, k, H, max_tokens = the most tokens of the whole
        mesh per call, dtype, align, scoring); its ``expert_map`` must be None.
      num_devices: n, the size of the expert axis.
      placement: the slot of each global expert (see the module docstring), or None (identity).
      capacity_factor: the per-peer capacity rule of ``peer_capacity`` (None: never overflows).
      ragged: the rows' exchange sends only live rows (``lax.ragged_all_to_all`` on GPUs; see the
        module docstring). Requires ``capacity_factor`` None.
    """

    local: MoEScratch
    config: MoEConfig
    num_devices: int
    placement: tuple[int, ...] | None
    capacity_factor: float | None
    ragged: bool = False

    @property
    def capacity(self) -> int:
        """C at ``config.max_tokens``: rows per peer the buffers are sized for."""
        return self.local.config.max_tokens // self.num_devices

    @property
    def nbytes(self) -> int:
        """Device bytes of all n scratches together (each device holds 1/n of it)."""
        return self.local.nbytes


jax.tree_util.register_dataclass(ExpertParallelScratch, data_fields=["local"],
                                 meta_fields=["config", "num_devices", "placement", "capacity_factor", "ragged"])


def _axis_size(op: str, mesh, axis_name) -> int:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise _fail(op, "mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    if axis_name not in mesh.axis_names:
        raise _fail(op, "axis_name", f"one of the mesh's axes {mesh.axis_names}", repr(axis_name))
    return int(mesh.shape[axis_name])


def _check_divisible(op: str, config: MoEConfig, num_devices: int) -> None:
    if config.num_experts % num_devices:
        raise _fail(op, "config.num_experts", f"a multiple of the expert axis size {num_devices}",
                    config.num_experts)
    if config.max_tokens % num_devices:
        raise _fail(op, "config.max_tokens", f"a multiple of the expert axis size {num_devices} "
                    "(tokens are split evenly over the axis)", config.max_tokens)
    if config.expert_map is not None:
        raise _fail(op, "config.expert_map", "None (the global config; placement says where experts live)",
                    config.expert_map)


def init_scratch_ep(config: MoEConfig, mesh, axis_name: str, *, placement: Sequence[int] | None = None,
                    capacity_factor: float | None = None, ragged: bool = False) -> ExpertParallelScratch:
    """Allocates every device's scratch once, directly in its sharded place.

    Args:
      config: the global ``MoEConfig``: E experts (a multiple of n), k, H, ``max_tokens`` the most
        tokens of one call over the whole mesh (a multiple of n), dtype, align, scoring;
        ``expert_map`` None.
      mesh: the ``jax.sharding.Mesh``; ``axis_name``: its expert (and token) axis, of size n.
      placement: [E] ints, the slot of each global expert (see the module docstring); None: identity.
      capacity_factor: the per-peer capacity rule (``peer_capacity``); None never overflows.
      ragged: dropless, sending only live rows (``lax.ragged_all_to_all`` on GPUs); needs
        ``capacity_factor`` None. The buffers are the same as without it.

    Returns:
      An ``ExpertParallelScratch`` (per device: ``buffer_shapes(local_config(...))``; leaves with a
      leading [n] axis sharded over ``axis_name``). Thread it through ``moe_stack_ep`` and donate it.
    """
    op = "init_scratch_ep"
    if not isinstance(config, MoEConfig):
        raise _fail(op, "config", "a MoEConfig", type(config).__name__)
    num_devices = _axis_size(op, mesh, axis_name)
    _check_divisible(op, config, num_devices)
    placement = checked_placement(op, placement, config.num_experts)
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(
            capacity_factor, (int, float)) or not capacity_factor > 0):
        raise _fail(op, "capacity_factor", "None or a positive number", repr(capacity_factor))
    if not isinstance(ragged, bool) or (ragged and capacity_factor is not None):
        raise _fail(op, "ragged", "a bool, and False when capacity_factor is set (the ragged exchange is dropless)",
                    f"{ragged!r} with capacity_factor={capacity_factor!r}")
    capacity = peer_capacity(config, num_devices, config.max_tokens // num_devices, capacity_factor)
    per_device = local_config(config, num_devices, capacity)

    def make():
        one = init_scratch(per_device)  # traced: only the fill values and shapes are used
        return jax.tree.map(lambda b: jnp.broadcast_to(b, (num_devices, *b.shape)), one)

    local = jax.jit(make, out_shardings=NamedSharding(mesh, P(axis_name)))()
    return ExpertParallelScratch(local, config, num_devices, placement,
                                 None if capacity_factor is None else float(capacity_factor), ragged)


def shard_params(params: dict, mesh, axis_name: str, *, placement: Sequence[int] | None = None) -> dict:
    """Lays out global params for ``moe_stack_ep``: expert axis in slot order, sharded; router replicated.

    Args:
      params: ``init_moe_params`` output of the global config (identity ``expert_map``), stacked
        ([L, ...]) or one layer's: ``gate_up`` [(L,) E, H, 2F], ``down`` [(L,) E, F, H], ``router``
        [(L,) H, E], experts in global id order.
      mesh, axis_name: as for ``init_scratch_ep``.
      placement: the same placement as the scratch's (None: identity).

    Returns:
      The same dict with expert row ``placement[e]`` holding global expert e, the expert axis sharded
      over ``axis_name`` and the router replicated.
    """
    check_param_keys("shard_params", params)
    num_devices = _axis_size("shard_params", mesh, axis_name)
    num_experts = jnp.shape(params["router"])[-1]
    if num_experts % num_devices:
        raise _fail("shard_params", "params['router']", f"E (last axis) a multiple of {num_devices}", num_experts)
    placement = checked_placement("shard_params", placement, num_experts)
    stacked = jnp.ndim(params["gate_up"]) == 4
    expert_axis = 1 if stacked else 0
    out = {}
    for name, leaf in params.items():
        if name in EXPERT_PARAM_NAMES:
            if placement is not None:
                order = np.argsort(placement_array(placement, num_experts))  # slot -> global expert
                leaf = jnp.take(leaf, jnp.asarray(order), axis=expert_axis)
            spec = P(*([None] * expert_axis), axis_name)
        else:
            spec = P()
        out[name] = jax.device_put(leaf, NamedSharding(mesh, spec))
    return out


# --- one layer, per device ------------------------------------------------------------------------

def _dispatch_plan(ids: jax.Array, slots: jax.Array, num_local: int, num_devices: int, capacity: int):
    """Where each local route goes: its destination device's bucket, and its slot there.

    Args:
      ids: [T_l, k] int32 global expert ids.
      slots: [E] int32, the placement.
      num_local, num_devices, capacity: El, n, C.

    Returns:
      ``(route_slot [T_l, k], send_route [n*C], send_local_id [n*C], dropped [])``: route_slot is
      ``dest*C + rank`` (rank = the route's position among the local routes to the same device, in
      flat order), -1 when rank >= C (overflow). send_route is the flat route index sent from
      each slot, -1 for empty slots; send_local_id the route's expert index on the destination
      device, -1 for empty slots. dropped: int32 count of overflowed routes.
    """
    num_tokens, top_k = ids.shape
    slot = slots[ids.reshape(-1)]
    dest, local_id = slot // num_local, slot % num_local
    onehot = (dest[:, None] == jnp.arange(num_devices, dtype=jnp.int32)).astype(jnp.int32)  # [R, n]
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # position within its bucket
    kept = rank < capacity
    send_pos = jnp.where(kept, dest * capacity + rank, -1)
    num_slots = num_devices * capacity
    scatter_to = jnp.where(kept, send_pos, num_slots)  # out of range: dropped by the scatter
    flat = jnp.arange(num_tokens * top_k, dtype=jnp.int32)
    send_route = jnp.full((num_slots,), -1, jnp.int32).at[scatter_to].set(flat, mode="drop")
    send_local_id = jnp.full((num_slots,), -1, jnp.int32).at[scatter_to].set(local_id, mode="drop")
    dropped = jnp.sum(~kept, dtype=jnp.int32)
    return send_pos.reshape(num_tokens, top_k), send_route, send_local_id, dropped


def plan_ep_layer(config: MoEConfig, local_config: MoEConfig, num_tokens: int, num_received: int, layer_params: dict,
                  expert_fn: ExpertFn | None = None) -> tuple[LayerPlan, LayerPlan]:
    """The plans of an expert-parallel layer on one device: ``(layer_plan, experts_plan)``.

    The layer's (its ``num_tokens`` local tokens: router and shared expert) routes in XLA (the
    routes go out before any kernel could use the scratch) and keeps its adds apart; the experts'
    are ``plan_layer``'s for the ``num_received`` rows of the receive-side config, plain permute.
    """
    layer_plan = plan_lib.plan_layer(config, num_tokens, layer_params, expert_fn=expert_fn, router_kernel=False,
                                     shared_in_decode_launch=False, prefetch=False, quantize_in_permute=False,
                                     residual_in_unpermute=False)
    experts_plan = plan_lib.plan_layer(local_config, num_received, layer_params, expert_fn=expert_fn,
                                       router_kernel=False, shared_in_decode_launch=False, prefetch=False,
                                       quantize_in_permute=False)
    return layer_plan, experts_plan


@dataclasses.dataclass(frozen=True)
class ExpertParallelDispatch:
    """``pipeline.Dispatch`` over a mesh axis: each route's row goes to the device owning its expert
    (a fixed bucket of C rows per peer) and its output comes back to the slot it left from.

    Attributes: the global ``config`` (routing), ``slots`` [E] int32 placement, ``num_devices`` n,
    ``capacity`` C, ``axis_name``, ``exchange`` (``all_to_all``, or the benchmark's identity),
    ``ragged`` (only live rows travel: ``ragged_all_to_all``), ``experts_plan`` (the received rows').
    """

    config: MoEConfig
    slots: jax.Array
    num_devices: int
    capacity: int
    axis_name: str
    exchange: Exchange
    ragged: bool
    experts_plan: LayerPlan

    def dispatch(self, plan, layer_params, tokens, ids, scratch):
        num_devices, capacity, axis_name, exchange = self.num_devices, self.capacity, self.axis_name, self.exchange
        hidden = tokens.shape[1]
        route_slot, send_route, send_local_id, dropped = _dispatch_plan(ids, self.slots, scratch.config.num_local_experts,
                                                                        num_devices, capacity)
        # Rows to send, one per slot; empty slots are zero rows (and id -1: the receiver drops them).
        token = jnp.maximum(send_route, 0) // self.config.top_k
        send_rows = jnp.where((send_route >= 0)[:, None], tokens[token], jnp.zeros((), tokens.dtype))
        recv_ids = exchange(send_local_id.reshape(num_devices, capacity), axis_name)
        if self.ragged and exchange is all_to_all:
            # A bucket's live slots come first (ranks 0, 1, ...): its size is its count of ids >= 0.
            send_sizes = jnp.sum(send_local_id.reshape(num_devices, capacity) >= 0, axis=1, dtype=jnp.int32)
            recv_sizes = jnp.sum(recv_ids >= 0, axis=1, dtype=jnp.int32)
            rows_exchange = functools.partial(ragged_all_to_all, axis_name=axis_name)
            recv_rows = rows_exchange(send_rows, send_sizes, recv_sizes)
            exchange_back = lambda rows: rows_exchange(rows, recv_sizes, send_sizes)  # noqa: E731
        else:
            recv_rows = exchange(send_rows.reshape(num_devices, capacity, hidden), axis_name).reshape(-1, hidden)
            exchange_back = lambda rows: exchange(rows.reshape(num_devices, capacity, hidden),  # noqa: E731
                                                  axis_name).reshape(-1, hidden)
        # The single-device path on the received rows: one route per row.
        scratch = permute(recv_rows, recv_ids.reshape(-1, 1), scratch)
        return scratch, (route_slot, exchange_back, dropped), self.experts_plan

    def combine(self, plan, rows_out, weights, scratch, state, residual, shared):
        route_slot, exchange_back, dropped = state
        num_received = self.num_devices * self.capacity
        recv_out = unpermute(rows_out, jnp.ones((num_received, 1), jnp.float32), scratch)  # weights 1: exact
        # The same native weighted sum as the single-device unpermute; overflowed routes (slot -1) give 0.
        y = unpermute_by_dest(exchange_back(recv_out), weights, route_slot)
        if shared is not None:
            y = y + shared
        return (y if residual is None else residual + y), dropped


# --- shard_map wrappers ---------------------------------------------------------------------------

def _unstack(local: MoEScratch) -> MoEScratch:
    """[1, ...] per-device view of the stacked buffers -> the device's own MoEScratch (a bitcast)."""
    return local.replace(**{n: getattr(local, n).reshape(getattr(local, n).shape[1:]) for n in BUFFER_NAMES})


def _restack(scratch: MoEScratch) -> MoEScratch:
    return scratch.replace(**{n: getattr(scratch, n)[None] for n in BUFFER_NAMES})


def _check_call(op: str, params, x, scratch, mesh, axis_name, stacked: bool) -> tuple[int, int]:
    """Trace-time checks shared by the layer and the stack; returns (n, C for this call)."""
    num_devices = _axis_size(op, mesh, axis_name)
    if not isinstance(scratch, ExpertParallelScratch):
        raise _fail(op, "scratch", "an ExpertParallelScratch (from jax_moe.parallel.init_scratch_ep)",
                    type(scratch).__name__)
    if scratch.num_devices != num_devices:
        raise _fail(op, "scratch", f"a scratch built for the {num_devices} devices of axis {axis_name!r}",
                    f"one built for {scratch.num_devices}")
    config = scratch.config
    for name, want in buffer_shapes(scratch.local.config).items():
        have = getattr(scratch.local, name)
        if tuple(have.shape) != (num_devices, *want.shape) or jnp.dtype(have.dtype) != want.dtype:
            raise _fail(op, f"scratch.local.{name}", f"{want.dtype}{[num_devices, *want.shape]}",
                        f"{jnp.dtype(have.dtype)}{list(have.shape)}")
    check_layer_params(op, params, config, stacked=stacked)
    x_shape = np.shape(x)
    if len(x_shape) != 2 or x_shape[1] != config.hidden_size:
        raise _fail(op, "x", f"shape [T, {config.hidden_size}] (T tokens of the whole mesh)", x_shape)
    if jnp.dtype(x.dtype) != config.dtype:
        raise _fail(op, "x", f"dtype {config.dtype} (config.dtype)", jnp.dtype(x.dtype))
    num_tokens = x_shape[0]
    if num_tokens < num_devices or num_tokens % num_devices:
        raise _fail(op, "x", f"a token count T that is a positive multiple of the axis size {num_devices}",
                    num_tokens)
    if num_tokens > config.max_tokens:
        raise _fail(op, "x", f"at most {config.max_tokens} tokens (the scratch's config.max_tokens)", num_tokens)
    capacity = peer_capacity(config, num_devices, num_tokens // num_devices, scratch.capacity_factor)
    return num_devices, capacity


def _specs(axis_name: str, stacked: bool, param_names):
    """Experts sharded over the axis; everything else (router, its bias, shared expert) replicated."""
    lead = (None,) if stacked else ()
    params = {name: P(*lead, axis_name) if name in EXPERT_PARAM_NAMES else P() for name in param_names}
    return params, P(axis_name)


def _explicit(mesh, axis_name) -> bool:
    axis_types = getattr(mesh, "axis_types", None)
    if not axis_types:
        return False
    return axis_types[mesh.axis_names.index(axis_name)] == jax.sharding.AxisType.Explicit


def _placed(tree, mesh, specs, axis_name):
    """On a mesh with Explicit axes shard_map takes inputs only as sharded as its in_specs say."""
    if not _explicit(mesh, axis_name):
        return tree
    return jax.tree.map(lambda s, a: jax.sharding.reshard(a, NamedSharding(mesh, s)), specs, tree,
                        is_leaf=lambda s: isinstance(s, P))


def _run(op, params, x, scratch, mesh, axis_name, expert_fn, exchange, stacked, unroll):
    check_options(op, expert_fn, unroll)
    num_devices, capacity = _check_call(op, params, x, scratch, mesh, axis_name, stacked)
    config = scratch.config
    slots = placement_array(scratch.placement, config.num_experts)
    layer_plan, experts_plan = plan_ep_layer(config, scratch.local.config, x.shape[0] // num_devices,
                                             num_devices * capacity, params, expert_fn)
    param_specs, token_spec = _specs(axis_name, stacked, params)
    params = {name: params[name] for name in param_specs}
    scratch_spec = jax.tree.map(lambda _: P(axis_name), scratch.local)

    def per_device(params, x, local):
        s = _unstack(local)
        dispatch = ExpertParallelDispatch(config, jnp.asarray(slots), num_devices, capacity, axis_name, exchange,
                                          scratch.ragged, experts_plan)
        if not stacked:
            out = pipeline.run_layer(layer_plan, params, x, s, expert_fn=expert_fn, dispatch=dispatch, config=config)
            return out.y, _restack(out.scratch), out.extra[None]

        def body(carry, layer_params):
            h, s = carry
            out = pipeline.run_layer(layer_plan, layer_params, h, s, expert_fn=expert_fn, residual=h, pre_norm=True,
                                     dispatch=dispatch, config=config)
            return (out.y, out.scratch), out.extra

        (x, s), dropped = lax.scan(body, (x, s), params, unroll=unroll)
        return x, _restack(s), dropped[None]

    in_specs = (param_specs, token_spec, scratch_spec)
    params, x, local = _placed((params, x, scratch.local), mesh, in_specs, axis_name)
    # check_vma=False: jaxlib 0.10.2's ffi_call requires all its operands to vary over the same
    # manual axes (the expert map operand is a constant) and drops that type from its results.
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs,
                            out_specs=(token_spec, scratch_spec, P(axis_name)), check_vma=False)
    y, local, dropped = sharded(params, x, local)
    return y, dataclasses.replace(scratch, local=local), jnp.sum(dropped, axis=0)  # [n(, L)] -> [(L)]


def moe_layer_ep(layer_params: dict, x: jax.Array, scratch: ExpertParallelScratch, *, mesh, axis_name: str,
                 expert_fn: ExpertFn | None = None,
                 _exchange: Exchange = all_to_all) -> tuple[jax.Array, ExpertParallelScratch, jax.Array]:
    """One expert-parallel MoE layer (``moe_layer`` on a mesh): experts and tokens over ``axis_name``.

    Args:
      layer_params: one layer of ``shard_params`` output: ``router`` [H, E], ``gate_up`` [E, H, 2F],
        ``down`` [E, F, H] (expert rows in slot order, sharded over the axis).
      x: [T, H] of ``scratch.config.dtype``, T a multiple of n and <= ``config.max_tokens``; token
        block d is device d's (ideally already sharded so over ``axis_name``).
      scratch: the ``ExpertParallelScratch`` from ``init_scratch_ep`` (donate it; don't reuse it).
      mesh, axis_name: the mesh and its expert axis (the scratch must be built for them). Other
        mesh axes, if any, replicate the computation.
      expert_fn: as in ``moe_layer``, applied per device to its El local experts: it gets the
        layer's params with the expert leaves local (``gate_up`` [El, H, 2F], ``down`` [El, F, H],
        FP8 scales [El, ...]). None: SwiGLU, as ``moe_layer`` runs it (``experts.run_experts``).

    Returns:
      ``(y, scratch, dropped)``: y [T, H] x's dtype, sharded over the axis like x; the scratch to
      pass on; dropped: int32 scalar, routes dropped by the capacity (0 when capacity_factor is None).
    """
    return _run("moe_layer_ep", layer_params, x, scratch, mesh, axis_name, expert_fn, _exchange,
                stacked=False, unroll=1)


def moe_stack_ep(params: dict, x: jax.Array, scratch: ExpertParallelScratch, *, mesh, axis_name: str,
                 unroll: int | bool = 1, expert_fn: ExpertFn | None = None,
                 _exchange: Exchange = all_to_all) -> tuple[jax.Array, ExpertParallelScratch, jax.Array]:
    """L pre-norm residual expert-parallel MoE layers (``moe_stack`` on a mesh), one ``lax.scan``.

    Each layer computes ``x = x + moe_layer_ep(params[l], rms_norm(x), scratch)``; the whole scan
    runs inside one ``jax.shard_map``, each device's scratch in the scan's carry.

    Args:
      params: ``shard_params`` output, stacked: ``router`` [L, H, E], ``gate_up`` [L, E, H, 2F],
        ``down`` [L, E, F, H].
      x, scratch, mesh, axis_name, expert_fn: as in ``moe_layer_ep``.
      unroll: passed to ``lax.scan``.

    Returns:
      ``(x_out, scratch, dropped)``: x_out [T, H] x's dtype sharded over the axis; the scratch;
      dropped: [L] int32, routes dropped by the capacity in each layer, summed over all devices.
    """
    return _run("moe_stack_ep", params, x, scratch, mesh, axis_name, expert_fn, _exchange,
                stacked=True, unroll=unroll)
