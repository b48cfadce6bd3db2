"""Our gmm, tgmm or flash forward at several tilings of one named shape, timed on a TPU chip beside
the tiling the kernel picks itself: does the schedule-ranked choice hold on the chip?

On a TPU VM, from the repository root with tests/, scripts/, torch-ext/ and benchmarks/ on
PYTHONPATH (as for device_timing.py):

    python benchmarks/tile_sweep.py --shape mixtral_8x7b_down_t16384 \\
        --tiles 1024,2048,2048 --tiles 512,14336,512 --out sweep.json
    python benchmarks/tile_sweep.py --kernel flash_attention --shape flux_dev_joint4608 \\
        --tiles 2048,512,2048,256 --out sweep.json
    python benchmarks/tile_sweep.py --shape qwen3_30b_a3b_down_t16384 \\
        --shape mixtral_8x7b_down_t16384 --vary tm=512,2048 --out sweep.json
    python benchmarks/tile_sweep.py --pass tgmm --shape qwen3_30b_a3b_down_t16384 \\
        --vary tm=256,1024 --out sweep.json

Tiles: tm,tk,tn for the gmm and the tgmm (`--pass tgmm`: x [M, K], dy [M, N] -> [G, K, N], as
training_timing.py times it); block_q,block_q_compute,block_kv,block_kv_compute for the flash
forward (the named row's op, its XLA pads around the kernel included), and with a fifth field,
fused (0 / 1), for the flash backward alone (`--kernel flash_attention --pass bwd`:
`flash_attention_bwd` on the forward's o and lse, made once at the kernel's own tiles; di and
the pads around the kernels included, as a training step runs them). `--scheduled GEN` reads
the gmm's, tgmm's or flash forward's tilings from the compiled schedule instead (no chip; the
tgmm's through benchmarks/tgmm_schedule.py's rows), and those of the gmm's dlhs, int8-weight and
fused-gate calls at the row's shape (`--pass dlhs|int8|gated`; `--pass int8` and `--pass dlhs`
are timed on a chip too: the forward with int8 weights, and dy @ w[g].T on training_timing.py's
dy). `--vary FIELD=V1,V2` times, per shape, the
kernel's own tiling with that one field changed (FIELDS names them), so one sweep covers shapes
whose own tilings differ. Every tiling is timed like a named row (device_timing.time_call);
`--interpret` runs a small shape in TPU interpret mode (the plumbing, on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import shapes as shapes_mod
import tgmm_schedule
from device_timing import _device_info, case_record, timed

SMALL = {
    "ragged_dot": shapes_mod.RaggedDotShape("sweep_small", 64, 4, 2, 256, 512),
    "flash_attention": shapes_mod.AttentionShape("sweep_small", 1, 2, 1, 384, 128, causal=False),
}


# The fields of a tiling on the command line, in order (the flash backward's: FLASH_BWD_FIELDS).
FIELDS = {
    "ragged_dot": ("tm", "tk", "tn"),
    "flash_attention": ("block_q", "block_q_compute", "block_kv", "block_kv_compute"),
}
FLASH_BWD_FIELDS = (
    "block_q_bwd",
    "block_q_compute_bwd",
    "block_kv_bwd",
    "block_kv_compute_bwd",
    "fused_bwd",
)


def _field_names(kind, pass_name):
    return FLASH_BWD_FIELDS if pass_name == "bwd" else FIELDS[kind]


def _tiles(adapter, kind, values, pass_name="gmm"):
    """A Tiles / GmmTiling / TgmmTiling from the command line's comma-separated values."""
    tiling = adapter.mod.tiling
    if kind == "ragged_dot":
        return (tiling.TgmmTiling if pass_name == "tgmm" else tiling.GmmTiling)(*values)
    if pass_name == "bwd":
        bq, bqc, bk, bkc, fused = values
        return tiling.backward_tiles(bq, bqc, bk, bkc, bool(fused))  # (forward fields unused)
    bq, bqc, bk, bkc = values
    return tiling.backward_tiles(bq, bqc, bk, bkc, False)  # forward only: its fields


