"""Transformers and Diffusers glue: attention functions and `register()`.

Transformers hands an attention function q [B, Hq, S, D] and k/v [B, Hkv, Sk, D] (KV heads not
repeated) plus, with the flash-attention mask function registered next to it, either no mask or a
2-D padding mask [B, Sk] (1 = real token). Padded batches are packed into varlen form (only real
tokens, cu_seqlens per row), so padding costs no kernel work; the outputs at padded query positions
are zero, as with Transformers' flash-attention path.

Diffusers' attention dispatcher (`diffusers.models.attention_dispatch`) hands a backend q [B, Sq,
Hq, D] and k/v [B, Sk, Hkv, D] (the flash-attn layout, so no transposes) with an optional
`attn_mask`. `diffusers_attention` runs it through `flash_attn_func`, or, with a padding-style mask,
through `flash_attn_varlen_func` on the packed real tokens. The dispatcher keys backends by the
closed enum `AttentionBackendName`, and diffusers 0.42.1 has no public way to add one, so
`register()` adds one member to that enum and registers the function with
`_AttentionBackendRegistry.register` (the decorator diffusers uses for its own backends): after
that, `model.set_attention_backend(name)` and `with attention_backend(name):` accept our name like
a built-in one. The upstream change that would make this public: a `register_attention_backend(
name, fn, constraints=(), supports_context_parallel=False)` in attention_dispatch that accepts a
new name (registry keyed by str, not the enum). SD3-style models (`JointAttnProcessor2_0`) call
`F.scaled_dot_product_attention` directly, bypassing the dispatcher; `use_dispatcher(model)`
swaps those processors for `JointAttnDispatchProcessor`, the same computation through
`dispatch_attention_fn`.
"""

from __future__ import annotations

import torch

from . import ops

# Transformers treats any name containing "flash" as a flash-attn package to import: avoid it.
DEFAULT_NAME = "pallas_tpu_attention"

__all__ = [
    "attention_forward",
    "diffusers_attention",
    "JointAttnDispatchProcessor",
    "use_dispatcher",
    "register",
    "DEFAULT_NAME",
]


def _cu_seqlens(mask2d: torch.Tensor) -> torch.Tensor:
    lens = mask2d.sum(dim=1, dtype=torch.int32)
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """Transformers attention function -> (out [B, S, Hq, D], None)."""
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("attention dropout is not implemented in flash-attention-tpu")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    # Transformers' sliding_window counts the current token: left window = sliding_window - 1.
    window = (-1, -1)
    if sliding_window is not None and Sk > sliding_window:
        window = (int(sliding_window) - 1, -1 if is_causal else int(sliding_window) - 1)
    if s_aux is not None:
        s_aux = s_aux.to(torch.float32) if q.dtype == torch.float32 else s_aux
    common = dict(
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window,
        softcap=float(softcap) if softcap else 0.0,
        s_aux=s_aux,
    )

    mask2d = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)}: expected the 2-D padding mask "
                "[batch, kv_len] that the flash-attention mask function produces (register() sets it)"
            )
        mask2d = attention_mask[:, -Sk:].to(torch.bool)
        if bool(mask2d.all()):
            mask2d = None
    if mask2d is None:
        return ops.flash_attn_func(q, k, v, **common), None

    # Pack the real tokens: keys by the mask, queries by its last Sq columns.
    q_mask = mask2d[:, -Sq:]
    idx_k = torch.nonzero(mask2d.reshape(-1), as_tuple=False).flatten()
    idx_q = torch.nonzero(q_mask.reshape(-1), as_tuple=False).flatten()
    kp = k.reshape(B * Sk, *k.shape[2:]).index_select(0, idx_k)
    vp = v.reshape(B * Sk, *v.shape[2:]).index_select(0, idx_k)
    qp = q.reshape(B * Sq, Hq, D).index_select(0, idx_q)
    out_p = ops.flash_attn_varlen_func(
        qp, kp, vp, _cu_seqlens(q_mask), _cu_seqlens(mask2d), **common
    )
    out = out_p.new_zeros((B * Sq, Hq, out_p.shape[-1])).index_copy(0, idx_q, out_p)
    return out.reshape(B, Sq, Hq, -1), None


# -------------------------------------------------------------------------------------------------
# Diffusers
# -------------------------------------------------------------------------------------------------

# A mask with more distinct query rows than this (per batch element) is not a padding mask: each
# distinct row becomes one packed sequence carrying its own copy of the keys it sees.
MAX_MASK_PATTERNS = 16


