"""Evaluating a traced user function's jaxpr where it is used, with optional rewrites.

A jaxpr is traced once, outside any `shard_map`; evaluated inside one, its equations see
operands that vary over mesh axes next to constants and literals that do not, which JAX's
primitives reject (tracing would have inserted the casts). `evaluate` inserts them: each
equation's operands are cast to vary over every axis one of them varies over. Outside
shard_map (and inside Pallas kernels) nothing varies and equations bind as traced.

A rewrite may stand in its own objects for values (`Deferred`: a captured array left in memory,
say); they skip the alignment (casts traced in pass them through), and equations reading them
go to the rewrite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

from jattn._src import compat
from jattn._src.mesh_axes import aligned, varying_axes

# (primitive, operands, params, the outputs' traced avals) -> outputs, or None to bind as usual.
Rewrite = Callable[[Any, list[Any], dict[str, Any], list[Any]], "list[Any] | None"]


class Deferred:
    """A value a rewrite represents its own way (no JAX type): only the rewrite reads it, and
    nested jits and custom_jvp calls that receive it are inlined so that it reaches the
    rewrite."""


# Primitives that only wrap a jaxpr: the parameter holding it.
WRAPPERS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
            "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
            "remat": "jaxpr", "checkpoint": "jaxpr"}


def wrapped(primitive, params: dict[str, Any]) -> Any | None:
    """The jaxpr a wrapper equation (jit, custom_jvp, remat, ...) calls; None for others."""
    return params.get(WRAPPERS.get(primitive.name, ""))


def bind(primitive, operands: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """The equation's outputs (always a list) on these operands."""
    outputs = compat.bind_equation(primitive, operands, params)
    return outputs if primitive.multiple_results else [outputs]


def evaluate(closed: Any, *args: Any, rewrite: Rewrite | None = None) -> list[Any]:
    """The outputs of a closed jaxpr at `args`: nested jits inlined (and, where operands vary
    over mesh axes or are Deferred, custom_jvp calls too: their inner jaxpr holds unvarying
    constants), each equation's operands aligned over mesh axes, and `rewrite` given the first
    refusal."""
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(var):
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    for eqn in jaxpr.eqns:
        outputs = _evaluate_equation(eqn.primitive, [read(var) for var in eqn.invars],
                                     eqn.params, [var.aval for var in eqn.outvars], rewrite)
        env.update(zip(eqn.outvars, outputs))
    return [read(var) for var in jaxpr.outvars]


def _evaluate_equation(primitive, operands: list[Any], params: dict[str, Any],
                       out_avals: list[Any], rewrite: Rewrite | None) -> list[Any]:
    deferred = any(isinstance(x, Deferred) for x in operands)
    if primitive.name == "pvary":  # a cast traced in: cast only where still needed
        [operand] = operands
        if deferred:  # the rewrite aligns what it binds
            return [operand]
        if rewrite is not None and not isinstance(operand, jax.core.Tracer):
            return [operand]  # a constant the rewrite reads as one (each bind aligns)
        missing = tuple(sorted(set(params["axes"]) - varying_axes(operand)))
        return [jax.lax.pcast(operand, missing, to="varying") if missing else operand]
    varying = not deferred and any(varying_axes(x) for x in operands)
    if varying:
        operands = aligned(*operands)
    outputs = None if rewrite is None else rewrite(primitive, operands, params, out_avals)
    if outputs is not None:
        return outputs
    if primitive.name in ("pjit", "jit") or (primitive.name == "custom_jvp_call"
                                             and (varying or deferred)):
        return evaluate(wrapped(primitive, params), *operands, rewrite=rewrite)
    return bind(primitive, operands, params)
