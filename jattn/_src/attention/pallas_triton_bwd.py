"""Flex attention backward kernels (Pallas, lowered to Triton).

Three kernels, no atomics, so results are deterministic:
- delta: delta = rowsum(O ∘ dO) - d_lse (it folds in the LSE cotangent) and the LSE in base 2
  (0 for rows that attend nowhere), per query row.
- dQ: grid (query tiles, B·Hq); walks the kv-major block lists like the forward, recomputing
  P = exp2(t - lse₂) and dS = P ∘ (dP - delta), then dQ += dS'·K with dS' the gradient through
  score_mod (`jax.vjp` of the mod, evaluated in the kernel).
- dK/dV: grid (kv tiles, B·Hkv); walks the q-major lists for each of the G query heads of its
  kv head, accumulating dV += Pᵀ·dO and dK += dS'ᵀ·Q. With a broadcast k/v batch (Bk = 1) it
  writes one fp32 slice per query batch, summed afterwards by XLA.
All of it is kernels, so that the torch ops can launch the backward without JAX
(interop/_direct.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn._src.attention import dropout
from jattn._src.attention import pallas_triton_tiles as tiles
from jattn._src.attention.common import Mods, Problem
from jattn._src.constants import LOG2_E
from jattn._src.masks.block_mask import MaskLists
from jattn._src.mesh_axes import aligned, out_struct
from jattn._src.pallas_triton.captured_loads import call_in_kernel
from jattn._src.pallas_triton.compile import compiler_params


def _ds(p: Problem, mods: Mods, score_refs, raw, s, keep, b, h, q_idx, kv_idx, lse2, delta,
        dp, kept):
    """(the weights, dS' = gradient w.r.t. the raw scaled score) of one tile, either
    orientation (lse2 and delta shaped to broadcast along the query axis). The weights are P,
    or with dropout (`kept`: its mask function, else None) P ∘ keep / (1 - rate). s and raw may
    lack the deferred part of the scale (`tiles.deferred_scale`), applied here inside one
    FFMA."""
    factor = tiles.deferred_scale(p, mods) * LOG2_E
    prob = tiles.exp2(p, s * factor - lse2)
    if keep is not None:
        prob = jnp.where(keep, prob, 0.0)
    # dP' = dO·Vᵀ reaches P through keep / (1 - rate)
    keep_d = None if kept is None else kept(b, h, q_idx, kv_idx)
    weights, dp = dropout.dropped(p, keep_d, prob), dropout.dropped(p, keep_d, dp)
    ds = prob * (dp - delta)
    if mods.score_vjp is not None:
        ds = call_in_kernel(mods.score_vjp, score_refs, raw, b, h, q_idx, kv_idx, ds)[0]
    if keep is not None:
        ds = jnp.where(keep, ds, 0.0)
    return weights, ds


# ------------------------------------------------------------------------------------------------
# delta and the base-2 LSE
# ------------------------------------------------------------------------------------------------

def _delta_kernel(*refs, p: Problem, rows: int):
    # (out, d_out, lse[, d_lse]) -> (delta, lse2); no d_lse where the LSE's cotangent is zero
    out_ref, do_ref, lse_ref, *d_lse_ref, delta_ref, lse2_ref = refs
    q0 = pl.program_id(0) * rows
    here = (slice(None),)
    out = tiles.load_tile(out_ref, here, q0, rows, p.L, p.Ev).astype(jnp.float32)
    d_out = tiles.load_tile(do_ref, here, q0, rows, p.L, p.Ev).astype(jnp.float32)
    lse = tiles.load_vector(lse_ref, here, q0, rows, p.L)
    delta = jnp.sum(out * d_out, axis=1)
    for ref in d_lse_ref:
        delta = delta - tiles.load_vector(ref, here, q0, rows, p.L)
    tiles.store_vector(delta_ref, here, delta, q0, p.L)
    tiles.store_vector(lse2_ref, here, tiles.base2_lse(lse), q0, p.L)


def delta_and_lse2(p: Problem, out, lse, d_out, d_lse, params):
    """(delta, lse2) [B, Hq, L] float32: rowsum(O ∘ dO) - d_lse and the LSE in base 2."""
    rows = 64
    ev_pad = tiles.padded(p.Ev)

    def row_tile(i, bh):
        return bh // p.Hq, bh % p.Hq, i

    vector = pl.BlockSpec((None, None, rows), row_tile)
    return pl.pallas_call(
        functools.partial(_delta_kernel, p=p, rows=rows),
        grid=(tiles.cdiv(p.L, rows), p.B * p.Hq),
        in_specs=[pl.BlockSpec((None, None, rows, ev_pad), lambda i, bh: (*row_tile(i, bh), 0)),
                  pl.BlockSpec((None, None, rows, ev_pad), lambda i, bh: (*row_tile(i, bh), 0)),
                  vector, *[vector] * (d_lse is not None)],
        out_specs=[vector, vector],
        out_shape=[out_struct(lse.shape, jnp.float32, lse)] * 2,
        compiler_params=params, interpret=p.interpret, name="jattn_flex_bwd_delta",
    )(out, d_out, lse, *[d_lse] * (d_lse is not None))


# ------------------------------------------------------------------------------------------------
# dQ
# ------------------------------------------------------------------------------------------------

def _dq_kernel(*refs, p: Problem, n_lists: int, n_score: int, n_mask: int):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), lists, score_refs, mask_refs, (dq_ref,) = (
        tiles.split_refs(refs, n_lists, n_score, n_mask, 6))
    mask_refs, seed_ref = dropout.split(p, mask_refs)
    kept = tiles.dropout_mask(p, seed_ref)
    bq, bk = p.config.bwd_block_q, p.config.bwd_block_k
    mask_bk = p.mask_block[1]
    b, h, mb, mh, q0, row = tiles.query_program(p, bq)
    here = (slice(None),)
    q_tile = tiles.load_tile(q_ref, here, q0, bq, p.L, p.E)
    do_tile = tiles.load_tile(do_ref, here, q0, bq, p.L, p.Ev)
    lse2 = tiles.load_vector(lse_ref, here, q0, bq, p.L)
    delta = tiles.load_vector(delta_ref, here, q0, bq, p.L)

    def visit(kv0, dq, apply_mask_mod):
        k_tile = tiles.load_tile(k_ref, (pl.ds(kv0, bk),), kv0, bk, p.S, p.E, mask_bk)
        v_tile = tiles.load_tile(v_ref, (pl.ds(kv0, bk),), kv0, bk, p.S, p.Ev, mask_bk)
        raw, s, keep, q_idx, kv_idx = tiles.tile_scores(
            p, p.bwd, score_refs, mask_refs, q_tile, k_tile, b, h, q0, kv0, apply_mask_mod,
            deferred=tiles.deferred_scale(p, p.bwd))
        dp = lax.dot_general(do_tile, v_tile, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
        _, ds = _ds(p, p.bwd, score_refs, raw, s, keep, b, h, q_idx, kv_idx, lse2[:, None],
                    delta[:, None], dp, kept)
        return dq + jnp.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=jnp.float32)

    dq = tiles.walk(lists, (mb, mh, row), bk, mask_bk, visit,
                    jnp.zeros((bq, tiles.padded(p.E)), jnp.float32))
    tiles.store_tile(dq_ref, here, (dq * p.scale).astype(dq_ref.dtype), q0, p.L, p.E)


# ------------------------------------------------------------------------------------------------
# dK / dV
# ------------------------------------------------------------------------------------------------

def _dkdv_kernel(*refs, p: Problem, n_lists: int, n_score: int, n_mask: int):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), lists, score_refs, mask_refs, outs = (
        tiles.split_refs(refs, n_lists, n_score, n_mask, 6))
    mask_refs, seed_ref = dropout.split(p, mask_refs)
    kept = tiles.dropout_mask(p, seed_ref)
    dk_ref, dv_ref = outs
    bq, bk = p.config.bwd_block_q, p.config.bwd_block_k
    mask_bq, mask_bk = p.mask_block
    jt, bh = pl.program_id(0), pl.program_id(1)
    b, hkv = bh // p.Hkv, bh % p.Hkv
    mb = b if p.mask_batch > 1 else 0
    kv0 = jt * bk
    col = kv0 // mask_bk
    here = (slice(None),)
    k_tile = tiles.load_tile(k_ref, here, kv0, bk, p.S, p.E)
    v_tile = tiles.load_tile(v_ref, here, kv0, bk, p.S, p.Ev)

    def head(g, carry):
        h = hkv * p.groups + g
        mh = h if p.mask_heads > 1 else 0

        def visit(q0, carry, apply_mask_mod):
            dk, dv = carry
            rows = (g, pl.ds(q0, bq))
            q_tile = tiles.load_tile(q_ref, rows, q0, bq, p.L, p.E, mask_bq)
            do_tile = tiles.load_tile(do_ref, rows, q0, bq, p.L, p.Ev, mask_bq)
            lse2 = tiles.load_vector(lse_ref, rows, q0, bq, p.L, mask_bq)
            delta = tiles.load_vector(delta_ref, rows, q0, bq, p.L, mask_bq)
            # [keys, queries] tiles: Pᵀ and dSᵀ feed the dV and dK products as they are.
            raw, s, keep, q_idx, kv_idx = tiles.tile_scores(
                p, p.dkdv, score_refs, mask_refs, q_tile, k_tile, b, h, q0, kv0, apply_mask_mod,
                deferred=tiles.deferred_scale(p, p.dkdv), transposed=True)
            dp = lax.dot_general(v_tile, do_tile, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            weights, ds = _ds(p, p.dkdv, score_refs, raw, s, keep, b, h, q_idx, kv_idx,
                              lse2[None, :], delta[None, :], dp, kept)
            dv = dv + jnp.dot(weights.astype(do_tile.dtype), do_tile,
                              preferred_element_type=jnp.float32)
            dk = dk + jnp.dot(ds.astype(q_tile.dtype), q_tile, preferred_element_type=jnp.float32)
            return dk, dv

        return tiles.walk(lists, (mb, mh, col), bq, mask_bq, visit, carry)

    dk, dv = lax.fori_loop(0, p.groups, head,
                           (jnp.zeros((bk, tiles.padded(p.E)), jnp.float32),
                            jnp.zeros((bk, tiles.padded(p.Ev)), jnp.float32)))
    tiles.store_tile(dk_ref, here, (dk * p.scale).astype(dk_ref.dtype), kv0, p.S, p.E)
    tiles.store_tile(dv_ref, here, dv.astype(dv_ref.dtype), kv0, p.S, p.Ev)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def backward(p: Problem, q, k, v, masks: MaskLists, score_caps, mask_caps, out, lse, d_out,
             d_lse):
    """(dq, dk, dv) of flex attention; d_lse is the natural-log LSE's cotangent (None:
    zero)."""
    cfg = p.config
    bq, bk = cfg.bwd_block_q, cfg.bwd_block_k
    q, k, v, masks, score_caps, mask_caps, out, lse, d_out, d_lse = aligned(
        q, k, v, masks, score_caps, mask_caps, out, lse, d_out, d_lse)
    e_pad, ev_pad = tiles.padded(p.E), tiles.padded(p.Ev)
    q_span = tiles.cdiv(p.L, p.mask_block[0]) * p.mask_block[0]
    kv_span = tiles.cdiv(p.S, p.mask_block[1]) * p.mask_block[1]
    delta, lse2 = delta_and_lse2(p, out, lse, d_out, d_lse,
                                 compiler_params(4, 1, compiler=cfg.bwd_compiler))
    params = compiler_params(cfg.bwd_num_warps, cfg.bwd_num_stages, compiler=cfg.bwd_compiler)
    interpret = p.interpret
    caps = (*score_caps, *mask_caps)
    common = dict(p=p, n_score=len(score_caps), n_mask=len(mask_caps))

    # ---- dQ ----
    kv_lists = masks.major("kv")

    def q_index(i, bh):
        return bh // p.Hq, bh % p.Hq, tiles.heaviest_first(p.L, bq, i), 0

    def kv_panel(i, bh):
        return (bh // p.Hq if p.kv_batch > 1 else 0), (bh % p.Hq) // p.groups, 0, 0

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, n_lists=len(kv_lists), **common),
        grid=(tiles.cdiv(p.L, bq), p.B * p.Hq),
        in_specs=[pl.BlockSpec((None, None, bq, e_pad), q_index),
                  pl.BlockSpec((None, None, kv_span, e_pad), kv_panel),
                  pl.BlockSpec((None, None, kv_span, ev_pad), kv_panel),
                  pl.BlockSpec((None, None, bq, ev_pad), q_index),
                  pl.BlockSpec((None, None, bq), lambda i, bh: q_index(i, bh)[:3]),
                  pl.BlockSpec((None, None, bq), lambda i, bh: q_index(i, bh)[:3]),
                  *[tiles.whole(x) for x in (*kv_lists, *caps)]],
        out_specs=pl.BlockSpec((None, None, bq, e_pad), q_index),
        out_shape=out_struct(q.shape, q.dtype, q),
        compiler_params=params, interpret=interpret, name="jattn_flex_bwd_dq",
    )(q, k, v, d_out, lse2, delta, *kv_lists, *caps)

    # ---- dK, dV ----
    q_lists = masks.major("q")
    G = p.groups

    def heads_panel(j, bh):
        return bh // p.Hkv, bh % p.Hkv, 0, 0

    def kv_tile(j, bh):
        return (bh // p.Hkv if p.kv_batch > 1 else 0), bh % p.Hkv, j, 0

    def per_batch(j, bh):
        return bh // p.Hkv, bh % p.Hkv, j, 0

    grad_dtype = k.dtype if p.kv_batch == p.B else jnp.float32
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, n_lists=len(q_lists), **common),
        grid=(tiles.cdiv(p.S, bk), p.B * p.Hkv),
        in_specs=[pl.BlockSpec((None, G, q_span, e_pad), heads_panel),
                  pl.BlockSpec((None, None, bk, e_pad), kv_tile),
                  pl.BlockSpec((None, None, bk, ev_pad), kv_tile),
                  pl.BlockSpec((None, G, q_span, ev_pad), heads_panel),
                  pl.BlockSpec((None, G, q_span), lambda j, bh: heads_panel(j, bh)[:3]),
                  pl.BlockSpec((None, G, q_span), lambda j, bh: heads_panel(j, bh)[:3]),
                  *[tiles.whole(x) for x in (*q_lists, *caps)]],
        out_specs=[pl.BlockSpec((None, None, bk, e_pad), per_batch),
                   pl.BlockSpec((None, None, bk, ev_pad), per_batch)],
        out_shape=[out_struct((p.B, p.Hkv, p.S, p.E), grad_dtype, q),
                   out_struct((p.B, p.Hkv, p.S, p.Ev), grad_dtype, q)],
        compiler_params=params, interpret=interpret, name="jattn_flex_bwd_dkdv",
    )(q, k, v, d_out, lse2, delta, *q_lists, *caps)
    if p.kv_batch < p.B:
        dk = dk.sum(axis=0, keepdims=True).astype(k.dtype)
        dv = dv.sum(axis=0, keepdims=True).astype(v.dtype)
    return dq, dk, dv
