"""Torch ops for flash attention in the flash-attn 2 calling convention, with autograd.

Two custom ops carry everything: `flash_attention_fwd` -> (out, softmax_lse) and
`flash_attention_bwd` -> (dq, dk, dv, dsinks). Dense tensors are [B, S, H, D]; varlen tensors are
packed [T, H, D] with cu_seqlens. Inputs are validated here, before any kernel runs.

Shape buckets (shape_buckets.py). Varlen calls pad the packed query and key tokens up to their
token buckets and the number of sequences up to its count bucket: padded tokens lie past
cu_seqlens[-1] and belong to no sequence (the work list never visits them; their rows are cut
off), padded sequences repeat the last offset and so have no tokens. Dense calls whose lengths are
token buckets and whose batch is a power of two run as they are; any other dense call is packed
into the varlen form (a reshape: sequence b owns tokens b*Sq .. (b+1)*Sq, with the same
bottom-right alignment) and bucketed the same way. So a new length or batch compiles only in a new
bucket. Gradients of padded rows are dropped by the slicing.

What stays a compile key: causal, the window sizes, softcap and the softmax scale (they shape the
mask band and are folded into the kernel: fixed per model, two or three values per model at most,
e.g. sliding and global layers), whether sinks are given, head counts, head dim and dtype.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import torch

from . import kernel
from ._ops import add_op_namespace_prefix
from .jax_bridge import jax_op, pallas_interpret
from .shape_buckets import bucket_count, bucket_policy, bucket_tokens

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "warmup"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256


# -------------------------------------------------------------------------------------------------
# The ops (JAX bodies)
# -------------------------------------------------------------------------------------------------


def _fwd_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: Optional[jax.Array],
    cu_seqlens_q: Optional[jax.Array],
    cu_seqlens_k: Optional[jax.Array],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    softmax_scale: float,
) -> tuple[jax.Array, jax.Array]:
    varlen = cu_seqlens_q is not None
    if not varlen:  # [B, S, H, D] -> the kernel's [B, H, S, D]
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    o, lse = kernel.flash_attention_fwd(
        q,
        k,
        v,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=softcap,
        softmax_scale=softmax_scale,
        sinks=sinks,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        interpret=pallas_interpret(),
    )
    if varlen:
        return o, lse[0]
    return jnp.swapaxes(o, 1, 2), lse


def _bwd_jax(
    do: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    o: jax.Array,
    lse: jax.Array,
    sinks: Optional[jax.Array],
    cu_seqlens_q: Optional[jax.Array],
    cu_seqlens_k: Optional[jax.Array],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    softmax_scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    varlen = cu_seqlens_q is not None
    if varlen:
        lse = lse[None]
    else:
        q, k, v, o, do = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, o, do))
    dq, dk, dv, dsinks = kernel.flash_attention_bwd(
        q,
        k,
        v,
        o,
        lse,
        do,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=softcap,
        softmax_scale=softmax_scale,
        sinks=sinks,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        interpret=pallas_interpret(),
    )
    if not varlen:
        dq, dk, dv = (jnp.swapaxes(x, 1, 2) for x in (dq, dk, dv))
    if dsinks is None:
        dsinks = jnp.zeros((q.shape[-2] if varlen else q.shape[1],), jnp.float32)
    return dq, dk, dv, dsinks


def _fwd_fake(
    q,
    k,
    v,
    sinks,
    cu_seqlens_q,
    cu_seqlens_k,
    causal,
    window_left,
    window_right,
    softcap,
    softmax_scale,
):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse


def _bwd_fake(
    do,
    q,
    k,
    v,
    o,
    lse,
    sinks,
    cu_seqlens_q,
    cu_seqlens_k,
    causal,
    window_left,
    window_right,
    softcap,
    softmax_scale,
):
    hq = q.shape[-2]
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        q.new_empty((hq,), dtype=torch.float32),
    )


fwd_op = jax_op(add_op_namespace_prefix("flash_attention_fwd"), _fwd_jax, fake=_fwd_fake)
bwd_op = jax_op(add_op_namespace_prefix("flash_attention_bwd"), _bwd_jax, fake=_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_q, cu_k, causal, wl, wr, softcap, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks, cu_q, cu_k)
    ctx.config = (causal, wl, wr, softcap, scale)
    ctx.has_sinks = sinks is not None


def _backward(ctx, do, dlse):
    q, k, v, o, lse, sinks, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv, dsinks = bwd_op(do.contiguous(), q, k, v, o, lse, sinks, cu_q, cu_k, *ctx.config)
    return (
        dq,
        dk,
        dv,
        dsinks.to(sinks.dtype) if ctx.has_sinks else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


fwd_op.register_autograd(_backward, setup_context=_setup_context)


# -------------------------------------------------------------------------------------------------
# Validation (before any kernel runs)
# -------------------------------------------------------------------------------------------------


def _check_tensors(q, k, v, ndim, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: q has {d}, k has {k.shape[-1]}")
    if d % 8 or d > MAX_HEAD_DIM or d == 0:
        raise ValueError(f"head dim must be a multiple of 8 and at most {MAX_HEAD_DIM}, got {d}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")


def _check_options(dropout_p, window_size, softcap, alibi_slopes, softmax_scale, s_aux, hq):
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: attention dropout is not implemented in the TPU kernel; pass 0.0"
        )
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported by flash-attention-tpu")
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size must be a pair (left, right) of ints, got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    softcap = float(softcap or 0.0)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    if softmax_scale is not None and not float(softmax_scale) > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (hq,):
            raise ValueError(
                f"s_aux (attention sinks) must be a tensor of shape ({hq},), got "
                f"{getattr(s_aux, 'shape', type(s_aux))}"
            )
        if not s_aux.is_floating_point():
            raise TypeError(f"s_aux must be floating point, got {s_aux.dtype}")
    return left, right, softcap


def _check_cu_seqlens(name, cu, total, n_seq=None):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D tensor [num_seqs + 1], got {getattr(cu, 'shape', type(cu))}"
        )
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}")
    if n_seq is not None and cu.numel() != n_seq:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length, got {n_seq} and {cu.numel()}"
        )
    if torch.compiler.is_compiling():  # values are data-dependent inside a compiled graph
        return
    c = cu.detach().cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {c.tolist()}")
    if int(c[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(c[-1])} must equal the packed length {total}")


def _scale(softmax_scale, d):
    return float(softmax_scale) if softmax_scale is not None else d**-0.5


# -------------------------------------------------------------------------------------------------
# Public functions (flash-attn 2 convention)
# -------------------------------------------------------------------------------------------------


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, Hq, D] (and softmax_lse [B, Hq, Sq],
    None with return_attn_probs). Causal is bottom-right aligned; `window_size` = (left, right);
    `s_aux` are per-head attention-sink logits [Hq]. Backward computes dq, dk, dv (and ds_aux)."""
    _check_tensors(q, k, v, 4, "[batch, seqlen, heads, head_dim]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    left, right, softcap = _check_options(
        dropout_p, window_size, softcap, alibi_slopes, softmax_scale, s_aux, q.shape[2]
    )
    scale = _scale(softmax_scale, q.shape[-1])
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if not bucket_policy().enabled or (
        sq == bucket_tokens(sq) and sk == bucket_tokens(sk) and b & (b - 1) == 0
    ):
        out, lse = fwd_op(q, k, v, s_aux, None, None, bool(causal), left, right, softcap, scale)
    else:
        # Pack into the varlen form: sequence i owns tokens i*sq .. (i+1)*sq (and i*sk .. for
        # keys); the kernel's per-sequence bottom-right alignment is the dense one.
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sq
        cu_k = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sk
        out, lse = _varlen_bucketed(
            q.reshape(b * sq, hq, d),
            k.reshape(b * sk, *k.shape[2:]),
            v.reshape(b * sk, *v.shape[2:]),
            s_aux,
            cu_q,
            cu_k,
            bool(causal),
            left,
            right,
            softcap,
            scale,
        )
        out = out.reshape(b, sq, hq, d)
        lse = lse.reshape(hq, b, sq).transpose(0, 1)
    return (out, lse, None) if return_attn_probs else out


