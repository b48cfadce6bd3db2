"""ragged-dot-tpu end to end through Transformers: tiny random Qwen3-MoE and Mixtral models built
from configs (no download), the kernel loaded with `kernels.get_kernel` from the build's offline
Hub cache and registered as an experts implementation, compared with experts_implementation="eager".
"""

import copy

import pytest
import torch

import kernel_loader

pytestmark = pytest.mark.e2e

import transformers  # noqa: E402,F401  (pinned in requirements.txt)

NAME = "tokamax_ragged_dot"


@pytest.fixture
def hub_kernel(monkeypatch):
    import kernels

    kernel_loader.use_offline_hub(monkeypatch)
    k = kernels.get_kernel(kernel_loader.repo_id("ragged_dot"), version=1, trust_remote_code=True)
    assert set(k.register()) == {"tokamax_ragged_dot", "pallas_ragged_dot"}
    return k


def _qwen3_moe(dtype=torch.float32, seed=0, moe_intermediate_size=48):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()


def _mixtral(dtype=torch.float32, seed=0):
    cfg = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).to(dtype).eval()


def _gpt_oss(dtype=torch.float32, seed=0):
    """Tiny GPT-OSS: interleaved gate/up stored [E, H, 2I] (is_transposed), biases, clamped SwiGLU.
    Weights and biases are scaled up from the (tiny, zero-bias) init so that the pre-activations
    cross the +-7 clamp and the biases matter."""
    cfg = transformers.GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.mul_(10)
            ex.gate_up_proj_bias.normal_(0, 2)
            ex.down_proj_bias.normal_(0, 0.5)
    return model.to(dtype).eval()


def _ids(batch=2, length=11, vocab=96, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, impl, ids):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("build", [_qwen3_moe, _mixtral], ids=["qwen3_moe", "mixtral"])
def test_logits_match_eager_f32(hub_kernel, build, monkeypatch):
    model = build(torch.float32)
    ids = _ids()
    eager = _logits(model, "eager", ids)
    calls = []
    gmm_op = hub_kernel.ops.gmm_op
    monkeypatch.setattr(hub_kernel.ops, "gmm_op", lambda *a: calls.append(1) or gmm_op(*a))
    ours = _logits(model, NAME, ids)
    assert len(calls) == 2 * 2  # gate_up and down in each of the 2 layers ran our kernel
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4 * eager.abs().max().item())


@pytest.mark.parametrize("build", [_qwen3_moe, _mixtral], ids=["qwen3_moe", "mixtral"])
def test_logits_match_eager_bf16(hub_kernel, build):
    model = build(torch.bfloat16)
    ids = _ids()
    eager = _logits(model, "eager", ids)
    ours = _logits(model, NAME, ids)
    # Both round every intermediate to bf16 (eps 2^-8); our f32 accumulation differs from eager's
    # only by a few of those roundings through two layers.
    scale = eager.abs().max().item()
    torch.testing.assert_close(ours, eager, rtol=0, atol=4 * 2**-8 * scale)


def test_greedy_generate_identical_f32(hub_kernel):
    model = _qwen3_moe(torch.float32)
    ids = _ids(batch=1, length=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_experts_implementation("eager")
    eager = model.generate(ids, **kw)
    model.set_experts_implementation(NAME)
    ours = model.generate(ids, **kw)
    assert torch.equal(ours, eager)


def test_training_step_gradients_match(hub_kernel):
    base = _qwen3_moe(torch.float32).train()
    ids = _ids(batch=2, length=9)
    grads = {}
    for impl in ("eager", NAME):
        model = copy.deepcopy(base)
        model.set_experts_implementation(impl)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads[NAME].keys()
    assert any("gate_up_proj" in n for n in grads[NAME])
    for name, g in grads["eager"].items():
        torch.testing.assert_close(
            grads[NAME][name], g, rtol=1e-4, atol=1e-5 * max(g.abs().max().item(), 1e-6), msg=name
        )


def test_expert_parallel_placeholder_ids(hub_kernel):
    """Picks of id num_experts (experts held elsewhere) carry weight 0 and contribute nothing."""
    model = _qwen3_moe(torch.float32)
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(3)
    tokens, top_k = 13, 3
    hidden = torch.randn(tokens, 64)
    index = torch.randint(0, 8, (tokens, top_k))
    weights = torch.rand(tokens, top_k)
    placeholder = torch.rand(tokens, top_k) < 0.4
    index = torch.where(placeholder, torch.full_like(index, 8), index)  # int64, as the router gives
    weights = torch.where(placeholder, torch.zeros_like(weights), weights)
    experts._is_expert_parallel = True
    model.set_experts_implementation("eager")
    eager = experts(hidden, index, weights)
    ours = hub_kernel.experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)
    # All picks placeholders: exactly zero.
    none = hub_kernel.experts_forward(
        experts, hidden, torch.full_like(index, 8), torch.zeros_like(weights)
    )
    assert torch.all(none == 0)