def _fields(kind, tiles, pass_name="gmm"):
    if kind == "ragged_dot":
        return [tiles.tm, tiles.tk, tiles.tn]
    if pass_name == "bwd":
        return [
            tiles.block_q_bwd,
            tiles.q_compute_bwd,
            tiles.block_kv_bwd,
            tiles.kv_compute_bwd,
            int(tiles.fused_bwd),
        ]
    return [tiles.block_q, tiles.q_compute, tiles.block_kv, tiles.block_kv_compute]


def _variants(own: list, names, vary: list) -> list:
    """The own tiling's fields with one field set to each value `--vary FIELD=V1,V2` gives
    (values equal to the own one left out: the kernel's choice is timed anyway)."""
    out = []
    for spec in vary:
        name, _, values = spec.partition("=")
        if name not in names or not values:
            raise SystemExit(
                f"--vary: expected FIELD=V1,V2 with FIELD one of {names}, got {spec!r}"
            )
        i = names.index(name)
        for v in (int(x) for x in values.split(",")):
            if v != own[i]:
                out.append(tuple(own[:i] + [v] + own[i + 1 :]))
    return out


def _sweep(adapter, args, shape, gen):
    """(tiles, record) for each tiling of `shape` the command line asks for: the kernel's own
    choice first, then `--tiles`, then `--vary`'s changes of the own tiling."""
    if args.pass_name == "tgmm":
        own = adapter.mod.tiling.TgmmTiling(*tgmm_schedule.default_tiles(shape, gen))
    elif args.pass_name in GMM_VARIANT_PASSES:
        import ours

        own = ours.gmm_variant_tiles(adapter.mod, shape, args.pass_name, gen)
    else:
        own = (adapter.tiles if args.kernel == "ragged_dot" else adapter._tiles)(shape, gen)
    tilings = [None] + [tuple(int(v) for v in t.split(",")) for t in args.tiles]
    names = _field_names(args.kernel, args.pass_name)
    tilings += _variants(_fields(args.kernel, own, args.pass_name), names, args.vary)
    for t in tilings:
        tiles = own if t is None else _tiles(adapter, args.kernel, t, args.pass_name)
        rec = {
            "shape": shape.name,
            "tiles": _fields(args.kernel, tiles, args.pass_name),
            "kernel_choice": t is None,
        }
        yield tiles, rec


def _tgmm_call(adapter, shape, gen, tiles):
    """(fn, args) of our tgmm at `shape` and `tiles` on training_timing.py's inputs."""
    import training_timing

    tgmm = adapter.mod.kernel.tgmm
    fn = lambda x, dy, gs: tgmm(x, dy, gs, tiling=tiles, generation=gen)  # noqa: E731
    return fn, training_timing.ragged_inputs(shape)


def _dlhs_call(adapter, shape, gen, tiles):
    """(fn, args) of our gmm's dlhs call at `shape` and `tiles` (dy [M, N] @ w[g].T, the tiles
    those of the transposed problem: K and N swapped), on training_timing.py's inputs."""
    import training_timing

    gmm = adapter.mod.kernel.gmm
    _, dy, gs = training_timing.ragged_inputs(shape)
    w = training_timing.ragged_weights(shape)
    fn = lambda dy, w, gs: gmm(dy, w, gs, transpose_rhs=True, tiling=tiles, generation=gen)  # noqa: E731
    return fn, (dy, w, gs)


def _int8_call(adapter, shape, gen, tiles):
    """(fn, args) of our gmm at `shape` and `tiles` with int8 weights and per-channel scales
    (ours.gmm_variant "int8": the forward's shape, its weights quantised)."""
    import jax
    import jax.numpy as jnp

    from ours import _random

    gmm = adapter.mod.kernel.gmm
    lhs = _random(10, (shape.m, shape.k), shape.dtype)
    # one expert's random block, shifted per expert (int8 wraps): a draw of every expert's
    # weights at once needs 32-bit temporaries, 17.5 GB at DeepSeek-V3-like's 256 experts
    one = jax.random.randint(jax.random.key(11), (shape.k, shape.n), -127, 128).astype(jnp.int8)
    rhs = one[None] + jnp.arange(shape.experts, dtype=jnp.int32).astype(jnp.int8)[:, None, None]
    scales = jnp.full((shape.experts, shape.n), 0.01, jnp.float32)
    gs = jnp.asarray(shape.group_sizes, jnp.int32)
    dt = jnp.dtype(shape.dtype)

    def fn(lhs, rhs, gs, scales):
        return gmm(lhs, rhs, gs, scales, out_dtype=dt, tiling=tiles, generation=gen)

    return fn, (lhs, rhs, gs, scales)


