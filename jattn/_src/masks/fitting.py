"""Any BlockMask torch accepts, fitted to the kernels' tiles with the same attention.

The kernels walk tiles of at least 16 queries and keys, and a mask block must hold whole
tiles: a multiple of 16. torch accepts more: blocks larger than the sequence (BLOCK_SIZE=256
for 64 tokens) and small ones (BLOCK_SIZE=(1, 64) in its decoding tests). `fitted` maps such a
mask onto legal blocks:

- a block longer than its sequence holds the whole sequence: it becomes the shortest legal
  block that still does (the lists are unchanged: one block along that axis);
- other blocks that are not a multiple of 16 are grouped, `lcm(block, 16)` per group. A group
  is full where all its blocks were, empty where all were, partial otherwise; its mask_mod
  looks up each position's original block (`_BlockKinds`): full attends, empty does not,
  partial asks the mask's own mask_mod. Every pair attends as it did.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jattn._src.constants import MIN_DOT_TILE
from jattn._src.masks.block_mask import DEFAULT_BLOCK, BlockMask, MaskMod
from jattn._src.tiling import cdiv, next_power_of_two

# Block kinds in the int8 table the grouped mask's mask_mod reads.
_EMPTY, _PARTIAL, _FULL = 0, 1, 2


def legal_block(block: int, length: int) -> int:
    """The block the kernels use for `block` on a sequence of `length`: a multiple of 16."""
    if block >= length:  # one block holds the sequence: the shortest legal one that does
        return min(cdiv(block, MIN_DOT_TILE) * MIN_DOT_TILE,
                   max(DEFAULT_BLOCK, next_power_of_two(length)))
    return math.lcm(block, MIN_DOT_TILE)


_LEGAL = "legal"  # `fitted`'s memo on a mask whose blocks the kernels take as they are


def fitted(mask: BlockMask) -> BlockMask:
    """`mask` with legal blocks (module docstring); itself when they already are. An eager
    mask keeps its fitted twin (made once, however often it is used)."""
    known = mask.__dict__.get("_fitted")
    if known is not None:
        return mask if known is _LEGAL else known
    blocks = tuple(legal_block(b, n) for b, n in zip(mask.block_size, mask.seq_lengths))
    result = mask if blocks == tuple(mask.block_size) else _fitted(mask, blocks)
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(result)):
        # (not a value of a trace in progress; a legal mask keeps a marker, not itself)
        object.__setattr__(mask, "_fitted", _LEGAL if result is mask else result)
    return result


def _fitted(mask: BlockMask, blocks: tuple[int, int]) -> BlockMask:
    groups = [1 if old >= length else new // old for new, old, length in zip(
        blocks, mask.block_size, mask.seq_lengths)]
    if groups == [1, 1]:  # only blocks past the sequence: the lists stand
        return dataclasses.replace(mask, block_size=blocks)
    kinds = (mask.partial_blocks().astype(jnp.int8) * _PARTIAL
             + mask.full_blocks().astype(jnp.int8) * _FULL)
    attends = _grouped(kinds != _EMPTY, groups, jnp.any, False)
    full = _grouped(kinds == _FULL, groups, jnp.all, True)
    return BlockMask.from_dense_blocks(
        attends & ~full, full, block_size=blocks, seq_lengths=mask.seq_lengths,
        mask_mod=_BlockKinds(kinds, tuple(mask.block_size), mask.mask_mod))


def _grouped(table: jax.Array, groups: list[int], reduce, neutral: bool) -> jax.Array:
    """[..., nQ, nKV] reduced over groups of rows and columns; a ragged last group is padded
    with `neutral`."""
    *lead, n_q, n_kv = table.shape
    (gq, gk) = groups
    rows, columns = cdiv(n_q, gq), cdiv(n_kv, gk)
    padded = jnp.pad(table, [(0, 0)] * len(lead) + [(0, rows * gq - n_q),
                                                    (0, columns * gk - n_kv)],
                     constant_values=neutral)
    return reduce(padded.reshape(*lead, rows, gq, columns, gk), axis=(-3, -1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _BlockKinds:
    """A grouped mask's mask_mod: each position as its original block says (see module)."""

    kinds: jax.Array  # [Bm, Hm, nQ, nKV] int8, of the original blocks
    block_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    mask_mod: MaskMod | None = None
    mod_name = "jattn's grouping of small BlockMask blocks"

    def __call__(self, b, h, q_idx, kv_idx):
        batches, heads = self.kinds.shape[:2]
        kind = self.kinds[0 if batches == 1 else b, 0 if heads == 1 else h,
                          q_idx // self.block_size[0], kv_idx // self.block_size[1]]
        attends = kind == _FULL
        partial = kind == _PARTIAL
        if self.mask_mod is not None:
            partial = partial & self.mask_mod(b, h, q_idx, kv_idx)
        return attends | partial
