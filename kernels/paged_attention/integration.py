"""Transformers glue: how `generate_batch` (continuous batching) and `generate` run through the
paged kernel.

What Transformers 5.22.2 hands an attention function during continuous batching on CPU/TPU: all
sequences packed into batch 1, `cu_seq_lens_q/k`, and a `PagedAttentionCache` whose `update()`
writes the new K/V into its own paged tensors and returns K/V gathered per sequence through
`read_index` (packed). Its block-table path (the `block_table`, `k_cache`, `v_cache` kwargs, with
which Transformers' flash wrapper calls the kernel's `flash_attn_with_kvcache` on the cache pages
and the real page table) is switched on only for flash attention on CUDA or XPU
(`continuous_batching.initialization.ensure_decode_fast_path_is_available`), and only for
decode-only batches. Continuous batching also accepts only attention names containing "flash",
and Transformers resolves those to flash-attn packages or Hub kernel repos, never to a locally
registered function.

So generate_batch loads this package as a Hub kernel:
`model.set_attn_implementation(HUB_ATTN_IMPLEMENTATION)` (the repo id plus
":flash_attn_varlen_func", which puts "flash" in the name; LOCAL_KERNELS can map the repo id to a
local build). Transformers then calls our `flash_attn_varlen_func` on the gathered K/V (the paged
kernel over K/V scattered into 16-token pages: one extra copy of the gathered K/V per layer), and,
where the block-table path is on, our `flash_attn_with_kvcache` with Transformers' page table
(tested on CPU with the device gate lifted: same greedy tokens). On that path the kernel reads
Transformers' token-major pages ([blocks, block_size, kv_heads, D], per-layer contiguous views at
an offset into one tensor) in place: dlpack hands them to JAX without a copy and no relayout is
made. What is missing for the direct page-table path on TPU is in Transformers: the device gate
(`ensure_decode_fast_path_is_available` accepting TPU / any kernel with a `flash_attn_with_kvcache`),
and a block-table path for prefill / mixed batches (today those steps gather K/V through
`read_index` and call `flash_attn_varlen_func`).

`register()` covers plain forward / `generate` under ATTN_IMPLEMENTATION (unpadded batches).
`enable_block_table_decode()` is the smallest patch that lifts Transformers' device gate for this
package only (removable: it returns the undo): generate_batch's decode steps then call our
`flash_attn_with_kvcache` on Transformers' own pages and page table, on TPU and on CPU. Upstream
change that makes it unnecessary: in `ensure_decode_fast_path_is_available`, accept any attention
implementation whose loaded kernel provides `flash_attn_with_kvcache` (Hub kernels included),
whatever the device, instead of flash-attn 2/3 on CUDA or XPU only.
"""

from __future__ import annotations

import torch

from . import ops
from ._ops import HUB_REPO_ID

# The name `register()` uses for plain forward / generate. Continuous batching accepts only
# "paged|eager", "sdpa" or names containing "flash", and Transformers resolves every "flash" name
# to a flash-attn package or a Hub kernel repo, so generate_batch loads this package as a Hub
# kernel instead: HUB_ATTN_IMPLEMENTATION (module docstring).
ATTN_IMPLEMENTATION = "paged_attention_tpu"
HUB_ATTN_IMPLEMENTATION = f"{HUB_REPO_ID}:flash_attn_varlen_func"


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    cache=None,
    **kwargs,
):
    """Transformers attention function: query [B, H, Sq, D], key/value [B, Hkv, Sk, D] ->
    (out [B, Sq, H, D], None)."""
    if dropout:
        raise ValueError("paged attention TPU: dropout is not supported (inference kernel)")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    cap = softcap or 0.0
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        key, value = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs
        )
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = next(iter(cu_k.values()))
    else:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "paged attention TPU: padded batches need continuous batching "
                "(generate_batch) or unpadded inputs"
            )
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sq
        cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * sk
    out = ops.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[-2:]),
        k.reshape(-1, *k.shape[-2:]).contiguous(),
        v.reshape(-1, *v.shape[-2:]).contiguous(),
        cu_q,
        cu_k,
        softmax_scale=scaling,
        causal=is_causal,
        window_size=window,
        softcap=cap,
    )
    return out.reshape(q.shape[0], -1, *out.shape[-2:]), None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register `attention_forward` (and the flash-attention mask) under `name` in Transformers'
    attention interfaces; `model.set_attn_implementation(name)` then runs forward / `generate`
    through the paged kernel (unpadded batches). For `generate_batch` use HUB_ATTN_IMPLEMENTATION
    (module docstring). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def enable_block_table_decode():
    """Let Transformers' continuous batching take its block-table decode path with this kernel on
    any device (TPU, and CPU for tests): wraps
    `continuous_batching.initialization.ensure_decode_fast_path_is_available` so that, for a model
    whose attention implementation is HUB_ATTN_IMPLEMENTATION, only Transformers' own check that
    every attention type supports block tables runs (not the CUDA/XPU device check); any other
    model goes to the original function. Returns a function that removes the patch."""
    from transformers.generation.continuous_batching import initialization

    original = initialization.ensure_decode_fast_path_is_available

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if getattr(config, "_attn_implementation", None) != HUB_ATTN_IMPLEMENTATION:
            return original(config, cb_config, user_requested)
        supported = all(
            initialization.ATTN_TYPE_TO_ALLOCATOR[t].supports_block_table
            for t in initialization.group_layers_by_attn_type(config)
        )
        if not supported:
            cb_config.max_blocks_per_request = 0

    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available

    def undo():
        initialization.ensure_decode_fast_path_is_available = original

    return undo


__all__ = [
    "register",
    "attention_forward",
    "enable_block_table_decode",
    "ATTN_IMPLEMENTATION",
    "HUB_ATTN_IMPLEMENTATION",
]
