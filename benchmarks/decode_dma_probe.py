"""Where a decode gmm's time goes on a TPU chip: the weight stream alone, the stream with a small
matmul per block, and our gmm at several tile sizes, all at the decode shapes of
`shapes.NAMED["ragged_dot"]` (64 tokens, ~4 rows per expert: every grid step streams one
expert's weight block and multiplies a handful of rows by it).

Why: on a TPU v5e chip our decode gmm ran ~2.3 us per grid step above its weight DMA
(Qwen3-30B-A3B gate_up 64 tokens: 10.2 us per 6 MiB block, 7.7 us of DMA at 819 GB/s; down:
6.1 us per 3 MiB block, 3.8 us of DMA), about the step's scheduled compute, as if the compute
did not overlap the next block's DMA; megablox's 128-row tiles ran ~0.5 us per step above it.
The probes separate the stream's own rate per block shape (and per buffer depth) from what the
kernel adds.

On a TPU VM, from the repository root with tests/, scripts/, torch-ext/ and benchmarks/ on
PYTHONPATH (as for device_timing.py):

    python benchmarks/decode_dma_probe.py --out decode_probe.json

`--interpret` runs every probe at a small shape in TPU interpret mode (the plumbing, on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import shapes as shapes_mod
from device_timing import _device_info, case_record, timed
from rows import sig6

SHAPES = ("qwen3_30b_a3b_gate_up_t64", "qwen3_30b_a3b_down_t64")
# Weight blocks (tk, tn) as fractions of (K, N): the whole expert, halves, quarters.
BLOCK_FRACTIONS = ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2))
ROWS = 16  # the matmul probe's rows per block: the tail bucket a ~4-row group runs


def _stream_kernel(shape, bk, bn, rows, matmul, buffers, interpret):
    """A Pallas kernel over grid (experts, K blocks, N blocks) whose only input traffic is the
    weight stream [E, K, N] in (bk, bn) blocks. `matmul`: each step also multiplies `rows` rows
    of x by its block into an f32 VMEM accumulator (a decode step's MXU work); without it the
    body touches one vreg of the block, so the steps are DMA alone."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    e, k, n = shape.experts, shape.k, shape.n
    kt, nt = k // bk, n // bn

    def body(x_ref, w_ref, o_ref, acc_ref):
        first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0) & (pl.program_id(2) == 0)

        @pl.when(first)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        if matmul:
            acc_ref[:, :bn] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)
        else:
            acc_ref[0:8, 0:128] += w_ref[0:8, 0:128].astype(jnp.float32)
        o_ref[...] = acc_ref[0:8, 0:128]

    w_kw = {}
    if buffers != 2:
        w_kw["pipeline_mode"] = pl.Buffered(buffers)
    call = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(e, kt, nt),
        in_specs=[
            pl.BlockSpec((rows, bk), lambda g, kb, nb: (0, kb)),
            pl.BlockSpec((None, bk, bn), lambda g, kb, nb: (g, kb, nb), **w_kw),
        ],
        out_specs=pl.BlockSpec((8, 128), lambda g, kb, nb: (0, 0)),
        scratch_shapes=[pltpu.VMEM((rows, max(bn, 128)), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
            vmem_limit_bytes=100 * 2**20,
        ),
        interpret=interpret,
    )
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (e, k, n), jnp.bfloat16)
    return jax.jit(call), (x, w)


def _ours(shape, tk, tn, interpret):
    import jax
    import jax.numpy as jnp

    import ours

    mod = ours.load("ragged_dot")
    t = mod.tiling.GmmTiling(tm=min(512, shape.m), tk=tk, tn=tn)
    lhs = jax.random.normal(jax.random.key(0), (shape.m, shape.k), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(1), (shape.experts, shape.k, shape.n), jnp.bfloat16)
    gs = jnp.asarray(shape.group_sizes, jnp.int32)

    def fn(lhs, rhs, gs):
        return mod.kernel.gmm(lhs, rhs, gs, tiling=t, interpret=interpret)

    return jax.jit(fn), (lhs, rhs, gs)


def _megablox_large(shape):
    import jax

    import registry

    a = registry.anchor("ragged_dot", "anchor:megablox_large")
    fn, args = a.call(shape, False, _device_info()["generation"])
    return jax.jit(fn), args


def probes(shape, interpret):
    """(name, builder, weight bytes per grid step, grid steps) for every probe of `shape`."""
    k, n, e = shape.k, shape.n, shape.experts
    out = []
    for fk, fn_ in BLOCK_FRACTIONS:
        bk, bn = k // fk, n // fn_
        if k % fk or n % fn_ or bk % 128 or bn % 128:
            continue
        step_bytes, steps = bk * bn * 2, e * fk * fn_
        for buffers in (2, 3):
            out.append(
                (
                    f"stream_{bk}x{bn}_buf{buffers}",
                    lambda bk=bk, bn=bn, b=buffers: _stream_kernel(
                        shape, bk, bn, ROWS, False, b, interpret
                    ),
                    step_bytes,
                    steps,
                )
            )
        out.append(
            (
                f"stream_mxu{ROWS}_{bk}x{bn}",
                lambda bk=bk, bn=bn: _stream_kernel(shape, bk, bn, ROWS, True, 2, interpret),
                step_bytes,
                steps,
            )
        )
        out.append(
            (
                f"ours_tk{bk}_tn{bn}",
                lambda bk=bk, bn=bn: _ours(shape, bk, bn, interpret),
                step_bytes,
                steps,
            )
        )
    if not interpret:
        out.append(("megablox_large", lambda: _megablox_large(shape), None, None))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", action="append", help=f"default: {', '.join(SHAPES)}")
    p.add_argument("--interpret", action="store_true", help="small shapes, TPU interpret mode")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    named = {s.name: s for s in shapes_mod.NAMED["ragged_dot"]}
    chosen = [named[s] for s in (args.shape or SHAPES)]
    ctx = contextlib.nullcontext()
    if args.interpret:  # one small shape: 16 rows over 4 experts, K 256, N 512
        from jax.experimental.pallas import tpu as pltpu

        chosen = [shapes_mod.RaggedDotShape("probe_small", 8, 4, 2, 256, 512)]
        ctx = pltpu.force_tpu_interpret_mode()
    doc = {"meta": _device_info(), "method": __doc__, "rows": []}
    with ctx:
        for shape in chosen:
            for name, build, step_bytes, steps in probes(shape, args.interpret):
                rec = {"shape": shape.name, "probe": name, "step_bytes": step_bytes}
                with case_record(doc, rec, args.out, log):
                    fn, fargs = build()
                    rec.update(timed(fn, fargs, target_s=0.0 if args.interpret else 0.2))
                    us = rec["measured_us"]
                    if steps:
                        rec.update(
                            grid_steps=steps,
                            us_per_step=sig6(us / steps),
                            gb_per_s=sig6(step_bytes * steps / us / 1e3),
                        )
    return doc


if __name__ == "__main__":
    main()
