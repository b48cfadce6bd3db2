"""Count what a Pallas TPU kernel moves between HBM and VMEM/SMEM, in TPU interpret mode.

jax 0.10.2 has no public statistics API for the TPU interpreter, so this module wraps the three
places where the interpreter (jax/_src/pallas/mosaic/interpret/interpret_pallas_call.py) moves data
across the HBM boundary:

- `DMA.execute_read`: every manual DMA (`pltpu.make_async_copy`, `pltpu.async_copy`); counted once
  per DMA, by source and destination memory space, with its byte size;
- `get(..., input_name=...)`: the automatic BlockSpec copy of an input block from HBM into its
  VMEM (or SMEM) buffer at the start of a grid step. The interpreter copies a block only when its
  block index differs from the previous step's, as the Mosaic pipeline does;
- `store(..., output_name=...)`: the automatic write-back of an output block to HBM, done when the
  next step's block index differs, or at the last step.

Grid steps come from the interpreter's own `grid_point_recorder` hook.

Grid order: the interpreter walks "parallel" grid dimensions in a random permutation (to catch
megacore assumptions). That changes which consecutive steps share a block, so by default the
counter makes it walk them in order, as one TensorCore does (`natural_order=True`).

Scalar-prefetch operands (work lists, page tables) are placed in SMEM by the interpreter without a
copy; they are counted separately (`prefetch_bytes`, once per kernel launch, `calls`) and not
included in `hbm_bytes`. Not counted: the final read of outputs by the caller, and loads/stores
inside the kernel body (VMEM/SMEM only).
Edge blocks are counted at their full block size: the interpreter pads every array to whole
blocks and copies whole blocks.

Usage:
    with count_traffic() as t:
        out = f(x)            # any function that calls pallas_call; TPU interpret mode is forced
        jax.block_until_ready(out)
    t.hbm_bytes, t.grid_steps, t.dma_count
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc

__all__ = ["Traffic", "count_traffic", "interpret_params"]

_SPACE_NAMES = dict(_ipc.TPU_MEMORY_SPACE_NAMES)
_HBM_NAMES = ("hbm", "any")  # pl.ANY refs live in HBM in the interpreter

_lock = threading.Lock()
_active: list["Traffic"] = []  # the counters currently collecting (nested contexts all count)


@dataclasses.dataclass
class Traffic:
    """Bytes and events seen by the interpreter while a `count_traffic` block was active."""

    blockspec_read_bytes: int = 0  # HBM -> VMEM/SMEM pipeline copies of input blocks
    blockspec_write_bytes: int = 0  # VMEM -> HBM write-backs of output blocks
    blockspec_reads: int = 0
    blockspec_writes: int = 0
    # (source space, destination space) -> [count, bytes] for manual DMAs
    dmas: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0]))
    grid_steps: int = 0
    calls: int = 0  # kernel launches (pallas_calls executed)
    prefetch_bytes: int = 0  # scalar-prefetch operands, summed over launches
    # operand name (as the interpreter names it) -> [copies, bytes] for BlockSpec copies
    by_operand: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0]))

    @property
    def dma_count(self) -> int:
        return sum(c for c, _ in self.dmas.values())

    @property
    def dma_bytes(self) -> int:
        return sum(b for _, b in self.dmas.values())

    def _dma_hbm(self, read: bool) -> int:
        total = 0
        for (src, dst), (_, nbytes) in self.dmas.items():
            if read and src in _HBM_NAMES:
                total += nbytes
            if not read and dst in _HBM_NAMES:
                total += nbytes
        return total

    @property
    def hbm_read_bytes(self) -> int:
        return self.blockspec_read_bytes + self._dma_hbm(read=True)

    @property
    def hbm_write_bytes(self) -> int:
        return self.blockspec_write_bytes + self._dma_hbm(read=False)

    @property
    def hbm_bytes(self) -> int:
        """Bytes crossing the HBM boundary: reads plus writes (an HBM->HBM DMA counts twice)."""
        return self.hbm_read_bytes + self.hbm_write_bytes

    def as_dict(self) -> dict:
        return {
            "hbm_bytes": self.hbm_bytes,
            "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes,
            "blockspec_read_bytes": self.blockspec_read_bytes,
            "blockspec_write_bytes": self.blockspec_write_bytes,
            "blockspec_reads": self.blockspec_reads,
            "blockspec_writes": self.blockspec_writes,
            "dma_count": self.dma_count,
            "dma_bytes": self.dma_bytes,
            "grid_steps": self.grid_steps,
            "calls": self.calls,
            "prefetch_bytes": self.prefetch_bytes,
        }

    # -- called by the wrappers below ------------------------------------------------------------
    def _add_dma(self, src: str, dst: str, nbytes: int) -> None:
        entry = self.dmas[(src, dst)]
        entry[0] += 1
        entry[1] += nbytes


def _each_active(fn):
    with _lock:
        for t in _active:
            fn(t)


# -------------------------------------------------------------------------------------------------
# The wrappers. They are installed once, at import, and count only while a counter is active, so
# a kernel traced earlier with the originals is simply not counted; `count_traffic` clears JAX's
# caches on entry so every kernel run inside it is traced (again) with the wrappers in place.
# -------------------------------------------------------------------------------------------------

_orig_execute_read = _ipc.DMA.execute_read
_orig_get = _ipc.get
_orig_interpret_pallas_call = _ipc.interpret_pallas_call
_orig_store = _ipc.store


def _execute_read(self):
    # The interpreter may call execute_read more than once for one DMA (from both semaphores'
    # tasks); only the call that actually reads moves data.
    started = self.state == _ipc.DmaState.STARTED
    _orig_execute_read(self)
    if started and _active:
        src = _SPACE_NAMES.get(self.src_memory_space, str(self.src_memory_space))
        dst = _SPACE_NAMES.get(self.dst_memory_space, str(self.dst_memory_space))
        nbytes = int(self.data_size) if self.data is not None else 0
        _each_active(lambda t: t._add_dma(src, dst, nbytes))


@functools.wraps(_orig_get)
def _get(*args, **kwargs):
    result = _orig_get(*args, **kwargs)
    if kwargs.get("input_name") is not None and _active:
        nbytes = int(result[1].nbytes)
        name = kwargs["input_name"]

        def add(t):
            t.blockspec_reads += 1
            t.blockspec_read_bytes += nbytes
            t.by_operand[name][0] += 1
            t.by_operand[name][1] += nbytes

        _each_active(add)
    return result


@functools.wraps(_orig_store)
def _store(*args, **kwargs):
    result = _orig_store(*args, **kwargs)
    if kwargs.get("output_name") is not None and _active:
        val = kwargs["val"] if "val" in kwargs else args[6]
        nbytes = int(val.nbytes)
        name = kwargs["output_name"]

        def add(t):
            t.blockspec_writes += 1
            t.blockspec_write_bytes += nbytes
            t.by_operand[name][0] += 1
            t.by_operand[name][1] += nbytes

        _each_active(add)
    return result


def _count_launch(nbytes):
    def add(t):
        t.calls += 1
        t.prefetch_bytes += nbytes

    _each_active(add)


def _interpret_pallas_call(*args, **kwargs):
    # Trace time: the scalar-prefetch operands' sizes are static; a callback counts each launch.
    from jax.experimental import io_callback

    n = kwargs["grid_mapping"].num_index_operands
    nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in args[:n])
    io_callback(functools.partial(_count_launch, nbytes), None, ordered=True)
    return _orig_interpret_pallas_call(*args, **kwargs)


# DMA.execute_read calls `get.__wrapped__` / `store.__wrapped__` (the functions without the
# exception guard): keep those pointing at the originals' inner functions so DMAs behave as before.
_get.__wrapped__ = _orig_get.__wrapped__
_store.__wrapped__ = _orig_store.__wrapped__


def _install():
    if getattr(_ipc, "_ptk_traffic_counter_installed", False):
        return
    _ipc.DMA.execute_read = _execute_read
    _ipc.get = _get
    _ipc.store = _store
    _ipc.interpret_pallas_call = _interpret_pallas_call
    _ipc._ptk_traffic_counter_installed = True


_install()


_orig_grid_coordinates = _ipc._get_randomized_grid_coordinates


def _natural_grid_coordinates(grid, mosaic_params, random_seed):
    """The interpreter's per-dimension coordinate lists, with parallel dimensions in order."""
    import jax.numpy as jnp

    coords = _orig_grid_coordinates(grid, mosaic_params, random_seed)
    return tuple(
        jnp.arange(c.shape[0], dtype=jnp.int32) if c.shape[0] else c for c in coords
    )


