"""Read what the TPU compiler built: libtpu's final VLIW schedule of a deviceless compile.

A deviceless compile (libtpu in `.libtpu/`, `tests/tpu_compile.py`) runs the whole TPU backend,
Mosaic and then the LLO scheduler that packs every kernel into VLIW bundles. libtpu can dump the
final schedule. One bundle issues per cycle when nothing stalls, so bundle counts are a lower bound
on compute time that already includes the vector (VALU), EUP (exp), XLU (transposes, cross-lane
reductions) and load/store work a FLOPs/bytes roofline cannot see
(../shared/reference/compiled-schedule.md has the recipe and the numbers it was checked on).

libtpu reads its flags once per process, so every dump is one subprocess:

    LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true --xla_jf_dump_to_filter=NAME"

This module

- runs such a compile (`dump_schedule(target, generation, ...)`): `target` names a function
  `module:function` whose call compiles one program for a generation (see
  `benchmarks/schedule_targets.py` for ours and the anchors at every named benchmark shape);
- parses the two files the dump writes per Mosaic kernel (`parse_dump`):
  `*-final_bundles.txt` (one line per bundle: `ADDR MARK: >> { op ;; op ;; ... }`, `LB:` a loop
  body start, the number of `>` the loop depth) and
  `*-final_hlo-static-per-bundle-utilization.txt` (per bundle, the slots used of MXU, XLU, VALU,
  VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU, after a CAPACITY row);
- turns them into a loop tree (`Schedule.loops`): the grid loop at depth 1 and the kernel's own
  rolled loops inside it, each with its bundle count, per-unit slot occupancy and op counts.

"MXU occupancy" of a segment = MXU slot uses / (MXU capacity x bundles). A plain block matmul
reads 0.93 on v6e (the test checks it stays high); it is a proxy for the fraction of MXU peak,
comparable between kernels of one kind, not a FLOP count.

CLI (any of our kernels or the anchors at a named shape; `--list` shows the targets):

    .venv/bin/python benchmarks/llo_schedule.py --list
    .venv/bin/python benchmarks/llo_schedule.py ours:ragged_dot qwen3_30b_a3b_gate_up_t4096 --generation v6e
    .venv/bin/python benchmarks/llo_schedule.py anchor:splash d256_causal_b2_8192 --generation tpu7x
    .venv/bin/python benchmarks/llo_schedule.py --dump-dir /tmp/dump --name plain_mm   # parse only

What it cannot see: stalls (DMA waits, MXU result latency the scheduler did not hide, bank
conflicts), the trip counts of loops with dynamic bounds (the time model supplies them from the
host-side work lists), and which predicated regions a given grid step takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

UNITS = (
    "MXU",
    "XLU",
    "VALU",
    "VPOP",
    "EUP",
    "VLOAD",
    "VLOAD:FILL",
    "VSTORE",
    "VSTORE:SPILL",
    "SALU",
)
# The op families worth counting in a hot loop (the prefix of the opcode before the first dot).
KEY_OPS = (
    "vmatmul",
    "vmatpush1",
    "vmatpush2",
    "vmatprep",
    "vpop",
    "vpow2",
    "vexp",
    "vrcp",
    "vmax",
    "vadd",
    "vmul",
    "vsub",
    "vsel",
    "vcmp",
    "vxpose",
    "vrot",
    "vld",
    "vst",
    "dma",
    "vpack",
    "vcombine",
    "vcvt",
)

_BUNDLE = re.compile(r"^\s*(0x[0-9a-fA-F]+|\d+)\s+([A-Z]{2})?\s*:\s*(>*)\s*\{(.*)$")
_OPCODE = re.compile(r"=\s*([a-z_][\w.]*)")
_REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)")
_BRANCH = re.compile(r"sbr\.rel\b[^;]*?target = \$region(\d+)")


@dataclasses.dataclass
class Bundle:
    index: int  # position in the program (0-based), = the row of the utilization file
    marker: str  # "LB" loop body start, "LH"/"LE" loop header/exit, "PB"/"PF" predicated
    # region body/fallthrough, "CT" control target, "" none
    depth: int  # loop depth (number of '>')
    ops: tuple[str, ...]  # full opcodes, e.g. "vmatmul.mubr.bf16.gmra.mxu0"
    starts_regions: tuple[int, ...] = ()  # "Start region N" comments: branch targets live here
    branch_to: int | None = None  # `sbr.rel ... target = $regionN`: N


@dataclasses.dataclass
class Segment:
    """Statistics of a set of bundles (a loop body, a loop with its children, a whole program)."""

    bundles: int
    slots: dict[str, int]  # slot uses per unit, summed over the bundles
    capacity: dict[str, int]  # slots per bundle per unit
    ops: dict[str, int]  # op family -> count

    def occupancy(self, unit: str = "MXU") -> float:
        cap = self.capacity.get(unit, 0) * self.bundles
        return self.slots.get(unit, 0) / cap if cap else 0.0

    @property
    def mxu_pushes(self) -> int:
        return self.ops.get("vmatmul", 0)

    def bound(self) -> str:
        """The unit whose slots are fullest: what bounds the segment if it ran stall-free."""
        units = ("MXU", "VALU", "EUP", "XLU", "VLOAD", "VSTORE")
        return max(units, key=self.occupancy)

    def as_dict(self) -> dict:
        return {
            "bundles": self.bundles,
            "occupancy": {u: round(self.occupancy(u), 4) for u in UNITS if u in self.capacity},
            "ops": {k: v for k, v in sorted(self.ops.items()) if k in KEY_OPS},
            "bound": self.bound(),
        }


@dataclasses.dataclass
class Region:
    """Bundles a forward branch skips when taken: a `pl.when` body, one side of an if/else, a
    DMA issue guarded by a condition. [start, end) runs from the bundle after the branch to the
    branch target (the delay slots are counted inside: they issue either way, a small error)."""

    branch: int
    start: int
    end: int
    target_region: int
    children: list[Region] = dataclasses.field(default_factory=list)

    @property
    def bundles(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class Loop:
    start: int  # first bundle (the LB bundle)
    end: int  # one past the last bundle
    depth: int
    children: list[Loop] = dataclasses.field(default_factory=list)

    @property
    def bundles(self) -> int:
        return self.end - self.start

    @property
    def own_bundles(self) -> int:
        """Bundles of the body not inside a nested loop: what one iteration costs besides them."""
        return self.bundles - sum(c.bundles for c in self.children)

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()


class Schedule:
    """One compiled Mosaic kernel's final schedule."""

    def __init__(
        self,
        name: str,
        bundles: list[Bundle],
        util: list[list[int]],
        capacity: dict[str, int],
        generation: str | None = None,
    ):
        if util and len(util) != len(bundles):
            raise ValueError(f"{name}: {len(bundles)} bundles but {len(util)} utilization rows")
        self.name, self.bundles, self.util = name, bundles, util
        self.capacity, self.generation = capacity, generation
        self.loops = _loop_tree(bundles)
        self.is_mosaic = True  # parse_dump tells a Mosaic kernel from XLA's fusions
        self.hbm_operand_bytes = 0  # bytes of the program's operands that live in HBM

    # -- statistics ---------------------------------------------------------------------------
    def segment(self, start: int = 0, end: int | None = None, exclude=()) -> Segment:
        """Statistics of bundles [start, end), leaving out the ranges in `exclude` (loops)."""
        end = len(self.bundles) if end is None else end
        skip = set()
        for lp in exclude:
            skip.update(range(lp.start, lp.end))
        idx = [i for i in range(start, end) if i not in skip]
        slots = Counter()
        ops = Counter()
        for i in idx:
            if self.util:
                for u, v in zip(UNITS, self.util[i]):
                    slots[u] += v
            for op in self.bundles[i].ops:
                ops[op.split(".", 1)[0]] += 1
        return Segment(len(idx), dict(slots), dict(self.capacity), dict(ops))

    def whole(self) -> Segment:
        return self.segment()

    def loop_segment(self, loop: Loop, own: bool = False) -> Segment:
        """A loop's statistics; `own=True` leaves out its nested loops (one iteration's own work)."""
        return self.segment(loop.start, loop.end, exclude=loop.children if own else ())

    def regions(self, loop: Loop | None = None) -> list[Region]:
        """The forward-branch regions inside `loop` (default: the grid loop), as a tree: the
        top-level ones in program order, each with its nested regions. A region that would cross
        the loop's end is left out (it is the loop's exit, not a conditional body)."""
        loop = loop or self.grid_loop()
        lo, hi = (loop.start, loop.end) if loop else (0, len(self.bundles))
        start_of: dict[int, int] = {}
        for b in self.bundles:
            for n in b.starts_regions:
                start_of.setdefault(n, b.index)
        flat = []
        for b in self.bundles[lo:hi]:
            if b.branch_to is None:
                continue
            tgt = start_of.get(b.branch_to)
            if tgt is None or tgt <= b.index + 1 or tgt > hi:
                continue  # a back edge (loop) or a jump out of the loop
            flat.append(Region(b.index, b.index + 1, tgt, b.branch_to))
        flat.sort(key=lambda r: (r.start, -r.end))
        roots: list[Region] = []
        stack: list[Region] = []
        for r in flat:
            while stack and r.start >= stack[-1].end:
                stack.pop()
            if stack and r.end > stack[-1].end:
                continue  # overlaps without nesting: not a structured region
            (stack[-1].children if stack else roots).append(r)
            stack.append(r)
        return roots

    def region_segment(self, region: Region) -> Segment:
        return self.segment(region.start, region.end)

    def all_loops(self) -> list[Loop]:
        return [lp for top in self.loops for lp in top.walk()]

    def grid_loop(self) -> Loop | None:
        """The outermost loop (Mosaic's loop over grid steps), None for a one-step grid."""
        tops = [lp for lp in self.loops if lp.depth == 1]
        return max(tops, key=lambda lp: lp.bundles) if tops else None

    def hot_loop(self) -> Loop | None:
        """The loop holding the most MXU pushes per iteration in its own body (the innermost one
        on a tie): where a matmul kernel spends its time. For a kernel whose grid step is
        straight-line code this is the grid loop itself."""
        best, best_key = None, None
        for lp in self.all_loops():
            seg = self.loop_segment(lp, own=True)
            if not seg.mxu_pushes:
                continue
            key = (seg.mxu_pushes, lp.depth)
            if best_key is None or key > best_key:
                best, best_key = lp, key
        return best

    def summary(self) -> dict:
        """What the CLI prints and the benchmarks store."""
        out = {
            "name": self.name,
            "generation": self.generation,
            "total": self.whole().as_dict(),
            "loops": [],
        }
        hot = self.hot_loop()
        for lp in self.all_loops():
            own = self.loop_segment(lp, own=True)
            out["loops"].append(
                {
                    "start": lp.start,
                    "depth": lp.depth,
                    "bundles": lp.bundles,
                    "own": own.as_dict(),
                    "children": len(lp.children),
                    "hot": lp is hot,
                }
            )
        if hot is not None:
            out["hot"] = {
                "start": hot.start,
                "depth": hot.depth,
                **self.loop_segment(hot, own=True).as_dict(),
            }
        return out


