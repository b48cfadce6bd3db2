"""`kernels benchmark` workloads for flash-attention-tpu, against torch's scaled_dot_product_attention.

On a TPU (self.device == "tpu") the shapes are Llama-3-8B prefill (32 query heads, 8 KV heads,
head dim 128, 8192 tokens, bf16, batch 1): causal, causal with a 1024-token sliding window, the
causal forward + backward, and a packed varlen batch (8 sequences of 1024 tokens). Each timed
method synchronises before returning, since the runner's own sync ignores TPUs. On CPU the kernels
run in Pallas interpret mode, so shapes are tiny and the numbers only check the plumbing.

Every workload is verified against torch sdpa in float32 on the same inputs; outputs are compared
as float32 (the runner's fixed atol=1e-2 then checks the attention, not bf16 storage rounding).
"""

from __future__ import annotations

import torch
from kernels.benchmark import Benchmark

LLAMA3_8B = dict(heads=32, kv_heads=8, head_dim=128, tokens=8192)
CPU_TINY = dict(heads=4, kv_heads=2, head_dim=64, tokens=96)


def _sync(t: torch.Tensor) -> None:
    tpu = getattr(torch, "tpu", None)
    if tpu is not None and hasattr(tpu, "synchronize"):
        tpu.synchronize()
    elif t.device.type != "cpu":
        t.reshape(-1)[:1].cpu()  # reading a value back waits for the computation


def _sdpa(q, k, v, causal=False, window=None):
    """Reference: q [B, S, H, D], k/v [B, Sk, Hkv, D] -> [B, S, H, D] float32."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    s, sk = q.shape[2], k.shape[2]
    mask = None
    if causal or window is not None:
        i = torch.arange(s, device=q.device)[:, None] + (sk - s)
        j = torch.arange(sk, device=q.device)[None, :]
        mask = torch.ones(s, sk, dtype=torch.bool, device=q.device)
        if causal:
            mask &= j <= i
        if window is not None:
            mask &= j >= i - window
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


class FlashAttentionBenchmark(Benchmark):
    seed = 0

    def _setup(self, requires_grad=False):
        s = LLAMA3_8B if self.device == "tpu" else CPU_TINY
        dtype = torch.bfloat16 if self.device == "tpu" else torch.float32
        t, h, hkv, d = s["tokens"], s["heads"], s["kv_heads"], s["head_dim"]
        mk = lambda *shape: torch.randn(*shape).to(dtype).to(self.device)  # noqa: E731
        self.q, self.k, self.v = mk(1, t, h, d), mk(1, t, hkv, d), mk(1, t, hkv, d)
        if requires_grad:
            for x in (self.q, self.k, self.v):
                x.requires_grad_()
            self.do = mk(1, t, h, d)
        self.out = None

    # Causal prefill.
    def setup_causal(self):
        self._setup()

    def benchmark_causal(self):
        out = self.kernel.flash_attn_func(self.q, self.k, self.v, causal=True)
        _sync(out)
        self.out = out.float()

    def verify_causal(self):
        return _sdpa(self.q, self.k, self.v, causal=True)

    # Causal with a 1024-token sliding window (a quarter of the sequence on CPU).
    def _window(self):
        return 1023 if self.device == "tpu" else self.q.shape[1] // 4

    def setup_sliding_window(self):
        self._setup()

    def benchmark_sliding_window(self):
        out = self.kernel.flash_attn_func(
            self.q, self.k, self.v, causal=True, window_size=(self._window(), -1)
        )
        _sync(out)
        self.out = out.float()

    def verify_sliding_window(self):
        return _sdpa(self.q, self.k, self.v, causal=True, window=self._window())

    # Forward + backward (training step of one attention layer); out = dq.
    def setup_causal_fwd_bwd(self):
        self._setup(requires_grad=True)

    def benchmark_causal_fwd_bwd(self):
        out = self.kernel.flash_attn_func(self.q, self.k, self.v, causal=True)
        (dq,) = torch.autograd.grad(out, [self.q], self.do)
        _sync(dq)
        self.out = dq.float()

    def verify_causal_fwd_bwd(self):
        q, k, v = (x.detach().float().requires_grad_() for x in (self.q, self.k, self.v))
        (dq,) = torch.autograd.grad(_sdpa(q, k, v, causal=True), [q], self.do.float())
        return dq

    # Packed varlen: equal-length sequences packed into one batch.
    def setup_varlen(self):
        self._setup()
        t = self.q.shape[1]
        n = 8 if self.device == "tpu" else 3
        self.cu = torch.arange(0, t + 1, t // n, dtype=torch.int32, device=self.device)
        self.cu[-1] = t
        self.max_len = int((self.cu[1:] - self.cu[:-1]).max())

    def benchmark_varlen(self):
        out = self.kernel.flash_attn_varlen_func(
            self.q[0],
            self.k[0],
            self.v[0],
            self.cu,
            self.cu,
            self.max_len,
            self.max_len,
            causal=True,
        )
        _sync(out)
        self.out = out.float()

    def verify_varlen(self):
        outs = []
        cu = self.cu.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            outs.append(_sdpa(self.q[:, a:b], self.k[:, a:b], self.v[:, a:b], causal=True)[0])
        return torch.cat(outs)
