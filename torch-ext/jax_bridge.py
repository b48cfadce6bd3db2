"""The torch <-> JAX bridge shared by every kernel in this collection.

A kernel's `ops.py` writes its op body as an ordinary JAX function whose parameters carry type
annotations (`jax.Array` for tensors, `int`/`float`/`bool`/`str` for static configuration) and
hands it to `jax_op`. The result is one torch custom op, named in the package's own namespace, that
runs:

- on TPU tensors, through torch_tpu's `torch.tpu.pallas.jax_op` (when torch_tpu is importable);
- on CPU tensors, the very same JAX function under `jax.jit`, with Pallas in interpret mode and
  tensors crossing by dlpack with no copy either way;
- on meta / fake tensors, a shape function derived from `jax.eval_shape` of the same function.

Interpret mode on CPU is chosen by the environment variable `PALLAS_TPU_INTERPRET`:
  unset / "plain"  Pallas' plain interpret mode (fast, exact results);
  "tpu"            TPU interpret mode: HBM/VMEM/SMEM, DMAs and semaphores simulated, with race
                   detection (a race raises `RuntimeError`), NaN-filled uninitialised memory and
                   raising out-of-bounds reads. Slow: meant for small shapes.
Kernel code reads the mode chosen for the current call with `pallas_interpret()` at trace time.

This file is vendored into every Hub package at build time, so it imports nothing from the
collection and nothing by absolute package name.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = [
    "INTERPRET_ENV",
    "jax_op",
    "pallas_interpret",
    "interpret_mode_from_env",
    "tpu_interpret_params",
    "use_interpret_mode",
    "to_jax",
    "to_torch",
    "has_torch_tpu",
    "CompileStats",
    "count_compiles_only",
]

INTERPRET_ENV = "PALLAS_TPU_INTERPRET"
_INTERPRET_MODES = ("plain", "tpu")

# -------------------------------------------------------------------------------------------------
# Interpret mode
# -------------------------------------------------------------------------------------------------

# What `pl.pallas_call(interpret=...)` should receive for the call being traced. `False` (compile
# with Mosaic) unless the CPU path of an op, or a test, sets it.
_CURRENT_INTERPRET: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "pallas_tpu_interpret", default=False
)


def tpu_interpret_params(**overrides):
    """TPU interpret mode with every check this collection relies on switched on (races,
    NaN-filled memory, raising out-of-bounds reads, DMAs at their wait): tpu_interpreter's."""
    return _interpreter().checking_params(**overrides)


def interpret_mode_from_env() -> str:
    mode = os.environ.get(INTERPRET_ENV, "plain").strip().lower() or "plain"
    if mode not in _INTERPRET_MODES:
        raise ValueError(
            f"environment variable {INTERPRET_ENV}={mode!r}: expected one of {_INTERPRET_MODES}"
        )
    return mode


def _interpret_value(mode: str):
    return True if mode == "plain" else tpu_interpret_params()


def pallas_interpret():
    """The `interpret=` argument for `pl.pallas_call` in the op currently being traced."""
    return _CURRENT_INTERPRET.get()


@contextlib.contextmanager
def use_interpret_mode(interpret):
    """Trace kernels inside this block with `interpret` (False, True or InterpretParams)."""
    token = _CURRENT_INTERPRET.set(interpret)
    try:
        yield
    finally:
        _CURRENT_INTERPRET.reset(token)


def _interpreter():
    # tpu_interpreter.py is vendored beside this file: a sibling module in a Hub package, a
    # top-level one when torch-ext/ is on sys.path (the tests). It raises a clear error if jax
    # moved the interpreter internals it uses, rather than reporting no race.
    if __package__:
        from . import tpu_interpreter
    else:
        import tpu_interpreter
    return tpu_interpreter


def _races_found() -> bool:
    return _interpreter().races_found()


# -------------------------------------------------------------------------------------------------
# Tensors across the boundary
# -------------------------------------------------------------------------------------------------

_TORCH_TO_JAX_DTYPE = {
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int32: jnp.int32,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
_JAX_TO_TORCH_DTYPE = {np.dtype(v): k for k, v in _TORCH_TO_JAX_DTYPE.items()}
# dlpack has no float8 codes in every version; these cross as raw bytes and are reinterpreted.
_BYTE_VIEW_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


def jax_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_JAX_DTYPE[dtype]
    except KeyError:
        raise TypeError(
            f"torch dtype {dtype} has no JAX counterpart here (JAX runs with 32-bit indices: "
            f"pass int32, not int64); supported: {sorted(str(d) for d in _TORCH_TO_JAX_DTYPE)}"
        ) from None


def torch_dtype(dtype) -> torch.dtype:
    return _JAX_TO_TORCH_DTYPE[np.dtype(dtype)]


def to_jax(t: torch.Tensor) -> jax.Array:
    """A CPU torch tensor as a JAX array sharing its memory (contiguous copy first if needed)."""
    target = jax_dtype(t.dtype)
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype in _BYTE_VIEW_DTYPES:
        return jax.lax.bitcast_convert_type(jnp.from_dlpack(t.view(torch.uint8)), target)
    return jnp.from_dlpack(t)


def to_torch(a: jax.Array) -> torch.Tensor:
    """A JAX CPU array as a torch tensor sharing its memory."""
    dtype = torch_dtype(a.dtype)
    if dtype in _BYTE_VIEW_DTYPES:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(a, jnp.uint8)).view(dtype)
    return torch.from_dlpack(a)


