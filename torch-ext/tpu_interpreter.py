"""Instruments Pallas' TPU interpret mode: race checks and an HBM traffic counter.

Pallas' TPU interpret mode (`pltpu.InterpretParams`) simulates HBM, VMEM, SMEM, DMAs and
semaphores on the CPU. jax has no public API for two things this collection needs from it, so this
module reaches into the interpreter's private implementation
(jax/_src/pallas/mosaic/interpret/interpret_pallas_call.py). It is the only file in the
collection that does. Tests, benchmarks and the torch ops' CPU path all use it.

- `races_found()`: whether the race detector flagged a data race since the last reset.
  `race_checked()` runs a block with fresh interpreter state and raises `RaceDetected` if the block
  raced. The torch ops' CPU path in TPU interpret mode calls `races_found()` through jax_bridge.
- `count_traffic()`: bytes crossing the HBM boundary (BlockSpec copies and manual DMAs), grid
  steps, kernel launches and scalar-prefetch bytes of every kernel run inside the block. The
  benchmark's small-shape section and the cost-model tests compare closed forms with it.
- `checking_params()` and `counting_params()`: the interpret parameters for checking (every check
  on) and for counting (fast, with the grid-step recorder).

Written for jax==0.10.2 (`JAX_VERSION`). Each feature checks the private names it uses the first
time it runs (`_require`). If jax moved them, `InterpreterAPIError` names what is missing and the
version this file was written for. Otherwise there would be an AttributeError deep inside an
interpreter callback, or a race check that quietly finds nothing.

Importing this module changes nothing in jax. The counter's wrappers are installed by the first
`count_traffic()` and count only while a counter is active.

Vendored into every Hub package (beside jax_bridge.py): imports nothing from the collection.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading

__all__ = [
    "JAX_VERSION",
    "InterpreterAPIError",
    "RaceDetected",
    "Traffic",
    "checking_params",
    "count_traffic",
    "counting_params",
    "race_checked",
    "races_found",
    "reset",
]

JAX_VERSION = "0.10.2"  # the jax release whose private interpreter API this file was written for
_PRIVATE_MODULE = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"


class InterpreterAPIError(RuntimeError):
    """jax's private TPU interpreter API is not what this module was written for."""


class RaceDetected(RuntimeError):
    """TPU interpret mode's race detector found a data race."""


# -------------------------------------------------------------------------------------------------
# The private API, checked once per feature
# -------------------------------------------------------------------------------------------------


def _params(module, name: str) -> list[str]:
    """Parameter names of module.name (through functools.wraps), [] if it is not a function."""
    fn = getattr(module, name, None)
    try:
        return list(inspect.signature(fn).parameters) if callable(fn) else []
    except (TypeError, ValueError):
        return []


def _dma_class_ok(m) -> bool:
    dma = getattr(m, "DMA", None)
    fields = set(getattr(dma, "__dataclass_fields__", ()))
    return (
        callable(getattr(dma, "execute_read", None))
        and hasattr(dma, "data_size")
        and {"state", "data", "src_memory_space", "dst_memory_space"} <= fields
    )


def _get_ok(m) -> bool:
    params = _params(m, "get")
    return (
        hasattr(getattr(m, "get", None), "__wrapped__")
        and "input_name" in params
        and "source_info" in params
    )


def _store_ok(m) -> bool:
    params = _params(m, "store")
    return (
        hasattr(getattr(m, "store", None), "__wrapped__")
        and params[6:7] == ["val"]
        and "output_name" in params
    )


