"""Guards: what a user function reads besides array values, recorded cheaply on every call.

A mod or epilogue is usually a fresh closure every call, and what it computes can change
without its code changing (a rebound global, a new scalar in a closure). Tracing it tells
exactly what it computes, but costs milliseconds. `read_state` instead walks what the function
can read — its code, closure cells, default arguments and attributes, the globals its code
names (and, in a user module, the attributes its code names, through submodules), a partial's
arguments, a bound method's object, pytree nodes, dataclass attributes, a user class's plain
class values, and containers — and records every Python value by value, every function by its
code, every array by shape, dtype and weak type. The arrays themselves are collected in walk
order. Equal records mean the function computes the same thing of those arrays, so a
call plan stored under the record (`jattn._src.programs`) is reused without tracing, with the
arrays read from this call's function.

A value the walk cannot record — an object of no known structure, a structure past
`MAX_VALUES` values — gives no record: such calls trace every time, never reuse a stale plan.
One array read through two names is recorded as one, so a call where they are two arrays
does not reuse its plan. Values a function reads from JAX arrays in Python while it is traced
(`int(ids[0])`) are, as under `jax.jit`, taken when it is traced. NumPy arrays are recorded by
value (a hash of their bytes), so what a function computes from them in Python (`temps[0]`,
`table.T`) belongs to the record: a plan is reused only where they hold the same values.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np

# Values one record may hold: a closure over a model object is not walked whole every call.
MAX_VALUES = 512

# Modules whose functions and objects are library code (these and the standard library):
# recorded by identity, never walked.
_LIBRARY_MODULES = ("jax", "jaxlib", "numpy", "math", "builtins", "functools", "operator",
                    "jattn", "typing", "collections", "enum", "dataclasses", "torch")


class _Unrecordable(Exception):
    """A value the walk cannot record."""


class State(NamedTuple):
    """What some user functions read: `record` (hashable; None when some value cannot be
    recorded) and the arrays they can read, in walk order."""

    record: Hashable | None
    arrays: list


def read_state(*fns: Any, numpy_by_value: bool = True) -> State:
    """The State of `fns` (None entries allowed). numpy_by_value=False records NumPy arrays by
    shape and dtype, as JAX arrays (for a caller that passes every array on as a traced
    argument, so that no value of theirs is read in Python)."""
    walker = _Walker(numpy_by_value)
    return _state(walker, lambda: tuple(walker.walk(fn) for fn in fns))


def read_global(value: Any, names: frozenset[str]) -> State:
    """The State of a global that code naming `names` reads (of a user module: the attributes
    it names, as a function's walk records them)."""
    walker = _Walker()
    return _state(walker, lambda: walker.global_value(value, names))


def _state(walker: _Walker, record: Callable[[], Hashable]) -> State:
    """The State of what `record()` walks with `walker`: no record where a value cannot be
    recorded or the record does not hash (a pytree's static data, say)."""
    try:
        recorded = record()
        hash(recorded)
    except (_Unrecordable, RecursionError, TypeError):
        return State(None, walker.arrays)
    return State(recorded, walker.arrays)


def is_library_function(fn: types.FunctionType) -> bool:
    """Library code, recorded by identity (jattn's own functions are walked as users' are)."""
    return _is_library(fn) and not fn.__module__.startswith("jattn")


def _is_library(value: Any) -> bool:
    return _is_library_module(getattr(value, "__module__", None) or "")


@functools.lru_cache(maxsize=1024)
def _is_library_module(module: str) -> bool:
    top = module.split(".")[0]
    return top in _LIBRARY_MODULES or top in sys.stdlib_module_names  # (contextlib, abc, ...)


class _Walker:
    def __init__(self, numpy_by_value: bool = True):
        self.numpy_by_value = numpy_by_value
        self.arrays: list = []
        self.positions: dict[int, int] = {}  # id of each array in `arrays` -> its position
        self.count = 0
        self.active: set[int] = set()  # functions being walked: recursion ends there

    def walk(self, value: Any) -> Hashable:
        self.count += 1
        if self.count > MAX_VALUES:
            raise _Unrecordable
        kind = type(value)
        if value is None or kind in (bool, int, str, bytes):
            return (kind, value)
        if kind is float:
            return (float, value.hex())  # -0.0 and NaN recorded as they are
        if kind is types.FunctionType:  # jattn's own closures are walked too
            return _identity(value) if is_library_function(value) else self._function(value)
        if isinstance(value, (jax.Array, np.ndarray)):
            # One array read through two names (two parameters made from one zeros array) is
            # recorded as the same array: a later call where they differ must not reuse a
            # plan that reads them as one.
            seen = self.positions.setdefault(id(value), len(self.arrays))
            if seen < len(self.arrays):
                return ("same array", seen)
            self.arrays.append(value)
            if self.numpy_by_value and isinstance(value, np.ndarray):
                return _numpy_record(value)
            return ("array", value.shape, value.dtype, getattr(value, "weak_type", False))
        if isinstance(value, np.generic):
            return ("scalar", value.dtype, value.tobytes())
        if kind in (tuple, list):
            return (kind, tuple(self.walk(x) for x in value))
        if kind is dict:
            return (dict, tuple((self.walk(k), self.walk(v)) for k, v in value.items()))
        if isinstance(value, functools.partial):
            return ("partial", self.walk(value.func), self.walk(value.args),
                    self.walk(value.keywords))
        if isinstance(value, types.MethodType):
            return ("method", self.walk(value.__func__), self.walk(value.__self__))
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        if isinstance(value, type):
            return _identity(value) if _is_library(value) else self._class(value)
        if isinstance(value, enum.Enum):
            return _identity(value)
        return self._structure(value)

    def _class(self, cls: type) -> Hashable:
        """A user class: itself, and the plain values its body and its user bases set
        (`Config.BIAS`), which its methods and instances may read."""
        values = []
        for klass in cls.__mro__:
            if klass is object or _is_library(klass):
                continue
            for name, value in vars(klass).items():
                if not (name.startswith("__") or callable(value) or isinstance(
                        value, (property, classmethod, staticmethod, types.MemberDescriptorType,
                                types.GetSetDescriptorType))):
                    values.append((klass.__qualname__, name, self.walk(value)))
        return ("class", _identity(cls), tuple(values))

    def _function(self, fn: types.FunctionType) -> Hashable:
        # (on every eager call's path: absent parts are not walked.) The parts in the order
        # `with_arrays` rebuilds them: cells, globals, defaults, keyword defaults, attributes.
        if id(fn) in self.active:
            return ("recursive", fn.__code__)
        self.active.add(id(fn))
        try:
            code, closure, defaults, kwdefaults = (fn.__code__, fn.__closure__, fn.__defaults__,
                                                   fn.__kwdefaults__)
            cells = tuple([self.walk(cell_contents(c)) for c in closure]) if closure else ()
            names = global_names(code)
            globals_ = ()
            if names:
                namespace = fn.__globals__
                globals_ = tuple([(name, self.global_value(namespace[name], names))
                                  for name in names if name in namespace])
            defaults = None if defaults is None else self.walk(defaults)
            kwdefaults = None if kwdefaults is None else self.walk(kwdefaults)
            attributes = fn.__dict__  # (`mod.bias = ...`)
            return ("function", code, defaults, kwdefaults, cells, globals_,
                    self.walk(attributes) if attributes else None)
        finally:
            self.active.discard(id(fn))

    def global_value(self, value: Any, names: frozenset[str]) -> Hashable:
        """A global the code names; of a user module, the attributes the code names too
        (`config.WINDOW` reads `config`'s WINDOW; `package.config.WINDOW` through a
        submodule)."""
        if isinstance(value, types.ModuleType) and not _is_library_module(value.__name__):
            self.count += 1
            if self.count > MAX_VALUES:
                raise _Unrecordable
            return ("module", value.__name__, tuple(
                (name, self.global_value(getattr(value, name), names)) for name in sorted(names)
                if hasattr(value, name) and getattr(value, name) is not value))
        return self.walk(value)

    def _structure(self, value: Any) -> Hashable:
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if not (len(leaves) == 1 and leaves[0] is value):  # a registered pytree node
            return ("pytree", treedef, tuple(self.walk(x) for x in leaves))
        if _is_library(value):
            return _identity(value)  # library code (jnp's ufuncs, ...)
        guarded = getattr(value, "guard_record", None)
        if callable(guarded):  # an object that states what it computes (a translated mod)
            return ("stated", guarded())
        if dataclasses.is_dataclass(value):  # every attribute, and the class's own values
            state = vars(value) if hasattr(value, "__dict__") else {
                f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return ("dataclass", self.walk(type(value)), self.walk(dict(state)))
        if isinstance(value, types.SimpleNamespace):
            return ("namespace", self.walk(vars(value)))
        raise _Unrecordable


def with_arrays(value: Any, arrays: list) -> Any:
    """`value` reading `arrays` where it read the arrays `read_state` found in it (in their
    walk order; one array read through two names stays one): user functions are made again
    around them (their code, with new cells, defaults and, where a global changes, a copy of
    their globals), containers and pytrees unflattened. Raises ValueError where an array sits
    elsewhere (a dataclass, a partial, a module, a function's attributes), where a function
    reads itself, or where the arrays' count differs."""
    substitutes = iter(arrays)
    rebuilt = _Rebuild(substitutes).value(value)
    if next(substitutes, _NONE_LEFT) is not _NONE_LEFT:
        raise ValueError("arrays left over: the value reads fewer arrays than given")
    return rebuilt


_NONE_LEFT = object()  # (the substitutes may be anything, None included: jax.tree.map's)


class _Rebuild:
    """`with_arrays`' walk, in `_Walker`'s order over the parts it can make again."""

    def __init__(self, substitutes):
        self.substitutes = substitutes
        self.done: dict[int, Any] = {}  # id of each original array -> its substitute
        self.active: set[int] = set()

    def value(self, value: Any) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str, bytes, float):
            return value
        if kind is types.FunctionType:
            return value if is_library_function(value) else self._function(value)
        if isinstance(value, (jax.Array, np.ndarray)):
            if id(value) not in self.done:
                substitute = next(self.substitutes, _NONE_LEFT)
                if substitute is _NONE_LEFT:
                    raise ValueError("too few arrays for the arrays the value reads")
                self.done[id(value)] = substitute
            return self.done[id(value)]
        if kind in (tuple, list):
            return kind(self.value(x) for x in value)
        if kind is dict:
            return {self._unchanged(k): self.value(v) for k, v in value.items()}
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if not (len(leaves) == 1 and leaves[0] is value):  # a registered pytree node
            return treedef.unflatten([self.value(x) for x in leaves])
        return self._unchanged(value)

    @staticmethod
    def _unchanged(value: Any, state: State | None = None) -> Any:
        """A value kept as it is: the walk must find no array in it."""
        if (state or read_state(value)).arrays:
            raise ValueError(f"an array read through a {type(value).__name__} cannot be "
                             "substituted")
        return value

    def _function(self, fn: types.FunctionType) -> types.FunctionType:
        if id(fn) in self.active:
            raise ValueError(f"{fn.__qualname__} reads itself")
        self.active.add(id(fn))
        closure = tuple(types.CellType() if (contents := cell_contents(c)) is EMPTY_CELL
                        else types.CellType(self.value(contents))
                        for c in fn.__closure__ or ())
        namespace = fn.__globals__
        names = global_names(fn.__code__)
        replaced = {name: self._global(namespace[name], names) for name in names
                    if name in namespace}
        if any(new is not namespace[name] for name, new in replaced.items()):
            namespace = {**namespace, **replaced}  # (a copy: the module stays as it is)
        defaults = None if fn.__defaults__ is None else self.value(fn.__defaults__)
        kwdefaults = None if fn.__kwdefaults__ is None else self.value(fn.__kwdefaults__)
        if fn.__dict__:
            self._unchanged(fn.__dict__)
        new = types.FunctionType(fn.__code__, namespace, fn.__name__, defaults, closure or None)
        new.__kwdefaults__, new.__qualname__ = kwdefaults, fn.__qualname__
        new.__dict__.update(fn.__dict__)
        self.active.discard(id(fn))
        return new

    def _global(self, value: Any, names: frozenset[str]) -> Any:
        if isinstance(value, types.ModuleType):  # (the attributes `names` reads: no arrays)
            return self._unchanged(value, read_global(value, names))
        return self.value(value)


def _numpy_record(value: np.ndarray) -> Hashable:
    """A NumPy array by value (a hash of its bytes: ~0.25 ms a MB): a mod may read its values
    in Python (`temps[0]`, `table.T`), which a trace keeps as constants, and the array may be
    edited in place between calls."""
    if value.dtype.hasobject:
        raise _Unrecordable  # (its bytes are pointers)
    return ("numpy", value.shape, value.dtype, hash(value.tobytes()))


def _identity(value: Any) -> Hashable:
    """Library code, classes and enum members: recorded as themselves (by identity)."""
    try:
        hash(value)
    except TypeError:
        raise _Unrecordable from None
    return ("object", value)


def cell_contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned after the function was made)
        return EMPTY_CELL