def _loop_tree(bundles: list[Bundle]) -> list[Loop]:
    """Loops from the LB markers and depths: a loop starting at an LB bundle of depth d runs while
    the depth stays >= d and no other LB of depth d starts (a sibling loop).

    A loop's back branch can be printed one level out, its delay slots after it at the loop's
    depth (the paged kernel's page-copy loop without bounds checks: the branch, then the address
    arithmetic and the page's DMA). Where those slots issue a DMA the branch and its slots stay in
    the loop: a loop's DMAs name it (schedule_model.align_loop_trips) and its per-page bundles
    include them. Other loops' delay slots (a gmm tail window's last stores, ~5 bundles) are
    still read as their parent's: every cached schedule was read so, and moving them changes the
    readings by up to ~1% (Qwen3-30B-A3B down at 64 tokens, v5e: +0.08%); that general rule
    waits for a regeneration of every row."""
    roots: list[Loop] = []
    stack: list[Loop] = []

    def dma_in_delay_slots(b: Bundle) -> bool:
        if b.branch_to is None:
            return False
        depth = stack[-1].depth
        for nxt in itertools.islice(bundles, b.index + 1, None):
            if nxt.marker == "LB" or (nxt.depth < depth and nxt.ops):
                return False
            if any(op.startswith("dma") for op in nxt.ops):
                return nxt.depth >= depth
        return False

    for b in bundles:
        while stack and (
            (b.depth < stack[-1].depth and not dma_in_delay_slots(b))
            or (b.marker == "LB" and b.depth == stack[-1].depth)
        ):
            stack[-1].end = b.index
            stack.pop()
        if b.marker == "LB" and b.depth >= 1:
            lp = Loop(b.index, b.index + 1, b.depth)
            (stack[-1].children if stack else roots).append(lp)
            stack.append(lp)
        for lp in stack:
            lp.end = b.index + 1
    return roots


