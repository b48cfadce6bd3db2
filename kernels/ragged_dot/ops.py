"""Torch ops and public torch functions of ragged-dot-tpu.

Three custom ops run the Pallas kernels of kernel.py through the shared bridge:
  gmm(lhs, rhs, group_sizes, scales?, transpose_rhs, out_dtype, tm, tk, tn) -> [M, N]
  gmm_gated(lhs, rhs, group_sizes, bias?, activation, layout, transpose_rhs, out_dtype, tm, tk,
            tn) -> [M, I]: the gate_up projection with act(gate) * up fused into its epilogue
  tgmm(lhs, dout, group_sizes, out_dtype, tm, tk, tn) -> [G, K, N]
gmm carries autograd: d lhs = gmm(grad, rhs) with the other weight layout (no HBM transpose),
d rhs = tgmm(lhs, grad) (or tgmm(grad, lhs) for the [G, N, K] layout). gmm_gated's backward
recomputes the pre-activation [M, 2I] with gmm (the forward never wrote it), takes the activation's
vjp in f32, and runs the same dlhs / tgmm kernels; the bias gradient is the per-group row sum.

Shape buckets (shape_buckets.py): the public functions pad the row count M up to its token bucket
before the op runs and return the caller's M rows, so a new M compiles only when it lands in a new
bucket. The padded rows lie past sum(group_sizes): they join no group, the kernels write them as
zeros and never read them, tgmm ignores them, and autograd drops their gradient at the slice.
Everything else that crosses the op as a Python value (transpose_rhs, out_dtype, activation,
layout, tile overrides) is fixed per model: a compile key by design.

Every public function validates its inputs (shapes, dtypes, devices, group_sizes values) and
raises ValueError / TypeError naming the argument before any kernel runs.
"""

from __future__ import annotations

from typing import Optional

import jax
import torch

from . import kernel as _kernel
from . import tiling as _tiling
from ._ops import add_op_namespace_prefix
from .jax_bridge import jax_op, pallas_interpret
from .shape_buckets import bucket_tokens

