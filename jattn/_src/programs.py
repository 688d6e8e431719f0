"""Compiled programs reused across calls, so that an eager call neither traces nor compiles twice.

An op's program is keyed on everything it depends on besides its array arguments: shapes,
dtypes, static options, the implementation and its config, and each traced user function's
`TracedFunction.key` (a changed Python scalar in a mod changes its jaxpr, so it gets a program
of its own; new values of captured arrays are arguments and reuse it). The cache is a bounded
LRU: an evicted program's executables are freed with it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import jax

from jattn._src.mesh_axes import mesh_key
from jattn._src.user_functions import TracedFunction

Program = TypeVar("Program")

# Distinct programs kept per op: a model calls an op at a handful of shapes and mods.
MAX_PROGRAMS = 256


# Every cache jattn (and its torch bridge) keeps, by name: `clear_caches` empties them all.
_CACHES: dict[str, Callable[[], None]] = {}


def register_cache(name: str, clear: Callable[[], None]) -> None:
    """Lists a cache (its `clear`) among those `clear_caches` empties."""
    _CACHES[name] = clear


def clear_caches() -> None:
    """Empties every cache jattn keeps: compiled programs, call plans, translated torch mods,
    tuning results read from disk. Later calls trace and compile again. (JAX's own caches
    are `jax.clear_caches()`'s.)

    Example::

        q = jnp.ones((1, 2, 64, 16))
        jattn.flex_attention(q, q, q)  # compiles a program, plans the call
        jattn.clear_caches()           # frees them
        print(jattn.flex_attention(q, q, q).shape)  # (1, 2, 64, 16), compiled again
    """
    for clear in list(_CACHES.values()):
        clear()


def cache_names() -> list[str]:
    """The registered caches' names (for tests and debugging)."""
    return sorted(_CACHES)


class ProgramCache(Generic[Program]):
    """key -> program; the least recently used beyond `maxsize` are dropped. Thread-safe: two
    threads that make the same program both get the one stored first. Registered under `name`
    for `clear_caches`. Keys are kept per mesh (`mesh_key`): what is traced inside shard_map
    is typed by its mesh, and a program holding such traces runs only under that mesh."""

    def __init__(self, name: str, maxsize: int = MAX_PROGRAMS):
        self._programs: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
        self._maxsize = maxsize
        self._lock = threading.Lock()
        register_cache(name, self.clear)

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: Hashable) -> Program | None:
        # Without the lock (on every eager call's path): the dict's own operations are atomic,
        # and a key another thread evicts meanwhile is simply not reordered.
        key = (mesh_key(), key)
        program = self._programs.get(key)
        if program is not None:
            try:
                self._programs.move_to_end(key)
            except KeyError:
                pass
        return program

    def put(self, key: Hashable, program: Program) -> Program:
        """Stores `program` unless one is stored under `key` already; returns the stored one."""
        key = (mesh_key(), key)
        with self._lock:
            program = self._programs.setdefault(key, program)
            self._programs.move_to_end(key)
            while len(self._programs) > self._maxsize:
                self._programs.popitem(last=False)
            return program

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()


def static_key(options: Any) -> tuple:
    """A static-options dataclass as a key: its fields, each traced user function by what it
    computes (`TracedFunction.key`) rather than by identity."""
    return tuple(value.key if isinstance(value, TracedFunction) else value
                 for value in (getattr(options, f.name) for f in dataclasses.fields(options)))


def _without_captures(options: Any) -> Any:
    return dataclasses.replace(options, **{
        f.name: getattr(options, f.name).without_captures() for f in dataclasses.fields(options)
        if isinstance(getattr(options, f.name), TracedFunction)})


_JITTED: ProgramCache[Callable[..., Any]] = ProgramCache("programs.jitted")


def jitted(fn: Callable[..., Any], options: Any, *static: Hashable) -> Callable[..., Any]:
    """jax.jit(partial(fn, options, *static)), made once per (fn, static_key(options), static):
    an eager call with options equal in everything but the user functions' captured arrays
    (which are fn's arguments) reuses the compiled program."""
    key = (fn, static_key(options), static)
    program = _JITTED.get(key)
    if program is None:
        program = _JITTED.put(key, jax.jit(functools.partial(fn, _without_captures(options),
                                                             *static)))
    return program