# What each feature reads or replaces in the private module: (what, is it there as expected).
_REQUIREMENTS = {
    "race check": [
        (
            "races (the race detector's state, a RaceDetectionState with races_found)",
            lambda m: (
                hasattr(m, "races")
                and "races_found"
                in getattr(getattr(m, "RaceDetectionState", None), "__dataclass_fields__", ())
            ),
        ),
    ],
    "traffic counter": [
        (
            "TPU_MEMORY_SPACE_NAMES",
            lambda m: isinstance(getattr(m, "TPU_MEMORY_SPACE_NAMES", None), dict),
        ),
        ("DmaState.STARTED", lambda m: hasattr(getattr(m, "DmaState", None), "STARTED")),
        ("DMA (execute_read, state, data, data_size, src/dst_memory_space)", _dma_class_ok),
        ("get(..., source_info=, input_name=) wrapping get.__wrapped__", _get_ok),
        (
            "store(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, ..., "
            "output_name=) wrapping store.__wrapped__",
            _store_ok,
        ),
        (
            "interpret_pallas_call(..., grid_mapping=)",
            lambda m: "grid_mapping" in _params(m, "interpret_pallas_call"),
        ),
        (
            "_get_randomized_grid_coordinates(grid, mosaic_params, random_seed)",
            lambda m: (
                _params(m, "_get_randomized_grid_coordinates")
                == ["grid", "mosaic_params", "random_seed"]
            ),
        ),
    ],
}
_checked: dict[str, object] = {}


def _require(feature: str):
    """The private interpreter module, after checking that it has what `feature` uses."""
    if feature in _checked:
        return _checked[feature]
    import importlib

    import jax

    try:
        module = importlib.import_module(_PRIVATE_MODULE)
    except ImportError as e:
        problems = [f"module {_PRIVATE_MODULE}: {e}"]
    else:
        problems = [
            f"{_PRIVATE_MODULE}.{what}: missing or changed"
            for what, present in _REQUIREMENTS[feature]
            if not present(module)
        ]
    if problems:
        raise InterpreterAPIError(
            f"the TPU interpret mode {feature} (tpu_interpreter.py) was written for jax=="
            f"{JAX_VERSION}'s private interpreter API, and jax {jax.__version__} differs: "
            + "; ".join(problems)
            + f". Install jax=={JAX_VERSION}, or port tpu_interpreter.py to this jax."
        )
    _checked[feature] = module
    return module


# -------------------------------------------------------------------------------------------------
# Interpret parameters and the race check
# -------------------------------------------------------------------------------------------------


def checking_params(**overrides):
    """TPU interpret mode with every check on: race detection, NaN-filled uninitialised memory,
    raising out-of-bounds reads, and DMAs executed at their wait, as late as hardware may, so that
    a missing wait shows."""
    from jax.experimental.pallas import tpu as pltpu

    params = dict(
        detect_races=True,
        uninitialized_memory="nan",
        out_of_bounds_reads="raise",
        dma_execution_mode="on_wait",
    )
    params.update(overrides)
    return pltpu.InterpretParams(**params)


def counting_params(**overrides):
    """TPU interpret mode for counting with `count_traffic`: the grid-step recorder on, DMAs
    executed eagerly (the same count as "on_wait", and faster), race detection off unless asked
    for (counting is not checking)."""
    from jax.experimental.pallas import tpu as pltpu

    params = dict(
        detect_races=False,
        uninitialized_memory="nan",
        out_of_bounds_reads="raise",
        dma_execution_mode="eager",
        grid_point_recorder=_record_grid_point,
    )
    params.update(overrides)
    return pltpu.InterpretParams(**params)


def reset() -> None:
    """Fresh interpreter state: memory, semaphores and the race detector. The interpreter keeps
    its state after a kernel raised (for debugging), and every later kernel would see it."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()


def races_found() -> bool:
    """Whether the race detector flagged a race in the kernels run (with `detect_races=True`)
    since the last `reset()`. Raises InterpreterAPIError if jax moved the detector's state."""
    races = _require("race check").races
    return bool(races is not None and races.races_found)


@contextlib.contextmanager
def race_checked(what: str = "the kernel"):
    """Run the block with fresh interpreter state and raise `RaceDetected` if a kernel in it
    raced. The state is reset again on the way out, whether the block raised or not. Kernels
    must run with race detection on (`checking_params()`) and complete inside the block
    (`jax.block_until_ready`)."""
    reset()
    try:
        yield
        if races_found():
            raise RaceDetected(f"TPU interpret mode detected a data race in {what}")
    finally:
        reset()


# -------------------------------------------------------------------------------------------------
# The traffic counter
# -------------------------------------------------------------------------------------------------

_HBM_NAMES = ("hbm", "any")  # pl.ANY refs live in HBM in the interpreter


def _counts() -> collections.defaultdict:
    return collections.defaultdict(lambda: [0, 0])  # key -> [events, bytes]