__all__ = [
    "ragged_dot",
    "gmm",
    "gmm_gated",
    "tgmm",
    "gmm_op",
    "gmm_gated_op",
    "tgmm_op",
    "gated_activation_torch",
    "pad_rows",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_OUT_DTYPES = {"": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    if dtype is None:
        return ""
    for name, d in _OUT_DTYPES.items():
        if d == dtype:
            return name
    raise TypeError(f"out_dtype: expected torch.bfloat16, torch.float32 or None, got {dtype}")


def _override(tm: int, tk: int, tn: int) -> dict:
    return {key: v for key, v in (("tm", tm), ("tk", tk), ("tn", tn)) if v}


# -------------------------------------------------------------------------------------------------
# The ops: annotated JAX bodies
# -------------------------------------------------------------------------------------------------


def _gmm_jax(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    scales: Optional[jax.Array] = None,
    transpose_rhs: bool = False,
    out_dtype: str = "",
    tm: int = 0,
    tk: int = 0,
    tn: int = 0,
) -> jax.Array:
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = out_dtype or lhs.dtype
    tiling = None
    if tm or tk or tn:
        tiling = _tiling.gmm_tiling(
            m,
            k,
            n,
            lhs.dtype,
            rhs.dtype,
            out,
            num_groups=rhs.shape[0],
            override=_override(tm, tk, tn),
        )
    return _kernel.gmm(
        lhs,
        rhs,
        group_sizes,
        scales,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype or None,
        tiling=tiling,
        interpret=pallas_interpret(),
    )


def _gmm_fake(
    lhs, rhs, group_sizes, scales=None, transpose_rhs=False, out_dtype="", tm=0, tk=0, tn=0
):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return lhs.new_empty((lhs.shape[0], n), dtype=_OUT_DTYPES[out_dtype] or lhs.dtype)


def _tgmm_jax(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    out_dtype: str = "",
    tm: int = 0,
    tk: int = 0,
    tn: int = 0,
) -> jax.Array:
    m, k = lhs.shape
    n = dout.shape[1]
    tiling = None
    if tm or tk or tn:
        tiling = _tiling.tgmm_tiling(
            m,
            k,
            n,
            lhs.dtype,
            dout.dtype,
            out_dtype or lhs.dtype,
            num_groups=group_sizes.shape[0],
            override=_override(tm, tk, tn),
        )
    return _kernel.tgmm(
        lhs,
        dout,
        group_sizes,
        out_dtype=out_dtype or None,
        tiling=tiling,
        interpret=pallas_interpret(),
    )


def _tgmm_fake(lhs, dout, group_sizes, out_dtype="", tm=0, tk=0, tn=0):
    return lhs.new_empty(
        (group_sizes.shape[0], lhs.shape[1], dout.shape[1]),
        dtype=_OUT_DTYPES[out_dtype] or lhs.dtype,
    )


def _gmm_gated_jax(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    bias: Optional[jax.Array] = None,
    activation: str = "silu",
    layout: str = "concatenated",
    transpose_rhs: bool = False,
    out_dtype: str = "",
    tm: int = 0,
    tk: int = 0,
    tn: int = 0,
) -> jax.Array:
    m, k = lhs.shape
    n = (rhs.shape[1] if transpose_rhs else rhs.shape[2]) // 2
    out = out_dtype or lhs.dtype
    tiling = None
    if tm or tk or tn:
        tiling = _tiling.gmm_tiling(
            m,
            k,
            n,
            lhs.dtype,
            rhs.dtype,
            out,
            num_groups=rhs.shape[0],
            override=_override(tm, tk, tn),
            gate_layout=layout,
        )
    return _kernel.gmm_gated(
        lhs,
        rhs,
        group_sizes,
        bias,
        activation=activation,
        layout=layout,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype or None,
        tiling=tiling,
        interpret=pallas_interpret(),
    )


def _gmm_gated_fake(
    lhs,
    rhs,
    group_sizes,
    bias=None,
    activation="silu",
    layout="concatenated",
    transpose_rhs=False,
    out_dtype="",
    tm=0,
    tk=0,
    tn=0,
):
    n = (rhs.shape[1] if transpose_rhs else rhs.shape[2]) // 2
    return lhs.new_empty((lhs.shape[0], n), dtype=_OUT_DTYPES[out_dtype] or lhs.dtype)


gmm_op = jax_op(add_op_namespace_prefix("gmm"), _gmm_jax, fake=_gmm_fake)
gmm_gated_op = jax_op(add_op_namespace_prefix("gmm_gated"), _gmm_gated_jax, fake=_gmm_gated_fake)
tgmm_op = jax_op(add_op_namespace_prefix("tgmm"), _tgmm_jax, fake=_tgmm_fake)


def _gmm_setup_context(ctx, inputs, output):
    lhs, rhs, group_sizes, scales, transpose_rhs, out_dtype, tm, tk, tn = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)
    ctx.quantised = scales is not None
    ctx.transpose_rhs = transpose_rhs
    ctx.lhs_dtype, ctx.rhs_dtype = lhs.dtype, rhs.dtype


def _gmm_backward(ctx, grad):
    lhs, rhs, group_sizes = ctx.saved_tensors
    if ctx.quantised:
        raise NotImplementedError(
            "ragged_dot gmm: int8 / float8 weights are forward-only; no gradient through them"
        )
    grad = grad.to(ctx.lhs_dtype)
    dlhs = drhs = None
    if ctx.needs_input_grad[0]:
        # lhs @ rhs[g] -> grad @ rhs[g]^T: the same kernel with the other weight layout.
        dlhs = gmm_op(
            grad, rhs, group_sizes, None, not ctx.transpose_rhs, _dtype_name(ctx.lhs_dtype)
        )
    if ctx.needs_input_grad[1]:
        out = _dtype_name(ctx.rhs_dtype)
        if ctx.transpose_rhs:  # rhs [G, N, K]: grad[g]^T @ lhs[g]
            drhs = tgmm_op(grad, lhs, group_sizes, out)
        else:  # rhs [G, K, N]: lhs[g]^T @ grad[g]
            drhs = tgmm_op(lhs, grad, group_sizes, out)
    return dlhs, drhs, None, None, None, None, None, None, None


gmm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup_context)


def gated_activation_torch(h: torch.Tensor, activation: str, layout: str) -> torch.Tensor:
    """act(gate) * up of a pre-activation h [..., 2I] in torch (the formulas of
    kernel.gated_activation): the backward's vjp and a readable reference."""
    if layout == "concatenated":
        gate, up = h.chunk(2, dim=-1)
    else:
        gate, up = h[..., ::2], h[..., 1::2]
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "gelu":
        return torch.nn.functional.gelu(gate) * up
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if activation == "gpt_oss_swiglu":
        gate = gate.clamp(max=_kernel.GPT_OSS_LIMIT)
        up = up.clamp(min=-_kernel.GPT_OSS_LIMIT, max=_kernel.GPT_OSS_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * _kernel.GPT_OSS_ALPHA))
    raise ValueError(f"activation: expected one of {_kernel.ACTIVATIONS}, got {activation!r}")


