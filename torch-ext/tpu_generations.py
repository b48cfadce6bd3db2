"""What each TPU generation offers a kernel: memory sizes, tiling units, peaks.

Shared by every kernel's `tiling.py` (VMEM budget models) and by the benchmarks (modelled time).
Per JAX device (one TensorCore; on TPU7x each core is its own device). Numbers from the Google
Cloud TPU documentation and jax's tpu_info; see README "TPU generations".

Tile policy: the contract every family's `tiling.py` follows (tests/test_shared_contract.py
checks it for every family):

- `vmem_budget_bytes(gen)`: the family's VMEM budget, read from `vmem_budget_bytes(gen, family)`
  here (one place for all families and generations); a tile candidate whose budget-model need
  exceeds it is never chosen.
- `choose_tiles(*, <the problem as keywords>, generation=None, override=None)`: the family's frozen
  tiles dataclass, with a `vmem_limit_bytes` field (None: `vmem_limit_bytes(gen, need)`), for
  `generation` (a name; None: `get_generation()`); `override` wins.
- `estimate_cost(<the problem>, ..., tiles=None, generation=None)`: the `KernelCost` of one call
  at `tiles` (None: what `choose_tiles` picks), `vmem_bytes` its budget-model need, and what its
  compute tiles push through each unit (`compute_tiles`, `mxu_pushes`, `eup_pushes`,
  `valu_ops`, `vmem_loads`, `vmem_stores`, `step_vregs`: the family's own per-tile counts, summed
  over the call).
- Ranking: `choose_tiles` picks among the candidates that fit with `best_tiles` (one function for
  every family), by `ranked_seconds`, a schedule-aware time model: max(the tiles' bundles / clock
  (never below the MXU FLOP floor), HBM bytes / bandwidth) + grid steps x step overhead. A tile's
  bundles come from `tile_bundles`: max(MXU push cycles x issue factor, vector-unit slot cycles
  x issue factor, VMEM load / store slot cycles x issue factor) + a fixed per-tile cost, plus the
  grid steps' own code where a family counts it (`step_bundles`), constants per generation
  (`TILE_BUNDLE_MODELS`)
  calibrated on libtpu's LLO dumps of our kernels' hot loops
  (benchmarks/results/tile_model_calibration.json; tests/test_shared_contract.py keeps the
  model within its tolerance of them). A family whose cost leaves the unit counts at 0 is ranked
  by the MXU FLOP floor (the roofline). A family that gives a `step_profile` (the gmm) has its
  compute and copies overlapped grid step by grid step (`overlapped_step_seconds`), not as
  totals. `best_tiles(..., within=)` treats candidates within the
  model's error of the fastest as equal and lets the family's tie-break (larger DMA blocks for
  flash) choose among them.

The problem arguments are each family's own. Every family ranks with `best_tiles`:
flash_attention's forward with per-tile unit counts (its backward: the FLOP floor, its dumps are
not calibrated yet); ragged_dot's gmm with its row windows' MXU pushes and VMEM loads and its grid
steps' own vregs (tgmm keeps its earlier summed-time search: not calibrated); paged_attention on
the decode batch its static shapes describe, without unit counts (its preference order breaks the
model's ties).

Vendored into every Hub package at build time: no imports from the collection.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    name: str  # "v5e", "v6e", "tpu7x", ...
    topology: str  # a name `jax.experimental.topologies.get_topology_desc` accepts
    device_kinds: tuple[str, ...]  # `jax.devices()[0].device_kind` values
    vmem_bytes: int  # per core
    smem_bytes: int
    scoped_vmem_default_bytes: int  # what Mosaic grants a kernel unless vmem_limit_bytes is raised
    mxu_size: int  # the MXU's square side: tiles along contracting/output dims should be multiples
    bf16_sublanes: int  # rows of one bf16 (sublane x lane) tile; 8-bit types use 2x this
    bf16_flops: float  # peak FLOP/s per device
    int8_ops: float | None
    fp8_flops: float | None
    hbm_bytes_per_s: float
    step_overhead_s: float = 0.35e-6  # fixed cost of one grid step
    # Core clock used to turn compiled VLIW bundles into time (benchmarks/schedule_model.py): one
    # bundle issues per cycle. No public source gives these clocks; each is derived from the bf16
    # peak and the MXU array (peak / FLOPs per cycle) and is an assumption until
    # benchmarks/validate_schedule.py checks it against tokamax's published TPU timings.
    clock_hz: float = 1.75e9
    clock_source: str = "assumed"
    cores_per_device: int = 1  # >1: megacore, "parallel" grid dims are split across cores


GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            name="v5e",
            topology="v5e:2x2",
            device_kinds=("TPU v5 lite", "TPU v5e"),
            vmem_bytes=128 * MiB,
            smem_bytes=1 * MiB,
            scoped_vmem_default_bytes=16 * MiB,
            mxu_size=128,
            bf16_sublanes=16,
            bf16_flops=197e12,
            int8_ops=393e12,
            fp8_flops=None,
            hbm_bytes_per_s=819e9,
            clock_hz=1.5e9,
            clock_source="197 TFLOP/s / (4 MXUs x 128x128 x 2 FLOP) = 1.50 GHz (derived, assumed)",
        ),
        TpuGeneration(
            name="v5p",
            topology="v5p:2x2x1",
            device_kinds=("TPU v5", "TPU v5p"),
            vmem_bytes=64 * MiB,
            smem_bytes=1 * MiB,
            scoped_vmem_default_bytes=16 * MiB,
            mxu_size=128,
            bf16_sublanes=16,
            bf16_flops=459e12,
            int8_ops=918e12,
            fp8_flops=459e12,
            hbm_bytes_per_s=2765e9,
            cores_per_device=2,
            clock_hz=1.75e9,
            clock_source="459 TFLOP/s / 2 cores / (4 MXUs x 128x128 x 2 FLOP) = 1.75 GHz "
            "(derived, assumed)",
        ),
        TpuGeneration(
            name="v6e",
            topology="v6e:2x2",
            device_kinds=("TPU v6 lite", "TPU v6e"),
            vmem_bytes=128 * MiB,
            smem_bytes=1 * MiB,
            scoped_vmem_default_bytes=32 * MiB,
            mxu_size=256,
            bf16_sublanes=16,
            bf16_flops=918e12,
            int8_ops=1836e12,
            fp8_flops=918e12,
            hbm_bytes_per_s=1638e9,
            clock_hz=1.75e9,
            clock_source="918 TFLOP/s / 524,288 FLOP per cycle = 1.75 GHz (the figure "
            "compiled-schedule.md assumes; derived, assumed)",
        ),
        TpuGeneration(
            name="tpu7x",
            topology="tpu7x:2x2x1",
            device_kinds=("TPU7x", "TPU v7", "TPU v7x"),
            vmem_bytes=64 * MiB,
            smem_bytes=1 * MiB,
            scoped_vmem_default_bytes=32 * MiB,
            mxu_size=256,
            bf16_sublanes=16,
            bf16_flops=1153e12,
            int8_ops=None,
            fp8_flops=2307e12,
            hbm_bytes_per_s=3.7e12,
            clock_hz=2.2e9,
            clock_source="1153 TFLOP/s per core / (4 MXUs x 256x256 x 2 FLOP) = 2.2 GHz "
            "(derived, assumed)",
        ),
    )
}

# The generations every kernel must compile for (CI's deviceless compile tests).
TESTED_GENERATIONS = ("v5e", "v6e", "tpu7x")
DEFAULT_GENERATION = "v6e"
GENERATION_ENV = "PALLAS_TPU_GENERATION"


def get_generation(name: str | TpuGeneration | None = None) -> TpuGeneration:
    """`name` (a TpuGeneration is returned as it is), else $PALLAS_TPU_GENERATION, else the
    attached TPU's, else the default (v6e)."""
    if isinstance(name, TpuGeneration):
        return name
    name = name or os.environ.get(GENERATION_ENV) or detect_generation() or DEFAULT_GENERATION
    try:
        return GENERATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown TPU generation {name!r}; expected one of {sorted(GENERATIONS)}"
        ) from None


