"""Tests of the kernel microbenchmarks (benchmarks/): the closed forms (ours and the JAX anchors)
against the interpreter's traffic counter on small shapes, the committed results against a fresh
`run.py --small`, the device timing loop, and the `kernels benchmark` files on CPU (that results.md
is the report of results.json: tests/test_llo_schedule.py)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("layout", [None, "concatenated", "interleaved"])
def test_gmm_step_work_copies_what_the_blockspecs_copy(layout):
    """The kernel's per-step copies (tiling.gmm_step_work: the tile ranking's step profile and
    the benchmarks' per-step schedule) are what the generic BlockSpec model copies for the
    kernel's index maps over the same work list, step by step: several K and N tiles, items
    without MXU work (rows past sum(group_sizes)), groups of whole and partial tiles."""
    import kernel_loader

    T = kernel_loader.load_kernel("ragged_dot").tiling
    m, k, n, tm, tk, tn, unit = 1000, 768, 1024, 128, 256, 256, T.row_unit("bfloat16")
    gs = np.asarray([300, 0, 128, 17, 400], np.int32)  # 845 rows: 155 past the groups
    wl = T._fields(
        T.work_list(gs, m=m, tm=tm, buckets=T.bucket_sizes(tm, unit), unit=unit, kind="gmm")
    )
    w = T.gmm_step_work(wl, k, n, tm, tk, tn, unit, 2, 1, 4, layout)
    L, kt, nt = wl["FLAGS"].shape[0], k // tk, n // tn
    n_rhs, cols = T._weight_blocks(tn, layout)
    k_of = lambda j, kb: np.where(wl["KFIX"][j] != 0, kt - 1, kb)  # noqa: E731
    reads, writes = blockspec_model.step_copies(
        (nt, L, kt),
        [
            blockspec_model.Operand(
                "lhs", tm * tk * 2, lambda nb, j, kb: (wl["TILE"][j], k_of(j, kb))
            ),
            blockspec_model.Operand(
                "rhs", n_rhs * tk * cols, lambda nb, j, kb: (wl["GROUP"][j], k_of(j, kb), nb)
            ),
            blockspec_model.Operand("out", tm * tn * 4, lambda nb, j, kb: (wl["OUT"][j], nb), True),
        ],
    )
    assert w["reads"].tolist() == reads.tolist()
    assert w["writes"].tolist() == writes.tolist()
    assert len(w["rows"]) == nt * L * kt and w["rows"].sum() >= nt * kt * gs.sum()
    assert (w["rows"] > 0).sum() == ((w["full"] + w["tail"]) > 0).sum()


def test_tgmm_step_work_copies_what_the_blockspecs_copy():
    """tgmm's per-step copies (tiling.tgmm_step_work: the tile ranking's step profile and the
    benchmarks' tgmm schedule) are what the generic BlockSpec model copies for kernel.tgmm's
    index maps over the same work list (grid K tiles x N tiles x items; an empty group's item,
    rows past sum(group_sizes)); they add up to estimate_cost's exact bytes, and the windows to
    its grid steps."""
    import kernel_loader

    T = kernel_loader.load_kernel("ragged_dot").tiling
    m, k, n, tm, tk, tn = 1000, 768, 1024, 128, 256, 512
    unit = T.row_unit("bfloat16", "bfloat16")
    gs = np.asarray([300, 0, 128, 17, 400], np.int32)  # 845 rows: 155 past the groups
    wl = T._fields(
        T.work_list(gs, m=m, tm=tm, buckets=T.bucket_sizes(tm, unit), unit=unit, kind="tgmm")
    )
    w = T.tgmm_step_work(wl, k, n, tm, tk, tn, unit, 2, 2, 4, 128)
    L, kt, nt = wl["FLAGS"].shape[0], k // tk, n // tn
    reads, writes = blockspec_model.step_copies(
        (kt, nt, L),
        [
            blockspec_model.Operand("lhs", tm * tk * 2, lambda kb, nb, j: (wl["TILE"][j], kb)),
            blockspec_model.Operand("dout", tm * tn * 2, lambda kb, nb, j: (wl["TILE"][j], nb)),
            blockspec_model.Operand(
                "out", tk * tn * 4, lambda kb, nb, j: (wl["OUT"][j], kb, nb), True
            ),
        ],
    )
    assert w["reads"].tolist() == reads.tolist()
    assert w["writes"].tolist() == writes.tolist()
    cost = T.estimate_cost(
        "tgmm", (m, k), (m, n), gs, out_dtype="float32",
        tiling=T.TgmmTiling(tm=tm, tk=tk, tn=tn),
    )  # fmt: skip
    assert w["reads"].sum() + w["writes"].sum() == cost.hbm_bytes
    assert len(w["rows"]) == cost.grid_steps == kt * nt * L
    # every row of every group is in a window of each (K, N) tile, rounded up to the MXU side
    assert w["rows"].sum() >= kt * nt * gs.sum()
    assert not (w["rows"] % 128).any()
    assert (w["rows"] > 0).sum() == ((w["full"] + w["tail"]) > 0).sum()


@pytest.mark.timeout(300)
def test_megablox_tgmm_closed_form_equals_counted():
    """megablox's tgmm in TPU interpret mode (several K and N tiles, an empty group, revisited
    row tiles): the HBM bytes its pipeline copies and its grid steps are the closed form's
    (anchors.tgmm_cost, what benchmarks/tgmm_schedule.py schedules it by), and its result is
    the weight gradient."""
    import anchors
    import rows

    gs = np.asarray([70, 0, 50, 72], np.int32)  # 192 rows, one empty group
    s = types.SimpleNamespace(m=192, k=256, n=384, experts=4, dtype="bfloat16", group_sizes=gs)
    tiling = (64, 128, 128)
    cost, info = anchors.tgmm_cost(s, tiling)
    key = jax.random.key(3)
    x = jax.random.normal(key, (s.m, s.k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.fold_in(key, 1), (s.m, s.n), jnp.bfloat16)
    mg = anchors._megablox()

    def fn(x, dy, gs):
        return mg.tgmm.__wrapped__(
            x.swapaxes(0, 1), dy, gs, preferred_element_type=jnp.bfloat16, tiling=tiling,
            interpret=True,
        )  # fmt: skip

    counted = rows.count_row(fn, (x, dy, jnp.asarray(gs)))
    assert counted["hbm_bytes"] == counted["blockspec_read_bytes"] + counted["hbm_write_bytes"]
    assert counted["hbm_bytes"] == cost.hbm_bytes, counted
    visits = anchors.tgmm_metadata(gs, s.m, tiling[0])[2]
    assert cost.grid_steps == visits * (s.k // 128) * (s.n // 128)
    # runs of visits to one group: 3 groups with rows, the empty group's own visit
    assert info["group_runs"] == 4 * (s.k // 128) * (s.n // 128)
    out = fn(x, dy, jnp.asarray(gs)).astype(jnp.float32)
    ends = np.cumsum(gs)
    for g, (lo, hi) in enumerate(zip(ends - gs, ends)):
        ref = x[lo:hi].astype(jnp.float32).T @ dy[lo:hi].astype(jnp.float32)
        assert jnp.allclose(out[g], ref, rtol=2e-2, atol=0.5)


def test_tgmm_schedule_rows_are_current():
    """results/tgmm_schedule.json (the README's tgmm figures) is what benchmarks/tgmm_schedule.py
    gives now: ours at the tiles the tile search picks today, and every row's scheduled time
    recomputed from its cached compile with today's model and closed forms (no compile)."""
    import schedule_rows
    import tgmm_schedule

    rows = json.loads(tgmm_schedule.RESULTS.read_text())["rows"]
    cache = schedule_rows._load_cache(tgmm_schedule.CACHE)
    shapes_ = {s.name: s for s in tgmm_schedule._shapes()}
    assert {(r["shape"], r["generation"]) for r in rows} == {
        (s, g) for s in shapes_ for g in tgmm_schedule.GENS
    }
    for r in rows:
        shape = shapes_[r["shape"]]
        if r["impl"] == "ours":
            assert tuple(r["tiles"]) == tgmm_schedule.default_tiles(shape, r["generation"]), r
        again = tgmm_schedule.row(
            r["impl"], shape, r["generation"], r["tiles"], entry=cache[r["cache_key"]]
        )
        if "error" in r:  # does not compile: said so in the table
            assert again["error"] == r["error"]
            continue
        assert again["scheduled_us"] == r["scheduled_us"], (r, again)
        assert again["hbm_bytes"] == r["hbm_bytes"] and again["grid_steps"] == r["grid_steps"]


def test_tgmm_rows_charge_each_tail_its_bucket_and_the_zero_fill_per_empty_group():
    """Our tgmm's compiled grid step holds one tail region per bucket, in bucket order, and an
    empty group's zero-fill (stores only, one per vreg of the (tk, tn) output block) right
    before its windows; the rows charge each tail run its bucket's region and the zero-fill only
    on empty groups' items (ours.tgmm_trips), not at the regions' mean and on every step."""
    import kernel_loader
    import ours
    import schedule_model
    import schedule_rows
    import tgmm_schedule

    T = kernel_loader.load_kernel("ragged_dot").tiling
    rows = json.loads(tgmm_schedule.RESULTS.read_text())["rows"]
    cache = schedule_rows._load_cache(tgmm_schedule.CACHE)
    for r in rows:
        if r["impl"] != "ours" or "error" in r:
            continue
        model = cache[r["cache_key"]]["_model"]
        tm, tk, tn = r["tiles"]
        buckets = T.bucket_sizes(tm, T.row_unit("bfloat16", "bfloat16"))
        assert len(model["side_region_bundles"]) == len(buckets), r["cache_key"]
        # region MXU pushes, program order: each bucket pushes at least as much as the smaller
        side = [x for x in model["regions"] if x[2] and model["work"][0] <= x[0]][-len(buckets) :]
        assert [x[1] - x[0] - 1 for x in side] == model["side_region_bundles"]
        assert all(a[2] <= b[2] for a, b in zip(side, side[1:])), side
        first = schedule_model.step_regions(model)["first"]
        zero_fill = [x for x in model["regions"] if x[1] - x[0] - 1 == first]
        # (a store or two may issue in the branch's delay slots, outside the region)
        assert zero_fill and zero_fill[0][2] == 0, zero_fill
        assert 0 <= tk * tn * 2 // 4096 - zero_fill[0][4] <= 4, zero_fill

    pkg = kernel_loader.load_kernel("ragged_dot")
    gs = np.asarray([300, 0, 128, 17, 0, 400], np.int32)
    t = T.TgmmTiling(tm=128, tk=256, tn=512)
    trips = ours.tgmm_trips(pkg, gs, 1000, 768, 1024, "bfloat16", t, "v5e")
    unit = T.row_unit("bfloat16", "bfloat16")
    wl = T._fields(
        T.work_list(gs, m=1000, tm=128, buckets=T.bucket_sizes(128, unit), unit=unit, kind="tgmm")
    )
    chunks = 512 // T.window_cols(256, 512, T.get_generation("v5e"), 128, unit)
    tails = ((wl["FLAGS"] & T.F_COMPUTE) != 0) & (wl["BUCKET"] >= 0)
    runs = np.bincount(wl["BUCKET"][tails], minlength=len(T.bucket_sizes(128, unit)))
    assert trips["side_region_runs"] == (runs * chunks * 3 * 2).tolist()
    assert trips["output_tiles"] == 2 * 3 * 2  # two empty groups, 3 K tiles x 2 N tiles
    assert trips["step_work"]["side"].sum(axis=0).tolist() == trips["side_region_runs"]


def test_gmm_ranking_overlaps_each_steps_copies_with_its_compute():
    """The gmm tile ranking overlaps compute and copies grid step by grid step
    (tpu_generations.overlapped_step_seconds on tiling.gmm_step_profile) and, at equal bytes,
    takes the faster tiles: on a TPU v5e chip Qwen3-30B-A3B down ran 3276 us at 512-row tiles
    and 3441 at 1024 at 16384 tokens (results/device/v5e_gmm_tile_sweep*.json,
    v5e_ragged_ours_step_overlap.json); the compiled schedule orders them the same. Whole-call
    overlap with the fewest grid steps between ties picked 1024 at both. At 4096 tokens, with
    the weight blocks copied a run ahead, 256-row tiles ran 878 us against 944 (512) and 983
    (1024) (v5e_gmm_tile_sweep_run_ahead.json); the step model without the run-ahead copies
    picked 1024 there."""
    import kernel_loader
    from tpu_generations import overlapped_step_seconds, ranked_seconds

    T = kernel_loader.load_kernel("ragged_dot").tiling
    # the rule: a step's compute hides the next step's reads and the previous step's writes
    # (step 0 hides step 1's 3: exposed 1; the first read and the last write wait)
    assert overlapped_step_seconds([2, 2, 2], [1, 3, 1], [1, 1, 1]) == 1 + 3 + 2 + 2 + 1
    v5e = T.get_generation("v5e")
    picks = {}
    for tokens in (4096, 16384):
        m, bf16 = tokens * 8, "bfloat16"
        t = T.gmm_tiling(m, 768, 2048, bf16, bf16, bf16, num_groups=128, generation="v5e")
        picks[tokens] = t.tm
        cost = T.gmm_candidate_cost(v5e, m, 768, 2048, 128, bf16, bf16, bf16, t.tm, 768, 2048)
        whole = dataclasses.replace(cost, step_profile=None)
        assert ranked_seconds(cost, v5e) > ranked_seconds(whole, v5e)  # copies exposed
    assert picks == {4096: 256, 16384: 512}


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


def _main_on_a_jax_only_machine(module: str, argv: list[str], timeout: int = 380) -> None:
    """`module.main(argv)` in a fresh process where torch and the `kernels` library cannot be
    imported, as on the TPU VM the chip runs use (JAX only)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['kernels'] = None\n"
        f"import {module}\n{module}.main({argv!r})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.tpu_interpret
@pytest.mark.timeout(400)
def test_device_run_needs_no_torch_and_checks_the_kernels(tmp_path):
    """The TPU VM run (`device_timing.py check`) loads the kernels as plain JAX packages, with
    torch and the `kernels` library unimportable, and its compiled-kernel checks pass against the
    f32 references; here in TPU interpret mode on the CPU, the ragged dot only (the chip runs
    all three)."""
    out = tmp_path / "check.json"
    args = ["check", "--kernel", "ragged_dot", "--generation", "v5e", "--interpret"]
    _main_on_a_jax_only_machine("device_timing", args + ["--out", str(out)])
    cases = json.loads(out.read_text())["cases"]
    names = {c["shape"] for c in cases}
    assert {"tgmm", "gmm_int8_weights", "gmm_rows_past_groups"} <= names
    assert all(c["ok"] for c in cases), [c for c in cases if not c["ok"]]


@pytest.mark.tpu_interpret
@pytest.mark.timeout(400)
def test_training_passes_compute_the_same_thing_in_every_implementation(tmp_path):
    """`training_timing.py` (the training passes timed on the chip) in TPU interpret mode on
    the CPU, torch unimportable as on a TPU VM: each pass's anchors (megablox's dlhs / tgmm /
    gmm + XLA gating, splash's fused backward) and ours give the same outputs, so the chip's
    times compare like with like."""
    out = tmp_path / "train.json"
    args = ["--interpret", "--kernel", "ragged_dot", "--kernel", "flash_attention"]
    args += ["--flash-tiles", "128,128,384,128,1"]  # a three-tile kv block, the fused backward
    _main_on_a_jax_only_machine("training_timing", args + ["--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    passes = {(r["impl"], r["pass"]) for r in rows}
    for impl in ("anchor:megablox_large", "anchor:megablox_tall"):
        assert {(impl, p) for p in ("dlhs", "tgmm", "gmm_then_xla_silu")} <= passes
    assert {("ours", "gated_silu"), ("ours", "fwd_bwd"), ("anchor:splash", "fwd_bwd")} <= passes
    assert ("ours@128,128,384,128,1", "fwd_bwd") in passes
    assert {("ours", "gated_swiglu_interleaved"), ("ours", "gmm_then_xla_swiglu_interleaved")} <= (
        passes
    )
    checked = [r for r in rows if "rel_err_vs_first" in r]
    # each pass's first implementation is the reference: dlhs, tgmm, the SiLU gate, GPT-OSS's
    # interleaved gate, attention's forward + backward
    assert len(checked) == len(rows) - 5
    assert all(r["rel_err_vs_first"] < 2e-2 for r in checked), checked


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch", [1, 2])
def test_device_timing_checks_flash_against_splash_on_the_same_inputs(batch):
    """The chip run's check of our named flash row against splash on the same inputs (splash
    takes [H, S, D] without a batch axis at batch 1: the check failed there before, unnoticed,
    as "anchor_check_error"); in TPU interpret mode at a small shape."""
    from jax.experimental.pallas import tpu as pltpu

    import device_timing
    import ours
    import shapes

    shape = shapes.AttentionShape("check_same_inputs", batch, 2, 1, 512, 128)
    fn, args = ours.ADAPTERS["flash_attention"].call(shape, "v5e")
    with pltpu.force_tpu_interpret_mode():
        err = device_timing._same_inputs_check("flash_attention", shape, "v5e", fn, args)
    assert err < 2e-2


@pytest.mark.tpu_interpret
@pytest.mark.timeout(400)
def test_tile_sweep_times_flash_at_given_tiles(tmp_path):
    """`tile_sweep.py --kernel flash_attention` (torch unimportable, TPU interpret mode): the
    kernel's own tiles and each given tiling are timed, a three-tile block included."""
    out = tmp_path / "sweep.json"
    args = ["--kernel", "flash_attention", "--shape", "flux_dev_joint4608", "--interpret"]
    args += ["--tiles", "384,128,384,128", "--out", str(out)]
    _main_on_a_jax_only_machine("tile_sweep", args)
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel_choice"] for r in rows] == [True, False]
    assert rows[1]["tiles"] == [384, 128, 384, 128]
    assert all(r["measured_us"] > 0 for r in rows), rows


