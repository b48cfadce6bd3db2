"""The main job: load every built kernel through `get_kernel(..., version=1)` from the offline Hub
cache (exactly what a user downloads), run it against its reference, then run tiny random
Transformers models (and a tiny Flux-style Diffusers transformer) through the kernels, and print
what ran and how it compared.

    make demo            (builds dist/ first, then runs this)

Runs on CPU, where the torch-cpu variants execute the Pallas kernels in interpret mode.
Exits non-zero if any comparison fails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(os.environ.get("DEMO_DIST", ROOT / "dist"))
# Offline, before huggingface_hub is imported: get_kernel must resolve v1 from the build's cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(DIST / "hub-cache")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch

from collection import load_collection

failures: list[str] = []


def report(what: str, ok: bool, detail: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}: {detail}", flush=True)
    if not ok:
        failures.append(what)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def load(coll, key):
    from kernels import get_kernel

    entry = coll.kernel(key)
    repo_id = coll.repo_id(entry)
    t = time.perf_counter()
    mod = get_kernel(repo_id, version=entry.version, trust_remote_code=True)
    variant = Path(mod.__file__).parent.name
    print(
        f"\n== {repo_id} v{entry.version}: loaded variant {variant}, op namespace "
        f"{mod._ops._OPS_NAME} ({time.perf_counter() - t:.1f} s)",
        flush=True,
    )
    return mod


# ------------------------------------------------------------------------------------ ragged dot


def demo_ragged_dot(mod) -> None:
    torch.manual_seed(0)
    group_sizes = torch.tensor([5, 0, 1, 37, 0, 16, 21, 4], dtype=torch.int32)  # empty, one-row
    m, k, n = int(group_sizes.sum()) + 6, 200, 384  # 6 rows past the groups: output zero
    lhs = torch.randn(m, k)
    rhs = torch.randn(len(group_sizes), k, n) / k**0.5
    t = time.perf_counter()
    out = mod.ragged_dot(lhs, rhs, group_sizes)
    dt = time.perf_counter() - t
    ref = torch.zeros(m, n)
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        ref[start : start + size] = lhs[start : start + size] @ rhs[g]
        start += size
    err = rel_err(out, ref)
    report(
        f"ragged_dot f32 lhs{list(lhs.shape)} rhs{list(rhs.shape)} groups {group_sizes.tolist()}",
        err < 1e-5,
        f"relative error {err:.2e} vs a per-group torch loop ({dt:.2f} s)",
    )

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    mod.register()
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        model.set_experts_implementation("tokamax_ragged_dot")
        t = time.perf_counter()
        logits = model(ids).logits
        dt = time.perf_counter() - t
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    err = rel_err(logits, ref_logits)
    report(
        "tiny Qwen3-MoE (8 experts, top-2), experts_implementation='tokamax_ragged_dot'",
        err < 1e-4,
        f"logits relative error {err:.2e} vs 'eager' ({dt:.2f} s forward)",
    )
    report(
        "  greedy generate, 6 new tokens",
        torch.equal(tokens, ref_tokens),
        f"{tokens[0, -6:].tolist()} vs eager {ref_tokens[0, -6:].tolist()}",
    )


# ------------------------------------------------------------------------------- flash attention


def _sdpa_reference(q, k, v, causal):
    # [B, S, H, D] flash-attn layout -> sdpa's [B, H, S, D], K/V heads repeated for GQA.
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    mask = None
    if causal:  # bottom-right aligned, as flash-attn
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


def demo_flash_attention(mod, coll) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 200, 8, 64)
    k = torch.randn(2, 200, 2, 64)
    v = torch.randn(2, 200, 2, 64)
    t = time.perf_counter()
    out = mod.flash_attn_func(q, k, v, causal=True)
    dt = time.perf_counter() - t
    err = rel_err(out, _sdpa_reference(q, k, v, causal=True))
    report(
        "flash_attn_func f32 causal GQA q[2,200,8,64] k/v[2,200,2,64]",
        err < 1e-5,
        f"relative error {err:.2e} vs torch sdpa ({dt:.2f} s)",
    )

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    repo_id = coll.repo_id(coll.kernel("flash_attention"))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref_logits = model(ids).logits
        ref_tokens = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
        model.set_attn_implementation(repo_id)
        t = time.perf_counter()
        logits = model(ids).logits
        dt = time.perf_counter() - t
        tokens = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    err = rel_err(logits, ref_logits)
    report(
        f"tiny Llama, attn_implementation='{repo_id}'",
        err < 1e-4,
        f"logits relative error {err:.2e} vs 'sdpa' ({dt:.2f} s forward)",
    )
    report(
        "  greedy generate, 6 new tokens",
        torch.equal(tokens, ref_tokens),
        f"{tokens[0, -6:].tolist()} vs sdpa {ref_tokens[0, -6:].tolist()}",
    )


def demo_diffusers(mod) -> None:
    """A tiny random-weight Flux-style transformer (joint text + image attention, d=64) through the
    kernel as a Diffusers attention backend, against Diffusers' native (SDPA) backend."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # "attention backends are experimental", per call

    name = mod.register()  # Transformers and Diffusers: one name
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(16, 24, 24),
    ).eval()
    side, n_text = 6, 10  # 36 image + 10 text tokens
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1], img_ids[:, 2] = (
        torch.arange(side * side) // side,
        torch.arange(side * side) % side,
    )
    inputs = dict(
        hidden_states=torch.randn(2, side * side, 8),
        encoder_hidden_states=torch.randn(2, n_text, 32),
        pooled_projections=torch.randn(2, 32),
        timestep=torch.tensor([0.9, 0.4]),
        img_ids=img_ids,
        txt_ids=torch.zeros(n_text, 3),
    )
    mask = torch.ones(2, n_text + side * side, dtype=torch.bool)
    mask[1, 6:n_text] = False  # row 1: a 6-token prompt padded to 10

    def run(backend, **kw):
        model.set_attention_backend(backend)
        t = time.perf_counter()
        with torch.no_grad():
            out = model(**inputs, **kw).sample
        return out, time.perf_counter() - t

    ref, _ = run("native")
    got, dt = run(name)
    err = rel_err(got, ref)
    report(
        f"tiny Flux-style transformer (2 heads, d=64, {side * side} image + {n_text} text tokens), "
        f"set_attention_backend('{name}')",
        err < 1e-4,
        f"output relative error {err:.2e} vs 'native' ({dt:.2f} s forward)",
    )
    kw = dict(joint_attention_kwargs={"attention_mask": mask})
    ref_m, _ = run("native", **kw)
    got_m, dt = run(name, **kw)
    err = rel_err(got_m, ref_m)
    report(
        "  padded prompt (key mask, packed varlen)",
        err < 1e-4,
        f"output relative error {err:.2e} vs 'native' ({dt:.2f} s forward)",
    )

    def denoise(backend):
        model.set_attention_backend(backend)
        scheduler = FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(3)
        latents = inputs["hidden_states"][:1].clone()
        with torch.no_grad():
            for t in scheduler.timesteps:
                step = dict(
                    inputs,
                    hidden_states=latents,
                    timestep=(t / 1000).expand(1),
                    encoder_hidden_states=inputs["encoder_hidden_states"][:1],
                    pooled_projections=inputs["pooled_projections"][:1],
                )
                latents = scheduler.step(model(**step).sample, t, latents).prev_sample
        return latents

    err = rel_err(denoise(name), denoise("native"))
    report(
        "  3 flow-matching Euler steps", err < 1e-4, f"latents relative error {err:.2e} vs 'native'"
    )
    model.set_attention_backend("native")


