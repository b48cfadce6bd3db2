"""The committed sharded rows (benchmarks/results/results.json["sharded"], written by
`python benchmarks/sharded.py`) against what they are computed from, without compiling: the
closed forms on each device's shard, the routing, the collective volumes from the stored
compiled shapes, results.md's section and README's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import report
import sharded

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
SECTION = RESULTS.get("sharded") or {}
ROWS = SECTION.get("rows", [])
STALE = "rerun `python benchmarks/sharded.py` (or --keep-compiled after a tiling-only change)"


def _rows(family):
    return [r for r in ROWS if r["family"] == family]


def test_every_sharded_row_is_committed_and_compiled():
    want = {
        *(
            ("ragged_dot", "qwen3_30b_a3b", t, g, c)
            for t in sharded.MOE_TOKENS
            for g, c in sharded.MOE_CASES
        ),
        *(
            (f, m, None, g, "psum (o_proj)")
            for f, m in (
                ("flash_attention", "llama3_8b_causal_8192"),
                ("paged_attention", "llama3_8b_decode_b64_ctx8192"),
            )
            for g in sharded.TP_GENERATIONS
        ),
    }
    assert {sharded.row_key(r) for r in ROWS} == want, STALE
    for r in ROWS:
        assert r["devices"] == sharded.num_devices(r["generation"]), r
        assert "collectives" in r and r["memory"], f"{sharded.row_key(r)} was not compiled"


@pytest.mark.parametrize("tokens", sharded.MOE_TOKENS)
def test_moe_rows_match_closed_forms_and_routing(tokens):
    for r in (r for r in _rows("ragged_dot") if r["tokens"] == tokens):
        n, gen = r["devices"], r["generation"]
        kern = sharded.moe_kernel_bytes(tokens, n, gen)
        assert r["kernel_hbm_bytes"] == kern["per_device"], STALE
        assert r["kernel_calls"] == kern["calls_per_device"], STALE
        assert r["kernel_hbm_bytes_own_rows"] == kern["own_rows"], STALE
        # The worst-case row block costs its zero output rows on top of the device's own rows.
        assert all(a > b for a, b in zip(r["kernel_hbm_bytes"], kern["own_rows"]))
        one = sharded.moe_kernel_bytes(tokens, 1, gen)["per_device"][0]
        assert r["kernel_hbm_bytes_unsharded"] == one, STALE
        # Every pick lands in exactly one device's groups; what leaves a device arrives at others.
        routing = sharded.moe_routing(tokens, n)
        assert r["routed_rows"]["group_rows"] == [sum(g) for g in routing["group_sizes"]]
        assert sum(r["routed_rows"]["group_rows"]) == tokens * sharded.QWEN3_30B_A3B["top_k"]
        assert sum(routing["rows_out"]) == sum(routing["rows_in"]) > 0
        assert r["routed_rows"]["rows_out"] == routing["rows_out"]
        assert r["routed_rows"]["rows_in"] == routing["rows_in"]
        # A device's shard of the experts costs fewer bytes than the whole layer on one device.
        assert max(r["kernel_hbm_bytes"]) < one


@pytest.mark.parametrize("family", ["flash_attention", "paged_attention"])
def test_attention_rows_match_closed_forms(family):
    fn = sharded.flash_kernel_bytes if family == "flash_attention" else sharded.paged_kernel_bytes
    for r in _rows(family):
        n, gen = r["devices"], r["generation"]
        assert r["kernel_hbm_bytes"] == [fn(n, gen)] * n, STALE
        assert r["kernel_hbm_bytes_unsharded"] == fn(1, gen), STALE


def test_collective_volumes_follow_from_the_compiled_shapes():
    s = sharded.QWEN3_30B_A3B
    for r in ROWS:
        n, cols = r["devices"], r["collectives"]
        ops = [c["op"] for c in cols]
        assert all(c["group_size"] == n for c in cols if c["op"] != "collective-permute"), cols
        if r["family"] == "ragged_dot":
            t, k, h = r["tokens"], s["top_k"], s["hidden"]
            recomputed = sharded.moe_collective_volume(
                [
                    {
                        k_: v
                        for k_, v in c.items()
                        if k_ not in ("role", "sent_bytes", "received_bytes")
                    }
                    for c in cols
                ],
                t,
                n,
                s,
            )
            assert recomputed == cols
            if r["collectives_path"] == "ragged_all_to_all":
                assert sorted(c.get("role") for c in cols if c["op"] == "ragged-all-to-all") == [
                    "combine",
                    "dispatch",
                ]
                assert set(ops) == {"ragged-all-to-all", "all-gather"}, ops  # + the counts
                dispatch = next(c for c in cols if c.get("role") == "dispatch")
                # The worst-case receive buffer: T k rows of H bf16 (XLA may split a row's dims).
                ((dt, dims),) = sharded.array_shapes(dispatch["result"])
                assert dt == "bf16" and dims[0] == t * k and np.prod(dims[1:]) == h, dims
                # Dispatch and combine each move every pick that changes device, once.
                moved = 2 * sum(r["routed_rows"]["rows_out"]) * h * 2
                assert (
                    sum(r["collective_sent_bytes"])
                    - sum(sum(c["sent_bytes"]) for c in cols if c["op"] == "all-gather")
                    == moved
                )
            else:
                assert "ragged-all-to-all" not in ops and "all-gather" in ops, ops
                # The f32 partial sums [T, H] are combined by a reduce-scatter, or, where XLA
                # compiles the psum_scatter so (v6e at 4096 tokens), an all-reduce of them padded.
                (comb,) = [c for c in cols if c["op"] in ("reduce-scatter", "all-reduce")]
                ((dt, dims),) = sharded.array_shapes(comb["operands"][0])
                assert dt == "f32" and dims[0] >= t and dims[1:] == (h,), comb
                assert (
                    comb["sent_bytes"]
                    == [
                        (1 if comb["op"] == "reduce-scatter" else 2)
                        * (n - 1)
                        * dims[0]
                        * h
                        * 4
                        // n
                    ]
                    * n
                )
        else:
            # Head-sharded attention has no collective: the only one is o_proj's psum of
            # [tokens, hidden] bf16.
            (c,) = cols
            tokens = sharded.FLASH_SEQ if r["family"] == "flash_attention" else sharded.PAGED_SEQS
            assert c["op"] == "all-reduce" and c["result"] == f"bf16[{tokens},4096]", c
            assert c["sent_bytes"] == [2 * (n - 1) * tokens * 4096 * 2 // n] * n
        sent = [sum(c["sent_bytes"][d] for c in cols) for d in range(n)]
        assert r["collective_sent_bytes"] == sent
        assert r["collective_received_bytes"] == [
            sum(c["received_bytes"][d] for c in cols) for d in range(n)
        ]


def test_moe_memory_holds_the_device_shard_of_the_experts():
    s = sharded.QWEN3_30B_A3B
    for r in _rows("ragged_dot"):
        weights = 2 * 3 * s["experts"] * s["hidden"] * s["inter"] // r["devices"]
        assert weights <= r["memory"]["argument_bytes"] < 1.05 * weights, r["memory"]


def test_results_md_and_readme_render_the_committed_rows():
    md = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    for line in report.sharded_markdown(SECTION):
        assert line in md.splitlines(), f"results.md lacks: {line[:120]} ({STALE})"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## More than one chip", 1)[1].split("\n## ", 1)[0]
    table = sharded.readme_table(SECTION)
    assert len(table) == 2 + len(ROWS)
    for line in table:
        assert line in section.splitlines(), f"README's sharded table lacks: {line}"


def _byte_figures(x) -> set[str]:
    """Every integer in the sharded rows, formatted as report.py formats bytes."""
    if isinstance(x, dict):
        return set().union(*(_byte_figures(v) for v in x.values()))
    if isinstance(x, list):
        return set().union(*(_byte_figures(v) for v in x)) if x else set()
    return {report._fmt_bytes(x)} if isinstance(x, int) and not isinstance(x, bool) else set()


def test_readme_byte_figures_are_in_the_sharded_rows():
    """Every "N KiB / MiB / GiB" README's "More than one chip" states is some figure of
    results.json["sharded"], formatted the report's way: a stale figure fails here."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## More than one chip", 1)[1].split("\n## ", 1)[0]
    stated = re.findall(r"(?<![\w.])(\d+(?:\.\d+)?) (KiB|MiB|GiB)\b", section)
    assert len(stated) > 20
    known = _byte_figures(ROWS)
    assert [f"{n} {u}" for n, u in stated if f"{n} {u}" not in known] == []


