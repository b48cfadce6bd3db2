"""ragged-dot-tpu torch API: ops (opcheck, autograd, torch.compile), bad input, Hub loading."""

import numpy as np
import pytest
import torch

import kernel_loader

rd = kernel_loader.load_kernel("ragged_dot")


def _ref_gmm(x, w, group_sizes, transpose_rhs=False):
    """Per-group torch loop in float64: differentiable reference."""
    outs, start = [], 0
    for g, size in enumerate(group_sizes):
        wg = w[g].T if transpose_rhs else w[g]
        outs.append(x[start : start + size] @ wg)
        start += size
    n = w.shape[1] if transpose_rhs else w.shape[2]
    outs.append(x.new_zeros((x.shape[0] - start, n)))
    return torch.cat(outs)


def _inputs(m, k, n, group_sizes, dtype=torch.float32, transpose_rhs=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    w = torch.randn(*shape, generator=gen).to(dtype)
    return x, w, torch.tensor(group_sizes, dtype=torch.int32)


def test_public_api():
    assert set(rd.__all__) == {
        "ragged_dot",
        "gmm",
        "gmm_gated",
        "tgmm",
        "experts_forward",
        "register",
        "warmup",
    }
    for name in rd.__all__:
        assert callable(getattr(rd, name))


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gmm_autograd_matches_reference(transpose_rhs, dtype):
    gs = [3, 0, 17, 1, 9]  # sum 30 < M = 40
    x, w, gst = _inputs(40, 72, 136, gs, dtype, transpose_rhs)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = rd.gmm(x, w, gst.to(torch.int64), transpose_rhs=transpose_rhs)
    assert out.dtype == dtype and out.shape == (40, 136)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = _ref_gmm(x64, w64, gs, transpose_rhs)
    grad = torch.randn(40, 136, generator=torch.Generator().manual_seed(1)).to(dtype)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x64, w64), grad.double())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(dx.double(), dx_ref, **tol)
    torch.testing.assert_close(dw.double(), dw_ref, **tol)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert torch.all(dw[1] == 0)  # the empty group gets an exactly zero weight gradient


def test_tgmm_and_ragged_dot_match_reference():
    gs = [4, 0, 9, 2]
    x, w, gst = _inputs(20, 200, 128, gs)
    dout = torch.randn(20, 128)
    got = rd.tgmm(x, dout, gst)
    ref = torch.stack(
        [
            x[s:e].T.double() @ dout[s:e].double()
            for s, e in zip(np.r_[0, np.cumsum(gs)[:-1]], np.cumsum(gs))
        ]
    )
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    out = rd.ragged_dot(x, w, gst, preferred_element_type=torch.float32)
    torch.testing.assert_close(
        out.double(), _ref_gmm(x.double(), w.double(), gs), rtol=1e-5, atol=1e-4
    )


