"""Inside `jax.shard_map`: the mesh axes values vary over, and keeping them consistent.

With shard_map's default type checking, operands of one operation must vary over the same mesh
axes, a scan's carry keeps its type, a pallas_call's outputs say which axes they vary over, and
a custom_vjp's cotangent has its input's type. `aligned` casts operands to the union of their
axes, `out_struct` types a kernel output like an operand, `kernel_operands` and
`kernel_results` type a Mosaic GPU kernel's operands and results, and `summed_to_vary_like`
sums a cotangent over the axes its input does not vary over. Outside shard_map nothing varies
and each returns its arguments as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

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


def mesh_key() -> tuple:
    """The current mesh's axis names and sizes (() outside any): the types of values traced
    inside shard_map name the mesh, so the caches of programs holding traces key by it."""
    return tuple(jax.sharding.get_abstract_mesh().shape_tuple)


def out_struct(shape, dtype, like: Any) -> jax.ShapeDtypeStruct:
    """A kernel output of `shape` and `dtype` varying as the (aligned) operand `like` does."""
    field = compat.VARYING_STRUCT_FIELD
    if field is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, **{field: getattr(jax.typeof(like), field)})


# pl.kernel (the Mosaic GPU kernels') types its body's refs as its operands are, where scalars
# read from varying refs then change a loop's carry type, and types its results as varying over
# no mesh axis. `kernel_operands` types the operands as pallas_call types its body's refs (this
# identity), `kernel_results` types the results as the operands were. The kernels run inside
# custom_vjp rules: neither is differentiated.
_as_kernel_operand_p = jex_core.Primitive("jattn_as_kernel_operand")
_as_kernel_operand_p.def_impl(lambda x: x)
_as_kernel_operand_p.def_abstract_eval(compat.without_varying_axes)
mlir.register_lowering(_as_kernel_operand_p, lambda ctx, x: [x])
batching.primitive_batchers[_as_kernel_operand_p] = (
    lambda args, dims: (_as_kernel_operand_p.bind(*args), dims[0]))


def kernel_operands(*operands: Any) -> tuple[list[Any], tuple[str, ...]]:
    """(operands, axes): a pl.kernel's operands (array leaves) typed as varying over no mesh
    axis, and the mesh axes any of them varied over."""
    leaves = [x for x in jax.tree.leaves(operands) if x is not None]
    axes = tuple(sorted(frozenset().union(*(varying_axes(x) for x in leaves))))
    if not axes:
        return list(operands), axes
    return [jax.tree.map(_as_kernel_operand_p.bind, x) for x in operands], axes


def kernel_results(results: Any, axes: tuple[str, ...]) -> Any:
    """A pl.kernel's results typed as varying over the mesh axes its operands did."""
    if not axes:
        return results
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), results)
