"""What a flash forward cut into instruction-memory overlays costs on a TPU chip: one forward at
the kernel's own tiles, timed with the edge walk's groups the program bound allows
(kernel._walk_unroll, tiling.forward_program_bundles) and again at groups of four, the length
the walk takes when nothing bounds it, on the same inputs (outputs compared). Default: 32 query
heads on one KV head (MQA) at 4096 causal tokens, whose v5e forward is 55,899 bundles in one
overlay at one tile a group and 131,353 bundles cut into 11 overlays at four (deviceless dumps).

On a TPU VM, from the repository root with tests/, scripts/, torch-ext/ and benchmarks/ on
PYTHONPATH:

    python benchmarks/program_size_probe.py --out v5e_program_size_probe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def probe(q_heads=32, kv_heads=1, seq=4096, head_dim=128, unbounded=4) -> dict:
    import jax
    import jax.numpy as jnp

    import ours
    from device_timing import _device_info, timed

    K = ours.ADAPTERS["flash_attention"].mod.kernel
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, q_heads, seq, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, kv_heads, seq, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, kv_heads, seq, head_dim), jnp.bfloat16)
    rows, outs = [], {}
    bounded = K._walk_unroll
    for name in ("bounded", "unbounded"):
        # the unbounded program: _walk_unroll's choice replaced by the unbounded group length
        K._walk_unroll = bounded if name == "bounded" else (lambda *a, **kw: unbounded)
        try:
            # a function of its own per program: jit's trace cache is keyed by the function
            f = jax.jit(lambda q, k, v: K.flash_attention_fwd(q, k, v, causal=True)[0])
            outs[name] = np.asarray(f(q, k, v).astype(jnp.float32))
            rows.append({"program": name, **timed(f, (q, k, v))})
        finally:
            K._walk_unroll = bounded
    diff = float(np.max(np.abs(outs["bounded"] - outs["unbounded"])))
    return {
        "meta": {**_device_info(), "q_heads": q_heads, "kv_heads": kv_heads, "seq": seq},
        "rows": rows,
        "max_abs_diff": diff,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import tempfile

    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))  # no torch on a TPU VM
    doc = probe()
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
