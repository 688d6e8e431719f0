"""Evaluates a traced user function inside a Pallas-Triton kernel.

User mods and epilogues index the arrays they capture (`bias[h, q_idx - kv_idx]`,
`doc_ids[q_idx]`). Traced, such a lookup is a `gather` (or a `dynamic_slice` for scalar
indices), which the Triton lowering cannot lower, on a whole table that may not even have a
power-of-two size. This interpreter walks the jaxpr and turns each lookup in a captured array
into an indexed load of that array's ref: one pointer per element, no table in registers.
Indices are clamped to the table, so masked-out positions of a ragged tile never read outside.

Casts to vary over mesh axes (traced where a mod closes over a value varying inside shard_map)
pass their operands through: nothing varies inside a kernel. Everything else is bound as
traced. jnp builds a multi-dimensional index by giving each index
array a trailing unit dim and concatenating them; those steps are kept lazy, since Triton
concatenates only two tensors, and materialised only if something other than a lookup uses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.extend.core import Literal

from jattn._src.user_functions import TracedFunction


@dataclasses.dataclass(frozen=True)
class _CapturedRef:
    """A captured array still in memory; loaded whole only if used other than by a lookup."""
    ref: Any


@dataclasses.dataclass(frozen=True)
class _IndexColumns:
    """An index array of shape [..., len(columns)] kept as its columns (each [...])."""
    columns: tuple[Any, ...]


def _materialize(value: Any) -> Any:
    if isinstance(value, _CapturedRef):
        return value.ref[...]
    if isinstance(value, _IndexColumns):
        parts = [c[..., None] for c in value.columns]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return value


def _is_trailing_unit(eqn) -> bool:
    """broadcast_in_dim that only appends a unit dim: x[..., None]."""
    (operand,) = eqn.invars[:1]
    shape = eqn.params["shape"]
    rank = len(operand.aval.shape)
    return (len(shape) == rank + 1 and shape[-1] == 1
            and tuple(eqn.params["broadcast_dimensions"]) == tuple(range(rank))
            and tuple(shape[:-1]) == tuple(operand.aval.shape))


def _lookup(table: _CapturedRef, columns: Sequence[Any], shape: Sequence[int]):
    """table[columns[0], columns[1], ...] as one gather-load, indices clamped into the table."""
    dims = table.ref.shape
    index = tuple(jnp.broadcast_to(jnp.clip(c, 0, d - 1), shape) for c, d in zip(columns, dims))
    return table.ref[index]


def _gather(eqn, operand, indices):
    numbers = eqn.params["dimension_numbers"]
    rank = len(operand.ref.shape)
    point_lookup = (numbers.offset_dims == () and tuple(numbers.collapsed_slice_dims) ==
                    tuple(range(rank)) and tuple(numbers.start_index_map) == tuple(range(rank))
                    and not numbers.operand_batching_dims)
    if not point_lookup:
        raise NotImplementedError(
            "In a kernel, a captured array can only be read one element per index "
            "(`table[i, j]` with integer arrays i, j); slices or rows of it cannot.")
    if isinstance(indices, _IndexColumns):
        columns = indices.columns
    elif indices.shape[-1] == 1:
        columns = (indices.reshape(indices.shape[:-1]),)
    else:
        raise NotImplementedError("captured-array lookup with an index array built in a way "
                                  "this kernel cannot split; index with separate arrays.")
    return _lookup(operand, columns, eqn.outvars[0].aval.shape)


def _dynamic_slice(eqn, operand, *starts):
    sizes = eqn.params["slice_sizes"]
    dims = operand.ref.shape
    index = tuple(pl.ds(jnp.clip(s, 0, d - z), z) for s, d, z in zip(starts, dims, sizes))
    return operand.ref[index]


_SUBJAXPR_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
                    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                    "eval_jaxpr": "jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "gather" and isinstance(invals[0], _CapturedRef):
            outs = [_gather(eqn, invals[0], invals[1])]
        elif name == "dynamic_slice" and isinstance(invals[0], _CapturedRef):
            outs = [_dynamic_slice(eqn, *invals)]
        elif name == "broadcast_in_dim" and _is_trailing_unit(eqn) and not isinstance(
                invals[0], (_CapturedRef, _IndexColumns)):
            outs = [_IndexColumns((invals[0],))]
        elif (name == "concatenate" and all(isinstance(v, _IndexColumns) for v in invals)
              and eqn.params["dimension"] == len(eqn.outvars[0].aval.shape) - 1):
            outs = [_IndexColumns(tuple(c for v in invals for c in v.columns))]
        elif name == "pvary":  # a mesh-axis cast traced outside: nothing varies in a kernel
            outs = invals
        elif name in _SUBJAXPR_PARAMS and _SUBJAXPR_PARAMS[name] in eqn.params:
            closed = eqn.params[_SUBJAXPR_PARAMS[name]]
            inner = getattr(closed, "jaxpr", closed)
            outs = _eval(inner, list(getattr(closed, "consts", ())), invals)
        else:
            invals = [_materialize(v) for v in invals]
            outs = eqn.primitive.bind(*invals, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [_materialize(read(v)) for v in jaxpr.outvars]


def call_in_kernel(fn: TracedFunction, capture_refs: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates a traced user function in a kernel body, captures given as refs."""
    closed = fn.closed_jaxpr
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = [_CapturedRef(capture_refs[slot]) for slot in fn.capture_slots]
    return _eval(jaxpr, consts, args)
