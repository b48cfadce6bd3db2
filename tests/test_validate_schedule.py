"""benchmarks/validate_schedule.py: the parts that need no compile (CSV rows, trip counts, dump
parsing) checked against brute force and, where tokamax is installed, against tokamax's own
host-side metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

import validate_schedule as vs  # noqa: E402

# `make setup` installs tokamax into .tokamax (like libtpu): a missing one must fail, not skip.
HAVE_TOKAMAX = (vs.TOKAMAX_DIR / "tokamax").is_dir()


def needs_tokamax(fn):
    def check():
        assert HAVE_TOKAMAX, "tokamax not installed in .tokamax: run `make setup`"

    import functools

    @functools.wraps(fn)
    def wrapped(*a, **k):
        check()
        return fn(*a, **k)

    return wrapped


ATTN_CSV = """gen,op,B,T,t,Hq,Hkv,D,Dv,causal,soft_cap,residuals,ms,tflops,config
tpu7x,pallas_mosaic_tpu_flash_attention,2,8192,8192,8,8,256,256,True,,False,1.291,425.8,"{""block_q"":2048,""block_kv"":2048,""block_kv_compute"":512,""q_layout"":1,""k_layout"":2,""v_layout"":1,""use_experimental_scheduler"":true,""use_base2_exp"":true}"
tpu_v6_lite,xla_chunked_dot_product_attention,2,8192,8192,8,8,256,256,True,,False,3.0,1.0,"{}"
tpu_v5,pallas_mosaic_tpu_flash_attention_vjp,2,8192,8192,8,8,256,256,True,,False,3.0,1.0,"{}"
tpu_v6_lite,pallas_mosaic_tpu_flash_attention,32,512,512,16,16,128,128,False,,True,1.104,31.1,"{""block_q"":512,""block_kv"":512,""block_kv_compute"":512,""q_layout"":1,""k_layout"":1,""v_layout"":1,""use_experimental_scheduler"":false,""use_base2_exp"":true}"
"""

RAGGED_CSV = """gen,op,kind,lhs,rhs,G,rows,ms,tflops,config
tpu_v5_lite,pallas_mosaic_tpu_ragged_dot,drhs,"bf16[131072,2048]","bf16[131072,768]",128,131072,3.222,128.0,"{""tile_m"":128,""tile_k"":2048,""tile_n"":768,""input_buffer_count"":4,""combine_scopes"":false}"
tpu_v5,pallas_mosaic_tpu_ragged_dot,dlhs,"bf16[131072,768]","bf16[128,2048,768]",128,131072,2.425,170.0,"{""tile_m"":128,""tile_k"":2048,""tile_n"":768,""input_buffer_count"":2,""combine_scopes"":false}"
tpu7x,ragged_dot,fwd,"bf16[4096,4096]","bf16[8,4096,4096]",8,4096,0.2,1.0,"{}"
tpu7x,pallas_mosaic_tpu_ragged_dot,fwd,"bf16[4096,4096]","bf16[8,4096,4096]",8,4096,0.174,789.9,"{""tile_m"":512,""tile_k"":4096,""tile_n"":1024,""input_buffer_count"":2,""combine_scopes"":false}"
"""


def test_csv_rows_keep_only_tokamax_pallas_kernels(tmp_path):
    (tmp_path / "a.csv").write_text(ATTN_CSV)
    (tmp_path / "r.csv").write_text(RAGGED_CSV)
    attn = vs.load_attention_rows(tmp_path / "a.csv")
    assert [(r.gen, r.B, r.causal, r.residuals) for r in attn] == [
        ("tpu7x", 2, True, False),
        ("v6e", 32, False, True),
    ]
    assert attn[0].cfg["block_kv_compute"] == 512 and attn[0].cfg["k_layout"] == 2
    assert attn[0].ms == pytest.approx(1.291)
    rag = vs.load_ragged_rows(tmp_path / "r.csv")
    assert [(r.gen, r.kind) for r in rag] == [("v5e", "drhs"), ("v5p", "dlhs"), ("tpu7x", "fwd")]
    # (m, k, n) of the kernel each row runs
    assert rag[0].mkn == (131072, 2048, 768)  # tgmm: [G, 2048, 768] out
    assert rag[1].mkn == (131072, 768, 2048)  # dlhs: dout [m, 768] @ rhs[G, 2048, 768]^T
    assert rag[2].mkn == (4096, 4096, 4096)
    assert len({r.key() for r in attn + rag}) == 5


def test_group_sizes_are_tokamax_multinomial_split():
    gs = vs.tokamax_group_sizes(10_000, 16)
    assert len(gs) == 16 and sum(gs) == 10_000
    assert gs == vs.tokamax_group_sizes(10_000, 16)  # seeded
    assert len(set(gs)) > 1  # random, not an even split


def _brute_visits(group_sizes, tm, visit_empty):
    out, start = [], 0
    for g, size in enumerate(group_sizes):
        rows = range(start, start + size)
        tiles = sorted({r // tm for r in rows})
        if not tiles and visit_empty:
            tiles = [start // tm]
        out += [(t, g) for t in tiles]
        start += size
    return out


@pytest.mark.parametrize("seed", range(5))
def test_ragged_visits_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(0, 300, size=7)]
    sizes[2] = 0
    for tm in (128, 256):
        for empty in (False, True):
            assert vs.ragged_visits(sizes, tm, empty) == _brute_visits(sizes, tm, empty)
        assert vs.gmm_visits(sizes, tm) == len(_brute_visits(sizes, tm, False))
        m = -(-sum(sizes) // tm) * tm
        assert vs.gmm_visits(sizes, tm) <= vs.gmm_grid_rows(m, len(sizes), tm)


@needs_tokamax
def test_ragged_visits_equal_tokamax_group_metadata():
    """The trip count of one tokamax row's gmm on a tiny shape = tokamax's num_active_tiles."""
    import jax.numpy as jnp

    rk = vs._ragged_kernel_module()
    for tm, empty in ((128, False), (128, True), (256, False)):
        sizes = vs.tokamax_group_sizes(1024, 8, seed=3)
        sizes[1] = 0
        sizes[0] += 1024 - sum(sizes)
        (_, group_ids, m_tile_ids), num = rk.make_group_metadata(
            group_sizes=jnp.asarray(sizes, jnp.int32),
            m=1024,
            tm=tm,
            start_group=0,
            num_nonzero_groups=8,
            visit_empty_groups=empty,
        )
        visits = vs.ragged_visits(sizes, tm, empty)
        assert int(num) == len(visits)
        assert [
            (int(t), int(g)) for t, g in zip(m_tile_ids[: len(visits)], group_ids[: len(visits)])
        ] == visits


@needs_tokamax
@pytest.mark.parametrize("T,bq,bkv", [(1024, 256, 256), (1024, 256, 512), (2048, 512, 256)])
def test_splash_trips_match_block_counting(T, bq, bkv):
    trips = vs.splash_trips(T, T, bq, bkv, causal=True)
    full = partial = 0
    rows = set()
    for i in range(T // bq):
        for j in range(T // bkv):
            q0, q1, k0, k1 = i * bq, (i + 1) * bq - 1, j * bkv, (j + 1) * bkv - 1
            if k0 > q1:
                continue  # fully masked: not in the grid
            rows.add(i)
            if k1 <= q0:
                full += 1
            else:
                partial += 1
    assert trips == {"steps": full + partial, "full": full, "partial": partial, "rows": len(rows)}
    assert vs.splash_trips(T, T, bq, bkv, causal=False)["partial"] == 0


BUNDLES = """\
  0x0   :  { %s1 = smov 0 }
  0x1 LB: > { %s2 = sadd.s32 1, %s1 }
  0x2   : > { %5 = sbr.rel (%p1) target = $region7 } /* Start region 5 */
  0x3   : > { %v1 = vadd.f32 %v2, %v3 }
  0x4   : > { %v4 = vmatmul.bf16 %v1 }
  0x5   : > { %v5 = vpop %v4 } /* End region 5 */
  0x6 PF: > { %p2 = scmp.eq.s32 %s2, 1 } /* Start/End empty region 7 :: Start region 8 */
  0x7   : > { %6 = sbr.rel (%p2) target = $region9 }
  0x8   : > { %v6 = vmul.f32 %v5, %v5 }
  0x9 PF: > { %s3 = smov 1 } /* Start/End empty region 9 */
  0xa   :  { %s4 = smov 2 }
