"""The static work list every kernel family scalar-prefetches into SMEM, written once.

A kernel of this collection walks a host-built list of work items instead of a dense grid: the
grid's last dimension is the item index, the BlockSpec index maps and the kernel body read the
item's fields from SMEM, and an item the schedule does not need is never listed (no step, no DMA).
This module fixes what every family's list has in common:

Record layout. A family declares its records once as a `RecordLayout`: a name per int32 field
(`LAYOUT.fields`, e.g. ragged_dot's OUT, TILE, GROUP, ..., FLAGS), in the order they are stored.
Nothing reads a field by a bare number; host code decodes a list into {name: column} with
`LAYOUT.decode`, kernel code reads one field of one item with `LAYOUT.read`.

Flags. A family whose records carry a FLAGS field uses the bits below, one layout for all:
COMPUTE (the item does its MXU work), FIRST / LAST (first / last item of its output block: the
accumulator is initialised / the output written), VALID (a listed item; padding records after the
live items have FLAGS == 0, so `FLAGS != 0` counts the live items). A family without a FLAGS field
(paged_attention marks empty items by their fields) simply has no flags.

SMEM layout. A list of L items is field-major: field f of item i is element f * L + i of a flat
int32 array ([n_fields, L] row-major, raveled). Several lists held together (flash attention's one
list per batch row) are concatenated whole: list b starts at b * n_fields * L. One rule for every
family, so `LAYOUT.read(ref, name, i, L, list_index=b)` is the only address computation a kernel
needs, and `LAYOUT.nbytes(L, n_lists)` what the lists take of SMEM.

Builder contract. A family's list builder is one function of (sizes, static tiling) with a keyword
`xp`: with `xp=np` it runs on the host for the cost model and the tests (concrete inputs, and the
list exactly as long as its live items unless a length is given); with `xp=jnp` it runs in the
traced program (the lengths are traced values, so the list has a static length bound and a padding
tail). The same code serves both: no host-side twin to keep equal by hand. Columns go through
`LAYOUT.stack` / `LAYOUT.flat`, which fix the storage order. Builders search and take running
maxima with `searchsorted` / `cummax` below, never `xp.searchsorted` / `xp.maximum.accumulate`:
in a traced program those are XLA while loops, one iteration per bisection step or per element,
each a few microseconds on a TPU. On a TPU v5e chip the ragged-dot list's three loops cost ~240 us
per call, a fifth of a 64-token decode gmm (benchmarks/results/device/v5e_decode_probe.json).

Vendored into every Hub package at build time: no imports from the collection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

# Flag bits of a record's FLAGS field (every family that has one).
COMPUTE = 1  # the item does its MXU work (not a dummy / empty / zero-rows item)
FIRST = 2  # first item of its output block: initialise the accumulator
LAST = 4  # last item of its output block: write the output
VALID = 8  # a listed item, not padding (padding records have FLAGS == 0)
FLAGS = {"COMPUTE": COMPUTE, "FIRST": FIRST, "LAST": LAST, "VALID": VALID}
FLAGS_FIELD = "FLAGS"

__all__ = [
    "COMPUTE",
    "FIRST",
    "LAST",
    "VALID",
    "FLAGS",
    "FLAGS_FIELD",
    "RecordLayout",
    "decode_flags",
    "searchsorted",
    "cummax",
]

# A traced `searchsorted` compares every query with every sorted value in one fused op up to
# this many comparisons (a few microseconds of vector work); past it, a bisection unrolled into
# log2(n) gather steps. Neither is an XLA while loop.
COMPARE_ALL_LIMIT = 1 << 22


def searchsorted(sorted_values, queries, *, side: str, xp: Any = np):
    """`np.searchsorted(sorted_values, queries, side=side)` on host arrays, and its loop-free
    equivalent on traced ones (jax.numpy's default method is a while loop)."""
    if xp is np:
        return np.searchsorted(sorted_values, queries, side=side)
    size = int(np.prod(np.shape(sorted_values))) * int(np.prod(np.shape(queries)))
    method = "compare_all" if size <= COMPARE_ALL_LIMIT else "scan_unrolled"
    return xp.searchsorted(sorted_values, queries, side=side, method=method)


def cummax(a, xp: Any = np):
    """Running maximum along the first axis: `np.maximum.accumulate` on host arrays,
    `jax.lax.cummax` (one reduce-window op) on traced ones (`jnp.maximum.accumulate` is a while
    loop over the elements)."""
    if xp is np:
        return np.maximum.accumulate(a) if a.size else a
    import jax

    return jax.lax.cummax(a, axis=0)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The named int32 fields of one family's work-list records, in storage order."""

    family: str
    fields: tuple[str, ...]

    def __post_init__(self):
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"{self.family}: duplicate work-list field names {self.fields}")

    @property
    def n_fields(self) -> int:
        return len(self.fields)

    @property
    def has_flags(self) -> bool:
        return FLAGS_FIELD in self.fields

    def index(self, name: str) -> int:
        try:
            return self.fields.index(name)
        except ValueError:
            raise KeyError(
                f"{self.family} work list has no field {name!r}; fields: {self.fields}"
            ) from None

    # -- building (host numpy or traced jax.numpy alike) -------------------------------------------

    def _columns(self, columns) -> list:
        if isinstance(columns, Mapping):
            missing = set(self.fields) - set(columns)
            if missing or len(columns) != self.n_fields:
                raise ValueError(
                    f"{self.family}: work-list columns {sorted(columns)} != fields {self.fields}"
                )
            return [columns[name] for name in self.fields]
        columns = list(columns)
        if len(columns) != self.n_fields:
            raise ValueError(
                f"{self.family}: {len(columns)} work-list columns for "
                f"{self.n_fields} fields {self.fields}"
            )
        return columns

    def stack(self, columns, xp: Any = np):
        """[n_fields, L]: the columns (one [L] array per field, in field order or by name)."""
        return xp.stack(self._columns(columns))

    def flat(self, columns, xp: Any = np):
        """[n_fields * L] int32, field-major: the SMEM array of one list."""
        return xp.concatenate(self._columns(columns)).astype(xp.int32)

    # -- reading -----------------------------------------------------------------------------------

    def read(self, ref, name: str, item, n_items: int, list_index=None):
        """Field `name` of item `item` from the flat SMEM array `ref` holding lists of `n_items`
        records (list `list_index` of several lists held together)."""
        offset = self.index(name) * n_items
        if list_index is not None:
            offset = list_index * (self.n_fields * n_items) + offset
        return ref[offset + item]

    def nbytes(self, n_items: int, n_lists: int = 1) -> int:
        """SMEM bytes of `n_lists` lists of `n_items` records."""
        return n_lists * self.n_fields * n_items * 4

    def decode(self, lists) -> dict[str, np.ndarray]:
        """{field name: column} of a list as built ([n_fields, L], or flat [n_fields * L]), or of
        several lists ([n_lists, n_fields, L]: columns [n_lists, L])."""
        a = np.asarray(lists)
        if a.ndim == 1:
            if a.shape[0] % self.n_fields:
                raise ValueError(
                    f"{self.family}: flat list of {a.shape[0]} values is not {self.n_fields} fields"
                )
            a = a.reshape(self.n_fields, -1)
        if a.shape[-2] != self.n_fields:
            raise ValueError(
                f"{self.family}: list of shape {a.shape} has no field axis of {self.n_fields}"
            )
        return {name: a[..., i, :] for i, name in enumerate(self.fields)}


