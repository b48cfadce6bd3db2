"""The JAX anchors (kernels shipped inside the jax wheel) on our benchmark shapes.

For each anchor: a closed-form cost (`*_cost(shape) -> (KernelCost, notes)`) derived from its
documented schedule, a function that runs it on small shapes in TPU interpret mode (so the tests
can check the closed form exactly against the DMA counter), and what to compile deviceless.

- megablox `gmm`: its grid size is a traced value (the number of (group, row tile) visits), so
  under `jax.jit` it cannot be interpreted. Called without its jit wrapper (`gmm.__wrapped__`) on
  concrete group sizes, the grid becomes a Python int and it runs in TPU interpret mode; the closed
  form walks the index maps over `make_group_metadata`'s own visit list.
- `flash_attention`: static grid (batch, heads, q blocks, kv blocks); every grid point is a step,
  blocks above the causal diagonal skip compute and re-point K/V at block 0 (no copy). It has no
  GQA (K/V are repeated to all query heads in HBM by XLA first), no sliding window and no soft cap.
- `ragged_paged_attention`: does not run in TPU interpret mode in jax 0.10.2 (the interpreter lacks
  a transform it uses), so it is counted from its schedule only (not checked by the counter):
  grid (head blocks, q blocks); each q block walks the sequences overlapping it; each of their KV
  blocks is `num_kv_pages_per_block` page DMAs (pages past the end re-fetch page 0).
"""

from __future__ import annotations

import functools
import importlib
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from blockspec_model import Operand, pipeline_bytes
from tpu_generations import KernelCost

__all__ = [
    "GMM_TILING",
    "gmm_cost",
    "gmm_call",
    "flash_cost",
    "flash_call",
    "rpa_blocks",
    "rpa_cost",
    "rpa_call",
    "itemsize",
]


_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int32": 4,
}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[str(dtype)]


def _jnp_dtype(dtype: str):
    import jax.numpy as jnp

    return jnp.dtype(dtype)


# -------------------------------------------------------------------------------------------------
# megablox gmm
# -------------------------------------------------------------------------------------------------

GMM_TILING = (128, 128, 128)  # megablox's default (tm, tk, tn)


def _megablox():
    # `megablox.gmm` the attribute is the custom_vjp op; the module holds the kernel.
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _visit_list(module, group_sizes: np.ndarray, m: int, tm: int, visit_empty_groups: bool):
    """(group_ids, m_tile_ids, number of visits) from a megablox-scheme kernel module's own
    make_group_metadata."""
    import jax.numpy as jnp

    (_, group_ids, m_tile_ids), num_tiles = module.make_group_metadata(
        group_sizes=jnp.asarray(group_sizes, jnp.int32),
        m=m,
        tm=tm,
        start_group=jnp.int32(0),
        num_nonzero_groups=len(group_sizes),
        visit_empty_groups=visit_empty_groups,
    )
    return np.asarray(group_ids), np.asarray(m_tile_ids), int(num_tiles)


def gmm_metadata(group_sizes: np.ndarray, m: int, tm: int):
    """megablox's own visit list: (group_ids, m_tile_ids, number of visits)."""
    return _visit_list(_megablox(), group_sizes, m, tm, visit_empty_groups=False)


def gmm_min_bytes(shape) -> int:
    isz = itemsize(shape.dtype)
    used = int((shape.group_sizes > 0).sum())  # experts with no rows need not be read
    return shape.m * shape.k * isz + used * shape.k * shape.n * isz + shape.m * shape.n * isz


def gmm_useful_flops(shape) -> int:
    return 2 * int(shape.group_sizes.sum()) * shape.k * shape.n


def gmm_large_tiling(shape):
    """A stronger megablox configuration than its default: 128 rows, K tiles up to 2048 and N
    tiles up to 1024 (what a user tuning it for these shapes would pick; fits every
    generation's default scoped VMEM)."""
    return (128, min(shape.k, 2048), min(shape.n, 1024))


def gmm_tall_tiling(shape):
    """megablox with 512-row tiles, K and N tiles up to 1024: fewer weight re-reads where an
    expert holds many rows (Mixtral's 8 experts: 1024-4096 rows each at 4096-16384 tokens), more
    rows computed and dropped where groups are short (DeepSeek-V3-like: ~128 rows per expert).
    The rows take the fastest megablox configuration per shape and generation as its best; this
    one fits v5e's 16 MiB default scoped VMEM (megablox asks for no more): 2 x (1 + 2 + 1) MiB
    of double-buffered blocks and a 2 MiB f32 accumulator."""
    return (min(shape.m, 512), min(shape.k, 1024), min(shape.n, 1024))


def gmm_cost(shape, tiling=GMM_TILING, out_dtype: str | None = None):
    """megablox gmm's traffic from its index maps over its visit list (bf16 out by default)."""
    return _gmm_walk(shape, tiling, gmm_metadata(shape.group_sizes, shape.m, tiling[0]), out_dtype)


