"""How much a sliding window cuts flash attention's grid steps, HBM bytes and MXU work against full
causal attention, at Llama-3-8B prefill (32 query heads, 8 KV heads, d 128, 8192 tokens, bf16).

    python benchmarks/window_cut.py [--window 1024] [--generation v6e]

Rows: the tiles each case gets from `choose_tiles` (what a user gets), then fixed tiles shared by
both cases. Every number comes from `tiling.estimate_cost`, whose bytes the tests check exactly
against TPU interpret mode. The last columns show why a bytes cut is bounded: neither case can move
less than its minimum (q, k, v read once, o and lse written once, the same for both), so the cut
can reach 2.5x only when full causal moves 2.5x its minimum or more.
"""

from __future__ import annotations

import argparse

from ours import load

SHAPE = dict(
    batch=1,
    num_q_heads=32,
    num_kv_heads=8,
    q_len=8192,
    kv_len=8192,
    head_dim=128,
    dtype="bfloat16",
    causal=True,
)
FIXED = [  # (block_q, block_q_compute, block_kv, block_kv_compute)
    (128, 128, 128, 128),
    (256, 256, 512, 256),
    (512, 512, 512, 512),
    (512, 512, 2048, 512),
    (1024, 256, 1024, 512),
    (2048, 512, 2048, 512),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--window", type=int, default=1024, help="keys a query sees, itself included")
    ap.add_argument("--generation", default="v6e")
    args = ap.parse_args(argv)
    T = load("flash_attention").tiling
    gen = T.GENERATIONS[args.generation]
    window = (args.window - 1, 0)

    def cost(ws, tiles):
        return T.estimate_cost(window_size=ws, tiles=tiles, generation=gen, **SHAPE)

    def default(ws):
        return T.choose_tiles(
            q_len=8192,
            kv_len=8192,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            dtype="bfloat16",
            causal=True,
            window_size=ws,
            generation=gen,
        )

    rows = [("choose_tiles", default((-1, -1)), default(window))]
    for bq, bqc, bk, bkc in FIXED:
        t = T.Tiles(bq, bk, bkc, 128, 128, block_q_compute=bqc)
        rows.append((f"{bq}/{bqc} x {bk}/{bkc}", t, t))
    print(
        f"Llama-3-8B 8192 causal vs window {args.window}, {gen.name}; tiles = "
        "block_q/block_q_compute x block_kv/block_kv_compute\n"
    )
    head = (
        "tiles",
        "steps full",
        "steps win",
        "steps cut",
        "bytes cut",
        "MXU cut",
        "time cut",
        "full bytes / min",
        "win bytes / min",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, tf, tw in rows:
        f, w = cost((-1, -1), tf), cost(window, tw)
        if label == "choose_tiles":
            label = (
                f"choose_tiles: full {tf.block_q}/{tf.q_compute} x {tf.block_kv}/"
                f"{tf.block_kv_compute}, window {tw.block_q}/{tw.q_compute} x "
                f"{tw.block_kv}/{tw.block_kv_compute}"
            )
        cells = (
            label,
            f.grid_steps,
            w.grid_steps,
            f"{f.grid_steps / w.grid_steps:.2f}x",
            f"{f.hbm_bytes / w.hbm_bytes:.2f}x",
            f"{f.mxu_flops / w.mxu_flops:.2f}x",
            f"{f.modelled_seconds(gen) / w.modelled_seconds(gen):.2f}x",
            f"{f.hbm_bytes / f.min_hbm_bytes:.2f}x",
            f"{w.hbm_bytes / w.min_hbm_bytes:.2f}x",
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
