"""Grouped matmul (ragged dot) Pallas TPU kernels: gmm (forward, and dlhs with the other weight
layout), the gate_up gmm with the gated activation fused into its epilogue, and tgmm (weight
gradient).

Schedule. The rows of lhs are grouped contiguously by `group_sizes`. Before the kernel, a few cheap
jnp ops turn group_sizes into a *work list* (schedule.work_list): one item per (row tile, group) pair
that shares rows, in row order, padded with inert items to a static length L = row tiles + groups.
The list is scalar-prefetched into SMEM, so the grid has a static size and the kernel runs
unchanged in both interpret modes and on hardware.

gmm grid = (N tiles, L items, K tiles). The BlockSpec index maps read the item's row tile and
group from SMEM: lhs block (tile, k), rhs block (group, k, n), output block (tile, n). Consecutive
items of one row tile keep the same output block, so it stays in VMEM and is written back once;
consecutive items of one group (and kt == 1) keep the same weight block, so it is not re-fetched.

The MXU work of an item is straight-line code: each row window is ONE block-sized matmul
(rows, tk) x (tk, tn), which Mosaic unrolls into back-to-back MXU pushes (the scheduler interleaves
the pushes, pops and accumulation of the whole block; a rolled loop over small chunks would
serialise them). An item's rows run as full windows of `chunk` rows (a loop whose body is one such
block matmul) plus one tail window from a small set of bucket sizes (a 20-row group tail runs a
32-row matmul, not a whole tile). Each window writes its rows' finished values (scaled, biased,
and for the gated gmm act(gate) * up), cast, straight into the output block with a row select, so
rows of other groups in the same tile stay bit-exactly untouched (a NaN weight of one expert never
reaches another expert's rows); only the first row unit of a full window can hold another group's
rows, so full windows select there alone. With one K block a row's sum is one window's product
and there is no accumulator (tiling.gmm_sums_in_output). With more, the running sums live in an
f32 accumulator (tm, tn) in VMEM, read and written once per window and K block, which each item's
first K block overwrites; every K block's windows write the output rows, and the last K block's
are what is written back. So no grid step zeroes an accumulator or copies it out per tile (on a
v5e chip 8% off Qwen3-30B-A3B down at 16384 tokens, one K block). Two cases keep an accumulator
that a tile's first item zeroes and its last writes out (tiling.gmm_windows_write_output): the
interleaved gate (its epilogue pairs lanes across the whole tile) and an output with more rows
per packed tile than the lhs. Rows past sum(group_sizes) belong to a virtual group whose items do
no MXU work and write zeros there. Items without MXU work (virtual rows, padding) point their
lhs/rhs index maps at the block the previous step left resident, so they issue no DMA. int8 / fp8
weights are converted to the lhs dtype into a VMEM copy once per grid step, or with one K block
once per run of a group's items (and a K tail, K % tk != 0, is zeroed there and in the lhs
window: garbage beyond K never meets the MXU); the per-output-channel scale (and a bias) of the
item's group is applied to its rows' sums as they go to the output block.

Gated gmm (`activation` given): the gate_up projection of a gated MLP. The output tile (tm, tn)
of act(gate) * up needs gate and up columns: with the concatenated layout ([gate | up] along N)
two rhs BlockSpecs read the gate block nb and the up block nb + I/tn of the same array, and each
window gates the two products of its columns; with the interleaved layout (gate0, up0, gate1,
...) one rhs block of 2*tn columns holds both, and the epilogue pairs lane 2j with lane 2j + 1 by
a lane rotation and compacts the even lanes with an exact 0/1 selection matmul (Mosaic has no
lane-strided load). Either way the kernel writes [M, I], not [M, 2I].

tgmm grid = (K tiles, N tiles, L items): for each (k, n) output block the items stream the row
tiles of each group; lhs and dout rows outside the item's group are zeroed (both operands) before
one row-contracting block matmul per window; the first item of a group zeroes the accumulator and
the last writes the [tk, tn] block of that group's gradient. Empty groups get one item that writes
zeros.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import schedule as _schedule
from . import tiling as _tiling
from .schedule import LAYOUT
from .tiling import GmmTiling, TgmmTiling
from .work_list import COMPUTE, FIRST, LAST, VALID

__all__ = [
    "gmm",
    "gmm_gated",
    "tgmm",
    "gated_activation",
    "QUANTISED_DTYPES",
    "ACTIVATIONS",
    "GATE_LAYOUTS",
]

QUANTISED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
ACTIVATIONS = _tiling.ACTIVATIONS
GATE_LAYOUTS = _tiling.GATE_LAYOUTS
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0
# The LLO scheduler flag tokamax exposes as `use_experimental_scheduler`; measured on the gmm
# schedule (README "ragged-dot-tpu"), on by default where it helps.
LP_SCHEDULER_FLAG = "XLA_TPU_FORCE_LP_LLO_SCHEDULER"


def _field(wl_ref, name, j, L):
    """Field `name` of item j of the SMEM work list (L records; schedule.LAYOUT)."""
    return LAYOUT.read(wl_ref, name, j, L)


def _row_mask(start, rows, lo, hi):
    r = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (r >= lo) & (r < hi)


def _sigmoid(x):
    # Through tanh (one EUP op): 1 / (1 + exp(-x)) costs an exp and an f32 divide, whose Newton
    # steps made the interleaved epilogue VALU-bound.
    return 0.5 + 0.5 * jnp.tanh(0.5 * x)


def gated_activation(gate, up, activation: str):
    """act(gate) * up in f32 (jnp; used inside the kernel and by the backward's recompute).

    silu: gate * sigmoid(gate) * up; gelu: erf GELU; gelu_tanh: tanh-approximated GELU;
    gpt_oss_swiglu: GPT-OSS's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
    gate = min(gate, 7), up = clip(up, -7, 7), (up + 1) * gate * sigmoid(1.702 * gate).
    """
    if activation == "silu":
        return gate * _sigmoid(gate) * up
    if activation == "gelu":
        return 0.5 * gate * (1.0 + jax.lax.erf(gate * (1.0 / math.sqrt(2.0)))) * up
    if activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + jnp.tanh(inner)) * up
    if activation == "gpt_oss_swiglu":
        gate = jnp.minimum(gate, GPT_OSS_LIMIT)
        up = jnp.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        return (up + 1.0) * (gate * _sigmoid(gate * GPT_OSS_ALPHA))
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def _run_item(wl_ref, j, L, flags, lo, window, buckets, rc):
    """Run `window` over a computing item's rows: NFULL full windows of `rc` rows in a loop (the
    body one block-sized matmul), then the tail in the smallest bucket that covers it. Each row is
    merged by exactly one window. `window(s, rows, first_row, full=False, item_first=...)` merges
    rows [max(s, first_row), min(s + rows, HI)); `full=True` promises that only rows [s, s + unit)
    can lie outside them; `item_first` (a traced bool) is true on the item's first window."""
    start = _field(wl_ref, "START", j, L)
    nfull = _field(wl_ref, "NFULL", j, L)
    tstart = _field(wl_ref, "TSTART", j, L)
    bucket = _field(wl_ref, "BUCKET", j, L)
    compute = (flags & COMPUTE) != 0

    @pl.when(compute & (nfull > 0))
    def _full_chunks():
        def body(i, carry):
            # START is LO rounded down to the row unit and NFULL full windows end at or before HI:
            # only a full window's first `unit` rows can lie outside the item's rows.
            window(start + i * rc, rc, lo, full=True, item_first=i == 0)
            return carry

        jax.lax.fori_loop(0, nfull, body, 0)

    tail_first = jnp.maximum(lo, start + nfull * rc)  # rows before it belong to the full chunks
    for b_idx, rows in enumerate(buckets):
        # Each bucket is a rolled loop of 0 or 1 trips, not a predicated region of the grid
        # step: a step runs one bucket at most, and as loops the buckets' matmuls stay out of the
        # step's own straight-line code, so the compiled schedule reads as what a step executes
        # (full windows in their loop, one bucket) rather than a step that holds every bucket's
        # MXU work (benchmarks/schedule_model.py charges a tail one bucket run).
        def tail(i, carry, rows=rows):
            window(tstart, rows, tail_first, item_first=nfull == 0)
            return carry

        jax.lax.fori_loop(0, (compute & (bucket == b_idx)).astype(jnp.int32), tail, 0)


