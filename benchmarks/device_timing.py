"""Device timing (`run.py --device tpu`): every row of a section timed on the attached TPU."""

from __future__ import annotations

import time

import registry
import shapes as shapes_mod
from rows import sig6


def measure_on_device(
    section: dict,
    kinds,
    log,
    iters: int = 20,
    warmup: int = 3,
    device=None,
    generation: str | None = None,
    small: bool = False,
) -> None:
    """Time every row of a section on the attached TPU with the JAX TPU backend (median of
    `iters` runs after `warmup` calls, each synchronised with block_until_ready). `device` and
    `generation` default to the first TPU and its generation (the tests pass the CPU)."""
    import jax
    import numpy as np

    import ours
    from tpu_generations import detect_generation

    gen = generation or detect_generation()
    if gen is None:
        raise SystemExit("--device tpu: no TPU visible to JAX (jax.devices('tpu') failed)")
    device = device or jax.devices("tpu")[0]
    table = {s.name: s for k in kinds for s in (shapes_mod.SMALL if small else shapes_mod.NAMED)[k]}
    for row in section["rows"]:
        if row["kernel"] not in kinds:
            continue
        shape = table[row["shape"]]
        kind = row["kernel"]
        if row["impl"] != "ours":
            a = registry.anchor(kind, row["impl"])
            # a per-generation anchor (tokamax's gmm) runs the tiles it would pick on this chip
            fn, _ = a.compile_args(shape, gen)
            _, args = a.call(shape, small, gen)
        else:
            a = ours.ADAPTERS[kind]
            fn, _ = a.compile_args(shape, gen)
            _, args = a.call(shape, gen)
        args = jax.device_put(args, device)
        f = jax.jit(fn)
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        pg = row["per_generation"].setdefault(gen, {})
        roof = pg.get("roofline_us")
        pg["measured_us"] = sig6(med * 1e6)
        if roof:
            pg["measured_fraction_of_roofline"] = sig6(roof / (med * 1e6))
        log(f"  {kind}/{shape.name}/{row['impl']} on {gen}: {med * 1e6:.1f} us")
