"""Grouped matmul (ragged dot) Pallas TPU kernels: gmm (forward, and dlhs with the other weight
layout) and tgmm (weight gradient).

Schedule. The rows of lhs are grouped contiguously by `group_sizes`. Before the kernel, a few cheap
jnp ops turn group_sizes into a *work list* (tiling.work_list): one item per (row tile, group) pair
that shares rows, in row order, padded with inert items to a static length L = row tiles + groups.
The list is scalar-prefetched into SMEM, so the grid has a static size and the kernel runs
unchanged in both interpret modes and on hardware.

gmm grid = (N tiles, L items, K tiles). The BlockSpec index maps read the item's row tile and
group from SMEM: lhs block (tile, k), rhs block (group, k, n), output block (tile, n). Consecutive
items of one row tile keep the same output block, so it stays in VMEM and is written back once;
consecutive items of one group (and kt == 1) keep the same weight block, so it is not re-fetched.
Each item multiplies only the rows it owns: full chunks of up to 256 rows in a loop, then one tail
window from a small set of bucket sizes (a 20-row group tail runs a 32-row matmul, not a whole
tile). Each window's result is merged into an f32 accumulator with a row select, so rows of other
groups in the same tile stay bit-exactly untouched (a NaN weight of one expert never reaches
another expert's rows). Inside a window the MXU works on (rows, 256)-column chunks of the resident
blocks in loops, so large DMA blocks do not unroll into huge kernels. The first item of a
tile zeroes the accumulator; the last writes the tile out. Rows past sum(group_sizes) belong to a
virtual group whose items do no MXU work and leave zeros. Items without MXU work (virtual rows,
padding) point their lhs/rhs index maps at the block the previous step left resident, so they
issue no DMA. A K tail (K % tk != 0) is zeroed in both operands on the last K block, so garbage
beyond K never meets the MXU. int8 / fp8 weights are converted to the lhs dtype in VMEM and the
per-output-channel scale of the item's group multiplies its accumulator rows after the last K
block.

tgmm grid = (K tiles, N tiles, L items): for each (k, n) output block the items stream the row
tiles of each group; lhs and dout rows outside the item's group are zeroed (both operands) before
the row-contracting matmul; the first item of a group zeroes the accumulator and the last writes
the [tk, tn] block of that group's gradient. Empty groups get one item that writes zeros.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tiling as _tiling
from .tiling import F_COMPUTE, F_FIRST, F_LAST, GMM_FIELDS, GmmTiling, TgmmTiling

__all__ = ["gmm", "tgmm", "QUANTISED_DTYPES"]

QUANTISED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_NF = len(GMM_FIELDS)
_F = {name: i for i, name in enumerate(GMM_FIELDS)}


def _field(wl_ref, name, j, L):
    return wl_ref[_F[name] * L + j]


def _row_mask(start, rows, lo, hi):
    r = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (r >= lo) & (r < hi)


def _run_item(wl_ref, j, L, flags, lo, window, buckets, rc):
    """Run `window` over a computing item's rows: NFULL full chunks of `rc` rows in a loop, then
    the tail in the smallest bucket that covers it. Each row is merged by exactly one window."""
    start = _field(wl_ref, "START", j, L)
    nfull = _field(wl_ref, "NFULL", j, L)
    tstart = _field(wl_ref, "TSTART", j, L)
    bucket = _field(wl_ref, "BUCKET", j, L)
    compute = (flags & F_COMPUTE) != 0

    @pl.when(compute & (nfull > 0))
    def _full_chunks():
        def body(i, carry):
            window(start + i * rc, rc, lo)
            return carry

        jax.lax.fori_loop(0, nfull, body, 0)

    tail_first = jnp.maximum(lo, start + nfull * rc)  # rows before it belong to the full chunks
    for b_idx, rows in enumerate(buckets):
        pl.when(compute & (bucket == b_idx))(functools.partial(window, tstart, rows, tail_first))


# -------------------------------------------------------------------------------------------------
# gmm
# -------------------------------------------------------------------------------------------------


def _chunk(t: int) -> int:
    """Compute chunk along a lane dimension: the MXU works on (rows, chunk) slices of a block in a
    loop, so large DMA blocks do not unroll into huge kernels."""
    for c in (256, 128):
        if t % c == 0:
            return c
    return t


def _gmm_kernel(wl_ref, lhs_ref, rhs_ref, *rest, L, kt, k_size, tk, tn, buckets, unit, rc,
                transpose_rhs, quantised, compute_dtype):
    if quantised:
        scale_ref, out_ref, acc_ref = rest
    else:
        (out_ref, acc_ref), scale_ref = rest, None
    j, kb = pl.program_id(1), pl.program_id(2)
    flags = _field(wl_ref, "FLAGS", j, L)
    lo = _field(wl_ref, "LO", j, L)
    hi = _field(wl_ref, "HI", j, L)
    is_last_k = kb == kt - 1
    ck, cn = _chunk(tk), _chunk(tn)
    k_tail = k_size % tk != 0

    @pl.when(((flags & F_FIRST) != 0) & (kb == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def window(s, rows, first_row):
        """Multiply lhs rows [s, s + rows) and merge the rows in [first_row, HI) into acc."""
        s = pl.multiple_of(s, unit)
        row_ok = _row_mask(s, rows, first_row, hi)

        def n_chunk(c, carry):
            n0 = pl.multiple_of(c * cn, cn)

            def k_chunk(kc, d):
                k0 = pl.multiple_of(kc * ck, ck)
                x = lhs_ref[pl.ds(s, rows), pl.ds(k0, ck)]
                if transpose_rhs:
                    w = rhs_ref[pl.ds(n0, cn), pl.ds(k0, ck)]
                else:
                    w = rhs_ref[pl.ds(k0, ck), pl.ds(n0, cn)]
                if quantised:
                    w = w.astype(compute_dtype)  # exact: int8 and e4m3 values fit in bf16
                if k_tail:
                    # Past K the last K block holds whatever lay beyond the array: zero it in
                    # both operands (0 * NaN would still be NaN).
                    kpos = kb * tk + k0
                    x = jnp.where(kpos + jax.lax.broadcasted_iota(jnp.int32, (1, ck), 1) < k_size,
                                  x, jnp.zeros_like(x))
                    if transpose_rhs:
                        ok = kpos + jax.lax.broadcasted_iota(jnp.int32, (1, ck), 1) < k_size
                    else:
                        ok = kpos + jax.lax.broadcasted_iota(jnp.int32, (ck, 1), 0) < k_size
                    w = jnp.where(ok, w, jnp.zeros_like(w))
                dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
                return d + jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

            d = jax.lax.fori_loop(0, tk // ck, k_chunk, jnp.zeros((rows, cn), jnp.float32))
            cur = acc_ref[pl.ds(s, rows), pl.ds(n0, cn)]
            new = cur + d
            if quantised:
                # Per-output-channel scales of this item's group, applied once to the finished sum.
                scale = scale_ref[:, pl.ds(n0, cn)].astype(jnp.float32)
                new = jnp.where(is_last_k, new * scale, new)
            # A select, not a 0/1 multiply: rows of other groups stay bit-exact even if d is NaN.
            acc_ref[pl.ds(s, rows), pl.ds(n0, cn)] = jnp.where(row_ok, new, cur)
            return carry

        jax.lax.fori_loop(0, tn // cn, n_chunk, 0)

    _run_item(wl_ref, j, L, flags, lo, window, buckets, rc)

    @pl.when(((flags & F_LAST) != 0) & is_last_k)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("transpose_rhs", "out_dtype", "tiling", "interpret", "generation"),
)
def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, scales: Optional[jax.Array] = None,
        *, transpose_rhs: bool = False, out_dtype=None, tiling: Optional[GmmTiling] = None,
        interpret=False, generation: Optional[str] = None) -> jax.Array:
    """out[rows of group g] = lhs[rows of g] @ rhs[g] (rhs[g].T with transpose_rhs).

    lhs [M, K]; rhs [G, K, N] or, with transpose_rhs, [G, N, K]; group_sizes int32 [G] with
    sum <= M (rows past the sum come out zero). int8 / float8_e4m3fn rhs needs `scales` f32 [G, N]
    (per output channel): out = (lhs @ rhs_q[g]) * scales[g]. f32 accumulation; output dtype
    `out_dtype` (default lhs dtype). `tiling`: a GmmTiling (default: tiling.gmm_tiling for
    `generation`). `interpret`: False on TPU, True or pltpu.InterpretParams on CPU.
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    quantised = jnp.dtype(rhs.dtype) in QUANTISED_DTYPES
    if quantised and scales is None:
        raise ValueError(f"gmm: rhs of dtype {rhs.dtype} needs scales f32 [G, N]")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    if k == 0 or num_groups == 0:
        return jnp.zeros((m, n), out_dtype)
    t = tiling or _tiling.gmm_tiling(m, k, n, lhs.dtype, rhs.dtype, out_dtype,
                                     num_groups=num_groups, generation=generation)
    tm, tk, tn = t.tm, t.tk, t.tn
    unit = _tiling.row_unit(lhs.dtype)
    buckets = _tiling.bucket_sizes(tm, unit)
    L = _tiling.work_list_length(m, tm, num_groups)
    kt, nt = pl.cdiv(k, tk), pl.cdiv(n, tn)
    wl = _tiling.work_list(group_sizes.astype(jnp.int32), m=m, tm=tm, buckets=buckets,
                           unit=unit, kind="gmm", xp=jnp)

    def k_of(j, kb, wl_ref):
        # Items without MXU work stay on the last K block: the block the previous step left.
        return jnp.where(_field(wl_ref, "KFIX", j, L) != 0, kt - 1, kb)

    def lhs_map(nb, j, kb, wl_ref):
        return _field(wl_ref, "TILE", j, L), k_of(j, kb, wl_ref)

    if transpose_rhs:
        rhs_spec = pl.BlockSpec(
            (None, tn, tk), lambda nb, j, kb, wl_ref: (_field(wl_ref, "GROUP", j, L), nb,
                                                         k_of(j, kb, wl_ref)))
    else:
        rhs_spec = pl.BlockSpec(
            (None, tk, tn), lambda nb, j, kb, wl_ref: (_field(wl_ref, "GROUP", j, L),
                                                         k_of(j, kb, wl_ref), nb))
    in_specs = [pl.BlockSpec((tm, tk), lhs_map), rhs_spec]
    args = [lhs, rhs]
    if quantised:
        in_specs.append(pl.BlockSpec(
            (None, 1, tn), lambda nb, j, kb, wl_ref: (_field(wl_ref, "GROUP", j, L), 0, nb)))
        args.append(scales.astype(jnp.float32).reshape(num_groups, 1, n))
    out_spec = pl.BlockSpec((tm, tn), lambda nb, j, kb, wl_ref: (_field(wl_ref, "OUT", j, L), nb))

    compute_dtype = lhs.dtype
    need = _tiling.gmm_vmem_bytes(tm, tk, tn, lhs.dtype, rhs.dtype, out_dtype, k=k,
                                  quantised=quantised)
    kernel = functools.partial(
        _gmm_kernel, L=L, kt=kt, k_size=k, tk=tk, tn=tn, buckets=buckets, unit=unit,
        rc=_tiling.row_chunk(tm),
        transpose_rhs=transpose_rhs, quantised=quantised, compute_dtype=compute_dtype)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nt, L, kt),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=_tiling.vmem_limit(t, need, generation),
        ),
        interpret=interpret,
        name="ragged_dot_gmm",
    )
    return call(wl, *args)


