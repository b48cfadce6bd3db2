"""The compiled schedule of one benchmark row (implementation x named shape x generation).

For each row `schedule_entry` compiles the call deviceless with libtpu's LLO dump on (one
subprocess, llo_schedule.dump_schedule), reads the Mosaic kernel's hot loop (bundles, per-unit
slot occupancy, the unit that bounds it) and the XLA ops around the kernel, and turns the row's
closed-form work (issued MXU FLOPs, grid steps, HBM bytes; the same numbers the rest of the row
shows) into a scheduled time with schedule_model.scheduled_from_work. That needs one number per
implementation: the MXU FLOPs one hot-loop iteration does (`hot_iteration_flops`), which follows
from the implementation's tiling.

Entries are cached in results/schedule_cache.json under a key that includes a hash of the
implementation's source (the files our compiled kernel is built from, or the jax version and
anchors.py for the anchors), so a rerun compiles only what changed. Each entry also records the
fingerprint of the program the compiler was handed (`program_fingerprint`: the lowered module,
Mosaic kernel bodies included, with source locations stripped). When the source key misses, the
row is lowered (seconds) and an entry of the same row with the same fingerprint is reused: an
edit that does not change the compiled program (a comment, a refactor, a tile policy that still
picks the same tiles) costs no compile.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import hashlib
import json
import os
import re
import time
from pathlib import Path

import llo_schedule
import schedule_model
import schedule_targets
from tpu_generations import GENERATIONS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / "results" / "schedule_cache.json"


_RELATIVE_IMPORT = re.compile(r"^\s*from \.(\w*) import ([\w, ()]+)", re.M)


def kernel_sources(kind: str) -> list[Path]:
    """The files the compiled kernel of family `kind` is built from: its kernel.py and every
    module of the family or of torch-ext/ (vendored beside it in a package) that it imports,
    transitively. The ops, the Transformers glue and unrelated torch-ext modules do not change
    the compiled program, so editing them keeps the cache."""
    places = (ROOT / "kernels" / kind, ROOT / "torch-ext")
    todo, seen = [places[0] / "kernel.py"], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, names in _RELATIVE_IMPORT.findall(path.read_text()):
            # `from .x import a` names module x; `from . import a, b` names modules a and b.
            wanted = [module] if module else [n.strip(" ()") for n in names.split(",")]
            for name in wanted:
                todo += [d / f"{name}.py" for d in places if (d / f"{name}.py").exists()]
    return sorted(seen)


def _source_hash(impl: str, kind: str) -> str:
    h = hashlib.sha256()
    if impl == "ours":
        for p in kernel_sources(kind):
            h.update(p.name.encode() + p.read_bytes())
    else:
        import jax

        h.update(jax.__version__.encode())
        h.update((HERE / "anchors.py").read_bytes())
    return h.hexdigest()[:16]


def hot_iteration_flops(
    kind: str, impl: str, shape, generation: str, info: dict, cost=None
) -> float | None:
    """MXU FLOPs of one iteration of the implementation's hot loop (its compute tile)."""
    if impl.startswith("anchor:megablox") or impl == "anchor:tokamax_gmm":
        # one (tm x tk) @ (tk x tn) block per grid step (tokamax: per emit_pipeline step); the
        # tokamax row's info is its generation's own (rows.py passes it per generation)
        tm, tk, tn = info["tiling"]
        return 2.0 * tm * min(tk, shape.k) * min(tn, shape.n)
    if impl == "anchor:splash":
        import anchors

        b = min(anchors.SPLASH_BLOCK, shape.seq)
        return 4.0 * b * b * shape.head_dim
    if impl == "anchor:flash_attention":
        import anchors

        b = min(anchors.FLASH_BLOCK, shape.seq)
        return 4.0 * b * b * shape.head_dim
    if impl.startswith("anchor:ragged_paged_attention"):
        import anchors

        # Its hot loop runs once per KV block a q block visits (all its q heads of one head
        # block against `pages_per_block` pages): the MXU work of one visit.
        hq_blk = anchors.rpa_blocks(shape)[0]
        return (
            4.0
            * info["queries_per_block"]
            * hq_blk
            * info["pages_per_block"]
            * shape.page_size
            * shape.head_dim
        )
    if impl == "ours":
        import ours

        fn = getattr(ours.ADAPTERS[kind], "hot_iteration_flops", None)
        return fn(shape, generation) if fn else None
    return None


