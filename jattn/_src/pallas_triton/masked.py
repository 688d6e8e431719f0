"""Masked tile access for Pallas-Triton kernels.

On the GPU a load or store past an array's end is neither padded nor masked unless the kernel
says so; these helpers carry the masks, and skip them where the bound is known not to bite.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def bounds(start, size: int, limit: int | None, axis: int):
    """[size, 1] (axis 0) or [1, size] mask of start + i < limit.

    None when no mask is needed: no limit, or a static start whose window ends inside it.
    """
    if limit is None or (isinstance(start, int) and start + size <= limit):
        return None
    shape = (size, 1) if axis == 0 else (1, size)
    return start + lax.broadcasted_iota(jnp.int32, shape, axis) < limit


def both(x, y):
    """x & y, where None means "everything"."""
    if x is None:
        return y
    return x if y is None else x & y


def load(ref, index, mask):
    """ref[index], with elements outside `mask` read as 0 (unmasked when mask is None)."""
    if mask is None:
        return ref[index]
    # The Triton lowering casts an int fill to float types of 16+ bits only; fp8 needs a float.
    fp8 = jnp.issubdtype(ref.dtype, jnp.floating) and jnp.dtype(ref.dtype).itemsize == 1
    return plgpu.load(ref.at[index], mask=mask, other=0.0 if fp8 else 0)


def store(ref, index, value, mask):
    """ref[index] = value where `mask` holds (everywhere when mask is None)."""
    if mask is None:
        ref[index] = value
    else:
        plgpu.store(ref.at[index], value, mask=mask)