# Columns per straight-line matmul for a (k_rows, cols) weight block: one definition, in tiling
# (`window_cols`, with its MAX_DOT_ELEMENTS and PROGRAM_MXU_BUNDLES limits and why), which the
# ranking's window counts use too. `_n_chunk` stays as the name benchmarks/ours.py and the
# schedule tests read.
_n_chunk = _tiling.window_cols


def _over_chunks(total: int, chunk: int, fn) -> None:
    """fn(offset) for offsets 0, chunk, ... < total: inline when one chunk, else a loop."""
    if chunk == total:
        fn(0)
        return

    def body(c, carry):
        fn(pl.multiple_of(c * chunk, chunk))
        return carry

    jax.lax.fori_loop(0, total // chunk, body, 0)


def _precision(a, b):
    """HIGHEST when an operand is f32: the MXU's default takes one bf16 pass, which on a TPU v5e
    chip left 2.4e-3 relative error in an f32 gmm (benchmarks/results/device/); f32 inputs get
    f32-accurate products (several passes). bf16 and 8-bit operands: the default (exact)."""
    f32 = jnp.dtype(jnp.float32)
    return jax.lax.Precision.HIGHEST if f32 in (a.dtype, b.dtype) else None


def _window_params(tm, tk, cols, buckets, unit, generation, n_rhs=1) -> dict:
    """The row-window parameters gmm and tgmm share: the K rows of a block, the tail buckets and
    row unit, the full window's rows and the columns per window matmul (tiling.window_cols: at
    most the program budget over every window copy)."""
    gen = _tiling.get_generation(generation)
    return dict(
        tk=tk,
        buckets=buckets,
        unit=unit,
        rc=_schedule.row_chunk(tm),
        cn=_tiling.window_cols(tk, cols, gen, tm, unit, n_rhs),
    )


def _compiler_params(semantics, vmem_limit, lp_scheduler, generation):
    """`lp_scheduler` None: the generation's default (tiling.use_lp_scheduler)."""
    if lp_scheduler is None:
        lp_scheduler = _tiling.use_lp_scheduler(generation)
    flags = {LP_SCHEDULER_FLAG: True} if lp_scheduler else None
    return pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=vmem_limit, flags=flags
    )


def _cost_estimate(c: dict) -> pl.CostEstimate:
    return pl.CostEstimate(
        flops=int(c["flops"]),
        transcendentals=int(c["transcendentals"]),
        bytes_accessed=int(c["bytes_accessed"]),
    )


# -------------------------------------------------------------------------------------------------
# gmm
# -------------------------------------------------------------------------------------------------


