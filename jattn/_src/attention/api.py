"""Public flex attention: validation, mask and mod preparation, config choice, custom_vjp."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jattn._src import platform
from jattn._src.attention import pallas_triton_bwd, pallas_triton_fwd, xla
from jattn._src.attention.common import Mods, Problem, checked_mask_mod, checked_score_mod
from jattn._src.attention.config import AttentionConfig, heuristic_config
from jattn._src.decoding import common as decoding
from jattn._src.decoding import pallas_triton as decoding_kernel
from jattn._src.masks.block_mask import BlockMask, dense_from_lists
from jattn._src.pallas_triton_compile import triton_compiler_available
from jattn._src.tiling import cdiv
from jattn._src.user_functions import CaptureSet

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_DEFAULT_BLOCK = 128
ScoreMod = Callable[..., jax.Array]


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, enable_gqa: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"flex_attention: `{name}` must be [batch, heads, length, dim], got "
                             f"shape {x.shape}.")
        if x.dtype not in _DTYPES:
            raise TypeError(f"flex_attention: `{name}` has dtype {x.dtype}; supported are "
                            "bfloat16, float16 and float32.")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"flex_attention: q, k and v must share a dtype, got {q.dtype}, "
                        f"{k.dtype} and {v.dtype}.")
    (B, Hq, _, E), (Bk, Hkv, _, Ek) = q.shape, k.shape
    if 0 in (E, v.shape[-1]):
        raise ValueError(f"flex_attention: head dims must be at least 1, got q {q.shape} and "
                         f"v {v.shape}.")
    if 0 in (Hq, Hkv):
        raise ValueError(f"flex_attention: q and k/v need at least one head, got q {q.shape} "
                         f"and k {k.shape}.")
    if Ek != E:
        raise ValueError(f"flex_attention: q {q.shape} and k {k.shape} must have the same head "
                         "dim (last axis).")
    if v.shape[:3] != k.shape[:3]:
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
    block = (_DEFAULT_BLOCK, _DEFAULT_BLOCK)
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
# Mods, traced at each implementation's tile shapes
# ------------------------------------------------------------------------------------------------

def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _tile_signature(block_q: int, block_k: int, *, transposed: bool = False):
    """Mod arguments on a kernel tile: [queries, keys], or transposed [keys, queries]."""
    if transposed:
        score = jax.ShapeDtypeStruct((block_k, block_q), jnp.float32)
        return score, (_i32(), _i32(), _i32(1, block_q), _i32(block_k, 1))
    score = jax.ShapeDtypeStruct((block_q, block_k), jnp.float32)
    return score, (_i32(), _i32(), _i32(block_q, 1), _i32(1, block_k))


def _trace_mods(score_mod, mask_mod, score_set: CaptureSet, mask_set: CaptureSet, score_sig,
                index_sig) -> Mods:
    score = score_vjp = mask = None
    if score_mod is not None:
        score = score_set.trace(score_mod, (score_sig, *index_sig))

        def score_vjp_fn(s, b, h, q_idx, kv_idx, d_out):
            return jax.vjp(lambda x: score_mod(x, b, h, q_idx, kv_idx), s)[1](d_out)[0]

        score_vjp = score_set.trace(score_vjp_fn, (score_sig, *index_sig, score_sig))
    if mask_mod is not None:
        mask = mask_set.trace(mask_mod, index_sig)
    return Mods(score, score_vjp, mask)


# ------------------------------------------------------------------------------------------------
# custom_vjp around the implementations
# ------------------------------------------------------------------------------------------------

def _forward(p: Problem, q, k, v, masks, score_caps, mask_caps):
    if p.implementation == "xla":
        return xla.forward(p, q, k, v, masks["partial"], masks["full"], score_caps, mask_caps)
    if p.decode is not None:
        return decoding_kernel.attention_forward(p.decode, q, k, v, masks, score_caps, mask_caps)
    return pallas_triton_fwd.forward(p, q, k, v, masks, score_caps, mask_caps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(p: Problem, q, k, v, masks, score_caps, mask_caps):
    return _forward(p, q, k, v, masks, score_caps, mask_caps)


def _flex_fwd(p: Problem, q, k, v, masks, score_caps, mask_caps):
    # symbolic_zeros: each argument leaf arrives as CustomVJPPrimal(value, perturbed).
    differentiated = tuple(c.perturbed for c in score_caps)
    q, k, v, masks, score_caps, mask_caps = custom_vjp_primal_tree_values(
        (q, k, v, masks, score_caps, mask_caps))
    out, lse = _forward(p, q, k, v, masks, score_caps, mask_caps)
    return (out, lse), (q, k, v, masks, score_caps, mask_caps, out, lse, differentiated)


def _dense_zeros(cotangent):
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(cotangent.shape, cotangent.dtype)
    return cotangent


def _flex_bwd(p: Problem, residuals, cotangents):
    q, k, v, masks, score_caps, mask_caps, out, lse, differentiated = residuals
    d_out, d_lse = (_dense_zeros(c) for c in cotangents)
    d_lse = d_lse.astype(jnp.float32)
    if p.implementation == "xla":
        dq, dk, dv, d_caps = xla.backward(p, q, k, v, masks["partial"], masks["full"],
                                          score_caps, mask_caps, out, lse, d_out, d_lse,
                                          differentiated)
    else:
        dq, dk, dv = pallas_triton_bwd.backward(p, q, k, v, masks, score_caps, mask_caps, out,
                                                lse, d_out, d_lse)
        d_caps = [None] * len(score_caps)
        if any(differentiated):
            # Gradients of captured arrays: an XLA pass over key blocks (deterministic), run
            # only when some captured array is being differentiated.
            partial, full = _dense_tables(masks)
            *_, d_caps = xla.backward(p, q, k, v, partial, full, score_caps, mask_caps, out,
                                      lse, d_out, d_lse, differentiated, operand_grads=False)
    return dq, dk, dv, None, tuple(d_caps), None


_flex.defvjp(_flex_fwd, _flex_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------

def _mask_arrays(implementation: str, block_mask: BlockMask) -> dict[str, jax.Array]:
    if implementation == "xla":
        return {"partial": block_mask.partial_blocks(), "full": block_mask.full_blocks()}
    masks = {"kv_num_blocks": block_mask.kv_num_blocks, "kv_indices": block_mask.kv_indices,
             "q_num_blocks": block_mask.q_num_blocks, "q_indices": block_mask.q_indices}
    if block_mask.full_kv_num_blocks is not None:
        masks.update(full_kv_num_blocks=block_mask.full_kv_num_blocks,
                     full_kv_indices=block_mask.full_kv_indices,
                     full_q_num_blocks=block_mask.full_q_num_blocks,
                     full_q_indices=block_mask.full_q_indices)
    return {name: jnp.asarray(x, jnp.int32) for name, x in masks.items()}


def _dense_tables(masks: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """[Bm, Hm, nQ, nKV] partial and full tables from the kernels' kv-major lists."""
    n_kv = masks["kv_indices"].shape[-1]
    partial = dense_from_lists(masks["kv_num_blocks"], masks["kv_indices"], n_kv)
    if "full_kv_num_blocks" not in masks:
        return partial, jnp.zeros_like(partial)
    return partial, dense_from_lists(masks["full_kv_num_blocks"], masks["full_kv_indices"], n_kv)


