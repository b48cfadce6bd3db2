"""Kernel-level tests of paged attention: the Pallas kernel against a dense f32 reference (plain
interpret mode, hypothesis-drawn ragged batches), the work list against its host twin, the cache
write, and TPU interpret mode (races, NaN-filled memory, raising out-of-bounds reads, exact DMA
bytes against tiling.traffic)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_loader
from jax_bridge import tpu_interpret_params

PA = kernel_loader.load_kernel("paged_attention")
kernel, reference, tiling = PA.kernel, PA.reference, PA.tiling

# Small static shapes shared by every example, so each configuration compiles once.
S, P, PS, T = 4, 5, 16, 40  # sequence slots, pages per sequence, page size, q token capacity
HQ, HKV, D = 4, 2, 128
NUM_PAGES = S * P + 3


def make_batch(rng, q_lens, kv_lens, *, dtype=np.float32, separate=False, num_slots=S,
               pages_per_seq=P, page_size=PS, tokens=T, hq=HQ, hkv=HKV, d=D):
    """Random q and paged cache for the live sequences (q_lens, kv_lens). Every cache slot no live
    key occupies (pages of nobody, rows past kv_len) is NaN, so reading one shows up."""
    n = len(q_lens)
    num_pages = num_slots * pages_per_seq + 3
    c = hkv if separate else 2 * hkv
    caches = [np.full((num_pages, c, page_size, d), np.nan, np.float32)
              for _ in range(2 if separate else 1)]
    pt = rng.permutation(num_pages)[: num_slots * pages_per_seq].reshape(num_slots, pages_per_seq)
    for s in range(n):
        for pos in range(kv_lens[s]):
            for cache in caches:
                cache[pt[s, pos // page_size], :, pos % page_size] = rng.standard_normal((c, d))
    q = rng.standard_normal((tokens, hq, d)).astype(np.float32)
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    kl = np.zeros(num_slots, np.int32)
    kl[:n] = kv_lens
    caches = [x.astype(dtype) for x in caches]
    return dict(q=q.astype(dtype), kv=caches[0], v=caches[1] if separate else None,
                kv_lens=kl, pt=pt.astype(np.int32), cu=cu, ns=np.array([n], np.int32))


@functools.lru_cache(maxsize=None)
def jitted(sliding_window=None, soft_cap=None, causal=True, config=None, interpret=True):
    return jax.jit(functools.partial(kernel.ragged_paged_attention, sliding_window=sliding_window,
                                     soft_cap=soft_cap, causal=causal, config=config,
                                     interpret=interpret))


def run_and_check(b, *, sliding_window=None, soft_cap=None, causal=True, config=None, tol=2e-5):
    f = jitted(sliding_window, soft_cap, causal, config)
    out = np.asarray(f(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], v_pages=b["v"]),
                     np.float32)
    ref = reference.ragged_paged_attention_ref(
        b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], v_pages=b["v"],
        sliding_window=sliding_window, soft_cap=soft_cap, causal=causal)
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
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=20, soft_cap=30.0)],
                         ids=["plain", "window_softcap"])
@settings(max_examples=8)
@given(data=st.data())
def test_matches_reference(kind, opts, data):
    q_lens, kv_lens, seed = data.draw(batches(kind))
    b = make_batch(np.random.default_rng(seed), q_lens, kv_lens)
    out = run_and_check(b, **opts)
    # Tokens of no live sequence come back as zeros.
    assert not out[int(b["cu"][-1]):].any()


@pytest.mark.parametrize("config", [
    tiling.PagedAttentionConfig(block_q=8, pages_per_block=2),
    tiling.PagedAttentionConfig(block_q=4, pages_per_block=1, stream_page_table=True),
], ids=["bq8_ppb2", "bq4_ppb1_streamed_page_table"])
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
@given(batch=batches("mixed"), window=st.sampled_from([None, 1, 17, 40]),
       bq=st.sampled_from([4, 8, 40]), ppb=st.sampled_from([1, 2, 5]))
def test_work_list_matches_host_twin(batch, window, bq, ppb):
    """kernel.build_work_list (jnp, in the traced program) == tiling.work_list_numpy (host, used by
    estimate_cost), and the work list never lists a page outside the causal/window range."""
    q_lens, kv_lens, _ = batch
    n = len(q_lens)
    b = make_batch(np.random.default_rng(0), q_lens, kv_lens)
    nqb = -(-T // bq)
    # The window-aware bound the kernel uses must still hold every item.
    max_items = tiling.max_items_bound(num_q_blocks=nqb, max_num_seqs=S, pages_per_seq=P,
                                       pages_per_block=ppb, block_q=bq, page_size=PS,
                                       sliding_window=window)
    work, total = kernel.build_work_list(
        jax.numpy.asarray(b["kv_lens"]), jax.numpy.asarray(b["cu"]), jax.numpy.asarray(b["ns"]),
        block_q=bq, num_q_blocks=nqb, page_size=PS, pages_per_block=ppb, sliding_window=window,
        causal=True, max_items=max_items)
    work = np.asarray(work)
    host = tiling.work_list_numpy(q_lens, kv_lens, block_q=bq, num_q_blocks=nqb, page_size=PS,
                                  pages_per_block=ppb, sliding_window=window, causal=True)
    assert int(total) == len(host) <= max_items
    assert [tuple(int(x) for x in work[:, i]) for i in range(len(host))] == host
    assert (work[3, len(host):] == 0).all()
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
    got = np.asarray(jax.jit(kernel.write_kv)(b["kv"], new, b["kv_lens"], b["pt"], b["cu"], b["ns"]))
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def _shapes(seqs, pages, tokens):
    return (jax.ShapeDtypeStruct((tokens, 4, 128), np.float32),
            jax.ShapeDtypeStruct((8, 4, 16, 128), np.float32),
            jax.ShapeDtypeStruct((seqs,), np.int32), jax.ShapeDtypeStruct((seqs, pages), np.int32),
            jax.ShapeDtypeStruct((seqs + 1,), np.int32), jax.ShapeDtypeStruct((1,), np.int32))


def test_smem_bound():
    """A page table over PAGE_TABLE_SMEM_BYTES is streamed (the call traces); a work list over
    the SMEM budget is refused with a ValueError before the kernel is traced."""
    f = functools.partial(kernel.ragged_paged_attention, interpret=True)
    assert tiling.streams_page_table(512, 1024, tiling.PagedAttentionConfig())
    assert jax.eval_shape(f, *_shapes(512, 1024, 512)).shape == (512, 4, 128)
    with pytest.raises(ValueError, match="SMEM"):
        jax.eval_shape(f, *_shapes(4096, 1024, 4096))


# -------------------------------------------------------------------------------------------------
# TPU interpret mode
# -------------------------------------------------------------------------------------------------


@pytest.fixture
def dma_log(monkeypatch):
    """Every DMA the TPU interpreter executes: (bytes, src memory space, dst memory space)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    log = []
    orig = ipc.DMA.execute_read

    def execute_read(self):
        orig(self)
        if self.data is not None:
            log.append((self.data_size, self.src_memory_space, self.dst_memory_space))

    monkeypatch.setattr(ipc.DMA, "execute_read", execute_read)
    yield log
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()


