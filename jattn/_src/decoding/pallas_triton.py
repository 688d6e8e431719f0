"""Flex decoding kernel (Pallas, lowered to Triton): split-KV, GQA-packed, contiguous or paged.

Grid: (splits, B·Hkv·head tiles). A program holds the queries of `heads_per_tile` query heads
that share one kv head — heads x Lq rows packed into one [block_m, E] tile, so K and V are read
once for the whole group — and streams its share of that kv head's keys in [block_k, E] tiles,
keeping an online softmax in base 2. It writes unnormalised float32 partials (acc, m, l) of its
key range; XLA merges the splits (`combine_splits`).

Key ranges. Without a BlockMask the tiles below kv_len[b] are cut into `splits` equal runs
(splits past the length do nothing); only the last tile needs a length mask. With a BlockMask
each split walks its share of the concatenated block lists (partial, then full) of the mask
rows its queries fall in — one row, or two when Lq queries straddle a row boundary, each row's
blocks then kept only for that row's queries. Tiles of listed blocks past kv_len load nothing
(masked loads issue no memory traffic).

Paged K/V: the pool is [Hkv, pages·page_size, E] per head; logical tile t of sequence b lives
at row page_table[b, t // page_size]·page_size + t % page_size. Only that address differs from
the contiguous kernel, so both compute the same floating-point operations in the same order:
bitwise equal results for the same config.

Performance model (H100, Hq 32, Hkv 8, D 128, bf16, Lq 1; bytes = K + V read once). A program
streams 64x128 K and V tiles (16 KiB each); 3 pipeline stages keep two steps (64 KiB) in flight
and two programs share an SM, ~128 KiB per SM, several times what Little's law needs at
3.35 TB/s and ~1 us of latency. The math per step (a 16x128x64 and a 16x64x128 dot, 1024 exp2)
hides under the loads. Predicted, before any GPU run: B8/32k (512 programs of 64 tiles)
2.5-2.8 TB/s; B1/128k (264 programs of 62 tiles) 2.4-2.7 TB/s, of which the XLA combine and
the launch take ~5-10 us of ~190 us; B1/8k (128 programs of 8 tiles, 33 MB) launch-bound near
1-1.5 TB/s. The risk is the pipeliner: if Triton does not keep both loads in flight, a
program waits one full latency per step and the rate falls towards 1 TB/s. Measured (session 4
sweep at B8/32k): 3 stages 2672 GB/s, 4 stages 2874 (the default since), 128-row tiles
2834-2853; other split counts than the heuristic's 8 were slower (2608-2718).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jattn._src.attention import pallas_triton_tiles as tiles
from jattn._src.constants import LOG2_E, MASK_VALUE
from jattn._src.decoding.common import DecodeProblem, combine_splits, kv_lists
from jattn._src.pallas_triton_compile import compiler_params
from jattn._src.pallas_triton_lookup import call_in_kernel


def _i32(x: int):
    return jnp.int32(x)


def _share(count, split, splits: int):
    """[lo, hi): split `split`'s share of `count` items cut into `splits` equal runs."""
    per = tiles.cdiv(count, splits) if isinstance(count, int) else lax.div(
        count + _i32(splits - 1), _i32(splits))
    lo = split * per
    return lo, jnp.minimum(lo + per, count)


