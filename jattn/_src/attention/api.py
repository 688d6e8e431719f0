"""Public flex attention: validation, the backend's program (cached) and its derivatives (a
custom_jvp whose tangents transpose to the backward's kernels)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jattn._src import backends, compat, guards, hardware, index_bounds, precision
from jattn._src.attention import pallas_mosaic_gpu, pallas_triton, xla
from jattn._src.attention.common import (Problem, canonical_scale, checked_mask_mod,
                                         checked_score_mod, returns_its_score, trace_mods,
                                         without_captures)
from jattn._src.attention.config import AttentionConfig, heuristic_config
from jattn._src.attention.dropout import NO_DROPOUT, Dropout, checked_dropout, with_seed
from jattn._src.attention.sinks import checked_sinks, with_sinks
from jattn._src.masks.block_mask import (DEFAULT_BLOCK, BlockMask, MaskLists,
                                         check_block_counts)
from jattn._src.masks.fitting import fitted
from jattn._src.mesh_axes import summed_to_vary_like
from jattn._src.programs import ProgramCache
from jattn._src.tiling import cdiv
from jattn._src.user_functions import CaptureSet

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32),
           jnp.dtype(jnp.float64))
ScoreMod = Callable[..., jax.Array]


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, enable_gqa: bool) -> None:
    # (on every eager call's path: each shape and dtype read once)
    shapes = q.shape, k.shape, v.shape
    for name, shape in zip("qkv", shapes):
        if len(shape) != 4:
            raise ValueError(f"flex_attention: `{name}` must be [batch, heads, length, dim], got "
                             f"shape {shape}.")
    dtype = q.dtype
    if dtype not in _DTYPES or not dtype == k.dtype == v.dtype:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dtype not in _DTYPES:
                raise TypeError(f"flex_attention: `{name}` has dtype {x.dtype}; supported are "
                                "bfloat16, float16, float32 and (with jax_enable_x64) float64.")
        raise TypeError(f"flex_attention: q, k and v must share a dtype, got {q.dtype}, "
                        f"{k.dtype} and {v.dtype}.")
    (B, Hq, _, E), (Bk, Hkv, S, Ek), v_shape = shapes
    if not all(type(d) is int for shape in shapes for d in shape[1:]):
        raise ValueError(f"flex_attention: only the batch dim may be symbolic (jax.export), got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}: heads, lengths and head dims "
                         "fix the kernels' blocks; export with them concrete.")
    if 0 in (E, v_shape[-1]):
        raise ValueError(f"flex_attention: head dims must be at least 1, got q {q.shape} and "
                         f"v {v.shape}.")
    if 0 in (Hq, Hkv):
        raise ValueError(f"flex_attention: q and k/v need at least one head, got q {q.shape} "
                         f"and k {k.shape}.")
    if Ek != E:
        raise ValueError(f"flex_attention: q {q.shape} and k {k.shape} must have the same head "
                         "dim (last axis).")
    if v_shape[:3] != (Bk, Hkv, S):
        raise ValueError(f"flex_attention: k {k.shape} and v {v.shape} must agree on batch, "
                         "heads and length.")
    if Bk not in (B, 1):
        raise ValueError(f"flex_attention: k/v batch {Bk} must equal q's batch {B} or be 1 "
                         "(broadcast).")
    if Hq % Hkv:
        raise ValueError(f"flex_attention: query heads {Hq} must be a multiple of kv heads "
                         f"{Hkv} (q {q.shape}, k {k.shape}).")
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"flex_attention: q has {Hq} heads and k/v {Hkv}; pass "
                         "enable_gqa=True for grouped-query attention.")


def _check_block_mask(block_mask: BlockMask, B: int, Hq: int, L: int, S: int) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError("flex_attention: `block_mask` must be a jattn.BlockMask (see "
                        f"jattn.create_block_mask), got {type(block_mask).__name__}.")
    check_block_counts(block_mask, "flex_attention")
    Bm, Hm, Lm, Sm = block_mask.shape
    if (Lm, Sm) != (L, S):
        raise ValueError(f"flex_attention: block_mask was built for Q_LEN={Lm}, KV_LEN={Sm} but "
                         f"q has length {L} and k {S}; build it with these lengths.")
    if Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"flex_attention: block_mask batch/heads ({Bm}, {Hm}) must be 1 or "
                         f"match q's ({B}, {Hq}).")


def _full_block_mask(L: int, S: int) -> BlockMask:
    """Every block full: plain attention through the same machinery. Built with numpy, so
    under jit the lists are constants rather than ops run on every call."""
    block = (DEFAULT_BLOCK, DEFAULT_BLOCK)
    n_q, n_kv = cdiv(L, block[0]), cdiv(S, block[1])

    def lists(rows: int, columns: int):  # (no partial blocks, every column full) per row
        # Tiled, not np.broadcast_to: JAX turns a zero-stride constant into a broadcast that
        # XLA runs as a kernel of its own on every call.
        indices = np.tile(np.arange(columns, dtype=np.int32), (1, 1, rows, 1))
        return (np.zeros((1, 1, rows), np.int32), indices, np.full((1, 1, rows), columns,
                                                                    np.int32), indices)

    kv_lists, q_lists = lists(n_q, n_kv), lists(n_kv, n_q)
    return BlockMask(*kv_lists, *q_lists, block_size=block, seq_lengths=(L, S), mask_mod=None)


# ------------------------------------------------------------------------------------------------
# Implementations
# ------------------------------------------------------------------------------------------------

_OP = "flex_attention"


def _kernels_unsupported(*, dtype=None, **_) -> str | None:
    if dtype is not None and jnp.dtype(dtype) == jnp.float64:
        return "the kernels accumulate in float32; float64 inputs run on xla."
    return None


backends.register_xla_and_kernels(_OP, xla, pallas_triton, config_class=AttentionConfig,
                                  heuristic=heuristic_config, unsupported=_kernels_unsupported)
backends.register(backends.Implementation(
    _OP, backends.PALLAS_MOSAIC_GPU, pallas_mosaic_gpu,
    unsupported=pallas_mosaic_gpu.unsupported, slower=pallas_mosaic_gpu.slower,
    config_class=AttentionConfig, heuristic=heuristic_config))


# ------------------------------------------------------------------------------------------------
# Differentiation: a custom_jvp whose tangents transpose to the backward's kernels
# ------------------------------------------------------------------------------------------------

class Residuals(NamedTuple):
    """What the backward reads: the inputs, the outputs, and which captured arrays of score_mod
    are being differentiated."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    lists: MaskLists
    score_captures: tuple[Any, ...]
    mask_captures: tuple[Any, ...]
    out: jax.Array
    lse: jax.Array
    differentiated: tuple[bool, ...]


