import jax
import torch

from . import kernel
from ._ops import add_op_namespace_prefix
from .jax_bridge import jax_op, pallas_interpret


def _scale_add(x: jax.Array, y: jax.Array, scale: float) -> jax.Array:
    return kernel.scale_add(x, y, scale, interpret=pallas_interpret())


def _scale_add_fake(x, y, scale):
    return torch.empty_like(x)


scale_add_op = jax_op(add_op_namespace_prefix("scale_add"), _scale_add, fake=_scale_add_fake)


def _setup_context(ctx, inputs, output):
    ctx.scale = inputs[2]


def _backward(ctx, grad):
    # d/dx = scale * grad (through the same kernel with y = 0), d/dy = grad.
    return scale_add_op(grad, torch.zeros_like(grad), ctx.scale), grad, None


scale_add_op.register_autograd(_backward, setup_context=_setup_context)


def scale_add(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"x and y must be 2-D of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must share a dtype, got {x.dtype} and {y.dtype}")
    return scale_add_op(x, y, float(scale))
