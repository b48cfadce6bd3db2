"""The training passes timed on a TPU chip, ours beside the anchors: what a training step runs
that the named rows (forward calls) do not.

- flash attention, forward + backward (`jax.vjp` of the op, then the cotangent): ours
  (`kernel.flash_attention`, its custom_vjp) against splash attention at its 512 blocks with its
  fused backward kernel (`anchors.splash_kernel(backward=True)`), on every named flash shape.
  The forward alone is a named row (device_timing.py), so the backward's time is the
  difference.
- the grouped matmul's backward at the named 4096-token shapes: dlhs = dy[M, N] @ w[g].T
  (ours: `kernel.gmm(transpose_rhs=True)`; megablox: its gmm with transpose_rhs) and the weight
  gradient dw[g] = x[rows of g].T @ dy[rows of g] (ours: `kernel.tgmm`; megablox: its tgmm, whose
  lhs is x.T: the transpose is in the timed function, as in megablox's own vjp). Megablox at its
  two row-tile configurations of the named rows: 128 rows (K/N tiles up to 2048 / 1024) and
  512 rows (up to 1024 / 1024), dlhs tiled on the transposed problem (K and N swapped); tgmm's
  K tiles at most 1024 in both (its f32 (tk, tn) accumulator and double-buffered output must
  fit v5e's 16 MiB of scoped VMEM).
- the gate_up projection with its gated activation (SiLU, gate and up concatenated): ours
  fused (`kernel.gmm_gated`, writes [M, I]) against megablox's gmm writing [M, 2I] followed by
  XLA's silu(gate) * up, and our plain gmm followed by the same XLA ops; and ours fused with
  GPT-OSS's layout and gate (gate and up interleaved column by column, clamped SwiGLU), which
  the anchors have no form of.

Each is timed like a named row (device_timing.time_call: compiled, run twice, then back-to-back
runs, the fastest run's mean). On a TPU VM, from the repository root with tests/, scripts/,
torch-ext/ and benchmarks/ on PYTHONPATH (as for device_timing.py):

    python benchmarks/training_timing.py --kernel flash_attention --out train_flash.json
    python benchmarks/training_timing.py --kernel ragged_dot --out train_gmm.json

`--interpret` runs every case at a small shape in TPU interpret mode (the plumbing, on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import shapes as shapes_mod
from device_timing import _device_info, case_record, timed
from rows import sig6

KINDS = ("flash_attention", "ragged_dot", "dense_matmul")
GMM_TOKENS = 4096  # the ragged shapes timed: the named ones at this many tokens


def _megablox_tilings(shape, pass_name):
    """{impl: (tm, tk, tn)} of megablox for one pass: the named rows' two row-tile rules on the
    pass's own problem (dlhs: K and N swapped; tgmm: K tiles <= 1024)."""
    import anchors

    if pass_name == "dlhs":
        t = dataclasses.replace(shape, k=shape.n, n=shape.k)
        return {
            "anchor:megablox_large": anchors.gmm_large_tiling(t),
            "anchor:megablox_tall": anchors.gmm_tall_tiling(t),
        }
    if pass_name == "tgmm":
        k, n = min(shape.k, 1024), min(shape.n, 1024)
        return {
            "anchor:megablox_large": (128, k, n),
            "anchor:megablox_tall": (min(shape.m, 512), k, n),
        }
    return {
        "anchor:megablox_large": anchors.gmm_large_tiling(shape),
        "anchor:megablox_tall": anchors.gmm_tall_tiling(shape),
    }


INPUT_SEED = 5


def ragged_weights(shape):
    """The experts' weights [G, K, N] of the grouped matmul's passes at `shape`, seeded from
    `ragged_inputs`' key. Made per timed case: two copies of DeepSeek-V3-like's 7.5 GB weights
    do not fit the chip."""
    import jax
    import jax.numpy as jnp

    key = jax.random.fold_in(jax.random.key(INPUT_SEED), 1)
    return jax.random.normal(key, (shape.experts, shape.k, shape.n), jnp.dtype(shape.dtype))


