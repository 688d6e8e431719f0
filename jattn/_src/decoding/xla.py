"""Flex decoding through flex_attention: the XLA implementation's `decode`, and the path of
query blocks too long for the split-KV kernel on any backend.

Decoding differs from flex_attention only in where queries sit and which keys exist: query i of
sequence b is at position q_start[b] + i, keys at kv_len[b] and beyond do not exist, and the
BlockMask's rows are looked up at those positions. All three fold into one score_mod
(`decode_score_mod`: -inf where a pair does not attend), so flex_attention without a BlockMask
computes the decode result — by XLA on the CPU, or by the flex attention kernels for query
blocks too long for the decode kernel. It reads every key of the cache, which costs nothing
extra on the CPU and is the documented price of the fallback on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.attention.api import flex_attention
from jattn._src.attention.common import checked_mask_mod, checked_score_mod
from jattn._src.decoding.call import DecodeCall, bad_lengths, no_gradient
from jattn._src.masks.block_mask import BlockMask

# Block kinds in the int8 table a decode score_mod looks up (int8: Triton loads no bools).
_EMPTY, _PARTIAL, _FULL = 0, 1, 2


def _block_kinds(block_mask: BlockMask) -> jax.Array:
    """[Bm, Hm, nQ, nKV] int8: _EMPTY, _PARTIAL or _FULL per block."""
    partial = block_mask.partial_blocks().astype(jnp.int8) * _PARTIAL
    return partial + block_mask.full_blocks().astype(jnp.int8) * _FULL


def decode_score_mod(score_mod: Callable | None, block_mask: BlockMask | None,
                     q_start: jax.Array, kv_len: jax.Array) -> Callable:
    """A flex_attention score_mod that computes decoding: score_mod at absolute query positions,
    -inf where the key is at or past kv_len, the position is negative, or the BlockMask (its
    row at the query's position) does not attend."""
    kinds = mask_mod = None
    if block_mask is not None:
        kinds = _block_kinds(block_mask)
        if block_mask.mask_mod is not None:
            mask_mod = checked_mask_mod(block_mask.mask_mod, "flex_decode")
    if kinds is not None:
        (batches, heads, n_rows, _), (block_q, block_kv) = kinds.shape, block_mask.block_size
        # Broadcast mask axes are dropped, so the lookup indexes only the axes that vary.
        kinds = kinds[(slice(None) if batches > 1 else 0, slice(None) if heads > 1 else 0)]

    def decode_mod(score, b, h, q_idx, kv_idx):
        position = q_start[b] + q_idx
        if score_mod is not None:
            score = score_mod(score, b, h, position, kv_idx)
        keep = (kv_idx < kv_len[b]) & (position >= 0)
        if kinds is not None:
            index = [b] if batches > 1 else []
            index += [h] if heads > 1 else []
            # lax.div on non-negative ints: jnp's floor-division fix-ups do not lower in a
            # Triton loop (the fallback runs this inside the flex attention kernel).
            row = jnp.minimum(lax.div(jnp.maximum(position, 0), jnp.int32(block_q)),
                              n_rows - 1)
            kind = kinds[(*index, row, lax.div(kv_idx, jnp.int32(block_kv)))]
            attends = kind == _FULL
            if mask_mod is None:
                attends = attends | (kind == _PARTIAL)
            else:
                attends = attends | ((kind == _PARTIAL) & mask_mod(b, h, position, kv_idx))
            keep = keep & attends
        return jnp.where(keep, score, -jnp.inf)

    return decode_mod


def forward(q, k, v, score_mod, block_mask, q_start, kv_len, *, scale: float,
            implementation: str, precision: str | None):
    """(out, lse) of decoding over contiguous k/v [B|1, Hkv, S, E] through flex_attention."""
    return flex_attention(q, k, v, decode_score_mod(score_mod, block_mask, q_start, kv_len),
                          None, scale=scale, enable_gqa=True, return_lse=True,
                          implementation=implementation, precision=precision)


def decode(call: DecodeCall):
    """(out, lse) through flex_attention over the whole cache, on the call's implementation.
    Lengths the host has not checked are clipped and the rows of bad sequences made NaN."""
    q, cache, kv_len = call.q, call.cache, call.kv_len
    B, Hq, Lq, _ = q.shape
    S = call.dims.S
    score_mod = call.score_mod
    if score_mod is not None:
        score_mod = checked_score_mod(score_mod, "flex_decode", (B, Hq, Lq, S))
    k_seq, v_seq = cache.to_contiguous() if cache is not None else (call.k, call.v)
    if any(isinstance(x, jax.core.Tracer) for x in (q, k_seq, v_seq)):
        q, k_seq, v_seq = no_gradient((q, k_seq, v_seq))  # eager arrays have no gradient
    kv_len = jnp.asarray(kv_len)  # (the mods index it with traced batch indices)
    bad = None
    if not call.checked:
        bad = bad_lengths(jnp, kv_len, S, call.dims.page_size, call.dims.num_pages,
                          None if cache is None else cache.page_table)
        kv_len = jnp.clip(kv_len, 0, S)
    out, lse = forward(q, k_seq, v_seq, score_mod, call.block_mask, kv_len - Lq, kv_len,
                       scale=call.scale, implementation=call.implementation.name,
                       precision=call.precision)
    if bad is not None:
        out = jnp.where(bad[:, None, None, None], jnp.nan, out).astype(out.dtype)
        lse = jnp.where(bad[:, None, None], jnp.nan, lse)
    return out, lse
