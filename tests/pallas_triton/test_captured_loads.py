"""Captured arrays read inside a Pallas kernel: `call_in_kernel`'s rewrite turns a lookup in a
captured array (`table[idx]`, `table[i, j]`, `table[h]` with a scalar h) into a load of its ref
with the indices clamped into the table, loads a table used whole, and refuses slices. Run by
the Pallas interpreter on the CPU, against the same function in plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.user_functions import CaptureSet, trace_with_captures

TABLE = jnp.arange(10.0, dtype=jnp.float32) * 1.5
GRID = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) - 5


def _kernel_call(fn, *args):
    """A pallas_call whose kernel reads `args` whole and returns fn(*args), with fn's captured
    arrays passed as kernel inputs by capture slot (as jattn's kernels pass them)."""
    [traced], captures = trace_with_captures(
        fn, [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args])
    [out_aval] = traced.out_avals

    def kernel(*refs):
        arg_refs, capture_refs, out_ref = refs[:len(args)], refs[len(args):-1], refs[-1]
        [out] = call_in_kernel(traced, capture_refs, *[r[...] for r in arg_refs])
        out_ref[...] = out

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_aval.shape, out_aval.dtype),
                          interpret=True)
    return lambda *args: call(*args, *captures)


def _run(fn, *args):
    """fn's outputs computed in a kernel, and the primitives in the kernel's body."""
    call = _kernel_call(fn, *args)
    [eqn] = [e for e in jax.make_jaxpr(call)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
    return call(*args), _primitives(eqn.params["jaxpr"])


def _primitives(jaxpr):
    names = set()
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    names |= _primitives(sub)
    return names


def test_a_lookup_with_an_index_array_is_a_load_with_indices_clamped_into_the_table():
    idx = jnp.array([0, 3, 9, 12, -2, -30, 5, 100], jnp.int32)
    out, primitives = _run(lambda i: TABLE[i] + 1, idx)
    # jnp wraps negative indices once; what is still outside (masked-out positions) is clamped
    wrapped = np.where(idx < 0, idx + 10, idx)
    np.testing.assert_array_equal(out, np.asarray(TABLE)[np.clip(wrapped, 0, 9)] + 1)
    assert "gather" not in primitives and "get" in primitives
    _, plain = _run(lambda i, t: t[i], idx, TABLE)  # a gather on a kernel value stays one
    assert "gather" in plain


class StrictRef:
    """A stand-in for a kernel ref that records what it is indexed with and, unlike the
    interpreter, raises on indices outside it (NumPy indexing)."""

    def __init__(self, array):
        self.array, self.shape, self.reads = np.asarray(array), np.shape(array), []

    def __getitem__(self, index):
        self.reads.append(index)
        if index is Ellipsis:
            return jnp.asarray(self.array)
        numpy_index = tuple(
            slice(int(i.start), int(i.start) + i.size) if isinstance(i, pl.Slice) else
            np.asarray(i) for i in index)
        for part, size in zip(numpy_index, self.shape):
            if isinstance(part, slice) and part.stop > size:
                raise IndexError(f"{part} outside {size}")
        return jnp.asarray(self.array[numpy_index])


def test_indices_reach_the_ref_already_clamped():
    idx = jnp.array([-30, 12, 4], jnp.int32)
    [traced], _ = trace_with_captures(lambda i, h: (TABLE[i], GRID[h], GRID[i, h]),
                                      [jax.ShapeDtypeStruct((3,), jnp.int32),
                                       jax.ShapeDtypeStruct((), jnp.int32)])
    table, grid = StrictRef(TABLE), StrictRef(GRID)
    lookup, row, pairs = call_in_kernel(traced, [table, grid], idx, jnp.int32(9))
    np.testing.assert_array_equal(lookup, np.asarray(TABLE)[[0, 9, 4]])
    np.testing.assert_array_equal(row, np.asarray(GRID)[2])
    np.testing.assert_array_equal(pairs, np.asarray(GRID)[[0, 2, 2], [3, 3, 3]])
    assert len(table.reads) == 1 and len(grid.reads) == 2  # one load per lookup


def test_a_multi_dimensional_lookup_loads_one_element_per_index_pair():
    i = jnp.array([0, 1, 2, 2, 5], jnp.int32)
    j = jnp.array([3, 0, 1, 7, 2], jnp.int32)
    out, primitives = _run(lambda i, j: GRID[i, j], i, j)
    np.testing.assert_array_equal(out, np.asarray(GRID)[np.clip(i, 0, 2), np.clip(j, 0, 3)])
    assert not {"gather", "concatenate"} & primitives  # index columns stay separate


def test_a_tile_shaped_lookup_like_a_relative_position_bias():
    q, kv = jnp.arange(8, dtype=jnp.int32), jnp.arange(8, dtype=jnp.int32)
    bias = jnp.arange(2 * 15, dtype=jnp.float32).reshape(2, 15)

    def score(q, kv):  # bias[h, q - kv + 7] over a tile, for head 1
        return bias[1, q[:, None] - kv[None, :] + 7]

    out, primitives = _run(score, q, kv)
    np.testing.assert_array_equal(out, score(q, kv))
    assert out.shape == (8, 8) and "gather" not in primitives


def test_a_scalar_index_reads_a_row_clamped_into_the_table():
    for h, row in [(1, 1), (2, 2), (7, 2)]:
        out, primitives = _run(lambda h: GRID[h] * 2, jnp.int32(h))
        np.testing.assert_array_equal(out, np.asarray(GRID)[row] * 2)
        assert "dynamic_slice" not in primitives
    traced = jax.make_jaxpr(lambda h: GRID[h])(jnp.int32(0))  # what the rewrite replaced
    assert "dynamic_slice" in [e.primitive.name for e in traced.jaxpr.eqns]


@pytest.mark.parametrize("fn", [lambda x: x + TABLE.sum(), lambda x: x - TABLE * 2],
                         ids=["reduced", "elementwise"])
def test_a_table_used_whole_is_loaded_whole(fn):
    x = jnp.linspace(0, 1, 10, dtype=jnp.float32)
    out, _ = _run(fn, x)
    np.testing.assert_allclose(out, fn(x), rtol=1e-6)


def test_lookups_inside_custom_jvp_functions_and_jits_are_seen():
    idx = jnp.array([1, 4, 11], jnp.int32)

    def fn(i):  # the table passed into a jit; relu's custom_jvp around a lookup's result
        return jax.nn.relu(jax.jit(lambda j, t: t[j])(i, TABLE) - 3)

    out, primitives = _run(fn, idx)
    np.testing.assert_array_equal(out, np.maximum(np.asarray(TABLE)[[1, 4, 9]] - 3, 0))
    assert "gather" not in primitives


def test_captures_are_read_by_slot_of_the_shared_capture_list():
    captures = CaptureSet(known=[GRID])
    traced = captures.trace(lambda i: TABLE[i] + GRID[0, 0],
                            [jax.ShapeDtypeStruct((3,), jnp.int32)])
    assert captures.captures[0] is GRID and captures.captures[1] is TABLE
    consts = traced.closed_jaxpr.consts
    assert sorted(traced.capture_slots) == [0, 1]
    assert all(captures.captures[s] is c for s, c in zip(traced.capture_slots, consts))

    def kernel(idx_ref, grid_ref, table_ref, out_ref):
        out_ref[...] = call_in_kernel(traced, [grid_ref, table_ref], idx_ref[...])[0]

    idx = jnp.array([0, 2, 4], jnp.int32)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3,), jnp.float32),
                         interpret=True)(idx, *captures.captures)
    np.testing.assert_array_equal(out, np.asarray(TABLE)[[0, 2, 4]] + float(GRID[0, 0]))


@pytest.mark.parametrize("fn", [lambda i: GRID[i, 1:3], lambda i: GRID[i]],
                         ids=["slice", "row per index"])
def test_reading_more_than_one_element_per_index_is_not_implemented(fn):
    with pytest.raises(NotImplementedError, match="one element per index"):
        _kernel_call(fn, jnp.zeros(2, jnp.int32))(jnp.zeros(2, jnp.int32))
