"""Compile targets and readers for the paged-attention points of the tile-ranking calibration
(benchmarks/results/tile_model_calibration.json, "paged_points").

`compile_paged_tiles` compiles our paged kernel at a named benchmark shape with explicit tiles
(block_q, pages_per_block), for llo_schedule.dump_schedule (tiles choose_config does not pick).
`step_parts` reads what the ranking model is calibrated on from a compiled schedule: the grid
step's alternative compute paths (schedule_model's `mxu_branches`: the narrow decode path and the
whole-q-block path, in program order) with their unit counts, and the step's code outside them.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_dump_targets.py \\
        llama3_8b_decode_b64_ctx8192 64 4 --generation v6e
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def compile_paged_tiles(generation: str, shape: str, tiles):
    """Compile target for llo_schedule.dump_schedule: our paged kernel at the named benchmark
    shape with tiles (block_q, pages_per_block)."""
    import jax

    import ours
    import schedule_targets
    import tpu_compile

    s = schedule_targets._shape("paged_attention", shape)
    adapter = ours.ADAPTERS["paged_attention"]
    bq, ppb = tiles
    cfg = adapter.mod.tiling.PagedAttentionConfig(block_q=int(bq), pages_per_block=int(ppb))
    fn = adapter._fn(s, generation, cfg)
    avals = adapter._avals(s)
    with jax.default_device(tpu_compile.tpu_device(generation)):
        return tpu_compile.lower_for(generation, fn, *avals).compile()


_COUNTED = ("vmatmul", "vmatprep", "vpow2", "vld", "vst", "vsel", "vcmp")


def step_parts(sched) -> dict:
    """The grid step of a compiled paged kernel split as the ranking model charges it: `paths`,
    each alternative compute path's bundles and op counts (program order: narrow decode path
    first when one is compiled), and `step_bundles`, the whole step's static bundles. A kernel
    without a narrow path has one path: the whole step's MXU region."""
    import schedule_model

    grid = sched.grid_loop()
    regions = [r for r in sched.regions(grid) if sched.region_segment(r).mxu_pushes]
    paths = schedule_model._mxu_branches(sched, regions, nested=True) or regions
    out = []
    for r in paths:
        seg = sched.region_segment(r)
        occ = {u: round(seg.occupancy(u), 3) for u in ("MXU", "VALU", "EUP", "VLOAD", "VSTORE")}
        ops = {k: seg.ops.get(k, 0) for k in _COUNTED}
        out.append({"bundles": r.bundles, "ops": ops, "occupancy": occ, "bound": seg.bound()})
    return {"step_bundles": grid.bundles, "paths": out}


def dump_parts(shape: str, tiles, generation: str) -> dict:
    import llo_schedule

    scheds = llo_schedule.dump_schedule(
        "paged_dump_targets:compile_paged_tiles",
        generation,
        {"shape": shape, "tiles": list(tiles)},
        name="ragged_paged_attention",
    )
    sched = max(scheds, key=lambda s: len(s.bundles))
    return step_parts(sched)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape")
    ap.add_argument("block_q", type=int)
    ap.add_argument("pages_per_block", type=int)
    ap.add_argument("--generation", default="v6e")
    a = ap.parse_args(argv)
    parts = dump_parts(a.shape, (a.block_q, a.pages_per_block), a.generation)
    print(json.dumps(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
