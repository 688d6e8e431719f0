"""Flex decoding kernel (Pallas, lowered to Triton): split-KV, GQA-packed, contiguous or paged.

Grid: (splits, B·Hkv·head tiles). A program holds the queries of `heads_per_tile` query heads
that share one kv head — heads x Lq rows packed into one [block_m, E] tile, so K and V are read
once for the whole group — and streams its share of that kv head's keys in [block_k, E] tiles,
keeping an online softmax in base 2. It writes unnormalised float32 partials (acc, m, l) of its
key range; a second kernel merges the splits of each query row (`_combine_kernel`).

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
hides under the loads. On the H100 at B8/32k the kernel runs at ~90% of DRAM peak, level with
cuDNN's split-KV kernel, the merge adds a few microseconds, and no tile, stage or split count
beats the defaults (64-row tiles, 4 warps, 4 stages when a split streams >= 48 tiles) by more
than ~1% (benchmarks/HISTORY.md, "Flex decoding").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn._src.attention import pallas_triton_tiles as tiles
from jattn._src.attention.split_kv import DecodeProblem
from jattn._src.constants import LOG2_E, MASK_VALUE
from jattn._src.masks.block_mask import MaskLists
from jattn._src.pallas_triton.compile import compiler_params
from jattn._src.pallas_triton.captured_loads import call_in_kernel


# A merge program holds a [splits, Ev] float32 tile (splits padded to a power of two): 4 warps
# up to this many elements (64 registers a thread), 8 above.
COMBINE_TILE_PER_4_WARPS = 64 * 128


def _i32(x: int):
    return jnp.int32(x)


def _share(count, split, splits: int):
    """[lo, hi): split `split`'s share of `count` items cut into `splits` equal runs."""
    per = tiles.cdiv(count, splits) if isinstance(count, int) else lax.div(
        count + _i32(splits - 1), _i32(splits))
    lo = split * per
    return lo, jnp.minimum(lo + per, count)


def _decode_kernel(*refs, p: DecodeProblem, n_lists: int, n_score: int):
    q_ref, k_ref, v_ref = refs[:3]
    rest = list(refs[3:-3])
    kv_len_ref = None if p.static_length else rest.pop(0)
    table_ref = rest.pop(0) if p.paged else None
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
    limit = p.S if p.static_length else jnp.clip(kv_len_ref[b], 0, p.S)  # keys of sequence b
    q_start = limit - p.Lq if p.queries_last else 0
    pos = q_start + lax.rem(row, _i32(p.Lq))                       # [M, 1] query position
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
            n_tiles = lax.div(limit + _i32(bk - 1), _i32(bk))
            whole_tiles = lax.div(limit, _i32(bk))
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

    # ---- unnormalised partials of this split, real rows only -----------------------------------
    m_i, l_i, acc = carry
    tiles.store_tile(acc_ref, (slice(None),), acc, 0, p.rows, p.Ev)
    tiles.store_vector(m_ref, (slice(None),), m_i, 0, p.rows)
    tiles.store_vector(l_ref, (slice(None),), l_i, 0, p.rows)