def test_tiling_override_through_torch():
    gs = [5, 0, 14, 20]
    x, w, gst = _inputs(48, 200, 256, gs, torch.bfloat16, transpose_rhs=True, seed=4)
    out = rd.gmm(
        x,
        w,
        gst,
        transpose_rhs=True,
        out_dtype=torch.float32,
        tiling={"tm": 16, "tk": 128, "tn": 128},
    )
    torch.testing.assert_close(
        out.double(), _ref_gmm(x.double(), w.double(), gs, True), rtol=1e-5, atol=1e-3
    )
    dout = torch.randn(48, 256).to(torch.bfloat16)
    got = rd.tgmm(x, dout, gst, out_dtype=torch.float32, tiling={"tm": 16, "tk": 128})
    starts = np.r_[0, np.cumsum(gs)[:-1]]
    ref = torch.stack(
        [x[s : s + g].double().T @ dout[s : s + g].double() for s, g in zip(starts, gs)]
    )
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="tiling"):
        rd.gmm(x, w, gst, transpose_rhs=True, tiling={"tm": 10})


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_quantised_gmm_torch(qdtype):
    gs = [5, 0, 11]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    if qdtype == torch.int8:
        wq = torch.randint(-127, 128, (3, 128, 256), generator=gen, dtype=torch.int8)
    else:
        wq = (torch.randn(3, 128, 256, generator=gen) * 4).to(qdtype)
    scales = torch.rand(3, 128, generator=gen) * 0.01 + 0.005
    out = rd.gmm(x, wq, torch.tensor(gs), scales, transpose_rhs=True, out_dtype=torch.float32)
    deq = wq.to(torch.float64) * scales.double()[:, :, None]
    ref = _ref_gmm(x.double(), deq, gs, transpose_rhs=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


def test_empty_shapes():
    w = torch.randn(3, 128, 64)
    none = torch.zeros(3, dtype=torch.int32)
    assert rd.gmm(torch.zeros(0, 128), w, none).shape == (0, 64)
    assert torch.all(rd.tgmm(torch.zeros(0, 128), torch.zeros(0, 64), none) == 0)
    x = torch.randn(5, 128, requires_grad=True)
    y = rd.gmm(x, w, none)  # no rows in any group: zeros, and zero gradient
    y.sum().backward()
    assert torch.all(y == 0) and torch.all(x.grad == 0)


def test_opcheck():
    gs = [3, 0, 5]
    x, w, gst = _inputs(10, 128, 128, gs)
    torch.library.opcheck(rd.ops.gmm_op, (x, w, gst, None, False, "", 0, 0, 0))
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.library.opcheck(
        rd.ops.gmm_op,
        (xr, wr, gst, None, False, "", 0, 0, 0),
        test_utils=(
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )
    torch.library.opcheck(rd.ops.tgmm_op, (x, torch.randn(10, 128), gst, "", 0, 0, 0))


def test_torch_compile_fullgraph():
    gs = [3, 0, 5]
    x, w, gst = _inputs(10, 128, 128, gs)

    def f(x, w, gs):
        return torch.relu(rd.gmm(x, w, gs, transpose_rhs=True)) * 2

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, gst), f(x, w, gst))
    xr = x.clone().requires_grad_(True)
    compiled(xr, w, gst).sum().backward()
    xe = x.clone().requires_grad_(True)
    f(xe, w, gst).sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad)


@pytest.mark.tpu_interpret
@pytest.mark.timeout(300)
def test_gmm_op_in_tpu_interpret_mode(tpu_interpret):
    gs = [5, 0, 9]
    x, w, gst = _inputs(16, 128, 128, gs)
    out = rd.gmm(x, w, gst)
    torch.testing.assert_close(
        out.double(), _ref_gmm(x.double(), w.double(), gs), rtol=1e-5, atol=1e-4
    )


def _ref_gated(x, w, bias, group_sizes, activation, layout, transpose_rhs):
    """float64 torch reference of gmm_gated (differentiable): the unfused per-group loop, the
    per-group bias, then the gating of ops.gated_activation_torch."""
    h = _ref_gmm(x, w, group_sizes, transpose_rhs)
    if bias is not None:
        rows = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
        pad = h.shape[0] - rows.shape[0]
        h = h + torch.cat([bias[rows], bias.new_zeros((pad, bias.shape[1]))])
    return rd.ops.gated_activation_torch(h, activation, layout)


@pytest.mark.parametrize(
    "layout,activation,transpose_rhs,with_bias",
    [
        ("concatenated", "silu", True, False),
        ("concatenated", "gelu", False, True),
        ("interleaved", "gpt_oss_swiglu", False, True),
        ("interleaved", "gelu_tanh", True, False),
    ],
)
def test_gmm_gated_autograd_matches_reference(layout, activation, transpose_rhs, with_bias):
    """Forward and the recomputing backward (d lhs, d rhs, d bias) against float64 autograd."""
    gs = [3, 0, 17, 1, 9]  # sum 30 < M = 40
    x, w, gst = _inputs(40, 72, 256, gs, transpose_rhs=transpose_rhs, seed=3)
    w = (w * 0.5).requires_grad_(True)
    x.requires_grad_(True)
    gen = torch.Generator().manual_seed(5)
    bias = (torch.randn(5, 256, generator=gen) * 2).requires_grad_(True) if with_bias else None
    out = rd.gmm_gated(
        x, w, gst, bias, activation=activation, layout=layout, transpose_rhs=transpose_rhs
    )
    assert out.shape == (40, 128) and out.dtype == torch.float32
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True) if with_bias else None
    ref = _ref_gated(x64, w64, b64, gs, activation, layout, transpose_rhs)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.all(out[30:] == 0)
    grad = torch.randn(40, 128, generator=gen)
    inputs = (x, w) + ((bias,) if with_bias else ())
    inputs64 = (x64, w64) + ((b64,) if with_bias else ())
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs64, grad.double())
    for name, g, r in zip(("lhs", "rhs", "bias"), got, want):
        torch.testing.assert_close(g.double(), r, **tol, msg=name)
    assert torch.all(got[1][1] == 0)  # the empty group: exactly zero weight gradient


