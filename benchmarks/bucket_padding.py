"""What the shape buckets cost: extra HBM bytes and extra modelled time of padded calls.

Usage: .venv/bin/python benchmarks/bucket_padding.py [--generation v6e] [--out benchmarks/results]
Writes bucket_padding.json and bucket_padding.md.

Every public op pads what varies between calls up to a bucket (torch-ext/shape_buckets.py); this
script prices that padding with each family's closed-form cost model (`tiling.estimate_cost` /
`tiling.traffic`, the same forms the kernels hand to `pl.CostEstimate`), at production shapes:

- ragged_dot: a Qwen3-30B-A3B MoE layer (hidden 2048, expert intermediate 768, 128 experts, top-8,
  bf16): the fused gate_up grouped matmul and the down projection, rows = tokens x 8;
- flash_attention: Llama-3-8B prefill attention (32 query heads, 8 KV heads, head dim 128, bf16,
  causal) of one prompt, through the varlen form (a dense call off the buckets is packed into it);
- paged_attention: Llama-3-8B paged attention (16-token pages, 256 pages per sequence): decode
  batches (contexts uniform in 1..4095) and single-sequence prefill chunks through
  ragged_paged_attention.

Two sets of sizes: the 200-call serving trace of tests/test_shape_buckets.py (even calls: prompt
lengths log-uniform in 1..4096; odd calls: decode batches uniform in 1..64; seed 0), and the bucket
edges (every size one past a bucket boundary, where padding is largest). For each call: the cost at
the caller's size (no padding) and at the bucket size (what runs); reported are the extra bytes and
the extra modelled time (max(issued FLOPs / peak, bytes / HBM bandwidth) + grid steps x step
overhead, `KernelCost.modelled_seconds`) relative to the unpadded call: worst, mean over calls, and
over the whole trace (sum of extra / sum of unpadded). These are closed-form (modelled) numbers,
not timings and not read from a compiled schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "tests", ROOT / "torch-ext"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import shape_buckets as SB  # noqa: E402

EXPERTS, TOP_K, HIDDEN, MOE_I = 128, 8, 2048, 768
HQ, HKV, D = 32, 8, 128
PAGE, PAGES_PER_SEQ = 16, 256


def serving_trace(seed=0, calls=200):
    """(kind, size) per call, as tests/test_shape_buckets.py draws it."""
    rng = np.random.default_rng(seed)
    trace = []
    for i in range(calls):
        if i % 2 == 0:
            trace.append(("prefill", int(np.exp(rng.uniform(0, np.log(4096))))))
        else:
            trace.append(("decode", int(rng.integers(1, 65))))
    return trace


def edge_sizes(max_size, lo=1):
    """One past every bucket boundary up to max_size (the worst padding of each bucket), plus the
    smallest size (the floor's worst case)."""
    sizes = {lo}
    for b in SB.token_buckets(max_size, lo):
        if b + 1 <= max_size:
            sizes.add(b + 1)
    return sorted(sizes)


def _load(key):
    import kernel_loader

    return kernel_loader.load_kernel(key)


def _routing(tokens, rng):
    """Group sizes of top-8-of-128 routing with random distinct experts per token."""
    start = rng.integers(0, EXPERTS, size=(tokens, 1))
    picks = (start + np.arange(TOP_K) * (EXPERTS // TOP_K)) % EXPERTS
    return np.bincount(picks.reshape(-1), minlength=EXPERTS)


def moe_costs(tokens, rng, gen):
    """(unpadded, padded) KernelCost sums of one MoE layer's two grouped matmuls."""
    tiling = _load("ragged_dot").tiling
    gs = _routing(tokens, rng)
    rows = tokens * TOP_K
    out = []
    for m in (rows, SB.bucket_tokens(rows)):
        gate_up = tiling.estimate_cost(
            "gmm",
            (m, HIDDEN),
            (EXPERTS, 2 * MOE_I, HIDDEN),
            gs,
            transpose_rhs=True,
            gate_layout="concatenated",
            generation=gen,
        )
        down = tiling.estimate_cost(
            "gmm", (m, MOE_I), (EXPERTS, HIDDEN, MOE_I), gs, transpose_rhs=True, generation=gen
        )
        out.append((gate_up, down))
    return out


def flash_costs(tokens, gen):
    tiling = _load("flash_attention").tiling
    out = []
    for total, seqs in ((tokens, 1), (SB.bucket_tokens(tokens), SB.bucket_count(1))):
        cu = [0] + [tokens] * seqs
        out.append(
            (
                tiling.estimate_cost(
                    batch=1,
                    num_q_heads=HQ,
                    num_kv_heads=HKV,
                    q_len=total,
                    kv_len=total,
                    head_dim=D,
                    dtype="bfloat16",
                    causal=True,
                    cu_seqlens_q=cu,
                    cu_seqlens_k=cu,
                    generation=gen,
                ),
            )
        )
    return out


def paged_costs(q_lens, kv_lens, gen):
    tiling = _load("paged_attention").tiling
    tokens, seqs = sum(q_lens), len(q_lens)
    out = []
    for num_tokens, max_seqs in ((tokens, seqs), (SB.bucket_tokens(tokens), SB.bucket_count(seqs))):
        out.append(
            (
                tiling.estimate_cost(
                    q_lens=q_lens,
                    kv_lens=kv_lens,
                    num_q_heads=HQ,
                    num_kv_heads=HKV,
                    head_dim=D,
                    page_size=PAGE,
                    pages_per_seq=PAGES_PER_SEQ,
                    max_num_seqs=max_seqs,
                    num_tokens=num_tokens,
                    generation=gen,
                ),
            )
        )
    return out


def _totals(costs, gen):
    return (sum(c.hbm_bytes for c in costs), sum(c.modelled_seconds(gen) for c in costs))


def _summary(rows):
    """rows: (size, bytes, extra_bytes, seconds, extra_seconds) per call."""
    if not rows:
        return {}
    a = np.array([r[1:] for r in rows], dtype=np.float64)
    rb, rt = a[:, 1] / a[:, 0], a[:, 3] / a[:, 2]
    worst_b, worst_t = int(np.argmax(rb)), int(np.argmax(rt))
    return {
        "calls": len(rows),
        "extra_bytes_mean_pct": 100 * float(rb.mean()),
        "extra_bytes_worst_pct": 100 * float(rb[worst_b]),
        "extra_bytes_worst_at": rows[worst_b][0],
        "extra_bytes_total_pct": 100 * float(a[:, 1].sum() / a[:, 0].sum()),
        "extra_time_mean_pct": 100 * float(rt.mean()),
        "extra_time_worst_pct": 100 * float(rt[worst_t]),
        "extra_time_worst_at": rows[worst_t][0],
        "extra_time_total_pct": 100 * float(a[:, 3].sum() / a[:, 2].sum()),
    }


def _row(size, pair, gen):
    (b0, t0), (b1, t1) = (_totals(c, gen) for c in pair)
    return (size, b0, b1 - b0, t0, t1 - t0)


def measure(generation="v6e"):
    from tpu_generations import get_generation

    gen = get_generation(generation)
    rng = np.random.default_rng(1)
    trace = serving_trace()
    rows = {name: [] for name in ("ragged_dot", "flash_attention", "paged_decode", "paged_prefill")}
    for kind, size in trace:
        rows["ragged_dot"].append(_row(size * TOP_K, moe_costs(size, rng, generation), gen))
        if kind == "prefill":
            rows["flash_attention"].append(_row(size, flash_costs(size, generation), gen))
            rows["paged_prefill"].append(_row(size, paged_costs([size], [size], generation), gen))
        else:
            kv = [int(x) for x in rng.integers(1, PAGE * PAGES_PER_SEQ, size=size)]
            rows["paged_decode"].append(_row(size, paged_costs([1] * size, kv, generation), gen))
    edges = {name: [] for name in rows}
    for size in edge_sizes(4096):
        edges["ragged_dot"].append(_row(size * TOP_K, moe_costs(size, rng, generation), gen))
        edges["flash_attention"].append(_row(size, flash_costs(size, generation), gen))
        edges["paged_prefill"].append(_row(size, paged_costs([size], [size], generation), gen))
    for size in edge_sizes(64):
        kv = [int(x) for x in rng.integers(1, PAGE * PAGES_PER_SEQ, size=size)]
        edges["paged_decode"].append(_row(size, paged_costs([1] * size, kv, generation), gen))
    # Where flash's padded call is slower, is it the padding or the tiles chosen for the bucket's
    # length? An unpadded call of exactly the bucket's length answers it.
    worst = _summary(rows["flash_attention"])["extra_time_worst_at"]
    (real,), (padded,) = flash_costs(worst, generation)
    (at_bucket,), _ = flash_costs(SB.bucket_tokens(worst), generation)
    flash_note = {
        "size": worst,
        "bucket": SB.bucket_tokens(worst),
        "unpadded_us": 1e6 * real.modelled_seconds(gen),
        "unpadded_steps": real.grid_steps,
        "padded_us": 1e6 * padded.modelled_seconds(gen),
        "padded_steps": padded.grid_steps,
        "bucket_length_unpadded_us": 1e6 * at_bucket.modelled_seconds(gen),
        "bucket_length_unpadded_steps": at_bucket.grid_steps,
    }
    return {
        "generation": generation,
        "policy": SB.bucket_policy().to_env(),
        "flash_worst_call": flash_note,
        "trace": {name: _summary(r) for name, r in rows.items()},
        "bucket_edges": {name: _summary(r) for name, r in edges.items()},
    }


def to_markdown(result):
    lines = [
        f"Padding cost of the shape buckets ({result['policy']}), modelled with the closed forms "
        f"for {result['generation']} (benchmarks/bucket_padding.py). Extra HBM bytes and extra "
        "modelled time of the padded call over the unpadded one, per call: mean, worst (at the "
        "size given) and over the whole set (sum of extra / sum of unpadded).",
        "",
    ]
    for title, key in (
        ("200-call serving trace", "trace"),
        ("Bucket edges (one past each boundary)", "bucket_edges"),
    ):
        lines += [
            f"**{title}**",
            "",
            "| op | calls | bytes mean | bytes worst (size) | bytes total | time mean | "
            "time worst (size) | time total |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, s in result[key].items():
            if not s:
                continue
            lines.append(
                f"| {name} | {s['calls']} | {s['extra_bytes_mean_pct']:.1f}% | "
                f"{s['extra_bytes_worst_pct']:.1f}% ({s['extra_bytes_worst_at']}) | "
                f"{s['extra_bytes_total_pct']:.1f}% | {s['extra_time_mean_pct']:.1f}% | "
                f"{s['extra_time_worst_pct']:.1f}% ({s['extra_time_worst_at']}) | "
                f"{s['extra_time_total_pct']:.1f}% |"
            )
        lines.append("")
    lines.append(
        "Sizes: ragged_dot rows (tokens x 8), flash / paged prefill prompt tokens, "
        "paged decode batch."
    )
    f = result["flash_worst_call"]
    lines += [
        "",
        f"flash_attention's worst call is the tile policy, not the padded tokens (which "
        f"belong to no sequence and get no work item): {f['size']} tokens unpadded model "
        f"{f['unpadded_us']:.1f} us in {f['unpadded_steps']} grid steps; padded to "
        f"{f['bucket']}, {f['padded_us']:.1f} us in {f['padded_steps']} steps; an unpadded "
        f"call of exactly {f['bucket']} tokens, {f['bucket_length_unpadded_us']:.1f} us in "
        f"{f['bucket_length_unpadded_steps']} steps (tiling.choose_tiles picks smaller "
        "blocks at that length).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generation", default="v6e")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    result = measure(args.generation)
    # The result joins results.json (the one source the report is written from) and its section
    # of results.md is regenerated with the rest of the report.
    import report

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["bucket_padding"] = result
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.out / "results.md").write_text(report.markdown(results))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
