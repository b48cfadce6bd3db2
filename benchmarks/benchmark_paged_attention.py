"""`kernels benchmark` workloads for paged-attention-tpu.

On TPU (self.device == "tpu"): Llama-3-8B serving shapes (32 query heads, 8 KV heads, head dim
128, bf16, 128-token pages): decode of 64 sequences with 8192-token contexts, and a mixed batch of
63 decodes plus a 2048-token prefill chunk. On CPU: tiny shapes of the same kinds (the kernel runs
in Pallas interpret mode). Each workload is checked against a dense per-sequence torch reference.
"""

from __future__ import annotations

import torch
from kernels.benchmark import Benchmark


def _sync(device):
    # The runner's device sync ignores TPU: synchronise inside the timed method.
    if device == "tpu":
        sync = getattr(getattr(torch, "tpu", None), "synchronize", None)
        if sync is not None:
            sync()


def _dense_reference(q, kv_cache, kv_lens, page_table, cu_q_lens, window=None):
    """f32 attention per sequence over its gathered pages; queries at the end of the keys."""
    _, c, page_size, d = kv_cache.shape
    hkv = c // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s in range(kv_lens.shape[0]):
        a, b = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        kl = int(kv_lens[s])
        n = -(-kl // page_size)
        pages = kv_cache[page_table[s, :n].long()].float()  # [n, 2*hkv, ps, d]
        kv = pages.permute(0, 2, 1, 3).reshape(n * page_size, c, d)[:kl]
        k, v = kv[:, 0::2], kv[:, 1::2]
        g = q.shape[1] // hkv
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        qs = q[a:b].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * d**-0.5
        qpos = kl - (b - a) + torch.arange(b - a, device=q.device)[:, None]
        kpos = torch.arange(kl, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)


class PagedAttentionBenchmark(Benchmark):
    seed = 0

    def _make(self, seqs, *, q_heads, kv_heads, head_dim, page_size, dtype, window=None):
        dev = self.device
        n = len(seqs)
        pages_per_seq = max(-(-kv // page_size) for _, kv in seqs)
        num_pages = n * pages_per_seq
        g = torch.Generator().manual_seed(0)
        # Pages scattered through the cache, as an allocator leaves them.
        self.page_table = (
            torch.randperm(num_pages, generator=g).reshape(n, pages_per_seq).to(torch.int32).to(dev)
        )
        self.kv_cache = (
            torch.randn(num_pages, 2 * kv_heads, page_size, head_dim, generator=g).to(dtype).to(dev)
        )
        tokens = sum(q for q, _ in seqs)
        self.q = torch.randn(tokens, q_heads, head_dim, generator=g).to(dtype).to(dev)
        self.kv_lens = torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device=dev)
        cu = [0]
        for q, _ in seqs:
            cu.append(cu[-1] + q)
        self.cu_q_lens = torch.tensor(cu, dtype=torch.int32, device=dev)
        self.num_seqs = torch.tensor([n], dtype=torch.int32, device=dev)
        self.window = window
        self.out = torch.empty_like(self.q)

    def _run(self):
        self.out = self.kernel.ragged_paged_attention(
            self.q,
            self.kv_cache,
            self.kv_lens,
            self.page_table,
            self.cu_q_lens,
            self.num_seqs,
            sliding_window=self.window,
            validate=False,
        )
        _sync(self.device)

    def _reference(self):
        return _dense_reference(
            self.q, self.kv_cache, self.kv_lens, self.page_table, self.cu_q_lens, self.window
        )

    # -- decode ----------------------------------------------------------------------------------
    def setup_decode(self):
        if self.device == "tpu":
            self._make(
                [(1, 8192)] * 64,
                q_heads=32,
                kv_heads=8,
                head_dim=128,
                page_size=128,
                dtype=torch.bfloat16,
            )
        else:
            self._make(
                [(1, 300), (1, 64), (1, 129), (1, 17)],
                q_heads=4,
                kv_heads=1,
                head_dim=128,
                page_size=16,
                dtype=torch.float32,
            )

    def benchmark_decode(self):
        self._run()

    def verify_decode(self):
        return self._reference()

    # -- decode with a sliding window -------------------------------------------------------------
    def setup_decode_window(self):
        if self.device == "tpu":
            self._make(
                [(1, 8192)] * 64,
                q_heads=32,
                kv_heads=8,
                head_dim=128,
                page_size=128,
                dtype=torch.bfloat16,
                window=1024,
            )
        else:
            self._make(
                [(1, 300), (1, 64), (1, 129), (1, 17)],
                q_heads=4,
                kv_heads=1,
                head_dim=128,
                page_size=16,
                dtype=torch.float32,
                window=40,
            )

    def benchmark_decode_window(self):
        self._run()

    def verify_decode_window(self):
        return self._reference()

    # -- mixed: decodes plus one prefill chunk ---------------------------------------------------
    def setup_mixed(self):
        if self.device == "tpu":
            self._make(
                [(1, 8192)] * 63 + [(2048, 8192)],
                q_heads=32,
                kv_heads=8,
                head_dim=128,
                page_size=128,
                dtype=torch.bfloat16,
            )
        else:
            self._make(
                [(1, 200), (1, 64), (1, 129), (40, 96)],
                q_heads=4,
                kv_heads=1,
                head_dim=128,
                page_size=16,
                dtype=torch.float32,
            )

    def benchmark_mixed(self):
        self._run()

    def verify_mixed(self):
        return self._reference()
