"""Torch-side tests of paged attention: the exported functions against the f32 reference, the
in-place KV-cache write (bit for bit, nothing else touched), opcheck, torch.compile, bad input
raising before any kernel runs, and one op in TPU interpret mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_loader

PA = kernel_loader.load_kernel("paged_attention")
ref = PA.reference

S, P, PS, T, HQ, HKV, D = 3, 4, 16, 24, 4, 2, 128


def _batch(seed, q_lens, kv_lens, dtype=torch.float32):
    """Native-layout batch; kv_lens include the new tokens, whose cache slots hold NaN before the
    write (so a missed write shows)."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    num_pages = S * P + 2
    cache = torch.randn(num_pages, 2 * HKV, PS, D, generator=g).to(dtype)
    pt = torch.randperm(num_pages, generator=g)[: S * P].reshape(S, P).to(torch.int32)
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1 : n + 1] = torch.cumsum(torch.tensor(q_lens), 0)
    cu[n + 1 :] = cu[n]
    kl = torch.zeros(S, dtype=torch.int32)
    kl[:n] = torch.tensor(kv_lens)
    for s in range(n):
        for pos in range(kv_lens[s] - q_lens[s], kv_lens[s]):
            cache[pt[s, pos // PS], :, pos % PS] = float("nan")
    q = torch.randn(T, HQ, D, generator=g).to(dtype)
    new_kv = torch.randn(T, 2 * HKV, D, generator=g).to(dtype)
    return q, cache, kl, pt, cu, torch.tensor([n], dtype=torch.int32), new_kv


@st.composite
def _lens(draw):
    n = draw(st.integers(1, S))
    q_lens, kv_lens, budget = [], [], T
    for i in range(n):
        kl = draw(st.sampled_from([1, PS - 1, PS, PS + 1, 2 * PS, P * PS]) | st.integers(1, P * PS))
        ql = min(draw(st.sampled_from([1, kl]) | st.integers(1, kl)), budget - (n - i - 1))
        budget -= ql
        q_lens.append(ql)
        kv_lens.append(max(kl, ql))
    return q_lens, kv_lens, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=8)
@given(lens=_lens(), window=st.sampled_from([None, 20]))
def test_ragged_paged_attention_with_cache_write(lens, window):
    q_lens, kv_lens, seed = lens
    q, cache, kl, pt, cu, ns, new_kv = _batch(seed, q_lens, kv_lens)
    before = cache.clone()
    out = PA.ragged_paged_attention(
        q, cache, kl, pt, cu, ns, new_kv=new_kv, sliding_window=window, softcap=25.0
    )
    want_cache = ref.write_kv_ref(
        before.numpy(), new_kv.numpy(), kl.numpy(), pt.numpy(), cu.numpy(), ns.numpy()
    )
    # Bit for bit, NaNs included: only the new tokens' slots changed.
    assert cache.numpy().view(np.uint32).tobytes() == want_cache.view(np.uint32).tobytes()
    want = ref.ragged_paged_attention_ref(
        q.numpy(),
        want_cache,
        kl.numpy(),
        pt.numpy(),
        cu.numpy(),
        ns.numpy(),
        sliding_window=window,
        soft_cap=25.0,
    )
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=2e-5)


