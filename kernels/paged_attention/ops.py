"""Torch ops of the paged attention kernel: ragged_paged_attention, flash_attn_with_kvcache,
flash_attn_varlen_func.

Every public function validates its inputs on the host (shapes, dtypes, index ranges: one
device-to-host copy of the small index tensors) before any kernel runs, so bad input raises a
ValueError/TypeError instead of reading out of bounds. `validate=False` skips the data checks
(shape checks stay), e.g. under torch.compile or when the caller guarantees the tables.

KV-cache writes. The bridge's ops never mutate their inputs, so the new tokens' K/V are written
into the torch cache tensor in place by the torch function itself (`index_put_` on exactly the new
tokens' slots, before the attention op reads the cache); the attention op only reads the cache.
On TPU that write is one torch scatter of T x 2*Hkv x D elements. JAX callers of the token-major
kernel pass new_k / new_v to `kernel.paged_attention_token_major`, where a Pallas kernel writes each
token's [Hkv, D] row with one DMA into the donated caches (input_output_aliases, in place, no
cache-sized temporary at any chunk size); the torch bridge ops cannot mutate their inputs, so the
torch functions keep the scatter. (Head-major JAX callers: `kernel.write_kv`.)

Cache layouts. `ragged_paged_attention` uses the head-major cache [num_pages, 2 * kv_heads,
page_size, head_dim] (K of head h at index 2h, V at 2h+1). `flash_attn_with_kvcache` takes
flash-attn's (and Transformers' and vLLM's) token-major caches [num_blocks, block_size, kv_heads,
head_dim] and the kernel reads them in place (kernel.paged_attention_token_major: no relayout, no
copy; contiguous caches, or contiguous views at an offset such as Transformers' per-layer page
views, cross to JAX by dlpack without a copy). Only float16 caches and bfloat16 caches with an
odd number (> 1) of KV heads still get a head-major copy per call.
`flash_attn_varlen_func` scatters the packed K/V into 16-token pages on every call (one copy of K/V).

Quantised caches. `flash_attn_with_kvcache` and `ragged_paged_attention(kv_layout="token_major")`
take int8 / float8_e4m3fn token-major caches with bfloat16 q: per-token-per-head scales
[num_blocks, Hkv, block_size] (k_scale / v_scale) and / or per-head scales [Hkv]
(k_head_scale / v_head_scale), dequantised in the kernel. New K/V are quantised here (absmax per
token and head) and written like a bf16 cache's. float8 caches cross to JAX as their uint8 bytes
(a zero-copy torch view) and the kernel reads uint8 pages as e4m3: the bridge's own float8
conversion (`to_jax`: dlpack of the bytes, then an eager `bitcast_convert_type`) is a separate
XLA computation that writes a new buffer, i.e. a full copy of the cache per call, and the same
bitcast inside the jitted body compiles to a cache-sized copy on TPU (deviceless compile).
No autograd: these are inference kernels (backward raises).

Shape buckets (shape_buckets.py). Every public function pads what varies between calls before the
op runs: query tokens (and, for the varlen function, the packed keys) up to their token bucket,
the number of sequences (page-table rows, kv_lens, cu_q_lens) and the page-table columns up to
their count bucket. Padded query rows lie past cu_q_lens[num_seqs] and padded sequences past the
live num_seqs (or, in the varlen function, have no tokens and no keys): the kernel never visits
them, their output rows are cut off, and padded page-table entries (page 0) are never read. The
number of live sequences, their lengths and positions are data (num_seqs, cu_q_lens, kv_lens),
never compile keys. The caches keep their own shape (a server allocates them once).
What stays a compile key: causal, sliding_window, softcap and the softmax scale (fixed per model,
folded into the kernel), head counts, head dim, page size, dtype and the cache's shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import torch

from . import kernel
from ._ops import add_op_namespace_prefix
from .jax_bridge import jax_op, pallas_interpret
from .shape_buckets import bucket_count, bucket_tokens
from .work_list import searchsorted

VARLEN_PAGE_SIZE = 16
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -------------------------------------------------------------------------------------------------
# JAX op bodies
# -------------------------------------------------------------------------------------------------


def _rpa_jax(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    v_cache: Optional[jax.Array] = None,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    causal: bool = True,
) -> jax.Array:
    return kernel.ragged_paged_attention(
        q,
        kv_cache,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        v_pages=v_cache,
        sm_scale=softmax_scale,
        sliding_window=sliding_window,
        soft_cap=softcap,
        causal=causal,
        interpret=pallas_interpret(),
    )


def _rpa_fake(
    q,
    kv_cache,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    v_cache=None,
    softmax_scale=None,
    sliding_window=None,
    softcap=None,
    causal=True,
):
    return torch.empty_like(q)


rpa_op = jax_op(add_op_namespace_prefix("ragged_paged_attention"), _rpa_jax, fake=_rpa_fake)


def _varlen_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    causal: bool = False,
    page_size: int = VARLEN_PAGE_SIZE,
) -> jax.Array:
    """Packed K/V -> head-major pages (sequence s's keys start on a fresh page), then the kernel."""
    tk, hkv, d = k.shape
    S = cu_seqlens_q.shape[0] - 1
    kv_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    pages_of = (kv_lens + page_size - 1) // page_size
    first_page = jnp.cumsum(pages_of) - pages_of
    pages_per_seq = max(1, -(-tk // page_size))
    num_pages = pages_per_seq + S
    page_table = jnp.minimum(
        first_page[:, None] + jnp.arange(pages_per_seq)[None, :], num_pages - 1
    )
    j = jnp.arange(tk)
    seq = jnp.clip(searchsorted(cu_seqlens_k, j, side="right", xp=jnp) - 1, 0, S - 1)
    r = j - cu_seqlens_k[seq]
    page, row = first_page[seq] + r // page_size, r % page_size
    kv = jnp.stack([k, v], axis=2).reshape(tk, 2 * hkv, d)
    # Rows past cu_seqlens_k[-1] (padding) land after their sequence's keys or past the cache
    # (dropped), never on a valid key.
    cache = (
        jnp.zeros((num_pages, 2 * hkv, page_size, d), k.dtype)
        .at[page, :, row, :]
        .set(kv, mode="drop")
    )
    return kernel.ragged_paged_attention(
        q,
        cache,
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        cu_seqlens_q.astype(jnp.int32),
        jnp.full((1,), S, jnp.int32),
        sm_scale=softmax_scale,
        sliding_window=sliding_window,
        soft_cap=softcap,
        causal=causal,
        interpret=pallas_interpret(),
    )


def _varlen_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale=None,
    sliding_window=None,
    softcap=None,
    causal=False,
    page_size=VARLEN_PAGE_SIZE,
):
    return torch.empty_like(q)


varlen_op = jax_op(
    add_op_namespace_prefix("paged_varlen_attention"), _varlen_jax, fake=_varlen_fake
)


def _kvcache_jax(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    causal: bool = False,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
    k_head_scale: Optional[jax.Array] = None,
    v_head_scale: Optional[jax.Array] = None,
) -> jax.Array:
    """flash-attn caches: packed q [T, H, D] (sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1],
    the first num_seqs sequences are live), caches [nb, bs, Hkv, D] -> out [T, H, D]. The kernel
    reads the token-major caches in place; only float16 caches, bfloat16 ones with an odd number
    (> 1) of KV heads (its strided word reads cannot unpack them), or blocks whose
    block_size * kv_heads rows do not fill whole sublane tiles take a head-major copy.

    Quantised caches (int8, or float8_e4m3fn arriving as their uint8 bytes, which the kernel
    reads as e4m3: the bridge's eager float8 conversion, and even a bitcast of the whole
    cache inside this jitted body on TPU, would copy the cache) are dequantised in the kernel with
    the per-token scales k_scale / v_scale [nb, Hkv, bs] and / or the per-head scales
    k_head_scale / v_head_scale [Hkv]."""
    hkv = k_cache.shape[2]
    args = (
        kv_lens.astype(jnp.int32),
        block_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32).reshape(1),
    )
    kw = dict(
        sm_scale=softmax_scale,
        sliding_window=sliding_window,
        soft_cap=softcap,
        causal=causal,
        interpret=pallas_interpret(),
    )
    if jnp.dtype(k_cache.dtype).itemsize == 1:
        return kernel.paged_attention_token_major(
            q,
            k_cache,
            v_cache,
            *args,
            k_scale=k_scale,
            v_scale=v_scale,
            k_head_scale=k_head_scale,
            v_head_scale=v_head_scale,
            **kw,
        )
    if kernel.token_major_supported(k_cache.dtype, hkv, k_cache.shape[1]):
        return kernel.paged_attention_token_major(q, k_cache, v_cache, *args, **kw)
    return kernel.ragged_paged_attention(
        q, k_cache.transpose(0, 2, 1, 3), *args, v_pages=v_cache.transpose(0, 2, 1, 3), **kw
    )


def _kvcache_fake(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_table,
    cu_q_lens,
    num_seqs,
    softmax_scale=None,
    sliding_window=None,
    softcap=None,
    causal=False,
    k_scale=None,
    v_scale=None,
    k_head_scale=None,
    v_head_scale=None,
):
    return torch.empty_like(q)


kvcache_op = jax_op(
    add_op_namespace_prefix("paged_flash_attn_with_kvcache"), _kvcache_jax, fake=_kvcache_fake
)


def _no_backward(ctx, grad):
    raise NotImplementedError("paged attention ops are inference-only: no backward pass")


def _setup_context(ctx, inputs, output):
    pass


for _op in (rpa_op, varlen_op, kvcache_op):
    _op.register_autograd(_no_backward, setup_context=_setup_context)


# -------------------------------------------------------------------------------------------------
# Validation
# -------------------------------------------------------------------------------------------------


def _check_tensor(name, t, ndim=None, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


_INT_DTYPES = (torch.int32, torch.int64)
_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_CACHE_DTYPES = _FLOAT_DTYPES + _QUANT_DTYPES
# Largest magnitude of each 8-bit format: a new token's per-token scale maps its absmax onto it.
_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def validate_quant(
    q, k_cache, v_cache, k_scale, v_scale, k_head_scale, v_head_scale, *, cache_name="k_cache"
):
    """Checks of a quantised token-major cache pair [num_blocks, block_size, Hkv, D] and its scales
    (ValueError/TypeError naming the argument). Returns the per-head scales as float32 tensors
    [Hkv] (a Python float becomes one value per head), or (None, None)."""
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache: dtype {v_cache.dtype} differs from {cache_name}'s {k_cache.dtype}"
        )
    scales = dict(
        k_scale=k_scale, v_scale=v_scale, k_head_scale=k_head_scale, v_head_scale=v_head_scale
    )
    if k_cache.dtype not in _QUANT_DTYPES:
        for name, val in scales.items():
            if val is not None:
                raise ValueError(
                    f"{name}: scales need an int8 or float8_e4m3fn cache, got {k_cache.dtype}"
                )
        return None, None
    if q.dtype != torch.bfloat16:
        raise TypeError(
            f"q: 8-bit caches take bfloat16 queries (the output is bfloat16), got {q.dtype}"
        )
    nb, bs, hkv, _ = k_cache.shape
    if hkv % 4 or (bs * hkv) % 32:
        raise ValueError(
            f"{cache_name}: 8-bit pages need a multiple of 4 KV heads (four heads per 32-bit "
            f"word) and block_size * kv_heads a multiple of 32 (the 8-bit sublane tile), got "
            f"block_size {bs} and {hkv} KV heads"
        )
    for a, b in (("k_scale", "v_scale"), ("k_head_scale", "v_head_scale")):
        if (scales[a] is None) != (scales[b] is None):
            raise ValueError(f"{a} / {b}: pass both or neither")
    if k_scale is not None:
        for name in ("k_scale", "v_scale"):
            _check_tensor(name, scales[name], 3, (torch.float32,))
            if tuple(scales[name].shape) != (nb, hkv, bs):
                raise ValueError(
                    f"{name}: expected shape {(nb, hkv, bs)} [num_blocks, kv_heads, "
                    f"block_size], got {tuple(scales[name].shape)}"
                )
        if bs % 128:
            raise ValueError(
                f"k_scale: per-token scales need block_size a multiple of 128 (a page's scales "
                f"are one lane-aligned row per head), got {bs}; use per-head scales"
            )
    heads = []
    for name in ("k_head_scale", "v_head_scale"):
        hs = scales[name]
        if hs is None:
            heads.append(None)
            continue
        if isinstance(hs, (int, float)) and not isinstance(hs, bool):
            hs = torch.full((hkv,), float(hs), dtype=torch.float32, device=k_cache.device)
        _check_tensor(name, hs, 1, (torch.float32,))
        if hs.shape[0] != hkv:
            raise ValueError(f"{name}: expected {hkv} values (one per KV head), got {hs.shape[0]}")
        host = hs.detach().to("cpu")
        if not bool((torch.isfinite(host) & (host > 0)).all()):
            raise ValueError(f"{name}: expected finite positive scales, got {host.tolist()}")
        heads.append(hs)
    return heads[0], heads[1]


def quantise(x: torch.Tensor, dtype: torch.dtype, head_scale=None, token_scales: bool = False):
    """x [N, Hkv, D] (float) -> (values [N, Hkv, D] in the 8-bit `dtype`, per-token-per-head scales
    [N, Hkv] float32 or None) with values * scale * head_scale ~= x: symmetric absmax scaling per
    token and head, round to nearest (int8: clipped to +-127; e4m3: to +-448)."""
    x = x.float()
    if head_scale is not None:
        x = x / head_scale.to(x.device)[None, :, None]
    qmax = _QUANT_MAX[dtype]
    scale = None
    if token_scales:
        amax = x.abs().amax(-1)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        x = x / scale[..., None]
    x = x.clamp(-qmax, qmax)
    if dtype == torch.int8:
        x = x.round()
    return x.to(dtype), scale


def _write_token_major(cache, scale_cache, new, head_scale, page, row):
    """cache[page[i], row[i]] = new[i] (token-major [nb, bs, Hkv, D], in place), quantised first
    for an 8-bit cache (its per-token scales into scale_cache[page[i], :, row[i]])."""
    if cache.dtype not in _QUANT_DTYPES:
        cache[page, row] = new.to(cache.dtype)
        return
    values, scale = quantise(new, cache.dtype, head_scale, scale_cache is not None)
    # Through uint8 views: index_put has no float8 kernel on every device.
    cache.view(torch.uint8)[page, row] = values.view(torch.uint8)
    if scale_cache is not None:
        scale_cache[page, :, row] = scale


def _check_options(softmax_scale, sliding_window, softcap):
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
    ):
        raise ValueError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(
            f"sliding_window: expected a positive int (keys p-w+1..p), got {sliding_window!r}"
        )
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap: expected a positive float or None, got {softcap!r}")


