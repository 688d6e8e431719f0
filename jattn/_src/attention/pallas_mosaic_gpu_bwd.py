"""Flex attention backward kernels on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Two kernels after pallas_triton's delta pass (delta = rowsum(O ∘ dO) − d_lse and the LSE in base
2), each recomputing the probabilities P = exp2(S·c − lse₂); no atomics, so the gradients are
bitwise repeatable:
- dQ: a program per 128-query tile (batch, BlockMask row, query head), the rows with the most
  blocks first. A producer warpgroup streams the row's listed K/V blocks by TMA into a ring of
  shared-memory slots; two consumer warpgroups own 64 query rows each, compute S = Q·Kᵀ and
  dP = dO·Vᵀ with wgmma, dS = P ∘ (dP − delta) (through score_mod's gradient), and accumulate
  dQ += dS·K with dS taken from registers.
- dK/dV: a program per 128-key tile (batch, kv head, BlockMask column), each consumer owning 64
  keys held in shared memory. For each of the G query heads of its kv head, the producer
  streams the column's listed query blocks in 64-row halves (Q, dO, lse₂, delta); the consumers
  compute the transposed tiles Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ and accumulate dV += Pᵀ·dO and
  dK += dSᵀ·Q from registers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src.attention import dropout
from jattn._src.attention.common import Problem
from jattn._src.attention.pallas_mosaic_gpu import BLOCK, CONSUMERS, ROWS
from jattn._src.attention.pallas_mosaic_gpu_tiles import (COLUMN, CONSUMER_REGISTERS,
                                                           OPERAND_COLUMNS, PRODUCER_REGISTERS,
                                                           ROW, BlockLists, float32_transforms,
                                                           heaviest_first, key_blocks,
                                                           load_vector, operand_transforms,
                                                           stream, tile_of)
from jattn._src.constants import LOG2_E
from jattn._src.masks.block_mask import MaskLists
from jattn._src.mesh_axes import kernel_operands, kernel_results, out_struct

KEYS = 64  # keys per consumer warpgroup in the dK/dV kernel
QUERIES = 64  # queries per dK/dV step: half a BlockMask block
DQ_STAGES = {64: 3, 128: 2}  # K/V slots of the dQ kernel by head dim (shared memory)
DKDV_STAGES = 3  # Q/dO slots of the dK/dV kernel
# With flex_attention(deterministic=False), dQ comes from the dK/dV kernel at these head dims:
# five products where the two kernels run seven, but the reduce-adds' order, and so the
# rounding, varies between runs. Each step, each consumer stages dSᵀ in shared memory,
# multiplies the step's dS by K and reduce-adds that part by TMA into a float32 accumulator.
# At head dim 128 the two consumers split the product by head dims, each over all 128 keys
# (FlashAttention-3's split: a [64, 64] accumulator beside dK and dV's, where its own 64 keys
# would need [64, 128]); at 64 each takes its own keys (half of 64 head dims is narrower than
# a shared-memory tile). H100, B4 L4096 full / causal, same run as the two kernels
# (`bench_mosaic_backward --reduce-add-dq`): head dim 64 408 / 367 TFLOP/s against 332 / 315
# (0.99 / 0.98x cuDNN); head dim 128 372 / 335 against 425 / 407, so 128 stays with the two
# kernels: in lockstep at the dSᵀ barrier the consumers' softmax no longer overlaps the other's
# products, and at 64 keys a step the products read shared memory at its bandwidth
# (benchmarks/HISTORY.md, session 36).
REDUCE_ADD_HEAD_DIMS = (64,)


def reduces_dq(p: Problem) -> bool:
    """Whether the call's dQ is reduce-added by the dK/dV kernel (no dQ kernel)."""
    return not p.deterministic and p.E in REDUCE_ADD_HEAD_DIMS