def ragged_inputs(shape):
    """(x [M, K], dy [M, N], group_sizes) of the grouped matmul's passes at `shape`, seeded
    (the weights, `ragged_weights`, come from the same key)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(shape.dtype)
    key = jax.random.key(INPUT_SEED)
    x = jax.random.normal(key, (shape.m, shape.k), dt)
    dy = jax.random.normal(jax.random.fold_in(key, 2), (shape.m, shape.n), dt)
    return x, dy, jnp.asarray(shape.group_sizes, jnp.int32)


def gmm_cases(shape, generation, small=False):
    """(impl, pass, fn, args, tiling) of the grouped matmul's training passes at `shape`."""
    import jax
    import jax.numpy as jnp

    import anchors
    import ours

    kernel = ours.load("ragged_dot").kernel
    mg = anchors._megablox()
    dt = jnp.dtype(shape.dtype)
    x, dy, gs = ragged_inputs(shape)

    ours_kw = dict(generation=generation)

    yield (
        "ours",
        "dlhs",
        lambda dy, w, gs: kernel.gmm(dy, w, gs, transpose_rhs=True, **ours_kw),
        (dy, ragged_weights(shape), gs),
        None,
    )
    yield "ours", "tgmm", lambda x, dy, gs: kernel.tgmm(x, dy, gs, **ours_kw), (x, dy, gs), None
    for impl, t in _megablox_tilings(shape, "dlhs").items():
        yield (
            impl,
            "dlhs",
            lambda dy, w, gs, t=t: mg.gmm(dy, w, gs, dt, tiling=t, transpose_rhs=True),
            (dy, ragged_weights(shape), gs),
            t,
        )
    for impl, t in _megablox_tilings(shape, "tgmm").items():
        yield (
            impl,
            "tgmm",
            lambda x, dy, gs, t=t: mg.tgmm(x.swapaxes(0, 1), dy, gs, dt, tiling=t),
            (x, dy, gs),
            t,
        )
    if "gate_up" not in shape.name:
        return
    half = shape.n // 2

    def xla_gate(h):
        return (jax.nn.silu(h[:, :half].astype(jnp.float32)) * h[:, half:]).astype(dt)

    yield (
        "ours",
        "gated_silu",
        lambda x, w, gs: kernel.gmm_gated(x, w, gs, activation="silu", **ours_kw),
        (x, ragged_weights(shape), gs),
        None,
    )

    # GPT-OSS's layout and clamped SwiGLU (gate and up interleaved column by column): fused, and
    # our gmm followed by XLA's gating of the [M, 2I] result (the anchors have no such gate).
    def xla_swiglu(h):
        h = h.astype(jnp.float32)
        return kernel.gated_activation(h[:, 0::2], h[:, 1::2], "gpt_oss_swiglu").astype(dt)

    yield (
        "ours",
        "gated_swiglu_interleaved",
        lambda x, w, gs: kernel.gmm_gated(
            x, w, gs, activation="gpt_oss_swiglu", layout="interleaved", **ours_kw
        ),
        (x, ragged_weights(shape), gs),
        None,
    )
    yield (
        "ours",
        "gmm_then_xla_swiglu_interleaved",
        lambda x, w, gs: xla_swiglu(kernel.gmm(x, w, gs, **ours_kw)),
        (x, ragged_weights(shape), gs),
        None,
    )
    yield (
        "ours",
        "gmm_then_xla_silu",
        lambda x, w, gs: xla_gate(kernel.gmm(x, w, gs, **ours_kw)),
        (x, ragged_weights(shape), gs),
        None,
    )
    for impl, t in _megablox_tilings(shape, "gated_silu").items():
        yield (
            impl,
            "gmm_then_xla_silu",
            lambda x, w, gs, t=t: xla_gate(mg.gmm(x, w, gs, dt, tiling=t)),
            (x, ragged_weights(shape), gs),
            t,
        )