# -------------------------------------------------------------------------------------------------
# Op signatures: JAX annotations -> a torch schema
# -------------------------------------------------------------------------------------------------


def _strip_optional(annotation):
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


_BASE_SCHEMA = {
    jax.Array: "Tensor",
    torch.Tensor: "Tensor",
    int: "int",
    float: "float",
    bool: "bool",
    str: "str",
}


def _param_schema(name: str, annotation) -> str:
    base, optional = _strip_optional(annotation)
    if base in _BASE_SCHEMA:
        text = _BASE_SCHEMA[base]
    elif typing.get_origin(base) in (list, tuple, Sequence) and typing.get_args(base)[:1] == (int,):
        text = "int[]"
    else:
        raise TypeError(f"jax_op parameter {name!r}: unsupported annotation {annotation!r}")
    return text + ("?" if optional else "")


def _return_schema(annotation) -> tuple[str, int | None]:
    """Schema text, and the number of outputs (None for a single tensor)."""
    if annotation in (jax.Array, torch.Tensor):
        return "Tensor", None
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if args and all(a in (jax.Array, torch.Tensor) for a in args):
            return "(" + ", ".join("Tensor" for _ in args) + ")", len(args)
    raise TypeError(
        f"jax_op return annotation {annotation!r}: expected jax.Array or a tuple of them"
    )


def _is_tensor_param(annotation) -> bool:
    return _strip_optional(annotation)[0] in (jax.Array, torch.Tensor)


# -------------------------------------------------------------------------------------------------
# The op itself
# -------------------------------------------------------------------------------------------------


class CompileStats:
    """What one op compiled on the CPU path (each op carries one as `op.compile_stats`).

    `keys`: the distinct (interpret mode, tensor shapes and dtypes, static values) the op was
    called with: the bridge's cache key, the same one torch_tpu's `jax_op` caches on, so
    `len(keys)` is the number of compilations the op needs. `traces`: how many times JAX traced the
    op's function (once per compilation). `jax_cache_size()`: executables in JAX's own jit cache.
    """

    def __init__(self):
        self.keys: set = set()
        self.traces = 0
        self.jitted: dict = {}  # interpret mode -> the op's jax.jit function

    def reset(self) -> None:
        """Forget the counts (JAX's cache keeps its executables)."""
        self.keys.clear()
        self.traces = 0

    def jax_cache_size(self) -> int:
        return sum(f._cache_size() for f in self.jitted.values())


# Inside `count_compiles_only()`, CPU calls of our ops record their compile key and return zeros
# of the output shapes without tracing or running anything: how tests count the compilations of a
# long trace of calls whose kernels would be slow to interpret. Process-wide (not a context
# variable): Transformers' continuous batching calls the ops from its own thread.
_COUNT_ONLY_DEPTH = [0]


@contextlib.contextmanager
def count_compiles_only():
    """Ops called on CPU inside this block (from any thread) only record their compile key
    (`op.compile_stats`) and return zeros: nothing is traced, compiled or run."""
    _COUNT_ONLY_DEPTH[0] += 1
    try:
        yield
    finally:
        _COUNT_ONLY_DEPTH[0] -= 1


def _key_part(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, list):
        return tuple(value)
    return value


def has_torch_tpu() -> bool:
    """torch_tpu is importable and exposes `torch.tpu.pallas.jax_op`."""
    try:
        import torch_tpu  # noqa: F401
    except Exception:  # ImportError, or a broken install without libtpu
        return False
    return hasattr(getattr(torch, "tpu", None), "pallas")