def test_hlo_collective_parser():
    """Shapes come from the instruction that defines each operand (compiled HLO prints operands
    by name), async starts count once, group sizes from both replica-group notations."""
    hlo = """
  %p.0 = bf16[128,2048]{1,0:T(8,128)(2,1)} parameter(0)
  %f.1 = f32[512,2048]{1,0} fusion(%p.0), kind=kLoop, calls=%fused
  %all_gather.9 = bf16[512,2048]{1,0:T(8,128)(2,1)S(1)} all-gather(%p.0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %reduce_scatter.7 = f32[128,2048]{1,0} reduce-scatter(%f.1), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %ar = (bf16[64,4096]{1,0}, bf16[64,4096]{1,0}) all-reduce-start(%x.2), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = bf16[64,4096]{1,0} all-reduce-done(%ar)
  %x.2 = bf16[64,4096]{1,0} parameter(1)
  %cp = (bf16[96,2048]{1,0}, bf16[96,2048]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%s.3), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}
  %s.3 = bf16[96,2048]{1,0} slice(%p.0), slice={[0:96], [0:2048]}
  %cpd = bf16[96,2048]{1,0} collective-permute-done(%cp)
"""
    cols = sharded.hlo_collectives(hlo)
    assert [c["op"] for c in cols] == [
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "collective-permute",
    ]
    ag, rs, ar, cp = cols
    assert ag["operands"] == ["bf16[128,2048]"] and ag["result"] == "bf16[512,2048]"
    assert ag["group_size"] == 4 and sharded.dense_volume(ag, 4) == ([3 * 128 * 2048 * 2] * 4,) * 2
    assert rs["operands"] == ["f32[512,2048]"] and rs["group_size"] == 4
    assert sharded.dense_volume(rs, 4)[0] == [3 * 512 * 2048 * 4 // 4] * 4
    assert ar["result"] == "bf16[64,4096]" and ar["group_size"] == 8
    assert sharded.dense_volume(ar, 8)[1] == [2 * 7 * 64 * 4096 * 2 // 8] * 8
    # A permute: its result from the -done, not the start's tuple; the ends of the chain only
    # send (device 0) or only receive (device 3).
    assert cp["result"] == "bf16[96,2048]" and cp["source_target_pairs"] == [[0, 1], [1, 2], [2, 3]]
    row = 96 * 2048 * 2
    assert sharded.dense_volume(cp, 4) == ([row, row, row, 0], [0, row, row, row])
    assert np.isclose(sharded.shape_bytes(sharded.array_shapes("s32[4,128]{1,0}")), 2048)
    assert sharded.num_devices("v6e") == 4 and sharded.num_devices("tpu7x") == 8