def _races_found():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races is not None and ipc.races.races_found)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [
    dict(q_lens=[3, 1], kv_lens=[40, 17], window=None, separate=False, stream=False),
    dict(q_lens=[2, 1, 4], kv_lens=[2, 33, 48], window=20, separate=True, stream=False),
    dict(q_lens=[1, 5, 1], kv_lens=[9, 40, 31], window=None, separate=False, stream=True),
], ids=["mixed", "window_separate", "streamed_page_table"])
def test_tpu_interpret(case, dma_log):
    """Races, NaN-filled uninitialised VMEM and out-of-bounds reads raise or show; the output
    matches; the manual DMAs move exactly the pages tiling.traffic predicts."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    slots, pages, tokens, hq, hkv = 3, 3, 8, 2, 1
    b = make_batch(np.random.default_rng(7), case["q_lens"], case["kv_lens"], num_slots=slots,
                   pages_per_seq=pages, tokens=tokens, hq=hq, hkv=hkv, separate=case["separate"])
    cfg = tiling.PagedAttentionConfig(pages_per_block=1, stream_page_table=case["stream"],
                                      block_q=4 if case["stream"] else None)
    f = jax.jit(functools.partial(kernel.ragged_paged_attention, config=cfg,
                                  sliding_window=case["window"], interpret=tpu_interpret_params()))
    out = np.asarray(f(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"], v_pages=b["v"]))
    assert not _races_found()
    ref = reference.ragged_paged_attention_ref(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"],
                                               b["ns"], v_pages=b["v"], sliding_window=case["window"])
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    t = tiling.traffic(q_lens=case["q_lens"], kv_lens=case["kv_lens"], num_q_heads=hq,
                       num_kv_heads=hkv, head_dim=D, page_size=PS, pages_per_seq=pages,
                       max_num_seqs=slots, num_tokens=tokens, q_dtype="float32",
                       kv_dtype="float32", sliding_window=case["window"],
                       separate_kv=case["separate"], config=cfg)
    assert t["stream_page_table"] == case["stream"]
    assert len(dma_log) == t["kv_dmas"] + t["pt_dmas"]
    assert sum(n for n, _, _ in dma_log) == t["kv_dma_bytes"] + t["pt_dma_bytes"]


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_out_of_bounds_page_raises():
    """A page table entry past the cache is an out-of-bounds DMA read in TPU interpret mode (the
    torch ops refuse such tables before any kernel runs)."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    b = make_batch(np.random.default_rng(3), [2], [20], num_slots=1, pages_per_seq=2, tokens=8,
                   hq=2, hkv=1)
    b["pt"][0, 1] = b["kv"].shape[0] + 5
    f = jax.jit(functools.partial(kernel.ragged_paged_attention, interpret=tpu_interpret_params()))
    try:
        with pytest.raises(Exception, match="(?i)out.of.bounds"):
            jax.block_until_ready(f(b["q"], b["kv"], b["kv_lens"], b["pt"], b["cu"], b["ns"]))
    finally:
        pltpu.reset_tpu_interpret_mode_state()
