"""Tile sizes and the closed-form cost of the ragged-dot kernels.

Everything here is plain Python / numpy; `estimate_cost` replays exactly the schedule the kernel
runs: the static work list of schedule.py (built by the same function the jitted wrapper runs on
`jax.numpy` arrays). Its names (work_list, LAYOUT, the F_* flags, ...) stay importable from here.

Tile choice (per generation): gmm searches row tiles tm in {128, 256, 512, 1024} (capped by M)
and K / N tiles (the whole dimension, or a divisor from 256 to 4096) among the tiles whose VMEM
need fits the family's budget (tpu_generations.vmem_budget_bytes: what vmem_limit_bytes can
grant), ranked by the collection's shared model (tpu_generations.best_tiles / ranked_seconds) on
`gmm_candidate_cost`: the HBM bytes and grid steps of `estimate_cost`'s closed form, and what the
expected row windows of routed groups push through the MXU and load from VMEM (`window_units`,
calibrated on the LLO dumps of this kernel: a tail window loads its whole weight chunk however few
its rows) plus the grid steps' own accumulator code (`_step_vregs`), with the compute and the
copies overlapped grid step by grid step on a representative routing (`gmm_step_profile`: a
group's first step copies a whole weight block, and a step with few rows cannot hide it);
candidates within RANKING_TOLERANCE of the fastest go to the one moving the fewest HBM bytes,
then to the faster by the model. tgmm ranks the same way (`_tgmm_search`) on
`tgmm_candidate_cost`: `_tgmm_traffic`'s bytes and steps, what its expected row windows push
through the MXU and move through VMEM (`tgmm_window_units`, calibrated on the LLO dumps of tgmm,
tile_model_calibration.json "tgmm_points": the dout rows are the MXU's stationary operand, so a
window of any rows up to the MXU side pushes as much as a full one, and each window reads and
writes its whole f32 (tk, tn) running sum and writes it, cast, into the output block) and the
zero-fill of empty groups' output blocks, with the windows and the copies overlapped grid step by
grid step (`tgmm_step_profile`: a group's output block is written back under the next group's
windows), ties within TGMM_RANKING_TOLERANCE to the fewest HBM bytes.
The VMEM budget model counts every buffer the kernel holds: double-buffered input and output
blocks, the f32 accumulator (where it has one), the quantisation scales, the dequantised weight
copy, the masked K-tail copies, and Mosaic's own scratch beside them (measured on deviceless
compiles where the windows write the output; a whole tile's f32 product where an epilogue works on
the tile: `gmm_vmem_bytes`, `tgmm_vmem_bytes`). Any of tm / tk / tn can be overridden; the rest
are searched.
The gated gate_up gmm (`gate_layout`) searches its output tile tn over the tiles its layout allows
(concatenated: divisors of I; interleaved: multiples of 64 up to 512) with twice the weight columns.
`call_cost` gives every pallas_call its CostEstimate from the same closed forms.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

from . import tpu_generations as _generations
from .schedule import (
    F_COMPUTE,
    F_FIRST,
    F_LAST,
    F_VALID,
    GMM_FIELDS,
    LAYOUT,
    TGMM_FIELDS,
    _fields,
    _itemsize,
    bucket_sizes,
    row_chunk,
    row_unit,
    work_list,
    work_list_length,
)
from .tpu_generations import (
    GENERATIONS,  # noqa: F401  (re-exported: tiling.GENERATIONS)
    KernelCost,
    TpuGeneration,
    best_tiles,
    get_generation,
    mxu_pushes,
)

__all__ = [
    "GmmTiling",
    "TgmmTiling",
    "gmm_tiling",
    "tgmm_tiling",
    "gmm_vmem_bytes",
    "tgmm_vmem_bytes",
    "bucket_sizes",
    "row_chunk",
    "row_unit",
    "work_list",
    "work_list_length",
    "estimate_cost",
    "GMM_FIELDS",
    "TGMM_FIELDS",
    "F_COMPUTE",
    "F_FIRST",
    "F_LAST",
    "F_VALID",
    "ACTIVATIONS",
    "GATE_LAYOUTS",
    "call_cost",
    "check_gated_tn",
    "use_lp_scheduler",
    "vmem_budget_bytes",
    "choose_tiles",
    "LAYOUT",
]

# Gated activations the gate_up gmm can fuse into its epilogue, and the gate/up column layouts.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gpt_oss_swiglu")
GATE_LAYOUTS = ("concatenated", "interleaved")


# -------------------------------------------------------------------------------------------------
# Tiling configs and the VMEM budget model
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """Tiles of gmm: lhs blocks (tm, tk), rhs blocks (tk, tn) [(tn, tk) transposed], out (tm, tn)."""

    tm: int
    tk: int
    tn: int
    vmem_limit_bytes: Optional[int] = None  # None: from the budget model


@dataclasses.dataclass(frozen=True)
class TgmmTiling:
    """Tiles of tgmm: lhs blocks (tm, tk), dout blocks (tm, tn), out blocks (tk, tn) per group."""

    tm: int
    tk: int
    tn: int
    vmem_limit_bytes: Optional[int] = None


# What Mosaic allocates beside a gmm's buffers (blocks, accumulators, dequantised / masked copies)
# when its windows write the output block, per weight block a window multiplies. The windows'
# f32 products are not held whole: at Mixtral-8x7B down, 512-row windows of 2048 columns, the
# compile's scoped VMEM is the buffers plus 2.8 MiB, where the tile's product alone is 4 MiB.
# Measured as the smallest vmem_limit_bytes a deviceless compile accepts, over 15 tilings of
# production shapes on v5e, v6e and TPU7x (bf16 and int8, K in one block and split, the
# concatenated gate): 0.35-3.0 MiB with one weight block, 4.1-5.1 with the gate's two
# (tests/test_ragged_dot_compile.py checks the model against the compiler both ways).
WINDOW_SCRATCH_BYTES = 3 * 1024 * 1024


def gmm_vmem_bytes(
    tm, tk, tn, lhs_dtype, rhs_dtype, out_dtype, *, k=None, quantised=False, gate_layout=None
) -> int:
    """VMEM the gmm kernel holds for these tiles (see the module docstring). `tn` is the output
    tile; a gated gmm (`gate_layout` given) holds 2 * tn weight / accumulator columns per output
    tile, plus the epilogue's activation values."""
    lb, wb, ob = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
    out_tn = tn
    if gate_layout is not None:
        tn = 2 * tn
    need = 2 * tm * tk * lb + 2 * tk * tn * wb + 2 * tm * out_tn * ob  # double-buffered blocks
    if k is None or not gmm_sums_in_output(k, tk, lhs_dtype, out_dtype, gate_layout):
        need += tm * tn * 4  # f32 accumulator
    if gmm_windows_write_output(lhs_dtype, out_dtype, gate_layout) and max(lb, wb) < 4:
        # The windows' products flow from the MXU into their stores: what Mosaic holds beside
        # the buffers is its own scratch, per weight block (WINDOW_SCRATCH_BYTES).
        need += _weight_blocks(out_tn, gate_layout)[0] * WINDOW_SCRATCH_BYTES
    else:
        # The whole tile's f32 product and merged value (the interleaved gate's epilogue works
        # on the whole tile; f32 operands go through the MXU in several bf16 passes).
        need += 2 * tm * tn * 4
    if quantised:
        need += 2 * 8 * tn * 4  # scale blocks (1, tn) f32, padded to 8 sublanes, double-buffered
        need += tk * tn * lb  # weights dequantised to the lhs dtype
    if k is not None and k % tk:
        need += tm * tk * lb + tk * tn * max(wb, lb)  # masked copies of the last K block
    if gate_layout == "interleaved":  # the epilogue's activation values, lane-selection matrix
        need += tm * tn * 4 + tn * out_tn * 4
    return need


def gmm_windows_write_output(lhs_dtype, out_dtype, gate_layout=None) -> bool:
    """gmm's windows write their rows' finished values (scaled, biased, gated), cast, into the
    output block themselves (no grid step zeroes an accumulator or copies it out per row tile)
    unless the gate is interleaved (its epilogue pairs lanes of a whole tile and compacts them
    with a matmul) or an lhs row unit is not a whole number of the output's packed rows (the
    windows' dynamic row offsets must stay aligned in the output block)."""
    return gate_layout != "interleaved" and row_unit(out_dtype) <= row_unit(lhs_dtype)


