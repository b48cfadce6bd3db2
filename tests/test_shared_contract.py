"""The shared contract every kernel family satisfies, one test base run over every family (as
tokamax runs one test base per op over every implementation).

- Work list (torch-ext/work_list.py): each family's host-side schedule module (`schedule.py`)
  declares its records as a `RecordLayout` with named fields; its one builder runs with `xp=np`
  (host) and `xp=jnp` (traced) and both give the same items; records decode by name, the kernel's
  SMEM addressing (`LAYOUT.read`) agrees with the decoding, and flagged lists use only the shared
  flag bits with their shared meaning. No family defines flag bits of its own.
- Tile policy (torch-ext/tpu_generations.py): every family's VMEM budget comes from
  `vmem_budget_bytes(gen, family)` (changing it there changes the family's default tiles), the
  default tiles fit it, and `estimate_cost(..., generation=...)` returns the shared KernelCost.
- Modules: every module of every family imports, and the import graph of each package (its own
  files plus the vendored torch-ext files) has no cycle.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import kernel_loader

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = sorted(p.parent.name for p in (ROOT / "kernels").glob("*/kernel.py"))
GENERATIONS = ("v5e", "v6e", "tpu7x")


def _package(family):
    return kernel_loader.load_kernel(family)


def _shared(family, name):
    """The package's vendored copy of a torch-ext module (work_list, tpu_generations)."""
    return importlib.import_module(f"{_package(family).__name__}.{name}")


def compile_gmm_tiles(generation: str, shape: str, tiles):
    """Compile target for benchmarks/llo_schedule.dump_schedule: our gmm at the named ragged
    benchmark shape with explicit tiles (tm, tk, tn). The gmm points of the tile-ranking
    calibration (tile_model_calibration.json, "gmm_points") were dumped with it."""
    import jax
    import jax.numpy as jnp

    import ours
    import schedule_targets
    import tpu_compile

    s = schedule_targets._shape("ragged_dot", shape)
    mod = ours.ADAPTERS["ragged_dot"].mod
    t = mod.tiling.GmmTiling(*tiles)
    dt = jnp.dtype(s.dtype)

    def fn(lhs, rhs, gs):
        return mod.kernel.gmm(lhs, rhs, gs, out_dtype=dt, tiling=t, generation=generation)

    avals = [((s.m, s.k), dt), ((s.experts, s.k, s.n), dt), ((s.experts,), jnp.int32)]
    with jax.default_device(tpu_compile.tpu_device(generation)):
        return tpu_compile.lower_for(generation, fn, *avals).compile()


def test_every_family_is_covered():
    assert FAMILIES == sorted(ADAPTERS), "add the new family's adapter to this contract test"


# -------------------------------------------------------------------------------------------------
# Per-family adapters: one small problem each, the rest of the file is family-agnostic
# -------------------------------------------------------------------------------------------------


class RaggedDot:
    out_field = "OUT"
    gs = np.array([5, 0, 37, 1, 0, 90, 3], np.int32)

    def lists(self, pkg, xp):
        s = pkg.schedule
        kw = dict(m=160, tm=32, buckets=s.bucket_sizes(32, 8), unit=8, kind="gmm")
        return s.work_list(xp.asarray(self.gs), xp=xp, **kw), s.work_list_length(160, 32, 7)

    problem = dict(
        kind="gmm", m=2048, k=1024, n=2048, lhs_dtype="bfloat16", rhs_dtype="bfloat16", num_groups=8
    )

    def cost(self, pkg, generation, tiles=None):
        return pkg.tiling.estimate_cost(
            "gmm",
            (2048, 1024),
            (8, 1024, 2048),
            np.full(8, 256),
            generation=generation,
            tiles=tiles,
        )


class FlashAttention:
    out_field = "QI"
    cq = np.array([0, 13, 13, 70, 96], np.int32)
    ck = np.array([0, 20, 25, 80, 100], np.int32)

    def lists(self, pkg, xp):
        s = pkg.schedule
        seqs = tuple(
            xp.asarray(a)
            for a in (
                self.cq[:-1],
                self.cq[1:],
                self.ck[:-1],
                self.ck[1:],
                self.cq[1:] - self.ck[1:],
            )
        )
        band = s.Band.make(True, 20, -1)
        bound = s.max_work_items(4, 7, 4)
        return (
            s.build_work_list(
                seqs,
                7,
                4,
                16,
                32,
                band,
                kv_major=False,
                xp=xp,
                max_items=None if xp is np else bound,
            ),
            bound,
        )

    problem = dict(
        q_len=4096,
        kv_len=4096,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        causal=True,
    )

    def cost(self, pkg, generation, tiles=None):
        return pkg.tiling.estimate_cost(batch=1, generation=generation, tiles=tiles, **self.problem)