def gmm_operands(shape, tiling, metadata, out_dtype=None):
    """(grid, operands) of the megablox-scheme gmm (megablox's and tokamax's kernels share it):
    grid (N tiles, visits, K tiles) over the visit list `metadata` = (group_ids, m_tile_ids,
    visits); lhs [tm, tk] of the visit's m tile, rhs [tk, tn] of its group, out [tm, tn] of its
    m tile."""
    tm, tk, tn = tiling
    isz = itemsize(shape.dtype)
    osz = itemsize(out_dtype or shape.dtype)
    group_ids, m_tile_ids, visits = metadata
    grid = (math.ceil(shape.n / tn), visits, math.ceil(shape.k / tk))
    return grid, [
        Operand("lhs", tm * tk * isz, lambda n, g, k: (m_tile_ids[g], k)),
        Operand("rhs", tk * tn * isz, lambda n, g, k: (group_ids[g], k, n)),
        Operand("out", tm * tn * osz, lambda n, g, k: (m_tile_ids[g], n), is_output=True),
    ]


def _gmm_walk(shape, tiling, metadata, out_dtype=None, lhs_buffers: int = 2):
    """The megablox-scheme gmm's cost over its visit list `metadata` (gmm_operands)."""
    tm, tk, tn = tiling
    isz = itemsize(shape.dtype)
    osz = itemsize(out_dtype or shape.dtype)
    grid, ops = gmm_operands(shape, tiling, metadata, out_dtype)
    visits = grid[1]
    p = pipeline_bytes(grid, ops)
    steps = p["steps"]
    cost = KernelCost(
        useful_flops=gmm_useful_flops(shape),
        mxu_flops=2 * tm * tk * tn * steps,
        hbm_bytes=p["read"] + p["write"],
        min_hbm_bytes=gmm_min_bytes(shape),
        grid_steps=steps,
        # lhs blocks (`lhs_buffers` deep), double-buffered rhs and out + the f32 accumulator
        vmem_bytes=(lhs_buffers * tm * tk + 2 * tk * tn) * isz + 2 * tm * tn * osz + tm * tn * 4,
    )
    return cost, {"tiling": list(tiling), "row_tile_visits": visits}


def gmm_call(shape, tiling=GMM_TILING, interpret=False, out_dtype: str | None = None):
    """(fn, args): megablox gmm on random data of `shape`; with concrete group sizes and no jit
    the grid is static, so the call interprets."""
    import jax
    import jax.numpy as jnp

    mg = _megablox()
    key = jax.random.key(0)
    lhs = jax.random.normal(key, (shape.m, shape.k), jnp.float32).astype(_jnp_dtype(shape.dtype))
    rhs = jax.random.normal(
        jax.random.fold_in(key, 1), (shape.experts, shape.k, shape.n), jnp.float32
    ).astype(_jnp_dtype(shape.dtype))
    gs = jnp.asarray(shape.group_sizes, jnp.int32)
    out_dtype = _jnp_dtype(out_dtype or shape.dtype)

    def fn(lhs, rhs, gs):
        return mg.gmm.__wrapped__(
            lhs, rhs, gs, preferred_element_type=out_dtype, tiling=tiling, interpret=interpret
        )

    return fn, (lhs, rhs, gs)


def gmm_compile_args(shape, tiling=GMM_TILING, out_dtype: str | None = None):
    """(fn, avals) for the deviceless compile: the jitted op, group sizes traced as in real use."""
    import jax.numpy as jnp

    mg = _megablox()
    out_dtype = _jnp_dtype(out_dtype or shape.dtype)
    dt = _jnp_dtype(shape.dtype)

    def fn(lhs, rhs, gs):
        return mg.gmm(lhs, rhs, gs, preferred_element_type=out_dtype, tiling=tiling)

    return fn, [
        ((shape.m, shape.k), dt),
        ((shape.experts, shape.k, shape.n), dt),
        ((shape.experts,), jnp.int32),
    ]


def tgmm_metadata(group_sizes: np.ndarray, m: int, tm: int):
    """megablox tgmm's visit list: gmm_metadata's, empty groups visited (their output is zeroed
    by a visit of their own)."""
    return _visit_list(_megablox(), group_sizes, m, tm, visit_empty_groups=True)


def tgmm_operands(shape, tiling, metadata, out_dtype=None):
    """(grid, operands) of megablox's tgmm (the weight gradient out[g] = lhs[rows of g].T @
    dout[rows of g]): grid (N tiles, K tiles, visits); lhs [tm, tk] and dout [tm, tn] of the
    visit's m tile, out [tk, tn] of its group."""
    tm, tk, tn = tiling
    isz = itemsize(shape.dtype)
    osz = itemsize(out_dtype or shape.dtype)
    group_ids, m_tile_ids, visits = metadata
    grid = (math.ceil(shape.n / tn), math.ceil(shape.k / tk), visits)
    return grid, [
        Operand("lhs", tm * tk * isz, lambda n, k, g: (m_tile_ids[g], k)),
        Operand("dout", tm * tn * isz, lambda n, k, g: (m_tile_ids[g], n)),
        Operand("out", tk * tn * osz, lambda n, k, g: (group_ids[g], k, n), is_output=True),
    ]


