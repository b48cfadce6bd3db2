"""The ragged-dot kernels' static work list: the host-side schedule, in one module.

One item per (row tile, group) pair that holds rows, in row order (see kernel.py's docstring);
`work_list` builds it with numpy on the host (tiling.estimate_cost replays it) and with jax.numpy
inside the jitted wrapper (`xp`), one function for both (torch-ext/work_list.py: the contract).
Records follow `LAYOUT` (named fields) and the shared flag bits of work_list.py; the row tiling
helpers the list depends on (row unit, chunk, tail buckets) live here too so that tiling.py and
kernel.py both import this module and neither imports the other's internals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .work_list import COMPUTE, FIRST, LAST, VALID, RecordLayout, cummax, searchsorted

# Work-list record fields (work_list.py: stored field-major, one int32 array [len(fields) * L]).
#   OUT: block index of the output (row tile for gmm, group for tgmm); padding repeats the last.
#   TILE: row tile whose lhs (and dout) block is resident; carried from the last computing item so
#         that items without MXU work never start a new DMA.
#   GROUP: the weight group whose rhs block is resident (gmm); carried like TILE, so GROUP never
#         decreases along the list and the items of one group form one *run*.
#   NEXT: the GROUP of the next run (-1 for the list's last run). A gmm whose weight block holds
#         all of K (tiling.prefetches_runs) starts copying the next run's block when a run
#         starts, so the copy hides under the whole run rather than under its last item.
#   KFIX: 1 for items without MXU work (gmm): their lhs/rhs block index freezes at the last K
#         block, which is the index the previous step left resident.
#   LO, HI: the item's rows inside the row tile, [LO, HI).
#   START, NFULL: the item's matmul first runs NFULL full chunks of `chunk` rows from START (a
#         multiple of the row unit at or below LO) in a loop,
#   TSTART, BUCKET: then one tail window [TSTART, TSTART + buckets[BUCKET]) covering the rows left
#         (BUCKET = -1: no tail). Rows outside [LO, HI) and rows an earlier chunk took are masked.
#   FLAGS: COMPUTE | FIRST (first item of its output block) | LAST | VALID (not padding).
LAYOUT = RecordLayout(
    "ragged_dot",
    (
        "OUT",
        "TILE",
        "GROUP",
        "NEXT",
        "KFIX",
        "LO",
        "HI",
        "START",
        "NFULL",
        "TSTART",
        "BUCKET",
        "FLAGS",
    ),
)
GMM_FIELDS = TGMM_FIELDS = LAYOUT.fields  # gmm and tgmm share the record layout
# The shared flag bits under this family's historical names.
F_COMPUTE, F_FIRST, F_LAST, F_VALID = COMPUTE, FIRST, LAST, VALID


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def row_unit(*dtypes) -> int:
    """Rows of one (sublane x lane) VMEM tile for the narrowest dtype: dynamic row offsets into a
    block must be multiples of it (f32: 8, bf16: 16, 8-bit: 32)."""
    return max(8 * 4 // _itemsize(d) for d in dtypes)


def row_chunk(tm: int) -> int:
    """Rows of one full matmul chunk: an item's rows run as full chunks in a loop plus one tail
    window, so the kernel holds matmul code for at most `chunk` rows whatever the row tile.

    512 rows, not 256: a window pays about 230 bundles beyond its MXU pops and pushes (filling
    and draining the MXU pipeline, the loop), which 512 rows halve per row. By the compiled
    schedule (libtpu 0.0.42) a 512-row window takes 4-18% fewer bundles than two 256-row ones:
    Qwen3-30B-A3B down 3,269 against 2 x 1,769 on v6e, 1,857 against 2 x 1,135 on TPU7x."""
    return min(tm, 512)


def bucket_sizes(tm: int, unit: int) -> tuple[int, ...]:
    """Row counts a tail window may run on: powers of two from `unit`, plus every multiple of
    min(chunk, 256)/8 up to 256 rows and every multiple of chunk/8 up to the chunk. A 20-row
    group tail runs a 32-row matmul, not a whole tile; the finer steps keep a tail's padding
    under 32 rows up to 256 rows (where most groups of a 4096-token batch end) and under chunk/8
    rows beyond."""
    rc = row_chunk(tm)
    sizes = set()
    b = unit
    while b < rc:
        sizes.add(b)
        b *= 2
    for top in (min(rc, 256), rc):
        step = max(unit, (top // 8) // unit * unit)
        sizes.update(range(step, top + 1, step))
    sizes.add(rc)
    return tuple(sorted(s for s in sizes if s <= rc and s % unit == 0))


# -------------------------------------------------------------------------------------------------
# The static work list
# -------------------------------------------------------------------------------------------------


def work_list_length(m: int, tm: int, num_groups: int) -> int:
    """Static upper bound on the number of work items. gmm: the non-empty groups touch at most
    (row tiles they cover) + (non-empty groups - 1) (tile, group) pairs, and the trailing rows past
    sum(group_sizes) add at most one item per uncovered tile; tgmm: one item per (tile, group) pair
    plus one per empty group. Both stay within row tiles + groups."""
    return max(1, -(-m // tm) + num_groups)


def work_list(
    group_sizes, *, m: int, tm: int, buckets: tuple[int, ...], unit: int, kind: str, xp: Any = np
):
    """The schedule: an int32 array [len(LAYOUT.fields) * L], field-major (LAYOUT.flat).

    Items are (row tile, group) pairs in row order, so consecutive items of one row tile share the
    resident output block (gmm) and consecutive items of one group share the resident weight block.
    gmm adds a virtual group for the rows past sum(group_sizes): its items only write zeros.
    tgmm gives every empty group one item without rows, so its weight gradient is written (zero).
    Works on numpy (cost model) and jax.numpy (inside jit) arrays alike.
    """
    assert kind in ("gmm", "tgmm")
    i32 = xp.int32
    gs = xp.maximum(xp.asarray(group_sizes).astype(i32), 0)
    num_groups = gs.shape[0]
    L = work_list_length(m, tm, num_groups)
    ends = xp.minimum(xp.cumsum(gs).astype(i32), m)
    starts = xp.concatenate([xp.zeros((1,), i32), ends[:-1]]) if num_groups else ends
    if kind == "gmm":
        total = ends[-1:] if num_groups else xp.zeros((1,), i32)
        starts = xp.concatenate([starts, total])
        ends = xp.concatenate([ends, xp.full((1,), m, i32)])
    sizes = ends - starts
    t0 = starts // tm
    t1 = xp.maximum(ends - 1, 0) // tm
    if kind == "gmm":
        n_items = xp.where(sizes > 0, t1 - t0 + 1, 0)
    else:
        n_items = xp.where(sizes > 0, t1 - t0 + 1, 1)
    cum = xp.cumsum(n_items).astype(i32)
    count = cum[-1]
    ng = n_items.shape[0]
    j = xp.arange(L, dtype=i32)
    g = xp.minimum(searchsorted(cum, j, side="right", xp=xp), ng - 1).astype(i32)
    tile = (t0[g] + j - (cum[g] - n_items[g])).astype(i32)
    valid = j < count
    lo = xp.clip(starts[g] - tile * tm, 0, tm).astype(i32)
    hi = xp.clip(ends[g] - tile * tm, 0, tm).astype(i32)
    compute = valid & (g < num_groups) & (hi > lo)

    last_valid = xp.maximum(count - 1, 0)
    key = tile if kind == "gmm" else g
    out = xp.where(valid, key, key[last_valid]).astype(i32)
    prev_key = xp.concatenate([xp.full((1,), -1, i32), key[:-1]])
    next_key = xp.concatenate([key[1:], xp.full((1,), -1, i32)])
    first = valid & ((j == 0) | (key != prev_key))
    last = valid & ((j == count - 1) | (key != next_key))

    # Blocks of items without MXU work stay those of the last computing item: no new DMA.
    last_compute = cummax(xp.where(compute, j, -1), xp)
    has = last_compute >= 0
    lc = xp.maximum(last_compute, 0)
    res_tile = xp.where(has, tile[lc], 0).astype(i32)
    res_group = xp.where(has, g[lc], 0).astype(i32)
    kfix = xp.where(compute, 0, 1).astype(i32)
    # GROUP is nondecreasing: the next run starts at the first item of a larger GROUP.
    next_start = searchsorted(res_group, res_group, side="right", xp=xp)
    next_group = xp.where(next_start < L, res_group[xp.minimum(next_start, L - 1)], -1).astype(i32)

    rc = row_chunk(tm)
    bucket_arr = xp.asarray(np.asarray(buckets, np.int32))
    s0 = lo // unit * unit
    nfull = (hi - s0) // rc
    tail_lo = s0 + nfull * rc
    has_tail = compute & (hi > tail_lo)
    bidx = xp.minimum(searchsorted(bucket_arr, hi - tail_lo, side="left", xp=xp), len(buckets) - 1)
    # A tail window that would cross the tile's end slides back; the rows it then shares with
    # the full chunks are masked out by the kernel.
    tstart = xp.where(has_tail, xp.minimum(tail_lo, tm - bucket_arr[bidx]), 0).astype(i32)
    bidx = xp.where(has_tail, bidx, -1).astype(i32)
    start = xp.where(compute, s0, 0).astype(i32)
    nfull = xp.where(compute, nfull, 0).astype(i32)

    flags = (
        xp.where(compute, COMPUTE, 0)
        | xp.where(first, FIRST, 0)
        | xp.where(last, LAST, 0)
        | xp.where(valid, VALID, 0)
    ).astype(i32)
    return LAYOUT.flat(
        dict(
            OUT=out,
            TILE=res_tile,
            GROUP=res_group,
            NEXT=next_group,
            KFIX=kfix,
            LO=lo,
            HI=hi,
            START=start,
            NFULL=nfull,
            TSTART=tstart,
            BUCKET=bidx,
            FLAGS=flags,
        ),
        xp,
    )


def _fields(wl: np.ndarray) -> dict[str, np.ndarray]:
    """{field name: [L] column} of a flat list (LAYOUT.decode)."""
    return LAYOUT.decode(wl)


__all__ = [
    "LAYOUT",
    "GMM_FIELDS",
    "TGMM_FIELDS",
    "F_COMPUTE",
    "F_FIRST",
    "F_LAST",
    "F_VALID",
    "row_unit",
    "row_chunk",
    "bucket_sizes",
    "work_list_length",
    "work_list",
]
