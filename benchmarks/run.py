"""Kernel microbenchmarks: HBM traffic, grid steps, MXU work, VMEM and modelled time per TPU
generation, for our kernels and the JAX anchors on the same shapes.

    python benchmarks/run.py                 # named (real-model) shapes + small shapes; writes
                                             # benchmarks/results/{results.md,results.json,*.png}
    python benchmarks/run.py --small         # recompute only the small-shape section (fast)
    python benchmarks/run.py --device tpu    # on a TPU VM: also measure times on the chip
    python benchmarks/run.py --no-write      # print the Markdown table only

Small shapes run in TPU interpret mode under the DMA counter (benchmarks/dma_counter.py): the
bytes and grid steps in that section are counted, and each row records whether the closed form
(our kernels' `tiling.estimate_cost`, the anchors' schedules in benchmarks/anchors.py) gives
exactly the same numbers. Named shapes are too large to interpret on CPU: their bytes and steps
come from those closed forms, checked on the small shapes. VMEM comes from a deviceless Mosaic
compile for v5e, v6e and TPU7x (the scoped VMEM the compiled kernel reserves), when libtpu is
installed (`.libtpu`, see tests/tpu_compile.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (HERE, ROOT / "tests", ROOT / "torch-ext"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import anchors  # noqa: E402
import schedule_rows  # noqa: E402
import shapes as shapes_mod  # noqa: E402
from tpu_generations import GENERATIONS, TESTED_GENERATIONS  # noqa: E402

RESULTS = HERE / "results"
TOKAMAX = ROOT.parent / "shared" / "reference" / "data"
KINDS = ("ragged_dot", "flash_attention", "paged_attention")
HEADLINE_GEN = "v6e"  # the generation whose tiling the headline bytes/steps columns show
SMALL_GEN = "v6e"
SMALL_GMM_TILING = (16, 128, 128)  # megablox tiling for the small shapes (rows must divide tm)

# -------------------------------------------------------------------------------------------------
# The anchors, described uniformly
# -------------------------------------------------------------------------------------------------


class _Anchor:
    """One anchor configuration. `tiling(shape, small)` (ragged dot only) picks its tiles."""

    def __init__(self, kind, impl, label, cost, call, compile_args, interpretable, method,
                 tiling=None):
        self.kind, self.impl, self.label, self._cost, self._call = kind, impl, label, cost, call
        self._compile_args, self.interpretable, self.method = compile_args, interpretable, method
        self._tiling = tiling

    def _args(self, shape, small):
        return (self._tiling(shape, small),) if self._tiling else ()

    def cost(self, shape, small):
        c, d = self._cost(shape, *self._args(shape, small))
        info = {"notes": d.get("notes", [])}
        info.update({k: v for k, v in d.items() if k != "notes"})
        if self._tiling:
            t = self._tiling(shape, small)
            info["tiling"] = list(t) if isinstance(t, tuple) else t
        return c, info

    def call(self, shape, small):
        return self._call(shape, *self._args(shape, small))

    def compile_args(self, shape):
        return self._compile_args(shape, *self._args(shape, False))


_GMM_METHOD = ("closed form over its own make_group_metadata visit list (its traced grid does not "
               "interpret under jit; checked against the interpreter without the jit on small "
               "shapes)")
_RPA_METHOD = ("closed form from its schedule only: it does not run in TPU interpret mode "
               "(jax 0.10.2)")
ANCHORS = {
    "ragged_dot": [
        _Anchor("ragged_dot", "anchor:megablox_default", "jax megablox gmm (default 128^3 tiles)",
                anchors.gmm_cost, anchors.gmm_call, anchors.gmm_compile_args, True, _GMM_METHOD,
                tiling=lambda s, small: SMALL_GMM_TILING if small else anchors.GMM_TILING),
        _Anchor("ragged_dot", "anchor:megablox_large", "jax megablox gmm (128 x <=2048 x <=1024 tiles)",
                anchors.gmm_cost, anchors.gmm_call, anchors.gmm_compile_args, True, _GMM_METHOD,
                tiling=lambda s, small: (SMALL_GMM_TILING[0], s.k, s.n) if small
                else anchors.gmm_large_tiling(s)),
    ],
    "flash_attention": [
        _Anchor("flash_attention", "anchor:flash_attention", "jax flash_attention (128 blocks)",
                anchors.flash_cost, anchors.flash_call, anchors.flash_compile_args, True,
                "closed form from its index maps (checked against the interpreter on small "
                "shapes)"),
        _Anchor("flash_attention", "anchor:splash", "jax splash attention (512 blocks)",
                anchors.splash_cost, anchors.splash_call, anchors.splash_compile_args, True,
                "closed form from its own mask info (data_next / block_mask) and index maps, "
                "checked against the interpreter on small shapes (128 blocks there)",
                tiling=lambda s, small: 128 if small else anchors.SPLASH_BLOCK),
    ],
    "paged_attention": [
        _Anchor("paged_attention", "anchor:ragged_paged_attention",
                "jax ragged_paged_attention (its default / v6e-tuned blocks)", anchors.rpa_cost,
                anchors.rpa_call, anchors.rpa_compile_args, False, _RPA_METHOD),
        _Anchor("paged_attention", "anchor:ragged_paged_attention_fit",
                "jax ragged_paged_attention (KV blocks of <= 4 MiB)", anchors.rpa_cost,
                anchors.rpa_call, anchors.rpa_compile_args, False, _RPA_METHOD,
                tiling=lambda s, small: anchors.rpa_fit_pages(s)),
    ],
}


def _anchor(kind, impl):
    return next(a for a in ANCHORS[kind] if a.impl == impl)


def problem_minimum(kind, shape):
    """The problem's own minimum bytes and useful FLOPs, the same for every implementation."""
    if kind == "ragged_dot":
        return anchors.gmm_min_bytes(shape), anchors.gmm_useful_flops(shape)
    if kind == "flash_attention":
        return anchors.attention_min_bytes(shape), anchors.attention_useful_flops(shape)
    return anchors.paged_min_bytes(shape), anchors.paged_useful_flops(shape)


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
            total = sum(int(size) for space, _, size in _CFG.findall(block)
                        if space == VMEM_SPACE)
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
        short = next((line for line in msg if "RESOURCE_EXHAUSTED" in line or "rror" in line),
                     msg[0] if msg else type(e).__name__)
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
        path = TOKAMAX / "tokamax_ragged_dot_autotune_derived.csv"
        lhs = f"{_dt(shape.dtype)}[{shape.m},{shape.k}]"
        rhs = f"{_dt(shape.dtype)}[{shape.experts},{shape.k},{shape.n}]"
        match = lambda r: r["kind"] == "fwd" and r["lhs"] == lhs and r["rhs"] == rhs  # noqa: E731
    elif kind == "flash_attention":
        path = TOKAMAX / "tokamax_attention_autotune_derived.csv"
        if shape.window is not None:
            return {}  # the data has no sliding-window shapes

        def match(r):
            return (not r["op"].endswith("_vjp")
                    and (int(r["B"]), int(r["T"]), int(r["t"]), int(r["Hq"]), int(r["Hkv"]),
                         int(r["D"])) == (shape.batch, shape.seq, shape.seq, shape.q_heads,
                                          shape.kv_heads, shape.head_dim)
                    and r["causal"] == str(shape.causal)
                    and (r["soft_cap"] or None) == (None if shape.softcap is None else
                                                    str(shape.softcap))
                    and r["residuals"] == "False")
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


