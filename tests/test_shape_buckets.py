"""Shape buckets (torch-ext/shape_buckets.py): the policy itself; padding never changes a result
(odd sizes against the f32 references, forward and backward, interpret mode); and bounded
compilation: a 200-call serving trace (prompt lengths 1-4096, decode batches 1-64, top-8 of 128
experts) compiles each op at most once per bucket it touches, counted from the bridge's compile
keys (`op.compile_stats`), with a real sample checked against JAX's own jit cache; and a
Transformers `generate_batch` over 20 prompts of different lengths compiles a bounded number of
paged-attention kernels."""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_loader
import shape_buckets as SB

RD = kernel_loader.load_kernel("ragged_dot")
FA = kernel_loader.load_kernel("flash_attention")
PA = kernel_loader.load_kernel("paged_attention")


# -------------------------------------------------------------------------------------------------
# The policy
# -------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch):
    monkeypatch.delenv(SB.BUCKETS_ENV, raising=False)


def test_default_token_buckets():
    assert SB.token_buckets(64) == [8, 16, 24, 32, 40, 48, 56, 64]
    up_to_4096 = SB.token_buckets(4096)
    assert len(up_to_4096) == 32 and up_to_4096[-1] == 4096
    assert SB.count_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [SB.bucket_tokens(n) for n in (0, 1, 9, 16, 17, 33, 65, 4095, 4097)] == [
        8,
        8,
        16,
        16,
        24,
        40,
        80,
        4096,
        5120,
    ]


@given(n=st.integers(1, 1 << 20))
def test_token_bucket_properties(n):
    b = SB.bucket_tokens(n)
    assert b >= n and b % SB.TOKEN_ALIGN == 0 and SB.bucket_tokens(b) == b
    assert SB.bucket_tokens(n + 1) >= b  # monotone
    if n > 8:
        assert b <= math.ceil(n * 1.25 / 8) * 8  # at most 25% (plus alignment) past the floor
    c = SB.bucket_count(n)
    assert c >= n and c & (c - 1) == 0 and SB.bucket_count(c) == c and c < 2 * n


def test_policy_from_env_and_overrides(monkeypatch):
    monkeypatch.setenv(SB.BUCKETS_ENV, "steps=8,min_tokens=64,min_count=8")
    assert SB.bucket_policy() == SB.BucketPolicy(8, 64, 8)
    assert SB.bucket_tokens(65) == 72 and SB.bucket_count(3) == 8
    monkeypatch.setenv(SB.BUCKETS_ENV, "off")
    assert SB.bucket_tokens(17) == 17 and SB.bucket_count(3) == 3
    monkeypatch.setenv(SB.BUCKETS_ENV, "steps=three")
    with pytest.raises(ValueError, match=SB.BUCKETS_ENV):
        SB.bucket_policy()
    monkeypatch.delenv(SB.BUCKETS_ENV)
    with SB.use_bucket_policy(min_tokens=128) as policy:
        assert policy.min_tokens == 128 and SB.bucket_tokens(3) == 128
        # Every vendored copy (each package has its own) follows the same setting.
        for pkg in (RD, FA, PA):
            assert pkg.shape_buckets.bucket_tokens(3) == 128
        with SB.use_bucket_policy(enabled=False):
            assert RD.shape_buckets.bucket_tokens(3) == 3
        assert SB.bucket_tokens(3) == 128
    assert SB.bucket_tokens(3) == 8
    with pytest.raises(ValueError, match="steps_per_octave"):
        SB.BucketPolicy(steps_per_octave=3)
    with pytest.raises(TypeError, match="policy"):
        SB.set_bucket_policy("off")


# -------------------------------------------------------------------------------------------------
# Padding never changes a result (interpret mode). A 32-token floor puts every size below in one
# bucket (heavily padded: 1 -> 32), so each op compiles once for all examples.
# -------------------------------------------------------------------------------------------------


