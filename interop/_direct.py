"""Eager ops on CUDA tensors whose JAX program is one kernel: that kernel launched on torch's
current stream, reading the tensors in place and writing torch-allocated outputs, without
JAX's dispatch, DLPack crossings or stream waits (`jattn._src.pallas_triton.launch`).

It is the kernel binary the JAX program launches, so results are the same bits. A call takes
this path only when every tensor is a contiguous tensor on the current CUDA device at an
address aligned as the kernel assumes, in a dtype JAX keeps (int64 is narrowed by JAX without
x64); otherwise, and for programs that are more than one kernel or are compiled by XLA, the
caller goes through JAX as before. Ordering is torch's own: the kernel runs after the work
queued on the current stream, later work there runs after it, and the caching allocator
keeps the tensors' memory for that stream as for any torch kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
import torch
from torch import Tensor

from ._dlpack import DTYPES
from jattn._src.bridge import compat, single_kernel_launch

_TORCH_DTYPES = {np.dtype(jax_dtype): torch_dtype for torch_dtype, jax_dtype in DTYPES.items()}
_current_device, _current_stream = compat.torch_cuda_device_and_stream()
_NOT_ONE_KERNEL = object()  # a launch-table entry: this signature runs through JAX


class DirectProgram:
    """A jitted JAX program run as its one kernel on torch tensors.

    program(*pack(tensors)) is the JAX call the tensors' views would be given (pack: the flat
    tensor tuple to the program's arguments). Launches are worked out once per (shape, dtype)
    signature of the tensors.
    """

    def __init__(self, program: Callable, pack: Callable[[Sequence], tuple]):
        self._program, self._pack = program, pack
        self._launches: dict[tuple, object] = {}

    def __call__(self, tensors: Sequence[Tensor]) -> list[Tensor] | None:
        """The program's results as new tensors, queued on torch's current stream, or None
        where this call must go through JAX (then nothing has been queued)."""
        index = _current_device()
        key = []
        for t in tensors:
            if not (isinstance(t, Tensor) and t.get_device() == index and t.is_contiguous()):
                return None
            key += (t.shape, t.dtype)
        launch = self._launches.get(key := tuple(key))
        if launch is None:
            launch = self._launches[key] = self._launch_for(tensors)
        if launch is _NOT_ONE_KERNEL:
            return None
        operands = [tensors[i].data_ptr() for i in launch.operands]
        if any(address % launch.alignment for address in operands):
            return None
        device = tensors[0].device
        outputs = [torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=device)
                   for shape, dtype in launch.outputs]
        if not launch(operands, [out.data_ptr() for out in outputs],
                      _current_stream(index), index):
            return None  # the kernel is loaded on another GPU
        return [outputs[i] for i in launch.results]

    def _launch_for(self, tensors: Sequence[Tensor]):
        """The kernel launch for tensors of these shapes and dtypes, or _NOT_ONE_KERNEL.
        Tracing errors (bad shapes, options) propagate, as the JAX path would raise them."""
        dtypes = [DTYPES.get(t.dtype) for t in tensors]
        if any(d is None or jax.dtypes.canonicalize_dtype(d) != d for d in dtypes):
            return _NOT_ONE_KERNEL
        program, pack = self._program, self._pack
        launch = single_kernel_launch(
            lambda *arrays: program(*pack(arrays)),
            *(jax.ShapeDtypeStruct(tuple(t.shape), d) for t, d in zip(tensors, dtypes)))
        return _NOT_ONE_KERNEL if launch is None else launch
