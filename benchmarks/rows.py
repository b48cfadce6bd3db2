"""Computing the benchmark's rows: for one (kernel, shape, implementation), the closed-form cost
per generation, the traffic counted in TPU interpret mode (small shapes), the deviceless compile
and its scoped VMEM, the compiled schedule's time (schedule_rows.py), and tokamax's published
timings for the same shape. `run_section` makes a table section of such rows; `retime` recomputes
the scheduled times of a section from the schedule cache alone.
"""

from __future__ import annotations

import csv
import math
import re
import time

import registry
import schedule_rows
import shapes as shapes_mod
import validate_schedule  # DATA: where tokamax's published TPU timings live (PTK_REFERENCE_DATA)
from tpu_generations import GENERATIONS, TESTED_GENERATIONS

# -------------------------------------------------------------------------------------------------
# Deviceless compile: does it compile, and how much VMEM does the compiled kernel reserve
# -------------------------------------------------------------------------------------------------

_SCOPED = re.compile(r'"scoped_memory_configs":\[([^\]]*)\]')
_CFG = re.compile(r'"memory_space":"(\d+)","offset":"(\d+)","size":"(\d+)"')
VMEM_SPACE = "1"  # Mosaic's memory space id for VMEM in the compiled custom call's config


def compiled_vmem_bytes(hlo_text: str) -> int | None:
    """Largest scoped VMEM reservation over the Mosaic kernels (tpu_custom_call instructions) in
    a compiled module's HLO text: the kernel's vmem_limit_bytes when it sets one, otherwise what
    the compiler recorded (often nothing: None, i.e. the generation's default scoped limit)."""
    best = None
    for line in hlo_text.splitlines():
        if "tpu_custom_call" not in line:
            continue
        for block in _SCOPED.findall(line):
            total = sum(int(size) for space, _, size in _CFG.findall(block) if space == VMEM_SPACE)
            if total:
                best = max(best or 0, total)
    return best


def compile_info(generation, fn, avals) -> dict:
    import tpu_compile

    if not tpu_compile.libtpu_available():
        return {"compiles": None, "error": "libtpu not installed"}
    import jax

    try:
        # Kernels that ask for the device kind at trace time (ragged_paged_attention does) must
        # see the target TPU, not the CPU host.
        with jax.default_device(tpu_compile.tpu_device(generation)):
            compiled = tpu_compile.compile_for(generation, fn, *avals)
    except Exception as e:  # a kernel that does not compile is a result, not a crash
        msg = str(e).strip().splitlines()
        short = next(
            (line for line in msg if "RESOURCE_EXHAUSTED" in line or "rror" in line),
            msg[0] if msg else type(e).__name__,
        )
        return {"compiles": False, "error": short[:240]}
    return {"compiles": True, "vmem_bytes": compiled_vmem_bytes(compiled.as_text())}


# -------------------------------------------------------------------------------------------------
# Tokamax measured timings on matching shapes
# -------------------------------------------------------------------------------------------------


def _dt(dtype):
    return {"bfloat16": "bf16", "float32": "f32"}[dtype]


_TOKAMAX_GEN = {"tpu_v5_lite": "v5e", "tpu_v6_lite": "v6e", "tpu7x": "tpu7x", "tpu_v5": "v5p"}


