"""The named benchmark shapes (real models) and their small counterparts (interpretable on CPU).

Every shape is a frozen dataclass with a `name`; `NAMED[kernel]` holds the production shapes of
issue 6, `SMALL[kernel]` small shapes of the same kind, used by `run.py --small`, by the tests
that check closed forms against the TPU interpreter, and by the committed small-shape results.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = [
    "RaggedDotShape",
    "AttentionShape",
    "PagedShape",
    "NAMED",
    "SMALL",
    "routing_group_sizes",
]

SEED = 0  # one fixed seed for every random routing


@functools.cache
def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[int, ...]:
    """Group sizes of a realistic MoE routing: each token picks `top_k` distinct experts uniformly
    at random (a fixed seed). Rows are then sorted by expert, as every grouped matmul expects."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return tuple(int(c) for c in np.bincount(picks.ravel(), minlength=experts))


def routing_group_sizes(tokens: int, experts: int, top_k: int, seed: int = SEED) -> np.ndarray:
    return np.asarray(_routing(tokens, experts, top_k, seed), dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class RaggedDotShape:
    """out[M, N] = lhs[M, K] @ rhs[group][K, N], M = tokens * top_k rows sorted by expert."""

    name: str
    tokens: int
    experts: int
    top_k: int
    k: int
    n: int
    dtype: str = "bfloat16"
    seed: int = SEED

    @property
    def m(self) -> int:
        return self.tokens * self.top_k

    @property
    def group_sizes(self) -> np.ndarray:
        return routing_group_sizes(self.tokens, self.experts, self.top_k, self.seed)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Self-attention prefill: q [batch, q_heads, seq, d], k/v [batch, kv_heads, seq, d]."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool = True
    window: int | None = None  # sliding window: a query sees itself and the window-1 keys before it
    softcap: float | None = None
    dtype: str = "bfloat16"
    # Packed documents: every row holds this many equal-length documents, given to the kernels as
    # segment ids (a query sees only keys of its own document, causally within it).
    documents: int | None = None

    def segment_ids(self):
        """[seq] int32 document ids of one row (the same for every row), or None."""
        import numpy as np

        if self.documents is None:
            return None
        assert self.seq % self.documents == 0, "documents must divide seq"
        return (np.arange(self.seq) // (self.seq // self.documents)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PagedShape:
    """Ragged paged attention: sequences given as (new query tokens, total KV length incl. them).

    The KV cache is paged with `page_size` tokens per page; every sequence owns
    ceil(kv_len / page_size) pages."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    window: int | None = None
    dtype: str = "bfloat16"
    # Our kernel's cache: "head_major" ([pages, 2 * Hkv, page_size, D], ragged_paged_attention)
    # or "token_major" (separate K and V [blocks, block_size, Hkv, D],
    # paged_attention_token_major); `kv_dtype` int8 / float8_e4m3fn (token-major only) with
    # per-token-per-head f32 scales. The anchors keep their own cache in `dtype`.
    layout: str = "head_major"
    kv_dtype: str | None = None
    # 8-bit pages' scales: "token" (per-token-per-head [blocks, Hkv, block_size] f32) or "head"
    # (per-head static scales [Hkv] only, as a serving stack with calibrated scales keeps).
    kv_scales: str = "token"

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def token_scales(self) -> bool:
        return self.kv_dtype is not None and self.kv_scales == "token"

    @property
    def head_scales(self) -> bool:
        return self.kv_dtype is not None and self.kv_scales == "head"

    @property
    def q_tokens(self) -> int:
        return sum(q for q, _ in self.seqs)

    @property
    def pages_per_seq(self) -> int:
        return max(-(-kv // self.page_size) for _, kv in self.seqs)


def _moe(prefix, tokens, experts, top_k, hidden, inter, gated=True):
    """gate_up: [M, hidden] x [hidden, 2*inter] (gate and up concatenated); down: [M, inter] x [inter, hidden]."""
    n_up = 2 * inter if gated else inter
    return [
        RaggedDotShape(f"{prefix}_gate_up_t{tokens}", tokens, experts, top_k, hidden, n_up),
        RaggedDotShape(f"{prefix}_down_t{tokens}", tokens, experts, top_k, inter, hidden),
    ]


def _llama_decode_token_major(suffix: str, **cache) -> PagedShape:
    """Llama-3-8B decoding 64 sequences of 8192 tokens over token-major pages of 128 (the
    `llama3_8b_decode_b64_ctx8192` batch), named `..._{suffix}`; `cache`: kv_dtype / kv_scales."""
    return PagedShape(
        f"llama3_8b_decode_b64_ctx8192_{suffix}",
        tuple((1, 8192) for _ in range(64)),
        32,
        8,
        128,
        page_size=128,
        layout="token_major",
        **cache,
    )


NAMED = {
    "ragged_dot": [
        # Qwen3-30B-A3B: hidden 2048, expert intermediate 768, 128 experts, top-8.
        *_moe("qwen3_30b_a3b", 64, 128, 8, 2048, 768),
        *_moe("qwen3_30b_a3b", 4096, 128, 8, 2048, 768),
        # Mixtral-8x7B: hidden 4096, intermediate 14336, 8 experts, top-2.
        *_moe("mixtral_8x7b", 4096, 8, 2, 4096, 14336),
        # Training / long-prefill batches: 16384 tokens (131072 and 32768 expert rows).
        *_moe("qwen3_30b_a3b", 16384, 128, 8, 2048, 768),
        *_moe("mixtral_8x7b", 16384, 8, 2, 4096, 14336),
        # One projection alone (gate or up): the shape tokamax's published TPU timings cover.
        RaggedDotShape("mixtral_8x7b_gate_t4096", 4096, 8, 2, 4096, 14336),
        # DeepSeek-V3-like experts: hidden 7168, expert intermediate 2048, 256 routed experts,
        # top-8 (the shared expert and the router's grouping left out). gate: one projection
        # (K = 7168, N = 2048; tokamax's published timings cover it at 16384 tokens on TPU7x);
        # down: K = 2048, N = 7168.
        *(
            RaggedDotShape(f"deepseek_v3_like_{proj}_t{tokens}", tokens, 256, 8, k, n)
            for tokens in (4096, 16384)
            for proj, k, n in (("gate", 7168, 2048), ("down", 2048, 7168))
        ),
    ],
    "flash_attention": [
        AttentionShape("llama3_8b_causal_8192", 1, 32, 8, 8192, 128),
        AttentionShape("llama3_8b_window1024_8192", 1, 32, 8, 8192, 128, window=1024),
        AttentionShape(
            "gemma_d256_window4096_softcap50_8192", 1, 8, 4, 8192, 256, window=4096, softcap=50.0
        ),
        # Shapes tokamax's published TPU timings cover (causal, no window, no soft cap).
        AttentionShape("llama3_8b_causal_b32_4096", 32, 32, 8, 4096, 128),
        AttentionShape("d256_causal_b2_8192", 2, 8, 8, 8192, 256),
        # Pre-training on packed sequences: 8 documents of 1024 tokens in each 8192-token row.
        AttentionShape("llama3_8b_packed8x1024_8192", 1, 32, 8, 8192, 128, documents=8),
        # Diffusion transformers (non-causal): Flux.1-dev at 1024x1024 (4096 image + 512 text
        # tokens attended jointly, 24 heads of 128) and a Wan2.1-1.3B-like video (81 frames at
        # 480x832 are 21 x 30 x 52 = 32,760 tokens, 12 heads of 128; rounded to 32,768 so that
        # the anchors, which need block multiples, run it too).
        AttentionShape("flux_dev_joint4608", 1, 24, 24, 4608, 128, causal=False),
        AttentionShape("wan_like_video_32768", 1, 12, 12, 32768, 128, causal=False),
    ],
    "paged_attention": [
        PagedShape(
            "llama3_8b_decode_b64_ctx8192",
            tuple((1, 8192) for _ in range(64)),
            32,
            8,
            128,
            page_size=128,
        ),
        # 63 decoding sequences plus one 2048-token prefill chunk (the last chunk of an
        # 8192-token prompt).
        PagedShape(
            "llama3_8b_mixed_63dec_prefill2048",
            tuple([(1, 8192)] * 63 + [(2048, 8192)]),
            32,
            8,
            128,
            page_size=128,
        ),
        # Long context: one sequence of 131072 tokens decoding.
        PagedShape("llama3_8b_decode_b1_ctx131072", ((1, 131072),), 32, 8, 128, page_size=128),
        # The decode batch over the caches flash-attn / vLLM / Transformers keep (token-major
        # K and V), in bf16 and quantised to int8 with per-token-per-head scales.
        _llama_decode_token_major("token_major"),
        _llama_decode_token_major("int8", kv_dtype="int8"),
        # The same batch over float8_e4m3fn pages (per-token-per-head scales): the int8 row's
        # bytes, its pages decoded with integer ops (no 8-bit float unit on v5e). The anchor
        # keeps its own bf16 cache, as for int8 (it has no 8-bit KV path to compare).
        _llama_decode_token_major("fp8", kv_dtype="float8_e4m3fn"),
        # The int8 and e4m3 batches with per-head static scales only (no per-token scales).
        _llama_decode_token_major("int8_head_scales", kv_dtype="int8", kv_scales="head"),
        _llama_decode_token_major("fp8_head_scales", kv_dtype="float8_e4m3fn", kv_scales="head"),
    ],
}

SMALL = {
    "ragged_dot": [
        RaggedDotShape("small_moe_gate_up_t16", 16, 8, 2, 256, 256),
        RaggedDotShape("small_moe_down_t16", 16, 8, 2, 128, 256),
    ],
    "flash_attention": [
        AttentionShape("small_causal_512", 1, 2, 1, 512, 128),
        AttentionShape("small_window128_512", 1, 2, 1, 512, 128, window=128),
        AttentionShape("small_packed4x128_512", 1, 2, 1, 512, 128, documents=4),
    ],
    "paged_attention": [
        PagedShape(
            "small_decode_b4_ctx300", tuple((1, 300) for _ in range(4)), 4, 1, 128, page_size=16
        ),
        PagedShape(
            "small_mixed_3dec_prefill40",
            ((1, 200), (1, 64), (1, 129), (40, 96)),
            4,
            1,
            128,
            page_size=16,
        ),
    ],
}