@pytest.mark.compile
@pytest.mark.timeout(300)
def test_tile_sweep_schedules_flash_tilings_as_the_named_row(tmp_path):
    """`tile_sweep.py --kernel flash_attention --scheduled v5e`: at the kernel's own tiles the
    deviceless compile of schedule_targets.compile_flash_tiles is the named row's program, so
    its scheduled time is the row's in results.json."""
    import tile_sweep

    out = tmp_path / "sweep.json"
    tile_sweep.main(
        ["--kernel", "flash_attention", "--shape", "flux_dev_joint4608", "--scheduled", "v5e"]
        + ["--out", str(out)]
    )
    (got,) = json.loads(out.read_text())["rows"]
    row = next(
        r
        for r in json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())[
            "named"
        ]["rows"]
        if r["shape"] == "flux_dev_joint4608" and r["impl"] == "ours"
    )
    want = row["per_generation"]["v5e"]["scheduled"]["scheduled_us"]
    assert got["kernel_choice"] and got["scheduled_us"] == pytest.approx(want, rel=1e-6)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "pass_name, shape, tm",
    [("tgmm", "qwen3_30b_a3b_down_t16384", 256), ("dlhs", "mixtral_8x7b_gate_t4096", 64)],
)
def test_tile_sweep_times_a_ragged_pass_at_its_own_and_other_row_tiles(
    tmp_path, pass_name, shape, tm
):
    """`tile_sweep.py --pass tgmm|dlhs` (torch unimportable, TPU interpret mode): the weight
    gradient at the tiles tgmm_schedule.py rows (the kernel's own), or the gmm's dlhs call at its
    own tiles, and each at `--vary`'s row tile, the pass recorded for report.py's table."""
    out = tmp_path / "sweep.json"
    args = ["--pass", pass_name, "--shape", shape, "--interpret"]
    args += ["--vary", f"tm={tm}", "--out", str(out)]
    _main_on_a_jax_only_machine("tile_sweep", args)
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["pass"] == pass_name
    assert [r["kernel_choice"] for r in rows] == [True, False], rows
    assert rows[1]["tiles"] == [tm] + rows[0]["tiles"][1:]
    assert all(r["measured_us"] > 0 for r in rows), rows


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tile_sweeps_dlhs_call_is_dy_times_the_transposed_weights():
    """What `tile_sweep.py --pass dlhs` times (`_dlhs_call`), in TPU interpret mode at the
    sweep's small shape: dy @ w[g].T of each row's group, against an f32 reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    import ours
    import tile_sweep

    shape = tile_sweep.SMALL["ragged_dot"]
    adapter = ours.ADAPTERS["ragged_dot"]
    tiles = ours.gmm_variant_tiles(adapter.mod, shape, "dlhs", "v5e")
    fn, (dy, w, gs) = tile_sweep._dlhs_call(adapter, shape, "v5e", tiles)
    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(jax.jit(fn)(dy, w, gs), np.float32)
    rows_of = np.repeat(np.arange(shape.experts), np.asarray(gs))
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    want = np.einsum("mn,mkn->mk", f32(dy), f32(w)[rows_of], dtype=np.float32)
    assert got.shape == (shape.m, shape.k)
    np.testing.assert_allclose(
        got, want.astype(jnp.bfloat16).astype(np.float32), rtol=2e-2, atol=0.25
    )


def test_run_shape_replaces_only_that_shapes_rows_in_place():
    """`run.py --kernel K --shape NAME` (rows.merge_section with shape_names): the shape's rows
    replace the old ones where they stood; other shapes and kernels keep theirs; a row the new
    run adds goes after its kernel's rows."""
    import rows

    def row(kind, shape, impl, v):
        return {"kernel": kind, "shape": shape, "impl": impl, "v": v}

    old = {
        "rows": [
            row("ragged_dot", "a", "ours", 0),
            row("flash_attention", "x", "ours", 0),
            row("flash_attention", "y", "anchor:splash", 0),
            row("flash_attention", "y", "ours", 0),
            row("flash_attention", "z", "ours", 0),
        ],
        "missing": {},
    }
    new = {
        "rows": [
            row("flash_attention", "y", "anchor:splash", 1),
            row("flash_attention", "y", "ours", 1),
            row("flash_attention", "y", "anchor:new", 1),
        ],
        "missing": {},
        "generations": ["v5e"],
    }
    got = rows.merge_section(old, new, ["flash_attention"], ["y"])["rows"]
    assert [(r["shape"], r["impl"], r["v"]) for r in got] == [
        ("a", "ours", 0),
        ("x", "ours", 0),
        ("y", "anchor:splash", 1),
        ("y", "ours", 1),
        ("z", "ours", 0),
        ("y", "anchor:new", 1),
    ]


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