def tokamax_ms(kind, shape) -> dict:
    """Best measured ms per generation in tokamax's published TPU autotune data for exactly this
    shape: {"pallas": {gen: ms}, "xla": {gen: ms}} (tokamax's Pallas kernel; the XLA op it is
    compared with: ragged_dot / xla_chunked_dot_product_attention). Forward only."""
    if kind == "ragged_dot":
        path = validate_schedule.DATA / "tokamax_ragged_dot_autotune_derived.csv"
        lhs = f"{_dt(shape.dtype)}[{shape.m},{shape.k}]"
        rhs = f"{_dt(shape.dtype)}[{shape.experts},{shape.k},{shape.n}]"
        match = lambda r: r["kind"] == "fwd" and r["lhs"] == lhs and r["rhs"] == rhs  # noqa: E731
    elif kind == "flash_attention":
        path = validate_schedule.DATA / "tokamax_attention_autotune_derived.csv"
        if shape.window is not None:
            return {}  # the data has no sliding-window shapes

        def match(r):
            return (
                not r["op"].endswith("_vjp")
                and (
                    int(r["B"]),
                    int(r["T"]),
                    int(r["t"]),
                    int(r["Hq"]),
                    int(r["Hkv"]),
                    int(r["D"]),
                )
                == (
                    shape.batch,
                    shape.seq,
                    shape.seq,
                    shape.q_heads,
                    shape.kv_heads,
                    shape.head_dim,
                )
                and r["causal"] == str(shape.causal)
                and (r["soft_cap"] or None)
                == (None if shape.softcap is None else str(shape.softcap))
                and r["residuals"] == "False"
            )
    else:
        return {}
    if not path.exists():
        return {}
    found = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if match(r) and r["gen"] in _TOKAMAX_GEN:
                which = "pallas" if r["op"].startswith("pallas_") else "xla"
                gen = _TOKAMAX_GEN[r["gen"]]
                d = found.setdefault(which, {})
                d[gen] = min(float(r["ms"]), d.get(gen, math.inf))
    return {k: dict(sorted(v.items())) for k, v in sorted(found.items())}


# -------------------------------------------------------------------------------------------------
# Rows
# -------------------------------------------------------------------------------------------------


def sig6(x: float) -> float:
    """x to 6 significant digits, as the results store times."""
    return float(f"{x:.6g}")


def _cost_dict(c) -> dict:
    return {
        "useful_flops": int(c.useful_flops),
        "mxu_flops": int(c.mxu_flops),
        "hbm_bytes": int(c.hbm_bytes),
        "grid_steps": int(c.grid_steps),
    }


def _timing(c, min_bytes, useful, generation) -> dict:
    from tpu_generations import KernelCost

    gen = GENERATIONS[generation]
    modelled = c.modelled_seconds(gen)
    roof = KernelCost(useful, 0, 0, min_bytes, 0).roofline_seconds(gen)
    return {
        "modelled_us": sig6(modelled * 1e6),
        "roofline_us": sig6(roof * 1e6),
        "fraction_of_roofline": sig6(roof / modelled) if modelled else None,
    }


def count_row(fn, args):
    """Run fn(*args) in TPU interpret mode under the traffic counter (tpu_interpreter.py)."""
    import jax

    import tpu_interpreter

    with tpu_interpreter.count_traffic() as t:
        jax.block_until_ready(fn(*args))
    d = t.as_dict()
    d["by_operand"] = {k: list(v) for k, v in sorted(t.by_operand.items())}
    d["dmas"] = {f"{a}->{b}": list(v) for (a, b), v in sorted(t.dmas.items())}
    return d


def retime(section: dict, log, old_rows=None) -> None:
    """Recompute every named row's scheduled entry from the schedule cache (no compile): after
    a change to the time model, or to fill rows of a run made with --no-compile. A row without a
    compile result takes the cached compile's (ours) or the previous results' (anchors, whose
    code did not change)."""
    import ours
    from tpu_generations import KernelCost

    table = {s.name: s for rows in shapes_mod.NAMED.values() for s in rows}
    for r in section["rows"]:
        shape = table.get(r["shape"])
        if shape is None:
            continue
        for g, pg in r["per_generation"].items():
            if "unsupported" in pg:
                continue  # the anchor cannot run the shape there: n/a
            # no compile result yet (or "not in the cache" from a --cache-only run)
            unknown = (pg.get("compile") or {}).get("compiles") is None
            if unknown and r["impl"] != "ours":
                old = _old_compile(old_rows, r["kernel"], r["shape"], r["impl"], g)
                if old:
                    pg["compile"] = old
                    unknown = False
            if unknown:
                cached = schedule_rows.read_schedule(
                    r["kernel"], r["impl"], r["shape"], g, cache_only=True
                )
                if cached and "error" not in cached:
                    pg["compile"] = {"compiles": True, "vmem_bytes": cached.get("vmem_bytes")}
                    if "vmem_bytes" not in cached:
                        pg["compile"]["vmem_read"] = False
            if not (pg.get("compile") or {}).get("compiles"):
                continue
            cost = KernelCost(
                r["useful_flops"],
                pg["mxu_flops"],
                pg["hbm_bytes"],
                r["min_hbm_bytes"],
                pg["grid_steps"],
            )
            info = r["info"]
            if r["impl"] == "ours":
                info = ours.ADAPTERS[r["kernel"]].cost(shape, g)[1]
            elif registry.anchor(r["kernel"], r["impl"]).per_generation:
                info = registry.anchor(r["kernel"], r["impl"]).cost(shape, False, g)[1]
            sched = schedule_rows.schedule_entry(
                r["kernel"], r["impl"], shape, g, cost, info, cache_only=True
            )
            if sched is not None:
                sched.pop("vmem_bytes", None)
                pg["scheduled"] = sched
    log("retimed the named rows from the schedule cache")