def _flash_bwd_call(adapter, shape, gen, tiles):
    """(fn, args) of our flash backward alone at `shape` and backward `tiles`, on
    training_timing.py's inputs: the residuals (o, lse) come from one forward at the kernel's
    own tiles, made here, outside the timing."""
    import jax

    import training_timing

    kernel = adapter.mod.kernel
    options, (q, k, v, do) = training_timing.flash_inputs(shape, gen)
    o, lse = jax.jit(lambda q, k, v: kernel.flash_attention_fwd(q, k, v, **options))(q, k, v)

    def fn(q, k, v, o, lse, do):
        return kernel.flash_attention_bwd(q, k, v, o, lse, do, tiles=tiles, **options)[:3]

    return fn, (q, k, v, o, lse, do)


# The deviceless compile of each kernel's forward at explicit tiles (schedule_targets).
SCHEDULED_TARGETS = {
    "ragged_dot": "schedule_targets:compile_gmm_tiles",
    "flash_attention": "schedule_targets:compile_flash_tiles",
}


# The gmm calls besides the forward that `--scheduled` reads (benchmarks/ours.py GMM_VARIANTS).
GMM_VARIANT_PASSES = ("dlhs", "int8", "gated")


def _scheduled_forward(adapter, kind, shape, gen, tiles, variant="gmm") -> dict:
    """The gmm (or, `variant`, its dlhs, int8 or fused-gate call) or flash forward at `tiles`,
    compiled deviceless and scheduled as its named row is (the tiling's own work list, trips
    and per-step copies)."""
    import schedule_rows

    args = {"shape": shape.name, "tiles": _fields(kind, tiles)}
    trips = None
    if variant != "gmm":
        import ours

        args["variant"] = variant
        _, cost, trips = ours.gmm_variant_row(adapter.mod, shape, variant, gen, tiles)
        info = {"tiling": _fields(kind, tiles), "notes": []}
        shape = ours.gmm_variant(shape, variant)[0]
    else:
        cost, info = adapter.cost(shape, gen, tiles)
    summary = schedule_rows.compiled_summary(kind, "ours", SCHEDULED_TARGETS[kind], args, gen)
    if "error" in summary:
        return summary
    return schedule_rows.schedule_entry(
        kind, "ours", shape, gen, cost, info, summary=summary, tiles=tiles, trips=trips
    )


