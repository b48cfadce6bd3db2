"""Deviceless Mosaic compile of the paged attention kernel for v5e, v6e and TPU7x at Llama-3-8B
serving sizes (32 query heads, 8 KV heads, head dim 128, bf16) with the default tiling: decode
batch 64 with 8192-token contexts, and a mixed batch of a 2048-token prefill chunk plus 63 decodes.
A VMEM overflow or layout error fails the compile."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

import kernel_loader
import tpu_compile

# No skip without libtpu: `make setup` installs it, and a missing one must fail loudly.
pytestmark = [pytest.mark.compile]

PA = kernel_loader.load_kernel("paged_attention")
SEQS, CTX, HQ, HKV, D = 64, 8192, 32, 8, 128


def _compile(generation, page_size, tokens, separate=False, config=None, seqs=SEQS, ctx=CTX):
    pages = ctx // page_size
    c = HKV if separate else 2 * HKV
    cache = ((seqs * pages, c, page_size, D), jnp.bfloat16)
    fn = functools.partial(
        PA.kernel.ragged_paged_attention, generation=generation, config=config, interpret=False
    )
    extra = {"v_pages": cache} if separate else {}
    return tpu_compile.compile_for(
        generation,
        fn,
        ((tokens, HQ, D), jnp.bfloat16),
        cache,
        ((seqs,), jnp.int32),
        ((seqs, pages), jnp.int32),
        ((seqs + 1,), jnp.int32),
        ((1,), jnp.int32),
        **extra,
    )


# The decode and the mixed batch at page 128 and page 16, each case on one generation in CI, so
# every generation compiles the head-major kernel at a production shape (decode 128 on v5e, 16 on
# v6e; mixed 128 on TPU7x, 16 on v5e); the variants below on one generation each, spread over the
# three (tpu_compile.generation_per_case / one_generation); everything everywhere in the long form.
@pytest.mark.parametrize(
    "generation,page_size",
    tpu_compile.generation_per_case([128, 16]),
)
def test_decode_batch_compiles(generation, page_size):
    compiled = _compile(generation, page_size, SEQS)
    # Only the kernel's small work-list / q layout temporaries: no copy of the 2 GiB cache.
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20


@pytest.mark.parametrize(
    "generation,page_size",
    tpu_compile.generation_per_case([128, 16], start=2),
)
def test_mixed_batch_with_prefill_chunk_compiles(generation, page_size):
    compiled = _compile(generation, page_size, 2048 + SEQS - 1)
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20
    # The work list and the new tokens' slots come from loop-free XLA ops.
    assert tpu_compile.xla_while_loops(compiled) == []


@pytest.mark.parametrize("generation", tpu_compile.one_generation(2))
def test_separate_kv_caches_compile(generation):
    _compile(generation, 32, SEQS, separate=True)


@pytest.mark.parametrize("generation", tpu_compile.one_generation(0))
def test_streamed_page_table_compiles(generation):
    """The streamed page-table path forced at the decode batch; on TPU7x also 128 sequences x
    16384-token contexts in 16-token pages (an 8 GiB cache), whose 512 KiB page table is streamed
    by default."""
    _compile(generation, 64, SEQS, config=PA.tiling.PagedAttentionConfig(stream_page_table=True))
    if generation == "tpu7x":
        assert PA.tiling.streams_page_table(128, 1024, PA.tiling.PagedAttentionConfig())
        _compile(generation, 16, 128, seqs=128, ctx=16384)


@pytest.mark.parametrize("generation", tpu_compile.TESTED_GENERATIONS)
def test_default_tiles_fit_vmem_budget(generation):
    """The budget model's need for the default tiles stays within the VMEM budget, and the limit
    the kernel asks Mosaic for stays under 3/4 of physical VMEM, at every tested page size and
    both batch shapes."""
    gen = PA.tiling.GENERATIONS[generation]
    for page_size in (16, 32, 64, 128):
        for tokens in (SEQS, 2048 + SEQS - 1):
            cfg = PA.tiling.choose_config(
                num_tokens=tokens,
                num_q_heads=HQ,
                num_kv_heads=HKV,
                head_dim=D,
                page_size=page_size,
                pages_per_seq=CTX // page_size,
                q_dtype="bfloat16",
                kv_dtype="bfloat16",
                generation=generation,
            )
            need = PA.tiling.vmem_need_bytes(
                block_q=cfg.block_q,
                pages_per_block=cfg.pages_per_block,
                page_size=page_size,
                num_kv_heads=HKV,
                group=HQ // HKV,
                head_dim=D,
                q_dtype="bfloat16",
                kv_dtype="bfloat16",
            )
            assert need <= PA.tiling.vmem_budget_bytes(gen)
            assert PA.tpu_generations.vmem_limit_bytes(gen, need) <= gen.vmem_bytes * 3 // 4
            assert PA.tpu_generations.vmem_limit_bytes(gen, need) >= need


@pytest.mark.parametrize("generation", tpu_compile.one_generation(1))
def test_cache_write_in_place_for_decode(generation):
    """kernel.write_kv (XLA scatter) with the cache donated writes a decode batch's 64 tokens in
    place: no cache-sized temporary, the output aliases the cache."""
    import jax

    page_size = 128
    pages = CTX // page_size
    av = functools.partial(tpu_compile.tpu_aval, generation=generation)
    cache = av((SEQS * pages, 2 * HKV, page_size, D), jnp.bfloat16)
    compiled = (
        jax.jit(PA.kernel.write_kv, donate_argnums=0)
        .trace(
            cache,
            av((SEQS, 2 * HKV, D), jnp.bfloat16),
            av((SEQS,), jnp.int32),
            av((SEQS, pages), jnp.int32),
            av((SEQS + 1,), jnp.int32),
            av((1,), jnp.int32),
        )
        .lower()
        .compile()
    )
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == SEQS * pages * 2 * HKV * page_size * D * 2
    assert mem.temp_size_in_bytes < 16 << 20


def _compile_token_major(generation, page_size, tokens, *, write, seqs=SEQS, ctx=CTX):
    """paged_attention_token_major at Llama-3-8B shapes, with the caches donated as a server's step
    function would (the writer's outputs alias them)."""
    import jax

    pages = ctx // page_size
    av = functools.partial(tpu_compile.tpu_aval, generation=generation)
    cache = av((seqs * pages, page_size, HKV, D), jnp.bfloat16)
    kw = {}
    if write:
        kw = dict(
            new_k=av((tokens, HKV, D), jnp.bfloat16), new_v=av((tokens, HKV, D), jnp.bfloat16)
        )
    fn = functools.partial(PA.kernel.paged_attention_token_major, generation=generation)
    return (
        jax.jit(fn, donate_argnums=(1, 2) if write else ())
        .trace(
            av((tokens, HQ, D), jnp.bfloat16),
            cache,
            cache,
            av((seqs,), jnp.int32),
            av((seqs, pages), jnp.int32),
            av((seqs + 1,), jnp.int32),
            av((1,), jnp.int32),
            **kw,
        )
        .lower()
        .compile()
    )


@pytest.mark.parametrize(
    "generation,page_size,tokens",
    # decode (the paired-head path) on every generation; the page-16 mixed batch on one
    [(g, 128, SEQS) for g in tpu_compile.TESTED_GENERATIONS]
    + tpu_compile.generation_per_case([(16, 2048 + SEQS - 1)], start=0),
)
def test_token_major_write_and_attention_in_place(generation, page_size, tokens):
    """Token-major caches read natively and the new tokens written by the Pallas writer in the same
    call: both 2 GiB caches aliased to the outputs, no cache-sized temporary (decode and a
    2111-token mixed batch alike), no copy or transpose of a cache in the compiled program."""
    import re

    compiled = _compile_token_major(generation, page_size, tokens, write=True)
    mem = compiled.memory_analysis()
    cache_bytes = SEQS * CTX * HKV * D * 2
    assert mem.alias_size_in_bytes == 2 * cache_bytes
    assert mem.temp_size_in_bytes < 64 << 20
    pages = SEQS * CTX // page_size
    for shape in re.findall(r"= bf16\[([\d,]+)\]\S* (?:copy|transpose)\(", compiled.as_text()):
        assert int(shape.split(",")[0]) != pages, f"a cache is copied: bf16[{shape}]"


@pytest.mark.parametrize("generation", tpu_compile.one_generation(1))
def test_flash_attn_with_kvcache_body_reads_caches_in_place(generation):
    """The JAX body of the torch flash_attn_with_kvcache op at Llama-3-8B decode (64 x 8192, page
    128): no head-major copy of the caches any more (temporaries far below one 1 GiB cache)."""
    page_size = 128
    pages = CTX // page_size
    cache = ((SEQS * pages, page_size, HKV, D), jnp.bfloat16)
    compiled = tpu_compile.compile_for(
        generation,
        PA.ops._kvcache_jax,
        ((SEQS, HQ, D), jnp.bfloat16),
        cache,
        cache,
        ((SEQS,), jnp.int32),
        ((SEQS, pages), jnp.int32),
        ((SEQS + 1,), jnp.int32),
        ((1,), jnp.int32),
        causal=True,
        static_argnames=("causal",),
    )
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20


@pytest.mark.parametrize(
    "generation,qdtype",
    # one format per generation in CI (TPU7x's e4m3 decode body compiles in
    # test_flash_attn_with_kvcache_body_fp8_bytes_in_place), both on every one in the long form
    [(g, q) for g in tpu_compile.TESTED_GENERATIONS for q in ("fp8", "int8")]
    if tpu_compile.LONG_FORM
    else [("v5e", "fp8"), ("v6e", "int8"), ("tpu7x", "int8")],
)
def test_quantised_token_major_compiles(generation, qdtype):
    """8-bit pages (word unpacking; the decode quads' e4m3 keys and values straight into bf16 x
    e4m3 matmuls, which each generation's MXU loads itself), per-token and per-head scales,
    sinks and the in-place write at Llama-3-8B decode (64 x 8192, page 128): the 8-bit caches
    aliased, no cache-sized temporary, the per-token scales kept in HBM."""
    import jax

    page_size, pages = 128, CTX // 128
    cdt = jnp.int8 if qdtype == "int8" else jnp.float8_e4m3fn
    av = functools.partial(tpu_compile.tpu_aval, generation=generation)
    cache = av((SEQS * pages, page_size, HKV, D), cdt)
    scale = av((SEQS * pages, HKV, page_size), jnp.float32)
    fn = functools.partial(PA.kernel.paged_attention_token_major, generation=generation)
    lowered = (
        jax.jit(fn, donate_argnums=(1, 2))
        .trace(
            av((SEQS, HQ, D), jnp.bfloat16),
            cache,
            cache,
            av((SEQS,), jnp.int32),
            av((SEQS, pages), jnp.int32),
            av((SEQS + 1,), jnp.int32),
            av((1,), jnp.int32),
            new_k=av((SEQS, HKV, D), cdt),
            new_v=av((SEQS, HKV, D), cdt),
            k_scale=scale,
            v_scale=scale,
            new_k_scale=av((SEQS, HKV), jnp.float32),
            new_v_scale=av((SEQS, HKV), jnp.float32),
            k_head_scale=av((HKV,), jnp.float32),
            v_head_scale=av((HKV,), jnp.float32),
            sinks=av((HQ,), jnp.float32),
        )
        .lower()
    )
    # The per-token scale arrays reach the kernel pinned to HBM (memory space color 0): XLA
    # otherwise may prefetch one that fits VMEM into it (TPU7x did, the 16 MiB of K scales), and
    # Mosaic then copies its pages with vector loads and stores instead of DMAs.
    assert lowered.as_text().count("\\22color\\22:0") == 2
    mem = lowered.compile().memory_analysis()
    assert mem.alias_size_in_bytes == 2 * SEQS * CTX * HKV * D
    assert mem.temp_size_in_bytes < 64 << 20


@pytest.mark.parametrize("generation", tpu_compile.one_generation(2))
def test_flash_attn_with_kvcache_body_fp8_bytes_in_place(generation):
    """The torch op body on float8_e4m3fn caches as the torch functions pass them (their uint8
    bytes, read as e4m3 by the kernel) with per-token and per-head scales, at Llama-3-8B decode
    (64 x 8192, page 128): no cache-sized temporary, no copy or convert of a cache (a
    uint8 -> float8 bitcast of the caches in the body compiled to two 512 MiB copies)."""
    import re

    page_size = 128
    pages = CTX // page_size
    cache = ((SEQS * pages, page_size, HKV, D), jnp.uint8)
    scale = ((SEQS * pages, HKV, page_size), jnp.float32)
    compiled = tpu_compile.compile_for(
        generation,
        PA.ops._kvcache_jax,
        ((SEQS, HQ, D), jnp.bfloat16),
        cache,
        cache,
        ((SEQS,), jnp.int32),
        ((SEQS, pages), jnp.int32),
        ((SEQS + 1,), jnp.int32),
        ((1,), jnp.int32),
        causal=True,
        k_scale=scale,
        v_scale=scale,
        k_head_scale=((HKV,), jnp.float32),
        v_head_scale=((HKV,), jnp.float32),
        static_argnames=("causal",),
    )
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20
    n = SEQS * pages
    for shape, op in re.findall(
        r"= \w+\[([\d,]+)\]\S* (copy|convert|transpose)\(", compiled.as_text()
    ):
        assert int(shape.split(",")[0]) != n, f"a cache is copied: {op} [{shape}]"
