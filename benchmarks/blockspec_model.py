"""Closed-form traffic of a BlockSpec pipeline, from a kernel's grid and index maps.

The Pallas TPU pipeline (and the TPU interpreter that models it) copies an input block from HBM
when its block index differs from the previous grid step's, and writes an output block back when
its block index differs from the next step's (or at the last step). So an operand moves
(number of runs of equal consecutive block indices) x (block bytes). This module evaluates index
maps written with numpy over the whole grid at once (row-major order, last grid axis fastest, one
core), which is how the anchors' closed forms are computed at shapes too large to interpret.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Operand", "grid_points", "runs", "pipeline_bytes", "step_copies"]


@dataclasses.dataclass(frozen=True)
class Operand:
    name: str
    block_bytes: int
    # index_map(*grid_coordinate_arrays) -> tuple of integer arrays (block indices), numpy
    index_map: Callable[..., Sequence[np.ndarray]]
    is_output: bool = False


def grid_points(grid: Sequence[int]) -> list[np.ndarray]:
    """One flat array per grid axis, in the pipeline's iteration order."""
    mesh = np.meshgrid(*[np.arange(g, dtype=np.int64) for g in grid], indexing="ij")
    return [m.ravel() for m in mesh]


def _changed(indices: Sequence[np.ndarray], n: int) -> np.ndarray:
    """[n] bool: the step's block index tuple differs from the previous step's (step 0: True)."""
    changed = np.zeros(n, dtype=bool)
    if n:
        changed[0] = True
    for idx in indices:
        idx = np.broadcast_to(np.asarray(idx), (n,))
        changed[1:] |= idx[1:] != idx[:-1]
    return changed


def runs(indices: Sequence[np.ndarray], n: int) -> int:
    """Number of maximal runs of equal consecutive index tuples among n grid steps."""
    return int(_changed(indices, n).sum())


def step_copies(grid: Sequence[int], operands: Sequence[Operand]) -> tuple[np.ndarray, np.ndarray]:
    """Per grid step (pipeline order): the bytes copied in for the step (its input blocks whose
    index changed) and the bytes written back after it (its output blocks whose index changes
    at the next step, or the last step's). Their sums are `pipeline_bytes`' read and write."""
    pts = grid_points(grid)
    n = int(np.prod(grid)) if len(grid) else 1
    reads, writes = np.zeros(n), np.zeros(n)
    for op in operands:
        changed = _changed(op.index_map(*pts), n)
        if op.is_output:  # written when the next step's block differs (or after the last step)
            writes += np.r_[changed[1:], True] * float(op.block_bytes)
        else:
            reads += changed * float(op.block_bytes)
    return reads, writes


def pipeline_bytes(grid: Sequence[int], operands: Sequence[Operand]) -> dict:
    """{operand name: (copies, bytes)} plus totals 'read', 'write', 'steps'."""
    pts = grid_points(grid)
    n = int(np.prod(grid)) if len(grid) else 1
    out = {}
    read = write = 0
    for op in operands:
        copies = runs(op.index_map(*pts), n)
        nbytes = copies * op.block_bytes
        out[op.name] = (copies, nbytes)
        if op.is_output:
            write += nbytes
        else:
            read += nbytes
    out["read"] = read
    out["write"] = write
    out["steps"] = n
    return out
