"""What a TPU's MXU gives for a bf16 x e4m3 matmul, every one of the 256 e4m3 byte codes, in both
places the paged kernel's quad path puts e4m3 (kernel.py compute_head_quads): the keys as the
transposed right operand of the score matmul, the values as the right operand of the probability
matmul. Mosaic lowers such a matmul to the MXU's own 8-bit float load (on v5e / v6e as e4m3 with
bias 11 after a select turning -0 into 0, the products times 16 after), with no widening on the
vector units; this checks, on the chip, that every finite code comes back exact and says what the
NaN codes 0x7F / 0xFF become.

Run on a TPU (it needs one; nothing here runs in CI):

    python benchmarks/fp8_mxu_probe.py --out benchmarks/results/device/v5e_fp8_mxu_codes.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def _scores(q_ref, k_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(
        q_ref[...], k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def _values(p_ref, v_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(
        p_ref[...], v_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


def probe() -> dict:
    codes = np.zeros((256, 128), np.uint8)
    codes[:, 0] = np.arange(256)  # row i: code i in column 0, zeros elsewhere
    e4m3 = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
    want = np.asarray(e4m3.astype(jnp.float32))[:, 0].astype(np.float64)
    # Score matmul: q rows scaled by 1, 3 and 2**-20 against all 256 keys.
    factors = (1.0, 3.0, 2.0**-20)
    q = np.zeros((16, 128), np.float32)
    for r, f in enumerate(factors):
        q[r, 0] = f
    s = pl.pallas_call(_scores, out_shape=jax.ShapeDtypeStruct((16, 256), jnp.float32))(
        jnp.asarray(q, jnp.bfloat16), e4m3
    )
    s = np.asarray(s, np.float64)
    # Probability matmul: one-hot rows pick value rows 16 at a time.
    pv = []
    for start in range(0, 256, 16):
        p = np.zeros((16, 256), np.float32)
        p[np.arange(16), start + np.arange(16)] = 1.0
        o = pl.pallas_call(_values, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32))(
            jnp.asarray(p, jnp.bfloat16), e4m3
        )
        pv += np.asarray(o, np.float64)[:, 0].tolist()

    def differ(got, scale):
        return [
            {"code": f"0x{i:02x}", "want": None if np.isnan(want[i]) else want[i] * scale,
             "got": None if np.isnan(got[i]) else float(got[i])}
            for i in range(256)
            if not (np.isnan(want[i]) and np.isnan(got[i])) and got[i] != want[i] * scale
        ]  # fmt: skip

    return {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "codes": 256,
        "scores_differ": {f"q x {f}": differ(s[r], f) for r, f in enumerate(factors)},
        "values_differ": differ(np.asarray(pv), 1.0),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = probe()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