def _g(x: float) -> float:
    return float(f"{x:.6g}")


def _cost_dict(c) -> dict:
    return {"useful_flops": int(c.useful_flops), "mxu_flops": int(c.mxu_flops),
            "hbm_bytes": int(c.hbm_bytes), "grid_steps": int(c.grid_steps)}


def _timing(c, min_bytes, useful, generation) -> dict:
    from tpu_generations import KernelCost

    gen = GENERATIONS[generation]
    modelled = c.modelled_seconds(gen)
    roof = KernelCost(useful, 0, 0, min_bytes, 0).roofline_seconds(gen)
    return {"modelled_us": _g(modelled * 1e6), "roofline_us": _g(roof * 1e6),
            "fraction_of_roofline": _g(roof / modelled) if modelled else None}


def count_row(fn, args):
    """Run fn(*args) in TPU interpret mode under the DMA counter."""
    import jax
    import dma_counter

    with dma_counter.count_traffic() as t:
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
            if not pg.get("compile") and r["impl"] != "ours":
                old = _old_compile(old_rows, r["kernel"], r["shape"], r["impl"], g)
                if old:
                    pg["compile"] = old
            if not pg.get("compile") and r["impl"] == "ours":
                cached = schedule_rows.read_schedule(r["kernel"], "ours", r["shape"], g,
                                                     cache_only=True)
                if cached and "error" not in cached and "vmem_bytes" in cached:
                    pg["compile"] = {"compiles": True, "vmem_bytes": cached["vmem_bytes"]}
            if not (pg.get("compile") or {}).get("compiles"):
                continue
            cost = KernelCost(r["useful_flops"], pg["mxu_flops"], pg["hbm_bytes"],
                              r["min_hbm_bytes"], pg["grid_steps"])
            info = r["info"]
            if r["impl"] == "ours":
                info = ours.ADAPTERS[r["kernel"]].cost(shape, g)[1]
            sched = schedule_rows.schedule_entry(r["kernel"], r["impl"], shape, g, cost, info,
                                                 cache_only=True)
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


