"""Tests of the kernel microbenchmarks (benchmarks/): the closed forms (ours and the JAX anchors)
against the interpreter's traffic counter on small shapes, the committed results against a fresh
`run.py --small`, the device timing loop, and the `kernels benchmark` files on CPU (that results.md
is the report of results.json: tests/test_llo_schedule.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import blockspec_model  # noqa: E402
import registry  # noqa: E402
import shapes  # noqa: E402
import tpu_interpreter  # noqa: E402

pytestmark = pytest.mark.tpu_interpret

# -------------------------------------------------------------------------------------------------
# The closed-form BlockSpec walker against the counter (the counter itself: test_tpu_interpreter.py)
# -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_blockspec_model_predicts_the_counted_copies():
    # Grid (2, 3, 1): x's block (i, 0) stays for the three j steps of each i (2 copies), y's
    # (0, j) changes every step (6 copies), the output (i, j) is written 6 times.
    from test_tpu_interpreter import _matmul

    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((128, 384), jnp.float32)
    with tpu_interpreter.count_traffic() as t:
        jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))
    blk = 128 * 128 * 4
    p = blockspec_model.pipeline_bytes(
        (2, 3, 1),
        [
            blockspec_model.Operand("x", blk, lambda i, j, k: (i, k)),
            blockspec_model.Operand("y", blk, lambda i, j, k: (k, j)),
            blockspec_model.Operand("o", blk, lambda i, j, k: (i, j), is_output=True),
        ],
    )
    assert (p["x"][0], p["y"][0], p["o"][0]) == (2, 6, 6)
    assert p["read"] + p["write"] == t.hbm_bytes == 14 * blk
    # Per step: x comes in on steps 0 and 3, y on every step; each output block is written
    # after its own step (its index changes at every step).
    reads, writes = blockspec_model.step_copies(
        (2, 3, 1),
        [
            blockspec_model.Operand("x", blk, lambda i, j, k: (i, k)),
            blockspec_model.Operand("y", blk, lambda i, j, k: (k, j)),
            blockspec_model.Operand("o", blk, lambda i, j, k: (i, 0), is_output=True),
        ],
    )
    assert reads.tolist() == [2 * blk, blk, blk, 2 * blk, blk, blk]
    assert writes.tolist() == [0, 0, blk, 0, 0, blk]  # (i, 0) written when i changes / at the end


@pytest.mark.parametrize("shape_name", ["qwen3_30b_a3b_down_t64", "mixtral_8x7b_down_t4096"])
def test_gmm_step_work_adds_up_to_the_call(shape_name):
    """Our gmm's per-step work (what the schedule overlaps step by step) sums to the call's
    totals: hot-loop and tail-window runs to the trip counts, copies to the closed-form bytes
    that the TPU interpreter's counter checks."""
    import ours

    a = ours.ADAPTERS["ragged_dot"]
    shape = next(s for s in shapes.NAMED["ragged_dot"] if s.name == shape_name)
    for gen in ("v5e", "tpu7x"):
        trips = a.schedule_trips(shape, gen)
        steps = trips["step_work"]
        cost, _ = a.cost(shape, gen)
        assert len(steps["hot"]) == cost.grid_steps
        assert steps["hot"].sum() == trips["hot_iterations"]
        assert steps["side"].sum() == trips["side_region_runs"]
        assert steps["reads"].sum() + steps["writes"].sum() == cost.hbm_bytes
        assert (steps["mxu"] > 0).sum() == (steps["hot"] + steps["side"] > 0).sum()


# -------------------------------------------------------------------------------------------------
# Closed forms against the counter, and the committed results, on the small shapes
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_section(request):
    import rows
    from xdist_shared import compute_once

    # As it is written (tuples become lists); computed by one xdist worker for all of them.
    return compute_once(
        request.config,
        "small_section",
        lambda: json.loads(json.dumps(rows.small_section(log=lambda msg: None))),
    )


