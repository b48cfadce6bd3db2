"""What the MXU's right-hand operand costs in the compiled schedule, by its dtype: the two matmuls
of the paged kernel's 8-bit decode quads (kernel.py compute_head_quads) alone in a kernel, at one
quad of a 1024-token item: the scores q [16, 128] x keys [4096, 128]^T and the values
p [16, 4096] x v [4096, 128], with the keys / values in bf16, int8 and e4m3.

With 16 left-hand rows the matmul is bound by loading its right operand into the MXU (the
`vmatprep.subr` / `vmatpush` ops, a few bundles per vreg of weights), not by its pushes of the
left operand. TPU7x has no int8 MXU path: an int8 right operand is unpacked to bf16 (two
`vunpack` per int8 vreg) and loaded as bf16, so int8 keys and values cost what bf16 ones do in
weight loads; e4m3 is loaded as it is stored, half of bf16's loads. A decode item's quads run
four such matmuls per quad pair (keys and values of two quads for 8 KV heads), which sets the
floor of the quad path on each generation.

Deviceless (libtpu's LLO dump; no TPU needed):

    JAX_PLATFORMS=cpu python benchmarks/mxu_weight_probe.py --out benchmarks/results/mxu_weight_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

ROWS, KEYS, HEAD_DIM = 16, 4096, 128
DTYPES = ("bfloat16", "int8", "float8_e4m3fn")
GENERATIONS = ("v5e", "v6e", "tpu7x")


def compile_matmul(generation: str, *, matmul: str, rhs: str):
    """Compile target for llo_schedule.dump_schedule: one quad's score (`matmul="scores"`) or
    value (`"values"`) matmul, bf16 left operand, right operand of dtype `rhs`, f32 out."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    import tpu_compile

    if matmul == "scores":
        lhs_shape, rhs_shape, out_shape, dims = (
            (ROWS, HEAD_DIM),
            (KEYS, HEAD_DIM),
            (ROWS, KEYS),
            (((1,), (1,)), ((), ())),
        )
    else:
        lhs_shape, rhs_shape, out_shape, dims = (
            (ROWS, KEYS),
            (KEYS, HEAD_DIM),
            (ROWS, HEAD_DIM),
            (((1,), (0,)), ((), ())),
        )

    def body(x_ref, w_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(
            x_ref[...], w_ref[...], dims, preferred_element_type=jnp.float32
        )

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    fn = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        in_specs=[vmem, vmem],
        out_specs=vmem,
        name="mxu_weight_probe",
    )
    avals = [
        jax.ShapeDtypeStruct(lhs_shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(rhs_shape, jnp.dtype(rhs)),
    ]
    with jax.default_device(tpu_compile.tpu_device(generation)):
        return tpu_compile.lower_for(generation, fn, *avals).compile()


def probe_row(generation: str, matmul: str, rhs: str) -> dict:
    """One compile's row: its bundles and its most frequent op families (with their counts)."""
    import llo_schedule

    scheds = llo_schedule.dump_schedule(
        "mxu_weight_probe:compile_matmul",
        generation,
        {"matmul": matmul, "rhs": rhs},
        name="mxu_weight_probe",
    )
    sched = max(scheds, key=lambda s: len(s.bundles))
    ops = collections.Counter(op.split(".")[0] for b in sched.bundles for op in b.ops)
    return {
        "generation": generation,
        "matmul": matmul,
        "rhs": rhs,
        "bundles": len(sched.bundles),
        "ops": dict(ops.most_common(8)),
    }


def probe(generations=GENERATIONS) -> list[dict]:
    rows = []
    for gen in generations:
        for matmul in ("scores", "values"):
            for rhs in DTYPES:
                rows.append(probe_row(gen, matmul, rhs))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generation", action="append", choices=GENERATIONS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows = probe(a.generation or GENERATIONS)
    if a.out:
        doc = {
            "command": "JAX_PLATFORMS=cpu python benchmarks/mxu_weight_probe.py --out "
            + str(a.out),
            "shapes": {"rows": ROWS, "keys": KEYS, "head_dim": HEAD_DIM},
            "rows": rows,
        }
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