def build_row(kind, shape, impl, small, generations, do_compile, log, do_schedule=False,
              old_rows=None, ours_generations=None):
    """One table row: impl is "anchor" or "ours"."""
    import ours

    min_bytes, useful = problem_minimum(kind, shape)
    if impl != "ours":
        a = _anchor(kind, impl)
        label, method = a.label, a.method
        cost, info = a.cost(shape, small)
        per_gen_cost = {g: cost for g in generations}  # its tiling does not depend on the chip
        prefetch_in_estimate = False
    else:
        a = ours.ADAPTERS[kind]
        label, method = a.label, "tiling.estimate_cost (checked against the interpreter on small shapes)"
        tiles = a.small_tiles() if small else None
        per_gen_cost, infos = {}, {}
        for g in generations:
            per_gen_cost[g], infos[g] = a.cost(shape, g, tiles)
        cost, info = per_gen_cost[HEADLINE_GEN], infos[HEADLINE_GEN]
        info = dict(info, tiling_per_generation={g: infos[g].get("tiling") for g in generations})
        prefetch_in_estimate = a.prefetch_in_estimate
    row = {
        "kernel": kind, "shape": shape.name, "impl": impl, "label": label, "method": method,
        "useful_flops": int(useful), "min_hbm_bytes": int(min_bytes),
        "kernel_useful_flops": int(cost.useful_flops),
        "kernel_min_hbm_bytes": int(cost.min_hbm_bytes),
        **_cost_dict(cost), "model_vmem_bytes": int(cost.vmem_bytes) or None,
        "info": info, "per_generation": {},
    }
    for g in generations:
        c = per_gen_cost[g]
        entry = {**_cost_dict(c), **_timing(c, min_bytes, useful, g)}
        row["per_generation"][g] = entry
    if small:
        interpretable = impl == "ours" or a.interpretable
        if interpretable:
            t0 = time.time()
            fn, args = (a.call(shape, small) if impl != "ours"
                        else a.call(shape, SMALL_GEN, a.small_tiles()))
            counted = count_row(fn, args)
            log(f"  counted {kind}/{shape.name}/{impl} in {time.time() - t0:.1f}s")
            compare = counted["hbm_bytes"] + (counted["prefetch_bytes"] if prefetch_in_estimate else 0)
            model = row["hbm_bytes"] if impl == "ours" else info.get("kernel_hbm_bytes",
                                                                         row["hbm_bytes"])
            row["counted"] = counted
            row["counted_compare_bytes"] = compare
            row["closed_form_bytes"] = model
            row["closed_form_matches"] = (compare == model
                                          and counted["grid_steps"] == row["grid_steps"])
            row["source"] = "counted (TPU interpreter)"
        else:
            row["source"] = "closed form (not interpretable)"
            row["closed_form_matches"] = None
    else:
        row["source"] = "closed form"
    if do_compile:
        fn_avals = (a.compile_args(shape) if impl != "ours" else None)
        for g in TESTED_GENERATIONS:
            t0 = time.time()
            pg = row["per_generation"].setdefault(g, {})
            if impl == "ours" and ours_generations and g not in ours_generations:
                continue  # not compiled in this run: the columns say n/a
            sched = None
            old_ci = _old_compile(old_rows, kind, shape.name, impl, g) if impl != "ours" else None
            if do_schedule:
                # One compile serves both columns: the dump's compile also gives the scoped VMEM.
                c = per_gen_cost.get(g, cost)
                sched = schedule_rows.schedule_entry(kind, impl, shape, g, c,
                                                     infos[g] if impl == "ours" else info)
            if sched is not None and "error" not in sched and "vmem_bytes" in sched:
                pg["compile"] = {"compiles": True, "vmem_bytes": sched.pop("vmem_bytes")}
            elif sched is not None and "error" in sched:
                # The dump's compile failed: that is the compile column's answer too.
                pg["compile"] = {"compiles": False, "error": sched["error"]}
            elif old_ci is not None:
                pg["compile"] = old_ci
            else:
                fn, avals = fn_avals if impl != "ours" else a.compile_args(shape, g)
                pg["compile"] = compile_info(g, fn, avals)
            log(f"  compiled {kind}/{shape.name}/{impl} for {g} in {time.time() - t0:.1f}s: "
                f"{pg['compile']}")
            if sched is not None and pg["compile"].get("compiles"):
                row["per_generation"][g]["scheduled"] = sched
                log(f"  scheduled {kind}/{shape.name}/{impl} for {g} in "
                    f"{time.time() - t0:.1f}s: {sched.get('scheduled_us')} us, hot MXU "
                    f"{sched.get('hot_mxu_occupancy')}, bound {sched.get('bound')}")
    tk = tokamax_ms(kind, shape) if impl == "ours" else {}
    if tk:
        row["tokamax_measured_ms"] = tk
    return row