def tgmm_cost(shape, tiling, out_dtype: str | None = None, metadata=None):
    """megablox tgmm's traffic from its index maps over its visit list (`metadata`, default
    tgmm_metadata's); every step multiplies a whole (tk, tm) x (tm, tn) block (rows of other
    groups masked). Returns (KernelCost, info) with its visit list's `group_runs` (the output
    tiles it zeroes and stores: one per run of visits to a group, per (N tile, K tile))."""
    tm, tk, tn = tiling
    if metadata is None:
        metadata = tgmm_metadata(shape.group_sizes, shape.m, tm)
    grid, ops = tgmm_operands(shape, tiling, metadata, out_dtype)
    p = pipeline_bytes(grid, ops)
    group_ids = metadata[0][: metadata[2]]
    runs = 1 + int((np.diff(group_ids) != 0).sum())
    cost = KernelCost(
        useful_flops=gmm_useful_flops(shape),
        mxu_flops=2 * tm * tk * tn * p["steps"],
        hbm_bytes=p["read"] + p["write"],
        min_hbm_bytes=gmm_min_bytes(shape),
        grid_steps=p["steps"],
        vmem_bytes=2 * (tm * tk + tm * tn) * itemsize(shape.dtype)
        + 2 * tk * tn * itemsize(out_dtype or shape.dtype)
        + tk * tn * 4,
    )
    return cost, {"tiling": list(tiling), "group_runs": runs * grid[0] * grid[1]}


def tgmm_compile_args(shape, tiling, out_dtype: str | None = None):
    """(fn, avals) of megablox's jitted tgmm (lhs handed over [K, M], as its op takes it)."""
    import jax.numpy as jnp

    mg = _megablox()
    dt = _jnp_dtype(shape.dtype)
    out_dtype = _jnp_dtype(out_dtype or shape.dtype)

    def fn(lhs_t, dout, gs):
        return mg.tgmm(lhs_t, dout, gs, preferred_element_type=out_dtype, tiling=tiling)

    return fn, [
        ((shape.k, shape.m), dt),
        ((shape.m, shape.n), dt),
        ((shape.experts,), jnp.int32),
    ]


# -------------------------------------------------------------------------------------------------
# tokamax's TPU gmm (tokamax 0.0.12 from `.tokamax/`, the kernel kernels-community/ragged-dot-tpu
# runs), imported as benchmarks/validate_schedule.py imports it
# -------------------------------------------------------------------------------------------------

# Where the anchor's tiles come from, most specific first.
TOKAMAX_TILING_SOURCES = {
    "published": "the best config in tokamax's published TPU autotune data for this shape and "
    "generation",
    "table": "tokamax's own tuned table for this shape (GMM_TILING_TUNED_LUT)",
    "default": "tokamax's default Config (the shape is in neither its published data for this "
    "generation nor its tuned table)",
}


def _validate_schedule():
    import validate_schedule  # benchmarks/, like this module

    return validate_schedule


def tokamax_gmm_kernel():
    """tokamax's `pallas_mosaic_tpu_kernel` module (its `gmm` and `make_group_metadata`)."""
    return _validate_schedule()._ragged_kernel_module()


def _tokamax_op_module():
    """tokamax's ragged-dot op module, read for its tiling table and Config defaults only. It
    imports qwix (not installed): the kernel's import puts validate_schedule's stand-in first."""
    tokamax_gmm_kernel()
    return _validate_schedule()._tokamax_import("_src.ops.ragged_dot.pallas_mosaic_tpu")


@functools.cache
def _tokamax_published_fwd():
    """tokamax's published forward gmm rows (validate_schedule.load_ragged_rows); none when the
    data is not there."""
    vs = _validate_schedule()
    path = vs.DATA / "tokamax_ragged_dot_autotune_derived.csv"
    if not path.exists():
        return ()
    return tuple(r for r in vs.load_ragged_rows(path) if r.kind == "fwd")


def tokamax_gmm_config(shape, generation: str) -> dict:
    """tokamax's gmm configuration for `shape` on `generation`: the fastest config its published
    autotune data has for exactly this forward shape on this generation; otherwise what its op
    picks without autotuning (`PallasMosaicTpuRaggedDot._get_heuristics_config`: its tuned table
    keyed by (m, k, n, groups, quantised), else `Config()`'s defaults). {"tiling", "buffers"
    (lhs input buffers), "source" (a key of TOKAMAX_TILING_SOURCES), "published_ms"}."""
    lhs, rhs = (shape.m, shape.k), (shape.experts, shape.k, shape.n)
    published = [
        r
        for r in _tokamax_published_fwd()
        if shape.dtype == "bfloat16" and r.gen == generation and r.lhs == lhs and r.rhs == rhs
    ]
    if published:
        best = min(published, key=lambda r: r.ms)
        c = best.cfg
        return {
            "tiling": (int(c["tile_m"]), int(c["tile_k"]), int(c["tile_n"])),
            "buffers": int(c.get("input_buffer_count", 2)),
            "source": "published",
            "published_ms": best.ms,
        }
    op = _tokamax_op_module()
    hit = op.GMM_TILING_TUNED_LUT.get((shape.m, shape.k, shape.n, shape.experts, False))
    if hit is not None:
        tiles, buffers = hit
        return {"tiling": tuple(tiles), "buffers": buffers, "source": "table", "published_ms": None}
    d = op.Config()
    return {
        "tiling": (d.tile_m, d.tile_k, d.tile_n),
        "buffers": d.input_buffer_count,
        "source": "default",
        "published_ms": None,
    }


