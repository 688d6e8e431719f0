"""The `precision=` argument: how float32 products are computed, by the kernels and XLA alike.

The names are `jax.default_matmul_precision`'s: None keeps the caller's setting (JAX's default
runs float32 products on the GPU's tensor cores as TF32); "highest" / "float32" give full
float32 products (the Triton kernels' IEEE dots), "high" / "tensorfloat32" TF32. bfloat16 and
float16 inputs are unaffected. The setting applies to the whole op, its backward included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def canonical(fn: str, precision) -> str | None:
    """`precision` as one of NAMES (a jax.lax.Precision is accepted), or None."""
    if precision is None:
        return None
    if isinstance(precision, jax.lax.Precision):
        precision = precision.name.lower()
    if precision not in NAMES:
        raise ValueError(f"{fn}: `precision`={precision!r} is not one of {NAMES} (or a "
                         "jax.lax.Precision); None keeps jax.default_matmul_precision.")
    return precision


@contextlib.contextmanager
def applied(precision: str | None) -> Iterator[None]:
    """Traces inside run their products at `precision` (None: as set by the caller)."""
    if precision is None:
        yield
        return
    with jax.default_matmul_precision(precision):
        yield