# -------------------------------------------------------------------------------------------------
# Parsing the dump
# -------------------------------------------------------------------------------------------------


def parse_bundles(text: str) -> list[Bundle]:
    """Bundles of a final_bundles file. A bundle starts on a line `ADDR MARK: >> {` and may go on
    over several lines (DMA descriptors do)."""
    starts: list[tuple[str, int, list[str]]] = []
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if m:
            starts.append((m.group(2) or "", len(m.group(3)), [m.group(4)]))
        elif starts:
            starts[-1][2].append(line)
    out = []
    for marker, depth, parts in starts:
        text = "\n".join(parts)
        cut = text.rfind("}")
        body, tail = (text[:cut], text[cut:]) if cut >= 0 else (text, "")
        regions = tuple(int(n) for n in _REGION_START.findall(tail))
        br = _BRANCH.search(body)
        ops = []
        for part in body.split(";;"):
            om = _OPCODE.search(part.split("/*", 1)[0])
            if om:
                ops.append(om.group(1))
        if not ops and not depth and out:
            # Empty bundles (branch delay slots, `{}`) carry no depth marker: they belong to the
            # loop of the bundle before them.
            depth = out[-1].depth
        out.append(
            Bundle(len(out), marker, depth, tuple(ops), regions, int(br.group(1)) if br else None)
        )
    return out