def _split(refs, n_lists: int, n_captures: tuple[int, int, int], n_out: int):
    """(lists, order, (score_mod's, mask_mod's, dropout's captured arrays), outputs)."""
    lists = refs[:n_lists]
    order = refs[n_lists]
    starts = n_lists + 1 + np.cumsum([0, *n_captures])
    captures = tuple(refs[a:b] for a, b in zip(starts[:-1], starts[1:]))
    return lists, order, captures, refs[len(refs) - n_out:]


@dataclasses.dataclass(frozen=True)
class _Tile:
    """One consumer's register tile of scores, either orientation (`query_axis`: the axis
    along which its queries run), starting at the positions `starts` (q0, kv0)."""
    p: Problem
    fns: tuple  # (score_fn, score_vjp, mask_fn, keep_fn), each None where the call has none
    refs: tuple  # (score_refs, mask_refs, dropout_refs)
    b: Any
    h: Any
    starts: tuple
    apply_mask: bool
    query_axis: int

    def _along_queries(self, x, shape):
        return lax.broadcast_in_dim(x, shape, [self.query_axis])

    def probabilities(self, s, lse2):
        """(P, the scaled score before score_mod, the mask or None) of unscaled scores s."""
        p, (score_fn, _, mask_fn, _), (score_refs, mask_refs, _) = self.p, self.fns, self.refs
        raw = s * p.scale
        if score_fn is None:
            # A positive scale folds into the exponent's factor: one multiply per score fewer.
            t, factor = (s, p.scale * LOG2_E) if p.scale > 0 else (raw, LOG2_E)
        else:
            t, factor = score_fn(score_refs, raw, self.b, self.h, *self.starts), LOG2_E
        keep = None
        if self.apply_mask and mask_fn is not None:
            keep = mask_fn(mask_refs, self.b, self.h, *self.starts)
            t = jnp.where(keep, t, -jnp.inf)
        return jnp.exp2(t * factor - self._along_queries(lse2, s.shape)), raw, keep

    def dropout_keep(self):
        """Dropout's mask of the tile (None without dropout)."""
        keep_fn = self.fns[3]
        return None if keep_fn is None else keep_fn(self.refs[2], self.b, self.h, *self.starts)

    def score_gradient(self, prob, raw, keep, dp, delta):
        """dS' = the gradient with respect to the scaled score before score_mod."""
        ds = prob * (dp - self._along_queries(delta, dp.shape))
        score_vjp = self.fns[1]
        if score_vjp is not None:
            ds = score_vjp(self.refs[0], raw, self.b, self.h, *self.starts, ds)
            if keep is not None:
                ds = jnp.where(keep, ds, 0.0)
        return ds


