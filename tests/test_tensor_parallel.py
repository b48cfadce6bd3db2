"""Head-sharded (tensor-parallel) flash and paged attention on emulated CPU devices:
kernels/flash_attention/tensor_parallel.py and kernels/paged_attention/tensor_parallel.py.

Like tests/test_expert_parallel.py, each case runs this file as a script in a fresh process with
`--xla_force_host_platform_device_count=8` set before JAX initialises (the pytest process has one
CPU device), kernels in interpret mode, tiny shapes.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_loader

HERE = Path(__file__).resolve().parent

FA = kernel_loader.load_kernel("flash_attention")
PA = kernel_loader.load_kernel("paged_attention")
FTP = importlib.import_module(FA.__name__ + ".tensor_parallel")
PTP = importlib.import_module(PA.__name__ + ".tensor_parallel")

DEVICES = 8
TP = 4
HQ, HKV, D = 8, 4, 128  # GQA groups of 2 query heads; each of 4 devices holds one group


def _run_case(name: str, timeout: int = 300) -> str:
    import emulated_devices

    return emulated_devices.run_case(__file__, name, DEVICES, timeout)


def _mesh(n=TP, axis="tp"):
    from jax.sharding import Mesh

    assert len(jax.devices()) == DEVICES, jax.devices()
    return Mesh(np.array(jax.devices()[:n]), (axis,))


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol
    )


def _rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# -------------------------------------------------------------------------------------------------
# Cases (run in the 8-device subprocess)
# -------------------------------------------------------------------------------------------------

SMALL_TILES = dict(
    block_q=32,
    block_kv=32,
    block_kv_compute=16,
    block_q_bwd=16,
    block_kv_bwd=32,
    block_q_compute=16,
    block_kv_compute_bwd=16,
)


def case_flash():
    mesh = _mesh()
    tiles = FA.tiling.Tiles(**SMALL_TILES)
    b, s = 2, 64
    q, k, v = _rand(0, (b, HQ, s, D)), _rand(1, (b, HKV, s, D)), _rand(2, (b, HKV, s, D))
    sinks, do = _rand(3, (HQ,)), _rand(4, (b, HQ, s, D))
    cfg = dict(causal=True, window_size=(40, -1), softcap=0.0)

    def loss(attn):
        return lambda q, k, v, sk: jnp.sum(attn(q, k, v, sk) * do)

    def sharded(q, k, v, sk):
        return FTP.tensor_parallel_flash_attention(
            q, k, v, mesh=mesh, sinks=sk, tiles=tiles, interpret=True, **cfg
        )

    def unsharded(q, k, v, sk):
        return FA.kernel.flash_attention(q, k, v, sinks=sk, tiles=tiles, interpret=True, **cfg)

    out = jax.jit(sharded)(q, k, v, sinks)
    one = jax.jit(unsharded)(q, k, v, sinks)
    ref = FA.reference.attention(q, k, v, sinks=sinks, **cfg)
    _close(one, ref)
    _close(out, one, tol=1e-6)
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = jax.jit(jax.grad(loss(unsharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        _close(g, w, tol=1e-5)
    # Packed documents (segment ids replicated, heads split).
    seg = jnp.asarray(np.sort(np.random.RandomState(0).randint(0, 3, (b, s)), axis=1))
    out = jax.jit(
        lambda q, k, v: FTP.tensor_parallel_flash_attention(
            q,
            k,
            v,
            mesh=mesh,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            tiles=tiles,
            interpret=True,
            causal=True,
        )
    )(q, k, v)
    _close(out, FA.reference.attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg))


def _paged_batch(rng, q_lens, kv_lens, *, num_slots=3, pages_per_seq=4, page_size=16, tokens=24):
    n = len(q_lens)
    num_pages = num_slots * pages_per_seq + 2
    pt = rng.permutation(num_pages)[: num_slots * pages_per_seq].reshape(num_slots, pages_per_seq)
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kl = np.zeros(num_slots, np.int32)
    kl[:n] = kv_lens
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    return dict(
        q=f(tokens, HQ, D),
        kv=f(num_pages, 2 * HKV, page_size, D),
        k_tm=f(num_pages, page_size, HKV, D),
        v_tm=f(num_pages, page_size, HKV, D),
        new_k=f(tokens, HKV, D),
        new_v=f(tokens, HKV, D),
        kv_lens=kl,
        pt=pt.astype(np.int32),
        cu=cu,
        ns=np.array([n], np.int32),
    )


def case_paged():
    mesh = _mesh()
    b = _paged_batch(np.random.default_rng(0), q_lens=[1, 7, 12], kv_lens=[30, 7, 50])
    meta = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    # Head-major cache, K/V interleaved per head.
    out = jax.jit(
        lambda q, kv, *m: PTP.tensor_parallel_paged_attention(
            q, kv, *m, mesh=mesh, soft_cap=30.0, interpret=True
        )
    )(b["q"], b["kv"], *meta)
    one = jax.jit(
        lambda q, kv, *m: PA.kernel.ragged_paged_attention(q, kv, *m, soft_cap=30.0, interpret=True)
    )(b["q"], b["kv"], *meta)
    ref = PA.reference.ragged_paged_attention_ref(b["q"], b["kv"], *meta, soft_cap=30.0)
    _close(one, ref)
    _close(out, one, tol=1e-6)
    # Token-major caches with the new tokens' K/V written by each device into its head shard.
    sharded_tm = PTP.tensor_parallel_paged_attention_token_major
    out, k2, v2 = jax.jit(
        lambda q, kc, vc, nk, nv, *m: sharded_tm(
            q, kc, vc, *m, mesh=mesh, new_k=nk, new_v=nv, sliding_window=20, interpret=True
        )
    )(b["q"], b["k_tm"], b["v_tm"], b["new_k"], b["new_v"], *meta)
    one, k1, v1 = jax.jit(
        lambda q, kc, vc, nk, nv, *m: PA.kernel.paged_attention_token_major(
            q, kc, vc, *m, new_k=nk, new_v=nv, sliding_window=20, interpret=True
        )
    )(b["q"], b["k_tm"], b["v_tm"], b["new_k"], b["new_v"], *meta)
    assert np.array_equal(np.asarray(k2), np.asarray(k1))
    assert np.array_equal(np.asarray(v2), np.asarray(v1))
    _close(out, one, tol=1e-6)
    _close(
        one, PA.reference.paged_attention_token_major_ref(b["q"], k1, v1, *meta, sliding_window=20)
    )


def case_bad_input():
    mesh = _mesh(8)
    q, k = jnp.zeros((1, 8, 16, D)), jnp.zeros((1, 4, 16, D))
    with pytest.raises(ValueError, match="does not divide the 4 KV heads"):
        FTP.tensor_parallel_flash_attention(q, k, k, mesh=mesh, interpret=True)
    with pytest.raises(ValueError, match="not a multiple"):
        FTP.tensor_parallel_flash_attention(
            jnp.zeros((1, 6, 16, D)), k, k, mesh=_mesh(2), interpret=True
        )
    with pytest.raises(ValueError, match="not an axis"):
        FTP.tensor_parallel_flash_attention(q, k, k, mesh=_mesh(2, "heads"), interpret=True)
    b = _paged_batch(np.random.default_rng(0), q_lens=[1], kv_lens=[3])
    meta = (b["kv_lens"], b["pt"], b["cu"], b["ns"])
    with pytest.raises(ValueError, match="does not divide the 4 KV heads"):
        PTP.tensor_parallel_paged_attention(b["q"], b["kv"], *meta, mesh=mesh, interpret=True)
    with pytest.raises(ValueError, match="does not divide the 4 KV heads"):
        PTP.tensor_parallel_paged_attention_token_major(
            b["q"], b["k_tm"], b["v_tm"], *meta, mesh=mesh, interpret=True
        )


CASES = {"flash": case_flash, "paged": case_paged, "bad_input": case_bad_input}


def test_flash_attention_heads_sharded():
    """4 devices x (1 KV head, its 2 query heads): forward, sinks, sliding window, packed
    documents and dq/dk/dv/dsinks equal to the unsharded kernel."""
    _run_case("flash")


def test_paged_attention_heads_sharded():
    """Head-major (K/V interleaved) and token-major caches split by KV head over 4 devices;
    the token-major cache write lands bit-exactly where the unsharded one does."""
    _run_case("paged")


def test_head_split_errors():
    _run_case("bad_input")


if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print(f"CASE {sys.argv[1]} OK")