def run_section(small: bool, kinds, log, do_compile: bool, do_schedule: bool = False,
                old_rows=None, ours_generations=None) -> dict:
    import ours

    table = shapes_mod.SMALL if small else shapes_mod.NAMED
    generations = list(TESTED_GENERATIONS) if not small else [SMALL_GEN]
    rows, missing = [], {}
    for kind in kinds:
        ok, why = ours.ADAPTERS[kind].available()
        if not ok:
            missing[kind] = why
            log(f"{kind}: our kernel not available, its rows are left out ({why})")
        for shape in table[kind]:
            for impl in [a.impl for a in ANCHORS[kind]] + ["ours"]:
                if impl == "ours" and not ok:
                    continue
                log(f"{kind} {shape.name} {impl}")
                rows.append(build_row(kind, shape, impl, small, generations, do_compile, log,
                                      do_schedule and not small, old_rows, ours_generations))
    return {"rows": rows, "missing": missing, "generations": generations}


# -------------------------------------------------------------------------------------------------
# Device timing (--device tpu)
# -------------------------------------------------------------------------------------------------


def measure_on_device(section: dict, kinds, log, iters: int = 20, warmup: int = 3,
                      device=None, generation: str | None = None, small: bool = False) -> None:
    """Time every row of a section on the attached TPU with the JAX TPU backend (median of
    `iters` runs after `warmup` calls, each synchronised with block_until_ready). `device` and
    `generation` default to the first TPU and its generation (the tests pass the CPU)."""
    import jax
    import numpy as np
    import ours
    from tpu_generations import detect_generation

    gen = generation or detect_generation()
    if gen is None:
        raise SystemExit("--device tpu: no TPU visible to JAX (jax.devices('tpu') failed)")
    device = device or jax.devices("tpu")[0]
    table = {s.name: s for k in kinds for s in (shapes_mod.SMALL if small else shapes_mod.NAMED)[k]}
    for row in section["rows"]:
        if row["kernel"] not in kinds:
            continue
        shape = table[row["shape"]]
        kind = row["kernel"]
        if row["impl"] != "ours":
            a = _anchor(kind, row["impl"])
            fn, _ = a.compile_args(shape)
            _, args = a.call(shape, small)
        else:
            a = ours.ADAPTERS[kind]
            fn, _ = a.compile_args(shape, gen)
            _, args = a.call(shape, gen)
        args = jax.device_put(args, device)
        f = jax.jit(fn)
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        pg = row["per_generation"].setdefault(gen, {})
        roof = pg.get("roofline_us")
        pg["measured_us"] = _g(med * 1e6)
        if roof:
            pg["measured_fraction_of_roofline"] = _g(roof / (med * 1e6))
        log(f"  {kind}/{shape.name}/{row['impl']} on {gen}: {med * 1e6:.1f} us")


