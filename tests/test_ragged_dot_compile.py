"""ragged-dot-tpu: deviceless Mosaic compiles for v5e, v6e and TPU7x at production MoE shapes.

Qwen3-30B-A3B experts (hidden 2048, expert intermediate 768, 128 experts, top-8) at 64 and 4096
tokens, Mixtral-8x7B (hidden 4096, intermediate 14336, 8 experts, top-2) at 4096 tokens: for each
projection the forward gmm (weights as Transformers stores them, [E, out, in]), dlhs (the same
weights read with the other layout flag) and tgmm, in bf16 with the default tiling of the
generation; plus the quantised forward (int8 on v5e / v6e, float8_e4m3fn on TPU7x). In CI every
kernel compiles on every generation at some production shape, the forward every (model, projection)
on some generation (tpu_compile.generation_per_case); HYPOTHESIS_PROFILE=sweep compiles the whole
matrix.
"""

import functools

import jax.numpy as jnp
import pytest

import kernel_loader
import tpu_compile

# No skip without libtpu: `make setup` installs it, and a missing one must fail loudly.
pytestmark = [pytest.mark.compile]

rd = kernel_loader.load_kernel("ragged_dot")
K = rd.kernel

BF16 = jnp.bfloat16
# name: (tokens, experts, top_k, [(K_in, N_out) per projection])
MODELS = {
    "qwen3_30b_a3b_64tok": (64, 128, 8, [(2048, 1536), (768, 2048)]),
    "qwen3_30b_a3b_4096tok": (4096, 128, 8, [(2048, 1536), (768, 2048)]),
    "mixtral_8x7b_4096tok": (4096, 8, 2, [(4096, 28672), (14336, 4096)]),
}


def _compile_gmm(
    gen, m, k, n, g, *, transpose_rhs, rhs_dtype=BF16, quantised=False, lhs_dtype=BF16
):
    rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
    args = [((m, k), lhs_dtype), (rhs_shape, rhs_dtype), ((g,), jnp.int32)]
    if quantised:
        args.append(((g, n), jnp.float32))
    fn = functools.partial(K.gmm, transpose_rhs=transpose_rhs, generation=gen)
    return tpu_compile.compile_for(gen, fn, *args)


# The forward at every (model, projection), each on one generation in CI (every generation gets
# two, one at 4096 tokens); every generation for every case in the long form.
@pytest.mark.parametrize(
    "generation,model,projection",
    tpu_compile.generation_per_case([(m, p) for m in MODELS for p in (0, 1)]),
)
def test_compiles_forward(generation, model, projection):
    tokens, experts, top_k, projections = MODELS[model]
    k, n = projections[projection]
    # Forward: out = x @ W^T with W stored [E, N, K] (transpose_rhs=True).
    compiled = _compile_gmm(generation, tokens * top_k, k, n, experts, transpose_rhs=True)
    # The work list is built by loop-free XLA ops (each while-loop iteration costs microseconds).
    assert tpu_compile.xla_while_loops(compiled) == []


# The two backward kernels at the training shapes, one case per generation in CI (Qwen3-30B-A3B
# down on v5e, Mixtral-8x7B gate_up on v6e, Qwen3-30B-A3B gate_up on TPU7x: 10-28 s each); every
# (model, projection), decode included, on every generation in the long form.
@pytest.mark.parametrize(
    "generation,model,projection",
    tpu_compile.generation_per_case(
        [(m, p) for m in MODELS for p in (0, 1)]
        if tpu_compile.LONG_FORM
        else [
            ("qwen3_30b_a3b_4096tok", 1),
            ("mixtral_8x7b_4096tok", 0),
            ("qwen3_30b_a3b_4096tok", 0),
        ]
    ),
)
def test_compiles_dlhs_and_tgmm(generation, model, projection):
    tokens, experts, top_k, projections = MODELS[model]
    m = tokens * top_k
    k, n = projections[projection]
    # dlhs: dx = dout @ W with the same [E, N, K] array (transpose_rhs=False, K and N swap roles).
    assert _compile_gmm(generation, m, n, k, experts, transpose_rhs=False) is not None
    # Weight gradient [E, N, K] = tgmm(dout, x).
    fn = functools.partial(K.tgmm, generation=generation)
    compiled = tpu_compile.compile_for(
        generation, fn, ((m, n), BF16), ((m, k), BF16), ((experts,), jnp.int32)
    )
    assert tpu_compile.xla_while_loops(compiled) == []


