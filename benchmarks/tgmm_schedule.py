"""The weight gradient (tgmm) over whole calls, by the compiled schedule: ours against megablox's.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tgmm_schedule.py [--generation v5e v6e tpu7x]
        [--shape NAME ...] [--tiles TM,TK,TN ...] [--jobs 2] [--write]

For each named ragged shape at 4096 and 16384 tokens (`TOKENS`; training_timing.py times the
4096-token ones by default, `--tokens 16384` the others) and each generation, it compiles
deviceless with libtpu's LLO dump on (schedule_rows.compiled_summary, one subprocess per compile)
our `kernel.tgmm` at the tiles the tile search picks (and at `--tiles`, to compare tilings) and
megablox's tgmm at the two tilings training_timing.py times it at, and turns each call's
closed-form work into a scheduled time with the same model as the forward rows
(schedule_model.scheduled_from_work):

- ours: the work list's full windows (the hot loop, one iteration per column chunk) and tail
  windows (each charged its own bucket's region) over every (K tile, N tile), the zero-fill of
  an empty group's output block only on that group's items, with DMA and compute overlapped
  grid step by grid step (ours.tgmm_trips; tiling.tgmm_step_work, what the tile ranking's step
  profile reads too); HBM bytes and grid steps from tiling.estimate_cost;
- megablox: one whole (tk, tm) x (tm, tn) block per grid step over its visit list (empty groups
  visited), its copies from its index maps (anchors.tgmm_cost), the accumulator zeroed and
  stored once per run of visits to a group.

Times are scheduled, not measured. Compiles are cached in results/tgmm_schedule_cache.json under
(implementation, shape, generation, tiles, source hash). `--write` stores the rows in
results/tgmm_schedule.json (what the README's tgmm figures quote).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import anchors
import ours
import schedule_model
import schedule_rows
from tpu_generations import GENERATIONS

HERE = Path(__file__).resolve().parent
CACHE = HERE / "results" / "tgmm_schedule_cache.json"
RESULTS = HERE / "results" / "tgmm_schedule.json"
GENS = ("v5e", "v6e", "tpu7x")
# The named ragged shapes' token counts the rows cover: the training passes' (4096, what
# training_timing.py times by default) and the long batches' (16384).
TOKENS = (4096, 16384)


def _shapes(names=None):
    import training_timing

    named = [s for t in TOKENS for s in training_timing._named("ragged_dot", t)]
    return [s for s in named if not names or s.name in names]


def _key(impl: str, shape, gen: str, tiles) -> str:
    source = schedule_rows._source_hash("ours" if impl == "ours" else impl, "ragged_dot")
    return f"{impl}|{shape.name}|{gen}|{'x'.join(map(str, tiles))}|{source}"


_LOWERING = threading.Lock()


def compiled(impl: str, shape, gen: str, tiles, key: str | None = None) -> dict:
    """The compiled summary of the call, cached under its source key; on a miss, an entry of
    the same call whose lowered program has the same fingerprint (schedule_rows'
    rule: an edit that leaves the program alone costs no compile)."""
    import schedule_targets

    key = key or _key(impl, shape, gen, tiles)
    cache = schedule_rows._load_cache(CACHE)
    if key in cache and _current(impl, cache[key]):
        return cache[key]
    name = "tgmm_tiles" if impl == "ours" else "megablox_tgmm"
    with _LOWERING:  # the first lowering per process sets up the TPU topology: not thread-safe
        lowered = getattr(schedule_targets, f"lower_{name}")(gen, shape.name, list(tiles))
    program = schedule_rows.lowered_fingerprint(lowered)
    call = key.rsplit("|", 1)[0] + "|"
    same = [
        e
        for k, e in cache.items()
        if k.startswith(call) and e.get("_program") == program and _current(impl, e)
    ]
    if same:
        schedule_rows._save_cache({key: same[0]}, CACHE)
        return same[0]
    entry = schedule_rows.compiled_summary(
        "ragged_dot",
        impl,
        f"schedule_targets:compile_{name}",
        {"shape": shape.name, "tiles": list(tiles)},
        gen,
    )
    entry["_program"] = program
    if not entry.get("error", "").startswith("Command '"):  # a timeout says nothing: not cached
        schedule_rows._save_cache({key: entry}, CACHE)
    return entry


def _current(impl: str, entry: dict) -> bool:
    """Whether a cached compile holds what its row reads: ours charges each tail window its
    bucket's region (`side_region_bundles`, recorded since 2026-12-06); a model read before
    that is compiled again."""
    model = entry.get("_model")
    return impl != "ours" or model is None or "side_region_bundles" in model


def _ours_work(shape, gen: str, tiles) -> tuple:
    mod = ours.ADAPTERS["ragged_dot"].mod
    T = mod.tiling
    t = T.TgmmTiling(*tiles)
    cost = T.estimate_cost(
        "tgmm",
        (shape.m, shape.k),
        (shape.m, shape.n),
        shape.group_sizes,
        lhs_dtype=shape.dtype,
        rhs_dtype=shape.dtype,
        out_dtype=shape.dtype,
        tiling=t,
        generation=gen,
    )
    trips = ours.tgmm_trips(mod, shape.group_sizes, shape.m, shape.k, shape.n, shape.dtype, t, gen)
    return cost, trips


def _megablox_work(shape, tiles) -> tuple:
    from blockspec_model import step_copies

    metadata = anchors.tgmm_metadata(shape.group_sizes, shape.m, tiles[0])
    cost, info = anchors.tgmm_cost(shape, tuple(tiles), metadata=metadata)
    reads, writes = step_copies(*anchors.tgmm_operands(shape, tuple(tiles), metadata))
    ones = np.ones(reads.shape[0])
    tm, tk, tn = tiles
    return cost, {
        "flops_per_hot_iteration": 2.0 * tm * tk * tn,
        "output_tiles": float(info["group_runs"]),
        "step_work": {"hot": ones, "mxu": ones, "reads": reads, "writes": writes},
    }


def row(impl: str, shape, gen: str, tiles, entry: dict | None = None) -> dict:
    """One scheduled row: the call's scheduled time and what bounds it, the hot loop's bundles
    and MXU occupancy, the call's bytes and grid steps. `entry`: its compiled summary (default:
    `compiled`, which may compile)."""
    key = _key(impl, shape, gen, tiles)
    entry = entry or compiled(impl, shape, gen, tiles, key)
    out = {
        "impl": impl,
        "shape": shape.name,
        "generation": gen,
        "tiles": list(tiles),
        "cache_key": key,
    }
    if "error" in entry:
        return {**out, "error": entry["error"]}
    cost, trips = _ours_work(shape, gen, tiles) if impl == "ours" else _megablox_work(shape, tiles)
    t = schedule_model.scheduled_from_work(
        entry["_model"],
        mxu_flops=cost.mxu_flops,
        grid_steps=cost.grid_steps,
        hbm_bytes=cost.hbm_bytes,
        generation=GENERATIONS[gen],
        **trips,
    )
    hot = entry.get("hot") or {}
    return {
        **out,
        "scheduled_us": round(t["scheduled_us"], 1),
        "bound": hot.get("bound") if t["bound"] == "bundles" else t["bound"],
        "hot_bundles": hot.get("bundles"),
        "hot_mxu_occupancy": hot.get("occupancy", {}).get("MXU"),
        "hbm_bytes": int(cost.hbm_bytes),
        "grid_steps": int(cost.grid_steps),
        "vmem_bytes": entry.get("vmem_bytes"),
    }


def default_tiles(shape, gen: str) -> tuple:
    T = ours.ADAPTERS["ragged_dot"].mod.tiling
    t = T.tgmm_tiling(
        shape.m, shape.k, shape.n, shape.dtype, shape.dtype, shape.dtype,
        num_groups=shape.experts, generation=gen,
    )  # fmt: skip
    return (t.tm, t.tk, t.tn)


def cases(shapes, gens, extra_tiles=()) -> list[tuple]:
    import training_timing

    out = []
    for s in shapes:
        for g in gens:
            out.append(("ours", s, g, default_tiles(s, g)))
            out += [("ours", s, g, tuple(t)) for t in extra_tiles]
            for impl, t in training_timing._megablox_tilings(s, "tgmm").items():
                out.append((impl, s, g, tuple(t)))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generation", nargs="+", default=list(GENS))
    p.add_argument("--shape", nargs="+", default=None)
    p.add_argument("--tiles", nargs="+", default=[], help="more tilings of ours: TM,TK,TN")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--write", action="store_true", help=f"store the rows in {RESULTS.name}")
    args = p.parse_args(argv)
    if args.write and (args.shape or args.tiles or set(args.generation) != set(GENS)):
        p.error("--write stores the full set of rows: no --shape, --tiles or --generation")
    extra = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    todo = cases(_shapes(args.shape), args.generation, extra)
    t0 = time.time()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # compiles run in subprocesses
        rows = list(pool.map(lambda c: row(*c), todo))
    for r in rows:
        if "error" in r:
            print(
                f"{r['shape']:32s} {r['generation']:6s} {r['impl']:24s} {r['tiles']}: {r['error']}"
            )
            continue
        print(
            f"{r['shape']:32s} {r['generation']:6s} {r['impl']:24s} {str(r['tiles']):20s} "
            f"{r['scheduled_us']:9.1f} us ({r['bound']}) hot {r['hot_bundles']} bundles, "
            f"MXU {r['hot_mxu_occupancy']}"
        )
    print(f"{len(rows)} rows, {time.time() - t0:.0f} s")
    if args.write:
        RESULTS.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        # the cache keeps what the rows were scheduled from (tests/test_benchmarks.py retimes
        # them), not every source edit's copy
        keep = {r["cache_key"] for r in rows}
        schedule_rows._save_cache(
            {}, CACHE, merge=lambda old, _new: {k: e for k, e in old.items() if k in keep}
        )


if __name__ == "__main__":
    main()
