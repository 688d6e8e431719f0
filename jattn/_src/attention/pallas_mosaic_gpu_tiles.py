"""What the Mosaic GPU kernels share: the order of their BlockMask rows or columns (heaviest
first), which (batch, head, row) a query tile is, the walk of a row's or column's block lists,
the producers' TMA streaming into a ring of slots, operand tiles in shared memory, and vector
loads in a wgmma register layout."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn._src.attention.common import Problem

ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector along a register tile's rows (axis 0)
COLUMN = plgpu.Layout.WGMMA.reduce(0)  # a vector along its columns (axis 1)
SWIZZLE = 128  # bytes; with (8, 64)-element tiles, wgmma's operand layout in shared memory
OPERAND_COLUMNS = SWIZZLE // 2  # a 16-bit operand tile's columns: one swizzle span
# Registers per thread of the consumer warpgroups and of the producer (the SM's 64K).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def operand_transforms():
    """The shared-memory transforms of a 16-bit wgmma operand tile."""
    return (plgpu.TilingTransform((8, OPERAND_COLUMNS)), plgpu.SwizzleTransform(SWIZZLE))


def float32_transforms():
    """The shared-memory transforms of float32 staging, swizzled as the operand tiles are (a
    row of SWIZZLE // 4 float32 is one swizzle span): a register tile's stores avoid bank
    conflicts."""
    return (plgpu.TilingTransform((8, SWIZZLE // 4)), plgpu.SwizzleTransform(SWIZZLE))


def tile_of(p: Problem, order_ref, t, rows: int):
    """(b, h, row) of query tile t, the tiles in `order_ref`'s order of BlockMask rows (`rows`
    per mask batch and head). Each row stands for the tiles of every batch and head it is
    shared by, heads varying fastest."""
    shared_b = 1 if p.mask_batch > 1 else p.B
    shared_h = 1 if p.mask_heads > 1 else p.Hq
    entry = order_ref[lax.div(t, shared_b * shared_h)]
    shared = lax.rem(t, shared_b * shared_h)
    b = lax.div(entry, p.mask_heads * rows) if p.mask_batch > 1 else lax.div(shared, shared_h)
    h = lax.rem(lax.div(entry, rows), p.mask_heads) if p.mask_heads > 1 else lax.rem(shared,
                                                                                     shared_h)
    return b, h, lax.rem(entry, rows)


def paired_tile_of(p: Problem, order_ref, t, rows: int):
    """(b, h, row) of query tile t in the paired order: batch and head slowest, then the
    `paired` order of their BlockMask's rows (`rows` per mask batch and head)."""
    line, j = lax.div(t, rows), lax.rem(t, rows)
    b, h = lax.div(line, p.Hq), lax.rem(line, p.Hq)
    mask_line = ((b if p.mask_batch > 1 else 0) * p.mask_heads
                 + (h if p.mask_heads > 1 else 0))
    return b, h, order_ref[mask_line * rows + j]


def _blocks(lists, has_full: bool):
    """Each BlockMask line's listed blocks, partial and full: [mask batch, mask heads, lines]."""
    return lists[0] + lists[2] if has_full else lists[0]


