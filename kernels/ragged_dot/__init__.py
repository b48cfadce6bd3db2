"""ragged-dot-tpu: grouped matmul (ragged dot) Pallas TPU kernels for Mixture-of-Experts layers.

Torch API: `ragged_dot`, `gmm` (forward, autograd: dlhs and tgmm), `gmm_gated` (the gate_up
projection with act(gate) * up fused), `tgmm`, and the Transformers
experts function `experts_forward` with `register()`. The JAX kernels are in `kernel`, the f32
references in `reference`, tile choice and the cost model in `tiling`, the expert-parallel MoE
layer (shard_map over an `ep` mesh axis) in `expert_parallel`.
"""

# Shape buckets (padded sizes that bound compilations): shape_buckets.py's docstring.
from . import _ops, expert_parallel, integration, kernel, ops, reference, shape_buckets, tiling
from .expert_parallel import expert_parallel_moe, moe_layer, route_top_k
from .integration import experts_forward, register, warmup
from .ops import gmm, gmm_gated, ragged_dot, tgmm
from .shape_buckets import BucketPolicy, set_bucket_policy, use_bucket_policy

__all__ = ["ragged_dot", "gmm", "gmm_gated", "tgmm", "experts_forward", "register", "warmup"]
