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
from collections.abc import Sequence

from llo_schedule import Loop, Schedule


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
        return {
            "scheduled_us": round(self.seconds * 1e6, 3),
            "compute_us": round(self.compute_seconds * 1e6, 3),
            "dma_us": round(self.dma_seconds * 1e6, 3),
            "fixed_us": round(self.fixed_seconds * 1e6, 3),
            "bound": self.bound,
            "per_kind": self.per_kind,
        }


def xla_seconds(xla: Sequence[Schedule], clock_hz: float, hbm_bytes_per_s: float) -> float:
    """XLA's own ops around a kernel (work-list builders, pads, casts): each at least its bundles
    once and at least its HBM operands' bytes (their loops' trip counts are not in the dump)."""
    return sum(max(len(x.bundles) / clock_hz, x.hbm_operand_bytes / hbm_bytes_per_s) for x in xla)


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


def scheduled_time(
    sched: Schedule,
    kinds: Sequence[StepKind],
    clock_hz: float,
    hbm_bytes_per_s: float,
    xla: Sequence[Schedule] = (),
    step_overhead_s: float = 0.0,
) -> ScheduledTime:
    """Scheduled time from explicit step kinds (the anchors' own schedule metadata, or a work
    list walked on the host): per step max(bundles / clock, DMA bytes / bandwidth) plus the fixed
    per-step cost, plus the bundles outside the grid loop and XLA's ops around the kernel."""
    grid = sched.grid_loop()
    outside = len(sched.bundles) - (grid.bundles if grid else len(sched.bundles))
    fixed = outside / clock_hz + xla_seconds(xla, clock_hz, hbm_bytes_per_s)
    compute = dma = total = 0.0
    per_kind = {}
    mem_bound_time = 0.0
    for k in kinds:
        b = step_bundles(sched, k)
        t_c, t_d = b / clock_hz, k.dma_bytes / hbm_bytes_per_s
        step = max(t_c, t_d) + step_overhead_s
        compute += k.count * t_c
        dma += k.count * t_d
        total += k.count * step
        if t_d > t_c:
            mem_bound_time += k.count * step
        per_kind[k.name] = {
            "count": k.count,
            "bundles_per_step": round(b, 1),
            "dma_bytes_per_step": k.dma_bytes,
            "bound": "DMA" if t_d > t_c else "bundles",
        }
    hot = sched.hot_loop()
    unit = sched.loop_segment(hot, own=True).bound() if hot else "VALU"
    bound = "DMA" if mem_bound_time > 0.5 * total else unit
    return ScheduledTime(total + fixed, compute, dma, fixed, per_kind, bound)


def _mxu_branches(sched: Schedule, regions) -> list:
    """The alternative MXU paths of a grid step, in program order: descend from the step's
    MXU regions while a single region holds all the MXU work (a `pl.when(valid)` wrapper); the
    first level where the work splits over several sibling regions is the set of paths one step
    chooses from (e.g. the paged kernel's narrow decode path and its whole-q-block path). Empty
    when the MXU work never splits."""
    while len(regions) == 1:
        regions = [c for c in regions[0].children if sched.region_segment(c).mxu_pushes]
    return regions if len(regions) > 1 else []


def _top_child_containing(grid: Loop, lp: Loop) -> Loop | None:
    for c in grid.children:
        if c.start <= lp.start and lp.end <= c.end:
            return c
    return None