def decode_flags(flags) -> dict[str, np.ndarray]:
    """{flag name: bool array} of a FLAGS column; raises on bits no flag names."""
    f = np.asarray(flags)
    unknown = f & ~sum(FLAGS.values())
    if np.any(unknown):
        raise ValueError(
            f"FLAGS values {sorted(set(np.unique(f[unknown != 0]).tolist()))} "
            f"hold bits outside {FLAGS}"
        )
    return {name: (f & bit) != 0 for name, bit in FLAGS.items()}


def check_flagged_list(
    layout: RecordLayout, lists, n_live: int | None = None, out_field: str | None = None
) -> dict[str, np.ndarray]:
    """The shared invariants of a flagged list, for tests: only named bits; the live items (FLAGS
    != 0) come first and all carry VALID, padding after them has FLAGS == 0; COMPUTE only on
    VALID items; with `out_field`, FIRST and LAST each mark exactly one item per output block of
    the live items, which run contiguously. Returns the decoded columns."""
    cols = layout.decode(lists)
    flags = np.asarray(cols[FLAGS_FIELD]).reshape(-1, np.asarray(cols[FLAGS_FIELD]).shape[-1])
    for row, fl in enumerate(flags):
        named = decode_flags(fl)
        live = fl != 0
        n = int(live.sum())
        assert live[:n].all() and not live[n:].any(), f"row {row}: padding before a live item"
        assert (named["VALID"] == live).all(), f"row {row}: a live item without VALID"
        assert not (named["COMPUTE"] & ~named["VALID"]).any(), f"row {row}: COMPUTE on padding"
        if n_live is not None and flags.shape[0] == 1:
            assert n == n_live, f"{n} live items, expected {n_live}"
        if out_field is not None:
            out = np.asarray(cols[out_field]).reshape(flags.shape)[row][:n]
            runs = out[np.r_[True, out[1:] != out[:-1]]] if n else out
            assert len(set(runs.tolist())) == len(runs), f"row {row}: output blocks not contiguous"
            assert sorted(out[named["FIRST"][:n]].tolist()) == sorted(runs.tolist())
            assert sorted(out[named["LAST"][:n]].tolist()) == sorted(runs.tolist())
    return cols
