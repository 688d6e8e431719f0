"""Tile arithmetic and the validation every kernel config shares."""

from __future__ import annotations

from typing import Any

from jattn._src.constants import MIN_DOT_TILE

WARP_COUNTS = (1, 2, 4, 8, 16)

# Who compiles a kernel's Triton IR: jax's stock path (XLA's bundled Triton) or the `triton`
# package (see jattn/_src/pallas_triton/compile.py).
COMPILERS = ("xla", "triton")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_power_of_two(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def dot_tile(size: int) -> int:
    """The power-of-two tile side (>= MIN_DOT_TILE, what Triton's dot needs) that covers
    `size`; the part past `size` is masked."""
    return max(MIN_DOT_TILE, next_power_of_two(size))


def check_tiles(config: Any, *names: str) -> None:
    """Tile sizes must be powers of two >= MIN_DOT_TILE."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < MIN_DOT_TILE or value & (value - 1):
            raise ValueError(
                f"{type(config).__name__}.{name}={value!r} must be a power of two >= "
                f"{MIN_DOT_TILE} (Triton tiles are powers of two and its dot needs 16 "
                "rows/columns).")


def check_warps(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value not in WARP_COUNTS:
            raise ValueError(f"{type(config).__name__}.{name}={value!r} must be 1, 2, 4, 8 or "
                             "16.")


def check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name}={value!r} must be a positive int.")


def check_compiler(config: Any, name: str = "compiler") -> None:
    value = getattr(config, name)
    if value not in COMPILERS:
        raise ValueError(f"{type(config).__name__}.{name}={value!r} must be 'xla' or 'triton'.")
