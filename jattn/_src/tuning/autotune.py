"""Times candidate configs of a kernel on the current device and keeps the fastest."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import jax

Config = TypeVar("Config")


def _progress(items: Sequence[Any], desc: str) -> Iterable[Any]:
    """tqdm's bar when it is installed, else a one-line bar on stderr."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, desc=desc, leave=False)
        return
    for i, item in enumerate(items):
        done = 30 * i // max(1, len(items))
        print(f"\r{desc} [{'#' * done}{'.' * (30 - done)}] {i}/{len(items)}", end="",
              file=sys.stderr, flush=True)
        yield item
    print(f"\r{desc} done ({len(items)} configs)".ljust(60), file=sys.stderr)


def median_seconds(fn: Callable[[], Any], *, calls: int = 10, samples: int = 5,
                   wait: Callable[[Any], Any] = jax.block_until_ready) -> float:
    """Median seconds per call of fn(), each sample `calls` launches then one wait(result).

    Launching several calls before waiting keeps launch latency from swamping short kernels.
    The first batch (compilation included) is not timed.
    """
    def batch():
        out = None
        for _ in range(calls):
            out = fn()
        wait(out)

    batch()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        batch()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def autotune(candidates: Sequence[Config], make_run: Callable[[Config], Callable[[], Any]], *,
             desc: str) -> tuple[Config, list[tuple[Config, float]]]:
    """Returns the fastest candidate and every candidate's median time (inf if it failed).

    make_run(config) returns a zero-argument callable that launches the kernel once on fixed
    inputs; compilation happens in the warm-up, outside the timed runs.
    """
    timings = []
    for config in _progress(candidates, desc):
        try:
            seconds = median_seconds(make_run(config))
        except Exception:  # a candidate the compiler rejects (resources, lowering) is skipped
            seconds = float("inf")
        timings.append((config, seconds))
    ranked = sorted(timings, key=lambda item: item[1])
    if ranked[0][1] == float("inf"):
        raise RuntimeError(f"{desc}: every candidate config failed to compile or run.")
    summary = "; ".join(f"{seconds * 1e6:.1f} us {config}" for config, seconds in ranked[:3])
    print(f"{desc}: fastest {summary}", file=sys.stderr)
    return ranked[0][0], timings
