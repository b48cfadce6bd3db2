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
  at `tiles` (None: what `choose_tiles` picks), `vmem_bytes` its budget-model need.

The problem arguments are each family's own. How candidates are ranked is not yet shared:
flash_attention ranks by `KernelCost.modelled_seconds`, ragged_dot by compute plus traffic time,
paged_attention takes the first fitting entry of a fixed preference list.

Vendored into every Hub package at build time: no imports from the collection.
"""

from __future__ import annotations

import dataclasses
import os

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


def get_generation(name: str | None = None) -> TpuGeneration:
    """`name`, else $PALLAS_TPU_GENERATION, else the attached TPU's, else the default (v6e)."""
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
# above. The three shares are the effective budgets the families had when the collection was
# unified (v6e: 75.2, 64 and 36 MiB of the 96 MiB capacity; TPU7x: 36.8, 32 and 24 MiB). One
# common share would change default tiles at production shapes, and with them the compiled
# programs that benchmarks/results/results.md describes, so they are kept, named here and nowhere
# else; making them one is a tile-policy change to be checked on the compiled schedules.
VMEM_BUDGET_FAMILIES = ("flash_attention", "ragged_dot", "paged_attention")


def vmem_budget_bytes(gen: TpuGeneration, family: str) -> int:
    """VMEM the tile search of `family` may fill on `gen` (every family's tiling reads it here).

    flash_attention: all of the capacity that `vmem_limit_bytes` can still grant after its
      headroom: (capacity - 2 MiB) / 1.25.
    ragged_dot: 2/3 of the capacity (half the physical VMEM).
    paged_attention: 3/4 of the larger of the default scoped limit and half the capacity (its
      fixed tile preference list takes the first entry that fits).
    """
    cap = vmem_capacity_bytes(gen)
    if family == "flash_attention":
        return int((cap - VMEM_LIMIT_EXTRA_BYTES) / VMEM_LIMIT_MARGIN)
    if family == "ragged_dot":
        return cap * 2 // 3
    if family == "paged_attention":
        return max(gen.scoped_vmem_default_bytes, cap // 2) * 3 // 4
    raise ValueError(f"unknown kernel family {family!r}; expected one of {VMEM_BUDGET_FAMILIES}")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one kernel call makes the hardware do, from a kernel's closed-form cost model
    (`tiling.estimate_cost`). The benchmarks check these numbers against TPU-interpret-mode counts."""

    useful_flops: int  # the math the caller asked for
    mxu_flops: int  # the math issued, tile padding included
    hbm_bytes: int  # bytes moved between HBM and VMEM/SMEM (reads + writes)
    min_hbm_bytes: int  # each input read once, each output written once
    grid_steps: int
    vmem_bytes: int = 0  # the budget model's VMEM need

    def modelled_seconds(self, gen: TpuGeneration, peak_flops: float | None = None) -> float:
        """max(issued FLOPs / peak, bytes / HBM bandwidth) + steps x per-step overhead."""
        peak = peak_flops or gen.bf16_flops
        return max(self.mxu_flops / peak, self.hbm_bytes / gen.hbm_bytes_per_s) + (
            self.grid_steps * gen.step_overhead_s
        )

    def roofline_seconds(self, gen: TpuGeneration, peak_flops: float | None = None) -> float:
        peak = peak_flops or gen.bf16_flops
        return max(self.useful_flops / peak, self.min_hbm_bytes / gen.hbm_bytes_per_s)