def in_one_bucket(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        with SB.use_bucket_policy(min_tokens=32, min_count=4):
            return test(*args, **kwargs)

    return run


def _gmm_torch_ref(lhs, rhs, group_sizes):
    out = torch.zeros(lhs.shape[0], rhs.shape[2], dtype=torch.float32)
    start = 0
    rows = []
    for g, size in enumerate(group_sizes.tolist()):
        rows.append(lhs[start : start + size].float() @ rhs[g].float())
        start += size
    rest = out[start:]
    return torch.cat(rows + [rest]) if rows else out


@settings(max_examples=5)
@given(m=st.integers(1, 16), data=st.data())
@in_one_bucket
def test_gmm_odd_rows_exact(m, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    num_groups, k, n = 4, 128, 128
    cuts = sorted(data.draw(st.lists(st.integers(0, m), min_size=num_groups, max_size=num_groups)))
    group_sizes = torch.tensor(np.diff([0] + cuts), dtype=torch.int32)
    lhs = torch.randn(m, k, generator=g, requires_grad=True)
    rhs = torch.randn(num_groups, k, n, generator=g, requires_grad=True)
    out = RD.gmm(lhs, rhs, group_sizes)
    assert out.shape == (m, n)
    want = _gmm_torch_ref(lhs, rhs, group_sizes)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(
        out.detach().numpy(),
        RD.reference.gmm_reference(lhs.detach().numpy(), rhs.detach().numpy(), group_sizes.numpy()),
        atol=1e-4,
        rtol=1e-4,
    )
    dout = torch.randn(m, n, generator=g)
    got = torch.autograd.grad(out, (lhs, rhs), dout)
    ref = torch.autograd.grad(want, (lhs, rhs), dout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    tg = RD.tgmm(lhs.detach(), dout, group_sizes)
    torch.testing.assert_close(tg, ref[1], atol=1e-3, rtol=1e-4)


def _torch_varlen_ref(q, k, v, cu_q, cu_k, causal):
    """Differentiable f32 reference: each sequence alone, bottom-right causal alignment."""
    outs = []
    hq, hkv = q.shape[1], k.shape[1]
    for s in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs = q[a:b].float().transpose(0, 1)
        ks = k[c:d].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        vs = v[c:d].float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        scores = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        mask = torch.from_numpy(np.array(FA.reference.mask(b - a, d - c, causal=causal)))
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        p = torch.nan_to_num(p)  # a query that sees no key gives 0
        outs.append((p @ vs).transpose(0, 1))
    return torch.cat(outs)


@settings(max_examples=4)
@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@in_one_bucket
def test_flash_varlen_odd_sizes_exact(lens, causal, seed):
    g = torch.Generator().manual_seed(seed)
    k_lens = [n + (i % 2) * 2 for i, n in enumerate(lens)]  # some sequences with more keys
    cu_q = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(k_lens)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 8, generator=g, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), 2, 8, generator=g, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), 2, 8, generator=g, requires_grad=True)
    out = FA.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=causal)
    want = _torch_varlen_ref(q, k, v, cu_q, cu_k, causal)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    do = torch.randn(out.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do)
    ):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@settings(max_examples=4)