def work_model_inputs(sched: Schedule, xla: Sequence[Schedule] = ()) -> dict:
    """What `scheduled_from_work` needs of a compiled schedule, as plain numbers (cacheable)."""
    grid, hot = sched.grid_loop(), sched.hot_loop()
    out = {
        "outside_bundles": len(sched.bundles) - (grid.bundles if grid else 0),
        "xla": [[len(x.bundles), x.hbm_operand_bytes] for x in xla],
    }
    if grid is None or hot is None:
        return out
    if hot is grid:
        mxu_regions = [r for r in sched.regions(grid) if sched.region_segment(r).mxu_pushes]
        out.update(
            hot_is_grid=True,
            step_bundles=grid.bundles,
            idle_step_bundles=grid.bundles - sum(r.bundles for r in mxu_regions),
            mxu_branches=[
                [r.bundles, sched.region_segment(r).mxu_pushes]
                for r in _mxu_branches(sched, mxu_regions)
            ],
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
                elif sched.region_segment(r).mxu_pushes:
                    side.append(r)

        collect(sched.regions(grid))
        side_bundles = [r.bundles for r in side]
        out.update(
            hot_is_grid=False,
            hot_bundles=hot.own_bundles,
            per_step_overhead_bundles=grid.bundles - nest.bundles - sum(side_bundles),
            side_region_mean_bundles=(
                sum(side_bundles) / len(side_bundles) if side_bundles else 0.0
            ),
        )
    return out


def scheduled_from_work(
    model: dict,
    *,
    mxu_flops: float,
    grid_steps: float,
    hbm_bytes: float,
    generation,
    flops_per_hot_iteration: float | None = None,
    hot_iterations: float | None = None,
    side_region_runs: float | None = None,
    branch_runs: Sequence[float] | None = None,
) -> dict:
    """Scheduled time from the hot loop's cost per unit of MXU work, for kernels whose trip
    counts are data-dependent (work lists, dynamic loop bounds). `model` is
    `work_model_inputs(schedule)`; `generation` a tpu_generations.TpuGeneration.

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
    tiles, each charged the mean bundles of those regions) passes them instead of
    `flops_per_hot_iteration`; without them every FLOP is charged at the hot loop's rate.

    A kernel whose hot loop is the grid loop and whose steps choose one of several MXU paths
    (`mxu_branches` in `model`, program order) passes `branch_runs`, the number of steps taking
    each path (from its work list): a busy step then costs the step's bundles without the paths
    plus the path it takes, instead of every path's bundles.

    Left out, and said so where used: loop levels between the grid and the hot loop (their own
    per-iteration bundles), and the spread between the side regions (their mean is charged).
    """
    clock, bw = generation.clock_hz, generation.hbm_bytes_per_s
    if hot_iterations is not None:
        iterations = hot_iterations
    elif branch_runs is not None:
        iterations = float(sum(branch_runs))
    else:
        iterations = mxu_flops / flops_per_hot_iteration
    if model.get("hot_is_grid") and branch_runs is not None:
        paths = model.get("mxu_branches") or []
        if len(paths) != len(branch_runs):
            raise ValueError(
                f"branch_runs has {len(branch_runs)} entries; the schedule has "
                f"{len(paths)} alternative MXU paths"
            )
        busy = float(sum(branch_runs))
        shared = model["step_bundles"] - sum(b for b, _ in paths)
        bundles = (
            busy * shared
            + sum(n * b for n, (b, _) in zip(branch_runs, paths))
            + (grid_steps - busy) * model["idle_step_bundles"]
        )
    elif model.get("hot_is_grid"):
        busy = min(iterations, grid_steps)
        bundles = busy * model["step_bundles"] + (grid_steps - busy) * model["idle_step_bundles"]
    else:
        bundles = (
            grid_steps * model["per_step_overhead_bundles"]
            + iterations * model["hot_bundles"]
            + (side_region_runs or 0.0) * model.get("side_region_mean_bundles", 0.0)
        )
    t_b = bundles / clock
    t_mxu = mxu_flops / generation.bf16_flops
    t_c = max(t_b, t_mxu)
    t_d = hbm_bytes / bw
    t_steps = grid_steps * generation.step_overhead_s
    # XLA's ops around the kernel are reported beside the kernel's time, not in it: their HBM
    # operands' bytes overcount ops that touch part of an operand (a batch slice of a whole
    # array), so `with_xla_us` is an upper bound.
    xla = sum(max(b / clock, byt / bw) for b, byt in model["xla"])
    fixed = model["outside_bundles"] / clock
    total = max(t_c, t_d) + t_steps + fixed
    return {
        "scheduled_us": round(total * 1e6, 3),
        "with_xla_us": round((total + xla) * 1e6, 3),
        "compute_us": round(t_c * 1e6, 3),
        "bundle_us": round(t_b * 1e6, 3),
        "mxu_floor_us": round(t_mxu * 1e6, 3),
        "dma_us": round(t_d * 1e6, 3),
        "step_overhead_us": round(t_steps * 1e6, 3),
        "fixed_us": round(fixed * 1e6, 3),
        "xla_us": round(xla * 1e6, 3),
        "hot_iterations": round(iterations, 1),
        "clock_hz": clock,
        "bound": "DMA" if t_d > t_c else ("MXU" if t_mxu >= t_b else "bundles"),
    }
