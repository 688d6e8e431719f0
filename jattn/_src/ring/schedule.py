"""Which ring steps have work, and which keys: the steps whose (query shard, key shard) pair is
empty on every device are left out of the ring, their transfers with them.

At ring step s device d attends its queries to the keys of device (d − s) mod n. A whole-sequence
BlockMask whose values are known while the ring is traced (built outside the jitted step, as
usual) says which of those pairs visit no block; a step empty on every device sends nothing and
launches nothing. Packed documents that end at shard boundaries leave every step but the first
empty. Where the mask's values are not known (a BlockMask built inside the traced function, or
a mask_mod, whose pairs are built per device) every step runs, empty pairs still launching no
kernel.

Of a step that runs, only the key blocks some device's pair visits travel (a document that
crosses a shard boundary needs its own blocks of the neighbour's shard, not the whole shard),
each step's keys sent straight from the device that holds them; each device's part of their
dK/dV goes straight back to it, its own shard's part staying home. Likewise only the query
blocks some device's pair visits are attended at that step: their rows of q, the output and
the gradients are sliced out and merged back, so the step's kernels and merges cost what its
few blocks do rather than a pass over the whole shard.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jattn._src.masks.block_mask import BlockMask, dense_from_lists
from jattn._src.ring.layout import global_positions


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """steps: the ring steps that run, in order (0 = each device's own shard). everywhere:
    those whose pair visits a block on every device, which need no test of emptiness (on a
    GPU such a test is a conditional whose predicate the host reads). kept: for each step,
    the key blocks of a shard (local block indices, of `block` positions each) that some
    device's pair visits, where that is fewer than all: only those are sent. rows: for each
    step, the query blocks of a shard (of `row_block` positions each) that some device's
    pair visits, where that is fewer than all: only those are attended."""

    steps: tuple[int, ...]
    everywhere: frozenset[int] = frozenset()
    kept: tuple[tuple[int, ...] | None, ...] | None = None
    block: int = 0
    rows: tuple[tuple[int, ...] | None, ...] | None = None
    row_block: int = 0

    def kept_positions(self, i: int) -> np.ndarray | None:
        """The local key positions the i-th step sends (in order), or None: the whole shard."""
        return _positions(None if self.kept is None else self.kept[i], self.block)

    def row_positions(self, i: int) -> np.ndarray | None:
        """The local query positions the i-th step attends (in order), or None: the whole
        shard."""
        return _positions(None if self.rows is None else self.rows[i], self.row_block)


def runs(positions: np.ndarray) -> list[np.ndarray]:
    """Sorted positions split into runs of consecutive ones."""
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


def _positions(blocks: tuple[int, ...] | None, size: int) -> np.ndarray | None:
    if blocks is None:
        return None
    blocks = np.asarray(blocks, np.int32)
    return (blocks[:, None] * size + np.arange(size, dtype=np.int32)).ravel()


def every_step(num_devices: int) -> RingSchedule:
    return RingSchedule(tuple(range(num_devices)))


def _values_known(block_mask: BlockMask | None) -> bool:
    return block_mask is not None and not any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(block_mask))


def _visited_blocks(block_mask: BlockMask, num_devices: int, layout: str):
    """(visited [query blocks, key blocks] of the whole sequence, any batch row or head;
    each device's query block rows; each device's key block columns)."""
    shard = block_mask.seq_lengths[0] // num_devices
    # values known: computed now by numpy (jax ops inside an eager shard_map would run as
    # the map's own)
    n_kv = block_mask.num_blocks[1]
    visited = dense_from_lists(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv, xp=np)
    if block_mask.full_kv_num_blocks is not None:
        visited |= dense_from_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                    n_kv, xp=np)

    def blocks(device: int, size: int) -> np.ndarray:  # the shard's, in the whole sequence
        starts = np.arange(0, shard, size, dtype=np.int32)
        return global_positions(starts, device, num_devices, shard, layout, xp=np) // size

    rows = [blocks(d, block_mask.block_size[0]) for d in range(num_devices)]
    columns = [blocks(d, block_mask.block_size[1]) for d in range(num_devices)]
    return visited.any(axis=(0, 1)), rows, columns


def work_balance(block_mask: BlockMask | None, num_devices: int, layout: str) -> float | None:
    """The most blocks one device's queries visit over the mean (1: equal work), where the
    whole sequence's BlockMask values are known; None where they are not. No BlockMask (no
    mask) is equal work."""
    if block_mask is None:
        return 1.0
    if not _values_known(block_mask):
        return None
    visited, rows, _ = _visited_blocks(block_mask, num_devices, layout)
    work = np.array([visited[r].sum() for r in rows], np.float64)
    return float(work.max() / work.mean()) if work.sum() else 1.0


def visited_share(block_mask: BlockMask | None) -> float | None:
    """The share of the whole sequence's (query block, key block) pairs the mask visits, for
    any batch row or head (1: no mask); None where the BlockMask's values are not known."""
    if block_mask is None:
        return 1.0
    if not _values_known(block_mask):
        return None
    visited, _, _ = _visited_blocks(block_mask, 1, "contiguous")
    return float(visited.mean())


def ring_schedule(block_mask: BlockMask | None, num_devices: int, layout: str) -> RingSchedule:
    """Where some device's pair visits a block of `block_mask` (the whole sequence's, [Bm, Hm,
    L, L]): the steps, those where every device's does, and which key and query blocks;
    every step, whole shards, where there is no BlockMask or its values are traced."""
    if num_devices == 1 or not _values_known(block_mask):
        return every_step(num_devices)
    visited, rows, columns = _visited_blocks(block_mask, num_devices, layout)
    # [step, device, query block of the device's shard, key block of the shard in hand]
    pairs = np.array([[visited[np.ix_(rows[d], columns[(d - step) % num_devices])]
                       for d in range(num_devices)] for step in range(num_devices)])
    work = pairs.any(axis=(2, 3))
    steps = tuple(np.flatnonzero(work.any(axis=1)).tolist())

    def some(step: int, visited_along) -> tuple[int, ...] | None:
        """The blocks that some device's pair visits at `step` (None: all, or the own
        shard's step, which every device has in hand and attends whole)."""
        needed = np.flatnonzero(visited_along)
        return None if step == 0 or needed.size == visited_along.size else tuple(
            needed.tolist())

    return RingSchedule(steps, frozenset(np.flatnonzero(work.all(axis=1)).tolist()),
                        tuple(some(step, pairs[step].any(axis=(0, 1))) for step in steps),
                        block_mask.block_size[1],
                        tuple(some(step, pairs[step].any(axis=(0, 2))) for step in steps),
                        block_mask.block_size[0])
