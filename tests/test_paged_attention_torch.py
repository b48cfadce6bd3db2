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
