"""JAX programs run as one kernel launch on buffers and a stream the caller owns, where the
backend that compiled them allows it (Pallas-Triton kernels compiled by the `triton` package;
see `pallas_triton_launch`). Callers outside JAX (interop's eager torch ops) use this module,
which stays free of any one backend."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jattn._src import pallas_triton_launch


def single_kernel_launch(fn: Callable, *args: jax.ShapeDtypeStruct):
    """A launch of `fn(*args)` as its one kernel (see `pallas_triton_launch.KernelLaunch`:
    operands, outputs, results, alignment, and a call on addresses and a stream), or None
    where only JAX can run the program."""
    return pallas_triton_launch.single_kernel_launch(fn, *args)