def _forward(p: Problem, q, k, v, lists, score_caps, mask_caps):
    """p's forward, jitted: under jax.jit, JAX traces the custom_jvp's primal (for the staged
    call) and its JVP rule (when differentiating) separately, and both call this; jit's trace
    cache makes the second a lookup instead of tracing the forward's kernels again. One jit per
    Problem, holding it weakly, so that JAX's trace caches drop a problem's traces when its
    program is evicted (one jit taking the Problem as a static argument would keep every
    problem alive in them)."""
    forward = _FORWARDS.get(p)
    if forward is None:
        problem = weakref.ref(p)

        def run(q, k, v, lists, score_caps, mask_caps):
            p = problem()
            with precision.applied(p.precision):
                return p.implementation.module.forward(p, q, k, v, lists, score_caps,
                                                       mask_caps)

        forward = _FORWARDS.setdefault(p, jax.jit(run))
    return forward(q, k, v, lists, score_caps, mask_caps)


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Problem -> its jit


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _flex(p: Problem, q, k, v, lists, score_caps, mask_caps):
    return _forward(p, q, k, v, lists, score_caps, mask_caps)


def _flex_jvp(p: Problem, primals, tangents):
    """The forward's kernels give the outputs; their tangents are a linear function of the
    inputs' (`_tangents`: the XLA forward's JVP) whose transpose is the backward's kernels
    (`_transposed`), so jax.grad runs exactly the forward and backward kernels while jax.jvp
    and jax.jacfwd run the JVP. symbolic_zeros: inputs nobody differentiates (and captured
    arrays that are not floating point) are left out of both."""
    q, k, v, lists, score_caps, mask_caps = primals
    dq, dk, dv, _, d_caps, _ = tangents
    outputs = (_forward(p, *primals) if p.implementation.backend is backends.XLA
               else _kernel_forward(p, *primals))
    differentiated = tuple(not isinstance(t, SymbolicZero) and jnp.issubdtype(
        jnp.result_type(c), jnp.floating) for t, c in zip(d_caps, score_caps))
    linear = (*(None if isinstance(t, SymbolicZero) else t for t in (dq, dk, dv)),
              tuple(t if wanted else None for t, wanted in zip(d_caps, differentiated)))
    residuals = (q, k, v, lists, tuple(score_caps), tuple(mask_caps), *outputs[:2])
    moving = tuple(t is not None for t in linear[:3])
    tangents_out = compat.linear_call_with_batching(
        functools.partial(_tangents, p),
        functools.partial(_transposed, p, moving, differentiated), residuals, linear)
    return outputs, tangents_out


