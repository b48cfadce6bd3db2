"""Scheduled time of one kernel call, from the compiler's own VLIW schedule (llo_schedule.py).

A Mosaic kernel is a loop over grid steps (the grid loop) holding straight-line code, predicated
regions (`pl.when` bodies, the two sides of a branch) and the kernel's own rolled loops. A call's
time is what its grid steps execute, each step timed by one rule (`Machine`):

    scheduled = prologue/epilogue bundles / clock
              + sum over steps: max(bundles the step executes / clock,
                                    HBM bytes it moves / bandwidth,
                                    MXU FLOPs it issues / MXU peak) + fixed step overhead
              + XLA ops around the kernel (reported beside it)

What a step executes comes from the compiled schedule (`work_model_inputs`: the grid loop, its
hot loop, its alternative MXU paths) and how many steps of each kind run from the kernel's own
work list (`scheduled_from_work`), or, for tokamax's kernels timed on real TPUs, from their
schedule metadata (benchmarks/validate_schedule.py, which applies the same `Machine` rule per
step). Both read a step's predicated regions the same way (`split_bodies`,
`first_last_regions`): an accumulator's init and write-out run once per output tile, and of the
two sides of a `lax.cond` a step runs one, so neither is charged to every step.

The DMA term overlaps with compute per step (double buffering hides one behind the other); a
step whose bytes take longer than its bundles is memory-bound. One bundle per cycle is a lower
bound: stalls (DMA waits beyond the overlap, MXU result latency the scheduler did not hide)
stay unmodelled, which is why the clocks are validated against real TPU times
(benchmarks/validate_schedule.py, ../shared/reference/data/). Every time here is "scheduled",
never "measured".
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence

import numpy as np

from llo_schedule import Loop, Schedule
from tpu_generations import overlapped_step_seconds


@dataclasses.dataclass(frozen=True)
class Machine:
    """What turns a grid step's work into time, the one rule every scheduled time here uses (our
    rows, the anchors' rows and the validation against tokamax's TPU timings): a step costs

        max(bundles / clock, HBM bytes / bandwidth, MXU FLOPs / MXU peak) + step overhead

    (DMA overlaps compute by double buffering; the MXU floor matters where a pushed tile takes
    more cycles than its bundles, as on TPU7x). Summing the work of many steps before the max
    (`work_seconds` of the totals) times them as one average step: exact when the steps are
    alike, an optimistic bound when memory- and compute-bound steps alternate."""

    clock_hz: float
    hbm_bytes_per_s: float
    mxu_flops_per_s: float
    step_overhead_s: float

    @classmethod
    def of(cls, generation, clock_hz=None, step_overhead_s=None, cores: int = 1) -> Machine:
        """`generation` (a tpu_generations.TpuGeneration) as seen by one of `cores` cores that
        share its HBM and MXU peak; `clock_hz` / `step_overhead_s` override its figures."""
        return cls(
            clock_hz=clock_hz or generation.clock_hz,
            hbm_bytes_per_s=generation.hbm_bytes_per_s / cores,
            mxu_flops_per_s=generation.bf16_flops / cores,
            step_overhead_s=(
                generation.step_overhead_s if step_overhead_s is None else step_overhead_s
            ),
        )

    def work_seconds(self, bundles: float, dma_bytes: float = 0.0, mxu_flops: float = 0.0) -> float:
        """The step rule without the fixed overhead."""
        return max(
            bundles / self.clock_hz,
            dma_bytes / self.hbm_bytes_per_s,
            mxu_flops / self.mxu_flops_per_s,
        )

    def step_seconds(self, bundles: float, dma_bytes: float = 0.0, mxu_flops: float = 0.0) -> float:
        return self.work_seconds(bundles, dma_bytes, mxu_flops) + self.step_overhead_s


def _mxu_branches(sched: Schedule, regions, nested: bool = False) -> list:
    """The alternative MXU paths of a grid step, in program order: descend from the step's
    MXU regions while a single region holds all the MXU work (a `pl.when(valid)` wrapper); the
    first level where the work splits over several sibling regions is the set of paths one step
    chooses from (e.g. the paged kernel's narrow decode path and its whole-q-block path). Empty
    when the MXU work never splits.

    `nested`: a path that only dispatches, all of its MXU work split over sub-regions again, is
    replaced by those sub-paths (the paged kernel's narrow path choosing the compact or the
    stacked form of its KV-head pair path). The schedule cannot tell alternatives from regions
    that run one after another (flash's paths hold sequential sub-tile regions), so the family
    that nests its paths asks for it (NESTED_PATHS)."""
    while len(regions) == 1:
        regions = [c for c in regions[0].children if sched.region_segment(c).mxu_pushes]
    if len(regions) < 2:
        return []
    if not nested:
        return regions
    out = []
    for r in regions:
        sub = _mxu_branches(sched, [r], nested=True)
        pushes = sched.region_segment(r).mxu_pushes
        split = sub and sum(sched.region_segment(c).mxu_pushes for c in sub) == pushes
        out.extend(sub if split else [r])
    return out


# The kernel families (ours) whose alternative compute paths nest (`_mxu_branches`).
NESTED_PATHS = frozenset({"paged_attention"})
# The kernel families (ours) whose grid step runs a rolled loop over work items, each item what
# a grid step of the other kernels is (`work_model_inputs(item_loop=True)`): paged attention runs
# a q block's items in its grid step.
ITEM_LOOPS = frozenset({"paged_attention"})


# -------------------------------------------------------------------------------------------------
# Predicated regions of a grid step: which run every step, which once per output tile, which are
# alternatives (shared with benchmarks/validate_schedule.py, which charges tokamax's kernels by it)
# -------------------------------------------------------------------------------------------------


def grid_regions(sched: Schedule) -> list[tuple[int, int]]:
    """(branch bundle, target bundle) of every predicated region inside the grid loop, nested
    ones included, in program order: `Schedule.regions()` flattened. A region (`pl.when`,
    `lax.cond`) is `sbr.rel (%p) target = $regionN` jumping over its body; bundles strictly
    between the two are skipped when the branch is taken (a few of them are delay slots that
    issue either way: ignored, < 5 bundles)."""
    out: list[tuple[int, int]] = []

    def walk(regions):
        for r in regions:
            out.append((r.branch, r.end))
            walk(r.children)

    walk(sched.regions())
    return sorted(out)


def _bodies(grid_bundles: int, regions) -> list[tuple[int, int]]:
    """The (branch, end) of the step's alternative bodies, program order (see `split_bodies`)."""
    regs = [tuple(r[:2]) for r in regions]
    big = [r for r in regs if r[1] - r[0] - 1 >= 0.15 * grid_bundles]
    bodies = [r for r in big if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in big)]
    # Where the regions carry MXU push counts (the benchmark rows' models), a region with MXU
    # work that starts where a body ends or ends where one starts is that `lax.cond`'s other side
    # even below 15% (megablox's "other K tiles" side: 45 of a 308-bundle step on v6e).
    for r in regions:
        if len(r) > 2 and r[2] and tuple(r[:2]) not in bodies:
            if any(b[1] == r[0] or r[1] == b[0] for b in bodies):
                bodies.append(tuple(r[:2]))
    return sorted(bodies)


def split_bodies(grid_bundles: int, regions) -> tuple[list[int], list[tuple[int, int]], int]:
    """(sizes of the grid step's alternative bodies in program order, the small regions, bundles
    of the step outside the bodies), from the grid loop's size and its predicated regions as
    (branch, end) pairs (`grid_regions`, any common origin). A body is a predicated region
    holding >= 15% of the grid loop that does not contain another such region (a region around
    the whole step, e.g. the skip of padded grid entries, is taken as always executed), or, where
    the regions carry MXU push counts (`_region_rows`), a region with MXU work right beside a
    body: the sides of a `lax.cond` (last K tile / other K tiles, masked / unmasked) of which
    one step runs one."""
    bodies = _bodies(grid_bundles, regions)
    regs = [tuple(r[:2]) for r in regions]
    small = [r for r in regs if r[1] - r[0] - 1 < 0.15 * grid_bundles and r not in bodies]
    sizes = [b - a - 1 for a, b in bodies]
    return sizes, small, grid_bundles - sum(sizes)


def first_last_regions(regions, work: tuple[int, int]) -> tuple[int, int]:
    """Bundles of the step's first-step and last-step regions: the accumulator's init (zeroing,
    on an output tile's first step) and its finalize (write-out, on its last step), which run
    once per output tile, not per grid step. `regions` are (branch, end[, MXU pushes, loads,
    stores]) in program order; `work` the (first, last) bundle of the step's MXU work (its
    alternative bodies, or the hot loop nest and its side regions). Init is the small region
    ending right before the work, finalize the one starting right after it (the validator's
    reading of splash's steps). Where the regions carry op counts, init must store without
    loading (it writes constants; a weight-prepare region before the work loads what it stores
    and runs every step) and finalize must load and store (it reads the accumulator): a region
    that does not fit is left in the per-step charge. 0 where none is found."""
    init, end = first_last_spans(regions, work)
    return tuple(r[1] - r[0] - 1 if r else 0 for r in (init, end))


def first_last_spans(regions, work: tuple[int, int]) -> tuple:
    """The (branch, end) bundles of the init and finalize regions `first_last_regions` sizes
    (None where none is found)."""
    lo, hi = work
    cand = [
        r
        for r in regions
        if not (len(r) > 2 and r[2])  # MXU work is not init / finalize
        and not (r[0] <= lo and hi <= r[1])  # a region around the work runs with it
        and not (lo <= r[0] and r[1] <= hi)  # inside the work
    ]
    before = [r for r in cand if r[1] <= lo]
    after = [r for r in cand if r[0] >= hi]
    init = end = None
    if before:
        r = max(before, key=lambda r: (r[0], r[1]))  # the innermost of the last
        if len(r) < 5 or (r[4] > 0 and r[3] * 8 <= r[4]):
            init = (r[0], r[1])
    if after:
        r = min(after, key=lambda r: (r[0], r[1]))
        if len(r) < 5 or (r[3] > 0 and r[4] > 0):
            end = (r[0], r[1])
    return init, end


def prepare_span(regions, work: tuple[int, int]) -> tuple | None:
    """The (branch, end) bundles of the step's weight-prepare region: the last region before the
    work that loads and stores without MXU work (a gmm's int8 / e4m3 weight block widened, or a
    K tail zeroed, into a VMEM copy: `first_last_spans`' rule leaves it out of init), found only
    where the regions carry op counts. None where there is none."""
    lo, hi = work
    before = [
        r
        for r in regions
        if len(r) >= 5
        and not r[2]
        and r[1] <= lo
        and not (r[0] <= lo and hi <= r[1])
        and r[3] > 0
        and r[4] > 0
    ]
    if not before:
        return None
    r = max(before, key=lambda r: (r[0], r[1]))
    return (r[0], r[1])


def _region_rows(sched: Schedule, grid: Loop) -> list[list[int]]:
    """The grid step's predicated regions as [branch, end, MXU pushes, loads, stores], relative to
    the grid loop's first bundle (cacheable numbers for `first_last_regions`)."""
    out = []

    def walk(regions):
        for r in regions:
            seg = sched.region_segment(r)
            out.append(
                [
                    r.branch - grid.start,
                    r.end - grid.start,
                    seg.mxu_pushes,
                    seg.ops.get("vld", 0),
                    seg.ops.get("vst", 0),
                ]
            )
            walk(r.children)

    walk(sched.regions(grid))
    return sorted(out)


def _top_child_containing(grid: Loop, lp: Loop) -> Loop | None:
    for c in grid.children:
        if c.start <= lp.start and lp.end <= c.end:
            return c
    return None


def work_model_inputs(
    sched: Schedule,
    xla: Sequence[Schedule] = (),
    nested_paths: bool = False,
    item_loop: bool = False,
) -> dict:
    """What `scheduled_from_work` needs of a compiled schedule, as plain numbers (cacheable).
    `nested_paths`: the kernel's alternative paths nest (`_mxu_branches`; NESTED_PATHS).
    `item_loop`: the kernel's grid step runs a rolled loop over work items (ITEM_LOOPS), the hot
    loop: that loop's body is read as "the step" below (its paths, regions and rolled loops),
    and the grid step's code around it (`block_bundles`, its rolled loops `block_loops`: a q
    block's init and write-back) is charged per grid step. Where the grid has one step Mosaic
    emits no grid loop and the whole program is that code."""
    grid, hot = sched.grid_loop(), sched.hot_loop()
    block = None
    if item_loop and hot is not None:
        if grid is not None and grid is not hot and grid.start <= hot.start < grid.end:
            block = grid
        grid = hot
    out = {
        "outside_bundles": len(sched.bundles) - ((block or grid).bundles if grid else 0),
        "xla": [[len(x.bundles), x.hbm_operand_bytes] for x in xla],
    }
    if grid is None or hot is None:
        return out
    if item_loop:
        if block is None:  # a one-step grid: the program is the grid step
            out["outside_bundles"] = 0
            top = Loop(0, len(sched.bundles), 0, [lp for lp in sched.loops if lp.depth == 1])
        else:
            top = block
        out.update(
            items_in_step=True,
            block_bundles=top.bundles - grid.bundles,
            block_loops=_step_loops(sched, top, [grid]),
        )
    mxu_regions = [r for r in sched.regions(grid) if sched.region_segment(r).mxu_pushes]
    branches = _mxu_branches(sched, mxu_regions, nested=nested_paths)
    # The step's alternative MXU paths, each with its static bundles and MXU pushes (loop bodies
    # counted once): what `branch_runs` / `branch_pushes` charge.
    out.update(
        step_bundles=grid.bundles,
        # every predicated region of the step (relative to the grid loop): what tells the regions
        # that run once per output tile and the sides one step chooses from (`step_regions`)
        regions=_region_rows(sched, grid),
        mxu_branches=[[r.bundles, sched.region_segment(r).mxu_pushes] for r in branches],
        step_loops=_step_loops(sched, grid, branches),
    )
    if hot is grid:
        out.update(
            hot_is_grid=True,
            idle_step_bundles=grid.bundles - sum(r.bundles for r in mxu_regions),
        )
    else:
        nest = _top_child_containing(grid, hot) or hot
        # MXU work outside the hot loop nest (tail windows of other sizes, masked edge tiles):
        # alternative regions a computing step takes one of, charged at their mean.
        side = []

        def collect(regions):  # the largest MXU regions beside the nest, inside its ancestors
            for r in regions:
                if r.start <= nest.start and nest.end <= r.end:
                    collect(r.children)
                elif nest.start <= r.start and r.end <= nest.end:
                    continue  # inside the nest: its bundles are the nest's
                elif sched.region_segment(r).mxu_pushes:
                    side.append(r)

        collect(sched.regions(grid))
        side_bundles = [r.bundles for r in side]
        out.update(
            hot_is_grid=False,
            # first and last bundle of the step's MXU work (the nest and the side regions),
            # relative to the grid loop: init / finalize regions lie right outside it
            work=[
                min([nest.start] + [r.branch for r in side]) - grid.start,
                max([nest.end] + [r.end for r in side]) - grid.start,
            ],
            hot_bundles=hot.own_bundles,
            per_step_overhead_bundles=grid.bundles - nest.bundles - sum(side_bundles),
            side_region_mean_bundles=(
                sum(side_bundles) / len(side_bundles) if side_bundles else 0.0
            ),
            # each side region's bundles, program order: what a kernel that knows which of them
            # each run takes (a tail window's bucket) charges per region (`side_region_runs`)
            side_region_bundles=side_bundles,
        )
    return out


def _step_loops(sched: Schedule, grid, paths) -> list[list[int]]:
    """The rolled loops of a grid step outside its MXU work (inside none of its alternative
    `paths` and with no MXU pushes of their own), nested ones included, in program order:
    [start, end, own bundles, parent, DMA ops, branch bundles] with start / end relative to the
    grid loop, `parent` the index of the enclosing listed loop (-1: directly in the step), `DMA
    ops` the DMA issues and waits of its own bundles and `branch bundles` those of its own bundles
    inside forward branches (`pl.when` bodies an iteration may skip; a branch around a nested loop
    is not one). A static count reads each loop's body once; a kernel whose work list says how
    often each runs (`loop_trips`, `align_loop_trips`) is charged by it."""

    def compute(lp) -> bool:
        inside = any(r.start <= lp.start and lp.end <= r.end for r in paths)
        return inside or sched.loop_segment(lp).mxu_pushes > 0

    out: list[list[int]] = []

    def visit(lp, parent: int) -> None:
        for child in lp.children:
            if compute(child):
                continue
            me = len(out)
            dma = sched.loop_segment(child, own=True).ops.get("dma", 0)
            out.append(
                [
                    child.start - grid.start,
                    child.end - grid.start,
                    child.own_bundles,
                    parent,
                    dma,
                    _branch_bundles(sched, child),
                ]
            )
            visit(child, me)

    visit(grid, -1)
    return out


def _branch_bundles(sched: Schedule, loop) -> int:
    """Bundles of `loop`'s own body inside forward branches: `pl.when` bodies an iteration may
    skip. A branch mostly taken by a nested loop is that loop's guard (it skips the loop when it
    has no trips), not a body branch; nested loops' own bundles are theirs."""
    total = 0
    for r in sched.regions(loop):
        if any(c.start <= r.start and r.end <= c.end for c in loop.children):
            continue  # inside a nested loop: that loop's
        looped = sum(c.bundles for c in loop.children if r.start <= c.start and c.end <= r.end)
        if 2 * looped > r.bundles:
            continue
        total += r.bundles - looped
    return total


def align_loop_trips(
    step_loops: Sequence[Sequence[int]], named: dict[str, float | tuple[float, float]]
) -> list[tuple[float, float]]:
    """`scheduled_from_work(loop_trips=...)` from a kernel's own loops by name (program order;
    "outer/inner" for a loop the kernel nests in another), each with its iterations over the
    call, or (iterations, branch runs) where the work list also says how often the loop body's
    forward branches run (e.g. a partly filled last page's copies), and its compiled step's
    `step_loops`: one (trips, branch runs) per loop. The loops directly in the step are the
    kernel's, in order; inside a named loop, the loops that issue DMAs are its named inner loops,
    in order. Any other nested loop is the compiler's (e.g. TPU7x copies a lane-offset scale tile
    through a small vld / vst loop beside its DMA) and is charged once per iteration of its
    parent: its own trips are not known (an under-count where it iterates more than once)."""
    top = [n for n in named if "/" not in n]
    inner = {n: [c for c in named if c.startswith(n + "/")] for n in top}
    out: list[tuple[float, float]] = []
    names: list[str | None] = []
    tops = iter(top)
    for loop in step_loops:
        parent, dma = loop[3], loop[4]
        if parent < 0:
            name = next(tops, None)
            if name is None:
                raise ValueError(
                    f"the compiled step has more loops directly in it than the {len(top)} named "
                    f"({', '.join(top)})"
                )
        else:
            outer = names[parent]
            pending = inner.get(outer) if outer else None
            name = pending.pop(0) if pending and dma else None
        names.append(name)
        if name is None:
            out.append((out[parent][0], out[parent][0]))
        else:
            value = named[name]
            trips, runs = value if isinstance(value, tuple) else (value, value)
            out.append((float(trips), float(runs)))
    unused = list(tops) + [c for cs in inner.values() for c in cs]
    if unused:
        raise ValueError(f"named loops not found in the compiled step: {', '.join(unused)}")
    return out


def step_regions(model: dict) -> dict:
    """How a grid step's predicated regions are charged, from a `work_model_inputs` model:
    `first`/`last`, the bundles of the output tile's init and finalize regions
    (`first_last_regions`: charged once per output tile, not per step), `prepare`, those of the
    weight-prepare region (`prepare_span`: charged by `prepare_runs` where a kernel passes it),
    and where the hot loop is
    the grid loop, `sides`, the step's alternative bodies (`split_bodies`: e.g. a gmm's "other K
    tiles" / "last K tile" sides of a `lax.cond`, of which a step runs one). All zero / empty for
    a model cached before the regions were recorded (every region is then charged per step)."""
    regions = model.get("regions")
    if "step_bundles" not in model:
        return {"first": 0, "last": 0, "sides": [], "first_last_loops": 0, "prepare": 0}
    if regions is None:
        # A model cached before the regions were recorded still has the step's alternative MXU
        # paths (sibling regions with MXU work): the two sides of a `lax.cond` where the larger
        # is a body by `split_bodies`' 15% rule. Init / finalize are not known: per step.
        paths = [b for b, _ in model.get("mxu_branches") or ()]
        big = len(paths) == 2 and max(paths) >= 0.15 * model["step_bundles"]
        sides = paths if model.get("hot_is_grid") and big else []
        return {"first": 0, "last": 0, "sides": sides, "first_last_loops": 0, "prepare": 0}
    sides: list[int] = []
    if model.get("hot_is_grid"):
        bodies = _bodies(model["step_bundles"], regions)
        sizes = [b - a - 1 for a, b in bodies]
        if bodies:
            work = (bodies[0][0], bodies[-1][1])
            sides = sizes if len(sizes) >= 2 else []
        else:  # no alternative bodies: the step's MXU regions are its work
            mxu = [r for r in regions if r[2]]
            if not mxu:
                return {"first": 0, "last": 0, "sides": [], "first_last_loops": 0, "prepare": 0}
            work = (min(r[0] for r in mxu), max(r[1] for r in mxu))
    else:
        work = tuple(model["work"])
    first, last = first_last_regions(regions, work)
    spans = [sp for sp in first_last_spans(regions, work) if sp]
    # rolled loops inside init / finalize (one iteration each in the region's bundles): a
    # q block's write-out loops
    inner = sum(
        lp[2]
        for lp in model.get("step_loops") or ()
        if any(a <= lp[0] and lp[1] <= b for a, b in spans)
    )
    prep = prepare_span(regions, work)
    return {
        "first": first,
        "last": last,
        "sides": sides,
        "first_last_loops": inner,
        "prepare": prep[1] - prep[0] - 1 if prep else 0,
    }


def scheduled_from_work(
    model: dict,
    *,
    mxu_flops: float,
    grid_steps: float,
    hbm_bytes: float,
    generation,
    step_work: dict | None = None,
    **trips,
) -> dict:
    """Scheduled time from the hot loop's cost per unit of MXU work, for kernels whose trip
    counts are data-dependent (work lists, dynamic loop bounds). `model` is
    `work_model_inputs(schedule)`; `generation` a tpu_generations.TpuGeneration; `trips` the
    trip-count keywords of `_call_bundles` (flops_per_hot_iteration, hot_iterations,
    side_region_runs, branch_runs, branch_pushes, output_tiles, output_loop_trips,
    last_side_runs, loop_trips, work_items, block_loop_trips, prepare_runs; each optional),
    described below.

    The call's MXU work (`mxu_flops`, issued FLOPs from the kernel's closed form, which the tests
    check against the TPU interpreter) is divided into hot-loop iterations of
    `flops_per_hot_iteration` each (the compute tile one iteration multiplies, which the caller
    knows from its tiling); each costs the hot loop's own bundles. Every grid step also pays the
    grid loop's bundles outside the loop nest holding the hot loop (when the hot loop is the grid
    loop itself, a step with no MXU work pays the bundles outside its MXU regions) and the
    generation's fixed per-step cost (`step_overhead_s`: without it the validation against
    tokamax's real timings falls from 92% to ~70% of rows within 25%). Compute never goes below
    the MXU FLOP floor (issued FLOPs / peak: on TPU7x a pushed tile takes more cycles than its
    bundles). DMA overlaps compute per step (double buffering). XLA's ops around the kernel
    (work-list builders, pads, layout transposes) come separately (`xla_us`, `with_xla_us`) at
    max(their bundles once, their HBM operands / bandwidth), an upper bound.

    A kernel whose work list says exactly how many hot iterations run (`hot_iterations`) and how
    many times one of its other MXU regions runs (`side_region_runs`: tail windows, masked edge
    tiles, each charged the mean bundles of those regions, or one count per region in program
    order, each charged its own bundles: a tgmm tail's bucket) passes them instead of
    `flops_per_hot_iteration`; without them every FLOP is charged at the hot loop's rate.

    A kernel whose hot loop is the grid loop and whose steps choose one of several MXU paths
    (`mxu_branches` in `model`, program order) passes `branch_runs`, the number of steps taking
    each path (from its work list): a busy step then costs the step's bundles without the paths
    plus the path it takes, instead of every path's bundles.

    A kernel whose steps choose one of several MXU paths that hold loops of their own (flash
    attention: the interior path for items the band covers whole, the edge walk with its masked
    tiles) passes `branch_pushes`, the MXU pushes its work list runs on each path: each path
    costs its static bundles per static push (its loops' bodies counted once, so a rate per
    push) times the pushes it runs, and every step the bundles outside the paths.

    A kernel that zeroes its accumulator on an output tile's first step and writes it out on its
    last (`pl.when(k == 0)` / `pl.when(k == last)`) passes `output_tiles`, how many times those
    regions run (per output tile, from its grid or work list): the init / finalize regions
    `step_regions` finds are then charged that many times instead of once per grid step (with
    `branch_pushes` too: flash attention's q block runs, its init on the run's first item and
    its write-out on the last); `output_loop_trips`, the iterations each rolled loop inside
    those regions runs per output tile (flash's write-out, a loop per head), charges those
    loops by it instead of one iteration. A
    kernel whose hot loop is the grid loop and whose step holds two sides of a `lax.cond` (a gmm's
    "last K tile" side that also writes the output, and the "other K tiles" side) passes
    `last_side_runs`, the busy steps taking the larger side: the others are charged the smaller
    one, instead of every step both (the validator's charge of tokamax's steps).

    A kernel that prepares its weight block in a region of the step's own code before the work
    (a gmm's int8 / e4m3 weights widened into a VMEM copy, `step_regions`' `prepare`) but not on
    every step passes `prepare_runs`, how many times that region runs (with one K block: once
    per N tile and run of a group's items): it is charged that many times instead of once per
    grid step.

    A kernel whose hot loop is the grid loop and whose steps run rolled loops of data-dependent
    trip counts outside their MXU paths (the paged kernel's page DMA issue and wait loops, run
    once per page; its q block's init / write-back loops, once per q block) passes `loop_trips`,
    each of the model's `step_loops`' iterations over the whole call (program order), or
    (iterations, runs of the loop body's forward branches) pairs (`align_loop_trips`): every step
    is then charged its code without those loops, and each loop its own bundles per iteration
    (its branch bodies per run), instead of one iteration per step.

    A kernel whose grid step runs a loop over work items (`work_model_inputs(item_loop=True)`:
    the model's step is one item) passes `work_items`, the items over the call, in place of the
    grid steps wherever the rules above count steps, and `block_loop_trips`, the iterations of
    the grid step's own rolled loops (`block_loops`) as `loop_trips` does for the item's: each
    grid step is then charged its code around the item loop (`block_bundles`, its loops by their
    trips) and the fixed per-step cost, each item none of that.

    A kernel whose grid steps differ in their work (a gmm's items: a new expert's weight block
    for a few rows, then a full window on resident weights) passes `step_work`, per grid step in
    pipeline order: "hot" (hot-loop iterations; for a grid-loop hot loop, > 0 marks a busy
    step), "side" (side-region runs, or runs per side region as `side_region_runs` takes them;
    optional), "mxu" (MXU FLOPs, any scale) and "reads" / "writes" (the bytes copied in for the
    step / written back after it, `blockspec_model.step_copies`). The call's pooled bundles, MXU
    floor and HBM bytes (the totals above) are then spread over the steps by those weights and
    overlapped per step as the pipeline does: the DMA of step i + 1's inputs and of step i - 1's
    outputs runs under step i's compute, the first step's inputs and the last step's outputs are
    exposed. Without
    it the call's work is pooled into one step (max of its totals), which is exact only when
    every step has the same mix: on a TPU v5e chip (15 named gmm cells) measured / scheduled
    was 0.94-1.43 for our gmm and 0.82-1.39 for megablox's 128-row tiles with the pooled rule,
    0.93-1.11 and 0.82-1.07 with this one (ours 1.01-1.13 since its windows stopped copying
    their lhs through a spill slot, a copy this model never charged; benchmarks/results/results.md).

    A kernel whose steps also differ in their code (the paged kernel's q blocks: a decode block
    of many narrow items, prefill blocks of a few whole-block ones) passes in `step_work` also
    "trips", one dict per step of this function's trip-count arguments for that step alone
    (the same keys the call passes, which they add up to; `flops_per_hot_iteration` stays the
    call's): the step's bundles are charged from them by the rules above, instead of from
    "hot" / "side". A kernel that copies part of a step's inputs itself, double-buffered under
    the step's own compute (the paged kernel's KV pages: item i + 1's while item i computes),
    passes those bytes as "streams": they overlap the step they belong to, where "reads" (its
    first item's pages, its q block) overlap the step before.

    Left out, and said so where used: loop levels between the grid and the hot loop (their own
    per-iteration bundles), and the spread between the side regions (their mean is charged).
    """
    machine = Machine.of(generation)
    clock = machine.clock_hz
    regions = step_regions(model)
    unknown = set(trips) - set(TRIP_KEYS)
    if unknown:
        raise TypeError(f"scheduled_from_work: unknown trip counts {sorted(unknown)}")
    trips = {k: trips.get(k) for k in TRIP_KEYS}
    bundles, iterations, loop_bundles, block = _call_bundles(
        model, regions, mxu_flops=mxu_flops, grid_steps=grid_steps, **trips
    )
    items_in_step = bool(model.get("items_in_step"))
    block_steps = grid_steps
    # The call's steps pooled into one (Machine's rule on the totals) plus each step's overhead:
    # per-step work is not known where the trip counts come from a work list.
    t_b = bundles / clock
    t_mxu = machine.work_seconds(0.0, 0.0, mxu_flops)
    t_c = max(t_b, t_mxu)
    t_d = machine.work_seconds(0.0, hbm_bytes)
    t_steps = block_steps * machine.step_overhead_s
    # XLA's ops around the kernel are reported beside the kernel's time, not in it: their HBM
    # operands' bytes overcount ops that touch part of an operand (a batch slice of a whole
    # array), so `with_xla_us` is an upper bound.
    xla = sum(machine.work_seconds(b, byt) for b, byt in model["xla"])
    fixed = model["outside_bundles"] / clock
    pooled = machine.work_seconds(bundles, hbm_bytes, mxu_flops)
    work = pooled
    if step_work is not None:
        per_step = None
        if "trips" in step_work:  # each step's bundles by its own trip counts
            given = {k for k, v in trips.items() if v is not None} - {"flops_per_hot_iteration"}
            mxu = np.asarray(step_work["mxu"], float)
            per_step = []
            for mxu_i, t in zip(mxu / mxu.sum() if mxu.sum() > 0 else mxu, step_work["trips"]):
                if set(t) != given:
                    raise ValueError(
                        f"step_work trips: each step needs the call's trip counts ({sorted(given)})"
                        f", got {sorted(t)}"
                    )
                per_step.append(
                    _call_bundles(
                        model,
                        regions,
                        mxu_flops=mxu_flops * mxu_i,
                        grid_steps=1.0,
                        flops_per_hot_iteration=trips["flops_per_hot_iteration"],
                        **t,
                    )[0]
                )
        work = _overlapped_per_step(model, step_work, t_b, t_mxu, t_d, per_step)
    total = work + t_steps + fixed
    return {
        "scheduled_us": round(total * 1e6, 3),
        # the call's work pooled into one step (the rule without `step_work`)
        **({"pooled_work_us": round(pooled * 1e6, 3)} if step_work is not None else {}),
        "with_xla_us": round((total + xla) * 1e6, 3),
        "compute_us": round(t_c * 1e6, 3),
        "bundle_us": round(t_b * 1e6, 3),
        "mxu_floor_us": round(t_mxu * 1e6, 3),
        "dma_us": round(t_d * 1e6, 3),
        "step_overhead_us": round(t_steps * 1e6, 3),
        "fixed_us": round(fixed * 1e6, 3),
        "xla_us": round(xla * 1e6, 3),
        "hot_iterations": round(iterations, 1),
        # the regions charged by how often they run, not per step (0: none found, or a cached
        # model without regions, or no count passed)
        "per_tile_region_bundles": (
            regions["first"]
            + regions["last"]
            + ((trips["output_loop_trips"] or 1) - 1) * regions.get("first_last_loops", 0)
            if trips["output_tiles"] is not None
            else 0
        ),
        # the weight-prepare region, charged by prepare_runs (0: none found or none passed)
        "prepare_region_bundles": regions.get("prepare", 0) if trips["prepare_runs"] else 0,
        "side_bundles": (
            regions["sides"]
            if trips["last_side_runs"] is not None and model.get("hot_is_grid")
            else []
        ),
        "clock_hz": clock,
        "bound": "DMA" if t_d > t_c else ("MXU" if t_mxu >= t_b else "bundles"),
        # the step's rolled loops, charged by their trips (only where a kernel passes them)
        **({"loop_bundles": round(loop_bundles)} if trips["loop_trips"] is not None else {}),
        # the grid steps' code around their item loops (only where a kernel runs one)
        **({"block_bundles": round(block)} if items_in_step else {}),
    }


def _call_bundles(
    model: dict,
    regions: dict,
    *,
    mxu_flops: float,
    grid_steps: float,
    flops_per_hot_iteration: float | None = None,
    hot_iterations: float | None = None,
    side_region_runs: float | Sequence[float] | None = None,
    branch_runs: Sequence[float] | None = None,
    branch_pushes: Sequence[float] | None = None,
    output_tiles: float | None = None,
    output_loop_trips: float | None = None,
    last_side_runs: float | None = None,
    loop_trips: Sequence[float | tuple[float, float]] | None = None,
    work_items: float | None = None,
    block_loop_trips: Sequence[float | tuple[float, float]] | None = None,
    prepare_runs: float | None = None,
) -> tuple[float, float, float, float]:
    """The bundles `scheduled_from_work` charges for its trip counts (the call's, or one grid
    step's for `step_work`'s "trips"; `regions` is `step_regions(model)`): (bundles, hot
    iterations, bundles of the step's rolled loops by their trips, the item loop's grid-step
    code)."""
    paths = model.get("mxu_branches") or []
    for name, per_path in (("branch_runs", branch_runs), ("branch_pushes", branch_pushes)):
        if per_path is not None and len(paths) != len(per_path):
            raise ValueError(
                f"{name} has {len(per_path)} entries; the schedule has "
                f"{len(paths)} alternative MXU paths"
            )
    items_in_step = bool(model.get("items_in_step"))
    if items_in_step != (work_items is not None):
        raise ValueError(
            "work_items goes with a schedule model read with item_loop=True, and only with one: "
            "recompile the row (schedule_rows.py)"
        )
    # Grid steps: the per-step overhead and, for an item loop, the code around it.
    block_steps = grid_steps
    block = 0.0
    if items_in_step:
        grid_steps = work_items  # the model's steps are the items from here on
        block_looped, block = 0.0, 0.0  # without trips: each loop read once per grid step
        if block_loop_trips is not None:
            block_looped, block = _charge_loops(
                model["block_loops"], block_loop_trips, "block_loop_trips"
            )
        block += block_steps * (model["block_bundles"] - block_looped)
    # Bundles of the step's own rolled loops, charged by their trips rather than once per step.
    looped, loop_bundles = 0.0, 0.0
    if loop_trips is not None:
        loops = model.get("step_loops")
        if loops is None or not model.get("hot_is_grid") or branch_pushes is not None:
            raise ValueError(
                "loop_trips needs a schedule model with step_loops whose hot loop is the grid "
                "loop: recompile the row (schedule_rows.py)"
            )
        looped, loop_bundles = _charge_loops(loops, loop_trips, "loop_trips")
    if hot_iterations is not None:
        iterations = hot_iterations
    elif branch_runs is not None:
        iterations = float(sum(branch_runs))
    elif branch_pushes is not None:
        iterations = float(sum(branch_pushes))  # reported as pushes
    else:
        iterations = mxu_flops / flops_per_hot_iteration
    # A rolled loop inside init / finalize (one iteration in the regions' bundles) runs
    # `output_loop_trips` iterations per output tile: the iterations past the first.
    per_tile = regions["first"] + regions["last"]
    if output_loop_trips is not None:
        per_tile += (output_loop_trips - 1) * regions.get("first_last_loops", 0)
    if branch_pushes is not None:
        shared = model["step_bundles"] - sum(b for b, _ in paths)
        once = 0.0
        if output_tiles is not None:  # init / write-out once per output tile (a q block)
            shared -= regions["first"] + regions["last"]
            once = output_tiles * per_tile
        bundles = (
            grid_steps * shared
            + once
            + sum(n * b / p for n, (b, p) in zip(branch_pushes, paths) if n)
        )
    elif model.get("hot_is_grid") and branch_runs is not None:
        busy = float(sum(branch_runs))
        shared = model["step_bundles"] - sum(b for b, _ in paths) - looped
        bundles = (
            busy * shared
            + sum(n * b for n, (b, _) in zip(branch_runs, paths))
            + (grid_steps - busy) * (model["idle_step_bundles"] - looped)
            + loop_bundles
        )
    elif model.get("hot_is_grid"):
        busy = min(iterations, grid_steps)
        step, once = model["step_bundles"] - looped, loop_bundles
        idle = model["idle_step_bundles"] - looped
        if output_tiles is not None:
            step -= regions["first"] + regions["last"]
            once += output_tiles * per_tile
        if prepare_runs is not None:
            step -= regions.get("prepare", 0)
            once += prepare_runs * regions.get("prepare", 0)
        if last_side_runs is not None and regions["sides"]:
            last = min(last_side_runs, busy)
            step -= sum(regions["sides"])
            once += last * max(regions["sides"]) + (busy - last) * min(regions["sides"])
        bundles = busy * step + once + (grid_steps - busy) * idle
    else:
        if model["per_step_overhead_bundles"] < 0:
            # regions counted twice when the model was read (a cache entry from before the nest's
            # own regions were left out of the side regions): a time from it would be too low
            raise ValueError(
                f"negative per-step bundles ({model['per_step_overhead_bundles']}) in a schedule "
                "model: recompile the row"
            )
        per_step, once = model["per_step_overhead_bundles"], 0.0
        if output_tiles is not None:
            per_step -= regions["first"] + regions["last"]
            once = output_tiles * per_tile
        if prepare_runs is not None:
            # a busy step's weight-prepare region (charged per grid step above) runs only
            # `prepare_runs` times: the gmm's with one K block, once per run of a group's items
            per_step -= regions.get("prepare", 0)
            once += prepare_runs * regions.get("prepare", 0)
        bundles = (
            grid_steps * per_step
            + once
            + iterations * model["hot_bundles"]
            + _side_bundles(model, side_region_runs)
        )
    bundles += block
    return bundles, iterations, loop_bundles, block


def _side_bundles(model: dict, runs) -> float:
    """Bundles of the side regions' runs: `runs` a count charged at the regions' mean, or one
    count per side region (program order: a tail window's bucket) charged at each region's own
    bundles (`side_region_bundles`, recorded since the models of benchmarks/tgmm_schedule.py)."""
    if runs is None:
        return 0.0
    if np.ndim(runs) == 0:
        return float(runs) * model.get("side_region_mean_bundles", 0.0)
    sizes = model.get("side_region_bundles")
    if sizes is None or len(sizes) != len(runs):
        raise ValueError(
            f"side_region_runs has {len(runs)} entries; the schedule model has "
            f"{'no per-region sizes' if sizes is None else f'{len(sizes)} side regions'}: "
            "pass one count, or recompile the row"
        )
    return float(np.dot(np.asarray(runs, float), np.asarray(sizes, float)))


def _overlapped_per_step(
    model: dict,
    step_work: dict,
    t_b: float,
    t_mxu: float,
    t_d: float,
    step_bundles: Sequence[float] | None = None,
):
    """Seconds of `scheduled_from_work`'s `step_work` rule: the pooled bundle time `t_b`, MXU
    floor `t_mxu` and DMA time `t_d` spread over the grid steps by the steps' own weights (the
    bundles of each step's trips, `step_bundles`, where given), each step's compute overlapped
    with its neighbours' copies (double buffering) and its own streamed copies."""
    hot = np.asarray(step_work["hot"], float)
    n = hot.shape[0]
    side = np.asarray(step_work.get("side", np.zeros(n)), float)
    # "side" per step, or per step and side region (`side_region_runs` per region): in bundles
    side_bundles = (
        side * model.get("side_region_mean_bundles", 0.0)
        if side.ndim == 1
        else np.array([_side_bundles(model, runs) for runs in side])
    )
    arrays = {
        "side": side_bundles,
        "streams": np.asarray(step_work.get("streams", np.zeros(n)), float),
        **{k: np.asarray(step_work[k], float) for k in ("mxu", "reads", "writes")},
    }
    if step_bundles is not None:
        arrays["step_bundles"] = np.asarray(step_bundles, float)
    if n == 0 or any(a.shape != (n,) for a in arrays.values()):
        raise ValueError(
            f"step_work: one value per grid step for every key, got {step_work.keys()}"
        )
    if step_bundles is not None:
        bundles = arrays["step_bundles"]
    elif model.get("hot_is_grid"):
        bundles = np.where(hot > 0, model["step_bundles"], model["idle_step_bundles"])
    else:
        bundles = model["per_step_overhead_bundles"] + hot * model["hot_bundles"] + side_bundles
    share = lambda a: a / a.sum() if a.sum() > 0 else np.full(n, 1.0 / n)  # noqa: E731
    compute = np.maximum(share(bundles) * t_b, share(arrays["mxu"]) * t_mxu)
    moved = arrays["reads"].sum() + arrays["writes"].sum() + arrays["streams"].sum()
    per_byte = t_d / moved if moved > 0 else 0.0
    # step i's compute hides the copies in for step i + 1, the write-back of step i - 1 and the
    # copies it streams itself (the tile ranking's rule, tpu_generations)
    return overlapped_step_seconds(
        compute,
        arrays["reads"] * per_byte,
        arrays["writes"] * per_byte,
        arrays["streams"] * per_byte,
    )


def _charge_loops(loops, trips_per_loop, name: str) -> tuple[float, float]:
    """(bundles of `loops` as a static count reads them, their bundles by `trips_per_loop`, the
    argument `name`): each loop's own bundles per iteration and its forward branches' per run."""
    if len(loops) != len(trips_per_loop):
        where = "item loop's grid step" if name == "block_loop_trips" else "step"
        raise ValueError(
            f"{name} has {len(trips_per_loop)} entries; the schedule's {where} has "
            f"{len(loops)} rolled loops outside its MXU paths"
        )
    charged = 0.0
    for value, (_, _, own, _, _, branches) in zip(trips_per_loop, loops):
        trips, runs = value if isinstance(value, (tuple, list)) else (value, value)
        charged += trips * (own - branches) + runs * branches
    return float(sum(lp[2] for lp in loops)), charged


# The trip-count keywords scheduled_from_work takes: _call_bundles' optional parameters.
TRIP_KEYS = tuple(
    p.name
    for p in inspect.signature(_call_bundles).parameters.values()
    if p.default is not inspect.Parameter.empty
)