def parse_utilization(text: str) -> tuple[dict[str, int], list[list[int]]]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    i = next(k for k, ln in enumerate(lines) if ln.startswith("== CAPAC"))
    names = [n.strip() for n in lines[i + 1].split(",")]
    caps = [int(x) for x in lines[i + 2].split()]
    if tuple(names) != UNITS:
        raise ValueError(f"unexpected utilization columns {names}")
    rows = []
    for ln in lines[i + 3 :]:
        if ln.startswith("=="):
            continue
        vals = ln.split()
        if len(vals) == len(UNITS) and all(v.isdigit() for v in vals):
            rows.append([int(v) for v in vals])
    return dict(zip(names, caps)), rows


_OPERAND = re.compile(r"inlined_call_operand\.(\w+)\s*\[shape:\s*(\w+)\[([\d,]*)\]")
DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f64": 8,
    "s64": 8,
}


def hbm_operand_bytes(text: str) -> int:
    """Bytes of a program's HBM operands (inputs and outputs), from its entry bundle: an XLA op
    around a kernel reads and writes at least these, whatever its loops' trip counts."""
    total = 0
    for space, dt, dims in _OPERAND.findall(text.split("\n\n", 1)[-1][:100000]):
        if space != "hbm":
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES.get(dt, 4)
    return total


def kernel_dumps(dump_dir: Path) -> dict[str, tuple[Path, Path | None]]:
    """Mosaic kernels in a dump folder: {op name: (final_bundles, utilization)}. XLA's own
    top-level programs (TLP, <late-...>) are left out."""
    found: dict[str, list] = {}
    for p in sorted(Path(dump_dir).iterdir()):
        m = re.match(
            r"^\d+-(.+)-\d+-(final_bundles|final_hlo-static-per-bundle-utilization)\.txt$", p.name
        )
        if not m or m.group(1) == "TLP" or m.group(1).startswith("<"):
            continue
        slot = found.setdefault(m.group(1), [None, None])
        slot[0 if m.group(2) == "final_bundles" else 1] = p
    return {k: (v[0], v[1]) for k, v in found.items() if v[0] is not None}


def parse_dump(dump_dir, name: str | None = None, generation: str | None = None) -> list[Schedule]:
    """Every Mosaic kernel of a dump folder whose op name contains `name`, largest first."""
    out = []
    for op, (bpath, upath) in kernel_dumps(Path(dump_dir)).items():
        if name and name not in op:
            continue
        bundles = parse_bundles(bpath.read_text())
        caps, util = parse_utilization(upath.read_text()) if upath else ({}, [])
        sched = Schedule(op, bundles, util, caps, generation)
        sched.hbm_operand_bytes = hbm_operand_bytes(bpath.read_text()[:200000])
        # XLA's own fusions around the kernel are dumped too; a Mosaic kernel's entry bundle
        # names the tpu custom call.
        sched.is_mosaic = (
            "custom-call" in bpath.read_text()[:20000].split("entry bundle", 1)[-1][:400]
        )
        out.append(sched)
    out.sort(key=lambda s: -len(s.bundles))
    return out


def program_overlays(dump_dir) -> list[int]:
    """Bundles of each instruction-memory overlay of the top-level program (XLA's ops and every
    Mosaic kernel of the compile), from libtpu's `*-TLP-*-overlay-graph.txt`; [] when the dump
    has none. A kernel larger than the largest overlay is cut into several, and a grid loop that
    spans them reloads each from HBM at every step: a stall this schedule does not show (our
    gmm's 140k-bundle program on a TPU v5e chip ran 3-7x its schedule in 8 overlays;
    benchmarks/results/device/)."""
    sizes = {}
    for p in Path(dump_dir).glob("*-TLP-*-overlay-graph.txt"):
        for node, kind, size in re.findall(r'"#(\d+):(\w+) def:\S+ size:(\d+)', p.read_text()):
            if kind == "tlp":
                sizes[node] = int(size)
    return [sizes[k] for k in sorted(sizes, key=int)]