_flex.defjvp(_flex_jvp, symbolic_zeros=True)


def _tangents(p: Problem, residuals, linear):
    """The outputs' tangents from the inputs' (None: not differentiated), by the
    implementation's `tangents`. The rows' largest scores have none, as in the backward."""
    with precision.applied(p.precision):
        return p.implementation.module.tangents(p, residuals, linear)


def _transposed(p: Problem, moving, differentiated, residuals, cotangents):
    """The transpose of `_tangents`: the backward's kernels on the outputs' cotangents, for the
    inputs `_tangents` took (moving: q, k, v each; differentiated: the score_mod's captured
    arrays)."""
    q, k, v, lists, score_caps, mask_caps, out, lse = residuals
    res = Residuals(q, k, v, lists, score_caps, mask_caps, out, lse, differentiated)
    dq, dk, dv, d_caps = _backward(p, res, cotangents[0], cotangents[1])
    return (*(d if wanted else None for d, wanted in zip((dq, dk, dv), moving)),
            tuple(d if wanted else None for d, wanted in zip(d_caps, differentiated)))


def _backward(p: Problem, res: Residuals, d_out, d_lse):
    """(dq, dk, dv, the captured arrays' gradients) of the saved residuals; d_lse None: the
    LSE's cotangent is zero (no work is spent on it)."""
    d_lse = None if d_lse is None else d_lse.astype(res.lse.dtype)
    with precision.applied(p.precision):  # (the backward is traced after the forward's scope)
        if p.implementation.backend is backends.XLA:  # (itself differentiable: jax.hessian)
            dq, dk, dv, d_caps = p.implementation.module.backward(p, res, d_out, d_lse)
        else:
            dq, dk, dv, d_caps = _kernel_backward(p, res.differentiated, res[:-1], d_out,
                                                  d_lse)
    dq, dk, dv = (summed_to_vary_like(d, x) for d, x in ((dq, res.q), (dk, res.k), (dv, res.v)))
    d_caps = [summed_to_vary_like(d, c) for d, c in zip(d_caps, res.score_captures)]
    return dq, dk, dv, d_caps


