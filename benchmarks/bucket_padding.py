"""What the shape buckets cost: extra HBM bytes and extra scheduled time of padded calls.

Usage (v6e by default; the lead's rerun, cache warm, takes a few minutes):

    .venv/bin/python benchmarks/bucket_padding.py [--generation v6e] [--out benchmarks/results]
        [--cache-only] [--max-compiles N] [--fill-cache]

Writes the result into results.json (key "bucket_padding") and regenerates results.md.

Every public op pads what varies between calls up to a bucket (torch-ext/shape_buckets.py). This
script prices that padding at production shapes:

- ragged_dot: a Qwen3-30B-A3B MoE layer (hidden 2048, expert intermediate 768, 128 experts, top-8,
  bf16): the fused gate_up grouped matmul (gmm_gated, SiLU, concatenated) and the down
  projection, rows = tokens x 8;
- flash_attention: Llama-3-8B prefill attention (32 query heads, 8 KV heads, head dim 128, bf16,
  causal) of one prompt, through the varlen form (a dense call off the buckets is packed into it);
- paged_attention: Llama-3-8B paged attention (16-token pages, 256 pages per sequence): decode
  batches (contexts uniform in 1..4095) and single-sequence prefill chunks through
  ragged_paged_attention.

The calls: the 200-call serving trace of tests/test_shape_buckets.py (even calls: prompt lengths
log-uniform in 1..4096; odd calls: decode batches uniform in 1..64; seed 0). Each call is priced
twice, at the caller's size (what an unbucketed call would compile and run, with the tiles the
tile policy picks for that size) and at its bucket size (what runs, with the bucket's tiles):

- extra HBM bytes: the closed forms (`tiling.estimate_cost`, the numbers the kernels hand to
  `pl.CostEstimate`, which the TPU interpreter checks on small shapes): exact, not a model;
- extra scheduled time: `schedule_model.scheduled_from_work` with the call's own closed-form work
  at that size (issued MXU FLOPs, grid steps, HBM bytes, and the hot-loop / branch trip counts
  walked from the kernel's work list) and the per-step bundles read from the compiled LLO
  schedule of the same kernel at the same tiles and static configuration (a deviceless compile
  with libtpu's dump on, one subprocess per compile, `llo_schedule.dump_schedule`). A kernel's
  per-step code depends on its tiles and static configuration (heads, head dim, mask kind, dtype,
  weight shapes), not on the lengths, so one compile per distinct (op, tiles, static
  configuration, generation) serves every call with those tiles: the approximation is that the
  per-step bundles of a representative compile (the smallest call of the trace with those tiles)
  hold at every length. Compiles are cached in results/bucket_schedule_cache.json under the tiles,
  the static configuration, the generation and a hash of the kernel's sources
  (schedule_rows.kernel_sources), with a fingerprint of the lowered program as the fallback (a
  source edit that leaves the program for these tiles unchanged, e.g. a tile-policy fix, costs no
  compile). Where a needed compile is missing (`--cache-only`, `--max-compiles`), the per-step
  inputs are interpolated linearly in the row tile between the two nearest compiled row tiles of
  the same op and other tiles (ragged_dot's tm, paged attention's block_q), else taken from the
  nearest compiled tiles; the result says how many calls were priced each way.

Padding cost of a call = scheduled(bucket) / scheduled(exact) - 1 (and likewise for bytes),
reported per op and over all ops: mean over calls, worst (at the size given), and over the whole
trace (sum of extra / sum of unpadded). Times are scheduled (compiled schedule x closed-form
work), never measured; XLA's own ops around the kernels (layout copies, the torch-side pad to the
bucket) are left out. The bucket edges (one past every boundary, where padding is largest) get the
closed-form extra bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

import shape_buckets as SB

EXPERTS, TOP_K, HIDDEN, MOE_I = 128, 8, 2048, 768
HQ, HKV, D = 32, 8, 128
PAGE, PAGES_PER_SEQ = 16, 256
DTYPE = "bfloat16"
CACHE = HERE / "results" / "bucket_schedule_cache.json"

# Each priced kernel: its family (the kernel sources hashed into the cache key), the pallas_call
# name its dump is filtered by, and its static configuration (compile keys besides the tiles).
OPS = {
    "gmm_gate_up": dict(
        family="ragged_dot",
        kernel="ragged_dot_gmm_gated",
        static=dict(
            k=HIDDEN,
            n=MOE_I,
            groups=EXPERTS,
            dtype=DTYPE,
            transpose_rhs=True,
            layout="concatenated",
            activation="silu",
        ),
    ),
    "gmm_down": dict(
        family="ragged_dot",
        kernel="ragged_dot_gmm",
        static=dict(k=MOE_I, n=HIDDEN, groups=EXPERTS, dtype=DTYPE, transpose_rhs=True),
    ),
    "flash_attention": dict(
        family="flash_attention",
        kernel="flash_attention_fwd",
        static=dict(hq=HQ, hkv=HKV, d=D, dtype=DTYPE, causal=True, window=[-1, -1], varlen=True),
    ),
    "paged_attention": dict(
        family="paged_attention",
        kernel="ragged_paged_attention",
        static=dict(
            hq=HQ,
            hkv=HKV,
            d=D,
            page=PAGE,
            pages_per_seq=PAGES_PER_SEQ,
            dtype=DTYPE,
            causal=True,
            window=None,
        ),
    ),
}
# The tile field the per-step code scales with (the interpolation axis), per op.
ROW_FIELD = {"gmm_gate_up": 0, "gmm_down": 0, "paged_attention": 0}


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


def _cdiv(a, b):
    return -(-a // b)


def _routing(tokens, rng):
    """Group sizes of top-8-of-128 routing with random distinct experts per token."""
    start = rng.integers(0, EXPERTS, size=(tokens, 1))
    picks = (start + np.arange(TOP_K) * (EXPERTS // TOP_K)) % EXPERTS
    return np.bincount(picks.reshape(-1), minlength=EXPERTS)


# -------------------------------------------------------------------------------------------------
# One call of one kernel at one size: its tiles, closed-form work and work-list trip counts
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Side:
    op: str
    tiles: tuple  # the tiles the compiled per-step code depends on (part of the cache key)
    args: dict  # compile_target's arguments for a call with these tiles
    size: int  # orders the calls sharing tiles: the smallest is the one compiled
    cost: object  # tpu_generations.KernelCost
    trips: dict  # scheduled_from_work's trip-count arguments


def gmm_side(op, m, group_sizes, generation) -> Side:
    RD = _load("ragged_dot")
    T = RD.tiling
    st = OPS[op]["static"]
    layout = st.get("layout")
    t = T.gmm_tiling(
        m,
        st["k"],
        st["n"],
        DTYPE,
        DTYPE,
        DTYPE,
        num_groups=st["groups"],
        generation=generation,
        gate_layout=layout,
    )
    weight_cols = 2 * st["n"] if layout else st["n"]
    cost = T.estimate_cost(
        "gmm",
        (m, st["k"]),
        (st["groups"], weight_cols, st["k"]),
        group_sizes,
        transpose_rhs=True,
        gate_layout=layout,
        tiling=t,
        generation=generation,
    )
    # Trip counts from the kernel's own work list, as the benchmark rows count them.
    import ours

    trips = ours.gmm_trips(RD, group_sizes, m, st["k"], st["n"], DTYPE, t, generation)
    key = (t.tm, t.tk, t.tn)
    return Side(op, key, {"m": m, "tiles": list(key)}, m, cost, trips)


def flash_side(total, cu, generation) -> Side:
    """One varlen call of `total` packed tokens with sequence offsets `cu` (slots included)."""
    FA = _load("flash_attention")
    T = FA.tiling
    t = T.choose_tiles(
        q_len=total,
        kv_len=total,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=DTYPE,
        causal=True,
        generation=generation,
        total_q=total,
        total_kv=total,
    )
    cost = T.estimate_cost(
        batch=1,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        q_len=total,
        kv_len=total,
        head_dim=D,
        dtype=DTYPE,
        causal=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        tiles=t,
        generation=generation,
    )
    # MXU pushes on the step's two paths (interior, edge walk), as the benchmark rows charge
    # them (ours.FlashAttention.schedule_trips).
    import ours

    key = (t.block_q, t.q_compute, t.block_kv, t.block_kv_compute)
    args = {"total": total, "seqs": len(cu) - 1, "tiles": dataclasses.asdict(t)}
    pushes = ours.flash_tile_pushes(T, generation, t, HQ // HKV, D)
    return Side("flash_attention", key, args, total, cost, ours.flash_branch_pushes(cost, pushes))


def paged_side(q_lens, kv_lens, num_tokens, max_seqs, generation) -> Side:
    PA = _load("paged_attention")
    T = PA.tiling
    cfg = T.choose_config(
        num_tokens=num_tokens,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        pages_per_seq=PAGES_PER_SEQ,
        q_dtype=DTYPE,
        kv_dtype=DTYPE,
        generation=generation,
    )
    cost = T.estimate_cost(
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        pages_per_seq=PAGES_PER_SEQ,
        max_num_seqs=max_seqs,
        num_tokens=num_tokens,
        generation=generation,
        tiles=cfg,
    )
    # Steps per compute path from the kernel's work list (tiling.path_runs, as
    # ours.PagedAttention.schedule_trips).
    import ours

    bq = cfg.block_q
    group = HQ // HKV
    rows = bq * group
    narrow = T.narrow_rows(group, rows)
    items = T.host_work_list(
        q_lens,
        kv_lens,
        block_q=bq,
        num_q_blocks=_cdiv(max(num_tokens, 1), bq),
        page_size=PAGE,
        pages_per_block=cfg.pages_per_block,
        sliding_window=None,
        causal=True,
    )
    trips = ours.paged_trips(
        T.path_runs(items, q_lens, block_q=bq, group=group, narrow=narrow)  # head-major: no pairs
    )
    trips["work_items"] = float(len(items))  # each q block's grid step loops over its items
    stream = bool(T.streams_page_table(max_seqs, PAGES_PER_SEQ, cfg))
    key = (bq, cfg.pages_per_block, stream)
    args = {
        "tokens": num_tokens,
        "seqs": max_seqs,
        "block_q": bq,
        "pages_per_block": cfg.pages_per_block,
    }
    return Side("paged_attention", key, args, num_tokens * 1000 + max_seqs, cost, trips)


# -------------------------------------------------------------------------------------------------
# The compiled programs (run in a fresh process by llo_schedule.dump_schedule)
# -------------------------------------------------------------------------------------------------


def _target(generation, op, args):
    """(fn, avals) of one kernel call with explicit tiles, as the public op runs it."""
    import jax.numpy as jnp

    bf, i32 = jnp.bfloat16, jnp.int32
    st = OPS[op]["static"]
    mod = _load(OPS[op]["family"])
    if op in ("gmm_gate_up", "gmm_down"):
        tm, tk, tn = args["tiles"]
        tiling = mod.tiling.GmmTiling(tm=tm, tk=tk, tn=tn)
        m, k, g = args["m"], st["k"], st["groups"]
        if op == "gmm_gate_up":

            def fn(lhs, rhs, gs):
                return mod.kernel.gmm_gated(
                    lhs,
                    rhs,
                    gs,
                    activation=st["activation"],
                    layout=st["layout"],
                    transpose_rhs=True,
                    out_dtype=bf,
                    tiling=tiling,
                    generation=generation,
                )

            cols = 2 * st["n"]
        else:

            def fn(lhs, rhs, gs):
                return mod.kernel.gmm(
                    lhs,
                    rhs,
                    gs,
                    transpose_rhs=True,
                    out_dtype=bf,
                    tiling=tiling,
                    generation=generation,
                )

            cols = st["n"]
        return fn, [((m, k), bf), ((g, cols, k), bf), ((g,), i32)]
    if op == "flash_attention":
        tiles = mod.tiling.Tiles(**args["tiles"])

        def fn(q, k, v, cu):
            o, _ = mod.kernel.flash_attention_fwd(
                q,
                k,
                v,
                causal=True,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                tiles=tiles,
                generation=generation,
            )
            return o

        t = args["total"]
        kv = ((t, HKV, D), bf)
        return fn, [((t, HQ, D), bf), kv, kv, ((args["seqs"] + 1,), i32)]
    if op == "paged_attention":
        cfg = mod.tiling.PagedAttentionConfig(
            block_q=args["block_q"], pages_per_block=args["pages_per_block"]
        )

        def fn(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs):
            return mod.kernel.ragged_paged_attention(
                q,
                kv_pages,
                kv_lens,
                page_table,
                cu_q_lens,
                num_seqs,
                config=cfg,
                generation=generation,
            )

        n = args["seqs"]
        return fn, [
            ((args["tokens"], HQ, D), bf),
            ((n * PAGES_PER_SEQ, 2 * HKV, PAGE, D), bf),
            ((n,), i32),
            ((n, PAGES_PER_SEQ), i32),
            ((n + 1,), i32),
            ((1,), i32),
        ]
    raise ValueError(f"unknown op {op!r}")


def compile_target(generation: str, op: str, args: dict, meta_out: str | None = None):
    """llo_schedule target: compile one kernel call for `generation` (the dump is the point).
    `meta_out`: a file that receives the hash of the kernel sources this process built the
    kernel from and the fingerprint of the program it compiled, so the schedule is cached under
    the sources it really came from even when they change meanwhile."""
    import jax

    import tpu_compile

    source = _source_hash(op)  # read just before the package is built from the same files
    fn, avals = _target(generation, op, args)
    with jax.default_device(tpu_compile.tpu_device(generation)):
        compiled = tpu_compile.compile_for(generation, fn, *avals)
    if meta_out:
        program = _fingerprint(generation, op, args)
        Path(meta_out).write_text(json.dumps({"source_hash": source, "program": program}))
    return compiled


def _fingerprint(generation, op, args) -> str | None:
    """A hash of the lowered program (Mosaic bodies without source locations), or None when the
    helpers for it are not there (schedule_rows' canonical form, tpu_compile.lower_for)."""
    try:
        import jax

        import schedule_rows
        import tpu_compile

        fn, avals = _target(generation, op, args)
        with jax.default_device(tpu_compile.tpu_device(generation)):
            return schedule_rows.lowered_fingerprint(tpu_compile.lower_for(generation, fn, *avals))
    except Exception:
        return None


# -------------------------------------------------------------------------------------------------
# The schedule cache: one compile per (op, tiles, static configuration, generation, sources)
# -------------------------------------------------------------------------------------------------


def _prefix(op, tiles, generation) -> str:
    static = json.dumps(OPS[op]["static"], sort_keys=True, separators=(",", ":"))
    return f"{op}|{','.join(str(int(x)) for x in tiles)}|{static}|{generation}|"


def _source_hash(op) -> str:
    import schedule_rows

    return schedule_rows._source_hash("ours", OPS[op]["family"])


def prune_cache() -> tuple[int, int]:
    """Drop the compiles an entry of the op's current sources at the same tiles, static
    configuration and generation supersedes (`schedule_rows.prune_cache`; `Schedules.model` reads
    older sources only where the current ones have none). Returns (entries before, after)."""
    import schedule_rows

    def source_of(prefix):  # "op|tiles|static|generation"
        op = prefix.split("|", 1)[0]
        return _source_hash(op) if op in OPS else None

    return schedule_rows.prune_cache(CACHE, source_of)


def _load_cache() -> dict:
    import schedule_rows

    return schedule_rows._load_cache(CACHE)


def _save_entry(key, entry) -> None:
    import schedule_rows

    schedule_rows._save_cache({key: entry}, CACHE)


def _compile(side: Side, generation) -> dict:
    """The schedule entry of one compile, with the source hash and program fingerprint of what
    the compiling process built (`_source`, `_program`)."""
    import tempfile

    import llo_schedule
    import schedule_model

    t0 = time.time()
    fd, meta = tempfile.mkstemp(prefix="bucket-meta-", suffix=".json")
    os.close(fd)
    args = {"op": side.op, "args": side.args, "meta_out": meta}
    try:
        scheds = llo_schedule.dump_schedule(
            "bucket_padding:compile_target", generation, args, name=OPS[side.op]["kernel"]
        )
        info = json.loads(Path(meta).read_text())
    except Exception as e:  # a compile that fails is reported, not fatal
        return {"error": str(e).strip().splitlines()[-1][:240] if str(e).strip() else repr(e)}
    finally:
        os.unlink(meta)
    mosaic = [s for s in scheds if s.is_mosaic]
    xla = [s for s in scheds if not s.is_mosaic]
    kernel = max(mosaic or scheds, key=lambda s: len(s.bundles))
    return {
        "kernel": kernel.name,
        "bundles": len(kernel.bundles),
        "compiled_at": side.args,
        "compile_seconds": round(time.time() - t0, 1),
        "compiled_unix": int(time.time()),
        "_model": schedule_model.work_model_inputs(
            kernel,
            xla,
            nested_paths=side.op in schedule_model.NESTED_PATHS,
            item_loop=side.op in schedule_model.ITEM_LOOPS,
        ),
        "_program": info["program"],
        "_source": info["source_hash"],
    }


class Schedules:
    """Per-step model inputs per (op, tiles): from the cache, a compile, or interpolated."""

    def __init__(self, generation, compile_budget=None):
        self.generation = generation
        self.budget = compile_budget  # None: compile everything missing
        self.cache = _load_cache()
        self.hash = {op: _source_hash(op) for op in OPS}
        self.compiled = []
        self.failed = {}

    def key(self, op, tiles):
        return _prefix(op, tiles, self.generation) + self.hash[op]

    def cached(self, side: Side):
        key = self.key(side.op, side.tiles)
        entry = self.cache.get(key)
        if entry is not None and _usable(entry):
            return entry
        if entry is not None:  # read by an older schedule_model: compile it again
            del self.cache[key]
            return None
        # Same op, tiles and static config under other sources: reuse it if the program for
        # these tiles did not change.
        prefix = _prefix(side.op, side.tiles, self.generation)
        older = [
            e
            for k, e in self.cache.items()
            if k.startswith(prefix) and e.get("_program") and _usable(e)
        ]
        if not older:
            return None
        program = _fingerprint(self.generation, side.op, side.args)
        same = [e for e in older if program and e["_program"] == program]
        if same:
            self.cache[key] = same[0]
            _save_entry(key, same[0])
            return same[0]
        return None

    def fill(self, side: Side):
        """Compile `side`'s tiles unless cached; False once the compile budget is spent."""
        if self.cached(side) is not None:
            return True
        if self.budget is not None and len(self.compiled) >= self.budget:
            return False
        print(f"compiling {side.op} tiles {side.tiles} at {side.args}", file=sys.stderr, flush=True)
        entry = _compile(side, self.generation)
        if "error" in entry:
            self.failed[(side.op, side.tiles)] = entry["error"]
            print(f"  failed: {entry['error']}", file=sys.stderr, flush=True)
            return True
        # Cached under the sources the compiling process built the kernel from. When they
        # changed since this process started (another edit meanwhile), the entry also serves
        # this run if the program this process would compile is the same.
        source = entry.pop("_source")
        _save_entry(_prefix(side.op, side.tiles, self.generation) + source, entry)
        key = self.key(side.op, side.tiles)
        if source == self.hash[side.op] or (
            entry["_program"]
            and entry["_program"] == _fingerprint(self.generation, side.op, side.args)
        ):
            self.cache[key] = entry
            if source != self.hash[side.op]:
                _save_entry(key, entry)
        else:
            print("  sources changed meanwhile: cached for them only", file=sys.stderr, flush=True)
        self.compiled.append((side.op, side.tiles, entry["compile_seconds"]))
        print(f"  {entry['compile_seconds']} s", file=sys.stderr, flush=True)
        return True

    def model(self, op, tiles, paths=None):
        """(model inputs, provenance): 'compiled', 'interpolated', 'nearest' or 'missing'.
        `paths`: the number of alternative MXU paths the kernel at `tiles` has (paged attention
        compiles its narrow decode path only when a q block is wider than it): schedules of
        another structure are not borrowed while one of this structure is there. When no
        schedule of the current sources of the op is there at all (its kernel changed since),
        the most recent schedules of older sources are used instead, and the provenance says
        so ('... (older sources)')."""
        current, older = {}, {}
        for k, e in self.cache.items():
            parts = k.split("|")
            if parts[0] != op or "_model" not in e or not _usable(e):
                continue
            t = _tiles_of(parts[1])
            if k == self.key(op, t):
                current[t] = e
            elif k.startswith(_prefix(op, t, self.generation)):
                if t not in older or e.get("compiled_unix", 0) > older[t].get("compiled_unix", 0):
                    older[t] = e
        if current:
            return self._pick(op, tiles, paths, {t: e["_model"] for t, e in current.items()})
        model, how = self._pick(op, tiles, paths, {t: e["_model"] for t, e in older.items()})
        return model, (how if model is None else f"{how} (older sources)")

    @staticmethod
    def _pick(op, tiles, paths, have):
        if tiles in have:
            return have[tiles], "compiled"
        if paths is not None:
            fits = {t: m for t, m in have.items() if len(m.get("mxu_branches") or []) == paths}
            have = fits or have
        if not have:
            return None, "missing"
        axis = ROW_FIELD.get(op)
        if axis is not None:
            same = {t: m for t, m in have.items() if _others(t, axis) == _others(tiles, axis)}
            lo = [t for t in same if t[axis] < tiles[axis]]
            hi = [t for t in same if t[axis] > tiles[axis]]
            if lo and hi:
                a = max(lo, key=lambda t: t[axis])
                b = min(hi, key=lambda t: t[axis])
                w = (tiles[axis] - a[axis]) / (b[axis] - a[axis])
                if _same_structure(same[a], same[b]):
                    return _lerp(same[a], same[b], w), "interpolated"
                return (same[a] if w <= 0.5 else same[b]), "nearest"
        near = min(have, key=lambda t: _tile_distance(t, tiles))
        return have[near], "nearest"


def _usable(entry: dict) -> bool:
    """Whether schedule_model accepts the entry's model inputs (it rejects per-step bundles an
    older reader left negative: regions counted twice)."""
    model = entry.get("_model")
    if not model:
        return False
    if entry.get("kernel", "").startswith("flash") and "step_bundles" not in model:
        return False  # flash is charged per MXU path: read before the reader recorded them
    return model.get("hot_is_grid") is not False or model.get("per_step_overhead_bundles", 0) >= 0


def _same_structure(a: dict, b: dict) -> bool:
    """Whether two compiles' model inputs describe the same loop structure (interpolable)."""
    return a.get("hot_is_grid") == b.get("hot_is_grid") and len(a.get("mxu_branches") or []) == len(
        b.get("mxu_branches") or []
    )


def _fit_trips(trips: dict, model: dict) -> dict:
    """A side's trip counts in the form its model takes: per-path step counts only where the
    schedule has those paths (a borrowed schedule may have one path: every busy step runs it);
    no work_items for a schedule compiled when each work item was a grid step."""
    if "work_items" in trips and not model.get("items_in_step"):
        trips = {k: v for k, v in trips.items() if k != "work_items"}
    paths = len(model.get("mxu_branches") or [])
    if "branch_pushes" in trips and paths != len(trips["branch_pushes"]):
        raise ValueError(
            f"a flash schedule with {paths} MXU paths cannot take branch_pushes: recompile it"
        )
    if "branch_runs" in trips and paths != len(trips["branch_runs"]):
        return {"hot_iterations": float(sum(trips["branch_runs"]))}
    if "branch_runs" not in trips and paths >= 2 and "hot_iterations" in trips:
        # every busy step: the whole block, the last path
        return {"branch_runs": [0.0] * (paths - 1) + [trips["hot_iterations"]]}
    return trips


def _tiles_of(text):
    return tuple(int(x) for x in text.split(","))


def _others(tiles, axis):
    return tuple(x for i, x in enumerate(tiles) if i != axis)


def _tile_distance(a, b):
    return sum(abs(math.log2(max(x, 1)) - math.log2(max(y, 1))) for x, y in zip(a, b))


def _lerp(a: dict, b: dict, w: float) -> dict:
    """Numbers (and lists of numbers of equal shape) interpolated; anything else from the
    nearer compile."""
    near = a if w <= 0.5 else b

    def mix(x, y, fallback):
        if isinstance(x, bool) or isinstance(y, bool):
            return fallback
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            return x + w * (y - x)
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            return [mix(p, q, f) for p, q, f in zip(x, y, fallback)]
        return fallback

    return {
        k: (mix(a[k], b[k], near[k]) if k in a and k in b else near.get(k, a.get(k))) for k in near
    }


# -------------------------------------------------------------------------------------------------
# The trace
# -------------------------------------------------------------------------------------------------


def plan(generation="v6e"):
    """Per trace call, the (exact, bucket) Side pairs of every op it runs, grouped by report row:
    {row name: [(size, [(exact, bucket), ...]), ...]}."""
    rng = np.random.default_rng(1)
    rows = {name: [] for name in ("ragged_dot", "flash_attention", "paged_decode", "paged_prefill")}
    for kind, size in serving_trace():
        gs = _routing(size, rng)
        m = size * TOP_K
        pairs = [
            (gmm_side(op, m, gs, generation), gmm_side(op, SB.bucket_tokens(m), gs, generation))
            for op in ("gmm_gate_up", "gmm_down")
        ]
        rows["ragged_dot"].append((m, pairs))
        if kind == "prefill":
            slots = SB.bucket_count(1)
            exact = flash_side(size, [0, size], generation)
            padded = flash_side(SB.bucket_tokens(size), [0] + [size] * slots, generation)
            rows["flash_attention"].append((size, [(exact, padded)]))
            pair = (
                paged_side([size], [size], size, 1, generation),
                paged_side([size], [size], SB.bucket_tokens(size), slots, generation),
            )
            rows["paged_prefill"].append((size, [pair]))
        else:
            kv = [int(x) for x in rng.integers(1, PAGE * PAGES_PER_SEQ, size=size)]
            q = [1] * size
            pair = (
                paged_side(q, kv, size, size, generation),
                paged_side(q, kv, SB.bucket_tokens(size), SB.bucket_count(size), generation),
            )
            rows["paged_decode"].append((size, [pair]))
    return rows


def _bisection(values):
    """Sorted values in the order that covers their range soonest: both ends, then midpoints."""
    values = sorted(values)
    if len(values) <= 2:
        return values
    out, spans = [values[0], values[-1]], [(0, len(values) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            out.append(values[mid])
            nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return out


def compile_order(rows) -> list[Side]:
    """One representative Side per distinct (op, tiles), in the order compiles are worth most:
    the ends of every row-tile range (so interpolation covers every call), then round-robin over
    flash's tiles (most-used first, two per round: nothing to interpolate along) and the
    midpoints of the row-tile ranges."""
    rep, uses = {}, {}
    for pairs in rows.values():
        for _, ps in pairs:
            for pair in ps:
                for s in pair:
                    k = (s.op, s.tiles)
                    uses[k] = uses.get(k, 0) + 1
                    if k not in rep or s.size < rep[k].size:
                        rep[k] = s
    lists = []
    for op in OPS:
        keys = [k for k in rep if k[0] == op]
        axis = ROW_FIELD.get(op)
        if axis is None:
            lists.append(sorted(keys, key=lambda k: -uses[k]))
            continue
        groups = {}
        for k in keys:
            groups.setdefault(_others(k[1], axis), []).append(k)
        for group in groups.values():
            by_row = {k[1][axis]: k for k in group}
            lists.append([by_row[v] for v in _bisection(by_row)])
    order = [
        k for lst in lists if OPS[lst[0][0]].get("family") != "flash_attention" for k in lst[:2]
    ]
    queues = [[k for k in lst if k not in order] for lst in lists]
    while any(queues):
        for q in queues:
            for _ in range(2 if q and q[0][0] == "flash_attention" else 1):
                if q:
                    order.append(q.pop(0))
    return [rep[k] for k in order]


def _summary(per_call):
    """per_call: (size, exact bytes, bucket bytes, exact us, bucket us)."""
    if not per_call:
        return {}
    timed = [r for r in per_call if len(r) == 5]
    a = np.array([r[1:3] for r in per_call], dtype=np.float64)
    rb = a[:, 1] / a[:, 0] - 1
    out = {
        "calls": len(per_call),
        "calls_scheduled": len(timed),
        "extra_bytes_mean_pct": 100 * float(rb.mean()),
        "extra_bytes_worst_pct": 100 * float(rb.max()),
        "extra_bytes_worst_at": per_call[int(np.argmax(rb))][0],
        "extra_bytes_total_pct": 100 * float(a[:, 1].sum() / a[:, 0].sum() - 1),
    }
    if timed:
        t = np.array([r[3:] for r in timed], dtype=np.float64)
        rt = t[:, 1] / t[:, 0] - 1
        out.update(
            extra_time_mean_pct=100 * float(rt.mean()),
            extra_time_worst_pct=100 * float(rt.max()),
            extra_time_worst_at=timed[int(np.argmax(rt))][0],
            extra_time_best_pct=100 * float(rt.min()),
            extra_time_total_pct=100 * float(t[:, 1].sum() / t[:, 0].sum() - 1),
            scheduled_us_exact=round(float(t[:, 0].sum()), 1),
            scheduled_us_bucket=round(float(t[:, 1].sum()), 1),
        )
    return out


def measure(generation="v6e", max_compiles=None, fill_only=False):
    from tpu_generations import get_generation

    gen = get_generation(generation)
    rows = plan(generation)
    sched = Schedules(generation, max_compiles)
    for side in compile_order(rows):
        sched.fill(side)  # past the compile budget: only what the cache holds
    if fill_only:
        return None
    provenance = {}

    def scheduled_us(side):
        paths = None
        if side.op == "paged_attention":
            paths = len(side.trips.get("branch_runs", ()))
        model, how = sched.model(side.op, side.tiles, paths)
        provenance.setdefault(side.op, {}).setdefault(how, 0)
        provenance[side.op][how] += 1
        if model is None:
            return None
        import schedule_model

        steps = side.cost.grid_steps
        if "work_items" in side.trips and not model.get("items_in_step"):
            steps = side.trips["work_items"]  # compiled when each item was a grid step
        t = schedule_model.scheduled_from_work(
            model,
            mxu_flops=side.cost.mxu_flops,
            grid_steps=steps,
            hbm_bytes=side.cost.hbm_bytes,
            generation=gen,
            **_fit_trips(side.trips, model),
        )
        return t["scheduled_us"]

    per_row, detail, unpriced = {}, {}, {}
    for name, calls in rows.items():
        out = []
        for size, pairs in calls:
            eb = sum(e.cost.hbm_bytes for e, _ in pairs)
            bb = sum(b.cost.hbm_bytes for _, b in pairs)
            times = [(scheduled_us(e), scheduled_us(b)) for e, b in pairs]
            if any(t is None for pair in times for t in pair):
                out.append((size, eb, bb))  # no schedule of this kernel at all: bytes only
            else:
                out.append((size, eb, bb, sum(e for e, _ in times), sum(b for _, b in times)))
        if any(len(r) == 3 for r in out):  # a row priced in part would be biased: bytes only
            unpriced[name] = sum(len(r) == 3 for r in out)
            out = [r[:3] for r in out]
        per_row[name] = out
        detail[name] = out
    trace = {name: _summary(r) for name, r in per_row.items()}
    every = [r for rs in per_row.values() for r in rs]
    trace["all_ops"] = _summary(every)

    # Where flash's padded call is slower: the padding, or the tiles chosen for the bucket's
    # length? An unpadded call of exactly the bucket's length answers it (same tiles as the
    # padded call: no compile of its own).
    f_calls = [r for r in per_row["flash_attention"] if len(r) == 5]
    worst = max(f_calls, key=lambda r: r[4] / r[3])[0] if f_calls else 1644
    bucket = SB.bucket_tokens(worst)
    exact = flash_side(worst, [0, worst], generation)
    padded = flash_side(bucket, [0] + [worst] * SB.bucket_count(1), generation)
    at_bucket = flash_side(bucket, [0, bucket], generation)
    flash_note = {
        "size": worst,
        "bucket": bucket,
        "unpadded_us": scheduled_us(exact),
        "unpadded_steps": exact.cost.grid_steps,
        "unpadded_tiles": list(exact.tiles),
        "padded_us": scheduled_us(padded),
        "padded_steps": padded.cost.grid_steps,
        "padded_tiles": list(padded.tiles),
        "bucket_length_unpadded_us": scheduled_us(at_bucket),
        "bucket_length_unpadded_steps": at_bucket.cost.grid_steps,
    }

    # Bucket edges: closed-form extra bytes (exact; no compile needed).
    rng = np.random.default_rng(2)
    edges = {name: [] for name in rows}
    for size in edge_sizes(4096):
        gs = _routing(size, rng)
        m = size * TOP_K
        pairs = [
            (gmm_side(op, m, gs, generation), gmm_side(op, SB.bucket_tokens(m), gs, generation))
            for op in ("gmm_gate_up", "gmm_down")
        ]
        edges["ragged_dot"].append(
            (m, sum(e.cost.hbm_bytes for e, _ in pairs), sum(b.cost.hbm_bytes for _, b in pairs))
        )
        e = flash_side(size, [0, size], generation)
        b = flash_side(SB.bucket_tokens(size), [0, size], generation)
        edges["flash_attention"].append((size, e.cost.hbm_bytes, b.cost.hbm_bytes))
        e = paged_side([size], [size], size, 1, generation)
        b = paged_side([size], [size], SB.bucket_tokens(size), 1, generation)
        edges["paged_prefill"].append((size, e.cost.hbm_bytes, b.cost.hbm_bytes))
    for size in edge_sizes(64):
        kv = [int(x) for x in rng.integers(1, PAGE * PAGES_PER_SEQ, size=size)]
        q = [1] * size
        e = paged_side(q, kv, size, size, generation)
        b = paged_side(q, kv, SB.bucket_tokens(size), SB.bucket_count(size), generation)
        edges["paged_decode"].append((size, e.cost.hbm_bytes, b.cost.hbm_bytes))

    distinct = {}
    for op in OPS:
        ks = {
            s.tiles
            for calls in rows.values()
            for _, ps in calls
            for p in ps
            for s in p
            if s.op == op
        }
        distinct[op] = {
            "tile_sets": len(ks),
            "compiled": sum(
                1 for t in ks if _usable(sched.cache.get(sched.key(op, t), {"_model": None}))
            ),
        }
    return {
        "generation": generation,
        "policy": SB.bucket_policy().to_env(),
        "schedules": {op: {**distinct[op], "priced_sides": provenance.get(op, {})} for op in OPS},
        "compile_failures": {f"{op} {list(t)}": e for (op, t), e in sched.failed.items()},
        # Rows without a scheduled time: calls whose kernels have no usable compiled schedule
        # (none compiled, or read by an older schedule_model); rerun without --cache-only.
        "unscheduled_rows": unpriced,
        "flash_worst_call": flash_note,
        "trace": trace,
        "bucket_edges": {name: _summary(r) for name, r in edges.items()},
    }


def to_markdown(result):
    if "schedules" not in result:  # a result from before the scheduled times
        return "(bucket padding: rerun benchmarks/bucket_padding.py)\n"
    sch = result["schedules"]
    compiled = sum(s["compiled"] for s in sch.values())
    needed = sum(s["tile_sets"] for s in sch.values())
    priced = {}
    for s in sch.values():
        for how, n in s["priced_sides"].items():
            priced[how] = priced.get(how, 0) + n
    how_text = ", ".join(f"{n} {how}" for how, n in sorted(priced.items()))
    lines = [
        f"Padding cost of the shape buckets ({result['policy']}) on {result['generation']}, "
        "scheduled (benchmarks/bucket_padding.py). Every call of the 200-call serving trace "
        "(prompts 1-4096 tokens log-uniform, decode batches 1-64, top-8 of 128 experts) is priced "
        "at the caller's size with the tiles the policy picks for it (what an unbucketed call "
        "runs) and at its bucket size with the bucket's tiles (what runs): padding cost = "
        "scheduled(bucket) / scheduled(exact) - 1. Scheduled time = "
        "schedule_model.scheduled_from_work on the call's own closed-form work (MXU FLOPs, grid "
        "steps, HBM bytes, work-list trip counts at that size) with the per-step bundles of the "
        "compiled LLO schedule of the same kernel at the same tiles and static configuration "
        "(deviceless libtpu compile). Approximation: one representative compile per (op, tiles) "
        "(the smallest trace call with those tiles); its per-step bundles are taken to hold at "
        f"every length. {compiled} of the {needed} distinct (kernel, tiles) the trace needs are "
        f"compiled; priced kernel calls: {how_text} (interpolated: per-step inputs linear in the "
        "row tile between the two nearest compiled row tiles; nearest: the nearest compiled "
        "tiles). Extra bytes are the closed forms (exact). Kernels only: XLA's ops around them "
        "(layout copies, the pad to the bucket) are not counted.",
        "",
        "**200-call serving trace**",
        "",
        "| op | calls | bytes mean | bytes worst (size) | bytes total | scheduled mean | "
        "scheduled worst (size) | scheduled total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["trace"].items():
        if not s:
            continue
        timed = (
            f"{s['extra_time_mean_pct']:.1f}% | "
            f"{s['extra_time_worst_pct']:.1f}% ({s['extra_time_worst_at']}) | "
            f"{s['extra_time_total_pct']:.1f}%"
            if s.get("calls_scheduled")
            else "no schedule | | "
        )
        lines.append(
            f"| {name.replace('_', ' ') if name == 'all_ops' else name} | {s['calls']} | "
            f"{s['extra_bytes_mean_pct']:.1f}% | "
            f"{s['extra_bytes_worst_pct']:.1f}% ({s['extra_bytes_worst_at']}) | "
            f"{s['extra_bytes_total_pct']:.1f}% | {timed} |"
        )
    lines += [
        "",
        "**Bucket edges (one past each boundary): extra bytes, closed form**",
        "",
        "| op | sizes | bytes mean | bytes worst (size) | bytes total |",
        "|---|---|---|---|---|",
    ]
    for name, s in result["bucket_edges"].items():
        if s:
            lines.append(
                f"| {name} | {s['calls']} | {s['extra_bytes_mean_pct']:.1f}% | "
                f"{s['extra_bytes_worst_pct']:.1f}% ({s['extra_bytes_worst_at']}) | "
                f"{s['extra_bytes_total_pct']:.1f}% |"
            )
    lines += [
        "",
        "Sizes: ragged_dot rows (tokens x 8; gate_up and down summed), flash / paged prefill "
        "prompt tokens, paged decode batch. A negative scheduled cost is a call that runs faster "
        "at its bucket (other tiles).",
    ]
    f = result["flash_worst_call"]
    lines += (
        []
        if f.get("unpadded_us") is None
        else [
            "",
            f"flash_attention's worst call: {f['size']} tokens unpadded, tiles "
            f"{tuple(f['unpadded_tiles'])} (block_q, q compute, block_kv, kv compute), scheduled "
            f"{f['unpadded_us']:.1f} us in {f['unpadded_steps']} grid steps; padded to "
            f"{f['bucket']}, tiles {tuple(f['padded_tiles'])}, {f['padded_us']:.1f} us in "
            f"{f['padded_steps']} steps; an unpadded call of exactly {f['bucket']} tokens, "
            f"{f['bucket_length_unpadded_us']:.1f} us in {f['bucket_length_unpadded_steps']} steps "
            "(the padded tokens belong to no sequence and get no work item: what differs is the "
            "tiles tiling.choose_tiles picks at the bucket's length).",
        ]
    )
    if result.get("compile_failures"):
        lines += [
            "",
            "Compiles that failed: "
            + "; ".join(f"{k}: {v}" for k, v in result["compile_failures"].items()),
        ]
    return "\n".join(lines) + "\n"


README_START = "<!-- bucket_padding.py: start -->"
README_END = "<!-- bucket_padding.py: end -->"


def readme_paragraph(result) -> str:
    """README's padding sentence ("Compilation and shape buckets"), every number from `result`."""
    import textwrap

    t = result["trace"]
    if any(not v.get("calls_scheduled") for v in t.values()):
        return "(bucket padding: some kernels have no compiled schedule yet)"
    rd, fl, pd, pp, al = (
        t[k] for k in ("ragged_dot", "flash_attention", "paged_decode", "paged_prefill", "all_ops")
    )
    f = result["flash_worst_call"]
    sch = result["schedules"]
    compiled = sum(s["compiled"] for s in sch.values())
    needed = sum(s["tile_sets"] for s in sch.values())
    ways = {}
    for s in sch.values():
        for how, n in s["priced_sides"].items():
            ways[how] = ways.get(how, 0) + n

    def count(word):
        return sum(n for how, n in ways.items() if how.startswith(word))

    older = sum(n for how, n in ways.items() if "older" in how)
    if compiled == needed:
        coverage = f"all {needed} distinct kernels the trace runs compiled"
    else:
        coverage = (
            f"{compiled} of the {needed} distinct kernels the trace runs compiled, the others' "
            f"per-step bundles interpolated along the row tile ({count('interpolated')} of "
            f"{sum(ways.values())} priced kernel calls) or taken from the nearest compiled "
            f"tiles ({count('nearest')})"
        )
    if older:
        coverage += f", {older} calls from schedules of older kernel sources"

    def pct(x):
        return f"{x:.1f}%"

    def signed(x):
        return f"{x:+.1f}%"

    same = abs(f["padded_us"] - f["bucket_length_unpadded_us"]) <= 0.05 * f["padded_us"]
    cause = " is the tile policy's choice at the bucket length, not padded work" if same else ""
    verdict = "costs little" if al["extra_time_mean_pct"] <= 10 else "is not small"
    text = (
        f"The padding {verdict}. Over the same trace, each call priced at its own size and at "
        f"its bucket, {result['generation']} scheduled time (the per-step bundles of the compiled "
        f"LLO schedule of each kernel at the tiles it runs, {coverage}, times the call's own "
        f"closed-form work) changes by {signed(rd['extra_time_mean_pct'])} mean for the experts' "
        f"grouped matmuls (worst {signed(rd['extra_time_worst_pct'])}), "
        f"{signed(pd['extra_time_mean_pct'])} for paged decode (worst "
        f"{signed(pd['extra_time_worst_pct'])}), "
        f"{signed(pp['extra_time_mean_pct'])} for paged prefill and {signed(fl['extra_time_mean_pct'])} "
        f"for flash prefill, {signed(al['extra_time_mean_pct'])} mean over all "
        f"{al['calls']} kernel calls and {signed(al['extra_time_total_pct'])} of the whole trace's "
        f"time. Flash's worst call ({signed(fl['extra_time_worst_pct'])} at "
        f"{fl['extra_time_worst_at']} tokens: {f['unpadded_us']:.0f} us unpadded, "
        f"{f['padded_us']:.0f} us padded to {f['bucket']}, {f['bucket_length_unpadded_us']:.0f} "
        f"us for an unpadded {f['bucket']}-token prompt){cause}. Extra HBM bytes (closed forms, exact): "
        f"{pct(rd['extra_bytes_mean_pct'])} mean for the grouped matmuls, "
        f"{pct(pd['extra_bytes_mean_pct'])} paged decode, {pct(pp['extra_bytes_mean_pct'])} "
        f"paged prefill, {pct(fl['extra_bytes_mean_pct'])} flash "
        f'(`benchmarks/results/results.md`, section "Shape buckets: the padding cost"; '
        f"`benchmarks/bucket_padding.py`)."
    )
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


def update_readme(result, path=ROOT / "README.md") -> bool:
    """Replace the paragraph between README's bucket_padding markers; False when absent."""
    text = path.read_text()
    a, b = text.find(README_START), text.find(README_END)
    if a < 0 or b < a:
        return False
    new = text[: a + len(README_START)] + "\n" + readme_paragraph(result) + "\n" + text[b:]
    if new != text:
        path.write_text(new)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generation", default="v6e")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--cache-only", action="store_true", help="compile nothing; missing tiles interpolated"
    )
    parser.add_argument("--max-compiles", type=int, default=None, help="compile at most N")
    parser.add_argument(
        "--fill-cache", action="store_true", help="only compile what is missing; write no result"
    )
    parser.add_argument(
        "--no-readme",
        action="store_true",
        help="leave README.md alone (default: rewrite its paragraph between the markers)",
    )
    args = parser.parse_args(argv)
    budget = 0 if args.cache_only else args.max_compiles
    result = measure(args.generation, budget, fill_only=args.fill_cache)
    before, after = prune_cache()
    print(f"bucket schedule cache: {before} -> {after} entries", file=sys.stderr)
    if result is None:
        return
    # The result joins results.json (the one source the report is written from) and its section
    # of results.md is regenerated with the rest of the report.
    import report

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["bucket_padding"] = result
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.out / "results.md").write_text(report.markdown(results))
    print(to_markdown(result))
    if not args.no_readme and args.out.resolve() == (ROOT / "benchmarks" / "results").resolve():
        print("README.md paragraph", "updated" if update_readme(result) else "markers not found")
    print(readme_paragraph(result))


if __name__ == "__main__":
    main()
