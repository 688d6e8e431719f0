"""Flex attention's forward-mode tangents in one Pallas-Triton kernel (jax.jvp, jax.jacfwd).

With the forward's LSE saved, the weights P = exp(S − lse) need no running max, and the
tangents of a query row are one pass over its key blocks, as the backward's dQ kernel walks
them:

    Ṡ = score_mod'(S) · scale · (Q̇·Kᵀ + Q·K̇ᵀ)      (pointwise, so its VJP is its JVP)
    lse̊ = Σ_j P Ṡ                                     (the LSE's tangent)
    Ȯ  = Σ_j P̂ (Ṡ V + V̇) − lse̊ · O

where P̂ is P with dropout's mask and 1 / (1 − rate) applied (P itself without dropout): out
is Σ P̂ V, and the softmax's derivative P (Ṡ − lse̊) reaches it through the same mask. The
products with a tangent that is zero (q̇, k̇ or v̇ not differentiated) are left out. Tangents
of the score_mod's captured arrays are not taken here (`tangents` runs the XLA JVP then).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn._src.attention import dropout
from jattn._src.attention import pallas_triton_tiles as tiles
from jattn._src.attention.common import Problem
from jattn._src.constants import LOG2_E
from jattn._src.masks.block_mask import MaskLists
from jattn._src.mesh_axes import aligned, out_struct
from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.pallas_triton.compile import compiler_params


def _kernel(*refs, p: Problem, moving: tuple[bool, bool, bool], n_lists: int, n_score: int,
            n_mask: int):
    ins, lists, score_refs, mask_refs, (d_out_ref, d_lse_ref) = tiles.split_refs(
        refs, n_lists, n_score, n_mask, 5 + sum(moving))
    ins = list(ins)
    q_ref, k_ref, v_ref = ins[:3]
    dq_ref, dk_ref, dv_ref = (ins.pop(3) if m else None for m in moving)
    out_ref, lse_ref = ins[3:]
    mask_refs, seed_ref = dropout.split(p, mask_refs)
    kept = tiles.dropout_mask(p, seed_ref)
    mods = p.bwd
    bq, bk = p.config.bwd_block_q, p.config.bwd_block_k
    mask_bk = p.mask_block[1]
    b, h, mb, mh, q0, row = tiles.query_program(p, bq)
    here = (slice(None),)
    q_tile = tiles.load_tile(q_ref, here, q0, bq, p.L, p.E)
    dq_tile = None if dq_ref is None else tiles.load_tile(dq_ref, here, q0, bq, p.L, p.E)
    lse2 = tiles.base2_lse(tiles.load_vector(lse_ref, here, q0, bq, p.L))
    deferred = tiles.deferred_scale(p, mods)
    factor = deferred * LOG2_E

    def product(a, b_tile):  # a·bᵀ in float32
        return lax.dot_general(a, b_tile, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def visit(kv0, carry, apply_mask_mod):
        acc, lse_t = carry
        keys = (pl.ds(kv0, bk),)
        k_tile = tiles.load_tile(k_ref, keys, kv0, bk, p.S, p.E, mask_bk)
        v_tile = tiles.load_tile(v_ref, keys, kv0, bk, p.S, p.Ev, mask_bk)
        raw, s, keep, q_idx, kv_idx = tiles.tile_scores(
            p, mods, score_refs, mask_refs, q_tile, k_tile, b, h, q0, kv0, apply_mask_mod,
            deferred=deferred)
        prob = tiles.exp2(p, s * factor - lse2[:, None])
        if keep is not None:
            prob = jnp.where(keep, prob, 0.0)
        # the tangent of scale·q·kᵀ, then of the score after score_mod
        ds = None
        if dq_tile is not None:
            ds = product(dq_tile, k_tile)
        if dk_ref is not None:
            dk_tile = tiles.load_tile(dk_ref, keys, kv0, bk, p.S, p.E, mask_bk)
            ds = product(q_tile, dk_tile) if ds is None else ds + product(q_tile, dk_tile)
        weights = dropout.dropped(p, None if kept is None else kept(b, h, q_idx, kv_idx), prob)
        if ds is not None:
            ds = ds * p.scale
            if mods.score_vjp is not None:
                ds = call_in_kernel(mods.score_vjp, score_refs, raw, b, h, q_idx, kv_idx, ds)[0]
            if keep is not None:  # (a mod's derivative where the mask drops the score)
                ds = jnp.where(keep, ds, 0.0)
            lse_t = lse_t + jnp.sum(prob * ds, axis=1)
            acc = acc + jnp.dot((weights * ds).astype(v_tile.dtype), v_tile,
                                preferred_element_type=jnp.float32)
        if dv_ref is not None:
            dv_tile = tiles.load_tile(dv_ref, keys, kv0, bk, p.S, p.Ev, mask_bk)
            acc = acc + jnp.dot(weights.astype(dv_tile.dtype), dv_tile,
                                preferred_element_type=jnp.float32)
        return acc, lse_t

    acc, lse_t = tiles.walk(lists, (mb, mh, row), bk, mask_bk, visit,
                            (jnp.zeros((bq, tiles.padded(p.Ev)), jnp.float32),
                             jnp.zeros((bq,), jnp.float32)))
    out = tiles.load_tile(out_ref, here, q0, bq, p.L, p.Ev).astype(jnp.float32)
    tiles.store_tile(d_out_ref, here, (acc - lse_t[:, None] * out).astype(d_out_ref.dtype), q0,
                     p.L, p.Ev)
    tiles.store_vector(d_lse_ref, here, lse_t, q0, p.L)


def tangents(p: Problem, q, k, v, dq, dk, dv, masks: MaskLists, score_caps, mask_caps, out,
             lse):
    """(out's tangent [B, Hq, L, Ev] in out's dtype, the LSE's [B, Hq, L] float32) from the
    tangents dq, dk, dv (None: zero) and the forward's out and LSE."""
    cfg = p.config
    bq = cfg.bwd_block_q
    moving = tuple(t is not None for t in (dq, dk, dv))
    q, k, v, dq, dk, dv, masks, score_caps, mask_caps, out, lse = aligned(
        q, k, v, dq, dk, dv, masks, score_caps, mask_caps, out, lse)
    e_pad, ev_pad = tiles.padded(p.E), tiles.padded(p.Ev)
    kv_span = tiles.cdiv(p.S, p.mask_block[1]) * p.mask_block[1]
    kv_lists = masks.major("kv")
    caps = (*score_caps, *mask_caps)

    def q_index(i, bh):
        return bh // p.Hq, bh % p.Hq, tiles.heaviest_first(p.L, bq, i), 0

    def kv_panel(i, bh):
        return (bh // p.Hq if p.kv_batch > 1 else 0), (bh % p.Hq) // p.groups, 0, 0

    specs = {"q": pl.BlockSpec((None, None, bq, e_pad), q_index),
             "k": pl.BlockSpec((None, None, kv_span, e_pad), kv_panel),
             "v": pl.BlockSpec((None, None, kv_span, ev_pad), kv_panel)}
    tangent_inputs = [(t, specs[name]) for name, t in zip("qkv", (dq, dk, dv)) if t is not None]
    d_out, d_lse = pl.pallas_call(
        functools.partial(_kernel, p=p, moving=moving, n_lists=len(kv_lists),
                          n_score=len(score_caps), n_mask=len(mask_caps)),
        grid=(tiles.cdiv(p.L, bq), p.B * p.Hq),
        in_specs=[specs["q"], specs["k"], specs["v"], *(spec for _, spec in tangent_inputs),
                  pl.BlockSpec((None, None, bq, ev_pad), q_index),
                  pl.BlockSpec((None, None, bq), lambda i, bh: q_index(i, bh)[:3]),
                  *[tiles.whole(x) for x in (*kv_lists, *caps)]],
        out_specs=[pl.BlockSpec((None, None, bq, ev_pad), q_index),
                   pl.BlockSpec((None, None, bq), lambda i, bh: q_index(i, bh)[:3])],
        out_shape=[out_struct(out.shape, out.dtype, q), out_struct(lse.shape, jnp.float32, q)],
        compiler_params=compiler_params(cfg.bwd_num_warps, cfg.bwd_num_stages,
                                        compiler=cfg.bwd_compiler),
        interpret=p.interpret, name="jattn_flex_jvp",
    )(q, k, v, *(t for t, _ in tangent_inputs), out, lse, *kv_lists, *caps)
    return d_out, d_lse