# A Pallas implementation's kernels have no derivative of their own: a gradient of a gradient
# (jax.hessian) differentiates the JVP rule's forward and the backward, which raises this
# rather than an error from inside Pallas. (XLA's forward and backward are differentiable.)
def _no_second_derivative(p: Problem, *_):
    raise NotImplementedError(
        f"flex_attention: second derivatives (a gradient of a gradient, jax.hessian) run on "
        f"implementation='xla' only: {p.implementation.name}'s kernels have no derivative. "
        "Pass implementation='xla' to the call you differentiate twice.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _kernel_forward(p: Problem, q, k, v, lists, score_caps, mask_caps):
    return _forward(p, q, k, v, lists, score_caps, mask_caps)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_backward(p: Problem, differentiated, residuals, d_out, d_lse):
    return p.implementation.module.backward(p, Residuals(*residuals, differentiated), d_out,
                                            d_lse)


_kernel_forward.defjvp(_no_second_derivative)
_kernel_backward.defjvp(_no_second_derivative)


# ------------------------------------------------------------------------------------------------
# Programs: one per problem, reused by every call with the same problem
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """The jitted forward (and the torch ops' backward) of one Problem."""

    problem: Problem
    forward: Callable[..., Any]
    backward: Callable[..., Any]

    @classmethod
    def make(cls, problem: Problem) -> _Program:
        def backward(q, k, v, lists, score_caps, mask_caps, out, lse, d_out, d_lse,
                     differentiated):
            wanted = differentiated or (True,) * len(score_caps)
            differentiated = tuple(jnp.issubdtype(jnp.result_type(c), jnp.floating) and w
                                   for c, w in zip(score_caps, wanted))
            res = Residuals(q, k, v, lists, tuple(score_caps), tuple(mask_caps), out, lse,
                            differentiated)
            return _backward(problem, res, d_out, d_lse)

        return cls(problem, jax.jit(functools.partial(_flex, problem)),
                   jax.jit(backward, static_argnums=10))


_PROGRAMS: ProgramCache[_Program] = ProgramCache("flex_attention.programs")


def flex_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   score_mod: ScoreMod | None = None, block_mask: BlockMask | None = None, *,
                   scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, config: AttentionConfig | None = None,
                   implementation: str | None = None, precision: str | None = None,
                   sinks: jax.Array | None = None, return_max_scores: bool = False,
                   dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                   deterministic: bool = True):
    """softmax(score_mod(scale · q·kᵀ) where block_mask/mask_mod allow) · v.

    Args:
      q: [B, Hq, L, E]; k: [B|1, Hkv, S, E]; v: [B|1, Hkv, S, Ev] — bfloat16, float16, float32
        or (with jax_enable_x64, on the xla implementation) float64, one dtype. Hq must be a
        multiple of Hkv (enable_gqa=True when they differ); query head h reads kv head
        h // (Hq // Hkv). Any L, S, E, Ev (ragged tiles are masked).
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` on float32 scores (float64 for
        float64 inputs; after scale) and broadcastable int32 indices; arrays it closes over
        become kernel inputs and get gradients. An index into such an array that certainly
        leaves it raises ValueError (docs/attention.md).
      block_mask: from `jattn.create_block_mask` / `BlockMask.from_kv_blocks`, built for (L, S);
        partial blocks apply its mask_mod, full blocks skip it, other blocks are never visited.
        None attends everywhere.
      scale: score scale, a Python float with |scale| <= 2**20 (a learnable one belongs in
        score_mod), default 1/sqrt(E). return_lse: also return the natural-log LSE.
      config: an AttentionConfig for the kernels (None: heuristic; the XLA implementation has
        no tunables and ignores it). implementation: "pallas_mosaic_gpu", "pallas_triton",
        "xla" or "interpret" (default: $JATTN_IMPLEMENTATION, else by platform and call; see
        docs/configs.md; `jattn.explain` says which and why).
      precision: float32 products, by `jax.default_matmul_precision`'s names: None keeps the
        caller's setting (JAX's default: TF32 on the GPU), "highest" gives full float32 products
        in the kernels and XLA alike (torch's flex_attention default). No effect on bf16/fp16.
      sinks: attention sinks, one logit per query head [Hq] (float32, learnable: it gets a
        gradient): each row's softmax counts exp(sinks[h]) in its denominator as a key no
        value belongs to (gpt-oss, StreamingLLM); the LSE returned includes it.
      return_max_scores: also return each row's largest score (after scale and score_mod,
        among the keys it attends to; torch's AuxRequest(max_scores=True)), as for monitoring
        or clipping logits. Not differentiated. The pallas_mosaic_gpu forward does not keep
        it: such a call runs on pallas_triton.
      dropout_rate, dropout_key: dropout of the attention weights (a Python float in [0, 1)
        and a JAX PRNG key, which may be traced; split it anew each step): each weight is kept
        with probability 1 - rate and scaled by 1 / (1 - rate), the same mask on every
        implementation for a given key, regenerated in the backward (nothing of size L x S is
        stored). The LSE is the softmax's, before dropout. On Hopper such a call runs on
        pallas_triton unless implementation="pallas_mosaic_gpu" asks for those kernels
        (docs/attention.md).
      deterministic: True (default) makes the gradients bitwise equal from run to run. False
        lets the backward add partial sums in the order they arrive where that is faster:
        the pallas_mosaic_gpu backward at head dim 64 then computes dQ inside its dK/dV
        kernel with TMA reduce-adds into a float32 accumulator (five matrix products where
        its two deterministic kernels take seven; 1.13x faster on the H200,
        benchmarks/RESULTS.md), and the gradients' last bits vary between runs. No effect
        elsewhere.

    Returns:
      out [B, Hq, L, Ev] of q's dtype; with return_lse also the float32 LSE [B, Hq, L] (float64
      for float64 inputs); with return_max_scores also the largest scores [B, Hq, L] (the
      LSE's dtype; -inf where a row attends to nothing), after the LSE when both are asked.
      A query that attends to nothing (S = 0 included) gives 0 and LSE -inf; B = 0 or L = 0
      give empty results. A key a query never reads (outside its blocks) cannot affect it,
      NaN included. Differentiable in q, k, v, captured arrays of score_mod and (through its
      cotangent) the LSE.

    Example::

        L = 256
        q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, L, 32), jnp.bfloat16)
        mask = jattn.create_block_mask(jattn.masks.causal_mask, None, None, L, L)
        out = jax.jit(lambda q, k, v: jattn.flex_attention(
            q, k, v, lambda s, b, h, q_idx, kv_idx: s + 0.1 * (kv_idx - q_idx), mask))(q, k, v)
        print(out.shape, out.dtype)  # (1, 2, 256, 32) bfloat16

    Eager calls reuse compiled programs: a call with the same shapes, dtypes, options and mods
    (mods reading the same Python values; a changed scalar inside a mod is a new computation)
    neither traces nor compiles. Arrays the mods close over are arguments, so new values
    reuse the program.
    """
    if sinks is not None:
        sinks = checked_sinks(_OP, sinks, jnp.shape(q)[1] if jnp.ndim(q) == 4 else None)
    result = flex_attention_with_captures(q, k, v, score_mod, block_mask, scale=scale,
                                          enable_gqa=enable_gqa,
                                          return_lse=return_lse or sinks is not None,
                                          config=config, implementation=implementation,
                                          precision=precision,
                                          return_max_scores=return_max_scores,
                                          dropout=checked_dropout(_OP, dropout_rate,
                                                                  dropout_key),
                                          deterministic=deterministic)
    if sinks is None:
        return result
    out, lse, *largest = result  # (the sinks are not keys: the largest scores stand)
    out, lse = with_sinks(out, lse, sinks)
    extra = ((lse,) if return_lse else ()) + tuple(largest)
    return (out, *extra) if extra else out


