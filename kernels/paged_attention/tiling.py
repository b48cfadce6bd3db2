"""Tile choice and closed-form cost of the ragged paged attention kernel.

Two tile sizes drive the kernel (see kernel.py for the schedule):

- `block_q`: query tokens per q block. One q block holds `block_q * G` rows per KV head (G query
  heads per KV head), so the MXU sees `block_q * G` rows in prefill. Decode items use a narrow path
  of `narrow_rows` rows instead (one token of G heads fits in it), so `block_q` does not inflate
  decode compute.
- `pages_per_block`: KV pages fetched per work item (one DMA per page per cache array, all KV heads
  of the page at once).

The budget model (`vmem_need_bytes`, against `vmem_budget_bytes`) counts every VMEM buffer: the two KV slots (double buffering), the q and output
blocks (double-buffered by the Pallas pipeline), the f32 accumulator and the softmax statistics,
and the f32 score/probability temporaries of one head. The SMEM model (`smem_bytes`) counts the
scalar-prefetched sequence metadata and work list, and the page table: kept whole in SMEM when it
is at most PAGE_TABLE_SMEM_BYTES, otherwise streamed (left in HBM, each work item's row DMA'd into
a two-row SMEM buffer two items ahead). A batch whose work list still exceeds the SMEM budget is
rejected with a ValueError.

`estimate_cost` replays the kernel's own work list (schedule.build_work_list, run on the host with
numpy) to give the exact bytes the kernel's DMAs and BlockSpec copies move.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import tpu_generations as _generations
from .schedule import (
    LAYOUT,
    compute_path,
    compute_paths,
    host_work_list,
    max_items_bound,
    path_runs,
)
from .tpu_generations import GENERATIONS, KernelCost, TpuGeneration, get_generation

MiB = 1 << 20
# Scalar-prefetched tables may use this much of the 1 MiB SMEM; the rest is left to Mosaic.
SMEM_BUDGET_BYTES = 768 * 1024
# A page table larger than this is streamed (one row per work item) instead of kept in SMEM.
PAGE_TABLE_SMEM_BYTES = 256 * 1024
# Rows of the MXU left-hand side in the narrow (decode) path.
NARROW_ROWS = 16
_NEG_LANES = 128  # a (rows, 1) f32 scratch is padded to 128 lanes in VMEM


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tiling of one kernel call. `None` fields are chosen by `choose_config`."""

    block_q: int | None = None  # query tokens per q block
    pages_per_block: int | None = None  # KV pages per work item
    max_items: int | None = None  # static work-list length; default: a proven upper bound
    # Keep the page table in HBM and DMA each item's row into SMEM (None: when the table is
    # larger than PAGE_TABLE_SMEM_BYTES).
    stream_page_table: bool | None = None
    vmem_limit_bytes: int | None = None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def row_align(group: int, sublanes: int = 16) -> int:
    """Smallest token count t with t * group a multiple of `sublanes` (block rows must tile)."""
    return sublanes // math.gcd(sublanes, group)


