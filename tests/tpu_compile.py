"""Deviceless compile for real TPU generations (libtpu + jax.experimental.topologies, no TPU).

libtpu==0.0.42.* lives in a separate folder (.libtpu, made by `make setup`; override with
$LIBTPU_DIR) so it never enters the main venv. Compiling runs Mosaic for the chosen generation:
VMEM overflow (`RESOURCE_EXHAUSTED ... vmem`) and layout errors surface here as exceptions.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from tpu_generations import GENERATIONS, TESTED_GENERATIONS

ROOT = Path(__file__).resolve().parent.parent
LIBTPU_DIR = Path(os.environ.get("LIBTPU_DIR", ROOT / ".libtpu"))
# Test processes run in parallel (pytest-xdist): libtpu's lockfile would refuse the second one.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def libtpu_available() -> bool:
    return (LIBTPU_DIR / "libtpu").is_dir()


@functools.cache
def tpu_device(generation: str):
    """Device 0 of a deviceless topology for `generation` ("v5e", "v6e", "tpu7x")."""
    if not libtpu_available():
        raise RuntimeError(f"libtpu not found in {LIBTPU_DIR}: run `make setup`")
    if str(LIBTPU_DIR) not in sys.path:
        sys.path.append(str(LIBTPU_DIR))
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(GENERATIONS[generation].topology, "tpu")
    return topo.devices[0]


def tpu_aval(shape, dtype, generation: str):
    import jax
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(
        tuple(shape), dtype, sharding=SingleDeviceSharding(tpu_device(generation))
    )


def compile_for(generation: str, fn, *args, static_argnames=(), **kwargs):
    """Compile `fn(*args, **kwargs)` for `generation`; array arguments are (shape, dtype) pairs or
    ShapeDtypeStructs and become avals on that generation's device. Returns the Compiled object."""
    return lower_for(generation, fn, *args, static_argnames=static_argnames, **kwargs).compile()


def xla_while_loops(compiled) -> list[str]:
    """The XLA while loops of a compiled program (their HLO lines), outside any Pallas kernel
    (a kernel is one custom call). Each iteration of one costs a few microseconds on a TPU: the
    work-list builders' jnp.searchsorted / maximum.accumulate loops once cost a 64-token decode
    gmm ~240 us on a v5e chip (work_list.searchsorted / cummax replace them)."""
    return [line.strip()[:160] for line in compiled.as_text().splitlines() if " while(" in line]


def lower_for(generation: str, fn, *args, static_argnames=(), **kwargs):
    """`compile_for` up to the lowered program (what the compiler is handed; seconds, no
    compile). Returns the Lowered object."""
    import jax

    def to_aval(a):
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], tuple):
            return tpu_aval(a[0], a[1], generation)
        if isinstance(a, jax.ShapeDtypeStruct):
            return tpu_aval(a.shape, a.dtype, generation)
        return a

    args = [to_aval(a) for a in args]
    statics = {k: v for k, v in kwargs.items() if k in static_argnames}
    arrays = {k: to_aval(v) for k, v in kwargs.items() if k not in static_argnames}
    jitted = jax.jit(functools.partial(fn, **statics))
    return jitted.trace(*args, **arrays).lower()


# CI (two cores) compiles each kernel at its production shapes for every generation, and the
# further cases of one kernel (the same kernel at another model's shape, another projection) on
# one generation each, rotating so that every generation compiles it at some production shape.
# The long form (HYPOTHESIS_PROFILE=sweep, as for the hypothesis sweeps) compiles every case on
# every generation.
LONG_FORM = os.environ.get("HYPOTHESIS_PROFILE") == "sweep"


def generation_per_case(cases, start: int = 0) -> list:
    """(generation, *case) parameter tuples: the full product in the long form; in CI, case i on
    generation (start + i) mod 3 (v5e, v6e, TPU7x, v5e, ...)."""
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    if LONG_FORM:
        return [(g, *c) for c in cases for g in TESTED_GENERATIONS]
    n = len(TESTED_GENERATIONS)
    return [(TESTED_GENERATIONS[(start + i) % n], *c) for i, c in enumerate(cases)]


def one_generation(start: int) -> list:
    """The generations a variant compiles for: one in CI (`start` picks which, so the variants of
    a family spread over all three), every one in the long form."""
    return [g for (g,) in generation_per_case([()], start)]