def flex_attention_with_captures(q, k, v, score_mod=None, block_mask=None, *,
                                 score_captures=(), mask_captures=(), scale=None,
                                 enable_gqa=False, return_lse=False, config=None,
                                 implementation=None, precision=None, return_max_scores=False,
                                 dropout: Dropout = NO_DROPOUT, deterministic: bool = True):
    """flex_attention, told which arrays score_mod and the mask_mod read (the torch ops know):
    the program takes them first, in this order, as `flex_attention_backward` does. dropout:
    the call's checked dropout (`attention.dropout.checked_dropout`); deterministic: as
    flex_attention's."""
    if not (isinstance(q, jax.Array) and isinstance(k, jax.Array) and isinstance(v, jax.Array)):
        q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    block_mask = _check_call(q, k, v, score_mod, block_mask, enable_gqa)
    max_scores = bool(return_max_scores)
    empty = _empty_result(q, k, v)
    if empty is not None:
        out, lse = empty
        largest = lse  # (-inf: nothing attended)
    else:
        program, lists, score_caps, mask_caps = _prepare(
            q, k, v, score_mod, block_mask, scale, enable_gqa, config, implementation, precision,
            (score_captures, mask_captures), max_scores=max_scores, dropout=dropout,
            deterministic=deterministic)
        out, lse, *largest = program.forward(q, k, v, lists, score_caps,
                                             with_seed(mask_caps, dropout.seed))
        largest = largest[0] if largest else None
    extra = ((lse,) if return_lse else ()) + ((largest,) if max_scores else ())
    return (out, *extra) if extra else out