"""


def test_branch_regions_from_final_bundles():
    import llo_schedule

    sched = llo_schedule.Schedule("t", llo_schedule.parse_bundles(BUNDLES), [], {})
    regions = vs.grid_regions(sched)
    assert regions == [(2, 6), (7, 9)]
    struct = {"grid_loop": 10, "regions": [[2, 6], [7, 9]]}
    sizes, small, rest = vs.split_bodies(struct)
    assert sizes == [3] and small == [(7, 9)] and rest == 7


HLO = """\
HloModule jit_f

%fused (p: bf16[4,8]) -> bf16[8,4] {
  ROOT %t = bf16[8,4]{1,0} transpose(%p)
}

ENTRY %main.1 (q.1: bf16[4,8], k.1: f32[16]) -> bf16[8,4] {
  %c = s32[] constant(1)
  %fusion.1 = bf16[8,4]{1,0:T(8,128)} fusion(%q.1), kind=kLoop, calls=%fused
  %kern.1 = bf16[8,4]{1,0} custom-call(%fusion.1, %k.1), custom_call_target="tpu_custom_call"
  %b = bf16[8,4]{1,0} bitcast(%kern.1)
  ROOT %copy.2 = bf16[8,4]{0,1} copy(%b)
}
"""


def test_xla_ops_bytes_around_the_kernel():
    ops = vs.xla_ops(HLO, "kern")
    assert [(o["name"], o["bytes"]) for o in ops] == [("fusion.1", 64 + 64), ("copy.2", 128)]


def test_stats_counts_rows_within_25_percent():
    res = [{"ratio": r, "key": str(r)} for r in (0.7, 0.8, 1.0, 1.2, 1.5)]
    s = vs.stats(res)
    assert s["rows"] == 5 and s["within_25pct"] == pytest.approx(0.6)
    assert s["median_ratio"] == 1.0 and s["worst_ratio"] == 1.5


@pytest.mark.compile
@needs_tokamax
def test_tokamax_gmm_compiles_and_its_grid_step_is_read(tmp_path):
    """One tiny row through the whole path: deviceless compile with the LLO dump (a fresh
    process), the grid loop found, and a scheduled time that grows with the number of visits."""
    from tpu_compile import libtpu_available

    assert libtpu_available(), "libtpu not installed in .libtpu: run `make setup`"
    row = vs.RaggedRow(
        "v6e",
        "fwd",
        (1024, 256),
        (4, 256, 256),
        4,
        1024,
        1.0,
        (("input_buffer_count", 2), ("tile_k", 256), ("tile_m", 256), ("tile_n", 256)),
    )
    struct = vs.compile_row(row)
    assert "error" not in struct, struct.get("error")
    assert struct["kernel"].startswith("gmm_megablox")
    assert struct["grid_loop"] > 0 and struct["loop_ops"]["vmatmul"] > 0
    p = vs.ModelParams(dict(vs.ASSUMED_CLOCK_HZ))
    small = vs.predict_ragged(row, struct, p)
    bigger = vs.predict_ragged(dataclasses.replace(row, lhs=(4096, 256), rows=4096), struct, p)
    assert small["steps"] == vs.gmm_visits(vs.tokamax_group_sizes(1024, 4), 256)
    assert bigger["steps"] == vs.gmm_visits(vs.tokamax_group_sizes(4096, 4), 256)
    # same compiled step, 19 visits instead of 7: the time follows the trip count
    assert bigger["kernel_ms"] > 2 * small["kernel_ms"]