def test_bucket_cache_prune_keeps_each_compiles_current_sources(tmp_path, monkeypatch):
    """bucket_padding.prune_cache: per (op, tiles, static configuration, generation), the
    compile of the op's current sources supersedes older ones; a configuration with none keeps
    all of its entries, and so does an op no longer listed."""
    import bucket_padding

    op = next(iter(bucket_padding.OPS))
    prefix = bucket_padding._prefix(op, (128, 128), "v6e")
    other = bucket_padding._prefix(op, (256, 128), "v6e")
    gone = "no_such_op|128|{}|v6e|"
    cache = {
        prefix + bucket_padding._source_hash(op): {"bundles": 1},
        prefix + "0000000000000000": {"bundles": 2},
        other + "0000000000000000": {"bundles": 3},
        other + "1111111111111111": {"bundles": 4},
        gone + "2222222222222222": {"bundles": 5},
    }
    path = tmp_path / "bucket_cache.json"
    path.write_text(json.dumps(cache))
    monkeypatch.setattr(bucket_padding, "CACHE", path)
    assert bucket_padding.prune_cache() == (5, 4)
    assert set(json.loads(path.read_text())) == set(cache) - {prefix + "0000000000000000"}


def test_flash_dump_points_selects_the_points_loop():
    """flash_dump_points.select_loop takes, among the innermost loops holding whole tiles, the
    masked (vsel) or mask-free one the point names (and for the forward, on the path it names),
    the longest such, and reports bundles per tile over the tiles in its body; a point whose loop
    is missing is refused."""
    import flash_dump_points

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
    masked = flash_dump_points.select_loop(schedule, {"masked": True}, 384)
    assert masked["hot_loop_bundles"] == 4334 and masked["tiles_per_iteration"] == 2
    assert masked["dump_bundles_per_tile"] == 2167.0
    assert masked["loop"] == "masked edge tiles (vsel), 2 per straight-line group"
    free = flash_dump_points.select_loop(schedule, {"masked": False}, 768)
    assert free["hot_loop_bundles"] == 3667 and free["tiles_per_iteration"] == 1
    assert free["loop"] == "mask-free tiles" and free["mxu_occupancy"] == 0.5
    with pytest.raises(ValueError, match="mask-free"):
        flash_dump_points.select_loop({"loops": schedule["loops"][1:2]}, {"masked": False}, 384)
    # The dq pass's group loop holds a masked and a mask-free body, one run per group: each
    # point reads its own branch, not the loop (TPU7x Llama-3-8B dq, 1024 x 512 tiles).
    mixed = loop(7333, vmatmul=1536, vsel=802)
    mixed["branches"] = [
        {"bundles": 3618, "ops": {"vmatmul": 768}, "occupancy": {"MXU": 0.673, "VALU": 0.4}},
        {"bundles": 3702, "ops": {"vmatmul": 768, "vsel": 802}, "occupancy": {"MXU": 0.656}},
    ]
    mixed["branches"][1]["occupancy"]["VALU"] = 0.5
    dq = {"loops": [loop(9000, children=1, dma=4), mixed]}
    masked = flash_dump_points.select_loop(dq, {"masked": True}, 384)
    assert masked["hot_loop_bundles"] == 3702 and masked["dump_bundles_per_tile"] == 1851.0
    free = flash_dump_points.select_loop(dq, {"masked": False}, 384)
    assert free["hot_loop_bundles"] == 3618 and free["mxu_occupancy"] == 0.673
    # The forward's points name their path: the interior path's q-tile loop (one body, no
    # select) or a body of the edge walk's group loop (v6e Llama-3-8B window 1024, 512 pushes a
    # tile), even where the interior loop is the longer mask-free one.
    interior = loop(10300, vmatmul=2048, vpow2=4096)
    fwd = {"loops": [loop(40000, children=2, dma=6), interior, mixed]}
    walk = [
        {"bundles": 10230, "ops": {"vmatmul": 2048}, "occupancy": {"MXU": 0.79, "VALU": 0.55}},
        {"bundles": 12629, "ops": {"vmatmul": 2048, "vsel": 64}, "occupancy": {"MXU": 0.64}},
    ]
    walk[1]["occupancy"]["VALU"] = 0.61
    mixed["branches"] = walk
    inner = flash_dump_points.select_loop(fwd, {"masked": False, "path": "interior"}, 512)
    assert inner["hot_loop_bundles"] == 10300 and inner["tiles_per_iteration"] == 4
    assert inner["loop"] == "interior path, mask-free tiles, 4 per straight-line group"
    free = flash_dump_points.select_loop(fwd, {"masked": False, "path": "walk"}, 512)
    assert free["hot_loop_bundles"] == 10230
    masked = flash_dump_points.select_loop(fwd, {"masked": True, "path": "walk"}, 512)
    assert masked["hot_loop_bundles"] == 12629 and masked["dump_bundles_per_tile"] == 3157.2
    with pytest.raises(ValueError, match="interior"):
        flash_dump_points.select_loop(dq, {"masked": False, "path": "interior"}, 384)