def flex_attention_backward(q, k, v, out, lse, d_out, d_lse, score_mod=None, block_mask=None, *,
                            score_captures=(), mask_captures=(), scale=None, enable_gqa=False,
                            config=None, implementation=None, precision=None,
                            differentiated=None, dropout: Dropout = NO_DROPOUT,
                            deterministic: bool = True):
    """Gradients of `flex_attention_with_captures(q, k, v, score_mod, block_mask,
    score_captures=..., mask_captures=..., return_lse=True)` from its saved outputs (out, lse)
    and their cotangents, without running the forward again: the backward `jax.vjp` runs, of
    the forward's cached program. (The torch ops' entry point: their autograd keeps out and lse.)

    d_lse may be None: the LSE's cotangent is zero (no work is spent on it).

    Returns (dq, dk, dv, d_score_captures): for each of `score_captures`, in order, its gradient
    (zeros if score_mod does not read it), or None if it is not floating point or
    `differentiated` (a bool per score capture; default: every floating one) leaves it out:
    a captured array's gradient costs a pass of its own. dropout: the forward's;
    deterministic: as flex_attention's.
    """
    block_mask = _check_call(q, k, v, score_mod, block_mask, enable_gqa)
    if differentiated is not None:
        differentiated = tuple(map(bool, differentiated))
    if _empty_result(q, k, v) is not None:  # nothing attended: every gradient is zero
        wanted = differentiated or (True,) * len(score_captures)
        return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
                [jnp.zeros_like(c) if w and jnp.issubdtype(jnp.result_type(c), jnp.floating)
                 else None for c, w in zip(score_captures, wanted)])
    program, lists, score_caps, mask_caps = _prepare(
        q, k, v, score_mod, block_mask, scale, enable_gqa, config, implementation, precision,
        (score_captures, mask_captures), dropout=dropout, deterministic=deterministic)
    dq, dk, dv, d_score_caps = program.backward(q, k, v, lists, score_caps,
                                                with_seed(mask_caps, dropout.seed), out, lse,
                                                d_out, d_lse, differentiated)
    return dq, dk, dv, list(d_score_caps[:len(score_captures)])


def _check_call(q, k, v, score_mod, block_mask, enable_gqa) -> BlockMask | None:
    """The checks every entry point makes once: the arrays, the mod, a given BlockMask (which
    comes back fitted to the kernels' blocks)."""
    _check_inputs(q, k, v, enable_gqa)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex_attention: `score_mod` must be callable, got {score_mod!r}.")
    if block_mask is None:
        return None
    (B, Hq, L, _), S = q.shape, k.shape[2]
    _check_block_mask(block_mask, B, Hq, L, S)
    return fitted(block_mask)


def _empty_result(q, k, v):
    """(out, lse) of a checked call with an empty batch, query or key axis (every
    implementation alike: empty, or zeros and LSE -inf where no key exists); None for every
    other call."""
    (B, Hq, L, _), S = q.shape, k.shape[2]
    if B and L and S:
        return None
    # (*_like: on q's device, as a computed result would be, not the default device)
    return (jnp.zeros_like(q, shape=(B, Hq, L, v.shape[-1])),
            jnp.full_like(q, -jnp.inf, _compute_dtype(q.dtype), shape=(B, Hq, L)))


