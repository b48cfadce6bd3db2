"""Transformers glue: an experts function running the Pallas grouped matmuls, and `register()`.

`experts_forward(self, hidden_states, top_k_index, top_k_weights)` follows the conventions of the
built-in `grouped_mm` experts function of transformers.integrations.moe: token-expert picks are
sorted by expert, the gate/up projection runs as one grouped matmul, the module's own gating
(`self._apply_gate`, which knows the concatenated or interleaved layout and the activation) or
`self.act_fn` follows, then the down projection, the routing weights, and a per-token sum in the
dtype of the routing weights, returned in the input dtype. Weights are used in the layout the model
stores them ([E, 2I, H] / [E, H, I], or transposed with `is_transposed`) with no copy: the kernel
reads either layout. Picks of id `num_experts` (expert-parallel placeholders) sort to the end,
belong to no group, and contribute exactly zero.

Gated experts whose gating we recognise run the gate_up projection with the activation fused into
the kernel's epilogue (`fused_gate`): the default `_apply_gate` (concatenated halves) with a SiLU,
erf-GELU or tanh-GELU `act_fn`, and GPT-OSS's clamped SwiGLU (interleaved gate/up). The kernel then
writes [tokens x top_k, I] instead of [.., 2I] and the bias rides in the same epilogue. Anything
else (another activation, a custom `_apply_gate`, a concatenated I that is not a multiple of 128)
keeps the unfused path: gmm, then the module's own gating.

Shape buckets: the tokens x top_k picks are padded up to their token bucket (shape_buckets.py) with
placeholder picks of id `num_experts` and routing weight 0, so both grouped matmuls run at the
bucket size (a new token count compiles only in a new bucket) and the placeholders, which belong to
no group, come out exactly zero and are cut off before the per-token sum.
"""

from __future__ import annotations

import torch

from . import ops as _ops
from .shape_buckets import bucket_tokens

__all__ = ["experts_forward", "register", "fused_gate", "warmup", "EXPERTS_NAMES"]

EXPERTS_NAMES = ("tokamax_ragged_dot", "pallas_ragged_dot")


def _weight(module, name: str) -> torch.Tensor:
    w = getattr(module, name, None)
    if not isinstance(w, torch.Tensor):
        raise ValueError(
            f"ragged_dot experts_forward: {type(module).__name__} has no tensor attribute {name!r}; "
            "supported experts store 3-D expert weights gate_up_proj (or up_proj without a gate) "
            "and down_proj"
        )
    if w.dim() != 3:
        raise ValueError(
            f"ragged_dot experts_forward: {type(module).__name__}.{name} has shape "
            f"{tuple(w.shape)}; expected a 3-D [num_experts, out, in] (or transposed) weight"
        )
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"ragged_dot experts_forward: {type(module).__name__}.{name} has dtype {w.dtype}; "
            "supported: bfloat16, float32 (quantised expert modules are not supported here; call "
            "gmm with int8/float8 weights and scales directly)"
        )
    return w


def _bias_param(module, name: str) -> torch.Tensor:
    b = getattr(module, name, None)
    if not isinstance(b, torch.Tensor):
        raise ValueError(
            f"ragged_dot experts_forward: {type(module).__name__} has has_bias=True but no tensor "
            f"attribute {name!r}"
        )
    return b


def _bias(module, name: str, rows: torch.Tensor, valid: torch.Tensor, like: torch.Tensor):
    b = _bias_param(module, name)
    # Placeholder picks get no bias: their rows must stay exactly zero.
    return torch.where(valid, like + b[rows].to(like.dtype), like)


# act_fn classes (by name: transformers renames them between versions) -> fused activation.
_ACT_CLASSES = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
}


def _activation_name(act) -> str | None:
    name = _ACT_CLASSES.get(type(act).__name__)
    if name == "gelu" and getattr(act, "act", None) not in (None, torch.nn.functional.gelu):
        return None  # GELUActivation(use_gelu_python=True) is still erf GELU, but be strict
    if type(act).__name__ == "GELU":  # torch.nn.GELU
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(getattr(act, "approximate", None))
    return name


