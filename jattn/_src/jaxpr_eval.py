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

from jattn._src.mesh_axes import aligned, varying_axes

# (primitive, operands, params, the outputs' traced avals) -> outputs, or None to bind as usual.
Rewrite = Callable[[Any, list[Any], dict[str, Any], list[Any]], "list[Any] | None"]


class Deferred:
    """A value a rewrite represents its own way (no JAX type): only the rewrite reads it, and
    nested jits and custom_jvp calls that receive it are inlined so that it reaches the
    rewrite."""


def jaxpr_and_consts(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a traced function; jax 0.11 merged ClosedJaxpr into Jaxpr, 0.10 keeps
    the consts beside `.jaxpr`."""
    return getattr(closed, "jaxpr", closed), getattr(closed, "consts", ())


def with_consts(closed: Any, consts: Sequence[Any]) -> Any:
    """The traced function with other constants (values of the same types, or Deferred)."""
    # jax 0.11 merged ClosedJaxpr into Jaxpr and added `with_consts`; 0.10 has `replace`.
    if hasattr(closed, "with_consts"):
        return closed.with_consts(list(consts))
    return closed.replace(consts=list(consts))


def evaluate(closed: Any, *args: Any, rewrite: Rewrite | None = None) -> list[Any]:
    """The outputs of a closed jaxpr at `args`: nested jits inlined (and, where operands vary
    over mesh axes or are Deferred, custom_jvp calls too: their inner jaxpr holds unvarying
    constants), each equation's operands aligned over mesh axes, and `rewrite` given the first
    refusal."""
    jaxpr, consts = jaxpr_and_consts(closed)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(var):
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    for eqn in jaxpr.eqns:
        params = eqn.params
        if eqn.primitive.name == "pvary":  # a cast traced in: cast only where still needed
            operand = read(eqn.invars[0])
            if isinstance(operand, Deferred):  # the rewrite aligns what it binds
                env.update(zip(eqn.outvars, [operand]))
                continue
            missing = tuple(sorted(set(params["axes"]) - varying_axes(operand)))
            outputs = [jax.lax.pcast(operand, missing, to="varying") if missing else operand]
            env.update(zip(eqn.outvars, outputs))
            continue
        operands = [read(var) for var in eqn.invars]
        deferred = any(isinstance(x, Deferred) for x in operands)
        varying = not deferred and any(varying_axes(x) for x in operands)
        if varying:
            operands = aligned(*operands)
        outputs = None if rewrite is None else rewrite(
            eqn.primitive, operands, params, [var.aval for var in eqn.outvars])
        if outputs is None and eqn.primitive.name in ("pjit", "jit"):
            outputs = evaluate(params["jaxpr"], *operands, rewrite=rewrite)
        elif (outputs is None and eqn.primitive.name == "custom_jvp_call"
              and (varying or deferred)):
            outputs = evaluate(params["call_jaxpr"], *operands, rewrite=rewrite)
        elif outputs is None:
            bind_params, subfunctions = eqn.primitive.get_bind_params(params), ()
            if isinstance(bind_params, tuple):  # older jax: (subfunctions, params)
                subfunctions, bind_params = bind_params
            outputs = eqn.primitive.bind(*subfunctions, *operands, **bind_params)
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
        env.update(zip(eqn.outvars, outputs))
    return [read(var) for var in jaxpr.outvars]
