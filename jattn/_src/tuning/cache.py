"""The on-disk autotuning cache: one JSON file of {op: {key: config fields}}.

The file lives at $JATTN_CACHE_DIR/autotune.json (default ~/.cache/jattn/autotune.json). Keys
name the device kind, a shape bucket and the dtype, so a result tuned on one GPU model is never
used on another.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import tempfile
from typing import Any

from jattn._src.programs import register_cache

CACHE_DIR_ENV = "JATTN_CACHE_DIR"


def cache_path() -> pathlib.Path:
    root = os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "jattn"
    return pathlib.Path(root) / "autotune.json"


def _read() -> dict[str, dict[str, Any]]:
    """The file's contents, parsed again only when it changed (a call that looks up its
    config must not pay for reading the file)."""
    path = cache_path()
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


register_cache("tuning.files", _parsed.cache_clear)


def lookup(op: str, key: str) -> dict[str, Any] | None:
    """The cached entry of `op` under `key` (a copy), or None."""
    entry = _read().get(op, {}).get(key)
    return None if entry is None else dict(entry)


def store(op: str, key: str, entry: dict[str, Any]) -> None:
    """Records an entry; the file is replaced atomically so concurrent readers never see half."""
    data = copy.deepcopy(_read())
    data.setdefault(op, {})[key] = entry
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(f.name, path)
