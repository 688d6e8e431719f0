"""Timing shared by every benchmark: warm-up, rotated inputs, medians, same rules for each side.

Each sample launches `calls` back-to-back runs and waits once, so launch latency is amortised
the same way for jattn, XLA and torch. Inputs rotate among enough copies to overflow the L2
cache, so small problems are not timed out of cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

L2_BYTES = 50 * 2**20  # H100


def copies_to_defeat_l2(bytes_per_input_set: int) -> int:
    """How many input sets to rotate so that the working set is at least 3x the L2 cache."""
    return max(1, min(16, -(-3 * L2_BYTES // max(1, bytes_per_input_set))))


def _median_per_call(run_batch: Callable[[int], None], calls: int, samples: int) -> float:
    run_batch(calls)  # warm-up (and compile) outside the samples
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        run_batch(calls)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_jax(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, calls: int = 20,
             samples: int = 7) -> float:
    """Median seconds per call of a (jitted) JAX function over rotating argument sets."""
    def run_batch(n):
        out = None
        for i in range(n):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)

    return _median_per_call(run_batch, calls, samples)


def time_torch(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, calls: int = 20,
               samples: int = 7) -> float:
    """Median seconds per call of a torch function on CUDA, measured like `time_jax`."""
    import torch

    def run_batch(n):
        for i in range(n):
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()

    return _median_per_call(run_batch, calls, samples)


def first_call_seconds(fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of the first call, trace and compile included."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start
