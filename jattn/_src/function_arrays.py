"""A plain Python function's arrays as pytree leaves, so that a BlockMask holding a user's
closure passes through `jax.jit` as an argument like jattn.masks' pytree mods do.

A mask_mod is usually a fresh closure per batch (`lambda b, h, q, kv: ids[b, q] == ids[b,
kv]`) or reads a global that is rebound per batch. As a pytree leaf, such a function is static
data of the BlockMask: a jitted step retraces and recompiles for every new closure and keeps
the first batch's global. `split` instead records the function as guards.read_state does (code,
Python values by value, arrays by shape and dtype, collected): functions with equal records
compute the same thing of their arrays, so the record is the static part, and
`guards.with_arrays` makes the function again around the arrays it is given (tracers inside
jit) where they sit in its closure cells, default arguments and the globals its code names,
directly, in containers and other pytrees, or through the functions it reads there
(attention-gym's mask builders nest closures). A function that reads arrays any other way
(an attribute of an object that is not a pytree) is not split: it stays a static leaf, as any
function passed through jax.jit.
"""

from __future__ import annotations

import types
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from jattn._src import guards
from jattn._src.programs import ProgramCache


class Skeleton:
    """A function without its arrays: compares by record (equal records compute the same
    function of the arrays), and rebuilds the function around new arrays."""

    def __init__(self, record: Hashable, function: types.FunctionType, n_arrays: int):
        self.record, self.function, self.n_arrays = record, function, n_arrays

    def __eq__(self, other) -> bool:
        return isinstance(other, Skeleton) and self.record == other.record

    def __hash__(self) -> int:
        return hash(self.record)

    def rebuild(self, arrays) -> types.FunctionType:
        """The function, reading `arrays` (in `split`'s order) where it read its own."""
        if not self.n_arrays:
            return self.function
        return guards.with_arrays(self.function, list(arrays))


def split(value: Any, signature: Sequence[jax.ShapeDtypeStruct]
          ) -> tuple[Skeleton, list] | None:
    """(skeleton, arrays) of a plain user function that reads arrays and computes with them
    as arrays when called at `signature`, or reads none (its skeleton then compares by the
    scalars it reads: a global `W` changed between two masks is a new mask_mod, not the first
    one's under jit); None for anything else (state it cannot record, arrays read another way
    or in Python — `int(prefix)`, NumPy on a NumPy array — which needs their values: kept
    whole)."""
    if type(value) is not types.FunctionType or guards.is_library_function(value):
        return None
    # (NumPy arrays by shape and dtype: they are passed on as traced arrays, like JAX's)
    record, arrays = guards.read_state(value, numpy_by_value=False)
    if record is None:
        return None
    skeleton = Skeleton(record, value, len(arrays))
    if not arrays:
        return skeleton, []
    key = (record, tuple(signature))
    splits = _SPLITS.get(key)
    if splits is None:
        splits = _SPLITS.put(key, _rebuilds_and_traces(skeleton, arrays, signature))
    return (skeleton, arrays) if splits else None


# Whether each record's function can be rebuilt around new arrays and traces with abstract
# ones, by (record, signature): asked once per kind of function, not per call.
_SPLITS: ProgramCache[bool] = ProgramCache("function_arrays.splits")


def _rebuilds_and_traces(skeleton: Skeleton, arrays: list, signature) -> bool:
    abstract = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays]
    try:
        skeleton.rebuild(arrays)  # (every array where `rebuild` can put another)
        jax.eval_shape(lambda arrays, *args: skeleton.rebuild(arrays)(*args), abstract,
                       *signature)
    except Exception:  # noqa: BLE001  (any failure: the function stays whole, as before)
        return False
    return True
