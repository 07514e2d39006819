"""jax_moe: MoE token permute/unpermute for JAX as XLA FFI custom calls with one shared scratch."""

from jax_moe import reference
from jax_moe.config import MoEConfig
from jax_moe.ops import permute, unpermute
from jax_moe.scratch import MoEScratch, init_scratch

__all__ = ["MoEConfig", "MoEScratch", "init_scratch", "permute", "unpermute", "reference"]
__version__ = "0.1.0"
