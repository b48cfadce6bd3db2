"""paged-attention-tpu: ragged paged attention Pallas TPU kernel for serving (decode, chunked
prefill and mixed batches) with the KV-cache write, flash-attn compatible wrappers and a
Transformers continuous-batching attention function.

Layout, schedule and limits: kernel.py (module docstring) and ops.py.
"""

# Shape buckets (padded sizes that bound compilations): shape_buckets.py's docstring.
from . import _ops, integration, kernel, ops, reference, shape_buckets, tensor_parallel, tiling
from .integration import ATTN_IMPLEMENTATION, HUB_ATTN_IMPLEMENTATION, attention_forward, register
from .ops import (
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    ragged_paged_attention,
    warmup,
    warmup_kvcache,
    warmup_varlen,
)
from .shape_buckets import BucketPolicy, set_bucket_policy, use_bucket_policy
from .tensor_parallel import (
    tensor_parallel_paged_attention,
    tensor_parallel_paged_attention_token_major,
)

# Exactly build.toml's exports; the submodules and `attention_forward` stay reachable as attributes.
__all__ = [
    "ragged_paged_attention",
    "flash_attn_with_kvcache",
    "flash_attn_varlen_func",
    "register",
    "warmup",
    "warmup_kvcache",
    "warmup_varlen",
]