# -------------------------------------------------------------------------------------------------
# Output: Markdown, JSON, plots
# -------------------------------------------------------------------------------------------------


def _sig(x, n=4):
    return "-" if x is None else f"{x:.{n}g}"


def _fmt_int(x):
    if x is None:
        return "-"
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return str(x)


def _fmt_bytes(x):
    if x is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x} B"


def _ratio_mark(ours_v, anchor_v):
    """ours / anchor, marked: lower is better for bytes, steps and time."""
    if ours_v is None or anchor_v in (None, 0):
        return "-"
    r = ours_v / anchor_v
    mark = "✅" if r < 0.995 else ("🟰" if r <= 1.005 else "❌")
    return f"{r:.3g}x {mark}"


def _groups(rows):
    """{(kernel, shape): [rows in table order]}"""
    by = {}
    for r in rows:
        by.setdefault((r["kernel"], r["shape"]), []).append(r)
    return by


def _vmem_cell(r, g):
    ci = r["per_generation"].get(g, {}).get("compile")
    if not ci or ci.get("compiles") is None:
        return "n/a"
    if not ci["compiles"]:
        return "❌ does not compile"
    v = ci.get("vmem_bytes")
    return f"✓ {_fmt_bytes(v)}" if v else "✓ default"


def _scheduled_us(r, g):
    return (r["per_generation"].get(g, {}).get("scheduled") or {}).get("scheduled_us")


def _scheduled_cell(r, g):
    sc = r["per_generation"].get(g, {}).get("scheduled")
    if not sc:
        return "n/a"
    if "error" in sc:
        return "❌ " + sc["error"][:60]
    occ = sc.get("hot_mxu_occupancy")
    occ_s = "-" if occ is None else f"{occ:.2f}"
    t = sc.get("scheduled_us")
    return f"{_sig(t) if t is not None else 'not modelled'} ({occ_s}, {sc.get('bound')})"


def losses(results: dict) -> list[str]:
    """Plain sentences for every named row where an anchor's scheduled time beats ours."""
    out = []
    sec = results.get("named") or {}
    for (kind, shape), grp in _groups(sec.get("rows", [])).items():
        ours_r = next((r for r in grp if r["impl"] == "ours"), None)
        if ours_r is None:
            continue
        for g in sec.get("generations", []):
            mine = _scheduled_us(ours_r, g)
            for r in grp:
                theirs = _scheduled_us(r, g) if r is not ours_r else None
                if mine and theirs and theirs < mine * 0.995:
                    out.append(f"{kind} {shape} on {g}: {r['label']} is scheduled faster than "
                               f"ours ({_sig(theirs)} us against {_sig(mine)} us, ours "
                               f"{mine / theirs:.2f}x).")
    return out


