"""Expert-parallel MoE (kernels/ragged_dot/expert_parallel.py) on 8 emulated CPU devices and
compiled for TPU slices.

The multi-device cases need `--xla_force_host_platform_device_count=8` before JAX initialises,
and the pytest process has already initialised it with one CPU device: each case runs this file as
a script in a fresh process (`python tests/test_expert_parallel.py <case>`, XLA_FLAGS set by
`_run_case`), with the kernels in interpret mode and tiny shapes. The compile tests run in the
pytest process: deviceless TPU topologies are a separate backend, and their meshes hold all the
topology's devices.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_loader
import tpu_compile

HERE = Path(__file__).resolve().parent

rd = kernel_loader.load_kernel("ragged_dot")
EP = importlib.import_module(rd.__name__ + ".expert_parallel")

DEVICES = 8


def _run_case(name: str, timeout: int = 300) -> str:
    import emulated_devices

    return emulated_devices.run_case(__file__, name, DEVICES, timeout)


# -------------------------------------------------------------------------------------------------
# Cases (run in the 8-device subprocess)
# -------------------------------------------------------------------------------------------------

# 16 experts over 8 devices (2 each), 2 tokens per device, top-2. Routing avoids expert 3 (its
# device still gets expert 2's rows) and experts 14 and 15 (device 7 computes nothing).
T, H, I, E, K = 16, 32, 16, 16, 2
UNUSED = (3, 14, 15)


def _mesh():
    from jax.sharding import Mesh

    assert len(jax.devices()) == DEVICES, jax.devices()
    return Mesh(np.array(jax.devices()), ("ep",))


def _problem(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.float32)
    w_gate_up = jax.random.normal(ks[1], (E, H, 2 * I), jnp.float32) / np.sqrt(H)
    w_down = jax.random.normal(ks[2], (E, I, H), jnp.float32) / np.sqrt(I)
    logits = jax.random.normal(ks[3], (T, E), jnp.float32)
    logits = logits.at[:, list(UNUSED)].set(-jnp.inf)
    ids, weights = EP.route_top_k(logits, K)
    assert not np.isin(np.asarray(ids), UNUSED).any()
    cot = jax.random.normal(ks[4], (T, H), jnp.float32)
    return x, ids, weights, w_gate_up, w_down, cot


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def case_forward(collectives):
    mesh = _mesh()
    x, ids, weights, w_gate_up, w_down, _ = _problem()
    ref = EP.moe_reference(x, ids, weights, w_gate_up, w_down)
    unsharded = jax.jit(lambda *a: EP.moe_layer(*a, interpret=True))(
        x, ids, weights, w_gate_up, w_down
    )
    sharded = jax.jit(
        lambda *a: EP.expert_parallel_moe(*a, mesh=mesh, collectives=collectives, interpret=True)
    )(x, ids, weights, w_gate_up, w_down)
    assert sharded.shape == (T, H) and np.isfinite(np.asarray(sharded)).all()
    _close(unsharded, ref)
    _close(sharded, unsharded)
    # The experts held elsewhere are not run here: poisoning device 7's (unused) experts and
    # expert 3 changes nothing, as no row may reach them.
    poison = w_gate_up.at[jnp.array(UNUSED)].set(jnp.nan)
    again = jax.jit(
        lambda *a: EP.expert_parallel_moe(*a, mesh=mesh, collectives=collectives, interpret=True)
    )(x, ids, weights, poison, w_down)
    _close(again, sharded, tol=0)


def case_grad(collectives):
    mesh = _mesh()
    x, ids, weights, w_gate_up, w_down, cot = _problem(seed=1)

    def loss(layer):
        return lambda x, wts, wgu, wd: jnp.sum(layer(x, ids, wts, wgu, wd) * cot)

    sharded = loss(
        lambda *a: EP.expert_parallel_moe(*a, mesh=mesh, collectives=collectives, interpret=True)
    )
    got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2, 3)))(x, weights, w_gate_up, w_down)
    want = jax.grad(loss(EP.moe_reference), argnums=(0, 1, 2, 3))(x, weights, w_gate_up, w_down)
    for name, g, w in zip(("x", "top_k_weights", "w_gate_up", "w_down"), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        _close(g, w, tol=5e-5)
    # Experts that received no token get exactly zero weight gradients.
    assert not np.asarray(got[2])[list(UNUSED)].any()
    assert not np.asarray(got[3])[list(UNUSED)].any()


def case_bad_input():
    from jax.sharding import Mesh

    mesh = _mesh()
    x, ids, weights, w_gate_up, w_down, _ = _problem()
    run = lambda *a, **k: EP.expert_parallel_moe(*a, mesh=mesh, interpret=True, **k)
    with pytest.raises(ValueError, match="does not divide the 12 experts"):
        run(x, ids % 12, weights, w_gate_up[:12], w_down[:12])
    with pytest.raises(ValueError, match="does not divide the 12 tokens"):
        run(x[:12], ids[:12], weights[:12], w_gate_up, w_down)
    with pytest.raises(ValueError, match="no ragged_all_to_all"):
        run(x, ids, weights, w_gate_up, w_down, collectives="ragged_all_to_all")
    with pytest.raises(ValueError, match="collectives"):
        run(x, ids, weights, w_gate_up, w_down, collectives="psum")
    with pytest.raises(ValueError, match="not an axis"):
        run(x, ids, weights, w_gate_up, w_down, axis="tp")
    with pytest.raises(ValueError, match="w_down"):
        run(x, ids, weights, w_gate_up, w_down[:, :, :8])
    with pytest.raises(TypeError, match="top_k_ids"):
        run(x, weights, weights, w_gate_up, w_down)
    # A 2-D mesh: the experts split over `ep`, everything replicated over the other axis.
    mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "ep"))
    out = jax.jit(
        lambda *a: EP.expert_parallel_moe(*a, mesh=mesh2, collectives="all_gather", interpret=True)
    )(x, ids, weights, w_gate_up, w_down)
    _close(out, EP.moe_reference(x, ids, weights, w_gate_up, w_down))
    assert EP.default_collectives("cpu") == "all_gather"
    assert EP.default_collectives("tpu") == "ragged_all_to_all"


CASES = {
    "forward_all_gather": lambda: case_forward("all_gather"),
    "forward_all_to_all": lambda: case_forward("all_to_all"),
    "grad_all_gather": lambda: case_grad("all_gather"),
    "grad_all_to_all": lambda: case_grad("all_to_all"),
    "bad_input": case_bad_input,
}


# -------------------------------------------------------------------------------------------------
# pytest: 8 emulated devices (subprocess)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("collectives", ["all_gather", "all_to_all"])
def test_sharded_forward_matches_unsharded(collectives):
    """8 devices x 2 experts: equal to the unsharded gmm layer and the f32 reference, with an
    expert that gets no token and a device whose experts get none; foreign experts never run."""
    _run_case(f"forward_{collectives}")


@pytest.mark.parametrize("collectives", ["all_gather", "all_to_all"])
def test_sharded_gradients_match_reference(collectives):
    """d/dx, d/d routing weights, d/d expert weights through dispatch, gmm/tgmm and combine."""
    _run_case(f"grad_{collectives}")


def test_bad_input_and_2d_mesh():
    _run_case("bad_input")


# -------------------------------------------------------------------------------------------------
# Deviceless compile of the sharded layer for TPU slices (Qwen3-30B-A3B experts)
# -------------------------------------------------------------------------------------------------

# Qwen3-30B-A3B: 128 experts, hidden 2048, moe_intermediate 768, top-8; a 512-token chunk.
QWEN3_30B = dict(tokens=512, hidden=2048, inter=768, experts=128, top_k=8)
_COLLECTIVE = re.compile(
    r"=\s*(\S+)\s+(all-gather|all-to-all|ragged-all-to-all|reduce-scatter|all-reduce)(?:-start)?\("
)


def collective_buffers(hlo_text: str) -> dict:
    """Collective op kind -> (count, summed result bytes per device) in a compiled HLO module."""
    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
    out = {}
    for m in _COLLECTIVE.finditer(hlo_text):
        shape, kind = m.group(1), m.group(2)
        total = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            if dt in sizes:
                total += sizes[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        n, b = out.get(kind, (0, 0))
        out[kind] = (n + 1, b + total)
    return out


def compile_sharded(generation: str, collectives: str, shapes=QWEN3_30B, grad: bool = False):
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tpu_compile

    tpu_compile.tpu_device(generation)  # puts libtpu on the path
    topo = topologies.get_topology_desc(tpu_compile.GENERATIONS[generation].topology, "tpu")
    mesh = Mesh(np.array(topo.devices), ("ep",))
    t, h, i, e, k = (shapes[n] for n in ("tokens", "hidden", "inter", "experts", "top_k"))

    def aval(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))

    bf16 = jnp.bfloat16
    args = (
        aval((t, h), bf16),
        aval((t, k), jnp.int32),
        aval((t, k), jnp.float32),
        aval((e, h, 2 * i), bf16),
        aval((e, i, h), bf16),
    )

    def layer(*a):
        return EP.expert_parallel_moe(*a, mesh=mesh, collectives=collectives, generation=generation)

    if grad:  # d x, d w_gate_up, d w_down of a scalar loss: the training step's MoE part

        def loss(x, ids, weights, w_gate_up, w_down):
            # Squared: the cotangent depends on the output, so the forward combine stays live.
            return jnp.sum(
                jnp.square(layer(x, ids, weights, w_gate_up, w_down).astype(jnp.float32))
            )

        fn = jax.jit(jax.grad(loss, argnums=(0, 3, 4)))
    else:
        fn = jax.jit(layer)
    return mesh, fn.trace(*args).lower().compile()


@pytest.mark.compile
@pytest.mark.parametrize(
    "generation,collectives",
    # TPU7x's ragged all-to-all forward compiles inside test_compiles_sharded_backward in CI
    [("v6e", "ragged_all_to_all"), ("tpu7x", "all_gather")]
    + ([("tpu7x", "ragged_all_to_all")] if tpu_compile.LONG_FORM else []),
)
def test_compiles_sharded_layer(generation, collectives):
    """The whole sharded layer (dispatch, both gmm kernels on the local experts, combine) compiles
    for a v6e 2x2 / TPU7x 2x2x1 slice with Mosaic and XLA:TPU; the collectives are the intended
    ones and each device's weights are its E/D experts only."""
    mesh, compiled = compile_sharded(generation, collectives)
    devices = mesh.shape["ep"]
    s = QWEN3_30B
    found = collective_buffers(compiled.as_text())
    print(generation, collectives, "devices", devices, "collectives", found)
    if collectives == "ragged_all_to_all":
        assert found.get("ragged-all-to-all", (0, 0))[0] == 2, found  # dispatch + combine
        assert "reduce-scatter" not in found
    else:
        assert "all-gather" in found and "reduce-scatter" in found, found
        assert "ragged-all-to-all" not in found
    weight_bytes = 2 * 3 * s["experts"] * s["hidden"] * s["inter"] // devices
    mem = compiled.memory_analysis()
    if mem is not None:
        print("memory", mem)
        assert weight_bytes <= mem.argument_size_in_bytes < weight_bytes * 1.05


