"""The backend registry: every op's implementations, and the one function that picks one.

An op (flex_attention, flex_decode, matmul, ...) registers one `Implementation` per backend it
runs on: the backend, what it cannot do (a function of the call's facts that returns a reason,
or None), and for kernels its config class, heuristic and search space, plus the op's own entry
points (`module`). `resolve` turns a call's `implementation=`, $JATTN_IMPLEMENTATION and the
platform into one implementation. The torch ops resolve through it too, with the platform of
their tensors. Why a call runs where it does: `jattn.explain`, or the "jattn" logger at DEBUG.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jattn._src import compat, hardware
from jattn._src.constants import IMPLEMENTATION_ENV

logger = logging.getLogger("jattn")


@dataclasses.dataclass(frozen=True)
class Backend:
    """Where and how an implementation runs.

    platforms: where it can run ("gpu": a CUDA GPU, "cpu"). interpret: jattn's Pallas kernels
    run in the Pallas interpreter. direct_launch: a forward is one compiled Triton kernel that
    the torch ops may launch without JAX's dispatch. (Whether an op's calls choose tile
    configs on it is the op's `Implementation.tunable`.)
    """

    name: str
    platforms: tuple[str, ...]
    interpret: bool = False
    direct_launch: bool = False


XLA = Backend("xla", ("cpu", "gpu"))
PALLAS_TRITON = Backend("pallas_triton", ("gpu",), direct_launch=True)
INTERPRET = Backend("interpret", ("cpu", "gpu"), interpret=True)
# Hopper kernels on Mosaic GPU (TMA, wgmma, warp specialisation); flex_attention's forward only.
PALLAS_MOSAIC_GPU = Backend("pallas_mosaic_gpu", ("gpu",))
BACKENDS = {backend.name: backend
            for backend in (PALLAS_TRITON, XLA, INTERPRET, PALLAS_MOSAIC_GPU)}

# The order tried on each platform when the caller names no implementation: the first that
# the op has, that supports the call and that is not measured slower there wins.
DEFAULT_ORDER = {"gpu": ("pallas_mosaic_gpu", "pallas_triton", "xla"), "cpu": ("xla",)}


def _supports_everything(**facts: Any) -> str | None:
    return None


def _never_slower(**facts: Any) -> str | None:
    return None


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: part of static options
class Implementation:
    """One op on one backend.

    module: the op's entry points on this backend, the same names and signatures on every
    backend of the op (flex_attention: specialise / forward / backward on a Problem; the GEMMs:
    gemm/protocols.py). unsupported(**facts): why this implementation cannot run a call, or None.
    slower(**facts): why the default choice passes it over for a call it supports (measured
    slower there than the next in DEFAULT_ORDER), or None; naming it still runs it.
    config_class / heuristic / search_space: the backend's tunables, where it has any.
    """

    op: str
    backend: Backend
    module: Any = None
    unsupported: Callable[..., str | None] = _supports_everything
    slower: Callable[..., str | None] = _never_slower
    config_class: type | None = None
    heuristic: Callable[..., Any] | None = None
    search_space: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def tunable(self) -> bool:
        """Whether calls on it choose a config (its kernels' tiles); XLA chooses its own."""
        return self.config_class is not None

    def __repr__(self) -> str:
        return f"Implementation({self.op!r}, {self.name!r})"


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def register(implementation: Implementation) -> Implementation:
    """Adds (or replaces) the implementation of its op on its backend."""
    _REGISTRY.setdefault(implementation.op, {})[implementation.name] = implementation
    return implementation


def register_xla_and_kernels(op: str, xla_module: Any, kernel_module: Any,
                             **tunables: Any) -> None:
    """Registers `op` on XLA (no tunables) and on the Pallas kernels, compiled and interpreted
    (`tunables`: their config_class, heuristic, search_space)."""
    register(Implementation(op, XLA, xla_module))
    for backend in (PALLAS_TRITON, INTERPRET):
        register(Implementation(op, backend, kernel_module, **tunables))


def implementations(op: str) -> dict[str, Implementation]:
    """The registered implementations of `op`, by backend name."""
    return dict(_REGISTRY[op])


def on_backend_of(op: str, implementation: Implementation) -> Implementation:
    """`op`'s implementation on the backend `implementation` runs on (an op built from
    another's products runs them there)."""
    return _REGISTRY[op][implementation.backend.name]


def for_empty(op: str) -> Implementation:
    """The implementation of a call with an empty dimension on any backend: XLA's, whose
    empty (or zero-length sum) results every implementation returns alike."""
    return _REGISTRY[op][XLA.name]


@dataclasses.dataclass(frozen=True)
class Resolution:
    """Why a call of `op` runs on `chosen`: the name asked for and by whom, and what was
    skipped on the way."""

    op: str
    chosen: str
    source: str  # "argument", IMPLEMENTATION_ENV or "platform default (<platform>)"
    skipped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what else the call runs elsewhere, and why

    def __str__(self) -> str:
        text = f"{self.op}: {self.chosen} ({self.source})"
        return (text + "".join(f"\n  skipped {reason}" for reason in self.skipped)
                + "".join(f"\n  {note}" for note in self.notes))


_EXPLAINING: contextvars.ContextVar[list[Resolution] | None] = contextvars.ContextVar(
    "jattn_explaining", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Resolution]]:
    """Collects the resolutions of the calls made inside the block (for `jattn.explain`)."""
    seen: list[Resolution] = []
    token = _EXPLAINING.set(seen)
    try:
        yield seen
    finally:
        _EXPLAINING.reset(token)