def flex_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   score_mod: ScoreMod | None = None, block_mask: BlockMask | None = None, *,
                   scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, config: AttentionConfig | None = None,
                   implementation: str | None = None):
    """softmax(score_mod(scale · q·kᵀ) where block_mask/mask_mod allow) · v.

    Args:
      q: [B, Hq, L, E]; k: [B|1, Hkv, S, E]; v: [B|1, Hkv, S, Ev] — bfloat16, float16 or float32,
        one dtype. Hq must be a multiple of Hkv (enable_gqa=True when they differ); query head h
        reads kv head h // (Hq // Hkv). Any L, S, E, Ev (ragged tiles are masked).
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` on float32 scores (after scale) and
        broadcastable int32 indices; arrays it closes over become kernel inputs and get gradients.
      block_mask: from `jattn.create_block_mask` / `BlockMask.from_kv_blocks`, built for (L, S);
        partial blocks apply its mask_mod, full blocks skip it, other blocks are never visited.
        None attends everywhere.
      scale: score scale, default 1/sqrt(E). return_lse: also return the natural-log LSE.
      config: an AttentionConfig for the kernels (None: heuristic). implementation:
        "pallas_triton", "xla" or "interpret" (default: $JATTN_IMPLEMENTATION, else by platform).

    Returns:
      out [B, Hq, L, Ev] of q's dtype, and with return_lse the float32 LSE [B, Hq, L]. A query
      that attends to nothing gives 0 and LSE -inf. Differentiable in q, k, v, captured arrays of
      score_mod and (through its cotangent) the LSE.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    problem, masks, score_caps, mask_caps = _prepare(q, k, v, score_mod, block_mask, scale,
                                                     enable_gqa, config, implementation)
    out, lse = _flex(problem, q, k, v, masks, score_caps, mask_caps)
    return (out, lse) if return_lse else out


def flex_attention_backward(q, k, v, out, lse, d_out, d_lse, score_mod=None, block_mask=None, *,
                            captures=(), scale=None, enable_gqa=False, config=None,
                            implementation=None):
    """Gradients of `flex_attention(q, k, v, score_mod, block_mask, return_lse=True)` from its
    saved outputs (out, lse) and their cotangents, without running the forward again — the same
    backward `jax.vjp` runs. (For the torch ops, whose autograd keeps out and lse.)

    Returns (dq, dk, dv, d_captures): d_captures holds, for each array of `captures`, its
    gradient if score_mod closes over it and it is floating point, else None.
    """
    problem, masks, score_caps, mask_caps = _prepare(q, k, v, score_mod, block_mask, scale,
                                                     enable_gqa, config, implementation)
    differentiated = tuple(jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in score_caps)
    residuals = (q, k, v, masks, score_caps, mask_caps, out, lse, differentiated)
    dq, dk, dv, _, d_score_caps, _ = _flex_bwd(problem, residuals, (d_out, d_lse))
    by_id = {id(c): d for c, d in zip(score_caps, d_score_caps)}
    return dq, dk, dv, [by_id.get(id(c)) for c in captures]


def _prepare(q, k, v, score_mod, block_mask, scale, enable_gqa, config, implementation):
    """Validation, mods traced per implementation tile: (Problem, mask arrays, score_mod's and
    mask_mod's captured arrays)."""
    _check_inputs(q, k, v, enable_gqa)
    (B, Hq, L, E), (Bk, Hkv, S, _), Ev = q.shape, k.shape, v.shape[-1]
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex_attention: `score_mod` must be callable, got {score_mod!r}.")
    if config is not None and not isinstance(config, AttentionConfig):
        raise TypeError(f"flex_attention: `config` must be an AttentionConfig, got {config!r}.")
    dense = block_mask is None
    if dense:
        block_mask = _full_block_mask(L, S)
    _check_block_mask(block_mask, B, Hq, L, S)
    implementation = platform.resolve_implementation(implementation)
    scale = float(E ** -0.5 if scale is None else scale)

    score_mod = None if score_mod is None else checked_score_mod(score_mod)
    mask_mod = None if block_mask.mask_mod is None else checked_mask_mod(block_mask.mask_mod)
    score_set, mask_set = CaptureSet(), CaptureSet()
    score_sig, index_sig = xla.block_signature(B, Hkv, Hq // Hkv, L, block_mask.block_size[1])
    xla_mods = _trace_mods(score_mod, mask_mod, score_set, mask_set, score_sig, index_sig)
    resolved = decode = None
    fwd_mods = bwd_mods = dkdv_mods = xla_mods
    if implementation != "xla":
        resolved = config or heuristic_config(
            E, block_mask.block_size, masked=block_mask.mask_mod is not None,
            triton_compiler=platform.has_cuda() and triton_compiler_available())
        resolved.check_fits(block_mask.block_size)
        fwd_mods = _trace_mods(score_mod, mask_mod, score_set, mask_set,
                               *_tile_signature(resolved.block_q, resolved.block_k))
        bwd_mods = _trace_mods(score_mod, mask_mod, score_set, mask_set,
                               *_tile_signature(resolved.bwd_block_q, resolved.bwd_block_k))
        dkdv_mods = _trace_mods(score_mod, mask_mod, score_set, mask_set,
                                *_tile_signature(resolved.bwd_block_q, resolved.bwd_block_k,
                                                 transposed=True))
        if config is None and L <= decoding.MAX_DECODE_QUERIES:
            # A few queries: the forward runs the split-KV decode kernel, which fills the GPU
            # (the flex forward would launch only B·Hq programs); the backward is unchanged.
            decode = decoding.make_problem(
                B=B, Hq=Hq, Hkv=Hkv, Lq=L, S=S, E=E, Ev=Ev, kv_batch=Bk, page_size=None,
                num_pages=None, block_mask=None if dense else block_mask, score_mod=score_mod,
                mask_mod=mask_mod, score_set=score_set, mask_set=mask_set, static_length=True,
                queries_last=False, scale=scale, implementation=implementation, config=None)
    problem = Problem(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, kv_batch=Bk,
                      mask_batch=block_mask.shape[0], mask_heads=block_mask.shape[1],
                      mask_block=block_mask.block_size, scale=scale,
                      implementation=implementation, config=resolved, fwd=fwd_mods,
                      bwd=bwd_mods, dkdv=dkdv_mods, xla=xla_mods, decode=decode)
    return (problem, _mask_arrays(implementation, block_mask), tuple(score_set.captures),
            tuple(mask_set.captures))
