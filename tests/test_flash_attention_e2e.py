"""flash-attention-tpu end to end through Transformers, no download: tiny random Llama and Qwen3
models, our attention through the registered name and through
attn_implementation="<org>/flash-attention-tpu" (Transformers' own Hub kernel loading, from the
build's offline cache). Logits match sdpa (f32, 1e-4 relative) on padded batches, greedy
generation is identical, and one training step's gradients match. A tiny random GPT-OSS (random
attention sinks, sliding-window and full layers), which pins its flash kernels, runs through the
registered name against eager attention."""

import pytest
import torch

import kernel_loader

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

import transformers  # noqa: E402,F401  (pinned in requirements.txt)

fa = kernel_loader.load_kernel("flash_attention")
NAME = fa.register()


def _config(kind):
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3Config(head_dim=32, **common)


def _model(kind, attn="sdpa"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(kind), attn_implementation=attn, dtype=torch.float32
    )
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding in row 1
    return ids, mask


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _check_logits_and_generate(model_ours, model_ref):
    ids, mask = _batch()
    with torch.no_grad():
        ref = model_ref(ids, attention_mask=mask).logits
        got = model_ours(ids, attention_mask=mask).logits
        keep = mask.bool()  # padded positions are not compared (flash paths output zeros there)
        assert _rel(got[keep], ref[keep]) < 1e-4
        # unpadded batch: the dense (non-varlen) path
        ref_u = model_ref(ids).logits
        got_u = model_ours(ids).logits
        assert _rel(got_u, ref_u) < 1e-4
        gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        want = model_ref.generate(ids, attention_mask=mask, **gen_kw)
        have = model_ours.generate(ids, attention_mask=mask, **gen_kw)
    assert torch.equal(have, want)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_registered_name_matches_sdpa(kind):
    ref = _model(kind)
    ours = _model(kind)
    ours.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == NAME
    _check_logits_and_generate(ours, ref)


@pytest.mark.parametrize("kind", ["llama"])
def test_training_step_gradients_match_sdpa(kind):
    ids, mask = _batch()
    grads = {}
    for attn in ("sdpa", NAME):
        model = _model(kind)
        model.set_attn_implementation(attn)
        model.train()
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[attn] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads[NAME].keys() and grads["sdpa"]
    for n, g in grads["sdpa"].items():
        assert _rel(grads[NAME][n], g) < 1e-4, n


def test_hub_attn_implementation_from_pretrained(monkeypatch, tmp_path):
    """attn_implementation="<org>/flash-attention-tpu" through Transformers' Hub kernel loading."""
    kernel_loader.use_offline_hub(monkeypatch)
    repo = kernel_loader.repo_id("flash_attention")
    ref = _model("qwen3")
    ref.save_pretrained(tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation=repo, allow_all_kernels=True, dtype=torch.float32
    ).eval()
    assert ours.config._attn_implementation == repo
    from transformers import modeling_flash_attention_utils as mfu

    # Transformers resolved our package's functions; count the calls it makes through them.
    calls = {"dense": 0, "varlen": 0}
    for key, attr in (("dense", "_flash_fn"), ("varlen", "_flash_varlen_fn")):
        fn = getattr(mfu, attr)
        assert fn.__name__ == ("flash_attn_func" if key == "dense" else "flash_attn_varlen_func")
        # (kernels imports the package under its content-hashed name; a build already imported
        # under that name in this process is the identical module.)
        assert "flash-attention-tpu" in fn.__code__.co_filename

        def counting(*a, _fn=fn, _key=key, **k):
            calls[_key] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(mfu, attr, counting)
    _check_logits_and_generate(ours, ref)
    assert calls["dense"] > 0 and calls["varlen"] > 0


# ------------------------------------------------------------------------------------ GPT-OSS
# GPT-OSS lists its flash kernels in `_compatible_flash_implementations`: Transformers replaces
# any other flash implementation (Hub repos whose name says "flash" included) by that list's
# first entry, so `attn_implementation="<org>/flash-attention-tpu"` never reaches our kernel.
# The name register() returns does not say "flash" and is used as given, sinks included.


def _gpt_oss(attn):
    cfg = transformers.GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn, dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # sinks of the size a trained model has (init gives ~0.02: no effect)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g) * 2)
    return model


def test_gpt_oss_pins_flash_kernels_but_not_the_registered_name():
    from transformers.utils.generic import is_flash_attention_requested

    pinned = transformers.GptOssForCausalLM._compatible_flash_implementations
    assert pinned and kernel_loader.repo_id("flash_attention") not in pinned
    assert is_flash_attention_requested(
        requested_attention_implementation=kernel_loader.repo_id("flash_attention")
    )  # so the repo id would be replaced by pinned[0]
    assert isinstance(NAME, str) and not is_flash_attention_requested(
        requested_attention_implementation=NAME
    )


def test_gpt_oss_registered_name_matches_eager(monkeypatch):
    ref = _gpt_oss("eager")
    ours = _gpt_oss(NAME)
    assert ours.config._attn_implementation == NAME  # not redirected to a pinned flash kernel
    calls = []
    for fn in ("flash_attn_func", "flash_attn_varlen_func"):
        orig = getattr(fa.ops, fn)
        monkeypatch.setattr(fa.ops, fn, lambda *a, _o=orig, **k: calls.append(k) or _o(*a, **k))
    ids, mask = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
        keep = mask.bool()
        assert _rel(got[keep], want[keep]) < 1e-4
        gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(
            ours.generate(ids, attention_mask=mask, **gen_kw),
            ref.generate(ids, attention_mask=mask, **gen_kw),
        )
        # the sinks matter here: without them eager's logits move far beyond the tolerance
        for layer in ref.model.layers:
            layer.self_attn.sinks.zero_()
        no_sinks = ref(ids, attention_mask=mask).logits
        assert _rel(no_sinks[keep], want[keep]) > 1e-2
    assert calls and all(k.get("s_aux") is not None for k in calls)
    assert {k["window_size"] for k in calls} >= {(3, -1), (-1, -1)}  # sliding and full layers
