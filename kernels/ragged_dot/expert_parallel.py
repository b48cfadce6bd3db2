"""Expert-parallel MoE layer in JAX: the experts of a layer split over an `ep` mesh axis, tokens
dispatched to the device holding their expert, the grouped matmuls (kernel.gmm_gated / gmm) run
on that device's experts only, and the results combined back to the tokens' devices.

Layout under `jax.shard_map` over the `ep` axis of size D (tokens data-parallel over the same axis):
  x [T, H], top_k_ids [T, k], top_k_weights [T, k]: split along T (T / D tokens per device);
  w_gate_up [E, H, 2I] ([gate | up] concatenated along the last axis), w_down [E, I, H]: split
  along E, device d holds experts [d * E/D, (d + 1) * E/D).
The layer computes, per token t, sum_j weights[t, j] * down[e](act(gate[e](x_t)) * up[e](x_t)) with
e = ids[t, j], exactly what `moe_layer` computes on one device.

Local experts. The grouped matmul needs the rows of its experts contiguous and ordered by expert,
with one group size per local expert. Each path below builds such a row block: the device's rows
first (grouped by local expert), then rows that belong to no group; gmm leaves those zero and does
no MXU work for them (its virtual group), so a device computes only its E/D experts, and picks of
experts held elsewhere never enter any of its groups.

Dispatch / combine (`collectives`):
  "ragged_all_to_all": jax.lax.ragged_all_to_all sends each device exactly the rows for its
      experts and returns the results the same way (one row block each direction, sized by the
      routing). XLA:TPU and XLA:GPU have it; XLA:CPU does not ("HLO opcode ragged-all-to-all is not
      supported by XLA:CPU ThunkEmitter", jax 0.10.2). Default on TPU / GPU.
  "all_to_all": the same exchange, with the same offsets and sizes, on the dense
      jax.lax.all_to_all (each peer's slice padded to the worst case). Runs everywhere; on CPU it is
      what checks the ragged path's bookkeeping against the unsharded layer.
  "all_gather": all_gather of the tokens (and their routing) to every device, each device runs its
      experts on the rows routed to them, a psum_scatter (reduce-scatter) sums the partial outputs
      and hands each device its tokens. Runs everywhere; default on CPU.
The receive buffers are sized for the worst case (every pick routed to one device): no token is
ever dropped, and the result equals the unsharded layer.

Backward: the grouped matmuls carry a custom VJP (dlhs = gmm with the other weight layout,
dweights = tgmm, the gated activation's vjp on the recomputed pre-activation); the collectives and
the index bookkeeping are differentiated by JAX (ragged_all_to_all's transpose is a
ragged_all_to_all back, all_to_all's an all_to_all, all_gather's a reduce-scatter).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import kernel as _kernel
from .work_list import searchsorted

__all__ = [
    "moe_layer",
    "moe_reference",
    "expert_parallel_moe",
    "route_top_k",
    "COLLECTIVES",
    "default_collectives",
]

COLLECTIVES = ("ragged_all_to_all", "all_to_all", "all_gather")


def default_collectives(platform: Optional[str] = None) -> str:
    """ragged_all_to_all where XLA lowers it (TPU, GPU), all_gather + reduce-scatter elsewhere."""
    platform = platform or jax.default_backend()
    return "ragged_all_to_all" if platform in ("tpu", "gpu", "cuda", "rocm") else "all_gather"


def route_top_k(router_logits: jax.Array, top_k: int, normalize: bool = True):
    """Qwen3-MoE routing: softmax over experts in f32, top-k, optionally renormalised.
    Returns (ids int32 [T, k], weights f32 [T, k])."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


# -------------------------------------------------------------------------------------------------
# The experts of one device: gate_up gmm (activation fused) and down gmm, with a custom VJP
# -------------------------------------------------------------------------------------------------


