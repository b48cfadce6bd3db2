"""Pallas TPU flash attention: forward and backward over a static work list of non-empty blocks.

Layout. Queries are grouped by KV head: q is [B, Hkv, G, Sq, D] (G = Hq // Hkv query heads share
one KV head), k/v are [B, Hkv, Sk, D]. A q block holds the G heads' rows stacked, G*block_q rows,
so one K/V tile feeds all the query heads of its KV head and K/V are never repeated in HBM.

Mask. Every token carries a position inside its sequence; a query row t may see key u when both
lie inside the same sequence (varlen), the same segment (segment ids) and
`lo <= (u - t + offset) <= hi`, where `offset` aligns the ends of the query and key ranges
(flash-attn's bottom-right causal alignment), `hi` is 0 for causal / the right window, `lo` is
minus the left window. One rule serves causal, sliding windows, Sq != Sk, varlen and padding.

Schedule. `build_work_list` enumerates the (q block, kv block, sequence) triples whose rectangle
meets the allowed band (and, with segment ids, whose blocks' id ranges meet), in q-major order for
the forward and the dq pass and kv-major order for the dk/dv pass, with cheap array ops (numpy
when everything is static; jnp with a static length bound for cu_seqlens and segment ids, one list
per batch row for segment ids). The list is scalar-prefetched into SMEM and the grid is
(B, Hkv, items): the BlockSpec index maps read the list, so an empty pair costs neither a grid step
nor a DMA. A list built on device has a padding tail, but the grid's last dimension is then
dynamic (the live length), so the tail costs no step either; a shorter batch row's padding items
repeat its last item's block indices (no copy) and do nothing. An outer block that no pair
touches gets one "dummy" item so its output is still written (zeros).

Forward: large DMA blocks, small compute tiles. An item brings block_q query tokens and block_kv
keys into VMEM (one DMA each: fewer steps, and K/V are re-read once per q block), then walks score
tiles of block_q_compute x block_kv_compute: for each q compute tile it computes from the band
which kv slices any of its rows can see and which all of its rows see, and loops over exactly
those, with no mask inside the band and a mask only at its edges. So a sliding window or the
causal diagonal costs masked work near the edge only, however large the DMA blocks. With segment
ids every tile is masked, and a tile whose (min, max) document ids (from SMEM) miss the q tile's
is skipped. Online softmax keeps f32 running max m and sum l per row, lane-replicated
[rows, 128], in VMEM scratch between items (an attention sink starts them at m = sink, l = 1).
A soft cap bounds every score, so a soft-capped call without sinks takes its exps against one
static max instead (`tiling.softcap_fixed_max`): no row max, no rescale, and no chain from one
score tile to the next but the sums (TPU7x, Gemma-like d=256 cap 50: 26% fewer bundles).

Forward schedule. A `fori_loop` that carries (m, l, acc) from one score tile to the next is one
dependency chain (matmul, max, exp, sum, matmul), so the MXU, EUP and VPU take turns. Instead the
score tiles of a q compute tile run in straight-line groups (several kv slices, the statistics
carried as values) that the LLO scheduler interleaves: an item the band covers whole (the bulk
of a long causal or windowed sequence) runs all its kv slices per q tile, its q tiles unrolled
two at a time when a tile is <= 512 x 512 stacked rows x keys (on v6e the interior q tile is
taller than the edge walk's, `tiling.interior_q_compute`, so fewer, longer chains fill the MXU
gaps instead); edge items run groups of FWD_UNROLL mask-free tiles, and the
remainder joins the masked edge tiles in masked groups. A masked tile builds the mask of one
head's rows and adds it, as a 0 / NEG_INF bias, to each of the G heads the tile stacks
(`_masked_scores`; not on v5e at d > 128, `tiling.mask_per_head`). The mask is one interval of
keys per row, its bounds worked out once per group; a dense call's tiles compare against the
band's edges alone (no sequence end falls inside a block unless the call pads it), one compare
per score where the band is too wide for a tile to meet both edges (`_in_bounds`). Scores are
base 2 (exp2, log2(e) and the softmax scale folded into the q tile once per group), the rescale
exp is one per row per tile, and 1 / l is taken once at the end. At the last item of a q block the output
and the log-sum-exp (lse, used by the backward) are written.

Backward: the same large-block / small-tile scheme (`_inner_ranges` serves all three kernels).
dk/dv walk q blocks for each kv block (kv-major list): each kv slice visits the q tiles that can
see it (the band mirrored), in transposed form (scores are [kv rows, q rows], so lse and
di = rowsum(do * o) arrive as lane rows, one [G, tile] slab per q tile); dq walks kv blocks for
each q block (q-major list) and accumulates in VMEM: no per-kv-block dq is ever written to HBM.
When dq of the whole sequence fits VMEM (`Tiles.fused_bwd`), the dk/dv kernel also accumulates
it in a scratch that lives across the (batch, head)'s items and no dq pass runs. The backward
recomputes base-2 scores (one multiply per score, lse turned to base 2 once outside the
kernels); the softmax scale is applied to dq and dk once, when they are written, not to every
score. Masked tiles test each score against one interval per row (dq:
the row's keys; dk/dv: the key's query tokens), two compares, as the forward does. The dq pass
runs a q tile's kv slices two per straight-line group (DQ_UNROLL) and updates dq once per group;
on v6e and TPU7x (bf16 inputs) it takes exp2 in bf16 and forms dS = P * (dP - di) in bf16, the
dtype its dS @ K matmul takes (`_probabilities`, `_score_grads`; the dk/dv passes keep f32,
where bf16 made v6e's tiles 6-14% longer).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tiling as _tiling
from .schedule import (
    LAYOUT,
    UNBOUNDED,
    Band,
    ListLayout,
    build_work_list,
    max_work_items,
    per_batch_lists_fit,
)
from .tiling import NUM_LANES, NUM_SUBLANES
from .work_list import COMPUTE, FIRST, LAST, VALID  # noqa: F401  (VALID: the shared flag set)

# A finite "minus infinity": max/exp arithmetic on fully masked rows stays NaN-free.
NEG_INF = -0.7 * float(np.finfo(np.float32).max)
LOG2E = _tiling.LOG2E
LN2 = 0.6931471805599453
# lse of a row that sees nothing: exp(s - BIG_LSE) is 0 for any finite score.
BIG_LSE = 0.7 * float(np.finfo(np.float32).max)
_UNBOUNDED = UNBOUNDED


# -------------------------------------------------------------------------------------------------
# Shared mask helpers (inside kernels)
# -------------------------------------------------------------------------------------------------


def _seq_scalars(seq_ref, s, n_seq):
    return tuple(seq_ref[j * n_seq + s] for j in range(5))


def _inner_ranges(x0, n, x_seq, y_seq, off, band: Band, y_base, y_block, y_tile):
    """Which inner compute tiles a tile of outer positions [x0, x0 + n) must visit.

    Positions are related by lo <= (y - x) + off <= hi (`band`), and each lies in its sequence
    (x_seq, y_seq = (lo, hi) half-open). The inner tiles are the y_tile-wide slices of the inner
    block [y_base, y_base + y_block). Returns (first, in_first, in_end, end): slices [first, end)
    hold a y that some real x of the tile may see; [in_first, in_end) inside it are seen whole by
    every x of the tile (no mask needed). The forward and dq pass call it with x = query tokens,
    y = keys; the dk/dv pass with x = keys, y = query tokens and the band mirrored."""
    x_seq_lo, x_seq_hi = x_seq
    y_seq_lo, y_seq_hi = y_seq
    shift = y_tile.bit_length() - 1  # y_tile is a power of two: slice = offset >> shift
    last = y_base + y_block - 1
    x_lo = jnp.maximum(x0, x_seq_lo)
    x_hi = jnp.minimum(x0 + n, x_seq_hi) - 1
    # y some real x may see
    see_lo, see_hi = y_seq_lo, y_seq_hi - 1
    if band.lo > -_UNBOUNDED:
        see_lo = jnp.maximum(see_lo, x_lo - off + band.lo)
    if band.hi < _UNBOUNDED:
        see_hi = jnp.minimum(see_hi, x_hi - off + band.hi)
    lo = jnp.maximum(see_lo, y_base) - y_base
    hi = jnp.minimum(see_hi, last) - y_base
    first = lo >> shift
    end = jnp.where((lo <= hi) & (x_lo <= x_hi), (hi >> shift) + 1, first)
    # y every x of the tile sees (all of the tile's x must be real)
    all_lo, all_hi = y_seq_lo, y_seq_hi - 1
    if band.lo > -_UNBOUNDED:
        all_lo = jnp.maximum(all_lo, x0 + n - 1 - off + band.lo)
    if band.hi < _UNBOUNDED:
        all_hi = jnp.minimum(all_hi, x0 - off + band.hi)
    in_first = jnp.clip((jnp.maximum(all_lo, y_base) - y_base + y_tile - 1) >> shift, first, end)
    in_end = jnp.clip((jnp.minimum(all_hi, last) - y_base + 1) >> shift, in_first, end)
    whole = (x0 >= x_seq_lo) & (x0 + n <= x_seq_hi)
    return first, in_first, jnp.where(whole, in_end, in_first), end


def _mirror(band: Band) -> Band:
    """The band seen from the keys: lo <= u - t + off <= hi  <=>  -hi <= t - u - off <= -lo."""
    return Band(-band.hi, -band.lo)


def _visit(ranges, tile_fn, *, has_segments=False, meets=None, unroll=None, n_inner=None):
    """Run tile_fn(i, masked) over the inner tiles of `ranges`: masked at the band's edges,
    mask-free inside it. With segment ids every tile is masked, and with `meets(i)` (segment-id
    ranges in SMEM) tiles whose documents do not meet are skipped.

    With `unroll` (a power of two) tile_fn takes a list of tile indices instead, a static count
    run as one straight-line region, so the scheduler can overlap the tiles of a group (`_groups`
    says how a range is cut; `n_inner`, the inner block's tile count, bounds its length)."""
    first, in_first, in_end, end = ranges
    one = (lambda i, masked: tile_fn([i], masked)) if unroll else tile_fn
    if has_segments:

        def body(i, _):
            if meets is None:
                one(i, True)
            else:
                pl.when(meets(i))(lambda: one(i, True))

        jax.lax.fori_loop(first, end, body, None)
        return
    if not unroll:
        for lo, hi, masked in (
            (first, in_first, True),
            (in_first, in_end, False),
            (in_end, end, True),
        ):
            jax.lax.fori_loop(lo, hi, lambda i, _, masked=masked: one(i, masked), None)
        return
    n_full, tail = _groups(end - first, unroll, n_inner)

    def full_group(g, _):
        lo = first + g * unroll
        tiles = [lo + u for u in range(unroll)]
        mask_free = (lo >= in_first) & (lo + unroll <= in_end)
        pl.when(mask_free)(lambda: tile_fn(tiles, False))
        pl.when(jnp.logical_not(mask_free))(lambda: tile_fn(tiles, True))

    jax.lax.fori_loop(0, n_full, full_group, None)
    start = first + n_full * unroll
    for size in _tail_sizes(unroll, n_inner):
        pl.when(tail == size)(lambda size=size: tile_fn([start + u for u in range(size)], True))


def _tail_sizes(unroll, n_inner):
    """The lengths a range's tail group takes (`_groups`), one straight-line copy each, none
    longer than the inner block's n_inner tiles. Program size counts: a kernel larger than one
    instruction-memory overlay is cut into several, which the grid loop reloads from HBM at
    every step. The binary-digit cut held 18 tile copies in the walk: at v6e's Llama-3-8B tiles
    (2048 x 512 stacked score tiles) a 71,054-bundle forward in 7 overlays; with these 14 it
    is 57,302 bundles in one (window 1024: 60,776)."""
    sizes = list(range(1, unroll))  # what full groups leave
    if 1 < unroll < n_inner:  # a remainder of one joins the last full group
        sizes.append(unroll + 1)
    return sizes


def _groups(n, unroll, n_inner):
    """A range of n inner tiles cut into straight-line groups: n_full groups of `unroll` tiles,
    each mask-free unless it touches a masked edge, then one masked tail group of exactly its
    length (`_tail_sizes`), a tail of one joining the last full group (unroll + 1 tiles).

    A q tile of a window sees W / slice + 1 kv slices, masked at both ends, a causal diagonal
    q tile its slices up to the diagonal: short ranges, where a tile alone in its group is the
    costly case, as nothing overlaps its softmax chain (v5e, Llama-3-8B window 1024, 1024 x 256
    stacked tiles: 5.76 bundles a MXU push alone, 5.65 / 5.22 in groups of 2 / 3, 5.02 in a
    masked group of 4, 4.89 in one of 5, 4.51 mask-free in 4). Cutting a range by its binary
    digits into edge runs and a mask-free run gave a window q tile of five slices a lone masked
    tile and a group of four, one of four slices three groups. Returns (n_full, tail), traced."""
    log_u = unroll.bit_length() - 1
    n_full, tail = n >> log_u, n & (unroll - 1)  # shifts and masks lower everywhere
    if unroll + 1 in _tail_sizes(unroll, n_inner):
        fold = (tail == 1) & (n_full > 0)
        n_full, tail = n_full - fold.astype(n_full.dtype), jnp.where(fold, unroll + 1, tail)
    return n_full, tail


def _range_table(q_ids, kv_ids, q_tile, kv_tile):
    """SMEM table of each compute tile's (min, max) segment id: [q min, q max] per (row, q tile),
    then [kv min, kv max] per (row, kv slice), flat int32."""
    q_min, q_max = _segment_ranges(q_ids, q_tile)
    k_min, k_max = _segment_ranges(kv_ids, kv_tile)
    return jnp.concatenate([a.reshape(-1) for a in (q_min, q_max, k_min, k_max)])


def _documents_meet(ranges_ref, shape, b, gq, gk):
    """Whether q tile gq and kv slice gk (global indices in row b) share a segment id range."""
    batch, n_qt, n_ks = shape
    q = b * n_qt + gq
    k = 2 * batch * n_qt + b * n_ks + gk
    return (ranges_ref[q] <= ranges_ref[k + batch * n_ks]) & (
        ranges_ref[k] <= ranges_ref[batch * n_qt + q]
    )


class SeqEdges(typing.NamedTuple):
    """Which sequence ends can fall inside a block, known at trace time. A dense call's
    sequences start at token 0 and end at their padded length unless the call pads them, so
    its masked tiles are cut by the band alone and drop those compares; cu_seqlens places
    sequences anywhere (`_Problem.seq_edges`)."""

    q_start: bool = True
    q_end: bool = True
    k_start: bool = True
    k_end: bool = True

    @property
    def none(self) -> bool:
        return not any(self)


# Any sequence end may cut a block: the general form (cu_seqlens, and what a caller does not say).
ANY_EDGES = SeqEdges()


class _RowBounds(typing.NamedTuple):
    """Each row's visible columns lo <= col <= hi of a tile (lane-replicated [rows, 128] int32,
    columns counted from y0), None on a side that never cuts a tile (static). `lo_last`: the
    largest row's lo (a scalar) where a tile meets at most one of the band's edges
    (`tiling.one_edge_tiles`), so that a tile compares each score against one side only."""

    lo: Optional[jax.Array]
    hi: Optional[jax.Array]
    lo_last: Optional[jax.Array] = None


def _interval_bounds(
    x, x_last, x_seq, y0, y_seq, off, band: Band, x_edges, y_edges, one_edge, mirrored=False
):
    """A tile's row at outer position x (`x`: lane-replicated [rows, 128]; `x_last` the largest,
    a scalar) may see the inner positions y of y_seq with lo <= (y - x) + off <= hi (`band`),
    none if x lies outside x_seq; `mirrored`: the rows are keys and the columns query tokens,
    lo <= (x - y) + off <= hi. The row's interval of y - y0 is worked out on the [rows, 128]
    columns (1/n_cols-th of the tile's elements), leaving out the sequence ends that cannot cut
    a block (`x_edges` / `y_edges`: (start, end) of SeqEdges) and, with `one_edge`, keeping the
    largest lo for `_in_bounds`' one-compare form."""
    rows = x.shape[0]
    lo = jnp.full((rows, NUM_LANES), y_seq[0] - y0, jnp.int32) if y_edges[0] else None
    hi = jnp.full((rows, NUM_LANES), y_seq[1] - 1 - y0, jnp.int32) if y_edges[1] else None
    if mirrored:  # x + off - hi <= y <= x + off - lo
        lo_step = off - band.hi - y0 if band.hi < _UNBOUNDED else None
        hi_step = off - band.lo - y0 if band.lo > -_UNBOUNDED else None
    else:  # x + lo - off <= y <= x + hi - off
        lo_step = band.lo - off - y0 if band.lo > -_UNBOUNDED else None
        hi_step = band.hi - off - y0 if band.hi < _UNBOUNDED else None
    if lo_step is not None:
        lo = x + lo_step if lo is None else jnp.maximum(lo, x + lo_step)
    if hi_step is not None:
        hi = x + hi_step if hi is None else jnp.minimum(hi, x + hi_step)
    if x_edges[0] or x_edges[1]:
        valid = jnp.full(x.shape, True)
        if x_edges[0]:
            valid = valid & (x >= x_seq[0])
        if x_edges[1]:
            valid = valid & (x < x_seq[1])
        hi = jnp.where(valid, jnp.int32(2**30) if hi is None else hi, -1)
    return _RowBounds(lo, hi, x_last + lo_step if one_edge else None)


def _in_bounds(bounds: _RowBounds, n_cols, col0=0, col_period=None):
    """The [rows, n_cols] mask of `bounds` over the columns col0 ... col0 + n_cols - 1 (mod
    `col_period` where the columns stack several heads' tokens); None where no side cuts.

    Two compares per score vreg, or one where a tile meets one edge at most (`lo_last`): a tile
    that the lower edge cuts tests col >= lo as ~col <= ~lo, with the flip applied to the
    column index (a few vregs) and the bound chosen per row. With the sequence ends a dense
    call cannot cut left out (SeqEdges) and the forward's row bounds worked out once per group,
    the forward's masked group of four against its mask-free group (deviceless dumps, Llama-3-8B,
    the walk's two branches): v6e (2048 x 512 stacked tiles) causal 12,485 -> 11,919 bundles
    (1.22x -> 1.17x), window 1024 12,629 -> 11,985 (1.23x -> 1.17x); TPU7x (1024 x 512) causal
    5,729 -> 5,492 (1.12x -> 1.07x), window 5,872 -> 5,566 (1.15x -> 1.09x); v5e window
    (1024 x 256) 4,882 -> 4,794 (1.06x -> 1.04x). The hoisting alone: v6e window 12,587."""
    lo, hi, lo_last = bounds
    if lo is None and hi is None:
        return None
    col = jax.lax.broadcasted_iota(jnp.int32, ((hi if lo is None else lo).shape[0], n_cols), 1)
    if col_period is not None:
        col = col & (col_period - 1)
    col = col + col0
    if lo_last is not None:
        lo_cuts = lo_last > col0
        flip = jnp.where(lo_cuts, -1, 0).astype(jnp.int32)
        return (col ^ flip) <= _lanes(jnp.where(lo_cuts, ~lo, hi), n_cols)
    mask = None if lo is None else col >= _lanes(lo, n_cols)
    if hi is not None:
        below = col <= _lanes(hi, n_cols)
        mask = below if mask is None else mask & below
    return mask


def _and_ids(mask, ids):
    """`mask` (None: every score) and the segment-id match of `ids` (None: no segment ids)."""
    if ids is None:
        return mask
    same = ids[0] == ids[1]
    return same if mask is None else mask & same


def _tile_bounds(groups, bqc, bkc, t0, y0, seq, band: Band, edges: SeqEdges):
    """`_RowBounds` of a q-major score tile's rows (forward and dq pass): G heads of the bqc
    query tokens from t0 stacked (the token is the row index mod bqc), columns keys from y0."""
    q_lo, q_hi, k_lo, k_hi, off = seq
    t = (jax.lax.broadcasted_iota(jnp.int32, (groups * bqc, NUM_LANES), 0) & (bqc - 1)) + t0
    return _interval_bounds(
        t,
        t0 + bqc - 1,
        (q_lo, q_hi),
        y0,
        (k_lo, k_hi),
        off,
        band,
        (edges.q_start, edges.q_end),
        (edges.k_start, edges.k_end),
        _tiling.one_edge_tiles(band, bqc, bkc, not edges.none),
    )


def _tile_mask(groups, bqc, bkc, t0, u0, seq, band: Band, ids=None, edges=ANY_EDGES):
    """Mask of a q-major score tile [G*bqc, bkc] (forward and dq pass; groups=1: one head's,
    which `_masked_scores` / `_masked_probabilities` apply to the G heads a tile stacks): rows
    stack G heads of the bqc query tokens from t0 (the token is the row index mod bqc), columns
    are the keys from u0; a row's keys form one interval (`_interval_bounds`). `ids`: (q segment
    ids as a column [bqc, 1], kv ids as a row [1, bkc]). None: nothing to mask (`edges`)."""
    mask = _in_bounds(_tile_bounds(groups, bqc, bkc, t0, u0, seq, band, edges), bkc)
    if ids is not None and groups > 1:
        ids = (jnp.concatenate([ids[0]] * groups, axis=0), ids[1])
    return _and_ids(mask, ids)


def _tile_mask_t(groups, bqc, bkc, t0, u0, seq, band: Band, ids=None, edges=ANY_EDGES):
    """`_tile_mask` of the transposed tile the dk/dv pass computes, [bkc, G*bqc] (groups=1: one
    head's, for `_masked_probabilities`): rows are the keys from u0, columns G heads of the bqc
    query tokens from t0 (the token is the column index mod bqc); a key's query tokens form one
    interval. `ids`: (kv segment ids as a column [bkc, 1], q ids as a row [1, bqc])."""
    q_lo, q_hi, k_lo, k_hi, off = seq
    u = jax.lax.broadcasted_iota(jnp.int32, (bkc, NUM_LANES), 0) + u0
    bounds = _interval_bounds(
        u,
        u0 + bkc - 1,
        (k_lo, k_hi),
        t0,
        (q_lo, q_hi),
        off,
        band,
        (edges.k_start, edges.k_end),
        (edges.q_start, edges.q_end),
        _tiling.one_edge_tiles(band, bqc, bkc, not edges.none),
        mirrored=True,
    )
    mask = _in_bounds(bounds, groups * bqc, col_period=bqc)
    if ids is not None and groups > 1:
        ids = (ids[0], jnp.concatenate([ids[1]] * groups, axis=1))
    return _and_ids(mask, ids)


def _probabilities(s, lse, exp_bf16):
    """The backward's recomputed probabilities exp2(s - lse) of base-2 scores. With `exp_bf16`
    (bf16 inputs on v6e / TPU7x, tiling.exp_in_bf16, as the forward) the exponent is formed in
    f32 and rounded once, and exp2 runs on packed bf16 vregs: half the EUP pushes and result
    pops, and p is bf16, as the p @ do / ds @ k matmuls take it anyway."""
    if exp_bf16:
        return jnp.exp2((s - lse).astype(jnp.bfloat16))
    return jnp.exp2(s - lse)


def _score_grads(p, dp, di, exp_bf16):
    """ds = p * (dp - di): dp - di in f32 (they cancel where p ~ 1), the product in bf16 when p
    is (`_probabilities`), the dtype the ds @ k / ds^T @ q matmuls take. TPU7x, Llama-3-8B dq
    pass (1024 x 512 tiles): 7,773 -> 7,333 bundles per two-tile group, MXU 0.63 -> 0.66."""
    if exp_bf16:
        return p * (dp - di).astype(jnp.bfloat16)
    return p * (dp - di)


def _masked_scores(mask, s):
    """s where `mask` holds, NEG_INF elsewhere, on the forward's q-major score tile that stacks G
    heads of the same tokens, [G*bqc, bkc] (the backward masks by `_masked_probabilities`).
    `mask` is the whole tile's or one head's ([bqc, bkc], where `tiling.mask_per_head`): the
    heads share their tokens' mask, so its compares run on 1/G-th of the tile.

    One head's mask becomes an additive bias (0 or NEG_INF, f32 data) that each head adds: a
    mask register reused by G selects is spilled as 0/1 data and re-tested (`vnez`) before
    every select, two VALU ops per score vreg where the add is one. v6e, Llama-3-8B window 1024,
    the forward's masked group of four: 13,136 -> 12,629 bundles (1.28x -> 1.23x the mask-free
    group), TPU7x 6,137 -> 5,872 (1.20x -> 1.15x). A masked score is NEG_INF plus a score far
    below NEG_INF's rounding step (or -inf past it): exp2 of it minus the running max is 0, and
    a row's max stays at NEG_INF until it sees a key, as with the select. Unlike the select,
    the add keeps a masked key's NaN or inf score; its value must be finite anyway (its
    probability 0 meets it in p @ v). `mask` None: nothing to mask (`_in_bounds`)."""
    if mask is None:
        return s
    groups = s.shape[0] // mask.shape[0]
    if groups == 1:
        return jnp.where(mask, s, NEG_INF)
    rows, cols = mask.shape
    bias = jnp.where(mask, 0.0, NEG_INF)
    return (s.reshape(groups, rows, cols) + bias[None]).reshape(s.shape)


def _masked_probabilities(mask, s, probabilities, axis, scores_first):
    """The backward's probabilities of a masked tile, `probabilities(s)` where `mask` holds and 0
    elsewhere, on a tile stacking G heads of the same tokens along `axis` (0: the dq pass's
    q-major tiles, [G*bqc, bkc]; 1: the dk/dv pass's transposed ones, [bkc, G*bqc]), `mask` the
    whole tile's or one head's (`_masked_scores`). One head's mask selects
    each head's probabilities, its lane or row slices (the forward's bias add made these passes
    slower: TPU7x Llama-3-8B dq 1024 x 512 masked tiles 1,851 -> 1,997 bundles, v6e dk/dv
    2,417 -> 2,694). A whole tile's mask (G = 1) masks the scores before the exp where
    `scores_first` (tiling.mask_scores_before_exp), else it selects the probabilities. `mask`
    None: nothing to mask (`_in_bounds`)."""
    if mask is None:
        return probabilities(s)
    groups = s.shape[axis] // mask.shape[axis]
    if groups == 1:
        if scores_first:
            return probabilities(jnp.where(mask, s, NEG_INF))
        return jnp.where(mask, probabilities(s), 0.0)
    p = probabilities(s)
    if axis == 0:
        rows, cols = mask.shape
        return jnp.where(mask[None], p.reshape(groups, rows, cols), 0.0).reshape(p.shape)
    n = mask.shape[1]
    return jnp.concatenate(
        [jnp.where(mask, p[:, g * n : (g + 1) * n], 0.0) for g in range(groups)], axis=1
    )


def _walk_q_tiles(
    tile,
    *,
    b,
    qi,
    ki,
    block_q,
    block_kv,
    bqc,
    bkc,
    seq,
    band,
    has_segments,
    tile_ranges,
    ranges_ref,
    unroll=None,
):
    """Forward and dq: for each q compute tile of the item's q block (query tokens [t0, t0 + bqc),
    the G heads' rows r0 ... r0 + bqc), tile(r0, t0, c, masked) over the kv slices c of the item's
    kv block that the band lets it see (`_visit`)."""
    q_seq_lo, q_seq_hi, k_seq_lo, k_seq_hi, off = seq

    def q_tile(j, _):
        r0 = pl.multiple_of(j * bqc, bqc)
        t0 = qi * block_q + r0
        ranges = _inner_ranges(
            t0,
            bqc,
            (q_seq_lo, q_seq_hi),
            (k_seq_lo, k_seq_hi),
            off,
            band,
            ki * block_kv,
            block_kv,
            bkc,
        )
        meets = None
        if tile_ranges:
            gq, gk = qi * (block_q // bqc) + j, ki * (block_kv // bkc)
            meets = lambda c: _documents_meet(ranges_ref, tile_ranges, b, gq, gk + c)  # noqa: E731
        _visit(
            ranges,
            lambda c, masked: tile(r0, t0, c, masked),
            has_segments=has_segments,
            meets=meets,
            unroll=unroll,
            n_inner=block_kv // bkc,
        )
        return None

    jax.lax.fori_loop(0, block_q // bqc, q_tile, None)


def _score_scale(scale, softcap):
    """The factor a score takes before its exp. Scores are kept in base 2 (exp2 is the EUP's
    native op; jnp.exp multiplies every argument by log2(e) first), so log2(e) rides on the score
    scale; with a soft cap the factor is scale / cap and the cap's tanh follows. The forward folds
    it into each q tile (one multiply per q element; its q tiles run over many kv slices per
    load); the backward multiplies the f32 scores (its q and k tiles are reloaded per score tile,
    and at d = 256 a tile has as many q elements as scores)."""
    return scale / softcap if softcap else scale * LOG2E


def _base2_scores(s, softcap):
    """Base-2 scores from scaled products (`_score_scale`); returns (scores, tanh) (the tanh
    for the soft cap's gradient, else None)."""
    if softcap:
        c = jnp.tanh(s)
        return c * (softcap * LOG2E), c
    return s, None


def _current_item(items_ref, layout: ListLayout):
    """(q block, kv block, sequence slot, flags) of the work item this grid step runs."""
    b, i = pl.program_id(0), pl.program_id(2)
    return tuple(layout.field(items_ref, b, i, name) for name in LAYOUT.fields)


def _pop_segment_refs(refs, has_segments):
    """The (q, kv) segment-id refs that follow a kernel's inputs when segment ids are given."""
    if not has_segments:
        return (None, None), refs
    return tuple(refs[:2]), refs[2:]


# -------------------------------------------------------------------------------------------------
# Forward
# -------------------------------------------------------------------------------------------------


def _lanes(x, width):
    """A lane-replicated [rows, 128] statistic as [rows, width]: whole vregs repeated (no lane
    broadcast), or a lane slice for widths under 128 (small interpret-mode tiles)."""
    if width == NUM_LANES:
        return x
    if width < NUM_LANES:
        return x[:, :width]
    reps = -(-width // NUM_LANES)
    y = jnp.concatenate([x] * reps, axis=1)
    return y if reps * NUM_LANES == width else y[:, :width]


def _row_reduce(x, op):
    """op-reduce a [rows, n] f32 tile to a lane-replicated [rows, 128]: whole vregs are combined
    elementwise first, so only one cross-lane reduction per 8 rows remains."""
    n = x.shape[1]
    if n > NUM_LANES and n % NUM_LANES == 0:
        parts = [x[:, i * NUM_LANES : (i + 1) * NUM_LANES] for i in range(n // NUM_LANES)]
        while len(parts) > 1:
            parts = [
                op(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                for i in range(0, len(parts), 2)
            ]
        x = parts[0]
    red = jnp.max if op is jnp.maximum else jnp.sum
    x = x.astype(jnp.float32)  # a bf16 tile's last [rows, 128] reduces across lanes in f32
    return jnp.broadcast_to(red(x, axis=1, keepdims=True), (x.shape[0], NUM_LANES))


def _fwd_kernel(
    items_ref,
    seq_ref,
    *refs,
    layout,
    n_seq,
    seq_edges,
    groups,
    block_q,
    block_kv,
    block_q_compute,
    block_kv_compute,
    band,
    scale,
    softcap,
    has_sinks,
    has_segments,
    tile_ranges,
    unroll,
    exp_bf16=False,
    interior_q=None,
    mask_heads=1,
    fixed_max=None,
):
    refs = list(refs)
    sinks_ref = refs.pop(0) if has_sinks else None
    ranges_ref = refs.pop(0) if tile_ranges else None
    q_ref, k_ref, v_ref = refs[:3]
    (qseg_ref, kseg_ref), refs = _pop_segment_refs(refs[3:], has_segments)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    b, h = (
        pl.program_id(0),
        pl.program_id(1),
    )  # read here: interpret mode has no program_id in loops
    qi, ki, si, flags = _current_item(items_ref, layout)
    bqc, bkc = block_q_compute, block_kv_compute
    D = q_ref.shape[-1]
    seq = _seq_scalars(seq_ref, si, n_seq)
    # Base-2 scores (`_score_scale`): m is the running max of the base-2 scores, or with
    # `fixed_max` (a soft cap, tiling.softcap_fixed_max) one static max that m keeps throughout.
    q_scale = _score_scale(scale, softcap)
    fixed = fixed_max is not None

    @pl.when((flags & FIRST) != 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if has_sinks:
            # The sink joins the denominator: start the running max at it with sum exp(0) = 1.
            for g in range(groups):
                m_ref[g] = jnp.full(
                    (block_q, NUM_LANES), sinks_ref[h * groups + g] * LOG2E, jnp.float32
                )
            l_ref[...] = jnp.ones_like(l_ref)
        else:
            m_ref[...] = jnp.full_like(m_ref, fixed_max if fixed else NEG_INF)
            l_ref[...] = jnp.zeros_like(l_ref)

    def load(r0, n=bqc):
        rows = pl.ds(r0, n)
        # The score scale is folded into the q tile once per group (`_score_scale`).
        q = q_ref[:, rows, :].reshape(groups * n, D)
        q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
        return [
            q,
            None if fixed else m_ref[:, rows, :].reshape(groups * n, NUM_LANES),
            l_ref[:, rows, :].reshape(groups * n, NUM_LANES),
            acc_ref[:, rows, :].reshape(groups * n, D),
        ]

    def store(r0, state, n=bqc):
        rows = pl.ds(r0, n)
        _, m, l, acc = state
        acc_ref[:, rows, :] = acc.reshape(groups, n, D)
        if not fixed:
            m_ref[:, rows, :] = m.reshape(groups, n, NUM_LANES)
        l_ref[:, rows, :] = l.reshape(groups, n, NUM_LANES)

    def step(state, r0, c, bounds):
        """One score tile (q compute tile at row r0, kv compute slice c) folded into the running
        statistics, which stay values (lane-replicated [rows, 128]). `bounds`: the q tile's
        `_RowBounds` against the kv block where the tile is masked, else None."""
        q, m, l, acc = state
        keys = pl.ds(pl.multiple_of(c * bkc, bkc), bkc)
        s = jax.lax.dot_general(
            q, k_ref[keys, :], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        s, _ = _base2_scores(s, softcap)
        if bounds is not None:
            ids = None
            if has_segments:
                q_ids = qseg_ref[pl.ds(r0, bqc), 0:1]
                q_ids = jnp.concatenate([q_ids] * mask_heads, axis=0) if mask_heads > 1 else q_ids
                ids = (q_ids, kseg_ref[c][0:1, :])
            # A row that has seen no key yet keeps m = NEG_INF and gathers exp2(0) = 1 per
            # masked key; the first key it sees scales that away (alpha = 0), and a row that
            # never sees one is told apart by m at the end.
            s = _masked_scores(_and_ids(_in_bounds(bounds, bkc, c * bkc), ids), s)

        def p_at_v(p):
            return jax.lax.dot_general(
                p.astype(v_ref.dtype),
                v_ref[keys, :],
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )

        if fixed:
            # Soft-capped scores against the static max: the tile's only tie to the previous
            # one is the sums. f32 exp (an argument near the cap would lose too much in bf16).
            p = jnp.exp2(s - fixed_max)
            return [q, m, l + _row_reduce(p, jnp.add), acc + p_at_v(p)]
        m_new = jnp.maximum(m, _row_reduce(s, jnp.maximum))
        if exp_bf16:
            # bf16 EUP/VPU (v6e, TPU7x): the exponent is formed in f32 (s and m are large and
            # close), rounded once, and exp2 and the row sum's vreg adds run on packed bf16
            # vregs (half the EUP pushes and adds); p feeds p @ v in bf16 as it would anyway.
            p = jnp.exp2((s - _lanes(m_new, bkc)).astype(jnp.bfloat16))
        else:
            p = jnp.exp2(s - _lanes(m_new, bkc))
        alpha = jnp.exp2(m - m_new)
        l = alpha * l + _row_reduce(p, jnp.add)
        pv = p_at_v(p)
        return [q, m_new, l, acc * _lanes(alpha, D) + pv]

    def tiles(r0, t0, cs, masked, n=bqc):
        """Score tiles of one q compute tile (n query tokens) against the kv compute slices `cs`,
        a static count in straight-line code: the scheduler overlaps one tile's softmax with the
        next one's matmuls."""
        state = load(r0, n)
        # A masked group's row bounds are worked out once, against the kv block's first key;
        # its tiles compare their columns from c * bkc (VALU work off the tiles' chains).
        bounds = None
        if masked:
            bounds = _tile_bounds(mask_heads, bqc, bkc, t0, ki * block_kv, seq, band, seq_edges)
        for c in cs:
            state = step(state, r0, c, bounds)
        store(r0, state, n)

    n_ks = block_kv // bkc
    # The interior path's q tile (tiling.interior_q_compute): taller than the edge walk's where
    # that pays, so the MXU gap of each tile's softmax chain is paid over more rows.
    bqi = interior_q or bqc
    n_qt = block_q // bqi

    def interior_item():
        """Every (q tile, kv slice) of the item, mask-free, as one straight-line region: the q
        tiles' chains are independent, so the scheduler interleaves them (the bulk of a long
        causal or windowed sequence takes this path)."""

        def q_tile(j, _):
            tiles(pl.multiple_of(j * bqi, bqi), None, range(n_ks), False, bqi)

        jax.lax.fori_loop(0, n_qt, q_tile, None, unroll=_interior_unroll(groups, bqi, bkc, n_qt))

    @pl.when((flags & COMPUTE) != 0)
    def _compute():
        walk = functools.partial(
            _walk_q_tiles,
            tiles,
            b=b,
            qi=qi,
            ki=ki,
            block_q=block_q,
            block_kv=block_kv,
            bqc=bqc,
            bkc=bkc,
            seq=seq,
            band=band,
            has_segments=has_segments,
            tile_ranges=tile_ranges,
            ranges_ref=ranges_ref,
            unroll=unroll,
        )
        if has_segments:
            walk()
            return
        q_seq_lo, q_seq_hi, k_seq_lo, k_seq_hi, off = seq
        _, in_first, in_end, _ = _inner_ranges(
            qi * block_q,
            block_q,
            (q_seq_lo, q_seq_hi),
            (k_seq_lo, k_seq_hi),
            off,
            band,
            ki * block_kv,
            block_kv,
            bkc,
        )
        interior = (in_first == 0) & (in_end == n_ks)
        pl.when(interior)(interior_item)
        pl.when(jnp.logical_not(interior))(walk)

    @pl.when((flags & LAST) != 0)
    def _finish():
        _normalise_and_store(o_ref, lse_ref, m_ref, l_ref, acc_ref, fixed)


def newton_reciprocal(x):
    """1 / x of positive normal f32 values: the EUP's approximate reciprocal refined by two Newton
    steps (each doubles its correct bits), without the special-case compares and selects of a
    division (~14 VALU ops a vreg on v5e against 6). Within 1 ulp of the correctly rounded 1 / x
    on a v5e chip, as the chip's division is (benchmarks/reciprocal_probe.py)."""
    r = pl.reciprocal(x, approx=True)
    r = r * (2.0 - x * r)
    return r * (2.0 - x * r)


# Rows a q block's write-out handles at once: one lse row of 128 lanes, and few enough vregs
# (acc, m, l of 128 rows: 48 at d = 128) that its chain stays in registers.
FINISH_ROWS = NUM_LANES
FINISH_UNROLL = 8


def _seen(m, l, fixed):
    """Rows that saw a key: their running max left NEG_INF, or against a fixed max (`fixed`:
    m never moves, and a masked key's exp is 0, not 1) their sum is positive."""
    return l > 0.0 if fixed else m > 0.5 * NEG_INF


def finish_unroll(block_q: int) -> tuple[int, int]:
    """(chunks a loop iteration, iterations) of one head's write-out loop of a q block of
    `block_q` rows (block_q a multiple of FINISH_ROWS)."""
    n = block_q // FINISH_ROWS
    unroll = math.gcd(n, FINISH_UNROLL)
    return unroll, n // unroll


def _normalise_and_store(o_ref, lse_ref, m_ref, l_ref, acc_ref, fixed=False):
    """A q block's write-out: o = acc / l and lse = m ln 2 + ln l per query row (a row that saw no
    key gets o = 0 and lse = BIG_LSE), FINISH_ROWS rows of a head at a time, FINISH_UNROLL chunks
    a loop iteration so the scheduler overlaps their chains. 1 / l stays lane-replicated
    [rows, 128], as acc needs it; lse is stored lane-major ([G, block_q]), so m and l go row-major
    through one 128 x 128 transpose a chunk and the log runs on one vreg row. Done on the whole
    [G x block_q, 128] block at once (a column slice of m and l, a division and a log on every
    vreg), each op's 1,024-vreg result of a 2048-row block of 4 heads went through VMEM: 8,913
    bundles a q block on v5e, 3,332 now (VALU and XLU both ~0.9 busy)."""
    groups, block_q, D = acc_ref.shape

    def rows_out(g, rows, n):
        m, l = m_ref[g, rows, :], l_ref[g, rows, :]
        seen = _seen(m, l, fixed)
        # l >= 1 wherever seen (the row's max scored exp2(0) = 1; with a fixed max l >= 2^-100,
        # tiling.softcap_fixed_max); 1 / 0 and log 0 of a row never visited are selected away.
        inv = jnp.where(seen, newton_reciprocal(l), 0.0)
        o_ref[g, rows, :] = (acc_ref[g, rows, :] * _lanes(inv, D)).astype(o_ref.dtype)
        # lse row-major: m in lane 0 and l in lane 1 of one tile, transposed once, so the log
        # runs on one row of each instead of on every lane of every row.
        lane = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
        ml = jnp.where(lane == 0, m, l).T
        m_row, l_row = ml[0:1, :n], ml[1:2, :n]
        return jnp.where(_seen(m_row, l_row, fixed), m_row * LN2 + jnp.log(l_row), BIG_LSE)

    if block_q % FINISH_ROWS:  # small interpret-mode blocks: the whole block per head
        for g in range(groups):
            lse_ref[g : g + 1, :] = rows_out(g, slice(None), block_q)
        return
    for g in range(groups):

        def chunk(c, _, g=g):
            r0 = pl.multiple_of(c * FINISH_ROWS, FINISH_ROWS)
            lse_ref[g : g + 1, pl.ds(r0, FINISH_ROWS)] = rows_out(
                g, pl.ds(r0, FINISH_ROWS), FINISH_ROWS
            )

        unroll, trips = finish_unroll(block_q)
        jax.lax.fori_loop(0, unroll * trips, chunk, None, unroll=unroll)


def _pad_axis(x, axis, size, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _round_up(x, m):
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Static description shared by forward and backward of one call."""

    batch: int
    kv_heads: int
    groups: int
    sq: int  # padded lengths
    sk: int
    head_dim: int
    band: Band
    scale: float
    softcap: float
    n_seq: int
    max_items: Optional[int]  # None: static list
    seq_edges: SeqEdges = ANY_EDGES  # which sequence ends can cut a block (masks' compares)


def _seq_table_dense(sq, sk):
    # One sequence, ends aligned (bottom-right), tails past the real length masked.
    return tuple(np.array([v], np.int32) for v in (0, sq, 0, sk, sq - sk))


def _seq_table_varlen(cu_q, cu_k):
    cu_q = cu_q.astype(jnp.int32)
    cu_k = cu_k.astype(jnp.int32)
    return (cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], cu_q[1:] - cu_k[1:])


def _segment_ranges(ids, block):
    """(min, max) segment id of each block of `ids` [B, S] -> [B, S // block] each."""
    blocks = ids.reshape(ids.shape[0], -1, block)
    return blocks.min(axis=2), blocks.max(axis=2)


def _items(seqs, prob, nq, nk, bq, bk, kv_major, qseg_ids=None, kseg_ids=None):
    """(flat work list for SMEM, its ListLayout, grid steps along the list).

    Without segment ids or cu_seqlens everything is static: the list is exact and the grid walks
    all of it. Otherwise the list is built on device with a static length (SMEM is sized at trace
    time), per batch row when segment ids are given, and the grid's last dimension is dynamic:
    the longest row's live items, so the padding tail costs no grid step."""
    if prob.max_items is None and qseg_ids is None:
        it = build_work_list(seqs, nq, nk, bq, bk, prob.band, kv_major=kv_major)
        return jnp.asarray(it).reshape(-1), ListLayout(it.shape[1]), it.shape[1]
    if prob.max_items is None:
        # Segment ids only remove pairs (an emptied outer block trades its items for one dummy),
        # so the band's own static list bounds the length.
        bound = build_work_list(seqs, nq, nk, bq, bk, prob.band, kv_major=kv_major).shape[1]
    else:
        bound = max_work_items(prob.n_seq, nq, nk)
    build = functools.partial(
        build_work_list, seqs, nq, nk, bq, bk, prob.band, kv_major=kv_major, max_items=bound
    )
    if qseg_ids is None or not per_batch_lists_fit(qseg_ids.shape[0], bound):
        lists, layout = build()[None], ListLayout(bound)
    else:
        ranges = (*_segment_ranges(qseg_ids, bq), *_segment_ranges(kseg_ids, bk))
        lists = jax.vmap(lambda *r: build(segment_ranges=r))(*ranges)  # [B, 4, bound]
        layout = ListLayout(bound, per_batch=True)
    # Live items (dummies included) carry a flag; the padding tail has none.
    flags = jnp.asarray(lists)[:, LAYOUT.index("FLAGS"), :]
    steps = jnp.max(jnp.sum(flags != 0, axis=1)).astype(jnp.int32)
    if not isinstance(steps, jax.core.Tracer):
        steps = int(steps)  # called eagerly: a static grid for this concrete list
    return jnp.asarray(lists).reshape(-1), layout, steps


def _segment_id_rows(qseg, kseg):
    """Plain [B, S] id rows from the kernels' lane-replicated layouts (None without ids)."""
    if qseg is None:
        return None, None
    return qseg[:, :, 0], kseg[:, 0, :]


def _seq_array(seqs):
    return jnp.concatenate([jnp.asarray(a, jnp.int32) for a in seqs])


# Mosaic flags of every pallas_call here: the LP list scheduler (tokamax's
# `use_experimental_scheduler`). libtpu 0.0.42, v6e, d=256 b2 8192 causal, an edge item's group
# of four 512x512 tiles: 3,148 bundles with it, 3,175 without; the fused backward's interior
# tile 1,496 with it, 1,507 without.
SCHEDULER_FLAGS = {"XLA_TPU_FORCE_LP_LLO_SCHEDULER": True}

# Mask-free kv compute tiles per straight-line group in the forward's edge items (see `_visit`):
# v6e, d=256, 512x512 tiles: 829 bundles per tile at 2, 785 at 4, 768 at 8 (code size grows).
FWD_UNROLL = 4
# Interior items: q compute tiles per straight-line region when a score tile is at most
# 512 x 512 (v6e d=256: 783 bundles per tile at 1, 755 at 2, 744 at all four; larger tiles' live
# temporaries outgrow VMEM: Llama-3-8B's 2048 x 512 stacked tiles do at 2).
INTERIOR_Q_UNROLL = 2


# kv slices per straight-line group of the dq pass's q tiles (see `_visit`).
DQ_UNROLL = 2


def _fwd_unroll(n_slices):
    """FWD_UNROLL, or the largest power of two within a block of fewer kv slices (`_visit`
    groups by shifts; a 1536-key block has three 512-key slices)."""
    n = min(FWD_UNROLL, n_slices)
    return 1 << (n.bit_length() - 1)


def _interior_unroll(groups, bqi, bkc, n_qt):
    """q tiles per straight-line region of the interior path (INTERIOR_Q_UNROLL where a score
    tile is at most 512 x 512 and it divides the q block's n_qt tiles, else 1)."""
    small = groups * bqi * bkc <= 512 * 512 and n_qt % INTERIOR_Q_UNROLL == 0
    return INTERIOR_Q_UNROLL if small else 1


def _forward_score_vregs(tiles, groups, interior_q, unroll):
    """Score vregs ([8, 128] f32) over the forward's straight-line score-tile copies: the
    interior path's region (its unrolled q tiles, each against every kv slice) and the edge
    walk's groups at `unroll` (two full-group bodies and one per tail length, `_tail_sizes`).
    tiling.forward_program_bundles turns them into a program size."""
    n_ks = tiles.block_kv // tiles.block_kv_compute
    bqi = interior_q or tiles.q_compute
    interior = n_ks * _interior_unroll(groups, bqi, tiles.block_kv_compute, tiles.block_q // bqi)
    walk = 2 * unroll + sum(_tail_sizes(unroll, n_ks))
    rows = interior * bqi + walk * tiles.q_compute
    return groups * rows * tiles.block_kv_compute / (NUM_SUBLANES * NUM_LANES)


def _mask_heads(generation, prob: _Problem):
    """The heads a masked tile builds its mask for (`_tile_mask`): one, shared by the G heads the
    tile stacks (`_masked_scores`), where tiling.mask_per_head says it pays, else all G."""
    return 1 if _tiling.mask_per_head(generation, prob.head_dim) else prob.groups


def _walk_unroll(generation, tiles, prob: _Problem, interior_q, has_sinks=False):
    """The edge walk's full-group length: `_fwd_unroll`, halved while the forward would not fit
    one instruction-memory overlay (tiling.forward_program_bundles). v6e's Llama-3-8B heads with
    a soft cap (2048 x 512 stacked tiles) were a 72,071-bundle program in 7 overlays at 4, which
    the grid loop reloads at every step (66,828 with per-head masks); at 2 the estimate is 46k.
    Against the soft cap's fixed max (no sinks) the same walk of 4 is 63,467 in one overlay."""
    unroll = _fwd_unroll(tiles.block_kv // tiles.block_kv_compute)
    while unroll > 1:
        vregs = _forward_score_vregs(tiles, prob.groups, interior_q, unroll)
        bundles, overlay = _tiling.forward_program_bundles(
            generation, vregs, prob.head_dim, prob.softcap, has_sinks
        )
        if bundles <= overlay:
            break
        unroll //= 2
    return unroll


def _cost_estimates(prob: _Problem, seqs, tiles, itemsize_dtype, pass_, segments, has_sinks=False):
    """`pl.CostEstimate`s of the pass's pallas_calls, in call order, from tiling.estimate_cost's
    closed forms (static lists: the exact counts; cu_seqlens: the padded dense band as a bound)."""
    band = prob.band
    window = (-band.lo if band.lo > -_UNBOUNDED else -1, band.hi if band.hi < _UNBOUNDED else -1)
    if all(isinstance(a, np.ndarray) for a in seqs) and prob.n_seq == 1:
        q_len, kv_len = int(seqs[1][0]), int(seqs[3][0])
    else:
        q_len, kv_len = prob.sq, prob.sk
    calls = []
    _tiling.estimate_cost(
        batch=prob.batch,
        num_q_heads=prob.kv_heads * prob.groups,
        num_kv_heads=prob.kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=prob.head_dim,
        dtype=itemsize_dtype,
        causal=False,
        window_size=window,
        segments=segments,
        tiles=tiles,
        pass_=pass_,
        softcap=prob.softcap,
        has_sinks=has_sinks,
        calls=calls,
    )
    return [
        pl.CostEstimate(
            flops=int(c["flops"]),
            transcendentals=int(c["transcendentals"]),
            bytes_accessed=int(c["bytes_accessed"]),
        )
        for c in calls
    ]


def _forward(
    q5,
    k4,
    v4,
    seqs,
    sinks,
    qseg,
    kseg,
    prob: _Problem,
    tiles,
    interpret,
    exp_bf16=False,
    interior_q=None,
    walk_unroll=None,
    mask_heads=1,
):
    """q5 [B, Hkv, G, Sq, D], k4/v4 [B, Hkv, Sk, D] (lengths already padded to the tiles);
    `walk_unroll`: the edge walk's full-group length (default `_fwd_unroll`)."""
    B, Hkv, G, Sq, D = q5.shape
    Sk = k4.shape[2]
    bq, bk, bkc, bqc = tiles.block_q, tiles.block_kv, tiles.block_kv_compute, tiles.q_compute
    nq, nk = Sq // bq, Sk // bk
    has_sinks = sinks is not None
    has_segments = qseg is not None
    qseg_ids, kseg_ids = _segment_id_rows(qseg, kseg)
    items, layout, steps = _items(seqs, prob, nq, nk, bq, bk, False, qseg_ids, kseg_ids)
    q_block = lambda b, i, it: layout.field(it, b, i, "QI")  # noqa: E731
    kv_block = lambda b, i, it: layout.field(it, b, i, "KI")  # noqa: E731

    def q_map(b, h, i, it, sq):
        return (b, h, 0, q_block(b, i, it), 0)

    def kv_map(b, h, i, it, sq):
        return (b, h, kv_block(b, i, it), 0)

    in_specs, args = [], []
    if has_sinks:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(sinks.astype(jnp.float32))
    tile_ranges = None
    if has_segments and _tiling.tile_ranges_fit(B, Sq // bqc, Sk // bkc):
        # Each compute tile's (min, max) segment id, whole in SMEM: score tiles whose documents
        # do not meet are skipped inside an item.
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(_range_table(qseg_ids, kseg_ids, bqc, bkc))
        tile_ranges = (B, Sq // bqc, Sk // bkc)
    in_specs += [
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
    ]
    args += [q5, k4, v4]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, it, sq: (b, q_block(b, i, it), 0)),
            # kv ids as lane rows, one [8, bkc] slab per compute slice (indexed on a leading dim).
            pl.BlockSpec(
                (None, bk // bkc, NUM_SUBLANES, bkc),
                lambda b, h, i, it, sq: (b, kv_block(b, i, it), 0, 0),
            ),
        ]
        kseg_slabs = kseg[:, 0, :].reshape(B, Sk // bkc, 1, bkc)
        args += [qseg, jnp.broadcast_to(kseg_slabs, (B, Sk // bkc, NUM_SUBLANES, bkc))]
    out_specs = [
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, G, bq), lambda b, h, i, it, sq: (b, h, 0, q_block(b, i, it))),
    ]
    out_shape = [
        jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        jax.ShapeDtypeStruct((B, Hkv, G, Sq), jnp.float32),
    ]
    kernel = functools.partial(
        _fwd_kernel,
        layout=layout,
        n_seq=prob.n_seq,
        seq_edges=prob.seq_edges,
        groups=G,
        block_q=bq,
        block_kv=bk,
        block_q_compute=bqc,
        block_kv_compute=bkc,
        band=prob.band,
        scale=prob.scale,
        softcap=prob.softcap,
        has_sinks=has_sinks,
        has_segments=has_segments,
        tile_ranges=tile_ranges,
        unroll=walk_unroll or _fwd_unroll(bk // bkc),
        exp_bf16=exp_bf16,
        interior_q=interior_q,
        mask_heads=mask_heads,
        fixed_max=_tiling.softcap_fixed_max(prob.softcap, has_sinks),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, Hkv, steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((G, bq, NUM_LANES), jnp.float32),  # running max m
            pltpu.VMEM((G, bq, NUM_LANES), jnp.float32),  # running sum l
            pltpu.VMEM((G, bq, D), jnp.float32),  # output accumulator
        ],
    )
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tiles.vmem_limit_bytes,
            flags=SCHEDULER_FLAGS,
        ),
        interpret=interpret,
        cost_estimate=_cost_estimates(prob, seqs, tiles, q5.dtype, "fwd", has_segments, has_sinks)[
            0
        ],
        name="flash_attention_fwd",
    )(items, _seq_array(seqs), *args)
    return o, lse


# -------------------------------------------------------------------------------------------------
# Backward
# -------------------------------------------------------------------------------------------------


def _dkdv_kernel(
    items_ref,
    seq_ref,
    *refs,
    layout,
    n_seq,
    seq_edges,
    groups,
    block_q,
    block_kv,
    block_q_compute,
    block_kv_compute,
    band,
    scale,
    softcap,
    has_segments,
    tile_ranges,
    mask_heads,
    mask_scores_first,
    fused_dq=False,
):
    """dk, dv for one kv block, accumulated over the kv-major list's q blocks. Per item, each kv
    compute slice visits the q compute tiles that can see it (the band mirrored), in transposed
    form: scores [kv rows, q rows], so lse and di arrive as lane rows, one [G, bqc] slab per q
    tile. `fused_dq`: dq of the whole sequence also accumulates here, in a VMEM scratch that
    lives across the (batch, head)'s items and is written once at its last step (5 matmuls per
    score tile instead of 4 here + 3 in a dq pass; chosen only when it fits VMEM)."""
    refs = list(refs)
    ranges_ref = refs.pop(0) if tile_ranges else None
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
    (qseg_ref, kseg_ref), refs = _pop_segment_refs(refs[6:], has_segments)
    if fused_dq:
        dk_ref, dv_ref, dq_ref, dk_acc, dv_acc, dq_acc = refs
    else:
        dk_ref, dv_ref, dk_acc, dv_acc = refs
    b = pl.program_id(0)  # read here: interpret mode has no program_id in loops
    step, n_steps = pl.program_id(2), pl.num_programs(2)
    qi, ki, si, flags = _current_item(items_ref, layout)
    bqc, bkc = block_q_compute, block_kv_compute
    rows_c = groups * bqc
    seq = _seq_scalars(seq_ref, si, n_seq)
    q_seq_lo, q_seq_hi, k_seq_lo, k_seq_hi, off = seq
    score_scale = _score_scale(scale, softcap)

    @pl.when((flags & FIRST) != 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    if fused_dq:

        @pl.when(step == 0)
        def _init_dq():
            dq_acc[...] = jnp.zeros_like(dq_acc)

    def tile(c, j, masked):
        keys = pl.ds(pl.multiple_of(c * bkc, bkc), bkc)
        rows = pl.ds(pl.multiple_of(j * bqc, bqc), bqc)
        D = q_ref.shape[-1]
        q = q_ref[:, rows, :].reshape(rows_c, D)
        do = do_ref[:, rows, :].reshape(rows_c, D)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        # Stats as lane rows [1, G*bqc]: the G heads' rows side by side (lse in base 2).
        lse_j, di_j = lse_ref[j], di_ref[j]
        lse = jnp.concatenate([lse_j[g : g + 1, :] for g in range(groups)], axis=1)
        di = jnp.concatenate([di_j[g : g + 1, :] for g in range(groups)], axis=1)
        st = jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        st, cap = _base2_scores(st * score_scale, softcap)
        if masked:
            ids = (kseg_ref[keys, 0:1], qseg_ref[j][0:1, :]) if has_segments else None
            t0, u0 = qi * block_q + j * bqc, ki * block_kv + c * bkc
            mask = _tile_mask_t(mask_heads, bqc, bkc, t0, u0, seq, band, ids, seq_edges)
            pt = _masked_probabilities(mask, st, lambda x: jnp.exp2(x - lse), 1, mask_scores_first)
        else:
            pt = jnp.exp2(st - lse)
        dv_acc[keys, :] += jax.lax.dot_general(
            pt.astype(do.dtype), do, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        dpt = jax.lax.dot_general(
            v, do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        dst = pt * (dpt - di)
        if softcap:
            dst = dst * (1.0 - cap * cap)
        dk_acc[keys, :] += jax.lax.dot_general(
            dst.astype(q.dtype), q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # `_finish` applies the scale
        if fused_dq:
            dq = jax.lax.dot_general(
                dst.astype(k.dtype), k, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )  # [G*bqc, D]; `_finish_dq` applies the scale
            q_rows = pl.ds(pl.multiple_of(qi * block_q + j * bqc, bqc), bqc)
            dq_acc[:, q_rows, :] += dq.reshape(groups, bqc, D)

    def kv_slice(c, _):
        u0 = ki * block_kv + c * bkc
        ranges = _inner_ranges(
            u0,
            bkc,
            (k_seq_lo, k_seq_hi),
            (q_seq_lo, q_seq_hi),
            -off,
            _mirror(band),
            qi * block_q,
            block_q,
            bqc,
        )
        meets = None
        if tile_ranges:
            gq, gk = qi * (block_q // bqc), ki * (block_kv // bkc) + c
            meets = lambda j: _documents_meet(ranges_ref, tile_ranges, b, gq + j, gk)  # noqa: E731
        _visit(ranges, lambda j, masked: tile(c, j, masked), has_segments=has_segments, meets=meets)
        return None

    @pl.when((flags & COMPUTE) != 0)
    def _compute():
        jax.lax.fori_loop(0, block_kv // bkc, kv_slice, None)

    @pl.when((flags & LAST) != 0)
    def _finish():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if fused_dq:

        @pl.when(step == n_steps - 1)
        def _finish_dq():
            dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _dq_kernel(
    items_ref,
    seq_ref,
    *refs,
    layout,
    n_seq,
    seq_edges,
    groups,
    block_q,
    block_kv,
    block_q_compute,
    block_kv_compute,
    band,
    scale,
    softcap,
    has_segments,
    tile_ranges,
    mask_heads,
    mask_scores_first,
    exp_bf16,
):
    """dq for one q block, accumulated in VMEM over the q-major list's kv blocks; compute tiles
    visited as in the forward."""
    refs = list(refs)
    ranges_ref = refs.pop(0) if tile_ranges else None
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
    (qseg_ref, kseg_ref), refs = _pop_segment_refs(refs[6:], has_segments)
    dq_ref, dq_acc, lse_col, di_col = refs
    b = pl.program_id(0)  # read here: interpret mode has no program_id in loops
    qi, ki, si, flags = _current_item(items_ref, layout)
    bqc, bkc = block_q_compute, block_kv_compute
    rows_c = groups * bqc
    seq = _seq_scalars(seq_ref, si, n_seq)
    score_scale = _score_scale(scale, softcap)

    @pl.when((flags & FIRST) != 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)
        # Row -> column once per q block, so every tile broadcasts stats along lanes.
        for g in range(groups):
            lse_col[g] = jnp.broadcast_to(lse_ref[g : g + 1, :], (NUM_LANES, block_q)).T
            di_col[g] = jnp.broadcast_to(di_ref[g : g + 1, :], (NUM_LANES, block_q)).T

    def tile(r0, t0, cs, masked):
        """Score tiles of the q tile at row r0 against kv slices `cs` (a static count) in
        straight-line code; their dQ contributions are summed before one accumulator update."""
        rows = pl.ds(r0, bqc)
        D = q_ref.shape[-1]
        q = q_ref[:, rows, :].reshape(rows_c, D)
        do = do_ref[:, rows, :].reshape(rows_c, D)
        lse = lse_col[:, rows, :].reshape(rows_c, NUM_LANES)[:, 0:1]
        di = di_col[:, rows, :].reshape(rows_c, NUM_LANES)[:, 0:1]
        dq_sum = None
        for c in cs:
            keys = pl.ds(pl.multiple_of(c * bkc, bkc), bkc)
            k = k_ref[keys, :]
            v = v_ref[keys, :]
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s, cap = _base2_scores(s * score_scale, softcap)
            if masked:
                ids = (qseg_ref[rows, 0:1], kseg_ref[c][0:1, :]) if has_segments else None
                u0 = ki * block_kv + c * bkc
                mask = _tile_mask(mask_heads, bqc, bkc, t0, u0, seq, band, ids, seq_edges)
                p = _masked_probabilities(
                    mask, s, lambda x: _probabilities(x, lse, exp_bf16), 0, mask_scores_first
                )
            else:
                p = _probabilities(s, lse, exp_bf16)
            dp = jax.lax.dot_general(
                do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            ds = _score_grads(p, dp, di, exp_bf16)
            if softcap:
                ds = ds * (1.0 - cap * cap)
            dq = jax.lax.dot_general(
                ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            dq_sum = dq if dq_sum is None else dq_sum + dq
        dq_acc[:, rows, :] += dq_sum.reshape(groups, bqc, D)  # `_finish` applies the scale

    @pl.when((flags & COMPUTE) != 0)
    def _compute():
        _walk_q_tiles(
            tile,
            b=b,
            qi=qi,
            ki=ki,
            block_q=block_q,
            block_kv=block_kv,
            bqc=bqc,
            bkc=bkc,
            seq=seq,
            band=band,
            has_segments=has_segments,
            tile_ranges=tile_ranges,
            ranges_ref=ranges_ref,
            unroll=DQ_UNROLL,
        )

    @pl.when((flags & LAST) != 0)
    def _finish():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _slabs(x, tile):
    """A [B, Hkv, G, S] stat as [B, Hkv, S // tile, G, tile]: one [G, tile] lane-row slab per
    compute tile, picked inside the kernel by an index on a leading dimension."""
    *lead, G, S = x.shape
    return jnp.swapaxes(x.reshape(*lead, G, S // tile, tile), -3, -2)


def _backward(
    q5,
    k4,
    v4,
    o5,
    lse,
    do5,
    seqs,
    qseg,
    kseg,
    prob: _Problem,
    tiles,
    interpret,
    exp_bf16,
    mask_heads,
    mask_scores_first,
):
    B, Hkv, G, Sq, D = q5.shape
    Sk = k4.shape[2]
    bq, bk = tiles.block_q_bwd, tiles.block_kv_bwd
    bqc, bkc = tiles.q_compute_bwd, tiles.kv_compute_bwd
    nq, nk = Sq // bq, Sk // bk
    di = jnp.sum(do5.astype(jnp.float32) * o5.astype(jnp.float32), axis=-1)  # [B, Hkv, G, Sq]
    # The kernels recompute base-2 scores (`_score_scale`): lse in base 2 (a row that saw nothing
    # keeps an lse no finite score reaches).
    lse2 = jnp.minimum(lse * LOG2E, BIG_LSE)
    has_segments = qseg is not None
    seq_arr = _seq_array(seqs)
    cp = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=tiles.vmem_limit_bytes_bwd,
        flags=SCHEDULER_FLAGS,
    )
    costs = _cost_estimates(prob, seqs, tiles, q5.dtype, "bwd", has_segments)
    qseg_ids, kseg_ids = _segment_id_rows(qseg, kseg)
    tile_ranges, head_specs, head_args = None, [], []
    if has_segments and _tiling.tile_ranges_fit(B, Sq // bqc, Sk // bkc):
        tile_ranges = (B, Sq // bqc, Sk // bkc)
        head_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)]
        head_args = [_range_table(qseg_ids, kseg_ids, bqc, bkc)]
    common = dict(
        n_seq=prob.n_seq,
        seq_edges=prob.seq_edges,
        groups=G,
        block_q=bq,
        block_kv=bk,
        block_q_compute=bqc,
        block_kv_compute=bkc,
        band=prob.band,
        scale=prob.scale,
        softcap=prob.softcap,
        has_segments=has_segments,
        tile_ranges=tile_ranges,
        mask_heads=mask_heads,
        mask_scores_first=mask_scores_first,
    )

    def maps(layout):
        q_block = lambda b, i, it: layout.field(it, b, i, "QI")  # noqa: E731
        kv_block = lambda b, i, it: layout.field(it, b, i, "KI")  # noqa: E731
        q_map = lambda b, h, i, it, sq: (b, h, 0, q_block(b, i, it), 0)  # noqa: E731
        kv_map = lambda b, h, i, it, sq: (b, h, kv_block(b, i, it), 0)  # noqa: E731
        return q_block, kv_block, q_map, kv_map

    # dk, dv: kv-major list. Stats and q segment ids as [G, bqc] / [8, bqc] lane-row slabs, one
    # per q compute tile; kv segment ids as a column.
    items_kv, layout_kv, steps_kv = _items(seqs, prob, nq, nk, bq, bk, True, qseg_ids, kseg_ids)
    q_block, kv_block, q_map, kv_map = maps(layout_kv)
    slab_map = lambda b, h, i, it, sq: (b, h, q_block(b, i, it), 0, 0)  # noqa: E731
    in_specs = head_specs + [
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, bq // bqc, G, bqc), slab_map),
        pl.BlockSpec((None, None, bq // bqc, G, bqc), slab_map),
    ]
    args = head_args + [q5, k4, v4, do5, _slabs(lse2, bqc), _slabs(di, bqc)]
    if has_segments:
        in_specs += [
            pl.BlockSpec(
                (None, bq // bqc, NUM_SUBLANES, bqc),
                lambda b, h, i, it, sq: (b, q_block(b, i, it), 0, 0),
            ),
            pl.BlockSpec((None, bk, NUM_LANES), lambda b, h, i, it, sq: (b, kv_block(b, i, it), 0)),
        ]
        q_slabs = qseg_ids.reshape(B, Sq // bqc, 1, bqc)
        args += [
            jnp.broadcast_to(q_slabs, (B, Sq // bqc, NUM_SUBLANES, bqc)),
            jnp.broadcast_to(kseg_ids[:, :, None], (B, Sk, NUM_LANES)),
        ]
    out_specs = [pl.BlockSpec((None, None, bk, D), kv_map)] * 2
    out_shape = [jax.ShapeDtypeStruct(k4.shape, k4.dtype), jax.ShapeDtypeStruct(v4.shape, v4.dtype)]
    scratch = [pltpu.VMEM((bk, D), jnp.float32)] * 2
    if tiles.fused_bwd:
        # dq of the whole sequence stays in VMEM for each (batch, head): one block, written back
        # when the head changes.
        out_specs.append(
            pl.BlockSpec((None, None, G, Sq, D), lambda b, h, i, it, sq: (b, h, 0, 0, 0))
        )
        out_shape.append(jax.ShapeDtypeStruct(q5.shape, q5.dtype))
        scratch.append(pltpu.VMEM((G, Sq, D), jnp.float32))
    grads = pl.pallas_call(
        functools.partial(_dkdv_kernel, layout=layout_kv, fused_dq=tiles.fused_bwd, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hkv, steps_kv),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=cp,
        interpret=interpret,
        cost_estimate=costs[0],
        name="flash_attention_dkdvq" if tiles.fused_bwd else "flash_attention_dkdv",
    )(items_kv, seq_arr, *args)
    if tiles.fused_bwd:
        dk, dv, dq = grads
        return dq, dk, dv, di
    dk, dv = grads

    # dq: q-major list, accumulated in VMEM across the q block's kv blocks. Stats as lane rows
    # [G, bq] (turned into columns once per q block); q segment ids as a column, kv ids as
    # [8, bkc] lane-row slabs.
    items_q, layout_q, steps_q = _items(seqs, prob, nq, nk, bq, bk, False, qseg_ids, kseg_ids)
    q_block, kv_block, q_map, kv_map = maps(layout_q)
    st_map = lambda b, h, i, it, sq: (b, h, 0, q_block(b, i, it))  # noqa: E731
    in_specs = head_specs + [
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, G, bq, D), q_map),
        pl.BlockSpec((None, None, G, bq), st_map),
        pl.BlockSpec((None, None, G, bq), st_map),
    ]
    args = head_args + [q5, k4, v4, do5, lse2, di]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, it, sq: (b, q_block(b, i, it), 0)),
            pl.BlockSpec(
                (None, bk // bkc, NUM_SUBLANES, bkc),
                lambda b, h, i, it, sq: (b, kv_block(b, i, it), 0, 0),
            ),
        ]
        k_slabs = kseg_ids.reshape(B, Sk // bkc, 1, bkc)
        args += [qseg, jnp.broadcast_to(k_slabs, (B, Sk // bkc, NUM_SUBLANES, bkc))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, layout=layout_q, exp_bf16=exp_bf16, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, Hkv, steps_q),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, G, bq, D), q_map),
            scratch_shapes=[
                pltpu.VMEM((G, bq, D), jnp.float32),
                pltpu.VMEM((G, bq, NUM_LANES), jnp.float32),
                pltpu.VMEM((G, bq, NUM_LANES), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        compiler_params=cp,
        interpret=interpret,
        cost_estimate=costs[1],
        name="flash_attention_dq",
    )(items_q, seq_arr, *args)
    return dq, dk, dv, di


# -------------------------------------------------------------------------------------------------
# Public JAX entry points
# -------------------------------------------------------------------------------------------------


def _check_common(q, k, v, window_size, softcap):
    if q.ndim != k.ndim or k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    if len(window_size) != 2 or any(w < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with each >= -1, got {window_size}")


def _check_segments(q, k, q_segment_ids, kv_segment_ids, varlen):
    if q_segment_ids is None and kv_segment_ids is None:
        return
    if q_segment_ids is None or kv_segment_ids is None:
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if varlen:
        raise ValueError("segment ids and cu_seqlens cannot be combined: use one packing scheme")
    want_q, want_k = (q.shape[0], q.shape[2]), (k.shape[0], k.shape[2])
    for name, ids, want in (
        ("q_segment_ids", q_segment_ids, want_q),
        ("kv_segment_ids", kv_segment_ids, want_k),
    ):
        if tuple(ids.shape) != want:
            raise ValueError(
                f"{name} must have shape [batch, seq] = {list(want)}, got {list(ids.shape)}"
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {ids.dtype}")


def _prepare(
    q,
    k,
    v,
    *,
    varlen,
    cu_seqlens_q,
    cu_seqlens_k,
    q_segment_ids,
    kv_segment_ids,
    causal,
    window_size,
    softcap,
    softmax_scale,
    tiles,
    generation,
    max_seqlen_q=None,
    max_seqlen_k=None,
    has_sinks=False,
):
    """Common layout work: returns (q5, k4, v4, seqs, qseg, kseg, prob, tiles, sizes)."""
    if varlen:
        # q [Tq, Hq, D] -> [1, Hkv, G, Tq, D]
        Tq, Hq, D = q.shape
        Tk, Hkv, _ = k.shape
        B = 1
        q4 = jnp.swapaxes(q, 0, 1)[None]
        k4 = jnp.swapaxes(k, 0, 1)[None]
        v4 = jnp.swapaxes(v, 0, 1)[None]
        Sq, Sk = Tq, Tk
    else:
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        q4, k4, v4 = q, k, v
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    if tiles is None:
        tiles = _tiling.choose_tiles(
            q_len=Sq if not varlen else (max_seqlen_q or Sq),
            kv_len=Sk if not varlen else (max_seqlen_k or Sk),
            num_q_heads=Hq,
            num_kv_heads=Hkv,
            head_dim=D,
            dtype=q.dtype,
            causal=causal,
            window_size=tuple(window_size),
            generation=generation,
            total_q=Sq,
            total_kv=Sk,
            segments=q_segment_ids is not None,
        )
        tiles = _tiling.with_fixed_max_kv_compute(generation, tiles, softcap, has_sinks)
    Sq_p, Sk_p = _round_up(Sq, tiles.q_multiple), _round_up(Sk, tiles.kv_multiple)
    tiles = _tiling.with_vmem_limits(
        tiles, G, D, q.dtype, generation, q_segment_ids is not None, Sq_p
    )
    q5 = _pad_axis(q4, 2, Sq_p).reshape(B, Hkv, G, Sq_p, D)
    k4 = _pad_axis(k4, 2, Sk_p)
    v4 = _pad_axis(v4, 2, Sk_p)
    if varlen:
        seqs = _seq_table_varlen(cu_seqlens_q, cu_seqlens_k)
        n_seq = cu_seqlens_q.shape[0] - 1
        max_items = 1
    else:
        seqs = _seq_table_dense(Sq, Sk)
        n_seq, max_items = 1, None
    qseg = kseg = None
    if q_segment_ids is not None:
        qs = _pad_axis(q_segment_ids.astype(jnp.int32), 1, Sq_p, -1)
        ks = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, Sk_p, -2)
        qseg = jnp.broadcast_to(qs[:, :, None], (B, Sq_p, NUM_LANES))
        kseg = jnp.broadcast_to(ks[:, None, :], (B, NUM_SUBLANES, Sk_p))
    scale = float(softmax_scale) if softmax_scale is not None else D**-0.5
    band = Band.make(causal, *window_size)
    # A dense call's sequences start at 0 and end where padding begins, if it is padded.
    edges = ANY_EDGES if varlen else SeqEdges(False, Sq < Sq_p, False, Sk < Sk_p)
    prob = _Problem(B, Hkv, G, Sq_p, Sk_p, D, band, scale, float(softcap), n_seq, max_items, edges)
    return q5, k4, v4, seqs, qseg, kseg, prob, tiles, (B, Hq, Sq, Sk, D)


def _unpack_out(x5, varlen, sizes):
    B, Hq, Sq, Sk, D = sizes
    x = x5.reshape(B, Hq, x5.shape[3], *x5.shape[4:])[:, :, :Sq]
    return jnp.swapaxes(x[0], 0, 1) if varlen else x


def _unpack_kv(x4, varlen, sizes):
    Sk = sizes[3]
    x = x4[:, :, :Sk]
    return jnp.swapaxes(x[0], 0, 1) if varlen else x


def _lse_out(lse, sizes):
    B, Hq, Sq = sizes[:3]
    return lse.reshape(B, Hq, -1)[:, :, :Sq]


def _lse_in(lse, prob: _Problem):
    # [B, Hq, Sq] -> [B, Hkv, G, Sq_p]; padded rows see nothing.
    lse = _pad_axis(lse.astype(jnp.float32), 2, prob.sq, BIG_LSE)
    return lse.reshape(prob.batch, prob.kv_heads, prob.groups, prob.sq)


def flash_attention_fwd(
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
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    tiles=None,
    generation=None,
    interpret=False,
):
    """Forward. Dense: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] -> (o like q, lse [B, Hq, Sq] f32).
    Varlen (cu_seqlens given): q [Tq, Hq, D], k/v [Tk, Hkv, D] -> (o like q, lse [1, Hq, Tq])."""
    varlen = cu_seqlens_q is not None
    _check_common(q, k, v, window_size, softcap)
    _check_segments(q, k, q_segment_ids, kv_segment_ids, varlen)
    q5, k4, v4, seqs, qseg, kseg, prob, tiles, sizes = _prepare(
        q,
        k,
        v,
        varlen=varlen,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
        tiles=tiles,
        generation=generation,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        has_sinks=sinks is not None,
    )
    exp_bf16 = _tiling.exp_in_bf16(generation, q.dtype)
    interior_q = _tiling.interior_q_compute(
        generation, tiles, prob.groups, prob.head_dim, q.dtype.itemsize, qseg is not None
    )
    o5, lse = _forward(
        q5, k4, v4, seqs, sinks, qseg, kseg, prob, tiles, interpret, exp_bf16, interior_q,
        walk_unroll=_walk_unroll(generation, tiles, prob, interior_q, sinks is not None),
        mask_heads=_mask_heads(generation, prob),
    )  # fmt: skip
    return _unpack_out(o5, varlen, sizes), _lse_out(lse, sizes)


def flash_attention_bwd(
    q,
    k,
    v,
    o,
    lse,
    do,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    softmax_scale=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    tiles=None,
    generation=None,
    interpret=False,
):
    """Backward: (dq, dk, dv, dsinks or None), same layouts as `flash_attention_fwd`."""
    varlen = cu_seqlens_q is not None
    _check_common(q, k, v, window_size, softcap)
    _check_segments(q, k, q_segment_ids, kv_segment_ids, varlen)
    q5, k4, v4, seqs, qseg, kseg, prob, tiles, sizes = _prepare(
        q,
        k,
        v,
        varlen=varlen,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        softmax_scale=softmax_scale,
        tiles=tiles,
        generation=generation,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        has_sinks=sinks is not None,
    )
    B, Hq, Sq, Sk, D = sizes

    def to5(x):
        x4 = jnp.swapaxes(x, 0, 1)[None] if varlen else x
        return _pad_axis(x4, 2, prob.sq).reshape(q5.shape)

    o5, do5 = to5(o), to5(do)
    lse5 = _lse_in(lse, prob)
    exp_bf16 = _tiling.exp_in_bf16(generation, q.dtype)
    if not _tiling.backward_band_masks(generation):
        prob = dataclasses.replace(prob, seq_edges=ANY_EDGES)
    dq5, dk4, dv4, di = _backward(
        q5,
        k4,
        v4,
        o5,
        lse5,
        do5,
        seqs,
        qseg,
        kseg,
        prob,
        tiles,
        interpret,
        exp_bf16,
        _mask_heads(generation, prob),
        _tiling.mask_scores_before_exp(generation),
    )
    dsinks = None
    if sinks is not None:
        # d sink_h = -sum_rows P(sink) * di, with P(sink) = exp(sink - lse).
        sk = sinks.astype(jnp.float32).reshape(1, prob.kv_heads, prob.groups, 1)
        dsinks = -jnp.sum(jnp.exp(sk - lse5) * di, axis=(0, 3)).reshape(Hq)
    return (
        _unpack_out(dq5, varlen, sizes),
        _unpack_kv(dk4, varlen, sizes),
        _unpack_kv(dv4, varlen, sizes),
        dsinks,
    )


def _segment_kwargs(segment_ids):
    if segment_ids is None:
        return {}
    return dict(q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fa_vjp(q, k, v, sinks, segment_ids, cfg):
    o, _ = flash_attention_fwd(q, k, v, sinks=sinks, **_segment_kwargs(segment_ids), **dict(cfg))
    return o


def _fa_vjp_fwd(q, k, v, sinks, segment_ids, cfg):
    o, lse = flash_attention_fwd(q, k, v, sinks=sinks, **_segment_kwargs(segment_ids), **dict(cfg))
    return o, (q, k, v, sinks, segment_ids, o, lse)


def _fa_vjp_bwd(cfg, res, do):
    q, k, v, sinks, segment_ids, o, lse = res
    dq, dk, dv, dsinks = flash_attention_bwd(
        q, k, v, o, lse, do, sinks=sinks, **_segment_kwargs(segment_ids), **dict(cfg)
    )
    return dq, dk, dv, dsinks, None  # segment ids are integers: no cotangent


_fa_vjp.defvjp(_fa_vjp_fwd, _fa_vjp_bwd)


def flash_attention(
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
    tiles=None,
    generation=None,
    interpret=False,
):
    """Differentiable dense flash attention, q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] -> [B, Hq, Sq, D].
    Packed documents: q_segment_ids [B, Sq] and kv_segment_ids [B, Sk] (a query sees only keys
    with its id)."""
    _check_common(q, k, v, window_size, softcap)
    _check_segments(q, k, q_segment_ids, kv_segment_ids, False)
    cfg = (
        ("causal", causal),
        ("window_size", tuple(window_size)),
        ("softcap", softcap),
        ("softmax_scale", softmax_scale),
        ("tiles", tiles),
        ("generation", generation),
        ("interpret", interpret),
    )
    segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    return _fa_vjp(q, k, v, sinks, segment_ids, cfg)