def flash_inputs(shape, generation):
    """(options, (q, k, v, do)) of our flash attention at `shape`: the keyword arguments of its
    mask (causal, window, soft cap, packed documents' segment ids) and generation, and the
    seeded inputs and output cotangent every timed training pass takes."""
    import jax
    import numpy as np

    import ours

    ids = shape.segment_ids()
    rows = None if ids is None else np.broadcast_to(ids, (shape.batch, shape.seq))
    options = dict(
        causal=shape.causal,
        window_size=ours._window_size(shape),
        softcap=shape.softcap or 0.0,
        q_segment_ids=rows,
        kv_segment_ids=rows,
        generation=generation,
    )
    qs = (shape.batch, shape.q_heads, shape.seq, shape.head_dim)
    kvs = (shape.batch, shape.kv_heads, shape.seq, shape.head_dim)
    key = jax.random.key(9)
    q, k, v, do = (
        jax.random.normal(jax.random.fold_in(key, i), s).astype(shape.dtype)
        for i, s in enumerate((qs, kvs, kvs, qs))
    )
    return options, (q, k, v, do)


def flash_cases(shape, generation, small=False, tilings=()):
    """(impl, pass, fn, args, tiling) of attention's forward + backward at `shape`: ours at its
    own tiles, ours at each of `tilings` ((block_q, block_q_compute, block_kv, block_kv_compute,
    fused) for both passes, impl "ours@..."), splash."""
    import jax

    import anchors
    import ours

    package = ours.load("flash_attention")
    kernel = package.kernel
    options, (q, k, v, do) = flash_inputs(shape, generation)

    def train(attention):
        def fn(q, k, v, do):
            _, vjp = jax.vjp(attention, q, k, v)
            return vjp(do)

        return fn

    def ours_attention(tiles=None):
        def attention(q, k, v):
            return kernel.flash_attention(q, k, v, tiles=tiles, **options)

        return attention

    yield "ours", "fwd_bwd", train(ours_attention()), (q, k, v, do), None
    for t in tilings:
        tiles = package.tiling.backward_tiles(*t[:4], bool(t[4]))
        impl = "ours@" + ",".join(map(str, t))
        yield impl, "fwd_bwd", train(ours_attention(tiles)), (q, k, v, do), list(t)
    block = 128 if small else anchors.SPLASH_BLOCK
    splash, _ = anchors.splash_compile_args(shape, block, backward=True)
    if shape.batch == 1:  # splash takes [H, S, D]: no batch axis
        q, k, v, do = (a[0] for a in (q, k, v, do))
    yield "anchor:splash", "fwd_bwd", train(splash), (q, k, v, do), block


