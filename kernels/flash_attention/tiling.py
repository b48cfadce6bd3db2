"""Tile sizes for flash attention per TPU generation, from a VMEM budget model, and the kernel's
closed-form cost (`estimate_cost`).

Tiles: the forward moves block_q query tokens (the G query heads of a KV head are stacked, so a q
block has G*block_q rows) and block_kv key tokens per DMA, and computes in score tiles of
block_q_compute x block_kv_compute inside them, skipping the tiles the mask leaves empty. Large DMA
blocks cut grid steps and K/V re-reads (K/V are read once per q block); small compute tiles keep
the masked work near the band's edge (a sliding window or the causal diagonal) small.
block_q_bwd / block_kv_bwd are the two backward passes' DMA blocks and block_q_compute_bwd /
block_kv_compute_bwd their compute tiles. `choose_tiles` tries the
candidates whose every VMEM buffer fits the generation's budget and keeps the one the shared
ranking (tpu_generations.best_tiles / ranked_seconds) finds fastest on the caller's shape: the
forward's and the backward's score tiles charged by the calibrated per-tile bundle model from
what each pushes through the MXU, EUP and VALU (`fwd_tile_units` per forward path: an interior
item's tiles, taller on v6e, or the edge walk's; `bwd_tile_units` per backward pass: dk/dv, dq
or fused; masked edge tiles pay their compares), overlapped with the DMA, plus the per-step
overhead. Candidates within RANKING_TOLERANCE (forward) / BWD_RANKING_TOLERANCE
(backward) of the fastest count as equal and the larger DMA blocks win among them. The two-pass
backward's cost sums both passes' unit counts, so its bundles are max over the summed units: a
lower bound where one pass is MXU-bound and the other vector-bound (dk/dv and dq on v6e).
Power-of-two blocks run up to the next power of two of the length (never refused for being
longer than the sequence), and the ranking is the kernel's own time, so a longer sequence never
gets faster tiles than a shorter one could (tests/test_shared_contract.py). A length that no
large power-of-two block divides (Flux-dev's 4608 tokens) also gets blocks of whole compute
tiles fitted to it (`fitted_blocks`: 3 x 1536, 1 x 4608): the kernel pads its inputs to a
multiple of every pass's blocks by an XLA copy around the kernel, which the ranking leaves out,
so among candidates it cannot tell apart the fewest padded rows win. `Tiles(...)` overrides the
choice (the VMEM limits it leaves None are set from the budget model: `with_vmem_limits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple, Optional

import numpy as np

from . import tpu_generations as _generations
from .schedule import (  # noqa: F401  (re-exported)
    MAX_PER_BATCH_LIST_BYTES,
    UNBOUNDED,
    Band,
    build_work_list,
    count_live_tiles,
    count_tiles,
    max_work_items,
    per_batch_lists_fit,
)
from .tpu_generations import (
    GENERATIONS,  # noqa: F401  (re-exported: tiling.GENERATIONS)
    KernelCost,
    TpuGeneration,
    best_tiles,
    get_generation,
    mxu_pushes,
    vmem_limit_bytes,
)

NUM_LANES = 128
NUM_SUBLANES = 8
_UNBOUNDED = UNBOUNDED
# At most this many stacked query rows (G heads x block_q_compute) per compute tile: beyond it the
# score tile ([rows, block_kv_compute] f32) grows past 4 MiB with no modelled gain.
MAX_ROWS = 2048


# With segment ids the forward also skips score tiles whose documents do not meet, from each
# compute tile's (min, max) id held in SMEM; past this size it computes them (masked) instead.
MAX_TILE_RANGE_BYTES = 128 * 1024


def tile_ranges_fit(batch: int, n_q_tiles: int, n_kv_slices: int) -> bool:
    return batch * (n_q_tiles + n_kv_slices) * 2 * 4 <= MAX_TILE_RANGE_BYTES


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_q: int = 256
    block_kv: int = 512
    block_kv_compute: int = 256
    block_q_bwd: int = 256
    block_kv_bwd: int = 256
    vmem_limit_bytes: Optional[int] = None
    vmem_limit_bytes_bwd: Optional[int] = None
    block_q_compute: Optional[int] = None  # None: block_q (one score tile per q block)
    block_q_compute_bwd: Optional[int] = None  # None: block_q_bwd
    block_kv_compute_bwd: Optional[int] = None  # None: block_kv_bwd
    # One backward kernel with dq of the whole sequence resident in VMEM (5 matmuls per score
    # tile instead of 7), for sequences whose dq fits; else dk/dv and dq passes.
    fused_bwd: bool = False

    def __post_init__(self):
        # Compute tiles are powers of two (the kernels find a tile from a position by a shift and
        # a row's place in its tile by a mask); a DMA block is any multiple of its compute tile,
        # so a length like 4608 = 3 x 1536 needs no padding copy (`fitted_blocks`).
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            v = getattr(self, name)
            if v < 8 or v % 8:
                raise ValueError(f"Tiles.{name} must be a positive multiple of 8, got {v}")
        for name in (
            "block_kv_compute",
            "block_q_compute",
            "block_q_compute_bwd",
            "block_kv_compute_bwd",
        ):
            v = getattr(self, name)
            if v is None:
                continue
            if v < 8 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 8, got {v}")
        for name, v in (
            ("block_q", self.q_compute),
            ("block_q_bwd", self.q_compute_bwd),
            ("block_kv_bwd", self.kv_compute_bwd),
        ):
            if v & (v - 1):
                raise ValueError(
                    f"Tiles.{name} of {v} is its own compute tile and must then be a power of two; "
                    "give its compute tile explicitly"
                )
        if self.block_kv % self.block_kv_compute:
            raise ValueError("Tiles.block_kv must be a multiple of block_kv_compute")
        if self.block_q % self.q_compute:
            raise ValueError("Tiles.block_q must be a multiple of block_q_compute")
        if self.block_q_bwd % self.q_compute_bwd or self.block_kv_bwd % self.kv_compute_bwd:
            raise ValueError(
                "Tiles.block_q_bwd / block_kv_bwd must be multiples of their compute tiles"
            )

    @property
    def q_compute(self) -> int:
        return self.block_q_compute or self.block_q

    @property
    def q_compute_bwd(self) -> int:
        return self.block_q_compute_bwd or self.block_q_bwd

    @property
    def kv_compute_bwd(self) -> int:
        return self.block_kv_compute_bwd or self.block_kv_bwd

    @property
    def q_multiple(self) -> int:
        """The query length is padded to a multiple of this: every pass's q block divides it."""
        return math.lcm(self.block_q, self.block_q_bwd)

    @property
    def kv_multiple(self) -> int:
        """The key length is padded to a multiple of this: every pass's kv block divides it."""
        return math.lcm(self.block_kv, self.block_kv_bwd)