def _count_calls(monkeypatch, ops):
    calls = {"gmm_op": 0, "gmm_gated_op": 0}
    for name in calls:
        op = getattr(ops, name)

        def counted(*a, _op=op, _name=name):
            calls[_name] += 1
            return _op(*a)

        monkeypatch.setattr(ops, name, counted)
    return calls


@pytest.mark.parametrize(
    "build,activation",
    [
        (lambda dt: _qwen3_moe(dt, moe_intermediate_size=128), ("silu", "concatenated")),
        (_gpt_oss, ("gpt_oss_swiglu", "interleaved")),
    ],
    ids=["qwen3_moe_fused_silu", "gpt_oss_fused_swiglu"],
)
def test_fused_gate_logits_and_gradients_match_eager(hub_kernel, build, activation, monkeypatch):
    """Gated experts whose gating we recognise run the gate_up gmm with the activation fused
    (one gmm_gated and one gmm per layer); logits and the training gradients match eager."""
    model = build(torch.float32)
    experts = model.model.layers[0].mlp.experts
    up = experts.gate_up_proj
    assert hub_kernel.integration.fused_gate(experts, up, experts.is_transposed) == activation
    ids = _ids()
    eager = _logits(model, "eager", ids)
    calls = _count_calls(monkeypatch, hub_kernel.ops)
    ours = _logits(model, NAME, ids)
    assert calls == {"gmm_op": 2, "gmm_gated_op": 2}
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4 * eager.abs().max().item())
    monkeypatch.undo()
    grads = {}
    for impl in ("eager", NAME):
        m = copy.deepcopy(model).train()
        m.set_experts_implementation(impl)
        m(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert any("gate_up_proj" in n for n in grads[NAME])
    for name, g in grads["eager"].items():
        torch.testing.assert_close(
            grads[NAME][name], g, rtol=1e-4, atol=1e-4 * max(g.abs().max().item(), 1e-6), msg=name
        )


def test_fused_gate_bf16_logits(hub_kernel):
    model = _gpt_oss(torch.bfloat16)
    ids = _ids()
    eager = _logits(model, "eager", ids)
    ours = _logits(model, NAME, ids)
    scale = eager.abs().max().item()
    torch.testing.assert_close(ours, eager, rtol=0, atol=4 * 2**-8 * scale)


class _Config:
    _experts_implementation = "eager"


def _layout_module(
    is_transposed, has_bias, has_gate, seed=0, intermediate=24, act="gelu_pytorch_tanh"
):
    """A Transformers-style experts module with the given layout flags; its eager forward is the
    reference (written from the conventions of transformers.integrations.moe)."""
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_transposed=is_transposed, has_bias=has_bias, has_gate=has_gate)
    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, h, i = 5, 32, intermediate
            g = torch.Generator().manual_seed(seed)
            out_up = 2 * i if has_gate else i
            up_shape = (
                (self.num_experts, h, out_up) if is_transposed else (self.num_experts, out_up, h)
            )
            dn_shape = (self.num_experts, i, h) if is_transposed else (self.num_experts, h, i)
            up = torch.nn.Parameter(torch.randn(*up_shape, generator=g) * 0.2)
            setattr(self, "gate_up_proj" if has_gate else "up_proj", up)
            self.down_proj = torch.nn.Parameter(torch.randn(*dn_shape, generator=g) * 0.2)
            if has_bias:
                setattr(
                    self,
                    "gate_up_proj_bias" if has_gate else "up_proj_bias",
                    torch.nn.Parameter(torch.randn(self.num_experts, out_up, generator=g)),
                )
                self.down_proj_bias = torch.nn.Parameter(
                    torch.randn(self.num_experts, h, generator=g)
                )
            self.act_fn = ACT2FN[act if has_gate else "relu2"]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for slot in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, slot])
                    if e == self.num_experts:
                        continue
                    x = hidden_states[t]
                    up = self.gate_up_proj[e] if has_gate else self.up_proj[e]
                    y = x @ up if is_transposed else up @ x
                    if has_bias:
                        y = y + (self.gate_up_proj_bias[e] if has_gate else self.up_proj_bias[e])
                    y = self._apply_gate(y[None])[0] if has_gate else self.act_fn(y)
                    z = y @ self.down_proj[e] if is_transposed else self.down_proj[e] @ y
                    if has_bias:
                        z = z + self.down_proj_bias[e]
                    out[t] += z * top_k_weights[t, slot]
            return out

    return Experts(_Config())