def _decode_kernel(*refs, p: DecodeProblem, n_lists: int, n_score: int):
    q_ref, k_ref, v_ref, q_start_ref, kv_len_ref = refs[:5]
    rest = refs[5:-3]
    table_ref = rest[0] if p.paged else None
    rest = rest[1:] if p.paged else rest
    list_refs, score_refs = rest[:n_lists], rest[n_lists:n_lists + n_score]
    mask_refs = rest[n_lists + n_score:]
    acc_ref, m_ref, l_ref = refs[-3:]
    bk, rows_m, splits = p.config.block_k, p.block_m, p.config.num_splits

    # ---- this program: query rows of (b, kv head, head tile) and one split of the keys ---------
    split, program = pl.program_id(0), pl.program_id(1)
    per_batch = p.Hkv * p.head_tiles
    b = program // per_batch
    first_head = (program % per_batch) * p.heads_per_tile
    row = lax.broadcasted_iota(jnp.int32, (rows_m, 1), 0)
    h = first_head + lax.div(row, _i32(p.Lq))                      # [M, 1] query head
    q_start, kv_len = q_start_ref[b], kv_len_ref[b]
    pos = q_start + lax.rem(row, _i32(p.Lq))                       # [M, 1] query position
    limit = p.S if p.static_length else kv_len
    q_tile = tiles.load_tile(q_ref, (slice(None),), 0, rows_m, p.rows, p.E)

    deferred = tiles.deferred_scale(p, p.mods)
    factor = deferred * LOG2_E
    scale = p.scale / deferred

    def kv_row(t0):
        """Row of logical position t0 (a tile start) in the K/V ref."""
        if not p.paged:
            return pl.multiple_of(t0, bk)
        page_size = _i32(p.page_size)
        logical_page = jnp.minimum(lax.div(t0, page_size), p.S // p.page_size - 1)
        page = jnp.clip(table_ref[b, logical_page], 0, p.num_pages - 1)  # never out of the pool
        return pl.multiple_of(page * page_size + lax.rem(t0, page_size), bk)

    def load_kv(ref, t0, dim: int, masked: bool):
        rows_in = tiles.bounds(t0, bk, limit, 0) if masked else None
        return tiles.load(ref, (pl.ds(kv_row(t0), bk), slice(None)),
                          tiles.both(rows_in, tiles.bounds(0, tiles.padded(dim), dim, 1)))

    def visit(t0, carry, *, masked: bool, apply_mask_mod: bool, row_keep):
        k_tile = load_kv(k_ref, t0, p.E, masked)
        s = lax.dot_general(q_tile, k_tile, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        if scale != 1.0:
            s = s * scale
        kv_idx = t0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        if p.mods.score is not None:
            s = call_in_kernel(p.mods.score, score_refs, s, b, h, pos, kv_idx)[0]
        keep = tiles.both(row_keep, kv_idx < limit if masked else None)
        if apply_mask_mod and p.mods.mask is not None:
            keep = tiles.both(keep, call_in_kernel(p.mods.mask, mask_refs, b, h, pos,
                                                   kv_idx)[0])
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)  # as in the flex forward: dies before the exp2
        v_tile = load_kv(v_ref, t0, p.Ev, masked)  # loaded before the exp2s, unlike the forward
        return tiles.softmax_step(p, carry, s, factor, lambda: v_tile)

    carry = (jnp.full((rows_m,), MASK_VALUE, jnp.float32), jnp.zeros((rows_m,), jnp.float32),
             jnp.zeros((rows_m, tiles.padded(p.Ev)), jnp.float32))
    # Queries at negative positions (kv_len < Lq) attend to nothing.
    valid_rows = pos >= 0 if p.Lq > 1 else None

    if not p.has_mask:
        # ---- dense: equal runs of the tiles below kv_len, the ragged last tile masked ---------
        if p.static_length:
            n_tiles, whole_tiles = tiles.cdiv(p.S, bk), p.S // bk
        else:
            n_tiles = lax.div(kv_len + _i32(bk - 1), _i32(bk))
            whole_tiles = lax.div(kv_len, _i32(bk))
        lo, hi = _share(n_tiles, split, splits)
        mid = jnp.clip(whole_tiles, lo, hi)
        for first, last, masked in ((lo, mid, False), (mid, hi, True)):
            if masked and p.static_length and p.S % bk == 0:
                continue
            carry = lax.fori_loop(first, last, lambda j, c, masked=masked: visit(
                j * bk, c, masked=masked, apply_mask_mod=False, row_keep=valid_rows), carry)
    else:
        # ---- block lists of the one or two mask rows the queries fall in, cut into splits ------
        block_q, block_kv = p.mask_block
        per_block = block_kv // bk
        mb = b if p.mask_batch > 1 else 0
        mh = first_head if p.mask_heads > 1 else 0

        def mask_row(position):
            return jnp.clip(lax.div(jnp.maximum(position, 0), _i32(block_q)), 0,
                            p.mask_rows - 1)

        first_row, last_row = mask_row(q_start), mask_row(q_start + p.Lq - 1)
        query_row = mask_row(pos)
        mask_rows = [(first_row, 1)]
        if p.Lq > 1:  # a second row only when the queries straddle a block boundary
            mask_rows.append((last_row, (last_row != first_row).astype(jnp.int32)))
        segments = []
        for mask_row_index, active in mask_rows:
            keep = None if p.Lq == 1 else (query_row == mask_row_index) & valid_rows
            for kind in range(0, len(list_refs), 2):
                count = list_refs[kind][mb, mh, mask_row_index] * per_block * active
                segments.append((count, list_refs[kind + 1], mask_row_index, kind == 0, keep))
        lo, hi = _share(sum(s[0] for s in segments), split, splits)
        masked = not p.static_length or p.S % block_kv != 0
        offset = 0
        for count, indices_ref, mask_row_index, partial, keep in segments:

            def body(j, c, indices_ref=indices_ref, r=mask_row_index, partial=partial,
                     keep=keep):
                block = indices_ref[mb, mh, r, lax.div(j, _i32(per_block))]
                t0 = block * block_kv + lax.rem(j, _i32(per_block)) * bk
                return visit(t0, c, masked=masked, apply_mask_mod=partial, row_keep=keep)

            carry = lax.fori_loop(jnp.clip(lo - offset, 0, count),
                                  jnp.clip(hi - offset, 0, count), body, carry)
            offset = offset + count

    # ---- unnormalised partials of this split ----------------------------------------------------
    m_i, l_i, acc = carry
    acc_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


def forward(p: DecodeProblem, q, k, v, q_start, kv_len, page_table, lists, score_caps,
            mask_caps):
    """(out [B, Hq, Lq, Ev] of q's dtype, lse [B, Hq, Lq] float32 natural log).

    k, v: contiguous [kv_batch, Hkv, S, E|Ev], or page pools [Hkv, pages, page_size, E|Ev] with
    page_table [B, S / page_size]. q_start, kv_len: int32 [B]. lists: the BlockMask's kv-major
    lists (partial, then full if any) or empty.
    """
    rows_m, splits, bk = p.block_m, p.config.num_splits, p.config.block_k
    e_pad, ev_pad = tiles.padded(p.E), tiles.padded(p.Ev)
    per_batch = p.Hkv * p.head_tiles
    q_rows = q.reshape(p.B, per_batch, p.rows, p.E)  # heads x queries of a program, contiguous

    def q_index(split, program):
        return program // per_batch, program % per_batch, 0, 0

    def kv_head(program):
        return (program % per_batch) // p.head_tiles

    if p.paged:
        k, v = (x.reshape(p.Hkv, p.num_pages * p.page_size, x.shape[-1]) for x in (k, v))
        kv_specs = [pl.BlockSpec((None, k.shape[1], pad), lambda s, pr: (kv_head(pr), 0, 0))
                    for pad in (e_pad, ev_pad)]
        extra = [page_table]
    else:
        # Whole tiles (or whole mask blocks) past S stay inside the block: the interpreter pads
        # it; on the GPU the loads there are masked.
        unit = p.mask_block[1] if p.has_mask else bk
        span = tiles.cdiv(p.S, unit) * unit

        def kv_index(split, program):
            return (program // per_batch if p.kv_batch > 1 else 0), kv_head(program), 0, 0

        kv_specs = [pl.BlockSpec((None, None, span, pad), kv_index) for pad in (e_pad, ev_pad)]
        extra = []
    inputs = [q_start, kv_len, *extra, *lists, *score_caps, *mask_caps]
    kernel = functools.partial(_decode_kernel, p=p, n_lists=len(lists), n_score=len(score_caps))
    programs = p.programs
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(splits, programs),
        in_specs=[pl.BlockSpec((None, None, rows_m, e_pad), q_index), *kv_specs,
                  *[tiles.whole(x) for x in inputs]],
        out_specs=[pl.BlockSpec((None, None, rows_m, ev_pad), lambda s, pr: (s, pr, 0, 0)),
                   pl.BlockSpec((None, None, rows_m), lambda s, pr: (s, pr, 0)),
                   pl.BlockSpec((None, None, rows_m), lambda s, pr: (s, pr, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, programs, rows_m, ev_pad), jnp.float32),
                   jax.ShapeDtypeStruct((splits, programs, rows_m), jnp.float32),
                   jax.ShapeDtypeStruct((splits, programs, rows_m), jnp.float32)],
        compiler_params=compiler_params(p.config.num_warps, p.config.num_stages,
                                        compiler=p.config.compiler),
        interpret=p.implementation == "interpret",
        name="jattn_flex_decode",
    )(q_rows, k, v, *inputs)
    # Padding rows and columns are dropped before the merge, which then reads only real ones.
    out, lse = combine_splits(acc[:, :, :p.rows, :p.Ev], m[:, :, :p.rows], l[:, :, :p.rows])
    return (out.reshape(p.B, p.Hq, p.Lq, p.Ev).astype(q.dtype),
            lse.reshape(p.B, p.Hq, p.Lq))


def attention_forward(p: DecodeProblem, q, k, v, masks, score_caps, mask_caps):
    """flex_attention's forward on this kernel (few queries): queries at positions 0..L-1, every
    key of k/v; masks: the BlockMask fields (kv-major lists used). (out, lse) as forward."""
    lists = kv_lists(masks) if p.has_mask else []
    return forward(p, q, k, v, np.zeros((p.B,), np.int32), np.full((p.B,), p.S, np.int32),
                   None, lists, score_caps, mask_caps)