def _paged_named(name):
    return next(s for s in shapes.NAMED["paged_attention"] if s.name == name)


@pytest.mark.parametrize(
    "shape_name", ["llama3_8b_mixed_63dec_prefill2048", "llama3_8b_decode_b64_ctx8192_int8", "int8"]
)
def test_paged_step_work_adds_up_to_the_call(shape_name):
    """The paged kernel's per-grid-step work (one step per q block, what the schedule overlaps
    step by step) sums to the call's: each step's trip counts to `schedule_trips`' (paths,
    items, rolled loops; an int8 batch's spreading matrix once per call, also over several q
    blocks: "int8", 40 decoding sequences and a 300-token prefill chunk), its MXU FLOPs and its
    copies (q block, KV pages and per-token scales, output block, the prefetched tables) to the
    closed form's."""
    import dataclasses

    import numpy as np

    import ours

    a = ours.ADAPTERS["paged_attention"]
    if shape_name == "int8":
        shape = dataclasses.replace(
            _paged_named("llama3_8b_decode_b64_ctx8192_int8"),
            name="int8_mixed",
            seqs=((1, 1000),) * 40 + ((300, 700),),
        )
    else:
        shape = _paged_named(shape_name)
    for gen in ("v5e", "tpu7x"):
        trips = a.schedule_trips(shape, gen)
        steps = trips["step_work"]
        cost, _ = a.cost(shape, gen)
        n = cost.grid_steps
        assert len(steps["trips"]) == n and all(len(steps[k]) == n for k in steps)
        per = steps["trips"]
        assert sum(t["work_items"] for t in per) == trips["work_items"] == cost.work_items
        runs = [t.get("branch_runs", [t.get("hot_iterations")]) for t in per]
        call_runs = trips.get("branch_runs", [trips.get("hot_iterations")])
        assert np.sum(runs, axis=0).tolist() == list(call_runs)
        assert steps["hot"].sum() == sum(call_runs)
        for level in ("loop_trips", "block_loop_trips"):
            assert [list(t[level]) for t in per] == [list(trips[level])] * n
            for name, value in trips[level].items():
                got = np.sum([t[level][name] for t in per], axis=0)
                assert np.array_equal(got, value), (level, name, got, value)
        assert steps["mxu"].sum() == cost.mxu_flops
        moved = steps["reads"].sum() + steps["streams"].sum() + steps["writes"].sum()
        assert moved == cost.hbm_bytes
        assert n > 1 or shape_name != "int8"
        if shape_name.startswith("llama3_8b_mixed"):
            # the decode q block first (63 sequences x 8 KV blocks on the narrow path, and the
            # prefill's first tokens), then the prefill's q blocks, 7 or 8 KV blocks each
            assert per[0]["branch_runs"][0] == trips["branch_runs"][0] >= 504
            assert steps["hot"][0] == 511
            assert set(steps["hot"][1:]) <= {7.0, 8.0}