def markdown(results: dict) -> str:
    out = ["# Kernel microbenchmarks", "",
           "Generated by `python benchmarks/run.py`; benchmarks/README.md explains every column. "
           "Real-model shapes first: bytes and steps from closed forms that the small-shape "
           "section checks exactly against the TPU interpreter's DMA counter. On each anchor row "
           "the last three columns compare ours with that anchor (ours / anchor): ✅ ours lower "
           "(better), ❌ ours higher (worse), 🟰 within 0.5%.", ""]
    meta = results.get("meta", {})
    if meta:
        out += [f"jax {meta.get('jax')}; libtpu for deviceless compiles: "
                f"{meta.get('libtpu', 'not installed')}.", ""]
    out += ["Times are **scheduled, not measured on a TPU**: the compiler's own VLIW schedule of "
            "a deviceless compile (libtpu's LLO dump, `benchmarks/llo_schedule.py`), the hot "
            "loop's bundles times the call's compute tiles, overlapped per grid step with the "
            "step's DMA time, plus the per-step cost (`benchmarks/schedule_model.py`); XLA's "
            "ops around the kernel (work-list builders, layout transposes) are in results.json "
            "(`xla_us`, an upper bound), not in the column. "
            "The clocks that turn bundles into time are validated against tokamax's published "
            "TPU timings in `results/validation.md`. The roofline-model column is "
            "max(FLOPs / peak, bytes / bandwidth) + per-step overhead: a bound, not a "
            "prediction.", ""]
    lost = losses(results)
    if lost:
        out += ["**Where ours loses (scheduled time):**", ""] + [f"- {x}" for x in lost] + [""]
    for section, title in (("named", "Real-model shapes"),
                           ("small", "Small shapes (counted in TPU interpret mode)")):
        sec = results.get(section)
        if not sec:
            continue
        out += [f"## {title}", ""]
        if section == "small":
            out += ["Small shapes exist to check the closed forms: our kernels run with small "
                    "tiles chosen to exercise multi-step schedules, so these rows are not a "
                    "performance comparison.", ""]
        for kind, why in sorted(sec.get("missing", {}).items()):
            out += [f"- **{kind}: our kernel was not available; its rows are left out** ({why})"]
        if sec.get("missing"):
            out.append("")
        gens = sec["generations"]
        for kind in KINDS:
            rows = [r for r in sec["rows"] if r["kernel"] == kind]
            if not rows:
                continue
            out += [f"### {kind}", ""]
            head = ["shape", "implementation", "useful FLOPs", "MXU FLOPs issued (x useful)",
                    "HBM bytes moved (x minimum)", "grid steps", "VMEM need (model)"]
            if section == "named":
                head += [f"{g} scheduled us (hot-loop MXU occupancy, bound)" for g in gens]
            head += [f"{g} roofline-model us (roofline %)" for g in gens]
            if section == "named":
                head += [f"{g} compiles, scoped VMEM" for g in gens]
                head += ["ours/anchor bytes", "ours/anchor steps",
                         f"ours/anchor {HEADLINE_GEN} scheduled time"]
            else:
                head += ["source", "closed form = counted"]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for (_, shape), grp in _groups(rows).items():
                ours_r = next((r for r in grp if r["impl"] == "ours"), None)
                for r in grp:
                    cells = [shape, r["label"], _fmt_int(r["useful_flops"]),
                             f"{_fmt_int(r['mxu_flops'])} ({r['mxu_flops'] / max(r['useful_flops'], 1):.3g}x)",
                             f"{_fmt_bytes(r['hbm_bytes'])} ({r['hbm_bytes'] / max(r['min_hbm_bytes'], 1):.3g}x)",
                             _fmt_int(r["grid_steps"]), _fmt_bytes(r.get("model_vmem_bytes"))]
                    if section == "named":
                        cells += [_scheduled_cell(r, g) for g in gens]
                    for g in gens:
                        pg = r["per_generation"].get(g, {})
                        frac = pg.get("fraction_of_roofline")
                        cell = f"{_sig(pg.get('modelled_us'))} ({100 * frac:.0f}%)" if frac else "-"
                        if "measured_us" in pg:
                            cell += f"; measured {_sig(pg['measured_us'])}"
                        tk = r.get("tokamax_measured_ms", {})
                        if g in tk.get("pallas", {}):
                            cell += f"; tokamax measured {_sig(1000 * tk['pallas'][g])}"
                        if g in tk.get("xla", {}):
                            cell += f"; XLA measured {_sig(1000 * tk['xla'][g])}"
                        cells.append(cell)
                    if section == "named":
                        cells += [_vmem_cell(r, g) for g in gens]
                        if r["impl"] != "ours" and ours_r is not None:
                            cells += [_ratio_mark(ours_r["hbm_bytes"], r["hbm_bytes"]),
                                      _ratio_mark(ours_r["grid_steps"], r["grid_steps"]),
                                      _ratio_mark(_scheduled_us(ours_r, HEADLINE_GEN),
                                                  _scheduled_us(r, HEADLINE_GEN))]
                        else:
                            cells += ["", "", ""]
                    else:
                        m = r.get("closed_form_matches")
                        cells += [r["source"], "n/a" if m is None else ("yes" if m else "**NO**")]
                    out.append("| " + " | ".join(str(c) for c in cells) + " |")
            out.append("")
            for a in ANCHORS[kind]:
                out.append(f"- {a.label}: {a.method}.")
            notes = sorted({f"- {r['label']}: {n}" for r in rows for n in r["info"].get("notes", [])})
            out += notes
            if any(r.get("tokamax_measured_ms") for r in rows):
                out.append("- tokamax / XLA measured (us): the best time in tokamax's published "
                           "TPU autotune data for exactly this shape and generation (forward, "
                           "bf16): its Pallas kernel, and the XLA op it was compared with. Real "
                           "hardware, other kernels: a reference point for the modelled times.")
            out.append("")
    return "\n".join(out) + "\n"


