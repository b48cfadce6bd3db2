"""Our kernels and the anchors compiled and run on a TPU chip: wall-clock times of every named row
and a correctness check of the compiled kernels against the f32 references.

On a TPU VM with JAX (torch is not needed: the kernels load as plain JAX packages,
`ours.use_jax_only_packages`), from the repository root with tests/, scripts/, torch-ext/ and
benchmarks/ on PYTHONPATH:

    python benchmarks/device_timing.py check --out device_check.json
    python benchmarks/device_timing.py time --kernel ragged_dot --out measured_ragged_dot.json

and back here, with the files copied into benchmarks/results/device/ and named in MEASURED_FILES,
to put the times beside the compiled schedule in results.json / results.md (run.py re-applies
them whenever it rewrites the results):

    python benchmarks/device_timing.py merge            # results/device/ (MEASURED_FILES)

How a row is timed: the row's jitted op (the same function the deviceless compile reads, the
XLA ops around the kernel included) on random inputs made on the chip, compiled and run twice,
then run back to back `n` times with one wait at the end (n sized to ~0.2 s of work, at least 3),
three such runs, the fastest run's mean per call. Back-to-back calls keep the chip's queue full,
so the host's dispatch time is hidden behind the device work as in a model's step; a row that
dispatches faster than the chip runs it measures the chip. `run.py --device tpu` (a TPU VM with
the whole stack) times the rows of its own section with the same `time_call`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import registry
import shapes as shapes_mod
from rows import sig6

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_call(f, args, target_s: float = 0.2, runs: int = 3, warmup: int = 2) -> dict:
    """Seconds per call of `f(*args)` (jitted) on its device: `warmup` calls (the first compiles),
    then `runs` runs of n back-to-back calls with one wait at the end; the fastest run's mean."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one_s = time.perf_counter() - t0
    n = max(3, min(200, int(target_s / max(one_s, 1e-6))))
    means = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = f(*args)  # earlier outputs are freed once their computation finishes
        jax.block_until_ready(out)
        means.append((time.perf_counter() - t0) / n)
    return {
        "seconds": min(means),
        "run_means_s": [sig6(m) for m in means],
        "calls_per_run": n,
        "single_call_s": sig6(one_s),
        "first_call_s": sig6(first_s),  # compile + one run
    }


def timed(fn, args, target_s: float = 0.2) -> dict:
    """`time_call` of `fn` (jitted here unless it is already) as a record's fields: measured_us
    and the run details."""
    import jax

    t = time_call(fn if hasattr(fn, "lower") else jax.jit(fn), args, target_s=target_s)
    us = sig6(t.pop("seconds") * 1e6)
    return {**t, "measured_us": us}


@contextlib.contextmanager
def case_record(doc: dict, rec: dict, out: Path, log):
    """One case of a chip run: the body fills `rec`; an exception it raises becomes the case's
    error (a case that fails is recorded, never dropped); then its wall time, and the document
    is rewritten (a run cut short keeps what it timed)."""
    t0 = time.time()
    try:
        yield rec
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:600]
    rec["wall_s"] = round(time.time() - t0, 1)
    doc["rows"].append(rec)
    _write(out, doc)
    log(json.dumps(rec))