def generation_of_device_kind(kind: str) -> str | None:
    for g in GENERATIONS.values():
        if kind in g.device_kinds:
            return g.name
    return None


def detect_generation() -> str | None:
    """The generation of the first TPU device JAX sees, or None without one."""
    try:
        import jax

        devices = jax.devices("tpu")
    except Exception:  # no TPU backend on this host
        return None
    return generation_of_device_kind(devices[0].device_kind) if devices else None


def vmem_capacity_bytes(gen: TpuGeneration) -> int:
    """The most VMEM any kernel of the collection asks Mosaic for (the cap of `vmem_limit_bytes`):
    3/4 of the core's physical VMEM, the rest left to XLA's own fusions around the kernels."""
    return gen.vmem_bytes * 3 // 4


# vmem_limit_bytes asks for the budget model's need times this, plus this many bytes: headroom for
# Mosaic's internal scratch the models do not count.
VMEM_LIMIT_MARGIN = 1.25
VMEM_LIMIT_EXTRA_BYTES = 2 * MiB


def vmem_limit_bytes(gen: TpuGeneration, needed_bytes: int) -> int:
    """The `vmem_limit_bytes` to ask Mosaic for: the budget model's need plus headroom for
    Mosaic's own scratch, never below the default scoped limit, never above the capacity."""
    want = max(
        gen.scoped_vmem_default_bytes,
        int(needed_bytes * VMEM_LIMIT_MARGIN) + VMEM_LIMIT_EXTRA_BYTES,
    )
    return min(want, vmem_capacity_bytes(gen))


