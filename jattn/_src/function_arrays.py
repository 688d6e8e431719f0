"""A plain Python function's arrays as pytree leaves, so that a BlockMask holding a user's
closure passes through `jax.jit` as an argument like jattn.masks' pytree mods do.

A mask_mod is usually a fresh closure per batch (`lambda b, h, q, kv: ids[b, q] == ids[b,
kv]`) or reads a global that is rebound per batch. As a pytree leaf, such a function is static
data of the BlockMask: a jitted step retraces and recompiles for every new closure and keeps
the first batch's global. `split` instead finds the arrays the function reads — in its closure
cells, default arguments and the globals its code names, directly, in containers and other
pytrees, or through the functions it reads there (attention-gym's mask builders nest
closures) — and records everything else as guards.read_state does (code, Python values by
value). Functions with equal records compute the same thing of their arrays, so the record is
the static part and `Skeleton.rebuild` makes the function again around the arrays it is given
(tracers inside jit). A function that reads arrays any other way (an attribute of an object
that is not a pytree) is not split: it stays a static leaf, as any function passed through
jax.jit.
"""

from __future__ import annotations

import types
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from jattn._src import guards
from jattn._src.programs import ProgramCache

_ARRAY_TYPES = (jax.Array, np.ndarray)


class _Unsplittable(Exception):
    """The function reads arrays in a way `rebuild` cannot substitute."""


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
        arrays = iter(arrays)
        return _rebuilt(self.function, arrays)


def split(value: Any, signature: Sequence[jax.ShapeDtypeStruct]
          ) -> tuple[Skeleton, list] | None:
    """(skeleton, arrays) of a plain user function that reads arrays and computes with them
    as arrays when called at `signature`; None for anything else (no arrays read: nothing to
    gain; read another way, or read in Python — `int(prefix)`, NumPy on a NumPy array —
    which needs their values: kept whole)."""
    if type(value) is not types.FunctionType or guards.is_library_function(value):
        return None
    arrays: list = []
    try:
        record = _record(value, arrays, set())
        hash(record)
    except (_Unsplittable, RecursionError, TypeError):
        return None
    if not arrays:
        return None
    skeleton = Skeleton(record, value, len(arrays))
    key = (record, tuple(signature))
    traces = _TRACES_ABSTRACTLY.get(key)
    if traces is None:
        traces = _TRACES_ABSTRACTLY.put(key, _traces_abstractly(skeleton, arrays, signature))
    return (skeleton, arrays) if traces else None


# Whether each record's function traces with abstract arrays, by (record, signature): asked
# once per kind of function, not per call.
_TRACES_ABSTRACTLY: ProgramCache[bool] = ProgramCache("function_arrays.traces_abstractly")


def _traces_abstractly(skeleton: Skeleton, arrays: list, signature) -> bool:
    abstract = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays]
    try:
        jax.eval_shape(lambda arrays, *args: skeleton.rebuild(arrays)(*args), abstract,
                       *signature)
    except Exception:  # noqa: BLE001  (any failure: the function stays whole, as before)
        return False
    return True


def _record(fn: types.FunctionType, arrays: list, active: set) -> Hashable:
    if id(fn) in active:
        raise _Unsplittable  # (a function reading itself: kept whole)
    active.add(id(fn))
    cells = tuple(_value(guards.cell_contents(c), arrays, active) for c in fn.__closure__ or ())
    defaults = tuple(_value(v, arrays, active) for v in fn.__defaults__ or ())
    code_names = guards.global_names(fn.__code__)
    names = sorted(n for n in code_names if n in fn.__globals__)
    globals_ = tuple((n, _value(fn.__globals__[n], arrays, active, code_names))
                     for n in names)
    rest = guards.read_state(fn.__kwdefaults__, fn.__dict__ or None)
    if rest.record is None or rest.arrays:
        raise _Unsplittable
    active.discard(id(fn))
    return ("function", fn.__code__, cells, defaults, globals_, rest.record)


def _value(value: Any, arrays: list, active: set, code_names=None) -> Hashable:
    """The record of a value a function reads (a global if code_names: the names its code
    looks up, for the attributes of a user module it reads)."""
    if isinstance(value, _ARRAY_TYPES):
        arrays.append(value)
        return ("array", value.shape, value.dtype, getattr(value, "weak_type", False))
    if type(value) is types.FunctionType and not guards.is_library_function(value):
        return _record(value, arrays, active)
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if not (len(leaves) == 1 and leaves[0] is value):  # a container or other pytree node
        return ("pytree", treedef, tuple(_value(x, arrays, active) for x in leaves))
    state = (guards.read_state(value) if code_names is None
             else guards.read_global(value, code_names))
    if state.record is None or state.arrays:
        raise _Unsplittable
    return state.record


def _rebuilt(fn: types.FunctionType, arrays) -> types.FunctionType:
    """fn with the arrays it reads (in `_record`'s order) taken from `arrays`."""
    contents = [guards.cell_contents(c) for c in fn.__closure__ or ()]
    closure = tuple(types.CellType() if value is guards.EMPTY_CELL
                    else types.CellType(_substituted(value, arrays)) for value in contents)
    defaults = tuple(_substituted(v, arrays) for v in fn.__defaults__ or ())
    namespace = fn.__globals__
    names = sorted(n for n in guards.global_names(fn.__code__) if n in namespace)
    replaced = {n: _substituted(namespace[n], arrays) for n in names}
    if any(replaced[n] is not namespace[n] for n in names):
        namespace = {**namespace, **replaced}  # (a copy: the module's globals stay as they are)
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, defaults or None,
                             closure or None)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    return new


def _substituted(value: Any, arrays) -> Any:
    if isinstance(value, _ARRAY_TYPES):
        return next(arrays)
    if type(value) is types.FunctionType and not guards.is_library_function(value):
        return _rebuilt(value, arrays)
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if not (len(leaves) == 1 and leaves[0] is value):
        return treedef.unflatten([_substituted(x, arrays) for x in leaves])
    return value