def _pad_offsets(cu: torch.Tensor, entries: int) -> torch.Tensor:
    """cu [n + 1] extended to `entries` by repeating its last offset (empty sequences)."""
    extra = entries - cu.shape[0]
    if extra <= 0:
        return cu
    return torch.cat([cu, cu[-1:].expand(extra)])


def _pad_tokens(x: torch.Tensor, tokens: int) -> torch.Tensor:
    extra = tokens - x.shape[0]
    if extra <= 0:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, extra))


def _varlen_bucketed(q, k, v, s_aux, cu_q, cu_k, causal, left, right, softcap, scale):
    """The varlen op at bucketed sizes; returns out [Tq, Hq, D] and lse [Hq, Tq] of the caller's
    tokens. Padded tokens lie past cu[-1]: no sequence owns them."""
    tq, tk = q.shape[0], k.shape[0]
    tq_pad, tk_pad = bucket_tokens(tq), bucket_tokens(tk)
    entries = bucket_count(cu_q.shape[0] - 1) + 1
    out, lse = fwd_op(
        _pad_tokens(q, tq_pad),
        _pad_tokens(k, tk_pad),
        _pad_tokens(v, tk_pad),
        s_aux,
        _pad_offsets(cu_q, entries),
        _pad_offsets(cu_k, entries),
        causal,
        left,
        right,
        softcap,
        scale,
    )
    return out[:tq], lse[:, :tq]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    s_aux=None,
):
    """Packed q [Tq, Hq, D], k/v [Tk, Hkv, D] with cu_seqlens_q/k [num_seqs + 1] -> out [Tq, Hq, D]
    (and softmax_lse [Hq, Tq], None with return_attn_probs). Sequences never see each other; causal
    is bottom-right aligned per sequence. max_seqlen_* are accepted for compatibility and ignored
    (never a compile key: the kernel sizes its work list from the bucketed totals)."""
    if block_table is not None:
        raise NotImplementedError(
            "block_table (paged KV) is not supported here; use paged-attention-tpu"
        )
    _check_tensors(q, k, v, 3, "[total_tokens, heads, head_dim]")
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], n_seq=cu_seqlens_q.numel())
    left, right, softcap = _check_options(
        dropout_p, window_size, softcap, alibi_slopes, softmax_scale, s_aux, q.shape[1]
    )
    # JAX runs without 64-bit integers.
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    out, lse = _varlen_bucketed(
        q,
        k,
        v,
        s_aux,
        cu_q,
        cu_k,
        bool(causal),
        left,
        right,
        softcap,
        _scale(softmax_scale, q.shape[-1]),
    )
    return (out, lse, None) if return_attn_probs else out