# The VMEM each family's tile search may fill, as a share of the one per-generation capacity
# above, named here and nowhere else. Flash attention and ragged dot search up to everything
# `vmem_limit_bytes` can grant; ragged dot's 2/3 share (v6e 64 of 96 MiB, TPU7x 32 of 48), the
# budget it had when the collection was unified, was lifted after the compiled schedules of the
# tiles it kept out were read: whole-K or full-N weight blocks that copy each lhs row once
# (v6e Mixtral-8x7B down, 4096 tokens: 1859 -> 1470 us scheduled; benchmarks/results/results.md).
# Paged attention keeps its smaller share: its preference list takes the first entry that fits.
VMEM_BUDGET_FAMILIES = ("flash_attention", "ragged_dot", "paged_attention")


def vmem_budget_bytes(gen: TpuGeneration, family: str) -> int:
    """VMEM the tile search of `family` may fill on `gen` (every family's tiling reads it here).

    flash_attention, ragged_dot: all of the capacity that `vmem_limit_bytes` can still grant
      after its headroom: (capacity - 2 MiB) / 1.25 (v5e / v6e 75.2 MiB, TPU7x 36.8 MiB).
    paged_attention: 3/4 of the larger of the default scoped limit and half the capacity (its
      fixed tile preference list takes the first entry that fits).
    """
    cap = vmem_capacity_bytes(gen)
    if family in ("flash_attention", "ragged_dot"):
        return int((cap - VMEM_LIMIT_EXTRA_BYTES) / VMEM_LIMIT_MARGIN)
    if family == "paged_attention":
        return max(gen.scoped_vmem_default_bytes, cap // 2) * 3 // 4
    raise ValueError(f"unknown kernel family {family!r}; expected one of {VMEM_BUDGET_FAMILIES}")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one kernel call makes the hardware do, from a kernel's closed-form cost model
    (`tiling.estimate_cost`). The benchmarks check these numbers against TPU-interpret-mode counts.

    The unit counts after `vmem_bytes` are what the call's compute tiles push through each unit,
    summed over the call (0: the family does not count them; `ranked_seconds` then falls back to
    the MXU FLOP floor). `compute_tiles` is the number of score / matmul tiles the kernel body
    runs, each charged the generation's fixed per-tile bundles; `mxu_pushes` MXU weight pushes of
    16 rows (`mxu_pushes()`); `eup_pushes` vregs through the EUP (exp, tanh); `valu_ops` VALU vreg
    ops; `vmem_loads` / `vmem_stores` vregs the tiles load from / store to VMEM (operands the MXU
    reads, accumulator read-modify-write); `step_vregs` vregs the grid steps move outside their
    compute tiles (accumulator init and write-back), summed over the steps (0: not counted);
    `work_items`, for a kernel whose grid step loops over several work items, those items."""

    useful_flops: int  # the math the caller asked for
    mxu_flops: int  # the math issued, tile padding included
    hbm_bytes: int  # bytes moved between HBM and VMEM/SMEM (reads + writes)
    min_hbm_bytes: int  # each input read once, each output written once
    grid_steps: int
    vmem_bytes: int = 0  # the budget model's VMEM need
    compute_tiles: int = 0
    mxu_pushes: int = 0
    eup_pushes: int = 0
    valu_ops: int = 0
    # of compute_tiles, those that carry a mask (band edges, sequence ends, segment ids): the
    # benchmarks' schedule model charges them the bundles of the kernel's masked path
    masked_tiles: int = 0
    vmem_loads: int = 0
    vmem_stores: int = 0
    step_vregs: int = 0
    # a family whose grid step runs a rolled loop over work items, each running the step's own
    # code (paged attention: a q block's items): the items, charged step_fixed_bundles each in
    # place of the grid steps (0: one item per grid step)
    work_items: int = 0
    # per grid step (pipeline order), where a family models it: (the step's share of the
    # compute, e.g. its MXU rows; the bytes its input blocks copy in; the bytes its output
    # blocks write back), arrays of one value per step; `ranked_seconds` then overlaps each
    # step's compute with its neighbours' copies (`overlapped_step_seconds`) instead of the
    # whole call's. None: the call's compute and DMA overlap as totals.
    step_profile: Optional[tuple] = dataclasses.field(default=None, compare=False, repr=False)

    def modelled_seconds(self, gen: TpuGeneration, peak_flops: float | None = None) -> float:
        """max(issued FLOPs / peak, bytes / HBM bandwidth) + steps x per-step overhead (the
        roofline-style model; tiles are ranked by `ranked_seconds`)."""
        peak = peak_flops or gen.bf16_flops
        return max(self.mxu_flops / peak, self.hbm_bytes / gen.hbm_bytes_per_s) + (
            self.grid_steps * gen.step_overhead_s
        )

    def roofline_seconds(self, gen: TpuGeneration, peak_flops: float | None = None) -> float:
        peak = peak_flops or gen.bf16_flops
        return max(self.useful_flops / peak, self.min_hbm_bytes / gen.hbm_bytes_per_s)


# -------------------------------------------------------------------------------------------------
# Tile ranking: one schedule-aware time model for every family's choose_tiles
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileBundleModel:
    """Per-generation constants of the per-tile bundle model (`tile_bundles`).

    A compute tile keeps the MXU busy for its pushes x `push_bundles` cycles, the vector units
    for the larger of EUP pushes / EUP slots and VALU ops / VALU slots, and the VMEM load / store
    slots for its loaded / stored vregs over the slots; the LLO scheduler stretches the busiest
    of the three by its issue factor (`mxu_issue`, `vector_issue`: the dependency latency between
    a tile's matmul, softmax and second matmul that it cannot hide; `memory_issue`: a matmul
    window's weight vregs go VMEM -> MXU one dependent push at a time, so a window with few rows
    waits on its weight loads far below the slots' rate), and every tile adds
    `tile_fixed_bundles` (result pops, loop and address bookkeeping, the statistics' reload).
    A family that counts its grid steps' own vregs (`KernelCost.step_vregs`) is also charged
    `step_vreg_bundles` per such vreg and `step_fixed_bundles` per grid step (the step's code
    outside its compute tiles: work-list reads, DMA issue, accumulator init and write-back).
    Calibrated against the final bundles of our kernels' hot loops (libtpu's LLO dump):
    benchmarks/results/tile_model_calibration.json lists every data point, the command that
    produced it and the model's error; tests/test_shared_contract.py keeps the model within its
    stated tolerance of them (flash's score tiles: `points`; ragged dot's matmul windows and grid
    steps: `gmm_points`)."""

    push_bundles: float  # cycles one MXU push (16 rows x mxu_size x mxu_size) occupies
    mxu_issue: float
    vector_issue: float
    tile_fixed_bundles: float
    memory_issue: float = 0.0  # 0: VMEM loads / stores not calibrated (never bound a tile)
    step_vreg_bundles: float = 0.0
    step_fixed_bundles: float = 0.0
    # A tile bound by its EUP pushes alone issues them at this factor (None: vector_issue).
    eup_issue: float | None = None
    valu_slots: int = 4  # the dumps' CAPACITY row
    eup_slots: int = 1
    vload_slots: int = 3
    vstore_slots: int = 2
    calibrated: bool = True


TILE_BUNDLE_MODELS: dict[str, TileBundleModel] = {
    # push_bundles: (16 x mxu x mxu x 2 FLOP) / (bf16 peak / clock) = 4.0 on all three.
    # v5e: MXU-bound (the vector term is v6e's; no v5e dump is vector-bound).
    # memory_issue / step_*: fitted on gmm dumps (tile_model_calibration.json "gmm_points").
    "v5e": TileBundleModel(
        push_bundles=4.0,
        mxu_issue=1.02,
        vector_issue=1.42,
        tile_fixed_bundles=16,
        memory_issue=2.62,
        step_vreg_bundles=1.53,
        step_fixed_bundles=175,
        vstore_slots=1,
    ),
    "v6e": TileBundleModel(
        push_bundles=4.0,
        mxu_issue=1.05,
        vector_issue=1.42,
        tile_fixed_bundles=224,
        memory_issue=2.21,
        step_vreg_bundles=0.9,
        step_fixed_bundles=183,
    ),
    # TPU7x: no dump of a flash tile below 512 rows; its fixed per-tile bundles are v6e's.
    "tpu7x": TileBundleModel(
        push_bundles=4.0,
        mxu_issue=0.96,
        vector_issue=1.36,
        tile_fixed_bundles=224,
        memory_issue=1.28,
        step_vreg_bundles=0.89,
        step_fixed_bundles=211,
        # The flash forward's soft-capped tiles against a fixed max (a tanh and an f32 exp per
        # score, little VALU work: Gemma-like d=256, 1,261 bundles a 1024 x 512 tile) issue
        # their EUP pushes about one a bundle.
        eup_issue=1.0,
    ),
}
# No dump of v5p was read: v5e's constants (same MXU geometry), marked uncalibrated.
TILE_BUNDLE_MODELS["v5p"] = dataclasses.replace(TILE_BUNDLE_MODELS["v5e"], calibrated=False)


def tile_bundle_model(gen: TpuGeneration) -> TileBundleModel:
    try:
        return TILE_BUNDLE_MODELS[gen.name]
    except KeyError:
        raise ValueError(f"no tile bundle model for TPU generation {gen.name!r}") from None


def mxu_pushes(gen: TpuGeneration, m: int, k: int, n: int) -> int:
    """MXU pushes of one [m, k] @ [k, n] bf16 matmul: one push per 16 rows (a packed bf16 vreg)
    per (mxu_size x mxu_size) block of the weight operand, as the dumps' `vmatmul` counts show
    (v6e: a 512x512 score tile at d=128 or d=256 is 128 pushes for QK^T plus PV)."""
    side = gen.mxu_size
    return -(-m // 16) * -(-k // side) * -(-n // side)


def tile_bundles(
    gen: TpuGeneration,
    *,
    mxu_pushes: float,
    eup_pushes: float = 0.0,
    valu_ops: float = 0.0,
    vmem_loads: float = 0.0,
    vmem_stores: float = 0.0,
    tiles: float = 1.0,
) -> float:
    """Bundles the LLO scheduler needs for `tiles` compute tiles that together push
    `mxu_pushes` / `eup_pushes` / `valu_ops` through the MXU / EUP / VALU and load / store
    `vmem_loads` / `vmem_stores` vregs (one tile: tiles=1): max(MXU cycles x mxu_issue, vector
    slot-cycles x vector_issue (EUP pushes x eup_issue where set), VMEM load / store
    slot-cycles x memory_issue) + tiles x fixed
    bundles (`TileBundleModel`). Per-tile inputs, or totals over homogeneous tiles, give the same
    answer (over tiles bound by different units, the totals' max is a lower bound)."""
    m = tile_bundle_model(gen)
    mxu = mxu_pushes * m.push_bundles * m.mxu_issue
    eup_issue = m.vector_issue if m.eup_issue is None else m.eup_issue
    vector = max(eup_pushes / m.eup_slots * eup_issue, valu_ops / m.valu_slots * m.vector_issue)
    memory = max(vmem_loads / m.vload_slots, vmem_stores / m.vstore_slots) * m.memory_issue
    return max(mxu, vector, memory) + tiles * m.tile_fixed_bundles


def step_bundles(gen: TpuGeneration, *, step_vregs: float, grid_steps: float) -> float:
    """Bundles of the grid steps' own code outside their compute tiles, for a family that counts
    the vregs it moves there (`KernelCost.step_vregs`; 0: not charged)."""
    if not step_vregs:
        return 0.0
    m = tile_bundle_model(gen)
    return step_vregs * m.step_vreg_bundles + grid_steps * m.step_fixed_bundles


def overlapped_step_seconds(compute, reads, writes, streams=None) -> float:
    """Seconds of a grid whose steps are double-buffered (Pallas' pipeline): step i's compute
    (`compute[i]`, seconds) runs while the blocks of step i + 1 are copied in (`reads[i + 1]`),
    the output blocks of step i - 1 are written back (`writes[i - 1]`) and the copies it
    streams itself (`streams[i]`) run; the first step's copies wait, as does the last
    write-back. One rule for the tile ranking (`ranked_seconds` with a `step_profile`) and the
    benchmarks' scheduled time (schedule_model, per-step work)."""
    compute = np.asarray(compute, float)
    reads, writes = np.asarray(reads, float), np.asarray(writes, float)
    hidden = np.r_[reads[1:], 0.0] + np.r_[0.0, writes[:-1]]
    if streams is not None:
        hidden = hidden + np.asarray(streams, float)
    return float(reads[0] + np.maximum(compute, hidden).sum() + writes[-1])


def ranked_seconds(cost: KernelCost, gen: TpuGeneration, *, outside_hbm_bytes: int = 0) -> float:
    """The time model every family's `choose_tiles` ranks candidates by (schedule-aware):

        max(compute, DMA) + grid steps x step overhead + outside_hbm_bytes / bandwidth

    compute = the call's bundles / clock, never below the MXU FLOP floor: its tiles' bundles
    (`tile_bundles` over the KernelCost's per-unit counts) plus its steps' own code
    (`step_bundles`, when counted); DMA = hbm_bytes / bandwidth, overlapped with compute (double
    buffering); `outside_hbm_bytes`: XLA copies around the kernel a tile choice causes (padding
    to a block multiple). A KernelCost without unit counts (compute_tiles == 0) is charged the
    MXU FLOP floor alone (the roofline). With a `step_profile` the compute and the bytes are
    spread over the grid steps by it and overlapped step by step (`overlapped_step_seconds`):
    a step whose copies outlast its compute is charged them (never less than max(compute,
    DMA))."""
    floor = cost.mxu_flops / gen.bf16_flops
    if cost.compute_tiles:
        bundles = tile_bundles(
            gen,
            mxu_pushes=cost.mxu_pushes,
            eup_pushes=cost.eup_pushes,
            valu_ops=cost.valu_ops,
            vmem_loads=cost.vmem_loads,
            vmem_stores=cost.vmem_stores,
            tiles=cost.compute_tiles,
        ) + step_bundles(
            gen, step_vregs=cost.step_vregs, grid_steps=cost.work_items or cost.grid_steps
        )
        compute = max(bundles / gen.clock_hz, floor)
    else:
        compute = floor
    dma = cost.hbm_bytes / gen.hbm_bytes_per_s
    busy = max(compute, dma)
    if cost.step_profile is not None:
        share, reads, writes = (np.asarray(a, float) for a in cost.step_profile)
        moved = reads.sum() + writes.sum()
        per_byte = dma / moved if moved > 0 else 0.0
        spread = compute * share / share.sum() if share.sum() > 0 else np.zeros_like(share)
        busy = max(busy, overlapped_step_seconds(spread, reads * per_byte, writes * per_byte))
    return busy + cost.grid_steps * gen.step_overhead_s + outside_hbm_bytes / gen.hbm_bytes_per_s


def best_tiles(candidates, gen: TpuGeneration, tie_break=None, within: float = 0.0):
    """The candidate with the lowest `ranked_seconds`: `candidates` yields (tiles, KernelCost)
    or (tiles, KernelCost, outside_hbm_bytes); `tie_break(tiles)` orders candidates the model
    cannot tell apart (lower first; default: first seen): those within a factor (1 + `within`)
    of the fastest, `within` being the model's error on the family's tiles (0: exact ties only).
    Returns (tiles, cost, seconds), or None for no candidate."""
    scored = []
    for i, cand in enumerate(candidates):
        tiles, cost = cand[0], cand[1]
        outside = cand[2] if len(cand) > 2 else 0
        scored.append((ranked_seconds(cost, gen, outside_hbm_bytes=outside), i, tiles, cost))
    if not scored:
        return None
    fastest = min(sec for sec, *_ in scored)
    near = [c for c in scored if c[0] <= fastest * (1.0 + within)]
    sec, _, tiles, cost = min(
        near, key=lambda c: ((tie_break(c[2]) if tie_break else ()), c[0], c[1])
    )
    return tiles, cost, sec
