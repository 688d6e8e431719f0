"""Inside `jax.shard_map`: the mesh axes values vary over, and keeping them consistent.

With shard_map's default type checking, operands of one operation must vary over the same mesh
axes, a scan's carry keeps its type, a pallas_call's outputs say which axes they vary over, and
a custom_vjp's cotangent has its input's type. `aligned` casts operands to the union of their
axes, `out_struct` types a kernel output like an operand, and `summed_to_vary_like` sums a
cotangent over the axes its input does not vary over. Outside shard_map nothing varies and
each returns its arguments as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jattn._src import compat


def varying_axes(x: Any) -> frozenset:
    """The mesh axes x varies over inside shard_map (empty elsewhere)."""
    return compat.varying_axes_of(jax.typeof(x))


def aligned(*operands: Any) -> list[Any]:
    """The operands (array leaves; None passes through) cast to vary over the union of their
    mesh axes."""
    leaves = [x for x in jax.tree.leaves(operands) if x is not None]
    axes = frozenset().union(*(varying_axes(x) for x in leaves))
    if not axes:
        return list(operands)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(jnp.asarray(x), missing, to="varying") if missing else x

    return [jax.tree.map(cast, x) for x in operands]


def summed_to_vary_like(cotangent: Any, primal: Any) -> Any:
    """A cotangent summed over the mesh axes it varies over and its primal does not (inside
    shard_map, a replicated input's gradient is the sum of every device's part), so that a
    custom_vjp backward returns its input's type."""
    if cotangent is None:
        return None
    extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def out_struct(shape, dtype, like: Any) -> jax.ShapeDtypeStruct:
    """A kernel output of `shape` and `dtype` varying as the (aligned) operand `like` does."""
    field = compat.VARYING_STRUCT_FIELD
    if field is None or not varying_axes(like):
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, **{field: getattr(jax.typeof(like), field)})