def validate_ragged(
    q,
    kv_cache,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    v_cache=None,
    new_kv=None,
    check_data=True,
    token_major=False,
):
    """Raise ValueError/TypeError for anything the kernel could not run safely. Returns num_seqs
    as an int (host), or None without check_data. Token-major caches are checked through their
    head-major views (`permute(0, 2, 1, 3)`, `token_major=True`); only they may be 8-bit (their
    scales: `validate_quant`)."""
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("kv_cache", kv_cache, 4, _CACHE_DTYPES if token_major else _FLOAT_DTYPES)
    _check_tensor("kv_lens", kv_lens, 1, _INT_DTYPES)
    _check_tensor("page_table", page_table, 2, _INT_DTYPES)
    _check_tensor("cu_q_lens", cu_q_lens, 1, _INT_DTYPES)
    _check_tensor("num_seqs", num_seqs, None, _INT_DTYPES)
    if num_seqs.numel() != 1:
        raise ValueError(
            f"num_seqs: expected a 1-element int tensor, got shape {tuple(num_seqs.shape)}"
        )
    T, hq, d = q.shape
    num_pages, c, page_size, dc = kv_cache.shape
    if kv_cache.dtype != q.dtype and kv_cache.dtype not in _QUANT_DTYPES:
        raise TypeError(f"kv_cache: dtype {kv_cache.dtype} differs from q's {q.dtype}")
    if dc != d:
        raise ValueError(f"kv_cache: head_dim {dc} differs from q's head_dim {d}")
    if v_cache is None:
        if c % 2:
            raise ValueError(
                f"kv_cache: dim 1 holds K and V of each KV head (2 * kv_heads), got {c}"
            )
        hkv = c // 2
    else:
        _check_tensor("v_cache", v_cache, 4, _CACHE_DTYPES if token_major else _FLOAT_DTYPES)
        if v_cache.shape != kv_cache.shape or v_cache.dtype != kv_cache.dtype:
            raise ValueError(
                f"v_cache: expected shape {tuple(kv_cache.shape)} and dtype "
                f"{kv_cache.dtype}, got {tuple(v_cache.shape)} {v_cache.dtype}"
            )
        hkv = c
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} KV heads")
    if page_size % 8:
        raise ValueError(
            f"kv_cache: page_size {page_size} must be a multiple of 8 (TPU sublane tile)"
        )
    S, P = page_table.shape
    if kv_lens.shape[0] != S:
        raise ValueError(f"kv_lens: expected {S} entries (page_table rows), got {kv_lens.shape[0]}")
    if cu_q_lens.shape[0] != S + 1:
        raise ValueError(
            f"cu_q_lens: expected {S + 1} entries (page_table rows + 1), got {cu_q_lens.shape[0]}"
        )
    if new_kv is not None:
        _check_tensor("new_kv", new_kv, 3, _FLOAT_DTYPES)
        if token_major:
            if tuple(new_kv.shape) != (T, 2 * hkv, d):
                raise ValueError(
                    f"new_kv: expected shape {(T, 2 * hkv, d)} (K of KV head h at 2h, V at "
                    f"2h + 1), got {tuple(new_kv.shape)}"
                )
        elif tuple(new_kv.shape) != (T, c, d) or v_cache is not None:
            raise ValueError(
                f"new_kv: expected shape {(T, c, d)} (K/V interleaved like kv_cache) with "
                f"a combined cache, got {tuple(new_kv.shape)}"
            )
    if not check_data:
        return None
    n = int(num_seqs.reshape(-1)[0].item())
    if not 0 <= n <= S:
        raise ValueError(f"num_seqs: {n} is outside [0, {S}] (page_table rows)")
    cu = cu_q_lens.detach().to("cpu", torch.int64)[: n + 1]
    kl = kv_lens.detach().to("cpu", torch.int64)[:n]
    if int(cu[0]) != 0:
        raise ValueError(f"cu_q_lens[0] must be 0, got {int(cu[0])}")
    ql = cu[1:] - cu[:-1]
    if bool((ql < 0).any()):
        bad = int(torch.nonzero(ql < 0)[0])
        raise ValueError(f"cu_q_lens is not increasing at sequence {bad}: {cu.tolist()}")
    if int(cu[-1]) > T:
        raise ValueError(f"cu_q_lens[num_seqs] = {int(cu[-1])} exceeds the {T} query tokens of q")
    if bool((kl < ql).any()):
        bad = int(torch.nonzero(kl < ql)[0])
        raise ValueError(
            f"sequence {bad}: {int(ql[bad])} query tokens but kv_lens = {int(kl[bad])} "
            "(kv_lens counts the new tokens too)"
        )
    if bool((kl > P * page_size).any()):
        bad = int(torch.nonzero(kl > P * page_size)[0])
        raise ValueError(
            f"sequence {bad}: kv_lens = {int(kl[bad])} exceeds the {P} pages x "
            f"{page_size} tokens its page_table row can address"
        )
    pt = page_table.detach().to("cpu", torch.int64)[:n]
    used = torch.arange(P)[None, :] < ((kl + page_size - 1) // page_size)[:, None]
    bad_entries = used & ((pt < 0) | (pt >= num_pages))
    if bool(bad_entries.any()):
        s, i = (int(x) for x in torch.nonzero(bad_entries)[0])
        raise ValueError(
            f"page_table[{s}, {i}] = {int(pt[s, i])} is outside [0, {num_pages}) (cache pages)"
        )
    return n


def _i32(t):
    return t.to(torch.int32) if t.dtype != torch.int32 else t


# -------------------------------------------------------------------------------------------------
# Public torch functions
# -------------------------------------------------------------------------------------------------


def ragged_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: torch.Tensor | int,
    *,
    new_kv: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
    validate: bool = True,
    kv_layout: str = "head_major",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_head_scale: torch.Tensor | float | None = None,
    v_head_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Ragged paged attention over a batch of sequences (decode, prefill chunks, or both).

    ragged_paged_attention(q, kv_cache, kv_lens, page_table, cu_q_lens, num_seqs, *,
                           new_kv=None, v_cache=None, softmax_scale=None, sliding_window=None,
                           softcap=None, causal=True, validate=True, kv_layout="head_major",
                           k_scale=None, v_scale=None, k_head_scale=None,
                           v_head_scale=None) -> out

    q          [T, Hq, D] float32/bfloat16/float16: the new tokens of all sequences, packed.
    kv_cache   [num_pages, 2 * Hkv, page_size, D], same dtype as q: head-major pages, K of KV head
               h at index 2h and its V at 2h+1. With `v_cache` given: K pages [num_pages, Hkv,
               page_size, D] and V pages of the same shape.
    kv_lens    [S] int32/int64: keys of each sequence, the new tokens included.
    page_table [S, pages_per_seq] int32/int64: page i of sequence s is kv_cache[page_table[s, i]].
    cu_q_lens  [S + 1]: sequence s owns q tokens cu_q_lens[s]:cu_q_lens[s+1]; they are the last
               q_len of its kv_lens positions (causal masking aligned to the sequence's end).
    num_seqs   [1] int tensor (or int): only the first num_seqs of the S slots are live, so one
               compiled kernel serves batches of any size up to S.
    new_kv     [T, 2 * Hkv, D] or None: K/V of the new tokens, written into kv_cache in place at
               their positions before attention (only those slots change).
    softmax_scale defaults to D ** -0.5; sliding_window w lets a query at position p see keys
    p-w+1..p; softcap c maps scores to c * tanh(s / c).
    kv_layout="token_major": kv_cache is the K cache [num_pages, page_size, Hkv, D] and v_cache
               (required) the V cache of the same shape (flash-attn's / vLLM's layout, read in
               place); new_kv [T, 2 * Hkv, D] keeps K of head h at 2h and V at 2h + 1.
    Quantised caches (token-major only): int8 or float8_e4m3fn kv_cache / v_cache with bfloat16
               q, dequantised in the kernel as value * k_scale[page, h, row] * k_head_scale[h]:
               k_scale / v_scale [num_pages, Hkv, page_size] float32 per-token-per-head scales
               (page_size a multiple of 128), k_head_scale / v_head_scale [Hkv] float32 (or one
               float) per-head static scales; either or both. new_kv (float) is quantised per
               token and head (absmax; with per-token scales its scales are written to
               k_scale / v_scale) and written in place like a bf16 cache's.
    Returns out [T, Hq, D] in q's dtype; rows of tokens beyond cu_q_lens[num_seqs] are zero.
    """
    if isinstance(num_seqs, int):
        num_seqs = torch.tensor([num_seqs], dtype=torch.int32, device=kv_lens.device)
    _check_options(softmax_scale, sliding_window, softcap)
    if kv_layout not in ("head_major", "token_major"):
        raise ValueError(f"kv_layout: expected 'head_major' or 'token_major', got {kv_layout!r}")
    token_major = kv_layout == "token_major"
    if token_major:
        if v_cache is None:
            raise ValueError("v_cache: required with kv_layout='token_major' (separate K/V caches)")
        _check_tensor("kv_cache", kv_cache, 4, _CACHE_DTYPES)
        _check_tensor("v_cache", v_cache, 4, _CACHE_DTYPES)
        if v_cache.shape != kv_cache.shape:
            raise ValueError(
                f"v_cache: shape {tuple(v_cache.shape)} differs from kv_cache's "
                f"{tuple(kv_cache.shape)}"
            )
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    k_head, v_head = None, None
    if token_major:
        k_head, v_head = validate_quant(
            q,
            kv_cache,
            v_cache,
            k_scale,
            v_scale,
            k_head_scale,
            v_head_scale,
            cache_name="kv_cache",
        )
    else:
        for name, val in (
            ("k_scale", k_scale),
            ("v_scale", v_scale),
            ("k_head_scale", k_head_scale),
            ("v_head_scale", v_head_scale),
        ):
            if val is not None:
                raise ValueError(f"{name}: quantised caches need kv_layout='token_major'")
    n = validate_ragged(
        q,
        kv_cache.permute(0, 2, 1, 3) if token_major else kv_cache,
        kv_lens,
        page_table,
        cu_q_lens,
        num_seqs,
        v_cache=v_cache.permute(0, 2, 1, 3) if token_major else v_cache,
        new_kv=new_kv,
        check_data=validate,
        token_major=token_major,
    )
    if new_kv is not None and token_major:
        t, page, row = _new_token_slots(
            kv_lens, page_table, cu_q_lens, num_seqs, n, kv_cache.shape[1]
        )
        dev = kv_cache.device
        page, row, new = page.to(dev), row.to(dev), new_kv[t.to(new_kv.device)]
        _write_token_major(kv_cache, k_scale, new[:, 0::2], k_head, page, row)
        _write_token_major(v_cache, v_scale, new[:, 1::2], v_head, page, row)
    elif new_kv is not None:
        _write_new_kv(kv_cache, new_kv, kv_lens, page_table, cu_q_lens, num_seqs, n)
    tokens = q.shape[0]
    kv_lens_p, page_table_p, cu_p = _pad_tables(_i32(kv_lens), _i32(page_table), _i32(cu_q_lens))
    if token_major:
        return _kvcache_call(
            _pad_tokens(q, bucket_tokens(tokens)),
            kv_cache,
            v_cache,
            kv_lens_p,
            page_table_p,
            cu_p,
            _i32(num_seqs.reshape(1)),
            softmax_scale,
            sliding_window,
            softcap,
            causal,
            scales=(k_scale, v_scale, k_head, v_head),
        )[:tokens]
    out = rpa_op(
        _pad_tokens(q, bucket_tokens(tokens)),
        kv_cache,
        kv_lens_p,
        page_table_p,
        cu_p,
        _i32(num_seqs.reshape(1)),
        v_cache,
        None if softmax_scale is None else float(softmax_scale),
        sliding_window,
        None if softcap is None else float(softcap),
        bool(causal),
    )
    return out[:tokens]


def _pad_tokens(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to `tokens`."""
    extra = tokens - x.shape[0]
    if extra <= 0:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


def _pad_offsets(cu: torch.Tensor, entries: int) -> torch.Tensor:
    """cu [S + 1] extended to `entries` by repeating its last offset (sequences with no tokens)."""
    extra = entries - cu.shape[0]
    if extra <= 0:
        return cu
    return torch.cat([cu, cu[-1:].expand(extra)])


def _pad_tables(kv_lens, page_table, cu_q_lens):
    """Sequence slots and page-table columns padded to their count buckets: padded slots have no
    keys and no query tokens (and lie past num_seqs), padded columns point at page 0 and are
    never read."""
    slots, columns = page_table.shape
    slots_p, columns_p = bucket_count(slots), bucket_count(columns)
    if (slots_p, columns_p) != (slots, columns):
        page_table = torch.nn.functional.pad(
            page_table, (0, columns_p - columns, 0, slots_p - slots)
        )
        kv_lens = torch.nn.functional.pad(kv_lens, (0, slots_p - slots))
    return kv_lens, page_table, _pad_offsets(cu_q_lens, slots_p + 1)


def _new_token_slots(kv_lens, page_table, cu_q_lens, num_seqs, n, page_size):
    """(t, page, row) of every new token t of a live sequence: its cache page and row."""
    if n is None:
        n = int(num_seqs.reshape(-1)[0].item())
    cu = cu_q_lens.to(torch.int64)[: n + 1]
    ql = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(n, device=cu.device), ql)
    t = torch.arange(int(cu[-1]) if n else 0, device=cu.device)
    pos = kv_lens.to(torch.int64)[seq] - ql[seq] + (t - cu[seq])
    page = page_table.to(torch.int64)[seq, pos // page_size]
    return t, page, pos % page_size


def _write_new_kv(kv_cache, new_kv, kv_lens, page_table, cu_q_lens, num_seqs, n=None):
    """kv_cache[page, :, row, :] = new_kv[t] for every new token t of a live sequence (in place)."""
    t, page, row = _new_token_slots(kv_lens, page_table, cu_q_lens, num_seqs, n, kv_cache.shape[2])
    kv_cache[page.to(kv_cache.device), :, row.to(kv_cache.device), :] = new_kv[t.to(new_kv.device)]


def _kvcache_call(
    q,
    k_cache,
    v_cache,
    kv_lens,
    table,
    cu,
    ns,
    softmax_scale,
    sliding_window,
    softcap,
    causal,
    scales=(None, None, None, None),
):
    """kvcache_op on padded tables; an 8-bit cache passes its scales, a float8 one crosses as its
    uint8 bytes (read as e4m3 by the kernel). Unquantised calls keep the op's plain positional
    form."""
    args = (
        q,
        k_cache,
        v_cache,
        kv_lens,
        table,
        cu,
        ns,
        None if softmax_scale is None else float(softmax_scale),
        sliding_window,
        None if softcap is None else float(softcap),
        bool(causal),
    )
    if k_cache.dtype not in _QUANT_DTYPES:
        return kvcache_op(*args)
    if k_cache.dtype == torch.float8_e4m3fn:
        args = args[:1] + (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) + args[3:]
    k_scale, v_scale, k_head, v_head = scales
    return kvcache_op(
        *args, k_scale=k_scale, v_scale=v_scale, k_head_scale=k_head, v_head_scale=v_head
    )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes=None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_head_scale: torch.Tensor | float | None = None,
    v_head_scale: torch.Tensor | float | None = None,
    **kwargs,
) -> torch.Tensor:
    """flash-attn's `flash_attn_with_kvcache` on the paged kernel.

    q [B, Sq, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] with `block_table`
    [B, max_blocks] (paged), or [B, max_len, Hkv, D] without it. k/v [B, Sk_new, Hkv, D], if given,
    are written into the caches in place at positions cache_seqlens[b]:cache_seqlens[b]+Sk_new;
    attention then sees cache_seqlens + Sk_new keys, queries aligned to the end (causal is
    bottom-right). window_size=(left, right): left >= 0 sees keys p-left..p (right must be 0 with
    causal, -1 without window). softcap 0 means none. Returns out [B, Sq, H, D].
    Quantised caches: int8 or float8_e4m3fn k_cache / v_cache with bfloat16 q (bf16 output),
    dequantised in the kernel as value * k_scale[block, h, row] * k_head_scale[h] (keyword
    arguments; either kind or both): k_scale / v_scale [num_blocks, Hkv, block_size] float32
    per-token-per-head scales (block_size a multiple of 128), k_head_scale / v_head_scale [Hkv]
    float32 (or a float) per-head static scales. New k/v (float) are quantised per token and head
    (absmax) and written in place, their per-token scales into k_scale / v_scale.
    Not supported (raises): rotary embedding, cache_batch_idx, cache_leftpad, alibi, returning
    the log-sum-exp.
    """
    for name, val in (
        ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin),
        ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad),
        ("alibi_slopes", alibi_slopes),
    ):
        if val is not None:
            raise ValueError(f"flash_attn_with_kvcache: {name} is not supported by this kernel")
    if return_softmax_lse:
        raise ValueError("flash_attn_with_kvcache: return_softmax_lse=True is not supported")
    _check_tensor("q", q, 4, _FLOAT_DTYPES)
    _check_tensor("k_cache", k_cache, 4, _CACHE_DTYPES)
    _check_tensor("v_cache", v_cache, 4, _CACHE_DTYPES)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}"
        )
    k_head, v_head = validate_quant(
        q, k_cache, v_cache, k_scale, v_scale, k_head_scale, v_head_scale
    )
    B, sq, h, d = q.shape
    nb, bs, hkv, dc = k_cache.shape
    if block_table is None:
        if nb != B:
            raise ValueError(f"k_cache: without block_table, expected {B} rows (batch), got {nb}")
        block_table = torch.arange(B, dtype=torch.int32, device=q.device)[:, None]
    _check_tensor("block_table", block_table, 2, _INT_DTYPES)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (batch), got {block_table.shape[0]}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required (the number of tokens already in each cache row)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    _check_tensor("cache_seqlens", cache_seqlens, 1, _INT_DTYPES)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens: expected {B} entries, got {cache_seqlens.shape[0]}")
    left, right = (int(x) for x in window_size)
    if left >= 0 and not causal:
        raise ValueError("window_size: a left window needs causal=True here")
    if causal and right not in (0, -1):
        raise ValueError(
            f"window_size: right={right} with causal=True is not supported (use 0 or -1)"
        )
    sliding_window = left + 1 if left >= 0 else None
    softcap_ = float(softcap) if softcap and softcap > 0 else None
    _check_options(softmax_scale, sliding_window, softcap_)
    new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both or neither")
    if k is not None:
        _check_tensor("k", k, 4, _FLOAT_DTYPES)
        if k.shape != v.shape or k.shape[0] != B or tuple(k.shape[2:]) != (hkv, dc):
            raise ValueError(
                f"k/v: expected shape [{B}, new tokens, {hkv}, {dc}], got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        new = k.shape[1]
    kv_lens = cache_seqlens.to(torch.int64) + new
    cu = torch.arange(B + 1, dtype=torch.int64, device=q.device) * sq
    ns = torch.tensor([B], dtype=torch.int32, device=q.device)
    # Validate against the head-major view (same checks as the native layout).
    validate_ragged(
        q.reshape(B * sq, h, d),
        k_cache.permute(0, 2, 1, 3),
        kv_lens,
        block_table,
        cu,
        ns,
        v_cache=v_cache.permute(0, 2, 1, 3),
        token_major=True,
    )
    if new:
        cs = cache_seqlens.to(torch.int64)
        pos = cs[:, None] + torch.arange(new, device=cs.device)[None, :]  # [B, new]
        page = torch.gather(block_table.to(torch.int64), 1, pos // bs).reshape(-1)
        row = (pos % bs).reshape(-1)
        _write_token_major(k_cache, k_scale, k.reshape(B * new, hkv, dc), k_head, page, row)
        _write_token_major(v_cache, v_scale, v.reshape(B * new, hkv, dc), v_head, page, row)
    # Packed queries: the batch and the query length are data (cu_q_lens, num_seqs), the token
    # count and the table sizes are bucketed.
    tokens = B * sq
    kv_lens_p, table_p, cu_p = _pad_tables(_i32(kv_lens), _i32(block_table), _i32(cu))
    out = _kvcache_call(
        _pad_tokens(q.reshape(tokens, h, d), bucket_tokens(tokens)),
        k_cache,
        v_cache,
        kv_lens_p,
        table_p,
        cu_p,
        ns,
        softmax_scale,
        sliding_window,
        softcap_,
        causal,
        scales=(k_scale, v_scale, k_head, v_head),
    )
    return out[:tokens].reshape(B, sq, h, d)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table=None,
    **kwargs,
) -> torch.Tensor:
    """flash-attn 2's `flash_attn_varlen_func` over packed q [Tq, H, D], k/v [Tk, Hkv, D] with
    cu_seqlens_q/k [B+1]: each sequence's queries are the last of its keys (bottom-right causal
    alignment). Runs the paged kernel on K/V scattered into 16-token pages. Returns [Tq, H, D].
    dropout, alibi, block_table and attention probabilities are not supported (raise)."""
    if dropout_p:
        raise ValueError("flash_attn_varlen_func: dropout_p must be 0 (inference kernel)")
    if alibi_slopes is not None or block_table is not None or return_attn_probs:
        raise ValueError(
            "flash_attn_varlen_func: alibi_slopes, block_table and "
            "return_attn_probs are not supported"
        )
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, _FLOAT_DTYPES)
    _check_tensor("v", v, 3, _FLOAT_DTYPES)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, _INT_DTYPES)
    _check_tensor("cu_seqlens_k", cu_seqlens_k, 1, _INT_DTYPES)
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"k/v: expected equal shapes and q's dtype {q.dtype}, got "
            f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
        )
    if k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: head_dim must match and "
            "query heads must be a multiple of KV heads"
        )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k: expected the same number of sequences")
    left, right = (int(x) for x in window_size)
    if left >= 0 and not causal:
        raise ValueError("window_size: a left window needs causal=True here")
    sliding_window = left + 1 if left >= 0 else None
    softcap_ = float(softcap) if softcap and softcap > 0 else None
    _check_options(softmax_scale, sliding_window, softcap_)
    cq = cu_seqlens_q.detach().to("cpu", torch.int64)
    ck = cu_seqlens_k.detach().to("cpu", torch.int64)
    for name, cu, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, k.shape[0])):
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
            raise ValueError(
                f"{name}: expected 0 = c[0] <= c[1] <= ... <= {total}, got {cu.tolist()}"
            )
    if bool(((cq[1:] - cq[:-1]) > (ck[1:] - ck[:-1])).any()):
        raise ValueError(
            "a sequence has more query tokens than keys (bottom-right alignment needs "
            "q_len <= k_len)"
        )
    # Shapes are static in the compiled kernel: pad tokens and sequence counts up to their buckets
    # so that the changing batches of continuous batching reuse a few compiled programs. Padded
    # sequences have no tokens; padded query rows come back as zeros and are cut off.
    tq, tk, n = q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1
    tq_pad, tk_pad, n_pad = bucket_tokens(tq), bucket_tokens(tk), bucket_count(n)
    q_p, k_p, v_p = _pad_tokens(q, tq_pad), _pad_tokens(k, tk_pad), _pad_tokens(v, tk_pad)
    cq_p = _pad_offsets(_i32(cu_seqlens_q), n_pad + 1)
    ck_p = _pad_offsets(_i32(cu_seqlens_k), n_pad + 1)
    out = varlen_op(
        q_p,
        k_p,
        v_p,
        cq_p,
        ck_p,
        None if softmax_scale is None else float(softmax_scale),
        sliding_window,
        softcap_,
        bool(causal),
        VARLEN_PAGE_SIZE,
    )
    return out[:tq]