def requested_implementation() -> str | None:
    """$JATTN_IMPLEMENTATION, or None (read by every eager call's plan key)."""
    return compat.environment_variable(IMPLEMENTATION_ENV)


def explaining() -> bool:
    """Whether calls are being explained (`recording`): eager calls then resolve their
    implementation instead of replaying a plan, so that each is reported."""
    return _EXPLAINING.get() is not None


def annotate(op: str, note: str) -> None:
    """Adds `note` to the last recorded resolution of `op`, when calls are being explained."""
    seen = _EXPLAINING.get()
    if seen is None:
        return
    for i in reversed(range(len(seen))):
        if seen[i].op == op:
            seen[i] = dataclasses.replace(seen[i], notes=(*seen[i].notes, note))
            return


def _record(resolution: Resolution) -> None:
    if resolution.skipped:
        logger.debug("%s", resolution)
    seen = _EXPLAINING.get()
    if seen is not None:
        seen.append(resolution)


def _check_name(name: str, source: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not an implementation; expected one of "
                         f"{tuple(BACKENDS)}.")


_warned_env: set[tuple[str, str]] = set()


def resolve(op: str, implementation: str | None = None, *, platform: str | None = None,
            **facts: Any) -> Implementation:
    """The implementation of `op` for a call: `implementation` if given (it must run here and
    support the call, else a ValueError says why), else $JATTN_IMPLEMENTATION where it can run
    the call, else the first of the platform's DEFAULT_ORDER that can.

    platform: "gpu" or "cpu" (default: where JAX runs). facts: what the op's implementations
    judge support by (dtype, head dims, ...).
    """
    platform = platform or hardware.default_platform()
    available = _REGISTRY[op]
    if implementation is not None:
        _check_name(implementation, "implementation")
        chosen = available.get(implementation)
        reason = _why_not(chosen, implementation, op, platform, facts)
        if reason is not None:
            raise ValueError(f"{op}: implementation={implementation!r} cannot run this call: "
                             f"{reason}")
        _record(Resolution(op, implementation, "argument"))
        return chosen
    skipped = []
    candidates = list(DEFAULT_ORDER[platform])
    source = f"platform default ({platform})"
    requested = requested_implementation()
    if requested:
        _check_name(requested, IMPLEMENTATION_ENV)
        reason = _why_not(available.get(requested), requested, op, platform, facts)
        if reason is None:
            _record(Resolution(op, requested, IMPLEMENTATION_ENV))
            return available[requested]
        skipped.append(f"{requested} (from {IMPLEMENTATION_ENV}): {reason}")
        if (requested, platform) not in _warned_env and platform not in BACKENDS[
                requested].platforms:
            _warned_env.add((requested, platform))
            warnings.warn(f"jattn: {IMPLEMENTATION_ENV}={requested!r} cannot run on {platform}; "
                          f"calls there use the platform default.", stacklevel=3)
    for name in candidates:
        if name not in available:  # a backend this op has no implementation on
            continue
        reason = _why_not(available[name], name, op, platform, facts)
        if reason is None:
            reason = available[name].slower(**facts)
        if reason is None:
            _record(Resolution(op, name, source, tuple(skipped)))
            return available[name]
        skipped.append(f"{name}: {reason}")
    raise ValueError(f"{op}: no implementation can run this call on {platform}: "
                     + "; ".join(skipped))


def _why_not(chosen: Implementation | None, name: str, op: str, platform: str,
             facts: dict[str, Any]) -> str | None:
    if chosen is None:
        return f"{op} has no {name} implementation."
    if platform not in chosen.backend.platforms:
        if chosen.backend.platforms == ("gpu",):
            return ("it needs a CUDA GPU, and this call runs on the CPU. Use implementation="
                    "'xla' (fast on CPU) or 'interpret' (runs the Pallas kernels in the "
                    "interpreter).")
        return f"it runs on {' or '.join(chosen.backend.platforms)}, not {platform}."
    return chosen.unsupported(**facts)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Which implementation each jattn op inside `fn(*args, **kwargs)` would run, and why —
    the skipped ones with their reasons. Nothing is computed: `fn` is traced abstractly.

    Args:
      fn: any callable; args, kwargs: its arguments (arrays of the shapes and dtypes it
        takes, e.g. q, k, v [B, H, L, E] bfloat16 for flex_attention).

    Returns:
      str, one line per jattn op call ("no jattn op was called." when there is none).

    Example::

        q = k = v = jnp.ones((1, 2, 128, 64), jnp.bfloat16)  # [B, H, L, E]
        mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, 128, 128)
        print(jattn.explain(jattn.flex_attention, q, k, v, block_mask=mask))
        # flex_attention: xla (platform default (cpu))
    """
    with recording() as seen:
        jax.eval_shape(lambda: fn(*args, **kwargs))
    return "\n".join(str(resolution) for resolution in seen) or "no jattn op was called."