def _compute_dtype(dtype) -> Any:
    """Scores, softmax and LSE: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _prepare(q, k, v, score_mod, block_mask, scale, enable_gqa, config, implementation,
             precision_name, known_captures=((), ()), *, max_scores: bool = False,
             dropout: Dropout = NO_DROPOUT, deterministic: bool = True):
    """The checked call's program: (program, mask lists, score_mod's and mask_mod's captured
    arrays). An eager call whose mods read what an earlier one's read (guards.read_state)
    replays that call's plan without tracing; otherwise `_traced_program`. known_captures:
    arrays the caller knows score_mod and mask_mod read, given the first slots. max_scores:
    the program's forward also returns the rows' largest scores. dropout: the call's; its
    rate and sharing are the program's, whose forward then takes the seed after the mask_mod's
    captures. deterministic: flex_attention's, checked here.
    """
    scale, precision_name = _canonical_options(q, config, scale, precision_name)
    if not isinstance(deterministic, bool):
        raise TypeError(f"flex_attention: `deterministic` must be True or False, got "
                        f"{deterministic!r}.")
    dropout_spec = (dropout.rate, dropout.shared)
    dense = block_mask is None
    state = guards.read_state(score_mod, None if dense else block_mask.mask_mod)
    key = _plan_key(q, k, v, state, known_captures, block_mask, scale, enable_gqa, config,
                    implementation, precision_name, max_scores, dropout_spec, deterministic)
    plan = None if key is None else _PLANS.get(key)
    if plan is not None:
        return plan.replayed(block_mask, state)
    if dense:
        block_mask = _full_block_mask(q.shape[2], k.shape[2])
    program, score_caps, mask_caps = _traced_program(
        q, k, v, score_mod, block_mask, dense, scale, config, implementation, precision_name,
        known_captures, max_scores, dropout_spec, deterministic)
    lists = block_mask.lists()
    if key is not None:
        _remember_plan(key, program, state, score_caps, mask_caps, lists if dense else None)
    return program, lists, score_caps, mask_caps


def _canonical_options(q, config, scale, precision_name) -> tuple[float, str | None]:
    """(scale, precision) as the programs take them; a bad config raises."""
    if config is not None and not isinstance(config, AttentionConfig):
        raise TypeError(f"flex_attention: `config` must be an AttentionConfig, got {config!r}.")
    return canonical_scale(_OP, scale, q.shape[-1]), precision.canonical(_OP, precision_name)


def _plan_key(q, k, v, state: guards.State, known_captures, block_mask, *options) -> tuple | None:
    """The key of an eager call's plan: what the mods read, shapes, options and the
    BlockMask's static fields. None where no plan applies: arrays traced by an outer
    transformation, captures the caller names, mods reading what guards cannot record, or
    `jattn.explain` asking which implementation the call resolves to."""
    tracer = jax.core.Tracer
    if (state.record is None or known_captures != ((), ()) or backends.explaining()
            or isinstance(q, tracer) or isinstance(k, tracer) or isinstance(v, tracer)):
        return None
    return (state.record, q.shape, k.shape, v.shape, q.dtype, *options,
            None if block_mask is None else _static_fields(block_mask),
            backends.requested_implementation(), hardware.default_platform())


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What an eager call reuses when its mods read what an earlier call's read: the program,
    where the mods' captured arrays come from (`guards.fetch`), and a dense call's lists."""

    program: _Program
    score_sources: tuple
    mask_sources: tuple
    lists: MaskLists | None

    def replayed(self, block_mask: BlockMask | None, state: guards.State):
        """`_prepare`'s result for a call whose mods read `state`."""
        return (self.program, self.lists if block_mask is None else block_mask.lists(),
                tuple(guards.fetch(self.score_sources, state.arrays)),
                tuple(guards.fetch(self.mask_sources, state.arrays)))


# Plans by the mods' guards record, shapes, options and the BlockMask's static fields.
_PLANS: ProgramCache[_Plan] = ProgramCache("flex_attention.plans")


def _remember_plan(key, program: _Program, state: guards.State, score_caps, mask_caps,
                   dense_lists: MaskLists | None) -> None:
    """Stores the plan of a traced eager call, unless it would hold a traced value past the
    call (a capture, or a dense call's lists made inside another function's trace)."""
    sources = [guards.sources_of(list(caps), state.arrays) for caps in (score_caps, mask_caps)]
    if dense_lists is not None:
        dense_lists = jax.device_put(dense_lists)  # moved to the device once
    if None not in sources and not any(isinstance(x, jax.core.Tracer)
                                       for x in jax.tree.leaves(dense_lists)):
        _PLANS.put(key, _Plan(program, *sources, dense_lists))


def _static_fields(block_mask: BlockMask) -> tuple:
    """What a program depends on in a BlockMask besides its lists' values (its mask_mod is
    guarded apart)."""
    return (block_mask.block_size, block_mask.seq_lengths, block_mask.kv_num_blocks.shape,
            block_mask.full_kv_num_blocks is None)


