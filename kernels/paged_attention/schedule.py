"""The ragged paged attention kernel's host-side schedule: its static work list, in one module.

One builder, `build_work_list`, for the traced program (`xp=jnp`: the lengths are traced values,
the list has the static length `max_items` and a padding tail) and for the host (`xp=np`: the cost
model and the tests, the list exactly as long as its items), following the collection's shared
contract (torch-ext/work_list.py): records of `LAYOUT` in one flat field-major SMEM array. The
records carry no flags: an empty item (a q block that holds no sequence's token) has SEQ == -1
and NUM_PAGES == 0; items are in q-block order, and each q block's end in the list (the second
array the builder returns) tells the kernel's grid step of that block which items to run. Imported by kernel.py and tiling.py alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .work_list import RecordLayout, searchsorted

# Q_BLOCK: the item's q block (its q / output BlockSpec index); padding repeats the last item's.
# SEQ: the sequence (page-table row), -1 for an empty item. FIRST_PAGE, NUM_PAGES: the KV block,
# pages [FIRST_PAGE, FIRST_PAGE + NUM_PAGES) of the sequence (NUM_PAGES <= pages_per_block).
LAYOUT = RecordLayout("paged_attention", ("Q_BLOCK", "SEQ", "FIRST_PAGE", "NUM_PAGES"))


def _cdiv(a, b):
    return (a + b - 1) // b


def max_items_bound(
    *,
    num_q_blocks: int,
    max_num_seqs: int,
    pages_per_seq: int,
    pages_per_block: int,
    block_q: int | None = None,
    page_size: int | None = None,
    sliding_window: int | None = None,
) -> int:
    """A static bound on the work list: at most num_q_blocks + max_num_seqs - 1 (q block, sequence)
    pairs (consecutive sequences share at most one block; an empty q block gets one empty item),
    each needing at most ceil(pages_per_seq / pages_per_block) KV blocks, or with a sliding window
    w at most ceil((ceil((w + block_q - 1) / page_size) + 1) / pages_per_block): the keys a block
    of block_q consecutive queries can see span w + block_q - 1 positions."""
    per_pair = max(1, -(-pages_per_seq // pages_per_block))
    if sliding_window is not None and block_q is not None and page_size is not None:
        pages = -(-(sliding_window + block_q - 1) // page_size) + 1
        per_pair = min(per_pair, max(1, -(-pages // pages_per_block)))
    return (num_q_blocks + max(max_num_seqs, 1) - 1) * per_pair


def build_work_list(
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    block_q: int,
    num_q_blocks: int,
    page_size: int,
    pages_per_block: int,
    sliding_window: int | None,
    causal: bool,
    max_items: int | None,
    xp: Any = None,
):
    """The kernel's work list as an int32 array [4, L] (LAYOUT.stack: Q_BLOCK, SEQ, FIRST_PAGE,
    NUM_PAGES; see the kernel module's docstring) and each q block's end in it, int32
    [num_q_blocks]: q block b owns items [ends[b - 1], ends[b]) (its grid step runs them), the
    last entry is the number of real items.

    One item per (q block, sequence, KV block of up to `pages_per_block` pages the block's
    queries can see), in q-block order, and one empty item for a q block with none. `kv_lens`
    [S] and `cu_q_lens` [S + 1] cover `S` page-table rows, the first `num_seqs[0]` of them live.
    `xp=jnp` (the default): L = `max_items`, items past the real ones repeat the last Q_BLOCK with
    SEQ == -1, NUM_PAGES == 0. `xp=np` with `max_items=None`: L = the number of real items."""
    if xp is None:
        import jax.numpy as xp
    if max_items is None and xp is not np:
        raise ValueError("build_work_list: a traced list needs a static max_items")
    num_slots = kv_lens.shape[0]
    q_start, q_end = cu_q_lens[:-1], cu_q_lens[1:]
    q_len = q_end - q_start
    live = xp.arange(num_slots) < num_seqs[0]
    b = xp.arange(num_q_blocks, dtype=xp.int32)[:, None]
    t0 = xp.maximum(q_start[None, :], b * block_q)
    t1 = xp.minimum(q_end[None, :], (b + 1) * block_q)
    overlap = (t0 < t1) & live[None, :]
    base = (kv_lens - q_len - q_start)[None, :]  # position of token t is base + t
    first_pos, last_pos = base + t0, base + t1 - 1
    if causal:
        k_lo = (
            xp.zeros_like(first_pos)
            if sliding_window is None
            else xp.maximum(first_pos - sliding_window + 1, 0)
        )
        k_hi = last_pos
    else:
        k_lo = xp.zeros_like(first_pos)
        k_hi = xp.broadcast_to(kv_lens[None, :] - 1, first_pos.shape)
    p_lo = k_lo // page_size
    p_hi = k_hi // page_size
    nkb = xp.where(overlap, _cdiv(p_hi - p_lo + 1, pages_per_block), 0)
    empty_block = (nkb.sum(axis=1) == 0).astype(xp.int32)
    counts = xp.concatenate([nkb, empty_block[:, None]], axis=1).reshape(-1)
    ends = xp.cumsum(counts)
    starts = ends - counts
    total = ends[-1]
    block_ends = xp.cumsum(counts.reshape(num_q_blocks, num_slots + 1).sum(axis=1))
    length = int(total) if max_items is None else max_items
    i = xp.arange(length, dtype=xp.int32)
    pair = xp.minimum(searchsorted(ends, i, side="right", xp=xp), counts.shape[0] - 1)
    k = i - starts[pair]
    qb, col = pair // (num_slots + 1), pair % (num_slots + 1)
    is_seq = col < num_slots
    s = xp.minimum(col, num_slots - 1)
    first = p_lo[qb, s] + k * pages_per_block
    npages = xp.minimum(pages_per_block, p_hi[qb, s] + 1 - first)
    real = i < total
    last_qb = qb[xp.maximum(total - 1, 0)]
    q_block = xp.where(real, qb, last_qb)
    seq = xp.where(real & is_seq, s, -1)
    first = xp.where(real & is_seq, first, 0)
    npages = xp.where(real & is_seq, npages, 0)
    work = LAYOUT.stack(
        dict(Q_BLOCK=q_block, SEQ=seq, FIRST_PAGE=first, NUM_PAGES=npages), xp
    ).astype(xp.int32)
    return work, block_ends.astype(xp.int32)


def compute_paths(*, rows: int, narrow: int, compact: int = 0) -> tuple[str, ...]:
    """The compute paths the kernel compiles, in program order (kernel.py `compute`): "compact",
    the narrow path's form for items of at most `compact` rows (0: not compiled;
    tiling.compact_rows: the KV-head pair path's compact form, or the 8-bit quad path);
    "narrow", the `narrow`-row slice holding a decode token's G heads (the pair path's stacked
    form where heads are paired, per KV head otherwise); "whole", the q block's `rows` rows (not
    compiled when narrow >= rows: the narrow code then takes every item)."""
    return ("compact",) * bool(compact) + ("narrow",) + ("whole",) * (narrow < rows)


def compute_path(
    q_start: int,
    q_end: int,
    q_block: int,
    *,
    block_q: int,
    group: int,
    narrow: int,
    compact: int = 0,
) -> str:
    """The compute path (`compute_paths`) an item of q block `q_block` runs for the sequence
    whose tokens are [q_start, q_end) of the packed batch, `group` rows each: "whole" unless
    its rows sit in one `narrow`-row slice; there "compact" when the item holds at most
    `compact` rows, else "narrow"."""
    rows = block_q * group
    b0 = q_block * block_q
    r_lo = (max(q_start, b0) - b0) * group
    r_hi = (min(q_end, b0 + block_q) - b0) * group
    if narrow < rows and r_lo // narrow != (r_hi - 1) // narrow:
        return "whole"
    return "compact" if r_hi - r_lo <= compact else "narrow"


def path_runs(
    items, q_lens, *, block_q: int, group: int, narrow: int, compact: int = 0
) -> dict[str, int]:
    """Busy items (those with pages) per compute path, keyed in `compute_paths` order: the
    steps that take each path, from `host_work_list`'s items for the sequences' `q_lens`."""
    cu = np.concatenate([[0], np.cumsum(np.asarray(q_lens, np.int64).reshape(-1))])
    rows = block_q * group
    runs = dict.fromkeys(compute_paths(rows=rows, narrow=narrow, compact=compact), 0)
    kw = dict(block_q=block_q, group=group, narrow=narrow, compact=compact)
    for b, s, _, npages in items:
        if npages:
            runs[compute_path(int(cu[s]), int(cu[s + 1]), b, **kw)] += 1
    return runs


def host_work_list(
    q_lens,
    kv_lens,
    *,
    block_q: int,
    num_q_blocks: int,
    page_size: int,
    pages_per_block: int,
    sliding_window: int | None,
    causal: bool,
):
    """`build_work_list` on the host (xp=np) for the live sequences' q_lens / kv_lens: the items
    as (q_block, seq, first_page, num_pages) tuples, the cost model's view of the list."""
    q_lens = np.asarray(q_lens, np.int32).reshape(-1)
    kv_lens = np.asarray(kv_lens, np.int32).reshape(-1)
    cu = np.concatenate([np.zeros(1, np.int32), np.cumsum(q_lens, dtype=np.int32)])
    work, block_ends = build_work_list(
        kv_lens,
        cu,
        np.array([len(q_lens)], np.int32),
        block_q=block_q,
        num_q_blocks=num_q_blocks,
        page_size=page_size,
        pages_per_block=pages_per_block,
        sliding_window=sliding_window,
        causal=causal,
        max_items=None,
        xp=np,
    )
    return [tuple(int(x) for x in work[:, j]) for j in range(int(block_ends[-1]))]


__all__ = ["LAYOUT", "build_work_list", "compute_path", "host_work_list", "max_items_bound"]
