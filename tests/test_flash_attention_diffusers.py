"""flash-attention-tpu as a Diffusers attention backend (diffusers 0.42.1), no download.

The dispatcher backend against diffusers' native (SDPA) backend on the shapes DiT models pass
([B, S, H, D], non-causal, joint text+image, GQA, d 64/128, f32/bf16, padding masks as 2-D, 4-D
and float masks), forward and gradients; the errors for what it cannot run; and, marked e2e, tiny
random-weight Flux-style and SD3-style transformers built from configs: outputs, a masked prompt,
a 3-step flow-matching denoising loop, and LoRA-adapter gradients against the native backend."""

import diffusers  # noqa: F401  (pinned in requirements.txt)
import pytest
import torch
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    attention_backend,
    dispatch_attention_fn,
)

import kernel_loader

pytestmark = pytest.mark.timeout(300)

fa = kernel_loader.load_kernel("flash_attention")
NAME = fa.register()


@pytest.fixture(autouse=True)
def _restore_active_backend():
    """`set_attention_backend` also sets diffusers' process-wide active backend: put it back."""
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    return q, k, v


def _attend(backend, q, k, v, **kw):
    """Output and (q, k, v) gradients of one dispatcher call on fresh leaves."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = dispatch_attention_fn(q, k, v, backend=backend, **kw)
    g = torch.Generator().manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach our kernel's torch ops (so a test cannot pass on native alone)."""
    calls = {"dense": 0, "varlen": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(fa.ops, "flash_attn_func", counted("dense", fa.ops.flash_attn_func))
    monkeypatch.setattr(
        fa.ops, "flash_attn_varlen_func", counted("varlen", fa.ops.flash_attn_varlen_func)
    )
    return calls


def _check_against_native(q, k, v, tol, **kw):
    out, grads = _attend(NAME, q, k, v, **kw)
    ref, ref_grads = _attend(AttentionBackendName.NATIVE, q, k, v, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel(out, ref) < tol
    for name, got, want in zip("qkv", grads, ref_grads):
        assert _rel(got, want) < tol, name


def test_register_names_one_backend_for_both_libraries():
    from transformers import AttentionInterface

    assert NAME == "pallas_tpu_attention" and fa.register() == NAME  # again: harmless
    member = AttentionBackendName(NAME)
    assert member.value == NAME and list(AttentionBackendName).count(member) == 1
    assert _AttentionBackendRegistry._backends[member] is fa.integration.diffusers_attention
    assert NAME in AttentionInterface._global_mapping
    before = _AttentionBackendRegistry.get_active_backend()[0]
    with attention_backend(NAME):
        assert _AttentionBackendRegistry.get_active_backend()[0] == member
    assert _AttentionBackendRegistry.get_active_backend()[0] == before != member
    with pytest.raises(ValueError, match="lowercase"):
        fa.register("Pallas_TPU")


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,dtype",
    [
        (2, 40, 40, 2, 2, 64, torch.float32),  # self-attention, d=64
        (1, 24, 56, 2, 2, 128, torch.float32),  # cross-attention, d=128
        (2, 33, 33, 4, 2, 64, torch.float32),  # GQA, ragged length
        (1, 40, 40, 2, 2, 128, torch.bfloat16),
    ],
)
def test_dispatch_matches_native(b, sq, sk, hq, hkv, d, dtype, kernel_calls):
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype)
    kw = dict(enable_gqa=hq != hkv)
    _check_against_native(q, k, v, 1e-4 if dtype == torch.float32 else 2e-2, **kw)
    assert kernel_calls == {"dense": 1, "varlen": 0}


def test_dispatch_scale_and_causal():
    q, k, v = _qkv(1, 32, 32, 2, 2, 64)
    _check_against_native(q, k, v, 1e-4, scale=0.05)
    _check_against_native(q, k, v, 1e-4, is_causal=True)


def _outer_padding_mask(lengths, s):
    """HunyuanVideo's mask: queries and keys both padded, [B, 1, S, S], key 0 always kept."""
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    mask = (valid[:, None, :, None] & valid[:, None, None, :]).clone()
    mask[..., 0] = True
    return mask


def _block_mask(s, cut):
    """Two documents in one sequence: block-diagonal, [S, S]."""
    seg = (torch.arange(s) >= cut).long()
    return seg[:, None] == seg[None, :]


