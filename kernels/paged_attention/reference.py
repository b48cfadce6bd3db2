"""f32 references for the paged attention kernel: dense attention per sequence, in numpy.

`ragged_paged_attention_ref` gathers each sequence's keys from the pages, computes softmax
attention in float32 (float64 accumulation is not needed at these sizes) with the same masks
(causal aligned to the sequence end, sliding window, soft cap) and packs the outputs.
"""

from __future__ import annotations

import numpy as np


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def gather_kv(kv_pages, page_table_row, kv_len, v_pages=None):
    """K [kv_len, Hkv, D] and V of one sequence from head-major pages [num_pages, C, page_size, D]."""
    kv_pages = np.asarray(kv_pages)
    ps = kv_pages.shape[2]
    n = -(-kv_len // ps)
    pages = np.asarray(page_table_row)[:n]

    def tokens(cache):  # [n, C, ps, D] -> [n * ps, C, D]
        x = np.asarray(cache)[pages].transpose(0, 2, 1, 3)
        return x.reshape(n * ps, x.shape[2], x.shape[3])[:kv_len]

    if v_pages is None:
        flat = tokens(kv_pages)
        return flat[:, 0::2], flat[:, 1::2]
    return tokens(kv_pages), tokens(v_pages)


def attention_ref(
    q, k, v, *, sm_scale, kv_offset, sliding_window=None, soft_cap=None, causal=True, sinks=None
):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D]; query j sits at key position kv_offset + j. sinks [Hq]:
    one extra logit per query head in every softmax denominator (no value)."""
    q, k, v = _f32(q), _f32(k), _f32(v)
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * np.float32(sm_scale)
    if soft_cap is not None:
        s = np.float32(soft_cap) * np.tanh(s / np.float32(soft_cap))
    qpos = kv_offset + np.arange(lq)[:, None]
    kpos = np.arange(lk)[None, :]
    mask = np.ones((lq, lk), bool)
    if causal:
        mask &= kpos <= qpos
        if sliding_window is not None:
            mask &= qpos - kpos < sliding_window
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, _f32(sinks)[:, None, None])
    m = np.where(np.isfinite(m), m, 0)
    p = np.where(mask[None], np.exp(s - m), 0)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(_f32(sinks)[:, None, None] - m)
    o = np.einsum("hqk,khd->qhd", p / np.where(l == 0, 1, l), v)
    return o.astype(np.float32)


def ragged_paged_attention_ref(
    q,
    kv_pages,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    v_pages=None,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    causal=True,
    sinks=None,
):
    """Dense f32 reference of kernel.ragged_paged_attention (same arguments); rows of tokens of no
    live sequence are zero."""
    q = _f32(q)
    T, hq, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    kv_lens = np.asarray(kv_lens)
    cu = np.asarray(cu_q_lens)
    pt = np.asarray(page_table)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    out = np.zeros_like(q)
    for s in range(n):
        a, b = int(cu[s]), int(cu[s + 1])
        if a == b:
            continue
        kl = int(kv_lens[s])
        k, v = gather_kv(kv_pages, pt[s], kl, v_pages)
        out[a:b] = attention_ref(
            q[a:b],
            k,
            v,
            sm_scale=sm_scale,
            kv_offset=kl - (b - a),
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            causal=causal,
            sinks=sinks,
        )
    return out


def write_kv_ref(kv_pages, new_kv, kv_lens, page_table, cu_q_lens, num_seqs):
    """The cache [num_pages, C, page_size, D] after writing new_kv [T, C, D] (numpy copy): token j of sequence s at position
    kv_lens[s] - q_len + j."""
    out = np.array(kv_pages, copy=True)
    ps = out.shape[2]
    cu = np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    for s in range(n):
        a, b = int(cu[s]), int(cu[s + 1])
        for j, t in enumerate(range(a, b)):
            pos = int(kv_lens[s]) - (b - a) + j
            out[int(page_table[s][pos // ps]), :, pos % ps] = np.asarray(new_kv)[t]
    return out


def paged_attention_token_major_ref(
    q, k_cache, v_cache, kv_lens, page_table, cu_q_lens, num_seqs, **kwargs
):
    """Dense f32 reference of kernel.paged_attention_token_major (no cache write): caches
    [num_blocks, block_size, Hkv, D]."""
    to_head_major = lambda c: np.asarray(c, np.float32).transpose(0, 2, 1, 3)  # noqa: E731
    return ragged_paged_attention_ref(
        q,
        to_head_major(k_cache),
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        v_pages=to_head_major(v_cache),
        **kwargs,
    )


def dequantize_token_major(cache, token_scale=None, head_scale=None):
    """f32 values of a quantised token-major cache [nb, bs, Hkv, D]: x * token_scale[nb, Hkv, bs]
    (transposed to the token axis) * head_scale[Hkv]."""
    x = np.asarray(cache).astype(np.float32)
    if token_scale is not None:
        x = x * np.asarray(token_scale, np.float32).transpose(0, 2, 1)[..., None]
    if head_scale is not None:
        x = x * np.asarray(head_scale, np.float32)[None, None, :, None]
    return x


def write_kv_token_major_ref(cache, new, kv_lens, page_table, cu_q_lens, num_seqs):
    """A copy of a token-major cache [num_blocks, block_size, Hkv, D] after writing new [T, Hkv, D]
    (same positions as write_kv_ref)."""
    out = np.array(cache, copy=True)
    bs = out.shape[1]
    cu = np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    for s in range(n):
        a, b = int(cu[s]), int(cu[s + 1])
        for j, t in enumerate(range(a, b)):
            pos = int(kv_lens[s]) - (b - a) + j
            out[int(page_table[s][pos // bs]), pos % bs] = np.asarray(new)[t]
    return out


__all__ = [
    "ragged_paged_attention_ref",
    "attention_ref",
    "gather_kv",
    "write_kv_ref",
    "paged_attention_token_major_ref",
    "write_kv_token_major_ref",
    "dequantize_token_major",
]