def test_gmm_gated_opcheck():
    x, w, gst = _inputs(10, 128, 256, [3, 0, 5])
    bias = torch.randn(3, 256)
    torch.library.opcheck(
        rd.ops.gmm_gated_op, (x, w, gst, bias, "silu", "concatenated", False, "", 0, 0, 0)
    )
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, bias))
    torch.library.opcheck(
        rd.ops.gmm_gated_op,
        (xr, wr, gst, br, "gpt_oss_swiglu", "interleaved", False, "", 0, 0, 0),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def _bad_calls():
    x, w, gs = _inputs(12, 128, 64, [4, 8])
    wq = torch.zeros(2, 128, 64, dtype=torch.int8)
    return [
        ("rhs.*K=96", lambda: rd.gmm(x, torch.zeros(2, 96, 64), gs), ValueError),
        ("group_sizes.*shape \\(2,\\)", lambda: rd.gmm(x, w, torch.tensor([4, 4, 4])), ValueError),
        ("group_sizes.*int32 or int64", lambda: rd.gmm(x, w, gs.float()), TypeError),
        ("group_sizes.*non-negative", lambda: rd.gmm(x, w, torch.tensor([-1, 5])), ValueError),
        ("group_sizes.*sum 20 exceeds", lambda: rd.gmm(x, w, torch.tensor([10, 10])), ValueError),
        ("lhs.*2-D", lambda: rd.gmm(x[None], w, gs), ValueError),
        ("rhs.*3-D", lambda: rd.gmm(x, w[0], gs), ValueError),
        ("lhs.*dtype", lambda: rd.gmm(x.to(torch.float16), w, gs), TypeError),
        ("rhs.*must match lhs", lambda: rd.gmm(x, w.to(torch.bfloat16), gs), TypeError),
        ("rhs.*dtype", lambda: rd.gmm(x, w.to(torch.int32), gs), TypeError),
        ("scales.*needs", lambda: rd.gmm(x.bfloat16(), wq, gs), ValueError),
        ("scales.*shape", lambda: rd.gmm(x.bfloat16(), wq, gs, torch.ones(2, 63)), ValueError),
        ("scales.*only int8", lambda: rd.gmm(x, w, gs, torch.ones(2, 64)), ValueError),
        ("group_sizes.*on meta", lambda: rd.gmm(x, w, gs.to("meta")), ValueError),
        ("rhs.*on meta", lambda: rd.gmm(x, w.to("meta"), gs), ValueError),
        ("dout.*rows", lambda: rd.tgmm(x, torch.zeros(11, 64), gs), ValueError),
        ("out_dtype", lambda: rd.gmm(x, w, gs, out_dtype=torch.int32), TypeError),
        ("group_offset", lambda: rd.ragged_dot(x, w, gs, group_offset=gs), ValueError),
        ("activation", lambda: rd.gmm_gated(x, w, gs, activation="relu"), ValueError),
        ("layout", lambda: rd.gmm_gated(x, w, gs, layout="stacked"), ValueError),
        ("bias.*shape", lambda: rd.gmm_gated(x, w, gs, torch.zeros(2, 32)), ValueError),
        ("rhs.*even", lambda: rd.gmm_gated(x, w[:, :, :63], gs), ValueError),
        ("rhs.*K=96", lambda: rd.gmm_gated(x, torch.zeros(2, 96, 64), gs), ValueError),
    ]


@pytest.mark.parametrize("idx", range(len(_bad_calls())))
def test_bad_input_raises_before_kernel(idx, monkeypatch):
    pattern, call, exc = _bad_calls()[idx]

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(rd.ops, "gmm_op", no_kernel)
    monkeypatch.setattr(rd.ops, "gmm_gated_op", no_kernel)
    monkeypatch.setattr(rd.ops, "tgmm_op", no_kernel)
    with pytest.raises(exc, match=pattern):
        call()


def test_hub_loading_offline(monkeypatch):
    import kernels

    kernel_loader.use_offline_hub(monkeypatch)
    hub = kernels.get_kernel(kernel_loader.repo_id("ragged_dot"), version=1, trust_remote_code=True)
    x, w, gs = _inputs(8, 128, 128, [3, 5])
    torch.testing.assert_close(
        hub.ragged_dot(x, w, gs).double(),
        _ref_gmm(x.double(), w.double(), [3, 5]),
        rtol=1e-5,
        atol=1e-4,
    )
