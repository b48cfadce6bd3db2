"""Tests of torch-ext/tpu_interpreter.py: the traffic counter against traffic computed by hand on
tiny kernels, the race check on a kernel with a deliberate race, and the check of jax's private
interpreter API."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpu_interpreter

ROOT = Path(__file__).resolve().parent.parent

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
        kernel,
        grid=(M // bm, N // bn, K // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
            pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
    )(x, y)


@pytest.mark.timeout(120)
def test_counter_blockspec_copies_exact():
    # Grid (2, 3, 2). x's block index (i, k) changes at every step: 12 copies of 128x128 bf16.
    # y's (k, j) too: 12 copies of 128x128 bf16. The output block (i, j) is written when it
    # changes: 6 writes of 128x128 f32. 12 grid steps. Kernel-body loads: per step one x block,
    # one y block and the accumulator (twice at the last k step).
    x = jnp.ones((256, 256), jnp.bfloat16)
    y = jnp.ones((256, 384), jnp.bfloat16)
    with tpu_interpreter.count_traffic() as t:
        out = jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.full((256, 384), 256.0, np.float32))
    blk16, blk32 = 128 * 128 * 2, 128 * 128 * 4
    assert t.grid_steps == 12
    assert t.blockspec_reads == 24 and t.blockspec_read_bytes == 24 * blk16
    assert t.blockspec_writes == 6 and t.blockspec_write_bytes == 6 * blk32
    assert t.hbm_bytes == 24 * blk16 + 6 * blk32
    assert t.dma_count == 0 and t.calls == 1 and t.prefetch_bytes == 0
    assert sorted(c for c, _ in t.by_operand.values()) == [6, 12, 12]
    assert t.body_loads == {(128, 128): 3 * 12 + 6}


@pytest.mark.timeout(120)
def test_counter_skips_unchanged_blocks_and_keeps_grid_order():
    # With K in one block (grid (2, 3, 1)), x's block (i, 0) is the same for the three j steps
    # of each i: 2 copies, not 6; y's (0, j) changes every step: 6 copies. The grid's parallel
    # dimensions must be walked in order (one core), not in the interpreter's random order,
    # or x would be copied up to 6 times.
    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((128, 384), jnp.float32)
    with tpu_interpreter.count_traffic() as t:
        jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))
    blk = 128 * 128 * 4
    assert t.grid_steps == 6
    assert t.blockspec_reads == 2 + 6 and t.blockspec_read_bytes == 8 * blk
    assert t.blockspec_writes == 6 and t.blockspec_write_bytes == 6 * blk


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
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32),
    )(order, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_counter_manual_dmas_exact(mode):
    x = jnp.arange(24 * 128, dtype=jnp.float32).reshape(24, 128)
    params = tpu_interpreter.counting_params(dma_execution_mode=mode)
    with tpu_interpreter.count_traffic(params) as t:
        out = jax.block_until_ready(_dma_kernel(x))
    np.testing.assert_array_equal(np.asarray(out), np.concatenate([x[16:], x[:8], x[8:16]]))
    row = 8 * 128 * 4
    assert dict(t.dmas) == {("hbm", "vmem"): [3, 3 * row], ("vmem", "hbm"): [3, 3 * row]}
    assert t.hbm_read_bytes == 3 * row and t.hbm_write_bytes == 3 * row
    assert t.blockspec_reads == 0 and t.blockspec_writes == 0
    assert t.grid_steps == 1 and t.calls == 1
    assert t.prefetch_bytes == 3 * 4  # the int32[3] row order, outside hbm_bytes
    # The kernel body loads only the three SMEM scalars order_ref[i]: the DMAs' reads of HBM and
    # VMEM are not kernel-body loads.
    assert t.body_loads == {(): 3}


@pytest.mark.timeout(60)
def test_counter_counts_nothing_outside_its_block():
    x = jnp.ones((256, 128), jnp.float32)
    y = jnp.ones((128, 128), jnp.float32)
    with tpu_interpreter.count_traffic() as t:
        pass
    with pltpu.force_tpu_interpret_mode(tpu_interpreter.counting_params()):
        jax.block_until_ready(_matmul(x, y, 128, 128, 128, jnp.float32))  # not counted
    assert t.hbm_bytes == 0 and t.grid_steps == 0 and t.calls == 0 and not t.body_loads


# -------------------------------------------------------------------------------------------------
# The race check
# -------------------------------------------------------------------------------------------------


def _copy_twice(x, racy: bool):
    """DMAs x into a VMEM buffer twice and copies the buffer out. The racy version reads the
    buffer while the second DMA into it may still be writing."""

    def kernel(x_hbm, o_ref, buf, sems):
        first = pltpu.make_async_copy(x_hbm, buf, sems.at[0])
        first.start()
        first.wait()
        second = pltpu.make_async_copy(x_hbm, buf, sems.at[1])
        second.start()
        if racy:
            o_ref[...] = buf[...]
            second.wait()
        else:
            second.wait()
            o_ref[...] = buf[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        grid=(1,),
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), x.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=tpu_interpreter.checking_params(),
    )(x)


@pytest.mark.timeout(120)
def test_deliberate_race_is_found():
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with pytest.raises(tpu_interpreter.RaceDetected, match="race in the racy copy"):
        with tpu_interpreter.race_checked("the racy copy"):
            jax.block_until_ready(_copy_twice(x, racy=True))
    assert not tpu_interpreter.races_found()  # race_checked left a fresh state behind
    with tpu_interpreter.race_checked("the copy"):
        out = jax.block_until_ready(_copy_twice(x, racy=False))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


@pytest.mark.timeout(120)
def test_race_check_and_counter_together():
    """The paged-attention tests' pattern: count with race detection on, in one block."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    params = tpu_interpreter.counting_params(detect_races=True, dma_execution_mode="on_wait")
    with pytest.raises(tpu_interpreter.RaceDetected):
        with tpu_interpreter.race_checked(), tpu_interpreter.count_traffic(params) as t:
            jax.block_until_ready(_copy_twice(x, racy=True))
    assert t.dmas == {("hbm", "vmem"): [2, 2 * 8 * 128 * 4]}
    assert t.blockspec_writes == 1 and t.grid_steps == 1


# -------------------------------------------------------------------------------------------------
# The private API it depends on
# -------------------------------------------------------------------------------------------------


def test_written_for_the_pinned_jax():
    """Whoever moves the jax pin must look at tpu_interpreter.py: it patches private names."""
    pinned = re.search(r"^jax==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert tpu_interpreter.JAX_VERSION == pinned == jax.__version__


def test_moved_private_names_fail_clearly(monkeypatch):
    import importlib

    ipc = importlib.import_module(tpu_interpreter._PRIVATE_MODULE)
    monkeypatch.setattr(tpu_interpreter, "_checked", {})
    monkeypatch.delattr(ipc, "races")
    with pytest.raises(
        tpu_interpreter.InterpreterAPIError,
        match=r"race check.*jax==0\.10\.2.*interpret_pallas_call\.races",
    ):
        tpu_interpreter.races_found()
    monkeypatch.undo()

    monkeypatch.setattr(tpu_interpreter, "_checked", {})
    monkeypatch.setattr(ipc, "store", lambda token, val: None)
    with pytest.raises(
        tpu_interpreter.InterpreterAPIError,
        match=r"traffic counter.*interpret_pallas_call\.store\(",
    ):
        with tpu_interpreter.count_traffic():
            pass
