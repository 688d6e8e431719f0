"""Eager ops on CUDA tensors whose JAX program is Pallas kernels: the kernels launched on
torch's current stream, reading the tensors in place and writing torch-allocated outputs,
without JAX's dispatch, DLPack crossings or stream waits (`jattn._src.pallas_triton.launch`).

They are the kernel binaries the JAX program launches, so results are the same bits. Between
the kernels a program may hold a few elementwise and reduction equations (a backward's
prologue, a sum over a broadcast batch); torch evaluates those, in the dtypes JAX would. A
tensor a kernel cannot read in place (strided, or at an address less aligned than the kernel
assumes) is copied first, as the JAX path would copy it. A call takes this path only when every
tensor is on the current CUDA device in a dtype JAX keeps (int64 is narrowed by JAX without
x64); otherwise, and for programs holding anything else (XLA's own kernels, other equations),
the caller goes through JAX as before. Ordering is torch's own: the kernels run after the work
queued on the current stream, later work there runs after them, and the caching allocator keeps
the tensors' memory for that stream as for any torch kernel.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import jax
import numpy as np
import torch
from torch import Tensor

from ._dlpack import DTYPES
from jattn._src.bridge import Constant, ConstantArray, KernelProgram, compat, kernel_program

_TORCH_DTYPES = {np.dtype(jax_dtype): torch_dtype for torch_dtype, jax_dtype in DTYPES.items()}
_current_device, _current_stream = compat.torch_cuda_device_and_stream()
_THROUGH_JAX = object()  # a programs-table entry: this signature runs through JAX


class DirectProgram:
    """A jitted JAX program run as its kernels on torch tensors.

    program(*pack(tensors)) is the JAX call the tensors' views would be given (pack: the flat
    tensor tuple to the program's arguments). What to launch is worked out once per (shape,
    dtype) signature of the tensors.
    """

    def __init__(self, program: Callable, pack: Callable[[Sequence], tuple]):
        self._program, self._pack = program, pack
        self._programs: dict[tuple, KernelProgram | object] = {}

    def __call__(self, tensors: Sequence[Tensor]) -> list[Tensor] | None:
        """The program's results as new tensors, queued on torch's current stream, or None
        where this call must go through JAX (then nothing it needs has been queued)."""
        if not tensors[0].is_cuda:
            return None
        index = _current_device()
        key = [index]
        for t in tensors:
            if not (isinstance(t, Tensor) and t.get_device() == index):
                return None
            key += (t.shape, t.dtype)
        program = self._programs.get(key := tuple(key))
        if program is None:
            program = self._programs[key] = self._program_for(tensors)
        if program is _THROUGH_JAX:
            return None
        return _run(program, tensors, index)

    def _program_for(self, tensors: Sequence[Tensor]):
        """The KernelProgram for tensors of these shapes and dtypes, or _THROUGH_JAX. Tracing
        errors (bad shapes, options) propagate, as the JAX path would raise them."""
        dtypes = [DTYPES.get(t.dtype) for t in tensors]
        if any(d is None or jax.dtypes.canonicalize_dtype(d) != d for d in dtypes):
            return _THROUGH_JAX
        program, pack = self._program, self._pack
        found = kernel_program(
            lambda *arrays: program(*pack(arrays)),
            *(jax.ShapeDtypeStruct(tuple(t.shape), d) for t, d in zip(tensors, dtypes)),
            evaluable=_evaluable)
        return _THROUGH_JAX if found is None else _on_device(found, tensors[0].device)


def _on_device(program: KernelProgram, device: torch.device) -> KernelProgram | object:
    """The program with its constant arrays (a dense call's BlockMask lists, say) as tensors
    on `device`, moved once; _THROUGH_JAX where one has a dtype numpy alone cannot give torch
    (bfloat16)."""
    def moved(x):
        if not isinstance(x, ConstantArray):
            return x
        return Constant(torch.from_numpy(np.array(x.value)).to(device))

    try:
        steps = [dataclasses.replace(step, inputs=tuple(map(moved, step.inputs)))
                 for step in program.steps]
    except TypeError:
        return _THROUGH_JAX
    return dataclasses.replace(program, steps=tuple(steps))


def _run(program: KernelProgram, tensors: Sequence[Tensor], index: int) -> list[Tensor] | None:
    """The program's results on `tensors` (all on GPU `index`), or None where a kernel is
    loaded on another GPU or torch computed an equation in another dtype than JAX would."""
    device = tensors[0].device
    slots: list = [*tensors, *[None] * (program.slots - len(tensors))]
    # slot -> its tensor's address, once the tensor is known contiguous and aligned: each is
    # checked once per call, however many kernels read it (a backward's kernels each read q,
    # k and v)
    addresses: list = [None] * program.slots
    for step in program.steps:
        launch = step.launch
        if launch is None:
            operands = [slots[i] if type(i) is int else i.value for i in step.inputs]
            [(shape, dtype)] = step.avals
            dtype = _TORCH_DTYPES[dtype]
            value = _RULES[step.name](operands, step.params, device, shape, dtype)
            if isinstance(value, Tensor) and (value.dtype != dtype or value.shape != shape):
                return None
            slots[step.outputs[0]] = value
            continue
        alignment = launch.alignment
        operands = []
        for i in step.inputs:
            if type(i) is not int:  # a constant array, moved to the device contiguous
                operands.append(i.value.data_ptr())
                continue
            address = addresses[i]
            if address is None or address % alignment:
                t = slots[i]
                address = t.data_ptr()
                if address % alignment or not t.is_contiguous():  # copied once per call
                    t = slots[i] = t.clone(memory_format=torch.contiguous_format)
                    address = t.data_ptr()
                addresses[i] = address
            operands.append(address)
        outputs = [torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=device)
                   for shape, dtype in launch.outputs]
        results = [out.data_ptr() for out in outputs]
        if not launch(operands, results, _current_stream(index), index):
            return None  # the kernel is loaded on another GPU
        first = step.outputs[0]
        slots[first:first + len(outputs)] = outputs
        addresses[first:first + len(outputs)] = results  # fresh from the allocator: contiguous
    return [slots[i] for i in program.results]


# ------------------------------------------------------------------------------------------------
# The equations torch evaluates between kernels: primitive name -> rule(operands, params, device,
# shape, dtype), the output (shape and torch dtype: its aval's) as a tensor, or as a Python scalar
# where every operand is one.
# ------------------------------------------------------------------------------------------------

def _binary(op):
    return lambda xs, params, device, shape, dtype: op(*xs)


def _converted(xs, params, device, shape, dtype):
    [x] = xs
    if isinstance(x, Tensor):
        return x.to(dtype)
    return (bool if dtype == torch.bool else float if dtype.is_floating_point else int)(x)


def _broadcast(xs, params, device, shape, dtype):
    [x] = xs
    if not isinstance(x, Tensor):
        return torch.full(shape, x, dtype=dtype, device=device)
    placed = [1] * len(shape)
    for size, dim in zip(x.shape, params["broadcast_dimensions"]):
        placed[dim] = size
    return x.reshape(placed).expand(shape)


def _selected(xs, params, device, shape, dtype):
    which, false, true = xs
    return torch.where(which, true, false)


_RULES: dict[str, Callable] = {
    "add": _binary(operator.add), "sub": _binary(operator.sub), "mul": _binary(operator.mul),
    "eq": _binary(operator.eq), "ne": _binary(operator.ne), "neg": _binary(operator.neg),
    "convert_element_type": _converted, "broadcast_in_dim": _broadcast, "select_n": _selected,
    "reduce_sum": lambda xs, params, *_: xs[0].sum(dim=params["axes"]),
    "reduce_max": lambda xs, params, *_: xs[0].amax(dim=params["axes"]),
    "reshape": lambda xs, params, device, shape, dtype: xs[0].reshape(shape),
    "squeeze": lambda xs, params, device, shape, dtype: xs[0].reshape(shape),
}


def _evaluable(name: str, params: dict, operands: list) -> bool:
    """Whether `_RULES` computes this equation as JAX does: a known primitive, a two-way
    select on a bool, sums of floats (torch's integer sums widen) and no reshape that
    reorders dimensions."""
    if name not in _RULES:
        return False
    dtypes = [np.dtype(dtype) for _, dtype in operands]
    if name == "select_n":
        return len(operands) == 3 and dtypes[0] == np.bool_
    if name == "reduce_sum":
        return np.issubdtype(dtypes[0], np.floating)
    if name == "reshape":
        return params.get("dimensions") is None
    return True
