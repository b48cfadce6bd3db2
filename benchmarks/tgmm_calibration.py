"""Re-dump the tgmm points of the tile-ranking calibration from the current kernel.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tgmm_calibration.py [--jobs 2]

For each tile config of `CONFIGS` it compiles tgmm deviceless (the point's own `command`, which
`llo_schedule.py` runs: `schedule_targets.compile_tgmm_tiles`), reads libtpu's final schedule
and rewrites tile_model_calibration.json "tgmm_points" "points": one 'window' point per row
window the kernel holds (its full window of `row_chunk(tm)` rows, then one per tail bucket, in
program order: the grid loop's depth-2 loops; where a window's columns run as a loop of
`window_cols` chunks, the point is that loop's body, one chunk) and one 'step' point (the grid
loop's own bundles). Each point carries the model's numbers as tests/test_ragged_dot_kernel.py
`test_tgmm_window_model_matches_the_dumps` recomputes them; the "how" / "tolerance_note" texts
are left to the person who reads the new errors.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CALIBRATION = HERE / "results" / "tile_model_calibration.json"
SHAPES = {"gate_up": "qwen3_30b_a3b_gate_up_t4096", "down": "qwen3_30b_a3b_down_t4096"}
# (generation, shape, (tm, tk, tn)): five tilings per generation around the ones it picks.
CONFIGS = [
    (gen, SHAPES[proj], tiles)
    for gen in ("v5e", "v6e", "tpu7x")
    for proj, tiles in (
        ("down", (512, 768, 2048)),
        ("gate_up", (1024, 2048, 512)),
        ("gate_up", (256, 1024, 1536)),
        ("gate_up", (512, 2048, 1536)),
        ("gate_up", (512, 512, 1536)),
    )
]


def command(gen: str, shape: str, tiles) -> str:
    args = json.dumps({"shape": shape, "tiles": list(tiles)})
    return (
        "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/llo_schedule.py "
        f"schedule_targets:compile_tgmm_tiles --generation {gen} --args '{args}' "
        "--name ragged_dot_tgmm --json"
    )


def _dump(cfg) -> dict:
    gen, shape, tiles = cfg
    out = subprocess.run(
        command(gen, shape, tiles), shell=True, cwd=HERE.parent, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{cfg}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _windows(schedule: dict) -> tuple[dict, list[dict]]:
    """(the grid loop, the innermost loop of each depth-2 window loop in program order)."""
    loops = schedule["loops"]
    grid = next(lp for lp in loops if lp["depth"] == 1)
    windows = []
    for i, lp in enumerate(loops):
        if lp["depth"] != 2:
            continue
        inner = loops[i + 1] if lp["children"] and i + 1 < len(loops) else None
        windows.append(inner if inner is not None and inner["depth"] == 3 else lp)
    return grid, windows


def points_of(cfg, schedule: dict, T, gens) -> list[dict]:
    gen_name, shape, (tm, tk, tn) = cfg
    unit = T.row_unit("bfloat16", "bfloat16")
    rows_of = [T.row_chunk(tm)] + list(T.bucket_sizes(tm, unit))
    cols = T.window_cols(tk, tn, T.get_generation(gen_name), tm, unit)
    grid, windows = _windows(schedule)
    if len(windows) != len(rows_of):
        raise RuntimeError(f"{cfg}: {len(windows)} window loops for {len(rows_of)} windows")
    common = dict(
        generation=gen_name,
        shape=shape,
        tiles={"tm": tm, "tk": tk, "tn": tn},
        command=command(gen_name, shape, (tm, tk, tn)),
        source="LLO dump (benchmarks/tgmm_calibration.py), jax 0.10.2, libtpu 0.0.42.1, "
        "deviceless; the window loops are the grid loop's depth-2 loops in program order: the "
        "full-window loop, then one 0/1-trip loop per tail bucket (a column-chunk loop inside "
        "each where the window's columns are chunked: the point is one chunk)",
    )
    points = [
        dict(
            kind="window",
            **common,
            rows=rows,
            tk=tk,
            cols=cols,
            loop="full row window (hot loop)" if i == 0 else f"tail bucket of {rows} rows",
            dump_bundles=lp["own"]["bundles"],
            dump_vmatmul=lp["own"]["ops"].get("vmatmul", 0),
            dump_mxu_occupancy=lp["own"]["occupancy"]["MXU"],
            dump_vstore_occupancy=lp["own"]["occupancy"]["VSTORE"],
            dump_bound=lp["own"]["bound"],
        )
        for i, (rows, lp) in enumerate(zip(rows_of, windows))
    ]
    points.append(
        dict(
            kind="step",
            **common,
            dump_bundles=grid["own"]["bundles"],
            loop="the grid loop's own bundles (outside the window loops: an empty group's zero "
            "output block, work-list reads, DMA issue)",
        )
    )
    return [_remodelled(pt, T, gens) for pt in points]


def _remodelled(pt: dict, T, gens) -> dict:
    """A point with the model's fields (re)computed from its dump numbers, as
    tests/test_ragged_dot_kernel.py `test_tgmm_window_model_matches_the_dumps` does: a step
    against step_bundles, a window as max(bundles, MXU floor) on both sides."""
    g = gens.GENERATIONS[pt["generation"]]
    if pt["kind"] == "step":
        vregs = T._tgmm_step_vregs(pt["tiles"]["tk"], pt["tiles"]["tn"], "bfloat16")
        model = gens.step_bundles(g, step_vregs=vregs, grid_steps=1)
        err = model / pt["dump_bundles"] - 1
        return {**pt, "step_vregs": vregs, "model_bundles": round(float(model), 1),
                "model_error": round(err, 4)}  # fmt: skip
    rows, tk, cols = pt["rows"], pt["tk"], pt["cols"]
    u = T.tgmm_window_units(g, rows, tk, cols, "bfloat16", "bfloat16")
    model = float(
        gens.tile_bundles(
            g,
            mxu_pushes=int(u["mxu_pushes"]),
            vmem_loads=int(u["vmem_loads"]),
            vmem_stores=int(u["vmem_stores"]),
        )
    )
    floor = 2 * rows * tk * cols / g.bf16_flops * g.clock_hz
    err = max(model, floor) / max(pt["dump_bundles"], floor) - 1
    return {**pt, "model_pushes": int(u["mxu_pushes"]), "model_bundles": round(model, 1),
            "mxu_floor_cycles": round(floor, 1), "model_error": round(err, 4)}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--recompute",
        action="store_true",
        help="no compiles: recompute the model's numbers of the stored points (after a refit)",
    )
    args = p.parse_args(argv)
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "torch-ext")]
    import importlib

    import ours

    mod = ours.ADAPTERS["ragged_dot"].mod
    T = mod.tiling
    gens = importlib.import_module(f"{mod.__name__}.tpu_generations")
    data = json.loads(CALIBRATION.read_text())
    if args.recompute:
        points = [_remodelled(pt, T, gens) for pt in data["tgmm_points"]["points"]]
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            schedules = list(pool.map(_dump, CONFIGS))
        points = [pt for cfg, s in zip(CONFIGS, schedules) for pt in points_of(cfg, s, T, gens)]
    data["tgmm_points"]["points"] = points
    CALIBRATION.write_text(json.dumps(data, indent=1) + "\n")
    errs = np.array([pt["model_error"] for pt in points if pt["kind"] == "window"])
    steps = np.array([pt["model_error"] for pt in points if pt["kind"] == "step"])
    print(f"{len(points)} points; windows {errs.min():+.1%} .. {errs.max():+.1%}, "
          f"steps {steps.min():+.1%} .. {steps.max():+.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
