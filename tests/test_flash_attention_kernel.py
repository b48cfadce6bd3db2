"""flash-attention-tpu, kernel level (JAX): forward and gradients against the f32 reference in
plain interpret mode over hypothesis-drawn shapes and features, the work list, the cost model,
and small shapes in TPU interpret mode (races, NaN-filled memory, raising out-of-bounds reads)."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_loader
import tpu_interpreter

fa = kernel_loader.load_kernel("flash_attention")
K, R, T = fa.kernel, fa.reference, fa.tiling

# Small tiles so that short sequences still span several q and kv blocks, each split into two
# compute tiles per axis (plain interpret mode accepts any power-of-two tile; real TPUs get >= 128
# from choose_tiles).
SMALL = T.Tiles(
    block_q=32,
    block_kv=32,
    block_kv_compute=16,
    block_q_bwd=16,
    block_kv_bwd=32,
    block_q_compute=16,
    block_kv_compute_bwd=16,
)
# Four compute tiles per block along each axis, and backward blocks of other shapes.
WIDE = T.Tiles(
    block_q=64,
    block_kv=64,
    block_kv_compute=16,
    block_q_bwd=32,
    block_kv_bwd=16,
    block_q_compute=16,
    block_q_compute_bwd=16,
)
# The fused backward (dq resident in VMEM for the whole sequence).
FUSED = dataclasses.replace(WIDE, block_kv_bwd=32, block_kv_compute_bwd=16, fused_bwd=True)
# Fewer, heavier examples than the profile's default: each one compiles two kernels.
N_EXAMPLES = max(3, settings.default.max_examples // 2)


def _rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)


def _close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _dense_case(B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, sinks, segments, seed=0):
    q = _rand(seed, (B, Hq, Sq, D), dtype)
    k = _rand(seed + 1, (B, Hkv, Sk, D), dtype)
    v = _rand(seed + 2, (B, Hkv, Sk, D), dtype)
    s = _rand(seed + 3, (Hq,)) if sinks else None
    qseg = kseg = None
    if segments:
        assert Sq == Sk
        qseg = jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 3, (B, Sq)), axis=1))
        kseg = qseg
    cfg = dict(causal=causal, window_size=window, softcap=softcap)
    return q, k, v, s, qseg, kseg, cfg


def _check_dense(
    q, k, v, s, qseg, kseg, cfg, tiles=SMALL, grads=True, interpret=True, generation=None
):
    """The forward (and with `grads` the backward) against the f32 reference, built for
    `generation` (None: the default, v6e); returns the forward's (o, lse)."""
    dtype = q.dtype
    kw = dict(tiles=tiles, interpret=interpret, generation=generation, **cfg)
    # jit: eager dispatch of the many small ops costs far more than one compile.
    fwd = jax.jit(functools.partial(K.flash_attention_fwd, **kw))
    o, lse = fwd(q, k, v, sinks=s, q_segment_ids=qseg, kv_segment_ids=kseg)
    seg = dict(q_segment_ids=qseg, kv_segment_ids=kseg)
    ref, ref_lse = jax.jit(functools.partial(R.attention_with_lse, **cfg))(q, k, v, sinks=s, **seg)
    assert o.shape == q.shape and o.dtype == q.dtype
    _close(o, ref, **_tol(dtype))
    sees = np.isfinite(np.asarray(ref_lse))  # rows that see nothing carry a sentinel lse
    _close(np.asarray(lse)[sees], np.asarray(ref_lse)[sees], **_tol(dtype))
    if not grads:
        return o, lse
    do = _rand(99, q.shape, dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref_fn = lambda q, k, v, s: R.attention(q, k, v, sinks=s, **seg, **cfg)  # noqa: E731
    want = jax.jit(lambda *a: jax.vjp(o_ref_fn, *a[:4])[1](a[4]))(*f32, s, do.astype(jnp.float32))
    if dtype != jnp.float32:
        # The backward's di = rowsum(do * o) uses the o the forward returned (bf16), as flash
        # attention does everywhere; where p ~ 1 the difference dp - di cancels and that rounding
        # shows. d lse / d(inputs) is what multiplies the di error, so the reference gets the same
        # term: want += vjp(lse)(di_exact - di_kernel).
        lse_fn = lambda q, k, v, s: R.attention_with_lse(q, k, v, sinks=s, **seg, **cfg)[1]  # noqa: E731
        dof = do.astype(jnp.float32)
        d_di = jnp.sum(dof * ref, -1) - jnp.sum(dof * o.astype(jnp.float32), -1)
        d_di = jnp.where(jnp.isfinite(ref_lse), d_di, 0.0)
        fix = jax.jit(lambda *a: jax.vjp(lse_fn, *a[:4])[1](a[4]))(*f32, s, d_di)
        want = [None if w is None else w + jnp.nan_to_num(f) for w, f in zip(want, fix)]
    bwd = jax.jit(functools.partial(K.flash_attention_bwd, **kw))
    got = bwd(q, k, v, o, lse, do, sinks=s, q_segment_ids=qseg, kv_segment_ids=kseg)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        if w is None:
            assert g is None
            continue
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        # Relative to the largest gradient, floored: where the exact gradient is 0 (a row that sees
        # one key has d softmax = 0) f32 rounding of ds = p * (dp - di) leaves ~1e-6.
        scale = max(float(np.max(np.abs(np.asarray(w)))), 1e-1)
        atol = 1e-4 if dtype == jnp.float32 else 5e-2  # relative to the largest gradient
        np.testing.assert_allclose(
            np.asarray(g, np.float32) / scale,
            np.asarray(w) / scale,
            atol=atol,
            rtol=0,
            err_msg=name,
        )
    return o, lse


def test_softcap_fixed_max_keeps_every_exp_a_normal_f32():
    """tiling.softcap_fixed_max: the static max of a soft-capped forward keeps exp2(s - M) of
    every capped score s within [2^FIXED_MAX_LOWEST_EXP, 2^FIXED_MAX_HIGHEST_EXP] (at most 1
    up to a cap of 34.6), and is None without a cap, with sinks, or past the widest cap."""
    assert T.softcap_fixed_max(0.0, False) is None
    assert T.softcap_fixed_max(50.0, True) is None
    assert T.softcap_fixed_max(60.0, False) is None  # c = 86.6: 2^(2c - 100) > 2^64
    for cap, highest in ((1.0, 0.0), (30.0, 0.0), (34.6, 0.0), (50.0, 44.27), (56.0, 61.58)):
        m, c = T.softcap_fixed_max(cap, False), cap * T.LOG2E
        assert -c - m >= T.FIXED_MAX_LOWEST_EXP - 1e-9
        assert c - m == pytest.approx(highest, abs=0.01) and c - m <= T.FIXED_MAX_HIGHEST_EXP


def test_v6e_soft_capped_forward_narrows_its_kv_slices():
    """tiling.with_fixed_max_kv_compute: v6e's forward against a fixed max takes 256-key kv
    compute slices; with sinks, without a cap, on TPU7x or v5e, or where the ranked slice is no
    wider, the ranked tile stays."""
    t = T.Tiles(2048, 2048, 512, 1024, 1024, block_q_compute=512)
    narrowed = T.with_fixed_max_kv_compute("v6e", t, 50.0, False)
    assert narrowed == dataclasses.replace(t, block_kv_compute=256)
    assert T.with_fixed_max_kv_compute("v6e", t, 50.0, True) == t
    assert T.with_fixed_max_kv_compute("v6e", t, 0.0, False) == t
    assert T.with_fixed_max_kv_compute("tpu7x", t, 50.0, False) == t
    assert T.with_fixed_max_kv_compute("v5e", t, 50.0, False) == t
    narrow = T.Tiles(1024, 1024, 128, 512, 512, block_q_compute=256)
    assert T.with_fixed_max_kv_compute("v6e", narrow, 50.0, False) == narrow


def _saturated_case(Sq, Sk, softcap, seed=0):
    """q and k along one direction so that soft-capped scores sit at either end of the cap: one
    q head's rows score every key near -cap (exps down to 2^-100 against a fixed max), one near
    +cap (the largest exps), two in between; GQA, values and noise random."""
    u = jnp.ones((64,), jnp.float32) / 8.0
    sign = jnp.asarray([-1.0, 1.0, 0.02, -0.02])[None, :, None, None]
    q = 400.0 * sign * u + 0.1 * _rand(seed, (1, 4, Sq, 64))
    k = (1.0 + 0.5 * jnp.abs(_rand(seed + 1, (1, 2, Sk, 1)))) * 8.0 * u
    v = _rand(seed + 2, (1, 2, Sk, 64))
    return q, k, v


@pytest.mark.timeout(300)
@pytest.mark.parametrize("softcap", [50.0, 80.0])  # the fixed max; the running max (too wide)
def test_softcap_scores_at_both_ends_of_the_cap(softcap):
    """Scores pushed against both ends of the cap (`_saturated_case`: scaled products of +-50 to
    +-125 against a cap of 50 or 80), with a window (masked tiles) and bottom-right causal rows
    that see no key (Sq > Sk), forward and backward against the f32 reference."""
    assert (T.softcap_fixed_max(softcap, False) is None) == (softcap == 80.0)
    cfg = dict(causal=True, window_size=(20, -1), softcap=softcap)
    _check_dense(*_saturated_case(56, 40, softcap), None, None, None, cfg)


@st.composite
def dense_configs(draw):
    hkv = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 4]))
    sq = draw(st.integers(1, 70))
    sk = draw(st.one_of(st.just(sq), st.integers(1, 70)))
    d = draw(st.sampled_from([64, 80, 96, 128, 256]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, -1, 0, 5, 17]))
    right = draw(st.sampled_from([-1, -1, 0, 3]))
    softcap = draw(st.sampled_from([0.0, 0.0, 4.0]))
    sinks = draw(st.booleans())
    batch = draw(st.sampled_from([1, 2]))
    segments = sq == sk and draw(st.booleans())
    tiles = draw(st.sampled_from([SMALL, WIDE, FUSED]))
    return (
        batch,
        groups * hkv,
        hkv,
        sq,
        sk,
        d,
        dtype,
        causal,
        (left, right),
        softcap,
        sinks,
        segments,
        tiles,
    )