# CI compiles the backward for one slice (TPU7x 2x2x1: 8 devices of 16 experts, the one that
# splits the experts finest); the long form (HYPOTHESIS_PROFILE=sweep) for the v6e 2x2 too.
@pytest.mark.compile
@pytest.mark.parametrize(
    "generation", [g for g in tpu_compile.one_generation(2) if g in ("v6e", "tpu7x")]
)
def test_compiles_sharded_backward(generation):
    """The backward of the sharded layer for a v6e 2x2 / TPU7x 2x2x1 slice: gmm (dlhs layout),
    tgmm and the recomputed gate_up on the local experts, the ragged all-to-alls transposed into
    ragged all-to-alls back; gradients of each device's experts only."""
    mesh, compiled = compile_sharded(generation, "ragged_all_to_all", grad=True)
    found = collective_buffers(compiled.as_text())
    print(generation, "backward collectives", found)
    assert found.get("ragged-all-to-all", (0, 0))[0] >= 4, found  # forward 2, transposed 2
    s, devices = QWEN3_30B, mesh.shape["ep"]
    weight_bytes = 2 * 3 * s["experts"] * s["hidden"] * s["inter"] // devices
    mem = compiled.memory_analysis()
    if mem is not None:
        print("memory", mem)
        # dx [T/D, H] and this device's expert-weight gradients, nothing more.
        assert weight_bytes <= mem.output_size_in_bytes < weight_bytes * 1.05


if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print(f"CASE {sys.argv[1]} OK")