class PagedAttention:
    out_field = None  # no flags: a q block's items end where the builder's block ends say
    q_lens = np.array([1, 1, 30, 0, 9], np.int32)
    kv_lens = np.array([17, 40, 64, 5, 9], np.int32)
    kw = dict(
        block_q=8, num_q_blocks=6, page_size=8, pages_per_block=2, sliding_window=None, causal=True
    )

    def lists(self, pkg, xp):
        s = pkg.schedule
        cu = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
        bound = s.max_items_bound(
            num_q_blocks=6, max_num_seqs=5, pages_per_seq=8, pages_per_block=2
        )
        work, block_ends = s.build_work_list(
            xp.asarray(self.kv_lens),
            xp.asarray(cu),
            xp.asarray(np.array([5], np.int32)),
            xp=xp,
            max_items=None if xp is np else bound,
            **self.kw,
        )
        assert int(block_ends[-1]) <= bound
        return work, bound

    problem = dict(
        num_tokens=520,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pages_per_seq=64,
        q_dtype="bfloat16",
        kv_dtype="bfloat16",
    )

    def cost(self, pkg, generation, tiles=None):
        return pkg.tiling.estimate_cost(
            q_lens=[1] * 8 + [512],
            kv_lens=[1024] * 8 + [512],
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            page_size=16,
            pages_per_seq=64,
            generation=generation,
            tiles=tiles,
        )


ADAPTERS = {
    "ragged_dot": RaggedDot(),
    "flash_attention": FlashAttention(),
    "paged_attention": PagedAttention(),
}


# -------------------------------------------------------------------------------------------------
# Work list
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_work_list_records_are_named_and_built_once(family):
    pkg, wl = _package(family), _shared(family, "work_list")
    adapter = ADAPTERS[family]
    layout = pkg.schedule.LAYOUT
    assert isinstance(layout, wl.RecordLayout) and layout.family == family
    assert all(f.isidentifier() and f.isupper() for f in layout.fields)

    host, _ = adapter.lists(pkg, np)
    device, bound = adapter.lists(pkg, jnp)
    host, device = (np.asarray(a).reshape(layout.n_fields, -1) for a in (host, device))
    assert host.dtype == device.dtype == np.int32
    # [n_fields, L]: the traced list padded to a static bound, the host one at most as long
    assert host.shape[0] == device.shape[0] == layout.n_fields
    n = host.shape[1]
    assert device.shape[1] == bound >= n
    np.testing.assert_array_equal(device[:, :n], host)  # one builder: same items on both sides

    cols = layout.decode(device)
    assert list(cols) == list(layout.fields)
    # The kernels' SMEM addressing: flat field-major, field f of item i at f * L + i.
    flat = device.reshape(-1)
    assert layout.nbytes(bound) == flat.nbytes
    for name in layout.fields:
        got = [int(layout.read(flat, name, i, bound)) for i in range(bound)]
        assert got == cols[name].tolist()
    two = np.concatenate([flat, flat[::-1].copy()])  # two lists held together (per batch row)
    for name in layout.fields:
        assert [
            int(layout.read(two, name, i, bound, list_index=1)) for i in range(bound)
        ] == layout.decode(flat[::-1].copy())[name].tolist()

    if layout.has_flags:
        wl.check_flagged_list(layout, device, out_field=adapter.out_field)
        n = int((cols["FLAGS"] != 0).sum())  # the live items (a padded host list: ragged_dot)
        flags = wl.decode_flags(cols["FLAGS"])
        assert flags["COMPUTE"].any()
        assert not flags["VALID"][n:].any()  # padding records carry no flag
    else:
        assert family == "paged_attention"
        # Items past the real ones are empty: no sequence, no pages.
        assert (cols["SEQ"][n:] == -1).all() and (cols["NUM_PAGES"][n:] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_flag_bits_are_the_shared_ones(family):
    """Family modules re-use the shared flag constants, and no family file spells a flag bit."""
    pkg, wl = _package(family), _shared(family, "work_list")
    for mod in (pkg.kernel, pkg.tiling, pkg.schedule):
        for name, bit in wl.FLAGS.items():
            for alias in (name, "F_" + name):
                if hasattr(mod, alias):
                    assert getattr(mod, alias) == bit, f"{mod.__name__}.{alias}"
    flag_names = set(wl.FLAGS) | {"F_" + n for n in wl.FLAGS}
    for path in sorted((ROOT / "kernels" / family).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            values = (
                node.value.elts
                if isinstance(getattr(node, "value", None), ast.Tuple)
                else [getattr(node, "value", None)]
            )
            literal = any(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in values)
            if isinstance(node, ast.Assign) and literal:  # aliases of the shared names are fine
                targets = [
                    t
                    for tgt in node.targets
                    for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])
                ]
                named = {t.id for t in targets if isinstance(t, ast.Name)} & flag_names
                assert not named, f"{path.name}:{node.lineno} defines flag bits {named}"