@pytest.mark.sweep
@settings(max_examples=N_EXAMPLES)
@given(dense_configs())
def test_dense_forward_and_grads_sweep(config):
    B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, sinks, segments, tiles = config
    _check_dense(
        *_dense_case(B, Hq, Hkv, Sq, Sk, D, dtype, causal, window, softcap, sinks, segments),
        tiles=tiles,
    )


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_each_head_dim_forward(D):
    _check_dense(
        *_dense_case(1, 2, 1, 33, 47, D, jnp.float32, True, (-1, -1), 0.0, False, False),
        grads=False,
    )


@pytest.mark.parametrize(
    "name,B,Hq,Hkv,Sq,Sk,causal,window,softcap,sinks,dtype",
    [
        ("causal_gqa_f32", 2, 4, 2, 50, 50, True, (-1, -1), 0.0, False, jnp.float32),
        ("causal_sq_lt_sk_mqa", 1, 4, 1, 21, 77, True, (-1, -1), 0.0, False, jnp.float32),
        ("window_softcap_sinks_bf16", 1, 4, 2, 64, 64, True, (9, -1), 6.0, True, jnp.bfloat16),
        ("bidirectional_window", 1, 2, 2, 45, 45, False, (7, 4), 0.0, False, jnp.float32),
        ("sq_gt_sk_rows_see_nothing", 1, 2, 1, 40, 12, True, (-1, -1), 0.0, True, jnp.float32),
        # Unpadded lengths and a band wider than a tile's diagonal: one compare per score.
        ("window_one_compare_masks", 1, 4, 2, 96, 96, True, (40, -1), 0.0, False, jnp.float32),
        ("bidirectional_one_compare", 1, 2, 1, 96, 96, False, (20, 20), 0.0, True, jnp.float32),
    ],
)
def test_dense_features(name, B, Hq, Hkv, Sq, Sk, causal, window, softcap, sinks, dtype):
    _check_dense(*_dense_case(B, Hq, Hkv, Sq, Sk, 64, dtype, causal, window, softcap, sinks, False))


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_softmax_path_per_generation(gen):
    """bf16 inputs take exp2 in bf16 on v6e / TPU7x (f32 on v5e, f32 for f32 inputs) in the
    forward and the dq pass, and only v6e runs interior items as taller q tiles, within the VMEM
    the call already asked for; each path in interpret mode against the f32 reference (forward
    atol = rtol = 3e-2, gradients 5e-2 of the largest), with a window and sinks so that
    interior, edge and masked tiles all run."""
    bf16 = gen in ("v6e", "tpu7x")
    assert T.exp_in_bf16(gen, jnp.bfloat16) == bf16
    assert T.mask_per_head(gen, 128) and T.mask_per_head(gen, 256) == (gen != "v5e")
    assert T.mask_scores_before_exp(gen) == (gen != "v5e")
    assert not T.exp_in_bf16(gen, jnp.float32)
    tall = T.interior_q_compute(gen, WIDE, 2, 64, 2, False)
    assert tall == (WIDE.block_q if gen == "v6e" else WIDE.q_compute)
    assert T.interior_q_compute(gen, WIDE, 2, 64, 2, True) == WIDE.q_compute  # segment ids
    # the need of the taller tile stays within what the default tiles' limit grants
    t = T.choose_tiles(
        q_len=8192,
        kv_len=8192,
        num_q_heads=8,
        num_kv_heads=8,
        head_dim=256,
        dtype=jnp.bfloat16,
        causal=True,
        generation=gen,
    )
    bqi = T.interior_q_compute(gen, t, 1, 256, 2, False)
    assert t.block_q % bqi == 0 and bqi >= t.q_compute
    need = T.vmem_need_fwd(1, 256, 2, t.block_q, t.block_kv, t.block_kv_compute, False, bqi)
    assert need * 1.25 + 2 * 2**20 <= t.vmem_limit_bytes
    # v5e at d=256 also builds each masked tile's mask for all its heads (tiling.mask_per_head);
    # one q head per KV head masks whole tiles, the backward its scores or its probabilities
    # (tiling.mask_scores_before_exp).
    for hq, D in ((4, 64), (2, 64), (4, 256)) if gen == "v5e" else ((4, 64), (2, 64)):
        q, k, v, s, qseg, kseg, cfg = _dense_case(
            1, hq, 2, 200, 200, D, jnp.bfloat16, True, (90, 0), 0.0, True, False, seed=5
        )
        _check_dense(q, k, v, s, qseg, kseg, cfg, tiles=WIDE, generation=gen)


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids(causal):
    _check_dense(*_dense_case(2, 4, 2, 56, 56, 64, jnp.float32, causal, (-1, -1), 0.0, True, True))