@given(
    batch=st.sampled_from([1, 3]),
    sq=st.integers(1, 5),
    extra_k=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
@in_one_bucket
def test_flash_dense_odd_sizes_exact(batch, sq, extra_k, seed):
    """A dense call off the buckets runs packed into the varlen form: same result and gradients
    (bottom-right causal alignment with Sq != Sk included)."""
    g = torch.Generator().manual_seed(seed)
    sk = sq + extra_k
    q = torch.randn(batch, sq, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(batch, sk, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(batch, sk, 2, 8, generator=g, requires_grad=True)
    out, lse, _ = FA.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (batch, 4, sq)
    cu_q = torch.arange(batch + 1) * sq
    cu_k = torch.arange(batch + 1) * sk
    want = _torch_varlen_ref(
        q.reshape(-1, 4, 8), k.reshape(-1, 2, 8), v.reshape(-1, 2, 8), cu_q, cu_k, True
    ).reshape(q.shape)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    do = torch.randn(out.shape, generator=g)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do)
    ):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@settings(max_examples=4)
@given(batch=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
@in_one_bucket
def test_paged_kvcache_odd_batch_exact(batch, seed):
    """flash_attn_with_kvcache decode at any batch 1..4: one kernel (32 tokens, 4 slots)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block, hkv, d, hq = 12, 16, 2, 128, 4
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: batch * 3].reshape(batch, 3).to(torch.int32)
    seqlens = torch.randint(1, 3 * block, (batch,), generator=g, dtype=torch.int32)
    q = torch.randn(batch, 1, hq, d, generator=g)
    out = PA.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True
    )
    cu = np.arange(batch + 1)
    want = PA.reference.paged_attention_token_major_ref(
        q.reshape(batch, hq, d).numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        seqlens.numpy(),
        table.numpy(),
        cu,
        np.array([batch]),
    )
    np.testing.assert_allclose(out.reshape(batch, hq, d).numpy(), want, atol=2e-5, rtol=2e-5)


# -------------------------------------------------------------------------------------------------
# Compile counts
# -------------------------------------------------------------------------------------------------


def test_real_calls_compile_once_per_bucket():
    """Real calls (interpret mode, default buckets): row counts 9, 12, 16 share bucket 16, 17 and
    21 share 24. The bridge's keys, JAX's traces and JAX's jit cache all grow by exactly the
    buckets touched."""
    stats = RD.ops.gmm_op.compile_stats
    g = torch.Generator().manual_seed(0)
    rhs = torch.randn(2, 128, 256, generator=g)
    before_traces, before_cache = stats.traces, stats.jax_cache_size()
    stats.keys.clear()
    for m in (9, 12, 16, 17, 21, 12):
        lhs = torch.randn(m, 128, generator=g)
        group_sizes = torch.tensor([m // 2, m - m // 2], dtype=torch.int32)
        out = RD.gmm(lhs, rhs, group_sizes)
        np.testing.assert_allclose(
            out.numpy(),
            RD.reference.gmm_reference(lhs.numpy(), rhs.numpy(), group_sizes.numpy()),
            atol=1e-4,
            rtol=1e-4,
        )
    assert len(stats.keys) == 2
    assert stats.traces - before_traces == stats.jax_cache_size() - before_cache
    assert stats.traces - before_traces <= 2  # 0 if an earlier test compiled these buckets


class _Experts:
    """A Transformers-style experts module (unfused gating: no `_default_apply_gate`)."""

    def __init__(self, num_experts=128, hidden=8, intermediate=8):
        self.num_experts = num_experts
        self.gate_up_proj = torch.zeros(num_experts, 2 * intermediate, hidden)
        self.down_proj = torch.zeros(num_experts, hidden, intermediate)

    def _apply_gate(self, h):
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def _serving_trace(seed=0, calls=200):
    """(kind, size) per call: half prefills of 1-4096 prompt tokens (log-uniform), half decode
    steps of batches 1-64."""
    rng = np.random.default_rng(seed)
    trace = []
    for i in range(calls):
        if i % 2 == 0:
            trace.append(("prefill", int(np.exp(rng.uniform(0, np.log(4096))))))
        else:
            trace.append(("decode", int(rng.integers(1, 65))))
    return trace


def _run_trace(trace, top_k=8):
    """Every public op of the three packages over the trace (counting mode: nothing compiles or
    runs); returns the bucketed sizes each op should have compiled for."""
    g = torch.Generator().manual_seed(0)
    experts = _Experts()
    heads, kv_heads, d, page, pages_per_seq, num_pages = 2, 1, 8, 16, 256, 64
    kv_cache = torch.zeros(num_pages, 2 * kv_heads, page, d)
    k_cache = torch.zeros(num_pages, page, kv_heads, d)
    touched = {name: set() for name in ("gmm", "flash", "rpa", "kvcache", "paged_varlen")}
    for kind, size in trace:
        tokens = size
        # MoE layer: top-8 of 128 experts per token.
        # Distinct experts per token: a random start, then strides of num_experts // top_k.
        start = torch.randint(0, experts.num_experts, (tokens, 1), generator=g)
        index = (start + torch.arange(top_k) * (experts.num_experts // top_k)) % experts.num_experts
        weights = torch.full((tokens, top_k), 1.0 / top_k)
        out = RD.experts_forward(experts, torch.zeros(tokens, 8), index, weights)
        assert out.shape == (tokens, 8)
        touched["gmm"].add(SB.bucket_tokens(tokens * top_k))
        kv_lens = torch.randint(1, pages_per_seq * page, (size,), generator=g, dtype=torch.int32)
        if kind == "prefill":
            q = torch.zeros(tokens, heads, d)
            k = torch.zeros(tokens, kv_heads, d)
            if size % 3:  # one prompt, dense layout
                FA.flash_attn_func(q[None], k[None], k[None], causal=True)
                if SB.bucket_tokens(size) == size:
                    touched["flash"].add(("dense", size))
                else:
                    touched["flash"].add(("varlen", SB.bucket_tokens(size), SB.bucket_count(1)))
            else:  # the prompt split into up to three packed sequences
                cuts = sorted({0, size, *torch.randint(0, size + 1, (2,), generator=g).tolist()})
                cu = torch.tensor(cuts, dtype=torch.int32)
                FA.flash_attn_varlen_func(q, k, k, cu, cu, causal=True)
                touched["flash"].add(
                    ("varlen", SB.bucket_tokens(size), SB.bucket_count(len(cuts) - 1))
                )
            cu = torch.tensor([0, size], dtype=torch.int32)
            PA.flash_attn_varlen_func(q, k, k, cu, cu, causal=True)
            touched["paged_varlen"].add((SB.bucket_tokens(size), SB.bucket_count(1)))
            # Chunked prefill of this prompt through the paged cache (one sequence).
            table = torch.randint(0, num_pages, (1, pages_per_seq), generator=g, dtype=torch.int32)
            kv = torch.tensor([max(size, int(kv_lens[0]))], dtype=torch.int32)
            PA.ragged_paged_attention(q, kv_cache, kv, table, cu, 1)
            touched["rpa"].add((SB.bucket_tokens(size), SB.bucket_count(1)))
        else:  # decode: one new token per sequence
            batch = size
            q = torch.zeros(batch, heads, d)
            table = torch.randint(
                0, num_pages, (batch, pages_per_seq), generator=g, dtype=torch.int32
            )
            cu = torch.arange(batch + 1, dtype=torch.int32)
            PA.ragged_paged_attention(q, kv_cache, kv_lens, table, cu, batch)
            touched["rpa"].add((SB.bucket_tokens(batch), SB.bucket_count(batch)))
            PA.flash_attn_with_kvcache(
                q[:, None], k_cache, k_cache, cache_seqlens=kv_lens, block_table=table, causal=True
            )
            touched["kvcache"].add((SB.bucket_tokens(batch), SB.bucket_count(batch)))
    return touched


def _ops_and_stats():
    return {
        "gmm": RD.ops.gmm_op,
        "flash": FA.ops.fwd_op,
        "rpa": PA.ops.rpa_op,
        "kvcache": PA.ops.kvcache_op,
        "paged_varlen": PA.ops.varlen_op,
    }


def _count_trace(trace):
    ops = _ops_and_stats()
    saved = {name: set(op.compile_stats.keys) for name, op in ops.items()}
    for op in ops.values():
        op.compile_stats.keys.clear()
    try:
        with (
            RD.jax_bridge.count_compiles_only(),
            FA.jax_bridge.count_compiles_only(),
            PA.jax_bridge.count_compiles_only(),
            torch.no_grad(),
        ):
            touched = _run_trace(trace)
        counts = {name: len(op.compile_stats.keys) for name, op in ops.items()}
    finally:
        for name, op in ops.items():
            op.compile_stats.keys.clear()
            op.compile_stats.keys.update(saved[name])
    return counts, touched


@pytest.mark.timeout(300)
def test_serving_trace_compiles_once_per_bucket(monkeypatch):
    trace = _serving_trace()
    counts, touched = _count_trace(trace)
    # experts_forward runs two grouped matmuls (gate_up, down) per row bucket.
    assert counts["gmm"] == 2 * len(touched["gmm"])
    for name in ("flash", "rpa", "kvcache", "paged_varlen"):
        assert counts[name] == len(touched[name]), name
    # The stated bounds (README): rows 8..32768 have 44 buckets; decode batches 1..64 reach 11
    # (token bucket, sequence bucket) pairs; prompts 1..4096 have 32 token buckets.
    decode_pairs = {(SB.bucket_tokens(b), SB.bucket_count(b)) for b in range(1, 65)}
    assert len(SB.token_buckets(4096 * 8, 8)) == 44 and len(decode_pairs) == 11
    assert len(touched["gmm"]) <= 44 and counts["kvcache"] <= 11
    assert counts["rpa"] <= 11 + 32 and counts["paged_varlen"] <= 32 and counts["flash"] <= 2 * 32
    # Without buckets the same trace compiles once per distinct size: the counter sees it.
    # (The first 60 calls suffice to show it.)
    monkeypatch.setenv(SB.BUCKETS_ENV, "off")
    head = trace[:60]
    raw, _ = _count_trace(head)
    assert raw["gmm"] == 2 * len({size for _, size in head}) > counts["gmm"] // 2
    assert raw["kvcache"] == len({s for kind, s in head if kind == "decode"}) > counts["kvcache"]


# -------------------------------------------------------------------------------------------------
# Transformers generate_batch: 20 prompts of different lengths
# -------------------------------------------------------------------------------------------------


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

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
    # Greedy runs of a fixed length: no end-of-sequence token (plain `generate` would otherwise
    # stop at the config's eos id 2, continuous batching does not).
    model.generation_config.eos_token_id = None
    return model


def _prompts(count=20):
    rng = np.random.default_rng(3)
    return [
        rng.integers(1, 128, size=int(n)).tolist()
        for n in rng.permutation(np.arange(1, 3 * count, 3))[:count]
    ]


def _generate_batch(model, prompts, monkeypatch, new_tokens):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    repo = PA.integration.HUB_ATTN_IMPLEMENTATION.split(":")[0]
    root = kernel_loader.variant_path("paged_attention").parent.parent
    monkeypatch.setenv("LOCAL_KERNELS", f"{repo}={root}")
    gc = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(
        block_size=16, num_blocks=64, max_batch_tokens=64, max_blocks_per_request=8
    )
    model.set_attn_implementation(PA.integration.HUB_ATTN_IMPLEMENTATION)
    try:
        with torch.no_grad():
            res = model.generate_batch(
                inputs=prompts, generation_config=gc, continuous_batching_config=cb
            )
    finally:
        model.set_attn_implementation("eager")
    return [res[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_generate_batch_20_prompts_bounded_compiles(monkeypatch):
    """20 prompts of lengths 1..58 through continuous batching, 32 new tokens each: every step has
    a different token count, but the paged varlen op compiles at most once per (query bucket, key
    bucket, sequence bucket) seen, and for fewer than half the steps (counting mode: nothing
    runs)."""
    model = _tiny_llama()
    prompts = _prompts()
    stats = PA.ops.varlen_op.compile_stats
    saved = set(stats.keys)
    stats.keys.clear()
    shapes = []
    original = PA.ops.varlen_op

    def recording(q, k, *rest, **kw):
        shapes.append((q.shape[0], k.shape[0], rest[1].shape[0]))
        return original(q, k, *rest, **kw)

    monkeypatch.setattr(PA.ops, "varlen_op", recording)
    try:
        with PA.jax_bridge.count_compiles_only():
            _generate_batch(model, prompts, monkeypatch, new_tokens=32)
        compiles = len(stats.keys)
    finally:
        stats.keys.clear()
        stats.keys.update(saved)
    steps = len(shapes) // 2  # two layers per step
    print(f"generate_batch: {steps} steps, {compiles} compiled kernels")
    assert steps > 40
    assert compiles == len(set(shapes))
    assert all(tq == SB.bucket_tokens(tq) and tk == SB.bucket_tokens(tk) for tq, tk, _ in shapes)
    # The packed keys of all sequences grow every step, the query tokens and the number of
    # sequences change: still at most one compile per bucket triple, well under one per step
    # (56 steps -> 25 kernels at the defaults).
    assert compiles <= 30 and compiles < steps // 2 + 1


@pytest.mark.e2e
@pytest.mark.sweep
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") != "sweep",
    reason="long form (about 2 minutes): HYPOTHESIS_PROFILE=sweep",
)
def test_generate_batch_20_prompts_real(monkeypatch):
    """The same 20 prompts for real: greedy tokens equal plain eager `generate`, and the kernels
    JAX compiled (its traces) equal the bridge's distinct keys."""
    from transformers import GenerationConfig

    model = _tiny_llama()
    prompts = _prompts()
    gc = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist()
            for p in prompts
        ]
    stats = PA.ops.varlen_op.compile_stats
    stats.reset()
    got = _generate_batch(model, prompts, monkeypatch, new_tokens=3)
    assert got == want
    assert stats.traces <= len(stats.keys) <= 60


# -------------------------------------------------------------------------------------------------
# Warm-up: after each package's warmup, calls anywhere inside its maxima compile nothing new
# -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_warmup_covers_every_bucket():
    g = torch.Generator().manual_seed(5)
    ops = _ops_and_stats()
    saved = {name: set(op.compile_stats.keys) for name, op in ops.items()}
    for op in ops.values():
        op.compile_stats.keys.clear()
    heads, kv_heads, d, page, num_pages = 2, 1, 8, 16, 32
    kv_cache = torch.zeros(num_pages, 2 * kv_heads, page, d)
    k_cache = torch.zeros(num_pages, page, kv_heads, d)
    experts = _Experts(num_experts=16)
    try:
        with (
            RD.jax_bridge.count_compiles_only(),
            FA.jax_bridge.count_compiles_only(),
            PA.jax_bridge.count_compiles_only(),
            torch.no_grad(),
        ):
            calls = {
                "gmm": RD.warmup(experts, max_tokens=40, top_k=4),
                "flash": FA.warmup(
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    head_dim=d,
                    max_tokens=100,
                    max_seqs=5,
                    dtype=torch.float32,
                ),
                "rpa": PA.warmup(
                    kv_cache, num_heads=heads, max_tokens=70, max_seqs=6, pages_per_seq=8
                ),
                "kvcache": PA.warmup_kvcache(
                    k_cache, k_cache, num_heads=heads, max_batch=20, max_blocks=8
                ),
                "paged_varlen": PA.warmup_varlen(
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    head_dim=d,
                    dtype=torch.float32,
                    max_query_tokens=40,
                    max_key_tokens=90,
                    max_seqs=3,
                ),
            }
            warm = {name: set(op.compile_stats.keys) for name, op in ops.items()}
            assert calls["gmm"] == len(warm["gmm"]) // 2 == len(SB.token_buckets(160, 4))
            assert calls["kvcache"] == len(warm["kvcache"]) == 6  # batches 1..20: 6 pairs
            for name in ("flash", "rpa", "paged_varlen"):
                assert calls[name] == len(warm[name]), name
            for _ in range(12):
                tokens = int(torch.randint(1, 41, (1,), generator=g))
                top = torch.randint(0, 16, (tokens, 4), generator=g)
                RD.experts_forward(experts, torch.zeros(tokens, 8), top, torch.ones(tokens, 4))
                n = int(torch.randint(1, 6, (1,), generator=g))
                cuts = torch.sort(torch.randint(0, 101, (n - 1,), generator=g)).values.tolist()
                total = cuts[-1] if cuts and cuts[-1] > 0 else 1
                cu = torch.tensor(
                    [0] + [min(c, total) for c in cuts[:-1]] + [total], dtype=torch.int32
                )
                q = torch.zeros(total, heads, d)
                k = torch.zeros(total, kv_heads, d)
                FA.flash_attn_varlen_func(q, k, k, cu, cu, causal=True)
                FA.flash_attn_func(q[None], k[None], k[None], causal=True)
                batch = int(torch.randint(1, 7, (1,), generator=g))
                tokens = int(torch.randint(batch, 71, (1,), generator=g))
                cu_q = torch.tensor([0] * batch + [tokens], dtype=torch.int32)
                kv_lens = torch.full((batch,), tokens, dtype=torch.int32)
                table = torch.randint(0, num_pages, (batch, 8), generator=g, dtype=torch.int32)
                PA.ragged_paged_attention(
                    torch.zeros(tokens, heads, d), kv_cache, kv_lens, table, cu_q, batch
                )
                batch = int(torch.randint(1, 21, (1,), generator=g))
                PA.flash_attn_with_kvcache(
                    torch.zeros(batch, 1, heads, d),
                    k_cache,
                    k_cache,
                    cache_seqlens=torch.full((batch,), 5, dtype=torch.int32),
                    block_table=table[:1].expand(batch, 8).contiguous(),
                    causal=True,
                )
                tq = int(torch.randint(1, 41, (1,), generator=g))
                tk = int(torch.randint(tq, 91, (1,), generator=g))
                PA.flash_attn_varlen_func(
                    torch.zeros(tq, heads, d),
                    torch.zeros(tk, kv_heads, d),
                    torch.zeros(tk, kv_heads, d),
                    torch.tensor([0, tq], dtype=torch.int32),
                    torch.tensor([0, tk], dtype=torch.int32),
                    causal=True,
                )
            after = {name: set(op.compile_stats.keys) for name, op in ops.items()}
    finally:
        for name, op in ops.items():
            op.compile_stats.keys.clear()
            op.compile_stats.keys.update(saved[name])
    for name in ops:
        assert after[name] == warm[name], f"{name}: {sorted(after[name] - warm[name])[:3]}"


def _tensor_shapes(key):
    """The tensor shapes in a bridge compile key (nested tuples), in order."""
    if isinstance(key, tuple) and len(key) == 3 and key[0] == "tensor":
        return [key[1]]
    if isinstance(key, tuple):
        return [s for part in key for s in _tensor_shapes(part)]
    return []


@pytest.mark.timeout(300)
def test_flash_warmup_dense_batches():
    """`dense_batches` warms dense `flash_attn_func` calls of those batch sizes: the warm-up makes
    exactly the kernels that every such call (any length up to max_tokens) and the varlen calls
    hit, once each, and after it none of those calls compiles anything; a batch it was not told
    about still does."""
    op = FA.ops.fwd_op
    saved = set(op.compile_stats.keys)
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, max_tokens = 2, 1, 8, 40
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32)

    def dense_call(b, n):
        q, k = torch.zeros(b, n, heads, d), torch.zeros(b, n, kv_heads, d)
        FA.flash_attn_func(q, k, k, causal=True)

    try:
        with FA.jax_bridge.count_compiles_only(), torch.no_grad():
            # What the calls hit, without a warm-up: every dense call of batch 2 (dense kernels
            # on the buckets, packed otherwise) and 3 (always packed), every varlen length.
            op.compile_stats.keys.clear()
            for b in (2, 3):
                for n in range(1, max_tokens + 1):
                    dense_call(b, n)
            for n in range(1, max_tokens + 1):
                cu = torch.tensor([0, n], dtype=torch.int32)
                q, k = torch.zeros(n, heads, d), torch.zeros(n, kv_heads, d)
                FA.flash_attn_varlen_func(q, k, k, cu, cu, causal=True)
            hit = set(op.compile_stats.keys)
            op.compile_stats.keys.clear()
            calls = FA.warmup(max_tokens=max_tokens, dense_batches=(2, 3), **kw)
            warm = set(op.compile_stats.keys)
            assert warm == hit and calls == len(warm)
            # Both forms are there: dense batch-2 kernels and packed ones (batch 3 packs to 3
            # sequence slots, padded to 4).
            shapes = [_tensor_shapes(key) for key in warm]
            assert any((2, 16, heads, d) in s for s in shapes)
            assert any((5,) in s for s in shapes)
            for _ in range(30):
                b = int(torch.randint(2, 4, (1,), generator=g))
                dense_call(b, int(torch.randint(1, max_tokens + 1, (1,), generator=g)))
            assert set(op.compile_stats.keys) == warm
            # The default warms batch 1 only: a batch-4 dense call on a bucket compiles its own.
            op.compile_stats.keys.clear()
            FA.warmup(max_tokens=max_tokens, **kw)
            before = set(op.compile_stats.keys)
            dense_call(4, 16)
            assert len(set(op.compile_stats.keys) - before) == 1
    finally:
        op.compile_stats.keys.clear()
        op.compile_stats.keys.update(saved)
    with pytest.raises(ValueError, match="dense_batches"):
        FA.warmup(max_tokens=8, dense_batches=(0,), **kw)