def tokamax_gmm_unsupported(shape, tiling) -> str | None:
    """Why tokamax's gmm cannot run `shape` at `tiling`, or None. Its op refuses any of m, k, n
    under 128; its work list needs m divisible by tile_m. (It has no bias and, through this op,
    no int8/fp8 weights either: no benchmark shape asks for them.)"""
    if min(shape.m, shape.k, shape.n) < 128:
        dims = f"m, k, n = {shape.m}, {shape.k}, {shape.n}"
        return f"tokamax's op refuses dimensions under 128 ({dims})"
    if shape.m % tiling[0]:
        return f"tokamax's gmm needs m divisible by tile_m ({shape.m} rows, tile_m {tiling[0]})"
    return None


def tokamax_gmm_metadata(group_sizes: np.ndarray, m: int, tm: int):
    """tokamax's own visit list (its make_group_metadata): (group_ids, m_tile_ids, visits)."""
    return _visit_list(tokamax_gmm_kernel(), group_sizes, m, tm, visit_empty_groups=False)


def tokamax_gmm_cost(shape, generation: str, config: dict | None = None):
    """tokamax's gmm traffic: one pallas_call whose body runs `emit_pipeline` over the grid
    (N tiles, visits, K tiles) with megablox's index maps over its own visit list, so a pipeline
    step is a grid step of the megablox scheme (the lhs block `buffers` deep)."""
    cfg = config or tokamax_gmm_config(shape, generation)
    tiling = tuple(cfg["tiling"])
    meta = tokamax_gmm_metadata(shape.group_sizes, shape.m, tiling[0])
    cost, info = _gmm_walk(shape, tiling, meta, lhs_buffers=cfg["buffers"])
    info.update(
        input_buffer_count=cfg["buffers"],
        tiling_source=cfg.get("source"),
        notes=[f"{shape.name}: tiles {tokamax_tiles_by_generation(shape)}"],
    )
    return cost, info


def tokamax_tiles_by_generation(shape) -> str:
    """'v5e 1024x512x1024 (published), v6e 128x128x128 (default), ...': the row's tiles."""
    from tpu_generations import TESTED_GENERATIONS

    cfgs = {g: tokamax_gmm_config(shape, g) for g in TESTED_GENERATIONS}
    return ", ".join(
        f"{g} {'x'.join(map(str, c['tiling']))} ({c['source']})" for g, c in cfgs.items()
    )


def _tokamax_gmm_fn(shape, config: dict, interpret: bool, jitted: bool):
    import jax

    rk = tokamax_gmm_kernel()
    gmm = rk.gmm if jitted else rk.gmm.__wrapped__
    out_dtype = _jnp_dtype(shape.dtype)

    def fn(lhs, rhs, gs):
        return gmm(
            lhs,
            rhs,
            gs,
            # bf16 operands, f32 accumulation: what tokamax's op and benchmark pass for bf16
            precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
            out_dtype=out_dtype,
            tiling=tuple(config["tiling"]),
            input_buffer_count=config["buffers"],
            interpret=interpret,
        )

    return fn


def tokamax_gmm_call(shape, config: dict, interpret: bool = True):
    """(fn, args): tokamax's gmm on random data of `shape` at `config`; without its jit and with
    concrete group sizes its pipeline's trip count is a Python value, so it interprets."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(4)
    dt = _jnp_dtype(shape.dtype)
    lhs = jax.random.normal(key, (shape.m, shape.k), jnp.float32).astype(dt)
    rhs = jax.random.normal(
        jax.random.fold_in(key, 1), (shape.experts, shape.k, shape.n), jnp.float32
    ).astype(dt)
    gs = jnp.asarray(shape.group_sizes, jnp.int32)
    return _tokamax_gmm_fn(shape, config, interpret, jitted=False), (lhs, rhs, gs)


def tokamax_gmm_compile_args(shape, generation: str, config: dict | None = None):
    """(fn, avals) for the deviceless compile: tokamax's jitted gmm at its tiles for
    `generation`, group sizes traced as in real use."""
    import jax.numpy as jnp

    cfg = config or tokamax_gmm_config(shape, generation)
    dt = _jnp_dtype(shape.dtype)
    return _tokamax_gmm_fn(shape, cfg, interpret=False, jitted=True), [
        ((shape.m, shape.k), dt),
        ((shape.experts, shape.k, shape.n), dt),
        ((shape.experts,), jnp.int32),
    ]


# -------------------------------------------------------------------------------------------------
# flash_attention
# -------------------------------------------------------------------------------------------------

FLASH_BLOCK = 128  # flash_attention's BlockSizes.get_default: 128 everywhere


def attention_pairs(seq: int, causal: bool, window: int | None, q_len: int | None = None) -> int:
    """(query, key) pairs the mask keeps for one head: causal bottom-right aligned, a window of w
    keeps the query's own key and the w-1 before it."""
    q_len = seq if q_len is None else q_len
    pos = np.arange(seq - q_len, seq, dtype=np.int64)  # absolute positions of the queries
    seen = pos + 1 if causal else np.full_like(pos, seq)
    if window is not None:
        seen = np.minimum(seen, window)
    return int(seen.sum())