def row_callable(kind: str, impl: str, shape, generation: str):
    """(fn, args) of one named row: the function the deviceless compile reads (compile_args),
    on the inputs the row's `call` makes."""
    import ours

    if impl == "ours":
        a = ours.ADAPTERS[kind]
        fn, _ = a.compile_args(shape, generation)
        _, args = a.call(shape, generation)
    else:
        a = registry.anchor(kind, impl)
        fn, _ = a.compile_args(shape, generation)
        _, args = a.call(shape, False, generation)
    return fn, args


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
    """Time every row of a section on the attached TPU (`run.py --device tpu`): per_generation
    [gen] gains measured_us and measured_fraction_of_roofline. `device` and `generation`
    default to the first TPU and its generation (the tests pass the CPU); `iters` bounds the
    calls per run."""
    import jax

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
        fn, args = row_callable(row["kernel"], row["impl"], shape, gen)
        args = jax.device_put(args, device)
        t = time_call(jax.jit(fn), args, target_s=0.0, runs=max(1, iters // 3), warmup=warmup)
        pg = row["per_generation"].setdefault(gen, {})
        _put_measured(pg, t["seconds"] * 1e6)
        log(f"  {row['kernel']}/{shape.name}/{row['impl']} on {gen}: {t['seconds'] * 1e6:.1f} us")


def _put_measured(pg: dict, us: float) -> None:
    pg["measured_us"] = sig6(us)
    if pg.get("roofline_us"):
        pg["measured_fraction_of_roofline"] = sig6(pg["roofline_us"] / us)


# ---------------------------------------------------------------------------------------------
# The device run's inputs: made on the chip in their own dtype
# ---------------------------------------------------------------------------------------------


def _bf16_when_large():
    """Make jax.random.normal draw large f32 requests in bf16: the benchmarks' inputs are drawn
    in f32 and cast to the row's dtype, and a DeepSeek-like weight stack drawn in f32 (15 GB)
    does not fit a 16 GiB chip. The values stay standard normal; only their rounding changes."""
    import jax
    import jax.numpy as jnp

    normal = jax.random.normal

    def drawn(key, shape=(), dtype=jnp.float32, *a, **kw):
        if jnp.dtype(dtype) == jnp.float32 and math.prod(shape) >= 1 << 26:
            dtype = jnp.bfloat16
        return normal(key, shape, dtype, *a, **kw)

    jax.random.normal = drawn


_GENERATION: list[str] = []  # --generation: the tiles' generation where no TPU is attached


def _device_info() -> dict:
    import jax

    from tpu_generations import detect_generation

    d = jax.devices()[0]
    return {
        "device_kind": d.device_kind,
        "platform": d.platform,
        "generation": detect_generation() or (_GENERATION or [None])[0],
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def _write(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _same_inputs_check(kind, shape, gen, fn, args):
    """Our named-shape output against an anchor's on the same inputs (the ragged dot's megablox,
    the attention's splash): max |ours - anchor| / max |anchor|. None for the paged kernel (the
    anchor keeps another cache layout)."""
    import jax
    import jax.numpy as jnp

    if kind == "ragged_dot":
        other, _ = registry.anchor(kind, "anchor:megablox_default").compile_args(shape, gen)
    elif kind == "flash_attention":
        other, _ = registry.anchor(kind, "anchor:splash").compile_args(shape, gen)
    else:
        return None
    a = jax.jit(fn)(*args).astype(jnp.float32)
    if kind == "flash_attention" and shape.batch == 1:  # splash's [H, S, D]: no batch axis
        b = jax.jit(other)(*(x[0] for x in args))[None].astype(jnp.float32)
    else:
        b = jax.jit(other)(*args).astype(jnp.float32)
    if kind == "ragged_dot":  # megablox leaves rows past the groups unwritten; ours zeroes them
        live = int(sum(shape.group_sizes))
        a, b = a[:live], b[:live]
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def time_named_rows(kinds, out: Path, log, only_impls=None, shape_names=None) -> dict:
    """Every named row of `kinds` (our kernel and each anchor) timed on the chip; the document is
    rewritten after each row, so a run cut short keeps what it timed."""
    import gc

    gen = _device_info()["generation"]
    doc = {"meta": _device_info(), "method": __doc__.split("How a row is timed: ")[1], "rows": []}
    for kind in kinds:
        impls = [a.impl for a in registry.ANCHORS[kind]] + ["ours"]
        for shape in shapes_mod.NAMED[kind]:
            if shape_names and shape.name not in shape_names:
                continue
            for impl in impls:
                if only_impls and impl not in only_impls:
                    continue
                rec = {"kernel": kind, "shape": shape.name, "impl": impl, "generation": gen}
                with case_record(doc, rec, out, log):
                    why = (
                        registry.anchor(kind, impl).unsupported(shape, gen)
                        if impl != "ours"
                        else None
                    )
                    if why:
                        rec["unsupported"] = why
                    else:
                        fn, args = row_callable(kind, impl, shape, gen)
                        rec.update(timed(fn, args))
                        if impl == "ours":
                            try:
                                rec["rel_err_vs_anchor"] = _same_inputs_check(
                                    kind, shape, gen, fn, args
                                )
                            except Exception as e:
                                rec["anchor_check_error"] = f"{type(e).__name__}: {e}"[:300]
                        del args
                gc.collect()
    return doc


# ---------------------------------------------------------------------------------------------
# Correctness of the compiled kernels on the chip
# ---------------------------------------------------------------------------------------------

# (shape, kind): small enough for a host f32/f64 reference, large enough for several tiles,
# ragged group sizes, partial blocks and every masking path the named shapes use.
CHECK_SHAPES = {
    "ragged_dot": [
        shapes_mod.RaggedDotShape("check_gmm_t300_e8", 300, 8, 2, 512, 768),
        shapes_mod.RaggedDotShape("check_gmm_t1000_e16", 1000, 16, 4, 1024, 512),
        shapes_mod.RaggedDotShape("check_gmm_f32_t200", 200, 8, 2, 256, 384, dtype="float32"),
    ],
    "flash_attention": [
        shapes_mod.AttentionShape("check_causal_gqa_1536", 1, 8, 2, 1536, 128),
        shapes_mod.AttentionShape("check_window300_1024", 2, 4, 4, 1024, 128, window=300),
        shapes_mod.AttentionShape("check_d256_softcap", 1, 4, 2, 1024, 256, softcap=30.0),
        shapes_mod.AttentionShape("check_d64_full", 1, 4, 1, 640, 64, causal=False),
        shapes_mod.AttentionShape("check_packed4_1024", 1, 4, 2, 1024, 128, documents=4),
    ],
    "paged_attention": [
        shapes_mod.PagedShape(
            "check_mixed_head_major", ((1, 700), (1, 33), (57, 300), (1, 1025)), 8, 2, 128, 16
        ),
        shapes_mod.PagedShape(
            "check_mixed_token_major",
            ((1, 700), (1, 33), (57, 300), (1, 1025)),
            8,
            2,
            128,
            16,
            layout="token_major",
        ),
        shapes_mod.PagedShape(
            "check_decode_int8",
            ((1, 513), (1, 64), (1, 2000)),
            32,
            8,
            128,
            128,
            layout="token_major",
            kv_dtype="int8",
        ),  # fmt: skip
        shapes_mod.PagedShape(
            "check_decode_fp8",
            ((1, 513), (1, 64), (1, 2000)),
            32,
            8,
            128,
            128,
            layout="token_major",
            kv_dtype="float8_e4m3fn",
        ),  # fmt: skip
        shapes_mod.PagedShape(
            "check_window_token_major",
            ((1, 900), (20, 400)),
            8,
            2,
            128,
            16,
            window=128,
            layout="token_major",
        ),  # fmt: skip
    ],
}


def _reference(kind, shape, mod, args):
    """The f32 reference of our kernel on `args` (numpy, on the host)."""
    import jax.numpy as jnp
    import numpy as np

    ref = mod.reference
    host = [np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a) for a in args]
    if kind == "ragged_dot":
        return ref.gmm_reference(host[0], host[1], host[2])
    if kind == "flash_attention":
        import jax

        ids = shape.segment_ids()
        rows = None if ids is None else np.broadcast_to(ids, (shape.batch, shape.seq))
        w = (-1, -1) if shape.window is None else (shape.window - 1, 0)
        with jax.default_device(jax.devices("cpu")[0]):
            o = ref.attention(
                *host[:3], causal=shape.causal, window_size=w, softcap=shape.softcap or 0.0,
                q_segment_ids=rows, kv_segment_ids=rows,
            )  # fmt: skip
        return np.asarray(o)
    opts = dict(sliding_window=shape.window)
    if shape.layout == "token_major":
        k, v = host[1], host[2]
        if shape.kv_dtype is not None:
            k = ref.dequantize_token_major(k, host[7])
            v = ref.dequantize_token_major(v, host[8])
        return ref.paged_attention_token_major_ref(host[0], k, v, *host[3:7], **opts)
    return ref.ragged_paged_attention_ref(*host[:6], **opts)


def _ragged_direct_cases(mod, gen):
    """(name, got, want) of the entry points the benchmark adapter does not reach: tgmm,
    transposed and int8 weights, the fused gate, and group sizes that leave rows past their sum
    (those must come out zero)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    K, ref = mod.kernel, mod.reference
    rng = np.random.default_rng(7)
    m, k, n, g = 700, 384, 640, 6
    gs = np.array([0, 150, 3, 257, 0, 190], np.int32)  # sums to 600 < m
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    q = np.clip(np.round(w * 40), -127, 127).astype(np.int8)
    scales = np.full((g, n), 1 / 40, np.float32)
    jit = lambda f, **kw: jax.jit(lambda *a: f(*a, generation=gen, **kw))  # noqa: E731
    yield (
        "gmm_rows_past_groups",
        jit(K.gmm)(bf(x), bf(w), gs),
        ref.gmm_reference(f32(x), f32(w), gs),
    )
    wt = np.swapaxes(w, 1, 2)
    yield (
        "gmm_transpose_rhs",
        jit(K.gmm, transpose_rhs=True)(bf(x), bf(wt), gs),
        ref.gmm_reference(f32(x), f32(wt), gs, transpose_rhs=True),
    )
    yield (
        "gmm_int8_weights",
        jit(K.gmm)(bf(x), jnp.asarray(q), gs, jnp.asarray(scales)),
        ref.gmm_reference(f32(x), q, gs, scales),
    )
    yield "tgmm", jit(K.tgmm)(bf(x), bf(dy), gs), ref.tgmm_reference(f32(x), f32(dy), gs)
    for act, layout in (("silu", "concatenated"), ("gpt_oss_swiglu", "interleaved")):
        yield (
            f"gmm_gated_{act}_{layout}",
            jit(K.gmm_gated, activation=act, layout=layout)(bf(x), bf(w), gs),
            ref.gmm_gated_reference(f32(x), f32(w), gs, activation=act, layout=layout),
        )
    # Three K blocks of 128: each item's running sums overwritten by its first K block and
    # written through to the output block by every K block (tiling.gmm_windows_write_output).
    kb3 = mod.tiling.GmmTiling(256, 128, 128)
    yield (
        "gmm_k_blocks",
        jit(K.gmm, tiling=kb3)(bf(x), bf(w), gs),
        ref.gmm_reference(f32(x), f32(w), gs),
    )
    yield (
        "gmm_int8_k_blocks",
        jit(K.gmm, tiling=kb3)(bf(x), jnp.asarray(q), gs, jnp.asarray(scales)),
        ref.gmm_reference(f32(x), q, gs, scales),
    )
    kb3_gated = mod.tiling.GmmTiling(256, 128, n // 2)  # tn divides I = 320: its two halves
    yield (
        "gmm_gated_silu_concatenated_k_blocks",
        jit(K.gmm_gated, activation="silu", layout="concatenated", tiling=kb3_gated)(
            bf(x), bf(w), gs
        ),
        ref.gmm_gated_reference(f32(x), f32(w), gs, activation="silu", layout="concatenated"),
    )


def _flash_backward_cases(mod, gen):
    """(name, got, want) of the flash backward (dq, dk, dv) against jax.vjp of the f32 reference
    on the host, causal GQA and a sliding window."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    K, ref = mod.kernel, mod.reference
    rng = np.random.default_rng(11)
    for name, hq, hkv, s, d, kw in (
        ("flash_bwd_causal_gqa", 4, 2, 1024, 128, dict(causal=True)),
        ("flash_bwd_window200_d256", 2, 2, 768, 256, dict(causal=True, window_size=(199, 0))),
    ):
        q, k, v, do = (
            np.asarray(jnp.asarray(rng.standard_normal(sh), jnp.bfloat16).astype(jnp.float32))
            for sh in ((1, hq, s, d), (1, hkv, s, d), (1, hkv, s, d), (1, hq, s, d))
        )
        bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, do)]

        def run(q, k, v, do, kw=kw):
            o, lse = K.flash_attention_fwd(q, k, v, generation=gen, **kw)
            return K.flash_attention_bwd(q, k, v, o, lse, do, generation=gen, **kw)

        got = jax.jit(run)(*bf)
        with jax.default_device(jax.devices("cpu")[0]):
            _, vjp = jax.vjp(lambda q, k, v, kw=kw: ref.attention(q, k, v, **kw), q, k, v)
            want = vjp(jnp.asarray(do))
        for part, a, b in zip("q k v".split(), got, want):
            yield f"{name}_d{part}", a, np.asarray(b)


def check_kernels(kinds, out: Path, log) -> dict:
    """Each CHECK_SHAPES case compiled for the chip and compared with the f32 reference:
    max |kernel - ref| / max |ref| and whether it is within the tests' tolerance (2e-2 for bf16
    inputs, 2e-3 for f32; the paged 8-bit cases 3e-2, their quantisation error included)."""
    import jax
    import numpy as np

    import ours

    gen = _device_info()["generation"]
    doc = {"meta": _device_info(), "cases": []}
    for kind in kinds:
        a = ours.ADAPTERS[kind]
        for shape in CHECK_SHAPES[kind]:
            rec = {"kernel": kind, "shape": shape.name}
            try:
                fn, args = a.call(shape, gen)
                got = np.asarray(jax.jit(fn)(*args)).astype(np.float32)
                want = _reference(kind, shape, a.mod, args)
                if kind == "ragged_dot":  # rows past the groups: exactly zero
                    live = int(sum(shape.group_sizes))
                    rec["rows_past_groups_zero"] = bool(np.all(got[live:] == 0))
                err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
                tol = 2e-3 if shape.dtype == "float32" else 2e-2
                tol = 3e-2 if getattr(shape, "kv_dtype", None) else tol
                rec.update(
                    rel_err=sig6(err), tol=tol, ok=bool(err <= tol and np.isfinite(got).all())
                )
                if kind == "ragged_dot":
                    rec["ok"] = rec["ok"] and rec["rows_past_groups_zero"]
            except Exception as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:600])
            doc["cases"].append(rec)
            _write(out, doc)
            log(json.dumps(rec))
        direct = {"ragged_dot": _ragged_direct_cases, "flash_attention": _flash_backward_cases}
        if kind in direct:
            cases = direct[kind](a.mod, gen)
            while True:
                rec = {"kernel": kind}
                try:
                    name, got, want = next(cases)
                except StopIteration:
                    break
                except Exception as e:
                    rec.update(
                        shape="(direct cases)", ok=False, error=f"{type(e).__name__}: {e}"[:600]
                    )
                    doc["cases"].append(rec)
                    _write(out, doc)
                    log(json.dumps(rec))
                    break
                got = np.asarray(got).astype(np.float32)
                err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
                rows_zero = name != "gmm_rows_past_groups" or bool(np.all(got[600:] == 0))
                ok = err <= 2e-2 and bool(np.isfinite(got).all()) and rows_zero
                rec.update(shape=name, rel_err=sig6(err), tol=2e-2, ok=ok)
                doc["cases"].append(rec)
                _write(out, doc)
                log(json.dumps(rec))
    return doc