# -------------------------------------------------------------------------------------------------
# benchmarks/bucket_padding.py: how the padding cost is priced (no compile here)
# -------------------------------------------------------------------------------------------------


def test_bucket_padding_prices_no_work_on_padded_rows():
    """The exact and bucketed sides of a call differ only by padding: the same useful work, the
    same work-list trips where the tiles agree, and at least as many bytes at the bucket."""
    import bucket_padding as BP

    gs = BP._routing(5, np.random.default_rng(0))
    exact, padded = (BP.gmm_side("gmm_down", m, gs, "v6e") for m in (40, SB.bucket_tokens(41)))
    assert exact.cost.useful_flops == padded.cost.useful_flops
    assert padded.cost.hbm_bytes >= exact.cost.hbm_bytes
    exact, padded = (BP.flash_side(t, [0, 37], "v6e") for t in (37, SB.bucket_tokens(37)))
    assert exact.cost.useful_flops == padded.cost.useful_flops
    q, kv = [1] * 5, [100, 7, 300, 16, 17]
    exact = BP.paged_side(q, kv, 5, 5, "v6e")
    padded = BP.paged_side(q, kv, SB.bucket_tokens(5), SB.bucket_count(5), "v6e")
    assert exact.cost.useful_flops == padded.cost.useful_flops
    if exact.tiles == padded.tiles:
        assert exact.trips == padded.trips
    # Padded sequence slots cost grid steps (the static list is sized by them), not work.
    assert padded.cost.grid_steps >= exact.cost.grid_steps