@pytest.mark.parametrize(
    "kind", ["bool_2d", "float_4d_inf", "empty_row", "outer_4d", "block_2d", "all_true"]
)
def test_dispatch_masks_match_native(kind, kernel_calls):
    b, s, h, d = 2, 24, 2, 64
    q, k, v = _qkv(b, s, s, h, h, d, seed=1)
    keys = torch.arange(s)[None, :] < torch.tensor([[s], [13]])  # row 1 keeps 13 keys
    if kind == "bool_2d":
        mask = keys
    elif kind == "float_4d_inf":
        mask = torch.zeros(b, 1, 1, s).masked_fill(~keys[:, None, None, :], float("-inf"))
    elif kind == "empty_row":  # batch row 1 sees no key: zeros, as SDPA gives
        mask = keys.clone()
        mask[1] = False
    elif kind == "outer_4d":
        mask = _outer_padding_mask([s, 13], s)
    elif kind == "block_2d":
        mask = _block_mask(s, 9)
    else:
        mask = torch.ones(b, 1, s, s, dtype=torch.bool)
    _check_against_native(q, k, v, 1e-4, attn_mask=mask)
    # all-true runs dense; every other mask packs the real tokens and runs varlen
    assert kernel_calls == (
        {"dense": 1, "varlen": 0} if kind == "all_true" else {"dense": 0, "varlen": 1}
    )
    if kind != "all_true":  # the mask matters
        plain = dispatch_attention_fn(q, k, v, backend=AttentionBackendName.NATIVE)
        masked = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=AttentionBackendName.NATIVE)
        assert _rel(masked, plain) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_masks_read_as_keep_or_drop(dtype):
    """Additive masks built with the dtype's minimum (diffusers, Transformers) or -inf drop keys."""
    keep = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    for fill in (torch.finfo(dtype).min, float("-inf")):
        additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill)
        assert torch.equal(fa.integration._bool_mask(additive), keep)
    assert fa.integration._bool_mask(keep) is keep


def test_dispatch_mask_gqa_bf16():
    q, k, v = _qkv(2, 24, 24, 4, 2, 128, torch.bfloat16, seed=2)
    mask = torch.arange(24)[None, :] < torch.tensor([[24], [10]])
    _check_against_native(q, k, v, 2e-2, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(dropout_p=0.1), NotImplementedError, "dropout"),
        (
            dict(attn_mask=torch.randn(1, 1, 24, 24)),
            ValueError,
            "arbitrary additive attention bias",
        ),
        (
            dict(attn_mask=torch.ones(24, 24, dtype=torch.bool).tril()),
            ValueError,
            "distinct query rows",
        ),
        (
            dict(
                attn_mask=torch.arange(24).expand(1, 2, 1, 24)
                < torch.tensor([24, 20])[:, None, None]
            ),
            ValueError,
            "differs between heads",
        ),
        (dict(attn_mask=torch.ones(1, 24, dtype=torch.long)), TypeError, "dtype"),
        (dict(attn_mask=torch.ones(1, 23, dtype=torch.bool)), ValueError, "does not broadcast"),
        (
            dict(attn_mask=torch.ones(1, 24, dtype=torch.bool), is_causal=True),
            ValueError,
            "one of them",
        ),
        (dict(attention_kwargs=dict(return_lse=True)), NotImplementedError, "return_lse"),
    ],
)
def test_dispatch_rejects(kw, exc, match, monkeypatch):
    calls = []
    monkeypatch.setattr(fa.ops, "flash_attn_func", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(fa.ops, "flash_attn_varlen_func", lambda *a, **k: calls.append(a))
    q, k, v = _qkv(1, 24, 24, 2, 2, 64)
    with pytest.raises(exc, match=match):
        dispatch_attention_fn(q, k, v, backend=NAME, **kw)
    assert not calls  # rejected before any kernel runs


def test_dispatch_rejects_causal_cross_attention_and_fp16():
    q, k, v = _qkv(1, 16, 24, 2, 2, 64)
    with pytest.raises(ValueError, match="top-left"):
        dispatch_attention_fn(q, k, v, is_causal=True, backend=NAME)
    q, k, v = (x.half() for x in _qkv(1, 16, 16, 2, 2, 64))
    with pytest.raises(TypeError, match="float16"):
        dispatch_attention_fn(q, k, v, backend=NAME)


# ------------------------------------------------------------------------------- tiny models (e2e)


def _flux(dtype=torch.float32):
    from diffusers import FluxTransformer2DModel

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
    )
    return model.to(dtype).eval()


def _flux_inputs(dtype=torch.float32, batch=2, side=4, n_text=8):
    """Packed latents [B, side*side, 8], text [B, n_text, 32], pooled text, positions."""
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side * side) // side
    img_ids[:, 2] = torch.arange(side * side) % side
    return dict(
        hidden_states=torch.randn(batch, side * side, 8, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, n_text, 32, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, 32, generator=g).to(dtype),
        timestep=torch.tensor([0.9, 0.4]).to(dtype)[:batch],
        img_ids=img_ids,
        txt_ids=torch.zeros(n_text, 3),
    )


def _sd3(dtype=torch.float32):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    # SD3.5-style: QK RMS norm, layer 0 also runs the image-only second attention.
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=128,
        num_attention_heads=1,
        joint_attention_dim=32,
        caption_projection_dim=128,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=8,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )
    return model.to(dtype).eval()


def _sd3_inputs(dtype=torch.float32, batch=2):
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(batch, 4, 8, 8, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, 6, 32, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, 32, generator=g).to(dtype),
        timestep=torch.tensor([900.0, 300.0])[:batch],
    )


def _run(model, backend, inputs, **kw):
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**inputs, **kw).sample


