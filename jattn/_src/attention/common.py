"""What every attention implementation gets: the static problem description and its mods."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jattn._src.attention.config import AttentionConfig
from jattn._src.backends import Implementation
from jattn._src.compat import jaxpr_and_consts
from jattn._src.mesh_axes import aligned, varying_axes
from jattn._src.mod_errors import (MASK_PARAMETERS, SCORE_PARAMETERS, check_parameters, name_of,
                                   traced_values_explained)
from jattn._src.user_functions import CaptureSet, TracedFunction


@dataclasses.dataclass(frozen=True)
class Mods:
    """score_mod and mask_mod traced at the shapes of one implementation's tiles.

    score: (score f32, b, h, q_idx, kv_idx) -> score. score_vjp: (score, b, h, q_idx, kv_idx,
    d_out) -> d_score. mask: (b, h, q_idx, kv_idx) -> bool. None where absent. Each reads its
    captured arrays from the call's `score_captures` / `mask_captures` lists.
    """

    score: TracedFunction | None = None
    score_vjp: TracedFunction | None = None
    mask: TracedFunction | None = None


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a custom_jvp static option
class Problem:
    """Static description of one flex_attention call.

    Shapes: q [B, Hq, L, E], k [Bk, Hkv, S, E], v [Bk, Hkv, S, Ev], Bk in {B, 1}; the BlockMask
    lists have batch Bm in {B, 1} and heads Hm in {Hq, 1}, blocks of mask_block.
    """

    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    Ev: int
    kv_batch: int
    mask_batch: int
    mask_heads: int
    mask_block: tuple[int, int]
    scale: float
    precision: str | None  # float32 products (jattn._src.precision); None: the caller's
    implementation: Implementation
    config: AttentionConfig | None
    fwd: Mods          # kernel forward tile, or the XLA block
    bwd: Mods          # kernel dQ tile [queries, keys], or the XLA block
    dkdv: Mods         # kernel dK/dV tile, transposed: [keys, queries]; or the XLA block
    xla: Mods          # XLA block: the XLA path, and gradients of captured arrays
    decode: Any = None  # a decoding DecodeProblem when the forward runs the decode kernel
    dense: bool = False  # no BlockMask was given: every query block attends to every kv block
    compute_dtype: Any = jnp.float32  # scores, softmax and LSE: float64 for float64 inputs
    max_scores: bool = False  # the forward also returns each row's largest score
    dropout: float = 0.0  # the rate of dropout of the attention weights (attention.dropout)
    dropout_shared: bool = False  # one dropout mask for every batch and head
    deterministic: bool = True  # gradients bitwise repeatable (flex_attention's argument)
    # The Mosaic GPU backward's mods (dQ tile, dK/dV tile) where it runs; None: pallas_triton's
    mosaic_backward: tuple[Mods, Mods] | None = None
    # The Mosaic GPU kernels' dropout keep(b, h, q_idx, kv_idx), reading dropout.word_tables,
    # at the forward and dQ tile and at the dK/dV tile; None without dropout
    mosaic_dropout: tuple[Any, Any] | None = None
    # Why the backward runs on pallas_triton's kernels behind another forward (`explain`)
    backward_fallback: str | None = None

    @property
    def groups(self) -> int:
        return self.Hq // self.Hkv

    @property
    def interpret(self) -> bool:
        """The kernels run in the Pallas interpreter."""
        return self.implementation.backend.interpret


class AttentionBackend(Protocol):
    """What a flex_attention implementation's module provides (the registry's `module`)."""

    def specialise(self, p: Problem, *, score_mod, mask_mod, score_set: CaptureSet,
                   mask_set: CaptureSet, block_mask, config) -> Problem:
        """p completed for this backend: its config and the mods traced at its tiles."""

    def forward(self, p: Problem, q, k, v, lists, score_caps, mask_caps):
        """(out, lse), with p.max_scores also the rows' largest scores."""

    def backward(self, p: Problem, res, d_out, d_lse):
        """(dq, dk, dv, the score_mod's captured arrays' gradients) of the residuals."""

    def tangents(self, p: Problem, residuals, linear):
        """The outputs' tangents (forward mode) from the inputs' (None where zero)."""


# Scores are float32 and the softmax's exponent is computed with fused multiply-adds, which
# round differently from the scores' own product: |scale| above 2**20 leaves an ordinary q·k
# (~10**3) too few float32 bits for the softmax to stay finite.
MAX_SCALE = float(2 ** 20)


def canonical_scale(fn: str, scale: Any, head_dim: int) -> float:
    """The score scale of a call as a Python float (1/sqrt(head_dim) for None), with clear
    errors for what cannot be one: the scale is a static part of the compiled program."""
    if scale is None:
        return float(head_dim ** -0.5)
    bad_type = TypeError(f"{fn}: `scale` must be a Python float (or None for 1/sqrt(head "
                         f"dim)), got {type(scale).__name__} {scale!r}.")
    if isinstance(scale, (str, bytes, bool)) or not hasattr(scale, "__float__"):
        raise bad_type
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            f"{fn}: `scale` must be a Python float, but a traced value was given (under "
            "jax.jit, grad or vmap): the scale is compiled into the kernels. Pass a float, or "
            "put a learnable or per-call scale into a score_mod, "
            "`lambda score, b, h, q_idx, kv_idx: score * my_scale`, with scale=1.0."
        ) from None
    except (TypeError, ValueError):
        raise bad_type from None
    if not math.isfinite(value) or abs(value) > MAX_SCALE:
        raise ValueError(
            f"{fn}: `scale` must be finite with |scale| <= 2**20 ({MAX_SCALE:.0f}), got "
            f"{value!r}: scores are float32, and beyond that an ordinary q·k leaves the softmax"
            " too few bits to stay finite. Scale q (or k) down instead.")
    return value