def _old_compile(old_rows, kind, shape_name, impl, g):
    """An anchor's compile result from the results being replaced: the anchors' code (the jax
    wheel, benchmarks/anchors.py) did not change, so its compile need not run again."""
    for r in old_rows or ():
        if (r["kernel"], r["shape"], r["impl"]) == (kind, shape_name, impl):
            return r.get("per_generation", {}).get(g, {}).get("compile")
    return None


def _unsupported_row(kind, shape, impl, a, min_bytes, useful, unsupported) -> dict:
    """The row of an anchor that cannot run the shape on any generation: n/a, with the reason."""
    why = "; ".join(sorted(set(unsupported.values())))
    return {
        "kernel": kind,
        "shape": shape.name,
        "impl": impl,
        "label": a.label,
        "method": a.method,
        "useful_flops": int(useful),
        "min_hbm_bytes": int(min_bytes),
        "unsupported": why,
        "source": "n/a",
        "info": {"notes": [f"{shape.name}: n/a: {why}"]},
        "per_generation": {g: {"unsupported": w} for g, w in unsupported.items()},
    }


def build_row(
    kind,
    shape,
    impl,
    small,
    generations,
    do_compile,
    log,
    do_schedule=False,
    old_rows=None,
    ours_generations=None,
    cache_only=False,
):
    """One table row: impl is "anchor" or "ours". `cache_only`: compile nothing; a generation
    whose compiled schedule is not in the cache says n/a."""
    import ours

    min_bytes, useful = registry.problem_minimum(kind, shape)
    unsupported = {}  # generation -> why the anchor cannot run the shape there
    if impl != "ours":
        a = registry.anchor(kind, impl)
        label, method = a.label, a.method
        if a.per_generation:  # its tiles depend on the chip (tokamax's published configs)
            unsupported = {
                g: why for g in TESTED_GENERATIONS if (why := a.unsupported(shape, g)) is not None
            }
            if all(g in unsupported for g in generations):
                return _unsupported_row(kind, shape, impl, a, min_bytes, useful, unsupported)
            per_gen_cost, infos = {}, {}
            for g in generations:
                if g not in unsupported:
                    per_gen_cost[g], infos[g] = a.cost(shape, small, g)
            # the row's own columns: the headline generation's tiles where the anchor runs there
            head = next(g for g in [registry.HEADLINE_GEN, *generations] if g in per_gen_cost)
            cost, info = per_gen_cost[head], infos[head]
            info = dict(
                info,
                tiling_per_generation={g: i.get("tiling") for g, i in infos.items()},
                notes=info.get("notes", [])
                + [f"{shape.name}: n/a on {g}: {why}" for g, why in unsupported.items()],
            )
        else:
            cost, info = a.cost(shape, small)
            per_gen_cost = {g: cost for g in generations}  # its tiling does not depend on the chip
            infos = {g: info for g in generations}
        prefetch_in_estimate = False
    else:
        a = ours.ADAPTERS[kind]
        label, method = (
            a.label,
            "tiling.estimate_cost (checked against the interpreter on small shapes)",
        )
        tiles = a.small_tiles() if small else None
        per_gen_cost, infos = {}, {}
        for g in generations:
            per_gen_cost[g], infos[g] = a.cost(shape, g, tiles)
        cost, info = per_gen_cost[registry.HEADLINE_GEN], infos[registry.HEADLINE_GEN]
        info = dict(info, tiling_per_generation={g: infos[g].get("tiling") for g in generations})
        prefetch_in_estimate = a.prefetch_in_estimate
    row = {
        "kernel": kind,
        "shape": shape.name,
        "impl": impl,
        "label": label,
        "method": method,
        "useful_flops": int(useful),
        "min_hbm_bytes": int(min_bytes),
        "kernel_useful_flops": int(cost.useful_flops),
        "kernel_min_hbm_bytes": int(cost.min_hbm_bytes),
        **_cost_dict(cost),
        "model_vmem_bytes": int(cost.vmem_bytes) or None,
        "info": info,
        "per_generation": {},
    }
    for g in generations:
        if g in unsupported:
            row["per_generation"][g] = {"unsupported": unsupported[g]}
            continue
        c = per_gen_cost[g]
        entry = {**_cost_dict(c), **_timing(c, min_bytes, useful, g)}
        row["per_generation"][g] = entry
    if small:
        interpretable = impl == "ours" or a.interpretable
        if interpretable:
            t0 = time.time()
            fn, args = (
                a.call(shape, small)
                if impl != "ours"
                else a.call(shape, registry.SMALL_GEN, a.small_tiles())
            )
            counted = count_row(fn, args)
            log(f"  counted {kind}/{shape.name}/{impl} in {time.time() - t0:.1f}s")
            compare = counted["hbm_bytes"] + (
                counted["prefetch_bytes"] if prefetch_in_estimate else 0
            )
            model = (
                row["hbm_bytes"]
                if impl == "ours"
                else info.get("kernel_hbm_bytes", row["hbm_bytes"])
            )
            row["counted"] = counted
            row["counted_compare_bytes"] = compare
            row["closed_form_bytes"] = model
            row["closed_form_matches"] = (
                compare == model and counted["grid_steps"] == row["grid_steps"]
            )
            row["source"] = "counted (TPU interpreter)"
        else:
            row["source"] = "closed form (not interpretable)"
            row["closed_form_matches"] = None
    else:
        row["source"] = "closed form"
    if do_compile:
        for g in TESTED_GENERATIONS:
            t0 = time.time()
            pg = row["per_generation"].setdefault(g, {})
            if impl == "ours" and ours_generations and g not in ours_generations:
                continue  # not compiled in this run: the columns say n/a
            if g in unsupported:
                pg["compile"] = {"compiles": None, "unsupported": unsupported[g]}
                continue  # n/a, the reason in the row's notes
            sched = None
            old_ci = _old_compile(old_rows, kind, shape.name, impl, g) if impl != "ours" else None
            if do_schedule:
                # One compile serves both columns: the dump's compile also gives the scoped VMEM.
                c = per_gen_cost.get(g, cost)
                sched = schedule_rows.schedule_entry(
                    kind,
                    impl,
                    shape,
                    g,
                    c,
                    infos.get(g, info),
                    cache_only=cache_only,
                )
            if sched is not None and "error" not in sched and "vmem_bytes" in sched:
                pg["compile"] = {"compiles": True, "vmem_bytes": sched.pop("vmem_bytes")}
            elif sched is not None and "error" not in sched and cache_only:
                # a cached dump from before entries kept the compile's scoped VMEM: it compiled
                pg["compile"] = {"compiles": True, "vmem_bytes": None, "vmem_read": False}
            elif sched is not None and "error" in sched:
                # The dump's compile failed: that is the compile column's answer too.
                pg["compile"] = {"compiles": False, "error": sched["error"]}
            elif old_ci is not None:
                pg["compile"] = old_ci
            elif cache_only:
                pg["compile"] = {"compiles": None}
            else:
                fn, avals = a.compile_args(shape, g)  # an anchor's ignores g unless per chip
                pg["compile"] = compile_info(g, fn, avals)
            log(
                f"  compiled {kind}/{shape.name}/{impl} for {g} in {time.time() - t0:.1f}s: "
                f"{pg['compile']}"
            )
            if sched is not None and pg["compile"].get("compiles"):
                row["per_generation"][g]["scheduled"] = sched
                log(
                    f"  scheduled {kind}/{shape.name}/{impl} for {g} in "
                    f"{time.time() - t0:.1f}s: {sched.get('scheduled_us')} us, hot MXU "
                    f"{sched.get('hot_mxu_occupancy')}, bound {sched.get('bound')}"
                )
    tk = tokamax_ms(kind, shape) if impl == "ours" else {}
    if tk:
        row["tokamax_measured_ms"] = tk
    return row


