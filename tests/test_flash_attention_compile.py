"""flash-attention-tpu: deviceless Mosaic compiles for v5e, v6e and TPU7x at production shapes
(Llama-3-8B, Gemma-2-style and MQA), forward and backward, with the tiles choose_tiles picks.
In CI every kernel compiles on every generation at some production shape and every shape on some
generation (tpu_compile.generation_per_case); HYPOTHESIS_PROFILE=sweep compiles the whole matrix."""

import os

import jax.numpy as jnp
import pytest

# Several pytest processes on one host may each load libtpu; without this libtpu refuses the
# second one ("multi-process lockfile"). Deviceless compiles share no device, so it is safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import kernel_loader  # noqa: E402
import tpu_compile  # noqa: E402

fa = kernel_loader.load_kernel("flash_attention")
K, T = fa.kernel, fa.tiling

# No skip without libtpu: `make setup` installs it, and a missing one must fail loudly.
pytestmark = [pytest.mark.compile]

SHAPES = {
    # 32 query heads, 8 KV heads, head dim 128, 8192 tokens, causal, batch 1
    "llama3_8b": dict(Hq=32, Hkv=8, S=8192, D=128, causal=True, window=(-1, -1), softcap=0.0),
    # the same with a 1024-token sliding window (the benchmarks' window target)
    "llama3_8b_window1024": dict(
        Hq=32, Hkv=8, S=8192, D=128, causal=True, window=(1023, 0), softcap=0.0
    ),
    # MQA: 32 query heads on one KV head (stacked into one q block of 32 x block_q rows)
    "mqa_32x1": dict(Hq=32, Hkv=1, S=4096, D=128, causal=True, window=(-1, -1), softcap=0.0),
    # head dim 256, soft cap 50, sliding window 4096 (as Transformers passes it: (4095, 4095))
    "gemma2": dict(Hq=16, Hkv=8, S=8192, D=256, causal=True, window=(4095, 4095), softcap=50.0),
    # Flux-dev joint attention: 4608 tokens, which no power-of-two block divides (fitted blocks)
    "flux_dev": dict(Hq=24, Hkv=24, S=4608, D=128, causal=False, window=(-1, -1), softcap=0.0),
    # Gemma-like heads at 3072 tokens: a kv block of all 3072 keys over 2 x 1024 stacked rows
    "gqa_d256_3072": dict(Hq=16, Hkv=8, S=3072, D=256, causal=True, window=(-1, -1), softcap=0.0),
    # Wan-like video attention: 12 heads, 32768 tokens, full: 4096-key forward blocks
    "wan_like": dict(Hq=12, Hkv=12, S=32768, D=128, causal=False, window=(-1, -1), softcap=0.0),
}


def _compile(gen, shape, direction, tiles=None):
    """The forward or backward at SHAPES[shape] for `gen`, with the tiles choose_tiles picks
    (or `tiles`)."""
    s = SHAPES[shape]
    Hq, Hkv, S, D = s["Hq"], s["Hkv"], s["S"], s["D"]
    tiles = tiles or T.choose_tiles(
        q_len=S,
        kv_len=S,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=jnp.bfloat16,
        causal=s["causal"],
        window_size=s["window"],
        generation=gen,
    )
    cfg = dict(
        causal=s["causal"],
        window_size=s["window"],
        softcap=s["softcap"],
        tiles=tiles,
        generation=gen,  # the softmax path (bf16 exp, interior tile) follows the generation
    )
    q = ((1, Hq, S, D), jnp.bfloat16)
    kv = ((1, Hkv, S, D), jnp.bfloat16)
    if direction == "fwd":
        compiled = tpu_compile.compile_for(
            gen, lambda q, k, v: K.flash_attention_fwd(q, k, v, **cfg), q, kv, kv
        )
    else:
        lse = ((1, Hq, S), jnp.float32)
        compiled = tpu_compile.compile_for(
            gen,
            lambda q, k, v, o, lse, do: K.flash_attention_bwd(q, k, v, o, lse, do, **cfg)[:3],
            q,
            kv,
            kv,
            q,
            lse,
            q,
        )
    return compiled, tiles