def test_bucket_padding_schedules_interpolate_along_the_row_tile(monkeypatch, tmp_path):
    import bucket_padding as BP

    monkeypatch.setattr(BP, "CACHE", tmp_path / "cache.json")
    monkeypatch.setattr(BP, "_source_hash", lambda op: "sources")
    sched = BP.Schedules("v6e", compile_budget=0)

    def model(b):
        return {
            "hot_is_grid": False,
            "hot_bundles": b,
            "per_step_overhead_bundles": 2 * b,
            "side_region_mean_bundles": b,
            "outside_bundles": 30,
            "xla": [],
        }

    for tm, b in ((16, 100), (64, 400)):
        sched.cache[sched.key("gmm_down", (tm, 768, 2048))] = {"_model": model(b)}
    m, how = sched.model("gmm_down", (32, 768, 2048))
    assert (
        how == "interpolated" and m["hot_bundles"] == 200 and m["per_step_overhead_bundles"] == 400
    )
    assert m["hot_is_grid"] is False
    assert sched.model("gmm_down", (16, 768, 2048)) == (model(100), "compiled")
    assert sched.model("gmm_down", (128, 768, 2048)) == (model(400), "nearest")
    assert sched.model("gmm_down", (32, 768, 1024))[1] == "nearest"  # other tn: no bracket
    assert sched.model("flash_attention", (128, 128, 128, 128)) == (None, "missing")
    assert BP._bisection([1, 2, 3, 4, 5]) == [1, 5, 3, 2, 4]


def test_readme_padding_paragraph_is_generated_from_results_json():
    """README's padding numbers ("Compilation and shape buckets", between the markers) are the
    paragraph benchmarks/bucket_padding.py writes from results.json: they cannot drift from it
    (rerunning the script rewrites both)."""
    import json
    import re
    from pathlib import Path

    import bucket_padding as BP

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    result = json.loads((root / "benchmarks" / "results" / "results.json").read_text())
    a, b = readme.index(BP.README_START), readme.index(BP.README_END)
    stated = re.sub(r"\s+", " ", readme[a + len(BP.README_START) : b]).strip()
    expected = re.sub(r"\s+", " ", BP.readme_paragraph(result["bucket_padding"])).strip()
    assert stated == expected, "rerun benchmarks/bucket_padding.py (it rewrites the paragraph)"