def run_section(
    small: bool,
    kinds,
    log,
    do_compile: bool,
    do_schedule: bool = False,
    old_rows=None,
    ours_generations=None,
    cache_only: bool = False,
    shape_names=None,
) -> dict:
    """The rows of `kinds` (every shape of the section, or only `shape_names`)."""
    import ours

    table = shapes_mod.SMALL if small else shapes_mod.NAMED
    generations = list(TESTED_GENERATIONS) if not small else [registry.SMALL_GEN]
    rows, missing = [], {}
    for kind in kinds:
        ok, why = ours.ADAPTERS[kind].available()
        if not ok:
            missing[kind] = why
            log(f"{kind}: our kernel not available, its rows are left out ({why})")
        for shape in table[kind]:
            if shape_names and shape.name not in shape_names:
                continue
            for impl in registry.impls(kind, named=not small):
                if impl == "ours" and not ok:
                    continue
                log(f"{kind} {shape.name} {impl}")
                rows.append(
                    build_row(
                        kind,
                        shape,
                        impl,
                        small,
                        generations,
                        do_compile,
                        log,
                        do_schedule and not small,
                        old_rows,
                        ours_generations,
                        cache_only,
                    )
                )
    return {"rows": rows, "missing": missing, "generations": generations}


# -------------------------------------------------------------------------------------------------
# Sections
# -------------------------------------------------------------------------------------------------