@dataclasses.dataclass
class Traffic:
    """What the interpreter moved while a `count_traffic` block was active.

    Counted: every manual DMA (`pltpu.make_async_copy`, `pltpu.async_copy`), once per DMA, by
    source and destination memory space; the automatic BlockSpec copy of an input block from HBM
    at the start of a grid step (the interpreter copies a block only when its block index differs
    from the previous step's, as the Mosaic pipeline does); the write-back of an output block to
    HBM (when the next step's block index differs, or at the last step). Edge blocks count at
    their full block size: the interpreter pads arrays to whole blocks and copies whole blocks.

    Scalar-prefetch operands (work lists, page tables) are placed in SMEM without a copy: they are
    counted apart (`prefetch_bytes`, once per launch) and not in `hbm_bytes`. Not counted: the
    caller's final read of the outputs, and loads and stores inside the kernel body (VMEM/SMEM),
    which are only tallied by shape in `body_loads`.
    """

    blockspec_read_bytes: int = 0  # HBM -> VMEM/SMEM pipeline copies of input blocks
    blockspec_write_bytes: int = 0  # VMEM -> HBM write-backs of output blocks
    blockspec_reads: int = 0
    blockspec_writes: int = 0
    # (source space, destination space) -> [count, bytes] for manual DMAs
    dmas: dict = dataclasses.field(default_factory=lambda: _counts())
    grid_steps: int = 0  # only with the grid-step recorder (`counting_params`)
    calls: int = 0  # kernel launches (pallas_calls executed)
    prefetch_bytes: int = 0  # scalar-prefetch operands, summed over launches
    # operand name (as the interpreter names it) -> [copies, bytes] for BlockSpec copies
    by_operand: dict = dataclasses.field(default_factory=lambda: _counts())
    # shape of the loaded value -> count, for loads from refs in the kernel body
    body_loads: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def dma_count(self) -> int:
        return sum(c for c, _ in self.dmas.values())

    @property
    def dma_bytes(self) -> int:
        return sum(b for _, b in self.dmas.values())

    def _dma_hbm(self, read: bool) -> int:
        return sum(
            nbytes
            for (src, dst), (_, nbytes) in self.dmas.items()
            if (src if read else dst) in _HBM_NAMES
        )

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


_lock = threading.Lock()
_active: list[Traffic] = []  # the counters collecting now (nested blocks all count)


def _each_active(fn) -> None:
    with _lock:
        for t in _active:
            fn(t)


def _record_grid_point(token, grid_point, core_index):
    """InterpretParams.grid_point_recorder: one grid step executed (a public hook)."""
    del grid_point, core_index

    def add(t):
        t.grid_steps += 1

    _each_active(add)
    return token


# The wrappers around the interpreter's data movement, made by `_install` (once per process). They
# call the originals and count only while a counter is active.
_originals: dict[str, object] = {}