def plots(results: dict, outdir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sec = results.get("named")
    if not sec:
        return written
    for kind in KINDS:
        groups = _groups([r for r in sec["rows"] if r["kernel"] == kind])
        if not groups:
            continue
        names = [s for (_, s) in groups]
        impls = []
        for grp in groups.values():
            for r in grp:
                if (r["impl"], r["label"]) not in impls:
                    impls.append((r["impl"], r["label"]))
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        width = 0.8 / len(impls)
        for i, (impl, label) in enumerate(impls):
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(names))]
            byt, frac = [], []
            for grp in groups.values():
                r = next((r for r in grp if r["impl"] == impl), None)
                byt.append(r["hbm_bytes"] / r["min_hbm_bytes"] if r else 0)
                frac.append((r["per_generation"][HEADLINE_GEN]["fraction_of_roofline"] or 0)
                            if r else 0)
            axes[0].bar(xs, byt, width, label=label)
            axes[1].bar(xs, frac, width, label=label)
        axes[0].set_ylabel("HBM bytes moved / minimum (log)")
        axes[0].set_yscale("log")
        axes[0].axhline(1.0, color="k", lw=0.8)
        axes[1].set_ylabel(f"{HEADLINE_GEN}: roofline time / modelled time")
        axes[1].set_ylim(0, 1.05)
        for ax in axes:
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
            ax.legend(fontsize=7)
        fig.suptitle(f"{kind}: HBM traffic and modelled efficiency, real-model shapes")
        fig.tight_layout()
        path = outdir / f"{kind}.png"
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
        written.append(path.name)
    return written


