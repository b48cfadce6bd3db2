"""The torch <-> JAX bridge (torch-ext/jax_bridge.py), through the toy kernel's built package."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import jax_bridge
import toy_kernel


@pytest.fixture(scope="module")
def toy():
    return toy_kernel.load_toy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_jax_function(toy, dtype):
    x = torch.randn(24, 128).to(dtype)
    y = torch.randn(24, 128).to(dtype)
    out = toy.scale_add(x, y, 0.5)
    assert out.dtype == dtype and out.shape == x.shape
    direct = toy.kernel.scale_add(jax_bridge.to_jax(x), jax_bridge.to_jax(y), 0.5, interpret=True)
    np.testing.assert_array_equal(out.float().numpy(), np.asarray(direct.astype(jnp.float32)))
    ref = toy.reference.scale_add(jax_bridge.to_jax(x), jax_bridge.to_jax(y), 0.5)
    np.testing.assert_allclose(
        out.float().numpy(),
        np.asarray(ref.astype(jnp.float32)),
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
    )


def test_opcheck(toy):
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    torch.library.opcheck(toy.ops.scale_add_op, (x, y, 2.0))


def test_torch_compile_fullgraph(toy):
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    fn = torch.compile(lambda a, b: toy.scale_add(a, b, 3.0) * 2, fullgraph=True)
    torch.testing.assert_close(fn(x, y), (3 * x + y) * 2)


def test_autograd(toy):
    x = torch.randn(16, 128, requires_grad=True)
    y = torch.randn(16, 128, requires_grad=True)
    grad = torch.randn(16, 128)
    toy.scale_add(x, y, 1.5).backward(grad)
    torch.testing.assert_close(x.grad, 1.5 * grad)
    torch.testing.assert_close(y.grad, grad)


def test_meta_tensors(toy):
    x = torch.empty(16, 128, device="meta", dtype=torch.bfloat16)
    out = toy.scale_add(x, x, 1.0)
    assert out.device.type == "meta" and out.shape == (16, 128) and out.dtype == torch.bfloat16


def test_op_name_carries_the_package_namespace(toy):
    namespace = toy._ops._OPS_NAME
    assert namespace.startswith("_toy_scale_tpu_cpu_")
    assert toy.ops.scale_add_op._qualname == f"{namespace}::scale_add"
    assert hasattr(getattr(torch.ops, namespace), "scale_add")


def test_zero_copy_both_ways():
    t = torch.randn(8, 128)
    a = jax_bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = jax_bridge.to_torch(a)
    assert back.data_ptr() == t.data_ptr()
    b = torch.randn(8, 128).to(torch.bfloat16)
    assert jax_bridge.to_jax(b).unsafe_buffer_pointer() == b.data_ptr()


def test_float8_crosses_as_bytes():
    t = torch.randn(4, 16).to(torch.float8_e4m3fn)
    a = jax_bridge.to_jax(t)
    assert a.dtype == jnp.float8_e4m3fn
    assert torch.equal(jax_bridge.to_torch(a).view(torch.uint8), t.view(torch.uint8))


def test_int64_is_refused_with_a_clear_message(toy):
    with pytest.raises(TypeError, match="int64"):
        jax_bridge.to_jax(torch.zeros(4, dtype=torch.int64))


def test_tpu_interpret_mode_runs_the_same_kernel(toy, tpu_interpret):
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    torch.testing.assert_close(toy.scale_add(x, y, 2.0), 2 * x + y)


def test_bad_interpret_mode_is_named(toy, monkeypatch):
    monkeypatch.setenv(jax_bridge.INTERPRET_ENV, "fast")
    with pytest.raises(ValueError, match="PALLAS_TPU_INTERPRET"):
        toy.scale_add(torch.zeros(8, 128), torch.zeros(8, 128))


# Kernels with seeded bugs, to show the TPU interpret mode the environment variable switches on
# catches what plain interpret mode hides.


def _oob_copy(x: jax.Array) -> jax.Array:
    """Copies rows 4..12 of an 8-row array: out of bounds (offset traced, so only seen at run time)."""

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(4 + 4 * pl.program_id(0), 8)], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), x.dtype), pltpu.SemaphoreType.DMA],
        interpret=jax_bridge.pallas_interpret(),
    )(x)


def _racy_copy(x: jax.Array) -> jax.Array:
    """Reads a VMEM buffer while a DMA into it is still in flight: a read-write race."""

    def kernel(x_hbm, o_ref, buf, sems):
        first = pltpu.make_async_copy(x_hbm, buf, sems.at[0])
        first.start()
        first.wait()
        second = pltpu.make_async_copy(x_hbm, buf, sems.at[1])
        second.start()
        o_ref[...] = buf[...]  # the bug: `second` may still be writing buf
        second.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        grid=(1,),
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), x.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=jax_bridge.pallas_interpret(),
    )(x)


def _fake_rows8(x):
    return torch.empty(8, 128, dtype=x.dtype, device=x.device)


@pytest.fixture(scope="module")
def buggy_ops():
    return (
        jax_bridge.jax_op("_bridge_test::oob_copy", _oob_copy, fake=_fake_rows8),
        jax_bridge.jax_op("_bridge_test::racy_copy", _racy_copy, fake=_fake_rows8),
    )


@pytest.mark.timeout(120)
def test_out_of_bounds_read_raises_only_in_tpu_interpret_mode(buggy_ops, monkeypatch):
    oob, _ = buggy_ops
    x = torch.randn(8, 128)
    oob(x)  # plain interpret mode clamps silently: the bug is invisible there
    monkeypatch.setenv(jax_bridge.INTERPRET_ENV, "tpu")
    with pytest.raises(Exception, match="(?i)out.of.bounds"):
        oob(x)


@pytest.mark.timeout(120)
def test_race_raises_in_tpu_interpret_mode(buggy_ops, monkeypatch):
    _, racy = buggy_ops
    x = torch.randn(8, 128)
    torch.testing.assert_close(racy(x), x)  # plain interpret mode: right answer, race hidden
    monkeypatch.setenv(jax_bridge.INTERPRET_ENV, "tpu")
    with pytest.raises(RuntimeError, match="race"):
        racy(x)
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.timeout(120)
def test_race_check_fails_loudly_if_jax_moved_the_detector(toy, tpu_interpret, monkeypatch):
    """The race check reads jax's private interpreter state (the package's vendored
    tpu_interpreter.py). If a jax release moves it, TPU interpret mode says so and names the jax
    version the check was written for. It does not report "no race" without checking."""
    import importlib

    vendored = importlib.import_module(toy.__name__ + ".tpu_interpreter")
    monkeypatch.setattr(vendored, "_checked", {})
    monkeypatch.setattr(vendored, "_PRIVATE_MODULE", "jax._src.pallas.mosaic.interpret.moved")
    with pytest.raises(vendored.InterpreterAPIError, match=r"race check.*jax==0\.10\.2"):
        toy.scale_add(torch.zeros(8, 128), torch.zeros(8, 128), 1.0)