def _gmm_kernel(
    wl_ref,
    lhs_ref,
    *refs,
    L,
    kt,
    k_size,
    tk,
    tn,
    buckets,
    unit,
    rc,
    cn,
    transpose_rhs,
    quantised,
    has_bias,
    n_rhs,
    activation,
    layout,
    n_valid,
    compute_dtype,
    prefetch_runs,
    col_offsets,
    wcols,
    writes_output,
    sums_in_output,
):
    """n_rhs weight refs (1, or 2 for concatenated gate/up), each with its own scale / bias ref,
    accumulator and (quantised or K tail) prepared-weight copy. With `prefetch_runs` the weight
    refs are in HBM and the kernel copies their blocks itself (`_run_weights`). With
    `writes_output` (tiling.gmm_windows_write_output: all but the interleaved gate and an output
    with more rows per packed tile than the lhs) each window writes its rows' finished values,
    cast, into the output block; with `sums_in_output` as well (one K block) there is no
    accumulator at all."""
    refs = list(refs)
    rhs_refs = [refs.pop(0) for _ in range(n_rhs)]
    scale_refs = [refs.pop(0) for _ in range(n_rhs)] if quantised else None
    bias_refs = [refs.pop(0) for _ in range(n_rhs)] if has_bias else None
    out_ref = refs.pop(0)
    acc_refs = [] if sums_in_output else [refs.pop(0) for _ in range(n_rhs)]
    k_tail = k_size % tk != 0
    prepare = quantised or k_tail
    prepared_refs = [refs.pop(0) for _ in range(n_rhs)] if prepare else None
    # With one K block a group's run of items reads one weight block (per N tile): it is
    # prepared on the run's first computing item and kept (tiling.weight_preparations).
    prepared_group = refs.pop(0) if prepare and kt == 1 else None

    nb, j, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if prefetch_runs:
        slots, sems, slot_ref = refs
        rhs_refs = _run_weights(
            wl_ref, rhs_refs, slots, sems, slot_ref, nb, j, L, col_offsets, transpose_rhs
        )
    w_refs = prepared_refs if prepare else rhs_refs
    flags = _field(wl_ref, "FLAGS", j, L)
    lo = _field(wl_ref, "LO", j, L)
    hi = _field(wl_ref, "HI", j, L)
    is_last_k = kb == kt - 1
    compute = (flags & COMPUTE) != 0

    if writes_output:
        # Every row of a real group is written by its item's windows; the rows past
        # sum(group_sizes) (the virtual group's items: valid, no MXU work, once per row tile at
        # its first K block) are written zero here: they run from LO to the tile's end (rows past
        # M are dropped by the write-back), so only the row unit holding LO is selected, and the
        # units after it are stored in a rolled loop, not a select over the whole block (a
        # region of the grid step's own code, ~1,000 bundles at 1024 x 2048 on v6e, which the
        # benchmarks' schedule model charged to every grid step).
        @pl.when(((flags & VALID) != 0) & ~compute & (kb == 0))
        def _zero_rows_past_groups():
            # lax.div, not //: LO >= 0, and jnp's floor division lowers through a sign op that
            # Mosaic resolves against the attached device's generation.
            first = pl.multiple_of(jax.lax.div(lo, unit) * unit, unit)
            rows = first + jax.lax.broadcasted_iota(jnp.int32, (unit, 1), 0)
            head = out_ref[pl.ds(first, unit), :]
            out_ref[pl.ds(first, unit), :] = jnp.where(rows >= lo, jnp.zeros_like(head), head)

            def zero_unit(u, carry):
                out_ref[pl.ds(pl.multiple_of(u * unit, unit), unit), :] = jnp.zeros(
                    (unit, out_ref.shape[1]), out_ref.dtype
                )
                return carry

            jax.lax.fori_loop(jax.lax.div(first, unit) + 1, out_ref.shape[0] // unit, zero_unit, 0)

    else:

        @pl.when(((flags & FIRST) != 0) & (kb == 0))
        def _zero():
            for acc_ref in acc_refs:
                acc_ref[...] = jnp.zeros_like(acc_ref)

    if prepare:
        # Once per grid step (with one K block, once per run of a group's items), not per
        # window: int8 / e4m3 -> lhs dtype (exact: their values fit in bf16), and past K the
        # last K block holds whatever lay beyond the array: zeroed (0 * NaN would still be NaN).
        needed = compute
        if prepared_group is not None:
            # The group whose block the copy holds, in SMEM: -1 at each N tile's first item (a
            # new column block; with a "parallel" N axis each core starts its tiles there).
            # Items without MXU work in between leave the copy as it is.
            group = _field(wl_ref, "GROUP", j, L)

            @pl.when(j == 0)
            def _new_column_block():
                prepared_group[0] = -1

            needed = compute & (prepared_group[0] != group)

        @pl.when(needed)
        def _prepare():
            if prepared_group is not None:
                prepared_group[0] = group
            for rhs_ref, w_ref in zip(rhs_refs, w_refs):
                w = rhs_ref[...].astype(compute_dtype)
                if k_tail:
                    axis = 1 if transpose_rhs else 0
                    ok = kb * tk + jax.lax.broadcasted_iota(jnp.int32, w.shape, axis) < k_size
                    w = jnp.where(ok, w, jnp.zeros_like(w))
                w_ref[...] = w

    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def window(s, rows, first_row, full=False, item_first=None):
        """Multiply lhs rows [s, s + rows) by the whole weight block(s) and write the rows in
        [first_row, HI) into the output block (`write_rows`) or merge them into the accumulators
        (`accumulate`). A full window selects only its first `unit` rows (the rest are the item's
        own). Sums start at an item's first K block (kb == 0), or from the accumulator the tile's
        first item zeroed, so `item_first` is not needed here."""
        del item_first
        s = pl.multiple_of(s, unit)
        row_ok = _row_mask(s, unit if full else rows, first_row, hi)

        def lhs_rows():
            # Read inside each column chunk, not once before their loop: a window read outside
            # the loop is a value the loop carries, which Mosaic copies to a VMEM spill slot and
            # back (on v5e at Mixtral-8x7B's gate_up, 1,034 bundles of copy per 3,902 of
            # matmul); read here, the MXU pushes load it straight from the lhs block.
            x = lhs_ref[pl.ds(s, rows), :]
            if k_tail:
                col = kb * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1)
                x = jnp.where(col < k_size, x, jnp.zeros_like(x))
            return x

        def scaled(p, total, cols):
            """The item's group's scale and bias applied to a row sum."""
            if quantised:
                total = total * scale_refs[p][:, cols].astype(jnp.float32)
            if has_bias:
                total = total + bias_refs[p][:, cols].astype(jnp.float32)
            return total

        def finished(p, new, cols):
            """What the accumulator holds after this K block: the sum so far, scaled and biased
            once it is finished (last K)."""
            if not (quantised or has_bias):
                return new
            fin = scaled(p, new, cols)
            return fin if kt == 1 else jnp.where(is_last_k, fin, new)

        def write_rows(ds, cols):
            """`writes_output`: the window's rows' finished values (scaled, biased, gated), cast,
            go into the output block, selected to the item's rows; the last K block's are those
            written back, so no pass zeroes an accumulator or copies it out per row tile. With
            one K block a row's sum is the window's product `ds` itself. With more, the running
            sums live in f32 accumulators, which an item's first K block overwrites. A full window
            stores its sums there without a row select: its first unit's rows outside the item
            belong to an earlier group, whose items have run all their K blocks. A tail window
            selects: it may slide back over rows of the item's full windows, already summed for
            this K block."""
            win = pl.ds(s, rows)
            totals = ds
            if not sums_in_output:
                totals = []
                for acc_ref, d in zip(acc_refs, ds):
                    cur = acc_ref[win, cols]
                    total = jnp.where(kb == 0, d, cur + d)  # a select: stale sums may be NaN
                    acc_ref[win, cols] = total if full else jnp.where(row_ok, total, cur)
                    totals.append(total)
            vals = [scaled(p, total, cols) for p, total in enumerate(totals)]
            out = vals[0] if activation is None else gated_activation(*vals, activation)
            out = out.astype(out_ref.dtype)
            if not full:
                # A select, not a 0/1 multiply: rows of other groups stay bit-exact even if the
                # product is NaN.
                out_ref[win, cols] = jnp.where(row_ok, out, out_ref[win, cols])
                return
            # The whole window is stored without a select (each product row flows from the MXU
            # pop to its store), then its first `unit` rows are put back where they belong to
            # another group: slicing the product instead would hold all of it in registers.
            head = pl.ds(s, unit)
            before = out_ref[head, cols]
            out_ref[win, cols] = out
            out_ref[head, cols] = jnp.where(row_ok, out_ref[head, cols], before)

        def accumulate(p, d, cols):
            """Not `writes_output` (the interleaved gated layout, or an output of more rows per
            packed tile than the lhs): merge the product into the accumulator, zeroed by the
            tile's first item and written out by its last (`_store`)."""
            acc_ref = acc_refs[p]
            if not full:
                cur = acc_ref[pl.ds(s, rows), cols]
                new = finished(p, cur + d, cols)
                acc_ref[pl.ds(s, rows), cols] = jnp.where(row_ok, new, cur)
                return
            head = pl.ds(s, unit)
            before = acc_ref[head, cols]
            whole = d if kt == 1 else acc_ref[pl.ds(s, rows), cols] + d
            acc_ref[pl.ds(s, rows), cols] = finished(p, whole, cols)
            acc_ref[head, cols] = jnp.where(row_ok, acc_ref[head, cols], before)

        def columns(n0):
            cols = pl.ds(n0, cn)
            x = lhs_rows()
            ds = []
            for p in range(n_rhs):
                w = w_refs[p][cols, :] if transpose_rhs else w_refs[p][:, cols]
                ds.append(
                    jax.lax.dot_general(
                        x, w, dims, precision=_precision(x, w), preferred_element_type=jnp.float32
                    )
                )
            if writes_output:
                write_rows(ds, cols)
                return
            for p, d in enumerate(ds):
                accumulate(p, d, cols)

        _over_chunks(wcols, cn, columns)

    _run_item(wl_ref, j, L, flags, lo, window, buckets, rc)

    if writes_output:  # the windows wrote the output block
        return

    @pl.when(((flags & LAST) != 0) & is_last_k)
    def _store():
        if activation is None:
            out_ref[...] = acc_refs[0][...].astype(out_ref.dtype)
        elif layout == "concatenated":
            h = gated_activation(acc_refs[0][...], acc_refs[1][...], activation)
            out_ref[...] = h.astype(out_ref.dtype)
        else:
            out_ref[...] = _interleaved_epilogue(
                acc_refs[0][...], activation, tn, n_valid, nb, out_ref.dtype
            )


