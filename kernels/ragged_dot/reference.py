"""f32 references for the ragged-dot kernels: plain numpy loops over the groups, no Pallas.

Each takes concrete arrays (numpy, JAX or anything `np.asarray` accepts; bf16 inputs are widened
exactly) and returns float32 numpy arrays. The matmuls run in float64, so the reference is at least
as accurate as any f32-accumulating kernel.
"""

from __future__ import annotations

import numpy as np

__all__ = ["gmm_reference", "tgmm_reference", "dequantise"]


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