def warmup(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_tokens: int,
    max_seqs: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    causal: bool = True,
    window_size=(-1, -1),
    softcap: float = 0.0,
    softmax_scale=None,
    sinks: bool = False,
    backward: bool = False,
    dense: bool = True,
    dense_batches=(1,),
    device="cpu",
) -> int:
    """Compile, before serving, every kernel these calls can need, with this model's attention
    settings (queries and keys of equal length: self-attention prefill):

    - `flash_attn_varlen_func` with up to `max_tokens` packed tokens in up to `max_seqs`
      sequences: one kernel per (token bucket, sequence-count bucket) pair;
    - with `dense=True`, `flash_attn_func` at every batch size in `dense_batches` (default: 1,
      one prompt), each sequence 1..`max_tokens` long. Such a call runs the dense kernel of
      [batch, length] when the batch is a power of two and the length a token bucket, and is
      otherwise packed into the varlen form (batch x length tokens in `batch` sequences), so this
      compiles exactly the dense kernels and the varlen (bucket of batch x length, bucket of
      batch) kernels those calls hit, for every length up to `max_tokens`.

    Each distinct kernel is compiled once (a kernel two of these call kinds share is not compiled
    twice). `backward=True` compiles the backward kernels too. Returns the number of calls made,
    the number of distinct forward kernels."""
    from .shape_buckets import count_buckets, token_buckets

    batches = tuple(dense_batches) if dense else ()
    for b in batches:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"dense_batches: expected positive ints, got {dense_batches!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive int, got {max_tokens!r}")
    # The kernels, as flash_attn_func / flash_attn_varlen_func will key them: dense (batch,
    # length) and varlen (padded tokens, sequence slots).
    dense_kernels: set = set()
    varlen_kernels = {
        (tokens, seqs)
        for tokens in token_buckets(max_tokens)
        for seqs in count_buckets(min(max_seqs, tokens))
    }
    policy = bucket_policy()
    for b in batches:
        for length in range(1, max_tokens + 1):
            if not policy.enabled or (bucket_tokens(length) == length and b & (b - 1) == 0):
                dense_kernels.add((b, length))
            else:
                varlen_kernels.add((bucket_tokens(b * length), bucket_count(b)))

    def zeros(*shape):
        return torch.zeros(*shape, dtype=dtype, device=device, requires_grad=backward)

    def sink_logits():
        return torch.zeros(num_heads, dtype=torch.float32, device=device) if sinks else None

    for b, length in sorted(dense_kernels):
        k = zeros(b, length, num_kv_heads, head_dim)
        out = flash_attn_func(
            zeros(b, length, num_heads, head_dim),
            k,
            torch.zeros_like(k, requires_grad=backward),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            s_aux=sink_logits(),
        )
        if backward:
            out.sum().backward()
    for tokens, seqs in sorted(varlen_kernels):
        k = zeros(tokens, num_kv_heads, head_dim)
        # All tokens in the first sequence, the other sequence slots empty: the shapes (and so
        # the compiled kernels) are those of any batch in these buckets.
        cu = torch.full((seqs + 1,), tokens, dtype=torch.int32, device=device)
        cu[0] = 0
        out = flash_attn_varlen_func(
            zeros(tokens, num_heads, head_dim),
            k,
            torch.zeros_like(k, requires_grad=backward),
            cu,
            cu,
            tokens,
            tokens,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            s_aux=sink_logits(),
        )
        if backward:
            out.sum().backward()
    return len(dense_kernels) + len(varlen_kernels)