def _row_groups(group_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """Group of each of the m rows; rows past sum(group_sizes) get G (no group)."""
    ends = torch.cumsum(group_sizes.to(torch.int64), 0)
    return torch.searchsorted(ends, torch.arange(m, device=group_sizes.device), right=True)


def _gated_setup_context(ctx, inputs, output):
    lhs, rhs, group_sizes, bias, activation, layout, transpose_rhs, out_dtype, tm, tk, tn = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes, bias)
    ctx.activation, ctx.layout, ctx.transpose_rhs = activation, layout, transpose_rhs
    ctx.lhs_dtype, ctx.rhs_dtype = lhs.dtype, rhs.dtype


def _gated_backward(ctx, grad):
    lhs, rhs, group_sizes, bias = ctx.saved_tensors
    num_groups, m = rhs.shape[0], lhs.shape[0]
    # The forward wrote only act(gate) * up: recompute the pre-activation h = lhs @ W (+ bias).
    h = gmm_op(lhs, rhs, group_sizes, None, ctx.transpose_rhs, "float32")
    groups = _row_groups(group_sizes, m)
    in_group = (groups < num_groups).unsqueeze(-1)
    if bias is not None:
        rows_bias = bias.to(torch.float32)[groups.clamp(max=num_groups - 1)]
        h = torch.where(in_group, h + rows_bias, h)
    with torch.enable_grad():
        hh = h.detach().requires_grad_(True)
        (dh,) = torch.autograd.grad(
            gated_activation_torch(hh, ctx.activation, ctx.layout), hh, grad.to(torch.float32)
        )
    # Rows outside every group had no pre-activation: no gradient flows from them.
    dh = torch.where(in_group, dh, torch.zeros((), dtype=dh.dtype, device=dh.device))
    dh_k = dh.to(ctx.lhs_dtype)
    dlhs = drhs = dbias = None
    if ctx.needs_input_grad[0]:
        dlhs = gmm_op(
            dh_k, rhs, group_sizes, None, not ctx.transpose_rhs, _dtype_name(ctx.lhs_dtype)
        )
    if ctx.needs_input_grad[1]:
        out = _dtype_name(ctx.rhs_dtype)
        drhs = (
            tgmm_op(dh_k, lhs, group_sizes, out)
            if ctx.transpose_rhs
            else tgmm_op(lhs, dh_k, group_sizes, out)
        )
    if bias is not None and ctx.needs_input_grad[3]:
        dbias = torch.zeros((num_groups + 1, dh.shape[1]), dtype=torch.float32, device=dh.device)
        dbias = dbias.index_add(0, groups, dh)[:num_groups].to(bias.dtype)
    return dlhs, drhs, None, dbias, None, None, None, None, None, None, None


gmm_gated_op.register_autograd(_gated_backward, setup_context=_gated_setup_context)


# -------------------------------------------------------------------------------------------------
# Validation
# -------------------------------------------------------------------------------------------------


