"""What `llo_schedule.py` can compile by name: our kernels and the anchors at every named
benchmark shape (benchmarks/shapes.py), plus a plain block matmul as the known reference.

A target is `module:function`; the function is called in a fresh process as
`function(generation, **args)` and compiles one program for that generation (libtpu then writes
the dump). `resolve(impl, shape)` turns a benchmark row (`ours:<kernel>` or `anchor:<id>`, a named
shape) into such a target.
"""

from __future__ import annotations

# The op-name filter of each implementation's Mosaic kernel (the pallas_call's `name=`); None
# dumps every kernel of the program (anchors whose kernels carry generated names).
KERNEL_NAMES = {
    "ours:ragged_dot": "ragged_dot_gmm",
    "ours:flash_attention": "flash_attention_fwd",
    "ours:paged_attention": "ragged_paged_attention",
}


def _shape(kind: str, name: str):
    import shapes

    for table in (shapes.NAMED, shapes.SMALL):
        for s in table.get(kind, []):
            if s.name == name:
                return s
    raise KeyError(f"no {kind} shape named {name!r}")


def _kind_of(shape_name: str) -> str:
    import shapes

    for table in (shapes.NAMED, shapes.SMALL):
        for kind, rows in table.items():
            if any(s.name == shape_name for s in rows):
                return kind
    raise KeyError(f"no named shape {shape_name!r}")


def compile_row(generation: str, impl: str, shape: str):
    """Compile the benchmark row (impl, shape) for `generation`, as benchmarks/run.py does;
    returns the Compiled object."""
    import jax

    import tpu_compile

    with jax.default_device(tpu_compile.tpu_device(generation)):
        return lower_row(generation, impl, shape).compile()


def lower_row(generation: str, impl: str, shape: str):
    """The benchmark row (impl, shape) lowered for `generation` (the program `compile_row`
    compiles); returns the Lowered object."""

    kind = _kind_of(shape)
    s = _shape(kind, shape)
    if impl.startswith("ours"):
        import ours

        fn, avals = ours.ADAPTERS[kind].compile_args(s, generation)
    else:
        import registry

        fn, avals = registry.anchor(kind, impl).compile_args(s, generation)
    return _lowered(generation, fn, avals)


def _lowered(generation: str, fn, avals):
    """`fn` lowered for `generation` on the avals [(shape, dtype), ...], with the deviceless
    chip as the default device (eager ops in `fn` would otherwise land on the host)."""
    import jax

    import tpu_compile

    with jax.default_device(tpu_compile.tpu_device(generation)):
        return tpu_compile.lower_for(generation, fn, *avals)


def plain_matmul(
    generation: str, m: int = 2048, k: int = 4096, n: int = 1024, block: int = 512
) -> None:
    """A plain Pallas block matmul: one (block x K) @ (K x block) dot per grid step. Its schedule
    is the reference for what 'MXU-bound' looks like (0.93 MXU occupancy on v6e)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    import tpu_compile

    def body(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32).astype(
            o_ref.dtype
        )

    def mm(a, b):
        return pl.pallas_call(
            body,
            grid=(m // block, n // block),
            in_specs=[
                pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, block), lambda i, j: (0, j)),
            ],
            out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
            name="plain_matmul",
        )(a, b)

    tpu_compile.compile_for(generation, mm, ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16))


def resolve(impl: str, shape: str | None) -> tuple[str, dict, str | None]:
    """(target, args, op-name filter) for a CLI request."""
    if impl == "plain_matmul":
        return "schedule_targets:plain_matmul", {}, "plain_matmul"
    if shape is None:
        raise ValueError(f"{impl} needs a named shape")
    kind = _kind_of(shape)
    full = f"ours:{kind}" if impl == "ours" else impl
    return ("schedule_targets:compile_row", {"impl": full, "shape": shape}, KERNEL_NAMES.get(full))


def describe() -> str:
    import registry
    import shapes

    lines = ["plain_matmul                 (no shape)"]
    for kind, rows in shapes.NAMED.items():
        impls = [f"ours:{kind}"] + [a.impl for a in registry.ANCHORS.get(kind, [])]
        lines.append(f"{kind}: implementations {', '.join(impls)}")
        lines.append(f"  shapes: {', '.join(s.name for s in rows + shapes.SMALL.get(kind, []))}")
    return "\n".join(lines)


def _ragged(shape: str):
    """(the named ragged shape, our ragged_dot package, its dtype) of a ragged compile target."""
    import jax.numpy as jnp

    import ours

    s = _shape("ragged_dot", shape)
    return s, ours.ADAPTERS["ragged_dot"].mod, jnp.dtype(s.dtype)


def compile_tgmm_tiles(generation: str, shape: str, tiles=None):
    """Our tgmm (weight gradient: lhs [M, K], dout [M, N] -> [G, K, N]) at the named ragged
    benchmark shape's M / K / N / groups with explicit tiles (tm, tk, tn), or the generation's
    default tiles when None: the tgmm points of the tile-ranking calibration
    (tile_model_calibration.json "tgmm_points") were dumped with it (op-name filter
    ragged_dot_tgmm)."""
    return lower_tgmm_tiles(generation, shape, tiles).compile()


def lower_tgmm_tiles(generation: str, shape: str, tiles=None):
    """`compile_tgmm_tiles`' program, lowered (not compiled)."""
    import jax.numpy as jnp

    s, mod, dt = _ragged(shape)
    t = mod.tiling.TgmmTiling(*tiles) if tiles else None

    def fn(lhs, dout, gs):
        return mod.kernel.tgmm(lhs, dout, gs, out_dtype=dt, tiling=t, generation=generation)

    avals = [((s.m, s.k), dt), ((s.m, s.n), dt), ((s.experts,), jnp.int32)]
    return _lowered(generation, fn, avals)


