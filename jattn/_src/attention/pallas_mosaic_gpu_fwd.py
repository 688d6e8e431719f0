"""Flex attention forward kernel on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

One program per (query head, BlockMask row, batch): three warpgroups. The producer walks the
row's BlockMask lists (partial blocks, then full ones) and streams each listed K/V block into a
ring of shared-memory slots with TMA. The two consumers each own 64 query rows of the 128-row
block; they compute S = Q·Kᵀ with wgmma, apply score_mod (and mask_mod on partial blocks) to the
float32 tile in registers, run the online softmax in base 2 and accumulate P·V with wgmma.
A schedule barrier alternates the consumers, so one's softmax overlaps the other's matmuls
(FlashAttention-3's ping-pong).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src.attention.common import Problem
from jattn._src.attention.pallas_mosaic_gpu import BLOCK, CONSUMERS, ROWS, STAGES
from jattn._src.constants import LOG2_E, MASK_VALUE

SWIZZLE = 128  # bytes; with (8, 64)-element tiles, wgmma's operand layout in shared memory


def _kernel(q_ref, k_ref, v_ref, *refs, p: Problem, has_full: bool, n_captures, score_fn,
            mask_fn, dtype):
    n_lists = 4 if has_full else 2
    # Without a score_mod a positive scale folds into the exponent's factor: one multiply
    # per score fewer.
    fold_scale = score_fn is None and p.scale > 0
    factor = p.scale * LOG2_E if fold_scale else LOG2_E
    list_refs, (out_ref, lse_ref) = refs[:n_lists], refs[-2:]
    n_score = n_captures[0]
    score_refs = refs[n_lists:n_lists + n_score]
    mask_refs = refs[n_lists + n_score:-2]
    block_q, bkv = BLOCK
    stages = STAGES[p.E]

    def body(q_smem2, k_smem, v_smem, lse_smem2, k_ready, v_ready, q_ready, k_free, v_free,
             schedule):
        h, row, b = lax.axis_index("heads"), lax.axis_index("rows"), lax.axis_index("batch")
        wg = lax.axis_index("wg")
        owner = (b if p.mask_batch > 1 else 0, h if p.mask_heads > 1 else 0, row)
        partial = list_refs[0][owner]
        steps = partial + (list_refs[2][owner] if has_full else 0)

        def kv_block(step):
            """The kv block index of loop step `step`: partial blocks first, then full ones."""
            if not has_full:
                return list_refs[1][(*owner, step)]
            # Both reads stay inside the lists: step < partial + full <= the row's length.
            return jnp.where(step < partial, list_refs[1][(*owner, step)],
                             list_refs[3][(*owner, jnp.maximum(step - partial, 0))])

        def swap_turns():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q_smem, lse_smem = q_smem2.at[wg], lse_smem2.at[wg]
            q0 = row * block_q + wg * ROWS
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q0, ROWS)], q_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            def rows_vector(value):
                return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32),
                                         plgpu.Layout.WGMMA.reduce(1))

            carry = (plgpu.layout_cast(jnp.zeros((ROWS, p.E), jnp.float32),
                                       plgpu.Layout.WGMMA),
                     rows_vector(MASK_VALUE), rows_vector(0.0))

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(swap_turns)

            def visit(step, carry, apply_mask):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(stages))

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                    swap_turns()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if not fold_scale:
                    s = s * p.scale
                if score_fn is not None or (apply_mask and mask_fn is not None):
                    kv0 = kv_block(step) * bkv
                    if score_fn is not None:
                        s = score_fn(score_refs, s, b, h, q0, kv0)
                    if apply_mask and mask_fn is not None:
                        s = jnp.where(mask_fn(mask_refs, b, h, q0, kv0), s, -jnp.inf)
                # Online softmax in base 2; m starts at the finite MASK_VALUE, so a row with no
                # key kept yet gets exp2(-inf) = 0 and a scale of 1, never NaN.
                m_new = jnp.maximum(m_i, s.max(axis=1) * factor)
                alpha = jnp.exp2(m_i - m_new)
                prob = jnp.exp2(s * factor - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + prob.sum(axis=1)
                p_lo = prob.astype(dtype)
                acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(schedule)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
                    following = step + 1

                    @pl.when(following < steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(following, jnp.int32(stages))])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, partial, functools.partial(visit, apply_mask=True), carry)
            if has_full:
                carry = lax.fori_loop(partial, steps, functools.partial(visit, apply_mask=False),
                                      carry)
            acc, m_i, l_i = carry
            pl.when(wg == 0)(swap_turns)

            # Rows that attend to nothing give 0 and LSE -inf.
            empty = l_i == 0.0
            l_safe = jnp.where(empty, 1.0, l_i)
            acc /= lax.broadcast_in_dim(l_safe, acc.shape, [0])
            q_smem[...] = acc.astype(dtype)
            lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) / LOG2_E)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, h, pl.ds(q0, ROWS)])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, ROWS)])
            # Shared memory is free once the stores have read it; the program ends without
            # waiting for them to land (+1.6% at D64 with four K/V tiles per row).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_b = b if p.kv_batch > 1 else 0
            kv_h = lax.div(h, jnp.int32(p.Hq // p.Hkv))

            def fetch(step, slot):
                keys = (kv_b, kv_h, pl.ds(kv_block(step) * bkv, bkv))
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

            for slot in range(stages):
                pl.when(slot < steps)(functools.partial(fetch, slot, slot))

            @pl.loop(stages, jnp.maximum(steps, stages))
            def _(step):
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                fetch(step, slot)

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))
    pl.run_scoped(
        lambda buffers, ready, free, schedule: body(*buffers, *ready, *free, schedule),
        (plgpu.SMEM((CONSUMERS, ROWS, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.E), dtype, transforms=transforms),
         plgpu.SMEM((CONSUMERS, ROWS), jnp.float32)),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=CONSUMERS)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )


def forward(p: Problem, has_full: bool, q, k, v, lists, score_captures=(), mask_captures=(),
            score_fn=None, mask_fn=None):
    """(out [B, Hq, L, E] of q's dtype, lse [B, Hq, L] float32 natural log).

    lists: the BlockMask's kv-major [counts, indices] (then the full ones when has_full),
    int32. score_fn(refs, score, b, h, q0, kv0) and mask_fn(refs, b, h, q0, kv0) take the refs
    of `score_captures` / `mask_captures` (arrays in global memory), the float32 [64, block_kv]
    tile in the wgmma register layout, and int32 scalars: b, h and the positions of the tile's
    first row and column.
    """
    n_captures = (len(score_captures), len(mask_captures))
    kernel = functools.partial(_kernel, p=p, has_full=has_full, n_captures=n_captures,
                               score_fn=score_fn, mask_fn=mask_fn, dtype=q.dtype)
    out, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((p.B, p.Hq, p.L, p.E), q.dtype),
                   jax.ShapeDtypeStruct((p.B, p.Hq, p.L), jnp.float32)],
        grid=(p.Hq, p.L // BLOCK[0], p.B),
        grid_names=("heads", "rows", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        # Approximate exp2/log2 (one MUFU op each) suit the softmax, as in the Triton kernels;
        # the mods' tanh avoids tanh.approx (pallas_mosaic_gpu_mods).
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, *lists, *score_captures, *mask_captures)
    return out, lse
