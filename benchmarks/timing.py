"""Timing shared by every benchmark: warm-up, rotated inputs, medians, same rules for each side.

Launch overhead is kept out of the numbers the same way on both sides: JAX runs one pass over
all rotated input sets inside a single jitted program, torch replays a CUDA graph of the same
pass. Inputs rotate among enough copies to overflow the L2 cache (and to amortise the one
dispatch), so small problems are not timed out of cache. A sample queues passes back to back
until it lasts MIN_SAMPLE_SECONDS, so its one host wait (and the launch of its first pass) stays
a small share of it however few input sets fit in memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jattn._src.tuning.autotune import median_seconds

L2_BYTES = 50 * 2**20  # H100
MIN_COPIES = 32            # calls per timed pass, to amortise a dispatch (~40 us from Python)
MAX_INPUT_BYTES = 4 * 2**30
# A sample also pays a fixed host cost: dispatching its first pass and waking up after the
# last. Session 9 (H100, flex decode B8/32k, passes of 4 calls): the GPU ran 356 us per call
# back to back, while a sample of one JAX pass read 459-574 us per call, 14 passes (20 ms)
# 364-369 and 40 passes 360, ~0.5 ms fixed per sample; a CUDA-graph replay pays far less.
# 100 ms samples keep that cost under ~0.6% on either side.
MIN_SAMPLE_SECONDS = 0.1


def warm_up(seconds: float = 3.0) -> None:
    """Dense GEMMs for a few seconds before the first timed case, on the GPU only: on a fresh
    machine the clocks, the runtimes and cuBLAS otherwise come up during the first case, which
    then reads low."""
    if jax.default_backend() != "gpu":
        return
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    square = jax.jit(lambda x: x @ x)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        jax.block_until_ready(square(x))
    try:
        import torch
    except ImportError:
        return
    y = torch.ones(4096, 4096, dtype=torch.bfloat16, device="cuda")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        (y @ y).sum().item()


def input_copies(bytes_per_input_set: int) -> int:
    """How many distinct input sets to rotate: >= 3x L2 in total and >= MIN_COPIES calls,
    within MAX_INPUT_BYTES. Distinct sets also stop XLA from merging repeated calls."""
    wanted = max(MIN_COPIES, -(-3 * L2_BYTES // max(1, bytes_per_input_set)))
    return max(1, min(wanted, MAX_INPUT_BYTES // max(1, bytes_per_input_set)))


def _passes_per_sample(run_pass: Callable[[], Any], wait: Callable[[Any], Any]) -> int:
    """How many passes make a sample of MIN_SAMPLE_SECONDS (at least 3): one pass timed after
    a warm-up (compilation, autotuning) pass."""
    wait(run_pass())
    start = time.perf_counter()
    wait(run_pass())
    return max(3, math.ceil(MIN_SAMPLE_SECONDS / (time.perf_counter() - start)))


def time_jax(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]]) -> float:
    """Median seconds per call of a JAX function, one pass over the sets per dispatch."""
    one_pass = jax.jit(lambda sets: [fn(*args) for args in sets])
    run_pass = lambda: one_pass(arg_sets)  # noqa: E731
    calls = _passes_per_sample(run_pass, jax.block_until_ready)
    return median_seconds(run_pass, calls=calls, samples=7) / len(arg_sets)


def time_torch(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *,
               graph: bool = True) -> float:
    """Median seconds per call of a torch function on CUDA, one graph replay per pass.

    graph=False launches eagerly instead (for work a CUDA graph cannot capture, e.g. autograd
    through compiled kernels); use it only where kernels are long next to launch latency.
    """
    import torch

    synchronize = lambda _: torch.cuda.synchronize()  # noqa: E731
    if not graph:
        run_pass = lambda: [fn(*args) for args in arg_sets]  # noqa: E731
        calls = _passes_per_sample(run_pass, synchronize)
        return median_seconds(run_pass, calls=calls, samples=7, wait=synchronize) / len(arg_sets)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (cuBLAS handles, autotuning) before capture
        for args in arg_sets[:2]:
            fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    calls = _passes_per_sample(graph.replay, synchronize)
    return median_seconds(graph.replay, calls=calls, samples=7, wait=synchronize) / len(arg_sets)


def first_call_seconds(fn: Callable[..., Any], *args: Any) -> float:
    """Wall time of the first call, trace and compile included."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start
