"""Kernel-level tests of paged attention: the Pallas kernel against a dense f32 reference (plain
interpret mode, hypothesis-drawn ragged batches), the work list against its host twin, the cache
write, and TPU interpret mode (races, NaN-filled memory, raising out-of-bounds reads, exact DMA
bytes against tiling.traffic)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jax_core

import kernel_loader
import tpu_interpreter
from jax_bridge import tpu_interpret_params

PA = kernel_loader.load_kernel("paged_attention")
ROOT_DIR = Path(__file__).resolve().parents[1]
kernel, reference, tiling = PA.kernel, PA.reference, PA.tiling

# Small static shapes shared by every example, so each configuration compiles once.
S, P, PS, T = 4, 5, 16, 40  # sequence slots, pages per sequence, page size, q token capacity
HQ, HKV, D = 4, 2, 128
NUM_PAGES = S * P + 3


def make_batch(
    rng,
    q_lens,
    kv_lens,
    *,
    dtype=np.float32,
    separate=False,
    num_slots=S,
    pages_per_seq=P,
    page_size=PS,
    tokens=T,
    hq=HQ,
    hkv=HKV,
    d=D,
):
    """Random q and paged cache for the live sequences (q_lens, kv_lens). Every cache slot no live
    key occupies (pages of nobody, rows past kv_len) is NaN, so reading one shows up."""
    n = len(q_lens)
    num_pages = num_slots * pages_per_seq + 3
    c = hkv if separate else 2 * hkv
    caches = [
        np.full((num_pages, c, page_size, d), np.nan, np.float32)
        for _ in range(2 if separate else 1)
    ]
    pt = rng.permutation(num_pages)[: num_slots * pages_per_seq].reshape(num_slots, pages_per_seq)
    for s in range(n):
        for pos in range(kv_lens[s]):
            for cache in caches:
                cache[pt[s, pos // page_size], :, pos % page_size] = rng.standard_normal((c, d))
    q = rng.standard_normal((tokens, hq, d)).astype(np.float32)
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kl = np.zeros(num_slots, np.int32)
    kl[:n] = kv_lens
    caches = [x.astype(dtype) for x in caches]
    return dict(
        q=q.astype(dtype),
        kv=caches[0],
        v=caches[1] if separate else None,
        kv_lens=kl,
        pt=pt.astype(np.int32),
        cu=cu,
        ns=np.array([n], np.int32),
    )


@functools.cache
def jitted(sliding_window=None, soft_cap=None, causal=True, config=None, interpret=True):
    return jax.jit(
        functools.partial(
            kernel.ragged_paged_attention,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            causal=causal,
            config=config,
            interpret=interpret,
        )
    )


def run_and_check(b, *, sliding_window=None, soft_cap=None, causal=True, config=None, tol=2e-5):
    f = jitted(sliding_window, soft_cap, causal, config)
    out = np.asarray(
        f(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], v_pages=b["v"]), np.float32
    )
    ref = reference.ragged_paged_attention_ref(
        b["q"],
        b["kv"],
        b["kv_lens"],
        b["pt"],
        b["cu"],
        b["ns"],
        v_pages=b["v"],
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        causal=causal,
    )
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    return out


# Lengths at and around page edges are drawn often: empty tail pages, exactly full pages.
_edge_lens = st.sampled_from([1, PS - 1, PS, PS + 1, 2 * PS, 3 * PS - 1, P * PS])


@st.composite
def batches(draw, kind):
    n = draw(st.integers(1, S))
    q_lens, kv_lens = [], []
    budget = T
    for _ in range(n):
        kl = draw(st.one_of(_edge_lens, st.integers(1, P * PS)))
        if kind == "decode":
            ql = 1
        elif kind == "prefill":
            ql = kl if draw(st.booleans()) else draw(st.integers(1, kl))
        else:
            ql = 1 if draw(st.booleans()) else draw(st.integers(1, kl))
        ql = max(1, min(ql, budget - (n - len(q_lens) - 1)))
        kl = max(kl, ql)
        budget -= ql
        q_lens.append(ql)
        kv_lens.append(kl)
    return q_lens, kv_lens, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize(
    "opts", [dict(), dict(sliding_window=20, soft_cap=30.0)], ids=["plain", "window_softcap"]
)
@settings(max_examples=8)
@given(data=st.data())
def test_matches_reference(kind, opts, data):
    q_lens, kv_lens, seed = data.draw(batches(kind))
    b = make_batch(np.random.default_rng(seed), q_lens, kv_lens)
    out = run_and_check(b, **opts)
    # Tokens of no live sequence come back as zeros.
    assert not out[int(b["cu"][-1]) :].any()


@pytest.mark.parametrize(
    "config",
    [
        tiling.PagedAttentionConfig(block_q=8, pages_per_block=2),
        tiling.PagedAttentionConfig(block_q=4, pages_per_block=1, stream_page_table=True),
    ],
    ids=["bq8_ppb2", "bq4_ppb1_streamed_page_table"],
)
@settings(max_examples=6)
@given(batch=batches("mixed"))
def test_small_tiles_and_separate_kv(config, batch):
    """Several q blocks per sequence and several KV blocks per (q block, sequence); the
    separate K and V caches; the page table streamed from HBM one row per item."""
    q_lens, kv_lens, seed = batch
    b = make_batch(np.random.default_rng(seed), q_lens, kv_lens, separate=True)
    run_and_check(b, config=config, sliding_window=24)


def test_non_causal_and_bf16():
    rng = np.random.default_rng(1)
    b = make_batch(rng, [3, 1, 7], [33, 1, 7])
    run_and_check(b, causal=False)
    b = make_batch(rng, [5, 1, 16], [40, 64, 16], dtype=jax.numpy.bfloat16)
    run_and_check(b, soft_cap=20.0, tol=3e-2)


@settings(max_examples=8)
@given(
    batch=batches("mixed"),
    window=st.sampled_from([None, 1, 17, 40]),
    bq=st.sampled_from([4, 8, 40]),
    ppb=st.sampled_from([1, 2, 5]),
)
def test_work_list_same_on_host_and_device(batch, window, bq, ppb):
    """The one builder (schedule.build_work_list) gives the same items in the traced program
    (xp=jnp, padded to max_items) and on the host (xp=np, what estimate_cost replays), and the
    work list never lists a page outside the causal/window range."""
    q_lens, kv_lens, _ = batch
    n = len(q_lens)
    b = make_batch(np.random.default_rng(0), q_lens, kv_lens)
    nqb = -(-T // bq)
    # The window-aware bound the kernel uses must still hold every item.
    max_items = tiling.max_items_bound(
        num_q_blocks=nqb,
        max_num_seqs=S,
        pages_per_seq=P,
        pages_per_block=ppb,
        block_q=bq,
        page_size=PS,
        sliding_window=window,
    )
    work, block_ends = kernel.build_work_list(
        jax.numpy.asarray(b["kv_lens"]),
        jax.numpy.asarray(b["cu"]),
        jax.numpy.asarray(b["ns"]),
        block_q=bq,
        num_q_blocks=nqb,
        page_size=PS,
        pages_per_block=ppb,
        sliding_window=window,
        causal=True,
        max_items=max_items,
    )
    work = np.asarray(work)
    host = PA.schedule.host_work_list(
        q_lens,
        kv_lens,
        block_q=bq,
        num_q_blocks=nqb,
        page_size=PS,
        pages_per_block=ppb,
        sliding_window=window,
        causal=True,
    )
    block_ends = np.asarray(block_ends)
    assert int(block_ends[-1]) == len(host) <= max_items
    assert [tuple(int(x) for x in work[:, i]) for i in range(len(host))] == host
    # each q block's grid step runs its items: [ends[b - 1], ends[b]), at least one, all its own
    starts = np.concatenate([[0], block_ends[:-1]])
    assert block_ends.shape == (nqb,) and (block_ends > starts).all()
    for qb, (lo, hi) in enumerate(zip(starts, block_ends)):
        assert [it[0] for it in host[lo:hi]] == [qb] * (hi - lo)
    assert (work[3, len(host) :] == 0).all()
    for qb, s, first, npages in host:
        if s < 0:
            continue
        assert 1 <= npages <= ppb and first >= 0
        assert (first + npages - 1) * PS < kv_lens[s]
        if window is not None:
            # The first listed page holds a key that some query of this block can see.
            cu = np.concatenate([[0], np.cumsum(q_lens)])
            t0 = max(cu[s], qb * bq)
            first_pos = kv_lens[s] - q_lens[s] + (t0 - cu[s])
            assert (first + npages) * PS - 1 >= first_pos - window + 1
    assert n >= 1


@settings(max_examples=12)
@given(batch=batches("mixed"))
def test_write_kv_bit_exact(batch):
    """The cache after kernel.write_kv equals the reference bit for bit: the new tokens' slots
    hold their K/V and every other entry (NaNs included) is unchanged."""
    q_lens, kv_lens, seed = batch
    rng = np.random.default_rng(seed)
    b = make_batch(rng, q_lens, kv_lens)
    new = rng.standard_normal((T, 2 * HKV, D)).astype(np.float32)
    want = reference.write_kv_ref(b["kv"], new, b["kv_lens"], b["pt"], b["cu"], b["ns"])
    got = np.asarray(
        jax.jit(kernel.write_kv)(b["kv"], new, b["kv_lens"], b["pt"], b["cu"], b["ns"])
    )
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def _shapes(seqs, pages, tokens):
    return (
        jax.ShapeDtypeStruct((tokens, 4, 128), np.float32),
        jax.ShapeDtypeStruct((8, 4, 16, 128), np.float32),
        jax.ShapeDtypeStruct((seqs,), np.int32),
        jax.ShapeDtypeStruct((seqs, pages), np.int32),
        jax.ShapeDtypeStruct((seqs + 1,), np.int32),
        jax.ShapeDtypeStruct((1,), np.int32),
    )


def test_smem_bound():
    """A page table over PAGE_TABLE_SMEM_BYTES is streamed (the call traces); a work list over
    the SMEM budget is refused with a ValueError before the kernel is traced."""
    f = functools.partial(kernel.ragged_paged_attention, interpret=True)
    assert tiling.streams_page_table(512, 1024, tiling.PagedAttentionConfig())
    assert jax.eval_shape(f, *_shapes(512, 1024, 512)).shape == (512, 4, 128)
    # 8192 sequences of 1024 pages: ~65k items even at the largest KV blocks
    with pytest.raises(ValueError, match="SMEM"):
        jax.eval_shape(f, *_shapes(8192, 1024, 8192))


# -------------------------------------------------------------------------------------------------
# TPU interpret mode
# -------------------------------------------------------------------------------------------------


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    [
        dict(q_lens=[3, 1], kv_lens=[40, 17], window=None, separate=False, stream=False),
        dict(q_lens=[2, 1, 4], kv_lens=[2, 33, 48], window=20, separate=True, stream=False),
        dict(q_lens=[1, 5, 1], kv_lens=[9, 40, 31], window=None, separate=False, stream=True),
    ],
    ids=["mixed", "window_separate", "streamed_page_table"],
)
def test_tpu_interpret(case):
    """Races, NaN-filled uninitialised VMEM and out-of-bounds reads raise or show; the output
    matches; the manual DMAs move exactly the pages tiling.traffic predicts."""
    slots, pages, tokens, hq, hkv = 3, 3, 8, 2, 1
    b = make_batch(
        np.random.default_rng(7),
        case["q_lens"],
        case["kv_lens"],
        num_slots=slots,
        pages_per_seq=pages,
        tokens=tokens,
        hq=hq,
        hkv=hkv,
        separate=case["separate"],
    )
    cfg = tiling.PagedAttentionConfig(
        pages_per_block=1, stream_page_table=case["stream"], block_q=4 if case["stream"] else None
    )
    f = jax.jit(
        functools.partial(
            kernel.ragged_paged_attention,
            config=cfg,
            sliding_window=case["window"],
            interpret=tpu_interpret_params(),
        )
    )
    with (
        tpu_interpreter.race_checked(),
        tpu_interpreter.count_traffic(tpu_interpret_params()) as counted,
    ):
        out = np.asarray(
            f(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], v_pages=b["v"])
        )
    ref = reference.ragged_paged_attention_ref(
        b["q"],
        b["kv"],
        b["kv_lens"],
        b["pt"],
        b["cu"],
        b["ns"],
        v_pages=b["v"],
        sliding_window=case["window"],
    )
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    t = tiling.traffic(
        q_lens=case["q_lens"],
        kv_lens=case["kv_lens"],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
        page_size=PS,
        pages_per_seq=pages,
        max_num_seqs=slots,
        num_tokens=tokens,
        q_dtype="float32",
        kv_dtype="float32",
        sliding_window=case["window"],
        separate_kv=case["separate"],
        config=cfg,
    )
    assert t["stream_page_table"] == case["stream"]
    assert counted.dma_count == t["kv_dmas"] + t["pt_dmas"]
    assert counted.dma_bytes == t["kv_dma_bytes"] + t["pt_dma_bytes"]


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_page_ids_are_clamped_into_the_cache():
    """The kernel runs without Mosaic's DMA bounds checks (kernel.py: ~45 scalar bundles a page),
    so every DMA address must be in bounds by construction: a page table entry past the cache
    (which the torch ops refuse before any kernel runs; a traced JAX call cannot) is clamped to
    the last page. TPU interpret mode raises on an out-of-bounds DMA read (the test fails without
    the clamp), and the answer is the one with the entry clamped by hand."""
    b = make_batch(
        np.random.default_rng(3), [2], [20], num_slots=1, pages_per_seq=2, tokens=8, hq=2, hkv=1
    )
    f = jax.jit(functools.partial(kernel.ragged_paged_attention, interpret=tpu_interpret_params()))
    outs = []
    for page in (b["kv"].shape[0] + 5, b["kv"].shape[0] - 1):
        pt = b["pt"].copy()
        pt[0, 1] = page
        pltpu.reset_tpu_interpret_mode_state()
        try:
            outs.append(np.asarray(f(b["q"], b["kv"], b["kv_lens"], pt, b["cu"], b["ns"])))
        finally:
            pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.isfinite(outs[0]).all()


# -------------------------------------------------------------------------------------------------
# Token-major caches [num_blocks, block_size, Hkv, D] (flash-attn / vLLM / Transformers layout)
# -------------------------------------------------------------------------------------------------


def make_token_major(
    rng,
    q_lens,
    kv_lens,
    *,
    dtype=np.float32,
    num_slots=S,
    pages_per_seq=P,
    page_size=PS,
    tokens=T,
    hq=HQ,
    hkv=HKV,
    d=D,
):
    """Token-major K and V caches holding every sequence's past keys (kv_len - q_len of them);
    every other slot, the new tokens' slots included, is NaN (a missed write or a read of a
    foreign slot shows). Also the new tokens' K/V [tokens, Hkv, D]."""
    n = len(q_lens)
    num_pages = num_slots * pages_per_seq + 3
    kc = np.full((num_pages, page_size, hkv, d), np.nan, np.float32)
    vc = kc.copy()
    pt = rng.permutation(num_pages)[: num_slots * pages_per_seq].reshape(num_slots, pages_per_seq)
    for s in range(n):
        for pos in range(kv_lens[s] - q_lens[s]):
            kc[pt[s, pos // page_size], pos % page_size] = rng.standard_normal((hkv, d))
            vc[pt[s, pos // page_size], pos % page_size] = rng.standard_normal((hkv, d))
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kl = np.zeros(num_slots, np.int32)
    kl[:n] = kv_lens
    cast = lambda x: np.asarray(jax.numpy.asarray(x).astype(dtype))  # noqa: E731
    return dict(
        q=cast(rng.standard_normal((tokens, hq, d))),
        k=cast(kc),
        v=cast(vc),
        new_k=cast(rng.standard_normal((tokens, hkv, d))),
        new_v=cast(rng.standard_normal((tokens, hkv, d))),
        kv_lens=kl,
        pt=pt.astype(np.int32),
        cu=cu,
        ns=np.array([n], np.int32),
    )


@functools.cache
def jitted_tm(sliding_window=None, soft_cap=None, config=None, interpret=True):
    # The caches are donated: the writer's outputs alias them (in place on TPU).
    return jax.jit(
        functools.partial(
            kernel.paged_attention_token_major,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            config=config,
            interpret=interpret,
        ),
        donate_argnums=(1, 2),
    )


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8).tobytes()


def run_token_major(
    b, *, sliding_window=None, soft_cap=None, config=None, interpret=True, tol=2e-5
):
    """Write + attention in one call; the caches must equal the reference write bit for bit and
    the output the f32 reference over the written caches."""
    want_k = reference.write_kv_token_major_ref(
        b["k"], b["new_k"], b["kv_lens"], b["pt"], b["cu"], b["ns"]
    )
    want_v = reference.write_kv_token_major_ref(
        b["v"], b["new_v"], b["kv_lens"], b["pt"], b["cu"], b["ns"]
    )
    f = jitted_tm(sliding_window, soft_cap, config, interpret)
    out, k2, v2 = f(
        b["q"],
        jax.numpy.asarray(b["k"]),
        jax.numpy.asarray(b["v"]),
        b["kv_lens"],
        b["pt"],
        b["cu"],
        b["ns"],
        new_k=b["new_k"],
        new_v=b["new_v"],
    )
    assert _bits(k2) == _bits(want_k) and _bits(v2) == _bits(want_v)
    out = np.asarray(out.astype(np.float32))
    ref = reference.paged_attention_token_major_ref(
        b["q"],
        want_k,
        want_v,
        b["kv_lens"],
        b["pt"],
        b["cu"],
        b["ns"],
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    assert not out[int(b["cu"][-1]) :].any()
    return out


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize(
    "opts", [dict(), dict(sliding_window=20, soft_cap=30.0)], ids=["plain", "window_softcap"]
)
@settings(max_examples=6)
@given(data=st.data())
def test_token_major_matches_reference(kind, opts, data):
    """Token-major caches, the new tokens written by the Pallas writer in the same call (bit-exact,
    nothing else touched), attention against the f32 reference."""
    q_lens, kv_lens, seed = data.draw(batches(kind))
    run_token_major(make_token_major(np.random.default_rng(seed), q_lens, kv_lens), **opts)


@settings(max_examples=6)
@given(batch=batches("mixed"))
def test_token_major_small_tiles_streamed_page_table(batch):
    q_lens, kv_lens, seed = batch
    cfg = tiling.PagedAttentionConfig(block_q=4, pages_per_block=2, stream_page_table=True)
    run_token_major(
        make_token_major(np.random.default_rng(seed), q_lens, kv_lens),
        config=cfg,
        sliding_window=24,
    )


@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_token_major_bf16_head_unpacking(hkv):
    """bf16 pages are read as uint32 words holding two heads of one token (plain interpret mode runs
    the same unpacking as Mosaic): every head count the kernel accepts, against the reference."""
    b = make_token_major(
        np.random.default_rng(hkv),
        [5, 1, 16],
        [40, 64, 16],
        dtype=jax.numpy.bfloat16,
        hkv=hkv,
        hq=2 * hkv,
    )
    run_token_major(b, soft_cap=20.0, tol=3e-2)


def test_nan_in_one_sequence_stays_in_it():
    """Decode tokens of several sequences share the narrow path's rows; a NaN in one sequence's
    valid value must not reach the others (their probabilities there are 0, and 0 * NaN is
    NaN in the probability matmul): only that sequence's q heads of that KV head are NaN, every
    other output equals the reference, rows of no sequence are zero."""
    rng = np.random.default_rng(3)
    b = make_batch(rng, [1, 1, 1], [37, 70, 9])
    kv = np.array(b["kv"])
    args = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    ref = reference.ragged_paged_attention_ref(b["q"], kv, *args)
    kv[b["pt"][1, 5 // PS], 1, 5 % PS] = np.nan  # V of KV head 0 (index 2h + 1), sequence 1
    out = np.asarray(kernel.ragged_paged_attention(b["q"], kv, *args, interpret=True))
    poisoned = np.zeros(out.shape[:2], bool)
    poisoned[1, : HQ // HKV] = True  # token 1 is sequence 1's; KV head 0's q heads
    assert np.isnan(out[poisoned]).all()
    np.testing.assert_allclose(out[:3][~poisoned[:3]], ref[:3][~poisoned[:3]], atol=2e-5, rtol=2e-5)
    assert not out[3:].any()


def test_token_major_bf16_head_pairs_keep_heads_apart():
    """Decode over bf16 token-major pages computes two KV heads per pass (kernel.py
    compute_head_pairs: one uint32 word holds a token of both). A NaN in one head's valid key
    and value reaches that token's pair of KV heads (the partner's probabilities are 0 there,
    and 0 * NaN is NaN in the probability matmul) and nothing else: every other head and every
    other sequence sharing the narrow rows stays equal to the reference (windowed,
    soft-capped, with sinks)."""
    rng = np.random.default_rng(7)
    hkv, hq = 4, 8
    b = make_token_major(
        rng, [1, 1, 1], [37, 70, 9], dtype=jax.numpy.bfloat16, hkv=hkv, hq=hq, tokens=8
    )
    sinks = rng.standard_normal(hq).astype(np.float32)
    args = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    clean = [reference.write_kv_token_major_ref(b[n], b["new_" + n], *args) for n in ("k", "v")]
    poisoned_caches = [np.array(c) for c in clean]
    page, row = b["pt"][1, 5 // PS], 5 % PS  # sequence 1, key 5 (valid), KV head 3
    for c in poisoned_caches:
        c[page, row, 3] = np.nan
    kw = dict(sliding_window=100, soft_cap=25.0, sinks=sinks)
    out = kernel.paged_attention_token_major(
        b["q"], *[jax.numpy.asarray(c) for c in poisoned_caches], *args, interpret=True, **kw
    )
    out = np.asarray(out.astype(np.float32))
    ref = reference.paged_attention_token_major_ref(b["q"], *clean, *args, **kw)
    g = hq // hkv
    poisoned = np.zeros(out.shape[:2], bool)
    poisoned[1, 2 * g : 4 * g] = True  # token 1 is sequence 1's decode token; KV heads 2, 3
    assert np.isnan(out[poisoned]).all()
    np.testing.assert_allclose(out[:3][~poisoned[:3]], ref[:3][~poisoned[:3]], atol=3e-2, rtol=3e-2)
    assert not out[3:].any()


@pytest.mark.parametrize("hkv, hq", [(2, 8), (4, 16)])
def test_token_major_bf16_compact_and_stacked_pairs(hkv, hq):
    """The pair path's two forms in one q block (G = 4, 16 narrow rows): items of at most 8 rows
    (a decode token's 4 rows, a 2-token chunk's 8) take the compact form, where head 2m + 1's
    rows ride in the rows the item does not own; a 3-token chunk's 12 rows take the stacked
    form. Every sequence against the f32 reference, windowed and soft-capped, with sinks."""
    rng = np.random.default_rng(hkv)
    b = make_token_major(
        rng, [1, 3, 1, 2], [37, 70, 9, 48], dtype=jax.numpy.bfloat16, hkv=hkv, hq=hq
    )
    sinks = rng.standard_normal(hq).astype(np.float32)
    args = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    caches = [reference.write_kv_token_major_ref(b[n], b["new_" + n], *args) for n in ("k", "v")]
    kw = dict(sliding_window=60, soft_cap=25.0, sinks=sinks)
    out = kernel.paged_attention_token_major(
        b["q"], *[jax.numpy.asarray(c) for c in caches], *args, interpret=True, **kw
    )
    out = np.asarray(out.astype(np.float32))
    ref = reference.paged_attention_token_major_ref(b["q"], *caches, *args, **kw)
    n = int(b["cu"][-1])
    np.testing.assert_allclose(out[:n], ref[:n], atol=3e-2, rtol=3e-2)
    assert not out[n:].any()


def test_token_major_rejects_unpackable_heads():
    b = make_token_major(np.random.default_rng(0), [1], [3], dtype=jax.numpy.bfloat16, hkv=3, hq=3)
    with pytest.raises(ValueError, match="even number of KV heads"):
        kernel.paged_attention_token_major(
            b["q"], b["k"], b["v"], b["kv_lens"], b["pt"], b["cu"], b["ns"], interpret=True
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    [
        dict(q_lens=[3, 1], kv_lens=[40, 17], window=None, stream=False, dtype="float32"),
        dict(q_lens=[2, 1, 4], kv_lens=[2, 33, 48], window=20, stream=True, dtype="bfloat16"),
        # two pages an item: slots filled by full pages (waited for by one wait per array), a
        # slot half filled, and one ending in a partly filled page
        dict(
            q_lens=[1, 1, 1],
            kv_lens=[32, 48, 40],
            window=None,
            stream=False,
            dtype="float32",
            pages_per_block=2,
        ),
    ],
    ids=["mixed_f32", "window_streamed_bf16", "decode_two_page_slots_f32"],
)
def test_token_major_tpu_interpret(case):
    """TPU interpret mode (races, NaN-filled VMEM, raising out-of-bounds reads) over the whole call,
    cache write included, counted by tpu_interpreter.count_traffic: DMA count and bytes, BlockSpec
    bytes and scalar-prefetch bytes equal tiling.traffic / estimate_cost exactly; the cache bytes
    moved are only the pages read and the new rows written. DMAs run when waited for
    (`dma_execution_mode="on_wait"`): a wait that took less than its copies signalled would leave
    NaN in the slot."""
    slots, pages, tokens, hq, hkv = 3, 3, 8, 4, 2
    dtype = np.dtype(case["dtype"]) if case["dtype"] == "float32" else jax.numpy.bfloat16
    b = make_token_major(
        np.random.default_rng(7),
        case["q_lens"],
        case["kv_lens"],
        num_slots=slots,
        pages_per_seq=pages,
        tokens=tokens,
        hq=hq,
        hkv=hkv,
        dtype=dtype,
    )
    cfg = tiling.PagedAttentionConfig(
        pages_per_block=case.get("pages_per_block", 1),
        stream_page_table=case["stream"],
        block_q=4 if case["stream"] else None,
    )
    params = tpu_interpreter.counting_params(detect_races=True, dma_execution_mode="on_wait")
    with tpu_interpreter.race_checked(), tpu_interpreter.count_traffic(params) as t:
        run_token_major(
            b,
            sliding_window=case["window"],
            config=cfg,
            interpret=False,
            tol=2e-5 if case["dtype"] == "float32" else 3e-2,
        )
    kw = dict(
        q_lens=case["q_lens"],
        kv_lens=case["kv_lens"],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
        page_size=PS,
        pages_per_seq=pages,
        max_num_seqs=slots,
        num_tokens=tokens,
        q_dtype=case["dtype"],
        kv_dtype=case["dtype"],
        sliding_window=case["window"],
        token_major=True,
        write_new_kv=True,
        config=cfg,
    )
    tr = tiling.traffic(**kw)
    assert t.calls == 2  # the writer and the attention kernel
    assert t.dma_count == tr["kv_dmas"] + tr["pt_dmas"] + tr["write_dmas"]
    assert t.dma_bytes == tr["kv_dma_bytes"] + tr["pt_dma_bytes"] + tr["write_bytes"] // 2
    assert t.blockspec_read_bytes + t.blockspec_write_bytes == tr["qo_block_bytes"]
    assert t.prefetch_bytes == tr["smem_bytes"] + tr["write_slot_bytes"]
    assert t.hbm_bytes + t.prefetch_bytes == tiling.estimate_cost(**kw).hbm_bytes


# -------------------------------------------------------------------------------------------------
# Quantised token-major caches (int8, float8_e4m3fn) and attention sinks
# -------------------------------------------------------------------------------------------------

QPS = 128  # per-token scales need lane-aligned pages
# Serving tolerances, as a fraction of the output's largest magnitude, against the f32 reference
# over the *unquantised* K/V: int8 with per-token-per-head scales keeps ~2-3 significant digits,
# e4m3 (3 mantissa bits) ~1.5. Against the f32 reference over the dequantised cache the kernel is
# as exact as its bf16 probabilities (QUANT_KERNEL_TOL).
QUANT_TOL = {"int8": 0.02, "fp8": 0.08}
QUANT_KERNEL_TOL = 0.01


def make_quantised(
    rng,
    q_lens,
    kv_lens,
    qdtype,
    *,
    hkv=4,
    hq=8,
    tokens=16,
    num_slots=3,
    pages_per_seq=2,
    head_scales=True,
):
    """Token-major K/V of standard-normal values quantised per token and head (symmetric, absmax),
    the per-token scales [nb, Hkv, bs], per-head static scales, the unquantised values and sinks."""
    n = len(q_lens)
    nb = num_slots * pages_per_seq + 2
    x = rng.standard_normal((2, nb, QPS, hkv, D)).astype(np.float32)
    qmax = 127.0 if qdtype == "int8" else 448.0
    amax = np.maximum(np.abs(x).max(-1), 1e-6)
    xq = x / (amax[..., None] / qmax)
    if qdtype == "int8":
        xq = np.clip(np.round(xq), -127, 127)
    cdt = jax.numpy.int8 if qdtype == "int8" else jax.numpy.float8_e4m3fn
    kq, vq = (np.asarray(jax.numpy.asarray(a).astype(cdt)) for a in xq)
    tsc = (amax / qmax).transpose(0, 1, 3, 2).astype(np.float32)  # [2, nb, Hkv, bs]
    hs = (rng.uniform(0.5, 2.0, (2, hkv)) if head_scales else np.ones((2, hkv))).astype(np.float32)
    pt = rng.permutation(nb)[: num_slots * pages_per_seq].reshape(num_slots, pages_per_seq)
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kl = np.zeros(num_slots, np.int32)
    kl[:n] = kv_lens
    q = np.asarray(
        jax.numpy.asarray(rng.standard_normal((tokens, hq, D))).astype(jax.numpy.bfloat16)
    )
    return dict(
        q=q,
        k=kq,
        v=vq,
        k_scale=tsc[0],
        v_scale=tsc[1],
        k_head=hs[0],
        v_head=hs[1],
        x=x,
        kv_lens=kl,
        pt=pt.astype(np.int32),
        cu=cu,
        ns=np.array([n], np.int32),
        sinks=rng.standard_normal(hq).astype(np.float32),
    )


def _check_quantised(b, qdtype, interpret, *, sliding_window=None):
    f = jax.jit(
        functools.partial(
            kernel.paged_attention_token_major, interpret=interpret, sliding_window=sliding_window
        )
    )
    out = f(
        b["q"],
        b["k"],
        b["v"],
        b["kv_lens"],
        b["pt"],
        b["cu"],
        b["ns"],
        k_scale=b["k_scale"],
        v_scale=b["v_scale"],
        k_head_scale=b["k_head"],
        v_head_scale=b["v_head"],
        sinks=b["sinks"],
    )
    assert out.dtype == jax.numpy.bfloat16
    out = np.asarray(out.astype(np.float32))
    live = int(b["cu"][-1])
    args = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    kw = dict(sliding_window=sliding_window, sinks=b["sinks"])
    q32 = b["q"].astype(np.float32)
    deq = [reference.dequantize_token_major(b[n], b[n + "_scale"], b[n + "_head"]) for n in "kv"]
    ref_deq = reference.paged_attention_token_major_ref(q32, *deq, *args, **kw)
    raw = [
        reference.dequantize_token_major(b["x"][i], None, b[n + "_head"])
        for i, n in enumerate("kv")
    ]
    ref_raw = reference.paged_attention_token_major_ref(q32, *raw, *args, **kw)
    scale = np.abs(ref_raw[:live]).max()
    assert np.isfinite(out).all() and not out[live:].any()
    assert np.abs(out[:live] - ref_deq[:live]).max() <= QUANT_KERNEL_TOL * scale
    assert np.abs(out[:live] - ref_raw[:live]).max() <= QUANT_TOL[qdtype] * scale


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@settings(max_examples=3, deadline=None)
@given(batch=batches("mixed"), window=st.sampled_from([None, 100]))
def test_quantised_caches_match_reference(qdtype, batch, window):
    """8-bit pages dequantised in the kernel (plain interpret mode runs Mosaic's word unpacking),
    per-token-per-head and per-head scales and sinks, against the f32 references (module-level
    tolerances)."""
    q_lens, kv_lens, seed = batch
    kv_lens = [min(2 * QPS, k * 3) for k in kv_lens]
    q_lens = [min(q, k, 5) for q, k in zip(q_lens, kv_lens)][:3]
    kv_lens = kv_lens[:3]
    b = make_quantised(np.random.default_rng(seed), q_lens, kv_lens, qdtype)
    _check_quantised(b, qdtype, True, sliding_window=window)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_quantised_tpu_interpret_and_bytes(qdtype):
    """TPU interpret mode (races, NaN VMEM, OOB) on 8-bit pages with per-token scales; the DMA
    counter's bytes equal the closed form, and the KV bytes of the call are half of the same
    batch's bf16 call (the scales add Hkv * 4 bytes per token and cache: +3% at D = 128)."""
    q_lens, kv_lens = [1, 3], [200, 77]
    b = make_quantised(np.random.default_rng(5), q_lens, kv_lens, qdtype, tokens=8, num_slots=2)
    params = tpu_interpreter.counting_params(detect_races=True, dma_execution_mode="on_wait")
    with tpu_interpreter.race_checked(), tpu_interpreter.count_traffic(params) as t:
        _check_quantised(b, qdtype, False)
    kw = dict(
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=D,
        page_size=QPS,
        pages_per_seq=2,
        max_num_seqs=2,
        num_tokens=8,
        q_dtype="bfloat16",
        token_major=True,
    )
    kv_dtype = "int8" if qdtype == "int8" else jax.numpy.float8_e4m3fn
    tr = tiling.traffic(kv_dtype=kv_dtype, token_scales=True, sinks=True, head_scales=True, **kw)
    bf16 = tiling.traffic(kv_dtype="bfloat16", **kw)
    assert t.dma_count == tr["kv_dmas"] + tr["scale_dmas"]
    assert t.dma_bytes == tr["kv_dma_bytes"] + tr["scale_dma_bytes"]
    assert t.blockspec_read_bytes + t.blockspec_write_bytes == (
        tr["qo_block_bytes"] + tr["sink_bytes"] + tr["head_scale_bytes"]
    )
    assert (
        t.hbm_bytes + t.prefetch_bytes
        == tiling.estimate_cost(
            kv_dtype=kv_dtype, token_scales=True, sinks=True, head_scales=True, **kw
        ).hbm_bytes
    )
    assert tr["kv_dma_bytes"] * 2 == bf16["kv_dma_bytes"]
    assert tr["kv_dma_bytes"] + tr["scale_dma_bytes"] <= 0.55 * bf16["kv_dma_bytes"]


def test_fp8_pages_as_uint8_bytes_match_float8():
    """e4m3 caches passed as their raw bytes (uint8, as the torch functions pass them: a float8
    bitcast of a whole cache is a copy on TPU) give the float8 caches' output bit for bit, and the
    writer stores a float new token's e4m3 bytes into a uint8 cache."""
    b = make_quantised(np.random.default_rng(2), [1, 3], [150, 40], "fp8", tokens=8, num_slots=2)
    new = np.random.default_rng(3).standard_normal((8, 4, D)).astype(np.float32)
    f = jax.jit(functools.partial(kernel.paged_attention_token_major, interpret=True))
    outs = []
    for as_bytes in (False, True):
        k, v = (jax.numpy.asarray(b[n]) for n in "kv")
        if as_bytes:
            k, v = (jax.lax.bitcast_convert_type(x, jax.numpy.uint8) for x in (k, v))
        outs.append(
            f(
                b["q"],
                k,
                v,
                b["kv_lens"],
                b["pt"],
                b["cu"],
                b["ns"],
                new_k=new,
                new_v=-new,
                k_head_scale=b["k_head"],
                v_head_scale=b["v_head"],
            )
        )
    (o8, k8, v8), (ou, ku, vu) = outs
    assert ku.dtype == jax.numpy.uint8
    assert np.asarray(o8).tobytes() == np.asarray(ou).tobytes()
    for x8, xu in ((k8, ku), (v8, vu)):
        assert np.asarray(jax.lax.bitcast_convert_type(x8, jax.numpy.uint8)).tobytes() == (
            np.asarray(xu).tobytes()
        )


def _quantised_call(b, token_scales: bool, caches=None, **kw):
    """paged_attention_token_major over make_quantised's caches (or `caches`) with per-head static
    scales and sinks, and per-token scales when `token_scales`; the output as f32."""
    k, v = caches if caches is not None else (b["k"], b["v"])
    scales = dict(k_scale=b["k_scale"], v_scale=b["v_scale"]) if token_scales else {}
    out = kernel.paged_attention_token_major(
        b["q"], k, v, b["kv_lens"], b["pt"], b["cu"], b["ns"],
        k_head_scale=b["k_head"], v_head_scale=b["v_head"], sinks=b["sinks"],
        interpret=True, **scales, **kw,
    )  # fmt: skip
    return np.asarray(out.astype(np.float32))


def _quantised_ref(b, token_scales: bool, **kw):
    deq = [
        reference.dequantize_token_major(
            b[n], b[n + "_scale"] if token_scales else None, b[n + "_head"]
        )
        for n in "kv"
    ]
    args = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    return reference.paged_attention_token_major_ref(
        b["q"].astype(np.float32), *deq, *args, sinks=b["sinks"], **kw
    )


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("hkv, hq, token_scales", [(8, 32, True), (8, 24, True), (4, 16, False)])
def test_8bit_quad_path_and_per_head_items(qdtype, hkv, hq, token_scales):
    """8-bit decode items of at most a quarter of the 16 narrow rows take the quad path
    (kernel.py compute_head_quads: four KV heads per word, heads 4j + 1..3's q rows rotated into
    rows the item does not own, G = 4 aligned and G = 3 straddling the quarters); a 2-4 token
    chunk in the same q block takes the per-head path. Per-token scales (8 KV heads: spread over
    the score columns by the MXU) or per-head static scales only (4 KV heads), windowed,
    soft-capped, with sinks, against the f32 reference over the dequantised cache."""
    g = hq // hkv
    assert tiling.compact_rows(jax.numpy.int8, hkv, True, g, 16, token_scales) == 4
    b = make_quantised(
        np.random.default_rng(hkv + hq), [1, 2, 1, 1], [200, 77, 256, 130], qdtype,
        hkv=hkv, hq=hq, tokens=16, num_slots=4,
    )  # fmt: skip
    kw = dict(sliding_window=150, soft_cap=30.0)
    out = _quantised_call(b, token_scales, **kw)
    ref = _quantised_ref(b, token_scales, **kw)
    live = int(b["cu"][-1])
    assert not out[live:].any()
    assert np.abs(out[:live] - ref[:live]).max() <= QUANT_KERNEL_TOL * np.abs(ref[:live]).max()


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_8bit_quads_hand_the_stored_bytes_to_the_matmuls(qdtype):
    """The decode quads' score and probability matmuls take the 8-bit keys and values as stored
    (a bf16 x int8 / e4m3 dot_general in the kernel's jaxpr, which Mosaic converts on the way into
    the MXU): no [4 * kv_tok, D] bf16 copy of the quad's keys is made in VMEM, the thing that cost
    e4m3 ~4,500 selects and compares per 1024-token step on v5e / v6e. The per-head path (2-4
    token chunks) still widens per head."""
    b = make_quantised(
        np.random.default_rng(5), [1, 1], [200, 77], qdtype, hkv=8, hq=32, tokens=8,
    )  # fmt: skip
    scales = dict(k_scale=b["k_scale"], v_scale=b["v_scale"])
    jaxpr = jax.make_jaxpr(
        lambda q, k, v: kernel.paged_attention_token_major(
            q, k, v, b["kv_lens"], b["pt"], b["cu"], b["ns"], interpret=True, **scales
        )
    )(b["q"], b["k"], b["v"])

    def dots(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                yield tuple(str(x.aval.dtype) for x in eqn.invars)
            for sub in jax_core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    want = "int8" if qdtype == "int8" else "float8_e4m3fn"
    found = list(dots(jaxpr.jaxpr))
    assert ("bfloat16", want) in found, found  # scores and probabilities, quads
    assert found.count(("bfloat16", want)) >= 2


def test_quad_path_spreads_token_scales_exactly():
    """The quad path's per-token scale spreading (kernel.py `_spread_scales` with the
    `_write_spread_matrix` 0/1 matrix, on the MXU in the kernel) reproduces every f32 scale bit
    for bit at its four columns, for scales using all 24 significant bits over a wide exponent
    range (one bf16 part, or two, would round them)."""
    jnp = jax.numpy
    t = tiling.SPREAD_TOKENS
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 4 * t)) * np.exp2(rng.integers(-20, 20, (8, 4 * t)))).astype(
        np.float32
    )
    x[0, :8] = np.float32(1 + 2.0**-23)  # needs the third part

    def body(x_ref, o_ref, m_ref):
        kernel._write_spread_matrix(m_ref)
        o_ref[...] = kernel._spread_scales(x_ref[...], m_ref[...])

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((4 * 8, 4 * t), jnp.float32),
        scratch_shapes=[pltpu.VMEM((3 * t, 4 * t), jnp.bfloat16)],
        interpret=True,
    )(x)
    want = np.concatenate([np.repeat(x[:, c * t : (c + 1) * t], 4, axis=1) for c in range(4)])
    assert np.asarray(out).tobytes() == want.tobytes()


def test_8bit_quad_path_keeps_sequences_apart():
    """A NaN in one valid e4m3 key and value (sequence 1, KV head 5) reaches that sequence's
    token on the quad of KV heads 4..7 (the other heads' probabilities are 0 at its column, and
    0 * NaN is NaN in the probability matmul, as in the pair path) and nothing else; a NaN in
    stale slots past kv_len, per-token scales included, reaches nothing. (Interpret mode reads
    the NaN code as NaN; the v5e chip's MXU reads it as 480 in the quads' bf16 x e4m3 matmuls,
    benchmarks/fp8_mxu_probe.py, which keeps the sequences apart too.)"""
    b = make_quantised(
        np.random.default_rng(11), [1, 1, 1], [200, 77, 130], "fp8", hkv=8, hq=32, tokens=8,
    )  # fmt: skip
    ref = _quantised_ref(b, True)
    k, v = (np.array(b[n]) for n in "kv")
    page, row = b["pt"][1, 5 // QPS], 5 % QPS
    for c in (k, v):
        c[page, row, 5] = np.nan
        c[b["pt"][2, 1], 130 - QPS :] = np.nan  # sequence 2's stale rows past kv_len
    for sc in ("k_scale", "v_scale"):
        b[sc] = np.array(b[sc])
        b[sc][b["pt"][2, 1], :, 130 - QPS :] = np.nan
    out = _quantised_call(b, True, caches=(k, v))
    poisoned = np.zeros(out.shape[:2], bool)
    poisoned[1, 4 * 4 : 8 * 4] = True  # token 1 is sequence 1's; query heads of KV heads 4..7
    assert np.isnan(out[poisoned]).all()
    live = int(b["cu"][-1])
    clean = ~poisoned[:live]
    err = np.abs(out[:live][clean] - ref[:live][clean]).max()
    assert err <= QUANT_KERNEL_TOL * np.abs(ref[:live]).max()


def test_sinks_head_major_and_bf16_token_major():
    """Sinks also in the head-major kernel and with bf16 token-major pages."""
    rng = np.random.default_rng(2)
    sinks = rng.standard_normal(HQ).astype(np.float32) * 2
    b = make_batch(rng, [3, 1, 7], [33, 1, 7])
    out = np.asarray(
        kernel.ragged_paged_attention(
            b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], sinks=sinks, interpret=True
        )
    )
    ref = reference.ragged_paged_attention_ref(
        b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], sinks=sinks
    )
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    t = make_token_major(rng, [3, 1], [33, 17], dtype=jax.numpy.bfloat16)
    out = kernel.paged_attention_token_major(
        t["q"], t["k"], t["v"], t["kv_lens"], t["pt"], t["cu"], t["ns"], sinks=sinks, interpret=True
    )
    ref = reference.paged_attention_token_major_ref(
        t["q"], t["k"], t["v"], t["kv_lens"], t["pt"], t["cu"], t["ns"], sinks=sinks
    )
    live = int(t["cu"][-1])
    np.testing.assert_allclose(
        np.asarray(out.astype(np.float32))[:live], ref[:live], atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(k_scale=np.ones((8, 4, QPS - 1), np.float32)), r"k_scale: expected shape"),
        (dict(k_head_scale=np.ones(3, np.float32)), r"k_head_scale: expected shape \(4,\)"),
        (dict(sinks=np.ones(3, np.float32)), r"sinks: expected shape \(8,\)"),
        (dict(k_scale=None), "together"),
    ],
)
def test_quantised_bad_scales_refused_before_any_kernel(bad, match, monkeypatch):
    b = make_quantised(np.random.default_rng(0), [1], [3], "int8", num_slots=1, pages_per_seq=1)
    kw = dict(
        k_scale=b["k_scale"],
        v_scale=b["v_scale"],
        k_head_scale=b["k_head"],
        v_head_scale=b["v_head"],
        sinks=b["sinks"],
    )
    kw.update(bad)
    monkeypatch.setattr(kernel.pl, "pallas_call", lambda *a, **k: pytest.fail("kernel ran"))
    with pytest.raises(ValueError, match=match):
        kernel.paged_attention_token_major(
            b["q"], b["k"], b["v"], b["kv_lens"], b["pt"], b["cu"], b["ns"], interpret=True, **kw
        )


def test_step_loop_trips_count_pages_partial_items_and_q_blocks():
    """The kernel's loops' iterations over a call, as it runs them: the page loops take an
    item's full pages (a last page copied short is not one of them: the item loop's branch takes
    it; an item whose full pages fill its slot is started in straight-line code, unless it is
    the call's first, and waited for without the wait loop), the
    stale-slot zeroing an item's slots past its valid keys, and around each q block's
    items its grid step's init / write-back, one iteration per 16-row chunk."""
    # q block 0: a sequence of 300 keys (3 pages, the last of 44 rows) and one of 256 (2 full
    # pages); q block 1: an empty item, and the first 4 pages of a 640-key sequence
    items = [(0, 0, 0, 3), (0, 1, 0, 2), (1, -1, 0, 0), (1, 2, 0, 4)]
    kv_lens = [300, 256, 640]
    kw = dict(kv_dtype="int8", num_kv_heads=8, token_major=True, page_size=128, pages_per_block=4)
    trips = tiling.step_loop_trips(items, kv_lens, rows=64, out_dtype="float32", **kw)
    assert trips == {
        "block": {
            "init": 2 * 4,  # two q blocks of 64 rows, 16 per iteration
            "write_back": 2 * 4,
        },
        "item": {
            # every item is started; two take the rolled page copies (a partly filled last
            # page, two pages of four), the last fills its slot (started straight-line)
            "item_fetch": (4, 2),
            "item_fetch/page_copies": 2 + 2,
            "page_waits": 2 + 2 + 0,  # the last item fills its slot: one wait, no loop
            "stale_zeroing": (4 - 2) + (4 - 2) + 0,
        },
    }
    # 62 rows round up to whole copy tiles (4 tokens of 8 heads: 64), still short of a page; a
    # page filled to its last tile (125 rows: 128) is a full page
    assert tiling.step_loop_trips(
        items, [2 * 128 + 62, 256, 640], rows=64, out_dtype="float32", **kw
    )["item"]["item_fetch"] == (4, 2)
    full = tiling.step_loop_trips(
        items, [2 * 128 + 125, 256, 640], rows=64, out_dtype="float32", **kw
    )["item"]
    assert full["item_fetch"] == (4, 2) and full["item_fetch/page_copies"] == 3 + 2
    assert full["page_waits"] == 3 + 2 + 0
    # the call's first item takes the rolled copies even where it fills its slot
    first = tiling.step_loop_trips(items[3:], kv_lens, rows=64, out_dtype="float32", **kw)
    assert first["item"]["item_fetch"] == (1, 1) and first["item"]["item_fetch/page_copies"] == 4
    assert first["item"]["page_waits"] == 0
    # a q block of 8 bf16 rows is written in one straight-line pass: no init / write-back loop;
    # the quad path's spreading matrix: 3 x 128 rows of bf16 tiles of 16, once per call
    small = tiling.step_loop_trips(
        items, kv_lens, rows=8, out_dtype="bfloat16", spread_matrix=True, **kw
    )
    assert small["block"] == {"spread_matrix": 24}
    assert list(small["item"]) == [
        "item_fetch", "item_fetch/page_copies", "page_waits", "stale_zeroing"
    ]  # fmt: skip


def test_compute_path_rule_shared_by_cost_model_and_benchmarks():
    """One helper (schedule.compute_path, summed by path_runs) decides which compute path an item
    takes, for the cost model's issued MXU FLOPs and unit counts and the benchmarks' per-path
    step counts (kernel.py's traced twin compares the same row slices and row counts)."""
    path = tiling.compute_path
    # G = 4 rows per token, 64-token q blocks (256 rows), 16-row narrow slices.
    kw = dict(block_q=64, group=4, narrow=16)
    assert path(5, 6, 0, **kw) == "narrow"  # one decode token: rows 20..23
    assert path(68, 72, 1, **kw) == "narrow"  # 4 tokens, one slice
    assert path(3, 5, 0, **kw) == "whole"  # rows 12..19 cross a slice edge
    assert path(0, 200, 1, **kw) == "whole"  # a prefill's whole block
    assert path(0, 1, 0, block_q=4, group=4, narrow=16) == "narrow"  # the narrow code only
    # Where the pair path compiles its compact form: items of at most 8 of the 16 rows.
    assert path(5, 6, 0, compact=8, **kw) == "compact"  # a decode token's 4 rows
    assert path(68, 70, 1, compact=8, **kw) == "compact"  # 2 tokens: 8 rows
    assert path(68, 71, 1, compact=8, **kw) == "narrow"  # 3 tokens: 12 rows, stacked form
    assert path(3, 5, 0, compact=8, **kw) == "whole"
    # The 8-bit quad path: items of at most 4 of the 16 rows (one token of G <= 4).
    assert path(5, 6, 0, compact=4, **kw) == "compact"
    assert path(68, 70, 1, compact=4, **kw) == "narrow"  # 2 tokens: the per-head path
    assert tiling.compute_paths(rows=256, narrow=16, compact=8) == ("compact", "narrow", "whole")
    assert tiling.compute_paths(rows=16, narrow=16) == ("narrow",)
    # compact is compiled for paired 16-bit token-major heads whose token fills <= half a slice,
    # and for 8-bit heads in fours whose token fills <= a quarter (per-token scales: 8k heads)
    bf16, i8, e4m3 = jax.numpy.bfloat16, jax.numpy.int8, jax.numpy.float8_e4m3fn
    assert tiling.compact_rows(bf16, 8, True, 4, 16) == 8
    assert tiling.compact_rows(bf16, 8, True, 16, 16) == 0  # G = 16: a token fills the slice
    assert tiling.compact_rows(bf16, 8, False, 4, 16) == 0  # head-major: no pairs
    assert tiling.compact_rows(i8, 8, True, 4, 16, token_scales=True) == 4
    assert tiling.compact_rows(e4m3, 4, True, 4, 16) == 4  # static scales: 4 heads suffice
    assert tiling.compact_rows(i8, 4, True, 4, 16, token_scales=True) == 0
    assert tiling.compact_rows(i8, 8, True, 8, 16) == 0  # G = 8: half the slice
    runs = tiling.path_runs(
        [(0, 0, 0, 2), (0, 1, 0, 1), (0, 2, 0, 3), (0, 3, 0, 0)], [1, 3, 12, 1],
        compact=8, **kw,
    )  # fmt: skip
    assert runs == {"compact": 1, "narrow": 1, "whole": 1}  # the empty item takes none
    # The cost model charges a decode batch narrow rows only, whole blocks to the prefill.
    kw = dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, pages_per_seq=P)
    cfg = tiling.PagedAttentionConfig(block_q=32, pages_per_block=2)
    t = tiling.traffic(q_lens=[1, 1, 1], kv_lens=[40, 17, 80], config=cfg, **kw)
    nr = tiling.narrow_rows(HQ // HKV, 32 * HQ // HKV)
    per_item = 4 * HKV * nr * 2 * PS * D
    assert t["mxu_flops"] == per_item * sum(1 for it in t["items"] if it[3] > 0)
    t2 = tiling.traffic(q_lens=[1, 30], kv_lens=[40, 80], config=cfg, **kw)
    wide = [it for it in t2["items"] if it[1] == 1]
    rows = 32 * HQ // HKV
    assert t2["mxu_flops"] == 4 * HKV * 2 * PS * D * (
        nr * (len(t2["items"]) - len(wide)) + rows * len(wide)
    )
    # Each busy item is one compute tile of the shared ranking model, counted on its own path.
    c2 = tiling.estimate_cost(q_lens=[1, 30], kv_lens=[40, 80], config=cfg, **kw)
    assert c2.compute_tiles == len(t2["items"])  # every item of this batch has pages
    narrow_u = tiling.item_units(
        tiling.get_generation(None), rows=nr, kv_tokens=2 * PS, num_kv_heads=HKV,
        head_dim=D, kv_dtype="float32",
    )  # fmt: skip
    wide_u = tiling.item_units(
        tiling.get_generation(None), rows=rows, kv_tokens=2 * PS, num_kv_heads=HKV,
        head_dim=D, kv_dtype="float32",
    )  # fmt: skip
    n_narrow = len(t2["items"]) - len(wide)
    assert c2.mxu_pushes == round(
        n_narrow * narrow_u["mxu_pushes"] + len(wide) * wide_u["mxu_pushes"]
    )
    assert c2.step_vregs > 0 and c2.valu_ops > 0 and c2.vmem_loads > 0


# -------------------------------------------------------------------------------------------------
# Tile ranking: the decode unit counts against libtpu's LLO dumps (tile_model_calibration.json)
# -------------------------------------------------------------------------------------------------

CALIBRATION = ROOT_DIR / "benchmarks" / "results" / "tile_model_calibration.json"


def _paged_points():
    paged = json.loads(CALIBRATION.read_text())["paged_points"]
    return paged["points"], paged["tolerance"]


def test_decode_unit_model_within_tolerance_of_paged_dumps():
    """The shared model on the paged unit counts (tiling.decode_step_bundles: the decode compute
    path plus the step's own code) stays within the stated tolerance of every dumped busy decode
    step, on every tested generation, both cache layouts and the 8-bit caches; and the recorded
    model numbers are what the code computes now (a constant changed without refitting fails;
    benchmarks/paged_dump_targets.py --recalibrate / --recompute rewrites them)."""
    import paged_dump_targets

    points, tol = _paged_points()
    assert {p["generation"] for p in points} == {"v5e", "v6e", "tpu7x"}
    assert {(p["layout"], p["kv_dtype"]) for p in points} >= {
        ("head_major", "bfloat16"),
        ("token_major", "bfloat16"),
        ("token_major", "int8"),
        ("token_major", "float8_e4m3fn"),
    }
    for p in points:
        m = paged_dump_targets.remodelled(p, tiling)
        assert m["model_busy_step_bundles"] == pytest.approx(
            p["model_busy_step_bundles"], abs=1.0
        ), p["shape"]
        assert abs(m["model_error"]) <= tol, (p["generation"], p["shape"], p["tiles"])
    # The token-major dumps also hold the narrow path's other form: the pair path's stacked form
    # (bf16) or the per-head path (8-bit), what 2-4 token chunks take, held to the same
    # tolerance per tile; the compact form (pairs, quads) is the cheaper one.
    others = [p for p in points if "dump_narrow_path_bundles" in p]
    assert {(p["generation"], p["kv_dtype"]) for p in others} == {
        (g, dt) for g in ("v5e", "v6e", "tpu7x") for dt in ("bfloat16", "int8", "float8_e4m3fn")
    }
    for p in others:
        m = paged_dump_targets.remodelled(p, tiling)
        assert m["model_narrow_tile_bundles"] == pytest.approx(
            p["model_narrow_tile_bundles"], abs=1.0
        )
        assert abs(m["narrow_tile_error"]) <= tol, (p["generation"], p["shape"], "narrow")
        assert p["dump_path_bundles"] < p["dump_narrow_path_bundles"]  # compact is cheaper


def test_decode_cost_ranks_kv_blocks_by_unit_counts():
    """decode_cost carries the unit counts (the model no longer falls back to the MXU FLOP
    floor): at the named decode batch, larger KV blocks rank faster on every generation (fewer
    per-item and per-step fixed bundles), block_q alone changes nothing (left to the preference
    order), and 8-bit pages with per-token scales cost less compute per byte with e4m3 (the quads'
    bf16 x e4m3 matmuls, nothing widened) than with int8, DMA-bound on v5e / v6e and, at 8-page
    KV blocks, still compute-bound on TPU7x, as the dumps are."""
    gens = tiling._generations
    kw = dict(
        num_tokens=64,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        page_size=128,
        pages_per_seq=64,
        q_dtype="bfloat16",
    )
    for name in ("v5e", "v6e", "tpu7x"):
        gen = tiling.GENERATIONS[name]

        def cost(ppb, bq=64, kv_dtype="bfloat16", gen=gen, **extra):
            return tiling.decode_cost(
                gen, block_q=bq, pages_per_block=ppb, kv_dtype=kv_dtype, **kw, **extra
            )

        secs = [gens.ranked_seconds(cost(p), gen) for p in (8, 4, 2, 1)]
        assert secs == sorted(secs), (name, secs)
        assert cost(8).compute_tiles == 64 * 8 and cost(8).valu_ops > 0
        # a q block of 16 of the 64 decode tokens: the same items in four grid steps, not one
        assert gens.ranked_seconds(cost(8, bq=16), gen) == pytest.approx(
            secs[0] + 3 * gen.step_overhead_s
        )

        def compute_over_dma(c, gen=gen):
            bundles = gens.tile_bundles(
                gen,
                mxu_pushes=c.mxu_pushes,
                eup_pushes=c.eup_pushes,
                valu_ops=c.valu_ops,
                vmem_loads=c.vmem_loads,
                tiles=c.compute_tiles,
            ) + gens.step_bundles(gen, step_vregs=c.step_vregs, grid_steps=c.work_items)
            return (bundles / gen.clock_hz) / (c.hbm_bytes / gen.hbm_bytes_per_s)

        e4m3, int8 = (
            compute_over_dma(cost(8, kv_dtype=dt, token_major=True, token_scales=True))
            for dt in ("float8_e4m3fn", "int8")
        )
        assert e4m3 < int8, (name, e4m3, int8)
        assert (e4m3 > 1) if name == "tpu7x" else (e4m3 < 1), (name, e4m3)
        assert compute_over_dma(cost(8)) < 1


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "uint8"])
def test_8bit_token_major_decode_is_exact_for_every_byte(dtype):
    """The kernel's word-level decode of an 8-bit token-major slot (`_token_major_head_8bit`:
    a strided uint32 load, then the head's byte as bf16) gives every one of the 256 byte values
    exactly, for each of the four heads a word holds (uint8: e4m3 pages passed as their bytes;
    the e4m3 NaN codes 0x7F / 0xFF aside, which no writer stores for a finite value)."""
    jnp = jax.numpy
    hkv, tokens, d = 4, 64, 128
    codes = np.arange(tokens * hkv * d, dtype=np.int64) % 256
    raw = np.random.default_rng(7).permutation(codes).astype(np.uint8).reshape(1, tokens * hkv, d)
    slot = jnp.asarray(raw).view(dtype) if dtype != "uint8" else jnp.asarray(raw)

    def body(buf, out):
        words = {}
        for h in range(hkv):
            x = kernel._token_major_head_8bit(buf, 0, h, hkv, tokens, True, words, 0)
            out[h] = x.astype(jnp.float32)

    got = _interpret_call(body, slot, (hkv, tokens, d))
    as_float = raw.view(np.int8) if dtype == "int8" else raw.view(jnp.float8_e4m3fn)
    want = as_float.astype(np.float32).reshape(tokens, hkv, d).transpose(1, 0, 2)
    finite = np.isfinite(want)
    assert finite.sum() >= want.size * 254 // 256
    np.testing.assert_array_equal(np.asarray(got)[finite], want[finite])


def _interpret_call(body, x, out_shape):
    """`body(x_ref, out_ref)` as a Pallas call in interpret mode, an f32 `out_shape` output."""
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(out_shape, jax.numpy.float32),
        interpret=True,
    )(x)
