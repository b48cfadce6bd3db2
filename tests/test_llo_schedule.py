"""The compiled-schedule reader (benchmarks/llo_schedule.py) and the scheduled-time model
(benchmarks/schedule_model.py).

The parser is checked on a hand-written dump whose loops, regions and slot counts are known; the
compile tests run libtpu's real scheduler on kernels whose schedule is known in kind: a plain
block matmul is MXU-bound with high MXU occupancy, its bundles grow linearly with the unrolled
contraction, a predicated region is found and can be left out of a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tpu_compile

ROOT = Path(__file__).resolve().parent.parent

import llo_schedule as L  # noqa: E402
import schedule_model as M  # noqa: E402

# A grid loop (depth 1) holding a predicated region with an inner loop (depth 2): bundles 0-1
# prologue, 2-9 grid loop body, 10 epilogue. Bundle 3 branches over region 7 (bundles 4-7);
# bundles 5-6 are the inner loop; bundle 6 is an empty delay slot with no depth marker.
_BUNDLES = """= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 } /* Start region 1 */
   0x1   :  { %s2 = smov 0 }
   0x2 LB: > { %v3 = vld [vmem:[%s1] sm:$0xff] }
   0x3   : > { %4 = sbr.rel (%p1) target = $region7 }
   0x4   : > { %v5 = vmatmul.mubr.bf16.gmra.mxu0 %v3  ;;  %v6 = vadd.f32 %v3, %v3 }
   0x5 LB: >> { %v7 = vmatmul.mubr.bf16.gmra.mxu0 %v3  ;;  %8 = dma.hbm_to_vmem [thread:$0]  (%p2),
  /*hbm=*/%s9, /*size_in_granules=*/16 }
   0x6   :  {}
   0x7   : > { %v9 = vpop.f32.mrf.mxu0 } /* End region 6 */
   0x8 PF: > { %v10 = vpow2.f32 %v9 } /* Start/End empty region 7 */
   0x9   : > { %11 = sbr.rel (%p3) target = $region2 }
   0xa   :  { %12 = vsyncpa [#allocation3], 0 }
"""
_UTIL = """== CAPACTIY:
MXU, XLU, VALU, VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU
    2     2     4     2     1     3     3     2     2     2
== UTILIZATION:
0 0 0 0 0 0 0 0 0 1
0 0 0 0 0 0 0 0 0 1
0 0 0 0 0 1 0 0 0 0
0 0 0 0 0 0 0 0 0 1
1 0 1 0 0 0 0 0 0 0
1 0 0 0 0 0 0 0 0 0
0 0 0 0 0 0 0 0 0 0
0 0 0 1 0 0 0 0 0 0
0 0 0 0 1 0 0 0 0 0
0 0 0 0 0 0 0 0 0 1
0 0 0 0 0 0 0 0 0 1
"""


def _synthetic() -> L.Schedule:
    bundles = L.parse_bundles(_BUNDLES)
    caps, util = L.parse_utilization(_UTIL)
    return L.Schedule("synthetic", bundles, util, caps, "v6e")


def test_parser_bundles_loops_and_slots():
    s = _synthetic()
    assert len(s.bundles) == 11
    assert s.bundles[5].ops == ("vmatmul.mubr.bf16.gmra.mxu0", "dma.hbm_to_vmem")  # two lines
    assert s.bundles[6].depth == 2  # the empty delay slot joins the loop before it
    grid = s.grid_loop()
    assert (grid.start, grid.end, grid.depth) == (2, 10, 1)
    (inner,) = grid.children
    assert (inner.start, inner.end, inner.depth) == (5, 7, 2)
    assert grid.own_bundles == 6
    seg = s.loop_segment(grid)
    assert seg.mxu_pushes == 2 and seg.ops["vpow2"] == 1 and seg.ops["dma"] == 1
    assert seg.slots["MXU"] == 2 and seg.occupancy("MXU") == pytest.approx(2 / (2 * 8))
    assert s.hot_loop() is inner  # the innermost loop with MXU pushes
    (region,) = s.regions()
    assert (region.branch, region.start, region.end) == (3, 4, 8)
    assert region.target_region == 7


def test_one_step_rule_bounds_each_step_by_its_fullest_unit():
    """schedule_model.Machine: a step costs the largest of its bundles, DMA and MXU floor, plus
    the fixed step overhead; the rows, the anchors and the validation all use this rule."""
    m = M.Machine(clock_hz=1e9, hbm_bytes_per_s=2e9, mxu_flops_per_s=4e9, step_overhead_s=1e-9)
    assert m.step_seconds(100) == pytest.approx(101e-9)  # bundles
    assert m.step_seconds(100, dma_bytes=1000) == pytest.approx(501e-9)  # DMA-bound
    assert m.step_seconds(100, 1000, mxu_flops=4000) == pytest.approx(1001e-9)  # MXU floor

    class Gen:
        clock_hz, hbm_bytes_per_s, bf16_flops, step_overhead_s = 1e9, 2e9, 4e9, 1e-9

    # two cores sharing a chip each get half its bandwidth and peak
    assert M.Machine.of(Gen, cores=2) == M.Machine(1e9, 1e9, 2e9, 1e-9)
    # scheduled_from_work applies the rule to the call's pooled work, plus each step's overhead
    s = _synthetic()
    model = M.work_model_inputs(s)
    t = M.scheduled_from_work(
        model, mxu_flops=0.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, hot_iterations=10
    )
    want = 10 * model["per_step_overhead_bundles"] + 10 * model["hot_bundles"]
    want += model["outside_bundles"]
    assert t["scheduled_us"] == pytest.approx((want + 10) * 1e-3)
    dma = M.scheduled_from_work(
        model, mxu_flops=0.0, grid_steps=10, hbm_bytes=1e6, generation=Gen, hot_iterations=10
    )
    assert dma["bound"] == "DMA"
    assert dma["scheduled_us"] == pytest.approx(500 + (10 + model["outside_bundles"]) * 1e-3)


def test_side_regions_are_charged_per_region_where_the_runs_say_which():
    """`side_region_runs` as one count per side region (a tgmm tail's bucket, program order):
    each region's runs at its own bundles, in the call's total and in each step's share, where
    one count charges the regions' mean; a model without per-region sizes refuses a list."""
    import numpy as np

    class Gen:  # one bundle per ns, no DMA or MXU floor, no fixed per-step cost
        clock_hz, hbm_bytes_per_s, bf16_flops, step_overhead_s = 1e9, 1e30, 1e30, 0.0

    base = {"outside_bundles": 0, "xla": [], "hot_is_grid": False, "hot_bundles": 50}
    model = {**base, "per_step_overhead_bundles": 10, "side_region_mean_bundles": 200.0}
    model["side_region_bundles"] = [100, 300]

    def us(m, runs, **kw):
        t = M.scheduled_from_work(
            m, mxu_flops=0.0, grid_steps=2, hbm_bytes=0.0, generation=Gen, hot_iterations=1,
            side_region_runs=runs, **kw,
        )  # fmt: skip
        return t["scheduled_us"] * 1e3

    assert us(model, [2.0, 1.0]) == pytest.approx(2 * 10 + 50 + 2 * 100 + 300)
    assert us(model, 3.0) == pytest.approx(2 * 10 + 50 + 3 * 200)  # the mean
    # per step: step 0 runs the hot loop and a 300-bundle tail, step 1 two 100-bundle tails
    side = np.array([[0.0, 1.0], [2.0, 0.0]])
    zero = np.zeros(2)
    work = {"hot": np.array([1.0, 0.0]), "side": side, "mxu": zero, "reads": zero, "writes": zero}
    assert us(model, [2.0, 1.0], step_work=work) == pytest.approx(2 * 10 + 50 + 2 * 100 + 300)
    with pytest.raises(ValueError, match="side_region_runs has 2 entries"):
        us({**model, "side_region_bundles": None}, [2.0, 1.0])
    with pytest.raises(ValueError, match="2 side regions"):
        us(model, [1.0, 1.0, 1.0])


def test_per_step_overlap_charges_steps_whose_work_does_not_overlap():
    """`step_work`: the call's totals spread over its steps and overlapped per step. A step
    whose DMA has no compute to hide under (a new weight block for a few rows) costs more than
    the pooled rule's max(compute, DMA); steps with the same mix cost the pooled time plus the
    exposed first copy and last write-back."""
    import numpy as np

    class Gen:  # one bundle per ns, 1 byte per ns, no MXU floor, no fixed per-step cost
        clock_hz, hbm_bytes_per_s, bf16_flops, step_overhead_s = 1e9, 1e9, 1e30, 0.0

    model = M.work_model_inputs(_synthetic())
    kw = dict(mxu_flops=0.0, grid_steps=4, hbm_bytes=4000.0, generation=Gen, hot_iterations=4)
    pooled = M.scheduled_from_work(model, **kw)
    fixed_us = model["outside_bundles"] * 1e-3
    compute_us = pooled["bundle_us"]
    assert pooled["scheduled_us"] == pytest.approx(4.0 + fixed_us)  # DMA-bound: 4000 bytes
    one = np.ones(4)
    # the same mix on every step: 1 us of copies in per step, the last step's write-back none
    same = dict(hot=one, mxu=one, reads=one, writes=np.zeros(4))
    t = M.scheduled_from_work(model, step_work=same, **kw)
    # step 0's copy is exposed, steps 0-2 hide the next step's 1 us, step 3 hides nothing
    want = 1.0 + 3 * max(compute_us / 4, 1.0) + compute_us / 4
    assert t["scheduled_us"] == pytest.approx(want + fixed_us)
    assert t["pooled_work_us"] == pytest.approx(4.0)
    # all copies before a step with no compute (steps 1-3 idle of MXU work): nothing overlaps
    apart = dict(hot=np.r_[4.0, 0, 0, 0], mxu=np.r_[1.0, 0, 0, 0], reads=np.r_[0, 0, 0, 4.0],
                 writes=np.zeros(4))  # fmt: skip
    t2 = M.scheduled_from_work(model, step_work=apart, **kw)
    assert t2["scheduled_us"] > t["scheduled_us"] > pooled["scheduled_us"]
    with pytest.raises(ValueError, match="one value per grid step"):
        M.scheduled_from_work(model, step_work=dict(same, reads=np.ones(3)), **kw)


# A page-copy loop (LB at 0x2) whose back branch is printed one level out (0x4) with its delay
# slots after it at the loop's depth (0x5-0x6, the DMA in 0x6), and a window loop (LB at 0x8)
# whose delay slot after its back branch (0xa) holds a store only.
_DELAY_SLOTS = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %s2 = sadd.s32 1, %s1 }
   0x2 LB: >> { %s3 = sld [smem:[#allocation1 + %s2]] }
   0x3   : >> { %p4 = scmp.ge.s32.totalorder %s3, %s2 }
   0x4   : > { %5 = sbr.rel (!%p4) target = $region3 }
   0x5   : >> { %s6 = scalar_lea.hbm %s3, 64 }
   0x6   : >> { %7 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s6, /*size_in_granules=*/16 }
   0x7   : > { %s8 = sadd.s32 %s2, 1 }
   0x8 LB: >> { %v9 = vld [vmem:[%s1] sm:$0xff] }
   0x9   : >> { %v10 = vadd.f32 %v9, %v9 }
   0xa   : > { %11 = sbr.rel (%p4) target = $region8 }
   0xb   : >> { %12 = vst [vmem:[%s1] sm:$0xff] %v10 }
   0xc   : > { %13 = sbr.rel (%p4) target = $region1 }
   0xd   :  { %14 = vsyncpa [#allocation3], 0 }
"""


def test_a_loops_dma_in_its_delay_slots_stays_in_the_loop():
    """The page-copy loop keeps its back branch and the delay slots holding its DMA (its DMA names
    it, its bundles per page include them); a loop whose delay slots hold no DMA is read as
    before (the cached schedules' rule)."""
    bundles = L.parse_bundles(_DELAY_SLOTS)
    (outer,) = L._loop_tree(bundles)
    copies, window = outer.children
    assert (copies.start, copies.end) == (2, 7)
    assert (window.start, window.end) == (8, 10)


# A grid step that chooses one of two MXU paths inside a `pl.when(valid)` wrapper, the way the
# paged kernel picks its narrow (decode) or whole-q-block path: bundle 2 skips the wrapper
# (bundles 3-9), bundle 3 the narrow path (bundle 4), bundle 6 the wide path (bundles 7-8).
_BRANCHY = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %v2 = vld [vmem:[%s1] sm:$0xff] }
   0x2   : > { %3 = sbr.rel (%p1) target = $region9 }
   0x3   : > { %4 = sbr.rel (%p2) target = $region5 }
   0x4   : > { %v5 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x5   : > { %v6 = vadd.f32 %v2, %v2 } /* Start region 5 */
   0x6   : > { %7 = sbr.rel (%p3) target = $region7 }
   0x7   : > { %v8 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x8   : > { %v9 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x9   : > { %v10 = vpop.f32.mrf.mxu0 } /* Start region 7 */
   0xa   : > { %v11 = vpow2.f32 %v10 } /* Start region 9 */
   0xb   : > { %12 = sbr.rel (%p4) target = $region2 }
   0xc   :  { %13 = vsyncpa [#allocation3], 0 }
"""


def test_alternative_mxu_paths_charge_only_the_path_taken():
    bundles = L.parse_bundles(_BRANCHY)
    mxu = [1 if any(op.startswith("vmatmul") for op in b.ops) else 0 for b in bundles]
    util = [[m, 0, 0, 0, 0, 0, 0, 0, 0, 1] for m in mxu]
    s = L.Schedule("branchy", bundles, util, {u: 1 for u in L.UNITS}, "v6e")
    assert s.hot_loop() is s.grid_loop()
    model = M.work_model_inputs(s)
    assert model["step_bundles"] == 11 and model["idle_step_bundles"] == 11 - 7
    assert model["mxu_branches"] == [[1, 1], [2, 2]]  # narrow, then wide (program order)

    class Gen:  # one bundle per ns, 1 byte per ns, no fixed per-step cost
        clock_hz, hbm_bytes_per_s, bf16_flops, step_overhead_s = 1e9, 1e9, 1e30, 0.0

    # 6 narrow steps, 2 wide ones, 2 idle: a busy step pays the step without either path plus
    # the path it takes; an idle step pays what lies outside the wrapper.
    t = M.scheduled_from_work(
        model, mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, branch_runs=[6, 2]
    )
    shared = 11 - 1 - 2
    want = 6 * (shared + 1) + 2 * (shared + 2) + 2 * 4 + 2  # + prologue and epilogue bundles
    assert t["scheduled_us"] == pytest.approx(want * 1e-3)
    # Charging every path on every busy step (the model without branch_runs) costs more.
    every = M.scheduled_from_work(
        model, mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, hot_iterations=8
    )
    assert every["scheduled_us"] == pytest.approx((8 * 11 + 2 * 4 + 2) * 1e-3)
    # Paths with loops of their own (flash's interior path and edge walk) are charged per MXU
    # push: each path's static bundles per static push, times the pushes the work list runs
    # there, plus every step's bundles outside the paths.
    pushed = M.scheduled_from_work(
        model, mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, branch_pushes=[6, 4]
    )
    assert pushed["scheduled_us"] == pytest.approx((10 * shared + 6 * 1 / 1 + 4 * 2 / 2 + 2) * 1e-3)
    with pytest.raises(ValueError, match="branch_pushes"):
        M.scheduled_from_work(
            model, mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, branch_pushes=[8]
        )
    with pytest.raises(ValueError, match="branch_runs"):
        M.scheduled_from_work(
            model, mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=Gen, branch_runs=[8]
        )


# A gmm-like grid step (hot loop below the grid loop): a `pl.when(first)` region zeroing the
# accumulator (bundles 3-5: stores only), the hot loop (bundles 7-9), a `pl.when(last)` region
# writing the accumulator out (bundles 11-12: loads and stores). Grid loop: bundles 1-14.
_PER_TILE = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %v2 = vld [vmem:[%s1] sm:$0xff] }
   0x2   : > { %3 = sbr.rel (%p1) target = $region3 }
   0x3   : > { %4 = vst [vmem:[%s1] sm:$0xff] %v2 }
   0x4   : > { %5 = vst [vmem:[%s1] sm:$0xff] %v2 }
   0x5   : > { %6 = vst [vmem:[%s1] sm:$0xff] %v2 }
   0x6   : > { %s7 = smov 0 } /* Start region 3 */
   0x7 LB: >> { %v8 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x8   : >> { %v9 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x9   : >> { %v10 = vpop.f32.mrf.mxu0 }
   0xa   : > { %11 = sbr.rel (%p2) target = $region4 }
   0xb   : > { %v12 = vld [vmem:[%s1] sm:$0xff] }
   0xc   : > { %13 = vst [vmem:[%s1] sm:$0xff] %v12 }
   0xd   : > { %v14 = vadd.f32 %v2, %v2 } /* Start region 4 */
   0xe   : > { %15 = sbr.rel (%p3) target = $region2 }
   0xf   :  { %16 = vsyncpa [#allocation3], 0 }
"""


class _Gen:  # one bundle per ns, 1 byte per ns, no MXU floor, no fixed per-step cost
    clock_hz, hbm_bytes_per_s, bf16_flops, step_overhead_s = 1e9, 1e9, 1e30, 0.0


def _sched(text: str) -> L.Schedule:
    bundles = L.parse_bundles(text)
    mxu = [1 if any(op.startswith("vmatmul") for op in b.ops) else 0 for b in bundles]
    util = [[m, 0, 0, 0, 0, 0, 0, 0, 0, 1] for m in mxu]
    return L.Schedule("t", bundles, util, {u: 1 for u in L.UNITS}, "v6e")


def test_init_and_write_back_regions_are_charged_per_output_tile():
    """Our gmm zeroes its accumulator on an output tile's first step and writes it on the last:
    those regions run once per output tile, not once per grid step."""
    s = _sched(_PER_TILE)
    assert s.hot_loop() is not s.grid_loop()
    model = M.work_model_inputs(s)
    assert model["step_bundles"] == 14 and model["per_step_overhead_bundles"] == 11
    assert M.step_regions(model) == {
        "first": 3, "last": 2, "sides": [], "first_last_loops": 0, "prepare": 0
    }  # fmt: skip
    kw = dict(mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=_Gen, hot_iterations=10)
    t = M.scheduled_from_work(model, output_tiles=2, **kw)
    # 10 steps x (11 - 5) bundles, init + write-back on 2 output tiles, 10 hot iterations of 3,
    # prologue + epilogue
    assert t["scheduled_us"] == pytest.approx((10 * 6 + 2 * 5 + 10 * 3 + 2) * 1e-3)
    assert t["per_tile_region_bundles"] == 5
    # a rolled loop of 1 bundle inside the write-back region (flash's write-out loop per head),
    # read once there, runs 4 iterations per output tile: 3 more on each of the 2 tiles
    _, (a, b) = M.first_last_spans(model["regions"], tuple(model["work"]))
    looped = dict(model, step_loops=[[a + 1, a + 2, 1, -1, 0, 0]])
    assert M.step_regions(looped)["first_last_loops"] == 1
    t4 = M.scheduled_from_work(looped, output_tiles=2, output_loop_trips=4, **kw)
    assert t4["scheduled_us"] == pytest.approx(t["scheduled_us"] + 2 * 3 * 1e-3)
    assert t4["per_tile_region_bundles"] == 5 + 3
    # a loop outside the regions is not theirs
    outside = dict(model, step_loops=[[b + 1, b + 2, 1, -1, 0, 0]])
    assert M.step_regions(outside)["first_last_loops"] == 0
    # without the count (an implementation that does not know it) every step pays them
    per_step = M.scheduled_from_work(model, **kw)
    assert per_step["scheduled_us"] == pytest.approx((10 * 11 + 10 * 3 + 2) * 1e-3)
    # a model cached before the regions were recorded keeps the per-step charge
    old = {k: v for k, v in model.items() if k != "regions"}
    assert M.scheduled_from_work(old, output_tiles=2, **kw)["scheduled_us"] == pytest.approx(
        per_step["scheduled_us"]
    )


def test_weight_prepare_region_is_charged_by_its_runs():
    """A gmm with int8 weights and one K block widens its weight block in a region before the
    work on a group's first computing item only (`prepare_runs`), not on every grid step: the
    region that loads what it stores right before the work (`prepare_span`)."""
    model = M.work_model_inputs(_sched(_PER_TILE))
    regions = [list(r) for r in model["regions"]]
    (init,) = [r for r in regions if r[4] and not r[3] and not r[2]]
    init[3] = 3  # the zeroing region now loads what it stores: a weight copy
    prep = dict(model, regions=regions)
    assert M.step_regions(prep)["prepare"] == 3 and M.step_regions(prep)["first"] == 0
    kw = dict(mxu_flops=1.0, grid_steps=10, hot_iterations=10, hbm_bytes=0.0, generation=_Gen)
    t = M.scheduled_from_work(prep, prepare_runs=4, **kw)
    # 10 steps x (11 - 3) bundles, the copy on 4 of them, 10 hot iterations of 3, prologue +
    # epilogue
    assert t["scheduled_us"] == pytest.approx((10 * 8 + 4 * 3 + 10 * 3 + 2) * 1e-3)
    assert t["prepare_region_bundles"] == 3
    every = M.scheduled_from_work(prep, **kw)
    assert every["scheduled_us"] == pytest.approx((10 * 11 + 10 * 3 + 2) * 1e-3)
    assert every["prepare_region_bundles"] == 0
    # no such region (the plain model's init stores constants): the count changes nothing
    plain = M.scheduled_from_work(model, prepare_runs=4, **kw)
    assert plain["scheduled_us"] == pytest.approx(every["scheduled_us"])


def test_first_last_regions_need_the_init_and_write_back_signatures():
    # (branch, end, MXU pushes, loads, stores); the work spans bundles 10-20
    init, prep, fin = [2, 6, 0, 0, 8], [6, 9, 0, 4, 4], [21, 25, 0, 6, 2]
    assert M.first_last_regions([init, fin], (10, 20)) == (3, 3)
    # a per-step region that loads what it stores (an int8 -> bf16 weight copy) right before
    # the work is not an accumulator init: it stays in the per-step charge
    assert M.first_last_regions([init, prep, fin], (10, 20)) == (0, 3)
    # it is the weight-prepare region, charged by its own runs
    assert M.prepare_span([init, prep, fin], (10, 20)) == (6, 9)
    assert M.prepare_span([init, fin], (10, 20)) is None
    assert M.prepare_span([(2, 6), (6, 9), (21, 25)], (10, 20)) is None  # no op counts
    # MXU regions and regions around or inside the work are neither
    assert M.first_last_regions([[21, 25, 4, 6, 2], [0, 30, 0, 1, 1]], (10, 20)) == (0, 0)
    # without op counts (the validator's structures) the adjacent small regions are taken
    assert M.first_last_regions([(2, 6), (6, 9), (21, 25)], (10, 20)) == (2, 3)


# A megablox-like grid step (hot loop = grid loop): a `pl.when(k == 0)` zeroing region (bundle
# 3), then the two sides of `lax.cond(k == last)`: the last-K-tile side, which also stores the
# output (bundles 5-8), and the other-K-tiles side (bundles 10-12). Grid loop: bundles 1-14.
_SIDES = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %v2 = vld [vmem:[%s1] sm:$0xff] }
   0x2   : > { %3 = sbr.rel (%p1) target = $region3 }
   0x3   : > { %4 = vst [vmem:[%s1] sm:$0xff] %v2 }
   0x4   : > { %5 = sbr.rel (%p2) target = $region5 } /* Start region 3 */
   0x5   : > { %v6 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x6   : > { %v7 = vpop.f32.mrf.mxu0 }
   0x7   : > { %v8 = vadd.f32 %v7, %v2 }
   0x8   : > { %9 = vst [vmem:[%s1] sm:$0xff] %v8 }
   0x9   : > { %10 = sbr.rel (%p3) target = $region6 } /* Start region 5 */
   0xa   : > { %v11 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xb   : > { %v12 = vpop.f32.mrf.mxu0 }
   0xc   : > { %v13 = vadd.f32 %v12, %v2 }
   0xd   : > { %s14 = smov 0 } /* Start region 6 */
   0xe   : > { %15 = sbr.rel (%p4) target = $region2 }
   0xf   :  { %16 = vsyncpa [#allocation3], 0 }
"""


def test_cond_sides_charge_one_side_per_step():
    """A step holding both sides of a `lax.cond` runs one: the last K tile of each output tile
    the larger side, the other steps the smaller (the validator's charge of tokamax's gmm)."""
    s = _sched(_SIDES)
    assert s.hot_loop() is s.grid_loop()
    model = M.work_model_inputs(s)
    assert model["step_bundles"] == 14 and model["mxu_branches"] == [[4, 1], [3, 1]]
    assert M.step_regions(model) == {
        "first": 1, "last": 0, "sides": [4, 3], "first_last_loops": 0, "prepare": 0
    }  # fmt: skip
    kw = dict(mxu_flops=8.0, grid_steps=8, hbm_bytes=0.0, generation=_Gen)
    t = M.scheduled_from_work(
        model, flops_per_hot_iteration=1.0, output_tiles=2, last_side_runs=2, **kw
    )
    # 8 busy steps x (14 - 1 - 7), init on 2 tiles, 2 last-K steps x 4 + 6 others x 3, + 2
    assert t["scheduled_us"] == pytest.approx((8 * 6 + 2 * 1 + 2 * 4 + 6 * 3 + 2) * 1e-3)
    both = M.scheduled_from_work(model, flops_per_hot_iteration=1.0, **kw)
    assert both["scheduled_us"] == pytest.approx((8 * 14 + 2) * 1e-3)
    # a model cached without the regions still knows the sides from its MXU paths
    old = {k: v for k, v in model.items() if k != "regions"}
    t_old = M.scheduled_from_work(
        old, flops_per_hot_iteration=1.0, output_tiles=2, last_side_runs=2, **kw
    )
    assert t_old["scheduled_us"] == pytest.approx((8 * 7 + 2 * 4 + 6 * 3 + 2) * 1e-3)


# The branchy step of _BRANCHY with rolled loops outside its MXU paths: an item loop (bundles
# 2-5) holding a page loop (bundles 3-4), and a write-back loop (bundle 15) after the paths.
_LOOPY = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %v2 = vld [vmem:[%s1] sm:$0xff] }
   0x2 LB: >> { %s3 = sadd.s32 %s1, %s1 }
   0x3 LB: >>> { %s4 = sadd.s32 %s1, %s1 }
   0x4   : >>> { %5 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s4, /*size_in_granules=*/16 }
   0x5   : >> { %s6 = sadd.s32 %s1, %s1 }
   0x6   : > { %7 = sbr.rel (%p1) target = $region11 }
   0x7   : > { %8 = sbr.rel (%p2) target = $region7 }
   0x8   : > { %v9 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0x9   : > { %v10 = vadd.f32 %v2, %v2 } /* Start region 7 */
   0xa   : > { %11 = sbr.rel (%p3) target = $region9 }
   0xb   : > { %v12 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xc   : > { %v13 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xd   : > { %v14 = vpop.f32.mrf.mxu0 } /* Start region 9 */
   0xe   : > { %v15 = vpow2.f32 %v14 } /* Start region 11 */
   0xf LB: >> { %16 = vst [vmem:[%s1] sm:$0xff] %v2 }
  0x10   : > { %17 = sbr.rel (%p4) target = $region2 }
  0x11   :  { %18 = vsyncpa [#allocation3], 0 }
"""


def test_step_loops_are_charged_by_their_trips():
    s = _sched(_LOOPY)
    model = M.work_model_inputs(s)
    # [start, end, own bundles, parent, DMA ops, branch bundles] relative to the grid loop,
    # program order, nested ones included
    assert model["step_loops"] == [[1, 5, 2, -1, 0, 0], [2, 4, 2, 0, 1, 0], [14, 15, 1, -1, 0, 0]]
    assert model["mxu_branches"] == [[1, 1], [2, 2]]
    kw = dict(mxu_flops=1.0, grid_steps=10, hbm_bytes=0.0, generation=_Gen, branch_runs=[6, 2])
    once = M.scheduled_from_work(model, **kw)
    # 8 busy steps start 8 items of 20 pages in all; 2 q blocks written back
    t = M.scheduled_from_work(model, loop_trips=[8, 20, 2], **kw)
    looped = 2 + 2 + 1
    shared = model["step_bundles"] - 1 - 2 - looped
    idle = model["idle_step_bundles"] - looped
    want = 6 * (shared + 1) + 2 * (shared + 2) + 2 * idle + 8 * 2 + 20 * 2 + 2 * 1
    assert t["scheduled_us"] == pytest.approx((want + model["outside_bundles"]) * 1e-3)
    assert t["loop_bundles"] == 8 * 2 + 20 * 2 + 2 * 1 and "loop_bundles" not in once
    # one trip per busy step of each loop (idle steps none) is the static count's charge
    same = M.scheduled_from_work(model, loop_trips=[8, 8, 8], **kw)
    idle_loops = 2 * looped * 1e-3
    assert same["scheduled_us"] == pytest.approx(once["scheduled_us"] - idle_loops)
    with pytest.raises(ValueError, match="3 rolled loops"):
        M.scheduled_from_work(model, loop_trips=[8, 20], **kw)
    # a loop body's forward branch (1 of the item loop's 2 own bundles) charged per run: 3 of
    # the 8 items take it
    branchy = {**model, "step_loops": [[1, 5, 2, -1, 0, 1], *model["step_loops"][1:]]}
    b = M.scheduled_from_work(branchy, loop_trips=[(8, 3), 20, 2], **kw)
    assert b["loop_bundles"] == 8 * 1 + 3 * 1 + 20 * 2 + 2 * 1
    old = {k: v for k, v in model.items() if k != "step_loops"}
    with pytest.raises(ValueError, match="step_loops"):
        M.scheduled_from_work(old, loop_trips=[8, 20, 2], **kw)


# A grid step that loops over work items (paged attention's q block): the grid loop (bundles
# 1-18) holds an init loop (bundle 2), the item loop (bundles 3-16: _LOOPY's step, its fetch
# loop and page loop, its two MXU paths) and a write-back loop (bundle 17).
_ITEMS = """
     0   :  { %s1 = smov 0 }
   0x1 LB: > { %s90 = sadd.s32 %s1, %s1 }
   0x2 LB: >> { %91 = vst [vmem:[%s1] sm:$0xff] %v2 }
   0x3 LB: >> { %v2 = vld [vmem:[%s1] sm:$0xff] }
   0x4 LB: >>> { %s3 = sadd.s32 %s1, %s1 }
   0x5 LB: >>>> { %s4 = sadd.s32 %s1, %s1 }
   0x6   : >>>> { %5 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s4, /*size_in_granules=*/16 }
   0x7   : >>> { %s6 = sadd.s32 %s1, %s1 }
   0x8   : >> { %7 = sbr.rel (%p1) target = $region11 }
   0x9   : >> { %8 = sbr.rel (%p2) target = $region7 }
   0xa   : >> { %v9 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xb   : >> { %v10 = vadd.f32 %v2, %v2 } /* Start region 7 */
   0xc   : >> { %11 = sbr.rel (%p3) target = $region9 }
   0xd   : >> { %v12 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xe   : >> { %v13 = vmatmul.mubr.bf16.gmra.mxu0 %v2 }
   0xf   : >> { %v14 = vpop.f32.mrf.mxu0 } /* Start region 9 */
  0x10   : >> { %v15 = vpow2.f32 %v14 } /* Start region 11 */
  0x11 LB: >> { %16 = vst [vmem:[%s1] sm:$0xff] %v2 }
  0x12   : > { %17 = sbr.rel (%p4) target = $region2 }
  0x13   :  { %18 = vsyncpa [#allocation3], 0 }
"""


def test_item_loop_is_the_step_and_its_grid_step_is_charged_per_q_block():
    """A kernel that runs a q block's work items in a rolled loop inside its grid step
    (work_model_inputs(item_loop=True)): the item loop is read as the step (paths, loops, as a
    grid step of the other kernels), the grid step's code around it is charged once per grid
    step with its own loops by their trips, and the fixed per-step cost per grid step only."""
    s = _sched(_ITEMS)
    model = M.work_model_inputs(s, item_loop=True)
    assert model["items_in_step"] and model["hot_is_grid"]
    assert model["step_bundles"] == 14 and model["mxu_branches"] == [[1, 1], [2, 2]]
    assert model["step_loops"] == [[1, 5, 2, -1, 0, 0], [2, 4, 2, 0, 1, 0]]
    # relative to the grid loop: init, write-back; the rest of the grid step 18 - 14 - 2
    assert model["block_loops"] == [[1, 2, 1, -1, 0, 0], [16, 17, 1, -1, 0, 0]]
    assert model["block_bundles"] == 18 - 14 and model["outside_bundles"] == 2

    class Gen(_Gen):
        step_overhead_s = 1e-9  # one bundle's time per grid step

    kw = dict(mxu_flops=1.0, hbm_bytes=0.0, generation=Gen, branch_runs=[6, 2])
    # 3 q blocks (grid steps) of 10 items: 8 busy ones start 8 items of 20 pages; each q block
    # initialises and writes back 4 row chunks
    t = M.scheduled_from_work(
        model,
        grid_steps=3,
        work_items=10,
        loop_trips=[8, 20],
        block_loop_trips=[12, 12],
        **kw,
    )
    shared = 14 - 1 - 2 - 4
    idle = model["idle_step_bundles"] - 4
    items = 6 * (shared + 1) + 2 * (shared + 2) + 2 * idle + 8 * 2 + 20 * 2
    block = 3 * (4 - 2) + 12 + 12
    assert t["block_bundles"] == block
    assert t["step_overhead_us"] == pytest.approx(3e-3)
    assert t["scheduled_us"] == pytest.approx((items + block + 2 + 3) * 1e-3)
    # without the grid step's loop trips its loops are read once per grid step
    once = M.scheduled_from_work(model, grid_steps=3, work_items=10, loop_trips=[8, 20], **kw)
    assert once["block_bundles"] == 3 * 4
    with pytest.raises(ValueError, match="2 rolled loops"):
        M.scheduled_from_work(
            model, grid_steps=3, work_items=10, loop_trips=[8, 20], block_loop_trips=[1], **kw
        )
    # work_items and an item-loop model go together
    with pytest.raises(ValueError, match="work_items"):
        M.scheduled_from_work(model, grid_steps=3, loop_trips=[8, 20], **kw)
    with pytest.raises(ValueError, match="work_items"):
        M.scheduled_from_work(
            M.work_model_inputs(s), grid_steps=3, work_items=10, hot_iterations=8, **kw
        )
    # a one-step grid has no grid loop: the item loop is the program's top loop and the code
    # around it (here the write-back loop beside it) the grid step's
    one = _sched(_LOOPY)
    m1 = M.work_model_inputs(one, item_loop=True)
    assert m1["step_bundles"] == model["step_bundles"] + 2 and m1["outside_bundles"] == 0
    assert m1["block_bundles"] == len(one.bundles) - m1["step_bundles"]


def test_named_loops_align_with_the_compiled_step_loops():
    loops = [[1, 5, 2, -1, 0, 0], [2, 4, 2, 0, 1, 0], [14, 15, 1, -1, 0, 0]]
    named = {"fetch": (8, 3), "fetch/pages": 20, "write_back": 2}
    assert M.align_loop_trips(loops, named) == [(8, 3), (20, 20), (2, 2)]
    # loops the compiler adds (no DMA of their own inside a named loop: e.g. a small copy loop
    # beside a DMA) run once per iteration of their parent
    extra = [
        [1, 9, 2, -1, 0, 0],
        [2, 6, 2, 0, 2, 0],
        [3, 4, 1, 1, 0, 0],
        [7, 8, 1, 0, 0, 0],
        [14, 15, 1, -1, 0, 0],
    ]
    assert M.align_loop_trips(extra, named) == [(8, 3), (20, 20), (20, 20), (8, 8), (2, 2)]
    with pytest.raises(ValueError, match="named loops not found.*fetch/pages"):
        M.align_loop_trips([[1, 5, 2, -1, 0, 0], [14, 15, 1, -1, 0, 0]], named)
    with pytest.raises(ValueError, match="more loops directly in it"):
        M.align_loop_trips(loops + [[16, 17, 1, -1, 0, 0]], named)


def test_paged_rows_name_every_rolled_loop_of_their_step():
    """Every paged benchmark row's compiled item loop and grid step have exactly the loops
    tiling.step_loop_trips names for its shape (the program-order mapping the scheduled time
    charges by)."""
    import ours
    import schedule_rows
    import shapes

    adapter = ours.ADAPTERS["paged_attention"]
    for shape in shapes.NAMED["paged_attention"]:
        for gen in ("v5e", "v6e", "tpu7x"):
            e = schedule_rows.read_schedule(
                "paged_attention", "ours", shape.name, gen, cache_only=True
            )
            assert e is not None and "error" not in e, (shape.name, gen)
            named = adapter.step_loops(shape, gen)
            model = e["_model"]
            assert model.get("items_in_step"), (shape.name, gen)
            # raises on a mismatch
            M.align_loop_trips(model["step_loops"], named["item"])
            M.align_loop_trips(model["block_loops"], named["block"])


def test_per_tile_runs_count_output_tiles_from_the_grid_and_work_list():
    import schedule_rows
    from shapes import RaggedDotShape
    from tpu_generations import KernelCost

    shape = RaggedDotShape("t", tokens=64, experts=4, top_k=2, k=512, n=384)
    # our gmm: one FIRST item per row tile (128 rows / 32 = 4), times 3 N tiles
    ours = schedule_rows.per_tile_runs(
        "ragged_dot", "ours", shape, "v6e", {"tiling": [32, 128, 128]}, None
    )
    assert ours == {"output_tiles": 4.0 * 3}
    # megablox: grid steps / K tiles visits x N tiles end on a last K tile
    cost = KernelCost(0, 0, 0, 0, grid_steps=60)
    mb = schedule_rows.per_tile_runs(
        "ragged_dot", "anchor:megablox_default", shape, "v6e", {"tiling": [32, 128, 128]}, cost
    )
    steps = mb.pop("step_work")
    assert mb == {"output_tiles": 15.0, "last_side_runs": 15.0}
    # ... and its steps' copies are the closed form's (anchors._gmm_walk), every step busy
    import anchors

    walk, _ = anchors._gmm_walk(
        shape, (32, 128, 128), anchors.gmm_metadata(shape.group_sizes, 128, 32)
    )
    assert len(steps["hot"]) == walk.grid_steps and steps["hot"].min() == 1
    assert steps["reads"].sum() + steps["writes"].sum() == walk.hbm_bytes
    assert schedule_rows.per_tile_runs("flash_attention", "ours", shape, "v6e", {}, cost) == {}


def test_program_overlays_reads_the_top_level_programs_overlay_graph(tmp_path):
    """The overlay graph libtpu dumps for the top-level program: one node per overlay with its
    size in bundles (prelude nodes left out); this is the graph the v5e gmm ran in 8 pieces."""
    (tmp_path / "1-TLP-82-overlay-graph.txt").write_text(
        "digraph {\n"
        '  "#0:prelude def:#1 size:256" -> "#1:tlp def:#2 size:7008"\n'
        '  "#1:tlp def:#2 size:7008" -> "#2:tlp def:#3 size:21256"\n'
        '  "#2:tlp def:#3 size:21256" -> "#3:tlp def:#2 size:16176"\n'
        '  "#3:tlp def:#2 size:16176" -> "#4:tlp def:#1 size:120 <exit>"\n'
        "}\n"
    )
    assert L.program_overlays(tmp_path) == [7008, 21256, 16176, 120]
    (tmp_path / "empty").mkdir()
    assert L.program_overlays(tmp_path / "empty") == []


def _largest_window_code_cell(generation: str) -> str:
    """The named gmm cell whose window copies take the most MXU bundles on `generation`: the
    one closest to that generation's program budget (tiling.program_mxu_bundles)."""
    import ours
    import shapes

    T = ours.ADAPTERS["ragged_dot"].mod.tiling
    gen = T.get_generation(generation)
    unit = T.row_unit("bfloat16")

    def code(s):
        t = T.gmm_tiling(
            s.tokens * s.top_k, s.k, s.n, "bfloat16", "bfloat16",
            num_groups=s.experts, generation=generation,
        )  # fmt: skip
        cn = T.window_cols(t.tk, t.tn, gen, t.tm, unit)
        return T.window_code_rows(t.tm, unit) * t.tk * cn / T.macs_per_bundle(gen)

    best = max(shapes.NAMED["ragged_dot"], key=code)
    assert code(best) <= T.program_mxu_bundles(gen)
    return best.name


@pytest.mark.compile
@pytest.mark.timeout(600)
def test_tile_sweep_reads_other_gmm_tilings_from_the_compiled_schedule(tmp_path):
    """`tile_sweep.py --scheduled GEN` (no chip): the gmm at its own tiles scheduled as its
    named row is (the same program and work, so the same time as results.json's row), and at
    another row tile a program of its own (another time)."""
    import json

    import tile_sweep

    out = tmp_path / "sched.json"
    args = ["--scheduled", "v5e", "--shape", "qwen3_30b_a3b_down_t64", "--vary", "tm=256"]
    rows = tile_sweep.main(args + ["--out", str(out)])["rows"]
    assert json.loads(out.read_text())["rows"] == rows
    own, other = rows
    assert own["kernel_choice"] and other["tiles"][0] == 256, rows
    results = json.loads(
        (Path(__file__).parent.parent / "benchmarks/results/results.json").read_text()
    )
    named = next(
        r
        for r in results["named"]["rows"]
        if (r["shape"], r["impl"]) == ("qwen3_30b_a3b_down_t64", "ours")
    )
    assert own["scheduled_us"] == pytest.approx(
        named["per_generation"]["v5e"]["scheduled"]["scheduled_us"], rel=1e-6
    )
    assert other["scheduled_us"] > 0 and other["scheduled_us"] != own["scheduled_us"]


def test_tile_sweep_schedules_the_gmms_other_calls(tmp_path):
    """`tile_sweep.py --scheduled GEN --pass dlhs|int8` (no chip): the gmm's lhs gradient
    (weights read transposed) and its int8-weight forward, each compiled as it runs and
    scheduled on its own work list, at the tiles the kernel picks for that call; the forward
    through the same path (`ours.gmm_variant_row`) is the named row's cost and trips."""
    import numpy as np

    import ours
    import shapes
    import tile_sweep

    shape = next(s for s in shapes.NAMED["ragged_dot"] if s.name == "qwen3_30b_a3b_down_t64")
    adapter = ours.ADAPTERS["ragged_dot"]
    tiles, cost, trips = ours.gmm_variant_row(adapter.mod, shape, "gmm", "v5e")
    assert tiles == adapter.tiles(shape, "v5e") and cost == adapter.cost(shape, "v5e")[0]
    own = adapter.schedule_trips(shape, "v5e")
    assert trips.keys() == own.keys() and trips["hot_iterations"] == own["hot_iterations"]
    for key, steps in own["step_work"].items():
        np.testing.assert_array_equal(trips["step_work"][key], steps)
    T = adapter.mod.tiling
    for variant, (k, n, rhs) in {
        "dlhs": (shape.n, shape.k, "bfloat16"),
        "int8": (shape.k, shape.n, "int8"),
    }.items():
        out = tmp_path / f"{variant}.json"
        args = ["--scheduled", "v5e", "--pass", variant, "--shape", shape.name, "--out", str(out)]
        (row,) = tile_sweep.main(args)["rows"]
        t = T.gmm_tiling(shape.m, k, n, "bfloat16", rhs, "bfloat16", num_groups=shape.experts,
                         generation="v5e")  # fmt: skip
        assert row["kernel_choice"] and row["tiles"] == [t.tm, t.tk, t.tn], row
        assert row["scheduled_us"] > 0 and "error" not in row, row
    # int8 weights in one K block: the widening region is found in the compiled step and
    # charged once per N tile and expert with rows (kernel `_prepare`), not per grid step
    assert t.tk >= shape.k and row["prepare_region_bundles"] > 0, (t, row)
    trips = ours.gmm_variant_row(adapter.mod, shape, "int8", "v5e", t)[2]
    experts = sum(1 for g in shape.group_sizes if g)
    assert trips["prepare_runs"] == -(-shape.n // t.tn) * experts


def _assert_fits_one_overlay(target, generation, args, name, dump_dir):
    """The largest Mosaic kernel of one deviceless compile fits one instruction-memory overlay of
    the top-level program: it is at most the largest overlay plus 16 bundles (the XLA ops around
    it sit in an overlay of their own, and the overlay holding the kernel may leave a few of its
    first bundles, before the grid loop, 7-12 seen, in the one before)."""
    scheds = [
        x for x in L.dump_schedule(target, generation, args, name, str(dump_dir)) if x.is_mosaic
    ]
    overlays = L.program_overlays(dump_dir)
    assert overlays, "libtpu wrote no overlay graph"
    kernel = max(len(x.bundles) for x in scheds)
    assert kernel <= max(overlays) + 16, (target, args, generation, kernel, overlays)


# v5e in CI (the generation the program budget was sized by, whose overlays the chip showed
# costing 3-7x); every generation in the long form (HYPOTHESIS_PROFILE=sweep): the v6e and TPU7x
# dumps took 80 and 121 s of a CI run near its time limit.
@pytest.mark.compile
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "generation", tpu_compile.TESTED_GENERATIONS if tpu_compile.LONG_FORM else ["v5e"]
)
def test_gmm_program_fits_one_instruction_memory_overlay(tmp_path, generation):
    """On every generation, our gmm at the named cell with the most window code under that
    generation's budget (tiling.PROGRAM_MXU_BUNDLES) compiles to a kernel one overlay holds:
    before the budget the v5e gmm was 140k bundles in 8 overlays of at most 21k, which a TPU
    v5e chip ran at 3-7x its schedule (benchmarks/results/device/)."""
    import schedule_targets

    shape = _largest_window_code_cell(generation)
    target, args, name = schedule_targets.resolve("ours:ragged_dot", shape)
    _assert_fits_one_overlay(target, generation, args, name, tmp_path)


# Forwards near their generation's program bound (tiling.FORWARD_CODE), compiled with the
# kernel's own tiles: (generation, compile_flash_forward's arguments or None for the named row
# Llama-3-8B window 1024). v6e's window 1024 in CI (2048 x 512 stacked score tiles: 57,421
# bundles, the largest program a named row compiles); in the long form the same row on the other
# generations and the forwards near the bound: v6e's soft-capped Llama-3-8B heads (66,828
# bundles in 7 overlays at full groups, so the bound halves its walk), v5e's 32-head MQA (one
# tile a group), TPU7x's 48 / 8 heads with a soft cap (groups of four, 50,066 bundles).
_FORWARD_PROGRAMS = [("v6e", None)] + (
    [
        ("v5e", None),
        ("tpu7x", None),
        ("v6e", dict(q_heads=32, kv_heads=8, seq=8192, window=1024, softcap=30.0)),
        ("v5e", dict(q_heads=32, kv_heads=1, seq=4096)),
        ("tpu7x", dict(q_heads=48, kv_heads=8, seq=8192, softcap=30.0)),
    ]
    if tpu_compile.LONG_FORM
    else []
)


@pytest.mark.compile
@pytest.mark.timeout(600)
@pytest.mark.parametrize("generation, forward", _FORWARD_PROGRAMS)
def test_flash_forward_program_fits_one_instruction_memory_overlay(tmp_path, generation, forward):
    """Our flash forward compiles to a kernel one overlay holds (its edge walk's groups bounded
    by kernel._walk_unroll). With the walk's former binary-digit groups v6e's Llama-3-8B window
    1024 was a 75,773-bundle kernel cut into overlays (causal: 71,054 bundles in 7), which the
    grid loop would reload from HBM at every step."""
    import schedule_targets

    if forward is None:
        target, args, name = schedule_targets.resolve(
            "ours:flash_attention", "llama3_8b_window1024_8192"
        )
    else:
        target, args, name = (
            "schedule_targets:compile_flash_forward",
            forward,
            "flash_attention_fwd",
        )
    _assert_fits_one_overlay(target, generation, args, name, tmp_path)


@pytest.mark.compile
@pytest.mark.timeout(600)
def test_fused_gate_program_fits_one_instruction_memory_overlay(tmp_path):
    """The fused gate_up gmm holds two weight blocks per window copy, so its K block is bounded
    for the program budget too (tiling.program_fits): at Mixtral-8x7B gate_up on v5e it took
    tm 512 / tk 4096 before, a 68k-bundle kernel in overlays of at most 21.6k bundles, which a
    TPU v5e chip ran at 1.27x our plain gmm plus XLA's gating (18.7 against 14.8 ms; with the
    bound 13.6 ms, benchmarks/results/device/v5e_train_gated_fit.json)."""
    _assert_fits_one_overlay(
        "schedule_targets:compile_gated",
        "v5e",
        {"shape": "mixtral_8x7b_gate_up_t4096"},
        "ragged_dot",
        tmp_path,
    )


# ---- real schedules from libtpu ------------------------------------------------------------------


def _matmul(generation="v6e", **kw):
    (s,) = [
        x
        for x in L.dump_schedule(
            "schedule_targets:plain_matmul", generation, kw, name="plain_matmul"
        )
        if x.is_mosaic
    ]
    return s


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_plain_matmul_is_mxu_bound_and_linear_in_k():
    small, mid, large = _matmul(k=1024), _matmul(k=2048), _matmul(k=4096)
    hot = large.hot_loop()
    assert hot is large.grid_loop()  # one straight-line dot per grid step
    seg = large.loop_segment(hot)
    assert seg.occupancy("MXU") >= 0.85 and seg.bound() == "MXU"
    # The dot over K unrolls: 4x the contraction is 4x the MXU pushes, and every further K
    # chunk costs the same bundles (linear growth on top of a fixed per-step part).
    b1, b2, b4 = (s.grid_loop().bundles for s in (small, mid, large))
    assert large.loop_segment(hot).mxu_pushes == 4 * small.loop_segment(small.hot_loop()).mxu_pushes
    assert 1.8 <= (b4 - b2) / (b2 - b1) <= 2.2


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_scheduled_time_linear_in_grid_steps():
    a, b = _matmul(m=1024), _matmul(m=4096)
    # The grid step's code does not depend on how many steps run...
    assert abs(a.grid_loop().bundles - b.grid_loop().bundles) <= 0.02 * a.grid_loop().bundles
    from tpu_generations import GENERATIONS

    steps_a, steps_b = (1024 // 512) * 2, (4096 // 512) * 2
    ta, tb = (
        M.scheduled_from_work(
            M.work_model_inputs(s),
            mxu_flops=0.0,
            grid_steps=n,
            hbm_bytes=0.0,
            generation=GENERATIONS["v6e"],
            hot_iterations=n,
        )
        for s, n in ((a, steps_a), (b, steps_b))
    )
    # ...so the scheduled time grows with them (4x the steps, ~4x the time).
    assert 3.8 <= tb["bundle_us"] / ta["bundle_us"] <= 4.2


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_generation_units_and_capacity_differ():
    v5e, v6e = _matmul("v5e", k=1024), _matmul("v6e", k=1024)
    # v5e's MXUs are 128 wide, v6e's 256: the same dot takes more pushes on v5e.
    assert v5e.loop_segment(v5e.hot_loop()).mxu_pushes > v6e.loop_segment(v6e.hot_loop()).mxu_pushes
    assert v6e.capacity["MXU"] >= 1 and set(v6e.capacity) == set(L.UNITS)


# ---- the results never call a scheduled time measured ---------------------------------------------


def test_results_say_scheduled_not_measured():
    import json

    import report

    results = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    md = report.markdown(results)
    # results.md is exactly what the generator writes from results.json (nothing hand-edited).
    assert md == (ROOT / "benchmarks" / "results" / "results.md").read_text()
    assert "scheduled, not measured on a TPU" in md
    for line in md.splitlines():
        if line.startswith("| shape |"):
            for head in line.split("|"):
                if "scheduled" in head:
                    assert "measured" not in head.replace("scheduled", "")
    # A scheduled entry lands in the scheduled column, never in a "measured" one.
    row = next(r for r in results["named"]["rows"] if r["impl"] == "ours")
    fake = json.loads(json.dumps(results))
    for r in fake["named"]["rows"]:
        for g in r["per_generation"].values():
            g.pop("measured_us", None)
            g["scheduled"] = {"scheduled_us": 123456.0, "hot_mxu_occupancy": 0.5, "bound": "MXU"}
    md2 = report.markdown(fake)
    assert "123456 (0.50, MXU)" in md2.replace("1.235e+05", "123456")
    for line in md2.splitlines():
        assert "measured 1.235e+05" not in line and "measured 123456" not in line
    assert row["kernel"] in md2


# ---- the model's trip counts are what the TPU interpreter runs ---------------------------------------


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens,experts,top_k", [(600, 2, 1), (40, 4, 2), (300, 3, 2)])
def test_gmm_trip_counts_equal_the_windows_the_interpreter_runs(tokens, experts, top_k):
    """The scheduled-time model charges our gmm's hot loop `hot_iterations` times and its tail
    regions `side_region_runs` times (benchmarks/ours.py, from the work list on the host). Every
    row window, full or tail, loads the weight block from VMEM once per column chunk: counting
    those loads in TPU interpret mode counts the windows the kernel really ran."""
    import jax
    import jax.numpy as jnp

    import ours
    import shapes
    import tpu_interpreter

    rd = ours.load("ragged_dot")
    s = shapes.RaggedDotShape("trips", tokens, experts, top_k, 640, 256)
    t = rd.tiling.gmm_tiling(s.m, s.k, s.n, s.dtype, s.dtype, s.dtype, generation="v6e")
    unit = rd.tiling.row_unit(s.dtype)
    gen = rd.tiling.get_generation("v6e")
    cn = rd.kernel._n_chunk(t.tk, t.tn, gen, t.tm, unit)
    # The weight chunk's shape (tk, cn) is no window's accumulator shape (rows, cn): tk is neither
    # a tail bucket nor the full window's rows.
    assert t.tk not in rd.tiling.bucket_sizes(t.tm, unit) + (rd.tiling.row_chunk(t.tm),)
    trips = ours.ADAPTERS["ragged_dot"].schedule_trips(s, "v6e")

    lhs = jnp.ones((s.m, s.k), jnp.bfloat16)
    rhs = jnp.ones((s.experts, s.k, s.n), jnp.bfloat16)
    with tpu_interpreter.count_traffic() as traffic:
        jax.block_until_ready(
            rd.kernel.gmm(
                lhs,
                rhs,
                jnp.asarray(s.group_sizes, jnp.int32),
                generation="v6e",
                interpret=tpu_interpreter.counting_params(),
            )
        )
    # kernel-body loads by shape: the weight block's (tk, cn) chunk is loaded once per window
    windows = traffic.body_loads[(t.tk, cn)] if t.tk != t.tm else None
    assert windows == trips["hot_iterations"] + trips["side_region_runs"]
    assert trips["hot_iterations"] + trips["side_region_runs"] > 0
    assert traffic.grid_steps > 0


def test_schedule_cache_key_covers_exactly_the_kernel_sources():
    import schedule_rows

    for kind in ("ragged_dot", "flash_attention", "paged_attention"):
        names = {p.name for p in schedule_rows.kernel_sources(kind)}
        # The compiled kernel, what it imports, and the shared modules vendored beside it ...
        assert {"kernel.py", "tiling.py", "tpu_generations.py"} <= names, (kind, names)
        # ... but not the torch ops or the Transformers glue: editing them keeps the cache.
        assert not names & {"ops.py", "integration.py", "jax_bridge.py"}, (kind, names)


_FINGERPRINT_KERNEL = """
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def body(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...]) * SCALE


def call(x):
    return pl.pallas_call(
        body,
        grid=(x.shape[0] // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((BLOCK, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)
"""


def _fingerprint(tmp_path, name, source, generation="v6e"):
    """Lower a pallas_call written in its own file (so its source locations are real) for a
    TPU generation and fingerprint the lowered program."""
    import importlib.util

    import jax.numpy as jnp

    import schedule_rows
    import tpu_compile

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lowered = tpu_compile.lower_for(generation, module.call, ((512, 128), jnp.float32))
    # the Mosaic body is found (else its source locations would go into the hash unnoticed)
    assert schedule_rows._MOSAIC_BODY.search(lowered.as_text(debug_info=False))
    return schedule_rows.lowered_fingerprint(lowered)


@pytest.mark.skipif(not __import__("tpu_compile").libtpu_available(), reason="needs libtpu")
@pytest.mark.timeout(120)
def test_program_fingerprint_ignores_source_locations_only(tmp_path):
    """The schedule cache reuses a compile when the lowered program is the same: comments and
    moved lines keep the fingerprint, any change to what the kernel computes or how it is tiled
    changes it."""
    base = "BLOCK, SCALE = 128, 2.0\n" + _FINGERPRINT_KERNEL
    moved = "# a comment\n\n\nBLOCK, SCALE = 128, 2.0\n\n" + _FINGERPRINT_KERNEL.replace(
        "def body", "# why\ndef body"
    )
    retiled = "BLOCK, SCALE = 256, 2.0\n" + _FINGERPRINT_KERNEL
    recomputed = "BLOCK, SCALE = 128, 3.0\n" + _FINGERPRINT_KERNEL
    fp = _fingerprint(tmp_path, "base", base)
    assert _fingerprint(tmp_path, "moved", moved) == fp
    assert _fingerprint(tmp_path, "retiled", retiled) != fp
    assert _fingerprint(tmp_path, "recomputed", recomputed) != fp


# What each named loop of the paged step does, by its own bundles' op families (issue: DMA
# descriptors and no waits; wait: DMA waits; stores of constants; loads, selects and stores).
_LOOP_SIGNATURES = {
    "item_fetch": lambda ops: ops.get("dma", 0) and not ops.get("vsyncadd"),
    "page_copies": lambda ops: ops.get("dma", 0) and not ops.get("vsyncadd"),
    "spread_matrix": lambda ops: ops.get("vst") and ops.get("vcmp") and not ops.get("vld"),
    "init": lambda ops: ops.get("vst") and not ops.get("vld") and not ops.get("vcmp"),
    "page_waits": lambda ops: ops.get("vsyncadd", 0) and not ops.get("vst"),
    "stale_zeroing": lambda ops: ops.get("vld") and ops.get("vsel") and ops.get("vst"),
    "write_back": lambda ops: ops.get("vrcp") and ops.get("vst"),
}


@pytest.mark.compile
@pytest.mark.timeout(600)
def test_paged_step_loops_are_the_ones_step_loop_trips_names():
    """The int8 decode row (every loop kind: page DMAs with per-token scales, the quad path's
    spreading matrix, init / write-back) compiled for v6e: the loops outside the item loop's
    compute paths, and those of the grid step around the item loop, are in program order the
    ones tiling.step_loop_trips names, each doing what its name says."""
    import ours
    import schedule_targets

    shape = "llama3_8b_decode_b64_ctx8192_int8"
    target, args, name = schedule_targets.resolve("ours:paged_attention", shape)
    (s,) = [x for x in L.dump_schedule(target, "v6e", args, name=name) if x.is_mosaic]
    model = M.work_model_inputs(s, nested_paths=True, item_loop=True)
    adapter = ours.ADAPTERS["paged_attention"]
    named = adapter.step_loops(schedule_targets._shape("paged_attention", shape), "v6e")
    # one q block: a one-step grid, whose program is the grid step (no grid loop), the item
    # loop its largest loop
    item = s.hot_loop()
    assert item is s.grid_loop() and item.depth == 1 and model["outside_bundles"] == 0
    # compiled without Mosaic's DMA bounds checks (kernel.py: page ids clamped instead): no
    # `shalt.err` guard in the item's code (the kernel's exit keeps its semaphore checks)
    halts = [op for b in s.bundles[item.start : item.end] for op in b.ops if op.startswith("shalt")]
    assert not halts, halts
    top = {lp.start: lp for lp in s.loops if lp.depth == 1}
    for level, rows, base in (
        ("item", model["step_loops"], item.start),
        ("block", model["block_loops"], 0),
    ):
        names = [n.split("/")[-1] for n in named[level]]
        assert set(names) <= set(_LOOP_SIGNATURES), names
        # on v6e each level holds exactly the kernel's loops, each doing what its name says
        assert len(rows) == len(names), (level, rows)
        pairs = [v if isinstance(v, tuple) else (v, v) for v in named[level].values()]
        assert M.align_loop_trips(rows, named[level]) == pairs
        loops = (
            {lp.start - base: lp for lp in item.walk()}
            if level == "item"
            else {at - base: lp for at, lp in top.items()}
        )
        for loop_name, row in zip(names, rows):
            start, _, own, parent, _, branches = row
            lp = loops[start]
            ops = s.loop_segment(lp, own=True).ops
            assert lp.own_bundles == own and _LOOP_SIGNATURES[loop_name](ops), (loop_name, ops)
            assert parent == (0 if loop_name == "page_copies" else -1)
            # the item loop's one branch: the rolled page copies with a partly filled last page's
            # chunk copies (most of its code, which an item filling its slot skips)
            if loop_name == "item_fetch":
                assert own / 2 < branches < own, row
    assert [n for n in named["block"]] == ["spread_matrix", "init", "write_back"]


@pytest.mark.compile
@pytest.mark.timeout(600)
def test_tpu7x_loads_int8_mxu_weights_as_bf16():
    """What README's paged section says of TPU7x's 8-bit decode (benchmarks/mxu_weight_probe.py):
    a quad's score matmul with int8 keys unpacks them (two `vunpack` per int8 vreg) and pushes
    as many weight vregs as bf16 keys (no int8 MXU path), e4m3 keys half as many, unwidened; and
    the stored probe results are what a compile gives now."""
    import collections
    import json

    import mxu_weight_probe

    stored = json.loads((ROOT / "benchmarks/results/mxu_weight_probe.json").read_text())["rows"]
    ops = {}
    for rhs in mxu_weight_probe.DTYPES:
        row = mxu_weight_probe.probe_row("tpu7x", "scores", rhs)
        (kept,) = [
            r
            for r in stored
            if r["generation"] == "tpu7x" and r["matmul"] == "scores" and r["rhs"] == rhs
        ]
        assert kept["bundles"] == row["bundles"], rhs
        ops[rhs] = collections.Counter(row["ops"])
    keys = mxu_weight_probe.KEYS * mxu_weight_probe.HEAD_DIM
    assert ops["int8"]["vunpack"] == 2 * keys // (32 * 128)
    assert ops["int8"]["vmatpush3"] == ops["bfloat16"]["vmatpush3"] > 0
    assert 2 * ops["float8_e4m3fn"]["vmatpush3"] == ops["bfloat16"]["vmatpush3"]
    assert ops["bfloat16"]["vunpack"] == ops["float8_e4m3fn"]["vunpack"] == 0
