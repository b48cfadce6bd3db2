"""Re-dump the flash points of the tile-ranking calibration
(benchmarks/results/tile_model_calibration.json: "points" for the forward, "bwd_points" for the
backward) after a change to the kernels, and refresh what each point records.

Every point carries the command that dumped it (llo_schedule.py on
schedule_targets:compile_flash_tiles / compile_flash_bwd_tiles, one kernel by op name). This runs
each distinct command once with --json, picks the point's loop from the schedule (`select_loop`:
the innermost loop whose MXU pushes are a whole number of the point's tiles, masked or mask-free
as the point says, the longest such), and rewrites the measured fields (bundles, tiles per loop
body, MXU and VALU occupancy) and the model's figure and error under the constants the code holds
now. Refitting the constants (kernels/flash_attention/tiling.py FWD_* / BWD_*) stays a decision
for the reader of the errors it prints; tests hold every point to the model's tolerance
(test_shared_contract.py the forward's, test_flash_attention_kernel.py the backward's).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/flash_dump_points.py [--pass fwd|dkv|dq|fused] \\
        [--generation v6e] [--shape NAME] [--jobs 2] [--keep DIR] [--write]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CALIBRATION = HERE / "results" / "tile_model_calibration.json"


def select_loop(schedule: dict, point: dict, mxu_pushes: int) -> dict:
    """The measured fields of `point` from one kernel's schedule summary (llo_schedule --json,
    with each innermost loop's MXU branches, `_dump`): among the innermost loops, and the
    branches of a loop that holds both a masked and a mask-free body (the dq pass's group loop
    and the forward's edge walk pick one per group: kernel._groups), whose vmatmul count is a
    positive multiple of the tile's MXU pushes and that select (vsel) exactly when the point is a
    masked one, the one with the most bundles (the edge walk compiles a masked loop on each side
    of the mask-free run; they match). A group loop of two bodies alike, neither selecting, is
    the walk of a call with nothing to mask: a mask-free point reads either body. A forward point
    also names its path: "walk" takes a body of the walk's group loop (or, where the walk has no
    mask-free body, as with segment ids, its one masked loop), "interior" an innermost loop that
    never selects and holds one body (the interior path's q-tile loop)."""
    path = point.get("path")
    found = []
    for loop in schedule["loops"]:
        if loop["children"]:
            continue
        branches = loop.get("branches", [])
        mixed = len({"vsel" in b["ops"] for b in branches}) == 2
        # A group loop whose two bodies issue the same matmuls and neither selects: the walk of
        # a dense bidirectional call, whose masked groups have nothing to mask (kernel.SeqEdges).
        alike = len(branches) == 2 and len({b["ops"].get("vmatmul") for b in branches}) == 1
        walk = mixed or alike
        for seg in branches if walk else [loop["own"]]:
            ops = seg["ops"]
            pushes = ops.get("vmatmul", 0)
            if not pushes or pushes % mxu_pushes or ("vsel" in ops) != bool(point["masked"]):
                continue
            if path is not None and path != ("walk" if walk or "vsel" in ops else "interior"):
                continue
            found.append(seg)
    if not found:
        raise ValueError(
            f"no {'masked' if point['masked'] else 'mask-free'} {path or ''} loop of whole tiles"
        )
    own = max(found, key=lambda x: x["bundles"])
    tiles = own["ops"]["vmatmul"] // mxu_pushes
    label = "masked edge tiles (vsel)" if point["masked"] else "mask-free tiles"
    if path is not None:
        label = f"{path} path, {label}"
    return {
        "hot_loop_bundles": own["bundles"],
        "hot_loop_vmatmul": own["ops"]["vmatmul"],
        "tiles_per_iteration": tiles,
        "dump_bundles_per_tile": round(own["bundles"] / tiles, 1),
        "mxu_occupancy": round(own["occupancy"]["MXU"], 3),
        "valu_occupancy": round(own["occupancy"]["VALU"], 3),
        "loop": label + (f", {tiles} per straight-line group" if tiles > 1 else ""),
    }


def _flash():
    import ours

    return ours.ADAPTERS["flash_attention"].mod


def _point_args(point: dict):
    T = _flash().tiling
    gen = T.get_generation(point["generation"])
    return T, (gen, point["rows"], point["cols"], point["head_dim"])


def tile_mxu_pushes(point: dict) -> int:
    T, args = _point_args(point)
    kw = dict(softcap=point["softcap"])
    if point["pass"] == "fwd":
        return T.fwd_tile_units(*args, **kw)["mxu_pushes"]
    return T.bwd_tile_units(*args, point["pass"], **kw)["mxu_pushes"]


def model_fields(point: dict) -> dict:
    """The model's bundles per tile for the point under the current constants, and its error
    against the dump (what the tests recompute)."""
    T, args = _point_args(point)
    kw = dict(masked=point["masked"], softcap=point["softcap"], two_edges=point["two_edges"])
    if point["pass"] == "fwd":
        fwd = dict(exp_bf16=point["exp_bf16"], fixed_max=point.get("fixed_max", False))
        model = T.fwd_tile_bundles(*args, path=point["path"], **fwd, **kw)
    else:
        model = T.bwd_tile_bundles(*args, point["pass"], **kw)
    return {
        "model_bundles_per_tile": round(model, 1),
        "model_error": round(model / point["dump_bundles_per_tile"] - 1, 4),
    }


def _dump(command: str, keep: Path | None = None) -> dict:
    """The command's schedule summary, each innermost loop with its MXU branches
    (schedule_model._mxu_branches over the loop's regions: the alternatives one iteration runs,
    empty when its MXU work never splits). With `keep`, the summary is read from / written to
    a file there named by the command's hash, so a second pass over the same kernels (another
    loop picked, another fit) compiles nothing."""
    import hashlib
    import tempfile

    cached = None
    if keep is not None:
        cached = keep / (hashlib.sha256(command.encode()).hexdigest()[:16] + ".json")
        if cached.exists():
            return json.loads(cached.read_text())

    import llo_schedule
    import schedule_model

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        argv = shlex.split(command) + ["--json", "--dump-dir", tmp]
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{command} failed:\n{out.stderr[-2000:]}")
        summary = json.loads(out.stdout[out.stdout.index("{") :])
        name = argv[argv.index("--name") + 1]
        sched = llo_schedule.parse_dump(tmp, name)[0]
    loops = sched.all_loops()
    assert len(loops) == len(summary["loops"]), command
    for loop, row in zip(loops, summary["loops"]):
        if loop.children:
            continue
        regions = [r for r in sched.regions(loop) if sched.region_segment(r).mxu_pushes]
        branches = schedule_model._mxu_branches(sched, regions)
        row["branches"] = [sched.region_segment(r).as_dict() for r in branches]
    if cached is not None:
        keep.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(summary))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "dkv", "dq", "fused"))
    ap.add_argument("--generation")
    ap.add_argument("--shape", help="only the points of this named shape")
    ap.add_argument("--write", action="store_true", help="rewrite the calibration file")
    ap.add_argument("--jobs", type=int, default=1, help="dumps compiled at once")
    ap.add_argument("--keep", type=Path, help="a folder keeping each dump's summary (reused)")
    args = ap.parse_args(argv)
    data = json.loads(CALIBRATION.read_text())
    points = [
        p
        for p in data["points"] + data["bwd_points"]
        if (args.pass_ is None or p["pass"] == args.pass_)
        and (args.generation is None or p["generation"] == args.generation)
        and (args.shape is None or p["shape"] == args.shape)
    ]
    commands = list(dict.fromkeys(p["command"] for p in points))
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        # each dump a compile in its own subprocess; the points read them as they finish
        schedules = {c: pool.submit(_dump, c, args.keep) for c in commands}
        _refresh(points, schedules, data if args.write else None)
    return 0


def _refresh(points: list, schedules: dict, data: dict | None) -> None:
    """Each point's measured and model fields from its command's dump; with `data`, the
    calibration file rewritten after every point (a later dump's failure keeps the earlier)."""
    worst = 0.0
    for p in points:
        before = p["dump_bundles_per_tile"]
        p.update(select_loop(schedules[p["command"]].result(), p, tile_mxu_pushes(p)))
        p.update(model_fields(p))
        if not p["role"].startswith("excluded"):
            worst = max(worst, abs(p["model_error"]))
        print(
            f"{p['generation']:6s} {p['pass']:5s} {p['shape'][:28]:28s} {p['rows']}x{p['cols']} "
            f"{'masked' if p['masked'] else 'mask-free':9s} {before} -> "
            f"{p['dump_bundles_per_tile']} per tile, model {p['model_bundles_per_tile']} "
            f"({p['model_error']:+.3f})"
        )
        if data is not None:
            CALIBRATION.write_text(json.dumps(data, indent=1) + "\n")
    print(f"largest model error (calibration and held-out points): {worst:.4f}")


if __name__ == "__main__":
    sys.exit(main())