def _dense_ref(q, k, v, *, causal, window=None, softcap=None, scale=None):
    """q [Sq, H, D], k/v [Sk, Hkv, D], queries at the end of the keys."""
    return ref.attention_ref(
        q,
        k,
        v,
        sm_scale=scale or q.shape[-1] ** -0.5,
        kv_offset=k.shape[0] - q.shape[0],
        sliding_window=window,
        soft_cap=softcap,
        causal=causal,
    )


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize(
    "causal,window,softcap", [(True, (-1, -1), 0.0), (True, (7, 0), 15.0), (False, (-1, -1), 0.0)]
)
def test_flash_attn_with_kvcache(paged, causal, window, softcap):
    g = torch.Generator().manual_seed(5)
    B, sq, new, bs, nblocks, maxb = 3, 2, 2, 16, 12, 3
    cache_seqlens = torch.tensor([0, 17, 30], dtype=torch.int32)
    if paged:
        shape = (nblocks, bs, HKV, D)
        block_table = (
            torch.randperm(nblocks, generator=g)[: B * maxb].reshape(B, maxb).to(torch.int32)
        )
    else:
        shape = (B, bs * maxb, HKV, D)
        block_table = None
    k_cache = torch.randn(*shape, generator=g)
    v_cache = torch.randn(*shape, generator=g)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = torch.randn(B, sq, HQ, D, generator=g)
    k = torch.randn(B, new, HKV, D, generator=g)
    v = torch.randn(B, new, HKV, D, generator=g)
    out = PA.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        causal=causal,
        window_size=window,
        softcap=softcap,
    )
    bt = block_table if paged else torch.arange(B)[:, None]
    size = bs if paged else bs * maxb
    for b in range(B):
        L = int(cache_seqlens[b]) + new
        pos = torch.arange(L)
        page, row = bt[b][pos // size].long(), pos % size
        # The new tokens landed at cache_seqlens[b]:, the old entries are untouched.
        keys, vals = k_cache[page, row], v_cache[page, row]
        c0 = int(cache_seqlens[b])
        assert torch.equal(keys[c0:], k[b]) and torch.equal(vals[c0:], v[b])
        assert torch.equal(keys[:c0], k0[page, row][:c0])
        want = _dense_ref(
            q[b].numpy(),
            keys.numpy(),
            vals.numpy(),
            causal=causal,
            window=window[0] + 1 if window[0] >= 0 else None,
            softcap=softcap or None,
        )
        np.testing.assert_allclose(out[b].numpy(), want, atol=2e-5, rtol=2e-5)
    # Outside the written slots nothing changed.
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(B):
        for pos in range(int(cache_seqlens[b]), int(cache_seqlens[b]) + new):
            written[bt[b][pos // size], pos % size] = True
    assert torch.equal(k_cache[~written], k0[~written]) and torch.equal(
        v_cache[~written], v0[~written]
    )


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_func(causal):
    g = torch.Generator().manual_seed(11)
    q_lens, k_lens = [1, 9, 4], [20, 9, 35]
    cu_q = torch.tensor([0, 1, 10, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 29, 64], dtype=torch.int64)
    q = torch.randn(14, HQ, D, generator=g)
    k = torch.randn(64, HKV, D, generator=g)
    v = torch.randn(64, HKV, D, generator=g)
    out = PA.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, softmax_scale=0.1
    )
    for s in range(3):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, d = int(cu_k[s]), int(cu_k[s + 1])
        want = _dense_ref(q[a:b].numpy(), k[c:d].numpy(), v[c:d].numpy(), causal=causal, scale=0.1)
        np.testing.assert_allclose(out[a:b].numpy(), want, atol=2e-5, rtol=2e-5)


def test_opcheck_and_compile():
    q, cache, kl, pt, cu, ns, _ = _batch(2, [1, 5], [20, 40])
    cache = torch.nan_to_num(cache)
    args = (q, cache, kl, pt, cu, ns, None, None, 16, 20.0, True)
    torch.library.opcheck(PA.ops.rpa_op, args)
    compiled = torch.compile(lambda *a: PA.ops.rpa_op(*a) * 2.0, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*args), PA.ops.rpa_op(*args) * 2.0)
    fa_args = (
        torch.randn(2, HQ, D),
        torch.randn(8, PS, HKV, D),
        torch.randn(8, PS, HKV, D),
        torch.tensor([5, 30], dtype=torch.int32),
        torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
    )
    torch.library.opcheck(PA.ops.kvcache_op, fa_args)


def test_public_function_under_torch_compile():
    q, cache, kl, pt, cu, ns, new_kv = _batch(4, [2, 1], [18, 33])
    eager_cache = cache.clone()
    want = PA.ragged_paged_attention(q, eager_cache, kl, pt, cu, ns, new_kv=new_kv)
    got = torch.compile(PA.ragged_paged_attention)(q, cache, kl, pt, cu, ns, new_kv=new_kv)
    torch.testing.assert_close(got, want)
    assert torch.equal(torch.nan_to_num(cache, 7.0), torch.nan_to_num(eager_cache, 7.0))


def _bad(**changes):
    q, cache, kl, pt, cu, ns, _ = _batch(1, [2, 1], [18, 33])
    args = dict(q=q, kv_cache=cache, kv_lens=kl, page_table=pt, cu_q_lens=cu, num_seqs=ns)
    for k, fn in changes.items():
        args[k] = fn(args[k])
    return args


def _set(idx, val):
    def f(t):
        t = t.clone()
        t[idx] = val
        return t

    return f


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(page_table=_set((1, 2), 99)), r"page_table\[1, 2\] = 99 is outside"),
        (dict(page_table=_set((0, 0), -1)), r"page_table\[0, 0\] = -1"),
        (dict(kv_lens=_set(1, P * PS + 1)), "exceeds the 4 pages"),
        (dict(cu_q_lens=_set(1, 4)), "not increasing"),
        (dict(kv_lens=_set(0, 1)), "2 query tokens but kv_lens = 1"),
        (dict(q=lambda t: t[:, :3]), "not a multiple of the cache's 2 KV heads"),
        (dict(cu_q_lens=_set(0, 1)), r"cu_q_lens\[0\] must be 0"),
        (dict(num_seqs=lambda t: torch.tensor([S + 1], dtype=torch.int32)), "outside"),
        (dict(kv_lens=lambda t: t.float()), "kv_lens: expected dtype"),
        (dict(q=lambda t: t.bfloat16()), "differs from q's"),
    ],
    ids=[
        "page_oob",
        "page_negative",
        "kv_len_beyond_pages",
        "cu_decreasing",
        "q_over_kv",
        "heads",
        "cu0",
        "num_seqs",
        "dtype",
        "cache_dtype",
    ],
)
def test_bad_input_raises_before_any_kernel(changes, match, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the kernel ran on bad input")

    monkeypatch.setattr(PA.ops, "rpa_op", must_not_run)
    with pytest.raises((ValueError, TypeError), match=match):
        PA.ragged_paged_attention(**_bad(**changes))


def test_bad_input_flash_wrappers():
    q = torch.randn(2, 1, HQ, D)
    kc = torch.randn(8, PS, HKV, D)
    bt = torch.tensor([[1, 2], [3, 40]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 40"):
        PA.flash_attn_with_kvcache(
            q, kc, kc.clone(), cache_seqlens=torch.tensor([3, 20]), block_table=bt
        )
    with pytest.raises(ValueError, match="more query tokens than keys"):
        PA.flash_attn_varlen_func(
            torch.randn(5, HQ, D),
            torch.randn(3, HKV, D),
            torch.randn(3, HKV, D),
            torch.tensor([0, 5]),
            torch.tensor([0, 3]),
        )
    with pytest.raises(ValueError, match="dropout"):
        PA.flash_attn_varlen_func(
            torch.randn(3, HQ, D),
            torch.randn(3, HKV, D),
            torch.randn(3, HKV, D),
            torch.tensor([0, 3]),
            torch.tensor([0, 3]),
            dropout_p=0.1,
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_torch_op_in_tpu_interpret_mode(tpu_interpret):
    """The torch op's CPU path in TPU interpret mode (the bridge raises on a detected race)."""
    q, cache, kl, pt, cu, ns, new_kv = _batch(9, [3, 1], [19, 2])
    q, new_kv = q[:8].contiguous(), new_kv[:8].contiguous()
    before = cache.clone()
    out = PA.ragged_paged_attention(q, cache, kl, pt, cu, ns, new_kv=new_kv)
    want_cache = ref.write_kv_ref(
        before.numpy(), new_kv.numpy(), kl.numpy(), pt.numpy(), cu.numpy(), ns.numpy()
    )
    want = ref.ragged_paged_attention_ref(
        q.numpy(), want_cache, kl.numpy(), pt.numpy(), cu.numpy(), ns.numpy()
    )
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=2e-5)


def test_flash_attn_with_kvcache_on_transformers_page_views():
    """Transformers' continuous-batching cache hands flash_attn_with_kvcache per-layer page views:
    contiguous slices, at an offset, of one tensor holding every layer's K and V. They cross to JAX
    by dlpack with no copy (same address), the kernel reads them token-major in place (no
    head-major copy any more), and the new tokens land in the shared tensor."""
    from jax_bridge import to_jax

    g = torch.Generator().manual_seed(3)
    bs, layers, nb = 16, 2, 10
    flat = torch.randn(nb * 2 * layers * bs, HKV, D, generator=g)  # [tokens * 2 * layers, Hkv, D]
    page_shape = (-1, bs, HKV, D)
    k_pages = flat[2 * bs :].view(*page_shape)[: nb * 2 * layers - 3]  # layer 1's K view
    v_pages = flat[3 * bs :].view(*page_shape)[: nb * 2 * layers - 3]
    assert k_pages.is_contiguous() and k_pages.storage_offset() > 0
    assert to_jax(k_pages).unsafe_buffer_pointer() == k_pages.data_ptr()
    B, new = 2, 1
    block_table = torch.tensor([[0, 4, 8], [12, 16, 20]], dtype=torch.int32)
    cache_seqlens = torch.tensor([20, 33], dtype=torch.int32)
    q = torch.randn(B, new, HQ, D, generator=g)
    k = torch.randn(B, new, HKV, D, generator=g)
    v = torch.randn(B, new, HKV, D, generator=g)
    before = flat.clone()
    out = PA.flash_attn_with_kvcache(
        q, k_pages, v_pages, k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=True
    )
    changed = (flat != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    want_rows = []
    for b in range(B):
        pos = int(cache_seqlens[b])
        page, row = int(block_table[b, pos // bs]), pos % bs
        want_rows += [2 * bs + page * bs + row, 3 * bs + page * bs + row]
        assert torch.equal(k_pages[page, row], k[b, 0]) and torch.equal(v_pages[page, row], v[b, 0])
    assert sorted(changed) == sorted(want_rows)
    for b in range(B):
        L = int(cache_seqlens[b]) + new
        pos = torch.arange(L)
        page, row = block_table[b][pos // bs].long(), pos % bs
        want = _dense_ref(
            q[b].numpy(), k_pages[page, row].numpy(), v_pages[page, row].numpy(), causal=True
        )
        np.testing.assert_allclose(out[b].numpy(), want, atol=2e-5, rtol=2e-5)


# -------------------------------------------------------------------------------------------------
# Quantised token-major caches through the torch functions (int8, float8_e4m3fn)
# -------------------------------------------------------------------------------------------------

QBS, QHKV, QHQ = 128, 4, 8  # per-token scales need 128-token blocks; 8-bit pages 4k KV heads
# Serving tolerances, as a fraction of the output's largest magnitude (the kernel tests' values):
# against the f32 reference over the *unquantised* K/V (what a user loses by quantising) int8
# 2%, e4m3 8%; against the f32 reference over the dequantised cache (the kernel's own error:
# bf16 probabilities and widened values) 1%.
QUANT_TOL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.08}
QUANT_KERNEL_TOL = 0.01
QDTYPES = [torch.int8, torch.float8_e4m3fn]


def _np_quantise(x, dtype, head_scale, token_scales):
    """Independent numpy form of ops.quantise: (values as raw bytes, scales [N, Hkv] or None)."""
    import ml_dtypes

    qmax = 127.0 if dtype == torch.int8 else 448.0
    x = np.asarray(x, np.float32) / np.asarray(head_scale, np.float32)[None, :, None]
    scale = None
    if token_scales:
        amax = np.abs(x).max(-1)
        scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
        x = x / scale[..., None]
    x = np.clip(x, -qmax, qmax)
    if dtype == torch.int8:
        vals = np.round(x).astype(np.int8)
    else:
        vals = x.astype(ml_dtypes.float8_e4m3fn)
    return vals.view(np.uint8), scale


def _dequant(cache, token_scale, head_scale):
    """f32 values of a token-major 8-bit cache [nb, bs, Hkv, D]."""
    return ref.dequantize_token_major(
        cache.float().numpy(),
        None if token_scale is None else token_scale.numpy(),
        head_scale.numpy(),
    )


def _quantised_caches(g, dtype, nb, bs, token_scales, heads=None):
    """(raw K/V f32 [2, nb, bs, Hkv, D], caches, per-token scales or None, per-head scales)."""
    raw = torch.randn(2, nb, bs, QHKV, D, generator=g)
    if heads is None:
        heads = torch.rand(2, QHKV, generator=g) + 0.5
    elif heads == "calibrated":
        # Static scales as a server calibrates them: each head's absmax onto the format's range
        # (V: one scale for all heads), with headroom for the new tokens.
        qmax = PA.ops._QUANT_MAX[dtype]
        amax = raw.abs().amax(dim=(1, 2, 4)) * 1.25 / qmax  # [2, Hkv]
        heads = torch.stack([amax[0], amax[1].max().expand(QHKV)])
    caches, scales = [], []
    for i in range(2):
        vals, sc = PA.ops.quantise(raw[i].reshape(-1, QHKV, D), dtype, heads[i], token_scales)
        caches.append(vals.reshape(nb, bs, QHKV, D))
        scales.append(None if sc is None else sc.reshape(nb, bs, QHKV).permute(0, 2, 1).clone())
    return raw, caches, scales, heads


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_flash_attn_with_kvcache_quantised(dtype):
    """int8 / e4m3 token-major caches with per-token-per-head and per-head scales through
    flash_attn_with_kvcache: a chunk of 3 new tokens per sequence (one sequence starting empty,
    one crossing a block), quantised and written in place (bit for bit against an independent
    numpy quantiser, scales too, nothing else touched); attention against the f32 references
    (module-level tolerances)."""
    g = torch.Generator().manual_seed(21)
    B, sq, nb = 3, 3, 8
    raw, (kc, vc), (ks, vs), heads = _quantised_caches(g, dtype, nb, QBS, True)
    block_table = torch.randperm(nb, generator=g)[: B * 2].reshape(B, 2).to(torch.int32)
    cache_seqlens = torch.tensor([0, 126, 200], dtype=torch.int32)
    q = torch.randn(B, sq, QHQ, D, generator=g).bfloat16()
    k = torch.randn(B, sq, QHKV, D, generator=g)
    v = torch.randn(B, sq, QHKV, D, generator=g)
    before = [t.clone() for t in (kc, vc, ks, vs)]
    out = PA.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        causal=True,
        k_scale=ks,
        v_scale=vs,
        k_head_scale=heads[0],
        v_head_scale=heads[1],
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    written = torch.zeros(nb, QBS, dtype=torch.bool)
    raw = raw.clone()
    for b in range(B):
        pos = int(cache_seqlens[b]) + torch.arange(sq)
        page, row = block_table[b][pos // QBS].long(), pos % QBS
        written[page, row] = True
        for i, (cache, scale, new) in enumerate(((kc, ks, k), (vc, vs, v))):
            want, want_scale = _np_quantise(new[b].numpy(), dtype, heads[i].numpy(), True)
            assert cache[page, row].view(torch.uint8).numpy().tobytes() == want.tobytes()
            assert np.array_equal(scale[page, :, row].numpy(), want_scale)
            raw[i, page, row] = new[b]
    for now, was in zip((kc, vc), before[:2]):
        assert torch.equal(now.view(torch.uint8)[~written], was.view(torch.uint8)[~written])
    for now, was in zip((ks, vs), before[2:]):
        keep = ~written[:, None, :].expand_as(now)
        assert torch.equal(now[keep], was[keep])
    deq = [_dequant(c, s, h) for c, s, h in ((kc, ks, heads[0]), (vc, vs, heads[1]))]
    got = out.float().numpy()
    scale = 0.0
    errs = []
    for b in range(B):
        L = int(cache_seqlens[b]) + sq
        pos = torch.arange(L)
        page, row = block_table[b][pos // QBS].long(), pos % QBS
        qb = q[b].float().numpy()
        want_deq = _dense_ref(qb, deq[0][page, row], deq[1][page, row], causal=True)
        want_raw = _dense_ref(qb, raw[0][page, row].numpy(), raw[1][page, row].numpy(), causal=True)
        scale = max(scale, np.abs(want_raw).max())
        errs.append((np.abs(got[b] - want_deq).max(), np.abs(got[b] - want_raw).max()))
    assert max(e[0] for e in errs) <= QUANT_KERNEL_TOL * scale
    assert max(e[1] for e in errs) <= QUANT_TOL[dtype] * scale


@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_ragged_paged_attention_token_major_quantised(dtype):
    """ragged_paged_attention(kv_layout="token_major") on 8-bit caches with per-head static scales
    only, calibrated per head (16-token pages: per-token scales need 128; V's one float): decode and a
    prefill chunk in one batch with a sliding window, new_kv (K of head h at 2h, V at 2h + 1)
    quantised and written in place."""
    g = torch.Generator().manual_seed(8)
    nb, bs = 12, 16
    raw, (kc, vc), _, heads = _quantised_caches(g, dtype, nb, bs, False, "calibrated")
    q_lens, kv_lens = [1, 5], [40, 21]
    pt = torch.randperm(nb, generator=g)[:8].reshape(2, 4).to(torch.int32)
    cu = torch.tensor([0, 1, 6], dtype=torch.int32)
    kl = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(8, QHQ, D, generator=g).bfloat16()
    new_kv = torch.randn(8, 2 * QHKV, D, generator=g)
    before = [kc.clone(), vc.clone()]
    out = PA.ragged_paged_attention(
        q,
        kc,
        kl,
        pt,
        cu,
        2,
        v_cache=vc,
        new_kv=new_kv,
        kv_layout="token_major",
        k_head_scale=heads[0],
        v_head_scale=float(heads[1, 0]),
        sliding_window=30,
    )
    raw = raw.clone()
    written = torch.zeros(nb, bs, dtype=torch.bool)
    for s in range(2):
        for j, t in enumerate(range(int(cu[s]), int(cu[s + 1]))):
            pos = kv_lens[s] - q_lens[s] + j
            page, row = int(pt[s, pos // bs]), pos % bs
            written[page, row] = True
            for i, cache in enumerate((kc, vc)):
                new = new_kv[t, i::2]
                want, _ = _np_quantise(new[None].numpy(), dtype, heads[i].numpy(), False)
                assert cache[page, row].view(torch.uint8).numpy().tobytes() == want.tobytes()
                raw[i, page, row] = new
    for now, was in zip((kc, vc), before):
        assert torch.equal(now.view(torch.uint8)[~written], was.view(torch.uint8)[~written])
    deq = [_dequant(kc, None, heads[0]), _dequant(vc, None, heads[1])]
    args = (kl.numpy(), pt.numpy(), cu.numpy(), np.array([2]))
    q32 = q.float().numpy()
    want_deq = ref.paged_attention_token_major_ref(q32, *deq, *args, sliding_window=30)
    want_raw = ref.paged_attention_token_major_ref(
        q32, raw[0].numpy(), raw[1].numpy(), *args, sliding_window=30
    )
    got = out.float().numpy()
    scale = np.abs(want_raw[:6]).max()
    assert not got[6:].any()
    assert np.abs(got[:6] - want_deq[:6]).max() <= QUANT_KERNEL_TOL * scale
    assert np.abs(got[:6] - want_raw[:6]).max() <= QUANT_TOL[dtype] * scale


def _quant_call(dtype=torch.int8, **changes):
    """A valid quantised flash_attn_with_kvcache call (2 sequences, 1 new token each), with
    `changes` applied to its keyword arguments (a callable receives the valid value)."""
    g = torch.Generator().manual_seed(4)
    _, (kc, vc), (ks, vs), heads = _quantised_caches(g, dtype, 4, QBS, True)
    kw = dict(
        q=torch.randn(2, 1, QHQ, D, generator=g).bfloat16(),
        k_cache=kc,
        v_cache=vc,
        k=torch.randn(2, 1, QHKV, D, generator=g),
        v=torch.randn(2, 1, QHKV, D, generator=g),
        cache_seqlens=torch.tensor([5, 130], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        causal=True,
        k_scale=ks,
        v_scale=vs,
        k_head_scale=heads[0],
        v_head_scale=heads[1],
    )
    for name, fn in changes.items():
        kw[name] = fn(kw[name]) if callable(fn) else fn
    return kw


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(k_scale=lambda t: t[:, :, :64]), r"k_scale: expected shape \(4, 4, 128\)"),
        (dict(v_scale=lambda t: t.bfloat16()), "v_scale: expected dtype"),
        (dict(v_scale=None), "k_scale / v_scale: pass both"),
        (dict(k_head_scale=lambda t: -t), "k_head_scale: expected finite positive"),
        (dict(v_head_scale=lambda t: t[:3]), "v_head_scale: expected 4 values"),
        (dict(q=lambda t: t.float()), "q: 8-bit caches take bfloat16"),
        (dict(v_cache=lambda t: t.view(torch.float8_e4m3fn)), "v_cache: dtype"),
        (
            dict(k_cache=lambda t: t.bfloat16(), v_cache=lambda t: t.bfloat16()),
            "k_scale: scales need",
        ),
        (
            dict(
                k_cache=lambda t: t[:, :, :2],
                v_cache=lambda t: t[:, :, :2],
                k_scale=None,
                v_scale=None,
                k_head_scale=None,
                v_head_scale=None,
                k=lambda t: t[:, :, :2],
                v=lambda t: t[:, :, :2],
                q=lambda t: t[:, :, :4],
            ),
            "k_cache: 8-bit pages need a multiple of 4 KV heads",
        ),
        (
            dict(
                k_cache=lambda t: t.reshape(32, 16, QHKV, D),
                v_cache=lambda t: t.reshape(32, 16, QHKV, D),
                k_scale=lambda t: t.reshape(4, QHKV, 8, 16).permute(0, 2, 1, 3).reshape(32, 4, 16),
                v_scale=lambda t: t.reshape(4, QHKV, 8, 16).permute(0, 2, 1, 3).reshape(32, 4, 16),
            ),
            "k_scale: per-token scales need block_size a multiple of 128",
        ),
        (dict(block_table=_set((1, 1), 9)), r"page_table\[1, 1\] = 9 is outside"),
    ],
    ids=[
        "scale_shape",
        "scale_dtype",
        "scale_pair",
        "head_scale_negative",
        "head_scale_len",
        "q_dtype",
        "mixed_cache_dtypes",
        "scales_on_bf16",
        "two_kv_heads",
        "block_16_token_scales",
        "page_oob",
    ],
)
def test_quantised_bad_input_refused_before_any_kernel(changes, match, monkeypatch):
    """Bad quantised input raises (naming the argument) before any kernel runs, and nothing is
    written: caches and scales keep their bytes."""

    def must_not_run(*a, **k):
        raise AssertionError("the kernel ran on bad input")

    monkeypatch.setattr(PA.ops, "kvcache_op", must_not_run)
    kw = _quant_call(**changes)
    keep = {
        n: kw[n].clone()
        for n in ("k_cache", "v_cache", "k_scale", "v_scale")
        if isinstance(kw[n], torch.Tensor)
    }
    with pytest.raises((ValueError, TypeError), match=match):
        PA.flash_attn_with_kvcache(**kw)
    for n, was in keep.items():
        # Byte views of contiguous copies: exact for float8 and NaN alike.
        now = kw[n].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(now, was.contiguous().reshape(-1).view(torch.uint8)), n


def test_ragged_quantised_bad_layout(monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the kernel ran on bad input")

    monkeypatch.setattr(PA.ops, "kvcache_op", must_not_run)
    monkeypatch.setattr(PA.ops, "rpa_op", must_not_run)
    kw = _quant_call()
    args = (
        kw["q"].reshape(2, QHQ, D),
        kw["k_cache"],
        torch.tensor([6, 131], dtype=torch.int32),
        kw["block_table"],
        torch.tensor([0, 1, 2], dtype=torch.int32),
        2,
    )
    with pytest.raises(ValueError, match="v_cache: required"):
        PA.ragged_paged_attention(*args, kv_layout="token_major")
    with pytest.raises(ValueError, match="kv_layout: expected"):
        PA.ragged_paged_attention(*args, v_cache=kw["v_cache"], kv_layout="tokens")
    with pytest.raises(ValueError, match="k_head_scale: quantised caches need kv_layout"):
        PA.ragged_paged_attention(*args, v_cache=kw["v_cache"], k_head_scale=1.0, v_head_scale=1.0)
    with pytest.raises(TypeError, match="kv_cache: expected dtype"):
        PA.ragged_paged_attention(*args, v_cache=kw["v_cache"])  # 8-bit head-major


@pytest.mark.tpu_interpret
@pytest.mark.timeout(400)
@pytest.mark.parametrize("dtype", QDTYPES, ids=["int8", "fp8"])
def test_quantised_tpu_interpret_and_bytes(dtype):
    """flash_attn_with_kvcache on 8-bit caches (per-token and per-head scales) in TPU interpret
    mode (races, NaN VMEM, OOB), counted by the DMA counter: the KV DMAs carry half the bytes of
    the same call on bf16 caches (the per-token scales add 4 bytes per token and head: at
    D = 128, <= 0.55x in all), same number of KV DMAs plus one per page and scale array; and the
    output still within the kernel tolerance of the dequantised reference."""
    import tpu_interpreter

    kw = _quant_call(dtype, k=None, v=None)
    # Lengths in whole 8-token tiles: a partial page then copies the same tokens for 8- and
    # 16-bit pages (8-bit pages round a partial page up to 8 tokens at 4 KV heads, bf16 to 4).
    kw["cache_seqlens"] = torch.tensor([16, 160], dtype=torch.int32)
    params = tpu_interpreter.counting_params(detect_races=True, dma_execution_mode="on_wait")
    with tpu_interpreter.race_checked(), tpu_interpreter.count_traffic(params) as quant:
        out = PA.flash_attn_with_kvcache(**kw)
    deq = [
        _dequant(kw[c], kw[s], kw[h])
        for c, s, h in (
            ("k_cache", "k_scale", "k_head_scale"),
            ("v_cache", "v_scale", "v_head_scale"),
        )
    ]
    bf16 = {n: torch.from_numpy(deq[i]).bfloat16() for i, n in enumerate(("k_cache", "v_cache"))}
    plain = dict(kw, k_scale=None, v_scale=None, k_head_scale=None, v_head_scale=None, **bf16)
    with tpu_interpreter.count_traffic() as full:
        PA.flash_attn_with_kvcache(**plain)
    pages = [1, 2]  # 16 and 160 keys in 128-token blocks
    scale_dma = 2 * sum(pages)
    assert quant.dma_count == full.dma_count + scale_dma
    scale_bytes = 2 * sum(pages) * QHKV * QBS * 4
    assert (quant.dma_bytes - scale_bytes) * 2 == full.dma_bytes
    assert quant.dma_bytes <= 0.55 * full.dma_bytes
    got = out.float().numpy()
    wants = []
    for b, L in enumerate((16, 160)):
        pos = torch.arange(L)
        page, row = kw["block_table"][b][pos // QBS].long(), pos % QBS
        qb = kw["q"][b].float().numpy()
        wants.append(_dense_ref(qb, deq[0][page, row], deq[1][page, row], causal=True))
    want = np.stack(wants)
    assert np.abs(got - want).max() <= QUANT_KERNEL_TOL * np.abs(want).max()


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_flash_attn_with_kvcache_new_tokens_copy_no_cache():
    """What one flash_attn_with_kvcache call with new k/v moves (bf16, token-major): the new rows
    are written by torch indexing into the caches themselves (same storage, only those rows
    change), the caches cross to JAX by dlpack (same address), and the only kernel traffic is the
    valid key/value rows read once (the DMA counter: KV bytes = the minimum, tile-rounded) and
    the output block written; no Pallas write reaches a cache."""
    import tpu_interpreter
    from jax_bridge import to_jax

    g = torch.Generator().manual_seed(6)
    B, bs, nb = 2, 16, 8
    k_cache = torch.randn(nb, bs, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(nb, bs, HKV, D, generator=g).bfloat16()
    ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
    assert to_jax(k_cache).unsafe_buffer_pointer() == ptrs[0]
    seqlens = torch.tensor([15, 39], dtype=torch.int32)  # 16 and 40 keys with the new token
    block_table = torch.tensor([[3, 0, 0], [5, 1, 6]], dtype=torch.int32)
    q = torch.randn(B, 1, HQ, D, generator=g).bfloat16()
    k = torch.randn(B, 1, HKV, D, generator=g).bfloat16()
    v = torch.randn(B, 1, HKV, D, generator=g).bfloat16()
    before = k_cache.clone()
    with tpu_interpreter.count_traffic() as t:
        PA.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table, causal=True
        )
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == ptrs
    changed = (k_cache != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[3, 15], [6, 7]]
    kv_bytes = 2 * (16 + 40) * HKV * D * 2  # K and V rows of the valid keys, bf16
    assert t.dma_bytes == kv_bytes
    assert t.hbm_write_bytes == t.blockspec_write_bytes  # the output block only


def test_cpu_bridge_cannot_donate_dlpack_buffers():
    """Why the torch ops cannot hand the in-kernel K/V writer (kernel.write_kv_token_major,
    input_output_aliases) a cache to update in place on the CPU bridge: a JAX array imported by
    dlpack shares the torch tensor's memory, but donating it to a jitted function does not alias
    the output to it: XLA's CPU client cannot donate a buffer that has an external reference, so
    the output is a fresh buffer (a full copy of the cache) and the torch tensor never sees the
    write. (The op schema also declares no mutated argument: `jax_op` registers mutates_args=().)
    If this test fails, JAX started donating dlpack buffers and the writer could be wired in."""
    import jax

    x = torch.zeros(64, 128)
    a = jax.numpy.from_dlpack(x)
    assert a.unsafe_buffer_pointer() == x.data_ptr()
    out = jax.jit(lambda a: a.at[3].set(1.0), donate_argnums=0)(a)
    assert out.unsafe_buffer_pointer() != x.data_ptr()
    assert float(x[3, 0]) == 0.0 and float(out[3, 0]) == 1.0
