"""Compile targets and readers for the paged-attention points of the tile-ranking calibration
(benchmarks/results/tile_model_calibration.json, "paged_points").

`compile_paged_tiles` compiles our paged kernel at a named benchmark shape with explicit tiles
(block_q, pages_per_block), for llo_schedule.dump_schedule (tiles choose_config does not pick).
`step_parts` reads what the ranking model is calibrated on from a compiled schedule: the grid
step's alternative compute paths (schedule_model's `mxu_branches`: the narrow decode path and the
whole-q-block path, in program order) with their unit counts, and the step's code outside them.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_dump_targets.py \\
        llama3_8b_decode_b64_ctx8192 64 4 --generation v6e

`--recalibrate` re-dumps every stored point (its own `command`) from the current kernel and
rewrites its dump numbers and the model's; `--recompute` only the model's (after a refit of the
PAGED_* constants). The "how" / "tolerance_note" texts are left to the person who reads the new
errors:

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_dump_targets.py --recalibrate --jobs 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALIBRATION = HERE / "results" / "tile_model_calibration.json"


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
    """One work item of a compiled paged kernel split as the ranking model charges it: `paths`,
    each alternative compute path's bundles and op counts (program order: narrow decode path
    first when one is compiled), and `step_bundles`, the item's static bundles (the body of the
    grid step's loop over its items, the hot loop, as schedule_model.work_model_inputs(
    item_loop=True) reads it: the q block's own code around that loop, run once per grid step,
    is not an item's). A kernel without a narrow path has one path: the whole item's MXU
    region."""
    import schedule_model

    grid = sched.hot_loop()
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


def _redump(point: dict) -> dict:
    """The point's `command` run in a fresh process (libtpu reads its dump flags once)."""
    out = subprocess.run(
        point["command"], shell=True, cwd=HERE.parent, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{point['command']}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def with_dump(point: dict, parts: dict) -> dict:
    """The point's dump numbers from `step_parts` of its compile: its compute path (the first
    path), the narrow path's other form where the point records one (the second), and the step's
    code outside every path."""
    path, *others = parts["paths"]
    other = parts["step_bundles"] - sum(p["bundles"] for p in parts["paths"])
    out = {
        **point,
        "dump_path_bundles": path["bundles"],
        "dump_path_ops": path["ops"],
        "dump_path_bound": path["bound"],
        "dump_path_occupancy": path["occupancy"],
        "dump_step_other_bundles": other,
        "dump_busy_step_bundles": path["bundles"] + other,
    }
    if "dump_narrow_path_bundles" in point:
        out["dump_narrow_path_bundles"] = others[0]["bundles"]
    return out


def remodelled(point: dict, T) -> dict:
    """The point with the model's numbers recomputed from the current constants, as
    tests/test_paged_attention_kernel.py `test_decode_unit_model_within_tolerance_of_paged_dumps`
    recomputes them."""
    gen, pr, tiles = T.GENERATIONS[point["generation"]], point["problem"], point["tiles"]
    m = T.decode_step_bundles(
        gen,
        block_q=tiles["block_q"],
        pages_per_block=tiles["pages_per_block"],
        token_major=point["layout"] == "token_major",
        **pr,
    )
    tile, step = float(m["tile"]), float(m["step"])
    out = {
        **point,
        "model_tile_bundles": round(tile, 1),
        "model_step_bundles": round(step, 1),
        "model_busy_step_bundles": round(tile + step, 1),
        "model_error": round((tile + step) / point["dump_busy_step_bundles"] - 1, 4),
        "tile_error": round(tile / point["dump_path_bundles"] - 1, 4),
        "step_error": round(step / point["dump_step_other_bundles"] - 1, 4),
    }
    if "dump_narrow_path_bundles" in point:
        units = T.item_units(
            gen,
            rows=T.narrow_rows(pr["group"], tiles["block_q"] * pr["group"]),
            kv_tokens=tiles["pages_per_block"] * pr["page_size"],
            num_kv_heads=pr["num_kv_heads"],
            head_dim=pr["head_dim"],
            kv_dtype=pr["kv_dtype"],
            token_major=True,
            token_scales=pr.get("token_scales", pr["kv_dtype"] != "bfloat16"),
            compact=False,
        )
        narrow = float(T._generations.tile_bundles(gen, tiles=1, **units))
        out["model_narrow_tile_bundles"] = round(narrow, 1)
        out["narrow_tile_error"] = round(narrow / point["dump_narrow_path_bundles"] - 1, 4)
    return out


def recalibrate(*, redump: bool, jobs: int = 2) -> list[dict]:
    """Rewrite tile_model_calibration.json "paged_points" "points" (re-dumped with `redump`)."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "torch-ext")]
    import ours

    T = ours.ADAPTERS["paged_attention"].mod.tiling
    data = json.loads(CALIBRATION.read_text())
    points = data["paged_points"]["points"]
    if redump:
        with ThreadPoolExecutor(jobs) as pool:
            points = [with_dump(p, parts) for p, parts in zip(points, pool.map(_redump, points))]
    points = [remodelled(p, T) for p in points]
    data["paged_points"]["points"] = points
    CALIBRATION.write_text(json.dumps(data, indent=1) + "\n")
    return points


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?")
    ap.add_argument("block_q", type=int, nargs="?")
    ap.add_argument("pages_per_block", type=int, nargs="?")
    ap.add_argument("--generation", default="v6e")
    ap.add_argument("--recalibrate", action="store_true", help="re-dump every stored point")
    ap.add_argument("--recompute", action="store_true", help="recompute the model's numbers")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.recalibrate or a.recompute:
        points = recalibrate(redump=a.recalibrate, jobs=a.jobs)
        errs = [p["model_error"] for p in points]
        print(f"{len(points)} points; busy-step error {min(errs):+.1%} .. {max(errs):+.1%}")
        for p in points:
            print(
                f"{p['role']:12} {p['generation']:6} {p['shape']:48} {p['tiles']} "
                f"path {p['dump_path_bundles']} other {p['dump_step_other_bundles']} "
                f"err {p['model_error']:+.1%} (tile {p['tile_error']:+.1%}, "
                f"step {p['step_error']:+.1%})"
            )
        return 0
    if a.shape is None or a.block_q is None or a.pages_per_block is None:
        ap.error("shape, block_q and pages_per_block (or --recalibrate / --recompute)")
    parts = dump_parts(a.shape, (a.block_q, a.pages_per_block), a.generation)
    print(json.dumps(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
