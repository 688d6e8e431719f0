"""Device detection and the choice of implementation."""

from __future__ import annotations

import functools
import os

import jax

from jattn._src.constants import IMPLEMENTATION_ENV, IMPLEMENTATIONS


@functools.cache
def has_cuda() -> bool:
    """True when JAX sees at least one CUDA device."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def device_kind() -> str:
    """The kind of JAX's default device, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
    return jax.devices()[0].device_kind


def resolve_implementation(implementation: str | None) -> str:
    """Picks the implementation: the argument, else $JATTN_IMPLEMENTATION, else by platform.

    The platform default is "pallas_triton" on a CUDA GPU and "xla" elsewhere.
    """
    name = implementation
    if name is None:
        name = os.environ.get(IMPLEMENTATION_ENV) or (
            "pallas_triton" if has_cuda() else "xla"
        )
    if name not in IMPLEMENTATIONS:
        source = "implementation" if implementation is not None else IMPLEMENTATION_ENV
        raise ValueError(
            f"{source}={name!r} is not an implementation; expected one of {IMPLEMENTATIONS}."
        )
    if name == "pallas_triton" and not has_cuda():
        raise ValueError(
            "implementation='pallas_triton' needs a CUDA GPU, but JAX sees only "
            f"{sorted({d.platform for d in jax.devices()})}. Use implementation='xla' "
            "(fast on CPU) or 'interpret' (runs the Pallas kernels in the interpreter)."
        )
    return name