def jax_op(qualname: str, fn: Callable[..., Any] | None = None, *, fake: Callable | None = None):
    """Register the annotated JAX function `fn` as the torch custom op `qualname` ("ns::name").

    Tensors (parameters annotated `jax.Array`, optionally `Optional[...]`) must be positional or
    keyword; every other parameter is static configuration, part of the jit cache key. The op never
    mutates its inputs. Use as `op = jax_op("ns::name", fn)` or as a decorator.

    `fake`, a torch function with the op's signature returning empty tensors of the output shapes,
    is needed for symbolic shapes (`torch.compile(dynamic=True)`, `opcheck`); without it the fake
    implementation derives shapes from `jax.eval_shape(fn)`, which needs concrete shapes.
    """
    if fn is None:
        return functools.partial(jax_op, qualname, fake=fake)
    if qualname.count("::") != 1:
        raise ValueError(f"op name {qualname!r} must be 'namespace::name'")
    # The namespace is derived from the package's content hash: an op already registered under
    # this exact name comes from an identical copy of this package (the same build loaded from two
    # paths), so it is the same op.
    from torch._library.custom_ops import OPDEFS

    if qualname in OPDEFS:
        return OPDEFS[qualname]

    signature = inspect.signature(fn, eval_str=True)
    params = list(signature.parameters.values())
    ret_schema, n_out = _return_schema(signature.return_annotation)
    schema = (
        "("
        + ", ".join(
            f"{_param_schema(p.name, p.annotation)} {p.name}"
            + ("" if p.default is inspect.Parameter.empty else f"={_schema_default(p.default)}")
            for p in params
        )
        + f") -> {ret_schema}"
    )
    tensor_names = [p.name for p in params if _is_tensor_param(p.annotation)]
    static_names = tuple(p.name for p in params if not _is_tensor_param(p.annotation))

    # One jitted function per interpret value: the value is read at trace time, so it must be part
    # of the cache key.
    @functools.cache
    def jitted(interpret_key: str):
        interpret = _interpret_value(interpret_key)

        def traced(*args, **kwargs):
            stats.traces += 1  # runs once per trace, i.e. once per compilation
            with use_interpret_mode(interpret):
                return fn(*args, **kwargs)

        stats.jitted[interpret_key] = jax.jit(traced, static_argnames=static_names)
        return stats.jitted[interpret_key]

    stats = CompileStats()

    def bind(args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def cpu_impl(*args, **kwargs):
        arguments = bind(args, kwargs)
        mode = interpret_mode_from_env()
        stats.keys.add((mode,) + tuple((n, _key_part(v)) for n, v in arguments.items()))
        if _COUNT_ONLY_DEPTH[0]:
            outs = fake_impl(*args, **kwargs)
            return tuple(o.zero_() for o in outs) if n_out is not None else outs.zero_()
        jax_args = {
            name: (to_jax(value) if name in tensor_names and value is not None else value)
            for name, value in arguments.items()
        }
        if mode == "tpu":
            from jax.experimental.pallas import tpu as pltpu

            # Fresh simulator state: a race or exception of an earlier call must not leak in.
            pltpu.reset_tpu_interpret_mode_state()
        try:
            out = jitted(mode)(**jax_args)
            jax.block_until_ready(out)
        except Exception:
            if mode == "tpu":
                pltpu.reset_tpu_interpret_mode_state()
            raise
        if mode == "tpu" and _races_found():
            raise RuntimeError(f"{qualname}: TPU interpret mode detected a data race in the kernel")
        input_ptrs = {arguments[n].data_ptr() for n in tensor_names if arguments[n] is not None}
        outs = [to_torch(o) for o in (out if n_out is not None else (out,))]
        # A custom op may not return a view of its input: copy if JAX handed an input back.
        outs = [o.clone() if o.numel() and o.data_ptr() in input_ptrs else o for o in outs]
        return tuple(outs) if n_out is not None else outs[0]

    def fake_impl(*args, **kwargs):
        if fake is not None:
            return fake(*args, **kwargs)
        arguments = bind(args, kwargs)
        device = None
        avals = {}
        for name, value in arguments.items():
            if name in tensor_names and value is not None:
                if any(isinstance(d, torch.SymInt) for d in value.shape):
                    raise RuntimeError(
                        f"{qualname}: symbolic shapes are not supported; use "
                        "torch.compile(dynamic=False) or give jax_op a `fake`"
                    )
                device = device or value.device
                avals[name] = jax.ShapeDtypeStruct(tuple(value.shape), jax_dtype(value.dtype))
            else:
                avals[name] = value
        statics = {k: v for k, v in avals.items() if k in static_names}
        arrays = {k: v for k, v in avals.items() if k not in static_names}
        with use_interpret_mode(True):
            out = jax.eval_shape(functools.partial(fn, **statics), **arrays)
        outs = [
            torch.empty(o.shape, dtype=torch_dtype(o.dtype), device=device)
            for o in (out if n_out is not None else (out,))
        ]
        return tuple(outs) if n_out is not None else outs[0]

    if has_torch_tpu():
        # torch_tpu registers the op (schema, TPU kernel, fake); we add the CPU interpret path.
        op = torch.tpu.pallas.jax_op(qualname)(fn)
        op.register_kernel("cpu")(cpu_impl)
    else:
        op = torch.library.custom_op(qualname, cpu_impl, mutates_args=(), schema=schema)
        op.register_fake(fake_impl)
    op.jax_fn = fn
    op.compile_stats = stats
    return op


def _schema_default(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value)
