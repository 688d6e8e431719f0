"""User mods in the Mosaic GPU forward: captured arrays read one element per program, and tanh
kept accurate under the kernel's approximate math.

The forward evaluates mods on [64, 128] register tiles in the wgmma layout. Mosaic GPU cannot
gather into that layout, so a lookup per score (`bias[q_idx - kv_idx]`, `doc_ids[q_idx]`) has
no lowering there. What it reads cheaply is a scalar from global memory: an element picked by
the program's batch and head (`slopes[h]`, `bias[b, h]`; traced at the kernel's tile, where b
and h are scalars, a `dynamic_slice` of size one) or a one-element array used whole (a
temperature). `unreadable` names the first read outside that set, so that the registry sends
such calls to pallas_triton; `call_in_kernel` evaluates a traced mod in the kernel with each
read a scalar load, its indices clamped into the array as a traced lookup's are.

The kernel compiles with approximate math, for the softmax's exp2 (one MUFU op). A mod's exp,
exp2 and log stay within a few float32 ulps that way, but tanh.approx is off by up to 2**-11
(0.015 on a softcap of 30), so `call_in_kernel` computes tanh as 1 - 2 / (2**(2x·log2 e) + 1)
instead: one approximate exp2 and a division, within ~5e-7 of it. (Measured on the H100,
softcap at B4 H16 L4096 D128 causal: 347 TFLOP/s this way, 284 with precise math throughout,
330 with the division as rsqrt², 349 with `score / 30` also made a product.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend.core import Literal

from jattn._src.attention.common import Mods
from jattn._src.constants import LOG2_E
from jattn._src.jaxpr_eval import Deferred, jaxpr_and_consts
from jattn._src.user_functions import TracedFunction

# Equations holding a jaxpr that a captured array may be passed into (and that jaxpr_eval
# inlines for it): its parameter's name. A captured array passed into any other (a remat, say)
# counts as unreadable.
_NESTED = {"pjit": "jaxpr", "jit": "jaxpr", "custom_jvp_call": "call_jaxpr"}

_HOW = {"gather": "through a gather (an index per score, or jnp.take)",
        "dynamic_slice": "a slice at a time"}


def _is_element_read(eqn, captured) -> bool:
    """eqn reads one element of a captured array: `table[b, h]` at scalar indices."""
    return (eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in captured
            and all(size == 1 for size in eqn.params["slice_sizes"]))


def _first_unreadable(jaxpr, captured: set) -> str | None:
    for eqn in jaxpr.eqns:
        operands = [(i, var) for i, var in enumerate(eqn.invars)
                    if not isinstance(var, Literal) and var in captured]
        if not operands:
            continue
        nested = _NESTED.get(eqn.primitive.name)
        if nested in eqn.params:
            inner = jaxpr_and_consts(eqn.params[nested])[0]
            found = _first_unreadable(inner, {inner.invars[i] for i, _ in operands})
            if found is not None:
                return found
            continue
        for i, var in operands:
            if (i == 0 and _is_element_read(eqn, captured)) or math.prod(var.aval.shape) == 1:
                continue
            how = _HOW.get(eqn.primitive.name, f"whole (in `{eqn.primitive.name}`)")
            return f"a captured {var.aval.str_short()} array {how}"
    return None


def unreadable(mods: Mods) -> str | None:
    """The first captured-array read of `mods` (traced at the Mosaic kernel's tile) that the
    kernel cannot make, described (`score_mod reads a captured f32[16,1024] array per score (a
    gather)`); None when it reads only single elements."""
    for name, fn in (("score_mod", mods.score), ("mask_mod", mods.mask)):
        if fn is not None:
            jaxpr = jaxpr_and_consts(fn.closed_jaxpr)[0]
            found = _first_unreadable(jaxpr, set(jaxpr.constvars))
            if found is not None:
                return f"{name} reads {found}"
    return None


@dataclasses.dataclass(frozen=True)
class _InMemory(Deferred):
    """A captured array in global memory, flattened (`ref`), with its shape and dtype."""
    ref: Any
    shape: tuple[int, ...]
    dtype: Any

    def element(self, index: Sequence[Any]) -> Any:
        flat = 0
        for i, size in zip(index, self.shape):
            flat = flat * size + jnp.clip(i, 0, size - 1)
        value = self.ref[flat]
        return value != 0 if self.dtype == jnp.bool_ else value


@dataclasses.dataclass(frozen=True)
class _Element(Deferred):
    """A scalar standing for an array of ones' shape (what a size-one lookup traced to)."""
    value: Any
    shape: tuple[int, ...]


def _scalar(x: Any) -> Any:
    if isinstance(x, _InMemory):
        return x.element([0] * len(x.shape))
    return x.value if isinstance(x, _Element) else x


def _as_shaped(value: Any, shape: Sequence[int]) -> Any:
    return value if tuple(shape) == () else _Element(value, tuple(shape))


def _tanh(x: Any) -> Any:
    # 2**(2x·log2 e) overflows to inf for large x, giving 1; underflows to 0, giving -1.
    return 1.0 - 2.0 / (jnp.exp2(x * (2.0 * LOG2_E)) + 1.0)


def _in_kernel(primitive, operands, params) -> list[Any] | None:
    """jaxpr_eval's rewrite: tanh through exp2; lookups become scalar loads, and ops on their
    results stay scalar until a broadcast makes them a tile."""
    name = primitive.name
    if name == "tanh" and not isinstance(operands[0], Deferred):
        return [_tanh(operands[0])]
    if name in _NESTED or not any(isinstance(x, Deferred) for x in operands):
        return None
    if name == "dynamic_slice" and isinstance(operands[0], _InMemory):
        value = operands[0].element([_scalar(s) for s in operands[1:]])
        return [_as_shaped(value, params["slice_sizes"])]
    scalars = [_scalar(x) for x in operands]
    if name == "broadcast_in_dim":
        return [jnp.broadcast_to(scalars[0], params["shape"])]
    if name == "reshape":
        return [_as_shaped(scalars[0], params["new_sizes"])]
    if name == "squeeze":
        shape = next(x.shape for x in operands if isinstance(x, Deferred))
        return [_as_shaped(scalars[0], [d for i, d in enumerate(shape)
                                        if i not in params["dimensions"]])]
    # Elementwise on one-element arrays: the same op on their scalars.
    shape = max((x.shape for x in operands if isinstance(x, Deferred)), key=len)
    try:
        out = primitive.bind(*scalars, **params)
    except (TypeError, ValueError) as error:
        raise NotImplementedError(
            f"implementation='pallas_mosaic_gpu' reads captured arrays one element at a time "
            f"and cannot apply `{name}` to such an element; use "
            "implementation='pallas_triton'.") from error
    return [_as_shaped(out, shape)] if not primitive.multiple_results else out


def call_in_kernel(fn: TracedFunction, refs: Sequence[Any], avals: Sequence[Any],
                   *args: Any) -> list[Any]:
    """A traced mod's outputs in the kernel body: `refs` are its call's captured arrays in
    global memory, flattened, and `avals` their shapes and dtypes (in capture-list order)."""
    captures = [_InMemory(ref, tuple(aval.shape), aval.dtype) for ref, aval in zip(refs, avals)]
    return fn(captures, *args, rewrite=_in_kernel)