def gmm_sums_in_output(k, tk, lhs_dtype, out_dtype, gate_layout=None) -> bool:
    """gmm keeps no f32 accumulator when its windows write the output block and one K block
    holds all of K: a row's sum is then one window's product. (With more K blocks the running
    sum stays in an f32 accumulator that each item's first K block overwrites.)"""
    return -(-k // tk) == 1 and gmm_windows_write_output(lhs_dtype, out_dtype, gate_layout)


def tgmm_sums_in_output(out_dtype) -> bool:
    """tgmm keeps its f32 running sum in the output block itself (no accumulator scratch, no
    cast copy per window) when the output is f32."""
    return np.dtype(out_dtype) == np.dtype(np.float32)


def tgmm_vmem_bytes(tm, tk, tn, lhs_dtype, dout_dtype, out_dtype) -> int:
    """VMEM the tgmm kernel holds for these tiles: double-buffered lhs, dout and output blocks,
    the f32 accumulator (unless the output is f32 and holds the sum), and what Mosaic allocates
    beside them. Its windows work one column chunk at a time and write each chunk's sum back
    at once, so that is the windows' scratch (WINDOW_SCRATCH_BYTES; the smallest vmem_limit_bytes
    a deviceless compile accepts is buffers + accumulator + 1.0-1.6 MiB at production tiles on
    v5e / v6e / TPU7x), not a whole (tk, tn) f32 product and merged value. f32 operands, which
    go through the MXU in several bf16 passes, keep those and the row-masked copies."""
    lb, db, ob = _itemsize(lhs_dtype), _itemsize(dout_dtype), _itemsize(out_dtype)
    need = 2 * tm * tk * lb + 2 * tm * tn * db + 2 * tk * tn * ob
    need += 0 if tgmm_sums_in_output(out_dtype) else tk * tn * 4  # f32 accumulator
    if max(lb, db) < 4:
        return need + WINDOW_SCRATCH_BYTES
    need += 2 * tk * tn * 4  # matmul result and merged value
    need += tm * tk * lb + tm * tn * db  # row-masked operand copies
    return need


def _gmm_traffic(m, k, n, num_groups, lb, wb, ob, tm, tk, tn, items, gate_layout=None):
    """HBM bytes and grid steps of gmm with evenly sized groups (the closed form behind the tile
    search and the pallas_call cost estimate): lhs once per N tile when K is whole, else its row
    tile once per item (consecutive items of a row tile step through its K blocks, so each
    copies them again); weights once per group when K is whole, else once per item; the output
    once. A gated gmm reads 2 * n weight columns."""
    kt, nt = -(-k // tk), -(-n // tn)
    wn = 2 * n if gate_layout is not None else n
    groups_read = min(num_groups, m) if kt == 1 else items
    lhs_rows = m if kt == 1 else max(m, items * min(tm, m))
    nbytes = nt * lhs_rows * k * lb + groups_read * k * wn * wb + m * n * ob
    return nbytes, nt * items * kt


def _tgmm_traffic(m, k, n, num_groups, lb, db, ob, tm, tk, tn, items):
    kt, nt = -(-k // tk), -(-n // tn)
    nbytes = nt * m * k * lb + kt * m * n * db + num_groups * k * n * ob
    return nbytes, kt * nt * items


def _epilogue_flops(m, n, tn, gate_layout) -> int:
    """The interleaved epilogue's lane-selection matmul: (tm, 2 tn) x (2 tn, tn) per output tile."""
    return 2 * m * 2 * tn * n if gate_layout == "interleaved" else 0


def call_cost(
    kind: str,
    m: int,
    k: int,
    n: int,
    num_groups: int,
    lhs_dtype,
    rhs_dtype,
    out_dtype,
    tiling,
    *,
    activation: Optional[str] = None,
    gate_layout: Optional[str] = None,
) -> dict:
    """The pallas_call's CostEstimate fields, from the closed forms of the tile search (group sizes
    are traced inside jit, so groups are taken evenly sized): flops = 2 * (M + expected row
    padding) * K * N (x2 for the gated gate and up halves, plus the interleaved epilogue's
    selection matmul), transcendentals = one exp / erf / tanh per output element of a fused
    activation, bytes_accessed = the HBM traffic of _gmm_traffic / _tgmm_traffic."""
    lb, wb, ob = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    if kind == "gmm":
        unit = row_unit(lhs_dtype)
        items = -(-m // tm) + min(num_groups, m)
        nbytes, _ = _gmm_traffic(m, k, n, num_groups, lb, wb, ob, tm, tk, tn, items, gate_layout)
    else:
        unit = row_unit(lhs_dtype, rhs_dtype)
        items = -(-m // tm) + num_groups
        nbytes, _ = _tgmm_traffic(m, k, n, num_groups, lb, wb, ob, tm, tk, tn, items)
    flops = 2 * (m + items * _row_padding(m / items, tm, unit)) * k * n
    transcendentals = 0
    if gate_layout is not None:
        flops = 2 * flops + _epilogue_flops(m, n, tn, gate_layout)
        # interleaved: the activation runs on all 2 tn lanes of a block before the compaction
        transcendentals = m * n * (2 if gate_layout == "interleaved" else 1)
    return {
        "flops": int(flops),
        "transcendentals": int(transcendentals),
        "bytes_accessed": int(nbytes),
    }


def use_lp_scheduler(generation: Optional[str] = None) -> bool:
    """Whether the kernels pass Mosaic the LP LLO-scheduler flag on `generation` (decided from the
    compiled gmm / tgmm schedules, README "ragged-dot-tpu")."""
    return get_generation(generation).name in _LP_SCHEDULER_GENERATIONS


_LP_SCHEDULER_GENERATIONS: tuple[str, ...] = ()


def vmem_budget_bytes(gen: TpuGeneration) -> int:
    """VMEM the tile search may fill: this family's share in tpu_generations.vmem_budget_bytes."""
    return _generations.vmem_budget_bytes(gen, "ragged_dot")


def _dim_candidates(size: int, halves: bool = False) -> list[int]:
    """Legal tiles along a lane dimension: the whole dimension, and the powers of two from 256
    to 4096 below it that divide it (no tail); with `halves` (gmm's N), also its half and quarter
    when it is above 4096 with no such divisor of 2048 or more (multiples of 128 only);
    non-dividing 512 / 256 only when no divisor exists (the kernel masks a K tail; an N tail is
    clipped at write-back)."""
    cands = [size]
    divisors = [c for c in (4096, 2048, 1024, 512, 256) if c < size and size % c == 0]
    cands += divisors
    if halves and size > 4096 and not any(d >= 2048 for d in divisors):
        # N like 7168 (7 x 1024) has no power-of-two divisor of 2048 or more: its half and
        # quarter (3584, 1792) are fewer passes over lhs (DeepSeek-V3's down projection reads lhs
        # 7 times at tn = 1024, twice at 3584; the weights stream once either way). Not along K:
        # a K split re-reads each item's lhs and weight blocks per K block.
        cands += [size // f for f in (2, 4) if size % (128 * f) == 0]
    if size > 512 and not divisors:
        cands += [512, 256]
    return cands


# The gmm searches 128-row tiles only for a K block no larger row tile's program can hold
# (`program_fits`). With the weight blocks copied a run ahead (`prefetches_runs`) the step model
# ranks 128-row tiles level with 256 (their boundary copies no longer show), but on a TPU v5e
# chip 128 rows ran slower than every larger tile at the same K block at Qwen3-30B-A3B gate_up,
# 4096 tokens: 1912 us against 1496 (256), 1614 (512), 1684 (1024); where only 128 rows fit a
# whole-K block they won: Mixtral-8x7B down, 4096 tokens, 128 / 14336 / 512 ran 6262 us
# against 7044 at 1024 / 2048 / 2048 (benchmarks/results/device/v5e_gmm_tile_sweep_run_ahead.json).
# (Since v5e's program budget went 28k -> 41k, 256 rows hold that block and ran 5538 us
# against 5954 at 128; the dlhs of Mixtral gate_up, K 28672, still takes 128: PROGRAM_MXU_BUNDLES.)
GMM_MIN_ROW_TILE = 256


def _row_candidates(gen: TpuGeneration, m: int, unit: int, tm: Optional[int]) -> list[int]:
    if tm:
        return [tm]
    cap = -(-max(m, 1) // unit) * unit
    return sorted({max(unit, min(t, cap)) for t in (gen.mxu_size, 128, 256, 512, 1024)})


def _row_padding(rows_per_item: float, tm: int, unit: int) -> float:
    """Expected padded MXU rows per work item, for items of about `rows_per_item` rows: a tiny item
    runs on at least one row unit; pieces of varied length past chunk/8 rows pad by half a bucket
    step (chunk/8) on average; shorter ones by about a third of their length (power-of-two
    buckets)."""
    rc = row_chunk(tm)
    if rows_per_item >= rc / 8:
        return rc / 16
    return max(unit - rows_per_item, rows_per_item / 3)


def _gated_tn_candidates(n: int, layout: str) -> list[int]:
    """Output tiles of a gated gmm: concatenated needs tn | I (the up block of output tile nb is
    block nb + I / tn of the same array); interleaved takes 2 * tn columns per block, any
    multiple of 64 (an edge block is masked), kept <= 512 because its epilogue's lane-selection
    matmul costs 2 * tn / K of the tile's MXU work."""
    if layout == "concatenated":
        return [n] + [c for c in (4096, 2048, 1024, 512, 256, 128) if c < n and n % c == 0]
    return ([n] if n <= 512 else []) + [c for c in (512, 256, 128, 64) if c < n]


def check_gated_tn(tn: int, n: int, layout: str) -> None:
    if layout == "concatenated" and n % tn:
        raise ValueError(
            f"tiling: tn={tn} must divide the intermediate size {n} (concatenated "
            "gate/up: the up block sits I / tn blocks after the gate block)"
        )
    if layout == "interleaved" and tn != n and (2 * tn) % 128:
        raise ValueError(f"tiling: tn={tn} must be a multiple of 64 or the intermediate size {n}")


# -------------------------------------------------------------------------------------------------
# What the gmm's compute tiles push through each unit (the shared ranking model's inputs)
# -------------------------------------------------------------------------------------------------

# Largest weight block one straight-line window matmul covers (K x N elements): a wider block is
# cut into column chunks of at most this many (tk x cols) elements, run by a loop whose body is
# one block-sized matmul, so the kernel's code stays bounded (compile time, instruction memory).
# Qwen3-30B-A3B's whole 2048 x 1536 block schedules at MXU 0.91 on v6e; Mixtral's 4096 x 2048 is
# cut along N. kernel.py's windows (gmm and tgmm) chunk by `window_cols`, the one definition.
MAX_DOT_ELEMENTS = 2048 * 2048

# The whole kernel must fit one instruction-memory overlay. A program larger than an overlay is
# cut into several, and a grid loop that spans them reloads every piece from HBM at every grid
# step: on a TPU v5e chip (benchmarks/device_timing.py, 2026-12-04) the gmm's 140k-bundle
# program ran in 8 overlays and took 3-7x its compiled schedule (Qwen3-30B-A3B gate_up at 64
# tokens 7.0 ms for 1.0 ms of weight DMA). The kernel holds one copy of the window matmul per row
# count it runs (the full window and every tail bucket), so the columns of a window are cut until
# all those copies together take at most the generation's budget of MXU bundles (MACs / the
# generation's MACs per bundle). The budgets come from libtpu 0.0.42's overlay graphs of
# deviceless compiles (llo_schedule.program_overlays; the XLA ops around the kernel sit in an
# overlay of their own) at the named gmm cells (benchmarks/shapes.py):
# - v5e 41k: Mixtral-8x7B down at 256-row tiles and a whole 14336-deep K block (39.8k MXU bundles)
#   is a 39,800-bundle kernel in one overlay, the dlhs of Mixtral gate_up at 128 / 28672 / 512
#   (39.4k) a 40,088-bundle one, and DeepSeek-V3-like gate at 512 / 7168 (46.7k) a 46,376-bundle
#   one; the 68k gated kernel below is cut into 4. The budget was 28k, from the one size then
#   timed on the chip (Qwen3-30B-A3B gate_up's 31,666-bundle kernel); on a TPU v5e chip the
#   picks 41k let in all ran faster than the 128-row or split-K tiles 28k left: the gmm at
#   Mixtral-8x7B down 256 / 14336 / 1024 5538 us against 5954 at 128 rows (4096 tokens) and
#   20780 against 21831 (16384), with int8 weights 5692 against 5796; the dlhs of Mixtral gate
#   5519 against 5820 and of Mixtral gate_up 128 / 28672 / 512 12212 against 13258 at
#   1024 / 2048 / 4096 (benchmarks/results/device/v5e_*_budget41k.json).
# - v6e 41k: Qwen3-30B-A3B gate_up at 4096 tokens with whole 1536-column windows (40k MXU
#   bundles) is a 47,642-bundle kernel in one overlay; DeepSeek-V3-like down at 47k MXU bundles
#   a 57,348-bundle one, still in one; Mixtral gate_up at 53k a 68,168-bundle one, cut into 8. The
#   limit lies between the last two; 41k keeps the largest kernel ~10k bundles under the first.
# - TPU7x 54k: its kernels take ~0.8 bundles per MXU bundle of window code (more work per
#   bundle than macs_per_bundle counts); Mixtral gate_up at 53.5k MXU bundles, every named
#   cell's widest windows, is a 42,310-bundle kernel in one 45,928-bundle overlay.
# A generation not listed (v5p: no dump of it read) takes UNLISTED_PROGRAM_MXU_BUNDLES, the
# budget v5e had before its overlay graphs were read (a 31,666-bundle kernel fit one overlay).
PROGRAM_MXU_BUNDLES = {"v5e": 41_000, "v6e": 41_000, "tpu7x": 54_000}
UNLISTED_PROGRAM_MXU_BUNDLES = 28_000


def program_mxu_bundles(gen: TpuGeneration) -> int:
    """The MXU bundles every window copy of one gmm / tgmm kernel may take on `gen` together."""
    return PROGRAM_MXU_BUNDLES.get(gen.name, UNLISTED_PROGRAM_MXU_BUNDLES)


def macs_per_bundle(gen: TpuGeneration) -> float:
    """bf16 multiply-accumulates the MXUs of one core retire per bundle (cycle) at peak."""
    return gen.bf16_flops / gen.cores_per_device / 2 / gen.clock_hz


def window_code_rows(tm: int, unit: int) -> int:
    """Rows of all the window matmul copies a kernel of row tile `tm` holds: the full window and
    one per tail bucket."""
    return row_chunk(tm) + sum(bucket_sizes(tm, unit))


def program_fits(gen: TpuGeneration, tm: int, tk: int, unit: int, n_rhs: int = 1) -> bool:
    """Whether a kernel of row tile `tm` and K block `tk` can fit the program budget at all: its
    window copies at the narrowest window (128 columns, `n_rhs` weight blocks each) within
    program_mxu_bundles. A K block too deep for that compiles to a program cut into overlays
    (window_cols cannot go below 128 columns): the gated gate_up gmm at Mixtral-8x7B (tm 512,
    tk 4096, two weight blocks) was a 68k-bundle kernel in 4 large overlays on v5e and ran 1.27x
    the plain gmm plus XLA's activation on the chip (benchmarks/results/device/v5e_train_gmm.json).
    The tile search skips such (tm, tk) unless they are given."""
    code_macs = window_code_rows(tm, unit) * n_rhs * tk * 128
    return code_macs <= program_mxu_bundles(gen) * macs_per_bundle(gen)


def window_cols(
    k_rows: int,
    cols: int,
    gen: Optional[TpuGeneration] = None,
    tm: Optional[int] = None,
    unit: Optional[int] = None,
    n_rhs: int = 1,
) -> int:
    """Columns per straight-line window matmul for a (k_rows, cols) weight block: cols itself
    when the block is small enough, else the largest multiple of 128 dividing cols within
    MAX_DOT_ELEMENTS and, given the generation, the row tile and row unit, within the program
    budget (program_mxu_bundles over every window copy, `n_rhs` weight blocks each)."""
    limit = MAX_DOT_ELEMENTS
    if gen is not None:
        code_rows = window_code_rows(tm, unit) * n_rhs
        limit = min(limit, int(program_mxu_bundles(gen) * macs_per_bundle(gen) / code_rows))
    if k_rows * cols <= limit or cols % 128:
        return cols
    best = 128
    for c in range(128, cols, 128):
        if cols % c == 0 and k_rows * c <= limit:
            best = c
    return best


def prefetches_runs(k: int, tk: int, n: int, tn: int, gen: TpuGeneration) -> bool:
    """Whether the gmm copies its weight blocks one *run* of items ahead itself (kernel.py,
    `_run_weights`) instead of through a BlockSpec, which copies a group's block under the single
    grid step before the group starts. It does when one K block holds all of K (a run then reads
    one block), every column block lies inside its weight array (a manual copy has no edge
    padding; N % tn == 0 covers the gated layouts' blocks too) at lane-aligned column offsets (tn
    a multiple of 128: Mosaic cannot slice at an offset of 320) and the device has one core (the
    chain of copies runs across N tiles, so that axis is not split between cores)."""
    return tk == k and n % tn == 0 and tn % 128 == 0 and gen.cores_per_device == 1


def _weight_blocks(tn: int, gate_layout: Optional[str]) -> tuple[int, int]:
    """(weight refs, columns of each) one gmm grid step multiplies: plain 1 x tn; the gated
    gate_up gmm 2 x tn (concatenated: gate and up blocks) or 1 x 2 tn (interleaved)."""
    if gate_layout == "concatenated":
        return 2, tn
    if gate_layout == "interleaved":
        return 1, 2 * tn
    return 1, tn


def window_units(gen: TpuGeneration, rows, tk: int, cols: int, n_rhs: int, lhs_dtype) -> dict:
    """What one window (an lhs row window of `rows` rows times `n_rhs` weight chunks of
    (tk, cols), the kernel's `window` at one column chunk) pushes through the MXU and moves
    through VMEM: the weight chunk is loaded whole whatever the rows (why a 16-row tail window
    costs most of a full window, the dumps' VLOAD-bound tails), each MXU push streams 16 rows x
    mxu_size of lhs, and the f32 accumulator rows are read and written back. `rows` may be an
    array (one window per entry)."""
    rows = np.asarray(rows, dtype=np.int64)
    lb = _itemsize(lhs_dtype)  # the compute dtype: int8 / fp8 weights are widened to it
    side = gen.mxu_size
    pushes = n_rhs * (-(-rows // 16)) * -(-tk // side) * -(-cols // side)
    weights = n_rhs * -(-tk * cols * lb // 4096)
    lhs = pushes * side * lb // 256  # 16 rows x side of lhs per push, in 4 KiB vregs
    acc = n_rhs * (-(-rows // 8)) * -(-cols // 128)
    return {"mxu_pushes": pushes, "vmem_loads": weights + lhs + acc, "vmem_stores": acc}


def _summed_windows(per_window: dict, window_counts) -> dict:
    """Unit counts of `window_counts[i]` windows whose units are `per_window[key][i]`, summed
    (gmm's `window_units` or tgmm's `tgmm_window_units` over the window kinds), and their
    number as compute_tiles."""
    counts = np.asarray(window_counts, dtype=np.float64)
    out = {key: int(round(float((counts * v).sum()))) for key, v in per_window.items()}
    out["compute_tiles"] = int(round(float(counts.sum())))
    return out


def _window_totals(gen, window_rows, window_counts, tk, cols, n_rhs, lhs_dtype) -> dict:
    """gmm windows: `window_counts[i]` windows of `window_rows[i]` rows each, summed."""
    u = window_units(gen, window_rows, tk, cols, n_rhs, lhs_dtype)
    return _summed_windows(u, window_counts)


def _step_vregs(tm: int, tn: int, gate_layout: Optional[str]) -> int:
    """f32 accumulator vregs one grid step's own code zeroes / writes back (what the dumps' per
    grid step bundles outside the windows scale with).

    Still charged per output tile where the windows write the output block
    (`gmm_windows_write_output`: every gmm but the interleaved gate), whose compiled program no
    longer zeroes or copies out an accumulator per tile. Without it the ranking moved v5e Qwen3-30B-A3B 16384 to 256-row tiles, ranked
    0.4% ahead of 512, which a v5e chip ran 1.5% slower at down (2658 against 2620 us) and level
    at gate_up (4863 / 4872; results/device/v5e_gmm_tile_sweep_write_through.json): the window
    model misses what 256-row windows lose to 512-row ones, and this charge stands in for it
    until the window points are re-dumped from this kernel."""
    n_rhs, cols = _weight_blocks(tn, gate_layout)
    return n_rhs * (-(-tm // 8)) * -(-cols // 128)


def weight_preparations(nt: int, kt: int, computing_items: float, group_runs: float) -> float:
    """How many times the gmm prepares its weight block(s) (kernel.py `_prepare`): on every
    computing grid step, or with one K block once per N tile and run of one group's computing
    items, the copy then holding that group's block for the run's other items (its rows are
    contiguous, so a group's items are one run)."""
    return nt * (group_runs if kt == 1 else kt * computing_items)


def group_runs(wl, compute) -> int:
    """Runs of one group's computing items in a gmm work list (`wl` its fields as arrays,
    `compute` the items' COMPUTE flags): where the group changes from one computing item to the
    next."""
    groups = np.asarray(wl["GROUP"])[np.asarray(compute, bool)]
    return int((groups[1:] != groups[:-1]).sum() + 1) if groups.size else 0


def work_list_preparations(wl, nt: int, kt: int) -> int:
    """`weight_preparations` of a gmm call from its work list (`wl` its fields as arrays)."""
    compute = (wl["FLAGS"] & F_COMPUTE) != 0
    return round(weight_preparations(nt, kt, int(compute.sum()), group_runs(wl, compute)))


def _prepared_vregs(k: int, tk: int, tn: int, gate_layout, lhs_dtype, quantised: bool) -> int:
    """Vregs of the weight copy the gmm prepares in a grid step's own code (kernel.py
    `_prepare`: int8 / e4m3 weights widened to the lhs dtype, or a K tail zeroed): every weight
    block, whole, `weight_preparations` times, 0 when the MXU reads the block itself. The
    charge per vreg is the grid steps' (`step_vreg_bundles`): v5e's LLO dump of int8 Mixtral-8x7B
    down at 128 / 14336 / 1024 spends 9,314 bundles of a step's own code on its 7,168 widened
    vregs (1.3 each; the shared 1.53). While every computing step widened its block, leaving the
    charge out made the ranking take those 128-row whole-K tiles, 9.5% slower by the compiled
    schedule than the tiles it had (6977 against 6373 us; 7471 against 6350 on a v5e chip).
    Widened once per run they are the pick: 5479 us scheduled, 5964 on the chip."""
    if not (quantised or k % tk):
        return 0
    n_rhs, cols = _weight_blocks(tn, gate_layout)
    return n_rhs * -(-tk * cols * _itemsize(lhs_dtype) // 4096)


def _expected_windows(m: int, num_groups: int, tm: int, unit: int):
    """Row windows of gmm's work items for routed groups (sizes unknown at trace time) of
    m / num_groups rows on average: the min(num_groups, m) group ends fall at random rows, so of
    the ceil(m / tm) row tiles T (1 - (1 - 1/T)^ends) hold one and are cut into partial items;
    the others are whole items (full chunks of row_chunk(tm) rows). A partial item runs full
    chunks and one tail window whose rows are taken uniform over (0, min(chunk, 2 x the partial
    items' mean rows)], in the smallest bucket covering them. Returns (items, [(rows, windows)]):
    the call's windows per (N tile, K tile, column chunk)."""
    tiles = -(-m // tm)
    ends = min(num_groups, m)
    cut = tiles * (1.0 - (1.0 - 1.0 / tiles) ** ends)
    whole = tiles - cut
    items = tiles + ends
    partial = items - whole
    rc = row_chunk(tm)
    buckets = bucket_sizes(tm, unit)
    windows = {}

    def add(rows, count):
        if count > 0:
            windows[rows] = windows.get(rows, 0.0) + count

    add(rc, whole * (tm // rc))
    if tm % rc:
        add(next(b for b in buckets if b >= tm % rc), whole)
    mean = max(0.0, m - whole * tm) / partial
    top = max(float(unit), min(float(rc), 2.0 * mean))
    add(rc, partial * max(0.0, mean - top / 2) / rc)
    prev = 0
    for b in buckets:
        add(b, partial * (min(b, top) - min(prev, top)) / top)
        prev = b
    return items, sorted(windows.items())


@functools.lru_cache(maxsize=16)
def representative_group_sizes(m: int, num_groups: int) -> np.ndarray:
    """The routed group sizes the tile search plans for (the real ones are traced): m rows sent
    to num_groups experts uniformly at random, with a fixed seed, so a group's first and last
    rows fall where routing puts them, not on tile edges (equal sizes of 1024 rows would align
    with 1024-row tiles and hide the partial items every real batch has)."""
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(m, np.full(num_groups, 1.0 / num_groups)).astype(np.int32)
    sizes.flags.writeable = False
    return sizes


def _block_changed(*index):
    """Per grid step, whether a block indexed by `index` (one array per block coordinate, in
    grid order) differs from the previous step's: what the pipeline copies (gmm_step_work,
    tgmm_step_work)."""
    return np.r_[True, np.any([np.diff(a) != 0 for a in index], axis=0)]


def gmm_step_work(
    wl, k, n, tm, tk, tn, unit, lhs_bytes, rhs_bytes, out_bytes, gate_layout=None, *,
    prefetch_runs=False,
):  # fmt: skip
    """Per grid step (N tile, item, K tile) of a gmm call, in grid order, from its work list
    `wl` (`_fields` of `work_list`): "full", its full row windows; "tail", 1 where it runs a
    tail window; "rows", the MXU rows it multiplies; "reads", the bytes copied in for it, placed
    where `tpu_generations.overlapped_step_seconds` hides them (reads[i] under step i - 1);
    "writes", the bytes its output block writes back after it (kernel.py's index maps: lhs
    (TILE, k), weights (GROUP, k, n), out (OUT, n); items without MXU work keep the last K
    block). With `prefetch_runs` (`prefetches_runs`) a run's weight block is copied while the
    run before it computes: its bytes are spread over that run's steps by their rows (the first
    run's block still waits). The tile ranking's `step_profile` and the benchmarks' per-step
    schedule (benchmarks/ours.py) both read it."""
    buckets = bucket_sizes(tm, unit)
    L = wl["FLAGS"].shape[0]
    kt, nt = -(-k // tk), -(-n // tn)
    compute = (wl["FLAGS"] & F_COMPUTE) != 0
    tail = compute & (wl["BUCKET"] >= 0)
    full = np.where(compute, wl["NFULL"], 0)
    rows = full * row_chunk(tm) + np.where(
        tail, np.asarray(buckets)[np.maximum(wl["BUCKET"], 0)], 0
    )
    nb = np.repeat(np.arange(nt), L * kt)
    j = np.tile(np.repeat(np.arange(L), kt), nt)
    kb = np.where(wl["KFIX"][j] != 0, kt - 1, np.tile(np.arange(kt), nt * L))

    n_rhs, cols = _weight_blocks(tn, gate_layout)
    weights = _block_changed(wl["GROUP"][j], kb, nb) * float(n_rhs * tk * cols * rhs_bytes)
    if prefetch_runs:
        assert kt == 1, "a run ahead needs one K block"
        weights = _copied_a_run_ahead(weights, rows[j].astype(float))
    reads = _block_changed(wl["TILE"][j], kb) * float(tm * tk * lhs_bytes) + weights
    writes = np.r_[_block_changed(wl["OUT"][j], nb)[1:], True] * float(tm * tn * out_bytes)
    return {
        "full": full[j].astype(float),
        "tail": tail[j].astype(float),
        "rows": rows[j].astype(float),
        "reads": reads,
        "writes": writes,
    }


def _copied_a_run_ahead(block_bytes, rows):
    """Per step, the weight bytes copied under the step before it when each run's block
    (`block_bytes` != 0 at a run's first step) is copied while the previous run computes: the
    first run's block where it was, every later one spread over the previous run's steps by
    their rows (evenly over a run without rows), each share placed after its step."""
    starts = block_bytes != 0
    run = np.cumsum(starts) - 1
    next_block = np.r_[block_bytes[starts][1:], 0.0]
    run_rows = np.bincount(run, weights=rows)
    run_steps = np.bincount(run)
    share = np.where(run_rows[run] > 0, rows / np.maximum(run_rows[run], 1.0), 1.0 / run_steps[run])
    out = np.zeros_like(block_bytes)
    out[0] = block_bytes[0]
    out[1:] += (share * next_block[run])[:-1]
    return out


@functools.lru_cache(maxsize=256)
def gmm_step_profile(
    m, k, n, num_groups, tm, tk, tn, unit, lhs_bytes, rhs_bytes, out_bytes, gate_layout=None,
    prefetch_runs=False,
) -> tuple:  # fmt: skip
    """KernelCost.step_profile of a gmm call on `representative_group_sizes`: per grid step
    its MXU rows, the bytes it copies in and the bytes it writes back (`gmm_step_work`). What
    it adds to the ranking: a group's first step copies a whole weight block (and a new row
    tile's lhs, and writes the previous tile's output) while the step before it may be a few
    rows of the last group's tail: with large blocks those copies outlast the compute that
    should hide them (Qwen3-30B-A3B down at 16384 tokens on a TPU v5e chip: 3276 us at
    512-row tiles, 3441 at 1024; the compiled schedule's per-step overlap orders them the
    same, 2910 and 3088 us; benchmarks/results/device/v5e_gmm_tile_sweep*.json)."""
    wl = _fields(
        work_list(
            representative_group_sizes(m, num_groups),
            m=m, tm=tm, buckets=bucket_sizes(tm, unit), unit=unit, kind="gmm",
        )
    )  # fmt: skip
    w = gmm_step_work(
        wl, k, n, tm, tk, tn, unit, lhs_bytes, rhs_bytes, out_bytes, gate_layout,
        prefetch_runs=prefetch_runs,
    )  # fmt: skip
    return w["rows"], w["reads"], w["writes"]


# gmm candidates whose ranked time is within this factor of the fastest are ties, ordered by
# `_tie_break` (fewest HBM bytes, which the closed form counts exactly): the model's error on
# whole gmm calls. At the benchmark rows' tiles it agrees with benchmarks' scheduled time within
# 3.5% on average (single windows: within tile_model_calibration.json "gmm_tolerance", 16%,
# errors that partly cancel over a call's windows).
RANKING_TOLERANCE = 0.08


def gmm_candidate_cost(
    gen: TpuGeneration,
    m: int,
    k: int,
    n: int,
    num_groups: int,
    lhs_dtype,
    rhs_dtype,
    out_dtype,
    tm: int,
    tk: int,
    tn: int,
    *,
    quantised: bool = False,
    gate_layout: Optional[str] = None,
) -> KernelCost:
    """The KernelCost the tile search ranks a gmm candidate by: `estimate_cost`'s closed form
    for routed groups it cannot see (group sizes are traced): HBM bytes and grid steps of
    `_gmm_traffic`, MXU FLOPs with the expected row padding, and the unit counts of the
    expected row windows (`_expected_windows`) and of the grid steps' own accumulator code."""
    lb, wb, ob = _itemsize(lhs_dtype), _itemsize(rhs_dtype), _itemsize(out_dtype)
    unit = row_unit(lhs_dtype)
    items, windows = _expected_windows(m, num_groups, tm, unit)
    nbytes, steps = _gmm_traffic(m, k, n, num_groups, lb, wb, ob, tm, tk, tn, items, gate_layout)
    flops = 2 * (m + items * _row_padding(m / items, tm, unit)) * k * n
    gated = gate_layout is not None
    if gated:
        flops = 2 * flops + _epilogue_flops(m, n, tn, gate_layout)
    kt, nt = -(-k // tk), -(-n // tn)
    n_rhs, cols = _weight_blocks(tn, gate_layout)
    cn = window_cols(tk, cols, gen, tm, unit, n_rhs)
    reps = nt * kt * (cols // cn)
    units = _window_totals(
        gen, [r for r, _ in windows], [reps * c for _, c in windows], tk, cn, n_rhs, lhs_dtype
    )
    if gate_layout == "interleaved":  # the epilogue's lane-selection matmul, once per out tile
        units["mxu_pushes"] += nt * -(-m // tm) * mxu_pushes(gen, tm, 2 * tn, tn)
    wn = 2 * n if gated else n
    return KernelCost(
        useful_flops=2 * m * k * n * (2 if gated else 1),
        mxu_flops=int(flops),
        hbm_bytes=int(nbytes),
        min_hbm_bytes=m * k * lb + min(num_groups, m) * k * wn * wb + m * n * ob,
        grid_steps=int(steps),
        vmem_bytes=int(
            gmm_vmem_bytes(
                tm,
                tk,
                tn,
                lhs_dtype,
                rhs_dtype,
                out_dtype,
                k=k,
                quantised=quantised,
                gate_layout=gate_layout,
            )
        ),
        step_vregs=nt * -(-m // tm) * _step_vregs(tm, tn, gate_layout)
        + round(weight_preparations(nt, kt, items, min(num_groups, m)))
        * _prepared_vregs(k, tk, tn, gate_layout, lhs_dtype, quantised),
        step_profile=gmm_step_profile(
            m,
            k,
            n,
            num_groups,
            tm,
            tk,
            tn,
            unit,
            lb,
            wb,
            ob,
            gate_layout,
            prefetches_runs(k, tk, n, tn, gen),
        ),  # fmt: skip
        **units,
    )


def _ranked_search(gen, m, k, unit, ov, tn_cands, cost_of, within, n_rhs=1, min_tm=0):
    """The (tm, tk, tn) `best_tiles` ranks fastest (tpu_generations.ranked_seconds of
    `cost_of(tm, tk, tn)`, a KernelCost) among the candidates whose VMEM need fits the budget
    and whose program can fit one overlay (`program_fits`, `n_rhs` weight blocks per window;
    unless tm and tk are both given), ties within `within` to the fewest HBM bytes, then the
    faster by the model (`_tie_break`); fields given in `ov` are kept as given. Nothing fits
    (only possible with an override): the smallest need."""
    budget = vmem_budget_bytes(gen)
    tms = _row_candidates(gen, m, unit, ov.get("tm"))
    tks = [ov["tk"]] if ov.get("tk") else _dim_candidates(k)
    tns = [ov["tn"]] if ov.get("tn") else tn_cands
    fitting, smallest = [], None
    for tm in tms:
        for tk in tks:
            if not (ov.get("tm") and ov.get("tk")) and not program_fits(gen, tm, tk, unit, n_rhs):
                continue
            if tm < min_tm <= tms[-1] and program_fits(gen, min_tm, tk, unit, n_rhs):
                continue  # a larger row tile holds this K block (GMM_MIN_ROW_TILE)
            for tn in tns:
                cost = cost_of(tm, tk, tn)
                # The tie-break's keys travel with the tiles (best_tiles hands it the tiles).
                tiles = (tm, tk, tn, cost.hbm_bytes, cost.grid_steps)
                if cost.vmem_bytes <= budget:
                    fitting.append((tiles, cost))
                if smallest is None or cost.vmem_bytes < smallest[0]:
                    smallest = (cost.vmem_bytes, tiles)
    best = best_tiles(fitting, gen, tie_break=_tie_break, within=within)
    return (best[0] if best is not None else smallest[1])[:3]


def _gmm_search(gen, m, k, n, num_groups, unit, ov, dtypes, tn_cands, quantised, gate_layout):
    """gmm's tiles: `_ranked_search` over `gmm_candidate_cost`, ties within RANKING_TOLERANCE."""

    def cost_of(tm, tk, tn):
        return gmm_candidate_cost(
            gen, m, k, n, num_groups, *dtypes, tm, tk, tn, quantised=quantised,
            gate_layout=gate_layout,
        )  # fmt: skip

    n_rhs = _weight_blocks(128, gate_layout)[0]
    return _ranked_search(
        gen, m, k, unit, ov, tn_cands, cost_of, RANKING_TOLERANCE, n_rhs, GMM_MIN_ROW_TILE
    )


def _tie_break(tiles):
    """Among candidates within RANKING_TOLERANCE of the fastest: the fewest HBM bytes (exact,
    where the bundles carry the model's error); among equal bytes `best_tiles` takes the faster
    by the model. (Fewer grid steps came second until the gmm's ranking overlapped DMA per grid
    step, `gmm_step_profile`: the model charges steps itself, and at equal bytes the fewest
    steps picked 1024-row tiles at Qwen3-30B-A3B's 16384 tokens, 5% slower on a TPU v5e chip
    than the 512 the model ranks faster.)"""
    return (tiles[3],)


# -------------------------------------------------------------------------------------------------
# What tgmm's compute tiles push through each unit (the shared ranking model's inputs)
# -------------------------------------------------------------------------------------------------

# The VMEM issue factor of tgmm's window loads / stores, per generation, where the shared model's
# `memory_issue` is gmm's (a gmm window's weight vregs go VMEM -> MXU one dependent push at a
# time). tgmm's window streams its whole f32 (tk, cols) running sum through VMEM (one load and
# one store per vreg) and writes it, cast, into the output block. Fitted (least worst error) on
# the LLO dumps of the current kernel (tile_model_calibration.json "tgmm_points",
# benchmarks/tgmm_calibration.py): v5e's windows stay at their MXU floor (1.0 fits); on v6e /
# TPU7x the tails of 128-256 rows, one MXU pass on a 256-wide MXU, are bound by those stores
# (1.45). `tgmm_window_units` scales its load / store counts by TGMM_MEMORY_ISSUE /
# memory_issue so the shared `tile_bundles` charges them at this factor.
TGMM_MEMORY_ISSUE = {"v5e": 1.0, "v5p": 1.0, "v6e": 1.45, "tpu7x": 1.45}

# An empty group's grid step zero-fills its output block: stores only, where the shared
# `step_vreg_bundles` was fitted on passes that load and store each vreg. Fitted on the step
# points of the same dumps (0.7: -20% .. +15% over 15 points; 1.0 would be +4% .. +55%).
TGMM_ZERO_FILL_SHARE = 0.7


# tgmm candidates whose ranked time is within this factor of the fastest are ties (fewest HBM
# bytes, then grid steps, win). The windows' model error (up to +24% on a short tail,
# tile_model_calibration.json "tgmm_points" "tolerance_note") is mostly an over-count per window
# that every candidate carries, not an error between candidates. It was gmm's 8% until the VMEM
# budget grew (tpu_generations.vmem_budget_bytes): then v6e Mixtral-8x7B gate_up / down at 16384
# tokens, ranked 7.7% behind 1024 / 2048 / 2048 at 256 / 4096 / 2048 and 256 / 2048 / 4096,
# took those on their fewer bytes and the compiled schedule put them 23% / 19% slower
# (benchmarks/tgmm_schedule.py); on v5e the same 256-row tiles rank 0.2-0.3% behind and the
# chip ran them 4.2-4.5% faster (results/device/v5e_tgmm_tile_sweep_budget_t16384.json).
TGMM_RANKING_TOLERANCE = 0.05


def tgmm_window_units(
    gen: TpuGeneration, rows, tk: int, cols: int, lhs_dtype, dout_dtype, out_dtype=None
) -> dict:
    """What one tgmm window (lhs rows (rows, tk) transposed times dout rows (rows, cols), the
    kernel's `window` at one column chunk, added into the f32 (tk, cols) running sum) pushes
    through the MXU and moves through VMEM. The dout rows are the MXU's stationary operand and
    the transposed lhs streams through it 16 of its tk rows per push, so a window pushes
    ceil(tk / 16) x ceil(rows / mxu_size) x ceil(cols / mxu_size) times: a 16-row tail costs a
    full window's pushes on a 256-wide MXU (the dumps' vmatmul counts: 768 for every bucket of
    16 to 256 rows at tk 2048, cols 1536 on v6e). The running sum is loaded and stored whole per
    window (tk x cols / 1024 vregs) and, unless the output (`out_dtype`, default lhs dtype) is
    f32 and is the sum itself, also written cast into the output block; the operands are loaded
    once. The load / store counts are scaled to tgmm's own issue factor (TGMM_MEMORY_ISSUE).
    `rows` may be an array."""
    rows = np.asarray(rows, dtype=np.int64)
    side = gen.mxu_size
    pushes = -(-tk // 16) * (-(-rows // side)) * -(-cols // side)
    acc = -(-tk // 8) * -(-cols // 128)
    out_dtype = out_dtype or lhs_dtype
    out = 0 if tgmm_sums_in_output(out_dtype) else -(-tk * cols * _itemsize(out_dtype) // 4096)
    operands = -(-rows * tk * _itemsize(lhs_dtype) // 4096) + (
        -(-rows * cols * _itemsize(dout_dtype) // 4096)
    )
    scale = TGMM_MEMORY_ISSUE[gen.name] / _generations.tile_bundle_model(gen).memory_issue
    return {
        "mxu_pushes": pushes,
        "vmem_loads": np.round((acc + operands) * scale).astype(np.int64),
        "vmem_stores": np.full(rows.shape, round((acc + out) * scale), dtype=np.int64),
    }


def _work_list_windows(wl, compute, tm: int, buckets) -> tuple[list[int], list[int]]:
    """The row windows a work list runs, as (rows of each window kind, how many of each): every
    computing item runs NFULL full windows of row_chunk(tm) rows and at most one tail window of
    its bucket's rows (gmm and tgmm alike)."""
    tails = compute & (wl["BUCKET"] >= 0)
    rows = [row_chunk(tm)] + list(buckets)
    counts = [int(wl["NFULL"][compute].sum())] + [
        int((tails & (wl["BUCKET"] == b)).sum()) for b in range(len(buckets))
    ]
    return rows, counts


def _tgmm_window_totals(gen, window_rows, window_counts, tk, cols, *dtypes) -> dict:
    """tgmm windows: `window_counts[i]` windows of `window_rows[i]` rows each, summed. `dtypes`:
    lhs, dout and (optional) output dtypes."""
    u = tgmm_window_units(gen, window_rows, tk, cols, *dtypes)
    return _summed_windows(u, window_counts)


def tgmm_step_work(wl, k, n, tm, tk, tn, unit, lhs_bytes, dout_bytes, out_bytes, mxu_side):
    """Per grid step (K tile, N tile, item) of a tgmm call, in grid order, from its work list
    `wl` (`_fields` of `work_list(kind="tgmm")`): "full", its full row windows; "tail", 1 where
    it runs a tail window; "bucket", that tail's bucket (-1: none); "rows", the MXU rows its
    windows issue (a window's rows rounded up to the MXU side `mxu_side`: the dout rows are the
    stationary operand, so a 16-row tail passes as many times as a full 128 / 256); "reads",
    the bytes copied in for it (lhs (TILE, kb), dout (TILE, nb): kernel.tgmm's index maps), placed
    where `tpu_generations.overlapped_step_seconds` hides them (reads[i] under step i - 1);
    "writes", the (tk, tn) output block written back after it when the next step moves to
    another group's block (OUT, kb, nb). The tile ranking's `tgmm_step_profile` and the
    benchmarks' per-step schedule (benchmarks/ours.py) both read it."""
    buckets = np.asarray(bucket_sizes(tm, unit))
    L = wl["FLAGS"].shape[0]
    kt, nt = -(-k // tk), -(-n // tn)
    compute = (wl["FLAGS"] & F_COMPUTE) != 0
    tail = compute & (wl["BUCKET"] >= 0)
    full = np.where(compute, wl["NFULL"], 0)
    bucket = np.where(tail, wl["BUCKET"], -1)
    tail_rows = np.where(tail, buckets[np.maximum(bucket, 0)], 0)
    passes = lambda r: -(-r // mxu_side) * mxu_side  # noqa: E731
    rows = full * passes(row_chunk(tm)) + np.where(tail, passes(tail_rows), 0)
    kb = np.repeat(np.arange(kt), nt * L)
    nb = np.tile(np.repeat(np.arange(nt), L), kt)
    j = np.tile(np.arange(L), kt * nt)

    tile = wl["TILE"][j]
    lhs = _block_changed(tile, kb) * float(tm * tk * lhs_bytes)
    reads = lhs + _block_changed(tile, nb) * float(tm * tn * dout_bytes)
    writes = np.r_[_block_changed(wl["OUT"][j], kb, nb)[1:], True] * float(tk * tn * out_bytes)
    return {
        "full": full[j].astype(float),
        "tail": tail[j].astype(float),
        "bucket": bucket[j],
        "rows": rows[j].astype(float),
        "reads": reads,
        "writes": writes,
    }


@functools.lru_cache(maxsize=256)
def tgmm_step_profile(
    gen_name, m, k, n, num_groups, tm, tk, tn, unit, lhs_dtype, dout_dtype, out_dtype
) -> tuple:
    """KernelCost.step_profile of a tgmm call on `representative_group_sizes`: per grid step
    the bundles of its windows (`tgmm_window_units` under the shared `tile_bundles`, per window
    kind), the bytes it copies in and the bytes it writes back (`tgmm_step_work`). What it adds
    to the ranking: a group's (tk, tn) output block is written back once per group, under the
    next group's steps; with few rows per group (DeepSeek-V3-like: 256 experts, ~128 rows each
    at 4096 tokens) a large block's write-back outlasts the windows that should hide it."""
    gen = get_generation(gen_name)
    dtypes = (lhs_dtype, dout_dtype, out_dtype)
    wl = _fields(
        work_list(
            representative_group_sizes(m, num_groups),
            m=m, tm=tm, buckets=bucket_sizes(tm, unit), unit=unit, kind="tgmm",
        )
    )  # fmt: skip
    w = tgmm_step_work(wl, k, n, tm, tk, tn, unit, *(_itemsize(d) for d in dtypes), gen.mxu_size)
    cn = window_cols(tk, tn, gen, tm, unit)
    kinds = [row_chunk(tm)] + list(bucket_sizes(tm, unit))
    u = tgmm_window_units(gen, kinds, tk, cn, *dtypes)
    per_window = np.array(
        [
            _generations.tile_bundles(
                gen,
                mxu_pushes=u["mxu_pushes"][i],
                vmem_loads=u["vmem_loads"][i],
                vmem_stores=u["vmem_stores"][i],
            )
            for i in range(len(kinds))
        ]
    )
    bundles = w["full"] * per_window[0] + np.where(w["bucket"] >= 0, per_window[1:][w["bucket"]], 0)
    return bundles * (tn // cn), w["reads"], w["writes"]


def _tgmm_step_vregs(tk: int, tn: int, out_dtype) -> int:
    """Vregs of the one thing a tgmm grid step writes outside its windows: an empty group's
    (tk, tn) output block, zero (what the dumps' grid-step bundles outside the windows scale
    with; a group with rows is written by its windows, `kernel._tgmm_kernel`)."""
    return round(TGMM_ZERO_FILL_SHARE * -(-tk * tn * _itemsize(out_dtype) // 4096))


def tgmm_candidate_cost(
    gen: TpuGeneration,
    m: int,
    k: int,
    n: int,
    num_groups: int,
    lhs_dtype,
    dout_dtype,
    out_dtype,
    tm: int,
    tk: int,
    tn: int,
) -> KernelCost:
    """The KernelCost the tile search ranks a tgmm candidate by, for routed groups it cannot see:
    HBM bytes and grid steps of `_tgmm_traffic`, MXU FLOPs with the expected row padding, the
    unit counts of the expected row windows (`_expected_windows`, at every (K tile, N tile,
    column chunk)) and the zero-fill vregs of empty groups' output blocks per (K, N) tile."""
    dtypes = (lhs_dtype, dout_dtype, out_dtype)
    lb, db, ob = (_itemsize(d) for d in dtypes)
    unit = row_unit(lhs_dtype, dout_dtype)
    _, windows = _expected_windows(m, num_groups, tm, unit)
    items = -(-m // tm) + num_groups  # the tgmm work list: one item per group even when empty
    nbytes, steps = _tgmm_traffic(m, k, n, num_groups, lb, db, ob, tm, tk, tn, items)
    flops = 2 * (m + items * _row_padding(m / items, tm, unit)) * k * n
    kt, nt = -(-k // tk), -(-n // tn)
    cn = window_cols(tk, tn, gen, tm, unit)
    reps = kt * nt * (tn // cn)
    units = _tgmm_window_totals(
        gen, [r for r, _ in windows], [reps * c for _, c in windows], tk, cn, *dtypes
    )
    empty = max(num_groups - m, 0)  # the representative routing leaves no group empty if it can
    return KernelCost(
        useful_flops=2 * m * k * n,
        mxu_flops=int(flops),
        hbm_bytes=int(nbytes),
        min_hbm_bytes=m * k * lb + m * n * db + num_groups * k * n * ob,
        grid_steps=int(steps),
        vmem_bytes=int(tgmm_vmem_bytes(tm, tk, tn, lhs_dtype, dout_dtype, out_dtype)),
        step_vregs=kt * nt * empty * _tgmm_step_vregs(tk, tn, out_dtype),
        step_profile=tgmm_step_profile(
            gen.name, m, k, n, num_groups, tm, tk, tn, unit, *(np.dtype(d).name for d in dtypes)
        ),
        **units,
    )


def _tgmm_search(gen, m, k, n, num_groups, unit, ov, dtypes):
    """tgmm's tiles: `_ranked_search` over `tgmm_candidate_cost`, ties within
    TGMM_RANKING_TOLERANCE."""

    def cost_of(tm, tk, tn):
        return tgmm_candidate_cost(gen, m, k, n, num_groups, *dtypes, tm, tk, tn)

    return _ranked_search(gen, m, k, unit, ov, _dim_candidates(n), cost_of, TGMM_RANKING_TOLERANCE)


def _override(override, cls) -> dict:
    ov = dataclasses.asdict(override) if isinstance(override, cls) else dict(override or {})
    unknown = set(ov) - {"tm", "tk", "tn", "vmem_limit_bytes"}
    if unknown:
        raise ValueError(
            f"tiling override: unknown fields {sorted(unknown)}; expected tm, tk, tn, vmem_limit_bytes"
        )
    return {key: v for key, v in ov.items() if v is not None}


def gmm_tiling(
    m: int,
    k: int,
    n: int,
    lhs_dtype,
    rhs_dtype,
    out_dtype=None,
    *,
    num_groups: int = 1,
    generation: Optional[str] = None,
    override: Optional[GmmTiling | dict] = None,
    quantised: Optional[bool] = None,
    gate_layout: Optional[str] = None,
) -> GmmTiling:
    """Tiles for gmm on `generation` (default: the attached TPU's, else $PALLAS_TPU_GENERATION,
    else v6e). `override` (a GmmTiling or a dict with any of tm/tk/tn/vmem_limit_bytes) wins field
    by field; the other fields are searched with the override's fixed. With `gate_layout` the
    gmm is the gated gate_up projection: `n` is the intermediate size I (the output width), the
    weights hold 2 * I columns."""
    gen = get_generation(generation)
    out_dtype = out_dtype or lhs_dtype
    if quantised is None:
        quantised = np.dtype(rhs_dtype).itemsize == 1
    ov = _override(override, GmmTiling)
    unit = row_unit(lhs_dtype)
    tn_cands = _dim_candidates(n, halves=True)
    if gate_layout is not None:
        tn_cands = _gated_tn_candidates(n, gate_layout)
    _check_gmm_tiles(ov, m, k, n, unit, gate_layout)  # the fields given, before any search
    tm, tk, tn = _gmm_search(
        gen,
        m,
        k,
        n,
        num_groups,
        unit,
        ov,
        (lhs_dtype, rhs_dtype, out_dtype),
        tn_cands,
        quantised,
        gate_layout,
    )
    _check_gmm_tiles(dict(tm=tm, tk=tk, tn=tn), m, k, n, unit, gate_layout)
    return GmmTiling(tm=tm, tk=tk, tn=tn, vmem_limit_bytes=ov.get("vmem_limit_bytes"))


def _check_gmm_tiles(tiles: dict, m, k, n, unit, gate_layout) -> None:
    """ValueError naming the field for each of tm / tk / tn in `tiles` (a given override's
    fields, or the chosen tiles) the kernel cannot run."""
    if tiles.get("tm") is not None:
        _check_tile("tm", tiles["tm"], m, unit)
    if tiles.get("tk") is not None:
        _check_tile("tk", tiles["tk"], k, 128)
    if tiles.get("tn") is not None:
        if gate_layout is None:
            _check_tile("tn", tiles["tn"], n, 128)
        else:
            check_gated_tn(tiles["tn"], n, gate_layout)


def tgmm_tiling(
    m: int,
    k: int,
    n: int,
    lhs_dtype,
    dout_dtype,
    out_dtype=None,
    *,
    num_groups: int = 1,
    generation: Optional[str] = None,
    override: Optional[TgmmTiling | dict] = None,
) -> TgmmTiling:
    """Tiles for tgmm (lhs [m, k], dout [m, n] -> [num_groups, k, n]); see gmm_tiling."""
    gen = get_generation(generation)
    out_dtype = out_dtype or lhs_dtype
    ov = _override(override, TgmmTiling)
    unit = row_unit(lhs_dtype, dout_dtype)
    tm, tk, tn = _tgmm_search(
        gen, m, k, n, num_groups, unit, ov, (lhs_dtype, dout_dtype, out_dtype)
    )
    _check_tile("tm", tm, m, unit)
    _check_tile("tk", tk, k, 128)
    _check_tile("tn", tn, n, 128)
    return TgmmTiling(tm=tm, tk=tk, tn=tn, vmem_limit_bytes=ov.get("vmem_limit_bytes"))


def choose_tiles(
    *,
    kind: str,
    m: int,
    k: int,
    n: int,
    lhs_dtype,
    rhs_dtype,
    out_dtype=None,
    num_groups: int = 1,
    generation: Optional[str] = None,
    override=None,
    quantised: Optional[bool] = None,
    gate_layout: Optional[str] = None,
) -> GmmTiling | TgmmTiling:
    """The collection's tile contract (tpu_generations.py, "Tile policy"): the tiles of `kind`
    ("gmm": lhs [m, k] x rhs [G, k, n]; "tgmm": lhs [m, k], dout [m, n], `rhs_dtype` dout's dtype)
    on `generation`, `override` winning field by field. gmm_tiling / tgmm_tiling under one name."""
    if kind == "gmm":
        return gmm_tiling(
            m,
            k,
            n,
            lhs_dtype,
            rhs_dtype,
            out_dtype,
            num_groups=num_groups,
            generation=generation,
            override=override,
            quantised=quantised,
            gate_layout=gate_layout,
        )
    if kind == "tgmm":
        if gate_layout is not None or quantised:
            raise ValueError("tgmm: no gate_layout or quantised weights")
        return tgmm_tiling(
            m,
            k,
            n,
            lhs_dtype,
            rhs_dtype,
            out_dtype,
            num_groups=num_groups,
            generation=generation,
            override=override,
        )
    raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")


def _check_tile(name: str, tile: int, full: int, multiple: int) -> None:
    if not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"tiling: {name} must be a positive int, got {tile!r}")
    if tile != full and tile % multiple:
        raise ValueError(
            f"tiling: {name}={tile} must equal the dimension ({full}) or be a multiple of {multiple}"
        )


def vmem_limit(tiling, need: int, generation: Optional[str] = None) -> int:
    from .tpu_generations import vmem_limit_bytes

    if tiling.vmem_limit_bytes:
        return tiling.vmem_limit_bytes
    return vmem_limit_bytes(get_generation(generation), need)


# -------------------------------------------------------------------------------------------------
# Closed-form cost: a replay of the grid, counting a block copy whenever its index changes
# -------------------------------------------------------------------------------------------------


def estimate_cost(
    kind: str,
    lhs_shape,
    rhs_or_dout_shape,
    group_sizes,
    *,
    lhs_dtype="bfloat16",
    rhs_dtype="bfloat16",
    out_dtype=None,
    transpose_rhs: bool = False,
    tiling=None,
    generation: Optional[str] = None,
    count_work_list: bool = False,
    padded_edge_blocks: bool = False,
    gate_layout: Optional[str] = None,
    has_bias: bool = False,
    tiles=None,
) -> KernelCost:
    """What one call of `kind` ("gmm" or "tgmm") does, for concrete `group_sizes`.

    gmm: lhs [M, K], rhs [G, K, N] ([G, N, K] with transpose_rhs); int8/fp8 rhs adds f32 scales
    [G, N]. tgmm: lhs [M, K], dout [M, N] -> [G, K, N] (`rhs_dtype` is then dout's dtype).
    hbm_bytes counts the BlockSpec copies exactly as the Pallas pipeline issues them: an input
    block is copied when its block index differs from the previous grid step's, an output block is
    written back when its index changes and after the last step. Edge blocks (a dimension not a
    multiple of its tile) count only their in-bounds part, or the whole block with
    `padded_edge_blocks` (what Pallas' TPU interpreter copies). `count_work_list` adds the SMEM work
    list (scalar prefetch) to hbm_bytes.
    min_hbm_bytes: the rows inside groups of lhs (and dout) and the weights of non-empty groups read
    once, the output written once. useful_flops = 2 * rows in groups * K * N; mxu_flops counts every
    matmul the kernel issues at its (rows of full chunks and tail window, tk, tn) size.
    gmm with `gate_layout` ("concatenated" / "interleaved"): the gated gate_up gmm, rhs holding
    2I columns, output [M, I]; `has_bias` counts its per-group f32 bias rows [G, 2I].
    `tiles` (the contract's name, tpu_generations.py "Tile policy") or `tiling`: the tiles or an
    override dict; None: choose_tiles'.
    """
    if tiles is not None:
        if tiling is not None:
            raise ValueError("estimate_cost: give tiles or tiling, not both")
        tiling = tiles
    gs = np.asarray(group_sizes, dtype=np.int64)
    lhs_dtype = np.dtype(lhs_dtype)
    rhs_dtype = np.dtype(rhs_dtype)
    out_dtype = np.dtype(out_dtype or lhs_dtype)
    m, k = (int(d) for d in lhs_shape)
    num_groups = gs.shape[0]
    total = int(min(gs.sum(), m))
    lb, wb, ob = lhs_dtype.itemsize, rhs_dtype.itemsize, out_dtype.itemsize
    if kind == "gmm":
        if transpose_rhs:
            _, n, k2 = rhs_or_dout_shape
        else:
            _, k2, n = rhs_or_dout_shape
        wn = n  # weight columns
        if gate_layout is not None:
            n = wn // 2
        quantised = wb == 1
        t = (
            tiling
            if isinstance(tiling, GmmTiling)
            else gmm_tiling(
                m,
                k,
                n,
                lhs_dtype,
                rhs_dtype,
                out_dtype,
                num_groups=num_groups,
                generation=generation,
                override=tiling,
                gate_layout=gate_layout,
            )
        )
        unit = row_unit(lhs_dtype)
    elif kind == "tgmm":
        _, n = rhs_or_dout_shape
        quantised = False
        t = (
            tiling
            if isinstance(tiling, TgmmTiling)
            else tgmm_tiling(
                m,
                k,
                n,
                lhs_dtype,
                rhs_dtype,
                out_dtype,
                num_groups=num_groups,
                generation=generation,
                override=tiling,
            )
        )
        unit = row_unit(lhs_dtype, rhs_dtype)
    else:
        raise ValueError(f"kind must be 'gmm' or 'tgmm', got {kind!r}")
    tm, tk, tn = t.tm, t.tk, t.tn
    buckets = bucket_sizes(tm, unit)
    wl = _fields(work_list(gs.astype(np.int32), m=m, tm=tm, buckets=buckets, unit=unit, kind=kind))
    L = wl["OUT"].shape[0]
    kt, nt = -(-k // tk), -(-n // tn)

    def rows(tile):  # in-bounds rows of a row tile
        return tm if padded_edge_blocks else max(0, min(tm, m - tile * tm))

    def kcols(kb):
        return tk if padded_edge_blocks else min(tk, k - kb * tk)

    def ncols(nb):
        return tn if padded_edge_blocks else min(tn, n - nb * tn)

    nonempty = int((gs > 0).sum())
    steps = nt * L * kt
    mxu = 0
    hbm = 0
    compute = (wl["FLAGS"] & F_COMPUTE) != 0
    tail_rows = np.where(wl["BUCKET"] >= 0, np.asarray(buckets)[np.maximum(wl["BUCKET"], 0)], 0)
    bucket_rows = np.where(compute, wl["NFULL"] * row_chunk(tm) + tail_rows, 0)

    if kind == "gmm":
        # Weight refs per output tile: (block width, column block of output tile nb).
        if gate_layout is None:
            wrefs = [(tn, lambda nb: nb)]
        elif gate_layout == "concatenated":
            wrefs = [(tn, lambda nb: nb), (tn, lambda nb: nb + n // tn)]
        else:
            wrefs = [(2 * tn, lambda nb: nb)]

        def wcols(width, cb):
            return width if padded_edge_blocks else min(width, wn - cb * width)

        prev = {"lhs": None, "rhs": None, "scale": None, "out": None}
        out_bytes = 0
        for nb in range(nt):
            for j in range(L):
                for kb in range(kt):
                    kk = kt - 1 if wl["KFIX"][j] else kb
                    lhs_idx = (int(wl["TILE"][j]), kk)
                    rhs_idx = (int(wl["GROUP"][j]), kk, nb)
                    out_idx = (int(wl["OUT"][j]), nb)
                    if lhs_idx != prev["lhs"]:
                        hbm += rows(lhs_idx[0]) * kcols(kk) * lb
                    if rhs_idx != prev["rhs"]:
                        hbm += sum(kcols(kk) * wcols(w, cb(nb)) * wb for w, cb in wrefs)
                    if (quantised or has_bias) and (rhs_idx[0], nb) != prev["scale"]:
                        per_row = sum(wcols(w, cb(nb)) * 4 for w, cb in wrefs)
                        hbm += per_row * (int(quantised) + int(has_bias))
                    if prev["out"] is not None and out_idx != prev["out"]:
                        out_bytes += rows(prev["out"][0]) * ncols(prev["out"][1]) * ob
                    prev = {
                        "lhs": lhs_idx,
                        "rhs": rhs_idx,
                        "scale": (rhs_idx[0], nb),
                        "out": out_idx,
                    }
                    if compute[j]:
                        mxu += 2 * int(bucket_rows[j]) * tk * sum(w for w, _ in wrefs)
        out_bytes += rows(prev["out"][0]) * ncols(prev["out"][1]) * ob
        hbm += out_bytes
        if gate_layout == "interleaved":  # the epilogue's selection matmul, once per out tile
            mxu += nt * (-(-m // tm)) * 2 * tm * 2 * tn * tn
        min_bytes = (
            total * k * lb
            + nonempty * k * wn * wb
            + m * n * ob
            + (nonempty * wn * 4 * (int(quantised) + int(has_bias)))
        )
        # What the windows push through each unit: every computing item runs NFULL full row
        # windows and at most one tail window (its bucket), at each (N tile, K tile, column
        # chunk), and the grid steps' own code (below).
        gen = get_generation(generation)
        n_rhs, cols = _weight_blocks(tn, gate_layout)
        cn = window_cols(tk, cols, gen, tm, unit, n_rhs)
        reps = nt * kt * (cols // cn)
        window_rows, window_counts = _work_list_windows(wl, compute, tm, buckets)
        units = _window_totals(
            gen, window_rows, [reps * c for c in window_counts], tk, cn, n_rhs, lhs_dtype
        )
        if gate_layout == "interleaved":
            units["mxu_pushes"] += nt * -(-m // tm) * mxu_pushes(gen, tm, 2 * tn, tn)
        # (charged per output tile even where one K block leaves no accumulator to zero or copy:
        # see _step_vregs)
        out_tiles = int(((wl["FLAGS"] & F_FIRST) != 0).sum())
        units["step_vregs"] = nt * out_tiles * _step_vregs(tm, tn, gate_layout)
        units["step_vregs"] += work_list_preparations(wl, nt, kt) * _prepared_vregs(
            k, tk, tn, gate_layout, lhs_dtype, quantised
        )
        vmem = gmm_vmem_bytes(
            tm,
            tk,
            tn,
            lhs_dtype,
            rhs_dtype,
            out_dtype,
            k=k,
            quantised=quantised,
            gate_layout=gate_layout,
        )
    else:
        prev = {"lhs": None, "dout": None, "out": None}
        out_bytes = 0
        for kb in range(kt):
            for nb in range(nt):
                for j in range(L):
                    tile = int(wl["TILE"][j])
                    lhs_idx = (tile, kb)
                    dout_idx = (tile, nb)
                    out_idx = (int(wl["OUT"][j]), kb, nb)
                    if lhs_idx != prev["lhs"]:
                        hbm += rows(tile) * kcols(kb) * lb
                    if dout_idx != prev["dout"]:
                        hbm += rows(tile) * ncols(nb) * wb
                    if prev["out"] is not None and out_idx != prev["out"]:
                        out_bytes += kcols(prev["out"][1]) * ncols(prev["out"][2]) * ob
                    prev = {"lhs": lhs_idx, "dout": dout_idx, "out": out_idx}
                    if compute[j]:
                        mxu += 2 * int(bucket_rows[j]) * tk * tn
        out_bytes += kcols(prev["out"][1]) * ncols(prev["out"][2]) * ob
        hbm += out_bytes
        min_bytes = total * k * lb + total * n * wb + num_groups * k * n * ob
        vmem = tgmm_vmem_bytes(tm, tk, tn, lhs_dtype, rhs_dtype, out_dtype)
        # What the windows push through each unit: every computing item runs NFULL full row
        # windows and at most one tail window (its bucket), at each (K tile, N tile, column
        # chunk); an empty group's item zero-fills its output block (the others' windows write
        # theirs, kernel._tgmm_kernel).
        gen = get_generation(generation)
        cn = window_cols(tk, tn, gen, tm, unit)
        reps = kt * nt * (tn // cn)
        window_rows, window_counts = _work_list_windows(wl, compute, tm, buckets)
        dtypes = (lhs_dtype, rhs_dtype, out_dtype)
        units = _tgmm_window_totals(
            gen, window_rows, [reps * c for c in window_counts], tk, cn, *dtypes
        )
        empty_blocks = int((((wl["FLAGS"] & F_FIRST) != 0) & ~compute).sum())
        units["step_vregs"] = kt * nt * empty_blocks * _tgmm_step_vregs(tk, tn, out_dtype)
    if count_work_list:
        hbm += LAYOUT.nbytes(L)
    return KernelCost(
        useful_flops=2 * total * k * n * (2 if gate_layout is not None else 1),
        mxu_flops=int(mxu),
        hbm_bytes=int(hbm),
        min_hbm_bytes=int(min_bytes),
        grid_steps=int(steps),
        vmem_bytes=int(vmem),
        **units,
    )