def _per_step_and_pooled(kind, shape, model, align=False):
    """One of our rows on v5e through the schedule model from `model` (a compile's numbers, no
    compile): (its step_work, the pooled time, the per-step time, each step timed alone: its
    bundles, MXU floor and copies). The pooled part of the per-step result is the pooled time,
    and the steps' bundles add up to the call's. `align`: put the named loop trips on the
    model's loops (what schedule_rows does for the paged rows)."""
    import numpy as np

    import ours
    import schedule_model as M
    from tpu_generations import GENERATIONS

    gen = GENERATIONS["v5e"]
    a = ours.ADAPTERS[kind]
    cost, _ = a.cost(shape, gen.name)
    trips = a.schedule_trips(shape, gen.name)
    steps = trips.pop("step_work")
    if align:
        for t in [trips, *steps["trips"]]:
            t["loop_trips"] = M.align_loop_trips(model["step_loops"], t["loop_trips"])
            t["block_loop_trips"] = M.align_loop_trips(model["block_loops"], t["block_loop_trips"])
    kw = dict(mxu_flops=cost.mxu_flops, grid_steps=cost.grid_steps, generation=gen)
    pooled = M.scheduled_from_work(model, hbm_bytes=cost.hbm_bytes, **kw, **trips)
    t = M.scheduled_from_work(model, hbm_bytes=cost.hbm_bytes, step_work=steps, **kw, **trips)
    assert t["pooled_work_us"] + t["step_overhead_us"] + t["fixed_us"] == pytest.approx(
        pooled["scheduled_us"], abs=2e-3
    )
    streams = steps.get("streams", np.zeros(len(steps["mxu"])))
    alone = [
        M.scheduled_from_work(
            model, mxu_flops=m, grid_steps=1, hbm_bytes=r + s + w, generation=gen, **tr
        )
        for tr, m, r, s, w in zip(
            steps["trips"], steps["mxu"], steps["reads"], streams, steps["writes"]
        )
    ]
    assert sum(x["bundle_us"] for x in alone) == pytest.approx(pooled["bundle_us"], rel=1e-6)
    return steps, pooled, t, alone


