"""Pieces shared by the flex attention kernels: masked tile loads, scores of a tile, specs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn._src.attention import dropout
from jattn._src.attention.common import Mods, Problem
from jattn._src.constants import LOG2_E
from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.pallas_triton.masked import both, bounds, load, store
from jattn._src.tiling import cdiv, dot_tile


def walk(lists, owner: tuple, tile: int, block: int, visit, carry):
    """Runs carry = visit(start, carry, apply_mask_mod) over the tiles one program visits: the
    partial blocks, then the full blocks, listed for `owner` (the (batch, head, row) index of
    the program's block row or column) in `lists` (num/indices ref pairs). Each block of
    `block` positions is `block // tile` tiles.
    """
    per_block = block // tile

    def start(indices_ref, j):
        if per_block == 1:
            return indices_ref[(*owner, j)] * block
        # Plain integer ops: jnp's floor-division sign fix-ups do not lower in a Triton loop.
        index, offset = lax.div(j, jnp.int32(per_block)), lax.rem(j, jnp.int32(per_block))
        return indices_ref[(*owner, index)] * block + offset * tile

    for k in range(0, len(lists), 2):
        num_ref, indices_ref = lists[k], lists[k + 1]
        carry = lax.fori_loop(
            0, num_ref[owner] * per_block,
            lambda j, c, indices_ref=indices_ref, partial=k == 0: visit(start(indices_ref, j),
                                                                        c, partial),
            carry)
    return carry


def split_refs(refs, n_lists: int, n_score: int, n_mask: int, n_in: int):
    """A backward-side kernel's refs: (its n_in inputs, the BlockMask lists, score_mod's and
    the mask_mod's captured arrays, its outputs)."""
    ins = refs[:n_in]
    lists = refs[n_in:n_in + n_lists]
    score_refs = refs[n_in + n_lists:n_in + n_lists + n_score]
    mask_refs = refs[n_in + n_lists + n_score:n_in + n_lists + n_score + n_mask]
    outs = refs[n_in + n_lists + n_score + n_mask:]
    return ins, lists, score_refs, mask_refs, outs


def base2_lse(lse):
    """The natural-log LSE in base 2, as the kernels that recompute P = exp2(S·c − lse₂) read
    it: 0 for rows that attend to nothing (their P is 0 by the mask, and no inf reaches it)."""
    return jnp.where(lse == -jnp.inf, 0.0, lse * LOG2_E)


def exp2(p: Problem, x):
    """2**x of a float32 tile. On the GPU one MUFU.EX2 per element (ex2.approx.ftz): jnp.exp2
    lowers to libdevice's exp2f, which wraps it in denormal handling the softmax does not need
    (results below 2**-126 become 0)."""
    if p.interpret:
        return jnp.exp2(x)
    return plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def softmax_step(p: Problem, carry, s, factor: float, load_v, kept=None):
    """One online-softmax update of (m_i, l_i, acc) with a [rows, keys] tile of scores `s` (-inf
    where masked; times `factor` they are base-2 logits). load_v() gives the matching V tile; it
    is called after the exp2s, where the forward kernel has always loaded it. kept: the tile's
    dropout mask (None: none), which leaves the weights out of acc but not out of l_i."""
    m_i, l_i, acc = carry
    m_new = jnp.maximum(m_i, s.max(axis=1) * factor)
    alpha = exp2(p, m_i - m_new)
    prob = exp2(p, s * factor - m_new[:, None])
    weights = prob if kept is None else jnp.where(kept, prob, 0.0)
    v_tile = load_v()
    acc = acc * alpha[:, None] + jnp.dot(weights.astype(v_tile.dtype), v_tile,
                                         preferred_element_type=jnp.float32)
    return m_new, l_i * alpha + prob.sum(axis=1), acc


def dropout_mask(p: Problem, seed_ref):
    """kept(b, h, q_idx, kv_idx) of the call's dropout, its seed read from `seed_ref` (None
    without dropout)."""
    if seed_ref is None:
        return None
    seed0, seed1 = seed_ref[0], seed_ref[1]
    return lambda b, h, q_idx, kv_idx: dropout.kept(p, seed0, seed1, b, h, q_idx, kv_idx)


def heaviest_first(length: int, tile: int, program):
    """Query tile of a program, last tiles first: under causal-like masks they visit the most
    blocks, and starting them early keeps the GPU's last wave short."""
    return cdiv(length, tile) - 1 - program


def query_program(p: Problem, block_q: int):
    """Where a program of a (query tiles, B·Hq) grid works: (b, h, BlockMask batch and head,
    first query row, BlockMask row)."""
    bh = pl.program_id(1)
    b, h = bh // p.Hq, bh % p.Hq
    q0 = heaviest_first(p.L, block_q, pl.program_id(0)) * block_q
    return (b, h, b if p.mask_batch > 1 else 0, h if p.mask_heads > 1 else 0, q0,
            q0 // p.mask_block[0])


def padded(dim: int) -> int:
    """Head dims live in power-of-two tiles (Triton's rule), masked down to the real size."""
    return dot_tile(dim)


def load_tile(ref, index, row0, rows: int, length: int, dim: int, span: int | None = None):
    """A [rows, padded(dim)] tile at ref[*index, :] whose first row is row `row0` of `length`:
    rows past the length and columns past `dim` read as 0. `index` selects the rows (and any
    leading dims). `span` is the unit the visited rows are rounded up to (default: rows); no
    row mask is needed when it divides the length."""
    mask = both(bounds(row0, rows, length, 0) if length % (span or rows) else None,
                bounds(0, padded(dim), dim, 1))
    return load(ref, (*index, slice(None)), mask)


def load_vector(ref, index, row0, rows: int, length: int, span: int | None = None):
    """A [rows] vector at ref[*index] whose first element is row `row0` of `length`."""
    mask = bounds(row0, rows, length, 0) if length % (span or rows) else None
    return load(ref, tuple(index), None if mask is None else mask[:, 0])


def store_tile(ref, index, value, row0, length: int, dim: int):
    """Stores a [rows, padded(dim)] tile at ref[*index, :], skipping rows/columns outside."""
    rows = value.shape[0]
    mask = both(bounds(row0, rows, length, 0) if length % rows else None,
                bounds(0, padded(dim), dim, 1))
    store(ref, (*index, slice(None)), value, mask)


def store_vector(ref, index, value, row0, length: int):
    """Stores a [rows] vector at ref[*index] whose first element is row `row0` of `length`,
    skipping elements past the length."""
    rows = value.shape[0]
    mask = bounds(row0, rows, length, 0) if length % rows else None
    store(ref, tuple(index), value, None if mask is None else mask[:, 0])


def deferred_scale(p: Problem, mods: Mods) -> float:
    """The part of the score scale a softmax may apply late: all of it when there is no
    score_mod and it is positive (a positive factor commutes with the row max and folds into
    the exp2 argument, one FFMA per score), else none (1.0)."""
    return p.scale if mods.score is None and p.scale > 0 else 1.0


def tile_scores(p: Problem, mods: Mods, score_refs, mask_refs, q_tile, k_tile, b, h, q0, kv0,
                apply_mask_mod: bool, *, deferred: float = 1.0, transposed: bool = False):
    """(raw scale·q·kᵀ, modded score, keep mask or None, q_idx, kv_idx) of one tile.

    The tile is [queries, keys], or with `transposed` [keys, queries] (scale·k·qᵀ, what dK/dV
    multiply by without transposing registers); `mods` must be traced for that orientation.
    deferred: a factor of the scale (from `deferred_scale`) left out of raw and the score.
    """
    queries, keys = q_tile.shape[0], k_tile.shape[0]
    first, second = (k_tile, q_tile) if transposed else (q_tile, k_tile)
    dot = lax.dot_general(first, second, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    q_axis, kv_axis = (1, 0) if transposed else (0, 1)
    q_shape, kv_shape = [1, 1], [1, 1]
    q_shape[q_axis], kv_shape[kv_axis] = queries, keys
    q_idx = q0 + lax.broadcasted_iota(jnp.int32, tuple(q_shape), q_axis)
    kv_idx = kv0 + lax.broadcasted_iota(jnp.int32, tuple(kv_shape), kv_axis)
    scale = p.scale / deferred
    raw = s = dot if scale == 1.0 else dot * scale
    if mods.score is not None:
        s = call_in_kernel(mods.score, score_refs, raw, b, h, q_idx, kv_idx)[0]
    # Tiles are visited up to whole BlockMask blocks, which may reach past the sequence ends.
    keep = None
    if p.S % p.mask_block[1]:
        keep = kv_idx < p.S
    if p.L % p.mask_block[0]:
        keep = both(keep, q_idx < p.L)
    if apply_mask_mod and mods.mask is not None:
        keep = both(keep, call_in_kernel(mods.mask, mask_refs, b, h, q_idx, kv_idx)[0])
    return raw, s, keep, q_idx, kv_idx


def whole(x: Any) -> pl.BlockSpec:
    """A BlockSpec handing every program the whole array."""
    return pl.BlockSpec(jnp.shape(x), lambda *ids, nd=jnp.ndim(x): (0,) * nd)

