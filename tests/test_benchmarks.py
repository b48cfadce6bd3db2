"""Tests of the kernel microbenchmarks (benchmarks/): the DMA counter against traffic computed by
hand, the closed forms (ours and the JAX anchors) against the counter on small shapes, the
committed results against a fresh `run.py --small`, and the `kernels benchmark` files on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import blockspec_model  # noqa: E402
import dma_counter  # noqa: E402
import shapes  # noqa: E402

pytestmark = pytest.mark.tpu_interpret

# -------------------------------------------------------------------------------------------------
# The counter against hand-computed traffic
# -------------------------------------------------------------------------------------------------


def _matmul(x, y, bm, bk, bn, out_dtype):
    """A tiled matmul with grid (M/bm, N/bn, K/bk): the BlockSpec pipeline does all the copies."""
    M, K = x.shape
    N = y.shape[1]

    def kernel(x_ref, y_ref, o_ref, acc):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        acc[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(M // bm, N // bn, K // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                  pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, y)


@pytest.mark.timeout(120)
def test_counter_blockspec_copies_exact():
    # Grid (2, 3, 2). x's block index (i, k) changes at every step: 12 copies of 128x128 bf16.
    # y's (k, j) too: 12 copies of 128x128 bf16. The output block (i, j) is written when it
    # changes: 6 writes of 128x128 f32. 12 grid steps.
    x = jnp.ones((256, 256), jnp.bfloat16)
    y = jnp.ones((256, 384), jnp.bfloat16)
    with dma_counter.count_traffic() as t:
        out = jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.full((256, 384), 256.0, np.float32))
    blk16, blk32 = 128 * 128 * 2, 128 * 128 * 4
    assert t.grid_steps == 12
    assert t.blockspec_reads == 24 and t.blockspec_read_bytes == 24 * blk16
    assert t.blockspec_writes == 6 and t.blockspec_write_bytes == 6 * blk32
    assert t.hbm_bytes == 24 * blk16 + 6 * blk32
    assert t.dma_count == 0 and t.calls == 1 and t.prefetch_bytes == 0
    assert sorted(c for c, _ in t.by_operand.values()) == [6, 12, 12]


@pytest.mark.timeout(120)
def test_counter_skips_unchanged_blocks_and_keeps_grid_order():
    # With K in one block (grid (2, 3, 1)), x's block (i, 0) is the same for the three j steps
    # of each i: 2 copies, not 6; y's (0, j) changes every step: 6 copies. The grid's parallel
    # dimensions must be walked in order (one core), not in the interpreter's random order,
    # or x would be copied up to 6 times.
    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((128, 384), jnp.float32)
    with dma_counter.count_traffic() as t:
        jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))
    blk = 128 * 128 * 4
    assert t.grid_steps == 6
    assert t.blockspec_reads == 2 + 6 and t.blockspec_read_bytes == 8 * blk
    assert t.blockspec_writes == 6
    # The closed-form walker predicts the same.
    p = blockspec_model.pipeline_bytes((2, 3, 1), [
        blockspec_model.Operand("x", blk, lambda i, j, k: (i, k)),
        blockspec_model.Operand("y", blk, lambda i, j, k: (k, j)),
        blockspec_model.Operand("o", blk, lambda i, j, k: (i, j), is_output=True),
    ])
    assert (p["x"][0], p["y"][0], p["o"][0]) == (2, 6, 6)
    assert p["read"] + p["write"] == t.hbm_bytes


def _dma_kernel(x):
    """Three HBM->VMEM->HBM round trips of 8x128 f32 rows, by manual DMAs; scalar prefetch of
    the row order (int32[3])."""
    order = jnp.asarray([2, 0, 1], jnp.int32)

    def kernel(order_ref, x_hbm, o_hbm, buf, sem):
        for i in range(3):
            src = order_ref[i]
            c = pltpu.make_async_copy(x_hbm.at[pl.ds(src * 8, 8)], buf, sem.at[0])
            c.start()
            c.wait()
            c2 = pltpu.make_async_copy(buf, o_hbm.at[pl.ds(i * 8, 8)], sem.at[1])
            c2.start()
            c2.wait()

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32),
    )(order, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_counter_manual_dmas_exact(mode):
    x = jnp.arange(24 * 128, dtype=jnp.float32).reshape(24, 128)
    params = dma_counter.interpret_params(dma_execution_mode=mode)
    with dma_counter.count_traffic(params) as t:
        out = jax.block_until_ready(_dma_kernel(x))
    np.testing.assert_array_equal(np.asarray(out), np.concatenate([x[16:], x[:8], x[8:16]]))
    row = 8 * 128 * 4
    assert dict(t.dmas) == {("hbm", "vmem"): [3, 3 * row], ("vmem", "hbm"): [3, 3 * row]}
    assert t.hbm_read_bytes == 3 * row and t.hbm_write_bytes == 3 * row
    assert t.blockspec_reads == 0 and t.blockspec_writes == 0
    assert t.grid_steps == 1 and t.calls == 1
    assert t.prefetch_bytes == 3 * 4  # the int32[3] row order, outside hbm_bytes


@pytest.mark.timeout(60)
def test_counter_counts_nothing_outside_its_block():
    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((128, 128), jnp.float32)
    with dma_counter.count_traffic() as t:
        pass
    with pltpu.force_tpu_interpret_mode(dma_counter.interpret_params()):
        jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))  # not counted
    assert t.hbm_bytes == 0 and t.grid_steps == 0 and t.calls == 0


# -------------------------------------------------------------------------------------------------
# Closed forms against the counter, and the committed results, on the small shapes
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_section():
    import run

    fresh = run.small_section(log=lambda msg: None)
    return json.loads(json.dumps(fresh))  # as it is written: tuples become lists


def _row_ids():
    import run

    ids = []
    for kind in run.KINDS:
        for s in shapes.SMALL[kind]:
            for impl in [a.impl for a in run.ANCHORS[kind]] + ["ours"]:
                ids.append((kind, s.name, impl))
    return ids


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,shape,impl", _row_ids(), ids=lambda v: str(v))
def test_closed_form_equals_counted(small_section, kind, shape, impl):
    rows = [r for r in small_section["rows"]
            if (r["kernel"], r["shape"], r["impl"]) == (kind, shape, impl)]
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
        f"(by operand: {r['counted']['by_operand']}, DMAs: {r['counted']['dmas']})")
    assert r["closed_form_matches"] is True
    # The problem's useful FLOPs agree with the kernel's own count.
    assert r["kernel_useful_flops"] == r["useful_flops"]


@pytest.mark.timeout(900)
def test_committed_results_match_a_fresh_small_run(small_section):
    committed = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    assert committed["small"] == small_section, (
        "benchmarks/results/results.json is stale: run `python benchmarks/run.py --small` "
        "(or the full `python benchmarks/run.py`) and commit the results")


# -------------------------------------------------------------------------------------------------
# The `kernels benchmark` files, on CPU, through the kernels runner, from the built repos
# -------------------------------------------------------------------------------------------------


def _benchmark_files():
    # Files that hold a benchmark (an empty placeholder of a kernel not yet written is left out).
    return [p for p in sorted((ROOT / "benchmarks").glob("benchmark_*.py"))
            if "Benchmark" in p.read_text()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", _benchmark_files(), ids=lambda p: p.name)
def test_benchmark_file_runs_on_cpu(path, monkeypatch):
    import kernel_loader
    from kernels.cli import benchmark as kb

    dist = kernel_loader.built_collection()
    repos = [d for d in dist.iterdir() if (d / "benchmarks" / path.name).exists()]
    assert len(repos) == 1, f"no built repo ships {path.name}"
    repo = repos[0]
    assert (repo / "benchmarks" / path.name).read_bytes() == path.read_bytes()
    results, _ = kb.run_benchmark_script(
        repo / "benchmarks" / path.name, iterations=1, warmup=0, cwd=repo,
        repo_id=str(repo), is_local=True, revision="local")
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

    import run

    rows = [copy.deepcopy(r) for r in small_section["rows"]
            if r["shape"] == "small_causal_512" and r["impl"] in ("ours", "anchor:flash_attention")]
    assert len(rows) == 2
    section = {"rows": rows, "missing": {}, "generations": ["v6e"]}
    with pltpu.force_tpu_interpret_mode(dma_counter.interpret_params()):
        run.measure_on_device(section, ("flash_attention",), log=lambda m: None, iters=1,
                              warmup=0, device=jax.devices("cpu")[0], generation="v6e",
                              small=True)
    for r in rows:
        pg = r["per_generation"]["v6e"]
        assert pg["measured_us"] > 0
        assert pg["measured_fraction_of_roofline"] == pytest.approx(
            pg["roofline_us"] / pg["measured_us"], rel=1e-4)