# -------------------------------------------------------------------------------------------------
# Running a compile with the dump switched on (one subprocess per compile)
# -------------------------------------------------------------------------------------------------


def dump_flags(dump_dir: str, name: str | None) -> str:
    flags = [f"--xla_jf_dump_to={dump_dir}", "--xla_jf_dump_llo_text=true"]
    if name:
        flags.append(f"--xla_jf_dump_to_filter={name}")
    return " ".join(flags)


def dump_schedule(
    target: str,
    generation: str,
    args: dict | None = None,
    name: str | None = None,
    dump_dir: str | None = None,
    timeout: int = 900,
    hlo_out: str | None = None,
) -> list[Schedule]:
    """Compile `target` (`"module:function"`, called as function(generation, **args), which must
    compile its program, e.g. with tests/tpu_compile.compile_for) for `generation` in a fresh
    process with the LLO dump on, and parse the Mosaic kernels whose op name contains `name`.
    If the target returns the Compiled object and `hlo_out` is given, its HLO text is written
    there (the compile's scoped-VMEM reservations live in it)."""
    keep = dump_dir is not None
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="llo-")
    env = dict(os.environ)
    env["LIBTPU_INIT_ARGS"] = (
        env.get("LIBTPU_INIT_ARGS", "") + " " + dump_flags(dump_dir, name)
    ).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--compile-only",
        target,
        "--generation",
        generation,
        "--args",
        json.dumps(args or {}),
    ]
    if hlo_out:
        cmd += ["--hlo-out", hlo_out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"compile of {target} for {generation} failed:\n{proc.stderr[-3000:]}")
    try:
        scheds = parse_dump(dump_dir, name, generation)
    finally:
        if not keep:
            import shutil

            shutil.rmtree(dump_dir, ignore_errors=True)
    if not scheds:
        raise RuntimeError(f"no Mosaic kernel matching {name!r} in the dump of {target}")
    return scheds


def _resolve(target: str):
    import importlib

    mod, fn = target.split(":", 1)
    return getattr(importlib.import_module(mod), fn)


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------


def format_summary(s: Schedule) -> str:
    lines = [f"{s.name} ({s.generation or '?'}): {len(s.bundles)} bundles"]
    hot = s.hot_loop()
    for lp in s.all_loops():
        own = s.loop_segment(lp, own=True)
        occ = " ".join(
            f"{u}={own.occupancy(u):.2f}" for u in ("MXU", "VALU", "EUP", "XLU", "VLOAD", "VSTORE")
        )
        ops = ", ".join(
            f"{k} {own.ops[k]}"
            for k in ("vmatmul", "vpow2", "vxpose", "vsel", "dma")
            if own.ops.get(k)
        )
        lines.append(
            f"{'  ' * lp.depth}loop @{lp.start} depth {lp.depth}: {lp.bundles} bundles "
            f"({own.bundles} own) {occ} [{ops}] bound {own.bound()}"
            + ("   <- hot" if lp is hot else "")
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "target",
        nargs="?",
        help="ours:<kernel> or anchor:<id> (see --list), or module:function with --args",
    )
    ap.add_argument("shape", nargs="?", help="a named benchmark shape (benchmarks/shapes.py)")
    ap.add_argument("--generation", default="v6e")
    ap.add_argument("--args", default="{}", help="JSON keyword arguments for module:function")
    ap.add_argument("--name", default=None, help="op-name filter of the dump")
    ap.add_argument("--dump-dir", default=None, help="keep the dump here (or parse it with --name)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--list", action="store_true", help="list the named targets")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hlo-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.compile_only:  # inside the subprocess: compile and exit; libtpu writes the dump
        compiled = _resolve(a.target)(a.generation, **json.loads(a.args))
        if a.hlo_out and hasattr(compiled, "as_text"):
            Path(a.hlo_out).write_text(compiled.as_text())
        return 0
    import schedule_targets

    if a.list:
        print(schedule_targets.describe())
        return 0
    if a.target is None and a.dump_dir:
        scheds = parse_dump(a.dump_dir, a.name, a.generation)
    else:
        if a.target == "plain_matmul" or a.target.startswith(("ours", "anchor:")):
            target, args, name = schedule_targets.resolve(a.target, a.shape)
        else:
            target, args, name = a.target, json.loads(a.args), a.name
        scheds = dump_schedule(target, a.generation, args, name or a.name, a.dump_dir)
    for s in scheds:
        print(json.dumps(s.summary(), indent=1) if a.json else format_summary(s))
    if a.dump_dir and not a.json:
        print(f"top-level program overlays (bundles): {program_overlays(a.dump_dir) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
