"""What a benchmark's --json file holds: its rows and the environment they were measured in."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
from typing import Any

import jax


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Date, device and the versions the numbers depend on."""
    return {"date": datetime.date.today().isoformat(),
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version(),
            **{package: _version(package) for package in ("jax", "jaxlib", "torch", "triton")}}


def write(path: str | None, rows: Any, **extra: Any) -> None:
    """Writes {"environment", **extra, "rows"} to `path` (nothing when it is None). Benchmarks
    call it after every row, so a run cut off by a time limit keeps what it measured."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump({"environment": environment(), **extra, "rows": rows}, f, indent=1)
