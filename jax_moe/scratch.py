"""MoEScratch: the one set of device buffers that every MoE layer and every step reuses."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import _native
from jax_moe.config import MoEConfig

BUFFER_NAMES = ("permuted", "src_index", "dest_index", "group_sizes", "expert_offsets", "workspace")

# Routes per tile of the multi-launch CUDA routing (cuda/workspace_layout.h).
ROUTING_TILE = _native.constants.ROUTING_TILE_ROUTES


# Element types of the CUDA grouped GEMM (cuda/grouped_gemm_cutlass.cuh): only configs of these
# dtypes reserve room for its arguments in the workspace.
GROUPED_MATMUL_DTYPES = (jnp.dtype(jnp.bfloat16),)
# Its K and N must be multiples of this (16-byte rows for the tensor-memory accelerator).
GROUPED_MATMUL_ALIGN = _native.constants.GEMM_ALIGN_ELEMENTS


# The workspace ends in COUNTER_WORDS words that permute and the GEMMs never touch; its very last
# word is the decode router's arrival counter, zero between calls: zeroed by init_scratch and reset
# by the kernel itself (the layout: cuda/workspace_layout.h).
COUNTER_WORDS = _native.constants.WORKSPACE_RESERVED_WORDS


def workspace_size(config: MoEConfig) -> int:
    """int32 words of the workspace: permute's routing counters or the grouped GEMMs' arguments
    (bf16 or FP8 experts), then ``COUNTER_WORDS`` for the decode router.

    The first ones are never live at once (each call leaves nothing in it for the next), so they
    share the buffer and take the largest of the sizes.
    """
    gemm_bytes = 0
    if config.dtype in GROUPED_MATMUL_DTYPES:
        gemm_bytes = max(_native.grouped_matmul_workspace_bytes(config.num_local_experts),
                         _native.fp8_grouped_matmul_workspace_bytes(config.num_local_experts))
    return _native.workspace_words(config.max_tokens * config.top_k, config.num_local_experts, gemm_bytes)


def buffer_shapes(config: MoEConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of each scratch buffer for ``config`` (the contract in ``jax_moe.ops``)."""
    num_local = config.num_local_experts
    i32 = jnp.int32
    return {
        "permuted": jax.ShapeDtypeStruct((config.capacity, config.hidden_size), config.dtype),
        "src_index": jax.ShapeDtypeStruct((config.capacity,), i32),
        "dest_index": jax.ShapeDtypeStruct((config.max_tokens, config.top_k), i32),
        "group_sizes": jax.ShapeDtypeStruct((num_local,), i32),
        "expert_offsets": jax.ShapeDtypeStruct((num_local + 1,), i32),
        "workspace": jax.ShapeDtypeStruct((workspace_size(config),), i32),
    }


@dataclasses.dataclass(frozen=True)
class MoEScratch:
    """Buffers written by ``permute`` and read by the expert GEMMs and ``unpermute``.

    A pytree: the five arrays are its leaves, ``config`` is static aux data, so ``jit``, ``scan``
    carries and donation see only the buffers.

    Attributes:
      permuted: [R_cap, H] ``config.dtype``; row ``expert_offsets[e] + r`` is the r-th route of local
        expert e. Padding rows are zero; rows past ``expert_offsets[El]`` are unspecified.
      src_index: [R_cap] int32; flat route ``t * k + j`` of each row, -1 for padding and past the end.
      dest_index: [T_max, k] int32; permuted row of route (t, j), -1 when dropped. Rows t >= T of
        the last ``permute`` are unspecified.
      group_sizes: [El] int32; rows of each local expert, padded to ``config.align``.
      expert_offsets: [El + 1] int32; exclusive prefix sum of ``group_sizes`` (last = live rows).
      workspace: int32 workspace of the CUDA kernels (permute's per-tile expert counts, the
        grouped GEMM's per-expert arguments), so that no handler allocates; contents unspecified,
        except the last word: the decode router's arrival counter, zero between calls.
      config: the ``MoEConfig`` these buffers were built for.
    """

    permuted: jax.Array
    src_index: jax.Array
    dest_index: jax.Array
    group_sizes: jax.Array
    expert_offsets: jax.Array
    workspace: jax.Array
    config: MoEConfig

    def buffers(self) -> tuple[jax.Array, ...]:
        """The buffers in ``BUFFER_NAMES`` order (the order of the permute call's aliased operands)."""
        return tuple(getattr(self, name) for name in BUFFER_NAMES)

    def replace(self, **buffers) -> "MoEScratch":
        """A scratch with the named buffers replaced (same config), e.g. by an op's outputs."""
        return dataclasses.replace(self, **buffers)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the scratch's buffers."""
        return sum(int(np.prod(b.shape)) * jnp.dtype(b.dtype).itemsize for b in self.buffers())


jax.tree_util.register_dataclass(MoEScratch, data_fields=list(BUFFER_NAMES), meta_fields=["config"])


def init_scratch(config: MoEConfig, device=None) -> MoEScratch:
    """Allocates the scratch for ``config`` once, directly on the target device.

    Args:
      config: the ``MoEConfig`` every ``permute``/``unpermute`` on this scratch will use.
      device: a ``jax.Device``, a ``jax.sharding.Sharding``, or None for the default device.

    Returns:
      A ``MoEScratch``: ``permuted`` [R_cap, H] ``config.dtype`` zeros, ``src_index`` [R_cap] and
      ``dest_index`` [T_max, k] int32 -1, ``group_sizes`` [El] and ``expert_offsets`` [El + 1]
      int32 zeros, ``workspace`` int32 zeros. Thread it through every layer (``lax.scan`` carry)
      and step (``jax.jit(..., donate_argnums=...)``).
    """
    if not isinstance(config, MoEConfig):
        raise ValueError(f"init_scratch: config: expected a MoEConfig, got {type(config).__name__}")
    shapes = buffer_shapes(config)
    fill = {"src_index": -1, "dest_index": -1}

    def make():
        return tuple(jnp.full(s.shape, fill.get(n, 0), s.dtype) for n, s in shapes.items())

    if device is None:
        buffers = jax.jit(make)()
    else:
        if not isinstance(device, (jax.Device, jax.sharding.Sharding)):
            raise ValueError(f"init_scratch: device: expected a jax.Device, a jax.sharding.Sharding or None, got "
                             f"{type(device).__name__} {device!r}")
        sharding = device if isinstance(device, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(device)
        buffers = jax.jit(make, out_shardings=sharding)()
    return MoEScratch(*buffers, config=config)
