"""flex_attention on the Pallas-Triton kernels (compiled, or run by the Pallas interpreter).

`specialise` completes a Problem for these kernels: the config, the mods traced at each
kernel's tile shapes, and for a few queries the split-KV kernel's problem (its forward fills
the GPU where the flex forward would launch only B·Hq programs). `forward` and `backward` run
the kernels; gradients of captured arrays come from the XLA pass over key blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jattn._src.attention import (pallas_triton_bwd, pallas_triton_fwd, pallas_triton_jvp,
                                  pallas_triton_split_kv, xla)
from jattn._src.attention.common import Problem, tile_signature, trace_mods
from jattn._src.attention.config import AttentionConfig, heuristic_config
from jattn._src.attention.split_kv import MAX_DECODE_QUERIES, make_problem
from jattn._src.masks.block_mask import BlockMask, MaskLists
from jattn._src.pallas_triton.compile import triton_compiler_available
from jattn._src.user_functions import CaptureSet


def specialise(p: Problem, *, score_mod, mask_mod, score_set: CaptureSet, mask_set: CaptureSet,
               block_mask: BlockMask, config: AttentionConfig | None) -> Problem:
    """p with this backend's config and mods (p.xla already traced)."""
    resolved = config or heuristic_config(
        p.E, p.mask_block, masked=block_mask.mask_mod is not None,
        triton_compiler=not p.interpret and triton_compiler_available(),
        score_mod=score_mod is not None)
    resolved.check_fits(p.mask_block)
    traced = {
        name: trace_mods(score_mod, mask_mod, score_set, mask_set, *tile_signature(bq, bk, **t))
        for name, bq, bk, t in (("fwd", resolved.block_q, resolved.block_k, {}),
                                ("bwd", resolved.bwd_block_q, resolved.bwd_block_k, {}),
                                ("dkdv", resolved.bwd_block_q, resolved.bwd_block_k,
                                 {"transposed": True}))}
    decode = None
    # (the split-KV kernel keeps no largest scores and applies no dropout)
    if p.L <= MAX_DECODE_QUERIES and not p.max_scores and not p.dropout:
        decode = make_problem(
            B=p.B, Hq=p.Hq, Hkv=p.Hkv, Lq=p.L, S=p.S, E=p.E, Ev=p.Ev, kv_batch=p.kv_batch,
            page_size=None, num_pages=None, block_mask=None if p.dense else block_mask,
            score_mod=score_mod, mask_mod=mask_mod, score_set=score_set, mask_set=mask_set,
            static_length=True, queries_last=False, scale=p.scale, interpret=p.interpret,
            config=None)
    return dataclasses.replace(p, config=resolved, decode=decode, **traced)


def forward(p: Problem, q, k, v, lists: MaskLists, score_caps, mask_caps):
    """(out, lse), with p.max_scores (out, lse, max_scores), as the XLA forward's."""
    if p.decode is not None:
        mask = lists if p.decode.has_mask else None
        return pallas_triton_split_kv.attention_forward(p.decode, q, k, v, mask, score_caps,
                                                        mask_caps)
    return pallas_triton_fwd.forward(p, q, k, v, lists, score_caps, mask_caps)


def backward(p: Problem, res, d_out, d_lse):
    """(dq, dk, dv, d_score_captures) of the residuals `res` (attention.api)."""
    dq, dk, dv = pallas_triton_bwd.backward(p, res.q, res.k, res.v, res.lists,
                                            res.score_captures, res.mask_captures, res.out,
                                            res.lse, d_out, d_lse)
    return dq, dk, dv, captured_gradients(p, res, d_out, d_lse)


def tangents(p: Problem, residuals, linear):
    """The outputs' tangents as `xla.tangents`: `pallas_triton_jvp`'s kernel, or the XLA JVP
    where a captured array of the score_mod moves (its tangent enters every score)."""
    if any(t is not None for t in linear[3]):
        return xla.tangents(p, residuals, linear)
    q, k, v, lists, score_caps, mask_caps, out, lse = residuals
    d_out, d_lse = pallas_triton_jvp.tangents(p, q, k, v, *linear[:3], lists, score_caps,
                                              mask_caps, out, lse)
    return (d_out, d_lse, *([jnp.zeros_like(lse)] if p.max_scores else []))


def captured_gradients(p: Problem, res, d_out, d_lse) -> list:
    """The gradients of the score_mod's captured arrays (None for those not differentiated):
    an XLA pass over key blocks, run only when some captured array is being differentiated."""
    if not any(res.differentiated):
        return [None] * len(res.score_captures)
    *_, d_caps = xla.gradients(p, res.q, res.k, res.v, res.lists, res.score_captures,
                               res.mask_captures, res.out, res.lse, d_out, d_lse,
                               res.differentiated, operand_grads=False)
    return d_caps