def _record_grid_point(token, grid_point, core_index):
    del grid_point, core_index

    def add(t):
        t.grid_steps += 1

    _each_active(add)
    return token


def interpret_params(**overrides):
    """TPU interpret mode parameters with the grid-step recorder. DMAs execute eagerly by default
    (the count is the same as with "on_wait", and eager is faster); race detection is off unless
    asked for: counting is not checking."""
    params = dict(
        detect_races=False,
        uninitialized_memory="nan",
        out_of_bounds_reads="raise",
        dma_execution_mode="eager",
        grid_point_recorder=_record_grid_point,
    )
    params.update(overrides)
    return pltpu.InterpretParams(**params)


@contextlib.contextmanager
def count_traffic(params=None, clear_caches: bool = True, natural_order: bool = True):
    """Count HBM traffic and grid steps of every Pallas TPU kernel run inside the block.

    All `pallas_call`s traced inside run in TPU interpret mode with `params` (default:
    `interpret_params()`), whatever `interpret=` their code passes. Run the kernel to completion
    (`jax.block_until_ready`) inside the block. `natural_order` walks "parallel" grid dimensions
    in order (one TensorCore) instead of the interpreter's random permutation."""
    traffic = Traffic()
    if clear_caches:
        jax.clear_caches()
    with _lock:
        _active.append(traffic)
    if natural_order:
        _ipc._get_randomized_grid_coordinates = _natural_grid_coordinates
    try:
        with pltpu.force_tpu_interpret_mode(params or interpret_params()):
            yield traffic
    except BaseException:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    finally:
        _ipc._get_randomized_grid_coordinates = _orig_grid_coordinates
        with _lock:
            _active.remove(traffic)
        if clear_caches:
            # Traces made inside hold the forced interpret parameters; do not leak them.
            jax.clear_caches()