def _run_weights(wl_ref, rhs_hbm, slots, sems, slot_ref, nb, j, L, col_offsets, transpose_rhs):
    """The weight blocks of item j, copied one *run* ahead (tiling.prefetches_runs).

    With BlockSpec pipelining a group's weight block is copied under the one grid step before
    the group's first item, which is mostly a few tail rows of the previous group: the copy of
    a 16 MiB block outlasts it (on a TPU v5e chip equal tile-aligned groups ran Mixtral-8x7B
    gate_up at 4096 tokens at 166 TFLOP/s, the named routing at 146). Here the weights stay in
    HBM and each run of items of one group (schedule.py: GROUP never decreases) has a VMEM slot
    of two: when a run starts, the next run's block (NEXT, or the first run of the next N tile)
    is started into the other slot, then this run's block (started when the previous run
    started) is waited for, so each copy hides under the whole run before its own. The chain
    crosses N tiles, so the N grid axis is sequential ("arbitrary"; tiling.prefetches_runs takes
    single-core devices only).
    Returns the current slot's views, one per weight ref."""
    nt = pl.num_programs(0)
    group = _field(wl_ref, "GROUP", j, L)
    run_start = (j == 0) | (group != _field(wl_ref, "GROUP", jnp.maximum(j - 1, 0), L))

    def copies(g, n_tile, slot):
        out = []
        for p, (hbm, buf) in enumerate(zip(rhs_hbm, slots)):
            cols = buf.shape[1] if transpose_rhs else buf.shape[2]
            c = pl.ds((n_tile + col_offsets[p]) * cols, cols)
            src = hbm.at[g, c, :] if transpose_rhs else hbm.at[g, :, c]
            out.append(pltpu.make_async_copy(src, buf.at[slot], sems.at[slot, p]))
        return out

    @pl.when((nb == 0) & (j == 0))
    def _first_block():  # nothing started it: copied in the open, as a pipeline's prologue
        slot_ref[0] = 1  # the run start below flips it to slot 0
        for c in copies(group, nb, 0):
            c.start()

    @pl.when(run_start)
    def _switch():
        slot = 1 - slot_ref[0]
        slot_ref[0] = slot
        nxt = _field(wl_ref, "NEXT", j, L)
        # The next run's copy starts before this run's is waited for: the other slot's run has
        # finished, and with two copies in flight the DMA engine does not idle between them
        # (waiting first cost ~0.4 us per run on a TPU v5e chip, 10% of a 64-token decode gmm).

        @pl.when(nxt >= 0)
        def _next_run():
            for c in copies(nxt, nb, 1 - slot):
                c.start()

        @pl.when((nxt < 0) & (nb + 1 < nt))
        def _next_tile():
            for c in copies(_field(wl_ref, "GROUP", 0, L), nb + 1, 1 - slot):
                c.start()

        for c in copies(group, nb, slot):
            c.wait()

    slot = slot_ref[0]
    return [buf.at[slot] for buf in slots]