def _traced_program(q, k, v, score_mod, block_mask, dense, scale, config, implementation,
                    precision_name, known_captures, max_scores, dropout_spec, deterministic):
    """The slow path: (program, score captures, mask captures) of a call, its mods traced."""
    (B, Hq, L, E), (Bk, Hkv, S, _), Ev = q.shape, k.shape, v.shape[-1]
    if score_mod is not None and returns_its_score(score_mod, _compute_dtype(q.dtype)):
        score_mod = None  # (an unconditional mod, as transformers passes: no mod's costs)
    user_mods = (score_mod, block_mask.mask_mod)
    score_mod = None if score_mod is None else checked_score_mod(score_mod, _OP, (B, Hq, L, S))
    mask_mod = None if block_mask.mask_mod is None else checked_mask_mod(block_mask.mask_mod,
                                                                         _OP)
    score_set, mask_set = (CaptureSet(known) for known in known_captures)
    xla_mods = trace_mods(score_mod, mask_mod, score_set, mask_set,
                          *xla.block_signature(B, Hkv, Hq // Hkv, L, block_mask.block_size[1],
                                               _compute_dtype(q.dtype)),
                          with_vjp=False)
    # The traces' texts, which key the program (computed once: each is a jaxpr printed).
    mod_keys = tuple(None if f is None else f.key for f in (xla_mods.score, xla_mods.mask))
    index_bounds.check_mods(_OP, zip(("score_mod", "mask_mod"), user_mods, mod_keys),
                            dict(b=B, h=Hq, q_idx=L, kv_idx=S))
    lists = block_mask.lists()
    implementation = backends.resolve(
        _OP, implementation, dtype=q.dtype, head_dim=E, value_dim=Ev, seq_lengths=(L, S),
        block_size=block_mask.block_size, score_mod=score_mod is not None,
        unreadable_capture=_unreadable_capture(score_mod, mask_mod, score_set, mask_set,
                                               mod_keys, (L, S)),
        max_scores=max_scores, dropout=dropout_spec[0] > 0)
    key = (q.shape, k.shape, v.shape, q.dtype, scale, precision_name, implementation, config,
           dense, block_mask.block_size, block_mask.shape, lists.has_full, max_scores,
           dropout_spec, deterministic, *mod_keys)
    program = _PROGRAMS.get(key)
    if program is None:
        found = len(score_set.captures), len(mask_set.captures)
        problem = Problem(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, kv_batch=Bk,
                          mask_batch=block_mask.shape[0], mask_heads=block_mask.shape[1],
                          mask_block=block_mask.block_size, scale=scale,
                          precision=precision_name, implementation=implementation,
                          config=None, fwd=xla_mods, bwd=xla_mods, dkdv=xla_mods, xla=xla_mods,
                          dense=dense, compute_dtype=_compute_dtype(q.dtype),
                          max_scores=max_scores, dropout=dropout_spec[0],
                          dropout_shared=dropout_spec[1], deterministic=deterministic)
        problem = implementation.module.specialise(
            problem, score_mod=score_mod, mask_mod=mask_mod, score_set=score_set,
            mask_set=mask_set, block_mask=block_mask, config=config)
        program = _Program.make(_without_captures(problem))
        if (len(score_set.captures), len(mask_set.captures)) == found:
            program = _PROGRAMS.put(key, program)
        # else the mods captured arrays at the kernels' tiles that they did not at the XLA
        # block (arrays made from the shapes they see): the program is this call's alone.
    if program.problem.backward_fallback is not None:
        backends.annotate(_OP, f"backward on pallas_triton ({implementation.name}'s "
                               f"backward: {program.problem.backward_fallback})")
    return program, tuple(score_set.captures), tuple(mask_set.captures)


# The `unreadable_capture` fact by the mods' XLA traces (it needs a trace at another shape).
_UNREADABLE: ProgramCache[tuple[str | None]] = ProgramCache("flex_attention.unreadable")


def _unreadable_capture(score_mod, mask_mod, score_set: CaptureSet, mask_set: CaptureSet,
                        mod_keys: tuple, seq_lengths: tuple[int, int]) -> str | None:
    """The fact of mods reading captured arrays (or arrays they build, as
    `jnp.arange(n)[q_idx]`) in ways the Mosaic GPU forward cannot; mod_keys: the keys of
    their XLA traces. Off Hopper that forward cannot run at all, so the fact is not needed."""
    if (score_mod is None and mask_mod is None) or not hardware.is_hopper():
        return None
    key = (seq_lengths, *mod_keys)
    fact = _UNREADABLE.get(key)
    if fact is None:
        fact = _UNREADABLE.put(key, (pallas_mosaic_gpu.unreadable_capture(
            score_mod, mask_mod, score_set.captures, mask_set.captures, seq_lengths),))
    return fact[0]


def _without_captures(problem: Problem) -> Problem:
    """The problem holding no captured array: each call passes its own."""
    mods = {name: without_captures(getattr(problem, name))
            for name in ("fwd", "bwd", "dkdv", "xla")}
    decode = problem.decode
    if decode is not None:
        decode = dataclasses.replace(decode, mods=without_captures(decode.mods))
    mosaic = {}
    if problem.mosaic_backward is not None:
        mosaic["mosaic_backward"] = tuple(map(without_captures, problem.mosaic_backward))
    if problem.mosaic_dropout is not None:
        mosaic["mosaic_dropout"] = tuple(f.without_captures() for f in problem.mosaic_dropout)
    return dataclasses.replace(problem, decode=decode, **mods, **mosaic)