def _bool_mask(attn_mask: torch.Tensor) -> torch.Tensor:
    """attn_mask as bool (True = attend): bool as is; an additive float mask only if it holds 0 and
    -inf (or the dtype's minimum, which is how diffusers and Transformers build them)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype == torch.bool:
        return attn_mask
    if not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask has dtype {attn_mask.dtype}: pass a bool mask (True = attend) "
            "or an additive float mask of 0 / -inf"
        )
    keep = attn_mask == 0
    dropped = attn_mask <= torch.finfo(attn_mask.dtype).min
    if not bool((keep | dropped).all()):
        raise ValueError(
            "attn_mask is a float mask with values other than 0 and -inf: an arbitrary "
            "additive attention bias is not supported by flash-attention-tpu (only "
            "masks that keep or drop keys); use the 'native' backend for it"
        )
    return keep


def _mask_4d(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    """Broadcast-ready [B|1, H|1, Sq|1, Sk] view of a bool mask, read as diffusers' native backend
    reads it: a 2-D [B, Sk] mask is a key-padding mask, anything else broadcasts like SDPA's."""
    if mask.dim() == 2 and tuple(mask.shape) == (b, sk):
        mask = mask[:, None, None, :]
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)}: expected 1-4 dims")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for size, full, what in zip(
        m.shape, (b, h, sq, sk), ("batch", "heads", "query length", "key length")
    ):
        if size not in (1, full) or (what == "key length" and size != full):
            raise ValueError(
                f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                f"[batch={b}, heads={h}, q_len={sq}, kv_len={sk}] ({what})"
            )
    return m


def _pack_plan(mask: torch.Tensor, b: int, sq: int, sk: int):
    """From a bool mask [B|1, 1, Sq|1, Sk]: (q_index or None, k_index, cu_seqlens_q, cu_seqlens_k).
    Each packed sequence is one group of queries that see the same keys; q_index None means every
    query in order, one sequence per batch row (a key-padding mask). Queries that see no key are
    left out (their output is zero, as SDPA's for a fully masked row)."""
    dev = mask.device
    if mask.shape[2] == 1:  # key padding: all queries, the kept keys of their row
        keys = mask[:, 0, 0, :].expand(b, sk)
        k_index = torch.nonzero(keys.reshape(-1), as_tuple=False).flatten()
        lens_k = keys.sum(dim=1, dtype=torch.int32)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev) * sq
        cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
        return None, k_index, cu_q, cu_k
    rows_all = mask[:, 0].expand(b, sq, sk)
    q_parts, k_parts, lens_q, lens_k = [], [], [], []
    for i in range(b):
        patterns, which = torch.unique(rows_all[i], dim=0, return_inverse=True)
        if patterns.shape[0] > MAX_MASK_PATTERNS:
            raise ValueError(
                f"attn_mask has {patterns.shape[0]} distinct query rows in batch element {i} (at most "
                f"{MAX_MASK_PATTERNS} supported): flash-attention-tpu takes padding-style masks "
                "(query and key padding, blocks), not an arbitrary dense mask; use causal=True for "
                "causal masks or the 'native' backend"
            )
        for p in range(patterns.shape[0]):
            keys = torch.nonzero(patterns[p], as_tuple=False).flatten()
            if keys.numel() == 0:
                continue
            queries = torch.nonzero(which == p, as_tuple=False).flatten()
            q_parts.append(queries + i * sq)
            k_parts.append(keys + i * sk)
            lens_q.append(queries.numel())
            lens_k.append(keys.numel())
    if not q_parts:
        return torch.zeros(0, dtype=torch.long, device=dev), None, None, None
    cu = lambda lens: torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)  # noqa: E731
    return torch.cat(q_parts), torch.cat(k_parts), cu(lens_q), cu(lens_k)


def diffusers_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """Diffusers attention backend: query [B, Sq, Hq, D], key/value [B, Sk, Hkv, D] (Hq a multiple
    of Hkv: GQA needs no repeat) -> [B, Sq, Hq, D]. `attn_mask` (bool, True = attend, or additive
    0 / -inf) may be a key-padding mask ([B, Sk], [B, 1, 1, Sk], ...) or a padding-style mask over
    queries and keys ([B, 1, Sq, Sk] with few distinct rows): the real tokens are packed and run
    varlen. Not supported (clear errors): dropout, arbitrary float biases or dense masks, per-head
    masks, return_lse, context parallelism, is_causal with Sq != Sk (SDPA aligns it top-left)."""
    del enable_gqa  # the kernel takes Hkv < Hq as it is
    if _parallel_config is not None:
        raise NotImplementedError(
            "context parallelism is not supported by the flash-attention-tpu diffusers backend"
        )
    if return_lse:
        raise NotImplementedError(
            "return_lse=True is not supported by the flash-attention-tpu diffusers backend"
        )
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: attention dropout is not implemented in "
            "flash-attention-tpu; pass 0.0"
        )
    for arg, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{arg} must be a 4-D tensor [batch, seq_len, heads, head_dim], got "
                f"{getattr(t, 'shape', type(t).__name__)}"
            )
    b, sq, hq, _ = query.shape
    sk = key.shape[1]
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True with an attn_mask: pass one of them")
    if is_causal and sq != sk:
        raise ValueError(
            f"is_causal=True with q_len {sq} != kv_len {sk}: SDPA aligns the causal "
            "mask top-left, flash-attention-tpu bottom-right; pass an explicit mask"
        )
    common = dict(softmax_scale=scale, causal=bool(is_causal), window_size=window_size)
    if attn_mask is None:
        return ops.flash_attn_func(query, key, value, **common)

    mask = _mask_4d(_bool_mask(attn_mask), b, hq, sq, sk)
    if mask.shape[1] > 1:
        if not bool((mask == mask[:, :1]).all()):
            raise ValueError(
                "attn_mask differs between heads: per-head masks are not supported by "
                "flash-attention-tpu"
            )
        mask = mask[:, :1]
    if bool(mask.all()):
        return ops.flash_attn_func(query, key, value, **common)
    q_index, k_index, cu_q, cu_k = _pack_plan(mask, b, sq, sk)
    if k_index is None:  # no query sees any key: all zeros, as SDPA gives
        return query.new_zeros(b, sq, hq, value.shape[-1])
    q_flat = query.reshape(b * sq, hq, query.shape[-1])
    kp = key.reshape(b * sk, *key.shape[2:]).index_select(0, k_index)
    vp = value.reshape(b * sk, *value.shape[2:]).index_select(0, k_index)
    qp = q_flat if q_index is None else q_flat.index_select(0, q_index)
    out = ops.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, **common)
    if q_index is not None:
        out = out.new_zeros(b * sq, hq, out.shape[-1]).index_copy(0, q_index, out)
    return out.reshape(b, sq, hq, -1)


