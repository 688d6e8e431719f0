"""Timing shared by every benchmark: warm-up, rotated inputs, medians, same rules for each side.

Each sample launches several calls back-to-back and waits once (`median_seconds`), so launch
latency is amortised the same way for jattn, XLA and torch. Inputs rotate among enough copies
to overflow the L2 cache, so small problems are not timed out of cache.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jattn._src.tuning.autotune import median_seconds

L2_BYTES = 50 * 2**20  # H100
CALLS, SAMPLES = 20, 7


def copies_to_defeat_l2(bytes_per_input_set: int) -> int:
    """How many input sets to rotate so that the working set is at least 3x the L2 cache."""
    return max(1, min(16, -(-3 * L2_BYTES // max(1, bytes_per_input_set))))


def time_jax(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]]) -> float:
    """Median seconds per call of a (jitted) JAX function over rotating argument sets."""
    rotation = itertools.cycle(arg_sets)
    return median_seconds(lambda: fn(*next(rotation)), calls=CALLS, samples=SAMPLES)


def time_torch(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]]) -> float:
    """Median seconds per call of a torch function on CUDA, measured like `time_jax`."""
    import torch

    rotation = itertools.cycle(arg_sets)
    return median_seconds(lambda: fn(*next(rotation)), calls=CALLS, samples=SAMPLES,
                          wait=lambda _: torch.cuda.synchronize())


def first_call_seconds(fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of the first call, trace and compile included."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start