@pytest.mark.parametrize(
    "generation,model",
    [(g, "qwen3_30b_a3b_4096tok") for g in tpu_compile.TESTED_GENERATIONS]
    # Mixtral-8x7B in the long form only (the same kernel at a wider weight block)
    + (tpu_compile.generation_per_case(["mixtral_8x7b_4096tok"]) if tpu_compile.LONG_FORM else []),
)
def test_compiles_quantised_forward(generation, model):
    tokens, experts, top_k, projections = MODELS[model]
    qdtype = jnp.float8_e4m3fn if generation == "tpu7x" else jnp.int8
    k, n = projections[0]
    assert (
        _compile_gmm(
            generation,
            tokens * top_k,
            k,
            n,
            experts,
            transpose_rhs=True,
            rhs_dtype=qdtype,
            quantised=True,
        )
        is not None
    )


# v5e in CI, every generation in the long form.
@pytest.mark.parametrize("gen", tpu_compile.one_generation(0))
def test_f32_gmm_and_tgmm_compile_at_highest_precision(gen):
    """f32 operands multiply at HIGHEST precision (a TPU v5e chip left 2.4e-3 relative error at
    the MXU's default one-pass bf16): Mosaic must lower those dots, forward and tgmm (whose f32
    output is its own accumulator: tiling.tgmm_sums_in_output)."""
    m, k, n, g = 1024, 512, 512, 8
    f32 = jnp.float32
    assert _compile_gmm(gen, m, k, n, g, transpose_rhs=False, rhs_dtype=f32, lhs_dtype=f32)
    fn = functools.partial(K.tgmm, generation=gen)
    assert tpu_compile.compile_for(gen, fn, ((m, k), f32), ((m, n), f32), ((g,), jnp.int32))


# The gated gate_up gmm (activation fused in the epilogue) at production shapes:
# Qwen3-30B-A3B (concatenated gate/up, [E, 2I, H] as Transformers stores it, SiLU) and
# GPT-OSS-120B-like experts (hidden 2880, I 2880, 128 experts, top-4; interleaved gate/up stored
# [E, H, 2I], biases, clamped SwiGLU; I is not a multiple of the output tile).
GATED = {
    "qwen3_30b_a3b_4096tok_silu": (4096 * 8, 2048, 768, 128, "silu", "concatenated", True, False),
    "gpt_oss_120b_4096tok_swiglu": (
        4096 * 4,
        2880,
        2880,
        128,
        "gpt_oss_swiglu",
        "interleaved",
        False,
        True,
    ),
    # I = 320 is no multiple of 128: the concatenated gate / up halves cannot be blocks of one
    # array (a TPU block's last dim is a multiple of 128 or the whole dim); they go in as two.
    # Interpret mode accepts any block, so only a compile (or a chip) catches it.
    "i320_concatenated_bias": (1024, 384, 320, 6, "silu", "concatenated", False, True),
}


@pytest.mark.parametrize(
    "generation,model",
    [(g, list(GATED)[0]) for g in tpu_compile.TESTED_GENERATIONS]
    + tpu_compile.generation_per_case(list(GATED)[1:], start=2),
)
def test_compiles_gated_gate_up(generation, model):
    m, k, i, experts, act, layout, transpose_rhs, with_bias = GATED[model]
    rhs_shape = (experts, 2 * i, k) if transpose_rhs else (experts, k, 2 * i)
    fn = functools.partial(
        K.gmm_gated,
        activation=act,
        layout=layout,
        transpose_rhs=transpose_rhs,
        generation=generation,
    )
    args = [((m, k), BF16), (rhs_shape, BF16), ((experts,), jnp.int32)]
    if with_bias:
        args.append(((experts, 2 * i), BF16))
    assert tpu_compile.compile_for(generation, fn, *args) is not None


