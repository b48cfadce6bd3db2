# `from . import` binds each submodule as an attribute even when `kernels` re-imports an identical
# build (same op namespace) under the same module name.
from . import _ops, integration, kernel, ops, reference, tiling
from .ops import scale_add

__all__ = ["scale_add"]