def _rows_in_groups(group_sizes, m):
    return jnp.arange(m)[:, None] < jnp.sum(group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _experts(rows, w_gate_up, w_down, group_sizes, activation, interpret, generation):
    h = _kernel.gmm_gated(
        rows,
        w_gate_up,
        group_sizes,
        activation=activation,
        interpret=interpret,
        generation=generation,
    )
    return _kernel.gmm(h, w_down, group_sizes, interpret=interpret, generation=generation)


def _experts_fwd(rows, w_gate_up, w_down, group_sizes, activation, interpret, generation):
    h = _kernel.gmm_gated(
        rows,
        w_gate_up,
        group_sizes,
        activation=activation,
        interpret=interpret,
        generation=generation,
    )
    y = _kernel.gmm(h, w_down, group_sizes, interpret=interpret, generation=generation)
    return y, (rows, w_gate_up, w_down, group_sizes, h)


def _experts_bwd(activation, interpret, generation, res, dy):
    rows, w_gate_up, w_down, group_sizes, h = res
    kw = dict(interpret=interpret, generation=generation)
    dy = dy.astype(rows.dtype)
    # y = h @ down[g]: dh = dy @ down[g]^T (the kernel reads the other layout), ddown = h^T dy.
    dh = _kernel.gmm(dy, w_down, group_sizes, transpose_rhs=True, out_dtype=jnp.float32, **kw)
    d_down = _kernel.tgmm(h, dy, group_sizes, out_dtype=w_down.dtype, **kw)
    # The forward never wrote the pre-activation: recompute it in f32 and take act's vjp there.
    pre = _kernel.gmm(rows, w_gate_up, group_sizes, out_dtype=jnp.float32, **kw)
    half = pre.shape[1] // 2
    _, act_vjp = jax.vjp(
        lambda g, u: _kernel.gated_activation(g, u, activation), pre[:, :half], pre[:, half:]
    )
    d_gate, d_up = act_vjp(dh)
    d_pre = jnp.concatenate([d_gate, d_up], axis=1)
    # Rows outside every group had no pre-activation: nothing flows back from them.
    d_pre = jnp.where(_rows_in_groups(group_sizes, rows.shape[0]), d_pre, 0).astype(rows.dtype)
    d_rows = _kernel.gmm(d_pre, w_gate_up, group_sizes, transpose_rhs=True, **kw)
    d_gate_up = _kernel.tgmm(rows, d_pre, group_sizes, out_dtype=w_gate_up.dtype, **kw)
    return d_rows, d_gate_up, d_down, None


_experts.defvjp(_experts_fwd, _experts_bwd)


def _bincount(ids, length):
    return jnp.zeros((length,), jnp.int32).at[ids].add(1, mode="drop")


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


# -------------------------------------------------------------------------------------------------
# One device: the unsharded layer and its f32 reference
# -------------------------------------------------------------------------------------------------


def moe_layer(
    x,
    top_k_ids,
    top_k_weights,
    w_gate_up,
    w_down,
    *,
    activation: str = "silu",
    interpret=False,
    generation: Optional[str] = None,
):
    """The MoE experts block on one device: x [T, H], top_k_ids [T, k] (ids in [0, E)),
    top_k_weights [T, k], w_gate_up [E, H, 2I], w_down [E, I, H] -> [T, H] in x's dtype."""
    _check(x, top_k_ids, top_k_weights, w_gate_up, w_down, activation)
    return _moe_local(
        x, top_k_ids, top_k_weights, w_gate_up, w_down, activation, interpret, generation
    )


def _moe_local(x, ids, weights, w_gate_up, w_down, activation, interpret, generation):
    t, k = ids.shape
    num_experts = w_gate_up.shape[0]
    flat = ids.reshape(-1)
    perm = jnp.argsort(flat, stable=True)
    group_sizes = _bincount(flat, num_experts)
    y = _experts(x[perm // k], w_gate_up, w_down, group_sizes, activation, interpret, generation)
    y = y.astype(jnp.float32) * weights.reshape(-1)[perm].astype(jnp.float32)[:, None]
    out = jnp.zeros((t, x.shape[1]), jnp.float32).at[perm // k].add(y)
    return out.astype(x.dtype)


def moe_reference(x, top_k_ids, top_k_weights, w_gate_up, w_down, *, activation: str = "silu"):
    """f32 reference of `moe_layer` in plain jnp (every expert applied densely, then selected)."""
    xf = x.astype(jnp.float32)
    pre = jnp.einsum("th,ehn->etn", xf, w_gate_up.astype(jnp.float32))
    half = pre.shape[-1] // 2
    h = _kernel.gated_activation(pre[..., :half], pre[..., half:], activation)
    y = jnp.einsum("eti,eih->eth", h, w_down.astype(jnp.float32))  # [E, T, H]
    onehot = jax.nn.one_hot(top_k_ids, w_gate_up.shape[0], dtype=jnp.float32)  # [T, k, E]
    mix = jnp.einsum("tke,tk->et", onehot, top_k_weights.astype(jnp.float32))
    return jnp.einsum("et,eth->th", mix, y)


# -------------------------------------------------------------------------------------------------
# Sharded bodies (run under shard_map, one call per device)
# -------------------------------------------------------------------------------------------------


def _body_all_gather(
    x, ids, weights, w_gate_up, w_down, *, axis, activation, interpret, generation
):
    me = jax.lax.axis_index(axis)
    local_experts = w_gate_up.shape[0]
    x_all = jax.lax.all_gather(x, axis, tiled=True)  # [T, H]
    ids_all = jax.lax.all_gather(ids, axis, tiled=True)  # [T, k]
    w_all = jax.lax.all_gather(weights, axis, tiled=True)
    t, k = ids_all.shape
    n = t * k
    flat = ids_all.reshape(-1)
    perm = jnp.argsort(flat, stable=True)
    num_experts = local_experts * jax.lax.axis_size(axis)
    counts = _bincount(flat, num_experts)
    first = me * local_experts
    offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, counts, 0))
    group_sizes = jax.lax.dynamic_slice(counts, (first,), (local_experts,))
    # Row r of the block = sorted pick offset + r: this device's picks first, by local expert;
    # rows past them (clamped indices) join no group and come out zero.
    r = jnp.arange(n)
    pick = perm[jnp.minimum(offset + r, n - 1)]
    valid = r < jnp.sum(group_sizes)
    y = _experts(
        x_all[pick // k], w_gate_up, w_down, group_sizes, activation, interpret, generation
    )
    scale = jnp.where(valid, w_all.reshape(-1)[pick].astype(jnp.float32), 0.0)
    partial = (
        jnp.zeros((t, x.shape[1]), jnp.float32)
        .at[pick // k]
        .add(y.astype(jnp.float32) * scale[:, None])
    )
    return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True).astype(x.dtype)


def _dense_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis
):
    """jax.lax.ragged_all_to_all's semantics (one slice per peer) on the dense all_to_all: each
    peer's slice is padded to operand's row count. For backends without the ragged op."""
    cap = operand.shape[0]
    r = jnp.arange(cap)
    src = input_offsets[:, None] + r[None, :]  # [D, cap]
    send = jnp.where(
        (r[None, :] < send_sizes[:, None])[..., None], operand[jnp.minimum(src, cap - 1)], 0
    )
    got = jax.lax.all_to_all(send, axis, 0, 0, tiled=False)  # got[s] = slice s sent to me
    where_to = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # their offsets for me
    dst = where_to[:, None] + r[None, :]
    dst = jnp.where(r[None, :] < recv_sizes[:, None], dst, output.shape[0])  # out of range: drop
    return output.at[dst.reshape(-1)].set(got.reshape(-1, operand.shape[1]), mode="drop")


def _body_all_to_all(
    x, ids, weights, w_gate_up, w_down, *, axis, activation, interpret, generation, ragged
):
    exchange = (
        functools.partial(jax.lax.ragged_all_to_all, axis_name=axis)
        if ragged
        else functools.partial(_dense_ragged_all_to_all, axis=axis)
    )
    me = jax.lax.axis_index(axis)
    devices = jax.lax.axis_size(axis)
    local_experts = w_gate_up.shape[0]
    t, k = ids.shape
    n = t * k
    flat = ids.reshape(-1)
    perm = jnp.argsort(flat, stable=True)  # my picks by expert, hence by destination device
    counts = jax.lax.all_gather(_bincount(flat, local_experts * devices), axis)  # [src, E]
    counts = counts.reshape(devices, devices, local_experts)  # [src, dst, local expert]
    per_pair = jnp.sum(counts, axis=-1)  # rows src sends to dst
    send_sizes = per_pair[me]
    input_offsets = _exclusive_cumsum(send_sizes)
    recv_sizes = per_pair[:, me]
    recv_offsets = _exclusive_cumsum(recv_sizes)
    # Receivers stack the slices by source: mine lands after those of lower-numbered sources.
    output_offsets = _exclusive_cumsum(per_pair, axis=0)[me]
    cap = n * devices  # worst case: every pick of every device routed here
    got = exchange(
        x[perm // k],
        jnp.zeros((cap, x.shape[1]), x.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
    )
    # Received rows come per source, each sorted by local expert: find each row's expert and
    # regroup by expert (rows past the received total get the no-group id local_experts).
    row = jnp.arange(cap)
    src = jnp.clip(searchsorted(jnp.cumsum(recv_sizes), row, side="right", xp=jnp), 0, devices - 1)
    pos = row - recv_offsets[src]
    mine = counts[:, me, :]  # [src, local expert]
    ends = jnp.cumsum(mine, axis=-1)[src]  # [cap, local experts]
    expert = jnp.sum(pos[:, None] >= ends, axis=-1)
    expert = jnp.where(row < jnp.sum(recv_sizes), expert, local_experts)
    order = jnp.argsort(expert, stable=True)
    group_sizes = jnp.sum(mine, axis=0)
    y_sorted = _experts(
        got[order], w_gate_up, w_down, group_sizes, activation, interpret, generation
    )
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    # Back the same way: my received slice from s returns to where s read it from.
    back_offsets = _exclusive_cumsum(per_pair, axis=1)[:, me]
    back = exchange(
        y, jnp.zeros((n, x.shape[1]), y.dtype), recv_offsets, recv_sizes, back_offsets, send_sizes
    )
    scale = weights.reshape(-1)[perm].astype(jnp.float32)
    out = (
        jnp.zeros((t, x.shape[1]), jnp.float32)
        .at[perm // k]
        .add(back.astype(jnp.float32) * scale[:, None])
    )
    return out.astype(x.dtype)


# -------------------------------------------------------------------------------------------------
# Public entry point
# -------------------------------------------------------------------------------------------------


def _check(x, ids, weights, w_gate_up, w_down, activation):
    if x.ndim != 2:
        raise ValueError(f"x: expected [tokens, hidden], got shape {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"top_k_ids / top_k_weights: expected matching [{x.shape[0]}, top_k] "
            f"shapes, got {ids.shape} and {weights.shape}"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"top_k_ids: expected an integer dtype, got {ids.dtype}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != x.shape[1] or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up: expected [E, {x.shape[1]}, 2I], got {w_gate_up.shape}")
    e, _, two_i = w_gate_up.shape
    if w_down.shape != (e, two_i // 2, x.shape[1]):
        raise ValueError(f"w_down: expected {(e, two_i // 2, x.shape[1])}, got {w_down.shape}")
    if activation not in _kernel.ACTIVATIONS or activation == "gpt_oss_swiglu":
        raise ValueError(f"activation: expected one of silu, gelu, gelu_tanh, got {activation!r}")


def expert_parallel_moe(
    x,
    top_k_ids,
    top_k_weights,
    w_gate_up,
    w_down,
    *,
    mesh: Mesh,
    axis: str = "ep",
    collectives: Optional[str] = None,
    activation: str = "silu",
    interpret=False,
    generation: Optional[str] = None,
):
    """`moe_layer` with the experts split over mesh axis `axis` (module docstring): x, ids and
    weights are split along tokens, w_gate_up / w_down along experts; returns [T, H] split along
    tokens. `collectives`: one of COLLECTIVES (default: default_collectives() of the mesh's
    devices). Raises ValueError before tracing anything when the axis does not divide the experts
    or the tokens. Other mesh axes replicate everything."""
    _check(x, top_k_ids, top_k_weights, w_gate_up, w_down, activation)
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {mesh.axis_names}")
    devices = mesh.shape[axis]
    num_experts, tokens = w_gate_up.shape[0], x.shape[0]
    if num_experts % devices:
        raise ValueError(
            f"mesh axis {axis!r} of size {devices} does not divide the "
            f"{num_experts} experts (w_gate_up.shape[0])"
        )
    if tokens % devices:
        raise ValueError(
            f"mesh axis {axis!r} of size {devices} does not divide the {tokens} "
            f"tokens (x.shape[0]); pad the batch"
        )
    platform = mesh.devices.flat[0].platform
    collectives = collectives or default_collectives(platform)
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives: expected one of {COLLECTIVES}, got {collectives!r}")
    if collectives == "ragged_all_to_all" and platform == "cpu":
        raise ValueError(
            "collectives: XLA:CPU has no ragged_all_to_all; use 'all_to_all' or 'all_gather' on CPU"
        )
    kw = dict(axis=axis, activation=activation, interpret=interpret, generation=generation)
    if collectives == "all_gather":
        body = functools.partial(_body_all_gather, **kw)
    else:
        body = functools.partial(_body_all_to_all, ragged=collectives == "ragged_all_to_all", **kw)
    tok, exp = P(axis), P(axis)
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(tok, tok, tok, exp, exp), out_specs=tok, check_vma=False
    )
    return sharded(x, top_k_ids.astype(jnp.int32), top_k_weights, w_gate_up, w_down)