# ------------------------------------------------------------------------------- paged attention


def demo_paged_attention(mod) -> None:
    torch.manual_seed(0)
    batch, new, heads, kv_heads, dim, block, blocks_per_seq = 3, 4, 8, 2, 64, 16, 4
    cache_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    k_cache = torch.randn(batch * blocks_per_seq, block, kv_heads, dim)
    v_cache = torch.randn(batch * blocks_per_seq, block, kv_heads, dim)
    block_table = torch.randperm(batch * blocks_per_seq, dtype=torch.int32).reshape(batch, -1)
    q = torch.randn(batch, new, heads, dim)
    k_new = torch.randn(batch, new, kv_heads, dim)
    v_new = torch.randn(batch, new, kv_heads, dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    t = time.perf_counter()
    out = mod.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k_new,
        v=v_new,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        causal=True,
    )
    dt = time.perf_counter() - t
    errs, cache_ok = [], True
    for b in range(batch):
        length = int(cache_seqlens[b]) + new
        pages = block_table[b]
        k_seq = k_ref[pages].reshape(-1, kv_heads, dim)
        v_seq = v_ref[pages].reshape(-1, kv_heads, dim)
        k_seq[cache_seqlens[b] : length] = k_new[b]
        v_seq[cache_seqlens[b] : length] = v_new[b]
        ref = _sdpa_reference(q[b : b + 1], k_seq[None, :length], v_seq[None, :length], causal=True)
        errs.append(rel_err(out[b : b + 1], ref))
        cache_ok &= torch.equal(k_cache[pages].reshape(-1, kv_heads, dim), k_seq)
        cache_ok &= torch.equal(v_cache[pages].reshape(-1, kv_heads, dim), v_seq)
    report(
        f"flash_attn_with_kvcache f32 paged, block {block}, cache lengths "
        f"{cache_seqlens.tolist()} + {new} new",
        max(errs) < 1e-5,
        f"max relative error {max(errs):.2e} vs dense sdpa ({dt:.2f} s)",
    )
    report("  KV cache after the call", cache_ok, "new K/V written in place, bit-exact")

    from transformers import (
        ContinuousBatchingConfig,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 11, 3)]
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    # A small paged cache: Transformers' default sizing would take most of the host's memory.
    cb_config = ContinuousBatchingConfig(
        block_size=16, num_blocks=32, max_batch_tokens=64, max_blocks_per_request=4
    )
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist()
            for p in prompts
        ]
        # Continuous batching loads the Hub repo itself (through get_kernel, offline here).
        model.set_attn_implementation(mod.integration.HUB_ATTN_IMPLEMENTATION)
        t = time.perf_counter()
        outputs = model.generate_batch(
            inputs=prompts, generation_config=gen, continuous_batching_config=cb_config
        )
        dt = time.perf_counter() - t
    got = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    report(
        f"tiny Llama generate_batch (continuous batching), "
        f"attn_implementation='{mod.integration.HUB_ATTN_IMPLEMENTATION}'",
        got == expected,
        f"{len(prompts)} prompts, greedy tokens {'equal' if got == expected else 'differ from'} "
        f"plain generate ({dt:.2f} s)",
    )


def main() -> int:
    if not (DIST / "hub-cache").is_dir():
        print(f"{DIST}/hub-cache missing: run `make demo` (it builds first)", file=sys.stderr)
        return 2
    coll = load_collection()
    print(
        f"kernels from {DIST / 'hub-cache'} (HF_HUB_OFFLINE=1); torch {torch.__version__}, "
        f"Pallas in {os.environ.get('PALLAS_TPU_INTERPRET', 'plain')} interpret mode on CPU"
    )
    demo_ragged_dot(load(coll, "ragged_dot"))
    flash = load(coll, "flash_attention")
    demo_flash_attention(flash, coll)
    demo_diffusers(flash)
    demo_paged_attention(load(coll, "paged_attention"))
    print()
    if failures:
        print(f"{len(failures)} check(s) failed: {failures}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
