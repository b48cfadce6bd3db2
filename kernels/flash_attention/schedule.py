"""Flash attention's host-side schedule: the band, the static work list and live-tile counting.

Imported by kernel.py (which builds the list and reads it in the kernels) and by tiling.py (whose
cost model replays it), so neither imports the other for it. The list follows the collection's
shared contract (torch-ext/work_list.py): records of `LAYOUT` (QI, KI, SEQ, FLAGS), the shared
flag bits, one flat field-major SMEM array (one list per batch row when segment ids are given),
and one builder, `build_work_list`, for the host (numpy) and the traced program (jax.numpy).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from .work_list import COMPUTE, FIRST, LAST, VALID, RecordLayout, cummax

# A band edge past every sequence length: that side of the band is open.
UNBOUNDED = 1 << 30
_UNBOUNDED = UNBOUNDED

# The records: q block, kv block, sequence slot (its row of the sequence table), flags. COMPUTE:
# a (q block, kv block, sequence) triple the mask leaves non-empty; dummy items (an outer block no
# pair touches: its output is still written) carry FIRST | LAST | VALID only.
LAYOUT = RecordLayout("flash_attention", ("QI", "KI", "SEQ", "FLAGS"))

# Segment ids give every batch row its own work list; all of them live in SMEM together. Past this
# size the kernel keeps one list for the batch (segment ids then only mask, as varlen never does).
MAX_PER_BATCH_LIST_BYTES = 256 * 1024


def per_batch_lists_fit(batch: int, n_items: int) -> bool:
    return LAYOUT.nbytes(n_items, batch) <= MAX_PER_BATCH_LIST_BYTES


@dataclasses.dataclass(frozen=True)
class Band:
    """Allowed key/query distance d = (u - t + offset): lo <= d <= hi."""

    lo: int
    hi: int

    @staticmethod
    def make(causal: bool, window_left: int, window_right: int) -> Band:
        hi = _UNBOUNDED if window_right < 0 else window_right
        if causal:
            hi = min(hi, 0)
        lo = -_UNBOUNDED if window_left < 0 else -window_left
        return Band(lo, hi)

    @property
    def full(self) -> bool:
        return self.lo <= -_UNBOUNDED and self.hi >= _UNBOUNDED


# -------------------------------------------------------------------------------------------------
# Work list
# -------------------------------------------------------------------------------------------------


def _rect_nonempty(xp, q_lo, q_hi, k_lo, k_hi, off, band: Band):
    """Whether rows [q_lo, q_hi) x keys [k_lo, k_hi) (half-open, already clipped to the sequence)
    contain an allowed pair. d = u - t + off ranges over
    [k_lo - (q_hi-1) + off, (k_hi-1) - q_lo + off] and takes every integer value in it, so the
    band test is an interval intersection."""
    ok = (q_lo < q_hi) & (k_lo < k_hi)
    if band.hi < _UNBOUNDED:
        ok = ok & (k_lo - (q_hi - 1) + off <= band.hi)
    if band.lo > -_UNBOUNDED:
        ok = ok & ((k_hi - 1) - q_lo + off >= band.lo)
    return ok


def _candidates(xp, seqs, nq, nk, block_q, block_kv, band, kv_major, segment_ranges=None):
    """Non-empty mask over candidates in list order: [outer, seq, inner]."""
    q_lo_s, q_hi_s, k_lo_s, k_hi_s, off_s = (xp.asarray(a) for a in seqs)
    qi = xp.arange(nq, dtype=np.int32)
    ki = xp.arange(nk, dtype=np.int32)
    if kv_major:
        qi_b = qi[None, None, :]
        ki_b = ki[:, None, None]
    else:
        qi_b = qi[:, None, None]
        ki_b = ki[None, None, :]
    s = lambda a: a[None, :, None]  # noqa: E731
    q_lo = xp.maximum(qi_b * block_q, s(q_lo_s))
    q_hi = xp.minimum((qi_b + 1) * block_q, s(q_hi_s))
    k_lo = xp.maximum(ki_b * block_kv, s(k_lo_s))
    k_hi = xp.minimum((ki_b + 1) * block_kv, s(k_hi_s))
    ok = _rect_nonempty(xp, q_lo, q_hi, k_lo, k_hi, s(off_s), band)
    if segment_ranges is not None:
        # A pair whose q block and kv block hold disjoint ranges of segment ids has no allowed
        # (query, key) pair: exact for packed (sorted) ids, never wrong for any ids.
        q_min, q_max, k_min, k_max = segment_ranges
        ok = ok & (q_min[qi_b] <= k_max[ki_b]) & (k_min[ki_b] <= q_max[qi_b])
    n_seq = q_lo_s.shape[0]
    outer = nk if kv_major else nq
    inner = nq if kv_major else nk
    shape = (outer, n_seq, inner)
    qi_f = xp.broadcast_to(qi_b, shape)
    ki_f = xp.broadcast_to(ki_b, shape)
    si_f = xp.broadcast_to(xp.arange(n_seq, dtype=np.int32)[None, :, None], shape)
    return ok, qi_f, ki_f, si_f


def build_work_list(
    seqs,
    nq,
    nk,
    block_q,
    block_kv,
    band: Band,
    *,
    kv_major: bool,
    max_items: Optional[int] = None,
    segment_ranges=None,
    xp=None,
):
    """The items as an int32 array [4, L] (LAYOUT.stack): rows q block, kv block, sequence, flags.

    `seqs` = (q_lo, q_hi, k_lo, k_hi, offset), int32 [n_seq] each; `segment_ranges` = (min, max)
    segment id of each q block and of each kv block ([nq], [nq], [nk], [nk]), for one batch row.
    `xp=np` (the default when every input is a numpy array: everything static): L is the exact
    number of items; `xp=jnp` (traced inputs): L = `max_items` (a static bound) and the tail
    repeats the last item with flags 0.
    """
    arrays = tuple(seqs) + tuple(segment_ranges or ())
    if xp is None:
        xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
    ok, qi, ki, si = _candidates(
        xp, seqs, nq, nk, block_q, block_kv, band, kv_major, segment_ranges
    )
    outer_n = ok.shape[0]
    # One dummy candidate per outer block, live only when the block has no pair: its output must
    # still be written.
    has_any = ok.reshape(outer_n, -1).any(axis=1)
    dummy = ~has_any
    outer_idx = xp.arange(outer_n, dtype=np.int32)
    ok = xp.concatenate([ok.reshape(outer_n, -1), dummy[:, None]], axis=1).reshape(-1)
    zeros = xp.zeros((outer_n, 1), np.int32)
    if kv_major:
        qcol, kcol = zeros, outer_idx[:, None]
    else:
        qcol, kcol = outer_idx[:, None], zeros
    qi = xp.concatenate([qi.reshape(outer_n, -1), qcol], axis=1).reshape(-1)
    ki = xp.concatenate([ki.reshape(outer_n, -1), kcol], axis=1).reshape(-1)
    si = xp.concatenate([si.reshape(outer_n, -1), zeros], axis=1).reshape(-1)
    n_cand = qi.shape[0] // outer_n - 1
    real = xp.concatenate(
        [xp.ones((outer_n, n_cand), bool), xp.zeros((outer_n, 1), bool)], axis=1
    ).reshape(-1)
    if xp is np:
        sel = np.nonzero(ok)[0]
        qi, ki, si, real = qi[sel], ki[sel], si[sel], real[sel]
        count = len(sel)
        length = count
    else:
        count = ok.sum().astype(jnp.int32)
        length = int(max_items)
        pos = jnp.where(ok, jnp.cumsum(ok) - 1, length)
        scatter = lambda a: jnp.zeros((length,), a.dtype).at[pos].set(a, mode="drop")  # noqa: E731
        qi, ki, si, real = scatter(qi), scatter(ki), scatter(si), scatter(real)
    idx = xp.arange(length, dtype=np.int32)
    live = idx < count
    # Dummy items borrow the previous real item's inner block index, so they cost no extra DMA.
    last_real = cummax(xp.where(real & live, idx, -1), xp)
    src = xp.maximum(last_real, 0)
    if kv_major:
        qi = xp.where(real, qi, qi[src])
    else:
        ki = xp.where(real, ki, ki[src])
    # Padding items repeat the last live item: same block indices, no copy.
    last = xp.maximum(count - 1, 0)
    qi = xp.where(live, qi, qi[last])
    ki = xp.where(live, ki, ki[last])
    si = xp.where(live, si, si[last])
    outer = ki if kv_major else qi
    prev = xp.concatenate([xp.full((1,), -1, np.int32), outer[:-1]])
    nxt = xp.concatenate([outer[1:], xp.full((1,), -1, np.int32)])
    first = live & (prev != outer)
    lastf = live & ((nxt != outer) | (idx == count - 1))
    flags = (
        xp.where(live & real, COMPUTE, 0)
        | xp.where(first, FIRST, 0)
        | xp.where(lastf, LAST, 0)
        | xp.where(live, VALID, 0)
    ).astype(np.int32)
    return LAYOUT.stack(
        dict(QI=qi.astype(np.int32), KI=ki.astype(np.int32), SEQ=si.astype(np.int32), FLAGS=flags),
        xp,
    )


def max_work_items(n_seq: int, nq: int, nk: int) -> int:
    """A static bound on the list length for `n_seq` packed sequences: each sequence's blocks form
    a rectangle, and the rectangles' sides sum to at most nq + n_seq - 1 (nk + n_seq - 1), plus one
    dummy per outer block."""
    pairs = min(n_seq * nq * nk, (nq + n_seq - 1) * (nk + n_seq - 1))
    return pairs + max(nq, nk)


@dataclasses.dataclass(frozen=True)
class ListLayout:
    """Where the fields of item i sit in the flat SMEM work list (LAYOUT, n_items records): one
    list for the whole batch or, when segment ids make the non-empty pairs differ between batch
    rows, one list per row (list b = batch row b)."""

    n_items: int
    per_batch: bool = False

    def field(self, items, b, i, name: str):
        """Field `name` of item i of batch row b's list (LAYOUT.read)."""
        return LAYOUT.read(items, name, i, self.n_items, list_index=b if self.per_batch else None)


