"""Sharded rows: what one device moves per layer when a layer runs on a TPU slice.

For each family's sharded program (kernels/ragged_dot/expert_parallel.py,
kernels/{flash,paged}_attention/tensor_parallel.py) at a real-model shape, per device:

  kernel HBM bytes     the family's closed form (`tiling.estimate_cost`) on the device's shard:
                       its experts with the rows routed to them, or its heads. The same closed
                       forms as the single-device rows of results.md (BlockSpec copies, checked
                       against the TPU interpreter's DMA counter there); XLA's ops around the
                       kernels (dispatch bookkeeping, o_proj matmul) are not in it.
  collectives          every collective of a deviceless compile of the whole sharded program for
                       the slice (tests/tpu_compile.py's topologies): op, operand and result
                       shapes read from the compiled HLO, and the bytes each device sends and
                       receives. Dense collectives (all-gather, reduce-scatter, all-reduce,
                       all-to-all) move a fixed volume: the bandwidth-optimal (ring) count,
                       (D-1)/D of the full buffer each way (all-reduce: twice that); a
                       collective-permute its operand, from each source to its target. A ragged
                       all-to-all's volume depends on the routing: the rows each device sends to
                       and receives from its peers under the benchmarks' seeded uniform routing
                       (benchmarks/shapes.py), times the row bytes read from the compiled op.
  memory               `memory_analysis()` of the compiled program (arguments, outputs, temporaries).

Nothing is timed. A collective's bytes become a time only as bytes / ICI bandwidth, a bound, and
only with a sourced bandwidth figure: ../shared/reference/tpu-hardware.md, the hardware reference
this project cites, lists none, so no time is given.

    python benchmarks/sharded.py              # recompute every row (12 deviceless compiles),
                                              # merge into results.json["sharded"], rewrite results.md
    python benchmarks/sharded.py --keep-compiled  # closed forms and routing recomputed, the
                                              # stored compiled fields kept (after a tiling change)
    python benchmarks/sharded.py --no-compile # print the closed forms only; writes nothing
    ... --readme                              # also rewrite README.md's table from the rows

The run prints the table README.md's "More than one chip" holds (tests/test_sharded_rows.py
checks README against results.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

RESULTS = HERE / "results" / "results.json"

# -------------------------------------------------------------------------------------------------
# The programs and their shapes
# -------------------------------------------------------------------------------------------------

# Qwen3-30B-A3B's experts block (the shapes of results.md's qwen3_30b_a3b rows).
QWEN3_30B_A3B = dict(experts=128, hidden=2048, inter=768, top_k=8, dtype="bfloat16")
MOE_TOKENS = (64, 4096)  # a decode batch, a prefill chunk
MOE_CASES = (  # (generation, collectives)
    ("v6e", "ragged_all_to_all"),
    ("v6e", "all_gather"),
    ("tpu7x", "ragged_all_to_all"),
    ("tpu7x", "all_gather"),
)
# Llama-3-8B attention (results.md's llama3_8b_causal_8192 and llama3_8b_decode_b64_ctx8192):
# 32 query heads, 8 KV heads of 128, hidden 4096; heads over the whole slice (tp = its devices).
LLAMA3_8B = dict(q_heads=32, kv_heads=8, head_dim=128, hidden=4096, dtype="bfloat16")
FLASH_SEQ = 8192
PAGED_SEQS, PAGED_CTX, PAGE_SIZE = 64, 8192, 128
TP_GENERATIONS = ("v6e", "tpu7x")
SEED = 0  # benchmarks/shapes.py's routing seed


def topology(generation: str) -> str:
    import tpu_compile

    return tpu_compile.GENERATIONS[generation].topology


@functools.cache
def slice_devices(generation: str):
    """The devices of the generation's deviceless slice (v6e 2x2: 4, TPU7x 2x2x1: 8)."""
    from jax.experimental import topologies

    import tpu_compile

    tpu_compile.tpu_device(generation)  # puts libtpu on the path
    return tuple(topologies.get_topology_desc(topology(generation), "tpu").devices)