def fused_gate(module, up: torch.Tensor, is_transposed: bool):
    """(activation, layout) the gate_up kernel can fuse for this experts module, or None."""
    if not getattr(module, "has_gate", True):
        return None
    apply_gate = getattr(type(module), "_apply_gate", None)
    two_i = up.shape[2] if is_transposed else up.shape[1]
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # an older transformers without the hook: nothing to match
        _default_apply_gate = None
    if apply_gate is not None and apply_gate is _default_apply_gate:
        act = _activation_name(getattr(module, "act_fn", None))
        # gate_up_out.chunk(2): concatenated halves; the up block of an output tile is a whole
        # BlockSpec block only when I is a multiple of the 128-lane tile.
        if act is not None and (two_i // 2) % 128 == 0:
            return act, "concatenated"
        return None
    qualname = getattr(apply_gate, "__qualname__", "")
    if (
        qualname == "GptOssExperts._apply_gate"
        and not getattr(module, "is_concatenated", True)
        and getattr(module, "alpha", None) == 1.702
        and getattr(module, "limit", None) == 7.0
    ):
        return "gpt_oss_swiglu", "interleaved"
    return None


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Transformers experts function (register with `register()`): [T, H] -> [T, H]."""
    if hidden_states.dim() != 2:
        raise ValueError(
            f"hidden_states: expected [tokens, hidden], got shape {tuple(hidden_states.shape)}"
        )
    if (
        top_k_index.shape != top_k_weights.shape
        or top_k_index.dim() != 2
        or top_k_index.shape[0] != hidden_states.shape[0]
    ):
        raise ValueError(
            f"top_k_index / top_k_weights: expected matching [tokens, top_k] shapes with "
            f"{hidden_states.shape[0]} tokens, got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}"
        )
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    is_transposed = getattr(self, "is_transposed", False)
    num_experts = self.num_experts
    up = _weight(self, "gate_up_proj" if has_gate else "up_proj")
    down = _weight(self, "down_proj")
    if up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(
            f"ragged_dot experts_forward: expert weights hold {up.shape[0]} / {down.shape[0]} "
            f"experts, expected num_experts={num_experts}"
        )

    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    expert_ids = top_k_index.reshape(-1).to(torch.int64)
    sample_weights = top_k_weights.reshape(-1)
    picks = expert_ids.shape[0]
    # Placeholder picks up to the row bucket: one compiled kernel per bucket, not per token count.
    extra = bucket_tokens(picks) - picks if picks else 0
    if extra > 0:
        expert_ids = torch.cat([expert_ids, expert_ids.new_full((extra,), num_experts)])
        sample_weights = torch.cat([sample_weights, sample_weights.new_zeros((extra,))])

    # Sort picks by expert; placeholder ids (>= num_experts) sort to the end and belong to no
    # group, so the kernel leaves their rows zero.
    ids_sorted, perm = torch.sort(expert_ids, stable=True)
    valid = (ids_sorted < num_experts).unsqueeze(-1)
    rows_expert = ids_sorted.clamp(0, num_experts - 1)
    group_sizes = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    group_sizes = group_sizes.scatter_add(
        0, expert_ids.clamp(0, num_experts), torch.ones_like(expert_ids, dtype=torch.int32)
    )[:num_experts]

    # Placeholder picks past the real ones read the last token: they belong to no group, so the
    # kernels never read their rows.
    x = hidden_states[(perm // top_k).clamp(max=num_tokens - 1)].to(up.dtype)
    # Weights as stored: [E, out, in] is read transposed in-kernel; is_transposed gives [E, in, out].
    fused = fused_gate(self, up, is_transposed)
    if fused is not None:
        bias = _bias_param(self, "gate_up_proj_bias") if has_bias else None
        h = _ops.gmm_gated(
            x,
            up,
            group_sizes,
            bias.to(up.dtype) if bias is not None else None,
            activation=fused[0],
            layout=fused[1],
            transpose_rhs=not is_transposed,
        )
    else:
        h = _ops.gmm(x, up, group_sizes, transpose_rhs=not is_transposed)
        if has_bias:
            h = _bias(
                self, "gate_up_proj_bias" if has_gate else "up_proj_bias", rows_expert, valid, h
            )
        h = self._apply_gate(h) if has_gate else self.act_fn(h)
    out = _ops.gmm(h.to(down.dtype), down, group_sizes, transpose_rhs=not is_transposed)
    if has_bias:
        out = _bias(self, "down_proj_bias", rows_expert, valid, out)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))

    weighted = out * sample_weights[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    weighted = weighted[inv_perm[:picks]]
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def warmup(module, max_tokens: int, top_k: int, *, backward: bool = False) -> int:
    """Compile, before serving, every kernel `experts_forward` can need on this experts module for
    1..`max_tokens` tokens routed to `top_k` experts each: one forward per row bucket of
    tokens x top_k (`backward=True` adds the backward's kernels). Returns the number of calls
    made."""
    weight = _weight(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj")
    is_transposed = getattr(module, "is_transposed", False)
    hidden = weight.shape[1] if is_transposed else weight.shape[2]
    seen, calls = set(), 0
    for tokens in range(1, max_tokens + 1):
        rows = bucket_tokens(tokens * top_k)
        if rows in seen:
            continue
        seen.add(rows)
        x = torch.zeros(
            tokens, hidden, dtype=weight.dtype, device=weight.device, requires_grad=backward
        )
        index = torch.arange(tokens * top_k, device=weight.device) % module.num_experts
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=weight.device)
        out = experts_forward(module, x, index.view(tokens, top_k), weights)
        if backward:
            out.sum().backward()
        calls += 1
    return calls


def register(names=EXPERTS_NAMES) -> tuple[str, ...]:
    """Register `experts_forward` in Transformers' ALL_EXPERTS_FUNCTIONS under each of `names`
    ("tokamax_ragged_dot" and "pallas_ragged_dot" by default). Returns the names."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
    return names
