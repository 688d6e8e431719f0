"""Bitwise-reproducible gradients of captured arrays: scatter-adds summed in integers.

The gradient of a table a mod indexes (`bias[h, kv_idx - q_idx]`) is a scatter-add of the score
cotangents into the table. XLA runs a float scatter-add with atomics on the GPU, so values that
land on one entry are summed in whatever order the threads arrive, and two runs differ in the
last bits. Integer addition does not depend on the order: each cotangent becomes an int64
fixed-point number (a power-of-two unit chosen so that no sum can overflow: about 2**-39 of the
largest cotangent at 8M updates), the int64 scatter-add is one atomic per update as the float
one was, and the sums are converted back to float32. The result is at least as precise as a
float32 sum of the same values and identical on every run and every platform.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.jaxpr_eval import evaluate

_TOTAL_BITS = 62  # an int64 sum of fixed-point values stays below 2**62 in magnitude


def _fraction_bits(updates: int) -> int:
    """Fixed-point bits below the largest value such that `updates` of them sum below 2**62."""
    return _TOTAL_BITS - max(1, math.ceil(math.log2(max(2, updates))))


def scatter_add(operand, indices, updates, **params):
    """lax.scatter_add(operand, indices, updates, **params) for float updates, summed exactly
    in int64 (see the module docstring). A non-finite update makes the result NaN. Its
    derivative is scatter-add's own (a second derivative through a captured array's
    gradient), summed in floats."""
    return _exact_scatter_add(tuple(params.items()), operand, indices, updates)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _exact_scatter_add(params, operand, indices, updates):
    finite = jnp.isfinite(updates)
    clean = jnp.where(finite, updates, 0).astype(jnp.float32)
    largest = jnp.max(jnp.abs(clean)) if clean.size else jnp.float32(0)
    # A power-of-two unit: scaling by it is exact, and every update is at most 2**bits units.
    exponent = jnp.ceil(jnp.log2(jnp.where(largest > 0, largest, 1.0)))
    unit_exponent = exponent - _fraction_bits(updates.size)
    with jax.enable_x64(True):
        fixed = jnp.round(clean * jnp.exp2(-unit_exponent)).astype(jnp.int64)
        summed = lax.scatter_add(jnp.zeros(operand.shape, jnp.int64), indices, fixed,
                                 **dict(params))
        total = summed.astype(jnp.float32) * jnp.exp2(unit_exponent).astype(jnp.float32)
    result = operand + total.astype(operand.dtype)
    return jnp.where(finite.all(), result, jnp.nan).astype(operand.dtype)


@_exact_scatter_add.defjvp
def _exact_scatter_add_jvp(params, primals, tangents):
    operand, indices, updates = primals
    d_operand, _, d_updates = tangents
    return (_exact_scatter_add(params, operand, indices, updates),
            lax.scatter_add(d_operand, indices, d_updates.astype(d_operand.dtype),
                            **dict(params)))


def _integer_scatter_add(primitive, operands, params, out_avals):
    """The rewrite of `jaxpr_eval.evaluate` that sums float scatter-adds in integers (float64
    ones, which int64 fixed point would round, stay XLA's)."""
    dtype = operands[0].dtype
    if (primitive is not lax.scatter_add_p or not jnp.issubdtype(dtype, jnp.floating)
            or dtype == jnp.float64):
        return None
    return [scatter_add(*operands, dimension_numbers=params["dimension_numbers"],
                        indices_are_sorted=params["indices_are_sorted"],
                        unique_indices=params["unique_indices"], mode=params["mode"])]


def vjp(fn: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[[Any], Any]]:
    """jax.vjp(fn, *primals) whose pullback sums scatter-adds in integers."""
    out, pullback = jax.vjp(fn, *primals)

    def deterministic_pullback(cotangent):
        leaves, tree = jax.tree.flatten(cotangent)
        out_tree = []

        def flat_pullback(*leaves):
            result, structure = jax.tree.flatten(pullback(tree.unflatten(leaves)))
            out_tree.append(structure)
            return result

        closed = jax.make_jaxpr(flat_pullback)(*leaves)
        return out_tree[0].unflatten(evaluate(closed, *leaves, rewrite=_integer_scatter_add))

    return out, deterministic_pullback
