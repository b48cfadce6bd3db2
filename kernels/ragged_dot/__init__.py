"""ragged-dot-tpu: grouped matmul (ragged dot) Pallas TPU kernels for Mixture-of-Experts layers.

Torch API: `ragged_dot`, `gmm` (forward, autograd: dlhs and tgmm), `gmm_gated` (the gate_up
projection with act(gate) * up fused), `tgmm`, and the Transformers
experts function `experts_forward` with `register()`. The JAX kernels are in `kernel`, the f32
references in `reference`, tile choice and the cost model in `tiling`.
"""

from . import _ops, integration, kernel, ops, reference, tiling
from .integration import experts_forward, register
from .ops import gmm, gmm_gated, ragged_dot, tgmm

__all__ = ["ragged_dot", "gmm", "gmm_gated", "tgmm", "experts_forward", "register"]