# -------------------------------------------------------------------------------------------------
# Host-side counting (the cost model): what the kernels do with a list
# -------------------------------------------------------------------------------------------------


def count_live_tiles(lists, seqs, band: Band, bq, bqc, bk, bkc, tables=None) -> int:
    """Score tiles the kernels compute: per COMPUTE item of the lists ([4, L] each, one per batch
    row), the (q compute tile, kv slice) pairs holding an allowed (query, key) pair, the same
    rectangle test the list builder applies to whole blocks (and, with `tables` = per-row (q min,
    q max, kv min, kv max) segment ids of each compute tile, whose documents meet)."""
    return count_tiles(lists, seqs, band, bq, bqc, bk, bkc, tables)[0]


class TileCounts(NamedTuple):
    """Score tiles of a work list, in (bqc x bkc) tiles: `live` computed, `masked` of them
    carrying a mask, `interior` of them on interior items (every tile of the item whole: the
    forward runs those through its interior path, kernel.interior_item, mask-free)."""

    live: int
    masked: int
    interior: int


def count_tiles(
    lists, seqs, band: Band, bq, bqc, bk, bkc, tables=None, segments=False
) -> TileCounts:
    """The score tiles `count_live_tiles` counts, how many of them carry a mask (a tile the
    band's edge cuts, or one the sequence ends inside; with segment ids every tile is masked) and
    how many sit on interior items (none with segment ids: the forward walks every item). The
    tile-ranking model charges a masked tile its compare and select work, an interior one the
    interior path's taller tile."""
    qi, ki, si, fl = np.concatenate(lists, axis=1)
    bi = np.concatenate([np.full(it.shape[1], b) for b, it in enumerate(lists)])
    computes = (fl & COMPUTE) != 0
    ql, qh, kl, kh, off = (np.asarray(a)[si] for a in seqs)
    live = masked = 0
    all_whole = computes & (not segments) & (tables is None)
    for j in range(bq // bqc):
        t0 = qi * bq + j * bqc
        q_lo = np.maximum(t0, ql)
        q_hi = np.minimum(t0 + bqc, qh)
        for c in range(bk // bkc):
            u0 = ki * bk + c * bkc
            k_lo = np.maximum(u0, kl)
            k_hi = np.minimum(u0 + bkc, kh)
            ok = computes & _rect_nonempty(np, q_lo, q_hi, k_lo, k_hi, off, band)
            if tables is not None:
                qt_min, qt_max, kt_min, kt_max = tables[:4]
                gq, gk = qi * (bq // bqc) + j, ki * (bk // bkc) + c
                ok &= (qt_min[bi, gq] <= kt_max[bi, gk]) & (kt_min[bi, gk] <= qt_max[bi, gq])
            live += int(ok.sum())
            if segments or tables is not None:
                masked += int(ok.sum())
                continue
            # Whole tile inside the sequence and every (query, key) distance inside the band.
            whole = (q_lo == t0) & (q_hi == t0 + bqc) & (k_lo == u0) & (k_hi == u0 + bkc)
            if band.hi < _UNBOUNDED:
                whole = whole & ((k_hi - 1) - q_lo + off <= band.hi)
            if band.lo > -_UNBOUNDED:
                whole = whole & (k_lo - (q_hi - 1) + off >= band.lo)
            masked += int((ok & ~whole).sum())
            all_whole = all_whole & ok & whole
    interior = int(np.sum(all_whole)) * (bq // bqc) * (bk // bkc)
    return TileCounts(live, masked, interior)


__all__ = [
    "UNBOUNDED",
    "LAYOUT",
    "Band",
    "ListLayout",
    "build_work_list",
    "max_work_items",
    "count_live_tiles",
    "count_tiles",
    "TileCounts",
    "per_batch_lists_fit",
    "MAX_PER_BATCH_LIST_BYTES",
    "COMPUTE",
    "FIRST",
    "LAST",
    "VALID",
]