def warmup(
    kv_cache: torch.Tensor,
    *,
    num_heads: int,
    max_tokens: int,
    max_seqs: int,
    pages_per_seq: int,
    v_cache: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> int:
    """Compile, before serving, every kernel `ragged_paged_attention` can need on this cache for
    batches of up to `max_tokens` query tokens in up to `max_seqs` sequences with page tables of
    `pages_per_seq` columns: one call per (token bucket, sequence-slot bucket) pair. The cache is
    only read (one live sequence of one token, no new_kv). Returns the number of calls made."""
    from .shape_buckets import count_buckets, token_buckets

    head_dim = kv_cache.shape[-1]
    device = kv_cache.device
    calls = 0
    for tokens in token_buckets(max_tokens):
        for slots in count_buckets(max_seqs):
            q = torch.zeros(tokens, num_heads, head_dim, dtype=kv_cache.dtype, device=device)
            kv_lens = torch.zeros(slots, dtype=torch.int32, device=device)
            kv_lens[0] = 1
            page_table = torch.zeros(slots, pages_per_seq, dtype=torch.int32, device=device)
            cu = torch.ones(slots + 1, dtype=torch.int32, device=device)
            cu[0] = 0
            ragged_paged_attention(
                q,
                kv_cache,
                kv_lens,
                page_table,
                cu,
                1,
                v_cache=v_cache,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                softcap=softcap,
                causal=causal,
            )
            calls += 1
    return calls


def warmup_kvcache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    max_batch: int,
    max_blocks: int,
    query_len: int = 1,
    softmax_scale: float | None = None,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_head_scale: torch.Tensor | float | None = None,
    v_head_scale: torch.Tensor | float | None = None,
) -> int:
    """Compile, before serving, every kernel `flash_attn_with_kvcache` can need on these caches
    for batches of 1..`max_batch` sequences of `query_len` new query tokens each, with block
    tables of `max_blocks` columns (decode: query_len=1). Quantised caches: pass the scales the
    serving calls pass (the caches and scales are only read). Returns the number of calls made."""
    from .shape_buckets import bucket_count, bucket_tokens

    head_dim = k_cache.shape[-1]
    device = k_cache.device
    seen, calls = set(), 0
    for batch in range(1, max_batch + 1):
        key = (bucket_tokens(batch * query_len), bucket_count(batch))
        if key in seen:
            continue
        seen.add(key)
        q_dtype = torch.bfloat16 if k_cache.dtype in _QUANT_DTYPES else k_cache.dtype
        q = torch.zeros(batch, query_len, num_heads, head_dim, dtype=q_dtype, device=device)
        table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        seqlens = torch.full((batch,), query_len, dtype=torch.int32, device=device)
        flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            block_table=table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            k_head_scale=k_head_scale,
            v_head_scale=v_head_scale,
        )
        calls += 1
    return calls


