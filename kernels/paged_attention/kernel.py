"""Ragged paged attention: one Pallas TPU kernel for decode, chunked prefill and mixed batches.

Data. Queries of all sequences are packed along tokens, q [T, Hq, D], sequence s owning tokens
[cu_q_lens[s], cu_q_lens[s+1]). Its keys live in a paged, head-major cache: KV cache
[num_pages, 2 * Hkv, page_size, D] with K and V interleaved per KV head (index 2h is K of head h,
2h+1 its V), or two caches k/v [num_pages, Hkv, page_size, D]. page_table [S, pages_per_seq]
maps a sequence's page i to a cache page; kv_lens[s] keys are valid, the queries being the last
q_len positions among them (causal masking is aligned to the end of the sequence).

Schedule. The packed tokens are cut into q blocks of `block_q` tokens (a block may hold several
sequences: in decode, one block holds up to `block_q` sequences). A static work list, built by jnp
ops before the kernel and scalar-prefetched into SMEM, holds one item per (q block, sequence,
KV block) where a KV block is up to `pages_per_block` consecutive pages of that sequence that the
block's queries can see: pages past the last query position (causal) or entirely before the
sliding window are never listed, so they cost neither a DMA nor a step. The 1-D grid has one
step per q block; items of one q block are consecutive, and the step runs them in a rolled loop
(the work list says where each q block's items end), so the q block and its output block
(BlockSpecs indexed by the grid step) are fetched and written once, and f32 softmax statistics
and the accumulator, initialised before the loop and written out after it, stay in VMEM scratch
across the block's items. A decode batch (one q block) or one long sequence is one grid step:
a grid step's fixed cost is paid per q block, not per KV block.

KV traffic. Each item's pages are copied by manual DMAs straight from the cache in HBM (one DMA
per page per cache array, covering every KV head; a sequence's partly filled last page copies only
its valid rows, rounded up to the sublane tile, in a few power-of-two row chunks),
double-buffered: while item i is computed, the pages of item i+1 (of this q block or the next)
are in flight into the other slot; an item whose full pages fill its slot has them started in
straight-line code and waits for them with one wait per array, other items start and wait page by
page in rolled loops. A page is fetched once per q block that needs it. GQA: per KV
head, the q block's rows for that head's G query heads (laid out as [Hkv, T * G, D],
token-major) are multiplied against the head's K and V in one pass. Rows past kv_len and page slots an item did not fill are masked (K)
and zeroed (V), so stale or NaN cache contents never reach the output.

Page table. Kept whole in SMEM (scalar prefetch) when small; above tiling.PAGE_TABLE_SMEM_BYTES it
stays in HBM and each item's row is DMA'd into a two-row SMEM buffer two items ahead of compute
(one ahead of the KV prefetch that reads it).

Decode. An item whose sequence occupies only a 16-row aligned slice of the q block (one decode
token of G <= 16 heads) takes a narrow path that computes only those rows.

Token-major caches (`paged_attention_token_major`). flash-attn, vLLM and Transformers keep K and V
pages as [num_blocks, block_size, Hkv, D]. Merging the last three dims of a page is free (a
bitcast), so the kernel sees [num_blocks, block_size * Hkv, D] with row t * Hkv + h, copies a page
(or a partial page's valid tokens, in whole sublane tiles) with one DMA into a flat VMEM slot, and
reads head h's keys as the rows h, h + Hkv, ... of the slot: a sublane-strided load. Mosaic has
strided loads for 32-bit data only, so 16-bit slots are loaded as uint32 words (two heads of one
token per word) and 8-bit slots as words of four heads (a shift and mask per head; int8 by sign
extension, e4m3 decoded with integer ops). On the narrow (decode) path a 16-bit slot's words are
used as they are: bitcast, the words of heads 2m and 2m + 1 are [2 * kv_tok, D] keys with row
2t + k = token t of head 2m + k, and the pair's q rows meet both heads' keys in one matmul, a
score kept where the key's head is the row's (compute_head_pairs). A decode token owns G <= 8 of
the 16 narrow rows, so head 2m + 1's rows ride 8 rows away in the same 16-row block, in rows the
item does not own (compact form); an item of more rows stacks the pair's rows, [32, D]. 8-bit
slots on the narrow path are taken four heads at a time by items of at most 4 of the 16 rows (a
decode token of G <= 4): the quad's words bitcast to [4 * kv_tok, D] 8-bit keys, which go as
they are into bf16 x 8-bit matmuls (Mosaic converts them on the way into the MXU), and heads
4j + 1..3's q rows ride in rows the item does not own (compute_head_quads);
other 8-bit items unpack per head. The whole-q-block path widens each head's half of a word to
f32 by a shift. The rest of the schedule is the head-major one. New tokens are written by
`write_kv_token_major`, a second Pallas kernel in the same call: one DMA per token and cache
moves the token's contiguous [Hkv, D] row into its page, the caches aliased to its outputs. Quantised pages carry per-token-per-head scales
([num_blocks, Hkv, block_size], one lane-aligned row per page, DMA'd with the page) that multiply
the scores (K) and the probabilities (V), and/or per-head scales (SMEM); the MXU sees the 8-bit
values exactly. Attention sinks start each row's running max at its sink logit
and its denominator at 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import schedule as _schedule
from . import tiling
from .schedule import LAYOUT, build_work_list
from .tiling import PagedAttentionConfig
from .tpu_generations import get_generation, vmem_limit_bytes
from .work_list import searchsorted

# A finite "minus infinity" for masked scores: exp(NEG - m) underflows to 0 without inf - inf NaNs.
NEG = -1e30


def _cdiv(a, b):
    return (a + b - 1) // b


def _token_major_head(
    buf, slot, h: int, hkv: int, kv_tok: int, unpack_u32: bool, words: dict, arr: int
):
    """Keys (or values) of KV head h from a token-major VMEM slot [slots, kv_tok * hkv, D] (row
    t * hkv + h): a sublane-strided load. Mosaic has strided loads for 32-bit data only, so a
    16-bit buffer is read as uint32 words (each holds rows 2i and 2i+1, i.e. heads h and h^1 of one
    token, low half = even row) and the head's half is moved to the top of an f32 word, which is
    exactly the bf16 value widened. `words` keeps the loaded words so the second head of a pair
    does not load them again. Without `unpack_u32` (TPU interpret mode, which has no ref bitcast)
    the 16-bit rows are loaded with a stride directly."""
    if buf.dtype.itemsize == 1:
        return _token_major_head_8bit(buf, slot, h, hkv, kv_tok, unpack_u32, words, arr)
    if hkv == 1:
        return buf[slot]
    if buf.dtype.itemsize == 4 or not unpack_u32:
        return buf[slot, pl.ds(h, kv_tok, stride=hkv), :]
    key = (arr, h // 2)
    if key not in words:
        words[key] = buf.bitcast(jnp.uint32)[slot, pl.ds(h // 2, kv_tok, stride=hkv // 2), :]
    w = words[key]
    top = (w << 16) if h % 2 == 0 else (w & jnp.uint32(0xFFFF0000))
    return pltpu.bitcast(top, jnp.float32).astype(buf.dtype)


def _token_major_head_8bit(
    buf, slot, h: int, hkv: int, kv_tok: int, unpack_u32: bool, words: dict, arr: int
):
    """KV head h of an int8 / float8_e4m3fn token-major slot as bfloat16 (exact: 8-bit integers and
    e4m3 values have at most 8 significant bits). A uint32 word holds heads 4j..4j+3 of one token
    (byte k = row 4i + k), so the head's rows are a strided word load and a byte extract. e4m3 is
    decoded with integer ops (no 8-bit float unit on v5e): its sign, exponent and mantissa bits
    moved to their f32 places, exact for every byte (subnormals included). Without `unpack_u32`
    (TPU interpret mode) a direct strided load."""
    if not unpack_u32:
        x = buf[slot] if hkv == 1 else buf[slot, pl.ds(h, kv_tok, stride=hkv), :]
        if x.dtype == jnp.uint8:  # e4m3 pages passed as their bytes
            x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
        return x.astype(jnp.float32).astype(jnp.bfloat16)
    key = (arr, h // 4)
    if key not in words:
        words[key] = buf.bitcast(jnp.uint32)[slot, pl.ds(h // 4, kv_tok, stride=hkv // 4), :]
    w = words[key]
    shift = 8 * (h % 4)
    if buf.dtype == jnp.int8:
        x = pltpu.bitcast(w << (24 - shift), jnp.int32) >> 24
        return x.astype(jnp.float32).astype(jnp.bfloat16)
    # e4m3 as f32 bits, branch-free: the byte moved to the top of the word (sign at bit 31), its 4
    # exponent and 3 mantissa bits moved down to f32's low exponent and high mantissa bits. A
    # normal value (exponent >= 1) is then f32 once the bias difference (127 - 7) is added to the
    # exponent field; a subnormal (exponent 0) is its mantissa times 2**-9 (an int -> float
    # convert: an f32 subnormal on the way would be flushed to zero). One select picks, the sign
    # is OR-ed in: 11 ops per word (the earlier decode negated and selected twice: 15).
    top = w << (24 - shift)
    mag = (top & jnp.uint32(0x7F000000)) >> 4
    subnormal = pltpu.bitcast(mag >> 20, jnp.int32).astype(jnp.float32) * (2.0**-9)
    bits = jnp.where(
        mag >= jnp.uint32(1 << 23),
        mag + jnp.uint32(120 << 23),
        pltpu.bitcast(subnormal, jnp.uint32),
    ) | (top & jnp.uint32(0x80000000))
    return pltpu.bitcast(bits, jnp.float32).astype(jnp.bfloat16)


def _write_spread_matrix(ref):
    """ref [3 * T, 4 * T] bf16 (T = tiling.SPREAD_TOKENS) := the 0/1 matrix whose row (part, t)
    is 1 at columns 4t..4t+3, the same block for each of the three bf16 parts of an f32 scale.
    Written once per call, one bf16 sublane tile of rows at a time in a rolled loop
    (straight-line, its 96 vregs were ~160 bundles of every grid step's code)."""
    T = tiling.SPREAD_TOKENS
    rows = tiling.row_tile(jnp.bfloat16)
    shape = (rows, 4 * T)

    def tile(c, carry):
        r0 = pl.multiple_of(c * rows, rows)
        t = lax.rem(r0 + lax.broadcasted_iota(jnp.int32, shape, 0), T)
        n = lax.broadcasted_iota(jnp.int32, shape, 1)
        ref[pl.ds(r0, rows), :] = ((n >> 2) == t).astype(jnp.bfloat16)
        return carry

    lax.fori_loop(0, 3 * T // rows, tile, 0)


def _spread_scales(x, repeat):
    """x [rows, tokens] f32 (tokens a multiple of T = tiling.SPREAD_TOKENS), repeat the
    `_write_spread_matrix` matrix -> [tokens / T * rows, 4 * T] f32 whose row c * rows + h,
    column n is x[h, c * T + n // 4], exactly: x cut in T-token chunks stacked along rows, split
    into three bf16 parts (8 + 8 + 8 significant bits) laid side by side, times the 0/1 matrix
    on the MXU, which sums the three exact products in f32."""
    t = tiling.SPREAD_TOKENS
    chunks = [x[:, c * t : (c + 1) * t] for c in range(x.shape[1] // t)]
    lhs = jnp.concatenate(chunks, axis=0)
    hi = lhs.astype(jnp.bfloat16)
    rest = lhs - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return jax.lax.dot_general(
        jnp.concatenate([hi, mid, lo], axis=1),
        repeat,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def _base2_softmax_step(m_prev, l_prev, s):
    """One online-softmax step on base-2 scores s [rows, keys] (log2(e) already folded in): the
    running max m_prev (natural units, as the statistics are stored) and denominator l_prev
    [rows, 1] -> (new max in base-2 units, rescale factor alpha, probabilities, new denominator).
    exp2 is the EUP's op; dropped scores (-inf) give 0."""
    m_prev = m_prev * math.log2(math.e)
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - m_new)
    return m_new, alpha, p, alpha * l_prev + p.sum(axis=1, keepdims=True)


def _scores_one_ahead(n: int, scores, update):
    """Trace `scores(j + 1)` before `update(j, *scores(j))` for j < n: each MXU runs its matmuls
    in program order, so the next head's score matmul then fills it during this head's softmax."""
    pending = scores(0)
    for j in range(1, n):
        cur = scores(j)
        update(j - 1, *pending)
        pending = cur
    update(n - 1, *pending)


def _paged_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,
    cu_ref,
    pt_ref,
    work_ref,
    block_end_ref,
    # inputs / outputs / scratch
    *refs,
    n_arr: int,
    num_kv_heads: int,
    head_dim: int,
    group: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    max_items: int,
    num_q_blocks: int,
    narrow: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    causal: bool,
    stream_pt: bool,
    token_major: bool = False,
    unpack_u32: bool = False,
    word_stores: bool = False,
    quant: str | None = None,
    token_scales: bool = False,
    static_scales: bool = False,
    sinks: bool = False,
    quad_heads: bool = False,
):
    q_ref = refs[0]
    caches = refs[1 : 1 + n_arr]
    refs = refs[1 + n_arr :]
    if token_scales:  # per-token-per-head scales in HBM: K and V, [num_blocks, Hkv, block_size]
        scale_hbm, refs = refs[:2], refs[2:]
    if static_scales:  # per-head scales in SMEM: [2, Hkv] (K row, V row)
        static_ref, refs = refs[0], refs[1:]
    if sinks:  # [Hkv, rows, 1] f32: each q row's sink logit
        sink_ref, refs = refs[0], refs[1:]
    if stream_pt:  # the page table stays in HBM: [S, 1, pages_per_seq]
        pt_hbm, refs = refs[0], refs[1:]
    o_ref = refs[0]
    bufs = refs[1 : 1 + n_arr]
    refs = refs[1 + n_arr :]
    if token_scales:  # VMEM slots of the items' scales: [2, Hkv, pages * block_size] each
        scale_bufs, refs = refs[:2], refs[2:]
    if quad_heads and token_scales:  # compute_head_quads' per-token scale spreading
        repeat_ref, spread_refs, refs = refs[0], refs[1:3], refs[3:]
    sem = refs[0]
    refs = refs[1:]
    if stream_pt:  # SMEM copies of two items' page-table rows, and their semaphores
        ids_ref, ids_sem, refs = refs[0], refs[1], refs[2:]
    m_ref, l_ref, acc_ref = refs
    rows = block_q * group
    kv_tok = pages_per_block * page_size
    # Partial pages are copied in multiples of `copy_tile` tokens: the sublane tile (head-major),
    # or the fewest tokens whose (token, head) rows fill whole sublane tiles (token-major).
    copy_tile = tiling.copy_tile(bufs[0].dtype, num_kv_heads, token_major)
    chunk_sizes = tiling.partial_page_chunks(page_size, bufs[0].dtype, tile=copy_tile)
    # Token-major: one page is page_size * Hkv rows of the flat [rows, D] buffer (row t * Hkv + h).
    page_rows = page_size * num_kv_heads
    # 16-bit token-major pages on the narrow path: two KV heads per uint32 word, computed as a
    # pair with nothing unpacked (compute_head_pairs). Interpreters without ref bitcasts take the
    # per-head strided loads.
    pair_heads = unpack_u32 and tiling.pair_heads(bufs[0].dtype, num_kv_heads, token_major)
    # Items of at most narrow / 2 rows (a decode token's G rows) take the pair path's compact form.
    compact_pairs = pair_heads and tiling.compact_pairs(
        bufs[0].dtype, num_kv_heads, token_major, group, narrow
    )
    # 8-bit token-major pages with `quad_heads` (tiling.quad_heads): decode items take their KV
    # heads four at a time (compute_head_quads), per-token scales spread in chunks of tokens.
    spread_chunks = kv_tok // tiling.SPREAD_TOKENS

    # One grid step per q block: its q rows and output block are the step's BlockSpecs, its
    # statistics are initialised before, and its output written after, a rolled loop over its
    # work items (consecutive in the list). A grid step is not free (the pipeline's own
    # bookkeeping, ~0.35 us: tpu_generations.step_overhead_s), so the items of a q block (a
    # decode batch's hundreds of KV blocks, one long sequence's) share one step, as JAX's
    # ragged_paged_attention runs its KV blocks.
    b = pl.program_id(0)
    item_lo = jnp.where(b == 0, 0, block_end_ref[jnp.maximum(b - 1, 0)])
    item_hi = block_end_ref[b]
    nitems = block_end_ref[num_q_blocks - 1]

    def field(name, j):
        return LAYOUT.read(work_ref, name, j, max_items)

    def ids_copy(j):
        """DMA of item j's page-table row into SMEM slot j % 2 (streamed page tables)."""
        seq = jnp.maximum(field("SEQ", j), 0)
        slot = lax.rem(j, 2)
        return pltpu.make_async_copy(pt_hbm.at[seq], ids_ref.at[slot], ids_sem.at[slot])

    def page_lookup(j):
        """Item j's page p -> its page index, the item's part of the address (sequence row and
        first page: SMEM loads the compiler does not hoist) read once, outside the page loops.
        The index is clamped into the cache: the kernel is compiled without Mosaic's DMA bounds
        checks (see the pallas_call), so every DMA address is in bounds by construction (the
        work list's pages lie in the page table's rows; a page id outside the cache, which the
        torch ops refuse before the call, reads a real page instead of faulting)."""
        first = field("FIRST_PAGE", j)
        last_page = caches[0].shape[0] - 1
        if stream_pt:
            row = lax.rem(j, 2)
            return lambda p: jnp.clip(ids_ref[row, 0, first + p], 0, last_page)
        base = jnp.maximum(field("SEQ", j), 0) * pages_per_seq + first
        return lambda p: jnp.clip(pt_ref[base + p], 0, last_page)

    def copies(page, slot, p, rows=None):
        """DMAs of cache page `page` into page slot p of `slot` (rows=(offset, size): only those
        rows). A wait needs only the semaphore and the shape: waits pass page 0."""
        if token_major:
            if rows is None:
                src = [caches[a].at[page] for a in range(n_arr)]
                dst = [bufs[a].at[slot, pl.ds(p * page_rows, page_rows)] for a in range(n_arr)]
            else:
                off, size = rows
                r0 = pl.multiple_of(off * num_kv_heads, tiling.row_tile(bufs[0].dtype))
                src = [caches[a].at[page, pl.ds(r0, size * num_kv_heads)] for a in range(n_arr)]
                dst = [
                    bufs[a].at[slot, pl.ds(p * page_rows + r0, size * num_kv_heads)]
                    for a in range(n_arr)
                ]
            return [
                pltpu.make_async_copy(x, y, sem.at[slot, a])
                for a, (x, y) in enumerate(zip(src, dst))
            ]
        if rows is None:
            return [
                pltpu.make_async_copy(caches[a].at[page], bufs[a].at[slot, p], sem.at[slot, a])
                for a in range(n_arr)
            ]
        off, size = rows
        return [
            pltpu.make_async_copy(
                caches[a].at[page, :, pl.ds(off, size)],
                bufs[a].at[slot, p, :, pl.ds(off, size)],
                sem.at[slot, a],
            )
            for a in range(n_arr)
        ]

    def page_copies(page, slot, p):
        """Every DMA of one full page: its K / V (`copies`) and, with per-token scales, its
        scales'."""
        return copies(page, slot, p) + (scale_copies(page, slot, p) if token_scales else [])

    def scale_copies(page, slot, p):
        return [
            pltpu.make_async_copy(
                scale_hbm[a].at[page],
                scale_bufs[a].at[slot, :, pl.ds(p * page_size, page_size)],
                sem.at[slot, n_arr + a],
            )
            for a in range(2)
        ]

    def page_plan(j):
        """Item j's pages: (count, last page's index, rows its copies take of the last page
        rounded up to the copy tile, whether that page is copied short, full pages)."""
        npages = field("NUM_PAGES", j)
        seq = jnp.maximum(field("SEQ", j), 0)
        last_p = npages - 1
        last_rows = kv_lens_ref[seq] - (field("FIRST_PAGE", j) + last_p) * page_size
        rows_up = lax.div(last_rows + copy_tile - 1, copy_tile) * copy_tile
        partial = (rows_up < page_size) if chunk_sizes else jnp.bool_(False)
        return npages, last_p, rows_up, partial, npages - partial.astype(jnp.int32)

    def fetch(j, slot, start: bool, rolled=False):
        """Start (or wait for) the copies of item j's pages. Full pages are one DMA each; the
        sequence's last page, when partly filled, copies only its valid rows rounded up to the
        sublane tile, as a few power-of-two row chunks (static DMA shapes). The copies are waited
        for as they were started, except where the item's full pages fill its slot: one wait per
        array then (below). Starting, this is the rolled page loop, for an item that does not
        fill its slot or where `rolled` (any other item `start_whole_slot` starts)."""
        npages, last_p, rows_up, partial, n_full = page_plan(j)

        def go(cs):
            for c in cs:
                c.start() if start else c.wait()

        def pages():
            page_at = page_lookup(j) if start else (lambda p: 0)

            # Rolled loops over the pages (one DMA descriptor per array per iteration): unrolled
            # for every item (predicated per page), the per-page address arithmetic was a few
            # hundred scalar bundles in every step's code. A page's per-token scales (one
            # [Hkv, block_size] tile row, copied whole and lane-aligned: block_size is a multiple
            # of 128) ride in the same iteration as its K / V.
            def full_page(p, carry):
                go(page_copies(page_at(p), slot, p))
                return carry

            lax.fori_loop(0, n_full, full_page, 0)

            if not chunk_sizes:
                return

            # A partly filled last page: one branch around all of its chunk copies, which a full
            # item skips (left as separate small conditions, the compiler predicated every
            # chunk's DMA, with its address arithmetic, into straight-line code that each item
            # ran).
            @pl.when((npages > 0) & partial)
            def _():
                page = page_at(last_p)
                if token_scales:
                    go(scale_copies(page, slot, last_p))
                for size in chunk_sizes:

                    @pl.when(lax.rem(lax.div(rows_up, size), 2) == 1)
                    def _():
                        off = pl.multiple_of(rows_up - lax.rem(rows_up, 2 * size), copy_tile)
                        go(copies(page, slot, last_p, (off, size)))

        # An item whose full pages fill its slot (every item of a long decode but a sequence's
        # last) starts them in straight-line code (`start_whole_slot`) and waits for them once per
        # array, for the whole slot: a DMA semaphore counts what its copies have delivered, and one
        # wait of the slot's size takes what all of the item's page copies signalled (a wait per
        # page cost ~11 bundles a page on TPU7x). A wait reads only its size from the copy it
        # names: the slot, as both ends.
        whole = n_full == pages_per_block
        if start:
            pl.when(jnp.logical_not(whole) | rolled)(pages)
            return

        @pl.when(whole)
        def _():
            slots = tuple(bufs) + (tuple(scale_bufs) if token_scales else ())
            go(
                pltpu.make_async_copy(x.at[slot], x.at[slot], sem.at[slot, a])
                for a, x in enumerate(slots)
            )

        pl.when(jnp.logical_not(whole))(pages)

    def start_whole_slot(j, slot):
        """Start the copies of item j, whose full pages fill its slot, in straight-line code: its
        page count is static, so the scheduler overlaps the page lookups and address arithmetic of
        successive pages with the DMA issues, where the rolled loop runs each page's chain and its
        back branch in turn (TPU7x, 8 pages of 8-bit K / V and their per-token scales: 132
        bundles against 8 x 24 in the loop)."""
        page_at = page_lookup(j)
        for p in range(pages_per_block):
            for c in page_copies(page_at(p), slot, p):
                c.start()

    if stream_pt:
        # Page-table rows run two items ahead of compute (one ahead of the KV prefetch).
        @pl.when((b == 0) & (nitems > 0))
        def _():
            ids_copy(0).start()
            ids_copy(0).wait()

            @pl.when(nitems > 1)
            def _():
                ids_copy(1).start()

    # Start the pages of item i + 1 into the other slot while item i is computed; the call's
    # first item also starts its own. One loop over the items to start (one code copy of the DMA
    # issue in the item: the first item's extra fetch used to be a second copy). The rolled
    # loops of the grid step and of its items, in program order, are tiling.step_loop_trips'
    # (the benchmarks charge each by its iterations).
    def start_item(j, carry):
        if stream_pt:

            @pl.when(j > 0)  # item 0's row was waited for above
            def _():
                ids_copy(j).wait()

        # The call's first item (started by item 0 beside item 1) takes the rolled loop; any
        # later item is the one after the item starting it, which starts it in straight-line code
        # if it fills its slot (run_item).
        fetch(j, lax.rem(j, 2), start=True, rolled=j == 0)
        return carry

    if quad_heads and token_scales:

        @pl.when(b == 0)
        def _():
            _write_spread_matrix(repeat_ref)

    # The q block's statistics are initialised before its items and its output written after
    # them, in rolled loops over `row_chunk` rows (straight-line, they were ~1000 bundles).
    row_chunk = tiling.output_row_chunk(rows, o_ref.dtype)
    n_chunks = rows // row_chunk

    def init(c, carry):
        r = pl.ds(pl.multiple_of(c * row_chunk, row_chunk), row_chunk)
        shape = (num_kv_heads, row_chunk, 1)
        if sinks:
            # The sink is one more score per query row whose value contributes nothing: start
            # the running max at it and the denominator at exp(sink - sink) = 1.
            m_ref[:, r, :] = sink_ref[:, r, :]
            l_ref[:, r, :] = jnp.ones(shape, jnp.float32)
        else:
            m_ref[:, r, :] = jnp.full(shape, NEG, jnp.float32)
            l_ref[:, r, :] = jnp.zeros(shape, jnp.float32)
        acc_ref[:, r, :] = jnp.zeros((num_kv_heads, row_chunk, head_dim), jnp.float32)
        return carry

    lax.fori_loop(0, n_chunks, init, 0)

    def run_item(i, carry):
        """Work item i of this q block: start the next item's pages, wait for its own, and run
        the compute path its rows take."""
        lax.fori_loop(jnp.where(i == 0, 0, i + 1), jnp.minimum(i + 2, nitems), start_item, 0)
        # Outside the loop above (which reads the next item's page counts too): a second
        # branch in its body would be charged with the rolled copies' runs
        # (tiling.step_loop_trips), and this one is the item's own code.
        nxt = jnp.minimum(i + 1, nitems - 1)

        @pl.when((i + 1 < nitems) & (page_plan(nxt)[4] == pages_per_block))
        def _():
            start_whole_slot(nxt, lax.rem(nxt, 2))

        if stream_pt:
            # Slot (i + 2) % 2 held item i's row, which no copy reads any more.
            @pl.when(i + 2 < nitems)
            def _():
                ids_copy(i + 2).start()

        seq = jnp.maximum(field("SEQ", i), 0)
        first_page = field("FIRST_PAGE", i)
        npages = field("NUM_PAGES", i)
        q_start = cu_ref[seq]
        q_end = cu_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        slot = lax.rem(i, 2)
        blk_tok0 = b * block_q
        r_lo = (jnp.maximum(q_start, blk_tok0) - blk_tok0) * group
        r_hi = (jnp.minimum(q_end, blk_tok0 + block_q) - blk_tok0) * group

        def valid_keys():
            """Keys of this item's slot that are valid (the rest of its pages: past kv_len, or not
            filled)."""
            return jnp.minimum(npages * page_size, kv_len - first_page * page_size)

        def zero_stale_values():
            """Zero the value rows of this item's slot past its valid keys (past kv_len in the last
            page, and page slots the item did not fill): they may hold anything (NaN in TPU
            interpret mode) and 0 * garbage must not reach the accumulator. Done once per item in
            VMEM, only for the pages concerned (a loop with no trips for an item of full pages),
            instead of a select over every head's values in the compute path. Keys need nothing:
            their scores are replaced by a select."""
            n_valid = valid_keys()

            def page(p, carry):
                valid = n_valid - p * page_size  # valid tokens of page slot p (<= 0: none)
                if token_major:
                    _zero_token_major_page(bufs[n_arr - 1], slot, p, valid)
                else:
                    keep = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0) < valid
                    for h in range(num_kv_heads):
                        arr, idx = (0, 2 * h + 1) if n_arr == 1 else (1, h)
                        x = bufs[arr][slot, p, idx]
                        bufs[arr][slot, p, idx] = jnp.where(keep, x, jnp.zeros_like(x))
                return carry

            lax.fori_loop(lax.div(n_valid, page_size), pages_per_block, page, 0)

        def _zero_token_major_page(buf, slot, p, valid):
            """Token-major page slot p (rows t * Hkv + h): rows of tokens >= valid set to zero. Where
            a 32-bit word holds whole tokens (8-bit pages: 4 heads of a token; bf16 with an even
            number of heads: 2), the rows are zeroed as uint32 words, so no 8- or 16-bit select is
            needed (compiled kernels only: the interpreters cannot store through a bitcast ref)."""
            pack = 4 // buf.dtype.itemsize
            if word_stores and pack > 1 and num_kv_heads % pack == 0:
                words = page_rows // pack
                view = buf.bitcast(jnp.uint32)
                start = pl.multiple_of(p * words, 8)
                x = view[slot, pl.ds(start, words), :]
                keep = lax.broadcasted_iota(jnp.int32, x.shape, 0) * pack < valid * num_kv_heads
                view[slot, pl.ds(start, words), :] = jnp.where(keep, x, jnp.zeros_like(x))
                return
            start = pl.multiple_of(p * page_rows, tiling.row_tile(buf.dtype))
            x = buf[slot, pl.ds(start, page_rows), :]
            keep = lax.broadcasted_iota(jnp.int32, x.shape, 0) < valid * num_kv_heads
            buf[slot, pl.ds(start, page_rows), :] = jnp.where(keep, x, jnp.zeros_like(x))

        def item_mask(row, col):
            """Which (q row of the q block, key of the KV block) scores this item keeps: the key is
            valid (within the item's pages and kv_len), the row is one of the sequence's tokens, and
            the key is visible to it (causal, sliding window)."""
            tok = blk_tok0 + lax.div(row, group)
            qpos = kv_len - (q_end - q_start) + (tok - q_start)
            kpos = first_page * page_size + col
            col_ok = (col < npages * page_size) & (kpos < kv_len)
            mask = col_ok & (tok >= q_start) & (tok < q_end)
            if causal:
                mask &= kpos <= qpos
                if sliding_window is not None:
                    mask &= qpos - kpos < sliding_window
            return mask

        def own_rows(r0, nr: int, copies: int = 1):
            """[copies * nr, 1]: which of the rows r0..r0 + nr (stacked `copies` times) are this
            item's sequence's. The others (other sequences' tokens sharing the rows, or no
            sequence's) keep their accumulator as it was: their probabilities are 0, but 0 times a
            NaN value of this sequence is NaN, and it must not reach another sequence's output."""
            r = lax.broadcasted_iota(jnp.int32, (copies * nr, 1), 0)
            tok = blk_tok0 + lax.div(r0 + (lax.rem(r, nr) if copies > 1 else r), group)
            return (tok >= q_start) & (tok < q_end)

        def compute(r0, nr: int):
            if nr == narrow and quad_heads:
                # An item of at most nr / 4 rows (a decode token of G <= 4 heads) takes the quad
                # path; larger items (prefill chunks) the per-head one.
                @pl.when(r_hi - r_lo <= nr // 4)
                def _():
                    compute_head_quads(r0, nr)

                @pl.when(r_hi - r_lo > nr // 4)
                def _():
                    compute_per_head(r0, nr)

                return
            if nr == narrow and pair_heads:
                if not compact_pairs:
                    return compute_head_pairs(r0, nr, compact=False)

                # Both pair paths are compiled; an item of at most nr / 2 rows (decode) takes the
                # compact one.
                @pl.when(r_hi - r_lo <= nr // 2)
                def _():
                    compute_head_pairs(r0, nr, compact=True)

                @pl.when(r_hi - r_lo > nr // 2)
                def _():
                    compute_head_pairs(r0, nr, compact=False)

                return
            compute_per_head(r0, nr)

        def compute_per_head(r0, nr: int):
            row = r0 + jax.lax.broadcasted_iota(jnp.int32, (nr, kv_tok), 0)
            col = jax.lax.broadcasted_iota(jnp.int32, (nr, kv_tok), 1)
            mask = item_mask(row, col)
            own = own_rows(r0, nr)
            words = {}

            def head_kv(h):
                if token_major:
                    k = _token_major_head(
                        bufs[0], slot, h, num_kv_heads, kv_tok, unpack_u32, words, 0
                    )
                    v = _token_major_head(
                        bufs[1], slot, h, num_kv_heads, kv_tok, unpack_u32, words, 1
                    )
                    return k, v
                if n_arr == 1:
                    k_arr, k_idx, v_arr, v_idx = 0, 2 * h, 0, 2 * h + 1
                else:
                    k_arr, k_idx, v_arr, v_idx = 0, h, 1, h
                # [pages, page_size, D] -> [pages * page_size, D]: page_size is a multiple of the
                # sublane tile, so this merge is free.
                k = bufs[k_arr][slot, :, k_idx].reshape(kv_tok, head_dim)
                v = bufs[v_arr][slot, :, v_idx].reshape(kv_tok, head_dim)
                return k, v

            def scores(h):
                k, v = head_kv(h)
                q = q_ref[h, pl.ds(r0, nr), :]
                if quant is not None:
                    q = q.astype(k.dtype)
                s = (
                    jax.lax.dot_general(
                        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )
                    * sm_scale
                )
                if static_scales:
                    s = s * static_ref[0, h]
                if token_scales:
                    s = s * scale_bufs[0][slot, pl.ds(h, 1), :]  # [1, kv_tok]: one scale per key
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                return jnp.where(mask, s, NEG), v

            def update(h, s, v):
                m_prev = m_ref[h, pl.ds(r0, nr), :]
                l_prev = l_ref[h, pl.ds(r0, nr), :]
                m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
                if token_scales:
                    # V's per-key scales fold into the probabilities (masked: stale slots hold NaN).
                    p = jnp.where(mask, p * scale_bufs[1][slot, pl.ds(h, 1), :], 0.0)
                pv = jax.lax.dot_general(
                    p.astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                if static_scales:
                    pv = pv * static_ref[1, h]
                m_ref[h, pl.ds(r0, nr), :] = m_new
                l_ref[h, pl.ds(r0, nr), :] = l_new
                acc_prev = acc_ref[h, pl.ds(r0, nr), :]
                acc_ref[h, pl.ds(r0, nr), :] = jnp.where(own, alpha * acc_prev + pv, acc_prev)

            # Each MXU runs its pushes and matmuls in program order, so head h + 1's key push and
            # score matmul are traced before head h's probability matmul: they then fill the MXUs
            # while head h's softmax runs on the vector units (in head order, h + 1 would wait for
            # h's softmax; the decode step was that chain, 8 heads long). A few rows only (the decode
            # path): two heads' scores of a whole q block would not fit in registers. Not for 8-bit
            # pages: two heads' unpacked words in flight overran the 32 MiB scoped VMEM on TPU7x.
            if nr <= 2 * tiling.NARROW_ROWS and quant is None:
                _scores_one_ahead(num_kv_heads, scores, update)
            else:
                for h in range(num_kv_heads):
                    update(h, *scores(h))

        def compute_head_pairs(r0, nr: int, compact: bool):
            """The narrow path over 16-bit token-major pages, two KV heads at a time: a uint32 word
            of the slot holds heads 2m and 2m + 1 of one token, so the pair's words bitcast to
            [2 * kv_tok, D] with row 2t + k = token t of head 2m + k: keys exactly as the MXU takes
            them, nothing unpacked (the per-head path moved every word's half to an f32 word and
            packed it back: 2 of every 3 VALU ops of a decode step). Every q row meets all 2 * kv_tok
            key rows; a score is kept where the key's head (column parity) is the row's head.

            Which q rows go to the MXU. Stacked (`compact=False`): the pair's rows, [2 * nr, D]
            (head 2m's nr rows, then head 2m + 1's). Compact (`compact=True`, an item holding at most
            nr / 2 of the rows, as a decode token of G <= 8 heads does): one [nr, D] block, the
            item's own rows of head 2m in place and head 2m + 1's row r in row r +- nr / 2, a row the
            item does not own. The other rows are other sequences' tokens whose scores would be
            dropped anyway, so the compact block does the same work on half the score vregs. The
            rotation by nr / 2 is a swap of two f32 vreg rows (nr = 16); rows that are neither are
            computed and never stored."""
            half = nr // 2
            lhs_rows = nr if compact else 2 * nr
            shape = (lhs_rows, 2 * kv_tok)
            row = lax.broadcasted_iota(jnp.int32, shape, 0)
            col = lax.broadcasted_iota(jnp.int32, shape, 1)
            if compact:
                own = own_rows(r0, nr)
                row_head = jnp.logical_not(own)  # not the item's: head 2m + 1's row r +- nr / 2
                q_row = r0 + jnp.where(own, row, jnp.where(row < half, row + half, row - half))
            else:
                own = own_rows(r0, nr, copies=2)
                row_head = row >= nr  # the row's head of the pair: 0 or 1
                q_row = r0 + jnp.where(row_head, row - nr, row)
            # Column 2t + k is key t of head k: the per-head mask on (row, t), where the heads match.
            keep = item_mask(q_row, col >> 1)
            keep &= (col & 1) == row_head.astype(jnp.int32)
            # Dropped scores become -inf, not NEG: the running max starts at NEG (or a sink logit),
            # so it stays finite and a dropped score's exp is exactly 0 with no second select (a row
            # with no kept score keeps m, l and acc: alpha = 1, p = 0). A select, not an additive
            # bias: a stale key slot (NaN) or the other head's key must not reach a kept row.
            # Base-2 scores: exp2 is the EUP's op (jnp.exp multiplies every argument by log2(e)
            # first); log2(e) rides on the score scale, the statistics are converted on load / store.
            log2e = math.log2(math.e)
            rs = pl.ds(r0, nr)

            def pair_kv(m):
                return tuple(
                    pltpu.bitcast(
                        bufs[a].bitcast(jnp.uint32)[
                            slot, pl.ds(m, kv_tok, stride=num_kv_heads // 2), :
                        ],
                        bufs[a].dtype,
                    )
                    for a in range(2)
                )

            def swap_halves(x):
                return jnp.concatenate([x[half:], x[:half]], axis=0)

            def load(ref, m):
                """(the pair's rows of `ref` as the LHS lays them out, both heads' rows as read)."""
                x0, x1 = ref[2 * m, rs, :], ref[2 * m + 1, rs, :]
                if not compact:
                    return jnp.concatenate([x0, x1], axis=0), (x0, x1)
                # 16-bit q: the row swap in f32, where it moves whole vregs.
                y = jnp.where(own, x0.astype(jnp.float32), swap_halves(x1.astype(jnp.float32)))
                return y.astype(x0.dtype), (x0, x1)

            def store(ref, m, x, read):
                if compact:
                    ref[2 * m, rs, :] = jnp.where(own, x, read[0])
                    ref[2 * m + 1, rs, :] = jnp.where(own, swap_halves(x), read[1])
                else:
                    for k in range(2):
                        ref[2 * m + k, rs, :] = x[k * nr : (k + 1) * nr]

            def scores(m):
                k, v = pair_kv(m)
                s = jax.lax.dot_general(
                    load(q_ref, m)[0],
                    k,
                    (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                if soft_cap is not None:
                    s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * log2e)
                else:
                    s = s * (sm_scale * log2e)
                return jnp.where(keep, s, -jnp.inf), v

            def update(m, s, v):
                m_prev, m_read = load(m_ref, m)
                l_prev, l_read = load(l_ref, m)
                acc_prev, acc_read = load(acc_ref, m)
                m_new, alpha, p, l_new = _base2_softmax_step(m_prev, l_prev, s)
                pv = jax.lax.dot_general(
                    p.astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                acc_new = alpha * acc_prev + pv
                if not compact:  # the compact store selects the own rows itself
                    acc_new = jnp.where(own, acc_new, acc_prev)
                store(m_ref, m, m_new * (1.0 / log2e), m_read)
                store(l_ref, m, l_new, l_read)
                store(acc_ref, m, acc_new, acc_read)

            # As the per-head path: pair m + 1's key push and score matmul are traced before pair
            # m's probability matmul, so they fill the MXUs while pair m's softmax runs.
            _scores_one_ahead(num_kv_heads // 2, scores, update)

        def compute_head_quads(r0, nr: int):
            """The narrow path over 8-bit token-major pages for an item of at most nr / 4 rows (a
            decode token of G <= 4 query heads per KV head), four KV heads at a time: a uint32 word of
            the slot holds one token of heads 4j..4j+3, so the quad's words bitcast to 8-bit
            [4 * kv_tok, D] keys with row 4t + k = token t of head 4j + k (the per-head path
            extracts each head's byte from every word with shifts and, for e4m3, an integer
            decode). The 8-bit keys and values are not widened in VMEM: the score and probability
            matmuls take a bf16 left operand and the 8-bit right one, which Mosaic converts on its
            way into the MXU (int8: v5e's converts, v6e / TPU7x's matmul prep; e4m3: the MXU's
            own 8-bit float load, on v5e / v6e as e4m3 with bias 11 after a select that turns -0
            into 0, the products times 16 after; TPU7x natively). The widened [4 * kv_tok, D] bf16
            copies cost e4m3 ~4,500 selects and compares per 1024-token step on v5e / v6e and
            every 8-bit quad ~200-300 bundles of the step's code. Exact for every int8 value and
            every finite e4m3 code, subnormals and -0 included (checked on a v5e chip for all 256
            codes, benchmarks/fp8_mxu_probe.py); the e4m3 NaN codes 0x7F / 0xFF read as 480
            there, where a widening gave NaN. Our writers store no NaN code for a finite value
            (they clip to +-448), and a NaN written with per-token scales makes its scale NaN,
            which the scores and probabilities carry.

            One [nr, D] left operand carries the four heads' q rows: the item's own rows
            [off, off + n) hold head 4j's, and head 4j + k's row r rides in row r + k * nr / 4
            (mod nr), rows the item does not own (a static sublane rotation of that head's rows).
            Every row meets all 4 * kv_tok keys; a score is kept where the key's head (column % 4) is
            the row's. Rows that are no head's (past the item's n rows in each quarter) are computed
            and never stored, as are the other heads' scores of a row.

            Scales: per-head static scales are per row (the row's head). Per-token scales need,
            at score column 4t + k, the scale of head 4j + k's token t: a lane interleave of four
            heads' scale rows, which Mosaic has no op for. The MXU makes it (`spread_token_scales`,
            once per item for all heads): the slot's [Hkv, kv_tok] scales cut in 128-token chunks,
            rows (chunk, head), times a 0/1 matrix repeating each token's scale over 4 columns give
            [chunks * Hkv, 512], row (c, h) column n = head h's scale of token 128c + n // 4; a quad's
            columns are then four sublane-strided loads of it (heads 4j..4j+3) and a select on
            n % 4. Exact: the f32 scales go in as three bf16 parts (8 + 8 + 8 significant bits) side
            by side against the matrix stacked three times, and the MXU sums them in f32."""
            quarter = nr // 4
            shape = (nr, 4 * kv_tok)
            col = lax.broadcasted_iota(jnp.int32, shape, 1)
            r1 = lax.broadcasted_iota(jnp.int32, (nr, 1), 0)
            own = own_rows(r0, nr)
            # The row's head in the quad (0..3): which quarter of the rotation it sits in.
            rel = lax.rem(r1 - (r_lo - r0) + nr, nr)
            row_head = lax.div(rel, quarter)
            src = lax.rem(r1 - row_head * quarter + nr, nr)  # the q row it carries
            # Which scores are kept: column 4t + k is key t of head k, kept on the rows of head k
            # where key t is valid and visible to the row's token, i.e. inside one interval of
            # columns per row ([4 * first, 4 * end) for keys [first, end)). Only the item's own
            # rows are stored, so the row's token need not be tested (the other rows' intervals
            # are whatever their tokens give, and never read).
            tok = blk_tok0 + lax.div(r0 + src, group)
            qpos = kv_len - (q_end - q_start) + (tok - q_start) - first_page * page_size
            end = jnp.full((nr, 1), valid_keys(), jnp.int32)
            if causal:
                end = jnp.minimum(end, qpos + 1)
            keep = (col < 4 * end) & ((col & 3) == row_head)
            if causal and sliding_window is not None:
                keep &= col >= 4 * (qpos - sliding_window + 1)
            log2e = math.log2(math.e)
            rs = pl.ds(r0, nr)
            byte_dtype = jnp.float8_e4m3fn if quant == "fp8" else jnp.int8

            if token_scales:

                def spread_token_scales(a):
                    x = scale_bufs[a][slot]  # [Hkv, kv_tok]
                    tok = lax.broadcasted_iota(jnp.int32, x.shape, 1)
                    # Stale slots may hold NaN: it would spread over its whole chunk row.
                    x = jnp.where(tok < valid_keys(), x, 0.0)
                    spread = _spread_scales(x, repeat_ref[...])
                    # Stored as 4 lane blocks [4, chunks * Hkv, 128]: Mosaic's strided loads need
                    # 128-lane rows.
                    t = tiling.SPREAD_TOKENS
                    for b in range(4):
                        spread_refs[a][b] = spread[:, b * t : (b + 1) * t]

                spread_token_scales(0)
                spread_token_scales(1)

                def by_columns(x, a, j, factor=1.0):
                    """x [nr, 4 * kv_tok] times the quad's per-token scales of cache a at its
                    columns (column 4t + k: head 4j + k's scale of token t), times `factor` (a
                    constant riding on the [chunks, 512] scales, not on every score)."""
                    width = 4 * tiling.SPREAD_TOKENS
                    lane = lax.broadcasted_iota(jnp.int32, (spread_chunks, width), 1) & 3
                    rows = [
                        jnp.concatenate(
                            [
                                spread_refs[a].at[b][
                                    pl.ds(4 * j + k, spread_chunks, stride=num_kv_heads), :
                                ]
                                for b in range(4)
                            ],
                            axis=1,
                        )
                        for k in range(4)
                    ]
                    e = rows[3]
                    for k in (2, 1, 0):
                        e = jnp.where(lane == k, rows[k], e)
                    if factor != 1.0:
                        e = e * factor
                    return jnp.concatenate(
                        [
                            x[:, c * width : (c + 1) * width] * e[c : c + 1]
                            for c in range(spread_chunks)
                        ],
                        axis=1,
                    )

            def quad_kv(j):
                def load(a):
                    view = bufs[a].bitcast(jnp.uint32)
                    if num_kv_heads == 4:
                        w = view[slot]
                    else:
                        w = view[slot, pl.ds(j, kv_tok, stride=num_kv_heads // 4), :]
                    # 8-bit keys and values go into the matmuls as they are stored (bf16 x int8 /
                    # e4m3: Mosaic converts them on the way into the MXU, nothing widened in VMEM).
                    return pltpu.bitcast(w, byte_dtype)

                return load(0), load(1)

            def per_row(values):
                """[nr, 1]: values[k] on the rows of head 4j + k."""
                out = jnp.full((nr, 1), values[3], jnp.float32)
                for k in (2, 1, 0):
                    out = jnp.where(row_head == k, values[k], out)
                return out

            def load(ref, j):
                """(the quad's rows of `ref` as the LHS lays them out, the four heads' rows as
                read). 16-bit q is rotated in f32, where a sublane rotation moves whole words."""
                xs = [ref[4 * j + k, rs, :] for k in range(4)]
                y = xs[0].astype(jnp.float32)
                for k in range(1, 4):
                    rolled = pltpu.roll(xs[k].astype(jnp.float32), k * quarter, 0)
                    y = jnp.where(row_head == k, rolled, y)
                return y.astype(xs[0].dtype), xs

            def store(ref, j, x, read):
                for k in range(4):
                    back = x if k == 0 else pltpu.roll(x, nr - k * quarter, 0)
                    ref[4 * j + k, rs, :] = jnp.where(own, back, read[k])

            def scores(j):
                k, v = quad_kv(j)
                s = jax.lax.dot_general(
                    load(q_ref, j)[0],
                    k,
                    (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                # The softmax scale (and log2(e), or 1 / soft cap) rides on the column scales where
                # there are any, else on the per-row static scales, else it is one multiply.
                factor = sm_scale / soft_cap if soft_cap is not None else sm_scale * log2e
                if token_scales and not static_scales:
                    s = by_columns(s, 0, j, factor)
                else:
                    if token_scales:
                        s = by_columns(s, 0, j)
                    if static_scales:
                        factor = per_row([static_ref[0, 4 * j + k] for k in range(4)]) * factor
                    s = s * factor
                if soft_cap is not None:
                    s = jnp.tanh(s) * (soft_cap * log2e)
                return jnp.where(keep, s, -jnp.inf), v

            def update(j, s, v):
                m_prev, m_read = load(m_ref, j)
                l_prev, l_read = load(l_ref, j)
                acc_prev, acc_read = load(acc_ref, j)
                m_new, alpha, p, l_new = _base2_softmax_step(m_prev, l_prev, s)
                if token_scales:  # V's per-token scales fold into the probabilities
                    p = by_columns(p, 1, j)
                pv = jax.lax.dot_general(
                    p.astype(jnp.bfloat16),
                    v,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )
                if static_scales:
                    pv = pv * per_row([static_ref[1, 4 * j + k] for k in range(4)])
                store(m_ref, j, m_new * (1.0 / log2e), m_read)
                store(l_ref, j, l_new, l_read)
                store(acc_ref, j, alpha * acc_prev + pv, acc_read)

            _scores_one_ahead(num_kv_heads // 4, scores, update)

        active = npages > 0

        @pl.when(active)
        def _():
            fetch(i, slot, start=False)
            zero_stale_values()

        if narrow < rows:
            # Non-negative operands: truncating division (Mosaic has no floor division lowering for
            # every generation).
            fits = lax.div(r_lo, narrow) == lax.div(r_hi - 1, narrow)

            @pl.when(active & fits)
            def _():
                compute(pl.multiple_of(lax.div(r_lo, narrow) * narrow, narrow), narrow)

            @pl.when(active & jnp.logical_not(fits))
            def _():
                compute(0, rows)
        else:

            @pl.when(active)
            def _():
                compute(0, rows)

        return carry

    lax.fori_loop(item_lo, item_hi, run_item, 0)

    def finish(c, carry):
        r = pl.ds(pl.multiple_of(c * row_chunk, row_chunk), row_chunk)
        l = l_ref[:, r, :]
        o_ref[:, r, :] = (acc_ref[:, r, :] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, n_chunks, finish, 0)


def token_major_supported(kv_dtype, num_kv_heads: int, page_size: int | None = None) -> bool:
    """Whether the token-major kernel can unpack one KV head's rows of this cache: 32-bit caches,
    one KV head, bfloat16 with an even number of KV heads (two heads per 32-bit word), or int8 /
    float8_e4m3fn with a multiple of 4 (four heads per word); and a page's rows (page_size * Hkv)
    must fill whole sublane tiles, as pages sit back to back in the flat VMEM slot."""
    size = jnp.dtype(kv_dtype).itemsize
    if page_size is not None and (page_size * num_kv_heads) % tiling.row_tile(kv_dtype):
        return False
    if size == 1:
        return num_kv_heads % 4 == 0
    return (
        num_kv_heads == 1
        or size == 4
        or (jnp.dtype(kv_dtype) == jnp.bfloat16 and num_kv_heads % 2 == 0)
    )


def _pinned_to_hbm(x):
    """x constrained to HBM where it is traced (a constraint binds inside a jit only; an eager
    call's operands are already device buffers in HBM). Compiled calls only: the interpreters
    refuse an operand tagged with a memory space."""
    if isinstance(x, jax.core.Tracer):
        return pltpu.with_memory_space_constraint(x, pltpu.HBM)
    return x


def _tpu_interpret_mode(interpret) -> bool:
    """Whether this pallas_call will run in TPU interpret mode (passed, or forced by
    pltpu.force_tpu_interpret_mode, as the DMA counter does)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return True
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    v_pages: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    causal: bool = True,
    config: PagedAttentionConfig | None = None,
    generation: str | None = None,
    interpret=False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of packed queries over a head-major paged KV cache (module docstring).

    q [T, Hq, D]; kv_pages [num_pages, 2*Hkv, page_size, D] (K/V interleaved per head) or, with
    `v_pages`, k pages [num_pages, Hkv, page_size, D] and v_pages of the same shape; kv_lens [S]
    int32; page_table [S, pages_per_seq] int32; cu_q_lens [S+1] int32; num_seqs [1] int32 (only
    the first num_seqs slots are live). Returns o [T, Hq, D] in q's dtype; rows of tokens that
    belong to no live sequence are zero. `sliding_window` w: a query at position p sees keys
    p-w+1..p. `soft_cap` c: scores become c * tanh(s / c). Inputs are not validated here (the
    torch ops do it); out-of-range page table entries would be read out of bounds. `sinks` [Hq]:
    attention-sink logits (see paged_attention_token_major).
    """
    n_arr = 1 if v_pages is None else 2
    num_pages, heads_in_cache, page_size = kv_pages.shape[:3]
    hkv = heads_in_cache // 2 if n_arr == 1 else heads_in_cache
    caches = [kv_pages] + ([v_pages] if n_arr == 2 else [])
    return _attention(
        q,
        caches,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        hkv=hkv,
        page_size=page_size,
        token_major=False,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        causal=causal,
        config=config,
        generation=generation,
        interpret=interpret,
        sinks=sinks,
    )


def paged_attention_token_major(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    new_k_scale: jax.Array | None = None,
    new_v_scale: jax.Array | None = None,
    k_head_scale: jax.Array | None = None,
    v_head_scale: jax.Array | None = None,
    sinks: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    causal: bool = True,
    config: PagedAttentionConfig | None = None,
    generation: str | None = None,
    interpret=False,
):
    """Ragged paged attention over token-major caches, the layout flash-attn, vLLM and
    Transformers keep: k_cache / v_cache [num_blocks, block_size, Hkv, D], read in place (the
    kernel DMAs pages of the cache itself; `[nb, bs, Hkv, D] -> [nb, bs * Hkv, D]` merges
    contiguous dims, a bitcast). Other arguments as `ragged_paged_attention`.

    8-bit caches: int8 or float8_e4m3fn, the latter also as its raw bytes (uint8 caches are read
    as e4m3): a caller holding e4m3 pages as bytes (the torch bridge) passes them as they are,
    since a uint8 -> float8 `bitcast_convert_type` on a whole cache is a copy on TPU (deviceless
    compile: one cache-sized temporary per cache).

    With new_k / new_v [T, Hkv, D]: the new tokens' K/V are first written into their slots by
    `write_kv_token_major` (a Pallas kernel with the caches aliased to its outputs), then
    attention reads the updated caches; returns (out, k_cache, v_cache). Jit the caller with the
    caches donated so that the write happens in place (otherwise XLA copies each cache once to
    keep the caller's arrays intact). Without new_k / new_v returns out.
    """
    nb, bs, hkv, d = k_cache.shape
    if (new_k is None) != (new_v is None):
        raise ValueError("new_k and new_v: pass both or neither")
    if (k_scale is None) != (v_scale is None) or (k_head_scale is None) != (v_head_scale is None):
        raise ValueError("k/v scales: pass the K and V scales together")
    if new_k is not None:
        k_cache, v_cache = write_kv_token_major(
            k_cache,
            v_cache,
            new_k,
            new_v,
            kv_lens,
            page_table,
            cu_q_lens,
            num_seqs,
            interpret=interpret,
        )
        if k_scale is not None:
            if new_k_scale is None or new_v_scale is None:
                raise ValueError("new_k_scale / new_v_scale: needed with new_k and k_scale")
            slots = write_slots(
                kv_lens.astype(jnp.int32),
                page_table.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32),
                num_seqs.astype(jnp.int32).reshape(1),
                bs,
                new_k.shape[0],
                num_pages=nb,
            )
            page, row = slots // bs, slots % bs
            k_scale = k_scale.at[page, :, row].set(new_k_scale.astype(k_scale.dtype), mode="drop")
            v_scale = v_scale.at[page, :, row].set(new_v_scale.astype(v_scale.dtype), mode="drop")
    caches = [k_cache.reshape(nb, bs * hkv, d), v_cache.reshape(nb, bs * hkv, d)]
    out = _attention(
        q,
        caches,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        hkv=hkv,
        page_size=bs,
        token_major=True,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        causal=causal,
        config=config,
        generation=generation,
        interpret=interpret,
        token_scales=None if k_scale is None else (k_scale, v_scale),
        head_scales=None if k_head_scale is None else (k_head_scale, v_head_scale),
        sinks=sinks,
    )
    if new_k is None:
        return out
    return (out, k_cache, v_cache) if k_scale is None else (out, k_cache, v_cache, k_scale, v_scale)


def _attention(
    q,
    caches,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    hkv: int,
    page_size: int,
    token_major: bool,
    sm_scale,
    sliding_window,
    soft_cap,
    causal,
    config,
    generation,
    interpret,
    token_scales=None,
    head_scales=None,
    sinks=None,
):
    T, hq, d = q.shape
    n_arr = len(caches)
    kv_dtype = caches[0].dtype
    heads_in_cache = caches[0].shape[1]
    group = hq // hkv
    S, pages_per_seq = page_table.shape
    if token_major and not token_major_supported(kv_dtype, hkv, page_size):
        raise ValueError(
            f"token-major caches of {jnp.dtype(kv_dtype).name} with {hkv} KV heads "
            f"and block_size {page_size}: 16-bit pages need bfloat16 and an even "
            "number of KV heads (or one), 8-bit pages a multiple of 4 KV heads, and "
            "block_size * KV heads a multiple of the sublane tile "
            f"({tiling.row_tile(kv_dtype)} rows)"
        )
    quant = {1: ("int8" if kv_dtype == jnp.int8 else "fp8")}.get(jnp.dtype(kv_dtype).itemsize)
    if quant is not None and not token_major:
        raise ValueError("8-bit caches: only the token-major layout (paged_attention_token_major)")
    if quant is not None and kv_dtype not in (jnp.int8, jnp.float8_e4m3fn, jnp.uint8):
        raise TypeError(
            f"8-bit caches: int8, float8_e4m3fn or its bytes as uint8, got "
            f"{jnp.dtype(kv_dtype).name}"
        )
    if token_scales is not None:
        want = (caches[0].shape[0], hkv, page_size)
        if quant is None or page_size % 128:
            raise ValueError(
                "k_scale / v_scale (per token): 8-bit caches with block_size a "
                f"multiple of 128 (got {jnp.dtype(kv_dtype).name}, {page_size})"
            )
        for name, a in zip(("k_scale", "v_scale"), token_scales):
            if a.shape != want:
                raise ValueError(
                    f"{name}: expected shape {want} [num_blocks, Hkv, block_size], got {a.shape}"
                )
        token_scales = [a.astype(jnp.float32) for a in token_scales]
    if head_scales is not None:
        for name, a in zip(("k_head_scale", "v_head_scale"), head_scales):
            if a.shape != (hkv,):
                raise ValueError(
                    f"{name}: expected shape ({hkv},) (one per KV head), got {a.shape}"
                )
        head_scales = jnp.stack([a.astype(jnp.float32) for a in head_scales])
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks: expected shape ({hq},) (one per query head), got {sinks.shape}")
    sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
    cfg = tiling.choose_config(
        num_tokens=T,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        q_dtype=q.dtype,
        kv_dtype=kv_dtype,
        generation=generation,
        config=config,
        token_major=token_major,
        token_scales=token_scales is not None,
    )
    bq, ppb = cfg.block_q, cfg.pages_per_block
    t_pad = _cdiv(max(T, 1), bq) * bq
    nqb = t_pad // bq
    rows = bq * group
    max_items = cfg.max_items or _schedule.max_items_bound(
        num_q_blocks=nqb,
        max_num_seqs=S,
        pages_per_seq=pages_per_seq,
        pages_per_block=ppb,
        block_q=bq,
        page_size=page_size,
        sliding_window=sliding_window if causal else None,
    )
    stream_pt = tiling.streams_page_table(S, pages_per_seq, cfg)
    smem = tiling.smem_bytes(S, pages_per_seq, max_items, stream_pt, nqb)
    if smem > tiling.SMEM_BUDGET_BYTES:
        raise ValueError(
            f"work list ({max_items} items) and page table ({S} x {pages_per_seq}, "
            f"{'streamed' if stream_pt else 'resident'}) need {smem} bytes of SMEM, over the "
            f"{tiling.SMEM_BUDGET_BYTES}-byte budget: split the batch or use larger pages"
        )

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32).reshape(1)
    work, block_ends = build_work_list(
        kv_lens,
        cu_q_lens,
        num_seqs,
        block_q=bq,
        num_q_blocks=nqb,
        page_size=page_size,
        pages_per_block=ppb,
        sliding_window=sliding_window,
        causal=causal,
        max_items=max_items,
    )

    # [T, Hq, D] -> [Hkv, T_pad * G, D]: the G query heads of a KV head become token-major rows.
    qh = q.reshape(T, hkv, group, d).transpose(1, 0, 2, 3)
    qh = jnp.pad(qh, ((0, 0), (0, t_pad - T), (0, 0), (0, 0))).reshape(hkv, t_pad * group, d)

    page_table = page_table.astype(jnp.int32)
    if stream_pt:
        # [S, 1, P]: a sequence's row is a leading-dim slice (tile-aligned for the DMA).
        pt_smem, pt_hbm = jnp.zeros((1,), jnp.int32), [page_table.reshape(S, 1, pages_per_seq)]
    else:
        pt_smem, pt_hbm = page_table.reshape(-1), []

    unpack_u32 = not _tpu_interpret_mode(interpret)
    narrow = tiling.narrow_rows(group, rows)
    quad_heads = unpack_u32 and tiling.quad_heads(
        kv_dtype, hkv, group, narrow, token_scales is not None
    )
    kernel = functools.partial(
        _paged_kernel,
        n_arr=n_arr,
        num_kv_heads=hkv,
        head_dim=d,
        group=group,
        block_q=bq,
        page_size=page_size,
        pages_per_block=ppb,
        pages_per_seq=pages_per_seq,
        max_items=max_items,
        num_q_blocks=nqb,
        narrow=narrow,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        causal=causal,
        stream_pt=stream_pt,
        token_major=token_major,
        unpack_u32=unpack_u32,
        word_stores=not interpret and not _tpu_interpret_mode(interpret),
        quant=quant,
        token_scales=token_scales is not None,
        static_scales=head_scales is not None,
        sinks=sinks is not None,
        quad_heads=quad_heads,
    )
    extra_in, extra_specs, scale_scratch = [], [], []
    if token_scales is not None:
        # Kept in HBM: under jit XLA may otherwise prefetch a scale array that fits VMEM into it
        # before the call (TPU7x did, 16 MiB of K scales at Llama-3-8B 64 x 8192), and Mosaic then
        # copies each page's scales with vector loads and stores in a loop of its own.
        extra_in += [a if interpret else _pinned_to_hbm(a) for a in token_scales]
        extra_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
        scale_scratch = [pltpu.VMEM((2, hkv, ppb * page_size), jnp.float32) for _ in range(2)]
        if quad_heads:
            t = tiling.SPREAD_TOKENS
            scale_scratch += [
                pltpu.VMEM((3 * t, 4 * t), jnp.bfloat16),
            ] + [pltpu.VMEM((4, ppb * page_size // t * hkv, t), jnp.float32)] * 2
    if head_scales is not None:
        extra_in.append(head_scales)
        extra_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    if sinks is not None:
        # Row r of a q block for KV head h is query head h * G + r % G.
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, 1, group), (1, bq, 1))
        extra_in.append(sink_rows.reshape(hkv, rows, 1))
        extra_specs.append(pl.BlockSpec((hkv, rows, 1), lambda i, *_: (0, 0, 0)))

    def qo_map(b, *_):
        return (0, b, 0)

    gen = get_generation(generation)
    need = tiling.vmem_need_bytes(
        block_q=bq,
        pages_per_block=ppb,
        page_size=page_size,
        num_kv_heads=hkv,
        group=group,
        head_dim=d,
        q_dtype=q.dtype,
        kv_dtype=kv_dtype,
        token_scales=token_scales is not None,
        sinks=sinks is not None,
    )
    if token_major:
        # One flat [pages * page_size * Hkv, D] slot per cache: row t * Hkv + h.
        kv_scratch = [pltpu.VMEM((2, ppb * page_size * hkv, d), kv_dtype) for _ in range(n_arr)]
    else:
        kv_scratch = [
            pltpu.VMEM((2, ppb, heads_in_cache, page_size, d), kv_dtype) for _ in range(n_arr)
        ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(nqb,),
        in_specs=[pl.BlockSpec((hkv, rows, d), qo_map)]
        + [pl.BlockSpec(memory_space=pl.ANY)] * n_arr
        + extra_specs
        + [pl.BlockSpec(memory_space=pl.ANY)] * int(stream_pt),
        out_specs=pl.BlockSpec((hkv, rows, d), qo_map),
        scratch_shapes=kv_scratch
        + scale_scratch
        + [
            pltpu.SemaphoreType.DMA((2, n_arr + 2 * int(token_scales is not None))),
        ]
        + (
            [pltpu.SMEM((2, 1, pages_per_seq), jnp.int32), pltpu.SemaphoreType.DMA((2,))]
            if stream_pt
            else []
        )
        + [
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, d), jnp.float32),
        ],
    )
    cost = tiling.static_cost(
        num_tokens=T,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        num_seqs=S,
        pages_per_seq=pages_per_seq,
        num_pages=caches[0].shape[0],
        q_dtype=q.dtype,
        kv_dtype=kv_dtype,
        config=cfg,
        sliding_window=sliding_window if causal else None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((hkv, t_pad * group, d), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            # Mosaic guards every DMA with a runtime bounds check of its HBM and VMEM ranges,
            # ~45 serial scalar bundles per page's copies (TPU7x, 8-bit pages with scales: 71 ->
            # 24 bundles a page). Every address here is in bounds by construction (page ids
            # clamped in page_lookup, slots and page offsets static or from the work list).
            disable_bounds_checks=True,
            vmem_limit_bytes=cfg.vmem_limit_bytes or vmem_limit_bytes(gen, need),
        ),
        cost_estimate=pl.CostEstimate(**cost),
        interpret=interpret,
        name="ragged_paged_attention_tm" if token_major else "ragged_paged_attention",
    )(
        kv_lens,
        cu_q_lens,
        pt_smem,
        work.reshape(-1),
        block_ends,
        qh,
        *caches,
        *extra_in,
        *pt_hbm,
    )
    out = out.reshape(hkv, t_pad, group, d)[:, :T].transpose(1, 0, 2, 3).reshape(T, hq, d)
    return out


def write_kv(
    kv_pages: jax.Array,
    new_kv: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> jax.Array:
    """The cache with the new tokens' K/V written at their slots, everything else unchanged.

    kv_pages [num_pages, C, page_size, D] (head-major pages), new_kv [T, C, D]: token t of sequence
    s goes to position kv_lens[s] - q_len[s] + (t - cu_q_lens[s]) of s, i.e. page
    page_table[s, pos // page_size], row pos % page_size. Tokens of dead slots (s >= num_seqs) and
    padding tokens are dropped.

    An XLA scatter, not a Pallas kernel: in the head-major layout one token's row sits inside a
    (sublane x lane) tile, and Mosaic DMAs need tile-aligned offsets, so a Pallas writer would
    have to read-modify-write whole tiles. Measured in the deviceless compile (jit with the cache
    donated, Llama-3-8B cache of 2 GiB): XLA updates the cache in place for up to 512 new tokens
    (decode batches); for 2111 tokens it adds a full-cache temporary.
    """
    num_pages, _, page_size, _ = kv_pages.shape
    slots = write_slots(
        kv_lens, page_table, cu_q_lens, num_seqs, page_size, new_kv.shape[0], num_pages=num_pages
    )
    page, row = slots // page_size, slots % page_size
    return kv_pages.at[page, :, row, :].set(new_kv.astype(kv_pages.dtype), mode="drop")


def write_slots(
    kv_lens, page_table, cu_q_lens, num_seqs, page_size: int, num_tokens: int, num_pages: int
):
    """Flat cache slot (page * page_size + row) of each packed new token; out of range
    (num_pages * page_size) for tokens of no live sequence."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    S = kv_lens.shape[0]
    live_end = cu_q_lens[jnp.minimum(num_seqs.reshape(-1)[0], S)]
    seq = jnp.clip(searchsorted(cu_q_lens, t, side="right", xp=jnp) - 1, 0, S - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    page = page_table[seq, jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)]
    slot = page * page_size + pos % page_size
    return jnp.where(t < live_end, slot, num_pages * page_size)


# DMAs of the cache writer in flight at once before the oldest is waited for.
WRITE_WINDOW = 16


def _write_kernel(
    slots_ref, new_k, new_v, k_in, v_in, k_out, v_out, sem, *, num_tokens: int, page_size: int
):
    """Token t's K and V rows ([Hkv, D], one contiguous row of a token-major page) are copied by
    one DMA each from the new K/V into slot slots_ref[t] of the caches (skipped when < 0), HBM to
    HBM, at most WRITE_WINDOW tokens in flight."""
    del k_in, v_in  # aliased to k_out / v_out: the writes land in the caller's caches

    def copies(t, slot):
        page, row = lax.div(slot, page_size), lax.rem(slot, page_size)
        return (
            pltpu.make_async_copy(new_k.at[t], k_out.at[page, row], sem.at[0]),
            pltpu.make_async_copy(new_v.at[t], v_out.at[page, row], sem.at[1]),
        )

    def wait(t):
        @pl.when(slots_ref[t] >= 0)
        def _():
            for c in copies(0, 0):  # a wait needs only the semaphore and the shape
                c.wait()

    def body(t, carry):
        slot = slots_ref[t]

        @pl.when(slot >= 0)
        def _():
            for c in copies(t, slot):
                c.start()

        @pl.when(t >= WRITE_WINDOW)
        def _():
            wait(t - WRITE_WINDOW)

        return carry

    lax.fori_loop(0, num_tokens, body, 0)
    for j in range(max(0, num_tokens - WRITE_WINDOW), num_tokens):
        wait(j)


def write_kv_token_major(
    k_cache: jax.Array,
    v_cache: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    interpret=False,
):
    """(k_cache, v_cache) with the new tokens' K/V written at their slots by a Pallas kernel whose
    outputs alias the caches (input_output_aliases): with the caches donated to the enclosing jit
    the write is in place, whatever the number of new tokens (decode, chunked prefill, mixed).

    k_cache / v_cache [num_blocks, block_size, Hkv, D]; new_k / new_v [T, Hkv, D]: token t of
    sequence s goes to position kv_lens[s] - q_len[s] + (t - cu_q_lens[s]), i.e. page
    page_table[s, pos // block_size], row pos % block_size. A token's [Hkv, D] row is contiguous
    in this layout and a whole number of (sublane, lane) tiles when Hkv fills the sublane tile,
    so one DMA moves it with no read-modify-write. Tokens of dead slots and padding are skipped.
    """
    nb, bs, hkv, d = k_cache.shape
    T = new_k.shape[0]
    slots = write_slots(
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32).reshape(1),
        bs,
        T,
        num_pages=nb,
    )
    slots = jnp.where(slots < nb * bs, slots, -1).astype(jnp.int32)
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    row_bytes = hkv * d * itemsize
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(1,),
        in_specs=[any_spec] * 4,
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    return pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=T, page_size=bs),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # Each new token's K and V rows: read once from new_k / new_v, written once.
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=int(2 * 2 * T * row_bytes + 4 * T)
        ),
        interpret=interpret,
        name="paged_kv_write",
    )(
        slots,
        _as_cache_dtype(new_k, k_cache.dtype),
        _as_cache_dtype(new_v, v_cache.dtype),
        k_cache,
        v_cache,
    )


def _as_cache_dtype(x, dtype):
    """New K/V in the cache's dtype; a uint8 cache holds e4m3 bytes (converted, then bitcast)."""
    if dtype == jnp.uint8 and x.dtype != jnp.uint8:
        return lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)
    return x.astype(dtype)


__all__ = [
    "ragged_paged_attention",
    "paged_attention_token_major",
    "write_kv_token_major",
    "token_major_supported",
    "build_work_list",
    "write_kv",
    "write_slots",
    "PagedAttentionConfig",
]