def dense_matmul_cases(shape, generation, small=False):
    """XLA's own dense bf16 matmul (jnp.dot, f32 accumulation, bf16 out) of [m, k] x [k, n]:
    the rate an MXU-bound kernel can reach on this chip, beside the nominal peak."""
    import jax
    import jax.numpy as jnp

    m, k, n = shape
    a = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (k, n)).astype(jnp.bfloat16)

    def fn(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    yield "xla", "dot", fn, (a, b), None


DENSE_SHAPES = ((8192, 8192, 8192), (32768, 4096, 14336), (32768, 14336, 4096))


def _kept(outputs, limit=2**30):
    """The outputs as held for the check: an output over `limit` bytes cut to its leading
    entries (a DeepSeek-V3-like weight gradient is 7.5 GB; two do not fit the chip)."""
    return [
        o if o.nbytes <= limit else o[: max(1, o.shape[0] * limit // o.nbytes)] for o in outputs
    ]


def _rel_err(got, want) -> float:
    """max |got - want| / max |want| over matching outputs (leading size-1 axes dropped)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def err_and_scale(a, b):  # fused: no f32 copy of a multi-GB gradient
        a, b = (jnp.reshape(x, [d for d in x.shape if d != 1]).astype(jnp.float32) for x in (a, b))
        return jnp.max(jnp.abs(a - b)), jnp.max(jnp.abs(b))

    err, scale = 0.0, 0.0
    for a, b in zip(got, want, strict=True):
        e, m = err_and_scale(a, b)
        err, scale = max(err, float(e)), max(scale, float(m))
    return err / max(scale, 1e-30)


def _named(kind, tokens=GMM_TOKENS):
    """The named shapes of `kind` a training pass is timed at (ragged: at `tokens` tokens)."""
    if kind == "dense_matmul":
        return list(DENSE_SHAPES)
    if kind == "ragged_dot":
        return [s for s in shapes_mod.NAMED[kind] if s.tokens == tokens]
    return list(shapes_mod.NAMED[kind])


def _small(kind):
    """One small shape per kind for --interpret (the plumbing in TPU interpret mode)."""
    if kind == "dense_matmul":
        return [(256, 256, 256)]
    if kind == "ragged_dot":
        return [shapes_mod.RaggedDotShape("train_small_gate_up", 128, 4, 2, 256, 512)]
    return [shapes_mod.AttentionShape("train_small_causal", 1, 2, 1, 256, 128)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", action="append", choices=KINDS)
    p.add_argument("--shape", action="append", help="only these shapes")
    p.add_argument("--pass", dest="passes", action="append", help="only these passes")
    p.add_argument("--impl", dest="impls", action="append", help="only these implementations")
    p.add_argument(
        "--flash-tiles",
        action="append",
        default=[],
        help="block_q,block_q_compute,block_kv,block_kv_compute,fused (0/1): ours at these "
        "tiles too (repeatable)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=GMM_TOKENS,
        help=f"the grouped matmul's named shapes at this many tokens (default {GMM_TOKENS})",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interpret", action="store_true", help="small shapes, TPU interpret mode")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    import jax

    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    gen = _device_info()["generation"] or "v5e"
    doc = {"meta": _device_info(), "method": __doc__, "rows": []}
    ctx = contextlib.nullcontext()
    if args.interpret:
        from jax.experimental.pallas import tpu as pltpu

        ctx = pltpu.force_tpu_interpret_mode()
    tilings = [tuple(int(v) for v in t.split(",")) for t in args.flash_tiles]
    cases = {"ragged_dot": gmm_cases}
    cases["flash_attention"] = functools.partial(flash_cases, tilings=tilings)
    cases["dense_matmul"] = dense_matmul_cases
    first_out = {}  # (shape, what the pass computes): the first implementation's outputs
    with ctx:
        for kind in args.kernel or KINDS:
            for shape in _small(kind) if args.interpret else _named(kind, args.tokens):
                name = shape.name if hasattr(shape, "name") else "dense_{}x{}x{}".format(*shape)
                if args.shape and name not in args.shape:
                    continue
                first_out.clear()  # one shape's outputs held at a time
                for impl, pass_name, fn, fargs, tiling in cases[kind](shape, gen, args.interpret):
                    if (args.passes and pass_name not in args.passes) or (
                        args.impls and impl not in args.impls
                    ):
                        del fn, fargs
                        continue
                    rec = {"kernel": kind, "shape": name, "impl": impl, "pass": pass_name}
                    rec.update(
                        generation=gen, tiling=list(tiling) if isinstance(tiling, tuple) else tiling
                    )
                    with case_record(doc, rec, args.out, log):
                        jitted = jax.jit(fn)
                        rec.update(timed(jitted, fargs, target_s=0.0 if args.interpret else 0.2))
                        if kind == "dense_matmul":
                            m, k, n = shape
                            rec["tflops"] = sig6(2 * m * k * n / rec["measured_us"] / 1e6)
                        # every implementation of a pass computes the same thing: the first's
                        # outputs check the others' (a wrong anchor setup would show here)
                        out = _kept(jax.tree.leaves(jitted(*fargs)))
                        what = (name, pass_name)
                        for gate in ("silu", "swiglu"):  # fused or not, the same gated output
                            if gate in pass_name:
                                what = (name, gate)
                        if what in first_out:
                            rec["rel_err_vs_first"] = sig6(_rel_err(out, first_out[what]))
                        else:
                            first_out[what] = out
                    del fn, fargs  # before the next case makes its inputs
    return doc


if __name__ == "__main__":
    main()