EMPTY_CELL = ("empty cell",)


@functools.lru_cache(maxsize=4096)
def global_names(code: types.CodeType) -> frozenset[str]:
    """The names `code` and the code nested in it (lambdas, comprehensions) may look up as
    globals or attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return frozenset(names)


def fetch(sources: tuple, arrays: list) -> list:
    """Values from `sources` (`sources_of`): this call's arrays by position, fixed values
    as stored."""
    return [arrays[i] if kind == "array" else i for kind, i in sources]


def sources_of(values: list, arrays: list) -> tuple | None:
    """Where each of `values` (a trace's captured arrays) comes from on a later call: an index
    into the State's `arrays` (the same array, or JAX's wrapper of the same NumPy array), or a
    value the trace made itself (stored: a constant, or computed in Python from values the
    record holds, NumPy arrays included). None where a value is traced by an outer
    transformation (the plan would hold it past the call)."""
    index = {id(a): i for i, a in enumerate(arrays)}
    sources = []
    for value in values:
        position = index.get(id(value))
        if position is None and _wraps(value, index):
            position = index[id(value.base)]
        if position is not None:
            sources.append(("array", position))
        elif isinstance(value, jax.core.Tracer):
            return None
        else:
            sources.append(("value", value))
    return tuple(sources)


def _wraps(value: Any, index: dict[int, int]) -> bool:
    """Whether `value` is a NumPy array holding exactly one of the arrays `index` holds (its
    data, shape, strides and dtype: JAX's wrapper of a captured NumPy array), not a view of
    part of it."""
    base = getattr(value, "base", None)
    if id(base) not in index or not isinstance(value, np.ndarray):
        return False
    ours, theirs = value.__array_interface__, base.__array_interface__
    return all(ours.get(field) == theirs.get(field)
               for field in ("data", "shape", "strides", "typestr"))