def _check_compiles(gen, shape, direction):
    compiled, tiles = _compile(gen, shape, direction)
    # The work lists come from loop-free XLA ops (each while-loop iteration costs microseconds).
    assert tpu_compile.xla_while_loops(compiled) == []
    limit = tiles.vmem_limit_bytes if direction == "fwd" else tiles.vmem_limit_bytes_bwd
    assert limit <= T.GENERATIONS[gen].vmem_bytes * 3 // 4


# Every shape's forward on one generation each in CI, every generation compiling some
# (tpu_compile.generation_per_case; every generation for every shape in the long form). Llama-3-8B
# goes to v5e (20-28 s a compile on each generation: one is what CI can afford of it).
@pytest.mark.parametrize(
    "gen,shape",
    (
        [(g, "llama3_8b") for g in tpu_compile.TESTED_GENERATIONS]
        if tpu_compile.LONG_FORM
        else [("v5e", "llama3_8b")]
    )
    # the Llama sliding window compiles in the long form only: gemma2's window (with softcap)
    # covers the windowed forward in CI
    + tpu_compile.generation_per_case(
        sorted(
            set(SHAPES)
            - {"llama3_8b"}
            - (set() if tpu_compile.LONG_FORM else {"llama3_8b_window1024"})
        ),
        # start 2 puts MQA (32 stacked heads, ~115 s to compile for v5e) on TPU7x (~10 s) in CI
        start=2,
    ),
)
def test_compiles_forward_at_production_shapes(gen, shape):
    _check_compiles(gen, shape, "fwd")


# The backward kernel at every shape, each on one generation in CI (every generation gets one:
# tpu_compile.generation_per_case); every generation for every shape in the long form.
@pytest.mark.parametrize("gen,shape", tpu_compile.generation_per_case(sorted(SHAPES)))
def test_compiles_backward_at_production_shapes(gen, shape):
    _check_compiles(gen, shape, "bwd")


# v5e in CI (19 s; the same compile took 47 s for v6e), every generation in the long form.
@pytest.mark.parametrize("gen", tpu_compile.one_generation(0))
def test_compiles_varlen_sinks_odd_head_dim(gen):
    """Packed varlen with sinks at head dim 80 (not a lane multiple), bf16, both directions."""
    Hq, Hkv, T_, D = 8, 2, 2000, 80
    tiles = T.choose_tiles(
        q_len=T_,
        kv_len=T_,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=jnp.bfloat16,
        causal=True,
        generation=gen,
    )
    cfg = dict(causal=True, window_size=(255, -1), tiles=tiles, generation=gen)
    q = ((T_, Hq, D), jnp.bfloat16)
    kv = ((T_, Hkv, D), jnp.bfloat16)
    cu = ((9,), jnp.int32)
    sinks = ((Hq,), jnp.float32)
    tpu_compile.compile_for(
        gen,
        lambda q, k, v, s, cu: K.flash_attention_fwd(
            q, k, v, sinks=s, cu_seqlens_q=cu, cu_seqlens_k=cu, **cfg
        ),
        q,
        kv,
        kv,
        sinks,
        cu,
    )
    tpu_compile.compile_for(
        gen,
        lambda q, k, v, o, lse, do, s, cu: K.flash_attention_bwd(
            q, k, v, o, lse, do, sinks=s, cu_seqlens_q=cu, cu_seqlens_k=cu, **cfg
        )[:4],
        q,
        kv,
        kv,
        q,
        ((1, Hq, T_), jnp.float32),
        q,
        sinks,
        cu,
    )