class JointAttnDispatchProcessor:
    """SD3-style joint attention (image tokens, then text tokens, in one sequence) through diffusers'
    attention dispatcher, so that `set_attention_backend` / `attention_backend` apply to it. Same
    computation as diffusers' `JointAttnProcessor2_0`, which calls SDPA directly."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        batch = hidden_states.shape[0]
        n_image = hidden_states.shape[1]

        def heads(x):  # [B, S, H * D] -> [B, S, H, D], the dispatcher's layout
            return x.view(batch, x.shape[1], attn.heads, -1)

        query = heads(attn.to_q(hidden_states))
        key = heads(attn.to_k(hidden_states))
        value = heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            text_q = heads(attn.add_q_proj(encoder_hidden_states))
            text_k = heads(attn.add_k_proj(encoder_hidden_states))
            text_v = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)

        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            out, text_out = out[:, :n_image], out[:, n_image:]
            if not attn.context_pre_only:
                text_out = attn.to_add_out(text_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, text_out) if encoder_hidden_states is not None else out


def use_dispatcher(model) -> int:
    """Swap every `JointAttnProcessor2_0` (SD3, SD3.5) in `model` for `JointAttnDispatchProcessor`,
    so the model's attention goes through diffusers' dispatcher (and so through the backend set
    with `set_attention_backend` or `attention_backend`). Returns how many were swapped; models
    that already use the dispatcher (Flux, Wan, HunyuanVideo, ...) need nothing and give 0."""
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    swapped = 0
    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is JointAttnProcessor2_0:
            module.set_processor(JointAttnDispatchProcessor())
            swapped += 1
    return swapped


def _diffusers_backend_member(name: str):
    """The `AttentionBackendName` member for `name`, added to the enum if missing (diffusers 0.42.1
    has no public way to add a backend name; see the module docstring)."""
    from diffusers.models.attention_dispatch import AttentionBackendName as names

    if name in names._value2member_map_:
        return names(name)
    member_name = name.upper()
    if member_name in names._member_map_:
        raise ValueError(f"diffusers already has a backend {member_name} with another value")
    member = str.__new__(names, name)
    member._name_, member._value_, member.__objclass__ = member_name, name, names
    member._sort_order_ = len(names._member_names_)
    names._member_map_[member_name] = member
    names._value2member_map_[name] = member
    names._member_names_.append(member_name)
    type.__setattr__(names, member_name, member)
    return member


def _register_diffusers(name: str) -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    _AttentionBackendRegistry.register(
        _diffusers_backend_member(name), constraints=[], supports_context_parallel=False
    )(diffusers_attention)


def register(name: str = DEFAULT_NAME) -> str:
    """Register our attention under `name` in every installed library of Transformers and
    Diffusers, and return `name`, the one name to use in both:

    - Transformers: `attention_forward` in `AttentionInterface`, with the flash-attention mask
      function (2-D padding masks) in `AttentionMaskInterface`; use `attn_implementation=name`.
    - Diffusers: `diffusers_attention` as a dispatcher backend; use
      `model.set_attention_backend(name)` or `with attention_backend(name):` (SD3-style models
      first need `use_dispatcher(model)`).

    `name` must be lowercase (diffusers lowercases backend names). Calling it again is harmless."""
    import importlib.util

    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"name must be a non-empty lowercase string, got {name!r}")
    found = [lib for lib in ("transformers", "diffusers") if importlib.util.find_spec(lib)]
    if not found:
        raise ImportError("register() needs transformers or diffusers installed")
    if "transformers" in found:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    if "diffusers" in found:
        _register_diffusers(name)
    return name