# TPU7x shows each of a chip's two TensorCores as its own JAX device (tpu-hardware.md).
DEVICES_PER_CHIP = {"tpu7x": 2}


def num_devices(generation: str) -> int:
    """Devices of the slice from the topology name (v6e:2x2 -> 4; tpu7x:2x2x1 -> 4 chips, 8
    devices), without loading libtpu; the compiles check it against the topology's devices."""
    dims = [int(d) for d in topology(generation).split(":")[1].split("x")]
    return int(np.prod(dims)) * DEVICES_PER_CHIP.get(generation, 1)


# -------------------------------------------------------------------------------------------------
# Routing: the per-token picks behind benchmarks/shapes.py's group sizes
# -------------------------------------------------------------------------------------------------


@functools.cache
def routing_picks(tokens: int, experts: int, top_k: int, seed: int = SEED) -> np.ndarray:
    """[tokens, top_k] expert ids: shapes.routing_group_sizes' draw (each token picks top_k
    distinct experts uniformly at random), kept per token so that the picks can be split over
    the devices that hold the tokens."""
    import shapes

    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    counts = np.bincount(picks.ravel(), minlength=experts)
    assert np.array_equal(counts, shapes.routing_group_sizes(tokens, experts, top_k, seed))
    return picks


def moe_routing(tokens: int, devices: int, shape=QWEN3_30B_A3B) -> dict:
    """Per device d (tokens [d T/D, (d+1) T/D), experts [d E/D, (d+1) E/D)): the group sizes of
    its experts, the picks it sends to other devices' experts and the picks it receives from
    other devices' tokens."""
    e, k = shape["experts"], shape["top_k"]
    picks = routing_picks(tokens, e, k)
    local = e // devices
    owner = picks // local  # device holding each pick's expert
    home = np.repeat(np.arange(devices), tokens // devices)[:, None]  # device holding the token
    counts = np.bincount(picks.ravel(), minlength=e)
    return {
        "group_sizes": [counts[d * local : (d + 1) * local].tolist() for d in range(devices)],
        "rows_out": [int(((home == d) & (owner != d)).sum()) for d in range(devices)],
        "rows_in": [int(((home != d) & (owner == d)).sum()) for d in range(devices)],
    }


# -------------------------------------------------------------------------------------------------
# Kernel bytes per device: the closed forms on the local shard
# -------------------------------------------------------------------------------------------------


def _load(key):
    import ours

    return ours.load(key)


def moe_kernel_bytes(tokens: int, devices: int, generation: str, shape=QWEN3_30B_A3B) -> dict:
    """HBM bytes of the two grouped matmuls each device runs (gmm_gated with SiLU fused, then the
    down gmm) on its E/D experts. Their row block has T k rows on either path (the ragged path's
    worst-case receive buffer D x (T/D) k, the all-gather path's T k gathered picks): rows outside
    the device's groups are read by no MXU pass, but the kernels write their (zero) output rows.
    `own_rows`: the same calls on a row block holding only the device's routed rows (what a
    routing-sized buffer would cost). devices=1 gives the unsharded layer (moe_layer)."""
    tl = _load("ragged_dot").tiling
    e, h, i, k, dt = (shape[n] for n in ("experts", "hidden", "inter", "top_k", "dtype"))
    group_sizes = (
        [np.bincount(routing_picks(tokens, e, k).ravel(), minlength=e).tolist()]
        if devices == 1
        else moe_routing(tokens, devices, shape)["group_sizes"]
    )
    kw = dict(lhs_dtype=dt, rhs_dtype=dt, out_dtype=dt, generation=generation)

    def calls(rows, gs):
        gate_up = tl.estimate_cost(
            "gmm", (rows, h), (len(gs), h, 2 * i), gs, gate_layout="concatenated", **kw
        )
        down = tl.estimate_cost("gmm", (rows, i), (len(gs), i, h), gs, **kw)
        return {"gmm_gated": int(gate_up.hbm_bytes), "gmm_down": int(down.hbm_bytes)}

    per_device = [calls(tokens * k, gs) for gs in group_sizes]
    return {
        "per_device": [sum(d.values()) for d in per_device],
        "calls_per_device": per_device,
        "own_rows": [sum(calls(sum(gs), gs).values()) for gs in group_sizes],
    }


def flash_kernel_bytes(tp: int, generation: str, shape=LLAMA3_8B, seq=FLASH_SEQ) -> int:
    """Forward flash attention on Hq/tp query heads and Hkv/tp KV heads (tp=1: unsharded)."""
    tl = _load("flash_attention").tiling
    c = tl.estimate_cost(
        batch=1,
        num_q_heads=shape["q_heads"] // tp,
        num_kv_heads=shape["kv_heads"] // tp,
        q_len=seq,
        kv_len=seq,
        head_dim=shape["head_dim"],
        dtype=shape["dtype"],
        causal=True,
        generation=generation,
        pass_="fwd",
    )
    return int(c.hbm_bytes)


def paged_kernel_bytes(tp: int, generation: str, shape=LLAMA3_8B) -> int:
    """Decode (one token per sequence) over each device's KV heads of the paged cache."""
    tl = _load("paged_attention").tiling
    c = tl.estimate_cost(
        q_lens=[1] * PAGED_SEQS,
        kv_lens=[PAGED_CTX] * PAGED_SEQS,
        num_q_heads=shape["q_heads"] // tp,
        num_kv_heads=shape["kv_heads"] // tp,
        head_dim=shape["head_dim"],
        page_size=PAGE_SIZE,
        pages_per_seq=PAGED_CTX // PAGE_SIZE,
        q_dtype=shape["dtype"],
        kv_dtype=shape["dtype"],
        generation=generation,
    )
    return int(c.hbm_bytes)


# -------------------------------------------------------------------------------------------------
# Collectives in a compiled HLO module
# -------------------------------------------------------------------------------------------------

from llo_schedule import DTYPE_BYTES

COLLECTIVE_OPS = (
    "ragged-all-to-all",
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def array_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array shape written in `text` ("bf16[4,8]{1,0}" -> ("bf16", (4, 8)))."""
    return [
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in _ARRAY.findall(text)
        if dt in DTYPE_BYTES
    ]


def shape_bytes(shapes) -> int:
    return int(sum(DTYPE_BYTES[dt] * int(np.prod(dims, dtype=np.int64)) for dt, dims in shapes))


def _fmt_shape(shapes) -> str:
    return ", ".join(f"{dt}[{','.join(map(str, dims))}]" for dt, dims in shapes)


def _group_size(attrs: str) -> int | None:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)  # iota form: [groups, size]<=[n]
    return int(m.group(2)) if m else None


def hlo_collectives(hlo_text: str) -> list[dict]:
    """Every collective instruction of a compiled HLO module, in program order: op, operand and
    result shapes (operands looked up by name: compiled HLO prints them without shapes), the
    replica group size, and a collective-permute's source -> target pairs. An async pair counts
    once, as its -start, with the result of its -done."""
    shapes, done_of, found = {}, {}, []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        shapes[name] = result
        depth, args = 1, ""
        for ch in rest:  # the operand list: up to the matching parenthesis
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
            args += ch
        operands = re.findall(r"%([\w.\-]+)", args)
        if op.endswith("-done") and operands:
            done_of[operands[0]] = result
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base not in COLLECTIVE_OPS:
            continue
        attrs = rest[len(args) + 1 :]
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
        found.append(
            {
                "op": base,
                "name": name,
                "result": result,
                "operand_names": operands,
                "group_size": _group_size(attrs),
                "pairs": (
                    None
                    if pairs is None
                    else [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1])]
                ),
            }
        )
    out = []
    for c in found:
        result = array_shapes(done_of.get(c["name"], c["result"]))
        operands = [array_shapes(shapes.get(n, "")) for n in c["operand_names"]]
        entry = {
            "op": c["op"],
            "operands": [_fmt_shape(s) for s in operands],
            "result": _fmt_shape(result),
            "operand_bytes": [shape_bytes(s) for s in operands],
            "result_bytes": shape_bytes(result),
            "group_size": c["group_size"],
        }
        if c["pairs"] is not None:
            entry["source_target_pairs"] = c["pairs"]
        out.append(entry)
    return out


def dense_volume(c: dict, devices: int) -> tuple[list[int], list[int]] | None:
    """(sent, received) bytes per device, lists over the `devices` devices, of a collective whose
    volume the shapes fix, counted the bandwidth-optimal (ring) way for a group of D: all-gather
    (D-1)/D of its result each way, reduce-scatter and all-to-all (D-1)/D of their operand,
    all-reduce twice (D-1)/D of its operand (a reduce-scatter, then an all-gather);
    collective-permute: its operand, sent by each source and received by each target. None for a
    ragged all-to-all (its volume is the routing's)."""
    op, first = c["op"], (c["operand_bytes"] or [0])[0]
    if op == "collective-permute":
        pairs = c["source_target_pairs"]
        sent = [first * sum(a == d for a, _ in pairs) for d in range(devices)]
        got = [first * sum(b == d for _, b in pairs) for d in range(devices)]
        return sent, got
    frac = (c["group_size"] - 1) / c["group_size"]
    if op == "all-gather":
        v = round(frac * c["result_bytes"])
    elif op in ("reduce-scatter", "all-to-all"):
        v = round(frac * first)
    elif op == "all-reduce":
        v = round(2 * frac * first)
    else:
        return None
    return [v] * devices, [v] * devices


def moe_collective_volume(collectives: list[dict], tokens: int, devices: int, shape) -> list[dict]:
    """sent / received bytes per device (lists over devices) for each collective of the MoE
    program. A ragged all-to-all is the dispatch when its result holds the worst-case T k rows
    (every pick routed to this device), else the combine (the T/D k rows of this device's picks)."""
    routing = moe_routing(tokens, devices, shape)
    rows_worst = tokens * shape["top_k"]
    out = []
    for c in collectives:
        c = dict(c)
        if c["op"] == "ragged-all-to-all":
            ((dt, dims),) = array_shapes(c["result"])
            row_bytes = DTYPE_BYTES[dt] * int(np.prod(dims[1:]))
            dispatch = dims[0] == rows_worst
            c["role"] = "dispatch" if dispatch else "combine"
            sent = routing["rows_out"] if dispatch else routing["rows_in"]
            got = routing["rows_in"] if dispatch else routing["rows_out"]
            c["sent_bytes"] = [r * row_bytes for r in sent]
            c["received_bytes"] = [r * row_bytes for r in got]
        else:
            c["sent_bytes"], c["received_bytes"] = dense_volume(c, devices)
        out.append(c)
    return out


# -------------------------------------------------------------------------------------------------
# The sharded programs, compiled for a slice
# -------------------------------------------------------------------------------------------------


def _mesh(generation, axis):
    from jax.sharding import Mesh

    devices = slice_devices(generation)
    assert len(devices) == num_devices(generation), (generation, len(devices))
    return Mesh(np.array(devices), (axis,))


def _compile(fn, avals):
    import jax

    return jax.jit(fn).trace(*avals).lower().compile()


def compile_moe(generation, collectives, tokens, shape=QWEN3_30B_A3B):
    """expert_parallel_moe over all the slice's devices (the `ep` axis), Qwen3-30B-A3B experts."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ep = importlib_module("ragged_dot", "expert_parallel")
    mesh = _mesh(generation, "ep")
    e, h, i, k = (shape[n] for n in ("experts", "hidden", "inter", "top_k"))
    dt = jnp.dtype(shape["dtype"])

    def aval(s, d):
        return jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("ep")))

    avals = (
        aval((tokens, h), dt),
        aval((tokens, k), jnp.int32),
        aval((tokens, k), jnp.float32),
        aval((e, h, 2 * i), dt),
        aval((e, i, h), dt),
    )

    def layer(*a):
        return ep.expert_parallel_moe(*a, mesh=mesh, collectives=collectives, generation=generation)

    return _compile(layer, avals)


def _o_proj(mesh, shape):
    """The row-parallel o_proj after head-sharded attention: each device multiplies its heads'
    outputs by its rows of W_o, and a psum over `tp` sums the partial products (the layer's
    collective; attention itself has none)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def body(o, w):  # o [tokens, Hq/tp, D], w [Hq/tp * D, hidden]
        part = jnp.dot(o.reshape(o.shape[0], -1), w, preferred_element_type=jnp.float32)
        return jax.lax.psum(part.astype(o.dtype), "tp")

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P(), check_vma=False
    )


def compile_flash(generation, shape=LLAMA3_8B, seq=FLASH_SEQ):
    """tensor_parallel_flash_attention (causal, one 8192-token sequence) + row-parallel o_proj,
    heads over all the slice's devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ftp = importlib_module("flash_attention", "tensor_parallel")
    mesh = _mesh(generation, "tp")
    hq, hkv, d, hid = (shape[n] for n in ("q_heads", "kv_heads", "head_dim", "hidden"))
    dt = jnp.dtype(shape["dtype"])
    heads = NamedSharding(mesh, P(None, "tp"))
    avals = (
        jax.ShapeDtypeStruct((1, hq, seq, d), dt, sharding=heads),
        jax.ShapeDtypeStruct((1, hkv, seq, d), dt, sharding=heads),
        jax.ShapeDtypeStruct((1, hkv, seq, d), dt, sharding=heads),
        jax.ShapeDtypeStruct((hq * d, hid), dt, sharding=NamedSharding(mesh, P("tp"))),
    )
    o_proj = _o_proj(mesh, shape)

    def layer(q, k, v, w_o):
        o = ftp.tensor_parallel_flash_attention(
            q, k, v, mesh=mesh, causal=True, generation=generation
        )
        return o_proj(o[0].transpose(1, 0, 2), w_o)  # [S, Hq, D] -> [S, hidden]

    return _compile(layer, avals)


def compile_paged(generation, shape=LLAMA3_8B):
    """tensor_parallel_paged_attention (head-major cache, 64 decoding sequences of 8192 tokens,
    pages of 128) + row-parallel o_proj, heads over all the slice's devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ptp = importlib_module("paged_attention", "tensor_parallel")
    mesh = _mesh(generation, "tp")
    hq, hkv, d, hid = (shape[n] for n in ("q_heads", "kv_heads", "head_dim", "hidden"))
    dt = jnp.dtype(shape["dtype"])
    pages = PAGED_CTX // PAGE_SIZE
    heads, rep = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P())
    avals = (
        jax.ShapeDtypeStruct((PAGED_SEQS, hq, d), dt, sharding=heads),
        jax.ShapeDtypeStruct((PAGED_SEQS * pages, 2 * hkv, PAGE_SIZE, d), dt, sharding=heads),
        jax.ShapeDtypeStruct((PAGED_SEQS,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((PAGED_SEQS, pages), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((PAGED_SEQS + 1,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((hq * d, hid), dt, sharding=NamedSharding(mesh, P("tp"))),
    )
    o_proj = _o_proj(mesh, shape)

    def layer(q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, w_o):
        o = ptp.tensor_parallel_paged_attention(
            q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, mesh=mesh, generation=generation
        )
        return o_proj(o, w_o)

    return _compile(layer, avals)


def importlib_module(key, sub):
    import importlib

    return importlib.import_module(_load(key).__name__ + "." + sub)


def memory(compiled) -> dict | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
    }


# -------------------------------------------------------------------------------------------------
# Rows
# -------------------------------------------------------------------------------------------------


def _totals(row):
    """Bytes each device sends and receives over all the row's collectives (lists over devices;
    the report shows the busiest device, which bounds the step)."""
    cols = row.get("collectives")
    if cols is None:
        return row
    n = row["devices"]
    sent = [sum(c["sent_bytes"][d] for c in cols) for d in range(n)]
    got = [sum(c["received_bytes"][d] for c in cols) for d in range(n)]
    row["collective_sent_bytes"] = sent
    row["collective_received_bytes"] = got
    return row


def moe_rows(compile_: bool, log=print) -> list[dict]:
    rows = []
    s = QWEN3_30B_A3B
    for tokens in MOE_TOKENS:
        for gen, coll in MOE_CASES:
            n = num_devices(gen)
            kern = moe_kernel_bytes(tokens, n, gen)
            row = {
                "family": "ragged_dot",
                "program": "expert_parallel_moe",
                "model": "qwen3_30b_a3b",
                "shape": f"{tokens} tokens, E={s['experts']} H={s['hidden']} I={s['inter']} "
                f"top-{s['top_k']} bf16",
                "tokens": tokens,
                "generation": gen,
                "topology": topology(gen),
                "devices": n,
                "axis": "ep",
                "collectives_path": coll,
                "kernel_hbm_bytes": kern["per_device"],
                "kernel_calls": kern["calls_per_device"],
                "kernel_hbm_bytes_own_rows": kern["own_rows"],
                "kernel_hbm_bytes_unsharded": moe_kernel_bytes(tokens, 1, gen)["per_device"][0],
            }
            routing = moe_routing(tokens, n)
            row["routed_rows"] = {
                "group_rows": [sum(g) for g in routing["group_sizes"]],
                "rows_out": routing["rows_out"],
                "rows_in": routing["rows_in"],
            }
            if compile_:
                t0 = time.time()
                compiled = compile_moe(gen, coll, tokens)
                cols = hlo_collectives(compiled.as_text())
                row["collectives"] = moe_collective_volume(cols, tokens, n, s)
                row["memory"] = memory(compiled)
                log(f"moe {gen} {coll} T={tokens}: compiled in {time.time() - t0:.0f}s")
            rows.append(_totals(row))
    return rows


def attention_rows(compile_: bool, log=print) -> list[dict]:
    rows = []
    s = LLAMA3_8B
    for family, program, model, shape_txt, kernel_bytes, compile_fn in (
        (
            "flash_attention",
            "tensor_parallel_flash_attention + row-parallel o_proj",
            "llama3_8b_causal_8192",
            f"1 x {FLASH_SEQ} causal, {s['q_heads']} q / {s['kv_heads']} KV heads of "
            f"{s['head_dim']}, bf16",
            flash_kernel_bytes,
            compile_flash,
        ),
        (
            "paged_attention",
            "tensor_parallel_paged_attention + row-parallel o_proj",
            "llama3_8b_decode_b64_ctx8192",
            f"{PAGED_SEQS} x 1 token, {PAGED_CTX}-token contexts, pages of {PAGE_SIZE}, "
            f"{s['q_heads']} q / {s['kv_heads']} KV heads of {s['head_dim']}, bf16",
            paged_kernel_bytes,
            compile_paged,
        ),
    ):
        for gen in TP_GENERATIONS:
            n = num_devices(gen)
            row = {
                "family": family,
                "program": program,
                "model": model,
                "shape": shape_txt,
                "generation": gen,
                "topology": topology(gen),
                "devices": n,
                "axis": "tp",
                "collectives_path": "psum (o_proj)",
                "kernel_hbm_bytes": [kernel_bytes(n, gen)] * n,
                "kernel_hbm_bytes_unsharded": kernel_bytes(1, gen),
            }
            if compile_:
                t0 = time.time()
                compiled = compile_fn(gen)
                cols = hlo_collectives(compiled.as_text())
                for c in cols:
                    c["sent_bytes"], c["received_bytes"] = dense_volume(c, n)
                row["collectives"] = cols
                row["memory"] = memory(compiled)
                log(f"{family} {gen} tp={n}: compiled in {time.time() - t0:.0f}s")
            rows.append(_totals(row))
    return rows


README_LAYERS = {
    "ragged_dot": "Qwen3-30B-A3B experts, {tokens} tokens",
    "flash_attention": "Llama-3-8B attention, 8192 causal",
    "paged_attention": "Llama-3-8B paged decode, 64 x 8192",
}


def readme_table(section: dict) -> list[str]:
    """The table README.md's "More than one chip" quotes: one line per compiled row, every number
    rendered from results.json["sharded"] (tests/test_sharded_rows.py checks the README holds
    exactly these lines)."""
    from report import _fmt_bytes

    out = [
        "| layer | slice (devices), collectives | kernel HBM bytes per device (one device) "
        "| collective bytes sent per device | arguments / temporaries per device |",
        "|---|---|---|---|---|",
    ]
    for r in section["rows"]:
        if "collectives" not in r:
            continue
        mem = r["memory"] or {}
        out.append(
            f"| {README_LAYERS[r['family']].format(**r)} "
            f"| {r['topology']} ({r['devices']}), {r['collectives_path']} "
            f"| {_fmt_bytes(max(r['kernel_hbm_bytes']))} "
            f"({_fmt_bytes(r['kernel_hbm_bytes_unsharded'])}) "
            f"| {_fmt_bytes(max(r['collective_sent_bytes']))} "
            f"| {_fmt_bytes(mem.get('argument_bytes'))} / {_fmt_bytes(mem.get('temp_bytes'))} |"
        )
    return out


def write_readme_table(path: Path, table: list[str]) -> None:
    """Replace the table under "## More than one chip" whose header is table[0] (the lines from
    it to the first line not starting with "|") by `table`."""
    lines = path.read_text().split("\n")
    start = lines.index("## More than one chip")
    head = next(i for i in range(start, len(lines)) if lines[i] == table[0])
    end = next(i for i in range(head, len(lines)) if not lines[i].startswith("|"))
    path.write_text("\n".join(lines[:head] + table + lines[end:]))


def row_key(row) -> tuple:
    return (
        row["family"],
        row["model"],
        row.get("tokens"),
        row["generation"],
        row["collectives_path"],
    )


def compute(compile_: bool = True, log=print) -> dict:
    import jax

    return {
        "jax": jax.__version__,
        "ici_time": (
            "../shared/reference/tpu-hardware.md, the hardware reference these figures cite, "
            "lists no ICI bandwidth, so no collective's bytes are turned into a time (not even "
            "as a bound)."
        ),
        "rows": moe_rows(compile_, log) + attention_rows(compile_, log),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="print the closed forms and routing (rows without collectives or memory); "
        "writes nothing",
    )
    parser.add_argument(
        "--keep-compiled",
        action="store_true",
        help="recompute the closed forms and the routing only, keep each stored row's compiled "
        "collectives and memory (after a tiling change that leaves the programs' collectives "
        "as they are; seconds instead of 12 compiles)",
    )
    parser.add_argument(
        "--readme",
        action="store_true",
        help='also rewrite the table in README.md\'s "More than one chip" from the new rows '
        "(its prose figures are checked by tests/test_sharded_rows.py, not rewritten)",
    )
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    section = compute(not (args.no_compile or args.keep_compiled), log)
    if args.no_compile:
        print(json.dumps(section, indent=1))
        return 0
    import report

    # Read just before writing: other keys (named, small, bucket_padding, meta) stay as they are.
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    if args.keep_compiled:
        old = {row_key(r): r for r in (results.get("sharded") or {}).get("rows", [])}
        for r in section["rows"]:
            stored = old.get(row_key(r))
            if stored is None or "collectives" not in stored:
                raise SystemExit(f"--keep-compiled: no compiled row stored for {row_key(r)}")
            r["collectives"], r["memory"] = stored["collectives"], stored["memory"]
            _totals(r)
    results["sharded"] = section
    args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (args.results.parent / "results.md").write_text(report.markdown(results))
    log(f"wrote {args.results} ['sharded'] and {args.results.parent / 'results.md'}")
    log("README.md's table (More than one chip):\n" + "\n".join(readme_table(section)))
    if args.readme:
        write_readme_table(ROOT / "README.md", readme_table(section))
        log("rewrote the table in README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