def test_record_layout_rejects_mismatched_columns():
    wl = _shared(FAMILIES[0], "work_list")
    layout = wl.RecordLayout("toy", ("A", "B"))
    with pytest.raises(ValueError, match="fields"):
        layout.stack({"A": np.zeros(3, np.int32)})
    with pytest.raises(KeyError, match="no field"):
        layout.index("C")
    with pytest.raises(ValueError, match="bits outside"):
        wl.decode_flags(np.array([1, 16]))
    with pytest.raises(AssertionError, match="padding before"):
        wl.check_flagged_list(
            wl.RecordLayout("toy", ("OUT", "FLAGS")),
            np.array([[0, 0, 0], [wl.VALID, 0, wl.VALID]], np.int32),
        )


@pytest.mark.parametrize("limit", [1 << 22, 0], ids=["compare_all", "scan_unrolled"])
def test_loop_free_search_and_running_max_match_numpy(limit, monkeypatch):
    """work_list.searchsorted / cummax on traced arrays (both search methods) give numpy's
    answers, duplicates, ends and out-of-range queries included."""
    import jax

    wl = _shared(FAMILIES[0], "work_list")
    monkeypatch.setattr(wl, "COMPARE_ALL_LIMIT", limit)
    rng = np.random.default_rng(0)
    for n in (1, 7, 130):
        a = np.sort(rng.integers(0, 40, n)).astype(np.int32)  # duplicates
        v = np.arange(-2, 43, dtype=np.int32)
        for side in ("left", "right"):
            got = jax.jit(lambda a, v, side=side: wl.searchsorted(a, v, side=side, xp=jnp))(a, v)
            np.testing.assert_array_equal(got, np.searchsorted(a, v, side=side))
            assert np.array_equal(wl.searchsorted(a, v, side=side), np.searchsorted(a, v, side))
        x = rng.integers(-5, 50, n).astype(np.int32)
        np.testing.assert_array_equal(
            jax.jit(lambda x: wl.cummax(x, jnp))(x), np.maximum.accumulate(x)
        )
        np.testing.assert_array_equal(wl.cummax(x), np.maximum.accumulate(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_searches_or_accumulates_with_a_while_loop(family):
    """Traced code searches and takes running maxima through work_list's loop-free helpers:
    jnp.searchsorted's default method and jnp.maximum.accumulate compile to XLA while loops
    (~240 us of a 64-token decode gmm on a v5e chip, three loops)."""
    for path in sorted((ROOT / "kernels" / family).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("searchsorted", "accumulate"):
                base = node.value
                owner = base.id if isinstance(base, ast.Name) else ast.unparse(base)
                assert owner in ("np", "torch"), (
                    f"{path.name}:{node.lineno}: {owner}.{node.attr}; use work_list.searchsorted "
                    "/ work_list.cummax"
                )


# -------------------------------------------------------------------------------------------------
# Tile policy: the VMEM budget and the cost signature
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_vmem_budget_comes_from_tpu_generations(family, monkeypatch):
    pkg, gens = _package(family), _shared(family, "tpu_generations")
    adapter = ADAPTERS[family]
    for name in GENERATIONS:
        gen = gens.GENERATIONS[name]
        budget = gens.vmem_budget_bytes(gen, family)
        assert pkg.tiling.vmem_budget_bytes(gen) == budget
        assert 0 < budget <= gens.vmem_capacity_bytes(gen) <= gen.vmem_bytes
    gen = gens.GENERATIONS["v6e"]
    need = adapter.cost(pkg, "v6e").vmem_bytes
    assert 0 < need <= gens.vmem_budget_bytes(gen, family)
    # The family's tile choice reads the shared budget: shrink it there and the default tiles
    # shrink with it.
    real = gens.vmem_budget_bytes
    monkeypatch.setattr(
        gens, "vmem_budget_bytes", lambda g, fam: need - 1 if fam == family else real(g, fam)
    )
    assert adapter.cost(pkg, "v6e").vmem_bytes <= need - 1


def test_no_family_sizes_vmem_itself():
    """Budgets are per generation in one place: no tiling module reads physical VMEM
    (TpuGeneration.vmem_bytes; a candidate's KernelCost, named `cost`, carries its need under the
    same name)."""
    import re

    for family in FAMILIES:
        src = (ROOT / "kernels" / family / "tiling.py").read_text()
        assert not re.search(r"(?<!\bcost)\.vmem_bytes", src), (
            f"{family}/tiling.py reads gen.vmem_bytes"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_cost_returns_the_shared_kernel_cost(family):
    pkg, gens = _package(family), _shared(family, "tpu_generations")
    costs = [ADAPTERS[family].cost(pkg, g) for g in GENERATIONS]
    for c in costs:
        assert isinstance(c, gens.KernelCost)
        for f in dataclasses.fields(c):
            if f.name == "step_profile":  # per grid step, where the family models it
                prof = c.step_profile
                assert prof is None or (len(prof) == 3 and len({len(a) for a in prof}) == 1)
                continue
            assert isinstance(getattr(c, f.name), int) and getattr(c, f.name) >= 0, f.name
        assert 0 < c.useful_flops <= c.mxu_flops
        assert 0 < c.min_hbm_bytes <= c.hbm_bytes
        assert c.grid_steps > 0
    assert len({dataclasses.astuple(c) for c in costs}) > 1  # the generation is read


@pytest.mark.parametrize("family", FAMILIES)
def test_choose_tiles_and_estimate_cost_signatures(family):
    """tpu_generations.py "Tile policy": choose_tiles(*, problem, generation=None, override=None)
    -> frozen tiles with vmem_limit_bytes; estimate_cost(problem, *, tiles=None, generation=None),
    whose default tiles are choose_tiles'."""
    pkg, adapter = _package(family), ADAPTERS[family]
    for fn, names in (
        (pkg.tiling.choose_tiles, ("generation", "override")),
        (pkg.tiling.estimate_cost, ("tiles", "generation")),
    ):
        params = inspect.signature(fn).parameters
        for name in names:
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fn.__name__, name)
            assert params[name].default is None, (fn.__name__, name)
    for name in GENERATIONS:
        tiles = pkg.tiling.choose_tiles(generation=name, **adapter.problem)
        assert dataclasses.is_dataclass(tiles) and hasattr(tiles, "vmem_limit_bytes")
        with pytest.raises(dataclasses.FrozenInstanceError):
            tiles.vmem_limit_bytes = 1
        assert pkg.tiling.choose_tiles(generation=name, override=tiles, **adapter.problem) == tiles
        assert dataclasses.astuple(adapter.cost(pkg, name)) == dataclasses.astuple(
            adapter.cost(pkg, name, tiles=tiles)
        )


# -------------------------------------------------------------------------------------------------
# Modules and the import graph
# -------------------------------------------------------------------------------------------------


def _package_sources(family) -> dict[str, Path]:
    """The modules of the built package: the family's files plus the vendored torch-ext files."""
    files = {p.stem: p for p in (ROOT / "torch-ext").glob("*.py")}
    files.update({p.stem: p for p in (ROOT / "kernels" / family).glob("*.py")})
    return files


def import_graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (relative imports anywhere in the file, function
    bodies included: a lazy import still makes a cycle)."""
    graph = {}
    for name, path in sources.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in sources and d != "__init__"}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    two = {"kernel": {"tiling"}, "tiling": {"kernel"}}  # flash_attention before issue 15
    assert find_cycle(two) == ["kernel", "tiling", "kernel"]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_import_cycles_and_every_module_imports(family):
    sources = _package_sources(family)
    graph = import_graph(sources)
    assert "schedule" in graph, f"{family}: the host-side schedule belongs in schedule.py"
    assert graph["schedule"] <= {"work_list", "tpu_generations"}, graph["schedule"]
    cycle = find_cycle(graph)
    assert cycle is None, f"{family}: import cycle {' -> '.join(cycle)}"
    pkg = _package(family)
    for name in sorted(sources):
        if name != "__init__":
            importlib.import_module(f"{pkg.__name__}.{name}")


# -------------------------------------------------------------------------------------------------
# Tile ranking: one schedule-aware time model (tpu_generations.ranked_seconds / best_tiles)
# -------------------------------------------------------------------------------------------------

CALIBRATION = ROOT / "benchmarks" / "results" / "tile_model_calibration.json"


@pytest.mark.parametrize("family", FAMILIES)
def test_choose_tiles_ranks_with_the_shared_model(family, monkeypatch):
    """choose_tiles picks through tpu_generations.best_tiles (ranked_seconds: per-tile bundles
    from the shared bundle model, overlapped with DMA, plus per-step overhead), and its answer
    is the candidate best_tiles returned."""
    pkg, gens = _package(family), _shared(family, "tpu_generations")
    real = gens.best_tiles
    picked = []

    def spy(candidates, gen, *args, **kwargs):
        best = real(candidates, gen, *args, **kwargs)
        picked.append(best)
        return best

    monkeypatch.setattr(gens, "best_tiles", spy)
    if hasattr(pkg.tiling, "best_tiles"):
        monkeypatch.setattr(pkg.tiling, "best_tiles", spy)
    tiles = pkg.tiling.choose_tiles(generation="v6e", **ADAPTERS[family].problem)
    assert picked, f"{family}: choose_tiles must rank candidates with tpu_generations.best_tiles"
    assert all(p is not None for p in picked)
    # Every ranked candidate's cost carries the per-unit counts the bundle model reads.
    for _, cost, seconds in picked:
        assert isinstance(cost, gens.KernelCost) and seconds > 0
    if family == "flash_attention":
        fwd_cost = picked[0][1]
        assert fwd_cost.compute_tiles > 0 and fwd_cost.mxu_pushes > 0
        assert fwd_cost.eup_pushes > 0 and fwd_cost.valu_ops > 0
        bq, bqc, bk, bkc = picked[0][0][:4]
        assert (tiles.block_q, tiles.q_compute, tiles.block_kv, tiles.block_kv_compute) == (
            bq,
            bqc,
            bk,
            bkc,
        )
    if family == "ragged_dot":
        (tm, tk, tn, *_), cost, _ = picked[0]
        assert (tiles.tm, tiles.tk, tiles.tn) == (tm, tk, tn)
        assert cost.compute_tiles > 0 and cost.mxu_pushes > 0
        assert cost.vmem_loads > 0 and cost.vmem_stores > 0 and cost.step_vregs > 0


def test_ranked_seconds_overlaps_dma_with_tile_bundles():
    """The ranking model, on hand-made costs: compute = the bundle model's bundles / clock (never
    below the MXU FLOP floor), overlapped with DMA, plus the per-step overhead; a cost without
    unit counts falls back to the FLOP floor (the roofline)."""
    gens = _shared("flash_attention", "tpu_generations")
    g = gens.GENERATIONS["v6e"]
    m = gens.tile_bundle_model(g)
    base = dict(useful_flops=1, mxu_flops=2**30, min_hbm_bytes=1, grid_steps=10)
    tiles = dict(compute_tiles=100, mxu_pushes=100 * 128, eup_pushes=100 * 320, valu_ops=0)
    small_dma = gens.KernelCost(hbm_bytes=1 << 20, **base, **tiles)
    bundles = 100 * 128 * m.push_bundles * m.mxu_issue + 100 * m.tile_fixed_bundles
    assert gens.tile_bundles(g, mxu_pushes=100 * 128, eup_pushes=100 * 320, tiles=100) == (
        pytest.approx(bundles)
    )
    want = bundles / g.clock_hz + 10 * g.step_overhead_s
    assert gens.ranked_seconds(small_dma, g) == pytest.approx(want)
    big_dma = gens.KernelCost(hbm_bytes=1 << 34, **base, **tiles)
    assert gens.ranked_seconds(big_dma, g) == pytest.approx(
        (1 << 34) / g.hbm_bytes_per_s + 10 * g.step_overhead_s
    )
    vector_bound = gens.KernelCost(hbm_bytes=1, **base, **{**tiles, "valu_ops": 4 * 100 * 128 * 8})
    assert gens.ranked_seconds(vector_bound, g) > gens.ranked_seconds(small_dma, g)
    roofline = gens.KernelCost(hbm_bytes=1 << 20, **base)
    assert gens.ranked_seconds(roofline, g) == pytest.approx(roofline.modelled_seconds(g))
    # best_tiles: lowest time; `within` lets the tie-break choose among near-equal candidates.
    cands = [("slow", big_dma), ("fast", small_dma)]
    assert gens.best_tiles(iter(cands), g)[0] == "fast"
    assert gens.best_tiles(iter(cands), g, tie_break=lambda t: t != "slow", within=1e9)[0] == (
        "slow"
    )
    assert gens.best_tiles(iter(()), g) is None
    # VMEM loads / stores: a third bound beside the MXU and the vector units, over the slots.
    assert gens.tile_bundles(g, mxu_pushes=10, vmem_loads=3000, tiles=2) == pytest.approx(
        3000 / m.vload_slots * m.memory_issue + 2 * m.tile_fixed_bundles
    )
    assert gens.tile_bundles(g, mxu_pushes=10, vmem_stores=3000) == pytest.approx(
        3000 / m.vstore_slots * m.memory_issue + m.tile_fixed_bundles
    )
    assert gens.tile_bundles(g, mxu_pushes=1000, vmem_loads=30) == gens.tile_bundles(
        g, mxu_pushes=1000
    )
    # The grid steps' own code: charged only when the family counts it (step_vregs > 0).
    counted = gens.KernelCost(hbm_bytes=1, **base, **tiles, step_vregs=10 * 256)
    step = 10 * m.step_fixed_bundles + 10 * 256 * m.step_vreg_bundles
    assert gens.step_bundles(g, step_vregs=10 * 256, grid_steps=10) == pytest.approx(step)
    assert gens.step_bundles(g, step_vregs=0, grid_steps=10) == 0
    assert gens.ranked_seconds(counted, g) == pytest.approx(
        (bundles + step) / g.clock_hz + 10 * g.step_overhead_s
    )


def test_tile_bundle_model_matches_the_dumps():
    """The forward's per-tile bundle model stays within the stated tolerance of the committed
    LLO-dump figures (benchmarks/results/tile_model_calibration.json "points": each path's loop,
    interior and edge walk, masked and mask-free, each with the command that dumped it), on the
    calibration points and on held-out tiles; the excluded ones (the segment-id walk's serial
    loop) are named with the reason. Mask-free calibration points hold to the ranking's tie
    tolerance; masked walk tiles, bound by their chains, and held-out points to the looser one."""
    data = json.loads(CALIBRATION.read_text())
    pkg = _package("flash_attention")
    gens = _shared("flash_attention", "tpu_generations")
    T = pkg.tiling
    tol, loose = data["tolerance"], data["tolerance_masked_and_held_out"]
    assert 0 < tol <= loose <= 0.11
    # flash's choose_tiles treats candidates within the model's tolerance as ties
    assert T.RANKING_TOLERANCE == tol
    roles = {p["role"] for p in data["points"]}
    assert {"calibration", "held-out"} <= roles
    checked = 0
    for p in data["points"]:
        assert p["pass"] == "fwd" and p["path"] in T.FWD_PATHS, p
        assert not (p["masked"] and p["path"] == "interior"), p
        g = gens.GENERATIONS[p["generation"]]
        kw = dict(softcap=p["softcap"], two_edges=p["two_edges"], exp_bf16=p["exp_bf16"])
        kw["fixed_max"] = p.get("fixed_max", False)
        u = T.fwd_tile_units(g, p["rows"], p["cols"], p["head_dim"], **kw)
        # The dump's loop body holds a whole number of this tile's MXU pushes.
        assert p["hot_loop_vmatmul"] == p["tiles_per_iteration"] * u["mxu_pushes"], p
        assert p["dump_bundles_per_tile"] == pytest.approx(
            p["hot_loop_bundles"] / p["tiles_per_iteration"], abs=0.1
        )
        assert p["command"] and p["source"]
        if p["role"].startswith("excluded"):
            assert p["segments"], "only the segment-id walk is excluded"
            continue
        model = T.fwd_tile_bundles(
            g, p["rows"], p["cols"], p["head_dim"], path=p["path"], masked=p["masked"], **kw
        )
        assert model == pytest.approx(p["model_bundles_per_tile"], abs=0.1), p
        err = model / p["dump_bundles_per_tile"] - 1
        bound = tol if p["role"] == "calibration" and not p["masked"] else loose
        assert abs(err) <= bound, (p["role"], p["generation"], p["shape"], p["path"], err)
        checked += 1
    assert checked >= 60
    assert {p["generation"] for p in data["points"]} == set(GENERATIONS)
    # every generation has points of both paths, and masked walk points
    for gen in GENERATIONS:
        mine = [p for p in data["points"] if p["generation"] == gen]
        assert {p["path"] for p in mine} == set(T.FWD_PATHS), gen
        assert any(p["masked"] for p in mine), gen


def test_gmm_window_model_matches_the_dumps():
    """Ragged dot's matmul windows and grid steps under the same bundle model stay within the
    stated tolerance of the committed LLO-dump figures (tile_model_calibration.json
    "gmm_points", each with the command that dumped it): a window as the ranking charges it,
    max(its bundles, its MXU FLOP floor in cycles), and a grid step's own bundles."""
    data = json.loads(CALIBRATION.read_text())
    pkg = _package("ragged_dot")
    gens = _shared("ragged_dot", "tpu_generations")
    tol = data["gmm_tolerance"]
    assert 0 < tol <= 0.2
    points = data["gmm_points"]
    assert {p["role"] for p in points} == {"calibration", "held-out"}
    assert {p["kind"] for p in points} == {"window", "step"}
    for p in points:
        g = gens.GENERATIONS[p["generation"]]
        assert p["command"] and p["source"]
        if p["kind"] == "step":
            t = p["tiles"]
            vregs = pkg.tiling._step_vregs(t["tm"], t["tn"], None)
            assert vregs == p["step_vregs"]
            model = gens.step_bundles(g, step_vregs=vregs, grid_steps=1)
            err = model / p["dump_bundles"] - 1
        else:
            u = pkg.tiling.window_units(g, p["rows"], p["tk"], p["cols"], p["n_rhs"], "bfloat16")
            # the window's MXU pushes are the dump's vmatmul count
            assert int(u["mxu_pushes"]) == p["dump_vmatmul"], p
            model = gens.tile_bundles(
                g,
                mxu_pushes=int(u["mxu_pushes"]),
                vmem_loads=int(u["vmem_loads"]),
                vmem_stores=int(u["vmem_stores"]),
            )
            floor = 2 * p["rows"] * p["tk"] * p["cols"] * p["n_rhs"] / g.bf16_flops * g.clock_hz
            err = max(model, floor) / max(p["dump_bundles"], floor) - 1
        assert abs(err) <= tol, (p["kind"], p["role"], p["generation"], p["tiles"], err)
        assert err == pytest.approx(p["model_error"], abs=1e-3)
    windows = [p for p in points if p["kind"] == "window"]
    assert len(windows) >= 30 and len([p for p in points if p["kind"] == "step"]) >= 10
    assert {p["generation"] for p in windows} == set(GENERATIONS)
    # tails of 16 rows and full windows both covered on every generation
    for gen in GENERATIONS:
        rows = {p["rows"] for p in windows if p["generation"] == gen}
        assert 16 in rows and 256 in rows, (gen, rows)


def test_ragged_window_count_is_the_benchmark_trip_count():
    """estimate_cost's windows (compute_tiles) are the work list's row windows the benchmarks'
    schedule model charges (ours.gmm_trips: full windows + tail windows, per N / K tile and
    column chunk), and tiling's window chunk rule is the kernel's."""
    import ours

    pkg = _package("ragged_dot")
    T = pkg.tiling
    for k_rows in (128, 768, 2048, 7168):
        for cols in (128, 1536, 2048, 3584, 7168, 14336, 96):
            assert T.window_cols(k_rows, cols) == pkg.kernel._n_chunk(k_rows, cols)
            for gen in GENERATIONS:
                args = (k_rows, cols, T.get_generation(gen), 512, 16)
                assert (
                    T.window_cols(*args)
                    == pkg.kernel._n_chunk(*args)
                    <= T.window_cols(k_rows, cols)
                )
    gs = np.array([300, 0, 17, 1, 900, 5, 0, 2850], np.int32)
    m, k, n = 4096, 7168, 3584
    for tiles in (T.GmmTiling(128, 7168, 3584), T.GmmTiling(512, 2048, 1792)):
        for gen in GENERATIONS:
            c = T.estimate_cost("gmm", (m, k), (8, k, n), gs, tiles=tiles, generation=gen)
            trips = ours.gmm_trips(pkg, gs, m, k, n, "bfloat16", tiles, gen)
            assert c.compute_tiles == trips["hot_iterations"] + trips["side_region_runs"]
            side = _shared("ragged_dot", "tpu_generations").GENERATIONS[gen].mxu_size
            assert c.mxu_pushes * 16 * side * side * 2 >= c.mxu_flops  # pushes cover the FLOPs


def _flash_times(gen, lengths, *, hq, hkv, d, causal=True, window=None):
    """{length: (ranked time in us, tiles)} of the forward tiles flash choose_tiles picks."""
    pkg = _package("flash_attention")
    T, gens = pkg.tiling, _shared("flash_attention", "tpu_generations")
    g = gens.GENERATIONS[gen]
    ws = (window - 1, 0) if window else (-1, -1)
    out = {}
    for n in lengths:
        kw = dict(
            q_len=n,
            kv_len=n,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype="bfloat16",
            causal=causal,
            window_size=ws,
        )
        t = T.choose_tiles(generation=gen, **kw)
        cost = T.estimate_cost(batch=1, tiles=t, generation=gen, **kw)
        out[n] = (1e6 * gens.ranked_seconds(cost, g), t)
    return out


MONOTONE_CASES = [
    ("v6e", dict(hq=32, hkv=8, d=128)),  # Llama-3-8B causal
    ("v5e", dict(hq=24, hkv=24, d=128, causal=False)),  # Flux-like, no mask
]
if os.environ.get("HYPOTHESIS_PROFILE") == "sweep":  # the long form: every generation
    MONOTONE_CASES += [
        ("tpu7x", dict(hq=8, hkv=8, d=256)),
        ("v6e", dict(hq=8, hkv=4, d=256, window=4096)),
        ("tpu7x", dict(hq=32, hkv=8, d=128)),
        ("v5e", dict(hq=32, hkv=8, d=128)),
        ("v6e", dict(hq=24, hkv=24, d=128, causal=False)),
        ("tpu7x", dict(hq=32, hkv=8, d=128, window=1024)),
    ]
# A bucket length that ends inside a 512-token compute tile makes the kernel mask that tile row
# and column (the sequence ends inside it: rows and keys past the end), which costs VALU work a
# longer length whose tiles are whole does not pay. Bounded here: the shorter length may cost at
# most this much more than the next longer bucket.
PARTIAL_TILE_SLACK = 1.3


@pytest.mark.parametrize("gen, shape", MONOTONE_CASES)
def test_flash_choose_tiles_is_monotone_in_length(gen, shape):
    """Over the bucket lengths of shape_buckets (up to 8192): the ranked time of the tiles flash
    picks never falls as the length grows where every candidate's compute tiles are whole
    (multiples of 512), a shorter bucket costs at most PARTIAL_TILE_SLACK x the next longer one
    elsewhere, and the tiles picked at a bucket are never slower there than the previous
    bucket's tiles (no tile-choice jump like the +66% the roofline ranking gave at 1792,
    issue 18)."""
    buckets = _shared("flash_attention", "shape_buckets").token_buckets(8192)
    picked = _flash_times(gen, buckets, **shape)
    times = {n: t for n, (t, _) in picked.items()}
    whole = [n for n in buckets if n % 512 == 0]
    assert len(whole) >= 10
    for a, b in zip(whole, whole[1:]):
        assert times[a] <= times[b], (a, b, times[a], times[b])
    for a, b in zip(buckets, buckets[1:]):
        assert times[a] <= PARTIAL_TILE_SLACK * times[b], (a, b, times[a], times[b])
    # The issue-18 failure: at a bucket length choose_tiles picked tiles slower (for the kernel)
    # than those it picks one bucket below (its ranking charged an XLA pad copy and refused
    # blocks longer than the sequence). The tiles picked at each length are never slower there
    # than the previous bucket's, beyond the ranking's tolerance.
    pkg = _package("flash_attention")
    gens = _shared("flash_attention", "tpu_generations")
    g = gens.GENERATIONS[gen]
    ws = (shape["window"] - 1, 0) if shape.get("window") else (-1, -1)
    common = dict(
        num_q_heads=shape["hq"],
        num_kv_heads=shape["hkv"],
        head_dim=shape["d"],
        dtype="bfloat16",
        causal=shape.get("causal", True),
        window_size=ws,
    )
    for a, b in zip(buckets, buckets[1:]):
        if a < 512:
            continue
        prev = picked[a][1]
        prev_at_b = pkg.tiling.estimate_cost(
            batch=1, q_len=b, kv_len=b, tiles=prev, generation=gen, **common
        )
        assert times[b] <= (1 + pkg.tiling.RANKING_TOLERANCE) * 1e6 * gens.ranked_seconds(
            prev_at_b, g
        ), (a, b)


# -------------------------------------------------------------------------------------------------
# Module paths: one list of the repository's module folders, no sys.path edits of its own
# -------------------------------------------------------------------------------------------------


def _repo_python_files():
    for folder in ("kernels", "torch-ext", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "toy_collection" not in path.parts:
                yield path


def test_no_module_edits_sys_path_for_first_party_folders():
    """The repository's module folders reach every process through one list: pytest's
    `pythonpath` in pyproject.toml and, for programs run from the dev venv, the .pth file
    `make setup` writes from the Makefile's REPO_PATHS (the two lists equal). The only sys.path
    edits left add the external packages kept in folders of their own, outside the venv: libtpu
    (tests/tpu_compile.py) and tokamax (benchmarks/validate_schedule.py)."""
    import re
    import tomllib

    pythonpath = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["pythonpath"]
    make = re.search(r"^REPO_PATHS := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make and make.group(1).split() == pythonpath
    allowed = {
        ("tests/tpu_compile.py", "sys.path.append(str(LIBTPU_DIR))"),
        ("benchmarks/validate_schedule.py", "sys.path.append(str(TOKAMAX_DIR))"),
    }
    edits = set()
    for path in _repo_python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend")
                and ast.unparse(node.func.value) == "sys.path"
            ):
                edits.add((str(path.relative_to(ROOT)), ast.unparse(node)))
    assert edits == allowed


def test_programs_find_the_repository_modules_from_anywhere(tmp_path):
    """A benchmark program run by the venv's python from another folder imports modules of
    benchmarks/, tests/ and torch-ext/ by name (the venv's .pth; `make setup` writes it)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "schedule_rows.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "schedule model now reads" in run.stdout
