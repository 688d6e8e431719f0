"""Flex attention forward kernel on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Each program takes a few 128-query tiles (batch, BlockMask row, query head) in turn, in the
order `tile_order` picks per call from the BlockMask's counts: one row's tiles of every head
in turn (rows of about equal work), each head's rows paired heaviest with lightest (rows of
unequal work), or dealt round the programs heaviest first (a few rows holding most of the
work). Each program has three warpgroups. The producer walks each tile's BlockMask lists
(partial blocks, then full ones) and streams each listed K/V block into a ring of shared-memory
slots with TMA, running on into the next tile while the consumers finish this one. The two
consumers each own 64 query rows of the tile; they compute S = Q·Kᵀ with wgmma, apply
score_mod (and mask_mod on partial blocks) to the float32 tile in registers, run the online
softmax in base 2 and accumulate P·V with wgmma, while the next tile's queries load into a
second buffer. A schedule barrier alternates the consumers, so one's softmax overlaps the
other's matmuls (FlashAttention-3's ping-pong).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src import hardware
from jattn._src.attention.common import Problem
from jattn._src.attention.pallas_mosaic_gpu import BLOCK, CONSUMERS, ROWS, STAGES
from jattn._src.attention.pallas_mosaic_gpu_tiles import (CONSUMER_REGISTERS, DEALT, PAIRED,
                                                           PRODUCER_REGISTERS, BlockLists,
                                                           heaviest_first, key_blocks,
                                                           operand_transforms, paired,
                                                           paired_tile_of, stream, tile_of,
                                                           tile_order)
from jattn._src.constants import LOG2_E, MASK_VALUE
from jattn._src.mesh_axes import kernel_operands, kernel_results, out_struct

# Tiles per program at most. A program walks several tiles so that its K/V pipeline runs on
# from one into the next. H100 (TFLOP/s): in the paired order two pairs balance best, B4 H16
# L4096 D128 causal 516 / 526 / 488 with 2 / 4 / 8 tiles; with rows in order, heads in turn,
# 8 beat 4 (a sliding window of 1024 at L16384: 482 against 458) and 1 (full and document
# masks). Without a BlockMask every tile has the same work, and 16 is a little faster still.
# Numbers: benchmarks/HISTORY.md, "Several tiles per program on the Mosaic forward", session 36.
MAX_TILES_PER_PROGRAM = 8
MAX_TILES_PER_PROGRAM_PAIRED = 4
MAX_TILES_PER_PROGRAM_DENSE = 16


def _kernel(q_ref, k_ref, v_ref, *refs, p: Problem, has_full: bool, n_captures, score_fn,
            mask_fn, keep_fn, dtype, groups: tuple[int, int]):
    n_lists = 4 if has_full else 2
    # Without a score_mod a positive scale folds into the exponent's factor: one multiply
    # per score fewer.
    fold_scale = score_fn is None and p.scale > 0
    factor = p.scale * LOG2_E if fold_scale else LOG2_E
    list_refs, (order_ref, mode_ref), (out_ref, lse_ref) = (
        refs[:n_lists], refs[n_lists:n_lists + 2], refs[-2:])
    n_score, n_mask, _ = n_captures
    score_refs = refs[n_lists + 2:n_lists + 2 + n_score]
    mask_refs = refs[n_lists + 2 + n_score:n_lists + 2 + n_score + n_mask]
    dropout_refs = refs[n_lists + 2 + n_score + n_mask:-2]
    block_q, bkv = BLOCK
    stages = STAGES[p.E]
    rows = p.L // block_q
    program = lax.axis_index("programs")
    tiles = p.B * rows * p.Hq
    mode = mode_ref[0]
    dealt = mode == DEALT
    # Tiles per program by the order (`groups`: paired, other); the grid has programs for
    # the smaller, and those beyond the larger's count take none.
    group = jnp.where(mode == PAIRED, *groups)
    programs = lax.div(tiles + group - 1, group)
    n_tiles = jnp.where(program < programs, jnp.minimum(group, jnp.where(
        dealt, lax.div(tiles - program + programs - 1, programs), tiles - program * group)), 0)
    lists = BlockLists(p, list_refs, has_full)

    def tile(i):
        """(b, h, row) of this program's tile i in the call's `tile_order`: `group`
        consecutive tiles per program (one row, heads in turn; or paired), or dealt round the
        programs (program p takes tiles p, p + programs, ...)."""
        t = jnp.where(dealt, i * programs + program, program * group + i)
        if p.dense:
            return tile_of(p, order_ref, t, rows)
        return tuple(jnp.where(mode == PAIRED, a, b) for a, b in zip(
            paired_tile_of(p, order_ref, t, rows), tile_of(p, order_ref, t, rows)))

    def slot_of(count):
        return lax.rem(count, jnp.int32(stages))

    def body(q_smem3, k_smem, v_smem, lse_smem2, k_ready, v_ready, q_ready, k_free, v_free,
             schedule):
        wg = lax.axis_index("wg")

        def swap_turns():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            lse_smem = lse_smem2.at[wg]

            def load_q(i):
                """Starts loading local tile i's queries into buffer i % 2."""
                b, h, row = tile(i)
                buffer = lax.rem(i, 2)
                plgpu.copy_gmem_to_smem(
                    q_ref.at[b, h, pl.ds(row * block_q + wg * ROWS, ROWS)],
                    q_smem3.at[buffer, wg], q_ready.at[buffer * CONSUMERS + wg])

            def rows_vector(value):
                return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32),
                                         plgpu.Layout.WGMMA.reduce(1))

            pl.when(n_tiles > 0)(lambda: load_q(0))

            def one_tile(i, done):
                """Local tile i, after `done` K/V blocks: its output and LSE."""
                b, h, row = tile(i)
                owner, partial, steps = lists.walk(b, h, row)
                q0 = row * block_q + wg * ROWS
                buffer = lax.rem(i, 2)
                q_smem = q_smem3.at[buffer, wg]
                # The next tile's queries load during this one; their buffer's output stores
                # have read it (the previous tile's last wait).
                pl.when(i + 1 < n_tiles)(lambda: load_q(i + 1))
                plgpu.barrier_wait(q_ready.at[buffer * CONSUMERS + wg])
                carry = (plgpu.layout_cast(jnp.zeros((ROWS, p.E), jnp.float32),
                                           plgpu.Layout.WGMMA),
                         rows_vector(MASK_VALUE), rows_vector(0.0))

                @pl.when(steps > 0)
                def _():
                    plgpu.barrier_wait(k_ready.at[slot_of(done)])

                pl.when(wg == 1)(swap_turns)

                def visit(step, carry, apply_mask):
                    acc, m_i, l_i = carry
                    slot = slot_of(done + step)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                        swap_turns()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    if not fold_scale:
                        s = s * p.scale
                    masked = apply_mask and mask_fn is not None
                    if score_fn is not None or masked or keep_fn is not None:
                        kv0 = lists.block(owner, partial, step) * bkv
                    if score_fn is not None:
                        s = score_fn(score_refs, s, b, h, q0, kv0)
                    if masked:
                        s = jnp.where(mask_fn(mask_refs, b, h, q0, kv0), s, -jnp.inf)
                    # Online softmax in base 2; m starts at the finite MASK_VALUE, so a row with
                    # no key kept yet gets exp2(-inf) = 0 and a scale of 1, never NaN.
                    m_new = jnp.maximum(m_i, s.max(axis=1) * factor)
                    alpha = jnp.exp2(m_i - m_new)
                    prob = jnp.exp2(s * factor - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + prob.sum(axis=1)
                    if keep_fn is not None:  # dropped weights leave the product, not l
                        prob = jnp.where(keep_fn(dropout_refs, b, h, q0, kv0), prob, 0.0)
                    p_lo = prob.astype(dtype)
                    acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
                    plgpu.barrier_arrive(schedule)
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(schedule)

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])

                        @pl.when(step + 1 < steps)
                        def _():
                            plgpu.barrier_wait(k_ready.at[slot_of(done + step + 1)])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                carry = lax.fori_loop(0, partial, functools.partial(visit, apply_mask=True),
                                      carry)
                if has_full:
                    carry = lax.fori_loop(partial, steps,
                                          functools.partial(visit, apply_mask=False), carry)
                acc, m_i, l_i = carry
                pl.when(wg == 0)(swap_turns)

                # Rows that attend to nothing give 0 and LSE -inf.
                empty = l_i == 0.0
                l_safe = jnp.where(empty, 1.0, l_i)
                # Kept weights are scaled by 1 / (1 - rate); the LSE stays the softmax's.
                norm = l_safe * (1.0 - p.dropout) if keep_fn is not None else l_safe
                acc /= lax.broadcast_in_dim(norm, acc.shape, [0])
                q_smem[...] = acc.astype(dtype)
                lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) / LOG2_E)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, h, pl.ds(q0, ROWS)])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, ROWS)])
                # The next tile may reuse shared memory once the stores have read it; nothing
                # waits for them to land.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                return done + steps

            lax.fori_loop(0, n_tiles, one_tile, jnp.int32(0))

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def one_tile(i, done):
                b, h, row = tile(i)
                owner, partial, steps = lists.walk(b, h, row)
                stream(steps, done, key_blocks(p, lists, b, h, owner, partial, bkv),
                       (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free))
                return done + steps

            lax.fori_loop(0, n_tiles, one_tile, jnp.int32(0))

    transforms = operand_transforms()
    pl.run_scoped(
        lambda buffers, ready, free, schedule: body(*buffers, *ready, *free, schedule),
        (plgpu.SMEM((2, CONSUMERS, ROWS, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.E), dtype, transforms=transforms),
         plgpu.SMEM((CONSUMERS, ROWS), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=2 * CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )


def _tiles_per_program(tiles: int, most: int) -> int:
    """The most tiles per program, up to `most`, whose programs take no more waves of tiles
    over the SMs than one tile per program would."""
    sms = hardware.num_sms()

    def wave_tiles(group):
        programs = -(-tiles // group)
        return -(-programs // sms) * group

    return max(g for g in range(1, most + 1) if wave_tiles(g) <= wave_tiles(1))


def forward(p: Problem, has_full: bool, q, k, v, lists, score_captures=(), mask_captures=(),
            dropout_tables=(), score_fn=None, mask_fn=None, keep_fn=None):
    """(out [B, Hq, L, E] of q's dtype, lse [B, Hq, L] float32 natural log).

    lists: the BlockMask's kv-major [counts, indices] (then the full ones when has_full),
    int32. score_fn(refs, score, b, h, q0, kv0) and mask_fn(refs, b, h, q0, kv0) take the refs
    of `score_captures` / `mask_captures` (arrays in global memory), the float32 [64, block_kv]
    tile in the wgmma register layout, and int32 scalars: b, h and the positions of the tile's
    first row and column. With dropout, keep_fn(refs, b, h, q0, kv0) reads `dropout_tables`
    (`dropout.word_tables`) as mask_fn reads its captures.
    """
    n_captures = (len(score_captures), len(mask_captures), len(dropout_tables))
    tiles = p.B * (p.L // BLOCK[0]) * p.Hq
    # Programs take their tiles in the order `tile_order` picks per call from the BlockMask's
    # counts. H100, B4 H16 D128 (TFLOP/s, one run): causal L4096 524 paired against 500 with
    # one row's tiles of every head in turn (the only consecutive order before), L16384 598
    # against 566, L2048 472 paired against 434 dealt; B1 H16 L16384: documents of 4k 522
    # against 495, packed documents of 1k-7k tokens 471 paired against 427 dealt; rows of
    # equal work keep rows in order, heads in turn (sliding window 1024: 482 against 463
    # paired).
    heaviest = heaviest_first(lists, has_full)
    if p.dense:
        group = _tiles_per_program(tiles, MAX_TILES_PER_PROGRAM_DENSE)
        groups, order, mode = (group, group), heaviest, jnp.zeros((1,), jnp.int32)
    else:
        groups = (_tiles_per_program(tiles, MAX_TILES_PER_PROGRAM_PAIRED),
                  _tiles_per_program(tiles, MAX_TILES_PER_PROGRAM))
        pairs = paired(lists, has_full)
        mode = tile_order(lists, has_full, heaviest, pairs, batch_heads=(p.B, p.Hq),
                          groups=groups, sms=hardware.num_sms())
        order = jnp.where(mode[0] == PAIRED, pairs, heaviest)
    programs = -(-tiles // min(groups))
    kernel = functools.partial(_kernel, p=p, has_full=has_full, n_captures=n_captures,
                               score_fn=score_fn, mask_fn=mask_fn, keep_fn=keep_fn,
                               dtype=q.dtype, groups=groups)
    operands, axes = kernel_operands(q, k, v, *lists, order, mode, *score_captures,
                                     *mask_captures, *dropout_tables)
    out, lse = plgpu.kernel(
        kernel,
        out_type=[out_struct((p.B, p.Hq, p.L, p.E), q.dtype, operands[0]),
                  out_struct((p.B, p.Hq, p.L), jnp.float32, operands[0])],
        grid=(programs,),
        grid_names=("programs",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        # Approximate exp2/log2 (one MUFU op each) suit the softmax, as in the Triton kernels;
        # the mods' tanh avoids tanh.approx (pallas_mosaic_gpu_mods).
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)
    return kernel_results((out, lse), axes)
