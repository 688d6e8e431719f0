"""A dense flex decoding oracle for tests: the whole [B, H, Lq, S] mask, then the attention oracle.

Written independently of the XLA path's score_mod: the BlockMask is expanded to a dense boolean
mask at each query's position with array indexing, not looked up element by element.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn._src.attention.reference import attention_reference
from jattn._src.masks.block_mask import BlockMask


def _block_mask_at(block_mask: BlockMask, positions: jax.Array, S: int) -> jax.Array:
    """[B, Hm, Lq, S] bool: the BlockMask's verdict for queries at `positions` [B, Lq]."""
    B = positions.shape[0]
    batches, heads = block_mask.shape[:2]
    block_q, block_kv = block_mask.block_size
    rows = jnp.clip(jnp.maximum(positions, 0) // block_q, 0, block_mask.num_blocks[0] - 1)
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(heads)[None, :, None, None]
    kv = jnp.arange(S)[None, None, None, :]
    index = (b if batches > 1 else 0, h, rows[:, None, :, None], kv // block_kv)
    full, partial = block_mask.full_blocks()[index], block_mask.partial_blocks()[index]
    if block_mask.mask_mod is not None:
        partial = partial & block_mask.mask_mod(b, h, positions[:, None, :, None], kv)
    return full | partial


def decode_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                     score_mod: Callable[..., jax.Array] | None = None,
                     block_mask: BlockMask | None = None, *, kv_len: jax.Array | None = None,
                     scale: float | None = None):
    """flex_decode on contiguous k/v [B|1, Hkv, S, E]: (out, natural-log LSE), float32+.

    Query i of sequence b sits at position kv_len[b] - Lq + i (negative: attends to nothing)
    and attends to keys below kv_len[b] that the BlockMask, read at its position, allows.
    """
    B, _, Lq, _ = q.shape
    S = k.shape[2]
    kv_len = jnp.broadcast_to(jnp.asarray(S if kv_len is None else kv_len, jnp.int32), (B,))
    positions = kv_len[:, None] - Lq + jnp.arange(Lq, dtype=jnp.int32)
    attends = ((jnp.arange(S) < kv_len[:, None, None]) & (positions[..., None] >= 0))[:, None]
    if block_mask is not None:
        attends = attends & _block_mask_at(block_mask, positions, S)

    def mod(score, b, h, q_idx, kv_idx):
        position = positions[b, q_idx]
        if score_mod is not None:
            score = score_mod(score, b, h, position, kv_idx)
        return jnp.where(attends, score, -jnp.inf)

    return attention_reference(q, k, v, mod, None, scale=scale)
