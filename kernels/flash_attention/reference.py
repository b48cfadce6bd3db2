"""f32 references for flash attention in plain jax.numpy: what the kernels must equal.

Semantics (flash-attn 2): query i of a sequence with Sq queries and Sk keys may see key j when
    i + Sk - Sq - left <= j <= i + Sk - Sq + right      (left/right = -1: unbounded),
with right = 0 under `causal` (bottom-right alignment). Soft cap: s -> cap * tanh(s / cap) before
masking. A sink (one logit per query head) joins the softmax denominator only. Rows that see no key
give 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def mask(sq, sk, *, causal=False, window_size=(-1, -1)):
    """Boolean [sq, sk] mask of allowed (query, key) pairs."""
    left, right = window_size
    i = jnp.arange(sq)[:, None] + (sk - sq)
    j = jnp.arange(sk)[None, :]
    ok = jnp.ones((sq, sk), bool)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def attention(q, k, v, **kw):
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] -> [B, Hq, Sq, D] f32 (computed in f32)."""
    return attention_with_lse(q, k, v, **kw)[0]


def attention_with_lse(
    q,
    k,
    v,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    softmax_scale=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
):
    """(output [B, Hq, Sq, D], log-sum-exp of each row's scores and sink [B, Hq, Sq]) in f32; a
    row that sees nothing has output 0 and lse -inf."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    k = jnp.repeat(k, G, axis=1)
    v = jnp.repeat(v, G, axis=1)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    m = mask(Sq, Sk, causal=causal, window_size=window_size)[None, None]
    if q_segment_ids is not None:
        m = m & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    s = jnp.where(m, s, -jnp.inf)
    if sinks is not None:
        sk_col = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (B, Hq, Sq, 1))
        s_all = jnp.concatenate([s, sk_col], axis=-1)
    else:
        s_all = s
    mx = jnp.max(s_all, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.exp(s_all - mx)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e[..., :Sk] / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, mx + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v), lse[..., 0]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Packed q [Tq, Hq, D], k/v [Tk, Hkv, D]: `attention` per sequence -> [Tq, Hq, D] f32."""
    cq = np.asarray(cu_seqlens_q)
    ck = np.asarray(cu_seqlens_k)
    outs = []
    for s in range(len(cq) - 1):
        qs = jnp.swapaxes(q[cq[s] : cq[s + 1]], 0, 1)[None]
        ks = jnp.swapaxes(k[ck[s] : ck[s + 1]], 0, 1)[None]
        vs = jnp.swapaxes(v[ck[s] : ck[s + 1]], 0, 1)[None]
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:
            outs.append(jnp.zeros((qs.shape[2], q.shape[1], q.shape[2]), jnp.float32))
            continue
        outs.append(jnp.swapaxes(attention(qs, ks, vs, **kw)[0], 0, 1))
    if not outs:
        return jnp.zeros(q.shape, jnp.float32)
    return jnp.concatenate(outs, axis=0)