def returns_its_score(score_mod: Callable[..., jax.Array], dtype) -> bool:
    """Whether score_mod returns its score unchanged: traced on scalars, it computes nothing
    (transformers passes such a mod when it has no softcap or head mask). A mod that cannot
    be traced on scalars is not."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        # (through a fresh function: make_jaxpr caches a trace by the function's identity,
        # and what a mod reads — a rebound global, a config's attribute — may have changed)
        closed = jax.make_jaxpr(lambda *args: score_mod(*args))(
            jax.ShapeDtypeStruct((), dtype), *[scalar] * 4)
    except Exception:  # its errors are checked_score_mod's to explain, at the call's shapes
        return False
    jaxpr = jaxpr_and_consts(closed)[0]
    return not jaxpr.eqns and list(jaxpr.outvars) == [jaxpr.invars[0]]


def checked_score_mod(score_mod: Callable[..., jax.Array], fn: str,
                      scores: tuple[int, ...]) -> Callable[..., jax.Array]:
    """score_mod, with clear errors (naming `fn` and the call's [B, Hq, L, S] `scores`) for
    the common mistakes: a wrong parameter list, Python control flow on the arguments, a result
    that is not one value per score. Its result has the score's dtype (float32; float64 for
    float64 inputs): an integer or bool result (`q_idx - kv_idx`) is converted, as torch's
    flex_attention promotes it."""
    check_parameters(fn, "score_mod", score_mod, SCORE_PARAMETERS)

    def checked(score, b, h, q_idx, kv_idx):
        with traced_values_explained(fn, "score_mod", score_mod):
            out = score_mod(score, b, h, q_idx, kv_idx)
        if jnp.issubdtype(jnp.result_type(out), jnp.complexfloating):
            raise TypeError(f"{fn}: `score_mod` must return real scores, but "
                            f"{name_of(score_mod)} returned {jnp.result_type(out)}.")
        shape = jnp.shape(out)
        if len(shape) != score.ndim or any(n not in (1, m) for n, m in zip(shape, score.shape)):
            raise ValueError(
                f"{fn}: `score_mod` must return one float per score, an array shaped like its "
                f"`score` argument (e.g. `score + bias[h]`), but {name_of(score_mod)} returned "
                f"{jnp.result_type(out)} of shape {tuple(jnp.shape(out))} for a score of shape "
                f"{tuple(score.shape)} (jattn calls it on blocks of the [B, Hq, L, S] = "
                f"{list(scores)} scores); did it reduce over an axis, or return a constant?")
        # (a result that does not vary along an index, `q_idx - kv_idx`, has ones there)
        return jnp.broadcast_to(out.astype(score.dtype), score.shape)
    return checked


def checked_mask_mod(mask_mod: Callable[..., jax.Array], fn: str) -> Callable[..., jax.Array]:
    """mask_mod, with clear errors (naming `fn`) for a wrong parameter list, Python control
    flow on the arguments and a result that is not bool; the result is broadcast to the
    indices' shape."""
    check_parameters(fn, "mask_mod", mask_mod, MASK_PARAMETERS)

    def checked(b, h, q_idx, kv_idx):
        with traced_values_explained(fn, "mask_mod", mask_mod):
            out = mask_mod(b, h, q_idx, kv_idx)
        if jnp.result_type(out) != jnp.bool_:
            raise TypeError(f"{fn}: `mask_mod` must return bool, got {jnp.result_type(out)}; "
                            "compare instead (e.g. `q_idx >= kv_idx`).")
        shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx), jnp.shape(b),
                                     jnp.shape(h))
        return jnp.broadcast_to(out, shape)
    return checked


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def tile_signature(block_q: int, block_k: int, *, transposed: bool = False):
    """Mod arguments on a kernel tile: [queries, keys], or transposed [keys, queries]."""
    if transposed:
        score = jax.ShapeDtypeStruct((block_k, block_q), jnp.float32)
        return score, (_i32(), _i32(), _i32(1, block_q), _i32(block_k, 1))
    score = jax.ShapeDtypeStruct((block_q, block_k), jnp.float32)
    return score, (_i32(), _i32(), _i32(block_q, 1), _i32(1, block_k))


def trace_mods(score_mod, mask_mod, score_set: CaptureSet, mask_set: CaptureSet, score_sig,
               index_sig, *, with_vjp: bool = True) -> Mods:
    """score_mod (and, with_vjp, its vjp) and mask_mod traced at one signature; None absent."""
    score = score_vjp = mask = None
    if score_mod is not None:
        score = score_set.trace(score_mod, (score_sig, *index_sig))
    if score_mod is not None and with_vjp:

        def score_vjp_fn(s, b, h, q_idx, kv_idx, d_out):
            def score_of(x):
                return score_mod(x, b, h, q_idx, kv_idx)

            out, pullback = jax.vjp(score_of, s)
            if varying_axes(out) - varying_axes(s):
                # Inside shard_map, a mod closing over a value that varies over a mesh axis (a
                # device index) varies too. Its pullback at an unvarying score would sum over
                # the axis (a psum in a kernel): linearise at a score varying like the result.
                out, pullback = jax.vjp(score_of, aligned(s, out)[0])
            return pullback(aligned(d_out, out)[0])[0]

        score_vjp = score_set.trace(score_vjp_fn, (score_sig, *index_sig, score_sig))
    if mask_mod is not None:
        mask = mask_set.trace(mask_mod, index_sig)
    return Mods(score, score_vjp, mask)


def without_captures(mods: Mods) -> Mods:
    """mods holding no captured arrays (see TracedFunction.without_captures)."""
    return Mods(*(None if f is None else f.without_captures()
                  for f in (mods.score, mods.score_vjp, mods.mask)))