def _install():
    ipc = _require("traffic counter")
    if _originals:
        return ipc
    space_names = dict(ipc.TPU_MEMORY_SPACE_NAMES)
    orig_execute_read, orig_get, orig_store = ipc.DMA.execute_read, ipc.get, ipc.store
    orig_call, started_state = ipc.interpret_pallas_call, ipc.DmaState.STARTED

    def execute_read(self):
        # The interpreter may call execute_read more than once for one DMA (from both
        # semaphores' tasks); only the call that finds it STARTED moves data.
        started = self.state == started_state
        orig_execute_read(self)
        if started and _active:
            src = space_names.get(self.src_memory_space, str(self.src_memory_space))
            dst = space_names.get(self.dst_memory_space, str(self.dst_memory_space))
            nbytes = int(self.data_size) if self.data is not None else 0

            def add(t):
                entry = t.dmas[(src, dst)]
                entry[0] += 1
                entry[1] += nbytes

            _each_active(add)

    @functools.wraps(orig_get)
    def get(*args, **kwargs):
        result = orig_get(*args, **kwargs)
        if not _active:
            return result
        name = kwargs.get("input_name")
        value = result[1]
        if name is not None:  # a BlockSpec copy of an input block
            nbytes = int(value.nbytes)

            def add(t):
                t.blockspec_reads += 1
                t.blockspec_read_bytes += nbytes
                t.by_operand[name][0] += 1
                t.by_operand[name][1] += nbytes

            _each_active(add)
        elif "source_info" in kwargs:  # a load in the kernel body (load_p / get_p)
            shape = tuple(value.shape)

            def add(t):
                t.body_loads[shape] += 1

            _each_active(add)
        return result

    @functools.wraps(orig_store)
    def store(*args, **kwargs):
        result = orig_store(*args, **kwargs)
        name = kwargs.get("output_name")
        if name is not None and _active:  # the write-back of an output block
            val = kwargs["val"] if "val" in kwargs else args[6]
            nbytes = int(val.nbytes)

            def add(t):
                t.blockspec_writes += 1
                t.blockspec_write_bytes += nbytes
                t.by_operand[name][0] += 1
                t.by_operand[name][1] += nbytes

            _each_active(add)
        return result

    def count_launch(nbytes):
        def add(t):
            t.calls += 1
            t.prefetch_bytes += nbytes

        _each_active(add)

    @functools.wraps(orig_call)
    def interpret_pallas_call(*args, **kwargs):
        # Trace time: the scalar-prefetch operands' sizes are static; a callback counts each
        # launch when it runs.
        import numpy as np
        from jax.experimental import io_callback

        n = kwargs["grid_mapping"].num_index_operands
        nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in args[:n])
        io_callback(functools.partial(count_launch, nbytes), None, ordered=True)
        return orig_call(*args, **kwargs)

    # DMA.execute_read calls `get.__wrapped__` / `store.__wrapped__` (the functions without the
    # exception guard): keep those the originals' inner functions, so DMAs are counted once (by
    # execute_read), not again as loads.
    get.__wrapped__ = orig_get.__wrapped__
    store.__wrapped__ = orig_store.__wrapped__
    _originals.update(
        execute_read=orig_execute_read,
        get=orig_get,
        store=orig_store,
        interpret_pallas_call=orig_call,
        grid_coordinates=ipc._get_randomized_grid_coordinates,
    )
    ipc.DMA.execute_read = execute_read
    ipc.get = get
    ipc.store = store
    ipc.interpret_pallas_call = interpret_pallas_call
    return ipc


def _natural_grid_coordinates(grid, mosaic_params, random_seed):
    """The interpreter's per-dimension coordinate lists, with parallel dimensions in order."""
    import jax.numpy as jnp

    coords = _originals["grid_coordinates"](grid, mosaic_params, random_seed)
    return tuple(jnp.arange(c.shape[0], dtype=jnp.int32) if c.shape[0] else c for c in coords)


@contextlib.contextmanager
def count_traffic(params=None, clear_caches: bool = True, natural_order: bool = True):
    """Count HBM traffic, grid steps and launches of every Pallas TPU kernel run inside the block.

        with count_traffic() as t:
            jax.block_until_ready(f(x))   # any function that calls pallas_call
        t.hbm_bytes, t.grid_steps, t.dma_count

    Every `pallas_call` traced inside runs in TPU interpret mode with `params` (default
    `counting_params()`), whatever `interpret=` its code passes. Run the kernels to completion
    inside the block. JAX's caches are cleared on entry, so that every kernel is traced with the
    counting wrappers, and on exit, so that traces holding the forced parameters do not leak.
    `natural_order` walks "parallel" grid dimensions in order, as one TensorCore does, instead of
    the interpreter's random permutation (which exists to catch megacore assumptions): which
    consecutive steps share a block, and so the bytes copied, depends on the order.
    """
    import jax
    from jax.experimental.pallas import tpu as pltpu

    ipc = _install()
    traffic = Traffic()
    if clear_caches:
        jax.clear_caches()
    with _lock:
        _active.append(traffic)
    if natural_order:
        ipc._get_randomized_grid_coordinates = _natural_grid_coordinates
    try:
        with pltpu.force_tpu_interpret_mode(params or counting_params()):
            yield traffic
    except BaseException:
        reset()
        raise
    finally:
        ipc._get_randomized_grid_coordinates = _originals["grid_coordinates"]
        with _lock:
            _active.remove(traffic)
        if clear_caches:
            jax.clear_caches()