def meta() -> dict:
    import jax

    import tpu_compile

    m = {"jax": jax.__version__}
    if tpu_compile.libtpu_available():
        infos = sorted(tpu_compile.LIBTPU_DIR.glob("libtpu-*.dist-info"))
        m["libtpu"] = infos[0].name[len("libtpu-"):-len(".dist-info")] if infos else "installed"
    return m


def small_section(kinds=KINDS, log=print) -> dict:
    """The small-shape section exactly as `run.py --small` computes it (used by the tests)."""
    return run_section(True, kinds, log, do_compile=False)


def _merge(old: dict | None, new: dict, kinds) -> dict:
    """`new` for the kernels just run, `old` rows kept for the others (--kernel runs a subset)."""
    if not old or set(kinds) == set(KINDS):
        return new
    rows = [r for r in old["rows"] if r["kernel"] not in kinds] + new["rows"]
    rows.sort(key=lambda r: (KINDS.index(r["kernel"]),))
    missing = {k: v for k, v in old.get("missing", {}).items() if k not in kinds}
    missing.update(new["missing"])
    return {"rows": rows, "missing": missing, "generations": new["generations"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="recompute only the small-shape section (keeps the named section)")
    parser.add_argument("--kernel", action="append", choices=KINDS, help="default: all")
    parser.add_argument("--device", choices=("cpu", "tpu"), default="cpu",
                        help="tpu: also time the named rows on the attached TPU")
    parser.add_argument("--no-compile", action="store_true", help="skip deviceless compiles")
    parser.add_argument("--ours-generations", nargs="+", choices=TESTED_GENERATIONS,
                        help="compile (and read the schedule of) our kernels only for these "
                             "generations; the others' compile columns say n/a")
    parser.add_argument("--retime", action="store_true",
                        help="only recompute the named rows' scheduled times from the schedule "
                             "cache (no compile, no interpret run) and rewrite the outputs")
    parser.add_argument("--old-rows", default=None,
                        help="with --retime: a results.json whose anchors' compile results "
                             "fill rows that have none")
    parser.add_argument("--no-schedule", action="store_true",
                        help="skip the compiled-schedule reading (LLO dumps) of the named rows")
    parser.add_argument("--no-write", action="store_true", help="print Markdown, write nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "tpu":
        os.environ.pop("JAX_PLATFORMS", None)
    kinds = tuple(args.kernel or KINDS)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["meta"] = meta()
    t0 = time.time()
    if args.retime:
        retime(results["named"], log, args.old_rows and json.loads(
            Path(args.old_rows).read_text())["named"]["rows"])
    elif args.device == "tpu":
        # On a TPU VM: the small (interpreted) section stays as committed, the deviceless
        # compiles are skipped (the chip itself runs the kernels), the named rows gain times.
        results["named"] = _merge(results.get("named"), run_section(False, kinds, log, False),
                                  kinds)
        measure_on_device(results["named"], kinds, log)
    else:
        results["small"] = _merge(results.get("small"), run_section(True, kinds, log, False),
                                  kinds)
        if not args.small:
            results["named"] = _merge(results.get("named"),
                                      run_section(False, kinds, log, not args.no_compile,
                                                  not args.no_compile and not args.no_schedule,
                                                  (results.get("named") or {}).get("rows"),
                                                  args.ours_generations),
                                      kinds)
    log(f"done in {time.time() - t0:.0f}s")
    md = markdown(results)
    if args.no_write:
        print(md)
        return results
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.out / "results.md").write_text(md)
    written = plots(results, args.out)
    log(f"wrote {path}, {args.out / 'results.md'}, {', '.join(written)}")
    bad = [f"{r['kernel']}/{r['shape']}/{r['impl']}" for r in results.get("small", {}).get("rows", [])
           if r.get("closed_form_matches") is False]
    if bad:  # a make target must fail when a closed form no longer matches the interpreter
        log(f"closed form != counted for: {', '.join(bad)}")
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