def small_section(kinds=registry.KINDS, log=print) -> dict:
    """The small-shape section exactly as `run.py --small` computes it (used by the tests)."""
    return run_section(True, kinds, log, do_compile=False)


def merge_section(old: dict | None, new: dict, kinds, shape_names=None) -> dict:
    """`new` for the kernels just run, `old` rows kept for the others (--kernel runs a subset;
    with `shape_names` only those shapes of `kinds` were run)."""
    if not old or (set(kinds) == set(registry.KINDS) and not shape_names):
        return new

    def key(r):
        return r["kernel"], r["shape"], r["impl"]

    def replaced(r):
        return r["kernel"] in kinds and (not shape_names or r["shape"] in shape_names)

    fresh = {key(r): r for r in new["rows"]}
    if shape_names:  # the shapes' rows replaced where they stood
        rows = [fresh.pop(key(r), r) for r in old["rows"] if key(r) in fresh or not replaced(r)]
        rows += list(fresh.values())
    else:
        rows = [r for r in old["rows"] if not replaced(r)] + new["rows"]
    rows.sort(key=lambda r: (registry.KINDS.index(r["kernel"]),))
    missing = {k: v for k, v in old.get("missing", {}).items() if k not in kinds}
    missing.update(new["missing"])
    return {"rows": rows, "missing": missing, "generations": new["generations"]}


def meta() -> dict:
    """What the results were made with: the jax version, and libtpu's for deviceless compiles."""
    import jax

    import tpu_compile

    m = {"jax": jax.__version__}
    if tpu_compile.libtpu_available():
        infos = sorted(tpu_compile.LIBTPU_DIR.glob("libtpu-*.dist-info"))
        m["libtpu"] = infos[0].name[len("libtpu-") : -len(".dist-info")] if infos else "installed"
    return m
