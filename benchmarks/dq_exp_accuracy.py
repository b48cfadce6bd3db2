"""How far the flash backward's gradients move from the f32 reference when the dq pass takes its
exp and dS in bf16 (kernel._probabilities / _score_grads; v6e and TPU7x with bf16 inputs, as
tiling.exp_in_bf16 says) against the same pass in f32 (v5e's path). Interpret mode on the CPU:
the backward is built for `generation="v5e"` and for `"v6e"` on the same inputs and the same
forward outputs (o, lse of the v5e forward, so only the backward differs), and each gradient's
largest error is given as a fraction of the largest reference gradient (the tests' measure,
tests/test_flash_attention_kernel.py `_check_dense`, which bounds it at 5%).

    JAX_PLATFORMS=cpu PYTHONPATH=tests:torch-ext:benchmarks \\
        .venv/bin/python benchmarks/dq_exp_accuracy.py [--out results/dq_exp_accuracy.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

# (name, q heads, kv heads, tokens, head dim, window (left, right), soft cap, sinks)
CASES = [
    ("window90_sinks_d64", 4, 2, 200, 64, (90, 0), 0.0, True),
    ("causal_gqa8x2_d128", 8, 2, 256, 128, (-1, -1), 0.0, False),
    ("causal_softcap30_d64", 4, 2, 192, 64, (-1, -1), 30.0, False),
]
# small tiles so that interior, edge and masked tiles all run (the tests' WIDE tiles): q / kv
# blocks 64, kv compute 16, backward blocks 32 / 16, q compute 16 in both passes
TILES = ((64, 64, 16, 32, 16), dict(block_q_compute=16, block_q_compute_bwd=16))


def measure() -> list[dict]:
    import jax
    import jax.numpy as jnp

    import ours

    fa = ours.ADAPTERS["flash_attention"].mod
    K, R, T = fa.kernel, fa.reference, fa.tiling
    tiles = T.Tiles(*TILES[0], **TILES[1])
    out = []
    for name, hq, hkv, seq, d, window, softcap, sinks in CASES:
        keys = jax.random.split(jax.random.PRNGKey(5), 5)
        q = jax.random.normal(keys[0], (1, hq, seq, d), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(keys[1], (1, hkv, seq, d), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(keys[2], (1, hkv, seq, d), jnp.float32).astype(jnp.bfloat16)
        do = jax.random.normal(keys[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        s = jax.random.normal(keys[4], (hq,), jnp.float32) if sinks else None
        cfg = dict(causal=True, window_size=window, softcap=softcap)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]

        def attention(q, k, v, s, cfg=cfg):
            return R.attention(q, k, v, sinks=s, **cfg)

        ref = jax.vjp(attention, *f32, s)[1](do.astype(jnp.float32))
        fwd = functools.partial(
            K.flash_attention_fwd, tiles=tiles, interpret=True, generation="v5e", **cfg
        )
        o, lse = jax.jit(fwd)(q, k, v, sinks=s)
        row = {"case": name}
        for gen in ("v5e", "v6e"):
            bwd = functools.partial(
                K.flash_attention_bwd, tiles=tiles, interpret=True, generation=gen, **cfg
            )
            got = jax.jit(bwd)(q, k, v, o, lse, do, sinks=s)
            for g_name, g, w in zip(("dq", "dk", "dv"), got, ref):
                w = np.asarray(w)
                err = np.max(np.abs(np.asarray(g, np.float32) - w)) / np.max(np.abs(w))
                row[f"{g_name}_{gen}"] = round(float(err), 6)
            row[f"exp_bf16_{gen}"] = T.exp_in_bf16(gen, jnp.bfloat16)
        out.append(row)
        print(json.dumps(row))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = measure()
    if args.out:
        args.out.write_text(json.dumps({"method": __doc__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