def compile_megablox_tgmm(generation: str, shape: str, tiles):
    """megablox's tgmm at the named ragged benchmark shape's M / K / N / groups and tiles
    (tm, tk, tn), as the benchmarks' tgmm rows compare it (benchmarks/tgmm_schedule.py)."""
    return lower_megablox_tgmm(generation, shape, tiles).compile()


def lower_megablox_tgmm(generation: str, shape: str, tiles):
    """`compile_megablox_tgmm`'s program, lowered (not compiled)."""
    import anchors

    fn, avals = anchors.tgmm_compile_args(_ragged(shape)[0], tuple(tiles))
    return _lowered(generation, fn, avals)


def compile_gmm_tiles(generation: str, shape: str, tiles=None, variant: str = "gmm"):
    """Our gmm, the named ragged row's program, at explicit tiles (tm, tk, tn) (the
    generation's own when None): what `tile_sweep.py` times on a chip, compiled deviceless so
    its schedule can be read beside the chip's time (op-name filter ragged_dot_gmm). `variant`
    (benchmarks/ours.py GMM_VARIANTS): the forward, or the dlhs, int8 or fused-gate call the
    row's shape stands for (`ours.gmm_variant`)."""
    return _gmm_variant_lowered(generation, shape, tiles, variant).compile()


def _gmm_variant_lowered(generation, shape, tiles, variant, layout="concatenated"):
    """The lowered program of `compile_gmm_tiles` (and `compile_gated`, any `layout`)."""
    import jax.numpy as jnp

    import ours

    s, mod, dt = _ragged(shape)
    vs, opts = ours.gmm_variant(s, variant)
    t = mod.tiling.GmmTiling(*tiles) if tiles else None
    kw = dict(tiling=t, generation=generation)
    wn = 2 * vs.n if variant == "gated" else vs.n
    w = ((s.experts, wn, vs.k) if opts.get("transpose_rhs") else (s.experts, vs.k, wn), dt)
    avals = [((vs.m, vs.k), dt), w, ((s.experts,), jnp.int32)]
    if variant == "gated":
        fn = lambda x, w, gs: mod.kernel.gmm_gated(x, w, gs, layout=layout, **kw)  # noqa: E731
    elif variant == "int8":
        avals[1] = (w[0], jnp.int8)
        avals.append(((s.experts, vs.n), jnp.float32))

        def fn(x, w, gs, scales):
            return mod.kernel.gmm(x, w, gs, scales, out_dtype=dt, **kw)
    else:
        transpose = bool(opts.get("transpose_rhs"))

        def fn(x, w, gs):
            return mod.kernel.gmm(x, w, gs, transpose_rhs=transpose, out_dtype=dt, **kw)

    return _lowered(generation, fn, avals)


def compile_flash_tiles(generation: str, shape: str, tiles):
    """Our flash forward, the named attention row's program, at explicit tiles (block_q,
    block_q_compute, block_kv, block_kv_compute): what `tile_sweep.py --kernel flash_attention`
    times on a chip, compiled deviceless so its schedule can be read beside the chip's time."""
    import ours

    adapter = ours.ADAPTERS["flash_attention"]
    t = adapter.mod.tiling.backward_tiles(*tiles, False)  # forward only: its fields
    fn, avals = adapter.compile_args(_shape("flash_attention", shape), generation, t)
    return _lowered(generation, fn, avals).compile()


