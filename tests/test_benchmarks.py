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
