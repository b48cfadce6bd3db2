"""flash-attention-tpu, torch side: flash_attn_func / flash_attn_varlen_func with autograd against
the f32 reference, opcheck, torch.compile(fullgraph=True), TPU interpret mode through the ops, and
bad inputs raising clear errors before any kernel runs."""

import numpy as np
import pytest
import torch

import kernel_loader

fa = kernel_loader.load_kernel("flash_attention")
R = fa.reference


def _ref_dense(q, k, v, **kw):
    """Reference in torch layout [B, S, H, D] -> [B, S, H, D] (f32 numpy)."""
    t = lambda x: np.swapaxes(x.detach().float().numpy(), 1, 2)  # noqa: E731
    s = kw.pop("s_aux", None)
    out = R.attention(
        t(q), t(k), t(v), sinks=None if s is None else s.detach().float().numpy(), **kw
    )
    return np.swapaxes(np.asarray(out), 1, 2)


def _torch_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, s_aux=None, scale=None):
    """Differentiable torch f32 reference (eager, [B, S, H, D]) for gradient checks."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    s = q @ k.transpose(-1, -2) * (scale or D**-0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    m = torch.from_numpy(np.array(R.mask(Sq, Sk, causal=causal, window_size=window)))
    s = s.masked_fill(~m, float("-inf"))
    if s_aux is not None:
        s = torch.cat([s, s_aux.float()[None, :, None, None].expand(B, H, Sq, 1)], -1)
    p = torch.softmax(s, -1)[..., :Sk]
    return (p @ v).transpose(1, 2)


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, Sq, Hq, D), mk(B, Sk, Hkv, D), mk(B, Sk, Hkv, D)


@pytest.mark.parametrize(
    "B,Sq,Sk,Hq,Hkv,D,dtype,causal,window,softcap,sinks",
    [
        (2, 37, 37, 4, 2, 64, torch.float32, True, (-1, -1), 0.0, False),
        (1, 20, 45, 4, 1, 128, torch.float32, True, (16, -1), 3.0, True),
        (1, 40, 40, 2, 2, 80, torch.bfloat16, False, (5, 5), 0.0, True),
    ],
)
def test_flash_attn_func_forward_backward(
    B, Sq, Sk, Hq, Hkv, D, dtype, causal, window, softcap, sinks
):
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, dtype)
    s_aux = torch.randn(Hq, requires_grad=True) if sinks else None
    out = fa.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, s_aux=s_aux
    )
    assert out.shape == q.shape and out.dtype == dtype
    ref = _torch_ref(q, k, v, causal, window, softcap, s_aux)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.detach(), atol=tol, rtol=tol)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    leaves = [q, k, v] + ([s_aux] if sinks else [])
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, leaves, do.float())
    for g, w in zip(got, want):
        scale = max(float(w.abs().max()), 1e-2)
        gtol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(g.float() / scale, w.float() / scale, atol=gtol, rtol=0)


def test_flash_attn_func_return_lse():
    q, k, v = _inputs(1, 24, 24, 2, 1, 64, torch.float32)
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (1, 2, 24) and lse.dtype == torch.float32
    s = torch.einsum("bqhd,bkhd->bhqk", q.detach(), k.detach().expand(-1, -1, 2, -1)) * 64**-0.5
    s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_varlen_func_forward_backward(dtype):
    lens_q, lens_k = [7, 0, 25, 3], [7, 5, 30, 3]
    cq = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int64)
    ck = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(int(cq[-1]), 4, 64, generator=g).to(dtype).requires_grad_()
    k = torch.randn(int(ck[-1]), 2, 64, generator=g).to(dtype).requires_grad_()
    v = torch.randn(int(ck[-1]), 2, 64, generator=g).to(dtype).requires_grad_()
    out = fa.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True)
    # reference: each sequence on its own through the differentiable torch reference
    refs = []
    for s in range(len(lens_q)):
        if lens_q[s] == 0:
            continue
        sl_q, sl_k = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        refs.append(_torch_ref(q[sl_q][None], k[sl_k][None], v[sl_k][None], causal=True)[0])
    ref = torch.cat(refs)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.detach(), atol=tol, rtol=tol)
    do = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, [q, k, v], do)
    want = torch.autograd.grad(ref, [q, k, v], do.float())
    for a, b in zip(got, want):
        scale = max(float(b.abs().max()), 1e-2)
        torch.testing.assert_close(
            a.float() / scale,
            b.float() / scale,
            atol=1e-4 if dtype == torch.float32 else 5e-2,
            rtol=0,
        )


def test_opcheck():
    q, k, v = (x.detach() for x in _inputs(1, 20, 20, 4, 2, 64, torch.float32))
    s_aux = torch.randn(4)
    args = (q, k, v, s_aux, None, None, True, -1, -1, 0.0, 0.125)
    torch.library.opcheck(fa.ops.fwd_op, args, raise_exception=True)
    out, lse = fa.ops.fwd_op(*args)
    bargs = (torch.randn_like(out), q, k, v, out, lse, s_aux, None, None, True, -1, -1, 0.0, 0.125)
    torch.library.opcheck(
        fa.ops.bwd_op, bargs, raise_exception=True, test_utils=("test_schema", "test_faketensor")
    )
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    vargs = (q[0], k[0], v[0], None, cu, cu, False, 3, 2, 5.0, 0.2)
    torch.library.opcheck(fa.ops.fwd_op, vargs, raise_exception=True)


def test_torch_compile_fullgraph():
    q, k, v = _inputs(1, 32, 32, 4, 2, 64, torch.float32)

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, window_size=(8, -1)).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, [q, k, v])
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, [q, k, v])
    torch.testing.assert_close(loss, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)
    # Inductor too, with the varlen entry point (cu_seqlens values are not inspected in the graph).
    cu = torch.tensor([0, 10, 32], dtype=torch.int32)
    fv = torch.compile(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, 22, 22, causal=True),
        fullgraph=True,
    )
    got = fv(q[0].detach(), k[0].detach(), v[0].detach())
    torch.testing.assert_close(
        got,
        fa.flash_attn_varlen_func(q[0].detach(), k[0].detach(), v[0].detach(), cu, cu, causal=True),
    )


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_ops_in_tpu_interpret_mode(tpu_interpret):
    q, k, v = _inputs(1, 24, 24, 2, 1, 64, torch.float32)
    s_aux = torch.randn(2, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=True, s_aux=s_aux)
    ref = _torch_ref(q, k, v, causal=True, s_aux=s_aux)
    torch.testing.assert_close(out, ref.detach(), atol=2e-5, rtol=2e-5)
    got = torch.autograd.grad(out.sum(), [q, k, v, s_aux])
    want = torch.autograd.grad(ref.sum(), [q, k, v, s_aux])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# -------------------------------------------------------------------------------------------------
# Bad input: a clear error before any kernel runs
# -------------------------------------------------------------------------------------------------

_q = torch.randn(1, 8, 4, 64)
_k = torch.randn(1, 8, 2, 64)
_qv = torch.randn(10, 4, 64)
_kv = torch.randn(10, 2, 64)
_cu = torch.tensor([0, 4, 10], dtype=torch.int32)

BAD = [
    (
        "dropout",
        lambda: fa.flash_attn_func(_q, _k, _k, dropout_p=0.1),
        NotImplementedError,
        "dropout",
    ),
    (
        "alibi",
        lambda: fa.flash_attn_func(_q, _k, _k, alibi_slopes=torch.ones(4)),
        NotImplementedError,
        "alibi",
    ),
    (
        "heads",
        lambda: fa.flash_attn_func(_q, torch.randn(1, 8, 3, 64), torch.randn(1, 8, 3, 64)),
        ValueError,
        "multiple",
    ),
    (
        "head_dim",
        lambda: fa.flash_attn_func(_q, torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32)),
        ValueError,
        "head dims",
    ),
    (
        "head_dim_big",
        lambda: fa.flash_attn_func(
            torch.randn(1, 8, 2, 512), torch.randn(1, 8, 2, 512), torch.randn(1, 8, 2, 512)
        ),
        ValueError,
        "head dim",
    ),
    (
        "kv_shape",
        lambda: fa.flash_attn_func(_q, _k, torch.randn(1, 9, 2, 64)),
        ValueError,
        "same shape",
    ),
    (
        "batch",
        lambda: fa.flash_attn_func(_q, torch.randn(2, 8, 2, 64), torch.randn(2, 8, 2, 64)),
        ValueError,
        "batch",
    ),
    ("ndim", lambda: fa.flash_attn_func(_qv, _kv, _kv), ValueError, "4-D"),
    ("dtype", lambda: fa.flash_attn_func(_q.half(), _k.half(), _k.half()), TypeError, "dtype"),
    (
        "mixed_dtype",
        lambda: fa.flash_attn_func(_q, _k.bfloat16(), _k.bfloat16()),
        TypeError,
        "share a dtype",
    ),
    (
        "window",
        lambda: fa.flash_attn_func(_q, _k, _k, window_size=(-2, 0)),
        ValueError,
        "window_size",
    ),
    (
        "window_len",
        lambda: fa.flash_attn_func(_q, _k, _k, window_size=(3,)),
        ValueError,
        "window_size",
    ),
    ("softcap", lambda: fa.flash_attn_func(_q, _k, _k, softcap=-1.0), ValueError, "softcap"),
    ("s_aux", lambda: fa.flash_attn_func(_q, _k, _k, s_aux=torch.zeros(3)), ValueError, "s_aux"),
    (
        "cu_not_increasing",
        lambda: fa.flash_attn_varlen_func(
            _qv,
            _kv,
            _kv,
            torch.tensor([0, 6, 4, 10], dtype=torch.int32),
            torch.tensor([0, 6, 4, 10], dtype=torch.int32),
            6,
            6,
        ),
        ValueError,
        "non-decreasing",
    ),
    (
        "cu_total",
        lambda: fa.flash_attn_varlen_func(
            _qv, _kv, _kv, torch.tensor([0, 4, 9], dtype=torch.int32), _cu, 5, 6
        ),
        ValueError,
        "packed length",
    ),
    (
        "cu_start",
        lambda: fa.flash_attn_varlen_func(
            _qv, _kv, _kv, torch.tensor([1, 4, 10], dtype=torch.int32), _cu, 6, 6
        ),
        ValueError,
        "start at 0",
    ),
    (
        "cu_len_mismatch",
        lambda: fa.flash_attn_varlen_func(
            _qv, _kv, _kv, _cu, torch.tensor([0, 10], dtype=torch.int32), 6, 10
        ),
        ValueError,
        "same length",
    ),
    (
        "cu_dtype",
        lambda: fa.flash_attn_varlen_func(_qv, _kv, _kv, _cu.float(), _cu, 6, 6),
        TypeError,
        "int32",
    ),
    (
        "varlen_ndim",
        lambda: fa.flash_attn_varlen_func(_q, _k, _k, _cu, _cu, 6, 6),
        ValueError,
        "3-D",
    ),
]


@pytest.mark.parametrize("name,fn,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_before_kernel(name, fn, exc, match, monkeypatch):
    # Any kernel launch would fail loudly: the error must come from validation.
    def boom(*a, **k):
        raise AssertionError("kernel ran before validation")

    monkeypatch.setattr(fa.ops.kernel, "flash_attention_fwd", boom)
    with pytest.raises(exc, match=match):
        fn()


def test_torch_compile_dynamic_shapes():
    f = torch.compile(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True),
        fullgraph=True,
        dynamic=True,
        backend="aot_eager",
    )
    for s in (20, 33):  # the second length reuses the symbolic graph
        q, k, v = (x.detach() for x in _inputs(1, s, s, 4, 2, 64, torch.float32, seed=s))
        torch.testing.assert_close(f(q, k, v), fa.flash_attn_func(q, k, v, causal=True))


def test_attention_forward_window_softcap_sinks_and_padding():
    """The Transformers attention function: [B, H, S, D] in, [B, S, H, D] out; sliding_window
    counts the current token (left window = sliding_window - 1); padded keys/queries drop out."""

    class Module(torch.nn.Module):
        is_causal = True

    B, S, H, Hkv, D, sw = 2, 30, 4, 2, 64, 9
    q, k, v = (x.detach() for x in _inputs(B, S, S, H, Hkv, D, torch.float32, seed=11))
    s_aux = torch.randn(H)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    out, weights = fa.attention_forward(
        Module(),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        scaling=0.1,
        sliding_window=sw,
        softcap=20.0,
        s_aux=s_aux,
    )
    assert weights is None and out.shape == (B, S, H, D)
    for b, start in ((0, 0), (1, 7)):
        want = _torch_ref(
            q[b : b + 1, start:],
            k[b : b + 1, start:],
            v[b : b + 1, start:],
            causal=True,
            window=(sw - 1, -1),
            softcap=20.0,
            s_aux=s_aux,
            scale=0.1,
        )
        torch.testing.assert_close(out[b : b + 1, start:], want, atol=2e-5, rtol=2e-5)
    assert torch.all(out[1, :7] == 0)