def _interleaved_epilogue(acc, activation, tn, n_valid, nb, out_dtype):
    """acc (rows, 2 tn): lanes 2j (gate) and 2j + 1 (up) -> (rows, tn) of act(gate) * up.

    A lane rotation brings up_j next to gate_j; the even lanes are then compacted by an exact 0/1
    selection matmul. Odd lanes and lanes past the array's last column (an edge block reads
    whatever lies there) are zeroed first, so only the row's own values reach its output."""
    w2 = 2 * tn
    up = pltpu.roll(acc, w2 - 1, 1)  # up[:, c] = acc[:, c + 1]
    h = gated_activation(acc, up, activation)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, w2), 1)
    keep = (lane % 2 == 0) & (nb * w2 + lane < 2 * n_valid)
    h = jnp.where(keep, h, 0.0)
    r = jax.lax.broadcasted_iota(jnp.int32, (w2, tn), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (w2, tn), 1)
    if jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16):
        # Round first: one bf16 pass then picks exactly the rounded value.
        sel = (r == 2 * c).astype(jnp.bfloat16)
        out = jnp.dot(h.astype(jnp.bfloat16), sel, preferred_element_type=jnp.float32)
    else:
        sel = (r == 2 * c).astype(jnp.float32)
        out = jnp.dot(
            h, sel, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
    return out.astype(out_dtype)


def _gmm_call(
    lhs,
    rhs,
    group_sizes,
    scales,
    bias,
    *,
    transpose_rhs,
    out_dtype,
    tiling,
    interpret,
    generation,
    activation,
    layout,
    lp_scheduler,
):
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n_rhs_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    gated = activation is not None
    n = n_rhs_cols // 2 if gated else n_rhs_cols  # output columns
    quantised = jnp.dtype(rhs.dtype) in QUANTISED_DTYPES
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0 or n == 0 or k == 0 or num_groups == 0:
        if gated and k == 0 and m and n and num_groups:
            # lhs @ W = 0 (+ bias): the activation of a zero pre-activation is still computed.
            raise ValueError("gmm_gated: K must be positive")
        return jnp.zeros((m, n), out_dtype)
    t = tiling or _tiling.gmm_tiling(
        m,
        k,
        n,
        lhs.dtype,
        rhs.dtype,
        out_dtype,
        num_groups=num_groups,
        generation=generation,
        gate_layout=layout if gated else None,
    )
    tm, tk, tn = t.tm, t.tk, t.tn
    if gated:
        _tiling.check_gated_tn(tn, n, layout)
    unit = _schedule.row_unit(lhs.dtype)
    buckets = _schedule.bucket_sizes(tm, unit)
    L = _schedule.work_list_length(m, tm, num_groups)
    kt, nt = pl.cdiv(k, tk), pl.cdiv(n, tn)
    wl = _schedule.work_list(
        group_sizes.astype(jnp.int32), m=m, tm=tm, buckets=buckets, unit=unit, kind="gmm", xp=jnp
    )
    # Column blocks of the rhs per output tile nb: the block width, and per weight ref the offset
    # of its block index (nb + offset).
    if not gated:
        wcols, col_offsets = tn, (0,)
    elif layout == "concatenated":
        wcols, col_offsets = tn, (0, n // tn)
    else:
        wcols, col_offsets = 2 * tn, (0,)
    n_rhs = len(col_offsets)
    # Per weight ref: the array it reads and how a per-group row vector (scales, bias) is cut.
    halves = [lambda a, axis: a] * n_rhs
    if gated and layout == "concatenated" and tn % 128:
        # I is no multiple of 128, so an (.., I) block of the [.., 2I] array is no legal TPU block
        # (last dim a multiple of 128 or the whole dim): the gate and up halves go in as arrays
        # of their own (one XLA copy of the weights), each block then their whole width.
        col_offsets = (0, 0)
        halves = [
            lambda a, axis: jax.lax.slice_in_dim(a, 0, n, axis=axis),
            lambda a, axis: jax.lax.slice_in_dim(a, n, 2 * n, axis=axis),
        ]
    prefetch_runs = _tiling.prefetches_runs(k, tk, n, tn, _tiling.get_generation(generation))

    def k_of(j, kb, wl_ref):
        # Items without MXU work stay on the last K block: the block the previous step left.
        return jnp.where(_field(wl_ref, "KFIX", j, L) != 0, kt - 1, kb)

    def lhs_map(nb, j, kb, wl_ref):
        return _field(wl_ref, "TILE", j, L), k_of(j, kb, wl_ref)

    def rhs_spec(offset):
        if prefetch_runs:  # copied by the kernel (`_run_weights`)
            return pl.BlockSpec(memory_space=pl.ANY)
        col = lambda nb: nb + offset  # noqa: E731
        if transpose_rhs:
            return pl.BlockSpec(
                (None, wcols, tk),
                lambda nb, j, kb, wl_ref: (
                    _field(wl_ref, "GROUP", j, L),
                    col(nb),
                    k_of(j, kb, wl_ref),
                ),
            )
        return pl.BlockSpec(
            (None, tk, wcols),
            lambda nb, j, kb, wl_ref: (_field(wl_ref, "GROUP", j, L), k_of(j, kb, wl_ref), col(nb)),
        )

    def row_vector_spec(offset):  # per-group (1, wcols) rows of scales / bias
        return pl.BlockSpec(
            (None, 1, wcols),
            lambda nb, j, kb, wl_ref: (_field(wl_ref, "GROUP", j, L), 0, nb + offset),
        )

    in_specs = [pl.BlockSpec((tm, tk), lhs_map)] + [rhs_spec(c) for c in col_offsets]
    args = [lhs] + [half(rhs, 1 if transpose_rhs else 2) for half in halves]
    if quantised:
        in_specs += [row_vector_spec(c) for c in col_offsets]
        sc = scales.astype(jnp.float32).reshape(num_groups, 1, n_rhs_cols)
        args += [half(sc, 2) for half in halves]
    has_bias = bias is not None
    if has_bias:
        in_specs += [row_vector_spec(c) for c in col_offsets]
        bi = bias.astype(jnp.float32).reshape(num_groups, 1, n_rhs_cols)
        args += [half(bi, 2) for half in halves]
    out_spec = pl.BlockSpec((tm, tn), lambda nb, j, kb, wl_ref: (_field(wl_ref, "OUT", j, L), nb))

    compute_dtype = lhs.dtype
    writes_output = _tiling.gmm_windows_write_output(
        lhs.dtype, out_dtype, layout if gated else None
    )
    sums_in_output = _tiling.gmm_sums_in_output(
        k, tk, lhs.dtype, out_dtype, layout if gated else None
    )
    scratch = [] if sums_in_output else [pltpu.VMEM((tm, wcols), jnp.float32) for _ in range(n_rhs)]
    wshape = (wcols, tk) if transpose_rhs else (tk, wcols)
    if quantised or k % tk:
        scratch += [pltpu.VMEM(wshape, compute_dtype) for _ in range(n_rhs)]
        if kt == 1:  # the group whose prepared block the copies hold
            scratch += [pltpu.SMEM((1,), jnp.int32)]
    if prefetch_runs:  # two weight slots per ref, their DMA semaphores, the current slot
        scratch += [
            [pltpu.VMEM((2, *wshape), rhs.dtype) for _ in range(n_rhs)],
            pltpu.SemaphoreType.DMA((2, n_rhs)),
            pltpu.SMEM((1,), jnp.int32),
        ]
    need = _tiling.gmm_vmem_bytes(
        tm,
        tk,
        tn,
        lhs.dtype,
        rhs.dtype,
        out_dtype,
        k=k,
        quantised=quantised,
        gate_layout=layout if gated else None,
    )
    cost = _tiling.call_cost(
        "gmm",
        m,
        k,
        n,
        num_groups,
        lhs.dtype,
        rhs.dtype,
        out_dtype,
        t,
        activation=activation,
        gate_layout=layout if gated else None,
    )
    kernel = functools.partial(
        _gmm_kernel,
        L=L,
        kt=kt,
        k_size=k,
        tn=tn,
        **_window_params(tm, tk, wcols, buckets, unit, generation, n_rhs),
        transpose_rhs=transpose_rhs,
        quantised=quantised,
        has_bias=has_bias,
        n_rhs=n_rhs,
        activation=activation,
        layout=layout,
        n_valid=n,
        compute_dtype=compute_dtype,
        prefetch_runs=prefetch_runs,
        col_offsets=col_offsets,
        wcols=wcols,
        writes_output=writes_output,
        sums_in_output=sums_in_output,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nt, L, kt),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=scratch,
        ),
        compiler_params=_compiler_params(
            ("arbitrary" if prefetch_runs else "parallel", "arbitrary", "arbitrary"),
            _tiling.vmem_limit(t, need, generation),
            lp_scheduler,
            generation,
        ),
        cost_estimate=_cost_estimate(cost),
        interpret=interpret,
        name="ragged_dot_gmm_gated" if gated else "ragged_dot_gmm",
    )
    return call(wl, *args)