def attention_min_bytes(shape) -> int:
    isz = itemsize(shape.dtype)
    qo = 2 * shape.batch * shape.q_heads * shape.seq * shape.head_dim * isz
    kv = 2 * shape.batch * shape.kv_heads * shape.seq * shape.head_dim * isz
    return qo + kv


def attention_useful_flops(shape) -> int:
    # QK^T and PV: 2 * d FLOPs each per kept (query, key) pair; packed documents see only
    # themselves.
    docs = shape.documents or 1
    pairs = docs * attention_pairs(shape.seq // docs, shape.causal, shape.window)
    return 4 * shape.head_dim * pairs * shape.batch * shape.q_heads


SEGMENT_NOTE = "segment ids only mask: block pairs between documents are still fetched and computed"


def _below_or_on_diag(r, rb, c, cb):
    return ((r + 1) * rb - 1) > (c * cb)


def flash_cost(shape, block: int = FLASH_BLOCK, include_repeat: bool = True):
    """flash_attention forward (no residuals) with its default 128 blocks. It computes plain
    causal (or full) attention: a window or soft cap in `shape` is not applied (it has neither).
    `include_repeat` adds the XLA repeat of K/V to all query heads that GQA needs before the call."""
    B, H, S, d = shape.batch, shape.q_heads, shape.seq, shape.head_dim
    isz = itemsize(shape.dtype)
    bq = bk = min(block, S)
    nq, nk = math.ceil(S / bq), S // bk
    causal = shape.causal
    blk = bq * d * isz

    def kv_map(b, h, qi, ki):
        return (b, h, np.where(_below_or_on_diag(qi, bq, ki, bk), ki, 0) if causal else ki)

    ops = [
        Operand("q", blk, lambda b, h, qi, ki: (b, h, qi)),
        Operand("k", bk * d * isz, kv_map),
        Operand("v", bk * d * isz, kv_map),
        Operand("o", blk, lambda b, h, qi, ki: (b, h, qi), is_output=True),
    ]
    if shape.documents:  # q ids [block_q, 128] and kv ids [8, block_k] int32, no head axis
        ops += [
            Operand("q_segment_ids", bq * 128 * 4, lambda b, h, qi, ki: (b, qi + 0 * h)),
            Operand(
                "kv_segment_ids", 8 * bk * 4, lambda b, h, qi, ki: (b, kv_map(b, h, qi, ki)[2])
            ),
        ]
    grid = (B, H, nq, nk)
    p = pipeline_bytes(grid, ops)
    qi, ki = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
    run_per_head = int(_below_or_on_diag(qi, bq, ki, bk).sum()) if causal else nq * nk
    kernel_bytes = p["read"] + p["write"]
    repeat = 0
    if include_repeat and shape.kv_heads != H:
        repeat = 2 * B * S * d * isz * (shape.kv_heads + H)  # read K,V once; write them repeated
    notes = []
    if shape.kv_heads != H:
        notes.append(f"no GQA: K/V repeated to {H} heads by XLA ({repeat:,} B included)")
    if shape.window is not None:
        notes.append("no sliding window: computes full causal")
    if shape.softcap is not None:
        notes.append("no soft cap")
    if shape.documents:
        notes.append(SEGMENT_NOTE)
    cost = KernelCost(
        useful_flops=attention_useful_flops(shape),
        mxu_flops=4 * bq * bk * d * run_per_head * B * H,
        hbm_bytes=kernel_bytes + repeat,
        min_hbm_bytes=attention_min_bytes(shape),
        grid_steps=p["steps"],
        # double-buffered q, k, v, o blocks + f32 m, l (128 lanes) and accumulator scratch
        vmem_bytes=2 * (2 * bq + 2 * bk) * d * isz + 2 * bq * 128 * 4 + bq * d * 4,
    )
    return cost, {"block": bq, "kernel_hbm_bytes": kernel_bytes, "notes": notes}


def flash_call(shape, block: int = FLASH_BLOCK):
    """(fn, args) running flash_attention on random data: k/v at kv_heads, repeated to q_heads by
    XLA inside fn (the interpreter counts only the kernel's own traffic)."""
    import jax
    import jax.numpy as jnp

    fn, avals = flash_compile_args(shape, block)
    key = jax.random.key(1)
    args = tuple(
        jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dt)
        for i, (s, dt) in enumerate(avals)
    )
    return fn, args


