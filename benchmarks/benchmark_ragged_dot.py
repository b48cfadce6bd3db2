"""`kernels benchmark` workloads for ragged-dot-tpu.

On a TPU (self.device == "tpu") the shapes are Qwen3-30B-A3B's experts (hidden 2048, expert
intermediate 768, 128 experts, top-8) at 64 tokens (decode) and 4096 tokens (prefill); each timed
method synchronises before returning, since the runner's own sync ignores TPUs. On CPU the kernels
run in Pallas interpret mode, so the shapes are tiny: the numbers there only check the plumbing.

Workloads: gmm at decode and prefill, the gated gate_up gmm (SiLU fused) at prefill, tgmm.
Each workload is verified against a per-group torch loop in float32. Outputs are float32
(out_dtype) so that the runner's fixed atol=1e-2 check compares accumulation, not bf16 rounding.
"""

from __future__ import annotations

import torch
from kernels.benchmark import Benchmark

# (tokens, experts, top_k, hidden, expert intermediate)
QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, inter=768)
CPU_TINY = dict(experts=8, top_k=2, hidden=128, inter=64)


def _sync(t: torch.Tensor) -> None:
    tpu = getattr(torch, "tpu", None)
    if tpu is not None and hasattr(tpu, "synchronize"):
        tpu.synchronize()
    elif t.device.type != "cpu":
        t.reshape(-1)[:1].cpu()  # reading a value back waits for the computation


def _group_sizes(tokens: int, experts: int, top_k: int, device) -> torch.Tensor:
    # Top-k distinct experts per token, uniformly at random: counts per expert.
    picks = torch.rand(tokens, experts).argsort(dim=1)[:, :top_k]
    return torch.bincount(picks.reshape(-1), minlength=experts).to(torch.int32).to(device)


def _loop_gmm(x, w, group_sizes, transpose_rhs):
    out = torch.zeros(
        x.shape[0],
        w.shape[1] if transpose_rhs else w.shape[2],
        dtype=torch.float32,
        device=x.device,
    )
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        if size:
            wg = w[g].float()
            out[start : start + size] = x[start : start + size].float() @ (
                wg.T if transpose_rhs else wg
            )
        start += size
    return out


def _loop_tgmm(x, dout, group_sizes):
    out = torch.zeros(
        group_sizes.shape[0], x.shape[1], dout.shape[1], dtype=torch.float32, device=x.device
    )
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        if size:
            out[g] = x[start : start + size].float().T @ dout[start : start + size].float()
        start += size
    return out


class RaggedDotBenchmark(Benchmark):
    seed = 0

    def _shapes(self, tokens_on_tpu: int):
        if self.device == "tpu":
            return tokens_on_tpu, QWEN3_30B_A3B
        return 16, CPU_TINY

    def _setup_gmm(self, tokens_on_tpu: int, projection: str):
        tokens, s = self._shapes(tokens_on_tpu)
        e, h, i = s["experts"], s["hidden"], s["inter"]
        k, n = (h, 2 * i) if projection == "gate_up" else (i, h)
        m = tokens * s["top_k"]
        dev = self.device
        self.group_sizes = _group_sizes(tokens, e, s["top_k"], dev)
        # Scaled so outputs are O(1): the runner compares with atol=1e-2.
        self.x = (torch.randn(m, k) / k**0.25).to(torch.bfloat16).to(dev)
        # Transformers' layout: [E, out, in], read transposed in-kernel.
        self.w = (torch.randn(e, n, k) / k**0.25).to(torch.bfloat16).to(dev)
        self.out = None

    def _run_gmm(self):
        self.out = self.kernel.gmm(
            self.x, self.w, self.group_sizes, transpose_rhs=True, out_dtype=torch.float32
        )
        _sync(self.out)

    def _verify_gmm(self):
        return _loop_gmm(self.x, self.w, self.group_sizes, transpose_rhs=True)

    # Decode: 64 tokens, gate_up projection (weight streaming bound).
    def setup_gmm_decode(self):
        self._setup_gmm(64, "gate_up")

    def benchmark_gmm_decode(self):
        self._run_gmm()

    def verify_gmm_decode(self):
        return self._verify_gmm()

    # Prefill: 4096 tokens, down projection.
    def setup_gmm_prefill(self):
        self._setup_gmm(4096, "down")

    def benchmark_gmm_prefill(self):
        self._run_gmm()

    def verify_gmm_prefill(self):
        return self._verify_gmm()

    # Gate_up at 4096 tokens with SiLU(gate) * up fused into the epilogue: writes [M, I], not
    # [M, 2I] (the concatenated layout Qwen3-MoE stores).
    def setup_gmm_gated_prefill(self):
        self._setup_gmm(4096, "gate_up")

    def benchmark_gmm_gated_prefill(self):
        self.out = self.kernel.gmm_gated(
            self.x,
            self.w,
            self.group_sizes,
            activation="silu",
            layout="concatenated",
            transpose_rhs=True,
            out_dtype=torch.float32,
        )
        _sync(self.out)

    def verify_gmm_gated_prefill(self):
        h = _loop_gmm(self.x, self.w, self.group_sizes, transpose_rhs=True)
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    # Weight gradient at 4096 tokens, gate_up projection: [E, K, N] = per-group x^T @ dout.
    def setup_tgmm_prefill(self):
        self._setup_gmm(4096, "gate_up")
        m = self.x.shape[0]
        n = self.w.shape[1]
        self.dout = (torch.randn(m, n) / m**0.25).to(torch.bfloat16).to(self.device)

    def benchmark_tgmm_prefill(self):
        self.out = self.kernel.tgmm(self.x, self.dout, self.group_sizes, out_dtype=torch.float32)
        _sync(self.out)

    def verify_tgmm_prefill(self):
        return _loop_tgmm(self.x, self.dout, self.group_sizes)