def test_differentiable_jax_api_with_segment_ids():
    """kernel.flash_attention (custom_vjp): values and jax.grad with sinks and packed documents."""
    q, k, v, s, qseg, kseg, cfg = _dense_case(
        2, 4, 2, 48, 48, 64, jnp.float32, True, (-1, -1), 0.0, True, True, seed=5
    )
    w = _rand(50, q.shape)

    def loss(fn):
        return lambda q, k, v, s: jnp.sum(
            fn(q, k, v, sinks=s, q_segment_ids=qseg, kv_segment_ids=kseg, **cfg) * w
        )

    ours = functools.partial(K.flash_attention, tiles=SMALL, interpret=True)
    got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, s)
    want = jax.jit(jax.value_and_grad(loss(R.attention), argnums=(0, 1, 2, 3)))(q, k, v, s)
    _close(got[0], want[0], rtol=1e-4, atol=1e-3)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got[1], want[1]):
        _close(g, r, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("only_q_ids", ValueError, "given together"),
        ("wrong_shape", ValueError, r"q_segment_ids must have shape \[batch, seq\]"),
        ("float_ids", TypeError, "kv_segment_ids must be an integer array"),
        ("with_cu_seqlens", ValueError, "cannot be combined"),
    ],
)
def test_segment_ids_bad_input(case, error, match):
    q = jnp.zeros((2, 4, 32, 64))
    k = jnp.zeros((2, 2, 32, 64))
    ids = jnp.zeros((2, 32), jnp.int32)
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids)
    if case == "only_q_ids":
        kw = dict(q_segment_ids=ids)
    elif case == "wrong_shape":
        kw["q_segment_ids"] = jnp.zeros((2, 31), jnp.int32)
    elif case == "float_ids":
        kw["kv_segment_ids"] = ids.astype(jnp.float32)
    else:
        q, k = q[0].swapaxes(0, 1), k[0].swapaxes(0, 1)
        cu = jnp.asarray([0, 32], jnp.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    fn = K.flash_attention_fwd if case == "with_cu_seqlens" else K.flash_attention
    with pytest.raises(error, match=match):
        fn(q, k, k, interpret=True, **kw)


# -------------------------------------------------------------------------------------------------
# varlen
# -------------------------------------------------------------------------------------------------


def _check_varlen(
    lens_q, lens_k, Hq, Hkv, D, dtype, cfg, sinks=False, tiles=SMALL, interpret=True, grads=True
):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _rand(0, (int(cq[-1]), Hq, D), dtype)
    k = _rand(1, (int(ck[-1]), Hkv, D), dtype)
    v = _rand(2, (int(ck[-1]), Hkv, D), dtype)
    s = _rand(3, (Hq,)) if sinks else None
    cu = dict(cu_seqlens_q=jnp.asarray(cq), cu_seqlens_k=jnp.asarray(ck))
    fwd = jax.jit(functools.partial(K.flash_attention_fwd, tiles=tiles, interpret=interpret, **cfg))
    o, lse = fwd(q, k, v, sinks=s, **cu)

    def ref_fn(q, k, v, s):
        return R.attention_varlen(q, k, v, cq, ck, sinks=s, **cfg)

    _close(o, jax.jit(ref_fn)(q, k, v, s), **_tol(dtype))
    if not grads:
        return
    do = _rand(7, q.shape, dtype)
    want = jax.jit(lambda *a: jax.vjp(ref_fn, *a[:4])[1](a[4]))(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        s,
        do.astype(jnp.float32),
    )
    bwd = jax.jit(functools.partial(K.flash_attention_bwd, tiles=tiles, interpret=interpret, **cfg))
    got = bwd(q, k, v, o, lse, do, sinks=s, **cu)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        if w is None:
            continue
        # Relative to the largest gradient, floored: where the exact gradient is 0 (a row that sees
        # one key has d softmax = 0) f32 rounding of ds = p * (dp - di) leaves ~1e-6.
        scale = max(float(np.max(np.abs(np.asarray(w)))), 1e-1)
        atol = 1e-4 if dtype == jnp.float32 else 5e-2
        np.testing.assert_allclose(
            np.asarray(g, np.float32) / scale,
            np.asarray(w) / scale,
            atol=atol,
            rtol=0,
            err_msg=name,
        )
    return o, lse


@st.composite
def varlen_configs(draw):
    n = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    same = draw(st.booleans())
    lens_k = lens_q if same else [lq + draw(st.integers(0, 20)) for lq in lens_q]
    causal = draw(st.booleans())
    window = (draw(st.sampled_from([-1, 6])), -1)
    softcap = draw(st.sampled_from([0.0, 3.0]))
    sinks = draw(st.booleans())
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    tiles = draw(st.sampled_from([SMALL, WIDE, FUSED]))
    return lens_q, lens_k, causal, window, softcap, sinks, dtype, tiles


@pytest.mark.sweep
@settings(max_examples=max(3, N_EXAMPLES // 2))  # each example compiles a fresh list builder
@given(varlen_configs())
def test_varlen_forward_and_grads_sweep(config):
    lens_q, lens_k, causal, window, softcap, sinks, dtype, tiles = config
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q, lens_k = [l + 1 for l in lens_q], [l + 1 for l in lens_k]
    _check_varlen(
        lens_q,
        lens_k,
        4,
        2,
        64,
        dtype,
        dict(causal=causal, window_size=window, softcap=softcap),
        sinks=sinks,
        tiles=tiles,
    )


def test_varlen_packed_causal_gqa():
    _check_varlen([5, 30, 1, 17], [5, 30, 1, 17], 4, 1, 128, jnp.float32, dict(causal=True))


# -------------------------------------------------------------------------------------------------
# Work list and cost model
# -------------------------------------------------------------------------------------------------


def _brute_pairs(seqs, nq, nk, bq, bk, band):
    """(q block, kv block, seq) triples with at least one allowed pair, by enumeration."""
    out = set()
    for s, (ql, qh, kl, kh, off) in enumerate(zip(*seqs)):
        for t in range(ql, qh):
            for u in range(kl, kh):
                d = u - t + off
                if band.lo <= d <= band.hi:
                    out.add((t // bq, u // bk, s))
    return out


@settings(max_examples=60, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    bqc=st.sampled_from([8, 16, 32]),
    bkc=st.sampled_from([8, 128, 256]),
    t0=st.integers(-40, 80),
    u0=st.integers(-40, 80),
    seq=st.tuples(
        st.integers(-20, 60),
        st.integers(0, 60),
        st.integers(-20, 60),
        st.integers(0, 60),
        st.integers(-30, 30),
    ),
    band=st.sampled_from([(None, 0), (None, None), (-20, 0), (-9, 4), (3, None)]),
)
def test_tile_masks_are_the_mask_rule(groups, bqc, bkc, t0, u0, seq, band):
    """The interval masks of a q-major tile (forward, dq) and of a kv-major tile (dk/dv), built
    for the whole tile of `groups` stacked heads (rows of a q-major tile, columns of a kv-major
    one) or for one head (`tiling.mask_per_head`), applied to scores by `_masked_scores` (the
    forward) and to probabilities by `_masked_probabilities` (the backward), equal the rule:
    t in [q_lo, q_hi), u in [k_lo, k_hi), lo <= u - t + off <= hi; a masked score is exactly
    NEG_INF (one head's mask is added as a bias, which absorbs the score), a masked probability
    exactly 0."""
    q_lo, q_len, k_lo, k_len, off = seq
    seq = (q_lo, q_lo + q_len, k_lo, k_lo + k_len, off)
    big = K._UNBOUNDED
    b = K.Band(-big if band[0] is None else band[0], big if band[1] is None else band[1])
    t = np.tile(np.arange(bqc), groups)[:, None] + t0  # [G*bqc, 1]
    u = np.arange(bkc)[None, :] + u0
    d = u - t + off
    want = (t >= seq[0]) & (t < seq[1]) & (u >= seq[2]) & (u < seq[3]) & (d >= b.lo) & (d <= b.hi)
    # Distinct values per head, so a head given another head's rows or columns shows.
    tile = jnp.arange(1, groups * bqc * bkc + 1, dtype=jnp.float32).reshape(groups * bqc, bkc)
    for heads in sorted({1, groups}):
        q_mask = K._tile_mask(heads, bqc, bkc, t0, u0, seq, b)
        kv_mask = K._tile_mask_t(heads, bqc, bkc, t0, u0, seq, b)
        assert q_mask.shape == (heads * bqc, bkc) and kv_mask.shape == (bkc, heads * bqc)
        q_major = K._masked_scores(q_mask, tile)
        np.testing.assert_array_equal(np.asarray(q_major), np.where(want, tile, K.NEG_INF))
        # The backward's form, through a stand-in for the exp that keeps distinct values.
        probs = functools.partial(jnp.maximum, 0.0)
        for scores_first in (False, True):
            q_major = K._masked_probabilities(q_mask, tile, probs, 0, scores_first)
            kv_major = K._masked_probabilities(kv_mask, tile.T, probs, 1, scores_first)
            np.testing.assert_array_equal(np.asarray(q_major), np.where(want, tile, 0.0))
            np.testing.assert_array_equal(np.asarray(kv_major), np.where(want, tile, 0.0).T)


def _dense_tile_masks_check(groups, bqc, bkc, t0, u0, lengths, padded, off, band):
    """`_tile_mask` / `_tile_mask_t` of a dense call (SeqEdges from its real and padded
    lengths) against the rule, on one tile inside the padded lengths."""
    (sq, sk), (sq_p, sk_p) = lengths, padded
    edges = K.SeqEdges(False, sq < sq_p, False, sk < sk_p)
    seq = (0, sq, 0, sk, off)
    t = np.tile(np.arange(bqc), groups)[:, None] + t0
    u = np.arange(bkc)[None, :] + u0
    d = u - t + off
    want = (t < sq) & (u < sk) & (d >= band.lo) & (d <= band.hi)
    q_mask = K._tile_mask(groups, bqc, bkc, t0, u0, seq, band, edges=edges)
    kv_mask = K._tile_mask_t(groups, bqc, bkc, t0, u0, seq, band, edges=edges)
    if q_mask is None:  # nothing to mask: every score is seen
        assert kv_mask is None and want.all()
        return
    np.testing.assert_array_equal(np.asarray(q_mask), want)
    np.testing.assert_array_equal(np.asarray(kv_mask), want.T)


@settings(max_examples=80, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    bqc=st.sampled_from([8, 16]),
    bkc=st.sampled_from([8, 16, 128]),
    t0=st.integers(0, 10).map(lambda i: 8 * i),
    u0=st.integers(0, 10).map(lambda i: 8 * i),
    lengths=st.tuples(st.integers(0, 300), st.integers(0, 300)),
    pad=st.tuples(st.booleans(), st.booleans()),
    off=st.integers(-30, 30),
    band=st.sampled_from([(None, 0), (-20, 0), (-9, 4), (-40, 40), (3, None), (None, None)]),
)
def test_dense_tile_masks_leave_out_the_sequence_ends_no_block_holds(
    groups, bqc, bkc, t0, u0, lengths, pad, off, band
):
    """A dense call's sequences start at token 0 and end at their padded length unless padding
    follows them (`SeqEdges`): its masks leave those compares out, and with a band too wide for
    one tile to meet both of its edges (`tiling.one_edge_tiles`: bands (-20, 0), (-40, 40)
    against 8- and 16-wide tiles) compare each score against one side. Every form equals the
    rule."""
    big = K._UNBOUNDED
    b = K.Band(-big if band[0] is None else band[0], big if band[1] is None else band[1])
    # An unpadded sequence ends at its padded length, past every tile here.
    padded = tuple(n if p else 10_000 for n, p in zip(lengths, pad))
    lengths = tuple(n if p else 10_000 for n, p in zip(lengths, pad))
    padded = tuple(p + 1 if q else p for p, q in zip(padded, pad))  # padding follows
    _dense_tile_masks_check(groups, bqc, bkc, t0, u0, lengths, padded, off, b)


def test_one_compare_masks_take_either_edge_of_a_window():
    """Every tile of a 16 x 16 sweep along a window band of 41 keys: the one-compare form
    (`_in_bounds` with `lo_last`) meets tiles the lower edge cuts, tiles the upper edge cuts and
    tiles inside the band, and equals the rule on each."""
    b = K.Band(-40, 0)
    assert T.one_edge_tiles(b, 16, 16, sequence_ends=False)
    assert not T.one_edge_tiles(b, 16, 128, sequence_ends=False)
    assert not T.one_edge_tiles(b, 16, 16, sequence_ends=True)
    # the cost model charges the second compare where the kernel makes it
    assert not T.compares_both_edges(b, 16, 16, False) and T.compares_both_edges(b, 16, 16, True)
    assert not T.compares_both_edges(K.Band.make(True, -1, -1), 16, 128, True)  # causal
    for t0 in range(0, 96, 16):
        for u0 in range(0, 112, 8):
            _dense_tile_masks_check(2, 16, 16, t0, u0, (10_000,) * 2, (10_000,) * 2, 0, b)


@pytest.mark.parametrize("kv_major", [False, True])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (20, -1)), (False, (9, 4))]
)
def test_work_list_is_exactly_the_nonempty_pairs(kv_major, causal, window):
    band = K.Band.make(causal, *window)
    cq = np.array([0, 13, 13, 70, 96], np.int32)
    ck = np.array([0, 20, 25, 80, 100], np.int32)
    seqs = (cq[:-1], cq[1:], ck[:-1], ck[1:], cq[1:] - ck[1:])
    bq, bk = 16, 32
    nq, nk = 7, 4
    want = _brute_pairs(seqs, nq, nk, bq, bk, band)
    static = K.build_work_list(seqs, nq, nk, bq, bk, band, kv_major=kv_major)
    dynamic = np.asarray(
        K.build_work_list(
            tuple(jnp.asarray(a) for a in seqs),
            nq,
            nk,
            bq,
            bk,
            band,
            kv_major=kv_major,
            max_items=K.max_work_items(4, nq, nk),
        )
    )
    for it in (static, dynamic):
        qi, ki, si, fl = it
        valid = (fl & K.COMPUTE) != 0
        got = {(int(a), int(b), int(c)) for a, b, c in zip(qi[valid], ki[valid], si[valid])}
        assert got == want
        assert valid.sum() == len(want)  # each non-empty pair exactly once
        outer = ki if kv_major else qi
        live = (fl & K.VALID) != 0
        assert np.all(live == (fl != 0))  # every listed item, dummies included, is VALID
        # every outer block is opened and closed exactly once (dummy items for untouched ones)
        n_outer = nk if kv_major else nq
        assert sorted(outer[(fl & K.FIRST) != 0].tolist()) == list(range(n_outer))
        assert sorted(outer[(fl & K.LAST) != 0].tolist()) == list(range(n_outer))
        assert np.all(np.diff(outer[live]) >= 0)  # outer blocks are contiguous runs
    # the static list is the dynamic one without its padding tail
    n = static.shape[1]
    np.testing.assert_array_equal(dynamic[:, :n], static)
    assert np.all(dynamic[3, n:] == 0) and np.all(dynamic[:3, n:] == static[:3, -1:])


@pytest.mark.parametrize("kv_major", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids_drop_pairs_per_batch_row(kv_major, causal):
    """With segment ids every batch row gets its own list: it keeps every pair that holds an
    allowed same-segment (query, key) pair, and drops every pair whose id ranges are disjoint."""
    band = K.Band.make(causal, -1, -1)
    S, bq, bk = 96, 16, 32
    seqs = tuple(np.array([v], np.int32) for v in (0, S, 0, S, 0))
    rows = [
        np.repeat([0, 1, 2, 3], [20, 30, 6, 40]),  # packed documents
        np.zeros(S, np.int64),  # one document: nothing to drop beyond the band
        np.repeat([5, 7], [50, 46]),
    ]
    band_list = K.build_work_list(seqs, S // bq, S // bk, bq, bk, band, kv_major=kv_major)
    n_band = int(((band_list[3] & K.COMPUTE) != 0).sum())
    for ids in rows:
        qb, kb = ids.reshape(-1, bq), ids.reshape(-1, bk)
        ranges = (qb.min(1), qb.max(1), kb.min(1), kb.max(1))
        it = K.build_work_list(
            seqs, S // bq, S // bk, bq, bk, band, kv_major=kv_major, segment_ranges=ranges
        )
        valid = (it[3] & K.COMPUTE) != 0
        got = {(int(a), int(b)) for a, b in zip(it[0][valid], it[1][valid])}
        assert len(got) == int(valid.sum())
        need = {
            (t // bq, u // bk)
            for t in range(S)
            for u in range(S)
            if ids[t] == ids[u] and (u <= t or not causal)
        }
        assert need <= got
        for qi, ki in got:
            assert qb[qi].min() <= kb[ki].max() and kb[ki].min() <= qb[qi].max()
        if len(set(ids)) > 1:
            assert len(got) < n_band  # documents that do not meet cost no step
        else:
            assert len(got) == n_band
        outer = it[1] if kv_major else it[0]
        n_outer = S // (bk if kv_major else bq)
        assert sorted(outer[(it[3] & K.FIRST) != 0].tolist()) == list(range(n_outer))


def test_cost_model_no_steps_on_empty_pairs_and_window_savings():
    shape = dict(
        batch=1,
        num_q_heads=32,
        num_kv_heads=8,
        q_len=8192,
        kv_len=8192,
        head_dim=128,
        dtype=jnp.bfloat16,
    )
    tiles = T.Tiles(256, 512, 256, 256, 512)
    full = T.estimate_cost(causal=False, tiles=tiles, **shape)
    causal = T.estimate_cost(causal=True, tiles=tiles, **shape)
    nq, nk = 8192 // 256, 8192 // 512
    assert full.grid_steps == 8 * nq * nk
    # causal: a q block i sees kv blocks 0 .. (i*256+255)//512
    assert causal.grid_steps == 8 * sum((i * 256 + 255) // 512 + 1 for i in range(nq))
    assert causal.useful_flops == 4 * 32 * 128 * (8192 * 8193 // 2)
    assert causal.mxu_flops >= causal.useful_flops
    win = T.estimate_cost(causal=True, window_size=(1023, -1), tiles=tiles, **shape)
    assert win.grid_steps < causal.grid_steps and win.hbm_bytes < causal.hbm_bytes
    for c in (full, causal, win):
        assert c.hbm_bytes >= c.min_hbm_bytes
    bwd = T.estimate_cost(causal=True, tiles=tiles, pass_="bwd", **shape)
    assert bwd.useful_flops == 2 * causal.useful_flops


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_default_tiles_near_minimum_bytes_and_window_work_cut(gen):
    """At Llama-3-8B 8192 with the tiles choose_tiles picks: full causal moves at most 1.3x the
    minimum bytes, a 1024 window at most 1.02x, and the window cuts MXU work and modelled time
    at least 2.8x (benchmarks/window_cut.py prints the whole comparison)."""
    shape = dict(
        batch=1,
        num_q_heads=32,
        num_kv_heads=8,
        q_len=8192,
        kv_len=8192,
        head_dim=128,
        dtype=jnp.bfloat16,
        causal=True,
        generation=gen,
    )
    g = T.GENERATIONS[gen]
    full = T.estimate_cost(window_size=(-1, -1), **shape)
    win = T.estimate_cost(window_size=(1023, 0), **shape)
    assert full.hbm_bytes <= 1.3 * full.min_hbm_bytes
    assert win.hbm_bytes <= 1.02 * win.min_hbm_bytes
    assert win.grid_steps < full.grid_steps
    assert full.mxu_flops >= 2.8 * win.mxu_flops
    assert full.modelled_seconds(g) >= 2.8 * win.modelled_seconds(g)


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_choose_tiles_fits_vmem(gen):
    g = T.GENERATIONS[gen]
    for d, (hq, hkv) in ((128, (32, 8)), (256, (8, 4)), (64, (16, 1))):
        t = T.choose_tiles(
            q_len=8192,
            kv_len=8192,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype=jnp.bfloat16,
            causal=True,
            generation=gen,
        )
        assert t.block_q >= 128 and t.block_kv >= 128 and t.block_q_bwd >= 128
        assert t.vmem_limit_bytes <= g.vmem_bytes * 3 // 4
        assert (
            T.vmem_need_fwd(
                hq // hkv,
                d,
                2,
                t.block_q,
                t.block_kv,
                t.block_kv_compute,
                block_q_compute=t.q_compute,
            )
            <= t.vmem_limit_bytes
        )
    override = T.Tiles(128, 128, 128, 128, 128)
    assert (
        T.choose_tiles(
            q_len=1,
            kv_len=1,
            num_q_heads=1,
            num_kv_heads=1,
            head_dim=64,
            dtype=jnp.float32,
            override=override,
        )
        is override
    )
    with pytest.raises(ValueError, match="block_q must be a positive multiple of 8"):
        T.Tiles(block_q=100)
    with pytest.raises(ValueError, match="block_q of 96 is its own compute tile"):
        T.Tiles(block_q=96)
    with pytest.raises(ValueError, match="block_q_compute must be a power of two"):
        T.Tiles(block_q=96, block_q_compute=48)
    with pytest.raises(ValueError, match="multiple of block_q_compute"):
        T.Tiles(block_q=96, block_q_compute=64)
    t = T.Tiles(96, 96, 32, 64, 32, block_q_compute=32)  # blocks of whole compute tiles
    assert (t.q_multiple, t.kv_multiple) == (192, 96)  # every pass's block divides the padding


# Blocks of three compute tiles (not powers of two), and backward blocks of other sizes: the
# padded lengths are multiples of both passes' blocks (lcm), the walks take three-tile blocks.
THREE = T.Tiles(
    block_q=48,
    block_kv=48,
    block_kv_compute=16,
    block_q_bwd=48,
    block_kv_bwd=48,
    block_q_compute=16,
    block_q_compute_bwd=16,
    block_kv_compute_bwd=16,
)


@pytest.mark.parametrize(
    "Sq, Sk, causal, window, tiles",
    [
        (96, 96, False, (-1, -1), THREE),
        (100, 70, True, (-1, -1), dataclasses.replace(THREE, fused_bwd=True)),
        (96, 96, True, (20, 3), THREE),
        (130, 130, True, (-1, -1), dataclasses.replace(THREE, block_q_bwd=32, block_kv_bwd=32)),
    ],
)
def test_blocks_that_are_not_powers_of_two(Sq, Sk, causal, window, tiles):
    """A DMA block of three compute tiles (1536 tokens at Flux-dev's 4608, where power-of-two
    blocks pad the inputs by an XLA copy): forward, both backwards and the lse exact against
    the f32 reference, padding included (100 and 70 tokens; 130 padded to lcm(48, 32) = 96)."""
    _check_dense(
        *_dense_case(1, 4, 2, Sq, Sk, 64, jnp.float32, causal, window, 0.0, True, False),
        tiles=tiles,
    )


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_choose_tiles_fits_blocks_to_lengths_no_power_of_two_divides(gen):
    """At 4608 tokens (Flux-dev) every power-of-two block of 1024 or more pads q, k and v to
    6144 by an XLA copy; the tiles picked divide 4608 in both passes, so nothing is padded,
    with no more grid steps than the 2048 blocks; a power-of-two length keeps power-of-two
    blocks."""
    assert T.fitted_blocks(4608, 512) == [1536]
    assert T.fitted_blocks(4608, 256, T.FITTED_MAX_KV) == [4608, 2304, 1536, 768]
    assert T.fitted_blocks(8192, 512, T.FITTED_MAX_KV) == []  # powers of two already fit
    kw = dict(num_q_heads=24, num_kv_heads=24, head_dim=128, dtype=jnp.bfloat16, generation=gen)
    t = T.choose_tiles(q_len=4608, kv_len=4608, causal=False, **kw)
    assert 4608 % t.q_multiple == 0 and 4608 % t.kv_multiple == 0, t
    assert T.pad_copy_rows(4608, t.q_multiple) == 0
    assert T.pad_copy_rows(4608, 2048) == 4608 + 6144
    assert -(-4608 // t.block_q) * -(-4608 // t.block_kv) <= 9
    t = T.choose_tiles(q_len=8192, kv_len=8192, causal=True, **kw)
    for b in (t.block_q, t.block_kv, t.block_q_bwd, t.block_kv_bwd):
        assert b & (b - 1) == 0, t


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_choose_tiles_takes_long_kv_blocks_only_where_the_band_covers_every_key(gen):
    """Full (not causal, unwindowed) attention over long sequences gets LONG_KV_BLOCK-key
    forward blocks (Wan-like 32768 tokens on a TPU v5e chip: 6% faster than 2048 x 2048) except
    on v6e, whose taller interior tiles fit VMEM beside 2048-key blocks only (scheduled 19,952
    against 20,952 us); a causal band or a window at the same length keeps kv blocks of at most
    2048 keys (4096 gained nothing or lost there), and the backward keeps its own
    candidates."""
    kw = dict(num_q_heads=12, num_kv_heads=12, head_dim=128, dtype=jnp.bfloat16, generation=gen)
    t = T.choose_tiles(q_len=32768, kv_len=32768, causal=False, **kw)
    if gen == "v6e":
        assert t.block_kv == 2048 and t.block_kv_bwd <= 2048, t
        assert T.interior_q_compute(gen, t, 1, 128, 2, False) > t.q_compute
        long = dataclasses.replace(t, block_kv=T.LONG_KV_BLOCK, vmem_limit_bytes=None)
        long = T.with_vmem_limits(long, 1, 128, jnp.bfloat16, gen, False, 32768)
        assert T.interior_q_compute(gen, long, 1, 128, 2, False) == long.q_compute
    else:
        assert t.block_kv == T.LONG_KV_BLOCK and t.block_kv_bwd <= 2048, t
    for band in (dict(causal=True), dict(causal=False, window_size=(1023, 1023))):
        t = T.choose_tiles(q_len=32768, kv_len=32768, **band, **kw)
        assert t.block_kv <= 2048 and t.block_kv_bwd <= 2048, (band, t)
    # no candidate stacks more than MAX_ROWS query rows over a long kv block
    for c in T._candidates(32768, 32768, 4, T.get_generation(gen), long_kv=True):
        assert c[2] <= 2048 or 4 * c[0] <= T.MAX_ROWS, c


def test_v5e_backward_takes_its_widest_tiles_unless_a_band_masks_them():
    """v5e's backward also tries 512-key compute tiles (kv_compute_tiles) and, among the
    candidates its model cannot tell apart, takes the widest (WIDEST_BWD_TILE_GENERATIONS:
    512 x 512 ran 0-17% faster on the chip, results/device/v5e_flash_bwd_tile_sweep*.json);
    a window of 1024 keys keeps 256 x 256 (13% slower at 256 x 512: outside the tolerance),
    and so do packed documents (segment ids: the ranking does not see the documents). The
    forward keeps 256 keys, and v6e / TPU7x their one kv tile of two MXU widths and the model's
    order (not in WIDEST_BWD_TILE_GENERATIONS)."""
    v5e = T.get_generation("v5e")
    assert T.kv_compute_tiles(v5e, backward=True) == (256, 512)
    assert T.kv_compute_tiles(v5e, backward=False) == (256,)
    for gen in ("v6e", "tpu7x"):
        g = T.get_generation(gen)
        assert T.kv_compute_tiles(g, True) == T.kv_compute_tiles(g, False) == (2 * g.mxu_size,)
    assert T.WIDEST_BWD_TILE_GENERATIONS == ("v5e",)
    # at equal MXU work the model sees one tile's fixed bundles between the two widths
    fixed = T._generations.tile_bundle_model(v5e).tile_fixed_bundles
    narrow = T.bwd_tile_bundles(v5e, 512, 256, 128, "fused", masked=False)
    wide = T.bwd_tile_bundles(v5e, 512, 512, 128, "fused", masked=False)
    assert fixed > 0 and wide == pytest.approx(2 * narrow - fixed)

    def bwd_tiles(**kw):
        t = T.choose_tiles(head_dim=128, dtype=jnp.bfloat16, generation="v5e", **kw)
        assert t.block_kv_compute == 256, t  # the forward's
        return t.q_compute_bwd, t.kv_compute_bwd

    for seq, heads in ((4608, 24), (32768, 12)):  # Flux-dev, Wan-like: G = 1, full attention
        assert bwd_tiles(q_len=seq, kv_len=seq, num_q_heads=heads, num_kv_heads=heads) == (
            512,
            512,
        )
    llama = dict(q_len=8192, kv_len=8192, num_q_heads=32, num_kv_heads=8, causal=True)
    assert bwd_tiles(**llama) == (512, 512)
    assert bwd_tiles(**llama, window_size=(1023, 0)) == (256, 256)
    assert bwd_tiles(**llama, segments=True) == (256, 256)


# Eight kv compute slices a kv block, so the forward's walk cuts a q tile's range into groups of
# four and one tail group of its exact length (kernel._groups): tails of 1, 2, 3 and 5 tiles
# (4 + 1), full groups mask-free or masked.
EIGHT_SLICES = T.Tiles(
    block_q=64,
    block_kv=128,
    block_kv_compute=16,
    block_q_bwd=32,
    block_kv_bwd=32,
    block_q_compute=16,
)


def _walk_range_lengths(sq, sk, band, tiles):
    """The kv slice counts (end - first) of every q tile the forward walks (items not taken by
    the interior path), at one dense sequence of sq queries and sk keys padded to the tiles."""
    bq, bk, bqc, bkc = tiles.block_q, tiles.block_kv, tiles.q_compute, tiles.block_kv_compute
    sq_pad, sk_pad = K._round_up(sq, tiles.q_multiple), K._round_up(sk, tiles.kv_multiple)
    off = sq - sk
    lengths = set()
    for qi in range(sq_pad // bq):
        for ki in range(sk_pad // bk):
            _, in_first, in_end, _ = K._inner_ranges(
                qi * bq, bq, (0, sq), (0, sk), off, band, ki * bk, bk, bkc
            )
            if int(in_first) == 0 and int(in_end) == bk // bkc:
                continue  # the interior path
            for j in range(bq // bqc):
                first, _, _, end = K._inner_ranges(
                    qi * bq + j * bqc, bqc, (0, sq), (0, sk), off, band, ki * bk, bk, bkc
                )
                lengths.add(int(end) - int(first))
    return lengths - {0}


@pytest.mark.parametrize("unroll, n_inner", [(1, 1), (1, 4), (2, 2), (2, 3), (4, 4), (4, 8)])
def test_walk_groups_cover_a_range_once(unroll, n_inner):
    """kernel._groups: every range of 0..n_inner tiles is n_full groups of `unroll` and one
    tail whose length has a copy in the program (`_tail_sizes`, none longer than the block);
    a tail of one joins the last full group where the block has room for unroll + 1."""
    sizes = K._tail_sizes(unroll, n_inner)
    assert all(s <= n_inner for s in sizes) and len(set(sizes)) == len(sizes)
    for n in range(n_inner + 1):
        n_full, tail = (int(x) for x in K._groups(jnp.int32(n), unroll, n_inner))
        assert n_full >= 0 and n_full * unroll + tail == n, (n, n_full, tail)
        assert tail == 0 or tail in sizes, (n, tail, sizes)
        if unroll > 1 and n > unroll:
            assert tail != 1, (n, n_full, tail)  # no lone tile after a full group


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "causal, window, lengths",
    [
        (True, (-1, -1), {1, 2, 3, 4, 5, 6, 7, 8}),
        (True, (60, -1), {1, 2, 3, 4, 5}),
        (False, (30, 50), {1, 2, 3, 4, 5, 6, 7}),
    ],
)
def test_walk_groups_every_range_length(causal, window, lengths):
    """The forward's edge walk at eight kv slices a block against the f32 reference: every
    range length 1-8 (tails alone, full groups, a full group and a tail), windows masked at
    both ends of a range. The lengths the band gives are checked first, so a band that stopped
    reaching a group would fail."""
    band = K.Band.make(causal, *window)
    assert _walk_range_lengths(200, 200, band, EIGHT_SLICES) == lengths
    _check_dense(
        *_dense_case(1, 4, 2, 200, 200, 64, jnp.float32, causal, window, 0.0, True, False),
        tiles=EIGHT_SLICES,
        grads=False,
    )


def _program(
    gen, q_heads, kv_heads, seq, head_dim, window, softcap, unroll=None, causal=True, sinks=False
):
    """(walk unroll, estimated program bundles, overlay, the tiles) of the forward at the
    kernel's own tiles: _walk_unroll's choice, or `unroll`."""
    t = T.choose_tiles(
        q_len=seq,
        kv_len=seq,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=jnp.bfloat16,
        causal=causal,
        window_size=(window - 1, 0) if window else (-1, -1),
        generation=gen,
    )
    G = q_heads // kv_heads
    iq = T.interior_q_compute(gen, t, G, head_dim, 2, False)
    band = K.Band.make(causal, window - 1 if window else -1, 0 if window else -1)
    prob = K._Problem(1, kv_heads, G, seq, seq, head_dim, band, 1.0, softcap, 1, None)
    unroll = unroll or K._walk_unroll(gen, t, prob, iq, sinks)
    vregs = K._forward_score_vregs(t, G, iq, unroll)
    return (unroll, *T.forward_program_bundles(gen, vregs, head_dim, softcap, sinks), t)


# Deviceless dumps (libtpu 0.0.42, llo_schedule.py): (generation, q heads, kv heads, tokens, head
# dim, window, soft cap, walk unroll, sinks) -> the forward's bundles, and whether one overlay held
# it. The soft-capped ones with sinks are the running max's programs (dumped before the fixed
# max, without sinks, which add a few bundles of init); without, the fixed max's (2026-12-08,
# `llo_schedule.py` on schedule_targets.compile_flash_forward with the walk's unroll forced).
PROGRAM_DUMPS = [
    (("v5e", 32, 8, 8192, 128, 1024, 0.0, 4, False), 45_867, True),
    (("v5e", 32, 8, 8192, 128, 1024, 30.0, 4, True), 46_944, True),
    (("v5e", 16, 8, 8192, 256, 4096, 50.0, 4, True), 41_087, True),
    (("v5e", 32, 8, 8192, 128, 1024, 30.0, 4, False), 43_813, True),
    (("v5e", 16, 8, 8192, 256, 4096, 50.0, 4, False), 38_356, True),
    (("v5e", 32, 1, 4096, 128, 0, 0.0, 1, False), 55_688, True),
    (("v6e", 32, 8, 8192, 128, 1024, 0.0, 4, False), 57_421, True),
    (("v6e", 32, 8, 8192, 128, 1024, 30.0, 4, True), 66_828, False),
    (("v6e", 16, 8, 8192, 256, 4096, 50.0, 4, True), 36_049, True),
    (("v6e", 32, 8, 8192, 128, 1024, 30.0, 4, False), 63_467, True),
    (("v6e", 16, 8, 8192, 256, 4096, 50.0, 4, False), 32_663, True),
    (("tpu7x", 32, 8, 8192, 128, 1024, 0.0, 4, False), 29_446, True),
    (("tpu7x", 32, 8, 8192, 128, 1024, 30.0, 4, True), 34_887, True),
    (("tpu7x", 16, 8, 8192, 256, 4096, 50.0, 4, True), 37_381, True),
    (("tpu7x", 48, 8, 8192, 128, 0, 30.0, 4, True), 50_066, True),
    (("tpu7x", 32, 8, 8192, 128, 1024, 30.0, 4, False), 26_573, True),
    (("tpu7x", 16, 8, 8192, 256, 4096, 50.0, 4, False), 26_377, True),
    (("tpu7x", 48, 8, 8192, 128, 0, 30.0, 4, False), 37_619, True),
]


def test_forward_program_estimate_matches_the_dumps_and_bounds_the_walk():
    """tiling.forward_program_bundles against the dumped programs (within 6%; v6e's and TPU7x's
    fitted points within 0.1%, v5e's within 3.6%), a program libtpu cut into overlays over its
    generation's bound; the walk's unroll halves exactly where the estimate leaves the overlay
    (v6e's soft-capped Llama-3-8B with sinks, v5e's 32-head MQA) and nowhere else: not on
    TPU7x's soft-capped 48 / 8 heads (50,066 bundles in one overlay at four), not on v6e's
    soft-capped Llama-3-8B without sinks (the fixed max: 63,467), nor on a named row."""
    for (gen, hq, hkv, seq, d, window, softcap, unroll, sinks), bundles, fits in PROGRAM_DUMPS:
        _, est, overlay, _ = _program(gen, hq, hkv, seq, d, window, softcap, unroll, sinks=sinks)
        assert est == pytest.approx(bundles, rel=0.06), (gen, hq, hkv, d, softcap, sinks)
        assert (bundles <= overlay) == fits, (gen, hq, hkv, d, softcap, bundles, overlay)
    llama_capped = ("v6e", 32, 8, 8192, 128, 1024, 30.0)
    assert _program(*llama_capped, sinks=True)[0] == 2
    assert _program(*llama_capped)[0] == 4  # the fixed max's walk of 4 fits (63,467)
    assert _program("v5e", 32, 1, 4096, 128, 0, 0.0)[0] == 1
    assert _program("tpu7x", 48, 8, 8192, 128, 0, 30.0, sinks=True)[0] == 4
    import shapes

    for s in shapes.NAMED["flash_attention"]:
        if s.documents:
            continue  # segment ids: a walk of one tile at a time
        for gen in ("v5e", "v6e", "tpu7x"):
            args = (s.q_heads, s.kv_heads, s.seq, s.head_dim, s.window, s.softcap or 0.0)
            unroll, _, _, t = _program(gen, *args, causal=s.causal)
            assert unroll == K._fwd_unroll(t.block_kv // t.block_kv_compute), (s.name, gen)


# q blocks of whole FINISH_ROWS chunks: the write-out's chunk loop (three chunks, not unrolled)
# and its unrolled form (eight chunks, one loop iteration), with query rows that see no key
# (causal, bottom-right: the first Sq - Sk rows) in the first chunks.
WRITE_OUT = {
    "three_chunks": T.Tiles(384, 128, 128, 128, 128, block_q_compute=128),
    "eight_chunks": T.Tiles(1024, 128, 128, 128, 128, block_q_compute=128),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(WRITE_OUT))
def test_write_out_in_row_chunks_matches_the_reference(name):
    """o and lse of q blocks written FINISH_ROWS rows of a head at a time (kernel
    _normalise_and_store): every chunk's rows in place for each of the G stacked heads, f32 at
    the f32 tolerance (the Newton reciprocal included), unseen rows 0 with the sentinel lse."""
    tiles = WRITE_OUT[name]
    n_chunks = tiles.block_q // K.FINISH_ROWS
    assert n_chunks == (3 if name == "three_chunks" else K.FINISH_UNROLL)
    sq = tiles.block_q
    q, k, v, s, qseg, kseg, cfg = _dense_case(
        1, 4, 2, sq, sq - 200, 64, jnp.float32, True, (-1, -1), 0.0, False, False
    )
    o, lse = _check_dense(q, k, v, s, qseg, kseg, cfg, tiles=tiles, grads=False)
    assert np.all(np.asarray(o)[:, :, :200] == 0)  # rows that see no key
    assert np.all(np.asarray(lse)[:, :, :200] == K.BIG_LSE)
    assert np.all(np.asarray(lse)[:, :, 200:] < 100.0)


def test_newton_reciprocal_is_within_two_ulps_in_interpret_mode():
    """benchmarks/reciprocal_probe.py's interpret-mode run: the Newton steps' own rounding only
    (the chip's figure is in results/device/v5e_reciprocal_probe.json)."""
    import reciprocal_probe

    got = reciprocal_probe.probe(interpret=True)
    assert got["newton_reciprocal"]["max_ulps"] <= 2
    assert got["division"]["max_ulps"] == 0


# -------------------------------------------------------------------------------------------------
# TPU interpret mode: DMAs, semaphores and VMEM simulated; races, NaN memory and OOB reads raise
# -------------------------------------------------------------------------------------------------


def _tpu_params():
    from jax_bridge import tpu_interpret_params

    return tpu_interpret_params()


TINY = T.Tiles(
    block_q=32,
    block_kv=32,
    block_kv_compute=16,
    block_q_bwd=32,
    block_kv_bwd=32,
    block_q_compute=16,
    block_q_compute_bwd=16,
    block_kv_compute_bwd=16,
)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [False, True])
def test_tpu_interpret_dense_causal_gqa_window_sinks(fused):
    with tpu_interpreter.race_checked():
        tiles = dataclasses.replace(TINY, fused_bwd=fused)
        _check_dense(
            *_dense_case(1, 4, 2, 40, 40, 64, jnp.float32, True, (20, -1), 0.0, True, False),
            tiles=tiles,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_one_compare_masks():
    """An unpadded dense call with a window wider than a compute tile's diagonal: every masked
    tile (forward, dq, dk/dv) compares its scores against one edge of the band."""
    assert T.one_edge_tiles(K.Band(-40, 0), 16, 16, sequence_ends=False)
    with tpu_interpreter.race_checked():
        _check_dense(
            *_dense_case(1, 4, 2, 64, 64, 64, jnp.float32, True, (40, -1), 0.0, False, False),
            tiles=TINY,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_softcap_fixed_max():
    """A soft cap of 50 (the fixed max) in TPU interpret mode: scores at both ends of the cap,
    rows that see no key, masked tiles; race-free, and no NaN from the scratch's NaN fill (m is
    never loaded there, only written at a q block's first item)."""
    cfg = dict(causal=True, window_size=(20, -1), softcap=50.0)
    with tpu_interpreter.race_checked():
        _check_dense(
            *_saturated_case(48, 32, 50.0),
            None,
            None,
            None,
            cfg,
            tiles=TINY,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fused", [False, True])
def test_tpu_interpret_whole_tile_masks(fused):
    """One q head per KV head (G = 1) in TPU interpret mode on v6e: the forward selects its
    whole-tile masks and the backward masks the scores before the exp
    (tiling.mask_scores_before_exp), both passes and the fused one, race-free and NaN-safe."""
    assert T.mask_scores_before_exp("v6e")
    with tpu_interpreter.race_checked():
        _check_dense(
            *_dense_case(1, 2, 2, 40, 40, 64, jnp.float32, True, (20, -1), 0.0, True, False),
            tiles=dataclasses.replace(TINY, fused_bwd=fused),
            interpret=_tpu_params(),
            generation="v6e",
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_write_out_in_row_chunks():
    """Two FINISH_ROWS chunks per q block in TPU interpret mode: race-free, no NaN from the
    scratch's NaN fill, rows that see no key written as 0."""
    tiles = T.Tiles(256, 128, 128, 128, 128, block_q_compute=128)
    with tpu_interpreter.race_checked():
        _check_dense(
            *_dense_case(1, 2, 1, 256, 100, 64, jnp.float32, True, (-1, -1), 0.0, False, False),
            tiles=tiles,
            grads=False,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_walk_tail_groups():
    """The edge walk at eight kv slices a block (EIGHT_SLICES) in TPU interpret mode, causal:
    the diagonal items' q tiles see 1-8 slices (test_walk_groups_every_range_length checks it),
    so every tail group and both full-group bodies run, race-free and NaN-safe."""
    with tpu_interpreter.race_checked():
        _check_dense(
            *_dense_case(1, 4, 2, 200, 200, 64, jnp.float32, True, (-1, -1), 0.0, False, False),
            tiles=EIGHT_SLICES,
            grads=False,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_blocks_that_are_not_powers_of_two():
    """Three-tile blocks (fitted_blocks) race-free and NaN-safe in TPU interpret mode, the
    fused backward included, with the lengths padded to them."""
    with tpu_interpreter.race_checked():
        _check_dense(
            *_dense_case(1, 2, 1, 90, 90, 64, jnp.float32, True, (-1, -1), 0.0, False, False),
            tiles=dataclasses.replace(THREE, fused_bwd=True),
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_tpu_interpret_varlen_bf16_softcap():
    with tpu_interpreter.race_checked():
        _check_varlen(
            [9, 0, 23],
            [9, 4, 30],
            2,
            1,
            64,
            jnp.bfloat16,
            dict(causal=True, softcap=5.0),
            tiles=TINY,
            interpret=_tpu_params(),
        )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case", ["dense_window_sinks", "varlen_causal", "dense_segments", "varlen_causal_fused_bwd"]
)
def test_estimate_cost_bytes_exact_against_interpreter(case):
    """estimate_cost's hbm_bytes equals the bytes the TPU interpreter copies between HBM and the
    kernel's buffers (BlockSpec copies in, output blocks written back), edge blocks padded."""
    tiles = T.Tiles(
        128,
        256,
        128,
        128,
        256,
        fused_bwd=case.endswith("fused_bwd"),
        block_q_compute_bwd=64 if case.endswith("fused_bwd") else None,
    )
    params = _tpu_params()
    if case == "dense_window_sinks":
        B, Hq, Hkv, S, D, dtype = 2, 2, 1, 384, 128, jnp.float32
        q = _rand(0, (B, Hq, S, D), dtype)
        k = _rand(1, (B, Hkv, S, D), dtype)
        cfg = dict(causal=True, window_size=(100, -1))
        kw = dict(sinks=_rand(2, (Hq,)))
        cost_kw = dict(batch=B, q_len=S, kv_len=S, has_sinks=True)
    elif case == "dense_segments":
        # Two rows with different documents: each row's list drops its own empty pairs.
        B, Hq, Hkv, S, D, dtype = 2, 2, 1, 384, 128, jnp.float32
        q = _rand(0, (B, Hq, S, D), dtype)
        k = _rand(1, (B, Hkv, S, D), dtype)
        ids = np.stack([np.repeat([0, 1, 2], [128, 128, 128]), np.repeat([4, 9], [300, 84])])
        tiles = T.Tiles(128, 128, 128, 128, 128)
        cfg = dict(causal=True)
        kw = dict(q_segment_ids=jnp.asarray(ids), kv_segment_ids=jnp.asarray(ids))
        cost_kw = dict(batch=B, q_len=S, kv_len=S, q_segment_ids=ids, kv_segment_ids=ids)
    else:
        B, Hq, Hkv, S, D, dtype = 1, 4, 2, 600, 64, jnp.bfloat16
        cu = [0, 100, 350, 350, 600]
        q = _rand(0, (S, Hq, D), dtype)
        k = _rand(1, (S, Hkv, D), dtype)
        cfg = dict(causal=True)
        kw = dict(cu_seqlens_q=jnp.asarray(cu, jnp.int32), cu_seqlens_k=jnp.asarray(cu, jnp.int32))
        cost_kw = dict(batch=1, q_len=S, kv_len=S, cu_seqlens_q=cu, cu_seqlens_k=cu)
    cost_kw.update(
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        dtype=dtype,
        causal=True,
        window_size=cfg.get("window_size", (-1, -1)),
        tiles=tiles,
        count_scalar_prefetch=False,
    )
    o, lse = jax.jit(functools.partial(K.flash_attention_fwd, tiles=tiles, interpret=True, **cfg))(
        q, k, k, **kw
    )
    if case == "dense_segments":
        # the segment ids do drop pairs: fewer steps and bytes than the band alone
        plain = {k_: v_ for k_, v_ in cost_kw.items() if "segment" not in k_}
        with_ids = T.estimate_cost(pass_="fwd", **cost_kw)
        band_only = T.estimate_cost(pass_="fwd", segments=True, **plain)
        assert with_ids.hbm_bytes < band_only.hbm_bytes
        assert with_ids.useful_flops < band_only.useful_flops
        ref = R.attention(
            q, k, k, q_segment_ids=kw["q_segment_ids"], kv_segment_ids=kw["kv_segment_ids"], **cfg
        )
        _close(o, ref, **_tol(dtype))
    with tpu_interpreter.race_checked():
        with tpu_interpreter.count_traffic(params) as fwd:
            jax.block_until_ready(
                K.flash_attention_fwd(q, k, k, tiles=tiles, interpret=params, **cfg, **kw)
            )
        with tpu_interpreter.count_traffic(params) as bwd:
            jax.block_until_ready(
                K.flash_attention_bwd(
                    q, k, k, o, lse, q, tiles=tiles, interpret=params, **cfg, **kw
                )
            )
    assert fwd.hbm_bytes == T.estimate_cost(pass_="fwd", **cost_kw).hbm_bytes
    assert bwd.hbm_bytes == T.estimate_cost(pass_="bwd", **cost_kw).hbm_bytes


def _pallas_cost_estimates(jaxpr):
    """The cost_estimate of every pallas_call in a (closed) jaxpr, nested calls included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn.params["cost_estimate"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found += _pallas_cost_estimates(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("fused", [False, True])
def test_pallas_calls_carry_estimate_cost(fused):
    """Each pallas_call passes XLA the closed-form cost of tiling.estimate_cost: MXU FLOPs and
    HBM bytes summed over the pass's calls, one exp per score element (+ the forward's rescale)."""
    B, Hq, Hkv, S, D = 1, 4, 2, 256, 128
    tiles = dataclasses.replace(WIDE, fused_bwd=fused, block_kv_bwd=32, block_kv_compute_bwd=16)
    q, k = _rand(0, (B, Hq, S, D)), _rand(1, (B, Hkv, S, D))
    cfg = dict(causal=True, window_size=(100, -1), tiles=tiles, interpret=True)
    kw = dict(
        batch=B,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        q_len=S,
        kv_len=S,
        head_dim=D,
        dtype=jnp.float32,
        causal=True,
        window_size=(100, -1),
        tiles=tiles,
    )
    lse = jnp.zeros((B, Hq, S), jnp.float32)
    for pass_, fn, args in (
        ("fwd", lambda q, k: K.flash_attention_fwd(q, k, k, **cfg), (q, k)),
        (
            "bwd",
            lambda q, k, lse: K.flash_attention_bwd(q, k, k, q, lse, q, **cfg)[:3],
            (q, k, lse),
        ),
    ):
        got = _pallas_cost_estimates(jax.make_jaxpr(fn)(*args).jaxpr)
        want = T.estimate_cost(pass_=pass_, **kw)
        assert len(got) == (1 if pass_ == "fwd" or fused else 2)
        assert sum(c.flops for c in got) == want.mxu_flops
        assert sum(c.bytes_accessed for c in got) == want.hbm_bytes
        assert all(c.transcendentals > 0 for c in got)
        if pass_ == "fwd":
            # one exp per computed score element plus one per row per score tile
            rows_tiles = got[0].flops // (4 * 128 * tiles.block_kv_compute)
            assert got[0].transcendentals == got[0].flops // (4 * 128) + rows_tiles


# -------------------------------------------------------------------------------------------------
# The backward's per-tile bundle model against libtpu's LLO dumps
# -------------------------------------------------------------------------------------------------

CALIBRATION = (
    Path(__file__).resolve().parent.parent
    / "benchmarks"
    / "results"
    / "tile_model_calibration.json"
)


def _bwd_model_bundles(p):
    g = T.GENERATIONS[p["generation"]]
    kw = dict(softcap=p["softcap"], two_edges=p["two_edges"])
    u = T.bwd_tile_units(g, p["rows"], p["cols"], p["head_dim"], p["pass"], **kw)
    model = T.bwd_tile_bundles(
        g, p["rows"], p["cols"], p["head_dim"], p["pass"], masked=p["masked"], **kw
    )
    return u, model


# How far above a dump the model may sit where it charges the MXU floor (role "mxu-floor").
MXU_FLOOR_EXCESS = 0.14


def test_backward_tile_model_matches_the_dumps():
    """bwd_tile_units through the shared bundle model stays within BWD_RANKING_TOLERANCE of the
    bundles per tile of every dumped backward loop (tile_model_calibration.json "bwd_points":
    the dq, dk/dv and fused passes on v5e, v6e and TPU7x, mask-free and masked loops, each with
    the command that dumped it), calibration and held-out points alike."""
    points = json.loads(CALIBRATION.read_text())["bwd_points"]
    assert {p["pass"] for p in points} == set(T.BWD_PASSES)
    assert {p["generation"] for p in points} == {"v5e", "v6e", "tpu7x"}
    assert {p["role"] for p in points} == {"calibration", "held-out", "mxu-floor"}
    assert 0 < T.BWD_RANKING_TOLERANCE <= 0.11  # tiling.py says why not 0.1
    for p in points:
        u, model = _bwd_model_bundles(p)
        # the loop body holds a whole number of this tile's MXU pushes
        assert p["hot_loop_vmatmul"] == p["tiles_per_iteration"] * u["mxu_pushes"], p
        assert p["dump_bundles_per_tile"] == pytest.approx(
            p["hot_loop_bundles"] / p["tiles_per_iteration"], abs=0.1
        )
        assert p["command"]
        # the recorded model figure is what the code computes now (a refit updates both)
        assert model == pytest.approx(p["model_bundles_per_tile"], abs=1.0), p
        err = model / p["dump_bundles_per_tile"] - 1
        if p["role"] == "mxu-floor":
            # v5e's large fused tiles pack their pushes tighter than the model's MXU floor (3.6-3.7
            # bundles a push; the forward's run 4.1-4.2): the model sits at that floor, above the
            # dump by at most 14% (tiling.BWD_RANKING_TOLERANCE says how the ranking copes)
            g = T.GENERATIONS[p["generation"]]
            floor = T._generations.tile_bundles(g, mxu_pushes=u["mxu_pushes"])
            assert p["generation"] == "v5e" and model == pytest.approx(floor), p
            assert 0 < err <= MXU_FLOOR_EXCESS, p
            continue
        assert abs(err) <= T.BWD_RANKING_TOLERANCE, (p["generation"], p["pass"], p["tiles"], err)


def test_backward_cost_counts_tile_units():
    """estimate_cost(pass_="bwd") carries the per-unit counts choose_tiles ranks the backward
    by: the two-pass backward sums both passes' tiles, the fused one has 5 matmuls per tile."""
    kw = dict(
        batch=1,
        num_q_heads=8,
        num_kv_heads=2,
        q_len=2048,
        kv_len=2048,
        head_dim=128,
        dtype=jnp.bfloat16,
        causal=True,
        generation="v6e",
    )
    base = T.Tiles(512, 512, 512, 512, 512, block_q_compute=256, block_q_compute_bwd=256)
    g = T.GENERATIONS["v6e"]
    two = T.estimate_cost(tiles=base, pass_="bwd", **kw)
    fused = T.estimate_cost(tiles=dataclasses.replace(base, fused_bwd=True), pass_="bwd", **kw)
    rows, cols = 4 * 256, 512
    # per pass: live tiles; the two-pass walks each tile twice (dk/dv, then dq)
    assert two.compute_tiles == 2 * fused.compute_tiles > 0
    assert 0 < fused.masked_tiles < fused.compute_tiles
    n = fused.compute_tiles
    dkv, dq, fu = (T.bwd_tile_units(g, rows, cols, 128, p) for p in ("dkv", "dq", "fused"))
    assert fused.mxu_pushes == n * fu["mxu_pushes"]
    assert two.mxu_pushes == n * (dkv["mxu_pushes"] + dq["mxu_pushes"])
    assert fu["mxu_pushes"] == dkv["mxu_pushes"] + dq["mxu_pushes"] // 3
    m = fused.masked_tiles
    assert fused.valu_ops == pytest.approx(n * fu["valu_ops"] + m * fu["masked_valu_ops"], abs=1)
    assert two.eup_pushes == 2 * fused.eup_pushes == 2 * n * rows * cols // 1024
    with pytest.raises(ValueError, match="pass_"):
        T.bwd_tile_units(g, rows, cols, 128, "dkdv")