# ------------------------------------------------------------------------------------------------
# dQ
# ------------------------------------------------------------------------------------------------

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs, p: Problem,
               has_full: bool, n_captures, fns, dtype):
    list_refs, order_ref, capture_refs, (dq_ref,) = _split(
        refs, 4 if has_full else 2, n_captures, 1)
    block_q, bkv = BLOCK
    stages = DQ_STAGES[p.E]
    lists = BlockLists(p, list_refs, has_full)
    b, h, row = tile_of(p, order_ref, lax.axis_index("programs"), p.L // block_q)
    owner, partial, steps = lists.walk(b, h, row)

    def slot_of(step):
        return lax.rem(step, jnp.int32(stages))

    def body(q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free):
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            q0 = row * block_q + wg * ROWS
            here = (b, h, pl.ds(q0, ROWS))
            plgpu.copy_gmem_to_smem(q_ref.at[here], q_smem.at[wg], q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[here], do_smem.at[wg], q_ready.at[wg])
            lse2 = load_vector(lse2_ref.at[here], ROW)
            delta = load_vector(delta_ref.at[here], ROW)
            plgpu.barrier_wait(q_ready.at[wg])

            def accumulate(dq_acc):
                def visit(step, apply_mask):
                    slot = slot_of(step)
                    kv0 = lists.block(owner, partial, step) * bkv
                    tile = _Tile(p, fns, capture_refs, b, h, (q0, kv0), apply_mask,
                                 query_axis=0)

                    def products(s_acc, dp_acc):
                        plgpu.barrier_wait(k_ready.at[slot])
                        plgpu.wgmma(s_acc, q_smem.at[wg], k_smem.at[slot].T)
                        plgpu.barrier_wait(v_ready.at[slot])
                        plgpu.wgmma(dp_acc, do_smem.at[wg], v_smem.at[slot].T)
                        # P while dP is computed.
                        prob, raw, keep = tile.probabilities(
                            plgpu.wgmma_accumulator_load(s_acc, wait_n=1), lse2)
                        dp = plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
                        plgpu.barrier_arrive(v_free.at[slot])
                        dp = dropout.dropped(p, tile.dropout_keep(), dp)
                        return tile.score_gradient(prob, raw, keep, dp, delta)

                    shape = plgpu.ACC((ROWS, bkv), jnp.float32)
                    ds = pl.run_scoped(products, shape, shape)
                    plgpu.wgmma(dq_acc, ds.astype(dtype), k_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(k_free.at[slot])

                pl.loop(0, partial)(functools.partial(visit, apply_mask=True))
                if has_full:
                    pl.loop(partial, steps)(functools.partial(visit, apply_mask=False))
                return dq_acc[...]

            dq = pl.run_scoped(accumulate, plgpu.ACC((ROWS, p.E), jnp.float32))
            q_smem.at[wg][...] = (dq * p.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[here])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            stream(steps, 0, key_blocks(p, lists, b, h, owner, partial, bkv), (k_ref, v_ref),
                   (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free))

    transforms = operand_transforms()
    pl.run_scoped(
        lambda buffers, ready, free: body(*buffers, *ready, *free),
        (plgpu.SMEM((CONSUMERS, ROWS, p.E), dtype, transforms=transforms),
         plgpu.SMEM((CONSUMERS, ROWS, p.Ev), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, bkv, p.Ev), dtype, transforms=transforms)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
        collective_axes="wg",
    )


# ------------------------------------------------------------------------------------------------
# dK / dV
# ------------------------------------------------------------------------------------------------

def _step(p: Problem, tile: _Tile, wg, step_refs, k_smem, v_smem, dk_acc, dv_acc, dtype):
    """A consumer's dK/dV step without dQ: Sᵀ, then Pᵀ, then dPᵀ and dV issued together and
    dSᵀ computed while dV runs; dK left in flight."""
    lse_ref, delta_ref, q_tile, do_tile = step_refs

    def products(s_acc, dp_acc):
        plgpu.wgmma(s_acc, k_smem.at[wg], q_tile.T)
        # Pᵀ before dPᵀ starts: with dK and dV held, the two [64, 64] accumulators live at
        # once spill registers (ptxas, head dim 128); the other consumer's products fill the
        # tensor cores.
        prob, raw, keep = tile.probabilities(plgpu.wgmma_accumulator_load(s_acc, wait_n=0),
                                             load_vector(lse_ref, COLUMN))
        plgpu.wgmma(dp_acc, v_smem.at[wg], do_tile.T)
        kept = tile.dropout_keep()
        plgpu.wgmma(dv_acc, dropout.dropped(p, kept, prob).astype(dtype), do_tile)
        dp = dropout.dropped(p, kept, plgpu.wgmma_accumulator_load(dp_acc, wait_n=1))
        return tile.score_gradient(prob, raw, keep, dp, load_vector(delta_ref, COLUMN))

    shape = plgpu.ACC((KEYS, QUERIES), jnp.float32)
    ds = pl.run_scoped(products, shape, shape).astype(dtype)
    plgpu.wgmma(dk_acc, ds, q_tile)


def _reduce_add_step(p: Problem, tile: _Tile, wg, step_refs, k_smem, v_smem, ds_smem, ds_ready,
                     dk_acc, dv_acc, split: bool, dims: int, dtype):
    """A consumer's dK/dV step that also computes its part of the step's dQ (float32,
    returned), in FlashAttention-3's order: Sᵀ and dPᵀ issued together (Pᵀ computed while dPᵀ
    runs), dSᵀ staged in shared memory, dV issued, then, once both consumers' dSᵀ are staged
    (split by head dims), dQ and dK; dK left in flight. Split, the consumers meet at the dSᵀ
    barrier every step, in lockstep (what that costs: benchmarks/HISTORY.md, session 36).
    dims: the head dims of this consumer's dQ part."""
    lse_ref, delta_ref, q_tile, do_tile = step_refs

    def products(s_acc, dp_acc):
        plgpu.wgmma(s_acc, k_smem.at[wg], q_tile.T)
        plgpu.wgmma(dp_acc, v_smem.at[wg], do_tile.T)
        prob, raw, keep = tile.probabilities(plgpu.wgmma_accumulator_load(s_acc, wait_n=1),
                                             load_vector(lse_ref, COLUMN))
        kept = tile.dropout_keep()
        dp = dropout.dropped(p, kept, plgpu.wgmma_accumulator_load(dp_acc, wait_n=0))
        ds = tile.score_gradient(prob, raw, keep, dp, load_vector(delta_ref, COLUMN))
        return dropout.dropped(p, kept, prob).astype(dtype), ds.astype(dtype)

    shape = plgpu.ACC((KEYS, QUERIES), jnp.float32)
    prob, ds = pl.run_scoped(products, shape, shape)
    ds_smem.at[wg][...] = ds
    plgpu.wgmma(dv_acc, prob, do_tile)
    plgpu.commit_smem()
    if split:
        plgpu.barrier_arrive(ds_ready)
        plgpu.barrier_wait(ds_ready)

    def dq_part(dq_acc):
        if split:
            for w in range(CONSUMERS):
                plgpu.wgmma(dq_acc, ds_smem.at[w].T, k_smem.at[w, :, pl.ds(wg * dims, dims)])
        else:
            plgpu.wgmma(dq_acc, ds_smem.at[wg].T, k_smem.at[wg])
        plgpu.wgmma(dk_acc, ds, q_tile)
        return plgpu.wgmma_accumulator_load(dq_acc, wait_n=1)

    return pl.run_scoped(dq_part, plgpu.ACC((QUERIES, dims), jnp.float32))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, *refs, p: Problem,
                 has_full: bool, n_captures, fns, dtype, reduce_dq: bool):
    # With reduce_dq, the inputs end with dq_accum [B, Hq, L, E] float32, which each step's
    # dQ part is added into by a TMA reduce-add (REDUCE_ADD_HEAD_DIMS says which part).
    list_refs, order_ref, capture_refs, outs = _split(
        refs, 4 if has_full else 2, n_captures, 3 if reduce_dq else 2)
    dq_accum_ref, dk_ref, dv_ref = outs if reduce_dq else (None, *outs)
    stages = DKDV_STAGES
    split = p.E // CONSUMERS % OPERAND_COLUMNS == 0  # dQ split by head dims (else by keys)
    dq_dims = p.E // CONSUMERS if split else p.E  # head dims of a consumer's dQ part
    block_q, bkv = BLOCK
    halves = block_q // QUERIES
    lists = BlockLists(p, list_refs, has_full)
    col = order_ref[lax.axis_index("columns")]
    bh = lax.axis_index("heads")
    b, hkv = lax.div(bh, jnp.int32(p.Hkv)), lax.rem(bh, jnp.int32(p.Hkv))

    def slot_of(count):
        return lax.rem(count, jnp.int32(stages))

    def head_walk(g):
        h = hkv * p.groups + g
        return (h, *lists.walk(b, h, col))

    def query_start(owner, partial, step):
        return lists.block(owner, partial, lax.div(step, halves)) * block_q + lax.rem(
            step, halves) * QUERIES

    def body(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
             ds_ready, dq_done, kv_ready, ready, free):
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            kv0 = col * bkv + wg * KEYS
            here = (b, hkv, pl.ds(kv0, KEYS))
            plgpu.copy_gmem_to_smem(k_ref.at[here], k_smem.at[wg], kv_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[here], v_smem.at[wg], kv_ready.at[wg])
            plgpu.barrier_wait(kv_ready.at[wg])

            def accumulate(dk_acc, dv_acc):
                def head(g, done):
                    h, owner, partial, steps = head_walk(g)

                    def visit(step, apply_mask):
                        count = done + step
                        slot = slot_of(count)
                        tile = _Tile(p, fns, capture_refs, b, h,
                                     (query_start(owner, partial, step), kv0), apply_mask,
                                     query_axis=1)
                        step_refs = (lse_smem.at[slot], delta_smem.at[slot], q_smem.at[slot],
                                     do_smem.at[slot])
                        plgpu.barrier_wait(ready.at[slot])
                        if reduce_dq:
                            dq = _reduce_add_step(p, tile, wg, step_refs, k_smem, v_smem,
                                                  ds_smem.at[lax.rem(count, 2)], ds_ready,
                                                  dk_acc, dv_acc, split, dq_dims, dtype)
                            # The last step's reduce-add has read the staging buffer.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            dq_smem.at[wg][...] = dq
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                dq_smem.at[wg],
                                dq_accum_ref.at[b, h, pl.ds(tile.starts[0], QUERIES),
                                                pl.ds(wg * dq_dims if split else 0, dq_dims)],
                                reduction_op="add")
                        else:
                            _step(p, tile, wg, step_refs, k_smem, v_smem, dk_acc, dv_acc,
                                  dtype)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[slot])

                    pl.loop(0, partial * halves)(functools.partial(visit, apply_mask=True))
                    if has_full:
                        pl.loop(partial * halves, steps * halves)(
                            functools.partial(visit, apply_mask=False))
                    return done + steps * halves

                lax.fori_loop(0, p.groups, head, jnp.int32(0))
                if reduce_dq and split:
                    # The other consumer's last dQ product has read this one's K.
                    plgpu.barrier_arrive(dq_done)
                    plgpu.barrier_wait(dq_done)
                return dk_acc[...], dv_acc[...]

            dk, dv = pl.run_scoped(accumulate, plgpu.ACC((KEYS, p.E), jnp.float32),
                                   plgpu.ACC((KEYS, p.Ev), jnp.float32))
            k_smem.at[wg][...] = (dk * p.scale).astype(dtype)
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[here])
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[here])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def head(g, done):
                h, owner, partial, steps = head_walk(g)
                # Q, dO, lse₂ and delta of each step's 64 queries, one barrier for the four
                stream(steps * halves, done,
                       lambda step: (b, h, pl.ds(query_start(owner, partial, step), QUERIES)),
                       (q_ref, do_ref, lse2_ref, delta_ref),
                       (q_smem, do_smem, lse_smem, delta_smem), (ready,) * 4, (free,))
                return done + steps * halves

            lax.fori_loop(0, p.groups, head, jnp.int32(0))

    transforms = operand_transforms()
    # dSᵀ of both consumers in two buffers (steps alternate), their float32 dQ parts, and the
    # barriers that say both have written a step's dSᵀ and both have done their last dQ part.
    staging = ((plgpu.SMEM((2, CONSUMERS, KEYS, QUERIES), dtype, transforms=transforms),
                plgpu.SMEM((CONSUMERS, QUERIES, dq_dims), jnp.float32,
                           transforms=float32_transforms()),
                plgpu.Barrier(num_arrivals=CONSUMERS), plgpu.Barrier(num_arrivals=CONSUMERS))
               if reduce_dq else ())
    pl.run_scoped(
        lambda buffers, staging, kv_ready, ready, free: body(
            *buffers, *(staging or (None,) * 4), kv_ready, ready, free),
        (plgpu.SMEM((CONSUMERS, KEYS, p.E), dtype, transforms=transforms),
         plgpu.SMEM((CONSUMERS, KEYS, p.Ev), dtype, transforms=transforms),
         plgpu.SMEM((stages, QUERIES, p.E), dtype, transforms=transforms),
         plgpu.SMEM((stages, QUERIES, p.Ev), dtype, transforms=transforms),
         plgpu.SMEM((stages, QUERIES), jnp.float32),
         plgpu.SMEM((stages, QUERIES), jnp.float32)),
        staging,
        plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        collective_axes="wg",
    )


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def backward(p: Problem, masks: MaskLists, q, k, v, d_out, lse2, delta, score_captures=(),
             mask_captures=(), dropout_tables=(), fns_dq=(None,) * 4, fns_dkdv=(None,) * 4):
    """(dq, dk, dv) in q's, k's and v's dtypes. masks: the BlockMask's lists; lse2, delta
    [B, Hq, L] float32 from the delta pass; dropout_tables: `dropout.word_tables` with dropout,
    else (); fns_*: (score_fn, score_vjp, mask_fn, keep_fn) as each kernel calls them (the
    captures' refs, the tile's leading arguments, its first query and key positions, and for
    score_vjp the cotangent), each None where the call has none."""
    captures = (*score_captures, *mask_captures, *dropout_tables)
    common = dict(p=p, has_full=masks.has_full, dtype=q.dtype,
                  n_captures=(len(score_captures), len(mask_captures), len(dropout_tables)))

    def launch(body, name, out_type, grid, grid_names):
        return pl.kernel(body, out_type=out_type, name=name,
                         mesh=plgpu.Mesh(grid=grid, grid_names=grid_names,
                                         num_threads=CONSUMERS + 1, thread_name="wg"),
                         compiler_params=plgpu.CompilerParams(approx_math=True))

    # dK/dV: every batch and kv head of the column with the most blocks (over all mask batches
    # and heads) first, and so on.
    q_lists = masks.major("q")
    column_order = heaviest_first(q_lists, masks.has_full, summed_axes=(0, 1))
    dkdv_inputs, axes = kernel_operands(q, k, v, d_out, lse2, delta, *q_lists, column_order,
                                        *captures)
    dkdv = functools.partial(
        launch, out_type=[out_struct(k.shape, k.dtype, dkdv_inputs[0]),
                          out_struct(v.shape, v.dtype, dkdv_inputs[0])],
        grid=(p.B * p.Hkv, p.S // BLOCK[1]), grid_names=("heads", "columns"))
    if reduces_dq(p):
        dq_accum = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        dk, dv = dkdv(functools.partial(_dkdv_kernel, fns=fns_dkdv, reduce_dq=True, **common),
                      "jattn_mosaic_bwd_dkdv_dq")(*dkdv_inputs, dq_accum)
        return kernel_results(((dq_accum[...] * p.scale).astype(q.dtype), dk, dv), axes)
    dk, dv = dkdv(functools.partial(_dkdv_kernel, fns=fns_dkdv, reduce_dq=False, **common),
                  "jattn_mosaic_bwd_dkdv")(*dkdv_inputs)

    # dQ: the rows with the most blocks first, so that the last programs to start are short.
    kv_lists = masks.major("kv")
    row_order = heaviest_first(kv_lists, masks.has_full)
    dq_inputs, _ = kernel_operands(q, k, v, d_out, lse2, delta, *kv_lists, row_order, *captures)
    dq = launch(functools.partial(_dq_kernel, fns=fns_dq, **common), "jattn_mosaic_bwd_dq",
                out_struct(q.shape, q.dtype, dq_inputs[0]), (p.B * p.Hq * (p.L // BLOCK[0]),),
                ("programs",))(*dq_inputs)
    return kernel_results((dq, dk, dv), axes)
