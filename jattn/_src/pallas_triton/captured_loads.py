"""Reading captured arrays inside a Pallas-Triton kernel: a `jaxpr_eval` rewrite.

User mods and epilogues index the arrays they capture (`bias[h, q_idx - kv_idx]`,
`doc_ids[q_idx]`). Traced, such a lookup is a `gather` (or a `dynamic_slice` for scalar
indices), which the Triton lowering cannot lower, on a whole table that may not even have a
power-of-two size. The rewrite keeps each captured array in memory (`_CapturedRef`) and turns a
lookup in it into an indexed load of its ref: one pointer per element, no table in registers.
Indices are clamped to the table, so masked-out positions of a ragged tile never read outside.

Wrapper primitives (jit, custom_jvp, remat, ...) are inlined, so that lookups inside them are
seen. jnp builds a multi-dimensional index by giving each index array a trailing unit dim and
concatenating them; those steps are kept lazy (`_IndexColumns`), since Triton concatenates only
two tensors, and materialised only if something other than a lookup uses them. Everything else
is bound as traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn._src.jaxpr_eval import Deferred, bind, evaluate, wrapped
from jattn._src.user_functions import TracedFunction


@dataclasses.dataclass(frozen=True)
class _CapturedRef(Deferred):
    """A captured array still in memory; loaded whole only if used other than by a lookup."""
    ref: Any


@dataclasses.dataclass(frozen=True)
class _IndexColumns(Deferred):
    """An index array of shape [..., len(columns)] kept as its columns (each [...])."""
    columns: tuple[Any, ...]


def _materialize(value: Any) -> Any:
    if isinstance(value, _CapturedRef):
        return value.ref[...]
    if isinstance(value, _IndexColumns):
        parts = [c[..., None] for c in value.columns]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return value


def _is_trailing_unit(operand: Any, params: dict[str, Any]) -> bool:
    """broadcast_in_dim that only appends a unit dim: x[..., None]."""
    shape, rank = params["shape"], jnp.ndim(operand)
    return (len(shape) == rank + 1 and shape[-1] == 1
            and tuple(params["broadcast_dimensions"]) == tuple(range(rank))
            and tuple(shape[:-1]) == tuple(jnp.shape(operand)))


def _lookup(table: _CapturedRef, columns: Sequence[Any], shape: Sequence[int]):
    """table[columns[0], columns[1], ...] as one gather-load, indices clamped into the table."""
    dims = table.ref.shape
    index = tuple(jnp.broadcast_to(jnp.clip(c, 0, d - 1), shape) for c, d in zip(columns, dims))
    return table.ref[index]


def _gather(operand: _CapturedRef, indices, params: dict[str, Any], shape: Sequence[int]):
    numbers = params["dimension_numbers"]
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
    return _lookup(operand, columns, shape)


def _dynamic_slice(operand: _CapturedRef, starts, params: dict[str, Any]):
    sizes = params["slice_sizes"]
    dims = operand.ref.shape
    index = tuple(pl.ds(jnp.clip(s, 0, d - z), z) for s, d, z in zip(starts, dims, sizes))
    return operand.ref[index]


def _rewrite(primitive, operands: list[Any], params: dict[str, Any], out_avals: list[Any]
             ) -> list[Any] | None:
    """jaxpr_eval's rewrite for user functions in a Triton kernel (see the module docstring)."""
    name = primitive.name
    inner = wrapped(primitive, params)
    if inner is not None:
        return evaluate(inner, *operands, rewrite=_rewrite)
    table = operands[0] if operands else None
    if isinstance(table, _CapturedRef) and name == "gather":
        return [_gather(table, operands[1], params, out_avals[0].shape)]
    if isinstance(table, _CapturedRef) and name == "dynamic_slice":
        return [_dynamic_slice(table, operands[1:], params)]
    deferred = any(isinstance(x, Deferred) for x in operands)
    if name == "broadcast_in_dim" and not deferred and _is_trailing_unit(table, params):
        return [_IndexColumns((table,))]
    if (name == "concatenate" and all(isinstance(x, _IndexColumns) for x in operands)
            and params["dimension"] == len(out_avals[0].shape) - 1):
        return [_IndexColumns(tuple(c for x in operands for c in x.columns))]
    if deferred:
        return bind(primitive, [_materialize(x) for x in operands], params)
    return None


def call_in_kernel(fn: TracedFunction, capture_refs: Sequence[Any], *args: Any) -> list[Any]:
    """The outputs of a traced user function in a kernel body, its captures given as refs
    (`capture_refs`: the shared capture list's, by slot)."""
    refs = [_CapturedRef(ref) for ref in capture_refs]
    return [_materialize(x) for x in fn(refs, *args, rewrite=_rewrite)]