# -------------------------------------------------------------------------------------------------
# tgmm
# -------------------------------------------------------------------------------------------------


def _tgmm_kernel(wl_ref, lhs_ref, dout_ref, out_ref, acc_ref, *, L, tk, tn, buckets, unit, rc):
    j = pl.program_id(2)
    flags = _field(wl_ref, "FLAGS", j, L)
    lo = _field(wl_ref, "LO", j, L)
    hi = _field(wl_ref, "HI", j, L)
    ck, cn = _chunk(tk), _chunk(tn)
    nkc, nnc = tk // ck, tn // cn

    def over_chunks(fn):
        def body(idx, carry):
            # lax.div/rem: jnp's floor division lowers through sign(), which Mosaic handles poorly.
            fn(pl.multiple_of(jax.lax.div(idx, nnc) * ck, ck),
               pl.multiple_of(jax.lax.rem(idx, nnc) * cn, cn))
            return carry

        jax.lax.fori_loop(0, nkc * nnc, body, 0)

    @pl.when((flags & F_FIRST) != 0)
    def _zero():
        def zero(k0, n0):
            acc_ref[pl.ds(k0, ck), pl.ds(n0, cn)] = jnp.zeros((ck, cn), jnp.float32)

        over_chunks(zero)

    def window(s, rows, first_row):
        s = pl.multiple_of(s, unit)
        row_ok = _row_mask(s, rows, first_row, hi)

        def accumulate(k0, n0):
            # Rows of other groups are zeroed in both operands: the matmul contracts over rows.
            x = lhs_ref[pl.ds(s, rows), pl.ds(k0, ck)]
            y = dout_ref[pl.ds(s, rows), pl.ds(n0, cn)]
            x = jnp.where(row_ok, x, jnp.zeros_like(x))
            y = jnp.where(row_ok, y, jnp.zeros_like(y))
            acc_ref[pl.ds(k0, ck), pl.ds(n0, cn)] += jax.lax.dot_general(
                x, y, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        over_chunks(accumulate)

    _run_item(wl_ref, j, L, flags, lo, window, buckets, rc)

    @pl.when((flags & F_LAST) != 0)
    def _store():
        def store(k0, n0):
            out_ref[pl.ds(k0, ck), pl.ds(n0, cn)] = (
                acc_ref[pl.ds(k0, ck), pl.ds(n0, cn)].astype(out_ref.dtype))

        over_chunks(store)


@functools.partial(
    jax.jit, static_argnames=("out_dtype", "tiling", "interpret", "generation"))
def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, out_dtype=None, tiling: Optional[TgmmTiling] = None, interpret=False,
         generation: Optional[str] = None) -> jax.Array:
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
    t = tiling or _tiling.tgmm_tiling(m, k, n, lhs.dtype, dout.dtype, out_dtype,
                                      num_groups=num_groups, generation=generation)
    tm, tk, tn = t.tm, t.tk, t.tn
    unit = _tiling.row_unit(lhs.dtype, dout.dtype)
    buckets = _tiling.bucket_sizes(tm, unit)
    L = _tiling.work_list_length(m, tm, num_groups)
    kt, nt = pl.cdiv(k, tk), pl.cdiv(n, tn)
    wl = _tiling.work_list(group_sizes.astype(jnp.int32), m=m, tm=tm, buckets=buckets,
                           unit=unit, kind="tgmm", xp=jnp)
    need = _tiling.tgmm_vmem_bytes(tm, tk, tn, lhs.dtype, dout.dtype, out_dtype)
    call = pl.pallas_call(
        functools.partial(_tgmm_kernel, L=L, tk=tk, tn=tn, buckets=buckets, unit=unit,
                          rc=_tiling.row_chunk(tm)),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(kt, nt, L),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda kb, nb, j, wl_ref: (_field(wl_ref, "TILE", j, L), kb)),
                pl.BlockSpec((tm, tn), lambda kb, nb, j, wl_ref: (_field(wl_ref, "TILE", j, L), nb)),
            ],
            out_specs=pl.BlockSpec(
                (None, tk, tn), lambda kb, nb, j, wl_ref: (_field(wl_ref, "OUT", j, L), kb, nb)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=_tiling.vmem_limit(t, need, generation),
        ),
        interpret=interpret,
        name="ragged_dot_tgmm",
    )
    return call(wl, lhs, dout)