# One generation in CI (a variant of the Llama-3-8B compile), every one in the long form.
@pytest.mark.parametrize("gen", tpu_compile.one_generation(2))
def test_compiles_segment_ids_at_llama_shape(gen):
    """Dense segment ids (packed documents in one row) at Llama-3-8B 8192 causal, both directions."""
    s = SHAPES["llama3_8b"]
    Hq, Hkv, S, D = s["Hq"], s["Hkv"], s["S"], s["D"]
    tiles = T.choose_tiles(
        q_len=S,
        kv_len=S,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=jnp.bfloat16,
        causal=True,
        generation=gen,
        segments=True,
    )
    q = ((1, Hq, S, D), jnp.bfloat16)
    kv = ((1, Hkv, S, D), jnp.bfloat16)
    seg = ((1, S), jnp.int32)
    tpu_compile.compile_for(
        gen,
        lambda q, k, v, sq, sk: K.flash_attention_fwd(
            q,
            k,
            v,
            causal=True,
            q_segment_ids=sq,
            kv_segment_ids=sk,
            tiles=tiles,
            generation=gen,
        ),
        q,
        kv,
        kv,
        seg,
        seg,
    )
    tpu_compile.compile_for(
        gen,
        lambda q, k, v, o, lse, do, sq, sk: K.flash_attention_bwd(
            q, k, v, o, lse, do, causal=True, q_segment_ids=sq, kv_segment_ids=sk, tiles=tiles
        )[:3],
        q,
        kv,
        kv,
        q,
        ((1, Hq, S), jnp.float32),
        q,
        seg,
        seg,
    )


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_compiles_fused_backward(gen):
    """Llama-3-8B heads at 2048 tokens: dq of the sequence fits VMEM on every generation, so
    choose_tiles takes the fused backward (one kernel, dq resident in VMEM); it must compile."""
    s = dict(SHAPES["llama3_8b"], S=2048)
    Hq, Hkv, S, D = s["Hq"], s["Hkv"], s["S"], s["D"]
    tiles = T.choose_tiles(
        q_len=S,
        kv_len=S,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=jnp.bfloat16,
        causal=True,
        generation=gen,
    )
    assert tiles.fused_bwd
    q = ((1, Hq, S, D), jnp.bfloat16)
    kv = ((1, Hkv, S, D), jnp.bfloat16)
    tpu_compile.compile_for(
        gen,
        lambda q, k, v, o, lse, do: K.flash_attention_bwd(
            q, k, v, o, lse, do, causal=True, tiles=tiles
        )[:3],
        q,
        kv,
        kv,
        q,
        ((1, Hq, S), jnp.float32),
        q,
    )


# v5e in CI (the generation whose VMEM limit it overflowed), every one in the long form.
@pytest.mark.parametrize("gen", tpu_compile.one_generation(0))
def test_compiles_kv_blocks_fitted_past_2048_keys(gen):
    """Gemma-like heads at 3072 tokens: choose_tiles takes a kv block of all 3072 keys
    (fitted_blocks, no XLA pad) over 2 x 1024 stacked query rows; on v5e that overflowed the
    VMEM limit the budget model set when it counted one score tile's temporaries (24.1 MB
    against 23.6)."""
    _, tiles = _compile(gen, "gqa_d256_3072", "fwd")
    assert max(tiles.block_kv, tiles.block_kv_bwd) > 2048, tiles
    assert 3072 % tiles.q_multiple == 0 and 3072 % tiles.kv_multiple == 0, tiles


def test_explicit_tiles_get_vmem_limits():
    """Tiles(...) given by hand carry no VMEM limits; the kernel sets them from the budget model
    as choose_tiles does. On a TPU v5e chip these blocks (1536 x 4608 at Flux-dev, 512-key
    compute tiles, the fused backward) failed to compile without them (Mosaic's default scoped
    limit); both passes compile here for v5e."""
    tiles = T.Tiles(
        1536,
        4608,
        512,
        1536,
        4608,
        block_q_compute=512,
        block_q_compute_bwd=512,
        block_kv_compute_bwd=512,
        fused_bwd=True,
    )
    assert tiles.vmem_limit_bytes is None and tiles.vmem_limit_bytes_bwd is None
    limited = T.with_vmem_limits(tiles, 1, 128, jnp.bfloat16, "v5e", False, 4608)
    assert limited.vmem_limit_bytes_bwd > T.GENERATIONS["v5e"].scoped_vmem_default_bytes
    for direction in ("fwd", "bwd"):
        _compile("v5e", "flux_dev", direction, tiles)
