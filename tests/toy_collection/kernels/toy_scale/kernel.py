"""out = scale * x + y, one (block_rows, full width) row tile per grid step."""

import jax
from jax.experimental import pallas as pl

from .tiling import block_rows


def _scale_add_kernel(x_ref, y_ref, o_ref, *, scale):
    o_ref[...] = (scale * x_ref[...].astype(jax.numpy.float32) + y_ref[...]).astype(o_ref.dtype)


def scale_add(x, y, scale: float, *, interpret=False):
    rows, cols = x.shape
    br = block_rows(rows)
    spec = pl.BlockSpec((br, cols), lambda i: (i, 0))
    return pl.pallas_call(
        lambda x_ref, y_ref, o_ref: _scale_add_kernel(x_ref, y_ref, o_ref, scale=scale),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, br),),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
    )(x, y)
