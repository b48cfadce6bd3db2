"""How exact the flash forward's reciprocal is on a TPU chip: kernel.newton_reciprocal (the EUP's
approximate reciprocal and two Newton steps, which the write-out uses for 1 / l) and a plain
division, each in a Pallas kernel over f32 values spread log-uniformly over [1, 2^24] (l, the
softmax denominator, is >= 1 wherever it is used), against the correctly rounded 1 / x, in
units in the last place. Interpret mode's approximate reciprocal is exact (only the Newton
steps' own rounding shows there, 1-2 ulps), so the chip's figure is the one that counts.

On a TPU VM, from the repository root with tests/, scripts/, torch-ext/ and benchmarks/ on
PYTHONPATH:

    python benchmarks/reciprocal_probe.py --out v5e_reciprocal_probe.json
    python benchmarks/reciprocal_probe.py --interpret --out /tmp/probe.json   # no chip
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROWS = 1024  # x [ROWS, 128] f32


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the last place of want (both positive f32)."""
    return np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))


def probe(interpret: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    import ours

    kernel = ours.ADAPTERS["flash_attention"].mod.kernel
    x = np.exp2(np.random.RandomState(0).uniform(0.0, 24.0, (ROWS, 128))).astype(np.float32)
    x[0, :4] = [1.0, 2.0, 3.0, 2.0**24]
    want = (1.0 / x.astype(np.float64)).astype(np.float32)

    def run(fn):
        def body(x_ref, o_ref):
            o_ref[...] = fn(x_ref[...])

        call = pl.pallas_call(
            body, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=interpret
        )
        return np.asarray(jax.jit(call)(jnp.asarray(x)))

    out = {"values": "x = 2^U(0, 24), f32 [1024, 128]", "interpret": interpret}
    for name, fn in (
        ("newton_reciprocal", kernel.newton_reciprocal),
        ("division", lambda v: 1.0 / v),
    ):
        u = _ulps(run(fn), want)
        out[name] = {
            "max_ulps": int(u.max()),
            "fraction_exact": float(np.mean(u == 0)),
            "fraction_within_1_ulp": float(np.mean(u <= 1)),
        }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interpret", action="store_true", help="plain interpret mode (no chip)")
    args = p.parse_args(argv)
    if not args.interpret:
        import tempfile

        import ours

        ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    from device_timing import _device_info

    doc = {"meta": _device_info(), "method": __doc__, **probe(args.interpret)}
    print(json.dumps(doc, indent=1))
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
