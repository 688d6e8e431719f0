"""A dense GEMM oracle for tests: plain jnp, in whatever precision its inputs have."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def matmul_reference(a: jax.Array, b: jax.Array, *, bias: jax.Array | None = None,
                     epilogue: Callable[..., jax.Array] | None = None,
                     epilogue_takes_indices: bool = False, out_dtype=None) -> jax.Array:
    """epilogue(a @ b + bias) with broadcast leading dims, accumulated in float32 or better.

    Float64 inputs (under `jax.enable_x64`) give the float64 golden value tests compare against.
    """
    acc_dtype = jnp.promote_types(a.dtype, jnp.float32)
    acc = jnp.matmul(a, b, preferred_element_type=acc_dtype)
    if bias is not None:
        acc = acc + bias.astype(acc_dtype)
    if epilogue is not None:
        if epilogue_takes_indices:
            m, n = acc.shape[-2:]
            rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
            cols = lax.broadcasted_iota(jnp.int32, (1, n), 1)
            acc = epilogue(acc, rows, cols)
        else:
            acc = epilogue(acc)
    return acc.astype(out_dtype or a.dtype)