# ---------------------------------------------------------------------------------------------
# Back here: the times into results.json / results.md
# ---------------------------------------------------------------------------------------------


# The chip runs whose times results.json carries, oldest first (a later file's row wins): what
# `run.py` re-applies whenever it rewrites the results. The other files are evidence, not
# results: v5e_ragged_ours_before_program_fit.json (our gmm before its program fitted one
# instruction-memory overlay), v5e_ragged_ours.json's and v5e_ragged_rest.json's rows of ours
# (before the work-list builders lost their XLA while loops; v5e_ragged_ours_loop_free.json
# re-times every one), v5e_decode_probe.json (benchmarks/decode_dma_probe.py),
# v5e_fp8_mxu_codes.json (benchmarks/fp8_mxu_probe.py: every e4m3 code through the MXU) and the
# check files (the compiled kernels against the f32 references). v5e_paged_e4m3_pairs.json timed
# the e4m3 bit-decoded pair path that v5e_paged_8bit_mxu.json's quads replaced.
DEVICE_DIR = HERE / "results" / "device"
MEASURED_FILES = (
    "v5e_ragged_anchors.json",
    "v5e_ragged_anchors_deepseek.json",
    "v5e_ragged_ours.json",
    "v5e_ragged_rest.json",
    "v5e_ragged_ours_loop_free.json",
    "v5e_flash.json",
    "v5e_flash_all.json",
    "v5e_paged.json",
    "v5e_paged_ours.json",
    "v5e_flash_flux.json",
    "v5e_ragged_ours_step_overlap.json",
    "v5e_flash_wan_long_kv.json",
    "v5e_flash_checked.json",
    "v5e_paged_e4m3_pairs.json",
    "v5e_paged_8bit_mxu.json",
    "v5e_ragged_ours_lhs_in_loop.json",
    "v5e_ragged_ours_run_ahead.json",
    "v5e_ragged_ours_run_ahead_sweep_picks.json",
    "v5e_ragged_ours_run_ahead_tiles.json",
    # the gmm's windows write its output block where one K block holds all of K (no accumulator
    # zeroing or copy-out per row tile), at the kernel's tiles (unchanged by it);
    # v5e_ragged_ours_before_write_through.json is the previous kernel timed in the same session,
    # v5e_ragged_ours_write_through.json the new one again with Qwen3-30B-A3B 16384 at 256-row
    # tiles (a step model the chip then overruled: tiling._step_vregs)
    "v5e_ragged_ours_write_through_same_tiles.json",
    # the paged kernel without Mosaic's DMA bounds checks (page ids clamped), every named row at
    # unchanged tiles; v5e_paged_before_no_bounds_checks.json is the previous kernel timed in the
    # same session (every row within 0.4%: v5e's decode rows are DMA-bound), and
    # v5e_paged_check_no_bounds_checks.json the new kernel against the f32 references
    "v5e_paged_no_bounds_checks.json",
    # the paged kernel waiting for an item's full pages with one wait per array, every named row
    # at unchanged tiles; v5e_paged_before_whole_slot_waits.json is the previous kernel timed in
    # the same session (every row within 0.2%: DMA-bound), v5e_paged_check_whole_slot_waits.json
    # the new kernel against the f32 references
    "v5e_paged_whole_slot_waits.json",
    # the paged kernel starting an item's pages in straight-line code where they fill its slot
    # (token scales kept in HBM), every named row at unchanged tiles;
    # v5e_paged_before_straight_line_issue.json is the previous kernel timed in the same session
    # (every row within 0.4%: DMA-bound), v5e_paged_check_straight_line_issue.json the new
    # kernel against the f32 references
    "v5e_paged_straight_line_issue.json",
    # the gmm's windows write its output block at every K block too (the running sums in an f32
    # accumulator each item's first K block overwrites; the concatenated fused gate likewise),
    # at unchanged tiles: Mixtral-8x7B down 16384 (seven K blocks) and two one-K-block controls;
    # v5e_ragged_ours_before_windows_write_output.json is the previous kernel timed in the same
    # session, v5e_train_gated_(before_)windows_write_output.json the fused gate and dlhs passes,
    # v5e_ragged_check_windows_write_output.json the new kernels against the f32 references
    "v5e_ragged_ours_windows_write_output.json",
    # the gmm at the tiles the corrected VMEM model picks (tiling.WINDOW_SCRATCH_BYTES): DeepSeek-
    # V3-like down 4096 and Mixtral-8x7B gate_up 16384 (v5e_ragged_ours_before_vmem_model.json:
    # the previous tiles in the same session), then Mixtral-8x7B down 16384 and two unchanged
    # controls with the final tiling code; v5e_ragged_check_vmem_model.json: the checks
    "v5e_ragged_ours_vmem_model.json",
    "v5e_ragged_ours_vmem_model_final.json",
    # the flash forward writing a q block out 128 rows of a head at a time (kernel.py
    # _normalise_and_store; it was one op on the whole block after another, each through VMEM),
    # every named row at unchanged tiles; v5e_flash_before_chunked_finish.json is the previous
    # kernel timed in the same session, v5e_flash_check_chunked_finish.json the new kernel
    # against the f32 references (forward and, through its lse, backward)
    "v5e_flash_chunked_finish.json",
    # the forward's edge walk cut into groups of four and one tail group of its exact length
    # (kernel._groups; a window q tile of five kv slices was a lone masked tile and a group of
    # four), the five named rows with edge items; v5e_flash_before_tail_groups.json the previous
    # kernel in the same session, v5e_flash_check_tail_groups.json the checks (backward too)
    "v5e_flash_tail_groups.json",
    # masked tiles building one head's mask for the G heads they stack (then kernel._where_heads),
    # the six named rows with masked tiles; v5e_flash_before_head_masks.json the previous kernel in
    # the same session, v5e_flash_check_head_masks.json the checks (backward too). Gemma's row
    # there ran the per-head mask on v5e's d=256 tiles too, which tiling.mask_per_head then
    # left out (1.0% slower): v5e_flash_head_masks_v5e_d256.json times the kernel as it is
    # (Gemma, and window 1024 again: 1228.8 against 1228.1 us)
    "v5e_flash_head_masks.json",
    "v5e_flash_head_masks_v5e_d256.json",
    # the forward adding one head's mask to the G heads as a 0 / NEG_INF bias
    # (kernel._masked_scores), four named rows; v5e_flash_before_bias_mask.json the previous
    # kernel in the same session, v5e_flash_check_bias_mask.json the checks (backward too)
    "v5e_flash_bias_mask.json",
    # masked tiles comparing against the band alone where no sequence end can fall inside a block
    # (a dense call), one compare per score where no tile meets both band edges, the forward's row
    # bounds once per group (kernel._in_bounds), four named rows; v5e_flash_before_one_compare.json
    # the previous kernel in the same session, v5e_flash_check_one_compare.json the checks
    "v5e_flash_one_compare.json",
    # our gmm at the tiles it picks once ragged dot's VMEM budget became flash attention's
    # (tpu_generations.vmem_budget_bytes), the v5e rows whose tiles moved: DeepSeek-V3-like (its
    # previous tiles timed in the files above) and Mixtral-8x7B (previous tiles beside the new ones
    # in the same session: v5e_gmm_tile_sweep_budget.json)
    "v5e_ragged_ours_budget.json",
    "v5e_ragged_ours_budget_mixtral.json",
    # our gmm at the tiles v5e's program budget of 41k MXU bundles picks (tiling.PROGRAM_MXU_BUNDLES,
    # was 28k): Mixtral-8x7B down at 256 rows over all of K (128 before; both tilings timed in one
    # session: v5e_gmm_budget41k.json; outputs at both against an f32 XLA reference:
    # v5e_gmm_budget41k_check.json)
    "v5e_ragged_ours_budget41k.json",
    # the other ten v5e rows at the same budget: their tiles unchanged, their windows wider
    # (tiling.window_cols: 256 -> 384 columns at Qwen3-30B-A3B gate_up, 512 -> 1024 at its down,
    # 128 -> 256 / 512 -> 896 at DeepSeek-V3-like); the previous windows' times are the files above
    "v5e_ragged_ours_budget41k_windows.json",
    # the soft-capped forward taking its exps against a fixed max (tiling.softcap_fixed_max),
    # Gemma's row; v5e_flash_before_fixed_max.json the previous kernel in the same session,
    # v5e_flash_check_fixed_max.json the checks (backward too)
    "v5e_flash_fixed_max.json",
)


