"""User functions (GEMM epilogues, attention mods) with their captured arrays made explicit.

A Pallas kernel may not close over arrays, and `jax.custom_vjp` cannot differentiate arrays that
its function closes over. So each user function is traced to a jaxpr at the exact shapes it will
see (a kernel tile, or a whole matrix for the XLA path), and every array it captures becomes an
explicit argument: a kernel input and a differentiable input of the custom_vjp.
`jax.closure_convert` is not enough: it hoists only float arrays and fixes the example shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jattn._src.compat import jaxpr_and_consts, with_consts
from jattn._src.jaxpr_eval import Rewrite, evaluate


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: usable as a static option
class TracedFunction:
    """A user function traced at fixed argument shapes.

    `capture_slots[i]` is the position, in the capture list shared by all traces of the same
    function, of the i-th array the function captured.
    """

    closed_jaxpr: Any
    capture_slots: tuple[int, ...]

    @property
    def out_avals(self) -> list[jax.core.ShapedArray]:
        return list(self.closed_jaxpr.out_avals)

    @functools.cached_property  # (printing a jaxpr costs ~1 ms; keys are asked on every call)
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What the traced computation is, without the captured arrays' values: the jaxpr's
        text (its constants are typed inputs; Python scalars it read appear as literals) and
        which captures it reads. Equal keys compute the same function of the captures."""
        return str(jaxpr_and_consts(self.closed_jaxpr)[0]), self.capture_slots

    def without_captures(self) -> TracedFunction:
        """This function holding no captured arrays (a cached program must not keep a call's
        arrays, or tracers, alive): they come from each call's capture list anyway."""
        n = len(self.capture_slots)
        return TracedFunction(with_consts(self.closed_jaxpr, [None] * n), self.capture_slots)

    def __call__(self, captures: Sequence[Any], *args: Any, rewrite: Rewrite | None = None
                 ) -> list[Any]:
        """The outputs at `args`, reading `captures` (the shared capture list); `rewrite`:
        as jaxpr_eval.evaluate's."""
        consts = [captures[slot] for slot in self.capture_slots]
        return evaluate(with_consts(self.closed_jaxpr, consts), *args, rewrite=rewrite)


class CaptureSet:
    """Traces user functions so that they share one list of captured arrays.

    Captured arrays are matched by identity, so a bias table closed over by two functions (or
    by one function traced at several shapes) appears once in `captures`. `known`: arrays the
    caller knows the functions read, given the first slots in this order (so that results per
    capture come back in the caller's order).
    """

    def __init__(self, known: Sequence[Any] = ()):
        self.captures: list[Any] = list(known)
        self._slot_of: dict[int, int] = {}
        for slot, array in enumerate(known):
            self._slot_of.setdefault(id(array), slot)

    def trace(self, fn: Callable[..., Any],
              signature: Sequence[jax.ShapeDtypeStruct]) -> TracedFunction:
        # A fresh function each time: make_jaxpr caches traces by function, and what `fn`
        # computes may have changed since (a rebound global it reads).
        closed = jax.make_jaxpr(lambda *args: fn(*args))(*signature)
        slots = []
        for const in closed.consts:
            if id(const) not in self._slot_of:
                self._slot_of[id(const)] = len(self.captures)
                self.captures.append(const)
            slots.append(self._slot_of[id(const)])
        return TracedFunction(closed, tuple(slots))


def trace_with_captures(
    fn: Callable[..., Any], *signatures: Sequence[jax.ShapeDtypeStruct]
) -> tuple[list[TracedFunction], list[Any]]:
    """Traces `fn` once per argument signature; the traces share one list of captured arrays."""
    capture_set = CaptureSet()
    traced = [capture_set.trace(fn, signature) for signature in signatures]
    return traced, capture_set.captures
