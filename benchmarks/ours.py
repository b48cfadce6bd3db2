"""Our kernels, plugged into the benchmarks: one small adapter per kernel.

Each adapter turns a benchmark shape into
  cost(shape, generation)          -> KernelCost, from the kernel's own `tiling.estimate_cost`
  call(shape, generation)          -> (fn, args): the kernel.py entry point on random data
  compile_args(shape, generation)  -> (fn, [(shape, dtype), ...]) for the deviceless compile
The kernels are loaded the way the tests load them (built package, `kernel_loader.load_kernel`).
An adapter whose kernel has not landed (import or attribute error) reports `available() == False`
and its rows are left out of the results, never faked.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ADAPTERS", "load"]


_JAX_ONLY: list[Path] = []  # set by use_jax_only_packages(): the folder the packages go in


def use_jax_only_packages(folder: Path) -> None:
    """Load the kernels without torch from now on (a TPU VM with JAX and no torch: the device
    run of benchmarks/device_timing.py). Must come before the first `load`."""
    if load.cache_info().currsize:
        raise RuntimeError("use_jax_only_packages() after a kernel was already loaded")
    _JAX_ONLY[:] = [Path(folder)]


@functools.cache
def load(key: str):
    if _JAX_ONLY:
        return _jax_only_package(key, _JAX_ONLY[0])
    import kernel_loader

    return kernel_loader.load_kernel(key)


def _jax_only_package(key: str, folder: Path):
    """kernels/<key> with the vendored torch-ext files (the same file set scripts/build.py
    packages), written to `folder` under an `__init__` that imports only the JAX modules: the
    Pallas kernels, their tiling and the f32 references; the torch op wrappers are left out."""
    import importlib.util
    import sys

    import build
    import collection

    entry = collection.load_collection().kernel(key)
    name = f"ptk_jax_{key}"
    pkg = Path(folder) / name
    pkg.mkdir(parents=True, exist_ok=True)
    for rel, data in build.package_sources(entry).items():
        if rel != "__init__.py":
            (pkg / rel).write_bytes(data)
    (pkg / "__init__.py").write_text("from . import kernel, reference, tiling\n")
    spec = importlib.util.spec_from_file_location(
        name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the package's relative imports find it here
    spec.loader.exec_module(module)
    return module


def _random(key_int, shape, dtype):
    import jax
    import jax.numpy as jnp

    return jax.random.normal(jax.random.key(key_int), shape, jnp.float32).astype(jnp.dtype(dtype))


class Adapter:
    key = ""
    label = ""
    needs = ()  # (submodule, attribute) pairs that must exist
    # Whether tiling.estimate_cost's hbm_bytes includes the scalar-prefetched tables (the counter
    # reports those separately as prefetch_bytes).
    prefetch_in_estimate = False

    def available(self) -> tuple[bool, str]:
        try:
            mod = load(self.key)
            for sub, attr in self.needs:
                getattr(getattr(mod, sub), attr)
        except Exception as e:  # not landed yet, or broken: leave the rows out and say why
            return False, f"{type(e).__name__}: {e}"[:300]
        return True, ""

    @property
    def mod(self):
        return load(self.key)


class RaggedDot(Adapter):
    key = "ragged_dot"
    label = "ours: gmm"
    needs = (("kernel", "gmm"), ("tiling", "estimate_cost"))
    prefetch_in_estimate = False  # estimate_cost(count_work_list=False): BlockSpec copies only

    def small_tiles(self):
        return self.mod.tiling.GmmTiling(tm=16, tk=128, tn=128)

    def tiles(self, shape, generation):
        """The kernel's own choice: gmm picks its tiles knowing the number of groups."""
        return self.mod.tiling.gmm_tiling(
            shape.m,
            shape.k,
            shape.n,
            shape.dtype,
            shape.dtype,
            shape.dtype,
            num_groups=shape.experts,
            generation=generation,
        )

    def cost(self, shape, generation, tiles=None):
        t = tiles or self.tiles(shape, generation)
        c = self.mod.tiling.estimate_cost(
            "gmm",
            (shape.m, shape.k),
            (shape.experts, shape.k, shape.n),
            shape.group_sizes,
            lhs_dtype=shape.dtype,
            rhs_dtype=shape.dtype,
            out_dtype=shape.dtype,
            tiling=t,
            generation=generation,
        )
        return c, {"tiling": [t.tm, t.tk, t.tn], "notes": []}

    def call(self, shape, generation, tiles=None):
        import jax.numpy as jnp

        lhs = _random(10, (shape.m, shape.k), shape.dtype)
        rhs = _random(11, (shape.experts, shape.k, shape.n), shape.dtype)
        gs = jnp.asarray(shape.group_sizes, jnp.int32)
        gmm = self.mod.kernel.gmm

        def fn(lhs, rhs, gs):
            return gmm(
                lhs, rhs, gs, out_dtype=jnp.dtype(shape.dtype), tiling=tiles, generation=generation
            )

        return fn, (lhs, rhs, gs)

    def compile_args(self, shape, generation):
        import jax.numpy as jnp

        gmm = self.mod.kernel.gmm
        dt = jnp.dtype(shape.dtype)

        def fn(lhs, rhs, gs):
            return gmm(lhs, rhs, gs, out_dtype=dt, generation=generation)

        return fn, [
            ((shape.m, shape.k), dt),
            ((shape.experts, shape.k, shape.n), dt),
            ((shape.experts,), jnp.int32),
        ]

    def schedule_trips(self, shape, generation, tiles=None):
        """Exact trip counts from the kernel's own work list: full row windows (the hot loop's
        iterations; one per column chunk when a weight block is cut along N) and tail windows
        (one bucket region each), over every (N tile, K tile). When the weight block is cut into
        column chunks, a tail's bucket region holds one chunk's matmul inside a loop over the
        chunks: it runs `chunks` times per tail, so each tail counts `chunks` region runs (the
        region's few bundles around that loop are then counted `chunks` times: a slight
        overcount)."""
        t = tiles or self.tiles(shape, generation)
        return gmm_trips(
            self.mod,
            shape.group_sizes,
            shape.m,
            shape.k,
            shape.n,
            shape.dtype,
            t,
            generation,
            per_step=True,
        )


