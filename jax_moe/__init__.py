"""jax_moe: MoE token permute/unpermute for JAX as XLA FFI custom calls with one shared scratch."""

from jax_moe import reference, routing
from jax_moe.config import MoEConfig
from jax_moe.gemm import grouped_matmul
from jax_moe.layers import moe_layer
from jax_moe.ops import permute, unpermute
from jax_moe.parallel import ExpertParallelScratch, init_scratch_ep, moe_layer_ep, moe_stack_ep, shard_params
from jax_moe.params import init_moe_params
from jax_moe.plan import LayerPlan, plan_layer
from jax_moe.stack import moe_stack
from jax_moe.tuning import Tuning
from jax_moe.scratch import MoEScratch, init_scratch

__all__ = ["MoEConfig", "MoEScratch", "init_scratch", "permute", "unpermute", "grouped_matmul", "reference", "routing",
           "init_moe_params", "moe_layer", "moe_stack", "LayerPlan", "plan_layer", "Tuning",
           "ExpertParallelScratch", "init_scratch_ep", "moe_layer_ep", "moe_stack_ep", "shard_params"]
__version__ = "0.1.0"
