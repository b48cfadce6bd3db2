import jax.numpy as jnp


def scale_add(x, y, scale):
    return (scale * x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