def paired(lists, has_full: bool):
    """The int32 order, per mask batch and head, of a kernel's BlockMask rows taken in pairs:
    the heaviest and the lightest, then the second heaviest and the second lightest, and so
    on. Consecutive pairs carry about equal work (a causal mask's pairs exactly), and the
    programs running at once read the K/V of a few heads, which stay in L2."""
    steps = _blocks(lists, has_full)
    rows = steps.shape[-1]
    j = np.arange(rows)
    position = np.where(j % 2 == 0, j // 2, rows - 1 - j // 2)
    by_weight = jnp.argsort(-steps, axis=-1, stable=True)
    return by_weight[..., position].reshape(-1).astype(jnp.int32)


def heaviest_first(lists, has_full: bool, summed_axes: tuple[int, ...] = ()):
    """The int32 order of a kernel's BlockMask lines (one orientation's [counts, indices, full
    counts, full indices]), the lines with the most blocks first (stable), after summing the
    counts over `summed_axes` (lines shared by several mask batches or heads)."""
    steps = _blocks(lists, has_full)
    if summed_axes:
        steps = steps.sum(axis=summed_axes)
    return jnp.argsort(-steps.reshape(-1), stable=True).astype(jnp.int32)


# The forward's tile orders (`tile_order`): consecutive tiles in the heaviest-first order of
# rows, heads in turn; dealt round the programs in that order; consecutive in the paired order.
CONSECUTIVE, DEALT, PAIRED = 0, 1, 2
# Rows whose blocks vary by more than this (standard deviation over mean) are paired.
UNEVEN_ROWS = 0.25


def tile_order(lists, has_full: bool, order, pairs, *, batch_heads: tuple[int, int],
               groups: tuple[int, int], sms: int):
    """How programs take the tiles: int32 [1] holding CONSECUTIVE, DEALT or PAIRED, from the
    BlockMask's counts (`groups`: tiles per program paired, and otherwise). Where rows differ
    in work (causal, documents), paired tiles (`paired`: heaviest with lightest, head by head)
    balance the programs and keep a few heads' K/V in L2; where they have about equal work
    (full, sliding windows), the rows in order with the heads in turn keep neighbouring rows'
    K/V in L2 instead. Either gives way to dealing (program p takes tiles p, p + programs, ...
    heaviest first) where that is clearly faster by the time each would take, as where a few
    rows hold most of the work in one wave of programs. A tile counts its blocks plus one
    (loading its queries, storing its output)."""
    steps = (_blocks(lists, has_full) + 1).astype(jnp.float32)
    batch, heads = batch_heads
    tiles = batch * heads * steps.shape[-1]

    def programs(work, group, dealt=False):
        """Each program's work: `group` consecutive tiles of `work`, or dealt round them."""
        count = -(-tiles // group)
        work = jnp.zeros(count * group, jnp.float32).at[:tiles].set(work.reshape(-1))
        return (work.reshape(group, count).sum(axis=0) if dealt
                else work.reshape(count, group).sum(axis=1))

    uneven = steps.std() > UNEVEN_ROWS * steps.mean()
    # `pairs` holds row numbers within each mask batch and head.
    paired_work = jnp.broadcast_to(
        jnp.take_along_axis(steps, pairs.reshape(steps.shape), axis=-1),
        (batch, heads, steps.shape[-1]))
    heaviest_work = jnp.repeat(steps.reshape(-1)[order], tiles // steps.size,
                               total_repeat_length=tiles)
    paired_group, group = groups
    consecutive = jnp.where(uneven, _makespan(programs(paired_work, paired_group), sms),
                            _makespan(programs(heaviest_work, group), sms))
    dealt = _makespan(programs(heaviest_work, group, dealt=True), sms)
    # Dealing gives up some L2 reuse: it must be clearly faster.
    mode = jnp.where(1.05 * dealt < consecutive, DEALT, jnp.where(uneven, PAIRED, CONSECUTIVE))
    return mode.astype(jnp.int32).reshape(1)


def _makespan(program_work, sms: int):
    """The time of programs of `program_work` run in order on `sms` SMs, each starting as one
    frees: in waves, wave k + 1's programs going (heaviest first) to the SMs that wave k
    loaded least, which for programs of decreasing work is the wave reversed."""
    waves = -(-program_work.size // sms)
    loads = jnp.zeros(waves * sms, jnp.float32).at[:program_work.size].set(
        program_work).reshape(waves, sms)
    loads = loads.at[1::2].set(loads[1::2, ::-1])
    return loads.sum(axis=0).max()


class BlockLists:
    """One orientation's BlockMask lists in a kernel ([counts, indices], then the full ones):
    a row's (or column's) partial blocks first, then its full ones."""

    def __init__(self, p: Problem, refs, has_full: bool):
        self.p, self.refs, self.has_full = p, refs, has_full

    def walk(self, b, h, index):
        """The list owner of batch b, head h and row (or column) `index`, its partial-block
        count and its step count."""
        owner = (b if self.p.mask_batch > 1 else 0, h if self.p.mask_heads > 1 else 0, index)
        partial = self.refs[0][owner]
        return owner, partial, partial + (self.refs[2][owner] if self.has_full else 0)

    def block(self, owner, partial, step):
        """The block index of step `step` of the owner's walk."""
        if not self.has_full:
            return self.refs[1][(*owner, step)]
        # Both reads stay inside the lists: step < partial + full <= the list's length.
        return jnp.where(step < partial, self.refs[1][(*owner, step)],
                         self.refs[3][(*owner, jnp.maximum(step - partial, 0))])


def stream(steps, done, at, sources, slots, ready, free):
    """The producer's loads, by TMA into a ring of shared-memory slots, of `steps` tiles
    numbered from `done` on: tile `step` of each of `sources` (refs in global memory), at the
    index `at(step)`, into its `slots` with its `ready` barriers, a slot reused once its `free`
    barriers say the consumers are done with it."""
    stages = slots[0].shape[0]

    @pl.loop(0, steps)
    def _(step):
        count = done + step
        slot = lax.rem(count, jnp.int32(stages))

        @pl.when(count >= stages)
        def _():
            for barrier in free:
                plgpu.barrier_wait(barrier.at[slot])

        index = at(step)
        for source, slot_refs, barrier in zip(sources, slots, ready):
            plgpu.copy_gmem_to_smem(source.at[index], slot_refs.at[slot], barrier.at[slot])


def key_blocks(p: Problem, lists: BlockLists, b, h, owner, partial, block_kv: int):
    """`stream`'s index of each step of a BlockMask row's walk: the K/V block of batch b and
    query head h it lists."""
    kv_b = b if p.kv_batch > 1 else 0
    kv_h = lax.div(h, jnp.int32(p.groups))
    return lambda step: (kv_b, kv_h,
                         pl.ds(lists.block(owner, partial, step) * block_kv, block_kv))


def load(ref, layout, *, optimized: bool = False):
    """A ref's values in registers, in `layout`."""
    # jax 0.11 takes the ref alone (an index beside it is deprecated); 0.10 needs one.
    index = inspect.signature(plgpu.load).parameters["idx"].default
    return plgpu.load(ref, *([()] if index is inspect.Parameter.empty else []), layout=layout,
                      optimized=optimized)


def load_vector(ref, layout):
    """A 1-D ref's values in registers, in `layout` (ROW or COLUMN)."""
    return load(ref, layout)