def _check_tensor(name: str, t, ndim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_group_sizes(group_sizes, num_groups: int, m: int, device) -> torch.Tensor:
    if not isinstance(group_sizes, torch.Tensor):
        raise TypeError(f"group_sizes: expected a torch.Tensor, got {type(group_sizes).__name__}")
    if group_sizes.dim() != 1 or group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes: expected shape ({num_groups},) (one size per group), got "
            f"{tuple(group_sizes.shape)}"
        )
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"group_sizes: expected int32 or int64, got {group_sizes.dtype}")
    if group_sizes.device != device:
        raise ValueError(
            f"group_sizes: on {group_sizes.device}, expected the device of lhs ({device})"
        )
    # Values can only be checked outside tracing (they are data); on CPU this is free.
    if not torch.compiler.is_compiling() and group_sizes.device.type != "meta" and num_groups:
        if bool((group_sizes < 0).any()):
            raise ValueError(
                f"group_sizes: expected non-negative sizes, got {group_sizes.tolist()}"
            )
        total = int(group_sizes.sum())
        if total > m:
            raise ValueError(
                f"group_sizes: sum {total} exceeds the {m} rows of lhs (expected sum <= {m})"
            )
    return group_sizes.to(torch.int32)  # JAX runs without 64-bit integers


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, ...] with zero rows appended up to `rows` (differentiable: the padded rows' gradient
    is dropped)."""
    extra = rows - x.shape[0]
    if extra <= 0:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


def _same_device(device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected the device of lhs ({device})")


# -------------------------------------------------------------------------------------------------
# Public functions
# -------------------------------------------------------------------------------------------------


def gmm(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    scales: Optional[torch.Tensor] = None,
    *,
    transpose_rhs: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    tiling: Optional[dict] = None,
) -> torch.Tensor:
    """Grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g].T with transpose_rhs).

    lhs [M, K] bf16/f32; rhs [G, K, N] (or [G, N, K] with transpose_rhs) of lhs's dtype, or int8 /
    float8_e4m3fn with `scales` [G, N] (per output channel, forward only); group_sizes int32/int64
    [G], non-negative, sum <= M (rows past the sum come out zero). f32 accumulation; the result has
    `out_dtype` (default lhs dtype). `tiling`: optional dict of tm/tk/tn overrides. Differentiable
    in lhs and (unquantised) rhs.
    """
    _check_tensor("lhs", lhs, 2, _FLOAT_DTYPES)
    _check_tensor("rhs", rhs, 3, _FLOAT_DTYPES + _QUANT_DTYPES)
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    rk, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if rk != k:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(
            f"rhs: shape {tuple(rhs.shape)} read as {layout} has K={rk}, expected lhs's K={k}"
        )
    _same_device(lhs.device, rhs=rhs, scales=scales)
    quantised = rhs.dtype in _QUANT_DTYPES
    if quantised:
        if scales is None:
            raise ValueError(f"scales: rhs of dtype {rhs.dtype} needs per-channel scales [G, N]")
        _check_tensor("scales", scales, 2, (torch.float32, torch.bfloat16))
        if tuple(scales.shape) != (num_groups, n):
            raise ValueError(
                f"scales: expected shape ({num_groups}, {n}), got {tuple(scales.shape)}"
            )
        scales = scales.to(torch.float32)
    else:
        if scales is not None:
            raise ValueError(
                f"scales: only int8 / float8_e4m3fn rhs takes scales, rhs is {rhs.dtype}"
            )
        if rhs.dtype != lhs.dtype:
            raise TypeError(f"rhs: dtype {rhs.dtype} must match lhs dtype {lhs.dtype}")
    group_sizes = _check_group_sizes(group_sizes, num_groups, m, lhs.device)
    ov = dict(tiling or {})
    unknown = set(ov) - {"tm", "tk", "tn"}
    if unknown:
        raise ValueError(f"tiling: unknown keys {sorted(unknown)}; expected tm, tk, tn")
    out = gmm_op(
        pad_rows(lhs, bucket_tokens(m)),
        rhs,
        group_sizes,
        scales,
        bool(transpose_rhs),
        _dtype_name(out_dtype),
        int(ov.get("tm", 0)),
        int(ov.get("tk", 0)),
        int(ov.get("tn", 0)),
    )
    return out[:m]


def gmm_gated(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: str = "silu",
    layout: str = "concatenated",
    transpose_rhs: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    tiling: Optional[dict] = None,
) -> torch.Tensor:
    """Gate_up projection with the gated activation fused: act(gate) * up of
    h = lhs[rows of g] @ rhs[g] (+ bias[g]) -> [M, I]; h [M, 2I] is never written to memory.

    rhs [G, K, 2I] (or [G, 2I, K] with transpose_rhs) of lhs's dtype; `layout` "concatenated"
    (gate = the first I columns, up = the last I) or "interleaved" (gate0, up0, gate1, ...);
    `bias` [G, 2I] or None; `activation` one of "silu", "gelu", "gelu_tanh", "gpt_oss_swiglu"
    (GPT-OSS's clamped SwiGLU: alpha 1.702, limit 7, up + 1). Rows past sum(group_sizes) are zero.
    Differentiable in lhs, rhs and bias (the backward recomputes h).
    """
    _check_tensor("lhs", lhs, 2, _FLOAT_DTYPES)
    _check_tensor("rhs", rhs, 3, _FLOAT_DTYPES)
    if activation not in _kernel.ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_kernel.ACTIVATIONS}, got {activation!r}")
    if layout not in _kernel.GATE_LAYOUTS:
        raise ValueError(f"layout: expected one of {_kernel.GATE_LAYOUTS}, got {layout!r}")
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    rk, two_i = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if rk != k:
        lay = "[G, 2I, K]" if transpose_rhs else "[G, K, 2I]"
        raise ValueError(
            f"rhs: shape {tuple(rhs.shape)} read as {lay} has K={rk}, expected lhs's K={k}"
        )
    if two_i % 2:
        raise ValueError(f"rhs: the gate_up dimension {two_i} must be even (gate and up halves)")
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs: dtype {rhs.dtype} must match lhs dtype {lhs.dtype}")
    if bias is not None:
        _check_tensor("bias", bias, 2, _FLOAT_DTYPES)
        if tuple(bias.shape) != (num_groups, two_i):
            raise ValueError(
                f"bias: expected shape ({num_groups}, {two_i}), got {tuple(bias.shape)}"
            )
    _same_device(lhs.device, rhs=rhs, bias=bias)
    group_sizes = _check_group_sizes(group_sizes, num_groups, m, lhs.device)
    ov = dict(tiling or {})
    unknown = set(ov) - {"tm", "tk", "tn"}
    if unknown:
        raise ValueError(f"tiling: unknown keys {sorted(unknown)}; expected tm, tk, tn")
    out = gmm_gated_op(
        pad_rows(lhs, bucket_tokens(m)),
        rhs,
        group_sizes,
        bias,
        activation,
        layout,
        bool(transpose_rhs),
        _dtype_name(out_dtype),
        int(ov.get("tm", 0)),
        int(ov.get("tk", 0)),
        int(ov.get("tn", 0)),
    )
    return out[:m]


def tgmm(
    lhs: torch.Tensor,
    dout: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    out_dtype: Optional[torch.dtype] = None,
    tiling: Optional[dict] = None,
) -> torch.Tensor:
    """Per-group lhs^T @ dout: lhs [M, K], dout [M, N] -> [G, K, N] (the weight gradient of gmm).
    Empty groups give zeros; rows past sum(group_sizes) are ignored."""
    _check_tensor("lhs", lhs, 2, _FLOAT_DTYPES)
    _check_tensor("dout", dout, 2, _FLOAT_DTYPES)
    if dout.shape[0] != lhs.shape[0]:
        raise ValueError(f"dout: expected {lhs.shape[0]} rows (lhs's M), got {dout.shape[0]}")
    if dout.dtype != lhs.dtype:
        raise TypeError(f"dout: dtype {dout.dtype} must match lhs dtype {lhs.dtype}")
    _same_device(lhs.device, dout=dout)
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dim() != 1:
        raise ValueError("group_sizes: expected a 1-D tensor of group sizes")
    group_sizes = _check_group_sizes(group_sizes, group_sizes.shape[0], lhs.shape[0], lhs.device)
    ov = dict(tiling or {})
    unknown = set(ov) - {"tm", "tk", "tn"}
    if unknown:
        raise ValueError(f"tiling: unknown keys {sorted(unknown)}; expected tm, tk, tn")
    rows = bucket_tokens(lhs.shape[0])
    return tgmm_op(
        pad_rows(lhs, rows),
        pad_rows(dout, rows),
        group_sizes,
        _dtype_name(out_dtype),
        int(ov.get("tm", 0)),
        int(ov.get("tk", 0)),
        int(ov.get("tn", 0)),
    )


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    precision=None,
    preferred_element_type: Optional[torch.dtype] = None,
    group_offset=None,
    *,
    scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`jax.lax.ragged_dot` semantics in torch: lhs [M, K], rhs [G, K, N], group_sizes [G] ->
    [M, N], rows past sum(group_sizes) zero. `preferred_element_type` is the output dtype (default
    lhs dtype); int8 / float8_e4m3fn rhs takes per-channel `scales` [G, N]. `precision` is accepted
    for signature compatibility: accumulation is always f32 and f32 operands always multiply at
    HIGHEST precision (bf16 ones exactly); `group_offset` is not supported."""
    if group_offset is not None:
        raise ValueError("group_offset: not supported (expected None)")
    if precision is not None and not isinstance(precision, (str, type(None))):
        raise TypeError(f"precision: expected None or a string, got {type(precision).__name__}")
    return gmm(lhs, rhs, group_sizes, scales, out_dtype=preferred_element_type)