def _itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def _r(x, m):
    return -(-x // m) * m


def vmem_need_fwd(
    groups,
    head_dim,
    itemsize,
    block_q,
    block_kv,
    block_kv_compute,
    segments=False,
    block_q_compute=None,
) -> int:
    dp = _r(head_dim, NUM_LANES)
    rows = groups * block_q
    need = 2 * rows * dp * itemsize  # q, double-buffered
    need += 2 * 2 * block_kv * dp * itemsize  # k, v
    need += 2 * rows * dp * itemsize  # o
    need += 2 * _r(groups, NUM_SUBLANES) * _r(block_q, NUM_LANES) * 4  # lse
    need += 2 * rows * NUM_LANES * 4 + rows * dp * 4  # m, l, acc scratch
    rows_c = groups * (block_q_compute or block_q)
    # One score tile's temporaries live at a time, or two past 2048 keys: Mosaic kept a second
    # tile's live in a longer straight-line group (v5e, d=256, 2 x 1024 stacked rows x 3072 keys
    # took 24.1 MB where one tile's count gave 17.3 MB and the limit 23.6).
    live_tiles = 2 if block_kv > POW2_BLOCKS[0] else 1
    need += live_tiles * rows_c * block_kv_compute * (3 * 4 + itemsize)  # s, exp, mask, p cast
    need += live_tiles * 3 * rows_c * dp * 4  # the compute tile's q, acc and p @ v values
    if segments:
        need += 2 * block_q * NUM_LANES * 4 + 2 * NUM_SUBLANES * block_kv * 4
    return need


def vmem_need_bwd(
    groups,
    head_dim,
    itemsize,
    block_q,
    block_kv,
    segments=False,
    block_q_compute=None,
    block_kv_compute=None,
    fused_q_len=None,
) -> int:
    """The larger of the dk/dv and dq kernels' needs; with `fused_q_len` (the padded query
    length) the fused kernel's: dk/dv plus the sequence's dq (f32 scratch, double-buffered out)."""
    dp = _r(head_dim, NUM_LANES)
    rows = groups * block_q
    rows_c = groups * (block_q_compute or block_q)
    cols_c = block_kv_compute or block_kv
    ins = 2 * 2 * rows * dp * itemsize + 2 * 2 * block_kv * dp * itemsize  # q, do, k, v
    ins += 2 * 2 * _r(groups, NUM_SUBLANES) * _r(block_q, NUM_LANES) * 4  # lse, di
    if segments:
        ins += 2 * block_q * NUM_LANES * 4 + 2 * NUM_SUBLANES * block_kv * 4
        ins += 2 * block_kv * NUM_LANES * 4 + 2 * NUM_SUBLANES * block_q * 4
    temps = rows_c * cols_c * (5 * 4 + itemsize)  # s/p, dp, ds, mask, tanh, cast
    temps += 4 * rows_c * dp * 4  # the compute tile's q, do, and matmul outputs
    dkdv = ins + 2 * 2 * block_kv * dp * itemsize + 2 * block_kv * dp * 4 + temps
    if fused_q_len is not None:
        return dkdv + groups * fused_q_len * dp * (4 + 2 * itemsize) + rows_c * dp * 4
    dq = ins + 2 * rows * dp * itemsize + rows * dp * 4 + 2 * rows * NUM_LANES * 4 + temps
    return max(dkdv, dq)


def with_vmem_limits(tiles: Tiles, groups, head_dim, dtype, generation, segments, padded_q_len):
    """`tiles` with the VMEM limits it lacks set from the budget model's need, as choose_tiles
    sets them: an explicit Tiles(...) leaves them None, and Mosaic's default scoped limit
    (16 MiB on v5e) does not hold large blocks (1536 x 4608 at Flux-dev did not compile there
    without it). `padded_q_len`: the fused backward's resident dq rows."""
    if tiles.vmem_limit_bytes is not None and tiles.vmem_limit_bytes_bwd is not None:
        return tiles
    gen = get_generation(generation)
    isz = _itemsize(dtype)
    fields = {}
    if tiles.vmem_limit_bytes is None:
        need = vmem_need_fwd(
            groups,
            head_dim,
            isz,
            tiles.block_q,
            tiles.block_kv,
            tiles.block_kv_compute,
            segments,
            tiles.q_compute,
        )
        fields["vmem_limit_bytes"] = vmem_limit_bytes(gen, need)
    if tiles.vmem_limit_bytes_bwd is None:
        need = vmem_need_bwd(
            groups,
            head_dim,
            isz,
            tiles.block_q_bwd,
            tiles.block_kv_bwd,
            segments,
            tiles.q_compute_bwd,
            tiles.kv_compute_bwd,
            padded_q_len if tiles.fused_bwd else None,
        )
        fields["vmem_limit_bytes_bwd"] = vmem_limit_bytes(gen, need)
    return dataclasses.replace(tiles, **fields)


def vmem_budget_bytes(gen: TpuGeneration) -> int:
    """VMEM a tile candidate may need: this family's share in tpu_generations.vmem_budget_bytes,
    what vmem_limit_bytes may grant less the 1.25x + 2 MiB headroom it adds for Mosaic."""
    return _generations.vmem_budget_bytes(gen, "flash_attention")


# Generations whose VPU and EUP work on packed bf16 vregs: the forward takes exp2 (and the row
# sum's vreg adds) of bf16 scores there when the inputs are bf16 (f32 inputs keep f32 softmax).
BF16_EXP_GENERATIONS = ("v6e", "tpu7x")


def exp_in_bf16(generation, dtype) -> bool:
    """Whether the forward built for `generation` (a name, a TpuGeneration or None: as
    choose_tiles resolves it) with inputs of `dtype` takes its exp in bf16."""
    if np.dtype(dtype).name != "bfloat16":
        return False
    gen = get_generation(generation)
    return gen.name in BF16_EXP_GENERATIONS


# A soft cap bounds every base-2 score: |s| <= c = softcap * log2(e). The forward then takes its
# exps against one static max M for every row instead of each row's running max: no row max and
# its cross-lane reduction, no rescale exp, no rescale multiply of the accumulator, and no chain
# from one score tile to the next but the sums. exp2(s - M) spans 2^(-c - M) ... 2^(c - M);
# M = min(c, -FIXED_MAX_LOWEST_EXP - c) keeps the smallest at or above 2^FIXED_MAX_LOWEST_EXP (a
# normal f32 with all 24 bits: the TPU flushes denormals) and the largest at 1 where c <= 50,
# at 2^(2c - 100) above (FIXED_MAX_HIGHEST_EXP bounds it: at 2^64 a row sum over 2^40 keys is
# 2^104, an accumulator of values up to 2^20 over them 2^124, inside f32's 2^128). Gemma-2's cap
# of 50: c = 72.1, M = 27.9, p <= 2^44.3. The exp takes f32 arguments on every generation:
# rounding an argument as large as c to bf16 (8 bits) would move p by up to 2^(c / 512), 10% at
# c = 72 (the running max keeps a bf16 argument small where it matters). Sinks take the running
# max (a sink's logit is not bounded by the cap). libtpu 0.0.42 deviceless dumps, Gemma-like
# d=256 window 4096 soft cap 50 (`llo_schedule.py ours gemma_d256_window4096_softcap50_8192`),
# interior / walk loop / whole program bundles, running max -> fixed max: TPU7x 6,656 / 13,937 /
# 35,260 -> 4,793 / 10,114 / 26,110 (EUP-bound: a tanh and an f32 exp per score); v6e 6,245 /
# 13,444 / 33,600 -> 6,310 / 13,041 / 32,687; v5e (MXU-bound) 16,703 / 8,467 / 40,497 ->
# 16,754 / 8,256 / 40,160.
FIXED_MAX_LOWEST_EXP = -100.0
FIXED_MAX_HIGHEST_EXP = 64.0
LOG2E = math.log2(math.e)


def softcap_fixed_max(softcap, has_sinks: bool) -> float | None:
    """The static base-2 max M the forward's exps take with soft cap `softcap` (see above), or
    None where it keeps each row's running max (no cap, sinks, or a cap too wide for f32)."""
    if not softcap or has_sinks:
        return None
    c = float(softcap) * LOG2E
    m = min(c, -FIXED_MAX_LOWEST_EXP - c)
    return m if c - m <= FIXED_MAX_HIGHEST_EXP else None


# v6e's forward against the fixed max runs its kv compute slices 256 keys wide: its tiles have
# no chain between them, and at 256 keys the interior path's region holds two q tiles
# (kernel._interior_unroll) whose EUP and MXU work the scheduler interleaves, where a 512-key
# tile's exps and matmuls take turns. Deviceless dumps, Gemma-like d=256 window 4096 cap 50,
# 2048 / 512 / 2048 blocks (`llo_schedule.py schedule_targets:compile_flash_tiles`), bundles
# per 1,024 MXU pushes, kv slices of 512 -> 256: v6e interior 6,310 -> 4,925, masked walk
# 6,513 -> 6,194, program 32,714 -> 28,163; TPU7x interior 5,043 -> 5,100 and walk 5,142 ->
# 6,714 (worse: it keeps the ranked tile). The tile ranking does not see the soft cap, so this
# narrows its pick afterwards.
FIXED_MAX_KV_COMPUTE = {"v6e": 256}


def with_fixed_max_kv_compute(generation, tiles, softcap, has_sinks: bool):
    """`tiles` with the forward's kv compute slice narrowed to FIXED_MAX_KV_COMPUTE where the
    forward runs against a fixed max (`softcap_fixed_max`) on that generation."""
    width = FIXED_MAX_KV_COMPUTE.get(get_generation(generation).name)
    if width is None or softcap_fixed_max(softcap, has_sinks) is None:
        return tiles
    if tiles.block_kv_compute <= width or tiles.block_kv % width:
        return tiles
    return dataclasses.replace(tiles, block_kv_compute=width)


# Masked score tiles build one head's mask and apply it to the G heads a tile stacks (the
# compares on 1/G-th of the tile; kernel._masked_scores adds it as a bias in the forward,
# kernel._masked_probabilities selects in the backward) except on v5e at head_dim > 128,
# where the tile is MXU-bound (128-wide MXUs push a d=256 tile's matmuls twice) and the
# per-head selects only reorder its chain. libtpu 0.0.42 deviceless dumps, the forward's masked
# tail groups / full-group loop, whole-tile mask -> one head's: Llama-3-8B window 1024 (G=4)
# v5e 14,719 / 9,756 -> 14,042 / 9,540, v6e 22,151 / 24,565 -> 19,980 / 23,381, TPU7x
# 10,969 / 12,224 -> 9,374 / 11,271; Gemma-like d=256 window 4096 (G=2) v6e 13,805 / 14,893 ->
# 12,975 / 14,369, TPU7x 14,383 / 15,276 -> 13,529 / 14,765, but v5e 12,459 / 8,576 -> 12,773 /
# 8,852 (and 1.0% slower on the v5e chip), measured with the per-head select before the bias.
# The backward's masked tiles take the same rule.
def mask_per_head(generation, head_dim) -> bool:
    """Whether masked tiles build one head's mask for the G heads they stack."""
    return not (get_generation(generation).name == "v5e" and head_dim > 128)


# The backward's whole-tile masks (one q head per KV head, or v5e at d > 128) mask the scores
# before the exp (kernel._masked_probabilities) except on v5e. libtpu 0.0.42 deviceless dumps of
# d=256 b2 8192 causal's masked tiles (benchmarks/flash_dump_points.py), probabilities selected ->
# scores masked: TPU7x dq 256 x 512 747 -> 694 bundles, fused 512 x 512 1,683 -> 1,541; v6e dk/dv
# 512 x 512 1,579 -> 1,459, fused 1,855 -> 1,754; v5e fused 256 x 256 1,255 -> 1,295 and dk/dv
# 1,056 -> 1,062 (worse), dq 766.5 -> 765.
def mask_scores_before_exp(generation) -> bool:
    """Whether the backward masks a whole tile's scores (else its probabilities)."""
    return get_generation(generation).name != "v5e"


# The forward's interior items (every score tile mask-free: the bulk of a long causal or windowed
# sequence) run the q block as taller compute tiles than the edge walk's, up to this many stacked
# rows, on these generations: one row-max / exp / p @ v dependency chain per q tile leaves the
# MXU idle between tiles, and a taller tile pays that gap over more rows. libtpu 0.0.42, v6e,
# d=256 b2 8192 causal, bf16 exp, 512 x 512 tiles: 733 bundles per tile at 512 rows (two
# chains), 652 at 1024, 644 at 2048. TPU7x, same shape: 725 at 512 rows, 762 at 1024 (worse:
# left at the edge walk's tile). v5e (4 smaller MXUs) is MXU-bound already: unchanged.
INTERIOR_MAX_ROWS = 2048
TALL_INTERIOR_GENERATIONS = ("v6e",)
# The tile ranking charges an interior tile taller than this many stacked rows as several of this
# height: the fixed bundles a tile pays stop shrinking there (the dumps above: 652 -> 644 from
# 1024 to 2048 rows; Flux-dev joint 4608 at 2048 x 1536 blocks, d = 128: 642 bundles per 512
# rows at 2048, where one tile's fixed bundles spread over 2048 rows would give 594).
INTERIOR_CHARGED_ROWS = 1024


# Program size. A Mosaic kernel larger than one instruction-memory overlay is cut into several,
# which the grid loop reloads from HBM at every step (our gmm's 140k-bundle program in 8 overlays
# ran at 3-7x its schedule on a v5e chip). The flash forward's program is mostly straight-line
# copies of its score tile: the interior path's q tiles and the edge walk's groups
# (kernel._forward_score_vregs counts the f32 [8, 128] score vregs over all copies). Bundles ~
# FORWARD_FIXED_BUNDLES + score vregs x (per_vreg + per_vreg_d * (D / 128 - 1)) x (softcap with a
# soft cap), fitted per generation on libtpu 0.0.42 deviceless dumps of Llama-3-8B heads (d=128)
# at window 1024 with and without a soft cap of 30, and Gemma-like d=256 heads at window 4096
# with a soft cap of 50 (`llo_schedule.py`; v5e: per_vreg also on the MQA point, the two within
# 3.6% either way; refitted when masked tiles began to build one head's mask, `mask_per_head`,
# which made the Llama programs 2-8% smaller; per_vreg_d: v5e's 128-wide MXUs push a d=256
# tile's two matmuls twice as often, v6e's and TPU7x's 256-wide ones about as often). A forward must
# stay within `overlay`, the largest overlay seen holding one (`program_overlays`):
# - v5e: Llama window 1024, 35 copies of 1024 x 256 tiles, 45,867 bundles, 46,944 with the soft
#   cap; Gemma-like 41,087; 32 MQA heads on one KV head at 4096 tokens, one walk tile a group,
#   55,688 (55,899 in a 56,176-bundle overlay before the per-head masks; at groups of four
#   131,353 bundles in 11 overlays, 2.16x slower on the chip: benchmarks/program_size_probe.py);
# - v6e: Llama window 1024, 18 copies of 2048 x 512, 57,421 bundles (60,776 in a 61,120-bundle
#   overlay before the per-head masks; 64,520 the largest overlay seen since, below); with the
#   soft cap 66,828, which libtpu cuts into 7 overlays (72,071 before); Gemma-like 36,049;
# - TPU7x: Llama window 1024, 18 copies of 1024 x 512, 29,446 / 34,887 bundles; Gemma-like
#   37,381; 48 / 8 heads with the soft cap at 8192 tokens 50,066 in one 50,976-bundle overlay,
#   estimated 50.3k: groups of four (two before the per-head masks: 51,561 bundles, estimated
#   4% over the 52,472-bundle overlay it fitted).
# Those soft-capped sizes are the running max's (a call with sinks). Against the fixed max
# (`softcap_fixed_max`) the copies shrink; dumped at a walk of four (2026-12-08): v5e Llama
# 43,813, Gemma-like 38,356; v6e Llama 63,467 in one 64,520-bundle overlay (the 2 x 2048 x 512
# walk the running max could not fit), Gemma-like 32,663; TPU7x Llama 26,573, Gemma-like
# 26,377, 48 / 8 heads 37,619 (`softcap_fixed_max` factors, the larger program's side).
class ForwardCode(NamedTuple):
    per_vreg: float  # bundles per score vreg of a copy at D = 128
    per_vreg_d: float  # more per score vreg for each further 128 of D
    softcap: float  # factor on a soft-capped forward's copies (the running max: sinks)
    softcap_fixed_max: float  # ... against the fixed max (no sinks)
    overlay: int  # bundles: the largest overlay seen holding a forward


FORWARD_FIXED_BUNDLES = 4_000  # init, write-out loops, the grid step's own code
FORWARD_CODE = {
    "v5e": ForwardCode(4.855, 3.213, 1.026, 0.95, 56_176),
    "v6e": ForwardCode(2.898, 0.059, 1.176, 1.11, 64_520),
    "tpu7x": ForwardCode(2.761, 0.223, 1.214, 0.85, 52_472),
}


def forward_program_bundles(
    generation, score_vregs: float, head_dim: int, softcap: float, has_sinks: bool = False
):
    """The flash forward's estimated program size in bundles, and the overlay it must fit (a
    generation not listed takes the smallest)."""
    gen = get_generation(generation)
    code = FORWARD_CODE.get(gen.name) or min(FORWARD_CODE.values(), key=lambda c: c.overlay)
    per_vreg = code.per_vreg + code.per_vreg_d * max(head_dim / 128 - 1, 0.0)
    factor = 1.0
    if softcap:
        fixed = softcap_fixed_max(softcap, has_sinks) is not None
        factor = code.softcap_fixed_max if fixed else code.softcap
    est = FORWARD_FIXED_BUNDLES + score_vregs * per_vreg * factor
    return est, code.overlay


def interior_q_compute(generation, tiles: Tiles, groups, head_dim, itemsize, segments) -> int:
    """The interior path's q compute tile: block_q_compute doubled while the stacked rows stay
    within INTERIOR_MAX_ROWS, it divides block_q, and the forward's VMEM need stays within what
    the call's vmem_limit_bytes already grants (so the limit, the tiles and the edge walk do not
    change)."""
    bqc = tiles.q_compute
    gen = get_generation(generation)
    if gen.name not in TALL_INTERIOR_GENERATIONS or segments:
        return bqc
    limit = tiles.vmem_limit_bytes or gen.scoped_vmem_default_bytes
    usable = (limit - _generations.VMEM_LIMIT_EXTRA_BYTES) / _generations.VMEM_LIMIT_MARGIN
    need = functools.partial(
        vmem_need_fwd,
        groups,
        head_dim,
        itemsize,
        tiles.block_q,
        tiles.block_kv,
        tiles.block_kv_compute,
        segments,
    )
    while (
        tiles.block_q % (2 * bqc) == 0
        and groups * 2 * bqc <= INTERIOR_MAX_ROWS
        and need(block_q_compute=2 * bqc) <= usable
    ):
        bqc *= 2
    return bqc


# Forward candidates within this factor of the fastest count as equally fast, and the larger DMA
# blocks win among them: no grid steps or K/V re-reads traded for a gain the model cannot resolve.
# It is the tolerance tests/test_shared_contract.py holds the per-tile bundle model to against the
# dumps (benchmarks/results/tile_model_calibration.json: now within 5.5%).
RANKING_TOLERANCE = 0.08


def _next_pow2(x: int) -> int:
    return 1 << (int(x) - 1).bit_length()


# Blocks that are not powers of two are tried from FITTED_MIN tokens up to the largest
# power-of-two block for queries and up to FITTED_MAX_KV for keys, each a whole number of
# compute tiles (`fitted_blocks`). Keys go further because an item runs all the kv slices of its
# block per q tile with the running statistics held as values, loading and storing them once:
# on a TPU v5e chip Flux-dev's 4608 tokens ran 1605-1634 us at 1536 x 4608 blocks, 1746-1850 at
# 1536 x 1536 and 2171 at the power-of-two 2048 x 2048 that pads them to 6144, while a 4608-query
# block ran 1979 (benchmarks/results/device/v5e_flash_tile_sweep*.json). Only as far as that was
# seen to compile: kv blocks past 2048 keys with at most MAX_ROWS stacked query rows and at most
# 4608 keys. Longer ones overflowed the VMEM limit the budget model set on the chip (Wan-like
# 2048 x 8192, Llama-3-8B's 4 x 2048 stacked rows x 4096, when it counted one score tile's
# temporaries; `vmem_need_fwd` now counts two past 2048 keys), though 2048 x 4096 ran 6% faster
# at Wan-like: full attention's forward takes LONG_KV_BLOCK below.
FITTED_MIN = 512
FITTED_MAX_KV = 4608
# A power-of-two kv block past 2048 keys, a forward candidate where the band covers every key
# (not causal, no window): on a TPU v5e chip Wan-like video attention (12 heads, 32768 tokens)
# ran 36550 us at 2048 x 4096 blocks and 38807 at 2048 x 2048 (-6%), while under a causal band
# 4096 keys gained nothing or lost (Llama-3-8B 8192 causal 3675-3708 against 3643, its batch
# of 32 x 4096 35557 against 33859, d=256 b2 8192 causal a tie, Gemma's 4096 window +0.7%;
# benchmarks/results/device/v5e_flash_tile_sweep*.json). The backward keeps its candidates.
LONG_KV_BLOCK = 4096
POW2_BLOCKS = (2048, 1024, 512, 256, 128)


def fitted_blocks(length: int, tile: int, largest: int = POW2_BLOCKS[0]) -> list[int]:
    """Blocks of whole `tile`s up to `largest`, not powers of two, that cut `length` (rounded
    up to a whole tile) into n equal blocks, n <= 16: 4608 tokens are 3 x 1536 or 1 x 4608,
    where every power-of-two block of 1024 or more pads them to 6144, and the padding is an XLA
    copy of q, k and v (and a slice of the output) around the kernel. A length no such block
    fits gets none (its power-of-two blocks pad no more)."""
    whole = _r(length, tile)
    out = set()
    for n in range(1, 17):
        b = whole // n
        if whole % n == 0 and b % tile == 0 and FITTED_MIN <= b <= largest and b & (b - 1):
            out.add(b)
    return sorted(out, reverse=True)


def kv_compute_tiles(gen, backward: bool) -> tuple[int, ...]:
    """The kv compute tiles (keys per score tile) a pass tries: two MXU widths where the MXU is
    256 wide; 256 keys on a 128-wide MXU (v5e), whose backward also tries 512. A backward score
    tile chains five matmuls through the exp and dS (S -> P -> dS -> dK, dQ), and on v5e one
    head's tile (G = 1) does not hide that chain under its MXU work until it is wide: the fused
    loop at d=128 runs 478 bundles at 128 x 256 against an MXU floor of 342, 926 at 256 x 256
    (669), 1419 at 512 x 256 (1322) and 2355 at 512 x 512 (2627: MXU-bound; `llo_schedule.py
    schedule_targets:compile_flash_bwd_tiles --generation v5e` at Flux-dev, the last two in the
    calibration file's "bwd_points"). On a TPU v5e chip the backward alone ran 16-17%
    faster at 512 keys where one head's 512 query rows make the tile (Flux-dev 4608: 4627 ->
    3872 us, Wan-like 32768: 111572 -> 92730) and 4% at d=256 (d256 causal b2 8192), tied where
    four stacked heads make the tile MXU-bound (Llama-3-8B causal 8192, -0.8%), and lost where a
    window or documents mask more of the wider tiles (window 1024 +13%, packed documents +10%;
    benchmarks/results/device/v5e_flash_bwd_tile_sweep.json). The ranking charges both widths
    their MXU floor (no floor or per-score term fits those dumps: BWD_CHAIN_FLOOR_VALU), and
    takes the widest tile among those it cannot tell apart (WIDEST_BWD_TILE_GENERATIONS). The
    forward keeps 256 keys on v5e: Flux-dev's forward ran 1633 us at 512 against 1605."""
    if gen.mxu_size >= 256:
        return (2 * gen.mxu_size,)
    return (256, 512) if backward else (256,)


# Generations whose backward ranking takes, among the candidates it cannot tell apart, the
# widest compute tile (the most scores a tile) before the model's own order. v5e's fused
# backward packs a wider tile's MXU pushes tighter (its dumps: 4.0-4.4 bundles a push at 256 x
# 256 and 512 x 256, 3.4-3.7 at 512 x 512 and 1024 x 256-512), which the model's MXU floor (4.08
# a push whatever the tile) does not see; on the chip the 512 x 512 tiles (G x 512 stacked
# rows) ran the backward alone 7.1% faster at d=256 b2 8192 causal, 2.6% at Llama-3-8B causal
# 8192, 17% at Flux-dev / Wan-like, a tie at Gemma's window 4096 (-0.5%) and Llama-3-8B 32 x
# 4096 (-0.1%); where a band masks much of the wider tile (window 1024, packed documents: 13% /
# 10% slower at 256 x 512 on the chip) the model puts the window's outside the tolerance
# (+19.5%), and packed documents (segment ids) keep the model's order.
# benchmarks/results/device/v5e_flash_bwd_tile_sweep*.json.
WIDEST_BWD_TILE_GENERATIONS = ("v5e",)


def _candidates(
    q_len, kv_len, groups, gen, total_q=None, total_kv=None, long_kv=False, backward=False
):
    """(block_q, block_q_compute, block_kv, block_kv_compute) for the forward (or, `backward`,
    the backward: its kv compute tiles, `kv_compute_tiles`): power-of-two blocks, then the
    blocks fitted to the padded totals (`total_q` / `total_kv`, the arrays the kernel pads;
    default the lengths), then, with `long_kv` (a band that covers every key), LONG_KV_BLOCK kv
    blocks under at most MAX_ROWS stacked query rows."""
    for compute_kv in kv_compute_tiles(gen, backward):
        yield from _candidates_at(
            q_len, kv_len, groups, gen, compute_kv, total_q, total_kv, long_kv
        )


def _candidates_at(q_len, kv_len, groups, gen, compute_kv, total_q, total_kv, long_kv):
    """`_candidates` at one kv compute tile."""
    # Blocks up to the next power of two of each length: a block larger than the sequence only
    # pads it, and a longer sequence must never see candidates a shorter one was refused (the
    # choice would not be monotone in length).
    cap_q = _next_pow2(max(128, q_len))
    cap_k = _next_pow2(max(128, kv_len))
    q_computes = [c for c in (512, 256, 128) if groups * c <= MAX_ROWS or c == 128]
    for bq in POW2_BLOCKS:
        if bq > cap_q and bq > 128:
            continue
        for bqc in sorted({min(bq, c) for c in q_computes}, reverse=True):
            for bk in POW2_BLOCKS:
                if bk > cap_k and bk > 128:
                    continue
                yield bq, bqc, bk, min(bk, compute_kv)
    pow2_q = [(b, c) for b in POW2_BLOCKS if b <= cap_q for c in q_computes if c <= b]
    pow2_k = [b for b in POW2_BLOCKS if b <= cap_k and b >= compute_kv]
    fit_q = [(b, c) for c in q_computes for b in fitted_blocks(total_q or q_len, c)]
    fit_k = fitted_blocks(total_kv or kv_len, compute_kv, FITTED_MAX_KV)
    for (bq, bqc), bk in [(q, k) for q in fit_q for k in pow2_k + fit_k] + [
        (q, k) for q in pow2_q for k in fit_k
    ]:
        if bk <= POW2_BLOCKS[0] or groups * bq <= MAX_ROWS:
            yield bq, bqc, bk, compute_kv
    if long_kv and LONG_KV_BLOCK <= cap_k:
        for bq, bqc in pow2_q:
            if groups * bq <= MAX_ROWS:
                yield bq, bqc, LONG_KV_BLOCK, compute_kv


def pad_copy_rows(total: int, multiple: int) -> int:
    """Rows an XLA pad of `total` rows to a multiple of `multiple` reads and writes (the whole
    array is copied, however few rows it adds; 0 when nothing is padded)."""
    return 0 if total % multiple == 0 else total + _r(total, multiple)


def backward_tiles(bq: int, bqc: int, bk: int, bkc: int, fused: bool, **fields) -> Tiles:
    """A backward candidate as `choose_tiles` ranks it: DMA blocks (bq, bk) and compute tiles
    (bqc, bkc) for both backward passes (or the fused one), the forward's fields set alike.
    `fields`: further Tiles fields (e.g. vmem_limit_bytes_bwd)."""
    return Tiles(
        bq,
        bk,
        bkc,
        bq,
        bk,
        block_q_compute=bqc,
        block_q_compute_bwd=bqc,
        block_kv_compute_bwd=bkc,
        fused_bwd=fused,
        **fields,
    )


def choose_tiles(
    *,
    q_len,
    kv_len,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype,
    causal=False,
    window_size=(-1, -1),
    generation=None,
    total_q=None,
    total_kv=None,
    segments=False,
    override: Optional[Tiles] = None,
) -> Tiles:
    """The tiles for one sequence of `q_len` x `kv_len` (the longest one for varlen; `total_q` /
    `total_kv` the packed totals: the fused backward keeps dq of `total_q` rows in VMEM). Ranked
    by the kernel's own time: the XLA pad to a block multiple is not charged, so a longer
    sequence never gets faster tiles than a shorter one (an earlier ranking that charged it
    picked small blocks at 1792 tokens, +66% kernel time)."""
    if override is not None:
        return override
    gen = get_generation(generation)
    groups = num_q_heads // num_kv_heads
    isz = _itemsize(dtype)
    budget = vmem_budget_bytes(gen)
    cost_kw = dict(
        batch=1,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        window_size=window_size,
    )

    total_q, total_kv = total_q or q_len, total_kv or kv_len
    candidates = list(_candidates(q_len, kv_len, groups, gen, total_q, total_kv, backward=True))
    full_band = not causal and tuple(window_size) == (-1, -1)
    fwd_candidates = list(_candidates(q_len, kv_len, groups, gen, total_q, total_kv, full_band))

    def forward():
        for bq, bqc, bk, bkc in fwd_candidates:
            # forward: block_q x block_kv DMA blocks, block_q_compute x block_kv_compute tiles
            nf = vmem_need_fwd(groups, head_dim, isz, bq, bk, bkc, segments, bqc)
            if nf > budget:
                continue
            t = backward_tiles(bq, bqc, bk, bkc, False)  # (its backward fields unused)
            c = estimate_cost(tiles=t, pass_="fwd", generation=gen, segments=segments, **cost_kw)
            yield (bq, bqc, bk, bkc, nf), c

    def pads_further(total, block, fwd_block):
        return _r(total, math.lcm(block, fwd_block)) > _r(total, fwd_block)

    def backward(fwd_q, fwd_k):
        # the same candidates as (block_q_bwd, its compute tile, block_kv_bwd, ...), as two
        # passes or fused (dq resident in VMEM: the padded sequence must fit). Not blocks that
        # pad a sequence past the forward's blocks: both passes run the sequence padded to every
        # pass's block (Tiles.q_multiple / kv_multiple), and this ranking charges neither the
        # forward's longer run nor that pad (at 896 tokens a 512-row backward block padded both
        # passes to 3584 rows, the forward's ranked time 82 -> 108 us). So every candidate pads
        # as the forward's blocks do.
        for bq, bqc, bk, bkc in candidates:
            if pads_further(total_q, bq, fwd_q) or pads_further(total_kv, bk, fwd_k):
                continue
            for fused in (False, True):
                seq_q = _r(total_q, fwd_q) if fused else None
                nb = vmem_need_bwd(groups, head_dim, isz, bq, bk, segments, bqc, bkc, seq_q)
                if nb > budget:
                    continue
                t = backward_tiles(bq, bqc, bk, bkc, fused)
                c = estimate_cost(tiles=t, pass_="bwd", generation=gen, **cost_kw)
                yield (bq, bqc, bk, bkc, nb, fused), c

    def padding(q_multiple, kv_multiple):
        """The rows x heads the forward's XLA pad copies move (q and the output's slice of Hq
        heads, k and v of Hkv): the kernel's ranking leaves them out (a longer sequence must not
        get faster tiles than a shorter one), the tie-break below does not."""
        return 2 * (
            pad_copy_rows(total_q, q_multiple) * num_q_heads
            + pad_copy_rows(total_kv, kv_multiple) * num_kv_heads
        )

    # Times the model cannot tell apart (within its stated error on each pass's dumps): the
    # forward's fewest rows copied by XLA pads (it pads q and k/v and slices the output; the
    # backward's blocks pad no further, `backward`), then the larger DMA blocks, then (the
    # backward on WIDEST_BWD_TILE_GENERATIONS) the widest compute tile, then the faster by the
    # model, then the earlier candidate (larger compute tile first; two passes before fused), so
    # the choice is deterministic.
    best_f = best_tiles(
        forward(),
        gen,
        tie_break=lambda k: (padding(k[0], k[2]), -k[0] * k[2]),
        within=RANKING_TOLERANCE,
    )
    best_b = None
    # (not with segment ids: this ranking does not see the documents, which mask more of a
    # wider tile; 8 packed documents ran 10% slower at 256 x 512 on the chip)
    widest_bwd_first = gen.name in WIDEST_BWD_TILE_GENERATIONS and not segments
    if best_f is not None:
        fq, fk = best_f[0][0], best_f[0][2]
        best_b = best_tiles(
            backward(fq, fk),
            gen,
            tie_break=lambda k: (-k[0] * k[2], -k[1] * k[3] if widest_bwd_first else 0),
            within=BWD_RANKING_TOLERANCE,
        )
    if best_b is None:
        raise ValueError(
            f"no flash-attention tiles fit {gen.name} VMEM for {num_q_heads // num_kv_heads} query "
            f"heads per KV head at head_dim {head_dim}; pass Tiles(...) explicitly"
        )
    bq, bqc, bk, bkc, nf = best_f[0]
    bqb, bqcb, bkb, bkcb, nb, fused = best_b[0]
    return Tiles(
        bq,
        bk,
        bkc,
        bqb,
        bkb,
        vmem_limit_bytes=vmem_limit_bytes(gen, nf),
        vmem_limit_bytes_bwd=vmem_limit_bytes(gen, nb),
        block_q_compute=bqc,
        block_q_compute_bwd=bqcb,
        block_kv_compute_bwd=bkcb,
        fused_bwd=fused,
    )


# What one forward score tile pushes through each unit (the ranking model's per-family inputs,
# tpu_generations.tile_bundles). The tile runs on one of two paths (kernel.py): an interior item
# (every tile of the q block mask-free) runs its q tiles as one straight-line region whose chains
# are independent (on v6e taller tiles, interior_q_compute), an edge item walks each q tile's kv
# slices in groups, one chain through (m, l, acc) per q tile, some groups masked. The VALU
# figures are effective ops per f32 score vreg (8 x 128 scores), per generation: the interior
# tile's (running max, exp2 argument, row sum, bf16 cast, the reductions' lane work), what the
# walk's chain adds to a mask-free tile, and what a mask adds (one head's interval compares, the
# bias or select); fitted so that (ops / VALU slots) x vector_issue + the fixed per-tile bundles
# gives the dumped bundles of the tiles the MXU does not bound, so that a chain's latency is
# charged to the unit that carries it (as the backward's, below). Shared by every generation
# (counted from the bodies, not refitted): per f32 vreg of the [rows, head_dim] accumulator 2
# (rescale multiply and add of p @ v), a soft cap's scale / tanh work (+2.4), segment ids' id
# compare (+1.4), a band's second edge (+0.8). The EUP takes one exp2 per score (half the pushes
# where the exp runs in bf16, exp_in_bf16: 16 x 128 scores a vreg), one tanh with a soft cap,
# and one rescale exp2 per row (lane-replicated, rows/8 vregs).
# benchmarks/results/tile_model_calibration.json "points" holds the dumps (each path's loop, masked
# and mask-free, every named shape's tiles on v5e, v6e and TPU7x), and
# benchmarks/flash_dump_points.py --pass fwd re-dumps them.
# Fitted per generation on the calibration points (mask-free ones for the first two, then the
# masked ones for the third; among fits within half a percent of the least largest error, the
# one nearest the ops the bodies issue, ~5 a score vreg unmasked). v5e's walk is chain-bound
# where its tile is not MXU-bound (d = 128: 640 bundles a 512 x 256 walk tile against 550 on the
# interior path); v6e's and TPU7x's mask-free walk tiles are within 3% of their interior ones.
# The mask figure refitted on the masked points re-dumped once a dense call's masks compared
# against the band alone, one compare where a tile meets one edge (kernel._in_bounds): v6e
# 2.0 -> 1.7, TPU7x 1.2 -> 0.8 (v5e's 0.6 holds). The wan-like masked points were dropped: that
# call (bidirectional, unpadded) has nothing to mask, and its tail groups compile mask-free.
FWD_VALU_PER_SCORE_VREG = {  # (interior, walk's chain added, mask added)
    "v5e": (5.0, 7.0, 0.6),
    "v6e": (4.6, 0.0, 1.7),
    "tpu7x": (5.0, 0.2, 0.8),
}
FWD_VALU_PER_SCORE_VREG["v5p"] = FWD_VALU_PER_SCORE_VREG["v5e"]
VALU_PER_ACC_VREG = 2.0
VALU_SECOND_EDGE_PER_SCORE_VREG = 0.8
# A soft-capped forward against a fixed max (`softcap_fixed_max`): the EUP takes a tanh and an
# f32 exp2 per score and no rescale exp; the VALU drops the running max (less these ops a score
# vreg), the accumulator's rescale multiply (one op per accumulator vreg, not two) and the
# walk's chain. Fitted on the Gemma-like calibration points (d=256, window 4096, cap 50)
# re-dumped with the fixed max: v6e 1,578 / 1,579 / 1,675 bundles (interior / walk / masked
# walk, 1024 x 512), TPU7x 1,261 / 1,262 / 1,306; v5e's (MXU-bound, 984 / 989 / 1,002 at
# 512 x 256) carry no signal: the running max's one vmax a score vreg.
FWD_VALU_FIXED_MAX_SAVED_PER_SCORE_VREG = {"v5e": 1.0, "v6e": 1.2, "tpu7x": 2.5}
FWD_VALU_FIXED_MAX_SAVED_PER_SCORE_VREG["v5p"] = FWD_VALU_FIXED_MAX_SAVED_PER_SCORE_VREG["v5e"]


def one_edge_tiles(band: Band, rows: int, cols: int, sequence_ends: bool) -> bool:
    """Whether every masked tile of `rows` query tokens x `cols` keys meets at most one edge of a
    band bounded on both sides, so that it compares each score against that edge alone
    (kernel._in_bounds): no sequence end falls inside a block (`sequence_ends` False: a dense
    call whose lengths need no padding) and the tile's distances y - x + off, rows + cols - 1
    values, cannot reach from below band.lo to above band.hi (a window 1024 against 512 x 512
    tiles). Otherwise a band bounded on both sides costs a masked tile its second compare
    (VALU_SECOND_EDGE_PER_SCORE_VREG, the cost model's `two_edges`)."""
    finite = band.lo > -UNBOUNDED and band.hi < UNBOUNDED
    return finite and not sequence_ends and rows + cols - 2 < band.hi - band.lo + 2


# Generations whose backward masks take a dense call's band-only form too (kernel.SeqEdges,
# `one_edge_tiles`). TPU7x's dk/dv model, refitted on its cheaper masked dumps (Llama-3-8B
# 1024 x 512: 2,293 -> 2,182 bundles a tile), moves Llama-3-8B window 1024's backward to
# 512-row stacked tiles, which the same dumps put at 9.5% (masked) and 18% (mask-free) more
# bundles per score than the 1024-row ones; no fit within the tolerance keeps its tiles, and
# no whole-call dump of the backward settles it, so TPU7x's backward keeps the general masks.
BAND_MASK_BWD_GENERATIONS = ("v5e", "v5p", "v6e")


def backward_band_masks(generation=None) -> bool:
    """Whether the backward's masked tiles take a dense call's band-only masks
    (BAND_MASK_BWD_GENERATIONS; the forward's always do)."""
    return get_generation(generation).name in BAND_MASK_BWD_GENERATIONS


def compares_both_edges(band: Band, rows: int, cols: int, sequence_ends: bool) -> bool:
    """The cost model's `two_edges` for a masked rows x cols tile (`one_edge_tiles`)."""
    finite = band.lo > -UNBOUNDED and band.hi < UNBOUNDED
    return finite and not one_edge_tiles(band, rows, cols, sequence_ends)


VALU_SOFTCAP_PER_SCORE_VREG = 2.4
VALU_SEGMENT_PER_SCORE_VREG = 1.4
FWD_PATHS = ("interior", "walk")


def fwd_tile_units(
    gen: TpuGeneration,
    rows: int,
    cols: int,
    head_dim: int,
    softcap=False,
    two_edges=False,
    exp_bf16=False,
    fixed_max=False,
):
    """Per score tile of `rows` stacked query rows x `cols` keys: MXU pushes (QK^T and PV), EUP
    pushes and VALU ops of an interior (mask-free) tile, and the VALU ops the walk's chain
    (`walk_valu_ops`), a mask (`two_edges`: one that compares against both edges of a band,
    `compares_both_edges`) and segment ids add. `fixed_max`: a soft-capped tile against a fixed
    max (`softcap_fixed_max`), exp in f32 whatever `exp_bf16` says."""
    interior, walk, mask = FWD_VALU_PER_SCORE_VREG[gen.name]
    dp = _r(head_dim, NUM_LANES)
    score_vregs = rows * cols / (NUM_SUBLANES * NUM_LANES)
    acc_vregs = rows * dp / (NUM_SUBLANES * NUM_LANES)
    rescale_exps = rows // NUM_SUBLANES
    per_acc_vreg = VALU_PER_ACC_VREG
    if fixed_max:
        if not softcap:
            raise ValueError("fixed_max needs softcap: only a soft cap bounds the scores")
        interior -= FWD_VALU_FIXED_MAX_SAVED_PER_SCORE_VREG[gen.name]
        walk, exp_bf16, rescale_exps, per_acc_vreg = 0.0, False, 0, VALU_PER_ACC_VREG - 1
    valu = interior * score_vregs + per_acc_vreg * acc_vregs
    if softcap:
        valu += VALU_SOFTCAP_PER_SCORE_VREG * score_vregs
    exp_pushes = score_vregs / 2 if exp_bf16 else score_vregs
    return {
        "mxu_pushes": mxu_pushes(gen, rows, dp, cols) + mxu_pushes(gen, rows, cols, dp),
        "eup_pushes": int(exp_pushes + (score_vregs if softcap else 0) + rescale_exps),
        "valu_ops": valu,
        "walk_valu_ops": walk * score_vregs,
        "masked_valu_ops": (mask + (VALU_SECOND_EDGE_PER_SCORE_VREG if two_edges else 0.0))
        * score_vregs,
        "segment_valu_ops": VALU_SEGMENT_PER_SCORE_VREG * score_vregs,
    }


def fwd_tile_bundles(
    gen: TpuGeneration,
    rows: int,
    cols: int,
    head_dim: int,
    *,
    path: str,
    masked: bool,
    softcap=False,
    two_edges=False,
    exp_bf16=False,
    fixed_max=False,
) -> float:
    """Bundles the model gives one forward score tile on `path` ("interior" or "walk";
    `fwd_tile_units` through tile_bundles): what the calibration points' model figures are."""
    if path not in FWD_PATHS:
        raise ValueError(f"path must be one of {FWD_PATHS}, got {path!r}")
    u = fwd_tile_units(gen, rows, cols, head_dim, softcap, two_edges, exp_bf16, fixed_max)
    valu = u["valu_ops"]
    if path == "walk":
        valu += u["walk_valu_ops"] + (u["masked_valu_ops"] if masked else 0.0)
    return _generations.tile_bundles(
        gen, mxu_pushes=u["mxu_pushes"], eup_pushes=u["eup_pushes"], valu_ops=valu
    )


# What one backward score tile pushes through each unit, per pass (kernel.py `_dkdv_kernel`,
# `_dq_kernel`; "fused" is the dk/dv kernel that also accumulates dq). MXU pushes are counted from
# the matmuls as the kernel writes them: the dk/dv pass works on transposed scores [cols, rows]
# (S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q; fused adds dQ = dS K), the dq pass on
# [rows, cols] (S = Q K^T, dP = dO V^T, dQ += dS K); the dumps' vmatmul counts equal these. The
# EUP takes one exp per score (plus a tanh with a soft cap); there is no rescale exp.
# The VALU figures are effective ops per f32 score vreg, (unmasked, added by a mask), per
# generation and pass: fitted so that (ops / VALU slots) x vector_issue + the fixed per-tile
# bundles gives the dumped bundles of the tiles the MXU does not bound (where the MXU bounds a
# group of tiles the fit keeps the earlier figure). They exceed the ops the dumps issue where the
# tile is latency-bound (the S -> P -> dS -> dQ chain, with three matmuls to overlap it, leaves
# both units waiting), so the chain's latency is charged to the unit that carries it. A mask
# costs little since it is two compares per score against one interval per row
# (kernel.py `_tile_mask` / `_tile_mask_t`; it was the full [rows, cols] iota rule, 6-9 ops
# charged per score vreg on v6e, 17-21 on v5e). A soft cap adds the cap's multiply, (1 - tanh^2)
# and its product with dS (4 ops, counted from the body, not fitted); segment ids the forward's
# id compare (not fitted either). The dq pass runs its kv slices two per straight-line group
# (kernel.py DQ_UNROLL): its dumped loops hold two tiles, and the figures are per tile.
# benchmarks/flash_dump_points.py re-dumps the points and refreshes their errors.
# benchmarks/results/tile_model_calibration.json "bwd_points"
# holds the dumps: fitted on the Llama-3-8B points (role "calibration"; among fits within two
# points of the best error there, the one with the smallest error on every point of its
# group), the d=256 points held out. Refitted on every point re-dumped after masked tiles began
# to build one head's mask (kernel._masked_scores) and the dq pass took its exp in bf16 on v6e /
# TPU7x: masks now cost 1-6 ops a score vreg; TPU7x dk/dv took, among the fits within the
# tolerance, the one with the least spread of error over its Llama points, which keeps the
# named cells' tiles (another fit moved TPU7x window 1024 to 512-row tiles, whose dk/dv tiles
# the dumps put at 11-18% more bundles per score than the 1024-row ones). v5e's fused mask
# figure went 18.1 -> 17.5 with the 512-key dumps: four stacked heads' masked 1024 x 512 tile
# is MXU-bound in its dump (4739 bundles), and 18.1 made the model's VALU term bind above it.
# Refitted on the masked points re-dumped once a dense call's masks compared against the band
# alone, one compare where a tile meets one edge (kernel._in_bounds): v6e dk/dv 4.3 -> 2.9,
# dq 1.0 -> 0.2, fused 5.4 -> 4.1, among fits within half a point of the least largest error
# the one nearest the earlier figure. The four-head masked 1024 x 512 fused tile on v5e (4705
# bundles) now sits at the MXU floor like its mask-free twin (role "mxu-floor"). TPU7x's
# backward keeps the general masks and its figures (BAND_MASK_BWD_GENERATIONS).
BWD_PASSES = ("dkv", "dq", "fused")
BWD_VALU_PER_SCORE_VREG = {
    "v5e": {"dkv": (10.0, 13.0), "dq": (17.5, 0.3), "fused": (11.0, 17.5)},
    "v6e": {"dkv": (9.0, 2.9), "dq": (9.4, 0.2), "fused": (11.0, 4.1)},
    "tpu7x": {"dkv": (7.0, 6.0), "dq": (6.7, 2.0), "fused": (11.0, 5.0)},
}
BWD_VALU_PER_SCORE_VREG["v5p"] = BWD_VALU_PER_SCORE_VREG["v5e"]  # no v5p dump: v5e's (same VPU)
_BWD_VALU_V6E = BWD_VALU_PER_SCORE_VREG["v6e"]  # generations without a fit of their own
# A tile's dependency chain (S -> P -> dS -> the dK / dQ matmul) has a latency that does not
# shrink with the tile: below it a small tile costs the same bundles whatever its size (TPU7x,
# d=256, a 256 x 512 tile: the dk/dv loop runs 1088 bundles per tile at MXU 0.42 occupancy, a
# 512 x 512 one at d=128 1190). Charged as a floor on the tile's effective VALU ops,
# (unmasked, masked) per pass, fitted with the figures above; 0: no dump has shown one that a
# floor fits. v5e's fused tiles of one head (G = 1, d=128) run above their MXU floor by an
# amount no floor or per-score term fits (the dumps: +40% at 128 x 256, +38% at 256 x 256,
# +10% at 128 x 512, +7% at 512 x 256, -10% at 512 x 512; kv_compute_tiles): the ranking
# charges them their MXU floor and takes the widest among those it cannot tell apart
# (WIDEST_BWD_TILE_GENERATIONS).
_NO_FLOOR = {"dkv": (0, 0), "dq": (0, 0), "fused": (0, 0)}
BWD_CHAIN_FLOOR_VALU = {
    "v5e": _NO_FLOOR,
    "v5p": _NO_FLOOR,
    "v6e": {"dkv": (2420, 2440), "dq": (750, 750), "fused": (2770, 2810)},
    "tpu7x": {"dkv": (2500, 2500), "dq": (1150, 1430), "fused": (2820, 3100)},
}
BWD_VALU_SOFTCAP_PER_SCORE_VREG = 4.0
# A band with two edges (a sliding window) masks with a second interval end. The interval mask
# computes both ends whatever the band, so it adds nothing: v6e, Llama-3-8B window 1024, a
# 1024 x 256 fused tile, masked 1624 bundles per tile against 1456 mask-free, as a causal
# tile's mask costs (the one window point; 3.2 when masks were built for every stacked head,
# 1849 bundles then).
BWD_VALU_SECOND_EDGE_PER_SCORE_VREG = 0.0
# The model's largest error on the backward points (tests/test_flash_attention_kernel.py holds it
# to this); the backward ranks with it as best_tiles' `within`. 0.11, not 0.1: v5e's unmasked
# fused Llama-3-8B tile runs at MXU occupancy 0.93, below the shared MXU floor of tile_bundles
# (4.08 bundles per push on v5e), and the model is 10.9% above it there (MXU-bound, so no VALU
# figure can move it). Its 512-key fused tiles go further below that floor (3.6-3.7 bundles a
# push, the model 11.6-13.9% above them: role "mxu-floor" in the calibration file). The chip
# follows the dumps, not the floor, there: Flux-dev's backward alone ran 4627 and 3872 us at
# 512 x 256 and 512 x 512 tiles, 1.26x and 1.27x their dumped bundles (3.68 and 3.05 ms),
# where the floor gives both 3.4 ms (WIDEST_BWD_TILE_GENERATIONS takes the wider).
BWD_RANKING_TOLERANCE = 0.11


def bwd_tile_units(
    gen: TpuGeneration,
    rows: int,
    cols: int,
    head_dim: int,
    pass_: str,
    softcap=False,
    two_edges=False,
):
    """Per backward score tile of `rows` stacked query rows x `cols` keys in pass `pass_`
    ("dkv", "dq" or "fused"): MXU pushes, EUP pushes, effective VALU ops (unmasked), and the
    VALU ops a mask (`two_edges`: both edges of a band, `compares_both_edges`) / segment ids
    add."""
    if pass_ not in BWD_PASSES:
        raise ValueError(f"pass_ must be one of {BWD_PASSES}, got {pass_!r}")
    dp = _r(head_dim, NUM_LANES)
    score_vregs = rows * cols / (NUM_SUBLANES * NUM_LANES)
    if pass_ == "dq":
        # S = Q K^T and dP = dO V^T: [rows, dp] x [dp, cols]; dQ += dS K: [rows, cols] x [cols, dp]
        mxu = 2 * mxu_pushes(gen, rows, dp, cols) + mxu_pushes(gen, rows, cols, dp)
    else:
        # S^T = K Q^T, dP^T = V dO^T: [cols, dp] x [dp, rows]; dV, dK: [cols, rows] x [rows, dp]
        mxu = 2 * mxu_pushes(gen, cols, dp, rows) + 2 * mxu_pushes(gen, cols, rows, dp)
        if pass_ == "fused":
            mxu += mxu_pushes(gen, rows, cols, dp)  # dQ = dS K (dS^T contracted over cols)
    unmasked, mask = BWD_VALU_PER_SCORE_VREG.get(gen.name, _BWD_VALU_V6E)[pass_]
    floor, floor_masked = BWD_CHAIN_FLOOR_VALU.get(gen.name, _NO_FLOOR)[pass_]
    extra = BWD_VALU_SOFTCAP_PER_SCORE_VREG * score_vregs if softcap else 0.0
    valu = max(unmasked * score_vregs, floor) + extra
    if two_edges:
        mask += BWD_VALU_SECOND_EDGE_PER_SCORE_VREG
    valu_masked = max((unmasked + mask) * score_vregs, floor_masked) + extra
    return {
        "mxu_pushes": mxu,
        "eup_pushes": int(score_vregs * (2 if softcap else 1)),
        "valu_ops": valu,
        "masked_valu_ops": valu_masked - valu,
        "segment_valu_ops": VALU_SEGMENT_PER_SCORE_VREG * score_vregs,
    }


def bwd_tile_bundles(
    gen: TpuGeneration,
    rows: int,
    cols: int,
    head_dim: int,
    pass_: str,
    *,
    masked: bool,
    softcap=False,
    two_edges=False,
) -> float:
    """Bundles the model gives one backward score tile (`bwd_tile_units` through
    tile_bundles): what the calibration points' model figures are."""
    u = bwd_tile_units(gen, rows, cols, head_dim, pass_, softcap=softcap, two_edges=two_edges)
    valu = u["valu_ops"] + (u["masked_valu_ops"] if masked else 0.0)
    return _generations.tile_bundles(
        gen, mxu_pushes=u["mxu_pushes"], eup_pushes=u["eup_pushes"], valu_ops=valu
    )


# -------------------------------------------------------------------------------------------------
# Cost model: the same work list the kernel walks, counted.
# -------------------------------------------------------------------------------------------------


def _allowed_pairs(seqs, lo, hi) -> int:
    """Number of (query, key) pairs the mask allows, summed over sequences."""
    total = 0
    for q_lo, q_hi, k_lo, k_hi, off in zip(*seqs):
        t = np.arange(q_lo, q_hi, dtype=np.int64)
        # allowed u: k_lo <= u < k_hi and lo <= u - t + off <= hi
        u_min = np.maximum(k_lo, t - off + max(lo, -_UNBOUNDED))
        u_max = np.minimum(k_hi - 1, t - off + min(hi, _UNBOUNDED))
        total += int(np.maximum(u_max - u_min + 1, 0).sum())
    return total


def _fetches(idx_per_batch, per_head: bool, heads: int) -> int:
    """Copies a BlockSpec makes for the block indices of each batch row's list ([L] or [L, k]),
    each walked once per head: one at the start of a run and one at every change of the block
    index. `per_head`: the block index includes the head, so every (batch, head) run starts with
    a copy; otherwise a run starts with one only when its first index differs from the previous
    run's last (and a new batch row always does)."""
    total = 0
    for idx in idx_per_batch:
        if idx.ndim == 1:
            idx = idx[:, None]
        within = int(np.any(idx[1:] != idx[:-1], axis=1).sum())
        if per_head:
            total += heads * (1 + within)
        else:
            wrap = int(np.any(idx[0] != idx[-1]))
            total += 1 + heads * within + (heads - 1) * wrap
    return total


def _segment_pairs(q_ids, kv_ids, seqs, lo, hi) -> int:
    """Allowed (query, key) pairs of one batch row with segment ids, counted densely in chunks."""
    total = 0
    u = np.arange(len(kv_ids), dtype=np.int64)
    for q_lo, q_hi, k_lo, k_hi, off in zip(*seqs):
        for t0 in range(int(q_lo), int(q_hi), 1024):
            t = np.arange(t0, min(t0 + 1024, int(q_hi)), dtype=np.int64)[:, None]
            d = u[None, :] - t + off
            ok = (u >= k_lo) & (u < k_hi) & (d >= max(lo, -_UNBOUNDED)) & (d <= hi)
            total += int((ok & (q_ids[t[:, 0]][:, None] == kv_ids[None, :])).sum())
    return total


def estimate_cost(
    *,
    batch,
    num_q_heads,
    num_kv_heads,
    q_len,
    kv_len,
    head_dim,
    dtype,
    causal=False,
    window_size=(-1, -1),
    has_sinks=False,
    segments=False,
    cu_seqlens_q: Optional[Sequence[int]] = None,
    cu_seqlens_k: Optional[Sequence[int]] = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    tiles: Optional[Tiles] = None,
    generation=None,
    pass_: str = "fwd",
    count_scalar_prefetch: bool = True,
    softcap: float = 0.0,
    calls: Optional[list] = None,
) -> KernelCost:
    """What the Pallas calls of one forward (`pass_="fwd"`) or backward (`"bwd"`: dk/dv and dq
    kernels) move and compute. Counts the kernels only: the layout transposes/pads around them and
    the backward's di = rowsum(do * o) prologue are XLA ops outside. For varlen give cu_seqlens
    (q_len/kv_len are then the packed totals, batch 1); the SMEM list is then sized by its static
    bound, but the grid walks only its live items. `segments=True` sizes the
    segment-id buffers; giving the ids themselves ([batch, len] arrays) also drops the pairs they
    make empty, per batch row, as the kernel does.

    hbm_bytes = every BlockSpec copy in (one per change of a block index along the grid, as the
    Pallas pipeline does) + every output block written once + (with count_scalar_prefetch) the
    work list and sequence table copied to SMEM. TPU interpret mode moves exactly the BlockSpec
    part (checked in tests); it does not route the scalar prefetch through its copy path, and it
    reads each whole output array once before the grid starts, which hardware does not.

    `calls`: a list that receives one `pl.CostEstimate`-style dict per pallas_call (flops =
    issued MXU FLOPs, transcendentals = exp (and tanh with `softcap`) per computed score element
    plus the forward's rescale exp per row per tile, none against a fixed max, bytes_accessed =
    its HBM bytes), in call order; the kernels pass them to their pallas_calls."""
    has_ids = q_segment_ids is not None
    segments = segments or has_ids

    if tiles is None:
        tiles = choose_tiles(
            q_len=q_len,
            kv_len=kv_len,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            causal=causal,
            window_size=window_size,
            generation=generation,
            segments=segments,
        )
        tiles = with_fixed_max_kv_compute(generation, tiles, softcap, has_sinks)
    isz = _itemsize(dtype)
    G = num_q_heads // num_kv_heads
    B, Hkv, D = batch, num_kv_heads, head_dim
    dp = _r(D, NUM_LANES)
    Sq, Sk = _r(q_len, tiles.q_multiple), _r(kv_len, tiles.kv_multiple)
    varlen = cu_seqlens_q is not None
    if varlen:
        cq = np.asarray(cu_seqlens_q, np.int64)
        ck = np.asarray(cu_seqlens_k, np.int64)
        seqs = (cq[:-1], cq[1:], ck[:-1], ck[1:], cq[1:] - ck[1:])
    else:
        seqs = tuple(np.array([v], np.int64) for v in (0, q_len, 0, kv_len, q_len - kv_len))
    n_seq = len(seqs[0])
    band = Band.make(causal, *window_size)
    # A dense call's sequences end inside a block only where the call pads them (kernel.SeqEdges).
    sequence_ends = varlen or Sq != q_len or Sk != kv_len
    lo, hi = band.lo, band.hi
    if has_ids:
        q_ids = np.asarray(q_segment_ids, np.int64)
        kv_ids = np.asarray(kv_segment_ids, np.int64)
        pairs = sum(_segment_pairs(q_ids[b], kv_ids[b], seqs, lo, hi) for b in range(B))
    else:
        pairs = B * _allowed_pairs(seqs, lo, hi)
    useful_fwd = 4 * num_q_heads * D * pairs

    def padded_ids(ids, length, fill):
        out = np.full((B, length), fill, np.int64)
        out[:, : ids.shape[1]] = ids
        return out

    def items(bq, bk, kv_major):
        """The list each batch row runs, as the kernel builds it (padding items included)."""
        nq, nk = Sq // bq, Sk // bk
        s32 = tuple(np.asarray(a, np.int32) for a in seqs)
        band_list = build_work_list(s32, nq, nk, bq, bk, band, kv_major=kv_major)
        bound = max_work_items(n_seq, nq, nk) if varlen else band_list.shape[1]
        per_row = has_ids and per_batch_lists_fit(B, bound)  # else one list, ids only mask
        if per_row:
            qb = padded_ids(q_ids, Sq, -1).reshape(B, nq, bq)
            kb = padded_ids(kv_ids, Sk, -2).reshape(B, nk, bk)
            lists = [
                build_work_list(
                    s32,
                    nq,
                    nk,
                    bq,
                    bk,
                    band,
                    kv_major=kv_major,
                    segment_ranges=(qb[b].min(1), qb[b].max(1), kb[b].min(1), kb[b].max(1)),
                )
                for b in range(B)
            ]
        else:
            lists = [band_list] * B
        # The grid walks the longest row's live items; shorter rows run padding items that repeat
        # their last item with flags 0 (no copy, no compute).
        steps = max(it.shape[1] for it in lists)
        lists = [
            np.concatenate(
                [
                    it,
                    np.repeat(it[:, -1:], steps - it.shape[1], axis=1)
                    * np.array([[1], [1], [1], [0]]),
                ],
                axis=1,
            )
            for it in lists
        ]
        n_lists = B if per_row else 1
        smem = (n_lists * 4 * bound * 4 + 5 * n_seq * 4) if count_scalar_prefetch else 0
        return lists, smem

    stat = _r(G, 1) * 4  # one f32 per row per head, lane-major [G, block]

    def tile_tables(bqc, bkc):
        """(min, max) segment id per q compute tile and kv slice, as the kernels hold them in
        SMEM (None when they do not: no ids, or past MAX_TILE_RANGE_BYTES), and their bytes."""
        if not (has_ids and tile_ranges_fit(B, Sq // bqc, Sk // bkc)):
            return None
        qt = padded_ids(q_ids, Sq, -1).reshape(B, -1, bqc)
        kt = padded_ids(kv_ids, Sk, -2).reshape(B, -1, bkc)
        return (qt.min(2), qt.max(2), kt.min(2), kt.max(2), B * (Sq // bqc + Sk // bkc) * 2 * 4)

    if pass_ == "fwd":
        bq, bk, bkc, bqc = tiles.block_q, tiles.block_kv, tiles.block_kv_compute, tiles.q_compute
        lists, smem = items(bq, bk, False)
        n_q = _fetches([it[0] for it in lists], True, Hkv)
        n_k = _fetches([it[1] for it in lists], True, Hkv)
        hbm = n_q * G * bq * D * isz  # q blocks
        hbm += 2 * n_k * bk * D * isz  # k, v
        hbm += n_q * G * bq * D * isz + n_q * stat * bq  # o, lse written once per q run
        if segments:
            hbm += _fetches([it[0] for it in lists], False, Hkv) * bq * NUM_LANES * 4
            hbm += _fetches([it[1] for it in lists], False, Hkv) * NUM_SUBLANES * bk * 4
        hbm += smem + (num_q_heads * 4 if has_sinks else 0)  # sinks: whole-array SMEM copy
        tables = tile_tables(bqc, bkc)
        if tables is not None:
            hbm += tables[-1]  # the tile ranges: a whole-array SMEM copy
        live_tiles, masked_tiles, interior_tiles = count_tiles(
            lists, seqs, band, bq, bqc, bk, bkc, tables, segments=segments
        )
        mxu = Hkv * live_tiles * 2 * (2 * G * bqc * bkc * dp)
        steps = Hkv * sum(it.shape[1] for it in lists)
        min_bytes = (
            B * num_q_heads * q_len * D * isz * 2
            + 2 * B * Hkv * kv_len * D * isz
            + B * num_q_heads * q_len * 4
        )
        need = vmem_need_fwd(G, D, isz, bq, bk, bkc, segments, bqc)
        gen_f = get_generation(generation)
        fixed_max = softcap_fixed_max(softcap, has_sinks) is not None
        kw = dict(
            softcap=bool(softcap),
            two_edges=compares_both_edges(band, bqc, bkc, sequence_ends),
            exp_bf16=exp_in_bf16(gen_f, dtype),
            fixed_max=fixed_max,
        )
        units = fwd_tile_units(gen_f, G * bqc, bkc, D, **kw)
        # Interior items run their q tiles on the interior path, on v6e taller
        # (interior_q_compute): the same pushes and vector work in fewer tiles' fixed bundles,
        # without the walk's chain.
        limited = with_vmem_limits(tiles, G, D, dtype, generation, segments, q_len)
        bqi = interior_q_compute(generation, limited, G, D, isz, segments)
        while bqi > bqc and G * bqi > INTERIOR_CHARGED_ROWS:  # bqi is bqc doubled
            bqi //= 2
        tall = fwd_tile_units(gen_f, G * bqi, bkc, D, **kw)
        n_live, n_masked = Hkv * live_tiles, Hkv * masked_tiles
        n_tall = Hkv * interior_tiles * bqc // bqi
        n_walk = n_live - Hkv * interior_tiles
        valu = n_walk * (units["valu_ops"] + units["walk_valu_ops"]) + n_tall * tall["valu_ops"]
        valu += n_masked * units["masked_valu_ops"]
        if segments:
            valu += n_masked * units["segment_valu_ops"]
        if calls is not None:
            elems = Hkv * live_tiles * G * bqc * bkc
            calls.append(
                dict(
                    flops=mxu,
                    transcendentals=elems * (2 if softcap else 1)
                    + (0 if fixed_max else Hkv * live_tiles * G * bqc),
                    bytes_accessed=hbm,
                )
            )
        return KernelCost(
            useful_fwd,
            mxu,
            hbm,
            min_bytes,
            steps,
            need,
            compute_tiles=n_walk + n_tall,
            masked_tiles=n_masked,
            mxu_pushes=n_walk * units["mxu_pushes"] + n_tall * tall["mxu_pushes"],
            eup_pushes=n_walk * units["eup_pushes"] + n_tall * tall["eup_pushes"],
            valu_ops=int(round(valu)),
        )

    if pass_ != "bwd":
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")
    bq, bk = tiles.block_q_bwd, tiles.block_kv_bwd
    bqc, bkc = tiles.q_compute_bwd, tiles.kv_compute_bwd
    tables = tile_tables(bqc, bkc)
    fused = tiles.fused_bwd
    hbm = mxu = steps = 0
    gen_b = get_generation(generation)
    tiles_b = masked_b = pushes_b = eup_b = 0
    valu_b = 0.0
    if fused:  # dq of each (batch, head) written once, from the VMEM-resident block
        hbm += B * Hkv * G * Sq * D * isz
    for kv_major, outs in ((True, "kv"),) if fused else ((True, "kv"), (False, "q")):
        hbm_before, mxu_before = (0, 0) if kv_major else (hbm, mxu)  # fused: dq out in call 1
        lists, smem = items(bq, bk, kv_major)
        n_q = _fetches([it[0] for it in lists], True, Hkv)
        n_k = _fetches([it[1] for it in lists], True, Hkv)
        hbm += 2 * n_q * G * bq * D * isz + 2 * n_q * stat * bq  # q, do, lse, di
        hbm += 2 * n_k * bk * D * isz  # k, v
        if outs == "kv":
            hbm += 2 * n_k * bk * D * isz  # dk, dv
        else:
            hbm += n_q * G * bq * D * isz  # dq
        if segments:
            # dq pass: q ids as columns [bq, 128], kv ids as rows [8, bk]; dk/dv pass: transposed.
            q_seg, k_seg = (
                (NUM_SUBLANES * bq, bk * NUM_LANES)
                if kv_major
                else (bq * NUM_LANES, NUM_SUBLANES * bk)
            )
            hbm += _fetches([it[0] for it in lists], False, Hkv) * q_seg * 4
            hbm += _fetches([it[1] for it in lists], False, Hkv) * k_seg * 4
        hbm += smem + (tables[-1] if tables is not None else 0)
        # dk/dv visit each (kv slice, q tile) pair the dq pass visits as (q tile, kv slice):
        # 4 matmuls per tile there (s, dv, dp, dk), 3 here (s, dp, dq); fused: 5 (+ dq).
        live, masked, _ = count_tiles(
            lists, seqs, band, bq, bqc, bk, bkc, tables, segments=segments
        )
        n_mm = (5 if fused else 4) if kv_major else 3
        mxu += Hkv * live * n_mm * (2 * G * bqc * bkc * dp)
        steps += Hkv * sum(it.shape[1] for it in lists)
        pass_name = "fused" if fused else ("dkv" if kv_major else "dq")
        units = bwd_tile_units(
            gen_b,
            G * bqc,
            bkc,
            D,
            pass_name,
            softcap=bool(softcap),
            two_edges=compares_both_edges(band, bqc, bkc, sequence_ends),
        )
        n_live, n_masked = Hkv * live, Hkv * masked
        tiles_b += n_live
        masked_b += n_masked
        pushes_b += n_live * units["mxu_pushes"]
        eup_b += n_live * units["eup_pushes"]
        valu_b += n_live * units["valu_ops"] + n_masked * units["masked_valu_ops"]
        if segments:
            valu_b += n_masked * units["segment_valu_ops"]
        if calls is not None:
            elems = Hkv * live * G * bqc * bkc
            calls.append(
                dict(
                    flops=mxu - mxu_before,
                    transcendentals=elems * (2 if softcap else 1),
                    bytes_accessed=hbm - hbm_before,
                )
            )
    min_bytes = (
        B * num_q_heads * q_len * D * isz * 2
        + 2 * B * Hkv * kv_len * D * isz  # q, do; k, v
        + 2 * B * num_q_heads * q_len * 4  # lse, di
        + B * num_q_heads * q_len * D * isz
        + 2 * B * Hkv * kv_len * D * isz
    )  # dq, dk, dv
    need = vmem_need_bwd(G, D, isz, bq, bk, segments, bqc, bkc, Sq if fused else None)
    return KernelCost(
        2 * useful_fwd,
        mxu,
        hbm,
        min_bytes,
        steps,
        need,
        compute_tiles=tiles_b,
        masked_tiles=masked_b,
        mxu_pushes=pushes_b,
        eup_pushes=eup_b,
        valu_ops=int(round(valu_b)),
    )