def test_paged_per_step_overlap_charges_the_decode_steps_dma_and_the_prefill_steps_compute():
    """The mixed batch's decode q block is DMA-bound (63 sequences' pages under little
    compute) and its prefill q blocks compute-bound: overlapped step by step they cost the
    decode step's copies plus the prefill steps' bundles, well above the pooled max(compute,
    DMA) of the call (on a TPU v5e chip the row measured 1.58x the pooled time). Each step is
    charged its own trips' bundles: the time equals the per-step rule applied to each step
    timed alone. No compile: a model with the v5e schedule's numbers (paths, rolled loops)."""
    import numpy as np

    from tpu_generations import GENERATIONS

    model = {  # llama3_8b_mixed_63dec_prefill2048 on v5e, as work_model_inputs read it
        "items_in_step": True, "hot_is_grid": True, "outside_bundles": 29, "xla": [],
        "block_bundles": 730, "step_bundles": 24429, "idle_step_bundles": 440, "regions": [],
        "block_loops": [[295, 345, 50, -1, 0, 0], [24785, 24800, 15, -1, 0, 0]],
        "mxu_branches": [[1574, 128], [22415, 4096]],
        "step_loops": [[12, 176, 139, -1, 3, 0], [42, 67, 25, 0, 1, 0],
                       [225, 229, 4, -1, 1, 0], [287, 423, 136, -1, 0, 0]],
    }  # fmt: skip
    gen = GENERATIONS["v5e"]
    shape = _paged_named("llama3_8b_mixed_63dec_prefill2048")
    steps, pooled, t, alone = _per_step_and_pooled("paged_attention", shape, model, align=True)
    compute = np.array([max(x["bundle_us"], x["mxu_floor_us"]) for x in alone])
    us = lambda b: np.asarray(b) / gen.hbm_bytes_per_s * 1e6  # noqa: E731
    reads, streams, writes = us(steps["reads"]), us(steps["streams"]), us(steps["writes"])
    hidden = np.r_[reads[1:], 0.0] + np.r_[0.0, writes[:-1]] + streams
    assert hidden[0] > 2 * compute[0] and (compute[1:] > hidden[1:]).all()
    want = reads[0] + np.maximum(compute, hidden).sum() + writes[-1]
    assert t["scheduled_us"] == pytest.approx(
        want + t["step_overhead_us"] + t["fixed_us"], rel=1e-4
    )
    # the decode step's copies plus the prefill steps' compute: ~1.4x the pooled time
    assert t["scheduled_us"] > 1.3 * pooled["scheduled_us"]