def compile_flash_forward(
    generation: str,
    q_heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int = 128,
    window: int = 0,
    softcap: float = 0.0,
):
    """Our flash forward, causal, on one sequence of `seq` tokens with the heads given, a window
    of `window` keys (0: none) and a soft cap, at the tiles the kernel picks: forwards no named
    row covers, whose program size the kernel bounds (tiling.forward_program_bundles; op-name
    filter flash_attention_fwd)."""
    import jax.numpy as jnp

    import ours

    K = ours.ADAPTERS["flash_attention"].mod.kernel

    def fn(q, k, v):
        return K.flash_attention_fwd(
            q,
            k,
            v,
            causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
            softcap=softcap,
            generation=generation,
        )

    q = ((1, q_heads, seq, head_dim), jnp.bfloat16)
    kv = ((1, kv_heads, seq, head_dim), jnp.bfloat16)
    return _lowered(generation, fn, [q, kv, kv]).compile()


def compile_dlhs(generation: str, shape: str):
    """Our dlhs (the forward's lhs gradient: dout [M, N] times the same weights [G, K, N] read
    with transpose_rhs, -> [M, K]) at the named ragged benchmark shape with the generation's
    default tiles (op-name filter ragged_dot_gmm)."""
    return compile_gmm_tiles(generation, shape, variant="dlhs")


def compile_xla_dot(generation: str, m: int = 32768, k: int = 14336, n: int = 4096):
    """XLA's own dense bf16 matmul [m, k] x [k, n] (f32 accumulation, bf16 out), the rate an
    MXU-bound kernel can reach (training_timing.py times it on the chip); the defaults are
    Mixtral-8x7B down's dims at 16384 tokens (op-name filter: none, it is XLA's fusion)."""
    import jax.numpy as jnp

    def fn(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    avals = [((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16)]
    return _lowered(generation, fn, avals).compile()


def compile_gated(generation: str, shape: str, layout: str = "concatenated", tiles=None):
    """Our gate_up gmm with its SiLU gate fused (`kernel.gmm_gated`, weights [G, K, N] with N =
    2I) at the named gate_up shape, the generation's default tiles or explicit (tm, tk, tn)
    (op-name filter ragged_dot_gmm)."""
    return _gmm_variant_lowered(generation, shape, tiles, "gated", layout).compile()


def compile_flash_bwd_tiles(generation: str, shape: str, tiles, fused: bool = False):
    """Our flash backward at the named flash benchmark shape with explicit backward tiles
    (block_q_bwd, block_q_compute_bwd, block_kv_bwd, block_kv_compute_bwd): two passes (op-name
    filters flash_attention_dkdv and flash_attention_dq) or, with `fused`, the one kernel that
    keeps dq in VMEM (flash_attention_dkdvq). The backward points of the tile-ranking calibration
    (tile_model_calibration.json "bwd_points") were dumped with it. The VMEM limit is the one
    choose_tiles would grant these tiles."""
    import jax.numpy as jnp

    import ours

    s = _shape("flash_attention", shape)
    mod = ours.ADAPTERS["flash_attention"].mod
    T = mod.tiling
    gen = T.get_generation(generation)
    bq, bqc, bk, bkc = tiles
    groups = s.q_heads // s.kv_heads
    dt = jnp.dtype(s.dtype)
    seq_q = -(-s.seq // bq) * bq if fused else None
    need = T.vmem_need_bwd(groups, s.head_dim, dt.itemsize, bq, bk, False, bqc, bkc, seq_q)
    t = T.backward_tiles(
        bq, bqc, bk, bkc, fused, vmem_limit_bytes_bwd=T.vmem_limit_bytes(gen, need)
    )
    window = (s.window - 1, 0) if s.window else (-1, -1)

    def fn(q, k, v, o, lse, do):
        return mod.kernel.flash_attention_bwd(
            q,
            k,
            v,
            o,
            lse,
            do,
            causal=s.causal,
            window_size=window,
            softcap=s.softcap or 0.0,
            tiles=t,
            generation=generation,
        )[:3]

    qs = ((s.batch, s.q_heads, s.seq, s.head_dim), dt)
    kvs = ((s.batch, s.kv_heads, s.seq, s.head_dim), dt)
    lse = ((s.batch, s.q_heads, s.seq), jnp.float32)
    return _lowered(generation, fn, [qs, kvs, kvs, qs, lse, qs]).compile()
