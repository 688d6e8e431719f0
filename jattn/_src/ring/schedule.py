"""Which ring steps have work: the steps whose (query shard, key shard) pair is empty on every
device are left out of the ring, their transfers with them.

At ring step s device d attends its queries to the keys of device (d − s) mod n. A whole-sequence
BlockMask whose values are known while the ring is traced (built outside the jitted step, as
usual) says which of those pairs visit no block; a step empty on every device sends nothing and
launches nothing: the shard in hand moves on by as many places as the steps skipped. Packed
documents that end at shard boundaries leave every step but the first empty. Where the mask's
values are not known (a BlockMask built inside the traced function, or a mask_mod, whose pairs
are built per device) every step runs, empty pairs still launching no kernel.

Each device's partial dK/dV of another device's shard goes straight back to that device, in
the step after it is computed; its own shard's stays home.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jattn._src.masks.block_mask import BlockMask
from jattn._src.ring.layout import global_positions


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """steps: the ring steps that run, in order (0 = each device's own shard); everywhere: those
    whose pair visits a block on every device, which need no test of emptiness (on a GPU
    such a test is a conditional whose predicate the host reads)."""

    steps: tuple[int, ...]
    everywhere: frozenset[int] = frozenset()


def every_step(num_devices: int) -> RingSchedule:
    return RingSchedule(tuple(range(num_devices)))


def ring_schedule(block_mask: BlockMask | None, num_devices: int, layout: str) -> RingSchedule:
    """The ring steps (0 = each device's own shard) at which some device's pair visits a block
    of `block_mask` (the whole sequence's, [Bm, Hm, L, L]), and those at which every device's
    does; every step, none known non-empty, where there is no BlockMask or its values are
    traced."""
    if block_mask is None or num_devices == 1 or any(
            isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(block_mask)):
        return every_step(num_devices)
    shard = block_mask.seq_lengths[0] // num_devices
    with jax.ensure_compile_time_eval():  # (values known: computed now, not staged)
        visited = np.asarray(block_mask.partial_blocks() | block_mask.full_blocks())

        def blocks(device: int, size: int) -> np.ndarray:  # the shard's, in the whole sequence
            starts = np.arange(0, shard, size, dtype=np.int32)
            return np.asarray(global_positions(starts, device, num_devices, shard, layout)
                              ) // size

        rows = [blocks(d, block_mask.block_size[0]) for d in range(num_devices)]
        columns = [blocks(d, block_mask.block_size[1]) for d in range(num_devices)]
    visited = visited.any(axis=(0, 1))
    work = np.array([[visited[np.ix_(rows[d], columns[(d - step) % num_devices])].any()
                      for d in range(num_devices)] for step in range(num_devices)])
    return RingSchedule(tuple(np.flatnonzero(work.any(axis=1)).tolist()),
                        frozenset(np.flatnonzero(work.all(axis=1)).tolist()))