def row_tile(dtype) -> int:
    """Rows of one VMEM (sublane) tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit.
    Partial pages are copied in multiples of this."""
    return 8 * max(1, 4 // _itemsize(dtype))


def copy_tile(dtype, num_kv_heads: int = 1, token_major: bool = False) -> int:
    """Tokens per partial-page copy unit: the sublane tile (head-major pages, rows = tokens), or
    for token-major pages (rows = token * Hkv + head) the fewest tokens whose rows fill whole
    sublane tiles."""
    tile = row_tile(dtype)
    return tile // math.gcd(tile, num_kv_heads) if token_major else tile


def partial_page_chunks(page_size: int, dtype, tile: int | None = None) -> list[int]:
    """Token counts (descending powers of two times the copy tile, each < page_size) whose sums
    copy any tile-rounded valid prefix of a page; empty when a page is a single tile."""
    tile = tile or row_tile(dtype)
    sizes, size = [], tile
    while size < page_size:
        sizes.append(size)
        size *= 2
    # Binary decomposition: sizes sum to >= page_size - tile, so every tile-rounded prefix
    # shorter than a page is a sum of distinct sizes.
    if page_size % tile:
        return []
    return sizes[::-1]


def page_copy_plan(
    kv_len: int, first_page: int, npages: int, page_size: int, dtype, tile: int | None = None
):
    """(number of DMAs, tokens copied) for one item's pages, exactly as kernel.fetch issues them."""
    tile = tile or row_tile(dtype)
    chunks = partial_page_chunks(page_size, dtype, tile=tile)
    last_rows = kv_len - (first_page + npages - 1) * page_size
    rows_up = -(-last_rows // tile) * tile
    if npages == 0:
        return 0, 0
    if chunks and rows_up < page_size:
        parts = [c for c in chunks if (rows_up // c) % 2 == 1]
        return npages - 1 + len(parts), (npages - 1) * page_size + rows_up
    return npages, npages * page_size


def output_row_chunk(rows: int, out_dtype) -> int:
    """Rows of a q block one iteration of the kernel's init / write-back loops handles (kernel.py:
    rolled loops over 16-row chunks; a packed output whose sublane tile a chunk would split is
    written in one straight-line pass)."""
    chunk = math.gcd(rows, 16)
    if _itemsize(out_dtype) < 4 and chunk % row_tile(out_dtype):
        chunk = rows
    return chunk


def step_loop_trips(
    items,
    kv_lens,
    *,
    rows: int,
    out_dtype,
    kv_dtype,
    num_kv_heads: int,
    token_major: bool,
    page_size: int,
    pages_per_block: int,
    spread_matrix: bool = False,
    call_first: bool = True,
) -> dict[str, dict[str, int | tuple[int, int]]]:
    """The kernel's rolled loops outside its compute paths, in program order (kernel.py
    `_paged_kernel`), each with its iterations over the whole call for the work list `items`
    ((q_block, seq, first_page, num_pages) tuples, `host_work_list`, or a run of it, whose first
    item is the call's where `call_first`). A compiled schedule reads
    each loop's body once; these are the counts the benchmarks' scheduled time charges them by
    (`schedule_model.scheduled_from_work(loop_trips=..., block_loop_trips=...)`).

    "block": the grid step's own loops, around its loop over the q block's items:
    - `spread_matrix`: the quad path's 0/1 spreading matrix, written once per call;
    - `init` / `write_back`: the q block's statistics and output, once per q block, in chunks of
      `output_row_chunk` rows (no loop when one chunk covers the block).
    "item": the loops of one item:
    - `item_fetch`: the loop over the items an item starts (each item once; its branch around the
      rolled page copies runs for an item that does not fill its slot with full pages, and for
      the call's first item: (items, such items); the others' pages are started in straight-line
      code outside the loop, charged with the item's own code), holding
      `item_fetch/page_copies` (one iteration per full page of the items it copies: its K / V
      DMAs, and its scales' with per-token scales);
    - `page_waits`: the waits for a busy item's copies, one iteration per full page, where the
      item does not fill its slot with full pages (one wait per array covers a slot that is);
    - `stale_zeroing`: a busy item's page slots past its valid keys."""
    tile = copy_tile(kv_dtype, num_kv_heads, token_major)
    n_chunks = rows // output_row_chunk(rows, out_dtype)
    full = stale = rolled = waits = 0
    for index, (_, seq, first, npages) in enumerate(items):
        if not npages:
            continue
        kv_len = int(kv_lens[seq])
        # a last page copied short (its valid rows in chunks) is not one of the page loop's
        _, tokens = page_copy_plan(kv_len, first, npages, page_size, kv_dtype, tile)
        partial = tokens < npages * page_size
        # A whole slot of full pages: started in straight-line code (but the call's first item)
        # and waited for with one wait per array.
        whole = not partial and npages == pages_per_block
        if not whole or (call_first and index == 0):
            rolled += 1
            full += npages - int(partial)
        if not whole:
            waits += npages - int(partial)
        n_valid = min(npages * page_size, kv_len - first * page_size)
        stale += pages_per_block - n_valid // page_size
    q_blocks = len({it[0] for it in items})
    block: dict[str, int | tuple[int, int]] = {}
    if spread_matrix:
        block["spread_matrix"] = 3 * SPREAD_TOKENS // row_tile(np.float16)  # bf16 row tiles
    if n_chunks > 1:
        block["init"] = q_blocks * n_chunks
        block["write_back"] = q_blocks * n_chunks
    item = {
        "item_fetch": (len(items), rolled),
        "item_fetch/page_copies": full,
        "page_waits": waits,
        "stale_zeroing": stale,
    }
    return {"block": block, "item": item}


def narrow_rows(group: int, rows: int) -> int:
    """Rows of the narrow (decode) compute path; == rows means no narrow path."""
    return min(rows, _round_up(max(group, NARROW_ROWS), NARROW_ROWS))


def vmem_need_bytes(
    *,
    block_q: int,
    pages_per_block: int,
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    q_dtype,
    kv_dtype,
    token_scales: bool = False,
    sinks: bool = False,
) -> int:
    rows = block_q * group
    kv_tokens = pages_per_block * page_size
    kv_slots = 2 * kv_tokens * 2 * num_kv_heads * head_dim * _itemsize(kv_dtype)
    q_out = 2 * 2 * num_kv_heads * rows * head_dim * _itemsize(q_dtype)
    acc = num_kv_heads * rows * head_dim * 4
    stats = 2 * num_kv_heads * rows * _NEG_LANES * 4
    # f32 scores, probabilities and their exp/mask temporaries of one head (four [rows,
    # kv_tokens] arrays: with three, the compiled 512 x 1024 block of a mixed batch on v6e
    # overran the limit asked for by ~0.1 MiB), and one head's keys and values widened.
    temps = 4 * rows * kv_tokens * 4 + 2 * kv_tokens * head_dim * 4
    scales = 2 * 2 * _round_up(num_kv_heads, 8) * kv_tokens * 4 if token_scales else 0
    if quad_heads(kv_dtype, num_kv_heads, group, narrow_rows(group, rows), token_scales):
        # kernel.py compute_head_quads: the 8-bit keys and values go to the MXU as stored
        # (nothing widened in VMEM); with per-token scales the 0/1 spreading matrix and the
        # spread K and V scales.
        if token_scales:
            t = SPREAD_TOKENS
            scales += 3 * t * 4 * t * 2 + 2 * (kv_tokens // t) * num_kv_heads * 4 * t * 4
    sink_rows = 2 * num_kv_heads * rows * _NEG_LANES * 4 if sinks else 0
    return kv_slots + q_out + acc + stats + temps + scales + sink_rows


def choose_config(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    q_dtype,
    kv_dtype,
    generation: str | TpuGeneration | None = None,
    config: PagedAttentionConfig | None = None,
    token_major: bool = False,
    token_scales: bool | None = None,
) -> PagedAttentionConfig:
    """Fill the `None` fields of `config` for this generation: the candidates that fit the VMEM
    budget model, ranked by the shared model on `decode_cost` (`token_major`: the unit counts of
    token-major pages; 8-bit caches are always token-major; `token_scales`: 8-bit pages with
    per-token scales, whose VMEM slots and column multiplies the budget and the ranking count;
    None: 8-bit caches have them)."""
    gen = generation if isinstance(generation, TpuGeneration) else get_generation(generation)
    if token_scales is None:
        token_scales = _itemsize(kv_dtype) == 1
    config = config or PagedAttentionConfig()
    group = num_q_heads // num_kv_heads
    align = row_align(group)
    if config.block_q is not None and (config.block_q * group) % 8:
        raise ValueError(
            f"config.block_q={config.block_q}: block_q * (q heads per KV head = "
            f"{group}) must be a multiple of 8"
        )
    budget = vmem_budget_bytes(gen)
    kw = dict(
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        token_scales=token_scales,
    )
    max_tokens = _round_up(max(num_tokens, 1), align)

    def q_block(r):
        return min(max(align, _round_up(max(1, r // group), align)), max_tokens)

    def kv_block(tokens):
        return max(1, tokens // page_size)

    # Preference order (first that fits the budget wins): large KV blocks cut decode's per-item
    # cost (one item per KV block); large q blocks cut how often a long prefill's KV is re-read
    # (once per q block). Decode items take the narrow path whatever the q block, and a q block
    # never exceeds the batch's tokens, so decode-only batches get small q blocks for free.
    # 1024-token KV blocks come first down to 256-row q blocks: in a mixed batch the decode
    # items (one per KV block) outnumber the prefill's, and halving the KV block doubles them,
    # while halving the q block only doubles the prefill's KV reads, which its compute hides
    # (TPU7x's 24 MiB budget, mixed batch of 63 decodes + 2048 prefill: 632 busy steps at
    # 64 x 8 pages instead of 1256 at 128 x 4, compiled schedule in benchmarks/results).
    # 2048-token KV blocks come next: the model takes them where halving the steps beats its
    # tolerance (each item's own code and a decode item's per-item work), not
    # on a tie, since they double the KV slots and the score temporaries (31 MiB at 64-token q
    # blocks for Llama-3-8B: not within TPU7x's budget).
    prefs = [(r, 1024) for r in (1024, 512, 256)]
    prefs += [(r, 2048) for r in (1024, 512, 256)]
    prefs += [(r, 512) for r in (1024, 512, 256)]
    prefs += [(r, t) for t in (256, 128) for r in (256, 128)]
    prefs += [(16 * group, t) for t in (128, 64, 32, 16)]
    candidates = []
    for r, t in prefs:
        c = (
            config.block_q if config.block_q is not None else q_block(r),
            config.pages_per_block if config.pages_per_block is not None else kv_block(t),
        )
        if c not in candidates:
            candidates.append(c)
    # Ranked with the shared model (tpu_generations.best_tiles) on the batch the static shapes
    # describe (`decode_cost`, with the unit counts calibrated on the paged dumps); candidates
    # within the model's error (RANKING_TOLERANCE) of the fastest are ties, which the preference
    # order breaks.
    order = {c: i for i, c in enumerate(candidates)}
    fitting = [
        (
            c,
            decode_cost(
                gen,
                num_tokens=num_tokens,
                num_kv_heads=num_kv_heads,
                group=group,
                head_dim=head_dim,
                page_size=page_size,
                pages_per_seq=pages_per_seq,
                q_dtype=q_dtype,
                kv_dtype=kv_dtype,
                block_q=c[0],
                pages_per_block=c[1],
                token_major=token_major,
                token_scales=token_scales,
            ),
        )
        for c in candidates
        if vmem_need_bytes(block_q=c[0], pages_per_block=c[1], **kw) <= budget
    ]
    # Ties: the preference order picks the q block (it sets how often a prefill's keys are
    # re-read, which the decode-only static batch cannot show: v5e's mixed batch of 63 decodes +
    # 2048 prefill moves 2.66 GB at 128 x 8 pages, 3.13 GB at 64 x 16); among the tied KV blocks
    # at that q block, those whose compute (the time without DMA) is within the tolerance of the
    # least go first, then the preference order again. The static batch is DMA-bound on most
    # generations, where the ranking alone cannot tell the KV blocks apart, but the compute of a
    # batch that is not DMA-bound (8-bit caches, chunks of prefill) is what differs.
    secs = {c: _generations.ranked_seconds(cost, gen) for c, cost in fitting}
    compute = {
        c: _generations.ranked_seconds(dataclasses.replace(cost, hbm_bytes=0), gen)
        for c, cost in fitting
    }
    near = [c for c in secs if secs[c] <= min(secs.values()) * (1.0 + RANKING_TOLERANCE)]
    block_q0 = min(near, key=order.__getitem__)[0] if near else None
    least = min((compute[c] for c in near if c[0] == block_q0), default=0.0)

    def tie_break(c):
        return (c[0] != block_q0, compute[c] > least * (1.0 + RANKING_TOLERANCE), order[c])

    best = _generations.best_tiles(fitting, gen, tie_break=tie_break, within=RANKING_TOLERANCE)
    # nothing fits: the smallest tiles (overrides taken as given)
    block_q, ppb = best[0] if best is not None else candidates[-1]
    ppb = max(1, min(ppb, pages_per_seq))
    return PagedAttentionConfig(
        block_q=block_q,
        pages_per_block=ppb,
        max_items=config.max_items,
        vmem_limit_bytes=config.vmem_limit_bytes,
        stream_page_table=config.stream_page_table,
    )


# -------------------------------------------------------------------------------------------------
# What one decode item's compute pushes through each unit (the shared ranking model's inputs)
# -------------------------------------------------------------------------------------------------

# The compute path of a decode item (kernel.py `compute` on the narrow rows) is, per KV head, a
# [rows, D] x [D, kv_tokens] score matmul, the online softmax over [rows, kv_tokens] f32 scores,
# and a [rows, kv_tokens] x [kv_tokens, D] matmul; token-major pages also unpack the head's
# keys and values from 32-bit words (bf16: a shift or mask per word; int8: shift and sign
# extension; e4m3: the integer decode) before the MXU sees them. The constants below are the
# family's own inputs to the shared tpu_generations model, fitted on libtpu's LLO dumps of the
# named decode rows (benchmarks/results/tile_model_calibration.json "paged_points": each point's
# narrow-path region and the rest of its grid step, with the command that dumped it; jax 0.10.2,
# libtpu 0.0.42.1). The shared constants (fitted on flash and gmm) do not fit this path:
#
# - head-major pages: the path is bound by the K and V vregs going VMEM -> MXU as weights, one
#   dependent push at a time (the dumps' VLOAD-bound narrow regions, no unit above 26% busy, ~1.2
#   bundles per key of 8 heads on every generation). The shared memory_issue under-counts it:
#   PAGED_LOAD_ISSUE multiplies the loaded vregs and PAGED_HEAD_LOADS counts per-KV-head loads
#   besides K and V (q rows, statistics, accumulator, spilled mask temporaries), both least
#   squares on the 2- and 8-page KV blocks (256 and 1024 keys) of each generation (v6e's head
#   loads refitted 17 -> 20 when the accumulator's own-row select added 3-54 bundles a step:
#   its points' worst error 6.1% -> 4.9%);
# - token-major pages unpacked per head are VALU-bound (dumps: VALU 44-97% busy):
#   PAGED_VALU_PER_SCORE_VREG VALU ops per f32 score vreg (mask, scale, max, exp argument, select, sum: the head-major dumps' VALU
#   slots, 10.7 per score vreg) and PAGED_UNPACK_VALU[cache] per f32 vreg of keys and values
#   unpacked (fitted on v6e's 8-page points with the shared vector_issue; bf16's on the per-head
#   narrow path the pair path below replaced, and still what the whole-q-block path and odd
#   head counts unpack); PAGED_VALU_ISSUE scales
#   the VALU ops per generation (v5e's shared vector_issue is v6e's, never fitted on a
#   vector-bound v5e dump: its unpacking paths take 15% more bundles than that predicts);
# - 16-bit token-major pages with an even head count take the narrow path two KV heads at a time
#   (`pair_heads`, kernel.py compute_head_pairs): nothing unpacked, the pair's q rows stacked
#   against both heads' keys, so each head's scores are twice the vregs; its softmax drops the
#   second select and exp's log2(e) multiply (base-2 scores): PAIR_VALU_PER_SCORE_VREG VALU ops
#   per f32 score vreg (v6e's 8-page dump: its VALU slots over its score vregs; no point is
#   VALU-bound by the model). The path is load-bound as the head-major one, with
#   PAIR_LOAD_FACTOR times the K and V vregs (strided word loads, the stacked scores spilled),
#   fitted on the bf16 token-major points (8 and 4 pages, every generation: within 5.2%);
#   an item of at most half the narrow rows (a decode token) takes the compact form instead
#   (`compact_pairs`: head 2m + 1's rows ride in the rows the item does not own), half the score
#   vregs and nothing spilled: COMPACT_PAIR_LOAD_FACTOR, fitted on the same points' compact
#   regions (each dump holds both forms; the stacked one still checks PAIR_LOAD_FACTOR);
# - 8-bit pages on the narrow path: a decode item takes the quad path (`quad_heads`, kernel.py
#   compute_head_quads: four KV heads per pass, the 8-bit keys and values straight into bf16 x
#   8-bit matmuls), as many score vregs and MXU pushes as the per-head path, VALU-bound:
#   QUAD_VALU_PER_SCORE_VREG VALU ops per f32 score vreg (mask, softmax, the q / statistics
#   rotations, bf16 packing), QUAD_WIDEN_VALU[cache] per f32 vreg of keys and values (what
#   Mosaic's conversion on the way into the MXU costs: int8 v5e's converts, v6e / TPU7x's matmul
#   prep; e4m3 the select of -0 on v5e / v6e, nothing on TPU7x; refitted per generation on the
#   8-bit points when the quads stopped widening in VMEM),
#   QUAD_HEAD_VALU per KV head (what does not scale with the keys) and, with per-token scales,
#   QUAD_TOKEN_SCALE_VALU per score vreg (the scales spread on the MXU, their selects and the two
#   column multiplies) in place of the per-head path's 3; per generation, fitted on the re-dumped
#   8-bit points (per-token scales at 4 and 8 pages, per-head scales at 8 pages), v5e's score
#   figure taken from v6e's (its 2 int8 points cannot separate it from the widening);
# - an item's own code outside the compute paths (the page DMA issue and wait loops with
#   their partial-page chunk branches, the straight-line page issue of an item filling its slot,
#   the stale-value zeroing of one page slot; the q block's statistics init and write-back run
#   once per grid step, around the item loop, and are not an item's) goes through the shared
#   step terms (step_vregs): the vregs it moves plus, per DMA stream (a cache array: one
#   head-major, K and V token-major; or a per-token scale array, PAGED_SCALE_STREAM_SHARE = 1:
#   each is one DMA per page like K and V), PAGED_STEP_STREAM_VREGS and
#   PAGED_PAGE_ISSUE_VREGS per page of the KV block (the straight-line issue, per layout: a
#   head-major page's one DMA compiles longer on v5e / v6e); a kernel whose decode items take
#   the quad path compiles a smaller item (its other paths are smaller): the step model less
#   QUAD_STEP_VREGS. The three per generation jointly, the least worst busy-step error over its
#   calibration points (a grid search on the re-dumped points, step 5 / 0.5 / 5 / 1 vregs), since
#   an item filling its slot started its pages in straight-line code: worst 3.4% / 3.3% / 3.1%
#   over the calibration points on v5e / v6e / TPU7x, over every point 4.9% / 5.2% / 3.1% (the
#   held-out ones). Before (one constant per stream, no page term): refitted when the kernel
#   dropped Mosaic's DMA bounds
#   checks (kernel.py's pallas_call: the item's code outside its paths 587 -> 378 bundles on
#   TPU7x's 8-bit point, 590 -> 346 on v6e's head-major one), and again when an item of full
#   pages took one wait per array (its code outside the paths 2-10 bundles longer, both wait
#   forms compiled; every point re-dumped each time, `paged_dump_targets.py --recalibrate`):
#   worst busy-step error over the calibration points 5.6% / 4.1% / 2.6% on v5e / v6e / TPU7x,
#   over every point 5.8% (v5e's held-out 4-page head-major point).
PAGED_LOAD_ISSUE = {"v5e": 1.34, "v6e": 1.58, "tpu7x": 2.88}
PAGED_HEAD_LOADS = {"v5e": 40.0, "v6e": 20.0, "tpu7x": 10.0}
PAGED_VALU_PER_SCORE_VREG = 10.7
PAGED_UNPACK_VALU = {
    "head_major": 0.0,
    "float32": 0.0,  # not dumped: no named row has f32 pages
    "bfloat16": 2.2,
    "int8": 2.7,
    "float8_e4m3fn": 7.9,
}
PAGED_VALU_ISSUE = {"v5e": 1.15, "v6e": 1.0, "tpu7x": 1.045}
PAIR_VALU_PER_SCORE_VREG = 11.7
PAIR_LOAD_FACTOR = 1.3
COMPACT_PAIR_LOAD_FACTOR = 0.94
QUAD_VALU_PER_SCORE_VREG = {"v5e": 12.0, "v6e": 12.0, "tpu7x": 14.2}
QUAD_WIDEN_VALU = {
    "int8": {"v5e": 1.05, "v6e": 0.5, "tpu7x": 0.5},
    "float8_e4m3fn": {"v5e": 0.3, "v6e": 0.27, "tpu7x": 0.0},
}
QUAD_STEP_VREGS = {"v5e": 10.0, "v6e": 5.0, "tpu7x": 40.0}
QUAD_HEAD_VALU = {"v5e": 84.0, "v6e": 58.0, "tpu7x": 25.0}
QUAD_TOKEN_SCALE_VALU = {"v5e": 7.4, "v6e": 8.1, "tpu7x": 3.4}
PAGED_SCALE_STREAM_SHARE = 1.0
PAGED_STEP_STREAM_VREGS = {"v5e": 60.0, "v6e": 90.0, "tpu7x": 60.0}
PAGED_PAGE_ISSUE_VREGS = {
    "head_major": {"v5e": 14.0, "v6e": 15.0, "tpu7x": 2.0},
    "token_major": {"v5e": 0.0, "v6e": 1.5, "tpu7x": 4.5},
}
# The model's error on a busy decode step (max |error| over "paged_points": 5.2%, v6e's held-out
# 4-page head-major point; 3.4% over the calibration points): candidates within 5% of the
# fastest are ties, ordered by the preference list.
RANKING_TOLERANCE = 0.05


def _variant(kv_dtype, token_major: bool) -> str:
    """Which unpacking a cache takes: head-major pages go to the MXU as stored; token-major pages
    are unpacked per KV head by dtype (8-bit caches are token-major only)."""
    name = np.dtype(kv_dtype).name
    if _itemsize(kv_dtype) == 1:
        return "int8" if name == "int8" else "float8_e4m3fn"
    if not token_major:
        return "head_major"
    # 32-bit pages are strided loads with nothing to unpack; other 16-bit types unpack as bf16.
    return "float32" if _itemsize(kv_dtype) == 4 else "bfloat16"


def pair_heads(kv_dtype, num_kv_heads: int, token_major: bool) -> bool:
    """Whether the narrow (decode) path computes KV heads two at a time (kernel.py
    compute_head_pairs): token-major 16-bit pages with an even number of KV heads, where one
    uint32 word holds one token of two heads."""
    return bool(token_major) and _itemsize(kv_dtype) == 2 and num_kv_heads % 2 == 0


def compact_pairs(kv_dtype, num_kv_heads: int, token_major: bool, group: int, narrow: int) -> bool:
    """Whether the pair path (`pair_heads`) also compiles its compact form (kernel.py
    compute_head_pairs): an item of one decode token holds `group` of the `narrow` rows, and the
    compact form takes items of at most narrow / 2 rows (the pair's second head rides in the rows
    the item does not own)."""
    return pair_heads(kv_dtype, num_kv_heads, token_major) and 2 * group <= narrow


# Tokens per chunk of the quad path's per-token scale spreading (kernel.py compute_head_quads):
# one lane row of a head's scales, spread over 4 * SPREAD_TOKENS score columns.
SPREAD_TOKENS = 128


def quad_heads(kv_dtype, num_kv_heads: int, group: int, narrow: int, token_scales: bool) -> bool:
    """Whether the narrow (decode) path computes a decode item's KV heads four at a time (kernel.py
    compute_head_quads): 8-bit pages (token-major) with a multiple of 4 KV heads, where one
    uint32 word holds one token of four heads, and a decode token's G rows fit a quarter of the
    narrow rows (the other three heads ride in the rows the item does not own); items of more
    rows take the per-head path. With per-token scales the item's scales are spread by one
    matmul over all KV heads' rows, which takes whole sublane tiles of heads: a multiple of 8
    KV heads."""
    return (
        _itemsize(kv_dtype) == 1
        and num_kv_heads % (8 if token_scales else 4) == 0
        and narrow % 4 == 0
        and 4 * group <= narrow
    )


def compact_rows(
    kv_dtype,
    num_kv_heads: int,
    token_major: bool,
    group: int,
    narrow: int,
    token_scales: bool = False,
) -> int:
    """The most rows an item may hold to take the narrow path's compact form, 0 where none is
    compiled (schedule.compute_paths): the 8-bit quad path's narrow / 4 (`quad_heads`), the
    16-bit pair path's narrow / 2 (`compact_pairs`): what the cost model and the benchmarks'
    step counts charge; the kernel compiles those two paths by the same two rules."""
    if quad_heads(kv_dtype, num_kv_heads, group, narrow, token_scales):
        return narrow // 4
    if compact_pairs(kv_dtype, num_kv_heads, token_major, group, narrow):
        return narrow // 2
    return 0


def item_units(
    gen: TpuGeneration,
    *,
    rows: int,
    kv_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype,
    token_major: bool = False,
    token_scales: bool = False,
    narrow: bool = True,
    compact: bool = False,
) -> dict:
    """What one work item's compute (`rows` q rows of each KV head against `kv_tokens` keys, the
    kernel's `compute(r0, rows)`) pushes through each unit, summed over its KV heads: MXU
    pushes of both matmuls, EUP pushes (one exp per score, one rescale exp per row), effective
    VALU ops (softmax per score vreg, unpacking per f32 vreg of keys and values, the
    per-key scales' multiplies), and VMEM loads (the cache's K and V vregs and the per-head
    loads, times the generation's PAGED_LOAD_ISSUE). `narrow`: the item takes the narrow path
    (`pair_heads` applies there); `compact`: the narrow path's compact form (`compact_rows`:
    the pair path's compact form, or the 8-bit quad path)."""
    dp = _round_up(head_dim, 128)
    kv_f32_vregs = 2 * kv_tokens * dp / 1024
    kv_loaded = 2 * kv_tokens * dp * _itemsize(kv_dtype) / 4096
    # v5p (no dump read) takes v5e's factors, as tpu_generations gives it v5e's bundle model.
    name = gen.name if gen.name in PAGED_LOAD_ISSUE else "v5e"
    scale_valu = 3.0
    if narrow and compact and _itemsize(kv_dtype) == 1:
        # The 8-bit quad path: per head, a quarter of a quad's [rows, 4 kv_tokens] scores and
        # matmuls (as many as the per-head path), the 8-bit keys and values converted on their
        # way into the MXU.
        score_vregs = rows * kv_tokens / 1024
        widen = QUAD_WIDEN_VALU[_variant(kv_dtype, True)][name]
        valu = QUAD_VALU_PER_SCORE_VREG[name] * score_vregs + widen * kv_f32_vregs
        valu += QUAD_HEAD_VALU[name]
        scale_valu = QUAD_TOKEN_SCALE_VALU[name]
        pushes = _generations.mxu_pushes(gen, rows, dp, kv_tokens)
        pushes += _generations.mxu_pushes(gen, rows, kv_tokens, dp)
    elif narrow and pair_heads(kv_dtype, num_kv_heads, token_major):
        # Per head: half of a pair's scores and of its matmuls, [2 rows, 2 kv_tokens] stacked,
        # [rows, 2 kv_tokens] compact.
        lhs_rows = rows if compact else 2 * rows
        score_vregs = lhs_rows * kv_tokens / 1024
        valu = PAIR_VALU_PER_SCORE_VREG * score_vregs
        pushes = _generations.mxu_pushes(gen, lhs_rows, dp, 2 * kv_tokens) / 2
        pushes += _generations.mxu_pushes(gen, lhs_rows, 2 * kv_tokens, dp) / 2
        kv_loaded *= COMPACT_PAIR_LOAD_FACTOR if compact else PAIR_LOAD_FACTOR
    else:
        score_vregs = rows * kv_tokens / 1024
        unpack = PAGED_UNPACK_VALU[_variant(kv_dtype, token_major)]
        valu = PAGED_VALU_PER_SCORE_VREG * score_vregs + unpack * kv_f32_vregs
        pushes = _generations.mxu_pushes(gen, rows, dp, kv_tokens)
        pushes += _generations.mxu_pushes(gen, rows, kv_tokens, dp)
    if token_scales:  # the K scale multiply and the V scale multiply and select, per score vreg
        valu += scale_valu * score_vregs
    load_issue = PAGED_LOAD_ISSUE[name]
    head_loads = PAGED_HEAD_LOADS[name]
    return {
        "mxu_pushes": num_kv_heads * pushes,
        "eup_pushes": num_kv_heads * (score_vregs + -(-rows // 8)),
        "valu_ops": num_kv_heads * valu * PAGED_VALU_ISSUE[name],
        "vmem_loads": num_kv_heads * (kv_loaded + head_loads) * load_issue,
    }


def step_vregs(
    gen: TpuGeneration,
    *,
    page_size: int,
    pages_per_block: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype,
    token_major: bool = False,
    token_scales: bool = False,
    quads: bool = False,
) -> float:
    """Vregs one work item's own code moves outside its compute path (KernelCost.step_vregs per
    item): the stale-value zeroing of one page slot (loaded and stored) and
    PAGED_STEP_STREAM_VREGS per DMA stream (its page loop's issue and wait, the partial-page
    chunks' branches); less QUAD_STEP_VREGS where the kernel's decode items take the quad path
    (`quads`: `quad_heads`). The q block's rows do not enter: its init and write-back run once
    per grid step, not per item."""
    dp = _round_up(head_dim, 128)
    page = page_size * num_kv_heads * dp * _itemsize(kv_dtype) / 4096
    zero = 2 * page if token_major else 2 * page / 2  # head-major: the V half of the page
    streams = 2 if token_major else 1
    if token_scales:  # the K and V scale pages: two more page loops, without partial chunks
        streams += 2 * PAGED_SCALE_STREAM_SHARE
    name = gen.name if gen.name in PAGED_STEP_STREAM_VREGS else "v5e"
    fewer = QUAD_STEP_VREGS[name] if quads else 0.0
    layout = "token_major" if token_major else "head_major"
    per_page = PAGED_PAGE_ISSUE_VREGS[layout][name]
    per_stream = PAGED_STEP_STREAM_VREGS[name] + pages_per_block * per_page
    return zero + streams * per_stream - fewer


def _busy_step_units(
    gen,
    *,
    block_q,
    group,
    kv_tokens,
    page_size,
    num_kv_heads,
    head_dim,
    kv_dtype,
    token_major,
    token_scales,
) -> tuple[dict, float]:
    """(item_units of the compute path a decode item takes at these tiles, over `kv_tokens` keys:
    its `narrow_rows`, in the compact form (pairs or quads) where that is compiled; the
    step_vregs of the item's own code outside that path): one busy decode step as the ranking
    charges it. 8-bit caches are token-major."""
    rows = narrow_rows(group, block_q * group)
    token_major = token_major or _itemsize(kv_dtype) == 1
    variant = dict(kv_dtype=kv_dtype, token_major=token_major, token_scales=token_scales)
    units = item_units(
        gen,
        rows=rows,
        kv_tokens=kv_tokens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        compact=compact_rows(kv_dtype, num_kv_heads, token_major, group, rows, token_scales) > 0,
        **variant,
    )
    per_step = step_vregs(
        gen,
        page_size=page_size,
        pages_per_block=kv_tokens // page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        quads=quad_heads(kv_dtype, num_kv_heads, group, rows, token_scales),
        **variant,
    )
    return units, per_step


def decode_step_bundles(
    gen: TpuGeneration,
    *,
    block_q: int,
    group: int,
    pages_per_block: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype,
    token_major: bool = False,
    token_scales: bool | None = None,
) -> dict:
    """The shared model's bundles for one busy decode step at these tiles: `tile`, the compute
    path a decode item takes (tpu_generations.tile_bundles of `item_units`), and `step`, the
    step's own code (tpu_generations.step_bundles of `step_vregs`). What the calibration
    (tile_model_calibration.json "paged_points") compares with the dumps' narrow-path region and
    the rest of the grid step."""
    if token_scales is None:
        token_scales = _itemsize(kv_dtype) == 1
    u, sv = _busy_step_units(
        gen,
        block_q=block_q,
        group=group,
        kv_tokens=pages_per_block * page_size,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        token_major=token_major,
        token_scales=token_scales,
    )
    return {
        "tile": _generations.tile_bundles(gen, tiles=1, **u),
        "step": _generations.step_bundles(gen, step_vregs=sv, grid_steps=1),
    }


def decode_cost(
    gen: TpuGeneration,
    *,
    num_tokens: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    q_dtype,
    kv_dtype,
    block_q: int,
    pages_per_block: int,
    token_major: bool = False,
    token_scales: bool | None = None,
) -> KernelCost:
    """What the tile ranking charges a (block_q, pages_per_block) candidate when only static
    shapes are known (the lengths are traced): `num_tokens` decoding sequences, each at the full
    `pages_per_seq` context, the batch whose step count is largest. Each sequence is one (q
    block, sequence) pair of ceil(pages / pages_per_block) items, run by one grid step per q
    block (each item charged the step's own code, each grid step the fixed overhead), every page
    read once, q read and o written once, the work list in SMEM, and per item the unit counts of the
    path a decode item takes (`_busy_step_units`: `item_units` on `narrow_rows` rows, which are
    the whole q block when no narrow path is compiled, in the compact form (pairs or quads) where that is
    compiled) over its KV block, and the step's own code (`step_vregs`). Larger KV blocks
    amortise the per-item fixed bundles; block_q changes only the grid steps (one per q block)
    and is otherwise left to the tie-break (larger q blocks re-read a prefill's KV fewer times,
    which this batch does not show). `token_scales` (None: for 8-bit caches) adds the scale pages."""
    if token_scales is None:
        token_scales = _itemsize(kv_dtype) == 1
    ppb = max(1, min(pages_per_block, pages_per_seq))
    per_seq = -(-pages_per_seq // ppb)
    steps = num_tokens * per_seq
    rows = narrow_rows(group, block_q * group)
    kv_tokens = pages_per_seq * page_size
    kv_bytes = num_tokens * kv_tokens * 2 * num_kv_heads * head_dim * _itemsize(kv_dtype)
    if token_scales:
        kv_bytes += num_tokens * kv_tokens * 2 * num_kv_heads * 4
    qo_bytes = 2 * num_tokens * group * num_kv_heads * head_dim * _itemsize(q_dtype)
    table_bytes = 4 * (3 * num_tokens + 2 + num_tokens * pages_per_seq) + LAYOUT.nbytes(steps)
    issued = 4 * num_tokens * per_seq * rows * ppb * page_size * head_dim * num_kv_heads
    useful = 4 * num_tokens * group * kv_tokens * head_dim * num_kv_heads
    units, per_step = _busy_step_units(
        gen,
        block_q=block_q,
        group=group,
        kv_tokens=ppb * page_size,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        token_major=token_major,
        token_scales=token_scales,
    )
    return KernelCost(
        useful_flops=int(useful),
        mxu_flops=int(max(issued, useful)),
        hbm_bytes=int(kv_bytes + qo_bytes + table_bytes),
        min_hbm_bytes=int(kv_bytes + qo_bytes),
        grid_steps=-(-num_tokens // block_q),
        work_items=int(steps),
        compute_tiles=int(steps),
        mxu_pushes=int(round(steps * units["mxu_pushes"])),
        eup_pushes=int(round(steps * units["eup_pushes"])),
        valu_ops=int(round(steps * units["valu_ops"])),
        vmem_loads=int(round(steps * units["vmem_loads"])),
        step_vregs=int(round(steps * per_step)),
    )


def choose_tiles(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    q_dtype,
    kv_dtype,
    generation: str | TpuGeneration | None = None,
    override: PagedAttentionConfig | None = None,
) -> PagedAttentionConfig:
    """The collection's tile contract (tpu_generations.py, "Tile policy"): `choose_config` with
    the override under the shared name."""
    return choose_config(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        generation=generation,
        config=override,
    )


def streams_page_table(num_seqs: int, pages_per_seq: int, config: PagedAttentionConfig) -> bool:
    if config.stream_page_table is not None:
        return config.stream_page_table
    return 4 * num_seqs * pages_per_seq > PAGE_TABLE_SMEM_BYTES


def smem_bytes(
    num_seqs: int, pages_per_seq: int, max_items: int, stream: bool, num_q_blocks: int = 1
) -> int:
    """SMEM the kernel uses: kv_lens, cu_q_lens, the work list and each q block's end in it, and
    the page table (whole, or two rows when streamed)."""
    table = 2 * pages_per_seq if stream else num_seqs * pages_per_seq
    return 4 * (num_seqs + num_seqs + 1 + num_q_blocks + table) + LAYOUT.nbytes(max_items)


def vmem_budget_bytes(gen: TpuGeneration) -> int:
    """VMEM the default tiles may use: this family's share in tpu_generations.vmem_budget_bytes,
    3/4 of max(the default scoped limit, 3/8 of physical VMEM) (36 MiB on v5e/v6e, 24 MiB on
    TPU7x). The kernel asks Mosaic for vmem_limit_bytes(need) explicitly, so v5e's 16 MiB default
    does not bind."""
    return _generations.vmem_budget_bytes(gen, "paged_attention")


def runs_mxu_flops(runs, *, num_kv_heads, rows, narrow, kv_tokens, head_dim) -> int:
    """Issued MXU FLOPs of the items `path_runs` counts on each path: QK^T and PV over an item's
    `kv_tokens` for a whole-block item's `rows` per KV head, a narrow or compact item's `narrow`
    rows."""
    return sum(
        n * 2 * 2 * num_kv_heads * (rows if path == "whole" else narrow) * kv_tokens * head_dim
        for path, n in runs.items()
    )


def traffic(
    *,
    q_lens,
    kv_lens,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    max_num_seqs: int | None = None,
    num_tokens: int | None = None,
    q_dtype="bfloat16",
    kv_dtype="bfloat16",
    sliding_window: int | None = None,
    causal: bool = True,
    separate_kv: bool = False,
    token_major: bool = False,
    write_new_kv: bool = False,
    token_scales: bool = False,
    sinks: bool = False,
    head_scales: bool = False,
    generation: str | None = None,
    config: PagedAttentionConfig | None = None,
) -> dict:
    """Everything one call of `kernel.ragged_paged_attention` moves and computes, itemised.

    Arguments describe the batch as the kernel sees it: the live sequences' q_lens / kv_lens,
    `max_num_seqs` page-table rows (default: the live count), `num_tokens` rows of q (default:
    sum of q_lens). Keys: config, items (the work list), max_items, kv_dmas, kv_dma_bytes (manual
    page DMAs), qo_block_bytes (q blocks read + output blocks written by the BlockSpec pipeline:
    each q block once, as its items are consecutive), smem_bytes (scalar-prefetched tables),
    stream_page_table, pt_dmas / pt_dma_bytes (page-table rows DMA'd to SMEM when streamed),
    `token_major`: separate token-major K and V caches [num_blocks, block_size, Hkv, D]
    (`kernel.paged_attention_token_major`; a partial page is copied in copy_tile tokens),
    `write_new_kv`: the call also writes the new tokens' K/V (`kernel.write_kv_token_major`: one
    HBM -> HBM DMA per live token per cache, its [Hkv, D] row read and written: write_dmas,
    write_bytes, also added to min_hbm_bytes since any writer must move them; write_slot_bytes:
    the writer's scalar-prefetched slot of each of the num_tokens rows), `token_scales`: 8-bit
    pages with per-token-per-head scales [num_blocks, Hkv, block_size] f32 (scale_dmas /
    scale_dma_bytes: each listed page's K and V scale rows, whole), `sinks`: the per-row sink
    logits, one [Hkv, rows, 1] f32 block read once (sink_bytes), `head_scales`: per-head static
    K and V scales, one [2, Hkv] f32 SMEM block (head_scale_bytes),
    mxu_flops, useful_flops, min_hbm_bytes, vmem_bytes, units (the busy items' unit counts for
    the shared ranking model: compute_tiles, mxu_pushes, eup_pushes, valu_ops, vmem_loads,
    step_vregs; `item_units` per compute path, `step_vregs` per busy step).
    """
    gen = generation if isinstance(generation, TpuGeneration) else get_generation(generation)
    q_lens = [int(x) for x in q_lens]
    kv_lens = [int(x) for x in kv_lens]
    num_seqs = len(q_lens)
    max_num_seqs = max_num_seqs or num_seqs
    num_tokens = num_tokens or sum(q_lens)
    group = num_q_heads // num_kv_heads
    cfg = choose_config(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        generation=gen,
        config=config,
        token_major=token_major,
        token_scales=token_scales,
    )
    bq, ppb = cfg.block_q, cfg.pages_per_block
    t_pad = _round_up(max(num_tokens, 1), bq)
    nqb = t_pad // bq
    rows = bq * group
    nr = narrow_rows(group, rows)
    items = host_work_list(
        q_lens,
        kv_lens,
        block_q=bq,
        num_q_blocks=nqb,
        page_size=page_size,
        pages_per_block=ppb,
        sliding_window=sliding_window,
        causal=causal,
    )
    max_items = cfg.max_items or max_items_bound(
        num_q_blocks=nqb,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        pages_per_block=ppb,
        block_q=bq,
        page_size=page_size,
        sliding_window=sliding_window if causal else None,
    )
    kv_size, q_size = _itemsize(kv_dtype), _itemsize(q_dtype)
    variant = dict(
        kv_dtype=kv_dtype,
        token_major=token_major or _itemsize(kv_dtype) == 1,
        token_scales=token_scales,
    )
    compact = compact_rows(
        kv_dtype, num_kv_heads, variant["token_major"], group, nr, token_scales=token_scales
    )
    runs = path_runs(items, q_lens, block_q=bq, group=group, narrow=nr, compact=compact)
    mxu = runs_mxu_flops(
        runs,
        num_kv_heads=num_kv_heads,
        rows=rows,
        narrow=nr,
        kv_tokens=ppb * page_size,
        head_dim=head_dim,
    )
    # What the busy items' compute pushes through each unit (item_units per path) and the vregs
    # their steps' own code moves (step_vregs): the shared ranking model's inputs.
    units = {k: 0.0 for k in ("mxu_pushes", "eup_pushes", "valu_ops", "vmem_loads")}
    for path, n in runs.items():
        if n:
            u = item_units(
                gen,
                rows=rows if path == "whole" else nr,
                kv_tokens=ppb * page_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                narrow=path != "whole",
                compact=path == "compact",
                **variant,
            )
            for k in units:
                units[k] += n * u[k]
    units["compute_tiles"] = sum(runs.values())
    units["step_vregs"] = sum(runs.values()) * step_vregs(
        gen,
        page_size=page_size,
        pages_per_block=ppb,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        quads=quad_heads(kv_dtype, num_kv_heads, group, nr, token_scales),
        **variant,
    )
    separate_kv = separate_kv or token_major  # token-major caches are always K and V apart
    listed_pages = sum(npages for (_, _, _, npages) in items)
    scale_dmas = 2 * listed_pages if token_scales else 0
    scale_dma_bytes = scale_dmas * num_kv_heads * page_size * 4
    tile = copy_tile(kv_dtype, num_kv_heads, token_major)
    dmas, kv_rows = 0, 0
    for _, s, start, npages in items:
        if npages:
            n, r = page_copy_plan(kv_lens[s], start, npages, page_size, kv_dtype, tile=tile)
            dmas += n
            kv_rows += r
    row_bytes = 2 * num_kv_heads * head_dim * kv_size  # one token's K and V, all heads
    qo_block = num_kv_heads * rows * head_dim * q_size
    stream = streams_page_table(max_num_seqs, pages_per_seq, cfg)
    # Scalar-prefetched tables (a streamed page table is not prefetched: a 1-entry placeholder).
    prefetch_bytes = 4 * (
        max_num_seqs
        + (max_num_seqs + 1)
        + 4 * max_items
        + nqb
        + (1 if stream else max_num_seqs * pages_per_seq)
    )
    pt_dmas = len(items) if stream else 0  # one row per work item, empty items included

    useful = 0
    min_kv_tokens = 0
    for s in range(num_seqs):
        ql, kl = q_lens[s], kv_lens[s]
        if ql == 0:
            continue
        first = kl - ql
        if causal:
            lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
            min_kv_tokens += kl - lo
            for j in range(ql):
                pos = first + j
                vis = pos + 1 if sliding_window is None else min(pos + 1, sliding_window)
                useful += 4 * num_q_heads * head_dim * vis
        else:
            min_kv_tokens += kl
            useful += 4 * num_q_heads * head_dim * kl * ql
    min_bytes = (
        min_kv_tokens * 2 * num_kv_heads * head_dim * kv_size
        + 2 * sum(q_lens) * num_q_heads * head_dim * q_size
        + 4 * sum(-(-k // page_size) for k in kv_lens)
    )
    if token_scales:
        min_bytes += min_kv_tokens * 2 * num_kv_heads * 4
    new_tokens = sum(q_lens) if write_new_kv else 0
    write_dmas = 2 * new_tokens
    write_bytes = 2 * 2 * new_tokens * num_kv_heads * head_dim * kv_size
    min_bytes += write_bytes
    vmem = vmem_need_bytes(
        block_q=bq,
        pages_per_block=ppb,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        token_scales=token_scales,
        sinks=sinks,
    )
    return dict(
        config=cfg,
        items=items,
        max_items=max_items,
        q_blocks=nqb,
        kv_dmas=dmas * (2 if separate_kv else 1),
        kv_dma_bytes=kv_rows * row_bytes,
        qo_block_bytes=2 * nqb * qo_block,
        smem_bytes=prefetch_bytes,
        stream_page_table=stream,
        pt_dmas=pt_dmas,
        pt_dma_bytes=pt_dmas * 4 * pages_per_seq,
        mxu_flops=mxu,
        write_dmas=write_dmas,
        write_bytes=write_bytes,
        write_slot_bytes=4 * num_tokens if write_new_kv else 0,
        scale_dmas=scale_dmas,
        scale_dma_bytes=scale_dma_bytes,
        sink_bytes=num_kv_heads * rows * 4 if sinks else 0,
        head_scale_bytes=2 * num_kv_heads * 4 if head_scales else 0,
        useful_flops=useful,
        min_hbm_bytes=min_bytes,
        vmem_bytes=vmem,
        units={k: int(round(v)) for k, v in units.items()},
    )


def static_cost(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_seqs: int,
    pages_per_seq: int,
    num_pages: int,
    q_dtype,
    kv_dtype,
    config: PagedAttentionConfig,
    sliding_window: int | None = None,
) -> dict:
    """pl.CostEstimate fields for one kernel call from static shapes only (the lengths are traced
    values): every token of every page a sequence can address, at most the cache, read once
    (with a sliding window at most w + block_q - 1 keys per q block and sequence); q read and o
    written once; the MXU work of those keys against each query row; one exp per score. An upper
    bound of `estimate_cost`, which needs the actual lengths."""
    kv_size, q_size = _itemsize(kv_dtype), _itemsize(q_dtype)
    keys_per_seq = pages_per_seq * page_size
    if sliding_window is not None:
        keys_per_seq = min(keys_per_seq, sliding_window + (config.block_q or 1) - 1 + page_size)
    kv_tokens = min(num_seqs * keys_per_seq, num_pages * page_size)
    kv_bytes = kv_tokens * 2 * num_kv_heads * head_dim * kv_size
    qo_bytes = 2 * num_tokens * num_q_heads * head_dim * q_size
    scores = num_tokens * num_q_heads * min(keys_per_seq, kv_tokens)
    return dict(
        flops=int(4 * scores * head_dim),
        transcendentals=int(scores),
        bytes_accessed=int(kv_bytes + qo_bytes + 4 * num_seqs * pages_per_seq),
    )


def estimate_cost(
    *,
    tiles: PagedAttentionConfig | None = None,
    generation: str | TpuGeneration | None = None,
    **kwargs,
) -> KernelCost:
    """Closed-form cost of one kernel call (arguments: see `traffic`; `tiles`, the contract's name
    in tpu_generations.py "Tile policy", is traffic's `config`).

    hbm_bytes = KV page DMAs (every page a work item lists, once per item, all KV heads; a
    sequence's partly filled last page only up to its valid rows rounded up to the copy tile;
    pages outside the causal range or the sliding window are never listed) + q/output block
    copies + scalar-prefetched tables (+ the new tokens' K/V rows read and written, with
    write_new_kv). min_hbm_bytes = the KV tokens some query can see, each read
    once, + q read and o written once + one page-table entry per valid page. grid_steps = the
    q blocks (one grid step each), work_items = the items their steps loop over. mxu_flops counts
    the rows and columns issued (narrow decode path or the whole q block, times every page slot of
    the KV buffer)."""
    if tiles is not None:
        if kwargs.get("config") is not None:
            raise ValueError("estimate_cost: give tiles or config, not both")
        kwargs["config"] = tiles
    t = traffic(generation=generation, **kwargs)
    return KernelCost(
        useful_flops=int(t["useful_flops"]),
        mxu_flops=int(t["mxu_flops"]),
        hbm_bytes=int(
            t["kv_dma_bytes"]
            + t["qo_block_bytes"]
            + t["smem_bytes"]
            + t["pt_dma_bytes"]
            + t["write_bytes"]
            + t["write_slot_bytes"]
            + t["scale_dma_bytes"]
            + t["sink_bytes"]
            + t["head_scale_bytes"]
        ),
        min_hbm_bytes=int(t["min_hbm_bytes"]),
        grid_steps=int(t["q_blocks"]),
        work_items=len(t["items"]),
        vmem_bytes=int(t["vmem_bytes"]),
        **t["units"],
    )


__all__ = [
    "PagedAttentionConfig",
    "choose_config",
    "choose_tiles",
    "compact_pairs",
    "compact_rows",
    "quad_heads",
    "compute_path",
    "compute_paths",
    "estimate_cost",
    "path_runs",
    "max_items_bound",
    "traffic",
    "vmem_need_bytes",
    "vmem_budget_bytes",
    "narrow_rows",
    "row_align",
    "row_tile",
    "partial_page_chunks",
    "page_copy_plan",
    "copy_tile",
    "static_cost",
    "decode_cost",
    "item_units",
    "decode_step_bundles",
    "step_vregs",
    "RANKING_TOLERANCE",
    "GENERATIONS",
    "SMEM_BUDGET_BYTES",
    "PAGE_TABLE_SMEM_BYTES",
    "streams_page_table",
    "smem_bytes",
]
