"""A JAX program that is one Pallas kernel, launched without JAX on buffers and a stream the
caller owns.

Where a program's whole computation is a single pallas_call (custom_vjp and jit wrappers
aside) whose kernel the `triton` package compiles (`compiler="triton"`, see
`pallas_triton.compile`), the compiled kernel JAX launches through XLA can be launched by
Triton's own launcher instead: no JAX dispatch, no buffers to import or export, no stream to
synchronise. interop's eager torch ops use this; it costs a few microseconds of host time
against JAX's 40-70 per call (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from jattn._src.compat import jaxpr_and_consts
from jattn._src.jaxpr_eval import wrapped
from jattn._src.pallas_triton.compile import recording_kernels

_DIVISIBILITY = re.compile(r"tt\.divisibility = (\d+)")  # a pointer's assumed alignment
# A compiled kernel -> the GPU index whose context Triton loaded it into (the kernels live in
# pallas_triton.compile's cache anyway).
_LOADED_ON: dict[object, int] = {}


class KernelLaunch:
    """How to run a program as its one kernel.

    operands: for each kernel input in order, the index of the program argument it is.
    outputs: (shape, dtype) of each kernel output, which the caller allocates.
    results: for each program result, the index of the kernel output it is.
    alignment: the byte alignment the kernel assumes of every buffer address.
    """

    def __init__(self, operands, outputs, results, kernel, grid):
        self.operands: tuple[int, ...] = operands
        self.outputs: tuple[tuple[tuple[int, ...], np.dtype], ...] = outputs
        self.results: tuple[int, ...] = results
        # Pallas declares every pointer argument divisible by some bytes (jax 0.10: 32).
        self.alignment = max(map(int, _DIVISIBILITY.findall(kernel.asm["ttir"])), default=1)
        self._kernel, self._grid, self._run = kernel, grid, None

    def __call__(self, operands: Sequence[int], outputs: Sequence[int], stream: int,
                 device: int) -> bool:
        """Queues the kernel on `stream` (a CUDA stream handle, 0 the legacy default) of GPU
        `device`, which must be the current one, reading the buffers at the addresses
        `operands` (in `self.operands` order) and writing those at `outputs`. False, and
        nothing queued, where the kernel is loaded on another GPU (Triton loads a compiled
        kernel into one context: the first device it is launched on)."""
        run = self._run
        if run is None:
            kernel = self._kernel
            if _LOADED_ON.setdefault(kernel, device) != device:
                return False
            run = self._run = functools.partial(kernel.run, *self._grid)
            self._bound = (kernel.function, kernel.packed_metadata, None, None, None)
        elif _LOADED_ON[self._kernel] != device:
            return False
        run(stream, *self._bound, *operands, *outputs)
        return True


def single_kernel_launch(fn: Callable, *args: jax.ShapeDtypeStruct) -> KernelLaunch | None:
    """The launch of `fn(*args)` as its one kernel, or None where the program is not exactly
    one pallas_call on its own arguments compiled by the `triton` package (then only JAX can
    run it). Errors of tracing `fn` propagate. Call on a machine with a CUDA GPU."""
    closed = jax.make_jaxpr(fn)(*args)
    equations, results = _inlined(closed)
    if len(equations) != 1 or equations[0].primitive.name != "pallas_call":
        return None
    [call] = equations
    arguments = {var: i for i, var in enumerate(jaxpr_and_consts(closed)[0].invars)}
    if (call.params.get("input_output_aliases")
            or not all(isinstance(v, jex_core.Var) and v in arguments for v in call.invars)
            or not all(isinstance(v, jex_core.Var) and v in call.outvars for v in results)):
        return None
    with recording_kernels() as kernels:
        jax.jit(lambda *xs: call.primitive.bind(*xs, **call.params)).trace(
            *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in call.invars)
        ).lower(lowering_platforms=("cuda",))
    if len(kernels) != 1:
        return None  # compiled by XLA's Triton: only JAX launches it
    [(kernel, grid)] = kernels
    return KernelLaunch(
        operands=tuple(arguments[v] for v in call.invars),
        outputs=tuple((tuple(v.aval.shape), np.dtype(v.aval.dtype)) for v in call.outvars),
        results=tuple(call.outvars.index(v) for v in results), kernel=kernel, grid=grid)


_CONSTANT = object()  # stands for a jaxpr constant: no argument of the program


def _inlined(closed) -> tuple[list, list]:
    """The live equations of `closed` with wrapper primitives (jit, custom_vjp, ...) replaced
    by their bodies, in terms of its own argument variables (constants become `_CONSTANT`),
    and its results in those terms."""
    equations, rename = [], {}

    def atom(x):
        return rename.get(x, x) if isinstance(x, jex_core.Var) else x

    def walk(inner, inputs: list) -> list:
        inner = jaxpr_and_consts(inner)[0]
        rename.update(dict.fromkeys(inner.constvars, _CONSTANT))
        rename.update(zip(inner.invars, inputs))
        for eqn in inner.eqns:
            body = wrapped(eqn.primitive, eqn.params)
            if body is None:
                equations.append(eqn.replace(invars=[atom(x) for x in eqn.invars]))
            else:
                rename.update(zip(eqn.outvars, walk(body, [atom(x) for x in eqn.invars])))
        return [atom(x) for x in inner.outvars]

    results = walk(closed, list(jaxpr_and_consts(closed)[0].invars))
    needed, live = {x for x in results if isinstance(x, jex_core.Var)}, []
    for eqn in reversed(equations):  # dead code (e.g. placeholders nothing reads) dropped
        if eqn.effects or not needed.isdisjoint(eqn.outvars):
            live.append(eqn)
            needed.update(x for x in eqn.invars if isinstance(x, jex_core.Var))
    return live[::-1], results