def _row_ids():
    ids = []
    for kind in registry.KINDS:
        for s in shapes.SMALL[kind]:
            for impl in registry.impls(kind):
                ids.append((kind, s.name, impl))
    return ids


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,shape,impl", _row_ids(), ids=lambda v: str(v))
def test_closed_form_equals_counted(small_section, kind, shape, impl):
    rows = [
        r
        for r in small_section["rows"]
        if (r["kernel"], r["shape"], r["impl"]) == (kind, shape, impl)
    ]
    if impl == "ours" and kind in small_section["missing"]:
        pytest.fail(f"our {kind} kernel did not load: {small_section['missing'][kind]}")
    assert len(rows) == 1
    r = rows[0]
    if r["closed_form_matches"] is None:
        # Only ragged_paged_attention: it cannot run in TPU interpret mode; say so in the table.
        assert impl.startswith("anchor:ragged_paged_attention")
        assert "not interpretable" in r["source"]
        return
    assert r["counted"]["grid_steps"] == r["grid_steps"]
    assert r["counted_compare_bytes"] == r["closed_form_bytes"], (
        f"closed form {r['closed_form_bytes']} != counted {r['counted_compare_bytes']} "
        f"(by operand: {r['counted']['by_operand']}, DMAs: {r['counted']['dmas']})"
    )
    assert r["closed_form_matches"] is True
    # The problem's useful FLOPs agree with the kernel's own count.
    assert r["kernel_useful_flops"] == r["useful_flops"]


@pytest.mark.timeout(900)
def test_committed_results_match_a_fresh_small_run(small_section):
    committed = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    assert committed["small"] == small_section, (
        "benchmarks/results/results.json is stale: run `python benchmarks/run.py --small` "
        "(or the full `python benchmarks/run.py`) and commit the results"
    )


# -------------------------------------------------------------------------------------------------
# The `kernels benchmark` files, on CPU, through the kernels runner, from the built repos
# -------------------------------------------------------------------------------------------------