def warmup_varlen(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_query_tokens: int,
    max_key_tokens: int,
    max_seqs: int,
    softmax_scale: float | None = None,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    causal: bool = True,
    device="cpu",
) -> int:
    """Compile, before serving, every kernel `flash_attn_varlen_func` (the path of Transformers'
    `generate_batch`) can need: one call per (query token bucket, key token bucket >= it,
    sequence bucket) triple up to the given maxima. Returns the number of calls made."""
    from .shape_buckets import count_buckets, token_buckets

    calls = 0
    for tq in token_buckets(max_query_tokens):
        for tk in token_buckets(max(max_key_tokens, tq), tq):
            for seqs in count_buckets(max_seqs):
                q = torch.zeros(tq, num_heads, head_dim, dtype=dtype, device=device)
                k = torch.zeros(tk, num_kv_heads, head_dim, dtype=dtype, device=device)
                cu_q = torch.full((seqs + 1,), tq, dtype=torch.int32, device=device)
                cu_k = torch.full((seqs + 1,), tk, dtype=torch.int32, device=device)
                cu_q[0] = cu_k[0] = 0
                flash_attn_varlen_func(
                    q,
                    k,
                    torch.zeros_like(k),
                    cu_q,
                    cu_k,
                    softmax_scale=softmax_scale,
                    causal=causal,
                    window_size=window_size,
                    softcap=softcap,
                )
                calls += 1
    return calls


__all__ = [
    "ragged_paged_attention",
    "flash_attn_with_kvcache",
    "flash_attn_varlen_func",
    "validate_ragged",
    "validate_quant",
    "quantise",
    "rpa_op",
    "varlen_op",
    "kvcache_op",
    "warmup",
    "warmup_kvcache",
    "warmup_varlen",
]
