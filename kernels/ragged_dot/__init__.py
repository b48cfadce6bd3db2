"""ragged-dot-tpu: grouped matmul Pallas kernels for Mixture-of-Experts layers."""
from . import kernel, reference, tiling