def apply_measured(results: dict, files=None) -> dict:
    """Put the measured times of `files` (default: MEASURED_FILES in results/device/) into
    results' named rows (per_generation[gen].measured_us, measured_fraction_of_roofline) and
    meta.device_timing. A row no file times keeps what it had."""
    files = [Path(f) for f in (files or [DEVICE_DIR / f for f in MEASURED_FILES])]
    rows = {(r["kernel"], r["shape"], r["impl"]): r for r in results["named"]["rows"]}
    runs = results.setdefault("meta", {}).setdefault("device_timing", [])
    for f in files:
        doc = json.loads(f.read_text())
        runs[:] = [r for r in runs if r.get("file") != f.name]
        runs.append({**doc["meta"], "file": f.name, "method": doc["method"]})
        for rec in doc["rows"]:
            row = rows.get((rec["kernel"], rec["shape"], rec["impl"]))
            if row is None or "measured_us" not in rec:
                continue
            pg = row["per_generation"].setdefault(rec["generation"], {})
            _put_measured(pg, rec["measured_us"])
            if rec.get("rel_err_vs_anchor") is not None:
                pg["measured_rel_err_vs_anchor"] = sig6(rec["rel_err_vs_anchor"])
    return results


def merge(files, results_dir: Path, log) -> dict:
    """`apply_measured` on results_dir/results.json, then rewrite results.json / results.md."""
    import report

    path = results_dir / "results.json"
    results = apply_measured(json.loads(path.read_text()), files)
    report.write_outputs(results, results_dir, report.markdown(results))
    log(f"merged {len(files or MEASURED_FILES)} file(s) into {path}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time", help="time the named rows on the attached TPU")
    t.add_argument("--kernel", action="append", choices=registry.KINDS)
    t.add_argument("--impl", action="append", help="only these implementations")
    t.add_argument("--shape", action="append", help="only these named shapes")
    t.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="compiled kernels against the f32 references on the TPU")
    c.add_argument("--kernel", action="append", choices=registry.KINDS)
    c.add_argument("--out", type=Path, required=True)
    for q in (t, c):
        q.add_argument("--generation", help="tiles for this generation when no TPU is attached")
        q.add_argument(
            "--interpret",
            action="store_true",
            help="TPU interpret mode (a CPU run of the plumbing)",
        )
    m = sub.add_parser("merge", help="put measured times into results.json / results.md")
    m.add_argument("files", nargs="*", help="default: MEASURED_FILES in results/device/")
    m.add_argument("--results", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.cmd == "merge":
        return merge(args.files, args.results, log)
    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    _bf16_when_large()
    _GENERATION[:] = [args.generation] if args.generation else []
    kinds = tuple(args.kernel or registry.KINDS)
    import contextlib

    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode() if args.interpret else contextlib.nullcontext():
        if args.cmd == "check":
            return check_kernels(kinds, args.out, log)
        return time_named_rows(kinds, args.out, log, args.impl, args.shape)


if __name__ == "__main__":
    main()
