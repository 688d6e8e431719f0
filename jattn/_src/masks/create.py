"""Building BlockMasks and dense masks from a mask_mod, on the device and memory-bounded."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jattn._src.masks.block_mask import BlockMask, MaskMod, _pair
from jattn._src.tiling import cdiv

# Mask elements evaluated per step of create_block_mask (~128 MiB of bool if XLA materialised
# them; it fuses the comparison into the block reduction, so usually far less).
_CHUNK_ELEMENTS = 1 << 27


def _index_grids(B: int, H: int):
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(H, dtype=jnp.int32)[None, :, None, None]
    return b, h


def _evaluate(mask_mod: MaskMod, b, h, q_idx, kv_idx, shape) -> jax.Array:
    out = mask_mod(b, h, q_idx, kv_idx)
    if not hasattr(out, "dtype") or out.dtype != jnp.bool_:
        raise TypeError(f"mask_mod must return a bool array, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}; compare instead "
                        "(e.g. `q_idx >= kv_idx`).")
    return jnp.broadcast_to(out, shape)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _block_tables(mask_mod: MaskMod, B: int, H: int, q_len: int, kv_len: int, block_q: int,
                  block_kv: int):
    """[B, H, nQ, nKV] tables of partial and full blocks, a few query blocks per step."""
    n_q, n_kv = cdiv(q_len, block_q), cdiv(kv_len, block_kv)
    rows = max(1, min(n_q, _CHUNK_ELEMENTS // (B * H * block_q * n_kv * block_kv)))
    b, h = _index_grids(B, H)
    kv = jnp.arange(n_kv * block_kv, dtype=jnp.int32)[None, None, None, :]
    kv_in = kv < kv_len

    def step(first_row):
        q = first_row * block_q + jnp.arange(rows * block_q, dtype=jnp.int32)[None, None, :, None]
        q_in = q < q_len
        # Out-of-range positions are evaluated at the last valid index (a captured array never
        # sees an index past its end) and then count as "attends" for fullness, "not" for any.
        attends = _evaluate(mask_mod, b, h, jnp.minimum(q, q_len - 1),
                            jnp.minimum(kv, kv_len - 1), (B, H, rows * block_q, kv.shape[-1]))
        valid = q_in & kv_in
        blocks = (B, H, rows, block_q, n_kv, block_kv)
        any_ = (attends & valid).reshape(blocks).any(axis=(3, 5))
        all_ = (attends | ~valid).reshape(blocks).all(axis=(3, 5))
        return any_, all_

    starts = jnp.arange(0, n_q, rows, dtype=jnp.int32)
    any_, all_ = lax.map(step, starts)  # [steps, B, H, rows, nKV]

    def stitch(x):
        return jnp.moveaxis(x, 0, 2).reshape(B, H, -1, n_kv)[:, :, :n_q]

    any_, all_ = stitch(any_), stitch(all_)
    return any_ & ~all_, all_


def _check_sizes(fn: str, B, H, Q_LEN, KV_LEN) -> tuple[int, int, int, int]:
    sizes = []
    for name, value, optional in (("B", B, True), ("H", H, True), ("Q_LEN", Q_LEN, False),
                                  ("KV_LEN", KV_LEN, False)):
        if value is None and optional:
            value = 1
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: `{name}` must be a positive int"
                             f"{' or None' if optional else ''}, got {value!r}.")
        sizes.append(value)
    return tuple(sizes)


def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      *, block_size: int | tuple[int, int] = 128) -> BlockMask:
    """The BlockMask of `mask_mod(b, h, q_idx, kv_idx) -> bool` for a [B, H, Q_LEN, KV_LEN] score.

    B or H None (or 1) broadcasts over batches or heads. mask_mod is evaluated on the default
    device in steps of a few query blocks, never holding the dense Q_LEN x KV_LEN mask. Index
    arguments are int32 arrays that broadcast to [B, H, q, kv].
    """
    B, H, Q_LEN, KV_LEN = _check_sizes("create_block_mask", B, H, Q_LEN, KV_LEN)
    block_size = _pair("block_size", block_size)
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: `mask_mod` must be callable, got {mask_mod!r}.")
    partial, full = _block_tables(mask_mod, B, H, Q_LEN, KV_LEN, *block_size)
    return BlockMask.from_dense_blocks(partial, full, block_size=block_size,
                                       seq_lengths=(Q_LEN, KV_LEN), mask_mod=mask_mod)


def create_mask(mask_mod: MaskMod, B: int | None, H: int | None, Q_LEN: int,
                KV_LEN: int) -> jax.Array:
    """The dense [B, H, Q_LEN, KV_LEN] bool mask (for tests and debugging: O(L·S) memory)."""
    B, H, Q_LEN, KV_LEN = _check_sizes("create_mask", B, H, Q_LEN, KV_LEN)
    b, h = _index_grids(B, H)
    q = jnp.arange(Q_LEN, dtype=jnp.int32)[None, None, :, None]
    kv = jnp.arange(KV_LEN, dtype=jnp.int32)[None, None, None, :]
    return _evaluate(mask_mod, b, h, q, kv, (B, H, Q_LEN, KV_LEN))
