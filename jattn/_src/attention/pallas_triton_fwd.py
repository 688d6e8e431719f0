"""Flex attention forward kernel (Pallas, lowered to Triton).

Grid: (query tiles, B·Hq). A program holds one [block_q, E] query tile and walks the key/value
blocks its BlockMask row lists: first the partial blocks (score_mod, then mask_mod), then the
full blocks (score_mod only), with an online softmax in base 2. K and V are whole-sequence
panels of the program's kv head (h // G), so GQA costs no copies.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn._src.attention import dropout
from jattn._src.attention import pallas_triton_tiles as tiles
from jattn._src.attention.common import Problem
from jattn._src.constants import LOG2_E, MASK_VALUE
from jattn._src.masks.block_mask import MaskLists
from jattn._src.mesh_axes import aligned, out_struct
from jattn._src.pallas_triton.compile import compiler_params


def _fwd_kernel(*refs, p: Problem, n_lists: int, n_score: int, n_mask: int):
    q_ref, k_ref, v_ref = refs[:3]
    list_refs = refs[3:3 + n_lists]
    score_refs = refs[3 + n_lists:3 + n_lists + n_score]
    mask_refs = refs[3 + n_lists + n_score:3 + n_lists + n_score + n_mask]
    out_ref, lse_ref = refs[3 + n_lists + n_score + n_mask:][:2]
    max_ref = refs[-1] if p.max_scores else None
    mask_refs, seed_ref = dropout.split(p, mask_refs)
    bq, bk = p.config.block_q, p.config.block_k
    mask_bk = p.mask_block[1]

    # ---- this program: one query tile of (b, h) ------------------------------------------------
    b, h, mb, mh, q0, row = tiles.query_program(p, bq)
    q_tile = tiles.load_tile(q_ref, (slice(None),), q0, bq, p.L, p.E)

    deferred = tiles.deferred_scale(p, p.fwd)
    factor = deferred * LOG2_E  # scores -> base-2 logits
    kept = tiles.dropout_mask(p, seed_ref)

    def visit(kv0, carry, apply_mask_mod):
        k_tile = tiles.load_tile(k_ref, (pl.ds(kv0, bk),), kv0, bk, p.S, p.E, mask_bk)
        _, s, keep, q_idx, kv_idx = tiles.tile_scores(p, p.fwd, score_refs, mask_refs, q_tile,
                                                      k_tile, b, h, q0, kv0, apply_mask_mod,
                                                      deferred=deferred)
        if keep is not None:
            # -inf, not a finite stand-in: the running max starts at the finite MASK_VALUE, so
            # masked scores give exp2(-inf) = 0 even in rows with nothing kept yet, and the
            # mask dies here rather than staying live (in predicate registers) past the exp2.
            s = jnp.where(keep, s, -jnp.inf)
        return tiles.softmax_step(p, carry, s, factor, lambda: tiles.load_tile(
            v_ref, (pl.ds(kv0, bk),), kv0, bk, p.S, p.Ev, mask_bk),
            None if kept is None else kept(b, h, q_idx, kv_idx))

    # ---- partial blocks, then full blocks -------------------------------------------------------
    carry = (jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
             jnp.zeros((bq, tiles.padded(p.Ev)), jnp.float32))
    m_i, l_i, acc = tiles.walk(list_refs, (mb, mh, row), bk, mask_bk, visit, carry)

    # ---- normalise; rows that attend to nothing give 0 and LSE -inf ----------------------------
    l_safe = jnp.where(l_i == 0, 1.0, l_i)
    # Kept weights are scaled by 1 / (1 - rate); the LSE stays the softmax's.
    norm = l_safe * (1.0 - p.dropout) if p.dropout else l_safe
    out = acc / norm[:, None]
    lse = jnp.where(l_i == 0, -jnp.inf, (m_i + jnp.log2(l_safe)) / LOG2_E)
    tiles.store_tile(out_ref, (slice(None),), out.astype(out_ref.dtype), q0, p.L, p.Ev)
    rows = tiles.bounds(q0, bq, p.L, 0) if p.L % bq else None
    tiles.store(lse_ref, slice(None), lse, None if rows is None else rows[:, 0])
    if max_ref is not None:  # m_i: the row's largest score, in base-2 units
        largest = jnp.where(l_i == 0, -jnp.inf, m_i / LOG2_E)
        tiles.store(max_ref, slice(None), largest, None if rows is None else rows[:, 0])


def forward(p: Problem, q, k, v, masks: MaskLists, score_caps, mask_caps):
    """(out [B, Hq, L, Ev], lse [B, Hq, L] float32 natural log), and with p.max_scores each
    row's largest score [B, Hq, L] float32."""
    bq = p.config.block_q
    q, k, v, lists, score_caps, mask_caps = aligned(q, k, v, masks.major("kv"), score_caps,
                                                    mask_caps)
    e_pad, ev_pad = tiles.padded(p.E), tiles.padded(p.Ev)
    kv_span = tiles.cdiv(p.S, p.mask_block[1]) * p.mask_block[1]

    def q_index(i, bh):
        return bh // p.Hq, bh % p.Hq, tiles.heaviest_first(p.L, bq, i), 0

    def kv_index(i, bh):
        return (bh // p.Hq if p.kv_batch > 1 else 0), (bh % p.Hq) // p.groups, 0, 0

    in_specs = [pl.BlockSpec((None, None, bq, e_pad), q_index),
                pl.BlockSpec((None, None, kv_span, e_pad), kv_index),
                pl.BlockSpec((None, None, kv_span, ev_pad), kv_index)]
    in_specs += [tiles.whole(x) for x in (*lists, *score_caps, *mask_caps)]
    kernel = functools.partial(_fwd_kernel, p=p, n_lists=len(lists), n_score=len(score_caps),
                               n_mask=len(mask_caps))
    rows = 2 if p.max_scores else 1  # per-row outputs: the LSE, and the largest scores
    return pl.pallas_call(
        kernel,
        grid=(tiles.cdiv(p.L, bq), p.B * p.Hq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bq, ev_pad), q_index),
                   *[pl.BlockSpec((None, None, bq), lambda i, bh: q_index(i, bh)[:3])] * rows],
        out_shape=[out_struct((p.B, p.Hq, p.L, p.Ev), q.dtype, q),
                   *[out_struct((p.B, p.Hq, p.L), jnp.float32, q)] * rows],
        compiler_params=compiler_params(p.config.num_warps, p.config.num_stages,
                                        compiler=p.config.compiler),
        interpret=p.interpret,
        name="jattn_flex_fwd",
    )(q, k, v, *lists, *score_caps, *mask_caps)