# The VMEM model against the compiler: tiles the model's need sets apart (tiling.gmm_vmem_bytes,
# WINDOW_SCRATCH_BYTES). Mixtral-8x7B down at 4096 tokens on TPU7x (K in seven blocks, an f32
# accumulator) and Qwen3-30B-A3B's fused gate at 16384 tokens on v6e (two weight blocks, one K
# block): the compile's scoped VMEM is 30.8 and 27.1 MiB there.
VMEM_CASES = {
    "mixtral_down_tpu7x": ("tpu7x", 8192, 14336, 4096, 8, (512, 2048, 2048), None),
    "qwen3_gate_up_silu_v6e": ("v6e", 131072, 2048, 768, 128, (1024, 2048, 768), "concatenated"),
}


@pytest.mark.parametrize("case", list(VMEM_CASES))
def test_vmem_model_bounds_the_compilers_allocation(case):
    """Compiled with vmem_limit_bytes at the model's need (no headroom) the gmm fits; 3 MiB
    below it Mosaic runs out of scoped VMEM: the model is an upper bound, and tight enough that
    the tile search does not give away tiles that fit (it once charged a whole tile's f32
    product, 8 MiB here, and ruled out the first case's tiles on TPU7x's 32 MiB budget)."""
    gen, m, k, n, g, (tm, tk, tn), layout = VMEM_CASES[case]
    need = rd.tiling.gmm_vmem_bytes(tm, tk, tn, BF16, BF16, BF16, k=k, gate_layout=layout)
    assert need <= rd.tiling.vmem_budget_bytes(rd.tiling.GENERATIONS[gen])

    def compile_at(limit):
        tiling = rd.tiling.GmmTiling(tm=tm, tk=tk, tn=tn, vmem_limit_bytes=limit)
        if layout is None:
            fn = functools.partial(K.gmm, generation=gen, tiling=tiling)
        else:
            fn = functools.partial(K.gmm_gated, layout=layout, generation=gen, tiling=tiling)
        wn = n if layout is None else 2 * n
        args = [((m, k), BF16), ((g, k, wn), BF16), ((g,), jnp.int32)]
        return tpu_compile.compile_for(gen, fn, *args)

    assert compile_at(need) is not None
    with pytest.raises(Exception, match="ScopedVmemOom"):
        compile_at(need - 3 * 1024 * 1024)


def test_tgmm_vmem_model_bounds_the_compilers_allocation():
    """tgmm's VMEM model (tiling.tgmm_vmem_bytes: buffers, f32 accumulator, the windows'
    scratch) against the compiler, both ways, at DeepSeek-V3-like gate's v5e tiles (1024 / 1024
    / 2048, bf16 output: the compile's scoped VMEM is 29.6 MiB, the buffers and accumulator
    28). It used to charge a whole (tk, tn) f32 product and merged value and the row-masked
    operand copies (50 MiB here), which kept larger tiles out of TPU7x's 32 MiB budget."""
    gen, m, k, n, g, (tm, tk, tn) = "v5e", 8192, 7168, 2048, 64, (1024, 1024, 2048)
    need = rd.tiling.tgmm_vmem_bytes(tm, tk, tn, BF16, BF16, BF16)

    def compile_at(limit):
        tiling = rd.tiling.TgmmTiling(tm=tm, tk=tk, tn=tn, vmem_limit_bytes=limit)
        fn = functools.partial(K.tgmm, generation=gen, tiling=tiling)
        return tpu_compile.compile_for(gen, fn, ((m, k), BF16), ((m, n), BF16), ((g,), jnp.int32))

    assert compile_at(need) is not None
    with pytest.raises(Exception, match="ScopedVmemOom"):
        compile_at(need - 3 * 1024 * 1024)
