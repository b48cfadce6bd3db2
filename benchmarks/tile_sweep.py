"""Our gmm or flash forward at several tilings of one named shape, timed on a TPU chip beside the
tiling the kernel picks itself: does the schedule-ranked choice hold on the chip?

On a TPU VM, from the repository root with tests/, scripts/, torch-ext/ and benchmarks/ on
PYTHONPATH (as for device_timing.py):

    python benchmarks/tile_sweep.py --shape mixtral_8x7b_down_t16384 \\
        --tiles 1024,2048,2048 --tiles 512,14336,512 --out sweep.json
    python benchmarks/tile_sweep.py --kernel flash_attention --shape flux_dev_joint4608 \\
        --tiles 2048,512,2048,256 --out sweep.json

Tiles: tm,tk,tn for the gmm; block_q,block_q_compute,block_kv,block_kv_compute for the flash
forward (the named row's op, its XLA pads around the kernel included). Every tiling is timed
like a named row (device_timing.time_call); `--interpret` runs a small shape in TPU interpret
mode (the plumbing, on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import shapes as shapes_mod
from device_timing import _device_info, case_record, timed

SMALL = {
    "ragged_dot": shapes_mod.RaggedDotShape("sweep_small", 64, 4, 2, 256, 512),
    "flash_attention": shapes_mod.AttentionShape("sweep_small", 1, 2, 1, 384, 128, causal=False),
}


def _tiles(adapter, kind, values):
    """A Tiles / GmmTiling from the command line's comma-separated values."""
    tiling = adapter.mod.tiling
    if kind == "ragged_dot":
        return tiling.GmmTiling(*values)
    bq, bqc, bk, bkc = values
    return tiling.backward_tiles(bq, bqc, bk, bkc, False)  # forward only: its fields


def _fields(kind, tiles):
    if kind == "ragged_dot":
        return [tiles.tm, tiles.tk, tiles.tn]
    return [tiles.block_q, tiles.q_compute, tiles.block_kv, tiles.block_kv_compute]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", default="ragged_dot", choices=sorted(SMALL))
    p.add_argument("--shape", action="append", required=True, help="named shapes of the kernel")
    p.add_argument("--tiles", action="append", default=[], help="comma-separated (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interpret", action="store_true", help="small shape, TPU interpret mode")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    adapter = ours.ADAPTERS[args.kernel]
    gen = _device_info()["generation"] or "v5e"
    named = {s.name: s for s in shapes_mod.NAMED[args.kernel]}
    chosen = [named[s] for s in args.shape]
    ctx = contextlib.nullcontext()
    if args.interpret:
        from jax.experimental.pallas import tpu as pltpu

        chosen = [SMALL[args.kernel]]
        ctx = pltpu.force_tpu_interpret_mode()
    doc = {"meta": _device_info(), "method": __doc__, "kernel": args.kernel, "rows": []}
    with ctx:
        for shape in chosen:
            pick = adapter.tiles if args.kernel == "ragged_dot" else adapter._tiles
            own = pick(shape, gen)
            tilings = [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles]
            for t in tilings:
                tiles = own if t is None else _tiles(adapter, args.kernel, t)
                rec = {"shape": shape.name, "tiles": _fields(args.kernel, tiles)}
                rec["kernel_choice"] = t is None
                with case_record(doc, rec, args.out, log):
                    fn, fargs = adapter.call(shape, gen, tiles=tiles)
                    rec.update(timed(fn, fargs, target_s=0.0 if args.interpret else 0.2))
    return doc


if __name__ == "__main__":
    main()