def flash_compile_args(shape, block: int = FLASH_BLOCK):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    dt = _jnp_dtype(shape.dtype)
    b = min(block, shape.seq)
    bs = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1)
    rep = shape.q_heads // shape.kv_heads

    ids = shape.segment_ids()
    segment_ids = None
    if ids is not None:
        rows = np.broadcast_to(
            np.asarray(ids), (shape.batch, shape.seq)
        )  # host arrays: no eager TPU op
        segment_ids = fa.SegmentIds(q=rows, kv=rows)

    def fn(q, k, v):
        k = jnp.repeat(k, rep, axis=1)
        v = jnp.repeat(v, rep, axis=1)
        return fa.flash_attention(
            q,
            k,
            v,
            causal=shape.causal,
            sm_scale=shape.head_dim**-0.5,
            block_sizes=bs,
            segment_ids=segment_ids,
        )

    qs = ((shape.batch, shape.q_heads, shape.seq, shape.head_dim), dt)
    kvs = ((shape.batch, shape.kv_heads, shape.seq, shape.head_dim), dt)
    return fn, [qs, kvs, kvs]


# -------------------------------------------------------------------------------------------------
# ragged_paged_attention
# -------------------------------------------------------------------------------------------------


RPA_FIT_KV_BYTES = 4 << 20  # per KV slot for the "fits VMEM" configuration (two slots)


