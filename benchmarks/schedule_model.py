"""Scheduled time of one kernel call, from the compiler's own VLIW schedule (llo_schedule.py).

A Mosaic kernel is a loop over grid steps (the grid loop) holding straight-line code, predicated
regions (`pl.when` bodies, the two sides of a branch) and the kernel's own rolled loops. A call's
time is what its grid steps execute:

    scheduled = prologue/epilogue bundles / clock
              + sum over step kinds: count x max(bundles one such step executes / clock,
                                                 HBM bytes one such step moves / bandwidth)
              + XLA ops around the kernel (their bundles / clock, once each)

The bundles a step executes are the grid loop's skeleton (its own bundles outside every
top-level predicated region), the predicated regions that kind of step takes, and each inner
loop's body bundles times its trip count. Which regions a step takes and how many iterations its
loops run is the one kernel-specific part (`StepKind`): it comes from the host-side work lists
our kernels build, or from an anchor's own schedule metadata (splash's mask blocks, megablox's
group metadata).

The DMA term overlaps with compute per step (double buffering hides one behind the other); a
step whose bytes take longer than its bundles is memory-bound. One bundle per cycle is a lower
bound: stalls (DMA waits beyond the overlap, MXU result latency the scheduler did not hide)
stay unmodelled, which is why the clocks are validated against real TPU times
(benchmarks/validate_schedule.py, ../shared/reference/data/). Every time here is "scheduled",
never "measured".
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from llo_schedule import Loop, Region, Schedule


@dataclasses.dataclass
class StepKind:
    """A kind of grid step and how many of them a call runs.

    regions: indices into `Schedule.regions()` (the grid loop's top-level predicated regions, in
        program order) that this kind of step executes, nested regions included; None = all of
        them (a step that takes every conditional body: an upper bound).
    nested: for a taken region whose own nested regions are not all taken, {region index:
        indices of its children taken} (default: all children).
    loop_trips: iterations per step of the grid loop's inner loops, by index in program order
        (`Schedule.grid_loop().children`); a loop not listed runs once.
    dma_bytes: HBM bytes one such step moves (reads + writes).
    """

    name: str
    count: float
    regions: Sequence[int] | None = None
    nested: dict[int, Sequence[int]] = dataclasses.field(default_factory=dict)
    loop_trips: dict[int, float] = dataclasses.field(default_factory=dict)
    dma_bytes: float = 0.0


@dataclasses.dataclass
class ScheduledTime:
    seconds: float
    compute_seconds: float  # sum of the steps' bundle times (no overlap)
    dma_seconds: float  # sum of the steps' DMA times
    fixed_seconds: float  # prologue/epilogue and XLA ops around the kernel
    per_kind: dict[str, dict]
    bound: str  # "DMA" when most of the time is memory-bound steps, else the hot loop's unit

    def as_dict(self) -> dict:
        return {"scheduled_us": round(self.seconds * 1e6, 3),
                "compute_us": round(self.compute_seconds * 1e6, 3),
                "dma_us": round(self.dma_seconds * 1e6, 3),
                "fixed_us": round(self.fixed_seconds * 1e6, 3),
                "bound": self.bound, "per_kind": self.per_kind}


def xla_seconds(xla: Sequence[Schedule], clock_hz: float, hbm_bytes_per_s: float) -> float:
    """XLA's own ops around a kernel (work-list builders, pads, casts): each at least its bundles
    once and at least its HBM operands' bytes (their loops' trip counts are not in the dump)."""
    return sum(max(len(x.bundles) / clock_hz, x.hbm_operand_bytes / hbm_bytes_per_s) for x in xla)


def _region_bundles(sched: Schedule, r: Region, taken_children) -> int:
    """Bundles of region r when its children in `taken_children` (indices) run, the others not."""
    skipped = sum(c.bundles for i, c in enumerate(r.children)
                  if taken_children is not None and i not in taken_children)
    return r.bundles - skipped


def _loops_in(lp_list: Sequence[Loop], start: int, end: int) -> list[int]:
    return [i for i, lp in enumerate(lp_list) if start <= lp.start and lp.end <= end]


def step_bundles(sched: Schedule, kind: StepKind) -> float:
    """Bundles one step of `kind` executes."""
    grid = sched.grid_loop()
    if grid is None:  # a one-step kernel: the whole program
        return float(len(sched.bundles))
    regions = sched.regions(grid)
    children = grid.children
    taken = set(range(len(regions))) if kind.regions is None else set(kind.regions)
    # Start from the whole grid-loop body, take out the regions not executed, then account the
    # inner loops: their body counts once in the static bundles, so add (trips - 1) x body, and
    # loops inside skipped regions run zero times.
    total = float(grid.bundles)
    skipped_ranges = []
    for i, r in enumerate(regions):
        if i not in taken:
            total -= r.bundles
            skipped_ranges.append((r.start, r.end))
            continue
        kids = kind.nested.get(i)
        for j, c in enumerate(r.children):
            if kids is not None and j not in kids:
                total -= c.bundles
                skipped_ranges.append((c.start, c.end))
    for j, lp in enumerate(children):
        if any(a <= lp.start and lp.end <= b for a, b in skipped_ranges):
            continue  # already taken out with its region
        trips = kind.loop_trips.get(j, 1.0)
        total += (trips - 1.0) * lp.bundles
    return max(total, 0.0)


def scheduled_time(sched: Schedule, kinds: Sequence[StepKind], clock_hz: float,
                   hbm_bytes_per_s: float, xla: Sequence[Schedule] = ()) -> ScheduledTime:
    grid = sched.grid_loop()
    outside = len(sched.bundles) - (grid.bundles if grid else len(sched.bundles))
    fixed = outside / clock_hz + xla_seconds(xla, clock_hz, hbm_bytes_per_s)
    compute = dma = total = 0.0
    per_kind = {}
    mem_bound_time = 0.0
    for k in kinds:
        b = step_bundles(sched, k)
        t_c, t_d = b / clock_hz, k.dma_bytes / hbm_bytes_per_s
        step = max(t_c, t_d)
        compute += k.count * t_c
        dma += k.count * t_d
        total += k.count * step
        if t_d > t_c:
            mem_bound_time += k.count * step
        per_kind[k.name] = {"count": k.count, "bundles_per_step": round(b, 1),
                            "dma_bytes_per_step": k.dma_bytes,
                            "bound": "DMA" if t_d > t_c else "bundles"}
    hot = sched.hot_loop()
    unit = sched.loop_segment(hot, own=True).bound() if hot else "VALU"
    bound = "DMA" if mem_bound_time > 0.5 * total else unit
    return ScheduledTime(total + fixed, compute, dma, fixed, per_kind, bound)


def _top_child_containing(grid: Loop, lp: Loop) -> Loop | None:
    for c in grid.children:
        if c.start <= lp.start and lp.end <= c.end:
            return c
    return None


def scheduled_from_work(sched: Schedule, *, mxu_flops: float, grid_steps: float,
                        hbm_bytes: float, flops_per_hot_iteration: float, clock_hz: float,
                        hbm_bytes_per_s: float, xla: Sequence[Schedule] = ()) -> ScheduledTime:
    """Scheduled time from the hot loop's cost per unit of MXU work, for kernels whose trip
    counts are data-dependent (work lists, dynamic loop bounds).

    The call's MXU work (`mxu_flops`, issued FLOPs from the kernel's closed form, which the tests
    check against the TPU interpreter) is divided into hot-loop iterations of
    `flops_per_hot_iteration` each (the compute tile one iteration multiplies, which the caller
    knows from its tiling); each costs the hot loop's own bundles. Every grid step also pays the
    grid loop's bundles outside the loop nest holding the hot loop (when the hot loop is the grid
    loop itself, a step with no MXU work pays the bundles outside its MXU regions). The DMA term
    overlaps per step with the average step's bundles.

    Left out, and said so where used: loop levels between the grid and the hot loop (their own
    per-iteration bundles), and the difference between masked edge tiles and interior tiles when
    they compile to different loops (the hot loop is the one with the most MXU pushes).
    """
    grid = sched.grid_loop()
    hot = sched.hot_loop()
    if grid is None or hot is None:
        raise ValueError(f"{sched.name}: no grid loop or no MXU work in the schedule")
    iterations = mxu_flops / flops_per_hot_iteration if flops_per_hot_iteration else 0.0
    if hot is grid:
        mxu_regions = [r for r in sched.regions(grid) if sched.region_segment(r).mxu_pushes]
        idle_step = grid.bundles - sum(r.bundles for r in mxu_regions)
        busy = min(iterations, grid_steps)
        compute_bundles = busy * grid.bundles + (grid_steps - busy) * idle_step
        per_step_overhead = idle_step
        hot_bundles = grid.bundles
    else:
        nest = _top_child_containing(grid, hot) or hot
        per_step_overhead = grid.bundles - nest.bundles
        hot_bundles = hot.own_bundles
        compute_bundles = grid_steps * per_step_overhead + iterations * hot_bundles
    outside = len(sched.bundles) - grid.bundles
    fixed = outside / clock_hz + xla_seconds(xla, clock_hz, hbm_bytes_per_s)
    t_c = compute_bundles / clock_hz
    t_d = hbm_bytes / hbm_bytes_per_s
    steps = max(grid_steps, 1.0)
    # Per step max(compute, DMA) with the average step: memory-bound steps hide their bundles.
    body = steps * max(t_c / steps, t_d / steps)
    unit = sched.loop_segment(hot, own=True).bound()
    bound = "DMA" if t_d > t_c else unit
    per_kind = {"hot": {"iterations": round(iterations, 2), "bundles_per_iteration": hot_bundles,
                        "per_step_overhead_bundles": per_step_overhead,
                        "grid_steps": grid_steps}}
    return ScheduledTime(body + fixed, t_c, t_d, fixed, per_kind, bound)
