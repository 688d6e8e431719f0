"""Checks of the arguments that ring_flex_attention and sharded_flex_attention share."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jattn._src.masks.block_mask import BlockMask, check_block_counts


def checked_token_arrays(fn: str, token_arrays: Sequence[jax.Array], length: int,
                         last_axis: str) -> list[jax.Array]:
    """token_arrays as arrays, each with `length` positions on its last axis and an integer or
    bool dtype; `last_axis` says, in the error, what that axis must be."""
    tokens = [jnp.asarray(x) for x in token_arrays]
    for i, x in enumerate(tokens):
        if x.ndim == 0 or x.shape[-1] != length:
            raise ValueError(f"{fn}: token_arrays[{i}] has shape {x.shape}; a per-token array "
                             f"{last_axis}.")
        if jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{fn}: token_arrays[{i}] is {x.dtype}; per-token arrays are "
                            "integer or bool (document ids, positions) and get no gradient. "
                            "Close over a float array in the mod instead (replicated).")
    return tokens


def mask_mod_of(fn: str, mask_mod: Callable[..., jax.Array] | None,
                block_mask: BlockMask | None, whole: str) -> Callable[..., jax.Array] | None:
    """The call's mask_mod: the one given, or the given BlockMask's (of the `whole` sequence or
    arrays); never both given."""
    if block_mask is None:
        return mask_mod
    if mask_mod is not None:
        raise ValueError(f"{fn}: give mask_mod or block_mask, not both (a BlockMask carries "
                         "its mask_mod).")
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{fn}: `block_mask` must be a jattn.BlockMask of the whole {whole}, "
                        f"got {type(block_mask).__name__}.")
    return block_mask.mask_mod


def check_whole_mask(fn: str, block_mask: BlockMask | None, q, num_devices: int,
                     layout: str) -> None:
    """A whole-sequence BlockMask fits the call: built for (B|1, Hq|1, L, L), its blocks
    tiling each shard (each half shard for zigzag)."""
    if block_mask is None:
        return
    (B, Hq, Lc, _), L = q.shape, num_devices * q.shape[2]
    check_block_counts(block_mask, fn)
    Bm, Hm, Lm, Sm = block_mask.shape
    if (Lm, Sm) != (L, L) or Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"{fn}: block_mask must be built for the whole sequence, (B|1, "
                         f"Hq|1, L, L) = ({B}|1, {Hq}|1, {L}, {L}) over {num_devices} shards "
                         f"of {Lc}; it has shape {block_mask.shape}.")
    chunk = Lc // 2 if layout == "zigzag" else Lc
    if any(chunk % size for size in block_mask.block_size):
        raise ValueError(f"{fn}: block_mask's blocks {block_mask.block_size} must tile each "
                         f"{layout} chunk of {chunk} positions; build it with a block_size "
                         f"dividing {chunk}.")
