"""The BlockMask of a device's part of a context-parallel call: built from its bound mask_mod,
or cut along batch and heads from the BlockMask of the whole call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax import lax

from jattn._src.masks.block_mask import BlockMask
from jattn._src.masks.create import create_block_mask
from jattn._src.ring.pair import uses_batch_or_head


def built(mask: Callable[..., jax.Array] | None, B: int, H: int, L: int, S: int,
          block_size: int) -> BlockMask | None:
    """A BlockMask of (B, H, L, S) built from `mask`, with batch and head axes only where it
    reads them (None without a mask: every key attends)."""
    if mask is None:
        return None
    uses_b, uses_h = uses_batch_or_head(mask)
    return create_block_mask(mask, B if uses_b else None, H if uses_h else None, L, S,
                             block_size=block_size)


def sliced(whole: BlockMask, mask: Callable[..., jax.Array] | None, *,
           batch: tuple | None = None, heads: tuple | None = None) -> BlockMask:
    """The (start, size) `batch` rows and `heads` of `whole` (a traced start is fine; an axis
    of one is shared as it is), reading `mask`."""
    Bm, Hm = whole.shape[:2]

    def cut(x):
        if batch is not None and Bm > 1:
            x = lax.dynamic_slice_in_dim(x, *batch, 0)
        if heads is not None and Hm > 1:
            x = lax.dynamic_slice_in_dim(x, *heads, 1)
        return x

    # (its mask_mod's own arrays are not the lists': they go with it)
    lists = jax.tree.map(cut, dataclasses.replace(whole, mask_mod=None))
    return dataclasses.replace(lists, mask_mod=mask)