@pytest.mark.e2e
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_flux_matches_native(dtype, tol, kernel_calls):
    model, inputs = _flux(dtype), _flux_inputs(dtype)
    ref = _run(model, "native", inputs)
    assert kernel_calls["dense"] == 0
    got = _run(model, NAME, inputs)
    assert kernel_calls["dense"] == 2  # one joint block + one single block
    assert got.dtype == dtype and _rel(got, ref) < tol
    # The attention context manager (processors left at their default backend) gives the same.
    model.set_attention_backend("native")
    for module in model.modules():
        if hasattr(getattr(module, "processor", None), "_attention_backend"):
            module.processor._attention_backend = None
    with attention_backend(NAME), torch.no_grad():
        assert torch.equal(model(**inputs).sample, got)
    assert kernel_calls["dense"] == 4


@pytest.mark.e2e
def test_flux_padded_prompt_matches_native(kernel_calls):
    """Row 1's prompt has 5 real tokens of 8: its padded text keys are masked ([B, S_txt + S_img]
    key mask, text first, as Flux's processor concatenates)."""
    model, inputs = _flux(), _flux_inputs()
    mask = torch.ones(2, 8 + 16, dtype=torch.bool)
    mask[1, 5:8] = False
    kw = dict(joint_attention_kwargs={"attention_mask": mask})
    ref = _run(model, "native", inputs, **kw)
    got = _run(model, NAME, inputs, **kw)
    assert kernel_calls == {"dense": 0, "varlen": 2}
    assert _rel(got, ref) < 1e-4
    assert _rel(ref, _run(model, "native", inputs)) > 1e-3  # the mask matters


@pytest.mark.e2e
def test_sd3_matches_native(kernel_calls):
    model, inputs = _sd3(), _sd3_inputs()
    ref = _run(model, "native", inputs)
    # JointAttnProcessor2_0 calls SDPA directly: 2 joint layers + 1 image-only attention swapped.
    assert fa.integration.use_dispatcher(model) == 3
    assert torch.equal(_run(model, "native", inputs), ref)  # the swap alone changes nothing
    assert kernel_calls["dense"] == 0
    got = _run(model, NAME, inputs)
    assert kernel_calls["dense"] == 3
    assert _rel(got, ref) < 1e-4


@pytest.mark.e2e
def test_flux_denoising_loop_matches_native(kernel_calls):
    from diffusers import FlowMatchEulerDiscreteScheduler

    model, inputs = _flux(), _flux_inputs(batch=1)

    def denoise(backend):
        model.set_attention_backend(backend)
        scheduler = FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(3)
        latents = inputs["hidden_states"].clone()
        with torch.no_grad():
            for t in scheduler.timesteps:
                step_in = dict(inputs, hidden_states=latents, timestep=(t / 1000).expand(1))
                noise_pred = model(**step_in).sample
                latents = scheduler.step(noise_pred, t, latents).prev_sample
        return latents

    ref, got = denoise("native"), denoise(NAME)
    assert kernel_calls["dense"] == 3 * 2  # 3 steps, 2 attention layers
    assert _rel(got, ref) < 1e-4
    assert _rel(ref, inputs["hidden_states"]) > 1e-2  # the loop moved the latents


class _LoRALinear(torch.nn.Module):
    """base(x) + B(A(x)): a rank-r adapter on a frozen projection."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(base.in_features + base.out_features)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_lora_training_step_gradients_match_native(family, kernel_calls):
    model, inputs = (_flux(), _flux_inputs()) if family == "flux" else (_sd3(), _sd3_inputs())
    if family == "sd3":
        fa.integration.use_dispatcher(model)
    model.requires_grad_(False)
    for module in list(model.modules()):
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            if isinstance(getattr(module, proj, None), torch.nn.Linear):
                setattr(module, proj, _LoRALinear(getattr(module, proj)))
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) >= 8
    target = torch.randn(
        _run(model, "native", inputs).shape, generator=torch.Generator().manual_seed(5)
    )

    def grads(backend):
        model.set_attention_backend(backend)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(**inputs).sample, target)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in adapters.items()}

    (ref_loss, ref), (loss, got) = grads("native"), grads(NAME)
    assert kernel_calls["dense"] == (2 if family == "flux" else 3)
    assert _rel(loss, ref_loss) < 1e-5
    for n in adapters:
        assert _rel(got[n], ref[n]) < 1e-4, n


@pytest.mark.tpu_interpret
def test_dispatch_packed_mask_tpu_interpret(tpu_interpret):
    """The packed sequences of a query+key padding mask (uneven lengths, one query group seeing a
    single key) in TPU interpret mode: races, NaN-filled memory and out-of-bounds reads raise."""
    q, k, v = _qkv(2, 16, 16, 2, 1, 64, seed=3)
    mask = _outer_padding_mask([16, 7], 16)
    out = dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=NAME)
    ref = dispatch_attention_fn(
        q, k, v, attn_mask=mask, enable_gqa=True, backend=AttentionBackendName.NATIVE
    )
    assert _rel(out, ref) < 1e-4