@pytest.mark.parametrize(
    "is_transposed,has_bias,has_gate",
    # Each flag both ways (a full product would double the run time for no new code path).
    [(False, False, True), (True, True, True), (False, True, False), (True, False, False)],
)
def test_experts_layouts(hub_kernel, is_transposed, has_bias, has_gate):
    module = _layout_module(is_transposed, has_bias, has_gate)
    torch.manual_seed(4)
    hidden = torch.randn(9, 32)
    index = torch.randint(0, 6, (9, 2))  # includes placeholder id 5 = num_experts
    weights = torch.where(index == 5, 0.0, torch.rand(9, 2))
    eager = module(hidden, index, weights)
    ours = hub_kernel.experts_forward(module, hidden, index, weights)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)
    # And gradients flow to every parameter and the routing weights.
    w = weights.clone().requires_grad_(True)
    hub_kernel.experts_forward(module, hidden, index, w).sum().backward()
    assert w.grad is not None
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.parametrize(
    "is_transposed,has_bias,act,fused",
    [
        (False, True, "gelu", "gelu"),
        (True, False, "silu", "silu"),
        (False, False, "gelu_pytorch_tanh", "gelu_tanh"),
        (True, True, "relu", None),
    ],
)
def test_experts_fused_gate_layouts(hub_kernel, is_transposed, has_bias, act, fused):
    """I = 128: the default concatenated gating with a recognised act_fn runs fused (weights in
    either layout, with or without biases); an activation we do not fuse keeps the unfused path."""
    module = _layout_module(is_transposed, has_bias, True, intermediate=128, act=act)
    up = module.gate_up_proj
    got = hub_kernel.integration.fused_gate(module, up, is_transposed)
    assert got == ((fused, "concatenated") if fused else None)
    torch.manual_seed(4)
    hidden = torch.randn(9, 32)
    index = torch.randint(0, 6, (9, 2))  # includes placeholder id 5 = num_experts
    weights = torch.where(index == 5, 0.0, torch.rand(9, 2))
    eager = module(hidden, index, weights)
    ours = hub_kernel.experts_forward(module, hidden, index, weights)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)
    w = weights.clone().requires_grad_(True)
    hub_kernel.experts_forward(module, hidden, index, w).sum().backward()
    assert w.grad is not None and all(p.grad is not None for p in module.parameters())


def test_unsupported_layout_is_a_clear_error(hub_kernel):
    module = _layout_module(False, False, True)
    del module.gate_up_proj
    with pytest.raises(ValueError, match="gate_up_proj"):
        hub_kernel.experts_forward(
            module, torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
        )