@functools.partial(
    jax.jit,
    static_argnames=(
        "transpose_rhs",
        "out_dtype",
        "tiling",
        "interpret",
        "generation",
        "lp_scheduler",
    ),
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    scales: Optional[jax.Array] = None,
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    tiling: Optional[GmmTiling] = None,
    interpret=False,
    generation: Optional[str] = None,
    lp_scheduler: Optional[bool] = None,
) -> jax.Array:
    """out[rows of group g] = lhs[rows of g] @ rhs[g] (rhs[g].T with transpose_rhs).

    lhs [M, K]; rhs [G, K, N] or, with transpose_rhs, [G, N, K]; group_sizes int32 [G] with
    sum <= M (rows past the sum come out zero). int8 / float8_e4m3fn rhs needs `scales` f32 [G, N]
    (per output channel): out = (lhs @ rhs_q[g]) * scales[g]. f32 accumulation; output dtype
    `out_dtype` (default lhs dtype). `tiling`: a GmmTiling (default: tiling.gmm_tiling for
    `generation`). `interpret`: False on TPU, True or pltpu.InterpretParams on CPU.
    `lp_scheduler`: pass the LP LLO-scheduler flag to Mosaic (default: tiling.use_lp_scheduler).
    """
    quantised = jnp.dtype(rhs.dtype) in QUANTISED_DTYPES
    if quantised and scales is None:
        raise ValueError(f"gmm: rhs of dtype {rhs.dtype} needs scales f32 [G, N]")
    return _gmm_call(
        lhs,
        rhs,
        group_sizes,
        scales,
        None,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=interpret,
        generation=generation,
        activation=None,
        layout=None,
        lp_scheduler=lp_scheduler,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "activation",
        "layout",
        "transpose_rhs",
        "out_dtype",
        "tiling",
        "interpret",
        "generation",
        "lp_scheduler",
    ),
)
def gmm_gated(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    transpose_rhs: bool = False,
    out_dtype=None,
    tiling: Optional[GmmTiling] = None,
    interpret=False,
    generation: Optional[str] = None,
    lp_scheduler: Optional[bool] = None,
) -> jax.Array:
    """The gate_up projection of a gated MLP with its activation fused: [M, I] =
    act(gate) * up of h = lhs @ rhs[g] (+ bias[g]), h [M, 2I] never written to HBM.

    rhs [G, K, 2I] (or [G, 2I, K] with transpose_rhs); `layout` "concatenated" (gate = columns
    [0, I), up = [I, 2I)) or "interleaved" (gate = even columns, up = odd); `bias` [G, 2I] or None;
    `activation` in ACTIVATIONS (see gated_activation). Rows past sum(group_sizes) come out zero.
    Concatenated needs I % 128 == 0 (I % tn == 0 for the tile), except in interpret mode.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if layout not in GATE_LAYOUTS:
        raise ValueError(f"layout: expected one of {GATE_LAYOUTS}, got {layout!r}")
    two_i = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if two_i % 2:
        raise ValueError(f"rhs: the gate_up dimension {two_i} must be even (gate and up halves)")
    if jnp.dtype(rhs.dtype) in QUANTISED_DTYPES:
        raise TypeError("rhs: gmm_gated takes float weights (bf16 / f32)")
    if bias is not None and bias.shape != (rhs.shape[0], two_i):
        raise ValueError(f"bias: expected shape {(rhs.shape[0], two_i)}, got {bias.shape}")
    return _gmm_call(
        lhs,
        rhs,
        group_sizes,
        None,
        bias,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
        tiling=tiling,
        interpret=interpret,
        generation=generation,
        activation=activation,
        layout=layout,
        lp_scheduler=lp_scheduler,
    )


# -------------------------------------------------------------------------------------------------
# tgmm
# -------------------------------------------------------------------------------------------------


def _tgmm_kernel(wl_ref, lhs_ref, dout_ref, out_ref, *scratch, L, tk, tn, buckets, unit, rc, cn):
    """`scratch`: the f32 accumulator, or nothing when the output is f32 and holds the sum itself
    (tiling.tgmm_sums_in_output)."""
    (acc_ref,) = scratch or (out_ref,)
    j = pl.program_id(2)
    flags = _field(wl_ref, "FLAGS", j, L)
    lo = _field(wl_ref, "LO", j, L)
    hi = _field(wl_ref, "HI", j, L)

    first = (flags & FIRST) != 0
    compute = (flags & COMPUTE) != 0

    # Every window writes its group's running sum twice: into the f32 accumulator (what the next
    # window adds to) and, cast, into the output block, which is therefore final after the
    # group's last window. The group's first window writes its product over whatever the
    # accumulator held (`opens`). So no grid step zeroes the accumulator before a group or reads
    # it back after one: those passes stored the whole (tk, tn) block one vreg per bundle (3,072
    # bundles each per group at Qwen3-30B-A3B gate_up's 2048 x 1536 on v5e), where the windows'
    # extra stores fit mostly beside their MXU pushes. Timed on the v5e chip, 5-15% faster
    # (README, "tgmm"). An empty group's one item computes nothing: its block is written zero.
    @pl.when(first & jnp.logical_not(compute))
    def _empty_group():
        out_ref[...] = jnp.zeros_like(out_ref)

    def window(s, rows, first_row, full=False, item_first=None):
        del full  # every row is masked: the operands' select is cheap beside the row contraction
        s = pl.multiple_of(s, unit)
        row_ok = _row_mask(s, rows, first_row, hi)
        opens = first & item_first  # the output block's first window: nothing to add to

        def columns(n0):
            # Rows of other groups are zeroed in both operands: the matmul contracts over rows.
            # lhs is read and selected per column chunk, not once before their loop: a value the
            # loop carries is copied to a VMEM spill slot and back (gmm's `lhs_rows`), and the
            # select is cheap beside the chunk's transposes and pushes.
            x = lhs_ref[pl.ds(s, rows), :]
            x = jnp.where(row_ok, x, jnp.zeros_like(x))
            y = dout_ref[pl.ds(s, rows), pl.ds(n0, cn)]
            y = jnp.where(row_ok, y, jnp.zeros_like(y))
            d = jax.lax.dot_general(
                x,
                y,
                (((0,), (0,)), ((), ())),
                precision=_precision(x, y),
                preferred_element_type=jnp.float32,
            )
            # A select, not a multiply by 0: what the accumulator held (another group's sums, or
            # whatever VMEM held before the first group) may be NaN.
            before = acc_ref[:, pl.ds(n0, cn)]
            total = jnp.where(opens, d, before + d)
            acc_ref[:, pl.ds(n0, cn)] = total
            if scratch:
                out_ref[:, pl.ds(n0, cn)] = total.astype(out_ref.dtype)

        _over_chunks(tn, cn, columns)

    _run_item(wl_ref, j, L, flags, lo, window, buckets, rc)


@functools.partial(
    jax.jit, static_argnames=("out_dtype", "tiling", "interpret", "generation", "lp_scheduler")
)
def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    tiling: Optional[TgmmTiling] = None,
    interpret=False,
    generation: Optional[str] = None,
    lp_scheduler: Optional[bool] = None,
) -> jax.Array:
    """out[g] = lhs[rows of g].T @ dout[rows of g]: lhs [M, K], dout [M, N] -> [G, K, N].

    Empty groups give exact zeros; rows past sum(group_sizes) are ignored. f32 accumulation,
    output dtype `out_dtype` (default lhs dtype).
    """
    m, k = lhs.shape
    n = dout.shape[1]
    num_groups = group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0 or k == 0 or n == 0 or num_groups == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    t = tiling or _tiling.tgmm_tiling(
        m, k, n, lhs.dtype, dout.dtype, out_dtype, num_groups=num_groups, generation=generation
    )
    tm, tk, tn = t.tm, t.tk, t.tn
    unit = _schedule.row_unit(lhs.dtype, dout.dtype)
    buckets = _schedule.bucket_sizes(tm, unit)
    L = _schedule.work_list_length(m, tm, num_groups)
    kt, nt = pl.cdiv(k, tk), pl.cdiv(n, tn)
    wl = _schedule.work_list(
        group_sizes.astype(jnp.int32), m=m, tm=tm, buckets=buckets, unit=unit, kind="tgmm", xp=jnp
    )
    need = _tiling.tgmm_vmem_bytes(tm, tk, tn, lhs.dtype, dout.dtype, out_dtype)
    cost = _tiling.call_cost("tgmm", m, k, n, num_groups, lhs.dtype, dout.dtype, out_dtype, t)
    call = pl.pallas_call(
        functools.partial(
            _tgmm_kernel, L=L, tn=tn, **_window_params(tm, tk, tn, buckets, unit, generation)
        ),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(kt, nt, L),
            in_specs=[
                pl.BlockSpec(
                    (tm, tk), lambda kb, nb, j, wl_ref: (_field(wl_ref, "TILE", j, L), kb)
                ),
                pl.BlockSpec(
                    (tm, tn), lambda kb, nb, j, wl_ref: (_field(wl_ref, "TILE", j, L), nb)
                ),
            ],
            out_specs=pl.BlockSpec(
                (None, tk, tn), lambda kb, nb, j, wl_ref: (_field(wl_ref, "OUT", j, L), kb, nb)
            ),
            scratch_shapes=(
                []
                if _tiling.tgmm_sums_in_output(out_dtype)
                else [pltpu.VMEM((tk, tn), jnp.float32)]
            ),
        ),
        compiler_params=_compiler_params(
            ("parallel", "parallel", "arbitrary"),
            _tiling.vmem_limit(t, need, generation),
            lp_scheduler,
            generation,
        ),
        cost_estimate=_cost_estimate(cost),
        interpret=interpret,
        name="ragged_dot_tgmm",
    )
    return call(wl, lhs, dout)
