"""flash-attention-tpu: Pallas TPU flash attention (forward and backward) with a flash-attn 2
compatible torch API and a Transformers attention function."""

# Shape buckets (padded sizes that bound compilations): shape_buckets.py's docstring.
from . import _ops, integration, kernel, ops, reference, shape_buckets, tensor_parallel, tiling
from .integration import attention_forward, diffusers_attention, register, use_dispatcher
from .ops import flash_attn_func, flash_attn_varlen_func, warmup
from .shape_buckets import BucketPolicy, set_bucket_policy, use_bucket_policy
from .tensor_parallel import tensor_parallel_flash_attention
from .tiling import Tiles, choose_tiles, estimate_cost

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "attention_forward",
    "register",
    "diffusers_attention",
    "use_dispatcher",
    "tensor_parallel_flash_attention",
    "Tiles",
    "choose_tiles",
    "estimate_cost",
    "kernel",
    "reference",
    "tiling",
    "ops",
    "integration",
    "tensor_parallel",
    "warmup",
]