def _scheduled(args) -> dict:
    """`--scheduled GEN`: the sweep's tilings read from the compiled schedule instead of a chip
    (the gmm, its dlhs / int8 / fused-gate calls and the flash forward:
    `schedule_rows.compiled_summary` of their SCHEDULED_TARGETS, timed by
    `schedule_rows.schedule_entry` with the tiling's own work list and per-step copies; the
    tgmm: `tgmm_schedule.row`): does the schedule order the tilings as the chip does?"""
    import ours

    adapter, gen = ours.ADAPTERS[args.kernel], args.scheduled  # (no chip: any packages)
    named = {s.name: s for s in shapes_mod.NAMED[args.kernel]}
    doc = {
        "meta": {"generation": gen, "scheduled": True},
        "kernel": args.kernel,
        "pass": args.pass_name,
        "rows": [],
    }
    for shape in (named[s] for s in args.shape):
        for tiles, rec in _sweep(adapter, args, shape, gen):
            if args.pass_name == "tgmm":  # tgmm_schedule's row: its cache, its trip counts
                row = tgmm_schedule.row("ours", shape, gen, tuple(rec["tiles"]))
            else:
                row = _scheduled_forward(adapter, args.kernel, shape, gen, tiles, args.pass_name)
            rec.update({k: row[k] for k in ("scheduled_us", "bound", "error") if k in row})
            if row.get("prepare_region_bundles"):  # int8 weights widened once per group run
                rec["prepare_region_bundles"] = row["prepare_region_bundles"]
            print(json.dumps(rec), flush=True)
            doc["rows"].append(rec)
            args.out.write_text(json.dumps(doc, indent=1))
    return doc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", default="ragged_dot", choices=sorted(SMALL))
    p.add_argument("--shape", action="append", required=True, help="named shapes of the kernel")
    p.add_argument("--tiles", action="append", default=[], help="comma-separated (repeatable)")
    p.add_argument(
        "--vary", action="append", default=[], help="FIELD=V1,V2: the own tiling, one field changed"
    )
    p.add_argument(
        "--pass",
        dest="pass_name",
        default="gmm",
        choices=("gmm", "tgmm", "bwd", *GMM_VARIANT_PASSES),
        help="ragged_dot: the forward gmm (default) or the weight gradient tgmm, whose own "
        "tiling is the one benchmarks/tgmm_schedule.py rows, the gmm's dlhs and int8-weight "
        "calls and, with --scheduled only, its fused-gate call (benchmarks/ours.py "
        "GMM_VARIANTS); "
        "flash_attention: the forward (default) or, on a chip, the backward alone (bwd)",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interpret", action="store_true", help="small shape, TPU interpret mode")
    p.add_argument(
        "--scheduled",
        metavar="GENERATION",
        help="no chip: each tiling's scheduled time for GENERATION (deviceless compile and LLO "
        "dump, benchmarks/schedule_model.py; the gmm, the flash forward or, with --pass tgmm, "
        "the tgmm)",
    )
    args = p.parse_args(argv)
    if args.pass_name == "bwd":
        if args.kernel != "flash_attention":
            p.error("--pass bwd: the flash_attention kernel only")
        if args.scheduled:
            p.error("--pass bwd: on a chip only (flash_dump_points.py reads its schedule)")
    elif args.pass_name != "gmm" and args.kernel != "ragged_dot":
        p.error(f"--pass {args.pass_name}: the ragged_dot kernel only")
    if args.pass_name == "gated" and not args.scheduled:
        p.error("--pass gated: with --scheduled only (training_timing.py times it)")
    if args.scheduled:
        return _scheduled(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    import ours

    ours.use_jax_only_packages(Path(tempfile.mkdtemp(prefix="ptk-jax-")))
    adapter = ours.ADAPTERS[args.kernel]
    gen = _device_info()["generation"] or "v5e"
    named = {s.name: s for s in shapes_mod.NAMED[args.kernel]}
    chosen = [named[s] for s in args.shape]
    ctx = contextlib.nullcontext()
    if args.interpret:
        from jax.experimental.pallas import tpu as pltpu

        chosen = [SMALL[args.kernel]]
        ctx = pltpu.force_tpu_interpret_mode()
    doc = {
        "meta": _device_info(),
        "method": __doc__,
        "kernel": args.kernel,
        "pass": args.pass_name,
        "rows": [],
    }
    with ctx:
        for shape in chosen:
            for tiles, rec in _sweep(adapter, args, shape, gen):
                with case_record(doc, rec, args.out, log):
                    if args.pass_name == "tgmm":
                        fn, fargs = _tgmm_call(adapter, shape, gen, tiles)
                    elif args.pass_name == "int8":
                        fn, fargs = _int8_call(adapter, shape, gen, tiles)
                    elif args.pass_name == "dlhs":
                        fn, fargs = _dlhs_call(adapter, shape, gen, tiles)
                    elif args.pass_name == "bwd":
                        fn, fargs = _flash_bwd_call(adapter, shape, gen, tiles)
                    else:
                        fn, fargs = adapter.call(shape, gen, tiles=tiles)
                    rec.update(timed(fn, fargs, target_s=0.0 if args.interpret else 0.2))
    return doc


if __name__ == "__main__":
    main()