def _work_list(T, group_sizes, m: int, tm: int, unit: int, kind: str) -> dict:
    """The kernel's work list for concrete group sizes (`T`: the family's tiling module), as
    named fields."""
    wl = T.work_list(
        np.asarray(group_sizes, np.int32),
        m=m, tm=tm, buckets=T.bucket_sizes(tm, unit), unit=unit, kind=kind,
    )  # fmt: skip
    return T._fields(wl)


# The gmm calls a ragged row's shape stands for besides the plain forward (tile_sweep.py
# --scheduled --pass): "dlhs", the lhs gradient (dout [M, N] times the forward's weights [G, K, N]
# read with transpose_rhs, -> [M, K]); "int8", the forward with int8 weights and f32 scales
# [G, N]; "gated", the gate_up gmm with its SiLU gate fused (concatenated layout: weights
# [G, K, N], N / 2 output columns).
GMM_VARIANTS = ("gmm", "dlhs", "int8", "gated")


def gmm_variant(shape, variant: str):
    """(the shape as `variant`'s gmm sees it, K its contraction and N its output columns; the
    call's options: `rhs_dtype`, `transpose_rhs`, `gate_layout`)."""
    import dataclasses

    if variant == "gmm":
        return shape, {}
    if variant == "dlhs":
        return dataclasses.replace(shape, k=shape.n, n=shape.k), {"transpose_rhs": True}
    if variant == "int8":
        return shape, {"rhs_dtype": "int8"}
    if variant == "gated":
        return dataclasses.replace(shape, n=shape.n // 2), {"gate_layout": "concatenated"}
    raise ValueError(f"variant must be one of {GMM_VARIANTS}, got {variant!r}")


def gmm_variant_tiles(mod, shape, variant: str, generation: str):
    """The tiles the kernel picks for `variant` at `shape` (`gmm_variant`'s problem)."""
    vshape, opts = gmm_variant(shape, variant)
    dt = vshape.dtype
    return mod.tiling.gmm_tiling(
        vshape.m, vshape.k, vshape.n, dt, opts.get("rhs_dtype", dt), dt,
        num_groups=shape.experts, generation=generation, gate_layout=opts.get("gate_layout"),
    )  # fmt: skip


def gmm_variant_row(mod, shape, variant: str, generation: str, tiles=None):
    """(tiles, KernelCost, trips) of `variant` at `shape`: the kernel's own tiles unless given,
    `estimate_cost` and `gmm_trips` of that call; the shape is `gmm_variant`'s."""
    T = mod.tiling
    vshape, opts = gmm_variant(shape, variant)
    m, k, n, dt = vshape.m, vshape.k, vshape.n, vshape.dtype
    rhs_dtype = opts.get("rhs_dtype", dt)
    gate = opts.get("gate_layout")
    t = tiles or gmm_variant_tiles(mod, shape, variant, generation)
    wn = 2 * n if gate else n
    rhs_shape = (shape.experts, wn, k) if opts.get("transpose_rhs") else (shape.experts, k, wn)
    cost = T.estimate_cost(
        "gmm", (m, k), rhs_shape, shape.group_sizes, lhs_dtype=dt, rhs_dtype=rhs_dtype,
        out_dtype=dt, transpose_rhs=bool(opts.get("transpose_rhs")), tiling=t,
        generation=generation, gate_layout=gate,
    )  # fmt: skip
    trips = gmm_trips(
        mod, shape.group_sizes, m, k, n, dt, t, generation, per_step=True,
        rhs_dtype=rhs_dtype, gate_layout=gate,
    )  # fmt: skip
    return t, cost, trips


def gmm_trips(
    mod, group_sizes, m, k, n, dtype, t, generation=None, per_step=False, *,
    rhs_dtype=None, gate_layout=None,
) -> dict:  # fmt: skip
    """`RaggedDot.schedule_trips` for any gmm call: the ragged_dot package `mod`, the call's
    group sizes, problem size (n: output columns) and dtype (`rhs_dtype`: the weights', when
    they differ; `gate_layout`: a fused gate's), its tiling `t` and the generation it compiles
    for (the window columns depend on it). `per_step`: also each grid step's work (`step_work`,
    so the schedule overlaps DMA and compute per step)."""
    T, K = mod.tiling, mod.kernel
    unit = T.row_unit(dtype)
    wl = _work_list(T, group_sizes, m, t.tm, unit, "gmm")
    gen = T.get_generation(generation)
    n_rhs, cols = T._weight_blocks(t.tn, gate_layout)
    chunks = cols // K._n_chunk(t.tk, cols, gen, t.tm, unit, n_rhs)
    # the kernel's own per-step work (tiling.gmm_step_work; the tile ranking reads it too, and
    # test_benchmarks checks its copies against the generic BlockSpec model)
    isz = np.dtype(dtype).itemsize
    wsz = np.dtype(rhs_dtype or dtype).itemsize
    prefetch = T.prefetches_runs(k, t.tk, n, t.tn, gen)
    w = T.gmm_step_work(
        wl, k, n, t.tm, t.tk, t.tn, unit, isz, wsz, isz, gate_layout, prefetch_runs=prefetch
    )
    trips = {
        "hot_iterations": float(w["full"].sum() * chunks),
        "side_region_runs": float(w["tail"].sum() * chunks),
    }
    if T._prepared_vregs(k, t.tk, t.tn, gate_layout, dtype, wsz == 1):
        # the weight block widened (or its K tail zeroed) into a VMEM copy: once per busy grid
        # step, or with one K block once per run of a group's items (kernel `_prepare`)
        trips["prepare_runs"] = float(T.work_list_preparations(wl, -(-n // t.tn), -(-k // t.tk)))
    if per_step:
        trips["step_work"] = {
            "hot": w["full"] * chunks,
            "side": w["tail"] * chunks,
            "mxu": w["rows"],
            "reads": w["reads"],
            "writes": w["writes"],
        }
    return trips


def tgmm_trips(mod, group_sizes, m, k, n, dtype, t, generation=None) -> dict:
    """`gmm_trips` for a tgmm call (tiles `t`): full row windows (the hot loop's iterations, one
    per column chunk) and tail windows (one run of their bucket's region per column chunk: the
    kernel emits one region per bucket, in bucket order, and a 16-row bucket's region is a
    quarter of a 512-row one's) over every (K tile, N tile); the empty groups' zero-fills (the
    region before the windows, run only by an empty group's item: `output_tiles`, not every
    step); and each grid step's work (tiling.tgmm_step_work: its windows, MXU rows, copies in
    and write-backs)."""
    T = mod.tiling
    gen = T.get_generation(generation)
    unit = T.row_unit(dtype, dtype)
    wl = _work_list(T, group_sizes, m, t.tm, unit, "tgmm")
    chunks = t.tn // T.window_cols(t.tk, t.tn, gen, t.tm, unit)
    isz = np.dtype(dtype).itemsize
    w = T.tgmm_step_work(wl, k, n, t.tm, t.tk, t.tn, unit, isz, isz, isz, gen.mxu_size)
    buckets = len(T.bucket_sizes(t.tm, unit))
    side = (w["bucket"][:, None] == np.arange(buckets)[None, :]) * float(chunks)
    flags = wl["FLAGS"]
    empty = int((((flags & T.F_FIRST) != 0) & ((flags & T.F_COMPUTE) == 0)).sum())
    return {
        "hot_iterations": float(w["full"].sum() * chunks),
        "side_region_runs": side.sum(axis=0).tolist(),
        "output_tiles": float(empty * -(-k // t.tk) * -(-n // t.tn)),
        "step_work": {
            "hot": w["full"] * chunks,
            "side": side,
            "mxu": w["rows"],
            "reads": w["reads"],
            "writes": w["writes"],
        },
    }


def _window_size(shape):
    # flash-attn convention (left, right); a window of w keys = the query's own key + w-1 before.
    return (shape.window - 1, 0) if shape.window is not None else (-1, -1)


def paged_trips(runs: dict) -> dict:
    """scheduled_from_work's trip counts from the paged kernel's busy steps per compute path
    (tiling.path_runs, program order): per-path runs where it compiles several paths, else the
    one path's hot iterations."""
    if len(runs) == 1:
        return {"hot_iterations": float(sum(runs.values()))}
    return {"branch_runs": [float(r) for r in runs.values()]}


def flash_tile_pushes(tiling, generation, tiles, groups: int, head_dim: int) -> int:
    """MXU pushes of one (G x block_q_compute) x block_kv_compute score tile of the forward, the
    unit its masked tiles and the work list's tile counts come in (an interior item's taller
    tiles, tiling.interior_q_compute, push the same per score)."""
    gen = tiling.get_generation(generation)
    rows = groups * tiles.q_compute
    return tiling.fwd_tile_units(gen, rows, tiles.block_kv_compute, head_dim)["mxu_pushes"]


def flash_branch_pushes(cost, tile_pushes: int) -> dict | None:
    """`branch_pushes` of a flash forward call from its KernelCost: its unmasked tiles' MXU
    pushes (interior path) and its masked tiles' (edge walk), `tile_pushes` a (walk) tile's."""
    if not cost.compute_tiles:
        return None
    masked = cost.masked_tiles * tile_pushes
    return {"branch_pushes": [cost.mxu_pushes - masked, masked]}


class FlashAttention(Adapter):
    key = "flash_attention"
    label = "ours: flash_attention_fwd"
    needs = (("kernel", "flash_attention_fwd"), ("tiling", "estimate_cost"))
    prefetch_in_estimate = True  # its estimate counts the SMEM work list it scalar-prefetches

    def small_tiles(self):
        return self.mod.tiling.Tiles(
            block_q=128, block_kv=256, block_kv_compute=128, block_q_bwd=128, block_kv_bwd=128
        )

    def _tiles(self, shape, generation, tiles=None):
        """The tiles the kernel picks for the shape (or `tiles`)."""
        if tiles:
            return tiles
        T = self.mod.tiling
        picked = T.choose_tiles(
            q_len=shape.seq,
            kv_len=shape.seq,
            num_q_heads=shape.q_heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype=shape.dtype,
            causal=shape.causal,
            window_size=_window_size(shape),
            generation=generation,
            segments=shape.segment_ids() is not None,
        )
        return T.with_fixed_max_kv_compute(generation, picked, shape.softcap, False)

    def cost(self, shape, generation, tiles=None):
        ids = shape.segment_ids()
        t = self._tiles(shape, generation, tiles)
        rows = None if ids is None else np.broadcast_to(ids, (shape.batch, shape.seq))
        c = self.mod.tiling.estimate_cost(
            batch=shape.batch,
            num_q_heads=shape.q_heads,
            num_kv_heads=shape.kv_heads,
            q_len=shape.seq,
            kv_len=shape.seq,
            head_dim=shape.head_dim,
            dtype=shape.dtype,
            causal=shape.causal,
            window_size=_window_size(shape),
            tiles=t,
            generation=generation,
            pass_="fwd",
            q_segment_ids=rows,
            kv_segment_ids=rows,
        )
        notes = ["writes lse (f32 per row) for the backward"]
        if ids is not None:
            notes.append(
                "segment ids: block pairs between documents leave the work list (no step, no DMA)"
            )
        return c, {
            "tiling": [t.block_q, t.q_compute, t.block_kv, t.block_kv_compute],
            "notes": notes,
        }

    def hot_iteration_flops(self, shape, generation):
        """MXU FLOPs of one iteration of the forward's interior loop: the q compute tiles it
        unrolls (kernel.INTERIOR_Q_UNROLL when a stacked tile is at most 512 x 512) against the
        whole kv block, QK^T and PV. Edge and masked tiles run in other loops at up to ~1.2x the
        interior's bundles per tile; the model charges every tile at the interior's rate."""
        _, info = self.cost(shape, generation)
        block_q, q_compute, block_kv, kv_compute = info["tiling"]
        groups = shape.q_heads // shape.kv_heads
        unroll = self.mod.kernel.INTERIOR_Q_UNROLL
        small = (
            groups * q_compute * kv_compute <= 512 * 512 and (block_q // q_compute) % unroll == 0
        )
        return 4.0 * groups * q_compute * block_kv * shape.head_dim * (unroll if small else 1)

    def schedule_trips(self, shape, generation, tiles=None):
        """MXU pushes the call runs on each of the forward step's two paths (kernel.py: the
        interior path, for items the band covers whole, then the edge walk): unmasked tiles at
        the interior path's bundles per push, masked tiles at the edge walk's (its masked
        groups, remainders and the q-tile loop around them, averaged over its static pushes).
        Unmasked tiles of edge items also run in the walk, at nearly the interior's rate (its
        mask-free group loop). With segment ids the step runs the edge walk only: a rolled loop
        over a q tile's kv slices, one masked tile per iteration (its hot loop), so the call's
        hot iterations are its live tiles (`hot_iterations`; a slice whose documents miss the
        q tile's is skipped inside the iteration, its few bundles not charged).
        `step_work`: the same per grid step (`step_work`)."""
        cost = self.cost(shape, generation, tiles)[0]
        if shape.segment_ids() is not None:
            trips = {"hot_iterations": float(cost.compute_tiles)}  # no interior path: walk tiles
        else:
            t = self._tiles(shape, generation, tiles)
            G = shape.q_heads // shape.kv_heads
            pushes = flash_tile_pushes(self.mod.tiling, generation, t, G, shape.head_dim)
            trips = flash_branch_pushes(cost, pushes)
        if trips is not None:
            trips["step_work"] = self.step_work(shape, generation, tiles, cost)
            # a q block's init and write-out run once per run of its items (the LAST item)
            trips["output_tiles"] = float(
                sum(t["output_tiles"] for t in trips["step_work"]["trips"])
            )
            trips["output_loop_trips"] = trips["step_work"]["trips"][0]["output_loop_trips"]
        return trips

    def _fwd_items(self, shape, generation, tiles=None) -> dict:
        """The forward's work list(s) as the kernel builds them (kernel._items, from the padded
        lengths, the band and the padded segment ids as kernel._prepare makes them): "fields",
        {QI, KI, SEQ, FLAGS} as [lists, steps] (one list for the batch, or one per batch row
        with segment ids: the grid walks `steps` items of each, a shorter row's tail repeating
        its last item's blocks with no flags), "layout" / "flat" (the SMEM array, for the index
        maps' reads), and what the tile counting needs (seqs, band, tiles, segment-id ranges
        per compute tile where the kernel holds them)."""
        K, T = self.mod.kernel, self.mod.tiling
        t = self._tiles(shape, generation, tiles)
        B, Hkv, D = shape.batch, shape.kv_heads, shape.head_dim
        bq, bk = t.block_q, t.block_kv
        Sq = K._round_up(shape.seq, t.q_multiple)
        Sk = K._round_up(shape.seq, t.kv_multiple)
        seqs = K._seq_table_dense(shape.seq, shape.seq)
        band = K.Band.make(shape.causal, *_window_size(shape))
        prob = K._Problem(
            B, Hkv, shape.q_heads // Hkv, Sq, Sk, D, band, 1.0, shape.softcap or 0.0, 1, None
        )
        ids = shape.segment_ids()
        qseg = kseg = tables = None
        if ids is not None:
            rows = np.broadcast_to(np.asarray(ids, np.int32), (B, shape.seq))
            qseg = np.pad(rows, ((0, 0), (0, Sq - shape.seq)), constant_values=-1)
            kseg = np.pad(rows, ((0, 0), (0, Sk - shape.seq)), constant_values=-2)
            if T.tile_ranges_fit(B, Sq // t.q_compute, Sk // t.block_kv_compute):
                tables = (
                    *K._segment_ranges(qseg, t.q_compute),
                    *K._segment_ranges(kseg, t.block_kv_compute),
                )
        flat, layout, steps = K._items(seqs, prob, Sq // bq, Sk // bk, bq, bk, False, qseg, kseg)
        flat = np.asarray(flat)
        n_lists = flat.size // (K.LAYOUT.n_fields * layout.n_items)
        lists = np.arange(n_lists)[:, None]
        fields = {
            name: np.asarray(layout.field(flat, lists, np.arange(steps)[None, :], name))
            for name in K.LAYOUT.fields
        }
        return dict(
            fields=fields,
            flat=flat,
            layout=layout,
            steps=steps,
            seqs=tuple(np.asarray(a, np.int64) for a in seqs),
            band=band,
            tiles=t,
            tables=tables,
            segments=ids is not None,
            Sq=Sq,
            Sk=Sk,
        )

    def step_work(self, shape, generation, tiles=None, cost=None) -> dict:
        """scheduled_from_work's `step_work` of the forward: one grid step per (batch row, KV
        head, work item), in grid order (B, Hkv, items). "trips": the step's own trip counts as
        `schedule_trips` counts the call's (its item's unmasked and masked tiles' MXU pushes on
        the interior / edge paths, or with segment ids its live tiles as hot iterations), from
        tiling.count_tiles on the item alone, so they add up to the call's; "hot": its live
        tiles; "mxu": their MXU FLOPs; "reads" / "writes": the copies of the kernel's
        BlockSpecs (kernel._forward's index maps on the list: q block and o / lse by QI, k and
        v blocks by KI, each with the batch row and KV head; the segment-id blocks by QI / KI
        with the batch row only), blockspec_model.step_copies; the scalar-prefetched list,
        sequence table and tile ranges arrive before the first step (its reads). The bytes add
        up to estimate_cost's hbm_bytes (`cost`: the call's, when the caller has it)."""
        from blockspec_model import Operand, step_copies

        T = self.mod.tiling
        w = self._fwd_items(shape, generation, tiles)
        t, f, tables = w["tiles"], w["fields"], w["tables"]
        B, Hkv, D = shape.batch, shape.kv_heads, shape.head_dim
        G = shape.q_heads // Hkv
        bq, bk, bqc, bkc = t.block_q, t.block_kv, t.q_compute, t.block_kv_compute
        n_lists, steps = f["QI"].shape
        # Each item's (live, masked) tiles, counted on it alone (the lists' other items empty),
        # per batch row where the rows differ (a list each, or the rows' own tile ranges).
        rows = B if tables is not None else n_lists
        live = np.zeros((rows, steps))
        masked = np.zeros((rows, steps))
        stack = np.stack([f[name] for name in self.mod.kernel.LAYOUT.fields], axis=1)
        empty = np.zeros((4, 0), np.int32)
        for b in range(rows):
            for i in range(steps):
                one = [empty] * b + [stack[min(b, n_lists - 1), :, i : i + 1]]
                live[b, i], masked[b, i], _ = T.count_tiles(
                    one, w["seqs"], w["band"], bq, bqc, bk, bkc, tables, w["segments"]
                )
        # grid order (B, Hkv, items); one list serves every batch row
        per_step = lambda a: np.repeat(  # noqa: E731
            np.broadcast_to(a, (B, steps))[:, None, :], Hkv, axis=1
        ).ravel()
        live, masked = per_step(live), per_step(masked)
        cost = cost or self.cost(shape, generation, tiles)[0]
        # per (bqc x bkc) tile, the unit the counts come in (the interior's taller tiles too)
        per_tile = flash_tile_pushes(T, generation, t, G, D)
        tile_flops = cost.mxu_flops / live.sum() if live.sum() else 0.0
        # a q block's runs end on its LAST item: init and write-out once per run, each head's
        # write-out loop (kernel._normalise_and_store) by its iterations
        K = self.mod.kernel
        last = per_step((np.asarray(f["FLAGS"]) & K.LAST) != 0)
        out = {
            "output_loop_trips": float(K.finish_unroll(bq)[1]) if bq % K.FINISH_ROWS == 0 else 1.0
        }
        if w["segments"]:
            trips = [
                {"hot_iterations": float(n), "output_tiles": float(e), **out}
                for n, e in zip(live, last)
            ]
        else:
            trips = [
                {
                    "branch_pushes": [float((n - m) * per_tile), float(m * per_tile)],
                    "output_tiles": float(e),
                    **out,
                }
                for n, m, e in zip(live, masked, last)
            ]
        isz = np.dtype(shape.dtype).itemsize
        flat, layout = w["flat"], w["layout"]
        # the kernel's index maps read the list (one list: every batch row reads it)
        qb = lambda b, i: layout.field(flat, b, i, "QI")  # noqa: E731
        kb = lambda b, i: layout.field(flat, b, i, "KI")  # noqa: E731
        ops = [
            Operand("q", G * bq * D * isz, lambda b, h, i: (b, h, qb(b, i))),
            Operand("k", bk * D * isz, lambda b, h, i: (b, h, kb(b, i))),
            Operand("v", bk * D * isz, lambda b, h, i: (b, h, kb(b, i))),
            Operand("o", G * bq * D * isz, lambda b, h, i: (b, h, qb(b, i)), True),
            Operand("lse", G * bq * 4, lambda b, h, i: (b, h, qb(b, i)), True),
        ]
        if w["segments"]:
            ops += [
                Operand("q_ids", bq * T.NUM_LANES * 4, lambda b, h, i: (b, qb(b, i))),
                Operand("kv_ids", T.NUM_SUBLANES * bk * 4, lambda b, h, i: (b, kb(b, i))),
            ]
        reads, writes = step_copies((B, Hkv, steps), ops)
        # scalar prefetch: the list(s) and the sequence table; with segment ids the tile ranges
        reads[0] += 4 * flat.size + 5 * 4 * len(w["seqs"][0])
        if tables is not None:
            reads[0] += B * (w["Sq"] // bqc + w["Sk"] // bkc) * 2 * 4
        return {
            "trips": trips,
            "hot": live,
            "mxu": live * tile_flops,
            "reads": reads,
            "writes": writes,
        }

    def _fn(self, shape, generation, tiles=None):
        fwd = self.mod.kernel.flash_attention_fwd
        ids = shape.segment_ids()
        # numpy, not jnp: built eagerly, a jax array would need a device (none in a deviceless lowering)
        rows = None if ids is None else np.broadcast_to(np.asarray(ids), (shape.batch, shape.seq))

        def fn(q, k, v):
            o, _ = fwd(
                q,
                k,
                v,
                causal=shape.causal,
                window_size=_window_size(shape),
                softcap=shape.softcap or 0.0,
                tiles=tiles,
                generation=generation,
                q_segment_ids=rows,
                kv_segment_ids=rows,
            )
            return o

        return fn

    def call(self, shape, generation, tiles=None):
        qs = (shape.batch, shape.q_heads, shape.seq, shape.head_dim)
        kvs = (shape.batch, shape.kv_heads, shape.seq, shape.head_dim)
        return self._fn(shape, generation, tiles), (
            _random(20, qs, shape.dtype),
            _random(21, kvs, shape.dtype),
            _random(22, kvs, shape.dtype),
        )

    def compile_args(self, shape, generation, tiles=None):
        """(fn, avals) of the named row's forward at the kernel's own tiles (or `tiles`)."""
        import jax.numpy as jnp

        dt = jnp.dtype(shape.dtype)
        qs = (shape.batch, shape.q_heads, shape.seq, shape.head_dim)
        kvs = (shape.batch, shape.kv_heads, shape.seq, shape.head_dim)
        return self._fn(shape, generation, tiles), [(qs, dt), (kvs, dt), (kvs, dt)]


class PagedAttention(Adapter):
    key = "paged_attention"
    label = "ours: ragged_paged_attention"
    needs = (("kernel", "ragged_paged_attention"), ("tiling", "estimate_cost"))
    prefetch_in_estimate = True  # kv_lens, cu_q_lens, page table and work list in SMEM

    def small_tiles(self):
        return self.mod.tiling.PagedAttentionConfig(block_q=8, pages_per_block=4)

    def _traffic_args(self, shape) -> dict:
        """The call as tiling.traffic / estimate_cost take it (without generation and tiles)."""
        return dict(
            q_lens=[q for q, _ in shape.seqs],
            kv_lens=[kv for _, kv in shape.seqs],
            num_q_heads=shape.q_heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            pages_per_seq=shape.pages_per_seq,
            q_dtype=shape.dtype,
            kv_dtype=shape.cache_dtype,
            sliding_window=shape.window,
            token_major=shape.layout == "token_major",
            token_scales=shape.token_scales,
            head_scales=shape.head_scales,
        )

    def cost(self, shape, generation, tiles=None):
        c = self.mod.tiling.estimate_cost(
            **self._traffic_args(shape), generation=generation, config=tiles
        )
        cfg = self._config(shape, generation, tiles)
        return c, {
            "tiling": [cfg.block_q, cfg.pages_per_block],
            "notes": ["the new tokens' KV cache write (write_kv) is a separate call, not counted"],
        }

    def _config(self, shape, generation, tiles=None):
        """The tiles the kernel picks for the shape (the default when `tiles` is None)."""
        return self.mod.tiling.choose_config(
            num_tokens=shape.q_tokens,
            num_q_heads=shape.q_heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            pages_per_seq=shape.pages_per_seq,
            q_dtype=shape.dtype,
            kv_dtype=shape.cache_dtype,
            generation=generation,
            config=tiles,
            token_major=shape.layout == "token_major",
            token_scales=shape.token_scales,
        )

    def _work_list(self, shape, generation, tiles=None):
        """The work list the kernel builds for the shape at its default tiles (or `tiles`;
        host_work_list), with the tiles and the q block's rows."""
        T = self.mod.tiling
        cfg = self._config(shape, generation, tiles)
        rows = cfg.block_q * (shape.q_heads // shape.kv_heads)
        items = T.host_work_list(
            [q for q, _ in shape.seqs],
            [kv for _, kv in shape.seqs],
            block_q=cfg.block_q,
            num_q_blocks=-(-max(shape.q_tokens, 1) // cfg.block_q),
            page_size=shape.page_size,
            pages_per_block=cfg.pages_per_block,
            sliding_window=shape.window,
            causal=True,
        )
        return items, cfg, rows

    def step_loops(self, shape, generation, tiles=None, items=None, call_first=True) -> dict:
        """The kernel's rolled loops outside its compute paths by name, program order, with
        their iterations over the call (or over `items`, part of its work list, which starts
        with the call's first item where `call_first`): "item", an
        item's, and "block", its grid step's around the item loop (tiling.step_loop_trips;
        schedule_model.align_loop_trips puts them on the compiled loops)."""
        T = self.mod.tiling
        call_items, cfg, rows = self._work_list(shape, generation, tiles)
        items = call_items if items is None else items
        group = shape.q_heads // shape.kv_heads
        token_major = shape.layout == "token_major"
        return T.step_loop_trips(
            items,
            [kv for _, kv in shape.seqs],
            rows=rows,
            out_dtype=shape.dtype,
            kv_dtype=shape.cache_dtype,
            num_kv_heads=shape.kv_heads,
            token_major=token_major,
            page_size=shape.page_size,
            pages_per_block=cfg.pages_per_block,
            spread_matrix=shape.token_scales
            and token_major
            and T.quad_heads(
                shape.cache_dtype, shape.kv_heads, group, T.narrow_rows(group, rows), True
            ),
            call_first=call_first,
        )

    def schedule_trips(self, shape, generation, tiles=None):
        """Steps per compute path, from the kernel's own work list (tiling.path_runs): an item
        whose rows sit in one narrow slice of its q block (a decode token's G heads) takes the
        narrow path, in its compact form (KV-head pairs or 8-bit quads) where that is compiled
        and the item holds at most tiling.compact_rows rows; any other item with pages the
        whole-q-block path (tiling.compute_paths gives the program order). Empty items take
        none. Each q block's grid step loops over its items (`work_items`: the list's items);
        the item's rolled loops (page DMA issue and wait, stale-slot zeroing) and the grid
        step's (the q block's init and write-back) are charged by their iterations over the
        call (`step_loops`). `step_work`: the same per grid step, with each step's MXU work and
        copies, so the schedule overlaps a DMA-bound decode q block and compute-bound prefill
        q blocks step by step rather than pooled (`step_work`)."""
        items, _, _ = self._work_list(shape, generation, tiles)
        return {
            **self._trips(shape, generation, tiles, items),
            "step_work": self.step_work(shape, generation, tiles),
        }

    def _path_runs(self, shape, generation, tiles, items) -> dict:
        """tiling.path_runs of `items` (the call's work list or part of it)."""
        T = self.mod.tiling
        _, cfg, rows = self._work_list(shape, generation, tiles)
        group = shape.q_heads // shape.kv_heads
        narrow = T.narrow_rows(group, rows)
        compact = T.compact_rows(
            shape.cache_dtype,
            shape.kv_heads,
            shape.layout == "token_major",
            group,
            narrow,
            token_scales=shape.token_scales,
        )
        return T.path_runs(
            items,
            [q for q, _ in shape.seqs],
            block_q=cfg.block_q,
            group=group,
            narrow=narrow,
            compact=compact,
        )

    def _trips(self, shape, generation, tiles, items, runs=None, call_first=True) -> dict:
        """scheduled_from_work's trip counts of `items` (the call's work list, or one grid
        step's items, the call's first among them where `call_first`; `runs`: their
        `_path_runs` where the caller has them)."""
        loops = self.step_loops(shape, generation, tiles, items, call_first)
        runs = runs if runs is not None else self._path_runs(shape, generation, tiles, items)
        return {
            **paged_trips(runs),
            "work_items": float(len(items)),
            "loop_trips": loops["item"],
            "block_loop_trips": loops["block"],
        }

    def step_work(self, shape, generation, tiles=None) -> dict:
        """scheduled_from_work's `step_work`: one grid step per q block, from the kernel's work
        list (each q block's items, in order). "trips": the step's own trip counts as
        `schedule_trips` counts the call's (`_trips` of its items; the quad path's spreading
        matrix is written by the first step only), which add up to the call's; "hot": its busy
        items; "mxu": the MXU FLOPs of its items' paths (tiling.traffic's rule); the bytes it
        moves (tiling.traffic's, item by item, tiling.page_copy_plan): "reads", its q block and
        its first item's KV pages (and scales, streamed page-table row), started under the step
        before (kernel.py: item i + 1's pages are fetched while item i computes, across q
        blocks), "streams", its other items' pages, fetched under its own items, "writes", its
        output block. The call's scalar-prefetched tables (and head scales, sinks) arrive
        before the first step: its reads. The bytes add up to estimate_cost's hbm_bytes."""
        T = self.mod.tiling
        items, cfg, rows = self._work_list(shape, generation, tiles)
        t = T.traffic(**self._traffic_args(shape), generation=generation, config=tiles)
        group = shape.q_heads // shape.kv_heads
        narrow = T.narrow_rows(group, rows)
        hkv, d, page = shape.kv_heads, shape.head_dim, shape.page_size
        kv_size = np.dtype(shape.cache_dtype).itemsize
        qo_block = hkv * rows * d * np.dtype(shape.dtype).itemsize
        tile = T.copy_tile(shape.cache_dtype, hkv, shape.layout == "token_major")
        kv_lens = [kv for _, kv in shape.seqs]

        def item_bytes(item) -> int:
            _, seq, first, npages = item
            pt = 4 * shape.pages_per_seq if t["stream_page_table"] else 0
            if not npages:
                return pt
            _, tokens = T.page_copy_plan(
                kv_lens[seq], first, npages, page, shape.cache_dtype, tile=tile
            )
            scales = 2 * npages * hkv * page * 4 if shape.token_scales else 0
            return tokens * 2 * hkv * d * kv_size + scales + pt

        q_blocks = sorted({it[0] for it in items})
        steps = {k: [] for k in ("trips", "hot", "mxu", "reads", "streams", "writes")}
        for b in q_blocks:
            mine = [it for it in items if it[0] == b]
            runs = self._path_runs(shape, generation, tiles, mine)
            trips = self._trips(shape, generation, tiles, mine, runs, b == q_blocks[0])
            if "spread_matrix" in trips["block_loop_trips"] and b != q_blocks[0]:
                trips["block_loop_trips"]["spread_matrix"] = 0
            steps["trips"].append(trips)
            steps["hot"].append(float(sum(runs.values())))
            steps["mxu"].append(
                float(
                    T.runs_mxu_flops(
                        runs,
                        num_kv_heads=hkv,
                        rows=rows,
                        narrow=narrow,
                        kv_tokens=cfg.pages_per_block * page,
                        head_dim=d,
                    )
                )
            )
            copied = [item_bytes(it) for it in mine]
            steps["reads"].append(float(qo_block + copied[0]))
            steps["streams"].append(float(sum(copied[1:])))
            steps["writes"].append(float(qo_block))
        steps["reads"][0] += float(
            t["smem_bytes"]
            + t["sink_bytes"]
            + t["head_scale_bytes"]
            + t["write_bytes"]
            + t["write_slot_bytes"]
        )
        return {k: v if k == "trips" else np.asarray(v) for k, v in steps.items()}

    def _fn(self, shape, generation, tiles=None):
        kern = self.mod.kernel
        opts = dict(sliding_window=shape.window, config=tiles, generation=generation)
        if shape.layout == "token_major":
            if shape.kv_dtype is not None:
                names = (
                    ("k_scale", "v_scale")
                    if shape.token_scales
                    else ("k_head_scale", "v_head_scale")
                )

                def fn(q, k, v, kv_lens, page_table, cu_q_lens, num_seqs, k_scale, v_scale):
                    return kern.paged_attention_token_major(
                        q, k, v, kv_lens, page_table, cu_q_lens, num_seqs,
                        **dict(zip(names, (k_scale, v_scale))), **opts,
                    )  # fmt: skip

                return fn

            def fn(q, k, v, kv_lens, page_table, cu_q_lens, num_seqs):
                return kern.paged_attention_token_major(
                    q, k, v, kv_lens, page_table, cu_q_lens, num_seqs, **opts
                )

            return fn

        def fn(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs):
            return kern.ragged_paged_attention(
                q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, **opts
            )

        return fn

    def _avals(self, shape):
        import jax.numpy as jnp

        n = len(shape.seqs)
        dt = jnp.dtype(shape.dtype)
        pages = n * shape.pages_per_seq
        q = ((shape.q_tokens, shape.q_heads, shape.head_dim), dt)
        meta = [
            ((n,), jnp.int32),
            ((n, shape.pages_per_seq), jnp.int32),
            ((n + 1,), jnp.int32),
            ((1,), jnp.int32),
        ]
        if shape.layout == "token_major":
            cache = (
                (pages, shape.page_size, shape.kv_heads, shape.head_dim),
                jnp.dtype(shape.cache_dtype),
            )
            scales = []
            if shape.token_scales:
                scales = [((pages, shape.kv_heads, shape.page_size), jnp.float32)] * 2
            elif shape.head_scales:
                scales = [((shape.kv_heads,), jnp.float32)] * 2
            return [q, cache, cache, *meta, *scales]
        return [
            q,
            ((pages, 2 * shape.kv_heads, shape.page_size, shape.head_dim), dt),
            *meta,
        ]

    def call(self, shape, generation, tiles=None):
        import jax.numpy as jnp

        av = self._avals(shape)
        n = len(shape.seqs)
        page_table = np.arange(n * shape.pages_per_seq, dtype=np.int32).reshape(n, -1)
        kv_lens = np.asarray([kv for _, kv in shape.seqs], np.int32)
        cu = np.concatenate([[0], np.cumsum([q for q, _ in shape.seqs])]).astype(np.int32)
        meta = (
            jnp.asarray(kv_lens),
            jnp.asarray(page_table),
            jnp.asarray(cu),
            jnp.asarray([n], jnp.int32),
        )
        q = _random(30, av[0][0], shape.dtype)
        if shape.layout != "token_major":
            return self._fn(shape, generation, tiles), (
                q,
                _random(31, av[1][0], shape.dtype),
                *meta,
            )
        caches = []
        for key in (31, 32):
            x = _random(key, av[1][0], "float32")
            if shape.kv_dtype == "int8":
                x = jnp.clip(jnp.round(x * 32.0), -127, 127)
            caches.append(x.astype(jnp.dtype(shape.cache_dtype)))
        scales = ()
        if shape.kv_dtype is not None:
            scales = (
                jnp.full(av[-1][0], 1.0 / 32.0 if shape.kv_dtype == "int8" else 1.0, jnp.float32),
            ) * 2
        return self._fn(shape, generation, tiles), (q, *caches, *meta, *scales)

    def compile_args(self, shape, generation):
        return self._fn(shape, generation), self._avals(shape)


ADAPTERS = {
    "ragged_dot": RaggedDot(),
    "flash_attention": FlashAttention(),
    "paged_attention": PagedAttention(),
}