def _combine_kernel(*refs, p: DecodeProblem, has_bad: bool):
    """Merges the splits of one query row: out = Σ 2^(m_s - m) acc_s / Σ 2^(m_s - m) l_s.

    A split that saw nothing has m = MASK_VALUE (finite) and l = 0, so its weight is 0 next to
    any real maximum and no inf - inf arises; a row no split saw gives 0 and LSE -inf. Rows of
    a sequence flagged in `bad` come out NaN.
    """
    acc_ref, m_ref, l_ref = refs[:3]
    bad_ref = refs[3] if has_bad else None
    out_ref, lse_ref = refs[-2:]
    splits = p.config.num_splits
    rows_s = tiles.padded(splits)
    acc = tiles.load_tile(acc_ref, (slice(None),), 0, rows_s, splits, p.Ev)  # [splits, Ev]
    m = tiles.load_vector(m_ref, (slice(None),), 0, rows_s, splits)
    l = tiles.load_vector(l_ref, (slice(None),), 0, rows_s, splits)     # 0 past the splits
    if rows_s != splits:
        m = jnp.where(lax.broadcasted_iota(jnp.int32, (rows_s,), 0) < splits, m, MASK_VALUE)
    m_max = m.max()
    weight = jnp.exp2(m - m_max)
    l_sum = (weight * l).sum()
    l_safe = jnp.where(l_sum == 0, 1.0, l_sum)
    out = (weight[:, None] * acc).sum(axis=0) / l_safe
    lse = jnp.where(l_sum == 0, -jnp.inf, (m_max + jnp.log2(l_safe)) / LOG2_E)
    if has_bad:
        row_is_bad = bad_ref[pl.program_id(0) // (p.Hq * p.Lq)] != 0
        out = jnp.where(row_is_bad, jnp.nan, out)
        lse = jnp.where(row_is_bad, jnp.nan, lse)
    tiles.store_vector(out_ref, (slice(None),), out.astype(out_ref.dtype), 0, p.Ev)
    lse_ref[...] = lse


def forward(p: DecodeProblem, q, k, v, kv_len, page_table, lists, score_caps, mask_caps, *,
            bad=None):
    """(out [B, Hq, Lq, Ev] of q's dtype, lse [B, Hq, Lq] float32 natural log).

    k, v: contiguous [kv_batch, Hkv, S, E|Ev], or page pools [Hkv, pages, page_size, E|Ev] with
    page_table [B, S / page_size]. kv_len: int32 [B] (clipped to [0, S] here), None when
    p.static_length. lists: the BlockMask's kv-major lists (partial, then full if any) or empty.
    bad: bool [B] or None: sequences whose rows come out NaN.

    Two launches: the split-KV kernel writes float32 partials of the real rows, then one
    program per query row merges its splits (one kernel: XLA would run the merge as two, and every
    launch is ~1% of a B8/32k call).
    """
    rows_m, splits, bk = p.block_m, p.config.num_splits, p.config.block_k
    e_pad, ev_pad = tiles.padded(p.E), tiles.padded(p.Ev)
    per_batch = p.Hkv * p.head_tiles
    programs = p.programs
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
    lengths = [] if p.static_length else [kv_len]
    inputs = [*lengths, *extra, *lists, *score_caps, *mask_caps]
    kernel = functools.partial(_decode_kernel, p=p, n_lists=len(lists), n_score=len(score_caps))
    # Partials [programs, rows, splits, ...]: the splits of a query row are contiguous for the
    # merge; a program writes its real rows of one split (row stride splits x Ev).
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(splits, programs),
        in_specs=[pl.BlockSpec((None, None, rows_m, e_pad), q_index), *kv_specs,
                  *[tiles.whole(x) for x in inputs]],
        out_specs=[pl.BlockSpec((None, rows_m, None, ev_pad), lambda s, pr: (pr, 0, s, 0)),
                   pl.BlockSpec((None, rows_m, None), lambda s, pr: (pr, 0, s)),
                   pl.BlockSpec((None, rows_m, None), lambda s, pr: (pr, 0, s))],
        out_shape=[jax.ShapeDtypeStruct((programs, p.rows, splits, p.Ev), jnp.float32),
                   jax.ShapeDtypeStruct((programs, p.rows, splits), jnp.float32),
                   jax.ShapeDtypeStruct((programs, p.rows, splits), jnp.float32)],
        compiler_params=compiler_params(p.config.num_warps, p.config.num_stages,
                                        compiler=p.config.compiler),
        interpret=p.interpret,
        name="jattn_flex_decode",
    )(q_rows, k, v, *inputs)

    query_rows = programs * p.rows  # = B·Hq·Lq, in q's order
    rows_s = tiles.padded(splits)
    bad_inputs = [] if bad is None else [jnp.asarray(bad).astype(jnp.int32)]
    out, lse = pl.pallas_call(
        functools.partial(_combine_kernel, p=p, has_bad=bad is not None),
        grid=(query_rows,),
        in_specs=[pl.BlockSpec((None, rows_s, ev_pad), lambda r: (r, 0, 0)),
                  pl.BlockSpec((None, rows_s), lambda r: (r, 0)),
                  pl.BlockSpec((None, rows_s), lambda r: (r, 0)),
                  *[tiles.whole(x) for x in bad_inputs]],
        out_specs=[pl.BlockSpec((None, ev_pad), lambda r: (r, 0)),
                   pl.BlockSpec((None,), lambda r: (r,))],
        out_shape=[jax.ShapeDtypeStruct((query_rows, p.Ev), q.dtype),
                   jax.ShapeDtypeStruct((query_rows,), jnp.float32)],
        compiler_params=compiler_params(4 if rows_s * ev_pad <= COMBINE_TILE_PER_4_WARPS else 8,
                                        1, compiler=p.config.compiler),
        interpret=p.interpret,
        name="jattn_flex_decode_combine",
    )(acc.reshape(query_rows, splits, p.Ev), m.reshape(query_rows, splits),
      l.reshape(query_rows, splits), *bad_inputs)
    return out.reshape(p.B, p.Hq, p.Lq, p.Ev), lse.reshape(p.B, p.Hq, p.Lq)


def attention_forward(p: DecodeProblem, q, k, v, lists: MaskLists | None, score_caps,
                      mask_caps):
    """flex_attention's forward on this kernel (few queries): queries at positions 0..L-1, every
    key of k/v; lists: the BlockMask's (None: no mask). (out, lse) as forward."""
    lists = lists.major("kv") if p.has_mask else []
    return forward(p, q, k, v, None, None, lists, score_caps, mask_caps)