def _flash_named(name):
    return next(s for s in shapes.NAMED["flash_attention"] if s.name == name)


# The v5e schedule models of two of our flash forward rows, as work_model_inputs read them
# (results/schedule_cache.json): causal (interior path, edge walk) and packed documents (segment
# ids: the edge walk only, one masked tile per hot-loop iteration).
_FLASH_V5E_MODELS = {
    "llama3_8b_causal_8192": {
        "hot_bundles": 17178, "hot_is_grid": False, "outside_bundles": 36, "xla": [],
        "mxu_branches": [[17182, 4096], [22835, 4608]], "per_step_overhead_bundles": 12300,
        "side_region_mean_bundles": 22835.0, "step_bundles": 52313,
    },
    "llama3_8b_packed8x1024_8192": {
        "hot_bundles": 1567, "hot_is_grid": False, "outside_bundles": 52, "xla": [],
        "mxu_branches": [], "per_step_overhead_bundles": 12256,
        "side_region_mean_bundles": 0.0, "step_bundles": 13858,
    },
}  # fmt: skip


@pytest.mark.parametrize("shape_name", ["llama3_8b_causal_8192", "llama3_8b_packed8x1024_8192"])
def test_flash_step_work_adds_up_to_the_call(shape_name):
    """Our flash forward's per-grid-step work (one step per (batch row, KV head, work item))
    sums to the call's: each step's trips (interior / edge pushes, or with segment ids hot
    iterations) to `schedule_trips`', its live tiles, MXU FLOPs and copies to the closed
    form's; on v5e (tiles 2048 / 256 / 2048 / 256) the copies follow the list by hand."""
    import numpy as np

    import ours

    a = ours.ADAPTERS["flash_attention"]
    shape = _flash_named(shape_name)
    packed = shape.segment_ids() is not None
    for gen in ("v5e", "tpu7x"):
        cost, info = a.cost(shape, gen)
        trips = a.schedule_trips(shape, gen)
        steps = trips.pop("step_work")
        n = cost.grid_steps
        assert len(steps["trips"]) == n and all(len(steps[k]) == n for k in steps)
        first = "hot_iterations" if packed else "branch_pushes"
        assert list(trips) == [first, "output_tiles", "output_loop_trips"]
        # the write-out loop's iterations per q block: the same on every step
        loop_trips = trips.pop("output_loop_trips")
        assert {t["output_loop_trips"] for t in steps["trips"]} == {loop_trips}
        assert loop_trips == 2  # 2048 rows: 16 chunks of 128, 8 an iteration
        for key, value in trips.items():
            got = np.sum([t[key] for t in steps["trips"]], axis=0)
            assert np.array_equal(got, value), (key, got, value)
        # one init and write-out per q block run: 8192 / 2048 q blocks x 8 KV heads
        assert trips["output_tiles"] == shape.kv_heads * -(-shape.seq // info["tiling"][0])
        assert steps["hot"].sum() == cost.compute_tiles
        assert steps["mxu"].sum() == cost.mxu_flops
        assert steps["reads"].sum() + steps["writes"].sum() == cost.hbm_bytes
        if gen != "v5e":
            continue
        assert info["tiling"] == [2048, 256, 2048, 256]
        qb, kvb, out = 4 * 2048 * 128 * 2, 2048 * 128 * 2, 4 * 2048 * 128 * 2 + 4 * 2048 * 4
        reads, writes = steps["reads"], steps["writes"]
        if packed:
            # each head: the 4 diagonal blocks, 2 documents x 10 causal tiles of 256 each, all
            # masked; every step copies its q, k, v blocks and both segment-id blocks and
            # writes its output
            assert n == 32 and [t["hot_iterations"] for t in steps["trips"]] == [20.0] * 32
            ids = 2048 * 128 * 4 + 8 * 2048 * 4
            assert set(reads[1:]) == {qb + 2 * kvb + ids} and set(writes) == {out}
        else:
            # each head: q blocks 0..3 against kv blocks 0..q (10 items); the diagonal item
            # runs 36 tiles of 8 x 8, 8 of them masked, the others 64 mask-free; k / v stay
            # when consecutive items share the kv block (q block 1's first item)
            assert n == 80
            diag = [0, 2, 5, 9]
            pushes = [[28 * 256, 8 * 256] if i in diag else [64 * 256, 0] for i in range(10)]
            assert [t["branch_pushes"] for t in steps["trips"]] == pushes * 8
            head = [qb + 2 * kvb, qb, 2 * kvb, qb + 2 * kvb, 2 * kvb, 2 * kvb]
            head += [qb + 2 * kvb, 2 * kvb, 2 * kvb, 2 * kvb]
            assert reads[10:].tolist() == head * 7 and reads[1:10].tolist() == head[1:]
            assert writes.tolist() == [out if i in diag else 0 for i in range(10)] * 8


def test_flash_per_step_overlap_differs_from_pooling():
    """The causal row on v5e (the model's numbers from its compile, no compile here), step by
    step: the diagonal steps run the edge walk (more bundles per tile than the interior
    steps), each step is charged its own trips' bundles and MXU floor, and every step's
    compute hides the next step's copies, so the time is the steps' compute plus the first
    step's copies in and the last step's out, above the pooled max(compute, DMA) by those."""
    import numpy as np

    from tpu_generations import GENERATIONS

    gen = GENERATIONS["v5e"]
    shape = _flash_named("llama3_8b_causal_8192")
    model = _FLASH_V5E_MODELS[shape.name]
    steps, pooled, t, alone = _per_step_and_pooled("flash_attention", shape, model)
    per_tile = np.array([x["bundle_us"] for x in alone]) / steps["hot"]
    diag = np.array([i in (0, 2, 5, 9) for i in range(10)] * 8)
    assert per_tile[diag].min() > 1.05 * per_tile[~diag].max()
    compute = np.array([max(x["bundle_us"], x["mxu_floor_us"]) for x in alone])
    us = lambda b: np.asarray(b) / gen.hbm_bytes_per_s * 1e6  # noqa: E731
    reads, writes = us(steps["reads"]), us(steps["writes"])
    assert (compute > np.r_[reads[1:], 0.0] + np.r_[0.0, writes[:-1]]).all()
    exposed = reads[0] + writes[-1]
    assert exposed > 5.0  # us: a q block and its K / V in, an output block out
    assert t["scheduled_us"] == pytest.approx(pooled["scheduled_us"] + exposed, abs=0.05)


def test_flash_packed_row_charges_a_hot_iteration_per_live_tile(monkeypatch):
    """With segment ids our flash forward compiles the edge walk only: its hot loop runs one
    masked tile per iteration (v5e: 256 vmatmul per 1,567-bundle body, the tiling's MXU pushes
    per tile), so the row's hot iterations are its live tiles (640), not its MXU FLOPs over the
    interior path's unrolled q tiles (40, which timed the row at 447 us against 1,106 us
    measured on a TPU v5e chip). schedule_entry on the v5e model, no compile."""
    import ours
    import schedule_rows

    gen = "v5e"
    shape = _flash_named("llama3_8b_packed8x1024_8192")
    model = _FLASH_V5E_MODELS[shape.name]
    entry = {"_model": model, "hot": {"bound": "VALU", "bundles": 1567}}
    monkeypatch.setattr(schedule_rows, "read_schedule", lambda *a, **k: entry)
    cost, info = ours.ADAPTERS["flash_attention"].cost(shape, gen)
    assert cost.compute_tiles == 640 and cost.mxu_pushes == 640 * 256
    out = schedule_rows.schedule_entry("flash_attention", "ours", shape, gen, cost, info)
    assert out["hot_iterations"] == 640
    bundles = 32 * 12256 + 640 * 1567
    assert out["bundle_us"] == pytest.approx(bundles / 1.5e9 * 1e6, abs=1e-3)
    assert 900 < out["scheduled_us"] < 1000


def test_tile_sweep_varies_one_field_of_the_kernels_own_tiling():
    """`tile_sweep.py --vary FIELD=V1,V2`: the own tiling with that field changed, the own value
    left out (the kernel's choice is timed anyway); a field of the other kernel is refused."""
    import tile_sweep

    names = tile_sweep.FIELDS["ragged_dot"]
    got = tile_sweep._variants([1024, 768, 2048], names, ["tm=512,1024,2048", "tn=1024"])
    assert got == [(512, 768, 2048), (2048, 768, 2048), (1024, 768, 1024)]
    with pytest.raises(SystemExit, match="block_kv"):
        tile_sweep._variants([1024, 768, 2048], names, ["block_kv=4096"])


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tile_sweep_times_the_flash_backward_alone(tmp_path):
    """`tile_sweep.py --kernel flash_attention --pass bwd` (torch unimportable, TPU interpret
    mode): the backward at the kernel's own backward tiles and with `--vary`'s fields changed
    (the two-pass form and a 128-key compute tile), its five fields recorded."""
    out = tmp_path / "sweep.json"
    args = ["--kernel", "flash_attention", "--pass", "bwd", "--shape", "flux_dev_joint4608"]
    args += ["--interpret", "--vary", "fused_bwd=0", "--vary", "block_kv_compute_bwd=128"]
    _main_on_a_jax_only_machine("tile_sweep", args + ["--out", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert doc["pass"] == "bwd" and [r["kernel_choice"] for r in rows] == [True, False, False]
    own = rows[0]["tiles"]
    assert len(own) == 5 and own[4] == 1, own  # the small shape's own backward is fused
    assert rows[1]["tiles"] == own[:4] + [0] and rows[2]["tiles"] == own[:3] + [128, 1], rows
    assert all(r["measured_us"] > 0 for r in rows), rows
