"""Tensor-parallel flash attention: heads split over a `tp` mesh axis under jax.shard_map.

Attention is independent per head, so a head-sharded attention needs no collective of its own:
device d gets the KV heads [d * Hkv/tp, (d + 1) * Hkv/tp) and the query heads that read them,
[d * Hq/tp, (d + 1) * Hq/tp) (the kernel groups query head h with KV head h // (Hq / Hkv), so a
contiguous split keeps every GQA group whole on one device), and runs `kernel.flash_attention` on
its heads. The output stays head-sharded; in a transformer block the o_proj that follows is
row-parallel and its psum is the layer's only collective (Megatron-style TP). Sinks ([Hq]) split
like the query heads; segment ids are per token and replicated. Gradients flow through the
kernel's custom VJP per device.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import kernel as _kernel

__all__ = ["tensor_parallel_flash_attention", "check_head_split"]


def check_head_split(num_q_heads: int, num_kv_heads: int, tp: int, axis: str = "tp") -> None:
    """ValueError unless `tp` devices can split the heads with every GQA group whole."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"heads: {num_q_heads} query heads are not a multiple of the {num_kv_heads} KV heads"
        )
    if num_kv_heads % tp:
        raise ValueError(
            f"mesh axis {axis!r} of size {tp} does not divide the {num_kv_heads} KV "
            f"heads (a GQA group of {num_q_heads // num_kv_heads} query heads must "
            f"stay on one device)"
        )


def tensor_parallel_flash_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    axis: str = "tp",
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    **kwargs,
):
    """`kernel.flash_attention` (q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D]) with the heads split over
    mesh axis `axis`; returns [B, Hq, Sq, D] split along heads. `kwargs` (causal, window_size,
    softcap, softmax_scale, tiles, generation, interpret) go to the kernel. Raises ValueError
    before tracing when the axis does not divide the KV heads."""
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q, k: expected [B, H, S, D], got shapes {q.shape} and {k.shape}")
    check_head_split(q.shape[1], k.shape[1], mesh.shape[axis], axis)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks: expected shape ({q.shape[1]},), got {sinks.shape}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids: pass both or neither")
    heads = P(None, axis)
    args, specs = [q, k, v], [heads, heads, heads]
    if sinks is not None:
        args.append(sinks)
        specs.append(P(axis))
    if q_segment_ids is not None:
        args += [q_segment_ids, kv_segment_ids]
        specs += [P(), P()]
    has_sinks, has_segments = sinks is not None, q_segment_ids is not None

    def body(q, k, v, *rest):
        rest = list(rest)
        s = rest.pop(0) if has_sinks else None
        qs, ks = (rest[0], rest[1]) if has_segments else (None, None)
        return _kernel.flash_attention(
            q, k, v, sinks=s, q_segment_ids=qs, kv_segment_ids=ks, **kwargs
        )

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(
        *args
    )
