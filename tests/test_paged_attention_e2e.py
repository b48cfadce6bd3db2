"""End to end with no download: a tiny random Llama (f32) through the paged attention kernel.

`generate_batch` (continuous batching) loads the built package as a Hub kernel (LOCAL_KERNELS maps
the repo id to the local build) and must give, for every prompt, the greedy tokens of plain
`generate` with eager attention: through `flash_attn_varlen_func` (what Transformers 5.22.2 does
on CPU/TPU), and with Transformers' CUDA/XPU-only gate on its block-table decode path lifted,
through `flash_attn_with_kvcache` on Transformers' own paged cache and page table.
`register()`'s attention function must match plain `generate` too.
"""

from __future__ import annotations

import pytest
import torch

import kernel_loader

pytestmark = pytest.mark.e2e

PA = kernel_loader.load_kernel("paged_attention")
PROMPTS = [
    [1, 5, 9, 3],
    [7, 2],
    [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 11, 12, 13, 14, 15, 16, 17, 18],
    [3],
]
NEW_TOKENS = 6


def _cb_config():
    # A small paged cache: Transformers' default sizing allocates most of the host memory.
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        block_size=16, num_blocks=32, max_batch_tokens=64, max_blocks_per_request=4
    )


@pytest.fixture(scope="module")
def model_and_reference():
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).eval()
    gc = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    return model, gc, want


def _generate_batch(model, gc, monkeypatch):
    repo = PA.integration.HUB_ATTN_IMPLEMENTATION.split(":")[0]
    assert repo == kernel_loader.repo_id("paged_attention")
    root = kernel_loader.variant_path("paged_attention").parent.parent
    monkeypatch.setenv("LOCAL_KERNELS", f"{repo}={root}")
    calls = {"varlen": 0, "kvcache": 0}

    def counting(name, op):
        def run(*a, **k):
            calls[name] += 1
            return op(*a, **k)

        return run

    # Transformers loads the same build (same op namespace and module): count the kernel's calls.
    monkeypatch.setattr(PA.ops, "varlen_op", counting("varlen", PA.ops.varlen_op))
    monkeypatch.setattr(PA.ops, "kvcache_op", counting("kvcache", PA.ops.kvcache_op))
    model.set_attn_implementation(PA.integration.HUB_ATTN_IMPLEMENTATION)
    try:
        with torch.no_grad():
            res = model.generate_batch(
                inputs=PROMPTS, generation_config=gc, continuous_batching_config=_cb_config()
            )
    finally:
        model.set_attn_implementation("eager")
    return [res[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))], calls


@pytest.mark.timeout(600)
def test_generate_batch_matches_generate(model_and_reference, monkeypatch):
    model, gc, want = model_and_reference
    got, calls = _generate_batch(model, gc, monkeypatch)
    assert got == want
    assert calls["varlen"] > 0, "generate_batch did not run the paged kernel"


@pytest.mark.timeout(600)
def test_generate_batch_block_table_path(model_and_reference, monkeypatch):
    """Transformers enables its block-table decode path only for flash attention on CUDA/XPU
    (continuous_batching.initialization.ensure_decode_fast_path_is_available).
    `enable_block_table_decode()` lifts that gate for this package (and its undo restores it):
    decode steps then call our flash_attn_with_kvcache on Transformers' paged cache with its page
    table, and the tokens still match. Every cache view handed over is contiguous (dlpack shares
    it with JAX: no per-step copy) and lies inside Transformers' one cache tensor."""
    from transformers.generation.continuous_batching import initialization

    original = initialization.ensure_decode_fast_path_is_available
    undo = PA.integration.enable_block_table_decode()
    views = []
    orig_kvcache = PA.ops.kvcache_op

    def recording(*a, **k):
        views.extend(a[1:3])
        return orig_kvcache(*a, **k)

    monkeypatch.setattr(PA.ops, "kvcache_op", recording)
    try:
        assert initialization.ensure_decode_fast_path_is_available is not original
        model, gc, want = model_and_reference
        got, calls = _generate_batch(model, gc, monkeypatch)
    finally:
        undo()
    assert initialization.ensure_decode_fast_path_is_available is original
    assert got == want
    assert calls["kvcache"] > 0, "the block-table path did not reach flash_attn_with_kvcache"
    assert views and all(v.is_contiguous() for v in views)
    bases = {v.untyped_storage().data_ptr() for v in views}
    assert len(bases) == 1, "the page views should all live in Transformers' one cache tensor"


@pytest.mark.timeout(600)
def test_registered_attention_generate(model_and_reference, monkeypatch):
    model, gc, want = model_and_reference
    name = PA.register()
    calls = []
    orig = PA.ops.varlen_op
    monkeypatch.setattr(PA.ops, "varlen_op", lambda *a, **k: calls.append(1) or orig(*a, **k))
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            got = [
                model.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist()
                for p in PROMPTS[:2]
            ]
    finally:
        model.set_attn_implementation("eager")
    assert got == want[:2]
    assert calls
