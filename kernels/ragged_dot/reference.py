"""f32 references for the ragged-dot kernels: plain numpy loops over the groups, no Pallas.

Each takes concrete arrays (numpy, JAX or anything `np.asarray` accepts; bf16 inputs are widened
exactly) and returns float32 numpy arrays. The matmuls run in float64, so the reference is at least
as accurate as any f32-accumulating kernel.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "gmm_reference",
    "gmm_gated_reference",
    "gated_activation_reference",
    "tgmm_reference",
    "dequantise",
]


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32).astype(np.float64)


def _offsets(group_sizes, m: int):
    gs = np.asarray(group_sizes).astype(np.int64)
    ends = np.minimum(np.cumsum(gs), m)
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends


def dequantise(rhs, scales, *, transpose_rhs: bool = False) -> np.ndarray:
    """Explicit dequantisation of int8 / fp8 weights with per-output-channel scales [G, N]."""
    w = _f64(rhs)
    s = _f64(scales)
    return w * (s[:, :, None] if transpose_rhs else s[:, None, :])


def gmm_reference(lhs, rhs, group_sizes, scales=None, *, transpose_rhs: bool = False) -> np.ndarray:
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g].T if transpose_rhs); rows past
    sum(group_sizes) are zero. Quantised rhs: dequantised with `scales` first."""
    x = _f64(lhs)
    w = dequantise(rhs, scales, transpose_rhs=transpose_rhs) if scales is not None else _f64(rhs)
    if transpose_rhs:
        w = np.swapaxes(w, 1, 2)
    m = x.shape[0]
    out = np.zeros((m, w.shape[2]), np.float64)
    for g, (s, e) in enumerate(zip(*_offsets(group_sizes, m))):
        if e > s:
            out[s:e] = x[s:e] @ w[g]
    return out.astype(np.float32)


def gated_activation_reference(h, activation: str, layout: str) -> np.ndarray:
    """act(gate) * up of a pre-activation h [..., 2I] in float64 (erf from math, elementwise)."""
    import math

    h = np.asarray(h, np.float64)
    if layout == "concatenated":
        gate, up = np.split(h, 2, axis=-1)
    else:
        gate, up = h[..., 0::2], h[..., 1::2]

    def sigmoid(x):
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-x))

    if activation == "silu":
        return gate * sigmoid(gate) * up
    if activation == "gelu":
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return 0.5 * gate * (1.0 + erf(gate / math.sqrt(2.0))) * up
    if activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1.0 + np.tanh(inner)) * up
    if activation == "gpt_oss_swiglu":  # transformers' GptOssExperts._apply_gate
        gate = np.minimum(gate, 7.0)
        up = np.clip(up, -7.0, 7.0)
        return (up + 1.0) * (gate * sigmoid(gate * 1.702))
    raise ValueError(f"unknown activation {activation!r}")


def gmm_gated_reference(
    lhs, rhs, group_sizes, bias=None, *, activation: str, layout: str, transpose_rhs: bool = False
) -> np.ndarray:
    """act(gate) * up of h = lhs[rows of g] @ rhs[g] (+ bias[g]); rows past the sum are zero."""
    h = gmm_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs).astype(np.float64)
    m = h.shape[0]
    if bias is not None:
        b = _f64(bias)
        for g, (s, e) in enumerate(zip(*_offsets(group_sizes, m))):
            h[s:e] += b[g]
    return gated_activation_reference(h, activation, layout).astype(np.float32)


def tgmm_reference(lhs, dout, group_sizes) -> np.ndarray:
    """out[g] = lhs[rows of g].T @ dout[rows of g]; empty groups are zero."""
    x, y = _f64(lhs), _f64(dout)
    m = x.shape[0]
    gs = np.asarray(group_sizes)
    out = np.zeros((gs.shape[0], x.shape[1], y.shape[1]), np.float64)
    for g, (s, e) in enumerate(zip(*_offsets(gs, m))):
        if e > s:
            out[g] = x[s:e].T @ y[s:e]
    return out.astype(np.float32)
