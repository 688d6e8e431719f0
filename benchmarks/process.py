"""What a benchmark watches in its own process: resident memory and XLA compilations."""

from __future__ import annotations

import jax


def rss_mib() -> float:
    """The process's resident memory, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class CompileCounter:
    """Counts XLA backend compilations from its creation on (JAX's monitoring events)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, *_, **__) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