def _benchmark_files():
    # Files that hold a benchmark (an empty placeholder of a kernel not yet written is left out).
    return [
        p
        for p in sorted((ROOT / "benchmarks").glob("benchmark_*.py"))
        if "Benchmark" in p.read_text()
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", _benchmark_files(), ids=lambda p: p.name)
def test_benchmark_file_runs_on_cpu(path, monkeypatch):
    from kernels.cli import benchmark as kb

    import kernel_loader

    dist = kernel_loader.built_collection()
    repos = [d for d in dist.iterdir() if (d / "benchmarks" / path.name).exists()]
    assert len(repos) == 1, f"no built repo ships {path.name}"
    repo = repos[0]
    assert (repo / "benchmarks" / path.name).read_bytes() == path.read_bytes()
    results, _ = kb.run_benchmark_script(
        repo / "benchmarks" / path.name,
        iterations=1,
        warmup=0,
        cwd=repo,
        repo_id=str(repo),
        is_local=True,
        revision="local",
    )
    assert results, f"{path.name}: no workloads ran"
    for name, timing in results.items():
        assert timing.verified is not False, name
        assert timing.mean_ms > 0, name


@pytest.mark.timeout(300)
def test_device_timing_path_runs(small_section):
    """The --device tpu timing loop, run here on the CPU device in TPU interpret mode on the
    smallest flash-attention rows (the real thing needs a TPU): every row gets a measured time
    and an achieved fraction of its roofline."""
    import copy

    import device_timing

    rows = [
        copy.deepcopy(r)
        for r in small_section["rows"]
        if r["shape"] == "small_causal_512" and r["impl"] in ("ours", "anchor:flash_attention")
    ]
    assert len(rows) == 2
    section = {"rows": rows, "missing": {}, "generations": ["v6e"]}
    with pltpu.force_tpu_interpret_mode(tpu_interpreter.counting_params()):
        device_timing.measure_on_device(
            section,
            ("flash_attention",),
            log=lambda m: None,
            iters=1,
            warmup=0,
            device=jax.devices("cpu")[0],
            generation="v6e",
            small=True,
        )
    for r in rows:
        pg = r["per_generation"]["v6e"]
        assert pg["measured_us"] > 0
        assert pg["measured_fraction_of_roofline"] == pytest.approx(
            pg["roofline_us"] / pg["measured_us"], rel=1e-4
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(400)
def test_device_run_needs_no_torch_and_checks_the_kernels(tmp_path):
    """The TPU VM run (`device_timing.py check`) loads the kernels as plain JAX packages, with
    torch and the `kernels` library unimportable, and its compiled-kernel checks pass against the
    f32 references; here in TPU interpret mode on the CPU, the ragged dot only (the chip runs
    all three)."""
    import subprocess
    import sys

    out = tmp_path / "check.json"
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['kernels'] = None\n"
        "import device_timing\n"
        f"device_timing.main(['check', '--kernel', 'ragged_dot', '--generation', 'v5e', "
        f"'--interpret', '--out', {str(out)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    names = {c["shape"] for c in cases}
    assert {"tgmm", "gmm_int8_weights", "gmm_rows_past_groups"} <= names
    assert all(c["ok"] for c in cases), [c for c in cases if not c["ok"]]


def test_measured_times_sit_beside_the_schedule(tmp_path):
    """`device_timing.apply_measured` puts a chip's times on the named rows they time (and no
    other), and results.md's measured section shows measured / scheduled for each."""
    import copy

    import device_timing
    import report

    results = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    results = copy.deepcopy(results)
    row = next(r for r in results["named"]["rows"] if r["impl"] == "ours")
    for r in results["named"]["rows"]:
        for pg in r["per_generation"].values():
            pg.pop("measured_us", None)
    sched = row["per_generation"]["v5e"]["scheduled"]["scheduled_us"]
    doc = {
        "meta": {"device_kind": "TPU v5 lite", "generation": "v5e", "jax": "0", "date": "d"},
        "method": "m",
        "rows": [
            {"kernel": row["kernel"], "shape": row["shape"], "impl": "ours", "generation": "v5e",
             "measured_us": 2 * sched},
            {"kernel": row["kernel"], "shape": "no_such_shape", "impl": "ours",
             "generation": "v5e", "measured_us": 1.0},
        ],
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(doc))
    device_timing.apply_measured(results, [tmp_path / "run.json"])
    measured = [
        (r["shape"], g)
        for r in results["named"]["rows"]
        for g, pg in r["per_generation"].items()
        if "measured_us" in pg
    ]
    assert measured == [(row["shape"], "v5e")]
    md = report.markdown(results)
    line = next(x for x in md.splitlines() if x.startswith(f"| {row['kernel']} | {row['shape']} |"))
    assert "| 2.00 |" in line


# -------------------------------------------------------------------------------------------------
# tokamax's gmm as a ragged-dot anchor (named rows only: its op refuses dimensions under 128)
# -------------------------------------------------------------------------------------------------

TOKAMAX = "anchor:tokamax_gmm"


def _tokamax_small_shape():
    # 256 rows over 4 experts: the 128-row tiles each hold several groups (revisited tiles)
    return shapes.RaggedDotShape("tokamax_small", 128, 4, 2, 256, 384)


def _visits_by_hand(group_sizes, tm):
    """(m tile, group) pairs holding rows: megablox's and tokamax's visit list, counted plainly."""
    pairs, start = [], 0
    for g, size in enumerate(int(x) for x in group_sizes):
        pairs += [(t, g) for t in range(start // tm, (start + size - 1) // tm + 1)] if size else []
        start += size
    return pairs


def test_tokamax_closed_form_matches_a_hand_count():
    """Full K and N tiles: each m tile's lhs is read once, each used expert's weights once, each
    output tile written once (the problem's minimum), one step and one block dot per visit."""
    import anchors

    s = _tokamax_small_shape()
    tm, k, n = 128, s.k, s.n
    cost, info = anchors.tokamax_gmm_cost(s, "v6e", {"tiling": (tm, k, n), "buffers": 2})
    visits = _visits_by_hand(s.group_sizes, tm)
    used = sum(1 for x in s.group_sizes if x)
    assert info["row_tile_visits"] == cost.grid_steps == len(visits)
    assert cost.hbm_bytes == 2 * (s.m * k + used * k * n + s.m * n)  # bf16
    assert cost.hbm_bytes == anchors.gmm_min_bytes(s)
    assert cost.mxu_flops == len(visits) * 2 * tm * k * n
    assert cost.useful_flops == 2 * s.m * k * n
    # two lhs buffers, two rhs, two out, the f32 accumulator; three lhs buffers add one block
    assert cost.vmem_bytes == 2 * 2 * (tm * k + k * n + tm * n) + 4 * tm * n
    deeper, _ = anchors.tokamax_gmm_cost(s, "v6e", {"tiling": (tm, k, n), "buffers": 3})
    assert deeper.vmem_bytes - cost.vmem_bytes == 2 * tm * k


@pytest.mark.timeout(300)
def test_tokamax_closed_form_equals_counted(monkeypatch):
    """tokamax's own gmm in TPU interpret mode (several K and N tiles, revisited row tiles): the
    HBM bytes its pipeline copies are the closed form's, and its result is the ragged dot."""
    from jax._src.pallas.mosaic import tpu_info

    import anchors
    import rows

    # Its pipeline asks the default device's TPU info at trace time for DMA tilings; the CPU
    # device running the interpreter has none: lend it v6e's.
    monkeypatch.setitem(
        tpu_info.registry,
        "cpu",
        lambda: tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V6E, 1),
    )
    s = _tokamax_small_shape()
    cfg = {"tiling": (128, 128, 128), "buffers": 2}
    cost, info = anchors.tokamax_gmm_cost(s, "v6e", cfg)
    fn, args = anchors.tokamax_gmm_call(s, cfg, interpret=False)  # the counter forces interpret
    try:
        counted = rows.count_row(fn, args)
        lhs, rhs, gs = args
        out = anchors.tokamax_gmm_call(s, cfg, interpret=True)[0](lhs, rhs, gs)
    finally:
        tpu_info.get_tpu_info.cache_clear()  # the lent v6e info must not outlive the test
    assert counted["calls"] == 1
    assert counted["dma_bytes"] == cost.hbm_bytes, counted
    assert cost.grid_steps == len(_visits_by_hand(s.group_sizes, 128)) * 2 * 3
    ref = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
    assert jnp.allclose(out.astype(jnp.float32), ref, rtol=2e-2, atol=0.5)


def test_tokamax_registry_entry_and_tiles_per_generation():
    """Named rows only; its tiles are the fastest config tokamax published for the shape and
    generation, else its op's own choice (its tuned table, else Config's defaults)."""
    import anchors
    import rows

    assert TOKAMAX in registry.impls("ragged_dot", named=True)
    assert TOKAMAX not in registry.impls("ragged_dot")  # no small-shape rows
    a = registry.anchor("ragged_dot", TOKAMAX)
    named = {s.name: s for s in shapes.NAMED["ragged_dot"]}
    op = anchors._tokamax_op_module()

    mixtral = named["mixtral_8x7b_gate_t4096"]
    data = rows.validate_schedule.DATA
    assert data.is_dir(), f"tokamax's published data not found at {data}: set PTK_REFERENCE_DATA"
    published = rows.tokamax_ms("ragged_dot", mixtral)["pallas"]  # an independent CSV reader
    for g in ("v5e", "tpu7x"):
        cfg = anchors.tokamax_gmm_config(mixtral, g)
        assert cfg["source"] == "published" and cfg["published_ms"] == published[g]
    assert "v6e" not in published
    d = op.Config()
    v6e = anchors.tokamax_gmm_config(mixtral, "v6e")
    assert (v6e["source"], v6e["tiling"]) == ("default", (d.tile_m, d.tile_k, d.tile_n))

    deepseek = named["deepseek_v3_like_gate_t16384"]
    lut = op.GMM_TILING_TUNED_LUT[(deepseek.m, deepseek.k, deepseek.n, deepseek.experts, False)]
    cfg = anchors.tokamax_gmm_config(deepseek, "v6e")
    assert (cfg["source"], cfg["tiling"], cfg["buffers"]) == ("table", tuple(lut[0]), lut[1])

    # The row's cost follows each generation's tiles: tpu7x's published 512 x 4096 x 1024 tiles
    # cover K in one step, 14 N tiles.
    tm, tk, tn = anchors.tokamax_gmm_config(mixtral, "tpu7x")["tiling"]
    c7, i7 = a.cost(mixtral, False, "tpu7x")
    c6, _ = a.cost(mixtral, False, "v6e")
    visits = len(_visits_by_hand(mixtral.group_sizes, tm))
    assert c7.grid_steps == visits * (-(-mixtral.k // tk)) * (-(-mixtral.n // tn))
    assert i7["tiling"] == [tm, tk, tn] and c6.grid_steps != c7.grid_steps

    # Every named ragged row is a bf16 forward gmm it runs; a shape under 128 rows is not.
    for s in named.values():
        for g in ("v5e", "v6e", "tpu7x"):
            assert a.unsupported(s, g) is None, (s.name, g)
    small = shapes.SMALL["ragged_dot"][0]
    assert "under 128" in a.unsupported(small, "v6e")
    odd = shapes.RaggedDotShape("odd_rows", 100, 4, 2, 256, 256)  # 200 rows, 128-row tiles
    assert "divisible by tile_m" in a.unsupported(odd, "v6e")


def test_tokamax_rows_without_a_cached_schedule_say_na(monkeypatch):
    """`run.py --cache-only` on a tokamax row whose schedule is not cached: the row is built (no
    compile), its scheduled and compile cells say n/a; a shape it cannot run is an n/a row with
    the reason, and the report renders both."""
    import report
    import rows
    import schedule_rows
    from tpu_compile import libtpu_available

    assert libtpu_available(), "libtpu not installed in .libtpu: run `make setup`"
    monkeypatch.setattr(schedule_rows, "_load_cache", lambda *a, **k: {})
    monkeypatch.setattr(schedule_rows, "_save_cache", lambda *a, **k: None)
    shape = next(s for s in shapes.NAMED["ragged_dot"] if s.name == "qwen3_30b_a3b_down_t64")
    gens = ["v5e", "v6e", "tpu7x"]
    row = rows.build_row(
        "ragged_dot", shape, TOKAMAX, False, gens, True, lambda m: None, True, cache_only=True
    )
    for g in gens:
        pg = row["per_generation"][g]
        assert pg["compile"] == {"compiles": None} and "scheduled" not in pg
        assert pg["hbm_bytes"] == row["hbm_bytes"]  # default tiles on every chip for this shape
    odd = shapes.RaggedDotShape("odd_rows", 100, 4, 2, 256, 256)
    na = rows.build_row("ragged_dot", odd, TOKAMAX, False, gens, True, lambda m: None, True)
    assert "divisible by tile_m" in na["unsupported"]
    section = {"rows": [row, na], "missing": {}, "generations": gens}
    md = report.markdown({"named": section})
    line = next(ln for ln in md.splitlines() if ln.startswith("| qwen3_30b_a3b_down_t64 "))
    cells = [c.strip() for c in line.split("|")]
    assert cells.count("n/a") == 6  # the scheduled and compile columns of three generations
    assert "| odd_rows | tokamax gmm" in md and "n/a: tokamax's gmm needs m divisible" in md


def test_schedule_cache_prune_keeps_current_and_unmatched_rows(tmp_path):
    """schedule_rows.prune_cache drops a row's entries under older source keys once the row has
    an entry under its current key, and keeps every entry of a row that has none (a lowering may
    still match their program fingerprints); the file is rewritten, not merged into."""
    import schedule_rows

    ours = schedule_rows._source_hash("ours", "paged_attention")
    anchor = schedule_rows._source_hash("anchor:splash", "flash_attention")
    row_a = "paged_attention|ours|some_shape|v6e"
    row_b = "flash_attention|anchor:splash|other_shape|tpu7x"
    cache = {
        f"{row_a}|{ours}": {"bundles": 1},
        f"{row_a}|0000000000000000": {"bundles": 2},
        f"{row_b}|1111111111111111": {"bundles": 3},
        f"{row_b}|2222222222222222": {"bundles": 4},
        f"{row_b[:-5]}|v5e|{anchor}": {"bundles": 5},
    }
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(cache))
    assert schedule_rows.prune_cache(path) == (5, 4)
    kept = json.loads(path.read_text())
    assert f"{row_a}|{ours}" in kept and f"{row_a}|0000000000000000" not in kept
    assert {k for k in kept if k.startswith(row_b)} == {
        f"{row_b}|1111111111111111",
        f"{row_b}|2222222222222222",
    }


def test_bwd_dump_points_selects_the_points_loop():
    """bwd_dump_points.select_loop takes, among the innermost loops holding whole tiles, the
    masked (vsel) or mask-free one the point names, the longest such, and reports bundles per
    tile over the tiles in its body; a point whose loop is missing is refused."""
    import bwd_dump_points

    def loop(bundles, children=0, **ops):
        occ = {"MXU": 0.5, "VALU": 0.25}
        return {"children": children, "own": {"bundles": bundles, "ops": ops, "occupancy": occ}}

    schedule = {
        "loops": [
            loop(9000, children=2, dma=4),  # the grid step: not innermost
            loop(4334, vmatmul=768, vsel=2180, vpow2=1024),
            loop(3667, vmatmul=768, vpow2=1024),
            loop(4264, vmatmul=768, vsel=2180),
            loop(500, vmatmul=100, vsel=3),  # not whole tiles of 384 pushes
        ]
    }
    masked = bwd_dump_points.select_loop(schedule, {"masked": True}, 384)
    assert masked["hot_loop_bundles"] == 4334 and masked["tiles_per_iteration"] == 2
    assert masked["dump_bundles_per_tile"] == 2167.0
    assert masked["loop"] == "masked edge tiles (vsel), 2 per straight-line group"
    free = bwd_dump_points.select_loop(schedule, {"masked": False}, 768)
    assert free["hot_loop_bundles"] == 3667 and free["tiles_per_iteration"] == 1
    assert free["loop"] == "mask-free tiles" and free["mxu_occupancy"] == 0.5
    with pytest.raises(ValueError, match="mask-free"):
        bwd_dump_points.select_loop({"loops": schedule["loops"][1:2]}, {"masked": False}, 384)
