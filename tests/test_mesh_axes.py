"""Mesh axes inside `jax.shard_map`: outside one nothing varies and every helper returns its
arguments as they are; inside, `aligned` casts operands to the union of their axes,
`summed_to_vary_like` sums a cotangent over the axes its primal does not vary over, and
`out_struct` types a kernel output like its operand; `kernel_operands` and `kernel_results`
type a Mosaic GPU kernel's operands as varying over nothing and its results back."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn._src import compat
from jattn._src.mesh_axes import (aligned, kernel_operands, kernel_results, out_struct,
                                  summed_to_vary_like, varying_axes)


def _mesh():
    devices = jax.devices("cpu")
    return Mesh(np.array(devices[:2] if len(devices) >= 2 else devices[:1]), ("i",))


def test_outside_shard_map_nothing_varies_and_everything_is_returned_as_is():
    x, y = jnp.ones(3), np.arange(3.0)
    assert varying_axes(x) == frozenset() and varying_axes(1.0) == frozenset()
    result = aligned(x, None, {"y": y})
    assert result[0] is x and result[1] is None and result[2]["y"] is y
    assert summed_to_vary_like(x, y) is x and summed_to_vary_like(None, y) is None
    struct = out_struct((2, 5), jnp.bfloat16, x)
    assert (struct.shape, struct.dtype) == ((2, 5), jnp.bfloat16)
    assert compat.varying_axes_of(struct) == frozenset()
    operands, axes = kernel_operands(x, None, y)
    assert operands[0] is x and operands[1] is None and operands[2] is y and axes == ()
    assert kernel_results(x, axes) is x


def test_inside_shard_map_operands_are_cast_to_the_union_of_their_axes():
    mesh, constant = _mesh(), jnp.arange(4.0)
    seen = {}

    def body(x):
        seen["before"] = varying_axes(x), varying_axes(constant)
        a, none, tree = aligned(x, None, {"c": constant, "s": jnp.float32(2)})
        seen["after"] = (a is x, none, varying_axes(tree["c"]), varying_axes(tree["s"]))
        seen["unvarying"] = aligned(constant, 3.0)  # no operand varies: unchanged
        # binding directly (no tracing-time casts) works only because the types now match
        return jax.lax.add_p.bind(jax.lax.mul_p.bind(a, tree["c"]),
                                  jnp.broadcast_to(tree["s"], a.shape))

    x = jnp.arange(4.0 * mesh.size)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    np.testing.assert_array_equal(out, x * jnp.tile(constant, mesh.size) + 2)
    assert seen["before"] == (frozenset({"i"}), frozenset())
    assert seen["after"] == (True, None, frozenset({"i"}), frozenset({"i"}))
    assert seen["unvarying"][0] is constant and seen["unvarying"][1] == 3.0


def test_a_cotangent_is_summed_over_the_axes_its_primal_does_not_vary_over():
    mesh, seen = _mesh(), {}

    def body(cotangent, replicated):
        summed = summed_to_vary_like(cotangent, replicated)
        kept = summed_to_vary_like(cotangent, cotangent)
        seen["axes"] = varying_axes(summed), kept is cotangent
        return summed

    cotangent = jnp.arange(3.0 * mesh.size).reshape(mesh.size, 3)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P()))(
        cotangent, jnp.ones((1, 3)))
    np.testing.assert_array_equal(out, cotangent.sum(0, keepdims=True))
    assert seen["axes"] == (frozenset(), True)


def test_out_struct_types_a_kernel_output_like_its_operand():
    mesh, constant, seen = _mesh(), jnp.ones(2), {}

    def body(x):
        varying, plain = out_struct((7,), jnp.int8, x), out_struct((7,), jnp.int8, constant)
        seen["structs"] = varying, plain
        return x

    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
                   jnp.ones(2 * mesh.size))
    varying, plain = seen["structs"]
    assert (varying.shape, varying.dtype, plain.shape, plain.dtype) == ((7,), jnp.int8,
                                                                       (7,), jnp.int8)
    assert compat.varying_axes_of(plain) == frozenset()
    if compat.VARYING_STRUCT_FIELD is not None:
        assert compat.varying_axes_of(varying) == frozenset({"i"})


def test_a_kernel_sees_its_operands_as_varying_over_nothing_and_its_results_vary_again():
    mesh, constant, seen = _mesh(), jnp.ones(2), {}

    def body(x):
        (a, c), axes = kernel_operands(x, constant)
        seen["operands"] = varying_axes(a), varying_axes(c), axes
        result = kernel_results(a * 2 + c, axes)  # (what a kernel would compute)
        seen["result"] = varying_axes(result)
        return result

    x = jnp.arange(2.0 * mesh.size)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert seen["operands"] == (frozenset(), frozenset(), ("i",))
    assert seen["result"] == frozenset({"i"})
