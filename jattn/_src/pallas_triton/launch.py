"""A JAX program made of Pallas kernels, launched without JAX on buffers and a stream the
caller owns.

Where a program's computation is pallas_calls (custom_jvp, custom_vjp and jit wrappers aside)
whose kernels the `triton` package compiles (`compiler="triton"`, see `pallas_triton.compile`),
and between them only equations the caller can evaluate itself (a backward's elementwise
prologue, say), the compiled kernels JAX launches through XLA can be launched by Triton's own
launcher instead: no JAX dispatch, no buffers to import or export, no stream to synchronise.
interop's eager torch ops use this; a kernel costs a few microseconds of host time against JAX's
40-70 per call (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

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
    """How to launch one compiled kernel.

    outputs: (shape, dtype) of each kernel output, which the caller allocates.
    alignment: the byte alignment the kernel assumes of every buffer address.
    """

    def __init__(self, outputs, kernel, grid):
        self.outputs: tuple[tuple[tuple[int, ...], np.dtype], ...] = outputs
        # Pallas declares every pointer argument divisible by some bytes (jax 0.10: 32).
        self.alignment = max(map(int, _DIVISIBILITY.findall(kernel.asm["ttir"])), default=1)
        self._kernel, self._grid, self._run = kernel, grid, None

    def __call__(self, operands: Sequence[int], outputs: Sequence[int], stream: int,
                 device: int) -> bool:
        """Queues the kernel on `stream` (a CUDA stream handle, 0 the legacy default) of GPU
        `device`, which must be the current one, reading the buffers at the addresses
        `operands` (the kernel's inputs in order) and writing those at `outputs`. False, and
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


@dataclasses.dataclass(frozen=True)
class Constant:
    """A literal operand of a step: a Python scalar."""

    value: Any


@dataclasses.dataclass(frozen=True, eq=False)
class ConstantArray:
    """An array the program holds as a constant (a dense call's BlockMask lists, say): a
    numpy array, which the caller moves to its device once; None where its value is not
    known."""

    value: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One equation of a KernelProgram: reads `inputs` (slot numbers or constants) and writes
    the slots `outputs`. A kernel has its `launch`; any other equation is the caller's to
    evaluate: `name` (the primitive's), `params` and the outputs' (shape, dtype)."""

    inputs: tuple[int | Constant | ConstantArray, ...]
    outputs: tuple[int, ...]
    launch: KernelLaunch | None = None
    name: str = ""
    params: dict = dataclasses.field(default_factory=dict)
    avals: tuple[tuple[tuple[int, ...], np.dtype], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class KernelProgram:
    """A program as steps run in order: slots 0 .. n-1 hold its n arguments, each step's
    outputs the next free slots; `results` are the slots it returns."""

    steps: tuple[Step, ...]
    results: tuple[int, ...]
    slots: int


# (primitive name, params, the operands' (shape, dtype)) -> whether the caller evaluates it
Evaluable = Callable[[str, dict, list], bool]


def kernel_program(fn: Callable, *args: jax.ShapeDtypeStruct,
                   evaluable: Evaluable = lambda *_: False) -> KernelProgram | None:
    """`fn(*args)` as a KernelProgram, or None where it holds anything else than pallas_calls
    on its own values compiled by the `triton` package and equations `evaluable` accepts
    (then only JAX can run it); the default accepts none: one kernel on the arguments, or
    None. Errors of tracing `fn` propagate. Call on a machine with a CUDA GPU."""
    closed = jax.make_jaxpr(lambda *a: fn(*a))(*args)  # (not make_jaxpr's cache: by identity)
    equations, results = _inlined(closed)
    slots = {var: i for i, var in enumerate(jaxpr_and_consts(closed)[0].invars)}

    def operand(x):
        if isinstance(x, jex_core.Literal):
            return Constant(np.asarray(x.val).item())
        if isinstance(x, ConstantArray):
            return None if x.value is None else ConstantArray(np.asarray(x.value))
        return slots[x]

    steps = []
    for eqn in equations:
        inputs = tuple(operand(x) for x in eqn.invars)
        if None in inputs:
            return None
        if eqn.primitive.name == "pallas_call":
            launch = _kernel_launch(eqn)
            if launch is None or any(isinstance(x, Constant) for x in inputs):
                return None
            step = Step(inputs, (), launch)
        elif evaluable(eqn.primitive.name, eqn.params, [_shape_dtype(x) for x in eqn.invars]):
            step = Step(inputs, (), name=eqn.primitive.name, params=dict(eqn.params),
                        avals=tuple(_shape_dtype(x) for x in eqn.outvars))
        else:
            return None
        first = len(slots)
        slots.update((var, first + i) for i, var in enumerate(eqn.outvars))
        steps.append(dataclasses.replace(step, outputs=tuple(range(first, len(slots)))))
    results = tuple(operand(x) for x in results)
    if not all(isinstance(x, int) for x in results):
        return None
    return KernelProgram(tuple(steps), results, len(slots))


def _shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
    """Of a jaxpr variable or literal, or of a ConstantArray (its value known)."""
    aval = x.value if isinstance(x, ConstantArray) else x.aval
    return tuple(aval.shape), np.dtype(aval.dtype)


def _kernel_launch(call) -> KernelLaunch | None:
    """The launch of one pallas_call equation's kernel, or None where `triton` does not
    compile it (XLA's Triton does) or it writes into its inputs."""
    if call.params.get("input_output_aliases"):
        return None
    with recording_kernels() as kernels:
        jax.jit(lambda *xs: call.primitive.bind(*xs, **call.params)).trace(
            *(jax.ShapeDtypeStruct(*_shape_dtype(v)) for v in call.invars)
        ).lower(lowering_platforms=("cuda",))
    if len(kernels) != 1:
        return None
    [(kernel, grid)] = kernels
    return KernelLaunch(tuple(_shape_dtype(v) for v in call.outvars), kernel, grid)


def _inlined(closed) -> tuple[list, list]:
    """The live equations of `closed` with wrapper primitives (jit, custom_vjp, ...) replaced
    by their bodies, in terms of its own argument variables (constant arrays become
    `ConstantArray`s), and its results in those terms."""
    equations, rename = [], {}

    def atom(x):
        return rename.get(x, x) if isinstance(x, jex_core.Var) else x

    def walk(inner, inputs: list) -> list:
        inner, consts = jaxpr_and_consts(inner)
        rename.update(zip(inner.constvars, map(ConstantArray, consts)))
        rename.update(dict.fromkeys(inner.constvars[len(consts):], ConstantArray(None)))
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