def rpa_fit_pages(shape) -> int:
    """KV pages per block so that one KV slot holds at most RPA_FIT_KV_BYTES (all KV heads)."""
    page = shape.page_size * 2 * shape.kv_heads * shape.head_dim * itemsize(shape.dtype)
    return max(1, min(shape.pages_per_seq, RPA_FIT_KV_BYTES // page))


def rpa_blocks(shape, pages_per_block=None):
    """(q heads per block, combined KV heads per block, KV pages per block, queries per block),
    as ragged_paged_attention picks them: its own head blocking, and its tuned table for
    'TPU v6' (its defaults (128 pages, 32 queries) where the table has no entry).
    `pages_per_block` overrides the KV pages per block."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rk
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tb

    dt = _jnp_dtype(shape.dtype)
    hq_blk, hkv2_blk = rk.get_min_heads_per_blk(shape.q_heads, 2 * shape.kv_heads, dt, dt)
    key = tb.simplify_key(
        (
            dt,
            dt,
            hq_blk,
            hkv2_blk // 2,
            shape.head_dim,
            shape.page_size,
            shape.q_tokens,
            shape.pages_per_seq,
        )
    )
    bkv, bq = tb.TUNED_BLOCK_SIZES.get("TPU v6", {}).get(key, (128, 32))
    bkv = pages_per_block or bkv
    return hq_blk, hkv2_blk, min(shape.pages_per_seq, bkv), min(shape.q_tokens, bq)


def paged_min_bytes(shape) -> int:
    """q read, o written, every valid KV byte read once (page tables not counted)."""
    isz = itemsize(shape.dtype)
    qo = 2 * shape.q_tokens * shape.q_heads * shape.head_dim * isz
    kv = (
        sum(min(kv, shape.window or kv) for _, kv in shape.seqs)
        * 2
        * shape.kv_heads
        * shape.head_dim
        * isz
    )
    return qo + kv


def paged_useful_flops(shape) -> int:
    pairs = sum(attention_pairs(kv, True, shape.window, q_len=q) for q, kv in shape.seqs)
    return 4 * shape.head_dim * shape.q_heads * pairs


def rpa_cost(shape, pages_per_block=None):
    """ragged_paged_attention's traffic from its schedule (see the module docstring)."""
    isz = itemsize(shape.dtype)
    hq_blk, hkv2_blk, pages_blk, bq = rpa_blocks(shape, pages_per_block)
    head_blocks = shape.q_heads // hq_blk
    T = shape.q_tokens
    nq = math.ceil(T / bq)
    kv_per_blk = pages_blk * shape.page_size
    cu = np.concatenate([[0], np.cumsum([q for q, _ in shape.seqs])])
    kv_block_visits = 0
    for qb in range(nq):
        qs, qe = qb * bq, (qb + 1) * bq
        for s, (_, kv) in enumerate(shape.seqs):
            if cu[s] < qe and cu[s + 1] > qs:
                kv_block_visits += math.ceil(kv / kv_per_blk)
    kv_block_visits *= head_blocks
    dmas = kv_block_visits * pages_blk
    dma_bytes = dmas * shape.page_size * hkv2_blk * shape.head_dim * isz
    steps = head_blocks * nq
    qo_bytes = 2 * steps * bq * hq_blk * shape.head_dim * isz  # q block in, o block out per step
    d = shape.head_dim
    group = shape.q_heads // shape.kv_heads
    cost = KernelCost(
        useful_flops=paged_useful_flops(shape),
        mxu_flops=4 * bq * hq_blk * kv_per_blk * d * kv_block_visits,
        hbm_bytes=dma_bytes + qo_bytes,
        min_hbm_bytes=paged_min_bytes(shape),
        grid_steps=steps,
        # double-buffered q and o blocks, the two KV slots, f32 l/m (128 lanes) and accumulator
        vmem_bytes=(
            4 * bq * hq_blk * d * isz
            + 2 * pages_blk * shape.page_size * hkv2_blk * d * isz
            + 2 * (hkv2_blk // 2) * bq * group * 128 * 4
            + bq * hq_blk * d * 4
        ),
    )
    notes = [
        f"{dmas:,} page DMAs, issued from a loop inside its {steps} grid steps: the "
        "per-grid-step overhead of the model does not see that loop"
    ]
    if shape.window is not None:
        notes.append("sliding window masks but still fetches every page")
    return cost, {
        "pages_per_block": pages_blk,
        "queries_per_block": bq,
        "dmas": dmas,
        "notes": notes,
    }


def _rpa_inputs(shape):
    """Concrete inputs: a page table giving each sequence its own consecutive pages."""
    pps = shape.pages_per_seq
    n = len(shape.seqs)
    page_indices = np.arange(n * pps, dtype=np.int32).reshape(n, pps)
    kv_lens = np.asarray([kv for _, kv in shape.seqs], np.int32)
    cu_q = np.concatenate([[0], np.cumsum([q for q, _ in shape.seqs])]).astype(np.int32)
    return kv_lens, page_indices, cu_q, n * pps


def rpa_compile_args(shape, pages_per_block=None):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rk

    dt = _jnp_dtype(shape.dtype)
    _, _, pages_blk, bq = rpa_blocks(shape, pages_per_block)
    n = len(shape.seqs)
    total_pages = n * shape.pages_per_seq

    def fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        return rk.ragged_paged_attention(
            q,
            kv_pages,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            sm_scale=shape.head_dim**-0.5,
            sliding_window=shape.window,
            num_kv_pages_per_block=pages_blk,
            num_queries_per_block=bq,
        )

    return fn, [
        ((shape.q_tokens, shape.q_heads, shape.head_dim), dt),
        ((total_pages, shape.page_size, 2 * shape.kv_heads, shape.head_dim), dt),
        ((n,), jnp.int32),
        ((n, shape.pages_per_seq), jnp.int32),
        ((n + 1,), jnp.int32),
        ((1,), jnp.int32),
    ]


def rpa_call(shape, pages_per_block=None):
    """(fn, args) on random data; runs in plain interpret mode only (see module docstring)."""
    import jax
    import jax.numpy as jnp

    fn, avals = rpa_compile_args(shape, pages_per_block)
    kv_lens, page_indices, cu_q, total_pages = _rpa_inputs(shape)
    key = jax.random.key(2)
    q = jax.random.normal(key, avals[0][0], jnp.float32).astype(avals[0][1])
    kv = jax.random.normal(jax.random.fold_in(key, 1), avals[1][0], jnp.float32).astype(avals[1][1])
    return fn, (
        q,
        kv,
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q),
        jnp.asarray([len(shape.seqs)], jnp.int32),
    )


# -------------------------------------------------------------------------------------------------
# Splash attention (jax.experimental.pallas.ops.tpu.splash_attention)
# -------------------------------------------------------------------------------------------------

SPLASH_BLOCK = 512  # block_q = block_kv = block_kv_compute (MaxText's default for splash)


def _splash_modules():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return sk, sm


def splash_kernel(shape, block: int = SPLASH_BLOCK, backward: bool = False):
    """Splash MHA (GQA through its head mapping) with a causal or local (sliding-window) mask.
    `backward`: differentiable, its fused dq/dk/dv kernel at the same blocks (the configuration
    MaxText and tokamax run for training); the forward is the same kernel either way."""
    sk, sm = _splash_modules()
    S = shape.seq
    b = min(block, S)
    if shape.window is not None:
        head_mask = sm.LocalMask((S, S), window_size=(shape.window - 1, 0), offset=0)
    elif shape.causal:
        head_mask = sm.CausalMask((S, S))
    else:
        head_mask = sm.FullMask((S, S))
    mask = sm.MultiHeadMask([head_mask] * shape.q_heads)
    bwd = dict(block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    bs = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, **(bwd if backward else {}))
    import jax

    # make_splash_mha builds its mask tables with eager jnp ops: on the host's CPU, not on the
    # deviceless TPU a compile sets as the default device (which cannot run them).
    with jax.default_device(jax.devices("cpu")[0]):
        return sk.make_splash_mha(
            mask, block_sizes=bs, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=shape.softcap
        )


def splash_cost(shape, block: int = SPLASH_BLOCK):
    """Splash forward from its own mask info: grid (q heads, q blocks, compressed kv width); K/V
    index maps follow data_next (a masked-out block re-points at the next live block: no copy)."""
    kernel = splash_kernel(shape, block)
    mi = kernel.fwd_mask_info
    data_next = np.asarray(mi.data_next)
    block_mask = np.asarray(mi.block_mask)
    H, S, d = shape.q_heads, shape.seq, shape.head_dim
    G = H // shape.kv_heads
    b = min(block, S)
    isz = itemsize(shape.dtype)
    nq, width = data_next.shape[1], data_next.shape[2]
    per_head = data_next.shape[0] != 1

    def hm(h):
        return h if per_head else np.zeros_like(h)

    def kv_map(h, i, j):
        return (h // G, data_next[hm(h), i, j])

    ops = [
        Operand("q", b * d * isz, lambda h, i, j: (h, i)),
        Operand("k", b * d * isz, kv_map),
        Operand("v", b * d * isz, kv_map),
        # m, l and the f32 accumulator are outputs with a constant block: written once at the end
        Operand("m", b * 128 * 4, lambda h, i, j: (0 * h,), is_output=True),
        Operand("l", b * 128 * 4, lambda h, i, j: (0 * h,), is_output=True),
        Operand("acc", b * d * 4, lambda h, i, j: (0 * h,), is_output=True),
        Operand("o", b * d * isz, lambda h, i, j: (h, i), is_output=True),
    ]
    if mi.partial_mask_blocks is not None:
        mask_next = np.asarray(mi.mask_next)
        pmb = np.asarray(mi.partial_mask_blocks)
        ops.append(
            Operand("mask", b * b * pmb.dtype.itemsize, lambda h, i, j: (mask_next[hm(h), i, j],))
        )
    if mi.q_sequence is not None:
        ops.append(Operand("q_sequence", b * 128 * 4, lambda h, i, j: (i + 0 * h,)))
    if shape.documents:  # q ids [bq, 128] and kv ids [8, bkv] int32, following data_next
        ops += [
            Operand("q_segment_ids", b * 128 * 4, lambda h, i, j: (i + 0 * h,)),
            Operand("kv_segment_ids", 8 * b * 4, lambda h, i, j: (data_next[hm(h), i, j],)),
        ]
    grid = (H, nq, width)
    p = pipeline_bytes(grid, ops)
    live = int((block_mask != 0).sum()) * (1 if per_head else H)
    # Splash has no batch axis: a batch is one call per sequence (B times this grid).
    B = shape.batch
    notes = [f"no batch axis: {B} calls, one per sequence"] if B > 1 else []
    if shape.documents:
        notes.append(SEGMENT_NOTE)
    cost = KernelCost(
        useful_flops=attention_useful_flops(shape),
        mxu_flops=4 * b * b * d * live * B,
        hbm_bytes=(p["read"] + p["write"]) * B,
        min_hbm_bytes=attention_min_bytes(shape),
        grid_steps=p["steps"] * B,
        vmem_bytes=2 * (2 * b + 2 * b) * d * isz + 2 * (2 * b * 128 * 4 + b * d * 4),
    )
    return cost, {"block": b, "kv_width": width, "notes": notes}


def splash_compile_args(shape, block: int = SPLASH_BLOCK, backward: bool = False):
    """(fn, avals): q [H, S, D], k/v [Hkv, S, D]; with batch > 1 a leading batch axis and one
    kernel call per sequence. `backward`: fn is differentiable (splash_kernel)."""
    import jax.numpy as jnp

    kernel = splash_kernel(shape, block, backward)
    dt = _jnp_dtype(shape.dtype)
    scale = shape.head_dim**-0.5
    lead = (shape.batch,) if shape.batch > 1 else ()
    ids = shape.segment_ids()
    segment_ids = None
    if ids is not None:
        sk, _ = _splash_modules()
        segment_ids = sk.SegmentIds(q=np.asarray(ids), kv=np.asarray(ids))  # host arrays

    def fn(q, k, v):
        if not lead:
            return kernel(q * scale, k, v, segment_ids=segment_ids)
        # One call per sequence (jax.vmap of this kernel does not run in TPU interpret mode).
        return jnp.stack(
            [kernel(q[b] * scale, k[b], v[b], segment_ids=segment_ids) for b in range(shape.batch)]
        )

    return fn, [
        (lead + (shape.q_heads, shape.seq, shape.head_dim), dt),
        (lead + (shape.kv_heads, shape.seq, shape.head_dim), dt),
        (lead + (shape.kv_heads, shape.seq, shape.head_dim), dt),
    ]


def splash_call(shape, block: int = SPLASH_BLOCK):
    import jax
    import jax.numpy as jnp

    fn, avals = splash_compile_args(shape, block)
    key = jax.random.key(3)
    args = tuple(
        jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dt)
        for i, (s, dt) in enumerate(avals)
    )
    return fn, args
