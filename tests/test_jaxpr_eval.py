"""Evaluating a traced jaxpr where it is used: the outputs equal the function's, nested jits are
inlined so a rewrite sees their equations, a rewrite replaces an equation or lets it bind, values
it stands in (`Deferred`) reach it through jits and custom_jvp functions, and inside shard_map a
jaxpr traced outside (with unvarying constants) evaluates on varying operands."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn._src import compat, jaxpr_eval
from jattn._src.jaxpr_eval import Deferred, bind, evaluate, wrapped

TABLE = jnp.array([-1.5, -0.5, 0.5, 1.5], jnp.float32)


@dataclasses.dataclass(frozen=True)
class Stored(Deferred):
    """A stand-in for an array, read only by the test's rewrite."""
    value: jax.Array


def _recording(names, replace=None, deferred=None):
    """A rewrite that records each primitive it is offered (in `deferred` those with a Stored
    operand) and binds Stored values itself."""
    def rewrite(primitive, operands, params, out_avals):
        names.append(primitive.name)
        if replace and primitive.name in replace:
            return replace[primitive.name](*operands)
        if any(isinstance(x, Deferred) for x in operands):
            if deferred is not None:
                deferred.append(primitive.name)
            if wrapped(primitive, params) is not None:
                return None  # let evaluate inline it
            values = [x.value if isinstance(x, Stored) else x for x in operands]
            outputs = bind(primitive, values, params)
            assert [o.shape for o in outputs] == [a.shape for a in out_avals]
            return outputs
        return None
    return rewrite


def _function(x, y):
    return jnp.sin(x) @ y + TABLE.sum(), jnp.cumsum(y, axis=0).astype(jnp.int32)


def test_evaluate_reproduces_the_function():
    x = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
    y = jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)
    closed = jax.make_jaxpr(_function)(x, y)
    expected = jax.jit(_function)(x, y)
    outputs = jax.jit(lambda *args: evaluate(closed, *args))(x, y)
    assert len(outputs) == 2
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6)
    names = []  # a rewrite that always declines changes nothing
    np.testing.assert_allclose(evaluate(closed, x, y, rewrite=_recording(names))[0], expected[0],
                               rtol=1e-6)
    assert {"sin", "dot_general", "cumsum"} <= set(names)


def test_nested_jits_are_inlined_for_the_rewrite():
    def f(x):
        return jax.jit(lambda y: jax.jit(jnp.sin)(y) * 2)(x) + 1

    x = jnp.arange(3.0)
    closed = jax.make_jaxpr(f)(x)
    assert "sin" not in [e.primitive.name for e in closed.jaxpr.eqns]  # it is inside the jits
    names = []
    np.testing.assert_allclose(evaluate(closed, x, rewrite=_recording(names))[0], f(x))
    assert names.count("sin") == 1 and {"mul", "add"} <= set(names)
    assert names[0] in ("pjit", "jit")  # the jit itself is offered first


def test_a_rewrite_replaces_an_equation_by_returning_its_outputs():
    def f(x):
        return jax.jit(jnp.sin)(x) + jnp.exp(x)

    x = jnp.array([0.0, 0.5, 1.0])
    closed = jax.make_jaxpr(f)(x)
    names = []
    replaced = evaluate(closed, x, rewrite=_recording(names, {"sin": lambda v: [jnp.cos(v)]}))
    np.testing.assert_allclose(replaced[0], jnp.cos(x) + jnp.exp(x), rtol=1e-6)
    # a whole jit replaced: its inner equations are never offered
    names = []
    replaced = evaluate(closed, x, rewrite=_recording(names, {"pjit": lambda v: [v * 0],
                                                             "jit": lambda v: [v * 0]}))
    np.testing.assert_allclose(replaced[0], jnp.exp(x), rtol=1e-6)
    assert "sin" not in names


def test_deferred_values_reach_the_rewrite_through_jits_and_custom_jvp_functions():
    def f(x):
        product = jax.jit(lambda a, t: a * t)(x, TABLE)
        return jax.nn.relu(TABLE) + jax.nn.softplus(TABLE) + product

    x = jnp.arange(4.0)
    closed = jax.make_jaxpr(f)(x)
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    assert len(consts) == 1 and consts[0] is TABLE
    names, deferred = [], []
    stored = compat.with_consts(closed, [Stored(TABLE)])
    [out] = jax.jit(lambda x: evaluate(stored, x, rewrite=_recording(names, deferred=deferred))
                    )(x)
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-6)
    # the equations that read the table inside the jit, relu and softplus (logaddexp) got it
    # as it was stored: each wrapper was offered, declined, and inlined
    assert deferred.count("custom_jvp_call") == 2
    assert {"mul", "max", "sub", "add"} <= set(deferred)
    assert "log1p" in names and "log1p" not in deferred  # (reads a computed value)
    assert not isinstance(out, Deferred)


def test_wrapped_gives_the_inner_jaxpr_of_wrappers_only():
    closed = jax.make_jaxpr(lambda x: jax.nn.relu(jax.jit(jnp.sin)(x)) + 1)(jnp.ones(2))
    by_name = {e.primitive.name: e for e in closed.jaxpr.eqns}
    jit_eqn = by_name.get("pjit", by_name.get("jit"))
    inner = wrapped(jit_eqn.primitive, jit_eqn.params)
    assert [e.primitive.name for e in compat.jaxpr_and_consts(inner)[0].eqns] == ["sin"]
    custom = by_name["custom_jvp_call"]
    assert wrapped(custom.primitive, custom.params) is custom.params["call_jaxpr"]
    assert wrapped(by_name["add"].primitive, by_name["add"].params) is None
    assert wrapped(jax.lax.add_p, {}) is None


def test_bind_always_returns_a_list():
    [total] = bind(jax.lax.add_p, [jnp.float32(1), jnp.float32(2)], {})
    assert float(total) == 3.0
    keys, values = jnp.array([3, 1, 2]), jnp.array([30.0, 10.0, 20.0])
    closed = jax.make_jaxpr(lambda k, v: jax.lax.sort((k, v), num_keys=1))(keys, values)
    [sort] = closed.jaxpr.eqns
    assert sort.primitive.multiple_results
    outputs = bind(sort.primitive, [keys, values], sort.params)
    assert isinstance(outputs, list) and len(outputs) == 2
    np.testing.assert_array_equal(outputs[1], [10.0, 20.0, 30.0])


def test_a_jaxpr_traced_outside_shard_map_evaluates_on_varying_operands():
    devices = jax.devices("cpu")
    mesh = Mesh(np.array(devices[:2] if len(devices) >= 2 else devices[:1]), ("i",))

    def f(x):  # a constant, a literal and a custom_jvp whose inner jaxpr holds a literal
        return jax.nn.softplus(x * TABLE) + jax.nn.relu(x - 1.0) + jax.jit(jnp.cos)(TABLE)

    closed = jax.make_jaxpr(f)(jnp.ones(4))
    failures = []

    def body(x):
        assert jaxpr_eval.varying_axes(x) == {"i"}
        try:  # the equations bound as traced: rejected, which the alignment avoids
            bind(jax.lax.mul_p, [x, TABLE], {})
        except ValueError as error:
            failures.append(str(error))
        return evaluate(closed, x)[0]

    x = jnp.arange(4.0 * mesh.size) / 3
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
    table = np.tile(np.asarray(TABLE), mesh.size)
    expected = np.logaddexp(x * table, 0) + np.maximum(x - 1, 0) + np.cos(table)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert failures and "varying manual axes" in failures[0]
