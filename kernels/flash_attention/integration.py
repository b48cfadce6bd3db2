"""Transformers glue: an attention function for `AttentionInterface` and `register()`.

Transformers hands an attention function q [B, Hq, S, D] and k/v [B, Hkv, Sk, D] (KV heads not
repeated) plus, with the flash-attention mask function registered next to it, either no mask or a
2-D padding mask [B, Sk] (1 = real token). Padded batches are packed into varlen form (only real
tokens, cu_seqlens per row), so padding costs no kernel work; the outputs at padded query positions
are zero, as with Transformers' flash-attention path.
"""

from __future__ import annotations

import torch

from . import ops

# Transformers treats any name containing "flash" as a flash-attn package to import: avoid it.
DEFAULT_NAME = "pallas_tpu_attention"

__all__ = ["attention_forward", "register", "DEFAULT_NAME"]


def _cu_seqlens(mask2d: torch.Tensor) -> torch.Tensor:
    lens = mask2d.sum(dim=1, dtype=torch.int32)
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def attention_forward(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
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
    common = dict(softmax_scale=scaling, causal=bool(is_causal), window_size=window,
                  softcap=float(softcap) if softcap else 0.0, s_aux=s_aux)

    mask2d = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)}: expected the 2-D padding mask "
                "[batch, kv_len] that the flash-attention mask function produces (register() sets it)")
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
    out_p = ops.flash_attn_varlen_func(qp, kp, vp, _cu_seqlens(q_mask), _cu_seqlens(mask2d),
                                       **common)
    out = out_p.new_zeros((B * Sq, Hq, out_p.shape[-1])).index_copy(0, idx_q, out_p)
    return out.reshape(B, Sq, Hq, -1), None


def register(name: str = DEFAULT_NAME) -> str:
    """Register `attention_forward` under `name` in Transformers' AttentionInterface, with the
    flash-attention mask function (2-D padding masks) in AttentionMaskInterface. Use
    `attn_implementation=name` afterwards. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name
