"""Tensor-parallel ragged paged attention: heads split over a `tp` mesh axis under jax.shard_map.

Each device holds the KV cache of its KV heads only (the cache is the memory that TP shards in
serving) and the query heads that read them: KV heads [d * Hkv/tp, (d + 1) * Hkv/tp) and query
heads [d * Hq/tp, (d + 1) * Hq/tp) (the kernel pairs query head h with KV head h // (Hq / Hkv), so
a contiguous split keeps every GQA group whole). Head-major caches [P, 2*Hkv, page, D] interleave
K/V per head (2h, 2h + 1), so a contiguous split of that axis is again whole heads. Page tables,
lengths and cu_q_lens are per sequence and replicated. The attention itself needs no collective;
the output stays head-sharded for a row-parallel o_proj.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import kernel as _kernel

__all__ = ["tensor_parallel_paged_attention", "tensor_parallel_paged_attention_token_major"]


def _check(mesh, axis, hq, hkv):
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
    tp = mesh.shape[axis]
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"heads: {hq} query heads are not a multiple of the {hkv} KV heads")
    if hkv % tp:
        raise ValueError(
            f"mesh axis {axis!r} of size {tp} does not divide the {hkv} KV heads "
            f"(a GQA group of {hq // hkv} query heads must stay on one device)"
        )


def tensor_parallel_paged_attention(
    q,
    kv_pages,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    mesh: Mesh,
    axis: str = "tp",
    v_pages=None,
    **kwargs,
):
    """`kernel.ragged_paged_attention` (q [T, Hq, D], kv_pages [P, 2*Hkv, page, D], or k pages
    [P, Hkv, page, D] with `v_pages`) with heads split over `axis`; returns [T, Hq, D] split along
    heads. `kwargs` (sm_scale, sliding_window, soft_cap, causal, config, generation, interpret)
    go to the kernel."""
    hkv = kv_pages.shape[1] // 2 if v_pages is None else kv_pages.shape[1]
    _check(mesh, axis, q.shape[1], hkv)
    heads, rep = P(None, axis), P()
    args = [q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs]
    specs = [heads, heads, rep, rep, rep, rep]
    if v_pages is not None:
        args.append(v_pages)
        specs.append(heads)

    def body(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, *v):
        return _kernel.ragged_paged_attention(
            q,
            kv_pages,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            v_pages=v[0] if v else None,
            **kwargs,
        )

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(
        *args
    )


def tensor_parallel_paged_attention_token_major(
    q,
    k_cache,
    v_cache,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    mesh: Mesh,
    axis: str = "tp",
    new_k=None,
    new_v=None,
    **kwargs,
):
    """`kernel.paged_attention_token_major` (caches [blocks, block_size, Hkv, D]) with heads split
    over `axis`. With new_k / new_v [T, Hkv, D] each device writes its heads' K/V into its cache
    shard and returns (out, k_cache, v_cache), caches split along heads; otherwise out."""
    _check(mesh, axis, q.shape[1], k_cache.shape[2])
    if (new_k is None) != (new_v is None):
        raise ValueError("new_k and new_v: pass both or neither")
    heads, cache, rep = P(None, axis), P(None, None, axis), P()
    args = [q, k_cache, v_cache, kv_lens, page_table, cu_q_lens, num_seqs]
    specs = [heads, cache, cache, rep, rep, rep, rep]
    writes = new_k is not None
    if writes:
        args += [new_k, new_v]
        specs += [heads, heads]

    def body(q, k_cache, v_cache, kv_lens, page_table, cu_q_lens, num_seqs, *new):
        nk, nv = new if new else (None, None)
        return _kernel.paged_attention_token_major(
            q,
            k_cache,
            v_cache,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            new_k=nk,
            new_v=nv,
            **kwargs,
        )

    out_specs = (heads, cache, cache) if writes else heads
    return jax.shard_map(
        body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs, check_vma=False
    )(*args)