def per_tile_runs(kind: str, impl: str, shape, generation: str, info: dict, cost) -> dict:
    """How often the implementation's once-per-output-tile code runs, from its grid or work list
    (schedule_model.scheduled_from_work's `output_tiles`, `last_side_runs`): {} where not
    known, and every region is then charged per grid step.

    - our gmm: grid (N tiles, work items, K tiles); the accumulator is zeroed on the first K tile
      of a row tile's first item and written on the last K tile of its last item: once per
      (row tile, N tile), the work list's FIRST items times the N tiles;
    - megablox / tokamax gmm: grid (N tiles, visits, K tiles); the accumulator is zeroed on each
      visit's first K tile, and the step's `lax.cond` takes its "last K tile" side (which also
      writes the output) on each visit's last K tile: grid steps / K tiles of each;
    - JAX's flash_attention and splash: grid (batch and heads, q blocks, KV blocks); m, l and the
      output accumulator are set up on a q block's first KV block and normalised and written on
      its last: once per (batch, head, q block).
    Our flash and paged kernels are charged through their work lists (`schedule_trips`)."""
    if impl in ("anchor:splash", "anchor:flash_attention"):
        import anchors

        b = min(anchors.SPLASH_BLOCK if impl == "anchor:splash" else anchors.FLASH_BLOCK, shape.seq)
        return {"output_tiles": float(shape.batch * shape.q_heads * -(-shape.seq // b))}
    if kind != "ragged_dot":
        return {}
    if impl.startswith("anchor:megablox") or impl == "anchor:tokamax_gmm":
        tk = info["tiling"][1]
        per_tile = cost.grid_steps / -(-shape.k // tk)
        return {
            "output_tiles": per_tile,
            "last_side_runs": per_tile,
            "step_work": megablox_step_work(shape, info["tiling"]),
        }
    if impl == "ours":
        import numpy as np

        import ours

        T = ours.ADAPTERS[kind].mod.tiling
        tm, _, tn = info["tiling"]
        unit = T.row_unit(shape.dtype)
        wl = T._fields(
            T.work_list(
                np.asarray(shape.group_sizes, np.int32),
                m=shape.m,
                tm=tm,
                buckets=T.bucket_sizes(tm, unit),
                unit=unit,
                kind="gmm",
            )
        )
        firsts = int(((wl["FLAGS"] & T.F_FIRST) != 0).sum())
        return {"output_tiles": float(firsts * -(-shape.n // tn))}
    return {}


def megablox_step_work(shape, tiling) -> dict:
    """schedule_model.scheduled_from_work's `step_work` of the megablox-scheme gmm (megablox's
    and tokamax's kernels) on its visit list: every step multiplies a whole (tm, tk) x (tk, tn)
    block (rows of other groups are masked after), so the steps' compute is the same; their
    copies follow the index maps anchors._gmm_walk prices (anchors.gmm_operands)."""
    import numpy as np

    import anchors
    from blockspec_model import step_copies

    metadata = anchors.gmm_metadata(shape.group_sizes, shape.m, tiling[0])
    reads, writes = step_copies(*anchors.gmm_operands(shape, tiling, metadata))
    ones = np.ones(reads.shape[0])
    return {"hot": ones, "mxu": ones, "reads": reads, "writes": writes}


# A Mosaic kernel travels inside the lowered module as base64 MLIR bytecode in its custom call's
# backend config; that bytecode carries source locations, so it is decoded and printed without
# them before hashing.
_MOSAIC_BODY = re.compile(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22")


def _canonical_mosaic(b64: str) -> str:
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(b64))
        PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        return module.operation.get_asm(enable_debug_info=False)


def program_fingerprint(kind: str, impl: str, shape_name: str, generation: str) -> str:
    """A hash of the program the row hands the compiler for `generation`: the lowered module
    without debug info, each Mosaic kernel body replaced by its location-free text. Equal
    fingerprints compile to the same schedule (same libtpu)."""
    import schedule_targets as targets

    full = f"ours:{kind}" if impl == "ours" else impl
    return lowered_fingerprint(targets.lower_row(generation, full, shape_name))


def lowered_fingerprint(lowered) -> str:
    """`program_fingerprint` of a jax Lowered object."""
    text = lowered.as_text(debug_info=False)
    h = hashlib.sha256()
    h.update(_MOSAIC_BODY.sub(lambda m: _canonical_mosaic(m.group(1)), text).encode())
    return h.hexdigest()[:24]


def _load_cache(path: Path = CACHE) -> dict:
    for _ in range(20):  # another benchmark process may be writing it: retry a torn read
        try:
            return json.loads(path.read_text())
        except OSError:
            return {}
        except ValueError:
            time.sleep(0.5)
    return {}


def _save_cache(cache: dict, path: Path = CACHE, *, merge=lambda old, new: {**old, **new}) -> None:
    """Merge `cache` into the file as it is now (other processes may have added entries) and
    replace it atomically; `merge(entries on file, cache)` gives what is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two writers must not drop each other's entries
        merged = merge(_load_cache(path), cache)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def _row_source(row: str) -> str:
    """The current source hash of a row key (kind, impl, shape, generation)."""
    kind, impl = row.split("|")[:2]
    return _source_hash(impl, kind)


def _current_entries(cache: dict, source_of=_row_source) -> dict:
    """The entries a lookup can still want: per row (a key without its source hash: kind, impl,
    shape, generation here), the entry under the row's current source key (`source_of(row)`)
    when the cache has one (older sources' entries of that row were reused through it or are
    stale), else every entry of the row (their program fingerprints may still match a
    lowering)."""
    rows: dict[str, list[str]] = {}
    for key in cache:
        rows.setdefault(key.rsplit("|", 1)[0], []).append(key)
    source = functools.cache(source_of)
    kept = {}
    for row, keys in rows.items():
        current = f"{row}|{source(row)}"
        kept.update((k, cache[k]) for k in ([current] if current in cache else keys))
    return kept


def prune_cache(path: Path = CACHE, source_of=_row_source) -> tuple[int, int]:
    """Drop the entries a current-source entry of the same row supersedes (`_current_entries`;
    `source_of` for a cache whose keys name rows otherwise, benchmarks/bucket_padding.py's):
    every edit of a kernel's sources adds a key per row, so the file otherwise grows by a copy of
    each row per edit. Returns (entries before, after)."""
    before = len(_load_cache(path))
    _save_cache({}, path, merge=lambda old, _new: _current_entries(old, source_of))
    return before, len(_load_cache(path))


def compiled_summary(kind: str, impl: str, target: str, args: dict, generation: str) -> dict:
    """Compile `target` (module:function of schedule_targets, called with `args`) deviceless
    for `generation` with the LLO dump on and summarise it as a cache entry: the Mosaic
    kernel's bundles, grid step and hot loop, the XLA ops around it, the compiled scoped VMEM,
    and the inputs scheduled_from_work needs (`_model`); {"error": ...} when it does not
    compile."""
    full = f"ours:{kind}" if impl == "ours" else impl
    t0 = time.time()
    import tempfile

    hlo = Path(tempfile.mkdtemp(prefix="hlo-")) / "program.hlo"
    try:
        scheds = llo_schedule.dump_schedule(target, generation, args, name=None, hlo_out=str(hlo))
    except Exception as e:  # a row that does not compile is a result, not a crash
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return {
            "error": next(
                (ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "rror" in ln),
                lines[-1] if lines else type(e).__name__,
            ).strip()[:240]
        }
    mosaic = [s for s in scheds if s.is_mosaic]
    xla = [s for s in scheds if not s.is_mosaic]
    want = schedule_targets.KERNEL_NAMES.get(full)
    named = [s for s in mosaic if want and want in s.name] or mosaic
    kernel = max(named, key=lambda s: len(s.bundles))
    grid, hot = kernel.grid_loop(), kernel.hot_loop()
    entry = {
        "kernel": kernel.name,
        "bundles": len(kernel.bundles),
        "grid_step_bundles": grid.bundles if grid else None,
        "hot": (
            {
                "depth": hot.depth,
                "is_grid_loop": hot is grid,
                **kernel.loop_segment(hot, own=True).as_dict(),
            }
            if hot
            else None
        ),
        "other_mosaic_kernels": [s.name for s in mosaic if s is not kernel],
        "xla_ops": len(xla),
        "xla_bundles": sum(len(s.bundles) for s in xla),
        "xla_hbm_operand_bytes": sum(s.hbm_operand_bytes for s in xla),
        "compile_seconds": round(time.time() - t0, 1),
    }
    if hlo.exists():
        import rows

        entry["vmem_bytes"] = rows.compiled_vmem_bytes(hlo.read_text())
        hlo.unlink()
    # What scheduled_from_work needs of the schedule, so a cached entry can be re-timed
    # when the closed forms change without compiling again.
    ours_kind = kind if impl == "ours" else None
    entry["_model"] = schedule_model.work_model_inputs(
        kernel,
        xla,
        nested_paths=ours_kind in schedule_model.NESTED_PATHS,
        item_loop=ours_kind in schedule_model.ITEM_LOOPS,
    )
    return entry


def read_schedule(
    kind: str,
    impl: str,
    shape_name: str,
    generation: str,
    use_cache: bool = True,
    cache_only: bool = False,
    refresh: bool = False,
) -> dict | None:
    """The compiled schedule's summary for a row: the Mosaic kernel(s) and the XLA ops.
    `cache_only`: None instead of compiling when the cache has no entry. `refresh`: compile even
    when the cache has an entry and replace it (an entry cached before the schedule model read
    something it now needs, e.g. the grid step's predicated regions)."""
    row = f"{kind}|{impl}|{shape_name}|{generation}|"
    key = row + _source_hash(impl, kind)
    cache = _load_cache() if use_cache and not refresh else {}
    if key in cache:
        return cache[key]
    try:
        program = program_fingerprint(kind, impl, shape_name, generation)
    except Exception:  # a row that does not lower is compiled below and fails there
        program = None
    same = [
        e
        for k, e in cache.items()
        if program and k.startswith(row) and e.get("_program") == program
    ]
    if same:  # the sources changed, the program did not
        # prefer an entry whose model holds the grid step's regions (compiled since the model
        # reads them): an older one charges every region per step
        same.sort(key=lambda e: "regions" not in e.get("_model", {}))
        _save_cache({key: same[0]})
        return same[0]
    if cache_only and not refresh:
        return None
    full = f"ours:{kind}" if impl == "ours" else impl
    target, args, _ = schedule_targets.resolve(full, shape_name)
    entry = compiled_summary(kind, impl, target, args, generation)
    entry["_program"] = program
    # A compile that ran out of time says nothing about the program: not cached. Nor does a
    # refresh that failed replace a compiled entry the cache holds for the row.
    replaces_good = refresh and any(
        k.startswith(row) and "error" not in e for k, e in _load_cache().items()
    )
    if (
        (use_cache or refresh)
        and not (replaces_good and "error" in entry)
        and not entry.get("error", "").startswith("Command '")
    ):
        _save_cache({key: entry})
    return entry


def schedule_entry(
    kind: str,
    impl: str,
    shape,
    generation: str,
    cost,
    info: dict,
    use_cache: bool = True,
    cache_only: bool = False,
    summary: dict | None = None,
    tiles=None,
    trips: dict | None = None,
) -> dict | None:
    """The `scheduled` entry of a row's generation: compiled-schedule figures and, where the
    implementation's hot-loop work is known, its scheduled time. `summary` and `tiles`: the
    `compiled_summary` of the row at other tiles than its own, and those tiles (ours); `trips`:
    the call's trip counts where the caller has them (another call than the row's op, as
    tile_sweep.py's gmm variants), in place of the adapter's `schedule_trips`."""
    s = summary or read_schedule(kind, impl, shape.name, generation, use_cache, cache_only)
    if s is None:
        return None
    if "error" in s:
        return {"error": s["error"]}
    out = {k: v for k, v in s.items() if not k.startswith("_")}
    hot = s.get("hot") or {}
    out["hot_mxu_occupancy"] = hot.get("occupancy", {}).get("MXU")
    out["hot_bundles"] = hot.get("bundles")
    if impl == "ours" and trips is None:
        import ours

        fn = getattr(ours.ADAPTERS[kind], "schedule_trips", None)
        trips = fn(shape, generation, tiles) if fn else None
    per_path = trips and (trips.get("branch_runs") or trips.get("branch_pushes"))
    if per_path and len(s["_model"].get("mxu_branches") or ()) != len(per_path):
        # a cache entry from before the model read the step's MXU paths (a program whose step
        # does not split passes no per-path trips: flash with segment ids runs the edge walk
        # only, its trips are hot iterations, ours.FlashAttention.schedule_trips)
        trips = None
    if trips and "loop_trips" in trips:
        # the call's trips, and each grid step's where the kernel gives them (paged: step_work)
        for t in [trips, *(trips.get("step_work") or {}).get("trips", ())]:
            if "step_loops" in s["_model"]:
                # the kernel's loops by name, put on the compiled step's (and grid step's) loops
                t["loop_trips"] = schedule_model.align_loop_trips(
                    s["_model"]["step_loops"], t["loop_trips"]
                )
                if "block_loop_trips" in t:
                    t["block_loop_trips"] = schedule_model.align_loop_trips(
                        s["_model"]["block_loops"], t["block_loop_trips"]
                    )
            else:
                # a cache entry from before the model read the step's rolled loops: each is
                # charged once per step, as the schedule reads it (schedule_rows.py recompiles it)
                t.pop("loop_trips")
                out["loops_read_once_per_step"] = True
    flops = None if trips else hot_iteration_flops(kind, impl, shape, generation, info, cost)
    if (flops or trips) and s["_model"].get("hot_is_grid") is not None:
        t = schedule_model.scheduled_from_work(
            s["_model"],
            mxu_flops=cost.mxu_flops,
            grid_steps=cost.grid_steps,
            hbm_bytes=cost.hbm_bytes,
            flops_per_hot_iteration=flops,
            generation=GENERATIONS[generation],
            **(trips or {}),
            **per_tile_runs(kind, impl, shape, generation, info, cost),
        )
        out.update(t)
        # The unit that bounds the call: DMA, the MXU floor, or the hot loop's fullest unit.
        out["bound"] = hot.get("bound") if t["bound"] == "bundles" else t["bound"]
    else:
        out["scheduled_us"] = None
        out["bound"] = hot.get("bound")
        out["why_no_time"] = "hot-loop work per iteration not modelled for this implementation"
    return out


def main(argv=None) -> None:
    """Recompile rows whose cache entries predate what the schedule model now reads (e.g. the grid
    step's predicated regions) and replace their entries; `run.py --retime` then retimes them."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("kind", nargs="?", help="ragged_dot, flash_attention or paged_attention")
    p.add_argument("shape", nargs="?", help="a named benchmark shape of that family")
    p.add_argument("--impl", nargs="+", default=["ours"], help="ours and/or anchor:NAME")
    p.add_argument("--generation", nargs="+", default=["v5e", "v6e", "tpu7x"])
    p.add_argument(
        "--prune",
        action="store_true",
        help="drop cache entries that current-source entries of their rows supersede "
        "(prune_cache); run it after `run.py` has looked every row up",
    )
    args = p.parse_args(argv)
    if args.prune:
        before, after = prune_cache()
        print(f"schedule cache: {before} -> {after} entries")
    if args.kind is None or args.shape is None:
        if not args.prune:
            p.error("kind and shape are required (or --prune)")
        return
    for gen in args.generation:
        for impl in args.impl:
            t0 = time.time()
            e = read_schedule(args.kind, impl, args.shape, gen, refresh=True)
            got = "regions" in (e or {}).get("_model", {})
            err = f", does not compile: {e['error'][:200]}" if e and "error" in e else ""
            print(
                f"{args.kind} {impl} {args.shape} {gen}: {time.time() - t0:.0f}s, regions {got}{err}"
            )


if __name__ == "__main__":
    main()
